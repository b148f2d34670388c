"""WhatsApp Web events as dshim messages: sans-IO, from neonize's ``Message`` event.

:func:`map_event` takes one event as protobuf JSON (:mod:`.models`) and returns an
:class:`~dshim.model.InboundMessage`, or a :class:`~dshim.model.Skip` saying why not:

- **dropped**: the account's own messages (``IsFromMe``: ``echo``; they are the bot's
  answers or what the owner types on the phone), status broadcasts (``status@broadcast``)
  and newsletters, protocol messages (revokes, key shares, history sync), reactions and
  poll updates (``ignored``), and **edits** (``Info.Edit`` set, ``IsEdit``, an
  ``editedMessage`` or a ``MESSAGE_EDIT`` protocol message): an edit is never a new turn,
  and a prompt already queued keeps the text it was accepted with (the inbox entry is
  durable by then; replacing it would make what the agent answers depend on timing);
- **conversation** = the chat JID (``user@server``), direct or group by ``IsGroup``;
  sender = ``Sender``'s user part, name = ``Pushname``; the time ``Timestamp``, which
  neonize writes as Unix milliseconds (an implausible one is ``malformed``);
- **text** from ``conversation``, ``extendedTextMessage.text`` or the caption of an
  image, video or document (also inside ``ephemeralMessage`` / ``viewOnceMessage*`` /
  ``documentWithCaptionMessage``); images (and stickers) as images, documents, audio,
  voice notes and videos as files, downloaded inside the turn through the engine;
  a location or a shared contact as one short line of text;
- **addressed**: every direct message; in a group a mention of the bot (its phone JID or
  its LID in ``contextInfo.mentionedJID``) or a reply to one of its messages
  (``contextInfo.participant`` is the bot) -- the seed plugin's rule;
- **quotes** (``contextInfo.stanzaID``): ``messageId`` the stanza id, the author the
  ``participant`` (the bot's own id when it is the bot), the content extracted from
  ``quotedMessage`` the same way as an inbound message (text, captions, attachment kinds
  and file names); without ``quotedMessage`` the core recovers it from the message index
  (then ``not-delivered``);
- **forwarded**: ``contextInfo.isForwarded``;
- **route** (what the answer needs to quote the message, recomputed from the stored event
  after a restart): the sender's JID, the message's time and a small snapshot of it
  (:func:`quote_snapshot`) for the reply's ``contextInfo.quotedMessage``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from dshim.channels.kit.decode import decode
from dshim.channels.kit.ids import plausible_time
from dshim.channels.whatsapp_web import models as m
from dshim.model import Attachment, Fetcher, InboundMessage, MediaRef, Mention, ReplyReference, Skip

CHANNEL_KEY = "whatsapp_web"
#: The chat of status updates (stories); never a conversation.
STATUS_BROADCAST = "status@broadcast"
DROPPED_SERVERS = frozenset({"broadcast", "newsletter"})
#: ``protocolMessage.type`` of an edit (``waE2E.ProtocolMessage.Type``).
MESSAGE_EDIT = ("MESSAGE_EDIT", 14)

#: Hands the channel's download for one media field of this event (``imageMessage`` ...)
#: and the size the message declares (``fileLength``; None: not given).
MediaFactory = Callable[[str, int | None], Fetcher | None]


@dataclass(frozen=True, slots=True)
class BotIdentity:
    """The linked account: its phone JID and LID (``user@server``, device left out)."""

    jid: str
    lid: str = ""
    name: str = ""

    @property
    def id(self) -> str:
        return user_of(self.jid)

    def is_me(self, jid: str) -> bool:
        """``jid`` (``user[:device]@server``) names the bot's phone number or its LID."""
        if not jid:
            return False
        user, _, server = jid.partition("@")
        user = user.partition(":")[0]
        for mine in (self.jid, self.lid):
            if mine:
                m_user, _, m_server = mine.partition("@")
                if user == m_user.partition(":")[0] and server == m_server:
                    return True
        return False


def user_of(jid: str) -> str:
    """The user part of ``user[:device]@server``."""
    return jid.partition("@")[0].partition(":")[0]


def chat_of(jid: m.JID) -> str:
    return jid.text


def unwrap(msg: m.WaMessage) -> m.WaMessage:
    """The message inside the ephemeral / view-once / document-with-caption wrappers."""
    for _ in range(4):
        inner = None
        for wrapper in (
            msg.ephemeralMessage,
            msg.viewOnceMessage,
            msg.viewOnceMessageV2,
            msg.viewOnceMessageV2Extension,
            msg.documentWithCaptionMessage,
        ):
            if wrapper is not None and wrapper.message is not None:
                inner = wrapper.message
                break
        if inner is None:
            return msg
        msg = inner
    return msg


