"""Slack Socket Mode throughput: envelopes/s and CPU per envelope, side by side with a floor.

    python scripts/bench_slack.py [--envelopes 5000] [--repeat 3]

The fake Slack (``dshim.testing.fakes.slack``) runs in its own process and, after every
``hello``, floods ``--envelopes`` ``events_api`` envelopes (a ~700-byte direct message
each) as fast as it can.  In this process, one after the other:

- floor          the least a Socket Mode client must do, written plainly: trio-websocket
                 (same 64 KiB receive buffer), ``json.loads`` of every frame, the ack
                 frame sent, a dict lookup mapping of the message fields;
- dshim reader   dshim's Socket Mode runner (``SocketRunner``: bounded-depth msgspec
                 envelope, ack at once, watchdog, in-order delivery) and the mapping of
                 the envelope to ``InboundMessage``;
- floor+dedup    the floor plus one SQLite ``INSERT OR IGNORE`` (dedup key + raw frame)
                 per envelope on a worker thread, WAL, synchronous=NORMAL;
- dshim 1-6      dshim's reader and mapping plus pipeline steps 1-6
                 (``BotRuntime.accept``: gates, persisted dedup + durable inbox on SQLite,
                 access, commands, lanes) with the lane handler doing nothing;
- slack-sdk      ``slack_sdk.socket_mode.SocketModeClient`` (the SDK's built-in
                 websocket client) acknowledging every envelope from its listener, when
                 slack-sdk is importable (a benchmark-only dependency).

CPU is this process's time (all its threads; the fake's CPU is not counted), from the
hello to the last envelope handled; each run is repeated and the median printed with the
spread, plus the ratio to the floor.  Compare within one run only.
"""

from __future__ import annotations

import argparse
import functools
import json
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import trio
import trio_websocket

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchkit import Run, measure_four, print_four_runs, steps_1_to_6  # noqa: E402

from dshim.channels.kit.http import open_http  # noqa: E402
from dshim.channels.slack.client import USER_AGENT, WS_OPTIONS, SocketRunner, WebClient  # noqa: E402
from dshim.channels.slack.protocol import BotIdentity, EventMapper, Incoming  # noqa: E402
from dshim.log import configure_logging  # noqa: E402
from dshim.model import InboundMessage  # noqa: E402


