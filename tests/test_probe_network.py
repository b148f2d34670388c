"""``dshim probe`` when the network fails: one row per bot that names the host and why.

Four failures, each on 127.0.0.1 or a ``.invalid`` name (RFC 6761: it never resolves),
so nothing reaches the internet: a closed port (refused), a server that accepts and never
answers (a timeout, with a short ``--timeout``), a plain TCP server spoken to with TLS,
and a host name that does not resolve.  A Telegram bot goes over HTTP, a WeCom bot over
its long connection (which serve retries: the probe must fail as fast as the others).
Real clock; every test has a hard deadline.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from dshim.probe import ProbeRow, _probe, format_table
from dshim.testing.fakes.telegram import TEST_TOKEN

WECOM_SECRET = "wecom-secret-0123456789abcdefABCDEF"
SECRETS = (TEST_TOKEN, TEST_TOKEN.split(":", 1)[1], WECOM_SECRET)
#: The probe's --timeout in these tests (the default is 20 s).
SHORT_S = 1.0
#: A failing bot's probe ends well within this (a retry loop would not).
FAST_S = 4.0


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@asynccontextmanager
async def serving(handler: Callable[[trio.SocketStream], object]) -> AsyncIterator[int]:
    """A TCP server on 127.0.0.1 with ``handler``; yields its port."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1")
        )
        listener = listeners[0]
        yield int(listener.socket.getsockname()[1])
        nursery.cancel_scope.cancel()


async def never_answers(stream: trio.SocketStream) -> None:
    async with stream:
        await trio.sleep_forever()


async def plain_http(stream: trio.SocketStream) -> None:
    """Reads what comes and answers in plain HTTP (a TLS hello gets a 400)."""
    async with stream:
        try:
            await stream.receive_some(4096)
            await stream.send_all(
                b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            )
        except trio.BrokenResourceError:
            pass


def bot_table(channel: str, base: str) -> str:
    if channel == "telegram":
        return (
            '[[bots]]\nname = "tg"\nchannel = "telegram"\ntoken = "${TG_TOKEN}"\n'
            f'api_base = "{base}"\n'
        )
    return (
        '[[bots]]\nname = "wx"\nchannel = "wecom"\nbot_id = "aibot-probe"\n'
        f'secret = "${{WECOM_BOT_SECRET}}"\nws_url = "{base}"\n'
    )


def write_config(tmp_path: Path, *bots: str) -> Path:
    path = tmp_path / "dshim.toml"
    path.write_text(f'[dshim]\ndata_dir = "{tmp_path / "data"}"\n\n' + "\n".join(bots))
    return path


@pytest.fixture(autouse=True)
def secrets_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TG_TOKEN", TEST_TOKEN)
    monkeypatch.setenv("WECOM_BOT_SECRET", WECOM_SECRET)


def scheme(channel: str, tls: bool) -> str:
    if channel == "telegram":
        return "https" if tls else "http"
    return "wss" if tls else "ws"


async def probe_one(
    tmp_path: Path, channel: str, base: str, *, timeout_s: float | None = None
) -> tuple[list[ProbeRow], int]:
    """The bot's rows after its credentials row, and the exit code (``timeout_s``: the
    probe's --timeout; by default each check's own limit, 20 s for most)."""
    rows, code = await _probe(
        write_config(tmp_path, bot_table(channel, base)), None, None, False, timeout_s=timeout_s
    )
    table = format_table(rows)
    assert not any(secret in table for secret in SECRETS), table
    name = "tg" if channel == "telegram" else "wx"
    mine = [r for r in rows if r.check.startswith(f"{name}: ")]
    assert mine[0].check == f"{name}: credentials" and mine[0].result == "ok", table
    return mine[1:], code


def the_failure(rows: list[ProbeRow]) -> ProbeRow:
    """The one failed row (the probe stops at the first network failure)."""
    table = format_table(rows)
    assert [r.result for r in rows] == ["fail"], table
    assert rows[0].ms < FAST_S * 1000, table
    return rows[0]


CHANNELS = ["telegram", "wecom"]


@pytest.mark.parametrize("channel", CHANNELS)
async def test_a_closed_port_is_connection_refused(tmp_path: Path, channel: str) -> None:
    port = closed_port()
    rows, code = await probe_one(tmp_path, channel, f"{scheme(channel, False)}://127.0.0.1:{port}")
    row = the_failure(rows)
    assert code == 1
    assert f"127.0.0.1:{port}" in row.detail and "connection refused" in row.detail, row


@pytest.mark.parametrize("channel", CHANNELS)
async def test_a_server_that_never_answers_is_a_timeout(tmp_path: Path, channel: str) -> None:
    async with serving(never_answers) as port:
        rows, code = await probe_one(
            tmp_path, channel, f"{scheme(channel, True)}://127.0.0.1:{port}", timeout_s=SHORT_S
        )
    row = the_failure(rows)
    assert code == 1
    assert f"127.0.0.1:{port}" in row.detail and f"no answer within {SHORT_S:g} s" in row.detail
    assert row.ms >= SHORT_S * 1000 * 0.9


@pytest.mark.parametrize("channel", CHANNELS)
async def test_tls_to_a_plain_server_is_a_tls_error(tmp_path: Path, channel: str) -> None:
    async with serving(plain_http) as port:
        rows, code = await probe_one(
            tmp_path, channel, f"{scheme(channel, True)}://127.0.0.1:{port}"
        )
    row = the_failure(rows)
    assert code == 1
    assert f"TLS handshake with 127.0.0.1:{port} failed" in row.detail, row


@pytest.mark.parametrize("channel", CHANNELS)
async def test_a_name_that_does_not_resolve_is_a_dns_error(tmp_path: Path, channel: str) -> None:
    host = "api.telegram.invalid" if channel == "telegram" else "openws.work.weixin.invalid"
    rows, code = await probe_one(tmp_path, channel, f"{scheme(channel, True)}://{host}")
    row = the_failure(rows)
    assert code == 1
    assert host in row.detail and "DNS" in row.detail, row


async def test_the_command_prints_one_line_per_failing_bot_and_no_traceback(
    tmp_path: Path,
) -> None:
    port = closed_port()
    cfg = write_config(
        tmp_path,
        bot_table("telegram", f"http://127.0.0.1:{port}"),
        bot_table("wecom", "wss://openws.work.weixin.invalid"),
    )
    env = {**os.environ, "TG_TOKEN": TEST_TOKEN, "WECOM_BOT_SECRET": WECOM_SECRET}
    with trio.fail_after(30):
        done = await trio.run_process(
            [sys.executable, "-m", "dshim", "--config", str(cfg), "probe", "--timeout", "2"],
            env=env,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 1, out + err
    assert "Traceback" not in out + err
    assert not any(secret in out + err for secret in SECRETS)
    failed = [line for line in out.splitlines() if "  fail  " in line]
    assert len(failed) == 2, out
    tg, wx = failed
    assert tg.startswith("tg: identity") and f"127.0.0.1:{port}" in tg and "refused" in tg
    assert wx.startswith("wx: identity") and "openws.work.weixin.invalid" in wx and "DNS" in wx
