"""The kit's websocket runner (``dshim.net.ws``) over real trio-websocket sockets.

Testing manifesto: a scripted websocket server on 127.0.0.1, port 0, in the same trio run
as the client; trio's autojump clock, so heartbeats, backoffs and watchdogs take no real
time and their timings are exact; every test has the suite's hard deadline.  The session
under test is a toy protocol (text commands) that records what the runner did with it,
so these tests say what any platform session can rely on: order of deliveries, when acks
go out, timers while the pipeline is busy, binary frames, closes, reconnect pacing, and
that nothing leaks (sockets) or escapes (network errors).
"""

from __future__ import annotations

import functools
import gc
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from dshim.channels.kit import Backoff
from dshim.errors import FatalChannelError
from dshim.model import Verdict
from dshim.net.ws import (
    Action,
    Close,
    Connected,
    Deliver,
    Ignored,
    Send,
    WsEnded,
    WsOptions,
    connect_once,
    run_ws,
)
from dshim.testing.fakes.base import FakePlatform

INTERVAL = 10.0  # the toy session's heartbeat (virtual seconds)


@dataclass
class Toy:
    """A toy session.  Server frames: ``ready``, ``event:<x>``, ``urgent:<x>`` (ack at
    once), ``ping``, ``bye``, bytes (delivered as they are), anything else is ignored."""

    ticks: list[tuple[float, bool]] = field(default_factory=list)
    ended: list[WsEnded] = field(default_factory=list)
    opened: int = 0
    next_beat: float | None = None
    fatal_code: int = 4004

    def connection_opened(self, now: float) -> list[Action[str | bytes]]:
        self.opened += 1
        self.next_beat = now + INTERVAL
        return [Send("hi", kind="hello")]

    def receive(self, data: str | bytes, now: float) -> list[Action[str | bytes]]:
        if isinstance(data, bytes):
            return [Deliver(data, ack=Send(b"\x00ack"))]
        if data == "ready":
            return [Connected(session="s1")]
        if data.startswith("event:"):
            return [Deliver(data[6:], ack=Send("ack:" + data[6:], logged=False))]
        if data.startswith("urgent:"):
            return [Deliver(data[7:], ack=Send("ack:" + data[7:]), ack_at_once=True)]
        if data == "ping":
            return [Send("pong")]
        if data == "bye":
            return [Close(4000, "asked to leave")]
        return [Ignored("unknown", data[:20])]

    def next_timer(self) -> float | None:
        return self.next_beat

    def tick(self, now: float, *, reading: bool) -> list[Action[str | bytes]]:
        self.ticks.append((now, reading))
        self.next_beat = now + INTERVAL
        return [Send("beat", logged=False)]

    def connection_lost(self, ended: WsEnded, now: float) -> None:
        self.ended.append(ended)
        self.next_beat = None
        if ended.code == self.fatal_code:
            raise FatalChannelError("told to stop")


class Server(FakePlatform[str | bytes]):
    """A websocket server that runs ``script(server, ws)`` for each connection;
    ``calls`` are the frames the client sent."""

    def __init__(self, script: Callable[..., Awaitable[None]]) -> None:
        super().__init__()
        self.script = script
        self.url = ""
        self.connections: list[float] = []

    @property
    def received(self) -> list[str | bytes]:
        return self.calls

    async def handler(self, request: WebSocketRequest) -> None:
        ws = await request.accept()
        self.connections.append(trio.current_time())
        try:
            await self.script(self, ws)
        except ConnectionClosed:
            pass

    async def pump(self, ws: WebSocketConnection) -> None:
        """Record what the client sends until it closes."""
        while True:
            self.record(await ws.get_message())


@asynccontextmanager
async def serving(script: Callable[..., Awaitable[None]]) -> AsyncIterator[Server]:
    server = Server(script)
    async with trio.open_nursery() as nursery:
        ws_server = await nursery.start(serve_websocket, server.handler, "127.0.0.1", 0, None)
        server.url = f"ws://127.0.0.1:{ws_server.port}/gw?ticket=secret-ticket"
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()


