"""Step 7: one turn — resolve the quote, assemble the prompt, run the harness, stream out.

The stoppable part (reply loading, media download, the harness stream) runs inside the
lane's stop scope: ``/stop`` cancels it, the partial answer is delivered marked as
stopped, and no prompt is sent if the stop came while the quote was still loading.

Restarts: right before anything of the answer can reach the user (the stream's first
send, an approval or question shown) the turn records it durably (inbox state
``delivered``).  A shutdown whose grace ends while the turn runs stops it the same way
as ``/stop`` (reason ``"shutdown"``): if something was shown, the partial answer is
finished at once with :data:`CUT_MARK` (an edit, or one short message); if nothing was,
the turn ends silently and the message runs again after the restart.  A crash leaves
the decision to the next start (:meth:`dshim.pipeline.runtime.BotRuntime.restore`).

Errors: the harness adapters raise only :class:`~dshim.errors.HarnessError` (each maps
its foreign exceptions — httpx, pipes, JSON — at its own boundary), the channel's
outbound only :class:`~dshim.errors.ChannelError`, the store only
:class:`~dshim.errors.StoreError`.  A harness failure becomes one visible error reply
with the partial answer kept; a delivery failure is logged; a store failure gets a short
"something went wrong" reply.  Running out of memory while the answer grows drops the
partial answer and fails the turn the same way: one error reply, and the bot goes on.
Any other exception is a bug: it is not dressed up as a failed turn but propagates, and
the bot's supervisor restarts (or stops) the bot.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import structlog
import trio

from dshim import prompt as prompt_mod
from dshim import reply as reply_mod
from dshim.config import DEFAULT_MAX_FILE_BYTES, BotConfig
from dshim.errors import (
    ChannelError,
    DshimError,
    FencedError,
    HarnessError,
    NotFound,
    StoreError,
    TooLarge,
)
from dshim.harness.base import Harness, HasAgentCommands, TurnContext
from dshim.metrics import NO_METRICS, BotMetrics
from dshim.model import (
    AGENT_FAILED_NOTE,
    ATTACHMENT_KINDS,
    ApprovalRequest,
    Delivered,
    FilePart,
    ImagePart,
    InboundMessage,
    MediaRef,
    MissingFile,
    PromptPart,
    QuestionRequest,
    ReadsHistory,
    ReplyTarget,
    TextDelta,
    ToolProgress,
    TurnEnd,
)
from dshim.outbound import Outbound, ReplyStream, watch_delivery, watch_stop
from dshim.pipeline import files as files_mod
from dshim.pipeline.files import FileStash
from dshim.pipeline.interactions import Interactions
from dshim.pipeline.lanes import Lane, LaneItem
from dshim.pipeline.notices import Notifier, outcome_of
from dshim.pipeline.observer import Observer
from dshim.pipeline.substitute import SubstituteGate, send_control_notice
from dshim.store.base import OutboundEntry, PromptRow, Store, TurnRecord

if TYPE_CHECKING:
    from dshim.capture import BotCapture

log = structlog.get_logger("dshim.turn")
_ids = random.Random()

MAX_IMAGES = 20
IMAGE_MAX_BYTES = 5 * 1024 * 1024
IMAGES_TOTAL_BYTES = 20 * 1024 * 1024
FILE_MAX_BYTES = DEFAULT_MAX_FILE_BYTES
MEDIA_DEADLINE_S = 60.0
STOPPED_MARK = "⏹ Stopped."
CUT_MARK = "✂️ Cut short: dshim was restarted while answering. Send your message again for a complete answer."
TOO_LARGE = "the answer was too large to handle (dshim ran out of memory)"
EMPTY_ANSWER = "(The agent returned an empty answer.)"


async def fetch_media(
    msg: InboundMessage,
    stash: FileStash | None = None,
    *,
    max_file_bytes: int = FILE_MAX_BYTES,
) -> tuple[list[ImagePart], list[FilePart | MissingFile], list[str]]:
    """Download the current attachments within the core's limits.

    Images become image parts.  Every other attachment is downloaded (at most
    ``max_file_bytes``) and saved in ``stash`` (:mod:`dshim.pipeline.files`): a
    :class:`FilePart` with its path, or a :class:`MissingFile` saying why it could not be
    had (``too-large``, ``not-found``, ``failed``), in attachment order.  Returns the
    parts and notes about what could not be included (told to the agent).  Images without
    a download handle (replayed events) become empty placeholders; such a file is
    ``failed``.
    """
    images: list[ImagePart] = []
    files: list[FilePart | MissingFile] = []
    notes: list[str] = []
    if not msg.images and not msg.files:
        return images, files, notes
    total = 0
    with trio.move_on_after(MEDIA_DEADLINE_S) as scope:
        for i, ref in enumerate(msg.images):
            label = ref.name or f"image {i + 1}"
            if i >= MAX_IMAGES:
                notes.append(
                    f"[{len(msg.images) - MAX_IMAGES} more image(s) not included: at most {MAX_IMAGES} per message]"
                )
                break
            got = await _fetch(ref, min(IMAGE_MAX_BYTES, IMAGES_TOTAL_BYTES - total), label, notes)
            if isinstance(got, str):
                continue
            data = got
            total += len(data)
            images.append(
                ImagePart(
                    mime=ref.mime or _sniff_image(data) or "application/octet-stream",
                    data=data,
                    name=ref.name,
                )
            )
        for i, ref in enumerate(msg.files, 1):
            files.append(await _fetch_file(msg, ref, i, stash, max_file_bytes, notes))
    if scope.cancelled_caught:
        notes.append("[some attachments were not included: downloading took too long]")
        for i, ref in enumerate(msg.files[len(files) :], len(files) + 1):
            files.append(MissingFile(name=_file_name(ref, i), kind=_kind(ref), reason="failed"))
    return images, files, notes


def _kind(ref: MediaRef) -> str:
    return ref.kind if ref.kind in ATTACHMENT_KINDS else "other"


def _file_name(ref: MediaRef, index: int) -> str:
    return files_mod.display_name(ref.name) or files_mod.default_name(_kind(ref), index, ref.mime)


async def _fetch_file(
    msg: InboundMessage,
    ref: MediaRef,
    index: int,
    stash: FileStash | None,
    limit: int,
    notes: list[str],
) -> FilePart | MissingFile:
    """One current file: downloaded within ``limit`` and saved, or why it could not be."""
    name = _file_name(ref, index)
    kind = _kind(ref)
    if ref.fetch is None:  # a replayed event, or a platform that gave no download handle
        return MissingFile(name=name, kind=kind, reason="failed")
    got = await _fetch(ref, limit, ref.name or f"file {index}", notes)
    if isinstance(got, str):
        return MissingFile(name=name, kind=kind, reason=got)
    if stash is None:
        log.warning("file_not_saved", reason="no data directory")
        return MissingFile(name=name, kind=kind, reason="failed")
    try:
        path = await stash.save(msg.conversation_id, msg.message_id, index, name, got)
    except OSError as exc:
        log.warning("file_save_failed", error=f"{type(exc).__name__}: {exc.strerror or exc}")
        notes.append(f"[{ref.name or f'file {index}'} could not be saved for the agent]")
        return MissingFile(name=name, kind=kind, reason="failed")
    return FilePart(
        name=name,
        path=str(path),
        size=len(got),
        mime=files_mod.media_type(ref.mime, name),
        kind=kind,
        data=got if len(got) <= prompt_mod.FILE_INLINE_MAX else b"",
    )


async def _fetch(ref: MediaRef, limit: int, label: str, notes: list[str]) -> bytes | str:
    """The attachment's bytes, or why not (``too-large``, ``not-found``, ``failed``), with
    a note for the agent.  Without a download handle: empty bytes."""
    if ref.size is not None and ref.size > limit:  # declared too large: nothing is fetched
        notes.append(f"[{label} not included: {ref.size} bytes is over the {limit} byte limit]")
        return "too-large"
    if ref.fetch is None:
        return b""
    try:
        data = await ref.fetch(limit)
    except TooLarge:
        notes.append(f"[{label} not included: over the {limit} byte limit]")
        return "too-large"
    except ChannelError as exc:
        notes.append(f"[{label} could not be downloaded: {exc}]")
        return "not-found" if isinstance(exc, NotFound) else "failed"
    if len(data) > limit:
        notes.append(f"[{label} not included: over the {limit} byte limit]")
        return "too-large"
    return data


def _sniff_image(data: bytes) -> str | None:
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    return None


def compose_final(text: str, *, error: str | None, stopped: bool, cut: bool = False) -> str:
    """The text the user finally sees for a turn (``cut``: by a shutdown, not by /stop)."""
    body = text.strip()
    if cut:
        return f"{body}\n\n{CUT_MARK}" if body else CUT_MARK
    if stopped:
        return f"{body}\n\n{STOPPED_MARK}" if body else STOPPED_MARK
    if error is not None:
        note = f"{AGENT_FAILED_NOTE} {error}"
        return f"{body}\n\n{note}" if body else note
    return body or EMPTY_ANSWER


@dataclass(frozen=True, slots=True)
class TurnDeps:
    """What a turn needs of its bot; the runtime builds it once per bot."""

    bot: BotConfig
    store: Store
    harness: Harness
    outbound: Outbound
    notifier: Notifier
    interactions: Interactions
    clock: Callable[[], float]
    observer: Observer | None = None
    metrics: BotMetrics = NO_METRICS
    substitute: SubstituteGate | None = None
    #: Where the turn saves current files for the agent (None: nowhere, they are listed
    #: as ``failed``).
    files: FileStash | None = None
    #: Wakes the bot's outbox worker when an answer was postponed.
    outbox_wake: Callable[[], None] | None = None
    #: ``serve --capture``: told of the quote's resolution and the answer (None: off).
    capture: BotCapture | None = None


class _Turn:
    """One turn's state, from the lane item to the record written at the end."""

    __slots__ = (
        "item",
        "msg",
        "id",
        "target",
        "title_source",
        "started_at",
        "text",
        "error",
        "prompt_sent",
        "prompt_text",
        "prompt_recorded",
        "session_id",
        "delivered",
        "first_delta_at",
        "opened_session",
        "notes",
        "postponed",
    )

    def __init__(self, item: LaneItem, *, started_at: float) -> None:
        msg = item.msg
        self.item = item
        self.id = f"{_ids.getrandbits(48):012x}"  # for log lines only: no syscall per turn
        self.target = ReplyTarget.for_message(msg)
        self.title_source = item.title_text if item.title_text is not None else msg.content
        self.msg = msgspec.structs.replace(msg, content=item.text) if item.text is not None else msg
        self.started_at = started_at
        #: The answer so far (TextDelta pieces joined).
        self.text = ""
        #: Why the turn failed, in words for the user (None: it did not fail).
        self.error: str | None = None
        self.prompt_sent = False
        #: The prompt as the transcript keeps it, and whether its row is written yet.
        self.prompt_text = ""
        self.prompt_recorded = False
        self.session_id: str | None = None
        self.delivered: list[Delivered] = []
        #: When the agent's first text arrived (the first-delta histogram).
        self.first_delta_at: float | None = None
        #: This turn bound a new session (a substitute turn's control notice is due).
        self.opened_session = False
        #: What the harness asked to tell the user as the turn ended (TurnContext.notes).
        self.notes: list[str] = []
        #: The final text went to the outbox (its inbox entry stays until delivered).
        self.postponed = False


