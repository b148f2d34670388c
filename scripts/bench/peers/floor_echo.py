"""The harness floor ("reference loop" of benchmarks.md section 4), only to calibrate.

Not dshim: the least a trio + httpx + msgspec Telegram echo bot does.  One long-poll task
feeds a bounded channel, four sender tasks answer.  Env: BENCH_API, BENCH_TOKEN.
Honours ``echo:sleep S``.  Runs with dshim's own interpreter (trio, httpx, msgspec).
"""

from __future__ import annotations

import os
import re

import httpx
import msgspec
import trio

SLEEP = re.compile(r"^echo:sleep\s+(\d+(?:\.\d+)?)")


class Chat(msgspec.Struct):
    id: int


class Message(msgspec.Struct):
    chat: Chat
    text: str = ""


class Update(msgspec.Struct):
    update_id: int
    message: Message | None = None


class Updates(msgspec.Struct):
    result: list[Update]


async def poll(client: httpx.AsyncClient, base: str, out: trio.MemorySendChannel[Message]) -> None:
    offset = 0
    decoder = msgspec.json.Decoder(Updates)
    while True:
        r = await client.post(f"{base}/getUpdates", json={"offset": offset, "timeout": 10})
        for u in decoder.decode(r.content).result:
            offset = u.update_id + 1
            if u.message is not None:
                await out.send(u.message)


async def sender(
    client: httpx.AsyncClient, base: str, inbox: trio.MemoryReceiveChannel[Message]
) -> None:
    async for msg in inbox:
        m = SLEEP.match(msg.text)
        if m:
            await trio.sleep(float(m.group(1)))
        body = msgspec.json.encode({"chat_id": msg.chat.id, "text": msg.text})
        await client.post(
            f"{base}/sendMessage", content=body, headers={"content-type": "application/json"}
        )


async def main() -> None:
    base = f"{os.environ['BENCH_API']}/bot{os.environ['BENCH_TOKEN']}"
    limits = httpx.Limits(max_connections=8, max_keepalive_connections=8)
    async with httpx.AsyncClient(timeout=30, limits=limits) as client:
        send, recv = trio.open_memory_channel[Message](100)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(poll, client, base, send)
            for _ in range(4):
                nursery.start_soon(sender, client, base, recv.clone())


if __name__ == "__main__":
    trio.run(main)