async def test_deliveries_in_order_and_acks_only_after_a_confirming_accept(
    autojump_clock: object,
) -> None:
    async def script(server: Server, ws: WebSocketConnection) -> None:
        for frame in ("ready", "event:a", "event:b", "event:stop", "urgent:c", "bye"):
            await ws.send_message(frame)
        await server.pump(ws)

    toy = Toy()
    seen: list[tuple[str, list[str | bytes]]] = []

    async with serving(script) as server:

        async def deliver(event: str | bytes) -> Verdict | None:
            assert isinstance(event, str)
            await trio.sleep(1.0)  # a slow pipeline: nothing is read meanwhile
            seen.append((event, list(server.received)))
            if event == "stop":
                return Verdict(False, "shutdown")  # not taken: never acked
            return Verdict(True)

        ended = await connect_once(server.url, toy, deliver)
        await server.wait_until(lambda: len(server.received) >= 4)
    assert [event for event, _ in seen] == ["a", "b", "stop", "c"]
    # "a" was not acked before its accept returned; "b" sees a's ack; "c" acked at once
    assert "ack:a" not in seen[0][1] and "ack:a" in seen[1][1]
    assert "ack:c" in seen[3][1]
    assert server.received[:4] == ["hi", "ack:a", "ack:b", "ack:c"]
    assert "ack:stop" not in server.received
    assert ended.code == 4000 and ended.by_us and ended.connected
    assert toy.ended == []  # connect_once leaves connection_lost to its caller


async def test_heartbeats_continue_while_a_delivery_blocks_and_say_so(
    autojump_clock: object,
) -> None:
    async def script(server: Server, ws: WebSocketConnection) -> None:
        await ws.send_message("ready")
        await ws.send_message("event:slow")
        await trio.sleep(100)
        await ws.send_message("bye")
        await server.pump(ws)

    toy = Toy()

    async def deliver(event: str | bytes) -> None:
        await trio.sleep(35)  # the pipeline is busy for 3.5 heartbeat intervals

    async with serving(script) as server:
        start = trio.current_time()
        await connect_once(server.url, toy, deliver)
    times = [round(t - start, 3) for t, _ in toy.ticks]
    assert times[:4] == [10.0, 20.0, 30.0, 40.0]  # every interval, delivery or not
    assert [reading for _, reading in toy.ticks[:4]] == [False, False, False, True]
    assert server.received.count("beat") >= 9


async def test_binary_frames_in_and_out(autojump_clock: object) -> None:
    async def script(server: Server, ws: WebSocketConnection) -> None:
        await ws.send_message(b"\x08\x01proto")
        await ws.send_message("bye")
        await server.pump(ws)

    got: list[str | bytes] = []

    async def deliver(event: str | bytes) -> None:
        got.append(event)

    async with serving(script) as server:
        await connect_once(server.url, Toy(), deliver)
        await server.wait_until(lambda: len(server.received) >= 2)
    assert got == [b"\x08\x01proto"]
    assert server.received[:2] == ["hi", b"\x00ack"]  # bytes go out as a binary frame


async def test_network_failures_and_refused_upgrades_are_returned_not_raised(
    autojump_clock: object,
) -> None:
    async def nothing(event: str | bytes) -> None:
        return None

    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()  # nobody listens there now
    ended = await connect_once(f"ws://127.0.0.1:{port}/", Toy(), nothing)
    assert ended == WsEnded(None)

    async def reject(request: WebSocketRequest) -> None:
        await request.reject(403, body=b"no")

    async with trio.open_nursery() as nursery:
        ws_server = await nursery.start(serve_websocket, reject, "127.0.0.1", 0, None)
        ended = await connect_once(f"ws://127.0.0.1:{ws_server.port}/", Toy(), nothing)
        nursery.cancel_scope.cancel()
    assert ended.rejected == 403 and not ended.connected


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_no_way_out_of_a_connection_leaves_its_socket_open(autojump_clock: object) -> None:
    # trio-websocket 0.12 leaks the client socket after a refused upgrade and after a
    # connection dropped without a close frame; the kit owns the stream so that it never
    # does (and needs no private trio-websocket call for it).
    async def script(server: Server, ws: WebSocketConnection) -> None:
        await ws.send_message("ready")
        await ws._stream.aclose()  # TCP closed, no websocket close frame

    async def reject(request: WebSocketRequest) -> None:
        await request.reject(403, body=b"no")

    async def nothing(event: str | bytes) -> None:
        return None

    async with serving(script) as server, trio.open_nursery() as nursery:
        rejecting = await nursery.start(serve_websocket, reject, "127.0.0.1", 0, None)
        gc.collect()  # sockets left for the GC by earlier tests must not close mid-count
        before = _open_fds()
        dropped = await connect_once(server.url, Toy(), nothing)
        refused = await connect_once(f"ws://127.0.0.1:{rejecting.port}/", Toy(), nothing)
        await trio.sleep(1)
        gc.collect()
        assert _open_fds() == before
        nursery.cancel_scope.cancel()
    assert dropped.code == 1006 and dropped.connected and not dropped.by_us
    assert refused.rejected == 403


