"""Telegram Bot API, sans-IO: Update -> InboundMessage, error classification, offsets.

Theory of operation
-------------------
Receiving is long polling (core.telegram.org/bots/api#getupdates), run by the kit's
poll loop (:mod:`dshim.channels.kit.poll`).  The bot asks
``getUpdates(offset, timeout=25, limit=100, allowed_updates=["message"])``; the server
answers as soon as updates with ``update_id >= offset`` exist, or with ``[]`` after the
timeout.  Asking with ``offset = last update_id + 1`` *confirms* everything below it:
confirmed updates are never sent again, unconfirmed ones are re-sent on every poll (and
kept by Telegram for 24 hours).  ``update_id`` grows but is not contiguous.

The cursor is the offset, stored as a decimal string.  :class:`UpdateFeed` maps an answer
(each update decoded on its own, see :func:`parse_update`) and gives every update the
offset that confirms it, ``update_id + 1``; the loop moves the cursor there only after
the pipeline accepted the update (dedup key and inbox written) and persists it after the
batch.  A crash before that re-polls the same updates and the pipeline's dedup drops the
copies: nothing accepted is lost and nothing handled runs twice.  The parts of an album
(one update per photo, one ``media_group_id``) are held until the album is complete and
handed over as one message; meanwhile no offset passes them (see :class:`UpdateFeed`),
and the bot re-polls at the album's deadline without waiting.  Failures (the loop's
backoff, 1 s doubling to 30 s with jitter): network errors, timeouts and 5xx; 429 waits
``retry_after``; 409 (another poller owns the token, or a webhook is set) is logged as an
error each time; 401 / 404 (bad token) are fatal: AuthError, the bot stops.

Mapping rules (the platform rule sits next to the line implementing it below): private
chats are direct, groups and supergroups are group chats, channel posts are ignored;
``thread_id`` is the forum topic (``is_topic_message``); entity offsets count UTF-16 code
units; in a forum topic every message "replies" to the topic's root service message,
which is neither a reply nor a quote.  There is no Bot API method that returns a message
by id, so a quoted message is whatever arrives inline (``reply_to_message``, one level,
same chat; ``external_reply`` for other chats, text only via ``quote``), and the bot's own
answers without inline text are recovered by the core (outbound index, then history).  A
forwarded message (``forward_origin``, or the older ``forward_*`` fields) is marked
``forwarded``: its text is content, never the sender's command or answer.  A message sent
on behalf of a chat (an anonymous admin, "sent as" a channel) carries a placeholder bot in
``from`` and the chat in ``sender_chat``: a person wrote it, the chat is its sender.

Nothing here imports trio or httpx or reads a clock: time is an argument.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
from msgspec import UNSET

from dshim.channels.kit import decode as kit_decode
from dshim.channels.kit.ids import (
    MAX_EPOCH_S,
    TOKEN,
    BadId,
    BadTime,
    check_id,
    check_optional_id,
    shape,
)
from dshim.channels.telegram import models as m
from dshim.errors import (
    AuthError,
    ChannelError,
    Conflict,
    NotFound,
    PermissionDenied,
    RateLimited,
    RemoteProtocolError,
    TransportError,
)
from dshim.model import (
    Attachment,
    ConversationType,
    Fetcher,
    InboundMessage,
    MediaRef,
    Mention,
    ReplyReference,
    Skip,
)

CHANNEL = "telegram"
#: sendMessage / editMessageText: 1-4096 characters (UTF-16 code units) after parsing.
MAX_MESSAGE_UTF16 = 4096
POLL_TIMEOUT_S = 25
POLL_LIMIT = 100
ALLOWED_UPDATES = ["message"]
#: dsh-im's token shape: "<numeric bot id>:<secret>".
TOKEN_RE = re.compile(r"^(\d{5,20}):[A-Za-z0-9_-]{20,}$")

# Ids (core.telegram.org/bots/api, kit.ids).  Chat and user ids are integers of "at most
# 52 significant bits" by the docs, signed 64-bit by every client (chats negative for
# groups: -100… for supergroups, and with that prefix past 2**53); message and topic ids
# positive.  Zero, a negative user or message id, or one past 64 signed bits is no
# Telegram id but a corrupt or hostile field (a chat id is what every send goes to).  ``file_id`` (a
# getFile parameter; its ``file_path`` goes into the download URL's path) and
# ``media_group_id`` (an album key) are URL-safe base64 tokens.  A bad one of these makes
# the update a ``malformed`` drop; a bad quoted ``message_id`` only a quote that is
# ``not-found``.
#: The largest magnitude of a chat, user or message id: a signed 64-bit integer.
MAX_INT_ID = 2**63 - 1
TELEGRAM_TOKEN_ID = shape("telegram file", f"[{TOKEN}]+")

#: Builds the download handle of a file: (file_id, declared size) -> fetch(max_bytes).
FetcherFactory = Callable[[str, "int | None"], Fetcher]


class BotIdentity(msgspec.Struct, frozen=True):
    """Who the bot is (from ``getMe``): mentions and replies are judged against it."""

    id: int
    username: str | None = None


def token_bot_id(token: str) -> int | None:
    """The bot id inside a well-formed token, None when the token has the wrong shape."""
    match = TOKEN_RE.match(token)
    return int(match.group(1)) if match else None


# --- text and entities ----------------------------------------------------------------


def utf16_len(text: str) -> int:
    """Length in UTF-16 code units: how Telegram counts message length and offsets."""
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def _span(u16: bytes, entity: m.MessageEntity) -> tuple[int, int] | None:
    """An entity's (start, end) in UTF-16 units; None when out of range or malformed."""
    start, end = entity.offset, entity.offset + entity.length
    if start < 0 or entity.length <= 0 or 2 * end > len(u16):
        return None
    return start, end


