"""The native-stream engine (:mod:`dshim.streams.native`) on a scripted channel.

What a user of a natively streaming channel notices: the first text at once and then no
more than one update per interval, the note under the text, a rate limit that pauses
updates instead of ending the answer, the final text exactly once (natively or by the
fallback, never both), and an answer that is stopped being closed on the screen.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import pytest
import structlog.testing
import trio

from dshim.backoff import Backoff
from dshim.errors import ChannelError, RateLimited, TransportError
from dshim.model import Delivered
from dshim.outbound import ReplyStream
from dshim.streams.native import NativeStream, Step, open_native_stream, retrying

DEADLINE = 600


class FallbackStream:
    """A fallback that records what it was given."""

    def __init__(self, log: list[tuple[str, str]]) -> None:
        self.log = log

    async def update(self, text: str) -> None:
        self.log.append(("fallback.update", text))

    async def progress(self, note: str) -> None:
        self.log.append(("fallback.progress", note))

    async def finish(self, text: str) -> list[Delivered]:
        self.log.append(("fallback.finish", text))
        return [Delivered(message_id="fb", text=text, sent_at=0.0, completed_at=0.0)]


class Script:
    """A channel's calls: every call is logged with its trio time; outcomes scripted."""

    interval_s = 1.0
    shows_notes = True

    def __init__(self) -> None:
        self.calls: list[tuple[float, str, str]] = []
        self.log: list[tuple[str, str]] = []
        #: Outcomes (a Step or an exception) for the next intermediate calls, in order.
        self.outcomes: list[Step | BaseException] = []
        self.finish_result: list[Delivered] | None | BaseException = None
        self.has_fallback = True
        self.stream: NativeStream | None = None

    def bind(self, stream: NativeStream) -> None:
        self.stream = stream

    async def _intermediate(self, op: str, text: str) -> Step:
        self.calls.append((trio.current_time(), op, text))
        outcome = self.outcomes.pop(0) if self.outcomes else Step.SHOWN
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    async def start(self, text: str) -> Step:
        assert self.stream is not None
        await self.stream.delivering()
        return await self._intermediate("start", text)

    async def append(self, text: str) -> Step:
        return await self._intermediate("append", text)

    async def finish(self, text: str) -> list[Delivered] | None:
        self.calls.append((trio.current_time(), "finish", text))
        result = self.finish_result
        if isinstance(result, BaseException):
            raise result
        if result is None and not self.has_fallback:
            return []
        return result

    def fallback(self) -> AbstractAsyncContextManager[ReplyStream] | None:
        if not self.has_fallback:
            return None

        @asynccontextmanager
        async def opened() -> AsyncIterator[ReplyStream]:
            self.log.append(("fallback.open", ""))
            yield FallbackStream(self.log)

        return opened()

    async def abandon(self) -> None:
        self.calls.append((trio.current_time(), "abandon", ""))

    async def background(self) -> None:
        return None

    def ops(self) -> list[str]:
        return [op for _, op, _ in self.calls]


def done(text: str) -> list[Delivered]:
    return [Delivered(message_id="m1", text=text, sent_at=0.0, completed_at=0.0)]


async def one_then_one_two(calls: Script, *, wait_s: float, final: str) -> list[tuple[float, str]]:
    """ "one", 1.5 s later "one two", ``wait_s`` later the final text: each call's time
    (from the first update) and name."""
    with trio.fail_after(DEADLINE):
        async with open_native_stream(calls) as stream:
            t0 = trio.current_time()
            await stream.update("one")
            await trio.sleep(1.5)
            await stream.update("one two")
            await trio.sleep(wait_s)
            await stream.finish(final)
    return [(round(t - t0, 1), op) for t, op, _ in calls.calls]


