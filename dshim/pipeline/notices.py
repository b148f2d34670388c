"""Notices: the short texts dshim itself sends (command replies, refusals, interaction
prompts and outcomes), and their record in the outbound index.

Two ways to send one:

- :meth:`Notifier.notify` queues it for the notice worker (:meth:`Notifier.run_worker`,
  one task per bot) and returns at once unless the bounded queue is full.  Steps 1-6 use
  it: the channel's reader never waits for a platform call of ours.
- :meth:`Notifier.send_now` sends it from the calling task and returns when it was
  delivered.  Tasks that may wait use it (a turn presenting an approval must know the
  request is visible before it counts answers).

Every delivered notice is written to the outbound index, so a user who quotes it later
is understood.  A notice that cannot be delivered is logged and dropped: it never fails
the task that sent it.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
import trio

from dshim.errors import DshimError
from dshim.model import Delivered, ReplyTarget
from dshim.outbound import Outbound
from dshim.pipeline.activity import Activity
from dshim.store.base import OutboundEntry, Store

__all__ = ["NOTICE_QUEUE", "Notifier"]

log = structlog.get_logger("dshim.pipeline")

#: Notices waiting for the worker; ``notify`` waits when the queue is full.
NOTICE_QUEUE = 64


class Notifier:
    """Sends one bot's notices (see the module docstring)."""

    def __init__(
        self,
        *,
        outbound: Outbound,
        store: Store,
        bot: str,
        clock: Callable[[], float],
        activity: Activity,
        queue_size: int = NOTICE_QUEUE,
    ) -> None:
        self.outbound = outbound
        self.store = store
        self.bot = bot
        self.clock = clock
        self.activity = activity
        self._send, self._recv = trio.open_memory_channel[tuple[ReplyTarget, str]](queue_size)

    async def notify(self, target: ReplyTarget, text: str) -> None:
        """Queue a notice for the worker.  Waits only when the notice queue is full."""
        self.activity.busy()
        await self._send.send((target, text))

    async def send_now(self, target: ReplyTarget, text: str) -> list[Delivered]:
        """Send a notice from this task and record it; ``[]`` when it could not be sent."""
        try:
            delivered = await self.outbound.send_text(target, text)
        except DshimError as exc:  # the channel's outbound raises ChannelError only
            log.warning("notice_failed", error=short(exc), conversation=target.conversation_id)
            return []
        now = self.clock()
        for d in delivered:
            await self.store.add_outbound(
                self.bot, target.conversation_id, OutboundEntry.from_delivered(d), now=now
            )
        return delivered

    async def run_worker(self) -> None:
        """Send queued notices in order, forever (run it in the bot's nursery)."""
        async for target, text in self._recv:
            try:
                await self.send_now(target, text)
            finally:
                self.activity.done()


def short(exc: BaseException) -> str:
    """An exception as one short line for logs and replies."""
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
