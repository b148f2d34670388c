"""The h11 transport for a platform's API calls, against a real HTTP server on 127.0.0.1:
answers arrive whole, connections are reused, a connection the server closed while idle
is not, failures are httpx's own errors (so the kit maps them like any other), and other
paths go to the default transport."""

from __future__ import annotations

import functools

import httpx
import pytest
import trio

from dshim.channels.kit.h11transport import H11Transport
from dshim.channels.kit.http import map_httpx_errors, open_http
from dshim.errors import TransportError
from dshim.testing.fakes.http import Request, Response, json_response, open_http_server


class Server:
    def __init__(self) -> None:
        self.peers: list[object] = []
        self.paths: list[str] = []
        self.slow = False
        self.close_after = False

    async def app(self, request: Request) -> Response:
        self.paths.append(request.path)
        if self.slow:
            await trio.sleep(30)
        resp = json_response({"ok": True, "echo": request.body.decode() if request.body else ""})
        if self.close_after:
            resp.headers.append(("connection", "close"))
        return resp


async def test_calls_under_the_prefix_are_answered_whole_and_reuse_one_connection() -> None:
    server = Server()
    async with open_http_server(server.app) as srv:
        async with open_http(srv.url, user_agent="t", fast_prefix="/api") as http:
            assert isinstance(http._transport, H11Transport)
            for i in range(5):
                resp = await http.post("/api/send", json={"n": i})
                assert resp.status_code == 200 and resp.json()["echo"] == f'{{"n":{i}}}'
            idle = sum(len(v) for v in http._transport._idle.values())
            assert idle == 1  # one keep-alive connection served all five
            other = await http.get("/files/x")  # not under the prefix: the default transport
            assert other.status_code == 200
    assert server.paths == ["/api/send"] * 5 + ["/files/x"]


async def test_a_connection_the_server_closes_is_not_reused() -> None:
    server = Server()
    server.close_after = True
    async with open_http_server(server.app) as srv:
        async with open_http(srv.url, user_agent="t", fast_prefix="/api") as http:
            for _ in range(3):
                assert (await http.post("/api/send", json={})).status_code == 200
                await trio.sleep(0.05)
            assert srv.connections == 3  # "connection: close": a new one each time
            server.close_after = False
            assert (await http.post("/api/send", json={})).status_code == 200
            assert (await http.post("/api/send", json={})).status_code == 200
            assert srv.connections == 4  # and kept again once the server allows it


async def test_a_read_timeout_is_httpx_read_timeout_and_maps_to_sent() -> None:
    server = Server()
    server.slow = True
    async with open_http_server(server.app) as srv:
        async with open_http(
            srv.url, user_agent="t", fast_prefix="/api", timeout=httpx.Timeout(5.0, read=0.2)
        ) as http:
            with pytest.raises(TransportError) as info:
                with map_httpx_errors("send"):
                    await http.post("/api/send", json={})
    assert info.value.request_sent  # the request was on the wire: its outcome is unknown


async def test_a_refused_connection_is_a_connect_error_and_maps_to_not_sent() -> None:
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here
    async with open_http(f"http://127.0.0.1:{port}", user_agent="t", fast_prefix="/api") as http:
        with pytest.raises(TransportError) as info:
            with map_httpx_errors("send"):
                await http.post("/api/send", json={})
    assert not info.value.request_sent


async def test_an_idle_connection_the_server_dropped_silently_is_replaced() -> None:
    """A server that answers with keep-alive and then drops the idle connection (an idle
    timeout): the next call must not be lost on the dead socket."""
    accepted = 0

    async def one_answer_then_drop(stream: trio.SocketStream) -> None:
        nonlocal accepted
        accepted += 1
        data = b""
        while b"\r\n\r\n" not in data:
            data += await stream.receive_some(4096)
        body = b'{"ok":true}'
        await stream.send_all(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        await stream.aclose()  # keep-alive promised, then gone while idle

    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, one_answer_then_drop, 0, host="127.0.0.1")
        [listener] = await nursery.start(serve)
        port = listener.socket.getsockname()[1]
        async with open_http(
            f"http://127.0.0.1:{port}", user_agent="t", fast_prefix="/api"
        ) as http:
            for _ in range(3):
                assert (await http.get("/api/x")).json() == {"ok": True}
                await trio.sleep(0.05)  # the close reaches us while the connection is idle
        nursery.cancel_scope.cancel()
    assert accepted == 3
