"""Table tests of QQ's sans-IO parts: the gateway dialect, errors, budgets, the mapping."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import UNSET

from dshim.channels.kit.gateway import ConnState, Mode, gateway_bot_decoder
from dshim.channels.qq import models as m
from dshim.channels.qq.protocol import (
    DEFAULT_INTENTS,
    AlreadySent,
    ContentRejected,
    IpNotAllowed,
    MarkdownRejected,
    PassiveBudget,
    PendingAudit,
    QQMapper,
    ReplyWindowClosed,
    Route,
    StreamPrefixRejected,
    budget_for,
    classify_error,
    fetched_message,
    fetched_reference,
    gateway_session,
    intents,
    parse_ext,
    parse_timestamp,
    scrub_frame,
)
from dshim.channels.qq.render import cut_point, fit_chunks, message_body
from dshim.errors import (
    AuthError,
    ChannelError,
    FatalChannelError,
    NotFound,
    PermissionDenied,
    RateLimited,
    TransportError,
)
from dshim.model import InboundMessage, ReplyReference, Skip
from dshim.net.ws_session import Close, Connected, Deliver, Send, WsEnded

BOT = "11223344"
USER = "E4F3C2B1A0998877665544332211AABB"
GROUP = "C0FFEE00112233445566778899AABBCC"
MEMBER = "0A1B2C3D4E5F60718293A4B5C6D7E8F9"
IDX = "REFIDX_CJ8BEI2Y3KcGGJj2wI4G=="
REF = "REFIDX_COgBEJqHnqcGGLbb7tMD=="
TOKEN = "QQBot tok-123"


def frame(t: str, d: dict[str, Any], s: int = 3) -> bytes:
    return json.dumps({"op": 0, "s": s, "t": t, "id": f"{t}:x1", "d": d}).encode()


def c2c(content: str = "hello", **extra: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": "ROBOT1.0_a1",
        "author": {"id": USER, "user_openid": USER},
        "content": content,
        "timestamp": "2026-11-02T10:00:00+08:00",
        "message_scene": {"source": "default", "ext": [f"msg_idx={IDX}", "auth_token=SECRET1"]},
    }
    d.update(extra)
    return d


def group(content: str = " hi ", **extra: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": "ROBOT1.0_g1",
        "author": {"id": MEMBER, "member_openid": MEMBER},
        "content": content,
        "group_openid": GROUP,
        "timestamp": "2026-11-02T10:00:00+08:00",
        "message_scene": {"ext": [f"msg_idx={IDX}"]},
    }
    d.update(extra)
    return d


def mapped(t: str, d: dict[str, Any]) -> InboundMessage:
    item = QQMapper(BOT).decode_frame(frame(t, d))
    assert isinstance(item, InboundMessage), item
    return item


# --- mapping -------------------------------------------------------------------------------


def test_c2c_is_direct_keyed_by_user_openid_with_the_dedup_key_of_id_and_msg_idx() -> None:
    item = mapped("C2C_MESSAGE_CREATE", c2c("  hello  "))
    assert (item.conversation_type, item.conversation_id, item.sender_id) == (
        "direct",
        f"c2c:{USER}",
        USER,
    )
    assert item.addressed and item.content == "hello"
    assert item.message_id == f"ROBOT1.0_a1|{IDX}"
    assert item.route == Route("c2c", USER, "ROBOT1.0_a1", IDX, item.received_at)
    assert item.received_at == parse_timestamp("2026-11-02T02:00:00Z")
    assert "SECRET1" not in repr(item) and "SECRET1" not in msgspec.json.encode(item).decode()


def test_without_msg_idx_the_dedup_key_is_the_id() -> None:
    assert mapped("C2C_MESSAGE_CREATE", c2c(message_scene=None)).message_id == "ROBOT1.0_a1"


@pytest.mark.parametrize(
    ("content", "expected"),
    [(" /today ", "/today"), ("<@!11223344> hi", "hi"), ("<@abc> hi there", "hi there"), (" ", "")],
)
def test_group_at_is_addressed_and_the_mention_is_removed(content: str, expected: str) -> None:
    item = QQMapper(BOT).decode_frame(frame("GROUP_AT_MESSAGE_CREATE", group(content)))
    if not expected:
        assert isinstance(item, Skip) and item.reason == "ignored"
        return
    assert isinstance(item, InboundMessage)
    assert (item.conversation_type, item.conversation_id, item.sender_id) == (
        "group",
        f"group:{GROUP}",
        MEMBER,
    )
    assert item.addressed and item.content == expected


def test_a_leading_mention_of_another_member_is_kept() -> None:
    d = group("<@M2> please review", mentions=[{"member_openid": "M2", "id": "M2"}])
    assert mapped("GROUP_AT_MESSAGE_CREATE", d).content == "<@M2> please review"


def test_a_full_group_message_addresses_the_bot_only_when_it_mentions_it() -> None:
    plain = mapped("GROUP_MESSAGE_CREATE", group("just chatting"))
    assert not plain.addressed
    tagged = mapped("GROUP_MESSAGE_CREATE", group(f"<@{BOT}> for you"))
    assert tagged.addressed and tagged.content == "for you"
    listed = mapped("GROUP_MESSAGE_CREATE", group("hey", mentions=[{"id": BOT, "is_you": True}]))
    assert listed.addressed


def test_guild_channel_and_guild_dm() -> None:
    at = mapped(
        "AT_MESSAGE_CREATE",
        {
            "id": "g1",
            "channel_id": "555",
            "guild_id": "777",
            "author": {"id": "42", "username": "ada", "bot": False},
            "member": {"nick": "Ada L"},
            "content": f"<@!{BOT}> status?",
        },
    )
    assert (at.conversation_id, at.conversation_type, at.addressed) == (
        "channel:555",
        "group",
        True,
    )
    assert (at.content, at.sender_name) == ("status?", "Ada L")
    dm = mapped(
        "DIRECT_MESSAGE_CREATE",
        {"id": "d1", "guild_id": "888", "channel_id": "9", "author": {"id": "42"}, "content": "x"},
    )
    assert (dm.conversation_id, dm.conversation_type) == ("dms:888", "direct")


def guild(content: str, **extra: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": "08g2",
        "channel_id": "555",
        "guild_id": "777",
        "author": {"id": "42", "username": "ada", "bot": False},
        "member": {"nick": "Ada L"},
        "content": content,
        "timestamp": "2026-11-02T10:00:00+08:00",
    }
    d.update(extra)
    return d


def test_message_create_is_a_guild_channel_message_addressed_only_by_a_mention() -> None:
    tagged = mapped("MESSAGE_CREATE", guild(f"<@!{BOT}> status?"))
    assert (tagged.conversation_id, tagged.conversation_type, tagged.sender_id) == (
        "channel:555",
        "group",
        "42",
    )
    assert tagged.addressed and tagged.content == "status?" and tagged.sender_name == "Ada L"
    assert tagged.route == Route("channel", "555", "08g2", None, tagged.received_at)
    listed = mapped("MESSAGE_CREATE", guild("hey", mentions=[{"id": BOT, "bot": True}]))
    assert listed.addressed
    plain = mapped("MESSAGE_CREATE", guild("just chatting", mentions=[{"id": "43"}]))
    assert not plain.addressed and plain.content == "just chatting"
    other = mapped("MESSAGE_CREATE", guild("<@!43> look", mentions=[{"id": "43"}]))
    assert not other.addressed and other.content == "<@!43> look"
    own = mapped("MESSAGE_CREATE", guild("an answer", author={"id": BOT, "bot": True}))
    assert own.sender_id == BOT and own.sender_is_bot
    # the same message as AT_MESSAGE_CREATE has the same dedup key: answered once
    assert mapped("AT_MESSAGE_CREATE", guild(f"<@!{BOT}> status?")).message_id == "08g2"
    assert tagged.message_id == "08g2"


def test_a_message_create_without_a_channel_is_malformed() -> None:
    item = QQMapper(BOT).decode_frame(frame("MESSAGE_CREATE", guild("x", channel_id=None)))
    assert isinstance(item, Skip) and item.reason == "malformed"


def test_a_guild_quote_without_lookup_says_why_it_is_not_there() -> None:
    reference = {"message_reference": {"message_id": "08quoted"}}
    at = mapped("AT_MESSAGE_CREATE", guild(f"<@!{BOT}> and this?", **reference)).reply_to
    assert at is not None and at.loader is None
    assert (at.message_id, at.unavailable_reason) == ("08quoted", "not-delivered")
    dm = mapped("DIRECT_MESSAGE_CREATE", guild("and this?", **reference)).reply_to
    assert dm is not None and (dm.message_id, dm.unavailable_reason) == ("08quoted", "unsupported")
    none = mapped("AT_MESSAGE_CREATE", guild("no quote", message_reference={})).reply_to
    assert none is not None and none.unavailable_reason == "not-found"


@pytest.mark.parametrize("bad", ["", "x" * 257, "a b", "08\u0000x", "引用"])
def test_a_guild_quote_with_a_bad_id_is_not_found_and_never_looked_up(bad: str) -> None:
    asked: list[object] = []

    def lookup(*args: Any, **kw: Any) -> Any:
        asked.append(args)
        raise AssertionError("no lookup for a bad id")

    raw = frame("AT_MESSAGE_CREATE", guild("q", message_reference={"message_id": "X"}))
    raw = raw.replace(b'"message_id": "X"', json.dumps({"message_id": bad})[1:-1].encode())
    item = QQMapper(BOT, lookup=lookup).decode_frame(raw)
    assert isinstance(item, InboundMessage) and item.reply_to is not None
    assert item.reply_to.unavailable_reason == "not-found"
    assert item.reply_to.message_id is UNSET and not asked


def test_a_guild_quote_defers_to_the_lookup_fetching_only_in_a_channel() -> None:
    asked: list[tuple[str, str | None, ReplyReference | None, str | None]] = []

    def lookup(
        conv: str, ref: str | None, snap: ReplyReference | None, /, *, fetch_in: str | None = None
    ) -> Any:
        asked.append((conv, ref, snap, fetch_in))

        async def load() -> None:
            return None

        return load

    mapper = QQMapper(BOT, lookup=lookup)
    reference = {"message_reference": {"message_id": "08quoted"}}
    for t in ("AT_MESSAGE_CREATE", "MESSAGE_CREATE", "DIRECT_MESSAGE_CREATE"):
        item = mapper.decode_frame(frame(t, guild(f"<@!{BOT}> q", **reference)))
        assert isinstance(item, InboundMessage) and item.reply_to is not None
        assert item.reply_to.loader is not None and item.reply_to.message_id == "08quoted"
    (c1, r1, s1, f1), (c2, _, s2, f2), (c3, r3, s3, f3) = asked
    assert (c1, r1, s1, f1) == ("channel:555", "08quoted", None, "555")
    assert (c2, s2, f2) == ("channel:555", None, "555")
    assert (c3, r3, f3) == ("dms:777", "08quoted", None)
    assert s3 is not None and s3.unavailable_reason == "unsupported"


def fetched(**extra: Any) -> dict[str, Any]:
    d = guild(
        f"<@!{BOT}> meeting moved to Friday",
        id="08quoted",
        attachments=[{"content_type": "image/png", "filename": "plan.png", "url": "a/b.png"}],
    )
    d.update(extra)
    return d


@pytest.mark.parametrize("wrapped", [True, False])
def test_a_fetched_guild_message_becomes_the_quote(wrapped: bool) -> None:
    body = json.dumps({"message": fetched()} if wrapped else fetched()).encode()
    ref = fetched_reference(
        fetched_message(body), message_id="08quoted", channel_id="555", bot_id=BOT
    )
    assert ref is not None
    assert (ref.message_id, ref.author_id, ref.author_name, ref.content) == (
        "08quoted",
        "42",
        "Ada L",
        "meeting moved to Friday",
    )
    assert [(a.kind, a.name) for a in ref.attachments or []] == [("image", "plan.png")]
    no_nick = fetched_message(json.dumps(fetched(member=None)).encode())
    named = fetched_reference(no_nick, message_id="08quoted", channel_id="555", bot_id=BOT)
    assert named is not None and named.author_name == "ada"


def test_a_fetched_message_of_another_id_or_channel_is_not_the_quote() -> None:
    other = fetched_message(json.dumps(fetched(id="08other")).encode())
    assert fetched_reference(other, message_id="08quoted", channel_id="555", bot_id=BOT) is None
    elsewhere = fetched_message(json.dumps(fetched(channel_id="556")).encode())
    assert fetched_reference(elsewhere, message_id="08quoted", channel_id="555", bot_id=BOT) is None


@pytest.mark.parametrize(
    "body",
    [b"", b"[]", b'{"message": {"content": "no id"}}', b'{"message": 5}', b'{"code": 0}'],
)
def test_a_fetched_answer_that_is_no_message_raises_a_decode_error(body: bytes) -> None:
    with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
        fetched_message(body)


def test_voice_uses_asr_text_plus_the_audio_and_attachments_are_lazy() -> None:
    d = c2c(
        "",
        attachments=[
            {
                "content_type": "voice",
                "url": "https://multimedia.nt.qq.com.cn/v.silk",
                "voice_wav_url": "https://multimedia.nt.qq.com.cn/v.wav",
                "asr_refer_text": "what time is it",
                "filename": "v.silk",
            },
            {"content_type": "image/png", "url": "gchat.qpic.cn/a.png", "filename": "a.png"},
            {"content_type": "file", "url": "https://x.qq.com/f", "filename": "r.pdf", "size": 9},
        ],
    )
    seen: list[str] = []

    def media(a: m.Attachment) -> Any:
        seen.append(a.url)
        return None

    item = QQMapper(BOT, media=media).decode_frame(frame("C2C_MESSAGE_CREATE", d))
    assert isinstance(item, InboundMessage)
    assert item.content == "what time is it"
    assert [(i.kind, i.name) for i in item.images] == [("image", "a.png")]
    assert [(f.kind, f.name, f.mime) for f in item.files] == [
        ("audio", "v.silk", "audio/wav"),
        ("file", "r.pdf", None),
    ]
    assert len(seen) == 3  # handles only: nothing is downloaded here


def test_ark_card_and_chat_record_become_placeholders_and_a_record_is_forwarded() -> None:
    card = mapped(
        "C2C_MESSAGE_CREATE",
        c2c("[卡片消息]", message_type=3, ark_data={"ark_type": "tuwen", "prompt": "A news item"}),
    )
    assert card.content == "[card: A news item]" and not card.forwarded
    record = mapped("C2C_MESSAGE_CREATE", c2c("=== 消息 1 === /new", message_type=102))
    assert record.content == "[chat record: === 消息 1 === /new]" and record.forwarded


def test_the_bots_own_message_is_an_echo_and_other_bots_are_bots() -> None:
    own = mapped(
        "AT_MESSAGE_CREATE",
        {"id": "1", "channel_id": "5", "author": {"id": BOT, "bot": True}, "content": "x"},
    )
    assert own.sender_id == BOT and own.sender_is_bot


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b'{"op": 0, "t": "C2C_MESSAGE_CREATE", "d": {"id": 5}}',
        b'{"op": 0, "t": "C2C_MESSAGE_CREATE", "d": {"id": "x", "author": {}}}',
        b'{"op": 0, "t": "GROUP_AT_MESSAGE_CREATE", "d": {"id": "x", "author": {"member_openid": "m"}}}',
        b'{"op": 0, "t": "C2C_MESSAGE_CREATE", "d": ' + b"[" * 5000 + b"]" * 5000 + b"}",
        b'{"op": 0, "t": "C2C_MESSAGE_CREATE", "d": {"id": "\\ud800", "content": "\\udc00"}}',
    ],
)
def test_malformed_events_are_dropped_never_raised(raw: bytes) -> None:
    item = QQMapper(BOT).decode_frame(raw)
    assert isinstance(item, (Skip, InboundMessage))
    if isinstance(item, Skip):
        assert item.reason == "malformed"


def test_events_that_are_not_messages_are_ignored() -> None:
    for t in ("FRIEND_ADD", "GROUP_ADD_ROBOT", "READY", "C2C_MSG_REJECT"):
        item = QQMapper(BOT).decode_frame(frame(t, {"openid": USER}))
        assert isinstance(item, Skip) and item.reason == "ignored"


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=30,
    )
)
def test_any_json_payload_maps_or_drops(d: Any) -> None:
    raw = json.dumps({"op": 0, "t": "C2C_MESSAGE_CREATE", "s": 1, "d": d}).encode()
    assert isinstance(QQMapper(BOT).decode_frame(raw), (Skip, InboundMessage))


# --- quotes ---------------------------------------------------------------------------------


def quote(**extra: Any) -> dict[str, Any]:
    return c2c(
        "and this?",
        message_type=103,
        message_scene={"ext": [f"msg_idx={IDX}", f"ref_msg_idx={REF}", "auth_token=S"]},
        **extra,
    )


def test_a_quote_without_lookup_is_its_msg_elements_snapshot_one_level_deep() -> None:
    item = mapped(
        "C2C_MESSAGE_CREATE",
        quote(
            msg_elements=[
                {
                    "msg_idx": REF,
                    "message_type": 0,
                    "content": "the quoted text",
                    "author": {"member_openid": "M2", "username": "Bo"},
                    "attachments": [
                        {"content_type": "voice", "filename": "a.silk", "asr_refer_text": "hi"}
                    ],
                    "msg_elements": [{"content": "a quote of a quote"}],
                }
            ]
        ),
    )
    ref = item.reply_to
    assert isinstance(ref, ReplyReference)
    assert (ref.message_id, ref.author_id, ref.author_name, ref.content) == (
        REF,
        "M2",
        "Bo",
        "the quoted text",
    )
    assert [(a.kind, a.name) for a in ref.attachments or []] == [("audio", "a.silk")]
    assert ref.loader is None and "quote of a quote" not in repr(msgspec.json.encode(item))


def test_a_quote_with_neither_index_nor_snapshot_is_not_found() -> None:
    ref = mapped("C2C_MESSAGE_CREATE", quote()).reply_to
    assert ref is not None
    assert (ref.message_id, ref.unavailable_reason, ref.author_id) == (REF, "not-found", UNSET)


def test_a_quote_with_a_lookup_defers_to_the_loader_with_the_snapshot() -> None:
    asked: list[tuple[str, str | None, ReplyReference | None]] = []

    def lookup(conv: str, ref_idx: str | None, snap: ReplyReference | None) -> Any:
        asked.append((conv, ref_idx, snap))

        async def load() -> None:
            return None

        return load

    d = quote(msg_elements=[{"content": "snap"}])
    item = QQMapper(BOT, lookup=lookup).decode_frame(frame("C2C_MESSAGE_CREATE", d))
    assert isinstance(item, InboundMessage) and item.reply_to is not None
    assert item.reply_to.loader is not None and item.reply_to.message_id == REF
    [(conv, ref_idx, snap)] = asked
    assert (conv, ref_idx) == (f"c2c:{USER}", REF) and snap is not None and snap.content == "snap"


def test_a_quoted_card_is_a_placeholder() -> None:
    d = quote(msg_elements=[{"message_type": 3, "ark_data": {"fields": {"title": "Weather"}}}])
    ref = mapped("C2C_MESSAGE_CREATE", d).reply_to
    assert ref is not None and ref.content == "[card: Weather]"


@pytest.mark.parametrize(
    ("ext", "expected"),
    [
        (["msg_idx=REFIDX_a=="], {"msg_idx": "REFIDX_a=="}),
        (["ref_msg_idx=TMP_1", "x", "=y", "k=v=w"], {"ref_msg_idx": "TMP_1", "k": "v=w"}),
    ],
)
def test_parse_ext_splits_on_the_first_equals_sign(
    ext: list[str], expected: dict[str, str]
) -> None:
    assert parse_ext(ext) == expected


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "message", "kind"),
    [
        (401, 11244, "token not exist", AuthError),
        (200, 11241, "", AuthError),
        (400, 40054005, "dedup", AlreadySent),
        (200, 304023, "audit", PendingAudit),
        (400, 304027, "expired", ReplyWindowClosed),
        (400, 40034128, "passive time", ReplyWindowClosed),
        (429, 22009, "msg limit exceed", RateLimited),
        (400, 304045, "", RateLimited),
        (400, 50056, "markdown", MarkdownRejected),
        (400, 40007, "prefix", StreamPrefixRejected),
        (400, 304003, "url", ContentRejected),
        (400, 304026, "msg_id", NotFound),
        (400, 50039, "获取消息失败", NotFound),
        (403, 40054013, "refuses", PermissionDenied),
        (400, 11261, "appid", FatalChannelError),
        (500, 0, "", TransportError),
        (401, 40023002, "接口访问源IP不在白名单", IpNotAllowed),
        (400, 12345, "what", ChannelError),
    ],
)
def test_classify_error(status: int, code: int, message: str, kind: type[Exception]) -> None:
    err = classify_error(status, m.ErrorBody(code=code, message=message), "POST /x")
    assert type(err) is kind
    if isinstance(err, RateLimited):
        assert err.retry_after == 2.0
    if isinstance(err, TransportError):
        assert err.request_sent


def test_an_ip_rejection_names_the_allowlist() -> None:
    err = classify_error(401, m.ErrorBody(code=11298, message="ip not in whitelist"), "GET /u")
    assert isinstance(err, IpNotAllowed) and "allowlist" in str(err)


# --- budgets and splitting --------------------------------------------------------------------


def test_the_passive_budget_counts_msg_seq_within_the_cap_and_window() -> None:
    b = PassiveBudget(cap=4, deadline=100.0)
    assert [b.take(1.0) for _ in range(5)] == [1, 2, 3, 4, None]
    assert PassiveBudget(cap=5, deadline=100.0).take(100.0) is None


def test_windows_are_60_minutes_in_c2c_and_5_in_groups() -> None:
    c = budget_for(Route("c2c", USER, "m", received=10.0), now=20.0, wall_now=0.0)
    g = budget_for(Route("group", GROUP, "m", received=10.0), now=20.0, wall_now=0.0)
    assert (c.cap, c.deadline, g.cap, g.deadline) == (4, 3610.0, 5, 310.0)
    # delivered late (a resume replay): the platform's earlier time starts the window
    replayed = Route("group", GROUP, "m", platform_ts=1000.0, received=100.0)
    assert budget_for(replayed, now=100.0, wall_now=1060.0).deadline == pytest.approx(340.0)
    skewed = Route("group", GROUP, "m", platform_ts=1000.0, received=100.0)
    assert budget_for(skewed, now=100.0, wall_now=9000.0).deadline == 400.0
    # resumed after a restart: the window started at the platform time
    late = budget_for(Route("group", GROUP, "m", platform_ts=1000.0), now=50.0, wall_now=1100.0)
    assert late.deadline == pytest.approx(250.0)


def test_fit_chunks_cuts_the_last_slot_with_the_notice() -> None:
    text = "\n\n".join(f"paragraph {i} " + "x" * 900 for i in range(6))
    chunks = fit_chunks(text, 2, "[cut]")
    assert (
        len(chunks) == 2
        and chunks[-1].endswith("\n\n[cut]")
        and all(len(c) <= 2000 for c in chunks)
    )
    assert fit_chunks("short", 1, "[cut]") == ["short"] and fit_chunks("x", 0, "n") == []


def test_cut_point_prefers_paragraphs_and_never_cuts_what_is_shown() -> None:
    text = "a" * 1500 + "\n\n" + "b" * 800
    assert cut_point(text, 2000) == 1500
    assert cut_point(text, 2000, at_least=1700) == 2000


def test_message_body_is_passive_and_quotes_by_msg_idx() -> None:
    route = Route("group", GROUP, "ROBOT1.0_g1", IDX)
    assert message_body(route, "hi", 2, markdown=False, quote=True) == {
        "msg_type": 0,
        "content": "hi",
        "msg_id": "ROBOT1.0_g1",
        "msg_seq": 2,
        "message_reference": {"message_id": IDX},
    }
    md = message_body(route, "**hi**", 1, markdown=True, quote=False)
    assert md == {
        "msg_type": 2,
        "markdown": {"content": "**hi**"},
        "msg_id": "ROBOT1.0_g1",
        "msg_seq": 1,
    }


# --- the gateway dialect ----------------------------------------------------------------------


def hello(ms: float = 45000) -> str:
    return json.dumps({"op": 10, "d": {"heartbeat_interval": ms}})


def ready_frame(s: int = 1) -> str:
    return json.dumps(
        {
            "op": 0,
            "s": s,
            "t": "READY",
            "d": {
                "version": 1,
                "session_id": "S1",
                "user": {"id": BOT, "username": "b", "bot": True},
                "shard": [0, 1],
            },
        }
    )


def session() -> Any:
    gw = gateway_session(token=TOKEN, random=lambda: 0.5, gateway_override="ws://gw/websocket")
    gw.set_gateway_info(
        gateway_bot_decoder.decode(
            b'{"url": "wss://api.sgroup.qq.com/websocket", "session_start_limit": {"remaining": 5}}'
        ),
        0.0,
    )
    return gw


def connect(gw: Any, now: float = 0.0) -> list[Any]:
    plan = gw.plan_connection(now)
    assert plan.url == "ws://gw/websocket"  # QQ's URL is used as is (no ?v=)
    gw.connection_opened(now)
    return list(gw.receive(hello(), now))


def test_identify_sends_the_qqbot_token_intents_and_shard() -> None:
    gw = session()
    [send] = connect(gw)
    assert isinstance(send, Send) and send.kind == "identify"
    d = json.loads(send.data)["d"]
    assert d["token"] == TOKEN and d["intents"] == DEFAULT_INTENTS and d["shard"] == [0, 1]
    assert DEFAULT_INTENTS == (1 << 25) | (1 << 30) | (1 << 12)
    out = gw.receive(ready_frame(), 1.0)
    assert isinstance(out[0], Connected) and gw.state is ConnState.CONNECTED and gw.seq == 1
    msg = gw.receive(frame("C2C_MESSAGE_CREATE", c2c(), s=2).decode(), 2.0)
    assert isinstance(msg[0], Deliver) and msg[0].event.t == "C2C_MESSAGE_CREATE" and gw.seq == 2


def test_heartbeats_carry_the_last_seq_and_a_missing_ack_resumes() -> None:
    gw = session()
    connect(gw)
    gw.receive(ready_frame(7), 0.0)
    [beat] = gw.tick(22.5)
    assert json.loads(beat.data) == {"op": 1, "d": 7}
    [close] = gw.tick(22.5 + 45.0)
    assert isinstance(close, Close) and close.code == 4000
    gw.connection_lost(WsEnded(4000, by_us=True, connected_for=60.0), 70.0)
    assert gw.plan_connection(70.0).mode is Mode.RESUME


def test_a_forced_close_4009_resumes_with_session_and_seq() -> None:
    gw = session()
    connect(gw)
    gw.receive(ready_frame(3), 0.0)
    gw.connection_lost(WsEnded(4009, connected_for=100.0), 100.0)
    [resume] = connect(gw, 100.0)
    assert resume.kind == "resume"
    assert json.loads(resume.data)["d"] == {"token": TOKEN, "session_id": "S1", "seq": 3}


def test_4004_asks_for_a_new_token_once_and_then_is_fatal() -> None:
    gw = session()
    connect(gw)
    gw.connection_lost(WsEnded(4004), 1.0)
    assert gw.token_rejected and gw.plan_connection(1.0).mode is Mode.IDENTIFY
    gw.token_rejected = False
    gw.connection_opened(10.0)
    with pytest.raises(AuthError):
        gw.connection_lost(WsEnded(4004), 11.0)


@pytest.mark.parametrize("code", [4010, 4011, 4012, 4013, 4014, 4914, 4915])
def test_fatal_close_codes_stop(code: int) -> None:
    gw = session()
    connect(gw)
    with pytest.raises(FatalChannelError) as info:
        gw.connection_lost(WsEnded(code), 1.0)
    if code in (4013, 4014):
        assert "q.qq.com" in str(info.value) and "intents" in str(info.value)


@pytest.mark.parametrize(
    ("code", "mode"),
    [
        (4006, Mode.IDENTIFY),
        (4007, Mode.IDENTIFY),
        (4900, Mode.IDENTIFY),
        (4913, Mode.IDENTIFY),
        (4009, Mode.RESUME),
        (None, Mode.RESUME),
    ],
)
def test_other_close_codes_resume_or_identify(code: int | None, mode: Mode) -> None:
    gw = session()
    connect(gw)
    gw.receive(ready_frame(), 0.0)
    gw.connection_lost(WsEnded(code, connected_for=10.0), 10.0)
    assert gw.plan_connection(10.0).mode is mode


def test_4008_waits_a_minute_and_op_9_waits_3_s() -> None:
    gw = session()
    connect(gw)
    gw.receive(ready_frame(), 0.0)
    gw.connection_lost(WsEnded(4008, connected_for=10.0), 10.0)
    assert gw.plan_connection(10.0).not_before == 70.0
    gw.connection_opened(70.0)
    gw.receive(hello(), 70.0)
    [close] = gw.receive(json.dumps({"op": 9, "d": False}), 71.0)
    assert isinstance(close, Close)
    gw.connection_lost(WsEnded(1000, by_us=True), 71.0)
    plan = gw.plan_connection(71.0)
    assert plan.mode is Mode.IDENTIFY and plan.not_before >= 74.0


def test_op_7_reconnect_resumes() -> None:
    gw = session()
    connect(gw)
    gw.receive(ready_frame(), 0.0)
    [close] = gw.receive('{"op": 7}', 5.0)
    assert isinstance(close, Close) and close.code == 4000
    gw.connection_lost(WsEnded(4000, by_us=True, connected_for=5.0), 5.0)
    assert gw.plan_connection(5.0).mode is Mode.RESUME


def test_intent_names() -> None:
    assert intents(None) == DEFAULT_INTENTS
    assert intents(["group_and_c2c_event"]) == 1 << 25
    with pytest.raises(ValueError, match="unknown intent"):
        intents(["everything"])


def test_the_protocol_module_is_sans_io() -> None:
    code = (
        "import sys, dshim.channels.qq.protocol; "
        "print(sorted(m for m in ('trio', 'httpx', 'trio_websocket') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_frame_the_inbox_keeps_has_no_auth_token() -> None:
    raw = frame("C2C_MESSAGE_CREATE", c2c())
    clean = scrub_frame(raw)
    assert b"SECRET1" in raw and b"SECRET1" not in clean
    before, after = QQMapper(BOT).decode_frame(raw), QQMapper(BOT).decode_frame(clean)
    assert isinstance(after, InboundMessage) and isinstance(before, InboundMessage)
    assert (after.message_id, after.content) == (before.message_id, before.content)


def test_the_replay_adapter_learns_the_bot_from_a_ready_frame() -> None:
    import httpx

    from dshim.channels.base import ReplaySource
    from dshim.channels.qq.channel import CHANNEL

    fx = ReplaySource(bot_id=None, bot_username=None, http=httpx.AsyncClient(), api_base="x")
    adapter = CHANNEL.replay_adapter(fx)
    ready = {"version": 1, "session_id": "S", "user": {"id": BOT, "username": "b"}}
    assert isinstance(adapter.decode(frame("READY", ready, s=1)), Skip)
    assert (adapter.bot_id, adapter.bot_username) == (BOT, "b")
    own = {"id": "1", "channel_id": "5", "author": {"id": BOT, "bot": True}, "content": "x"}
    item = adapter.decode(frame("AT_MESSAGE_CREATE", own))
    assert isinstance(item, InboundMessage) and item.sender_id == item.bot_id == BOT


def test_no_identify_while_the_session_start_limit_is_used_up() -> None:
    gw = gateway_session(token=TOKEN, random=lambda: 0.5)
    info = b'{"url": "wss://gw/websocket", "session_start_limit": {"total": 1000, "remaining": 0, "reset_after": 60000, "max_concurrency": 1}}'
    gw.set_gateway_info(gateway_bot_decoder.decode(info), 10.0)
    plan = gw.plan_connection(10.0)
    assert plan.url == "" and plan.not_before == 70.0 and plan.reason == "session_start_limit"
    assert gw.plan_connection(70.0).refresh_gateway  # then ask /gateway/bot again
