"""A real store seen through a proxy that counts calls, slows them, or makes them fail.

Tests of the quoted-reply layer need a store that is slow (deadlines), counts its calls
(the recovery runs once) or breaks (a failing disk).  Instead of a re-implementation of the
store's rules, :class:`StoreProxy` forwards every call to the real SQLite store after
counting it, sleeping ``delay`` seconds, and raising the error scripted in ``fail``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from dshim.store import open_store
from dshim.store.base import Store


class StoreProxy:
    """Forwards to ``inner``; ``calls`` counts calls per method."""

    def __init__(self, inner: Store, *, delay: float = 0.0) -> None:
        self.inner = inner
        self.delay = delay
        self.calls: Counter[str] = Counter()
        #: method name -> the exception its calls raise (instead of reaching the store).
        self.fail: dict[str, BaseException] = {}

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        target = getattr(self.inner, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if self.delay:
                await trio.sleep(self.delay)
            if name in self.fail:
                raise self.fail[name]
            return await target(*args, **kwargs)

        return call


@asynccontextmanager
async def open_proxy(data_dir: Path, *, delay: float = 0.0) -> AsyncIterator[StoreProxy]:
    """A proxy over a fresh SQLite store in ``data_dir`` (inline: the autojump clock stays
    deterministic)."""
    async with open_store(data_dir, inline=True) as store:
        yield StoreProxy(store, delay=delay)