class _Delivery:
    """Records, durably and before the fact, that a turn may have shown the user something.

    The turn's inbox entries move to ``delivered`` right before the first send of the
    answer (or of an interaction prompt): after a crash from then on the message gets a
    notice instead of a second answer; before it, nothing was shown and it runs again.
    The prompt's transcript row is written in the same store call (one round trip, and a
    turn that runs again after a crash is in the transcript once).
    """

    __slots__ = ("_store", "_bot", "_turn", "marked", "due")

    def __init__(self, store: Store, bot: str, turn: _Turn) -> None:
        self._store = store
        self._bot = bot
        self._turn = turn
        self.marked = False
        #: The stream cannot report its first send (see dshim.outbound.watch_delivery):
        #: mark before anything is handed to it.
        self.due = False

    async def mark(self) -> None:
        if self.marked:
            return
        self.marked = True
        self.due = False
        turn = self._turn
        prompt = None
        if turn.prompt_sent and turn.session_id is not None:
            prompt = PromptRow(
                session_id=turn.session_id, text=turn.prompt_text, at=turn.started_at
            )
        try:
            await self._store.mark_delivered(self._bot, turn.item.inbox_keys, prompt=prompt)
        except FencedError:
            raise  # another instance runs the bot now: this one must not deliver
        except StoreError as exc:  # deliver anyway: a rare duplicate beats a lost answer
            log.warning("delivery_mark_failed", error=str(exc))
        else:
            turn.prompt_recorded = prompt is not None


