"""msgspec "view" structs of the Telegram Bot API: only the fields dshim reads.

Names follow the Bot API reference (core.telegram.org/bots/api); ``from`` is ``from_``.
Unknown fields are ignored, so newer API versions decode fine.  Ids are Python ints
(chat and user ids exceed 32 bits).  One decoder per type, reused.
"""

from __future__ import annotations

from typing import Any

import msgspec


class _View(msgspec.Struct, kw_only=True, rename={"from_": "from"}, gc=False):
    pass


class User(_View):
    id: int
    is_bot: bool = False
    first_name: str = ""
    last_name: str | None = None
    username: str | None = None


class Me(User):
    """``getMe``'s result."""

    can_read_all_group_messages: bool | None = None


class Chat(_View):
    id: int
    type: str
    title: str | None = None
    username: str | None = None
    first_name: str | None = None
    last_name: str | None = None
    is_forum: bool = False


class MessageEntity(_View):
    type: str
    offset: int
    length: int
    user: User | None = None


class PhotoSize(_View):
    file_id: str
    width: int = 0
    height: int = 0
    file_size: int | None = None


class FileView(_View):
    """Document, Audio, Voice, Video, VideoNote, Animation and Sticker: the common fields."""

    file_id: str
    file_name: str | None = None
    mime_type: str | None = None
    file_size: int | None = None


class TextQuote(_View):
    text: str
    position: int | None = None
    is_manual: bool = False


class MessageOrigin(_View):
    """``user`` / ``hidden_user`` / ``chat`` / ``channel``: one struct, fields by type."""

    type: str
    date: int | None = None
    sender_user: User | None = None
    sender_user_name: str | None = None
    sender_chat: Chat | None = None
    chat: Chat | None = None
    message_id: int | None = None


class _Media(_View):
    photo: list[PhotoSize] | None = None
    document: FileView | None = None
    audio: FileView | None = None
    voice: FileView | None = None
    video: FileView | None = None
    video_note: FileView | None = None
    animation: FileView | None = None
    sticker: FileView | None = None


class ExternalReplyInfo(_Media, kw_only=True):
    """A reply to a message in another chat or topic (no text: that comes as ``quote``)."""

    origin: MessageOrigin
    chat: Chat | None = None
    message_id: int | None = None


class RepliedMessage(_Media, kw_only=True):
    """``reply_to_message``: one level only (its own reply is never read)."""

    message_id: int
    date: int = 0
    chat: Chat | None = None
    from_: User | None = None
    sender_chat: Chat | None = None
    message_thread_id: int | None = None
    is_topic_message: bool = False
    text: str | None = None
    caption: str | None = None
    forum_topic_created: dict[str, Any] | None = None


class Message(_Media, kw_only=True):
    message_id: int
    date: int
    chat: Chat
    from_: User | None = None
    sender_chat: Chat | None = None
    message_thread_id: int | None = None
    is_topic_message: bool = False
    text: str | None = None
    entities: list[MessageEntity] | None = None
    caption: str | None = None
    caption_entities: list[MessageEntity] | None = None
    reply_to_message: RepliedMessage | None = None
    external_reply: ExternalReplyInfo | None = None
    quote: TextQuote | None = None
    reply_to_story: dict[str, Any] | None = None
    migrate_to_chat_id: int | None = None
    migrate_from_chat_id: int | None = None
    #: Set on every part of an album (several photos sent together).
    media_group_id: str | None = None
    #: Forwarded from elsewhere (Bot API 7.0+); the older fields below still arrive too.
    forward_origin: MessageOrigin | None = None
    forward_date: int | None = None
    forward_from: User | None = None
    forward_from_chat: Chat | None = None
    forward_sender_name: str | None = None


class Update(_View):
    update_id: int
    message: Message | None = None


class ResponseParameters(_View):
    retry_after: float | None = None
    migrate_to_chat_id: int | None = None


class ChatMember(_View):
    """``getChatMember``'s result: only the status is read."""

    status: str = "unknown"


class Envelope(_View):
    """Every Bot API response; ``result`` is decoded per method."""

    ok: bool
    #: Empty when absent (msgspec.Raw cannot be combined with None).
    result: msgspec.Raw = msgspec.Raw(b"")
    error_code: int | None = None
    description: str | None = None
    parameters: ResponseParameters | None = None


class SentMessage(_View):
    """What sendMessage / editMessageText return: only the id matters."""

    message_id: int
    date: int = 0


class File(_View):
    file_id: str
    file_size: int | None = None
    file_path: str | None = None


class WebhookInfo(_View):
    url: str = ""
    pending_update_count: int = 0
    last_error_message: str | None = None


UPDATE_DECODER = msgspec.json.Decoder(Update)
ENVELOPE_DECODER = msgspec.json.Decoder(Envelope)
RAW_LIST_DECODER = msgspec.json.Decoder(list[msgspec.Raw])
ME_DECODER = msgspec.json.Decoder(Me)
SENT_DECODER = msgspec.json.Decoder(SentMessage)
FILE_DECODER = msgspec.json.Decoder(File)
WEBHOOK_DECODER = msgspec.json.Decoder(WebhookInfo)
CHAT_MEMBER_DECODER = msgspec.json.Decoder(ChatMember)
