"""The native-stream engine: one answer streamed by a platform's own streaming calls.

Beside :mod:`dshim.render`'s edit engine (send one message, then edit it) stand the
platforms that stream natively: a DingTalk AI card, a WeCom stream bubble, QQ's
C2C stream, Slack's ``chat.startStream``, the web chat's frames.  What differs between
them is only how text reaches the screen; what each of them must get right is the same,
and it lives here once:

- **display**: the answer so far (stripped), with a tool or status note under it
  (``⏳ note``) until more text arrives -- unless the platform does not show notes;
- **pacing**: at most one call per ``interval_s``, never before a rate limit's pause
  ended (``RateLimited.retry_after``); texts that arrive in between are merged, the
  newest is the one sent;
- **the delivery hook** (:class:`~dshim.outbound.WatchesDelivery`): awaited once, right
  before the first call that can show the user any of the answer (the channel says
  when, through :meth:`NativeStream.delivering`, because only it knows which of its
  calls shows text: a DingTalk card shows nothing until it is delivered);
- **the final text exactly once**: ``finish`` may be called once; it waits for the
  intermediate call in flight, then hands the channel the complete text; a channel that
  cannot finish natively (refused, diverged, a lost answer that makes a repeat unsafe)
  returns None and the engine hands the text to the fallback instead -- never both;
- **the fallback**: a :class:`~dshim.outbound.ReplyStream` the channel opens on demand
  (the edit engine, markdown at the end); once it took over, updates go to it;
- **cancellation**: leaving :func:`open_native_stream`'s block without ``finish``
  (``/stop``, a failure, shutdown) cancels the background tasks and lets the channel
  close what is up (:meth:`NativeCalls.abandon`, shielded, within its own timeout).

Intermediate failures never end the answer: a :class:`~dshim.errors.RateLimited`
pauses the updates for its ``retry_after``; any other :class:`~dshim.errors.ChannelError`
pauses them one second per failure in a row, and the third in a row stops them (the
final text still goes through ``finish``, which retries under the channel's rules:
:func:`retrying` is the shared primitive for that; a channel whose rules add to it
wraps it, and its ``log_context`` names the message in the retry's log records).  The
log records of those intermediate failures are named by ``open_native_stream``'s
``events`` (a channel keeps the names its operators know, as ``retrying``'s ``events``
does for the retries); a channel whose ``finish`` is paced like its intermediate calls
waits for :attr:`NativeStream.next_call_at` first.

A channel supplies a :class:`NativeCalls` -- start, append, finish, a fallback, abandon
and background work (timers of its own: they take :attr:`NativeStream.lock` around their
calls and report them with :meth:`NativeStream.paced`) -- and nothing else.  A channel
that counts its failures differently catches them in its calls and answers
:attr:`Step.AGAIN` or :attr:`Step.STOP` itself (with :meth:`NativeStream.pause` saying
how long the next attempt waits, as a rate limit raised to the engine would).  A channel
whose stream has a feature of its own for the pipeline (Slack's stop button:
:class:`~dshim.outbound.WatchesStop`) has ``open_native_stream`` build a subclass of
:class:`NativeStream` that adds it (``stream_type``).
"""

from __future__ import annotations

import enum
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Generic, Protocol, TypeVar

import structlog
import trio

from dshim.backoff import Backoff
from dshim.errors import ChannelError, RateLimited, TransportError, outcome_unknown, single_error
from dshim.model import Delivered
from dshim.outbound import DeliveryHook, ReplyStream, WatchesDelivery

__all__ = [
    "BoundCalls",
    "NativeCalls",
    "NativeStream",
    "Step",
    "open_native_stream",
    "retrying",
]

log = structlog.get_logger("dshim.streams")

T = TypeVar("T")

#: Intermediate failures in a row (other than rate limits) after which updates stop.
MAX_UPDATE_FAILURES = 3
#: The log records of intermediate failures: a rate limit's pause, a failure that is
#: tried again, the failure that stops the updates.
STREAM_EVENTS = ("stream_rate_limited", "stream_update_failed", "stream_updates_stopped")


