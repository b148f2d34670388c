"""What the per-channel capture round trips share: run a rig's scripted conversation
under ``serve --capture`` (``tests.test_capture.capturing``), read what was captured, and
check the round trip (``dshim replay --check`` passes, prompts byte for byte the live
ones, no secret in any captured byte, 0700/0600)."""

from __future__ import annotations

import json
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from tests.channel_contract import ChannelRig, RecordingHarness
from tests.test_capture import _replay, capturing

Script = Callable[[], Awaitable[None]]


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
    files = sorted(cap.rglob("*.json"))
    assert files, "nothing captured"
    checked = _replay("--check", str(cap))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(files)} passed, 0 failed" in checked.stdout
    printed = _replay(str(cap))
    assert printed.returncode == 0, printed.stderr
    lines = [json.loads(x) for x in printed.stdout.splitlines()]
    replayed = sorted(x["text"] for x in lines if x["kind"] == "prompt")
    assert replayed == sorted(harness.texts())
    assert len(replayed) == prompts
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
