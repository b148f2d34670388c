"""Table tests of the DingTalk sans-IO code: Stream frames, robot messages, quotes, errors.

Pure functions only: no trio, no sockets; payloads are the shapes of
/work/shared/protocols/dingtalk.md §2-§3 (robot callbacks as decoded from a CALLBACK
frame's ``data`` string).
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec
import pytest
from msgspec import UNSET

from dshim.channels.dingtalk import models as m
from dshim.channels.dingtalk.client import DEFAULT_API_BASE
from dshim.channels.dingtalk.protocol import (
    MessageMapper,
    RobotCallback,
    Route,
    StreamSession,
    card_markdown,
    classify_error,
    quote_reference,
)
from dshim.errors import AuthError, NotFound, PermissionDenied, RateLimited, TransportError
from dshim.model import InboundMessage, ReplyReference, Skip
from dshim.net.ws_session import Close, Connected, Deliver, Handover, Ignored, Send

BOT = "$:LWCP_v1:$bot"
USER = "$:LWCP_v1:$user"


def frame(kind: str, topic: str, data: Any, mid: str | None = "m-1") -> str:
    headers: dict[str, Any] = {"topic": topic, "contentType": "application/json"}
    if mid is not None:
        headers["messageId"] = mid
    return json.dumps({"specVersion": "1.0", "type": kind, "headers": headers, "data": data})


def ack_of(action: Any) -> dict[str, Any]:
    assert isinstance(action, Send)
    assert isinstance(action.data, str)
    decoded: dict[str, Any] = json.loads(action.data)
    return decoded


# -- the stream session ------------------------------------------------------------------------


def test_ping_is_acked_with_the_same_opaque() -> None:
    s = StreamSession()
    [action] = s.receive(frame("SYSTEM", "ping", json.dumps({"opaque": "abc"}), "p-1"), 0.0)
    ack = ack_of(action)
    assert ack["code"] == 200 and ack["headers"]["messageId"] == "p-1"
    assert json.loads(ack["data"]) == {"opaque": "abc"}
    assert s.pings == 1


def test_robot_callback_is_acked_at_once_and_delivered_with_the_decoded_data() -> None:
    s = StreamSession()
    robot = {"msgId": "x", "conversationId": "c"}
    [action] = s.receive(frame("CALLBACK", "/v1.0/im/bot/messages/get", json.dumps(robot)), 0)
    assert isinstance(action, Deliver) and action.ack_at_once
    assert isinstance(action.event, RobotCallback)
    assert json.loads(action.event.data) == robot
    assert json.loads(ack_of(action.ack)["data"]) == {"response": None}


def test_disconnect_hands_over_and_closes_the_old_socket_later() -> None:
    s = StreamSession(handover_close_s=10.0)
    assert s.connection_opened(0.0) == [Connected()]
    [action] = s.receive(frame("SYSTEM", "disconnect", json.dumps({"reason": "expired"})), 5.0)
    assert action == Handover("expired")  # no ack: the next connection opens now
    assert s.next_timer() == 15.0
    assert s.tick(14.0, reading=True) == []
    assert s.tick(15.0, reading=True) == [Close(1000, "disconnect handover")]
    assert s.next_timer() is None


@pytest.mark.parametrize(
    ("kind", "topic", "expect"),
    [
        ("EVENT", "chat_update", {"status": "SUCCESS"}),
        ("CALLBACK", "/v1.0/card/instances/callback", {"response": None}),
    ],
)
def test_other_frames_are_acked_but_not_delivered(kind: str, topic: str, expect: Any) -> None:
    [action] = StreamSession().receive(frame(kind, topic, "{}"), 0)
    assert json.loads(ack_of(action)["data"]) == expect


@pytest.mark.parametrize(
    "data",
    [b"\x00binary", "not json", '{"type": 3}', "[" * 200 + "]" * 200, '{"data": 5}'],
)
def test_bad_frames_are_ignored_never_raised(data: str | bytes) -> None:
    actions = StreamSession().receive(data, 0)
    assert all(isinstance(a, Ignored) for a in actions)


def test_system_informational_frames_are_silent() -> None:
    assert StreamSession().receive(frame("SYSTEM", "KEEPALIVE", "{}"), 0) == []


# -- robot messages ----------------------------------------------------------------------------

MAPPER = MessageMapper(bot_id="robot", robot_code="robot")


def robot(**fields: Any) -> dict[str, Any]:
    base = {
        "msgId": "msgA==",
        "msgtype": "text",
        "text": {"content": "hello"},
        "createAt": 1796032800000,
        "conversationType": "1",
        "conversationId": "cidDM",
        "senderId": USER,
        "senderStaffId": "staff1",
        "senderNick": "Ada",
        "chatbotUserId": BOT,
        "robotCode": "robot",
        "sessionWebhook": "https://oapi.dingtalk.com/robot/sendBySession?session=s",
        "sessionWebhookExpiredTime": 1796034600000,
    }
    base.update(fields)
    return base


def mapped(**fields: Any) -> InboundMessage:
    item = MAPPER.decode_raw(json.dumps(robot(**fields)).encode())
    assert isinstance(item, InboundMessage), item
    return item


def test_direct_text() -> None:
    msg = mapped()
    assert (msg.message_id, msg.conversation_id, msg.conversation_type) == (
        "msgA==",
        "cidDM",
        "direct",
    )
    assert (msg.sender_id, msg.sender_name, msg.content, msg.addressed) == (
        "staff1",
        "Ada",
        "hello",
        True,
    )
    assert msg.received_at == 1796032800.0
    assert isinstance(msg.route, Route)
    assert msg.route.webhook_expires_at == 1796034600.0 and msg.route.direct


def test_group_addressed_only_by_the_at_list_and_the_mention_is_removed() -> None:
    at = {"atUsers": [{"dingtalkId": BOT}], "isInAtList": True}
    msg = mapped(
        conversationType="2",
        conversationTitle="Team",
        text={"content": " @dshim  what now? "},
        **at,
    )
    assert (msg.conversation_type, msg.addressed, msg.content) == ("group", True, "what now?")
    assert msg.conversation_title == "Team"
    other = mapped(conversationType="2", isInAtList=False, text={"content": "chat"})
    assert not other.addressed
    # a leading @ of somebody else stays (the bot is not the only one @-ed)
    two = mapped(
        conversationType="2",
        isInAtList=True,
        atUsers=[{"dingtalkId": BOT}, {"dingtalkId": "x"}],
        text={"content": "@Bob look"},
    )
    assert two.content == "@Bob look"


def test_sender_falls_back_to_sender_id() -> None:
    assert mapped(senderStaffId=None).sender_id == USER


def test_rich_text_joins_runs_at_names_and_pictures_become_images() -> None:
    content = {
        "richText": [
            {"text": "look at "},
            {"type": "at", "atName": "Bob"},
            {"type": "text", "text": " this:"},
            {"type": "picture", "downloadCode": "dc1", "pictureDownloadCode": "p1"},
        ]
    }
    msg = mapped(msgtype="richText", text=None, content=content)
    assert msg.content == "look at @Bob this:"
    assert [i.kind for i in msg.images] == ["image"]


GROUP_AT_BOT = {"conversationType": "2", "isInAtList": True, "atUsers": [{"dingtalkId": BOT}]}


@pytest.mark.parametrize(
    "segments",
    [
        # The mention as an at segment, or as the leading text run (both are seen).
        [{"type": "at", "atName": "dshim bot"}, {"text": " what is on this screen?"}],
        [{"text": "@dshim what is on this screen?"}],
        [{"text": " @dshim "}, {"type": "text", "text": "what is on this screen?"}],
    ],
)
def test_group_rich_text_loses_the_bot_mention_like_plain_text(
    segments: list[dict[str, Any]],
) -> None:
    picture = {"type": "picture", "downloadCode": "dc1"}
    content = {"richText": [*segments, picture]}
    msg = mapped(msgtype="richText", text=None, content=content, **GROUP_AT_BOT)
    assert msg.addressed and msg.content == "what is on this screen?"
    assert [i.kind for i in msg.images] == ["image"]


def test_group_rich_text_keeps_mentions_that_may_not_be_the_bot() -> None:
    content = {"richText": [{"type": "at", "atName": "Bob"}, {"text": " look"}]}
    two = {**GROUP_AT_BOT, "atUsers": [{"dingtalkId": BOT}, {"dingtalkId": "x"}]}
    assert mapped(msgtype="richText", text=None, content=content, **two).content == "@Bob look"
    # In a direct chat nothing is a mention to remove.
    assert mapped(msgtype="richText", text=None, content=content).content == "@Bob look"


def test_a_rich_text_segment_with_a_download_code_but_no_type_is_a_picture() -> None:
    content = {
        "richText": [
            {"text": "before "},
            {"downloadCode": "dc-untyped", "pictureDownloadCode": "pdc-untyped"},
            {"pictureDownloadCode": "pdc-only"},
            {"text": "after"},
        ]
    }
    msg = mapped(msgtype="richText", text=None, content=content)
    assert msg.content == "before after"
    assert [i.kind for i in msg.images] == ["image", "image"]
    ref = quoted({"msgId": "q1", "msgType": "richText", "senderId": USER, "content": content})
    assert ref.content == "before after" and ref.attachments == [m_att("image"), m_att("image")]


@pytest.mark.parametrize("field", ["sessionWebhookExpiredTime", "createAt"])
def test_epoch_milliseconds_may_be_digit_strings_but_not_other_strings(field: str) -> None:
    msg = mapped(**{field: "1796034600000"})
    assert isinstance(msg.route, Route)
    got = msg.route.webhook_expires_at if field != "createAt" else msg.received_at
    assert got == 1796034600.0
    for bad in ("soon", "", "1796034600000ms", "-5", "\u0661\u0662"):
        item = MAPPER.decode_raw(json.dumps(robot(**{field: bad})).encode())
        assert isinstance(item, Skip) and item.reason == "malformed", (bad, item)
        assert field in item.detail


@pytest.mark.parametrize("as_string", [False, True])
def test_content_may_be_an_object_or_a_json_string(as_string: bool) -> None:
    content: Any = {"downloadCode": "f1", "fileName": "report.pdf"}
    if as_string:
        content = json.dumps(content)
    msg = mapped(msgtype="file", text=None, content=content)
    assert [(f.kind, f.name) for f in msg.files] == [("file", "report.pdf")]


def test_audio_recognition_is_text_and_the_audio_a_file() -> None:
    msg = mapped(
        msgtype="audio",
        text=None,
        content={"downloadCode": "a1", "duration": 3, "recognition": "hi there"},
    )
    assert msg.content == "hi there" and [f.kind for f in msg.files] == ["audio"]


def test_picture_and_video() -> None:
    assert [i.kind for i in mapped(msgtype="picture", content={"downloadCode": "p"}).images] == [
        "image"
    ]
    assert [f.kind for f in mapped(msgtype="video", content={"downloadCode": "v"}).files] == [
        "video"
    ]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{", "malformed"),
        (json.dumps(robot(conversationType="9")).encode(), "malformed"),
        (json.dumps(robot(conversationType=["1"])).encode(), "malformed"),
        (json.dumps(robot(msgId=5)).encode(), "malformed"),
        (json.dumps(robot(senderId=BOT)).encode(), "echo"),
        (b'{"msgId": "\\ud800", "conversationId": 1}', "malformed"),
        (b"[" * 5000 + b"]" * 5000, "malformed"),
        (json.dumps(robot(text={"content": "x" * (2 << 20)})).encode(), "malformed"),
    ],
)
def test_bad_events_are_skips(raw: bytes, reason: str) -> None:
    item = MAPPER.decode_raw(raw)
    assert isinstance(item, Skip) and item.reason == reason


# -- quotes ------------------------------------------------------------------------------------


def quoted(replied: Any, **fields: Any) -> ReplyReference:
    text = {"content": "and?", "isReplyMsg": True, "repliedMsg": replied}
    ref = mapped(text=text, **fields).reply_to
    assert ref is not None
    return ref


@pytest.mark.parametrize(
    ("content", "text"),
    [
        ({"content": "device shape"}, "device shape"),
        ({"text": "earlier shape"}, "earlier shape"),
        ("bare string", "bare string"),
        (json.dumps({"content": "as a string"}), "as a string"),
    ],
)
def test_quoted_text_in_every_shape(content: Any, text: str) -> None:
    ref = quoted(
        {
            "msgId": "q1",
            "msgType": "text",
            "senderId": USER,
            "senderNick": "Bob",
            "content": content,
        }
    )
    assert (ref.message_id, ref.author_id, ref.author_name, ref.content) == (
        "q1",
        USER,
        "Bob",
        text,
    )
    assert not ref.recover


def test_quote_of_rich_text_file_audio_video_chat_record() -> None:
    rich = quoted(
        {
            "msgId": "q",
            "msgType": "richText",
            "senderId": USER,
            "content": {
                "richText": [
                    {"msgType": "text", "content": "see "},
                    {"msgType": "picture", "downloadCode": "secret-code"},
                ]
            },
        }
    )
    assert rich.content == "see " and rich.attachments == [m_att("image")]
    f = quoted(
        {"msgId": "q", "msgType": "file", "content": {"downloadCode": "c", "fileName": "a.pdf"}}
    )
    assert f.attachments == [m_att("file", "a.pdf")] and f.content is UNSET
    a = quoted({"msgId": "q", "msgType": "voice", "content": {"recognition": "said"}})
    assert a.content == "said" and a.attachments == [m_att("audio")]
    v = quoted({"msgId": "q", "msgType": "video", "content": {"downloadCode": "c"}})
    assert v.attachments == [m_att("video")]
    c = quoted(
        {"msgId": "q", "msgType": "chatRecord", "content": {"summary": "3 messages", "title": "t"}}
    )
    assert c.content == "3 messages"


def m_att(kind: str, name: str | None = None) -> Any:
    from dshim.model import Attachment

    return Attachment(kind=kind, name=name)


def test_card_quote_with_visible_text_is_a_snapshot() -> None:
    tree = {
        "elementType": "ROOT",
        "children": [
            {"elementType": "TEXT", "value": "first line"},
            {"elementType": "BOX", "children": [{"elementType": "TEXT", "value": "second"}]},
        ],
    }
    ref = quoted(
        {
            "msgId": "q",
            "msgType": "interactiveCard",
            "senderId": BOT,
            "content": {"cardContent": tree},
        }
    )
    assert ref.content == "first line\nsecond" and not ref.recover
    params = quoted(
        {
            "msgId": "q",
            "msgType": "interactiveCard",
            "content": {"cardData": {"cardParamMap": {"msgContent": "md"}}},
        }
    )
    assert params.content == "md"


@pytest.mark.parametrize("content", [None, "[Interactive Card Message]", {}])
def test_card_placeholder_asks_for_recovery_by_process_key_then_id_then_time(content: Any) -> None:
    ref = quoted(
        {
            "msgId": "qcard",
            "msgType": "interactiveCard",
            "senderId": BOT,
            "createdAt": 1796032000000,
            "content": content,
        },
        originalProcessQueryKey="track-1",
    )
    assert ref.recover and ref.recover_keys == ["track-1"]
    assert ref.recover_at == 1796032000.0
    assert (ref.message_id, ref.author_id) == ("qcard", BOT)
    assert ref.content is UNSET


def test_quote_of_a_users_message_without_content_is_looked_up_by_id_only() -> None:
    ref = quoted({"msgId": "qp", "msgType": "text", "senderId": USER, "createdAt": 1796032000000})
    assert ref.recover and ref.recover_keys == [] and ref.recover_at is None


def test_legacy_quote_message_and_original_msg_id() -> None:
    ref = mapped(
        quoteMessage={
            "msgId": "old",
            "senderId": USER,
            "text": {"content": "legacy"},
            "msgtype": "text",
        }
    ).reply_to
    assert ref is not None and (ref.message_id, ref.content) == ("old", "legacy")
    only = mapped(originalMsgId="orig").reply_to
    assert only is not None and only.message_id == "orig" and only.recover


def test_unknown_quoted_type_without_text_is_unsupported() -> None:
    ref = quoted({"msgId": "q", "msgType": "hologram", "senderId": USER})
    assert ref.unavailable_reason == "unsupported" and not ref.recover


def test_no_download_code_or_url_reaches_a_quote() -> None:
    ref = quote_reference(
        {"msgId": "q", "msgType": "picture", "content": {"downloadCode": "SECRET"}},
        bot_user=BOT,
        process_key=None,
    )
    assert "SECRET" not in repr(msgspec.to_builtins(ref, builtin_types=None, str_keys=True))


# -- errors and rendering ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (401, {"code": "InvalidAuthentication"}, AuthError),
        (403, {"code": "Forbidden.AccessDenied.AccessTokenPermissionDenied"}, PermissionDenied),
        (403, {"code": "Forbidden.AccessDenied.QpsLimitForAppkeyAndApi"}, RateLimited),
        (429, {"code": "Throttling"}, RateLimited),
        (404, {"code": "cardNotFound"}, NotFound),
        (503, {}, TransportError),
        (200, {"errcode": 130101, "errmsg": "send too fast"}, RateLimited),
        (200, {"errcode": -1}, TransportError),
    ],
)
def test_errors_are_mapped_once(status: int, body: dict[str, Any], kind: type) -> None:
    err = classify_error(status, m.error_decoder.decode(json.dumps(body)), "POST /x")
    assert type(err) is kind


@pytest.mark.parametrize(
    ("text", "card"),
    [
        ("one\ntwo", "one<br>two"),
        ("one\r\ntwo\nthree", "one<br>two<br>three"),
        ("para\n\nnext", "para\n\nnext"),
        ("- a\n- b", "- a\n- b"),
        ("```\ncode\nmore\n```\nafter", "```\ncode\nmore\n```\nafter"),
        ("intro\n- item", "intro\n- item"),
        ("intro\n1. item", "intro\n1. item"),
        ("# Title\nbody", "# Title\nbody"),
        ("text\n> quote", "text\n> quote"),
        ("text\n| a | b |", "text\n| a | b |"),
        ("第一行\n第二行\n```\ncode\n```\n结尾", "第一行<br>第二行\n```\ncode\n```\n结尾"),
    ],
)
def test_card_markdown_makes_single_line_breaks_visible(text: str, card: str) -> None:
    assert card_markdown(text) == card


def test_the_bot_user_falls_back_to_the_configured_one_when_an_event_omits_it() -> None:
    mapper = MessageMapper(bot_id="robot", robot_code="robot", chatbot_user_id=BOT)
    event = robot(chatbotUserId=None)
    event["text"] = {
        "content": "and?",
        "isReplyMsg": True,
        "repliedMsg": {"msgId": "q", "msgType": "interactiveCard", "senderId": BOT},
    }
    item = mapper.decode_raw(json.dumps(event).encode())
    assert isinstance(item, InboundMessage) and item.reply_to is not None
    assert item.reply_to.author_id == BOT and item.reply_to.recover
    assert isinstance(
        mapper.decode_raw(json.dumps(robot(chatbotUserId=None, senderId=BOT)).encode()), Skip
    )


def test_a_placeholder_card_of_another_sender_is_not_recovered_by_time() -> None:
    ref = quoted(
        {
            "msgId": "q",
            "msgType": "interactiveCard",
            "senderId": "$:LWCP_v1:$otherbot",
            "createdAt": 1796032000000,
            "content": "[Interactive Card Message]",
        }
    )
    assert ref.recover and ref.recover_at is None and ref.author_id == "$:LWCP_v1:$otherbot"


def test_the_inbox_copy_has_no_session_webhook_and_still_maps() -> None:
    from dshim.channels.dingtalk.protocol import without_webhook

    raw = json.dumps(robot()).encode()
    kept = without_webhook(raw)
    assert b"sendBySession" not in kept
    assert json.loads(kept)["sessionWebhook"] == ""
    item = MAPPER.decode_raw(kept)
    assert isinstance(item, InboundMessage) and item.content == "hello"
    assert isinstance(item.route, Route) and not item.route.session_webhook
    assert "sendBySession" not in repr(mapped().route)
    no_hook = json.dumps({k: v for k, v in robot().items() if k != "sessionWebhook"}).encode()
    assert without_webhook(no_hook) == no_hook


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        ({"client_secret": None}, "bots[0].client_secret: required key is missing"),
        ({"answer": "cards"}, 'bots[0].answer: expected "card" or "markdown"'),
        ({"api_base": "ftp://x"}, "bots[0].api_base: expected an http:// or https:// URL"),
        ({"client_id": "a b"}, "bots[0].client_id: not a DingTalk Client ID"),
        ({"webhook": "x"}, "bots[0].webhook: unknown key"),
    ],
)
def test_bad_settings_name_the_key(keys: dict[str, Any], error: str) -> None:
    from dshim.channels.registry import parse_config
    from dshim.errors import ConfigError

    table = {"name": "d", "channel": "dingtalk", "client_id": "dingx", "client_secret": "s3cret"}
    with pytest.raises(ConfigError, match=re.escape(error)):
        bot = {k: v for k, v in {**table, **keys}.items() if v is not None}
        parse_config({"bots": [bot]}, env={})


def test_settings_defaults() -> None:
    from dshim.channels.dingtalk.channel import DingTalkSettings
    from dshim.channels.registry import parse_config

    config = parse_config(
        {
            "bots": [
                {"name": "d", "channel": "dingtalk", "client_id": "dingx", "client_secret": "s"}
            ]
        },
        env={},
    )
    settings = config.bots[0].settings
    assert isinstance(settings, DingTalkSettings)
    assert (settings.robot, settings.answer, settings.api_base) == (
        "dingx",
        "card",
        DEFAULT_API_BASE,  # the platform's own host: named by the channel, never reached
    )


def test_a_group_message_without_the_at_flag_is_addressed_and_callbacks_are_ignored() -> None:
    assert mapped(conversationType="2", isInAtList=None).addressed
    item = MAPPER.decode_raw(
        json.dumps(robot(msgtype="interactiveCardCallback", text=None)).encode()
    )
    assert isinstance(item, Skip) and item.reason == "ignored"


WEIRD: list[Any] = [None, 0, -1, 1e400, "", "x", "\u0000", [], {}, True, [{}], {"a": [None]}]


def quote_event(**replied: Any) -> dict[str, Any]:
    base = {"msgId": "q", "msgType": "text", "senderId": USER, "content": {"content": "c"}}
    base.update(replied)
    return robot(text={"content": "x", "isReplyMsg": True, "repliedMsg": base})


@pytest.mark.parametrize("value", WEIRD, ids=repr)
def test_no_field_of_any_type_makes_the_mapping_raise(value: Any) -> None:
    fields = [k for k in robot() if k != "msgId"] + ["content", "atUsers", "quoteMessage"]
    for key in fields:
        for msgtype in ("text", "richText", "picture", "file", "audio", "unknown"):
            event = robot(msgtype=msgtype)
            event[key] = value
            MAPPER.decode_raw(json.dumps(event).encode())  # a message or a Skip, never raises
        for qkey in ("msgId", "msgType", "senderId", "createdAt", "content", "senderNick"):
            for qtype in ("text", "richText", "interactiveCard", "chatRecord", "file"):
                event = quote_event(msgType=qtype)
                event["text"]["repliedMsg"][qkey] = value
                item = MAPPER.decode_raw(json.dumps(event).encode())
                assert isinstance(item, InboundMessage | Skip)


def test_original_msg_id_fills_a_quote_without_its_own_id() -> None:
    ref = quoted({"msgType": "picture", "senderId": USER}, originalMsgId="orig==")
    assert ref.message_id == "orig==" and ref.attachments == [m_att("image")]
