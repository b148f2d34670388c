"""msgspec view structs for the QQ official bot API (v2 gateway and OpenAPI) that dshim reads.

Only the fields dshim uses are named; everything else in a payload is skipped by the
decoder.  Ids (openids, message ids, ``REFIDX_…`` quote indexes) are strings.  Decoders are
built once per type.  Field meanings: tencent-connect/bot-docs ``docs/develop/api-v2``
(``dev-prepare/interface-framework``, ``server-inter/message/send-receive``) and the 2026
event pages (``autogen/event/c2c_message_create``, ``group_at_message_create``); see
``protocols/qq.md``.
"""

from __future__ import annotations

from typing import Any

import msgspec


class Frame(msgspec.Struct, kw_only=True, gc=False):
    """The gateway envelope ``{"op", "d", "s", "t", "id"}``; ``id`` is the event id."""

    op: int
    d: msgspec.Raw = msgspec.Raw(b"null")
    s: int | None = None
    t: str | None = None
    id: str | None = None


class Author(msgspec.Struct, kw_only=True, gc=False):
    """``author``: C2C has ``user_openid`` (and ``id``), groups ``member_openid``, guild
    messages ``id`` (a guild user id) and ``username``."""

    id: str | None = None
    user_openid: str | None = None
    member_openid: str | None = None
    union_openid: str | None = None
    username: str | None = None
    bot: bool = False


class Member(msgspec.Struct, kw_only=True, gc=False):
    """``member`` of a guild message (the nick in that guild)."""

    nick: str | None = None


class Mention(msgspec.Struct, kw_only=True, gc=False):
    """One entry of ``mentions`` (group: other users; the bot itself is not listed on
    GROUP_AT_MESSAGE_CREATE; ``is_you`` / ``bot`` on full group messages and guilds)."""

    id: str | None = None
    member_openid: str | None = None
    user_openid: str | None = None
    bot: bool = False
    is_you: bool = False


class Attachment(msgspec.Struct, kw_only=True, gc=False):
    """``attachments[]``: ``content_type`` ``image/jpeg``, ``video/mp4``, ``file``,
    ``voice`` …; voice adds ``voice_wav_url`` and ``asr_refer_text``."""

    content_type: str = ""
    url: str = ""
    filename: str | None = None
    size: int | None = None
    voice_wav_url: str | None = None
    asr_refer_text: str | None = None


class ArkFields(msgspec.Struct, kw_only=True, gc=False):
    title: str | None = None
    desc: str | None = None


class ArkData(msgspec.Struct, kw_only=True, gc=False):
    """``ark_data`` of a card message (``message_type`` 3)."""

    ark_type: str | None = None
    ark_name: str | None = None
    prompt: str | None = None
    fields: ArkFields | None = None


class MsgElement(msgspec.Struct, kw_only=True, gc=False):
    """One quoted item of ``msg_elements`` (``message_type`` 103).  ``msg_idx`` and
    ``author`` are often absent; a nested ``msg_elements`` is not read (one level)."""

    msg_idx: str | None = None
    author: Author | None = None
    message_type: int = 0
    content: str = ""
    attachments: list[Attachment] = msgspec.field(default_factory=list)
    ark_data: ArkData | None = None


class MessageScene(msgspec.Struct, kw_only=True, gc=False):
    """``message_scene``: ``ext`` is a list of ``key=value`` strings (``msg_idx=…``,
    ``ref_msg_idx=…``, ``auth_token=…`` — a secret)."""

    source: str | None = None
    ext: list[str] = msgspec.field(default_factory=list)


class MessageReference(msgspec.Struct, kw_only=True, gc=False):
    """Guild messages: ``message_reference.message_id`` of the message replied to."""

    message_id: str | None = None


class Message(msgspec.Struct, kw_only=True, gc=False):
    """C2C_MESSAGE_CREATE, GROUP_AT_MESSAGE_CREATE, GROUP_MESSAGE_CREATE, AT_MESSAGE_CREATE,
    MESSAGE_CREATE and DIRECT_MESSAGE_CREATE ``d`` (the fields dshim reads of each), and
    the guild message ``GET /channels/{channel_id}/messages/{message_id}`` answers."""

    id: str
    author: Author = msgspec.field(default_factory=Author)
    content: str = ""
    timestamp: str | int | float | None = None
    attachments: list[Attachment] = msgspec.field(default_factory=list)
    message_type: int = 0
    ark_data: ArkData | None = None
    msg_elements: list[MsgElement] = msgspec.field(default_factory=list)
    message_scene: MessageScene | None = None
    mentions: list[Mention] = msgspec.field(default_factory=list)
    group_openid: str | None = None
    # guild messages
    channel_id: str | None = None
    guild_id: str | None = None
    src_guild_id: str | None = None
    member: Member | None = None
    message_reference: MessageReference | None = None


class FetchedEnvelope(msgspec.Struct, kw_only=True, gc=False):
    """``GET /channels/{channel_id}/messages/{message_id}``: the message object itself
    (bot-docs ``openapi/message/get_message_of_id.md``) or wrapped as ``{"message": {...}}``
    (the Python SDK's page; botgo decodes both).  ``message`` is ``null`` unless wrapped."""

    message: msgspec.Raw = msgspec.Raw(b"null")


class Me(msgspec.Struct, kw_only=True, gc=False):
    """``GET /users/@me``."""

    id: str
    username: str = ""
    bot: bool = True


class AccessTokenBody(msgspec.Struct, kw_only=True, gc=False):
    """``POST https://bots.qq.com/app/getAppAccessToken``: ``expires_in`` is a string in
    the examples and a number in the field table (both accepted)."""

    access_token: str | None = None
    expires_in: str | int | float | None = None
    code: int | None = None
    message: str | None = None


class ExtInfo(msgspec.Struct, kw_only=True, gc=False):
    ref_idx: str | None = None


class Sent(msgspec.Struct, kw_only=True, gc=False):
    """The answer of a send (``/messages``, ``/stream_messages``): ``id``, and the quote
    index of the new message in ``ext_info.ref_idx``."""

    id: str | None = None
    ext_info: ExtInfo | None = None
    code: int | None = None
    message: str | None = None


class ErrorBody(msgspec.Struct, kw_only=True, gc=False):
    """An OpenAPI error: ``{"code", "message", "err_code"?, "trace_id"?}``."""

    code: int = 0
    message: str = ""
    err_code: int | None = None
    trace_id: str | None = None


frame_decoder = msgspec.json.Decoder(Frame)
message_decoder = msgspec.json.Decoder(Message)
fetched_decoder = msgspec.json.Decoder(FetchedEnvelope)
me_decoder = msgspec.json.Decoder(Me)
token_decoder = msgspec.json.Decoder(AccessTokenBody)
sent_decoder = msgspec.json.Decoder(Sent)
error_decoder = msgspec.json.Decoder(ErrorBody)
encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    """Compact JSON for request bodies."""
    return encoder.encode(obj)


__all__ = [
    "AccessTokenBody",
    "ArkData",
    "ArkFields",
    "Attachment",
    "Author",
    "ErrorBody",
    "ExtInfo",
    "FetchedEnvelope",
    "Frame",
    "Me",
    "Member",
    "Mention",
    "Message",
    "MessageReference",
    "MessageScene",
    "MsgElement",
    "Sent",
    "encode",
]
