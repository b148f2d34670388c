"""hikari 2 echo bot for the benchmark suite's B3 (run in its own venv).

Env: BENCH_API (the fake's REST base, ``.../api/v10``), BENCH_TOKEN.  hikari
asks the fake for the gateway URL (``GET /gateway/bot``) and connects with zlib-stream
compression, unpatched.  Honours ``echo:sleep S``.
"""

import asyncio
import os
import re

import hikari

SLEEP = re.compile(r"^echo:sleep\s+(\d+(?:\.\d+)?)")


def main() -> None:
    bot = hikari.GatewayBot(
        os.environ["BENCH_TOKEN"],
        rest_url=os.environ["BENCH_API"],
        intents=hikari.Intents.DM_MESSAGES | hikari.Intents.MESSAGE_CONTENT,
        banner=None,
        suppress_optimization_warning=True,
    )

    @bot.listen()
    async def echo(event: hikari.DMMessageCreateEvent) -> None:
        if event.is_bot or not event.content:
            return
        m = SLEEP.match(event.content)
        if m:
            await asyncio.sleep(float(m.group(1)))
        await event.message.respond(event.content)

    bot.run(asyncio_debug=False, check_for_updates=False, enable_signal_handlers=True)


if __name__ == "__main__":
    main()
