"""Test support for the harness adapters: a pipeline rig with a [harness] section, and waits.

Like :func:`tests.helpers.open_rig` (a runtime on a real SQLite file with a recording
outbound), but the configuration gets a ``[harness]`` table too, so interaction timeouts
and the like are the real configuration path.  The harness instance is passed in.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from dshim.config import parse_config
from dshim.harness.base import Harness
from dshim.pipeline.runtime import open_bot_runtime
from dshim.store import open_store
from dshim.store.base import Store
from dshim.testing.outbound import RecordingOutbound
from tests.helpers import BOT_ID, Clock, Events, Rig

FAKE_AGENT = [sys.executable, "-m", "dshim.testing.fakes.acp_agent"]


@asynccontextmanager
async def open_harness_rig(
    data_dir: Path,
    *,
    harness: Harness,
    harness_cfg: dict[str, Any] | None = None,
    store: Store | None = None,
    inline: bool = True,
    **bot_options: Any,
) -> AsyncIterator[Rig]:
    config = parse_config(
        {
            "harness": harness_cfg or {},
            "bots": [{"name": "t", "channel": "telegram", **bot_options}],
        },
        env={},
    )
    clock = Clock()
    events = Events()
    out = RecordingOutbound(clock=clock, bot_username="dshim_bot")
    async with AsyncExitStack() as stack:
        st = (
            store
            if store is not None
            else await stack.enter_async_context(open_store(data_dir, inline=inline))
        )
        rt = await stack.enter_async_context(
            open_bot_runtime(
                config=config,
                bot=config.bots[0],
                bot_id=BOT_ID,
                store=st,
                outbound=out,
                harness=harness,
                clock=clock,
                observer=events,
            )
        )
        yield Rig(rt, out, events, st, clock)


async def wait_until(predicate: Callable[[], bool], *, poll_s: float = 0.01) -> None:
    """Poll until ``predicate()`` holds (callers bound it with ``trio.fail_after``).

    Polling on purpose: the conditions are about what the recording outbound or a fake
    server saw, which offer no event to wait on.
    """
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(poll_s)


def sent_containing(rig: Rig, needle: str) -> list[str]:
    return [t for t in rig.texts if needle in t]
