"""Helpers of the WhatsApp channel that other channels could use (candidates for the kit).

:func:`close_jobs` is the end of a webhook channel's job queue — endpoint tasks hand jobs
to the bot's one reader through a bounded memory channel; when the reader ends, the queue
is closed and every job still in it is refused, so its sender answers "try again" instead
of waiting forever (the web chat's ``Chat.close`` does the same by hand).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import trio

T = TypeVar("T")

__all__ = ["close_jobs"]


def close_jobs(
    send: trio.MemorySendChannel[T],
    receive: trio.MemoryReceiveChannel[T],
    refuse: Callable[[T], None],
) -> None:
    """Close the queue for new jobs and ``refuse`` each job still waiting in it."""
    send.close()
    while True:
        try:
            job = receive.receive_nowait()
        except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
            return
        refuse(job)
