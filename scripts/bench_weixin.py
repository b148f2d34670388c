#!/usr/bin/env python3
"""WeChat (iLink) inbound throughput: getupdates reader + mapping + pipeline steps 1-6.

Usage: python scripts/bench_weixin.py [--messages 20000] [--repeat 3]

The fake iLink API (:mod:`dshim.testing.fakes.weixin`) runs in its own process, preloaded
with N WeixinMessage objects (0.3-2 KB: direct texts from 300 users, voice with
speech-to-text, images, quotes with snapshots and content-less shells, group chatter and
the bot's own echoes), answering ``getupdates`` 100 at a time.  Measured in one run:

1. ``floor``    -- raw transport + JSON decode: httpx POSTs ``getupdates`` with the cursor
                   and ``json.loads`` the answer (no mapping, no store);
2. ``floor + dedup`` -- the floor plus, per message, one SQLite ``INSERT OR IGNORE`` of
                   the dedup key (sender or group, message id) and the raw message on a
                   worker thread, WAL, synchronous=NORMAL (``benchkit.FloorDedup``): the
                   least a durable reader adds;
3. ``pipeline`` -- the channel's real reader: ``IlinkClient.get_updates`` (split, envelope),
                   ``UpdateSource.poll`` (msgspec mapping, ids to flush), the kit's
                   ``accept_batch`` = ``BotRuntime.accept`` (steps 1-6, dedup and the
                   durable inbox in SQLite, cursor persisted per batch) with, for each
                   accepted message, the newest context token per user persisted and
                   the message index recorded; the turn (step 7) is a no-op.

Figures: messages/s (wall) and CPU ms per message of this process (the fake's CPU is its
own), median of ``--repeat`` runs, with the ratio to the floor (the pipeline's: to the
floor + dedup).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchkit import Figures, counting_runtime, open_floor_dedup, print_stream_line  # noqa: E402

from dshim.channels.kit.poll import accept_batch  # noqa: E402
from dshim.channels.weixin import channel  # noqa: E402
from dshim.channels.weixin.client import USER_AGENT, IlinkClient  # noqa: E402
from dshim.channels.weixin.contexts import ContextBook  # noqa: E402
from dshim.channels.weixin.render import WeixinOutbound  # noqa: E402
from dshim.log import configure_logging  # noqa: E402
from dshim.net.http import open_http  # noqa: E402
from dshim.store import open_store  # noqa: E402
from dshim.store.base import BoundStore  # noqa: E402
from dshim.testing.fakes.weixin import TEST_TOKEN, open_fake_weixin  # noqa: E402

BOT_ID = "b0f5e7c1d2a3@im.bot"
T0_MS = 1_796_032_800_000
LOREM = (
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua. 你好，世界。 🧪 "
)


def make_stream(n: int, seed: int = 7) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    for i in range(n):
        ms = T0_MS + i * 10
        user = f"o9cq{rng.randrange(300):06d}@im.wechat"
        body = (LOREM * 10)[: rng.randint(100, 1500)]
        kind = rng.random()
        item: dict[str, Any] = {
            "type": 1,
            "msg_id": str((ms << 22) | 7),
            "text_item": {"text": body},
        }
        msg: dict[str, Any] = {
            "seq": i,
            "message_id": (ms << 22) | (i & 0x3FFFFF),
            "from_user_id": user,
            "to_user_id": BOT_ID,
            "create_time_ms": ms,
            "message_type": 1,
            "message_state": 2,
            "context_token": f"AARzJWAF{i:012d}{rng.getrandbits(64):016x}",
            "item_list": [item],
        }
        if kind < 0.1:
            item.clear()
            item.update(
                {
                    "type": 3,
                    "voice_item": {"text": body[:80], "media": {"encrypt_query_param": f"v{i}"}},
                }
            )
        elif kind < 0.18:
            item.clear()
            item.update(
                {
                    "type": 2,
                    "image_item": {"aeskey": "00" * 16, "media": {"encrypt_query_param": f"i{i}"}},
                }
            )
        elif kind < 0.3:
            item["ref_msg"] = {
                "svr_id": ((ms - 5000) << 22) | 1,
                "message_item": {"type": 1, "text_item": {"text": LOREM[:200]}},
            }
        elif kind < 0.38:
            item["ref_msg"] = {
                "svr_id": ((ms - 5000) << 22) | 2,
                "message_item": {"type": 8, "create_time_ms": ms - 5000},
            }
        elif kind < 0.45:
            msg["group_id"] = f"{rng.randrange(20)}@chatroom"
        elif kind < 0.5:
            msg["message_type"] = 2
        out.append(msg)
    return out


async def serve_fake(n: int) -> None:
    """The child process: the fake, preloaded, until stdin closes."""
    async with open_fake_weixin() as fake:
        for msg in make_stream(n):
            fake.log.append(msg)
        print(fake.url, flush=True)
        await trio.to_thread.run_sync(sys.stdin.read)


async def bench_floor(url: str, n: int, db: Path | None = None) -> tuple[float, float]:
    headers = {"Authorization": f"Bearer {TEST_TOKEN}", "AuthorizationType": "ilink_bot_token"}
    got = 0
    cursor = ""
    with open_floor_dedup(db) as dedup:
        async with httpx.AsyncClient(base_url=url) as http:
            c0, t0 = time.process_time(), time.perf_counter()
            while got < n:
                resp = await http.post(
                    "/ilink/bot/getupdates", json={"get_updates_buf": cursor}, headers=headers
                )
                data = json.loads(resp.content)
                got += len(data["msgs"])
                if dedup is not None:
                    for m in data["msgs"]:
                        conv = m.get("group_id") or m["from_user_id"]
                        await dedup.insert(conv, str(m["message_id"]), json.dumps(m).encode())
                cursor = data["get_updates_buf"]
            c1, t1 = time.process_time(), time.perf_counter()
    return n / (t1 - t0), (c1 - c0) * 1000 / n


async def bench_pipeline(url: str, n: int) -> tuple[float, float, dict[str, int]]:
    now = lambda: T0_MS / 1000 + 3600  # noqa: E731
    with tempfile.TemporaryDirectory(prefix="dshim-bench-") as tmp:
        async with open_store(Path(tmp)) as store, open_http(url, user_agent=USER_AGENT) as http:
            async with counting_runtime("weixin", BOT_ID, store, clock=now) as (rt, verdicts):
                bound = BoundStore(store, rt.bot.name)
                client = IlinkClient(http, TEST_TOKEN)
                book = ContextBook(
                    bound, credential="bench", clock=now, register_secret=lambda s: None
                )
                outbound = WeixinOutbound(client, book, bound, clock=now)
                decode = channel.mapper(
                    bot_id=BOT_ID, clock=now, fetcher_for=client.fetcher, loader_for=None
                )
                source = channel.UpdateSource(client, decode, outbound, now)
                inbound = channel.IndexingInbound(rt, bound, now, book)
                cursor: str | None = None
                seen = 0
                c0, t0 = time.process_time(), time.perf_counter()
                while seen < n:
                    batch = await source.poll(cursor)
                    seen += batch.arrived
                    cursor, _ = await accept_batch(
                        inbound, bound, batch, cursor_name=channel.CURSOR, cursor=cursor
                    )
                await rt.wait_idle()
                c1, t1 = time.process_time(), time.perf_counter()
    return n / (t1 - t0), (c1 - c0) * 1000 / n, verdicts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--serve-fake", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    configure_logging("warning", "console")
    if args.serve_fake:
        trio.run(serve_fake, args.messages)
        return
    sizes = [len(json.dumps(m, ensure_ascii=False).encode()) for m in make_stream(args.messages)]
    print_stream_line("bench_weixin", "messages", sizes, where="fake in its own process; ")
    results = Figures()
    verdicts: dict[str, int] = {}
    floor, dedup, pipeline = (
        "floor: httpx + json.loads",
        "floor + durable dedup (one SQLite INSERT/message)",
        "pipeline: reader + mapping + steps 1-6",
    )
    tmp = tempfile.TemporaryDirectory(prefix="dshim-bench-floor-")
    for rep in range(args.repeat):
        for name in (floor, dedup, pipeline):
            child = subprocess.Popen(
                [sys.executable, __file__, "--serve-fake", "--messages", str(args.messages)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            try:
                assert child.stdout is not None
                url = child.stdout.readline().strip()
                if name == floor:
                    rate, cpu = trio.run(bench_floor, url, args.messages)
                elif name == dedup:
                    db = Path(tmp.name) / f"floor-{rep}.sqlite3"
                    rate, cpu = trio.run(bench_floor, url, args.messages, db)
                else:
                    rate, cpu, verdicts = trio.run(bench_pipeline, url, args.messages)
            finally:
                assert child.stdin is not None
                child.stdin.close()
                child.wait(timeout=30)
            results.add(name, rate, cpu)
    tmp.cleanup()
    cpu = {name: statistics.median(cpus) for name, (_, cpus) in results.items()}
    print(
        f"{'path':50} {'messages/s':>11} {'CPU ms/message':>15} {'(min-max)':>15} "
        f"{'vs floor (CPU)':>15}"
    )
    for name, (rates, cpus) in results.items():
        base = cpu[dedup] if name == pipeline else cpu[floor]
        print(
            f"{name:50} {statistics.median(rates):11,.0f} {cpu[name]:15.4f} "
            f"{f'{min(cpus):.4f}-{max(cpus):.4f}':>15} {cpu[name] / base:14.2f}x"
        )
    print(
        "# the pipeline against floor + dedup, the rest against the floor; "
        f"pipeline verdicts: {dict(sorted(verdicts.items()))}"
    )


if __name__ == "__main__":
    main()
