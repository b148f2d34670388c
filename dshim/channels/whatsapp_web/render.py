"""WhatsApp Web outbound: the :class:`dshim.outbound.Outbound` of a linked personal account.

An answer is a reply to the user's message: the first message carries a
``contextInfo`` with the message's ``stanzaID``, its sender as ``participant`` and a small
snapshot of it as ``quotedMessage`` (the route the mapping put on the message,
:func:`~dshim.channels.whatsapp_web.protocol.route_of`), so the phone shows the quote
bubble.  When the turn starts the user's message is marked read (blue ticks), and
``composing`` presence ("typing...") is sent until the first text shows and renewed
every 8 s (WhatsApp lets it fade after about 10 s); ``paused`` once the answer is
complete.

Streaming is the shared edit engine (:mod:`dshim.render`) with WhatsApp's limits: the
first message after ~1 s of text, then edits of it at most every 2 s and at most 20
edits per answer, the final text's included (WhatsApp keeps every edit of a message;
an answer does not need more), so the final text always lands.  WhatsApp accepts an
edit for 15 minutes after the send: past 14 (a very long answer) the engine is told the
message is gone (NotFound) and sends the rest as a new message instead.  Beyond 4,096
characters an answer continues in further messages, split at paragraph and line
boundaries (WhatsApp itself takes 65,536, but folds anything past a few screens behind
"Read more"); only the first quotes the user.  The agent's Markdown becomes WhatsApp's
own formatting (:func:`~dshim.channels.kit.whatsapp_format.to_whatsapp`), for the
intermediate texts as well as the final one.

WhatsApp has no idempotency key that neonize exposes: a send whose outcome is unknown
(the engine's deadline passed, the connection dropped while it waited) is repeated at
most once, after the account answers again (:meth:`WhatsAppWebTransport.reachable`), as
the engine does for every such platform.  Approvals and questions are numbered text
(the pipeline's default): buttons do not reach personal accounts reliably.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import structlog
import trio

from dshim.channels.base import WatchesDelivery
from dshim.channels.kit.whatsapp_format import to_whatsapp
from dshim.channels.whatsapp_web.engine import Quote, WaEngine
from dshim.errors import ChannelError, NotFound
from dshim.model import Delivered, ReplyTarget
from dshim.render import EditOutbound, EditStream, Limits, ProbesReachable

log = structlog.get_logger("dshim.whatsapp_web")

#: One message's text at most (WhatsApp's own limit is 65,536; see the module doc).
MAX_TEXT = 4096
#: WhatsApp accepts edits this long after the send; dshim stops a minute earlier.
EDIT_WINDOW_S = 15 * 60.0
EDIT_MARGIN_S = 60.0
LIMITS = Limits(
    max_len=MAX_TEXT,
    first_send_delay_s=1.0,
    edit_interval_s=2.0,
    typing_interval_s=8.0,
    max_edits=20,
    retry_backoff_s=2.0,
)
#: The read receipt at the turn's start waits at most this long (it is a courtesy).
MARK_READ_WAIT_S = 5.0
SENT_TIMES_MAX = 4096


def quote_of(target: ReplyTarget) -> Quote | None:
    """The ``contextInfo`` quote of the user's message, from the message's route."""
    route = target.route
    message_id = target.reply_to_message_id
    anchor = target.anchor
    if anchor is not None:  # a substitute answer: its own anchor, plain when evicted
        if anchor.mode == "plain" or not anchor.message_id:
            return None
        if anchor.message_id != message_id:
            route = None
        message_id = anchor.message_id
    if not message_id:
        return None
    participant = ""
    quoted: dict[str, Any] = {"conversation": ""}
    if isinstance(route, Mapping):
        participant = str(route.get("participant") or "")
        snapshot = route.get("quoted")
        if isinstance(snapshot, Mapping):
            quoted = dict(snapshot)
    if not participant:
        participant = target.conversation_id
    return Quote(stanza_id=message_id, participant=participant, message=quoted)


class WhatsAppWebTransport(ProbesReachable):
    """The edit engine's transport for one answer (see :mod:`dshim.render`)."""

    def __init__(self, outbound: WhatsAppWebOutbound, target: ReplyTarget) -> None:
        self._outbound = outbound
        self._engine = outbound.engine
        self._chat = target.conversation_id
        self._quote = quote_of(target)

    async def send(self, text: str, *, reply: bool) -> str:
        quote = self._quote if reply else None
        message_id = await self._engine.send(self._chat, text, quote=quote)
        self._outbound.sent(message_id)
        return message_id

    async def edit(self, message_id: str, text: str) -> None:
        sent_at = self._outbound.sent_at(message_id)
        if sent_at is not None and self._outbound.clock() - sent_at > (
            EDIT_WINDOW_S - EDIT_MARGIN_S
        ):
            raise NotFound("edit: WhatsApp's 15-minute edit window is over")
        await self._engine.edit(self._chat, message_id, text)

    async def typing(self) -> None:
        await self._engine.presence(self._chat, composing=True)

    async def reachable(self) -> None:
        """The account answers again (``get_me``; before the one repeat of a send whose
        outcome is unknown)."""
        if await self._engine.me() is None:
            raise ChannelError("the account is not linked")