async def test_cancellation_closes_at_once_with_the_shutdown_code(autojump_clock: object) -> None:
    codes: list[int | None] = []

    async def script(server: Server, ws: WebSocketConnection) -> None:
        await ws.send_message("ready")
        try:
            await server.pump(ws)
        except ConnectionClosed as exc:
            codes.append(exc.reason.code if exc.reason else None)
            raise

    async def nothing(event: str | bytes) -> None:
        return None

    async with serving(script) as server:
        with trio.move_on_after(5):
            await connect_once(
                server.url, Toy(), nothing, options=WsOptions(shutdown_close_code=1001)
            )
        await server.wait_until(lambda: bool(codes))
    assert codes == [1001]


async def test_reconnects_back_off_until_a_connection_is_stable(autojump_clock: object) -> None:
    """Drops before the session is live wait 1, 2, 4 s (Backoff, no jitter); a connection
    that was live for ``stable_after_s`` is followed by an immediate reconnect."""
    plan = ["drop", "drop", "drop", "stable", "drop", "fatal"]

    async def script(server: Server, ws: WebSocketConnection) -> None:
        step = plan[len(server.connections) - 1]
        if step == "stable":
            await ws.send_message("ready")
            await trio.sleep(60)
        if step == "fatal":
            await ws.aclose(4004, "go away")
            return
        await ws._stream.aclose()

    toy = Toy()
    urls: list[str] = []

    async def nothing(event: str | bytes) -> None:
        return None

    async with serving(script) as server:

        async def next_url() -> str:
            urls.append(server.url)
            return server.url

        t0 = trio.current_time()
        with pytest.raises(FatalChannelError):
            await run_ws(toy, next_url, nothing, backoff=Backoff(jitter=0.0))
    starts = [round(t - t0, 3) for t in server.connections]
    assert starts == [0.0, 1.0, 3.0, 7.0, 67.0, 67.0 + 1.0]
    assert [e.connected for e in toy.ended] == [False, False, False, True, False, False]
    assert toy.ended[-1].code == 4004 and len(urls) == 6


async def test_the_url_is_logged_without_its_query(autojump_clock: object) -> None:
    from structlog.testing import capture_logs

    async def script(server: Server, ws: WebSocketConnection) -> None:
        await ws.send_message("not a command")
        await ws.send_message("bye")
        await server.pump(ws)

    async def nothing(event: str | bytes) -> None:
        return None

    with capture_logs() as logs:
        async with serving(script) as server:
            await connect_once(server.url, Toy(), nothing)
    assert "secret-ticket" not in repr(logs)
    events = [e["event"] for e in logs]
    assert events[0] == "ws_connecting" and logs[0]["url"].endswith("/gw")
    assert "frame_dropped" in events and "ws_closing" in events
    assert {"event": "frame_sent", "kind": "hello", "log_level": "info"} in logs


