"""Discord Gateway v10: a sans-IO session state machine and the MESSAGE_CREATE mapping.

Theory of operation
-------------------
:class:`GatewayProtocol` holds everything about the gateway that is not I/O.  The trio
shell (:mod:`.client`) opens websockets, feeds every received text frame to
:meth:`~GatewayProtocol.receive`, calls :meth:`~GatewayProtocol.tick` when
:meth:`~GatewayProtocol.next_timer` is due, performs the returned actions
(:class:`SendFrame`, :class:`CloseConnection`, :class:`Dispatch` ...) and reports the end
of each connection with :meth:`~GatewayProtocol.connection_lost`.  Time is always an
argument (seconds on any monotonic clock); randomness comes from an injected function.

Two lifetimes::

    session (survives reconnects): session_id, resume_gateway_url, seq, the cached
        Get Gateway Bot URL, the identify budget (session_start_limit)
    connection: AWAIT_HELLO -> (Identify | Resume sent) AWAIT_READY -> READY/RESUMED
        CONNECTED -> CLOSED; heartbeat interval, next beat, "ACK pending"

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
  After a Resume the server replays the dispatches we missed, then sends RESUMED; the
  replayed events may include ones we already handled (the pipeline's dedup drops them).
* Close codes 4004, 4010, 4011, 4012, 4013, 4014 are fatal: never reconnect.  4007 and
  4009 need a new session.  Everything else (and network errors) resumes when a session
  exists, with backoff for connections that never got to READY/RESUMED.
* Identify is expensive (1000 per day; exceeding it resets the token): never identify
  while ``session_start_limit.remaining`` is 0 -- wait ``reset_after`` and ask again --
  and at most ``max_concurrency`` identifies per 5 s.

The second half maps a MESSAGE_CREATE dispatch to :class:`~dshim.model.InboundMessage`
(resources/message.mdx; see the rules on :class:`MessageMapper`).  Nothing here imports
trio or httpx or reads a clock.
"""

from __future__ import annotations

import enum
import mimetypes
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec

from dshim.channels.discord import models as m
from dshim.errors import AuthError, FatalChannelError
from dshim.model import (
    Attachment,
    Fetcher,
    InboundMessage,
    Loader,
    MediaRef,
    ReplyReference,
    Skip,
)

CHANNEL = "discord"
API_VERSION = 10

# Gateway opcodes (topics/opcodes-and-status-codes.mdx).
OP_DISPATCH = 0
OP_HEARTBEAT = 1
OP_IDENTIFY = 2
OP_RESUME = 6
OP_RECONNECT = 7
OP_INVALID_SESSION = 9
OP_HELLO = 10
OP_HEARTBEAT_ACK = 11

# Intents (events/gateway.mdx "List of Intents").  MESSAGE_CONTENT is privileged: without
# it Discord sends empty content for guild messages that do not mention the bot.
GUILDS = 1 << 0
GUILD_MESSAGES = 1 << 9
DIRECT_MESSAGES = 1 << 12
MESSAGE_CONTENT = 1 << 15
INTENTS = GUILDS | GUILD_MESSAGES | DIRECT_MESSAGES | MESSAGE_CONTENT

#: Close codes after which reconnecting cannot help (discord.py's set, minus our own 1000).
FATAL_CLOSE_CODES: dict[int, str] = {
    4004: "authentication failed: the bot token is invalid",
    4010: "invalid shard",
    4011: "sharding required: the bot is in too many guilds for one shard",
    4012: "invalid API version",
    4013: "invalid intents",
    4014: "disallowed intents: enable the Message Content intent for this bot in the "
    "Discord Developer Portal (Bot -> Privileged Gateway Intents)",
}
#: Close codes after which the session cannot be resumed (invalid seq, session timed out).
NEW_SESSION_CLOSE_CODES = frozenset({4007, 4009})
#: Our close code when we intend to resume (anything but 1000/1001 keeps the session).
RESUME_CLOSE_CODE = 4000
#: Identify budget window: ``max_concurrency`` identifies per this many seconds.
IDENTIFY_WINDOW_S = 5.0
#: A server that does not say Hello within this time is treated as a failed connection.
HELLO_TIMEOUT_S = 20.0


