"""Table tests for the sans-IO Discord gateway state machine and the MESSAGE_CREATE mapping.

No sockets and no clock: time is an argument (``now``), randomness is a fixed function.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dshim.channels.discord import models as m
from dshim.channels.discord.protocol import (
    INTENTS,
    CloseConnection,
    Connected,
    ConnState,
    Dispatch,
    GatewayProtocol,
    GatewayTuning,
    Ignored,
    MessageMapper,
    Mode,
    SendFrame,
    gateway_url,
    snowflake_time,
)
from dshim.errors import AuthError, FatalChannelError
from dshim.model import InboundMessage, ReplyReference, Skip

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
    return [json.loads(a.payload) for a in actions if isinstance(a, SendFrame)]


def new_gw(rand: float = 0.25, **tuning: Any) -> GatewayProtocol:
    gw = GatewayProtocol(token=TOKEN, random=lambda: rand, tuning=GatewayTuning(**tuning))
    gw.set_gateway_info(info(), 0.0)
    return gw


def connected_gw(now: float = 0.0, seq: int = 1) -> GatewayProtocol:
    gw = new_gw()
    plan = gw.plan_connection(now)
    gw.connection_opened(plan.mode, now)
    gw.receive(hello(), now)
    gw.receive(ready(s=seq), now)
    return gw


# -- handshake and heartbeat --------------------------------------------------------------


def test_first_connection_identifies_with_intents_after_hello() -> None:
    gw = new_gw()
    plan = gw.plan_connection(0.0)
    assert plan.mode is Mode.IDENTIFY and not plan.refresh_gateway
    assert plan.url == GW + "/?v=10&encoding=json"
    gw.connection_opened(plan.mode, 0.0)
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
    assert [type(a) for a in actions] == [Connected, Dispatch]
    assert gw.session_id == "abc" and gw.resume_url == RESUME and gw.seq == 1
    assert gw.state is ConnState.CONNECTED


@pytest.mark.parametrize("rand", [0.0, 0.25, 0.999])
def test_first_heartbeat_is_jittered_then_every_interval(rand: float) -> None:
    gw = new_gw(rand)
    gw.connection_opened(Mode.IDENTIFY, 100.0)
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
    assert actions == [CloseConnection(4000, "heartbeat not acknowledged")]
    gw.connection_lost(1000, t1 + 1.0)  # our own close: the local code does not matter
    plan = gw.plan_connection(t1 + 1.0)
    assert plan.mode is Mode.RESUME and plan.not_before <= t1 + 1.0
    assert plan.url == RESUME + "/?v=10&encoding=json"
    gw.connection_opened(plan.mode, t1 + 1.1)
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
    gw.connection_opened(Mode.IDENTIFY, 0.0)
    assert gw.next_timer() == 20.0
    assert gw.tick(19.9) == []
    assert isinstance(gw.tick(20.0)[0], CloseConnection)


# -- reconnect, resume, invalid session ---------------------------------------------------


def test_reconnect_opcode_closes_non_1000_and_resumes() -> None:
    gw = connected_gw(seq=9)
    [close] = gw.receive(frame(7), 1.0)
    assert isinstance(close, CloseConnection) and close.code not in (1000, 1001)
    gw.connection_lost(close.code, 1.0)
    plan = gw.plan_connection(1.0)
    assert (plan.mode, plan.not_before) == (Mode.RESUME, 1.0)


def test_invalid_session_resumable_resumes() -> None:
    gw = connected_gw()
    [close] = gw.receive(frame(9, True), 1.0)
    assert close.code == 4000
    gw.connection_lost(None, 1.0)
    assert gw.plan_connection(1.0).mode is Mode.RESUME


@pytest.mark.parametrize("rand", [0.0, 1.0])
def test_invalid_session_not_resumable_waits_1_to_5_s_and_identifies_on_gateway_url(
    rand: float,
) -> None:
    gw = connected_gw()
    gw._random = lambda: rand  # type: ignore[method-assign]
    [close] = gw.receive(frame(9, False), 10.0)
    assert isinstance(close, CloseConnection) and close.code == 1000
    gw.connection_lost(1000, 10.0)
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
        gw.connection_lost(code, 1.0)
    assert str(code) in str(exc_info.value)
    assert TOKEN not in str(exc_info.value)


def test_disallowed_intents_error_says_what_to_do() -> None:
    gw = connected_gw()
    with pytest.raises(FatalChannelError, match="Message Content intent"):
        gw.connection_lost(4014, 1.0)


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
    gw.connection_lost(code, 1.0)
    assert gw.plan_connection(1.0).mode is mode


def test_backoff_grows_for_connections_that_never_get_ready_and_resets_after() -> None:
    gw = new_gw(rand=0.5, backoff_s=(0.0, 1.0, 3.0))
    gw.set_gateway_info(info(), 0.0)
    now = 0.0
    waits = []
    for _ in range(4):
        plan = gw.plan_connection(now)
        now = max(now, plan.not_before)
        gw.connection_opened(plan.mode, now)
        gw.connection_lost(None, now)  # refused before hello
        waits.append(gw.plan_connection(now).not_before - now)
    assert waits[0] == pytest.approx(1.0)
    assert waits[1] == pytest.approx(3.0) and waits[3] == pytest.approx(3.0)
    plan = gw.plan_connection(now + 10)
    gw.connection_opened(plan.mode, now + 10)
    gw.receive(hello(), now + 10)
    gw.receive(ready(), now + 10)
    gw.connection_lost(1006, now + 20)
    assert gw.plan_connection(now + 20).not_before == now + 20
    assert gw.failures == 0


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
    gw.connection_opened(gw.plan_connection(0.0).mode, 0.0)
    gw.receive(hello(), 0.0)
    assert gw.identify_remaining == 1 and gw.identifies == 1
    gw.connection_lost(4009, 1.0)  # needs a new session
    plan = gw.plan_connection(1.0)
    assert plan.mode is Mode.IDENTIFY and plan.not_before >= 5.0  # one identify per 5 s
    gw.connection_opened(plan.mode, plan.not_before)
    gw.receive(hello(), plan.not_before)
    assert gw.identify_remaining == 0
    gw.connection_lost(4009, 6.0)
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
    action = SendFrame("identify", TOKEN.encode())
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


def test_forward_is_not_a_quote() -> None:
    spy = LoaderSpy()
    msg = mapped(
        message(
            content="",
            message_reference=ref(rtype=1),
            message_snapshots=[{"message": {"content": "/new", "attachments": []}}],
        ),
        spy,
    )
    assert msg.reply_to is None and spy.made == [] and msg.content == ""


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
            assert isinstance(action, SendFrame | CloseConnection | Dispatch | Connected | Ignored)
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
