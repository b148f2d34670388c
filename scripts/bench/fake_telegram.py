#!/usr/bin/env python3
"""The benchmark's fake Bot API, in its own process: dshim's own ``FakeTelegram``.

Usage (the suite runs it; one JSON object per stdout line)::

    python scripts/bench/fake_telegram.py --updates 4000 --chats 200 [--rate 0] [--hold 3.5]
        [--text-bytes 2100] [--layout round-robin|b2] [--sleep S [--varied]] [--timeout 120]
        [--bots N]

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

Many bots (B8): ``--bots N`` serves N bots, each with its own token and its own
``FakeTelegram`` state, all in this one process on one port (a request goes to the bot
its ``/bot<token>/`` path names).  The first line then also carries ``"tokens"`` (fake
tokens only: ``<id>:TEST-...``); chat ``c`` belongs to bot ``c % N`` (its users are
distinct across bots), and before ``{"first_poll": ...}`` the fake prints
``{"all_polling": t, "bots": N}``: the arrival of the last bot's first ``getUpdates``.

Soak (B7): ``--window W`` keeps at most W unanswered (the next ones are made
available as replies come in), ``--progress N`` prints ``{"progress": n, "t": ...}``
every N replies (the suite samples the candidate's RSS then).

Nothing here reaches the internet.
"""

from __future__ import annotations

import argparse
import resource
import sys
import time
from functools import partial
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ledger import Ledger, add_arguments, emit  # noqa: E402

from dshim.testing.fakes.base import open_servers  # noqa: E402
from dshim.testing.fakes.http import Request, Response, json_response, serve_http  # noqa: E402
from dshim.testing.fakes.telegram import (  # noqa: E402
    TEST_TOKEN,
    FakeMessage,
    FakeTelegram,
    open_fake_telegram,
)


def bot_tokens(n: int) -> list[str]:
    """N distinct fake tokens shaped like Telegram's (``<bot id>:<secret>``)."""
    return [f"{700_000 + i}:TEST-token-for-the-fake-only-{i}" for i in range(n)]


class ManyBots:
    """N :class:`FakeTelegram` states behind one HTTP handler, routed by token."""

    def __init__(self, tokens: list[str]) -> None:
        self.fakes = [
            FakeTelegram(token=t, bot_id=700_000 + i, username=f"bench_bot_{i}")
            for i, t in enumerate(tokens)
        ]
        self._by_token = {f.token: f for f in self.fakes}
        self.first_poll: dict[str, float] = {}
        self.all_polling = trio.Event()

    async def handle(self, request: Request) -> Response:
        prefix, _, method = request.path[1:].partition("/")
        if request.path.startswith("/file/"):
            prefix = request.path[len("/file/") :].partition("/")[0]
        fake = self._by_token.get(prefix[3:]) if prefix.startswith("bot") else None
        if fake is None:
            return json_response(
                {"ok": False, "error_code": 401, "description": "Unauthorized"}, 401
            )
        if method.lower() == "getupdates" and fake.token not in self.first_poll:
            self.first_poll[fake.token] = time.perf_counter()
            if len(self.first_poll) == len(self.fakes):
                self.all_polling.set()
        response = await fake.handle(request)
        fake.calls.clear()  # nothing reads them here; 1,000 bots' polls would pile up
        return response


async def many(args: argparse.Namespace) -> None:
    """``--bots N`` (N > 1): every bot's own state, one server."""
    tokens = bot_tokens(args.bots)
    bots = ManyBots(tokens)
    ledger = Ledger(args)
    users = [FakeTelegram.user(10_000 + i, f"User{i}") for i in range(args.chats)]

    def on_reply(msg: FakeMessage) -> None:
        ledger.reply(msg.text, msg.data["chat"]["id"])

    chats = []
    for i, user in enumerate(users):
        fake = bots.fakes[i % args.bots]
        chats.append(fake.private_chat(user))
    for fake in bots.fakes:
        fake.on_bot_message = on_reply
    serve = partial(serve_http, bots.handle, host="127.0.0.1", port=0)
    async with open_servers(serve) as (server,):
        for fake in bots.fakes:
            fake.server = server
        emit({"url": server.url, "tokens": tokens})
        with trio.move_on_after(args.timeout) as waiting:
            await bots.all_polling.wait()
        if waiting.cancelled_caught:
            emit({"error": f"{len(bots.first_poll)}/{args.bots} bots called getUpdates"})
            return
        emit({"all_polling": max(bots.first_poll.values()), "bots": args.bots})

        def inject(k: int, chat: int, text: str) -> None:
            bots.fakes[chat % args.bots].user_message(chats[chat], users[chat], text)

        await ledger.run(inject)


async def main(args: argparse.Namespace) -> None:
    if args.bots > 1:
        await many(args)
        return
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


def raise_nofile() -> None:
    """Many bots hold one connection each: the soft descriptor limit up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    p.add_argument("--token", default=TEST_TOKEN)
    p.add_argument("--bots", type=int, default=1, help="bots served (distinct tokens)")
    return p.parse_args(argv)


if __name__ == "__main__":
    raise_nofile()
    trio.run(main, parse_args())
