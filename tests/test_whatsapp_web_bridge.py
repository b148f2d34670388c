"""The crossing between neonize's threads and trio (``whatsapp_web/bridge.py``), with
real foreign threads standing in for whatsmeow's handlers."""

from __future__ import annotations

import threading

import pytest
import trio

from dshim.channels.whatsapp_web.bridge import ThreadBridge
from dshim.errors import AuthError, TransportError, outcome_unknown

DEADLINE = 60


async def test_events_from_a_foreign_thread_arrive_in_order_and_the_thread_waits_for_room() -> None:
    with trio.fail_after(DEADLINE):
        bridge: ThreadBridge[int] = ThreadBridge(buffer=4)
        taken: list[bool] = []
        on_trio_thread: list[bool] = []
        trio_thread = threading.get_ident()

        def handler_thread() -> None:  # what whatsmeow's callbacks do
            for i in range(50):
                taken.append(bridge.hand_over(i))

        worker = threading.Thread(target=handler_thread)
        worker.start()
        got: list[int] = []
        await trio.sleep(0.2)
        # The handler is held back: only the buffer's worth (and one in hand) went in.
        assert len(taken) <= 5
        async for event in bridge.events():
            on_trio_thread.append(threading.get_ident() == trio_thread)
            got.append(event)
            if len(got) == 50:
                bridge.close()
        await trio.to_thread.run_sync(worker.join)
    assert got == list(range(50)) and all(taken) and all(on_trio_thread)


async def test_after_close_a_handler_returns_at_once_and_says_it_was_not_taken() -> None:
    with trio.fail_after(DEADLINE):
        bridge: ThreadBridge[str] = ThreadBridge(buffer=1)
        bridge.close()
        result = await trio.to_thread.run_sync(bridge.hand_over, "late")
    assert result is False


async def test_a_call_runs_off_the_trio_thread_within_the_limiter() -> None:
    with trio.fail_after(DEADLINE):
        bridge: ThreadBridge[None] = ThreadBridge(calls_at_once=2)
        running = 0
        most = 0
        lock = threading.Lock()
        trio_thread = threading.get_ident()

        def slow(n: int) -> int:
            nonlocal running, most
            assert threading.get_ident() != trio_thread
            with lock:
                running += 1
                most = max(most, running)
            threading.Event().wait(0.05)
            with lock:
                running -= 1
            return n * 2

        results: list[int] = []

        async def one(n: int) -> None:
            results.append(await bridge.call("double", slow, n))

        async with trio.open_nursery() as nursery:
            for n in range(6):
                nursery.start_soon(one, n)
    assert sorted(results) == [0, 2, 4, 6, 8, 10] and most == 2


async def test_a_call_past_its_deadline_is_a_transport_error_of_unknown_outcome(
    autojump_clock: trio.abc.Clock,
) -> None:
    release = threading.Event()
    with trio.fail_after(DEADLINE):
        bridge: ThreadBridge[None] = ThreadBridge(deadline_s=30)
        try:
            with pytest.raises(TransportError, match="send: no answer within 30 s") as caught:
                await bridge.call("send", release.wait)
        finally:
            release.set()  # the abandoned thread ends
    assert outcome_unknown(caught.value)


async def test_the_librarys_errors_are_channel_errors_mapped_or_transport() -> None:
    class LoggedOut(Exception):
        pass

    def fails() -> None:
        raise LoggedOut("401: logged out")

    with trio.fail_after(DEADLINE):
        bridge: ThreadBridge[None] = ThreadBridge()
        with pytest.raises(AuthError, match="run dshim login"):
            await bridge.call(
                "connect", fails, errors={LoggedOut: lambda e: AuthError(f"{e}: run dshim login")}
            )
        with pytest.raises(TransportError, match="connect: LoggedOut: 401: logged out"):
            await bridge.call("connect", fails)


async def test_a_message_handler_waits_until_the_trio_side_took_it_and_close_lets_it_go() -> None:
    with trio.fail_after(DEADLINE):
        bridge: ThreadBridge[str] = ThreadBridge()
        taken = trio.Event()
        returned: list[bool] = []

        def handler() -> None:
            returned.append(bridge.hand_over("m1", until=taken))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, handler)
            events = bridge.events()
            assert await events.__anext__() == "m1"
            await trio.sleep(0.05)
            assert returned == []  # still waiting: the ack would go out too early
            taken.set()
        assert returned == [True]

        waiting = trio.Event()  # never set: the bot stops instead

        def stuck() -> None:
            returned.append(bridge.hand_over("m2", until=waiting))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(trio.to_thread.run_sync, stuck)
            assert await events.__anext__() == "m2"
            bridge.close()
        await events.aclose()
        assert returned == [True, False]
