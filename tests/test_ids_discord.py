"""Discord ids and times checked at decode: table tests on the mapper, and end to end
against the fake gateway (see ``tests/test_discord_e2e.py``: 127.0.0.1, autojump clock,
real SQLite store, echo harness): a MESSAGE_CREATE with a 70 KiB author id is one logged
``malformed`` drop and the next message is answered by the same bot, never restarted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.discord import models as m
from dshim.channels.discord.protocol import MessageMapper, is_snowflake, map_interaction
from dshim.model import InboundMessage, Skip
from tests.test_discord_e2e import answered, answers, running_bot, source

BOT = "1100000000000000001"
USER = "80351110224678912"
CHANNEL = "1200000000000000002"
GUILD = "1300000000000000003"
MSG = "1400000000000000004"
HUGE = "1" * (70 * 1024)
BAD = [
    "x" * 513,
    "1" * 21,
    "18446744073709551616",  # 2**64: 20 digits, no unsigned 64-bit integer
    "99999999999999999999",
    HUGE,
    "1\u00002",
    "1\n2",
    "../1",
    "1 2",
    "1/2",
    "1?2",
    "12a",
    "-1",
    "１２",  # fullwidth digits: isdigit() but not ASCII
    "..",
]


def message(**fields: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": MSG,
        "channel_id": CHANNEL,
        "guild_id": GUILD,
        "author": {"id": USER, "username": "ada"},
        "content": f"<@{BOT}> hello",
        "timestamp": "2026-11-30T10:00:00.000000+00:00",
        "type": 0,
        "mentions": [{"id": BOT, "username": "dshim"}],
    }
    d.update(fields)
    return d


def decoded(d: dict[str, Any]) -> InboundMessage | Skip:
    return MessageMapper(BOT).decode_message(json.dumps(d).encode())


def malformed(item: InboundMessage | Skip) -> bool:
    return isinstance(item, Skip) and item.reason == "malformed" and len(item.detail) <= 200


def test_real_ids_pass() -> None:
    assert is_snowflake("18446744073709551615")  # 2**64 - 1
    item = decoded(
        message(
            attachments=[{"id": "1500000000000000005", "filename": "a.png", "url": "https://x/a"}],
            message_reference={"message_id": "1399999999999999999", "channel_id": CHANNEL},
        )
    )
    assert isinstance(item, InboundMessage)
    assert (item.message_id, item.conversation_id, item.sender_id) == (MSG, CHANNEL, USER)
    assert item.reply_to is not None and item.reply_to.message_id == "1399999999999999999"


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_message_channel_guild_or_author_id_is_malformed(bad: str) -> None:
    assert malformed(decoded(message(id=bad)))
    assert malformed(decoded(message(channel_id=bad)))
    assert malformed(decoded(message(guild_id=bad)))
    assert malformed(decoded(message(author={"id": bad, "username": "ada"})))


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_attachment_id_is_malformed(bad: str) -> None:
    attachment = {"id": bad, "filename": "a.png", "url": "https://x/a"}
    assert malformed(decoded(message(attachments=[attachment])))
    forward = {
        "message_reference": {"type": 1, "message_id": "1399999999999999999"},
        "message_snapshots": [{"message": {"content": "fwd", "attachments": [attachment]}}],
    }
    assert malformed(decoded(message(**forward)))


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_quoted_id_keeps_the_message_without_its_quote(bad: str) -> None:
    for ref in ({"message_id": bad, "channel_id": CHANNEL}, {"message_id": MSG, "channel_id": bad}):
        item = decoded(message(message_reference=ref))
        assert isinstance(item, InboundMessage) and item.content == "hello"
        assert item.reply_to is not None and item.reply_to.unavailable_reason == "not-found"
        assert not isinstance(item.reply_to.message_id, str)  # the id is not copied


@pytest.mark.parametrize(
    "when", ["9999-12-31T23:59:59+00:00", "2100-01-01T00:00:01+00:00", "1969-12-31T23:59:59+00:00"]
)
def test_an_absurd_timestamp_is_malformed(when: str) -> None:
    assert malformed(decoded(message(timestamp=when)))


def test_a_message_id_of_a_time_past_2100_without_timestamp_is_malformed() -> None:
    # Without a timestamp the snowflake's own time counts: 2**64 - 1 is in the year 2154.
    assert malformed(decoded(message(id="18446744073709551615", timestamp=None)))


def test_an_interaction_id_of_a_time_past_2100_is_malformed() -> None:
    inter = m.Interaction(
        id="18446744073709551615",
        type=3,
        token="t" * 40,
        channel_id=CHANNEL,
        user=m.User(id=USER, username="ada"),
        message=m.InteractionMessage(id=MSG, channel_id=CHANNEL),
        data=m.InteractionData(custom_id="dshim:opt:1:-", component_type=2),
    )
    assert malformed(map_interaction(BOT, inter))  # type: ignore[arg-type]


async def test_a_70_kib_author_id_is_dropped_and_the_next_message_answered(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            poisoned = fake.message(fake.dm_channel, "poisoned")
            poisoned["author"] = {**poisoned["author"], "id": HUGE}
            await fake.dispatch("MESSAGE_CREATE", poisoned)
            await fake.user_message(fake.dm_channel, "still there?")
            expected = source(fake.user, "direct") + "\n\nstill there?"
            await answered(fake, fake.dm_channel, expected)
            await trio.sleep(30)
    # The bot's own answer comes back through the gateway as an echo drop.
    assert [r for r in bot.drop_reasons() if r != "echo"] == ["malformed"]
    assert bot.events.prompts == [expected]
    assert answers(fake, fake.dm_channel) == [expected]
    assert not [e for e in logs if str(e["event"]).endswith("_restarting")]


async def test_an_absurd_timestamp_is_a_malformed_drop_live(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        future = fake.message(fake.dm_channel, "from the future")
        future["timestamp"] = "9999-12-31T23:59:59+00:00"
        await fake.dispatch("MESSAGE_CREATE", future)
        await fake.user_message(fake.dm_channel, "still there?")
        expected = source(fake.user, "direct") + "\n\nstill there?"
        await answered(fake, fake.dm_channel, expected)
    # The bot's own answer comes back through the gateway as an echo drop.
    assert [r for r in bot.drop_reasons() if r != "echo"] == ["malformed"]
    assert bot.events.prompts == [expected]