class Step(enum.Enum):
    """What an intermediate call achieved."""

    #: The text is on the screen (a channel that showed only a part of it answers AGAIN).
    SHOWN = "shown"
    #: Nothing was shown; try again with the newest text after ``interval_s``.
    AGAIN = "again"
    #: No more intermediate calls for this answer; ``finish`` does the rest.
    STOP = "stop"
    #: The native way is closed for this answer: the fallback takes over from here.
    FALLBACK = "fallback"


class NativeCalls(Protocol):
    """What a channel supplies for one natively streamed answer.

    The calls are never concurrent (the engine holds a lock around each), and ``finish``
    is called at most once, after the last intermediate call returned.
    """

    #: At least this long between the starts of two intermediate calls.
    interval_s: float
    #: Whether a status note is shown under the text (``⏳ note``) while there is no more.
    shows_notes: bool

    def bind(self, stream: NativeStream) -> None:
        """Receive the stream these calls serve, before anything runs (see
        :class:`BoundCalls`)."""
        ...

    async def start(self, text: str) -> Step:
        """Put the first text of the answer on the screen."""
        ...

    async def append(self, text: str) -> Step:
        """Bring what is shown towards ``text`` (the whole display text so far)."""
        ...

    async def finish(self, text: str) -> list[Delivered] | None:
        """The complete final text, exactly once (``text`` may be empty: then only close
        what is up).  None: it could not be finished natively and nothing of it may be
        shown twice by the fallback (the channel made sure of that); raise to hand the
        answer to the pipeline's outbox (a failure whose outcome is known)."""
        ...

    def fallback(self) -> AbstractAsyncContextManager[ReplyStream] | None:
        """The stream that takes over at :attr:`Step.FALLBACK` or when ``finish`` returned
        None (opened then, inside the engine's nursery); None when there is none (then a
        None from ``finish`` delivers nothing more)."""
        ...

    async def abandon(self) -> None:
        """Left without ``finish``: close what is up (best effort, bounded, never raises)."""
        ...

    async def background(self) -> None:
        """Work that runs beside the stream until it ends (a status line, timers)."""
        ...


S = TypeVar("S", bound="NativeStream")


class BoundCalls(Generic[S]):
    """What every channel's :class:`NativeCalls` shares: the stream it is bound to
    (``stream``: its text, note, lock and hooks), set by :func:`open_native_stream`
    before any call."""

    _bound: S | None = None

    def bind(self, stream: S) -> None:
        self._bound = stream

    @property
    def stream(self) -> S:
        assert self._bound is not None, "bound by open_native_stream"
        return self._bound


