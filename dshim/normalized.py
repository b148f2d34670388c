"""The normalized event format: an InboundMessage as JSON with snake_case keys.

Used by replay fixtures (``"format": "normalized"``) and by the durable inbox for messages
that reached the pipeline without a platform payload.  Optional keys may be omitted.
``received_at`` and ``reply_to.recover_at`` are ISO 8601 strings or epoch seconds;
``reply_to.recover_at`` means "the platform gave only the id/time of a quoted bot message:
run the recovery".  Loaders and download handles are never part of the format.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from dshim.channels.kit.decode import decode as bounded_decode
from dshim.model import Attachment, InboundMessage, MediaRef, ReplyReference

Scalar = str | int | float | None


class WireAttachment(msgspec.Struct, kw_only=True, omit_defaults=True):
    kind: str | None = None
    name: Scalar = None


class WireReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    message_id: Scalar | UnsetType = UNSET
    author_id: Scalar | UnsetType = UNSET
    author_name: Scalar | UnsetType = UNSET
    content: Scalar | UnsetType = UNSET
    attachments: list[WireAttachment] | UnsetType = UNSET
    unavailable_reason: str | None | UnsetType = UNSET
    #: Present (even null) = run the recovery of the bot's own answer; the value is the
    #: quoted message's time when the platform gave one.
    recover_at: str | float | None | UnsetType = UNSET


class WireMedia(msgspec.Struct, kw_only=True, omit_defaults=True):
    kind: str | None = None
    name: str | None = None
    mime: str | None = None
    size: int | None = None


class WireEvent(msgspec.Struct, kw_only=True, omit_defaults=True):
    message_id: str | int
    conversation_id: str | int
    sender_id: str | int
    conversation_type: Literal["direct", "group"] = "direct"
    thread_id: str | int | None = None
    sender_name: str | None = None
    sender_is_bot: bool = False
    addressed: bool | None = None
    content: str = ""
    images: list[WireMedia] = msgspec.field(default_factory=list)
    files: list[WireMedia] = msgspec.field(default_factory=list)
    reply_to: WireReply | None = None
    received_at: str | float | None = None
    conversation_title: str | None = None
    forwarded: bool = False


_decoder = msgspec.json.Decoder(WireEvent)
_encoder = msgspec.json.Encoder()


def parse_time(value: str | float | int | None) -> float | None:
    """ISO 8601 (``Z`` allowed; naive means UTC) or epoch seconds -> epoch seconds."""
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    text = value.strip()
    if text.endswith("Z") or text.endswith("z"):
        text = text[:-1] + "+00:00"
    try:
        dt = datetime.fromisoformat(text)
    except ValueError as exc:
        raise ValueError(f"not an ISO 8601 time: {value!r}") from exc
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def format_time(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat().replace("+00:00", "Z")


def from_wire(ev: WireEvent, *, channel: str, bot_id: str) -> InboundMessage:
    reply: ReplyReference | None = None
    if ev.reply_to is not None:
        r = ev.reply_to
        recover = not isinstance(r.recover_at, UnsetType)
        recover_at = parse_time(r.recover_at) if not isinstance(r.recover_at, UnsetType) else None
        reply = ReplyReference(
            message_id=r.message_id,
            author_id=r.author_id,
            author_name=r.author_name,
            content=r.content,
            attachments=(
                UNSET
                if isinstance(r.attachments, UnsetType)
                else [Attachment(kind=a.kind or "other", name=a.name) for a in r.attachments]
            ),
            unavailable_reason=r.unavailable_reason,
            recover=recover,
            recover_at=recover_at,
        )
    received = parse_time(ev.received_at)
    addressed = ev.addressed if ev.addressed is not None else ev.conversation_type == "direct"
    return InboundMessage(
        channel=channel,
        bot_id=bot_id,
        message_id=str(ev.message_id),
        conversation_id=str(ev.conversation_id),
        conversation_type=ev.conversation_type,
        thread_id=None if ev.thread_id in (None, "") else str(ev.thread_id),
        sender_id=str(ev.sender_id),
        sender_name=ev.sender_name,
        sender_is_bot=ev.sender_is_bot,
        addressed=addressed,
        content=ev.content,
        images=[_media(m, "image") for m in ev.images],
        files=[_media(m, "file") for m in ev.files],
        reply_to=reply,
        received_at=received if received is not None else 0.0,
        conversation_title=ev.conversation_title,
        forwarded=ev.forwarded,
    )


def _media(m: WireMedia, default_kind: str) -> MediaRef:
    return MediaRef(kind=m.kind or default_kind, name=m.name, mime=m.mime, size=m.size)


def decode_event(data: bytes | str, *, channel: str, bot_id: str) -> InboundMessage:
    """Decode one normalized event.  Raises msgspec errors or ValueError when malformed
    (nesting is bounded: a too-deep event is a DecodeError, never a RecursionError)."""
    return from_wire(bounded_decode(_decoder, data), channel=channel, bot_id=bot_id)


def encode_event(msg: InboundMessage) -> bytes:
    """Encode a message to the normalized format (loaders and download handles dropped)."""
    wire_reply: WireReply | None = None
    r = msg.reply_to
    if r is not None:
        wire_reply = WireReply(
            message_id=r.message_id,
            author_id=r.author_id,
            author_name=r.author_name,
            content=r.content,
            attachments=(
                UNSET
                if isinstance(r.attachments, UnsetType)
                else [WireAttachment(kind=a.kind, name=a.name) for a in r.attachments]
            ),
            unavailable_reason=r.unavailable_reason,
            recover_at=r.recover_at if r.recover else UNSET,
        )
    ev = WireEvent(
        message_id=msg.message_id,
        conversation_id=msg.conversation_id,
        sender_id=msg.sender_id,
        conversation_type=msg.conversation_type,
        thread_id=msg.thread_id,
        sender_name=msg.sender_name,
        sender_is_bot=msg.sender_is_bot,
        addressed=msg.addressed,
        content=msg.content,
        images=[WireMedia(kind=m.kind, name=m.name, mime=m.mime, size=m.size) for m in msg.images],
        files=[WireMedia(kind=m.kind, name=m.name, mime=m.mime, size=m.size) for m in msg.files],
        reply_to=wire_reply,
        received_at=msg.received_at,
        conversation_title=msg.conversation_title,
        forwarded=msg.forwarded,
    )
    return _encoder.encode(ev)