def _entity_text(u16: bytes, span: tuple[int, int]) -> str | None:
    try:
        return u16[2 * span[0] : 2 * span[1]].decode("utf-16-le")
    except UnicodeDecodeError:  # the span splits a surrogate pair
        return None


def _addressing(
    text: str, entities: list[m.MessageEntity] | None, me: BotIdentity
) -> tuple[bool, str, list[Mention]]:
    """(addressed by an entity, text with the addressing mentions removed, the other
    people mentioned, in order)."""
    if not entities:
        return False, text, []
    u16 = text.encode("utf-16-le", "surrogatepass")
    username = (me.username or "").lstrip("@")
    handle = f"@{username}".lower() if username else None
    addressed = False
    remove: list[tuple[int, int]] = []
    mentions: list[Mention] = []
    for entity in entities:
        span = _span(u16, entity)
        if span is None:
            continue
        if entity.type == "mention":
            # "@username" in the text; usernames compare case-insensitively.
            word = _entity_text(u16, span)
            if handle is not None and word is not None and word.lower() == handle:
                addressed = True
                remove.append(span)
            elif word is not None and len(word) > 1:
                mentions.append(Mention(ids={"username": word[1:]}, text=word))
        elif entity.type == "text_mention":
            # A mention of a user without a username carries the user.
            if entity.user is not None and entity.user.id == me.id:
                addressed = True
                remove.append(span)
            elif entity.user is not None:
                word = _entity_text(u16, span)
                mentions.append(
                    Mention(ids={"id": str(entity.user.id)}, name=user_name(entity.user), text=word)
                )
        elif entity.type == "bot_command":
            # "/cmd@username" is for this bot; the command text itself stays.
            word = _entity_text(u16, span)
            if handle is not None and word is not None:
                _, at, target = word.partition("@")
                if at and "@" + target.lower() == handle:
                    addressed = True
    if not remove:
        return addressed, text, mentions
    return addressed, _remove_spans(u16, remove), mentions


def _remove_spans(u16: bytes, spans: list[tuple[int, int]]) -> str:
    pieces: list[str] = []
    pos = 0
    for start, end in sorted(set(spans)):
        if start < pos:  # overlapping entities: keep the first
            continue
        pieces.append(u16[2 * pos : 2 * start].decode("utf-16-le", "replace"))
        pos = end
    pieces.append(u16[2 * pos :].decode("utf-16-le", "replace"))
    out = pieces[0]
    for piece in pieces[1:]:
        # "hi @bot there" -> "hi there", not "hi  there".
        if (not out or out[-1].isspace()) and piece[:1] == " ":
            piece = piece[1:]
        out += piece
    return out


# --- people and attachments -------------------------------------------------------------


def user_name(user: m.User) -> str | None:
    """``first_name last_name`` joined by one space, else ``username``."""
    name = " ".join(p for p in (user.first_name, user.last_name) if p)
    return name or user.username or None


def _author(sender_chat: m.Chat | None, user: m.User | None) -> tuple[str | None, str | None]:
    # A message sent on behalf of a chat (anonymous admin, channel) names the chat.
    if sender_chat is not None:
        return str(sender_chat.id), sender_chat.title or sender_chat.username
    if user is not None:
        return str(user.id), user_name(user)
    return None, None


def _origin_author(origin: m.MessageOrigin) -> tuple[str | None, str | None]:
    if origin.type == "user" and origin.sender_user is not None:
        return str(origin.sender_user.id), user_name(origin.sender_user)
    if origin.type == "hidden_user":
        return None, origin.sender_user_name
    if origin.type == "chat" and origin.sender_chat is not None:
        return str(origin.sender_chat.id), origin.sender_chat.title
    if origin.type == "channel" and origin.chat is not None:
        return str(origin.chat.id), origin.chat.title or origin.chat.username
    return None, None


def _largest(photo: list[m.PhotoSize]) -> m.PhotoSize:
    return max(photo, key=lambda p: (p.width * p.height, p.file_size or 0))


