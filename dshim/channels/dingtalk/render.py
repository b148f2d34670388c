"""DingTalk outbound: AI-card answers streamed in place, markdown when cards cannot be used.

Answers (``answer = "card"``, the default)
------------------------------------------
One streaming AI card per answer: ``POST /v1.0/card/instances`` (a fresh ``outTrackId``)
and ``/deliver`` into the direct chat (``IM_ROBOT.<staffId>``) or the group
(``IM_GROUP.<conversationId>``, the asker @-ed) once the first text is there, then the
whole text so far with ``PUT /v1.0/card/streaming`` (``isFull``, a new ``guid`` each
call) at most every 500 ms, finally ``isFinalize`` and ``flowStatus`` 3 (``isError`` and
5 when the agent failed or the final text cannot be streamed).  The answer streams on
the native-stream engine (:mod:`dshim.streams.native`; :class:`CardCalls` makes the card
calls): it merges the texts between two streaming calls, pauses them for a 429's wait
and one second per other failure in a row, stops them at the third (the final text still
goes), awaits the delivery hook between the create and the delivery (a card shows
nothing before it) and finishes once.  A create that fails while the answer is written
is not retried then: the card waits for the final text.  Card calls are idempotent (the
whole text each time), so the final ones are retried through 429s and QPS 403s within a
budget (the engine's :func:`~dshim.streams.native.retrying`, with the quota rule below
for creating and delivering).  The card is recorded in the message index under its
``outTrackId`` when it is delivered and gets its final text when it is finished, so a
quote of it (``originalProcessQueryKey``) recovers the exact answer; the card path
therefore reports no :class:`Delivered` of its own (the pipeline would index the same
card twice).

Fallback: when creating or delivering the card is refused (not permitted, over the card
quota: 403 QPS or 429 again after one short wait, another refusal), or the final text
cannot be streamed, the answer is sent as markdown at the end (the engine's fallback,
:class:`MarkdownAtEnd`, as every answer is with ``answer = "markdown"``): through the
message's ``sessionWebhook`` while it is valid, else the robot OpenAPI
(``oToMessages/batchSend`` / ``groupMessages/send``, whose ``processQueryKey`` is the
delivered id).  That answers fell back, and why, is logged once per bot.  Text paths
split beyond 4,000 characters.

Failures follow :mod:`dshim.render`'s rules (``Limits.send_retry_s``,
``unknown_repeat_wait_s``).  Every card call names its card by ``outTrackId`` and
carries the whole state (a create that finds its ``outTrackId`` taken after a lost answer
was made; a delivery into the same space, the whole text with ``isFull``, a
``flowStatus``): repeating one changes nothing, so a card call is retried through
failures that prove nothing happened *and* through lost answers, with backoff, for
``send_retry_s``.  A markdown send has no such key: one that certainly did nothing (could
not connect, a 5xx, a 429 after its wait) is retried with backoff for ``send_retry_s``;
one whose answer was lost after the request went out is repeated once, after
``unknown_repeat_wait_s`` and once the OpenAPI answers again (:meth:`DingTalkApi.reachable`),
and a second lost answer gives up (the user may see it twice, never a loop of copies).
An answer still not delivered after its retries is raised as a :class:`TransportError`
the pipeline's outbox keeps (``request_sent`` False: certainly not shown, or shown only
in a card this process can still finish): when DingTalk is back the outbox's delivery
goes into that same card (the open card is remembered per message), else as markdown --
after a restart too, when a card left open by the first process stays as it was.

A reaction ("thinking") is put on the user's message while the answer is being written
and taken back at the end; DingTalk has no typing indicator.  Approvals and questions
are markdown text with numbered options.
"""

from __future__ import annotations

import math
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import structlog
import trio

