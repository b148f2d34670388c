"""Harness adapters behind one interface (:mod:`dshim.harness.base`).

Always open a harness with :func:`open_harness`: it gives adapters that run background
tasks (the ACP agent's reader) a nursery of their own and closes them on exit.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import trio

from dshim.errors import single_error
from dshim.harness.base import Harness

if TYPE_CHECKING:
    from dshim.config import HarnessConfig
    from dshim.store.base import Store

CLOSE_TIMEOUT_S = 15.0


def create_harness(
    cfg: HarnessConfig, *, bot: str, store: Store | None, workspace: str | None = None
) -> Harness:
    """Build the configured adapter for one bot (its module is imported only then: the
    adapters nobody configured cost no start-up time)."""
    if cfg.kind == "echo":
        from dshim.harness.echo import EchoHarness

        return EchoHarness()
    if cfg.kind == "openai":
        from dshim.harness.openai import OpenAIHarness

        return OpenAIHarness(cfg, bot=bot, store=store)
    if cfg.kind == "acp":
        from dshim.harness.acp import AcpHarness

        return AcpHarness(cfg, bot=bot, workspace=workspace)
    if cfg.kind == "dsh":
        from dshim.harness.dsh import DshHarness

        return DshHarness(cfg, bot=bot, workspace=workspace)
    raise ValueError(f"unknown harness kind {cfg.kind!r}")


@asynccontextmanager
async def open_harness(harness: Harness) -> AsyncIterator[Harness]:
    """Own a harness: attach a nursery for its background tasks, close it on exit."""
    with single_error():
        async with trio.open_nursery() as nursery:
            attach = getattr(harness, "attach", None)
            if attach is not None:
                attach(nursery)
            try:
                yield harness
            finally:
                with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
                    await harness.aclose()
                nursery.cancel_scope.cancel()
