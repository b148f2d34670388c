"""Harness adapters behind one interface (:mod:`dshim.harness.base`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dshim.config import HarnessConfig
    from dshim.harness.base import Harness
    from dshim.store.base import Store


def create_harness(
    cfg: HarnessConfig, *, bot: str, store: Store, workspace: str | None = None
) -> Harness:
    """Build the configured adapter for one bot.  Imports the adapter lazily."""
    if cfg.kind == "echo":
        from dshim.harness.echo import EchoHarness

        return EchoHarness()
    if cfg.kind == "openai":
        from dshim.harness.openai import OpenAIHarness  # type: ignore[import-not-found,unused-ignore]

        return OpenAIHarness(cfg, bot=bot, store=store)  # type: ignore[no-any-return,unused-ignore]
    if cfg.kind == "acp":
        from dshim.harness.acp import AcpHarness  # type: ignore[import-not-found,unused-ignore]

        return AcpHarness(cfg, bot=bot, workspace=workspace)  # type: ignore[no-any-return,unused-ignore]
    raise ValueError(f"unknown harness kind {cfg.kind!r}")
