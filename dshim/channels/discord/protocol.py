"""Discord, sans-IO: the Gateway v10 session, REST rate limits and errors, and the mapping.

Theory of operation
-------------------
:class:`GatewayProtocol` is the kit's shared Discord-style gateway session
(:class:`dshim.channels.kit.gateway.GatewaySession`, also QQ's) with Discord's dialect
(:data:`DISCORD_GATEWAY`: close codes, the ``?v=10`` URL) and intents.  It holds
everything about the gateway that is not I/O.  The kit's runner (:mod:`dshim.net.ws`)
opens websockets to the URL :meth:`~GatewayProtocol.plan_connection` chose, feeds every
received frame to :meth:`~GatewayProtocol.receive`, calls :meth:`~GatewayProtocol.tick`
when :meth:`~GatewayProtocol.next_timer` is due, performs the returned actions and reports
the end of each connection with :meth:`~GatewayProtocol.connection_lost`.  Time is always
an argument (seconds on any monotonic clock); randomness comes from an injected function.

Two lifetimes::

    session (survives reconnects): session_id, resume_gateway_url, seq, the cached
        Get Gateway Bot URL, the identify budget (session_start_limit)
    connection: AWAIT_HELLO -> (Identify | Resume sent) AWAIT_READY -> READY/RESUMED
        CONNECTED -> CLOSED; heartbeat interval, next beat, "ACK pending"

What Discord guarantees: dispatches arrive in order with a growing ``s``; nothing is
acknowledged per event; a Resume replays the dispatches a session missed (within a few
minutes), so the only redelivery is a replay after Resume -- which may repeat events we
already handled (the pipeline's persisted dedup drops them).  Every wanted dispatch is
delivered to the channel before the next frame is read.

Rules, with the doc pages they come from (discord-api-docs, events/gateway.mdx and
topics/opcodes-and-status-codes.mdx):

* Hello (op 10) starts the heartbeat: the first beat after ``interval * random()``, then
  every ``interval``; ``d`` is the last non-null ``s`` seen on the session.  Then Identify
  (op 2, new session) or Resume (op 6: token, session_id, seq).
* A beat that is due while the previous one is not yet ACKed (op 11) means a zombie
  connection: close with 4000 (never 1000/1001, which would end the session) and resume.
* Op 1 from the server: heartbeat at once.  Op 7 Reconnect: close with 4000, resume.
  Op 9 Invalid Session: ``d=true`` -> resume; ``d=false`` -> forget the session, close with
  1000, wait 1-5 s and Identify afresh on the cached Get Gateway URL.
* READY carries ``session_id`` and ``resume_gateway_url``; resumes go to the latter.
* Close codes 4004, 4010, 4011, 4012, 4013, 4014 are fatal: never reconnect.  4007 and
  4009 need a new session.  Everything else (and network errors) resumes when a session
  exists; the runner backs off connections that never got to READY/RESUMED.
* Identify is expensive (1000 per day; exceeding it resets the token): never identify
  while ``session_start_limit.remaining`` is 0 -- wait ``reset_after`` and ask again --
  and at most ``max_concurrency`` identifies per 5 s.
* A frame is decoded with bounded depth (:func:`dshim.channels.kit.decode.decode`): a
  frame that does not decode is :class:`~dshim.net.ws.Ignored`, the connection
  goes on.

REST (topics/rate-limits.mdx, topics/opcodes-and-status-codes.mdx): :func:`classify_error`
maps an HTTP status and Discord's JSON ``code`` to the error tree, :class:`RateLimiter`
keeps the bucket state learned from the ``X-RateLimit-*`` headers.

The last part maps MESSAGE_CREATE to :class:`~dshim.model.InboundMessage`
(resources/message.mdx; see the rules on :class:`MessageMapper`), and INTERACTION_CREATE
button presses to :class:`Press` (interactions/receiving-and-responding.mdx,
interactions/message-components.mdx).  Nothing here imports trio or httpx or reads a
clock.

Button presses (message components)
-----------------------------------
The bot's buttons carry a ``custom_id`` (at most 100 characters) that says what they are:
``dshim:ctl:<action>:<conversation>:<thread|->`` on a substitute control notice (the chat
it is about travels in the button, the press happens in the operator's DM), and
``dshim:opt:<n>:<thread|->`` on an approval or question (option ``n``; the press
happens in the asking turn's channel, the turn's thread id travels in the button).  A
press arrives as INTERACTION_CREATE type 3 (MESSAGE_COMPONENT) whatever the intents.
Discord's guarantee: the interaction must be answered within **3 s** with
``POST /interactions/{id}/{token}/callback`` or the presser sees "This interaction
failed" and the token no longer answers (404, code 10062); nothing is redelivered except
by a Resume replay, so presses are deduplicated in memory by interaction id
(:class:`RecentIds`; a new session after a restart replays nothing).  The token is a
secret: it is used for that one callback and never logged or stored (an answer press
goes to the durable inbox normalized, without the frame).
"""

from __future__ import annotations

import math
import re
import urllib.parse
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Literal, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from dshim.channels.discord import models as m
from dshim.channels.kit.decode import decode
from dshim.channels.kit.gateway import (  # noqa: F401 - re-exported for Discord's users
    HELLO_TIMEOUT_S,
    IDENTIFY_WINDOW_S,
    OP_DISPATCH,
    ConnectPlan,
    ConnState,
    Dispatch,
    GatewayAction,
    GatewayDialect,
    GatewaySession,
    GatewayTuning,
    Mode,
)
from dshim.channels.kit.ids import plausible_time
from dshim.errors import (
    AuthError,
    ChannelError,
    FatalChannelError,
    NotFound,
    PermissionDenied,
    RateLimited,
    TransportError,
)
from dshim.model import (
    Attachment,
    Fetcher,
    InboundMessage,
    Loader,
    MediaRef,
    Mention,
    ReplyReference,
    Skip,
)

