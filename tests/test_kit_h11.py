"""The h11 transport for a platform's API calls, against a real HTTP server on 127.0.0.1:
answers arrive whole, connections are reused, a connection the server closed while idle
is not, failures are httpx's own errors (so the kit maps them like any other), and other
paths go to the default transport — through httpx's interface and through JsonPoster's
prepared path alike."""

from __future__ import annotations

import contextlib
import functools
import json
from collections.abc import Awaitable, Callable

import httpx
import pytest
import trio

from dshim.errors import ChannelError, TransportError
from dshim.net.h11transport import H11Transport
from dshim.net.http import (
    DEFAULT_TIMEOUT,
    Answer,
    JsonPoster,
    counted,
    counting_requests,
    download_capped,
    map_httpx_errors,
    open_http,
    parse_retry_after,
)
from dshim.testing.fakes.http import (
    DropConnection,
    Request,
    Response,
    json_response,
    open_http_server,
)


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


# --- the prepared path: JsonPoster's calls, answered without httpx's models -----------------


async def posted(poster: JsonPoster, path: str, body: object, limits: httpx.Timeout) -> Answer:
    return await counted("send", poster.post(path, body, limits))


class Recorder(Server):
    def __init__(self) -> None:
        super().__init__()
        self.requests: list[Request] = []

    async def app(self, request: Request) -> Response:
        self.requests.append(request)
        return await super().app(request)


async def test_prepared_posts_send_the_head_and_body_and_reuse_one_connection() -> None:
    server = Recorder()
    async with open_http_server(server.app) as srv:
        async with open_http(srv.url, user_agent="ua/1", fast_prefix="/api") as http:
            poster = JsonPoster(http)
            for i in range(3):
                resp = await posted(poster, "/api/send", {"n": i, "t": "é" * i}, DEFAULT_TIMEOUT)
                assert resp.status_code == 200
                assert json.loads(resp.content)["echo"] == json.dumps(
                    {"n": i, "t": "é" * i}, ensure_ascii=False, separators=(",", ":")
                )
                assert resp.headers.get("Content-Type") == "application/json"
            resp = await posted(poster, "/api/other", {}, DEFAULT_TIMEOUT)  # a second target
            assert resp.status_code == 200
    assert srv.connections == 1
    first = server.requests[1]
    assert first.method == "POST" and first.path == "/api/send"
    assert first.header("host") == f"127.0.0.1:{srv.port}"
    assert first.header("user-agent") == "ua/1"
    assert first.header("accept") == first.header("content-type") == "application/json"
    assert first.header("content-length") == str(len(first.body))
    assert [r.path for r in server.requests] == ["/api/send"] * 3 + ["/api/other"]


async def test_a_prepared_post_outside_the_prefix_goes_through_httpx() -> None:
    server = Recorder()
    async with open_http_server(server.app) as srv:
        async with open_http(srv.url, user_agent="ua/1", fast_prefix="/api") as http:
            resp = await posted(JsonPoster(http), "/files/x", {"a": 1}, DEFAULT_TIMEOUT)
    assert resp.status_code == 200 and json.loads(resp.content)["echo"] == '{"a":1}'
    assert server.requests[0].header("content-type") == "application/json"


