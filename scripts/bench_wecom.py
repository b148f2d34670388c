"""WeCom long-connection throughput: callbacks/s and CPU per callback, next to a floor.

    python scripts/bench_wecom.py [--messages 5000] [--repeat 3]

The fake WeCom (``dshim.testing.fakes.wecom``) runs in its own process and, after every
accepted subscribe, floods ``--messages`` ``aibot_msg_callback`` frames (~0.5 KB each,
single-chat texts from distinct users) as fast as the socket takes them.  In this
process, one after the other:

- floor         the least a client must do, written plainly: trio-websocket (same
                64 KiB receive buffer), the subscribe, ``json.loads`` of every frame and a
                dict-lookup mapping of the message fields;
- dshim reader  dshim's link (``WecomLink``: subscribe, pings, ack matching, bounded
                decode of the envelope, callbacks handed over one at a time) and the
                mapping to ``InboundMessage``;
- floor+dedup   the floor plus one SQLite ``INSERT OR IGNORE`` (msgid + raw frame) per
                callback on a worker thread, WAL, synchronous=NORMAL;
- dshim 1-6     dshim's reader and mapping plus pipeline steps 1-6
                (``BotRuntime.accept``: gates, persisted dedup + durable inbox, access,
                commands, lanes) with the lane handler doing nothing.

CPU is this process's time (not the fake's), from the subscribe ack to the last callback
handled; each run is repeated, the median is printed with the spread and the ratio to the
floor.  Compare within one run only.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchkit as kit  # noqa: E402

from dshim.channels.wecom import protocol as p  # noqa: E402
from dshim.channels.wecom.client import WecomLink  # noqa: E402
from dshim.net.ws import DEFAULT_OPTIONS  # noqa: E402


async def floor(env: dict[str, Any], n: int, db: Path | None = None) -> tuple[float, float]:
    meter = kit.Meter(n)
    with kit.open_floor_dedup(db, key=("mid",)) as dedup:
        async with kit.open_floor_websocket(env["ws_url"], DEFAULT_OPTIONS) as ws:
            sub = {"bot_id": env["bot_id"], "secret": env["secret"]}
            await ws.send_message(p.frame(p.SUBSCRIBE, "aibot_subscribe_1_00000000", sub))
            while not meter.done.is_set():
                data = await ws.get_message()
                frame = json.loads(data)
                cmd = frame.get("cmd")
                if cmd is None:
                    meter.start()
                    continue
                if cmd != p.MSG_CALLBACK:
                    continue
                body = frame["body"]
                group = body.get("chattype") == "group"
                mapped = {
                    "id": body["msgid"],
                    "conversation": body.get("chatid") if group else body["from"]["userid"],
                    "sender": body["from"]["userid"],
                    "content": (body.get("text") or {}).get("content", ""),
                    "req_id": frame["headers"]["req_id"],
                }
                if dedup is not None:
                    await dedup.insert(mapped["id"], data)
                meter.tick()
    return meter.wall, meter.cpu


async def dshim_link(
    env: dict[str, Any], n: int, handle: Callable[[p.Callback, p.Mapper], Awaitable[None]]
) -> tuple[float, float]:
    meter = kit.Meter(n)
    link = WecomLink(env["ws_url"], env["bot_id"], env["secret"])
    mapper = p.Mapper(env["bot_id"])
    callbacks_in, callbacks = trio.open_memory_channel[p.Callback](0)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run, callbacks_in)
        meter.start()
        async for cb in callbacks:
            await handle(cb, mapper)
            meter.tick()
            if meter.done.is_set():
                break
        nursery.cancel_scope.cancel()
    return meter.wall, meter.cpu


reader_only, pipeline = kit.reader_and_pipeline(
    dshim_link,
    channel="wecom",
    bot_id=lambda env: env["bot_id"],
    decode=lambda cb, mapper: mapper.decode_frame(cb.raw),
    raw=lambda cb: cb.raw,
)


def decode_costs(env: dict[str, Any]) -> str:
    """Per-callback decode cost: classify + msgspec views + mapping vs json.loads."""
    body = {
        "msgid": "msg1796112000000001",
        "aibotid": env["bot_id"],
        "chattype": "single",
        "from": {"userid": "zhangsan"},
        "create_time": 1796112000,
        "msgtype": "text",
        "text": {"content": "message 1 " + "lorem ipsum " * 20},
    }
    raw = json.dumps(
        {"cmd": p.MSG_CALLBACK, "headers": {"req_id": "aibot_msg_callback_1_0"}, "body": body}
    ).encode()
    mapper = p.Mapper(env["bot_id"])
    classify = kit.micros(lambda: p.classify(raw))
    mapping = kit.micros(lambda: mapper.decode_frame(raw))
    loads = kit.micros(lambda: json.loads(raw))
    return (
        f"decode of one {len(raw)}-byte callback: envelope classify {classify:.1f} µs, "
        f"envelope+body views + mapping to InboundMessage {mapping:.1f} µs; "
        f"json.loads alone {loads:.1f} µs"
    )


def main(args: argparse.Namespace) -> None:
    kit.fake_bench(
        "dshim.testing.fakes.wecom",
        args.messages,
        args.repeat,
        unit="callback",
        names=("floor (trio-websocket + json.loads + dict mapping)", "dshim link reader + mapping"),
        floor=floor,
        reader=reader_only,
        pipeline=pipeline,
        notes=lambda env: [decode_costs(env)],
    )


if __name__ == "__main__":
    main(kit.argument_parser(__doc__, "--messages").parse_args())
