"""Answers on QQ: passive replies only, C2C native streams, group notices and cuts.

QQ has no edit for C2C and group messages, and every reply is passive: it carries the
inbound ``msg_id`` and a ``msg_seq`` unique per reply to that message, within a window
(C2C 60 min, groups and guild channels 5 min) and a count (C2C 4, groups 5).
:class:`~.protocol.PassiveBudget` hands out the ``msg_seq`` values; a send is retried
with the *same* ``msg_seq``, so a send that landed is refused as a duplicate (40054005,
counted as sent) instead of shown twice.  A failure that proves nothing was delivered
(could not connect, a 5xx, a 429) is retried with backoff for ``send_retry_s`` (120 s),
then raised for the pipeline's outbox; a call whose answer was lost after it went out is
repeated once, after a pause and once ``GET /users/@me`` answers (:class:`_Retries`: the
engine's :func:`~dshim.streams.native.retrying` with the passive budget's rules around
it -- no 429 waited out into the window's end, nothing retried past it).  A stream
preview of unknown outcome stops the previews; when a stream's start turns out to have
landed unseen (40054005 on its repeat) with other text than the final one, the final
text goes in a new message.  304023/304024 (pending audit) count as sent without an id;
304027/40034128 (window expired) end the delivery of this answer with one log line,
never a retry loop.

Both kinds of answer run on the native-stream engine (:mod:`dshim.streams.native`: it
paces and merges the texts, runs the delivery hook once, finishes once and abandons on
cancellation); :class:`C2CCalls` and :class:`GroupCalls` are QQ's calls, and count their
failures the QQ way.  The message and retry limits are a :class:`~dshim.render.Limits`
(:data:`LIMITS`); :class:`Timings` holds the rest.

* **C2C**: the native stream (``/v2/users/{openid}/stream_messages``, ``input_mode``
  ``replace`` with the whole text so far, ``index`` 0, 1, 2 ..., ``stream_msg_id`` from
  the first answer) at most every 700 ms; a chunk must start with what the message
  already shows (else 40007), so when the agent rewrites earlier text, or the text passes
  2,000 characters, the message is finished and the answer continues in a new one.  A
  failed preview is tried again (after a 429's ``retry_after``) for as long as it takes;
  a refusal, like a lost answer, stops the previews.  A stream is always
  closed with ``input_state: 10`` -- by ``finish``, and also when the answer is stopped,
  cancelled or fails.  Its content is markdown when permitted, else text (50055/50056
  switch to text for the rest of the bot's life); other replies (notices, group answers)
  are plain text.
* **Groups** (and guild channels): no edit, no stream (no intermediate calls: the engine
  only collects the text).  A short "working…" reply when no answer is ready within 10 s
  (one slot), then the answer; if the agent is still running 30 s before the 5-minute
  window closes, what exists goes out with a notice that the rest cannot be delivered
  here (QQ forbids later replies) -- the pipeline keeps the full answer in the
  transcript.  Both are timers beside the stream, under the engine's lock.
* Every answer splits at 2,000 characters within the replies left; the last one carries
  a cut notice when they do not suffice.  The first message quotes the user's message
  (``message_reference.message_id`` = its ``msg_idx``; a group that rejects it gets the
  answer without).

Approvals and questions are text with numbered options; with ``keyboards`` on they are one
markdown message with a command button per option (:func:`keyboard_for`): a press sends the
option's number as the user's message, judged like a typed answer.

Every delivered message is returned as a :class:`~dshim.model.Delivered` whose id is its
``ext_info.ref_idx`` (the key a later quote of it carries; the message ``id`` when the
answer had none), so the pipeline's message index resolves quotes of the bot's answers.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import structlog
import trio

from dshim.channels.base import InteractionPrompt
from dshim.channels.kit import Backoff
from dshim.channels.qq import models as m
from dshim.channels.qq.client import QQApi
from dshim.channels.qq.protocol import (
    C2C,
    CHANNEL_KIND,
    DMS,
    GROUP,
    MAX_MESSAGE_CHARS,
    AlreadySent,
    MarkdownRejected,
    PassiveBudget,
    PendingAudit,
    ReplyWindowClosed,
    Route,
    StreamPrefixRejected,
    budget_for,
)
from dshim.errors import (
    AuthError,
    ChannelError,
    FatalChannelError,
    RateLimited,
    TransportError,
    outcome_unknown,
)
from dshim.model import Delivered, Option, ReplyTarget
from dshim.render import Limits, split_text
from dshim.streams.native import BoundCalls, NativeStream, Step, open_native_stream, retrying

log = structlog.get_logger("dshim.qq")

T = TypeVar("T")

#: Sent in a group when no answer is ready within ``working_after_s`` (uses one reply).
WORKING_TEXT = "⏳ Working on it…"
#: Ends what a group gets when the agent outlives QQ's 5-minute reply window.
WINDOW_NOTICE = (
    "[QQ allows replies to a group message only within 5 minutes: the rest of this answer "
    "cannot be delivered here. Ask again to continue.]"
)
#: Ends the last reply when an answer needs more messages than QQ allows per message.
TOO_LONG_NOTICE = "[The answer is longer than QQ lets a bot reply to one message: cut here.]"
#: Cuts are looked for in the last 45 % of a chunk (as :func:`dshim.render.split_text`).
SPLIT_MIN_FRACTION = 0.55
#: Budgets (per inbound message) remembered at most.
MAX_BUDGETS = 4096
#: Backoff between the attempts of one reply: 1 s (``Limits.retry_backoff_s``), doubling
#: up to this.
RETRY_BACKOFF_MAX_S = 10.0
#: Stream input states.
GENERATING, DONE = 1, 10
#: A chunk for a stream that is closed already (a repeat of a closing chunk that landed).
STREAM_FINISHED = 40054015
#: ``open_interaction(target, prompt)`` (see :mod:`dshim.outbound`).
Presenter = Callable[[ReplyTarget, InteractionPrompt], AbstractAsyncContextManager[list[Delivered]]]


#: 2,000 characters a message; a C2C stream chunk at most every 700 ms
#: (``edit_interval_s``); one reply is retried (same ``msg_seq``) for ``send_retry_s``
#: after failures that prove it was not delivered -- never past the reply window; the one
#: repeat of a reply whose answer was lost waits ``unknown_repeat_wait_s``, then until QQ
#: answers ``GET /users/@me`` again (see :class:`_Retries`).  No typing indicator.
LIMITS = Limits(max_len=MAX_MESSAGE_CHARS, edit_interval_s=0.7, typing_interval_s=None)


@dataclass(frozen=True, slots=True)
class Timings:
    """The renderer's timings beyond its :class:`~dshim.render.Limits` (tests shrink
    nothing: they run on the autojump clock)."""

    #: Groups: the "working…" reply when no answer is ready after this long.
    working_after_s: float = 10.0
    #: Groups: send what exists this long before the passive window closes (4.5 of 5 min).
    cut_before_end_s: float = 30.0
    #: Closing a stream when the answer is cancelled: at most this long.
    close_timeout_s: float = 5.0


DEFAULT_TIMINGS = Timings()


def fit_chunks(text: str, slots: int, notice: str, limit: int = MAX_MESSAGE_CHARS) -> list[str]:
    """``text`` split at ``limit`` into at most ``slots`` messages; when it needs more, the
    last one is cut so that it ends with ``notice``."""
    if slots <= 0:
        return []
    chunks = split_text(text, limit)
    if len(chunks) <= slots:
        return chunks
    kept = chunks[: slots - 1]
    rest = "\n\n".join(chunks[slots - 1 :])
    head = split_text(rest, max(1, limit - len(notice) - 2))
    return [*kept, (head[0] + "\n\n" + notice) if head else notice]


def cut_point(text: str, limit: int, at_least: int = 0) -> int:
    """Where to end a message of ``text`` (longer than ``limit``): the last paragraph break,
    line break or space in its last 45 %, else ``limit``; never before ``at_least``."""
    floor = max(at_least, math.ceil(limit * SPLIT_MIN_FRACTION))
    for sep in ("\n\n", "\n", " "):
        p = text.rfind(sep, floor, limit + 1)
        if p > 0:
            return p
    return max(limit, at_least)


#: QQ keyboards: at most 5 rows of 5 buttons.
KEYBOARD_ROWS, KEYBOARD_ROW_BUTTONS = 5, 5
BUTTON_LABEL_MAX = 32


def keyboard_for(options: Sequence[Option]) -> dict[str, Any]:
    """A custom keyboard with one button per option (``keyboard.content.rows``).

    Each button is a command button (``action.type`` 2) whose ``data`` is the option's
    number with ``enter`` set: a press sends that number as the user's message, so it is
    judged exactly like a typed answer (``permission.type`` 2: anyone may press; the
    pipeline accepts only the asker)."""
    buttons = [
        {
            "id": str(i),
            "render_data": {
                "label": option.label[:BUTTON_LABEL_MAX],
                "visited_label": option.label[:BUTTON_LABEL_MAX],
                "style": 1,
            },
            "action": {
                "type": 2,
                "permission": {"type": 2},
                "data": str(i),
                "enter": True,
                "unsupport_tips": f"reply with {i}",
            },
        }
        for i, option in enumerate(options[: KEYBOARD_ROWS * KEYBOARD_ROW_BUTTONS], start=1)
    ]
    rows = [
        {"buttons": buttons[i : i + KEYBOARD_ROW_BUTTONS]}
        for i in range(0, len(buttons), KEYBOARD_ROW_BUTTONS)
    ]
    return {"content": {"rows": rows}}


def message_body(
    route: Route,
    text: str,
    seq: int,
    *,
    markdown: bool,
    quote: bool,
    keyboard: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON of one passive reply (``send.md``): text or markdown (with a keyboard),
    ``msg_id``, ``msg_seq``, and the quote of the user's message by its ``msg_idx``."""
    if route.kind in (CHANNEL_KIND, DMS):  # guild: msg_id anchors it; no msg_seq
        return {"content": text, "msg_id": route.msg_id}
    body: dict[str, Any]
    if markdown:
        body = {"msg_type": 2, "markdown": {"content": text}}  # content must stay empty
        if keyboard is not None:
            body["keyboard"] = keyboard
    else:
        body = {"msg_type": 0, "content": text}
    body["msg_id"] = route.msg_id
    body["msg_seq"] = seq
    if quote and route.msg_idx:
        body["message_reference"] = {"message_id": route.msg_idx}
    return body


