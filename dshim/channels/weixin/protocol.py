"""WeChat iLink bot API, sans-IO: WeixinMessage -> InboundMessage, quotes, ids, errors.

Theory of operation
-------------------
There is no public Tencent reference; the wire facts come from the official OpenClaw
plugin (Tencent/openclaw-weixin ``src/api/types.ts``, ``api.ts``, ``monitor.ts``,
``inbound.ts``), see /work/shared/protocols/weixin.md.

Lifecycle: a QR login (``get_bot_qrcode``, then ``get_qrcode_status`` long-polled, see
:func:`login_step`) gives a ``bot_token``, the bot's ``ilink_bot_id`` and the API
``baseurl``.  The bot then announces itself (``msg/notifystart``: the first call that
proves the token, so ``run`` reports started after it) and long-polls ``getupdates``
with the opaque cursor ``get_updates_buf`` until it stops (``msg/notifystop``).  There
is no websocket, no heartbeat and no ack: asking with a cursor is the only
acknowledgement, so the cursor is stored only after the pipeline accepted every message
of the batch (the kit's poll loop) and a crash re-delivers what followed the stored one.
The server holds a poll up to ``longpolling_timeout_ms`` (default 35 s, adopted when it
suggests another value); the client's read timeout stays 10 s above it and a client
timeout is an empty batch.  A response replaces the cursor only when it carries a
non-empty one.

Guarantees: at-least-once.  The plugin's fork saw replays ~1 s apart and redeliveries
30-50 minutes later: dedup is by ``message_id`` (as a decimal string), else
``client_id``, else ``seq``, else the items' ``msg_id`` s, persisted by the pipeline for
``dedup_ttl_s`` (48 h).  ``message_type`` 2 is the bot's own message (an echo).

Errors: every answer is ``{ret, errcode?, errmsg?}`` on HTTP 200; ``ret``/``errcode``
``-14`` is an expired session (the token is dead: a fatal :class:`SessionExpired`, the
user logs in again), ``-2`` is "no valid context token / too many replies / slow down"
(:class:`ReplyRefused`), anything else non-zero is a :class:`~dshim.errors.ChannelError`.

Identity: direct chats only (the plugin hard-codes "direct"); a message with a
``group_id`` is mapped as an unaddressed group message.  Users are ``...@im.wechat``,
the bot ``...@im.bot``.  Sending needs the latest ``context_token`` the user's messages
carried (:class:`ContextToken`, newer ``seq``/time wins).  A message's token travels in
its :class:`Route`: the channel keeps it only once the pipeline took the message — a
stale, duplicate or denied one may carry a higher ``seq`` and a token iLink refuses.

Quotes: the first item of any type with ``ref_msg``.  The quoted content is read by
field shape (``text_item.text``, ``voice_item.text``, media items), never by ``type``:
iLink often sends a content-less shell (``type`` 8 for the bot's answers, since mid-2026
``type`` 0 with only an id for any quote).  Such a shell goes to recovery: the message
index by ``svr_id``/``msg_id``, by time (the item's times and the time in a 64-bit id,
:func:`id_time_ms`), then the session history (:class:`QuoteLookup`).

Nothing here imports trio or httpx or reads a clock: time is an argument.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import msgspec

from dshim.channels.kit import decode as kit_decode
from dshim.channels.kit.ids import (
    MAX_EPOCH_S,
    TOKEN,
    BadId,
    BadTime,
    check_id,
    check_optional_id,
    shape,
    valid_id,
)
from dshim.channels.weixin import models as m
from dshim.errors import AuthError, ChannelError, RemoteProtocolError
from dshim.model import (
    Attachment,
    Fetcher,
    InboundMessage,
    Loader,
    MediaRef,
    ReplyReference,
    Skip,
)

CHANNEL = "weixin"
DEFAULT_API_BASE = "https://ilinkai.weixin.qq.com"
DEFAULT_CDN_BASE = "https://novac2c.cdn.weixin.qq.com/c2c"
#: The server's long-poll window unless it suggests another (``longpolling_timeout_ms``).
POLL_WINDOW_S = 35.0
#: Suggested windows outside this range are not adopted.
POLL_WINDOW_RANGE_S = (1.0, 120.0)
#: ``message_type``: 1 a user's message, 2 the bot's own.
MESSAGE_TYPE_BOT = 2
#: Item types dshim knows (8 and 0 are the content-less quote shells).
KNOWN_ITEM_TYPES = frozenset({0, 1, 2, 3, 4, 5, 8})
ITEM_TEXT, ITEM_IMAGE, ITEM_VOICE, ITEM_FILE, ITEM_VIDEO = 1, 2, 3, 4, 5
#: iLink error codes.
SESSION_EXPIRED = -14
REPLY_REFUSED = -2
#: 64-bit message ids whose upper bits are a millisecond time (heuristic, dsh-im).
ID_DIGITS = (16, 20)
ID_TIME_MIN_MS = 1_577_836_800_000  # 2020-01-01T00:00:00Z
ID_TIME_FUTURE_MS = 24 * 3600 * 1000
MAX_SAFE_INTEGER = 2**53 - 1
#: Latest context tokens kept per bot (the seed's bound).
CONTEXT_USERS_MAX = 1000

#: ``voice_item.encode_type`` -> file extension (1 pcm, 2 adpcm, 3 feature, 4 speex, 5 amr,
#: 6 silk, 7 mp3, 8 ogg-speex).
VOICE_EXTENSIONS = {1: "pcm", 2: "adpcm", 4: "speex", 5: "amr", 6: "silk", 7: "mp3", 8: "ogg"}

_HEX32 = re.compile(r"^[0-9a-fA-F]{32}$")


# --- errors -------------------------------------------------------------------------------


class SessionExpired(AuthError):
    """``-14``: the bot token is dead; only a new QR login helps."""


class ReplyRefused(ChannelError):
    """``-2`` on a send: no valid context token, the per-message reply cap, or a rate
    limit; one retry after a pause, then the user has to write again."""


def api_error(what: str, env: m.Envelope) -> ChannelError | None:
    """The error an answer's ``ret``/``errcode`` stands for (None: success)."""
    code = env.ret if env.ret not in (None, 0) else env.errcode
    if code in (None, 0):
        return None
    detail = (env.errmsg or "").strip()[:200]
    text = f"{what}: ret {code}" + (f" ({detail})" if detail else "")
    if code == SESSION_EXPIRED:
        return SessionExpired(f"{what}: the WeChat session expired (ret -14)", code=code)
    if code == REPLY_REFUSED:
        return ReplyRefused(text, code=code)
    return ChannelError(text, code=code)


