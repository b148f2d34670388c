"""A Discord-style gateway session, sans-IO: Discord's and QQ's (same opcodes, same flow).

Theory of operation
-------------------
:class:`GatewaySession` is a :class:`~dshim.net.ws_session.WsSession`: it holds
everything about the gateway that is not I/O.  The kit's runner (:mod:`dshim.net.ws`)
opens websockets to the URL :meth:`~GatewaySession.plan_connection` chose, feeds every
received frame to :meth:`~GatewaySession.receive`, calls :meth:`~GatewaySession.tick`
when :meth:`~GatewaySession.next_timer` is due, performs the returned actions and reports
the end of each connection with :meth:`~GatewaySession.connection_lost`.  Time is always
an argument (seconds on any monotonic clock); randomness comes from an injected function.

Two lifetimes::

    session (survives reconnects): session_id, resume URL, seq, the cached
        GET /gateway/bot URL, the identify budget (session_start_limit)
    connection: AWAIT_HELLO -> (Identify | Resume sent) AWAIT_READY -> READY/RESUMED
        CONNECTED -> CLOSED; heartbeat interval, next beat, "ACK pending"

What both platforms guarantee: dispatches arrive in order with a growing ``s``; nothing is
acknowledged per event; a Resume replays the dispatches a session missed, so the only
redelivery is a replay after Resume -- which may repeat events already handled (the
pipeline's persisted dedup drops them).

The shared rules (Discord: discord-api-docs events/gateway.mdx,
topics/opcodes-and-status-codes.mdx; QQ: bot-docs dev-prepare/interface-framework/
event-emit.md, opcode.md, error-trace/websocket.md):

* Hello (op 10) starts the heartbeat: the first beat after ``interval * random()``, then
  every ``interval``; ``d`` is the last non-null ``s`` seen on the session.  Then Identify
  (op 2, new session) or Resume (op 6: token, session_id, seq).
* A beat that is due while the previous one is not yet ACKed (op 11) means a zombie
  connection: close with the dialect's resume close code (never 1000/1001, which would
  end a Discord session) and resume.
* Op 1 from the server: heartbeat at once.  Op 7 Reconnect: close, resume.  Op 9 Invalid
  Session: ``d=true`` -> resume; otherwise forget the session, close with 1000, wait
  (``invalid_session_wait_s``) and Identify afresh.
* READY carries ``session_id`` (Discord also ``resume_gateway_url``; resumes go there).
* Close codes are the dialect's: fatal ones raise (never reconnect), "new session" ones
  drop the session, "refresh token" ones (QQ 4004) ask the shell for a new token once
  (:attr:`GatewaySession.token_rejected`) -- a second one in a row is fatal --, some ask
  for a wait first (QQ 4008: 60 s).  Everything else (and network errors) resumes when
  a session exists; the runner backs off connections that never got to READY/RESUMED.
* Identify is budgeted (``session_start_limit`` from ``GET /gateway/bot``): never
  identify while ``remaining`` is 0 -- wait ``reset_after`` and ask again -- and at most
  ``max_concurrency`` identifies per 5 s.
* A frame is decoded with bounded depth (:func:`dshim.channels.kit.decode.decode`): a
  frame that does not decode is :class:`~dshim.net.ws_session.Ignored`, the
  connection goes on.

The differences are a :class:`GatewayDialect`: the platform's name for messages, the URL
form, extra Identify fields (QQ's ``shard``), and the close-code classes.  The token's
form (``Bot``-less for Discord, ``QQBot <access_token>`` for QQ) is the caller's.
Nothing here imports trio or httpx or reads a clock.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from dshim.channels.kit.decode import decode
from dshim.errors import AuthError, FatalChannelError
from dshim.net.ws_session import Action, Close, Connected, Deliver, Ignored, Send, WsEnded

__all__ = [
    "ConnState",
    "ConnectPlan",
    "Dispatch",
    "Frame",
    "GatewayAction",
    "GatewayBot",
    "GatewayDialect",
    "GatewaySession",
    "GatewayTuning",
    "Mode",
    "Ready",
    "ReadyUser",
    "SessionStartLimit",
    "frame_decoder",
    "gateway_bot_decoder",
    "hello_decoder",
    "ready_decoder",
]

# Gateway opcodes (the same numbers on Discord and QQ).
OP_DISPATCH = 0
OP_HEARTBEAT = 1
OP_IDENTIFY = 2
OP_RESUME = 6
OP_RECONNECT = 7
OP_INVALID_SESSION = 9
OP_HELLO = 10
OP_HEARTBEAT_ACK = 11

#: Identify budget window: ``max_concurrency`` identifies per this many seconds.
IDENTIFY_WINDOW_S = 5.0
#: A server that does not say Hello within this time is treated as a failed connection.
HELLO_TIMEOUT_S = 20.0
#: Connections in a row that never got READY after which the gateway URL is re-read.
STALE_GATEWAY_FAILURES = 3


# --- the frames the session reads -------------------------------------------------------


class Frame(msgspec.Struct, kw_only=True, gc=False):
    """The gateway envelope ``{"op", "d", "s", "t"}``; ``d`` is decoded per opcode."""

    op: int
    d: msgspec.Raw = msgspec.Raw(b"null")
    s: int | None = None
    t: str | None = None


class Hello(msgspec.Struct, kw_only=True, gc=False):
    heartbeat_interval: float


class ReadyUser(msgspec.Struct, kw_only=True, gc=False):
    id: str
    username: str = ""
    bot: bool = False


class Ready(msgspec.Struct, kw_only=True, gc=False):
    session_id: str
    resume_gateway_url: str | None = None
    user: ReadyUser | None = None


class SessionStartLimit(msgspec.Struct, kw_only=True, gc=False):
    total: int = 1000
    remaining: int = 1000
    #: Milliseconds until ``remaining`` resets.
    reset_after: float = 0.0
    max_concurrency: int = 1


class GatewayBot(msgspec.Struct, kw_only=True, gc=False):
    """``GET /gateway/bot``."""

    url: str
    shards: int = 1
    session_start_limit: SessionStartLimit = msgspec.field(default_factory=SessionStartLimit)


frame_decoder = msgspec.json.Decoder(Frame)
hello_decoder = msgspec.json.Decoder(Hello)
ready_decoder = msgspec.json.Decoder(Ready)
gateway_bot_decoder = msgspec.json.Decoder(GatewayBot)
_encoder = msgspec.json.Encoder()


def _encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def _same_url(base: str) -> str:
    return base


@dataclass(frozen=True, slots=True)
class GatewayDialect:
    """What one platform's gateway does differently.  Close codes map to their meaning."""

    #: The platform's name, in error messages.
    platform: str
    #: Close codes after which reconnecting cannot help.
    fatal_close_codes: Mapping[int, str]
    #: Those of the fatal codes that mean the credential is bad (AuthError).
    auth_close_codes: frozenset[int] = frozenset()
    #: Close codes after which the session cannot be resumed (Identify afresh).
    new_session_close_codes: frozenset[int] = frozenset()
    #: Close codes that reject the token: get a new one, Identify; twice in a row is fatal.
    refresh_token_close_codes: Mapping[int, str] = field(default_factory=dict)
    #: Close codes that ask for a wait before the next connection (seconds).
    close_waits_s: Mapping[int, float] = field(default_factory=dict)
    #: Our close code when we intend to resume (anything but 1000/1001 keeps the session).
    resume_close_code: int = 4000
    #: Extra Identify fields (QQ: ``shard``).
    identify_extra: Mapping[str, Any] = field(default_factory=dict)
    #: The websocket URL for a gateway base URL (Discord adds ``?v=10&encoding=json``).
    url: Callable[[str], str] = _same_url


