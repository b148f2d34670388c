"""A small HTTP/1.1 transport for httpx on trio sockets and h11: the hot platform calls.

httpx's default transport (httpcore) costs about 0.4 ms of CPU per call on this stack; most
of it is pool bookkeeping and the general-purpose connection machinery.  A bot talks to one
or two hosts over keep-alive connections, so this transport keeps exactly that: a pool of
idle HTTP/1.1 connections per (host, port), one h11 state machine per connection,
request and response bodies read whole (platform API calls are small JSON; downloads use
the default transport), and httpx's own error types, so
:func:`dshim.net.http.map_httpx_errors` maps its failures like any other.

Only paths under ``prefix`` (by default every path: a platform's API calls), over ``http``
(the fakes, a local Bot API server) and, given an ``ssl_context``, ``https``, with a body
in memory (uploads built as streams, multipart forms, go on) and not marked
:data:`STREAMED` (the kit's downloads, which must stream within their size caps); all else
goes to the default transport, which this one wraps.  At most ``max_connections`` calls
are in flight; an idle connection the server has closed meanwhile (readable before
reuse) is dropped, not used.

TLS: :class:`trio.SSLStream` over the TCP stream, as httpcore's trio backend does it —
the same ``ssl.SSLContext`` as the wrapped transport (:func:`~dshim.net.http.open_http`
hands one to both), so certificates, SNI and the host name are checked identically; SNI
and the host name are the URL's host (IDNA-encoded); ALPN offers ``http/1.1`` only;
``https_compatible`` (a ragged EOF is an EOF: the HTTP framing tells a truncated answer).
The connect timeout covers the TCP connect and the handshake together; a failed handshake
(a certificate refused, the peer gone) is ``httpx.ConnectError`` as with httpcore, so
nothing was sent.  An idle TLS connection is dropped when its socket is readable or TLS
holds bytes it has not handed out (a ``close_notify`` or anything else the server sent
after its answer).

Two ways in:

- :meth:`H11Transport.handle_async_request`, httpx's transport interface: h11 writes the
  request from the ``httpx.Request`` and the answer is an ``httpx.Response``;
- :meth:`H11Transport.prepare_post` once per target, then :meth:`H11Transport.post` per
  call (:class:`~dshim.net.http.JsonPoster`'s hot path): the request head is
  bytes built once, so a call is one concatenation, one ``send`` and h11 reading the
  answer, which comes back as a light :class:`ApiResponse`.  h11 is handed the prepared
  head's event (validated once) so that its state machine knows a request is out — the
  method for the response's framing, keep-alive — but not the body, whose length only
  the wire carries: h11 never writes on this path.

Timeouts: connect, write and read as httpx defines them (read: between two reads), from
the request's ``timeout`` extension or the ``httpx.Timeout`` given to ``post``; one cancel
scope per call, its deadline moved from phase to phase.  A connection that the server
closed, or that failed mid-call, is dropped; a request is never retried here (the callers
decide, and they know whether it was sent).
"""

from __future__ import annotations

import math
import re
import ssl
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence

import h11
import httpx
import trio

__all__ = ["ApiResponse", "H11Transport", "PostTemplate", "PreparedPost"]

_MAX_IDLE_PER_HOST = 32
#: New connections being opened at a time, per transport: a start of ten thousand bots
#: on one shared client (:func:`dshim.net.http.open_shared_http`) connects in waves of
#: this many, not in a flood that overflows the server's listen backlog (each dropped
#: SYN waits a second or more to be sent again, and the connect timeout runs meanwhile).
#: The connect timeout counts from the moment a connection is being opened.
MAX_CONNECTING = 64
#: Request extension of a request whose answer is read as a stream
#: (:func:`~dshim.net.http.download_capped`): this transport reads answers whole,
#: so it hands such requests to the default transport.
STREAMED = "dshim.streamed"
_READ_CHUNK = 65536
_END = h11.EndOfMessage()
#: Path characters a :class:`PostTemplate` writes as they are (RFC 3986 ``pchar`` and
#: ``/``, no ``%``, no query): httpx's URL would leave such a path unchanged.  Any other
#: path is prepared the long way (:meth:`H11Transport.prepare_post`).
_PLAIN_PATH = re.compile(rb"/[A-Za-z0-9\-._~!$&'()*+,;=:@/]*")
_Head = Sequence[tuple[bytes, bytes]]
#: A pool's key: host (ASCII, IDNA-encoded), port, TLS or not.
_Key = tuple[str, int, bool]