E = TypeVar("E", bound=m.Envelope)


def decode_envelope(what: str, body: bytes, decoder: msgspec.json.Decoder[E]) -> E:
    """Decode an HTTP 200 answer and raise what its ``ret`` says.  An empty body is a
    success (``sendmessage`` sometimes answers with nothing)."""
    if not body.strip():
        return decoder.decode(b"{}")
    try:
        env = kit_decode.decode(decoder, body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"{what}: undecodable answer ({exc})") from None
    err = api_error(what, env)
    if err is not None:
        raise err
    return env


# --- getupdates --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class UpdateBatch:
    """One ``getupdates`` answer: each message's raw bytes, the next cursor, the window."""

    raws: list[bytes]
    cursor: str | None
    window_s: float | None


def decode_updates(body: bytes) -> UpdateBatch:
    """Split a ``getupdates`` answer; its messages are decoded one by one later."""
    # The messages are cut out first: one bad message must not break the batch.
    span = kit_decode.member_span(body, "msgs")
    raws: list[bytes] = []
    if span is not None and body[span[0] : span[1]].strip() == b"null":
        span = None  # "msgs": null is an empty batch
    if span is not None:
        try:
            raws = kit_decode.split_array(body[span[0] : span[1]])
        except ValueError as exc:
            raise RemoteProtocolError(f"getupdates: undecodable msgs ({exc})") from None
        body = body[: span[0]] + b"[]" + body[span[1] :]
    env = decode_envelope("getupdates", body, m.UPDATES_DECODER)
    window: float | None = None
    if env.longpolling_timeout_ms and env.longpolling_timeout_ms > 0:
        secs = env.longpolling_timeout_ms / 1000
        lo, hi = POLL_WINDOW_RANGE_S
        window = min(max(secs, lo), hi)
    return UpdateBatch(raws, env.get_updates_buf or None, window)


