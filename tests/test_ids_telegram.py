"""Telegram ids and times checked at decode: table tests on ``parse_update``, and end to
end against the fake Bot API (see ``tests/test_telegram_e2e.py``: 127.0.0.1, autojump
clock, real SQLite store, echo harness): an update with a 70 KiB ``file_id`` is one
logged ``malformed`` drop and the next message is answered by the same bot, never
restarted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.telegram.protocol import BotIdentity, parse_update
from dshim.model import InboundMessage, Skip
from tests.helpers import Events
from tests.rig_telegram import (
    ADA,
    DEADLINE,
    echo_of,
    final_texts,
    polling,
    running_bot,
    telegram_world,
)

ME = BotIdentity(id=987654321, username="dshim_bot")
HUGE = "A" * (70 * 1024)
BAD = ["x" * 513, HUGE, "a\u0000b", "a\nb", "../x", "a b", "a/b", "a?b", "a#b", "..", "引用"]
#: Integers no Telegram id is: zero, negative message/user ids, beyond 64 signed bits.
BAD_INT = [0, -5, 2**63, 2**64 - 1]


def update(**fields: Any) -> bytes:
    msg: dict[str, Any] = {
        "message_id": 11,
        "date": 1796032960,
        "chat": {"id": 42, "type": "private", "first_name": "Ada"},
        "from": {"id": 42, "is_bot": False, "first_name": "Ada"},
        "text": "hello",
    }
    msg.update(fields)
    return json.dumps({"update_id": 1000, "message": msg}).encode()


def parsed(raw: bytes) -> InboundMessage | Skip:
    return parse_update(raw, ME).item


def malformed(item: InboundMessage | Skip) -> bool:
    return isinstance(item, Skip) and item.reason == "malformed" and len(item.detail) <= 200


def photo(file_id: str) -> list[dict[str, Any]]:
    return [{"file_id": file_id, "file_unique_id": "AQADu", "width": 90, "height": 60}]


def test_real_ids_pass() -> None:
    raw = update(
        chat={"id": -1001234567890, "type": "supergroup", "title": "Research", "is_forum": True},
        message_thread_id=77,
        is_topic_message=True,
        media_group_id="13540000000000001",
        photo=photo("AgACAgIAAxkBAAIBZ2Zx-_Q3f0lYbE1u1P7p1vQKsAAC"),
        caption="@dshim_bot look",
        caption_entities=[{"type": "mention", "offset": 0, "length": 10}],
        document={"file_id": "BQACAgIAAxkBAAIBaGZx", "file_name": "a.pdf"},
        reply_to_message={"message_id": 9, "date": 1796032900, "text": "before"},
    )
    result = parse_update(raw, ME)
    item = result.item
    assert isinstance(item, InboundMessage)
    assert (item.message_id, item.conversation_id, item.thread_id) == ("11", "-1001234567890", "77")
    assert result.album == (-1001234567890, "13540000000000001")
    assert item.reply_to is not None and item.reply_to.message_id == "9"


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_file_or_album_id_is_malformed(bad: str) -> None:
    assert malformed(parsed(update(photo=photo(bad))))
    assert malformed(parsed(update(document={"file_id": bad, "file_name": "a.pdf"})))
    assert malformed(parsed(update(voice={"file_id": bad})))
    result = parse_update(update(media_group_id=bad, photo=photo("AgAC")), ME)
    assert malformed(result.item) and result.album is None


@pytest.mark.parametrize("bad", BAD_INT)
def test_an_out_of_range_message_chat_or_sender_id_is_malformed(bad: int) -> None:
    assert malformed(parsed(update(message_id=bad)))
    assert malformed(parsed(update(**{"from": {"id": bad, "first_name": "Ada"}})))
    assert malformed(parsed(update(message_thread_id=bad, is_topic_message=True)))
    if bad != -5:  # negative chat ids are groups
        assert malformed(parsed(update(chat={"id": bad, "type": "private"})))


def test_a_chat_id_beyond_64_bits_or_a_bad_migration_is_malformed() -> None:
    assert malformed(parsed(update(chat={"id": -(2**63) - 1, "type": "group"})))
    assert isinstance(parsed(update(chat={"id": -(2**63) + 1, "type": "group"})), InboundMessage)
    result = parse_update(update(migrate_to_chat_id=2**63), ME)
    assert malformed(result.item) and result.migration is None


@pytest.mark.parametrize("where", ["message_id", "from id", "date"])
def test_an_id_of_70_000_digits_is_malformed(where: str) -> None:
    """Beyond 64 bits the decoder refuses it: one malformed update, confirmed by its id."""
    digits = "9" * 70_000
    body = update().decode()
    if where == "message_id":
        body = body.replace('"message_id": 11', f'"message_id": {digits}')
    elif where == "from id":
        body = body.replace('"id": 42, "is_bot"', f'"id": {digits}, "is_bot"')
    else:
        body = body.replace('"date": 1796032960', f'"date": {digits}')
    result = parse_update(body.encode(), ME)
    assert malformed(result.item) and result.update_id == 1000


@pytest.mark.parametrize("bad", BAD_INT)
def test_a_bad_quoted_id_keeps_the_message_without_its_quote(bad: int) -> None:
    replied = {"message_id": bad, "date": 1796032900, "text": "before"}
    item = parsed(update(reply_to_message=replied))
    assert isinstance(item, InboundMessage) and item.content == "hello"
    assert item.reply_to is not None and item.reply_to.unavailable_reason == "not-found"
    assert item.reply_to.content is None or not item.reply_to.content
    external = {"origin": {"type": "hidden_user", "sender_user_name": "x"}, "message_id": bad}
    item = parsed(update(external_reply=external))
    assert isinstance(item, InboundMessage) and item.content == "hello"
    assert item.reply_to is not None and item.reply_to.unavailable_reason == "not-found"


@pytest.mark.parametrize("when", [-1, 4102444801, 16407412978094929299, 99999999999999])
def test_an_absurd_date_is_malformed(when: int) -> None:
    assert malformed(parsed(update(date=when)))


async def test_a_70_kib_file_id_is_dropped_and_the_next_message_answered(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    events = Events()
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with telegram_world(tmp_path) as (fake, store, clock):
            chat = fake.private_chat(ADA)
            async with running_bot(fake, store, clock, observer=events):
                await polling(fake)
                poisoned = fake.user_message(chat, ADA, caption="poisoned", photo=b"\x89PNG")
                poisoned["photo"][-1]["file_id"] = HUGE
                fake.user_message(chat, ADA, "still there?")
                expected = echo_of(ADA, "still there?")
                await fake.wait_until(lambda: expected in final_texts(fake, chat["id"]))
                await trio.sleep(30)
    assert [r for _, r in events.drops] == ["malformed"]
    assert events.prompts == [expected]
    assert final_texts(fake, chat["id"]) == [expected]
    assert not [e for e in logs if str(e["event"]).endswith("_restarting")]


async def test_an_absurd_date_is_a_malformed_drop_live(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    events = Events()
    with trio.fail_after(DEADLINE):
        async with telegram_world(tmp_path) as (fake, store, clock):
            chat = fake.private_chat(ADA)
            async with running_bot(fake, store, clock, observer=events):
                await polling(fake)
                fake.user_message(chat, ADA, "from the future", date=16407412978094929)
                fake.user_message(chat, ADA, "still there?")
                expected = echo_of(ADA, "still there?")
                await fake.wait_until(lambda: expected in final_texts(fake, chat["id"]))
    assert [r for _, r in events.drops] == ["malformed"]
    assert events.prompts == [expected]
