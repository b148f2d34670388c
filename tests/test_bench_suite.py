"""The side-by-side suite (scripts/bench/run.py) runs end to end in its smallest
configuration: dshim only, no peer installed, bounded counts; no speed is asserted, only
that each scenario's table comes out with every event answered once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

RUN = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "run.py"


def suite(*args: str) -> str:
    r = subprocess.run(
        [sys.executable, str(RUN), "--no-install", "--reps", "1", "--candidates", "dshim", *args],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def row(out: str, title: str, first_cell: str) -> list[str]:
    """The cells of the table row starting with ``first_cell`` under the heading ``title``."""
    section = out.split(f"### {title}", 1)[1].split("###", 1)[0]
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells and cells[0] == first_cell:
            return cells
    raise AssertionError(f"no {first_cell!r} row under {title!r}:\n{out}")


def test_b1_and_the_soak_answer_every_update_once_and_report_rss() -> None:
    out = suite("--only", "B1,B7", "--updates", "60", "--soak", "300")
    assert "nproc " in out and "dshim " in out
    b1 = row(out, "B1 saturated echo, 60 updates, 200 chats", "dshim")
    assert b1[4:7] == ["0", "yes", "60/60"], b1  # dupes, order, answered
    soak = row(out, "B7 soak: 300 events", "dshim")
    assert soak[1] == "300/300" and soak[6] == "0", soak
    samples = soak[3].split()
    assert len(samples) == 10 and all(float(s) > 10 for s in samples), soak
