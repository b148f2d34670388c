"""Streaming answers by editing messages: the engine shared by edit-capable channels.

A channel that shows an answer while it is being written (send a message, then edit it as
text arrives) implements a tiny per-answer :class:`StreamTransport` and a set of
:class:`Limits`; this module does everything else: pacing, splitting, retries, and the
guarantee that the final text is delivered exactly once.  It knows no platform.

The transport protocol
----------------------
One transport object serves one answer (one conversation, one message being answered)::

    async def send(text: str, *, reply: bool) -> str
        Post a new message; return its platform id.  ``reply`` is True for the first
        message of an answer (it should quote / reply to the user's message) and False for
        follow-up messages.  ``text`` is never empty and never longer than the limit.
    async def edit(message_id: str, text: str) -> None
        Replace the text of a message this transport sent.  An edit that changes nothing
        ("message is not modified") must return normally: it is a success.
    async def typing() -> None
        Show a typing indicator (best effort; errors are logged and ignored).

Errors are the :mod:`dshim.errors` tree, mapped by the channel's client:
:class:`~dshim.errors.RateLimited` -> wait ``retry_after`` (for every stream into the same
chat, see :class:`ChatPacer`), then retry; :class:`~dshim.errors.TransportError`
(network, timeout, 5xx) -> retry with backoff (a *send* of unknown outcome at most once, see
below); :class:`~dshim.errors.NotFound` on an edit
(the user deleted the message) -> the text is sent as a new message instead; anything
else is final and raised from :meth:`EditStream.finish`.  Every retry loop is capped in
time (``Limits.send_retry_s``, 120 s by default).

Limits (:class:`Limits`) come from the platform: the maximum message length measured by a
platform length function (e.g. UTF-16 code units, or code points), the
delay before the first message is posted, the minimum interval between two edits of one
message, and the typing refresh interval.  A :class:`ChatPacer` shared by all answers
into one chat carries the optional per-chat budget (N sends or edits per window, for
platforms that flood-limit busy chats) and the pause a 429 imposes.

Theory of operation
-------------------
``update(text)`` only records the newest full text; a background *pump* task turns it
into at most one platform call at a time: the first message is posted once
``first_send_delay_s`` has passed since text first arrived, then it is edited at most
once per ``edit_interval_s``; text beyond the limit continues in follow-up messages split
at paragraph, line or word boundaries (:func:`split_text`).  Texts that arrive while a
call or a wait is in progress are merged: only the newest is ever sent.  Until the first
message is posted, ``typing()`` is repeated every ``typing_interval_s``.

The background tasks start only when there is something for them to do: the typing task
once ``typing_grace_s`` has passed without text (at once when the grace is 0), the pump
once the first message is due.  Until then one timer task per trio run (:class:`_Starter`)
holds their deadlines.  An answer that is complete before either deadline — the common
case for a quick agent — costs no task at all: ``finish`` sends it directly.

Why the starter may be a system task (the one place that is not a child of the bot's
nursery) without bending structured concurrency: it runs no answer's work itself.  When
a deadline comes up it only calls ``nursery.start_soon`` on *that answer's own* nursery
(inside the answer's captured context), so the pump and the typing task are children of
the answer, supervised, cancelled and awaited with it like any other task.  What it
holds is a heap of deadlines; the failure paths: an answer that finished (or left its
block: ``open_edit_stream.__aexit__`` clears the nursery before cancelling it) before
its deadline is skipped when the deadline comes up; a bug raised while starting one
answer's task is logged (``stream_start_failed``) and the others' deadlines still run
(the system task never raises, which would crash the run); it lives as long as its trio
run (a ``RunVar``: a new run, e.g. each test, gets its own) and is cancelled with it.
The alternative — a timer task per answer in the answer's nursery — costs a task per
answer even for quick ones (B1 in docs/performance.md); ``tests/test_render_starter.py``
holds the failure paths.

``finish(final)`` stops the pump after its in-flight call (a call is never cancelled
half-way, so a message the platform created is always known by id), then brings every
message to its final chunk, waiting for pacing and retry-after as needed.  A message
whose send returned an id is only ever edited afterwards, so retries never duplicate it.

Delivery exactly once, as far as the platform lets us know: a send that failed before
the request left (:class:`~dshim.errors.TransportError` with ``request_sent=False``,
could not connect) or that the platform answered with a failure (a 5xx status, a 429)
certainly created nothing and is retried with backoff for ``send_retry_s``.  A send
whose outcome is unknown (the request went out, no answer came back: ``request_sent=True``
without a status — a timeout, a connection lost after the request was written) may have
created the message without our knowing its id.  Such a message slot is treated as
possibly delivered (also the first message a channel sent itself, a native stream's
start, reported with :meth:`EditStream.unconfirmed_send`): intermediate previews stop, and
``finish`` repeats the send *once*
(:data:`UNSURE_SENDS_MAX` sends in all) — ``unknown_repeat_wait_s`` later and once the
platform answers again (the transport's optional ``reachable()`` probe, retried with
backoff), so a short outage costs no answer; if that one is unsure too it gives up (raises) rather than post copy
after copy.  Text after a send that did return an id goes
by edit to that message.  The user sees at most two copies, never a loop of them.
Transports whose platform deduplicates sends declare ``idempotent_sends = True`` and are
retried normally.

Intermediate failures never end the turn: the pump logs them and stops showing
intermediate text; ``finish`` still delivers the final text (or raises why it cannot).
"""

