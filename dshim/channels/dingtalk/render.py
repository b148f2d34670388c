"""DingTalk outbound: AI-card answers streamed in place, markdown when cards cannot be used.

Answers (``answer = "card"``, the default)
------------------------------------------
One streaming AI card per answer: ``POST /v1.0/card/instances`` (a fresh ``outTrackId``)
and ``/deliver`` into the direct chat (``IM_ROBOT.<staffId>``) or the group
(``IM_GROUP.<conversationId>``, the asker @-ed) once the first text is there, then the
whole text so far with ``PUT /v1.0/card/streaming`` (``isFull``, a new ``guid`` each call)
at most every 500 ms, finally ``isFinalize`` and ``flowStatus`` 3 (``isError`` and 5 when
the agent failed or the final text cannot be streamed).  Streaming calls are idempotent
(the whole text each time), so they are retried through 429s and QPS 403s within a
budget.  The card is recorded in the message index under its ``outTrackId`` when it is
delivered and gets its final text when it is finished, so a quote of it
(``originalProcessQueryKey``) recovers the exact answer; the card path therefore reports
no :class:`Delivered` of its own (the pipeline would index the same card twice).

Fallback: when creating or delivering the card is refused (not permitted, over the card
quota: 403 QPS or 429 again after one short wait, any failure), or the final text cannot
be streamed, the answer is sent as markdown: through the message's ``sessionWebhook``
while it is valid, else the robot OpenAPI (``oToMessages/batchSend`` /
``groupMessages/send``, whose ``processQueryKey`` is the delivered id).  That answers
fell back, and why, is logged once per bot.  A send whose outcome is unknown (the
request went out, no answer) is never repeated, so the text is never shown twice; text
paths split beyond 4,000 characters.

A reaction ("thinking") is put on the user's message while the answer is being written
and taken back at the end; DingTalk has no typing indicator.  Approvals and questions
are markdown text with numbered options.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, Literal

import structlog
import trio

from dshim.channels.base import ChannelStore, OutboundEntry
from dshim.channels.dingtalk.client import DingTalkApi
from dshim.channels.dingtalk.protocol import Route, card_markdown, new_track_id
from dshim.channels.kit import Backoff
from dshim.errors import ChannelError, PermissionDenied, RateLimited, TransportError
from dshim.model import AGENT_FAILED_NOTE, Delivered, ReplyTarget
from dshim.render import split_text

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
MAX_ATTEMPTS = 6
#: How long cards are not tried again after DingTalk said they are not permitted.
CARD_DENIED_RETRY_S = 600.0
REACTION_TIMEOUT_S = 5.0
#: A card call refused for QPS is tried again once after the wait, if it is this short.
QPS_RETRY_MAX_S = 5.0
#: How long closing an abandoned card may take (it runs shielded, at shutdown).
ABANDON_TIMEOUT_S = 5.0
TITLE_MAX = 30

AnswerMode = Literal["card", "markdown"]
Hook = Callable[[], Awaitable[None]]


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
    ) -> None:
        self.api = api
        self.store = store
        self.clock = clock
        self.answer = answer
        self.card_template_id = card_template_id
        self.new_id = new_id
        self.card_interval_s = card_interval_s
        self._cards_denied_until = -math.inf
        self._fallback_logged: set[str] = set()

    # -- the Outbound contract ------------------------------------------------------------

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        """Notices, command replies, approvals and questions: markdown."""
        return await self.deliver_markdown(target, text)

    @asynccontextmanager
    async def open_stream(self, target: ReplyTarget) -> AsyncIterator[CardStream]:
        """One answer: a card (or markdown), with the reaction on the user's message."""
        route = _route(target)
        cards = self.answer == "card" and trio.current_time() >= self._cards_denied_until
        stream = CardStream(self, target, route, card=cards)
        reacted = await self._react(route, add=True)
        try:
            async with trio.open_nursery() as nursery:
                if cards:
                    nursery.start_soon(stream.pump)
                else:
                    stream.pump_done.set()
                try:
                    yield stream
                finally:
                    nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await stream.abandon()
                if reacted:
                    await self._react(route, add=False)

    # -- helpers the stream uses ----------------------------------------------------------

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
        """One chunk, exactly once as far as DingTalk lets us know; returns its id."""
        use_webhook = self.webhook_usable(route)
        backoff = Backoff(1.0, 30.0, 2.0, jitter=0.0)
        waited = 0.0
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
                if exc.request_sent:
                    # It may be on the user's screen: never a second copy.
                    log.warning("send_unconfirmed", error=str(exc)[:200], webhook=use_webhook)
                    return f"unconfirmed-{uuid.uuid4().hex}"
                delay = backoff.next_delay()
                if backoff.failures >= MAX_ATTEMPTS:
                    raise
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