CHANNEL = "discord"
#: A user mention in message content: ``<@id>`` or the legacy nickname form ``<@!id>``.
_USER_MENTION_RE = re.compile(r"<@!?(\d{1,20})>")
API_VERSION = 10

# Intents (events/gateway.mdx "List of Intents").  MESSAGE_CONTENT is privileged: without
# it Discord sends empty content for guild messages that do not mention the bot.
GUILDS = 1 << 0
GUILD_MESSAGES = 1 << 9
DIRECT_MESSAGES = 1 << 12
MESSAGE_CONTENT = 1 << 15
INTENTS = GUILDS | GUILD_MESSAGES | DIRECT_MESSAGES | MESSAGE_CONTENT


def intents(*, message_content: bool = True) -> int:
    """The intents dshim identifies with (``message_content = false`` drops the privileged one)."""
    return INTENTS if message_content else INTENTS & ~MESSAGE_CONTENT


#: Where the Message Content switch is, and the setting that stops asking for it.
MESSAGE_CONTENT_HINT = (
    "the bot asks for the privileged Message Content intent, which is not enabled for it: "
    "turn it on in the Discord Developer Portal (your application -> Bot -> Privileged "
    "Gateway Intents -> Message Content Intent), or set message_content = false for this "
    "bot in the configuration (message text then arrives only in DMs and in messages "
    "that mention the bot)"
)

#: Close codes after which reconnecting cannot help (discord.py's set, minus our own 1000).
FATAL_CLOSE_CODES: dict[int, str] = {
    4004: "authentication failed: the bot token is invalid",
    4010: "invalid shard",
    4011: "sharding required: the bot is in too many guilds for one shard",
    4012: "invalid API version",
    4013: "invalid intents",
    4014: "disallowed intents: a privileged intent is not enabled for this bot in the "
    "Discord Developer Portal (Bot -> Privileged Gateway Intents)",
}
#: Close codes after which the session cannot be resumed (invalid seq, session timed out).
NEW_SESSION_CLOSE_CODES = frozenset({4007, 4009})
#: Our close code when we intend to resume (anything but 1000/1001 keeps the session).
RESUME_CLOSE_CODE = 4000


def gateway_url(base: str) -> str:
    """``base`` with ``?v=10&encoding=json`` (path ``/`` when empty; other query kept)."""
    parts = urllib.parse.urlsplit(base)
    query = [
        (k, v)
        for k, v in urllib.parse.parse_qsl(parts.query, keep_blank_values=True)
        if k not in ("v", "encoding", "compress")
    ]
    query += [("v", str(API_VERSION)), ("encoding", "json")]
    return urllib.parse.urlunsplit(
        (parts.scheme, parts.netloc, parts.path or "/", urllib.parse.urlencode(query), "")
    )


def _short(exc: Exception) -> str:
    return str(exc)[:200]


#: What Discord's gateway does differently from the kit's shared session.
DISCORD_GATEWAY = GatewayDialect(
    platform="Discord",
    fatal_close_codes=FATAL_CLOSE_CODES,
    auth_close_codes=frozenset({4004}),
    new_session_close_codes=NEW_SESSION_CLOSE_CODES,
    resume_close_code=RESUME_CLOSE_CODE,
    url=gateway_url,
)


class GatewayProtocol(GatewaySession):
    """Discord's gateway session: the kit's :class:`~dshim.channels.kit.gateway.GatewaySession`
    with :data:`DISCORD_GATEWAY` and Discord's intents.  See the module docstring."""

    def __init__(
        self,
        *,
        token: str,
        random: Callable[[], float],
        intents: int = INTENTS,
        wanted: frozenset[str] = frozenset({"MESSAGE_CREATE"}),
        gateway_override: str | None = None,
        tuning: GatewayTuning | None = None,
        properties: dict[str, str] | None = None,
    ) -> None:
        super().__init__(
            token=token,
            random=random,
            dialect=DISCORD_GATEWAY,
            intents=intents,
            wanted=wanted,
            gateway_override=gateway_override,
            tuning=tuning,
            properties=properties,
        )

    def fatal_error(self, code: int) -> AuthError | FatalChannelError:
        """The error for a fatal close code (4014 names the switch and the setting)."""
        if code == 4014 and self.intents & MESSAGE_CONTENT:
            meaning = "disallowed intents: " + MESSAGE_CONTENT_HINT
            return FatalChannelError(
                f"Discord closed the gateway with {code}: {meaning}", code=code
            )
        return super().fatal_error(code)


# --- REST: errors and rate limits ------------------------------------------------------------

#: Global limit: requests per second per bot (interaction endpoints excluded).
GLOBAL_LIMIT_PER_S = 50
#: JSON error codes: 10003 unknown channel, 10008 unknown message.
NOT_FOUND_CODES = frozenset({10003, 10008})
#: 50001 missing access, 50013 missing permissions.
PERMISSION_CODES = frozenset({50001, 50013})
#: The longest retry-after believed (a broken or hostile value is capped, never slept on).
MAX_RETRY_AFTER_S = 24 * 3600.0
#: Learned buckets kept at most (idle ones are forgotten first).
MAX_BUCKETS = 4096