async def test_pings_without_a_pong_cut_the_connection(autojump_clock: object) -> None:
    """``WsOptions.ping_interval_s``: a peer that completed the handshake and then hears
    nothing (no pong) is cut after ``pong_timeout_s``; a peer that answers is kept."""
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, Request

    async def deaf(stream: trio.SocketStream) -> None:
        conn = WSConnection(ConnectionType.SERVER)
        while True:
            conn.receive_data(await stream.receive_some(65536))
            if any(isinstance(e, Request) for e in conn.events()):
                break
        await stream.send_all(conn.send(AcceptConnection()))
        await trio.sleep_forever()  # never reads again: pings go unanswered

    options = WsOptions(ping_interval_s=30.0, pong_timeout_s=5.0)
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"), deaf, 0
        )
        port = listeners[0].socket.getsockname()[1]
        t0 = trio.current_time()

        async def nothing(event: object) -> None:
            return None

        ended = await connect_once(f"ws://127.0.0.1:{port}/", Toy(), nothing, options=options)
        assert trio.current_time() - t0 == pytest.approx(35.0, abs=0.5)
        assert (ended.code, ended.by_us) == (options.ping_timeout_code, True)

        async def answering(server: Server, ws: WebSocketConnection) -> None:
            await server.pump(ws)  # trio-websocket answers pings by itself

        async with serving(answering) as server:
            with trio.move_on_after(200):
                await connect_once(server.url, Toy(), nothing, options=options)
                raise AssertionError("a connection whose pongs come was cut")
        nursery.cancel_scope.cancel()


async def test_a_handover_opens_the_next_connection_before_the_old_one_ends(
    autojump_clock: object,
) -> None:
    """``run_ws_handover``: a session's Handover starts the next connection (with a new
    session) at once; the old one keeps delivering until it closes; deliveries of both
    reach ``deliver`` one at a time."""
    from dshim.net.ws import Handover, run_ws_handover

    class Moving(Toy):
        def receive(self, data: str | bytes, now: float) -> list[Action[str | bytes]]:
            if data == "moving":
                return [Handover("moving")]
            return super().receive(data, now)

    first_closed = trio.Event()
    opened_while_old_open: list[bool] = []

    async def script(server: Server, ws: WebSocketConnection) -> None:
        if len(server.connections) == 1:
            await ws.send_message("event:a")
            await ws.send_message("moving")
            await server.wait_until(lambda: len(server.connections) == 2)
            await ws.send_message("event:late")  # the old socket still delivers
            await trio.sleep(5)
            await ws.aclose(1000, "moved")
            first_closed.set()
        else:
            opened_while_old_open.append(not first_closed.is_set())
            await ws.send_message("event:b")
            await server.pump(ws)

    delivered: list[tuple[str | bytes, float]] = []
    sessions: list[Moving] = []

    def new_session() -> Moving:
        sessions.append(Moving())
        return sessions[-1]

    async def deliver(event: str | bytes) -> None:
        delivered.append((event, trio.current_time()))
        await trio.sleep(1)  # one at a time: the next starts after this one ends

    async with serving(script) as server:

        async def next_url() -> str:
            return server.url

        with trio.move_on_after(60):
            await run_ws_handover(new_session, next_url, deliver, backoff=Backoff(rng=None))
    assert opened_while_old_open == [True] and len(sessions) == 2
    assert {e for e, _ in delivered} == {"a", "b", "late"} and delivered[0][0] == "a"
    times = sorted(t for _, t in delivered)
    assert all(b - a >= 1.0 - 1e-6 for a, b in zip(times, times[1:], strict=False))
    assert sessions[0].ended and sessions[0].ended[0].code == 1000


