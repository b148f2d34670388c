"""Feishu / Lark without I/O: the pbbp2 frame codec, the long-connection session, and the
mapping of events and looked-up messages to dshim's model.

Theory of operation
-------------------
Connection (wire facts: /shared/protocols/feishu.md §2, from the official SDKs' ``ws``
clients).  Every connection starts with ``POST /callback/ws/endpoint`` (``AppID`` /
``AppSecret``), which hands out a fresh ``wss://`` URL -- its query carries credentials
and ``service_id`` -- and a ``ClientConfig`` (``PingInterval``, ``ReconnectInterval``,
``ReconnectNonce``, ``ReconnectCount``, seconds).  Frames are binary protobuf
``pbbp2.Frame`` (proto2), encoded here by hand (:func:`encode_frame` /
:func:`decode_frame`: required fields always written, unknown fields skipped, every
length checked).  States of :class:`FeishuSession`::

    opened --ping--> waiting_pong --pong--> live --(every PingInterval) ping--> live
       any state: no pong for 2 x PingInterval (since the last pong, or since the
       connection opened) -> close 4000 (reconnect)

- A CONTROL ``ping`` goes out at once and then every ``PingInterval``; a ``pong`` whose
  payload is non-empty is a ``ClientConfig`` that applies from then on.  The first pong
  makes the connection live (:class:`~dshim.net.ws_session.Connected`).
- DATA frames of ``type=event`` carry one event JSON; one with ``sum > 1`` is a fragment,
  buffered by ``message_id`` into slot ``seq`` until every slot is filled (at most
  :data:`MAX_PENDING_MESSAGES` messages of at most :data:`MAX_EVENT_BYTES`; incomplete
  ones expire after :data:`FRAGMENT_TTL_S`).  ``type=card`` frames are dropped unacked,
  as every SDK does (card clicks arrive as ``type=event`` ``card.action.trigger``).
- Acks: the platform re-pushes an event that is not acked within 3 s, to any connection
  of the app (cluster mode).  Acceptance by the pipeline (dedup key + inbox row in
  SQLite) takes milliseconds, so each event is acked *after* ``accept`` returned a
  confirming verdict (a ``shutdown`` verdict stays unacked and comes back after the
  restart); a redelivery -- Feishu re-pushes with a new ``event_id`` -- is dropped by
  the persisted dedup on ``message.message_id``.  Should an acceptance take longer than
  :data:`EARLY_ACK_S` (a busy store), the event is acked anyway before the 3 s pass and
  the dedup drops a redelivery.  The ack is the frame that completed
  the event, every header echoed (``instance_id`` routes it), plus ``biz_rt``, payload
  ``{"code":200}``; for ``card.action.trigger`` the payload also carries ``data`` =
  base64 of the card callback's JSON answer (a toast).
- Reconnects: after a connection ends the next one waits ``random() x ReconnectNonce``
  once, then ``ReconnectInterval`` between failed attempts (the SDKs' schedule), on top
  of the kit runner's backoff for connections that never became stable.  Bad
  credentials (an endpoint ``code`` other than 0 / 1 / 1000040343), a refused upgrade with
  403, and one with 514 and ``Handshake-Autherrcode: 1000040350`` (too many connections)
  are fatal; other 514 refusals are server errors and retried.

Receiving (§4): ``im.message.receive_v1`` maps to :class:`~dshim.model.InboundMessage`
(``p2p`` -> direct, else group; ``chat_id`` the conversation; a topic's root message id
its ``thread_id``, for the first message and the replies alike, see :func:`topic_key`;
mentions of the bot address it; the other people mentioned -- ``@_user_N`` placeholders
with every id of their ``mentions`` entry, and post ``at`` nodes whose ``user_id`` holds an
open_id -- become ``mentions`` in text order for substitute mode),
``im.message.recalled_v1`` to :class:`Recall`, ``card.action.trigger`` to the clicker's
answer message (or, for a substitute control notice's button, a :class:`ControlPress`).  Quotes (§4, §6): the event
names only ``parent_id`` (without it, a ``root_id`` other than the message itself: the
seed's fallback); a topic reply whose ``parent_id == root_id`` is thread context, not a
quote; else a loader fetches the message (one request) and :func:`fetched_reference`
maps it (another chat, or an item naming no chat -> ``not-found``, never its content).

Error codes (§6, §7) are classified once in :func:`classify_error`.
"""

from __future__ import annotations

import base64
import json
import math
import re
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from msgspec import UNSET

from dshim.channels.feishu import models as m
from dshim.channels.kit.decode import decode
from dshim.channels.kit.ids import TOKEN, check_id, check_optional_id, check_time, shape, valid_id
from dshim.errors import (
    AuthError,
    ChannelError,
    Deleted,
    FatalChannelError,
    NotFound,
    PermissionDenied,
    RateLimited,
    RemoteProtocolError,
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
    Ignored,
    Send,
    WsEnded,
)

CHANNEL = "feishu"

#: Every Feishu id dshim reads -- ``om_``/``oc_``/``ou_``/``omt_`` ids, ``img_v2_``/
#: ``file_v3_`` resource keys, card tokens (``c-``) -- is letters, digits, ``_`` and ``-``
#: (feishu.md §4); they go into URL paths (``/messages/{message_id}``,
#: ``/resources/{file_key}``), so anything else is a malformed event.  A bad
#: ``parent_id`` / ``root_id`` is only a quote that cannot be had (kit.ids).
FEISHU_ID = shape("feishu", f"[{TOKEN}]+")

# --- pbbp2 frames (proto2) ------------------------------------------------------------------

METHOD_CONTROL = 0
METHOD_DATA = 1
#: A frame bigger than this is refused before decoding (the transport caps it too).
MAX_FRAME_BYTES = 16 * 1024 * 1024
_MAX_VARINT_BYTES = 10


class FrameError(RemoteProtocolError, ValueError):
    """Bytes that are not a valid ``pbbp2.Frame`` (still a ValueError, as it always was)."""


@dataclass(slots=True)
class Frame:
    """``pbbp2.Frame``: fields 1-4 are proto2 ``required`` (always encoded, also when 0)."""

    seq_id: int = 0
    log_id: int = 0
    service: int = 0
    method: int = METHOD_CONTROL
    headers: list[tuple[str, str]] = field(default_factory=list)
    payload_encoding: str | None = None
    payload_type: str | None = None
    payload: bytes | None = None
    log_id_new: str | None = None

    def header(self, key: str) -> str | None:
        for k, v in self.headers:
            if k == key:
                return v
        return None

    def with_header(self, key: str, value: str) -> list[tuple[str, str]]:
        """The headers with ``key`` set to ``value`` (replaced if present, else appended)."""
        out = [(k, v) for k, v in self.headers if k != key]
        out.append((key, value))
        return out