#: Media fields in the order they are looked at: (field, kind for the agent, image?).
_MEDIA = (
    ("imageMessage", "image", True),
    ("stickerMessage", "image", True),
    ("videoMessage", "video", False),
    ("audioMessage", "audio", False),
    ("documentMessage", "file", False),
)


def _size(value: str | int) -> int | None:
    try:
        size = int(value)
    except ValueError:
        return None
    return size if size > 0 else None


def _location_text(loc: m.Location) -> str:
    where = ", ".join(p for p in (loc.name, loc.address) if p)
    coords = f"{loc.degreesLatitude:.6f}, {loc.degreesLongitude:.6f}"
    return f"[location: {where} ({coords})]" if where else f"[location: {coords}]"


def _contact_text(names: list[str]) -> str:
    shown = [n for n in names if n] or ["unnamed"]
    return "[contact: " + ", ".join(shown) + "]"


def content_of(msg: m.WaMessage) -> tuple[str, m.ContextInfo | None]:
    """The text of a message (text, a caption, a location or contact line) and the
    ``contextInfo`` that came with it."""
    msg = unwrap(msg)
    if msg.conversation:
        return msg.conversation, None
    if msg.extendedTextMessage is not None:
        return msg.extendedTextMessage.text, msg.extendedTextMessage.contextInfo
    for field, _, _ in _MEDIA:
        media: m.Media | None = getattr(msg, field)
        if media is not None:
            return media.caption, media.contextInfo
    loc = msg.locationMessage or msg.liveLocationMessage
    if loc is not None:
        return _location_text(loc), loc.contextInfo
    if msg.contactMessage is not None:
        return _contact_text([msg.contactMessage.displayName]), msg.contactMessage.contextInfo
    if msg.contactsArrayMessage is not None:
        arr = msg.contactsArrayMessage
        names = [c.displayName for c in arr.contacts] or [arr.displayName]
        return _contact_text(names), arr.contextInfo
    return "", None


def attachments_of(msg: m.WaMessage) -> list[Attachment]:
    """The attachments of a (quoted) message: their kinds and file names."""
    msg = unwrap(msg)
    out = []
    for field, kind, _ in _MEDIA:
        media: m.Media | None = getattr(msg, field)
        if media is not None:
            out.append(Attachment(kind=kind, name=media.fileName or media.title or None))
    return out


def _media(msg: m.WaMessage, factory: MediaFactory | None) -> tuple[list[MediaRef], list[MediaRef]]:
    images: list[MediaRef] = []
    files: list[MediaRef] = []
    for field, kind, image in _MEDIA:
        media: m.Media | None = getattr(msg, field)
        if media is None:
            continue
        size = _size(media.fileLength)
        ref = MediaRef(
            kind="image" if image else kind,
            name=media.fileName or media.title or None,
            mime=media.mimetype or None,
            size=size,
            fetch=factory(field, size) if factory is not None else None,
        )
        (images if image else files).append(ref)
    return images, files


#: The quoted text an answer's ``quotedMessage`` carries at most (the phone shows a few
#: lines of it).
SNAPSHOT_TEXT_MAX = 1024


def quote_snapshot(msg: m.WaMessage) -> dict[str, object]:
    """What an answer quotes of ``msg`` (a ``waE2E.Message`` in protobuf JSON): its text,
    or its media kind with caption and file name -- never a media key, URL or thumbnail."""
    msg = unwrap(msg)
    text, _ = content_of(msg)
    text = text[:SNAPSHOT_TEXT_MAX]
    for field, _, _ in _MEDIA:
        media: m.Media | None = getattr(msg, field)
        if media is not None:
            shown: dict[str, object] = {}
            if media.caption:
                shown["caption"] = media.caption[:SNAPSHOT_TEXT_MAX]
            if media.fileName:
                shown["fileName"] = media.fileName[:256]
            if media.mimetype:
                shown["mimetype"] = media.mimetype[:128]
            return {field: shown}
    return {"conversation": text}


def strip_mention(text: str, me: BotIdentity) -> str:
    """``text`` without the ``@<number>`` (or ``@<lid>``) that mentions the bot."""
    for jid in (me.jid, me.lid):
        user = user_of(jid)
        if user:
            text = re.sub(rf"(?<![\w@])@{re.escape(user)}\b\s?", "", text)
    return text.strip()