class _Conn:
    """One connection: its socket, its TLS layer over that socket (https), its h11 state."""

    __slots__ = ("sock", "tls", "h11")

    def __init__(
        self, sock: trio.socket.SocketType, tls: trio.SSLStream[trio.SocketStream] | None
    ) -> None:
        self.sock = sock
        self.tls = tls
        self.h11 = h11.Connection(h11.CLIENT)

    def idle_and_quiet(self) -> bool:
        """Reusable: idle, and the server has sent nothing since its last answer."""
        if self.h11.our_state is not h11.IDLE or self.sock.is_readable():
            return False
        # TLS may have read more from the socket than the answer's records: what is left in
        # SSLStream's incoming buffer (a close_notify that came with the answer, say) means
        # the server spoke after answering.  Bytes h11 holds were checked on the way back.
        return self.tls is None or not self.tls._incoming.pending


class ResponseHeaders(Mapping[str, str]):
    """A response's headers, looked up case-insensitively (repeated ones joined by ``, ``,
    as httpx does)."""

    __slots__ = ("_map",)

    def __init__(self, raw: Iterable[tuple[bytes, bytes]]) -> None:
        found: dict[str, str] = {}
        for name, value in raw:
            key, text = name.decode("latin-1").lower(), value.decode("latin-1")
            found[key] = f"{found[key]}, {text}" if key in found else text
        self._map = found

    def __getitem__(self, key: str) -> str:
        return self._map[key.lower()]

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and key.lower() in self._map

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __repr__(self) -> str:
        return f"ResponseHeaders({self._map!r})"


class ApiResponse:
    """What an API call answered: ``status_code``, ``content`` (the whole body) and
    ``headers`` (parsed when first read)."""

    __slots__ = ("status_code", "content", "_raw", "_headers")

    def __init__(self, status_code: int, raw_headers: _Head, content: bytes) -> None:
        self.status_code = status_code
        self.content = content
        self._raw = raw_headers
        self._headers: ResponseHeaders | None = None

    @property
    def headers(self) -> ResponseHeaders:
        if self._headers is None:
            self._headers = ResponseHeaders(self._raw)
        return self._headers

    def __repr__(self) -> str:
        return f"<ApiResponse [{self.status_code}]>"


class PreparedPost:
    """A POST target prepared by :meth:`H11Transport.prepare_post`: its connection key,
    its head on the wire up to the ``Content-Length`` value, and h11's event for it."""

    __slots__ = ("key", "head", "event")

    def __init__(self, key: _Key, head: bytes, event: h11.Request) -> None:
        self.key = key
        self.head = head
        self.event = event


class PostTemplate:
    """POST targets under one base URL with one set of headers, prepared cheaply: the
    head h11 writes for the base is kept, and a path's head is that head with the
    path's target (see :meth:`H11Transport.post_template`).  Preparing a path costs a
    match and a concatenation instead of a parsed ``httpx.URL`` and an h11 state machine
    (~1 ms for each of a bot's API methods, paid by every bot at its start)."""

    __slots__ = ("_key", "_base_path", "_rest", "_event")

    def __init__(self, key: _Key, base_path: bytes, rest: bytes, event: h11.Request) -> None:
        self._key = key
        self._base_path = base_path
        self._rest = rest
        self._event = event

    def prepare(self, path: str) -> PreparedPost | None:
        """The prepared POST of ``path`` (under the base), or None when the path needs
        encoding (then prepare it with :meth:`H11Transport.prepare_post`)."""
        raw = path.encode("ascii", "replace")
        if not _PLAIN_PATH.fullmatch(raw):
            return None
        target = self._base_path + raw
        # h11 writes "POST <target> HTTP/1.1\r\n" then the headers: the same bytes.  Its
        # state machine reads the method and the headers of the event, never the target:
        # the template's one event serves every path.
        return PreparedPost(
            self._key, b"POST %s HTTP/1.1\r\n%s" % (target, self._rest), self._event
        )