def _varint(value: int) -> bytes:
    if value < 0:  # int32 negatives are 10-byte two's complement in protobuf
        value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len_field(tag: int, data: bytes) -> bytes:
    return bytes([tag]) + _varint(len(data)) + data


def encode_frame(frame: Frame) -> bytes:
    """The frame's proto2 wire bytes (tags 0x08 0x10 0x18 0x20, 0x2a headers, 0x32-0x4a)."""
    out = bytearray()
    out += b"\x08" + _varint(frame.seq_id)
    out += b"\x10" + _varint(frame.log_id)
    out += b"\x18" + _varint(frame.service)
    out += b"\x20" + _varint(frame.method)
    for key, value in frame.headers:
        inner = _len_field(0x0A, key.encode("utf-8")) + _len_field(0x12, value.encode("utf-8"))
        out += _len_field(0x2A, inner)
    if frame.payload_encoding is not None:
        out += _len_field(0x32, frame.payload_encoding.encode("utf-8"))
    if frame.payload_type is not None:
        out += _len_field(0x3A, frame.payload_type.encode("utf-8"))
    if frame.payload is not None:
        out += _len_field(0x42, frame.payload)
    if frame.log_id_new is not None:
        out += _len_field(0x4A, frame.log_id_new.encode("utf-8"))
    return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = 0
    for i in range(_MAX_VARINT_BYTES):
        if pos >= len(data):
            raise FrameError("truncated varint")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            return result & ((1 << 64) - 1), pos
    raise FrameError("varint longer than 10 bytes")


def _fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of each field; unknown wire types are errors."""
    pos = 0
    end = len(data)
    while pos < end:
        key, pos = _read_varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise FrameError("field number 0")
        if wire == 0:
            value, pos = _read_varint(data, pos)
            yield number, wire, value
        elif wire == 2:
            length, pos = _read_varint(data, pos)
            if length > end - pos:
                raise FrameError("length-delimited field runs past the end")
            yield number, wire, data[pos : pos + length]
            pos += length
        elif wire == 1:
            if end - pos < 8:
                raise FrameError("truncated fixed64")
            yield number, wire, data[pos : pos + 8]
            pos += 8
        elif wire == 5:
            if end - pos < 4:
                raise FrameError("truncated fixed32")
            yield number, wire, data[pos : pos + 4]
            pos += 4
        else:
            raise FrameError(f"unsupported wire type {wire}")


def _text(value: int | bytes, what: str) -> str:
    if not isinstance(value, bytes):
        raise FrameError(f"{what}: expected a string")
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise FrameError(f"{what}: not UTF-8") from exc


def _int(value: int | bytes, what: str, *, signed32: bool = False) -> int:
    if not isinstance(value, int):
        raise FrameError(f"{what}: expected a varint")
    if signed32:
        value &= 0xFFFFFFFF
        if value >= 1 << 31:
            value -= 1 << 32
    return value


def decode_frame(data: bytes) -> Frame:
    """Parse a ``pbbp2.Frame``; raises :class:`FrameError` (never anything else)."""
    if len(data) > MAX_FRAME_BYTES:
        raise FrameError("frame too large")
    frame = Frame()
    seen = 0
    for number, wire, value in _fields(data):
        if number == 1 and wire == 0:
            frame.seq_id = _int(value, "SeqID")
            seen |= 1
        elif number == 2 and wire == 0:
            frame.log_id = _int(value, "LogID")
            seen |= 2
        elif number == 3 and wire == 0:
            frame.service = _int(value, "service", signed32=True)
            seen |= 4
        elif number == 4 and wire == 0:
            frame.method = _int(value, "method", signed32=True)
            seen |= 8
        elif number == 5 and wire == 2:
            assert isinstance(value, bytes)
            key: str | None = None
            val: str | None = None
            for n, w, v in _fields(value):
                if n == 1 and w == 2:
                    key = _text(v, "header key")
                elif n == 2 and w == 2:
                    val = _text(v, "header value")
            if key is None or val is None:
                raise FrameError("header without key or value")
            frame.headers.append((key, val))
        elif number == 6 and wire == 2:
            frame.payload_encoding = _text(value, "payload_encoding")
        elif number == 7 and wire == 2:
            frame.payload_type = _text(value, "payload_type")
        elif number == 8 and wire == 2:
            assert isinstance(value, bytes)
            frame.payload = value
        elif number == 9 and wire == 2:
            frame.log_id_new = _text(value, "LogIDNew")
        elif number <= 9:
            raise FrameError(f"field {number} has the wrong wire type {wire}")
        # unknown fields (number > 9) are skipped
    if seen != 15:
        raise FrameError("a required field (SeqID, LogID, service, method) is missing")
    return frame


def ping_frame(service_id: int) -> bytes:
    """The client's CONTROL ping (SeqID/LogID 0, no payload)."""
    return encode_frame(
        Frame(service=service_id, method=METHOD_CONTROL, headers=[("type", "ping")])
    )


def ack_frame(frame: Frame, *, biz_rt_ms: int, data: bytes | None = None) -> bytes:
    """The ack of an event: the same frame, every header echoed plus ``biz_rt``, and the
    payload ``{"code":200}`` (with ``data`` = base64 of a card callback's answer)."""
    body: dict[str, Any] = {"code": 200}
    if data is not None:
        body["data"] = base64.b64encode(data).decode("ascii")
    return encode_frame(
        Frame(
            seq_id=frame.seq_id,
            log_id=frame.log_id,
            service=frame.service,
            method=frame.method,
            headers=frame.with_header("biz_rt", str(max(0, biz_rt_ms))),
            payload_encoding=frame.payload_encoding,
            payload_type=frame.payload_type,
            payload=m.encode(body),
            log_id_new=frame.log_id_new,
        )
    )


def service_id_of(url: str) -> int:
    """The ``service_id`` query parameter of a long-connection URL (0 when absent)."""
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    try:
        return int(query.get("service_id", ["0"])[0])
    except ValueError:
        return 0


# --- fragments ------------------------------------------------------------------------------

#: Incomplete fragmented events are forgotten this long after their first fragment (SDKs: 5 s).
FRAGMENT_TTL_S = 5.0
#: At most this many fragmented events are buffered at once (the oldest is dropped).
MAX_PENDING_MESSAGES = 64
#: A reassembled event may not be larger than this.
MAX_EVENT_BYTES = 8 * 1024 * 1024
MAX_FRAGMENTS = 1024


