#!/usr/bin/env python3
"""B9 big store and B9 retention: the store's lookups and writes as the store grows, and
a long soak that must keep the store file bounded.

Usage::

    python scripts/bench/big_store.py                 # B9: 10k/100k/1M rows, 5M keys, B1
    python scripts/bench/big_store.py --quick         # smaller counts, 1 repetition
    python scripts/bench/big_store.py --no-b1         # the in-process figures only
    python scripts/bench/big_store.py --soak 1000000  # B9 retention only

B9 builds a synthetic SQLite store through the store API (``set_binding``,
``record_turn`` with many index entries per call, ``accept_many``; concurrent calls are
committed together by the store), for bot ``telegram0`` over conversations ``10000`` ...
(the fake Telegram's chat ids, so B1's 200 chats are among them):

* the message index: 100 entries per conversation (user and bot alternately, one a
  minute);
* the transcript: every tenth conversation's session has 310 rows (3 full history pages),
  the others 76: ~1,000,000 rows at 10,000 conversations;
* the dedup table: 5,000,000 live keys (500 per conversation), added after the slope.

It measures, at 10k, 100k and 1M index rows (and as many transcript rows), the store
calls the pipeline makes (``dshim/reply.py`` ``_recover``, ``dshim/channels/kit/index.py``):

* quote recovery by id: ``list_outbound`` + the id match;
* quote recovery by time: ``list_outbound`` + the time-window match;
* history scan: ``transcript_page`` 3 pages of 100 rows, each before the last;

p50/p99 over random conversations, and the slope (ms per 10x store).  Then dedup
``accept`` (with a 2 KB raw event, then ``inbox_done``, as intake and the turn do) on an
empty store and on the store with 5M live keys, side by side in blocks that alternate;
the per-event store work of a turn (accept, begin_turn, mark_delivered, record_turn,
set_cursor) on a fresh and on the big store likewise; and B1 (``run.py``'s saturated
burst, 200 chats) with ``dshim`` on a fresh data directory and ``dshim+big`` on a copy of
the big store (``DSHIM_DATA_DIR``), interleaved.

``--soak N`` (B9 retention) runs N events' store work through one store on a simulated
clock (``--step`` seconds per event), over ``--soak-chats`` conversations with a new
session every ``--session-every`` events of a conversation (``/new``), the periodic
``prune`` every simulated hour, and prints the store file's size (database + WAL), the
row counts and the process's RSS every 100,000 events (``--every``).
"""

from __future__ import annotations

import argparse
import os
import platform as py_platform
import random
import resource
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from run import table  # noqa: E402 - the suite's Markdown table

from dshim.store import DB_FILENAME, open_store  # noqa: E402
from dshim.store.base import OutboundEntry, PromptRow, Store, TurnRecord  # noqa: E402

BOT = "telegram0"
#: The fake Telegram's first chat id (B1's chats are 10000 ...).
CONV0 = 10_000
INDEX_PER_CONV = 100
LONG_SESSION_ROWS = 310
SHORT_SESSION_ROWS = 76
DEDUP_PER_CONV = 500
TTL_S = 48 * 3600.0
RAW = b'{"update_id": 1, "message": {"text": "' + b"x" * 2000 + b'"}}'
#: How many builder tasks run at once (the store commits their calls together).
BUILDERS = 64


def conv(i: int) -> str:
    return str(CONV0 + i)


def session(i: int) -> str:
    return f"bench-session-{i}"


def transcript_rows(i: int) -> int:
    return LONG_SESSION_ROWS if i % 10 == 0 else SHORT_SESSION_ROWS


def rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def file_mb(data_dir: Path) -> float:
    db = data_dir / DB_FILENAME
    return sum(p.stat().st_size for p in (db, db.with_name(db.name + "-wal")) if p.exists()) / 1e6


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def fmt(values: list[float], digits: int = 3) -> str:
    """median (min–max)"""
    if not values:
        return "—"
    m = statistics.median(values)
    if len(values) == 1:
        return f"{m:,.{digits}f}"
    return f"{m:,.{digits}f} ({min(values):,.{digits}f}–{max(values):,.{digits}f})"


async def gather(jobs: list[Callable[[], Awaitable[None]]], width: int = BUILDERS) -> None:
    """Run the jobs ``width`` at a time (their store calls are committed together)."""
    it = iter(jobs)

    async def worker() -> None:
        for job in it:
            await job()

    async with trio.open_nursery() as nursery:
        for _ in range(width):
            nursery.start_soon(worker)


