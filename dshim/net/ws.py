"""Websocket connections for channels: one trio runner over a sans-IO session protocol.

Every websocket channel writes what it knows about its connection as a *session*
(:class:`WsSession`): an object without I/O that takes frames and time and returns
actions.  This module is the trio shell around it, the same for every platform:
:func:`run_ws` runs the Discord and QQ gateways (``dshim.channels.kit.gateway_run``),
Feishu and WeCom; :func:`run_ws_handover` runs DingTalk Stream and Slack Socket Mode.

Theory of operation
-------------------
:func:`run_ws` keeps a session alive until it is cancelled or the session gives up::

    loop:  url = await next_url()          the channel's plan: a REST call for the URL
                                           or ticket, identify-budget waits ...
           ended = await connect_once(url) one websocket, below
           session.connection_lost(ended)  the session plans its next step; it raises
                                           for fatal ends (bad credentials ...)
           wait                            nothing after a connection that was up for
                                           ``stable_after_s``, else the shared Backoff

:func:`connect_once` opens one websocket, gives the session ``connection_opened`` and runs
two tasks over it.  Session methods never await, so each call is atomic:

- the **reader** feeds every received frame (text ``str`` or binary ``bytes``) to
  ``session.receive(data, now)`` and performs the returned actions in order.  A
  :class:`Deliver` is awaited with the channel's ``deliver`` callback *before the next
  frame is read*: events reach the pipeline in platform order, and a slow pipeline
  slows the socket instead of filling a queue (trio-websocket's bounded message queue
  and the kernel's socket buffer absorb a burst: a resume replay, READY plus
  GUILD_CREATE ...).  The event's ``ack`` goes out once ``deliver`` returned a verdict
  that confirms it (a ``"shutdown"`` verdict leaves it unacked, so the platform
  delivers it again) -- or before ``deliver`` when the session says ``ack_at_once``,
  for platforms whose ack deadline is shorter than an accept may take (Feishu 3 s,
  DingTalk, Slack Socket Mode): the persisted dedup then drops the redelivery.  (Slack's
  ``deliver`` only queues the acked envelope for a delivering task of its own, so that a
  slow pipeline never holds back the next ack);
- the **timer** sleeps until ``session.next_timer()`` and calls ``session.tick(now,
  reading=...)``: heartbeats, application-level pings, Hello and pong watchdogs.
  ``reading`` is False while ``deliver`` runs: an acknowledgement may be waiting unread,
  so the session must not declare the connection dead then.  A session that times its
  own websocket pings (Slack) returns :class:`Ping`: the ping goes out from a task of its
  own and its pong is reported to the session's ``pong(now)`` (:class:`Pinging`);
- the **pinger** (only with ``WsOptions.ping_interval_s``, for platforms whose dead
  sockets only a websocket ping finds, e.g. DingTalk Stream): a ping every interval, and
  no pong within ``pong_timeout_s`` cuts the connection (our close, ``ping_timeout_code``).

Handovers: :func:`run_ws_handover` is the same loop for platforms whose server
announces the end of a connection and may stop delivering on it at once (DingTalk Stream
``disconnect``, Slack's ``refresh_requested`` / ``warning``): each connection gets a fresh
session, a :class:`Handover` action starts the next connection right away (the new
socket is connected before the old one is closed), and the old one runs on until it
closes -- its session's own :class:`Close` or the server's (DingTalk), or, with
``close_replaced``, the runner's once the new one is live or a grace ran out (Slack);
deliveries of all open connections reach ``deliver`` one at a time.

Nothing cancels a delivery in hand: when the session closes the connection (a
:class:`Close` action, e.g. a zombie verdict or a server-sent disconnect), the reader
finishes the delivery and ends at the close.  When the runner is cancelled (shutdown), the
connection is closed at once with ``shutdown_close_code`` and the peer's answer is not
awaited long.

Every action a session can return is one of :class:`Send`, :class:`Close`,
:class:`Deliver`, :class:`Connected`, :class:`Ignored` (logged as ``frame_dropped``),
:class:`Handover` (logged as ``ws_handed_over``) and :class:`Ping`.
A channel whose own requests travel on the socket and are answered there (WeCom: a reply
frame and its ack, matched by ``req_id``) sends them through the :class:`WsOutlet` that
``on_open`` of :func:`connect_once` receives; its session sees the answers as frames.

They and :class:`WsSession` live in the sans-IO :mod:`dshim.net.ws_session`
(what a ``protocol.py`` imports) and are re-exported here.
URLs are logged without their query (it can carry a ticket or credentials), frames only
by their ``kind``.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Generic, NoReturn, TypeVar

import structlog
import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
    wrap_client_stream,
)

from dshim.backoff import Backoff
from dshim.errors import single_error
from dshim.model import Verdict
from dshim.net.http import default_ssl_context
from dshim.net.ws_session import (
    Action,
    Close,
    Connected,
    Deliver,
    Handover,
    Ignored,
    Ping,
    Pinging,
    Send,
    WsEnded,
    WsSession,
)

__all__ = [
    "Action",
    "Close",
    "Connected",
    "Deliver",
    "Deliverer",
    "Handover",
    "Ignored",
    "Ping",
    "Pinging",
    "Send",
    "WsEnded",
    "WsOptions",
    "WsOutlet",
    "WsSession",
    "connect_once",
    "open_client_websocket",
    "run_ws",
    "run_ws_handover",
]

log = structlog.get_logger("dshim.kit")

E = TypeVar("E")


#: The channel's side: hand one event to the pipeline.  None confirms it (not a message).
Deliverer = Callable[[E], Awaitable[Verdict | None]]


@dataclass(frozen=True, slots=True)
class WsOptions:
    """trio-websocket settings and the runner's waits."""

    connect_timeout_s: float = 20.0
    disconnect_timeout_s: float = 2.0
    #: Messages trio-websocket buffers while a delivery is in hand (bounded backpressure).
    message_queue_size: int = 64
    max_message_size: int = 16 * 1024 * 1024
    #: Bytes per socket read.  Large READY / replay bursts read ~1.6x faster with 64 KiB
    #: than with trio-websocket's 4 KiB default.
    receive_buffer_size: int = 64 * 1024
    #: How long our own close waits for the peer's close frame.
    close_wait_s: float = 2.0
    #: On cancellation: the close frame goes out at once; its answer is awaited this long.
    shutdown_close_s: float = 0.25
    shutdown_close_code: int = 1000
    #: A connection that was live this long was healthy: reconnect at once, reset backoff.
    stable_after_s: float = 5.0
    #: A websocket ping (protocol level, not a platform frame) every this many seconds;
    #: no pong within ``pong_timeout_s`` cuts the connection (ends with ``ping_timeout_code``
    #: as our own close).  None: no pings (platforms with an application heartbeat).
    ping_interval_s: float | None = None
    pong_timeout_s: float = 10.0
    ping_timeout_code: int = 4000