# --- ids and times -------------------------------------------------------------------------


def id_str(value: m.Id) -> str | None:
    """An id as the decimal/opaque string it is compared as (None when absent)."""
    if value is None or isinstance(value, bool):
        return None
    text = str(value).strip()
    return text or None


def id_time_ms(value: m.Id, *, now_ms: float) -> int | None:
    """The millisecond time in a 64-bit message id (``id >> 22``), or None.

    Only ids of 16-20 decimal digits count, and only times between 2020-01-01 and 24 h
    after ``now_ms`` that are safe integers (dsh-im's heuristic; unverified by Tencent).
    """
    text = id_str(value)
    if text is None or not text.isdigit() or not ID_DIGITS[0] <= len(text) <= ID_DIGITS[1]:
        return None
    ms = int(text) >> 22
    if ms > MAX_SAFE_INTEGER or ms < ID_TIME_MIN_MS or ms > now_ms + ID_TIME_FUTURE_MS:
        return None
    return ms


# Ids (weixin.md §4, kit.ids): ``message_id`` / item ``msg_id`` / ``svr_id`` are uint64
# (digits, at most 2**64 - 1); users are ``<id>@im.wechat``, bots ``<hex>@im.bot``,
# groups ``<digits>@chatroom``; ``client_id`` s are prefixed random ids.  A message whose
# own id, items' ids, sender, group or client id is of another shape, or whose time is
# past 2100 or negative, is malformed; a bad ``svr_id`` (or quoted item id) only makes
# the quote ``not-found``.  A ``context_token`` (a secret: never in a log or an error)
# that is no printable token is never stored -- the message is kept, its answer goes with
# the user's stored token -- so it cannot poison later sends.
WEIXIN_NUMBER = shape("weixin message", "[0-9]{1,20}")
WEIXIN_USER = shape("weixin user", f"[{TOKEN}.]+(@[{TOKEN}.]+)?")
WEIXIN_CLIENT_ID = shape("weixin client", f"[{TOKEN}.:]+")
#: Context tokens: printable ASCII without spaces, far shorter than this in practice.
CONTEXT_TOKEN_RE = re.compile(r"[\x21-\x7e]{1,4096}")
_UINT64_MAX = 2**64 - 1


def valid_number_id(value: m.Id) -> bool:
    """A uint64 id (as iLink sends it: a JSON number or its decimal string)."""
    text = id_str(value)
    return valid_id(text, WEIXIN_NUMBER) and int(text) <= _UINT64_MAX


def _check_number_id(value: m.Id, field: str) -> None:
    if value is None or valid_number_id(value):
        return
    text = id_str(value)
    check_id(text or "", WEIXIN_NUMBER, field)  # the kit's message (names no value)
    raise BadId(f"{field}: more than 64 bits")


def check_ids(msg: m.WeixinMessage) -> None:
    """Raise ``BadId`` / ``BadTime`` when the message's own ids or times are no iLink
    values (see :data:`WEIXIN_USER` and the notes above it)."""
    _check_number_id(msg.message_id, "message_id")
    for item in msg.item_list:
        _check_number_id(item.msg_id, "item msg_id")
    check_optional_id((msg.from_user_id or "").strip(), WEIXIN_USER, "from_user_id")
    check_optional_id((msg.group_id or "").strip(), WEIXIN_USER, "group_id")
    check_optional_id(msg.client_id, WEIXIN_CLIENT_ID, "client_id")
    for name, ms in (
        ("create_time_ms", msg.create_time_ms),
        ("update_time_ms", msg.update_time_ms),
    ):
        if ms is not None and not 0 <= ms <= MAX_EPOCH_S * 1000:
            raise BadTime(f"{name}: not a plausible time")


def dedup_id(msg: m.WeixinMessage) -> str | None:
    """The stable id of a message: ``message_id``, else ``client_id``, else ``seq``,
    else its items' ``msg_id`` s."""
    mid = id_str(msg.message_id)
    if mid is not None:
        return mid
    if msg.client_id:
        return f"client:{msg.client_id}"
    if msg.seq is not None:
        return f"seq:{msg.seq}"
    items = sorted(i for i in (id_str(it.msg_id) for it in msg.item_list) if i is not None)
    return "items:" + ",".join(items) if items else None


