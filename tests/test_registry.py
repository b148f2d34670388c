"""The channel registry is discovered: a channel package with a ``spec.py`` is in every list.

:mod:`dshim.channels.registry` finds the channels from their specs; the configuration,
``dshim init``, the log redactor, the docs generator, the tests' rigs, fakes and fixture
cases and the benches read their lists from it.  These tests check that each of them
holds every channel, that a new package with a spec joins them all without any other
edit (a channel written into a temporary directory, in a fresh interpreter), that the
specs stay light, and that no source file names the channels by hand again.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dshim import docs_config, log
from dshim.channels import registry
from dshim.channels.registry import CHANNEL_KEYS, SPECS, spec
from dshim.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
CHANNELS = REPO / "dshim" / "channels"


def test_every_channel_package_has_a_spec_and_is_registered() -> None:
    packages = {
        p.name
        for p in CHANNELS.iterdir()
        if (p / "__init__.py").is_file() and (p / "channel.py").is_file()
    }
    with_spec = {p.parent.name for p in CHANNELS.glob("*/spec.py")}
    assert packages == with_spec, "a channel package without spec.py, or a spec without channel"
    assert set(CHANNEL_KEYS) == with_spec
    assert len(CHANNEL_KEYS) == len(set(CHANNEL_KEYS))


def test_keys_follow_the_positions_and_every_spec_is_its_own() -> None:
    positions = [entry.position for entry in SPECS]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    for entry in SPECS:
        assert spec(entry.key) is entry
        assert entry.starter.endswith("\n") and not entry.starter.endswith("\n\n"), entry.key


def test_an_unknown_key_is_a_config_error_naming_the_keys_in_order() -> None:
    expected = f"unknown channel 'icq'; expected one of {', '.join(CHANNEL_KEYS)}"
    with pytest.raises(ConfigError) as spec_error:
        spec("icq")
    with pytest.raises(ConfigError) as load_error:
        registry.load_channel("icq")
    assert str(spec_error.value) == str(load_error.value) == expected


def test_the_configuration_knows_every_channel() -> None:
    assert registry.CATALOG.keys == CHANNEL_KEYS
    for key in CHANNEL_KEYS:
        assert registry.CATALOG.settings_for(key) is registry.load_channel(key).settings
    assert registry.CATALOG.webhook_only == {e.key: e.title for e in SPECS if e.webhook_only}


def test_the_starter_file_has_every_channel_block_in_order() -> None:
    text = registry.starter_toml()
    at = [text.index(entry.starter) for entry in SPECS]
    enabled = [a for a, e in zip(at, SPECS, strict=True) if e.starter_enabled]
    commented = [a for a, e in zip(at, SPECS, strict=True) if not e.starter_enabled]
    assert enabled == sorted(enabled) and commented == sorted(commented)
    assert max(enabled) < min(commented)
    for entry in SPECS:
        line = f'channel = "{entry.key}"'
        assert line in entry.starter.splitlines() or f"# {line}" in entry.starter.splitlines()


def test_every_log_token_pattern_keeps_one_named_group_and_is_used() -> None:
    names: list[str] = []
    for entry in SPECS:
        for pattern in entry.log_tokens:
            compiled = re.compile(pattern)
            assert len(compiled.groupindex) == 1 == compiled.groups, (entry.key, pattern)
            names += list(compiled.groupindex)
            assert pattern in log._PATTERNS
    assert len(names) == len(set(names)), names
    assert "secret" not in names  # the registered values' group


def test_docs_list_every_channel() -> None:
    assert list(docs_config.schema()["channels"]) == list(CHANNEL_KEYS)
    for key in CHANNEL_KEYS:
        assert (REPO / "docs" / "channels" / f"{key}.md").is_file(), key


def test_the_test_and_bench_lists_hold_every_channel() -> None:
    from tests.test_channel_contract import RIGS
    from tests.test_fakes_cli import FAKES

    assert list(RIGS) == list(CHANNEL_KEYS)
    remote = [entry.key for entry in SPECS if not entry.local]
    assert FAKES == remote
    for key in remote:
        assert (REPO / "dshim" / "testing" / "fakes" / f"{key}.py").is_file(), key
    for key in CHANNEL_KEYS:
        assert spec(key).fixture_cases, key
        assert (REPO / "fixtures" / key).is_dir(), key
    idle = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "bench" / "fake_idle.py"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert "{" + ",".join(sorted(remote)) + "}" in "".join(idle.stdout.split())


def test_a_missing_rig_fails_with_what_to_write() -> None:
    from tests.test_channel_contract import rig_of

    with pytest.raises(pytest.fail.Exception, match=r"write tests/rig_zulip\.py with a class"):
        rig_of("zulip")


#: A channel that exists only as a package with a spec (no channel.py yet).
ZULIP_SPEC = '''\
from dshim.channels.spec import RegistryEntry

SPEC = RegistryEntry(
    key="zulip",
    position=65,
    title="Zulip",
    starter="""\\
# Zulip (a bot user)
# [[bots]]
# name = "zulip"
# channel = "zulip"
# api_key = "${ZULIP_API_KEY}"
""",
    fixture_cases=frozenset({"dm_text"}),
    log_tokens=(r"(?P<zulip>zulip-)[a-z]{10}",),
    webhook_only=True,
)
'''

PROBE = """\
import json, sys
import dshim.channels
dshim.channels.__path__.append(sys.argv[1])
from dshim import log
from dshim.channels import registry
from dshim.errors import ConfigError
out = {
    "keys": registry.CHANNEL_KEYS,
    "catalog": registry.CATALOG.keys,
    "webhook_only": dict(registry.CATALOG.webhook_only),
    "starter": registry.starter_toml(),
    "redacted": log.redact("key zulip-abcdefghij here"),
    "channel_modules": [m for m in sys.modules if m.endswith(".channel")],
}
try:
    registry.parse_config({"bots": [{"name": "z", "channel": "zulip"}]}, env={})
