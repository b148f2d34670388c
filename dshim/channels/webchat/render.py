"""Web chat outbound: answers streamed as ``message`` frames, notices, buttons.

Every tab that follows the conversation gets the frames (:class:`~.client.Tabs`); every
message the bot delivers is also written to the conversation's message log, which is
where the page's history and the quotes of the bot's answers come from.

Streaming (:class:`WebchatCalls` on the native-stream engine): the first text goes out at once (this is local: no
pacing for a platform's sake), then at most one frame per :data:`FRAME_INTERVAL_S` per
answer, each carrying the whole text so far with ``"final": false`` and the answer's one
id; texts that arrive in between are merged (only the newest is sent).  ``finish`` sends
exactly one frame with ``"final": true`` and the complete text, and logs it.  An answer
longer than :data:`MAX_MESSAGE_LEN` continues in follow-up messages (split at paragraph,
line or word boundaries).  Until the first text a ``typing`` frame says the bot is
writing.  Sending never fails (a closed tab is just gone), so nothing is retried and
nothing can be sent twice.

Approvals and questions (:meth:`WebchatOutbound.open_interaction`): the request is a bot
message with the whole text (typed answers work as everywhere) and an ``interaction``
frame with one button per option; the page sends a button press as an ``answer`` frame,
which the channel turns into a message with that option.  When the pipeline stops
waiting, an ``interaction_closed`` frame takes the buttons away.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import structlog

from dshim.channels.base import (
    ChannelStore,
    InteractionPrompt,
    LoggedMessage,
    PresentsInteractions,
)
from dshim.channels.webchat import protocol
from dshim.channels.webchat.client import Tabs
from dshim.errors import StoreError
from dshim.model import Delivered, ReplyTarget
from dshim.render import split_text
from dshim.streams.native import BoundCalls, NativeStream, Step, open_native_stream

log = structlog.get_logger("dshim.webchat")

#: At most one intermediate frame per answer this often (20 a second).
FRAME_INTERVAL_S = 0.05
#: One message's text; longer answers continue in follow-up messages.
MAX_MESSAGE_LEN = 50_000

Clock = Callable[[], float]


def split(text: str) -> list[str]:
    """The messages a text is delivered in."""
    return split_text(text, MAX_MESSAGE_LEN)


def new_id() -> str:
    """A bot message id (unique in practice: 64 random bits)."""
    return "b-" + secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class Pending:
    """A request shown with buttons that still waits for its answer."""

    conversation: str
    id: str
    prompt: InteractionPrompt
    frame: str


class WebchatOutbound(PresentsInteractions):
    """The channel's :class:`dshim.outbound.Outbound` (with buttons for interactions)."""

    def __init__(
        self, tabs: Tabs, store: ChannelStore, me: protocol.BotIdentity, *, clock: Clock
    ) -> None:
        self.tabs = tabs
        self.store = store
        self.me = me
        self.clock = clock
        #: ``/cmd@name`` names the bot as the page does.
        self.bot_username: str | None = me.name
        #: Answers being written: message id -> (conversation, the message so far).
        self._live: dict[str, tuple[str, LoggedMessage]] = {}
        self._pending: dict[tuple[str, str], Pending] = {}

    # -- what the channel asks ----------------------------------------------------------

    def live(self, conversation: str) -> list[LoggedMessage]:
        """The conversation's answers being written now (their text so far)."""
        return [lm for conv, lm in self._live.values() if conv == conversation]

    def pending(self, conversation: str) -> list[Pending]:
        """The conversation's requests waiting for an answer (their buttons)."""
        return [p for (conv, _), p in self._pending.items() if conv == conversation]

    def interaction(self, conversation: str, interaction_id: str) -> Pending | None:
        return self._pending.get((conversation, interaction_id))

    # -- delivering ----------------------------------------------------------------------

    def _bot_message(
        self, message_id: str, text: str, at: float, reply_to: str | None
    ) -> LoggedMessage:
        return LoggedMessage(
            message_id=message_id,
            author_id=self.me.id,
            author_name=self.me.name,
            author_bot=True,
            text=text,
            at=at,
            reply_to=reply_to,
        )

    def show(self, conversation: str, logged: LoggedMessage, *, final: bool) -> None:
        """Send one message frame to the conversation's tabs."""
        frame = protocol.message_frame(conversation, logged, final=final)
        self.tabs.broadcast(conversation, frame, key=logged.message_id)

    async def record(self, conversation: str, logged: LoggedMessage) -> None:
        """Write a delivered message to the log (a failing store costs the history only)."""
        try:
            await self.store.log_message(conversation, logged, now=self.clock())
        except StoreError as exc:
            log.warning("message_log_failed", error=str(exc)[:300], message_id=logged.message_id)

    async def deliver(
        self,
        target: ReplyTarget,
        chunks: list[str],
        *,
        first_id: str | None = None,
        sent_at: float | None = None,
    ) -> list[Delivered]:
        """Show ``chunks`` as final messages (the first under the user's message) and log them."""
        now = self.clock()
        out: list[Delivered] = []
        for i, chunk in enumerate(chunks):
            mid = first_id if i == 0 and first_id is not None else new_id()
            at = sent_at if i == 0 and sent_at is not None else now
            logged = self._bot_message(
                mid, chunk, at, target.reply_to_message_id if i == 0 else None
            )
            self.show(target.conversation_id, logged, final=True)
            await self.record(target.conversation_id, logged)
            out.append(Delivered(message_id=mid, text=chunk, sent_at=at, completed_at=now))
        return out

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        """A notice or command reply: final at once, under the user's message."""
        return await self.deliver(target, split(text))

    @asynccontextmanager
    async def open_stream(self, target: ReplyTarget) -> AsyncIterator[NativeStream]:
        """Stream one answer (see the module docstring)."""
        self.tabs.broadcast(
            target.conversation_id, protocol.typing_frame(target.conversation_id, self.me.name)
        )
        calls = WebchatCalls(self, target)
        async with open_native_stream(calls) as stream:
            yield stream

    @asynccontextmanager
    async def open_interaction(
        self, target: ReplyTarget, prompt: InteractionPrompt
    ) -> AsyncIterator[list[Delivered]]:
        """Show a request with buttons until the block ends (see the module docstring)."""
        conversation = target.conversation_id
        [shown] = await self.deliver(target, [prompt.text[:MAX_MESSAGE_LEN]])
        frame = protocol.interaction_frame(
            conversation,
            shown.message_id,
            kind=prompt.kind,
            prompt=prompt.prompt,
            options=prompt.options,
            multi_select=prompt.multi_select,
            allow_free_text=prompt.allow_free_text,
        )
        key = (conversation, shown.message_id)
        self._pending[key] = Pending(conversation, shown.message_id, prompt, frame)
        self.tabs.broadcast(conversation, frame)
        try:
            yield [shown]
        finally:
            del self._pending[key]
            self.tabs.broadcast(
                conversation, protocol.interaction_closed_frame(conversation, shown.message_id)
            )