@dataclass(slots=True)
class _Partial:
    first_at: float
    parts: list[bytes | None]
    size: int = 0


class Reassembler:
    """Fragment reassembly by ``message_id`` / ``sum`` / ``seq`` (bounded, expiring)."""

    def __init__(self) -> None:
        self._pending: dict[str, _Partial] = {}

    def __len__(self) -> int:
        return len(self._pending)

    def add(
        self, message_id: str, total: int, seq: int, payload: bytes, now: float
    ) -> bytes | None:
        """The whole payload once ``payload`` completed it, else None.  Raises ValueError
        for an impossible fragment (bad ``sum``/``seq``, over the size bound)."""
        self.expire(now)
        if total <= 1:
            if len(payload) > MAX_EVENT_BYTES:
                raise ValueError("event too large")
            return payload
        if total > MAX_FRAGMENTS or not 0 <= seq < total:
            raise ValueError(f"bad fragment seq {seq} of {total}")
        partial = self._pending.get(message_id)
        if partial is None or len(partial.parts) != total:
            while len(self._pending) >= MAX_PENDING_MESSAGES:
                self._pending.pop(next(iter(self._pending)))
            partial = _Partial(now, [None] * total)
            self._pending[message_id] = partial
        old = partial.parts[seq]
        partial.size += len(payload) - (len(old) if old is not None else 0)
        if partial.size > MAX_EVENT_BYTES:
            del self._pending[message_id]
            raise ValueError("fragmented event too large")
        partial.parts[seq] = payload
        if any(p is None for p in partial.parts):
            return None
        del self._pending[message_id]
        return b"".join(p for p in partial.parts if p is not None)

    def expire(self, now: float) -> None:
        for key in [k for k, p in self._pending.items() if now - p.first_at > FRAGMENT_TTL_S]:
            del self._pending[key]

    def clear(self) -> None:
        self._pending.clear()


# --- the session ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FeishuEvent:
    """One complete event for the channel: its JSON bytes, the frame that completed it
    (echoed in the ack), when it arrived, and which connection it came on."""

    payload: bytes
    frame: Frame
    received_at: float
    connection: int


@dataclass(slots=True)
class ConnectionSettings:
    """``ClientConfig``, with the SDKs' defaults until the platform sends one (seconds)."""

    ping_interval: float = 120.0
    reconnect_interval: float = 120.0
    reconnect_nonce: float = 30.0
    reconnect_count: int = -1

    def apply(self, cfg: m.ClientConfig) -> None:
        if cfg.ping_interval is not None and cfg.ping_interval > 0:
            self.ping_interval = float(cfg.ping_interval)
        if cfg.reconnect_interval is not None and cfg.reconnect_interval >= 0:
            self.reconnect_interval = float(cfg.reconnect_interval)
        if cfg.reconnect_nonce is not None and cfg.reconnect_nonce >= 0:
            self.reconnect_nonce = float(cfg.reconnect_nonce)
        if cfg.reconnect_count is not None:
            self.reconnect_count = int(cfg.reconnect_count)


#: A card click is answered in its ack with this toast (the card itself is updated by API).
CARD_TOAST = {"toast": {"type": "info", "content": "Received"}}
WATCHDOG_CLOSE = 4000
#: An event whose acceptance takes this long is acked before ``accept`` returns ...
EARLY_ACK_S = 2.0
#: ... checked this often while connected (so the ack goes out before the 3 s deadline).
ACK_POLL_S = 0.5
#: ``Handshake-Autherrcode`` of a 514 refusal: the app has too many connections (client error).
TOO_MANY_CONNECTIONS = 1000040350


