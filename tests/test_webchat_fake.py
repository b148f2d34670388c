"""The scripted web chat tab that ships in ``dshim.testing`` (``dshim.testing.fakes.webchat``).

Testing manifesto: the tab talks to dshim as ``dshim serve`` runs it (``tests.rig_webchat
.serving``: real SQLite store, the endpoint on hypercorn on 127.0.0.1 port 0, the echo
harness), on trio's autojump clock unless a subprocess needs real time.  What is asserted
is what a script author relies on: one error out of ``open_webchat_client``, refusals as
errors, the times it records, going offline and coming back, the flood and the process.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
import trio.testing

from dshim.channels.base import WebSocket
from dshim.http.app import Endpoint
from dshim.http.server import serve_endpoint
from dshim.testing.fakes.webchat import (
    BadServerFrame,
    FrameRefused,
    UpgradeRefused,
    WebchatClient,
    flood,
    open_webchat_client,
)
from tests.rig_webchat import serving, source_block

TOKEN = "wc-fake-token-5c1e9a"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(40)


def echo(text: str) -> str:
    return f"{source_block()}\n\n{text}"


async def test_a_refused_upgrade_is_one_error_at_once_never_retried(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with serving(tmp_path, token=TOKEN) as s:
        port = s.url.rsplit(":", 1)[1]
        t0 = trio.current_time()
        with pytest.raises(UpgradeRefused) as no_token:
            async with open_webchat_client(s.ws_url, user="u-ann", name="Ann") as tab:
                await tab.join("c1")
        with pytest.raises(UpgradeRefused) as foreign:
            async with open_webchat_client(
                s.ws_url, user="u-ann", name="Ann", token=TOKEN, origin="http://evil.example"
            ) as tab:
                await tab.join("c1")
        assert trio.current_time() - t0 < 0.1  # no backoff: not a single retry
        async with open_webchat_client(
            s.ws_url, user="u-ann", name="Ann", token=TOKEN, origin=f"http://127.0.0.1:{port}"
        ) as tab:
            await tab.join("c1")
            await tab.send("c1", "with the token")
            await tab.wait_until(lambda: any(m.final for m in tab.bot_messages("c1")))
    assert (no_token.value.status, foreign.value.status) == (401, 403)
    assert b"unauthorized" in no_token.value.body and TOKEN not in str(no_token.value)
    assert tab.bot_texts("c1") == [echo("with the token")] and tab.connections == 1


async def test_an_error_in_the_block_comes_out_as_itself(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with serving(tmp_path) as s:
        with pytest.raises(KeyError, match="mine"):
            async with open_webchat_client(s.ws_url, user="u-ann", name="Ann") as tab:
                await tab.join("c1")  # connected: trio-websocket's reader task runs
                raise KeyError("mine")


async def test_leaving_the_block_closes_the_socket_with_a_handshake_at_once(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with serving(tmp_path) as s:
        async with open_webchat_client(s.ws_url, user="u-ann", name="Ann") as tab:
            await tab.join("c1")
            assert s.endpoint.open_sockets == 1
            left = trio.current_time()
        closed = trio.current_time()
        await trio.testing.wait_all_tasks_blocked()
        assert s.endpoint.open_sockets == 0
    assert closed - left < 0.01  # not a timeout: dshim answered the close frame
    assert [f["type"] for f in tab.frames] == ["history"]


async def test_refusals_raise_with_dshims_code_and_message(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with (
        serving(tmp_path) as s,
        open_webchat_client(s.ws_url, user="u-ann", name="Ann") as tab,
    ):
        with pytest.raises(FrameRefused) as not_joined:
            await tab.send("c1", "before joining")
        await tab.join("c1")
        # (Small frames only: a multi-MiB frame on the autojump clock can let the clock
        # jump while both ends wait on the socket.)
        many = [(f"{i}.png", "image/png", PNG) for i in range(21)]
        with pytest.raises(FrameRefused) as too_many:
            await tab.send("c1", "too many", files=many)
        with pytest.raises(FrameRefused) as gone:
            await tab.answer("c1", "no-such-request", "allow_once")
        accepted = await tab.send("c1", "fine", client_id="mine-1")
    assert not_joined.value.code == "not_joined"
    assert too_many.value.code == "too_many_attachments"
    assert too_many.value.message == "21 attachments: at most 20 per message"
    assert gone.value.code == "not_found"
    assert accepted == {
        "type": "accepted",
        "client_id": "mine-1",
        "id": "u-ann/mine-1",
        "conversation": "c1",
    }
    assert tab.unacked == {}  # refused frames are not sent again on a reconnect


@asynccontextmanager
async def ann_in_c1(tmp_path: Path) -> AsyncIterator[WebchatClient]:
    """dshim serving the web chat, and Ann's tab in the direct conversation c1."""
    async with (
        serving(tmp_path) as s,
        open_webchat_client(s.ws_url, user="u-ann", name="Ann") as tab,
    ):
        await tab.join("c1")
        yield tab