# --- media ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MediaHandle:
    """Where a media item lives on the CDN and its AES key (nothing downloaded yet).

    ``param`` and ``full_url`` are signed: never logged (``repr`` hides them)."""

    kind: str
    param: str | None = field(repr=False)
    full_url: str | None = field(repr=False)
    key: bytes | None = field(repr=False)
    name: str | None = None
    size: int | None = None


def media_key(aeskey_hex: str | None, media: m.Media | None) -> bytes | None:
    """The AES-128 key: ``image_item.aeskey`` (32 hex chars), else ``media.aes_key`` —
    base64 of 16 raw bytes or of a 32-char hex string."""
    if aeskey_hex and _HEX32.match(aeskey_hex.strip()):
        return bytes.fromhex(aeskey_hex.strip())
    if media is None or not media.aes_key:
        return None
    try:
        raw = base64.b64decode(media.aes_key.strip(), validate=False)
    except (binascii.Error, ValueError):
        return None
    if len(raw) == 16:
        return raw
    try:
        text = raw.decode("ascii")
    except UnicodeDecodeError:
        return None
    return bytes.fromhex(text) if _HEX32.match(text) else None


def _handle(
    kind: str, media: m.Media | None, *, key: bytes | None, name: str | None, size: int | None
) -> MediaHandle | None:
    if media is None or not (media.encrypt_query_param or media.full_url):
        return None
    return MediaHandle(kind, media.encrypt_query_param, media.full_url, key, name, size)


def _int(value: str | int | None) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().isdigit():
        return int(value.strip())
    return None


def item_media(item: m.MessageItem) -> list[MediaHandle]:
    """The downloadable media of one item (image, voice, file, video)."""
    out: list[MediaHandle | None] = []
    if item.image_item is not None:
        img = item.image_item
        key = media_key(img.aeskey, img.media)
        out.append(_handle("image", img.media, key=key, name=None, size=img.mid_size))
    if item.voice_item is not None:
        v = item.voice_item
        name = f"voice.{VOICE_EXTENSIONS.get(v.encode_type or 0, 'silk')}"
        out.append(_handle("audio", v.media, key=media_key(None, v.media), name=name, size=None))
    if item.file_item is not None:
        f = item.file_item
        out.append(
            _handle(
                "file", f.media, key=media_key(None, f.media), name=f.file_name, size=_int(f.len)
            )
        )
    if item.video_item is not None:
        vi = item.video_item
        out.append(
            _handle(
                "video",
                vi.media,
                key=media_key(None, vi.media),
                name="video.mp4",
                size=vi.video_size,
            )
        )
    return [h for h in out if h is not None]


def item_attachments(item: m.MessageItem) -> list[Attachment]:
    """Attachment kinds of an item by which media item is present (never URLs or keys)."""
    out: list[Attachment] = []
    if item.image_item is not None:
        out.append(Attachment(kind="image"))
    if item.voice_item is not None:
        out.append(Attachment(kind="audio"))
    if item.file_item is not None:
        out.append(Attachment(kind="file", name=item.file_item.file_name))
    if item.video_item is not None:
        out.append(Attachment(kind="video"))
    return out


def item_text(item: m.MessageItem) -> str | None:
    """The text of an item by shape: ``text_item.text``, else the voice's speech-to-text."""
    if item.text_item is not None and item.text_item.text:
        return item.text_item.text
    if item.voice_item is not None and item.voice_item.text:
        return item.voice_item.text
    return None


# --- quotes -------------------------------------------------------------------------------


def _occurrence(text: str, needle: str, index: int, start: int = 0) -> int:
    pos = start - 1
    for _ in range(index + 1):
        pos = text.find(needle, pos + 1)
        if pos < 0:
            return -1
    return pos


