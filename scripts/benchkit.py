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
import time
from collections.abc import Sequence

import msgspec
import trio
import trio_websocket

__all__ = ["Meter", "Run", "print_four_runs"]


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
