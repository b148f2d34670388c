"""Pipeline throughput: normalized events/s and CPU per event, side by side with a floor.

    python scripts/bench_pipeline.py [--events 20000] [--turn-events 5000] [--conversations 100]

Three runs in one process, each on a fresh SQLite file in a temporary directory:

- floor      the least any durable gateway must do per event, written as plainly as
             possible: msgspec-decode the normalized JSON, one SQLite INSERT OR IGNORE
             (dedup) on the store's worker thread, one memory-channel hop;
- dshim 1-6  ``BotRuntime.accept`` (decode, gates, persisted dedup + durable inbox,
             access, commands, lanes) with the lane handler doing nothing;
- dshim 1-7  the same plus the turn: prompt assembly, session binding, the echo harness
             streaming the answer in 64-character deltas, the recording outbound,
             transcript and outbound index writes.

Prints events/s, CPU ms/event (process time) and the ratio to the floor.  Numbers are
for this machine and this run only; compare within one run.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import msgspec
import trio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dshim import normalized  # noqa: E402
from dshim.channels.registry import parse_config
from dshim.harness.echo import EchoHarness  # noqa: E402
from dshim.log import configure_logging  # noqa: E402
from dshim.pipeline.runtime import open_bot_runtime  # noqa: E402
from dshim.store import open_store  # noqa: E402
from dshim.testing.outbound import RecordingOutbound  # noqa: E402


def make_events(n: int, conversations: int, now: float) -> list[bytes]:
    out = []
    for i in range(n):
        conv = str(1000 + i % conversations)
        ev = {
            "message_id": str(i),
            "conversation_id": conv,
            "conversation_type": "direct",
            "sender_id": conv,
            "sender_name": "Bench User",
            "content": f"ping {i} " + "lorem ipsum dolor sit amet " * 4,
            "received_at": now,
        }
        out.append(msgspec.json.encode(ev))
    return out


class Result:
    def __init__(self, name: str, events: int, wall: float, cpu: float) -> None:
        self.name = name
        self.events = events
        self.wall = wall
        self.cpu = cpu

    @property
    def rate(self) -> float:
        return self.events / self.wall

    @property
    def cpu_ms(self) -> float:
        return self.cpu * 1000 / self.events


async def run_floor(events: list[bytes], tmp: Path) -> Result:
    conn = sqlite3.connect(tmp / "floor.sqlite3", check_same_thread=False, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    conn.execute("CREATE TABLE dedup (conv TEXT, mid TEXT, PRIMARY KEY (conv, mid))")
    limiter = trio.CapacityLimiter(1)
    decoder = msgspec.json.Decoder(normalized.WireEvent)
    send, recv = trio.open_memory_channel[Any](8)
    done = 0

    async def consumer() -> None:
        nonlocal done
        async for _ in recv:
            done += 1

    def insert(conv: str, mid: str) -> int:
        return conn.execute("INSERT OR IGNORE INTO dedup VALUES (?, ?)", (conv, mid)).rowcount

    w0, c0 = time.perf_counter(), time.process_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(consumer)
        async with send:
            for raw in events:
                ev = decoder.decode(raw)
                if await trio.to_thread.run_sync(
                    insert, str(ev.conversation_id), str(ev.message_id), limiter=limiter
                ):
                    await send.send(ev)
    wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    conn.close()
    assert done == len(events)
    return Result("floor (decode + sqlite dedup + channel hop)", len(events), wall, cpu)


async def run_dshim(
    events: list[bytes], tmp: Path, *, turns: bool, now: float, conversations: int
) -> Result:
    config = parse_config(
        {"bots": [{"name": "bench", "channel": "telegram", "lanes": {"max_queue": len(events)}}]},
        env={},
        channel_settings=False,
    )
    bot = config.bots[0]
    out = RecordingOutbound(clock=time.time)
    handled = 0
    async with open_store(tmp / ("turns" if turns else "gates")) as store:
        async with open_bot_runtime(
            config=config,
            bot=bot,
            bot_id="1",
            store=store,
            outbound=out,
            harness=EchoHarness(),
            clock=lambda: now,
        ) as rt:
            if not turns:

                async def nothing(item: Any, lane: Any) -> None:
                    nonlocal handled
                    handled += 1
                    rt._done()

                rt.lanes._handler = nothing
            w0, c0 = time.perf_counter(), time.process_time()
            for raw in events:
                item = normalized.decode_event(raw, channel="telegram", bot_id="1")
                verdict = await rt.accept(item, raw)
                assert verdict.accepted, verdict
            await rt.wait_idle()
            wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    if turns:
        assert len(out.sent) == len(events), len(out.sent)
        return Result("dshim steps 1-7 (echo harness)", len(events), wall, cpu)
    assert handled == len(events)
    return Result("dshim steps 1-6 (no harness)", len(events), wall, cpu)


async def main(args: argparse.Namespace) -> None:
    configure_logging("error", "json")
    now = time.time()
    gate_events = make_events(args.events, args.conversations, now)
    turn_events = make_events(args.turn_events, args.conversations, now)
    with tempfile.TemporaryDirectory(prefix="dshim-bench-") as d:
        tmp = Path(d)
        floor = await run_floor(gate_events, tmp)
        gates = await run_dshim(
            gate_events, tmp, turns=False, now=now, conversations=args.conversations
        )
        turns = await run_dshim(
            turn_events, tmp, turns=True, now=now, conversations=args.conversations
        )
    print(
        f"python {sys.version.split()[0]}, trio {trio.__version__}, msgspec {msgspec.__version__}"
    )
    print(f"{'run':48} {'events':>7} {'events/s':>10} {'CPU ms/event':>13} {'CPU vs floor':>13}")
    for r in (floor, gates, turns):
        ratio = r.cpu_ms / floor.cpu_ms
        print(f"{r.name:48} {r.events:7d} {r.rate:10.0f} {r.cpu_ms:13.3f} {ratio:12.2f}x")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--turn-events", type=int, default=5000)
    parser.add_argument("--conversations", type=int, default=100)
    trio.run(main, parser.parse_args())