async def test_a_replaced_connection_is_closed_once_the_next_is_live_or_after_the_grace(
    autojump_clock: object,
) -> None:
    """``run_ws_handover(close_replaced=)``: the runner closes the old connection with
    that Close as soon as the next one is live, without cancelling a delivery in hand on
    the old one; when the next one never gets live, ``replaced_grace_s`` after it started."""
    from dshim.net.ws import Handover, run_ws_handover

    class Moving(Toy):
        def receive(self, data: str | bytes, now: float) -> list[Action[str | bytes]]:
            if data == "moving":
                return [Handover("moving")]
            return super().receive(data, now)

    closes: list[tuple[int, int, float]] = []  # (connection, code, time)

    async def script(server: Server, ws: WebSocketConnection) -> None:
        n = len(server.connections)
        if n == 1:
            await ws.send_message("ready")
            await ws.send_message("moving")
            await trio.sleep(2)
            await ws.send_message("event:slow")  # in hand when the next one is live
        elif n == 2:
            await trio.sleep(3)
            await ws.send_message("ready")
            await trio.sleep(1)
            await ws.send_message("moving")  # the next one never gets live
        try:
            await server.pump(ws)
        except ConnectionClosed as exc:
            assert exc.reason is not None
            closes.append((n, exc.reason.code, trio.current_time() - t0))

    delivered: list[tuple[str | bytes, float]] = []
    sessions: list[Moving] = []

    def new_session() -> Moving:
        sessions.append(Moving())
        return sessions[-1]

    async def deliver(event: str | bytes) -> None:
        await trio.sleep(5)
        delivered.append((event, trio.current_time() - t0))

    async with serving(script) as server:

        async def next_url() -> str:
            return server.url

        t0 = trio.current_time()
        with trio.move_on_after(30):
            await run_ws_handover(
                new_session,
                next_url,
                deliver,
                backoff=Backoff(rng=None),
                close_replaced=Close(4000, "replaced"),
                replaced_grace_s=7.0,
            )
    assert len(sessions) == 3
    # the first closed when the second said ready (3 s), the second 7 s after the third
    # began; the third at the shutdown
    assert [(n, code) for n, code, _ in closes] == [(1, 4000), (2, 4000), (3, 1000)]
    assert [round(t) for _, _, t in closes] == [3, 11, 30]
    assert delivered == [("slow", pytest.approx(7.0, abs=0.1))]  # not cancelled by the close
    first = sessions[0].ended
    assert len(first) == 1 and (first[0].code, first[0].by_us) == (4000, True)
    assert sessions[2].ended == []  # still open when the runner was cancelled


async def test_a_sessions_own_ping_reports_its_pong(autojump_clock: object) -> None:
    """A :class:`Ping` action: the runner pings, and the pong goes to the session's
    ``pong(now)``; the timers follow what the pong scheduled.  A peer that never answers
    gets no pong reported (and the runner does not judge: the session does)."""
    from wsproto import ConnectionType, WSConnection
    from wsproto.events import AcceptConnection, Request

    from dshim.net.ws import Ping

    @dataclass
    class Pinger(Toy):
        pings: list[float] = field(default_factory=list)
        pongs: list[float] = field(default_factory=list)

        def tick(self, now: float, *, reading: bool) -> list[Action[str | bytes]]:
            self.pings.append(now)
            self.next_beat = None  # the next ping once this one was answered
            return [Ping()]

        def pong(self, now: float) -> None:
            self.pongs.append(now)
            self.next_beat = now + INTERVAL

    async def nothing(event: object) -> None:
        return None

    async def answering(server: Server, ws: WebSocketConnection) -> None:
        await server.pump(ws)  # trio-websocket answers pings by itself

    answered = Pinger()
    async with serving(answering) as server:
        t0 = trio.current_time()
        with trio.move_on_after(35):
            await connect_once(server.url, answered, nothing)
    assert [round(t - t0) for t in answered.pings] == [10, 20, 30]
    assert len(answered.pongs) == 3
    assert all(p >= q for p, q in zip(answered.pongs, answered.pings, strict=True))

    async def deaf(stream: trio.SocketStream) -> None:
        conn = WSConnection(ConnectionType.SERVER)
        while True:
            conn.receive_data(await stream.receive_some(65536))
            if any(isinstance(e, Request) for e in conn.events()):
                break
        await stream.send_all(conn.send(AcceptConnection()))
        await trio.sleep_forever()  # never reads again: pings go unanswered

    unanswered = Pinger()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"), deaf, 0
        )
        port = listeners[0].socket.getsockname()[1]
        with trio.move_on_after(60) as waited:
            await connect_once(f"ws://127.0.0.1:{port}/", unanswered, nothing)
        nursery.cancel_scope.cancel()
    assert waited.cancelled_caught  # still open: the session did not close it
    assert len(unanswered.pings) == 1 and unanswered.pongs == []