class NativeStream(WatchesDelivery):
    """One answer on a :class:`NativeCalls` (a :class:`~dshim.outbound.ReplyStream` with
    ``watch_delivery``).  Open with :func:`open_native_stream`."""

    def __init__(self, calls: NativeCalls, *, events: tuple[str, str, str] = STREAM_EVENTS) -> None:
        self.calls = calls
        self.events = events
        self.text = ""
        self.note: str | None = None
        #: What the last intermediate call put on the screen (None: nothing yet).
        self.shown: str | None = None
        self.started = False
        self._last_call = -math.inf
        self._paused_until = -math.inf
        self._failures = 0
        self._changed = trio.Event()
        self._finishing = trio.Event()
        self._pump_done = trio.Event()
        self._lock = trio.Lock()
        self._first = trio.Lock()
        self._hook: DeliveryHook | None = None
        self._hook_done = False
        self._finished = False
        self._nursery: trio.Nursery | None = None
        self._fallback: ReplyStream | None = None
        self._fallback_ready = trio.Event()

    # -- what the pipeline calls --------------------------------------------------------

    def watch_delivery(self, hook: DeliveryHook) -> None:
        self._hook = hook

    async def update(self, text: str) -> None:
        if self._fallback is not None:
            await self._fallback.update(text)
            return
        if text != self.text:
            self.text = text
            self.note = None
            self.wake()

    async def progress(self, note: str) -> None:
        if self._fallback is not None:
            await self._fallback.progress(note)
            return
        if self.calls.shows_notes:
            self.note = note.strip() or None
            self.wake()

    async def finish(self, text: str) -> list[Delivered]:
        """The final text, exactly once: natively, or by the fallback."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        self._finishing.set()
        self.wake()
        await self._pump_done.wait()
        if self._fallback is None:
            async with self._lock:
                done = await self.calls.finish(text)
            if done is not None:
                return done
        fallback = await self._open_fallback()
        if fallback is None:
            return []
        return await fallback.finish(text)

    # -- what the channel's calls use -----------------------------------------------------

    def wake(self) -> None:
        """Plan the next intermediate call (a call that showed only part of the text calls
        this, so the rest follows after the interval)."""
        self._changed.set()

    @property
    def finishing(self) -> bool:
        return self._finishing.is_set()

    @property
    def lock(self) -> trio.Lock:
        """Held around every call the engine makes; a channel's own calls on the same
        answer outside the engine (a timer's rotation, a card attached to the stream)
        take it too, so calls on one answer never overlap."""
        return self._lock

    def paced(self) -> None:
        """A call of the channel's own on this answer (outside the engine) went out now:
        the next intermediate call waits ``interval_s`` from here."""
        self._last_call = trio.current_time()

    def pause(self, seconds: float) -> None:
        """No intermediate call before ``seconds`` from now (and never before
        ``interval_s`` after the last): what a channel that catches its own failures sets
        before it answers :attr:`Step.AGAIN`."""
        self._paused_until = max(self._paused_until, trio.current_time() + seconds)

    @property
    def next_call_at(self) -> float:
        """When the next call on this answer may go: ``interval_s`` after the last, not
        before a pause ended (what a ``finish`` paced like the intermediate calls waits
        for)."""
        return max(self._last_call + self.calls.interval_s, self._paused_until)

    def redraw(self) -> None:
        """What is shown no longer holds the display text (the channel moved on to a new
        message or bubble): the next intermediate call goes out even if the text did not
        change."""
        self.shown = None
        self._changed.set()

    async def delivering(self) -> None:
        """Right before the channel's first call that can show text: the delivery hook,
        once (whoever comes second waits until it is done)."""
        async with self._first:
            hook, self._hook = self._hook, None
            self._hook_done = True
            if hook is not None:
                await hook()

    def display(self) -> str:
        """The text an intermediate call should show now."""
        text = self.text.strip()
        if self.note is None:
            return text
        return f"{text}\n\n⏳ {self.note}" if text else f"⏳ {self.note}"

    # -- the pump -------------------------------------------------------------------------

    async def _pump(self) -> None:
        """Intermediate calls until finish, a stop or the fallback."""
        try:
            while not self._finishing.is_set():
                display = self.display()
                if not display or display == self.shown:
                    await self._changed.wait()
                    self._changed = trio.Event()
                    continue
                not_before = self.next_call_at
                if trio.current_time() < not_before:
                    with trio.move_on_at(not_before):
                        await self._finishing.wait()
                    continue
                async with self._lock:
                    if self._finishing.is_set():
                        return
                    self._changed = trio.Event()
                    step = await self._call(display)
                if step is Step.STOP:
                    return
                if step is Step.FALLBACK:
                    fallback = await self._open_fallback()
                    if fallback is not None and self.text:
                        await fallback.update(self.text)
                    return
        finally:
            self._pump_done.set()

    async def _call(self, display: str) -> Step:
        self._last_call = trio.current_time()
        try:
            if self.started:
                step = await self.calls.append(display)
            else:
                step = await self.calls.start(display)
                self.started = step is Step.SHOWN
        except RateLimited as exc:
            self._paused_until = trio.current_time() + exc.retry_after
            log.info(self.events[0], retry_after=exc.retry_after)
            self._changed.set()
            return Step.AGAIN
        except ChannelError as exc:
            self._failures += 1
            if self._failures >= MAX_UPDATE_FAILURES:
                log.warning(self.events[2], error=str(exc)[:200])
                return Step.STOP
            log.info(self.events[1], error=str(exc)[:200], failures=self._failures)
            self._paused_until = trio.current_time() + self._failures
            self._changed.set()
            return Step.AGAIN
        if step is Step.SHOWN:
            self._failures = 0
            self.shown = display
        elif step is Step.AGAIN:
            self._changed.set()
        return step

    # -- the fallback -----------------------------------------------------------------------

    async def _open_fallback(self) -> ReplyStream | None:
        """The fallback stream, opened once in the engine's nursery (None: there is none)."""
        if self._fallback is not None:
            return self._fallback
        if self._fallback_ready.is_set():
            return None
        manager = self.calls.fallback()
        if manager is None or self._nursery is None:
            self._fallback_ready.set()
            return None
        await self._nursery.start(self._host_fallback, manager)
        return self._fallback

    async def _host_fallback(
        self,
        manager: AbstractAsyncContextManager[ReplyStream],
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        async with manager as stream:
            if not self._hook_done:
                hook, self._hook = self._hook, None
                if hook is not None and isinstance(stream, WatchesDelivery):
                    stream.watch_delivery(hook)
            self._fallback = stream
            self._fallback_ready.set()
            task_status.started()
            await trio.sleep_forever()


@asynccontextmanager
async def open_native_stream(
    calls: NativeCalls,
    *,
    events: tuple[str, str, str] = STREAM_EVENTS,
    stream_type: type[NativeStream] = NativeStream,
) -> AsyncIterator[NativeStream]:
    """Run one natively streamed answer::

        async with open_native_stream(calls) as stream: ...

    ``calls.bind`` receives the stream before anything runs (the calls use its
    :meth:`~NativeStream.delivering`, :meth:`~NativeStream.wake` and ``text``).  Leaving
    the block without ``finish`` cancels the background work and abandons what is up;
    a failure raised by ``finish`` passes through as itself (never a group).  ``events``
    names the log records of intermediate failures (:data:`STREAM_EVENTS`); the stream is
    a ``stream_type`` (a subclass that adds a feature of the channel's own, such as
    ``watch_stop``; ``calls.bind`` receives it as that).
    """
    stream = stream_type(calls, events=events)
    calls.bind(stream)
    try:
        with single_error():
            async with trio.open_nursery() as nursery:
                stream._nursery = nursery
                nursery.start_soon(stream._pump)
                nursery.start_soon(calls.background)
                try:
                    yield stream
                finally:
                    stream._nursery = None
                    nursery.cancel_scope.cancel()
    finally:
        if not stream._finished:
            stream._finished = True
            with trio.CancelScope(shield=True):
                await calls.abandon()


async def retrying(
    call: Callable[[], Awaitable[T]],
    *,
    give_up_at: float,
    backoff: Backoff,
    rate_limit_budget_s: float = math.inf,
    repeatable: bool = True,
    on_unsure: Callable[[], None] | None = None,
    events: tuple[str, str] = ("stream_rate_limited", "stream_call_retry"),
    log_context: Mapping[str, object] | None = None,
) -> T:
    """``await call()`` through transient failures until ``give_up_at``.

    A :class:`~dshim.errors.RateLimited` is waited out (``retry_after``) while the waits
    add up to at most ``rate_limit_budget_s``; a :class:`~dshim.errors.TransportError`
    backs off and repeats, except that a failure whose outcome is unknown (the request
    went out, no answer came back) is raised at once unless the call is ``repeatable``
    (making it twice changes nothing: an idempotency key, a set-to-this-text call);
    ``on_unsure`` hears of every such failure.  ``events`` names the log records of a
    rate-limit wait and of a retry, and ``log_context`` adds fields to both (which
    message is retried, as a channel's own records around the call say).  Refusals (any
    other ChannelError) are raised at once, as is the last failure when the time is up.
    """
    limited = 0.0
    context = dict(log_context or {})
    while True:
        try:
            return await call()
        except RateLimited as exc:
            limited += exc.retry_after
            if limited > rate_limit_budget_s:
                raise
            log.info(events[0], retry_after=exc.retry_after, **context)
            await trio.sleep(exc.retry_after)
        except TransportError as exc:
            unsure = outcome_unknown(exc)
            if unsure and on_unsure is not None:
                on_unsure()
            if unsure and not repeatable:
                raise
            delay = backoff.next_delay()
            if trio.current_time() + delay > give_up_at:
                raise
            log.info(events[1], error=str(exc)[:200], retry_in_s=delay, **context)
            await trio.sleep(delay)
