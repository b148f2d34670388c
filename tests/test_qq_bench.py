"""``scripts/bench_qq.py`` still runs end to end (tiny sizes; no speed is asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench_qq.py"


def test_bench_qq_runs_and_prints_its_figures() -> None:
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--dispatches", "100", "--repeat", "1"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "pipeline steps 1-6" in r.stdout and "floor" in r.stdout
    assert "nonebot-adapter-qq" in r.stdout