def _seconds(value: float | None) -> float:
    return math.inf if value is None else float(value)


class H11Transport(httpx.AsyncBaseTransport):
    """See the module docstring.  ``fallback`` serves streamed requests, other paths, and
    https when no ``ssl_context`` is given; give it the same context as ``fallback``.
    ``ssl_context`` may be a function that makes it: it is then called at the first https
    connection (a bot whose API is plain http, a local Bot API server say, never loads a
    CA bundle)."""

    def __init__(
        self,
        fallback: httpx.AsyncBaseTransport,
        *,
        prefix: str,
        max_connections: int = 16,
        ssl_context: ssl.SSLContext | Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        self._fallback = fallback
        self._prefix = prefix.encode("ascii")
        self._idle: dict[_Key, list[_Conn]] = {}
        self._slots = trio.Semaphore(max_connections)
        self._connecting = trio.Semaphore(MAX_CONNECTING)
        #: Slots to take back as calls end (see :meth:`shrink`).
        self._owed = 0
        #: Idle connections kept per host (see :meth:`grow`).
        self.max_idle = _MAX_IDLE_PER_HOST
        self._templates: dict[tuple[str, tuple[tuple[str, str], ...]], PostTemplate | None] = {}
        self._ssl_source = ssl_context
        self._ssl_context: ssl.SSLContext | None = None

    def _tls(self) -> ssl.SSLContext:
        if self._ssl_context is None:
            source = self._ssl_source
            assert source is not None  # _key() gives no TLS key without one
            context = source if isinstance(source, ssl.SSLContext) else source()
            # HTTP/1.1 is all h11 speaks (httpcore sets the same on this context for http1).
            context.set_alpn_protocols(["http/1.1"])
            self._ssl_context = context
        return self._ssl_context

    def _key(self, url: httpx.URL) -> _Key | None:
        """The pool key of ``url`` when this transport serves it, else None."""
        if not url.raw_path.startswith(self._prefix):
            return None
        scheme = url.scheme
        if scheme == "http":
            return url.raw_host.decode("ascii"), url.port or 80, False
        if scheme == "https" and self._ssl_source is not None:
            return url.raw_host.decode("ascii"), url.port or 443, True
        return None

    def handles(self, request: httpx.Request) -> bool:
        """Is ``request`` one this transport serves itself (else: the fallback)?"""
        return (
            self._key(request.url) is not None
            and isinstance(request.stream, httpx.ByteStream)
            and STREAMED not in request.extensions
        )

    def grow(self, connections: int, idle: int) -> None:
        """Allow ``connections`` more calls in flight and keep ``idle`` more idle
        connections per host: a transport shared by one more bot
        (:func:`dshim.net.http.open_shared_http`)."""
        for _ in range(connections):
            if self._owed:
                self._owed -= 1
            else:
                self._slots.release()
        self.max_idle += idle

    def shrink(self, connections: int, idle: int) -> None:
        """Undo a :meth:`grow` (a bot left): the slots free now are taken back at once,
        the others as their calls end."""
        for _ in range(connections):
            try:
                self._slots.acquire_nowait()
            except trio.WouldBlock:
                self._owed += 1
        self.max_idle = max(_MAX_IDLE_PER_HOST, self.max_idle - idle)

    # -- the prepared path -----------------------------------------------------------------

    def post_template(
        self, base: httpx.URL, headers: Sequence[tuple[str, str]]
    ) -> PostTemplate | None:
        """A :class:`PostTemplate` for POSTs under ``base`` (its path, without a trailing
        slash, goes in front of every path), or None when this transport does not serve
        ``base`` (see :meth:`prepare_post`).  Made once per base and headers."""
        cache_key = (str(base), tuple(headers))
        if cache_key in self._templates:
            return self._templates[cache_key]
        base_path = base.raw_path.rstrip(b"/")
        probe = self.prepare_post(base.copy_with(raw_path=base_path + b"/"), headers)
        template = None
        if probe is not None and not base.query:
            _, _, rest = probe.head.partition(b"\r\n")
            template = PostTemplate(probe.key, base_path, rest, probe.event)
        if len(self._templates) < 16:
            self._templates[cache_key] = template
        return template

    def prepare_post(
        self, url: httpx.URL, headers: Sequence[tuple[str, str]]
    ) -> PreparedPost | None:
        """Prepare POSTs of a body to ``url`` with ``headers`` (no Host, no Content-Length):
        None when ``url`` is not one this transport serves (see :meth:`handles`)."""
        key = self._key(url)
        if key is None:
            return None
        fields = [(b"Host", url.netloc)]  # no port when it is the scheme's default
        fields += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        if any(
            k.lower() in (b"host", b"content-length", b"transfer-encoding") for k, _ in fields[1:]
        ):
            raise ValueError("prepare_post: the transport writes Host and the body's framing")
        event = h11.Request(method="POST", target=url.raw_path, headers=fields)  # validates
        # The head exactly as h11 writes it, its blank line cut to append Content-Length.
        written = h11.Connection(h11.CLIENT).send(event)
        assert written is not None and written.endswith(b"\r\n\r\n")
        head = written[:-2] + b"Content-Length: "
        return PreparedPost(key, head, event)

    async def post(
        self,
        prepared: PreparedPost,
        body: bytes,
        timeout: httpx.Timeout,  # noqa: ASYNC109 - httpx's per-request limits
    ) -> ApiResponse:
        """POST ``body`` to a prepared target; raises httpx's transport errors."""
        wire = b"".join((prepared.head, b"%d\r\n\r\n" % len(body), body))
        status, headers, content = await self._call(
            prepared.key,
            prepared.event,
            wire,
            _seconds(timeout.connect),
            _seconds(timeout.write),
            _seconds(timeout.read),
            None,
        )
        return ApiResponse(status, headers, content)

    # -- httpx's interface -------------------------------------------------------------------

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = self._key(url)
        if (
            key is None
            or not isinstance(request.stream, httpx.ByteStream)
            or STREAMED in request.extensions
        ):
            return await self._fallback.handle_async_request(request)
        body = b"".join(request.stream)  # ByteStream: bytes
        headers: list[tuple[bytes, bytes]] = [
            (k, v) for k, v in request.headers.raw if k.lower() not in (b"host", b"content-length")
        ]
        headers.insert(0, (b"Host", url.netloc))
        if body or request.method in ("POST", "PUT", "PATCH"):
            headers.append((b"Content-Length", str(len(body)).encode("ascii")))
        event = h11.Request(method=request.method, target=url.raw_path, headers=headers)
        limits = request.extensions.get("timeout", {})
        status, raw, content = await self._call(
            key,
            event,
            body,
            _seconds(limits.get("connect")),
            _seconds(limits.get("write")),
            _seconds(limits.get("read")),
            request,
        )
        return httpx.Response(
            status,
            headers=list(raw),
            content=content,
            request=request,
            extensions={"http_version": b"HTTP/1.1"},
        )

    # -- one call ------------------------------------------------------------------------------

    async def _call(
        self,
        key: _Key,
        event: h11.Request,
        payload: bytes,
        connect_s: float,
        write_s: float,
        read_s: float,
        request: httpx.Request | None,
    ) -> tuple[int, _Head, bytes]:
        """One exchange on a pooled connection.  ``request`` given: h11 writes ``event``
        with ``payload`` as its body; else ``payload`` is the whole request on the wire and
        ``event`` its head (see the module docstring)."""
        slots = self._slots
        try:
            slots.acquire_nowait()  # the common case: a free slot, no extra schedule point
        except trio.WouldBlock:
            await slots.acquire()
        try:
            conn = self._take(key)
            if conn is None:
                conn = await self._connect(key, connect_s, request)
            try:
                answer = await self._exchange(conn, event, payload, write_s, read_s, request)
            except BaseException:
                conn.sock.close()
                raise
            self._keep_or_close(key, conn)
            return answer
        finally:
            if self._owed:
                self._owed -= 1
            else:
                slots.release()

    def _take(self, key: _Key) -> _Conn | None:
        idle = self._idle.get(key)
        while idle:
            conn = idle.pop()
            # Readable while idle: the server closed it (or sent garbage): not reusable.
            if conn.idle_and_quiet():
                return conn
            conn.sock.close()
        return None

    def _keep_or_close(self, key: _Key, conn: _Conn) -> None:
        # Both sides DONE: keep-alive agreed (h11 says MUST_CLOSE after "Connection: close");
        # bytes after the answer would be read as the next call's answer: not reusable.
        state = conn.h11
        if (
            state.our_state is h11.DONE
            and state.their_state is h11.DONE
            and not state.trailing_data[0]
        ):
            state.start_next_cycle()
            idle = self._idle.get(key)
            if idle is None:
                idle = self._idle[key] = []
            if len(idle) < self.max_idle:
                idle.append(conn)
                return
        conn.sock.close()

    async def _connect(self, key: _Key, connect_s: float, request: httpx.Request | None) -> _Conn:
        host, port, tls = key
        async with self._connecting:
            return await self._open(host, port, tls, connect_s, request)

    async def _open(
        self, host: str, port: int, tls: bool, connect_s: float, request: httpx.Request | None
    ) -> _Conn:
        try:
            with trio.fail_after(connect_s):  # the TCP connect and the TLS handshake
                stream = await trio.open_tcp_stream(host, port)
                if not tls:
                    return _Conn(stream.socket, None)
                secure = trio.SSLStream(
                    stream, self._tls(), server_hostname=host, https_compatible=True
                )
                try:
                    await secure.do_handshake()
                except BaseException:
                    stream.socket.close()
                    raise
                return _Conn(stream.socket, secure)
        except trio.TooSlowError:
            raise httpx.ConnectTimeout("connect timed out", request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc), request=request) from exc
        except trio.BrokenResourceError as exc:  # the handshake failed: its ssl error is the cause
            reason = str(exc.__cause__ or "") or "TLS handshake failed"
            raise httpx.ConnectError(reason, request=request) from exc

    async def _exchange(
        self,
        conn: _Conn,
        event: h11.Request,
        payload: bytes,
        write_s: float,
        read_s: float,
        request: httpx.Request | None,
    ) -> tuple[int, _Head, bytes]:
        state, sock, tls = conn.h11, conn.sock, conn.tls
        if request is None:
            state.send(event)  # its bytes are in payload already
            state.send(_END)
            wire = payload
        else:
            wire = state.send(event) or b""
            if payload:
                wire += state.send(h11.Data(data=payload)) or b""
            wire += state.send(_END) or b""
        reading = False
        status = 0
        headers: _Head = ()
        chunks: list[bytes] = []
        # One scope for the call; its deadline is the current phase's (write, then each read).
        scope = trio.CancelScope(deadline=trio.current_time() + write_s)
        try:
            with scope:
                if tls is not None:
                    await tls.send_all(wire)
                else:
                    sent = await sock.send(wire)
                    while sent < len(wire):
                        sent += await sock.send(memoryview(wire)[sent:])
                reading = True
                scope.deadline = trio.current_time() + read_s
                fresh = True
                while True:
                    got = state.next_event()
                    if got is h11.NEED_DATA:
                        if not fresh:
                            scope.deadline = trio.current_time() + read_s
                        fresh = False
                        # b"": the peer's EOF (over TLS also one without close_notify)
                        if tls is not None:
                            data = await tls.receive_some(_READ_CHUNK)
                            state.receive_data(data)  # type: ignore[arg-type]  # SSLObject.read: bytes
                        else:
                            state.receive_data(await sock.recv(_READ_CHUNK))
                        continue
                    kind = type(got)
                    if kind is h11.Data:
                        chunks.append(got.data)  # type: ignore[union-attr]
                    elif kind is h11.Response:
                        status, headers = got.status_code, got.headers  # type: ignore[union-attr]
                    elif kind is h11.EndOfMessage:
                        break
                    elif kind is h11.ConnectionClosed:
                        raise httpx.RemoteProtocolError(
                            "server closed the connection before answering", request=request
                        )
        except h11.RemoteProtocolError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from exc
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            error = httpx.ReadError if reading else httpx.WriteError
            raise error(str(exc) or "connection lost", request=request) from exc
        if scope.cancelled_caught:
            if reading:
                raise httpx.ReadTimeout("read timed out", request=request)
            raise httpx.WriteTimeout("write timed out", request=request)
        content = bytes(chunks[0]) if len(chunks) == 1 else b"".join(chunks)
        return status, headers, content

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for conns in idle.values():
            for conn in conns:
                conn.sock.close()
        await self._fallback.aclose()
