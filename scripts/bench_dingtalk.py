"""DingTalk Stream throughput: robot messages/s and CPU per message, next to a floor.

    python scripts/bench_dingtalk.py [--messages 5000] [--repeat 3]

The fake DingTalk (``dshim.testing.fakes.dingtalk``) runs in its own process and pushes
``--messages`` robot-message CALLBACK frames (~1 KB each, direct messages) right after
every Stream connect.  In this process, one after the other:

- floor         the least a Stream client must do, written plainly: register for a
                ticket (httpx), trio-websocket, ``json.loads`` of the frame and of its
                ``data`` string, the ack sent back, a dict lookup mapping;
- dshim reader  dshim's Stream client (``StreamSession`` on the kit's websocket
                connection via ``run_stream``: bounded-depth msgspec envelope, the double
                decode, the ack at once) and the mapping to ``InboundMessage``;
- floor+dedup   the floor plus one SQLite ``INSERT OR IGNORE`` (dedup key + raw message)
                per message on a worker thread, WAL, synchronous=NORMAL;
- dshim 1-6     dshim's reader and mapping plus pipeline steps 1-6
                (``BotRuntime.accept``: gates, persisted dedup + durable inbox, access,
                commands, lanes) with the lane handler doing nothing.

CPU is this process's time from the connect to the last message handled (the fake's CPU
is not counted); each run is repeated and the median printed with the spread, and the
ratio to the floor.  Compare within one run only.
"""

from __future__ import annotations

import argparse
import functools
import json
import sqlite3
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import trio
import trio_websocket

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchkit import Meter, Run, measure_four, print_four_runs, steps_1_to_6  # noqa: E402

from dshim.channels.dingtalk.client import (  # noqa: E402
    USER_AGENT,
    WS_OPTIONS,
    DingTalkApi,
    run_stream,
)
from dshim.channels.dingtalk.protocol import MessageMapper, RobotCallback  # noqa: E402
from dshim.channels.kit.http import open_http  # noqa: E402
from dshim.log import configure_logging  # noqa: E402
from dshim.model import InboundMessage  # noqa: E402


async def floor(env: dict[str, Any], n: int, db: Path | None = None) -> tuple[float, float]:
    meter = Meter(n)
    conn: sqlite3.Connection | None = None
    limiter = trio.CapacityLimiter(1)
    if db is not None:
        conn = sqlite3.connect(db, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE dedup (conv TEXT, mid TEXT, raw BLOB, PRIMARY KEY (conv, mid))")

    def insert(conv: str, mid: str, raw: str) -> int:
        assert conn is not None
        return conn.execute(
            "INSERT OR IGNORE INTO dedup VALUES (?, ?, ?)", (conv, mid, raw)
        ).rowcount

    meter.start()
    async with httpx.AsyncClient() as http:
        body = {
            "clientId": env["client_id"],
            "clientSecret": env["client_secret"],
            "subscriptions": [],
        }
        opened = (
            await http.post(env["api_base"] + "/v1.0/gateway/connections/open", json=body)
        ).json()
    url = f"{opened['endpoint']}?ticket={opened['ticket']}"
    async with trio_websocket.open_websocket_url(
        url,
        message_queue_size=WS_OPTIONS.message_queue_size,
        max_message_size=WS_OPTIONS.max_message_size,
        receive_buffer_size=WS_OPTIONS.receive_buffer_size,
    ) as ws:
        while not meter.done.is_set():
            frame = json.loads(await ws.get_message())
            headers = frame["headers"]
            await ws.send_message(
                json.dumps(
                    {
                        "code": 200,
                        "headers": {"messageId": headers["messageId"]},
                        "message": "OK",
                        "data": '{"response":null}',
                    }
                )
            )
            data = frame["data"]
            d = json.loads(data)
            mapped = {
                "id": d["msgId"],
                "conversation": d["conversationId"],
                "direct": d["conversationType"] == "1",
                "sender": d.get("senderStaffId") or d["senderId"],
                "name": d.get("senderNick"),
                "content": d.get("text", {}).get("content", "").strip(),
            }
            if conn is not None:
                await trio.to_thread.run_sync(
                    insert, mapped["conversation"], mapped["id"], data, limiter=limiter
                )
            meter.tick()
    if conn is not None:
        conn.close()
    return meter.wall, meter.cpu


async def dshim_stream(
    env: dict[str, Any], n: int, handle: Callable[[RobotCallback, MessageMapper], Awaitable[None]]
) -> tuple[float, float]:
    meter = Meter(n)
    meter.start()
    async with open_http(user_agent=USER_AGENT) as http:
        api = DingTalkApi(
            http,
            client_id=env["client_id"],
            client_secret=env["client_secret"],
            robot_code=env["client_id"],
            api_base=env["api_base"],
            oapi_base=env["api_base"],
        )
        mapper = MessageMapper(bot_id=env["client_id"], robot_code=env["client_id"])

        async def deliver(callback: RobotCallback) -> None:
            await handle(callback, mapper)
            meter.tick()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_stream, api, deliver)
            await meter.done.wait()
            nursery.cancel_scope.cancel()
    return meter.wall, meter.cpu


async def reader_only(env: dict[str, Any], n: int) -> tuple[float, float]:
    async def handle(callback: RobotCallback, mapper: MessageMapper) -> None:
        item = mapper.decode_raw(callback.data)
        assert isinstance(item, InboundMessage), item

    return await dshim_stream(env, n, handle)


async def pipeline(env: dict[str, Any], n: int, tmp: Path) -> tuple[float, float]:
    async with steps_1_to_6("dingtalk", env["client_id"], n, tmp) as rt:

        async def handle(callback: RobotCallback, mapper: MessageMapper) -> None:
            verdict = await rt.accept(mapper.decode_raw(callback.data), callback.data)
            assert verdict.accepted, verdict

        return await dshim_stream(env, n, handle)


async def measure(args: argparse.Namespace, env: dict[str, Any]) -> list[Run]:
    configure_logging("error", "json")
    return await measure_four(
        args.messages,
        args.repeat,
        names=[
            "floor (ticket + websocket + 2x json.loads + ack + dict)",
            "dshim Stream reader + mapping",
            "floor + durable dedup (one SQLite INSERT/message)",
            "dshim reader + mapping + pipeline steps 1-6",
        ],
        floor=functools.partial(floor, env),
        reader=functools.partial(reader_only, env),
        pipeline=functools.partial(pipeline, env),
    )


def main(args: argparse.Namespace) -> None:
    fake = [sys.executable, "-m", "dshim.testing.fakes.dingtalk"]
    fake += ["--flood", str(args.messages), "--lifetime", "900"]
    proc = subprocess.Popen(fake, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        env = json.loads(proc.stdout.readline())
        runs = trio.run(measure, args, env)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    print_four_runs(runs, unit="message", count=args.messages, repeat=args.repeat)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    main(parser.parse_args())
