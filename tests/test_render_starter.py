"""The edit engine's starter (dshim.render._Starter): one system task per trio run holds
the deadlines at which answers start their pump and typing tasks.  Its failure paths:
an answer that ended before its deadline starts nothing, a bug while starting one
answer's task is logged and the others still start, and every task it starts is a
child of its answer's own nursery (cancelled with the answer)."""

from __future__ import annotations

import pytest
import trio
from structlog.testing import capture_logs

from dshim.render import EditStream, Limits, open_edit_stream
from tests.test_render import Transport, clock

DEADLINE = 120
LIMITS = Limits(max_len=100, first_send_delay_s=1.0, edit_interval_s=1.0, typing_interval_s=5.0)


async def test_an_answer_that_ended_before_its_deadline_starts_nothing(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        t = Transport()
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            await stream.update("quick")  # the pump's deadline is 1 s away
        ended = t.now()
        # Left without finish (a stop): no deadline may start a task in a closed nursery.
        await trio.sleep(10)
    assert t.calls == []
    assert [at for at in t.typing_at if at > ended] == []
    assert not [e for e in logs if e["event"] == "stream_start_failed"]  # skipped, not tried


async def test_a_bug_starting_one_answers_task_is_logged_and_the_others_go_on(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_start = EditStream._start
    broken: list[EditStream] = []

    def start(self: EditStream, what: str) -> None:
        if self in broken:
            raise RuntimeError("a bug")
        real_start(self, what)

    monkeypatch.setattr(EditStream, "_start", start)
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        bad, good = Transport(), Transport()
        async with (
            open_edit_stream(bad, LIMITS, clock=clock) as s1,
            open_edit_stream(good, LIMITS, clock=clock) as s2,
        ):
            broken.append(s1)
            await s1.update("first")
            await s2.update("second, still streamed")
            await trio.sleep(3)  # past both first-send deadlines
            assert good.calls and good.calls[0][1] == "send"  # its pump started
            await s2.finish("second, still streamed")
            await s1.finish("first")  # finish sends what the pump never did
    assert [e["event"] for e in logs].count("stream_start_failed") == 1
    assert bad.final == ["first"] and good.final == ["second, still streamed"]


async def test_the_tasks_it_starts_belong_to_the_answer_and_end_with_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        with trio.CancelScope() as answer:
            async with open_edit_stream(t, LIMITS, clock=clock) as stream:
                await stream.update("streaming")
                await trio.sleep(1.5)  # the starter started the pump inside this answer
                assert t.calls and t.calls[0][1] == "send"
                answer.cancel()  # the answer is stopped: its pump goes with it
                await trio.sleep(1)
        calls = len(t.calls)
        await trio.sleep(30)
    assert len(t.calls) == calls  # nothing of the answer runs on afterwards
