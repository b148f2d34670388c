"""Supervision and shutdown of bots, with a scripted channel module (no platform)."""

from __future__ import annotations

import functools
import random
from pathlib import Path
from typing import Any

import msgspec
import trio
from structlog.testing import capture_logs

from dshim.channels.base import BotHost, ProbeRows, ReplayAdapter, ReplaySource
from dshim.channels.registry import parse_config
from dshim.config import Config
from dshim.errors import AuthError, TransportError
from dshim.serve import (
    PRUNE_FIRST_S,
    PRUNE_INTERVAL_S,
    ServeHost,
    classify_failure,
    prune_periodically,
    serve_bots,
    supervise_bot,
)
from dshim.store import open_store
from dshim.testing.outbound import RecordingOutbound
from tests.helpers import Clock, msg


class ScriptedChannel:
    """A channel whose runs fail as scripted, then serve messages from a memory channel."""

    key = "telegram"
    settings = msgspec.Struct

    def __init__(self, failures: list[BaseException] | None = None) -> None:
        self.failures = list(failures or [])
        self.starts = 0
        self.send, self.recv = trio.open_memory_channel[Any](100)
        self.outbound: RecordingOutbound | None = None
        self.up = trio.Event()

    def replay_adapter(self, fx: ReplaySource) -> ReplayAdapter:
        raise NotImplementedError

    async def probe(self, rows: ProbeRows) -> None:
        raise NotImplementedError

    async def run(
        self, ctx: BotHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        self.starts += 1
        if self.failures:
            raise self.failures.pop(0)
        self.outbound = RecordingOutbound(clock=ctx.clock)
        async with ctx.open_runtime(outbound=self.outbound, bot_id="100") as rt:
            task_status.started()
            self.up.set()

            async def reader() -> None:
                async for m in self.recv:
                    await rt.accept(m)

            await ctx.serve(rt, reader)


def config(*names: str) -> Config:
    return parse_config(
        {"bots": [{"name": n, "channel": "telegram"} for n in names]},
        env={},
        channel_settings=False,
    )


def test_classify_failure() -> None:
    assert classify_failure(AuthError("bad token", status=401)) == "fatal"
    assert classify_failure(TransportError("reset")) == "transient"
    assert classify_failure(TypeError("bug")) == "bug"
    assert classify_failure(ExceptionGroup("g", [TransportError("x"), AuthError("y")])) == "fatal"


async def test_transient_failures_restart_with_backoff(
    autojump_clock: object, tmp_path: Path
) -> None:
    ch = ScriptedChannel([TransportError("connection reset"), TransportError("connection reset")])
    cfg = config("a")
    shutdown = trio.Event()
    async with open_store(tmp_path, inline=True) as store:
        ctx = ServeHost(config=cfg, bot=cfg.bots[0], store=store, shutdown=shutdown, clock=Clock())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervise_bot, ch, ctx)
            t0 = trio.current_time()
            await ch.up.wait()
            elapsed = trio.current_time() - t0
            await ch.send.send(msg("after restarts"))
            await trio.sleep(1)
            shutdown.set()
    assert ch.starts == 3
    assert 2.0 <= elapsed <= 4.5  # 1 s then 2 s, jitter ±50 %, never under 1 s
    assert ch.outbound is not None and ch.outbound.sent[0].text.endswith("after restarts")


async def test_fatal_error_stops_only_that_bot(autojump_clock: object, tmp_path: Path) -> None:
    bad = ScriptedChannel([AuthError("Unauthorized", status=401)])
    good = ScriptedChannel()
    cfg = config("bad", "good")
    shutdown = trio.Event()
    async with open_store(tmp_path, inline=True) as store:
        with capture_logs() as logs:
            async with trio.open_nursery() as nursery:
                results: dict[str, str] = {}

                async def run() -> None:
                    results.update(
                        await serve_bots(
                            cfg,
                            store,
                            shutdown=shutdown,
                            channels={"bad": bad, "good": good},
                            clock=Clock(),
                        )
                    )

                nursery.start_soon(run)
                await trio.sleep(60)
                await good.send.send(msg("still served"))
                await trio.sleep(1)
                shutdown.set()
    assert bad.starts == 1  # no retry loop for bad credentials
    assert results == {"bad": "fatal", "good": "shutdown"}
    assert good.outbound is not None and good.outbound.sent[0].text.endswith("still served")
    assert any(e["event"] == "bot_stopped_fatal" for e in logs)


async def test_bug_is_not_retried_quietly(autojump_clock: object, tmp_path: Path) -> None:
    ch = ScriptedChannel([TypeError("'NoneType' object is not subscriptable")])
    cfg = config("a")
    async with open_store(tmp_path, inline=True) as store:
        ctx = ServeHost(
            config=cfg, bot=cfg.bots[0], store=store, shutdown=trio.Event(), clock=Clock()
        )
        with capture_logs() as logs:
            result = await supervise_bot(ch, ctx)
    assert result == "bug" and ch.starts == 1
    assert any(e["event"] == "bot_crashed_bug" and e["log_level"] == "error" for e in logs)