def error_body(body: bytes) -> m.ErrorBody:
    """Discord's ``{"code", "message", "retry_after", "global"}``; empty when it is not one
    (e.g. a Cloudflare ban page)."""
    try:
        return decode(m.error_decoder, body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return m.ErrorBody()


def classify_error(status: int, code: int, what: str, message: str = "") -> ChannelError:
    """An HTTP failure status plus Discord's JSON ``code`` as the error tree.

    401 -> AuthError (the token is not valid any more); 10003/10008 or 404 -> NotFound;
    50001/50013 or 403 -> PermissionDenied; 5xx -> TransportError (the request was
    sent: its outcome is unknown); anything else ChannelError.  ``what`` names the
    route, never a URL.  (429 is :meth:`RateLimiter.hit`'s.)
    """
    text = f"{what}: HTTP {status}" + (f" code {code}" if code else "")
    if message:
        text += f": {message[:200]}"
    code_or_none = code or None
    if status == 401:
        return AuthError(f"Discord rejected the bot token ({text})", status=401, code=code_or_none)
    if code in NOT_FOUND_CODES or status == 404:
        return NotFound(text, status=status, code=code_or_none)
    if code in PERMISSION_CODES or status == 403:
        return PermissionDenied(text, status=status, code=code_or_none)
    if status >= 500:
        return TransportError(text, status=status, code=code_or_none, request_sent=True)
    return ChannelError(text, status=status, code=code_or_none)


@dataclass(frozen=True, slots=True)
class RateLimitHit:
    """A 429: how long to wait, whether every route is paused, Discord's code (if any)."""

    retry_after: float
    is_global: bool = False
    code: int = 0


def _seconds(value: float | None, default: float) -> float:
    """A wait from the platform, within [0, MAX_RETRY_AFTER_S] (NaN: ``default``)."""
    if value is None or math.isnan(value):
        return default
    return min(max(0.0, value), MAX_RETRY_AFTER_S)


def rate_limit_hit(body: bytes, headers: Mapping[str, str]) -> RateLimitHit:
    """Read a 429: ``retry_after`` from the body, else the ``Retry-After`` header.

    ``headers`` is looked up with lower-case names (httpx's headers are case-insensitive).
    """
    err = error_body(body)
    retry_after = err.retry_after
    if retry_after is None:
        try:
            retry_after = float(headers.get("retry-after", "1"))
        except ValueError:
            retry_after = 1.0
    is_global = (
        err.global_
        or headers.get("x-ratelimit-global", "").lower() == "true"
        or headers.get("x-ratelimit-scope") == "global"
    )
    return RateLimitHit(_seconds(retry_after, 1.0), is_global, err.code)


class _Bucket:
    __slots__ = ("limit", "remaining", "reset_at")

    def __init__(self) -> None:
        self.limit = 1
        self.remaining = 1
        self.reset_at = 0.0


class RateLimiter:
    """Discord's REST limits, learned from the responses, never hard-coded.  Sans-IO.

    * per route: ``X-RateLimit-Bucket`` maps ``METHOD route-template`` to a bucket id;
      state (``-Remaining``, ``-Reset-After``) is kept per (bucket, top-level resource
      id), so ``/channels/A/messages`` and ``/channels/B/messages`` are independent.  A
      bucket with nothing remaining makes the next request wait for its reset;
    * global: at most 50 requests per second, and a 429 with ``global: true`` (or
      ``X-RateLimit-Global`` / scope ``global``) pauses every request.

    The caller asks :meth:`reserve` before each request (0: go, one request is counted
    at once so concurrent callers see it; else the seconds to wait before asking
    again), and tells it every response with :meth:`learn` and every 429 with
    :meth:`hit`; :meth:`global_wait` says whether a wait is the global limit's (the
    client then queues its callers, so that one of them sleeps on it, not all).
    """

    def __init__(self, *, global_per_s: int = GLOBAL_LIMIT_PER_S) -> None:
        self._route_buckets: dict[str, str] = {}
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._global_until = 0.0
        self._recent: deque[float] = deque(maxlen=global_per_s)

    def _key(self, route_key: str, major: str) -> tuple[str, str]:
        return (self._route_buckets.get(route_key, route_key), major)

    def reserve(self, route_key: str, major: str, now: float) -> float:
        """0.0 when a request may go now (and count it), else how long to wait first."""
        wait = self._global_until - now
        bucket = self._buckets.get(self._key(route_key, major))
        if bucket is not None and bucket.remaining <= 0:
            if bucket.reset_at > now:
                wait = max(wait, bucket.reset_at - now)
            else:
                bucket.remaining = max(1, bucket.limit)
        recent = self._recent
        if recent.maxlen is not None and len(recent) == recent.maxlen:
            wait = max(wait, recent[0] + 1.0 - now)
        if wait > 0:
            return wait
        if bucket is not None:
            bucket.remaining -= 1
        recent.append(now)
        return 0.0

    def global_wait(self, now: float) -> float:
        """How long every request waits for the global limit (a global 429's pause, or
        the 50 requests of the last second), counting none."""
        wait = self._global_until - now
        recent = self._recent
        if recent.maxlen is not None and len(recent) == recent.maxlen:
            wait = max(wait, recent[0] + 1.0 - now)
        return max(0.0, wait)

    def learn(self, route_key: str, major: str, headers: Mapping[str, str], now: float) -> None:
        """Take the ``X-RateLimit-*`` headers of a response."""
        bucket_id = headers.get("x-ratelimit-bucket")
        remaining = headers.get("x-ratelimit-remaining")
        reset_after = headers.get("x-ratelimit-reset-after")
        if bucket_id is None or remaining is None or reset_after is None:
            return
        try:
            left = int(remaining)
            after = _seconds(float(reset_after), 0.0)
        except ValueError:
            return
        self._route_buckets[route_key] = bucket_id
        bucket = self._bucket((bucket_id, major), now)
        limit = headers.get("x-ratelimit-limit")
        if limit is not None and limit.isascii() and limit.isdigit():
            bucket.limit = int(limit)
        bucket.remaining = left
        bucket.reset_at = now + after

    def hit(self, route_key: str, major: str, hit: RateLimitHit, now: float) -> None:
        """A 429: pause the route's bucket, or every route when it is global."""
        if hit.is_global:
            self._global_until = max(self._global_until, now + hit.retry_after)
            return
        bucket = self._bucket(self._key(route_key, major), now)
        bucket.remaining = 0
        bucket.reset_at = max(bucket.reset_at, now + hit.retry_after)

    def _bucket(self, key: tuple[str, str], now: float) -> _Bucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= MAX_BUCKETS:  # bounded: forget idle buckets
                self._buckets = {k: b for k, b in self._buckets.items() if b.reset_at > now}
                while len(self._buckets) >= MAX_BUCKETS:
                    del self._buckets[next(iter(self._buckets))]
            bucket = self._buckets[key] = _Bucket()
        return bucket

    def limited_error(self, route_key: str, hit: RateLimitHit) -> RateLimited:
        """The :class:`~dshim.errors.RateLimited` a caller raises for ``hit``."""
        return RateLimited(
            f"{route_key}: rate limited (retry after {hit.retry_after:.2f} s)",
            retry_after=hit.retry_after,
            code=hit.code or None,
            is_global=hit.is_global,
        )


# --- MESSAGE_CREATE -> InboundMessage --------------------------------------------------------

#: Message types that carry a user's text: DEFAULT and REPLY (resources/message.mdx).
USER_MESSAGE_TYPES = frozenset({0, 19})
#: Channel types of threads: announcement, public and private threads.
THREAD_CHANNEL_TYPES = frozenset({10, 11, 12})
#: message_reference.type of a forward (its content is in message_snapshots, not a quote).
REFERENCE_FORWARD = 1
DISCORD_EPOCH_MS = 1420070400000
#: Snowflakes are unsigned 64-bit integers written as decimal strings: at most 20 digits
#: (and at most 2**64 - 1: ``99999999999999999999`` has 20 digits and is none).  Every id
#: dshim reads is one (kit.ids): they go into URL paths
#: (``/channels/{channel_id}/messages/{message_id}``), so a message whose own ids or
#: attachment ids are not is ``malformed``, a reference that is not only a quote that is
#: ``not-found``.
SNOWFLAKE_MAX_DIGITS = 20
SNOWFLAKE_MAX = 2**64 - 1
#: Guild events the mapper reads (the bot's managed role, the guild's threads), never
#: handed to the pipeline.
GUILD_EVENTS = frozenset(
    {
        "GUILD_CREATE",
        "GUILD_DELETE",
        "GUILD_ROLE_CREATE",
        "GUILD_ROLE_UPDATE",
        "GUILD_ROLE_DELETE",
        "THREAD_CREATE",
    }
)
#: Guilds whose bot role is remembered at most (one shard holds at most 2,500).
MAX_GUILDS = 10_000
#: Thread channels remembered as threads at most (oldest forgotten).
MAX_THREADS = 10_000

#: Attachment kinds by file extension, for attachments without a content type.  A fixed
#: table: the result must not depend on the host's MIME database.
EXTENSION_KINDS: dict[str, str] = {
    **dict.fromkeys(
        "png jpg jpeg jpe gif webp bmp tif tiff heic heif avif svg ico".split(), "image"
    ),
    **dict.fromkeys("mp4 m4v mov webm mkv avi wmv mpg mpeg 3gp".split(), "video"),
    **dict.fromkeys("mp3 m4a aac wav flac ogg oga opus weba mid midi aif aiff".split(), "audio"),
}

#: ``lookup(channel_id, message_id)`` -> a loader that fetches that message.
LookupFactory = Callable[[str, str], Loader]
#: ``media(attachment)`` -> a download handle (None: no download possible).
MediaFactory = Callable[[m.Attachment], Fetcher | None]


def is_snowflake(value: object) -> bool:
    """A Discord id: 1-20 ASCII digits (anything else is not copied nor looked up)."""
    return (
        isinstance(value, str)
        and 0 < len(value) <= SNOWFLAKE_MAX_DIGITS
        and value.isascii()
        and value.isdigit()
        and (len(value) < SNOWFLAKE_MAX_DIGITS or int(value) <= SNOWFLAKE_MAX)
    )


def snowflake_time(snowflake: str) -> float | None:
    """Epoch seconds encoded in a snowflake id, or None when it is not one."""
    if not is_snowflake(snowflake):
        return None
    value = int(snowflake)
    if value <= 0:
        return None
    return ((value >> 22) + DISCORD_EPOCH_MS) / 1000.0


def parse_timestamp(value: str | None) -> float | None:
    """ISO 8601 as Discord writes it (``2026-01-02T03:04:05.678000+00:00``) -> epoch s."""
    if not value or len(value) > 64:
        return None
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        dt = datetime.fromisoformat(text)
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        return dt.timestamp()
    except (ValueError, OverflowError):  # year 1 at +14:00 is before datetime's range
        return None


def display_name(user: m.User | None, member: m.Member | None) -> str | None:
    """Member nick, else ``global_name``, else ``username``."""
    if member is not None and member.nick:
        return member.nick
    if user is None:
        return None
    return user.global_name or user.username or None


def attachment_kind(content_type: str | None, filename: str | None = None) -> str:
    """image/video/audio by MIME prefix; anything else is a file.  Without a content type
    the file name's extension decides (:data:`EXTENSION_KINDS`)."""
    ct = (content_type or "").lower()
    if not ct:
        _, dot, ext = (filename or "").rpartition(".")
        return EXTENSION_KINDS.get(ext.lower(), "file") if dot else "file"
    for prefix in ("image", "video", "audio"):
        if ct.startswith(prefix + "/"):
            return prefix
    return "file"


def _other_message(q: m.QuotedMessage, channel_id: str, message_id: str) -> bool:
    """The snapshot names another message or channel than the reference."""
    return (q.id is not None and q.id != message_id) or (
        q.channel_id is not None and q.channel_id != channel_id
    )


def quoted_reference(q: m.QuotedMessage, message_id: str) -> ReplyReference:
    """A quoted message snapshot (``referenced_message`` or a fetched message).

    ``message_id`` is the (validated) id of the reference.  A field the snapshot does not
    carry -- no author, no content -- is ``UNSET`` (the model's "said nothing").
    """
    attachments = [
        Attachment(kind=attachment_kind(a.content_type, a.filename), name=a.filename)
        for a in q.attachments
    ]
    attachments += [Attachment(kind="image", name=s.name or None) for s in q.sticker_items]
    author = q.author
    author_id: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    if author is not None:
        if is_snowflake(author.id):
            author_id = author.id
        name = display_name(author, q.member) or UNSET
    return ReplyReference(
        message_id=message_id,
        author_id=author_id,
        author_name=name,
        content=q.content,
        attachments=attachments,
    )


def fetched_reference(
    q: m.QuotedMessage, channel_id: str, message_id: str
) -> ReplyReference | None:
    """A message returned by ``GET /channels/{channel_id}/messages/{message_id}``.

    A message from another channel (or with another id) is discarded: ``None`` (not found).
    """
    if _other_message(q, channel_id, message_id):
        return None
    return quoted_reference(q, message_id)


def _own_ids_valid(msg: m.Message) -> bool:
    """The message's own ids are snowflakes (written out: it runs for every message)."""
    guild_id = msg.guild_id
    ids = msg.id + msg.channel_id + msg.author.id + (guild_id or "")
    return (
        ids.isdigit()
        and ids.isascii()
        and is_snowflake(msg.id)
        and is_snowflake(msg.channel_id)
        and is_snowflake(msg.author.id)
        and (guild_id is None or is_snowflake(guild_id))
    )


T = TypeVar("T")


def _decode_d(decoder: msgspec.json.Decoder[T], d: msgspec.Raw | bytes | str) -> T:
    """Decode a dispatch's ``d``.  A :class:`msgspec.Raw` is the ``d`` of a frame that was
    decoded with bounded depth (:meth:`GatewayProtocol.receive`,
    :meth:`MessageMapper.decode_frame`), so its depth is not scanned again; bytes and text
    are (:func:`~dshim.channels.kit.decode.decode`)."""
    if not isinstance(d, msgspec.Raw):
        return decode(decoder, d)
    try:
        return decoder.decode(d)
    except RecursionError:  # pragma: no cover - a Raw comes from a bounded frame
        raise msgspec.DecodeError("JSON nested too deeply") from None


class MessageMapper:
    """Maps MESSAGE_CREATE payloads for one bot.

    * Ids are snowflakes (1-20 digits): a message whose own ids are not is ``malformed``.
    * ``guild_id`` absent -> direct, else group; ``conversation_id`` = ``channel_id``; a
      message inside a thread also has ``thread_id`` = its channel id (replies go to the
      thread).  Every message of a thread must say so alike (one lane, one session), so a
      thread is known by any of: a thread ``channel_type``, a ``position`` (only thread
      messages carry one), the message id being the channel id (a forum or media post's
      starter message shares its thread's id), or the channel being a thread the mapper
      saw before (in such a message, THREAD_CREATE, or GUILD_CREATE's ``threads``;
      bounded, see :data:`MAX_THREADS`).
    * ``sender_name`` = member nick, else ``global_name``, else ``username``;
      ``sender_is_bot`` = ``author.bot`` or a webhook message.  The bot's own messages
      keep ``sender_id`` = the bot id (the pipeline drops them as echoes).
    * Addressed: a DM, or the bot's id in ``mentions``, ``<@id>`` / ``<@!id>`` in the
      content, or a mention of the bot's own managed role (``<@&role>``, which Discord's
      mention picker often offers first; learned from GUILD_CREATE, see
      :meth:`learn_guild_event`).  Replying to the bot without a mention does not address
      it.  The bot's mentions are removed from the content, which is then trimmed.
    * Attachments: image content types -> images, everything else -> files.
    * A forward (``message_reference.type`` 1 with ``message_snapshots``) is not a quote:
      the forwarded text and attachments are the message's content, ``forwarded`` is set
      (never a command or an answer), the sender is the person who forwarded it.
    * System messages (types other than DEFAULT and REPLY), and messages with nothing for
      the agent (no text, no attachment, no quote: a sticker, a poll, an embed) are
      skipped as ``ignored``.
    * ``reply_to``: see :meth:`reply_reference`.
    """

    def __init__(
        self,
        bot_id: str,
        *,
        lookup: LookupFactory | None = None,
        media: MediaFactory | None = None,
    ) -> None:
        self.bot_id = bot_id
        self._lookup = lookup
        self._media = media
        self._tokens = (f"<@{bot_id}>", f"<@!{bot_id}>")
        #: guild id -> the bot's managed role ids there.
        self._roles: dict[str, frozenset[str]] = {}
        #: Thread channel ids seen, oldest first.
        self._threads: OrderedDict[str, None] = OrderedDict()

    # -- guild events ------------------------------------------------------------------

    def bot_roles(self, guild_id: str) -> frozenset[str]:
        """The bot's own managed role ids in a guild (learned from guild events)."""
        return self._roles.get(guild_id, frozenset())

    def learn_guild_event(self, t: str, d: msgspec.Raw | bytes | str) -> Skip:
        """Read a guild event for the bot's managed role; always an ``ignored`` Skip.

        GUILD_CREATE lists the guild's roles: the bot's is the one whose ``tags.bot_id``
        is the bot.  GUILD_ROLE_CREATE/UPDATE/DELETE keep it current; GUILD_DELETE (not an
        outage) forgets the guild.  GUILD_CREATE's ``threads`` and THREAD_CREATE name
        thread channels (see the thread rule on the class).
        """
        try:
            if t in ("GUILD_CREATE", "GUILD_DELETE"):
                guild = _decode_d(m.guild_decoder, d)
                if t == "GUILD_DELETE":
                    if not guild.unavailable:
                        self._roles.pop(guild.id, None)
                else:
                    self._set_roles(guild.id, {r.id for r in guild.roles if self._is_ours(r)})
                    for thread in guild.threads:
                        self._learn_thread(thread)
            elif t == "THREAD_CREATE":
                self._learn_thread(_decode_d(m.thread_decoder, d))
            elif t in ("GUILD_ROLE_CREATE", "GUILD_ROLE_UPDATE", "GUILD_ROLE_DELETE"):
                event = _decode_d(m.guild_role_decoder, d)
                roles = set(self._roles.get(event.guild_id, ()))
                role = event.role
                if role is not None and self._is_ours(role):
                    roles.add(role.id)
                elif role is not None:
                    roles.discard(role.id)
                elif event.role_id is not None:
                    roles.discard(event.role_id)
                self._set_roles(event.guild_id, roles)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Skip(reason="malformed", detail=f"{t}: {_short(exc)}")
        return Skip(reason="ignored", detail=t)

    def _learn_thread(self, thread: m.ThreadChannel) -> None:
        if thread.type in THREAD_CHANNEL_TYPES and is_snowflake(thread.id):
            self._note_thread(thread.id)

    def _note_thread(self, channel_id: str) -> None:
        threads = self._threads
        if channel_id in threads:
            threads.move_to_end(channel_id)
            return
        threads[channel_id] = None
        if len(threads) > MAX_THREADS:
            threads.popitem(last=False)

    def _in_thread(self, msg: m.Message) -> bool:
        """Whether the message was sent in a thread (the rule on the class)."""
        if msg.guild_id is None:
            return False
        channel = msg.channel_id
        if (
            msg.channel_type in THREAD_CHANNEL_TYPES
            or msg.position is not None
            or msg.id == channel  # a forum/media post's starter message
        ):
            self._note_thread(channel)
            return True
        if channel in self._threads:
            self._threads.move_to_end(channel)
            return True
        return False

    def _is_ours(self, role: m.Role) -> bool:
        return role.tags is not None and role.tags.bot_id == self.bot_id and is_snowflake(role.id)

    def _set_roles(self, guild_id: str, roles: set[str]) -> None:
        if not is_snowflake(guild_id):
            return
        self._roles.pop(guild_id, None)
        if not roles:
            return
        while len(self._roles) >= MAX_GUILDS:  # bounded: forget the oldest guild
            del self._roles[next(iter(self._roles))]
        self._roles[guild_id] = frozenset(roles)

    # -- messages ----------------------------------------------------------------------

    def decode_frame(self, raw: bytes | str) -> InboundMessage | Skip:
        """A whole gateway frame as received (replay fixtures, the durable inbox).

        Guild events are read for the bot's role (and skipped as ``ignored``).
        """
        try:
            frame = decode(m.frame_decoder, raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Skip(reason="malformed", detail=_short(exc))
        if frame.op == OP_DISPATCH and frame.t in GUILD_EVENTS:
            return self.learn_guild_event(frame.t, frame.d)
        if frame.op == OP_DISPATCH and frame.t == "INTERACTION_CREATE":
            # A press is answered live (within 3 s) or not at all: from a stored frame it
            # is never a message (an answer press reaches the inbox normalized).
            press = self.decode_interaction(frame.d)
            if isinstance(press, Skip):
                return press
            return Skip(reason="ignored", detail="a button press", message_id=press.id)
        if frame.op != OP_DISPATCH or frame.t != "MESSAGE_CREATE":
            return Skip(reason="ignored", detail=f"op {frame.op} {frame.t or ''}".strip()[:100])
        return self.decode_message(frame.d)

    def decode_interaction(self, d: msgspec.Raw | bytes | str) -> Press | Skip:
        """An INTERACTION_CREATE ``d`` payload (see :func:`map_interaction`)."""
        try:
            inter = _decode_d(m.interaction_decoder, d)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Skip(reason="malformed", detail=_short(exc))
        return map_interaction(self.bot_id, inter)

    def decode_message(self, d: msgspec.Raw | bytes | str) -> InboundMessage | Skip:
        """A MESSAGE_CREATE ``d`` payload (a frame's Raw ``d``, or bytes/text)."""
        try:
            msg = _decode_d(m.message_decoder, d)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Skip(reason="malformed", detail=_short(exc))
        return self.map_message(msg)

    def map_message(self, msg: m.Message) -> InboundMessage | Skip:
        if not _own_ids_valid(msg):
            return Skip(reason="malformed", detail="an id is not a snowflake")
        if msg.type not in USER_MESSAGE_TYPES:
            return Skip(reason="ignored", detail=f"message type {msg.type}", message_id=msg.id)
        direct = msg.guild_id is None
        # The bot's mentions address it and are removed from the text.
        content = msg.content
        mentioned = bool(msg.mentions) and any(u.id == self.bot_id for u in msg.mentions)
        if "<@" in content:
            for token in self._tokens:
                if token in content:
                    mentioned = True
                    content = content.replace(token, "")
            if not direct and self._roles:
                content, by_role = self._strip_role_mentions(msg, content)
                mentioned = mentioned or by_role
        elif not direct and msg.mention_roles and self._roles:
            mentioned = mentioned or self._strip_role_mentions(msg, content)[1]
        content = content.strip()
        in_thread = self._in_thread(msg)
        attachments = msg.attachments
        forwarded = False
        ref = msg.message_reference
        if ref is not None and ref.type == REFERENCE_FORWARD:
            # A forward: the snapshot's text is the message's content, never a quote.
            forwarded = True
            reply_to = None
            if msg.message_snapshots:
                snapshot = msg.message_snapshots[0].message
                text = snapshot.content.strip()
                content = f"{content}\n\n{text}" if content and text else content or text
                attachments = attachments + snapshot.attachments
        else:
            reply_to = self.reply_reference(msg) if ref is not None else None
        images: list[MediaRef] = []
        files: list[MediaRef] = []
        for a in attachments:
            if a.id and not is_snowflake(a.id):
                return Skip(reason="malformed", detail="an attachment id is not a snowflake")
            kind = attachment_kind(a.content_type, a.filename)
            media = MediaRef(
                kind="image" if kind == "image" else "file",
                name=a.filename or None,
                mime=a.content_type,
                size=a.size,
                fetch=self._media(a) if self._media is not None else None,
            )
            (images if kind == "image" else files).append(media)
        if not content and not images and not files and reply_to is None:
            # A sticker, a poll, an embed, a bare mention: nothing to answer.
            return Skip(reason="ignored", detail="nothing for the agent", message_id=msg.id)
        received_at = parse_timestamp(msg.timestamp) or snowflake_time(msg.id) or 0.0
        if not plausible_time(received_at):  # year 9999, or a snowflake of 2154 (kit.ids)
            return Skip(reason="malformed", detail="timestamp: not a plausible time")
        mentions = [] if forwarded else self._people_mentioned(msg, content)
        item = InboundMessage(
            channel=CHANNEL,
            bot_id=self.bot_id,
            message_id=msg.id,
            conversation_id=msg.channel_id,
            conversation_type="direct" if direct else "group",
            thread_id=msg.channel_id if in_thread else None,
            sender_id=msg.author.id,
            sender_name=display_name(msg.author, msg.member),
            sender_is_bot=msg.author.bot or msg.webhook_id is not None,
            addressed=direct or mentioned,
            content=content,
            images=images,
            files=files,
            reply_to=reply_to,
            received_at=received_at,
            mentions=mentions,
            mentioned=mentioned,
            route=Route(user_id=msg.author.id),
        )
        if forwarded:
            item.forwarded = True
        return item

    def _people_mentioned(self, msg: m.Message, content: str) -> list[Mention]:
        """``<@id>`` / ``<@!id>`` in the (bot-mention-free) content, in text order, named
        from ``mentions`` when Discord resolved them; the bot itself is never one."""
        if "<@" not in content:
            return []
        known = {u.id: u for u in msg.mentions}
        out: list[Mention] = []
        for match in _USER_MENTION_RE.finditer(content):
            uid = match.group(1)
            if uid == self.bot_id:
                continue
            user = known.get(uid)
            name = (user.global_name or user.username or None) if user is not None else None
            out.append(Mention(ids={"id": uid}, name=name, text=match.group(0)))
        return out

    def _strip_role_mentions(self, msg: m.Message, content: str) -> tuple[str, bool]:
        """``content`` without mentions of the bot's managed role, and whether it had one."""
        roles = self._roles.get(msg.guild_id or "")
        if not roles:
            return content, False
        mentioned = any(r in roles for r in msg.mention_roles)
        for role in roles:
            token = f"<@&{role}>"
            if token in content:
                mentioned = True
                content = content.replace(token, "")
        return content, mentioned

    def reply_reference(self, msg: m.Message) -> ReplyReference | None:
        """The quoted message, from ``message_reference`` + ``referenced_message``.

        * no reference, or a forward (``message_snapshots``) -> no quote;
        * a reference whose ids are not snowflakes -> ``not-found``, the id is not copied
          and no request is made;
        * a reference into another channel -> ``not-found``, and no request is made;
        * ``referenced_message: null`` -> ``deleted``;
        * a snapshot whose id or channel does not match the reference -> ``not-found``;
        * a snapshot -> id, author id and name, content, attachments (kind by MIME
          prefix, file name), stickers as images;
        * only the reference id -> a lazy ``GET /channels/{channel_id}/messages/{id}``
          for the current channel.
        """
        ref = msg.message_reference
        if ref is None or ref.type == REFERENCE_FORWARD:
            return None
        ref_channel = ref.channel_id or msg.channel_id
        ref_id = ref.message_id
        if ref_id is None:
            return None
        if not is_snowflake(ref_id) or not is_snowflake(ref_channel):
            return ReplyReference(unavailable_reason="not-found")
        if ref_channel != msg.channel_id:
            return ReplyReference(message_id=ref_id, unavailable_reason="not-found")
        quoted = msg.referenced_message
        if quoted is None:
            return ReplyReference(message_id=ref_id, unavailable_reason="deleted")
        if isinstance(quoted, m.QuotedMessage):
            if _other_message(quoted, msg.channel_id, ref_id):
                return ReplyReference(message_id=ref_id, unavailable_reason="not-found")
            return quoted_reference(quoted, ref_id)
        # UNSET: Discord did not resolve it; look it up inside the turn, if we can.
        if self._lookup is None:
            return ReplyReference(message_id=ref_id, unavailable_reason="not-delivered")
        return ReplyReference(message_id=ref_id, loader=self._lookup(msg.channel_id, ref_id))


# --- INTERACTION_CREATE -> Press ---------------------------------------------------------------

#: Interaction type MESSAGE_COMPONENT, component type BUTTON.
INTERACTION_MESSAGE_COMPONENT = 3
COMPONENT_BUTTON = 2
#: Interaction callback types: CHANNEL_MESSAGE_WITH_SOURCE, DEFERRED_UPDATE_MESSAGE,
#: UPDATE_MESSAGE (interactions/receiving-and-responding.mdx).
CALLBACK_DEFERRED_UPDATE = 6
CALLBACK_UPDATE_MESSAGE = 7
#: "Unknown interaction": the 3 s window (or the token) has expired.
UNKNOWN_INTERACTION_CODE = 10062
CUSTOM_ID_MAX = 100
CONTROL_PREFIX = "dshim:ctl:"
OPTION_PREFIX = "dshim:opt:"
#: Buttons per action row, and in all (five rows).
ROW_MAX = 5
BUTTONS_MAX = 25
#: Interaction tokens seen in practice are ~200 characters; anything far longer is no token.
TOKEN_MAX = 1000
ControlAction = Literal["stop", "disable"]


@dataclass(frozen=True, slots=True)
class Route:
    """A mapped message's sender, for the requests a turn shows with buttons (only the
    starter's press is shown as the decision)."""

    user_id: str


def _thread_part(thread_id: str | None) -> str:
    return thread_id if thread_id is not None and is_snowflake(thread_id) else "-"


def control_custom_id(action: str, conversation_id: str, thread_id: str | None) -> str:
    """A control notice button's ``custom_id`` (at most 55 characters for snowflakes)."""
    return f"{CONTROL_PREFIX}{action}:{conversation_id}:{_thread_part(thread_id)}"[:CUSTOM_ID_MAX]


def option_custom_id(number: int, thread_id: str | None) -> str:
    """The ``custom_id`` of option ``number`` (1-based) of a request's buttons."""
    return f"{OPTION_PREFIX}{number}:{_thread_part(thread_id)}"


@dataclass(frozen=True, slots=True)
class ControlPress:
    """A control notice button: the action and the chat it is about."""

    action: ControlAction
    conversation_id: str
    thread_id: str | None


@dataclass(frozen=True, slots=True)
class Press:
    """A press of one of the bot's buttons, ready to be answered.

    Exactly one of ``control`` (a substitute control notice) and ``answer`` (an option
    of an approval or question: a message from the presser whose text is the option's
    number, judged by the pipeline like the typed answer) is set.
    """

    id: str
    #: The interaction token: a secret, for the one callback (not in ``repr``).
    token: str = field(repr=False)
    channel_id: str
    message_id: str
    message_content: str
    user_id: str
    control: ControlPress | None = None
    answer: InboundMessage | None = None


def _parse_thread(value: str) -> str | None | UnsetType:
    if value == "-":
        return None
    return value if is_snowflake(value) else UNSET


def parse_control(custom_id: str) -> ControlPress | None:
    """``dshim:ctl:<action>:<conversation>:<thread|->``, or None."""
    action, _, rest = custom_id[len(CONTROL_PREFIX) :].partition(":")
    conversation, _, thread = rest.partition(":")
    thread_id = _parse_thread(thread)
    if action not in ("stop", "disable") or not is_snowflake(conversation):
        return None
    if isinstance(thread_id, UnsetType):
        return None
    return ControlPress("stop" if action == "stop" else "disable", conversation, thread_id)


def parse_option(custom_id: str) -> tuple[int, str | None] | None:
    """``dshim:opt:<n>:<thread|->`` -> (n, thread id), or None."""
    number, _, thread = custom_id[len(OPTION_PREFIX) :].partition(":")
    thread_id = _parse_thread(thread)
    if not (number.isascii() and number.isdigit() and 1 <= int(number[:3]) <= BUTTONS_MAX):
        return None
    if isinstance(thread_id, UnsetType):
        return None
    return int(number), thread_id


def _valid_token(token: str) -> bool:
    return (
        0 < len(token) <= TOKEN_MAX
        and token.isascii()
        and token.isprintable()
        and ("/" not in token and " " not in token)
    )


def map_interaction(bot_id: str, inter: m.Interaction) -> Press | Skip:
    """An INTERACTION_CREATE payload: a :class:`Press` of one of our buttons, or a Skip.

    Only button presses (type 3, component type 2) on the bot's own messages with a
    dshim ``custom_id`` are presses; other interactions (slash commands, other apps'
    components) are ``ignored``.  Ids must be snowflakes and the token a plausible
    token (it goes into a URL path), else ``malformed``.
    """
    if inter.type != INTERACTION_MESSAGE_COMPONENT:
        return Skip(reason="ignored", detail=f"interaction type {inter.type}")
    data = inter.data
    if data is None or data.component_type != COMPONENT_BUTTON:
        return Skip(reason="ignored", detail="not a button")
    custom_id = data.custom_id
    if not custom_id.startswith((CONTROL_PREFIX, OPTION_PREFIX)):
        return Skip(reason="ignored", detail="not a dshim button")
    presser = inter.member.user if inter.member is not None else None
    presser = presser or inter.user
    message = inter.message
    channel_id = inter.channel_id or (message.channel_id if message is not None else "")
    if (
        presser is None
        or message is None
        or not is_snowflake(inter.id)
        or not is_snowflake(presser.id)
        or not is_snowflake(message.id)
        or not is_snowflake(channel_id)
        or (inter.guild_id is not None and not is_snowflake(inter.guild_id))
        or not _valid_token(inter.token)
        or len(custom_id) > CUSTOM_ID_MAX
    ):
        return Skip(reason="malformed", detail="a button press without valid ids or token")
    base = Press(
        id=inter.id,
        token=inter.token,
        channel_id=channel_id,
        message_id=message.id,
        message_content=message.content,
        user_id=presser.id,
    )
    if custom_id.startswith(CONTROL_PREFIX):
        control = parse_control(custom_id)
        if control is None:
            return Skip(reason="malformed", detail="a control button's custom_id")
        return replace(base, control=control)
    option = parse_option(custom_id)
    if option is None:
        return Skip(reason="malformed", detail="an option button's custom_id")
    number, thread_id = option
    member = inter.member
    answer = InboundMessage(
        channel=CHANNEL,
        bot_id=bot_id,
        message_id=inter.id,
        conversation_id=channel_id,
        conversation_type="direct" if inter.guild_id is None else "group",
        thread_id=thread_id,
        sender_id=presser.id,
        sender_name=display_name(
            presser, m.Member(nick=member.nick) if member is not None else None
        ),
        sender_is_bot=presser.bot,
        addressed=True,
        content=str(number),
        received_at=snowflake_time(inter.id) or 0.0,
    )
    if not plausible_time(answer.received_at):
        return Skip(reason="malformed", detail="an interaction id of no plausible time")
    return replace(base, answer=answer)


class RecentIds:
    """The last ``limit`` interaction ids seen (a Resume may replay a press)."""

    def __init__(self, limit: int = 1024) -> None:
        self._limit = limit
        self._ids: dict[str, None] = {}

    def add(self, item_id: str) -> bool:
        """Remember ``item_id``; False when it was already there."""
        if item_id in self._ids:
            return False
        if len(self._ids) >= self._limit:
            del self._ids[next(iter(self._ids))]
        self._ids[item_id] = None
        return True
