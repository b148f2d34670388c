"""The DSH adapter: protocol tables, then the adapter against the fake host on 127.0.0.1.

Table tests pin the sans-IO rules (envelope checks, error mapping, events -> turn events,
history scans).  Adapter tests open :class:`~dshim.harness.dsh.DshHarness` with
:func:`dshim.harness.open_harness` against :mod:`dshim.testing.fakes.dsh` (port 0) on the
autojump clock with a hard deadline; the end-to-end tests through Telegram are in
``test_harness_dsh_e2e.py``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from dshim.channels.registry import parse_config
from dshim.config import HarnessConfig, Secret
from dshim.errors import ConfigError, HarnessError
from dshim.harness import create_harness, open_harness
from dshim.harness.base import TurnContext
from dshim.harness.dsh import DshHarness, protocol
from dshim.harness.dsh.protocol import TurnTracker
from dshim.model import (
    ApprovalRequest,
    ImagePart,
    QuestionRequest,
    TextDelta,
    TextPart,
    Thinking,
    ToolProgress,
    TurnEnd,
    TurnEvent,
)
from dshim.probe import ProbeRow, _harness_check
from dshim.testing.fakes.dsh import VERSION, FakeDsh, open_fake_dsh

DEADLINE = 300
CTX = TurnContext(
    bot="b", conversation_id="c", thread_id=None, sender_id="1", conversation_type="direct"
)


# --- protocol tables ------------------------------------------------------------------------


def _resp(rpc_id: str, result: Any, kind: str = "server-response") -> bytes:
    return json.dumps({"type": kind, "rpcId": rpc_id, "result": result}).encode()


def test_request_body_is_the_client_request_envelope() -> None:
    body = json.loads(protocol.request_body("r-1", "session.create", {"workspaceId": "w"}))
    assert body == {
        "type": "client-request",
        "rpcId": "r-1",
        "method": "session.create",
        "payload": {"workspaceId": "w"},
    }


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"not json", "harness-response-invalid"),
        (_resp("other", {"ok": True, "value": 1}), "harness-response-invalid"),
        (_resp("r", {"ok": True}, kind="client-request"), "harness-response-invalid"),
        (_resp("r", {"ok": "yes"}), "harness-response-invalid"),
        (
            _resp("r", {"ok": False, "error": {"code": "agent-busy", "message": "busy"}}),
            "agent-busy",
        ),
        (_resp("r", {"ok": False}), "internal"),
    ],
)
def test_parse_response_checks_the_echo_and_ok(body: bytes, code: str) -> None:
    with pytest.raises(HarnessError) as info:
        protocol.parse_response("session.prompt", "r", body)
    assert info.value.code == code


def test_parse_response_returns_the_value_and_explains_known_codes() -> None:
    assert protocol.parse_response("m", "r", _resp("r", {"ok": True, "value": {"a": 1}})) == {
        "a": 1
    }
    with pytest.raises(HarnessError) as info:
        protocol.parse_response(
            "session.prompt",
            "r",
            _resp("r", {"ok": False, "error": {"code": "session-not-found", "message": "gone"}}),
        )
    assert "send /new" in str(info.value) and "session.prompt: gone" in str(info.value)


@pytest.mark.parametrize(
    ("status", "body", "loopback", "code", "words"),
    [
        (401, b"", True, "harness-auth-required", "token"),
        (407, b"", True, "harness-proxy-auth-required", "credentials"),
        (403, b"forbidden", True, "harness-loopback-forbidden", "refuses this client"),
        (403, b" forbidden\n", False, "harness-host-untrusted", "refuses this client"),
        (403, b"nope", True, "harness-request-forbidden", "refuses this client"),
        (404, b"", True, "harness-api-not-found", "too old"),
        (502, b"", True, "harness-http-failed", "HTTP 502"),
    ],
)
def test_http_errors_map_once_with_clear_words(
    status: int, body: bytes, loopback: bool, code: str, words: str
) -> None:
    err = protocol.http_error("session.create", status, body, loopback=loopback)
    assert err.code == code and words in str(err)


def test_respond_bodies() -> None:
    ok = json.loads(protocol.respond_body("q-1", {"sessionId": "s"}))
    assert ok == {
        "type": "client-response",
        "rpcId": "q-1",
        "result": {"ok": True, "value": {"sessionId": "s"}},
    }
    cancel = json.loads(protocol.respond_body("q-1", None, cancelled=True))
    assert cancel["result"]["ok"] is False and cancel["result"]["error"]["code"] == "cancelled"
    assert protocol.parse_receipt(b'{"accepted":true}') == (True, None)
    assert protocol.parse_receipt(b'{"accepted":false,"reason":"not-pending"}') == (
        False,
        "not-pending",
    )
    assert protocol.parse_receipt(b"[]") == (False, "invalid")


@pytest.mark.parametrize(
    "raw",
    [
        b"{}",  # binary frames are ignored
        "not json",
        "[1,2]",
        json.dumps(
            {"type": "server-request", "method": "a", "payload": {"type": "b", "sessionId": "s"}}
        ),
        json.dumps({"type": "server-request", "method": "a", "payload": {"type": "a"}}),
        json.dumps({"type": "other", "method": "a", "payload": {"type": "a", "sessionId": "s"}}),
        "[" * 10000,
    ],
)
def test_malformed_mux_frames_are_dropped(raw: str | bytes) -> None:
    assert protocol.decode_frame(raw) is None


def _ev(seq: int, kind: str, **data: Any) -> dict[str, Any]:
    return {"seq": seq, "type": kind, "time": 1_790_000_000_000 + seq, "data": data}


def _chunk(
    seq: int, text: str, *, turn: int = 2, step: int = 0, kind: str = "text-delta"
) -> dict[str, Any]:
    return _ev(
        seq, "assistant/chunk", turn=turn, step=step, chunk={"type": kind, "index": 0, "text": text}
    )


def test_tracker_follows_only_its_own_turn_in_seq_order_without_duplicates() -> None:
    tracker = TurnTracker("mine")
    events = [
        _ev(1, "turn/start", turn=1),
        _ev(2, "user/message", turn=1, source={"rpcId": "other"}),
        _chunk(3, "not mine", turn=1),
        _ev(4, "turn/end", turn=1, reason="completed"),
        _ev(5, "turn/start", turn=2),
        _ev(6, "user/message", turn=2, source={"rpcId": "mine"}),
        _chunk(7, "think", kind="reasoning-delta"),
        _chunk(8, "Hello "),
        _chunk(9, "world"),
        _ev(
            10,
            "assistant/message",
            turn=2,
            step=0,
            message={"content": [{"type": "text", "text": "Hello world!"}]},
        ),
        _ev(11, "tool/call", turn=2, callId="c1", name="grep"),
        _ev(12, "tool/result", turn=2, callId="c1", name="grep", error={"message": "x"}),
        _chunk(13, "Done.", step=1),
        _ev(14, "turn/end", turn=2, reason="completed"),
        _chunk(15, "after the end"),
    ]
    out: list[TurnEvent] = []
    out += tracker.feed(list(reversed(events[:9])))  # any order
    out += tracker.feed(events[5:])  # overlapping: duplicates are ignored
    assert out == [
        Thinking("think"),
        TextDelta("Hello "),
        TextDelta("world"),
        TextDelta("!"),
        ToolProgress(title="grep", status="running", tool_id="c1"),
        ToolProgress(title="grep", status="failed", tool_id="c1"),
        TextDelta("\n\nDone."),
    ]
    assert tracker.done and tracker.end == TurnEnd()
    assert tracker.text == "Hello world!\n\nDone."


@pytest.mark.parametrize(
    ("reason", "stop", "words"),
    [
        ("completed", "end_turn", None),
        ("max-tokens", "max_tokens", "output limit"),
        ("interrupted", "cancelled", None),
        ({"kind": "blocked"}, "refusal", "blocked"),
        (
            {"kind": "error", "error": {"code": "RATE_LIMIT", "message": "slow down"}},
            "error",
            "slow down (RATE_LIMIT)",
        ),
        ("weird", "error", "weird"),
        (None, "error", "unknown reason"),
    ],
)
def test_turn_end_reasons(reason: Any, stop: str, words: str | None) -> None:
    end = protocol.end_for(reason)
    assert end.stop_reason == stop
    assert (end.error is None) if words is None else (words in (end.error or ""))


def test_history_scan_takes_the_last_message_of_completed_turns_across_pages() -> None:
    msg = lambda seq, turn, text: _ev(  # noqa: E731
        seq, "assistant/message", turn=turn, message={"content": [{"type": "text", "text": text}]}
    )
    newer = [
        msg(7, 2, "final two"),
        _ev(8, "turn/end", turn=2, reason="completed"),
        msg(9, 3, "cut"),
        _ev(10, "turn/end", turn=3, reason={"kind": "error"}),
    ]
    older = [
        msg(2, 1, "one"),
        _ev(3, "turn/end", turn=1, reason={"kind": "completed"}),
        msg(6, 2, "step one of two"),
    ]
    scan = protocol.AnswerScan()
    scan.feed(newer)
    scan.feed(older)
    assert [a.text for a in scan.answers] == ["final two", "one"]
    assert protocol.event_time({"time": "2026-09-21T00:00:00Z"}) == 1789948800.0
    assert protocol.event_time({"time": 1_790_000_000_000}) == 1_790_000_000.0
    assert protocol.event_time({"time": True}) is None


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
_kinds = st.sampled_from(
    ["user/message", "assistant/chunk", "assistant/message", "tool/call", "tool/result", "turn/end"]
)
_data = st.dictionaries(
    st.sampled_from(["turn", "step", "chunk", "message", "reason", "name", "callId", "error"]),
    _json | st.just(1),
    max_size=5,
)
_event = st.fixed_dictionaries(
    {"seq": st.integers(1, 30) | _json, "type": _kinds | _json, "data": _data | _json},
    optional={"time": _json},
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_event | _json, max_size=8))
def test_events_of_any_shape_never_raise(events: list[Any]) -> None:
    tracker = TurnTracker("r")
    tracker.feed([_ev(0, "user/message", turn=1, source={"rpcId": "r"}), *events])
    scan = protocol.AnswerScan()
    scan.feed([e for e in events if isinstance(e, dict)])
    protocol.page_events({"events": [{"event": e} for e in events], "hasMore": True})


@settings(max_examples=100, deadline=None)
@given(_json)
def test_frames_of_any_shape_never_raise(payload: Any) -> None:
    frame = {"type": "server-request", "rpcId": "x", "method": "session/event", "payload": payload}
    protocol.decode_frame(json.dumps(frame))


def test_config_accepts_dsh_keys_and_checks_the_url() -> None:
    cfg = parse_config(
        {"harness": {"kind": "dsh", "token": "${T}", "workspace": "/w", "agent_preset": "p"}},
        env={"T": "tok"},
    ).harness
    assert cfg.kind == "dsh" and cfg.token == Secret("tok") and cfg.agent_preset == "p"
    with pytest.raises(ConfigError, match="harness.base_url"):
        parse_config({"harness": {"kind": "dsh", "base_url": "ftp://x"}}, env={})
    h = create_harness(cfg, bot="b", store=None, workspace="/bot/own")
    assert isinstance(h, DshHarness)
    assert h.base_url == "http://127.0.0.1:3080" and h.workspace == "/bot/own"


# --- the adapter against the fake -----------------------------------------------------------


@asynccontextmanager
async def adapter(tmp_path: Path, fake: FakeDsh, **cfg: Any) -> AsyncIterator[DshHarness]:
    config = HarnessConfig(kind="dsh", base_url=fake.url, workspace=str(tmp_path), **cfg)
    harness = DshHarness(config, bot="b", poll_interval_s=0.3)
    async with open_harness(harness):
        yield harness


async def run(h: DshHarness, sid: str, text: str, **answers: Any) -> list[TurnEvent]:
    """One turn; approvals/questions are answered with ``approve`` / ``pick``."""
    out: list[TurnEvent] = []
    parts: list[Any] = [TextPart(text), *answers.pop("images", [])]
    async with aclosing(h.prompt(sid, parts, CTX)) as events:
        async for ev in events:
            out.append(ev)
            if isinstance(ev, ApprovalRequest) and ev.reply is not None:
                await ev.reply(answers.get("approve"))
            elif isinstance(ev, QuestionRequest) and ev.reply is not None:
                await ev.reply(answers.get("pick", []), answers.get("custom"))
    return out


Hook = Callable[[TurnEvent, list[TurnEvent]], Awaitable[None]]


async def watch(h: DshHarness, sid: str, text: str, hook: Hook) -> list[TurnEvent]:
    """One turn; ``hook`` sees every event (and the events so far) as it arrives."""
    events: list[TurnEvent] = []
    async with aclosing(h.prompt(sid, [TextPart(text)], CTX)) as stream:
        async for ev in stream:
            events.append(ev)
            await hook(ev, events)
    return events


def text_of(events: list[TurnEvent]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


async def test_models_are_listed_and_selected(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            catalogue = await h.list_models(None)
            sid = await h.create_session(title=None)
            assert await h.select_model(sid, "deepseek-reasoner") == "deepseek/deepseek-reasoner"
            current = [m.id for m in await h.list_models(sid) or [] if m.current]
            answer = text_of(await run(h, sid, "hi"))
            with pytest.raises(HarnessError, match="unknown model"):
                await h.select_model(sid, "gpt-9")
    assert [m.id for m in catalogue or []] == [
        "deepseek/deepseek-chat",
        "deepseek/deepseek-reasoner",
    ]
    assert current == ["deepseek/deepseek-reasoner"]
    assert answer == "[deepseek-reasoner] echo: hi"
    [select] = fake.calls_to("session.selectModel")
    assert select.payload == {
        "sessionId": sid,
        "provider": "deepseek",
        "model": "deepseek-reasoner",
    }
    assert fake.calls_to("llm.models")


async def test_registered_workspace_is_reused_and_preset_sent(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_dsh() as fake:
            wid = fake.add_workspace(str(tmp_path))
            async with adapter(tmp_path, fake, agent_preset="default") as h:
                await h.create_session(title="t")
                await h.create_session(title="t2")
            async with adapter(tmp_path, fake, agent_preset="nope") as h:
                with pytest.raises(HarnessError) as info:
                    await h.create_session(title=None)
    assert not fake.calls_to("workspace.create")
    assert len(fake.calls_to("workspace.list")) == 2  # once per adapter, then cached
    payloads = [c.payload for c in fake.calls_to("session.create")]
    assert payloads[0] == {"workspaceId": wid, "agentPreset": "default"}
    assert info.value.code == "agent-preset-not-found"


async def test_images_are_sent_as_base64_parts(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            sid = await h.create_session(title=None)
            image = ImagePart(mime="image/png", data=b"\x89PNG1234", name="a.png")
            answer = text_of(await run(h, sid, "look", images=[image]))
    assert answer == "echo: look\nimage image/png 8 bytes"
    [prompt] = fake.prompts()
    assert prompt["content"][1] == {
        "type": "image",
        "mediaType": "image/png",
        "data": "iVBORzEyMzQ=",
        "name": "a.png",
    }


@pytest.mark.parametrize(
    ("knob", "code"),
    [
        ("forbidden", "harness-loopback-forbidden"),
        ("old", "harness-api-not-found"),
        ("token", "harness-auth-required"),
    ],
)
async def test_host_refusals_are_clear(
    autojump_clock: trio.abc.Clock, tmp_path: Path, knob: str, code: str
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            if knob == "token":
                fake.token = "right"
            else:
                setattr(fake, knob, True)
            with pytest.raises(HarnessError) as info:
                await h.check()
    assert info.value.code == code


async def test_mux_lost_mid_turn_continues_by_polling_without_repeats(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE), structlog.testing.capture_logs() as logs:
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            sid = await h.create_session(title=None)

            async def cut(ev: TurnEvent, events: list[TurnEvent]) -> None:
                if text_of(events).count("chunk") == 2 and isinstance(ev, TextDelta):
                    fake.mux_enabled = False
                    await fake.close_mux()

            events = await watch(h, sid, "dsh:slow 6", cut)
    assert text_of(events) == "".join(f"chunk {i} " for i in range(6))
    assert isinstance(events[-1], TurnEnd) and events[-1].error is None
    assert [e["reason"] for e in logs if e["event"] == "turn_events_polled"] == ["events mux lost"]
    assert fake.calls_to("session.history")


async def test_malformed_mux_frames_do_not_stop_the_turn(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE), structlog.testing.capture_logs() as logs:
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            sid = await h.create_session(title=None)
            await h.check()

            async def garbage(ev: TurnEvent, events: list[TurnEvent]) -> None:
                if len(events) == 1:
                    for send in fake.mux:
                        for bad in ("nope", "[" * 5000, json.dumps({"type": "server-request"})):
                            send.send_nowait(bad)

            events = await watch(h, sid, "dsh:slow 3", garbage)
    assert text_of(events) == "chunk 0 chunk 1 chunk 2 "
    assert sum(1 for e in logs if e["event"] == "event_dropped") == 3


async def test_respond_refusals_are_logged_and_the_turn_goes_on(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE), structlog.testing.capture_logs() as logs:
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            sid = await h.create_session(title=None)

            async def late(ev: TurnEvent, events: list[TurnEvent]) -> None:
                if isinstance(ev, ApprovalRequest) and ev.reply is not None:
                    [rpc] = list(fake.pending)
                    fake.pending[rpc].done.set()  # answered meanwhile: not pending
                    fake.pending[rpc].result = {"outcome": "rejected"}
                    await ev.reply("allowed-once")

            events = await watch(h, sid, "dsh:approve", late)
    refused = [e for e in logs if e["event"] == "interaction_response_refused"]
    assert [e["reason"] for e in refused] == ["not-pending"]
    assert text_of(events) == "approval: rejected"


async def test_question_cancelled_is_answered_cancelled(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            sid = await h.create_session(title=None)
            answer = text_of(await run(h, sid, "dsh:ask"))
            custom = text_of(await run(h, sid, "dsh:ask", custom="green"))
    assert answer == "answer: cancelled"
    assert custom == "answer:  (green)"
    bodies = [c for c in fake.calls_to("respond")]
    assert len(bodies) == 2 and all(c.status == 200 for c in bodies)


async def test_probe_rows_show_version_workspace_and_models(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_dsh() as fake:
            config = parse_config(
                {
                    "dshim": {"data_dir": str(tmp_path / "data")},
                    "harness": {"kind": "dsh", "base_url": fake.url, "workspace": str(tmp_path)},
                },
                env={},
            )
            rows: list[ProbeRow] = []
            await _harness_check(config, rows)
    by_name = {r.check: r for r in rows}
    assert by_name["harness"].result == "ok" and VERSION in by_name["harness"].detail
    assert by_name["harness: workspace"].result == "ok"
    assert by_name["harness: models"].detail.startswith("2: deepseek/deepseek-chat")


async def test_without_the_events_websocket_the_chat_hears_at_once_where_to_approve(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    """The mux is down: an approval cannot reach the chat.  The turn says so before
    anything else, and once the tool call has waited 5 s it names the tool and the DSH
    UI — not ~110 s of silence; approved there, the answer arrives."""
    seen: list[tuple[float, TurnEvent]] = []

    async def hook(ev: TurnEvent, events: list[TurnEvent]) -> None:
        seen.append((trio.current_time(), ev))
        if isinstance(ev, ToolProgress) and ev.status == "waiting":
            [rpc] = list(fake.pending)
            fake.resolve_elsewhere(rpc)

    with trio.fail_after(DEADLINE), structlog.testing.capture_logs() as logs:
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            fake.mux_enabled = False
            sid = await h.create_session(title=None)
            started = trio.current_time()
            events = await watch(h, sid, "dsh:approve", hook)
    first = events[0]
    assert isinstance(first, ToolProgress) and first.status == "notice"
    assert "approvals and questions cannot reach this chat" in first.title
    assert "DSH UI" in first.title
    [(at, hint)] = [
        (t, e) for t, e in seen if isinstance(e, ToolProgress) and e.status == "waiting"
    ]
    assert isinstance(hint, ToolProgress) and hint.title.startswith("shell: waiting")
    assert "give it in the DSH UI" in hint.title
    assert at - started < 10
    assert text_of(events) == "approval: allowed-once"  # given in the DSH UI
    assert isinstance(events[-1], TurnEnd) and events[-1].error is None
    assert [e["event"] for e in logs if e["event"].startswith("turn_")].count(
        "turn_interactions_unavailable"
    ) == 1


async def test_polling_reads_back_over_a_burst_larger_than_one_window(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    long = " ".join(f"word{i:04d}" for i in range(300))  # ~190 chunk events at once
    with trio.fail_after(DEADLINE):
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            fake.mux_enabled = False
            sid = await h.create_session(title=None)
            answer = text_of(await run(h, sid, long))
    assert answer == "echo: " + long
    assert any("beforeSeq" in c.payload for c in fake.calls_to("session.history"))


async def test_a_prompt_the_host_does_not_confirm_is_not_sent_again(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            sid = await h.create_session(title=None)
            fake.slow_next("session.prompt", 45)
            with pytest.raises(HarnessError) as info:
                await run(h, sid, "slow to accept")
            await trio.sleep(60)
    assert info.value.code == "harness-result-uncertain"
    assert "may still be answered" in str(info.value)
    assert len(fake.calls_to("session.prompt")) == 1


async def test_a_session_the_host_lost_is_replaced_once(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE), structlog.testing.capture_logs() as logs:
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            sid = await h.create_session(title=None)
            del fake.sessions[sid]  # deleted in the host's own UI
            first = text_of(await run(h, sid, "still there?"))
            second = text_of(await run(h, sid, "and now?"))
    assert (first, second) == ("echo: still there?", "echo: and now?")
    assert len(fake.calls_to("session.create")) == 2
    new = [p["sessionId"] for p in fake.prompts()]
    assert new == [sid, new[1], new[1]] and new[1] != sid  # refused once, then the new one
    assert [e["event"] for e in logs].count("session_replaced") == 1


async def test_a_response_the_host_calls_bad_is_logged(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE), structlog.testing.capture_logs() as logs:
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            sid = await h.create_session(title=None)

            async def bad(ev: TurnEvent, events: list[TurnEvent]) -> None:
                if isinstance(ev, ApprovalRequest) and ev.reply is not None:
                    [rpc] = list(fake.pending)
                    await h._respond(rpc, {"sessionId": sid, "approvalId": "x", "outcome": "ok"})
                    await ev.reply("rejected")

            await watch(h, sid, "dsh:approve", bad)
    reasons = [e.get("reason") for e in logs if e["event"].startswith("interaction_response")]
    assert reasons == ["bad-response", None]


async def test_a_turn_returns_to_the_mux_when_it_is_back(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE), structlog.testing.capture_logs() as logs:
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            sid = await h.create_session(title=None)

            async def drop(ev: TurnEvent, events: list[TurnEvent]) -> None:
                if text_of(events) == "chunk 0 chunk 1 " and isinstance(ev, TextDelta):
                    await fake.close_mux()  # dropped; the host takes it back at once

            events = await watch(h, sid, "dsh:slow 8", drop)
    assert text_of(events) == "".join(f"chunk {i} " for i in range(8))
    follows = [(e["event"], e.get("reason")) for e in logs if e["event"].startswith("turn_events")]
    assert follows == [
        ("turn_events_streamed", None),
        ("turn_events_polled", "events mux lost"),
        ("turn_events_streamed", "events mux back"),
    ]
    assert fake.mux_opened == 2


def test_http_errors_are_harness_error_subtypes() -> None:
    assert isinstance(protocol.http_error("m", 401, b"", loopback=True), protocol.HostNotLoggedIn)
    assert isinstance(protocol.http_error("m", 403, b"", loopback=True), protocol.HostRefused)
    assert isinstance(protocol.http_error("m", 404, b"", loopback=True), protocol.HostTooOld)


async def test_an_oversized_or_deeply_nested_answer_is_an_error_not_a_crash(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        rpc = json.loads(request.content)["rpcId"]
        if request.url.path == "/api/host.describe":
            return httpx.Response(200, content=b'"' + b"x" * (33 * 1024 * 1024) + b'"')
        deep = "[" * 5000 + "]" * 5000
        nested = (
            f'{{"type":"server-response","rpcId":"{rpc}","result":{{"ok":true,"value":{deep}}}}}'
        )
        return httpx.Response(200, content=nested.encode())

    cfg = HarnessConfig(kind="dsh", base_url="http://dsh.test", workspace=str(tmp_path))
    client = httpx.AsyncClient(transport=httpx.MockTransport(answer))
    h = DshHarness(cfg, bot="b", client=client)
    with trio.fail_after(DEADLINE):
        with pytest.raises(HarnessError, match="larger than 32 MiB"):
            await h.check()
        with pytest.raises(HarnessError) as info:
            await h.list_models(None)
    assert info.value.code == "harness-response-invalid"
    await client.aclose()


async def test_a_question_answered_in_another_client_is_withdrawn_with_a_note(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            sid = await h.create_session(title=None)

            async def elsewhere(ev: TurnEvent, events: list[TurnEvent]) -> None:
                if isinstance(ev, QuestionRequest) and ev.withdrawn is not None:
                    [rpc] = list(fake.pending)
                    fake.resolve_elsewhere(rpc)
                    await ev.withdrawn()  # what the pipeline waits on

            events = await watch(h, sid, "dsh:ask", elsewhere)
    assert (
        text_of(events)
        == "(The question was answered in another client.)\n\nanswer: answered elsewhere"
    )
    assert not fake.calls_to("respond")


def test_a_message_without_a_turn_number_joins_the_open_or_the_next_turn() -> None:
    def user(seq: int) -> dict[str, Any]:
        return _ev(seq, "user/message", source={"rpcId": "mine"})

    open_turn = TurnTracker("mine")
    out = open_turn.feed(
        [
            _ev(1, "turn/start", turn=4),
            user(2),
            _chunk(3, "yes", turn=4),
            _ev(4, "turn/end", turn=4, reason="completed"),
        ]
    )
    assert out == [TextDelta("yes")] and open_turn.done

    queued = TurnTracker("mine")
    out = queued.feed(
        [
            _ev(1, "turn/start", turn=1),
            _chunk(2, "theirs", turn=1),
            _ev(3, "turn/end", turn=1, reason="completed"),
            user(4),  # queued: the host numbers turns, none is open
            _ev(5, "turn/start", turn=2),
            _chunk(6, "ours"),
            _ev(7, "turn/end", turn=2, reason="completed"),
        ]
    )
    assert out == [TextDelta("ours")] and queued.done

    unnumbered = TurnTracker("mine")
    out = unnumbered.feed(
        [
            user(1),
            _ev(2, "assistant/chunk", chunk={"type": "text-delta", "text": "plain"}),
            _ev(3, "turn/end", reason="completed"),
        ]
    )
    assert out == [TextDelta("plain")] and unnumbered.done


async def test_a_workspace_registered_with_a_trailing_slash_is_found(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_dsh() as fake:
            wid = fake.add_workspace(str(tmp_path) + "/")
            async with adapter(tmp_path, fake) as h:
                await h.create_session(title=None)
    assert not fake.calls_to("workspace.create")
    assert fake.calls_to("session.create")[0].payload == {"workspaceId": wid}


async def test_images_a_text_only_model_refuses_are_left_out_with_a_note(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_dsh() as fake, adapter(tmp_path, fake) as h:
            fake.images_refused = True
            sid = await h.create_session(title=None)
            image = ImagePart(mime="image/png", data=b"\x89PNG1234")
            answer = text_of(await run(h, sid, "look", images=[image]))
    first, second = fake.calls_to("session.prompt")
    assert first.rpc_id == second.rpc_id  # the same prompt, refused once
    assert len(second.payload["content"]) == 1
    assert answer.startswith("echo: look\n\n[1 image(s) attached by the user were left out")