async def test_shutdown_stops_reading_and_lets_the_running_turn_finish(
    autojump_clock: object, tmp_path: Path
) -> None:
    ch = ScriptedChannel()
    cfg = config("a")
    shutdown = trio.Event()
    async with open_store(tmp_path, inline=True) as store:
        ctx = ServeHost(config=cfg, bot=cfg.bots[0], store=store, shutdown=shutdown, clock=Clock())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(supervise_bot, ch, ctx)
            await ch.up.wait()
            await ch.send.send(msg("echo:slow 8"))
            await trio.sleep(0.2)
            shutdown.set()
            await trio.sleep(0.01)
            ch.send.send_nowait(msg("after the signal"))  # not read any more
        assert ch.outbound is not None
        assert ch.outbound.sent[0].text.endswith("echo:slow 8")  # finished within the grace
        assert len(ch.outbound.sent) == 1


class NeverStarts(ScriptedChannel):
    """Keeps retrying its start-up (an unreachable platform): never reports started."""

    async def run(
        self, ctx: BotHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        self.starts += 1
        self.attempts = 0
        while True:
            self.attempts += 1  # the platform does not answer; the next attempt in 5 s
            await trio.sleep(5)


async def test_shutdown_stops_a_bot_still_retrying_its_start_at_once(
    autojump_clock: object, tmp_path: Path
) -> None:
    ch = NeverStarts()
    cfg = config("a")
    shutdown = trio.Event()
    async with open_store(tmp_path, inline=True) as store:
        host = ServeHost(config=cfg, bot=cfg.bots[0], store=store, shutdown=shutdown, clock=Clock())
        results: list[str] = []
        ended = trio.Event()

        async def run() -> None:
            results.append(await supervise_bot(ch, host))
            ended.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await trio.sleep(12)
            shutdown.set()
            t0 = trio.current_time()
            with trio.move_on_after(60):
                await ended.wait()
            waited = trio.current_time() - t0
            nursery.cancel_scope.cancel()
    assert results == ["shutdown"] and waited < 0.1
    assert ch.starts == 1 and ch.attempts == 3


class StartsThenFails(ScriptedChannel):
    """Authenticates, reports started, then fails at once (an event that kills the reader)."""

    def __init__(self) -> None:
        super().__init__()
        self.started_at: list[float] = []

    async def run(
        self, ctx: BotHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        self.started_at.append(trio.current_time())
        task_status.started()
        raise RecursionError("maximum recursion depth exceeded while deserializing an object")


async def test_a_bot_that_fails_right_after_starting_backs_off_ever_longer(
    autojump_clock: object, tmp_path: Path
) -> None:
    ch = StartsThenFails()
    cfg = config("a")
    shutdown = trio.Event()
    async with open_store(tmp_path, inline=True) as store:
        host = ServeHost(config=cfg, bot=cfg.bots[0], store=store, shutdown=shutdown, clock=Clock())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(supervise_bot, ch, host, rng=random.Random(5)))
            await trio.sleep(120)
            shutdown.set()
    gaps = [b - a for a, b in zip(ch.started_at, ch.started_at[1:], strict=False)]
    assert len(ch.started_at) <= 9  # 1, 2, 4, 8, 16, 30, 30 ... s: never a tight loop
    assert all(gap >= 1.0 for gap in gaps)
    assert gaps[3] > gaps[0] and max(gaps) >= 15  # (jitter pinned: the same gaps every run)


async def test_the_store_is_swept_a_minute_after_start_and_then_hourly(
    autojump_clock: object, tmp_path: Path
) -> None:
    """Dedup keys past their TTL do not pile up in a long-running process."""
    async with open_store(tmp_path, inline=True) as store:
        clock = Clock()

        async def kept() -> list[str]:  # seen as of time 0: whatever has a row at all
            return [k for k in ("old", "new") if await store.seen("bot", "c1", k, now=0.0)]

        assert await store.accept("bot", "c1", "old", now=clock(), ttl_s=30.0, raw=None)
        assert await store.accept("bot", "c1", "new", now=clock(), ttl_s=7200.0, raw=None)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(prune_periodically, store, clock)
            await trio.sleep(PRUNE_FIRST_S - 1)
            assert await kept() == ["old", "new"]  # nothing swept during start-up
            await trio.sleep(2)
            assert await kept() == ["new"]  # the expired key is gone, the live one stays
            await trio.sleep(PRUNE_INTERVAL_S)
            assert await kept() == ["new"]  # an hour and a minute: it lives for two hours
            await trio.sleep(PRUNE_INTERVAL_S)
            assert await kept() == []
            nursery.cancel_scope.cancel()
