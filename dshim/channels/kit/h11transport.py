"""A small HTTP/1.1 transport for httpx on trio sockets and h11: the hot platform calls.

httpx's default transport (httpcore) costs about 0.4 ms of CPU per call on this stack; most
of it is pool bookkeeping and the general-purpose connection machinery.  A bot talks to one
or two hosts over keep-alive connections, so this transport keeps exactly that: a pool of
idle HTTP/1.1 connections per (scheme, host, port), one h11 state machine per connection,
request and response bodies read whole (platform API calls are small JSON; downloads use
the default transport), and httpx's own error types, so
:func:`dshim.channels.kit.http.map_httpx_errors` maps its failures like any other.

Plain ``http`` only (the fakes, a local Bot API server), and only for paths under
``prefix`` (a platform's API methods, never its file downloads, which must stream within
their size caps); everything else goes to the default transport, which this one wraps.
At most ``max_connections`` calls are in flight; an idle connection the server has closed
meanwhile (readable before reuse) is dropped, not used.

Timeouts: the request's ``timeout`` extension (connect, read, write), as httpx sets it.
A connection that the server closed, or that failed mid-call, is dropped; a request is
never retried here (the callers decide, and they know whether it was sent).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import h11
import httpx
import trio

__all__ = ["H11Transport"]

_MAX_IDLE_PER_HOST = 32
_READ_CHUNK = 65536


class _Conn:
    __slots__ = ("stream", "h11")

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h11 = h11.Connection(h11.CLIENT)


def _timeout(request: httpx.Request, key: str) -> float:
    value = request.extensions.get("timeout", {}).get(key)
    return math.inf if value is None else float(value)


class H11Transport(httpx.AsyncBaseTransport):
    """See the module docstring.  ``fallback`` serves https and streamed requests."""

    def __init__(
        self,
        fallback: httpx.AsyncBaseTransport,
        *,
        prefix: str,
        max_connections: int = 16,
    ) -> None:
        self._fallback = fallback
        self._prefix = prefix.encode("ascii")
        self._idle: dict[tuple[str, int], list[_Conn]] = {}
        self._slots = trio.Semaphore(max_connections)

    def handles(self, request: httpx.Request) -> bool:
        """Is ``request`` one this transport serves itself (else: the fallback)?"""
        url = request.url
        return (
            url.scheme == "http"
            and url.raw_path.startswith(self._prefix)
            and isinstance(request.stream, httpx.ByteStream)
        )

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if not self.handles(request):
            return await self._fallback.handle_async_request(request)
        async with self._slots:
            return await self._request(request, url)

    async def _request(self, request: httpx.Request, url: httpx.URL) -> httpx.Response:
        host, port = url.host, url.port or 80
        key = (host, port)
        conn = self._take(key)
        if conn is None:
            conn = await self._connect(request, host, port)
        try:
            response = await self._exchange(conn, request, host, port)
        except BaseException:
            await self._drop(conn)
            raise
        if conn.h11.our_state is h11.DONE and conn.h11.their_state is h11.DONE:
            conn.h11.start_next_cycle()
            idle = self._idle.setdefault(key, [])
            if len(idle) < _MAX_IDLE_PER_HOST:
                idle.append(conn)
            else:
                await self._drop(conn)
        else:
            await self._drop(conn)
        return response

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            # Readable while idle: the server closed it (or sent garbage): not reusable.
            if conn.h11.our_state is h11.IDLE and not conn.stream.socket.is_readable():
                return conn
            conn.stream.socket.close()
        return None

    async def _connect(self, request: httpx.Request, host: str, port: int) -> _Conn:
        try:
            with trio.fail_after(_timeout(request, "connect")):
                stream = await trio.open_tcp_stream(host, port)
        except trio.TooSlowError:
            raise httpx.ConnectTimeout("connect timed out", request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        return _Conn(stream)

    async def _exchange(
        self, conn: _Conn, request: httpx.Request, host: str, port: int
    ) -> httpx.Response:
        body = b"".join(request.stream)  # type: ignore[arg-type]  # ByteStream: bytes
        headers: list[tuple[bytes, bytes]] = [
            (k, v) for k, v in request.headers.raw if k.lower() not in (b"host", b"content-length")
        ]
        hostport = host if port == 80 else f"{host}:{port}"
        headers.insert(0, (b"Host", hostport.encode("ascii")))
        if body or request.method in ("POST", "PUT", "PATCH"):
            headers.append((b"Content-Length", str(len(body)).encode("ascii")))
        target = request.url.raw_path
        out = conn.h11.send(h11.Request(method=request.method, target=target, headers=headers))
        if body:
            out = (out or b"") + (conn.h11.send(h11.Data(data=body)) or b"")
        out = (out or b"") + (conn.h11.send(h11.EndOfMessage()) or b"")
        try:
            with trio.fail_after(_timeout(request, "write")):
                await conn.stream.send_all(out)
        except trio.TooSlowError:
            raise httpx.WriteTimeout("write timed out", request=request) from None
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpx.WriteError(str(exc) or "connection lost", request=request) from exc
        return await self._read_response(conn, request)

    async def _read_response(self, conn: _Conn, request: httpx.Request) -> httpx.Response:
        status = 0
        headers: Sequence[tuple[bytes, bytes]] = ()
        chunks: list[bytes] = []
        read_timeout = _timeout(request, "read")
        try:
            while True:
                event = conn.h11.next_event()
                if event is h11.NEED_DATA:
                    with trio.fail_after(read_timeout):
                        data = await conn.stream.receive_some(_READ_CHUNK)
                    conn.h11.receive_data(data)  # b"" is the peer's EOF
                    continue
                if isinstance(event, h11.Response):
                    status, headers = event.status_code, list(event.headers)
                elif isinstance(event, h11.Data):
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    break
                elif isinstance(event, h11.ConnectionClosed):
                    raise httpx.RemoteProtocolError(
                        "server closed the connection before answering", request=request
                    )
        except trio.TooSlowError:
            raise httpx.ReadTimeout("read timed out", request=request) from None
        except h11.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            raise httpx.ReadError(str(exc) or "connection lost", request=request) from exc
        return httpx.Response(
            status,
            headers=headers,
            content=b"".join(chunks),
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    async def _drop(self, conn: _Conn) -> None:
        with trio.CancelScope(shield=True):
            await conn.stream.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                await self._drop(conn)
        await self._fallback.aclose()
