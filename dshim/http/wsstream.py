"""hypercorn's websocket stream with dshim's limits: the cap while reading, one budget, pings.

Theory of operation
-------------------
hypercorn reads a websocket message into a buffer and hands it to the ASGI application
only once it is complete; its one limit is a per-message cap (``websocket_max_message_size``)
and it keeps reading into the buffer after refusing a message until the peer closes.  It
has no hook for a limit across sockets, none for a peer that stops answering, and it
inflates permessage-deflate frames before any size check can see them.  So this module
is the one place where dshim reaches into hypercorn: :func:`install` makes hypercorn's
HTTP/1.1 and HTTP/2 protocols open :class:`DshimWSStream` instead of its ``WSStream``.
The subclass behaves as its parent unless the server's configuration is a
:class:`DshimConfig` with :class:`WsLimits` (dshim's own, :mod:`dshim.http.server`).
Tested against hypercorn 0.17-0.18 (``tests/test_http_abuse.py`` fails if the names it
replaces move).

Per socket, with limits:

- **Cap while reading**: a message is refused the moment its bytes pass
  :data:`WS_MAX_MESSAGE` (close 1009), not after it was read whole; nothing more of it
  is kept.
- **One budget** (:class:`MessageBudget`): the bytes of messages being read *and* of
  messages handed to the application that it has not finished with (it takes the next
  one: :data:`~dshim.http.app.RELEASE_KEY`) count against :data:`WS_BUFFERED_MAX` for
  all sockets together and :data:`WS_BUFFERED_PER_CLIENT` for one client address (an
  address cannot take it all).  A message that would pass either is refused with 1013
  ("try again later"; the page sends it again after reconnecting) and what its socket
  held is free again.  A refused socket is read no further (what arrives is dropped) and
  is closed :data:`CLOSE_LINGER_S` after its close frame, answered or not.
- **Liveness**: every :data:`PING_INTERVAL_S` the socket is pinged; one that has sent
  nothing (no pong, no frame) since the last ping is closed (1001) and its TCP
  connection ends.  A socket whose messages wait for the application counts as heard.
  One :class:`Pinger` task per server does this for all its sockets (a task per socket
  would cost every idle socket its memory); without it running, each socket pings
  itself.
- **Closing**: once the application closed a socket, the peer's answer is awaited
  :data:`CLOSE_LINGER_S` at most, then the stream ends (the application sees it closed;
  the scope's :data:`~dshim.http.app.LINGER_KEY` extension tells it so).
- **No compression**: permessage-deflate is not negotiated (a 64 KiB read could inflate
  to 64 MiB before the buffer sees it); the web chat's frames are JSON and base64,
  browsers and scripts work without it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.events import Closed, RawData
from hypercorn.protocol import h2 as hypercorn_h2
from hypercorn.protocol import h11 as hypercorn_h11
from hypercorn.protocol.events import Data, Event, Request, StreamClosed
from hypercorn.protocol.ws_stream import (
    ASGIWebsocketState,
    Handshake,
    WebsocketBuffer,
    WSStream,
)
from hypercorn.trio import run as hypercorn_run
from hypercorn.trio import tcp_server as hypercorn_tcp
from hypercorn.typing import WebsocketAcceptEvent
from wsproto.events import CloseConnection, Message, Ping, TextMessage
from wsproto.utilities import LocalProtocolError

from dshim.http.app import CLOSE_WAIT_S, LINGER_KEY, RELEASE_KEY, SEND_MANY_KEY
from dshim.http.auth import client_key

__all__ = [
    "CLOSE_LINGER_S",
    "PING_INTERVAL_S",
    "WS_BUFFERED_MAX",
    "WS_BUFFERED_PER_CLIENT",
    "WS_MAX_MESSAGE",
    "DshimConfig",
    "DshimWSStream",
    "MessageBudget",
    "WsLimits",
    "install",
]

log = structlog.get_logger("dshim.http")

MIB = 1024 * 1024
#: The largest websocket message read (the web chat's ``MAX_FRAME_BYTES``: one message
#: with 20 MiB of attachments in base64 fits).
WS_MAX_MESSAGE = 28 * MIB
#: What all sockets together may hold of messages being read or not yet handled.
WS_BUFFERED_MAX = 4 * WS_MAX_MESSAGE
#: What the sockets of one client address may hold of it.
WS_BUFFERED_PER_CLIENT = 2 * WS_MAX_MESSAGE
#: How often a socket is pinged; one silent for a whole interval after a ping is closed.
PING_INTERVAL_S = 20.0
#: How long a refused socket waits for the peer's close before its connection ends.
CLOSE_LINGER_S = CLOSE_WAIT_S
MESSAGE_TOO_BIG = 1009
TRY_AGAIN_LATER = 1013
GOING_AWAY = 1001


class MessageBudget:
    """Bytes held by websocket messages, for all sockets and per client address."""

    def __init__(
        self, total: int = WS_BUFFERED_MAX, per_client: int = WS_BUFFERED_PER_CLIENT
    ) -> None:
        self.total = total
        self.per_client = per_client
        self.used = 0
        self._by_client: dict[str, int] = {}

    def take(self, client: str, n: int) -> bool:
        """Hold ``n`` more bytes for ``client``; False (nothing held) when over a limit."""
        mine = self._by_client.get(client, 0)
        if self.used + n > self.total or mine + n > self.per_client:
            return False
        self.used += n
        self._by_client[client] = mine + n
        return True

    def give(self, client: str, n: int) -> None:
        """``n`` bytes of ``client`` are free again."""
        if n <= 0:
            return
        self.used -= n
        left = self._by_client.get(client, 0) - n
        if left > 0:
            self._by_client[client] = left
        else:
            self._by_client.pop(client, None)

    def held_by(self, client: str) -> int:
        return self._by_client.get(client, 0)


class Pinger:
    """One task pings every socket of a server (rather than a task per socket: an idle
    socket then holds no task for it).  :meth:`run` it next to the server; while it does
    not run, each socket pings itself (:meth:`DshimWSStream._send_pings`)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.running = False
        #: The sockets it pings, by when each was last pinged.
        self.streams: dict[DshimWSStream, None] = {}

    async def run(self) -> None:
        """Check every socket a few times an interval, until cancelled: one pinged an
        interval ago is closed if it sent nothing since, else pinged again."""
        self.running = True
        try:
            while True:
                await trio.sleep(self.interval_s / 4)
                now = trio.current_time()
                for stream in list(self.streams):
                    if now - stream._pinged_at >= self.interval_s:
                        stream._ping_due(now)
        finally:
            self.running = False
            # The sockets left ping themselves from now on.
            for stream in list(self.streams):
                self.streams.pop(stream, None)
                stream._ping_alone()