DEFAULT_OPTIONS = WsOptions()
#: The transport under a client websocket (TLS for ``wss://``).
Stream = trio.SocketStream | trio.SSLStream[trio.SocketStream]


@dataclass(frozen=True, slots=True, eq=False)
class WsOutlet:
    """Sends frames onto one open connection from outside its session (see the module
    docstring); valid until that connection closes."""

    ws: WebSocketConnection

    async def send(self, data: str | bytes) -> None:
        """Send one frame; :class:`trio.ClosedResourceError` when the connection closed
        before it went out whole."""
        try:
            await self.ws.send_message(data)
        except ConnectionClosed as exc:
            raise trio.ClosedResourceError("the websocket is closed") from exc


def _loggable(url: str) -> str:
    """``url`` without its query and fragment (tickets, credentials)."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))


@dataclass(eq=False)
class _Connection(Generic[E]):
    """One open websocket driven by a session (see the module docstring)."""

    ws: WebSocketConnection
    session: WsSession[E]
    deliver: Deliverer[E]
    clock: Callable[[], float]
    options: WsOptions
    stop_when_connected: bool
    on_connected: Callable[[Connected], None] | None
    #: True while ``deliver`` runs (the reader is not reading: see ``tick(reading=)``).
    delivering: bool = False
    #: The code of our own close, when this side closed.
    own_close: int | None = None
    connected_at: float | None = None
    _armed: float | None = None
    _rearm: trio.Event = field(default_factory=trio.Event)
    #: The transport under ``ws`` (cut the hard way when pongs stop).
    stream: Stream | None = None
    #: Told when the session returns :class:`Handover` (``run_ws_handover``).
    on_handover: Callable[[Handover], None] | None = None
    #: Given a :class:`WsOutlet` before the session's first actions.
    on_open: Callable[[WsOutlet], None] | None = None
    #: Close with this once the event is set (``connect_once(close_on=)``).
    close_on: tuple[trio.Event, Close] | None = None
    #: The connection's tasks (:class:`Ping` starts one).
    _nursery: trio.Nursery | None = None

    async def drive(self) -> int | None:
        """Run until the connection ends; returns the close code (None: network)."""
        if self.on_open is not None:
            self.on_open(WsOutlet(self.ws))
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for action in self.session.connection_opened(self.clock()):
                if await self._perform(action):
                    nursery.cancel_scope.cancel()
                    return self.own_close
            nursery.start_soon(self._timers)
            if self.options.ping_interval_s is not None:
                nursery.start_soon(self._pinger, self.options.ping_interval_s)
            if self.close_on is not None:
                nursery.start_soon(self._close_when, *self.close_on)
            code = await self._read()
            nursery.cancel_scope.cancel()
        return self.own_close if self.own_close is not None else code

    async def _read(self) -> int | None:
        session = self.session
        ws = self.ws
        deliver = self.deliver
        while True:
            try:
                data = await ws.get_message()
            except ConnectionClosed as exc:
                return _close_code(exc)
            for action in session.receive(data, self.clock()):
                if isinstance(action, Deliver):
                    # Inline (the hot path): ack first only when the session says so.
                    ack = action.ack
                    if ack is not None and action.ack_at_once:
                        await self._send(ack)
                    self.delivering = True
                    try:
                        verdict = await deliver(action.event)
                    finally:
                        self.delivering = False
                    if ack is not None and not action.ack_at_once:
                        if verdict is None or verdict.confirm:
                            await self._send(ack)
                elif await self._perform(action):
                    return self.own_close
            if session.next_timer() != self._armed:
                self._rearm.set()

    async def _timers(self) -> None:
        session = self.session
        while True:
            timer = session.next_timer()
            if timer is None:
                # Nothing scheduled: wait until a frame schedules something.
                self._armed = None
                await self._rearm.wait()
                self._rearm = trio.Event()
                continue
            self._armed = timer
            with trio.move_on_at(timer):
                await self._rearm.wait()
                self._rearm = trio.Event()
                continue  # the timer moved: sleep again
            for action in session.tick(self.clock(), reading=not self.delivering):
                if isinstance(action, Deliver):  # pragma: no cover - sessions deliver on receive
                    raise AssertionError("a session delivered from tick()")
                if await self._perform(action):
                    return

    async def _pinger(self, interval: float) -> None:
        """Ping every ``interval``; a pong that does not come cuts the connection."""
        while True:
            await trio.sleep(interval)
            with trio.move_on_after(self.options.pong_timeout_s) as waited:
                try:
                    await self.ws.ping()
                except ConnectionClosed:
                    return  # the reader sees the close and ends
            if waited.cancelled_caught:
                log.warning("ws_pong_timed_out", timeout_s=self.options.pong_timeout_s)
                self.own_close = self.options.ping_timeout_code
                if self.stream is not None:
                    await self.stream.aclose()  # the reader's get_message ends at once
                return

    async def _ping(self) -> None:
        """One :class:`Ping`: its pong goes to the session (none: the watchdog judges)."""
        try:
            await self.ws.ping()
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            return  # the reader sees the close and ends
        session = self.session
        if isinstance(session, Pinging):
            session.pong(self.clock())
        if session.next_timer() != self._armed:
            self._rearm.set()

    async def _close_when(self, event: trio.Event, close: Close) -> None:
        """Close from outside the session (a delivery in hand is not cancelled)."""
        await event.wait()
        if self.own_close is None:  # else this side is closing already
            await self._perform(close)

    async def _send(self, action: Send) -> None:
        try:
            await self.ws.send_message(action.data)
        except ConnectionClosed:
            return  # the reader sees the close and ends
        if action.logged:
            log.info("frame_sent", kind=action.kind)

    async def _perform(self, action: Action[E]) -> bool:
        """Do one action; True when this side closed the connection."""
        if isinstance(action, Send):
            await self._send(action)
            return False
        if isinstance(action, Close):
            log.info("ws_closing", code=action.code, reason=action.reason)
            await self._close(action.code, action.reason)
            return True
        if isinstance(action, Connected):
            if self.connected_at is None:
                self.connected_at = self.clock()
            log.info("ws_resumed" if action.resumed else "ws_connected", session=action.session)
            if self.on_connected is not None:
                self.on_connected(action)
            if self.stop_when_connected:
                await self._close(1000, "done")
                return True
            return False
        if isinstance(action, Ignored):
            log.warning("frame_dropped", reason=action.reason, detail=action.detail)
            return False
        if isinstance(action, Handover):
            log.info("ws_handed_over", reason=action.reason)
            if self.on_handover is not None:
                self.on_handover(action)
            return False
        if isinstance(action, Ping):
            assert self._nursery is not None  # actions come only while drive() runs
            self._nursery.start_soon(self._ping)
            return False
        raise AssertionError(f"unknown action {action!r}")

    async def _close(self, code: int, reason: str) -> None:
        self.own_close = code
        with trio.move_on_after(self.options.close_wait_s):
            await self.ws.aclose(code, reason)


def _close_code(exc: BaseException) -> int | None:
    if isinstance(exc, ConnectionClosed) and exc.reason is not None:
        return int(exc.reason.code)
    return None


def _endpoint(url: str) -> tuple[str, int, str, str, bool]:
    """(host, port, Host header, request target, TLS) of a ``ws://`` / ``wss://`` URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise ValueError(f"not a websocket URL: {_loggable(url)!r}")
    secure = parts.scheme == "wss"
    default_port = 443 if secure else 80
    port = parts.port or default_port
    host_header = parts.hostname if port == default_port else f"{parts.hostname}:{port}"
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, port, host_header, target, secure


