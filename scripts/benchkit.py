"""What the per-channel benches (``scripts/bench_<channel>.py``) share: the fake in its own
process, the argument parser, the figures of one measured run over repetitions, the meter
of one run, the floor's websocket and durable dedup, dshim's reader and pipeline runs, the
decode-cost loops and the table they print.

Every channel bench against a websocket fake measures the same four runs in its own
process — the floor, dshim's reader + mapping, the floor + one durable SQLite insert per
event, and dshim's reader + mapping + pipeline steps 1-6 — and prints them the same way.
The benches over a recorded stream (Telegram, WeChat, WhatsApp) share the runtime whose
turn is a no-op and whose accepts count the verdicts, their figures and their first line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import trio

__all__ = [
    "Figures",
    "FloorDedup",
    "Meter",
    "Run",
    "argument_parser",
    "counting_runtime",
    "gateway_decode_costs",
    "micros",
    "open_fake",
    "open_floor_dedup",
    "open_floor_websocket",
    "print_four_runs",
    "print_stream_line",
    "reader_and_pipeline",
    "run_four",
    "steps_1_to_6",
    "until_counted",
]

#: What a channel's reader hands to the bench (a dispatch, an envelope, ...), and its mapper.
E = TypeVar("E")
M = TypeVar("M")


class Run:
    """One run's wall and CPU times over the repetitions (median, spread)."""

    def __init__(self, name: str, n: int) -> None:
        self.name = name
        self.n = n
        self.walls: list[float] = []
        self.cpus: list[float] = []

    def add(self, wall: float, cpu: float) -> None:
        self.walls.append(wall)
        self.cpus.append(cpu)

    @property
    def rate(self) -> float:
        return self.n / statistics.median(self.walls)

    @property
    def cpu_ms(self) -> float:
        return statistics.median(self.cpus) * 1000 / self.n

    def spread(self) -> str:
        per = [c * 1000 / self.n for c in self.cpus]
        return f"{min(per):.3f}-{max(per):.3f}"


class Meter:
    """Wall and CPU from the first event (``start``) to the n-th handled one (``tick``)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.count = 0
        self.done = trio.Event()
        self.w0 = self.c0 = 0.0
        self.wall = self.cpu = 0.0

    def start(self) -> None:
        if not self.w0:
            self.w0, self.c0 = time.perf_counter(), time.process_time()

    def tick(self) -> None:
        self.count += 1
        if self.count == self.n:
            self.wall = time.perf_counter() - self.w0
            self.cpu = time.process_time() - self.c0
            self.done.set()


def plural(unit: str) -> str:
    """``dispatches``, ``messages``: the unit's plural in the tables."""
    return unit + ("es" if unit.endswith(("s", "sh", "ch")) else "s")


def print_four_runs(
    runs: Sequence[Run],
    *,
    unit: str,
    versions: str = "",
    notes: Sequence[str] = (),
    peers: Sequence[Run] = (),
) -> None:
    """The environment line, ``notes`` (e.g. decode costs), and the table of the four runs
    (floor, reader, floor + dedup, pipeline; a ``unit`` each) and any ``peers`` (other
    stacks against the same fake): events/s, CPU ms per event with its spread, and the CPU
    ratio of the reader and the peers to the floor and of the pipeline to the floor + dedup."""
    # Imported here, not at the top: the recorded-stream benches (which never print this
    # table) measure slower after importing trio-websocket, at small sizes.
    import trio_websocket

    extra = f", {versions}" if versions else ""
    print(
        f"python {sys.version.split()[0]}, trio {trio.__version__}, trio-websocket "
        f"{trio_websocket.__version__}, msgspec {msgspec.__version__}{extra}, "
        f"nproc {os.cpu_count()}; {runs[0].n} {plural(unit)} x {len(runs[0].walls)} runs, "
        "median (min-max)"
    )
    for note in notes:
        print(note)
    rows = [*runs, *peers]
    width = max(52, *(len(r.name) for r in rows))
    print(
        f"{'run':{width}} {plural(unit) + '/s':>14} {'CPU ms/' + unit:>18} {'(min-max)':>13} "
        f"{'vs floor':>9}"
    )
    for r in rows:
        base = runs[2] if r is runs[3] else runs[0]
        ratio = r.cpu_ms / base.cpu_ms
        print(f"{r.name:{width}} {r.rate:14.0f} {r.cpu_ms:18.3f} {r.spread():>13} {ratio:8.2f}x")
    print("(vs floor: reader runs against the floor, the pipeline run against floor + dedup)")