@dataclass
class WsLimits:
    """The limits of one server's websockets (see the module docstring)."""

    max_message: int = WS_MAX_MESSAGE
    budget: MessageBudget = field(default_factory=MessageBudget)
    ping_interval_s: float = PING_INTERVAL_S
    #: Pings the sockets while :meth:`Pinger.run` runs (``serve_endpoint`` runs it).
    pinger: Pinger | None = None

    def __post_init__(self) -> None:
        if self.pinger is None:
            self.pinger = Pinger(self.ping_interval_s)


class DshimConfig(HypercornConfig):
    """hypercorn's configuration with dshim's websocket limits (None: hypercorn's own)."""

    ws_limits: WsLimits | None = None


class _Refused(Exception):
    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code = code
        self.reason = reason


def _cost(data: str | bytes) -> int:
    """What a piece of a message holds in memory: a str takes 1, 2 or 4 bytes a
    character, by its widest one (CPython's compact strings)."""
    if isinstance(data, bytes) or data.isascii():
        return len(data)
    widest = ord(max(data))
    return len(data) * (1 if widest < 0x100 else 2 if widest < 0x10000 else 4)


class _BudgetedBuffer(WebsocketBuffer):
    """hypercorn's message buffer, checked and counted before anything is kept."""

    def __init__(self, stream: DshimWSStream, max_length: int) -> None:
        super().__init__(max_length)
        self._stream = stream
        self.held = 0

    def extend(self, event: Message[Any]) -> None:
        data: str | bytes = event.data
        if self.length + len(data) > self.max_length:
            raise _Refused(
                MESSAGE_TOO_BIG, f"a message may be at most {self.max_length // MIB} MiB"
            )
        cost = _cost(data)
        if not self._stream.hold(cost):
            raise _Refused(TRY_AGAIN_LATER, "too much data waiting: send it again in a moment")
        self.held += cost
        super().extend(event)

    def to_message(self) -> dict[str, Any]:
        message: dict[str, Any] = dict(super().to_message())
        message[RELEASE_KEY] = self._stream.releaser(self.held)
        return message

    def clear(self) -> None:
        super().clear()
        self.held = 0


class _Accepted(Handshake):
    """An accepted handshake, shared by all sockets (:meth:`DshimWSStream._shed_handshake`)."""

    def __init__(self) -> None:
        super().__init__([], "1.1")
        self.accepted = True


