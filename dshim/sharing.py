"""What a shared store says of its instances and their bots (``GET /status``,
``dshim status``): every live instance with the bots it holds, and every bot's lease
with its owner, epoch and how long it still runs (the database's clock)."""

from __future__ import annotations

import math
from typing import Any

from dshim.store.base import SharesBots

__all__ = ["sharing_report", "sharing_table"]


async def sharing_report(store: SharesBots, *, within_s: float) -> dict[str, Any]:
    """The instances seen within ``within_s`` and every lease, as JSON-ready data."""
    instances = await store.instances(within_s=within_s)
    leases = await store.leases()
    now = max([i.seen_at for i in instances] or [0.0])
    by_owner: dict[str, list[str]] = {}
    rows = []
    for lease in sorted(leases, key=lambda le: le.bot):
        left = lease.expires_at - now if now else math.nan
        held = bool(lease.owner) and (not now or left > 0)
        if held:
            by_owner.setdefault(lease.owner, []).append(lease.bot)
        rows.append(
            {
                "bot": lease.bot,
                "owner": lease.owner if held else None,
                "epoch": lease.epoch,
                "expires_in_s": round(left, 1) if not math.isnan(left) else None,
            }
        )
    return {
        "instances": [
            {
                "name": i.name,
                "started_at": i.started_at,
                "seen_s_ago": round(now - i.seen_at, 1),
                "bots": by_owner.get(i.name, []),
            }
            for i in sorted(instances, key=lambda i: i.name)
        ],
        "leases": rows,
    }


def sharing_table(report: dict[str, Any]) -> str:
    """The report as two plain tables (``dshim status``)."""
    lines = ["instance  seen (s ago)  bots"]
    for i in report["instances"]:
        lines.append(f"{i['name']}  {i['seen_s_ago']:.1f}  {', '.join(i['bots']) or '-'}")
    lines += ["", "bot  owner  epoch  lease runs out in (s)"]
    for row in report["leases"]:
        left = row["expires_in_s"]
        lines.append(
            f"{row['bot']}  {row['owner'] or '(free)'}  {row['epoch']}  "
            f"{'-' if left is None else f'{left:.1f}'}"
        )
    return "\n".join(lines)
