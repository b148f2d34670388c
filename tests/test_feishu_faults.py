"""The fault matrix on Feishu: a 10-second outage while 20 users wait for answers.

The bot runs through serve_bots against the fake Open API and long connection (127.0.0.1,
autojump clock, real SQLite store, echo harness; see ``tests/test_feishu_e2e.py``).  The
fake's ``outage`` makes every Open API call (or only the sends: replies, creates, card
creates and card updates) fail for 10 s -- answered with a 500, dropped before it is
processed, or processed with its answer lost.  What the users see is counted: every
answer arrives, exactly once and complete, except that a call whose answer was lost after
processing may show one extra copy; the bot never restarts.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio
from structlog.testing import capture_logs

from dshim.testing.fakes.feishu import FakeFeishu
from tests.fault_matrix import matrix, restarts
from tests.rig_feishu import DEADLINE, running_bot, source

USERS = [{"open_id": f"ou_user{i:02d}00000000000000000000000", "name": f"U{i}"} for i in range(20)]
CHATS = [f"oc_dm{i:02d}000000000000000000000000" for i in range(20)]
SENDS = (
    "POST /open-apis/im/v1/messages/{message_id}/reply",
    "POST /open-apis/im/v1/messages",
    "POST /open-apis/cardkit/v1/cards",
    "PUT /open-apis/cardkit/v1/cards/{card_id}/elements/{element_id}/content",
    "PATCH /open-apis/cardkit/v1/cards/{card_id}/settings",
    "PUT /open-apis/im/v1/messages/{message_id}",
)
MATRIX = matrix(SENDS)


def question(i: int) -> str:
    return f"echo:sleep 2 question of {USERS[i]['name']}"


def answer_of(fake: FakeFeishu, i: int) -> str:
    return f"{source(fake, 'direct', USERS[i])}\n\n{question(i)}"


def shown(fake: FakeFeishu, i: int) -> list[str]:
    return [b.text for b in fake.bot_messages(CHATS[i])]


async def ask_everyone(fake: FakeFeishu) -> None:
    for i, (user, chat) in enumerate(zip(USERS, CHATS, strict=True)):
        fake.dm_chats[user["open_id"]] = chat
        await fake.user_message(chat, question(i), sender=user)


def answered(fake: FakeFeishu) -> bool:
    return all(answer_of(fake, i) in shown(fake, i) for i in range(len(USERS)))


def streaming_cards(fake: FakeFeishu) -> list[str]:
    """The cards still shown as generating (streaming mode never turned off)."""
    return [
        cid
        for cid, card in fake.cards.items()
        if card["sent"] and card["card"].get("config", {}).get("streaming_mode")
    ]


@pytest.mark.parametrize(("kind", "ops"), MATRIX)
async def test_a_ten_second_outage_loses_no_answer(
    tmp_path: Path, autojump_clock: trio.abc.Clock, kind: str, ops: tuple[str, ...]
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            await ask_everyone(fake)
            await trio.sleep(0.5)
            fake.outage(10.0, kind, ops)
            await fake.wait_until(lambda: answered(fake))
            await trio.sleep(300)  # every retry the bot would make has happened
    for i in range(len(USERS)):
        assert shown(fake, i) == [answer_of(fake, i)]
    assert streaming_cards(fake) == []
    assert restarts(logs) == []


async def test_calls_lost_after_processing_show_at_most_one_extra_copy(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            await ask_everyone(fake)
            await trio.sleep(0.5)
            fake.outage(10.0, "lost", SENDS)
            await fake.wait_until(lambda: answered(fake))
            await trio.sleep(300)
    for i in range(len(USERS)):
        texts = shown(fake, i)
        assert texts.count(answer_of(fake, i)) in (1, 2) and len(texts) <= 2, texts
        assert all(answer_of(fake, i).startswith(t) for t in texts), texts
    assert restarts(logs) == []


@pytest.mark.parametrize("kind", ["500", "drop"])
async def test_an_outage_longer_than_the_retries_delivers_the_answer_when_back(
    tmp_path: Path, autojump_clock: trio.abc.Clock, kind: str
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            fake.dm_chats[USERS[0]["open_id"]] = CHATS[0]
            await fake.user_message(CHATS[0], question(0), sender=USERS[0])
            await trio.sleep(0.5)
            fake.outage(200.0, kind, SENDS)  # longer than send_retry_s (120 s)
            await trio.sleep(150)
            assert shown(fake, 0) == []  # still down: nothing given up
            await fake.wait_until(lambda: answer_of(fake, 0) in shown(fake, 0))
            await trio.sleep(300)
    assert shown(fake, 0) == [answer_of(fake, 0)]
    assert restarts(logs) == []


async def test_answers_lost_for_hours_are_not_repeated_past_the_uuid_hour(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    # Every send is processed but its answer lost, for longer than Feishu's one-hour uuid
    # window: the outbox repeats the answer only while a repeat is the same send, then
    # gives it up as unknown (it may well be on screen), never a loop of copies.
    with trio.fail_after(DEADLINE * 10):
        async with running_bot(tmp_path, deadline=DEADLINE * 10) as (bot, fake):
            fake.dm_chats[USERS[0]["open_id"]] = CHATS[0]
            await fake.user_message(CHATS[0], question(0), sender=USERS[0])
            await trio.sleep(0.5)
            fake.outage(5400.0, "lost", SENDS)
            await trio.sleep(3600 + 600)
            calls = sum(len(fake.calls_to(op)) for op in SENDS)
            await trio.sleep(1200)  # still within the outage: nothing is tried any more
            assert sum(len(fake.calls_to(op)) for op in SENDS) == calls