# -- building --------------------------------------------------------------------------------


def entry_time(t0: float, k: int) -> float:
    return t0 + 60.0 * k


async def build_conversations(store: Store, start: int, stop: int, t0: float) -> None:
    """Bindings, index entries and transcript rows of conversations ``start .. stop-1``."""

    async def one(i: int) -> None:
        c, s = conv(i), session(i)
        await store.set_binding(BOT, c, "", s, title=None, now=t0)
        entries = [
            OutboundEntry(
                message_ids=[f"{c}-{k}"],
                text=f"message {k} of conversation {c}: " + "lorem ipsum " * 8,
                sent_at=entry_time(t0, k),
                completed_at=entry_time(t0, k) + (0.0 if k % 2 == 0 else 2.0),
                inbound=k % 2 == 0,
                author_id="u" + c if k % 2 == 0 else None,
            )
            for k in range(INDEX_PER_CONV)
        ]
        now = entry_time(t0, INDEX_PER_CONV)
        turn = TurnRecord(
            session_id=None,
            user_text=None,
            user_at=now,
            answer_text=None,
            answer_at=now,
            completed=True,
            delivered=entries,
            inbox_done=[],
        )
        await store.record_turn(BOT, c, turn, now=now)
        for k in range(transcript_rows(i) // 2):
            at = entry_time(t0, 2 * k)
            turn = TurnRecord(
                session_id=s,
                user_text=f"question {k} " + "lorem ipsum " * 6,
                user_at=at,
                answer_text=f"answer {k} " + "dolor sit amet " * 10,
                answer_at=at + 2.0,
                completed=True,
                delivered=[],
                inbox_done=[],
            )
            await store.record_turn(BOT, c, turn, now=at + 2.0)

    await gather([lambda i=i: one(i) for i in range(start, stop)])


async def build_dedup(store: Store, convs: int, per_conv: int, now: float) -> None:
    """``per_conv`` live keys in each conversation, through ``accept_many`` (500 a call,
    one conversation's: a conversation's message ids arrive in order)."""

    async def one(i: int) -> None:
        for k in range(0, per_conv, 500):
            keys = [(conv(i), f"d{j:06d}", None) for j in range(k, min(per_conv, k + 500))]
            await store.accept_many(BOT, keys, now=now, ttl_s=TTL_S)

    await gather([lambda i=i: one(i) for i in range(convs)], width=8)


# -- measuring -------------------------------------------------------------------------------


async def measure_lookups(
    store: Store, convs: int, samples: int, t0: float, rng: random.Random
) -> dict[str, list[float]]:
    """ms per lookup: by id, by time, history scan (3 x 100)."""
    now = entry_time(t0, INDEX_PER_CONV) + 60.0
    out: dict[str, list[float]] = {k: [] for k in ("id", "time", "history")}
    out.update({k + "_cpu": [] for k in ("id", "time", "history")})
    found = 0
    for _ in range(samples):
        i = rng.randrange(convs)
        c = conv(i)
        k = rng.randrange(INDEX_PER_CONV)
        key = f"{c}-{k}"
        t, cpu = time.perf_counter(), time.process_time()
        entries = await store.list_outbound(BOT, c, now=now)
        matches = [e for e in entries if key in e.message_ids]
        out["id"].append((time.perf_counter() - t) * 1000)
        out["id_cpu"].append((time.process_time() - cpu) * 1000)
        found += len(matches) == 1
        qt = entry_time(t0, k | 1) + 1.0  # within one of the bot's answers
        t, cpu = time.perf_counter(), time.process_time()
        entries = await store.list_outbound(BOT, c, now=now)
        matches = [
            e for e in entries if not e.inbound and e.sent_at - 15.0 <= qt <= e.completed_at + 15.0
        ]
        out["time"].append((time.perf_counter() - t) * 1000)
        out["time_cpu"].append((time.process_time() - cpu) * 1000)
        found += len(matches) == 1
        j = rng.randrange(0, convs, 10)  # a long session: three full pages
        t, cpu = time.perf_counter(), time.process_time()
        before: int | None = None
        rows_read = 0
        for _page in range(3):
            rows = await store.transcript_page(session(j), before_id=before, limit=100)
            rows_read += len(rows)
            if len(rows) < 100:
                break
            before = min(r.id for r in rows)
        out["history"].append((time.perf_counter() - t) * 1000)
        out["history_cpu"].append((time.process_time() - cpu) * 1000)
        found += rows_read == 300
    if found != 3 * samples:
        raise RuntimeError(f"lookups found {found} of {3 * samples}: the store is not as built")
    return out


async def accept_block(
    store: Store, n: int, convs: int, serial: list[int], rng: random.Random
) -> list[float]:
    """ms per accept (2 KB raw) of ``n`` new keys in random conversations, each followed
    by its ``inbox_done`` (not timed)."""
    out: list[float] = []
    now = time.time()
    for _ in range(n):
        i = rng.randrange(convs)
        serial[0] += 1
        mid = f"new{serial[0]}"
        t = time.perf_counter()
        fresh = await store.accept(BOT, conv(i), mid, now=now, ttl_s=TTL_S, raw=RAW)
        out.append((time.perf_counter() - t) * 1000)
        if not fresh:
            raise RuntimeError("a new key was refused")
        await store.inbox_done(BOT, conv(i), mid)
    return out


async def event_block(
    store: Store, n: int, chats: int, serial: list[int], rng: random.Random
) -> list[float]:
    """ms of a turn's store work per event (accept, begin_turn, mark_delivered,
    record_turn with one index entry and the inbox done, set_cursor), over ``chats``
    conversations (B1's), each bound to its session."""
    out: list[float] = []
    for _ in range(n):
        i = rng.randrange(chats)
        c = conv(i)
        serial[0] += 1
        mid = f"ev{serial[0]}"
        now = time.time()
        t = time.perf_counter()
        await store.accept(BOT, c, mid, now=now, ttl_s=TTL_S, raw=RAW)
        keys = [(c, mid)]
        binding = await store.begin_turn(BOT, c, "", keys)
        s = binding.session_id if binding is not None else session(i)
        await store.mark_delivered(BOT, keys, prompt=PromptRow(session_id=s, text="hi", at=now))
        turn = TurnRecord(
            session_id=s,
            user_text=None,
            user_at=now,
            answer_text="hi " * 50,
            answer_at=now,
            completed=True,
            delivered=[
                OutboundEntry(
                    message_ids=[f"a{mid}"], text="hi " * 50, sent_at=now, completed_at=now
                )
            ],
            inbox_done=keys,
        )
        await store.record_turn(BOT, c, turn, now=now)
        await store.set_cursor(BOT, "offset", str(serial[0]))
        out.append((time.perf_counter() - t) * 1000)
    return out


async def side_by_side(
    fn: Callable[[Store, int, list[float]], Awaitable[list[float]]],
    stores: dict[str, Store],
    blocks: int,
) -> dict[str, list[float]]:
    """Alternate blocks of ``fn`` on each store (drift hits both alike); all samples."""
    out: dict[str, list[float]] = {k: [] for k in stores}
    for b in range(blocks):
        for name in list(stores) if b % 2 == 0 else reversed(list(stores)):
            samples: list[float] = []
            out[name] += await fn(stores[name], b, samples)
    return out


def lookup_rows(label: str, rows_n: int, m: dict[str, list[float]]) -> list[str]:
    return [
        label,
        f"{rows_n:,}",
        *(
            f"{statistics.median(m[k]):.3f} / {pct(m[k], 0.99):.3f}"
            f" ({pct(m[k + '_cpu'], 0.99):.3f})"
            for k in ("id", "time", "history")
        ),
    ]


# -- B9 --------------------------------------------------------------------------------------


async def b9(args: argparse.Namespace, work: Path) -> Path:
    """Build, measure; returns the big store's data directory."""
    rng = random.Random(9)
    big = work / "big"
    t0 = time.time() - 30 * 86400.0 + 7200.0  # well within the index's 30 days
    sizes = [int(s) for s in args.sizes.split(",")]
    results: list[tuple[int, int, dict[str, list[float]]]] = []
    build_s = build_cpu = 0.0
    async with open_store(big) as store:
        built = 0
        for convs in sizes:
            t, cpu = time.perf_counter(), time.process_time()
            await build_conversations(store, built, convs, t0)
            dt = time.perf_counter() - t
            build_s += dt
            build_cpu += time.process_time() - cpu
            rows_t = sum(transcript_rows(i) // 2 * 2 for i in range(convs))
            print(
                f"built {convs:,} conversations ({convs * INDEX_PER_CONV:,} index rows, "
                f"{rows_t:,} transcript rows) in {build_s:.1f} s total, {build_cpu:.1f} s CPU "
                f"(+{dt:.1f} s), file {file_mb(big):.0f} MB, RSS {rss_mb():.0f} MB",
                flush=True,
            )
            built = convs
            await measure_lookups(store, convs, 200, t0, rng)  # warm
            m = await measure_lookups(store, convs, args.samples, t0, rng)
            results.append((convs, convs * INDEX_PER_CONV, m))
        rows = [lookup_rows(f"{c:,} conversations", n, m) for c, n, m in results]
        table(
            "B9 lookups by store size (ms: p50 / p99 wall time (p99 CPU time of the process))",
            ["store", "index rows", "quote by id", "quote by time", "history 3x100"],
            rows,
        )
        if len(results) >= 2:
            (_, n0, m0), (_, n1, m1) = results[0], results[-1]
            decades = max(1e-9, __import__("math").log10(n1 / n0))
            slope = [
                f"{(pct(m1[k], 0.99) - pct(m0[k], 0.99)) / decades:+.3f}"
                f" / {(statistics.median(m1[k]) - statistics.median(m0[k])) / decades:+.3f}"
                for k in ("id", "time", "history")
            ]
            table(
                f"B9 slope: ms per 10x store, p99 / p50 ({n0:,} -> {n1:,} rows)",
                ["", "quote by id", "quote by time", "history 3x100"],
                [["slope", *slope]],
            )
        convs = sizes[-1]
        per_conv = max(1, args.keys // convs)
        t, cpu = time.perf_counter(), time.process_time()
        await build_dedup(store, convs, per_conv, time.time())
        dt = time.perf_counter() - t
        print(
            f"built {convs * per_conv:,} live dedup keys in {dt:.1f} s "
            f"({time.process_time() - cpu:.1f} s CPU), "
            f"file {file_mb(big):.0f} MB, RSS {rss_mb():.0f} MB",
            flush=True,
        )
        async with open_store(work / "empty") as empty:
            stores = {"empty store": empty, f"{convs * per_conv:,} live keys": store}
            serial = [0]

            async def acc(s: Store, b: int, _: list[float]) -> list[float]:
                return await accept_block(s, args.accepts, convs, serial, rng)

            await acc(empty, 0, [])  # warm both
            await acc(store, 0, [])
            got = await side_by_side(acc, stores, args.blocks)
            base = statistics.median(got["empty store"])
            table(
                f"B9 dedup accept (2 KB raw), {args.blocks} alternating blocks of {args.accepts}",
                ["store", "p50 ms", "p99 ms", "mean ms", "p50 vs empty"],
                [
                    [
                        k,
                        f"{statistics.median(v):.3f}",
                        f"{pct(v, 0.99):.3f}",
                        f"{statistics.fmean(v):.3f}",
                        f"{statistics.median(v) / base:.2f}x",
                    ]
                    for k, v in got.items()
                ],
            )
        # The periodic sweep on the big store: the first after a start looks at every
        # session (transcript_keep), a later one at the sessions written since.
        spent = []
        for _ in range(2):
            t = time.perf_counter()
            await store.prune(now=time.time())
            spent.append(time.perf_counter() - t)
        print(
            f"prune on the big store: the first {spent[0] * 1000:.0f} ms (every session), "
            f"the next {spent[1] * 1000:.0f} ms",
            flush=True,
        )
        # A fresh store with the same 200 bound sessions (B1's chats), nothing else.
        async with open_store(work / "fresh") as fresh:
            for i in range(200):
                await fresh.set_binding(BOT, conv(i), "", session(i), title=None, now=t0)
            stores = {"fresh store": fresh, "big store": store}
            serial = [0]

            async def ev(s: Store, b: int, _: list[float]) -> list[float]:
                return await event_block(s, args.events, 200, serial, rng)

            await ev(fresh, 0, [])
            await ev(store, 0, [])
            got = await side_by_side(ev, stores, args.blocks)
            base = statistics.median(got["fresh store"])
            table(
                f"B9 a turn's store work per event, {args.blocks} alternating blocks of "
                f"{args.events} over 200 chats",
                ["store", "p50 ms", "p99 ms", "mean ms", "p50 vs fresh"],
                [
                    [
                        k,
                        f"{statistics.median(v):.3f}",
                        f"{pct(v, 0.99):.3f}",
                        f"{statistics.fmean(v):.3f}",
                        f"{statistics.median(v) / base:.2f}x",
                    ]
                    for k, v in got.items()
                ],
            )
    print(f"big store: {file_mb(big):.0f} MB, built in {build_s:.1f} s (+ the keys)", flush=True)
    return big


def b1_side_by_side(big: Path, work: Path, reps: int, n: int) -> None:
    """run.py's B1 (200 chats) with dshim on a fresh data directory and on a copy of the
    big store, interleaved."""
    import run as suite  # the suite's own runner

    copies: list[Path] = []

    def big_copy() -> dict[str, str]:
        dest = work / f"b1-big-{len(copies)}"
        t = time.perf_counter()
        shutil.copytree(big, dest)
        copies.append(dest)
        print(f"  copied the big store in {time.perf_counter() - t:.1f} s", flush=True)
        return {"DSHIM_DATA_DIR": str(dest)}

    (fresh,) = suite.candidates(["dshim"], {}, work)
    bigc = suite.Candidate(
        "dshim+big", fresh.argv, version=fresh.version, platform="any", env_per_run=big_copy
    )
    results: dict[str, list[dict[str, Any]]] = {"dshim": [], "dshim+big": []}
    for rep in range(reps):
        for cand in (fresh, bigc) if rep % 2 == 0 else (bigc, fresh):
            r = suite.run_once(cand, ["--updates", str(n), "--chats", "200"], 180)
            results[cand.name].append(r)
            print(
                f"  B1 rep {rep + 1} {cand.name}: {r['replies']}/{n} in {r['elapsed_s']:.2f} s",
                flush=True,
            )
            while copies:
                shutil.rmtree(copies.pop(), ignore_errors=True)
    eps = {k: [r["replies"] / r["elapsed_s"] for r in v] for k, v in results.items()}
    cpu = {k: [r["cpu_ms_per_event"] for r in v] for k, v in results.items()}
    rows = []
    for name in results:
        rows.append(
            [
                name,
                fmt(eps[name], 0),
                fmt(cpu[name], 2),
                fmt([r["peak_rss_mb"] for r in results[name]], 0),
                str(sum(r["duplicates"] for r in results[name])),
                "yes" if all(r["in_order"] for r in results[name]) else "NO",
                f"{statistics.median(eps[name]) / statistics.median(eps['dshim']):.2f}x",
                f"{statistics.median(cpu[name]) / statistics.median(cpu['dshim']):.2f}x",
            ]
        )
    table(
        f"B9 B1 saturated echo on a fresh and on the big store, {n} updates, 200 chats",
        [
            "candidate",
            "events/s",
            "CPU ms/event",
            "peak RSS MB",
            "dupes",
            "order",
            "this/fresh events/s",
            "this/fresh CPU",
        ],
        rows,
    )


# -- B9 retention ----------------------------------------------------------------------------


def row_counts(data_dir: Path) -> dict[str, int]:
    with sqlite3.connect(f"{(data_dir / DB_FILENAME).as_uri()}?mode=ro", uri=True) as conn:
        out = {
            t: int(conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0])  # noqa: S608
            for t in ("dedup", "outbound", "transcript", "bindings", "inbox")
        }
        out["free_pages"] = int(conn.execute("PRAGMA freelist_count").fetchone()[0])
        out["pages"] = int(conn.execute("PRAGMA page_count").fetchone()[0])
    return out


async def soak(args: argparse.Namespace, work: Path) -> None:
    """N events' store work on a simulated clock, prune every simulated hour."""
    data = work / "soak"
    n, chats, step = args.soak, args.soak_chats, args.step
    t0 = time.time() - n * step  # the simulated clock ends about now
    sessions = {i: 0 for i in range(chats)}
    counts = {i: 0 for i in range(chats)}
    print(
        f"soak: {n:,} events over {chats:,} conversations, {step:g} s simulated per event "
        f"({n * step / 86400:.1f} days), a new session every {args.session_every} events of a "
        f"conversation, prune every simulated hour",
        flush=True,
    )
    header = ["events", "file MB", "RSS MB", "dedup", "index", "transcript", "free pages", "s"]
    rows: list[list[str]] = []
    started = time.perf_counter()
    async with open_store(data) as store:
        nxt = [0]

        async def event(k: int) -> None:
            i = k % chats
            counts[i] += 1
            c, mid, now = conv(i), f"m{k}", t0 + k * step
            if counts[i] % args.session_every == 1:  # /new: a new session
                sessions[i] += 1
                s = f"{session(i)}.{sessions[i]}"
                await store.set_binding(BOT, c, "", s, title=None, now=now)
            await store.accept(BOT, c, mid, now=now, ttl_s=TTL_S, raw=RAW[:600])
            keys = [(c, mid)]
            binding = await store.begin_turn(BOT, c, "", keys)
            assert binding is not None
            s = binding.session_id
            await store.mark_delivered(
                BOT, keys, prompt=PromptRow(session_id=s, text=f"question {k}", at=now)
            )
            inbound = OutboundEntry(
                message_ids=[mid],
                text=f"question {k}",
                sent_at=now,
                completed_at=now,
                inbound=True,
                author_id="u" + c,
            )
            answer = OutboundEntry(
                message_ids=[f"a{k}"], text="answer " * 30, sent_at=now, completed_at=now + 1
            )
            turn = TurnRecord(
                session_id=s,
                user_text=None,
                user_at=now,
                answer_text="answer " * 30,
                answer_at=now + 1,
                completed=True,
                delivered=[inbound, answer],
                inbox_done=keys,
            )
            await store.record_turn(BOT, c, turn, now=now + 1)
            await store.set_cursor(BOT, "offset", str(k))

        async def worker(stop: int) -> None:
            while nxt[0] < stop:
                k = nxt[0]
                nxt[0] += 1
                await event(k)

        hour = max(1, int(3600.0 / step))
        while nxt[0] < n:
            stop = min(n, nxt[0] + hour)
            async with trio.open_nursery() as nursery:
                for _ in range(16):  # conversations k % chats: 16 different ones at a time
                    nursery.start_soon(worker, stop)
            await store.prune(now=t0 + stop * step)
            if stop % args.every < hour or stop == n:
                c = row_counts(data)
                rows.append(
                    [
                        f"{stop:,}",
                        f"{file_mb(data):.1f}",
                        f"{rss_mb():.0f}",
                        f"{c['dedup']:,}",
                        f"{c['outbound']:,}",
                        f"{c['transcript']:,}",
                        f"{c['free_pages']:,} / {c['pages']:,}",
                        f"{time.perf_counter() - started:.0f}",
                    ]
                )
                print("  " + " | ".join(rows[-1]), flush=True)
    table(f"B9 retention soak: {n:,} events", header, rows)
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"peak RSS {maxrss:.0f} MB; soak took {time.perf_counter() - started:.0f} s")


def versions() -> str:
    import dshim

    return (
        f"nproc {os.cpu_count()}, Python {py_platform.python_version()}, "
        f"SQLite {sqlite3.sqlite_version}, trio {trio.__version__}, "
        f"dshim {getattr(dshim, '__version__', '?')}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller counts, 1 B1 repetition")
    p.add_argument("--sizes", default=None, help="conversations per step (100,1000,10000)")
    p.add_argument("--keys", type=int, default=None, help="live dedup keys (5,000,000)")
    p.add_argument("--samples", type=int, default=None, help="lookups per size (2,000)")
    p.add_argument("--accepts", type=int, default=None, help="accepts per block (2,000)")
    p.add_argument("--events", type=int, default=None, help="events per block (1,000)")
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--reps", type=int, default=None, help="B1 repetitions (3)")
    p.add_argument("--updates", type=int, default=None, help="B1 updates (4,000)")
    p.add_argument("--no-b1", action="store_true", help="skip the B1 processes")
    p.add_argument("--soak", type=int, default=None, help="B9 retention only: N events")
    p.add_argument("--soak-chats", type=int, default=1000)
    p.add_argument("--step", type=float, default=5.0, help="simulated seconds per event")
    p.add_argument("--session-every", type=int, default=400)
    p.add_argument("--every", type=int, default=100_000)
    p.add_argument("--workdir", default=None, help="keep the stores here (default: a temp dir)")
    args = p.parse_args(argv)
    q = args.quick
    args.sizes = args.sizes or ("100,1000,3000" if q else "100,1000,10000")
    args.keys = args.keys if args.keys is not None else (500_000 if q else 5_000_000)
    args.samples = args.samples or (500 if q else 2000)
    args.accepts = args.accepts or (500 if q else 2000)
    args.events = args.events or (300 if q else 1000)
    args.reps = args.reps or (1 if q else 3)
    args.updates = args.updates or (1000 if q else 4000)
    print(f"# B9 big store — {time.strftime('%Y-%m-%d %H:%M')}")
    print(versions(), flush=True)
    with tempfile.TemporaryDirectory(prefix="dshim-b9-", dir=args.workdir) as tmp:
        work = Path(tmp)
        if args.soak:
            trio.run(soak, args, work)
            return
        big = trio.run(b9, args, work)
        if not args.no_b1:
            b1_side_by_side(big, work, args.reps, args.updates)


if __name__ == "__main__":
    main()
