"""What the fault-matrix tests of every channel share (issue 27's matrix): the four
outages an answer must survive with nothing lost, and the log records that would show
the bot itself restarted (a send failure is the turn's, never the bot's)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def matrix(sends: Sequence[str]) -> list[tuple[str, tuple[str, ...]]]:
    """(kind, ops) of the fake's ``outage``: ``()`` is every call, ``sends`` only those."""
    only = tuple(sends)
    return [
        ("500", ()),  # 500 on every call
        ("drop", ()),  # every connection dropped before processing
        ("500", only),  # 500 on sends
        ("drop", only),  # sends dropped before processing
    ]


def restarts(logs: Sequence[Mapping[str, Any]]) -> list[object]:
    """The ``*_restarting`` records among captured logs (none may appear)."""
    return [e["event"] for e in logs if str(e["event"]).endswith("_restarting")]