def resolve_partial(full: str, partial: m.PartialText) -> str | None:
    """The part of ``full`` a partial quote selects, or None when it cannot be found.

    The ``startindex``-th occurrence of ``start`` (0-based) to the end of the
    ``endindex``-th occurrence of ``end``, the latter counted from the text's start or
    from ``start``'s position (both readings exist); ``quotemd5`` picks between them.
    """
    if not partial.start or not partial.end:
        return None
    s = _occurrence(full, partial.start, max(0, partial.startindex or 0))
    if s < 0:
        return None
    candidates: list[str] = []
    for base in (0, s):
        e = _occurrence(full, partial.end, max(0, partial.endindex or 0), base)
        if e >= s:
            candidates.append(full[s : e + len(partial.end)])
    if not candidates:
        return None
    if partial.quotemd5:
        want = partial.quotemd5.strip().lower()
        for c in candidates:
            if hashlib.md5(c.encode("utf-8")).hexdigest() == want:  # noqa: S324 - iLink's
                return c
    return candidates[0]


@dataclass(frozen=True, slots=True)
class QuoteLookup:
    """What recovery of a content-less quote needs: the conversation, the keys the quoted
    message may be indexed under, its candidate times (epoch seconds), a partial
    selection, and the reason when nothing is found."""

    conversation_id: str
    keys: tuple[str, ...]
    times: tuple[float, ...]
    partial: m.PartialText | None = None


#: Builds the lazy loader of a content-less quote (the channel's index lookup).
LoaderFactory = Callable[[QuoteLookup], Loader]


def _reference_item(items: Sequence[m.MessageItem]) -> m.MessageItem | None:
    for item in items:
        if item.ref_msg is not None:
            return item
    return None


def reply_reference(
    ref: m.RefMsg,
    *,
    conversation_id: str,
    now_ms: float,
    loader_for: LoaderFactory | None,
) -> ReplyReference:
    """The :class:`ReplyReference` of a ``ref_msg`` (one level: its own quote is ignored)."""
    qi = ref.message_item
    if (ref.svr_id is not None and not valid_number_id(ref.svr_id)) or (
        qi is not None and qi.msg_id is not None and not valid_number_id(qi.msg_id)
    ):
        return ReplyReference(unavailable_reason="not-found")  # never looked up
    svr_id = id_str(ref.svr_id)
    item_id = id_str(qi.msg_id) if qi is not None else None
    qid = svr_id or item_id
    text = item_text(qi) if qi is not None else None
    attachments = item_attachments(qi) if qi is not None else []
    partial = ref.partial_text if isinstance(ref.partial_text, m.PartialText) else None
    if isinstance(ref.partial_text, str) and ref.partial_text.strip():
        text = ref.partial_text
    elif text and partial is not None:
        text = resolve_partial(text, partial) or text
    if not text and not attachments and ref.title and ref.title.strip():
        text = ref.title
    if text or attachments:
        return ReplyReference(message_id=qid, content=text, attachments=attachments)
    # A content-less shell: recover it (index by id, by time, then session history).
    times: list[float] = []
    for ms in (
        qi.create_time_ms if qi is not None else None,
        qi.update_time_ms if qi is not None else None,
        ref.create_time_ms,
        id_time_ms(svr_id, now_ms=now_ms),
        id_time_ms(item_id, now_ms=now_ms),
    ):
        if ms is not None and ms > 0 and ms / 1000 not in times:
            times.append(ms / 1000)
    keys = tuple(dict.fromkeys(k for k in (svr_id, item_id) if k is not None))
    known = qi is None or qi.type is None or qi.type in KNOWN_ITEM_TYPES
    lookup = QuoteLookup(conversation_id, keys, tuple(times), partial)
    return ReplyReference(
        message_id=qid,
        unavailable_reason=None if known else "unsupported",
        recover=True,
        recover_at=times[0] if times else None,
        recover_keys=list(keys),
        loader=loader_for(lookup) if loader_for is not None else None,
    )


# --- messages -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ContextToken:
    """The latest ``context_token`` of a user, with what orders it (newer wins)."""

    token: str = field(repr=False)
    seq: int | None
    time_ms: int | None

    def newer_than(self, other: ContextToken | None) -> bool:
        if other is None:
            return True
        if self.seq is not None and other.seq is not None and self.seq != other.seq:
            return self.seq > other.seq
        if self.time_ms is not None and other.time_ms is not None:
            return self.time_ms >= other.time_ms
        return True