async def run_turn(deps: TurnDeps, item: LaneItem, lane: Lane) -> None:
    """Run one turn end to end: prepare, ensure the session, relay, record.

    Never raises except for cancellation and bugs; finishes the item's inbox entries.
    """
    turn = _Turn(item, started_at=deps.clock())
    delivery = _Delivery(deps.store, deps.bot.name, turn)
    stop_scope = trio.CancelScope()
    lane.stop_scope = stop_scope
    msg = turn.msg
    answer: str | None = None  # the final text, once it is handed to the platform
    # Bound by hand (bound_contextvars is a generator context manager: every turn pays it).
    tokens = structlog.contextvars.bind_contextvars(conversation=msg.conversation_id, turn=turn.id)
    try:
        log.debug("turn_started", message_id=msg.message_id)
        try:
            if msg.substitute is not None and deps.substitute is not None:
                turn.target = await deps.substitute.target_for(msg, turn.target)
            async with deps.outbound.open_stream(turn.target) as stream:
                # A stream that cannot report its first send: what it is handed counts as shown.
                delivery.due = not watch_delivery(stream, delivery.mark)
                watch_stop(stream, lane.stop)  # a platform stop button ends it like /stop
                with stop_scope:
                    parts = await _prepare(deps, turn)
                    if await _ensure_session(deps, turn):
                        await _relay(deps, turn, stream, parts, delivery)
                stopped = stop_scope.cancelled_caught
                cut = stopped and lane.stop_reason == "shutdown"
                if cut and not delivery.marked:
                    # Nothing was shown: leave the message to run again after the restart.
                    log.info("turn_left_for_restart", prompt_sent=turn.prompt_sent)
                    deps.metrics.turn("stopped", duration_s=deps.clock() - turn.started_at)
                    return
                if stopped and not turn.prompt_sent:
                    log.info("turn_stopped_before_prompt")
                if deps.capture is not None and turn.prompt_sent:
                    deps.capture.answered(msg.conversation_id, turn.text, turn.error)
                final = compose_final(turn.text, error=turn.error, stopped=stopped, cut=cut)
                if turn.notes:
                    final = "\n\n".join([final, *turn.notes])
                if delivery.due:
                    await delivery.mark()
                answer = final
                turn.delivered = await stream.finish(final)
                if deps.capture is not None:
                    deps.capture.sent(turn.target, turn.delivered)
        except ChannelError as exc:
            log.warning("reply_failed", error=str(exc))
            turn.error = turn.error or f"delivery failed: {exc}"
            if answer is not None and outcome_of(exc) == "later":
                # Certainly not delivered, the platform is down or busy: the outbox
                # delivers it when the platform is back, also after a restart.
                await _postpone(deps, turn, answer)
        except (DshimError, MemoryError) as exc:  # the store failed, or memory ran out
            log.warning("turn_failed", error=str(exc), kind=type(exc).__name__)
            if isinstance(exc, MemoryError):
                turn.text = ""  # not worth keeping (nor writing to the transcript)
            turn.error = turn.error or str(exc) or type(exc).__name__
            await deps.notifier.send_now(
                turn.target, f"⚠️ Something went wrong while answering: {type(exc).__name__}"
            )
        await _record(deps, turn, stopped=stop_scope.cancelled_caught)
    finally:
        structlog.contextvars.reset_contextvars(**tokens)


