"""WeChat (iLink) ids and times checked at decode (table tests on ``map_message``, the
decode ``serve``, the inbox and replay run): ids over 512 characters or of another shape,
and times past 2100 or negative, are ``malformed`` drops; a bad quoted id only makes the
quote ``not-found``; a context token that is no token is never stored (nor repeated in a
detail), the message is kept."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dshim.channels.weixin.protocol import Mapped, map_message
from dshim.model import InboundMessage, Skip

BOT = "b0f5e7c1d2a3@im.bot"
USER = "o9cq8000aaaaaaa@im.wechat"
NOW_MS = 1796032800000
BAD = ["x" * 513, "A" * (70 * 1024), "a\u0000b", "a\nb", "../x", "a b", "a/b", "a?b", "a#b", ".."]
BAD_NUMBER = [*BAD, "12a", "-1", -1, "18446744073709551616", 2**64, "1" * 21, "１２"]


def message(**fields: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "seq": 101,
        "message_id": 7533107557171200002,
        "from_user_id": USER,
        "to_user_id": BOT,
        "client_id": "c-1",
        "create_time_ms": 1796032795000,
        "message_type": 1,
        "context_token": "AARzJWAFAAABAAAAAABc0fake0context0token",
        "item_list": [{"type": 1, "msg_id": "7533107557171200001", "text_item": {"text": "hello"}}],
    }
    msg.update(fields)
    return msg


def mapped(msg: dict[str, Any]) -> Mapped:
    return map_message(json.dumps(msg).encode(), bot_id=BOT, now_ms=NOW_MS)


def malformed(item: InboundMessage | Skip) -> bool:
    return isinstance(item, Skip) and item.reason == "malformed" and len(item.detail) <= 200


def quote(**ref: Any) -> list[dict[str, Any]]:
    return [
        {
            "type": 1,
            "msg_id": "7533107557171200001",
            "text_item": {"text": "hello"},
            "ref_msg": {"title": "", **ref},
        }
    ]


def test_real_ids_pass() -> None:
    out = mapped(message(group_id="20011223344@chatroom", client_id="dshim-0123456789abcdef"))
    item = out.item
    assert isinstance(item, InboundMessage) and item.content == "hello"
    assert (item.message_id, item.conversation_id, item.sender_id) == (
        "7533107557171200002",
        "20011223344@chatroom",
        USER,
    )
    direct = mapped(message(message_id="18446744073709551615"))  # 2**64 - 1, as a string
    assert isinstance(direct.item, InboundMessage) and direct.context is not None
    ref = mapped(message(item_list=quote(svr_id=7533107536199680024, message_item={"type": 1})))
    assert isinstance(ref.item, InboundMessage) and ref.item.reply_to is not None
    assert ref.item.reply_to.message_id == "7533107536199680024"


@pytest.mark.parametrize("bad", BAD_NUMBER)
def test_a_bad_message_or_item_id_is_malformed(bad: str | int) -> None:
    assert malformed(mapped(message(message_id=bad)).item)
    items = [{"type": 1, "msg_id": bad, "text_item": {"text": "hello"}}]
    assert malformed(mapped(message(item_list=items)).item)


@pytest.mark.parametrize("bad", [*BAD, "a@b@c", "@im.wechat", "user@"])
def test_a_bad_sender_group_or_client_id_is_malformed(bad: str) -> None:
    assert malformed(mapped(message(from_user_id=bad)).item)
    assert malformed(mapped(message(group_id=bad)).item)
    if "@" not in bad:
        assert malformed(mapped(message(client_id=bad)).item)


@pytest.mark.parametrize("bad", BAD_NUMBER)
def test_a_bad_quoted_id_keeps_the_message_without_its_quote(bad: str | int) -> None:
    for items in (
        quote(svr_id=bad, message_item={"type": 1}),
        quote(message_item={"type": 1, "msg_id": bad}),
    ):
        out = mapped(message(item_list=items))
        item = out.item
        assert isinstance(item, InboundMessage) and item.content == "hello"
        assert item.reply_to is not None and item.reply_to.unavailable_reason == "not-found"
        assert not item.reply_to.recover


@pytest.mark.parametrize("bad", ["t" * 4097, "a b", "a\nb", "\u00e9t\u00e9"])
def test_a_context_token_that_is_no_token_is_not_stored(bad: str) -> None:
    out = mapped(message(context_token=bad))
    assert isinstance(out.item, InboundMessage) and out.item.content == "hello"
    assert out.context is None


@pytest.mark.parametrize("field", ["create_time_ms", "update_time_ms"])
@pytest.mark.parametrize("when", [-1, 4102444801000, 16407412978094929299])
def test_an_absurd_time_is_malformed(field: str, when: int) -> None:
    assert malformed(mapped(message(**{field: when})).item)
