"""Small things a user meets on the command line: readable ``--help``, where global options
go, ``dshim init -``, and a quiet ``dshim replay --check`` when every fixture passes.

Real subprocesses (``python -m dshim``), as a user runs them; no network.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.test_cli import REPO, dshim

COMMANDS = ["serve", "init", "probe", "login", "replay"]


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_names_no_python_types(command: str, tmp_path: Path) -> None:
    r = dshim(*([command] if command else []), "--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert not re.search(r"<[a-zA-Z]", r.stdout), r.stdout  # <list[Path]>, <str>, <path>


def test_replay_help_names_its_argument_path() -> None:
    r = dshim("replay", "--help")
    assert re.search(r"^  PATH  Fixture files", r.stdout, re.MULTILINE), r.stdout


@pytest.mark.parametrize(
    ("argv", "hint"),
    [
        (["serve", "--config", "x.toml"], "dshim --config x.toml serve"),
        (["serve", "--bot", "a", "--data-dir", "/tmp/d"], "dshim --data-dir /tmp/d serve"),
        (["probe", "--log-level=debug"], "dshim --log-level=debug probe"),
        (["replay", "fixtures", "--log-format", "json"], "dshim --log-format json replay"),
    ],
)
def test_a_global_option_after_the_command_says_where_it_goes(
    argv: list[str], hint: str, tmp_path: Path
) -> None:
    r = dshim(*argv, cwd=tmp_path)
    assert r.returncode == 2
    assert "Global options go before the command: " + hint in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def test_an_unknown_option_still_gets_the_plain_answer(tmp_path: Path) -> None:
    r = dshim("serve", "--bots", "x", cwd=tmp_path)
    assert r.returncode == 2 and "No such option: --bots" in r.stderr
    assert "Global options" not in r.stderr


def test_init_dash_writes_the_starter_to_stdout(tmp_path: Path) -> None:
    r = dshim("init", "-", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.iterdir()) == []  # no file named "-"
    assert r.stdout.startswith("# dshim.toml")
    (tmp_path / "from-stdout.toml").write_text(r.stdout)
    check = dshim("--config", "from-stdout.toml", "probe", "--timeout", "1", cwd=tmp_path)
    assert "Traceback" not in check.stderr and "from-stdout.toml" not in check.stderr


#: A fixture whose golden expects a malformed event to be dropped (a logged warning).
DROPPING = REPO / "fixtures" / "discord" / "deep_nesting_malformed.json"


def test_replay_check_prints_no_expected_warnings_after_a_pass(tmp_path: Path) -> None:
    shutil.copy(DROPPING, tmp_path / "f.json")
    r = dshim("replay", "--check", str(tmp_path / "f.json"))
    assert r.returncode == 0, r.stderr
    assert "1 passed, 0 failed" in r.stdout
    assert r.stderr == ""


def test_replay_check_shows_the_warnings_of_a_failing_fixture(tmp_path: Path) -> None:
    fixture = json.loads(DROPPING.read_text())
    fixture["expect"] = fixture["expect"][:-1]
    (tmp_path / "f.json").write_text(json.dumps(fixture))
    r = dshim("replay", "--check", str(tmp_path / "f.json"))
    assert r.returncode == 1
    assert r.stderr.startswith(f"FAIL {tmp_path / 'f.json'}")
    assert "event_dropped" in r.stderr  # what went on in the failing run


def test_the_whole_golden_set_passes_quietly() -> None:
    r = dshim("replay", "--check", "fixtures/", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr == "", r.stderr[:3000]


def test_a_first_run_logs_one_store_line(tmp_path: Path) -> None:
    from dshim.store.sqlite import SCHEMA_VERSION

    (tmp_path / "dshim.toml").write_text('[harness]\nkind = "echo"\n')
    r = dshim("--data-dir", "state", "--log-format", "json", "probe", cwd=tmp_path)
    records = [json.loads(x) for x in r.stderr.splitlines() if x.startswith("{")]
    store = [x for x in records if x["event"].startswith("store_")]
    assert len(store) == 1, r.stderr
    assert store[0]["event"] == "store_created" and store[0]["schema"] == SCHEMA_VERSION
    again = dshim("--data-dir", "state", "--log-format", "json", "probe", cwd=tmp_path)
    assert '"event":"store_' not in again.stderr  # nothing to migrate: nothing said


async def test_an_upgrade_logs_the_steps_in_one_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import structlog
    import trio

    from dshim.store import open_store
    from dshim.store import sqlite as store_sqlite

    current = store_sqlite.SCHEMA_VERSION
    with trio.fail_after(30):
        monkeypatch.setattr(store_sqlite, "SCHEMA_VERSION", current - 2)  # an older dshim
        async with open_store(tmp_path, inline=True):
            pass
        monkeypatch.setattr(store_sqlite, "SCHEMA_VERSION", current)
        with structlog.testing.capture_logs() as logs:
            async with open_store(tmp_path, inline=True):
                pass
    store = [x for x in logs if x["event"].startswith("store_")]
    assert len(store) == 1
    assert store[0]["event"] == "store_migrated"
    assert (store[0]["from_schema"], store[0]["schema"]) == (current - 2, current)
    assert [step.split(":")[0] for step in store[0]["steps"]] == [str(current - 1), str(current)]