async def test_frames_and_streamed_texts_carry_their_trio_times(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with ann_in_c1(tmp_path) as tab:
        sent_at = trio.current_time()
        mid = (await tab.send("c1", "echo:slow 6 a story"))["id"]
        await tab.wait_until(lambda: any(m.final for m in tab.answers_to(mid)))
        done_at = trio.current_time()
    assert [r.frame for r in tab.received] == tab.frames
    times = [r.at for r in tab.received]
    assert times == sorted(times) and times[-1] <= done_at
    [answer] = tab.answers_to(mid)
    assert len(answer.texts) >= 3 and answer.text == echo("echo:slow 6 a story")
    assert len(answer.times) == len(answer.texts)
    assert sent_at <= answer.times[0] < answer.times[-1] == answer.final_at
    # Each text shows when its frame arrived.
    arrivals = {(r.frame["text"], r.at) for r in tab.received if r.frame.get("id") == answer.id}
    assert set(zip(answer.texts, answer.times, strict=True)) <= arrivals


async def test_an_offline_tab_sends_nothing_then_rejoins_and_sends_what_waited(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with ann_in_c1(tmp_path) as tab:
        await tab.drop(reconnect=False)
        assert not tab.connected and tab.close_codes == [1006]  # cut: no close frame
        async with trio.open_nursery() as nursery:
            nursery.start_soon(functools.partial(tab.send, "c1", "written while offline"))
            await trio.sleep(60)
            assert tab.connections == 1 and tab.accepted == {}
            histories = sum(f["type"] == "history" for f in tab.frames)
            await tab.reconnect()
        await tab.wait_until(lambda: any(m.final for m in tab.bot_messages("c1")))
        await trio.sleep(5)
    assert tab.connections == 2
    assert sum(f["type"] == "history" for f in tab.frames) == histories + 1
    assert tab.bot_texts("c1") == [echo("written while offline")]


async def bad_frames(ws: WebSocket) -> None:
    await ws.receive()  # the join
    await ws.send("this is not JSON")
    await trio.sleep_forever()


async def test_a_frame_from_dshim_that_is_not_json_ends_the_tab_with_one_error(
    autojump_clock: trio.abc.Clock,
) -> None:
    endpoint = Endpoint()
    endpoint.mount_websocket("web", "ws", bad_frames)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        [base] = await nursery.start(
            functools.partial(serve_endpoint, endpoint, "127.0.0.1:0", shutdown=stop)
        )
        url = base.replace("http://", "ws://") + "/hooks/web/ws"
        with pytest.raises(BadServerFrame, match="not JSON"):
            async with open_webchat_client(url, user="u-ann", name="Ann") as tab:
                await tab.join("c1")
        stop.set()


async def test_a_flood_is_accepted_in_full_and_logged(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with serving(tmp_path) as s:
        result = await flood(s.ws_url, 30, conversations=3, size=200)
        logged = await s.store.message_log("web", "flood-1", limit=100)
    assert (result.sent, result.accepted, result.refused) == (30, 30, 0)
    mine = {m.message_id: m.text for m in logged if m.author_id == "u-flood"}
    assert sorted(mine) == sorted(f"u-flood/f{i}" for i in range(1, 30, 3))
    assert all(
        text.startswith(f"{mid[9:]} ") and len(text) == 201 + len(mid[9:])
        for mid, text in mine.items()
    )


async def test_the_process_says_a_message_and_prints_the_answer(tmp_path: Path) -> None:
    async with serving(tmp_path, inline=False) as s:
        with trio.fail_after(60):
            done = await trio.run_process(
                [sys.executable, "-m", "dshim.testing.fakes.webchat", s.ws_url, "--say", "hi"],
                capture_stdout=True,
                capture_stderr=True,
            )
    assert done.stdout.decode() == source_block("direct", "u-script", "Script") + "\n\nhi\n"
