"""Feishu ids and times checked at decode: table tests on the mapper, and end to end
against the fake (127.0.0.1, autojump clock, real SQLite store, echo harness; see
``tests/test_feishu_e2e.py``): a 70 KiB ``message_id`` is a logged ``malformed`` drop and
the next message is answered by the same bot, never restarted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.feishu.protocol import EventMapper
from dshim.model import InboundMessage, Skip
from tests.test_feishu_e2e import answered, running_bot, source

BOT = "ou_bot0000000000000000000000000000"
MSG = "om_dc13264520392913993dd051dba21dcf"
CHAT = "oc_5ce6d572455d361153b7cb51da133945"
USER = "ou_7d8a6e6df7621556ce0d21922b676706"
HUGE = "om_" + "x" * (70 * 1024)
BAD = [
    "x" * 513,
    HUGE,
    "om_a\u0000b",
    "om_a\nb",
    "../x",
    "om a",
    "om_a/b",
    "om_a?b",
    "om_a#b",
    "..",
]


def event(open_id: str = USER, **message: Any) -> bytes:
    msg = {
        "message_id": MSG,
        "chat_id": CHAT,
        "chat_type": "p2p",
        "message_type": "text",
        "content": json.dumps({"text": "hello"}),
        "create_time": "1795000000000",
        **message,
    }
    sender = {"sender_id": {"open_id": open_id}, "sender_type": "user"}
    body = {
        "schema": "2.0",
        "header": {"event_type": "im.message.receive_v1", "create_time": "1795000000000"},
        "event": {"sender": sender, "message": {k: v for k, v in msg.items() if v is not None}},
    }
    return json.dumps(body).encode()


def mapped(raw: bytes) -> InboundMessage | Skip:
    item = EventMapper(bot_open_id=BOT, app_id="cli_app").decode(raw)
    assert isinstance(item, InboundMessage | Skip)
    return item


def test_real_ids_pass() -> None:
    item = mapped(
        event(
            thread_id="omt_1a3b5c7d9e",
            root_id="om_root00000000000000000000000000",
            parent_id="om_parent000000000000000000000000",
        )
    )
    assert isinstance(item, InboundMessage)
    assert (item.message_id, item.conversation_id, item.sender_id) == (MSG, CHAT, USER)
    assert (
        item.reply_to is not None
        and item.reply_to.message_id == "om_parent000000000000000000000000"
    )


@pytest.mark.parametrize("field", ["message_id", "chat_id", "thread_id", "open_id"])
@pytest.mark.parametrize("bad", BAD)
def test_a_bad_message_chat_thread_or_sender_id_is_malformed(field: str, bad: str) -> None:
    item = mapped(event(**{field: bad}))
    assert isinstance(item, Skip) and item.reason == "malformed"
    assert bad not in item.detail or len(bad) < 3


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_image_key_is_malformed(bad: str) -> None:
    item = mapped(event(message_type="image", content=json.dumps({"image_key": bad})))
    assert isinstance(item, Skip) and item.reason == "malformed"


@pytest.mark.parametrize("field", ["parent_id", "root_id"])
@pytest.mark.parametrize("bad", BAD)
def test_a_bad_quoted_id_keeps_the_message_without_its_quote(field: str, bad: str) -> None:
    asked: list[tuple[str, str]] = []

    def lookup(chat: str, parent: str) -> Any:
        asked.append((chat, parent))
        raise AssertionError("a bad id is never looked up")

    raw = event(**{field: bad})
    item = EventMapper(bot_open_id=BOT, app_id="cli_app", lookup=lookup).decode(raw)
    assert isinstance(item, InboundMessage) and item.content == "hello"
    assert item.reply_to is not None and item.reply_to.unavailable_reason == "not-found"
    assert not asked


def test_a_bad_recalled_message_id_is_malformed() -> None:
    body = {
        "schema": "2.0",
        "header": {"event_type": "im.message.recalled_v1"},
        "event": {"message_id": HUGE, "chat_id": CHAT},
    }
    item = EventMapper(bot_open_id=BOT, app_id="cli_app").decode(json.dumps(body).encode())
    assert isinstance(item, Skip) and item.reason == "malformed"


@pytest.mark.parametrize("when", ["16407412978094929299", "99999999999999999", "4102444801000"])
def test_an_absurd_create_time_is_malformed(when: str) -> None:
    item = mapped(event(create_time=when))
    assert isinstance(item, Skip) and item.reason == "malformed"


async def test_a_70_kib_message_id_is_dropped_and_the_next_message_answered(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            huge = {
                "message_id": HUGE,
                "chat_id": fake.dm_chat,
                "chat_type": "p2p",
                "message_type": "text",
                "content": json.dumps({"text": "poisoned"}),
            }
            sender = {"sender_id": {"open_id": fake.user["open_id"]}, "sender_type": "user"}
            await fake.push_event(
                fake.envelope("im.message.receive_v1", {"sender": sender, "message": huge})
            )
            await fake.user_message(fake.dm_chat, "still there?")
            await answered(fake, fake.dm_chat, source(fake) + "\n\nstill there?")
            await trio.sleep(30)
    assert [r for _, r in bot.events.drops] == ["malformed"]
    assert bot.events.prompts == [source(fake) + "\n\nstill there?"]
    assert [b.text for b in fake.bot_messages(fake.dm_chat)] == bot.events.prompts
    assert not [e for e in logs if str(e["event"]).endswith("_restarting")]
    assert bot.results is None or bot.results.get("fs") != "fatal"
