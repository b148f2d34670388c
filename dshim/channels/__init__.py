"""Platform channels: one package per platform, imported lazily by key.

A channel package ``dshim.channels.<key>`` provides in its ``channel`` module:

- ``async def run(ctx: dshim.serve.BotContext, *, task_status)`` — the bot's nursery:
  authenticate, call ``task_status.started()``, then read events into the pipeline;
- ``def replay_adapter(fx: dshim.replay.ReplayContext) -> ReplayAdapter`` — decode raw
  fixture events with the real protocol code (and lookups through ``fx.http``);
- ``async def probe_checks(ctx: dshim.probe.ProbeContext) -> None`` — channel checks.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from dshim.config import CHANNEL_KEYS
from dshim.errors import ConfigError


def load_channel(key: str) -> ModuleType:
    """Import ``dshim.channels.<key>.channel``; a clear ConfigError when unavailable."""
    if key not in CHANNEL_KEYS:
        raise ConfigError(f"unknown channel {key!r}; expected one of {', '.join(CHANNEL_KEYS)}")
    try:
        return importlib.import_module(f"dshim.channels.{key}.channel")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith(f"dshim.channels.{key}"):
            raise ConfigError(
                f"channel {key!r} is not available in this version of dshim yet"
            ) from None
        raise
