"""WeChat outbound: whole answers, typing while the agent works, few messages.

iLink has no edit, no quote-on-send and no streaming, and accepts only about ten replies
per user message: the answer is sent once it is complete, as plain text (Markdown
reduced, :func:`~dshim.channels.weixin.protocol.plain_text`), split at 4,000 characters
on paragraph/line boundaries, at most :data:`MAX_MESSAGES` messages (the rest is cut
with a one-line notice).  While the agent works the user sees "typing": a typing ticket
from ``getconfig`` (cached per user for a day, a failure backs off a minute) and
``sendtyping status=1`` every 5 s, ``status=2`` before the answer goes out; typing
failures never fail a turn.

Every send gets a fresh ``client_id``.  ``ret != 0`` is never a delivery.  ``-2``
(no valid context token, the reply cap, slow down) is retried once after 3 s: with the
last token a send to that user succeeded with when the refused one was another (which
then takes the refused one's place, :meth:`ContextBook.worked`), else with the same; a 429
waits as asked; a send that certainly created nothing (could not connect, not written
whole, answered with a 5xx) is retried with a backoff for ``Limits.send_retry_s`` (120 s, as
the shared engine does); a send whose outcome is unknown (the request went out, no answer
came back) is repeated at most once, with the same ``client_id``,
``Limits.unknown_repeat_wait_s`` later and once iLink answers again
(:meth:`IlinkClient.reachable`), so the user sees at most two copies and never a loop of
them.  A message that still fails ends the answer there: logged (``reply_undelivered``)
and counted; the transcript keeps the whole answer, and when nothing of it went out the
error is the turn's: one that proves non-delivery puts it in the pipeline's outbox, sent
when iLink is back (also after a restart).  A ``-14`` (session expired) is raised as it
is; the long poll stops the bot for a new login.

Replies need the user's latest context token and are only possible within 24 h of their
last message: outside it nothing is attempted (``reply_not_attempted``).  The message an
answer or notice is for was taken by the pipeline, so its own token (in the target's
:class:`~dshim.channels.weixin.protocol.Route`) is adopted first when it is newer.  Each delivered
message is indexed by the pipeline under the server's ``message_id`` when the answer
has one (else the ``client_id``); the other id is added to the index entry before the
user's next message is handed over (:meth:`WeixinOutbound.flush_ids`).
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import structlog
import trio

from dshim.channels.base import ChannelStore, WatchesDelivery
from dshim.channels.kit import Backoff
from dshim.channels.weixin import protocol
from dshim.channels.weixin.client import IlinkClient
from dshim.channels.weixin.contexts import ContextBook
from dshim.errors import (
    AuthError,
    ChannelError,
    DshimError,
    RateLimited,
    StoreError,
    TransportError,
    single_error,
)
from dshim.model import Delivered, ReplyTarget
from dshim.net.http import count_request
from dshim.render import BACKOFF_MAX_S, Limits, split_text

log = structlog.get_logger("dshim.weixin")

MAX_CHARS = 4000
#: iLink accepts ~10 replies per user message; keep room for notices and retries.
MAX_MESSAGES = 8
CUT_NOTICE = "[… answer cut: WeChat accepts only a few replies per message]"
REPLY_WINDOW_S = 24 * 3600.0
REFUSED_RETRY_S = 3.0
TYPING_INTERVAL_S = 5.0
TYPING_TICKET_TTL_S = 24 * 3600.0
TYPING_FAILURE_PAUSE_S = 60.0
TYPING_CALL_DEADLINE_S = 5.0
#: The engine's limits, with WeChat's own: 4,000 characters, and 429 waits per message of
#: at most 300 s in all before giving up (iLink's limits are per user message).
LIMITS = Limits(max_len=MAX_CHARS, rate_limit_budget_s=300.0)
#: Sends of unknown outcome per message: the first and one repeat.
UNSURE_SENDS_MAX = 2
PENDING_IDS_MAX = 1024
PENDING_IDS_TTL_S = 600.0


class ReplyNotPossible(ChannelError):
    """The answer cannot be sent at all (no context token, outside the 24 h window)."""


def split(text: str) -> list[str]:
    """The messages an answer is delivered in (replay uses it)."""
    chunks = split_text(protocol.plain_text(text), MAX_CHARS)
    if len(chunks) <= MAX_MESSAGES:
        return chunks
    last = chunks[MAX_MESSAGES - 1]
    room = MAX_CHARS - len(CUT_NOTICE) - 1
    last = last if len(last) <= room else split_text(last, room)[0]
    return [*chunks[: MAX_MESSAGES - 1], f"{last}\n{CUT_NOTICE}"]


class WeixinOutbound:
    """Sends notices and answers of one bot (the pipeline's :class:`~dshim.outbound.Outbound`)."""

    bot_username: str | None = None

    def __init__(
        self,
        client: IlinkClient,
        contexts: ContextBook,
        store: ChannelStore,
        *,
        clock: Callable[[], float],
        rng: random.Random | None = None,
        register_secret: Callable[[str], None] = lambda s: None,
        limits: Limits = LIMITS,
    ) -> None:
        self.client = client
        self.limits = limits
        self.contexts = contexts
        self.store = store
        self.clock = clock
        self._rng = rng or random.Random()
        self._register = register_secret
        self._tickets: OrderedDict[str, tuple[str | None, float]] = OrderedDict()
        #: conversation -> [(indexed id, extra id, trio time)] not yet added to the index.
        self._pending: OrderedDict[str, list[tuple[str, str, float]]] = OrderedDict()

    # -- the Outbound contract ------------------------------------------------------------

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        return await self.deliver(target.conversation_id, text, context=_context_of(target))

    @asynccontextmanager
    async def open_stream(self, target: ReplyTarget) -> AsyncIterator[WeixinStream]:
        context = _context_of(target)
        await self._adopt(target.conversation_id, context)  # typing's ticket asks with it
        stream = WeixinStream(self, target.conversation_id, context)
        # The typing task never raises: what the block raises comes out as itself.
        with single_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream.keep_typing)
                try:
                    yield stream
                finally:
                    stream.stop_typing()

    # -- sending --------------------------------------------------------------------------

    def new_client_id(self) -> str:
        return f"dshim-{self._rng.getrandbits(64):016x}"

    async def deliver(
        self,
        user: str,
        text: str,
        *,
        context: protocol.ContextToken | None = None,
        before_first: Callable[[], Awaitable[None]] | None = None,
    ) -> list[Delivered]:
        """Send ``text`` to ``user`` as few plain-text messages; the delivered ones.

        ``context``: the token of the message this answers (one the pipeline took)."""
        chunks = split(text)
        if not chunks:
            return []
        await self._adopt(user, context)
        ctx = await self.contexts.get(user)
        now = self.clock()
        if ctx is None:
            self._not_attempted("no_context_token")
            raise ReplyNotPossible("no context token for this user: they must write first")
        if now - ctx.last_seen > REPLY_WINDOW_S:
            self._not_attempted("reply_window_closed")
            raise ReplyNotPossible("the user's last message is over 24 h old: WeChat refuses")
        if before_first is not None:
            await before_first()
        token = ctx.token
        # The fallback of a refusal: the last token that worked, else the answered
        # message's own.
        fallback = next(
            (t for t in (ctx.worked, context) if t is not None and t.token != token.token), None
        )
        delivered: list[Delivered] = []
        for index, chunk in enumerate(chunks):
            try:
                sent, used = await self._send_one(user, token, fallback, chunk)
            except ChannelError as exc:
                reason = type(exc).__name__
                log.warning(
                    "reply_undelivered",
                    reason=reason,
                    error=str(exc),
                    message=index + 1,
                    messages=len(chunks),
                )
                count_request("reply_undelivered", reason)
                if not delivered or isinstance(exc, AuthError):
                    raise
                return delivered
            delivered.append(sent)
            await self._worked(user, used, instead_of=token if used is not token else None)
            if used is not token:
                token, fallback = used, None
        return delivered

    async def _adopt(self, user: str, context: protocol.ContextToken | None) -> None:
        if context is None:
            return
        try:
            await self.contexts.observe(user, context)
        except StoreError as exc:  # kept in memory all the same
            log.warning("context_token_write_failed", error=str(exc))

    async def _worked(
        self, user: str, token: protocol.ContextToken, *, instead_of: protocol.ContextToken | None
    ) -> None:
        try:
            await self.contexts.worked(user, token, instead_of=instead_of)
        except StoreError as exc:  # the message is out; only a later refusal suffers
            log.warning("context_token_write_failed", error=str(exc))

    def _not_attempted(self, reason: str) -> None:
        log.warning("reply_not_attempted", reason=reason)
        count_request("reply_not_attempted", reason)

    async def _send_one(
        self,
        user: str,
        token: protocol.ContextToken,
        fallback: protocol.ContextToken | None,
        text: str,
    ) -> tuple[Delivered, protocol.ContextToken]:
        """One message; with the token it went out with (``fallback`` after a refusal)."""
        client_id = self.new_client_id()
        body = protocol.send_body(
            to_user=user, client_id=client_id, context_token=token.token, text=text
        )
        sent_at = self.clock()
        refused = unsure = 0
        waited = 0.0
        first = self.limits.retry_backoff_s
        backoff = Backoff(first, max(BACKOFF_MAX_S, first), 2.0, jitter=0.0)
        give_up_at = trio.current_time() + self.limits.send_retry_s
        while True:
            try:
                server_id = await self.client.send_message(body)
                break
            except protocol.ReplyRefused:
                refused += 1
                if refused > 1:
                    raise
                if fallback is not None:  # once: the next refusal raises
                    token = fallback
                    body["context_token"] = token.token
                log.info(
                    "reply_refused_retrying",
                    retry_in_s=REFUSED_RETRY_S,
                    token="last_worked" if fallback is not None else "same",
                )
                await trio.sleep(REFUSED_RETRY_S)
                client_id = body["client_id"] = self.new_client_id()  # nothing was created
            except RateLimited as exc:
                if waited + exc.retry_after > self.limits.rate_limit_budget_s:
                    raise
                waited += exc.retry_after
                log.info("reply_rate_limited", retry_after=exc.retry_after)
                await trio.sleep(exc.retry_after)
                client_id = body["client_id"] = self.new_client_id()
            except TransportError as exc:
                if exc.outcome_unknown:
                    # Out, with no answer: it may be on the user's screen.  One repeat
                    # (same client_id), once the brief outage that lost it is over.
                    unsure += 1
                    if unsure >= UNSURE_SENDS_MAX:
                        raise
                    log.info("reply_send_unconfirmed", error=str(exc))
                    await self._until_reachable(user, backoff, give_up_at)
                    continue
                # Never left, or answered with a 5xx: nothing was created.
                delay = backoff.next_delay()
                if trio.current_time() + delay > give_up_at:
                    raise
                log.info("reply_send_retrying", error=str(exc), retry_in_s=delay)
                await trio.sleep(delay)
        done = self.clock()
        if server_id is not None and server_id != client_id:
            self._remember_ids(user, server_id, client_id)
        sent = Delivered(
            message_id=server_id or client_id, text=text, sent_at=sent_at, completed_at=done
        )
        return sent, token

    async def _until_reachable(self, user: str, backoff: Backoff, give_up_at: float) -> None:
        """Before the one repeat of a send of unknown outcome: wait
        ``unknown_repeat_wait_s``, then until iLink answers
        (:meth:`IlinkClient.reachable`, retried with backoff) or the time is spent."""
        now = trio.current_time()
        await trio.sleep(max(0.0, min(self.limits.unknown_repeat_wait_s, give_up_at - now)))
        while True:
            try:
                await self.client.reachable(user)
                return
            except ChannelError as exc:
                log.info("reply_platform_unreachable", error=str(exc))
            delay = backoff.next_delay()
            if trio.current_time() + delay > give_up_at:
                return  # out of time: the repeat goes now, once
            await trio.sleep(delay)

    # -- index ids --------------------------------------------------------------------------

    def _remember_ids(self, conversation: str, indexed: str, extra: str) -> None:
        self._pending.setdefault(conversation, []).append((indexed, extra, trio.current_time()))
        self._pending.move_to_end(conversation)
        while len(self._pending) > PENDING_IDS_MAX:
            self._pending.popitem(last=False)

    async def flush_ids(self, conversation: str) -> None:
        """Add the second id of each delivered message to its index entry (the pipeline
        recorded it under the first once the turn ended)."""
        pending = self._pending.get(conversation)
        if not pending:
            return
        keep: list[tuple[str, str, float]] = []
        for indexed, extra, at in pending:
            done = await self.store.update_outbound(
                conversation, indexed, now=self.clock(), add_ids=[extra]
            )
            if not done and trio.current_time() - at < PENDING_IDS_TTL_S:
                keep.append((indexed, extra, at))
        if keep:
            self._pending[conversation] = keep
        else:
            del self._pending[conversation]

    # -- typing ---------------------------------------------------------------------------

    async def typing(self, user: str, status: int) -> None:
        """One ``sendtyping`` (best effort: failures are logged, never raised)."""
        with trio.move_on_after(TYPING_CALL_DEADLINE_S):
            try:
                ticket = await self._ticket(user)
                if ticket is not None:
                    await self.client.send_typing(user, ticket, status)
            except DshimError as exc:  # the platform or the store: typing is best effort
                log.debug("typing_failed", error=str(exc))

    async def _ticket(self, user: str) -> str | None:
        now = trio.current_time()
        cached = self._tickets.get(user)
        if cached is not None and now < cached[1]:
            return cached[0]
        ctx = await self.contexts.get(user)
        try:
            ticket = await self.client.get_typing_ticket(
                user, ctx.token.token if ctx is not None else None
            )
        except ChannelError as exc:
            log.debug("typing_ticket_failed", error=str(exc))
            self._cache_ticket(user, None, now + TYPING_FAILURE_PAUSE_S)
            return None
        if ticket:
            self._register(ticket)
        self._cache_ticket(user, ticket, now + TYPING_TICKET_TTL_S)
        return ticket

    def _cache_ticket(self, user: str, ticket: str | None, until: float) -> None:
        self._tickets[user] = (ticket, until)
        self._tickets.move_to_end(user)
        while len(self._tickets) > PENDING_IDS_MAX:
            self._tickets.popitem(last=False)


