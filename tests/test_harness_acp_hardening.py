"""ACP hardening found behind real agents: session/close and resume, the agent mode, the
process group, the reader's log context, log-in errors and the agent's own commands.

Like ``test_harness_acp.py``: the real pipeline (a runtime on SQLite with a recording
outbound) and the real subprocess fake agent, on the real clock, each test under a
``trio.fail_after`` deadline.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import structlog
import trio

from dshim.channels.registry import parse_config
from dshim.harness import open_harness
from dshim.harness.acp import AcpHarness
from dshim.probe import ProbeRow, _harness_check
from tests.harness_rig import FAKE_AGENT, open_harness_rig, wait_until
from tests.helpers import Rig, msg
from tests.test_harness_acp import ask, methods

DEADLINE_S = 30.0


@asynccontextmanager
async def rig_with(
    tmp_path: Path,
    *flags: str,
    cfg: dict[str, Any] | None = None,
    **bot: Any,
) -> AsyncIterator[tuple[Rig, AcpHarness]]:
    workspace = tmp_path / "ws"
    workspace.mkdir(exist_ok=True)
    command = [
        *FAKE_AGENT,
        *flags,
        "--journal",
        str(tmp_path / "journal.jsonl"),
        "--sessions-file",
        str(tmp_path / "sessions.json"),
    ]
    harness_cfg = parse_config(
        {"harness": {"kind": "acp", "command": command, **(cfg or {})}}, env={}
    ).harness
    harness = AcpHarness(harness_cfg, bot="t", workspace=str(workspace), restart_backoff_s=0.05)
    async with open_harness(harness) as h:
        async with open_harness_rig(tmp_path / "data", harness=h, **bot) as rig:
            yield rig, h  # type: ignore[misc]


def open_sessions(tmp_path: Path) -> list[str]:
    path = tmp_path / "sessions.json"
    return json.loads(path.read_text()) if path.exists() else []


def streamed(rig: Rig) -> list[str]:
    """Every text the chat showed so far, streamed previews included."""
    return [u for s in rig.out.streams for u in s.updates] + rig.texts


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:
        return False


# --- session/close and resume ---------------------------------------------------------------


async def test_idle_conversations_close_their_sessions_and_the_next_message_resumes(
    tmp_path: Path,
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with rig_with(tmp_path, lanes={"idle_exit_s": 0.3}) as (rig, _):
            for i in range(20):
                await rig.rt.accept(
                    msg(f"remember {i}", conversation_id=f"c{i}", sender_id=f"c{i}")
                )
            await rig.rt.wait_idle()
            assert len(open_sessions(tmp_path)) == 20
            await wait_until(lambda: open_sessions(tmp_path) == [])
            closes = [m for m in methods(tmp_path) if m == "session/close"]
            answer = await ask(rig, "/recall", conversation_id="c7", sender_id="c7")
    assert len(closes) == 20
    assert answer == "recall: remember 7"  # resumed with its history
    assert methods(tmp_path).count("session/resume") == 1
    assert len(open_sessions(tmp_path)) == 1


async def test_new_closes_the_old_session(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with rig_with(tmp_path) as (rig, _):
            await ask(rig, "first")
            [old] = open_sessions(tmp_path)
            await ask(rig, "/new")
            assert open_sessions(tmp_path) == []
            answer = await ask(rig, "/recall")
    assert answer == "recall:"  # a fresh session
    assert old not in open_sessions(tmp_path)


async def test_agent_without_close_keeps_its_sessions(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with rig_with(tmp_path, "--no-close", lanes={"idle_exit_s": 0.2}) as (rig, _):
            await ask(rig, "first")
            await trio.sleep(1.0)
    assert "session/close" not in methods(tmp_path)
    assert len(open_sessions(tmp_path)) == 1


# --- the agent mode -------------------------------------------------------------------------


async def test_configured_mode_is_applied_to_new_and_resumed_sessions(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with rig_with(tmp_path, cfg={"mode": "Ask"}, lanes={"idle_exit_s": 0.3}) as (
            rig,
            h,
        ):
            first = await ask(rig, "/mode")
            await wait_until(lambda: open_sessions(tmp_path) == [])
            again = await ask(rig, "/mode")  # resumed: set again
            status = await ask(rig, "/status")
    assert first == again == "mode: ask"
    sets = [
        m
        for m in [
            json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()
        ]
        if m.get("method") == "session/set_config_option"
    ]
    assert [s["params"]["configId"] for s in sets] == ["mode", "mode"]
    assert all(s["params"]["value"] == "ask" for s in sets)
    assert "mode ask, as the agent reports it ([harness] mode = 'Ask')" in status
    assert h.mode == "Ask"


async def test_status_before_any_session_does_not_claim_the_configured_mode(
    tmp_path: Path,
) -> None:
    with trio.fail_after(DEADLINE_S):
        async with rig_with(tmp_path, cfg={"mode": "Ask"}) as (rig, h):
            before = await h.check()  # the agent runs, no session was opened yet
            await ask(rig, "hello")
            after = await h.check()
    assert "mode not reported yet (no session opened; [harness] mode = 'Ask'" in before
    assert "mode ask, as the agent reports it" in after


async def test_a_chosen_model_is_applied_again_when_the_session_is_reopened(
    tmp_path: Path,
) -> None:
    """The agent forgets the model when an idle session is closed (as codex-acp does): the
    resumed session is switched back to the chat's choice before the next prompt."""
    with trio.fail_after(DEADLINE_S):
        async with rig_with(tmp_path, lanes={"idle_exit_s": 0.3}) as (rig, _):
            await ask(rig, "hello")
            await ask(rig, "/model fake-large")
            chosen = await ask(rig, "first")
            await wait_until(lambda: open_sessions(tmp_path) == [])
            again = await ask(rig, "after the idle close")
    assert chosen == "[fake-large] echo: first"
    assert again == "[fake-large] echo: after the idle close"
    journal = [json.loads(line) for line in (tmp_path / "journal.jsonl").read_text().splitlines()]
    methods = [m.get("method") for m in journal]
    resumed = methods.index("session/resume")
    sets = [
        i
        for i, m in enumerate(journal)
        if m.get("method") == "session/set_config_option" and m["params"].get("configId") == "model"
    ]
    assert len(sets) == 2 and sets[1] > resumed
    assert methods.index("session/prompt", resumed) > sets[1]


