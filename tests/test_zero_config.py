"""``dshim serve`` on a fresh install: no --config, no DSHIM_CONFIG, no ./dshim.toml.

The real console entry point runs as a subprocess in an empty directory, with HOME and
XDG_STATE_HOME in a temporary directory and ``DSHIM_HTTP_LISTEN=127.0.0.1:0`` (any free
port: the printed URL is the one actually bound).  A websocket client speaks the web
chat's frames (issue 10 §2) to ``/ws`` like a script would.  Real clock, bounded by
``trio.fail_after``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection

from tests.http_client import open_ws

URL_LINE = re.compile(r"^dshim is running: open (http://127\.0\.0\.1:(\d+)/)$")


def fresh_env(home: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DSHIM_CONFIG", "DSHIM_DATA_DIR", "DSHIM_HTTP_LISTEN")
    }
    env.update(
        HOME=str(home),
        XDG_STATE_HOME=str(home / "state"),
        DSHIM_HTTP_LISTEN="127.0.0.1:0",
    )
    return env


async def read_line(stream: trio.abc.ReceiveStream, buffer: bytearray) -> str:
    while b"\n" not in buffer:
        chunk = await stream.receive_some(4096)
        if not chunk:
            raise EOFError(f"stdout closed; got {bytes(buffer)!r}")
        buffer += chunk
    line, _, rest = bytes(buffer).partition(b"\n")
    buffer[:] = rest
    return line.decode()


async def frame(ws: WebSocketConnection, kind: str) -> dict[str, Any]:
    """The next frame of this type (others, such as the user's own message, are skipped)."""
    while True:
        data = json.loads(await ws.get_message())
        assert data.get("type") != "error", data
        if data.get("type") == kind:
            return data  # type: ignore[no-any-return]


async def test_serve_without_any_config_runs_the_web_chat(tmp_path: Path) -> None:
    cwd = tmp_path / "empty"
    cwd.mkdir()
    stderr = tmp_path / "stderr.log"
    with trio.fail_after(60), stderr.open("wb") as err:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "dshim", "serve"],
            cwd=cwd,
            env=fresh_env(tmp_path),
            stdout=subprocess.PIPE,
            stderr=err,
        )
        try:
            assert proc.stdout is not None
            buffer = bytearray()
            line = await read_line(proc.stdout, buffer)
            match = URL_LINE.match(line)
            assert match, (line, stderr.read_text()[-2000:])
            base = match.group(1).rstrip("/")
            async with httpx.AsyncClient(base_url=base) as http:
                assert (await http.get("/healthz")).text == "ok"
                page = await http.get("/")
                assert page.status_code == 200 and "text/html" in page.headers["content-type"]

            async with open_ws(base, "/ws") as ws:
                await ws.send_message(
                    json.dumps(
                        {
                            "type": "join",
                            "conversation": "c1",
                            "kind": "direct",
                            "user": {"id": "u1", "name": "Ada"},
                        }
                    )
                )
                history = await frame(ws, "history")
                assert history["conversation"] == "c1" and history["messages"] == []
                await ws.send_message(
                    json.dumps(
                        {
                            "type": "send",
                            "client_id": "k1",
                            "conversation": "c1",
                            "text": "hello from a script",
                            "reply_to": None,
                            "files": [],
                        }
                    )
                )
                accepted = await frame(ws, "accepted")
                assert accepted["client_id"] == "k1" and accepted["id"]
                while True:
                    message = await frame(ws, "message")
                    if message["author"]["bot"] and message["final"]:
                        break
                assert message["conversation"] == "c1"
                assert message["text"].endswith("\n\nhello from a script")
                assert message["text"].startswith('<dsh_im_source>{"channel":"webchat"')

                # SIGTERM with the socket open: it is closed, and dshim exits 0.
                proc.send_signal(signal.SIGTERM)
                try:
                    while True:
                        await ws.get_message()
                except ConnectionClosed as closed:
                    assert closed.reason.code == 1001
            with trio.fail_after(20):
                code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
    log = stderr.read_text()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log
    assert "dshim init" in log  # how to add a platform
    assert buffer.strip() == b""  # one line on stdout, nothing else
    assert (tmp_path / "state" / "dshim").is_dir()  # the default data directory
    assert not (cwd / "dshim.toml").exists()


def test_an_explicit_config_that_does_not_exist_stays_an_error(tmp_path: Path) -> None:
    env = fresh_env(tmp_path)
    for args, extra in (
        (["--config", str(tmp_path / "missing.toml"), "serve"], {}),
        (["serve"], {"DSHIM_CONFIG": str(tmp_path / "missing.toml")}),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "dshim", *args],
            cwd=tmp_path,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2, r.stderr
        assert "missing.toml: config file not found" in r.stderr
        assert "dshim init" in r.stderr and "Traceback" not in r.stderr
        assert r.stdout == ""