class WhatsAppWebOutbound(EditOutbound):
    """Sends notices and streams answers for one linked account."""

    def __init__(
        self, engine: WaEngine, *, clock: Callable[[], float], limits: Limits = LIMITS
    ) -> None:
        super().__init__(limits=limits, clock=clock, bot_username=None)
        self.engine = engine
        self._sent: OrderedDict[str, float] = OrderedDict()

    def sent(self, message_id: str) -> None:
        """Remember when a message was sent (for WhatsApp's edit window)."""
        self._sent[message_id] = self.clock()
        while len(self._sent) > SENT_TIMES_MAX:
            self._sent.popitem(last=False)

    def sent_at(self, message_id: str) -> float | None:
        return self._sent.get(message_id)

    def transport(self, target: ReplyTarget) -> WhatsAppWebTransport:
        return WhatsAppWebTransport(self, target)

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        return await super().send_text(target, to_whatsapp(text))

    async def mark_read(self, target: ReplyTarget) -> None:
        """Blue ticks on the user's message (best effort, bounded)."""
        route = target.route
        message_id = target.reply_to_message_id
        if not message_id or not isinstance(route, Mapping) or target.anchor is not None:
            return
        sender = str(route.get("participant") or target.conversation_id)
        raw_ts = route.get("timestamp")
        timestamp = raw_ts if isinstance(raw_ts, int) and raw_ts > 0 else int(self.clock())
        with trio.move_on_after(MARK_READ_WAIT_S):
            try:
                await self.engine.mark_read(
                    target.conversation_id, sender, [message_id], timestamp=timestamp
                )
            except ChannelError as exc:
                log.info("mark_read_failed", error=str(exc)[:200])

    async def paused(self, target: ReplyTarget) -> None:
        """``paused`` presence once an answer is complete (best effort, bounded)."""
        with trio.move_on_after(MARK_READ_WAIT_S):
            try:
                await self.engine.presence(target.conversation_id, composing=False)
            except ChannelError as exc:
                log.info("presence_failed", error=str(exc)[:200])

    @asynccontextmanager  # a ReplyStream of its own over the engine's EditStream
    async def open_stream(self, target: ReplyTarget) -> AsyncIterator[WhatsAppWebStream]:
        """Mark read, then stream by edits (see the module doc); ``paused`` at the end."""
        await self.mark_read(target)
        try:
            async with self.edit_stream(target) as stream:
                yield WhatsAppWebStream(stream)
        finally:
            with trio.CancelScope(shield=True):
                await self.paused(target)


class WhatsAppWebStream(WatchesDelivery):
    """A :class:`~dshim.outbound.ReplyStream` over the engine: every text it shows in
    WhatsApp's formatting."""

    def __init__(self, inner: EditStream) -> None:
        self._inner = inner

    def watch_delivery(self, hook: Callable[[], Awaitable[None]]) -> None:
        self._inner.watch_delivery(hook)

    async def update(self, text: str) -> None:
        await self._inner.update(to_whatsapp(text))

    async def progress(self, note: str) -> None:
        await self._inner.progress(note)

    async def finish(self, text: str) -> list[Delivered]:
        return await self._inner.finish(to_whatsapp(text))


def split(text: str) -> list[str]:
    """How WhatsApp Web answers are split (replay uses it)."""
    return LIMITS.split(to_whatsapp(text))