@dataclass(frozen=True, slots=True)
class Route:
    """What the channel keeps with a mapped message (``InboundMessage.route``): the
    further ids it is indexed under (its items' ``msg_id`` s, its ``client_id``), and
    the context token of a direct message (an answer to it may carry it)."""

    extra_ids: tuple[str, ...] = ()
    context: ContextToken | None = None


@dataclass(slots=True)
class Mapped:
    """A decoded message: what goes to the pipeline, and the user's context token."""

    item: InboundMessage | Skip
    user: str | None = None
    context: ContextToken | None = None
    group_id: str | None = None
    time_ms: int | None = None


def _extra_ids(msg: m.WeixinMessage, mid: str) -> tuple[str, ...]:
    ids = [id_str(it.msg_id) for it in msg.item_list]
    ids.append(msg.client_id)
    return tuple(dict.fromkeys(i for i in ids if i and i != mid))


#: Builds a lazy download handle of one media item (the channel's CDN client).
FetcherFactory = Callable[[MediaHandle], Fetcher]


def map_message(
    raw: bytes,
    *,
    bot_id: str,
    now_ms: float,
    fetcher_for: FetcherFactory | None = None,
    loader_for: LoaderFactory | None = None,
) -> Mapped:
    """Decode and map one entry of ``getupdates``' ``msgs``.  Never raises for bad input."""
    try:
        msg = kit_decode.decode(m.MESSAGE_DECODER, raw)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return Mapped(Skip(reason="malformed", detail=str(exc)[:200]))
    try:
        check_ids(msg)
    except (BadId, BadTime) as exc:
        return Mapped(Skip(reason="malformed", detail=str(exc)))
    # A quote is never newer than the message quoting it (replay decodes before "now").
    now_ms = max(now_ms, msg.create_time_ms or 0)
    mid = dedup_id(msg)
    if mid is None:
        return Mapped(Skip(reason="malformed", detail="message without any id"))
    if msg.message_type == MESSAGE_TYPE_BOT:  # the bot's own message
        return Mapped(Skip(reason="echo", message_id=mid))
    user = (msg.from_user_id or "").strip()
    if not user:
        return Mapped(Skip(reason="malformed", detail="no from_user_id", message_id=mid))
    time_ms = msg.create_time_ms or msg.update_time_ms or id_time_ms(msg.message_id, now_ms=now_ms)
    token = msg.context_token
    valid_token = token is not None and CONTEXT_TOKEN_RE.fullmatch(token) is not None
    context = ContextToken(token, msg.seq, time_ms) if token and valid_token else None
    texts: list[str] = []
    images: list[MediaRef] = []
    files: list[MediaRef] = []
    for item in msg.item_list:
        text = item_text(item)
        if text:
            texts.append(text)
        for handle in item_media(item):
            ref = MediaRef(
                kind=handle.kind,
                name=handle.name,
                size=handle.size,
                fetch=fetcher_for(handle) if fetcher_for is not None else None,
            )
            (images if handle.kind == "image" else files).append(ref)
    group = (msg.group_id or "").strip() or None
    reply_to = None
    carrier = _reference_item(msg.item_list)
    if carrier is not None and carrier.ref_msg is not None:
        reply_to = reply_reference(
            carrier.ref_msg, conversation_id=user, now_ms=now_ms, loader_for=loader_for
        )
    inbound = InboundMessage(
        channel=CHANNEL,
        bot_id=bot_id,
        message_id=mid,
        # Direct chats only; a group message is never addressed (iLink bots are DM-only).
        conversation_id=group or user,
        conversation_type="group" if group else "direct",
        sender_id=user,
        addressed=group is None,
        content="\n".join(texts),
        images=images,
        files=files,
        reply_to=reply_to,
        received_at=time_ms / 1000 if time_ms else 0.0,
        route=Route(_extra_ids(msg, mid), context if group is None else None),
    )
    return Mapped(inbound, user=user, context=context, group_id=group, time_ms=time_ms)


# --- sending --------------------------------------------------------------------------------


def send_body(*, to_user: str, client_id: str, context_token: str, text: str) -> dict[str, object]:
    """The ``sendmessage`` ``msg``: one TEXT item, finished (iLink has no streaming)."""
    return {
        "from_user_id": "",
        "to_user_id": to_user,
        "client_id": client_id,
        "message_type": MESSAGE_TYPE_BOT,
        "message_state": 2,
        "context_token": context_token,
        "item_list": [{"type": ITEM_TEXT, "text_item": {"text": text}}],
    }