@asynccontextmanager
async def open_client_websocket(
    url: str,
    options: WsOptions = DEFAULT_OPTIONS,
    *,
    extra_headers: Sequence[tuple[bytes, bytes]] = (),
) -> AsyncIterator[tuple[WebSocketConnection, Stream]]:
    """A client websocket on a TCP (TLS) stream this function owns, and that stream (a
    caller may cut the connection the hard way by closing it).

    trio-websocket's ``open_websocket_url`` (checked with 0.12.2) leaves the socket open
    after a refused upgrade, and after a connection that ended without a closing
    handshake (its ``aclose()`` then returns early); reaching its private
    ``_close_stream()`` was the only fix.  Opening the stream here and wrapping it with
    the public ``wrap_client_stream`` lets every way out close the socket, with the public
    API only (tests/test_kit_ws.py counts open file descriptors to keep it so).  Leaving
    the block while the websocket is still open (cancellation, an error) closes it with
    ``shutdown_close_code``: the close frame goes out at once, its answer is awaited at
    most ``shutdown_close_s``.
    """
    host, port, host_header, target, secure = _endpoint(url)
    deadline = trio.current_time() + options.connect_timeout_s
    with trio.fail_at(deadline):
        stream: Stream
        if secure:
            stream = await trio.open_ssl_over_tcp_stream(
                host, port, ssl_context=default_ssl_context(), https_compatible=True
            )
        else:
            stream = await trio.open_tcp_stream(host, port)
    try:
        with single_error():
            async with trio.open_nursery() as nursery:
                with trio.fail_at(deadline):
                    ws = await wrap_client_stream(
                        nursery,
                        stream,
                        host_header,
                        target,
                        extra_headers=list(extra_headers),
                        message_queue_size=options.message_queue_size,
                        max_message_size=options.max_message_size,
                        receive_buffer_size=options.receive_buffer_size,
                    )
                try:
                    yield ws, stream
                finally:
                    if ws.closed is None:
                        with (
                            trio.CancelScope(shield=True),
                            trio.move_on_after(options.shutdown_close_s),
                        ):
                            await ws.aclose(options.shutdown_close_code, "closing")
                    nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