def _delivered_id(sent: m.Sent | None, route: Route, seq: int) -> str:
    if sent is not None and sent.ext_info is not None and sent.ext_info.ref_idx:
        return sent.ext_info.ref_idx
    if sent is not None and sent.id:
        return sent.id
    return f"{route.msg_id}#{seq}"  # landed, id unknown (40054005, pending audit)


class _Retries:
    """The attempts of one reply (the same ``msg_seq`` every time), under QQ's rules.

    A failure that proves the reply was not delivered (could not connect, a 5xx) is
    retried with backoff for ``send_retry_s`` -- the engine's :func:`retrying` -- then
    raised: the pipeline's outbox delivers the answer when QQ is back.  What is QQ's own
    is the passive budget: a 429 is waited out as long as QQ asks unless the wait would
    reach the end of the reply window (then ReplyWindowClosed), and nothing is retried
    past that end; a reply whose answer was lost after the request went out (unknown
    outcome) is repeated once, after ``unknown_repeat_wait_s`` and once QQ answers again,
    its ``msg_seq`` making QQ refuse the repeat (40054005) should the first have landed.
    A second unknown outcome is raised."""

    def __init__(self, out: QQOutbound, budget: PassiveBudget, *, unknown: int = 0) -> None:
        self._out = out
        self._budget = budget
        self._backoff = Backoff(
            min_s=out.limits.retry_backoff_s, max_s=RETRY_BACKOFF_MAX_S, jitter=0.0
        )
        self._give_up_at = min(out.mono() + out.limits.send_retry_s, budget.deadline)
        #: Unknown outcomes so far (a stream's preview may have had one already).
        self.unknown = unknown

    async def run(self, call: Callable[[], Awaitable[T]], **log_context: object) -> T:
        """``await call()`` until it is known to be done (or raise, see above)."""
        while True:
            try:
                return await retrying(
                    lambda: self._within_window(call, log_context),
                    give_up_at=self._give_up_at,
                    backoff=self._backoff,
                    repeatable=False,  # the one repeat is QQ's: below
                    events=("rate_limited", "reply_retrying"),
                    log_context=log_context,
                )
            except TransportError as exc:
                if not unknown_outcome(exc):  # out of time
                    log.warning("reply_delivery_gave_up", error=str(exc)[:200], **log_context)
                    raise
                self.unknown += 1
                if self.unknown > 1:
                    log.warning("reply_delivery_gave_up", outcome="unknown", **log_context)
                    raise
                log.info("reply_unconfirmed", error=str(exc)[:200], **log_context)
                await self.until_reachable()

    async def _within_window(
        self, call: Callable[[], Awaitable[T]], log_context: dict[str, object]
    ) -> T:
        """429s waited out as QQ asks (1 s when it does not say), within the window."""
        while True:
            try:
                return await call()
            except RateLimited as exc:
                wait = exc.retry_after or 1.0
                if self._out.mono() + wait >= self._budget.deadline:
                    raise ReplyWindowClosed("rate limited until the reply window closes") from exc
                log.info("rate_limited", retry_after=round(wait, 3), **log_context)
                await trio.sleep(wait)

    async def until_reachable(self) -> None:
        """Before the one repeat of a reply of unknown outcome: a pause (the outage that
        lost the answer is likely still on), then until QQ answers ``GET /users/@me``."""
        out = self._out
        give_up_at = max(self._give_up_at, out.mono())
        await trio.sleep(min(out.limits.unknown_repeat_wait_s, give_up_at - out.mono()))
        while True:
            try:
                await out.api.get_me()
                return
            except ChannelError as exc:
                log.info("platform_unreachable", error=str(exc)[:200])
            delay = self._backoff.next_delay()
            if out.mono() + delay > give_up_at:
                return  # out of time: the repeat goes now, once
            await trio.sleep(delay)


