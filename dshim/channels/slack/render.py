"""Slack outbound: native streaming answers, the chat.update fallback, notices, buttons.

Every answer goes into the thread of the user's message (``Route.thread_ts``: the
message's thread, or its own ``ts``).  Agent text is always sent escaped (``&``, ``<``,
``>``), so model output cannot write ``<!channel>``, ``<@U…>`` or links; it goes as
``markdown_text`` (standard Markdown) where the method takes it.

Native streaming (``stream = true``) runs on the native-stream engine
(:mod:`dshim.streams.native`: it paces, merges the texts that arrive in between, runs the
delivery hook once and hands the final text over exactly once, natively or to the
fallback); Slack supplies its calls (:class:`SlackStreamCalls`) and a stream with its
stop button (:class:`SlackStream`).  The first text opens ``chat.startStream`` in the
thread with the sender as ``recipient_user_id`` / ``recipient_team_id``; then
``chat.appendStream`` sends only the new suffix, at most every :data:`APPEND_INTERVAL_S`,
in pieces of at most :data:`APPEND_MAX` characters; ``finish`` appends the rest and calls
``chat.stopStream``.  When streaming is not available (``channel_type_not_supported``,
``method_not_supported_for_channel_type``, ``deprecated_endpoint``,
``messages_tab_disabled`` ...; remembered per channel type) or the text diverged from
what was appended (the agent rewrote earlier text), the stream is stopped and the answer
continues on the fallback: the streamed message is edited by ``chat.update`` with the
full text (:mod:`dshim.render`'s engine, which paces, splits and delivers the final text
exactly once).  ``stopped_by_user`` (the person pressed stop in Slack) ends the turn like
``/stop`` through the stream's ``watch_stop`` hook.  A stream left without ``finish`` (a
failed turn, a shutdown before any text) is left as it is.

Fallback (:class:`SlackTransport`): ``chat.postMessage`` then ``chat.update`` at most
once per second per message, 4,000 characters per message (``chat.update``'s limit),
overflow as further thread posts.  ``chat.update`` is Tier 3, a budget shared by the
whole workspace: every edit takes a slot of one :class:`~dshim.render.ChatPacer` (50 a
minute).  Posts into one channel are at least :data:`POST_SPACING_S` apart (Slack's
~1 message/s per channel).  A 429 pauses only the method it hit (the client).  Slack has
no idempotency key for posts: a post of unknown outcome is repeated at most once, after
a pause and once ``auth.test`` answers again (:meth:`SlackTransport.reachable`).

Failures follow :mod:`dshim.render`'s rules on both paths.  A failure that proves the
call did nothing (could not connect, a 5xx, a 429 after its ``Retry-After``) is retried
with backoff for ``send_retry_s``: an append is made again, a ``chat.startStream`` that
failed so hands the answer to the fallback's post.  A response lost after the request
went out is an unknown outcome: after a ``chat.startStream`` the fallback's post is its
one repeat (:meth:`~dshim.render.EditStream.unconfirmed_send`); after an append the
stream is stopped and the fallback sets the whole text by ``chat.update`` (appending
again could show a piece twice); ``chat.stopStream`` is simply repeated (a stream found
stopped is stopped).  A stream stopped with the final text is the answer, also when the
stop's answer was lost: it is never posted again.  What still fails after the retries is
raised from ``finish`` as itself (the turn's failure, never the bot's), so the pipeline's
outbox delivers an answer the platform certainly did not take once it is back.  The
retries are the engine's :func:`~dshim.streams.native.retrying` (the 429 waits of one
answer add up to at most ``rate_limit_budget_s``); an intermediate append that failed
so is caught by the calls, which pause the engine (the 429's ``Retry-After``, or their
own backoff) before the same piece goes again.

Status: ``assistant.threads.setStatus`` "is thinking…" once ``typing_grace_s`` passed
without text (a native stream's background work sets it once, the chat.update engine
until its first message; a workspace or conversation that refuses it is not asked
again).

Approvals and questions (:meth:`SlackOutbound.open_interaction`): a thread message with
the request text and a Block Kit ``actions`` block, one button per option (value = the
option's number); a press arrives as an ``interactive`` envelope and is judged like the
typed answer.  When the pipeline stops waiting, the message is updated: the buttons go,
the decision is shown.

Substitute mode: an answer with ``target.anchor`` is placed by :class:`SlackTransport`
(thread / quote with the trigger's permalink / plain) through the chat.update engine,
never natively streamed.  The operators' control notice
(:meth:`SlackOutbound.send_control_notice`) is a DM (``conversations.open``) with the two
:data:`~dshim.outbound.CONTROL_ACTIONS` buttons; the channel hands a press to
``Inbound.substitute_control`` and :meth:`SlackOutbound.show_control_result` shows what it
did.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
import trio

from dshim.channels.base import (
    CONTROL_ACTIONS,
    ControlNotice,
    FindsDirectTargets,
    InteractionPrompt,
    PresentsControlNotices,
    PresentsInteractions,
    ReplyStream,
    WatchesStop,
)
from dshim.channels.kit import Backoff
from dshim.channels.slack.client import WebClient
from dshim.channels.slack.protocol import (
    ACTION_PREFIX,
    CONTROL_PREFIX,
    STREAM_UNAVAILABLE,
    ControlPress,
    Route,
    actions_block_id,
    control_value,
    escape,
    pieces,
    stream_suffix,
)
from dshim.errors import ChannelError, DshimError, RateLimited, TransportError, outcome_unknown
from dshim.model import Delivered, ReplyTarget
from dshim.render import (
    BACKOFF_MAX_S,
    ChatPacer,
    EditOutbound,
    EditStream,
    IdempotentSends,
    Limits,
    ProbesReachable,
    open_edit_stream,
)
from dshim.streams.native import BoundCalls, NativeStream, Step, open_native_stream, retrying

log = structlog.get_logger("dshim.slack")

T = TypeVar("T")

#: ``chat.update``'s documented limit; fallback messages are split at it.
MAX_MESSAGE_LEN = 4000
#: Text per ``chat.appendStream`` call.
APPEND_MAX = 11_000
#: At most one append this often.
APPEND_INTERVAL_S = 0.35
#: A streamed message longer than this continues on the fallback (split at 4,000).
STREAM_MAX = 38_000
#: Posts into one channel at least this far apart.
POST_SPACING_S = 1.0
#: ``chat.update`` budget for the workspace (Tier 3).
UPDATES_PER_MINUTE = 50
STATUS_TEXT = "is thinking…"


def _measure(text: str) -> int:
    return len(escape(text))


#: 4,000 characters after escaping; edits at most once a second; the status after 1 s
#: without text (a quick answer needs none: it would be one more call per turn), then
#: every 100 s (Slack clears it after two minutes).
LIMITS = Limits(
    max_len=MAX_MESSAGE_LEN, measure=_measure, typing_interval_s=100.0, typing_grace_s=1.0
)


#: A substitute answer's messages: room for ``<@asker> `` and the quoted permalink.
ANCHORED_LIMITS = dataclasses.replace(LIMITS, max_len=MAX_MESSAGE_LEN - 200)


def split(text: str) -> list[str]:
    """The messages a complete text is delivered in (4,000 escaped characters each)."""
    return LIMITS.split(text)


def thread_of(target: ReplyTarget) -> str | None:
    """The thread an answer to ``target`` goes into."""
    route = target.route
    if isinstance(route, Route):
        return route.thread_ts
    return target.thread_id or target.reply_to_message_id


@dataclass(frozen=True, slots=True)
class Adopted:
    """A message that already exists (a stopped native stream): the fallback's first
    "send" edits it instead of posting."""

    ts: str
    sent_at: float


class SlackTransport(IdempotentSends, ProbesReachable):
    """One answer's messages on the fallback path (:class:`dshim.render.StreamTransport`).

    A substitute turn's answer (``target.anchor``) is placed by its anchor: ``thread`` in
    the thread of the anchor message, ``quote`` and ``plain`` as channel posts (no
    ``thread_ts``), the quote ending with the trigger's permalink (unfurled: Slack shows
    the quoted message).  Its first message starts with ``<@asker>``: the only ping, as
    the agent's text is escaped.  Such a post never makes the thread the bot's (the
    person it answered for may take over there).
    """

    idempotent_sends = False

    def __init__(self, outbound: SlackOutbound, target: ReplyTarget) -> None:
        self.outbound = outbound
        self.web = outbound.web
        self.channel = target.conversation_id
        self.thread_ts = thread_of(target)
        self.adopted: Adopted | None = None
        self.anchored = target.anchor is not None
        #: What the first message carries around the agent's text (a substitute answer).
        self._lead = ""
        self._tail = ""
        self._first: str | None = None
        anchor = target.anchor
        if anchor is not None:
            if anchor.mention_id:
                self._lead = f"<@{anchor.mention_id}> "
            if anchor.mode != "thread":
                self.thread_ts = None
            elif anchor.message_id:
                self.thread_ts = anchor.message_id
            if anchor.mode == "quote" and anchor.message_id:
                link = outbound.permalink(self.channel, anchor.message_id)
                self._tail = f"\n\n{link}" if link else ""

    def _content(self, text: str, first: bool) -> str:
        body = escape(text)
        return f"{self._lead}{body}{self._tail}" if first else body

    async def send(self, text: str, *, reply: bool) -> str:
        if self.adopted is not None and reply:
            adopted, self.adopted = self.adopted, None
            await self.edit(adopted.ts, text)
            return adopted.ts
        await self.outbound.post_turn(self.channel)
        first = self._first is None
        posted = await self.web.post_message(
            self.channel,
            thread_ts=self.thread_ts,
            markdown=self._content(text, first),
            retries=2,
            unfurl=first and bool(self._tail),
        )
        if posted.ts is None:
            raise ChannelError("chat.postMessage: no ts in the answer")
        if first:
            self._first = posted.ts
        if not self.anchored:
            await self.outbound.posted(self.channel, self.thread_ts)
        return posted.ts

    async def edit(self, message_id: str, text: str) -> None:
        await self.outbound.updates.acquire()
        markdown = self._content(text, message_id == self._first)
        await self.web.update(self.channel, message_id, markdown=markdown, retries=2)

    async def typing(self) -> None:
        await self.outbound.status(self.channel, self.thread_ts)

    async def reachable(self) -> None:
        """Does the Web API answer again?  (``auth.test``: cheap, changes nothing; before
        the one repeat of a post whose outcome is unknown, see :mod:`dshim.render`.)"""
        await self.web.auth_test()


class SlackStream(NativeStream, WatchesStop):
    """One answer on the native-stream engine, with Slack's own stop button.

    Implements :class:`dshim.outbound.ReplyStream` with ``watch_delivery`` (the engine's)
    and ``watch_stop``; its calls are :class:`SlackStreamCalls`.
    """

    on_stop: Callable[[], object] | None = None

    def watch_stop(self, stop: Callable[[], object]) -> None:
        """Call ``stop()`` when the person stopped the answer in Slack (``stopped_by_user``)."""
        self.on_stop = stop


class SlackStreamCalls(BoundCalls[SlackStream]):
    """One answer's ``chat.startStream`` / ``appendStream`` / ``stopStream`` calls on the
    native-stream engine (:mod:`dshim.streams.native`): the engine paces, merges and
    finishes once, these stream and fall back; see the module docstring."""

    interval_s = APPEND_INTERVAL_S
    shows_notes = False  # a note would be appended for good: progress is not shown

    def __init__(self, outbound: SlackOutbound, target: ReplyTarget) -> None:
        self.outbound = outbound
        self.web = outbound.web
        self.target = target
        self.channel = target.conversation_id
        self.thread_ts = thread_of(target)
        route = target.route if isinstance(target.route, Route) else None
        self.user = route.user if route else None
        self.team = route.team if route else None
        self.channel_type = route.channel_type if route else None
        #: What was appended (the escaping aside): the text the message shows.
        self._shown = ""
        self.ts: str | None = None
        self._sent_at = 0.0
        self.stopped_by_user = False
        #: The fallback took over (or was asked to).
        self.fell_back = False
        #: A ``chat.startStream`` whose answer was lost: a message may be up, unknown to us.
        self._start_unsure = False
        #: Why ``chat.stopStream`` could not be made (the fallback cannot edit the message).
        self._stop_failed: ChannelError | None = None
        self._pump_backoff = self._backoff()
        self._rate_limited_s = 0.0

    def bind(self, stream: NativeStream) -> None:
        assert isinstance(stream, SlackStream), "opened with stream_type=SlackStream"
        self._bound = stream

    def _went_out(self) -> None:
        """A call on the message goes out now: the next waits ``interval_s``."""
        self.stream.paced()

    def _hold(self, seconds: float) -> None:
        """No call on the message for ``seconds``, then the interval."""
        self.stream.pause(seconds + self.interval_s)

    async def _paced(self) -> None:
        """Wait until the next call on the message may go (``finish``'s appends)."""
        at = self.stream.next_call_at
        if at > trio.current_time():
            await trio.sleep_until(at)
        self._went_out()

    # -- retries ---------------------------------------------------------------------------

    def _backoff(self) -> Backoff:
        first = self.outbound.limits.retry_backoff_s
        return Backoff(first, max(BACKOFF_MAX_S, first), 2.0, jitter=0.0)

    async def _retrying(self, call: Callable[[], Awaitable[T]], *, repeatable: bool) -> T:
        """``call()`` under the engine's rules (:func:`dshim.streams.native.retrying`): a
        failure that proves it did nothing (could not connect, a 5xx) is retried with
        backoff for ``send_retry_s``, a 429 after its Retry-After; a response lost after
        the request went out is raised at once unless the call is ``repeatable`` (making
        it twice changes nothing).  The 429 waits add up over the whole answer to at most
        ``rate_limit_budget_s``."""
        limits = self.outbound.limits

        async def counted() -> T:
            try:
                return await call()
            except RateLimited as exc:
                # The client waited out what it could; the method stays blocked this long.
                self._rate_limited_s += exc.retry_after
                raise

        return await retrying(
            counted,
            give_up_at=trio.current_time() + limits.send_retry_s,
            backoff=self._backoff(),
            rate_limit_budget_s=limits.rate_limit_budget_s - self._rate_limited_s,
            repeatable=repeatable,
        )

    # -- the native path (NativeCalls) ------------------------------------------------------

    async def start(self, text: str) -> Step:
        """``chat.startStream`` with the first piece (``text`` is stripped, as the final
        text is: whitespace held back is never a divergence)."""
        if self.ts is not None:  # started with a part of it: the rest is appended
            return await self.append(text)
        try:
            started = await self._start(text)
        except DshimError as exc:  # the delivery hook or the thread memory failed
            log.warning("stream_task_failed", error=str(exc)[:200])
            return Step.STOP  # finish does the rest
        if not started:
            return Step.FALLBACK
        return Step.SHOWN if self._shown == text else Step.AGAIN  # AGAIN: the next piece

    async def _start(self, text: str) -> bool:
        if self.outbound.native_unavailable(self.channel_type) or self.thread_ts is None:
            return False
        first = pieces(text, APPEND_MAX)[0] if len(text) <= STREAM_MAX else ""
        if not first:
            return False
        await self.stream.delivering()
        await self.outbound.post_turn(self.channel)  # a new message: ~1 per second here
        self._sent_at = self.outbound.clock()
        self._went_out()
        try:
            started = await self.web.start_stream(
                self.channel,
                self.thread_ts,
                user=self.user,
                team=self.team,
                markdown=escape(first),
            )
        except ChannelError as exc:
            if str(exc.code) in STREAM_UNAVAILABLE:
                self.outbound.mark_native_unavailable(self.channel_type, str(exc.code))
            # The fallback posts the answer; after a start that may be up, that post is
            # its one repeat (after a pause, see dshim.render), never a loop of copies.
            self._start_unsure = unsure(exc)
            log.info("stream_start_failed", error=str(exc)[:200], unsure=self._start_unsure)
            return False
        if started.ts is None:  # started, but where: as good as a lost answer
            self._start_unsure = True
            return False
        self.ts = started.ts
        self._shown = first
        await self.outbound.posted(self.channel, self.thread_ts)
        return True

    async def append(self, text: str) -> Step:
        """One ``chat.appendStream`` towards ``text``: the next piece of the new suffix."""
        assert self.ts is not None
        suffix = stream_suffix(self._shown, text)
        if suffix is None or len(text) > STREAM_MAX:
            log.info("stream_diverged", shown=len(self._shown), text=len(text))
            return Step.FALLBACK
        if not suffix:
            return Step.SHOWN
        piece = pieces(suffix, APPEND_MAX)[0]
        self._went_out()
        try:
            await self.web.append_stream(self.channel, self.ts, escape(piece))
        except ChannelError as exc:
            return self._native_failed(exc)
        self._shown += piece
        self._pump_backoff.reset()
        return Step.SHOWN if len(piece) == len(suffix) else Step.AGAIN  # AGAIN: the next piece

    def _native_failed(self, exc: ChannelError) -> Step:
        code = str(exc.code)
        if code == "stopped_by_user":
            log.info("stream_stopped_by_user")
            self.stopped_by_user = True
            if self.stream.on_stop is not None:
                self.stream.on_stop()
            return Step.STOP
        if code in STREAM_UNAVAILABLE:
            self.outbound.mark_native_unavailable(self.channel_type, code)
        if isinstance(exc, RateLimited):
            # The client already waited what it could; try again after the pause.
            self._hold(exc.retry_after)
            return Step.AGAIN
        if isinstance(exc, TransportError) and not unsure(exc):
            # Certainly not appended (could not connect, a 5xx): the same piece, later.
            delay = self._pump_backoff.next_delay()
            log.info("stream_append_retry", error=str(exc)[:200], retry_in_s=delay)
            self._hold(delay)
            return Step.AGAIN
        # Refused, or perhaps appended (the answer was lost): appending again could show
        # a piece twice, so the fallback stops the stream and sets the whole text.
        log.info("stream_append_failed", error=str(exc)[:200], code=code)
        return Step.FALLBACK

    async def finish(self, text: str) -> list[Delivered] | None:
        """Append the rest and stop; None when the fallback must finish instead."""
        final = text.strip()
        if self.ts is None and not self.stopped_by_user and final:
            # The answer came whole before the stream started: stream it all the same
            # (False: not available here, the fallback posts it).
            await self._start(final)
        if self.ts is None or self.stopped_by_user:
            return None
        suffix = stream_suffix(self._shown, final)
        if suffix is None or len(final) > STREAM_MAX or not final:
            return None
        ts = self.ts
        for piece in pieces(suffix, APPEND_MAX):

            async def append(piece: str = piece) -> None:
                await self._paced()
                await self.web.append_stream(self.channel, ts, escape(piece))

            try:
                await self._retrying(append, repeatable=False)
            except ChannelError as exc:
                if str(exc.code) == "stopped_by_user":
                    self.stopped_by_user = True
                log.info("stream_finish_failed", error=str(exc)[:200])
                if isinstance(exc, (RateLimited, TransportError)) and not unsure(exc):
                    raise  # down or busy all along: nothing to edit now, the outbox retries
                return None  # refused or perhaps appended: the fallback sets the text
            self._shown += piece
        failed = await self._stop()
        if failed is not None:
            # Every piece was confirmed: the whole answer is on the screen, still marked as
            # being written.  Posting it again would show it twice.
            log.warning("stream_left_open", error=str(failed)[:200])
        now = self.outbound.clock()
        return [Delivered(message_id=ts, text=final, sent_at=self._sent_at, completed_at=now)]

    async def _stop(self) -> ChannelError | None:
        """``chat.stopStream``, retried while Slack is down or busy (a repeat of a stop
        whose answer was lost finds the stream stopped: harmless).  Returns the failure
        that outlasted the retries (None: the message is no longer streaming)."""
        assert self.ts is not None
        ts = self.ts

        async def stop() -> None:
            await self.web.stop_stream(self.channel, ts)

        try:
            await self._retrying(stop, repeatable=True)
        except (RateLimited, TransportError) as exc:
            log.warning("stream_stop_failed", error=str(exc)[:200])
            return exc
        except ChannelError as exc:  # stopped already (by us, the person or Slack), or gone
            log.info("stream_stop_refused", error=str(exc)[:200], code=str(exc.code))
        return None

    # -- the fallback ------------------------------------------------------------------------

    def fallback(self) -> AbstractAsyncContextManager[ReplyStream]:
        return self._fallback()

    @asynccontextmanager
    async def _fallback(self) -> AsyncIterator[ReplyStream]:
        """The chat.update engine, adopting the streamed message (stopped first)."""
        self.fell_back = True
        transport = SlackTransport(self.outbound, self.target)
        if self.ts is not None:
            if not self.stopped_by_user:
                self._stop_failed = await self._stop()
            transport.adopted = Adopted(self.ts, self._sent_at)
        async with open_edit_stream(
            transport,
            self.outbound.limits,
            clock=self.outbound.clock,
            pacer=self.outbound.pacer(self.target),
        ) as stream:
            if self._start_unsure:
                stream.unconfirmed_send()
            if self._stop_failed is None:
                yield stream
            else:
                yield _StillStreaming(stream, self._stop_failed)

    async def abandon(self) -> None:
        """Left without ``finish`` (a failed turn, or a shutdown before any text): nothing
        is closed (a stream that is up stays as it is)."""
        return None

    async def background(self) -> None:
        """The "is thinking…" status, once, when the grace passed without text (a quick
        answer spends no call on it); the stream's end cancels the wait."""
        await trio.sleep(self.outbound.limits.typing_grace_s)
        stream = self.stream
        if stream.text or stream.finishing or self.ts is not None or self.fell_back:
            return
        try:
            await self.outbound.status(self.channel, self.thread_ts)
        except DshimError as exc:  # never ends the answer
            log.warning("stream_task_failed", error=str(exc)[:200])


class _StillStreaming:
    """The fallback of an answer whose ``chat.stopStream`` failed: the message is still
    streaming, so no edit can land and ``finish`` raises why (a failure that may pass --
    the platform is down or busy -- lets the pipeline's outbox deliver the answer later)."""

    def __init__(self, inner: EditStream, failed: ChannelError) -> None:
        self.inner = inner
        self.failed = failed

    async def update(self, text: str) -> None:
        await self.inner.update(text)

    async def progress(self, note: str) -> None:
        await self.inner.progress(note)

    async def finish(self, text: str) -> list[Delivered]:
        raise self.failed


@dataclass
class _Press:
    user: str
    value: str


class SlackOutbound(EditOutbound, FindsDirectTargets, PresentsControlNotices, PresentsInteractions):
    """The channel's :class:`dshim.outbound.Outbound` (see the module docstring)."""

    def __init__(
        self,
        web: WebClient,
        *,
        clock: Callable[[], float],
        bot_username: str | None = None,
        stream: bool = True,
        on_thread: Callable[[str, str], Awaitable[None]] | None = None,
        limits: Limits = LIMITS,
        workspace_host: str | None = None,
    ) -> None:
        super().__init__(limits=limits, clock=clock, bot_username=bot_username)
        self.web = web
        #: ``acme.slack.com``: where the permalinks of quoted triggers point.
        self.workspace_host = workspace_host
        self.native = stream
        self._on_thread = on_thread
        self._native_off: dict[str | None, str] = {}
        self._status_off: str | None = None
        self._last_post: dict[str, float] = {}
        self._post_locks: dict[str, trio.Lock] = {}
        self.updates = ChatPacer(UPDATES_PER_MINUTE, 60.0)
        #: (channel, message ts) -> the last button press on it.
        self._presses: dict[tuple[str, str], _Press] = {}

    def transport(self, target: ReplyTarget) -> SlackTransport:
        return SlackTransport(self, target)

    # -- shared state ------------------------------------------------------------------------

    def native_unavailable(self, channel_type: str | None) -> bool:
        return not self.native or channel_type in self._native_off

    def mark_native_unavailable(self, channel_type: str | None, why: str) -> None:
        if channel_type not in self._native_off:
            log.info("stream_disabled", channel_type=channel_type, error=why)
        self._native_off[channel_type] = why

    async def post_turn(self, channel: str) -> None:
        """Wait for this channel's turn to post (at least 1 s after the previous post)."""
        lock = self._post_locks.setdefault(channel, trio.Lock())
        async with lock:
            wait = self._last_post.get(channel, -1e9) + POST_SPACING_S - trio.current_time()
            if wait > 0:
                await trio.sleep(wait)
            self._last_post[channel] = trio.current_time()
            if len(self._last_post) > 4096:
                self._last_post.pop(next(iter(self._last_post)))
                self._post_locks.pop(next(iter(self._post_locks)), None)

    async def posted(self, channel: str, thread_ts: str | None) -> None:
        """The bot posted into a thread: it is a bot conversation from now on."""
        if thread_ts is not None and self._on_thread is not None:
            await self._on_thread(channel, thread_ts)

    async def status(self, channel: str, thread_ts: str | None) -> None:
        """``assistant.threads.setStatus`` (best effort; a refusal turns it off)."""
        if thread_ts is None or self._status_off is not None:
            return
        try:
            await self.web.set_status(channel, thread_ts, STATUS_TEXT)
        except TransportError:
            return
        except ChannelError as exc:
            self._status_off = str(exc.code)
            log.info("status_disabled", error=str(exc)[:200])

    def permalink(self, channel: str, ts: str) -> str | None:
        """The permalink of a top-level message (None: the workspace URL is unknown)."""
        if self.workspace_host is None:
            return None
        return f"https://{self.workspace_host}/archives/{channel}/p{ts.replace('.', '')}"

    def note_press(self, channel: str, message_ts: str, user: str, value: str) -> None:
        """A button of an interaction message was pressed (the channel saw it)."""
        if len(self._presses) > 1024:
            self._presses.pop(next(iter(self._presses)))
        self._presses[(channel, message_ts)] = _Press(user, value)

    # -- substitute control ------------------------------------------------------------

    async def direct_target(self, user_id: str) -> ReplyTarget:
        """A DM to ``user_id`` goes to its DM channel (``conversations.open``)."""
        channel = await self.web.open_dm(user_id)
        return ReplyTarget(conversation_id=channel, conversation_type="direct")

    async def send_control_notice(
        self, target: ReplyTarget, notice: ControlNotice
    ) -> list[Delivered]:
        """The operator's DM: the notice and its two buttons (see :func:`control_blocks`)."""
        channel = target.conversation_id
        text = escape(notice.text)[:3000]
        await self.post_turn(channel)
        sent_at = self.clock()
        posted = await self.web.post_message(
            channel, thread_ts=None, text=text, blocks=control_blocks(text, notice, None), retries=2
        )
        if posted.ts is None:
            raise ChannelError("chat.postMessage: no ts in the answer")
        return [
            Delivered(message_id=posted.ts, text=notice.text, sent_at=sent_at, completed_at=sent_at)
        ]

    async def show_control_result(self, press: ControlPress, result: str) -> None:
        """Update the pressed notice with what the press did (the buttons stay: the
        other action may still be wanted)."""
        text = press.text.split(RESULT_MARK, 1)[0]  # without an earlier press's result
        notice = ControlNotice(
            text=text, conversation_id=press.conversation_id, thread_id=press.thread_id
        )
        try:
            await self.web.update(
                press.channel,
                press.message_ts,
                text=f"{text}{RESULT_MARK}{escape(result)}"[:3900],
                blocks=control_blocks(text, notice, result),
                retries=2,
            )
        except ChannelError as exc:
            log.info("control_update_failed", error=str(exc)[:200])

    # -- Outbound -------------------------------------------------------------------------

    @asynccontextmanager
    async def open_stream(self, target: ReplyTarget) -> AsyncIterator[ReplyStream]:
        """A native stream where possible, else the chat.update engine.

        A substitute answer (``target.anchor``) always takes the engine: it arrives as
        one finished message (``chat.postMessage``), and ``chat.startStream`` could only
        post into a thread, never quote or plain; its messages leave room for the
        asker's mention and the quoted permalink.
        """
        route = target.route if isinstance(target.route, Route) else None
        if target.anchor is not None:
            async with open_edit_stream(
                self.transport(target),
                ANCHORED_LIMITS,
                clock=self.clock,
                pacer=self.pacer(target),
            ) as anchored:
                yield anchored
            return
        if self.native_unavailable(route.channel_type if route else None):
            async with self.edit_stream(target) as edit_stream:
                yield edit_stream
            return
        calls = SlackStreamCalls(self, target)
        async with open_native_stream(calls, stream_type=SlackStream) as stream:
            yield stream

    @asynccontextmanager
    async def open_interaction(
        self, target: ReplyTarget, prompt: InteractionPrompt
    ) -> AsyncIterator[list[Delivered]]:
        """Show a request with buttons until the block ends (see the module docstring)."""
        channel = target.conversation_id
        thread_ts = thread_of(target)
        token = secrets.token_hex(4)
        blocks: list[dict[str, object]] = [
            {"type": "section", "text": {"type": "mrkdwn", "text": escape(prompt.prompt)[:3000]}}
        ]
        buttons = [
            {
                "type": "button",
                "action_id": f"{ACTION_PREFIX}{i + 1}",
                "text": {"type": "plain_text", "text": (o.label or str(i + 1))[:75]},
                "value": str(i + 1),
            }
            for i, o in enumerate(prompt.options[:25])
        ]
        if buttons:
            block_id = actions_block_id(target.thread_id, token)
            blocks.append({"type": "actions", "block_id": block_id, "elements": buttons})
        await self.post_turn(channel)
        sent_at = self.clock()
        posted = await self.web.post_message(
            channel, thread_ts=thread_ts, text=escape(prompt.text)[:3900], blocks=blocks, retries=2
        )
        if posted.ts is None:
            raise ChannelError("chat.postMessage: no ts in the answer")
        ts = posted.ts
        await self.posted(channel, thread_ts)
        shown = Delivered(message_id=ts, text=prompt.text, sent_at=sent_at, completed_at=sent_at)
        starter = target.route.user if isinstance(target.route, Route) else None
        try:
            yield [shown]
        finally:
            press = self._presses.pop((channel, ts), None)
            if press is not None and (starter is None or press.user == starter):
                label = _label(prompt, press.value)
                note = f"→ {label}"
            else:
                note = "(closed)"
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                try:
                    await self.web.update(
                        channel,
                        ts,
                        text=escape(f"{prompt.prompt}\n\n{note}")[:3900],
                        blocks=[
                            {
                                "type": "section",
                                "text": {
                                    "type": "mrkdwn",
                                    "text": escape(f"{prompt.prompt}\n\n{note}")[:3000],
                                },
                            }
                        ],
                        retries=2,
                    )
                except ChannelError as exc:
                    log.info("interaction_update_failed", error=str(exc)[:200])


def unsure(exc: ChannelError) -> bool:
    """Whether a failed call may have been carried out: the request went out and no
    answer came back (a status, even a 5xx, is an answer)."""
    return outcome_unknown(exc)


#: Between a control notice and the result of a press on it.
RESULT_MARK = "\n\n→ "


def control_blocks(text: str, notice: ControlNotice | None, result: str | None) -> list[Any]:
    """A control notice: ``text`` (escaped mrkdwn), the result of a press, and the
    :data:`~dshim.outbound.CONTROL_ACTIONS` buttons for ``notice``'s chat."""
    shown = text if result is None else f"{text}{RESULT_MARK}{escape(result)}"
    blocks: list[Any] = [{"type": "section", "text": {"type": "mrkdwn", "text": shown[:3000]}}]
    if notice is not None:
        buttons = [
            {
                "type": "button",
                "action_id": CONTROL_PREFIX + action,
                "text": {"type": "plain_text", "text": label[:75]},
                "value": control_value(action, notice.conversation_id, notice.thread_id),
                **({"style": "danger"} if action == "disable" else {}),
            }
            for action, label in CONTROL_ACTIONS
        ]
        blocks.append({"type": "actions", "block_id": "dshim_ctl", "elements": buttons})
    return blocks


def _label(prompt: InteractionPrompt, value: str) -> str:
    if value.isdigit() and 1 <= int(value) <= len(prompt.options):
        return prompt.options[int(value) - 1].label
    return value