class _SpentH11:
    """Stands for the HTTP/1.1 connection after the upgrade: nothing more is sent on it."""

    def send(self, event: Any) -> bytes:
        raise RuntimeError("the HTTP/1.1 exchange of an upgraded websocket is over")


_ACCEPTED = _Accepted()
_SPENT_H11: Any = _SpentH11()


class DshimWSStream(WSStream):
    """hypercorn's websocket stream with :class:`WsLimits` (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits: WsLimits | None = getattr(self.config, "ws_limits", None)
        self.client_key = client_key(str(self.client[0])) if self.client else ""
        self._held = 0
        self._released = False
        self._refused = False
        self._handling = False
        self._heard_at = trio.current_time()
        self._pinged_at = self._heard_at
        #: Set when the stream ends: the ping task stops at once (the connection's task
        #: group, and a graceful shutdown, would wait for its sleep).
        self._ended = trio.Event()
        if self.limits is not None:
            self.buffer = _BudgetedBuffer(self, self.limits.max_message)

    # -- the budget ------------------------------------------------------------------------

    def hold(self, n: int) -> bool:
        """Count ``n`` more bytes against the budget (False: over it)."""
        assert self.limits is not None
        if self._released or not self.limits.budget.take(self.client_key, n):
            return False
        self._held += n
        return True

    def releaser(self, n: int) -> Callable[[], None]:
        """Frees a delivered message's ``n`` bytes, once (the application took the next)."""
        done = False

        def release() -> None:
            nonlocal done
            if done or self._released or self.limits is None:
                return
            done = True
            self._held -= n
            self.limits.budget.give(self.client_key, n)

        return release

    def _release_all(self) -> None:
        if self.limits is not None and not self._released:
            self._released = True
            self.limits.budget.give(self.client_key, self._held)
            self._held = 0

    # -- events ----------------------------------------------------------------------------

    async def handle(self, event: Event) -> None:
        if self.limits is None:
            await super().handle(event)
            return
        if isinstance(event, Request):
            await super().handle(event)
            scope = getattr(self, "scope", None)
            if scope is not None:  # before the application's first receive (app.py)
                scope["extensions"][LINGER_KEY] = {}
                scope["extensions"][SEND_MANY_KEY] = {}
            return
        if isinstance(event, StreamClosed):
            self._release_all()
            self._ended.set()
            if self.limits.pinger is not None:
                self.limits.pinger.streams.pop(self, None)
        elif isinstance(event, Data):
            self._heard_at = trio.current_time()
            if self._refused:
                return  # nothing more of a refused socket is read
        self._handling = True
        try:
            await super().handle(event)
        except _Refused as refusal:
            await self._refuse(refusal)
        finally:
            self._handling = False

    async def _refuse(self, refusal: _Refused) -> None:
        log.info("websocket_message_refused", code=refusal.code, reason=refusal.reason)
        self._refused = True
        self.buffer.clear()
        self._release_all()
        await self._send_wsproto_event(CloseConnection(code=refusal.code, reason=refusal.reason))
        self.task_group.spawn(self._end_after, CLOSE_LINGER_S)

    async def _end_after(self, delay_s: float) -> None:
        with trio.move_on_after(delay_s):
            await self._ended.wait()
        await self._end()

    async def _end(self) -> None:
        """End the stream (and for HTTP/1.1 its connection) without waiting for the peer."""
        if not self.closed:
            await self.send(StreamClosed(stream_id=self.stream_id))

    async def app_send(self, message: Any) -> None:
        texts = message.get(SEND_MANY_KEY) if message is not None else None
        if texts is not None and self.limits is not None:
            await self._send_many(texts)
            return
        closing = (
            self.limits is not None
            and message is not None
            and message.get("type") == "websocket.close"
            and not self.closed
        )
        await super().app_send(message)
        if closing:  # the peer's answer is awaited CLOSE_LINGER_S at most (LINGER_KEY)
            self.task_group.spawn(self._end_after, CLOSE_LINGER_S)

    async def _send_many(self, texts: list[str]) -> None:
        """Several text messages in one write (:data:`~dshim.http.app.SEND_MANY_KEY`)."""
        if self.closed or self.state != ASGIWebsocketState.CONNECTED:
            return
        try:
            data = b"".join(self.connection.send(TextMessage(data=text)) for text in texts)
        except LocalProtocolError:
            return  # closing: as hypercorn drops a send then
        await self.send(Data(stream_id=self.stream_id, data=data))

    async def _accept(self, message: WebsocketAcceptEvent) -> None:
        if self.limits is not None:
            self.handshake.extensions = None  # no permessage-deflate (module docstring)
        await super()._accept(message)
        if self.limits is not None and self.handshake.accepted:
            self._shed_handshake()

    def _shed_handshake(self) -> None:
        """Drop what only the handshake needed, which an open socket would keep all its
        life: the parsed handshake, and the HTTP/1.1 connection state that answered it
        (after the upgrade hypercorn passes the socket's bytes through untouched)."""
        self.handshake = _ACCEPTED  # handle() asks it only ``accepted``
        protocol = getattr(self.send, "__self__", None)
        connection = getattr(protocol, "connection", None)
        if isinstance(connection, hypercorn_h11.H11WSConnection):
            connection.h11_connection = _SPENT_H11

    async def _send_pings(self) -> None:
        if self.limits is None:
            await super()._send_pings()
            return
        pinger = self.limits.pinger
        if pinger is not None and pinger.running:  # it pings this socket from now on
            self._pinged_at = trio.current_time()
            if not self.closed and not self._ended.is_set():
                pinger.streams[self] = None
                await self._send_wsproto_event(Ping())
            return
        await self._ping_loop()

    def _ping_due(self, now: float) -> None:
        """(The pinger) an interval since the last ping: close a socket silent since,
        else ping it again (in a short task of its own: a peer that does not read must
        not hold up the others)."""
        assert self.limits is not None and self.limits.pinger is not None
        if self.closed or self._ended.is_set():
            self.limits.pinger.streams.pop(self, None)
            return
        silent = not self._handling and self._heard_at < self._pinged_at
        self._pinged_at = now
        if silent:
            self.limits.pinger.streams.pop(self, None)
        self.task_group.spawn(self._ping_once, silent)

    async def _ping_once(self, silent: bool) -> None:
        """A ping, or for a silent socket the close (1001) and the end of its connection."""
        if self.closed or self._ended.is_set():
            return
        if not silent:
            await self._send_wsproto_event(Ping())
            return
        assert self.limits is not None
        log.info("websocket_ping_unanswered", silent_s=round(self.limits.ping_interval_s, 1))
        await self._send_wsproto_event(CloseConnection(code=GOING_AWAY, reason="no answer to ping"))
        await self._end()

    def _ping_alone(self) -> None:
        """The pinger stopped: this socket pings itself from its next ping on."""
        if not self.closed and not self._ended.is_set():
            try:
                self.task_group.spawn(self._ping_loop, False)
            except RuntimeError:  # its connection is ending too
                pass

    async def _ping_loop(self, ping_now: bool = True) -> None:
        """Ping every interval; close a socket silent for a whole interval after a ping."""
        assert self.limits is not None
        interval = self.limits.ping_interval_s
        while not self.closed:
            if ping_now:
                self._pinged_at = trio.current_time()
                await self._send_wsproto_event(Ping())
            ping_now = True
            with trio.move_on_at(self._pinged_at + interval):
                await self._ended.wait()
            if self.closed or self._ended.is_set():
                return
            if self._handling:  # its messages wait for the application: it is there
                continue
            if self._heard_at < self._pinged_at:
                await self._ping_once(True)
                return


