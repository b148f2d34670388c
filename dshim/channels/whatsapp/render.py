"""WhatsApp outbound: the :class:`dshim.outbound.Outbound` of a Cloud API bot.

Business messages cannot be edited, so an answer is not streamed by edits: the user's
message is marked read with the typing indicator when the turn starts (``status: read``
+ ``typing_indicator``; WhatsApp shows it up to 25 s), refreshed every 20 s, and the
answer is sent once it is complete, as a contextual reply to the user's message
(``context.message_id``), with ``preview_url: false``.  The agent's Markdown becomes
WhatsApp formatting (:func:`~dshim.channels.kit.whatsapp_format.to_whatsapp`); beyond
4,096 characters it is split at paragraph/line boundaries into as few messages as
possible, and only the first quotes the user's message.

This reuses the shared engine (:mod:`dshim.render`) with an infinite first-send delay:
no intermediate text is ever sent, the typing refresh and the exactly-once rules of
``finish`` apply unchanged.  Pacing: every message to one recipient shares a pacer of
one message per 6 s (WhatsApp's pair rate, error 131056 when exceeded): a long split
answer is queued, never burst.  Errors: throughput / pair / API limits (130429, 131056,
4, 80007) carry no retry-after and created nothing: the engine backs off exponentially
(2 s doubling, for the engine's ``send_retry_s``); a send whose outcome is unknown
(timeout after the request went out, a connection lost before the answer: the Cloud
API has no idempotency key) is repeated at most once, never in a loop, 15 s later and
once ``GET /<PHONE_NUMBER_ID>`` answers again (:meth:`WhatsAppTransport.reachable`); a
5xx answer created nothing and is retried like the limits; 131047
(more than 24 h since the user wrote) ends delivery to that user at once, logged and
counted, until the user writes again; 190 (expired token) is reported to the channel,
which stops the bot (:attr:`WhatsAppOutbound.fatal`).  Any other send failure is the
turn's: an answer still refused after the retries goes to the pipeline's outbox, which
sends it when Graph takes it again.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import structlog
import trio

from dshim.channels.base import InteractionPrompt, PresentsInteractions, WatchesDelivery
from dshim.channels.kit.whatsapp_format import to_whatsapp
from dshim.channels.whatsapp import protocol
from dshim.channels.whatsapp.client import GraphClient
from dshim.channels.whatsapp.protocol import WindowClosed
from dshim.errors import AuthError, ChannelError
from dshim.model import Delivered, ReplyTarget
from dshim.net.http import count_request
from dshim.render import ChatPacer, EditOutbound, EditStream, Limits, ProbesReachable

log = structlog.get_logger("dshim.whatsapp")

#: WhatsApp's pair rate: about one message per 6 s to one user, sustained.
PAIR_INTERVAL_S = 6.0
TYPING_REFRESH_S = 20.0
LIMITS = Limits(
    max_len=protocol.MAX_TEXT,
    first_send_delay_s=math.inf,  # no edits: nothing is shown before the final text
    edit_interval_s=0.0,
    typing_interval_s=TYPING_REFRESH_S,
    retry_backoff_s=2.0,
)
CLOSED_WINDOWS_MAX = 4096


def _group(target: ReplyTarget) -> bool:
    return target.conversation_type == "group"


def _phone(target: ReplyTarget) -> str | None:
    """The user's phone number the channel put in the message's ``route`` (or None)."""
    return target.route if isinstance(target.route, str) else None


class WhatsAppTransport(ProbesReachable):
    """The engine's transport for one answer: sends and the typing indicator, no edits."""

    def __init__(self, outbound: WhatsAppOutbound, target: ReplyTarget) -> None:
        self._outbound = outbound
        self._target = target

    async def send(self, text: str, *, reply: bool) -> str:
        target = self._target
        reply_to = target.reply_to_message_id if reply else None
        payload = protocol.text_payload(
            target.conversation_id,
            text,
            reply_to=reply_to,
            group=_group(target),
            phone=_phone(target),
        )
        return await self._outbound.deliver(target.conversation_id, payload)

    async def edit(self, message_id: str, text: str) -> None:
        raise ChannelError("WhatsApp business messages cannot be edited")

    async def typing(self) -> None:
        message_id = self._target.reply_to_message_id
        if _group(self._target):
            return  # groups have no read receipts (nor typing) on the Cloud API
        if message_id and not self._outbound.window_closed(self._target.conversation_id):
            await self._outbound.client.typing(message_id)

    async def reachable(self) -> None:
        """Graph answers again: ``GET /<PHONE_NUMBER_ID>``, the number's own record (the
        engine's probe before the one repeat of a send whose answer was lost)."""
        await self._outbound.client.phone_number()


