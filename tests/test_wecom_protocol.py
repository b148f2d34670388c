"""Table tests of the WeCom sans-IO code: mapping, quotes, frames, pings, budget, media."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import pytest
from msgspec import UNSET

from dshim.channels.wecom import media
from dshim.channels.wecom import protocol as p
from dshim.channels.wecom.render import split
from dshim.errors import AuthError, ChannelError, FatalChannelError, RateLimited
from dshim.model import InboundMessage, Option, Skip
from dshim.net.ws_session import Close, Connected, Deliver, Ignored, Send, WsEnded

BOT = "aib-test"
URL = "https://ww-aibot-img-1258476243.cos.ap-guangzhou.myqcloud.com/abc?sign=x"
KEY = base64.b64encode(bytes(range(32))).decode().rstrip("=")


def frame(body: dict[str, Any], cmd: str = p.MSG_CALLBACK, req_id: str = "rq-1") -> bytes:
    return json.dumps({"cmd": cmd, "headers": {"req_id": req_id}, "body": body}).encode()


def body(msgtype: str = "text", **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "msgid": "m-1",
        "aibotid": BOT,
        "chattype": "single",
        "from": {"userid": "zhangsan"},
        "msgtype": msgtype,
    }
    out.update(kw)
    return out


def mapped(b: dict[str, Any], cmd: str = p.MSG_CALLBACK) -> InboundMessage:
    made: list[str] = []

    def media_factory(kind: str, item: Any) -> Any:
        made.append(kind)

        async def fetch(n: int) -> bytes:
            return b""

        return fetch

    out = p.Mapper(BOT, media=media_factory).decode_frame(frame(b, cmd))
    assert isinstance(out, InboundMessage), out
    return out


# --- mapping ---------------------------------------------------------------------------------


def test_direct_text() -> None:
    msg = mapped(body(text={"content": "  hello  "}, create_time=1700000000))
    assert (msg.conversation_id, msg.conversation_type, msg.sender_id) == (
        "zhangsan",
        "direct",
        "zhangsan",
    )
    assert msg.content == "hello" and msg.addressed and msg.message_id == "m-1"
    assert msg.received_at == 1700000000.0
    assert msg.route == p.Route(req_id="rq-1", chatid="zhangsan", received_at=1700000000.0)
    assert msg.reply_to is None


@pytest.mark.parametrize(
    ("text", "content"),
    [
        ("@dshim what is up", "what is up"),
        ("@机器人 你好", "你好"),
        ("  @dshim\nline two", "line two"),
        ("@dshim", ""),
        ("no mention here", "no mention here"),
        ("email@x.com stays", "email@x.com stays"),
    ],
)
def test_group_mention_token_removed(text: str, content: str) -> None:
    msg = mapped(body(chattype="group", chatid="wrk1", text={"content": text}))
    assert msg.conversation_id == "wrk1" and msg.conversation_type == "group"
    assert msg.content == content
    assert msg.addressed
    assert msg.route.chatid == "wrk1"


def test_voice_is_its_transcript() -> None:
    assert mapped(body("voice", voice={"content": "语音转文字"})).content == "语音转文字"


def test_mixed_texts_joined_images_as_images() -> None:
    mixed = {
        "msg_item": [
            {"msgtype": "text", "text": {"content": "one"}},
            {"msgtype": "image", "image": {"url": URL, "aeskey": KEY}},
            {"msgtype": "text", "text": {"content": "two"}},
            {"msgtype": "image", "image": {"url": URL, "aeskey": KEY}},
        ]
    }
    msg = mapped(body("mixed", mixed=mixed))
    assert msg.content == "one\ntwo"
    assert [i.kind for i in msg.images] == ["image", "image"]
    assert all(i.fetch is not None for i in msg.images)


@pytest.mark.parametrize(
    ("msgtype", "images", "files"),
    [("image", ["image"], []), ("file", [], ["file"]), ("video", [], ["video"])],
)
def test_media_are_lazy_handles(msgtype: str, images: list[str], files: list[str]) -> None:
    msg = mapped(body(msgtype, **{msgtype: {"url": URL, "aeskey": KEY}}))
    assert [i.kind for i in msg.images] == images
    assert [f.kind for f in msg.files] == files
    assert msg.content == ""
    assert URL not in repr(msg)


def test_media_without_url_is_no_handle() -> None:
    assert mapped(body("image", image={"aeskey": KEY})).images == []


@pytest.mark.parametrize(
    ("quote", "content", "attachments"),
    [
        ({"msgtype": "text", "text": {"content": "quoted"}}, "quoted", UNSET),
        ({"msgtype": "voice", "voice": {"content": "说过的话"}}, "说过的话", UNSET),
        (
            {
                "msgtype": "mixed",
                "mixed": {
                    "msg_item": [
                        {"msgtype": "text", "text": {"content": "a"}},
                        {"msgtype": "image", "image": {"url": URL}},
                    ]
                },
            },
            "a",
            [("image", None)],
        ),
        ({"msgtype": "image", "image": {"url": URL, "aeskey": KEY}}, UNSET, [("image", None)]),
        ({"msgtype": "file", "file": {"url": URL, "aeskey": KEY}}, UNSET, [("file", None)]),
        ({"msgtype": "video", "video": {"url": URL}}, UNSET, [("video", None)]),
    ],
)
def test_quote_is_a_content_snapshot(quote: dict[str, Any], content: Any, attachments: Any) -> None:
    ref = mapped(body(text={"content": "and?"}, quote=quote)).reply_to
    assert ref is not None
    assert ref.content == content
    got = UNSET if ref.attachments is UNSET else [(a.kind, a.name) for a in ref.attachments]
    assert got == attachments
    # WeCom gives no id, author or time of the quoted message: never guessed.
    assert ref.message_id is UNSET and ref.author_id is UNSET and ref.author_name is UNSET
    assert ref.unavailable_reason is UNSET
    assert not ref.recover and ref.loader is None
    assert URL not in repr(ref)


@pytest.mark.parametrize(
    "quote",
    [
        {"msgtype": "text", "text": {"content": "   "}},
        {"msgtype": "text"},
        {"msgtype": "image"},
        {"msgtype": "mixed", "mixed": {"msg_item": []}},
        {"msgtype": "location"},
        {},
    ],
)
def test_quote_with_nothing_usable_is_not_delivered(quote: dict[str, Any]) -> None:
    ref = mapped(body(text={"content": "and?"}, quote=quote)).reply_to
    assert ref is not None and ref.unavailable_reason == "not-delivered"


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"not json", "malformed"),
        (b'{"cmd":"aibot_msg_callback","headers":{"req_id":"x"},"body":5}', "malformed"),
        (frame({"msgid": "", "msgtype": "text"}), "malformed"),
        (frame(body(text={"content": 5})), "malformed"),
        (frame(body(chattype="group", text={"content": "x"})), "malformed"),  # no chatid
        (b'{"cmd":"aibot_msg_callback","body":' + b'{"a":' * 100 + b"1" + b"}" * 101, "malformed"),
        (
            b'{"cmd":"aibot_msg_callback","headers":{"req_id":"x"},"body":{"msgid":"\\ud800"}}',
            "malformed",
        ),
        (frame(body("location")), "ignored"),
        (frame(body("event", event={"eventtype": "enter_chat"}), p.EVENT_CALLBACK), "ignored"),
        (frame(body("event", event={"eventtype": "feedback_event"}), p.EVENT_CALLBACK), "ignored"),
        (frame(body(text={"content": "x"}), "aibot_other"), "ignored"),
    ],
)
def test_bad_and_foreign_frames_are_skips(raw: bytes, reason: str) -> None:
    out = p.Mapper(BOT).decode_frame(raw)
    assert isinstance(out, Skip) and out.reason == reason


def test_card_click_is_the_typed_answer_it_stands_for() -> None:
    ev = body(
        "event",
        msgid="ev-1",
        create_time=1700000001,
        event={
            "eventtype": "template_card_event",
            "template_card_event": {"event_key": p.option_key(1), "task_id": "t-1"},
        },
    )
    mapper = p.Mapper(BOT)

    def answer(b: dict[str, Any]) -> InboundMessage | Skip:
        decoded = p.decode_body(frame(b, p.EVENT_CALLBACK))
        assert isinstance(decoded, tuple)
        ev = p.map_event(*decoded)
        assert isinstance(ev, p.ChatEvent) and ev.kind == "template_card_event"
        return mapper.card_answer(ev, decoded[1])

    msg = answer(ev)
    assert isinstance(msg, InboundMessage)
    assert (msg.content, msg.message_id, msg.sender_id) == ("2", "ev-1", "zhangsan")
    assert msg.route.task_id == "t-1"
    flat = body("event", event={"eventtype": "template_card_event", "event_key": "dshim_opt_3"})
    flat_msg = answer(flat)
    assert isinstance(flat_msg, InboundMessage) and flat_msg.content == "3"
    foreign = body("event", event={"eventtype": "template_card_event", "event_key": "buy"})
    assert isinstance(answer(foreign), Skip)
    # Decoded again (after a restart, in replay) a click is never a message.
    again = mapper.decode_frame(frame(ev, p.EVENT_CALLBACK))
    assert isinstance(again, Skip) and again.reason == "ignored"


@pytest.mark.parametrize(
    ("key", "answer"),
    [
        ("dshim_opt_1", "1"),
        ("dshim_opt_12", "12"),
        ("dshim_opt_0", None),
        ("dshim_opt_x", None),
        ("other", None),
        ("dshim_opt_100", None),
    ],
)
def test_key_answer(key: str, answer: str | None) -> None:
    assert p.key_answer(key) == answer


def test_map_event_kinds() -> None:
    decoded = p.decode_body(
        frame(body("event", event={"eventtype": "enter_chat"}), p.EVENT_CALLBACK)
    )
    assert isinstance(decoded, tuple)
    ev = p.map_event(*decoded)
    assert isinstance(ev, p.ChatEvent)
    assert (ev.kind, ev.req_id, ev.conversation_id) == ("enter_chat", "rq-1", "zhangsan")


@pytest.mark.parametrize(
    ("value", "seconds"),
    [(None, 0.0), (0, 0.0), (1700000000, 1700000000.0), (1700000000123, 1700000000.123)],
)
def test_epoch_seconds(value: float | None, seconds: float) -> None:
    assert p.epoch_seconds(value) == pytest.approx(seconds)


# --- frames ----------------------------------------------------------------------------------


def test_frames_follow_the_sdk_shapes() -> None:
    assert json.loads(p.frame(p.PING, "ping_1_abcd")) == {
        "cmd": "ping",
        "headers": {"req_id": "ping_1_abcd"},
    }
    sub = json.loads(p.frame(p.SUBSCRIBE, "r", p.subscribe_body("b", "s")))
    assert sub == {
        "cmd": "aibot_subscribe",
        "headers": {"req_id": "r"},
        "body": {"bot_id": "b", "secret": "s"},
    }
    st = json.loads(p.frame(p.RESPOND, "r", p.stream_body("s1", "中文", finish=True)))
    assert st["body"] == {
        "msgtype": "stream",
        "stream": {"id": "s1", "finish": True, "content": "中文"},
    }
    push = p.push_markdown_body("zhangsan", "x")
    assert push == {"chatid": "zhangsan", "msgtype": "markdown", "markdown": {"content": "x"}}
    assert (
        p.new_req_id("aibot_send_msg", 1700000000000, "0a1b2c3d")
        == "aibot_send_msg_1700000000000_0a1b2c3d"
    )


def test_interaction_card_has_a_button_per_option() -> None:
    opts = [Option(id=f"o{i}", label=f"Option {i}") for i in range(8)]
    card = p.interaction_card("t", "Question", "pick one", opts)
    assert card["card_type"] == "button_interaction" and card["task_id"] == "t"
    assert [b["key"] for b in card["button_list"]] == [p.option_key(i) for i in range(6)]


def test_classify() -> None:
    ack = p.classify('{"headers":{"req_id":"r"},"errcode":846605,"errmsg":"invalid req_id"}')
    assert isinstance(ack, p.Ack) and (ack.req_id, ack.errcode) == ("r", 846605)
    cb = p.classify(frame(body(text={"content": "x"})))
    assert isinstance(cb, p.Callback) and cb.req_id == "rq-1"
    assert isinstance(p.classify(b"\xff\xfe"), p.Unusable)
    assert isinstance(p.classify('{"cmd":"nope","headers":{"req_id":"r"}}'), p.Unusable)


@pytest.mark.parametrize(
    "ev_body",
    [
        # As the server sends it, and the shapes it may also take: only the type counts.
        body("event", msgid="ev-9", event={"eventtype": "disconnected_event"}),
        {"event": {"eventtype": "disconnected_event"}},
        {"msgid": "", "msgtype": "event", "event": {"eventtype": "disconnected_event"}},
        {"aibotid": BOT, "create_time": 1700000000, "event": {"eventtype": "disconnected_event"}},
    ],
)
def test_a_disconnected_event_is_a_takeover_with_or_without_msgid(ev_body: dict[str, Any]) -> None:
    got = p.classify(frame(ev_body, p.EVENT_CALLBACK))
    assert isinstance(got, p.Takeover)
    # Decoded again (replay, the inbox) it is an event, not a malformed message.
    out = p.Mapper(BOT).decode_frame(frame(ev_body, p.EVENT_CALLBACK))
    assert isinstance(out, Skip) and out.reason == "ignored"


def test_other_events_and_texts_naming_the_event_are_no_takeover() -> None:
    enter = frame(body("event", event={"eventtype": "enter_chat"}), p.EVENT_CALLBACK)
    assert isinstance(p.classify(enter), p.Callback)
    said = frame(body(text={"content": "what is a disconnected_event?"}))
    assert isinstance(p.classify(said), p.Callback)
    odd = frame({"event": {"eventtype": 5}}, p.EVENT_CALLBACK)
    assert isinstance(p.classify(odd), p.Callback)


@pytest.mark.parametrize(
    ("code", "kind"),
    [(846605, p.ReplyExpired), (846608, p.StreamExpired), (45009, RateLimited)],
)
def test_ack_errors(code: int, kind: type[Exception]) -> None:
    assert isinstance(p.ack_error("x", code, "m"), kind)


# --- heartbeat, budget, windows -----------------------------------------------------------------


def test_heartbeat_two_unacked_pings_mean_dead() -> None:
    hb = p.Heartbeat(30.0)
    hb.start(0.0)
    assert not hb.due(29.9) and hb.due(30.0)
    hb.sent("ping_a", 30.0)
    assert not hb.dead()
    assert hb.acked("ping_a") and hb.unacked == 0
    assert not hb.acked("other")
    hb.sent("ping_b", 60.0)
    hb.sent("ping_c", 90.0)
    assert hb.dead()


def session() -> p.WecomSession:
    counter = iter(range(1000))
    return p.WecomSession(BOT, "s3cret", lambda cmd: f"{cmd}_{next(counter)}", ping_interval_s=30)


def ack(req_id: str, errcode: int = 0) -> str:
    return json.dumps({"headers": {"req_id": req_id}, "errcode": errcode, "errmsg": "x"})


def sent(actions: Any) -> list[dict[str, Any]]:
    return [json.loads(a.data) for a in actions if isinstance(a, Send)]


def test_session_subscribes_then_pings_and_hands_over_callbacks_and_acks() -> None:
    s = session()
    [sub] = sent(s.connection_opened(0.0))
    assert sub["cmd"] == p.SUBSCRIBE and sub["body"] == {"bot_id": BOT, "secret": "s3cret"}
    assert s.next_timer() == 10.0  # the subscribe's ack timeout
    early = frame(body())
    assert [type(a) for a in s.receive(early, 1.0)] == [Ignored]  # nothing before the ack
    assert [type(a) for a in s.receive(ack(sub["headers"]["req_id"]), 1.0)] == [Connected]
    assert s.next_timer() == 31.0
    [cb] = s.receive(early, 2.0)
    assert isinstance(cb, Deliver) and isinstance(cb.event, p.Callback)
    [mine] = s.receive(ack("aibot_send_msg_9"), 2.0)
    assert isinstance(mine, Deliver) and isinstance(mine.event, p.Ack)
    [ping] = sent(s.tick(31.0, reading=True))
    assert ping["cmd"] == p.PING
    assert s.receive(ack(ping["headers"]["req_id"]), 31.5) == ()  # the ping's ack: kept here


def test_session_closes_after_two_unacked_pings_only_while_reading() -> None:
    s = session()
    [sub] = sent(s.connection_opened(0.0))
    s.receive(ack(sub["headers"]["req_id"]), 0.0)
    assert len(sent(s.tick(30.0, reading=True))) == 1
    assert len(sent(s.tick(60.0, reading=True))) == 1
    # The channel holds a callback: the acks may be waiting unread.
    assert len(sent(s.tick(90.0, reading=False))) == 1
    [close] = s.tick(120.0, reading=True)
    assert isinstance(close, Close) and close.reason == "no ping ack"
    assert s.next_timer() is None
    s.connection_lost(WsEnded(1000, by_us=True), 120.0)  # not fatal: reconnect


def test_session_closes_without_a_subscribe_ack() -> None:
    s = session()
    s.connection_opened(0.0)
    assert s.tick(9.0, reading=True) == ()
    [close] = s.tick(10.0, reading=True)
    assert isinstance(close, Close)
    s.connection_lost(WsEnded(1000, by_us=True), 10.0)


def test_session_rejected_subscribe_and_takeover_are_fatal() -> None:
    s = session()
    [sub] = sent(s.connection_opened(0.0))
    [close] = s.receive(ack(sub["headers"]["req_id"], errcode=40058), 0.5)
    assert isinstance(close, Close)
    with pytest.raises(AuthError) as info:
        s.connection_lost(WsEnded(1000, by_us=True), 1.0)
    assert "s3cret" not in str(info.value)
    s = session()
    [sub] = sent(s.connection_opened(0.0))
    s.receive(ack(sub["headers"]["req_id"]), 0.5)
    ev = body("event", event={"eventtype": p.TAKEOVER_EVENT})
    [close] = s.receive(frame(ev, cmd=p.EVENT_CALLBACK), 1.0)
    assert isinstance(close, Close) and close.reason == "taken over"
    with pytest.raises(FatalChannelError):
        s.connection_lost(WsEnded(1000, by_us=True), 1.0)


def test_budget_30_a_minute_and_1000_an_hour() -> None:
    b = p.Budget()
    for i in range(30):
        assert b.wait_time("c", float(i)) == 0.0
        b.take("c", float(i))
    assert b.wait_time("c", 30.0) == pytest.approx(30.0)  # the first leaves the window at 60
    assert b.wait_time("other", 30.0) == 0.0
    t = 60.0
    for _ in range(970):
        t += b.wait_time("c", t)
        b.take("c", t)
    assert b.wait_time("c", t) > 60.0  # the hour's 1,000 are used


def test_reply_window() -> None:
    assert p.reply_window_open(0.0, 1e9)
    assert p.reply_window_open(1000.0, 1000.0 + 24 * 3600 - 1)
    assert not p.reply_window_open(1000.0, 1000.0 + 24 * 3600)


def test_split_keeps_streams_under_18000_bytes() -> None:
    text = "\n\n".join("字" * 4000 for _ in range(10))  # 120,000 bytes
    chunks = split(text)
    assert all(p.utf8_len(c) <= p.STREAM_MAX_BYTES for c in chunks)
    assert "\n\n".join(chunks) == text  # cut at the paragraph breaks


def test_clip_bytes_on_code_points() -> None:
    assert p.clip_bytes("字字", 4) == "字"


# --- media ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [0, 1, 15, 16, 31, 32, 33, 64, 1000])
def test_media_round_trip_with_32_byte_padding(size: int) -> None:
    key = bytes(range(32))
    plain = bytes((i * 7) % 256 for i in range(size))
    enc = media.encrypt(plain, key)
    assert len(enc) % 32 == 0 and len(enc) > size  # padding to 32, always at least 1 byte
    assert media.decrypt(enc, media.media_key(KEY)) == plain


def test_media_bad_key_or_padding() -> None:
    key = bytes(range(32))
    enc = media.encrypt(b"hello", key)
    with pytest.raises(media.MediaError):
        media.decrypt(enc, bytes(32))
    with pytest.raises(media.MediaError):
        media.decrypt(enc[:-1], key)
    with pytest.raises(media.MediaError):
        media.media_key("not base64!!")
    with pytest.raises(media.MediaError):
        media.media_key(base64.b64encode(b"short").decode())
    assert media.unpad(b"x" * 16 + bytes([16]) * 16) == b"x" * 16
    with pytest.raises(media.MediaError):
        media.unpad(b"x" * 31 + bytes([33]))


def test_models_name_from() -> None:
    from dshim.channels.wecom import models as m

    got = msgspec.json.decode(b'{"msgid":"1","from":{"userid":"u"}}', type=m.Body)
    assert got.sender.userid == "u"


def test_stored_frames_carry_no_signed_url_or_key() -> None:
    b = body(
        "mixed",
        mixed={"msg_item": [{"msgtype": "image", "image": {"url": URL, "aeskey": KEY}}]},
        quote={"msgtype": "file", "file": {"url": URL, "aeskey": KEY}},
    )
    raw = frame(b)
    stored = p.scrub(raw)
    assert URL.encode() not in stored and KEY.encode() not in stored
    again = p.Mapper(BOT).decode_frame(stored)
    assert isinstance(again, InboundMessage) and len(again.images) == 1
    assert again.reply_to is not None and again.reply_to.attachments != UNSET
    plain = frame(body(text={"content": "no media"}))
    assert p.scrub(plain) is plain


async def test_a_restored_attachment_says_its_link_is_gone() -> None:
    stored = p.scrub(frame(body("image", image={"url": URL, "aeskey": KEY})))
    msg = p.Mapper(BOT).decode_frame(stored)
    assert isinstance(msg, InboundMessage)
    fetch = msg.images[0].fetch
    assert fetch is not None
    with pytest.raises(ChannelError, match="link is gone"):
        await fetch(1000)
