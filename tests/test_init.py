"""``dshim init`` and the built-in default: what a newcomer's first configuration is.

The starter file must load exactly as written (the web chat and the echo harness), and a
platform block must load once uncommented with its environment variables set.  Loading
validates each bot's channel settings, so the ``webchat`` channel must be importable:
until it is part of this tree, a stand-in with no keys of its own takes its place
(:func:`webchat`); once the real channel exists, it is used.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import msgspec
import pytest

from dshim.channels.base import ChannelSettings, ChannelSpec
from dshim.channels.discord.channel import DiscordSettings
from dshim.channels.registry import (
    CHANNEL_KEYS,
    default_config,
    load_config,
    settings_for,
    starter_toml,
)
from dshim.channels.telegram.channel import TelegramSettings
from dshim.errors import ConfigError

TG_TOKEN = "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw"
PLATFORMS = [key for key in CHANNEL_KEYS if key != "webchat"]
STARTER_TOML = starter_toml()


class StandInSettings(ChannelSettings):
    """The web chat's settings until the real channel is merged: no keys of its own."""


@pytest.fixture
def webchat(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``load_channel("webchat")`` work (the real channel, else a stand-in)."""
    try:
        importlib.import_module("dshim.channels.webchat.channel")
    except ModuleNotFoundError as exc:
        if exc.name is None or not exc.name.startswith("dshim.channels.webchat"):
            raise

        async def never(*args: object, **kwargs: object) -> None:
            raise AssertionError("the stand-in web chat does not run")

        module = types.ModuleType("dshim.channels.webchat.channel")
        module.CHANNEL = ChannelSpec(  # type: ignore[attr-defined]
            key="webchat",
            settings=StandInSettings,
            run_fn=never,
            replay_fn=never,  # type: ignore[arg-type]
            probe_fn=never,
        )
        monkeypatch.setitem(sys.modules, "dshim.channels.webchat", types.ModuleType("x"))
        monkeypatch.setitem(sys.modules, "dshim.channels.webchat.channel", module)


def dshim(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DSHIM_CONFIG", "DSHIM_DATA_DIR")}
    return subprocess.run(
        [sys.executable, "-m", "dshim", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def uncomment_block(text: str, channel: str) -> str:
    """The file with the commented ``[[bots]]`` block of ``channel`` uncommented."""
    lines = text.splitlines()
    at = lines.index(f'# channel = "{channel}"')
    start = max(i for i in range(at) if lines[i] == "# [[bots]]")
    end = next(i for i in range(at, len(lines) + 1) if i == len(lines) or not lines[i])
    for i in range(start, end):
        assert lines[i].startswith("# "), lines[i]
        lines[i] = lines[i][2:]
    return "\n".join(lines) + "\n"


def swap_harness(text: str, kind: str) -> str:
    """The file with ``[harness]`` replaced by the commented example of ``kind``."""
    lines = text.splitlines()
    start = lines.index("[harness]")
    end = lines.index("", start)
    example_kind = lines.index(f'# kind = "{kind}"')
    ex_start = example_kind - 1
    assert lines[ex_start] == "# [harness]"
    ex_end = lines.index("", example_kind)
    example = [line[2:] for line in lines[ex_start:ex_end]]
    return "\n".join(lines[:start] + example + lines[end:]) + "\n"


def test_init_writes_a_starter_that_loads_as_written(tmp_path: Path, webchat: None) -> None:
    r = dshim("init", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    path = tmp_path / "dshim.toml"
    assert path.read_text() == STARTER_TOML
    assert "dshim serve" in r.stdout
    for table in ("[dshim]", "[http]", "[harness]", "[[bots]]"):
        assert any(line.startswith(table) for line in STARTER_TOML.splitlines()), table
    cfg = load_config(path, env={})
    assert cfg.harness.kind == "echo"
    assert (cfg.http.enabled, cfg.http.listen, cfg.http.token) == (True, "127.0.0.1:8910", None)
    assert [(b.name, b.channel, b.enabled) for b in cfg.bots] == [("web", "webchat", True)]
    # Nothing active needs the environment: every "${...}" is in a comment.
    assert all("${" not in line.split("#")[0] for line in STARTER_TOML.splitlines())


def test_every_platform_has_a_commented_block_naming_its_credentials() -> None:
    for key in PLATFORMS:
        block = uncomment_block(STARTER_TOML, key).split(f'channel = "{key}"')[1].split("\n\n")[0]
        names = re.findall(r"\$\{([A-Z0-9_]+)\}", block)
        fields = msgspec.structs.fields(settings_for(key))
        if not any("Secret" in str(f.type) for f in fields):
            # Linked by `dshim login` (WhatsApp Web): no credential in the file at all.
            assert names == [], (key, names)
            continue
        assert names and all(n.startswith(key.upper()) for n in names), (key, names)


@pytest.mark.parametrize(
    ("channel", "env", "settings"),
    [
        ("telegram", {"TELEGRAM_BOT_TOKEN": TG_TOKEN}, TelegramSettings),
        ("discord", {"DISCORD_BOT_TOKEN": "MTA.discord-test-token.x"}, DiscordSettings),
    ],
)
def test_an_uncommented_platform_block_loads_with_its_variables_set(
    tmp_path: Path, webchat: None, channel: str, env: dict[str, str], settings: type
) -> None:
    path = tmp_path / "dshim.toml"
    path.write_text(uncomment_block(STARTER_TOML, channel))
    cfg = load_config(path, env=env)
    assert [b.channel for b in cfg.bots] == ["webchat", channel]
    assert isinstance(cfg.bots[1].settings, settings)
    with pytest.raises(ConfigError, match=f"{next(iter(env))} is not set"):
        load_config(path, env={})


@pytest.mark.parametrize(
    ("kind", "env"),
    [("acp", {"GEMINI_API_KEY": "gemini-key-123"}), ("openai", {"DEEPSEEK_API_KEY": "sk-123456"})],
)
def test_the_commented_harness_examples_load(
    tmp_path: Path, webchat: None, kind: str, env: dict[str, str]
) -> None:
    path = tmp_path / "dshim.toml"
    path.write_text(swap_harness(STARTER_TOML, kind))
    cfg = load_config(path, env=env)
    assert cfg.harness.kind == kind


def test_init_never_overwrites_a_file(tmp_path: Path) -> None:
    path = tmp_path / "dshim.toml"
    path.write_text("# mine\n")
    r = dshim("init", cwd=tmp_path)
    assert r.returncode == 2
    assert "dshim.toml already exists" in r.stderr and "Traceback" not in r.stderr
    assert path.read_text() == "# mine\n"


def test_init_writes_where_it_is_told(tmp_path: Path, webchat: None) -> None:
    r = dshim("init", "conf/bots.toml", cwd=tmp_path)
    assert r.returncode == 2 and "cannot write it" in r.stderr  # no such directory
    (tmp_path / "conf").mkdir()
    r = dshim("init", "conf/bots.toml", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "--config conf/bots.toml" in r.stdout
    assert load_config(tmp_path / "conf" / "bots.toml", env={}).bots[0].channel == "webchat"


def test_the_built_in_default_is_the_web_chat_on_8910(webchat: None) -> None:
    cfg = default_config(env={})
    assert cfg.harness.kind == "echo"
    assert (cfg.http.enabled, cfg.http.listen, cfg.http.token) == (True, "127.0.0.1:8910", None)
    assert [(b.name, b.channel) for b in cfg.bots] == [("web", "webchat")]
    assert cfg.dshim.data_dir is None  # the default data directory
