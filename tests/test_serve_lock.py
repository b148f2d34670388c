"""Two ``dshim serve`` on one data directory: the second refuses to start.

Real processes (``python -m dshim``) against the fake Bot API on 127.0.0.1; the first one
holds an exclusive lock on the data directory for its whole life, so the second one prints
one line naming the directory and the first one's pid and exits 1, and the bots are
answered once.  ``dshim probe`` and ``dshim replay`` take no such lock: they work while
serve runs.  Real clock; every step is bounded by ``trio.fail_after``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import trio

from dshim.testing.fakes.telegram import TEST_TOKEN, open_fake_telegram
from tests.test_serve_signals import ADA, SOURCE, polling, start_serve, stop, texts, write_config

FIXTURE = Path(__file__).parent.parent / "fixtures" / "telegram" / "dm_text.json"


async def dshim(cfg: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    """Run one short ``dshim`` command to its end (at most 30 s)."""
    env = {**os.environ, "DSHIM_TEST_TG_TOKEN": TEST_TOKEN}
    env.pop("DSHIM_DATA_DIR", None)
    with trio.fail_after(30):
        return await trio.run_process(
            [sys.executable, "-m", "dshim", "--config", str(cfg), *args],
            env=env,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
        )


async def test_a_second_serve_on_the_same_data_dir_refuses_with_one_line(
    tmp_path: Path,
) -> None:
    log = tmp_path / "first.log"
    with trio.fail_after(80):
        async with open_fake_telegram() as fake:
            cfg = write_config(tmp_path, fake.url)
            chat = fake.private_chat(ADA)
            first = await start_serve(cfg, log)
            try:
                await polling(fake, 1)
                second = await dshim(cfg, "--log-format", "json", "serve")
                err = second.stderr.decode()
                assert second.returncode == 1, err[-3000:]
                assert err.count("\n") == 1 and err.startswith("dshim: "), err[-3000:]
                assert str(tmp_path / "state") in err and f"pid {first.pid}" in err
                assert TEST_TOKEN not in err and "Traceback" not in err

                # The first one still answers, and it alone.
                fake.user_message(chat, ADA, "hello")
                await fake.wait_until(lambda: len(texts(fake)) == 1)

                # probe and replay do not need the lock.
                probed = await dshim(cfg, "probe", "tg")
                assert probed.returncode == 0, probed.stdout.decode() + probed.stderr.decode()
                assert b"tg: identity" in probed.stdout
                replayed = await dshim(cfg, "replay", "--check", str(FIXTURE))
                assert replayed.returncode == 0, replayed.stdout.decode()
                await trio.sleep(1)  # a second answer from anywhere would be out by now
                assert await stop(first, signal.SIGTERM) == 0, log.read_text()[-3000:]
            finally:
                if first.returncode is None:
                    first.kill()
            assert texts(fake) == [f"{SOURCE}\n\nhello"]

            # The lock goes with the process: the next serve starts.
            again = await start_serve(cfg, log)
            try:
                polls = len(fake.calls_to("getUpdates"))
                await polling(fake, polls + 1)
                assert await stop(again, signal.SIGINT) == 0
            finally:
                if again.returncode is None:
                    again.kill()
