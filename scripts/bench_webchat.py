"""Web chat throughput: messages/s and CPU per message, side by side with a floor.

    python scripts/bench_webchat.py [--messages 5000] [--repeat 3] [--conversations 20]

For every run a scripted tab (``python -m dshim.testing.fakes.webchat --flood N URL``)
starts in its own process, joins ``--conversations`` direct chats and sends N ``send``
frames (~1 KB of text each) as fast as the socket takes them, reading what comes back.
In this process, one after the other, each on a fresh hypercorn (the endpoint's own
``serve_endpoint``, port 0):

- floor          the least a websocket chat endpoint must do, written plainly: a raw ASGI
                 websocket app that ``json.loads`` every frame and answers nothing;
- floor+dedup    the floor plus the least a *durable* chat must add: one SQLite ``INSERT OR
                 IGNORE`` (dedup key + raw frame) per message on a worker thread, WAL,
                 synchronous=NORMAL;
- dshim chat     dshim's endpoint (``Endpoint``: routing, ``AsgiWebSocket``) and the web
                 chat's tab reader and reader task (``Chat``: msgspec frame parsing, the
                 stored event, ``map_event``, the conversation's message log in SQLite,
                 the message shown back and ``accepted`` to the tab) with the pipeline
                 answering "accepted" without doing anything;
- dshim 1-6      the same plus pipeline steps 1-6 (``BotRuntime.accept``: gates, persisted
                 dedup + durable inbox on SQLite, access, commands, lanes), the lane
                 handler (step 7, the turn) doing nothing, as in bench_discord.py.

The floors answer nothing and the tab ends when they close the socket; dshim answers each
message twice (the message shown back to the conversation, then ``accepted``) and the tab
ends at the N-th ``accepted``.  CPU is this process's time (all threads; the tab's CPU is
not counted) from the first message handed to the handler to the N-th one handled; the
median of ``--repeat`` runs is printed with the spread and the ratio to both floors.
Compare within one run only.
"""

from __future__ import annotations

import argparse
import functools
import importlib.metadata
import json
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import msgspec
import trio
import trio_websocket

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchkit import FloorDedup, Meter, Run, argument_parser, micros, open_floor_dedup  # noqa: E402

from dshim.channels.registry import parse_config
from dshim.channels.webchat import models as m  # noqa: E402
from dshim.channels.webchat import protocol  # noqa: E402
from dshim.channels.webchat.channel import Chat  # noqa: E402
from dshim.channels.webchat.protocol import BotIdentity, Member  # noqa: E402
from dshim.harness.echo import EchoHarness  # noqa: E402
from dshim.http.app import Endpoint  # noqa: E402
from dshim.http.server import serve_endpoint  # noqa: E402
from dshim.log import configure_logging  # noqa: E402
from dshim.model import InboundMessage, Skip, Verdict  # noqa: E402
from dshim.pipeline.runtime import open_bot_runtime  # noqa: E402
from dshim.store import open_store  # noqa: E402
from dshim.store.base import BoundStore  # noqa: E402
from dshim.testing.fakes.webchat import FloodResult, flood_frames  # noqa: E402

BOT = "bench"
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


async def run_tab(url: str, args: argparse.Namespace) -> FloodResult:
    """The scripted tab's flood, in its own process."""
    tab = [sys.executable, "-m", "dshim.testing.fakes.webchat", url, "--flood", str(args.messages)]
    tab += ["--conversations", str(args.conversations), "--size", str(args.size)]
    done = await trio.run_process(tab, capture_stdout=True)
    got = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return FloodResult(**got)


# -- floor ----------------------------------------------------------------------------------


class FloorApp:
    """A raw ASGI websocket endpoint: ``json.loads`` of every frame (and, with a database,
    one durable insert per message); closes the socket once N messages were handled."""

    def __init__(self, meter: Meter, dedup: FloorDedup | None) -> None:
        self.meter = meter
        self.dedup = dedup

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"]
                await send({"type": kind + ".complete"})
                if kind == "lifespan.shutdown":
                    return
        elif scope["type"] == "websocket":
            await receive()  # websocket.connect
            await send({"type": "websocket.accept"})
            while True:
                message = await receive()
                if message["type"] != "websocket.receive":
                    return
                data = message.get("text") or message.get("bytes") or b""
                frame = json.loads(data)
                if frame.get("type") != "send":
                    continue
                self.meter.start()
                if self.dedup is not None:
                    await self.dedup.insert(frame["conversation"], frame["client_id"], data)
                self.meter.tick()
                if self.meter.done.is_set():
                    await send({"type": "websocket.close", "code": 1000})
                    return
        else:
            await receive()
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    async def close_sockets(self) -> None:
        """(serve_endpoint's shutdown hook: the floor's socket is closed already.)"""


async def floor(args: argparse.Namespace, db: Path | None = None) -> tuple[float, float]:
    meter = Meter(args.messages)
    with open_floor_dedup(db) as dedup:
        app = FloorApp(meter, dedup)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            [base] = await nursery.start(
                functools.partial(serve_endpoint, app, "127.0.0.1:0", shutdown=stop)  # type: ignore[arg-type]
            )
            result = await run_tab(base.replace("http://", "ws://", 1) + "/ws", args)
            stop.set()
    assert meter.done.is_set() and result.sent == args.messages, result
    return meter.wall, meter.cpu


# -- dshim ----------------------------------------------------------------------------------


