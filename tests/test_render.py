"""The shared streaming-by-edit engine (dshim.render) on trio's autojump clock.

A scripted in-memory transport records every call with its (virtual) time, and fails on
demand.  Assertions are about what a chat user would see: when the first message shows
up, how often it changes, that the final text is complete and appears exactly once.
Each test has a hard (virtual) deadline.
"""

from __future__ import annotations

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from dshim.channels.telegram.protocol import utf16_len
from dshim.errors import NotFound, PermissionDenied, RateLimited, TransportError
from dshim.render import ChatPacer, Limits, deliver_text, open_edit_stream, split_text

DEADLINE = 600


class Transport:
    """An in-memory chat: message id -> every text it showed."""

    def __init__(self) -> None:
        self.t0 = trio.current_time()
        self.shown: dict[str, list[str]] = {}
        self.calls: list[tuple[float, str, str, str]] = []  # (t, kind, id, text)
        self.typing_at: list[float] = []
        self.replies: list[bool] = []
        self.failures: dict[str, list[Exception]] = {"send": [], "edit": [], "typing": []}
        self.failed_at: list[tuple[float, str]] = []
        self.send_after_success: list[Exception] = []
        self._next = 1

    def now(self) -> float:
        return trio.current_time() - self.t0

    def _maybe_fail(self, kind: str) -> None:
        if self.failures[kind]:
            self.failed_at.append((self.now(), kind))
            raise self.failures[kind].pop(0)

    async def send(self, text: str, *, reply: bool) -> str:
        await trio.sleep(0.01)
        self._maybe_fail("send")
        mid = str(self._next)
        self._next += 1
        self.shown[mid] = [text]
        self.replies.append(reply)
        self.calls.append((self.now(), "send", mid, text))
        if self.send_after_success:
            raise self.send_after_success.pop(0)  # the message exists, the answer is lost
        return mid

    async def edit(self, message_id: str, text: str) -> None:
        await trio.sleep(0.01)
        self._maybe_fail("edit")
        if message_id not in self.shown:
            raise NotFound("message to edit not found")
        self.calls.append((self.now(), "edit", message_id, text))
        if self.shown[message_id][-1] != text:  # "not modified" is a success
            self.shown[message_id].append(text)

    async def typing(self) -> None:
        self.typing_at.append(self.now())
        self._maybe_fail("typing")

    @property
    def final(self) -> list[str]:
        return [texts[-1] for _, texts in sorted(self.shown.items(), key=lambda kv: int(kv[0]))]


LIMITS = Limits(max_len=100, first_send_delay_s=1.0, edit_interval_s=1.0, typing_interval_s=5.0)


def clock() -> float:
    return 1_790_000_000.0 + trio.current_time()


async def stream_text(stream: object, pieces: list[str], gap: float) -> str:
    text = ""
    for piece in pieces:
        text += piece
        await stream.update(text)  # type: ignore[attr-defined]
        await trio.sleep(gap)
    return text


