"""msgspec view structs for the Discord Gateway v10 and REST v10 payloads dshim reads.

Only the fields dshim uses are named; everything else in a payload is skipped by the
decoder.  Snowflakes are strings on the wire and stay strings here.  Decoders are built
once per type (msgspec ``Decoder`` objects are reusable and thread-safe).

Field meanings: https://discord.com/developers/docs (events/gateway-events,
resources/message, resources/user).
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

# Shared with QQ's gateway: the kit's envelope, Hello and ``GET /gateway/bot`` answer.
from dshim.channels.kit.gateway import (
    Frame,
    GatewayBot,
    Hello,
    SessionStartLimit,
    frame_decoder,
    gateway_bot_decoder,
    hello_decoder,
)


class User(msgspec.Struct, kw_only=True, gc=False):
    id: str
    username: str = ""
    global_name: str | None = None
    bot: bool = False


class MentionedUser(msgspec.Struct, kw_only=True, gc=False):
    id: str
    username: str = ""
    global_name: str | None = None


class Member(msgspec.Struct, kw_only=True, gc=False):
    nick: str | None = None


class Ready(msgspec.Struct, kw_only=True, gc=False):
    session_id: str
    resume_gateway_url: str | None = None
    user: User | None = None


class Attachment(msgspec.Struct, kw_only=True, gc=False):
    id: str = ""
    filename: str = ""
    content_type: str | None = None
    size: int | None = None
    url: str | None = None


class StickerItem(msgspec.Struct, kw_only=True, gc=False):
    id: str = ""
    name: str = ""


class SnapshotMessage(msgspec.Struct, kw_only=True, gc=False):
    """The forwarded message inside a ``message_snapshots`` entry (it has no author)."""

    content: str = ""
    attachments: list[Attachment] = msgspec.field(default_factory=list)
    sticker_items: list[StickerItem] = msgspec.field(default_factory=list)


class MessageSnapshot(msgspec.Struct, kw_only=True, gc=False):
    message: SnapshotMessage = msgspec.field(default_factory=SnapshotMessage)


class MessageReference(msgspec.Struct, kw_only=True, gc=False):
    #: 0 DEFAULT (a reply), 1 FORWARD; absent means DEFAULT.
    type: int = 0
    message_id: str | None = None
    channel_id: str | None = None
    guild_id: str | None = None


class QuotedMessage(msgspec.Struct, kw_only=True, gc=False):
    """A ``referenced_message`` or a fetched message: one level, its own quote not expanded."""

    id: str | None = None
    channel_id: str | None = None
    author: User | None = None
    member: Member | None = None
    #: Absent (UNSET) when the payload says nothing about it.
    content: str | UnsetType = UNSET
    attachments: list[Attachment] = msgspec.field(default_factory=list)
    sticker_items: list[StickerItem] = msgspec.field(default_factory=list)
    timestamp: str | None = None


class Message(msgspec.Struct, kw_only=True, gc=False):
    """A MESSAGE_CREATE dispatch's ``d``: a message object plus the gateway's extra fields."""

    id: str
    channel_id: str
    author: User
    guild_id: str | None = None
    member: Member | None = None
    content: str = ""
    timestamp: str | None = None
    type: int = 0
    mentions: list[MentionedUser] = msgspec.field(default_factory=list)
    mention_roles: list[str] = msgspec.field(default_factory=list)
    attachments: list[Attachment] = msgspec.field(default_factory=list)
    message_reference: MessageReference | None = None
    #: Forwards (``message_reference.type`` 1): the forwarded message, one level.
    message_snapshots: list[MessageSnapshot] = msgspec.field(default_factory=list)
    #: Absent (UNSET): Discord did not try to resolve the reply; ``None``: it was deleted.
    referenced_message: QuotedMessage | None | UnsetType = UNSET
    webhook_id: str | None = None
    channel_type: int | None = None
    #: Only messages inside a thread carry a position.
    position: int | None = None


class RoleTags(msgspec.Struct, kw_only=True, gc=False):
    #: Set on the managed role Discord creates for a bot when it joins a guild.
    bot_id: str | None = None


class Role(msgspec.Struct, kw_only=True, gc=False):
    id: str
    tags: RoleTags | None = None


class ThreadChannel(msgspec.Struct, kw_only=True, gc=False):
    """A thread channel (THREAD_CREATE's ``d``, GUILD_CREATE's ``threads``): its id and type.
    Both have defaults, so one odd entry never costs a GUILD_CREATE its roles."""

    id: str = ""
    type: int = 0


class Guild(msgspec.Struct, kw_only=True, gc=False):
    """GUILD_CREATE (and GUILD_DELETE): the roles and the active threads are read."""

    id: str
    unavailable: bool = False
    roles: list[Role] = msgspec.field(default_factory=list)
    threads: list[ThreadChannel] = msgspec.field(default_factory=list)


class GuildRoleEvent(msgspec.Struct, kw_only=True, gc=False):
    """GUILD_ROLE_CREATE / GUILD_ROLE_UPDATE (``role``) and GUILD_ROLE_DELETE (``role_id``)."""

    guild_id: str
    role: Role | None = None
    role_id: str | None = None


class ErrorBody(msgspec.Struct, kw_only=True, gc=False):
    """A REST error: ``{"code", "message"}``; a 429 adds ``retry_after`` and ``global``."""

    code: int = 0
    message: str = ""
    retry_after: float | None = None
    global_: bool = msgspec.field(default=False, name="global")


class CreatedChannel(msgspec.Struct, kw_only=True, gc=False):
    """What dshim reads from a created channel (a thread, a DM channel)."""

    id: str


class CreatedMessage(msgspec.Struct, kw_only=True, gc=False):
    """What dshim reads from a created or edited message."""

    id: str
    channel_id: str = ""
    content: str | None = None


class InteractionData(msgspec.Struct, kw_only=True, gc=False):
    """A component interaction's ``data``: which component (``custom_id``) was used."""

    custom_id: str = ""
    #: 2 = a button.
    component_type: int = 0