async def test_first_text_at_once_then_one_update_per_interval_with_the_newest_text(
    autojump_clock: trio.abc.Clock,
) -> None:
    calls = Script()
    calls.finish_result = done("abcdef")
    with trio.fail_after(DEADLINE):
        async with open_native_stream(calls) as stream:
            t0 = trio.current_time()
            await stream.update("a")
            await trio.sleep(0.1)
            for text in ("ab", "abc", "abcd"):  # merged: only the newest is sent
                await stream.update(text)
                await trio.sleep(0.1)
            await trio.sleep(2)
            delivered = await stream.finish("abcdef")
    assert [(round(t - t0, 1), op, text) for t, op, text in calls.calls] == [
        (0.0, "start", "a"),
        (1.0, "append", "abcd"),
        (2.4, "finish", "abcdef"),
    ]
    assert delivered == done("abcdef")


async def test_a_note_shows_under_the_text_until_more_text(autojump_clock: trio.abc.Clock) -> None:
    calls = Script()
    calls.finish_result = done("x")
    with trio.fail_after(DEADLINE):
        async with open_native_stream(calls) as stream:
            await stream.update("Looking")
            await trio.sleep(1.5)
            await stream.progress("reading file.py")
            await trio.sleep(1.5)
            await stream.update("Looking closer")
            await trio.sleep(1.5)
            await stream.finish("x")
    assert [text for _, op, text in calls.calls if op != "finish"] == [
        "Looking",
        "Looking\n\n⏳ reading file.py",
        "Looking closer",
    ]


async def test_the_delivery_hook_runs_once_before_the_first_visible_call(
    autojump_clock: trio.abc.Clock,
) -> None:
    calls = Script()
    calls.finish_result = done("hi there")
    seen: list[list[str]] = []

    async def hook() -> None:
        seen.append(calls.ops())

    with trio.fail_after(DEADLINE):
        async with open_native_stream(calls) as stream:
            stream.watch_delivery(hook)
            await stream.update("hi")
            await trio.sleep(2)
            await stream.update("hi there")
            await trio.sleep(2)
            await stream.finish("hi there")
    assert seen == [[]]  # once, before the start call


async def test_a_rate_limit_pauses_updates_for_its_retry_after_and_the_answer_goes_on(
    autojump_clock: trio.abc.Clock,
) -> None:
    calls = Script()
    calls.outcomes = [Step.SHOWN, RateLimited("slow down", retry_after=7.0)]
    calls.finish_result = done("one two three")
    times = await one_then_one_two(calls, wait_s=10, final="one two three")
    assert times == [(0.0, "start"), (1.5, "append"), (8.5, "append"), (11.5, "finish")]


async def test_three_failures_in_a_row_stop_updates_but_the_final_text_still_arrives(
    autojump_clock: trio.abc.Clock,
) -> None:
    calls = Script()
    failure = TransportError("down", request_sent=False)
    calls.outcomes = [Step.SHOWN, failure, failure, failure]
    calls.finish_result = done("final")
    with trio.fail_after(DEADLINE):
        async with open_native_stream(calls) as stream:
            await stream.update("a")
            for i in range(20):
                await trio.sleep(1.5)
                await stream.update("a" + "b" * (i + 1))
            delivered = await stream.finish("final")
    assert calls.ops() == ["start", "append", "append", "append", "finish"]
    assert delivered == done("final")


async def test_a_fallback_step_hands_the_rest_of_the_answer_to_the_fallback_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    calls = Script()
    calls.outcomes = [Step.FALLBACK]
    with trio.fail_after(DEADLINE):
        async with open_native_stream(calls) as stream:
            await stream.update("hello")
            await trio.sleep(1)
            await stream.update("hello world")
            await stream.progress("thinking")
            delivered = await stream.finish("hello world!")
    assert calls.ops() == ["start"]  # no native finish after the fallback took over
    assert calls.log == [
        ("fallback.open", ""),
        ("fallback.update", "hello"),
        ("fallback.update", "hello world"),
        ("fallback.progress", "thinking"),
        ("fallback.finish", "hello world!"),
    ]
    assert [d.message_id for d in delivered] == ["fb"]