class Metered:
    """The pipeline as the chat's reader sees it, counting what it handled."""

    def __init__(self, meter: Meter, accept: Callable[..., Awaitable[Verdict]] | None) -> None:
        self.meter = meter
        self._accept = accept
        self.verdicts: dict[str, int] = {}

    async def accept(self, item: InboundMessage | Skip, raw: bytes | None = None) -> Verdict:
        self.meter.start()
        if self._accept is None:
            verdict = Verdict(accepted=True)
        else:
            verdict = await self._accept(item, raw)
        key = "accepted" if verdict.accepted else str(verdict.reason)
        self.verdicts[key] = self.verdicts.get(key, 0) + 1
        self.meter.tick()
        return verdict


async def chat(
    args: argparse.Namespace, tmp: Path, *, pipeline: bool
) -> tuple[float, float, dict[str, int]]:
    n = args.messages
    config = parse_config(
        {"bots": [{"name": BOT, "channel": "webchat", "lanes": {"max_queue": n + 10}}]},
        env={},
        channel_settings=False,
    )
    meter = Meter(n)
    me = BotIdentity.for_bot(BOT)
    endpoint = Endpoint()
    endpoint.root_bot = BOT
    async with open_store(tmp) as store:
        web = Chat(store=BoundStore(store, BOT), me=me, clock=time.time, bot=BOT)
        endpoint.mount_websocket(BOT, "ws", web.serve_tab)
        async with open_bot_runtime(
            config=config,
            bot=config.bots[0],
            bot_id=me.id,
            store=store,
            outbound=web.outbound,
            harness=EchoHarness(),
            decode_raw=web.decode_raw,
        ) as rt:

            async def no_turn(item: Any, lane: Any) -> None:
                rt._done()

            rt.lanes._handler = no_turn
            inbound = Metered(meter, rt.accept if pipeline else None)
            stop = trio.Event()
            async with trio.open_nursery() as nursery:
                [base] = await nursery.start(
                    functools.partial(serve_endpoint, endpoint, "127.0.0.1:0", shutdown=stop)
                )
                nursery.start_soon(web.read, inbound)
                result = await run_tab(base.replace("http://", "ws://", 1) + "/ws", args)
                stop.set()
                web.close()
            await rt.wait_idle()
    assert result.accepted == n and result.refused == 0, result
    return meter.wall, meter.cpu, inbound.verdicts


def decode_costs(args: argparse.Namespace) -> str:
    """Per-message cost of the web chat's own steps on one flooded frame vs json.loads."""
    _, sends = flood_frames(1, size=args.size)
    data = sends[0]
    me = BotIdentity.for_bot(BOT)
    member = Member("flood-0", "direct", "u-flood", "Flood")
    frame = protocol.parse_frame(data)
    assert isinstance(frame, m.SendFrame)
    raw = protocol.build_event(frame, member, at=0.0)

    def parse() -> None:
        parsed = protocol.parse_frame(data)
        assert isinstance(parsed, m.SendFrame)
        protocol.build_event(parsed, member, at=0.0)

    parse_us = micros(parse)
    mapping_us = micros(lambda: protocol.map_event(raw, me))
    loads_us = micros(lambda: json.loads(data))
    return (
        f"one {len(data.encode())}-byte send frame: parse_frame + build_event {parse_us:.1f} µs, "
        f"map_event {mapping_us:.1f} µs; json.loads alone {loads_us:.1f} µs"
    )


async def measure(args: argparse.Namespace) -> tuple[list[Run], dict[str, int]]:
    configure_logging("error", "json")
    n = args.messages
    runs = [
        Run("floor (hypercorn ASGI websocket + json.loads)", n),
        Run("floor + durable dedup (one SQLite INSERT/message)", n),
        Run("dshim endpoint + web chat (message log, answers)", n),
        Run("dshim endpoint + web chat + pipeline steps 1-6", n),
    ]
    verdicts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="dshim-bench-") as d:
        for rep in range(args.repeat):
            with trio.fail_after(600):
                runs[0].add(*await floor(args))
                runs[1].add(*await floor(args, Path(d) / f"floor-{rep}.sqlite3"))
                wall, cpu, _ = await chat(args, Path(d) / f"chat-{rep}", pipeline=False)
                runs[2].add(wall, cpu)
                wall, cpu, verdicts = await chat(args, Path(d) / f"store-{rep}", pipeline=True)
                runs[3].add(wall, cpu)
    return runs, verdicts


def main(args: argparse.Namespace) -> None:
    runs, verdicts = trio.run(measure, args)
    print(
        f"python {sys.version.split()[0]}, trio {trio.__version__}, hypercorn "
        f"{importlib.metadata.version('hypercorn')}, "
        f"trio-websocket {trio_websocket.__version__} (the tab), msgspec {msgspec.__version__}, "
        f"nproc {os.cpu_count()}; {args.messages} messages over {args.conversations} "
        f"conversations x {args.repeat} runs, median (min-max)"
    )
    print(decode_costs(args))
    print(
        f"{'run':52} {'messages/s':>11} {'CPU ms/message':>15} {'(min-max)':>13} "
        f"{'vs floor':>9} {'vs floor+dedup':>15}"
    )
    for r in runs:
        print(
            f"{r.name:52} {r.rate:11.0f} {r.cpu_ms:15.3f} {r.spread():>13} "
            f"{r.cpu_ms / runs[0].cpu_ms:8.2f}x {r.cpu_ms / runs[1].cpu_ms:14.2f}x"
        )
    print(f"pipeline verdicts (last run): {dict(sorted(verdicts.items()))}")


if __name__ == "__main__":
    parser = argument_parser(__doc__, "--messages")
    parser.add_argument("--conversations", type=int, default=20)
    parser.add_argument("--size", type=int, default=1000, help="characters per message")
    main(parser.parse_args())
