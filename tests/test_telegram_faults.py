"""The fault matrix on Telegram: a 10-second outage while 20 users wait for answers.

The bot runs through serve_bots against the fake Bot API (127.0.0.1, autojump clock,
real SQLite store); the fake's ``outage`` makes every call (or only ``sendMessage``)
fail for 10 s — answered with a 500, dropped before it is processed, or processed with
its answer lost.  What the users see is counted: every answer arrives, exactly once,
except that a send whose answer was lost after processing may show one extra copy.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from dshim.pipeline.runtime import LATE_ANSWER_TEXT
from dshim.testing.fakes.telegram import FakeTelegram
from tests.rig_telegram import (
    ADA,
    DEADLINE,
    echo_of,
    polling,
    running_bot,
    telegram_world,
)

USERS = [FakeTelegram.user(1000 + i, f"User{i}") for i in range(20)]


@pytest.mark.parametrize(
    ("kind", "ops"),
    [
        ("500", ()),  # 500 on every call
        ("drop", ()),  # every connection dropped before processing
        ("500", ("sendMessage",)),  # 500 on send
        ("drop", ("sendMessage",)),  # sends dropped before processing
    ],
)
async def test_a_ten_second_outage_loses_no_answer(
    autojump_clock: trio.abc.Clock, tmp_path: Path, kind: str, ops: tuple[str, ...]
) -> None:
    with trio.fail_after(DEADLINE):
        async with telegram_world(tmp_path) as (fake, store, clock):
            chats = [fake.private_chat(u) for u in USERS]
            async with running_bot(fake, store, clock):
                await polling(fake)
                for chat, user in zip(chats, USERS, strict=True):
                    fake.user_message(chat, user, f"echo:sleep 2 question of {user['first_name']}")
                await trio.sleep(0.5)
                fake.outage(10.0, kind, ops)
                await fake.wait_until(
                    lambda: all(len(fake.bot_messages(u["id"])) >= 1 for u in USERS)
                )
                await trio.sleep(300)  # every retry the bot would make has happened
    for user in USERS:
        texts = [m.text for m in fake.bot_messages(user["id"])]
        assert texts == [echo_of(user, f"echo:sleep 2 question of {user['first_name']}")]


async def test_sends_lost_after_processing_show_at_most_one_extra_copy(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with telegram_world(tmp_path) as (fake, store, clock):
            chats = [fake.private_chat(u) for u in USERS]
            async with running_bot(fake, store, clock):
                await polling(fake)
                for chat, user in zip(chats, USERS, strict=True):
                    fake.user_message(chat, user, f"echo:sleep 2 question of {user['first_name']}")
                await trio.sleep(0.5)
                fake.outage(10.0, "lost", ("sendMessage",))
                await fake.wait_until(
                    lambda: all(len(fake.bot_messages(u["id"])) >= 1 for u in USERS)
                )
                await trio.sleep(300)
    for user in USERS:
        answer = echo_of(user, f"echo:sleep 2 question of {user['first_name']}")
        texts = [m.text for m in fake.bot_messages(user["id"])]
        assert texts and all(t == answer for t in texts) and len(texts) <= 2


async def test_an_outage_longer_than_the_retries_delivers_from_the_outbox_when_back(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with telegram_world(tmp_path) as (fake, store, clock):
            chat = fake.private_chat(ADA)
            async with running_bot(fake, store, clock):
                await polling(fake)
                fake.user_message(chat, ADA, "echo:sleep 2 are you there?")
                await trio.sleep(0.5)
                fake.outage(240.0, "500", ("sendMessage",))  # twice the engine's retries
                await trio.sleep(200)
                assert fake.bot_messages(ADA["id"]) == []  # still down, nothing given up
                await fake.wait_until(lambda: len(fake.bot_messages(ADA["id"])) >= 1)
                await trio.sleep(600)
    assert [m.text for m in fake.bot_messages(ADA["id"])] == [
        echo_of(ADA, "echo:sleep 2 are you there?")
    ]


async def test_a_postponed_answer_survives_a_restart(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with telegram_world(tmp_path) as (fake, store, clock):
            chat = fake.private_chat(ADA)
            async with running_bot(fake, store, clock):
                await polling(fake)
                fake.user_message(chat, ADA, "echo:sleep 2 hold on to this")
                await trio.sleep(0.5)
                fake.outage(400.0, "500", ("sendMessage",))
                await trio.sleep(200)  # postponed by now; then a restart during the outage
            assert fake.bot_messages(ADA["id"]) == []
            async with running_bot(fake, store, clock):
                await fake.wait_until(lambda: len(fake.bot_messages(ADA["id"])) >= 1)
                await trio.sleep(60)
    assert [m.text for m in fake.bot_messages(ADA["id"])] == [
        echo_of(ADA, "echo:sleep 2 hold on to this")
    ]


async def test_an_answer_too_late_to_make_sense_becomes_a_short_notice(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE * 3):
        async with telegram_world(tmp_path) as (fake, store, clock):
            chat = fake.private_chat(ADA)
            async with running_bot(fake, store, clock):
                await polling(fake)
                fake.user_message(chat, ADA, "echo:sleep 2 old news")
                await trio.sleep(0.5)
                fake.outage(1200.0, "500", ("sendMessage",))  # past backlog_max_age_s (600)
                await fake.wait_until(lambda: len(fake.bot_messages(ADA["id"])) >= 1)
                await trio.sleep(600)
    [notice] = fake.bot_messages(ADA["id"])
    assert notice.text == LATE_ANSWER_TEXT