async def _prepare(deps: TurnDeps, turn: _Turn) -> list[PromptPart]:
    """Mark the turn running, resolve the quote, fetch the media, assemble the prompt."""
    msg = turn.msg
    key = msg.lane_key
    binding = await deps.store.begin_turn(
        deps.bot.name,
        key[0],
        key[1],
        turn.item.inbox_keys,
        last_direct=(msg.conversation_id, turn.started_at)
        if msg.conversation_type == "direct"
        else None,
    )
    turn.session_id = binding.session_id if binding else None
    quoted = None
    if msg.reply_to is not None:
        ctx = reply_mod.ResolveContext(
            store=deps.store,
            bot=deps.bot.name,
            bot_id=msg.bot_id,
            conversation_id=msg.conversation_id,
            session_id=turn.session_id,
            budget=deps.bot.reply,
            clock=deps.clock,
            on_result=deps.metrics.reply_lookup,
            history=deps.harness if isinstance(deps.harness, ReadsHistory) else None,
        )
        if deps.capture is None:
            quoted = await reply_mod.resolve(msg.reply_to, ctx)
        else:
            async with deps.capture.resolving(msg, deps.store, turn.session_id):
                quoted = await reply_mod.resolve(msg.reply_to, ctx)
    command = _agent_command(deps.harness, turn)
    if command is not None:
        return prompt_mod.command_parts(command)
    images, files, notes = await fetch_media(
        msg, deps.files, max_file_bytes=deps.bot.max_file_bytes
    )
    return prompt_mod.assemble(
        msg, quoted, deps.bot.prompt, images=images, files=files, notes=notes
    )


