"""Step 7: one turn — resolve the quote, assemble the prompt, run the harness, stream out.

The stoppable part (reply loading, media download, the harness stream) runs inside the
lane's stop scope: ``/stop`` cancels it, the partial answer is delivered marked as
stopped, and no prompt is sent if the stop came while the quote was still loading.
Shutdown cancels the whole turn.  A harness failure becomes one visible error reply;
nothing here lets an exception kill the lane.
"""

from __future__ import annotations

import uuid
from contextlib import aclosing
from typing import TYPE_CHECKING

import structlog
import trio

from dshim import prompt as prompt_mod
from dshim import reply as reply_mod
from dshim.errors import BUG_TYPES, ChannelError, HarnessError
from dshim.harness.base import TurnContext
from dshim.model import (
    ApprovalRequest,
    Delivered,
    FilePart,
    ImagePart,
    InboundMessage,
    MediaRef,
    PromptPart,
    QuestionRequest,
    ReplyTarget,
    TextDelta,
    TextPart,
    ToolProgress,
    TurnEnd,
)
from dshim.pipeline.lanes import Lane
from dshim.store.base import OutboundEntry, TurnRecord

if TYPE_CHECKING:
    from dshim.pipeline.runtime import BotRuntime, LaneItem

log = structlog.get_logger("dshim.turn")

MAX_IMAGES = 20
IMAGE_MAX_BYTES = 5 * 1024 * 1024
IMAGES_TOTAL_BYTES = 20 * 1024 * 1024
FILE_MAX_BYTES = 20 * 1024 * 1024
MEDIA_DEADLINE_S = 60.0
STOPPED_MARK = "⏹ Stopped."
EMPTY_ANSWER = "(The agent returned an empty answer.)"


async def fetch_media(msg: InboundMessage) -> tuple[list[ImagePart], list[FilePart], list[str]]:
    """Download the current attachments within the core's limits.

    Returns the parts and notes about what could not be included (told to the agent).
    Attachments without a download handle (replayed events) become empty placeholders.
    """
    images: list[ImagePart] = []
    files: list[FilePart] = []
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
            data = await _fetch(ref, min(IMAGE_MAX_BYTES, IMAGES_TOTAL_BYTES - total), label, notes)
            if data is None:
                continue
            total += len(data)
            images.append(
                ImagePart(
                    mime=ref.mime or _sniff_image(data) or "application/octet-stream",
                    data=data,
                    name=ref.name,
                )
            )
        for i, ref in enumerate(msg.files):
            label = ref.name or f"file {i + 1}"
            data = await _fetch(ref, FILE_MAX_BYTES, label, notes)
            if data is None:
                continue
            files.append(FilePart(name=ref.name or f"file-{i + 1}", data=data, mime=ref.mime))
    if scope.cancelled_caught:
        notes.append("[some attachments were not included: downloading took too long]")
    return images, files, notes


async def _fetch(ref: MediaRef, limit: int, label: str, notes: list[str]) -> bytes | None:
    if ref.size is not None and ref.size > limit:
        notes.append(f"[{label} not included: {ref.size} bytes is over the {limit} byte limit]")
        return None
    if ref.fetch is None:
        return b""
    try:
        data = await ref.fetch(limit)
    except ChannelError as exc:
        notes.append(f"[{label} could not be downloaded: {exc}]")
        return None
    if len(data) > limit:
        notes.append(f"[{label} not included: over the {limit} byte limit]")
        return None
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


def compose_final(text: str, *, error: str | None, stopped: bool) -> str:
    """The text the user finally sees for a turn."""
    body = text.strip()
    if stopped:
        return f"{body}\n\n{STOPPED_MARK}" if body else STOPPED_MARK
    if error is not None:
        note = f"⚠️ The agent failed: {error}"
        return f"{body}\n\n{note}" if body else note
    return body or EMPTY_ANSWER


