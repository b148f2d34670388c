"""The web chat's sockets under abuse: sockets that never join, or hold every slot, never
keep a real tab out.

Every test runs the web chat as ``dshim serve`` does (:func:`tests.rig_webchat.serving`:
the real SQLite store, hypercorn on 127.0.0.1 port 0, the echo harness) and talks to it
over real sockets: hostile ones with the hand-written RFC 6455 client of
``tests/test_http_abuse.py`` (it can open a socket and say nothing, or never answer a
ping; ``local`` picks another loopback address, another client), real tabs with the
product's scripted tab (:mod:`dshim.testing.fakes.webchat`) or trio-websocket (they
answer pings).  Where a test is about the 10 s join rule or pings it runs on the autojump
clock; where it is about the caps it runs on the real clock, so the join rule cannot
free a slot behind the test's back (those tests take well under a second).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from dshim.channels.webchat import client as webchat_client
from dshim.channels.webchat.channel import JOIN_DEADLINE_S, JOIN_TIMEOUT_CODE
from dshim.channels.webchat.client import TABS_MAX, TABS_PER_ADDRESS, TABS_PER_CLIENT
from dshim.http.wsstream import PING_INTERVAL_S
from tests.http_client import open_ws
from tests.rig_webchat import ChatClient, Served, serving, source_block
from tests.test_http_abuse import RawSocket

TOO_MANY = 1013


def join(conversation: str, user: str, name: str = "Ann") -> bytes:
    frame = {"type": "join", "conversation": conversation, "user": {"id": user, "name": name}}
    return json.dumps(frame).encode()


async def close_frame(sock: RawSocket) -> tuple[int, str] | None:
    """Read (ignoring everything else) until the server's close frame: (code, reason)."""
    while (frame := await sock.read_frame()) is not None:
        opcode, payload = frame
        if opcode == 0x8:
            return int.from_bytes(payload[:2], "big"), payload[2:].decode()
    return None


async def joined(stack: AsyncExitStack, s: Served, local: str, user: str) -> RawSocket:
    """A raw socket from ``local`` that joined a conversation as ``user`` (history seen)."""
    sock = await stack.enter_async_context(RawSocket.open(s.url, local=local))
    assert sock.status == 101
    await sock.send_frame(join(f"c-{user}", user))
    frame = await sock.read_message()
    assert frame is not None and json.loads(frame[1])["type"] == "history", frame
    return sock


async def answered(tab: ChatClient, conversation: str, text: str) -> str:
    """Send ``text`` and wait for the bot's final answer to it."""
    mid = await tab.send(conversation, text)
    await tab.wait_until(lambda: any(m.final for m in tab.answers_to(mid)))
    [answer] = [m for m in tab.answers_to(mid) if m.final]
    return answer.text


# --- sockets that never join -----------------------------------------------------------------


