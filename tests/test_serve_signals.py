"""``dshim serve`` as a real process: SIGTERM/SIGINT drain running answers, then exit 0.

The bot is a Telegram bot pointed at the fake Bot API on 127.0.0.1 served by this test;
the process is the real console entry point (``python -m dshim``) with its own store.
Real clock; each test is bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import trio

from dshim.pipeline.runtime import INTERRUPTED_TEXT
from dshim.pipeline.turn import CUT_MARK, STOPPED_MARK
from dshim.testing.fakes.telegram import TEST_TOKEN, FakeTelegram, open_fake_telegram

ADA = FakeTelegram.user(42, "Ada", "Lovelace", "ada")
SOURCE = (
    '<dsh_im_source>{"channel":"telegram","conversationType":"direct","senderId":"42",'
    '"senderName":"Ada Lovelace"}</dsh_im_source>'
)


GRACE_S = 1.0
OTHER_TOKEN = "654321:a-token-the-fake-does-not-know-0000"


def write_config(
    tmp_path: Path, api_base: str, *, other_bot: bool = False, grace_s: float = GRACE_S
) -> Path:
    cfg = tmp_path / "dshim.toml"
    text = (
        f'[dshim]\ndata_dir = "{tmp_path / "state"}"\nshutdown_grace_s = {grace_s}\n\n'
        '[http]\nlisten = "127.0.0.1:0"\n\n'
        f'[[bots]]\nname = "tg"\nchannel = "telegram"\ntoken = "${{DSHIM_TEST_TG_TOKEN}}"\n'
        f'api_base = "{api_base}"\n'
    )
    if other_bot:
        text += (
            f'\n[[bots]]\nname = "other"\nchannel = "telegram"\ntoken = "{OTHER_TOKEN}"\n'
            f'api_base = "{api_base}"\n'
        )
    cfg.write_text(text)
    return cfg


async def start_serve(
    cfg: Path, log: Path, *args: str, stdout: int = subprocess.DEVNULL
) -> trio.Process:
    env = {**os.environ, "DSHIM_TEST_TG_TOKEN": TEST_TOKEN}
    env.pop("DSHIM_DATA_DIR", None)
    command = [sys.executable, "-m", "dshim", "--config", str(cfg), "--log-format", "json"]
    with log.open("ab") as stderr:  # the child keeps its own copy of the descriptor
        return await trio.lowlevel.open_process(
            [*command, "serve", *args], env=env, stdout=stdout, stderr=stderr
        )


async def stop(proc: trio.Process, sig: int = signal.SIGTERM) -> int:
    """Send ``sig`` and wait (at most 15 s) for the exit code."""
    proc.send_signal(sig)
    with trio.fail_after(15):
        return await proc.wait()


async def polling(fake: FakeTelegram, n: int) -> None:
    await fake.wait_until(lambda: len(fake.calls_to("getUpdates")) >= n)


def texts(fake: FakeTelegram) -> list[str]:
    return [m.text for m in fake.bot_messages(42)]


async def test_sigterm_lets_the_running_answer_finish_and_keeps_the_next_message(
    tmp_path: Path,
) -> None:
    log = tmp_path / "serve.log"
    with trio.fail_after(60):
        async with open_fake_telegram() as fake:
            cfg = write_config(tmp_path, fake.url)
            chat = fake.private_chat(ADA)
            proc = await start_serve(cfg, log)
            try:
                await polling(fake, 1)
                # 1.5 s of answer; the signal comes ~1 s in, within the 1 s grace of the rest.
                fake.user_message(chat, ADA, "echo:slow 4 a story")
                await fake.wait_until(lambda: len(fake.calls_to("sendMessage")) >= 1)
                proc.send_signal(signal.SIGTERM)
                await trio.sleep(0.3)
                fake.user_message(chat, ADA, "sent during shutdown")
                with trio.fail_after(15):
                    code = await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
            assert code == 0, log.read_text()[-3000:]
            assert texts(fake) == [f"{SOURCE}\n\necho:slow 4 a story"]  # finished, not cut

            # The message sent during shutdown was not confirmed: the next start answers it.
            proc = await start_serve(cfg, log)
            try:
                await fake.wait_until(lambda: len(texts(fake)) == 2)
                code = await stop(proc, signal.SIGINT)
            finally:
                if proc.returncode is None:
                    proc.kill()
            assert code == 0
            assert texts(fake)[1] == f"{SOURCE}\n\nsent during shutdown"
    assert TEST_TOKEN not in log.read_text()


async def test_an_answer_longer_than_the_grace_is_cut_and_marked_at_once(
    tmp_path: Path,
) -> None:
    log = tmp_path / "serve.log"
    with trio.fail_after(90):
        async with open_fake_telegram() as fake:
            cfg = write_config(tmp_path, fake.url)
            chat = fake.private_chat(ADA)
            proc = await start_serve(cfg, log)
            try:
                await polling(fake, 1)
                fake.user_message(chat, ADA, "echo:slow 60 a very long story")
                await fake.wait_until(lambda: len(fake.calls_to("sendMessage")) >= 1)
                t0 = trio.current_time()
                proc.send_signal(signal.SIGTERM)
                with trio.fail_after(20):
                    code = await proc.wait()
                waited = trio.current_time() - t0
            finally:
                if proc.returncode is None:
                    proc.kill()
            assert code == 0, log.read_text()[-3000:]
            assert GRACE_S - 0.1 <= waited <= GRACE_S + 8  # the grace, then the cut is shown
            partial = texts(fake)
            # Marked at once, by an edit of the partial answer: cut short by the restart.
            assert len(partial) == 1 and partial[0].endswith(CUT_MARK)
            assert "a very long story" not in partial[0]

            proc = await start_serve(cfg, log)
            try:
                polls = len(fake.calls_to("getUpdates"))
                await polling(fake, polls + 1)
                await trio.sleep(2)  # a notice would be out by now
                await stop(proc)
            finally:
                if proc.returncode is None:
                    proc.kill()
            # No second answer to the cut-off message, and no notice: it was marked already.
            assert texts(fake) == partial
            assert INTERRUPTED_TEXT not in texts(fake)
            assert STOPPED_MARK not in texts(fake)[0]


async def test_serve_bot_runs_only_the_named_bot(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with trio.fail_after(60):
        async with open_fake_telegram() as fake:
            cfg = write_config(tmp_path, fake.url, other_bot=True)
            chat = fake.private_chat(ADA)
            proc = await start_serve(cfg, log, "--bot", "tg")
            try:
                await polling(fake, 1)
                fake.user_message(chat, ADA, "hello")
                await fake.wait_until(lambda: len(texts(fake)) == 1)
                await trio.sleep(2)  # the other bot would have called getMe by now
                code = await stop(proc, signal.SIGTERM)
            finally:
                if proc.returncode is None:
                    proc.kill()
    assert code == 0
    assert texts(fake) == [f"{SOURCE}\n\nhello"]
    assert all(c.status != 401 for c in fake.calls)  # the other token never reached the fake
    records = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
    assert {r.get("bot") for r in records if "bot" in r} == {"tg"}


async def test_serve_with_http_prints_the_url_and_becomes_ready(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    with trio.fail_after(60):
        async with open_fake_telegram() as fake:
            cfg = write_config(tmp_path, fake.url)
            proc = await start_serve(cfg, log, stdout=subprocess.PIPE)
            try:
                assert proc.stdout is not None
                out = b""
                while not out.endswith(b"\n"):
                    chunk = await proc.stdout.receive_some(1024)
                    assert chunk, log.read_text()[-2000:]
                    out += chunk
                line = out.decode().strip()
                assert line.startswith("dshim is running: open http://127.0.0.1:")
                url = line.removeprefix("dshim is running: open ")
                assert url.endswith("/") and not url.endswith(":0/")  # the port actually bound
                async with httpx.AsyncClient(base_url=url) as http:
                    assert (await http.get("/healthz")).text == "ok"
                    for _ in range(600):  # until every bot reported started
                        ready = await http.get("/readyz")
                        if ready.status_code == 200:
                            break
                        await trio.sleep(0.05)
                    assert ready.json()[0]["name"] == "tg" and ready.json()[0]["state"] == "up"
                code = await stop(proc, signal.SIGTERM)
            finally:
                if proc.returncode is None:
                    proc.kill()
    assert code == 0, log.read_text()[-3000:]
    assert "dshim init" not in log.read_text()  # the zero-config hint is for zero config only
    assert "Traceback" not in log.read_text()


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then closed again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for_log(log: Path, event: str) -> None:
    """Until the process logged ``event``."""
    while True:
        if f'"event":"{event}"' in await trio.Path(log).read_text():
            return
        await trio.sleep(0.05)


@pytest.mark.parametrize(
    ("first", "second"),
    [(signal.SIGINT, signal.SIGINT), (signal.SIGTERM, signal.SIGINT)],
    ids=["sigint-sigint", "sigterm-sigint"],
)
async def test_a_second_signal_cuts_the_grace_short_and_exits_0(
    tmp_path: Path, first: signal.Signals, second: signal.Signals
) -> None:
    log = tmp_path / "serve.log"
    with trio.fail_after(60):
        async with open_fake_telegram() as fake:
            cfg = write_config(tmp_path, fake.url, grace_s=30)
            chat = fake.private_chat(ADA)
            proc = await start_serve(cfg, log)
            try:
                await polling(fake, 1)
                fake.user_message(chat, ADA, "echo:slow 60 a very long story")
                await fake.wait_until(lambda: len(fake.calls_to("sendMessage")) >= 1)
                proc.send_signal(first)
                await wait_for_log(log, "bot_draining")  # the 30 s grace has begun
                t0 = trio.current_time()
                proc.send_signal(second)
                with trio.fail_after(15):
                    code = await proc.wait()
                waited = trio.current_time() - t0
            finally:
                if proc.returncode is None:
                    proc.kill()
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert waited < 5, text[-3000:]  # not the 30 s grace
    assert "Traceback" not in text


async def test_a_signal_during_start_up_retries_stops_at_once_and_exits_0(
    tmp_path: Path,
) -> None:
    """The platform is unreachable: the bot keeps retrying getMe and never comes up."""
    log = tmp_path / "serve.log"
    cfg = write_config(tmp_path, f"http://127.0.0.1:{closed_port()}", grace_s=10)
    with trio.fail_after(60):
        proc = await start_serve(cfg, log)
        try:
            await wait_for_log(log, "call_failed_retrying")
            t0 = trio.current_time()
            proc.send_signal(signal.SIGINT)
            with trio.fail_after(20):
                code = await proc.wait()
            waited = trio.current_time() - t0
        finally:
            if proc.returncode is None:
                proc.kill()
    text = log.read_text()
    assert code == 0, text[-3000:]
    assert waited < 3, text[-3000:]  # not the grace and the 5 s after it
    assert "Traceback" not in text
    assert TEST_TOKEN not in text


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["sigint", "sigterm"])
async def test_a_signal_while_serve_reads_its_configuration_exits_0(
    tmp_path: Path, sig: signal.Signals
) -> None:
    """The configuration is a FIFO: the signal comes while serve is known to be reading it,
    before anything has started."""
    text = write_config(tmp_path, f"http://127.0.0.1:{closed_port()}").read_bytes()
    fifo = tmp_path / "fifo.toml"
    os.mkfifo(fifo)
    log = tmp_path / "serve.log"
    with trio.fail_after(30):
        proc = await start_serve(fifo, log)
        try:
            while True:  # a writer opens without blocking only once serve has it open
                try:
                    writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                    break
                except OSError as exc:
                    if exc.errno != errno.ENXIO:
                        raise
                    await trio.sleep(0.01)
            proc.send_signal(sig)
            try:
                os.write(writer, text)
            finally:
                os.close(writer)
            with trio.fail_after(20):
                code = await proc.wait()
        finally:
            if proc.returncode is None:
                proc.kill()
    output = log.read_text()
    assert code == 0, output[-3000:]
    assert "Traceback" not in output
    assert "serve_started" not in output  # stopped before it started anything
