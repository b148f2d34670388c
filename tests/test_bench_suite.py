"""The side-by-side suite (scripts/bench/run.py) runs end to end in its smallest
configuration: dshim only, no peer installed, bounded counts; no speed is asserted, only
that each scenario's table comes out with every event answered once."""

from __future__ import annotations

import json
import subprocess
import sys
import zlib
from pathlib import Path

import trio_websocket

from dshim.testing.fakes.discord import open_fake_discord

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


def test_b1_with_capture_runs_dshim_with_capture_off_and_on_side_by_side() -> None:
    out = suite("--only", "B1-capture", "--updates", "60")
    title = "B1 saturated echo, capture off and on, 60 updates, 200 chats"
    off = row(out, title, "dshim")
    on = row(out, title, "dshim+capture")
    # candidate, events/s, CPU ms/event, capture MB, RSS, dupes, order, answered
    assert off[3] == "—" and float(on[3]) > 0, (off, on)  # only the second one captured
    for cells in (off, on):
        assert cells[5:8] == ["0", "yes", "60/60"], cells
        assert float(cells[2]) > 0, cells


async def test_the_fake_discord_compresses_the_gateway_when_the_client_asks() -> None:
    """hikari connects with ``compress=zlib-stream`` (as Discord's clients do by default):
    every frame then comes binary, from one zlib stream, each ending in a sync flush."""
    async with open_fake_discord(token="t") as fake:
        url = f"{fake.gateway_url}/?v=10&encoding=json&compress=zlib-stream"
        async with trio_websocket.open_websocket_url(url) as ws:
            inflate = zlib.decompressobj()
            hello = await ws.get_message()
            assert isinstance(hello, bytes) and hello.endswith(b"\x00\x00\xff\xff")
            assert json.loads(inflate.decompress(hello))["op"] == 10
            await ws.send_message(json.dumps({"op": 1, "d": None}))
            ack = await ws.get_message()
            assert isinstance(ack, bytes) and ack.endswith(b"\x00\x00\xff\xff")
            assert json.loads(inflate.decompress(ack)) == {"op": 11}
        async with trio_websocket.open_websocket_url(f"{fake.gateway_url}/?v=10") as ws:
            plain = await ws.get_message()
            assert isinstance(plain, str) and json.loads(plain)["op"] == 10


def test_b8_runs_many_bots_against_one_fake_and_prints_the_slope() -> None:
    out = suite("--only", "B8", "--quick", "--updates", "40", "--b8-sizes", "1,3")
    title = "B8 many Telegram bots, one fake Bot API, idle 5 s, then 40 updates"
    for bots in ("1", "3"):
        cells = next(
            [c.strip() for c in line.strip().strip("|").split("|")]
            for line in out.split(f"### {title}", 1)[1].splitlines()
            if line.startswith("| dshim | " + bots + " |")
        )
        # candidate, bots, start ms, CPU s, RSS, descriptors, CPU %, events/s, vs 1 bot,
        # CPU ms/event, lost, dupes, order
        assert cells[10:13] == ["0", "0", "yes"], cells
        assert float(cells[4]) > 10 and int(cells[5]) >= int(bots), cells
    assert "Slope (idle RSS" in out and "1 -> 3 bots:" in out
