"""Discord gateway throughput: dispatches/s and CPU per dispatch, side by side with a floor.

    python scripts/bench_discord.py [--dispatches 5000] [--repeat 3]

The fake Discord (``dshim.testing.fakes.discord``) runs in its own process and, after
every Identify, floods ``--dispatches`` MESSAGE_CREATE frames (~1 KB each, direct
messages) as fast as it can.  In this process, one after the other:

- floor         the least a gateway client must do, written as plainly as possible:
                trio-websocket (same 64 KiB receive buffer), ``json.loads`` of every
                frame, a dict lookup mapping of the message fields;
- dshim reader  dshim's gateway client (``GatewayProtocol`` on the kit's websocket
                runner via ``run_gateway``: bounded-depth msgspec envelope, sequence
                tracking, heartbeats, in-order delivery) and the MESSAGE_CREATE mapping
                to ``InboundMessage``;
- floor+dedup   the floor plus the least a *durable* gateway must add: one SQLite
                ``INSERT OR IGNORE`` (dedup key + raw frame) per dispatch on a worker
                thread, WAL, synchronous=NORMAL;
- dshim 1-6     dshim's reader and mapping plus pipeline steps 1-6
                (``BotRuntime.accept``: gates, persisted dedup + durable inbox on SQLite,
                access, commands, lanes) with the lane handler doing nothing.

CPU is this process's time (the fake's CPU is not counted), from READY to the last
dispatch handled; each run is repeated and the median is printed with the spread, plus
the ratio to the floor.  Compare within one run only.
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

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchkit as kit  # noqa: E402

from dshim.channels.discord import models as m  # noqa: E402
from dshim.channels.discord.client import (  # noqa: E402
    USER_AGENT,
    WS_OPTIONS,
    RestClient,
    run_gateway,
)
from dshim.channels.discord.protocol import GatewayProtocol, MessageMapper, gateway_url  # noqa: E402
from dshim.channels.kit.gateway import Dispatch  # noqa: E402
from dshim.net.http import open_http  # noqa: E402

# -- floor ----------------------------------------------------------------------------------


async def floor(env: dict[str, Any], n: int, db: Path | None = None) -> tuple[float, float]:
    meter = kit.Meter(n)
    url = gateway_url(env["gateway_url"])
    mapped: list[dict[str, Any]] = []
    with kit.open_floor_dedup(db) as dedup:
        async with kit.open_floor_websocket(url, WS_OPTIONS) as ws:
            json.loads(await ws.get_message())  # hello
            identify = {"op": 2, "d": {"token": env["token"], "intents": 37377, "properties": {}}}
            await ws.send_message(json.dumps(identify))
            bot_id = env["bot_id"]
            while not meter.done.is_set():
                data = await ws.get_message()
                frame = json.loads(data)
                if frame.get("t") == "READY":
                    meter.start()
                elif frame.get("t") == "MESSAGE_CREATE":
                    d = frame["d"]
                    author = d["author"]
                    mapped.append(
                        {
                            "id": d["id"],
                            "conversation": d["channel_id"],
                            "direct": "guild_id" not in d,
                            "sender": author["id"],
                            "name": author.get("global_name") or author.get("username"),
                            "bot": author.get("bot", False),
                            "content": d.get("content", ""),
                            "mentioned": any(u["id"] == bot_id for u in d.get("mentions", ())),
                        }
                    )
                    if dedup is not None:
                        await dedup.insert(d["channel_id"], d["id"], data)
                    mapped.clear()
                    meter.tick()
    return meter.wall, meter.cpu


# -- dshim ----------------------------------------------------------------------------------


async def dshim_gateway(
    env: dict[str, Any], n: int, handle: Callable[[Dispatch, MessageMapper], Awaitable[None]]
) -> tuple[float, float]:
    meter = kit.Meter(n)
    async with open_http(user_agent=USER_AGENT) as http:
        rest = RestClient(http, token=env["token"], api_base=env["api_base"])
        me = await rest.get_current_user()
        mapper = MessageMapper(me.id)
        # READY is delivered too: the meter starts there, like the floor's.
        gw = GatewayProtocol(
            token=env["token"],
            random=random.random,
            wanted=frozenset({"READY", "MESSAGE_CREATE"}),
        )

        async def deliver(dispatch: Dispatch) -> None:
            if dispatch.t == "READY":
                meter.start()
                return
            await handle(dispatch, mapper)
            meter.tick()

        return await kit.until_counted(meter, functools.partial(run_gateway, gw, rest, deliver))


reader_only, pipeline = kit.reader_and_pipeline(
    dshim_gateway,
    channel="discord",
    bot_id=lambda env: env["bot_id"],
    decode=lambda dispatch, mapper: mapper.decode_message(dispatch.d),
    raw=lambda dispatch: dispatch.frame,
)


def decode_costs(env: dict[str, Any]) -> str:
    """Per-dispatch decode cost of one flooded frame: msgspec views vs json.loads."""
    fake_msg = {
        "id": "1576900598169600010",
        "type": 0,
        "channel_id": "1540661811609600005",
        "author": {"id": "1431945451929600007", "username": "ada", "global_name": "Ada Lovelace"},
        "content": "ping " + "lorem ipsum dolor sit amet " * 20,
        "timestamp": "2026-11-30T10:00:00.000000+00:00",
        "mentions": [],
        "attachments": [],
        "embeds": [],
        "channel_type": 1,
    }
    raw = json.dumps({"op": 0, "t": "MESSAGE_CREATE", "s": 5, "d": fake_msg}).encode()
    mapper = MessageMapper(env["bot_id"])
    return kit.gateway_decode_costs(raw, "dispatch", m, mapper)


def main(args: argparse.Namespace) -> None:
    kit.gateway_bench(
        "dshim.testing.fakes.discord",
        args,
        floor=floor,
        reader=reader_only,
        pipeline=pipeline,
        decode_costs=decode_costs,
    )


if __name__ == "__main__":
    main(kit.argument_parser(__doc__, "--dispatches").parse_args())
