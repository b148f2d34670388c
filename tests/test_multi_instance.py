"""Several ``dshim serve`` processes on one PostgreSQL store (issue 32), as operators run them.

Testing manifesto: real processes (``python -m dshim serve --instance NAME``, each with a
data directory of its own) against one real PostgreSQL (the session's throwaway cluster)
and six Telegram bots on fake Bot APIs on 127.0.0.1 (in the test's process).  Leases of
3 s (renewed every second) keep the waits short.  An instance is killed with SIGKILL
(nothing released: its leases run out), paused with SIGSTOP.  Every message is a distinct
text, and the echo harness answers each with exactly what it received, so "0 lost, 0
duplicate" is read off the fakes: every text answered exactly once.  The real clock, hard
deadlines.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
import trio

from dshim.pipeline.recovery import INTERRUPTED_TEXT
from dshim.testing.fakes.telegram import TEST_TOKEN, FakeTelegram, open_fake_telegram
from tests.pgkit import PgCluster

LEASE_S = 3
BOTS = 6
USER = FakeTelegram.user(5001, "Ada")


def write_config(path: Path, url: str, fakes: list[FakeTelegram]) -> Path:
    lines = [
        "[dshim]\nshutdown_grace_s = 2\nbacklog_max_age_s = 3600\n",
        "[http]\nenabled = false\n",
        f'[store]\nurl = "{url}"\nlease_s = {LEASE_S}\n',
    ]
    for i, fake in enumerate(fakes):
        lines.append(
            f'[[bots]]\nname = "tg{i}"\nchannel = "telegram"\ntoken = "{TEST_TOKEN}"\n'
            f'api_base = "{fake.url}"\n'
        )
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


@dataclass
class Proc:
    name: str
    process: trio.Process
    log: Path


class Cluster:
    """The dshim processes of one test."""

    def __init__(self, config: Path, tmp_path: Path) -> None:
        self.config = config
        self.tmp_path = tmp_path
        self.procs: dict[str, Proc] = {}
        #: Every process started, restarted ones' predecessors too (all are reaped).
        self.started: list[Proc] = []

    async def start(self, name: str) -> Proc:
        log = self.tmp_path / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSHIM_")}
        with log.open("ab") as out:
            process = await trio.lowlevel.open_process(
                [
                    sys.executable,
                    "-m",
                    "dshim",
                    "--config",
                    str(self.config),
                    "--data-dir",
                    str(self.tmp_path / f"data-{name}"),
                    "--log-format",
                    "json",
                    "serve",
                    "--instance",
                    name,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        proc = self.procs[name] = Proc(name, process, log)
        self.started.append(proc)
        return proc

    def kill(self, name: str) -> None:
        self.procs[name].process.send_signal(signal.SIGKILL)

    async def stop_all(self) -> None:
        for proc in self.started:
            if proc.process.returncode is None:
                proc.process.send_signal(signal.SIGCONT)
                proc.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(20):
            for proc in self.started:
                await proc.process.wait()
        for proc in self.started:
            if proc.process.returncode is None:
                proc.process.kill()
                await proc.process.wait()


def holders(cluster: PgCluster, url: str) -> dict[str, str]:
    """bot -> the instance holding its unexpired lease (the database's clock); nothing
    before the first instance created the schema."""
    try:
        rows = cluster.query(
            url,
            "SELECT bot, owner FROM leases"
            " WHERE expires_at > extract(epoch from clock_timestamp())",
        )
    except psycopg.errors.UndefinedTable:
        return {}
    return {str(bot): str(owner) for bot, owner in rows}


def answered(fakes: list[FakeTelegram]) -> list[str]:
    """Every text the bots sent the user, over all bots."""
    return [m.text for fake in fakes for m in fake.bot_messages(USER["id"])]


def outcomes(fakes: list[FakeTelegram], sent: dict[str, tuple[int, int]]) -> dict[str, str]:
    """What became of each text ``send`` sent: ``answered`` (exactly one answer ends with
    it; an interruption notice may follow it when the instance died after the platform
    took the answer but before that was recorded), ``notice`` (no answer, but the
    interruption notice under it: the instance died between marking the answer shown and
    the platform taking it, so the user is asked to send it again -- the restart rule),
    ``lost`` (nothing) or ``duplicate`` (two answers)."""
    out = {}
    for text, (bot, message_id) in sent.items():
        messages = fakes[bot].bot_messages(USER["id"])
        answers = sum(m.text.endswith(text) for m in messages)
        notices = sum(
            m.text == INTERRUPTED_TEXT and m.reply_to_message_id == message_id for m in messages
        )
        if answers > 1:
            out[text] = "duplicate"
        elif answers == 1:
            out[text] = "answered"
        else:
            out[text] = "notice" if notices == 1 else "lost"
    return out


async def poll(predicate: object, *, every: float = 0.25) -> None:
    """Wait until ``predicate()`` holds (processes and a database: nothing to wait on)."""
    while not predicate():  # type: ignore[operator]  # noqa: ASYNC110
        await trio.sleep(every)


@asynccontextmanager
async def six_bots(
    pg_cluster: PgCluster, tmp_path: Path
) -> AsyncIterator[tuple[list[FakeTelegram], Cluster, str]]:
    url = pg_cluster.fresh_url()
    async with AsyncExitStack() as stack:
        fakes = [await stack.enter_async_context(open_fake_telegram()) for _ in range(BOTS)]
        config = write_config(tmp_path / "dshim.toml", url, fakes)
        cluster = Cluster(config, tmp_path)
        try:
            yield fakes, cluster, url
        finally:
            with trio.CancelScope(shield=True):
                await cluster.stop_all()


def send(
    fakes: list[FakeTelegram], texts: list[str], sent: dict[str, tuple[int, int]] | None = None
) -> None:
    """Each text to the next bot; ``sent`` records (bot, message id) of each."""
    for n, text in enumerate(texts):
        bot = n % len(fakes)
        msg = fakes[bot].user_message(fakes[bot].private_chat(USER), USER, text)
        if sent is not None:
            sent[text] = (bot, int(msg["message_id"]))


async def test_three_instances_answer_every_message_once_through_kills_and_a_joiner(
    pg_cluster: PgCluster, tmp_path: Path
) -> None:
    with trio.fail_after(240):
        async with six_bots(pg_cluster, tmp_path) as (fakes, cluster, url):
            for name in ("a", "b", "c"):
                await cluster.start(name)

            def balanced(names: tuple[str, ...], most: int) -> bool:
                owners = list(holders(pg_cluster, url).values())
                return len(owners) == BOTS and all(owners.count(n) <= most for n in names)

            await poll(lambda: balanced(("a", "b", "c"), 3))
            texts = [f"message {k:03d}" for k in range(300)]
            sent: dict[str, tuple[int, int]] = {}
            send(fakes, texts[:100], sent)
            await poll(lambda: len(answered(fakes)) >= 60)
            cluster.kill("a")  # turns in flight, nothing released
            send(fakes, texts[100:200], sent)
            await poll(lambda: len(answered(fakes)) >= 170)
            cluster.kill("b")
            await cluster.start("a")  # a comes back (same name, same data directory)
            send(fakes, texts[200:300], sent)
            with trio.move_on_after(45):
                await poll(lambda: "lost" not in outcomes(fakes, sent).values())
            await cluster.start("d")  # a fourth joins: it gets its share
            await poll(lambda: "d" in holders(pg_cluster, url).values())
            await trio.sleep(2 * LEASE_S)
            final = outcomes(fakes, sent)
            share = list(holders(pg_cluster, url).values())
            shown = await trio.run_process(
                [sys.executable, "-m", "dshim", "--config", str(cluster.config), "status"],
                capture_stdout=True,
                env={k: v for k, v in os.environ.items() if not k.startswith("DSHIM_")},
            )
    lost_or_twice = {x: o for x, o in final.items() if o in ("lost", "duplicate")}
    assert lost_or_twice == {}  # 0 lost, 0 duplicate
    # A notice instead of the answer only where an instance died inside a send.
    assert sum(o == "notice" for o in final.values()) <= 4
    table = shown.stdout.decode()
    assert all(f"\n{n}  " in table for n in ("a", "c", "d"))  # the live instances
    assert "tg0  " in table and "(free)" not in table
    assert share.count("d") >= 1 and all(share.count(n) <= 3 for n in ("a", "c", "d"))


async def test_a_paused_instance_wakes_up_fenced_and_sends_nothing(
    pg_cluster: PgCluster, tmp_path: Path
) -> None:
    with trio.fail_after(180):
        async with six_bots(pg_cluster, tmp_path) as (fakes, cluster, url):
            stopped = await cluster.start("p")
            await poll(lambda: len(holders(pg_cluster, url)) == BOTS)  # p holds all six
            await cluster.start("q")
            await poll(lambda: "q" in holders(pg_cluster, url).values())
            await poll(lambda: list(holders(pg_cluster, url).values()).count("p") == BOTS // 2)
            p_bots = [b for b, owner in holders(pg_cluster, url).items() if owner == "p"]
            # An answer streaming in p when it is paused: woken without the cut, p would
            # go on editing it.
            busy = fakes[int(p_bots[0][2:])]
            busy.user_message(busy.private_chat(USER), USER, "echo:slow 30 a long story")
            await poll(lambda: len(busy.bot_messages(USER["id"])) == 1)
            stopped.process.send_signal(signal.SIGSTOP)
            await poll(lambda: set(holders(pg_cluster, url).values()) == {"q"})
            # q takes the bot over and puts the interruption notice under the message.
            await poll(
                lambda: any(m.text == INTERRUPTED_TEXT for m in busy.bot_messages(USER["id"]))
            )
            texts = [f"while p sleeps {k}" for k in range(12)]
            send(fakes, texts)
            await poll(lambda: all(any(t.endswith(x) for t in answered(fakes)) for x in texts))
            sent_before = {id(f): len(f.calls_to("sendMessage", "editMessageText")) for f in fakes}
            stopped.process.send_signal(signal.SIGCONT)
            await trio.sleep(3 * LEASE_S)
            counts = {x: sum(t.endswith(x) for t in answered(fakes)) for x in texts}
            sent_after = {id(f): len(f.calls_to("sendMessage", "editMessageText")) for f in fakes}
    assert p_bots
    assert [x for x, n in counts.items() if n != 1] == []
    assert sent_after == sent_before  # the woken instance sent nothing (it may hold bots
    # again by now, with new epochs: balancing gives it its share back)
    log = stopped.log.read_text(encoding="utf-8")
    assert '"lease_lost"' in log or '"bot_cut_lease_lost"' in log
