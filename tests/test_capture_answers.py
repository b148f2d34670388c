"""A capture of a bot that runs an agent (not echo) keeps the agent's answers, and replay
answers with them: ``dshim replay --check`` then compares the sends too, not only the
prompts.  The agent here is a scripted harness whose answers are not the prompt."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path

import trio

from dshim.harness.base import TurnContext
from dshim.model import PromptPart, TextDelta, TextPart, TurnEnd, TurnEvent
from tests.capture_kit import capturing
from tests.capture_kit import replay as _replay
from tests.channel_contract import RecordingHarness, final_texts
from tests.rig_telegram import TelegramRig


class ScriptedAgent(RecordingHarness):
    """Answers "Agent: <n> words" (not the prompt); "fail" fails with a partial text."""

    async def prompt(  # type: ignore[override]
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        self.prompts.append(list(parts))
        current = [p.text for p in parts if isinstance(p, TextPart)][-1].strip()
        if current == "fail":
            yield TextDelta("half an ans")
            yield TurnEnd(stop_reason="error", error="the agent lost its way")
            return
        yield TextDelta(f"Agent: {len(current.split())} words")
        yield TurnEnd()


async def test_a_capture_of_an_agent_replays_its_answers(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    rig = TelegramRig()
    harness = ScriptedAgent()
    agent = {"kind": "openai", "base_url": "http://127.0.0.1:9", "model": "m"}
    with trio.fail_after(600):
        cap = tmp_path / "cap"
        async with rig.open(), capturing(rig, tmp_path / "data", cap, harness, harness_table=agent):
            await rig.receiving()
            await rig.user_dm("how many words is this")
            await rig.wait_until(lambda: "Agent: 5 words" in final_texts(rig))
            await rig.user_dm("fail")
            lost = "agent lost its way"
            await rig.wait_until(lambda: any(lost in t for t in final_texts(rig)))
            await trio.sleep(5)
    [captured] = sorted((tmp_path / "cap").rglob("*.json"))
    fixture = json.loads(captured.read_bytes())
    [answers] = fixture["answers"].values()
    assert answers == [
        {"text": "Agent: 5 words"},
        {"text": "half an ans", "error": "the agent lost its way"},
    ]
    checked = _replay("--check", str(captured))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    lines = [json.loads(x) for x in _replay(str(captured)).stdout.splitlines()]
    sends = [x["text"] for x in lines if x["kind"] == "send"]
    assert sends == final_texts(rig)  # what the user saw live, replayed
