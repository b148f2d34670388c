"""Every fake platform runs as a process: ``python -m dshim.testing.fakes.<name> --port 0``.

Testing manifesto: each fake is started as a real subprocess on 127.0.0.1 with a free
port; the test reads what it prints (its URL, the credentials, a ``[[bots]]`` block),
checks that the URL answers, that a real ``dshim serve`` built from the printed block
comes up against it (``/readyz`` says the bot is up), and that Ctrl-C ends it with exit 0
and no traceback.  Real clock (the processes are real); every test is bounded by
``trio.fail_after``; nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import trio

from dshim.channels.registry import SPECS

#: Every channel with a remote platform has a fake of it (``dshim.testing.fakes.<key>``).
FAKES = [entry.key for entry in SPECS if not entry.local]


@dataclass
class Printed:
    url: str
    bots_toml: str
    text: str


async def read_until(stream: trio.abc.ReceiveStream, done: str) -> str:
    out = b""
    while not out.decode(errors="replace").endswith(done):
        chunk = await stream.receive_some(4096)
        assert chunk, f"the process ended; it printed: {out.decode(errors='replace')}"
        out += chunk
    return out.decode()


@asynccontextmanager
async def running(name: str, tmp_path: Path) -> AsyncIterator[tuple[trio.Process, Printed]]:
    """The fake ``name`` as a process, and what it printed once it listened."""
    err = tmp_path / f"{name}.stderr"
    with err.open("wb") as stderr:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", f"dshim.testing.fakes.{name}", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=stderr,
        )
    try:
        assert proc.stdout is not None
        text = await read_until(proc.stdout, "\n\n")
        url = next(line for line in text.splitlines() if line.startswith("url: "))[5:]
        snippet = text.split("a bot for dshim.toml:\n\n", 1)[1]
        yield proc, Printed(url, snippet, text)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def interrupt(proc: trio.Process) -> int:
    proc.send_signal(signal.SIGINT)
    with trio.fail_after(10):
        return await proc.wait()


@pytest.mark.parametrize("name", FAKES)
async def test_a_fake_prints_its_url_and_a_bot_block_and_stops_on_ctrl_c(
    name: str, tmp_path: Path
) -> None:
    with trio.fail_after(30):
        async with running(name, tmp_path) as (proc, printed):
            assert printed.url.startswith("http://127.0.0.1:")
            assert not printed.url.endswith(":0")  # the port actually bound
            async with httpx.AsyncClient(trust_env=False) as http:
                answer = await http.get(printed.url)
            assert 200 <= answer.status_code < 600  # an HTTP server answers there
            bot = tomllib.loads(printed.bots_toml)["bots"][0]
            assert bot["channel"] == name
            assert all(value in printed.text for value in bot.values())  # credentials listed
            code = await interrupt(proc)
    stderr = (tmp_path / f"{name}.stderr").read_text()
    assert code == 0, stderr
    assert "Traceback" not in stderr


@pytest.mark.parametrize("name", FAKES)
def test_a_fake_explains_its_options(name: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", f"dshim.testing.fakes.{name}", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "--port" in done.stdout and "--host" in done.stdout


def test_a_taken_port_is_one_line_not_a_traceback() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        done = subprocess.run(
            [sys.executable, "-m", "dshim.testing.fakes.telegram", "--port", port],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


@pytest.mark.parametrize("name", FAKES)
async def test_dshim_serve_with_the_printed_block_connects(name: str, tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with running(name, tmp_path) as (fake, printed):
            cfg = tmp_path / "dshim.toml"
            cfg.write_text(
                f'[dshim]\ndata_dir = "{tmp_path / "state"}"\n\n'
                '[http]\nlisten = "127.0.0.1:0"\n\n' + printed.bots_toml
            )
            env = {k: v for k, v in os.environ.items() if k != "DSHIM_DATA_DIR"}
            log = tmp_path / "serve.log"
            with log.open("wb") as stderr:
                serve = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "dshim", "--config", str(cfg), "serve"],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                )
            try:
                assert serve.stdout is not None
                line = (await read_until(serve.stdout, "\n")).strip()
                url = line.removeprefix("dshim is running: open ")
                state = None
                async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
                    while state != "up":
                        answer = await http.get("/readyz")
                        state = answer.json()[0]["state"]
                        assert state in ("starting", "up"), log.read_text()[-2000:]
                        await trio.sleep(0.05)
                assert await interrupt(serve) == 0, log.read_text()[-2000:]
            finally:
                if serve.returncode is None:
                    serve.kill()
                    await serve.wait()
            assert await interrupt(fake) == 0
    assert "Traceback" not in log.read_text()
