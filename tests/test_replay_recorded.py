"""Replaying a capture of a real agent: a fixture's ``answers`` (what the agent answered
live, per conversation, in turn order) are what replay delivers, so ``--check`` on such
a capture compares the sends too; without them replay echoes as always."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "fixtures" / "telegram" / "dm_text.json"


def replay(path: Path, *args: str) -> list[dict[str, object]]:
    done = subprocess.run(
        [sys.executable, "-m", "dshim", "replay", str(path), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def with_answers(tmp_path: Path, answers: object) -> Path:
    fixture = json.loads(BASE.read_text())
    fixture["answers"] = answers
    fixture.pop("expect", None)
    path = tmp_path / "captured.json"
    path.write_text(json.dumps(fixture))
    return path


def test_recorded_answers_are_what_replay_sends(tmp_path: Path) -> None:
    path = with_answers(tmp_path, {"42": [{"text": "Paris. It has been since 508."}]})
    lines = replay(path)
    prompt = next(x for x in lines if x["kind"] == "prompt")
    assert str(prompt["text"]).endswith("What is the capital of France?")
    sends = [x["text"] for x in lines if x["kind"] == "send"]
    assert sends == ["Paris. It has been since 508."]


def test_a_recorded_failure_fails_the_same_way_and_others_still_echo(tmp_path: Path) -> None:
    failed = with_answers(tmp_path, {"42": [{"text": "", "error": "the agent crashed"}]})
    [send] = [x for x in replay(failed) if x["kind"] == "send"]
    assert "the agent crashed" in str(send["text"])
    other = with_answers(tmp_path, {"7": [{"text": "not this chat"}]})
    [echoed] = [x for x in replay(other) if x["kind"] == "send"]
    assert str(echoed["text"]).endswith("What is the capital of France?")