class CardStream:
    """One answer: an AI card streamed in place, or markdown at the end (see the module
    docstring).  A :class:`dshim.outbound.ReplyStream` with ``watch_delivery``."""

    def __init__(
        self, outbound: DingTalkOutbound, target: ReplyTarget, route: Route, *, card: bool
    ) -> None:
        self._out = outbound
        self._api = outbound.api
        self._target = target
        self._route = route
        self.card = card
        self.track_id: str | None = None
        self._text = ""
        self._note: str | None = None
        self._shown: str | None = None
        self._last_call = -math.inf
        self._paused_until = -math.inf
        self._changed = trio.Event()
        self._finishing = trio.Event()
        self.pump_done = trio.Event()
        self._call_lock = trio.Lock()
        self._hook: Hook | None = None
        self._finished = False

    def watch_delivery(self, hook: Hook) -> None:
        self._hook = hook

    async def update(self, text: str) -> None:
        if text != self._text:
            self._text = text
            self._note = None
            self._wake()

    async def progress(self, note: str) -> None:
        """A tool or status note: shown under the text in the card until more text."""
        self._note = note.strip() or None
        self._wake()

    def _display(self) -> str:
        text = self._text.strip()
        if self._note is None:
            return text
        return f"{text}\n\n⏳ {self._note}" if text else f"⏳ {self._note}"

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _sleep_until(self, t: float) -> None:
        with trio.move_on_at(t):
            await self._finishing.wait()

    async def pump(self) -> None:
        """Intermediate text: create the card at the first text, then paced updates."""
        failures = 0
        try:
            while not self._finishing.is_set():
                text = self._display()
                if not text or text == self._shown:
                    await self._changed.wait()  # finish() wakes it too
                    continue
                not_before = max(self._last_call + self._out.card_interval_s, self._paused_until)
                if trio.current_time() < not_before:
                    await self._sleep_until(not_before)
                    continue
                async with self._call_lock:
                    if self._finishing.is_set():
                        return
                    if self.track_id is None:
                        if not await self._create(text):
                            return
                        continue
                    try:
                        await self._stream(text, finalize=False)
                        failures = 0
                    except RateLimited as exc:
                        self._paused_until = trio.current_time() + exc.retry_after
                        log.info("card_rate_limited", retry_after=exc.retry_after)
                    except ChannelError as exc:
                        failures += 1
                        if failures >= 3:
                            log.warning("card_updates_stopped", error=str(exc)[:200])
                            return
                        self._paused_until = trio.current_time() + failures
        finally:
            self.pump_done.set()

    async def _stream(self, text: str, *, finalize: bool, error: bool = False) -> None:
        assert self.track_id is not None
        self._last_call = trio.current_time()
        await self._api.stream_card(
            self.track_id, uuid.uuid4().hex, card_markdown(text), finalize=finalize, error=error
        )
        self._shown = text

    async def _create(self, text: str) -> bool:
        """Create and deliver the card; False (and markdown from now on) when refused."""
        track_id = self._out.new_id()
        route = self._route
        try:
            await _retry_limited(
                lambda: self._api.create_card(track_id, self._out.card_template_id)
            )
        except ChannelError as exc:
            self.card = False
            self._out.fell_back(_reason(exc), exc)
            return False
        if self._hook is not None:
            hook, self._hook = self._hook, None
            await hook()
        now = self._out.clock()
        try:
            await _retry_limited(
                lambda: self._api.deliver_card(
                    track_id,
                    direct=route.direct,
                    staff_id=route.staff_id,
                    conversation_id=route.conversation_id,
                    at=None
                    if route.direct
                    else {route.staff_id: route.sender_nick or route.staff_id},
                )
            )
        except TransportError as exc:
            if not exc.request_sent:
                self.card = False
                self._out.fell_back(_reason(exc), exc)
                return False
            # It may have arrived: keep the card (a markdown copy could show it twice).
            log.warning("card_delivery_unconfirmed", error=str(exc)[:200])
        except ChannelError as exc:
            self.card = False
            self._out.fell_back(_reason(exc), exc)
            return False
        self.track_id = track_id
        self._last_call = trio.current_time()
        await self._out.store.record_outbound(
            self._target.conversation_id,
            OutboundEntry(message_ids=[track_id], text=text, sent_at=now, completed_at=now),
            now=now,
        )
        return True

    async def finish(self, text: str) -> list[Delivered]:
        """The final text, exactly once: finalize the card, or markdown (see the module)."""
        if self._finished:
            raise RuntimeError("finish() called twice")
        self._finished = True
        self._finishing.set()
        self._wake()
        await self.pump_done.wait()
        async with self._call_lock:
            if self.card and self.track_id is None and text.strip():
                await self._create(text)
            if self.card and self.track_id is not None:
                if await self._final_card(text):
                    now = self._out.clock()
                    await self._out.store.update_outbound(
                        self._target.conversation_id,
                        self.track_id,
                        now=now,
                        text=text,
                        completed_at=now,
                    )
                    return []
        if not text.strip():
            return []
        hook, self._hook = self._hook, None
        return await self._out.deliver_markdown(self._target, text, hook=hook)

    async def abandon(self) -> None:
        """Left without :meth:`finish` (stopped by shutdown, a failure): a card that is up
        is closed in its failed state, so it does not stay "writing" forever."""
        if self._finished or self.track_id is None:
            return
        self._finished = True
        with trio.move_on_after(ABANDON_TIMEOUT_S):
            try:
                await self._stream(self._text or self._shown or "", finalize=True, error=True)
            except ChannelError as exc:
                log.info("card_status_failed", error=str(exc)[:200])
            await self._mark(self._text or self._shown or "", error=True)

    async def _final_card(self, text: str) -> bool:
        """Stream the final text with ``isFinalize`` and set ``flowStatus`` 3 (``isError``
        and 5 when the text ends with the agent's failure note); False when the card could
        not take it (then it is marked failed, best effort)."""
        # The agent's failure note ends the text: the card shows its error state.
        failed = text.rstrip().rsplit("\n\n", 1)[-1].startswith(AGENT_FAILED_NOTE)
        backoff = Backoff(1.0, 30.0, 2.0, jitter=0.0)
        waited = 0.0
        while True:
            await trio.sleep_until(
                max(self._last_call + self._out.card_interval_s, self._paused_until)
            )
            try:
                await self._stream(text, finalize=True, error=failed)
                break
            except RateLimited as exc:
                waited += exc.retry_after
                if waited <= RATE_LIMIT_BUDGET_S:
                    log.info("card_rate_limited", retry_after=exc.retry_after, final=True)
                    self._paused_until = trio.current_time() + exc.retry_after
                    continue
                error: ChannelError = exc
            except TransportError as exc:
                delay = backoff.next_delay()
                if backoff.failures < MAX_ATTEMPTS:
                    self._paused_until = trio.current_time() + delay
                    continue
                error = exc
            except ChannelError as exc:
                error = exc
            self._out.fell_back("card_finish_failed", error)
            await self._mark(self._shown or text, error=True)
            return False
        await self._mark(text, error=failed)
        return True

    async def _mark(self, text: str, *, error: bool) -> None:
        """The card's final state: ``flowStatus`` 3 (5 on error) and its text, best effort."""
        assert self.track_id is not None
        track_id = self.track_id
        params = {"flowStatus": "5" if error else "3", "msgContent": card_markdown(text)}
        try:
            with trio.fail_after(30):
                await _retry_limited(lambda: self._api.update_card(track_id, params), times=4)
        except (ChannelError, trio.TooSlowError) as exc:
            log.info("card_status_failed", error=str(exc)[:200])


async def _retry_limited(call: Callable[[], Awaitable[None]], *, times: int = 1) -> None:
    """``call()``, repeated up to ``times`` more times after a short 429 / QPS refusal
    (a refused call did nothing, so repeating it cannot duplicate anything)."""
    for attempt in range(times + 1):
        try:
            await call()
            return
        except RateLimited as exc:
            if attempt >= times or exc.retry_after > QPS_RETRY_MAX_S:
                raise
            log.info("card_rate_limited", retry_after=exc.retry_after)
            await trio.sleep(exc.retry_after)


def _reason(exc: ChannelError) -> str:
    if isinstance(exc, RateLimited):
        return "card_quota"
    if isinstance(exc, PermissionDenied):
        return "card_not_permitted"
    return "card_failed"
