"""Slack, sans-IO: the Socket Mode connection, Web API errors, and the event mapping.

Theory of operation
-------------------
**Connections.**  Socket Mode (docs.slack.dev/apis/events-api/using-socket-mode) hands
out a fresh ``wss://`` URL per connection from ``apps.connections.open`` (app token).
One :class:`SocketSession` (a :class:`~dshim.net.ws_session.WsSession`, run by the
kit's :func:`~dshim.net.ws.run_ws_handover`) drives one websocket::

    AWAIT_HELLO --hello--> READY --disconnect(warning|refresh_requested)--> DRAINING
         |                   |                                    (Handover: the runner
         |                   |                                     opens the next socket;
         +--timeout/close----+--close / dead socket--> CLOSED      once it said hello this
                                                                   one is closed: REPLACED)

What Slack guarantees: at-least-once delivery -- an envelope not acknowledged within 3 s
is sent again, up to 3 times (roughly at once, +1 min, +5 min), to any open connection
of the app; no ordering across connections (an app may hold up to 10); events from a
time without any socket arrive only as such retries, if at all.

- The connection is ready only after ``hello`` (``connection_info.app_id`` is ours).
- Every envelope is acknowledged **at once** with ``{"envelope_id": ...}``, before the
  pipeline sees it: Slack redelivers an envelope not acknowledged within 3 s, which is
  shorter than an accept can take (store writes), so the ack cannot wait for the
  verdict (CHANNELS.md §4's exception).  Redeliveries (``retry_attempt`` 1..3, possibly
  with the same ``envelope_id``) are therefore expected and dropped by the pipeline's
  persisted dedup on ``(channel, ts)``; they are never dropped for ``retry_attempt > 0``,
  because redeliveries are also how events from a gap without a socket arrive.
  Envelopes whose payload does not decode are acknowledged too (else they come back).
- ``disconnect`` frames: ``warning`` (this socket closes in ~10 s) and
  ``refresh_requested`` (routine recycle) ask for a :class:`Handover`: the runner opens
  the next connection first and closes this one once the new one said hello, so no
  event falls into the gap (Slack may send any payload to any open connection).
  ``too_many_websockets`` closes this one, and the next connection waits at least
  ``too_many_backoff_s`` (:attr:`SocketSession.not_before`); ``link_disabled`` (Socket
  Mode switched off) is fatal.
- Liveness: trio-websocket answers Slack's pings; the session asks for an own ping every
  ``ping_interval_s`` (:class:`~dshim.net.ws_session.Ping`, its pong reported with
  :meth:`SocketSession.pong`) and declares the socket dead when no pong came
  within ``pong_timeout_s`` or nothing at all (frame or pong) for ``silence_s`` —
  20 s / 60 s, because 5 s watchdogs cause false reconnects while Slack recycles its
  containers (bolt-js #2496).  While the runner's reader is blocked in a delivery the
  watchdog does not judge (a pong may be waiting unread).

**Mapping** (:class:`EventMapper`, pure): ``message`` (``message.im``, ``.channels``,
``.groups``, ``.mpim``) and ``app_mention`` events become
:class:`~dshim.model.InboundMessage` with ``message_id`` = ``ts`` and
``conversation_id`` = ``channel`` — the pipeline's dedup key ``(channel, ts)`` makes the
``message``/``app_mention`` twins of one human message and redeliveries one prompt.
The answer always goes into the thread (``thread_ts``, or the message's own ``ts`` for a
top-level message), and in channels a thread is one conversation: ``thread_id`` =
``thread_ts`` for a reply, and the message's own ``ts`` for a top-level message the bot
answers (a mention), so the mention and every later reply in its thread share one lane
and one harness session.  A DM stays one conversation (a top-level DM message has no
``thread_id``); an unaddressed top-level channel message opens no thread of its own.

Quotes: Slack has no quote-reply.  (a) A thread reply quotes the thread parent, but
only the first time in a thread: once the bot answers in a thread, later replies there
are conversation, not quotes — the parent is already in that conversation.  The mapper
counts a thread as the bot's once it mapped an addressed message in it (or a top-level
one whose thread the answer opens), and the outbound side tells it (persisted) about
every thread it posted into; a thread whose parent is the bot's own message is the
bot's too.  (b) Otherwise the first permalink of this workspace in the text
(``/archives/<C>/p<digits>``) quotes that message; the link stays in the text.  Lookups
run lazily inside the turn, in the current channel only: ``conversations.history``
(``latest=ts, inclusive, limit=1``, the returned ``ts`` checked) for top-level targets,
``conversations.replies`` for targets inside a thread.  A permalink into another
conversation is ``not-found`` without a request; a missing history scope (known from
``x-oauth-scopes``) is ``permission-denied`` without a request.  Error strings map as
protocols/slack.md §6 (:func:`classify_error`).

Substitute mode: ``mentions`` are the ``<@U…>`` / ``<@U…|label>`` tokens of the message's
own text in order (kind ``id``; the bot's own is not one, nor one on a ``&gt;`` quoted
line), named by the label or the name learned from that person's messages;
``mentioned`` is the bot's own mention (``app_mention`` or ``<@bot>``).  A channel
message that mentions only a person arrives only as a ``message`` event
(``message.channels`` / ``message.groups``) and reaches the pipeline unaddressed, which
decides whether it triggers.  Presses on a control notice's buttons
(:func:`control_press`) are not messages.

Nothing here imports trio or httpx or reads a clock: time is an argument.
"""