@dataclass(frozen=True, slots=True)
class GatewayTuning:
    """Timings of the reconnect policy.  Defaults follow Discord's guidance; tests shrink them."""

    #: Delay before reconnect attempt n (n = connections in a row that never got READY or
    #: RESUMED); the last value repeats.  Multiplied by 0.5-1.5 (jitter) except for 0.
    backoff_s: tuple[float, ...] = (0.0, 1.0, 3.0, 5.0, 10.0, 30.0)
    #: Op 9 ``d=false``: wait a random time in this range before identifying again.
    invalid_session_wait_s: tuple[float, float] = (1.0, 5.0)
    #: Spacing between identifies with ``max_concurrency`` 1.
    identify_window_s: float = IDENTIFY_WINDOW_S
    hello_timeout_s: float = HELLO_TIMEOUT_S


class Mode(enum.Enum):
    IDENTIFY = "identify"
    RESUME = "resume"


class ConnState(enum.Enum):
    DISCONNECTED = "disconnected"
    AWAIT_HELLO = "await_hello"
    AWAIT_READY = "await_ready"
    CONNECTED = "connected"
    CLOSING = "closing"


# --- actions the shell performs ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SendFrame:
    """Send this text frame.  ``kind`` is for logs: the payload may contain the token."""

    kind: str
    payload: bytes

    def __repr__(self) -> str:
        return f"SendFrame(kind={self.kind!r})"


@dataclass(frozen=True, slots=True)
class CloseConnection:
    """Close the websocket with this code, then call ``connection_lost``."""

    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class Dispatch:
    """An op 0 event for the application.  ``frame`` is the whole frame as received."""

    t: str
    s: int | None
    d: msgspec.Raw
    frame: bytes


@dataclass(frozen=True, slots=True)
class Connected:
    """READY (``resumed=False``) or RESUMED: the session is live."""

    resumed: bool
    session_id: str
    user: m.User | None = None


@dataclass(frozen=True, slots=True)
class Ignored:
    """A frame that was dropped (malformed, unknown opcode); the shell logs it."""

    reason: str
    detail: str = ""


Action = SendFrame | CloseConnection | Dispatch | Connected | Ignored


@dataclass(frozen=True, slots=True)
class ConnectPlan:
    """What to do next: refresh the gateway info, wait, or connect to ``url`` in ``mode``.

    ``not_before`` is an absolute time on the caller's clock; connect only after it (and
    ask again: the plan may change while waiting).  ``refresh_gateway`` asks the shell to
    call ``GET /gateway/bot`` and hand the result to :meth:`GatewayProtocol.set_gateway_info`.
    """

    mode: Mode
    url: str
    not_before: float
    refresh_gateway: bool = False
    reason: str = ""


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


