"""``dshim serve --capture DIR`` as a real process: what it writes replays to what it did.

The bot is a Telegram bot pointed at the fake Bot API on 127.0.0.1 served by the test; the
process is the real console entry point (``python -m dshim``) with its own SQLite store
and the echo harness, whose answers are the prompts it received: what the fake recorded
as sent is what the harness got live.  After SIGINT a real ``dshim replay --check``
subprocess runs on the capture directory, and the prompts ``dshim replay`` prints are
compared with those answers byte for byte.  Real clock (processes), every test bounded by
``trio.fail_after``; nothing waits on a timer, only on what the fake or a file shows.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from contextlib import closing
from pathlib import Path
from typing import Any

import trio

from dshim.store import DB_FILENAME
from dshim.testing.fakes.telegram import TEST_TOKEN, FakeTelegram, open_fake_telegram

REPO = Path(__file__).resolve().parent.parent
ADA = FakeTelegram.user(42, "Ada", "Lovelace", "ada")
BOB = FakeTelegram.user(43, "Bob", "Babbage", "bob")
GROUP_ID = -1001234567890


def write_config(tmp_path: Path, api_base: str) -> Path:
    cfg = tmp_path / "dshim.toml"
    cfg.write_text(
        f'[dshim]\ndata_dir = "{tmp_path / "state"}"\nshutdown_grace_s = 1.0\n\n'
        '[http]\nlisten = "127.0.0.1:0"\n\n'
        '[[bots]]\nname = "tg"\nchannel = "telegram"\ntoken = "${DSHIM_TEST_TG_TOKEN}"\n'
        f'api_base = "{api_base}"\n'
    )
    return cfg


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSHIM_")}
    env["DSHIM_TEST_TG_TOKEN"] = TEST_TOKEN
    return env


async def start_serve(cfg: Path, log: Path, capture: Path) -> trio.Process:
    command = [sys.executable, "-m", "dshim", "--config", str(cfg), "--log-format", "json"]
    with log.open("ab") as stderr:  # the child keeps its own copy of the descriptor
        return await trio.lowlevel.open_process(
            [*command, "serve", "--capture", str(capture)],
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )


async def stop(proc: trio.Process, sig: int = signal.SIGINT) -> int:
    proc.send_signal(sig)
    with trio.fail_after(20):
        return await proc.wait()


async def replay(*args: str) -> subprocess.CompletedProcess[bytes]:
    return await trio.run_process(
        [sys.executable, "-m", "dshim", "replay", *args],
        cwd=REPO,
        env=_env(),
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


def answers(fake: FakeTelegram, chat_id: int) -> list[str]:
    return [m.text for m in fake.bot_messages(chat_id)]


def quote_without_text(
    fake: FakeTelegram, chat: dict[str, Any], sender: dict[str, Any], text: str, answer_id: int
) -> dict[str, Any]:
    """A reply to the bot's answer that arrives without the answer's text (as Telegram
    sends one it does not inline): the bot must recover it (index, else transcript)."""
    msg = fake.user_message(chat, sender, text, reply_to=answer_id)
    # The update is serialized when getUpdates answers; nothing ran since it was queued.
    quoted = msg["reply_to_message"]
    for key in ("text", "entities"):
        quoted.pop(key, None)
    return msg


def quoted(prompt: str) -> Any:
    """The ``content`` of the prompt's reply block (None: no such block)."""
    _, found, rest = prompt.partition("<dsh_im_reply_to>")
    if not found:
        return None
    return json.loads(rest.partition("</dsh_im_reply_to>")[0]).get("content")


async def polled_past(fake: FakeTelegram, update_id: int) -> None:
    """The bot confirmed ``update_id`` (asked for a later offset): it was judged."""
    await fake.wait_until(lambda: fake.confirmed(update_id))