except ConfigError as exc:
    out["error"] = str(exc)
print(json.dumps(out))
"""


def test_a_package_with_a_spec_joins_every_registry(tmp_path: Path) -> None:
    package = tmp_path / "zulip"
    package.mkdir()
    (package / "__init__.py").write_text('"""Zulip."""\n')
    (package / "spec.py").write_text(ZULIP_SPEC)
    done = subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    out = json.loads(done.stdout)
    keys = list(CHANNEL_KEYS)
    keys.insert(keys.index("slack") + 1, "zulip")  # position 65: after 60, before 70
    assert out["keys"] == out["catalog"] == keys
    assert out["webhook_only"]["zulip"] == "Zulip"
    slack = spec("slack").starter
    assert slack + "\n# Zulip (a bot user)\n" in out["starter"]
    assert out["redacted"] == "key zulip-*** here"
    assert out["error"] == (
        "dshim.toml: bots[0].channel: channel 'zulip' is not available in this version of dshim yet"
    )
    assert out["channel_modules"] == []


def test_the_registry_and_the_specs_import_nothing_heavy() -> None:
    code = textwrap.dedent(
        """\
        import sys
        import dshim.channels.registry
        print(" ".join(sorted(sys.modules)))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    loaded = done.stdout.split()
    assert not [m for m in loaded if m.split(".")[0] in ("trio", "httpx", "trio_websocket")]
    of_channels = {m for m in loaded if m.startswith("dshim.channels")}
    light = {"dshim.channels", "dshim.channels.registry", "dshim.channels.spec"}
    light |= {f"dshim.channels.{key}" for key in CHANNEL_KEYS}
    light |= {f"dshim.channels.{key}.spec" for key in CHANNEL_KEYS}
    assert of_channels == light  # no channel.py, not the contract, not the kit


def test_config_imports_no_channel() -> None:
    tree = ast.parse((REPO / "dshim" / "config.py").read_text(encoding="utf-8"))
    imported = [
        alias.name if isinstance(node, ast.Import) else f"{node.module}"
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    assert not [name for name in imported if name.startswith("dshim.channels")]
    assert "importlib" not in imported  # nor by name


# --- no hand-kept lists -----------------------------------------------------------------------

#: Files allowed a literal naming three or more channels, and why.
ALLOWED = {
    # The optional features each channel is expected to implement: test data per channel
    # (a new channel adds its expectation there with its tests).
    "tests/test_channel_features.py",
    # The channels whose capture is tested end to end: a chosen subset.
    "tests/test_capture.py",
}
_KEYS = "|".join(map(re.escape, CHANNEL_KEYS))
#: Three or more keys in a row in a string ("telegram, discord, slack"); lowercase only:
#: prose names platforms capitalised.
_IN_A_ROW = re.compile(
    rf"\b(?:{_KEYS})\b(?:[\s,;:|/()`\"'-]+(?:and\s+|or\s+)?\b(?:{_KEYS})\b){{2,}}"
)


def _docstrings(tree: ast.AST) -> set[int]:
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def hand_kept_lists(path: Path) -> list[str]:
    """Where ``path`` names three or more channel keys in one literal (a list, tuple, set,
    dict's keys, or a string that is not a docstring)."""
    keys = set(CHANNEL_KEYS)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docs = _docstrings(tree)
    found: list[str] = []
    for node in ast.walk(tree):
        elements: list[ast.expr | None] = []
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            elements = list(node.elts)
        elif isinstance(node, ast.Dict):
            elements = list(node.keys)
        named = {
            e.value
            for e in elements
            if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in keys
        }
        if len(named) >= 3:
            found.append(f"line {node.lineno}: {sorted(named)}")
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            match = _IN_A_ROW.search(node.value)
            if match:
                found.append(f"line {node.lineno}: {match.group(0)!r}")
    return found


def test_no_source_names_the_channels_by_hand() -> None:
    offenders: dict[str, list[str]] = {}
    for top in ("dshim", "tests", "scripts"):
        for path in sorted((REPO / top).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel in ALLOWED:
                continue
            found = hand_kept_lists(path)
            if found:
                offenders[rel] = found
    assert not offenders, (
        "lists of channels kept by hand (read them from dshim.channels.registry):\n"
        + "\n".join(f"{p}: {', '.join(f)}" for p, f in offenders.items())
    )


def test_the_guard_finds_a_hand_kept_list(tmp_path: Path) -> None:
    a, b, c = CHANNEL_KEYS[:3]
    path = tmp_path / "lists.py"
    path.write_text(
        f'"""Docs may say {a}, {b}, {c}."""\n'
        f"KEYS = [{a!r}, {b!r}, {c!r}]\n"
        f"TABLE = {{{a!r}: 1, {b!r}: 2, {c!r}: 3}}\n"
        f'CHOICES = "{a}|{b}|{c}"\n'
        f"ONE = [{a!r}, 'other', {b!r}]\n"
    )
    found = hand_kept_lists(path)
    assert [f.split(":")[0] for f in found] == ["line 2", "line 3", "line 4"], found
