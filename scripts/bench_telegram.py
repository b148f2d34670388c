#!/usr/bin/env python3
"""Telegram inbound throughput: mapping, and mapping + pipeline steps 1-6.

Usage: python scripts/bench_telegram.py [--updates 20000] [--repeat 3]

A recorded stream of N Update objects (getUpdates payloads, 0.5-2.5 KB: direct messages
across 200 chats, group messages addressed by mention or by reply to the bot, unaddressed
group chatter, quotes, photos) is generated deterministically, then measured three ways in
one run, on one machine:

1. ``floor``    -- the named floor: ``json.loads`` + plain dict access building the same
                   fields (no validation, no UTF-16 entity handling, no reply rules);
2. ``mapping``  -- dshim's real mapping, :func:`protocol.parse_update` (msgspec views);
3. ``pipeline`` -- the channel's real batch path (``UpdateSource.batch``: parse and
                   offsets, then the kit's ``poll.accept_batch``: ``BotRuntime.accept`` =
                   steps 1-6 with dedup and the durable inbox in SQLite in its worker
                   thread, offset persisted per batch of 100), with the turn itself
                   (step 7) replaced by a no-op so only 1-6 are counted.

Figures: updates/s (wall) and CPU ms per update (process CPU, all threads), median of
``--repeat`` runs, with the ratio to the floor.  Environment is printed with the result.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchkit import Figures, counting_runtime, print_stream_line  # noqa: E402

from dshim.channels.kit.poll import accept_batch  # noqa: E402
from dshim.channels.telegram import channel, protocol  # noqa: E402
from dshim.channels.telegram.client import BotApiClient  # noqa: E402
from dshim.channels.telegram.protocol import BotIdentity  # noqa: E402
from dshim.log import configure_logging  # noqa: E402
from dshim.store import open_store  # noqa: E402
from dshim.store.base import BoundStore  # noqa: E402

BOT = {"id": 987654321, "is_bot": True, "first_name": "Dshim", "username": "DshimBot"}
ME = BotIdentity(987654321, "DshimBot")
T0 = 1_796_032_800
BATCH = 100

LOREM = (
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud "
    "exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat. 🧪 "
)


def make_stream(n: int, seed: int = 7) -> list[bytes]:
    """N Update objects as getUpdates returns them."""
    rng = random.Random(seed)
    out: list[bytes] = []
    for i in range(n):
        uid = 600_000_000 + i
        user = {
            "id": 1000 + rng.randrange(5000),
            "is_bot": False,
            "first_name": rng.choice(["Ada", "Bob", "Chen", "Dana"]),
            "last_name": rng.choice(["Lovelace", "Smith", "Wu", ""]) or None,
            "username": f"user{rng.randrange(10000)}",
            "language_code": "en",
        }
        user = {k: v for k, v in user.items() if v is not None}
        body = (LOREM * rng.randint(1, 8))[: rng.randint(200, 1800)]
        kind = rng.random()
        msg: dict[str, Any] = {"message_id": 10 + i, "from": user, "date": T0 + i // 100}
        if kind < 0.55:  # direct message
            msg["chat"] = {
                "id": 2000 + rng.randrange(200),
                "type": "private",
                "first_name": user["first_name"],
            }
            msg["text"] = body
        else:
            msg["chat"] = {
                "id": -1001000000000 - rng.randrange(50),
                "type": "supergroup",
                "title": "Research group",
            }
            if kind < 0.75:  # addressed by mention
                text = "@DshimBot " + body
                msg["text"] = text
                msg["entities"] = [
                    {"type": "mention", "offset": 0, "length": 9},
                    {"type": "bold", "offset": 12, "length": 5},
                ]
            elif kind < 0.85:  # reply to the bot, with a quote
                msg["text"] = body
                msg["reply_to_message"] = {
                    "message_id": 5 + i,
                    "from": BOT,
                    "chat": msg["chat"],
                    "date": T0 - 60,
                    "text": LOREM[:300],
                }
                msg["quote"] = {"text": LOREM[:40], "position": 0, "is_manual": True}
            elif kind < 0.9:  # a photo with a mention in the caption
                msg["caption"] = "@DshimBot what is this?"
                msg["caption_entities"] = [{"type": "mention", "offset": 0, "length": 9}]
                msg["photo"] = [
                    {
                        "file_id": f"AgACAgIAAxk{i}s",
                        "file_unique_id": f"s{i}",
                        "width": 90,
                        "height": 60,
                        "file_size": 1500,
                    },
                    {
                        "file_id": f"AgACAgIAAxk{i}m",
                        "file_unique_id": f"m{i}",
                        "width": 320,
                        "height": 213,
                        "file_size": 21000,
                    },
                    {
                        "file_id": f"AgACAgIAAxk{i}l",
                        "file_unique_id": f"l{i}",
                        "width": 1280,
                        "height": 853,
                        "file_size": 160000,
                    },
                ]
            else:  # unaddressed chatter
                msg["text"] = body
        out.append(json.dumps({"update_id": uid, "message": msg}, ensure_ascii=False).encode())
    return out


def floor_map(raw: bytes) -> dict[str, Any] | None:
    """The floor: json.loads and dict access for the same fields, nothing checked."""
    update = json.loads(raw)
    msg = update.get("message")
    if msg is None:
        return None
    chat = msg["chat"]
    sender = msg.get("from") or {}
    text = msg.get("text") or msg.get("caption") or ""
    entities = msg.get("entities") or msg.get("caption_entities") or []
    addressed = chat["type"] == "private" or any(
        e["type"] == "mention"
        and text[e["offset"] : e["offset"] + e["length"]].lower() == "@dshimbot"
        for e in entities
    )
    reply = msg.get("reply_to_message")
    name = " ".join(p for p in (sender.get("first_name"), sender.get("last_name")) if p)
    return {
        "message_id": str(msg["message_id"]),
        "conversation_id": str(chat["id"]),
        "conversation_type": "direct" if chat["type"] == "private" else "group",
        "sender_id": str(sender.get("id")),
        "sender_name": name or sender.get("username"),
        "addressed": addressed or bool(reply and reply.get("from", {}).get("id") == ME.id),
        "content": text,
        "reply_to": (reply.get("text") or reply.get("caption")) if reply else None,
        "received_at": float(msg["date"]),
    }


def bench_sync(fn: Callable[[bytes], Any], raws: list[bytes]) -> tuple[float, float]:
    """(updates/s, CPU ms per update) of a pure function over the stream."""
    c0, t0 = time.process_time(), time.perf_counter()
    for raw in raws:
        fn(raw)
    c1, t1 = time.process_time(), time.perf_counter()
    return len(raws) / (t1 - t0), (c1 - c0) * 1000 / len(raws)


async def bench_pipeline(raws: list[bytes]) -> tuple[float, float, dict[str, int]]:
    """(updates/s, CPU ms per update, verdict counts) through the channel's batch path."""
    with tempfile.TemporaryDirectory(prefix="dshim-bench-") as tmp:
        async with open_store(Path(tmp)) as store:
            async with (
                httpx.AsyncClient(base_url="http://127.0.0.1:9") as http,
                counting_runtime(
                    "telegram",
                    str(ME.id),
                    store,
                    clock=lambda: float(T0 + 60),
                    bot_username=ME.username,
                ) as (rt, verdicts),
            ):
                client = BotApiClient(http, "123456:BENCH-not-a-real-token-000000")
                # No migrations in the stream: the outbound is never asked.
                source = channel.UpdateSource(client, ME, None)  # type: ignore[arg-type]
                bound = BoundStore(store, rt.bot.name)
                cursor: str | None = None
                c0, t0 = time.process_time(), time.perf_counter()
                for i in range(0, len(raws), BATCH):
                    batch = source.batch(raws[i : i + BATCH], protocol.parse_offset(cursor))
                    cursor, _ = await accept_batch(
                        rt, bound, batch, cursor_name=channel.OFFSET_CURSOR, cursor=cursor
                    )
                await rt.wait_idle()
                c1, t1 = time.process_time(), time.perf_counter()
    return len(raws) / (t1 - t0), (c1 - c0) * 1000 / len(raws), verdicts


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> str:
    return (
        f"{min(values):,.0f}-{max(values):,.0f}"
        if values[0] > 50
        else f"{min(values):.4f}-{max(values):.4f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--updates", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    configure_logging("warning", "console")  # drops are logged at info: keep them out
    raws = make_stream(args.updates)
    sizes = [len(r) for r in raws]
    print_stream_line("bench_telegram", "updates", sizes, versions=f"; httpx {httpx.__version__}")

    def mapping(raw: bytes) -> Any:
        return protocol.parse_update(raw, ME)

    results = Figures()
    verdicts: dict[str, int] = {}
    for _ in range(args.repeat):
        for name, fn in (
            ("floor: json.loads + dict access", floor_map),
            ("mapping: protocol.parse_update", mapping),
        ):
            results.add(name, *bench_sync(fn, raws))
        rate, cpu, verdicts = trio.run(bench_pipeline, raws)
        results.add("pipeline: mapping + steps 1-6 (SQLite)", rate, cpu)

    floor_rate = median(results["floor: json.loads + dict access"][0])
    floor_cpu = median(results["floor: json.loads + dict access"][1])
    print(
        f"{'path':42} {'updates/s':>12} {'spread':>17} {'CPU ms/update':>14} {'vs floor (CPU)':>15}"
    )
    for name, (rates, cpus) in results.items():
        print(
            f"{name:42} {median(rates):12,.0f} {spread(rates):>17} {median(cpus):14.4f} "
            f"{median(cpus) / floor_cpu:14.2f}x"
        )
    mapping_cpu = median(results["mapping: protocol.parse_update"][1])
    print(
        f"# mapping is {floor_cpu / mapping_cpu:.2f}x the floor's speed "
        f"({median(results['mapping: protocol.parse_update'][0]) / floor_rate:.2f}x updates/s); "
        f"pipeline verdicts: {dict(sorted(verdicts.items()))}"
    )


if __name__ == "__main__":
    main()