class InteractionMember(msgspec.Struct, kw_only=True, gc=False):
    """The presser in a guild (``member.user``); in a DM it is the top-level ``user``."""

    user: User | None = None
    nick: str | None = None


class InteractionMessage(msgspec.Struct, kw_only=True, gc=False):
    """The bot message whose component was pressed."""

    id: str
    channel_id: str = ""
    content: str = ""


class Interaction(msgspec.Struct, kw_only=True, gc=False):
    """An INTERACTION_CREATE ``d`` (resources/interactions.mdx, Interaction Object).

    ``token`` is a secret (it answers the interaction for 15 minutes): it is used for the
    one callback and never logged or stored.
    """

    id: str
    type: int
    token: str = ""
    channel_id: str | None = None
    guild_id: str | None = None
    member: InteractionMember | None = None
    user: User | None = None
    message: InteractionMessage | None = None
    data: InteractionData | None = None


channel_decoder = msgspec.json.Decoder(CreatedChannel)
interaction_decoder = msgspec.json.Decoder(Interaction)
ready_decoder = msgspec.json.Decoder(Ready)
message_decoder = msgspec.json.Decoder(Message)
quoted_decoder = msgspec.json.Decoder(QuotedMessage)
guild_decoder = msgspec.json.Decoder(Guild)
thread_decoder = msgspec.json.Decoder(ThreadChannel)
guild_role_decoder = msgspec.json.Decoder(GuildRoleEvent)
user_decoder = msgspec.json.Decoder(User)
error_decoder = msgspec.json.Decoder(ErrorBody)
created_decoder = msgspec.json.Decoder(CreatedMessage)
encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    """Compact JSON for outgoing frames and request bodies."""
    return encoder.encode(obj)


__all__ = [
    "UNSET",
    "Attachment",
    "CreatedMessage",
    "ErrorBody",
    "Frame",
    "GatewayBot",
    "Guild",
    "GuildRoleEvent",
    "Hello",
    "Interaction",
    "InteractionData",
    "InteractionMember",
    "InteractionMessage",
    "Member",
    "MentionedUser",
    "Message",
    "MessageReference",
    "MessageSnapshot",
    "QuotedMessage",
    "Ready",
    "Role",
    "RoleTags",
    "SessionStartLimit",
    "SnapshotMessage",
    "StickerItem",
    "User",
    "encode",
    "frame_decoder",
    "gateway_bot_decoder",
    "hello_decoder",
]
