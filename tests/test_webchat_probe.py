"""``dshim probe`` for a web chat bot: identity, the page's files, the store, the send test.

There is no platform to reach: the send test writes a message into the log of the last
direct conversation, where the page shows it with the history the next time it joins.
"""

from __future__ import annotations

from pathlib import Path

import trio

from dshim.probe import ProbeRow, _probe
from dshim.store import open_store

DEADLINE = 20


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "dshim.toml"
    path.write_text(
        f'[dshim]\ndata_dir = "{tmp_path / "data"}"\n\n'
        '[[bots]]\nname = "web"\nchannel = "webchat"\ndisplay_name = "helper"\n',
        encoding="utf-8",
    )
    return path


def by_check(rows: list[ProbeRow]) -> dict[str, ProbeRow]:
    return {r.check: r for r in rows}


async def test_a_web_chat_bot_passes_its_probe(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        rows, code = await _probe(write_config(tmp_path), None, "web", False)
    checks = by_check(rows)
    assert code == 0
    assert checks["web: credentials"].result == "ok"
    assert checks["web: identity"].detail == "helper (id bot:web)"
    assert checks["web: page"].result == "ok" and "app.js" in checks["web: page"].detail
    assert checks["web: store"].result == "ok"


async def test_the_send_test_lands_in_the_last_direct_conversation(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    with trio.fail_after(DEADLINE):
        rows, code = await _probe(config, None, "web", True)
        assert code == 0 and by_check(rows)["web: send test"].result == "warn"  # none yet
        async with open_store(tmp_path / "data") as store:
            await store.set_last_direct("web", "c-1", now=1_790_000_000.0)
        rows, code = await _probe(config, None, "web", True)
        async with open_store(tmp_path / "data") as store:
            [logged] = await store.message_log("web", "c-1", limit=10)
    assert code == 0
    assert by_check(rows)["web: send test"].result == "ok"
    assert logged.author_bot and logged.author_id == "bot:web" and logged.author_name == "helper"
    assert logged.text.startswith("✅ dshim connection test")