class FeishuSession:
    """The long connection as a :class:`~dshim.net.ws_session.WsSession`."""

    def __init__(self, *, random: Callable[[], float]) -> None:
        self.settings = ConnectionSettings()
        self.random = random
        self.service_id = 0
        self.reassembler = Reassembler()
        self.live = False
        #: Pongs received on this connection (probes read it).
        self.pongs = 0
        self._next_ping: float | None = None
        self._pong_deadline: float | None = None
        #: Connection attempts since the last one that became live (reconnect schedule).
        self.failures = 0
        self.reconnect_jitter_used = False
        #: Counts connections, so that an ack never goes out on a later one.
        self.connection = 0
        self._acks: list[Send] = []
        #: The event the channel is accepting now, and whether its ack went out early.
        self._in_flight: FeishuEvent | None = None
        self._early_acked = False
        #: While connected, tick() runs at least this often (the early-ack guard).
        self._poll_at: float | None = None

    # -- planning (called by the channel's ``next_url``) ----------------------------------

    def set_endpoint(self, url: str, cfg: m.ClientConfig | None) -> None:
        self.service_id = service_id_of(url)
        if cfg is not None:
            self.settings.apply(cfg)

    def reconnect_delay(self) -> float:
        """How long to wait before the next attempt: ``random() x ReconnectNonce`` once
        after a connection was lost, then ``ReconnectInterval`` between failures."""
        if self.failures == 0:
            return 0.0
        if not self.reconnect_jitter_used:
            self.reconnect_jitter_used = True
            return self.random() * self.settings.reconnect_nonce
        return self.settings.reconnect_interval

    # -- WsSession ------------------------------------------------------------------------

    def connection_opened(self, now: float) -> Sequence[Action[FeishuEvent]]:
        self.connection += 1
        self._acks.clear()
        self._in_flight = None
        self._poll_at = now + ACK_POLL_S
        self.live = False
        self.pongs = 0
        self.reassembler.clear()
        return self._ping(now)

    def _ping(self, now: float) -> list[Action[FeishuEvent]]:
        self._next_ping = now + self.settings.ping_interval
        if self._pong_deadline is None:  # the connection just opened
            self._pong_deadline = now + 2 * self.settings.ping_interval
        return [Send(ping_frame(self.service_id), kind="ping", logged=False)]

    def receive(self, data: str | bytes, now: float) -> Sequence[Action[FeishuEvent]]:
        if isinstance(data, str):
            return [Ignored("malformed", "text frame on a binary protocol")]
        try:
            frame = decode_frame(data)
        except FrameError as exc:
            return [Ignored("malformed", str(exc)[:200])]
        kind = frame.header("type") or ""
        if frame.method == METHOD_CONTROL:
            if kind == "pong":
                return self._pong(frame, now)
            return []  # server pings need no answer
        if frame.method != METHOD_DATA:
            return [Ignored("unknown_method", str(frame.method))]
        if kind != "event":
            return []  # type=card and others: no SDK acks them
        try:
            total = int(frame.header("sum") or "1")
            seq = int(frame.header("seq") or "0")
            payload = self.reassembler.add(
                frame.header("message_id") or "", total, seq, frame.payload or b"", now
            )
        except ValueError as exc:
            return [Ignored("malformed", str(exc)[:200])]
        if payload is None:
            return []  # more fragments to come
        # The ack goes out once the channel called acknowledge() (after accept), from tick();
        # should accepting take longer than EARLY_ACK_S, tick() acks it anyway.
        event = FeishuEvent(payload, frame, now, self.connection)
        self._in_flight, self._early_acked = event, False
        return [Deliver(event)]

    def acknowledge(self, event: FeishuEvent, now: float, *, data: bytes | None = None) -> None:
        """Queue the ack of ``event`` (sent by the next :meth:`tick`, at once): the frame
        echoed with ``biz_rt`` = the time since it arrived, and ``data`` (a card callback's
        JSON answer) base64-encoded in the payload.  An event of an earlier connection is
        not acked (the platform re-pushes it; dedup drops the copy), nor one acked early."""
        if event.connection != self.connection:
            return
        if self._in_flight is event:
            self._in_flight = None
            if self._early_acked:
                return
        self._queue_ack(event, now, data)

    def _queue_ack(self, event: FeishuEvent, now: float, data: bytes | None) -> None:
        biz_rt = round((now - event.received_at) * 1000)
        self._acks.append(
            Send(ack_frame(event.frame, biz_rt_ms=biz_rt, data=data), kind="ack", logged=False)
        )

    def _pong(self, frame: Frame, now: float) -> list[Action[FeishuEvent]]:
        self.pongs += 1
        out: list[Action[FeishuEvent]] = []
        if frame.payload:
            try:
                cfg = decode(m.client_config_decoder, frame.payload)
            except msgspec.MsgspecError:
                out.append(Ignored("malformed", "pong payload is not a ClientConfig"))
            else:
                before = self.settings.ping_interval
                self.settings.apply(cfg)
                if self.settings.ping_interval != before and self._next_ping is not None:
                    self._next_ping = now + self.settings.ping_interval
        # The watchdog: the next pong is due within 2 x PingInterval of this one.
        self._pong_deadline = now + 2 * self.settings.ping_interval
        if not self.live:
            self.live = True
            self.failures = 0
            self.reconnect_jitter_used = False
            out.append(Connected(session=None))
        return out

    def next_timer(self) -> float | None:
        if self._acks:
            return -math.inf  # acks are due at once
        timers = [t for t in (self._next_ping, self._pong_deadline, self._poll_at) if t is not None]
        return min(timers) if timers else None

    def tick(self, now: float, *, reading: bool) -> Sequence[Action[FeishuEvent]]:
        event = self._in_flight
        if event is not None and not self._early_acked and now - event.received_at >= EARLY_ACK_S:
            # Accepting is slow (a busy store): ack before Feishu's 3 s run out; should the
            # event come again anyway, the persisted dedup drops it.
            self._early_acked = True
            self._queue_ack(event, now, None)
        if self._poll_at is not None:
            self._poll_at = now + ACK_POLL_S
        out: list[Action[FeishuEvent]] = list(self._acks)
        self._acks.clear()
        if self._pong_deadline is not None and now >= self._pong_deadline:
            if reading:
                self._pong_deadline = None
                self._next_ping = None
                return [*out, Close(WATCHDOG_CLOSE, "no pong within 2 x PingInterval")]
            self._pong_deadline = now + 1.0  # a delivery is in hand: look again shortly
        if self._next_ping is not None and now >= self._next_ping:
            out.extend(self._ping(now))
        return out

    def connection_lost(self, ended: WsEnded, now: float) -> None:
        self._next_ping = None
        self._pong_deadline = None
        self._acks.clear()
        self._in_flight = None
        self._poll_at = None
        self.reassembler.clear()
        was_live = self.live
        self.live = False
        if ended.rejected == 403:
            raise FatalChannelError("Feishu refused the long connection (HTTP 403): stopping")
        if ended.rejected == 514 and ended.rejected_header("handshake-autherrcode") == str(
            TOO_MANY_CONNECTIONS
        ):
            raise FatalChannelError(
                "Feishu refused the long connection: too many connections for this app "
                "(at most 50; is another dshim running with it?)"
            )
        if was_live:
            self.failures = 1
            self.reconnect_jitter_used = False
        else:
            self.failures += 1


# --- errors ---------------------------------------------------------------------------------

#: Token codes: refresh the tenant_access_token and retry once.
TOKEN_CODES = frozenset({99991661, 99991663, 99991671, 99991668})
PERMISSION_CODES = frozenset({230002, 230027, 230050, 230013, 99991672, 99991401, 230035, 230053})
NOT_FOUND_CODES = frozenset({230001, 234003, 230011, 232009})
DELETED_CODES = frozenset({230110})
RATE_CODES = frozenset({99991400, 230020})
#: "message is being sent": the outcome is unknown (retried once with the same uuid).
SENDING_CODE = 230049
MISSING_SCOPE = 99991672
CARD_PERMISSION_CODES = frozenset({99991672, 300311})


def classify_error(
    status: int, code: int, what: str, msg: str = "", *, reset_s: float | None = None
) -> ChannelError:
    """One Feishu failure (HTTP status + JSON ``code``) as the error tree."""
    text = f"{what}: code {code} ({msg[:120]})" if msg else f"{what}: code {code}"
    if code in TOKEN_CODES:
        return AuthError(text, status=status, code=code)
    if code in RATE_CODES or status == 429:
        return RateLimited(text, retry_after=reset_s if reset_s else 1.0, status=status, code=code)
    if code in DELETED_CODES:
        return Deleted(text, status=status, code=code)
    if code in PERMISSION_CODES or status in (401, 403):
        return PermissionDenied(text, status=status, code=code)
    if code in NOT_FOUND_CODES or status == 404:
        return NotFound(text, status=status, code=code)
    if code == SENDING_CODE:
        return TransportError(text, status=status, code=code, request_sent=True)
    if status >= 500 or code in (1, 1000040343):
        return TransportError(text, status=status, code=code, request_sent=True)
    return ChannelError(text, status=status, code=code)


# --- contact lookups (substitute targets) ----------------------------------------------------

#: ``contact/v3`` codes with a definite answer (cached); anything else is transient.
CROSS_APP_CODE = 99992361  # the open_id belongs to another app
NOT_VISIBLE_CODE = 41050  # outside the app's contact visibility
INVALID_ID_CODES = frozenset({41012, 40001})  # invalid user id / invalid parameter

