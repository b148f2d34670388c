"""A small HTTP/1.1 server on trio sockets and h11, for fake platform APIs.

Fakes (``dshim.testing.fakes.<platform>``) describe *what* a platform answers; this
module does the HTTP: one task per connection, keep-alive, request bodies up to
``max_body`` bytes, and two fault primitives every fake needs — a handler that raises
:class:`DropConnection` closes the socket without answering (the client sees a
disconnect), and a handler that sleeps is a slow response.

Usage::

    async def app(request: Request) -> Response:
        if request.path == "/ping":
            return json_response({"ok": True})
        return json_response({"error": "not found"}, status=404)

    async with open_http_server(app) as server:
        ...  # server.url == "http://127.0.0.1:<port>"

The server listens on 127.0.0.1, port 0 (the kernel picks a free port), and never reaches
the outside world.  Leaving the ``async with`` block cancels every connection, including
handlers that are still waiting (long polls).
"""

from __future__ import annotations

import functools
import json
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import h11
import trio

__all__ = [
    "DropConnection",
    "HttpServer",
    "Request",
    "Response",
    "json_response",
    "open_http_server",
    "serve_http",
]

MAX_BODY = 16 * 1024 * 1024
RECEIVE_SIZE = 64 * 1024


class DropConnection(Exception):
    """Raise from a handler to close the connection without sending a response."""


class Request:
    """One HTTP request as the handler sees it (the body is already read)."""

    __slots__ = ("method", "target", "path", "query", "headers", "body")

    def __init__(
        self, method: str, target: str, headers: list[tuple[str, str]], body: bytes
    ) -> None:
        self.method = method
        self.target = target
        raw_path, _, raw_query = target.partition("?")
        self.path = urllib.parse.unquote(raw_path)
        #: Query parameters; the last value wins for repeated names.
        self.query: dict[str, str] = dict(urllib.parse.parse_qsl(raw_query, keep_blank_values=True))
        #: Header names are lower case.
        self.headers = headers
        self.body = body

    def header(self, name: str) -> str | None:
        name = name.lower()
        for key, value in self.headers:
            if key == name:
                return value
        return None

    def json(self) -> Any:
        """The body decoded as JSON (raises ValueError when it is not JSON)."""
        return json.loads(self.body)

    def params(self) -> dict[str, Any]:
        """Query string, then a JSON object or form-encoded body, merged (body wins)."""
        out: dict[str, Any] = dict(self.query)
        ctype = (self.header("content-type") or "").split(";", 1)[0].strip().lower()
        if self.body:
            if ctype == "application/json":
                data = self.json()
                if not isinstance(data, dict):
                    raise ValueError("JSON body is not an object")
                out.update(data)
            elif ctype == "application/x-www-form-urlencoded":
                out.update(
                    urllib.parse.parse_qsl(self.body.decode("utf-8"), keep_blank_values=True)
                )
        return out

    def __repr__(self) -> str:
        return f"Request({self.method} {self.path})"


class Response:
    """What a handler returns."""

    __slots__ = ("status", "headers", "body")

    def __init__(
        self,
        status: int = 200,
        body: bytes = b"",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.headers = headers or []


def json_response(obj: Any, status: int = 200) -> Response:
    """A JSON response (compact UTF-8)."""
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return Response(status, body, [("content-type", "application/json")])


Handler = Callable[[Request], Awaitable[Response]]


class HttpServer:
    """A running server: where it listens, and how many requests it has answered."""

    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = port
        self.requests = 0
        self.connections = 0

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


async def _send(stream: trio.SocketStream, conn: h11.Connection, event: h11.Event) -> None:
    data = conn.send(event)
    if data:
        await stream.send_all(data)


async def _read_request(
    stream: trio.SocketStream, conn: h11.Connection, max_body: int
) -> Request | None:
    """The next request on the connection, or None when the client closed it."""
    head: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            data = await stream.receive_some(RECEIVE_SIZE)
            conn.receive_data(data)  # b"" tells h11 the peer closed
            continue
        if isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > max_body:
                raise h11.RemoteProtocolError("request body too large", error_status_hint=413)
        elif isinstance(event, h11.EndOfMessage):
            assert head is not None
            headers = [(k.decode("latin-1").lower(), v.decode("latin-1")) for k, v in head.headers]
            return Request(
                head.method.decode("ascii"), head.target.decode("latin-1"), headers, bytes(body)
            )
        elif isinstance(event, h11.ConnectionClosed) or event is h11.PAUSED:
            return None


async def _serve_connection(
    stream: trio.SocketStream, handler: Handler, server: HttpServer, max_body: int
) -> None:
    server.connections += 1
    conn = h11.Connection(h11.SERVER)
    async with stream:
        while True:
            try:
                request = await _read_request(stream, conn, max_body)
            except h11.RemoteProtocolError as exc:
                if conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                    body = str(exc).encode("utf-8")
                    try:
                        await _send(
                            stream,
                            conn,
                            h11.Response(
                                status_code=exc.error_status_hint,
                                headers=[
                                    ("content-length", str(len(body))),
                                    ("connection", "close"),
                                ],
                            ),
                        )
                        await _send(stream, conn, h11.Data(data=body))
                        await _send(stream, conn, h11.EndOfMessage())
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        pass  # the client is gone (e.g. killed mid-request): nothing to tell it
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            if request is None:
                return
            server.requests += 1
            try:
                response = await handler(request)
            except DropConnection:
                return  # closing the stream without a response is the fault
            headers = [(k, v) for k, v in response.headers if k.lower() != "content-length"]
            headers.append(("content-length", str(len(response.body))))
            try:
                await _send(
                    stream, conn, h11.Response(status_code=response.status, headers=headers)
                )
                if response.body:
                    await _send(stream, conn, h11.Data(data=response.body))
                await _send(stream, conn, h11.EndOfMessage())
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # the client went away while we answered (e.g. a cancelled poll)
            if conn.our_state is h11.MUST_CLOSE or conn.their_state is h11.MUST_CLOSE:
                return
            try:
                conn.start_next_cycle()
            except h11.LocalProtocolError:
                return


async def serve_http(
    handler: Handler,
    *,
    port: int = 0,
    host: str = "127.0.0.1",
    max_body: int = MAX_BODY,
    task_status: trio.TaskStatus[HttpServer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``handler`` on ``host`` (127.0.0.1) until cancelled; ``task_status`` gets the
    server."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    server = HttpServer(listeners[0].socket.getsockname()[1], host)

    async def on_connection(stream: trio.SocketStream) -> None:
        await _serve_connection(stream, handler, server, max_body)

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, on_connection, listeners)
        task_status.started(server)


@asynccontextmanager
async def open_http_server(
    handler: Handler, *, max_body: int = MAX_BODY
) -> AsyncIterator[HttpServer]:
    """Run a server for the duration of the block (see the module docstring)."""
    async with trio.open_nursery() as nursery:
        server: HttpServer = await nursery.start(
            functools.partial(serve_http, handler, max_body=max_body)
        )
        try:
            yield server
        finally:
            nursery.cancel_scope.cancel()
