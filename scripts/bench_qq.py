"""QQ gateway throughput: events/s and CPU per event, side by side with a floor.

    python scripts/bench_qq.py [--dispatches 5000] [--repeat 3]

The fake QQ (``dshim.testing.fakes.qq``) runs in its own process and, after every
Identify, floods ``--dispatches`` C2C_MESSAGE_CREATE frames (~0.6 KB each, with
``message_scene.ext``) as fast as it can.  In this process, one after the other:

- floor         the least a gateway client must do, written as plainly as possible:
                trio-websocket (same 64 KiB receive buffer), ``json.loads`` of every
                frame, a dict lookup mapping of the message fields;
- dshim reader  dshim's gateway client (the kit's gateway session with QQ's dialect on
                the websocket runner via ``run_gateway``: access token, bounded-depth
                msgspec envelope, sequence tracking, heartbeats, in-order delivery) and
                the C2C_MESSAGE_CREATE mapping to ``InboundMessage``;
- floor+dedup   the floor plus the least a *durable* gateway must add: one SQLite
                ``INSERT OR IGNORE`` (dedup key + raw frame) per dispatch on a worker
                thread, WAL, synchronous=NORMAL;
- dshim 1-6     dshim's reader and mapping plus pipeline steps 1-6
                (``BotRuntime.accept``: gates, persisted dedup + durable inbox on SQLite,
                access, commands, lanes) with the lane handler doing nothing.

CPU is this process's time (the fake's CPU is not counted), from READY to the last
dispatch handled; each run is repeated and the median is printed with the spread, plus
the ratio to the floor.  Compare within one run only.

The peer, when installed (a benchmark-only dependency: ``pip install "nonebot2[httpx,websockets]"
nonebot-adapter-qq``): nonebot2 with nonebot-adapter-qq in its own process against a fresh
fake, a message handler counting the events (its process's CPU from the first event to the
n-th); without it the script says so.
"""

from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchkit as kit  # noqa: E402

from dshim.channels.kit.gateway import Dispatch  # noqa: E402
from dshim.channels.qq import models as m  # noqa: E402
from dshim.channels.qq.client import USER_AGENT, WS_OPTIONS, QQApi, run_gateway  # noqa: E402
from dshim.channels.qq.protocol import (  # noqa: E402
    QQMapper,
    auth_header,
    gateway_session,
    scrub_frame,
)
from dshim.net.http import open_http  # noqa: E402

# -- floor ----------------------------------------------------------------------------------


async def floor(env: dict[str, Any], n: int, db: Path | None = None) -> tuple[float, float]:
    meter = kit.Meter(n)
    with kit.open_floor_dedup(db) as dedup:
        async with httpx.AsyncClient() as http:
            resp = await http.post(
                env["http_url"] + "/app/getAppAccessToken",
                json={"appId": env["app_id"], "clientSecret": env["client_secret"]},
            )
            token = resp.json()["access_token"]
        mapped: list[dict[str, Any]] = []
        async with kit.open_floor_websocket(env["gateway_url"], WS_OPTIONS) as ws:
            json.loads(await ws.get_message())  # hello
            identify = {
                "op": 2,
                "d": {
                    "token": f"QQBot {token}",
                    "intents": 1 << 25,
                    "shard": [0, 1],
                    "properties": {},
                },
            }
            await ws.send_message(json.dumps(identify))
            while not meter.done.is_set():
                data = await ws.get_message()
                frame = json.loads(data)
                if frame.get("t") == "READY":
                    meter.start()
                elif frame.get("t") == "C2C_MESSAGE_CREATE":
                    d = frame["d"]
                    author = d["author"]
                    ext = dict(e.split("=", 1) for e in d["message_scene"]["ext"])
                    mid = f"{d['id']}|{ext.get('msg_idx', '')}"
                    mapped.append(
                        {
                            "id": mid,
                            "conversation": "c2c:" + author["user_openid"],
                            "sender": author["user_openid"],
                            "content": d.get("content", "").strip(),
                        }
                    )
                    if dedup is not None:
                        await dedup.insert(author["user_openid"], mid, data)
                    mapped.clear()
                    meter.tick()
    return meter.wall, meter.cpu


# -- dshim ----------------------------------------------------------------------------------


async def dshim_gateway(
    env: dict[str, Any], n: int, handle: Callable[[Dispatch, QQMapper], Awaitable[None]]
) -> tuple[float, float]:
    meter = kit.Meter(n)
    async with open_http(user_agent=USER_AGENT) as http:
        api = QQApi(
            http,
            app_id=env["app_id"],
            client_secret=env["client_secret"],
            api_base=env["http_url"],
            token_base=env["http_url"],
        )
        me = await api.get_me()
        mapper = QQMapper(me.id)
        # READY is delivered too: the meter starts there, like the floor's.
        gw = gateway_session(
            token=auth_header(await api.token()),
            random=random.random,
            intents=1 << 25,
            gateway_override=env["gateway_url"],
            wanted=frozenset({"READY", "C2C_MESSAGE_CREATE"}),
        )

        async def deliver(dispatch: Dispatch) -> None:
            if dispatch.t == "READY":
                meter.start()
                return
            await handle(dispatch, mapper)
            meter.tick()

        return await kit.until_counted(meter, functools.partial(run_gateway, gw, api, deliver))


