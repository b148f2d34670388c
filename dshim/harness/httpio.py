"""HTTP helpers the HTTP harness adapters (openai, dsh) share."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import trio

__all__ = ["RELEASE_TIMEOUT_S", "release_response"]

RELEASE_TIMEOUT_S = 2.0


async def release_response(resp: httpx.Response, chunks: AsyncIterator[bytes] | None) -> None:
    """Close a response, then let its byte iterator fail so that httpx's chain of async
    generators finishes now (an abandoned, suspended chain would be finalized by the
    garbage collector later).  Shielded and bounded: runs on /stop and shutdown too."""
    with trio.CancelScope(shield=True), trio.move_on_after(RELEASE_TIMEOUT_S):
        await resp.aclose()
        if chunks is not None:
            try:
                async for _ in chunks:
                    pass
            except (httpx.HTTPError, httpx.StreamError):
                pass