def _context_of(target: ReplyTarget) -> protocol.ContextToken | None:
    """The context token of the message a target answers (None: no such message)."""
    route = target.route
    return route.context if isinstance(route, protocol.Route) else None


class WeixinStream(WatchesDelivery):
    """One answer: typing until it is complete, then delivered in one go."""

    def __init__(
        self, outbound: WeixinOutbound, user: str, context: protocol.ContextToken | None = None
    ) -> None:
        self._out = outbound
        self._user = user
        self._context = context
        self._typing_done = trio.Event()
        self._typing_shown = False
        self._hook: Callable[[], Awaitable[None]] | None = None

    def watch_delivery(self, hook: Callable[[], Awaitable[None]]) -> None:
        """Await ``hook`` right before the first send (see :class:`dshim.outbound.ReplyStream`)."""
        self._hook = hook

    async def update(self, text: str) -> None:
        """iLink cannot show partial text: nothing is sent before the answer is complete."""

    async def progress(self, note: str) -> None:
        """No native progress display: the typing indicator stands for it."""

    def stop_typing(self) -> None:
        self._typing_done.set()

    async def keep_typing(self) -> None:
        while not self._typing_done.is_set():
            self._typing_shown = True
            await self._out.typing(self._user, 1)
            with trio.move_on_after(TYPING_INTERVAL_S):
                await self._typing_done.wait()

    async def finish(self, text: str) -> list[Delivered]:
        self.stop_typing()

        async def first() -> None:
            if self._typing_shown:  # cancel the indicator this answer showed
                await self._out.typing(self._user, 2)
            if self._hook is not None:
                await self._hook()

        return await self._out.deliver(self._user, text, context=self._context, before_first=first)
