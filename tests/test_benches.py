"""The benchmark scripts still run end to end (tiny sizes; no speed is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.parametrize(
    ("script", "args", "prints"),
    [
        ("bench_pipeline.py", ["--events", "200", "--turn-events", "20"], "steps 1-7"),
        ("bench_telegram.py", ["--updates", "300", "--repeat", "1"], "verdicts: {'accepted'"),
        ("bench_discord.py", ["--dispatches", "100", "--repeat", "1"], "pipeline steps 1-6"),
        ("bench_webchat.py", ["--messages", "100", "--repeat", "1"], "pipeline steps 1-6"),
        ("bench_weixin.py", ["--messages", "200", "--repeat", "1"], "pipeline: reader"),
        ("bench_harness.py", ["--turns", "5", "--warmup", "1"], "time to first token"),
        ("bench_whatsapp.py", ["--posts", "100", "--repeat", "1"], "pipeline: handler"),
        ("bench_dingtalk.py", ["--messages", "100", "--repeat", "1"], "pipeline steps 1-6"),
        ("bench_wecom.py", ["--messages", "100", "--repeat", "1"], "pipeline steps 1-6"),
        ("bench_whatsapp_web.py", ["--messages", "100", "--repeat", "1"], "pipeline steps 1-6"),
    ],
)
def test_bench_script_runs_and_prints_its_figures(
    script: str, args: list[str], prints: str
) -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPTS / script), *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert prints in r.stdout and "floor" in r.stdout


@pytest.mark.parametrize(
    ("args", "prints"),
    [
        (
            ["--no-b1", "--sizes", "10,100", "--keys", "2000", "--samples", "50"]
            + ["--accepts", "100", "--events", "100", "--blocks", "2"],
            "a turn's store work per event",
        ),
        (["--soak", "3000", "--every", "1000", "--soak-chats", "50"], "retention soak: 3,000"),
    ],
)
def test_the_big_store_bench_runs_and_prints_its_tables(args: list[str], prints: str) -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench" / "big_store.py"), *args],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert prints in r.stdout and "| " in r.stdout