from dshim.channels.base import ChannelStore, OutboundEntry, ReplyStream, WatchesDelivery
from dshim.channels.dingtalk.client import DingTalkApi
from dshim.channels.dingtalk.protocol import Route, card_markdown, new_track_id
from dshim.channels.kit import Backoff
from dshim.errors import (
    ChannelError,
    PermissionDenied,
    RateLimited,
    TransportError,
    outcome_unknown,
)
from dshim.model import AGENT_FAILED_NOTE, Delivered, ReplyTarget
from dshim.render import BACKOFF_MAX_S, Limits, split_text
from dshim.streams.native import BoundCalls, NativeStream, Step, open_native_stream, retrying

log = structlog.get_logger("dshim.dingtalk")

#: The public streaming AI-card template (variables msgContent, flowStatus ...).
DEFAULT_CARD_TEMPLATE = "02fcf2f4-5e02-4a85-b672-46d1f715543e.schema"
#: Text paths (markdown) split beyond this many characters.
MAX_TEXT_LEN = 4000
#: At most one card streaming call per this many seconds.
CARD_INTERVAL_S = 0.5
#: A session webhook this close to its expiry is not used any more.
WEBHOOK_MARGIN_S = 30.0
#: 429 / QPS waits one final call may accumulate before it gives up.
RATE_LIMIT_BUDGET_S = 120.0
#: How long cards are not tried again after DingTalk said they are not permitted.
CARD_DENIED_RETRY_S = 600.0
REACTION_TIMEOUT_S = 5.0
#: A card call refused for QPS is tried again once after the wait, if it is this short.
QPS_RETRY_MAX_S = 5.0
#: How long closing an abandoned card may take (it runs shielded, at shutdown).
ABANDON_TIMEOUT_S = 5.0
TITLE_MAX = 30
#: Cards left unfinished by an answer the outbox keeps (per message), at most.
OPEN_CARDS_MAX = 1024
#: The answer of a create whose outTrackId exists already: an earlier attempt made it.
TRACK_EXISTS = "param.outTrackIdExists"
#: The log records of the streaming calls' failures (the engine's, under card names): a
#: rate limit's pause, a failure tried again, the failure that stops the updates.
CARD_EVENTS = ("card_rate_limited", "card_update_failed", "card_updates_stopped")
#: The log records of a card call's retries: a rate limit's wait, a transport retry.
CARD_CALL_EVENTS = ("card_rate_limited", "card_call_retry")

T = TypeVar("T")

