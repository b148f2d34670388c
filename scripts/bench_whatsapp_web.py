"""WhatsApp Web throughput: messages/s and CPU per message, next to a floor.

    python scripts/bench_whatsapp_web.py [--messages 5000] [--repeat 3]

The fake account (``dshim.testing.fakes.whatsapp_web``) runs in its own process and,
after every connect, delivers ``--messages`` message events (neonize's ``Message`` event
as protobuf JSON, ~0.6 KB each: direct texts from 200 users) over the engine's websocket
as fast as the socket takes them, each acknowledged by the client.  In this process, one
after the other:

- floor         the least a client must do, written plainly: trio-websocket (the same
                receive buffer), ``json.loads`` of every frame, a dict-lookup mapping of
                the message fields, the ack sent back;
- dshim reader  dshim's wire engine (``WireEngine``: calls and events multiplexed on the
                socket, an ack once the message was taken) and the mapping
                (``protocol.map_event``: msgspec views of the event) to ``InboundMessage``;
- floor+dedup   the floor plus one SQLite ``INSERT OR IGNORE`` (message id + raw event)
                per message on a worker thread, WAL, synchronous=NORMAL;
- dshim 1-6     dshim's engine and mapping plus pipeline steps 1-6
                (``BotRuntime.accept``: gates, persisted dedup + durable inbox, access,
                commands, lanes) with the lane handler doing nothing, the ack after it.

The live channel runs neonize (whatsmeow, Go) in process instead of the wire engine: its
events cross from Go's threads through a bounded channel (``bridge.py``); what this bench
measures is everything from the event's protobuf JSON on.  CPU is this process's time
(not the fake's), from ``connected`` to the last message handled; each run is repeated,
the median is printed with the spread and the ratio to the floor.  Compare within one run
only.
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

from dshim.channels.whatsapp_web import protocol as p  # noqa: E402
from dshim.channels.whatsapp_web.engine import Connected, Incoming  # noqa: E402
from dshim.channels.whatsapp_web.wire import WS_OPTIONS, WireEngine  # noqa: E402
from dshim.testing.fakes.whatsapp_web import flood_event  # noqa: E402


def identity(env: dict[str, Any]) -> p.BotIdentity:
    return p.BotIdentity(env["jid"], env["lid"], "dshim bot")


async def floor(env: dict[str, Any], n: int, db: Path | None = None) -> tuple[float, float]:
    meter = kit.Meter(n)
    with kit.open_floor_dedup(db, key=("id",)) as dedup:
        async with kit.open_floor_websocket(env["engine_url"], WS_OPTIONS) as ws:
            while not meter.done.is_set():
                frame = json.loads(await ws.get_message())
                if frame.get("type") != "event":
                    continue
                if frame["event"] == "connected":
                    meter.start()
                    continue
                if frame["event"] != "message":
                    continue
                event = frame["raw"]
                info, message = event["Info"], event["Message"]
                source = info["MessageSource"]
                mapped = {
                    "id": info["ID"],
                    "conversation": f"{source['Chat']['User']}@{source['Chat']['Server']}",
                    "sender": source["Sender"]["User"],
                    "content": message.get("conversation")
                    or (message.get("extendedTextMessage") or {}).get("text", ""),
                }
                if dedup is not None:
                    await dedup.insert(mapped["id"], json.dumps(event))
                await ws.send_message(json.dumps({"type": "ack", "ack": frame["ack"]}))
                meter.tick()
    return meter.wall, meter.cpu


async def dshim_engine(
    env: dict[str, Any], n: int, handle: Callable[[Incoming, p.BotIdentity], Awaitable[None]]
) -> tuple[float, float]:
    meter = kit.Meter(n)
    me = identity(env)
    engine = WireEngine(env["engine_url"])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(engine.connect)
        async for event in engine.events():
            if isinstance(event, Connected):
                meter.start()
            elif isinstance(event, Incoming):
                await handle(event, me)
                event.taken.set()
                meter.tick()
                if meter.done.is_set():
                    break
        await engine.disconnect()
        engine.close()
        nursery.cancel_scope.cancel()
    return meter.wall, meter.cpu


reader_only, pipeline = kit.reader_and_pipeline(
    dshim_engine,
    channel="whatsapp_web",
    bot_id=lambda env: env["jid"].partition("@")[0],
    decode=lambda event, me: p.map_event(event.raw, bot_id=me.id, me=me),
    raw=lambda event: event.raw,
)


def decode_costs(env: dict[str, Any]) -> str:
    """Per-message decode cost: msgspec views + mapping vs json.loads."""
    raw = json.dumps(flood_event(1), separators=(",", ":")).encode()
    me = identity(env)
    mapping = kit.micros(lambda: p.map_event(raw, bot_id=me.id, me=me))
    loads = kit.micros(lambda: json.loads(raw))
    return (
        f"decode of one {len(raw)}-byte message event: views + mapping to InboundMessage "
        f"{mapping:.1f} µs; json.loads alone {loads:.1f} µs"
    )


def main(args: argparse.Namespace) -> None:
    kit.fake_bench(
        "dshim.testing.fakes.whatsapp_web",
        args.messages,
        args.repeat,
        unit="message",
        names=(
            "floor (trio-websocket + json.loads + dict mapping + ack)",
            "dshim wire engine + mapping",
        ),
        floor=floor,
        reader=reader_only,
        pipeline=pipeline,
        notes=lambda env: [decode_costs(env)],
    )


if __name__ == "__main__":
    main(kit.argument_parser(__doc__, "--messages").parse_args())