def _agent_command(harness: Harness, turn: _Turn) -> str | None:
    """The turn's text when it is an agent command: ``/agent <command>``, or a typed
    ``/<name>`` that the agent lists among its commands (and dshim has none of)."""
    text = turn.msg.content
    if turn.item.agent_command:
        return text.strip()
    if not isinstance(harness, HasAgentCommands):
        return None
    return prompt_mod.agent_command(text, {c.name.lower() for c in harness.agent_commands})


async def _ensure_session(deps: TurnDeps, turn: _Turn) -> bool:
    """Bind a new harness session when the conversation has none.  False if it failed."""
    if turn.session_id is not None:
        await _control_notice(deps, turn, turn.session_id)
        return True
    title = prompt_mod.session_title(turn.title_source)
    try:
        session_id = await deps.harness.create_session(title=title)
    except HarnessError as exc:  # e.g. the agent cannot be started
        turn.error = str(exc)
        log.warning("harness_failed", error=turn.error, code=exc.code)
        return False
    key = turn.msg.lane_key
    await deps.store.set_binding(deps.bot.name, *key, session_id, title=title, now=deps.clock())
    log.info("session_bound", session=session_id)
    turn.session_id = session_id
    turn.opened_session = True
    await _control_notice(deps, turn, session_id)
    return True


async def _control_notice(deps: TurnDeps, turn: _Turn, session_id: str) -> None:
    sub = turn.msg.substitute
    if sub is not None and not sub.in_topic and deps.substitute is not None:
        # Before the answer: the operators learn what was asked and can take over (their
        # "stop" button stops this very turn).  Sent here, not queued: one call per
        # operator, once per session — the session's first substitute turn, or the next
        # one when no operator could be told.
        await send_control_notice(
            deps.substitute, deps.outbound, deps.notifier, turn.msg, session_id
        )


