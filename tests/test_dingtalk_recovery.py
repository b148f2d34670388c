"""The recovery order of a quoted DingTalk AI card, as a table.

A quote of the bot's card arrives as the placeholder "[Interactive Card Message]" with
``originalProcessQueryKey``, ``msgId`` and ``createdAt``.  The channel's mapping turns it
into a recovering reference; the core then looks, in this order and first match decides:
the message index by the process key (the card's ``outTrackId`` / OpenAPI
``processQueryKey``), by the quoted ``msgId``, the bot's answers by time (15 s, unique),
and the bound session's history (unique), writing a history hit back under ``msgId``.
Each row seeds a real SQLite store and resolves the mapped reference.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from dshim.channels.base import OutboundEntry
from dshim.channels.dingtalk.protocol import MessageMapper
from dshim.model import InboundMessage
from dshim.reply import ResolveContext, resolve
from dshim.store import open_store

BOT = "$:LWCP_v1:$bot"
T = 1_796_032_500.0  # the quoted card's createdAt (seconds)
NOW = T + 600


def card_quote(*, key: str | None = "track-1", msg_id: str = "msgCard==") -> InboundMessage:
    replied = {
        "msgId": msg_id,
        "msgType": "interactiveCard",
        "senderId": BOT,
        "createdAt": int(T * 1000),
        "content": "[Interactive Card Message]",
    }
    event: dict[str, Any] = {
        "msgId": "msgNow==",
        "msgtype": "text",
        "text": {"content": "shorter", "isReplyMsg": True, "repliedMsg": replied},
        "conversationType": "1",
        "conversationId": "cid",
        "senderId": "$:LWCP_v1:$user",
        "senderStaffId": "staff",
        "chatbotUserId": BOT,
        "createAt": int(NOW * 1000),
    }
    if key is not None:
        event["originalProcessQueryKey"] = key
    item = MessageMapper(bot_id="robot", robot_code="robot").decode_raw(json.dumps(event).encode())
    assert isinstance(item, InboundMessage)
    return item


def bot_entry(ids: list[str], text: str, sent: float, done: float | None = None) -> OutboundEntry:
    return OutboundEntry(message_ids=ids, text=text, sent_at=sent, completed_at=done or sent)


ROWS = [
    # (what, index entries, history answers (text, at), expected content or reason)
    (
        "process key beats everything",
        [bot_entry(["track-1"], "by key", T - 400), bot_entry(["msgCard=="], "by id", T)],
        [("by history", T)],
        "by key",
    ),
    (
        "then the quoted msgId",
        [bot_entry(["other"], "near in time", T + 1), bot_entry(["msgCard=="], "by id", T - 900)],
        [],
        "by id",
    ),
    (
        "then the one answer within 15 s",
        [bot_entry(["a"], "by time", T - 20, T + 10), bot_entry(["b"], "too old", T - 100)],
        [("by history", T)],
        "by time",
    ),
    (
        "then the session history",
        [bot_entry(["x"], "too old", T - 100)],
        [("by history", T + 3)],
        "by history",
    ),
    (
        "two answers in the window: not-delivered, no history guess",
        [bot_entry(["a"], "one", T - 5), bot_entry(["b"], "two", T + 5)],
        [("by history", T)],
        "not-delivered",
    ),
    ("two history candidates: not-delivered", [], [("h1", T - 5), ("h2", T + 5)], "not-delivered"),
    ("nothing anywhere: not-delivered", [], [], "not-delivered"),
]


@pytest.mark.parametrize(("what", "index", "history", "expected"), ROWS, ids=[r[0] for r in ROWS])
async def test_card_quote_recovery_order(
    tmp_path: Path,
    what: str,
    index: list[OutboundEntry],
    history: list[tuple[str, float]],
    expected: str,
) -> None:
    item = card_quote()
    async with open_store(tmp_path, inline=True) as store:
        for e in index:
            await store.add_outbound("bot", "cid", e, now=NOW)
        await store.set_binding("bot", "cid", "", "sess", title=None, now=NOW)
        await store.append_transcript("bot", "sess", "user", "earlier", at=T - 30, completed=True)
        for text, at in history:
            await store.append_transcript("bot", "sess", "assistant", text, at=at, completed=True)
        ctx = ResolveContext(
            store=store, bot="bot", conversation_id="cid", session_id="sess", clock=lambda: NOW
        )
        quoted = await resolve(item.reply_to, ctx)
        assert quoted is not None
        if expected == "not-delivered":
            assert (quoted.content, quoted.unavailable_reason) == (None, "not-delivered")
        else:
            assert quoted.content == expected and quoted.unavailable_reason is None
        assert (quoted.message_id, quoted.author_id) == ("msgCard==", BOT)
        if expected == "by history":  # written back under the quoted msgId
            [back] = [
                e
                for e in await store.list_outbound("bot", "cid", now=NOW)
                if "msgCard==" in e.message_ids
            ]
            assert back.text == "by history"


async def test_without_a_process_key_the_msg_id_is_the_first_key(tmp_path: Path) -> None:
    item = card_quote(key=None)
    assert item.reply_to is not None and item.reply_to.recover_keys == []
    async with open_store(tmp_path, inline=True) as store:
        await store.add_outbound("bot", "cid", bot_entry(["msgCard=="], "by id", T - 900), now=NOW)
        ctx = ResolveContext(store=store, bot="bot", conversation_id="cid", clock=lambda: NOW)
        quoted = await resolve(item.reply_to, ctx)
    assert quoted is not None and quoted.content == "by id"