def _is_image(f: m.FileView) -> bool:
    return (f.mime_type or "").lower().startswith("image/")


def _quoted_attachments(msg: m._Media) -> list[Attachment]:
    out: list[Attachment] = []
    if msg.photo:
        out.append(Attachment(kind="image"))
    # An animation also arrives as a document (backward compatibility): count it once.
    if msg.document is not None and msg.animation is None:
        kind = "image" if _is_image(msg.document) else "file"
        out.append(Attachment(kind=kind, name=msg.document.file_name))
    if msg.audio is not None:
        out.append(Attachment(kind="audio", name=msg.audio.file_name))
    if msg.voice is not None:
        out.append(Attachment(kind="audio"))
    if msg.video is not None:
        out.append(Attachment(kind="video", name=msg.video.file_name))
    if msg.video_note is not None:
        out.append(Attachment(kind="video"))
    if msg.animation is not None:
        out.append(Attachment(kind="video", name=msg.animation.file_name))
    if msg.sticker is not None:
        out.append(Attachment(kind="image"))
    return out


def _media_ref(
    kind: str, f: m.FileView, fetcher: FetcherFactory | None, *, name: str | None = None
) -> MediaRef:
    return MediaRef(
        kind=kind,
        name=name if name is not None else f.file_name,
        mime=f.mime_type,
        size=f.file_size,
        fetch=fetcher(f.file_id, f.file_size) if fetcher is not None else None,
    )


def _current_media(
    msg: m.Message, fetcher: FetcherFactory | None
) -> tuple[list[MediaRef], list[MediaRef]]:
    images: list[MediaRef] = []
    files: list[MediaRef] = []
    if msg.photo:
        best = _largest(msg.photo)  # sizes of one photo; the largest is the original
        images.append(
            MediaRef(
                kind="image",
                size=best.file_size,
                fetch=fetcher(best.file_id, best.file_size) if fetcher is not None else None,
            )
        )
    if msg.document is not None:
        if _is_image(msg.document):
            images.append(_media_ref("image", msg.document, fetcher))
        else:
            files.append(_media_ref("file", msg.document, fetcher))
    if msg.audio is not None:
        files.append(_media_ref("audio", msg.audio, fetcher))
    if msg.voice is not None:
        files.append(_media_ref("audio", msg.voice, fetcher))
    if msg.video is not None:
        files.append(_media_ref("video", msg.video, fetcher))
    return images, files


# --- replies ------------------------------------------------------------------------------


def _is_topic_root(msg: m.Message, replied: m.RepliedMessage) -> bool:
    # In a forum topic, reply_to_message is the topic's root (forum_topic_created) service
    # message whose id is the topic id: that is where the message was typed, not a reply.
    if replied.forum_topic_created is not None:
        return True
    return (
        msg.is_topic_message
        and msg.message_thread_id is not None
        and replied.message_id == msg.message_thread_id
    )


def _reply_reference(msg: m.Message, me: BotIdentity) -> ReplyReference | None:
    quote = msg.quote.text if msg.quote is not None and msg.quote.text else None
    replied = msg.reply_to_message
    if replied is not None and not _is_topic_root(msg, replied):
        if not _valid_int(replied.message_id):
            return ReplyReference(unavailable_reason="not-found")  # never recovered
        # Same chat, one level: text or caption, else the user's quote of it.
        author_id, author_name = _author(replied.sender_chat, replied.from_)
        content = replied.text or replied.caption or quote
        attachments = _quoted_attachments(replied)
        ref = ReplyReference(
            message_id=str(replied.message_id),
            author_id=author_id if author_id is not None else UNSET,
            author_name=author_name if author_name is not None else UNSET,
            content=content if content else UNSET,
            attachments=attachments,
        )
        own = (
            replied.from_ is not None and replied.from_.id == me.id and replied.sender_chat is None
        )
        if own and not content and not attachments:
            # The bot's own answer arrived without text (e.g. a long message Telegram did
            # not inline): the core recovers it by id, by date, then from history.
            ref.recover = True
            ref.recover_at = float(replied.date) if replied.date else None
        return ref
    if msg.external_reply is not None:
        # Another chat or topic: no text field, only the user's quote and the media.
        ext = msg.external_reply
        author_id, author_name = _origin_author(ext.origin)
        message_id = ext.message_id if ext.message_id is not None else ext.origin.message_id
        if message_id is not None and not _valid_int(message_id):
            return ReplyReference(unavailable_reason="not-found")
        return ReplyReference(
            message_id=str(message_id) if message_id is not None else UNSET,
            author_id=author_id if author_id is not None else UNSET,
            author_name=author_name if author_name is not None else UNSET,
            content=quote if quote else UNSET,
            attachments=_quoted_attachments(ext),
        )
    if msg.reply_to_story is not None:
        return ReplyReference(unavailable_reason="unsupported", attachments=[])
    return None