def unknown_outcome(exc: ChannelError) -> bool:
    """The request went out and no answer came back (timeout, connection lost after it
    was written): the platform may have processed it.  A status is an answer."""
    return outcome_unknown(exc)


class QQOutbound:
    """The :class:`~dshim.outbound.Outbound` of a QQ bot (see the module docstring)."""

    def __init__(
        self,
        api: QQApi,
        *,
        clock: Callable[[], float],
        bot_username: str | None,
        markdown: bool = True,
        keyboards: bool = False,
        timings: Timings = DEFAULT_TIMINGS,
        limits: Limits = LIMITS,
        monotonic: Callable[[], float] = trio.current_time,
    ) -> None:
        self.api = api
        self.clock = clock
        self.mono = monotonic
        self.bot_username = bot_username
        self.timings = timings
        self.limits = limits
        #: Markdown for C2C/group replies; off for good after a 50055/50056.
        self.markdown = markdown
        #: Groups quote the user's message until one rejects ``message_reference``.
        self.group_quotes = True
        #: C2C streams quote it too, until the stream endpoint rejects it (undocumented).
        self.stream_quotes = True
        self._budgets: OrderedDict[str, PassiveBudget] = OrderedDict()
        #: Approvals and questions with buttons, looked up by the pipeline (None: text).
        self.open_interaction: Presenter | None = self._open_keyboard if keyboards else None

    # -- budgets -----------------------------------------------------------------------

    def budget(self, route: Route) -> PassiveBudget:
        """The passive replies left for the message ``route`` answers (one per message)."""
        budget = self._budgets.get(route.msg_id)
        if budget is None:
            budget = budget_for(route, now=self.mono(), wall_now=self.clock())
            self._budgets[route.msg_id] = budget
            while len(self._budgets) > MAX_BUDGETS:
                self._budgets.popitem(last=False)
        return budget

    # -- sending one reply -------------------------------------------------------------

    async def send_one(
        self,
        route: Route,
        budget: PassiveBudget,
        text: str,
        *,
        quote: bool,
        keyboard: dict[str, Any] | None = None,
    ) -> Delivered:
        """One passive reply, retried with its ``msg_seq`` until it is known to be sent.

        Raises ReplyWindowClosed when no reply is possible any more; a refusal gives its
        ``msg_seq`` back (nothing was sent).
        """
        seq = budget.take(self.mono())
        if seq is None:
            raise ReplyWindowClosed("no passive reply left for this message (window or count)")
        sent_at = self.clock()
        quote = quote and (route.kind != GROUP or self.group_quotes)

        async def attempt() -> m.Sent | None:
            nonlocal quote
            while True:
                # Markdown only where it carries a keyboard: plain replies are text (every
                # bot may send it; markdown needs its own approval).
                markdown = keyboard is not None and self.markdown and route.kind in (C2C, GROUP)
                body = message_body(
                    route, text, seq, markdown=markdown, quote=quote, keyboard=keyboard
                )
                try:
                    return await self.api.send(route.kind, route.target, body)
                except (AlreadySent, PendingAudit) as exc:
                    log.info("reply_counted_as_sent", code=exc.code, seq=seq)
                    return None
                except MarkdownRejected:
                    if not markdown:
                        raise
                    log.info("markdown_rejected_using_text")
                    self.markdown = False
                except (RateLimited, TransportError):  # the same msg_seq again (_Retries)
                    raise
                except (ReplyWindowClosed, AuthError, FatalChannelError):
                    raise
                except ChannelError as exc:
                    if (
                        keyboard is None
                        and quote
                        and route.kind == GROUP
                        and type(exc) is ChannelError
                    ):
                        # The group refused the quote: answer without it from now on.
                        log.info("group_quote_rejected", error=str(exc))
                        self.group_quotes = False
                        quote = False
                        continue
                    budget.give_back(seq)  # refused: nothing was sent
                    raise

        sent = await _Retries(self, budget).run(attempt, seq=seq)
        return Delivered(
            message_id=_delivered_id(sent, route, seq),
            text=text,
            sent_at=sent_at,
            completed_at=self.clock(),
        )

    async def send_chunks(
        self,
        route: Route,
        budget: PassiveBudget,
        text: str,
        *,
        quote: bool,
        notice: str = TOO_LONG_NOTICE,
        before_first: Callable[[], Awaitable[None]] | None = None,
    ) -> list[Delivered]:
        """``text`` as replies within the budget; stops (logged) when the window closed."""
        out: list[Delivered] = []
        try:
            slots = budget.left(self.mono())
            for i, chunk in enumerate(fit_chunks(text, slots, notice, self.limits.max_len)):
                if i == 0 and before_first is not None:
                    await before_first()
                out.append(await self.send_one(route, budget, chunk, quote=quote and i == 0))
        except ReplyWindowClosed as exc:
            log.warning("reply_window_expired", error=str(exc), delivered=len(out))
        if not out and text.strip() and budget.left(self.mono()) == 0:
            log.warning("reply_not_delivered", reason="no passive reply left")
        return out

    # -- the Outbound interface --------------------------------------------------------

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        """A complete text (notice, command reply, approval prompt) as passive replies."""
        route = _route(target)
        return await self.send_chunks(route, self.budget(route), text, quote=True)

    @asynccontextmanager
    async def _open_keyboard(
        self, target: ReplyTarget, prompt: InteractionPrompt
    ) -> AsyncIterator[list[Delivered]]:
        """An approval or question as one markdown message with a button per option.

        Raises ChannelError on entry when QQ refuses it (no keyboard permission, markdown
        not permitted ...): the pipeline then sends the text, and later requests go as text
        at once.  QQ cannot take buttons away afterwards: a late press is a late answer,
        which the pipeline judges like a typed one."""
        route = _route(target)
        budget = self.budget(route)
        if not self.markdown or len(prompt.text) > self.limits.max_len:
            raise ChannelError("buttons need one markdown message")
        try:
            shown = await self.send_one(
                route, budget, prompt.text, quote=True, keyboard=keyboard_for(prompt.options)
            )
        except ChannelError as exc:
            if not isinstance(exc, (ReplyWindowClosed, TransportError, RateLimited)):
                log.warning("keyboard_refused_using_text", error=str(exc)[:200])
                self.open_interaction = None
            raise
        yield [shown]

    @asynccontextmanager
    async def open_stream(self, target: ReplyTarget) -> AsyncIterator[NativeStream]:
        """A C2C answer streams natively; groups and guilds get notices and the answer
        (both on the native-stream engine: :class:`C2CCalls`, :class:`GroupCalls`)."""
        route = _route(target)
        budget = self.budget(route)
        calls: C2CCalls | GroupCalls
        if route.kind == C2C:
            calls = C2CCalls(self, route, budget)
        else:
            calls = GroupCalls(self, route, budget)
        async with open_native_stream(calls) as stream:
            yield stream


