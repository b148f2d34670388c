"""nonebot2 + nonebot-adapter-telegram (aiohttp driver) echo bot for the benchmark suite.

Env: BENCH_API (the fake Bot API base), BENCH_TOKEN.  Honours ``echo:sleep S``.
"""

import asyncio
import json
import os
import re

import nonebot
from nonebot.adapters.telegram import Adapter, Bot
from nonebot.adapters.telegram.event import MessageEvent

SLEEP = re.compile(r"^echo:sleep\s+(\d+(?:\.\d+)?)")

nonebot.init(
    driver="~aiohttp",
    telegram_bots=json.loads(
        json.dumps(
            [{"token": os.environ["BENCH_TOKEN"], "api_server": os.environ["BENCH_API"] + "/"}]
        )
    ),
    log_level="WARNING",
)
nonebot.get_driver().register_adapter(Adapter)
matcher = nonebot.on_message(priority=1, block=True)


@matcher.handle()
async def echo(bot: Bot, event: MessageEvent) -> None:
    text = event.get_plaintext()
    m = SLEEP.match(text)
    if m:
        await asyncio.sleep(float(m.group(1)))
    await bot.send(event, text)


if __name__ == "__main__":
    nonebot.run()
