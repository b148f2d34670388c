"""What the per-channel benches (``scripts/bench_<channel>.py``) share: the figures of one
measured run over repetitions, the meter of one run, and the table they print.

Every channel bench measures the same four runs against its fake in its own process —
the floor, dshim's reader + mapping, the floor + one durable SQLite insert per event, and
dshim's reader + mapping + pipeline steps 1-6 — and prints them the same way.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import trio
import trio_websocket

__all__ = ["Meter", "Run", "measure_four", "print_four_runs", "steps_1_to_6"]


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


def print_four_runs(
    runs: Sequence[Run],
    *,
    unit: str,
    count: int,
    repeat: int,
    versions: str = "",
    notes: Sequence[str] = (),
    peers: Sequence[Run] = (),
) -> None:
    """The environment line, ``notes`` (e.g. decode costs), and the table of the four runs
    (floor, reader, floor + dedup, pipeline) and any ``peers`` (other stacks against the
    same fake): events/s, CPU ms per event with its spread, and the CPU ratio of the
    reader and the peers to the floor and of the pipeline to the floor + dedup."""
    extra = f", {versions}" if versions else ""
    print(
        f"python {sys.version.split()[0]}, trio {trio.__version__}, trio-websocket "
        f"{trio_websocket.__version__}, msgspec {msgspec.__version__}{extra}, "
        f"nproc {os.cpu_count()}; {count} {unit}s x {repeat} runs, median (min-max)"
    )
    for note in notes:
        print(note)
    rows = [*runs, *peers]
    width = max(52, *(len(r.name) for r in rows))
    print(
        f"{'run':{width}} {unit + 's/s':>14} {'CPU ms/' + unit:>18} {'(min-max)':>13} {'vs floor':>9}"
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
    from dshim.config import parse_config
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


async def measure_four(
    n: int,
    repeat: int,
    *,
    names: Sequence[str],
    floor: Measured,
    reader: Measured,
    pipeline: Measured,
) -> list[Run]:
    """The four runs, ``repeat`` times each, interleaved: ``floor(n)``, ``reader(n)``,
    ``floor(n, db)`` (with one durable insert per event) and ``pipeline(n, store_dir)``."""
    runs = [Run(name, n) for name in names]
    with tempfile.TemporaryDirectory(prefix="dshim-bench-") as d:
        for rep in range(repeat):
            with trio.fail_after(600):
                runs[0].add(*await floor(n))
                runs[1].add(*await reader(n))
                runs[2].add(*await floor(n, Path(d) / f"floor-{rep}.sqlite3"))
                runs[3].add(*await pipeline(n, Path(d) / f"store-{rep}"))
    return runs