def _route(target: ReplyTarget) -> Route:
    if not isinstance(target.route, Route):
        raise ChannelError("a QQ reply needs the inbound message it answers (passive only)")
    return target.route


# --- groups ------------------------------------------------------------------------------------


class GroupCalls(BoundCalls[NativeStream]):
    """A group answer on the native-stream engine: no intermediate calls at all (QQ has no
    edit or stream here); "working…" after 10 s and the cut 30 s before the window ends
    are timers (:meth:`background`, under the engine's lock), the answer goes in
    :meth:`finish` -- unless the cut delivered it already."""

    #: The engine's first call is its last (:attr:`Step.STOP`): no pacing to keep.
    interval_s = 0.0
    shows_notes = False

    def __init__(self, out: QQOutbound, route: Route, budget: PassiveBudget) -> None:
        self._out = out
        self._route = route
        self._budget = budget
        self._delivered: list[Delivered] = []
        self._done = False

    async def start(self, text: str) -> Step:
        return Step.STOP  # the text waits for finish (or the cut)

    async def append(self, text: str) -> Step:
        return Step.STOP

    async def background(self) -> None:
        await _guard(self._timers)

    async def _timers(self) -> None:
        out, budget, stream = self._out, self._budget, self.stream
        cut_at = budget.deadline - out.timings.cut_before_end_s
        await trio.sleep_until(min(out.mono() + out.timings.working_after_s, cut_at))
        async with stream.lock:
            if not self._done and not self._delivered and out.mono() < cut_at:
                try:
                    self._delivered.append(
                        await out.send_one(self._route, budget, WORKING_TEXT, quote=True)
                    )
                except ReplyWindowClosed as exc:
                    log.warning("reply_window_expired", error=str(exc), delivered=0)
                    self._done = True
                    return
        await trio.sleep_until(cut_at)
        async with stream.lock:
            if self._done:
                return
            self._done = True
            answer = stream.text
            log.warning("reply_window_closing", answered=len(answer))
            text = f"{answer.strip()}\n\n{WINDOW_NOTICE}" if answer.strip() else ""
            self._delivered += await out.send_chunks(
                self._route,
                budget,
                text or WINDOW_NOTICE,
                quote=not self._delivered,
                notice=WINDOW_NOTICE,
                before_first=stream.delivering,
            )

    async def finish(self, text: str) -> list[Delivered]:
        if not self._done:  # the engine holds its lock: the timers wait
            self._done = True
            self._delivered += await self._out.send_chunks(
                self._route,
                self._budget,
                text,
                quote=not self._delivered,
                before_first=self.stream.delivering,
            )
        return list(self._delivered)

    def fallback(self) -> None:
        return None  # every reply is passive: there is no other way to answer

    async def abandon(self) -> None:
        return None  # nothing is open


