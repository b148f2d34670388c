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

from dshim.testing.fakes.telegram import FakeTelegram
from tests.test_telegram_e2e import DEADLINE, echo_of, polling, running_bot, telegram_world

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