@dataclass(frozen=True, slots=True)
class GatewayTuning:
    """Timings of the session policy.  Defaults follow Discord's guidance (QQ waits 3 s
    after an Invalid Session)."""

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


@dataclass(slots=True)  # not frozen: one per event (frozen init is 3x slower)
class Dispatch:
    """An op 0 event the channel wants.  ``frame`` is the whole frame as received."""

    t: str
    s: int | None
    d: msgspec.Raw
    frame: bytes


GatewayAction = Action[Dispatch]


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


def _short(exc: Exception) -> str:
    return str(exc)[:200]


class GatewaySession:
    """The gateway session state machine.  See the module docstring for the rules.

    ``dialect`` names what the platform does differently (see :class:`GatewayDialect`);
    ``token`` is what Identify and Resume send (settable: a platform with short-lived
    access tokens sets the current one before each connection).

    ``wanted`` names the dispatches (``t``) handed to the channel as
    :class:`~dshim.net.ws.Deliver` actions; others only move ``seq``.
    """

    def __init__(
        self,
        *,
        token: str,
        random: Callable[[], float],
        dialect: GatewayDialect,
        intents: int,
        wanted: frozenset[str],
        gateway_override: str | None = None,
        tuning: GatewayTuning | None = None,
        properties: dict[str, str] | None = None,
    ) -> None:
        self.dialect = dialect
        self.token = token
        self._random = random
        self.intents = intents
        self.wanted = wanted
        self.tuning = tuning or GatewayTuning()
        self._properties = properties or {"os": "linux", "browser": "dshim", "device": "dshim"}
        self._override = gateway_override
        # session
        self.session_id: str | None = None
        self.resume_url: str | None = None
        self.seq: int | None = None
        self.user: ReadyUser | None = None
        self.gateway_url: str | None = None
        # identify budget (session_start_limit)
        self.identify_remaining: int | None = None
        self.identify_reset_at = 0.0
        self.max_concurrency = 1
        self.last_identify_at: float | None = None
        self.identifies = 0
        self._gateway_stale = True
        # planning: connections in a row that never got READY/RESUMED; earliest next one
        self.failures = 0
        self._not_before = 0.0
        self._planned = Mode.IDENTIFY
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
        #: The platform rejected :attr:`token` (a ``refresh_token_close_codes`` close): get a
        #: new one before the next connection, then clear this.
        self.token_rejected = False
        self._token_rejections = 0

    def __repr__(self) -> str:  # never the token
        return (
            f"GatewaySession(state={self.state.value}, session={self.session_id!r}, "
            f"seq={self.seq!r})"
        )

    # -- session / planning ------------------------------------------------------------

    @property
    def can_resume(self) -> bool:
        return self.session_id is not None and self.seq is not None

    def set_gateway_info(self, info: GatewayBot, now: float) -> None:
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
            self._planned = Mode.RESUME
            return ConnectPlan(Mode.RESUME, self.dialect.url(base), self._not_before)
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
        self._planned = Mode.IDENTIFY
        return ConnectPlan(Mode.IDENTIFY, self.dialect.url(base), not_before, reason=reason)

    # -- connection (the WsSession interface) ------------------------------------------

    def connection_opened(self, now: float) -> list[GatewayAction]:
        """A websocket to the last planned URL is open; expect Hello (nothing to send)."""
        self.state = ConnState.AWAIT_HELLO
        self.mode = self._planned
        self.heartbeat_interval = None
        self.next_heartbeat_at = None
        self.ack_pending = False
        self._last_beat_at = None
        self._hello_deadline = now + self.tuning.hello_timeout_s
        self._closing_for = None
        self._reached_connected = False
        return []

    def next_timer(self) -> float | None:
        """When :meth:`tick` must run next (None: nothing scheduled)."""
        if self.state is ConnState.AWAIT_HELLO:
            return self._hello_deadline
        if self.state in (ConnState.AWAIT_READY, ConnState.CONNECTED):
            return self.next_heartbeat_at
        return None

    def tick(self, now: float, *, reading: bool = True) -> list[GatewayAction]:
        """Timers: the Hello deadline, heartbeats and zombie detection.

        ``reading=False`` says the shell is not reading frames right now (the pipeline is
        applying backpressure): an ACK may be waiting unread, so beats continue and the
        zombie verdict waits until reading resumes.
        """
        if self.state is ConnState.AWAIT_HELLO:
            if self._hello_deadline is not None and now >= self._hello_deadline:
                return [self._close(self.dialect.resume_close_code, "no hello", Mode.RESUME)]
            return []
        if self.state not in (ConnState.AWAIT_READY, ConnState.CONNECTED):
            return []
        if self.next_heartbeat_at is None or now < self.next_heartbeat_at:
            return []
        assert self.heartbeat_interval is not None
        if self.ack_pending and reading:
            # The previous beat was never acknowledged: the connection is a zombie.
            return [
                self._close(
                    self.dialect.resume_close_code, "heartbeat not acknowledged", Mode.RESUME
                )
            ]
        self.next_heartbeat_at = now + self.heartbeat_interval
        return [self._heartbeat(now)]

    def receive(self, data: str | bytes, now: float) -> list[GatewayAction]:
        """One frame from the server.  Frames that do not decode become :class:`Ignored`."""
        if self.state in (ConnState.CLOSING, ConnState.DISCONNECTED):
            return []
        raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
        try:
            frame = decode(frame_decoder, raw)  # bounded depth: never a RecursionError
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return [Ignored("malformed_frame", _short(exc))]
        op = frame.op
        if op == OP_DISPATCH:
            return self._dispatch(frame, raw)
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
            return [self._close(self.dialect.resume_close_code, "reconnect requested", Mode.RESUME)]
        if op == OP_INVALID_SESSION:
            try:
                resumable = msgspec.json.decode(frame.d, type=bool)
            except (msgspec.DecodeError, msgspec.ValidationError):
                resumable = False
            if resumable and self.session_id is not None:
                return [
                    self._close(
                        self.dialect.resume_close_code, "invalid session (resumable)", Mode.RESUME
                    )
                ]
            # d=false: the session is gone; identify afresh after 1-5 s.
            self._forget_session()
            lo, hi = self.tuning.invalid_session_wait_s
            self._not_before = now + lo + (hi - lo) * self._random()
            return [self._close(1000, "invalid session", Mode.IDENTIFY)]
        return [Ignored("unknown_opcode", str(op))]

    def connection_lost(self, ended: WsEnded, now: float) -> None:
        """The websocket ended.  Plans the next step (the runner does the backoff).

        Raises :class:`~dshim.errors.AuthError` or :class:`~dshim.errors.FatalChannelError`
        for the dialect's fatal close codes (and for a token rejected twice in a row).
        """
        code = ended.code
        requested = self._closing_for
        reached = self._reached_connected
        dialect = self.dialect
        self.state = ConnState.DISCONNECTED
        self.mode = None
        self.next_heartbeat_at = None
        self.heartbeat_interval = None
        self._closing_for = None
        if reached:
            self._token_rejections = 0
        if requested is None and code is not None:
            if code in dialect.fatal_close_codes:
                raise self.fatal_error(code)
            if code in dialect.refresh_token_close_codes:
                # The token was refused: one more try with a fresh one, then it is fatal.
                self._token_rejections += 1
                if self._token_rejections > 1:
                    raise self.fatal_error(code)
                self.token_rejected = True
                self._forget_session()
            if code in dialect.new_session_close_codes:
                self._forget_session()
            wait = dialect.close_waits_s.get(code)
            if wait is not None:
                self._not_before = max(self._not_before, now + wait)
        if reached:
            self.failures = 0
        else:
            self.failures += 1
            if self.failures >= STALE_GATEWAY_FAILURES and not self.can_resume:
                # The identify URL keeps failing: ask the platform for a fresh one.
                self._gateway_stale = True
        self._not_before = max(self._not_before, now)

    def fatal_error(self, code: int) -> AuthError | FatalChannelError:
        """The error for a fatal close code (the dialect's words for it)."""
        dialect = self.dialect
        meaning = dialect.fatal_close_codes.get(code) or dialect.refresh_token_close_codes.get(
            code, "closed"
        )
        message = f"{dialect.platform} closed the gateway with {code}: {meaning}"
        if code in dialect.auth_close_codes:
            return AuthError(message, code=code)
        return FatalChannelError(message, code=code)

    # -- internals ---------------------------------------------------------------------

    def _forget_session(self) -> None:
        self.session_id = None
        self.resume_url = None
        self.seq = None

    def _close(self, code: int, reason: str, then: Mode) -> Close:
        self.last_close_reason = reason
        self.state = ConnState.CLOSING
        self._closing_for = then
        return Close(code, reason)

    def _heartbeat(self, now: float) -> Send:
        self.ack_pending = True
        self._last_beat_at = now
        return Send(
            _encode({"op": OP_HEARTBEAT, "d": self.seq}).decode(), kind="heartbeat", logged=False
        )

    def _hello(self, frame: Frame, now: float) -> list[GatewayAction]:
        if self.state is not ConnState.AWAIT_HELLO:
            return [Ignored("unexpected_hello")]
        try:
            hello = hello_decoder.decode(frame.d)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return [Ignored("malformed_hello", _short(exc))]
        if not hello.heartbeat_interval > 0 or not math.isfinite(hello.heartbeat_interval):
            return [Ignored("malformed_hello", "heartbeat_interval is not a positive number")]
        interval = hello.heartbeat_interval / 1000.0
        self.heartbeat_interval = interval
        # Jitter on the first beat keeps many clients from beating in lock-step.
        self.next_heartbeat_at = now + interval * self._random()
        self.ack_pending = False
        self.state = ConnState.AWAIT_READY
        if self.mode is Mode.RESUME:
            if not self.can_resume:  # the session was lost meanwhile: plan again
                return [self._close(self.dialect.resume_close_code, "session lost", Mode.IDENTIFY)]
            resume = {"token": self.token, "session_id": self.session_id, "seq": self.seq}
            return [Send(_encode({"op": OP_RESUME, "d": resume}).decode(), kind="resume")]
        self._forget_session()
        self.last_identify_at = now
        self.identifies += 1
        if self.identify_remaining is not None:
            self.identify_remaining -= 1
        identify = {
            "token": self.token,
            "intents": self.intents,
            **self.dialect.identify_extra,
            "properties": self._properties,
        }
        return [Send(_encode({"op": OP_IDENTIFY, "d": identify}).decode(), kind="identify")]

    def _dispatch(self, frame: Frame, raw: bytes) -> list[GatewayAction]:
        if frame.s is not None:
            self.seq = frame.s
        t = frame.t or ""
        if t == "READY":
            try:
                ready = ready_decoder.decode(frame.d)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                return [Ignored("malformed_ready", _short(exc))]
            self.session_id = ready.session_id
            self.resume_url = ready.resume_gateway_url
            self.user = ready.user
            self._connected()
            out: list[GatewayAction] = [Connected(False, ready.session_id)]
        elif t == "RESUMED":
            self._connected()
            out = [Connected(True, self.session_id)]
        else:
            out = []
        if t in self.wanted:
            out.append(Deliver(Dispatch(t, frame.s, frame.d, raw)))
        return out

    def _connected(self) -> None:
        self.state = ConnState.CONNECTED
        self._reached_connected = True
        self.failures = 0
