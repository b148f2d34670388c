"""Table tests of the sans-IO Feishu code: the pbbp2 codec (round trips, golden bytes,
hypothesis fuzz), fragment reassembly, the session's pings/pongs/acks/watchdog, the event
mapping and the looked-up message mapping."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dshim.channels.feishu import models as m
from dshim.channels.feishu.protocol import (
    FRAGMENT_TTL_S,
    METHOD_CONTROL,
    METHOD_DATA,
    EventMapper,
    FeishuSession,
    Frame,
    FrameError,
    Reassembler,
    Recall,
    card_text,
    classify_error,
    decode_frame,
    encode_frame,
    fetched_reference,
    service_id_of,
)
from dshim.errors import (
    AuthError,
    Deleted,
    FatalChannelError,
    NotFound,
    PermissionDenied,
    RateLimited,
    TransportError,
)
from dshim.model import InboundMessage, Skip
from dshim.net.ws_session import Close, Connected, Deliver, Ignored, Send, WsEnded

BOT = "ou_bot"
APP = "cli_app"


# --- codec ------------------------------------------------------------------------------------


def test_ping_frame_golden_bytes() -> None:
    # SeqID 0, LogID 0, service 7, method 0 (all required: written even when 0), header type=ping
    frame = Frame(service=7, method=METHOD_CONTROL, headers=[("type", "ping")])
    assert encode_frame(frame) == bytes.fromhex("08001000180720002a0c0a0474797065120470696e67")


def test_decode_skips_unknown_fields_and_keeps_known_ones() -> None:
    frame = Frame(
        seq_id=300, log_id=2**40, service=1, method=1, headers=[("sum", "1")], payload=b"{}"
    )
    extra = bytes([0x58]) + b"\x05" + bytes([0x62, 2]) + b"hi" + bytes([0x6D]) + b"\x00\x00\x00\x00"
    got = decode_frame(encode_frame(frame) + extra)
    assert got == frame


def test_decode_rejects_missing_required_fields() -> None:
    with pytest.raises(FrameError):
        decode_frame(bytes.fromhex("0801"))  # only SeqID


@pytest.mark.parametrize(
    "data",
    [
        b"\x08",
        b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",
        b"\x42\x05ab",
        b"\x0b",
        b"\x2a\x02\x0a\x05",
    ],
)
def test_decode_rejects_truncated_and_bad_wire_types(data: bytes) -> None:
    with pytest.raises(FrameError):
        decode_frame(data)


headers = st.lists(st.tuples(st.text(max_size=20), st.text(max_size=40)), max_size=6)
frames = st.builds(
    Frame,
    seq_id=st.integers(0, 2**64 - 1),
    log_id=st.integers(0, 2**64 - 1),
    service=st.integers(-(2**31), 2**31 - 1),
    method=st.integers(0, 1),
    headers=headers,
    payload_encoding=st.none() | st.text(max_size=10),
    payload_type=st.none() | st.text(max_size=10),
    payload=st.none() | st.binary(max_size=200),
    log_id_new=st.none() | st.text(max_size=20),
)


@given(frames)
@settings(max_examples=300, deadline=None)
def test_round_trip(frame: Frame) -> None:
    assert decode_frame(encode_frame(frame)) == frame


@given(st.binary(max_size=300))
@settings(max_examples=1000, deadline=None)
def test_arbitrary_bytes_never_crash(data: bytes) -> None:
    try:
        decode_frame(data)
    except FrameError:
        pass


@given(frames, st.integers(0, 400), st.integers(0, 255))
@settings(max_examples=300, deadline=None)
def test_mutated_frames_decode_or_fail_cleanly(frame: Frame, at: int, byte: int) -> None:
    data = bytearray(encode_frame(frame))
    data[at % len(data)] = byte
    try:
        decode_frame(bytes(data))
    except FrameError:
        pass


def test_service_id_from_url() -> None:
    assert service_id_of("wss://x/ws?device_id=1&service_id=33&ticket=s") == 33
    assert service_id_of("wss://x/ws") == 0


# --- reassembly -------------------------------------------------------------------------------


def test_fragments_in_any_order_make_the_event() -> None:
    r = Reassembler()
    assert r.add("f1", 3, 2, b"c", 0.0) is None
    assert r.add("f1", 3, 0, b"a", 0.1) is None
    assert r.add("f1", 3, 1, b"b", 0.2) == b"abc"
    assert len(r) == 0


def test_incomplete_fragments_expire() -> None:
    r = Reassembler()
    assert r.add("f1", 2, 0, b"a", 0.0) is None
    assert r.add("f2", 2, 0, b"x", FRAGMENT_TTL_S + 1) is None  # f1 expired meanwhile
    assert r.add("f1", 2, 1, b"b", FRAGMENT_TTL_S + 1) is None  # a fresh, incomplete f1
    assert len(r) == 2


@pytest.mark.parametrize("total,seq", [(2, 2), (2, -1), (5000, 0)])
def test_impossible_fragments_are_refused(total: int, seq: int) -> None:
    with pytest.raises(ValueError):
        Reassembler().add("f", total, seq, b"a", 0.0)


def test_fragment_size_is_bounded() -> None:
    r = Reassembler()
    big = b"x" * (5 * 1024 * 1024)
    assert r.add("f", 2, 0, big, 0.0) is None
    with pytest.raises(ValueError):
        r.add("f", 2, 1, big, 0.0)
    assert len(r) == 0


# --- session ----------------------------------------------------------------------------------


def data_frame(payload: bytes, *, fid: str = "f1", total: int = 1, seq: int = 0) -> bytes:
    return encode_frame(
        Frame(
            seq_id=9,
            log_id=8,
            service=7,
            method=METHOD_DATA,
            headers=[
                ("type", "event"),
                ("message_id", fid),
                ("sum", str(total)),
                ("seq", str(seq)),
                ("instance_id", "i-1"),
            ],
            payload=payload,
        )
    )


def pong(config: dict[str, Any] | None = None) -> bytes:
    payload = json.dumps(config).encode() if config else None
    return encode_frame(Frame(service=7, headers=[("type", "pong")], payload=payload))


def open_session() -> FeishuSession:
    s = FeishuSession(random=lambda: 0.5)
    s.set_endpoint("wss://h/ws?service_id=7&ticket=t", m.ClientConfig(ping_interval=10))
    return s


def test_ping_at_once_then_every_interval_and_first_pong_is_live() -> None:
    s = open_session()
    [ping] = s.connection_opened(0.0)
    assert isinstance(ping, Send)
    assert decode_frame(ping.data).header("type") == "ping"  # type: ignore[arg-type]
    assert decode_frame(ping.data).service == 7  # type: ignore[arg-type]
    assert isinstance(s.receive(pong(), 0.1)[0], Connected)
    assert s.tick(9.9, reading=True) == []
    [again] = s.tick(10.0, reading=True)
    assert isinstance(again, Send) and again.kind == "ping"


def test_pong_client_config_applies() -> None:
    s = open_session()
    s.connection_opened(0.0)
    s.receive(pong({"PingInterval": 3, "ReconnectInterval": 9, "ReconnectNonce": 2}), 1.0)
    assert s.settings.ping_interval == 3
    assert s.settings.reconnect_interval == 9
    assert s.tick(3.9, reading=True) == []
    assert [a.kind for a in s.tick(4.0, reading=True) if isinstance(a, Send)] == ["ping"]


def test_watchdog_closes_without_pong_but_not_while_delivering() -> None:
    s = open_session()
    s.connection_opened(0.0)
    s.tick(10.0, reading=True)  # second ping, no pong yet
    held = s.tick(20.0, reading=False)  # a delivery in hand: look again later
    assert not [a for a in held if isinstance(a, Close)]
    [close] = s.tick(21.0, reading=True)
    assert isinstance(close, Close) and close.code == 4000


def test_event_is_acked_after_acknowledge_with_headers_echoed() -> None:
    s = open_session()
    s.connection_opened(0.0)
    event = b'{"schema":"2.0","header":{"event_type":"x"},"event":{}}'
    [deliver] = s.receive(data_frame(event), 1.0)
    assert isinstance(deliver, Deliver) and deliver.ack is None
    assert deliver.event.payload == event
    s.acknowledge(deliver.event, 1.25, data=b'{"toast":{}}')
    assert s.next_timer() is not None and s.next_timer() < 0  # type: ignore[operator]
    [ack] = s.tick(1.25, reading=True)
    assert isinstance(ack, Send)
    frame = decode_frame(ack.data)  # type: ignore[arg-type]
    assert (frame.seq_id, frame.log_id, frame.service, frame.method) == (9, 8, 7, METHOD_DATA)
    assert frame.header("instance_id") == "i-1" and frame.header("biz_rt") == "250"
    body = json.loads(frame.payload or b"")
    assert body["code"] == 200
    assert json.loads(base64.b64decode(body["data"])) == {"toast": {}}


def test_acks_never_cross_connections() -> None:
    s = open_session()
    s.connection_opened(0.0)
    [deliver] = s.receive(data_frame(b"{}"), 1.0)
    assert isinstance(deliver, Deliver)
    s.connection_lost(WsEnded(None, connected_for=1.0), 2.0)
    s.connection_opened(3.0)
    s.acknowledge(deliver.event, 3.0)
    assert all(a.kind != "ack" for a in s.tick(3.0, reading=True) if isinstance(a, Send))


def test_fragmented_event_is_delivered_once_complete() -> None:
    s = open_session()
    s.connection_opened(0.0)
    assert s.receive(data_frame(b'{"a":', total=2, seq=0), 0.1) == []
    [deliver] = s.receive(data_frame(b"1}", total=2, seq=1), 0.2)
    assert isinstance(deliver, Deliver) and deliver.event.payload == b'{"a":1}'


def test_card_frames_and_garbage_are_not_acked() -> None:
    s = open_session()
    s.connection_opened(0.0)
    card = encode_frame(Frame(method=METHOD_DATA, headers=[("type", "card")], payload=b"{}"))
    assert s.receive(card, 0.1) == []
    [bad] = s.receive(b"\xff\xff", 0.1)
    assert isinstance(bad, Ignored)
    [text] = s.receive("text", 0.1)
    assert isinstance(text, Ignored)


def test_reconnect_schedule_and_fatal_403() -> None:
    s = open_session()
    s.connection_opened(0.0)
    s.receive(pong({"ReconnectNonce": 30, "ReconnectInterval": 120}), 0.1)
    s.connection_lost(WsEnded(None, connected_for=5.0), 10.0)
    assert s.reconnect_delay() == 15.0  # random() x ReconnectNonce, once
    s.connection_lost(WsEnded(None), 20.0)
    assert s.reconnect_delay() == 120.0
    with pytest.raises(FatalChannelError):
        s.connection_lost(WsEnded(None, rejected=403), 30.0)


# --- mapping ----------------------------------------------------------------------------------


def envelope(event_type: str, event: dict[str, Any]) -> bytes:
    env = {
        "schema": "2.0",
        "header": {"event_id": "e1", "event_type": event_type, "create_time": "1796000000000"},
        "event": event,
    }
    return json.dumps(env).encode()


def message_event(
    content: dict[str, Any] | str,
    *,
    msg_type: str = "text",
    chat_type: str = "p2p",
    mentions: list[dict[str, Any]] | None = None,
    **extra: Any,
) -> bytes:
    message: dict[str, Any] = {
        "message_id": "om_1",
        "chat_id": "oc_1",
        "chat_type": chat_type,
        "message_type": msg_type,
        "content": content if isinstance(content, str) else json.dumps(content),
        "create_time": "1796000000000",
        **extra,
    }
    if mentions is not None:
        message["mentions"] = mentions
    return envelope(
        "im.message.receive_v1",
        {"sender": {"sender_id": {"open_id": "ou_u"}, "sender_type": "user"}, "message": message},
    )


def mention(key: str, open_id: str, name: str) -> dict[str, Any]:
    return {"key": key, "id": {"open_id": open_id}, "name": name}


MAPPER = EventMapper(bot_open_id=BOT, app_id=APP, lookup=lambda c, i: _never)


async def _never() -> None:
    raise AssertionError("no lookup in table tests")


def mapped(raw: bytes) -> InboundMessage:
    item = MAPPER.decode(raw)
    assert isinstance(item, InboundMessage), item
    return item


def test_direct_text() -> None:
    msg = mapped(message_event({"text": "hello"}))
    assert (msg.conversation_type, msg.conversation_id, msg.sender_id) == ("direct", "oc_1", "ou_u")
    assert msg.addressed and msg.content == "hello" and msg.received_at == 1796000000.0


def test_group_mentions_bot_removed_other_named() -> None:
    msg = mapped(
        message_event(
            {"text": "@_user_1 ask @_user_2 please"},
            chat_type="group",
            mentions=[mention("@_user_1", BOT, "dshim"), mention("@_user_2", "ou_b", "Bob")],
        )
    )
    assert msg.conversation_type == "group" and msg.addressed
    assert msg.content == "ask @Bob please"


def test_group_without_bot_mention_is_unaddressed() -> None:
    msg = mapped(
        message_event(
            {"text": "@_user_1 hi"},
            chat_type="group",
            mentions=[mention("@_user_1", "ou_b", "Bob")],
        )
    )
    assert not msg.addressed and msg.content == "@Bob hi"


def test_post_with_title_link_code_at_and_image() -> None:
    post = {
        "title": "Report",
        "content": [
            [
                {"tag": "at", "user_id": "@_user_1", "user_name": "dshim"},
                {"tag": "text", "text": " see "},
                {"tag": "a", "text": "docs", "href": "https://x"},
            ],
            [{"tag": "code_block", "language": "PYTHON", "text": "print(1)\n"}],
            [{"tag": "img", "image_key": "img_1"}],
        ],
    }
    msg = mapped(message_event(post, msg_type="post", mentions=[mention("@_user_1", BOT, "dshim")]))
    assert msg.content == "Report\nsee docs\n\n```python\nprint(1)\n```"
    assert [(i.kind, i.fetch is None) for i in msg.images] == [("image", True)]


@pytest.mark.parametrize(
    "msg_type,content,images,files",
    [
        ("image", {"image_key": "img_1"}, 1, 0),
        ("file", {"file_key": "f_1", "file_name": "a.pdf"}, 0, 1),
        ("audio", {"file_key": "f_2", "duration": 1000}, 0, 1),
        ("media", {"file_key": "f_3", "image_key": "i", "file_name": "v.mp4"}, 0, 1),
    ],
)
def test_media_messages_are_lazy_handles(
    msg_type: str, content: dict[str, Any], images: int, files: int
) -> None:
    msg = mapped(message_event(content, msg_type=msg_type))
    assert (len(msg.images), len(msg.files), msg.content) == (images, files, "")


@pytest.mark.parametrize(
    "msg_type,content,text",
    [
        ("sticker", {"file_key": "s"}, "[sticker]"),
        ("share_chat", {"chat_id": "oc_2"}, "[shared chat]"),
        ("system", {"template": "x"}, "[system message]"),
        ("location", {"name": "Office"}, "[location: Office]"),
        ("whatever_new", {}, "[whatever_new message]"),
    ],
)
def test_other_types_are_short_placeholders(
    msg_type: str, content: dict[str, Any], text: str
) -> None:
    assert mapped(message_event(content, msg_type=msg_type)).content == text


def test_quote_has_a_loader_and_topic_root_is_no_quote() -> None:
    quoted = mapped(message_event({"text": "x"}, parent_id="om_0", root_id="om_0"))
    assert quoted.reply_to is not None and quoted.reply_to.message_id == "om_0"
    assert quoted.reply_to.loader is not None
    topic = mapped(
        message_event({"text": "x"}, parent_id="om_r", root_id="om_r", thread_id="omt_1")
    )
    assert topic.reply_to is None and topic.thread_id == "om_r"  # the topic's root message
    inner = mapped(
        message_event({"text": "x"}, parent_id="om_2", root_id="om_r", thread_id="omt_1")
    )
    assert inner.reply_to is not None and inner.reply_to.message_id == "om_2"


@pytest.mark.parametrize(
    "chat_type,fields,thread",
    [
        ("group", {"thread_id": "omt_1"}, "om_1"),  # a topic's first message
        ("group", {"thread_id": "omt_1", "root_id": "om_r", "parent_id": "om_r"}, "om_r"),
        ("group", {"thread_id": "omt_1", "root_id": "om_r", "parent_id": "om_2"}, "om_r"),
        ("group", {"thread_id": "omt_1", "root_id": "omt_1"}, "om_1"),  # root_id the topic
        ("topic_group", {}, "om_1"),  # a first message without thread_id
        ("topic_group", {"root_id": "om_r", "parent_id": "om_r"}, "om_r"),
        ("group", {}, None),
        ("group", {"root_id": "om_r", "parent_id": "om_r"}, None),  # a quote, not a topic
        ("p2p", {"root_id": "om_r", "parent_id": "om_r"}, None),
    ],
)
def test_a_topic_is_keyed_by_its_root_message(
    chat_type: str, fields: dict[str, str], thread: str | None
) -> None:
    msg = mapped(message_event({"text": "x"}, chat_type=chat_type, **fields))
    assert msg.thread_id == thread


def test_a_reply_without_parent_id_quotes_its_root() -> None:
    # The seed's fallback: parent_id, else root_id when it is not the message itself.
    rooted = mapped(message_event({"text": "x"}, root_id="om_r", thread_id="omt_1"))
    assert rooted.reply_to is not None and rooted.reply_to.message_id == "om_r"
    assert rooted.reply_to.loader is not None
    plain = mapped(message_event({"text": "x"}, root_id="om_r"))
    assert plain.reply_to is not None and plain.reply_to.message_id == "om_r"
    itself = mapped(message_event({"text": "x"}, root_id="om_1", thread_id="omt_1"))
    assert itself.reply_to is None  # the topic's root message itself
    topic_id = mapped(message_event({"text": "x"}, root_id="omt_1", thread_id="omt_1"))
    assert topic_id.reply_to is None  # the topic's id is no message to quote


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[" * 5000,
        b'{"schema":"2.0"}',
        envelope("im.message.receive_v1", {"sender": 5, "message": {}}),
        message_event("\udc00 bad", msg_type="text").replace(b"\\udc00", b"\\ud800"),
    ],
)
def test_bad_input_is_a_malformed_skip(raw: bytes) -> None:
    item = MAPPER.decode(raw)
    assert isinstance(item, (Skip, InboundMessage))
    if isinstance(item, Skip):
        assert item.reason == "malformed"


def test_recall_and_other_events() -> None:
    recall = MAPPER.decode(
        envelope("im.message.recalled_v1", {"message_id": "om_1", "chat_id": "oc_1"})
    )
    assert recall == Recall("oc_1", "om_1")
    assert MAPPER.decode_raw(envelope("im.message.recalled_v1", {"message_id": "om_1"})) == Skip(
        reason="ignored", detail="recall"
    )
    other = MAPPER.decode(envelope("im.chat.member.bot.added_v1", {}))
    assert isinstance(other, Skip) and other.reason == "ignored"


def test_card_click_is_the_clickers_answer() -> None:
    raw = envelope(
        "card.action.trigger",
        {
            "operator": {"open_id": "ou_u"},
            "token": "c-1",
            "action": {
                "tag": "button",
                "value": {"dshim": 1, "answer": "Allow", "thread": "", "kind": "group"},
            },
            "context": {"open_message_id": "om_card", "open_chat_id": "oc_9"},
        },
    )
    msg = mapped(raw)
    assert (msg.content, msg.sender_id, msg.conversation_id, msg.message_id) == (
        "Allow",
        "ou_u",
        "oc_9",
        "card:c-1",
    )
    assert msg.route == "om_card" and msg.conversation_type == "group"


# --- cards ------------------------------------------------------------------------------------


CARD_1 = {
    "config": {"wide_screen_mode": True},
    "header": {"title": {"tag": "plain_text", "content": "Build"}},
    "elements": [
        {"tag": "div", "text": {"tag": "lark_md", "content": "**passed** [log](https://ci/x)"}},
        {
            "tag": "action",
            "actions": [
                {
                    "tag": "button",
                    "text": {"tag": "plain_text", "content": "Open"},
                    "url": "https://ci",
                    "value": {"secret": "v"},
                }
            ],
        },
        {"tag": "markdown", "content": "hidden part", "hidden": True},
    ],
}
CARD_2_RAW = {
    "json_card": json.dumps(
        {
            "schema": "2.0",
            "body": {
                "elements": [
                    {
                        "tag": "markdown",
                        "property": {"content": "streamed answer", "element_id": "answer"},
                    }
                ]
            },
            "config": {"summary": {"content": "summary text"}},
        }
    )
}
CARD_I18N = {
    "i18n_elements": {
        "en_us": [{"tag": "markdown", "content": "Hello"}],
        "zh_cn": [{"tag": "markdown", "content": "你好"}],
    },
    "header": {"i18n_title": {"ja_jp": "ja", "en_us": "Greeting"}},
}


@pytest.mark.parametrize(
    "card,text",
    [
        (CARD_1, "Build\n**passed** log\nOpen"),
        (CARD_2_RAW, "streamed answer"),
        (CARD_I18N, "你好\nGreeting"),
        (
            {
                "title": "",
                "elements": [[{"tag": "text", "text": "请升级至最新版本客户端，以查看内容"}]],
            },
            None,
        ),
        ({"type": "card", "data": {"card_id": "card_1"}}, None),
        ({}, None),
    ],
)
def test_card_visible_text(card: dict[str, Any], text: str | None) -> None:
    assert card_text(card) == text


# --- looked-up messages -----------------------------------------------------------------------


def answer(item: dict[str, Any]) -> m.MessageAnswer:
    return msgspec.json.decode(
        json.dumps({"code": 0, "data": {"items": [item]}}), type=m.MessageAnswer
    )


def item(**kw: Any) -> dict[str, Any]:
    base = {
        "message_id": "om_q",
        "msg_type": "text",
        "chat_id": "oc_1",
        "deleted": False,
        "sender": {"id": "ou_x", "id_type": "open_id", "sender_type": "user"},
        "body": {"content": json.dumps({"text": "quoted"})},
    }
    base.update(kw)
    return base


def ref(it: dict[str, Any]) -> Any:
    return fetched_reference(
        answer(it), chat_id="oc_1", message_id="om_q", app_id=APP, bot_open_id=BOT, bot_name="dshim"
    )


def test_lookup_results() -> None:
    ok = ref(item())
    assert (ok.content, ok.author_id) == ("quoted", "ou_x")
    assert ref(item(chat_id="oc_other")) is None  # another chat: not-found, content discarded
    # Without a chat_id the message cannot be shown to be this chat's: never used either.
    no_chat = item()
    del no_chat["chat_id"]
    assert ref(no_chat) is None
    assert ref(item(chat_id="")) is None and ref(item(chat_id=None)) is None
    assert ref(item(deleted=True)).unavailable_reason == "deleted"
    bot = ref(item(sender={"id": APP, "id_type": "app_id", "sender_type": "app"}))
    assert (bot.author_id, bot.author_name) == (BOT, "dshim")
    img = ref(item(msg_type="image", body={"content": json.dumps({"image_key": "k"})}))
    assert [(a.kind, a.name) for a in img.attachments] == [("image", None)]
    f = ref(
        item(msg_type="file", body={"content": json.dumps({"file_key": "k", "file_name": "r.pdf"})})
    )
    assert [(a.kind, a.name) for a in f.attachments] == [("file", "r.pdf")]
    empty = ref(item(msg_type="interactive", body={"content": json.dumps({"elements": []})}))
    assert empty.unavailable_reason == "unsupported"


@pytest.mark.parametrize(
    "status,code,kind",
    [
        (400, 99991672, PermissionDenied),
        (400, 230027, PermissionDenied),
        (400, 230110, Deleted),
        (400, 230001, NotFound),
        (429, 99991400, RateLimited),
        (400, 99991663, AuthError),
        (500, 1, TransportError),
        (400, 230049, TransportError),
    ],
)
def test_error_classification(status: int, code: int, kind: type[Exception]) -> None:
    assert type(classify_error(status, code, "x")) is kind


def test_too_many_connections_is_fatal_other_514s_are_not() -> None:
    s = open_session()
    s.connection_lost(
        WsEnded(None, rejected=514, rejected_headers=(("handshake-autherrcode", "1000040351"),)),
        1.0,
    )
    with pytest.raises(FatalChannelError):
        s.connection_lost(
            WsEnded(
                None, rejected=514, rejected_headers=(("handshake-autherrcode", "1000040350"),)
            ),
            2.0,
        )


def test_text_keeps_its_indentation_and_at_all_is_named() -> None:
    code = "@_user_1 fix this:\n    if x:\n        y()"
    msg = mapped(message_event({"text": code}, mentions=[mention("@_user_1", BOT, "dshim")]))
    assert msg.content == "fix this:\n    if x:\n        y()"
    everyone = mapped(message_event({"text": "@_all meeting now"}, chat_type="group"))
    assert everyone.content == "@all meeting now" and not everyone.addressed


def test_slow_acceptance_is_acked_early_and_only_once() -> None:
    s = open_session()
    s.connection_opened(0.0)
    s.receive(pong(), 0.0)
    [deliver] = s.receive(data_frame(b"{}"), 1.0)
    assert isinstance(deliver, Deliver)
    assert s.next_timer() == 0.5  # the guard polls while connected
    assert s.tick(1.5, reading=False) == []  # 0.5 s into accepting: nothing yet
    [early] = s.tick(3.0, reading=False)  # 2 s: acked before Feishu's 3 s run out
    assert isinstance(early, Send) and early.kind == "ack"
    assert decode_frame(early.data).header("biz_rt") == "2000"  # type: ignore[arg-type]
    s.acknowledge(deliver.event, 4.0)  # accept returned: no second ack
    assert [a for a in s.tick(4.0, reading=True) if isinstance(a, Send) and a.kind == "ack"] == []


def test_data_frame_from_hand_written_bytes() -> None:
    # Built byte by byte from the pbbp2 field table: 1 SeqID, 2 LogID, 3 service, 4 method,
    # 5 headers {1 key, 2 value}, 6 payload_encoding, 7 payload_type, 8 payload, 9 LogIDNew.
    header = b"\x0a\x04type\x12\x05event"
    data = (
        b"\x08\x96\x01"  # SeqID 150
        b"\x10\x02"  # LogID 2
        b"\x18\x07"  # service 7
        b"\x20\x01"  # method 1 (DATA)
        + b"\x2a"
        + bytes([len(header)])
        + header
        + b"\x32\x04gzip"
        + b"\x3a\x04json"
        + b"\x42\x02{}"
        + b"\x4a\x03abc"
    )
    frame = decode_frame(data)
    assert (frame.seq_id, frame.log_id, frame.service, frame.method) == (150, 2, 7, 1)
    assert frame.headers == [("type", "event")]
    assert (frame.payload_encoding, frame.payload_type, frame.payload, frame.log_id_new) == (
        "gzip",
        "json",
        b"{}",
        "abc",
    )
    assert encode_frame(frame) == data