@asynccontextmanager
async def steps_1_to_6(channel: str, bot_id: str, n: int, store_dir: Path) -> AsyncIterator[Any]:
    """A bot runtime on a real store in ``store_dir`` whose turns (step 7) do nothing, so
    only steps 1-6 are measured; room for ``n`` queued events.  Yields the runtime (its
    ``accept``), and waits until every accepted event was taken off its lane."""
    from dshim.channels.registry import parse_config
    from dshim.harness.echo import EchoHarness
    from dshim.pipeline.runtime import open_bot_runtime
    from dshim.store import open_store
    from dshim.testing.outbound import RecordingOutbound

    config = parse_config(
        {"bots": [{"name": "bench", "channel": channel, "lanes": {"max_queue": n + 10}}]},
        env={},
        channel_settings=False,
    )
    async with open_store(store_dir) as store:
        async with open_bot_runtime(
            config=config,
            bot=config.bots[0],
            bot_id=bot_id,
            store=store,
            outbound=RecordingOutbound(clock=time.time),
            harness=EchoHarness(),
        ) as rt:

            async def nothing(item: Any, lane: Any) -> None:
                rt._done()

            rt.lanes._handler = nothing
            yield rt
            await rt.wait_idle()


Measured = Callable[..., Awaitable[tuple[float, float]]]


def run_four(
    env: dict[str, Any],
    n: int,
    repeat: int,
    *,
    unit: str,
    names: tuple[str, str],
    floor: Measured,
    reader: Measured,
    pipeline: Measured,
) -> list[Run]:
    """The four runs over ``n`` events (a ``unit`` each) against the fake's ``env``, in a trio
    run with dshim logging errors only, ``repeat`` times each, interleaved:
    ``floor(env, n)`` and ``reader(env, n)`` (named by ``names``), ``floor(env, n, db)``
    (with one durable insert per event) and ``pipeline(env, n, store_dir)``."""
    from dshim.log import configure_logging

    runs = [
        Run(names[0], n),
        Run(names[1], n),
        Run(f"floor + durable dedup (one SQLite INSERT/{unit})", n),
        Run("dshim reader + mapping + pipeline steps 1-6", n),
    ]

    async def measure() -> None:
        configure_logging("error", "json")
        with tempfile.TemporaryDirectory(prefix="dshim-bench-") as d:
            for rep in range(repeat):
                with trio.fail_after(600):
                    runs[0].add(*await floor(env, n))
                    runs[1].add(*await reader(env, n))
                    runs[2].add(*await floor(env, n, Path(d) / f"floor-{rep}.sqlite3"))
                    runs[3].add(*await pipeline(env, n, Path(d) / f"store-{rep}"))

    trio.run(measure)
    return runs


# -- the fake, the parser -------------------------------------------------------------------