class DshimTCPServer(hypercorn_tcp.TCPServer):
    """hypercorn's trio connection, reading without a timeout scope when it has no read
    timeout (dshim sets none): the scope hypercorn enters around every read anyway is
    memory every open socket holds while it waits."""

    async def _read_data(self) -> None:
        if self.config.read_timeout is not None or not isinstance(self.config, DshimConfig):
            await super()._read_data()
            return
        while True:
            try:
                data = await self.stream.receive_some(hypercorn_tcp.MAX_RECV)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                break
            await self.protocol.handle(RawData(bytes(data)))
            if data == b"":
                break
        await self.protocol.handle(Closed())


def install() -> None:
    """Make hypercorn's HTTP/1.1 and HTTP/2 protocols open :class:`DshimWSStream` (its
    HTTP/3 needs QUIC, which dshim never binds) and its trio worker serve connections with
    :class:`DshimTCPServer`.  Idempotent."""
    for module in (hypercorn_h11, hypercorn_h2):
        if getattr(module, "WSStream", None) not in (WSStream, DshimWSStream):
            raise RuntimeError(f"{module.__name__}.WSStream is not hypercorn's: cannot limit it")
        setattr(module, "WSStream", DshimWSStream)  # noqa: B010
    if getattr(hypercorn_run, "TCPServer", None) not in (hypercorn_tcp.TCPServer, DshimTCPServer):
        raise RuntimeError("hypercorn.trio.run.TCPServer is not hypercorn's: cannot replace it")
    setattr(hypercorn_run, "TCPServer", DshimTCPServer)  # noqa: B010