async def run_turn(rt: BotRuntime, item: LaneItem, lane: Lane) -> None:
    """Run one turn end to end.  Never raises except for cancellation and bugs."""
    msg = item.msg
    turn_id = uuid.uuid4().hex[:12]
    key = msg.lane_key
    store = rt.store
    bot = rt.bot.name
    target = ReplyTarget.for_message(msg)
    title_source = item.title_text if item.title_text is not None else msg.content
    if item.text is not None:
        msg = _with_text(msg, item.text)
    stop_scope = trio.CancelScope()
    lane.stop_scope = stop_scope
    text = ""
    error: str | None = None
    prompt_sent = False
    session_id: str | None = None
    started_at = rt.clock()
    delivered: list[Delivered] = []
    with structlog.contextvars.bound_contextvars(conversation=msg.conversation_id, turn=turn_id):
        log.info("turn_started", message_id=msg.message_id)
        try:
            async with rt.outbound.open_stream(target) as stream:
                with stop_scope:
                    binding = await store.begin_turn(
                        bot,
                        key[0],
                        key[1],
                        item.inbox_keys,
                        last_direct=(msg.conversation_id, started_at)
                        if msg.conversation_type == "direct"
                        else None,
                    )
                    session_id = binding.session_id if binding else None
                    quoted = None
                    if msg.reply_to is not None:
                        ctx = reply_mod.ResolveContext(
                            store=store,
                            bot=bot,
                            conversation_id=msg.conversation_id,
                            session_id=session_id,
                            budget=rt.bot.reply,
                            clock=rt.clock,
                        )
                        quoted = await reply_mod.resolve(msg.reply_to, ctx)
                    images, files, notes = await fetch_media(msg)
                    parts: list[PromptPart] = list(
                        prompt_mod.assemble(msg, quoted, rt.bot.prompt, images=images, files=files)
                    )
                    if notes:
                        parts.insert(_after_text(parts), TextPart("\n".join(notes)))
                    if session_id is None:
                        title = prompt_mod.session_title(title_source)
                        try:
                            session_id = await rt.harness.create_session(title=title)
                        except HarnessError as exc:  # e.g. the agent cannot be started
                            error = str(exc)
                            log.warning("harness_failed", error=error, code=exc.code)
                        else:
                            await store.set_binding(
                                bot, *key, session_id, title=title, now=rt.clock()
                            )
                            log.info("session_bound", session=session_id)
                    if session_id is not None:
                        if rt.observer is not None:
                            rt.observer.on_prompt(msg, parts)
                        await store.append_transcript(
                            bot,
                            session_id,
                            "user",
                            prompt_mod.prompt_text(parts),
                            at=started_at,
                            completed=True,
                        )
                        prompt_sent = True
                        tctx = TurnContext(
                            bot=bot,
                            conversation_id=msg.conversation_id,
                            thread_id=msg.thread_id,
                            sender_id=msg.sender_id,
                            conversation_type=msg.conversation_type,
                        )
                        try:
                            async with aclosing(
                                rt.harness.prompt(session_id, parts, tctx)
                            ) as events:
                                async for ev in events:
                                    if isinstance(ev, TextDelta):
                                        text += ev.text
                                        await stream.update(text)
                                    elif isinstance(ev, ToolProgress):
                                        await stream.progress(f"{ev.title} ({ev.status})")
                                    elif isinstance(ev, (ApprovalRequest, QuestionRequest)):
                                        await rt.interactions.ask(ev, msg)
                                    elif isinstance(ev, TurnEnd):
                                        error = ev.error
                                        break
                        except HarnessError as exc:
                            error = str(exc)
                            log.warning("harness_failed", error=error, code=exc.code)
                        except Exception as exc:
                            if isinstance(exc, BUG_TYPES):
                                log.exception("harness_crashed")
                            else:
                                log.warning("harness_failed", error=str(exc))
                            error = str(exc) or type(exc).__name__
                stopped = stop_scope.cancelled_caught
                if stopped and not prompt_sent:
                    log.info("turn_stopped_before_prompt")
                final = compose_final(text, error=error, stopped=stopped)
                delivered = await stream.finish(final)
        except ChannelError as exc:
            log.warning("reply_failed", error=str(exc))
            error = error or f"delivery failed: {exc}"
        except Exception as exc:
            if isinstance(exc, BUG_TYPES):
                log.exception("turn_crashed")
            else:
                log.warning("turn_failed", error=str(exc))
            error = error or str(exc)
            await rt._send_now(
                target, f"⚠️ Something went wrong while answering: {type(exc).__name__}"
            )
        completed_at = rt.clock()
        stopped = stop_scope.cancelled_caught
        await store.record_turn(
            bot,
            msg.conversation_id,
            TurnRecord(
                session_id=session_id if prompt_sent else None,
                user_text=None,  # written before the harness call (adapters read the transcript)
                user_at=started_at,
                answer_text=text,
                answer_at=delivered[0].sent_at if delivered else completed_at,
                completed=error is None and not stopped,
                delivered=[OutboundEntry.from_delivered(d) for d in delivered],
                inbox_done=item.inbox_keys,
            ),
            now=completed_at,
        )
        log.info(
            "turn_finished",
            stopped=stop_scope.cancelled_caught,
            failed=error is not None,
            messages=len(delivered),
            ms=round((completed_at - started_at) * 1000),
        )


def _after_text(parts: list[PromptPart]) -> int:
    last = -1
    for i, p in enumerate(parts):
        if isinstance(p, TextPart):
            last = i
    return last + 1


def _with_text(msg: InboundMessage, text: str) -> InboundMessage:
    import msgspec

    return msgspec.structs.replace(msg, content=text)
