"""The ACP adapter end to end: the real pipeline, the real subprocess fake agent.

``python -m dshim.testing.fakes.acp_agent`` speaks ACP v1 over stdio; its behaviour is
picked by the prompt text (``/slow``, ``/approve``, ``/crash`` ...) and launch flags.  With
``--journal`` it records every message it received, which is how these tests see what
dshim sent on the wire.  Real subprocesses need the real clock: every test runs under a
``trio.fail_after`` deadline so a hang fails fast.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from dshim.channels.registry import parse_config
from dshim.harness import open_harness
from dshim.harness.acp import IMAGES_REFUSED, AcpHarness
from dshim.model import MediaRef
from dshim.pipeline.turn import STOPPED_MARK
from dshim.probe import ProbeRow, _harness_check
from tests.harness_rig import FAKE_AGENT, open_harness_rig, wait_until
from tests.helpers import Rig, msg

DEADLINE_S = 20.0
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 10


def journal(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "journal.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def methods(tmp_path: Path) -> list[str]:
    return [m.get("method", "<response>") for m in journal(tmp_path)]


@asynccontextmanager
async def acp_rig(
    tmp_path: Path,
    *flags: str,
    harness_cfg: dict[str, Any] | None = None,
    **harness_kw: Any,
) -> AsyncIterator[tuple[Rig, AcpHarness]]:
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    command = [*FAKE_AGENT, *flags, "--journal", str(tmp_path / "journal.jsonl")]
    cfg = parse_config({"harness": {"kind": "acp", "command": command}}, env={}).harness
    harness_kw.setdefault("restart_backoff_s", 0.05)
    async with open_harness(AcpHarness(cfg, bot="t", workspace=str(workspace), **harness_kw)) as h:
        async with open_harness_rig(tmp_path / "data", harness=h, harness_cfg=harness_cfg) as rig:
            yield rig, h  # type: ignore[misc]


async def ask(rig: Rig, text: str, **kw: Any) -> str:
    """Send a message and wait until the bot is idle; returns the last text sent."""
    await rig.rt.accept(msg(text, **kw))
    await rig.rt.wait_idle()
    return rig.texts[-1]


async def presented(rig: Rig, needle: str) -> str:
    await wait_until(lambda: any(needle in t for t in rig.texts))
    return next(t for t in rig.texts if needle in t)


# -- streaming ----------------------------------------------------------------------------------


async def test_streamed_answer_in_the_workspace(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            answer = await ask(rig, "hello there, agent of mine")
    assert answer == "echo: hello there, agent of mine"
    updates = rig.out.streams[0].updates
    assert len(updates) >= 2 and updates[-1] == answer  # streamed in pieces, in order
    assert all(answer.startswith(u) for u in updates)
    new = next(m for m in journal(tmp_path) if m.get("method") == "session/new")
    assert new["params"]["cwd"] == str(tmp_path / "ws")
    init = next(m for m in journal(tmp_path) if m.get("method") == "initialize")
    assert init["params"]["protocolVersion"] == 1
    prompt = next(m for m in journal(tmp_path) if m.get("method") == "session/prompt")
    blocks = prompt["params"]["prompt"]
    assert blocks[-1] == {"type": "text", "text": "hello there, agent of mine"}
    assert blocks[0]["text"].startswith("<dsh_im_source>")


async def test_tool_calls_and_plan_show_as_progress(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            assert await ask(rig, "/tool pytest") == "tool pytest done"
            assert await ask(rig, "/plan") == "plan done"
    assert rig.out.streams[0].progress_notes == [
        "pytest (pending)",
        "pytest (in_progress)",
        "pytest (completed)",
    ]
    assert rig.out.streams[1].progress_notes == [
        "Plan: read (0/3 done)",
        "Plan: write (1/3 done)",
        "Plan: test (2/3 done)",
    ]


# -- approvals and questions -----------------------------------------------------------------------


async def test_approval_answered_with_a_number_goes_back_to_the_agent(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            await rig.rt.accept(msg("/approve Write notes.txt"))
            shown = await presented(rig, "🔐")
            await rig.rt.accept(msg("2"))
            await rig.rt.wait_idle()
    assert shown.startswith("🔐 The agent asks for permission: Write notes.txt")
    assert "1. Allow once\n2. Always allow\n3. Reject\n4. Never allow" in shown
    assert '"path": "/tmp/fake.txt"' in shown
    assert "✅ Approved: Always allow." in rig.texts
    assert rig.texts[-1] == "permission: allow-always"
    answer = next(m for m in journal(tmp_path) if "result" in m and "outcome" in m["result"])
    assert answer["result"] == {"outcome": {"outcome": "selected", "optionId": "allow-always"}}


async def test_approval_answered_in_chinese(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            await rig.rt.accept(msg("/approve"))
            await presented(rig, "🔐")
            await rig.rt.accept(msg(" 批准 "))
            await rig.rt.wait_idle()
            assert rig.texts[-1] == "permission: allow-once"
            await rig.rt.accept(msg("/approve"))
            await wait_until(lambda: sum("🔐" in t for t in rig.texts) == 2)
            await rig.rt.accept(msg("拒绝"))
            await rig.rt.wait_idle()
    assert rig.texts[-1] == "permission: reject-once"


async def test_wrong_user_in_a_group_cannot_approve(tmp_path: Path) -> None:
    group: dict[str, Any] = {
        "conversation_type": "group",
        "conversation_id": "-7",
        "addressed": True,
    }
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            await rig.rt.accept(msg("/approve", sender_id="1", sender_name="Ada", **group))
            await presented(rig, "🔐")
            await rig.rt.accept(msg("yes", sender_id="2", sender_name="Bob", **group))
            await wait_until(
                lambda: any("Only Ada" in t and "can answer it" in t for t in rig.texts)
            )
            await rig.rt.accept(msg("no", sender_id="1", **group))
            await rig.rt.wait_idle()
    assert rig.texts[-1] == "permission: reject-once"
    outcomes = [
        m["result"] for m in journal(tmp_path) if "result" in m and "outcome" in m["result"]
    ]
    assert outcomes == [{"outcome": {"outcome": "selected", "optionId": "reject-once"}}]


async def test_quoted_yes_does_not_approve(tmp_path: Path) -> None:
    """Only the reply's own text answers: a quoted "yes" is never the answer."""
    from dshim.model import ReplyReference

    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            await rig.rt.accept(msg("/approve"))
            await presented(rig, "🔐")
            quoting = ReplyReference(message_id="5", content="yes")
            await rig.rt.accept(msg("what about this?", reply_to=quoting))
            await trio.sleep(0.3)
            assert not any(t.startswith("permission:") for t in rig.texts)
            await rig.rt.accept(msg("1"))
            await rig.rt.wait_idle()
    assert [t for t in rig.texts if t.startswith("permission:")] == ["permission: allow-once"]
    assert rig.texts[1].startswith("That is not an answer to the pending request.")


