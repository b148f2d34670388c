"""A :class:`~dshim.channels.whatsapp_web.engine.WaEngine` over a websocket: the engine
boundary carried to another process (the fake WhatsApp of
:mod:`dshim.testing.fakes.whatsapp_web`, which a test or ``dshim serve`` reaches with the
channel's ``engine_url`` setting).

Theory of operation
-------------------
One websocket on ``engine_url`` (``ws://127.0.0.1:<port>``) per :meth:`WireEngine.connect`;
every frame is one JSON object in a text frame, told apart by ``type``.

Client to server::

    {"type": "call", "id": 7, "op": "send", "args": {...}}   one call, answered by id
    {"type": "ack", "ack": "<ack id>"}                         a message is taken

Server to client::

    {"type": "result", "id": 7, "result": ...}
    {"type": "error", "id": 7, "kind": "transport" | "unknown" | "not_found"
                                     | "rate_limited" | "refused",
     "message": "...", "status": int | null, "retry_after": float | null}
    {"type": "event", "event": "message", "raw": {...}, "ack": "<ack id>"}
    {"type": "event", "event": "qr", "code": "..."}
    {"type": "event", "event": "paired", "jid": "...", "name": "...", "error": "..."}
    {"type": "event", "event": "connected" | "disconnected" | "replaced"}
    {"type": "event", "event": "logged_out", "reason": "LOGGED_OUT", "on_connect": false}
    {"type": "event", "event": "connect_failed", "reason": "...", "message": "..."}
    {"type": "event", "event": "keepalive_lost", "errors": 3}

The calls and their ``args`` / ``result`` (JIDs as ``user@server``):

==========  =========================================================  ===================
op          args                                                       result
==========  =========================================================  ===================
me          ``{}``                                                     ``null`` (not
                                                                       paired) or
                                                                       ``{jid, lid,
                                                                       push_name,
                                                                       platform}``
send        ``{chat, text, quote: null | {stanza_id, participant,      the message id
            message}}``
edit        ``{chat, message_id, text}``                               ``null``
presence    ``{chat, composing}``                                      ``null``
mark_read   ``{chat, sender, message_ids, timestamp}``                 ``null``
download    ``{raw: <the message event>, field}``                      the bytes, base64
pair_phone  ``{phone}``                                                the pair code
logout      ``{}``                                                     ``null``
disconnect  ``{}``                                                     ``null``
==========  =========================================================  ===================

A message event's ``raw`` is neonize's ``Message`` event as
``MessageToDict(event, preserving_proto_field_name=True)``; the :class:`Incoming` it
becomes holds ``json.dumps(raw, separators=(",", ":"))`` encoded, byte for byte what
:class:`~dshim.channels.whatsapp_web.engine.NeonizeEngine` hands over.  Its ``ack`` goes
back once the channel set ``Incoming.taken``, on the connection the message came in on;
a message not acked (the connection ended first, the engine was closed) is delivered
again at the next connect -- whatsmeow's guarantee, since it acks when its handler
returns.

The connection's end says how :meth:`~WireEngine.connect` ends: a close with code 1000
(the server ended the session: logged out, replaced, ``disconnect``) or our own close
(:meth:`~WireEngine.disconnect`) returns; any other end (a dropped socket, 1006, a
server going away) raises :class:`~dshim.errors.TransportError` and the channel
reconnects with its backoff.  A socket that cannot be opened is a
``TransportError(request_sent=False)``.  The engine makes no events of its own: a drop is
the raise, not a ``Disconnected``.

Events reach the channel through a bounded channel in the order they came; while it is
full the engine stops reading the socket, answers to calls included, so a burst waits in
the server (the channel reads its events in a task of their own, never behind a call).

Calls need the live connection: one that is not open within :data:`CONNECTION_WAIT_S`
fails with ``request_sent=False`` (nothing went out); an answer that does not come
within :data:`CALL_DEADLINE_S`, or a connection lost while the call waits, is a
``TransportError`` of unknown outcome (the call may have been carried out).  Error
frames map once, here: ``transport`` with a status to ``TransportError(status=...)``
(nothing was done), ``unknown`` to a ``TransportError`` of unknown outcome,
``not_found`` to :class:`~dshim.errors.NotFound`, ``rate_limited`` to
:class:`~dshim.errors.RateLimited`, ``refused`` to :class:`~dshim.errors.ChannelError`.
Logs name ops, ids and close codes, never a message's text or media.
"""

