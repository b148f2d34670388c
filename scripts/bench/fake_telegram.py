#!/usr/bin/env python3
"""The benchmark's fake Bot API, in its own process: dshim's own ``FakeTelegram``.

Usage (the suite runs it; one JSON object per stdout line)::

    python scripts/bench/fake_telegram.py --updates 4000 --chats 200 [--rate 0] [--hold 3.5]
        [--text-bytes 2100] [--layout round-robin|b2] [--sleep S [--varied]] [--timeout 120]

1. prints ``{"url": ...}`` and serves 127.0.0.1 (port 0);
2. waits for the candidate's first ``getUpdates`` (prints ``{"first_poll": t}``, a
   ``perf_counter`` time, comparable across processes), then ``--hold`` seconds (the idle
   hold the suite measures CPU after), prints ``{"released": t}``;
3. makes the updates available: all at once (``--rate 0``, saturated) or ``--rate`` per
   second; each is a private message "ping K ..." of about ``--text-bytes`` bytes from one
   of ``--chats`` users (``--prefix`` goes in front of the text, e.g. ``echo:sleep 2``);
4. counts the bot's replies (the "ping K" they echo) and prints ``{"done": {...}}`` —
   replies, duplicates, per-chat order, latency from availability to reply (p50/p99,
   ms), the time from release to the last reply — when every update was answered or
   ``--timeout`` passed; then exits.

Soak (B7): ``--window W`` keeps at most W updates unanswered (the next ones are made
available as replies come in), ``--progress N`` prints ``{"progress": n, "t": ...}``
every N replies (the suite samples the candidate's RSS then).

Nothing here reaches the internet.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dshim.testing.fakes.telegram import (  # noqa: E402
    TEST_TOKEN,
    FakeMessage,
    FakeTelegram,
    open_fake_telegram,
)

_PING = re.compile(r"ping (\d+) ")


def chat_of(k: int, args: argparse.Namespace) -> int:
    """Which user sends update ``k``: round robin, one chat, or B2's layout (one message
    in each chat, then the extra ones in chat 0)."""
    if args.one_chat:
        return 0
    if args.layout == "b2":
        return k if k < args.chats else 0
    return k % args.chats


def directive(k: int, args: argparse.Namespace) -> str:
    """The agent latency every candidate honours: ``echo:sleep S`` in front of the text."""
    if args.sleep <= 0:
        return ""
    seconds = 1.0 + (k * 7 % 21) / 10 if args.varied else args.sleep
    return f"echo:sleep {seconds:.1f} "


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


async def main(args: argparse.Namespace) -> None:
    start_chat = 10_000
    users = [FakeTelegram.user(start_chat + i, f"User{i}") for i in range(args.chats)]
    filler = "x" * max(0, args.text_bytes - 40)
    available: dict[int, float] = {}
    answered: dict[int, float] = {}
    order: dict[int, list[int]] = {}
    first_reply: dict[int, float] = {}
    duplicates = 0
    all_done = trio.Event()
    room = [trio.Event()]

    def on_reply(msg: FakeMessage) -> None:
        nonlocal duplicates
        m = _PING.search(msg.text)
        if m is None:
            return
        k = int(m.group(1))
        if k in answered:
            duplicates += 1
            return
        answered[k] = time.perf_counter()
        chat = msg.data["chat"]["id"]
        order.setdefault(chat, []).append(k)
        first_reply.setdefault(chat, answered[k])
        room[0].set()
        if args.progress and len(answered) % args.progress == 0:
            emit({"progress": len(answered), "t": answered[k]})
        if len(answered) >= args.updates:
            all_done.set()

    async with open_fake_telegram(token=args.token) as fake:
        fake.on_bot_message = on_reply
        chats = [fake.private_chat(u) for u in users]
        emit({"url": fake.url})
        with trio.move_on_after(args.timeout) as waiting:
            await fake.wait_until(lambda: bool(fake.calls_to("getUpdates")))
        if waiting.cancelled_caught:
            emit({"error": "the candidate never called getUpdates"})
            return
        emit({"first_poll": time.perf_counter()})
        await trio.sleep(args.hold)
        released = time.perf_counter()
        emit({"released": released})
        with trio.move_on_after(args.timeout):
            for k in range(args.updates):
                i = chat_of(k, args)
                text = f"{directive(k, args)}ping {k} {filler}"
                if args.rate > 0:
                    due = released + k / args.rate
                    delay = due - time.perf_counter()
                    if delay > 0:
                        await trio.sleep(delay)
                while args.window and k - len(answered) >= args.window:
                    room[0] = trio.Event()
                    await room[0].wait()
                available[k] = time.perf_counter()
                fake.user_message(chats[i], users[i], text)
            await all_done.wait()
        finished = time.perf_counter()
    latencies = [(answered[k] - available[k]) * 1000 for k in answered if k in available]
    in_order = all(seq == sorted(seq) for seq in order.values())
    last = max(answered.values()) if answered else finished
    emit(
        {
            "done": {
                "updates": args.updates,
                "replies": len(answered),
                "duplicates": duplicates,
                "in_order": in_order,
                "elapsed_s": last - released,
                "chats_answered_s": (max(first_reply.values()) - released) if first_reply else None,
                "chats_answered": len(first_reply),
                "p50_ms": percentile(latencies, 0.5),
                "p99_ms": percentile(latencies, 0.99),
                "mean_ms": statistics.fmean(latencies) if latencies else float("nan"),
                "timed_out": len(answered) < args.updates,
            }
        }
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=4000)
    p.add_argument("--chats", type=int, default=200)
    p.add_argument("--one-chat", action="store_true", help="every update from one chat")
    p.add_argument("--rate", type=float, default=0.0, help="updates/s (0: all at once)")
    p.add_argument("--hold", type=float, default=3.5)
    p.add_argument("--text-bytes", type=int, default=2100)
    p.add_argument("--layout", choices=["round-robin", "b2"], default="round-robin")
    p.add_argument("--sleep", type=float, default=0.0, help="agent latency (echo:sleep)")
    p.add_argument("--varied", action="store_true", help="latencies 1.0-3.0 s, not --sleep")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--token", default=TEST_TOKEN)
    p.add_argument("--window", type=int, default=0, help="at most W unanswered (0: no bound)")
    p.add_argument("--progress", type=int, default=0, help="print progress every N replies")
    return p.parse_args(argv)


if __name__ == "__main__":
    trio.run(main, parse_args())