async def test_serve_capture_replays_to_the_prompts_the_harness_received_live(
    tmp_path: Path,
) -> None:
    log = tmp_path / "serve.log"
    cap = tmp_path / "cap"
    with trio.fail_after(150):
        async with open_fake_telegram() as fake:
            cfg = write_config(tmp_path, fake.url)
            dm = fake.private_chat(ADA)
            bob = fake.private_chat(BOB)
            group = fake.group_chat(GROUP_ID, "Ops")
            proc = await start_serve(cfg, log, cap)
            try:
                await fake.wait_until(lambda: len(fake.calls_to("getUpdates")) >= 1)
                # A plain message.
                first = fake.user_message(dm, ADA, "list <two> things & stop")
                await fake.wait_until(lambda: len(answers(fake, 42)) == 1)
                [answer] = fake.bot_messages(42)
                # A quote of the bot's own answer without its text: from the index.
                quote_without_text(fake, dm, ADA, "why the second one?", answer.message_id)
                await fake.wait_until(lambda: len(answers(fake, 42)) == 2)
                # The same message delivered again (a poll that repeats an update): a
                # duplicate, judged and confirmed, never answered.
                again = fake.add_update({"message": first})
                await polled_past(fake, again)
                # A group message not addressed to the bot, then one that is.
                fake.user_message(group, ADA, "just chatting")
                fake.user_message(group, ADA, f"@{fake.bot['username']} and you?")
                await fake.wait_until(lambda: len(answers(fake, GROUP_ID)) == 1)
                # Bob's answer, which the next run finds only in the transcript.
                fake.user_message(bob, BOB, "remember the milk")
                await fake.wait_until(lambda: len(answers(fake, 43)) == 1)
                code = await stop(proc)
            finally:
                if proc.returncode is None:
                    proc.kill()
            assert code == 0, log.read_text()[-3000:]
            assert len(answers(fake, 42)) == 2  # the duplicate was not answered
            assert quoted(answers(fake, 42)[1]) == answer.text  # recovered from the index

            # The index forgets Bob's answer (as after its 30 days); the transcript keeps it.
            with closing(sqlite3.connect(tmp_path / "state" / DB_FILENAME)) as db, db:
                gone = db.execute("DELETE FROM outbound WHERE conversation_id = '43'").rowcount
            assert gone >= 1
            [milk] = fake.bot_messages(43)
            proc = await start_serve(cfg, log, cap)
            try:
                # Queued before the new process polls: its first answer carries it.
                quote_without_text(fake, bob, BOB, "which milk?", milk.message_id)
                await fake.wait_until(lambda: len(answers(fake, 43)) == 2)
                code = await stop(proc)
            finally:
                if proc.returncode is None:
                    proc.kill()
            assert code == 0, log.read_text()[-3000:]
            assert quoted(answers(fake, 43)[1]) == milk.text  # recovered from the transcript
            live = sorted(answers(fake, 42) + answers(fake, GROUP_ID) + answers(fake, 43))

    files = sorted(cap.rglob("*.json"))
    # Ada's chat, the group, Bob's chat in two parts (one per run).
    assert len(files) == 4, files
    checked = await replay("--check", str(cap))
    assert checked.returncode == 0, (checked.stdout + checked.stderr).decode()[-4000:]
    assert f"{len(files)} passed, 0 failed".encode() in checked.stdout
    printed = await replay(str(cap))
    assert printed.returncode == 0, printed.stderr.decode()[-3000:]
    lines = [json.loads(x) for x in printed.stdout.decode().splitlines()]
    # Byte for byte what the harness received live (its echo is what the fake was sent).
    assert sorted(x["text"] for x in lines if x["kind"] == "prompt") == live
    assert len(live) == 5
    reasons = sorted(x["reason"] for x in lines if x["kind"] == "drop")
    assert reasons == ["duplicate", "unaddressed"]
    # The second run's part of Bob's chat replays its quote from the captured transcript.
    [second] = [f for f in files if f.name.endswith(".2.json")]
    fx = json.loads(second.read_bytes())
    assert fx["history"] and not fx["outbound"]
    assert any(milk.text == row["text"] for rows in fx["history"].values() for row in rows)
    assert TEST_TOKEN.encode() not in b"".join(p.read_bytes() for p in files)