from __future__ import annotations

import contextvars
import heapq
import itertools
import math
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, runtime_checkable

import structlog
import trio

from dshim.backoff import Backoff
from dshim.errors import ChannelError, DshimError, NotFound, RateLimited, TransportError
from dshim.model import Delivered, ReplyTarget
from dshim.outbound import ReplyStream, WatchesDelivery

__all__ = [
    "ChatPacer",
    "EditOutbound",
    "EditStream",
    "IdempotentSends",
    "Limits",
    "PacerPool",
    "ProbesReachable",
    "StreamTransport",
    "deliver_text",
    "open_edit_stream",
    "split_text",
]

log = structlog.get_logger("dshim.render")

#: A cut is looked for in the last 45 % of a chunk (past 55 % of it), so chunks stay large.
SPLIT_MIN_FRACTION = 0.55
#: Shown in a follow-up message that the final text no longer needs (text shrank).
CONTINUED_MARK = "…"
BACKOFF_MAX_S = 30.0
#: Sends of one message whose outcome may be unknown: the first and one repeat, so the
#: user sees at most two copies of it.
UNSURE_SENDS_MAX = 2


class StreamTransport(Protocol):
    """What a channel provides for one answer (see the module docstring).

    Optional features: :class:`IdempotentSends` (the platform deduplicates repeated
    sends) and :class:`ProbesReachable` (a cheap call that tells the platform answers).
    """

    async def send(self, text: str, *, reply: bool) -> str: ...

    async def edit(self, message_id: str, text: str) -> None: ...

    async def typing(self) -> None: ...


@runtime_checkable
class IdempotentSends(Protocol):
    """A :class:`StreamTransport` that says whether its platform deduplicates repeated
    sends (an idempotency key, such as Discord's ``nonce`` with ``enforce_nonce``), with a
    class attribute ``idempotent_sends``.  When True the engine repeats a send of unknown
    outcome like any other transient failure; when False, or without the attribute (the
    default), such a send is repeated at most once."""

    idempotent_sends: bool


@runtime_checkable
class ProbesReachable(Protocol):
    """A :class:`StreamTransport` with ``reachable()``: a cheap platform call that returns
    once the platform answers again (raising ChannelError while it does not), awaited
    before the one repeat of a send of unknown outcome."""

    async def reachable(self) -> None: ...