async def test_a_reply_whose_own_text_is_yes_approves(tmp_path: Path) -> None:
    from dshim.model import ReplyReference

    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            await rig.rt.accept(msg("/approve"))
            await presented(rig, "🔐")
            prompt = ReplyReference(message_id="5", content="🔐 permission needed")
            await rig.rt.accept(msg("yes", reply_to=prompt))
            await rig.rt.wait_idle()
    assert [t for t in rig.texts if t.startswith("permission:")] == ["permission: allow-once"]
    assert not any(t.startswith("echo:") for t in rig.texts)


async def test_unanswered_approval_is_rejected_after_the_timeout(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path, harness_cfg={"interaction_timeout_s": 0.5}) as (rig, _):
            answer = await ask(rig, "/approve")
    assert any(t.startswith("⌛ No answer within 0.5 seconds") for t in rig.texts)
    assert answer == "permission: reject-once"


async def test_elicitation_form_is_asked_one_field_at_a_time(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            assert await ask(rig, "hi")  # warm up the process
            await rig.rt.accept(msg("/ask3"))
            first = await presented(rig, "(1/3)")
            await rig.rt.accept(msg("1"))
            second = await presented(rig, "(2/3)")
            await rig.rt.accept(msg("1, 3"))
            third = await presented(rig, "(3/3)")
            await rig.rt.accept(msg("extra cheese"))
            await rig.rt.wait_idle()
    assert first.startswith("❓ A quick question\n(1/3) Favourite colour")
    assert "1. Red\n2. Green\n3. Blue" in first and "your own answer" not in first
    assert "one or more numbers" in second
    assert "Anything else?" in third
    assert rig.texts[-1] == (
        'answers: {"colour": "red", "note": "extra cheese", "toppings": ["cheese", "olives"]}'
    )


async def test_elicitation_single_question(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            await rig.rt.accept(msg("/ask"))
            await presented(rig, "Favourite colour")
            await rig.rt.accept(msg("blue"))
            await rig.rt.wait_idle()
    assert rig.texts[-1] == 'answers: {"colour": "blue"}'
    assert "Answer sent: Blue." in rig.texts


# -- stop ----------------------------------------------------------------------------------------


async def test_stop_mid_stream_cancels_within_the_bound(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, h):
            await rig.rt.accept(msg("/slow 200 50"))
            await wait_until(lambda: bool(rig.out.streams) and len(rig.out.streams[0].updates) >= 2)
            pid = h.pid
            t0 = trio.current_time()
            await rig.rt.accept(msg("/stop"))
            await rig.rt.wait_idle()
            elapsed = trio.current_time() - t0
            assert await ask(rig, "still there?") == "echo: still there?"
            assert h.pid == pid  # a well-behaved agent is not restarted
    assert elapsed < 3.0  # the bound is 10 s; a cooperative agent stops at once
    stopped = rig.texts[0]
    assert stopped.startswith("chunk 1 chunk 2") and stopped.endswith(STOPPED_MARK)
    assert "session/cancel" in methods(tmp_path)


async def test_stop_while_waiting_for_approval_cancels_the_request(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            await rig.rt.accept(msg("/approve"))
            await presented(rig, "🔐")
            await rig.rt.accept(msg("/stop"))
            await rig.rt.wait_idle()
            await trio.sleep(0.1)
    assert rig.texts[-1] == STOPPED_MARK
    outcomes = [
        m["result"] for m in journal(tmp_path) if "result" in m and "outcome" in m["result"]
    ]
    assert outcomes == [{"outcome": {"outcome": "cancelled"}}]
    assert "session/cancel" in methods(tmp_path)


async def test_agent_that_ignores_cancel_is_abandoned_and_restarted(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path, cancel_timeout_s=1.0) as (rig, h):
            await rig.rt.accept(msg("/hang"))
            await wait_until(lambda: bool(rig.out.streams) and bool(rig.out.streams[0].updates))
            first_pid = h.pid
            t0 = trio.current_time()
            await rig.rt.accept(msg("/stop"))
            await rig.rt.wait_idle()
            elapsed = trio.current_time() - t0
            assert rig.texts[-1] == "hanging\n\n" + STOPPED_MARK
            assert await ask(rig, "are you back?") == "echo: are you back?"
            assert h.pid is not None and h.pid != first_pid
    assert 1.0 <= elapsed < 3.0
    assert h.spawn_count == 2


async def test_agent_crash_while_waiting_for_approval_fails_at_once(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            await rig.rt.accept(msg("/approve-crash"))
            await presented(rig, "Delete everything")
            await rig.rt.wait_idle()  # no answer needed: the request died with the agent
            failed = rig.texts[-1]
            assert await ask(rig, "2") == "echo: 2"  # not taken as an answer any more
    assert failed.startswith("⚠️ The agent failed: the agent process exited unexpectedly")
    assert len(rig.texts) == 3  # the request, one error reply, the next answer


async def test_agent_can_withdraw_its_request(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            answer = await ask(rig, "/approve-withdraw")
    assert answer == "withdrawn: error -32800"
    assert not rig.rt.interactions.pending(("42", ""))


# -- failures -----------------------------------------------------------------------------------


async def test_an_agent_killed_by_a_signal_is_said_so(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            killed = await ask(rig, "/crash kill")
            assert await ask(rig, "after") == "echo: after"
    assert "the agent process was killed by signal 9 (SIGKILL)" in killed
    assert "exit status" not in killed


async def test_agent_crash_gives_one_error_and_the_next_message_works(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, h):
            assert await ask(rig, "first") == "echo: first"
            crashed = await ask(rig, "/crash")
            assert len(rig.texts) == 2  # exactly one reply for the crashed turn
            assert await ask(rig, "second") == "echo: second"
    assert crashed.startswith("about to crash")
    assert "⚠️ The agent failed: the agent process exited unexpectedly (exit status 3)" in crashed
    assert h.spawn_count == 2
    # The new process resumed the bound session instead of starting a new one.
    sessions = [
        m["params"].get("sessionId")
        for m in journal(tmp_path)
        if m.get("method") == "session/prompt"
    ]
    assert len(set(sessions)) == 1
    assert "session/resume" in methods(tmp_path)


async def test_malformed_line_fails_the_turn_and_restarts(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, h):
            bad = await ask(rig, "/garbage")
            assert len(rig.texts) == 1
            assert await ask(rig, "ok now?") == "echo: ok now?"
    assert bad.startswith("before garbage")
    assert "the agent sent a malformed message" in bad
    assert h.spawn_count == 2


async def test_response_with_unknown_id_fails_the_turn_and_restarts(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, h):
            bad = await ask(rig, "/unknown-id")
            assert await ask(rig, "ok now?") == "echo: ok now?"
    assert "never sent" in bad and bad.count("⚠️") == 1
    assert h.spawn_count == 2


async def test_unsupported_agent_requests_get_an_error_not_a_hang(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            assert await ask(rig, "/clientreq") == "client answered: error -32601"


async def test_agent_errors_and_end_reasons_are_explained(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            auth = await ask(rig, "/error -32000")
            refused = await ask(rig, "/refuse")
            cut = await ask(rig, "/maxtokens")
    assert "needs to be logged in" in auth
    assert "refused" in refused
    assert cut.startswith("partial") and "output limit" in cut


async def test_a_cancelled_check_does_not_kill_a_slow_starting_agent(tmp_path: Path) -> None:
    cfg = parse_config({"harness": {"kind": "acp", "command": FAKE_AGENT}}, env={}).harness
    async with open_harness(AcpHarness(cfg, bot="t", workspace=str(tmp_path))) as h:
        assert isinstance(h, AcpHarness)
        with trio.fail_after(DEADLINE_S):
            async with trio.open_nursery() as nursery:
                # e.g. /status's 5 s deadline expiring while the agent starts
                nursery.start_soon(h.check)
                await wait_until(lambda: h.spawn_count == 1)
                nursery.cancel_scope.cancel()
            first_pid = h.pid
            detail = await h.check()
    assert "Fake ACP agent 1.0" in detail
    assert h.spawn_count == 1 and first_pid is not None and str(first_pid) in detail


async def test_missing_agent_binary_is_a_clear_error(tmp_path: Path) -> None:
    cfg = parse_config(
        {"harness": {"kind": "acp", "command": [str(tmp_path / "nope")]}}, env={}
    ).harness
    async with open_harness(AcpHarness(cfg, bot="t")) as h:
        with trio.fail_after(DEADLINE_S):
            async with open_harness_rig(tmp_path, harness=h) as rig:
                answer = await ask(rig, "hello")
    assert "cannot start the agent" in answer and "No such file" in answer


async def test_unsupported_protocol_version_is_refused(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path, "--protocol-version", "2") as (rig, h):
            answer = await ask(rig, "hello")
    assert "the agent speaks ACP protocol version 2; dshim speaks 1" in answer
    assert h.pid is None  # the process was shut down, not left running


# -- sessions across restarts ------------------------------------------------------------------------


async def test_session_load_replay_is_not_shown(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path, "--load-only") as (rig, _):
            await ask(rig, "first")
            await ask(rig, "/crash")
            answer = await ask(rig, "again")
    assert answer == "echo: again"
    assert "session/load" in methods(tmp_path) and "session/resume" not in methods(tmp_path)


async def test_without_load_a_restart_opens_a_new_session(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path, "--no-load") as (rig, _):
            await ask(rig, "first")
            await ask(rig, "/crash")
            assert await ask(rig, "again") == "echo: again"
            assert await ask(rig, "and again") == "echo: and again"
    assert methods(tmp_path).count("session/new") == 2


# -- images ------------------------------------------------------------------------------------------


async def _png(limit: int) -> bytes:
    return PNG


async def test_images_go_as_image_blocks(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            answer = await ask(
                rig, "what is this?", images=[MediaRef(kind="image", name="a.png", fetch=_png)]
            )
    assert answer == "echo: what is this?\nimage image/png 18 bytes"


async def test_images_are_refused_when_the_agent_cannot_read_them(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path, "--no-image") as (rig, _):
            answer = await ask(
                rig, "look", images=[MediaRef(kind="image", name="a.png", fetch=_png)]
            )
            assert await ask(rig, "text works") == "echo: text works"
    assert answer == IMAGES_REFUSED
    assert methods(tmp_path).count("session/prompt") == 1


# -- models and steering ----------------------------------------------------------------------------


async def test_models_via_config_options(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            listed = await ask(rig, "/models")
            chosen = await ask(rig, "/model 2")
            answer = await ask(rig, "hi")
            again = await ask(rig, "/models")
    assert listed == "Models:\n1. fake-small (current)\n2. fake-large"
    assert chosen == "Model set to fake-large."
    assert answer == "[fake-large] echo: hi"
    assert again == "Models:\n1. fake-small\n2. fake-large (current)"
    setting = next(m for m in journal(tmp_path) if m.get("method") == "session/set_config_option")
    assert setting["params"]["configId"] == "model" and setting["params"]["value"] == "fake-large"


async def test_models_via_legacy_set_model(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path, "--models", "legacy") as (rig, _):
            await ask(rig, "hello")
            chosen = await ask(rig, "/model fake-large")
            answer = await ask(rig, "hi")
            unknown = await ask(rig, "/model gpt-9")
    assert chosen == "Model set to fake-large."
    assert answer == "[fake-large] echo: hi"
    assert "unknown model 'gpt-9'" in unknown
    assert "session/set_model" in methods(tmp_path)


async def test_agent_without_models_says_so(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path, "--models", "none") as (rig, _):
            assert await ask(rig, "/models") == "This agent does not offer model selection."
            assert await ask(rig, "/model 1") == "This agent does not offer model selection."


async def test_steer_reaches_the_running_answer(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            await rig.rt.accept(msg("/slow 20 50"))
            await wait_until(lambda: bool(rig.out.streams) and bool(rig.out.streams[0].updates))
            await rig.rt.accept(msg("/steer go left"))
            await rig.rt.wait_idle()
    assert "Sent to the running answer." in rig.texts
    final = rig.out.streams[0].updates[-1]
    assert "[steer] go left" in final
    steering = next(m for m in journal(tmp_path) if m.get("method") == "_session/steering")
    assert steering["params"]["prompt"] == [{"type": "text", "text": "go left"}]
    assert steering["params"]["_meta"] == {"steering": {"idleBehavior": "promptRequired"}}


async def test_steer_without_the_extension_is_refused_not_queued(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path, "--no-steer") as (rig, _):
            await rig.rt.accept(msg("/slow 20 50"))
            await wait_until(lambda: bool(rig.out.streams) and bool(rig.out.streams[0].updates))
            await rig.rt.accept(msg("/steer go left"))
            await wait_until(lambda: any("not supported" in t for t in rig.texts))
            await rig.rt.accept(msg("/stop"))
            await rig.rt.wait_idle()
    assert "Steering is not supported by this agent; the message was not queued." in rig.texts
    assert len(rig.events.prompts) == 1
    assert "_session/steering" not in methods(tmp_path)


# -- probe -------------------------------------------------------------------------------------------


async def test_probe_lists_capabilities(tmp_path: Path) -> None:
    rows: list[ProbeRow] = []
    command = [*FAKE_AGENT, "--no-image", "--no-steer"]
    config = parse_config({"harness": {"kind": "acp", "command": command}}, env={})
    with trio.fail_after(DEADLINE_S):
        await _harness_check(config, rows)
    table = {r.check: (r.result, r.detail) for r in rows}
    assert table["harness"][0] == "ok" and "Fake ACP agent 1.0" in table["harness"][1]
    assert table["harness: image"][0] == "warn"
    assert table["harness: load session"] == (
        "ok",
        "sessions survive agent restarts (session/resume)",
    )
    assert table["harness: models"] == ("ok", "2: fake-small (current), fake-large")
    assert table["harness: steer"] == ("warn", "not supported by this agent")


# --- the sans-IO mapping (dshim.harness.acp.protocol) --------------------------------------


def test_message_chunks_of_a_new_agent_message_start_a_new_paragraph() -> None:
    from dshim.harness.acp.models import Update
    from dshim.harness.acp.protocol import UpdateState, event_for
    from dshim.model import TextDelta, ToolProgress

    state = UpdateState()
    chunk = {"type": "text", "text": "Hello"}
    events = [
        event_for(
            Update(session_update="agent_message_chunk", content=chunk, message_id="a"), state
        ),
        event_for(
            Update(session_update="agent_message_chunk", content=chunk, message_id="a"), state
        ),
        event_for(
            Update(session_update="agent_message_chunk", content=chunk, message_id="b"), state
        ),
        event_for(Update(session_update="tool_call", tool_call_id="t1", title="grep"), state),
        event_for(
            Update(session_update="tool_call_update", tool_call_id="t1", status="completed"), state
        ),
        event_for(Update(session_update="usage_update"), state),
    ]
    assert events == [
        TextDelta("Hello"),
        TextDelta("Hello"),
        TextDelta("\n\nHello"),
        ToolProgress(title="grep", status="pending", tool_id="t1"),
        ToolProgress(title="grep", status="completed", tool_id="t1"),
        None,
    ]


def test_prompt_outcomes_are_explained() -> None:
    import msgspec

    from dshim.harness.acp.models import CONNECTION_LOST, RpcError
    from dshim.harness.acp.protocol import end_event, prompt_outcome

    ok = prompt_outcome(
        None, msgspec.Raw(b'{"stopReason":"max_tokens"}'), cancelling=False, lost=CONNECTION_LOST
    )
    assert ok == ("max_tokens", None)
    assert end_event(*ok).error == "the answer was cut off: the model reached its output limit"
    lost = RpcError(code=CONNECTION_LOST, message="the agent process exited")
    assert prompt_outcome(lost, None, cancelling=False, lost=CONNECTION_LOST) == (
        None,
        "the agent process exited",
    )
    assert prompt_outcome(RpcError(code=-32603), None, cancelling=True, lost=CONNECTION_LOST) == (
        "cancelled",
        None,
    )
    auth = prompt_outcome(
        RpcError(code=-32000, message="x"), None, cancelling=False, lost=CONNECTION_LOST
    )
    assert auth[1] is not None and "logged in" in auth[1]
    assert prompt_outcome(None, msgspec.Raw(b"[1]"), cancelling=False, lost=CONNECTION_LOST)[1] == (
        "the agent sent an invalid session/prompt result"
    )


def test_a_form_is_asked_field_by_field_and_typed() -> None:
    from dshim.harness.acp.protocol import Form, form_fields

    schema = {
        "properties": {
            "count": {"type": "integer", "title": "How many"},
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}},
        },
        "required": ["count"],
    }

    async def nothing(*args: object) -> None:
        return None

    form = Form("Please fill in", form_fields(schema))
    first = form.question(reply=nothing, withdrawn=nothing)
    assert first.question == "Please fill in\n(1/3) How many" and first.allow_free_text
    assert form.answer([], "3") == "next"
    assert form.question(reply=nothing, withdrawn=nothing).options[0].label == "Yes"
    assert form.answer(["true"], None) == "next"
    assert form.question(reply=nothing, withdrawn=nothing).multi_select
    assert form.answer(["a", "b"], None) == "accept"
    assert form.content == {"count": 3, "ok": True, "tags": ["a", "b"]}
    assert Form("", form_fields(schema)).answer([], None) == "cancel"
