"""WeCom outbound: native stream replies, rotation, overflow, pushes and button cards.

An answer is a native stream bound to the user's message (``aibot_respond_msg`` with the
inbound ``req_id``, :class:`WecomCalls` on the native-stream engine of
:mod:`dshim.streams.native`):

1. as soon as the turn starts, a first frame with a new ``stream.id`` and
   :data:`~.protocol.THINKING_MARK` opens the bubble (it shows none of the answer, so the
   pipeline's delivery hook runs only before the first frame with answer text);
2. then the whole text so far (``content`` replaces), at most every 800 ms; frames go
   one at a time and each waits for its ack, so text that arrives meanwhile is merged and
   only the newest is sent (an intermediate frame is skipped while the previous one is
   unacked);
3. ``finish`` sends exactly one ``finish: true`` frame with the final text.

Size: a stream shows at most :data:`~.protocol.STREAM_MAX_BYTES` (18,000 UTF-8 bytes, under
WeCom's 20,480); the rest of a long answer goes as ``aibot_send_msg`` markdown messages to
the same chat, split at paragraph, line or word boundaries.  Lifetime: a stream expires 6
minutes after its first frame (846608), so a stream that has been open for
:data:`~.protocol.STREAM_ROTATE_S` is finished with the text so far and the answer
continues on a new stream id under the same ``req_id``; an unexpected 846608 does the
same.  846605 (the ``req_id`` is no longer valid), a closed socket (the pending frame
fails), or a message older than 24 h: the rest of the answer — everything not yet shown
in a finished bubble — is delivered by ``aibot_send_msg`` once the socket is back.

Failures follow :mod:`dshim.render`'s rules (``Limits.send_retry_s``,
``unknown_repeat_wait_s``).  A frame that certainly did nothing (a server-error ack, or
the socket was down so it never went out) is retried with backoff for ``send_retry_s``,
once a socket is up again.  A stream frame names its bubble and carries the whole text,
so one whose ack never came is sent again too (replace semantics make it harmless).  A
push has no such key (WeCom keeps no record of its req_id): one whose ack never came is
repeated once, with a new req_id, after ``unknown_repeat_wait_s`` and once a socket is up
and subscribed; a second lost ack gives up (two copies at most, never a loop).  An answer
still not delivered is raised as a :class:`TransportError` with ``request_sent`` False
for the pipeline's outbox, and the bubble it left open is remembered: the outbox's
delivery finishes that same bubble (:meth:`WecomOutbound.send_text`; after a restart a
new bubble, the old one expires 6 minutes after it opened).

Budget: every new stream and every push counts against the conversation's 30/minute and
1,000/hour (:class:`~.protocol.Budget`); a send waits for room instead of exceeding it.
A rate-limit errcode is retried with backoff, never taken as a lost answer.

Approvals and questions (:meth:`WecomOutbound.open_interaction`): a ``button_interaction``
template card, attached to the running stream of the same message
(``stream_with_template_card``, once per message) or else pushed as a ``template_card``
message.  A click arrives as ``template_card_event``; the channel updates the card within
5 s and hands the pipeline the typed answer the button stands for.  Typed answers work
as everywhere.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import structlog
import trio

from dshim.channels.base import InteractionPrompt, PresentsInteractions
from dshim.channels.kit import Backoff
from dshim.channels.wecom import protocol as p
from dshim.channels.wecom.client import WecomLink
from dshim.errors import ChannelError, RateLimited, TransportError, outcome_unknown
from dshim.model import Delivered, Option, ReplyTarget
from dshim.render import BACKOFF_MAX_S, Limits, split_text
from dshim.streams.native import BoundCalls, NativeStream, Step, open_native_stream

log = structlog.get_logger("dshim.wecom")

Clock = Callable[[], float]
#: Waiting for rate limits, per call, before the call gives up.
RATE_LIMIT_BUDGET_S = 900.0
#: Bubbles left open by answers the outbox keeps (per inbound req_id), at most.
OPEN_BUBBLES_MAX = 1024
#: Intermediate frames failing in a row before the previews stop.
PREVIEW_FAILURES = 3


def split(text: str) -> list[str]:
    """The messages a text is delivered in: the stream's part, then the pushes."""
    return split_text(text, p.STREAM_MAX_BYTES, p.utf8_len)


