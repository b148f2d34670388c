"""The ordered inbound pipeline of one bot.

Theory of operation
-------------------
A channel's reader calls :meth:`BotRuntime.accept` for every platform event, in platform
order, and awaits it.  ``accept`` runs steps 1-6 of DESIGN.md §3 on the reader's task:

1. decode/validate (the channel hands a :class:`Skip` for what it could not map), drop the
   bot's own echoes and other bots;
2. trigger rules: groups only when addressed;
3. dedup by (bot, conversation, message) persisted atomically with a durable inbox entry,
   and the backlog limit (stale events are never run);
4. access policy on the current sender;
5. commands, batch input and pending interaction answers, on the current text only (a
   quoted or forwarded message is never a command, a /batch control word or an answer);
6. enqueue on the conversation's lane (bounded; overflow gets a visible "busy" reply).

The judgements of steps 1-4 are pure (:mod:`dshim.pipeline.gates`); commands are the
table in :mod:`dshim.pipeline.commands`, batch input is :mod:`dshim.pipeline.batch`,
interaction answers :mod:`dshim.pipeline.interactions`, notices
:mod:`dshim.pipeline.notices`.  When ``accept`` returns, the event is durable: a
channel may confirm it to the platform (advance an offset, ack an envelope).  Step 7 — the
turn — runs later on the lane's task (:mod:`dshim.pipeline.turn`).  Nothing before step 7
does network lookups for quoted messages, so unaddressed, duplicate, denied or stale
messages never trigger one.

The inbox entry of a message is removed when its handling ends (answered, refused, or
dropped by steps 4-6).  Entries left behind by a crash or shutdown are restored on the
next start (:meth:`BotRuntime.restore`):

- ``queued`` (its turn never started): it runs — each resume counts as an attempt, so
  one that takes the bot down before its turn starts is given up (:data:`GAVE_UP_TEXT`)
  after :data:`MAX_TURN_ATTEMPTS`;
- ``running`` (its turn started, nothing of the answer was shown): it runs again — at
  most :data:`MAX_TURN_ATTEMPTS` turns in all, so a message that takes the bot down
  every time ends with a notice instead of a restart loop;
- ``delivered`` (part of the answer may have reached the user): a notice
  (:data:`INTERRUPTED_TEXT`) under the message instead of a second answer.

A shutdown (:meth:`BotRuntime.drain`) lets running turns finish during the grace; then it
stops them at once: a partial answer is finished marked as cut (so the notice is not
needed after the restart), a turn that had shown nothing is left to run again.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import msgspec
import structlog
import trio

from dshim import normalized
from dshim.backoff import Backoff
from dshim.config import BotConfig, Config, SubstituteTarget, backlog_max_age
from dshim.errors import DshimError, HarnessError, single_error
from dshim.harness import create_harness, open_harness
from dshim.harness.base import ClosesSessions, Harness
from dshim.metrics import NO_METRICS, BotMetrics
from dshim.model import DropReason, InboundMessage, ReplyTarget, Skip, SubstituteTurn, Verdict
from dshim.outbound import Outbound
from dshim.pipeline import commands as cmds
from dshim.pipeline import gates
from dshim.pipeline.activity import Activity
from dshim.pipeline.batch import Batch, Batches, Step
from dshim.pipeline.files import FileStash
from dshim.pipeline.interactions import Interactions
from dshim.pipeline.lanes import Lane, LaneItem, LaneSet
from dshim.pipeline.notices import Notifier, Outcome, short
from dshim.pipeline.observer import Observer
from dshim.pipeline.substitute import SubstituteGate
from dshim.pipeline.turn import TurnDeps, run_turn
from dshim.store.base import InboxEntry, OutboxEntry, Store

if TYPE_CHECKING:
    from dshim.capture import BotCapture

#: What :meth:`BotRuntime.retract` did (``dshim.channels.base.RetractOutcome``).
RetractOutcome = Literal["dropped", "stopped", "none"]

__all__ = [
    "BUSY_TEXT",
    "INTERRUPTED_TEXT",
    "BotRuntime",
    "Clock",
    "LaneItem",
    "Observer",
    "RawDecoder",
    "open_bot_runtime",
    "wall_clock",
]

log = structlog.get_logger("dshim.pipeline")

Clock = Callable[[], float]
RawDecoder = Callable[[bytes], "InboundMessage | Skip"]

BUSY_TEXT = "I'm busy with earlier messages in this chat, so this message was not queued. Please send it again in a moment."
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

ACCEPTED = Verdict(True)
_SHUTDOWN = Verdict(False, "shutdown")


class _Judged(NamedTuple):
    """An event steps 1-4 let through: what the store keeps for it, and when."""

    msg: InboundMessage
    stored: bytes | None
    denied: bool
    now: float


_substitute_decoder = msgspec.json.Decoder(SubstituteTurn)


class BotRuntime:
    """Steps 1-7 for one bot.  Create with :func:`open_bot_runtime`."""

    def __init__(
        self,
        *,
        config: Config,
        bot: BotConfig,
        bot_id: str,
        store: Store,
        harness: Harness,
        outbound: Outbound,
        nursery: trio.Nursery,
        clock: Clock,
        observer: Observer | None,
        decode_raw: RawDecoder | None,
        metrics: BotMetrics = NO_METRICS,
        substitute_targets: Sequence[SubstituteTarget] | None = None,
        files: FileStash | None = None,
        capture: BotCapture | None = None,
    ) -> None:
        self.config = config
        #: ``serve --capture``: told of every event, drop, prompt and send (None: off).
        self.capture = capture
        self.bot = bot
        self.bot_id = bot_id
        self.store = store
        self.harness = harness
        self.outbound = outbound
        self.clock = clock
        self.observer = observer
        self.metrics = metrics
        self.decode_raw = decode_raw
        self._nursery = nursery
        self.activity = Activity()
        self.notifier = Notifier(
            outbound=outbound,
            store=store,
            bot=bot.name,
            clock=clock,
            activity=self.activity,
            capture=capture,
        )
        self.interactions = Interactions(self.notifier, config.harness.interaction_timeout_s)
        self.substitute = SubstituteGate(bot, store, clock, targets=substitute_targets)
        self.batches = Batches()
        self.lanes = LaneSet(
            nursery,
            self._run_item,
            max_queue=bot.lanes.max_queue,
            idle_exit_s=bot.lanes.idle_exit_s,
            on_idle=self._lane_idle,
        )
        self.turn_deps = TurnDeps(
            bot=bot,
            store=store,
            harness=harness,
            outbound=outbound,
            notifier=self.notifier,
            interactions=self.interactions,
            clock=clock,
            observer=observer,
            metrics=metrics,
            substitute=self.substitute,
            files=files,
            outbox_wake=self._wake_outbox,
            capture=capture,
        )
        self._outbox_due = trio.Event()
        self._closing = False
        #: Inbox keys of turns waiting in a lane, and those withdrawn meanwhile (retract).
        self._queued: set[tuple[str, str]] = set()
        self._retracted: set[tuple[str, str]] = set()
        #: The shutdown grace is over: no lane item starts any more.
        self._cutting = False
        self.backlog_max_age_s = backlog_max_age(config, bot)

    # -- bookkeeping -------------------------------------------------------------------

    def _done(self) -> None:
        """One unit of work ended (kept for the channel benchmarks' no-op lane handlers)."""
        self.activity.done()

    async def wait_idle(self) -> None:
        """Wait until no turn, queued item, notice or command is in progress."""
        await self.activity.wait_idle()

    async def wait_settled(self) -> None:
        """Wait until nothing can make progress without the user.

        That is: nothing runs or is queued except turns blocked on a pending approval or
        question — and the items queued behind them in the same conversation, which cannot
        start before the answer.  Notices and commands in flight are waited for.  With no
        pending request it is :meth:`wait_idle`.  Replay uses it to feed the next event
        (perhaps the answer) while a request waits, instead of letting its timeout run out.
        """
        await self.activity.wait_until(self._settled)

    def _settled(self) -> bool:
        blocked = 0
        for key in self.interactions.waiting():
            lane = self.lanes.get(key)
            if lane is not None and lane.running is not None:
                blocked += 1 + lane.queued
        return self.activity.pending <= blocked

    @property
    def closing(self) -> bool:
        return self._closing

    def _drop(self, item: InboundMessage | Skip, reason: DropReason, **kw: Any) -> Verdict:
        level = "warning" if reason == "malformed" else "info"
        getattr(log, level)(
            "event_dropped",
            reason=reason,
            message_id=item.message_id,
            **({"detail": item.detail} if isinstance(item, Skip) and item.detail else {}),
            **kw,
        )
        if self.observer is not None:
            self.observer.on_drop(item, reason)
        self.metrics.event(reason)
        return Verdict(False, reason)

    # -- steps 1-6 ---------------------------------------------------------------------

    async def accept(self, item: InboundMessage | Skip, raw: bytes | None = None) -> Verdict:
        """Run steps 1-6.  When it returns, the event is durable or deliberately dropped."""
        if self.capture is not None and raw is not None:
            self.capture.event(item, raw)
        judged = await self._judge(item, raw)
        if isinstance(judged, Verdict):
            return judged
        fresh = await self.store.accept(
            self.bot.name,
            judged.msg.conversation_id,
            judged.msg.message_id,
            now=judged.now,
            ttl_s=self.config.dshim.dedup_ttl_s,
            raw=judged.stored,
        )
        return await self._accepted(judged, fresh)

    async def accept_many(
        self, events: Sequence[tuple[InboundMessage | Skip, bytes | None]]
    ) -> list[Verdict]:
        """:meth:`accept` for a batch (a getUpdates page, a websocket burst): every key and
        inbox entry in one store transaction, then steps 5-6 in order.  Once one event is
        refused for shutdown, the rest are too (the platform delivers them again)."""
        verdicts: list[Verdict | _Judged] = []
        for item, raw in events:
            if self.capture is not None and raw is not None:
                self.capture.event(item, raw)
            if verdicts and verdicts[-1] is _SHUTDOWN:
                verdicts.append(_SHUTDOWN)
                continue
            judged = await self._judge(item, raw)
            verdicts.append(_SHUTDOWN if judged == _SHUTDOWN else judged)
        pending = [v for v in verdicts if isinstance(v, _Judged)]
        fresh = iter(
            await self.store.accept_many(
                self.bot.name,
                [(p.msg.conversation_id, p.msg.message_id, p.stored) for p in pending],
                now=self.clock(),
                ttl_s=self.config.dshim.dedup_ttl_s,
            )
            if pending
            else []
        )
        out: list[Verdict] = []
        for v in verdicts:
            out.append(await self._accepted(v, next(fresh)) if isinstance(v, _Judged) else v)
        return out

    async def _judge(self, item: InboundMessage | Skip, raw: bytes | None) -> _Judged | Verdict:
        """Steps 1-4 and what the store keeps: a verdict when the event is dropped here."""
        if isinstance(item, Skip):
            return self._drop(item, item.reason)
        msg = item
        now = self.clock()
        reason = gates.judge(
            msg,
            bot_id=self.bot_id,
            now=now,
            max_age_s=self.backlog_max_age_s,
            access=self.bot.access,
        )
        if self.substitute.enabled and reason in ("unaddressed", None):
            # Step 2, substitute triggers: before dedup and before any network call.
            sub = await self.substitute.evaluate(msg)
            if sub is not None:
                msg.substitute = sub
                if reason == "unaddressed":
                    reason = gates.judge(
                        msg,
                        bot_id=self.bot_id,
                        now=now,
                        max_age_s=self.backlog_max_age_s,
                        access=self.bot.access,
                        substitute=True,
                    )
        if reason == "stale":
            if await self.store.seen(self.bot.name, msg.conversation_id, msg.message_id, now=now):
                return self._drop(msg, "duplicate")
            return self._drop(msg, "stale", age_s=round(now - msg.received_at, 1))
        if reason is not None and reason != "denied":
            return self._drop(msg, reason)
        if self._closing:
            # Not accepted: the platform will redeliver after the restart.
            self.metrics.event("shutdown")
            return _SHUTDOWN
        denied = reason == "denied"
        stored: bytes | None
        if denied:
            stored = None  # remember the key (step 3 comes first), keep no inbox entry
        elif raw is not None:
            stored = b"R" + raw
        else:
            stored = b"N" + normalized.encode_event(msg)
        if stored is not None and msg.substitute is not None:
            stored = b"S" + msgspec.json.encode(msg.substitute) + b"\n" + stored
        return _Judged(msg, stored, denied, now)

    async def _accepted(self, judged: _Judged, fresh: bool) -> Verdict:
        """After the store took (or refused, as a duplicate) the key: steps 5 and 6."""
        msg = judged.msg
        if not fresh:
            return self._drop(msg, "duplicate")
        if judged.denied:
            self._drop(msg, "denied", sender=msg.sender_id)
            # Durable (its key is kept) but never work: a channel must not act on it.
            return Verdict(True, "denied")
        self.metrics.event("accepted")
        if msg.substitute is not None:
            await self.substitute.remember_anchor(msg, msg.substitute)
            log.info("substitute_triggered", message_id=msg.message_id)
        await self._dispatch(msg)
        return ACCEPTED

    async def _finish_inbox(self, msg: InboundMessage) -> None:
        await self.store.inbox_done(self.bot.name, msg.conversation_id, msg.message_id)

    def allowed(self, msg: InboundMessage) -> bool:
        """Step 4 for this bot (see :func:`dshim.pipeline.gates.allowed`)."""
        return gates.allowed(msg, self.bot.access)

    async def _dispatch(self, msg: InboundMessage) -> None:
        """Steps 5 and 6 for an accepted message."""
        # Step 5: commands, batch input, interaction answers — what the user typed only:
        # a caption of media is no command, and forwarded content is never one.
        typed = not (msg.images or msg.files or msg.forwarded)
        command = cmds.parse_command(msg.content, self.outbound.bot_username) if typed else None
        batch = self.batches.get(msg.lane_key)
        if command is not None:
            if self.observer is not None:
                self.observer.on_command(msg, "/" + command.name)
            log.info("command_received", command=command.name, message_id=msg.message_id)
            await self._command(msg, command, batch)
            return
        if batch is not None:
            await self._batch_step(msg, self.batches.collect(msg, batch))
            return
        if await self.interactions.try_answer(msg):
            await self._finish_inbox(msg)
            return
        # Step 6: the conversation's lane.
        await self._enqueue(
            LaneItem(kind="turn", msg=msg, inbox_keys=[(msg.conversation_id, msg.message_id)])
        )

    async def retract(self, conversation_id: str, message_id: str) -> RetractOutcome:
        """The platform withdrew a message: drop it while queued, stop it while running
        (like ``/stop``: the stopped answer tells the user once), else nothing."""
        key = (conversation_id, message_id)
        if key in self._queued:
            self._retracted.add(key)
            log.info("turn_retracted", conversation=conversation_id, message_id=message_id)
            return "dropped"
        lane = self.lanes.running_with(key)
        if lane is not None and lane.stop():
            log.info("turn_stop_requested", conversation=conversation_id, cause="retracted")
            return "stopped"
        return "none"

    async def _enqueue(self, item: LaneItem) -> None:
        self.activity.busy()
        if item.kind == "turn":
            self._queued.update(item.inbox_keys)
        if not self.lanes.enqueue(item.msg.lane_key, item):
            self._queued.difference_update(item.inbox_keys)
            self.activity.done()
            if item.kind == "turn":
                self.metrics.turn("busy")
            log.warning(
                "lane_overflow",
                conversation=item.msg.conversation_id,
                message_id=item.msg.message_id,
            )
            await self.notifier.notify(ReplyTarget.for_message(item.msg), BUSY_TEXT)
            for conv, mid in item.inbox_keys:
                await self.store.inbox_done(self.bot.name, conv, mid)

    async def notify(self, target: ReplyTarget, text: str) -> None:
        """Queue a notice (command reply, refusal).  Waits when the notice queue is full."""
        await self.notifier.notify(target, text)

    async def _reply(self, msg: InboundMessage, text: str) -> None:
        await self.notifier.notify(ReplyTarget.for_message(msg), text)
        await self._finish_inbox(msg)

    # -- step 5 details ----------------------------------------------------------------

    async def _command(
        self, msg: InboundMessage, command: cmds.Command, batch: Batch | None
    ) -> None:
        """Step 5 for a parsed command: through the table of :mod:`dshim.pipeline.commands`."""
        ctx = cmds.CommandContext(
            msg=msg,
            command=command,
            bot=self.bot,
            harness=self.harness,
            store=self.store,
            clock=self.clock,
            lanes=self.lanes,
            interactions=self.interactions,
            substitute=self.substitute,
            batches=self.batches,
            reply=partial(self._reply, msg),
            finish=partial(self._finish_inbox, msg),
            enqueue=self._enqueue,
            spawn=self._spawn,
            batch_step=partial(self._batch_step, msg),
        )
        await cmds.dispatch(ctx, batching=batch is not None)

    async def substitute_control(
        self,
        action: Literal["stop", "disable"],
        conversation_id: str,
        thread_id: str | None,
        user_id: str,
    ) -> str:
        """A control notice's button (see :meth:`dshim.channels.base.Inbound.substitute_control`)."""
        if not self.bot.access.operates(user_id):
            return "Only the bot's operators may use these buttons."
        if action == "stop":
            key = (conversation_id, thread_id or "")
            lane = self.lanes.get(key)
            stopped = lane.stop() if lane is not None else False
            self.interactions.cancel_for(key)
            log.info("substitute_control", action=action, conversation=conversation_id)
            return "Stopped the answer." if stopped else "Nothing is running there now."
        await self.substitute.set_on(conversation_id, False)
        log.info("substitute_control", action=action, conversation=conversation_id)
        return "Substitute mode is off in that chat (/substitute on there turns it back on)."

    async def _batch_step(self, msg: InboundMessage, step: Step) -> None:
        """Carry out what the batch logic decided for ``msg``."""
        if step.submit:
            await self._enqueue(
                LaneItem(
                    kind="turn",
                    msg=msgspec.structs.replace(msg, reply_to=None, images=[], files=[]),
                    text=cmds.batch_prompt(list(step.submit)),
                    title_text=step.submit[0],
                    inbox_keys=[(msg.conversation_id, msg.message_id)],
                )
            )
        elif step.reply is not None:
            await self._reply(msg, step.reply)
        else:
            await self._finish_inbox(msg)

    def _spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        self.activity.busy()

        async def run() -> None:
            try:
                await fn(*args)
            finally:
                self.activity.done()

        self._nursery.start_soon(run)

    # -- harness sessions of idle conversations ----------------------------------------

    async def _lane_idle(self, key: tuple[str, str]) -> None:
        """A conversation lane went idle: let the harness free its session (ACP
        ``session/close``); the next message reopens it."""
        if not isinstance(self.harness, ClosesSessions):
            return
        try:
            binding = await self.store.get_binding(self.bot.name, *key)
        except DshimError as exc:
            log.warning("session_close_skipped", error=short(exc))
            return
        if binding is not None:
            await self._close_session(binding.session_id, "idle")

    async def _close_session(self, session_id: str, reason: str) -> None:
        if not isinstance(self.harness, ClosesSessions):
            return
        try:
            await self.harness.close_session(session_id, reason=reason)
        except HarnessError as exc:
            log.warning("session_close_failed", reason=reason, error=short(exc))

    # -- step 7 and lane items ---------------------------------------------------------

    async def _run_item(self, item: LaneItem, lane: Lane) -> None:
        self._queued.difference_update(item.inbox_keys)
        retracted = [k for k in item.inbox_keys if k in self._retracted]
        self._retracted.difference_update(retracted)
        try:
            if self._cutting:
                return  # shutting down: its inbox entry brings it back after the restart
            if item.kind == "turn" and retracted and len(retracted) == len(item.inbox_keys):
                for conv, mid in item.inbox_keys:  # withdrawn while it waited: no turn
                    await self.store.inbox_done(self.bot.name, conv, mid)
                return
            if item.kind == "new":
                old = await self.store.get_binding(self.bot.name, *item.msg.lane_key)
                existed = await self.store.clear_binding(self.bot.name, *item.msg.lane_key)
                text = (
                    "Started a new conversation: your next message opens a new session."
                    if existed
                    else "This chat had no session yet: your next message opens a new one."
                )
                await self.notifier.send_now(ReplyTarget.for_message(item.msg), text)
                if old is not None:  # after the reply: closing may take the agent a while
                    await self._close_session(old.session_id, "new")
            else:
                await run_turn(self.turn_deps, item, lane)  # finishes the inbox entries itself
                return
            for conv, mid in item.inbox_keys:
                await self.store.inbox_done(self.bot.name, conv, mid)
        finally:
            self.activity.done()

    # -- restart -----------------------------------------------------------------------

    def _decode_stored(self, data: bytes) -> InboundMessage | Skip:
        if data[:1] == b"S":  # a substitute turn: its decision, then the message
            decision, _, inner = data[1:].partition(b"\n")
            item = self._decode_stored(inner)
            if isinstance(item, InboundMessage):
                item.substitute = _substitute_decoder.decode(decision)
            return item
        kind, body = data[:1], data[1:]
        if kind == b"R" and self.decode_raw is not None:
            return self.decode_raw(body)
        if kind == b"N":
            return normalized.decode_event(body, channel=self.bot.channel, bot_id=self.bot_id)
        return Skip(reason="malformed", detail="unknown inbox format")

    async def restore(self) -> int:
        """Resume messages accepted before a restart.  Returns how many were resumed."""
        entries = await self.store.inbox_pending(self.bot.name)
        resumed = 0
        for entry in entries:
            try:
                item = self._decode_stored(entry.raw)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                item = Skip(reason="malformed", detail=short(exc))
            if isinstance(item, Skip):
                log.warning(
                    "inbox_entry_unreadable", message_id=entry.message_id, detail=item.detail
                )
                await self.store.inbox_done(self.bot.name, entry.conversation_id, entry.message_id)
                continue
            if entry.state == "undelivered":
                continue  # its answer waits in the outbox (run_outbox delivers it)
            if entry.state in ("running", "delivered"):
                resumed += await self._restore_interrupted(entry, item)
                continue
            reason = gates.judge(
                item,
                bot_id=self.bot_id,
                now=self.clock(),
                max_age_s=self.backlog_max_age_s,
                access=self.bot.access,
                substitute=item.substitute is not None,
            )
            if reason is not None:
                self._drop(item, reason, restored=True)
                await self._finish_inbox(item)
                continue
            # Every resume counts, like a turn start: a message that takes the bot down
            # before its turn starts cannot resume (and take it down) for ever.
            tried = await self.store.inbox_resumed(
                self.bot.name, entry.conversation_id, entry.message_id
            )
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
        stale = bool(item.received_at) and self.clock() - item.received_at > self.backlog_max_age_s
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
            await self.store.inbox_done(self.bot.name, conversation_id, message_id)

        await self.notifier.notify(ReplyTarget.for_message(item), text, then=noticed)

    # -- the durable outbox --------------------------------------------------------------

    def _wake_outbox(self) -> None:
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
            entries = await self.store.outbox_pending(self.bot.name)
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
        bot = self.bot.name
        item = None
        if entry.raw is not None:
            try:
                item = self._decode_stored(entry.raw)
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError):
                item = None
        if not isinstance(item, InboundMessage):
            log.warning("outbox_entry_unreadable", message_id=entry.message_id)
            await self.store.outbox_done(bot, entry.conversation_id, entry.message_id)
            return True
        target = ReplyTarget.for_message(item)
        if item.substitute is not None:
            target = await self.substitute.target_for(item, target)
        late = self.clock() - entry.created_at > self.backlog_max_age_s
        text = LATE_ANSWER_TEXT if late else entry.text
        _, outcome = await self.notifier.send_outcome(target, text)
        if outcome == "later":
            return False
        log.info("outbox_delivered", message_id=entry.message_id, late=late, outcome=outcome)
        await self.store.outbox_done(bot, entry.conversation_id, entry.message_id)
        return True

    def _is_command(self, msg: InboundMessage) -> bool:
        typed = not (msg.images or msg.files or msg.forwarded)
        return typed and cmds.parse_command(msg.content, self.outbound.bot_username) is not None

    # -- shutdown ----------------------------------------------------------------------

    async def drain(self, grace_s: float) -> None:
        """Stop accepting; let running turns finish for up to ``grace_s`` seconds, then cut
        them at once: a partial answer is finished marked as cut short by the restart
        (within :data:`CUT_GRACE_S` more), a turn that had shown nothing is left to run
        again after the restart.  Queued items stay queued (they run after the restart).
        """
        self._closing = True
        with trio.move_on_after(grace_s):
            await self.lanes.wait_none_running()
        if not self.lanes.running_count():
            return
        self._cutting = True
        log.warning("shutdown_cutting_turns", running=self.lanes.stop_all("shutdown"))
        with trio.move_on_after(CUT_GRACE_S):
            await self.lanes.wait_none_running()
        if self.lanes.running_count():
            log.warning("shutdown_cancelling_turns", running=self.lanes.running_count())