async def test_first_message_after_one_second_then_at_most_one_edit_per_second(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            text = await stream_text(stream, [f"w{i} " for i in range(15)], 0.2)  # 3 s of text
            delivered = await stream.finish(text)
    sends = [c for c in t.calls if c[1] == "send"]
    edits = [c for c in t.calls if c[1] == "edit"]
    assert len(sends) == 1
    assert sends[0][0] == pytest.approx(1.0, abs=0.05)  # ~1 s of text first
    times = [c[0] for c in t.calls]
    assert all(b - a >= 1.0 - 1e-6 for a, b in zip(times, times[1:], strict=False))
    assert len(edits) <= 3  # 15 updates were merged into a few edits
    assert t.final == [text.strip()]
    assert [d.text for d in delivered] == [text.strip()]
    assert delivered[0].message_id == sends[0][2]


async def test_short_answer_is_one_send_at_finish(autojump_clock: trio.abc.Clock) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            await stream.update("Hi")
            await trio.sleep(0.3)
            await stream.finish("Hi there.")
    assert [(c[1], c[3]) for c in t.calls] == [("send", "Hi there.")]
    assert t.replies == [True]


async def test_typing_every_five_seconds_until_the_first_text(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            await trio.sleep(12)  # the agent thinks
            await stream.update("Answer")
            await trio.sleep(6)
            await stream.finish("Answer.")
    assert t.typing_at == pytest.approx([0, 5, 10], abs=0.05)
    first_send = next(c[0] for c in t.calls if c[1] == "send")
    assert first_send == pytest.approx(13, abs=0.05)
    assert all(at < first_send for at in t.typing_at)


async def test_typing_failures_do_not_break_the_answer(autojump_clock: trio.abc.Clock) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        t.failures["typing"] = [TransportError("boom"), PermissionDenied("blocked")]
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            await trio.sleep(11)
            await stream.finish("done")
    assert t.final == ["done"] and len(t.typing_at) == 3


async def test_long_text_continues_in_follow_up_messages_split_at_paragraphs(
    autojump_clock: trio.abc.Clock,
) -> None:
    paragraphs = [f"Paragraph {i} " + "x" * 40 for i in range(6)]
    final = "\n\n".join(paragraphs)
    with trio.fail_after(DEADLINE):
        t = Transport()
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            for i in range(1, len(final) + 1, 20):
                await stream.update(final[:i])
                await trio.sleep(0.25)
            delivered = await stream.finish(final)
    assert t.final == split_text(final, 100)
    assert len(t.final) >= 4 and all(len(text) <= 100 for text in t.final)
    assert "".join("".join(c.split()) for c in t.final) == "".join(final.split())  # nothing lost
    assert [d.text for d in delivered] == t.final
    assert t.replies == [True] + [False] * (len(t.final) - 1)  # only the first answers the user


async def test_429_storm_still_delivers_the_final_text_exactly_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        t.failures["send"] = [RateLimited("flood", retry_after=3)] * 2
        t.failures["edit"] = [RateLimited("flood", retry_after=2)] * 6
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            text = await stream_text(stream, [f"part {i}. " for i in range(10)], 0.5)
            final = text + "The end."
            delivered = await stream.finish(final)
    assert t.final == [final.strip()]
    assert len(t.shown) == 1  # one message, never duplicated
    assert [d.text for d in delivered] == [final.strip()]
    # After each 429 the next call waited at least retry_after.
    for at, kind in t.failed_at:
        later = [c[0] for c in t.calls if c[0] > at]
        if later:
            assert later[0] - at >= (3 if kind == "send" else 2) - 0.05


async def test_a_long_flood_control_storm_delays_but_never_drops_the_final_text(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        # 429s on every call for far longer than send_retry_s: charged to its own budget.
        t.failures["send"] = [RateLimited("flood", retry_after=5)] * 15
        t.failures["edit"] = [RateLimited("flood", retry_after=5)] * 30
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            await stream_text(stream, ["one ", "two ", "three "], 0.5)
            delivered = await stream.finish("one two three, finally")
    assert t.final == ["one two three, finally"]
    assert len(t.shown) == 1
    assert [d.text for d in delivered] == ["one two three, finally"]


async def test_a_send_that_succeeded_is_never_repeated(autojump_clock: trio.abc.Clock) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        t.failures["edit"] = [TransportError("reset"), TransportError("reset")]
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            await stream_text(stream, ["a", "b", "c", "d"], 0.6)
            await stream.finish("abcd and more")
    assert len(t.shown) == 1 and t.final == ["abcd and more"]


def lost_response() -> TransportError:
    """The request reached the platform; the connection dropped before the answer."""
    return TransportError("sendMessage: connection failed (ReadError)", request_sent=True)


async def test_a_send_whose_outcome_is_unknown_is_repeated_at_most_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        t.send_after_success = [lost_response() for _ in range(50)]  # every answer is lost
        with pytest.raises(TransportError):
            async with open_edit_stream(t, LIMITS, clock=clock) as stream:
                await stream_text(stream, [f"part {i}. " for i in range(12)], 0.5)
                await stream.finish("the whole answer")
    assert 1 <= len(t.shown) <= 2  # the user sees at most two copies, never six
    assert len([c for c in t.calls if c[1] == "send"]) == len(t.shown)


async def test_after_one_lost_response_the_answer_continues_by_edit(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        t.send_after_success = [lost_response()]  # the first send's answer is lost
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            text = await stream_text(stream, [f"part {i}. " for i in range(8)], 0.5)
            delivered = await stream.finish(text + "The end.")
    sends = [c for c in t.calls if c[1] == "send"]
    assert len(sends) == 2  # the copy we could not confirm, and one more we know the id of
    final = (text + "The end.").strip()
    assert t.shown[sends[1][2]][-1] == final  # later text went by edit to the known one
    assert [d.message_id for d in delivered] == [sends[1][2]]
    assert [d.text for d in delivered] == [final]


async def test_a_lost_response_of_a_follow_up_message_is_repeated_at_most_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    paragraphs = "\n\n".join(f"Paragraph {i} " + "x" * 40 for i in range(4))
    with trio.fail_after(DEADLINE):
        t = Transport()
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            await stream.update(paragraphs[:90])
            await trio.sleep(2)
            assert len(t.shown) == 1
            t.send_after_success = [lost_response() for _ in range(50)]
            with pytest.raises(TransportError):
                await stream.finish(paragraphs)
    assert len(t.shown) <= 1 + 2 * (len(split_text(paragraphs, 100)) - 1)
    assert len(t.shown) <= 3  # the first message and at most two copies of the second


async def test_sends_that_never_left_are_retried_freely(autojump_clock: trio.abc.Clock) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        t.failures["send"] = [
            TransportError("cannot connect (ConnectError)", request_sent=False) for _ in range(6)
        ]
        delivered = await deliver_text(t, LIMITS, "hello", clock=clock)
    assert [d.text for d in delivered] == ["hello"] and len(t.shown) == 1
    assert len(t.failed_at) == 6


class IdempotentTransport(Transport):
    """A platform with an idempotency key: a repeated send returns the same message."""

    idempotent_sends = True

    def __init__(self) -> None:
        super().__init__()
        self.lost = 0

    async def send(self, text: str, *, reply: bool) -> str:
        if self.lost:
            self.lost -= 1
            if not self.shown:
                await super().send(text, reply=reply)  # created once ...
            raise lost_response()  # ... and the answer lost, several times
        if self.shown:  # the nonce matches: the existing message, with the newest text
            mid = next(iter(self.shown))
            await self.edit(mid, text)
            return mid
        return await super().send(text, reply=reply)


async def test_an_idempotent_transport_may_repeat_an_unknown_send(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = IdempotentTransport()
        t.lost = 4
        delivered = await deliver_text(t, LIMITS, "hello", clock=clock)
    assert [d.text for d in delivered] == ["hello"] and len(t.shown) == 1


async def test_deleted_message_gets_the_final_text_as_a_new_message(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            await stream_text(stream, ["first ", "second "], 0.8)
            assert t.shown
            t.shown.clear()  # the user deleted the message
            delivered = await stream.finish("first second third")
    assert t.final == ["first second third"]
    assert delivered[0].message_id == "2"


async def test_group_budget_limits_calls_per_minute(autojump_clock: trio.abc.Clock) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        pacer = ChatPacer(budget=3, per_s=60)
        limits = Limits(max_len=4096)
        async with open_edit_stream(t, limits, clock=clock, pacer=pacer) as stream:
            text = await stream_text(stream, [f"w{i} " for i in range(40)], 1.0)  # 40 s
            await stream.finish(text + "end")
    times = [c[0] for c in t.calls]
    for i, at in enumerate(times):
        assert len([x for x in times[i:] if x < at + 60 - 1e-6]) <= 3
    assert t.final == [(text + "end").strip()]


async def test_leaving_without_finish_stops_quietly(autojump_clock: trio.abc.Clock) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        with trio.move_on_after(2.5):
            async with open_edit_stream(t, LIMITS, clock=clock) as stream:
                await stream_text(stream, ["a", "b", "c", "d", "e", "f"], 1.0)
        calls = len(t.calls)
        await trio.sleep(30)
    assert len(t.calls) == calls  # nothing runs after the stream is gone
    assert len(t.typing_at) == 1


async def test_final_errors_are_raised_plainly_not_as_groups(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        t.failures["send"] = [PermissionDenied("Forbidden: bot was blocked by the user")]
        with pytest.raises(PermissionDenied):
            async with open_edit_stream(t, LIMITS, clock=clock) as stream:
                await stream.finish("hello")


async def test_transient_send_failures_are_retried_with_a_cap(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        refused = TransportError("cannot connect", request_sent=False)
        t.failures["send"] = [refused] * 3
        assert [d.text for d in await deliver_text(t, LIMITS, "hello", clock=clock)] == ["hello"]
        t2 = Transport()
        t2.failures["send"] = [refused] * 50
        with pytest.raises(TransportError):
            await deliver_text(t2, LIMITS, "hello", clock=clock)
        # Retried with backoff for send_retry_s (120 s), then the failure stands.
        assert LIMITS.send_retry_s == 120.0
        assert LIMITS.send_retry_s - 30.0 <= t2.failed_at[-1][0] <= LIMITS.send_retry_s
        gaps = [b[0] - a[0] for a, b in zip(t2.failed_at, t2.failed_at[1:], strict=False)]
        assert all(g >= 1.0 for g in gaps) and max(gaps) <= 30.1  # backoff 1 s .. 30 s


class Outage(Transport):
    """A platform that is down until ``until`` (virtual seconds): each send fails with
    ``fault`` — answered with 5xx, refused, or dropped before or after processing."""

    def __init__(self, fault: str, until: float, *, probe: bool = True) -> None:
        super().__init__()
        self.fault, self.until = fault, until
        self.probes: list[float] = []
        if not probe:
            self.reachable = None  # type: ignore[assignment]

    def _down(self) -> bool:
        return self.now() < self.until

    async def send(self, text: str, *, reply: bool) -> str:
        if self._down():
            await trio.sleep(0.01)
            self.failed_at.append((self.now(), "send"))
            if self.fault == "500":
                raise TransportError("sendMessage: HTTP 500", status=500, request_sent=True)
            if self.fault == "refused":
                raise TransportError("cannot connect", request_sent=False)
            if self.fault == "drop-after":  # the message exists, the answer is lost
                mid = await super().send(text, reply=reply)
                del mid
            raise TransportError("sendMessage: connection failed", request_sent=True)
        return await super().send(text, reply=reply)

    async def reachable(self) -> None:
        self.probes.append(self.now())
        await trio.sleep(0.01)
        if self._down():
            raise TransportError("getMe: connection failed", request_sent=True)


@pytest.mark.parametrize("fault", ["500", "refused", "drop-before"])
async def test_a_ten_second_outage_loses_no_answer_and_doubles_none(
    autojump_clock: trio.abc.Clock, fault: str
) -> None:
    with trio.fail_after(DEADLINE):
        t = Outage(fault, until=10.0)
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            await stream.update("the answer")
            delivered = await stream.finish("the answer, complete")
    assert t.final == ["the answer, complete"]  # delivered, exactly once
    assert [d.text for d in delivered] == ["the answer, complete"]
    assert t.calls[0][0] >= 10.0


async def test_a_send_lost_after_processing_makes_at_most_one_extra_copy(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = Outage("drop-after", until=10.0)
        assert [d.text for d in await deliver_text(t, LIMITS, "hello", clock=clock)] == ["hello"]
        assert t.final == ["hello", "hello"]  # the lost one and the confirmed repeat
        forever = Outage("drop-after", until=10_000.0)
        with pytest.raises(TransportError):
            await deliver_text(forever, LIMITS, "hello", clock=clock)
    assert forever.final == ["hello", "hello"]  # two copies at most, never a loop of them


async def test_an_unknown_outcome_waits_for_the_platform_before_its_one_repeat(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = Outage("drop-before", until=25.0)
        await deliver_text(t, LIMITS, "hello", clock=clock)
    assert len(t.failed_at) == 1  # one lost send, then no send until the platform is back
    assert t.probes[0] >= LIMITS.unknown_repeat_wait_s  # a pause first, then probes
    assert len(t.probes) >= 2 and t.probes[-1] >= 25.0
    assert t.calls[0][0] >= 25.0
    assert t.final == ["hello"]


async def test_intermediate_failures_end_only_the_live_preview(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        t.failures["send"] = [PermissionDenied("not enough rights")]
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            await stream_text(stream, ["a", "b", "c"], 1.0)
            assert t.shown == {}  # the preview gave up
            await stream.finish("abc!")
    assert t.final == ["abc!"]


async def test_progress_note_is_shown_under_the_text_until_more_text(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(DEADLINE):
        t = Transport()
        async with open_edit_stream(t, LIMITS, clock=clock) as stream:
            await stream.update("Looking")
            await trio.sleep(1.5)
            await stream.progress("web_search (running)")
            await trio.sleep(1.5)
            await stream.update("Looking it up: found")
            await trio.sleep(1.5)
            await stream.finish("Looking it up: found it.")
    history = t.shown["1"]
    assert "Looking\n\n⏳ web_search (running)" in history
    assert history[-1] == "Looking it up: found it."


async def test_deliver_text_splits_and_measures_with_the_platform_function(
    autojump_clock: trio.abc.Clock,
) -> None:
    limits = Limits(max_len=10, measure=utf16_len)
    with trio.fail_after(DEADLINE):
        t = Transport()
        delivered = await deliver_text(t, limits, "😀😀😀😀😀 😀😀😀", clock=clock)
    assert [d.text for d in delivered] == ["😀😀😀😀😀", "😀😀😀"]
    assert t.replies == [True, False]
    assert await deliver_text(Transport(), limits, "   ", clock=clock) == []


# --- the splitter ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "limit", "chunks"),
    [
        ("short", 10, ["short"]),
        ("   ", 10, []),
        ("aaaa bbbb cccc", 10, ["aaaa bbbb", "cccc"]),
        ("aaaaaaa\nbb ccc", 10, ["aaaaaaa", "bb ccc"]),
        ("aaaa\n\nbbbb\ncc dd", 12, ["aaaa\n\nbbbb", "cc dd"]),
        ("aaaaaa\n\nbb\ncccc", 12, ["aaaaaa\n\nbb", "cccc"]),
        ("aaaaaaaa\n\nbbbb", 8, ["aaaaaaaa", "bbbb"]),
        ("a b cccccccccccc", 10, ["a b cccccc", "cccccc"]),
        ("abcdefghijklmnop", 5, ["abcde", "fghij", "klmno", "p"]),
    ],
)
def test_split_prefers_paragraphs_then_lines_then_words(
    text: str, limit: int, chunks: list[str]
) -> None:
    assert split_text(text, limit) == chunks


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab \n😀é")), max_size=300), st.integers(2, 40))
def test_split_chunks_fit_and_lose_only_whitespace(text: str, limit: int) -> None:
    chunks = split_text(text, limit, utf16_len)
    assert all(0 < utf16_len(c) <= limit for c in chunks)
    assert "".join("".join(c.split()) for c in chunks) == "".join(text.split())


async def test_a_stream_started_late_still_logs_and_counts_as_its_answer(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The preview and the typing indicator start only when due, from a timer task of the
    run; their calls still carry the answer's context (log keys, request counters)."""
    import structlog

    seen: list[tuple[str, object]] = []

    class Recording(Transport):
        async def send(self, text: str, *, reply: bool) -> str:
            seen.append(("send", structlog.contextvars.get_contextvars().get("turn")))
            return await super().send(text, reply=reply)

        async def typing(self) -> None:
            seen.append(("typing", structlog.contextvars.get_contextvars().get("turn")))
            await super().typing()

    limits = Limits(max_len=100, first_send_delay_s=1.0, typing_interval_s=5.0, typing_grace_s=2.0)
    with trio.fail_after(DEADLINE):
        t = Recording()
        with structlog.contextvars.bound_contextvars(turn="t-1"):
            async with open_edit_stream(t, limits, clock=clock) as stream:
                await trio.sleep(3)  # silent past the grace: typing
                await stream.update("first words")
                await trio.sleep(2)  # past the first-send delay: the preview
                assert t.final == ["first words"]
                delivered = await stream.finish("first words and the rest")
        assert t.final == ["first words and the rest"]
        assert len(delivered) == 1
        assert t.typing_at == [2.0]
        assert seen == [("typing", "t-1"), ("send", "t-1")]


async def test_a_quick_answer_gets_no_typing_and_one_message(
    autojump_clock: trio.abc.Clock,
) -> None:
    limits = Limits(max_len=500, first_send_delay_s=1.0, typing_interval_s=5.0, typing_grace_s=1.0)
    with trio.fail_after(DEADLINE):
        t = Transport()
        async with open_edit_stream(t, limits, clock=clock) as stream:
            for i in range(50):  # many small deltas, no wait in between
                await stream.update("word " * (i + 1))
            await stream.finish("word " * 50)
        await trio.sleep(10)  # the deadlines the answer left behind come and go
        assert t.typing_at == []
        assert [kind for _, kind, _, _ in t.calls] == ["send"]
        assert t.final == [("word " * 50).strip()]


async def test_max_edits_caps_the_intermediate_edits_and_keeps_one_for_the_final_text(
    autojump_clock: trio.abc.Clock,
) -> None:
    limits = Limits(max_len=4096, first_send_delay_s=1.0, edit_interval_s=2.0, max_edits=5)
    with trio.fail_after(DEADLINE):
        t = Transport()
        async with open_edit_stream(t, limits, clock=clock) as stream:
            text = await stream_text(stream, [f"w{i} " for i in range(120)], 0.5)  # 60 s
            await stream.finish(text + "done")
    edits = [c for c in t.calls if c[1] == "edit"]
    assert len(edits) == 5  # four on the way (every 2 s at first), then the final text
    assert [c[1] for c in t.calls].count("send") == 1
    assert edits[-1][3] == (text + "done").strip()
    assert edits[-1][0] > 59 and all(c[0] < 12 for c in edits[:-1])
    assert t.final == [(text + "done").strip()]
