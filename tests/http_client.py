"""Small clients for the local HTTP endpoint's tests: raw requests and websockets.

``open_ws`` owns its TCP stream and closes it on every way out: trio-websocket's
``open_websocket_url`` (0.12) leaves the client socket open after a refused upgrade and
after a close the server started (see :mod:`dshim.net.ws`), which
``filterwarnings = error`` turns into failures.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio
from trio_websocket import WebSocketConnection

from dshim.net.ws import WsOptions, open_client_websocket


def port_of(base: str) -> int:
    port = urllib.parse.urlsplit(base).port
    assert port is not None
    return port


async def raw_request(base: str, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send bytes as they are; read one response (status, headers, body)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port_of(base))
    async with stream:
        await stream.send_all(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {
            k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])
        }
        length = int(headers.get("content-length", "0"))
        while len(body) < length:
            chunk = await stream.receive_some(65536)
            if not chunk:
                break
            body += chunk
    return int(lines[0].split()[1]), headers, body


async def upgrade(base: str, path: str, *headers: str) -> tuple[int, bytes]:
    """A websocket upgrade request; the HTTP answer when it is refused (101: accepted)."""
    lines = [
        f"GET {path} HTTP/1.1",
        f"Host: 127.0.0.1:{port_of(base)}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
        *headers,
    ]
    status, _, body = await raw_request(base, ("\r\n".join(lines) + "\r\n\r\n").encode())
    return status, body


@asynccontextmanager
async def open_ws(
    base: str, path: str, headers: list[tuple[bytes, bytes]] | None = None
) -> AsyncIterator[WebSocketConnection]:
    """A websocket to ``path`` of the endpoint at ``base`` (``http://127.0.0.1:PORT``), on
    the kit's client (it owns the TCP stream, so no way out leaks the socket)."""
    url = base.replace("http://", "ws://", 1) + path
    options = WsOptions(max_message_size=16 * 1024 * 1024, shutdown_close_s=2.0)
    async with open_client_websocket(url, options, extra_headers=headers or ()) as (ws, _):
        yield ws