async def connect_once(
    url: str,
    session: WsSession[E],
    deliver: Deliverer[E],
    *,
    clock: Callable[[], float] = trio.current_time,
    options: WsOptions = DEFAULT_OPTIONS,
    stop_when_connected: bool = False,
    on_connected: Callable[[Connected], None] | None = None,
    on_handover: Callable[[Handover], None] | None = None,
    on_open: Callable[[WsOutlet], None] | None = None,
    close_on: tuple[trio.Event, Close] | None = None,
) -> WsEnded:
    """One connection to ``url`` driven by ``session``; returns how it ended.

    Network failures, timeouts and refused upgrades are returned (``code`` None), never
    raised.  ``stop_when_connected`` closes with 1000 as soon as the session is live
    (probes).  ``on_open`` gets the connection's :class:`WsOutlet` once the websocket is
    open, before the session's ``connection_opened`` actions.  ``close_on`` (an event and
    a :class:`Close`): once the event is set, the connection is closed so, as if the
    session had asked (a replaced connection of :func:`run_ws_handover`).
    """
    log.info("ws_connecting", url=_loggable(url))
    conn: _Connection[E] | None = None
    code: int | None = None
    rejected: int | None = None
    rejected_headers: tuple[tuple[str, str], ...] = ()
    try:
        async with open_client_websocket(url, options) as (ws, stream):
            conn = _Connection(
                ws, session, deliver, clock, options, stop_when_connected, on_connected
            )
            conn.stream = stream
            conn.on_handover = on_handover
            conn.on_open = on_open
            conn.close_on = close_on
            code = await conn.drive()
    except (
        ConnectionClosed,
        HandshakeError,
        OSError,
        trio.BrokenResourceError,
        trio.TooSlowError,
    ) as exc:
        code = _close_code(exc)
        if isinstance(exc, ConnectionRejected):
            rejected = exc.status_code
            rejected_headers = tuple(
                (k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in exc.headers
            )
        log.warning("ws_connection_failed", error=type(exc).__name__, code=code, status=rejected)
    connected_for = None
    if conn is not None and conn.connected_at is not None:
        connected_for = max(0.0, clock() - conn.connected_at)
    by_us = conn is not None and conn.own_close is not None
    return WsEnded(
        code,
        by_us=by_us,
        rejected=rejected,
        connected_for=connected_for,
        rejected_headers=rejected_headers,
    )


async def run_ws(
    session: WsSession[E],
    next_url: Callable[[], Awaitable[str]],
    deliver: Deliverer[E],
    *,
    backoff: Backoff | None = None,
    clock: Callable[[], float] = trio.current_time,
    options: WsOptions = DEFAULT_OPTIONS,
    connect: Callable[..., Awaitable[WsEnded]] = connect_once,
) -> NoReturn:
    """Keep ``session`` connected forever (see the module docstring).

    Raises what ``next_url`` or ``session.connection_lost`` raise (fatal errors); every
    other end of a connection reconnects: at once after a connection that was live for
    ``stable_after_s``, else after ``backoff.next_delay()`` (1 s .. 30 s with jitter by
    default), so a server that accepts and drops at once is never hammered.
    """
    backoff = backoff or Backoff()
    while True:
        url = await next_url()
        ended = await connect(url, session, deliver, clock=clock, options=options)
        log.info(
            "ws_disconnected",
            code=ended.code,
            by_us=ended.by_us,
            connected_s=None if ended.connected_for is None else round(ended.connected_for, 3),
        )
        session.connection_lost(ended, clock())
        if ended.connected_for is not None and ended.connected_for >= options.stable_after_s:
            backoff.reset()
            continue
        delay = backoff.next_delay()
        log.info("reconnect_delayed", retry_in_s=round(delay, 2), failures=backoff.failures)
        await trio.sleep(delay)


async def run_ws_handover(
    new_session: Callable[[], WsSession[E]],
    next_url: Callable[[], Awaitable[str]],
    deliver: Deliverer[E],
    *,
    backoff: Backoff | None = None,
    clock: Callable[[], float] = trio.current_time,
    options: WsOptions = DEFAULT_OPTIONS,
    on_connected: Callable[[Connected], None] | None = None,
    close_replaced: Close | None = None,
    replaced_grace_s: float = 10.0,
) -> NoReturn:
    """:func:`run_ws` for platforms that hand a connection over (DingTalk Stream
    ``disconnect``, Slack Socket Mode ``refresh_requested``): every connection gets its
    own session from ``new_session``, and a :class:`Handover` from a session starts the
    next connection at once while the old one stays open (it may still deliver).
    Deliveries of all open connections reach ``deliver`` one at a time.  Other ends
    reconnect exactly as :func:`run_ws`.  Raises what ``next_url`` or a session's
    ``connection_lost`` raise.

    Without ``close_replaced`` (DingTalk) the old connection runs on until it closes by
    itself.  With it (Slack, whose server keeps the old socket open for a while), the
    runner closes the old connection with that :class:`Close` as soon as the next one is
    live (:class:`Connected`) or has ended, and at the latest ``replaced_grace_s`` after
    the next one started (logged as ``ws_replaced``); a delivery in hand on the old one
    is not cancelled, the old connection's end is reported after it.
    """
    backoff = backoff or Backoff()
    lock = trio.Lock()

    async def one_at_a_time(event: E) -> Verdict | None:
        # acquire_nowait first: an uncontended ``async with lock`` costs two scheduler
        # round trips per event (~5 us, measurable in scripts/bench_slack.py).  Fair
        # either way: acquire_nowait fails while others wait.
        try:
            lock.acquire_nowait()
        except trio.WouldBlock:
            await lock.acquire()
        try:
            return await deliver(event)
        finally:
            lock.release()

    async def close_when_replaced(old: _Attempt[E], new: _Attempt[E]) -> None:
        with trio.move_on_after(replaced_grace_s):
            await new.settled.wait()
        log.info("ws_replaced", next_connected=new.connected)
        old.close_now.set()

    with single_error():
        async with trio.open_nursery() as nursery:
            replaced: _Attempt[E] | None = None
            while True:
                url = await next_url()
                attempt = _Attempt(new_session(), close_replaced)
                nursery.start_soon(attempt.run, url, one_at_a_time, clock, options, on_connected)
                if replaced is not None and close_replaced is not None:
                    nursery.start_soon(close_when_replaced, replaced, attempt)
                replaced = None
                await attempt.wake.wait()
                if attempt.handed_over:
                    backoff.reset()
                    replaced = attempt
                    continue  # the old connection ends by itself, or is closed as replaced
                ended = attempt.ended
                assert ended is not None
                if (
                    ended.connected_for is not None
                    and ended.connected_for >= options.stable_after_s
                ):
                    backoff.reset()
                    continue
                delay = backoff.next_delay()
                log.info("reconnect_delayed", retry_in_s=round(delay, 2), failures=backoff.failures)
                await trio.sleep(delay)


class _Attempt(Generic[E]):
    """One connection of :func:`run_ws_handover`: wakes the loop at a handover or its end."""

    def __init__(self, session: WsSession[E], close_replaced: Close | None = None) -> None:
        self.session = session
        self.wake = trio.Event()
        self.handed_over = False
        self.ended: WsEnded | None = None
        self.connected = False
        #: Set once the connection is live or has ended (a replaced one may close then).
        self.settled = trio.Event()
        #: Set to close this connection as replaced (``close_replaced``).
        self.close_now = trio.Event()
        self._close_replaced = close_replaced

    def _handover(self, action: Handover) -> None:
        self.handed_over = True
        self.wake.set()

    async def run(
        self,
        url: str,
        deliver: Deliverer[E],
        clock: Callable[[], float],
        options: WsOptions,
        on_connected: Callable[[Connected], None] | None,
    ) -> None:
        def connected(action: Connected) -> None:
            self.connected = True
            self.settled.set()
            if on_connected is not None:
                on_connected(action)

        close = self._close_replaced
        try:
            ended = await connect_once(
                url,
                self.session,
                deliver,
                clock=clock,
                options=options,
                on_connected=connected,
                on_handover=self._handover,
                close_on=None if close is None else (self.close_now, close),
            )
        finally:
            self.settled.set()
        log.info(
            "ws_disconnected",
            code=ended.code,
            by_us=ended.by_us,
            connected_s=None if ended.connected_for is None else round(ended.connected_for, 3),
        )
        self.ended = ended
        # A fatal end raises here and stops the runner: the loop is not woken to plan a
        # reconnect (no backoff drawn, no reconnect_delayed logged).
        self.session.connection_lost(ended, clock())
        self.wake.set()
