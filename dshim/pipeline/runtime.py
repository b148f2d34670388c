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

Steps 1-4 are :mod:`dshim.pipeline.intake` (their judgements are pure,
:mod:`dshim.pipeline.gates`); commands are the table in :mod:`dshim.pipeline.commands`,
batch input is :mod:`dshim.pipeline.batch`, interaction answers
:mod:`dshim.pipeline.interactions`, notices :mod:`dshim.pipeline.notices`.  When
``accept`` returns, the event is durable: a channel may confirm it to the platform
(advance an offset, ack an envelope).  Step 7 — the turn — runs later on the lane's task
(:mod:`dshim.pipeline.turn`).  Nothing before step 7 does network lookups for quoted
messages, so unaddressed, duplicate, denied or stale messages never trigger one.

The inbox entry of a message is removed when its handling ends (answered, refused, or
dropped by steps 4-6).  Entries left behind by a crash or shutdown are restored on the
next start (:meth:`BotRuntime.restore`, :mod:`dshim.pipeline.recovery`):

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

Parts
-----
:class:`BotRuntime` is the composition: it builds the bot's parts, hands each what it
needs, and keeps the public surface channels, serve, replay and the tests use.  What is
left here is what ties the parts together — steps 5 and 6 (:meth:`BotRuntime._dispatch`:
the command table, batches, answers, the lane) and the lane items themselves (a turn, a
``/new``, a retracted message).  :class:`~dshim.pipeline.intake.Intake` (steps 1-4) and
:class:`~dshim.pipeline.recovery.Recovery` (restore, the outbox, the drain) come back
here only through the callbacks given to them, and never hold the lanes: those are read
from the runtime when they are used.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import structlog
import trio

from dshim.config import BotConfig, Config, SubstituteTarget, backlog_max_age
from dshim.errors import DshimError, HarnessError, single_error
from dshim.harness import create_harness, open_harness
from dshim.harness.base import ClosesSessions, Harness
from dshim.metrics import NO_METRICS, BotMetrics
from dshim.model import InboundMessage, ReplyTarget, Skip, Verdict
from dshim.outbound import Outbound
from dshim.pipeline import commands as cmds
from dshim.pipeline import gates
from dshim.pipeline.activity import Activity
from dshim.pipeline.batch import Batch, Batches, Step
from dshim.pipeline.files import FileStash
from dshim.pipeline.intake import Intake, RawDecoder
from dshim.pipeline.interactions import Interactions
from dshim.pipeline.lanes import Lane, LaneItem, LaneSet
from dshim.pipeline.notices import Notifier, short
from dshim.pipeline.observer import Observer
from dshim.pipeline.recovery import (
    CUT_GRACE_S,
    GAVE_UP_TEXT,
    INTERRUPTED_TEXT,
    LATE_ANSWER_TEXT,
    MAX_TURN_ATTEMPTS,
    OUTBOX_RETRY_MAX_S,
    OUTBOX_RETRY_S,
    Recovery,
)
from dshim.pipeline.substitute import SubstituteGate
from dshim.pipeline.turn import TurnDeps, run_turn
from dshim.store.base import Store

if TYPE_CHECKING:
    from dshim.capture import BotCapture

#: What :meth:`BotRuntime.retract` did (``dshim.channels.base.RetractOutcome``).
RetractOutcome = Literal["dropped", "stopped", "none"]

