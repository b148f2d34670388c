"""aiogram 3 echo bot for the benchmark suite (run in its own venv).

Env: BENCH_API (the fake Bot API base), BENCH_TOKEN.  Honours ``echo:sleep S``.
"""

import asyncio
import os
import re

from aiogram import Bot, Dispatcher
from aiogram.client.session.aiohttp import AiohttpSession
from aiogram.client.telegram import TelegramAPIServer
from aiogram.types import Message

SLEEP = re.compile(r"^echo:sleep\s+(\d+(?:\.\d+)?)")
dp = Dispatcher()


@dp.message()
async def echo(message: Message) -> None:
    if message.text is None:
        return
    m = SLEEP.match(message.text)
    if m:
        await asyncio.sleep(float(m.group(1)))
    await message.answer(message.text)


async def main() -> None:
    session = AiohttpSession(api=TelegramAPIServer.from_base(os.environ["BENCH_API"]))
    bot = Bot(os.environ["BENCH_TOKEN"], session=session)
    await dp.start_polling(bot, polling_timeout=10, handle_signals=True)


if __name__ == "__main__":
    asyncio.run(main())
