"""The fault matrix on DingTalk: a 10-second outage while 20 users wait for answers.

The bot runs through serve_bots against the fake DingTalk (127.0.0.1, autojump clock,
real SQLite store, echo harness; see ``tests/test_dingtalk_e2e.py``).  The fake's
``outage`` makes every HTTP call (or only the sends: card calls, robot sends, session
webhooks) fail for 10 s -- answered with a 500, dropped before it is processed, or
processed with its answer lost.  Half of the users get an answer that comes whole after
2 s, half one written in 6 pieces; the same runs with ``answer = "markdown"``.  What the
users see is counted: every answer arrives, exactly once and complete (a card finished,
never left writing), except that a send whose answer was lost after processing may show
one extra copy; the bot never restarts.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from structlog.testing import capture_logs

from dshim.testing.fakes.dingtalk import FakeDingTalk
from tests.fault_matrix import matrix, restarts
from tests.test_dingtalk_e2e import Bot, running_bot

USERS = [(f"staff{i:04d}", f"User {i}") for i in range(20)]
SENDS = (
    "POST /v1.0/card/instances",
    "POST /v1.0/card/instances/deliver",
    "PUT /v1.0/card/streaming",
    "PUT /v1.0/card/instances",
    "POST /v1.0/robot/oToMessages/batchSend",
    "POST /v1.0/robot/groupMessages/send",
    "POST /robot/sendBySession",
)
MATRIX = matrix(SENDS)
#: Virtual seconds: the answers' wait (500 at most) and the 300 s after them.
DEADLINE = 1200.0
MODES = pytest.mark.parametrize("answer", ["card", "markdown"])


def question(i: int) -> str:
    # Even users: an answer that comes whole after 2 s; odd: one written in 6 pieces.
    pace = "echo:sleep 2" if i % 2 == 0 else "echo:sleep 1 echo:slow 6"
    return f"{pace} question of user {i}"


def answer_of(i: int, text: str | None = None) -> str:
    staff, nick = USERS[i]
    block = {
        "channel": "dingtalk",
        "conversationType": "direct",
        "senderId": staff,
        "senderName": nick,
    }
    src = "<dsh_im_source>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_source>"
    return f"{src}\n\n{text if text is not None else question(i)}"


def conversation(i: int) -> str:
    return f"cidDM{USERS[i][0]}=="


def shown(fake: FakeDingTalk, i: int) -> list[str]:
    """What user ``i``'s chat shows of the bot: cards and markdown, as they are now."""
    return [m.text for m in fake.bot_messages(conversation(i))]


def answered(fake: FakeDingTalk) -> bool:
    return all(answer_of(i) in shown(fake, i) for i in range(len(USERS)))


def writing(fake: FakeDingTalk) -> list[str]:
    """Cards left in their streaming state (not finalized, or not marked finished)."""
    return [
        m.id
        for m in fake.messages
        if m.kind == "card" and (not m.finalized or m.flow_status != "3")
    ]


@asynccontextmanager
async def twenty_dms(tmp_path: Path, **options: Any) -> AsyncIterator[tuple[Bot, FakeDingTalk]]:
    """The bot, with 20 people who each wrote it directly half a second ago."""
    async with running_bot(tmp_path, **options) as (bot, fake):
        for i, (staff, nick) in enumerate(USERS):
            fake.user_message(fake.add_user(staff, nick), question(i), user=staff)
        await trio.sleep(0.5)
        yield bot, fake