reader_only, pipeline = kit.reader_and_pipeline(
    dshim_gateway,
    channel="qq",
    bot_id=lambda env: env["bot_id"],
    decode=lambda dispatch, mapper: mapper.decode_message(dispatch.t, dispatch.d),
    raw=lambda dispatch: scrub_frame(dispatch.frame),
)


def decode_costs(env: dict[str, Any]) -> str:
    """Per-event decode cost of one flooded frame: msgspec views vs json.loads."""
    d = {
        "id": "ROBOT1.0_kD4.cI-uQ2iI5Mx0001",
        "author": {"id": "E4F3C2B1A0998877665544332211AABB", "user_openid": "E4F3"},
        "content": "ping " + "lorem ipsum dolor sit amet " * 12,
        "timestamp": "2026-11-30T18:00:00+08:00",
        "attachments": [],
        "message_type": 0,
        "message_scene": {"source": "default", "ext": ["msg_idx=REFIDX_x==", "auth_token=t"]},
    }
    raw = json.dumps({"op": 0, "s": 5, "t": "C2C_MESSAGE_CREATE", "id": "e:1", "d": d}).encode()
    mapper = QQMapper(env["bot_id"])
    return kit.gateway_decode_costs(raw, "event", m, mapper)


def main(args: argparse.Namespace) -> None:
    runs = kit.gateway_bench(
        "dshim.testing.fakes.qq",
        args,
        floor=floor,
        reader=reader_only,
        pipeline=pipeline,
        decode_costs=decode_costs,
    )
    with kit.open_fake("dshim.testing.fakes.qq", args.dispatches) as fresh:
        peer = nonebot_peer(args, fresh)
    if peer is None:
        print("nonebot-adapter-qq: not installed (benchmark-only peer); not measured")
    else:
        print(f"{'peer':52} {'dispatches/s':>12} {'CPU ms/dispatch':>16}")
        base = runs[0].cpu_ms
        for name, rate, cpu in peer:
            print(f"{name:52} {rate:12.0f} {cpu:16.3f} {'':>13} {cpu / base:8.2f}x")
        print("(the peer's handler counts each message event; its own process's CPU)")


#: The peer: nonebot2 with nonebot-adapter-qq against the same fake, in its own process;
#: a message handler counts the events and prints wall and CPU from the first to the n-th.
NONEBOT_CHILD = """
import json, os, sys, time
import nonebot
from nonebot.adapters.qq import Adapter
env, n = json.loads(sys.argv[1]), int(sys.argv[2])
intent = {k: False for k in ("guilds", "guild_members", "guild_message_reactions",
          "message_audit", "at_messages")}
intent["c2c_group_at_messages"] = True
nonebot.init(driver="~httpx+~websockets", log_level="ERROR",
             qq_api_base=env["http_url"] + "/", qq_auth_base=env["http_url"] + "/app/getAppAccessToken",
             qq_bots=[{"id": env["app_id"], "secret": env["client_secret"], "intent": intent}])
nonebot.get_driver().register_adapter(Adapter)
seen = [0, 0.0, 0.0]
matcher = nonebot.on_message()
@matcher.handle()
async def count() -> None:
    if seen[0] == 0:
        seen[1], seen[2] = time.perf_counter(), time.process_time()
    seen[0] += 1
    if seen[0] == n:
        wall, cpu = time.perf_counter() - seen[1], time.process_time() - seen[2]
        print(json.dumps({"wall": wall, "cpu": cpu}), flush=True)
        os._exit(0)
nonebot.run()
"""


def nonebot_peer(
    args: argparse.Namespace, fake: dict[str, Any]
) -> list[tuple[str, float, float]] | None:
    """(name, events/s, CPU ms/event) of nonebot-adapter-qq against the fresh ``fake``
    (its own process, flooding ``--dispatches`` messages per Identify), None when not
    installed."""
    try:
        import nonebot.adapters.qq  # type: ignore[import-not-found]  # noqa: F401
    except ImportError:
        return None
    env = json.dumps(fake)
    n = args.dispatches
    walls, cpus = [], []
    for _ in range(args.repeat):
        out = subprocess.run(
            [sys.executable, "-c", NONEBOT_CHILD, env, str(n)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        line = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
        if not line:
            print(f"nonebot-adapter-qq: the peer failed: {out.stderr[-500:]}")
            return []
        got = json.loads(line)
        walls.append(got["wall"])
        cpus.append(got["cpu"])
    wall, cpu = statistics.median(walls), statistics.median(cpus)
    return [("nonebot2 + nonebot-adapter-qq (reader + matcher)", n / wall, cpu * 1000 / n)]


if __name__ == "__main__":
    main(kit.argument_parser(__doc__, "--dispatches").parse_args())