class WhatsAppOutbound(EditOutbound, PresentsInteractions):
    """Sends notices and answers for one business number."""

    def __init__(
        self, client: GraphClient, *, clock: Callable[[], float], limits: Limits = LIMITS
    ) -> None:
        super().__init__(limits=limits, clock=clock, bot_username=None)
        self.client = client
        #: Set when the platform rejected the token mid-run: the channel stops the bot.
        self.fatal = trio.Event()
        self.fatal_error: AuthError | None = None
        #: Delivery failures by Graph error code (131047, ...), for logs and the probe.
        self.failures: Counter[int] = Counter()
        self._closed: OrderedDict[str, None] = OrderedDict()

    # -- the 24-hour window ----------------------------------------------------------------

    def window_closed(self, conversation: str) -> bool:
        return conversation in self._closed

    def closed_by_status(self, conversation: str) -> None:
        """A ``failed`` status with 131047: later sends to this user are refused here."""
        self._close(conversation)

    def _close(self, conversation: str) -> None:
        self._closed[conversation] = None
        self._closed.move_to_end(conversation)
        while len(self._closed) > CLOSED_WINDOWS_MAX:
            self._closed.popitem(last=False)

    def user_wrote(self, conversation: str) -> None:
        """A message from the user reopens the customer-service window."""
        self._closed.pop(conversation, None)

    def count_failure(self, code: int | None) -> int:
        key = code if code is not None else 0
        self.failures[key] += 1
        return self.failures[key]

    async def deliver(self, conversation: str, payload: dict[str, object]) -> str:
        """One send, with the channel-level outcomes of its errors."""
        if conversation in self._closed:
            raise WindowClosed(
                "send message: the 24-hour window is closed (code 131047)", code=131047
            )
        try:
            return await self.client.send(payload)
        except WindowClosed:
            self._close(conversation)
            total = self.count_failure(protocol.WINDOW_CLOSED)
            # On /metrics: dshim_platform_requests_total{method="delivery_refused",status="131047"}
            count_request("delivery_refused", protocol.WINDOW_CLOSED)
            log.warning(
                "delivery_refused",
                code=protocol.WINDOW_CLOSED,
                reason="outside the 24-hour window: the user must write first "
                "(only template messages reach them now)",
                conversation=conversation,
                refused_total=total,
            )
            raise
        except AuthError as exc:
            if self.fatal_error is None:
                self.fatal_error = exc
                self.fatal.set()
            raise

    # -- the engine ------------------------------------------------------------------------

    def transport(self, target: ReplyTarget) -> WhatsAppTransport:
        return WhatsAppTransport(self, target)

    def pacer(self, target: ReplyTarget) -> ChatPacer:
        """One pacer per recipient: one message per :data:`PAIR_INTERVAL_S`."""
        return self._pacers.get(target.conversation_id, budget=1, per_s=PAIR_INTERVAL_S)

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        return await super().send_text(target, to_whatsapp(text))

    @asynccontextmanager  # a ReplyStream of its own over the engine's EditStream
    async def open_stream(self, target: ReplyTarget) -> AsyncIterator[WhatsAppStream]:
        """Typing until the answer is complete, then the final text (see the module doc)."""
        async with self.edit_stream(target) as stream:
            yield WhatsAppStream(stream)

    @asynccontextmanager
    async def open_interaction(
        self, target: ReplyTarget, prompt: InteractionPrompt
    ) -> AsyncIterator[list[Delivered]]:
        """An approval or question as reply buttons (up to 3 options) or a list message
        (up to 10) under the user's message, the request above them; more options, a
        request over 1,024 characters or a failed send raise ChannelError on entry (the
        pipeline sends the numbered text instead).  WhatsApp cannot take buttons away afterwards:
        a late press is judged like typed text (no pending request -> a normal message)."""
        labels = [o.label for o in prompt.options]
        body = to_whatsapp(prompt.prompt)
        payload = protocol.interactive_payload(
            target.conversation_id,
            body,
            labels,
            reply_to=target.reply_to_message_id,
            group=_group(target),
            phone=_phone(target),
        )
        if payload is None or len(body) > protocol.MAX_INTERACTIVE_BODY:
            raise ChannelError("the request does not fit an interactive message")
        await self.pacer(target).acquire()
        sent_at = self.clock()
        wamid = await self.deliver(target.conversation_id, payload)
        yield [Delivered(message_id=wamid, text=prompt.text, sent_at=sent_at, completed_at=sent_at)]


class WhatsAppStream(WatchesDelivery):
    """A :class:`~dshim.outbound.ReplyStream` over the engine: the final text converted
    to WhatsApp formatting; intermediate text and progress notes are not shown."""

    def __init__(self, inner: EditStream) -> None:
        self._inner = inner

    def watch_delivery(self, hook: Callable[[], Awaitable[None]]) -> None:
        self._inner.watch_delivery(hook)

    async def update(self, text: str) -> None:
        await self._inner.update(text)

    async def progress(self, note: str) -> None:
        return None

    async def finish(self, text: str) -> list[Delivered]:
        return await self._inner.finish(to_whatsapp(text))


def split(text: str) -> list[str]:
    """How WhatsApp answers are split (replay uses it)."""
    return LIMITS.split(to_whatsapp(text))
