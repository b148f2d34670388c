"""The command line as a user runs it: real subprocesses, exit codes, messages."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "fixtures" / "normalized" / "plain_dm.json"


def dshim(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    full_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DSHIM_CONFIG", "DSHIM_DATA_DIR", "DSHIM_HTTP_LISTEN")
    }
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "dshim", *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_version() -> None:
    r = dshim("--version")
    assert r.returncode == 0
    assert r.stdout.strip().startswith("dshim ")


def test_help_does_not_import_channels_or_harness_adapters() -> None:
    code = (
        "import sys\n"
        "from dshim.cli import app\n"
        "try:\n"
        "    app(['--help'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = sorted(m for m in sys.modules if m.startswith(('dshim.channels', 'dshim.harness', 'dshim.pipeline', 'trio', 'httpx')))\n"
        "print('HEAVY=' + ','.join(heavy))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert "Usage" in r.stdout
    assert r.stdout.strip().splitlines()[-1] == "HEAVY="


def test_usage_error_exits_2() -> None:
    r = dshim("--no-such-option")
    assert r.returncode == 2
    r = dshim("--log-format", "xml", "replay", str(FIXTURE))
    assert r.returncode == 2


def test_missing_config_says_how_to_create_one(tmp_path: Path) -> None:
    r = dshim("--config", "nope.toml", "serve", cwd=tmp_path)
    assert r.returncode == 2
    assert "nope.toml: config file not found" in r.stderr and "[[bots]]" in r.stderr
    assert "dshim init nope.toml" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_local_dshim_toml_is_read_without_config(tmp_path: Path) -> None:
    (tmp_path / "dshim.toml").write_text('[harness]\nkind = "echo"\n')
    r = dshim("serve", cwd=tmp_path, env={"DSHIM_DATA_DIR": str(tmp_path / "data")})
    assert r.returncode == 2 and "no enabled bots" in r.stderr  # it read ./dshim.toml


def test_a_busy_port_is_a_config_error_naming_http_listen(tmp_path: Path) -> None:
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    port = busy.getsockname()[1]
    cfg = tmp_path / "dshim.toml"
    cfg.write_text(
        f'[dshim]\ndata_dir = "{tmp_path / "state"}"\n\n[http]\nlisten = "127.0.0.1:{port}"\n\n'
        '[[bots]]\nname = "a"\nchannel = "telegram"\ntoken = "123456:abcdefghijklmnopqrstuvwxyz"\n'
        'api_base = "http://127.0.0.1:9"\n'
    )
    with busy:
        for args in (
            ("--config", str(cfg), "serve"),
            ("--config", str(cfg), "serve", "--listen", f"127.0.0.1:{port}"),
        ):
            r = dshim(*args)
            assert r.returncode == 2, r.stderr
            # One line besides the (JSON) log records, and no traceback.
            lines = [x for x in r.stderr.strip().splitlines() if not x.startswith("{")]
            assert len(lines) == 1, r.stderr
            assert lines[0] == (
                f"dshim: http.listen: cannot listen on 127.0.0.1:{port}: the address is already in use"
            )
            assert r.stdout == ""  # never "dshim is running"


def test_listen_override_is_checked_like_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "dshim.toml"
    cfg.write_text(
        '[[bots]]\nname = "a"\nchannel = "telegram"\ntoken = "123456:abcdefghijklmnopqrstuvwxyz"\n'
    )
    r = dshim("--config", str(cfg), "serve", "--listen", "0.0.0.0:8910")
    assert r.returncode == 2
    assert "--listen / DSHIM_HTTP_LISTEN: http.token: required" in r.stderr
    r = dshim("--config", str(cfg), "serve", env={"DSHIM_HTTP_LISTEN": "no-port-here"})
    assert r.returncode == 2
    assert "--listen / DSHIM_HTTP_LISTEN: http.listen: expected host:port" in r.stderr


def test_bad_config_names_key_path_without_traceback(tmp_path: Path) -> None:
    cfg = tmp_path / "dshim.toml"
    cfg.write_text(
        '[[bots]]\nname = "a"\nchannel = "telegram"\n\n[[bots]]\nname = "b"\nchannel = "telegram"\n[bots.access]\nmode = "safe"\n'
    )
    r = dshim("--config", str(cfg), "serve")
    assert r.returncode == 2
    assert 'dshim.toml: bots[1].access.mode: expected "open" or "allowlist", got "safe"' in r.stderr
    assert "Traceback" not in r.stderr


def test_config_from_environment_variable(tmp_path: Path) -> None:
    cfg = tmp_path / "other.toml"
    cfg.write_text('[harness]\nkind = "echo"\n')
    r = dshim("serve", env={"DSHIM_CONFIG": str(cfg), "DSHIM_DATA_DIR": str(tmp_path / "data")})
    assert r.returncode == 2
    assert "no enabled bots" in r.stderr


def test_missing_secret_is_named_and_never_printed(tmp_path: Path) -> None:
    cfg = tmp_path / "dshim.toml"
    cfg.write_text('[[bots]]\nname = "a"\nchannel = "telegram"\ntoken = "${DSHIM_TEST_TOKEN}"\n')
    r = dshim("--config", str(cfg), "serve", env={"DSHIM_TEST_TOKEN": ""})
    assert r.returncode == 2
    assert "DSHIM_TEST_TOKEN is not set" in r.stderr


def test_replay_prints_json_lines() -> None:
    r = dshim("replay", str(FIXTURE))
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert [x["kind"] for x in lines] == ["prompt", "send"]
    assert all(x["fixture"].endswith("plain_dm.json") for x in lines)
    assert lines[1]["text"] == lines[0]["text"] and lines[1]["reply_to"] == "1"


def test_replay_check_passes_and_fails_with_a_diff(tmp_path: Path) -> None:
    ok = dshim("replay", "--check", str(FIXTURE))
    assert ok.returncode == 0, ok.stderr
    broken = json.loads(FIXTURE.read_text())
    broken["expect"][1]["text"] = "something else"
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken))
    r = dshim("replay", "--check", str(path))
    assert r.returncode == 1
    assert (
        "FAIL" in r.stderr and "-" in r.stderr and "+" in r.stderr and "something else" in r.stderr
    )


def test_replay_directory_recurses(tmp_path: Path) -> None:
    sub = tmp_path / "a" / "b"
    sub.mkdir(parents=True)
    (sub / "x.json").write_text(FIXTURE.read_text())
    (tmp_path / "notes.txt").write_text("ignored")
    r = dshim("replay", "--check", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "1 passed, 0 failed" in r.stdout


def test_replay_missing_path_is_a_usage_error(tmp_path: Path) -> None:
    r = dshim("replay", str(tmp_path / "nope"))
    assert r.returncode == 2


def test_probe_core_checks_run_but_no_bots_exits_2_like_serve(tmp_path: Path) -> None:
    cfg = tmp_path / "dshim.toml"
    cfg.write_text('[harness]\nkind = "echo"\n')
    r = dshim("--config", str(cfg), "--data-dir", str(tmp_path / "state"), "probe")
    assert r.returncode == 2, r.stdout + r.stderr
    rows = {line.split()[0]: line for line in r.stdout.splitlines()[2:]}
    assert set(rows) >= {"config", "data", "store", "harness", "bots"}
    assert all(" ok " in line for name, line in rows.items() if name != "bots")
    assert " fail " in rows["bots"] and "no bots" in rows["bots"]
    assert "ms" in r.stdout.splitlines()[0]
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    r = dshim("--config", str(empty), "--data-dir", str(tmp_path / "state"), "probe")
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_help_shows_flags_as_flags() -> None:
    top = dshim("--help").stdout
    probe = dshim("probe", "--help").stdout
    serve = dshim("serve", "--help").stdout
    assert "<bool>" not in top + probe + serve
    assert "--version " in top and "--send-test " in probe
    assert "--bot NAME" in serve and "--listen HOST:PORT" in serve
    assert "init" in top and "DSHIM_HTTP_LISTEN" in serve


def test_serve_with_an_unusable_data_dir_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = tmp_path / "dshim.toml"
    cfg.write_text(
        f'[dshim]\ndata_dir = "{blocker}"\n\n'
        '[[bots]]\nname = "a"\nchannel = "telegram"\ntoken = "123456:abcdefghijklmnopqrstuvwxyz"\n'
    )
    r = dshim("--config", str(cfg), "serve")
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0  # one line
    assert "dshim.toml: dshim.data_dir:" in r.stderr and "not a directory" in r.stderr
    assert "Traceback" not in r.stderr
    r = dshim("--config", str(cfg), "--data-dir", str(blocker / "sub"), "serve")
    assert r.returncode == 2 and "--data-dir" in r.stderr and "Traceback" not in r.stderr


def test_badly_shaped_token_is_a_config_error(tmp_path: Path) -> None:
    cfg = tmp_path / "dshim.toml"
    cfg.write_text('[[bots]]\nname = "a"\nchannel = "telegram"\ntoken = "${TOKEN}"\n')
    r = dshim("--config", str(cfg), "serve", env={"TOKEN": "no-colon-secret-value"})
    assert r.returncode == 2
    assert "bots[0].token: not a Telegram bot token" in r.stderr
    assert "no-colon-secret-value" not in r.stderr and "Traceback" not in r.stderr


def test_serve_bot_must_name_an_enabled_bot(tmp_path: Path) -> None:
    cfg = tmp_path / "dshim.toml"
    token = 'token = "123456:abcdefghijklmnopqrstuvwxyz"\n'
    cfg.write_text(
        f'[[bots]]\nname = "a"\nchannel = "telegram"\n{token}\n'
        f'[[bots]]\nname = "b"\nchannel = "telegram"\nenabled = false\n{token}'
    )
    r = dshim("--config", str(cfg), "serve", "--bot", "zed")
    assert r.returncode == 2 and "--bot zed: no bot named 'zed'" in r.stderr
    r = dshim("--config", str(cfg), "serve", "--bot", "b")
    assert r.returncode == 2 and "disabled" in r.stderr


def test_probe_with_bad_config_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "dshim.toml"
    cfg.write_text("[harness]\nkind = 3\n")
    r = dshim("--config", str(cfg), "probe")
    assert r.returncode == 2
    assert "fail" in r.stdout and "harness.kind" in r.stdout


def test_probe_unusable_data_dir_fails(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cfg = tmp_path / "dshim.toml"
    cfg.write_text("")
    r = dshim("--config", str(cfg), "--data-dir", str(blocker / "state"), "probe")
    assert r.returncode == 1
    assert "fail" in r.stdout and "data dir" in r.stdout


# --- serve's direct route (dshim.launch) means what typer means ----------------------------

SERVE_FORMS = [
    ["serve"],
    ["--config", "a.toml", "serve"],
    ["--config=a.toml", "--data-dir", "d", "serve", "--bot", "one", "--bot=two"],
    ["--log-level", "DEBUG", "--log-format=json", "serve", "--listen", "127.0.0.1:0"],
    ["--config", "a.toml", "--config", "b.toml", "serve", "--listen=h:1", "--listen", "h:2"],
    ["serve", "--capture", "cap", "--bot", "one"],
    ["serve", "--capture=cap1", "--capture", "cap2"],
    ["serve", "--instance", "east-1", "--bot", "one"],
]
NOT_DIRECT = [
    [],
    ["--help"],
    ["serve", "--help"],
    ["--version", "serve"],
    ["serve", "extra"],
    ["serve", "--config", "a.toml"],  # a global option after the command
    ["--log-level", "loud", "serve"],
    ["--log-format", "xml", "serve"],
    ["--config", "serve"],  # the value is missing
    ["--config", "--bot", "serve"],
    ["--conf", "a.toml", "serve"],
    ["serve", "--bot"],
    ["probe"],
    ["-h"],
]


def _typer_reading(
    argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> tuple[object, ...]:
    """What typer's serve command hands to launch.serve for *argv*."""
    from typer.testing import CliRunner

    from dshim import launch
    from dshim.cli import app

    seen: list[tuple[object, ...]] = []

    def record(
        g: launch.Globals,
        bots: list[str],
        listen: str | None,
        capture: str | None = None,
        instance: str | None = None,
    ) -> int:
        seen.append(
            (g.config, g.data_dir, g.log_level, g.log_format, list(bots), listen, capture, instance)
        )
        return 0

    monkeypatch.setattr(launch, "serve", record)
    result = CliRunner().invoke(app, argv, env=env)
    assert result.exit_code == 0, result.output
    return seen[0]