def new_stream_id() -> str:
    return "dshim-" + secrets.token_hex(8)


def _short(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__)[:300]


def unsure(exc: ChannelError) -> bool:
    """Whether a failed frame may have been carried out: it went out and no ack came
    (none in 5 s, or the socket closed first).  An ack, even a server error, is an answer;
    a frame that could not be written (the socket was down) certainly did nothing."""
    return outcome_unknown(exc)


def _undelivered(what: str, exc: ChannelError) -> TransportError:
    """The error an answer ends with when the outbox is to deliver it later."""
    return TransportError(f"{what}: {_short(exc)}", request_sent=False)


@dataclass(frozen=True, slots=True)
class RenderTuning:
    interval_s: float = p.STREAM_INTERVAL_S
    rotate_s: float = p.STREAM_ROTATE_S


@dataclass(slots=True)
class PendingCard:
    """A card whose buttons still wait for a click."""

    conversation: str
    title: str
    options: list[Option]


class WecomOutbound(PresentsInteractions):
    """The channel's :class:`dshim.outbound.Outbound`, with button cards."""

    def __init__(
        self,
        link: WecomLink,
        *,
        clock: Clock,
        budget: p.Budget | None = None,
        tuning: RenderTuning | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.link = link
        self.clock = clock
        self.budget = budget or p.Budget()
        self.tuning = tuning or RenderTuning()
        self.limits = limits or Limits(max_len=p.STREAM_MAX_BYTES, measure=p.utf8_len)
        self.bot_username: str | None = None
        self._streams: dict[str, WecomCalls] = {}
        self._carded: OrderedDict[str, None] = OrderedDict()
        self._cards: dict[str, PendingCard] = {}
        #: inbound req_id -> the stream id of a bubble an undelivered answer left open.
        self._open: OrderedDict[str, str] = OrderedDict()

    # -- what the channel asks -------------------------------------------------------------

    def card(self, task_id: str) -> PendingCard | None:
        return self._cards.get(task_id)

    # -- low level -------------------------------------------------------------------------

    async def room(self, conversation: str) -> None:
        """Wait until the conversation's budget has room for one more message, take it."""
        while True:
            wait = self.budget.wait_time(conversation, trio.current_time())
            if wait <= 0:
                self.budget.take(conversation, trio.current_time())
                return
            log.info("send_budget_waited", wait_s=round(wait, 2))
            await trio.sleep(wait)

    def backoff(self) -> Backoff:
        first = self.limits.retry_backoff_s
        return Backoff(first, max(BACKOFF_MAX_S, first), 2.0, jitter=0.0)

    def deadline(self) -> float:
        """When a send starting now has spent its ``send_retry_s``."""
        return trio.current_time() + self.limits.send_retry_s

    async def call(
        self,
        cmd: str,
        req_id: str,
        body: Any,
        *,
        what: str,
        bound: int | None = None,
        give_up_at: float | None = None,
        idempotent: bool = False,
    ) -> p.Ack:
        """One request, retried with backoff until ``give_up_at`` (default: now +
        ``send_retry_s``; then the last failure is raised) while it certainly did nothing:
        a server-error ack, or the socket was down so the frame never went out (retried
        once a socket is up again).  Rate limits are waited out as asked (within
        :data:`RATE_LIMIT_BUDGET_S`).  A frame of unknown outcome (it went out, no ack
        came) is raised at once unless ``idempotent`` (a stream frame: same id, whole
        content, repeating it changes nothing).  ``bound`` frames belong to the socket
        of that generation: once it is gone they fail at once with ConnectionLost."""
        backoff = self.backoff()
        waited = 0.0
        if give_up_at is None:
            give_up_at = self.deadline()
        while True:
            try:
                return await self.link.request(cmd, req_id, body, what=what, bound=bound)
            except TransportError as exc:
                if isinstance(exc, p.ConnectionLost) and bound is not None:
                    raise
                if unsure(exc) and not idempotent:
                    raise
                if isinstance(exc, p.ConnectionLost) and not self.link.live:
                    if trio.current_time() >= give_up_at:
                        raise
                    log.info("send_waiting_for_socket", what=what, error=_short(exc))
                    with trio.move_on_at(give_up_at):
                        await self.link.wait_live()
                    continue
                delay = backoff.next_delay()
                if trio.current_time() + delay > give_up_at:
                    raise
                log.info("send_retry", what=what, error=_short(exc), retry_in_s=delay)
                await trio.sleep(delay)
            except RateLimited as exc:
                delay = backoff.next_delay(retry_after=exc.retry_after)
                waited += delay
                if waited > RATE_LIMIT_BUDGET_S:
                    raise
                log.info("send_rate_limited", what=what, retry_in_s=delay)
                await trio.sleep(delay)

    async def until_reachable(self, give_up_at: float) -> None:
        """Before the one repeat of a push of unknown outcome: a pause (the outage that
        lost its ack is likely still on), then until a socket is up and subscribed."""
        now = trio.current_time()
        await trio.sleep(max(0.0, min(self.limits.unknown_repeat_wait_s, give_up_at - now)))
        with trio.move_on_at(give_up_at):  # out of time: the repeat goes now, once
            await self.link.wait_live()

    async def push_one(self, conversation: str, body: dict[str, Any], *, what: str) -> str:
        """One ``aibot_send_msg``; returns its req_id.  WeCom does not deduplicate pushes
        (nothing says a req_id is remembered), so a push whose ack never came is repeated
        once, with a new req_id, after a pause and once the socket is back; a second
        unknown outcome is raised (the user may see it twice, never a loop of copies)."""
        give_up_at = self.deadline()
        lost = 0
        while True:
            req_id = self.link.new_req_id(p.SEND)
            try:
                await self.call(p.SEND, req_id, body, what=what, give_up_at=give_up_at)
                return req_id
            except TransportError as exc:
                if not unsure(exc):
                    raise
                lost += 1
                log.warning("push_unconfirmed", what=what, error=_short(exc), lost=lost)
                if lost > 1:
                    raise
                await self.until_reachable(give_up_at)

    async def push(self, conversation: str, chunks: list[str]) -> list[Delivered]:
        """``aibot_send_msg`` markdown messages, one per chunk, in order (see
        :meth:`push_one` for the retries)."""
        out: list[Delivered] = []
        for chunk in chunks:
            await self.room(conversation)
            sent_at = self.clock()
            req_id = await self.push_one(
                conversation, p.push_markdown_body(conversation, chunk), what="push"
            )
            out.append(
                Delivered(message_id=req_id, text=chunk, sent_at=sent_at, completed_at=self.clock())
            )
        return out

    def keep_open(self, req_id: str, stream_id: str) -> None:
        """Remember a bubble an undelivered answer left open, for the outbox's delivery."""
        self._open[req_id] = stream_id
        self._open.move_to_end(req_id)
        while len(self._open) > OPEN_BUBBLES_MAX:
            self._open.popitem(last=False)

    async def reply_frame(
        self,
        route: p.Route,
        body: dict[str, Any],
        *,
        what: str,
        bound: int | None = None,
        give_up_at: float | None = None,
    ) -> None:
        """A stream frame (idempotent: same stream id, whole content)."""
        await self.call(
            p.RESPOND,
            route.req_id,
            body,
            what=what,
            bound=bound,
            give_up_at=give_up_at,
            idempotent=True,
        )

    def carded(self, req_id: str) -> bool:
        return req_id in self._carded

    def mark_carded(self, req_id: str) -> None:
        self._carded[req_id] = None
        while len(self._carded) > 4096:
            self._carded.popitem(last=False)

    # -- Outbound ----------------------------------------------------------------------------

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        """A notice: a finished one-frame stream under the user's message (the rest, or
        everything when that is not possible, pushed).  The outbox's delivery of an
        answer that left its bubble open finishes that bubble instead."""
        chunks = split(text)
        if not chunks:
            return []
        route = target.route if isinstance(target.route, p.Route) else None
        if route is None or not p.reply_window_open(route.received_at, self.clock()):
            return await self.push(target.conversation_id, chunks)
        sid = self._open.pop(route.req_id, None)
        reused = sid is not None
        if sid is None:
            sid = new_stream_id()
            await self.room(target.conversation_id)
        sent_at = self.clock()
        # The outbox retries a kept bubble itself (with its backoff, every answer in
        # turn): one attempt here, so one answer does not hold up the others while the
        # bubble's 6 minutes run out.
        once = trio.current_time() if reused else None
        body = p.stream_body(sid, chunks[0], finish=True)
        try:
            await self.reply_frame(route, body, what="reply", give_up_at=once)
        except p.ReplyExpired:
            return await self.push(target.conversation_id, chunks)
        except p.StreamExpired:
            if not reused:
                raise
            return await self.send_text(target, text)  # that bubble is gone: a new one
        except TransportError as exc:
            if not reused:
                raise
            # Still the bubble to finish.  Repeated for send_retry_s, maybe without an
            # ack: only ever into this same bubble, so the outbox may try it again.
            self.keep_open(route.req_id, sid)
            if unsure(exc):
                raise _undelivered("reply", exc) from exc
            raise
        first = Delivered(
            message_id=sid, text=chunks[0], sent_at=sent_at, completed_at=self.clock()
        )
        return [first, *await self.push(target.conversation_id, chunks[1:])]

    @asynccontextmanager
    async def open_stream(self, target: ReplyTarget) -> AsyncIterator[NativeStream]:
        """Stream one answer (see the module docstring)."""
        calls = WecomCalls(self, target)
        key = calls.route.req_id if calls.route is not None else None
        if key is not None:
            self._streams[key] = calls
        try:
            async with open_native_stream(calls) as stream:
                yield stream
        finally:
            if key is not None and self._streams.get(key) is calls:
                del self._streams[key]

    @asynccontextmanager
    async def open_interaction(
        self, target: ReplyTarget, prompt: InteractionPrompt
    ) -> AsyncIterator[list[Delivered]]:
        """Show a request as a button card until the block ends."""
        task_id = "dshim_" + secrets.token_hex(8)
        title = "Approval needed" if prompt.kind == "approval" else "Question"
        card = p.interaction_card(task_id, title, prompt.prompt, prompt.options)
        route = target.route if isinstance(target.route, p.Route) else None
        stream = self._streams.get(route.req_id) if route is not None else None
        sent_at = self.clock()
        # Known before it is shown: a click may come before the ack does.
        self._cards[task_id] = PendingCard(target.conversation_id, title, list(prompt.options))
        try:
            shown = False
            if stream is not None and route is not None and not self.carded(route.req_id):
                shown = await stream.attach_card(card)
            if not shown:
                await self.room(target.conversation_id)
                await self.call(
                    p.SEND,
                    self.link.new_req_id(p.SEND),
                    p.push_card_body(target.conversation_id, card),
                    what="card",
                )
        except ChannelError as exc:
            self._cards.pop(task_id, None)
            raise ChannelError(f"card: {_short(exc)}") from exc
        try:
            yield [
                Delivered(
                    message_id=task_id, text=prompt.text, sent_at=sent_at, completed_at=self.clock()
                )
            ]
        finally:
            self._cards.pop(task_id, None)


@dataclass(slots=True)
class _Segment:
    """One stream bubble of the answer: its id, where its text starts, what it shows."""

    id: str
    offset: int
    opened_at: float  # trio time of its first frame
    sent_at: float  # epoch
    shown: str = ""
    #: ``shown`` without a progress note: the part of the answer text it holds.
    plain: str = ""
    has_text: bool = False
    sent_text: bool = False


@dataclass(slots=True)
class _Done:
    id: str
    text: str
    sent_at: float
    completed_at: float


class WecomCalls(BoundCalls[NativeStream]):
    """One streamed answer's frames and pushes, on the native-stream engine
    (:mod:`dshim.streams.native`): the engine merges texts, paces at ``interval_s`` and
    delivers the final text once; these keep WeCom's bubbles (segments), the rotation
    timer and the reply path."""

    shows_notes = True

    def __init__(self, out: WecomOutbound, target: ReplyTarget) -> None:
        self.out = out
        self.target = target
        self.interval_s = out.tuning.interval_s
        self.route = target.route if isinstance(target.route, p.Route) else None
        self._cur: _Segment | None = None
        self._opened = False
        self._segment_opened = trio.Event()
        self._offset = 0
        self._done: list[_Done] = []
        #: The reply path is gone (846605, a closed socket, no route): push the rest.
        self._broken = self.route is None or not p.reply_window_open(
            self.route.received_at, out.clock()
        )
        self._card: dict[str, Any] | None = None
        self._orphan: _Segment | None = None
        self._generation: int | None = None
        self._failures = 0

    # -- frames --------------------------------------------------------------------------------

    def _rest(self, text: str) -> str:
        return text[self._offset :]

    def _display(self) -> str:
        chunks = split(self._rest(self.stream.text))
        body = chunks[0] if chunks else ""
        note = self.stream.note
        if body and note:
            with_note = f"{body}\n\n⏳ {note}"
            if p.utf8_len(with_note) <= p.STREAM_MAX_BYTES:
                return with_note
        return body

    def _display_plain(self) -> str:
        chunks = split(self._rest(self.stream.text))
        return chunks[0] if chunks else ""

    async def _frame(self, content: str, *, finish: bool, give_up_at: float | None = None) -> None:
        """One frame of the current segment (opening a new one when there is none).
        A preview is tried once (the next carries newer text); ``give_up_at``: retried
        until then."""
        assert self.route is not None
        has_text = content != p.THINKING_MARK
        if has_text:
            await self.stream.delivering()
        seg = self._cur
        if seg is None:
            await self.out.room(self.target.conversation_id)
            seg = _Segment(new_stream_id(), self._offset, trio.current_time(), self.out.clock())
            self._cur = seg
            self._segment_opened.set()
        body: dict[str, Any]
        if self._card is not None:
            body = p.stream_card_body(seg.id, content, self._card, finish=finish)
        else:
            body = p.stream_body(seg.id, content, finish=finish)
        plain = self._display_plain()
        if content != f"{plain}\n\n⏳ {self.stream.note}":
            plain = content  # no progress note in it
        self.stream.paced()
        seg.sent_text = seg.sent_text or has_text  # shown, maybe, even without an ack
        if self._generation is None:
            # A stream lives on one connection: after a drop the rest goes by push.
            self._generation = self.out.link.generation if self.out.link.live else None
        await self.out.reply_frame(
            self.route,
            body,
            what="stream",
            bound=self._generation,
            give_up_at=trio.current_time() if give_up_at is None else give_up_at,
        )
        if self._generation is None:
            self._generation = self.out.link.generation  # acked: on the socket live now
        self._card = None
        seg.shown = content
        seg.plain = plain
        seg.has_text = seg.has_text or has_text

    def _close_segment(self, final: str) -> None:
        """The current segment ends showing ``final``; the next one starts after it."""
        seg = self._cur
        if seg is None:
            return
        rest = self._rest(self.stream.text)
        lead = len(rest) - len(rest.lstrip())
        if final and rest.lstrip().startswith(final):
            self._offset += lead + len(final)
        if final and final != p.THINKING_MARK:
            self._done.append(_Done(seg.id, final, seg.sent_at, self.out.clock()))
        self._cur = None
        self._segment_opened = trio.Event()

    async def _rotate(self) -> None:
        """Finish the current stream before it expires; the answer goes on in a new one."""
        seg = self._cur
        assert seg is not None
        content = self._display_plain()
        if not content:
            content = seg.shown or p.THINKING_MARK
        log.info(
            "stream_rotated", stream_id=seg.id, age_s=round(trio.current_time() - seg.opened_at)
        )
        try:
            await self._frame(content, finish=True)
        except p.StreamExpired:
            content = seg.plain
        self._close_segment(content)

    def _due_rotation(self) -> bool:
        seg = self._cur
        return seg is not None and trio.current_time() - seg.opened_at >= self.out.tuning.rotate_s

    async def _step(self, *, opening: bool = False) -> Step:
        """One intermediate frame (or rotation), under the stream's lock."""
        if self.stream.finishing or self._broken:
            return Step.STOP
        try:
            if self._due_rotation():
                await self._rotate()
                self.stream.redraw()  # the rest goes on in a new bubble
                return Step.AGAIN
            if opening:
                self._opened = True
                display = p.THINKING_MARK
            else:
                display = self._display()
                if not display:
                    return Step.SHOWN  # all of the text is in a finished bubble
            if self._cur is None or display != self._cur.shown:
                await self._frame(display, finish=False)
        except p.StreamExpired:
            seg = self._cur
            self._close_segment(seg.plain if seg is not None else "")
            self.stream.redraw()
            return Step.AGAIN
        except (p.ReplyExpired, p.ConnectionLost) as exc:
            self._lost(exc)
            return Step.STOP
        except ChannelError as exc:
            self._failures += 1
            log.info("stream_update_failed", error=_short(exc), failures=self._failures)
            return Step.STOP if self._failures >= PREVIEW_FAILURES else Step.AGAIN
        self._failures = 0
        return Step.AGAIN if opening else Step.SHOWN

    async def start(self, text: str) -> Step:
        if not self._opened:
            # The thinking marker first, as when the turn started (the text follows
            # after the interval).
            return await self._step(opening=True)
        return await self._step()

    async def append(self, text: str) -> Step:
        return await self._step()

    async def background(self) -> None:
        """The thinking marker as soon as the turn starts, then the rotation timer: a
        bubble that has been open for ``rotate_s`` is finished and the answer goes on in
        a new one (the engine wakes to write it)."""
        if self._broken:
            return
        async with self.stream.lock:
            if not self._opened:
                await self._step(opening=True)
        interval = self.out.tuning.interval_s
        while not self.stream.finishing and not self._broken and self._failures < PREVIEW_FAILURES:
            seg = self._cur
            if seg is None:
                await self._segment_opened.wait()
                continue
            await trio.sleep_until(seg.opened_at + self.out.tuning.rotate_s)
            async with self.stream.lock:
                if self._cur is seg:
                    await self._step()
            if self._cur is seg:  # the rotation failed: not again at once
                await trio.sleep(interval)

    async def attach_card(self, card: dict[str, Any]) -> bool:
        """Attach a template card to this stream's next frame (sent at once)."""
        if self.route is None or self._broken or self.stream.finishing:
            return False
        async with self.stream.lock:
            if self._broken or self.stream.finishing:
                return False
            self._card = card
            try:
                content = (self._cur.shown if self._cur is not None else "") or p.THINKING_MARK
                await self._frame(content, finish=False)
            except ChannelError as exc:
                self._card = None
                log.info("card_attach_failed", error=_short(exc))
                return False
            self.out.mark_carded(self.route.req_id)
            return True

    # -- finish --------------------------------------------------------------------------------

    async def finish(self, text: str) -> list[Delivered]:
        """Exactly one ``finish: true`` frame with the final text (and pushes beyond it).

        Not delivered after the retries (:class:`TransportError`, ``request_sent``
        False): the bubble this answer left open is remembered, and the outbox's
        delivery finishes it (:meth:`WecomOutbound.send_text`)."""
        self.stream.text = text
        try:
            delivered = await self._deliver(text)
        except ChannelError as exc:
            self._keep_bubble(exc)
            raise
        await self._close_orphan()
        return delivered

    def fallback(self) -> None:
        return None  # pushes carry whatever the reply path cannot

    async def _deliver(self, text: str) -> list[Delivered]:
        chunks = split(self._rest(text))
        if not self._broken and (chunks or self._cur is not None):
            first = chunks[0] if chunks else "…"
            try:
                await self._finish_frame(first)
            except (p.ReplyExpired, p.ConnectionLost) as exc:
                self._lost(exc)
        # Whatever no finished bubble shows: the overflow, or all of it after a loss.
        pushes = split(self._rest(text))
        delivered = [
            Delivered(message_id=d.id, text=d.text, sent_at=d.sent_at, completed_at=d.completed_at)
            for d in self._done
        ]
        if pushes:
            delivered += await self.out.push(self.target.conversation_id, pushes)
        return delivered

    def _keep_bubble(self, exc: ChannelError) -> None:
        """The answer is not delivered: the outbox is to finish the bubble it left open
        (the current one, or one a lost socket cut off) rather than add a copy."""
        seg = self._orphan if self._broken else self._cur
        if seg is None or self.route is None or not isinstance(exc, TransportError):
            return
        if exc.outcome_unknown:
            return  # pushed, maybe shown: not sent again
        if seg.shown or seg.sent_text:
            self._orphan = None
            self.out.keep_open(self.route.req_id, seg.id)
            log.info("stream_left_for_outbox", stream_id=seg.id)

    async def abandon(self) -> None:
        """Left without ``finish`` (stopped, failed, shutdown): the open bubble is finished
        with what it shows, so it does not spin until WeCom expires it."""
        seg = self._cur
        if seg is None or self._broken or self.route is None:
            return
        with trio.move_on_after(p.ACK_TIMEOUT_S):
            try:
                await self.out.reply_frame(
                    self.route,
                    p.stream_body(seg.id, seg.shown or p.THINKING_MARK, finish=True),
                    what="stream",
                    bound=self._generation,
                )
            except ChannelError as exc:
                log.info("stream_abandon_failed", error=_short(exc))

    def _lost(self, exc: ChannelError) -> None:
        """The reply path is gone: the rest of the answer goes by push."""
        log.info("stream_reply_path_lost", error=_short(exc))
        self._broken = True
        seg, self._cur = self._cur, None
        if isinstance(exc, p.ConnectionLost) and seg is not None and (seg.shown or seg.sent_text):
            # Open on WeCom (thinking, or part of the answer): closed once it is pushed.
            self._orphan = seg

    async def _close_orphan(self) -> None:
        """A bubble left open by a lost socket (thinking, or part of the answer that the
        pushes now carry in full): replace its text by a pointer to them (best effort,
        on the socket that is up now)."""
        seg, self._orphan = self._orphan, None
        if seg is None or self.route is None:
            return
        try:
            with trio.move_on_after(p.ACK_TIMEOUT_S * 2):
                await self.out.reply_frame(
                    self.route, p.stream_body(seg.id, p.MOVED_MARK, finish=True), what="stream"
                )
        except ChannelError as exc:
            log.info("stream_orphan_left", error=_short(exc))

    async def _finish_frame(self, first: str) -> None:
        """The finish frame of the current segment, retried for ``send_retry_s`` (a
        repeat is harmless: replace semantics); a stream past 5 minutes is still inside
        its 6, one that expired anyway continues on a new stream id.  Not acked after its
        retries: raised as not delivered (the outbox finishes this same bubble)."""
        give_up_at = self.out.deadline()
        while True:
            try:
                await self._frame(first, finish=True, give_up_at=give_up_at)
                break
            except p.StreamExpired:
                seg = self._cur
                self._close_segment(seg.plain if seg is not None and seg.has_text else "")
                rest = split(self._rest(self.stream.text))
                if not rest:
                    return
                first = rest[0]
            except p.ConnectionLost:
                raise
            except TransportError as exc:
                if unsure(exc):
                    raise _undelivered("stream", exc) from exc
                raise
        self._close_segment(first)
