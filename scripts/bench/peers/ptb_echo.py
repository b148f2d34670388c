"""python-telegram-bot 22 echo bot for the benchmark suite (run in its own venv).

Env: BENCH_API (the fake Bot API base), BENCH_TOKEN, BENCH_CONCURRENT (0: PTB's default
sequential processing; N: ``concurrent_updates(N)``).  Honours ``echo:sleep S``.
"""

import asyncio
import os
import re

from telegram import Update
from telegram.ext import Application, ContextTypes, MessageHandler, filters

SLEEP = re.compile(r"^echo:sleep\s+(\d+(?:\.\d+)?)")


async def echo(update: Update, context: ContextTypes.DEFAULT_TYPE) -> None:
    msg = update.effective_message
    if msg is None or msg.text is None:
        return
    m = SLEEP.match(msg.text)
    if m:
        await asyncio.sleep(float(m.group(1)))
    await msg.reply_text(msg.text)


def main() -> None:
    api = os.environ["BENCH_API"]
    builder = (
        Application.builder()
        .token(os.environ["BENCH_TOKEN"])
        .base_url(f"{api}/bot")
        .base_file_url(f"{api}/file/bot")
    )
    concurrent = int(os.environ.get("BENCH_CONCURRENT", "0"))
    if concurrent:
        builder = builder.concurrent_updates(concurrent)
    app = builder.build()
    app.add_handler(MessageHandler(filters.TEXT, echo))
    app.run_polling(poll_interval=0.0, timeout=10, drop_pending_updates=False)


if __name__ == "__main__":
    main()
