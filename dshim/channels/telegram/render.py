"""Telegram outbound: the :class:`dshim.outbound.Outbound` of a Telegram bot.

Answers go under the user's message (``reply_parameters`` with
``allow_sending_without_reply``, so a deleted original does not fail the send) and into
the same forum topic (``message_thread_id``).  Streaming is the shared edit engine
(:mod:`dshim.render`) with Telegram's limits: 4,096 UTF-16 code units per message, the
first message after ~1 s of text, at most one edit per second per message, at most 20
sends+edits per minute in a group chat, ``typing`` every 5 s until the first text.
Plain text, no parse mode: model output is not valid MarkdownV2 or HTML.

A group upgraded to a supergroup answers 400 with ``migrate_to_chat_id``: the transport
resends there and remembers the new id for the rest of the bot's run.  A forum topic
deleted while the agent answered answers 400 "message thread not found": the transport
resends once to the chat itself, without the topic, and sends the rest of the answer
there too.  Both resends follow a definite refusal (nothing was delivered); a send whose
outcome is unknown is never repeated here (see :mod:`dshim.render`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import structlog

from dshim.channels.telegram.client import BotApiClient
from dshim.channels.telegram.models import SentMessage
from dshim.channels.telegram.protocol import (
    MAX_MESSAGE_UTF16,
    ChatMigrated,
    ThreadNotFound,
    utf16_len,
)
from dshim.model import ReplyTarget
from dshim.render import ChatPacer, EditOutbound, Limits, ProbesReachable

log = structlog.get_logger("dshim.telegram")

#: 4,096 UTF-16 code units; the first message after ~1 s of text, at most one edit a
#: second, typing renewed every 5 s (Telegram shows it for 5 s): the engine's defaults;
#: typing only once the agent has been silent for 1 s (a quick answer needs none).
LIMITS = Limits(max_len=MAX_MESSAGE_UTF16, measure=utf16_len, typing_grace_s=1.0)
#: Telegram's flood limit for groups: about 20 messages per minute (edits count too).
GROUP_BUDGET = 20
GROUP_BUDGET_WINDOW_S = 60.0
MIGRATIONS_MAX = 1024


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


class TelegramTransport(ProbesReachable):
    """The edit engine's transport for one answer (see :mod:`dshim.render`)."""

    def __init__(self, outbound: TelegramOutbound, target: ReplyTarget) -> None:
        self._outbound = outbound
        self._client = outbound.client
        self._chat = int(target.conversation_id)
        self._thread = _int(target.thread_id)
        self._reply_to = _int(target.reply_to_message_id)
        anchor = target.anchor
        #: A substitute answer: placed by its own anchor, addressed to the asker.
        self._mention: tuple[str, int] | None = None
        self._mentioned_id: str | None = None
        if anchor is not None:
            self._reply_to = _int(anchor.message_id) if anchor.mode != "plain" else None
            user = _int(anchor.mention_id)
            if user is not None and user > 0:  # a person (a chat has a negative id)
                self._mention = (" ".join((anchor.mention_name or "").split()) or "you", user)

    @property
    def chat_id(self) -> int:
        return self._outbound.current_chat(self._chat)

    def _addressed(self, text: str) -> tuple[str, list[dict[str, Any]] | None]:
        """The first message of a substitute answer starts with a ``text_mention`` of the
        person who asked (when it still fits Telegram's limit)."""
        if self._mention is None:
            return text, None
        name, user = self._mention
        out = f"{name} {text}"
        if utf16_len(out) > MAX_MESSAGE_UTF16:
            return text, None
        entity = {
            "type": "text_mention",
            "offset": 0,
            "length": utf16_len(name),
            "user": {"id": user},
        }
        return out, [entity]

    async def send(self, text: str, *, reply: bool) -> str:
        entities = None
        if self._mention is not None and self._mentioned_id is None:
            text, entities = self._addressed(text)
        params: dict[str, Any] = {
            "chat_id": self.chat_id,
            "text": text,
            "link_preview_options": {"is_disabled": True},
        }
        if entities:
            params["entities"] = entities
        if self._thread is not None:
            params["message_thread_id"] = self._thread
        if reply and self._reply_to is not None:
            params["reply_parameters"] = {
                "message_id": self._reply_to,
                "allow_sending_without_reply": True,
            }
        try:
            sent = await self._send_to_thread(params)
        except ChatMigrated as exc:
            self._outbound.migrated(self._chat, exc.migrate_to_chat_id)
            params["chat_id"] = exc.migrate_to_chat_id
            params.pop("reply_parameters", None)  # the original lives in the old chat
            sent = await self._send_to_thread(params)
        if self._mention is not None and self._mentioned_id is None:
            self._mentioned_id = str(sent.message_id)
        return str(sent.message_id)

    async def _send_to_thread(self, params: dict[str, Any]) -> SentMessage:
        try:
            return await self._client.send_message(params)
        except ThreadNotFound:
            if "message_thread_id" not in params:
                raise
        # The topic was deleted while the agent answered: the answer goes to the chat
        # itself (still under the question when it survives), once, and stays there.
        log.info("reply_thread_dropped", thread=self._thread, chat=params["chat_id"])
        self._thread = None
        del params["message_thread_id"]
        return await self._client.send_message(params)

    async def edit(self, message_id: str, text: str) -> None:
        entities = None
        if message_id == self._mentioned_id:
            text, entities = self._addressed(text)
        await self._client.edit_message_text(self.chat_id, int(message_id), text, entities=entities)

    async def typing(self) -> None:
        await self._client.send_chat_action(self.chat_id, "typing", thread_id=self._thread)

    async def reachable(self) -> None:
        """Does the Bot API answer again? (``getMe``: cheap, idempotent; before the one
        repeat of a send whose outcome is unknown, see :mod:`dshim.render`)."""
        await self._client.get_me()


class TelegramOutbound(EditOutbound):
    """Sends notices and streams answers for one bot."""

    def __init__(
        self,
        client: BotApiClient,
        *,
        clock: Callable[[], float],
        username: str | None,
        limits: Limits = LIMITS,
    ) -> None:
        super().__init__(limits=limits, clock=clock, bot_username=username)
        self.client = client
        self._migrations: OrderedDict[int, int] = OrderedDict()

    def current_chat(self, chat_id: int) -> int:
        """The id a chat has now (after group -> supergroup migrations)."""
        seen = 0
        while chat_id in self._migrations and seen < 8:
            chat_id = self._migrations[chat_id]
            seen += 1
        return chat_id

    def migrated(self, old: int, new: int) -> None:
        """Remember that chat ``old`` is now ``new``."""
        if old == new:
            return
        if self._migrations.get(old) != new:
            log.info("chat_migrated", old_chat=old, new_chat=new)
        self._migrations[old] = new
        self._migrations.move_to_end(old)
        while len(self._migrations) > MIGRATIONS_MAX:
            self._migrations.popitem(last=False)

    def transport(self, target: ReplyTarget) -> TelegramTransport:
        return TelegramTransport(self, target)

    def pacer(self, target: ReplyTarget) -> ChatPacer:
        """Groups get Telegram's flood budget (about 20 messages a minute, edits count)."""
        if target.conversation_type == "group":
            return self._pacers.get(
                target.conversation_id, budget=GROUP_BUDGET, per_s=GROUP_BUDGET_WINDOW_S
            )
        return super().pacer(target)


def split(text: str) -> list[str]:
    """How Telegram answers are split (replay uses it)."""
    return LIMITS.split(text)