@pytest.mark.parametrize(
    "attackers",
    [("127.0.0.2",), ("127.0.0.1",), ("127.0.0.2", "127.0.0.3", "127.0.0.4", "127.0.0.5")],
    ids=["another-address", "the-same-address", "four-addresses"],
)
async def test_never_joined_sockets_never_keep_a_real_tab_out(
    tmp_path: Path, attackers: Sequence[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A smaller cap than TABS_MAX (thousands): the rule is the same, the test stays quick.
    cap = min(TABS_MAX, 256)
    monkeypatch.setattr(webchat_client, "TABS_MAX", cap)
    # The real clock: the tab gets in at once, not once the 10 s join rule freed a slot.
    async with serving(tmp_path) as s, AsyncExitStack() as stack:
        idle: list[RawSocket] = []
        with trio.fail_after(30):
            for i in range(cap):
                sock = await stack.enter_async_context(
                    RawSocket.open(s.url, local=attackers[i % len(attackers)])
                )
                assert sock.status == 101
                idle.append(sock)
        # A real tab (from 127.0.0.1, as a local browser) joins and gets its answer.
        with trio.fail_after(JOIN_DEADLINE_S / 2):
            async with ChatClient(s.ws_url).running() as ann:
                await ann.join("c1")
                assert await answered(ann, "c1", "hello") == f"{source_block()}\n\nhello"
                assert TOO_MANY not in ann.close_codes and ann.connections == 1
        # The oldest socket that had not joined was closed to make room, saying why.
        with trio.fail_after(5):
            code, reason = await close_frame(idle[0]) or (None, "")
        assert code == TOO_MANY and "not joined" in reason


async def test_a_socket_that_does_not_join_within_10_s_is_closed_one_that_joins_stays(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with (
        serving(tmp_path) as s,
        RawSocket.open(s.url) as silent,
        RawSocket.open(s.url) as wrong,
        open_ws(s.url, "/ws") as late,
    ):
        start = trio.current_time()
        # A join that is refused (a user id dshim does not take) is no join.
        await wrong.send_frame(join("c1", "bad/id"))
        error = await wrong.read_message()
        assert error is not None and json.loads(error[1])["type"] == "error"
        # A real tab joins in its first seconds (the page joins as soon as it is open).
        await trio.sleep(JOIN_DEADLINE_S / 2)
        await late.send_message(join("c1", "u-ann").decode())
        assert json.loads(await late.get_message())["type"] == "history"
        with trio.fail_after(PING_INTERVAL_S * 3):
            closes = [await close_frame(silent), await close_frame(wrong)]
        elapsed = trio.current_time() - start
        reason = f"no join within {JOIN_DEADLINE_S:g} s"
        assert closes == [(JOIN_TIMEOUT_CODE, reason)] * 2
        assert elapsed >= JOIN_DEADLINE_S
        # The joined one stays, silent as it is, for as long as it answers pings.
        await trio.sleep(30 * PING_INTERVAL_S)
        send = {"type": "send", "client_id": "k1", "conversation": "c1", "text": "still here"}
        await late.send_message(json.dumps(send))
        frames: list[dict[str, object]] = []
        with trio.fail_after(30):
            while not any(f.get("type") == "accepted" for f in frames):
                frames.append(json.loads(await late.get_message()))


async def test_a_joined_socket_that_stops_answering_pings_is_closed_and_its_slot_freed(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with serving(tmp_path) as s, AsyncExitStack() as stack:
        dead = await joined(stack, s, "127.0.0.1", "u-gone")
        start = trio.current_time()
        with trio.fail_after(PING_INTERVAL_S * 5):
            code, _ = await close_frame(dead) or (None, "")
        assert code == 1001  # no answer to ping
        assert PING_INTERVAL_S <= trio.current_time() - start <= 3 * PING_INTERVAL_S
        # Its slot is free: the address can hold as many tabs as ever.
        with trio.fail_after(60):
            for i in range(TABS_PER_ADDRESS):
                await joined(stack, s, "127.0.0.1", f"u{i // TABS_PER_CLIENT}")


# --- the caps: per client (address + user), per address, for all ------------------------------


async def test_tabs_are_capped_per_client_and_per_address_and_others_still_get_in(
    tmp_path: Path,
) -> None:
    async with serving(tmp_path) as s, AsyncExitStack() as stack:
        with trio.fail_after(30):
            for _ in range(TABS_PER_CLIENT):
                await joined(stack, s, "127.0.0.1", "u-ann")
            # One more tab of the same user from the same address is refused when it
            # joins, with a reason the page can show.
            extra = await stack.enter_async_context(RawSocket.open(s.url, local="127.0.0.1"))
            await extra.send_frame(join("c-u-ann", "u-ann"))
            assert await close_frame(extra) == (TOO_MANY, "too many open tabs for this user")
            # Another user behind the same address, and the same user id from another
            # address, are other clients.
            await joined(stack, s, "127.0.0.1", "u-bob")
            await joined(stack, s, "127.0.0.2", "u-ann")

            # One address full of joined tabs (of several users) is refused any more ...
            for i in range(TABS_PER_ADDRESS):
                await joined(stack, s, "127.0.0.3", f"u{i // TABS_PER_CLIENT}")
            more = await stack.enter_async_context(RawSocket.open(s.url, local="127.0.0.3"))
            assert await close_frame(more) == (TOO_MANY, "too many open tabs")
        # ... and cannot keep anyone else out: another user's tab chats at once.
        with trio.fail_after(5):
            async with ChatClient(s.ws_url, user=("u-cy", "Cy")).running() as cy:
                await cy.join("c1")
                expected = f"{source_block(user='u-cy', name='Cy')}\n\nhi"
                assert await answered(cy, "c1", "hi") == expected