from __future__ import annotations

import base64
import binascii
import itertools
import json
import urllib.parse
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
)

from dshim.channels.whatsapp_web.engine import (
    Account,
    Connected,
    ConnectFailed,
    Disconnected,
    EngineEvent,
    Incoming,
    KeepAliveLost,
    LoggedOut,
    Paired,
    QrCode,
    Quote,
    Replaced,
    WaEngine,
)
from dshim.errors import (
    ChannelError,
    ConfigError,
    NotFound,
    RateLimited,
    RemoteProtocolError,
    TransportError,
)
from dshim.net.ws import WsOptions, open_client_websocket

__all__ = ["CALL_DEADLINE_S", "CONNECTION_WAIT_S", "WireEngine"]

log = structlog.get_logger("dshim.whatsapp_web")

#: A call waits this long for a live connection before it fails (nothing sent).
CONNECTION_WAIT_S = 5.0
#: A call's answer must come within this (past it: the outcome is unknown).
CALL_DEADLINE_S = 30.0
#: Events waiting for the channel before the reader stops reading (backpressure).
EVENT_BUFFER = 64
DISCONNECT_TIMEOUT_S = 2.0
#: The websocket (dshim's own opener: it closes the socket on every way out, which
#: trio-websocket's ``open_websocket_url`` does not after a dropped connection).
WS_OPTIONS = WsOptions(
    connect_timeout_s=10.0,
    message_queue_size=64,
    max_message_size=64 * 1024 * 1024,
)
NORMAL_CLOSURE = 1000


@dataclass(eq=False)
class _Pending:
    """One call waiting for its answer."""

    op: str
    done: trio.Event = field(default_factory=trio.Event)
    frame: dict[str, Any] | None = None
    lost: bool = False


@dataclass(eq=False)
class _Connection:
    """One open websocket and the calls waiting on it."""

    ws: WebSocketConnection
    pending: dict[int, _Pending] = field(default_factory=dict)
    closed: bool = False
    #: We end it (:meth:`WireEngine.disconnect`): ``connect`` returns however it closes.
    ending: bool = False

    def lose(self) -> None:
        """The connection is over: every waiting call learns it."""
        self.closed = True
        for pending in self.pending.values():
            pending.lost = True
            pending.done.set()


