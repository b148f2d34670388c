"""Feishu long-connection throughput: events/s and CPU per event, side by side with a floor.

    python scripts/bench_feishu.py [--events 5000] [--repeat 3]

The fake Feishu (``dshim.testing.fakes.feishu``) runs in its own process and, on every new
long connection, pushes ``--events`` ``im.message.receive_v1`` events (direct text
messages, ~1 KB each, one pbbp2 DATA frame each) as fast as it can.  In this process, one
after the other:

- floor         the least a long-connection client must do, written plainly: the endpoint
                call, trio-websocket (same 64 KiB receive buffer), a minimal protobuf walk
                to the payload, ``json.loads`` of the event and of its content, a dict
                mapping, and the ack (the frame echoed with ``biz_rt`` and ``{"code":200}``
                appended);
- dshim reader  dshim's client (``FeishuSession`` on the kit's websocket runner via
                ``run_connection``: the pbbp2 codec, pings, reassembly) and the event
                mapping to ``InboundMessage``, each event acked;
- floor+dedup   the floor plus one SQLite ``INSERT OR IGNORE`` (dedup key + raw event) per
                event on a worker thread, WAL, synchronous=NORMAL;
- dshim 1-6     dshim's reader and mapping plus pipeline steps 1-6 (``BotRuntime.accept``:
                gates, persisted dedup + durable inbox on SQLite, access, commands,
                lanes) with the lane handler doing nothing, each event acked after accept.

CPU is this process's time (the fake's is not counted), from the first event to the last
one handled; each run is repeated and the median printed with the spread and the ratio to
its floor.  Compare within one run only.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchkit as kit  # noqa: E402

from dshim.channels.feishu.client import USER_AGENT, WS_OPTIONS, RestClient, run_connection  # noqa: E402
from dshim.channels.feishu.protocol import EventMapper, FeishuEvent, FeishuSession  # noqa: E402
from dshim.channels.kit import Backoff  # noqa: E402
from dshim.net.http import open_http  # noqa: E402

# -- floor ----------------------------------------------------------------------------------


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def payload_of(data: bytes) -> tuple[bytes, bool]:
    """(payload, is an event frame) by walking the top-level protobuf fields."""
    pos, payload, event = 0, b"", False
    while pos < len(data):
        key, pos = _varint(data, pos)
        if key & 7 == 0:
            _, pos = _varint(data, pos)
            continue
        length, pos = _varint(data, pos)
        value = data[pos : pos + length]
        pos += length
        if key >> 3 == 8:
            payload = value
        elif key >> 3 == 5 and b"type" in value and b"event" in value:
            event = True
    return payload, event


def _field(tag: int, value: bytes) -> bytes:
    out, n = bytearray([tag]), len(value)
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out) + value


ACK_TAIL = _field(0x2A, _field(0x0A, b"biz_rt") + _field(0x12, b"0")) + _field(
    0x42, b'{"code":200}'
)
PING = bytes.fromhex("0800100018072000") + _field(
    0x2A, _field(0x0A, b"type") + _field(0x12, b"ping")
)


async def floor(env: dict[str, Any], n: int, db: Path | None = None) -> tuple[float, float]:
    meter = kit.Meter(n)
    with kit.open_floor_dedup(db) as dedup:
        async with httpx.AsyncClient() as http:
            body = {"AppID": env["app_id"], "AppSecret": env["app_secret"]}
            url = (await http.post(env["api_base"] + "/callback/ws/endpoint", json=body)).json()[
                "data"
            ]["URL"]
        async with kit.open_floor_websocket(url, WS_OPTIONS) as ws:
            await ws.send_message(PING)
            while not meter.done.is_set():
                data = await ws.get_message()
                assert isinstance(data, bytes)
                payload, event = payload_of(data)
                if not event:
                    continue
                meter.start()
                ev = json.loads(payload)["event"]
                msg = ev["message"]
                mapped = {
                    "id": msg["message_id"],
                    "conversation": msg["chat_id"],
                    "direct": msg["chat_type"] == "p2p",
                    "sender": ev["sender"]["sender_id"]["open_id"],
                    "content": json.loads(msg["content"]).get("text", ""),
                }
                if dedup is not None:
                    await dedup.insert(mapped["conversation"], mapped["id"], payload)
                await ws.send_message(data + ACK_TAIL)
                meter.tick()
    return meter.wall, meter.cpu


# -- dshim ----------------------------------------------------------------------------------


async def dshim_reader(
    env: dict[str, Any], n: int, handle: Callable[[FeishuEvent, EventMapper], Awaitable[None]]
) -> tuple[float, float]:
    meter = kit.Meter(n)
    async with open_http(env["api_base"], user_agent=USER_AGENT) as http:
        rest = RestClient(
            http, app_id=env["app_id"], app_secret=env["app_secret"], api_base=env["api_base"]
        )
        info = await rest.bot_info()
        mapper = EventMapper(bot_open_id=info.open_id, app_id=env["app_id"])
        session = FeishuSession(random=random.random)

        async def deliver(event: FeishuEvent) -> None:
            meter.start()
            await handle(event, mapper)
            session.acknowledge(event, trio.current_time())
            meter.tick()

        run = functools.partial(
            run_connection,
            session,
            rest,
            deliver,
            backoff=Backoff(),
            register_secret=lambda s: None,
        )
        return await kit.until_counted(meter, run)


reader_only, pipeline = kit.reader_and_pipeline(
    dshim_reader,
    channel="feishu",
    bot_id=lambda env: "ou_bench",
    decode=lambda event, mapper: mapper.decode(event.payload),
    raw=lambda event: event.payload,
)


def main(args: argparse.Namespace) -> None:
    with kit.open_fake("dshim.testing.fakes.feishu", args.events) as env:
        runs = kit.run_four(
            env,
            args.events,
            args.repeat,
            unit="event",
            names=(
                "floor (websocket + protobuf walk + json.loads + ack)",
                "dshim long-connection reader + mapping",
            ),
            floor=floor,
            reader=reader_only,
            pipeline=pipeline,
        )
    kit.print_four_runs(
        runs,
        unit="event",
        versions=f"httpx {httpx.__version__}",
    )


if __name__ == "__main__":
    main(kit.argument_parser(__doc__, "--events").parse_args())