ProfileOutcome = Literal["ok", "cross_app", "not_visible", "invalid_id", "error"]


@dataclass(frozen=True, slots=True)
class Profile:
    """A strict user-profile lookup: ``ok`` (a named user), ``cross_app``,
    ``not_visible`` (also code 0 without a user), ``invalid_id``, or ``error`` (any
    other code, the network, a timeout: never a definite answer)."""

    outcome: ProfileOutcome
    open_id: str | None = None
    name: str | None = None
    avatar_url: str | None = None

    @property
    def definite(self) -> bool:
        """Worth caching: every outcome but ``error``."""
        return self.outcome != "error"


def profile_of(answer: m.ContactAnswer) -> Profile:
    """A code-0 profile answer: ``ok`` with the name and the 72 px avatar (else 240 px)."""
    user = answer.data.user if answer.data is not None else None
    if answer.code != 0:
        return profile_failure(answer.code)
    if user is None or not user.name or not user.open_id:
        return Profile("not_visible")
    avatar = user.avatar.avatar_72 or user.avatar.avatar_240 if user.avatar else ""
    return Profile("ok", open_id=user.open_id, name=user.name, avatar_url=avatar or None)


def profile_failure(code: int | str | None) -> Profile:
    """A refused lookup by its business code (also inside a non-2xx answer: a 403 with
    99992361 is ``cross_app``, not a transient failure)."""
    if code == CROSS_APP_CODE:
        return Profile("cross_app")
    if code == NOT_VISIBLE_CODE:
        return Profile("not_visible")
    if code in INVALID_ID_CODES:
        return Profile("invalid_id")
    return Profile("error")


#: A hand-typed open_id's profile outcome -> the line's reason (None: accepted).
OPEN_ID_REASONS: dict[ProfileOutcome, str | None] = {
    "ok": None,
    "cross_app": "cross_app_open_id",
    "not_visible": "not_visible",
    "invalid_id": "unresolvable",
    "error": "resolve_failed",
}


def endpoint_error(code: int, msg: str) -> ChannelError:
    """The endpoint call's codes: 1 and 1000040343 retry later, anything else is fatal."""
    if code in (1, 1000040343):
        return TransportError(f"ws endpoint: code {code}", code=code, request_sent=True)
    return AuthError(
        f"ws endpoint refused the app credentials: code {code} ({msg[:120]})", code=code
    )


# --- content extraction ---------------------------------------------------------------------

_PLACEHOLDERS = {
    "sticker": "[sticker]",
    "share_chat": "[shared chat]",
    "share_user": "[shared contact]",
    "system": "[system message]",
    "location": "[location]",
    "merge_forward": "[merged and forwarded messages]",
    "todo": "[task]",
    "hongbao": "[red packet]",
    "share_calendar_event": "[calendar event]",
    "calendar": "[calendar event]",
    "general_calendar": "[calendar event]",
    "video_chat": "[video call]",
    "vote": "[vote]",
    "folder": "[folder]",
}
_MARKDOWN_LINK = re.compile(r"\[([^\]\n]*)\]\(([^)\s]*)\)")


@dataclass(slots=True)
class Media:
    """A resource of a message: ``kind`` image/file/audio/video and its key."""

    kind: str
    key: str
    name: str | None = None


@dataclass(slots=True)
class Extracted:
    text: str
    media: list[Media]
    unsupported: bool = False
    #: People mentioned in the text, in order (placeholders and post ``at`` nodes).
    people: list[Mention] = field(default_factory=list)


#: The id kinds a mention's ``id`` object carries (all kept: targets match any of them).
_ID_KINDS = ("open_id", "user_id", "union_id")
_PLACEHOLDER = re.compile(r"@_user_\d+")


def mention_ids(mention: m.Mention) -> dict[str, str]:
    """Every id of a structured mention by kind; a bare string id is typed by
    ``id_type`` (default open_id, as the platform's)."""
    if isinstance(mention.id, m.UserId):
        found = {k: getattr(mention.id, k) for k in _ID_KINDS}
        return {k: v for k, v in found.items() if isinstance(v, str) and v}
    if isinstance(mention.id, str) and mention.id:
        kind = mention.id_type if mention.id_type in _ID_KINDS else "open_id"
        return {kind: mention.id}
    return {}


class MentionNames:
    """``@_user_N`` placeholder -> ``@name`` (another user) or "" (the bot), and the
    people behind the placeholders (substitute mode)."""

    def __init__(self, mentions: Sequence[m.Mention] | None, bot_open_id: str) -> None:
        self.names: dict[str, str] = {}
        self.people: dict[str, Mention] = {}
        self.bot_mentioned = False
        for mention in mentions or ():
            ids = mention_ids(mention)
            is_bot = bool(bot_open_id) and ids.get("open_id") == bot_open_id
            if is_bot:
                self.bot_mentioned = True
            if mention.key:
                text = "" if is_bot else f"@{mention.name or 'user'}"
                self.names[mention.key] = text
                if ids and not is_bot:
                    self.people[mention.key] = Mention(
                        ids=ids, name=mention.name or None, text=text
                    )

    def in_order(self, text: str) -> list[Mention]:
        """The people whose placeholders ``text`` holds, in text order."""
        if "@_user_" not in text:
            return []
        return [self.people[key] for key in _PLACEHOLDER.findall(text) if key in self.people]

    def at_node(self, uid: str, user_name: str) -> Mention | None:
        """A post's ``at`` node: a placeholder, or an open_id in ``user_id`` (matched
        as an open_id only, never as a tenant user id)."""
        if uid in self.people:
            return self.people[uid]
        if uid in self.names or not uid.startswith("ou_"):
            return None  # the bot itself, ``all``, or nothing usable
        return Mention(
            ids={"open_id": uid},
            name=user_name or None,
            text=f"@{user_name}" if user_name else None,
        )

    def replace(self, text: str) -> str:
        """The text with every placeholder replaced; the bot's own goes with one space
        next to it (the rest of the text, indentation included, is kept as typed)."""
        if "@_" not in text:
            return text
        for key in sorted(self.names, key=len, reverse=True):  # @_user_10 before @_user_1
            name = self.names[key]
            if name:
                text = text.replace(key, name)
            else:
                text = re.sub(re.escape(key) + r" ?| ?" + re.escape(key), "", text)
        return text.replace("@_all", "@all")


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def post_text(content: Any, names: MentionNames) -> Extracted:
    """A post (title + paragraphs): text, links as their text, ``at`` as names, code kept,
    images and media as attachments."""
    if not isinstance(content, dict):
        return Extracted("", [])
    body = content
    if "content" not in body:  # a send-side locale wrapper, seen in lookups
        for loc in _locales(body):
            if isinstance(body[loc], dict):
                body = body[loc]
                break
    media: list[Media] = []
    people: list[Mention] = []
    lines: list[str] = []
    title = _str(body.get("title")).strip()
    if title:
        lines.append(title)
    paragraphs = body.get("content")
    if isinstance(paragraphs, list):
        for para in paragraphs:
            if not isinstance(para, list):
                continue
            parts: list[str] = []
            for el in para:
                if not isinstance(el, dict):
                    continue
                tag = el.get("tag")
                if tag == "text":
                    parts.append(_str(el.get("text")))
                elif tag == "a":
                    parts.append(_str(el.get("text")) or _str(el.get("href")))
                elif tag == "at":
                    uid = _str(el.get("user_id"))
                    person = names.at_node(uid, _str(el.get("user_name")))
                    if person is not None:
                        people.append(person)
                    if uid in names.names:
                        parts.append(names.names[uid])
                    elif uid == "all":
                        parts.append("@all")
                    else:
                        name = _str(el.get("user_name"))
                        parts.append(f"@{name}" if name else "")
                elif tag == "img":
                    key = _str(el.get("image_key"))
                    if key:
                        media.append(Media("image", key))
                elif tag == "media":
                    key = _str(el.get("file_key"))
                    if key:
                        media.append(Media("video", key, _str(el.get("file_name")) or None))
                elif tag == "emotion":
                    emoji = _str(el.get("emoji_type"))
                    if emoji:
                        parts.append(f":{emoji}:")
                elif tag == "code_block":
                    lang = _str(el.get("language")).lower()
                    code = _str(el.get("text")).rstrip("\n")
                    parts.append(f"\n```{lang}\n{code}\n```\n")
                elif tag == "hr":
                    parts.append("\n---\n")
                elif tag == "md":
                    parts.append(_str(el.get("text")))
            lines.append(names.replace("".join(parts)).strip(" "))
    return Extracted(_tidy_post("\n".join(lines)), media, people=people)


