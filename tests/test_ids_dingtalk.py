"""DingTalk ids and times checked at decode (table tests on ``MessageMapper.decode_raw``,
the one decode ``serve``, the inbox and replay run): ids over 512 characters or of
another shape are ``malformed`` drops; ``/`` (a base64 letter) is accepted, a path
segment is not; a bad quoted id only makes the quote ``not-found``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dshim.channels.dingtalk.protocol import MessageMapper
from dshim.model import InboundMessage, Skip

BOT = "$:LWCP_v1:$c2hvcnRib3RpZA=="
BAD = [
    "x" * 513,
    "A" * (70 * 1024),
    "a\u0000b",
    "a\nb",
    "../x",
    "a/../b",
    "a/..",
    "a b",
    "a?b",
    "a#b",
    "..",
    "引用",
]


def robot(**fields: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "msgId": "msgR0bOt1/+Ab==",
        "conversationId": "cidR0bOtDmAdA1234567890==",
        "conversationType": "1",
        "msgtype": "text",
        "text": {"content": "hello"},
        "createAt": 1796032224000,
        "senderId": "$:LWCP_v1:$dXNlcmFkYQ==",
        "senderStaffId": "manager4321",
        "chatbotUserId": BOT,
        "robotCode": "dingbot0001",
    }
    msg.update(fields)
    return msg


def decoded(msg: dict[str, Any]) -> InboundMessage | Skip:
    mapper = MessageMapper(bot_id="dingbot0001", robot_code="dingbot0001", media=lambda c: None)
    return mapper.decode_raw(json.dumps(msg).encode())


def malformed(item: InboundMessage | Skip) -> bool:
    return isinstance(item, Skip) and item.reason == "malformed" and len(item.detail) <= 200


def test_real_ids_pass() -> None:
    item = decoded(
        robot(
            text={
                "content": "hello",
                "isReplyMsg": True,
                "repliedMsg": {
                    "msgId": "msgQ1/x==",
                    "msgType": "text",
                    "content": {"content": "q"},
                },
            },
            originalProcessQueryKey="dshim-track-0001",
        )
    )
    assert isinstance(item, InboundMessage)
    assert (item.message_id, item.conversation_id, item.sender_id) == (
        "msgR0bOt1/+Ab==",
        "cidR0bOtDmAdA1234567890==",
        "manager4321",
    )
    assert item.reply_to is not None and item.reply_to.message_id == "msgQ1/x=="
    picture = decoded(robot(msgtype="picture", content={"downloadCode": "mIofN681YE3f/+m+Ntq=="}))
    assert isinstance(picture, InboundMessage) and len(picture.images) == 1


@pytest.mark.parametrize("field", ["msgId", "conversationId", "senderId", "senderStaffId"])
@pytest.mark.parametrize("bad", BAD)
def test_a_bad_message_conversation_or_sender_id_is_malformed(field: str, bad: str) -> None:
    item = decoded(robot(**{field: bad}))
    assert malformed(item)
    assert isinstance(item, Skip) and (len(bad) < 3 or bad not in item.detail)


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_download_code_is_malformed(bad: str) -> None:
    assert malformed(decoded(robot(msgtype="picture", content={"downloadCode": bad})))
    assert malformed(decoded(robot(msgtype="file", content={"downloadCode": bad, "fileName": "a"})))
    rich = {"richText": [{"text": "hi"}, {"type": "picture", "downloadCode": bad}]}
    assert malformed(decoded(robot(msgtype="richText", content=rich)))


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_quoted_id_keeps_the_message_without_its_quote(bad: str) -> None:
    replied = {"msgId": bad, "msgType": "text", "content": {"content": "q"}}
    for msg in (
        robot(text={"content": "hello", "isReplyMsg": True, "repliedMsg": replied}),
        robot(originalMsgId=bad),
        robot(quoteMessage={"msgId": bad, "text": {"content": "q"}}),
        robot(
            text={"content": "hello", "isReplyMsg": True, "repliedMsg": {"msgType": "x"}},
            originalProcessQueryKey=bad,
        ),
    ):
        item = decoded(msg)
        assert isinstance(item, InboundMessage) and item.content == "hello"
        assert item.reply_to is not None and item.reply_to.unavailable_reason == "not-found"
        assert not item.reply_to.recover


@pytest.mark.parametrize("when", [4102444801000, 999999999999999, "4102444801000", -5])
def test_an_absurd_create_at_is_malformed(when: int | str) -> None:
    assert malformed(decoded(robot(createAt=when)))