async def test_a_posters_own_headers_go_with_every_post_fast_or_not() -> None:
    """JsonPoster's headers (a token, a content type of its own) on the prepared path, on
    httpx's (outside the prefix) and without the fast transport; ``post_bytes`` sends the
    body as given, to an absolute URL, and a 257th path is prepared again, not refused."""
    server = Recorder()
    extra = {"Authorization": "Bearer xoxb-1", "Content-Type": "application/json; charset=utf-8"}
    async with open_http_server(server.app) as srv:
        async with open_http(srv.url, user_agent="ua/1", fast_prefix="/api") as http:
            poster = JsonPoster(http, extra)
            await counted("a", poster.post_bytes(srv.url + "/api/m", b'{"a":1}', DEFAULT_TIMEOUT))
            await counted("b", poster.post("/files/m", {"b": 2}, DEFAULT_TIMEOUT))
            for i in range(257):
                await counted("c", poster.post_bytes(f"{srv.url}/api/c{i}", b"{}", DEFAULT_TIMEOUT))
        async with httpx.AsyncClient(headers={"user-agent": "ua/2"}) as plain:
            poster = JsonPoster(plain, extra)
            await counted("d", poster.post_bytes(srv.url + "/api/m", b'{"d":4}', DEFAULT_TIMEOUT))
    assert len(server.requests) == 260
    for request in server.requests:
        assert request.header("authorization") == "Bearer xoxb-1"
        assert request.header("content-type") == "application/json; charset=utf-8"
        assert request.header("accept") == "application/json"
    assert [r.body for r in (server.requests[0], server.requests[1], server.requests[-1])] == [
        b'{"a":1}',
        b'{"b":2}',
        b'{"d":4}',
    ]
    assert server.requests[0].header("user-agent") == "ua/1"
    assert server.requests[-1].header("user-agent") == "ua/2"
    assert server.requests[-2].path == "/api/c256"


async def serve_raw(
    nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]
) -> str:
    serve = functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1")
    [listener] = await nursery.start(serve)
    return f"http://127.0.0.1:{listener.socket.getsockname()[1]}"


async def read_request(stream: trio.abc.ReceiveStream, buffered: bytearray) -> bytes:
    """One request's bytes (head and Content-Length body) from ``buffered`` + the stream."""
    while b"\r\n\r\n" not in buffered:
        data = await stream.receive_some(65536)
        if not data:
            raise EOFError
        buffered += data
    head, _, rest = bytes(buffered).partition(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        ),
        0,
    )
    while len(rest) < length:
        rest += await stream.receive_some(65536)
    buffered[:] = rest[length:]
    return head + b"\r\n\r\n" + rest[:length]


