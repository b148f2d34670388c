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
- more routes (readiness, metrics) are added with :meth:`Endpoint.route`.

Handlers receive :class:`~dshim.channels.base.HttpRequest` (the body read, capped at
:data:`MAX_BODY`) and return :class:`~dshim.channels.base.HttpResponse`; a websocket
handler gets an accepted :class:`AsgiWebSocket` and serves it until it returns.  Client
mistakes answer 4xx with a short JSON error; an exception in a handler is logged and
answers 500 without a traceback in the body.  On shutdown :meth:`Endpoint.close_sockets`
closes every open websocket (code 1001), so the server's graceful stop is not held up.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import structlog
import trio

from dshim.channels.base import (
    HttpHandler,
    HttpRequest,
    HttpResponse,
    WebSocketClosed,
    WebSocketHandler,
)

__all__ = ["MAX_BODY", "AsgiWebSocket", "Endpoint", "json_error"]

log = structlog.get_logger("dshim.http")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

#: Request bodies above this answer 413 (webhook payloads and uploads stay far below).
MAX_BODY = 32 * 1024 * 1024
HOOKS = "/hooks/"


def json_error(status: int, code: str, message: str) -> HttpResponse:
    """A short JSON error: ``{"error": code, "message": message}``."""
    body = json.dumps({"error": code, "message": message}, separators=(",", ":")).encode()
    return HttpResponse(status, body, "application/json")


@dataclass
class _Mounts:
    http: dict[str, HttpHandler]
    websocket: dict[str, WebSocketHandler]


class AsgiWebSocket:
    """An accepted ASGI websocket as :class:`dshim.channels.base.WebSocket`.

    Sends are serialized (several tasks may answer into one socket); ``receive`` belongs
    to one task.
    """

    def __init__(self, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        self._scope = scope
        self._receive = receive
        self._send = send
        self._path = path
        self._lock = trio.Lock()
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

    async def accept(self) -> None:
        await self._send({"type": "websocket.accept"})

    async def receive(self) -> str | bytes:
        if self.closed is not None:
            raise WebSocketClosed(self.closed)
        while True:
            message = await self._receive()
            kind = message.get("type")
            if kind == "websocket.receive":
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

    async def close(self, code: int = 1000, reason: str = "") -> None:
        async with self._lock:
            if self.closed is not None:
                return
            self.closed = code
            try:
                await self._send({"type": "websocket.close", "code": code, "reason": reason})
            except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                pass


def _headers(scope: Scope) -> tuple[tuple[str, str], ...]:
    return tuple(
        (bytes(k).decode("latin-1").lower(), bytes(v).decode("latin-1"))
        for k, v in scope.get("headers", ())
    )


class Endpoint:
    """The ASGI application (see the module docstring)."""

    def __init__(self) -> None:
        self._bots: dict[str, _Mounts] = {}
        self._routes: dict[str, dict[str, HttpHandler]] = {}
        #: The bot whose mounts are also served at the root (the web chat).
        self.root_bot: str | None = None
        self._sockets: set[AsgiWebSocket] = set()
        self.route("GET", "/healthz", _healthz)

    # -- configuration ---------------------------------------------------------------

    def route(self, method: str, path: str, handler: HttpHandler) -> None:
        """Serve ``method path`` (exact match) with ``handler``."""
        self._routes.setdefault(path, {})[method.upper()] = handler

    def mount(self, bot: str, path: str, handler: HttpHandler) -> None:
        """Serve ``/hooks/<bot>/<path>`` (and the root, for the root bot) with ``handler``."""
        self._mounts(bot).http[_norm(path)] = handler

    def mount_websocket(self, bot: str, path: str, handler: WebSocketHandler) -> None:
        """Serve websockets at ``/hooks/<bot>/<path>`` (and the root, for the root bot)."""
        self._mounts(bot).websocket[_norm(path)] = handler

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
        body = bytearray()
        while True:
            message = await receive()
            if message.get("type") == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > MAX_BODY:
                await _respond(send, json_error(413, "too_large", "the request body is too large"))
                return
            if not message.get("more_body"):
                break
        request = HttpRequest(
            method=method,
            path=path,
            query=bytes(scope.get("query_string", b"")).decode("latin-1"),
            headers=_headers(scope),
            body=bytes(body),
        )
        methods = self._routes.get(path)
        handler = methods.get(method) if methods is not None else None
        if methods is not None and handler is None:
            await _respond(send, json_error(405, "method_not_allowed", f"{method} {path}"))
            return
        if handler is None:
            target = self._resolve(path)
            mounts = self._bots.get(target[0]) if target is not None else None
            if target is not None and mounts is not None:
                handler = mounts.http.get(_norm(target[1]))
                if handler is not None:
                    request = HttpRequest(
                        method, target[1], request.query, request.headers, request.body
                    )
        if handler is None:
            await _respond(send, json_error(404, "not_found", f"nothing at {path}"))
            return
        try:
            response = await handler(request)
        except Exception:
            log.exception("http_handler_failed", path=path, method=method)
            response = json_error(500, "internal", "the request failed inside dshim")
        await _respond(send, response)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path") or "/")
        target = self._resolve(path)
        mounts = self._bots.get(target[0]) if target is not None else None
        handler = mounts.websocket.get(_norm(target[1])) if target and mounts else None
        connect = await receive()
        if connect.get("type") != "websocket.connect":
            return
        if handler is None or target is None:
            await send({"type": "websocket.close", "code": 4404})
            return
        ws = AsgiWebSocket(scope, receive, send, target[1])
        await ws.accept()
        self._sockets.add(ws)
        try:
            await handler(ws)
        except WebSocketClosed:
            pass
        except Exception:
            log.exception("websocket_handler_failed", path=path)
            await ws.close(1011, "internal error")
        finally:
            self._sockets.discard(ws)
            await ws.close()


def _norm(path: str) -> str:
    return "/" + path.strip("/")


async def _healthz(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, b"ok", "text/plain; charset=utf-8")


async def _respond(send: Send, response: HttpResponse) -> None:
    headers = [(b"content-type", response.content_type.encode("latin-1"))]
    headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.headers]
    headers.append((b"content-length", str(len(response.body)).encode()))
    await send({"type": "http.response.start", "status": response.status, "headers": headers})
    await send({"type": "http.response.body", "body": response.body})


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message.get("type") == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message.get("type") == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