def seconds_of(timestamp: str | int) -> float | None:
    """``Info.Timestamp`` (neonize writes whatsmeow's time as Unix *milliseconds*) as
    epoch seconds; None when it is no integer."""
    try:
        return int(timestamp) / 1000.0
    except (TypeError, ValueError):
        return None


def route_of(ev: m.MessageEvent, msg: m.WaMessage, at: float) -> dict[str, object]:
    """The answer's route: who wrote the message (``user@server``), when (epoch seconds,
    as the read receipt wants it), its snapshot."""
    src = ev.Info.MessageSource
    sender = src.Sender if src.Sender.User else src.Chat
    return {
        "participant": f"{sender.User}@{sender.Server}",
        "timestamp": int(at),
        "quoted": quote_snapshot(msg),
    }


def _is_edit(ev: m.MessageEvent, msg: m.WaMessage) -> bool:
    if ev.Info.Edit or ev.IsEdit or msg.editedMessage is not None:
        return True
    return msg.protocolMessage is not None and msg.protocolMessage.type in MESSAGE_EDIT


def _reply(
    ctx: m.ContextInfo, me: BotIdentity, sender: m.JID, pushname: str
) -> ReplyReference | None:
    if not ctx.stanzaID:
        return None
    author = me.id if me.is_me(ctx.participant) else user_of(ctx.participant) or None
    ref = ReplyReference(message_id=ctx.stanzaID, author_id=author)
    if me.is_me(ctx.participant) and me.name:
        ref.author_name = me.name
    elif author is not None and author == sender.User and pushname:
        ref.author_name = pushname  # they quote themselves: their name is known
    quoted = ctx.quotedMessage
    if quoted is None:
        ref.recover = True
        return ref
    text, _ = content_of(quoted)
    ref.content = text or None
    ref.attachments = attachments_of(quoted)
    return ref


def map_event(
    raw: bytes,
    *,
    bot_id: str,
    me: BotIdentity,
    media: MediaFactory | None = None,
) -> InboundMessage | Skip:
    """One neonize ``Message`` event (protobuf JSON) as a message, or why not."""
    try:
        ev = decode(m.event_decoder, raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return Skip(reason="malformed", detail=str(exc)[:200])
    info = ev.Info
    src = info.MessageSource
    mid = info.ID
    if not mid or not src.Chat.User or len(mid) > 256:
        return Skip(reason="malformed", detail="no message id or chat", message_id=mid or None)
    chat = chat_of(src.Chat)
    if src.IsFromMe:
        return Skip(reason="echo", message_id=mid)
    if chat == STATUS_BROADCAST or src.Chat.Server in DROPPED_SERVERS:
        return Skip(reason="ignored", detail="status or newsletter", message_id=mid)
    msg = unwrap(ev.Message)
    if _is_edit(ev, msg):
        return Skip(reason="ignored", detail="edit", message_id=mid)
    if msg.protocolMessage is not None or msg.reactionMessage is not None:
        return Skip(reason="ignored", detail="protocol or reaction", message_id=mid)
    if msg.encReactionMessage is not None or msg.pollUpdateMessage is not None:
        return Skip(reason="ignored", detail="reaction or poll update", message_id=mid)
    received = seconds_of(info.Timestamp)
    if received is None or not plausible_time(received):
        return Skip(reason="malformed", detail="Timestamp: not Unix milliseconds", message_id=mid)
    text, ctx = content_of(msg)
    images, files = _media(msg, media)
    mentioned = bool(ctx and any(me.is_me(j) for j in ctx.mentionedJID))
    if mentioned:
        text = strip_mention(text, me)
    replied_to_bot = bool(ctx and ctx.stanzaID and me.is_me(ctx.participant))
    group = src.IsGroup or src.Chat.Server == "g.us"
    return InboundMessage(
        channel=CHANNEL_KEY,
        bot_id=bot_id,
        message_id=mid,
        conversation_id=chat,
        conversation_type="group" if group else "direct",
        sender_id=src.Sender.User or src.Chat.User,
        sender_name=info.Pushname or None,
        addressed=not group or mentioned or replied_to_bot,
        mentioned=mentioned,
        content=text,
        images=images,
        files=files,
        reply_to=_reply(ctx, me, src.Sender, info.Pushname) if ctx is not None else None,
        received_at=received,
        forwarded=bool(ctx and ctx.isForwarded),
        mentions=[Mention(ids={"id": user_of(j)}) for j in (ctx.mentionedJID if ctx else [])],
        route=route_of(ev, msg, received),
    )