def _is_forward(msg: m.Message) -> bool:
    # forward_origin since Bot API 7.0; forward_date and friends before it (some
    # servers still send both).  Forwarded text is content, never the sender's command.
    return (
        msg.forward_origin is not None
        or msg.forward_date is not None
        or msg.forward_from is not None
        or msg.forward_from_chat is not None
        or msg.forward_sender_name is not None
    )


# --- ids and times (kit.ids) ----------------------------------------------------------------


def _valid_int(value: int | None, *, signed: bool = False) -> bool:
    """A Telegram integer id: non-zero, at most :data:`MAX_INT_ID` in magnitude, positive
    unless ``signed`` (chat ids)."""
    if not isinstance(value, int) or isinstance(value, bool) or value == 0:
        return False
    return -MAX_INT_ID <= value <= MAX_INT_ID if signed else 0 < value <= MAX_INT_ID


def _check_int(value: int | None, field: str, *, signed: bool = False) -> None:
    # Never the value in the message: it may be 70,000 digits.
    if value is not None and not _valid_int(value, signed=signed):
        raise BadId(f"{field}: not a Telegram id")


def _check_files(msg: m._Media, where: str) -> None:
    for size in msg.photo or ():
        check_id(size.file_id, TELEGRAM_TOKEN_ID, f"{where}photo file_id")
    for name in ("document", "audio", "voice", "video", "video_note", "animation", "sticker"):
        f: m.FileView | None = getattr(msg, name)
        if f is not None:
            check_id(f.file_id, TELEGRAM_TOKEN_ID, f"{where}{name} file_id")


def check_ids(msg: m.Message) -> None:
    """Raise :class:`~dshim.channels.kit.ids.BadId` / ``BadTime`` when an id the message
    is answered, keyed or fetched by -- chat, sender, message, topic, album, files, a
    migration target -- or its ``date`` is no Telegram value.  The quoted message's id is
    not checked here (a bad one only loses the quote, :func:`_reply_reference`); the
    quoted message's files are never fetched."""
    _check_int(msg.message_id, "message_id")
    _check_int(msg.chat.id, "chat id", signed=True)
    if msg.from_ is not None:
        _check_int(msg.from_.id, "from id")
    if msg.sender_chat is not None:
        _check_int(msg.sender_chat.id, "sender_chat id", signed=True)
    _check_int(msg.message_thread_id, "message_thread_id")
    _check_int(msg.migrate_to_chat_id, "migrate_to_chat_id", signed=True)
    _check_int(msg.migrate_from_chat_id, "migrate_from_chat_id", signed=True)
    check_optional_id(msg.media_group_id, TELEGRAM_TOKEN_ID, "media_group_id")
    _check_files(msg, "")
    if not 0 <= msg.date <= MAX_EPOCH_S:  # an int: no float conversion of 70,000 digits
        raise BadTime("date: not a plausible time")


# --- the mapping ----------------------------------------------------------------------------


def map_message(
    msg: m.Message, me: BotIdentity, *, fetcher: FetcherFactory | None = None
) -> InboundMessage | Skip:
    """Map one ``message`` to the normalized message (or a Skip with the reason).

    An id or time of another shape (:func:`check_ids`) is a ``malformed`` Skip."""
    try:
        check_ids(msg)
    except (BadId, BadTime) as exc:
        return Skip(reason="malformed", detail=str(exc))
    chat = msg.chat
    mid = str(msg.message_id)
    conversation_type: ConversationType
    if chat.type == "private":
        conversation_type = "direct"
    elif chat.type in ("group", "supergroup"):
        conversation_type = "group"
    else:  # channel posts and anything newer
        return Skip(reason="ignored", detail=f"chat type {chat.type}", message_id=mid)
    if msg.migrate_to_chat_id is not None or msg.migrate_from_chat_id is not None:
        return Skip(reason="ignored", detail="group migrated to a supergroup", message_id=mid)
    sender = msg.from_
    if sender is None:
        return Skip(reason="ignored", detail="message without a sender", message_id=mid)
    if msg.sender_chat is not None:
        # Sent on behalf of a chat (an anonymous group admin, a channel): ``from`` is a
        # placeholder bot (GroupAnonymousBot, Channel_Bot), but a person wrote it.  The
        # chat is the sender.
        sender_id = str(msg.sender_chat.id)
        sender_name = msg.sender_chat.title or msg.sender_chat.username
        sender_is_bot = False
    else:
        sender_id, sender_name, sender_is_bot = str(sender.id), user_name(sender), sender.is_bot
    text, entities = (
        (msg.text, msg.entities)
        if msg.text is not None
        else (msg.caption or "", msg.caption_entities)
    )
    by_entity, content, mentions = _addressing(text, entities, me)
    forwarded = _is_forward(msg)
    replied = msg.reply_to_message
    by_reply = (
        replied is not None
        and replied.from_ is not None
        and replied.from_.id == me.id
        and not _is_topic_root(msg, replied)
    )
    images, files = _current_media(msg, fetcher)
    reply_to = _reply_reference(msg, me)
    content = content.strip()
    if not content and not images and not files and reply_to is None:
        # Service messages (members joined, pins, topic created ...) and unsupported
        # content (stickers, polls, locations): nothing to answer.
        return Skip(reason="ignored", detail="no text or supported media", message_id=mid)
    thread_id = (
        str(msg.message_thread_id)
        if msg.is_topic_message and msg.message_thread_id is not None
        else None
    )
    return InboundMessage(
        channel=CHANNEL,
        bot_id=str(me.id),
        message_id=mid,
        conversation_id=str(chat.id),
        conversation_type=conversation_type,
        thread_id=thread_id,
        sender_id=sender_id,
        sender_name=sender_name,
        sender_is_bot=sender_is_bot,
        addressed=conversation_type == "direct" or by_entity or by_reply,
        content=content,
        images=images,
        files=files,
        reply_to=reply_to,
        received_at=float(msg.date),
        conversation_title=chat.title,
        forwarded=forwarded,
        # Someone else's words: their mentions trigger nothing here.
        mentions=[] if forwarded else mentions,
        mentioned=by_entity,
    )