async def test_a_native_finish_that_cannot_finish_gives_the_text_to_the_fallback_not_both(
    autojump_clock: trio.abc.Clock,
) -> None:
    calls = Script()
    calls.finish_result = None
    hooked: list[str] = []

    async def hook() -> None:
        hooked.append("hook")

    with trio.fail_after(DEADLINE):
        async with open_native_stream(calls) as stream:
            stream.watch_delivery(hook)
            delivered = await stream.finish("whole answer")
    assert calls.ops() == ["finish"]
    assert calls.log == [("fallback.open", ""), ("fallback.finish", "whole answer")]
    assert [d.text for d in delivered] == ["whole answer"]


async def test_finish_twice_is_an_error_and_a_failing_finish_raises_as_itself(
    autojump_clock: trio.abc.Clock,
) -> None:
    calls = Script()
    calls.finish_result = done("x")
    with trio.fail_after(DEADLINE):
        async with open_native_stream(calls) as stream:
            await stream.finish("x")
            with pytest.raises(RuntimeError, match="twice"):
                await stream.finish("x")
        calls2 = Script()
        calls2.finish_result = TransportError("gone", request_sent=False)
        with pytest.raises(TransportError, match="gone"):
            async with open_native_stream(calls2) as stream2:
                await stream2.finish("y")
    assert "abandon" not in calls.ops() + calls2.ops()


async def test_leaving_without_finish_abandons_what_is_up_even_when_cancelled(
    autojump_clock: trio.abc.Clock,
) -> None:
    calls = Script()
    with trio.fail_after(DEADLINE):
        with trio.move_on_after(5):
            async with open_native_stream(calls) as stream:
                await stream.update("partial")
                await trio.sleep_forever()
    assert calls.ops() == ["start", "abandon"]


async def test_retrying_repeats_known_failures_waits_rate_limits_and_raises_unknown_ones(
    autojump_clock: trio.abc.Clock,
) -> None:
    outcomes: list[BaseException | str] = [
        TransportError("refused", request_sent=False),
        RateLimited("busy", retry_after=3.0),
        "ok",
    ]
    unsure: list[str] = []

    async def call() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    with trio.fail_after(DEADLINE):
        t0 = trio.current_time()
        assert (
            await retrying(call, give_up_at=t0 + 60, backoff=Backoff(1.0, 30.0, 2.0, jitter=0.0))
            == "ok"
        )
        assert trio.current_time() - t0 == pytest.approx(4.0, abs=0.5)

        lost = TransportError("read timeout", request_sent=True)
        outcomes[:] = [lost]
        with pytest.raises(TransportError, match="read timeout"):
            await retrying(
                call,
                give_up_at=trio.current_time() + 60,
                backoff=Backoff(1.0, 30.0, 2.0, jitter=0.0),
                repeatable=False,
                on_unsure=lambda: unsure.append("lost"),
            )
        assert unsure == ["lost"]

        outcomes[:] = [ChannelError("refused for good")]
        with pytest.raises(ChannelError, match="for good"):
            await retrying(call, give_up_at=trio.current_time() + 60, backoff=Backoff())


async def test_a_channel_that_counts_its_own_failures_pauses_the_next_attempt(
    autojump_clock: trio.abc.Clock,
) -> None:
    class Paused(Script):
        """Catches its failures itself: AGAIN after a pause of its choosing, never STOP."""

        async def append(self, text: str) -> Step:
            step = await super().append(text)
            if step is Step.AGAIN:
                assert self.stream is not None
                self.stream.pause(4.0)
            return step

    calls = Paused()
    calls.outcomes = [Step.SHOWN, Step.AGAIN, Step.AGAIN, Step.AGAIN]
    calls.finish_result = done("one two")
    times = await one_then_one_two(calls, wait_s=15, final="one two")
    assert times == [
        (0.0, "start"),
        (1.5, "append"),
        (5.5, "append"),
        (9.5, "append"),
        (13.5, "append"),  # three in a row did not stop it: the channel counts
        (16.5, "finish"),
    ]


