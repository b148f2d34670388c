"""The status of the process's bots, as ``/readyz`` and ``dshim_bot_up`` report it.

``dshim serve`` keeps one :class:`BotStatuses` per process.  Its supervisor moves each
enabled bot through the states, in this order or back:

- ``starting``: registered, the channel is authenticating (also after a restart's wait);
- ``up``: the channel reported started (``task_status.started()``: authenticated, the
  pipeline open);
- ``backoff``: the bot failed or its reader ended; it restarts at the time in ``detail``;
- ``stopped``: it ended for good — a fatal error or a bug (the reason in ``detail``), or
  the shutdown;
- ``elsewhere``: with a store several instances share, another instance holds the bot's
  lease and runs it (this one takes it over when that one stops renewing).

The process is ready when the store is open and every enabled bot is ``up`` (or
``elsewhere``: it is up in the instance that holds it).  Details are
redacted before they are kept (an error message never carries a secret out).
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from dshim.log import redact

__all__ = ["BotState", "BotStatus", "BotStatuses", "iso_time"]

BotState = Literal["starting", "up", "backoff", "stopped", "elsewhere"]
#: Details are cut to this many characters.
DETAIL_MAX = 300


def iso_time(epoch: float) -> str:
    """Epoch seconds as ISO 8601 UTC with a ``Z`` (millisecond precision)."""
    moment = datetime.datetime.fromtimestamp(epoch, tz=datetime.UTC)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(slots=True)
class BotStatus:
    """One bot's state since a time (epoch seconds), with a detail for people."""

    name: str
    channel: str
    state: BotState
    since: float
    detail: str = ""

    def as_json(self) -> dict[str, str]:
        return {
            "name": self.name,
            "channel": self.channel,
            "state": self.state,
            "since": iso_time(self.since),
            "detail": self.detail,
        }


class BotStatuses:
    """Per-process bot states (see the module docstring).  ``clock``: epoch seconds."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._bots: dict[str, BotStatus] = {}
        #: Set while the store is open.
        self.store_open = False

    def _set(self, name: str, state: BotState, detail: str, channel: str | None = None) -> None:
        old = self._bots.get(name)
        status = BotStatus(
            name=name,
            channel=channel if channel is not None else (old.channel if old else ""),
            state=state,
            since=self._clock(),
            detail=redact(detail)[:DETAIL_MAX],
        )
        self._bots[name] = status

    def starting(self, name: str, channel: str, detail: str = "") -> None:
        self._set(name, "starting", detail, channel)

    def up(self, name: str) -> None:
        self._set(name, "up", "")

    def backoff(self, name: str, *, retry_at: float, reason: str) -> None:
        self._set(name, "backoff", f"retry at {iso_time(retry_at)} after: {reason}")

    def stopped(self, name: str, reason: str) -> None:
        self._set(name, "stopped", reason)

    def elsewhere(self, name: str, detail: str) -> None:
        self._set(name, "elsewhere", detail)

    def get(self, name: str) -> BotStatus | None:
        return self._bots.get(name)

    def all(self) -> list[BotStatus]:
        return list(self._bots.values())

    def up_flags(self) -> list[tuple[str, bool]]:
        """``(bot, up)`` for every bot (the ``dshim_bot_up`` gauge)."""
        return [(s.name, s.state == "up") for s in self._bots.values()]

    @property
    def ready(self) -> bool:
        return self.store_open and all(s.state in ("up", "elsewhere") for s in self._bots.values())

    def readyz(self) -> tuple[int, bytes]:
        """``/readyz``: 200 when ready, else 503; the body lists every bot."""
        body = json.dumps([s.as_json() for s in self._bots.values()], separators=(",", ":"))
        return (200 if self.ready else 503), body.encode()