def _tidy_post(text: str) -> str:
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def _locales(d: dict[str, Any]) -> list[str]:
    """Locale keys of an i18n dict: zh_cn first, then en_us, then the others in order."""
    keys = [k for k in d if isinstance(k, str) and re.fullmatch(r"[a-z]{2}_[a-z]{2}", k)]
    order = {"zh_cn": 0, "en_us": 1}
    return sorted(keys, key=lambda k: order.get(k, 2))


def content_of(
    msg_type: str, raw_content: str, names: MentionNames, *, file_name_fallback: bool = True
) -> Extracted:
    """Text and media of a message by type (events and lookups use the same rules)."""
    try:
        content = json.loads(raw_content) if raw_content else {}
    except (ValueError, RecursionError):
        return Extracted("", [], unsupported=True)
    if not isinstance(content, dict):
        content = {}
    if msg_type == "text":
        raw = _str(content.get("text"))
        return Extracted(names.replace(raw).strip(), [], people=names.in_order(raw))
    if msg_type == "post":
        return post_text(content, names)
    if msg_type == "image":
        key = _str(content.get("image_key"))
        return Extracted("", [Media("image", key)] if key else [])
    if msg_type in ("file", "audio", "media"):
        key = _str(content.get("file_key"))
        kind = {"file": "file", "audio": "audio", "media": "video"}[msg_type]
        name = _str(content.get("file_name")) or None
        return Extracted("", [Media(kind, key, name)] if key else [])
    if msg_type == "interactive":
        text = card_text(content)
        return Extracted(text or "", [], unsupported=not text)
    if msg_type == "location":
        name = _str(content.get("name"))
        return Extracted(f"[location: {name}]" if name else "[location]", [])
    return Extracted(_PLACEHOLDERS.get(msg_type, f"[{msg_type or 'unknown'} message]"), [])


# --- card text ------------------------------------------------------------------------------

#: Keys never read for visible text: settings, callbacks, links, hidden parts.
_CARD_SKIP = frozenset(
    {
        "config",
        "value",
        "behaviors",
        "url",
        "href",
        "multi_url",
        "card_link",
        "callback",
        "confirm",
        "img_key",
        "image_key",
        "icon",
        "element_id",
        "tag",
        "fallback",
        "extra",
        "style",
        "template",
        "template_id",
        "template_variable",
        "card_id",
        "streaming_config",
        "summary",
        "placeholder",
        "hover_tips",
        "disabled_tips",
        "id",
        "user_id",
        "open_id",
    }
)
_CARD_TEXT_KEYS = ("content", "text", "title", "subtitle")
_UPGRADE = re.compile(
    r"(升级|更新).{0,12}(客户端|版本)|upgrade.{0,40}(client|version|app)|update.{0,30}(client|app)",
    re.IGNORECASE,
)
_CARD_MAX_NODES = 20_000


def card_text(card: Any) -> str | None:
    """The visible text of a card (Card 1.0, the receive-side projection, CardKit 2.0,
    the ``raw_card_content`` envelope with ``json_card`` and ``property`` wrappers, i18n
    variants preferring zh_cn, then en_us, then the first); None when there is none (an
    empty card, a bare ``card_id``, an "upgrade your client" placeholder)."""
    if isinstance(card, dict):
        inner = card.get("json_card")
        if isinstance(inner, str):
            try:
                card = json.loads(inner)
            except (ValueError, RecursionError):
                return None
    out: list[str] = []
    budget = [_CARD_MAX_NODES]
    _walk(card, out, budget, 0)
    text = _tidy_post("\n".join(t for t in (s.strip() for s in out) if t))
    if not text or _UPGRADE.search(text) and len(text) < 120:
        return None
    return text


def _pick_locale(d: dict[str, Any]) -> Any:
    locales = _locales(d)
    return d[locales[0]] if locales else None