class GatewayProtocol:
    """The gateway session state machine.  See the module docstring for the rules."""

    def __init__(
        self,
        *,
        token: str,
        random: Callable[[], float],
        intents: int = INTENTS,
        gateway_override: str | None = None,
        tuning: GatewayTuning | None = None,
        properties: dict[str, str] | None = None,
    ) -> None:
        self._token = token
        self._random = random
        self.intents = intents
        self.tuning = tuning or GatewayTuning()
        self._properties = properties or {"os": "linux", "browser": "dshim", "device": "dshim"}
        self._override = gateway_override
        # session
        self.session_id: str | None = None
        self.resume_url: str | None = None
        self.seq: int | None = None
        self.user: m.User | None = None
        self.gateway_url: str | None = None
        # identify budget (session_start_limit)
        self.identify_remaining: int | None = None
        self.identify_reset_at = 0.0
        self.max_concurrency = 1
        self.last_identify_at: float | None = None
        self.identifies = 0
        self._gateway_stale = True
        # reconnect policy
        self.failures = 0
        self._not_before = 0.0
        # connection
        self.state = ConnState.DISCONNECTED
        self.mode: Mode | None = None
        self.heartbeat_interval: float | None = None
        self.next_heartbeat_at: float | None = None
        self.ack_pending = False
        self.last_ack_latency: float | None = None
        self._last_beat_at: float | None = None
        self._hello_deadline: float | None = None
        self._closing_for: Mode | None = None
        self._reached_connected = False
        #: Why we closed the last connection ourselves (for logs and the probe).
        self.last_close_reason: str | None = None

    def __repr__(self) -> str:  # never the token
        return (
            f"GatewayProtocol(state={self.state.value}, session={self.session_id!r}, "
            f"seq={self.seq!r})"
        )

    # -- session / planning ------------------------------------------------------------

    @property
    def can_resume(self) -> bool:
        return self.session_id is not None and self.seq is not None

    def set_gateway_info(self, info: m.GatewayBot, now: float) -> None:
        """Take ``GET /gateway/bot``: the URL to identify on and the identify budget."""
        self.gateway_url = info.url
        limit = info.session_start_limit
        self.identify_remaining = limit.remaining
        self.identify_reset_at = now + max(0.0, limit.reset_after) / 1000.0
        self.max_concurrency = max(1, limit.max_concurrency)
        self._gateway_stale = False

    def gateway_info_unavailable(self) -> bool:
        """``GET /gateway/bot`` failed.  With a configured gateway URL, go on without a
        known identify budget (spacing still applies) and return True; else False."""
        if self._override is None:
            return False
        self.gateway_url = self._override
        self.identify_remaining = None
        self._gateway_stale = False
        return True

    def plan_connection(self, now: float) -> ConnectPlan:
        """Resume when a session exists, else Identify -- within the identify budget."""
        base = self.resume_url or self._override or self.gateway_url
        if self.can_resume and base:
            return ConnectPlan(Mode.RESUME, gateway_url(base), self._not_before)
        if self._gateway_stale or self.gateway_url is None:
            return ConnectPlan(
                Mode.IDENTIFY, "", self._not_before, refresh_gateway=True, reason="gateway_info"
            )
        not_before = self._not_before
        reason = ""
        if self.identify_remaining is not None and self.identify_remaining <= 0:
            if now < self.identify_reset_at:
                # Never identify with no identifies left: wait for the reset, then re-read.
                return ConnectPlan(
                    Mode.IDENTIFY, "", self.identify_reset_at, reason="session_start_limit"
                )
            self._gateway_stale = True
            return ConnectPlan(
                Mode.IDENTIFY, "", now, refresh_gateway=True, reason="session_start_limit"
            )
        if self.last_identify_at is not None:
            spaced = self.last_identify_at + self.tuning.identify_window_s / self.max_concurrency
            if spaced > not_before:
                not_before, reason = spaced, "identify_spacing"
        base = self._override or self.gateway_url
        return ConnectPlan(Mode.IDENTIFY, gateway_url(base), not_before, reason=reason)

    # -- connection --------------------------------------------------------------------

    def connection_opened(self, mode: Mode, now: float) -> None:
        """A websocket to the planned URL is open; expect Hello."""
        self.state = ConnState.AWAIT_HELLO
        self.mode = mode
        self.heartbeat_interval = None
        self.next_heartbeat_at = None
        self.ack_pending = False
        self._last_beat_at = None
        self._hello_deadline = now + self.tuning.hello_timeout_s
        self._closing_for = None
        self._reached_connected = False

    def next_timer(self) -> float | None:
        """When :meth:`tick` must run next (None: nothing scheduled)."""
        if self.state is ConnState.AWAIT_HELLO:
            return self._hello_deadline
        if self.state in (ConnState.AWAIT_READY, ConnState.CONNECTED):
            return self.next_heartbeat_at
        return None

    def tick(self, now: float, *, reading: bool = True) -> list[Action]:
        """Timers: the Hello deadline, heartbeats and zombie detection.

        ``reading=False`` says the shell is not reading frames right now (the pipeline is
        applying backpressure): an ACK may be waiting unread, so beats continue and the
        zombie verdict waits until reading resumes.
        """
        if self.state is ConnState.AWAIT_HELLO:
            if self._hello_deadline is not None and now >= self._hello_deadline:
                return [self._close(RESUME_CLOSE_CODE, "no hello", Mode.RESUME)]
            return []
        if self.state not in (ConnState.AWAIT_READY, ConnState.CONNECTED):
            return []
        if self.next_heartbeat_at is None or now < self.next_heartbeat_at:
            return []
        assert self.heartbeat_interval is not None
        if self.ack_pending and reading:
            # The previous beat was never acknowledged: the connection is a zombie.
            return [self._close(RESUME_CLOSE_CODE, "heartbeat not acknowledged", Mode.RESUME)]
        self.next_heartbeat_at = now + self.heartbeat_interval
        return [self._heartbeat(now)]

    def receive(self, data: str | bytes, now: float) -> list[Action]:
        """One text frame from the server.  Malformed frames become :class:`Ignored`."""
        if self.state in (ConnState.CLOSING, ConnState.DISCONNECTED):
            return []
        try:
            frame = m.frame_decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return [Ignored("malformed_frame", str(exc)[:200])]
        op = frame.op
        if op == OP_DISPATCH:
            return self._dispatch(frame, data, now)
        if op == OP_HEARTBEAT_ACK:
            if self.ack_pending and self._last_beat_at is not None:
                self.last_ack_latency = now - self._last_beat_at
            self.ack_pending = False
            return []
        if op == OP_HEARTBEAT:
            return [self._heartbeat(now)]
        if op == OP_HELLO:
            return self._hello(frame, now)
        if op == OP_RECONNECT:
            return [self._close(RESUME_CLOSE_CODE, "reconnect requested", Mode.RESUME)]
        if op == OP_INVALID_SESSION:
            try:
                resumable = msgspec.json.decode(frame.d, type=bool)
            except (msgspec.DecodeError, msgspec.ValidationError):
                resumable = False
            if resumable and self.session_id is not None:
                return [self._close(RESUME_CLOSE_CODE, "invalid session (resumable)", Mode.RESUME)]
            # d=false: the session is gone; identify afresh after 1-5 s.
            self._forget_session()
            lo, hi = self.tuning.invalid_session_wait_s
            self._not_before = now + lo + (hi - lo) * self._random()
            return [self._close(1000, "invalid session", Mode.IDENTIFY)]
        return [Ignored("unknown_opcode", str(op))]

    def connection_lost(self, code: int | None, now: float) -> None:
        """The websocket ended (``code`` None for network errors).  Plans the next step.

        Raises :class:`~dshim.errors.AuthError` (4004) or
        :class:`~dshim.errors.FatalChannelError` for fatal close codes.
        """
        requested = self._closing_for
        reached = self._reached_connected
        self.state = ConnState.DISCONNECTED
        self.mode = None
        self.next_heartbeat_at = None
        self.heartbeat_interval = None
        self._closing_for = None
        if requested is None and code in FATAL_CLOSE_CODES:
            message = f"Discord closed the gateway with {code}: {FATAL_CLOSE_CODES[code]}"
            if code == 4004:
                raise AuthError(message, code=code)
            raise FatalChannelError(message, code=code)
        if requested is None and code in NEW_SESSION_CLOSE_CODES:
            self._forget_session()
        if reached:
            self.failures = 0
        else:
            self.failures += 1
        if requested is not None and reached:
            # Our own close of a healthy connection (op 7, op 9, zombie): go again at once
            # (op 9 d=false already set its 1-5 s wait).
            self._not_before = max(self._not_before, now)
            return
        steps = self.tuning.backoff_s
        base = steps[min(self.failures, len(steps) - 1)] if steps else 0.0
        delay = base * (0.5 + self._random()) if base > 0 else 0.0
        self._not_before = max(self._not_before, now + delay)
        if self.failures >= 3 and not self.can_resume:
            # Identify URL keeps failing: ask Discord for a fresh one.
            self._gateway_stale = True

    # -- internals ---------------------------------------------------------------------

    def _forget_session(self) -> None:
        self.session_id = None
        self.resume_url = None
        self.seq = None

    def _close(self, code: int, reason: str, then: Mode) -> CloseConnection:
        self.last_close_reason = reason
        self.state = ConnState.CLOSING
        self._closing_for = then
        return CloseConnection(code, reason)

    def _heartbeat(self, now: float) -> SendFrame:
        self.ack_pending = True
        self._last_beat_at = now
        return SendFrame("heartbeat", m.encode({"op": OP_HEARTBEAT, "d": self.seq}))

    def _hello(self, frame: m.Frame, now: float) -> list[Action]:
        if self.state is not ConnState.AWAIT_HELLO:
            return [Ignored("unexpected_hello")]
        try:
            hello = m.hello_decoder.decode(frame.d)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return [Ignored("malformed_hello", str(exc)[:200])]
        if hello.heartbeat_interval <= 0:
            return [Ignored("malformed_hello", "heartbeat_interval <= 0")]
        interval = hello.heartbeat_interval / 1000.0
        self.heartbeat_interval = interval
        # Jitter on the first beat keeps many clients from beating in lock-step.
        self.next_heartbeat_at = now + interval * self._random()
        self.ack_pending = False
        self.state = ConnState.AWAIT_READY
        if self.mode is Mode.RESUME:
            if not self.can_resume:  # the session was lost meanwhile: plan again
                return [self._close(RESUME_CLOSE_CODE, "session lost", Mode.IDENTIFY)]
            return [
                SendFrame(
                    "resume",
                    m.encode(
                        {
                            "op": OP_RESUME,
                            "d": {
                                "token": self._token,
                                "session_id": self.session_id,
                                "seq": self.seq,
                            },
                        }
                    ),
                )
            ]
        self._forget_session()
        self.last_identify_at = now
        self.identifies += 1
        if self.identify_remaining is not None:
            self.identify_remaining -= 1
        return [
            SendFrame(
                "identify",
                m.encode(
                    {
                        "op": OP_IDENTIFY,
                        "d": {
                            "token": self._token,
                            "intents": self.intents,
                            "properties": self._properties,
                        },
                    }
                ),
            )
        ]

    def _dispatch(self, frame: m.Frame, data: str | bytes, now: float) -> list[Action]:
        if frame.s is not None:
            self.seq = frame.s
        t = frame.t or ""
        raw = data.encode() if isinstance(data, str) else data
        out: list[Action] = []
        if t == "READY":
            try:
                ready = m.ready_decoder.decode(frame.d)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                return [Ignored("malformed_ready", str(exc)[:200])]
            self.session_id = ready.session_id
            self.resume_url = ready.resume_gateway_url
            self.user = ready.user
            self._connected()
            out.append(Connected(False, ready.session_id, ready.user))
        elif t == "RESUMED":
            self._connected()
            out.append(Connected(True, self.session_id or ""))
        out.append(Dispatch(t, frame.s, frame.d, raw))
        return out

    def _connected(self) -> None:
        self.state = ConnState.CONNECTED
        self._reached_connected = True
        self.failures = 0