async def test_the_idle_close_record_names_its_conversation(tmp_path: Path) -> None:
    with (
        trio.fail_after(DEADLINE_S),
        structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars]
        ) as logs,
    ):
        async with rig_with(tmp_path, lanes={"idle_exit_s": 0.3}) as (rig, _):
            await ask(rig, "hello")
            await wait_until(lambda: open_sessions(tmp_path) == [])
    [closed] = [e for e in logs if e["event"] == "agent_session_closed"]
    assert closed["reason"] == "idle"
    assert closed["conversation"] == msg("x").conversation_id


async def test_unknown_mode_is_logged_and_the_turn_still_runs(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S), structlog.testing.capture_logs() as logs:
        async with rig_with(tmp_path, cfg={"mode": "yolo"}) as (rig, _):
            answer = await ask(rig, "/mode")
    assert answer == "mode: auto"
    [warning] = [e for e in logs if e["event"] == "agent_mode_ignored"]
    assert warning["available"] == ["auto", "ask", "plan"]


async def test_probe_lists_the_modes(tmp_path: Path) -> None:
    workspace = tmp_path / "ws"
    workspace.mkdir()
    rows: dict[str | None, list[ProbeRow]] = {}
    with trio.fail_after(DEADLINE_S):
        for mode in (None, "plan", "yolo"):
            raw: dict[str, Any] = {"kind": "acp", "command": FAKE_AGENT, "cwd": str(workspace)}
            if mode:
                raw["mode"] = mode
            config = parse_config(
                {"dshim": {"data_dir": str(tmp_path / "d")}, "harness": raw}, env={}
            )
            rows[mode] = []
            await _harness_check(config, rows[mode])
    row = {m: next(r for r in rs if r.check == "harness: mode") for m, rs in rows.items()}
    assert row[None].result == "warn" and "available: auto, ask, plan" in row[None].detail
    assert row["plan"].result == "ok" and row["plan"].detail.startswith("plan")
    assert row["yolo"].result == "fail" and "'yolo' is not offered" in row["yolo"].detail