def client_version(version: str) -> int:
    """``iLink-App-ClientVersion``: ``major<<16 | minor<<8 | patch`` of a version string."""
    parts = [int(p) if p.isdigit() else 0 for p in re.split(r"[.+-]", version)[:3]]
    parts += [0] * (3 - len(parts))
    return ((parts[0] & 0xFF) << 16) | ((parts[1] & 0xFF) << 8) | (parts[2] & 0xFF)


def uin_header(rand32: int) -> str:
    """``X-WECHAT-UIN``: base64 of the decimal string of a random uint32 (not raw bytes)."""
    return base64.b64encode(str(rand32 & 0xFFFFFFFF).encode("ascii")).decode("ascii")


_MD_FENCE = re.compile(r"^\s*```[^\n]*$", re.M)
_MD_HEADING = re.compile(r"^\s{0,3}#{1,6}\s+", re.M)
_MD_BOLD = re.compile(r"(\*\*|__)(?=\S)(.+?)(?<=\S)\1", re.S)
_MD_ITALIC = re.compile(r"(?<![\*\w])\*(?=\S)([^*\n]+?)(?<=\S)\*(?!\*)")
_MD_CODE = re.compile(r"`([^`\n]+)`")
_MD_IMAGE = re.compile(r"!\[([^\]]*)\]\(([^)\s]+)[^)]*\)")
_MD_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)[^)]*\)")
_MD_BULLET = re.compile(r"^(\s*)[*+-]\s+", re.M)
_MD_QUOTE = re.compile(r"^\s{0,3}>\s?", re.M)
_MD_RULE = re.compile(r"^\s{0,3}([-*_])(\s*\1){2,}\s*$", re.M)


def plain_text(text: str) -> str:
    """Markdown reduced to readable plain text (WeChat renders none of it)."""
    text = _MD_FENCE.sub("", text)
    text = _MD_HEADING.sub("", text)
    text = _MD_RULE.sub("", text)
    text = _MD_IMAGE.sub(lambda mt: mt.group(1) or mt.group(2), text)
    text = _MD_LINK.sub(
        lambda mt: mt.group(1) if mt.group(1) == mt.group(2) else f"{mt.group(1)} ({mt.group(2)})",
        text,
    )
    text = _MD_BOLD.sub(r"\2", text)
    text = _MD_ITALIC.sub(r"\1", text)
    text = _MD_CODE.sub(r"\1", text)
    text = _MD_BULLET.sub(r"\1• ", text)
    text = _MD_QUOTE.sub("", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


# --- login ----------------------------------------------------------------------------------

LoginAction = Literal["wait", "verify", "new_qr", "redirect", "bound", "confirmed", "fail"]


@dataclass(frozen=True, slots=True)
class LoginStep:
    """What to do after one ``get_qrcode_status`` answer."""

    action: LoginAction
    detail: str = ""
    redirect_host: str | None = None


def login_step(status: m.QrStatus) -> LoginStep:
    """Map one QR status (protocols/weixin.md §2) to the login flow's next action."""
    s = (status.status or "").strip()
    if s in ("wait", "scaned", ""):
        return LoginStep("wait", "scanned, confirm on the phone" if s == "scaned" else "")
    if s == "need_verifycode":
        return LoginStep("verify")
    if s == "verify_code_blocked":
        return LoginStep("new_qr", "too many wrong verification codes")
    if s == "expired":
        return LoginStep("new_qr", "the QR code expired")
    if s == "scaned_but_redirect":
        host = (status.redirect_host or "").strip()
        if not host:
            return LoginStep("fail", "redirect without a host")
        return LoginStep("redirect", redirect_host=host)
    if s == "binded_redirect":
        return LoginStep("bound")
    if s == "confirmed":
        if not status.bot_token or not status.ilink_bot_id:
            return LoginStep("fail", "confirmed without bot_token or ilink_bot_id")
        return LoginStep("confirmed")
    return LoginStep("fail", f"unknown QR status {s[:40]!r}")


def credential_hash(token: str) -> str:
    """A short fingerprint of a bot token (context tokens belong to one token)."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()[:16]