@contextmanager
def open_fake(module: str, flood: int) -> Iterator[dict[str, Any]]:
    """The fake ``python -m <module> --flood <flood>`` in its own process; yields the JSON
    line it prints first (its URLs and credentials) and ends it on exit."""
    fake = [sys.executable, "-m", module, "--flood", str(flood), "--lifetime", "900"]
    proc = subprocess.Popen(fake, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield json.loads(proc.stdout.readline())
    finally:
        proc.terminate()
        proc.wait(timeout=10)


#: The first two runs of a gateway bench (Discord, QQ).
GATEWAY_RUNS = (
    "floor (trio-websocket + json.loads + dict mapping)",
    "dshim gateway reader + mapping",
)


def fake_bench(
    fake: str,
    n: int,
    repeat: int,
    *,
    unit: str,
    names: tuple[str, str],
    floor: Measured,
    reader: Measured,
    pipeline: Measured,
    notes: Callable[[dict[str, Any]], list[str]] | None = None,
    versions: str = "",
) -> list[Run]:
    """The four runs over ``n`` events against the fake ``fake`` (a module, flooding ``n``
    after every connection) ``repeat`` times, printed with ``notes(env)`` (decode costs)
    above the table; the runs."""
    with open_fake(fake, n) as env:
        runs = run_four(
            env, n, repeat, unit=unit, names=names, floor=floor, reader=reader, pipeline=pipeline
        )
    print_four_runs(runs, unit=unit, versions=versions, notes=notes(env) if notes else [])
    return runs


def gateway_bench(
    fake: str,
    args: argparse.Namespace,
    *,
    floor: Measured,
    reader: Measured,
    pipeline: Measured,
    decode_costs: Callable[[dict[str, Any]], str],
) -> list[Run]:
    """A gateway's four runs over ``args.dispatches`` against the fake ``fake`` (a module),
    printed with the decode costs; the runs."""
    import httpx

    return fake_bench(
        fake,
        args.dispatches,
        args.repeat,
        unit="dispatch",
        names=GATEWAY_RUNS,
        floor=floor,
        reader=reader,
        pipeline=pipeline,
        notes=lambda env: [decode_costs(env)],
        versions=f"httpx {httpx.__version__}",
    )


def argument_parser(doc: str, count: str) -> argparse.ArgumentParser:
    """The parser of a channel bench: its docstring as the help, ``count`` (e.g.
    ``--dispatches``, default 5000) and ``--repeat`` (default 3)."""
    parser = argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(count, type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    return parser


# -- the floor's websocket and dedup, dshim's reader ----------------------------------------


def open_floor_websocket(url: str, options: Any) -> AbstractAsyncContextManager[Any]:
    """The floor's trio-websocket connection to ``url`` with the channel's own websocket
    ``options`` (a ``WsOptions``: the same message queue, message size and receive buffer
    as dshim's reader)."""
    import trio_websocket  # not at the top: see print_four_runs

    return trio_websocket.open_websocket_url(
        url,
        message_queue_size=options.message_queue_size,
        max_message_size=options.max_message_size,
        receive_buffer_size=options.receive_buffer_size,
    )


class FloorDedup:
    """The least a *durable* reader adds to the floor: one SQLite ``INSERT OR IGNORE`` of the
    dedup key and the raw event per event, on a worker thread, WAL, synchronous=NORMAL."""

    def __init__(self, db: Path, key: Sequence[str]) -> None:
        self._conn = sqlite3.connect(db, check_same_thread=False, isolation_level=None)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        columns = "".join(f"{k} TEXT, " for k in key)
        self._conn.execute(
            f"CREATE TABLE dedup ({columns}raw BLOB, PRIMARY KEY ({', '.join(key)}))"
        )
        self._sql = f"INSERT OR IGNORE INTO dedup VALUES ({'?, ' * len(key)}?)"
        self._limiter = trio.CapacityLimiter(1)

    def _insert(self, row: tuple[str | bytes, ...]) -> int:
        return self._conn.execute(self._sql, row).rowcount

    async def insert(self, *row: str | bytes) -> None:
        """The key's values, then the raw event."""
        await trio.to_thread.run_sync(self._insert, row, limiter=self._limiter)

    def close(self) -> None:
        self._conn.close()


@contextmanager
def open_floor_dedup(
    db: Path | None, key: Sequence[str] = ("conv", "mid")
) -> Iterator[FloorDedup | None]:
    """A :class:`FloorDedup` in ``db`` keyed by ``key``, or None (the plain floor)."""
    if db is None:
        yield None
        return
    dedup = FloorDedup(db, key)
    try:
        yield dedup
    finally:
        dedup.close()


async def until_counted(meter: Meter, run: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    """``run`` (a reader that runs until cancelled) until ``meter`` counted its n events;
    the meter's wall and CPU."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await meter.done.wait()
        nursery.cancel_scope.cancel()
    return meter.wall, meter.cpu


Read = Callable[
    [dict[str, Any], int, Callable[[E, M], Awaitable[None]]], Awaitable[tuple[float, float]]
]


def reader_and_pipeline(
    read: Read[E, M],
    *,
    channel: str,
    bot_id: Callable[[dict[str, Any]], str],
    decode: Callable[[E, M], Any],
    raw: Callable[[E], bytes],
) -> tuple[Measured, Measured]:
    """dshim's two runs over ``read(env, n, handle)`` (the channel's reader calling
    ``handle(event, mapper)`` per event until n were handled): the reader + mapping
    (``decode(event, mapper)`` must be an ``InboundMessage``), and the reader + mapping +
    :func:`steps_1_to_6` (every event, stored as ``raw(event)``, accepted)."""
    from dshim.model import InboundMessage

    async def reader(env: dict[str, Any], n: int) -> tuple[float, float]:
        async def handle(event: E, mapper: M) -> None:
            item = decode(event, mapper)
            assert isinstance(item, InboundMessage), item

        return await read(env, n, handle)

    async def pipeline(env: dict[str, Any], n: int, tmp: Path) -> tuple[float, float]:
        async with steps_1_to_6(channel, bot_id(env), n, tmp) as rt:

            async def handle(event: E, mapper: M) -> None:
                verdict = await rt.accept(decode(event, mapper), raw(event))
                assert verdict.accepted, verdict

            return await read(env, n, handle)

    return reader, pipeline


# -- decode costs ---------------------------------------------------------------------------


def micros(fn: Callable[[], object], k: int = 20000) -> float:
    """Mean µs per call of ``fn`` over ``k`` calls."""
    t0 = time.perf_counter()
    for _ in range(k):
        fn()
    return (time.perf_counter() - t0) / k * 1e6


def gateway_decode_costs(raw: bytes, what: str, models: Any, mapper: Any) -> str:
    """The decode-cost line of a gateway bench for one flooded frame ``raw`` (a ``what``):
    the envelope and the message view (the channel's ``models.frame_decoder``, its ``d``
    left raw, then ``models.message_decoder``), the same + mapping to ``InboundMessage``
    (``mapper.decode_frame``), and json.loads alone."""
    views = micros(lambda: models.message_decoder.decode(models.frame_decoder.decode(raw).d))
    mapped = micros(lambda: mapper.decode_frame(raw))
    loads = micros(lambda: json.loads(raw))
    return (
        f"decode of one {len(raw)}-byte {what}: msgspec envelope+view {views:.1f} µs, "
        f"+ mapping to InboundMessage {mapped:.1f} µs; json.loads alone {loads:.1f} µs"
    )


# -- the recorded-stream benches ------------------------------------------------------------


@asynccontextmanager
async def counting_runtime(
    channel: str,
    bot_id: str,
    store: Any,
    *,
    clock: Callable[[], float],
    max_queue: int = 10_000,
    bot_username: str | None = None,
) -> AsyncIterator[tuple[Any, dict[str, int]]]:
    """A bot ``bench`` on ``store`` (no backlog limit, nothing restored) whose lanes stay
    real (step 6: bounded queues, workers) and whose turn (step 7) only marks the inbox row
    done; its ``accept`` and ``accept_many`` count the verdicts.  Yields the runtime and
    the counts."""
    from dshim.channels.registry import parse_config
    from dshim.harness.echo import EchoHarness
    from dshim.pipeline.lanes import LaneSet
    from dshim.pipeline.runtime import open_bot_runtime
    from dshim.testing.outbound import RecordingOutbound

    config = parse_config(
        {"bots": [{"name": "bench", "channel": channel, "backlog_max_age_s": 10**9}]},
        env={},
        channel_settings=False,
    )
    bot = config.bots[0]
    verdicts: dict[str, int] = {}
    async with open_bot_runtime(
        config=config,
        bot=bot,
        bot_id=bot_id,
        store=store,
        outbound=RecordingOutbound(clock=time.time, bot_username=bot_username),
        harness=EchoHarness(),
        clock=clock,
        restore=False,
    ) as rt:

        async def no_turn(item: Any, lane: Any) -> None:
            for conv, mid in item.inbox_keys:
                await store.inbox_done(bot.name, conv, mid)
            rt._done()

        rt.lanes = LaneSet(rt._nursery, no_turn, max_queue=max_queue, idle_exit_s=600)
        accept, accept_many = rt.accept, rt.accept_many

        def count(verdict: Any) -> Any:
            key = "accepted" if verdict.accepted else str(verdict.reason)
            verdicts[key] = verdicts.get(key, 0) + 1
            return verdict

        async def counting_accept(item: Any, raw: bytes | None = None) -> Any:
            return count(await accept(item, raw))

        async def counting_accept_many(events: Any) -> Any:  # a batch (Telegram's pages)
            return [count(v) for v in await accept_many(events)]

        rt.accept = counting_accept  # type: ignore[method-assign]
        rt.accept_many = counting_accept_many  # type: ignore[method-assign]
        yield rt, verdicts


class Figures(dict[str, tuple[list[float], list[float]]]):
    """A recorded-stream bench's figures: each path's rates and CPU ms per item over the
    repetitions, in the order the paths were first added."""

    def add(self, name: str, rate: float, cpu: float) -> None:
        rates, cpus = self.setdefault(name, ([], []))
        rates.append(rate)
        cpus.append(cpu)


def print_stream_line(
    script: str, what: str, sizes: Sequence[int], *, where: str = "", versions: str = ""
) -> None:
    """The first line of a recorded-stream bench: how many ``what`` and their sizes,
    ``where`` (e.g. ``"fake in its own process; "``), then the environment and
    ``versions`` (e.g. ``"; httpx 0.28.1"``)."""
    print(
        f"# {script}: {len(sizes):,} {what}, {statistics.mean(sizes) / 1024:.2f} KB mean "
        f"({min(sizes)}-{max(sizes)} B); {where}nproc {os.cpu_count()}; "
        f"Python {platform.python_version()}; msgspec {msgspec.__version__}; trio {trio.__version__}"
        f"{versions}"
    )