class WebchatCalls(BoundCalls[NativeStream]):
    """One streamed answer's frames, on the native-stream engine
    (:mod:`dshim.streams.native`): the engine paces and merges, these show."""

    interval_s = FRAME_INTERVAL_S
    shows_notes = True

    def __init__(self, outbound: WebchatOutbound, target: ReplyTarget) -> None:
        self.outbound = outbound
        self.target = target
        self.id = new_id()
        self._sent_at: float | None = None
        self._shown: str | None = None

    async def _before_first(self) -> None:
        await self.stream.delivering()
        if self._sent_at is None:
            self._sent_at = self.outbound.clock()

    def _display(self) -> str:
        text = self.stream.text.strip()[:MAX_MESSAGE_LEN]
        note = self.stream.note
        return f"{text}\n\n⏳ {note}" if text and note else text

    async def start(self, text: str) -> Step:
        await self._before_first()
        if self.stream.finishing:
            return Step.STOP
        return await self.append(text)

    async def append(self, text: str) -> Step:
        display = self._display()
        if not display:
            return Step.AGAIN
        self._shown = display
        logged = self.outbound._bot_message(
            self.id, display, self._sent_at or 0.0, self.target.reply_to_message_id
        )
        self.outbound._live[self.id] = (self.target.conversation_id, logged)
        self.outbound.show(self.target.conversation_id, logged, final=False)
        return Step.SHOWN

    async def finish(self, text: str) -> list[Delivered]:
        """The one final frame (and follow-up messages beyond the length limit)."""
        chunks = split(text)
        if not chunks:
            chunks = ["…"] if self._shown is not None else []
        if not chunks:
            return []
        await self._before_first()
        self.outbound._live.pop(self.id, None)
        return await self.outbound.deliver(
            self.target, chunks, first_id=self.id, sent_at=self._sent_at
        )

    def fallback(self) -> None:
        return None  # sending never fails

    async def abandon(self) -> None:
        """Left without ``finish`` (stopped, failed): what was shown becomes final."""
        self.outbound._live.pop(self.id, None)
        if self._shown is not None:
            await self.outbound.deliver(
                self.target, [self._shown], first_id=self.id, sent_at=self._sent_at
            )

    async def background(self) -> None:
        return None