async def _relay(
    deps: TurnDeps,
    turn: _Turn,
    stream: ReplyStream,
    parts: list[PromptPart],
    delivery: _Delivery,
) -> None:
    """Hand the prompt to the harness and its events to the stream and the interactions."""
    msg = turn.msg
    session_id = turn.session_id
    assert session_id is not None
    if deps.observer is not None:
        deps.observer.on_prompt(msg, parts)
    # The transcript row is written with the delivery mark (or with the record at the end).
    turn.prompt_text = prompt_mod.prompt_text(parts)
    turn.prompt_sent = True
    tctx = TurnContext(
        bot=deps.bot.name,
        conversation_id=msg.conversation_id,
        thread_id=msg.thread_id,
        sender_id=msg.sender_id,
        conversation_type=msg.conversation_type,
        notes=turn.notes,
    )
    # A substitute turn in the chat answers like a person: one finished message (unless
    # configured to stream); in a topic/thread it streams like any turn there (the seed's
    # topic sessions do).  Decided per turn, never latched on the session.
    live = msg.substitute is None or msg.substitute.in_topic or msg.substitute.stream
    try:
        async with aclosing(deps.harness.prompt(session_id, parts, tctx)) as events:
            async for ev in events:
                if isinstance(ev, TextDelta):
                    if turn.first_delta_at is None:
                        turn.first_delta_at = deps.clock()
                    turn.text += ev.text
                    if not live:
                        continue
                    if delivery.due:
                        await delivery.mark()
                    await stream.update(turn.text)
                elif isinstance(ev, ToolProgress):
                    if not live:
                        continue
                    if delivery.due:
                        await delivery.mark()
                    await stream.progress(f"{ev.title} ({ev.status})")
                elif isinstance(ev, (ApprovalRequest, QuestionRequest)):
                    await delivery.mark()  # the request is shown to the user
                    await deps.interactions.ask(ev, msg)
                elif isinstance(ev, TurnEnd):
                    turn.error = ev.error
                    break
    except HarnessError as exc:
        turn.error = str(exc)
        log.warning("harness_failed", error=turn.error, code=exc.code)
    except MemoryError:
        # An answer too large to hold: let go of it (the memory is what we lack) and say so.
        turn.text = ""
        turn.error = TOO_LARGE
        log.warning("turn_out_of_memory")


def _inbox_key(msg: InboundMessage) -> tuple[str, str]:
    return (msg.conversation_id, msg.message_id)


async def _postpone(deps: TurnDeps, turn: _Turn, text: str) -> None:
    msg = turn.msg
    if _inbox_key(msg) not in turn.item.inbox_keys:
        return  # nothing in the inbox to deliver it from after a restart
    await deps.store.outbox_put(
        deps.bot.name, msg.conversation_id, msg.message_id, text, now=deps.clock()
    )
    turn.postponed = True
    log.warning("answer_postponed", message_id=msg.message_id, chars=len(text))
    if deps.outbox_wake is not None:
        deps.outbox_wake()


async def _record(deps: TurnDeps, turn: _Turn, *, stopped: bool) -> None:
    """Write the turn's answer, delivered messages and inbox completion in one go."""
    completed_at = deps.clock()
    delivered = turn.delivered
    await deps.store.record_turn(
        deps.bot.name,
        turn.msg.conversation_id,
        TurnRecord(
            session_id=turn.session_id if turn.prompt_sent else None,
            # Usually written already, with the delivery mark (before the first send).
            user_text=turn.prompt_text if turn.prompt_sent and not turn.prompt_recorded else None,
            user_at=turn.started_at,
            answer_text=turn.text,
            answer_at=delivered[0].sent_at if delivered else completed_at,
            completed=turn.error is None and not stopped,
            delivered=[OutboundEntry.from_delivered(d) for d in delivered],
            inbox_done=[k for k in turn.item.inbox_keys if k != _inbox_key(turn.msg)]
            if turn.postponed
            else turn.item.inbox_keys,
        ),
        now=completed_at,
    )
    deps.metrics.turn(
        "stopped" if stopped else "error" if turn.error is not None else "ok",
        first_delta_s=None
        if turn.first_delta_at is None
        else turn.first_delta_at - turn.started_at,
        duration_s=completed_at - turn.started_at,
    )
    log.info(
        "turn_finished",
        stopped=stopped,
        failed=turn.error is not None,
        messages=len(delivered),
        ms=round((completed_at - turn.started_at) * 1000),
    )
