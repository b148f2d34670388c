"""Step 6 on its own: :class:`~dshim.pipeline.lanes.LaneSet` — per-lane order, workers
shared between lanes, the idle exit of every lane at its own time.  Trio's autojump clock:
times are exact."""

from __future__ import annotations

from typing import Any

import trio

from dshim.pipeline.lanes import SPARE_WORKERS, Lane, LaneSet


class Recorder:
    """A lane handler that records (lane key, item, trio time) and waits on ``gates``."""

    def __init__(self) -> None:
        self.ran: list[tuple[tuple[str, str], Any, float]] = []
        self.gates: dict[Any, trio.Event] = {}
        self.idle: list[tuple[tuple[str, str], float]] = []

    async def handle(self, item: Any, lane: Lane) -> None:
        gate = self.gates.get(item)
        if gate is not None:
            await gate.wait()
        self.ran.append((lane.key, item, trio.current_time()))

    async def on_idle(self, key: tuple[str, str]) -> None:
        self.idle.append((key, trio.current_time()))


def lanes(nursery: trio.Nursery, rec: Recorder, idle_exit_s: float = 600.0) -> LaneSet:
    return LaneSet(nursery, rec.handle, max_queue=100, idle_exit_s=idle_exit_s, on_idle=rec.on_idle)


async def test_each_lane_keeps_its_order_while_lanes_run_side_by_side(
    autojump_clock: object,
) -> None:
    rec = Recorder()
    rec.gates["a0"] = trio.Event()
    async with trio.open_nursery() as nursery:
        ls = lanes(nursery, rec)
        for i in range(3):
            assert ls.enqueue(("a", ""), f"a{i}")
            assert ls.enqueue(("b", ""), f"b{i}")
        await trio.sleep(1)
        assert [item for _, item, _ in rec.ran] == ["b0", "b1", "b2"]  # a0 holds lane a
        assert ls.get(("a", "")) is not None and ls.get(("a", "")).queued == 2  # type: ignore[union-attr]
        rec.gates["a0"].set()
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert [item for key, item, _ in rec.ran if key == ("a", "")] == ["a0", "a1", "a2"]


async def test_a_flood_of_new_conversations_runs_on_one_worker(autojump_clock: object) -> None:
    rec = Recorder()
    async with trio.open_nursery() as nursery:
        ls = lanes(nursery, rec)
        for i in range(200):  # first messages of distinct users, each handled at once
            assert ls.enqueue((f"u{i}", ""), i)
            await trio.sleep(0.01)
        await trio.sleep(1)
        assert len(rec.ran) == 200
        assert len(ls) == 200
        # One worker (parked, waiting for the next lane with work) and the reaper.
        names = sorted(t.name for t in nursery.child_tasks)
        assert names == ["lane-reaper", "lane-worker"], names
        nursery.cancel_scope.cancel()


async def test_workers_beyond_the_spares_end_when_their_lanes_are_done(
    autojump_clock: object,
) -> None:
    rec = Recorder()
    n = SPARE_WORKERS + 10
    async with trio.open_nursery() as nursery:
        ls = lanes(nursery, rec)
        for i in range(n):
            rec.gates[i] = trio.Event()
            ls.enqueue((f"c{i}", ""), i)
        await trio.sleep(1)
        assert ls.running_count() == n  # every conversation's turn runs at once
        for gate in rec.gates.values():
            gate.set()
        await trio.sleep(1)
        assert ls.running_count() == 0
        workers = [t for t in nursery.child_tasks if t.name == "lane-worker"]
        assert len(workers) == SPARE_WORKERS
        nursery.cancel_scope.cancel()
    assert sorted(item for _, item, _ in rec.ran) == list(range(n))


async def test_every_idle_lane_exits_at_its_own_time_and_work_resets_it(
    autojump_clock: object,
) -> None:
    rec = Recorder()
    async with trio.open_nursery() as nursery:
        ls = lanes(nursery, rec, idle_exit_s=10)
        t0 = trio.current_time()
        ls.enqueue(("a", ""), "a0")  # a idle from t0
        await trio.sleep(2)
        ls.enqueue(("b", ""), "b0")  # b idle from t0 + 2
        await trio.sleep(2)
        ls.enqueue(("a", ""), "a1")  # a again: idle from t0 + 4
        await trio.sleep(7.5)  # t0 + 11.5
        assert ls.get(("b", "")) is not None and ls.get(("a", "")) is not None
        await trio.sleep(1)  # t0 + 12.5: b's 10 s are up
        assert ls.get(("b", "")) is None and ls.get(("a", "")) is not None
        await trio.sleep(2)  # t0 + 14.5: a's too
        assert len(ls) == 0
        assert [(k, round(t - t0, 3)) for k, t in rec.idle] == [(("b", ""), 12), (("a", ""), 14)]
        ls.enqueue(("a", ""), "a2")  # a new lane for the same conversation
        await trio.sleep(1)
        assert len(ls) == 1
        nursery.cancel_scope.cancel()
    assert [item for _, item, _ in rec.ran] == ["a0", "b0", "a1", "a2"]


async def test_a_lane_with_work_queued_or_running_never_exits(autojump_clock: object) -> None:
    rec = Recorder()
    rec.gates["long"] = trio.Event()
    async with trio.open_nursery() as nursery:
        ls = lanes(nursery, rec, idle_exit_s=5)
        ls.enqueue(("a", ""), "long")
        ls.enqueue(("a", ""), "next")
        await trio.sleep(60)  # the turn runs for a minute: the lane is not idle
        assert ls.get(("a", "")) is not None and rec.idle == []
        rec.gates["long"].set()
        await trio.sleep(4)
        assert ls.get(("a", "")) is not None
        await trio.sleep(2)
        assert ls.get(("a", "")) is None
        nursery.cancel_scope.cancel()
    assert [item for _, item, _ in rec.ran] == ["long", "next"]
