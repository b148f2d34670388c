"""The local HTTP endpoint's request and websocket types, as a handler sees them.

They sit on the ground floor because both sides use them: the endpoint
(:mod:`dshim.http.app`, its auth and ops routes) builds them, and the channels that
mount handlers (platform webhooks, the web chat) receive them -- through the channel
contract, :mod:`dshim.channels.base`, which re-exports them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "HttpHandler",
    "HttpRequest",
    "HttpResponse",
    "WebSocket",
    "WebSocketClosed",
    "WebSocketHandler",
]


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """One HTTP request to a mounted handler (the body is read, at most the endpoint's cap).

    ``path`` is relative to the mount point and starts with ``/``; header names are lower
    case.  Authentication (the endpoint's bearer token) is checked before the handler runs;
    a platform's own signature check is the handler's.
    """

    method: str
    path: str
    query: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    #: The client's address as the endpoint's limits group it (an IPv4 address, an IPv6
    #: /64); empty when unknown.
    client: str = ""

    def header(self, name: str) -> str | None:
        name = name.lower()
        for key, value in self.headers:
            if key == name:
                return value
        return None


@dataclass(frozen=True, slots=True)
class HttpResponse:
    """What a mounted handler answers."""

    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: tuple[tuple[str, str], ...] = ()


#: A handler mounted on the local HTTP endpoint (platform webhooks, the web chat's page).
HttpHandler = Callable[[HttpRequest], Awaitable[HttpResponse]]


class WebSocketClosed(Exception):
    """The peer closed the websocket (or the endpoint is shutting down)."""

    def __init__(self, code: int | None = None) -> None:
        super().__init__(f"websocket closed ({code})")
        self.code = code


class WebSocket(Protocol):
    """One accepted websocket on the local HTTP endpoint.

    The endpoint has already checked authentication and ``Origin``.  ``receive`` returns the
    next text (``str``) or binary (``bytes``) message and raises :class:`WebSocketClosed`
    when the peer or the endpoint closed the socket; ``send`` raises it too once closed.
    One task may receive while others send.
    """

    @property
    def path(self) -> str: ...

    @property
    def query(self) -> str: ...

    @property
    def headers(self) -> tuple[tuple[str, str], ...]: ...

    @property
    def client(self) -> str:
        """The peer's address as the endpoint's limits group it (see ``HttpRequest``)."""
        ...

    async def receive(self) -> str | bytes: ...

    async def send(self, data: str) -> None: ...

    async def close(self, code: int = 1000, reason: str = "") -> None: ...


#: Serves one websocket until it closes (returning closes it).
WebSocketHandler = Callable[[WebSocket], Awaitable[None]]
