"""QQ official bot, sans-IO: the v2 gateway dialect, OpenAPI errors, passive-reply budgets,
and the mapping of message events (quotes included).

Theory of operation
-------------------
**Gateway.**  QQ's gateway is Discord's state machine with other words, so the session is
the kit's :class:`~dshim.channels.kit.gateway.GatewaySession` with :data:`QQ_GATEWAY`
(bot-docs ``dev-prepare/interface-framework/event-emit.md``, ``opcode.md``,
``error-trace/websocket.md``).  The differences, explicit here:

* the token is ``QQBot <access_token>`` (the same form as the REST header), and it
  expires: the channel sets the current one before every connection;
* Identify carries ``shard: [0, 1]`` and QQ's intents (:func:`intents`); there is no
  ``resume_gateway_url`` (resumes go to the URL of ``GET /gateway/bot``) and no op 3/4/8;
* op 9 Invalid Session: wait 3 s, Identify again (the official SDK's wait);
* close codes: 4004 (token invalid) gets a new token and Identifies once -- a second 4004
  in a row stops the bot; 4006/4007 and 4900-4913 need a new session; 4008 (too fast)
  waits 60 s; 4009 (connection expired, QQ closes sockets periodically) resumes; 4010-4014
  (shard, too many guilds, version, intents not approved), 4914 (delisted) and 4915
  (banned) are fatal; 4001/4002 (our bug) Identify again, with the runner's backoff.

What QQ guarantees: dispatches in order with a growing ``s``; no per-event ACK on the
websocket (nothing to confirm: events are pushed once and replayed only through Resume),
so the only redelivery is a Resume replay and the occasional duplicate push: the
pipeline's persisted dedup on ``(id, msg_idx)`` drops both.

**Replies are passive only** (``server-inter/message/send-receive/send.md``; active pushes
fail since 2025-04-21): every send carries the inbound message's ``msg_id`` and a
``msg_seq`` unique per reply to it; QQ refuses a repeated ``(msg_id, msg_seq)`` with
40054005, so a retry after a timeout reuses its ``msg_seq`` and a send that landed is not
duplicated.  :class:`PassiveBudget` counts the replies of one inbound message: at most 4
within 60 min in C2C, 5 within 5 min in groups and guild channels.

**Quotes** in C2C and groups carry a ``REFIDX_…`` index, not a message id, and there is no
fetch-by-id API: see :meth:`QQMapper.reply_reference`.  Guild messages quote by message id
(``message_reference.message_id``); guild channels have ``GET
/channels/{channel_id}/messages/{message_id}``, guild DMs no lookup at all: see
:meth:`QQMapper.guild_reference`.  Errors: :func:`classify_error` maps an HTTP status
and QQ's ``code``/``err_code`` (``error-trace/openapi.md``) to the error tree once.
Nothing here imports trio or httpx or reads a clock.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

import msgspec
from msgspec import UNSET, UnsetType

from dshim.channels.kit.decode import decode
from dshim.channels.kit.gateway import (
    OP_DISPATCH,
    GatewayDialect,
    GatewaySession,
    GatewayTuning,
)
from dshim.channels.kit.ids import (
    DIGITS,
    TOKEN,
    BadId,
    BadTime,
    check_id,
    check_time,
    shape,
    valid_id,
)
from dshim.channels.qq import models as m
from dshim.errors import (
    AuthError,
    ChannelError,
    FatalChannelError,
    NotFound,
    PermissionDenied,
    RateLimited,
    TransportError,
)
from dshim.model import Attachment, Fetcher, InboundMessage, Loader, MediaRef, ReplyReference, Skip

CHANNEL = "qq"

# --- gateway ----------------------------------------------------------------------------------

# Intents (event-emit.md "事件订阅 intents").  Only approved bits may be asked for: an
# unapproved one closes the socket at Identify with 4013/4014.
GUILDS = 1 << 0
GUILD_MEMBERS = 1 << 1
GUILD_MESSAGES = 1 << 9
DIRECT_MESSAGE = 1 << 12
GROUP_AND_C2C_EVENT = 1 << 25
INTERACTION = 1 << 26
PUBLIC_GUILD_MESSAGES = 1 << 30
#: The default: group and C2C messages, plus guild @-messages and guild DMs.
DEFAULT_INTENTS = GROUP_AND_C2C_EVENT | PUBLIC_GUILD_MESSAGES | DIRECT_MESSAGE

INTENT_NAMES: dict[str, int] = {
    "guilds": GUILDS,
    "guild_members": GUILD_MEMBERS,
    "guild_messages": GUILD_MESSAGES,
    "direct_message": DIRECT_MESSAGE,
    "group_and_c2c_event": GROUP_AND_C2C_EVENT,
    "interaction": INTERACTION,
    "public_guild_messages": PUBLIC_GUILD_MESSAGES,
}


def intents(names: list[str] | None = None) -> int:
    """The intent bitmask for the configured names (None: :data:`DEFAULT_INTENTS`).

    Raises ValueError naming an unknown name."""
    if names is None:
        return DEFAULT_INTENTS
    value = 0
    for name in names:
        bit = INTENT_NAMES.get(name.strip().lower())
        if bit is None:
            raise ValueError(
                f"unknown intent {name!r}; expected some of {', '.join(sorted(INTENT_NAMES))}"
            )
        value |= bit
    return value


INTENTS_HINT = (
    "an intent the bot asks for is not approved for it: enable the events on q.qq.com "
    "(your bot -> 开发设置 / 事件订阅), or set intents for this bot in the configuration to "
    "the approved ones (a bit revoked since the last start only fails at the next Identify)"
)

#: Close codes after which reconnecting cannot help (error-trace/websocket.md).
FATAL_CLOSE_CODES: dict[int, str] = {
    4010: "invalid shard",
    4011: "too many guilds for one shard",
    4012: "invalid API version",
    4013: "invalid intents: " + INTENTS_HINT,
    4014: "intents not allowed: " + INTENTS_HINT,
    4914: "the bot is delisted (sandbox only): add it to the sandbox or publish it",
    4915: "the bot is banned",
}
#: 4004: the token is invalid -- get a new one and Identify; twice in a row is fatal.
TOKEN_CLOSE_CODES: dict[int, str] = {
    4004: "the access token was rejected twice in a row: check app_id and client_secret"
}
NEW_SESSION_CLOSE_CODES = frozenset({4001, 4002, 4006, 4007, *range(4900, 4914)})

QQ_GATEWAY = GatewayDialect(
    platform="QQ",
    fatal_close_codes=FATAL_CLOSE_CODES,
    auth_close_codes=frozenset(TOKEN_CLOSE_CODES),
    new_session_close_codes=NEW_SESSION_CLOSE_CODES,
    refresh_token_close_codes=TOKEN_CLOSE_CODES,
    close_waits_s={4008: 60.0},
    identify_extra={"shard": [0, 1]},
)
#: QQ's timings: 3 s after an Invalid Session (the official SDK's wait).
QQ_TUNING = GatewayTuning(invalid_session_wait_s=(3.0, 3.0))
#: The dispatches the channel reads.  MESSAGE_CREATE is every guild channel message (the
#: private-domain ``guild_messages`` intent); AT_MESSAGE_CREATE only those @-ing the bot.
MESSAGE_EVENTS = frozenset(
    {
        "C2C_MESSAGE_CREATE",
        "GROUP_AT_MESSAGE_CREATE",
        "GROUP_MESSAGE_CREATE",
        "AT_MESSAGE_CREATE",
        "MESSAGE_CREATE",
        "DIRECT_MESSAGE_CREATE",
    }
)
#: Guild channel messages (one conversation ``channel:<channel_id>``).
GUILD_CHANNEL_EVENTS = frozenset({"AT_MESSAGE_CREATE", "MESSAGE_CREATE"})


def auth_header(access_token: str) -> str:
    """``QQBot <access_token>``: the REST ``Authorization`` value and the Identify token."""
    return f"QQBot {access_token}"


def gateway_session(
    *,
    token: str,
    random: Callable[[], float],
    intents: int = DEFAULT_INTENTS,
    gateway_override: str | None = None,
    tuning: GatewayTuning | None = None,
    wanted: frozenset[str] = MESSAGE_EVENTS,
) -> GatewaySession:
    """QQ's gateway session (``token`` in the ``QQBot <access_token>`` form)."""
    return GatewaySession(
        token=token,
        random=random,
        dialect=QQ_GATEWAY,
        intents=intents,
        wanted=wanted,
        gateway_override=gateway_override,
        tuning=tuning or QQ_TUNING,
        properties={"os": "linux", "browser": "dshim", "device": "dshim"},
    )


