"""What survives a stop of the bot: restoring the inbox, the durable outbox, the drain.

:class:`Recovery` owns the bot's work across restarts and outages:

- :meth:`Recovery.restore` at start: the inbox entries a crash or shutdown left behind
  (see :mod:`dshim.pipeline.runtime` for what each state becomes), with the attempt
  count that turns a message which takes the bot down every time into a notice
  (:data:`GAVE_UP_TEXT`, :data:`INTERRUPTED_TEXT`) instead of a restart loop;
- :meth:`Recovery.run_outbox` for as long as the bot runs: the answers the platform did
  not take in time, retried with backoff, replaced by :data:`LATE_ANSWER_TEXT` once too
  old to make sense;
- :meth:`Recovery.drain` at shutdown: the grace for running turns, then the cut, with
  the ``cutting`` flag that keeps queued items from starting afterwards.

It is apart from :class:`~dshim.pipeline.runtime.BotRuntime` because none of it is on
the path of a live event: it runs once at start, in the background, or once at the end,
and its rules (attempt caps, retry intervals, the cut) are easier to read on their own.
It reaches steps 5 and 6 only through the callbacks the runtime hands in, and it is
given the lanes per call, so a lane set replaced after construction (the benchmarks do)
is the one drained.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import msgspec
import structlog
import trio

from dshim.backoff import Backoff
from dshim.model import InboundMessage, ReplyTarget, Skip, Verdict
from dshim.pipeline import gates
from dshim.pipeline.lanes import LaneItem
from dshim.pipeline.notices import Notifier, Outcome, short

if TYPE_CHECKING:
    from dshim.config import BotConfig
    from dshim.pipeline.lanes import LaneSet
    from dshim.pipeline.substitute import SubstituteGate
    from dshim.store.base import InboxEntry, OutboxEntry, Store

__all__ = [
    "CUT_GRACE_S",
    "GAVE_UP_TEXT",
    "INTERRUPTED_TEXT",
    "LATE_ANSWER_TEXT",
    "MAX_TURN_ATTEMPTS",
    "OUTBOX_RETRY_MAX_S",
    "OUTBOX_RETRY_S",
    "Recovery",
]

log = structlog.get_logger("dshim.pipeline")

INTERRUPTED_TEXT = "dshim restarted while answering this message, so the answer was interrupted. Send it again to retry."
LATE_ANSWER_TEXT = (
    "The answer to this message could not be delivered in time (the platform was"
    " unreachable). Send it again to retry."
)
#: The outbox's first retry while the platform stays down, and its longest wait.
OUTBOX_RETRY_S = 30.0
OUTBOX_RETRY_MAX_S = 300.0
#: Turns started for one message before a restart gives up on it (with a notice).
MAX_TURN_ATTEMPTS = 2
GAVE_UP_TEXT = (
    "dshim stopped twice while handling this message, so it gave up on it. Send it again to retry."
)
#: After the shutdown grace: how long cut answers may take to show their mark.
CUT_GRACE_S = 5.0

_DECODE_ERRORS = (msgspec.DecodeError, msgspec.ValidationError, ValueError)


class Recovery:
    """Restore, outbox and drain for one bot."""

    def __init__(
        self,
        *,
        bot: BotConfig,
        bot_id: str,
        store: Store,
        clock: Callable[[], float],
        backlog_max_age_s: float,
        notifier: Notifier,
        substitute: SubstituteGate,
        decode_stored: Callable[[bytes], InboundMessage | Skip],
        drop: Callable[..., Verdict],
        is_command: Callable[[InboundMessage], bool],
        dispatch: Callable[[InboundMessage], Awaitable[None]],
        enqueue: Callable[[LaneItem], Awaitable[None]],
    ) -> None:
        """``decode_stored`` reads an inbox entry back and ``drop`` reports a dropped
        message (both :class:`~dshim.pipeline.intake.Intake`'s); ``dispatch`` runs steps
        5-6 for a restored message and ``enqueue`` puts a lane item on its lane (the
        runtime's); ``is_command`` tells a command from a turn (step 5's rule)."""
        self._bot = bot
        self._bot_id = bot_id
        self._store = store
        self._clock = clock
        self._max_age_s = backlog_max_age_s
        self._notifier = notifier
        self._substitute = substitute
        self._decode_stored = decode_stored
        self._drop: Callable[..., Verdict] = drop
        self._is_command = is_command
        self._dispatch = dispatch
        self._enqueue = enqueue
        self._outbox_due = trio.Event()
        #: The shutdown grace is over: no lane item starts any more.
        self.cutting = False

    # -- restart -----------------------------------------------------------------------

    async def restore(self) -> int:
        """Resume messages accepted before a restart.  Returns how many were resumed."""
        bot = self._bot.name
        entries = await self._store.inbox_pending(bot)
        resumed = 0
        for entry in entries:
            try:
                item = self._decode_stored(entry.raw)
            except _DECODE_ERRORS as exc:
                item = Skip(reason="malformed", detail=short(exc))
            if isinstance(item, Skip):
                log.warning(
                    "inbox_entry_unreadable", message_id=entry.message_id, detail=item.detail
                )
                await self._store.inbox_done(bot, entry.conversation_id, entry.message_id)
                continue
            if entry.state == "undelivered":
                continue  # its answer waits in the outbox (run_outbox delivers it)
            if entry.state in ("running", "delivered"):
                resumed += await self._restore_interrupted(entry, item)
                continue
            reason = gates.judge(
                item,
                bot_id=self._bot_id,
                now=self._clock(),
                max_age_s=self._max_age_s,
                access=self._bot.access,
                substitute=item.substitute is not None,
            )
            if reason is not None:
                self._drop(item, reason, restored=True)
                await self._store.inbox_done(bot, item.conversation_id, item.message_id)
                continue
            # Every resume counts, like a turn start: a message that takes the bot down
            # before its turn starts cannot resume (and take it down) for ever.
            tried = await self._store.inbox_resumed(bot, entry.conversation_id, entry.message_id)
            if tried >= MAX_TURN_ATTEMPTS:
                log.warning("inbox_entry_given_up", message_id=item.message_id, attempts=tried)
                await self._notice_then_done(entry, item, GAVE_UP_TEXT)
                continue
            log.info("inbox_entry_resumed", message_id=item.message_id, attempt=tried + 1)
            await self._dispatch(item)
            resumed += 1
        return resumed

    async def _restore_interrupted(self, entry: InboxEntry, item: InboundMessage) -> int:
        """A message whose turn had started: run it again, or say it was interrupted."""
        stale = bool(item.received_at) and self._clock() - item.received_at > self._max_age_s
        if (
            entry.state == "running"
            and entry.attempts < MAX_TURN_ATTEMPTS
            and not stale
            and not self._is_command(item)  # a /send: its batch is gone with the process
        ):
            log.info(
                "turn_resumed_after_restart", message_id=item.message_id, attempt=entry.attempts + 1
            )
            await self._enqueue(
                LaneItem(
                    kind="turn",
                    msg=item,
                    inbox_keys=[(entry.conversation_id, entry.message_id)],
                )
            )
            return 1
        log.warning(
            "turn_interrupted_by_restart",
            message_id=item.message_id,
            shown=entry.state == "delivered",
            attempts=entry.attempts,
        )
        await self._notice_then_done(entry, item, INTERRUPTED_TEXT)
        return 0

    async def _notice_then_done(self, entry: InboxEntry, item: InboundMessage, text: str) -> None:
        """Tell the user under their message, and only then finish its inbox entry."""
        conversation_id, message_id = entry.conversation_id, entry.message_id

        async def noticed(outcome: Outcome) -> None:
            # Done only once the notice is out (or may be, or never can be): a crash before
            # that, or a platform that is down, leaves it for the next start.
            if outcome == "later":
                log.warning("restart_notice_postponed", message_id=message_id)
                return
            await self._store.inbox_done(self._bot.name, conversation_id, message_id)

        await self._notifier.notify(ReplyTarget.for_message(item), text, then=noticed)

    # -- the durable outbox --------------------------------------------------------------

    def wake_outbox(self) -> None:
        """A turn postponed an answer: try the outbox now."""
        self._outbox_due.set()

    async def run_outbox(self) -> None:
        """Deliver the answers the platform did not take (an outage longer than the
        engine's retries), oldest first, for as long as the bot runs: at start (they
        survive restarts), when a turn postpones one, and again with backoff while the
        platform stays down.  An answer older than ``backlog_max_age_s`` makes no sense
        any more: a short notice under the message takes its place."""
        backoff = Backoff(OUTBOX_RETRY_S, OUTBOX_RETRY_MAX_S, 2.0, jitter=0.1)
        while True:
            self._outbox_due = trio.Event()
            entries = await self._store.outbox_pending(self._bot.name)
            waiting = 0
            for entry in entries:
                if not await self._deliver_postponed(entry):
                    waiting += 1
            if waiting:
                delay = backoff.next_delay()
                log.info("outbox_waiting", answers=waiting, retry_in_s=round(delay, 1))
                with trio.move_on_after(delay):
                    await self._outbox_due.wait()
            else:
                backoff.reset()
                await self._outbox_due.wait()

    async def _deliver_postponed(self, entry: OutboxEntry) -> bool:
        """Try one postponed answer; False while the platform still does not take it."""
        bot = self._bot.name
        item = None
        if entry.raw is not None:
            try:
                item = self._decode_stored(entry.raw)
            except _DECODE_ERRORS:
                item = None
        if not isinstance(item, InboundMessage):
            log.warning("outbox_entry_unreadable", message_id=entry.message_id)
            await self._store.outbox_done(bot, entry.conversation_id, entry.message_id)
            return True
        target = ReplyTarget.for_message(item)
        if item.substitute is not None:
            target = await self._substitute.target_for(item, target)
        late = self._clock() - entry.created_at > self._max_age_s
        text = LATE_ANSWER_TEXT if late else entry.text
        _, outcome = await self._notifier.send_outcome(target, text)
        if outcome == "later":
            return False
        log.info("outbox_delivered", message_id=entry.message_id, late=late, outcome=outcome)
        await self._store.outbox_done(bot, entry.conversation_id, entry.message_id)
        return True

    # -- shutdown ----------------------------------------------------------------------

    async def drain(self, lanes: LaneSet, grace_s: float) -> None:
        """Let the running turns of ``lanes`` finish for up to ``grace_s`` seconds, then
        cut them at once: a partial answer is finished marked as cut short by the restart
        (within :data:`CUT_GRACE_S` more), a turn that had shown nothing is left to run
        again after the restart.  Queued items stay queued (they run after the restart).
        Stopping intake is the caller's part."""
        with trio.move_on_after(grace_s):
            await lanes.wait_none_running()
        if not lanes.running_count():
            return
        self.cutting = True
        log.warning("shutdown_cutting_turns", running=lanes.stop_all("shutdown"))
        with trio.move_on_after(CUT_GRACE_S):
            await lanes.wait_none_running()
        if lanes.running_count():
            log.warning("shutdown_cancelling_turns", running=lanes.running_count())
