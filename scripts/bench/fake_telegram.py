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
import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ledger import Ledger, add_arguments, emit  # noqa: E402

from dshim.testing.fakes.telegram import (  # noqa: E402
    TEST_TOKEN,
    FakeMessage,
    FakeTelegram,
    open_fake_telegram,
)


async def main(args: argparse.Namespace) -> None:
    users = [FakeTelegram.user(10_000 + i, f"User{i}") for i in range(args.chats)]
    ledger = Ledger(args)

    def on_reply(msg: FakeMessage) -> None:
        ledger.reply(msg.text, msg.data["chat"]["id"])

    async with open_fake_telegram(token=args.token) as fake:
        fake.on_bot_message = on_reply
        chats = [fake.private_chat(u) for u in users]
        emit({"url": fake.url})
        with trio.move_on_after(args.timeout) as waiting:
            await fake.wait_until(lambda: bool(fake.calls_to("getUpdates")))
        if waiting.cancelled_caught:
            emit({"error": "the candidate never called getUpdates"})
            return

        def inject(k: int, chat: int, text: str) -> None:
            fake.user_message(chats[chat], users[chat], text)

        await ledger.run(inject)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--token", default=TEST_TOKEN)
    return p.parse_args(argv)


if __name__ == "__main__":
    trio.run(main, parse_args())