class ParsedUpdate(msgspec.Struct, frozen=True):
    """One raw update, read once: its id, what the pipeline gets, and a chat migration."""

    update_id: int | None
    item: InboundMessage | Skip
    #: (old chat id, new chat id) when a group became a supergroup.
    migration: tuple[int, int] | None = None
    #: (chat id, media_group_id) when the message is one part of an album.
    album: tuple[int, str] | None = None


def _decode(raw: bytes) -> m.Update:
    """One Update, nesting bounded (``kit.decode``: 64 levels, far below the interpreter's
    limit and far above any real update).  Raises msgspec.DecodeError / ValidationError."""
    return kit_decode.decode(m.UPDATE_DECODER, raw)


def parse_update(
    raw: bytes, me: BotIdentity, *, fetcher: FetcherFactory | None = None
) -> ParsedUpdate:
    """Decode and map one Update as getUpdates returns it.  Never raises for bad input.

    Each update is decoded on its own (see :func:`decode_updates`): a lone surrogate
    escape, invalid UTF-8 or nesting 1,000 levels deep makes *this* update a
    ``malformed`` Skip, with its id read without decoding it, so it is confirmed.
    """
    try:
        update = _decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        skip = Skip(reason="malformed", detail=f"update does not decode: {exc}")
        return ParsedUpdate(update_id_of(raw), skip)
    msg = update.message
    if msg is None:  # edited messages, member updates ...: not asked for, not answered
        return ParsedUpdate(update.update_id, Skip(reason="ignored", detail="not a message update"))
    migration = None
    if msg.migrate_to_chat_id is not None:
        migration = (msg.chat.id, msg.migrate_to_chat_id)
    elif msg.migrate_from_chat_id is not None:
        migration = (msg.migrate_from_chat_id, msg.chat.id)
    item = map_message(msg, me, fetcher=fetcher)
    if isinstance(item, Skip) and item.reason == "malformed":
        return ParsedUpdate(update.update_id, item)  # no migration, no album of bad ids
    album = None
    if msg.media_group_id is not None and isinstance(item, InboundMessage):
        album = (msg.chat.id, msg.media_group_id)
    return ParsedUpdate(update.update_id, item, migration, album)


def decode_update(
    raw: bytes, me: BotIdentity, *, fetcher: FetcherFactory | None = None
) -> InboundMessage | Skip:
    """Decode and map one raw Update (replay, and the inbox after a restart).

    A JSON array is a collected album, as :class:`UpdateFeed` stores it: its parts are
    combined again (:func:`combine_album`).
    """
    if raw[:1] == b"[" or raw.lstrip()[:1] == b"[":
        try:
            raws = kit_decode.split_array(raw)
        except ValueError as exc:
            return Skip(reason="malformed", detail=f"album does not decode: {exc}")
        parts = [parse_update(r, me, fetcher=fetcher).item for r in raws]
        messages = [p for p in parts if isinstance(p, InboundMessage)]
        if not messages:
            return Skip(reason="malformed", detail="album without a readable part")
        return combine_album(messages)
    return parse_update(raw, me, fetcher=fetcher).item


def update_id_of(raw: bytes) -> int | None:
    """The ``update_id`` of an update that does not decode, read without decoding it."""
    value = kit_decode.member(raw, "update_id")
    if value is None or not value.isdigit() or len(value) > 20:
        return None
    return int(value)


