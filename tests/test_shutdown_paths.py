"""Every way ``dshim serve`` is stopped exits 0 without a traceback: WhatsApp and WeChat.

Testing manifesto: the real console entry point (``python -m dshim``) as a subprocess with
its own store, against the fake WhatsApp Cloud API and the fake WeChat iLink API on
127.0.0.1 served by this test (port 0).  The echo harness makes the turn that is running
when the signal arrives: a slow stream (``echo:slow``) or, on WhatsApp, a long answer split
into parts that wait for the pair-rate pacer (one message per 6 s).  Real clock (the
process is real); every test is bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio

from dshim.testing.fakes import weixin as wx
from dshim.testing.fakes import whatsapp as wa

GRACE_S = 1.0
LONG_GRACE_S = 30.0
ENDPOINT_TOKEN = "endpoint-bearer-for-shutdown-tests-0123"


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def whatsapp_bot(api_base: str) -> str:
    return (
        f'[[bots]]\nname = "wa"\nchannel = "whatsapp"\nphone_number_id = "{wa.PHONE_NUMBER_ID}"\n'
        f'access_token = "${{DSHIM_TEST_WA_TOKEN}}"\napp_secret = "${{DSHIM_TEST_WA_SECRET}}"\n'
        f'verify_token = "${{DSHIM_TEST_WA_VERIFY}}"\napi_base = "{api_base}"\n'
    )


def weixin_bot(api_base: str, cdn_base: str) -> str:
    return (
        f'[[bots]]\nname = "wx"\nchannel = "weixin"\ntoken = "${{DSHIM_TEST_WX_TOKEN}}"\n'
        f'bot_id = "{wx.BOT_ID}"\napi_base = "{api_base}"\ncdn_base = "{cdn_base}"\n'
    )


SECRETS = {
    "DSHIM_TEST_WA_TOKEN": wa.TEST_TOKEN,
    "DSHIM_TEST_WA_SECRET": wa.TEST_APP_SECRET,
    "DSHIM_TEST_WA_VERIFY": wa.TEST_VERIFY_TOKEN,
    "DSHIM_TEST_WX_TOKEN": wx.TEST_TOKEN,
}


@dataclass
class Serve:
    proc: trio.Process
    log: Path

    def text(self) -> str:
        return self.log.read_text()

    async def wait_for_log(self, event: str) -> dict[str, Any]:
        """Until the process logged ``event``: its record."""
        while True:
            for line in (await trio.Path(self.log).read_text()).splitlines():
                if line.startswith("{") and f'"event":"{event}"' in line:
                    record: dict[str, Any] = json.loads(line)
                    return record
            await trio.sleep(0.05)

    async def signal_and_wait(self, *signals: int, between: str | None = None) -> int:
        """Send each signal (after the first, once ``between`` was logged); the exit code."""
        for i, sig in enumerate(signals):
            if i and between is not None:
                await self.wait_for_log(between)
            self.proc.send_signal(sig)
        # A second signal cuts the grace short: the process ends soon after it, well before
        # the answer (or the grace) would have ended by itself.
        with trio.fail_after(8 if len(signals) > 1 else 25):
            return await self.proc.wait()


@asynccontextmanager
async def serving(tmp_path: Path, bot: str, grace_s: float) -> AsyncIterator[Serve]:
    cfg = tmp_path / "dshim.toml"
    cfg.write_text(
        f'[dshim]\ndata_dir = "{tmp_path / "state"}"\nshutdown_grace_s = {grace_s}\n\n'
        f'[http]\nlisten = "127.0.0.1:0"\ntoken = "{ENDPOINT_TOKEN}"\n\n' + bot
    )
    log = tmp_path / "serve.log"
    env = {**os.environ, **SECRETS}
    env.pop("DSHIM_DATA_DIR", None)
    command = [sys.executable, "-m", "dshim", "--config", str(cfg), "--log-format", "json"]
    with log.open("ab") as stderr:
        proc = await trio.lowlevel.open_process(
            [*command, "serve"], env=env, stdout=stderr, stderr=stderr
        )
    try:
        yield Serve(proc, log)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def assert_clean(serve: Serve, code: int) -> None:
    text = serve.text()
    assert code == 0, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert all(secret not in text for secret in SECRETS.values())


# --- WhatsApp -------------------------------------------------------------------------------

#: Three parts of about 3,000 characters: the answer is split and paced 6 s per part.
LONG_TEXT = " ".join(["paced"] * 1800)


@asynccontextmanager
async def whatsapp_turn(
    tmp_path: Path, grace_s: float, text: str, *, started: Callable[[wa.FakeWhatsApp], bool]
) -> AsyncIterator[Serve]:
    """Serve one WhatsApp bot and run a turn until ``started`` says it is under way."""
    async with (
        wa.open_fake_whatsapp() as fake,
        serving(tmp_path, whatsapp_bot(fake.url), grace_s) as s,
    ):
        record = await s.wait_for_log("http_listening")
        fake.webhook_url = f"{record['urls'][0].rstrip('/')}/hooks/wa"
        await s.wait_for_log("bot_started")
        ada = fake.user("15551234567", "Ada")
        assert await fake.send_messages(fake.user_message(ada, text)) == 200
        await fake.wait_until(lambda: started(fake))
        yield s


@pytest.mark.parametrize(
    ("signals", "grace_s"),
    [
        ((signal.SIGINT,), GRACE_S),
        ((signal.SIGTERM,), GRACE_S),
        ((signal.SIGINT, signal.SIGINT), LONG_GRACE_S),
        ((signal.SIGTERM, signal.SIGINT), LONG_GRACE_S),
    ],
    ids=["sigint", "sigterm", "sigint-sigint", "sigterm-sigint"],
)
async def test_whatsapp_a_paced_answer_at_shutdown_exits_0(
    tmp_path: Path, signals: tuple[int, ...], grace_s: float
) -> None:
    with trio.fail_after(90):
        sent = whatsapp_turn(
            tmp_path, grace_s, LONG_TEXT, started=lambda f: len(f.calls_to("send")) >= 1
        )
        async with sent as s:  # the first part is out, the next wait for the pacer
            assert_clean(s, await s.signal_and_wait(*signals, between="bot_draining"))


async def test_whatsapp_a_streaming_answer_at_shutdown_exits_0(tmp_path: Path) -> None:
    with trio.fail_after(90):
        typing = whatsapp_turn(
            tmp_path, GRACE_S, "echo:slow 60 a long story", started=lambda f: bool(f.read)
        )
        async with typing as s:
            assert_clean(s, await s.signal_and_wait(signal.SIGINT))


# --- WeChat ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("signals", "grace_s"),
    [
        ((signal.SIGINT,), GRACE_S),
        ((signal.SIGTERM,), GRACE_S),
        ((signal.SIGINT, signal.SIGINT), LONG_GRACE_S),
        ((signal.SIGTERM, signal.SIGINT), LONG_GRACE_S),
    ],
    ids=["sigint", "sigterm", "sigint-sigint", "sigterm-sigint"],
)
@pytest.mark.parametrize("run", range(3))
async def test_weixin_a_streaming_answer_at_shutdown_exits_0(
    tmp_path: Path, signals: tuple[int, ...], grace_s: float, run: int
) -> None:
    with trio.fail_after(90):
        async with (
            wx.open_fake_weixin() as fake,
            serving(tmp_path, weixin_bot(fake.url, fake.cdn_url), grace_s) as s,
        ):
            await fake.wait_until(lambda: len(fake.calls_to("getupdates")) >= 1)
            fake.user_message("echo:slow 60 a long story")
            await fake.wait_until(lambda: bool(fake.calls_to("sendtyping", "sendmessage")))
            assert_clean(s, await s.signal_and_wait(*signals, between="bot_draining"))


# --- start-up backoff -----------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
@pytest.mark.parametrize("platform", ["whatsapp", "weixin"])
async def test_a_signal_during_start_up_backoff_exits_0(
    tmp_path: Path, platform: str, sig: int
) -> None:
    dead = f"http://127.0.0.1:{closed_port()}"
    bot = whatsapp_bot(dead) if platform == "whatsapp" else weixin_bot(dead, dead)
    with trio.fail_after(60):
        async with serving(tmp_path, bot, LONG_GRACE_S) as s:
            await s.wait_for_log("call_failed_retrying")
            t0 = trio.current_time()
            code = await s.signal_and_wait(sig)
            assert trio.current_time() - t0 < 5  # not the grace
            assert_clean(s, code)
