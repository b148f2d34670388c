"""The fault matrix on WeChat (iLink): a 10-second outage while 20 users wait.

The bot runs through serve_bots against the fake iLink API (127.0.0.1, autojump clock,
real SQLite store, echo harness; see ``tests/rig_weixin.py``).  The fake's ``outage``
makes every call (or only ``sendmessage``) fail for 10 s -- answered with a 500, dropped
before it is processed, or processed with its answer lost.  An outage of everything also
cuts the long poll: half of the users write before it, half during it, and theirs arrive
once it is over.  What the users see is counted: every answer arrives exactly once,
except that a send whose answer was lost may show one extra copy; the bot never restarts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.weixin.client import USER_AGENT, IlinkClient
from dshim.errors import TransportError
from dshim.net.http import open_http
from dshim.testing.fakes.weixin import TEST_TOKEN, FakeWeixin
from tests.fault_matrix import matrix, restarts
from tests.rig_weixin import DEADLINE, echo_of, polling, running_bot, texts, weixin_world

SENDS = ("sendmessage",)
MATRIX = matrix(SENDS)
USERS = [f"o9cq80{i:02d}_fault_user@im.wechat" for i in range(20)]


def question(user: str) -> str:
    return f"echo:sleep 2 question of {user[:8]}"


def answered(fake: FakeWeixin, users: list[str]) -> bool:
    return all(echo_of(question(u), user=u) in texts(fake, u) for u in users)


@pytest.mark.parametrize(("kind", "ops"), [*MATRIX, ("lost", SENDS)])
async def test_a_ten_second_outage_loses_no_answer(
    tmp_path: Path, autojump_clock: trio.abc.Clock, kind: str, ops: tuple[str, ...]
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with weixin_world(tmp_path) as w, running_bot(w):
            fake = w.fake
            await polling(fake)
            for user in USERS[:10]:
                fake.user_message(question(user), user=user)
            await trio.sleep(0.5)
            fake.outage(10.0, kind, ops)
            for user in USERS[10:]:  # while everything is down, the poll brings nothing
                fake.user_message(question(user), user=user)
            await fake.wait_until(lambda: answered(fake, USERS))
            await trio.sleep(300)  # every retry the bot would make has happened
    for user in USERS:
        got = texts(fake, user)
        answer = echo_of(question(user), user=user)
        if kind == "lost":
            assert got and set(got) == {answer} and len(got) <= 2, got
        else:
            assert got == [answer], got
    assert len(fake.calls_to("sendmessage")) > len(USERS)  # the outage did hit sends
    assert restarts(logs) == []
    assert [e for e in logs if e["event"] == "answer_postponed"] == []


async def test_an_outage_longer_than_the_retries_delivers_from_the_outbox_when_back(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with weixin_world(tmp_path) as w, running_bot(w):
            fake = w.fake
            await polling(fake)
            fake.user_message("echo:sleep 2 are you there?")
            await trio.sleep(0.5)
            fake.outage(300.0, "500", SENDS)
            await trio.sleep(250)
            assert texts(fake) == []  # still down, nothing given up
            await fake.wait_until(lambda: len(texts(fake)) >= 1)
            await trio.sleep(120)
    assert texts(fake) == [echo_of("echo:sleep 2 are you there?")]
    assert [e["event"] for e in logs if e["event"] == "answer_postponed"] == ["answer_postponed"]
    assert restarts(logs) == []


async def test_a_minute_of_500s_is_retried_within_the_reply(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with weixin_world(tmp_path) as w, running_bot(w):
            fake = w.fake
            await polling(fake)
            fake.user_message("echo:sleep 2 hello")
            await trio.sleep(0.5)
            fake.outage(60.0, "500", SENDS)
            await fake.wait_until(lambda: len(texts(fake)) >= 1)
            await trio.sleep(120)
    assert texts(fake) == [echo_of("echo:sleep 2 hello")]
    assert [e for e in logs if e["event"] == "answer_postponed"] == []


async def test_the_reachability_probe_is_getconfig_and_only_the_network_fails_it(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(DEADLINE):
        async with (
            weixin_world(tmp_path) as w,
            open_http(w.fake.url, user_agent=USER_AGENT) as http,
        ):
            client = IlinkClient(http, TEST_TOKEN)
            await client.reachable()
            assert [c.op for c in w.fake.calls] == ["getconfig"]
            w.fake.fail_next("getconfig", ret=-2)  # an iLink answer: reachable all the same
            await client.reachable()
            w.fake.outage(5.0, "drop")
            with pytest.raises(TransportError):
                await client.reachable()
