"""The kit's long-poll loop: events in order, a durable cursor never past an unaccepted
event, and failures that back off instead of spinning.

The loop runs against a scripted source (what each poll returns or raises) and the real
SQLite store; the pipeline side is a recording ``Inbound`` whose verdicts the test picks.
Everything runs on trio's autojump clock, so backoffs take no real time and their lengths
are exact trio times.
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import structlog
import trio

from dshim.channels.kit import Backoff
from dshim.channels.kit.poll import (
    CURSOR_WRITE_DEADLINE_S,
    PollBatch,
    PollEvent,
    accept_batch,
    run_poll_loop,
)
from dshim.errors import AuthError, Conflict, FatalChannelError, RateLimited, TransportError
from dshim.model import InboundMessage, Skip, Verdict
from dshim.store import open_store
from dshim.store.base import BoundStore

CURSOR = "test.cursor"

Step = PollBatch | Exception


def event(n: int, cursor: str | None = None) -> PollEvent:
    return PollEvent(Skip(reason="ignored", message_id=str(n)), f"raw{n}".encode(), cursor)


class Source:
    """Answers each poll with the next scripted step; then waits forever (a quiet chat)."""

    def __init__(self, *steps: Step) -> None:
        self.steps = list(steps)
        self.polls: list[tuple[float, str | None]] = []

    async def poll(self, cursor: str | None) -> PollBatch:
        self.polls.append((trio.current_time(), cursor))
        if not self.steps:
            await trio.sleep_forever()
        step = self.steps.pop(0)
        if isinstance(step, Exception):
            raise step
        return step

    def gaps(self) -> list[float]:
        times = [t for t, _ in self.polls]
        return [b - a for a, b in zip(times, times[1:], strict=False)]


class Pipeline:
    """Records what it was handed; ``verdict`` decides per raw."""

    def __init__(self, verdict: Callable[[bytes | None], Verdict] | None = None) -> None:
        self.seen: list[bytes | None] = []
        self.verdict = verdict or (lambda raw: Verdict(True))
        self.gate: trio.Event | None = None

    async def accept(self, item: InboundMessage | Skip, raw: bytes | None = None) -> Verdict:
        self.seen.append(raw)
        if self.gate is not None and raw == b"raw3":
            await self.gate.wait()
        await trio.lowlevel.checkpoint()
        return self.verdict(raw)


@asynccontextmanager
async def bound_store(tmp_path: Path) -> AsyncIterator[BoundStore]:
    async with open_store(tmp_path, inline=True) as store:
        yield BoundStore(store, "bot")


async def run_until_idle(
    source: Source, pipeline: Pipeline, store: BoundStore, *, seconds: float = 600
) -> None:
    with trio.move_on_after(seconds):
        await run_poll_loop(
            source, pipeline, store, cursor_name=CURSOR, backoff=Backoff(rng=random.Random(3))
        )


async def test_events_go_in_order_and_the_cursor_follows_each_accepted_one(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with bound_store(tmp_path) as store:
        await store.set_cursor(CURSOR, "10")
        source = Source(
            PollBatch([event(1, "11"), event(2, "12")]),
            PollBatch([event(3, "13")]),
        )
        pipeline = Pipeline()
        await run_until_idle(source, pipeline, store)
        assert pipeline.seen == [b"raw1", b"raw2", b"raw3"]
        # Each poll asks from what was confirmed before it; the store holds the last one.
        assert [c for _, c in source.polls] == ["10", "12", "13"]
        assert await store.get_cursor(CURSOR) == "13"
        assert source.gaps() == [0, 0]  # answered polls are followed at once


async def test_a_shutdown_verdict_stops_without_confirming_that_event(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with bound_store(tmp_path) as store:
        source = Source(PollBatch([event(1, "a"), event(2, "b"), event(3, "c")], cursor="end"))
        pipeline = Pipeline(
            lambda raw: Verdict(False, "shutdown") if raw == b"raw2" else Verdict(True)
        )
        with trio.fail_after(5):
            await run_poll_loop(source, pipeline, store, cursor_name=CURSOR)  # returns
        assert pipeline.seen == [b"raw1", b"raw2"]  # nothing after the refused event
        assert await store.get_cursor(CURSOR) == "a"  # confirms only the first


async def test_dropped_events_are_confirmed_too(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with bound_store(tmp_path) as store:
        source = Source(PollBatch([event(1, "a"), event(2, "b")]))
        pipeline = Pipeline(lambda raw: Verdict(False, "malformed"))
        await run_until_idle(source, pipeline, store)
        assert await store.get_cursor(CURSOR) == "b"


async def test_a_batch_cursor_moves_only_once_every_event_is_confirmed(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """WeChat iLink style: one opaque cursor per response, none per event."""
    async with bound_store(tmp_path) as store:
        source = Source(
            PollBatch([event(1), event(2)], cursor="buf-1"),
            PollBatch([], cursor="buf-2"),  # no messages, but a new cursor: kept
            PollBatch([event(3), event(4)], cursor="buf-3"),
        )
        pipeline = Pipeline(
            lambda raw: Verdict(False, "shutdown") if raw == b"raw4" else Verdict(True)
        )
        with trio.fail_after(5):
            await run_poll_loop(source, pipeline, store, cursor_name=CURSOR)
        assert [c for _, c in source.polls] == [None, "buf-1", "buf-2"]
        assert await store.get_cursor(CURSOR) == "buf-2"  # event 4 was refused: not buf-3


async def test_progress_is_persisted_when_shutdown_cancels_mid_batch(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with bound_store(tmp_path) as store:
        source = Source(PollBatch([event(1, "1"), event(2, "2"), event(3, "3"), event(4, "4")]))
        pipeline = Pipeline()
        pipeline.gate = trio.Event()  # event 3 never finishes being accepted
        with trio.move_on_after(10) as scope:
            await run_poll_loop(source, pipeline, store, cursor_name=CURSOR)
        assert scope.cancelled_caught
        assert pipeline.seen == [b"raw1", b"raw2", b"raw3"]
        assert await store.get_cursor(CURSOR) == "2"


class StuckStore(BoundStore):
    async def set_cursor(self, name: str, value: str) -> None:
        await trio.sleep_forever()


async def test_a_stuck_cursor_write_cannot_hold_a_shutdown(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with open_store(tmp_path, inline=True) as raw_store:
        store = StuckStore(raw_store, "bot")
        with structlog.testing.capture_logs() as logs, trio.CancelScope() as scope:
            scope.cancel()  # shutdown already requested: the write is still attempted
            start = trio.current_time()
            await accept_batch(
                Pipeline(), store, PollBatch([]), cursor_name=CURSOR, cursor=None
            )  # nothing moved: no write at all
            await accept_batch(
                Pipeline(), store, PollBatch([], cursor="x"), cursor_name=CURSOR, cursor=None
            )
        assert trio.current_time() - start == pytest.approx(CURSOR_WRITE_DEADLINE_S)
        assert [e["event"] for e in logs] == ["cursor_write_timed_out"]


async def test_failures_back_off_growing_and_honour_retry_after(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with bound_store(tmp_path) as store:
        source = Source(
            TransportError("getUpdates: connection failed"),
            TransportError("getUpdates: HTTP 502", status=502),
            RateLimited("getUpdates: Too Many Requests", retry_after=12),
            Conflict("getUpdates: Conflict (another process is polling this bot)"),
            PollBatch([event(1, "1")]),
            TransportError("getUpdates: timed out"),
        )
        with structlog.testing.capture_logs() as logs:
            await run_until_idle(source, Pipeline(), store)
        gaps = source.gaps()
        assert len(gaps) == 6
        assert all(g >= 1.0 for g in gaps[:4]) and gaps[1] > gaps[0]
        assert gaps[2] >= 12  # retry_after honoured in full
        assert gaps[4] == 0  # the answered poll is followed at once
        assert 1.0 <= gaps[5] <= 1.5  # and reset the backoff
    events = [(e["event"], e["log_level"]) for e in logs]
    assert events == [
        ("poll_failed", "warning"),
        ("poll_failed", "warning"),
        ("rate_limited", "warning"),
        ("poll_conflict", "error"),
        ("poll_failed", "warning"),
    ]
    conflict = next(e for e in logs if e["event"] == "poll_conflict")
    assert "another process is polling" in conflict["error"]


@pytest.mark.parametrize(
    "fatal", [AuthError("getUpdates: Unauthorized"), FatalChannelError("session expired")]
)
async def test_fatal_errors_end_the_loop_at_once(
    autojump_clock: trio.abc.Clock, tmp_path: Path, fatal: Exception
) -> None:
    async with bound_store(tmp_path) as store:
        source = Source(TransportError("first"), fatal)
        with pytest.raises(type(fatal)):
            await run_poll_loop(source, Pipeline(), store, cursor_name=CURSOR)
        assert len(source.polls) == 2


async def test_a_batch_that_confirms_nothing_never_spins(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with bound_store(tmp_path) as store:
        # The platform keeps re-sending events whose ids could not be read.
        stuck = [PollBatch([event(n)]) for n in range(6)]
        filtered = PollBatch([], received=3)  # came back, but none was new
        source = Source(*stuck, filtered, PollBatch([event(9, "9")]))
        with structlog.testing.capture_logs() as logs:
            await run_until_idle(source, Pipeline(), store, seconds=3600)
        gaps = source.gaps()
        assert len(gaps) == 8 and gaps[7] == 0  # the last batch moved the cursor
        assert all(g >= 1.0 for g in gaps[:7])  # never a hot loop
        assert gaps[5] > gaps[0]  # and backing off
        assert sum(e["event"] == "poll_unconfirmed" for e in logs) == 7
        assert await store.get_cursor(CURSOR) == "9"


async def test_a_source_holding_events_back_is_not_stuck(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with bound_store(tmp_path) as store:
        source = Source(
            PollBatch([event(1, "1")], received=3, holding=True),
            PollBatch([], received=2, holding=True),
            PollBatch([event(2, "5")], received=1),
        )
        with structlog.testing.capture_logs() as logs:
            await run_until_idle(source, Pipeline(), store)
        assert source.gaps() == [0, 0, 0]  # the source paces itself while it holds events
        assert not any(e["event"] == "poll_unconfirmed" for e in logs)
        assert await store.get_cursor(CURSOR) == "5"


def test_the_default_backoff_is_one_to_thirty_seconds_with_jitter() -> None:
    backoff = Backoff(rng=random.Random(5))
    delays = [backoff.next_delay() for _ in range(12)]
    assert 1.0 <= delays[0] <= 1.5
    assert all(1.0 <= d <= 30.0 for d in delays) and max(delays) > 15
    assert not math.isclose(delays[3], 8.0)  # jittered, not the bare schedule