class Meter:
    """Wall and CPU from the hello to the n-th handled envelope (thread-safe ticks)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.count = 0
        self.w0 = self.c0 = 0.0
        self.wall = self.cpu = 0.0
        self.finished = threading.Event()
        self._lock = threading.Lock()

    def start(self) -> None:
        if not self.w0:
            self.w0, self.c0 = time.perf_counter(), time.process_time()

    def tick(self) -> bool:
        with self._lock:
            self.count += 1
            if self.count == self.n:
                self.wall = time.perf_counter() - self.w0
                self.cpu = time.process_time() - self.c0
                self.finished.set()
                return True
        return False


async def socket_url(env: dict[str, Any]) -> str:
    async with httpx.AsyncClient() as http:
        resp = await http.post(
            env["api_base"] + "/apps.connections.open",
            headers={"Authorization": f"Bearer {env['app_token']}"},
        )
        return str(resp.json()["url"])


# -- floor ----------------------------------------------------------------------------------


async def floor(env: dict[str, Any], n: int, db: Path | None = None) -> tuple[float, float]:
    meter = Meter(n)
    conn: sqlite3.Connection | None = None
    limiter = trio.CapacityLimiter(1)
    if db is not None:
        conn = sqlite3.connect(db, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("CREATE TABLE dedup (conv TEXT, mid TEXT, raw BLOB, PRIMARY KEY (conv, mid))")

    def insert(conv: str, mid: str, raw: str | bytes) -> int:
        assert conn is not None
        return conn.execute(
            "INSERT OR IGNORE INTO dedup VALUES (?, ?, ?)", (conv, mid, raw)
        ).rowcount

    url = await socket_url(env)
    mapped: list[dict[str, Any]] = []
    async with trio_websocket.open_websocket_url(
        url,
        message_queue_size=WS_OPTIONS.message_queue_size,
        max_message_size=WS_OPTIONS.max_message_size,
        receive_buffer_size=WS_OPTIONS.receive_buffer_size,
    ) as ws:
        while not meter.finished.is_set():
            data = await ws.get_message()
            frame = json.loads(data)
            if frame.get("type") == "hello":
                meter.start()
                continue
            if frame.get("type") != "events_api":
                continue
            await ws.send_message(json.dumps({"envelope_id": frame["envelope_id"]}))
            ev = frame["payload"]["event"]
            mapped.append(
                {
                    "id": ev["ts"],
                    "conversation": ev["channel"],
                    "direct": ev.get("channel_type") == "im",
                    "sender": ev.get("user"),
                    "bot": "bot_id" in ev,
                    "content": ev.get("text", ""),
                    "thread": ev.get("thread_ts"),
                }
            )
            if conn is not None:
                await trio.to_thread.run_sync(
                    insert, ev["channel"], ev["ts"], data, limiter=limiter
                )
            mapped.clear()
            meter.tick()
    if conn is not None:
        conn.close()
    return meter.wall, meter.cpu


# -- dshim ----------------------------------------------------------------------------------


async def dshim_socket(
    env: dict[str, Any], n: int, handle: Callable[[Incoming, EventMapper], Awaitable[None]]
) -> tuple[float, float]:
    meter = Meter(n)
    async with open_http(user_agent=USER_AGENT) as http:
        web = WebClient(
            http, bot_token=env["bot_token"], app_token=env["app_token"], api_base=env["api_base"]
        )
        mapper = EventMapper(BotIdentity(user_id=env["bot_user"]))
        done = trio.Event()

        async def deliver(incoming: Incoming) -> None:
            await handle(incoming, mapper)
            if meter.tick():
                done.set()

        runner = SocketRunner(web, deliver, on_connected=lambda _: meter.start())
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runner.run)
            await done.wait()
            nursery.cancel_scope.cancel()
    return meter.wall, meter.cpu


async def reader_only(env: dict[str, Any], n: int) -> tuple[float, float]:
    async def handle(incoming: Incoming, mapper: EventMapper) -> None:
        item = mapper.map_envelope(incoming.envelope)
        assert isinstance(item, InboundMessage), item

    return await dshim_socket(env, n, handle)


async def pipeline(env: dict[str, Any], n: int, tmp: Path) -> tuple[float, float]:
    async with steps_1_to_6("slack", env["bot_user"], n, tmp) as rt:

        async def handle(incoming: Incoming, mapper: EventMapper) -> None:
            verdict = await rt.accept(mapper.map_envelope(incoming.envelope), incoming.raw)
            assert verdict.accepted, verdict

        return await dshim_socket(env, n, handle)


# -- slack-sdk ------------------------------------------------------------------------------


def slack_sdk_run(env: dict[str, Any], n: int) -> tuple[float, float] | None:
    """The SDK's built-in SocketModeClient, acknowledging from its listener."""
    try:
        from slack_sdk.socket_mode import SocketModeClient
        from slack_sdk.socket_mode.request import SocketModeRequest
        from slack_sdk.socket_mode.response import SocketModeResponse
        from slack_sdk.web import WebClient as SdkWebClient
    except ImportError:
        return None
    meter = Meter(n)
    web = SdkWebClient(token=env["bot_token"], base_url=env["api_base"] + "/")
    client = SocketModeClient(
        app_token=env["app_token"], web_client=web, auto_reconnect_enabled=False
    )

    def listener(c: SocketModeClient, req: SocketModeRequest) -> None:
        c.send_socket_mode_response(SocketModeResponse(envelope_id=req.envelope_id))
        if req.type == "events_api":
            ev = req.payload["event"]
            mapped = {"id": ev["ts"], "conversation": ev["channel"], "content": ev.get("text")}
            assert mapped["id"]
            meter.tick()

    client.socket_mode_request_listeners.append(listener)
    # From before connect(): the SDK queues frames and runs listeners on a thread pool,
    # so its own view of the hello can come after envelopes were read.  This charges it
    # apps.connections.open and the handshake (a few ms) that the other runs do not pay.
    meter.start()
    client.connect()
    try:
        if not meter.finished.wait(timeout=300):
            return None
    finally:
        client.close()
    return meter.wall, meter.cpu


async def measure(args: argparse.Namespace, env: dict[str, Any]) -> list[Run]:
    configure_logging("error", "json")
    return await measure_four(
        args.envelopes,
        args.repeat,
        names=[
            "floor (trio-websocket + json.loads + ack + dict mapping)",
            "dshim Socket Mode reader + mapping",
            "floor + durable dedup (one SQLite INSERT/envelope)",
            "dshim reader + mapping + pipeline steps 1-6",
        ],
        floor=functools.partial(floor, env),
        reader=functools.partial(reader_only, env),
        pipeline=functools.partial(pipeline, env),
    )


def main(args: argparse.Namespace) -> None:
    fake = [sys.executable, "-m", "dshim.testing.fakes.slack"]
    fake += ["--flood", str(args.envelopes), "--lifetime", "900"]
    proc = subprocess.Popen(fake, stdout=subprocess.PIPE, text=True)
    sdk: Run | None = None
    try:
        assert proc.stdout is not None
        env = json.loads(proc.stdout.readline())
        runs = trio.run(measure, args, env)
        sdk = Run("slack-sdk SocketModeClient (built-in client, ack in listener)", args.envelopes)
        for _ in range(args.repeat):
            got = slack_sdk_run(env, args.envelopes)
            if got is None:
                sdk = None
                break
            sdk.add(*got)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    n = args.envelopes
    print_four_runs(
        runs,
        unit="envelope",
        count=n,
        repeat=args.repeat,
        versions=f"httpx {httpx.__version__}",
        peers=[sdk] if sdk is not None else [],
    )
    if sdk is None:
        print("(slack-sdk not installed: pip install slack-sdk to compare with SocketModeClient)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--envelopes", type=int, default=5000)
    parser.add_argument("--repeat", type=int, default=3)
    main(parser.parse_args())
