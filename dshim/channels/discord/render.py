"""Discord outbound: the transport for :mod:`dshim.render`'s streaming-by-edit engine.

An answer is created as a reply to the user's message (``message_reference`` with
``fail_if_not_exists: false``, so a deleted original does not lose the answer) and never
pings anyone (``allowed_mentions {parse: [], replied_user: false}``: model output saying
``@everyone`` stays text).  It is then streamed by ``PATCH`` edits at most once per second
per message; text beyond 2,000 characters continues in follow-up messages (no reply
reference); the typing indicator is refreshed every 8 s until the first message is up
(Discord shows it for 10 s).  Pacing, splitting, retries and "the final text exactly
once" live in :mod:`dshim.render`.

Rate limits: bucket waits happen in the REST client; a 429 is handed to the engine at
once (``retries=0``), which pauses the chat and sends the *newest* text when it retries
instead of replaying a stale intermediate edit.  Every create carries a ``nonce`` with
``enforce_nonce``: a create retried after its response was lost returns the message that
already exists instead of posting a duplicate.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

import structlog

from dshim.channels.discord.client import RestClient
from dshim.errors import ChannelError
from dshim.model import ReplyTarget
from dshim.render import EditOutbound, Limits

log = structlog.get_logger("dshim.discord")

#: Discord's message length limit, in code points.
MAX_MESSAGE_LEN = 2000
#: "Cannot reply without permission to read message history".
CANNOT_REPLY_CODE = 160002

#: 2,000 code points; the first message after ~1 s of text, then at most one edit a
#: second (the engine's defaults); typing lasts 10 s on Discord, so it is renewed every 8 s.
LIMITS = Limits(max_len=MAX_MESSAGE_LEN, typing_interval_s=8.0)


def split(text: str) -> list[str]:
    """The chunks a text is delivered in (2,000 characters each at most)."""
    return LIMITS.split(text)


class DiscordTransport:
    """One answer's messages in one channel (see :class:`dshim.render.StreamTransport`)."""

    #: Creates carry ``nonce`` + ``enforce_nonce``: a create repeated after its response
    #: was lost returns the existing message, so the engine may retry unknown outcomes.
    idempotent_sends = True

    def __init__(self, rest: RestClient, target: ReplyTarget) -> None:
        self.rest = rest
        self.channel_id = target.thread_id or target.conversation_id
        self.reply_to = target.reply_to_message_id
        # A nonce per logical message: retries of the same message reuse it.
        self._nonce_base = secrets.token_hex(8)
        self._sent = 0
        #: A substitute answer: a thread to open on the anchor first, and the asker to
        #: mention (and ping: only them) in the first message.
        self._thread_on: str | None = None
        self._thread_name = "answer"
        self._ping: str | None = None
        self._first_id: str | None = None
        anchor = target.anchor
        if anchor is not None:
            self._ping = anchor.mention_id
            self._thread_name = f"{anchor.mention_name or 'Answer'}: answered for them"
            if anchor.mode == "plain":
                self.reply_to = None
            elif anchor.mode == "quote":
                self.reply_to = anchor.message_id
            elif target.thread_id is not None:  # already in a thread: continue it
                self.reply_to = None
            else:
                self._thread_on = anchor.message_id
                self.reply_to = None

    def _addressed(self, text: str) -> str:
        if self._ping is None:
            return text
        out = f"<@{self._ping}> {text}"
        return out if len(out) <= MAX_MESSAGE_LEN else text

    async def _open_thread(self) -> None:
        anchor, self._thread_on = self._thread_on, None
        if anchor is None:
            return
        try:
            thread = await self.rest.start_thread(
                self.channel_id, anchor, self._thread_name, retries=0
            )
        except ChannelError as exc:  # no permission, a thread exists already ...
            log.info("reply_thread_failed", code=exc.code, error=str(exc))
            self.reply_to = anchor  # still under the trigger, as a reply
            return
        self.channel_id = thread.id

    async def send(self, text: str, *, reply: bool) -> str:
        if self._thread_on is not None:
            await self._open_thread()
        ping = self._ping if self._first_id is None else None
        if ping is not None:
            text = self._addressed(text)
        nonce = f"{self._nonce_base}{self._sent:03d}"
        reply_to = self.reply_to if reply else None
        try:
            created = await self.rest.create_message(
                self.channel_id, text, reply_to=reply_to, nonce=nonce, retries=0, ping=ping
            )
        except ChannelError as exc:
            if reply_to is None or exc.code != CANNOT_REPLY_CODE:
                raise
            # No Read Message History permission: answer without the reply reference.
            self.reply_to = None
            created = await self.rest.create_message(
                self.channel_id, text, nonce=nonce, retries=0, ping=ping
            )
        self._sent += 1
        if self._first_id is None:
            self._first_id = created.id
        if created.content is not None and created.content != text:
            # The nonce matched a create whose response we lost, with older text.
            await self.rest.edit_message(self.channel_id, created.id, text, retries=0)
        return created.id

    async def edit(self, message_id: str, text: str) -> None:
        if message_id == self._first_id:
            text = self._addressed(text)
        await self.rest.edit_message(self.channel_id, message_id, text, retries=0)

    async def typing(self) -> None:
        await self.rest.trigger_typing(self.channel_id, retries=0)


class DiscordOutbound(EditOutbound):
    """The channel's :class:`dshim.outbound.Outbound`: replies, notices, streamed answers."""

    def __init__(
        self,
        rest: RestClient,
        *,
        clock: Callable[[], float],
        bot_username: str | None = None,
        limits: Limits = LIMITS,
    ) -> None:
        super().__init__(limits=limits, clock=clock, bot_username=bot_username)
        self.rest = rest

    def transport(self, target: ReplyTarget) -> DiscordTransport:
        return DiscordTransport(self.rest, target)

    async def direct_target(self, user_id: str) -> ReplyTarget:
        """A DM to ``user_id`` goes to its DM channel (opened on first use)."""
        channel = await self.rest.open_dm(user_id)
        return ReplyTarget(conversation_id=channel.id, conversation_type="direct")