@dataclass(frozen=True, slots=True)
class Limits:
    """A platform's message and pacing limits."""

    #: Maximum length of one message, in the units of ``measure``.
    max_len: int
    #: Length function; must count at least one unit per code point.
    measure: Callable[[str], int] = len
    #: The first message is posted this long after text first arrived (or at finish).
    first_send_delay_s: float = 1.0
    #: Minimum time between two calls on the same message.
    edit_interval_s: float = 1.0
    #: Typing indicator refresh until the first message is posted; None = no typing.
    typing_interval_s: float | None = 5.0
    #: No typing indicator until the agent has been silent this long (0: at once).  A
    #: quick answer then costs no typing call; a chat also gets at most one typing call
    #: per ``typing_interval_s`` across the answers it receives.
    typing_grace_s: float = 0.0
    #: How long one call is retried, with backoff, after failures that prove it was not
    #: delivered (could not connect, a 5xx or other failure status) before it gives up.
    send_retry_s: float = 120.0
    #: The one repeat of a send of unknown outcome waits at least this long (and until the
    #: platform answers a probe), so it does not fall into the outage that lost the first.
    unknown_repeat_wait_s: float = 15.0
    #: 429s are retried as the platform asks until this much waiting for one call has
    #: accumulated: a long flood-control storm delays the final text, it does not drop it.
    rate_limit_budget_s: float = 900.0
    #: Edits of the answer's messages in all, the final text's included (None: no limit).
    #: Intermediate calls stop while one final edit per message shown still fits, so the
    #: final text always lands within it (WhatsApp Web: 20, so a long answer does not
    #: flood the edit history).
    max_edits: int | None = None
    #: First backoff after a transient failure; doubles up to 30 s (:class:`dshim.backoff.Backoff`,
    #: no jitter: one stream's calls are sequential and tests rely on the exact waits).
    retry_backoff_s: float = 1.0

    def split(self, text: str) -> list[str]:
        return split_text(text, self.max_len, self.measure)


# --- splitting ---------------------------------------------------------------------------


def _fit(text: str, limit: int, measure: Callable[[str], int]) -> int:
    """The longest prefix length (code points) whose measure is within ``limit``."""
    lo, hi = 0, min(len(text), limit)
    if measure(text[:hi]) <= limit:
        return hi
    while lo < hi - 1:  # invariant: prefix lo fits, prefix hi does not
        mid = (lo + hi) // 2
        if measure(text[:mid]) <= limit:
            lo = mid
        else:
            hi = mid
    return lo


def split_text(text: str, limit: int, measure: Callable[[str], int] = len) -> list[str]:
    """Split ``text`` into chunks of at most ``limit`` units (by ``measure``).

    The text is trimmed; each chunk is cut at the last paragraph break (blank line) in
    its last 45 %, else the last line break there, else the last space, else exactly at
    the limit.  The separator at a cut is dropped and chunks are trimmed at the cut, so
    joining the chunks with the separators gives back the text.  Whitespace-only text
    gives no chunks.
    """
    if limit < 1:
        raise ValueError("limit must be at least 1")
    rest = text.strip()
    chunks: list[str] = []
    while rest:
        if measure(rest) <= limit:
            chunks.append(rest)
            break
        n = max(1, _fit(rest, limit, measure))
        window = rest[:n]
        floor = max(1, math.ceil(n * SPLIT_MIN_FRACTION))
        cut, skip = n, 0
        for sep in ("\n\n", "\n", " "):
            # The separator is dropped, so it may start right at the limit.
            p = rest.rfind(sep, floor, n + len(sep))
            if p > 0:
                cut, skip = p, len(sep)
                break
        head = rest[:cut].rstrip()
        if not head:  # only whitespace before the cut: cut hard instead
            head, cut, skip = window, n, 0
        chunks.append(head)
        rest = rest[cut + skip :].lstrip("\n")
    return chunks


# --- pacing shared by every answer into one chat ----------------------------------------


class ChatPacer:
    """The pacing state of one chat: a 429 pause and an optional sliding-window budget.

    ``budget`` calls per ``per_s`` seconds (None: unlimited).  Times are trio's clock.
    """

    def __init__(self, budget: int | None = None, per_s: float = 60.0) -> None:
        self.budget = budget
        self.per_s = per_s
        self.blocked_until = -math.inf
        self._recent: deque[float] = deque(maxlen=budget or 1)
        #: When this chat last got a typing indicator (trio time).
        self.typing_at = -math.inf

    def wait_time(self) -> float:
        """Seconds until a call may be made (0 when it may be made now)."""
        now = trio.current_time()
        wait = self.blocked_until - now
        if self.budget is not None and len(self._recent) >= self.budget:
            wait = max(wait, self._recent[0] + self.per_s - now)
        return max(0.0, wait)

    def try_reserve(self) -> bool:
        """Take a slot if one is free now (atomic: no checkpoint)."""
        if self.wait_time() > 0:
            return False
        if self.budget is not None:
            self._recent.append(trio.current_time())
        return True

    async def acquire(self) -> None:
        """Wait until a call may be made, and take the slot."""
        while True:
            if self.try_reserve():
                return
            await trio.sleep(self.wait_time())

    def pause(self, seconds: float) -> None:
        """The platform asked for ``seconds`` of silence in this chat (429)."""
        self.blocked_until = max(self.blocked_until, trio.current_time() + max(0.0, seconds))