__all__ = [
    "BUSY_TEXT",
    "CUT_GRACE_S",
    "GAVE_UP_TEXT",
    "INTERRUPTED_TEXT",
    "LATE_ANSWER_TEXT",
    "MAX_TURN_ATTEMPTS",
    "OUTBOX_RETRY_MAX_S",
    "OUTBOX_RETRY_S",
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
BUSY_TEXT = "I'm busy with earlier messages in this chat, so this message was not queued. Please send it again in a moment."


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
        self.backlog_max_age_s = backlog_max_age(config, bot)
        #: Steps 1-4; what they let through comes back to :meth:`_dispatch`.
        self.intake = Intake(
            bot=bot,
            bot_id=bot_id,
            store=store,
            clock=clock,
            dedup_ttl_s=config.dshim.dedup_ttl_s,
            backlog_max_age_s=self.backlog_max_age_s,
            substitute=self.substitute,
            observer=observer,
            metrics=metrics,
            capture=capture,
            decode_raw=decode_raw,
            dispatch=self._dispatch,
        )
        #: Restore at start, the durable outbox, the drain at shutdown.
        self.recovery = Recovery(
            bot=bot,
            bot_id=bot_id,
            store=store,
            clock=clock,
            backlog_max_age_s=self.backlog_max_age_s,
            notifier=self.notifier,
            substitute=self.substitute,
            decode_stored=self.intake.decode_stored,
            drop=self.intake.drop,
            is_command=self._is_command,
            dispatch=self._dispatch,
            enqueue=self._enqueue,
        )
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
            outbox_wake=self.recovery.wake_outbox,
            capture=capture,
        )
        #: Inbox keys of turns waiting in a lane, and those withdrawn meanwhile (retract).
        self._queued: set[tuple[str, str]] = set()
        self._retracted: set[tuple[str, str]] = set()

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
        return self.intake.closing

    # -- steps 1-4 (dshim.pipeline.intake), then 5-6 here ------------------------------

    async def accept(self, item: InboundMessage | Skip, raw: bytes | None = None) -> Verdict:
        """Run steps 1-6.  When it returns, the event is durable or deliberately dropped."""
        return await self.intake.accept(item, raw)

    async def accept_many(
        self, events: Sequence[tuple[InboundMessage | Skip, bytes | None]]
    ) -> list[Verdict]:
        """:meth:`accept` for a batch (a getUpdates page, a websocket burst): every key and
        inbox entry in one store transaction, then steps 5-6 in order.  Once one event is
        refused for shutdown, the rest are too (the platform delivers them again)."""
        return await self.intake.accept_many(events)

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

    def _is_command(self, msg: InboundMessage) -> bool:
        """Would step 5 take ``msg`` for a command?  (Recovery asks: a restored /send does
        not run again, its batch is gone with the process.)"""
        typed = not (msg.images or msg.files or msg.forwarded)
        return typed and cmds.parse_command(msg.content, self.outbound.bot_username) is not None

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
            await self._close_session(binding.session_id, "idle", key[0])

    async def _close_session(self, session_id: str, reason: str, conversation: str) -> None:
        if not isinstance(self.harness, ClosesSessions):
            return
        # The harness's records (``agent_session_closed``) name the conversation.
        with structlog.contextvars.bound_contextvars(conversation=conversation):
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
            if self.recovery.cutting:
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
                    await self._close_session(old.session_id, "new", item.msg.conversation_id)
            else:
                await run_turn(self.turn_deps, item, lane)  # finishes the inbox entries itself
                return
            for conv, mid in item.inbox_keys:
                await self.store.inbox_done(self.bot.name, conv, mid)
        finally:
            self.activity.done()

    # -- restart, the outbox, shutdown (dshim.pipeline.recovery) -----------------------

    async def restore(self) -> int:
        """Resume messages accepted before a restart.  Returns how many were resumed."""
        return await self.recovery.restore()

    async def run_outbox(self) -> None:
        """Deliver the answers the platform did not take, for as long as the bot runs
        (see :meth:`dshim.pipeline.recovery.Recovery.run_outbox`)."""
        await self.recovery.run_outbox()

    async def drain(self, grace_s: float) -> None:
        """Stop accepting; let running turns finish for up to ``grace_s`` seconds, then cut
        them at once: a partial answer is finished marked as cut short by the restart
        (within :data:`CUT_GRACE_S` more), a turn that had shown nothing is left to run
        again after the restart.  Queued items stay queued (they run after the restart).
        """
        self.intake.closing = True
        await self.recovery.drain(self.lanes, grace_s)


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
