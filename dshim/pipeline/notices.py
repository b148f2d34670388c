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

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Literal, TypeAlias

import structlog
import trio

from dshim.errors import AuthError, DshimError, RateLimited, TransportError
from dshim.model import Delivered, ReplyTarget
from dshim.outbound import Outbound
from dshim.pipeline.activity import Activity
from dshim.store.base import OutboundEntry, Store

if TYPE_CHECKING:
    from dshim.capture import BotCapture

__all__ = ["NOTICE_QUEUE", "AfterNotice", "Notifier", "Outcome", "outcome_of"]

log = structlog.get_logger("dshim.pipeline")

#: Notices waiting for the worker; ``notify`` waits when the queue is full.
NOTICE_QUEUE = 64

#: How a notice went (see :func:`outcome_of`).
Outcome: TypeAlias = Literal["sent", "unknown", "later", "refused"]
AfterNotice: TypeAlias = Callable[[Outcome], Awaitable[None]]


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
        capture: BotCapture | None = None,
    ) -> None:
        self.outbound = outbound
        self.capture = capture
        self.store = store
        self.bot = bot
        self.clock = clock
        self.activity = activity
        self._send, self._recv = trio.open_memory_channel[
            tuple[ReplyTarget, str, AfterNotice | None]
        ](queue_size)

    async def notify(
        self, target: ReplyTarget, text: str, *, then: AfterNotice | None = None
    ) -> None:
        """Queue a notice for the worker.  Waits only when the notice queue is full.

        ``then`` is called by the worker with the notice's :data:`Outcome` once it was
        tried (e.g. to mark an inbox entry done only when its notice went out)."""
        self.activity.busy()
        await self._send.send((target, text, then))

    async def send_now(self, target: ReplyTarget, text: str) -> list[Delivered]:
        """Send a notice from this task and record it; ``[]`` when it could not be sent."""
        delivered, _ = await self.send_outcome(target, text)
        return delivered

    async def send_outcome(self, target: ReplyTarget, text: str) -> tuple[list[Delivered], Outcome]:
        """Send a notice from this task and record it; also say how it went."""
        try:
            delivered = await self.outbound.send_text(target, text)
        except DshimError as exc:  # the channel's outbound raises ChannelError only
            log.warning("notice_failed", error=short(exc), conversation=target.conversation_id)
            return [], outcome_of(exc)
        if self.capture is not None:
            self.capture.sent(target, delivered)
        now = self.clock()
        for d in delivered:
            await self.store.add_outbound(
                self.bot, target.conversation_id, OutboundEntry.from_delivered(d), now=now
            )
        return delivered, "sent"

    async def run_worker(self) -> None:
        """Send queued notices in order, forever (run it in the bot's nursery)."""
        async for target, text, then in self._recv:
            try:
                _, outcome = await self.send_outcome(target, text)
                if then is not None:
                    await then(outcome)
            finally:
                self.activity.done()


def outcome_of(exc: DshimError) -> Outcome:
    """How a failed send went: ``unknown`` when the platform may have it (never send it
    again), ``later`` when it certainly did not and may work later (the platform is
    down or busy), ``refused`` when it never will (the chat is gone, the bot blocked)."""
    if isinstance(exc, TransportError):
        return "unknown" if exc.outcome_unknown else "later"
    if isinstance(exc, (RateLimited, AuthError)):
        return "later"
    return "refused"


def short(exc: BaseException) -> str:
    """An exception as one short line for logs and replies."""
    text = str(exc) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
