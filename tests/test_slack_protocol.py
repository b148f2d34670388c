"""Table tests of Slack's sans-IO code: the Socket Mode session, text decoding, mapping."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from dshim.channels.slack import models as m
from dshim.channels.slack.protocol import (
    BotIdentity,
    EventMapper,
    Handover,
    Ping,
    SocketSession,
    SocketState,
    SocketTuning,
    classify_error,
    decode_text,
    escape,
    find_permalink,
    stream_suffix,
)
from dshim.errors import AuthError, FatalChannelError, NotFound, PermissionDenied, RateLimited
from dshim.model import InboundMessage, ReplyReference, Skip
from dshim.net.ws_session import Close, Connected, Deliver, Ignored, Send, WsEnded

BOT = "U0BOT0001"
ME = BotIdentity(
    user_id=BOT,
    bot_id="B0BOT0001",
    app_id="A0APP0001",
    team_id="T0FAKE001",
    name="dshim",
    workspace_host="acme.slack.com",
)


def frame(obj: dict[str, Any]) -> str:
    return json.dumps(obj)


def envelope(event: dict[str, Any], **kw: Any) -> bytes:
    return json.dumps(
        {
            "envelope_id": "e1",
            "type": "events_api",
            "retry_attempt": 0,
            "payload": {
                "type": "event_callback",
                "team_id": "T0FAKE001",
                "api_app_id": kw.pop("app", "A0APP0001"),
                "event_id": "Ev1",
                "event": event,
            },
            **kw,
        }
    ).encode()


def ev(text: str = "hi", **kw: Any) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "message",
        "channel": "D0DM00001",
        "channel_type": "im",
        "user": "U0ADA0001",
        "text": text,
        "ts": "1700000000.000100",
    }
    out.update(kw)
    return out


def lookups() -> tuple[list[tuple[str, str, str | None]], EventMapper]:
    calls: list[tuple[str, str, str | None]] = []

    def lookup(channel: str, ts: str, thread: str | None) -> Any:
        calls.append((channel, ts, thread))

        async def load() -> ReplyReference | None:
            return None

        return load

    return calls, EventMapper(ME, lookup=lookup)


# -- the session ---------------------------------------------------------------------------


def test_ready_only_after_hello_and_every_envelope_is_acked_at_once() -> None:
    s = SocketSession(app_id="A0APP0001")
    s.connection_opened(0.0)
    assert not s.ready
    [connected] = s.receive(frame({"type": "hello", "num_connections": 1}), 0.1)
    assert isinstance(connected, Connected) and s.ready
    [deliver] = s.receive(envelope(ev()), 0.2)
    assert isinstance(deliver, Deliver) and deliver.ack_at_once
    assert deliver.ack is not None and json.loads(deliver.ack.data) == {"envelope_id": "e1"}
    # a redelivery is delivered too (gap events arrive this way)
    [again] = s.receive(envelope(ev(), retry_attempt=2, retry_reason="timeout"), 0.3)
    assert isinstance(again, Deliver)


def test_an_undecodable_envelope_is_still_acked() -> None:
    s = SocketSession()
    s.connection_opened(0.0)
    actions = s.receive('{"envelope_id": "e9", "type": "events_api", "payload": {"x": [}', 1.0)
    assert isinstance(actions[0], Send) and json.loads(actions[0].data) == {"envelope_id": "e9"}
    assert isinstance(actions[1], Ignored) and actions[1].reason == "malformed"
    deep = '{"envelope_id":"e8","type":"events_api","payload":' + "[" * 500 + "]" * 500 + "}"
    acts = s.receive(deep, 1.0)
    assert isinstance(acts[0], Send) and json.loads(acts[0].data) == {"envelope_id": "e8"}


@pytest.mark.parametrize("reason", ["warning", "refresh_requested"])
def test_refresh_disconnects_ask_for_a_handover(reason: str) -> None:
    s = SocketSession()
    s.connection_opened(0.0)
    s.receive(frame({"type": "hello"}), 0.0)
    [handover] = s.receive(frame({"type": "disconnect", "reason": reason}), 1.0)
    assert handover == Handover(reason)
    assert s.state is SocketState.DRAINING and s.next_timer() is not None  # still watched


def test_link_disabled_is_fatal_and_too_many_websockets_backs_off() -> None:
    s = SocketSession()
    s.connection_opened(0.0)
    s.receive(frame({"type": "hello"}), 0.0)
    [close] = s.receive(frame({"type": "disconnect", "reason": "link_disabled"}), 1.0)
    assert isinstance(close, Close)
    with pytest.raises(FatalChannelError):
        s.connection_lost(WsEnded(4000, by_us=True), 2.0)
    t = SocketSession()
    t.connection_opened(0.0)
    t.receive(frame({"type": "hello"}), 0.0)
    t.receive(frame({"type": "disconnect", "reason": "too_many_websockets"}), 1.0)
    t.connection_lost(WsEnded(4000), 1.5)
    assert t.backoff_at_least == 30.0 and t.not_before == 31.5  # 30 s after the end


def test_watchdog_pings_and_declares_a_silent_socket_dead() -> None:
    tuning = SocketTuning()
    s = SocketSession(tuning=tuning)
    s.connection_opened(0.0)
    assert s.next_timer() == 15.0  # hello timeout
    s.receive(frame({"type": "hello"}), 1.0)
    assert s.next_timer() == 11.0
    assert s.tick(11.0) == [Ping()]
    assert s.next_timer() == 31.0  # pong timeout, 20 s
    s.pong(12.0)
    assert s.tick(22.0) == [Ping()]
    # no pong: dead after 20 s (not after 5 s: Slack's container recycling)
    assert s.tick(30.0) == []
    assert s.tick(41.9) == []
    [close] = s.tick(42.0)
    assert isinstance(close, Close)


def test_watchdog_does_not_judge_while_a_delivery_blocks_the_reader() -> None:
    s = SocketSession()
    s.connection_opened(0.0)
    s.receive(frame({"type": "hello"}), 0.0)
    s.tick(10.0)
    assert s.tick(31.0, reading=False) == []
    assert s.tick(31.5) == []
    # a long delivery: pings still go out, and no deadline is left in the past
    t = SocketSession()
    t.connection_opened(0.0)
    t.receive(frame({"type": "hello"}), 0.0)
    now = 10.0
    pings = 0
    for _ in range(50):
        timer = t.next_timer()
        assert timer is not None and timer > now - 1e-9
        now = timer
        actions = t.tick(now, reading=False)
        assert not [a for a in actions if isinstance(a, Close)]
        pings += len(actions)
        if actions:
            t.pong(now + 0.1)
    assert pings >= 10


def test_no_hello_in_time_closes() -> None:
    s = SocketSession()
    s.connection_opened(0.0)
    [close] = s.tick(15.0)
    assert isinstance(close, Close)


# -- errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        ("invalid_auth", AuthError),
        ("account_inactive", AuthError),
        ("missing_scope", PermissionDenied),
        ("not_in_channel", PermissionDenied),
        ("access_denied", PermissionDenied),
        ("thread_not_found", NotFound),
        ("message_not_found", NotFound),
        ("ratelimited", RateLimited),
    ],
)
def test_error_strings_map_once(error: str, kind: type[Exception]) -> None:
    exc = classify_error("conversations.history", error)
    assert isinstance(exc, kind) and exc.code == error


# -- text -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "text"),
    [
        ("<@U0BOT0001> hello", "hello"),
        ("hi <@U0BOT0001|dshim>, ok", "hi , ok"),
        ("ask <@U0BOB0002>", "ask @U0BOB0002"),
        ("ask <@U0BOB0002|bob>", "ask @bob"),
        ("see <#C0GEN0001|general>", "see #general"),
        ("see <#C0GEN0001>", "see #C0GEN0001"),
        (
            "<https://example.com|the docs> and <https://x.org>",
            "the docs (https://example.com) and https://x.org",
        ),
        ("<!here> <!channel> <!everyone>", "@here @channel @everyone"),
        ("<!subteam^S123|@devs> look", "@devs look"),
        ("a &lt;b&gt; &amp;amp; c", "a <b> &amp; c"),
        ("1 &lt; 2 &amp;&amp; 3 &gt; 2", "1 < 2 && 3 > 2"),
    ],
)
def test_text_decoding(raw: str, text: str) -> None:
    assert decode_text(raw, BOT) == text


def test_escape_makes_agent_text_inert() -> None:
    assert escape("<!channel> & <@U1>") == "&lt;!channel&gt; &amp; &lt;@U1&gt;"


def test_permalinks() -> None:
    link = find_permalink(
        "<https://acme.slack.com/archives/C0GEN0001/p1700000000000100?thread_ts=1699999999.000200&amp;cid=C0GEN0001>"
    )
    assert link is not None
    assert (link.host, link.channel, link.ts, link.thread_ts) == (
        "acme.slack.com",
        "C0GEN0001",
        "1700000000.000100",
        "1699999999.000200",
    )
    assert find_permalink("https://acme.slack.com/archives/C0GEN0001") is None


def test_stream_suffix() -> None:
    assert stream_suffix("Hello", "Hello world") == " world"
    assert stream_suffix("Hello", "Help") is None


# -- mapping ----------------------------------------------------------------------------------


def decoded(mapper: EventMapper, event: dict[str, Any], **kw: Any) -> InboundMessage | Skip:
    return mapper.decode_envelope(envelope(event, **kw))


def test_dm_maps_to_a_direct_addressed_message_answered_in_its_thread() -> None:
    item = decoded(EventMapper(ME), ev("hello &amp; welcome"))
    assert isinstance(item, InboundMessage)
    assert (item.conversation_id, item.message_id, item.conversation_type) == (
        "D0DM00001",
        "1700000000.000100",
        "direct",
    )
    assert item.addressed and item.thread_id is None and item.content == "hello & welcome"
    assert item.route.thread_ts == "1700000000.000100"
    assert item.received_at == 1700000000.0001


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (ev(bot_id="B0BOT0001"), "echo"),
        (ev(bot_id="B0OTHER01"), "bot"),
        (ev(subtype="bot_message", bot_id="B0OTHER01"), "bot"),
        (ev(app_id="A0APP0001"), "echo"),
        (ev(user=BOT), "echo"),
        (ev(subtype="message_changed"), "ignored"),
        (ev(subtype="message_deleted"), "ignored"),
        (ev(subtype="channel_join"), "ignored"),
        (ev(ts="not-a-ts"), "malformed"),
        (ev(user=None), "malformed"),
        ({"type": "reaction_added"}, "ignored"),
    ],
)
def test_drops(event: dict[str, Any], reason: str) -> None:
    item = decoded(EventMapper(ME), event)
    assert isinstance(item, Skip) and item.reason == reason


def test_envelopes_for_another_app_and_garbage_are_dropped() -> None:
    mapper = EventMapper(ME)
    other = decoded(mapper, ev(), app="A0OTHER01")
    assert isinstance(other, Skip) and other.reason == "ignored"
    bad = mapper.decode_envelope(
        b'{"type":"events_api","payload":{"type":"event_callback","event":{"ts":5}}}'
    )
    assert isinstance(bad, Skip) and bad.reason == "malformed"
    assert isinstance(mapper.decode_envelope(b"\xff\xfe"), Skip)


def test_group_addressing() -> None:
    mapper = EventMapper(ME)
    group = {"channel": "C0GEN0001", "channel_type": "channel"}
    plain = decoded(mapper, ev("hello all", **group))
    assert isinstance(plain, InboundMessage) and not plain.addressed
    mention = decoded(mapper, ev("<@U0BOT0001> hello", ts="1700000001.000100", **group))
    assert isinstance(mention, InboundMessage) and mention.addressed
    assert mention.content == "hello" and mention.conversation_type == "group"
    app_mention = decoded(
        mapper, {**ev("hey", ts="1700000002.000100", channel="C0GEN0001"), "type": "app_mention"}
    )
    assert isinstance(app_mention, InboundMessage) and app_mention.addressed
    # a reply in the thread the bot answered (the mention's) is addressed, and not a quote
    follow = decoded(
        mapper, ev("and more", ts="1700000005.000100", thread_ts="1700000001.000100", **group)
    )
    assert isinstance(follow, InboundMessage) and follow.addressed and follow.reply_to is None
    assert follow.thread_id == "1700000001.000100"
    # a reply in someone else's thread is not
    other = decoded(
        mapper, ev("unrelated", ts="1700000006.000100", thread_ts="1700000000.000100", **group)
    )
    assert isinstance(other, InboundMessage) and not other.addressed


@pytest.mark.parametrize("kind", ["message", "app_mention"])
def test_a_top_level_mention_in_a_channel_is_the_conversation_of_its_own_thread(
    kind: str,
) -> None:
    mapper = EventMapper(ME)
    group = {"channel": "C0GEN0001", "channel_type": "channel"}
    top = decoded(
        mapper, {**ev("<@U0BOT0001> remember 7", ts="1700000001.000100", **group), "type": kind}
    )
    assert isinstance(top, InboundMessage)
    assert top.thread_id == "1700000001.000100" and top.route.thread_ts == top.thread_id
    follow = decoded(
        mapper, ev("which one?", ts="1700000009.000100", thread_ts="1700000001.000100", **group)
    )
    assert isinstance(follow, InboundMessage) and follow.addressed and follow.reply_to is None
    assert follow.lane_key == top.lane_key == ("C0GEN0001", "1700000001.000100")
    # DMs stay one conversation: a top-level DM has no thread
    dm = decoded(mapper, ev("hi", ts="1700000010.000100"))
    assert isinstance(dm, InboundMessage) and dm.thread_id is None
    # an unaddressed top-level channel message opens no conversation of its own
    plain = decoded(mapper, ev("hello all", ts="1700000011.000100", **group))
    assert isinstance(plain, InboundMessage) and plain.thread_id is None


def test_first_thread_reply_quotes_the_parent_by_lookup_later_ones_do_not() -> None:
    calls, mapper = lookups()
    group = {"channel": "C0GEN0001", "channel_type": "channel"}
    first = decoded(
        mapper,
        ev(
            "<@U0BOT0001> what about this?",
            ts="1700000010.000100",
            thread_ts="1700000000.000100",
            parent_user_id="U0BOB0002",
            **group,
        ),
    )
    assert isinstance(first, InboundMessage) and first.reply_to is not None
    assert first.reply_to.message_id == "1700000000.000100"
    assert first.reply_to.author_id == "U0BOB0002"
    assert first.reply_to.loader is not None
    assert calls == [("C0GEN0001", "1700000000.000100", None)]
    later = decoded(
        mapper, ev("thanks", ts="1700000011.000100", thread_ts="1700000000.000100", **group)
    )
    assert isinstance(later, InboundMessage) and later.reply_to is None and later.addressed
    assert len(calls) == 1


def test_thread_under_the_bots_own_message_is_addressed_and_recoverable() -> None:
    calls, mapper = lookups()
    item = decoded(
        mapper,
        ev(
            "why?",
            channel="C0GEN0001",
            channel_type="channel",
            ts="1700000010.000100",
            thread_ts="1700000000.000100",
            parent_user_id=BOT,
        ),
    )
    assert isinstance(item, InboundMessage) and item.addressed
    ref = item.reply_to
    assert ref is not None and ref.recover and ref.author_id == BOT
    assert ref.recover_at == 1700000000.0001


def test_permalinks_quote_in_the_same_channel_only() -> None:
    calls, mapper = lookups()
    group = {"channel": "C0GEN0001", "channel_type": "channel"}
    same = decoded(
        mapper,
        ev(
            "<@U0BOT0001> look <https://acme.slack.com/archives/C0GEN0001/p1699999999000300>",
            **group,
        ),
    )
    assert isinstance(same, InboundMessage) and same.reply_to is not None
    assert same.reply_to.message_id == "1699999999.000300"
    assert "https://acme.slack.com/archives/C0GEN0001/p1699999999000300" in same.content
    assert calls == [("C0GEN0001", "1699999999.000300", None)]
    other = decoded(
        mapper,
        ev(
            "<@U0BOT0001> <https://acme.slack.com/archives/C0OUT0001/p1699999999000300>",
            ts="1700000001.000100",
            **group,
        ),
    )
    assert isinstance(other, InboundMessage) and other.reply_to is not None
    assert other.reply_to.unavailable_reason == "not-found" and other.reply_to.loader is None
    foreign = decoded(
        mapper,
        ev(
            "<@U0BOT0001> <https://evil.slack.com/archives/C0GEN0001/p1699999999000300>",
            ts="1700000002.000100",
            **group,
        ),
    )
    assert isinstance(foreign, InboundMessage) and foreign.reply_to is None
    in_thread = decoded(
        mapper,
        ev(
            "<@U0BOT0001> <https://acme.slack.com/archives/C0GEN0001/p1699999999000400"
            "?thread_ts=1699999999.000300&amp;cid=C0GEN0001>",
            ts="1700000003.000100",
            **group,
        ),
    )
    assert isinstance(in_thread, InboundMessage) and in_thread.reply_to is not None
    assert calls[-1] == ("C0GEN0001", "1699999999.000400", "1699999999.000300")
    assert len(calls) == 2


def test_missing_history_scope_degrades_without_a_request() -> None:
    calls: list[Any] = []
    me = BotIdentity(user_id=BOT, scopes=frozenset({"chat:write", "im:history"}))

    def lookup(*args: Any) -> Any:
        calls.append(args)
        raise AssertionError("no lookup without the scope")

    mapper = EventMapper(me, lookup=lookup)
    item = decoded(
        mapper,
        ev(
            "<@U0BOT0001> hm",
            channel="G0PRIV001",
            channel_type="group",
            ts="1700000010.000100",
            thread_ts="1700000000.000100",
            parent_user_id="U0BOB0002",
        ),
    )
    assert isinstance(item, InboundMessage) and item.reply_to is not None
    assert item.reply_to.unavailable_reason == "permission-denied"
    assert calls == []


def test_fetched_reference_checks_the_ts_and_names_the_bot() -> None:
    mapper = EventMapper(ME)
    got = msgspec.json.decode(
        b'{"type":"message","ts":"1.000001","bot_id":"B0BOT0001","text":"my &lt;answer&gt;",'
        b'"files":[{"name":"a.png","mimetype":"image/png"}]}',
        type=m.Event,
    )
    ref = mapper.fetched_reference(got, "1.000001")
    assert ref is not None and ref.author_id == BOT and ref.author_name == "dshim"
    assert ref.content == "my <answer>"
    assert [(a.kind, a.name) for a in ref.attachments] == [("image", "a.png")]
    assert mapper.fetched_reference(got, "1.000002") is None
    assert mapper.fetched_reference(None, "1.000001") is None


def test_files_are_lazy_handles() -> None:
    fetched: list[str] = []

    def media(f: m.File) -> Any:
        fetched.append(f.id)
        return None

    mapper = EventMapper(ME, media=media)
    item = decoded(
        mapper,
        ev(
            "",
            subtype="file_share",
            files=[
                {"id": "F1", "name": "cat.png", "mimetype": "image/png", "size": 3},
                {"id": "F2", "name": "notes.pdf", "mimetype": "application/pdf", "size": 9},
            ],
        ),
    )
    assert isinstance(item, InboundMessage)
    assert [(i.kind, i.name) for i in item.images] == [("image", "cat.png")]
    assert [(f.kind, f.name) for f in item.files] == [("file", "notes.pdf")]
    assert fetched == ["F1", "F2"]  # handles made, nothing downloaded


def test_button_press_becomes_a_message_from_the_presser() -> None:
    mapper = EventMapper(ME)
    raw = json.dumps(
        {
            "envelope_id": "e5",
            "type": "interactive",
            "payload": {
                "type": "block_actions",
                "api_app_id": "A0APP0001",
                "user": {"id": "U0ADA0001", "name": "ada", "team_id": "T0FAKE001"},
                "channel": {"id": "C0GEN0001"},
                "container": {"message_ts": "1700000020.000100", "thread_ts": "1700000000.000100"},
                "actions": [
                    {"action_id": "dshim_opt_2", "value": "2", "action_ts": "1700000021.000200"}
                ],
            },
        }
    ).encode()
    item = mapper.decode_envelope(raw)
    assert isinstance(item, InboundMessage)
    assert (item.content, item.sender_id, item.thread_id) == ("2", "U0ADA0001", "1700000000.000100")
    assert item.addressed and item.reply_to is None


def test_the_stored_frame_drops_the_verification_token_and_response_url() -> None:
    mapper = EventMapper(ME)
    raw = json.loads(envelope(ev("keep me")))
    raw["payload"]["token"] = "legacy-verification-secret"
    frame = json.dumps(raw).encode()
    env = m.envelope_decoder.decode(frame)
    stored = mapper.stored_frame(env)
    assert stored is not None and b"legacy-verification-secret" not in stored
    again = mapper.decode_envelope(stored)
    first = mapper.decode_envelope(frame)
    assert isinstance(again, InboundMessage) and isinstance(first, InboundMessage)
    assert (again.message_id, again.content, again.conversation_id) == (
        first.message_id,
        first.content,
        first.conversation_id,
    )
    press = {
        "envelope_id": "e5",
        "type": "interactive",
        "payload": {
            "type": "block_actions",
            "token": "legacy-verification-secret",
            "response_url": "https://hooks.slack.com/actions/T0/1/SECRETSECRET",
            "user": {"id": "U0ADA0001"},
            "channel": {"id": "C0GEN0001"},
            "container": {"message_ts": "1700000020.000100"},
            "actions": [
                {"action_id": "dshim_opt_1", "value": "1", "action_ts": "1700000021.000200"}
            ],
        },
    }
    stored = mapper.stored_frame(m.envelope_decoder.decode(json.dumps(press).encode()))
    assert stored is not None
    assert b"SECRET" not in stored and b"legacy-verification" not in stored
    assert isinstance(mapper.decode_envelope(stored), InboundMessage)