def _format_failures(stderr: str) -> list[str]:
    """``FAIL`` lines of ``dshim replay --check`` about the file itself (unreadable, no
    fixture, no expect list, a crash), not about the lines it replays to."""
    return [
        line
        for line in stderr.splitlines()
        if line.startswith("FAIL")
        and any(why in line for why in ("invalid fixture", "cannot read", "crashed", "no 'expect'"))
    ]


def _captured_bytes(cap: Path) -> int:
    total = 0
    for path in cap.rglob("*.json"):
        try:
            total += path.stat().st_size
        except FileNotFoundError:  # replaced between the listing and the stat
            pass
    return total


async def test_sigkill_under_load_leaves_valid_fixtures_and_the_next_start_cleans_up(
    tmp_path: Path,
) -> None:
    log = tmp_path / "serve.log"
    cap = tmp_path / "cap"
    users = [FakeTelegram.user(100 + i, f"User{i}") for i in range(8)]
    with trio.fail_after(150):
        async with open_fake_telegram() as fake:
            cfg = write_config(tmp_path, fake.url)
            chats = [fake.private_chat(u) for u in users]
            proc = await start_serve(cfg, log, cap)
            try:
                await fake.wait_until(lambda: len(fake.calls_to("getUpdates")) >= 1)
                sent = 0
                # Load: long messages in eight chats, a batch each time the bot made a
                # call, until the capture was rewritten many times (every write is each
                # changed file whole), then a kill at once, wherever its writer is.
                while _captured_bytes(cap) < 2_000_000:
                    calls = len(fake.calls)
                    for chat, user in zip(chats, users, strict=True):
                        fake.user_message(chat, user, f"message {sent} " + "x" * 3000)
                        sent += 1
                    await fake.wait_until(lambda: len(fake.calls) > calls)  # noqa: B023
                proc.kill()  # SIGKILL: no flush, no cleanup
                with trio.fail_after(20):
                    await proc.wait()
            finally:
                if proc.returncode is None:
                    proc.kill()
            assert proc.returncode == -signal.SIGKILL
            files = sorted(cap.rglob("*.json"))
            assert len(files) >= len(users)
            for path in files:
                fx = json.loads(path.read_bytes())
                assert fx["channel"] == "telegram" and fx["events"], path

            # Every file is a whole fixture: replay runs each (exit 0: none unreadable,
            # none crashed), and --check has no FAIL of the file's own (a turn the kill
            # cut may differ from its expect lines, nothing else).
            printed = await replay(str(cap))
            assert printed.returncode == 0, printed.stderr.decode()[-3000:]
            checked = await replay("--check", str(cap))
            summary = checked.stdout.decode().splitlines()[-1].split()
            # "<passed> passed, <failed> failed": every captured file was checked.
            assert int(summary[0]) + int(summary[2]) == len(files), summary
            assert _format_failures(checked.stderr.decode()) == []

            # A write the kill cut short leaves only its temporary file; the next start
            # removes every one (one planted too, in case the kill fell between writes).
            planted = files[0].with_name(f".{files[0].name}.tmp")
            planted.write_bytes(files[0].read_bytes()[:100])
            polls = len(fake.calls_to("getUpdates"))
            proc = await start_serve(cfg, log, cap)
            try:
                # The capture is prepared before any bot starts: by the first poll.
                await fake.wait_until(lambda: len(fake.calls_to("getUpdates")) > polls)
                assert log.read_text().count('"capture_started"') == 2
                assert list(cap.rglob("*.tmp")) == []
                code = await stop(proc)
            finally:
                if proc.returncode is None:
                    proc.kill()
            assert code == 0, log.read_text()[-3000:]
    # What the restart added (the updates the kill left unconfirmed) replays too.
    again = await replay(str(cap))
    assert again.returncode == 0, again.stderr.decode()[-3000:]