from __future__ import annotations

import enum
import re
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Literal

import msgspec
from msgspec import UNSET, UnsetType

from dshim.channels.kit.decode import decode
from dshim.channels.kit.ids import plausible_time
from dshim.channels.slack import models as m
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
from dshim.net.ws_session import (
    Action,
    Close,
    Connected,
    Deliver,
    Handover,
    Ignored,
    Ping,
    Send,
    WsEnded,
)

CHANNEL = "slack"
#: Our close code for a socket we replace or declare dead (never a fatal one).
RECONNECT_CLOSE_CODE = 4000
#: Message subtypes that are user messages; everything else is not new user content.
USER_SUBTYPES = frozenset({None, "file_share", "thread_broadcast"})
#: Threads the mapper remembers as the bot's (bounded, oldest forgotten).
MAX_THREADS = 5000
#: Sender display names remembered for ``<@U…>`` decoding (bounded).
MAX_NAMES = 2000

_TS = re.compile(r"\d{1,12}\.\d{1,9}")
_ID = re.compile(r"[A-Z0-9][A-Z0-9_-]{0,39}")
_TOKEN = re.compile(r"<([^<>]{1,2000})>")
_PERMALINK = re.compile(
    r"https?://([A-Za-z0-9.-]+)/archives/([A-Z0-9]{1,40})/p(\d{7,22})(\?[^\s|>]*)?"
)
#: Error strings (protocols/slack.md §4, §6), mapped once here.
AUTH_ERRORS = frozenset(
    {"invalid_auth", "not_authed", "token_revoked", "token_expired", "account_inactive"}
)
PERMISSION_ERRORS = frozenset(
    {
        "missing_scope",
        "not_in_channel",
        "access_denied",
        "channel_is_limited_access",
        "ekm_access_denied",
        "is_archived",
        "restricted_action",
        "restricted_action_read_only_channel",
        "restricted_action_thread_only_channel",
        "restricted_action_non_threadable_channel",
        "cant_update_message",
        "edit_window_closed",
        "message_not_owned_by_app",
        "not_allowed_token_type",
        "team_access_not_granted",
        "forbidden_team",
    }
)
NOT_FOUND_ERRORS = frozenset(
    {"channel_not_found", "thread_not_found", "message_not_found", "file_not_found"}
)
TRANSIENT_ERRORS = frozenset(
    {"service_unavailable", "fatal_error", "internal_error", "request_timeout"}
)
RATE_ERRORS = frozenset({"ratelimited", "rate_limited"})
#: Native streaming is not available here: fall back to chat.postMessage + chat.update.
STREAM_UNAVAILABLE = frozenset(
    {
        "channel_type_not_supported",
        "method_not_supported_for_channel_type",
        "deprecated_endpoint",
        "messages_tab_disabled",
        "unknown_method",
        "not_allowed_token_type",
        "missing_recipient_user_id",
        "missing_recipient_team_id",
        "missing_scope",
    }
)
#: History scope per conversation type (protocols/slack.md §6).
HISTORY_SCOPES = {
    "im": "im:history",
    "channel": "channels:history",
    "group": "groups:history",
    "mpim": "mpim:history",
}


def classify_error(method: str, error: str | None, *, status: int | None = None) -> ChannelError:
    """A Web API ``{"ok": false, "error": ...}`` as the error tree (``code`` = the string)."""
    code = error or "unknown_error"
    text = f"{method}: {code}"
    if code in AUTH_ERRORS:
        return AuthError(text, status=401, code=code)
    if code in PERMISSION_ERRORS:
        return PermissionDenied(text, code=code)
    if code in NOT_FOUND_ERRORS:
        return NotFound(text, code=code)
    if code in RATE_ERRORS:
        return RateLimited(text, retry_after=1.0, code=code)
    if code in TRANSIENT_ERRORS:
        return TransportError(text, status=status, code=code, request_sent=True)
    return ChannelError(text, status=status, code=code)


def _short(exc: Exception) -> str:
    return str(exc)[:200]


# --- Socket Mode connection --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SocketTuning:
    """Socket Mode timings (seconds)."""

    #: A server that does not say hello within this time: the connection failed.
    hello_timeout_s: float = 15.0
    #: An own websocket ping this often.
    ping_interval_s: float = 10.0
    #: No pong within this time after a ping: the socket is dead (half-open).
    pong_timeout_s: float = 20.0
    #: No frame and no pong for this long: the socket is dead.
    silence_s: float = 60.0
    #: After a ``warning``/``refresh_requested``, the old socket is closed at the latest
    #: this long after the handover began (Slack closes it ~10 s after a warning).
    handover_grace_s: float = 10.0
    #: ``too_many_websockets``: wait at least this long before the next connection.
    too_many_backoff_s: float = 30.0


@dataclass(slots=True)
class Incoming:
    """An envelope for the channel: ``events_api`` or ``interactive``, with its raw frame."""

    envelope: m.Envelope
    raw: bytes


class SocketState(enum.Enum):
    AWAIT_HELLO = "await_hello"
    READY = "ready"
    DRAINING = "draining"
    CLOSED = "closed"


SocketAction = Action[Incoming]
#: How the runner closes a connection that handed over (``run_ws_handover(close_replaced=)``).
REPLACED = Close(RECONNECT_CLOSE_CODE, "replaced")


def ack_frame(envelope_id: str) -> Send:
    """The acknowledgement of one envelope (kept out of the log: one per event)."""
    return Send(m.encode({"envelope_id": envelope_id}).decode(), kind="ack", logged=False)