def decode_updates(method: str, status: int, body: bytes) -> list[bytes]:
    """getUpdates' answer: the raw bytes of each update, in order, none decoded yet.

    The fast path decodes the envelope (``result`` as raw elements); when that fails —
    one update with a lone surrogate or absurd nesting makes the whole answer
    undecodable — the answer is split without decoding (``kit.decode.member`` and
    ``split_array``), so every other update still runs and the bad one is dropped alone
    (:func:`parse_update`).  Error answers are classified as for every method.
    """
    try:
        env = m.ENVELOPE_DECODER.decode(body)
        raws = m.RAW_LIST_DECODER.decode(env.result) if env.ok and status < 400 else None
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return _split_updates(method, status, body)
    if raws is None:
        raise api_error(method, status, env)
    return [bytes(raw) for raw in raws]


def _split_updates(method: str, status: int, body: bytes) -> list[bytes]:
    if status >= 400 or kit_decode.member(body, "ok") != b"true":
        decode_envelope(method, status, body)  # raises the classified error
        raise RemoteProtocolError(f"{method}: the response is not a Bot API envelope")
    result = kit_decode.member(body, "result")
    if result is None:
        raise RemoteProtocolError(f"{method}: the response has no result")
    try:
        return kit_decode.split_array(result)
    except ValueError as exc:
        raise RemoteProtocolError(f"{method}: unexpected result: {exc}") from None


# --- errors ----------------------------------------------------------------------------------


class NotModified(ChannelError):
    """An edit that changes nothing: callers treat it as success."""


class ThreadNotFound(NotFound):
    """The forum topic a message was sent into is gone (deleted or never existed)."""


class ChatMigrated(ChannelError):
    """The group became a supergroup: resend to ``migrate_to_chat_id``."""

    def __init__(self, message: str, *, migrate_to_chat_id: int, status: int | None = 400):
        super().__init__(message, status=status)
        self.migrate_to_chat_id = migrate_to_chat_id


def api_error(
    method: str,
    status: int,
    envelope: m.Envelope | None,
    *,
    body_hint: str = "",
    file: bool = False,
) -> ChannelError:
    """Classify a failed Bot API call (HTTP status + ``description`` + ``parameters``).

    ``file`` marks getFile: there a 400 ("file is too big", "wrong file_id", "invalid
    file_id") or a 404 (the file is gone or too old) means the file is unavailable — the
    token already worked for getMe — so it is NotFound, never AuthError.  The messages
    name the method, never the URL (the token is in its path).
    """
    desc = (envelope.description if envelope is not None else None) or body_hint or f"HTTP {status}"
    code = envelope.error_code if envelope is not None and envelope.error_code else status
    params = envelope.parameters if envelope is not None else None
    text = f"{method}: {desc}"
    lowered = desc.lower()
    if (params is not None and params.retry_after is not None) or code == 429:
        retry = params.retry_after if params is not None and params.retry_after else 1.0
        return RateLimited(text, retry_after=float(retry), status=status, code=code)
    if params is not None and params.migrate_to_chat_id is not None:
        return ChatMigrated(text, migrate_to_chat_id=params.migrate_to_chat_id, status=status)
    if code == 401 or status == 401:
        return AuthError(f"{text} (the bot token was rejected)", status=status, code=code)
    if file and (code in (400, 404) or status in (400, 404)):
        return NotFound(f"{method}: the file is unavailable ({desc})", status=status, code=code)
    if code == 404 or status == 404:
        # A method URL that does not exist: the token is malformed.
        return AuthError(f"{text} (the bot token is not valid)", status=status, code=code)
    if code == 409 or status == 409:
        return Conflict(
            f"{text} (another process is polling this bot, or a webhook is set: run one "
            "dshim per bot token and delete the webhook)",
            status=status,
            code=code,
        )
    if code == 403 or status == 403:
        return PermissionDenied(text, status=status, code=code)
    if status >= 500 or code >= 500:
        return TransportError(text, status=status, code=code)
    if "message is not modified" in lowered:
        return NotModified(text, status=status, code=code)
    if "can't be edited" in lowered or "not enough rights" in lowered:
        return PermissionDenied(text, status=status, code=code)
    if "message thread not found" in lowered:
        return ThreadNotFound(text, status=status, code=code)
    if "not found" in lowered:
        # message to edit / to be replied / chat not found
        return NotFound(text, status=status, code=code)
    return ChannelError(text, status=status, code=code)


def decode_envelope(method: str, status: int, body: bytes, *, file: bool = False) -> m.Envelope:
    """Decode the ``{ok, result | error_code, description, parameters}`` envelope.

    Raises the classified error for ``ok: false`` (or a non-JSON error body); ``file``
    as for :func:`api_error`.
    """
    try:
        env = m.ENVELOPE_DECODER.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        if status >= 500 or status == 429:
            raise api_error(method, status, None, file=file) from None
        if status >= 400:
            raise api_error(method, status, None, body_hint=f"HTTP {status}", file=file) from None
        raise RemoteProtocolError(
            f"{method}: the response is not a Bot API envelope", status=status
        ) from None
    if not env.ok or status >= 400:
        raise api_error(method, status, env, file=file)
    return env