AnswerMode = Literal["card", "markdown"]
Hook = Callable[[], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class OpenCard:
    """A card an undelivered answer left behind: the outbox's delivery finishes it."""

    track_id: str
    #: Its delivery was confirmed (it is in the chat and in the message index).
    delivered: bool


class _QuotaSpent(Exception):
    """A quota refusal that is not waited for: carries it past :func:`retrying` (which
    waits out every rate limit within its budget), to be raised as itself."""

    def __init__(self, limited: RateLimited) -> None:
        super().__init__(str(limited))
        self.limited = limited


def unsure(exc: ChannelError) -> bool:
    """Whether a failed call may have been carried out: the request went out and no
    answer came back (a status, even a 5xx, is an answer)."""
    return outcome_unknown(exc)


def split(text: str) -> list[str]:
    """The chunks a markdown answer is sent in (4,000 characters each at most)."""
    return split_text(text, MAX_TEXT_LEN)


def _title(text: str) -> str:
    """The notification / chat-list title: the text's first line, shortened."""
    first = next((line.strip(" #>*-") for line in text.splitlines() if line.strip()), "")
    return (first[: TITLE_MAX - 1] + "…") if len(first) > TITLE_MAX else (first or "…")


def _route(target: ReplyTarget) -> Route:
    route = target.route
    if isinstance(route, Route):
        return route
    # A notice without a message (should not happen): answer by OpenAPI.
    return Route(
        msg_id="",
        conversation_id=target.conversation_id,
        direct=target.conversation_type == "direct",
        staff_id=target.conversation_id,
    )


class DingTalkOutbound:
    """The channel's :class:`dshim.outbound.Outbound`."""

    bot_username: str | None = None

    def __init__(
        self,
        api: DingTalkApi,
        *,
        store: ChannelStore,
        clock: Callable[[], float],
        answer: AnswerMode = "card",
        card_template_id: str = DEFAULT_CARD_TEMPLATE,
        new_id: Callable[[], str] = new_track_id,
        card_interval_s: float = CARD_INTERVAL_S,
        limits: Limits | None = None,
    ) -> None:
        self.api = api
        self.limits = limits or Limits(max_len=MAX_TEXT_LEN)
        self.store = store
        self.clock = clock
        self.answer = answer
        self.card_template_id = card_template_id
        self.new_id = new_id
        self.card_interval_s = card_interval_s
        self._cards_denied_until = -math.inf
        self._fallback_logged: set[str] = set()
        self._open_cards: OrderedDict[str, OpenCard] = OrderedDict()

    # -- the Outbound contract ------------------------------------------------------------

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        """Notices, command replies, approvals and questions: markdown.  The outbox's
        delivery of an answer whose card was left unfinished goes into that card."""
        route = _route(target)
        kept = self._open_cards.pop(route.msg_id, None) if route.msg_id else None
        if kept is not None and text.strip():
            calls = CardCalls(self, target, route, card=True)
            calls.adopt(kept)
            async with open_native_stream(calls, events=CARD_EVENTS) as stream:
                return await stream.finish(text)
        return await self.deliver_markdown(target, text)

    @asynccontextmanager
    async def open_stream(self, target: ReplyTarget) -> AsyncIterator[CardStream]:
        """One answer: a card (or markdown), with the reaction on the user's message."""
        route = _route(target)
        cards = self.answer == "card" and trio.current_time() >= self._cards_denied_until
        calls = CardCalls(self, target, route, card=cards)
        reacted = await self._react(route, add=True)
        try:
            # The engine raises a failed send as itself (the turn's, never a group) and
            # abandons a card left without finish before the reaction is taken back.
            async with open_native_stream(calls, events=CARD_EVENTS) as stream:
                yield CardStream(stream, calls)
        finally:
            if reacted:
                with trio.CancelScope(shield=True):
                    await self._react(route, add=False)

    # -- helpers the stream uses ----------------------------------------------------------

    def keep_open(self, msg_id: str, card: OpenCard) -> None:
        """Remember a card an undelivered answer left, for the outbox's delivery."""
        if not msg_id:
            return
        self._open_cards[msg_id] = card
        while len(self._open_cards) > OPEN_CARDS_MAX:
            self._open_cards.popitem(last=False)

    def backoff(self) -> Backoff:
        first = self.limits.retry_backoff_s
        return Backoff(first, max(BACKOFF_MAX_S, first), 2.0, jitter=0.0)

    async def until_reachable(self, backoff: Backoff, give_up_at: float) -> None:
        """Before the one repeat of a send of unknown outcome: a pause (the outage that
        lost the answer is likely still on), then until the OpenAPI answers again."""
        now = trio.current_time()
        await trio.sleep(max(0.0, min(self.limits.unknown_repeat_wait_s, give_up_at - now)))
        while True:
            try:
                await self.api.reachable()
                return
            except ChannelError as exc:
                log.info("platform_unreachable", error=str(exc)[:200])
            delay = backoff.next_delay()
            if trio.current_time() + delay > give_up_at:
                return  # out of time: the repeat goes now, once
            await trio.sleep(delay)

    async def card_call(
        self,
        call: Callable[[], Awaitable[T]],
        give_up_at: float,
        *,
        quota: bool = False,
        on_unsure: Callable[[], None] | None = None,
    ) -> T:
        """An idempotent card call (see the module docstring): retried through transport
        failures, lost answers included, with backoff until ``give_up_at`` (then the last
        failure is raised), and through 429 / QPS refusals as long as they ask -- within
        :data:`RATE_LIMIT_BUDGET_S`, or, with ``quota`` (creating and delivering, where a
        refusal means markdown), once after a short wait.  The engine's :func:`retrying`
        with DingTalk's quota rule on top."""
        limited = 0

        async def once() -> T:
            nonlocal limited
            try:
                return await call()
            except RateLimited as exc:
                limited += 1
                if quota and (limited > 1 or exc.retry_after > QPS_RETRY_MAX_S):
                    raise _QuotaSpent(exc) from exc
                raise

        try:
            return await retrying(
                once,
                give_up_at=give_up_at,
                backoff=self.backoff(),
                rate_limit_budget_s=RATE_LIMIT_BUDGET_S,
                on_unsure=on_unsure,
                events=CARD_CALL_EVENTS,
            )
        except _QuotaSpent as exc:
            raise exc.limited from None

    def fell_back(self, reason: str, exc: BaseException | None = None) -> None:
        """Log once per bot that answers use markdown instead of cards, and why (later
        fallbacks only at debug level)."""
        if isinstance(exc, PermissionDenied) and not isinstance(exc, RateLimited):
            self._cards_denied_until = trio.current_time() + CARD_DENIED_RETRY_S
        first = not self._fallback_logged
        self._fallback_logged.add(reason)
        (log.warning if first else log.debug)(
            "card_answers_fell_back",
            reason=reason,
            error=str(exc)[:200] if exc is not None else None,
            to="markdown",
        )

    async def _react(self, route: Route, *, add: bool) -> bool:
        if not route.msg_id:
            return False
        try:
            with trio.fail_after(REACTION_TIMEOUT_S):
                if add:
                    await self.api.add_reaction(route.msg_id, route.conversation_id)
                else:
                    await self.api.remove_reaction(route.msg_id, route.conversation_id)
        except (ChannelError, trio.TooSlowError) as exc:
            log.debug("reaction_failed", error=str(exc)[:200], added=add)
            return False
        return True

    def webhook_usable(self, route: Route) -> bool:
        if not route.session_webhook or not self.api.webhook_allowed(route.session_webhook):
            return False
        expires = route.webhook_expires_at
        return expires is None or self.clock() < expires - WEBHOOK_MARGIN_S

    async def deliver_markdown(
        self, target: ReplyTarget, text: str, *, hook: Hook | None = None
    ) -> list[Delivered]:
        """Send ``text`` as markdown chunks (webhook while valid, else OpenAPI)."""
        route = _route(target)
        out: list[Delivered] = []
        for chunk in split(text):
            if hook is not None:
                await hook()
                hook = None
            sent_at = self.clock()
            mid = await self._send_chunk(route, chunk)
            out.append(
                Delivered(message_id=mid, text=chunk, sent_at=sent_at, completed_at=self.clock())
            )
        return out

    async def _send_chunk(self, route: Route, chunk: str) -> str:
        """One chunk, exactly once as far as DingTalk lets us know; returns its id (see
        the module docstring for the retries)."""
        use_webhook = self.webhook_usable(route)
        backoff = self.backoff()
        give_up_at = trio.current_time() + self.limits.send_retry_s
        waited = 0.0
        lost = 0
        while True:
            try:
                if use_webhook:
                    assert route.session_webhook is not None
                    await self.api.send_webhook(
                        route.session_webhook, self._webhook_body(route, chunk)
                    )
                    return f"webhook-{uuid.uuid4().hex}"
                return await self.api.send_markdown(
                    direct=route.direct,
                    staff_id=route.staff_id,
                    conversation_id=route.conversation_id,
                    title=_title(chunk),
                    text=chunk,
                )
            except RateLimited as exc:
                waited += exc.retry_after
                if waited > RATE_LIMIT_BUDGET_S:
                    raise
                log.info("send_rate_limited", retry_after=exc.retry_after, webhook=use_webhook)
                await trio.sleep(exc.retry_after)
            except TransportError as exc:
                if unsure(exc):
                    # It may be on the user's screen: one repeat, after a pause and once
                    # DingTalk answers again; a second lost answer gives up.
                    lost += 1
                    log.warning(
                        "send_unconfirmed", error=str(exc)[:200], webhook=use_webhook, lost=lost
                    )
                    if lost > 1:
                        raise
                    await self.until_reachable(backoff, give_up_at)
                    continue
                delay = backoff.next_delay()
                if trio.current_time() + delay > give_up_at:
                    log.warning("send_gave_up", error=str(exc)[:200], webhook=use_webhook)
                    raise
                log.info("send_retry", error=str(exc)[:200], retry_in_s=delay)
                await trio.sleep(delay)
            except ChannelError as exc:
                if not use_webhook:
                    raise
                # The webhook refused it (expired, not allowed): nothing was shown.
                log.info("webhook_refused", error=str(exc)[:200], then="openapi")
                use_webhook = False

    def _webhook_body(self, route: Route, chunk: str) -> dict[str, Any]:
        body: dict[str, Any] = {
            "msgtype": "markdown",
            "markdown": {"title": _title(chunk), "text": chunk},
        }
        if not route.direct and route.staff_id:
            body["at"] = {"atUserIds": [route.staff_id], "isAtAll": False}
        return body


class CardStream(WatchesDelivery):
    """What :meth:`DingTalkOutbound.open_stream` yields: the answer's stream on the
    native-stream engine, and the card it put up (``track_id``, None while there is none:
    the capture reports an answer a card showed, which no :class:`Delivered` names).  A
    :class:`dshim.outbound.ReplyStream` with ``watch_delivery``."""

    def __init__(self, stream: NativeStream, calls: CardCalls) -> None:
        self.stream = stream
        self._calls = calls

    @property
    def track_id(self) -> str | None:
        return self._calls.track_id

    def watch_delivery(self, hook: Hook) -> None:
        self.stream.watch_delivery(hook)

    async def update(self, text: str) -> None:
        await self.stream.update(text)

    async def progress(self, note: str) -> None:
        """A tool or status note: shown under the text in the card until more text."""
        await self.stream.progress(note)

    async def finish(self, text: str) -> list[Delivered]:
        return await self.stream.finish(text)


class MarkdownAtEnd(WatchesDelivery):
    """The fallback: nothing while the answer is written, the final text as markdown (the
    delivery hook before its first chunk)."""

    def __init__(self, outbound: DingTalkOutbound, target: ReplyTarget) -> None:
        self._out = outbound
        self._target = target
        self._hook: Hook | None = None

    def watch_delivery(self, hook: Hook) -> None:
        self._hook = hook

    async def update(self, text: str) -> None:
        return None

    async def progress(self, note: str) -> None:
        return None

    async def finish(self, text: str) -> list[Delivered]:
        if not text.strip():
            return []
        hook, self._hook = self._hook, None
        return await self._out.deliver_markdown(self._target, text, hook=hook)


class CardCalls(BoundCalls[NativeStream]):
    """One answer's AI card (see the module docstring) on the native-stream engine
    (:mod:`dshim.streams.native`): the engine paces the streaming calls
    (``card_interval_s``), merges the texts between them, counts their failures and
    finishes once; these make the card calls.

    ``start`` creates and delivers the card (the delivery hook between the two: a card
    shows nothing until it is delivered) and answers AGAIN: the first text follows by
    ``stream_card`` after the interval.  It makes no retries (``finish`` does): a create
    that fails is left to the final text, and no more intermediate calls go out; a
    refusal hands the answer to markdown at the end (:class:`MarkdownAtEnd`), as does a
    stream opened without cards."""

    shows_notes = True

    def __init__(
        self, outbound: DingTalkOutbound, target: ReplyTarget, route: Route, *, card: bool
    ) -> None:
        self._out = outbound
        self._api = outbound.api
        self._target = target
        self._route = route
        self.card = card
        self.interval_s = outbound.card_interval_s
        #: The delivered card's outTrackId (None until it is in the chat).
        self.track_id: str | None = None
        #: What the last streaming call that went through showed.
        self._shown: str | None = None
        #: The card's outTrackId once one was tried (reused by every repeat), whether its
        #: create went through, and whether a delivery may have landed unconfirmed.
        self._track: str | None = None
        self._created = False
        self._deliver_unsure = False
        #: A create of this card went out and its answer was lost (it may exist).
        self._create_lost = False

    def adopt(self, card: OpenCard) -> None:
        """Finish a card an earlier attempt at this answer left open."""
        self._track = card.track_id
        self._created = True
        self._deliver_unsure = not card.delivered
        if card.delivered:
            self.track_id = card.track_id

    # -- intermediate calls ----------------------------------------------------------------

    async def start(self, text: str) -> Step:
        if not self.card:
            return Step.FALLBACK
        if self.track_id is not None:
            return await self.append(text)
        try:
            if not await self._create(text, trio.current_time()):
                return Step.FALLBACK
        except (RateLimited, TransportError) as exc:
            log.info("card_create_delayed", error=str(exc)[:200])
            return Step.STOP
        return Step.AGAIN  # up, still empty: the text follows after the interval

    async def append(self, text: str) -> Step:
        await self._stream_card(text, finalize=False)
        return Step.SHOWN

    async def _stream_card(self, text: str, *, finalize: bool, error: bool = False) -> None:
        assert self.track_id is not None
        await self._api.stream_card(
            self.track_id, uuid.uuid4().hex, card_markdown(text), finalize=finalize, error=error
        )
        self._shown = text

    async def _create(self, text: str, give_up_at: float) -> bool:
        """Create and deliver the card (both retried until ``give_up_at``, see the module
        docstring); False (and markdown from now on) when DingTalk refused it.  A failure
        that outlasted the retries is raised."""
        out = self._out
        route = self._route
        if self._track is None:
            self._track = out.new_id()
        track_id = self._track

        def lost_create() -> None:
            # Kept on the calls: a later call (finish after the pump gave up) that finds
            # the card existing must know an earlier create may have made it.
            self._create_lost = True

        def lost_delivery() -> None:
            self._deliver_unsure = True

        if not self._created:
            try:
                await out.card_call(
                    lambda: self._api.create_card(track_id, out.card_template_id),
                    give_up_at,
                    quota=True,
                    on_unsure=lost_create,
                )
            except (RateLimited, TransportError) as exc:
                if isinstance(exc, RateLimited):
                    return self._refused(exc)
                raise
            except ChannelError as exc:
                if not (self._create_lost and str(exc.code) == TRACK_EXISTS):
                    return self._refused(exc)
                # The lost attempt made it: the card exists.
            self._created = True
        await self.stream.delivering()
        now = out.clock()
        try:
            await out.card_call(
                lambda: self._api.deliver_card(
                    track_id,
                    direct=route.direct,
                    staff_id=route.staff_id,
                    conversation_id=route.conversation_id,
                    at=None
                    if route.direct
                    else {route.staff_id: route.sender_nick or route.staff_id},
                ),
                give_up_at,
                quota=True,
                on_unsure=lost_delivery,
            )
        except RateLimited as exc:
            if self._deliver_unsure:
                raise  # it may be up: no markdown copy
            return self._refused(exc)
        except TransportError:
            raise
        except ChannelError as exc:
            if self._deliver_unsure:
                raise
            return self._refused(exc)
        self.track_id = track_id
        self._deliver_unsure = False
        self.stream.paced()  # the first streaming call waits the interval from here
        await out.store.record_outbound(
            self._target.conversation_id,
            OutboundEntry(message_ids=[track_id], text=text, sent_at=now, completed_at=now),
            now=now,
        )
        return True

    def _refused(self, exc: ChannelError) -> bool:
        self.card = False
        self._out.fell_back(_reason(exc), exc)
        return False

    # -- the end ------------------------------------------------------------------------------

    async def finish(self, text: str) -> list[Delivered] | None:
        """The final text: finalize the card; None (markdown) when there is no card to
        finish or DingTalk refused it (see the module docstring)."""
        give_up_at = trio.current_time() + self._out.limits.send_retry_s
        try:
            if self.card and self.track_id is None and text.strip():
                await self._create(text, give_up_at)
            if self.card and self.track_id is not None:
                if await self._final_card(text, give_up_at):
                    now = self._out.clock()
                    await self._out.store.update_outbound(
                        self._target.conversation_id,
                        self.track_id,
                        now=now,
                        text=text,
                        completed_at=now,
                    )
                    return []
        except TransportError as exc:
            raise self._postponed(exc) from exc
        except RateLimited:
            self._keep_card()
            raise
        return None if text.strip() else []

    def fallback(self) -> AbstractAsyncContextManager[ReplyStream]:
        return nullcontext(MarkdownAtEnd(self._out, self._target))

    async def background(self) -> None:
        return None

    def _keep_card(self) -> None:
        """The answer goes to the outbox: a card that is (or may be) up is finished by
        the outbox's delivery instead of being joined by a markdown copy."""
        if self._track is not None and (self.track_id is not None or self._deliver_unsure):
            card = OpenCard(self._track, delivered=self.track_id is not None)
            self._out.keep_open(self._route.msg_id, card)

    def _postponed(self, exc: TransportError) -> TransportError:
        """The card answer could not be completed within the retries: nothing of it is on
        the screen but a card this process finishes later (see :meth:`_keep_card`), so
        the pipeline's outbox may deliver it."""
        self._keep_card()
        log.warning("card_answer_undelivered", error=str(exc)[:200], lost=unsure(exc))
        return TransportError(
            f"card answer not delivered: {str(exc)[:200]}",
            status=exc.status,
            code=exc.code,
            request_sent=False,
        )

    async def abandon(self) -> None:
        """Left without ``finish`` (stopped by shutdown, a failure): a card that is up is
        closed in its failed state, so it does not stay "writing" forever."""
        if self.track_id is None:
            return
        text = self.stream.text or self._shown or ""
        with trio.move_on_after(ABANDON_TIMEOUT_S):
            try:
                await self._stream_card(text, finalize=True, error=True)
            except ChannelError as exc:
                log.info("card_status_failed", error=str(exc)[:200])
            await self._mark(text, error=True)

    async def _final_card(self, text: str, give_up_at: float) -> bool:
        """Stream the final text with ``isFinalize`` and set ``flowStatus`` 3 (``isError``
        and 5 when the text ends with the agent's failure note); False when DingTalk
        refused it (then the card is marked failed, best effort).  Transport failures are
        retried until ``give_up_at``, then raised."""
        # The agent's failure note ends the text: the card shows its error state.
        failed = text.rstrip().rsplit("\n\n", 1)[-1].startswith(AGENT_FAILED_NOTE)
        await trio.sleep_until(self.stream.next_call_at)
        try:
            await self._out.card_call(
                lambda: self._stream_card(text, finalize=True, error=failed), give_up_at
            )
        except (RateLimited, TransportError):
            raise
        except ChannelError as exc:
            self._out.fell_back("card_finish_failed", exc)
            await self._mark(self._shown or text, error=True)
            return False
        await self._mark(text, error=failed, give_up_at=give_up_at)
        return True

    async def _mark(self, text: str, *, error: bool, give_up_at: float | None = None) -> None:
        """The card's final state: ``flowStatus`` 3 (5 on error) and its text, retried
        until ``give_up_at`` (30 s by default); a card whose text is final stays so even
        when this fails."""
        assert self.track_id is not None
        track_id = self.track_id
        params = {"flowStatus": "5" if error else "3", "msgContent": card_markdown(text)}
        until = give_up_at if give_up_at is not None else trio.current_time() + 30.0
        try:
            await self._out.card_call(lambda: self._api.update_card(track_id, params), until)
        except ChannelError as exc:
            log.warning("card_status_failed", error=str(exc)[:200])


def _reason(exc: ChannelError) -> str:
    if isinstance(exc, RateLimited):
        return "card_quota"
    if isinstance(exc, PermissionDenied):
        return "card_not_permitted"
    return "card_failed"
