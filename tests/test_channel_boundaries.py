"""Channels use only the contract: ``dshim.channels.base``, the kit, the network floor
(``dshim.net``), the native-stream engine (``dshim.streams``), the model, errors and
render — never serve, probe, replay, the pipeline or a harness — and ``protocol.py`` is
sans-IO.  Checked on the import graph of a fresh interpreter and on the source."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from dshim.channels.base import Channel
from dshim.channels.registry import load_channel

PACKAGE = Path(__file__).resolve().parents[1] / "dshim" / "channels"
CHANNELS = sorted(p.name for p in PACKAGE.iterdir() if (p / "channel.py").is_file())
ALLOWED_DSHIM = (
    "dshim.channels.base",
    "dshim.channels.spec",
    "dshim.channels.kit",
    "dshim.net",
    "dshim.streams",
    "dshim.model",
    "dshim.errors",
)
ALLOWED_EXACT = {"dshim", "dshim.render", "dshim.channels.kit", "dshim.net", "dshim.streams"}
FORBIDDEN_LOADED = (
    "dshim.serve",
    "dshim.probe",
    "dshim.replay",
    "dshim.pipeline",
    "dshim.harness",
    "dshim.cli",
    "dshim.store.sqlite",
)
IO_MODULES = {"trio", "httpx", "trio_websocket", "socket", "time", "asyncio"}


def test_both_working_channels_are_found() -> None:
    assert {"telegram", "discord"} <= set(CHANNELS)


@pytest.mark.parametrize("key", CHANNELS)
def test_load_channel_returns_the_typed_channel(key: str) -> None:
    channel = load_channel(key)
    assert isinstance(channel, Channel) and channel.key == key


@pytest.mark.parametrize("key", CHANNELS)
def test_importing_a_channel_pulls_in_no_serve_probe_replay_pipeline_or_harness(key: str) -> None:
    code = (
        "import sys\n"
        f"import dshim.channels.{key}.channel\n"
        "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('dshim'))))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    loaded = r.stdout.split()
    assert f"dshim.channels.{key}.channel" in loaded
    bad = [m for m in loaded if m.startswith(FORBIDDEN_LOADED)]
    assert bad == []


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("key", CHANNELS)
def test_channel_modules_import_only_the_contract(key: str) -> None:
    own = f"dshim.channels.{key}"
    for path in sorted((PACKAGE / key).glob("*.py")):
        for name in _imports(path):
            if not name.startswith("dshim"):
                continue
            ok = (
                name in ALLOWED_EXACT
                or name == own
                or name.startswith(own + ".")
                or name.startswith(ALLOWED_DSHIM)
            )
            assert ok, f"{path.relative_to(PACKAGE)} imports {name}"


@pytest.mark.parametrize("key", CHANNELS)
def test_protocol_is_sans_io(key: str) -> None:
    path = PACKAGE / key / "protocol.py"
    io = [n for n in _imports(path) if n.split(".")[0] in IO_MODULES]
    assert io == [], f"{path.name} imports {io}"
