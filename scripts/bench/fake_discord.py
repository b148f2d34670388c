#!/usr/bin/env python3
"""The benchmark's fake Discord (B3), in its own process: dshim's own ``FakeDiscord``.

Usage (the suite runs it; one JSON object per stdout line)::

    python scripts/bench/fake_discord.py --updates 4000 --chats 200 [--rate 0] [--hold 3.5]
        [--text-bytes 1000] [--timeout 120]

1. prints ``{"api_base", "gateway_url", "token", ...}`` and serves 127.0.0.1 (REST and
   gateway; zlib-stream transport compression when the client asks, as Discord does);
2. waits for the candidate's first READY (prints ``{"first_poll": t}``), then ``--hold``
   seconds, prints ``{"released": t}``;
3. dispatches the MESSAGE_CREATEs: direct messages "ping K ..." from ``--chats`` users,
   each in its own DM channel, all at once or ``--rate`` per second;
4. counts the replies (``POST /channels/{id}/messages`` carrying "ping K") and prints
   ``{"done": {...}}`` (see ``ledger.py``), then exits.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ledger import Ledger, add_arguments, emit, watch_calls  # noqa: E402

from dshim.testing.fakes.discord import bench_identity, open_fake_discord, snowflake  # noqa: E402


async def main(args: argparse.Namespace) -> None:
    ledger = Ledger(args)
    async with open_fake_discord(**bench_identity()) as fake:
        fake.identify_window_s = 0.0
        dms = []
        for i in range(args.chats):
            channel = snowflake()
            fake.channels[channel] = {"id": channel, "type": 1}
            dms.append((channel, fake.make_user(f"user{i}")))

        def reply(call: Any) -> None:
            if call.method == "POST" and call.status == 200 and isinstance(call.json, dict):
                parts = call.path.split("/")  # /channels/{id}/messages
                if len(parts) == 4 and parts[3] == "messages":
                    ledger.reply(str(call.json.get("content", "")), parts[2])

        emit(
            {
                "api_base": fake.api_base,
                "http_url": fake.http_url,
                "gateway_url": fake.gateway_url,
                "token": fake.token,
            }
        )
        with trio.move_on_after(args.timeout) as waiting:
            await fake.wait_until(lambda: fake.ready_count > 0)
        if waiting.cancelled_caught:
            emit({"error": "the candidate never identified"})
            return

        async def inject(k: int, chat: int, text: str) -> None:
            channel, user = dms[chat]
            await fake.user_message(channel, text, author=user)

        await ledger.run(inject, watch=watch_calls(fake, reply))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p, chats=200)
    p.set_defaults(text_bytes=1000)
    return p.parse_args(argv)


if __name__ == "__main__":
    trio.run(main, parse_args())