def _walk(node: Any, out: list[str], budget: list[int], depth: int) -> None:
    budget[0] -= 1
    if budget[0] < 0 or depth > 60:
        return
    if isinstance(node, list):
        for item in node:
            _walk(item, out, budget, depth + 1)
        return
    if not isinstance(node, dict):
        return
    if node.get("hidden") is True or node.get("visible") is False:
        return
    prop = node.get("property")
    if isinstance(prop, dict):  # raw_card_content wraps element fields in "property"
        merged = {k: v for k, v in node.items() if k != "property"}
        merged.update(prop)
        node = merged
    keys = list(node)
    # i18n variants: take one locale only.
    i18n_done: set[str] = set()
    for key in keys:
        if isinstance(key, str) and key.startswith("i18n_") and isinstance(node[key], dict):
            base = key[5:]
            chosen = _pick_locale(node[key])
            if chosen is not None:
                i18n_done.add(base)
                _walk_value(base, chosen, out, budget, depth)
    if isinstance(node.get("i18n"), dict):
        chosen = _pick_locale(node["i18n"])
        if chosen is not None:
            if isinstance(chosen, str):
                out.append(_visible(chosen))
            else:
                _walk(chosen, out, budget, depth + 1)
            i18n_done.add("content")
    # A whole card keyed by locale (post-style wrapper).
    if keys and all(isinstance(k, str) and re.fullmatch(r"[a-z]{2}_[a-z]{2}", k) for k in keys):
        chosen = _pick_locale(node)
        if chosen is not None:
            _walk(chosen, out, budget, depth + 1)
        return
    for key in keys:
        if key in _CARD_SKIP or key in i18n_done or key == "property":
            continue
        if isinstance(key, str) and (key.startswith("i18n") or key == "i18n"):
            continue
        _walk_value(key, node[key], out, budget, depth)


def _walk_value(key: str, value: Any, out: list[str], budget: list[int], depth: int) -> None:
    if isinstance(value, str):
        if key in _CARD_TEXT_KEYS:
            out.append(_visible(value))
        return
    if isinstance(value, (dict, list)):
        _walk(value, out, budget, depth + 1)


def _visible(text: str) -> str:
    """Markdown links as their text, ``<at>`` tags as names, other tags dropped."""
    text = _MARKDOWN_LINK.sub(lambda mt: mt.group(1), text)
    text = re.sub(
        r"<at [^>]*>([^<]*)</at>", lambda mt: f"@{mt.group(1)}" if mt.group(1) else "", text
    )
    text = re.sub(r"</?(font|text_tag|link|local_datetime|number_tag|u|i|b|s)[^>]*>", "", text)
    return text


# --- the event mapper -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Recall:
    """A recalled message (``im.message.recalled_v1``): never a turn."""

    conversation_id: str
    message_id: str


@dataclass(frozen=True, slots=True)
class ControlPress:
    """A button of a substitute control notice (``card.action.trigger``): never a turn."""

    action: Literal["stop", "disable"]
    conversation_id: str
    thread_id: str | None
    user_id: str
    card_message_id: str


#: (chat id, quoted message id) -> the loader of that quote.
LookupFactory = Callable[[str, str], Loader]
#: (message id, media) -> the download handle of one resource of the current message.
MediaFactory = Callable[[str, Media], Fetcher | None]


def _ms(value: str) -> float | None:
    try:
        t = float(value) / 1000.0
    except (TypeError, ValueError):
        return None
    return t if math.isfinite(t) and t > 0 else None


def _card_value_text(value: Any) -> str:
    return value if isinstance(value, str) else ""


def topic_key(msg: m.Message) -> str | None:
    """The ``thread_id`` of a message in a topic (话题): its topic's root message id.

    One topic is one conversation, lane and harness session, so its first message and
    every reply in it must map to the same key.  The topic's own ``thread_id``
    (``omt_...``) cannot be that key: a topic's first message may arrive without it
    (native topic groups, ``chat_type`` ``topic_group``) while the replies carry it.  The
    root message id is known to both: a reply in a topic names it in ``root_id``, the
    first message is it.  A message is in a topic when it has a ``thread_id``, or when
    its chat is a topic group (every top-level message there opens a topic); a quote
    reply in an ordinary chat (``root_id`` without ``thread_id``) stays in the chat's
    main conversation.
    """
    if not msg.thread_id and msg.chat_type != "topic_group":
        return None
    root = msg.root_id
    if root and root != msg.thread_id and not root.startswith("omt_"):
        return root
    return msg.message_id  # the topic's first message (or a root_id naming the topic)