# --- MESSAGE_CREATE -> InboundMessage --------------------------------------------------------

#: Message types that carry a user's text: DEFAULT and REPLY (resources/message.mdx).
USER_MESSAGE_TYPES = frozenset({0, 19})
#: Channel types of threads: announcement, public and private threads.
THREAD_CHANNEL_TYPES = frozenset({10, 11, 12})
#: message_reference.type of a forward (its content is in message_snapshots, not a quote).
REFERENCE_FORWARD = 1
DISCORD_EPOCH_MS = 1420070400000

#: ``lookup(channel_id, message_id)`` -> a loader that fetches that message.
LookupFactory = Callable[[str, str], Loader]
#: ``media(attachment)`` -> a download handle (None: no download possible).
MediaFactory = Callable[[m.Attachment], Fetcher | None]


def snowflake_time(snowflake: str) -> float | None:
    """Epoch seconds encoded in a snowflake id, or None when it is not one."""
    try:
        value = int(snowflake)
    except ValueError:
        return None
    if value <= 0:
        return None
    return ((value >> 22) + DISCORD_EPOCH_MS) / 1000.0


def parse_timestamp(value: str | None) -> float | None:
    """ISO 8601 as Discord writes it (``2026-01-02T03:04:05.678000+00:00``) -> epoch s."""
    if not value:
        return None
    text = value.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        return None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp()