async def test_a_chunked_answer_sent_in_pieces_is_read_whole_and_the_connection_kept() -> None:
    connections = 0

    async def chunked(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        buffered = bytearray()
        with contextlib.suppress(EOFError, trio.BrokenResourceError):
            while True:
                await read_request(stream, buffered)
                await stream.send_all(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"transfer-encoding: chunked\r\n\r\n5\r\n"
                )
                for piece in (b'{"ok"', b"\r\n4\r\n:tru", b"\r\n2\r\ne}\r\n", b"0\r\n\r\n"):
                    await trio.sleep(0.01)  # each piece its own read
                    await stream.send_all(piece)

    async with trio.open_nursery() as nursery:
        url = await serve_raw(nursery, chunked)
        async with open_http(url, user_agent="t", fast_prefix="/api") as http:
            poster = JsonPoster(http)
            for _ in range(3):
                resp = await posted(poster, "/api/x", {}, DEFAULT_TIMEOUT)
                assert resp.status_code == 200 and resp.content == b'{"ok":true}'
        nursery.cancel_scope.cancel()
    assert connections == 1


async def test_a_prepared_post_on_a_connection_the_server_closes_is_not_reused() -> None:
    server = Server()
    server.close_after = True
    async with open_http_server(server.app) as srv:
        async with open_http(srv.url, user_agent="t", fast_prefix="/api") as http:
            poster = JsonPoster(http)
            for _ in range(3):
                assert (await posted(poster, "/api/send", {}, DEFAULT_TIMEOUT)).status_code == 200
            assert srv.connections == 3  # "connection: close": a new one each time


async def test_a_prepared_post_replaces_an_idle_connection_the_server_dropped() -> None:
    accepted = 0

    async def one_answer_then_drop(stream: trio.SocketStream) -> None:
        nonlocal accepted
        accepted += 1
        await read_request(stream, bytearray())
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
        await stream.aclose()  # keep-alive promised, then gone while idle

    async with trio.open_nursery() as nursery:
        url = await serve_raw(nursery, one_answer_then_drop)
        async with open_http(url, user_agent="t", fast_prefix="/api") as http:
            poster = JsonPoster(http)
            for _ in range(3):
                assert (await posted(poster, "/api/x", {}, DEFAULT_TIMEOUT)).content == b"{}"
                await trio.sleep(0.05)  # the close reaches us while the connection is idle
        nursery.cancel_scope.cancel()
    assert accepted == 3


async def test_prepared_post_failures_are_mapped_and_counted_as_errors() -> None:
    seen: list[tuple[str, str]] = []

    async def drop(request: Request) -> Response:
        if request.path == "/api/drop":
            raise DropConnection
        await trio.sleep(30)
        raise AssertionError("unreachable")

    async with open_http_server(drop) as srv:
        async with open_http(srv.url, user_agent="t", fast_prefix="/api") as http:
            poster = JsonPoster(http)
            with counting_requests(lambda what, status: seen.append((what, status))):
                with pytest.raises(TransportError) as dropped:
                    await posted(poster, "/api/drop", {}, DEFAULT_TIMEOUT)
                with pytest.raises(TransportError) as slow:
                    await posted(poster, "/api/slow", {}, httpx.Timeout(5.0, read=0.2))
    with trio.socket.socket() as sock:
        await sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # nothing listens here
    async with open_http(f"http://127.0.0.1:{port}", user_agent="t", fast_prefix="/api") as http:
        with pytest.raises(TransportError) as refused:
            await posted(JsonPoster(http), "/api/x", {}, DEFAULT_TIMEOUT)
    assert dropped.value.request_sent and "RemoteProtocolError" in str(dropped.value)
    assert slow.value.request_sent and "ReadTimeout" in str(slow.value)
    assert not refused.value.request_sent and "ConnectError" in str(refused.value)
    assert seen == [("send", "error"), ("send", "error")]


async def test_a_body_the_server_never_reads_is_a_write_timeout() -> None:
    async def never_reads(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        url = await serve_raw(nursery, never_reads)
        async with open_http(url, user_agent="t", fast_prefix="/api") as http:
            with pytest.raises(TransportError) as info:
                # Far more than the socket buffers hold: the send blocks.
                await posted(
                    JsonPoster(http), "/api/x", "x" * 32_000_000, httpx.Timeout(5.0, write=0.3)
                )
        nursery.cancel_scope.cancel()
    # Never written whole: the server cannot have acted on it, so it may be sent again.
    assert not info.value.request_sent and "WriteTimeout" in str(info.value)


async def test_the_read_timeout_is_between_reads_not_for_the_whole_answer() -> None:
    async def trickle(stream: trio.SocketStream) -> None:
        await read_request(stream, bytearray())
        await stream.send_all(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\n")
        for piece in (b"a", b"b", b"c", b"d"):
            await trio.sleep(0.3)  # 1.2 s in all, each read well within 1.0 s
            await stream.send_all(piece)

    async with trio.open_nursery() as nursery:
        url = await serve_raw(nursery, trickle)
        async with open_http(url, user_agent="t", fast_prefix="/api") as http:
            resp = await posted(JsonPoster(http), "/api/x", {}, httpx.Timeout(5.0, read=1.0))
        nursery.cancel_scope.cancel()
    assert resp.content == b"abcd"


async def test_a_call_cancelled_mid_answer_never_leaves_its_answer_to_the_next_call() -> None:
    release = trio.Event()

    async def app(request: Request) -> Response:
        if request.path == "/api/slow":
            await release.wait()
        return json_response({"path": request.path})

    async with open_http_server(app) as srv:
        async with open_http(srv.url, user_agent="t", fast_prefix="/api") as http:
            poster = JsonPoster(http)
            assert (await posted(poster, "/api/first", {}, DEFAULT_TIMEOUT)).status_code == 200
            with trio.move_on_after(0.2):
                await posted(poster, "/api/slow", {}, DEFAULT_TIMEOUT)
            release.set()  # the slow answer now arrives on the abandoned connection
            resp = await posted(poster, "/api/next", {}, DEFAULT_TIMEOUT)
    assert json.loads(resp.content) == {"path": "/api/next"}


async def test_a_rate_limited_answer_keeps_its_status_and_retry_after() -> None:
    async def limited(request: Request) -> Response:
        return Response(
            429, b'{"ok":false}', [("Retry-After", "7"), ("x-two", "a"), ("x-two", "b")]
        )

    async with open_http_server(limited) as srv:
        async with open_http(srv.url, user_agent="t", fast_prefix="/api") as http:
            resp = await posted(JsonPoster(http), "/api/x", {}, DEFAULT_TIMEOUT)
    assert resp.status_code == 429
    assert parse_retry_after(resp.headers) == 7.0
    assert resp.headers["X-Two"] == "a, b" and "retry-after" in resp.headers


async def test_plain_http_api_calls_load_no_ca_bundle_and_no_httpx_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bot on a plain-http API (a local Bot API server, the fakes) starts without the CA
    bundle or httpcore's pool; a request off the API path still gets them when it comes."""
    import dshim.net.http as kit_http

    loads: list[int] = []
    real = kit_http.default_ssl_context
    monkeypatch.setattr(kit_http, "default_ssl_context", lambda: loads.append(1) or real())
    made: list[object] = []
    real_transport = httpx.AsyncHTTPTransport

    def transport(**kwargs: object) -> httpx.AsyncHTTPTransport:
        made.append(kwargs)
        return real_transport(**kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(kit_http.httpx, "AsyncHTTPTransport", transport)
    server = Server()
    async with open_http_server(server.app) as srv:
        async with open_http(srv.url, user_agent="ua/1", fast_prefix="/api") as http:
            for i in range(3):
                resp = await posted(JsonPoster(http), "/api/send", {"n": i}, DEFAULT_TIMEOUT)
                assert json.loads(resp.content)["echo"] == f'{{"n":{i}}}'
            assert (await http.post("/api/x", json={})).status_code == 200
            assert loads == [] and made == []
            assert (await http.get("/files/x")).status_code == 200  # off the API path
            assert len(made) == 1
    assert server.paths == ["/api/send"] * 3 + ["/api/x", "/files/x"]


# httpx and httpcore leave their inner body generators to trio's finalizer when a streamed
# answer is abandoned midway (here: at the cap); the connection itself is closed.
@pytest.mark.filterwarnings(
    "ignore:Async generator 'http(x|core)\\..*was garbage collected:ResourceWarning"
)
async def test_a_capped_download_is_streamed_even_on_an_api_path() -> None:
    """Every path goes over this transport by default, but a download reads the answer as
    it comes and stops at its cap: an answer that never ends is cut at the cap, not read
    whole (which would never finish)."""

    async def endless(stream: trio.SocketStream) -> None:
        buffered = bytearray()
        with contextlib.suppress(EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            await read_request(stream, buffered)
            await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            chunk = b"4000\r\n" + b"x" * 0x4000 + b"\r\n"
            while True:
                await stream.send_all(chunk)

    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            base = await serve_raw(nursery, endless)
            async with open_http(base, user_agent="ua/1") as http:
                assert isinstance(http._transport, H11Transport)
                with pytest.raises(ChannelError, match="over the 100000 byte limit"):
                    await download_capped(http, base + "/api/file/1", 100_000)
            nursery.cancel_scope.cancel()


async def test_a_compressed_answer_is_decoded_as_httpx_decodes_it() -> None:
    """httpx asks for gzip on every request; a platform that compresses its answers is
    read the same on this transport as on httpx's own."""
    import gzip

    body = gzip.compress(json.dumps({"ok": True, "items": list(range(50))}).encode())

    async def compressing(stream: trio.SocketStream) -> None:
        buffered = bytearray()
        with contextlib.suppress(EOFError, trio.BrokenResourceError):
            request = await read_request(stream, buffered)
            assert b"gzip" in request.lower()  # httpx's accept-encoding reached the server
            head = b"HTTP/1.1 200 OK\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"
            await stream.send_all(head % len(body) + body)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            base = await serve_raw(nursery, compressing)
            async with open_http(base, user_agent="ua/1") as http:
                assert isinstance(http._transport, H11Transport)
                resp = await http.get("/api/list")
            nursery.cancel_scope.cancel()
    assert resp.json() == {"ok": True, "items": list(range(50))}