@MODES
@pytest.mark.parametrize(("kind", "ops"), MATRIX)
async def test_a_ten_second_outage_loses_no_answer(
    tmp_path: Path, autojump_clock: trio.abc.Clock, kind: str, ops: tuple[str, ...], answer: str
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with twenty_dms(tmp_path, answer=answer) as (bot, fake):
            fake.outage(10.0, kind, ops)
            with trio.move_on_after(500):  # else the assertions below say what is missing
                await fake.wait_until(lambda: answered(fake))
            await trio.sleep(300)  # every retry the bot would make has happened
    for i in range(len(USERS)):
        assert shown(fake, i) == [answer_of(i)], i
    assert writing(fake) == []
    assert restarts(logs) == []


@MODES
async def test_sends_lost_after_processing_show_at_most_one_extra_copy(
    tmp_path: Path, autojump_clock: trio.abc.Clock, answer: str
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with twenty_dms(tmp_path, answer=answer) as (bot, fake):
            fake.outage(10.0, "lost", SENDS)
            with trio.move_on_after(500):
                await fake.wait_until(lambda: answered(fake))
            await trio.sleep(300)
    for i in range(len(USERS)):
        texts = shown(fake, i)
        assert texts.count(answer_of(i)) in (1, 2), texts
        assert len(texts) <= 2, texts
    if answer == "card":  # every card call is repeated by its outTrackId: one card each
        for i in range(len(USERS)):
            assert shown(fake, i) == [answer_of(i)], i
    assert writing(fake) == []
    assert restarts(logs) == []


@MODES
async def test_an_outage_longer_than_the_retries_delivers_from_the_outbox_when_back(
    tmp_path: Path, autojump_clock: trio.abc.Clock, answer: str
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with twenty_dms(tmp_path, answer=answer) as (bot, fake):
            fake.outage(300.0, "500", SENDS)  # more than twice the retries
            await trio.sleep(250)
            assert all(shown(fake, i) == [] for i in range(len(USERS)))  # nothing given up
            with trio.move_on_after(400):
                await fake.wait_until(lambda: answered(fake))
            await trio.sleep(60)
    for i in range(len(USERS)):
        assert shown(fake, i) == [answer_of(i)], i
    assert writing(fake) == []
    assert restarts(logs) == []
    assert [e for e in logs if e["event"] == "answer_postponed"]


async def test_a_card_left_open_by_a_long_outage_gets_the_answer_from_the_outbox(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """The card is up and streaming when the card calls start failing for 300 s: the
    outbox's delivery finishes that very card instead of adding a markdown copy."""
    text = "echo:slow 8 a long story"
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            fake.user_message(fake.dm_conversation, text)
            await fake.wait_until(lambda: bool(fake.bot_messages(fake.dm_conversation)))
            fake.outage(300.0, "500", ("PUT /v1.0/card/streaming", "PUT /v1.0/card/instances"))
            await trio.sleep(250)
            [card] = fake.bot_messages(fake.dm_conversation)
            assert not card.finalized
            await trio.sleep(300)
    [card] = fake.bot_messages(fake.dm_conversation)
    final = answer_of_default(fake, text)
    assert card.text == final and card.finalized and card.flow_status == "3"
    assert [e for e in logs if e["event"] == "answer_postponed"]
    assert restarts(logs) == []


def answer_of_default(fake: FakeDingTalk, text: str) -> str:
    block = {
        "channel": "dingtalk",
        "conversationType": "direct",
        "senderId": fake.user["staff_id"],
        "senderName": fake.user["nick"],
    }
    src = "<dsh_im_source>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_source>"
    return f"{src}\n\n{text}"


async def test_a_card_create_whose_answer_was_lost_is_kept_when_finish_finds_it_existing(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """The first create makes the card but its answer is lost: the stream gives the card
    up for the moment, and finish's create of the same outTrackId is told it exists.  The
    lost create made it, so that card is delivered and finished -- no markdown instead."""
    text = "echo:slow 4 a card made in the dark"
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            fake.drop_response_next("POST /v1.0/card/instances")
            fake.user_message(fake.dm_conversation, text)
            final = answer_of_default(fake, text)
            with trio.move_on_after(300):
                await fake.wait_until(
                    lambda: any(m.text == final for m in fake.bot_messages(fake.dm_conversation))
                )
            await trio.sleep(60)
    [card] = fake.bot_messages(fake.dm_conversation)
    assert (card.kind, card.text, card.finalized, card.flow_status) == ("card", final, True, "3")
    creates = [c for c in fake.calls if c.op == "POST /v1.0/card/instances"]
    # The lost create (no answer), then the one that found the card: one outTrackId.
    assert [c.status for c in creates] == [0, 400]
    assert len({c.json["outTrackId"] for c in creates}) == 1
    assert not [e for e in logs if e["event"] == "card_answers_fell_back"]
