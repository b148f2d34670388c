#!/usr/bin/env python3
"""The benchmark's fake Slack (B4), in its own process: dshim's own ``FakeSlack``.

Usage (the suite runs it; one JSON object per stdout line)::

    python scripts/bench/fake_slack.py --updates 2000 --chats 200 [--rate 0] [--hold 3.5]
        [--text-bytes 1000] [--timeout 120]

1. prints ``{"api_base", "bot_token", "app_token"}`` and serves the Web API and Socket
   Mode on 127.0.0.1;
2. waits for the candidate's first Socket Mode ``hello`` (prints ``{"first_poll": t}``),
   then ``--hold`` seconds, prints ``{"released": t}``;
3. pushes the ``events_api`` envelopes: direct messages "ping K ..." in ``--chats`` DM
   conversations, all at once (the burst) or ``--rate`` per second;
4. counts the replies (``chat.postMessage`` or a stream call carrying "ping K") and the
   acknowledgements, and prints ``{"done": {...}}`` (see ``ledger.py``) with the ack
   latency from an envelope's send to its ack (``ack_p50_ms``, ``ack_p99_ms``,
   ``acked``), then exits.  No redelivery during the run (the ack deadline is only
   measured), so a late ack shows as latency, not as duplicates.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ledger import Ledger, add_arguments, emit, percentile, watch_calls  # noqa: E402

from dshim.testing.fakes.slack import open_fake_slack  # noqa: E402

REPLIES = ("chat.postMessage", "chat.update", "chat.startStream", "chat.appendStream")


async def main(args: argparse.Namespace) -> None:
    ledger = Ledger(args)
    sent: dict[str, float] = {}
    async with open_fake_slack() as fake:
        fake.redeliver_after_s = 3600.0
        fake.server_ping_interval_s = None
        dms = [f"D0BENCH{i:04d}" for i in range(args.chats)]
        for dm in dms:
            fake.channel_types[dm] = "im"
            fake.members.add(dm)

        def reply(call: Any) -> None:
            if call.method in REPLIES and call.error is None:
                text = call.args.get("text") or call.args.get("markdown_text") or ""
                ledger.reply(str(text), call.args.get("channel"))

        def acks() -> dict[str, Any]:
            waits = [(at - sent[eid]) * 1000 for at, eid in fake.acks if eid in sent]
            return {
                "acked": len(waits),
                "ack_p50_ms": percentile(waits, 0.5),
                "ack_p99_ms": percentile(waits, 0.99),
            }

        emit({"api_base": fake.api_base, "bot_token": fake.bot_token, "app_token": fake.app_token})
        with trio.move_on_after(args.timeout) as waiting:
            await fake.wait_until(lambda: fake.live is not None)
        if waiting.cancelled_caught:
            emit({"error": "the candidate never said hello"})
            return

        async def inject(k: int, chat: int, text: str) -> None:
            envelope = fake.envelope(fake.event(dms[chat], text))
            sent[envelope["envelope_id"]] = trio.current_time()
            await fake.send_envelope(envelope)

        await ledger.run(inject, acks, watch_calls(fake, reply))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p, updates=2000, chats=200)
    p.set_defaults(text_bytes=1000)
    return p.parse_args(argv)


if __name__ == "__main__":
    trio.run(main, parse_args())
