#!/usr/bin/env python3
"""One of dshim's fakes in its own process, for the idle and startup scenario (B6).

Usage (the suite runs it; one JSON object per stdout line)::

    python scripts/bench/fake_idle.py --platform feishu [--lifetime 120] [--webhook URL]

Prints ``{"settings": {...}}`` (the ``[[bots]]`` keys that point dshim at this fake;
fake credentials only), then ``{"first_poll": t}`` (a ``perf_counter`` time) at the
bot's first contact: its first long poll (Telegram, WeChat), READY (Discord, QQ), hello
(Slack), gateway connection (Feishu, DingTalk, WeCom), or for WhatsApp, whose fake only
sends webhooks, the first 200 to the verification GET polled on ``--webhook`` (the
route mounted).  Then it serves, idle, until ``--lifetime`` is over.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fake_discord import bench_identity  # noqa: E402

from dshim.testing.fakes import (  # noqa: E402
    dingtalk,
    discord,
    feishu,
    qq,
    slack,
    telegram,
    wecom,
    weixin,
    whatsapp,
)

Opener = Callable[[], AbstractAsyncContextManager[Any]]
# platform: (open the fake, its bot settings, "the bot made contact")
PLATFORMS: dict[str, tuple[Opener, Callable[[Any], dict[str, Any]], Callable[[Any], bool]]] = {
    "telegram": (
        telegram.open_fake_telegram,
        lambda f: {"token": f.token, "api_base": f.url},
        lambda f: bool(f.calls_to("getUpdates")),
    ),
    "discord": (
        lambda: discord.open_fake_discord(**bench_identity()),
        lambda f: {"token": f.token, "api_base": f.api_base},
        lambda f: f.ready_count > 0,
    ),
    "slack": (
        slack.open_fake_slack,
        lambda f: {"bot_token": f.bot_token, "app_token": f.app_token, "api_base": f.api_base},
        lambda f: f.live is not None,
    ),
    "feishu": (
        feishu.open_fake_feishu,
        lambda f: {"app_id": f.app_id, "app_secret": f.app_secret, "api_base": f.api_base},
        lambda f: bool(f.connections),
    ),
    "dingtalk": (
        dingtalk.open_fake_dingtalk,
        lambda f: {
            "client_id": f.client_id,
            "client_secret": f.client_secret,
            "api_base": f.api_base,
            "oapi_base": f.api_base,
        },
        lambda f: bool(f.connections),
    ),
    "wecom": (
        wecom.open_fake_wecom,
        lambda f: {"bot_id": f.bot_id, "secret": f.secret, "ws_url": f.ws_url},
        lambda f: bool(f.subscribes),
    ),
    "qq": (
        qq.open_fake_qq,
        lambda f: {
            "app_id": f.app_id,
            "client_secret": f.client_secret,
            "api_base": f.http_url,
            "token_base": f.http_url,
            "gateway_url": f.gateway_url,
        },
        lambda f: f.ready_count > 0,
    ),
    "weixin": (
        weixin.open_fake_weixin,
        lambda f: {"token": f.token, "bot_id": f.bot_id, "api_base": f.url, "cdn_base": f.cdn_url},
        lambda f: bool(f.calls),
    ),
    "whatsapp": (
        whatsapp.open_fake_whatsapp,
        lambda f: {
            "phone_number_id": f.phone_number_id,
            "access_token": f.token,
            "app_secret": whatsapp.TEST_APP_SECRET,
            "verify_token": whatsapp.TEST_VERIFY_TOKEN,
            "api_base": f.url,
        },
        lambda f: False,  # see --webhook
    ),
}


async def mounted(url: str) -> None:
    """Poll the WhatsApp verification GET until the bot's route answers it."""
    query = {"hub.mode": "subscribe", "hub.verify_token": whatsapp.TEST_VERIFY_TOKEN}
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            try:
                r = await client.get(url, params={**query, "hub.challenge": "up"})
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await trio.sleep(0.01)


async def main(args: argparse.Namespace) -> None:
    opener, settings, contact = PLATFORMS[args.platform]
    with trio.move_on_after(args.lifetime):
        async with opener() as fake:
            print(json.dumps({"settings": settings(fake)}), flush=True)
            if args.webhook:
                await mounted(args.webhook)
            else:
                await fake.wait_until(lambda: contact(fake))
            print(json.dumps({"first_poll": time.perf_counter()}), flush=True)
            await trio.sleep_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--platform", choices=sorted(PLATFORMS), required=True)
    p.add_argument("--lifetime", type=float, default=120.0)
    p.add_argument("--webhook", default="", help="WhatsApp: the bot's webhook URL to poll")
    trio.run(main, p.parse_args())
