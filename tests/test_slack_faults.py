"""The fault matrix on Slack: a 10-second outage while 20 users wait for answers in DMs.

The bot runs through serve_bots against the fake Slack (127.0.0.1, autojump clock, real
SQLite store, echo harness; see ``tests/test_slack_e2e.py``).  The fake's ``outage``
makes every Web API call (or only the ``chat.*`` sends) fail for 10 s -- answered with a
500, dropped before it is processed, or processed with its answer lost -- and its fault
queue answers 429 storms with ``Retry-After``.  Half of the users get an answer that
comes whole (``chat.startStream`` + ``chat.stopStream``), half one that is streamed
while it is written (``chat.appendStream``), and the same runs on the
``chat.postMessage`` / ``chat.update`` fallback (``stream = false``).  What the users see
is counted: every answer arrives, exactly once and complete (a streamed message stopped),
except that a call whose answer was lost after processing may show one extra copy; the
bot never restarts.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.slack.protocol import unescape
from dshim.testing.fakes.slack import FakeSlack
from tests.fault_matrix import matrix, restarts
from tests.test_slack_e2e import Bot, running_bot, source

USERS = [(f"U0USR{i:04d}", f"User {i}") for i in range(20)]
SENDS = ("chat.startStream", "chat.appendStream", "chat.stopStream", "chat.postMessage")
SENDS += ("chat.update",)
#: Virtual seconds: the answers' wait (500 at most) and the 300 s after them.
DEADLINE = 1200.0

MATRIX = matrix(SENDS)


def question(i: int) -> str:
    # Even users: an answer that comes whole after 2 s; odd: one written in 6 pieces.
    pace = "echo:sleep 2" if i % 2 == 0 else "echo:sleep 1 echo:slow 6"
    return f"{pace} question of user {i}"


def answer_of(fake: FakeSlack, i: int) -> str:
    user, name = USERS[i]
    return source(fake, "direct", user=user, name="") + "\n\n" + question(i)


@asynccontextmanager
async def twenty_dms(tmp_path: Path, **options: Any) -> AsyncIterator[tuple[Bot, FakeSlack]]:
    """The bot, with 20 people who each wrote it a DM half a second ago."""
    async with running_bot(tmp_path, **options) as (bot, fake):
        for i, (user, name) in enumerate(USERS):
            channel = fake.add_dm(user, name)
            await fake.user_message(channel, question(i), user=user)
        await trio.sleep(0.5)
        yield bot, fake


def shown(fake: FakeSlack, i: int) -> list[str]:
    """What user ``i``'s DM shows: the bot's messages as they are now, as text."""
    return [unescape(m.text) for m in fake.bot_messages(fake.dm_channels[USERS[i][0]])]


def answered(fake: FakeSlack) -> bool:
    return all(answer_of(fake, i) in shown(fake, i) for i in range(len(USERS)))


def streaming(fake: FakeSlack) -> list[str]:
    """Messages left in the streaming state (never stopped)."""
    return [m.ts for m in fake.messages.values() if m.streaming]


@pytest.mark.parametrize("stream", [True, False], ids=["native", "fallback"])
@pytest.mark.parametrize(("kind", "ops"), MATRIX)
async def test_a_ten_second_outage_loses_no_answer(
    tmp_path: Path,
    autojump_clock: trio.abc.Clock,
    kind: str,
    ops: tuple[str, ...],
    stream: bool,
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with twenty_dms(tmp_path, stream=stream) as (bot, fake):
            fake.outage(10.0, kind, ops)
            with trio.move_on_after(500):  # else the assertions below say what is missing
                await fake.wait_until(lambda: answered(fake))
            await trio.sleep(300)  # every retry the bot would make has happened
    for i in range(len(USERS)):
        assert shown(fake, i) == [answer_of(fake, i)], i
    assert streaming(fake) == []
    assert restarts(logs) == []


@pytest.mark.parametrize("stream", [True, False], ids=["native", "fallback"])
async def test_sends_lost_after_processing_show_at_most_one_extra_copy(
    tmp_path: Path, autojump_clock: trio.abc.Clock, stream: bool
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with twenty_dms(tmp_path, stream=stream) as (bot, fake):
            fake.outage(10.0, "lost", SENDS)
            with trio.move_on_after(500):  # else the assertions below say what is missing
                await fake.wait_until(lambda: answered(fake))
            await trio.sleep(300)
    for i in range(len(USERS)):
        answer = answer_of(fake, i)
        texts = shown(fake, i)
        assert texts.count(answer) in (1, 2), texts
        assert len(texts) <= 2, texts
        assert all(answer.startswith(t) for t in texts), texts  # at most a cut-off copy
    assert restarts(logs) == []


@pytest.mark.parametrize("stream", [True, False], ids=["native", "fallback"])
async def test_a_429_storm_on_chat_methods_gives_one_complete_answer_per_message(
    tmp_path: Path, autojump_clock: trio.abc.Clock, stream: bool
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with running_bot(tmp_path, stream=stream) as (bot, fake):
            for method in SENDS:
                fake.fail_next(method, 10, status=429, retry_after=30)
            for i, (user, name) in enumerate(USERS):
                channel = fake.add_dm(user, name)
                await fake.user_message(channel, question(i), user=user)
            with trio.move_on_after(500):  # else the assertions below say what is missing
                await fake.wait_until(lambda: answered(fake))
            await trio.sleep(300)
    for i in range(len(USERS)):
        assert shown(fake, i) == [answer_of(fake, i)], i
    assert streaming(fake) == []
    assert restarts(logs) == []
    # Retry-After was honoured: once a 429 came back, no call of that method for 30 s
    # (calls at the same instant were on their way already).
    for method in SENDS:
        calls = fake.calls_to(method)
        for limited in (c.at for c in calls if c.status == 429):
            assert not [c.at for c in calls if limited < c.at < limited + 30 - 1e-6], method


async def test_a_stop_whose_answer_was_lost_is_the_answer_not_posted_again(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(DEADLINE):
        async with running_bot(tmp_path) as (bot, fake):
            fake.outage(
                60.0, "lost", ("chat.stopStream",)
            )  # the stop works, its answer never comes
            await fake.user_message(fake.dm, "echo:slow 4 a story")
            await trio.sleep(400)
    final = source(fake, "direct") + "\n\necho:slow 4 a story"
    assert [unescape(t) for t in fake.texts(fake.dm)] == [final]
    assert streaming(fake) == []
    assert not fake.calls_to("chat.postMessage")


async def test_appends_whose_answers_were_lost_leave_the_final_text_once(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(DEADLINE):
        async with running_bot(tmp_path) as (bot, fake):
            fake.outage(60.0, "lost", ("chat.appendStream",))  # appended, or not? unknown
            await fake.user_message(fake.dm, "echo:slow 8 a longer story")
            await trio.sleep(400)
    final = source(fake, "direct") + "\n\necho:slow 8 a longer story"
    assert [unescape(t) for t in fake.texts(fake.dm)] == [final]  # set whole by chat.update
    assert streaming(fake) == []


async def test_an_outage_longer_than_the_retries_delivers_from_the_outbox_when_back(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            await fake.user_message(fake.dm, "echo:sleep 2 are you there?")
            await trio.sleep(0.5)
            fake.outage(300.0, "500", SENDS)  # more than twice the engine's retries
            await trio.sleep(250)
            assert fake.texts(fake.dm) == []  # still down, nothing given up
            with trio.move_on_after(400):
                await fake.wait_until(lambda: bool(fake.texts(fake.dm)))
            await trio.sleep(60)
    final = source(fake, "direct") + "\n\necho:sleep 2 are you there?"
    assert [unescape(t) for t in fake.texts(fake.dm)] == [final]
    assert restarts(logs) == []
