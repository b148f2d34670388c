#!/usr/bin/env python3
"""One of dshim's fakes in its own process, for the idle and startup scenario (B6).

Usage (the suite runs it; one JSON object per stdout line)::

    python scripts/bench/fake_idle.py --platform feishu [--lifetime 120] [--webhook URL]

Prints ``{"settings": {...}}`` (the ``[[bots]]`` keys that point dshim at this fake;
fake credentials only), then ``{"first_poll": t}`` (a ``perf_counter`` time) at the
bot's first contact: its first long poll (Telegram, WeChat), READY (Discord, QQ), hello
(Slack), gateway connection (Feishu, DingTalk, WeCom), or for WhatsApp, whose fake only
sends webhooks, the first 200 to the verification GET polled on ``--webhook`` (the
route mounted).  Then it serves, idle, until ``--lifetime`` is over.  Each platform's fake
says how (its ``IDLE_BENCH``, a :class:`dshim.testing.fakes.base.IdleBench`); the
platforms are the registry's channels but the web chat.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from dshim.channels.registry import SPECS  # noqa: E402
from dshim.testing.fakes.base import IdleBench  # noqa: E402


def idle_benches() -> dict[str, IdleBench[Any]]:
    """Every platform's ``IDLE_BENCH``, from its fake (``dshim.testing.fakes.<key>``)."""
    out: dict[str, IdleBench[Any]] = {}
    for entry in SPECS:
        if not entry.local:  # the web chat has no platform to fake
            module = importlib.import_module(f"dshim.testing.fakes.{entry.key}")
            out[entry.key] = module.IDLE_BENCH
    return out


PLATFORMS = idle_benches()


async def main(args: argparse.Namespace) -> None:
    bench = PLATFORMS[args.platform]
    with trio.move_on_after(args.lifetime):
        async with bench.open() as fake:
            print(json.dumps({"settings": bench.settings(fake)}), flush=True)
            if args.webhook:
                assert bench.mounted is not None, f"{args.platform} sends no webhooks"
                await bench.mounted(args.webhook)
            else:
                await fake.wait_until(lambda: bench.contact(fake))
            print(json.dumps({"first_poll": time.perf_counter()}), flush=True)
            await trio.sleep_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--platform", choices=sorted(PLATFORMS), required=True)
    p.add_argument("--lifetime", type=float, default=120.0)
    p.add_argument("--webhook", default="", help="WhatsApp: the bot's webhook URL to poll")
    trio.run(main, p.parse_args())