# --- errors ------------------------------------------------------------------------------------


class ReplyWindowClosed(ChannelError):
    """The passive-reply window or count is used up (304027, 40034128 ...): QQ forbids
    any further reply to this message.  Never retried."""


class AlreadySent(ChannelError):
    """40054005: the same ``msg_id`` + ``msg_seq`` was sent before -- an earlier attempt
    landed.  Counts as sent."""


class PendingAudit(ChannelError):
    """304023/304024: accepted, pending manual audit.  Counts as sent (no id)."""


class MarkdownRejected(ChannelError):
    """50055/50056/50037/50057: markdown invalid or not permitted: send text instead."""


class StreamPrefixRejected(ChannelError):
    """40007: a ``replace`` stream chunk changed the prefix already delivered."""


class ContentRejected(ChannelError):
    """The content was refused (sensitive words, unregistered URL ...)."""


class IpNotAllowed(PermissionDenied):
    """The caller's IP is not on the bot's IP allowlist (q.qq.com console)."""


IP_ALLOWLIST_HINT = (
    "QQ accepts OpenAPI calls only from the server IPs on the bot's allowlist: add this "
    "host's public IP on q.qq.com (开发设置 -> IP白名单)"
)

TOKEN_CODES = frozenset({11241, 11242, 11243})
BAD_APP_CODES = frozenset({11251, 11261})
PERMISSION_CODES = frozenset(
    {11253, 11254, 11262, 11264, 40054013, 40034101, 40054003, 40054002, 304028, 1100301, 40034105}
)
RATE_CODES = frozenset({22009, 20028, 304045, 304050, 1100100, 1100308, 40034100})
#: 50039: "获取消息失败", the answer of a message lookup for an id the channel does not hold.
NOT_FOUND_CODES = frozenset({304026, 40034024, 1100104, 50039})
WINDOW_CODES = frozenset({304027, 304103, 40034005, 40034128, 40034025, 40034026})
ALREADY_SENT_CODES = frozenset({40054005})
AUDIT_CODES = frozenset({304023, 304024})
MARKDOWN_CODES = frozenset({50055, 50056, 50037, 50057})
STREAM_PREFIX_CODES = frozenset({40007})
CONTENT_CODES = frozenset({304003, 40054010, 1100101, 40034006})
RETRY_CODES = frozenset({304082, 304083, 11252, 11263, 50001})
#: A code some deployments answer for a caller outside the IP allowlist (unverified); the
#: message text decides as well.
IP_CODES = frozenset({40023002})
IP_WORDS = ("白名单", "whitelist", "allowlist", "ip not allowed")
#: A retry-after QQ does not state (rate limits carry no header): wait this long.
DEFAULT_RETRY_AFTER_S = 2.0