class WireEngine(WaEngine):
    """:class:`WaEngine` over the websocket protocol of the module docstring (create it
    inside the bot's trio run)."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("ws", "wss") or not parts.hostname:
            raise ConfigError(f"engine_url must be a ws:// URL, not {url!r}")
        self.url = url
        self._loggable = urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
        self._send, self._receive = trio.open_memory_channel[EngineEvent](EVENT_BUFFER)
        self._conn: _Connection | None = None
        self._conn_changed = trio.Event()
        self._connect_lock = trio.Lock()
        self._ids = itertools.count(1)
        self._ack_waiters: set[trio.CancelScope] = set()
        self.closed = False

    # -- the interface ---------------------------------------------------------------------

    async def events(self) -> AsyncIterator[EngineEvent]:
        async with self._receive:
            async for event in self._receive:
                yield event

    def close(self) -> None:
        self.closed = True
        self._send.close()
        for scope in list(self._ack_waiters):
            scope.cancel()

    async def connect(self) -> None:
        async with self._connect_lock:
            opened = False
            clean = False
            try:
                async with open_client_websocket(self.url, WS_OPTIONS) as (ws, _):
                    opened = True
                    clean = await self._run(_Connection(ws))
            except (OSError, HandshakeError, trio.TooSlowError) as exc:
                if opened:
                    raise
                raise TransportError(
                    f"connect: cannot open {self._loggable}: {type(exc).__name__}",
                    status=exc.status_code if isinstance(exc, ConnectionRejected) else None,
                    request_sent=False,
                ) from exc
            if not clean:
                raise TransportError("connect: the connection to the engine was lost")

    async def me(self) -> Account | None:
        result = await self._call("me", {})
        if result is None:
            return None
        if not isinstance(result, dict) or not result.get("jid"):
            raise RemoteProtocolError("me: the engine answered no account")
        return Account(
            jid=str(result["jid"]),
            lid=str(result.get("lid") or ""),
            push_name=str(result.get("push_name") or ""),
            platform=str(result.get("platform") or ""),
        )

    async def send(self, chat: str, text: str, *, quote: Quote | None = None) -> str:
        quoted = None
        if quote is not None:
            quoted = {
                "stanza_id": quote.stanza_id,
                "participant": quote.participant,
                "message": quote.message,
            }
        result = await self._call("send", {"chat": chat, "text": text, "quote": quoted})
        if not isinstance(result, str) or not result:
            raise ChannelError("send: WhatsApp returned no message id")
        return result

    async def edit(self, chat: str, message_id: str, text: str) -> None:
        await self._call("edit", {"chat": chat, "message_id": message_id, "text": text})

    async def presence(self, chat: str, *, composing: bool) -> None:
        await self._call("presence", {"chat": chat, "composing": composing})

    async def mark_read(
        self, chat: str, sender: str, message_ids: list[str], *, timestamp: int
    ) -> None:
        args = {"chat": chat, "sender": sender, "message_ids": message_ids, "timestamp": timestamp}
        await self._call("mark_read", args)

    async def download(self, raw: bytes, field: str) -> bytes:
        try:
            event = json.loads(raw)
        except ValueError as exc:
            raise ChannelError("download: the event is not JSON") from exc
        result = await self._call("download", {"raw": event, "field": field})
        if not isinstance(result, str):
            raise RemoteProtocolError("download: the engine answered no data")
        try:
            return base64.b64decode(result, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise RemoteProtocolError("download: the data is not base64") from exc

    async def pair_phone(self, phone: str) -> str:
        result = await self._call("pair_phone", {"phone": phone})
        if not isinstance(result, str) or not result:
            raise RemoteProtocolError("pair_phone: the engine answered no code")
        return result

    async def logout(self) -> None:
        await self._call("logout", {})

    async def disconnect(self) -> None:
        conn = self._conn
        if conn is None or conn.closed:
            return  # nothing to end
        conn.ending = True
        try:
            await self._call("disconnect", {})
        except TransportError:
            pass  # the connection ended before the answer: what was asked
        finally:
            with trio.move_on_after(DISCONNECT_TIMEOUT_S) as scope:
                scope.shield = True
                await conn.ws.aclose()

    # -- the connection --------------------------------------------------------------------

    def _set_conn(self, conn: _Connection | None) -> None:
        self._conn = conn
        self._conn_changed.set()
        self._conn_changed = trio.Event()

    async def _run(self, conn: _Connection) -> bool:
        """Read ``conn`` until it closes; True when it ended cleanly."""
        self._set_conn(conn)
        log.info("engine_wire_connected", url=self._loggable)
        try:
            async with trio.open_nursery() as nursery:
                try:
                    while True:
                        data = await conn.ws.get_message()
                        await self._on_frame(conn, data, nursery)
                except ConnectionClosed as exc:
                    code = int(exc.reason.code) if exc.reason is not None else None
                    clean = conn.ending or code == NORMAL_CLOSURE
                    log.info("engine_wire_closed", code=code, clean=clean)
                    return clean
                finally:
                    conn.lose()
                    nursery.cancel_scope.cancel()  # acks still waiting: never sent
        finally:
            conn.lose()
            if self._conn is conn:
                self._set_conn(None)

    async def _on_frame(self, conn: _Connection, data: str | bytes, nursery: trio.Nursery) -> None:
        try:
            frame = json.loads(data)
            kind = frame["type"]
        except (ValueError, KeyError, TypeError):
            log.warning("engine_wire_frame_dropped", why="not a frame")
            return
        if kind in ("result", "error"):
            pending = conn.pending.get(frame.get("id"))
            if pending is None:
                log.warning("engine_wire_frame_dropped", why="no such call", id=frame.get("id"))
                return
            pending.frame = frame
            pending.done.set()
        elif kind == "event":
            await self._on_event(conn, frame, nursery)
        else:
            log.warning("engine_wire_frame_dropped", why="unknown type", type=str(kind)[:40])

    async def _on_event(
        self, conn: _Connection, frame: dict[str, Any], nursery: trio.Nursery
    ) -> None:
        name = frame.get("event")
        event: EngineEvent
        try:
            if name == "message":
                ack = str(frame["ack"])
                incoming = Incoming(json.dumps(frame["raw"], separators=(",", ":")).encode())
                if not await self._hand_over(incoming):
                    return  # closed: not acked, delivered again at the next connect
                nursery.start_soon(self._ack_when_taken, conn, incoming, ack)
                return
            if name == "qr":
                event = QrCode(str(frame["code"]))
            elif name == "paired":
                event = Paired(
                    jid=str(frame.get("jid") or ""),
                    name=str(frame.get("name") or ""),
                    error=str(frame.get("error") or ""),
                )
            elif name == "connected":
                event = Connected()
            elif name == "disconnected":
                event = Disconnected()
            elif name == "logged_out":
                event = LoggedOut(
                    reason=str(frame.get("reason") or ""),
                    on_connect=bool(frame.get("on_connect")),
                )
            elif name == "replaced":
                event = Replaced()
            elif name == "connect_failed":
                event = ConnectFailed(
                    reason=str(frame.get("reason") or ""),
                    message=str(frame.get("message") or ""),
                )
            elif name == "keepalive_lost":
                event = KeepAliveLost(int(frame.get("errors") or 0))
            else:
                log.warning("engine_wire_frame_dropped", why="unknown event", event=str(name)[:40])
                return
        except (KeyError, TypeError, ValueError):
            log.warning("engine_wire_frame_dropped", why="bad event", event=str(name)[:40])
            return
        await self._hand_over(event)

    async def _hand_over(self, event: EngineEvent) -> bool:
        """Into the channel (waits for room); False once the engine is closed."""
        if self.closed:
            return False
        try:
            await self._send.send(event)
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        return True

    async def _ack_when_taken(self, conn: _Connection, incoming: Incoming, ack: str) -> None:
        with trio.CancelScope() as scope:
            self._ack_waiters.add(scope)
            try:
                await incoming.taken.wait()
            finally:
                self._ack_waiters.discard(scope)
            if self.closed or conn.closed:
                return
            try:
                await conn.ws.send_message(json.dumps({"type": "ack", "ack": ack}))
            except ConnectionClosed:
                pass  # not acked: the server delivers it again at the next connect

    # -- calls -----------------------------------------------------------------------------

    async def _live(self, op: str) -> _Connection:
        with trio.move_on_after(CONNECTION_WAIT_S):
            while self._conn is None or self._conn.closed:
                await self._conn_changed.wait()
            return self._conn
        raise TransportError(
            f"{op}: not connected to the engine within {CONNECTION_WAIT_S:g} s",
            request_sent=False,
        )

    async def _call(self, op: str, args: dict[str, Any]) -> Any:
        conn = await self._live(op)
        call_id = next(self._ids)
        pending = _Pending(op)
        conn.pending[call_id] = pending
        frame = json.dumps({"type": "call", "id": call_id, "op": op, "args": args})
        try:
            with trio.move_on_after(CALL_DEADLINE_S) as scope:
                try:
                    await conn.ws.send_message(frame)
                except ConnectionClosed as exc:
                    raise TransportError(
                        f"{op}: the connection to the engine is closed", request_sent=False
                    ) from exc
                await pending.done.wait()
        finally:
            conn.pending.pop(call_id, None)
        if scope.cancelled_caught:
            log.warning("engine_call_timed_out", what=op, deadline_s=CALL_DEADLINE_S)
            raise TransportError(f"{op}: no answer within {CALL_DEADLINE_S:g} s")
        if pending.lost or pending.frame is None:
            raise TransportError(f"{op}: the connection to the engine was lost before the answer")
        return _answer(op, pending.frame)


def _answer(op: str, frame: dict[str, Any]) -> Any:
    """A call's result, or its error frame as a dshim error."""
    if frame.get("type") == "result":
        return frame.get("result")
    kind = frame.get("kind")
    message = f"{op}: {str(frame.get('message') or kind)[:300]}"
    status = frame.get("status")
    status = status if isinstance(status, int) and not isinstance(status, bool) else None
    if kind == "transport":
        raise TransportError(message, status=status)
    if kind == "unknown":
        raise TransportError(message)
    if kind == "not_found":
        raise NotFound(message, status=status or 404)
    if kind == "rate_limited":
        retry = frame.get("retry_after")
        retry_after = float(retry) if isinstance(retry, int | float) else 1.0
        raise RateLimited(message, retry_after=retry_after, status=status or 429)
    if kind == "refused":
        raise ChannelError(message, status=status)
    raise RemoteProtocolError(f"{op}: an error of unknown kind {str(kind)[:40]!r}")