class PacerPool:
    """Pacers by chat key, bounded (least recently used chats are forgotten)."""

    def __init__(self, *, max_chats: int = 1024) -> None:
        self.max_chats = max_chats
        self._pacers: OrderedDict[str, ChatPacer] = OrderedDict()

    def get(self, key: str, *, budget: int | None = None, per_s: float = 60.0) -> ChatPacer:
        pacer = self._pacers.get(key)
        if pacer is None:
            pacer = ChatPacer(budget, per_s)
            self._pacers[key] = pacer
            while len(self._pacers) > self.max_chats:
                self._pacers.popitem(last=False)
        else:
            self._pacers.move_to_end(key)
        return pacer


# --- the stream ----------------------------------------------------------------------------


class _Msg:
    __slots__ = ("id", "text", "sent_at", "last_call")

    def __init__(self, id: str, text: str, sent_at: float, last_call: float) -> None:
        self.id = id
        self.text = text
        self.sent_at = sent_at  # epoch seconds (for Delivered)
        self.last_call = last_call  # trio time of the last send/edit


def _short(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text[:300]


class EditStream(WatchesDelivery):
    """One answer streamed by edits.  Implements :class:`dshim.outbound.ReplyStream`.

    Open with :func:`open_edit_stream`; :func:`deliver_text` uses it without the
    background tasks for complete texts.
    """

    def __init__(
        self,
        transport: StreamTransport,
        limits: Limits,
        *,
        clock: Callable[[], float],
        pacer: ChatPacer | None = None,
    ) -> None:
        self.transport = transport
        self.limits = limits
        self.clock = clock
        self.pacer = pacer if pacer is not None else ChatPacer()
        self._text = ""
        self._note: str | None = None
        self._first_text_at: float | None = None
        self._msgs: list[_Msg] = []
        self._changed = trio.Event()
        self._finishing = trio.Event()
        self._typing_done = trio.Event()
        self._pump_done = trio.Event()
        self._pump_done.set()  # no pump until started
        #: Where the background tasks run (open_edit_stream's nursery); None: not open.
        self._nursery: trio.Nursery | None = None
        #: The context they run in: the answer's own (log keys, request counters), also
        #: when the starter's task starts them.
        self._context: contextvars.Context | None = None
        self._pump_started = False
        self._finished = False
        self._pump_failures = 0
        #: Intermediate edits made (see ``Limits.max_edits``).
        self._edits = 0
        self._pump_backoff = self._backoff()
        self._rate_limited_s = 0.0
        #: Sends per message slot whose outcome is unknown (see _unsure_send).
        self._unsure: dict[int, int] = {}
        self._delivery_hook: Callable[[], Awaitable[None]] | None = None

    # -- what the turn calls ------------------------------------------------------------

    async def update(self, text: str) -> None:
        """The answer so far (the whole text, not a delta)."""
        if text != self._text:
            self._text = text
            self._note = None
            if self._first_text_at is None and text.strip():
                self._first_text_at = now = trio.current_time()
                if self._nursery is not None:  # the pump is due with the first message
                    _start_at(now + self.limits.first_send_delay_s, self, _PUMP)
            self._wake()

    async def progress(self, note: str) -> None:
        """A tool or status note: shown under the text already visible, until more text."""
        self._note = note.strip() or None
        self._wake()

    async def finish(self, text: str) -> list[Delivered]:
        """Deliver the complete final text; returns every message it now occupies."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        self._finishing.set()
        self._typing_done.set()
        self._wake()
        await self._pump_done.wait()
        chunks = self.limits.split(text)
        for i, chunk in enumerate(chunks):
            if i < len(self._msgs):
                if self._msgs[i].text != chunk:
                    await self._final_edit(i, chunk)
            else:
                await self._final_send(chunk, reply=not self._msgs, slot=i)
        for i in range(len(chunks), len(self._msgs)):
            if self._msgs[i].text != CONTINUED_MARK:  # the text shrank below this message
                await self._final_edit(i, CONTINUED_MARK)
        now = self.clock()
        return [
            Delivered(message_id=m.id, text=m.text, sent_at=m.sent_at, completed_at=now)
            for m in self._msgs[: len(chunks)]
        ]

    # -- background tasks ---------------------------------------------------------------

    def _wake(self) -> None:
        # Set once until the pump looks again (it renews the event): an answer streamed in
        # many small deltas does not make an event per delta.
        changed = self._changed
        if not changed.is_set():
            changed.set()

    def _start(self, what: str) -> None:
        """A deadline of :class:`_Starter` passed: start the pump or the typing task, unless
        the answer is finished (or no longer needs it) by now."""
        nursery, context = self._nursery, self._context
        if nursery is None or context is None or self._finishing.is_set():
            return
        if what == _PUMP:
            if not self._pump_started:
                self._pump_started = True
                self._pump_done = trio.Event()
                context.run(nursery.start_soon, _guard, self._pump)
        elif not self._typing_done.is_set() and self._first_text_at is None:
            context.run(nursery.start_soon, _guard, self._typing_loop)

    async def _sleep(self, seconds: float) -> None:
        """Sleep, but return at once when finish() is called."""
        with trio.move_on_after(seconds):
            await self._finishing.wait()

    def _display(self) -> str:
        text = self._text.strip()
        if text and self._note:
            return f"{text}\n\n⏳ {self._note}"
        return text

    def _plan(self) -> tuple[int, str, float] | None:
        """The next intermediate call: (message index, text, earliest trio time)."""
        display = self._display()
        if not display or self._first_text_at is None or self._unsure:
            return None  # (unsure: a message may be up unknown to us; finish repeats it)
        chunks = self.limits.split(display)
        most = self.limits.max_edits
        if most is not None and self._edits + len(self._msgs) >= most:
            # One final edit is kept for every message shown, so the final text lands
            # within the cap: nothing more is shown (sent or edited) before finish().
            return None
        for i, chunk in enumerate(chunks):
            if i < len(self._msgs):
                m = self._msgs[i]
                if m.text != chunk:
                    return i, chunk, m.last_call + self.limits.edit_interval_s
            elif i == 0:
                return 0, chunk, self._first_text_at + self.limits.first_send_delay_s
            else:
                return i, chunk, self._msgs[i - 1].last_call
        return None

    async def _pump(self) -> None:
        """Show intermediate text; ends when finish() is called or calls keep failing."""
        try:
            while not self._finishing.is_set():
                if self._changed.is_set():
                    self._changed = trio.Event()  # what changed so far is planned now
                plan = self._plan()
                if plan is None:
                    await self._changed.wait()  # finish() wakes it too
                    continue
                index, chunk, not_before = plan
                wait = max(not_before - trio.current_time(), self.pacer.wait_time())
                if wait > 0:
                    await self._sleep(wait)
                    continue  # plan again: newer text may have arrived meanwhile
                if not self.pacer.try_reserve():
                    continue
                if not await self._intermediate(index, chunk):
                    return
        finally:
            self._pump_done.set()

    async def _intermediate(self, index: int, chunk: str) -> bool:
        """One intermediate call; False when the pump should give up."""
        try:
            if index < len(self._msgs):
                m = self._msgs[index]
                m.last_call = trio.current_time()
                self._edits += 1
                await self.transport.edit(m.id, chunk)
                m.text = chunk
            else:
                await self._record_send(chunk, reply=not self._msgs)
        except RateLimited as exc:
            log.info("stream_rate_limited", retry_after=exc.retry_after)
            self.pacer.pause(exc.retry_after)
        except ChannelError as exc:
            if index >= len(self._msgs) and self._unsure_send(index, exc):
                # The message may be up without our knowing its id: no more previews,
                # finish() makes the one repeat it is allowed.
                log.warning("stream_updates_stopped", error=_short(exc), outcome="unknown")
                return False
            self._pump_failures += 1
            if isinstance(exc, TransportError) and self._pump_failures < 3:
                log.info("stream_update_failed", error=_short(exc))
                self.pacer.pause(self._pump_backoff.next_delay())
            else:
                log.warning("stream_updates_stopped", error=_short(exc))
                return False
        else:
            self._pump_failures = 0
            self._pump_backoff.reset()
        return True

    async def _typing_loop(self) -> None:
        """Typing until the first message is posted; started at once (no grace) or once the
        grace passed without text (see :meth:`_start`)."""
        interval = self.limits.typing_interval_s
        if interval is None:
            return
        grace = self.limits.typing_grace_s
        while not self._typing_done.is_set():
            # One indicator per interval per chat, also across answers (it lasts that long).
            wait = self.pacer.typing_at + interval - trio.current_time()
            if grace > 0 and wait > 0:
                with trio.move_on_after(wait):
                    await self._typing_done.wait()
                continue
            self.pacer.typing_at = trio.current_time()
            try:
                await self.transport.typing()
            except ChannelError as exc:
                log.debug("typing_failed", error=_short(exc))
            with trio.move_on_after(interval):
                await self._typing_done.wait()

    # -- final delivery -----------------------------------------------------------------

    def _backoff(self) -> Backoff:
        """The retry schedule of one call: ``retry_backoff_s`` doubling up to 30 s, exact."""
        first = self.limits.retry_backoff_s
        return Backoff(first, max(BACKOFF_MAX_S, first), 2.0, jitter=0.0)

    def watch_delivery(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Call ``await hook()`` once, right before this answer's first send: from then on
        part of it may be on the user's screen (see :class:`dshim.outbound.ReplyStream`)."""
        self._delivery_hook = hook

    async def _record_send(self, text: str, *, reply: bool) -> _Msg:
        """Send, and remember the message the moment its id is known."""
        hook, self._delivery_hook = self._delivery_hook, None
        if hook is not None:
            await hook()
        sent_at = self.clock()
        mid = await self.transport.send(text, reply=reply)
        m = _Msg(mid, text, sent_at, trio.current_time())
        self._msgs.append(m)
        self._typing_done.set()
        return m

    async def _retrying(self, backoff: Backoff, exc: ChannelError, give_up_at: float) -> None:
        """Account one failed attempt: wait as the error asks, or re-raise when the call's
        retry time (``send_retry_s``, ending at ``give_up_at``) is spent.

        429 waits are charged to the stream's rate-limit budget instead, so flood control
        never makes us drop the final text.
        """
        if isinstance(exc, RateLimited):
            self._rate_limited_s += exc.retry_after
            if self._rate_limited_s > self.limits.rate_limit_budget_s:
                log.warning(
                    "stream_delivery_gave_up", waited_s=self._rate_limited_s, error=_short(exc)
                )
                raise exc
            log.info("stream_rate_limited", retry_after=exc.retry_after, attempt=backoff.failures)
            self.pacer.pause(exc.retry_after)
            return
        delay = backoff.next_delay()
        if trio.current_time() + delay > give_up_at:
            log.warning("stream_delivery_gave_up", attempts=backoff.failures, error=_short(exc))
            raise exc
        log.info("stream_delivery_retry", error=_short(exc), retry_in_s=delay)
        await trio.sleep(delay)

    def _unsure_send(self, slot: int, exc: ChannelError) -> bool:
        """Count a send of message ``slot`` that may have been delivered; True if it was one.

        A send is unsure when the request went out and no answer came back
        (:attr:`TransportError.request_sent` without a status: a timeout, a connection lost
        after the request was written), unless the transport's sends are idempotent.  A
        failure status (5xx) is an answer: the platform did not create the message.
        """
        if (
            isinstance(exc, TransportError)
            and exc.request_sent
            and exc.status is None
            and not (
                isinstance(self.transport, IdempotentSends) and self.transport.idempotent_sends
            )
        ):
            self._unsure[slot] = self._unsure.get(slot, 0) + 1
            return True
        return False

    async def _until_reachable(self, backoff: Backoff, give_up_at: float) -> None:
        """Before the one repeat of a send of unknown outcome: wait
        ``unknown_repeat_wait_s`` (a brief outage that drops requests is over by then: the
        repeat must not fall into it), then until the platform answers again (the
        transport's optional ``reachable`` probe, retried with backoff)."""
        probe: Callable[[], Awaitable[None]] | None = (
            self.transport.reachable if isinstance(self.transport, ProbesReachable) else None
        )
        now = trio.current_time()
        await trio.sleep(max(0.0, min(self.limits.unknown_repeat_wait_s, give_up_at - now)))
        while probe is not None:
            try:
                await probe()
                return
            except ChannelError as exc:
                log.info("stream_platform_unreachable", error=_short(exc))
            delay = backoff.next_delay()
            if trio.current_time() + delay > give_up_at:
                return  # out of time: the repeat goes now, once
            await trio.sleep(delay)

    def unconfirmed_send(self) -> None:
        """The answer's first message was sent outside the engine with an unknown outcome
        (a native stream's start whose answer was lost): it may be on the user's screen.
        No previews follow; ``finish`` makes the one repeat allowed, after the pause."""
        self._unsure[0] = self._unsure.get(0, 0) + 1

    async def _final_send(self, text: str, *, reply: bool, slot: int) -> None:
        backoff = self._backoff()
        give_up_at = trio.current_time() + self.limits.send_retry_s
        if self._unsure.get(slot, 0):
            # An earlier send of it (a preview, or outside the engine) may be up: its one
            # repeat must not fall into the outage that lost it either.
            await self._until_reachable(backoff, give_up_at)
        while True:
            if self._unsure.get(slot, 0) >= UNSURE_SENDS_MAX:
                raise TransportError("the message could not be confirmed", request_sent=True)
            await self.pacer.acquire()
            try:
                await self._record_send(text, reply=reply)
                return
            except (RateLimited, TransportError) as exc:
                if self._unsure_send(slot, exc):
                    if self._unsure[slot] >= UNSURE_SENDS_MAX:
                        # Delivered already, probably (twice, maybe): never a loop of copies.
                        log.warning(
                            "stream_delivery_gave_up", outcome="unknown", sends=self._unsure[slot]
                        )
                        raise
                    log.info("stream_send_unconfirmed", error=_short(exc))
                    await self._until_reachable(backoff, give_up_at)
                    continue
                await self._retrying(backoff, exc, give_up_at)

    async def _final_edit(self, index: int, text: str) -> None:
        backoff = self._backoff()
        give_up_at = trio.current_time() + self.limits.send_retry_s
        m = self._msgs[index]
        while True:
            await trio.sleep_until(m.last_call + self.limits.edit_interval_s)
            await self.pacer.acquire()
            m.last_call = trio.current_time()
            try:
                await self.transport.edit(m.id, text)
                m.text = text
                return
            except NotFound:
                # The message is gone (deleted by the user): post the text anew.
                log.info("stream_message_gone", message_id=m.id)
                self._msgs.pop(index)
                await self._final_send(text, reply=index == 0, slot=index)
                self._msgs.insert(index, self._msgs.pop())
                return
            except (RateLimited, TransportError) as exc:
                await self._retrying(backoff, exc, give_up_at)


def _unwrap(eg: BaseExceptionGroup[BaseException]) -> BaseException:
    """The single exception inside nested groups, or the group itself."""
    exc: BaseException = eg
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class open_edit_stream:  # noqa: N801 - a context manager used like a function
    """Run one streamed answer: typing until the first text, paced edits, then finish::

        async with open_edit_stream(transport, limits, clock=clock) as stream: ...

    Leaving the block without ``finish`` (stop, failure, shutdown) stops the background
    tasks and raises nothing of its own.  Exceptions from the block pass through
    unchanged (never wrapped in an ExceptionGroup).  A class rather than a generator
    context manager: every answer opens one.
    """

    __slots__ = ("_stream", "_nursery_manager", "_nursery")

    def __init__(
        self,
        transport: StreamTransport,
        limits: Limits,
        *,
        clock: Callable[[], float],
        pacer: ChatPacer | None = None,
    ) -> None:
        self._stream = EditStream(transport, limits, clock=clock, pacer=pacer)
        self._nursery_manager: AbstractAsyncContextManager[trio.Nursery] | None = None
        self._nursery: trio.Nursery | None = None

    async def __aenter__(self) -> EditStream:
        stream = self._stream
        manager = trio.open_nursery()
        nursery = await manager.__aenter__()
        self._nursery_manager, self._nursery = manager, nursery
        stream._nursery = nursery
        stream._context = contextvars.copy_context()
        limits = stream.limits
        if limits.typing_interval_s is not None:
            if limits.typing_grace_s > 0:
                _start_at(trio.current_time() + limits.typing_grace_s, stream, _TYPING)
            else:
                nursery.start_soon(_guard, stream._typing_loop)
        return stream

    async def __aexit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        manager, nursery = self._nursery_manager, self._nursery
        assert manager is not None and nursery is not None
        self._stream._nursery = None  # nothing starts any more
        nursery.cancel_scope.cancel()
        try:
            return await manager.__aexit__(typ, exc, tb)
        except BaseExceptionGroup as eg:
            inner = _unwrap(eg)
            if inner is eg:
                raise
            raise inner from None


_PUMP = "pump"
_TYPING = "typing"


class _Starter:
    """The deadlines at which streams start their background tasks: one heap and one
    system task per trio run (see the module docstring).  A deadline of an answer that
    finished meanwhile is dropped when it comes up."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, EditStream, str]] = []
        self._order = itertools.count()  # ties: first come, first started
        self._wakeup = trio.Event()
        self._sleeping_until = math.inf

    def at(self, when: float, stream: EditStream, what: str) -> None:
        heapq.heappush(self._heap, (when, next(self._order), stream, what))
        if when < self._sleeping_until:
            self._sleeping_until = when
            self._wakeup.set()

    async def run(self) -> None:
        heap = self._heap
        while True:
            now = trio.current_time()
            while heap and heap[0][0] <= now:
                _, _, stream, what = heapq.heappop(heap)
                try:
                    stream._start(what)
                except Exception:  # a bug: logged, and this run's other answers go on
                    log.exception("stream_start_failed", task=what)
            self._sleeping_until = heap[0][0] if heap else math.inf
            self._wakeup = trio.Event()
            with trio.move_on_at(self._sleeping_until):
                await self._wakeup.wait()


_STARTER: trio.lowlevel.RunVar[_Starter] = trio.lowlevel.RunVar("dshim_render_starter")


def _start_at(when: float, stream: EditStream, what: str) -> None:
    if when <= trio.current_time():
        stream._start(what)
        return
    try:
        starter = _STARTER.get()
    except LookupError:
        starter = _Starter()
        _STARTER.set(starter)
        trio.lowlevel.spawn_system_task(starter.run, name="dshim.render.starter")
    starter.at(when, stream, what)


async def _guard(fn: Callable[[], Awaitable[None]]) -> None:
    """Background tasks never end the answer; anything but a dshim error is a bug and
    propagates."""
    try:
        await fn()
    except DshimError as exc:
        log.warning("stream_task_failed", error=_short(exc))


async def deliver_text(
    transport: StreamTransport,
    limits: Limits,
    text: str,
    *,
    clock: Callable[[], float],
    pacer: ChatPacer | None = None,
) -> list[Delivered]:
    """Send a complete text (split as needed) with the same pacing and retry rules."""
    if not text.strip():
        return []
    stream = EditStream(transport, limits, clock=clock, pacer=pacer)
    return await stream.finish(text)


class EditOutbound:
    """An :class:`~dshim.outbound.Outbound` that streams by editing messages.

    A channel subclasses it and supplies :meth:`transport` (one :class:`StreamTransport`
    per answer); :meth:`pacer` gives every answer into one chat the same
    :class:`ChatPacer` (override it for per-chat budgets).  Notices (``send_text``) and
    streamed answers (``open_stream``) then share pacing, splitting and retries.
    """

    def __init__(
        self, *, limits: Limits, clock: Callable[[], float], bot_username: str | None
    ) -> None:
        self.limits = limits
        self.clock = clock
        #: The platform's own name for the bot, for ``/cmd@name``.
        self.bot_username = bot_username
        self._pacers = PacerPool()

    def transport(self, target: ReplyTarget) -> StreamTransport:
        """The transport of one answer to ``target``."""
        raise NotImplementedError

    def pacer(self, target: ReplyTarget) -> ChatPacer:
        """The pacer every answer into ``target``'s chat shares."""
        return self._pacers.get(target.conversation_id)

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        """Send a complete text under the user's message, split per the limits."""
        return await deliver_text(
            self.transport(target), self.limits, text, clock=self.clock, pacer=self.pacer(target)
        )

    def open_stream(self, target: ReplyTarget) -> AbstractAsyncContextManager[ReplyStream]:
        """Stream an answer by editing: typing, then the first message, then edits.

        Typed as any :class:`~dshim.outbound.ReplyStream`, as the pipeline sees it: a
        channel may override it with a stream of its own (a native one, or one around the
        engine's, which :meth:`edit_stream` opens)."""
        return self.edit_stream(target)

    def edit_stream(self, target: ReplyTarget) -> AbstractAsyncContextManager[EditStream]:
        """The engine's stream of one answer to ``target`` (what ``open_stream`` opens)."""
        return open_edit_stream(
            self.transport(target), self.limits, clock=self.clock, pacer=self.pacer(target)
        )
