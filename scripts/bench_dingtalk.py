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
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchkit as kit  # noqa: E402

from dshim.channels.dingtalk.client import (  # noqa: E402
    USER_AGENT,
    WS_OPTIONS,
    DingTalkApi,
    run_stream,
)
from dshim.channels.dingtalk.protocol import MessageMapper, RobotCallback  # noqa: E402
from dshim.net.http import open_http  # noqa: E402


async def floor(env: dict[str, Any], n: int, db: Path | None = None) -> tuple[float, float]:
    meter = kit.Meter(n)
    with kit.open_floor_dedup(db) as dedup:
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
        async with kit.open_floor_websocket(url, WS_OPTIONS) as ws:
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
                if dedup is not None:
                    await dedup.insert(mapped["conversation"], mapped["id"], data)
                meter.tick()
    return meter.wall, meter.cpu


async def dshim_stream(
    env: dict[str, Any], n: int, handle: Callable[[RobotCallback, MessageMapper], Awaitable[None]]
) -> tuple[float, float]:
    meter = kit.Meter(n)
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

        return await kit.until_counted(meter, lambda: run_stream(api, deliver))


reader_only, pipeline = kit.reader_and_pipeline(
    dshim_stream,
    channel="dingtalk",
    bot_id=lambda env: env["client_id"],
    decode=lambda callback, mapper: mapper.decode_raw(callback.data),
    raw=lambda callback: callback.data,
)


def main(args: argparse.Namespace) -> None:
    kit.fake_bench(
        "dshim.testing.fakes.dingtalk",
        args.messages,
        args.repeat,
        unit="message",
        names=(
            "floor (ticket + websocket + 2x json.loads + ack + dict)",
            "dshim Stream reader + mapping",
        ),
        floor=floor,
        reader=reader_only,
        pipeline=pipeline,
    )


if __name__ == "__main__":
    main(kit.argument_parser(__doc__, "--messages").parse_args())
