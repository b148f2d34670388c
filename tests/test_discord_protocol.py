"""Table tests for the sans-IO Discord gateway state machine and the MESSAGE_CREATE mapping.

No sockets and no clock: time is an argument (``now``), randomness is a fixed function.
The issue 9 cases (hostile input, forwards, the bot's role, empty messages, the Message
Content intent) are here as mapping rules; the end-to-end tests check them on the wire.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec import UNSET

from dshim.channels.base import ReplaySource
from dshim.channels.discord import models as m
from dshim.channels.discord.channel import CHANNEL
from dshim.channels.discord.protocol import (
    INTENTS,
    ConnState,
    GatewayProtocol,
    GatewayTuning,
    MessageMapper,
    Mode,
    attachment_kind,
    gateway_url,
    intents,
    snowflake_time,
)
from dshim.errors import AuthError, FatalChannelError
from dshim.model import InboundMessage, ReplyReference, Skip
from dshim.net.ws_session import Close, Connected, Deliver, Ignored, Send, WsEnded

TOKEN = "tok.en-secret-value"
GW = "wss://gateway.discord.gg"
RESUME = "wss://gateway-us-east1-b.discord.gg"
BOT = "1504423025049600001"
CHAN = "1471808117145600003"


def info(
    remaining: int = 1000, reset_after_ms: float = 3_600_000, concurrency: int = 1
) -> m.GatewayBot:
    return m.GatewayBot(
        url=GW,
        session_start_limit=m.SessionStartLimit(
            total=1000, remaining=remaining, reset_after=reset_after_ms, max_concurrency=concurrency
        ),
    )


def frame(op: int, d: Any = None, s: int | None = None, t: str | None = None) -> str:
    return json.dumps({"op": op, "d": d, "s": s, "t": t})


def hello(ms: float = 1000) -> str:
    return frame(10, {"heartbeat_interval": ms})


def ready(session: str = "sess-1", s: int = 1) -> str:
    return frame(
        0,
        {
            "v": 10,
            "session_id": session,
            "resume_gateway_url": RESUME,
            "user": {"id": BOT, "username": "b", "bot": True},
        },
        s,
        "READY",
    )


def sent(actions: list[Any]) -> list[dict[str, Any]]:
    return [json.loads(a.data) for a in actions if isinstance(a, Send)]


def lost(gw: GatewayProtocol, code: int | None, now: float) -> None:
    gw.connection_lost(WsEnded(code), now)


def new_gw(rand: float = 0.25, **tuning: Any) -> GatewayProtocol:
    gw = GatewayProtocol(token=TOKEN, random=lambda: rand, tuning=GatewayTuning(**tuning))
    gw.set_gateway_info(info(), 0.0)
    return gw


def connect(gw: GatewayProtocol, now: float) -> Mode:
    """Plan a connection and open it, as the runner does; returns the planned mode."""
    plan = gw.plan_connection(now)
    gw.connection_opened(now)
    return plan.mode


def connected_gw(now: float = 0.0, seq: int = 1) -> GatewayProtocol:
    gw = new_gw()
    connect(gw, now)
    gw.receive(hello(), now)
    gw.receive(ready(s=seq), now)
    return gw


# -- handshake and heartbeat --------------------------------------------------------------


def test_first_connection_identifies_with_intents_after_hello() -> None:
    gw = new_gw()
    plan = gw.plan_connection(0.0)
    assert plan.mode is Mode.IDENTIFY and not plan.refresh_gateway
    assert plan.url == GW + "/?v=10&encoding=json"
    gw.connection_opened(0.0)
    out = sent(gw.receive(hello(45000), 0.0))
    assert out == [
        {
            "op": 2,
            "d": {
                "token": TOKEN,
                "intents": 37377,
                "properties": {"os": "linux", "browser": "dshim", "device": "dshim"},
            },
        }
    ]
    assert INTENTS == 1 | 512 | 4096 | 32768
    actions = gw.receive(ready("abc"), 0.1)
    assert actions == [Connected(False, "abc")]  # READY itself is not a wanted dispatch
    assert gw.session_id == "abc" and gw.resume_url == RESUME and gw.seq == 1
    assert gw.state is ConnState.CONNECTED


@pytest.mark.parametrize("rand", [0.0, 0.25, 0.999])
def test_first_heartbeat_is_jittered_then_every_interval(rand: float) -> None:
    gw = new_gw(rand)
    connect(gw, 100.0)
    gw.receive(hello(2000), 100.0)
    first = gw.next_timer()
    assert first is not None and first == pytest.approx(100.0 + 2.0 * rand)
    if rand > 0:
        assert gw.tick(first - 0.001) == []
    beat = sent(gw.tick(first))
    assert beat == [{"op": 1, "d": None}]
    gw.receive(frame(11), first + 0.05)
    assert gw.next_timer() == pytest.approx(first + 2.0)


def test_heartbeat_carries_last_non_null_sequence() -> None:
    gw = connected_gw(seq=1)
    gw.receive(frame(0, {"x": 1}, 7, "TYPING_START"), 0.1)
    gw.receive(frame(0, None, None, "X"), 0.2)  # null s does not reset it
    assert sent(gw.tick(gw.next_timer() or 0)) == [{"op": 1, "d": 7}]


def test_server_heartbeat_request_is_answered_at_once() -> None:
    gw = connected_gw(seq=4)
    assert sent(gw.receive(frame(1), 0.3)) == [{"op": 1, "d": 4}]


def test_unacknowledged_heartbeat_is_a_zombie_and_resumes() -> None:
    gw = connected_gw(seq=3)
    t1 = gw.next_timer()
    assert t1 is not None
    assert sent(gw.tick(t1)) == [{"op": 1, "d": 3}]
    # no ACK: when the next beat is due, the connection is declared dead
    actions = gw.tick(t1 + 1.0)
    assert actions == [Close(4000, "heartbeat not acknowledged")]
    lost(gw, 1000, t1 + 1.0)  # our own close: the local code does not matter
    plan = gw.plan_connection(t1 + 1.0)
    assert plan.mode is Mode.RESUME and plan.not_before <= t1 + 1.0
    assert plan.url == RESUME + "/?v=10&encoding=json"
    gw.connection_opened(t1 + 1.1)
    assert sent(gw.receive(hello(), t1 + 1.1)) == [
        {"op": 6, "d": {"token": TOKEN, "session_id": "sess-1", "seq": 3}}
    ]


def test_no_zombie_verdict_while_not_reading() -> None:
    gw = connected_gw()
    t1 = gw.next_timer() or 0.0
    gw.tick(t1)
    # the shell is blocked on backpressure: keep beating, judge later
    assert sent(gw.tick(t1 + 1.0, reading=False)) == [{"op": 1, "d": 1}]
    gw.receive(frame(11), t1 + 1.5)
    assert sent(gw.tick(t1 + 2.0)) == [{"op": 1, "d": 1}]


def test_hello_timeout_closes_and_reconnects() -> None:
    gw = new_gw(hello_timeout_s=20.0)
    connect(gw, 0.0)
    assert gw.next_timer() == 20.0
    assert gw.tick(19.9) == []
    assert isinstance(gw.tick(20.0)[0], Close)


# -- reconnect, resume, invalid session ---------------------------------------------------


def test_reconnect_opcode_closes_non_1000_and_resumes() -> None:
    gw = connected_gw(seq=9)
    [close] = gw.receive(frame(7), 1.0)
    assert isinstance(close, Close) and close.code not in (1000, 1001)
    lost(gw, close.code, 1.0)
    plan = gw.plan_connection(1.0)
    assert (plan.mode, plan.not_before) == (Mode.RESUME, 1.0)


def test_invalid_session_resumable_resumes() -> None:
    gw = connected_gw()
    [close] = gw.receive(frame(9, True), 1.0)
    assert isinstance(close, Close) and close.code == 4000
    lost(gw, None, 1.0)
    assert gw.plan_connection(1.0).mode is Mode.RESUME


@pytest.mark.parametrize("rand", [0.0, 1.0])
def test_invalid_session_not_resumable_waits_1_to_5_s_and_identifies_on_gateway_url(
    rand: float,
) -> None:
    gw = connected_gw()
    gw._random = lambda: rand  # type: ignore[method-assign]
    [close] = gw.receive(frame(9, False), 10.0)
    assert isinstance(close, Close) and close.code == 1000
    lost(gw, 1000, 10.0)
    assert gw.session_id is None and gw.seq is None
    plan = gw.plan_connection(10.0)
    assert plan.mode is Mode.IDENTIFY
    assert plan.url == GW + "/?v=10&encoding=json"  # the cached Get Gateway URL, not resume
    assert plan.not_before == pytest.approx(10.0 + 1.0 + 4.0 * rand)
    assert 11.0 <= plan.not_before <= 15.0


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (4004, AuthError),
        (4010, FatalChannelError),
        (4011, FatalChannelError),
        (4012, FatalChannelError),
        (4013, FatalChannelError),
        (4014, FatalChannelError),
    ],
)
def test_fatal_close_codes_raise(code: int, error: type[Exception]) -> None:
    gw = connected_gw()
    with pytest.raises(error) as exc_info:
        lost(gw, code, 1.0)
    assert str(code) in str(exc_info.value)
    assert TOKEN not in str(exc_info.value)


def test_disallowed_intents_error_names_the_portal_switch_and_the_setting() -> None:
    gw = connected_gw()
    with pytest.raises(FatalChannelError) as exc_info:
        lost(gw, 4014, 1.0)
    text = str(exc_info.value)
    assert "Privileged Gateway Intents -> Message Content Intent" in text
    assert "message_content = false" in text


def test_without_message_content_the_intent_is_not_requested() -> None:
    gw = GatewayProtocol(token=TOKEN, random=lambda: 0.5, intents=intents(message_content=False))
    gw.set_gateway_info(info(), 0.0)
    connect(gw, 0.0)
    [identify] = sent(gw.receive(hello(), 0.0))
    assert identify["d"]["intents"] == 1 | 512 | 4096  # no 1 << 15
    assert intents() == INTENTS
    with pytest.raises(FatalChannelError) as exc_info:  # 4014 then is another intent
        lost(gw, 4014, 1.0)
    assert "message_content = false" not in str(exc_info.value)


@pytest.mark.parametrize(
    ("code", "mode"),
    [
        (None, Mode.RESUME),
        (1006, Mode.RESUME),
        (1000, Mode.RESUME),
        (1001, Mode.RESUME),
        (4000, Mode.RESUME),
        (4008, Mode.RESUME),
        (4007, Mode.IDENTIFY),
        (4009, Mode.IDENTIFY),
    ],
)
def test_other_closes_reconnect(code: int | None, mode: Mode) -> None:
    gw = connected_gw()
    lost(gw, code, 1.0)
    assert gw.plan_connection(1.0).mode is mode


def test_the_identify_url_is_read_again_after_three_failed_connections() -> None:
    gw = new_gw()
    for _ in range(3):
        assert not gw.plan_connection(0.0).refresh_gateway
        connect(gw, 0.0)
        lost(gw, None, 0.0)  # refused before hello; the runner backs off
    assert gw.plan_connection(0.0).refresh_gateway
    gw.set_gateway_info(info(), 0.0)
    connect(gw, 0.0)
    gw.receive(hello(), 0.0)
    gw.receive(ready(), 0.0)
    lost(gw, 1006, 1.0)
    assert gw.failures == 0 and gw.plan_connection(1.0).mode is Mode.RESUME


# -- identify budget ----------------------------------------------------------------------


def test_never_identifies_with_no_remaining_identifies() -> None:
    gw = GatewayProtocol(token=TOKEN, random=lambda: 0.5)
    assert gw.plan_connection(0.0).refresh_gateway  # first: ask GET /gateway/bot
    gw.set_gateway_info(info(remaining=0, reset_after_ms=60_000), 0.0)
    plan = gw.plan_connection(0.0)
    assert plan.not_before == 60.0 and plan.url == "" and plan.reason == "session_start_limit"
    later = gw.plan_connection(60.0)
    assert later.refresh_gateway  # after the reset: read the budget again
    gw.set_gateway_info(info(remaining=5), 60.0)
    assert gw.plan_connection(60.0).url.startswith(GW)


def test_identify_counts_down_and_spaces_identifies() -> None:
    gw = new_gw()
    gw.set_gateway_info(info(remaining=2), 0.0)
    connect(gw, 0.0)
    gw.receive(hello(), 0.0)
    assert gw.identify_remaining == 1 and gw.identifies == 1
    lost(gw, 4009, 1.0)  # needs a new session
    plan = gw.plan_connection(1.0)
    assert plan.mode is Mode.IDENTIFY and plan.not_before >= 5.0  # one identify per 5 s
    gw.connection_opened(plan.not_before)
    gw.receive(hello(), plan.not_before)
    assert gw.identify_remaining == 0
    lost(gw, 4009, 6.0)
    assert gw.plan_connection(6.0).url == ""  # budget exhausted: wait for the reset


def test_gateway_override_is_used_for_identify() -> None:
    gw = GatewayProtocol(token=TOKEN, random=lambda: 0.5, gateway_override="ws://127.0.0.1:9/gw")
    gw.set_gateway_info(info(), 0.0)
    assert gw.plan_connection(0.0).url == "ws://127.0.0.1:9/gw?v=10&encoding=json"


@pytest.mark.parametrize(
    ("base", "url"),
    [
        ("wss://gateway.discord.gg", "wss://gateway.discord.gg/?v=10&encoding=json"),
        ("wss://gateway.discord.gg/", "wss://gateway.discord.gg/?v=10&encoding=json"),
        ("wss://g.example/?v=9&encoding=etf&x=1", "wss://g.example/?x=1&v=10&encoding=json"),
    ],
)
def test_gateway_url(base: str, url: str) -> None:
    assert gateway_url(base) == url


def test_malformed_frames_are_ignored_without_state_change() -> None:
    gw = connected_gw(seq=2)
    for bad in ["not json", "[]", '{"op": "x"}', frame(42)]:
        actions = gw.receive(bad, 1.0)
        assert len(actions) == 1 and isinstance(actions[0], Ignored)
    assert gw.state is ConnState.CONNECTED and gw.seq == 2


def test_repr_never_shows_the_token() -> None:
    gw = connected_gw()
    assert TOKEN not in repr(gw)
    identify = gw.plan_connection(0)
    assert TOKEN not in repr(identify)
    action = Send(TOKEN, kind="identify")
    assert TOKEN not in repr(action)


# -- MESSAGE_CREATE mapping ---------------------------------------------------------------

ADA = {"id": "1431945451929600007", "username": "ada", "global_name": "Ada Lovelace"}


def message(**over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": "1576900598169600010",
        "channel_id": CHAN,
        "guild_id": "1400000000000000002",
        "author": ADA,
        "member": {"nick": None},
        "content": "hi",
        "timestamp": "2026-11-30T10:00:00.000000+00:00",
        "type": 0,
        "mentions": [],
        "attachments": [],
    }
    d.update(over)
    return d


class LoaderSpy:
    def __init__(self) -> None:
        self.made: list[tuple[str, str]] = []

    def __call__(self, channel_id: str, message_id: str) -> Any:
        self.made.append((channel_id, message_id))

        async def load() -> ReplyReference | None:
            return None

        return load


def mapped(d: dict[str, Any], lookup: Any = None) -> InboundMessage:
    item = MessageMapper(BOT, lookup=lookup).decode_message(json.dumps(d).encode())
    assert isinstance(item, InboundMessage), item
    return item


@pytest.mark.parametrize(
    ("over", "expect"),
    [
        ({"guild_id": None, "member": None}, {"conversation_type": "direct", "addressed": True}),
        ({}, {"conversation_type": "group", "addressed": False}),
        (
            {"mentions": [{"id": BOT}], "content": f"<@{BOT}> hello"},
            {"addressed": True, "content": "hello"},
        ),
        ({"content": f"<@!{BOT}>  hey  "}, {"addressed": True, "content": "hey"}),
        ({"content": f"a <@{BOT}> b <@{BOT}>"}, {"addressed": True, "content": "a  b"}),
        ({"content": "<@999> not us", "mentions": [{"id": "999"}]}, {"addressed": False}),
        ({"content": "<@&123> role ping", "mention_roles": ["123"]}, {"addressed": False}),
        ({"member": {"nick": "Countess"}}, {"sender_name": "Countess"}),
        ({"author": {"id": "5", "username": "bob"}}, {"sender_name": "bob"}),
        (
            {"author": {"id": "5", "username": "bob", "global_name": "Bob B"}},
            {"sender_name": "Bob B"},
        ),
        ({"author": dict(ADA, bot=True)}, {"sender_is_bot": True}),
        ({"webhook_id": "77"}, {"sender_is_bot": True}),
        ({"author": {"id": BOT, "username": "me", "bot": True}}, {"sender_id": BOT}),
        ({"channel_type": 11}, {"thread_id": CHAN, "conversation_id": CHAN}),
        ({"channel_type": 0}, {"thread_id": None}),
        ({"position": 4}, {"thread_id": CHAN}),
        ({"type": 19}, {"message_id": "1576900598169600010"}),
    ],
)
def test_message_mapping(over: dict[str, Any], expect: dict[str, Any]) -> None:
    d = message(**over)
    for k, v in list(over.items()):
        if v is None:
            del d[k]
    msg = mapped(d)
    for key, value in expect.items():
        assert getattr(msg, key) == value, key
    assert msg.channel == "discord" and msg.conversation_id == CHAN
    assert msg.received_at == pytest.approx(1796032800.0)


def test_every_message_of_a_thread_is_the_threads_conversation() -> None:
    """However Discord marks a thread message (``channel_type``, ``position``, or not at
    all), the messages of one thread share one conversation and thread: one lane, one
    session."""
    mapper = MessageMapper(BOT)

    def lane(**over: Any) -> tuple[str, str]:
        item = mapper.decode_message(json.dumps(message(**over)).encode())
        assert isinstance(item, InboundMessage), item
        return item.lane_key

    # a forum post: the starter message has the thread's id (and nothing else says so)
    post = "1576900598169600500"
    assert lane(id=post, channel_id=post) == (post, post)
    assert lane(id="1576900598169600501", channel_id=post, channel_type=11) == (post, post)
    assert lane(id="1576900598169600502", channel_id=post) == (post, post)  # remembered
    # a thread announced by THREAD_CREATE (or GUILD_CREATE's threads)
    thread, parent = "1576900598169600600", "1576900598169600601"
    created = {"id": thread, "type": 11, "guild_id": "1400000000000000002", "parent_id": parent}
    mapper.learn_guild_event("THREAD_CREATE", json.dumps(created).encode())
    assert lane(id="1576900598169600602", channel_id=thread) == (thread, thread)
    listed = "1576900598169600700"
    guild = {"id": "1400000000000000002", "roles": [], "threads": [dict(created, id=listed)]}
    mapper.learn_guild_event("GUILD_CREATE", json.dumps(guild).encode())
    assert lane(id="1576900598169600702", channel_id=listed) == (listed, listed)
    # a text channel stays one conversation without a thread; a DM's id is never a thread
    assert lane(id="1576900598169600800", channel_id=CHAN) == (CHAN, "")
    dm = "1576900598169600900"
    direct = mapper.decode_message(
        json.dumps({**message(id=dm, channel_id=dm), "guild_id": None}).encode()
    )
    assert isinstance(direct, InboundMessage) and direct.lane_key == (dm, "")


def test_received_at_falls_back_to_the_snowflake() -> None:
    d = message()
    del d["timestamp"]
    assert mapped(d).received_at == snowflake_time(d["id"])


@pytest.mark.parametrize("mtype", [6, 7, 18, 21, 46])
def test_system_messages_are_skipped(mtype: int) -> None:
    item = MessageMapper(BOT).decode_message(json.dumps(message(type=mtype)))
    assert isinstance(item, Skip) and item.reason == "ignored"


def test_attachments_become_images_or_files() -> None:
    msg = mapped(
        message(
            attachments=[
                {
                    "id": "1",
                    "filename": "a.png",
                    "content_type": "image/png",
                    "size": 10,
                    "url": "https://cdn.discordapp.com/a.png",
                },
                {"id": "2", "filename": "b.pdf", "content_type": "application/pdf", "size": 20},
                {"id": "3", "filename": "c.bin"},
            ]
        )
    )
    assert [(r.name, r.mime, r.size) for r in msg.images] == [("a.png", "image/png", 10)]
    assert [r.name for r in msg.files] == ["b.pdf", "c.bin"]


REF = "1576899339878400040"


def ref(channel: str = CHAN, mid: str = REF, rtype: int | None = 0) -> dict[str, Any]:
    r: dict[str, Any] = {
        "message_id": mid,
        "channel_id": channel,
        "guild_id": "1400000000000000002",
    }
    if rtype is not None:
        r["type"] = rtype
    return r


SNAP = {
    "id": REF,
    "channel_id": CHAN,
    "author": {"id": "8", "username": "bob", "global_name": None},
    "member": {"nick": "Bobby"},
    "content": "quoted text",
    "attachments": [
        {"id": "1", "filename": "x.png", "content_type": "image/png"},
        {"id": "2", "filename": "v.mp4", "content_type": "video/mp4"},
        {"id": "3", "filename": "n.txt", "content_type": None},
    ],
    "sticker_items": [{"id": "9", "name": "Wave", "format_type": 1}],
}


def test_quote_snapshot() -> None:
    spy = LoaderSpy()
    q = mapped(message(type=19, message_reference=ref(), referenced_message=SNAP), spy).reply_to
    assert q is not None and q.loader is None and spy.made == []
    assert (q.message_id, q.author_id, q.author_name, q.content) == (
        REF,
        "8",
        "Bobby",
        "quoted text",
    )
    assert [(a.kind, a.name) for a in q.attachments] == [  # type: ignore[union-attr]
        ("image", "x.png"),
        ("video", "v.mp4"),
        ("file", "n.txt"),
        ("image", "Wave"),
    ]


@pytest.mark.parametrize(
    ("over", "reason", "lookups"),
    [
        ({"message_reference": ref(), "referenced_message": None}, "deleted", 0),
        ({"message_reference": ref(channel="42")}, "not-found", 0),
        (
            {
                "message_reference": ref(channel="42"),
                "referenced_message": dict(SNAP, channel_id="42"),
            },
            "not-found",
            0,
        ),
        ({"message_reference": ref(), "referenced_message": dict(SNAP, id="1")}, "not-found", 0),
        ({"message_reference": ref()}, None, 1),
        ({"message_reference": ref(rtype=None)}, None, 1),
    ],
)
def test_quote_reference_cases(over: dict[str, Any], reason: str | None, lookups: int) -> None:
    spy = LoaderSpy()
    q = mapped(message(type=19, **over), spy).reply_to
    assert q is not None and q.message_id == REF
    assert (q.unavailable_reason if reason else None) == reason
    assert len(spy.made) == lookups
    if lookups:
        assert spy.made == [(CHAN, REF)] and q.loader is not None


FORWARD_REF = ref(channel="1471808117145600099", mid="1576900388454400094", rtype=1)


def test_a_forward_is_content_not_a_quote() -> None:
    # issue 9 #6: the snapshot's text is the message's content, marked forwarded; the
    # sender is the person who forwarded it; no quote, no lookup.
    spy = LoaderSpy()
    msg = mapped(
        message(
            guild_id=None,
            member=None,
            content="",
            message_reference=FORWARD_REF,
            message_snapshots=[
                {
                    "message": {
                        "type": 0,
                        "content": "/new  please",
                        "attachments": [
                            {"id": "1", "filename": "a.png", "content_type": "image/png"},
                            {"id": "2", "filename": "b.pdf", "content_type": "application/pdf"},
                        ],
                        "mentions": [],
                    }
                }
            ],
        ),
        spy,
    )
    assert msg.content == "/new  please" and msg.forwarded is True
    assert msg.reply_to is None and spy.made == []
    assert (msg.sender_id, msg.sender_name) == (ADA["id"], "Ada Lovelace")
    assert [r.name for r in msg.images] == ["a.png"] and [r.name for r in msg.files] == ["b.pdf"]


def test_a_forward_with_a_comment_keeps_both_texts() -> None:
    msg = mapped(
        message(
            content="look at this",
            message_reference=FORWARD_REF,
            message_snapshots=[{"message": {"content": "forwarded words"}}],
        )
    )
    assert msg.content == "look at this\n\nforwarded words" and msg.forwarded


def test_a_mention_inside_a_forward_does_not_address_the_bot() -> None:
    msg = mapped(
        message(
            content="",
            message_reference=FORWARD_REF,
            message_snapshots=[{"message": {"content": f"<@{BOT}> hi", "mentions": [{"id": BOT}]}}],
        )
    )
    assert msg.addressed is False and msg.content == f"<@{BOT}> hi"


@pytest.mark.parametrize(
    "over",
    [
        {"content": "", "sticker_items": [{"id": "9", "name": "Wave", "format_type": 1}]},
        {"content": "", "poll": {"question": {"text": "lunch?"}, "answers": []}},
        {"content": "", "embeds": [{"title": "a link preview"}]},
        {"content": "   "},
        {"content": f"<@{BOT}>", "mentions": [{"id": BOT}]},
        {
            "content": "",
            "message_reference": FORWARD_REF,
            "message_snapshots": [{"message": {"content": "", "sticker_items": [{"id": "1"}]}}],
        },
    ],
)
def test_a_message_with_nothing_for_the_agent_is_not_a_turn(over: dict[str, Any]) -> None:
    # issue 9 #15: no text, no attachment, no quote -> ignored, never an empty prompt.
    item = MessageMapper(BOT).decode_message(json.dumps(message(guild_id=None, **over)))
    assert isinstance(item, Skip) and item.reason == "ignored", item
    assert item.message_id == "1576900598169600010"


def test_a_reply_with_only_a_sticker_is_still_a_turn_about_the_quote() -> None:
    q = mapped(
        message(
            guild_id=None,
            content="",
            type=19,
            message_reference=ref(),
            referenced_message=SNAP,
            sticker_items=[{"id": "9", "name": "Wave"}],
        )
    )
    assert q.content == "" and q.reply_to is not None


@pytest.mark.parametrize(
    "bad",
    [
        "1" * 21,
        "1" * 100_000,
        "12a4",
        "",
        "../../users/@me",
        "١٢٣",  # Arabic-Indic digits: str.isdigit() says yes, Discord never sends them
        "-5",
    ],
)
def test_a_reference_that_is_not_a_snowflake_is_not_found_and_never_looked_up(bad: str) -> None:
    # issue 9 #4: a quoted id of any length was copied into the quote and the lookup URL.
    spy = LoaderSpy()
    cases: list[dict[str, Any]] = [
        {"message_reference": ref(mid=bad)},
        {"message_reference": ref(mid=bad), "referenced_message": dict(SNAP, id=bad)},
    ]
    if bad:  # an empty channel_id is an absent one: the current channel
        cases.append({"message_reference": ref(channel=bad)})
    for over in cases:
        q = mapped(message(type=19, **over), spy).reply_to
        assert q is not None and q.unavailable_reason == "not-found"
        assert bad == "" or bad not in repr(q)
        assert q.message_id is UNSET
    assert spy.made == []


def test_a_quoted_author_id_that_is_not_a_snowflake_is_left_out() -> None:
    snap = dict(SNAP, author={"id": "x" * 5000, "username": "bob"})
    q = mapped(message(type=19, message_reference=ref(), referenced_message=snap)).reply_to
    assert q is not None and q.author_id is UNSET and q.author_name == "Bobby"


@pytest.mark.parametrize("field", ["id", "channel_id", "guild_id"])
def test_a_message_whose_own_ids_are_not_snowflakes_is_malformed(field: str) -> None:
    item = MessageMapper(BOT).decode_message(json.dumps(message(**{field: "9" * 30})))
    assert isinstance(item, Skip) and item.reason == "malformed"
    bad_author = message(author=dict(ADA, id="ada"))
    item = MessageMapper(BOT).decode_message(json.dumps(bad_author))
    assert isinstance(item, Skip) and item.reason == "malformed"


def test_a_snapshot_without_an_author_leaves_author_unset() -> None:
    # base.py rule 5: "field absent" is UNSET, never None.
    snap = {k: v for k, v in SNAP.items() if k not in ("author", "member", "content")}
    q = mapped(message(type=19, message_reference=ref(), referenced_message=snap)).reply_to
    assert q is not None
    assert (q.author_id, q.author_name, q.content) == (UNSET, UNSET, UNSET)


GUILD = "1400000000000000002"
BOT_ROLE = "1420000000000000007"
OTHER_ROLE = "1420000000000000008"


def guild_create(roles: list[dict[str, Any]]) -> bytes:
    d = {"id": GUILD, "name": "g", "unavailable": False, "roles": roles, "channels": []}
    return json.dumps({"op": 0, "t": "GUILD_CREATE", "s": 2, "d": d}).encode()


BOT_ROLE_JSON = {"id": BOT_ROLE, "name": "b", "managed": True, "tags": {"bot_id": BOT}}
OTHER_BOT_ROLE = {"id": OTHER_ROLE, "name": "o", "managed": True, "tags": {"bot_id": "77"}}


def role_mention(role: str) -> dict[str, Any]:
    return message(content=f"<@&{role}> what time is it?", mention_roles=[role])


def test_a_mention_of_the_bots_managed_role_addresses_it() -> None:
    # issue 9 #14: the mention picker often inserts the bot's role instead of the bot.
    mapper = MessageMapper(BOT)
    learned = mapper.decode_frame(guild_create([{"id": GUILD, "name": "@everyone"}, BOT_ROLE_JSON]))
    assert isinstance(learned, Skip) and learned.reason == "ignored"
    assert mapper.bot_roles(GUILD) == {BOT_ROLE}
    item = mapper.decode_message(json.dumps(role_mention(BOT_ROLE)))
    assert isinstance(item, InboundMessage)
    assert item.addressed is True and item.content == "what time is it?"
    # the role in mention_roles is enough (the picker's text form can vary)
    bare = message(content="hello there", mention_roles=[BOT_ROLE])
    item = mapper.decode_message(json.dumps(bare))
    assert isinstance(item, InboundMessage) and item.addressed


def test_another_role_or_another_guild_does_not_address_the_bot() -> None:
    mapper = MessageMapper(BOT)
    mapper.decode_frame(guild_create([BOT_ROLE_JSON, OTHER_BOT_ROLE]))
    other = mapper.decode_message(json.dumps(role_mention(OTHER_ROLE)))
    assert isinstance(other, InboundMessage) and other.addressed is False
    assert other.content == f"<@&{OTHER_ROLE}> what time is it?"
    elsewhere = dict(role_mention(BOT_ROLE), guild_id="1400000000000000099")
    item = mapper.decode_message(json.dumps(elsewhere))
    assert isinstance(item, InboundMessage) and item.addressed is False


def test_role_events_keep_the_bot_role_current() -> None:
    mapper = MessageMapper(BOT)
    mapper.decode_frame(guild_create([]))
    assert mapper.bot_roles(GUILD) == frozenset()

    def event(t: str, d: dict[str, Any]) -> bytes:
        return json.dumps({"op": 0, "t": t, "s": 3, "d": d}).encode()

    mapper.decode_frame(event("GUILD_ROLE_CREATE", {"guild_id": GUILD, "role": BOT_ROLE_JSON}))
    assert mapper.bot_roles(GUILD) == {BOT_ROLE}
    mapper.decode_frame(event("GUILD_ROLE_DELETE", {"guild_id": GUILD, "role_id": BOT_ROLE}))
    assert mapper.bot_roles(GUILD) == frozenset()
    mapper.decode_frame(guild_create([BOT_ROLE_JSON]))
    mapper.decode_frame(event("GUILD_DELETE", {"id": GUILD, "unavailable": True}))  # outage
    assert mapper.bot_roles(GUILD) == {BOT_ROLE}
    mapper.decode_frame(event("GUILD_DELETE", {"id": GUILD}))  # the bot left
    assert mapper.bot_roles(GUILD) == frozenset()
    bad = mapper.decode_frame(event("GUILD_CREATE", {"roles": "no"}))
    assert isinstance(bad, Skip) and bad.reason == "malformed"


DEEP = b"[" * 1000 + b"]" * 1000


@pytest.mark.parametrize(
    "raw",
    [
        b'{"op":0,"t":"MESSAGE_CREATE","s":3,"d":' + DEEP + b"}",
        b'{"op":0,"t":"MESSAGE_CREATE","s":3,"d":{"id":"1","x":' + DEEP + b"}}",
        b'{"op":11,"d":' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}",
    ],
)
def test_a_deeply_nested_frame_is_a_malformed_drop(raw: bytes) -> None:
    # issue 9 #2: ~1,000 levels raised RecursionError out of receive() and the mapper.
    gw = connected_gw(seq=2)
    [dropped] = gw.receive(raw, 1.0)
    assert isinstance(dropped, Ignored) and dropped.reason == "malformed_frame"
    assert gw.state is ConnState.CONNECTED and gw.seq == 2
    assert sent(gw.tick(gw.next_timer() or 0.0)) == [{"op": 1, "d": 2}]  # beats on
    item = MessageMapper(BOT).decode_frame(raw)
    assert isinstance(item, Skip) and item.reason == "malformed"


def test_attachment_kinds_do_not_depend_on_the_hosts_mime_database() -> None:
    cases = {
        "a.PNG": "image",
        "clip.webm": "video",
        "voice.ogg": "audio",
        "song.opus": "audio",
        "notes.txt": "file",
        "archive.tar.gz": "file",
        "noext": "file",
        "": "file",
    }
    assert {name: attachment_kind(None, name) for name in cases} == cases
    assert attachment_kind("image/heic", "x.bin") == "image"
    assert attachment_kind("text/plain; charset=utf-8", "x.png") == "file"


def test_decode_frame_takes_only_message_create() -> None:
    mapper = MessageMapper(BOT)
    good = json.dumps({"op": 0, "t": "MESSAGE_CREATE", "s": 5, "d": message()})
    assert isinstance(mapper.decode_frame(good.encode()), InboundMessage)
    other = mapper.decode_frame(
        json.dumps({"op": 0, "t": "MESSAGE_UPDATE", "s": 6, "d": message()})
    )
    assert isinstance(other, Skip) and other.reason == "ignored"
    bad = mapper.decode_frame(b'{"op":0,"t":"MESSAGE_CREATE","s":7,"d":{"id":1}}')
    assert isinstance(bad, Skip) and bad.reason == "malformed"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=30,
)
message_keys = st.sampled_from(
    [
        "id",
        "channel_id",
        "author",
        "guild_id",
        "content",
        "mentions",
        "attachments",
        "message_reference",
        "referenced_message",
        "member",
        "type",
        "timestamp",
        "position",
        "channel_type",
    ]
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(message_keys, json_values, max_size=14), st.binary(max_size=64))
def test_fuzzed_payloads_never_crash_the_mapper(d: dict[str, Any], junk: bytes) -> None:
    mapper = MessageMapper(BOT, lookup=LoaderSpy())
    base = message()
    base.update(d)
    for raw in (
        json.dumps({"op": 0, "t": "MESSAGE_CREATE", "s": 1, "d": base}).encode(),
        json.dumps({"op": 0, "t": "MESSAGE_CREATE", "s": 1, "d": d}).encode(),
        junk,
    ):
        item = mapper.decode_frame(raw)
        assert isinstance(item, InboundMessage | Skip)


@settings(max_examples=200, deadline=None)
@given(json_values, st.binary(max_size=64))
def test_fuzzed_frames_never_crash_the_state_machine(d: Any, junk: bytes) -> None:
    gw = connected_gw()
    for op in (0, 1, 7, 9, 10, 11, 99):
        payload = json.dumps({"op": op, "d": d, "s": None, "t": "X"})
        for action in gw.receive(payload, 1.0):
            assert isinstance(action, Send | Close | Deliver | Connected | Ignored)
        if gw.state is not ConnState.CONNECTED:
            gw = connected_gw()
    gw.receive(junk, 1.0)


def test_models_decode_discord_doc_examples() -> None:
    # GET /gateway/bot example from events/gateway.mdx
    doc = b'{"url":"wss://gateway.discord.gg/","shards":9,"session_start_limit":{"total":1000,"remaining":999,"reset_after":14400000,"max_concurrency":1}}'
    got = msgspec.json.decode(doc, type=m.GatewayBot)
    assert got.session_start_limit.remaining == 999 and got.shards == 9
    err = m.error_decoder.decode(
        b'{"message":"You are being rate limited.","retry_after":64.57,"global":false}'
    )
    assert err.retry_after == 64.57 and err.global_ is False


def test_snapshot_without_ids_is_taken_as_the_referenced_message() -> None:
    snap = {k: v for k, v in SNAP.items() if k not in ("id", "channel_id")}
    q = mapped(message(type=19, message_reference=ref(), referenced_message=snap)).reply_to
    assert q is not None and q.message_id == REF and q.content == "quoted text"


async def test_the_replay_adapter_learns_the_bot_from_ready_and_drops_deep_frames() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(404))) as h:
        fx = ReplaySource(bot_id=None, bot_username=None, http=h, api_base="https://replay.invalid")
        adapter = CHANNEL.replay_adapter(fx)
        deep = b'{"op":0,"t":"READY","s":1,"d":' + DEEP + b"}"
        item = adapter.decode(deep)
        assert isinstance(item, Skip) and item.reason == "malformed"
        assert isinstance(adapter.decode(ready().encode()), Skip)
        assert adapter.bot_id == BOT
        mention = message(content=f"<@{BOT}> hi", mentions=[{"id": BOT}])
        frame_ = json.dumps({"op": 0, "t": "MESSAGE_CREATE", "s": 2, "d": mention}).encode()
        got = adapter.decode(frame_)
        assert isinstance(got, InboundMessage) and got.addressed and got.content == "hi"


def test_the_protocol_module_is_sans_io() -> None:
    # protocol.py (and the kit's session types it uses) must not pull in trio or httpx.
    code = (
        "import sys, dshim.channels.discord.protocol; "
        "print(sorted(m for m in ('trio', 'httpx', 'trio_websocket') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