def decode_result(method: str, env: m.Envelope, decoder: msgspec.json.Decoder[Any]) -> Any:
    """Decode ``result`` with a per-method decoder; a mismatch is a protocol error."""
    if not env.result:
        raise RemoteProtocolError(f"{method}: the response has no result")
    try:
        return decoder.decode(env.result)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"{method}: unexpected result: {exc}") from None


# --- albums ---------------------------------------------------------------------------------


class AlbumLimits(NamedTuple):
    """How albums are collected."""

    #: An album is collected until this long after its last part arrived ...
    quiet_s: float = 1.0
    #: ... but never longer than this after its first part ...
    max_s: float = 5.0
    #: ... nor beyond Telegram's own limit of parts per album.
    max_parts: int = 10
    #: Albums collected at once (beyond it, the oldest is handed over as it is).
    max_open: int = 32


ALBUM_LIMITS = AlbumLimits()


def combine_album(parts: list[InboundMessage]) -> InboundMessage:
    """One message for an album's parts (in order): every image and file, the caption of
    whichever part carries one, addressed when any part is (a mention in the caption)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    texts = [p.content for p in parts if p.content]
    return msgspec.structs.replace(
        first,
        content="\n\n".join(texts),
        images=[ref for p in parts for ref in p.images],
        files=[ref for p in parts for ref in p.files],
        addressed=any(p.addressed for p in parts),
        reply_to=next((p.reply_to for p in parts if p.reply_to is not None), None),
        forwarded=any(p.forwarded for p in parts),
        mentions=[mention for p in parts for mention in p.mentions],
        mentioned=any(p.mentioned for p in parts),
    )


class _Album:
    """An album being collected: its parts (update_id, message, raw) and their times."""

    __slots__ = ("parts", "first_at", "last_at")

    def __init__(self, now: float) -> None:
        self.parts: list[tuple[int, InboundMessage, bytes]] = []
        self.first_at = now
        self.last_at = now

    def due_at(self, limits: AlbumLimits) -> float:
        return min(self.last_at + limits.quiet_s, self.first_at + limits.max_s)


class Collected(NamedTuple):
    """A collected album, handed over: one message for all its parts."""

    #: The first part's update_id.
    update_id: int
    item: InboundMessage
    #: The part's raw update, or (several parts) the JSON array of their raws, which
    #: :func:`decode_update` reads back into the same message.
    raw: bytes


class AlbumCollector:
    """Collects the parts of albums (per chat and ``media_group_id``) until each is
    complete (see :class:`AlbumLimits`), then hands it over as *one* message
    (:func:`combine_album`).  The one collection both ``serve`` (:class:`UpdateFeed`)
    and ``dshim replay`` run; time is the caller's (``now``, any monotonic clock)."""

    def __init__(self, limits: AlbumLimits = ALBUM_LIMITS) -> None:
        self.limits = limits
        #: Albums being collected, oldest first.
        self._albums: dict[tuple[int, str], _Album] = {}

    @property
    def holding(self) -> bool:
        """True while album parts are held."""
        return bool(self._albums)

    def due_at(self) -> float | None:
        """When the next held album is complete (None: nothing held)."""
        if not self._albums:
            return None
        return min(a.due_at(self.limits) for a in self._albums.values())

    def first_held(self) -> int | None:
        """The lowest update_id held (None: nothing held)."""
        if not self._albums:
            return None
        return min(a.parts[0][0] for a in self._albums.values())

    def add(
        self, key: tuple[int, str], uid: int, item: InboundMessage, raw: bytes, now: float
    ) -> list[Collected]:
        """Hold one part; the albums this completes (Telegram's parts limit) or pushes out
        (too many open at once: the oldest goes as it is)."""
        album = self._albums.get(key)
        if album is None:
            album = self._albums[key] = _Album(now)
        album.parts.append((uid, item, raw))
        album.last_at = now
        if len(album.parts) >= self.limits.max_parts:
            return [self._hand_over(key)]
        if len(self._albums) > self.limits.max_open:
            return [self._hand_over(next(iter(self._albums)))]
        return []

    def next_due(self, now: float) -> Collected | None:
        """Hand over the oldest album complete at ``now`` (None: none is)."""
        for key, album in self._albums.items():
            if now >= album.due_at(self.limits):
                return self._hand_over(key)
        return None

    def due(self, now: float) -> list[Collected]:
        """Hand over every album complete at ``now``, oldest first."""
        out: list[Collected] = []
        while (album := self.next_due(now)) is not None:
            out.append(album)
        return out

    def _hand_over(self, key: tuple[int, str]) -> Collected:
        parts = self._albums.pop(key).parts
        item = combine_album([p[1] for p in parts])
        raw = parts[0][2] if len(parts) == 1 else b"[" + b",".join(p[2] for p in parts) + b"]"
        return Collected(parts[0][0], item, raw)