async def test_retrying_names_the_call_in_its_log_records(autojump_clock: trio.abc.Clock) -> None:
    outcomes: list[BaseException | str] = [
        RateLimited("busy", retry_after=2.0),
        TransportError("refused", request_sent=False),
        "ok",
    ]

    async def call() -> str:
        outcome = outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    with trio.fail_after(DEADLINE), structlog.testing.capture_logs() as logs:
        result = await retrying(
            call,
            give_up_at=trio.current_time() + 60,
            backoff=Backoff(1.0, 30.0, 2.0, jitter=0.0),
            events=("waited", "retried"),
            log_context={"seq": 3},
        )
    assert result == "ok"
    assert [(e["event"], e["seq"]) for e in logs] == [("waited", 3), ("retried", 3)]


async def test_a_channel_names_the_records_of_its_intermediate_failures(
    autojump_clock: trio.abc.Clock,
) -> None:
    calls = Script()
    failure = TransportError("down", request_sent=False)
    calls.outcomes = [Step.SHOWN, RateLimited("slow down", retry_after=2.0), failure, failure]
    calls.outcomes.append(failure)
    calls.finish_result = done("final")
    events = ("card_rate_limited", "card_update_failed", "card_updates_stopped")
    with trio.fail_after(DEADLINE), structlog.testing.capture_logs() as logs:
        async with open_native_stream(calls, events=events) as stream:
            await stream.update("a")
            for i in range(20):
                await trio.sleep(1.5)
                await stream.update("a" + "b" * (i + 1))
            await stream.finish("final")
    assert [e["event"] for e in logs] == [
        "card_rate_limited",
        "card_update_failed",
        "card_update_failed",
        "card_updates_stopped",
    ]


async def test_next_call_at_is_an_interval_after_the_last_call_and_never_inside_a_pause(
    autojump_clock: trio.abc.Clock,
) -> None:
    calls = Script()
    calls.outcomes = [Step.SHOWN, RateLimited("slow down", retry_after=7.0)]
    with trio.fail_after(DEADLINE):
        async with open_native_stream(calls) as stream:
            assert stream.next_call_at == -math.inf  # nothing went out yet
            t0 = trio.current_time()
            await stream.update("one")
            await trio.sleep(0.1)
            assert stream.next_call_at == pytest.approx(t0 + calls.interval_s)
            await trio.sleep(1.5)
            await stream.update("one two")  # rate limited at t0 + 1.6
            await trio.sleep(0.1)
            assert stream.next_call_at == pytest.approx(t0 + 1.6 + 7.0)
            stream.paced()  # a call of the channel's own, inside the pause
            assert stream.next_call_at == pytest.approx(t0 + 1.6 + 7.0)
            await trio.sleep(10)
            stream.paced()
            assert stream.next_call_at == pytest.approx(trio.current_time() + calls.interval_s)
            calls.finish_result = done("one two")
            await stream.finish("one two")


class StopButtonStream(NativeStream):
    """A stream with a feature of a channel's own (here: a stop button's hook)."""

    stop: object = None

    def watch_stop(self, stop: object) -> None:
        self.stop = stop


async def test_a_channel_may_have_its_stream_built_as_a_subclass_with_a_feature_of_its_own(
    autojump_clock: trio.abc.Clock,
) -> None:
    calls = Script()
    calls.finish_result = done("all")
    with trio.fail_after(DEADLINE):
        async with open_native_stream(calls, stream_type=StopButtonStream) as stream:
            assert isinstance(stream, StopButtonStream) and calls.stream is stream
            stream.watch_stop("stop hook")
            await stream.update("all")
            await trio.sleep(0.1)
            assert await stream.finish("all") == done("all")
    assert stream.stop == "stop hook"
    assert calls.ops() == ["start", "finish"]