def error_body(body: bytes) -> m.ErrorBody:
    """QQ's error body; empty when it is not one."""
    try:
        return decode(m.error_decoder, body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return m.ErrorBody()


def classify_error(
    status: int, err: m.ErrorBody, what: str, *, retry_after: float | None = None
) -> ChannelError:
    """An OpenAPI failure (HTTP status plus ``code``/``err_code``) as the error tree.

    ``what`` names the route, never a URL.  See ``protocols/qq.md`` §9 for the table.
    """
    codes = {c for c in (err.code, err.err_code) if c}
    code = err.err_code or err.code or None
    text = f"{what}: HTTP {status}" + (f" code {code}" if code else "")
    if err.message:
        text += f": {err.message[:200]}"
    if err.trace_id:
        text += f" (trace {err.trace_id[:64]})"
    lowered = err.message.lower()
    if codes & IP_CODES or any(w in lowered for w in IP_WORDS):
        return IpNotAllowed(f"{text}: {IP_ALLOWLIST_HINT}", status=status, code=code)
    if codes & ALREADY_SENT_CODES:
        return AlreadySent(text, status=status, code=code)
    if codes & AUDIT_CODES:
        return PendingAudit(text, status=status, code=code)
    if codes & WINDOW_CODES:
        return ReplyWindowClosed(text, status=status, code=code)
    if codes & MARKDOWN_CODES:
        return MarkdownRejected(text, status=status, code=code)
    if codes & STREAM_PREFIX_CODES:
        return StreamPrefixRejected(text, status=status, code=code)
    if status == 401 or codes & TOKEN_CODES:
        return AuthError(
            f"QQ rejected the access token ({text}); if app_id and client_secret are right, "
            "the host's IP may be missing from the bot's IP allowlist on q.qq.com",
            status=status,
            code=code,
        )
    if codes & BAD_APP_CODES:
        return FatalChannelError(f"QQ does not know this app_id ({text})", code=code)
    if 11265 in codes:
        return FatalChannelError(f"the bot is banned ({text})", code=code)
    if status == 429 or codes & RATE_CODES:
        wait = retry_after if retry_after is not None else DEFAULT_RETRY_AFTER_S
        return RateLimited(text, retry_after=wait, status=status, code=code)
    if codes & NOT_FOUND_CODES or status == 404:
        return NotFound(text, status=status, code=code)
    if codes & PERMISSION_CODES or status == 403:
        return PermissionDenied(text, status=status, code=code)
    if codes & CONTENT_CODES:
        return ContentRejected(text, status=status, code=code)
    if status >= 500 or codes & RETRY_CODES:
        return TransportError(text, status=status, code=code, request_sent=True)
    return ChannelError(text, status=status, code=code)


# --- passive replies --------------------------------------------------------------------------

#: Kinds of conversation: C2C, group, guild channel, guild DM.
C2C, GROUP, CHANNEL_KIND, DMS = "c2c", "group", "channel", "dms"
#: Replies per inbound message (the 2026 overview: C2C 4, groups 5).
REPLY_CAPS = {C2C: 4, GROUP: 5, CHANNEL_KIND: 5, DMS: 5}
#: Passive-reply windows in seconds (C2C 60 min, groups and guilds 5 min).
REPLY_WINDOWS_S = {C2C: 3600.0, GROUP: 300.0, CHANNEL_KIND: 300.0, DMS: 300.0}
#: Longest text of one message dshim sends (split beyond, at paragraph/line boundaries).
MAX_MESSAGE_CHARS = 2000


@dataclass(slots=True)
class Route:
    """What a reply to one inbound message needs (``InboundMessage.route``).

    ``received`` is the monotonic time the channel received it (set by the channel; None
    for a message resumed from the durable inbox, whose window then starts at
    ``platform_ts``)."""

    kind: str
    target: str
    msg_id: str
    msg_idx: str | None = None
    platform_ts: float = 0.0
    received: float | None = None


class PassiveBudget:
    """The passive replies left for one inbound message.  Sans-IO: times are arguments.

    :meth:`take` hands out the next ``msg_seq`` (1, 2, ...) while the window is open and
    the cap not reached; a retry of the same reply must reuse the ``msg_seq`` it got.
    """

    __slots__ = ("cap", "deadline", "next_seq", "_base")

    def __init__(self, *, cap: int, deadline: float, first_seq: int = 1) -> None:
        self.cap = cap
        self.deadline = deadline
        self.next_seq = self._base = first_seq

    def left(self, now: float) -> int:
        """Replies that may still be sent now."""
        if now >= self.deadline:
            return 0
        return max(0, self.cap - (self.next_seq - self._base))

    def give_back(self, seq: int) -> None:
        """A reply with ``seq`` was refused (not sent): it may be used again."""
        if seq == self.next_seq - 1:
            self.next_seq = seq

    def take(self, now: float) -> int | None:
        """The ``msg_seq`` of one more reply, or None (window closed or cap reached)."""
        if self.left(now) <= 0:
            return None
        seq = self.next_seq
        self.next_seq += 1
        return seq


def budget_for(route: Route, *, now: float, wall_now: float) -> PassiveBudget:
    """The budget of a route: the window starts when the message was received (or, for a
    message resumed after a restart, at its platform time, ``wall_now`` being the epoch
    now that ``now`` corresponds to; its ``msg_seq`` values then start above the cap)."""
    window = REPLY_WINDOWS_S.get(route.kind, 300.0)
    cap = REPLY_CAPS.get(route.kind, 5)
    age = max(0.0, wall_now - route.platform_ts) if route.platform_ts else 0.0
    if route.received is not None:
        # The platform's time when it is earlier (a message delivered late, by a resume
        # replay), unless the clocks disagree by more than the window itself.
        start = min(route.received, now - age) if age <= window else route.received
        return PassiveBudget(cap=cap, deadline=start + window)
    # Resumed after a restart: the replies sent before it used msg_seq 1..cap at most, so
    # this process counts on from cap + 1 (a notice must not be refused as a duplicate).
    return PassiveBudget(cap=cap, deadline=now - age + window, first_seq=cap + 1)


# --- mapping ----------------------------------------------------------------------------------

#: ``message_type`` values (2026 event pages).
TYPE_ARK, TYPE_CHAT_RECORD, TYPE_QUOTE = 3, 102, 103
#: Attachment kinds by content type prefix; ``voice`` is audio.
MEDIA_PREFIXES = (("image/", "image"), ("video/", "video"), ("audio/", "audio"))
#: ``ref_msg_idx`` of a quoted item that has no stored index (never in ours).
TMP_PREFIX = "TMP_"
#: Quote snapshots and placeholders are cut here (the reply layer cuts again).
SUMMARY_MAX = 200

#: A quoted guild message id that is looked up (printable ASCII, no spaces, not too long).
# Ids (qq.md §1, kit.ids).  They go into URL paths (``/v2/users/{user_openid}/messages``,
# ``/channels/{channel_id}/messages/{message_id}``) and store keys; one of another shape
# is a malformed event, a bad quoted id (``ref_msg_idx``, a guild
# ``message_reference.message_id``) only a quote that is ``not-found``.
#: ``user_openid`` / ``group_openid`` / ``member_openid``: opaque, seen as 32 hex digits.
QQ_OPENID = shape("qq openid", f"[{TOKEN}]+")
#: Message ids: ``ROBOT1.0_…`` (letters, digits, ``_ . - !``; ``=`` ``+`` seen in others)
#: in C2C and groups, hex strings in guilds.
QQ_MESSAGE_ID = shape("qq message", f"[{TOKEN}.!=+]+")
#: A guild ``message_reference.message_id`` (hex, about 40 characters): at most 256.
QQ_GUILD_MESSAGE_ID = shape("qq guild message", f"[{TOKEN}.!=+]{{1,256}}")
#: ``REFIDX_…`` quote indexes (base64, ``==`` at the end) and ``TMP_<uuid>``: store keys.
QQ_INDEX = shape("qq quote index", f"[{TOKEN}=+/]+")
#: Guild ``channel_id`` / ``guild_id``: digit strings.
QQ_GUILD_ID = DIGITS


class LookupFactory(Protocol):
    """``lookup(conversation_id, ref, snapshot, fetch_in=None)`` -> the loader of a quote:
    the message index by ``ref``, then (guild channels) ``GET`` of message ``ref`` in
    channel ``fetch_in``, else ``snapshot`` (None: ``not-found``)."""

    def __call__(
        self,
        conversation_id: str,
        ref: str | None,
        snapshot: ReplyReference | None,
        /,
        *,
        fetch_in: str | None = None,
    ) -> Loader: ...


#: ``media(attachment)`` -> a download handle (None: no download possible).
MediaFactory = Callable[[m.Attachment], Fetcher | None]


def parse_ext(ext: list[str]) -> dict[str, str]:
    """``message_scene.ext`` as a dict: ``key=value`` split on the first ``=`` (REFIDX values
    end in ``==``).  Entries without ``=`` are skipped.  ``auth_token`` is a secret: it never
    leaves the mapping (and :func:`scrub_frame` removes it from the frame the inbox keeps)."""
    out: dict[str, str] = {}
    for item in ext:
        key, sep, value = item.partition("=")
        if sep and key:
            out.setdefault(key.strip(), value.strip())
    return out


_AUTH_TOKEN = re.compile(rb"auth_token=[^\"\\]*")


def scrub_frame(raw: bytes) -> bytes:
    """The frame without the ``auth_token=…`` values of ``message_scene.ext`` (a secret):
    what the durable inbox may keep.  The frame still decodes to the same message."""
    if b"auth_token=" not in raw:
        return raw
    return _AUTH_TOKEN.sub(b"auth_token=", raw)


def parse_timestamp(value: str | int | float | None) -> float | None:
    """RFC 3339 (``2026-01-02T03:04:05+08:00``) or epoch seconds -> epoch seconds."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        t = float(value)
        if t > 1e12:  # milliseconds
            t /= 1000.0
        return t if math.isfinite(t) and t > 0 else None
    text = value.strip()
    if not text or len(text) > 64:
        return None
    if text.isdigit():
        return parse_timestamp(int(text))
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        dt = datetime.fromisoformat(text)
        if dt.tzinfo is None:
            dt = dt.replace(tzinfo=UTC)
        return dt.timestamp()
    except (ValueError, OverflowError):
        return None


def attachment_kind(a: m.Attachment) -> str:
    """image / video / audio (voice) / file."""
    ct = a.content_type.lower()
    if ct == "voice" or a.asr_refer_text is not None or a.voice_wav_url:
        return "audio"
    for prefix, kind in MEDIA_PREFIXES:
        if ct.startswith(prefix):
            return kind
    return "file"


def media_url(url: str) -> str:
    """An attachment URL with a scheme (some payloads omit it)."""
    if url.startswith("//"):
        return "https:" + url
    if url and "://" not in url:
        return "https://" + url
    return url


def _cut(text: str, limit: int = SUMMARY_MAX) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def ark_summary(ark: m.ArkData | None, content: str) -> str:
    """A short readable placeholder of an ARK card (``message_type`` 3)."""
    words = ""
    if ark is not None:
        fields = ark.fields
        words = ark.prompt or (fields.title if fields else None) or ""
        if not words and fields is not None:
            words = fields.desc or ""
        words = words or ark.ark_name or ""
    words = words or content
    return f"[card: {_cut(words)}]" if words.strip() else "[card]"


def chat_record_summary(content: str) -> str:
    """A short readable placeholder of a forwarded chat record (``message_type`` 102)."""
    return f"[chat record: {_cut(content)}]" if content.strip() else "[chat record]"


def _voice_text(attachments: list[m.Attachment]) -> str:
    return "\n".join(a.asr_refer_text.strip() for a in attachments if a.asr_refer_text)


def element_reference(el: m.MsgElement, ref_idx: str | None) -> ReplyReference:
    """The snapshot of a quoted item from ``msg_elements[0]`` (one level; nested
    ``msg_elements`` are not read).  Author fields only when the element carries them."""
    if el.message_type == TYPE_ARK:
        content = ark_summary(el.ark_data, el.content)
    elif el.message_type == TYPE_CHAT_RECORD:
        content = chat_record_summary(el.content)
    else:
        content = el.content.strip() or _voice_text(el.attachments)
    author_id: str | UnsetType = UNSET
    author_name: str | UnsetType = UNSET
    if el.author is not None:
        who = el.author.member_openid or el.author.user_openid or el.author.id
        if who:
            author_id = who
        if el.author.username:
            author_name = el.author.username
    return ReplyReference(
        message_id=ref_idx if ref_idx is not None else UNSET,
        author_id=author_id,
        author_name=author_name,
        content=content or UNSET,
        attachments=[
            Attachment(kind=attachment_kind(a), name=a.filename or None) for a in el.attachments
        ],
    )


def fetched_message(body: bytes) -> m.Message:
    """The message of a ``GET /channels/{channel_id}/messages/{message_id}`` answer: the
    bare object or ``{"message": {...}}`` (both are in QQ's docs).  Raises msgspec's
    DecodeError/ValidationError on anything else."""
    wrapped = decode(m.fetched_decoder, body).message
    if bytes(wrapped) != b"null":
        return m.message_decoder.decode(wrapped)  # inside a bounded document
    return m.message_decoder.decode(body)


def fetched_reference(
    msg: m.Message, *, message_id: str, channel_id: str, bot_id: str
) -> ReplyReference | None:
    """The quote of a guild message fetched by id: content (the bot's own mention token
    removed, as from a message it receives), author id, the member's nick or the user
    name, attachments.  A message with another id or from another channel is None (not
    found)."""
    if msg.id != message_id or (msg.channel_id is not None and msg.channel_id != channel_id):
        return None
    content = msg.content
    if bot_id:
        for token in (f"<@!{bot_id}>", f"<@{bot_id}>"):
            content = content.replace(token, "")
    author = msg.author
    name = (msg.member.nick if msg.member is not None else None) or author.username
    return ReplyReference(
        message_id=message_id,
        author_id=author.id or UNSET,
        author_name=name or UNSET,
        content=content.strip() or UNSET,
        attachments=[
            Attachment(kind=attachment_kind(a), name=a.filename or None) for a in msg.attachments
        ],
    )


class QQMapper:
    """Maps QQ message events for one bot.

    * C2C_MESSAGE_CREATE -> direct, conversation ``c2c:<user_openid>``, sender
      ``user_openid``; GROUP_AT_MESSAGE_CREATE -> group ``group:<group_openid>``, sender
      ``member_openid``, always addressed (QQ delivers only @bot messages);
      GROUP_MESSAGE_CREATE (all group messages, when the owner allowed it) -> addressed
      only when it mentions the bot; AT_MESSAGE_CREATE -> guild channel
      ``channel:<channel_id>`` (addressed); MESSAGE_CREATE (every guild channel message,
      the ``guild_messages`` intent) -> the same conversation, addressed only when it
      mentions the bot (``<@!bot>`` or a ``mentions`` entry); DIRECT_MESSAGE_CREATE ->
      guild DM ``dms:<guild_id>``.
    * The @bot prefix QQ already removed leaves spaces: the content is trimmed, and a
      leading ``<@…>`` token (or one naming the bot anywhere) is removed defensively.
    * ``message_id`` is the message ``id``, or ``id|msg_idx`` when ``message_scene.ext``
      has a ``msg_idx``: the dedup key is ``(id, msg_idx)``.  ``auth_token`` in ``ext``
      never leaves this function.
    * Attachments: images -> images, video/file/voice -> files (voice as ``audio``, its
      ``asr_refer_text`` is the text when there is none), lazy handles.
    * ``message_type`` 3 (ARK card) and 102 (chat record) become a short placeholder; a
      chat record (or a forwarded card) is ``forwarded`` -- never a command.
    * Quotes: :meth:`reply_reference` (C2C, groups), :meth:`guild_reference` (guild
      ``message_reference``).  Messages with nothing for the agent are
      ``ignored``; the bot's own messages are echoes (sender = the bot id), other bots
      ``sender_is_bot``.
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
        self._tokens = (f"<@{bot_id}>", f"<@!{bot_id}>") if bot_id else ()

    def decode_frame(self, raw: bytes | str) -> InboundMessage | Skip:
        """A whole gateway frame as received (replay fixtures, the durable inbox)."""
        try:
            frame = decode(m.frame_decoder, raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Skip(reason="malformed", detail=_short(exc))
        if frame.op != OP_DISPATCH or frame.t not in MESSAGE_EVENTS:
            return Skip(reason="ignored", detail=f"op {frame.op} {frame.t or ''}".strip()[:100])
        return self.decode_message(frame.t, frame.d)

    def decode_message(self, t: str, d: msgspec.Raw | bytes | str) -> InboundMessage | Skip:
        """One message event's ``d``."""
        try:
            if isinstance(d, msgspec.Raw):
                msg = m.message_decoder.decode(d)  # from a frame decoded with bounded depth
            else:
                msg = decode(m.message_decoder, d)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
            return Skip(reason="malformed", detail=f"{t}: {_short(exc)}")
        return self.map_message(t, msg)

    def map_message(self, t: str, msg: m.Message) -> InboundMessage | Skip:
        """One decoded message event; ids and time of the wrong shape are malformed."""
        try:
            return self._map(t, msg)
        except (BadId, BadTime) as exc:
            return Skip(reason="malformed", detail=f"{t}: {_short(exc)}")

    def _map(self, t: str, msg: m.Message) -> InboundMessage | Skip:
        where = self._where(t, msg)
        if where is None:
            return Skip(reason="malformed", detail=f"{t}: no sender or conversation id")
        kind, target, sender = where
        ext = parse_ext(msg.message_scene.ext) if msg.message_scene is not None else {}
        msg_idx = ext.get("msg_idx") or None
        if not msg.id:
            return Skip(reason="malformed", detail=f"{t}: bad message id")
        check_id(msg.id, QQ_MESSAGE_ID, "id")
        if msg_idx is not None:
            check_id(msg_idx, QQ_INDEX, "msg_idx")
        message_id = f"{msg.id}|{msg_idx}" if msg_idx else msg.id
        others = {
            x
            for mention in msg.mentions
            if not mention.is_you
            for x in (mention.id, mention.member_openid, mention.user_openid)
            if x and x != self.bot_id
        }
        content, mentioned = self._strip_mentions(msg.content, others)
        direct = kind in (C2C, DMS)
        if t == "GROUP_AT_MESSAGE_CREATE" or t == "AT_MESSAGE_CREATE":
            addressed = True
        elif t == "GROUP_MESSAGE_CREATE":
            addressed = mentioned or any(
                x.is_you or (x.bot and x.id == self.bot_id) for x in msg.mentions
            )
        elif t == "MESSAGE_CREATE":
            # Guild mentions name the bot by its user id (``<@!id>``, ``mentions[].id``).
            addressed = mentioned or any(
                x.is_you or (bool(self.bot_id) and x.id == self.bot_id) for x in msg.mentions
            )
        else:
            addressed = direct
        forwarded = False
        if msg.message_type == TYPE_ARK:
            forwarded = msg.ark_data is not None and msg.ark_data.ark_type == "forward_msg"
            content = ark_summary(msg.ark_data, content)
        elif msg.message_type == TYPE_CHAT_RECORD:
            forwarded = True
            content = chat_record_summary(content)
        voice = _voice_text(msg.attachments)
        if voice:
            content = f"{content}\n{voice}" if content else voice
        reply_to = None
        if msg.message_type == TYPE_QUOTE or "ref_msg_idx" in ext:
            reply_to = self.reply_reference(msg, ext, f"{kind}:{target}")
        elif kind in (CHANNEL_KIND, DMS) and msg.message_reference is not None:
            reply_to = self.guild_reference(msg, kind, f"{kind}:{target}")
        images: list[MediaRef] = []
        files: list[MediaRef] = []
        for a in msg.attachments:
            a_kind = attachment_kind(a)
            name = a.filename or ("voice.wav" if a_kind == "audio" else None)
            mime = a.content_type if "/" in a.content_type else None
            if a_kind == "audio" and a.voice_wav_url:
                mime = "audio/wav"
            media = MediaRef(
                kind="image" if a_kind == "image" else a_kind,
                name=name,
                mime=mime,
                size=a.size,
                fetch=self._media(a) if self._media is not None else None,
            )
            (images if a_kind == "image" else files).append(media)
        if not content and not images and not files and reply_to is None:
            return Skip(reason="ignored", detail="nothing for the agent", message_id=message_id)
        platform_ts = check_time(parse_timestamp(msg.timestamp) or 0.0, "timestamp")
        author = msg.author
        sender_name = (msg.member.nick if msg.member is not None else None) or author.username
        item = InboundMessage(
            channel=CHANNEL,
            bot_id=self.bot_id,
            message_id=message_id,
            conversation_id=f"{kind}:{target}",
            conversation_type="direct" if direct else "group",
            sender_id=sender,
            sender_name=sender_name or None,
            sender_is_bot=author.bot,
            addressed=addressed,
            content=content,
            images=images,
            files=files,
            reply_to=reply_to,
            received_at=platform_ts,
            route=Route(kind, target, msg.id, msg_idx, platform_ts),
        )
        if forwarded:
            item.forwarded = True
        return item

    def _where(self, t: str, msg: m.Message) -> tuple[str, str, str] | None:
        """(kind, target, sender) of a message event; None when an id is missing."""
        a = msg.author
        where: tuple[str, str, str] | None = None
        if t == "C2C_MESSAGE_CREATE":
            who = a.user_openid or a.id
            where = (C2C, who, who) if who else None
            shapes = (QQ_OPENID, QQ_OPENID)
        elif t in ("GROUP_AT_MESSAGE_CREATE", "GROUP_MESSAGE_CREATE"):
            who = a.member_openid or a.id
            where = (GROUP, msg.group_openid, who) if who and msg.group_openid else None
            shapes = (QQ_OPENID, QQ_OPENID)
        elif t in GUILD_CHANNEL_EVENTS:
            where = (CHANNEL_KIND, msg.channel_id, a.id) if a.id and msg.channel_id else None
            shapes = (QQ_GUILD_ID, QQ_GUILD_ID)  # guild user ids are digit strings too
        elif t == "DIRECT_MESSAGE_CREATE":
            where = (DMS, msg.guild_id, a.id) if a.id and msg.guild_id else None
            shapes = (QQ_GUILD_ID, QQ_GUILD_ID)
        if where is not None:
            check_id(where[1], shapes[0], f"{where[0]} id")
            check_id(where[2], shapes[1], "author id")
            if where[0] == DMS and msg.channel_id:
                check_id(msg.channel_id, QQ_GUILD_ID, "channel_id")
        return where

    def _strip_mentions(self, content: str, others: set[str]) -> tuple[str, bool]:
        """Content without the bot's mention tokens, trimmed, and whether the bot was
        mentioned by token.  A leading ``<@…>`` token that names none of the other users
        in ``mentions`` is taken for a stray @bot token (its id form is not documented)."""
        text = content.strip()
        mentioned = False
        for token in self._tokens:
            if token in text:
                mentioned = True
                text = text.replace(token, "")
        text = text.strip()
        if text.startswith("<@"):
            end = text.find(">")
            if 0 < end <= 80 and text[2:end].lstrip("!") not in others:
                text = text[end + 1 :].strip()
        return text, mentioned

    def reply_reference(
        self, msg: m.Message, ext: Mapping[str, str], conversation_id: str
    ) -> ReplyReference:
        """The quoted message of a ``message_type`` 103 event (or one with ``ref_msg_idx``).

        ``messageId`` is the ``ref_msg_idx`` value.  Inside the turn, with no network
        request: the quote index by ``ref_msg_idx`` first (a user's message with its
        author; the bot's own answer with its exact final text; a ``TMP_…`` index is never
        in it), then the ``msg_elements[0]`` snapshot, else ``not-found``.  Without a
        lookup (pure use) the snapshot, else ``not-found``.
        """
        ref_idx = ext.get("ref_msg_idx") or None
        if ref_idx is not None and not valid_id(ref_idx, QQ_INDEX):
            return ReplyReference(unavailable_reason="not-found")  # never looked up
        snapshot = element_reference(msg.msg_elements[0], ref_idx) if msg.msg_elements else None
        if self._lookup is not None:
            return ReplyReference(
                message_id=ref_idx if ref_idx is not None else UNSET,
                loader=self._lookup(conversation_id, ref_idx, snapshot),
            )
        if snapshot is not None:
            return snapshot
        return ReplyReference(
            message_id=ref_idx if ref_idx is not None else UNSET, unavailable_reason="not-found"
        )

    def guild_reference(self, msg: m.Message, kind: str, conversation_id: str) -> ReplyReference:
        """The quoted message of a guild message (``message_reference.message_id``, a
        message id).

        Inside the turn: the message index by that id first (a user's message with its
        author, the bot's own answer with its exact text); then, in a guild channel, one
        ``GET /channels/{channel_id}/messages/{message_id}`` of the current channel (the
        reference names no other); a guild DM has no message lookup, so a quote the index
        does not know is ``unsupported``.  An id that is empty or not of
        :data:`QQ_GUILD_MESSAGE_ID`'s shape is ``not-found`` and never looked up.  Without a lookup (pure use): a DM's
        ``unsupported``, a channel's ``not-delivered``.
        """
        ref = msg.message_reference
        ref_id = ref.message_id if ref is not None else None
        if not ref_id or not valid_id(ref_id, QQ_GUILD_MESSAGE_ID):
            return ReplyReference(unavailable_reason="not-found")
        channel = msg.channel_id if kind == CHANNEL_KIND else None
        snapshot = (
            None
            if channel is not None
            else ReplyReference(message_id=ref_id, unavailable_reason="unsupported")
        )
        if self._lookup is not None:
            return ReplyReference(
                message_id=ref_id,
                loader=self._lookup(conversation_id, ref_id, snapshot, fetch_in=channel),
            )
        if snapshot is not None:
            return snapshot
        return ReplyReference(message_id=ref_id, unavailable_reason="not-delivered")


def indexable(ref_idx: str | None) -> bool:
    """A ``ref_msg_idx`` that can be in the quote index (not a ``TMP_…`` placeholder)."""
    return bool(ref_idx) and not (ref_idx or "").startswith(TMP_PREFIX)


def _short(exc: BaseException) -> str:
    return str(exc)[:200]


__all__ = [
    "CHANNEL",
    "DEFAULT_INTENTS",
    "MAX_MESSAGE_CHARS",
    "QQ_GATEWAY",
    "AlreadySent",
    "ContentRejected",
    "IpNotAllowed",
    "MarkdownRejected",
    "PassiveBudget",
    "PendingAudit",
    "QQMapper",
    "ReplyWindowClosed",
    "Route",
    "StreamPrefixRejected",
    "auth_header",
    "budget_for",
    "classify_error",
    "fetched_message",
    "fetched_reference",
    "gateway_session",
    "intents",
    "parse_ext",
]
