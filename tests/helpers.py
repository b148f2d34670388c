"""Shared test helpers: a bot runtime on a real SQLite file with a recording outbound."""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from dshim.channels.registry import parse_config
from dshim.config import Config
from dshim.harness.base import Harness
from dshim.harness.echo import EchoHarness
from dshim.model import InboundMessage, PromptPart, ReplyReference, Skip
from dshim.pipeline.runtime import BotRuntime, open_bot_runtime
from dshim.prompt import prompt_text
from dshim.store import open_store
from dshim.store.base import Store
from dshim.testing.outbound import RecordingOutbound

BOT_ID = "100"
T0 = 1_790_000_000.0  # 2026-09-21, a fixed "now" for messages


class Clock:
    """Epoch clock that follows trio's clock (virtual under autojump)."""

    def __init__(self, start: float = T0) -> None:
        self.start = start
        self.t0 = trio.current_time()

    def __call__(self) -> float:
        return self.start + (trio.current_time() - self.t0)


class Events:
    """Observer recording drops, commands and prompts."""

    def __init__(self) -> None:
        self.drops: list[tuple[str, str]] = []
        self.commands: list[str] = []
        self.prompts: list[str] = []
        self.prompt_msgs: list[InboundMessage] = []

    def on_drop(self, item: InboundMessage | Skip, reason: str) -> None:
        self.drops.append((item.message_id or "", reason))

    def on_command(self, msg: InboundMessage, name: str) -> None:
        self.commands.append(name)

    def on_prompt(self, msg: InboundMessage, parts: list[PromptPart]) -> None:
        self.prompts.append(prompt_text(parts))
        self.prompt_msgs.append(msg)


_counter = 0


def msg(
    content: str = "hello",
    *,
    message_id: str | None = None,
    conversation_id: str = "42",
    conversation_type: str = "direct",
    sender_id: str = "42",
    addressed: bool | None = None,
    reply_to: ReplyReference | None = None,
    received_at: float = T0,
    **kw: Any,
) -> InboundMessage:
    global _counter
    _counter += 1
    return InboundMessage(
        channel="telegram",
        bot_id=BOT_ID,
        message_id=message_id or f"m{_counter}",
        conversation_id=conversation_id,
        conversation_type=conversation_type,  # type: ignore[arg-type]
        sender_id=sender_id,
        addressed=(conversation_type == "direct") if addressed is None else addressed,
        content=content,
        reply_to=reply_to,
        received_at=received_at,
        **kw,
    )


def bot_config(harness_cfg: dict[str, Any] | None = None, **options: Any) -> Config:
    return parse_config(
        {"harness": harness_cfg or {}, "bots": [{"name": "t", "channel": "telegram", **options}]},
        env={},
        channel_settings=False,
    )


class Rig:
    def __init__(
        self, rt: BotRuntime, out: RecordingOutbound, events: Events, store: Store, clock: Clock
    ) -> None:
        self.rt = rt
        self.out = out
        self.events = events
        self.store = store
        self.clock = clock

    @property
    def texts(self) -> list[str]:
        return [s.text for s in self.out.sent]


@asynccontextmanager
async def open_rig(
    data_dir: Path,
    *,
    harness: Harness | None = None,
    inline: bool = True,
    store: Store | None = None,
    restore: bool = True,
    harness_cfg: dict[str, Any] | None = None,
    **options: Any,
) -> AsyncIterator[Rig]:
    """A runtime on a real SQLite file.  ``inline`` keeps SQLite on the trio thread so the
    autojump clock stays deterministic."""
    config = bot_config(harness_cfg, **options)
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
                harness=harness or EchoHarness(),
                clock=clock,
                observer=events,
                restore=restore,
            )
        )
        yield Rig(rt, out, events, st, clock)


def schema_at(conn: sqlite3.Connection, version: int) -> None:
    """Make ``conn``'s database a store as schema ``version`` left it (the migrations up
    to it, and its user_version), for the tests that open an old store."""
    from dshim.store import sqlite as sqlite_store

    for migration in sqlite_store.MIGRATIONS[:version]:
        for statement in migration.statements:
            conn.execute(statement)
    conn.execute(f"PRAGMA user_version = {version}")


async def while_locked_elsewhere(
    call: Callable[[], Awaitable[object]], release: Callable[[], object], *, after_s: float = 0.5
) -> tuple[float, int]:
    """Await ``call()`` while another connection holds a lock that ``release()`` lets go
    ``after_s`` later; returns how long the call waited and how often a 10 ms ticker ran
    on the trio thread meanwhile (a store that waits on its worker thread lets it run)."""
    ticks = 0

    async def ticking() -> None:
        nonlocal ticks
        while True:
            await trio.sleep(0.01)
            ticks += 1

    async def release_later() -> None:
        await trio.sleep(after_s)
        release()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ticking)
            nursery.start_soon(release_later)
            started = trio.current_time()
            await call()
            waited = trio.current_time() - started
            nursery.cancel_scope.cancel()
    return waited, ticks
