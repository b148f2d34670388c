"""A tab that reads slowly never holds the bot up and never sees a stale text.

Shell tests of :class:`dshim.channels.webchat.client.Tab` over an in-memory socket whose
``send`` waits until the test lets it go (a stalled browser): frames queue without
blocking whoever pushes them, a newer text of a message being written replaces the queued
older one, and a tab that falls too far behind is closed with 1013 so the page reloads.
"""

from __future__ import annotations

import json

import trio

from dshim.channels.base import WebSocketClosed
from dshim.channels.webchat.client import JOINED_MAX, Tab, Tabs
from dshim.channels.webchat.protocol import Member


class StalledSocket:
    """A websocket whose peer reads only when ``release`` is set."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.release = trio.Event()
        self.closed: tuple[int, str] | None = None

    path = "/ws"
    query = ""
    headers = ()

    async def receive(self) -> str | bytes:
        await trio.sleep_forever()
        raise AssertionError

    async def send(self, data: str) -> None:
        if self.closed is not None:
            raise WebSocketClosed(self.closed[0])
        await self.release.wait()
        self.sent.append(data)

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed = (code, reason)


def frame(mid: str, text: str, final: bool) -> str:
    return json.dumps({"type": "message", "id": mid, "text": text, "final": final})


async def test_a_stalled_tab_gets_the_newest_text_in_order_and_the_final_once(
    autojump_clock: trio.abc.Clock,
) -> None:
    ws = StalledSocket()
    tab = Tab(ws)
    async with trio.open_nursery() as nursery:
        tab.attach(nursery)
        await trio.sleep(1)  # the writer waits for frames; pushing never waits for it
        tab.push(frame("u1", "hello", True))
        for i in range(1, 200):
            tab.push(frame("b1", "x" * i, False), key="b1")
        tab.push(frame("u2", "another", True))
        tab.push(frame("b1", "x" * 500, True), key="b1")
        assert tab.queued == 3
        ws.release.set()
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    shown = [(f["id"], len(f["text"]), f["final"]) for f in map(json.loads, ws.sent)]
    # 201 texts of b1 became one (the final), still in its place before u2.
    assert shown == [("u1", 5, True), ("b1", 500, True), ("u2", 7, True)]


async def test_a_tab_too_far_behind_is_closed_so_the_page_reloads(
    autojump_clock: trio.abc.Clock,
) -> None:
    ws = StalledSocket()
    tab = Tab(ws, outbox_max=10)
    tabs = Tabs()
    assert tabs.admit(tab) == []
    tab.join(Member("c1", "direct", "u1", "Ann"))
    async with trio.open_nursery() as nursery:
        tab.attach(nursery)
        await trio.sleep(1)
        for i in range(20):
            assert tabs.broadcast("c1", frame(f"u{i}", "hi", True)) == 1
        assert tabs.broadcast("c2", frame("x", "not for this tab", True)) == 0
        ws.release.set()
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert ws.closed is not None and ws.closed[0] == 1013


async def test_an_idle_tab_holds_no_writer_task(autojump_clock: trio.abc.Clock) -> None:
    """The writer runs only while frames wait: many idle tabs cost no task each."""
    ws = StalledSocket()
    ws.release.set()
    tab = Tab(ws)
    async with trio.open_nursery() as nursery:
        tab.attach(nursery)
        await trio.sleep(1)
        assert len(nursery.child_tasks) == 0
        tab.push(frame("u1", "hello", True))
        assert len(nursery.child_tasks) == 1
        await trio.sleep(1)
        assert len(nursery.child_tasks) == 0 and tab.queued == 0
        tab.push(frame("u2", "again", True))
        await trio.sleep(1)
        assert len(nursery.child_tasks) == 0
        tab.detach()
        tab.push(frame("u3", "after the tab ended", True))
        await trio.sleep(1)
    assert [json.loads(f)["id"] for f in ws.sent] == ["u1", "u2"]


def test_broadcast_reaches_exactly_the_tabs_in_the_conversation() -> None:
    tabs = Tabs()
    ann, bob = Tab(StalledSocket(), client="a"), Tab(StalledSocket(), client="b")
    ann.join(Member("c1", "room", "ann", "Ann"))  # joined before it was admitted
    assert tabs.admit(ann) == [] and tabs.admit(bob) == []
    bob.join(Member("c1", "room", "bob", "Bob"))
    bob.join(Member("c2", "direct", "bob", "Bob"))
    assert tabs.broadcast("c1", "f") == 2 and tabs.broadcast("c2", "f") == 1
    ann.leave("c1")
    assert list(tabs.following("c1")) == [bob]
    for i in range(JOINED_MAX):  # the oldest conversations are left
        bob.join(Member(f"x{i}", "direct", "bob", "Bob"))
    assert tabs.broadcast("c1", "f") == 0 and tabs.broadcast("x0", "f") == 1
    tabs.remove(bob)
    assert tabs.broadcast("x0", "f") == 0 and len(tabs) == 1
    assert bob.queued == 3 and ann.queued == 1


class BatchingSocket(StalledSocket):
    """A socket that can write several frames at once (as the endpoint's can)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[int] = []

    async def send_many(self, texts: list[str]) -> None:
        await self.release.wait()
        self.writes.append(len(texts))
        self.sent.extend(texts)


async def test_frames_that_wait_together_are_written_together_in_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    ws = BatchingSocket()
    ws.release.set()
    tab = Tab(ws)
    async with trio.open_nursery() as nursery:
        tab.attach(nursery)
        for i in range(5):
            tab.push(frame(f"u{i}", "hi", True))
        tab.push(frame("b1", "x", False), key="b1")
        tab.push(frame("b1", "xy", True), key="b1")
        await trio.sleep(1)
        tab.push(frame("u9", "later", True))
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert ws.writes == [6]  # then the single later frame by send
    assert [json.loads(f)["id"] for f in ws.sent] == ["u0", "u1", "u2", "u3", "u4", "b1", "u9"]
    assert json.loads(ws.sent[5])["text"] == "xy"