def display_name(user: m.User | None, member: m.Member | None) -> str | None:
    """Member nick, else ``global_name``, else ``username``."""
    if member is not None and member.nick:
        return member.nick
    if user is None:
        return None
    return user.global_name or user.username or None


def attachment_kind(content_type: str | None, filename: str | None = None) -> str:
    """image/video/audio by MIME prefix; anything else is a file.  Without a content type
    the file name's extension decides."""
    if not content_type and filename:
        content_type = mimetypes.guess_type(filename, strict=False)[0]
    ct = (content_type or "").lower()
    for prefix in ("image", "video", "audio"):
        if ct.startswith(prefix + "/"):
            return prefix
    return "file"


def _other_message(q: m.QuotedMessage, channel_id: str, message_id: str) -> bool:
    """The snapshot names another message or channel than the reference."""
    return (q.id is not None and q.id != message_id) or (
        q.channel_id is not None and q.channel_id != channel_id
    )


def quoted_reference(q: m.QuotedMessage, message_id: str | None = None) -> ReplyReference:
    """A quoted message snapshot (``referenced_message`` or a fetched message)."""
    attachments = [
        Attachment(kind=attachment_kind(a.content_type, a.filename), name=a.filename)
        for a in q.attachments
    ]
    attachments += [Attachment(kind="image", name=s.name or None) for s in q.sticker_items]
    author = q.author
    return ReplyReference(
        message_id=q.id or message_id,
        author_id=author.id if author is not None else None,
        author_name=display_name(author, q.member),
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


class MessageMapper:
    """Maps MESSAGE_CREATE payloads for one bot.

    * ``guild_id`` absent -> direct, else group; ``conversation_id`` = ``channel_id``; a
      message inside a thread (thread ``channel_type``, or a ``position``) also has
      ``thread_id`` = its channel id (replies go to the thread).
    * ``sender_name`` = member nick, else ``global_name``, else ``username``;
      ``sender_is_bot`` = ``author.bot`` or a webhook message.  The bot's own messages
      keep ``sender_id`` = the bot id (the pipeline drops them as echoes).
    * Addressed: a DM, or the bot's id in ``mentions`` or ``<@id>`` / ``<@!id>`` in the
      content.  Replying to the bot without a mention does not address it.  The bot's
      mention is removed from the content, which is then trimmed.
    * Attachments: image content types -> images, everything else -> files.
    * System messages (types other than DEFAULT and REPLY) are skipped as ``ignored``.
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

    def decode_frame(self, raw: bytes | str) -> InboundMessage | Skip:
        """A whole gateway frame as received (replay fixtures, the durable inbox)."""
        try:
            frame = m.frame_decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Skip(reason="malformed", detail=str(exc)[:200])
        if frame.op != OP_DISPATCH or frame.t != "MESSAGE_CREATE":
            return Skip(reason="ignored", detail=f"op {frame.op} {frame.t or ''}".strip())
        return self.decode_message(frame.d)

    def decode_message(self, d: msgspec.Raw | bytes | str) -> InboundMessage | Skip:
        """A MESSAGE_CREATE ``d`` payload."""
        try:
            msg = m.message_decoder.decode(d)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Skip(reason="malformed", detail=str(exc)[:200])
        return self.map_message(msg)

    def map_message(self, msg: m.Message) -> InboundMessage | Skip:
        if msg.type not in USER_MESSAGE_TYPES:
            return Skip(reason="ignored", detail=f"message type {msg.type}", message_id=msg.id)
        direct = msg.guild_id is None
        content = msg.content
        mentioned = any(u.id == self.bot_id for u in msg.mentions)
        for token in self._tokens:
            if token in content:
                mentioned = True
                content = content.replace(token, "")
        in_thread = msg.channel_type in THREAD_CHANNEL_TYPES or msg.position is not None
        images: list[MediaRef] = []
        files: list[MediaRef] = []
        for a in msg.attachments:
            kind = attachment_kind(a.content_type, a.filename)
            ref = MediaRef(
                kind="image" if kind == "image" else "file",
                name=a.filename or None,
                mime=a.content_type,
                size=a.size,
                fetch=self._media(a) if self._media is not None else None,
            )
            (images if kind == "image" else files).append(ref)
        received_at = parse_timestamp(msg.timestamp) or snowflake_time(msg.id) or 0.0
        return InboundMessage(
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
            content=content.strip(),
            images=images,
            files=files,
            reply_to=self.reply_reference(msg),
            received_at=received_at,
        )

    def reply_reference(self, msg: m.Message) -> ReplyReference | None:
        """The quoted message, from ``message_reference`` + ``referenced_message``.

        * no reference, or a forward (``message_snapshots``) -> no quote;
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
