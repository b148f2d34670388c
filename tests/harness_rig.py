"""Test support for the harness adapters: a pipeline rig with a [harness] section, and waits.

Like :func:`tests.helpers.open_rig` (a runtime on a real SQLite file with a recording
outbound), but the configuration gets a ``[harness]`` table too, so interaction timeouts
and the like are the real configuration path.  The harness instance is passed in.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from dshim.harness.base import Harness
from tests.helpers import Rig, open_rig

FAKE_AGENT = [sys.executable, "-m", "dshim.testing.fakes.acp_agent"]


@asynccontextmanager
async def open_harness_rig(
    data_dir: Path,
    *,
    harness: Harness,
    harness_cfg: dict[str, Any] | None = None,
    **options: Any,
) -> AsyncIterator[Rig]:
    """:func:`tests.helpers.open_rig` with a required harness instance."""
    async with open_rig(data_dir, harness=harness, harness_cfg=harness_cfg, **options) as rig:
        yield rig


async def wait_until(predicate: Callable[[], bool], *, poll_s: float = 0.01) -> None:
    """Poll until ``predicate()`` holds (callers bound it with ``trio.fail_after``).

    Polling on purpose: the conditions are about what the recording outbound or a fake
    server saw, which offer no event to wait on.
    """
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(poll_s)


def sent_containing(rig: Rig, needle: str) -> list[str]:
    return [t for t in rig.texts if needle in t]