# --- polling -------------------------------------------------------------------------------


def parse_offset(cursor: str | None) -> int | None:
    """The stored cursor as an offset (None: nothing confirmed yet, or unreadable)."""
    if cursor is None:
        return None
    cursor = cursor.strip()
    if not cursor or not cursor.lstrip("-").isdigit():
        return None
    return int(cursor)


def poll_params(
    offset: int | None, *, timeout_s: int = POLL_TIMEOUT_S, limit: int = POLL_LIMIT
) -> dict[str, Any]:
    """The getUpdates parameters of a (long) poll from ``offset``."""
    params: dict[str, Any] = {
        "timeout": timeout_s,
        "limit": limit,
        "allowed_updates": ALLOWED_UPDATES,
    }
    if offset is not None:
        params["offset"] = offset
    return params


class Ready(NamedTuple):
    """One update ready for the pipeline, with the offset that confirms it."""

    parsed: ParsedUpdate
    raw: bytes
    #: ``update_id + 1``: asking from it confirms this update and every earlier one
    #: (None when the update's id could not be read).
    offset: int | None


class UpdateFeed:
    """Which updates of a getUpdates answer are new, which offset confirms each, and the
    albums being collected.

    ``offset`` is what the bot asked from: updates below it are already confirmed (an
    answer never holds them, but a feed never trusts that).  ``update_id`` grows but is
    not contiguous, so the offset confirming an update is ``update_id + 1``.

    Albums: Telegram delivers each photo of an album as its own update, all with one
    ``media_group_id``, the caption on one of them.  The feed holds the parts of an album
    (:class:`AlbumCollector`: per chat and media_group_id) until about a second after its
    last part arrived (bounded in time and parts, see :class:`AlbumLimits`), then hands
    over *one* message
    (:func:`combine_album`) whose raw is the JSON array of the parts' raws (the durable
    inbox keeps it; :func:`decode_update` reads it back).  While parts are held, no
    offset passes the first of them: other updates are handed over meanwhile, but the
    offset they carry stops below the album, so nothing of it is confirmed before the
    combined message was accepted; after a crash Telegram sends the parts again.

    While an album is held the bot re-polls from below it, so Telegram answers again with
    updates this feed already handed over or holds: they are recognised by id (at or
    below the highest seen in this run) and skipped.  Time is the caller's (``now``).
    """

    def __init__(
        self,
        me: BotIdentity,
        *,
        fetcher: FetcherFactory | None = None,
        albums: AlbumLimits = ALBUM_LIMITS,
    ) -> None:
        self.me = me
        self.fetcher = fetcher
        #: The album collection (the same one ``dshim replay`` runs).
        self.albums = AlbumCollector(albums)
        #: The highest update_id handed over or held in this run.
        self._seen: int | None = None

    @property
    def holding(self) -> bool:
        """True while album parts are held (the offset must not pass them)."""
        return self.albums.holding

    def due_at(self) -> float | None:
        """When the next held album is complete (None: nothing held)."""
        return self.albums.due_at()

    def take(self, raws: list[bytes], offset: int | None, *, now: float = 0.0) -> list[Ready]:
        """Map an answer's updates, in order; drop the ones below ``offset`` or already
        seen; collect album parts; hand over the albums complete at ``now``."""
        out: list[Ready] = []
        for raw in raws:
            parsed = parse_update(raw, self.me, fetcher=self.fetcher)
            uid = parsed.update_id
            if uid is None:
                out.append(Ready(parsed, raw, None))
                continue
            if (offset is not None and uid < offset) or (
                self._seen is not None and uid <= self._seen
            ):
                continue
            self._seen = uid
            if parsed.album is not None and isinstance(parsed.item, InboundMessage):
                # Held first, so the offset handed over with an album pushed out stops
                # below this part.
                self._hand_over(self.albums.add(parsed.album, uid, parsed.item, raw, now), out)
                continue
            out.append(Ready(parsed, raw, self._confirming()))
        # One at a time: each offset stops below the albums still held after it.
        while (album := self.albums.next_due(now)) is not None:
            self._hand_over([album], out)
        return out

    def _hand_over(self, collected: list[Collected], out: list[Ready]) -> None:
        for album in collected:
            parsed = ParsedUpdate(album.update_id, album.item)
            out.append(Ready(parsed, album.raw, self._confirming()))

    def _confirming(self) -> int | None:
        """The offset that confirms everything handed over so far and nothing held:
        just above the highest update seen, or the first held part of an album."""
        if self._seen is None:
            return None
        offset = self._seen + 1
        held = self.albums.first_held()
        return offset if held is None else min(offset, held)
