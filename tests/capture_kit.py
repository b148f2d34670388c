"""What the per-channel capture round trips share: run a rig's scripted conversation
under ``serve --capture`` (``tests.test_capture.capturing``), read what was captured, and
check the round trip (``dshim replay --check`` passes, prompts byte for byte the live
ones, no secret in any captured byte, 0700/0600)."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from dshim.capture import open_capture
from dshim.channels.registry import parse_config
from dshim.serve import serve_bots
from dshim.store import open_store
from tests.channel_contract import BOT, ChannelRig, RecordingHarness
from tests.helpers import Clock

Script = Callable[[], Awaitable[None]]
REPO = Path(__file__).resolve().parent.parent


@asynccontextmanager
async def capturing(
    rig: ChannelRig,
    data_dir: Path,
    capture_dir: Path,
    harness: RecordingHarness,
    *,
    harness_table: dict[str, Any] | None = None,
) -> AsyncIterator[None]:
    """The rig's bot under serve_bots with ``[dshim] capture_dir`` (and ``[harness]``
    as ``harness_table`` says, for what the capture reads of it; ``harness`` answers);
    leaving stops it and writes the capture."""
    table = {"name": BOT, "channel": rig.channel.key, **rig.bot_table()}
    doc: dict[str, Any] = {"dshim": {"capture_dir": str(capture_dir)}, "bots": [table]}
    if harness_table is not None:
        doc["harness"] = harness_table
    config = parse_config(doc, env={})
    clock = Clock()
    shutdown = trio.Event()
    done = trio.Event()
    async with (
        open_store(data_dir, inline=True) as store,
        open_capture(config, clock=clock, data_dir=data_dir, inline=True) as capture,
        trio.open_nursery() as nursery,
    ):
        assert capture is not None

        async def serve(task_status: trio.TaskStatus[None]) -> None:
            await serve_bots(
                config,
                store,
                shutdown=shutdown,
                channels={BOT: rig.channel},
                clock=clock,
                harness=harness,
                capture=capture,
                task_status=task_status,
            )
            done.set()

        await nursery.start(serve)
        try:
            yield
        finally:
            shutdown.set()
            with trio.fail_after(120):
                await done.wait()


def replay(*args: str) -> subprocess.CompletedProcess[str]:
    # Blocking on purpose: under the autojump clock a wait would jump to the deadline.
    return subprocess.run(  # noqa: ASYNC221
        [sys.executable, "-m", "dshim", "replay", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def replay_lines(cap: Path, harness: RecordingHarness) -> list[dict[str, Any]]:
    """``dshim replay --check`` passes on every captured file, and the prompts replay
    prints are byte for byte the ones ``harness`` received live; the printed lines."""
    files = sorted(cap.rglob("*.json"))
    assert files, "nothing captured"
    checked = replay("--check", str(cap))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(files)} passed, 0 failed" in checked.stdout
    printed = replay(str(cap))
    assert printed.returncode == 0, printed.stderr
    lines = [json.loads(x) for x in printed.stdout.splitlines()]
    replayed = sorted(x["text"] for x in lines if x["kind"] == "prompt")
    assert replayed == sorted(harness.texts())
    return lines


async def captured(
    rig: ChannelRig, tmp_path: Path, script: Callable[[RecordingHarness], Script]
) -> RecordingHarness:
    """Run ``script`` against the rig's bot with capture into ``tmp_path / "cap"``."""
    harness = RecordingHarness()
    async with rig.open(), capturing(rig, tmp_path / "data", tmp_path / "cap", harness):
        await rig.receiving()
        await script(harness)()
    return harness


def fixtures_of(cap: Path) -> dict[str, dict[str, Any]]:
    """Every captured file, decoded, by its conversation folder."""
    return {p.parent.name: json.loads(p.read_bytes()) for p in sorted(cap.rglob("*.json"))}


def captured_bytes(cap: Path) -> bytes:
    return b"".join(p.read_bytes() for p in sorted(cap.rglob("*")) if p.is_file())


def check_round_trip(
    cap: Path,
    harness: RecordingHarness,
    *,
    prompts: int,
    secrets: list[str],
    drops: set[str] | None = None,
) -> list[dict[str, Any]]:
    """``dshim replay --check`` passes on the capture, its prompts are the live ones byte
    for byte, the drop reasons are ``drops`` (None: at least a duplicate and an
    unaddressed one), no captured byte holds a secret, modes are private; the lines."""
    lines = replay_lines(cap, harness)
    assert len([x for x in lines if x["kind"] == "prompt"]) == prompts
    seen = {x["reason"] for x in lines if x["kind"] == "drop"}
    if drops is None:
        assert {"duplicate", "unaddressed"} <= seen, seen
    else:
        assert seen == drops, seen
    assert all(secrets), secrets
    data = captured_bytes(cap)
    assert not [s for s in secrets if s.encode() in data]
    for path in [cap, *cap.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    return lines