def wall_clock() -> float:
    return time.time()


def _store_dir(store: Store) -> Path | None:
    """The directory of a store kept in a file (the data directory), else None."""
    path = getattr(store, "path", None)
    return Path(path).parent if isinstance(path, str) else None


@asynccontextmanager
async def open_bot_runtime(
    *,
    config: Config,
    bot: BotConfig,
    bot_id: str,
    store: Store,
    outbound: Outbound,
    harness: Harness | None = None,
    clock: Clock = wall_clock,
    observer: Observer | None = None,
    decode_raw: RawDecoder | None = None,
    restore: bool = True,
    metrics: BotMetrics = NO_METRICS,
    substitute_targets: Sequence[SubstituteTarget] | None = None,
    data_dir: Path | None = None,
    capture: BotCapture | None = None,
) -> AsyncIterator[BotRuntime]:
    """Open a bot's pipeline: its harness, lanes, notice sender and file sweeper.

    ``substitute_targets``: the targets substitute triggers match, when the channel
    resolved the configured ones (e.g. an email to the platform id); None: as configured.
    ``data_dir``: where turns save current files for the agent (``files/<bot>/``, swept
    at start and then periodically); by default the store's directory, and with neither
    the files are listed as ``failed``.

    On exit everything still running is cancelled; call :meth:`BotRuntime.drain` first
    for a graceful stop.
    """
    with single_error():
        async with AsyncExitStack() as stack:
            if harness is None:
                h = await stack.enter_async_context(
                    open_harness(
                        create_harness(
                            config.harness, bot=bot.name, store=store, workspace=bot.workspace
                        )
                    )
                )
            else:
                h = harness
            root = data_dir if data_dir is not None else _store_dir(store)
            files = (
                FileStash(root, bot.name, ttl_s=bot.files_ttl_s, clock=clock)
                if root is not None
                else None
            )
            async with trio.open_nursery() as nursery:
                rt = BotRuntime(
                    config=config,
                    bot=bot,
                    bot_id=bot_id,
                    store=store,
                    harness=h,
                    outbound=outbound,
                    nursery=nursery,
                    clock=clock,
                    observer=observer,
                    decode_raw=decode_raw,
                    metrics=metrics,
                    substitute_targets=substitute_targets,
                    files=files,
                    capture=capture,
                )
                nursery.start_soon(rt.notifier.run_worker)
                nursery.start_soon(rt.run_outbox)
                if files is not None:
                    nursery.start_soon(files.run_sweeper)
                metrics.watch_lanes(rt.lanes)
                with structlog.contextvars.bound_contextvars(bot=bot.name):
                    try:
                        if restore:
                            await rt.restore()
                        yield rt
                    finally:
                        metrics.unwatch_lanes(rt.lanes)
                        nursery.cancel_scope.cancel()
