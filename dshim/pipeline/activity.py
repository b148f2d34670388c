"""Work in progress of one bot's pipeline, for :meth:`BotRuntime.wait_idle` and friends.

Every unit of work the pipeline starts — an item queued on a lane (it stays counted while
it runs), a notice waiting to be sent, a command answered in the background — is counted
with :meth:`Activity.busy` when it starts and :meth:`Activity.done` when it ends.
Waiters give a predicate over the bot's state and are woken whenever the count changes
or someone :meth:`pokes <Activity.poke>` (an interaction started waiting for the user),
so waiting never polls.  Nothing is woken while nobody waits: the counters stay cheap on
the hot path.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

__all__ = ["Activity"]


class Activity:
    """A counter of pipeline work with change notification."""

    __slots__ = ("pending", "_changed", "_waiters")

    def __init__(self) -> None:
        #: Units of work started and not yet done.
        self.pending = 0
        self._changed = trio.Event()
        self._waiters = 0

    def busy(self) -> None:
        """One more unit of work."""
        self.pending += 1
        if self._waiters:
            self.poke()

    def done(self) -> None:
        """One unit of work ended."""
        self.pending -= 1
        if self._waiters:
            self.poke()

    def poke(self) -> None:
        """Something a waiter's predicate reads changed: wake the waiters to look again."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds (checked now and after every change)."""
        while not predicate():
            self._waiters += 1
            try:
                await self._changed.wait()
            finally:
                self._waiters -= 1

    async def wait_idle(self) -> None:
        """Return once no work is in progress."""
        await self.wait_until(lambda: self.pending == 0)
