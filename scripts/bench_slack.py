"""Slack Socket Mode throughput: envelopes/s and CPU per envelope, side by side with a floor.

    python scripts/bench_slack.py [--envelopes 5000] [--repeat 3]

The fake Slack (``dshim.testing.fakes.slack``) runs in its own process and, after every
``hello``, floods ``--envelopes`` ``events_api`` envelopes (a ~700-byte direct message
each) as fast as it can.  In this process, one after the other:

- floor          the least a Socket Mode client must do, written plainly: trio-websocket
                 (same 64 KiB receive buffer), ``json.loads`` of every frame, the ack
                 frame sent, a dict lookup mapping of the message fields;
- dshim reader   dshim's Socket Mode runner (``run_socket_mode``: bounded-depth msgspec
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
import json
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import benchkit as kit  # noqa: E402

from dshim.channels.slack.client import (  # noqa: E402
    USER_AGENT,
    WS_OPTIONS,
    WebClient,
    run_socket_mode,
)
from dshim.channels.slack.protocol import BotIdentity, EventMapper, Incoming  # noqa: E402
from dshim.net.http import open_http  # noqa: E402


async def socket_url(env: dict[str, Any]) -> str:
    async with httpx.AsyncClient() as http:
        resp = await http.post(
            env["api_base"] + "/apps.connections.open",
            headers={"Authorization": f"Bearer {env['app_token']}"},
        )
        return str(resp.json()["url"])


# -- floor ----------------------------------------------------------------------------------


async def floor(env: dict[str, Any], n: int, db: Path | None = None) -> tuple[float, float]:
    meter = kit.Meter(n)
    with kit.open_floor_dedup(db) as dedup:
        url = await socket_url(env)
        mapped: list[dict[str, Any]] = []
        async with kit.open_floor_websocket(url, WS_OPTIONS) as ws:
            while not meter.done.is_set():
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
                if dedup is not None:
                    await dedup.insert(ev["channel"], ev["ts"], data)
                mapped.clear()
                meter.tick()
    return meter.wall, meter.cpu


# -- dshim ----------------------------------------------------------------------------------


async def dshim_socket(
    env: dict[str, Any], n: int, handle: Callable[[Incoming, EventMapper], Awaitable[None]]
) -> tuple[float, float]:
    meter = kit.Meter(n)
    async with open_http(user_agent=USER_AGENT) as http:
        web = WebClient(
            http, bot_token=env["bot_token"], app_token=env["app_token"], api_base=env["api_base"]
        )
        mapper = EventMapper(BotIdentity(user_id=env["bot_user"]))

        async def deliver(batch: list[Incoming]) -> None:
            for incoming in batch:
                await handle(incoming, mapper)
                meter.tick()

        return await kit.until_counted(
            meter, lambda: run_socket_mode(web, deliver, on_connected=lambda _: meter.start())
        )


reader_only, pipeline = kit.reader_and_pipeline(
    dshim_socket,
    channel="slack",
    bot_id=lambda env: env["bot_user"],
    decode=lambda incoming, mapper: mapper.map_envelope(incoming.envelope),
    raw=lambda incoming: incoming.raw,
)


# -- slack-sdk ------------------------------------------------------------------------------


class SdkMeter:
    """Wall and CPU from the hello to the n-th handled envelope, ticked from the SDK's
    listener threads (so under a lock, and ``finished`` is a threading.Event)."""

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

    def tick(self) -> None:
        with self._lock:
            self.count += 1
            if self.count == self.n:
                self.wall = time.perf_counter() - self.w0
                self.cpu = time.process_time() - self.c0
                self.finished.set()


def slack_sdk_run(env: dict[str, Any], n: int) -> tuple[float, float] | None:
    """The SDK's built-in SocketModeClient, acknowledging from its listener."""
    try:
        from slack_sdk.socket_mode import SocketModeClient
        from slack_sdk.socket_mode.request import SocketModeRequest
        from slack_sdk.socket_mode.response import SocketModeResponse
        from slack_sdk.web import WebClient as SdkWebClient
    except ImportError:
        return None
    meter = SdkMeter(n)
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


def main(args: argparse.Namespace) -> None:
    sdk: kit.Run | None = None
    with kit.open_fake("dshim.testing.fakes.slack", args.envelopes) as env:
        runs = kit.run_four(
            env,
            args.envelopes,
            args.repeat,
            unit="envelope",
            names=(
                "floor (trio-websocket + json.loads + ack + dict mapping)",
                "dshim Socket Mode reader + mapping",
            ),
            floor=floor,
            reader=reader_only,
            pipeline=pipeline,
        )
        sdk = kit.Run(
            "slack-sdk SocketModeClient (built-in client, ack in listener)", args.envelopes
        )
        for _ in range(args.repeat):
            got = slack_sdk_run(env, args.envelopes)
            if got is None:
                sdk = None
                break
            sdk.add(*got)
    kit.print_four_runs(
        runs,
        unit="envelope",
        versions=f"httpx {httpx.__version__}",
        peers=[sdk] if sdk is not None else [],
    )
    if sdk is None:
        print("(slack-sdk not installed: pip install slack-sdk to compare with SocketModeClient)")


if __name__ == "__main__":
    main(kit.argument_parser(__doc__, "--envelopes").parse_args())