@pytest.mark.parametrize(
    "env",
    [{}, {"DSHIM_CONFIG": "env.toml", "DSHIM_HTTP_LISTEN": "e:9", "DSHIM_INSTANCE": "env-i"}],
)
@pytest.mark.parametrize("argv", SERVE_FORMS)
def test_the_direct_serve_route_reads_options_as_typer_does(
    argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dshim.launch import parse_serve

    for name in ("DSHIM_CONFIG", "DSHIM_DATA_DIR", "DSHIM_HTTP_LISTEN", "DSHIM_INSTANCE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parsed = parse_serve(argv)
    assert parsed is not None
    g, bots, listen, capture, instance = parsed
    direct = (g.config, g.data_dir, g.log_level, g.log_format, bots, listen, capture, instance)
    assert direct == _typer_reading(argv, env, monkeypatch)


@pytest.mark.parametrize("argv", NOT_DIRECT)
def test_anything_but_a_plain_serve_goes_to_typer(argv: list[str]) -> None:
    from dshim.launch import parse_serve

    assert parse_serve(argv) is None


def test_serve_help_and_a_bad_serve_option_are_typer_s(tmp_path: Path) -> None:
    r = dshim("serve", "--help", cwd=tmp_path)
    assert r.returncode == 0 and "--listen" in r.stdout and "--bot" in r.stdout
    r = dshim("serve", "--bots", "x", cwd=tmp_path)
    assert r.returncode == 2 and "--bots" in r.stderr and "Traceback" not in r.stderr


def test_serve_starts_without_the_command_line_framework(tmp_path: Path) -> None:
    """A plain ``dshim serve`` (what restarts after every deploy) does not load typer,
    click or pydantic: ~50 ms and ~10 MB of every start."""
    (tmp_path / "dshim.toml").write_text('[harness]\nkind = "echo"\n')
    code = (
        "import sys, runpy\n"
        "sys.argv = ['dshim', 'serve']\n"
        "try:\n"
        "    runpy.run_module('dshim', run_name='__main__')\n"
        "except SystemExit as exc:\n"
        "    print('EXIT', exc.code)\n"
        "print('LOADED=' + ','.join(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('typer', 'click', 'pydantic'))))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSHIM_")}
    env["DSHIM_DATA_DIR"] = str(tmp_path / "data")
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=env,
    )
    assert "no enabled bots" in r.stderr  # it ran serve and read ./dshim.toml
    lines = r.stdout.strip().splitlines()
    assert lines[-2:] == ["EXIT 2", "LOADED="]