class SocketSession:
    """One Socket Mode websocket without I/O (see the module docstring): a
    :class:`~dshim.net.ws_session.WsSession` that judges liveness by its own pings
    (:class:`~dshim.net.ws_session.Pinging`)."""

    def __init__(self, *, app_id: str | None = None, tuning: SocketTuning | None = None) -> None:
        self.app_id = app_id
        self.tuning = tuning or SocketTuning()
        self.state = SocketState.AWAIT_HELLO
        self.opened_at: float | None = None
        self.last_seen = 0.0
        self.ping_due: float | None = None
        self.ping_sent_at: float | None = None
        #: Why this connection ended from the server's side (disconnect reason).
        self.disconnect_reason: str | None = None
        self.num_connections: int | None = None
        self.envelopes = 0
        #: The earliest time of the next connection, when the server asked for a wait.
        self.not_before: float | None = None

    def connection_opened(self, now: float) -> list[SocketAction]:
        self.opened_at = now
        self.last_seen = now
        return []

    @property
    def ready(self) -> bool:
        return self.state is SocketState.READY

    def next_timer(self) -> float | None:
        t = self.tuning
        if self.state is SocketState.CLOSED or self.opened_at is None:
            return None
        if self.state is SocketState.AWAIT_HELLO:
            return self.opened_at + t.hello_timeout_s
        times = [self.last_seen + t.silence_s]
        if self.ping_sent_at is not None:
            times.append(self.ping_sent_at + t.pong_timeout_s)
        elif self.ping_due is not None:
            times.append(self.ping_due)
        return min(times)

    def tick(self, now: float, *, reading: bool = True) -> list[SocketAction]:
        t = self.tuning
        if self.state is SocketState.CLOSED or self.opened_at is None:
            return []
        if self.state is SocketState.AWAIT_HELLO:
            if now >= self.opened_at + t.hello_timeout_s:
                return [self._close("no hello")]
            return []
        if not reading:
            # Blocked in a delivery: a pong may be waiting unread.  Judge afterwards
            # (every deadline moves past now, so the timer does not spin).
            self.last_seen = max(self.last_seen, now - t.silence_s / 2)
            if self.ping_sent_at is not None:
                self.ping_sent_at = max(self.ping_sent_at, now - t.pong_timeout_s / 2)
        elif self.ping_sent_at is not None and now >= self.ping_sent_at + t.pong_timeout_s:
            return [self._close("no pong")]
        elif now >= self.last_seen + t.silence_s:
            return [self._close("silent")]
        if self.ping_sent_at is None and self.ping_due is not None and now >= self.ping_due:
            self.ping_sent_at = now
            self.ping_due = None
            return [Ping()]
        return []

    def pong(self, now: float) -> None:
        """The answer to our ping arrived."""
        self.last_seen = now
        self.ping_sent_at = None
        self.ping_due = now + self.tuning.ping_interval_s

    def _close(self, why: str) -> Close:
        self.state = SocketState.CLOSED
        return Close(RECONNECT_CLOSE_CODE, why)

    def receive(self, data: str | bytes, now: float) -> list[SocketAction]:
        raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
        self.last_seen = now
        try:
            env = decode(m.envelope_decoder, raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return self._undecodable(raw, exc)
        kind = env.type
        if kind == "hello":
            return self._hello(env, now)
        if kind == "disconnect":
            return self._disconnect(env)
        actions: list[SocketAction] = []
        if env.envelope_id:
            ack = ack_frame(env.envelope_id)
        else:
            return [Ignored("malformed", f"{kind or 'frame'} without envelope_id")]
        if kind in ("events_api", "interactive"):
            self.envelopes += 1
            actions.append(Deliver(Incoming(env, raw), ack=ack, ack_at_once=True))
            return actions
        # slash_commands and anything new: acknowledged, not for us.
        return [ack, Ignored("ignored", f"envelope type {kind[:40]!r}")]

    def _undecodable(self, raw: bytes, exc: Exception) -> list[SocketAction]:
        """A frame that does not decode: acknowledge it if its envelope id is readable."""
        actions: list[SocketAction] = []
        envelope_id: str | None = None
        try:
            envelope_id = decode(m.envelope_id_decoder, raw).envelope_id
        except (msgspec.DecodeError, msgspec.ValidationError):
            match = re.search(rb'"envelope_id"\s*:\s*"([A-Za-z0-9_.:-]{1,200})"', raw[:100_000])
            if match:
                envelope_id = match.group(1).decode("ascii")
        if envelope_id:
            actions.append(ack_frame(envelope_id))
        actions.append(Ignored("malformed", _short(exc)))
        return actions

    def _hello(self, env: m.Envelope, now: float) -> list[SocketAction]:
        info = env.connection_info
        if self.app_id and info is not None and info.app_id and info.app_id != self.app_id:
            self.disconnect_reason = "wrong_app"
            return [self._close("hello for another app")]
        if info is not None and info.app_id and self.app_id is None:
            self.app_id = info.app_id
        self.num_connections = env.num_connections
        if self.state is not SocketState.AWAIT_HELLO:
            return [Ignored("ignored", "second hello")]
        self.state = SocketState.READY
        self.ping_due = now + self.tuning.ping_interval_s
        return [Connected(session=f"connections={env.num_connections}")]

    def _disconnect(self, env: m.Envelope) -> list[SocketAction]:
        reason = (env.reason or "").strip()[:60] or "unknown"
        self.disconnect_reason = reason
        if reason in ("warning", "refresh_requested") and self.state is SocketState.READY:
            self.state = SocketState.DRAINING
            return [Handover(reason)]
        if reason in ("warning", "refresh_requested"):
            return []  # already handing over, or not ready yet: the close follows
        return [self._close(f"disconnect: {reason}")]

    def connection_lost(self, ended: WsEnded, now: float) -> None:
        """The socket ended.  Raises for the ends no reconnect can fix."""
        self.state = SocketState.CLOSED
        if self.backoff_at_least:
            self.not_before = now + self.backoff_at_least
        if self.disconnect_reason == "link_disabled":
            raise FatalChannelError(
                "Slack disabled the Socket Mode link (link_disabled): turn Socket Mode on "
                "in the app's settings"
            )

    @property
    def backoff_at_least(self) -> float:
        """The wait the server asked for before the next connection (0: none)."""
        if self.disconnect_reason == "too_many_websockets":
            return self.tuning.too_many_backoff_s
        return 0.0


# --- identity ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BotIdentity:
    """Who the bot is (``auth.test``), and what it may read (``x-oauth-scopes``)."""

    user_id: str
    bot_id: str | None = None
    app_id: str | None = None
    team_id: str | None = None
    name: str | None = None
    #: The workspace URL host (``acme.slack.com``); permalinks elsewhere are not quotes.
    workspace_host: str | None = None
    #: Granted scopes; None when unknown (then lookups are tried and errors mapped).
    scopes: frozenset[str] | None = None


def parse_scopes(header: str | None) -> frozenset[str] | None:
    """The ``x-oauth-scopes`` header as a set (None when absent)."""
    if header is None:
        return None
    return frozenset(s.strip() for s in header.split(",") if s.strip())


def workspace_host(url: str | None) -> str | None:
    """``acme.slack.com`` from ``auth.test``'s ``url`` (``https://acme.slack.com/``)."""
    if not url:
        return None
    host = urllib.parse.urlsplit(url).hostname
    return host.lower() if host else None


# --- text ----------------------------------------------------------------------------------


def unescape(text: str) -> str:
    """Slack's three entities (protocols/slack.md §3): ``&lt; &gt; &amp;``."""
    if "&" not in text:
        return text
    return text.replace("&lt;", "<").replace("&gt;", ">").replace("&amp;", "&")


def escape(text: str) -> str:
    """Agent text made inert: ``&``, ``<``, ``>`` escaped, so ``<!channel>``,
    ``<@U…>`` and links cannot be written by the model."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


SPECIAL_MENTIONS = {"here": "@here", "channel": "@channel", "everyone": "@everyone"}


def _token_text(body: str, bot_user: str, names: Callable[[str], str | None]) -> str:
    """One ``<…>`` token of mrkdwn as plain text."""
    target, _, label = body.partition("|")
    label = unescape(label)
    if target.startswith("@"):
        uid = target[1:]
        if uid == bot_user:
            return ""
        name = label.lstrip("@") or names(uid) or uid
        return "@" + name
    if target.startswith("#"):
        return "#" + (label or target[1:])
    if target.startswith("!"):
        word = target[1:]
        if word in SPECIAL_MENTIONS:
            return SPECIAL_MENTIONS[word]
        if label:
            return label
        return "@" + word.split("^", 1)[0]
    url = unescape(target)
    if label and label != url:
        return f"{label} ({url})"
    return url


_SPACES = re.compile(r"[ \t]{2,}")


def decode_text(
    text: str, bot_user: str, names: Callable[[str], str | None] = lambda _: None
) -> str:
    """Slack mrkdwn as the agent reads it: mentions as ``@name`` (the bot's removed),
    ``#channel``, ``label (url)``, entities decoded; trimmed."""
    if "<" not in text:  # no tokens (the common case): only the entities
        return unescape(text).strip()
    out: list[str] = []
    pos = 0
    removed = False
    for match in _TOKEN.finditer(text):
        out.append(unescape(text[pos : match.start()]))
        piece = _token_text(match.group(1), bot_user, names)
        removed = removed or not piece
        out.append(piece)
        pos = match.end()
    out.append(unescape(text[pos:]))
    joined = "".join(out)
    if removed:  # a removed mention leaves double spaces behind
        joined = _SPACES.sub(" ", joined)
    return joined.strip()


def mentions_user(text: str, user_id: str) -> bool:
    return f"<@{user_id}>" in text or f"<@{user_id}|" in text


#: A user id (``W…``: Enterprise Grid users).
USER_ID = re.compile(r"[UW][A-Z0-9]{1,39}")
#: A user mention token: ``<@U…>`` or ``<@U…|label>``.
_USER_TOKEN = re.compile(r"<@([UW][A-Z0-9]{1,39})(?:\|([^<>]{0,200}))?>")


def people_mentioned(
    text: str, bot_user: str, names: Callable[[str], str | None] = lambda _: None
) -> list[Mention]:
    """The people ``<@U…>`` mentions in the raw mrkdwn ``text``, in text order.

    The bot itself is never one; a mention on a block-quote line (``&gt;`` at the start,
    Slack's ``>``) belongs to the quoted text, not to this message.  ``name``: the
    token's label, else the name the mapper learned for the id (else None); ``text``:
    the mention as :func:`decode_text` writes it into ``content`` (``@name``).
    """
    if "<@" not in text:
        return []
    out: list[Mention] = []
    for line in text.split("\n"):
        if line.lstrip().startswith(("&gt;", ">")):
            continue
        for match in _USER_TOKEN.finditer(line):
            uid, label = match.group(1), match.group(2)
            if uid == bot_user:
                continue
            label = unescape(label or "").lstrip("@") or None
            name = label or names(uid)
            out.append(Mention(ids={"id": uid}, name=name, text="@" + (name or uid)))
    return out


@dataclass(frozen=True, slots=True)
class Permalink:
    """A message permalink: ``https://<host>/archives/<channel>/p<ts digits>``."""

    host: str
    channel: str
    ts: str
    thread_ts: str | None


def find_permalink(text: str) -> Permalink | None:
    """The first message permalink in the (raw mrkdwn) text."""
    match = _PERMALINK.search(text)
    if match is None:
        return None
    host, channel, digits, query = match.groups()
    if len(digits) <= 6:
        return None
    ts = f"{digits[:-6]}.{digits[-6:]}"
    thread_ts: str | None = None
    if query:
        params = urllib.parse.parse_qs(unescape(query[1:]))
        values = params.get("thread_ts") or [""]
        value = values[0]
        if value and _TS.fullmatch(value):
            thread_ts = value
    if not _TS.fullmatch(ts):
        return None
    return Permalink(host.lower(), channel, ts, thread_ts)


def attachment_kind(mimetype: str | None) -> str:
    mime = (mimetype or "").lower()
    for prefix in ("image", "video", "audio"):
        if mime.startswith(prefix + "/"):
            return prefix
    return "file"


def ts_time(ts: str | None) -> float | None:
    if ts is None or not _TS.fullmatch(ts):
        return None
    return float(ts)


# --- mapping -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Route:
    """What answering one message needs (``InboundMessage.route``)."""

    #: The thread the answer goes into (``thread_ts``, or the message's own ``ts``).
    thread_ts: str
    #: The sender (``recipient_user_id`` of a native stream; the interaction starter).
    user: str | None = None
    #: The sender's team (``recipient_team_id``).
    team: str | None = None
    channel_type: str | None = None


#: A lookup of one message: (channel, ts, thread_ts or None for a top-level message).
LookupFactory = Callable[[str, str, str | None], Loader]
MediaFactory = Callable[[m.File], Fetcher | None]


def channel_kind(channel: str, channel_type: str | None) -> str | None:
    """``im``/``mpim``/``channel``/``group``, from the event or the id's prefix."""
    if channel_type in HISTORY_SCOPES:
        return channel_type
    if channel.startswith("D"):
        return "im"
    if channel.startswith("G"):
        return "group"
    return None


def history_allowed(scopes: frozenset[str] | None, kind: str | None) -> bool:
    """Whether the granted scopes can read this conversation's history (unknown: try)."""
    if scopes is None:
        return True
    if kind is None:  # a C… channel of unknown type: public or private
        return "channels:history" in scopes or "groups:history" in scopes
    return HISTORY_SCOPES[kind] in scopes


def _valid_ids(ev: m.Event) -> bool:
    return (
        ev.channel is not None
        and _ID.fullmatch(ev.channel) is not None
        and ev.ts is not None
        and _TS.fullmatch(ev.ts) is not None
        and (ev.thread_ts is None or _TS.fullmatch(ev.thread_ts) is not None)
        and (ev.user is None or _ID.fullmatch(ev.user) is not None)
    )


def _display_name(ev: m.Event) -> str | None:
    p = ev.user_profile
    if p is not None:
        for name in (p.display_name, p.real_name, p.name):
            if name and name.strip():
                return name.strip()[:200]
    return None


class EventMapper:
    """Maps Socket Mode envelopes for one bot (rules in the module docstring)."""

    def __init__(
        self,
        me: BotIdentity,
        *,
        lookup: LookupFactory | None = None,
        media: MediaFactory | None = None,
        threads: Iterable[str] = (),
    ) -> None:
        self.me = me
        #: Builds the lazy lookups of quoted messages (None: quotes are ``not-delivered``).
        self.lookup = lookup
        #: Builds the download handles of current files.
        self.media = media
        self._threads: OrderedDict[str, None] = OrderedDict((t, None) for t in threads)
        self._names: OrderedDict[str, str] = OrderedDict()

    # -- threads the bot is part of ---------------------------------------------------

    def note_thread(self, channel: str, thread_ts: str) -> bool:
        """The bot answers in this thread; True when it was new."""
        key = f"{channel}:{thread_ts}"
        if key in self._threads:
            self._threads.move_to_end(key)
            return False
        self._threads[key] = None
        while len(self._threads) > MAX_THREADS:
            self._threads.popitem(last=False)
        return True

    def bot_thread(self, channel: str, thread_ts: str) -> bool:
        return f"{channel}:{thread_ts}" in self._threads

    def threads(self) -> list[str]:
        """The remembered threads, oldest first (``channel:thread_ts``)."""
        return list(self._threads)

    def _name(self, user_id: str) -> str | None:
        return self._names.get(user_id)

    def _learn_name(self, user_id: str, name: str) -> None:
        self._names[user_id] = name
        self._names.move_to_end(user_id)
        while len(self._names) > MAX_NAMES:
            self._names.popitem(last=False)

    # -- envelopes --------------------------------------------------------------------

    def decode_envelope(self, raw: bytes | str) -> InboundMessage | Skip:
        """A whole Socket Mode frame as received (fixtures, the durable inbox)."""
        try:
            env = decode(m.envelope_decoder, raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Skip(reason="malformed", detail=_short(exc))
        return self.map_envelope(env)

    def map_envelope(self, env: m.Envelope) -> InboundMessage | Skip:
        if m.absent(env.payload):
            return Skip(reason="ignored", detail=f"{env.type or 'frame'} without payload")
        try:
            if env.type == "events_api":
                cb = m.callback_decoder.decode(env.payload)
                return self.map_callback(cb)
            if env.type == "interactive":
                return self.map_action(m.block_actions_decoder.decode(env.payload))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return Skip(reason="malformed", detail=_short(exc))
        return Skip(reason="ignored", detail=f"envelope type {env.type[:40]!r}")

    def control_press(self, env: m.Envelope) -> ControlPress | None:
        """A press on a substitute control notice's button (None: anything else)."""
        if env.type != "interactive" or m.absent(env.payload):
            return None
        try:
            payload = m.block_actions_decoder.decode(env.payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        app = self.me.app_id
        if app and payload.api_app_id and payload.api_app_id != app:
            return None
        return control_press(payload)

    def stored_frame(self, env: m.Envelope) -> bytes | None:
        """The envelope as the durable inbox keeps it: only the fields the mapping reads.

        Slack's payloads carry the legacy verification ``token`` and, on interactions, a
        ``response_url`` that can post into the conversation: neither may reach the
        store.  The decoded view structs name only what dshim reads, so re-encoding them
        drops both (the event itself stays the raw bytes Slack sent).  None when the
        payload does not decode (the event is dropped anyway).
        """
        payload: msgspec.Struct
        try:
            if env.type == "events_api":
                payload = m.callback_decoder.decode(env.payload)
            elif env.type == "interactive":
                payload = m.block_actions_decoder.decode(env.payload)
            else:
                return None
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None
        return m.encode(
            {
                "envelope_id": env.envelope_id,
                "type": env.type,
                "retry_attempt": env.retry_attempt,
                "payload": payload,
            }
        )

    def map_callback(self, cb: m.EventCallback) -> InboundMessage | Skip:
        if cb.type != "event_callback" or m.absent(cb.event):
            return Skip(reason="ignored", detail=f"payload type {cb.type[:40]!r}")
        app = self.me.app_id
        if app and cb.api_app_id and cb.api_app_id != app:
            return Skip(reason="ignored", detail="an envelope for another app")
        ev = m.event_decoder.decode(cb.event)
        return self.map_event(ev, team_id=cb.team_id)

    def map_event(self, ev: m.Event, *, team_id: str | None = None) -> InboundMessage | Skip:
        """One ``message`` / ``app_mention`` event."""
        if ev.type not in ("message", "app_mention"):
            return Skip(reason="ignored", detail=f"event {ev.type[:40]!r}")
        me = self.me
        if ev.subtype == "bot_message" or ev.bot_id or ev.app_id:
            own = (
                (ev.bot_id is not None and ev.bot_id == me.bot_id)
                or (ev.app_id is not None and ev.app_id == me.app_id)
                or ev.user == me.user_id
            )
            return Skip(reason="echo" if own else "bot", detail="bot message", message_id=ev.ts)
        if ev.subtype not in USER_SUBTYPES:
            # Edits, deletions, joins, topic changes ...: not new user messages.
            return Skip(
                reason="ignored", detail=f"subtype {str(ev.subtype)[:40]!r}", message_id=ev.ts
            )
        if not _valid_ids(ev) or ev.user is None:
            return Skip(reason="malformed", detail="missing or malformed channel/ts/user")
        assert ev.channel is not None and ev.ts is not None
        if not plausible_time(float(ev.ts)):  # 12 digits reach the year 33658
            return Skip(reason="malformed", detail="ts: not a plausible time")
        if ev.user == me.user_id:
            return Skip(reason="echo", detail="own message", message_id=ev.ts)
        channel, ts = ev.channel, ev.ts
        kind = channel_kind(channel, ev.channel_type)
        direct = kind == "im"
        name = _display_name(ev)
        if name is not None:
            self._learn_name(ev.user, name)
        text = ev.text or ""
        is_reply = ev.thread_ts is not None and ev.thread_ts != ts
        thread_ts = ev.thread_ts if is_reply else None
        answer_thread = ev.thread_ts or ts
        known_thread = is_reply and thread_ts is not None and self.bot_thread(channel, thread_ts)
        bot_parent = is_reply and ev.parent_user_id == me.user_id
        # The bot's own explicit mention (``/substitute`` in groups needs one).
        mentioned = ev.type == "app_mention" or mentions_user(text, me.user_id)
        addressed = direct or mentioned or known_thread or bot_parent
        content = decode_text(text, me.user_id, self._name)
        reply_to: ReplyReference | None = None
        if is_reply and thread_ts is not None and not known_thread:
            reply_to = self._parent_quote(channel, kind, thread_ts, ev.parent_user_id)
        elif "/archives/" in text:
            link = find_permalink(text)
            if link is not None and self._our_workspace(link.host):
                reply_to = self._permalink_quote(channel, kind, link)
        images: list[MediaRef] = []
        files: list[MediaRef] = []
        for f in ev.files:
            if f.mode in ("tombstone", "hidden_by_limit"):
                continue
            if f.id and not _ID.fullmatch(f.id):  # F… ids, like every Slack id (kit.ids)
                return Skip(reason="malformed", detail="a file id of another shape")
            kind_of = attachment_kind(f.mimetype)
            media = MediaRef(
                kind="image" if kind_of == "image" else "file",
                name=f.name or f.title or None,
                mime=f.mimetype,
                size=f.size,
                fetch=self.media(f) if self.media is not None else None,
            )
            (images if kind_of == "image" else files).append(media)
        if not content and not images and not files and reply_to is None:
            return Skip(reason="ignored", detail="nothing for the agent", message_id=ts)
        if addressed:
            self.note_thread(channel, answer_thread)
        if addressed and not direct and thread_ts is None:
            # A top-level mention in a channel is answered in its own thread: that thread
            # is its conversation (lane and session), which every later reply there joins.
            thread_ts = ts
        return InboundMessage(
            channel=CHANNEL,
            bot_id=me.user_id,
            message_id=ts,
            conversation_id=channel,
            conversation_type="direct" if direct else "group",
            thread_id=thread_ts,
            sender_id=ev.user,
            sender_name=name,
            addressed=addressed,
            content=content,
            images=images,
            files=files,
            reply_to=reply_to,
            received_at=float(ts),
            mentions=people_mentioned(text, me.user_id, self._name),
            mentioned=mentioned,
            route=Route(
                thread_ts=answer_thread,
                user=ev.user,
                team=ev.user_team or ev.team or ev.source_team or team_id or me.team_id,
                channel_type=kind,
            ),
        )

    def _our_workspace(self, host: str) -> bool:
        known = self.me.workspace_host
        return known is None or host == known

    def _parent_quote(
        self, channel: str, kind: str | None, parent_ts: str, parent_user: str | None
    ) -> ReplyReference:
        """Rule (a): the thread parent, a top-level message of this channel."""
        author: str | UnsetType = UNSET
        if parent_user is not None and _ID.fullmatch(parent_user):
            author = parent_user
        ours = parent_user is not None and parent_user == self.me.user_id
        ref = ReplyReference(message_id=parent_ts, author_id=author)
        if ours and self.me.name:
            ref.author_name = self.me.name
        if ours:
            # The bot's own message: the core can recover it when the lookup cannot.
            ref.recover = True
            ref.recover_at = ts_time(parent_ts)
        if not history_allowed(self.me.scopes, kind):
            if not ours:
                ref.unavailable_reason = "permission-denied"
            return ref
        if self.lookup is None:
            if not ours:
                ref.unavailable_reason = "not-delivered"
            return ref
        ref.loader = self.lookup(channel, parent_ts, None)
        return ref

    def _permalink_quote(self, channel: str, kind: str | None, link: Permalink) -> ReplyReference:
        """Rule (b): a permalink; looked up only inside the current channel."""
        if link.channel != channel:
            return ReplyReference(message_id=link.ts, unavailable_reason="not-found")
        if not history_allowed(self.me.scopes, kind):
            return ReplyReference(message_id=link.ts, unavailable_reason="permission-denied")
        if self.lookup is None:
            return ReplyReference(message_id=link.ts, unavailable_reason="not-delivered")
        parent = link.thread_ts if link.thread_ts and link.thread_ts != link.ts else None
        return ReplyReference(message_id=link.ts, loader=self.lookup(channel, link.ts, parent))

    # -- lookups ----------------------------------------------------------------------

    def fetched_reference(self, found: m.Event | None, ts: str) -> ReplyReference | None:
        """A message returned by a lookup; another ``ts`` (or nothing) is not found."""
        if found is None or found.ts != ts:
            return None
        me = self.me
        author_id: str | UnsetType = UNSET
        author_name: str | UnsetType = UNSET
        if (found.bot_id and found.bot_id == me.bot_id) or found.user == me.user_id:
            author_id = me.user_id
            if me.name:
                author_name = me.name
        elif found.user:
            author_id = found.user
            name = _display_name(found) or self._name(found.user)
            if name:
                author_name = name
        elif found.bot_id:
            author_id = found.bot_id
            bot_name = (found.bot_profile.name if found.bot_profile else None) or found.username
            if bot_name:
                author_name = bot_name
        attachments = [
            Attachment(kind=attachment_kind(f.mimetype), name=f.name or f.title or None)
            for f in found.files
            if f.mode not in ("tombstone",)
        ]
        return ReplyReference(
            message_id=ts,
            author_id=author_id,
            author_name=author_name,
            content=decode_text(found.text or "", "", self._name),
            attachments=attachments,
        )

    # -- interactivity ----------------------------------------------------------------

    def map_action(self, p: m.BlockActions) -> InboundMessage | Skip:
        """A Block Kit button press on one of the bot's interaction messages.

        It becomes a message from the person who pressed it whose text is the option's
        value (its label), in the conversation and thread of the buttons' message, so
        the pipeline judges it exactly like a typed answer (starter-only rule included).
        """
        app = self.me.app_id
        if p.type != "block_actions":
            return Skip(reason="ignored", detail=f"interactive {p.type[:40]!r}")
        if app and p.api_app_id and p.api_app_id != app:
            return Skip(reason="ignored", detail="an interaction for another app")
        action = next((a for a in p.actions if a.action_id.startswith(ACTION_PREFIX)), None)
        user = p.user.id if p.user is not None else ""
        container = p.container
        channel = (p.channel.id if p.channel else None) or (
            container.channel_id if container else None
        )
        message_ts = (container.message_ts if container else None) or (
            p.message.ts if p.message else None
        )
        if action is None:
            return Skip(reason="ignored", detail="not a dshim button")
        thread = (container.thread_ts if container else None) or (
            p.message.thread_ts if p.message else None
        )
        if (
            not channel
            or not _ID.fullmatch(channel)
            or not _ID.fullmatch(user)
            or message_ts is None
            or not _TS.fullmatch(message_ts)
            or (thread is not None and not _TS.fullmatch(thread))
            or action.action_ts is None
            or not _TS.fullmatch(action.action_ts)
        ):
            return Skip(reason="malformed", detail="button press without channel/user/ts")
        value = (action.value or "").strip()[:2000]
        if not value:
            return Skip(reason="malformed", detail="button without a value")
        kind = channel_kind(channel, None)
        team = (p.user.team_id if p.user else None) or (p.team.id if p.team else None)
        # The answer belongs to the turn that asked: its thread_id travels in the
        # buttons' block_id (the thread the request is posted in, except in a DM, where
        # a top-level message's turn has none).
        thread_id = lane_thread(action.block_id)
        if thread_id is UNSET:
            thread_id = thread if thread is not None and thread != message_ts else None
        return InboundMessage(
            channel=CHANNEL,
            bot_id=self.me.user_id,
            message_id=f"{message_ts}-{action.action_ts}",
            conversation_id=channel,
            conversation_type="direct" if kind == "im" else "group",
            thread_id=thread_id,
            sender_id=user,
            sender_name=(p.user.name or p.user.username) if p.user else None,
            addressed=True,
            content=value,
            received_at=float(action.action_ts),
            route=Route(thread_ts=thread or message_ts, user=user, team=team, channel_type=kind),
        )


#: The substitute control notice's buttons: ``action_id`` ``dshim_ctl_<action>``, value
#: ``<action>|<conversation>|<thread_ts or ->`` (the chat the notice is about).
CONTROL_PREFIX = "dshim_ctl_"
CONTROL_ACTION_NAMES = ("stop", "disable")


def control_value(action: str, conversation_id: str, thread_id: str | None) -> str:
    """A control button's ``value``: the action and the chat it acts on."""
    return f"{action}|{conversation_id}|{thread_id or '-'}"


@dataclass(frozen=True, slots=True)
class ControlPress:
    """A press on a control notice's button (for ``Inbound.substitute_control``)."""

    action: Literal["stop", "disable"]
    conversation_id: str
    thread_id: str | None
    #: Who pressed it.
    user: str
    #: Where the notice is (the operator's DM) and its ``ts``: the message to update.
    channel: str
    message_ts: str
    #: The notice's text as Slack holds it (escaped mrkdwn).
    text: str


def control_press(p: m.BlockActions) -> ControlPress | None:
    """The control press in a ``block_actions`` payload (None: not one, or malformed)."""
    action = next((a for a in p.actions if a.action_id.startswith(CONTROL_PREFIX)), None)
    if p.type != "block_actions" or action is None:
        return None
    kind, _, rest = (action.value or "").partition("|")
    conversation, _, thread = rest.partition("|")
    user = p.user.id if p.user is not None else ""
    channel = (p.channel.id if p.channel else None) or (
        p.container.channel_id if p.container else None
    )
    message_ts = (p.container.message_ts if p.container else None) or (
        p.message.ts if p.message else None
    )
    if (
        kind not in CONTROL_ACTION_NAMES
        or action.action_id != CONTROL_PREFIX + kind
        or not _ID.fullmatch(conversation)
        or not (thread == "-" or _TS.fullmatch(thread))
        or not _ID.fullmatch(user)
        or not channel
        or not _ID.fullmatch(channel)
        or message_ts is None
        or not _TS.fullmatch(message_ts)
    ):
        return None
    return ControlPress(
        action="stop" if kind == "stop" else "disable",
        conversation_id=conversation,
        thread_id=None if thread == "-" else thread,
        user=user,
        channel=channel,
        message_ts=message_ts,
        text=(p.message.text if p.message else None) or "",
    )


#: Every dshim button's ``action_id`` starts with this (``dshim_opt_<n>``).
ACTION_PREFIX = "dshim_opt_"
BLOCK_PREFIX = "dshim|"


def actions_block_id(thread_id: str | None, token: str) -> str:
    """The ``block_id`` of a request's buttons: the asking turn's ``thread_id``."""
    return f"{BLOCK_PREFIX}{thread_id or '-'}|{token}"


def lane_thread(block_id: str | None) -> str | None | UnsetType:
    """The ``thread_id`` a press answers in (UNSET: not one of our block ids)."""
    if not block_id or not block_id.startswith(BLOCK_PREFIX):
        return UNSET
    value = block_id[len(BLOCK_PREFIX) :].partition("|")[0]
    if value == "-":
        return None
    return value if _TS.fullmatch(value) else UNSET


# --- streaming ----------------------------------------------------------------------------


def stream_suffix(shown: str, text: str) -> str | None:
    """What to append to a native stream that shows ``shown`` so it shows ``text``.

    None when ``text`` does not extend ``shown`` (the agent rewrote earlier text): the
    stream cannot show it and the answer falls back to ``chat.update``.
    """
    if not text.startswith(shown):
        return None
    return text[len(shown) :]


def pieces(text: str, size: int) -> list[str]:
    """``text`` in pieces of at most ``size`` characters (appendStream's limit)."""
    return [text[i : i + size] for i in range(0, len(text), size)] or []