async def _guard(fn: Callable[[], Awaitable[None]]) -> None:
    """Background work never ends the answer; a dshim error is logged."""
    try:
        await fn()
    except (ChannelError, OSError) as exc:
        log.warning("stream_task_failed", error=str(exc)[:200])


# --- C2C streams -------------------------------------------------------------------------------


class _Message:
    """One streamed message: its stream id, next index, ``msg_seq`` and what it shows."""

    __slots__ = ("seq", "stream_id", "index", "shown", "ref_idx", "sent_at", "first", "unsure")

    def __init__(self, seq: int, sent_at: float, *, first: bool) -> None:
        self.seq = seq
        self.stream_id: str | None = None
        self.index = 0
        self.shown = ""
        self.ref_idx: str | None = None
        self.sent_at = sent_at
        self.first = first
        #: (content, input_state) of the calls whose answer was lost: QQ may have them.
        self.unsure: list[tuple[str, int]] = []


class C2CCalls(BoundCalls[NativeStream]):
    """A C2C answer on QQ's native stream (see the module docstring), on the
    native-stream engine: the engine paces and merges, these make the chunk calls.

    Every intermediate call brings the messages one chunk call towards the answer so far
    (the engine's raw ``text``: the messages' offsets are into it, as the final text's
    are).  Failures are counted the QQ way, so the calls catch them: a chunk whose answer
    was lost stops the previews (``finish`` repeats it once), other transient failures
    try again after the interval (a 429 after its ``retry_after``) as long as it takes, a
    closed reply window ends the delivery, a refusal ends the previews."""

    shows_notes = False

    def __init__(self, out: QQOutbound, route: Route, budget: PassiveBudget) -> None:
        self._out = out
        self._route = route
        self._budget = budget
        self.interval_s = out.limits.edit_interval_s
        #: Offset in the answer where the current message starts.
        self._start = 0
        self._cur: _Message | None = None
        self._delivered: list[Delivered] = []
        self._closed_window = False
        self._last_call = -math.inf
        #: Calls whose answer was lost while previewing (finish makes the one repeat).
        self._unknown = 0

    # -- intermediate calls ------------------------------------------------------------

    async def start(self, text: str) -> Step:
        return await self.append(text)

    async def append(self, text: str) -> Step:
        try:
            await self._step(self.stream.text, final=False)
        except (RateLimited, TransportError) as exc:
            if unknown_outcome(exc):
                # QQ may show this chunk: no more previews, finish repeats it once.
                log.warning("stream_updates_stopped", error=str(exc)[:200])
                self._unknown += 1
                return Step.STOP
            wait = exc.retry_after if isinstance(exc, RateLimited) else self.interval_s
            log.info("stream_update_failed", error=str(exc)[:200])
            self.stream.pause(wait or self.interval_s)
            return Step.AGAIN  # with the newest text
        except ReplyWindowClosed as exc:
            log.warning("reply_window_expired", error=str(exc))
            self._closed_window = True
            return Step.STOP
        except (ChannelError, OSError) as exc:
            log.warning("stream_task_failed", error=str(exc)[:200])
            return Step.STOP
        return Step.STOP if self._closed_window else Step.SHOWN

    async def _step(self, full: str, *, final: bool) -> None:
        """Bring the messages up to ``full``: one chunk call (not final), or all (final)."""
        limit = self._out.limits.max_len
        while True:
            cur = self._cur
            if cur is None:  # a new message starts at the next non-blank character
                portion = full[self._start :].lstrip()
                self._start = len(full) - len(portion)
            else:
                portion = full[self._start :]
                if not portion.startswith(cur.shown):
                    # The agent rewrote text this message already shows (40007 otherwise):
                    # finish it as it is and show the new text in a new message.
                    await self._close(cur)
                    continue
            if not portion.strip():
                if final and cur is not None:
                    await self._close(cur)
                return
            if len(portion) <= limit:
                # Trailing blanks are never shown: the next chunk must start with it.
                if await self._chunk(portion.rstrip(), DONE if final else GENERATING):
                    return
                continue  # that message cannot take it: a new one
            shown = len(cur.shown) if cur is not None else 0
            left = self._budget.left(self._out.mono())
            if left == 0 or (cur is None and left == 1):
                # This is the last message QQ allows: it ends with the cut notice.
                room = max(1, limit - len(TOO_LONG_NOTICE) - 2)
                cut = cut_point(portion, room, shown)  # never before what is shown
                content = portion[:cut].rstrip() + "\n\n" + TOO_LONG_NOTICE
                if not await self._chunk(content, DONE):
                    continue
                self._closed_window = True
                return
            cut = cut_point(portion, limit, shown)
            if not await self._chunk(portion[:cut].rstrip(), DONE):
                continue
            self._start += cut
            if not final:
                return

    async def _chunk(self, content: str, state: int) -> bool:
        """One stream call for the current message (a new message when there is none).

        False when the message cannot take it: its start landed in an earlier attempt
        whose answer was lost, so its id is unknown -- the text goes in a new message."""
        out = self._out
        cur = self._cur
        if cur is None:
            seq = self._budget.take(out.mono())
            if seq is None:
                raise ReplyWindowClosed("no passive reply left for this message")
            cur = self._cur = _Message(seq, out.clock(), first=not self._delivered)
            await self.stream.delivering()
        body: dict[str, Any] = {
            "input_mode": "replace",
            "input_state": state,
            "content_type": "markdown" if out.markdown else "text",
            "content_raw": content,
            "msg_id": self._route.msg_id,
            "msg_seq": cur.seq,
            "index": cur.index,
        }
        if cur.stream_id is not None:
            body["stream_msg_id"] = cur.stream_id
        elif cur.first and self._route.msg_idx and out.stream_quotes:
            body["message_reference"] = {"message_id": self._route.msg_idx}
        self._last_call = out.mono()
        self.stream.paced()  # a close and a new start in one step: paced from the last
        try:
            sent = await out.api.stream(self._route.target, body)
        except MarkdownRejected:
            if body["content_type"] != "markdown":
                raise
            log.info("markdown_rejected_using_text")
            out.markdown = False
            return await self._chunk(content, state)
        except StreamPrefixRejected:
            # What the message shows is not what we think: finish it, go on anew.
            if content != cur.shown:
                await self._close(cur)
                return True
            raise
        except AlreadySent:
            # The start landed in an earlier attempt (same msg_seq) whose answer was lost:
            # its id is unknown, so that message cannot be continued or closed.
            log.info("stream_start_counted_as_sent", seq=cur.seq)
            if cur.unsure and all(u[0] == content for u in cur.unsure):
                # What landed shows this very text (left open, when it was a preview:
                # without its id it cannot be closed, but the text is all there).
                self._end(cur, content)
                return True
            self._end(cur, cur.unsure[-1][0] if cur.unsure else cur.shown)
            return False
        except TransportError as exc:
            if unknown_outcome(exc):
                cur.unsure.append((content, state))
            raise
        except ChannelError as exc:
            if (
                exc.code == STREAM_FINISHED
                and state == DONE
                and cur.stream_id is not None
                and (content, DONE) in cur.unsure
            ):
                # The closing chunk landed earlier; only its answer was lost.
                log.info("stream_close_counted_as_sent", seq=cur.seq)
                cur.shown = content
                self._end(cur, content)
                return True
            if "message_reference" not in body or type(exc) is not ChannelError:
                raise
            # The stream endpoint refused the quote: stream without it from now on.
            log.info("stream_quote_rejected", error=str(exc)[:200])
            out.stream_quotes = False
            return await self._chunk(content, state)
        cur.index += 1  # a failed call is repeated with its index (QQ takes a repeat)
        if cur.stream_id is None and sent.id:
            cur.stream_id = sent.id
        if sent.ext_info is not None and sent.ext_info.ref_idx:
            cur.ref_idx = sent.ext_info.ref_idx
        cur.shown = content
        cur.unsure.clear()
        if state == DONE:
            self._end(cur, content)
        return True

    async def _close(self, cur: _Message) -> None:
        """Finish the current message as it is (``input_state`` 10)."""
        if cur.stream_id is None:  # nothing shown yet: nothing to close
            self._cur = None
            return
        await self._chunk(cur.shown, DONE)
        self._cur = None

    def _end(self, cur: _Message, content: str) -> None:
        self._cur = None
        if content:
            self._delivered.append(
                Delivered(
                    message_id=cur.ref_idx or cur.stream_id or f"{self._route.msg_id}#{cur.seq}",
                    text=content,
                    sent_at=cur.sent_at,
                    completed_at=self._out.clock(),
                )
            )

    # -- finishing ---------------------------------------------------------------------

    async def finish(self, text: str) -> list[Delivered]:
        """Deliver the final text (closing the stream with state 10) and return every
        message; a stream still open afterwards (the window closed, a failure raised)
        is closed like an abandoned one."""
        try:
            if not self._closed_window:
                await trio.sleep_until(self._last_call + self.interval_s)
                try:
                    await self._final(text)
                except ReplyWindowClosed as exc:
                    log.warning("reply_window_expired", error=str(exc))
            return list(self._delivered)
        finally:
            await self.close_open()

    async def _final(self, text: str) -> None:
        retries = _Retries(self._out, self._budget, unknown=self._unknown)
        if self._unknown:
            await retries.until_reachable()  # before the one repeat of the lost chunk
        await retries.run(lambda: self._step(text, final=True))

    def fallback(self) -> None:
        return None  # every reply is passive: there is no other way to answer

    async def abandon(self) -> None:
        await self.close_open()

    async def background(self) -> None:
        return None

    async def close_open(self) -> None:
        """Close a stream left open (stop, cancellation, failure): ``input_state`` 10."""
        cur = self._cur
        if cur is None or cur.stream_id is None:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(self._out.timings.close_timeout_s):
            try:
                await self._chunk(cur.shown, DONE)
                log.info("stream_closed", reason="answer_ended")
            except ChannelError as exc:
                log.warning("stream_close_failed", error=str(exc)[:200])


__all__ = [
    "LIMITS",
    "C2CCalls",
    "GroupCalls",
    "QQOutbound",
    "Timings",
    "cut_point",
    "fit_chunks",
    "message_body",
]