class EventMapper:
    """Maps event JSON to the pipeline's model; never raises for bad input."""

    def __init__(
        self,
        *,
        bot_open_id: str,
        app_id: str,
        lookup: LookupFactory | None = None,
        media: MediaFactory | None = None,
    ) -> None:
        self.bot_open_id = bot_open_id
        self.app_id = app_id
        self.lookup = lookup
        self.media = media

    def decode(self, raw: bytes) -> InboundMessage | Skip | Recall | ControlPress:
        """One event (the DATA frame payload, reassembled)."""
        try:
            env = decode(m.envelope_decoder, raw)
            header = env.header
            if header is None:
                return Skip(reason="malformed", detail="event without a header")
            kind = header.event_type
            if kind == "im.message.receive_v1":
                return self._message(m.receive_decoder.decode(env.event), header)
            if kind == "im.message.recalled_v1":
                ev = m.recalled_decoder.decode(env.event)
                check_optional_id(ev.chat_id, FEISHU_ID, "chat_id")
                return Recall(ev.chat_id, check_id(ev.message_id, FEISHU_ID, "message_id"))
            if kind == "card.action.trigger":
                return self._card_action(m.card_action_decoder.decode(env.event), header)
            return Skip(reason="ignored", detail=f"event {kind[:60]!r}")
        except (msgspec.MsgspecError, ValueError, RecursionError) as exc:
            return Skip(reason="malformed", detail=str(exc)[:300])

    def decode_raw(self, raw: bytes) -> InboundMessage | Skip:
        """As :meth:`decode`, for the durable inbox (a recall or a control press is never
        stored)."""
        item = self.decode(raw)
        if isinstance(item, (Recall, ControlPress)):
            return Skip(reason="ignored", detail=type(item).__name__.lower())
        return item

    def _message(self, ev: m.ReceiveEvent, header: m.Header) -> InboundMessage | Skip:
        msg = ev.message
        if not msg.message_id or not msg.chat_id:
            return Skip(reason="malformed", detail="message without message_id or chat_id")
        check_id(msg.message_id, FEISHU_ID, "message_id")
        check_id(msg.chat_id, FEISHU_ID, "chat_id")
        check_optional_id(msg.thread_id, FEISHU_ID, "thread_id")
        sender_id = (ev.sender.sender_id.open_id if ev.sender.sender_id else None) or ""
        check_optional_id(sender_id, FEISHU_ID, "sender open_id")
        names = MentionNames(msg.mentions, self.bot_open_id)
        extracted = content_of(msg.message_type, msg.content, names)
        direct = msg.chat_type == "p2p"
        images: list[MediaRef] = []
        files: list[MediaRef] = []
        for item in extracted.media:
            check_id(item.key, FEISHU_ID, f"{item.kind} key")
            ref = MediaRef(
                kind=item.kind,
                name=item.name,
                fetch=self.media(msg.message_id, item) if self.media is not None else None,
            )
            (images if item.kind == "image" else files).append(ref)
        created = _ms(msg.create_time) or _ms(header.create_time) or 0.0
        check_time(created, "create_time")
        return InboundMessage(
            channel=CHANNEL,
            bot_id=self.bot_open_id,
            message_id=msg.message_id,
            conversation_id=msg.chat_id,
            conversation_type="direct" if direct else "group",
            sender_id=sender_id,
            thread_id=topic_key(msg),
            sender_is_bot=ev.sender.sender_type not in ("", "user"),
            addressed=direct or names.bot_mentioned,
            content=extracted.text,
            images=images,
            files=files,
            reply_to=self._reply_to(msg),
            received_at=created,
            # Only the message's own text: a quoted message is not in the event, a
            # forward (merge_forward) or a card carries no placeholders of its own.
            mentions=extracted.people,
            mentioned=names.bot_mentioned,
        )

    def _reply_to(self, msg: m.Message) -> ReplyReference | None:
        parent = msg.parent_id
        if not parent:
            # No parent_id but a root_id (a topic reply): the root is the quote, as in the
            # seed -- unless it is the message itself or the topic's own id (``omt_``).
            root = msg.root_id
            if not root or root == msg.message_id or root == msg.thread_id:
                return None
            return self._quote(msg.chat_id, root)
        if parent == msg.message_id:
            return None
        if msg.thread_id and parent == msg.root_id:
            return None  # a topic reply points at the topic root: thread context, no quote
        return self._quote(msg.chat_id, parent)

    def _quote(self, chat_id: str, parent: str) -> ReplyReference:
        if not valid_id(parent, FEISHU_ID):
            return ReplyReference(unavailable_reason="not-found")  # never looked up
        loader = self.lookup(chat_id, parent) if self.lookup is not None else None
        if loader is None:
            return ReplyReference(message_id=parent, unavailable_reason="not-delivered")
        return ReplyReference(message_id=parent, loader=loader)

    def _card_action(
        self, ev: m.CardActionEvent, header: m.Header
    ) -> InboundMessage | Skip | ControlPress:
        value = ev.action.value if ev.action is not None else None
        ctx = ev.context
        if not isinstance(value, dict) or value.get("dshim") != 1 or ctx is None:
            return Skip(reason="ignored", detail="card action not from a dshim card")
        control = value.get("control")
        if control is not None:  # a substitute control notice's button
            chat = _card_value_text(value.get("chat"))
            presser = ev.operator.open_id if ev.operator is not None else None
            if control not in ("stop", "disable") or not chat or not presser:
                return Skip(reason="malformed", detail="control press without action or chat")
            check_id(chat, FEISHU_ID, "chat")
            check_id(presser, FEISHU_ID, "operator open_id")
            check_optional_id(_card_value_text(value.get("thread")), FEISHU_ID, "thread")
            check_optional_id(ctx.open_message_id, FEISHU_ID, "open_message_id")
            return ControlPress(
                action="stop" if control == "stop" else "disable",
                conversation_id=chat,
                thread_id=_card_value_text(value.get("thread")) or None,
                user_id=presser,
                card_message_id=ctx.open_message_id,
            )
        answer = _card_value_text(value.get("answer"))
        chat = ctx.open_chat_id or _card_value_text(value.get("chat"))
        sender = ev.operator.open_id if ev.operator is not None else None
        if not answer or not chat or not sender:
            return Skip(reason="malformed", detail="card action without answer, chat or operator")
        check_id(chat, FEISHU_ID, "chat")
        check_id(sender, FEISHU_ID, "operator open_id")
        check_optional_id(ctx.open_message_id, FEISHU_ID, "open_message_id")
        kind = _card_value_text(value.get("kind"))
        thread = check_optional_id(_card_value_text(value.get("thread")), FEISHU_ID, "thread")
        # One click is one message: the card's token (or the event id) keys its dedup.
        click_id = check_id(ev.token or header.event_id, FEISHU_ID, "token")
        return InboundMessage(
            channel=CHANNEL,
            bot_id=self.bot_open_id,
            message_id=f"card:{click_id}",
            conversation_id=chat,
            conversation_type="direct" if kind == "direct" else "group",
            sender_id=sender,
            thread_id=thread,
            addressed=True,
            content=answer,
            received_at=check_time(_ms(header.create_time) or 0.0, "create_time"),
            route=ctx.open_message_id or None,  # the card: answers go under it
        )


# --- looked-up messages ---------------------------------------------------------------------


def fetched_reference(
    answer: m.MessageAnswer,
    *,
    chat_id: str,
    message_id: str,
    app_id: str,
    bot_open_id: str,
    bot_name: str,
) -> ReplyReference | None:
    """A quoted message from ``GET messages/{id}``: None when it is not there (or not shown
    to be in this chat -- another ``chat_id``, or none: its content is discarded)."""
    items = answer.data.items if answer.data is not None and answer.data.items else []
    item = next((i for i in items if i.message_id == message_id), None)
    if item is None:
        return None
    if item.chat_id != chat_id:
        return None  # another chat, or none named: never leak its content
    if item.deleted:
        return ReplyReference(message_id=message_id, unavailable_reason="deleted")
    sender = item.sender
    is_bot = sender is not None and sender.sender_type == "app" and sender.id == app_id
    names = MentionNames(item.mentions, bot_open_id)
    extracted = content_of(item.msg_type, item.body.content if item.body else "", names)
    ref = ReplyReference(message_id=message_id)
    if is_bot:
        ref.author_id = bot_open_id
        ref.author_name = bot_name
    elif sender is not None and sender.id:
        ref.author_id = sender.id
    ref.content = extracted.text or UNSET
    if extracted.media:
        ref.attachments = [Attachment(kind=md.kind, name=md.name) for md in extracted.media]
    if extracted.unsupported:
        ref.unavailable_reason = "unsupported"
    return ref


def lookup_failure(exc: ChannelError) -> ReplyReference | None:
    """A failed lookup as a reference reason (None: ``not-found``)."""
    if isinstance(exc, Deleted):
        return ReplyReference(unavailable_reason="deleted")
    if isinstance(exc, NotFound):
        return None
    if isinstance(exc, (PermissionDenied, AuthError)):
        return ReplyReference(unavailable_reason="permission-denied")
    return ReplyReference(unavailable_reason="not-delivered")
