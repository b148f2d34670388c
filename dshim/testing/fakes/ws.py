"""What the websocket fakes share: the writer task of one server-side connection.

A fake's connection keeps a memory channel of ``(kind, value)`` items that its writer
task sends in order: ``"text"`` (a string, as is), ``"close"`` (``(code, reason)``: a
clean close, bounded), ``"drop"`` (the socket closed without a close frame, as a dead
network does), and any other kind a JSON frame (``dumps(value)``), after which
``on_sent(kind)`` runs (a fake that counts its queued frames releases one there).  The
connection records who closed it (``closed_by``: ``server`` or ``drop``) and when.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Protocol

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

__all__ = ["FakeWsConnection", "write_frames"]


class FakeWsConnection(Protocol):
    """A fake's record of one websocket it accepted."""

    ws: WebSocketConnection
    closed_by: str | None
    closed_at: float | None


async def write_frames(
    conn: FakeWsConnection,
    recv: trio.MemoryReceiveChannel[tuple[str, Any]],
    changed: Callable[[], None],
    *,
    dumps: Callable[[Any], str] = lambda value: json.dumps(value, ensure_ascii=False),
    on_sent: Callable[[str], None] | None = None,
) -> None:
    """Send ``conn``'s queued items until a close or a drop (see the module docstring);
    ``changed`` tells the fake's waiters."""
    ws = conn.ws
    try:
        async for kind, value in recv:
            if kind == "text":
                await ws.send_message(value)
            elif kind == "close":
                conn.closed_by, conn.closed_at = "server", trio.current_time()
                changed()
                with trio.move_on_after(2):
                    await ws.aclose(*value)
                return
            elif kind == "drop":
                conn.closed_by, conn.closed_at = "drop", trio.current_time()
                changed()
                await ws._stream.aclose()
                return
            else:
                await ws.send_message(dumps(value))
                if on_sent is not None:
                    on_sent(kind)
    except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
        return