# --- process group --------------------------------------------------------------------------


async def test_agent_children_do_not_outlive_a_crash(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with rig_with(tmp_path) as (rig, _):
            answer = await ask(rig, "/child crash")
            pid = int(answer.split("child ", 1)[1].split()[0])
            await wait_until(lambda: not alive(pid))
            after = await ask(rig, "still there?")
    assert after == "echo: still there?"


def escaped(rig: Rig) -> list[int]:
    """The pids of the ``/escape`` tools the chat was told of, in order."""
    pids = [int(t.split("escaped ", 1)[1].split()[0]) for t in streamed(rig) if "escaped " in t]
    return list(dict.fromkeys(pids))


async def test_a_tool_in_its_own_session_does_not_outlive_a_stopped_turn(tmp_path: Path) -> None:
    """The agent answers the cancel but leaves its tool (started with setsid, outside its
    process group) running: dshim ends it after the grace; the agent itself goes on."""
    with trio.fail_after(DEADLINE_S), structlog.testing.capture_logs() as logs:
        async with rig_with(tmp_path) as (rig, h):
            await ask(rig, "hello")
            agent_pid = h.pid
            await rig.rt.accept(msg("/escape"))
            await wait_until(lambda: len(escaped(rig)) == 1)
            [tool] = escaped(rig)
            assert os.getpgid(tool) != agent_pid  # outside the agent's group
            await rig.rt.accept(msg("/stop"))
            await rig.rt.wait_idle()
            stopped = trio.current_time()
            await wait_until(lambda: not alive(tool))
            ended_after = trio.current_time() - stopped
            after = await ask(rig, "still there?")
            assert h.pid == agent_pid  # the agent was not restarted
    assert after == "echo: still there?"
    assert ended_after < 10
    [ended] = [e for e in logs if e["event"] == "agent_strays_ended"]
    assert ended["pids"] == [tool] and "stopped" in ended["why"]


async def test_a_tool_in_its_own_session_does_not_outlive_the_agent(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with rig_with(tmp_path) as (rig, _):
            answer = await ask(rig, "/escape crash")
            [tool] = escaped(rig)
            assert "exit status 3" in answer
            await wait_until(lambda: not alive(tool))
            assert await ask(rig, "after") == "echo: after"


async def test_tools_the_agent_still_runs_for_another_turn_are_left_alone(
    tmp_path: Path,
) -> None:
    """Stopping one chat's turn while another chat's turn runs: nothing is ended (whose
    tool it is cannot be told apart)."""
    other = msg("/escape", conversation_id="77")
    with trio.fail_after(DEADLINE_S):
        async with rig_with(tmp_path) as (rig, _):
            await rig.rt.accept(other)
            await wait_until(lambda: len(escaped(rig)) == 1)
            await rig.rt.accept(msg("/slow 50 100"))
            await wait_until(lambda: any("chunk 1" in t for t in streamed(rig)))
            await rig.rt.accept(msg("/stop"))
            await trio.sleep(4)  # past the grace
            [tool] = escaped(rig)
            assert alive(tool)
            await rig.rt.accept(msg("/stop", conversation_id="77"))
            await wait_until(lambda: not alive(tool))


async def test_agent_children_do_not_outlive_a_stop_timeout_or_shutdown(tmp_path: Path) -> None:
    def children(rig: Rig) -> list[int]:
        pids = [int(t.split("child ", 1)[1].split()[0]) for t in streamed(rig) if "child " in t]
        return list(dict.fromkeys(pids))

    with trio.fail_after(DEADLINE_S):
        async with rig_with(tmp_path) as (rig, h):
            h.cancel_timeout_s = 0.5
            await rig.rt.accept(msg("/child"))
            await wait_until(lambda: len(children(rig)) == 1)
            await rig.rt.accept(msg("/stop"))
            await rig.rt.wait_idle()
            [first] = children(rig)
            await wait_until(lambda: not alive(first))  # the stop timed out: group ended
            await rig.rt.accept(msg("/child"))
            await wait_until(lambda: len(children(rig)) == 2)
        second = children(rig)[1]
        with trio.fail_after(5):
            await wait_until(lambda: not alive(second))  # shutdown ended the group


# --- log context ----------------------------------------------------------------------------


async def test_crash_logs_name_the_running_turn_not_the_one_that_spawned_the_agent(
    tmp_path: Path,
) -> None:
    with (
        trio.fail_after(DEADLINE_S),
        structlog.testing.capture_logs(
            processors=[structlog.contextvars.merge_contextvars]
        ) as logs,
    ):
        async with rig_with(tmp_path) as (rig, _):
            await ask(rig, "spawns the agent")
            await ask(rig, "/crash")
    started = [e["turn"] for e in logs if e["event"] == "turn_started"]
    first, second = started
    failed = [e for e in logs if e["event"] in ("agent_failed", "agent_turn_failed")]
    assert failed and all(e.get("turn") != first for e in failed)
    assert [e.get("turn") for e in failed if e["event"] == "agent_turn_failed"] == [second]


# --- log in ---------------------------------------------------------------------------------


async def test_login_required_names_the_methods_and_the_command(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with rig_with(tmp_path, "--auth-required") as (rig, _):
            answer = await ask(rig, "hello")
    assert "not logged in on the host" in answer
    assert "Log in with Fake — Run `fake-agent login` in a terminal" in answer
    assert "send your message again" in answer


# --- agent commands -------------------------------------------------------------------------


async def test_agent_commands_are_listed_and_reachable_with_agent(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE_S):
        async with rig_with(tmp_path) as (rig, _):
            await ask(rig, "hello")  # the agent advertises its commands on session/new
            help_text = await ask(rig, "/help")
            ours = await ask(rig, "/status")
            theirs = await ask(rig, "/agent status")
            usage = await ask(rig, "/agent")
            passed = await ask(rig, "/compact now")  # no dshim command of that name
    assert "The agent's own commands (/agent <command> [args] runs one" in help_text
    assert "\n/agent status — Show the agent's own status\n" in help_text
    assert "/compact — Compact the conversation" in help_text
    assert ours.startswith("Harness (acp): reachable")
    assert theirs == "agent status: fine"
    assert usage.startswith("Usage: /agent <command>")
    assert passed == "compacted: now"  # the command as the prompt's first block


def test_child_pid_helper_sees_this_process() -> None:
    assert alive(os.getpid())


def test_login_text_names_the_agents_own_login_command() -> None:
    from dshim.harness.acp.protocol import AuthMethod, auth_methods, login_text

    methods = auth_methods(
        [
            {
                "id": "claude-login",
                "name": "Log in with Claude",
                "description": "Run `claude /login`",
            },
            7,
        ]
    )
    assert methods == (AuthMethod("claude-login", "Log in with Claude", "Run `claude /login`"),)
    text = login_text(methods, ["/usr/local/bin/claude-agent-acp"])
    assert "run `claude /login` on the host" in text
    assert "run `codex login` on the host" in login_text(methods, ["npx", "codex-acp"])
    assert "log the agent in on the host" in login_text(methods, ["my-agent"])
    # Started through node: the package folder in the script's path names the agent.
    node = ["node", "/usr/lib/node_modules/@agentclientprotocol/codex-acp/dist/index.js"]
    assert "run `codex login` on the host" in login_text(methods, node)
    claude = ["/usr/bin/node", "/opt/claude-agent-acp/dist/index.js", "--cwd", "/home/codex"]
    assert "run `claude /login` on the host" in login_text(methods, claude)
    assert "log the agent in" in login_text(methods, ["node", "/srv/agents/mine/index.js"])
