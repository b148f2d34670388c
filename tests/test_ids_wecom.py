"""WeCom ids and times checked at decode (table tests on ``decode_body`` and
``Mapper.decode_frame``, the decode ``serve``, the inbox and replay run): an id over 512
characters or other than letters, digits and ``_ - @ .``, or a ``create_time`` past
2100 or negative, is a ``malformed`` drop.  WeCom quotes carry no id."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dshim.channels.wecom import protocol as p
from dshim.model import InboundMessage, Skip

BOT = "aibXk3fQ0Tzx7bY2vR9wLmN4"
BAD = [
    "x" * 513,
    "A" * (70 * 1024),
    "a\u0000b",
    "a\nb",
    "../x",
    "a b",
    "a/b",
    "a?b",
    "a#b",
    "..",
    "引用",
]


def frame(req_id: str = "aibot_msg_callback_1796112001000_00000001", **body: Any) -> bytes:
    b: dict[str, Any] = {
        "msgid": "msgAAQeQ0001",
        "aibotid": BOT,
        "chattype": "group",
        "chatid": "wrkSFfCgAAtdJ3p6hHUo3s2Q",
        "from": {"userid": "zhang.san-01@corp"},
        "create_time": 1796112001,
        "msgtype": "text",
        "text": {"content": "@dshim hello"},
    }
    b.update(body)
    return json.dumps({"cmd": p.MSG_CALLBACK, "headers": {"req_id": req_id}, "body": b}).encode()


def decoded(raw: bytes) -> InboundMessage | Skip:
    return p.Mapper(BOT).decode_frame(raw)


def malformed(item: InboundMessage | Skip) -> bool:
    return isinstance(item, Skip) and item.reason == "malformed" and len(item.detail) <= 200


def test_real_ids_pass() -> None:
    item = decoded(frame())
    assert isinstance(item, InboundMessage) and item.content == "hello"
    assert (item.message_id, item.conversation_id, item.sender_id) == (
        "msgAAQeQ0001",
        "wrkSFfCgAAtdJ3p6hHUo3s2Q",
        "zhang.san-01@corp",
    )
    direct = decoded(frame(chattype="single", chatid="", **{"from": {"userid": "lisi"}}))
    assert isinstance(direct, InboundMessage) and direct.conversation_id == "lisi"
    assert isinstance(decoded(frame(create_time=1796112001000)), InboundMessage)  # ms


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_msgid_chatid_userid_or_bot_id_is_malformed(bad: str) -> None:
    assert malformed(decoded(frame(msgid=bad)))
    assert malformed(decoded(frame(chatid=bad)))
    assert malformed(decoded(frame(**{"from": {"userid": bad}})))
    assert malformed(decoded(frame(chattype="single", chatid="", **{"from": {"userid": bad}})))
    assert malformed(decoded(frame(aibotid=bad)))
    item = decoded(frame(msgid=bad))
    assert isinstance(item, Skip) and (len(bad) < 3 or bad not in item.detail)


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_req_id_is_malformed(bad: str) -> None:
    """The callback's req_id is what every answer to it is sent under."""
    assert malformed(decoded(frame(req_id=bad)))


@pytest.mark.parametrize("bad", BAD)
def test_an_event_with_a_bad_id_is_no_chat_event(bad: str) -> None:
    raw = json.dumps(
        {
            "cmd": p.EVENT_CALLBACK,
            "headers": {"req_id": "aibot_event_callback_1796112018000_00000012"},
            "body": {
                "msgid": "evtAAQeQ0017",
                "msgtype": "event",
                "chattype": "single",
                "from": {"userid": bad},
                "event": {"eventtype": "enter_chat"},
            },
        }
    ).encode()
    assert isinstance(p.decode_body(raw), Skip)


@pytest.mark.parametrize("when", [4102444801, 16407412978094929299, -1, 1e300])
def test_an_absurd_create_time_is_malformed(when: float) -> None:
    assert malformed(decoded(frame(create_time=when)))
