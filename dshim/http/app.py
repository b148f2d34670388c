"""The local HTTP endpoint's ASGI application: routes, mounts and websockets.

Theory of operation
-------------------
:class:`Endpoint` is one ASGI application per process, served by hypercorn's trio worker
(:mod:`dshim.http.server`).  It owns the routing table; everything else comes from the
outside:

- ``GET /healthz`` answers ``ok`` while the process runs;
- a channel mounts HTTP handlers and websocket handlers for its bot
  (:meth:`Endpoint.mount`, :meth:`Endpoint.mount_websocket`, through
  :meth:`dshim.channels.base.BotHost.mount`); they are served at
  ``/hooks/<bot>/<path>``.  The mounts of the web chat bot (the embedded default) are
  also served at the root: ``/`` is its page, ``/ws`` its socket.  A request for an
  unknown bot or path answers 404;
- more routes (readiness, metrics) are added with :meth:`Endpoint.route`; ``HEAD`` is
  answered like ``GET`` (without the body) where a route has no ``HEAD`` of its own.

Before anything else runs, a request's ``Host`` is checked (:class:`~.auth.HostPolicy`:
the listen address, loopback names, ``[http] public_host``; else 421 with a short text),
then ``[http] token`` (:mod:`dshim.http.auth`): every route but ``/healthz`` and the login
form needs the bearer token or the session cookie — an unknown path too, so that nothing
is revealed without it.  A mount its channel made public (``mount(..., public=True)``: a
platform webhook that cannot send the token and checks its own signature) is served
without it, its bodies capped at :data:`PUBLIC_MOUNT_MAX_BODY`.  A browser navigating
without it is sent to the login form (303); any other client gets 401; an address that
guessed too often gets 429 (:class:`~.auth.GuessThrottle`).  A websocket upgrade is
checked for ``Host``, ``Origin``, then for the token, then for a handler, and refused with
an HTTP answer (421, 403, 401, 429, 404) before it is accepted.

Public mounts and ``/healthz`` are not checked for ``Host``, by decision: a webhook is
called by the platform, usually through a reverse proxy that forwards whatever public name
the operator gave the platform (``public_host`` may not be set, or the proxy may pass its
own upstream name), and it authenticates every request by its signature, so a
DNS-rebinding page reads nothing there the internet cannot; ``/healthz`` says only ``ok``
and load balancers probe it by any name.

Handlers receive :class:`~dshim.channels.base.HttpRequest` (the body read, capped at
``max_body``: a larger ``Content-Length`` is refused before reading) and return
:class:`~dshim.channels.base.HttpResponse`; a websocket handler gets an accepted
:class:`AsgiWebSocket` and serves it until it returns.  Client mistakes answer 4xx with a
short JSON error ``{"error": code, "message": text}``; an exception in a handler is
logged and answers 500 without a traceback in the body.  On shutdown
:meth:`Endpoint.close_sockets` closes every open websocket (code 1001), so the server's
graceful stop is not held up.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import structlog
import trio

from dshim.http.auth import (
    Auth,
    GuessThrottle,
    HostPolicy,
    OriginPolicy,
    client_key,
    login_form,
    login_page,
    safe_next,
)
from dshim.http.types import (
    HttpHandler,
    HttpRequest,
    HttpResponse,
    WebSocketClosed,
    WebSocketHandler,
)

__all__ = [
    "CLOSE_WAIT_S",
    "LINGER_KEY",
    "MAX_BODY",
    "RELEASE_KEY",
    "AsgiWebSocket",
    "Endpoint",
    "json_error",
]

log = structlog.get_logger("dshim.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: Request bodies above this answer 413 (webhook payloads and uploads stay far below).
MAX_BODY = 32 * 1024 * 1024
#: How long the server lets requests in flight finish when it stops (seconds).
GRACEFUL_S = 3.0
#: How long a websocket dshim closed waits for the peer's closing answer.
CLOSE_WAIT_S = 5.0
#: The key of a received websocket message whose value frees what it held in the
#: server's budget (:mod:`dshim.http.wsstream`), called when the next one is taken.
RELEASE_KEY = "dshim.release"
#: A websocket scope's extension saying that the server itself ends a socket the
#: application closed once the peer answered, or :data:`CLOSE_WAIT_S` after
#: (:mod:`dshim.http.wsstream`).
LINGER_KEY = "dshim.close_linger"
#: A websocket scope's extension saying that a ``websocket.send`` may carry a list of
#: texts under this key: one message each, written to the socket together.
SEND_MANY_KEY = "dshim.send_many"
HOOKS = "/hooks/"
LOGIN = "/login"
#: Open without the token.
PUBLIC = frozenset({"/healthz"})
#: The body limit of the routes open without the token (the login form is tiny).
PUBLIC_MAX_BODY = 16 * 1024
#: The body limit of public mounts (platform webhooks that authenticate by signature).
PUBLIC_MOUNT_MAX_BODY = 1024 * 1024


def json_error(status: int, code: str, message: str) -> HttpResponse:
    """A short JSON error: ``{"error": code, "message": message}``."""
    body = json.dumps({"error": code, "message": message}, separators=(",", ":")).encode()
    return HttpResponse(status, body, "application/json")


@dataclass
class _Mounts:
    http: dict[str, HttpHandler]
    websocket: dict[str, WebSocketHandler]
    #: Mount paths served without the token (they check a signature themselves).
    public: set[str] = field(default_factory=set)


class AsgiWebSocket:
    """An accepted ASGI websocket as :class:`dshim.channels.base.WebSocket`.

    Sends are serialized (several tasks may answer into one socket); ``receive`` belongs
    to one task.  Taking the next message tells the server the previous one is handled
    (:data:`RELEASE_KEY`: what it held leaves the server's budget).  Once dshim closed
    the socket, a ``receive`` waits at most :data:`CLOSE_WAIT_S` for the peer's answer:
    a peer that never answers cannot keep the handler (and its slot) forever.
    """

    __slots__ = (
        "_scope",
        "_receive",
        "_send",
        "_path",
        "_lock",
        "_release",
        "_receiving",
        "closed",
    )

    def __init__(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        self._scope = scope
        self._receive = receive
        self._send = send
        self._path = path
        self._lock = trio.Lock()
        self._release: Callable[[], None] | None = None
        self._receiving: trio.CancelScope | None = None
        self.closed: int | None = None

    @property
    def path(self) -> str:
        return self._path

    @property
    def query(self) -> str:
        raw: bytes = self._scope.get("query_string", b"")
        return raw.decode("latin-1")

    @property
    def headers(self) -> tuple[tuple[str, str], ...]:
        return _headers(self._scope)

    @property
    def client(self) -> str:
        return _client(self._scope)

    async def accept(self) -> None:
        await self._send({"type": "websocket.accept"})

    async def receive(self) -> str | bytes:
        release, self._release = self._release, None
        if release is not None:
            release()
        if self.closed is not None:
            raise WebSocketClosed(self.closed)
        if LINGER_KEY in (self._scope.get("extensions") or {}):
            # The server ends a socket dshim closed by itself (CLOSE_WAIT_S): no scope
            # of our own for that, which an idle socket would hold while it waits.
            return await self._next()
        self._receiving = scope = trio.CancelScope()
        try:
            with scope:
                return await self._next()
        finally:
            self._receiving = None
        # Closed by dshim, and the peer did not answer within CLOSE_WAIT_S.
        raise WebSocketClosed(self.closed or 1006)

    async def _next(self) -> str | bytes:
        while True:
            message = await self._receive()
            kind = message.get("type")
            if kind == "websocket.receive":
                done = message.get(RELEASE_KEY)
                self._release = done if callable(done) else None
                text = message.get("text")
                if text is not None:
                    return str(text)
                return bytes(message.get("bytes") or b"")
            if kind == "websocket.disconnect":
                self.closed = int(message.get("code") or 1005)
                raise WebSocketClosed(self.closed)

    async def send(self, data: str) -> None:
        async with self._lock:
            if self.closed is not None:
                raise WebSocketClosed(self.closed)
            try:
                await self._send({"type": "websocket.send", "text": data})
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self.closed = 1006
                raise WebSocketClosed(1006) from exc

    async def send_many(self, texts: list[str]) -> None:
        """Send ``texts`` in order, one message each: written together where the server
        can (:data:`SEND_MANY_KEY`), else one after the other."""
        if SEND_MANY_KEY not in (self._scope.get("extensions") or {}):
            for text in texts:
                await self.send(text)
            return
        async with self._lock:
            if self.closed is not None:
                raise WebSocketClosed(self.closed)
            try:
                await self._send({"type": "websocket.send", "text": "", SEND_MANY_KEY: texts})
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                self.closed = 1006
                raise WebSocketClosed(1006) from exc

    async def close(self, code: int = 1000, reason: str = "") -> None:
        async with self._lock:
            if self.closed is not None:
                return
            self.closed = code
            if self._receiving is not None:
                self._receiving.deadline = min(
                    self._receiving.deadline, trio.current_time() + CLOSE_WAIT_S
                )
            try:
                await self._send({"type": "websocket.close", "code": code, "reason": reason})
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass


def _headers(scope: Scope) -> tuple[tuple[str, str], ...]:
    return tuple(
        (bytes(k).decode("latin-1").lower(), bytes(v).decode("latin-1"))
        for k, v in scope.get("headers", ())
    )


def _client(scope: Scope) -> str:
    """The peer's address as the limits group it (:func:`~.auth.client_key`)."""
    peer = scope.get("client")
    return client_key(str(peer[0])) if peer else ""


class Endpoint:
    """The ASGI application (see the module docstring).

    ``token``: the bearer token every route but ``/healthz`` needs (None: open);
    ``host``: the configured listen host (``Host`` and websocket ``Origin`` checks);
    ``public_host``: ``[http] public_host``; ``max_body``: the request body limit.
    """

    def __init__(
        self,
        *,
        token: str | None = None,
        host: str = "127.0.0.1",
        public_host: str | None = None,
        max_body: int = MAX_BODY,
    ) -> None:
        self._bots: dict[str, _Mounts] = {}
        self._routes: dict[str, dict[str, HttpHandler]] = {}
        #: The bot whose mounts are also served at the root (the web chat).
        self.root_bot: str | None = None
        self._sockets: set[AsgiWebSocket] = set()
        self.auth = Auth(token)
        self.hosts = HostPolicy(host, public_host)
        self.origins = OriginPolicy(host, public_host)
        self.guesses = GuessThrottle()
        self.max_body = max_body
        self.route("GET", "/healthz", _healthz)
        if self.auth.required:
            self.route("GET", LOGIN, _login_get)
            self.route("POST", LOGIN, self._login_post)

    # -- configuration ---------------------------------------------------------------

    def route(self, method: str, path: str, handler: HttpHandler) -> None:
        """Serve ``method path`` (exact match) with ``handler``."""
        self._routes.setdefault(path, {})[method.upper()] = handler

    def mount(self, bot: str, path: str, handler: HttpHandler, *, public: bool = False) -> None:
        """Serve ``/hooks/<bot>/<path>`` (and the root, for the root bot) with ``handler``.

        ``public``: served without the token (the handler authenticates by signature),
        with bodies up to :data:`PUBLIC_MOUNT_MAX_BODY`.
        """
        mounts = self._mounts(bot)
        mounts.http[_norm(path)] = handler
        if public:
            mounts.public.add(_norm(path))
        else:
            mounts.public.discard(_norm(path))

    def mount_websocket(self, bot: str, path: str, handler: WebSocketHandler) -> None:
        """Serve websockets at ``/hooks/<bot>/<path>`` (and the root, for the root bot)."""
        self._mounts(bot).websocket[_norm(path)] = handler

    def unmount(self, bot: str) -> None:
        """Nothing more at ``/hooks/<bot>/…`` (the bot stopped in this process: another
        instance runs it)."""
        self._bots.pop(bot, None)

    def _mounts(self, bot: str) -> _Mounts:
        mounts = self._bots.get(bot)
        if mounts is None:
            mounts = self._bots[bot] = _Mounts({}, {})
        return mounts

    @property
    def open_sockets(self) -> int:
        return len(self._sockets)

    async def close_sockets(self, code: int = 1001, reason: str = "dshim is stopping") -> None:
        """Close every open websocket (shutdown)."""
        for ws in list(self._sockets):
            await ws.close(code, reason)

    # -- routing ------------------------------------------------------------------------

    def _resolve(self, path: str) -> tuple[str, str] | None:
        """``(bot, path within the bot)`` for a mount path, else None."""
        if path.startswith(HOOKS):
            bot, _, rest = path[len(HOOKS) :].partition("/")
            return (bot, "/" + rest) if bot else None
        if self.root_bot is not None:
            return self.root_bot, path
        return None

    # -- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope.get("type")
        if kind == "http":
            await self._http(scope, receive, send)
        elif kind == "websocket":
            await self._websocket(scope, receive, send)
        elif kind == "lifespan":
            await _lifespan(receive, send)

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        method = str(scope.get("method", "GET")).upper()
        path = str(scope.get("path") or "/")
        headers = _headers(scope)
        head = method == "HEAD"
        query = bytes(scope.get("query_string", b"")).decode("latin-1")
        client = _client(scope)
        public = self._public(path)
        public_mount = not public and self._public_mount(path)
        if path not in PUBLIC and not public_mount and not self._host_allowed(path, headers):
            await _respond(send, _misdirected(), head=head)
            return
        if not public and not public_mount:
            refusal = self._credential_refusal(method, path, query, headers, client)
            if refusal is not None:
                await _respond(send, refusal, head=head)
                return
        limit = self.max_body
        if public:
            limit = min(self.max_body, PUBLIC_MAX_BODY)
        elif public_mount:
            limit = min(self.max_body, PUBLIC_MOUNT_MAX_BODY)
        declared = next((v for k, v in headers if k == "content-length"), "")
        if declared.strip().isdigit() and int(declared) > limit:
            await _respond(send, _too_large(limit), head=head)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > limit:
                await _respond(send, _too_large(limit), head=head)
                return
            if not message.get("more_body"):
                break
        request = HttpRequest(
            method=method, path=path, query=query, headers=headers, body=bytes(body), client=client
        )
        methods = self._routes.get(path)
        handler = None
        if methods is not None:
            handler = methods.get(method) or (methods.get("GET") if head else None)
            if handler is None:
                allowed = ", ".join(sorted({*methods, *(["HEAD"] if "GET" in methods else [])}))
                error = json_error(405, "method_not_allowed", f"{method} is not allowed on {path}")
                await _respond(send, _with_headers(error, ("allow", allowed)), head=head)
                return
        if handler is None and self._page_without_slash(method, path, headers):
            # A browser at /hooks/<bot> goes to /hooks/<bot>/: the relative links of a mounted
            # page (app.js, ws) resolve then.  Programs (webhook checks) get the mount itself.
            location = path + "/" + (f"?{query}" if query else "")
            await _respond(
                send, HttpResponse(308, b"", headers=(("location", location),)), head=head
            )
            return
        if handler is None:
            target = self._resolve(path)
            mounts = self._bots.get(target[0]) if target is not None else None
            if target is not None and mounts is not None:
                handler = mounts.http.get(_norm(target[1]))
                if handler is not None:
                    request = HttpRequest(
                        method, target[1], request.query, request.headers, request.body, client
                    )
        if handler is None:
            await _respond(
                send, json_error(404, "not_found", f"nothing at {path[:200]}"), head=head
            )
            return
        try:
            response = await handler(request)
        except Exception:
            log.exception("http_handler_failed", path=path, method=method)
            response = json_error(500, "internal", "the request failed inside dshim")
        await _respond(send, response, head=head)

    def _page_without_slash(
        self, method: str, path: str, headers: tuple[tuple[str, str], ...]
    ) -> bool:
        if method not in ("GET", "HEAD") or not path.startswith(HOOKS):
            return False
        bot = path[len(HOOKS) :]
        accept = next((v for k, v in headers if k == "accept"), "")
        mounts = self._bots.get(bot) if bot and "/" not in bot else None
        # A public root mount is a webhook, not a page: its GET is answered where it is.
        return mounts is not None and "/" not in mounts.public and "text/html" in accept

    def _public_mount(self, path: str) -> bool:
        """``path`` is a mount its channel made public (a signed webhook)."""
        if not path.startswith(HOOKS):
            return False
        target = self._resolve(path)
        mounts = self._bots.get(target[0]) if target is not None else None
        return target is not None and mounts is not None and _norm(target[1]) in mounts.public

    def _public(self, path: str) -> bool:
        return path in PUBLIC or (path == LOGIN and self.auth.required)

    def _host_allowed(self, path: str, headers: tuple[tuple[str, str], ...]) -> bool:
        host = next((v for k, v in headers if k == "host"), None)
        if self.hosts.allows(host):
            return True
        log.info("http_host_refused", path=path[:200], host=(host or "")[:100])
        return False

    def _credential_refusal(
        self,
        method: str,
        path: str,
        query: str,
        headers: tuple[tuple[str, str], ...],
        client: str,
    ) -> HttpResponse | None:
        """None when the request carries the token (or none is needed); else 401/303, or
        429 for an address out of guesses (then even the right token waits: no oracle)."""
        verdict = self.auth.check(headers)
        if verdict == "missing":
            return _unauthorized(method, path, query, headers)
        if verdict == "ok" and not self.auth.required:
            return None
        if self.guesses.wait_s(client) > 0:
            return self._too_many_guesses(client)
        if verdict == "wrong":
            self.guesses.failed(client)
            return _unauthorized(method, path, query, ())
        return None

    def _too_many_guesses(self, client: str) -> HttpResponse:
        log.info("http_guesses_throttled")
        error = json_error(
            429, "too_many_requests", "too many wrong tokens from this address: try again later"
        )
        return _with_headers(error, ("retry-after", self.guesses.retry_after(client)))

    async def _login_post(self, request: HttpRequest) -> HttpResponse:
        form = login_form(request)
        if form is None:
            return json_error(
                400,
                "bad_request",
                "expected a form (application/x-www-form-urlencoded) with one token field",
            )
        token, next_path = form
        if self.guesses.wait_s(request.client) > 0:
            return self._too_many_guesses(request.client)
        if not self.auth.token_matches(token):
            log.info("http_login_refused")
            self.guesses.failed(request.client)
            return json_error(401, "unauthorized", "that is not the token")
        self.guesses.succeeded(request.client)
        return HttpResponse(
            303,
            b"",
            "text/plain; charset=utf-8",
            headers=(("location", safe_next(next_path)), self.auth.set_cookie()),
        )

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        admitted = await self._upgrade(scope, receive, send)
        if admitted is None:
            return
        handler, mount_path = admitted
        # This frame lives as long as the socket: it keeps only what it needs.
        ws = AsgiWebSocket(scope, receive, send, mount_path)
        await ws.accept()
        self._sockets.add(ws)
        try:
            await handler(ws)
        except WebSocketClosed:
            pass
        except Exception:
            log.exception("websocket_handler_failed", path=scope.get("path"))
            await ws.close(1011, "internal error")
        finally:
            self._sockets.discard(ws)
            await ws.close()

    async def _upgrade(
        self, scope: Scope, receive: Receive, send: Send
    ) -> tuple[WebSocketHandler, str] | None:
        """The handler and mount path of an upgrade, or None once it was refused."""
        path = str(scope.get("path") or "/")
        target = self._resolve(path)
        mounts = self._bots.get(target[0]) if target is not None else None
        handler = mounts.websocket.get(_norm(target[1])) if target and mounts else None
        connect = await receive()
        if connect.get("type") != "websocket.connect":
            return None
        headers = _headers(scope)
        origin = next((v for k, v in headers if k == "origin"), None)
        server = scope.get("server") or (None, None)
        host_header = next((v for k, v in headers if k == "host"), None)
        if not self._host_allowed(path, headers):
            await _deny(scope, send, _misdirected())
            return None
        if origin is not None and not self.origins.allows(origin, host_header, server[1]):
            log.info("websocket_origin_refused", path=path, origin=origin[:200])
            error = json_error(403, "forbidden", "this page's origin may not open dshim sockets")
            await _deny(scope, send, error)
            return None
        refusal = self._credential_refusal("GET", path, "", headers, _client(scope))
        if refusal is not None:
            if refusal.status == 303:  # an upgrade is no navigation: no redirect
                refusal = _unauthorized("GET", path, "", ())
            await _deny(scope, send, refusal)
            return None
        if handler is None or target is None:
            await _deny(scope, send, json_error(404, "not_found", f"no websocket at {path[:200]}"))
            return None
        return handler, target[1]


def _norm(path: str) -> str:
    return "/" + path.strip("/")


async def _healthz(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, b"ok", "text/plain; charset=utf-8")


async def _login_get(request: HttpRequest) -> HttpResponse:
    query = urllib.parse.parse_qs(request.query)
    return login_page(query.get("next", ["/"])[0])


def _unauthorized(
    method: str, path: str, query: str, headers: tuple[tuple[str, str], ...]
) -> HttpResponse:
    """A browser navigating goes to the login form; anything else gets 401."""
    accept = next((v for k, v in headers if k == "accept"), "")
    if method == "GET" and "text/html" in accept:
        target = path + ("?" + query if query else "")
        location = LOGIN + "?" + urllib.parse.urlencode({"next": target})
        return HttpResponse(
            303, b"", "text/plain; charset=utf-8", headers=(("location", location),)
        )
    error = json_error(
        401, "unauthorized", "this endpoint needs its token: Authorization: Bearer <token>"
    )
    return _with_headers(error, ("www-authenticate", 'Bearer realm="dshim"'))


def _misdirected() -> HttpResponse:
    """421: the request names a host this endpoint does not answer for."""
    return HttpResponse(
        421,
        b"421 Misdirected Request: this dshim does not answer for that Host name "
        b"(an operator can add it as [http] public_host)\n",
        "text/plain; charset=utf-8",
    )


def _too_large(limit: int) -> HttpResponse:
    return json_error(413, "too_large", f"the request body is over {limit} bytes")


def _with_headers(response: HttpResponse, *headers: tuple[str, str]) -> HttpResponse:
    return HttpResponse(
        response.status, response.body, response.content_type, (*response.headers, *headers)
    )


def _encode_headers(response: HttpResponse, length: int) -> list[tuple[bytes, bytes]]:
    headers = [(b"content-type", response.content_type.encode("latin-1"))]
    headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers]
    headers.append((b"content-length", str(length).encode()))
    return headers


async def _respond(send: Send, response: HttpResponse, *, head: bool = False) -> None:
    headers = _encode_headers(response, len(response.body))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else response.body})


async def _deny(scope: Scope, send: Send, response: HttpResponse) -> None:
    """Refuse a websocket upgrade with an HTTP answer (plain 403 where not supported)."""
    if "websocket.http.response" in (scope.get("extensions") or {}):
        headers = _encode_headers(response, len(response.body))
        await send(
            {"type": "websocket.http.response.start", "status": response.status, "headers": headers}
        )
        await send({"type": "websocket.http.response.body", "body": response.body})
    else:
        await send({"type": "websocket.close", "code": 1008})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message.get("type") == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message.get("type") == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
