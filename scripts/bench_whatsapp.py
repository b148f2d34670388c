#!/usr/bin/env python3
"""WhatsApp inbound throughput: signed webhook POSTs through verification, mapping and
pipeline steps 1-6.

Usage: python scripts/bench_whatsapp.py [--posts 5000] [--repeat 3] [--concurrency 8]

A stream of N webhook bodies exactly as Meta sends them (0.4-2.5 KB; mostly one text
message, some with two messages and a status, some images with captions, some quotes,
some statuses only) is generated deterministically and signed with the app secret, then
measured four ways in one run, on one machine:

1. ``floor``    -- the named floor: HMAC-SHA256 check + ``json.loads`` + dict access for
                   the same fields (no validation, no bounded depth, no mapping rules);
2. ``floor + dedup`` -- the floor plus, per message, one SQLite ``INSERT OR IGNORE`` of the
                   dedup key (sender, message id) and the message's raw JSON on a worker
                   thread, WAL, synchronous=NORMAL (``benchkit.FloorDedup``): the least a
                   durable receiver adds;
3. ``mapping``  -- dshim's real edge: ``protocol.signature_ok`` + ``split_body`` +
                   ``decode_event`` per message (msgspec views);
4. ``pipeline`` -- the channel's real webhook handler (``Webhook.handle``: signature,
                   split, one job for the bot's reader) and reader (``BotRuntime.accept`` =
                   steps 1-6 with dedup and the durable inbox in SQLite in its worker
                   thread, the message index written), called in-process, with the turn
                   itself (step 7) replaced by a no-op;
5. ``http``     -- the same through dshim's real HTTP endpoint (hypercorn), the POSTs sent
                   by a sender in its own process (``--concurrency`` connections), next to
                   ``http floor``: the same sender against a mount that answers 200 at once.

Figures: POSTs/s (wall; for ``http`` the sender's own timing of its POSTs) and CPU ms per
POST (this process's CPU, all threads; the sender's CPU is not counted), median of
``--repeat`` runs, with the ratio to the floor (``pipeline``: to the floor + dedup;
``http`` rows: to the ``http floor``).
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchkit import Figures, counting_runtime, open_floor_dedup, print_stream_line  # noqa: E402

from dshim.channels.base import HttpRequest, HttpResponse  # noqa: E402
from dshim.channels.whatsapp import channel, protocol  # noqa: E402
from dshim.channels.whatsapp.client import GraphClient  # noqa: E402
from dshim.channels.whatsapp.protocol import BotIdentity  # noqa: E402
from dshim.channels.whatsapp.render import WhatsAppOutbound  # noqa: E402
from dshim.config import Secret  # noqa: E402
from dshim.http.app import Endpoint  # noqa: E402
from dshim.http.server import serve_endpoint  # noqa: E402
from dshim.log import configure_logging  # noqa: E402
from dshim.store import open_store  # noqa: E402
from dshim.store.base import BoundStore  # noqa: E402

SECRET = b"bench-app-secret-0123456789"
PNID = "106540352242922"
DISPLAY = "15550783881"
ME = BotIdentity(PNID, DISPLAY, "Bench")
T0 = 1_796_032_800
LOREM = (
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud "
    "exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat. 🧪 "
)


def sign(body: bytes) -> str:
    return "sha256=" + hmac.new(SECRET, body, hashlib.sha256).hexdigest()


def make_stream(n: int, seed: int = 7) -> list[bytes]:
    """N webhook bodies as Meta POSTs them."""
    rng = random.Random(seed)
    out: list[bytes] = []
    for i in range(n):
        users = []
        messages: list[dict[str, Any]] = []
        statuses: list[dict[str, Any]] = []
        kind = rng.random()
        count = 2 if 0.6 <= kind < 0.7 else (0 if kind >= 0.95 else 1)
        for j in range(count):
            phone = str(16505550000 + rng.randrange(500))
            user: dict[str, Any] = {"profile": {"name": rng.choice(["Ada", "Bob", "Chen"])}}
            user["wa_id"] = phone
            if rng.random() < 0.5:
                user["user_id"] = f"US.{13491208655302741918 + int(phone)}"
            users.append(user)
            msg: dict[str, Any] = {"from": phone}
            if "user_id" in user:
                msg["from_user_id"] = user["user_id"]
            msg["id"] = f"wamid.HBgL{i:010d}{j}FQIAEhgUM0FBQUFBQUFB"
            msg["timestamp"] = str(T0 + i // 50)
            text = (LOREM * rng.randint(1, 6))[: rng.randint(100, 1500)]
            if kind < 0.8:
                msg["type"] = "text"
                msg["text"] = {"body": text}
                if kind < 0.15:
                    msg["context"] = {"from": DISPLAY, "id": f"wamid.OURS{i:08d}"}
            else:
                msg["type"] = "image"
                msg["image"] = {
                    "caption": text[:300],
                    "mime_type": "image/jpeg",
                    "sha256": "Hq9Ux1gIR2K1T8rU1yPpFJg2kNs9rE3kQJ1n2q0vB7c=",
                    "id": str(1_000_000_000 + i),
                }
            messages.append(msg)
        if count != 1:
            statuses.append(
                {
                    "id": f"wamid.OURS{i:08d}",
                    "status": rng.choice(["sent", "delivered", "read"]),
                    "timestamp": str(T0 + i // 50),
                    "recipient_id": str(16505550000 + rng.randrange(500)),
                }
            )
        value: dict[str, Any] = {
            "messaging_product": "whatsapp",
            "metadata": {"display_phone_number": DISPLAY, "phone_number_id": PNID},
        }
        if messages:
            value["contacts"] = users
            value["messages"] = messages
        if statuses:
            value["statuses"] = statuses
        body = {
            "object": "whatsapp_business_account",
            "entry": [
                {"id": "102290129340398", "changes": [{"value": value, "field": "messages"}]}
            ],
        }
        out.append(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode())
    return out


def floor_map(raw: bytes, header: str) -> list[dict[str, Any]]:
    """The floor: HMAC check, json.loads and dict access for the same fields."""
    expected = hmac.new(SECRET, raw, hashlib.sha256).hexdigest()
    if not hmac.compare_digest(expected, header[7:]):
        raise ValueError("signature")
    out = []
    for entry in json.loads(raw)["entry"]:
        for change in entry["changes"]:
            value = change["value"]
            contacts = value.get("contacts") or [{}]
            for msg in value.get("messages", []):
                body = msg.get("text", {}).get("body") or msg.get("image", {}).get("caption")
                out.append(
                    {
                        "message_id": msg["id"],
                        "sender": msg.get("from_user_id") or msg.get("from"),
                        "name": contacts[0].get("profile", {}).get("name"),
                        "content": body,
                        "quoted": (msg.get("context") or {}).get("id"),
                        "received_at": float(msg["timestamp"]),
                    }
                )
    return out


async def bench_floor_dedup(posts: list[tuple[bytes, str]], db: Path) -> tuple[float, float]:
    """The floor plus one durable insert per message (key + the message's raw JSON)."""
    with open_floor_dedup(db) as dedup:
        assert dedup is not None
        c0, t0 = time.process_time(), time.perf_counter()
        for raw, header in posts:
            for m in floor_map(raw, header):
                await dedup.insert(m["sender"], m["message_id"], json.dumps(m).encode())
        c1, t1 = time.process_time(), time.perf_counter()
    return len(posts) / (t1 - t0), (c1 - c0) * 1000 / len(posts)


def edge_map(raw: bytes, header: str) -> list[Any]:
    if not protocol.signature_ok(SECRET, raw, header):
        raise ValueError("signature")
    return [
        protocol.decode_event(p.raw, ME).item
        for p in protocol.split_body(raw)
        if p.kind == "message"
    ]


def bench_sync(
    fn: Callable[[bytes, str], Any], posts: list[tuple[bytes, str]]
) -> tuple[float, float]:
    c0, t0 = time.process_time(), time.perf_counter()
    for raw, header in posts:
        fn(raw, header)
    c1, t1 = time.process_time(), time.perf_counter()
    return len(posts) / (t1 - t0), (c1 - c0) * 1000 / len(posts)


async def _with_webhook(fn: Callable[[channel.Webhook, Any], Any]) -> tuple[Any, dict[str, int]]:
    """Run ``fn(webhook, runtime)`` with the real handler and reader, step 7 a no-op."""
    settings = channel.WhatsAppSettings(
        phone_number_id=PNID,
        access_token=Secret("EAAG-bench-not-a-token"),
        app_secret=Secret(SECRET.decode()),
        verify_token=Secret("bench"),
        api_base="http://127.0.0.1:9",
    )
    with tempfile.TemporaryDirectory(prefix="dshim-bench-") as tmp:
        async with (
            open_store(Path(tmp)) as store,
            httpx.AsyncClient(base_url="http://127.0.0.1:9") as http,
        ):
            client = GraphClient(http, "EAAG-bench-not-a-token", PNID)
            outbound = WhatsAppOutbound(client, clock=time.time)
            async with counting_runtime(
                "whatsapp", PNID, store, clock=lambda: float(T0 + 60), max_queue=100_000
            ) as (rt, verdicts):
                hook = channel.Webhook(
                    me=ME,
                    settings=settings,
                    client=client,
                    outbound=outbound,
                    store=BoundStore(store, rt.bot.name),
                    clock=lambda: float(T0 + 60),
                    bot=rt.bot.name,
                )
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(hook.read, rt)
                    result = await fn(hook, rt)
                    await rt.wait_idle()
                    nursery.cancel_scope.cancel()
    return result, verdicts


async def bench_pipeline(posts: list[tuple[bytes, str]]) -> tuple[float, float, dict[str, int]]:
    async def run(hook: channel.Webhook, rt: Any) -> tuple[float, float]:
        c0, t0 = time.process_time(), time.perf_counter()
        for raw, header in posts:
            request = HttpRequest("POST", "/", "", (("x-hub-signature-256", header),), raw)
            response = await hook.handle(request)
            assert response.status == 200, response
        c1, t1 = time.process_time(), time.perf_counter()
        return len(posts) / (t1 - t0), (c1 - c0) * 1000 / len(posts)

    (rate, cpu), verdicts = await _with_webhook(run)
    return rate, cpu, verdicts


async def _ok(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, b"ok", "text/plain")


async def bench_http(
    posts_file: Path, count: int, concurrency: int, *, floor: bool
) -> tuple[float, float]:
    """POSTs/s and this process's CPU ms per POST, the sender in its own process."""

    async def run(hook: channel.Webhook | None, rt: Any) -> tuple[float, float]:
        endpoint = Endpoint(token="bench-endpoint-token")
        endpoint.mount("bench", "", _ok if hook is None else hook.handle, public=True)
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                partial(serve_endpoint, endpoint, "127.0.0.1:0", shutdown=stop)
            )
            url = f"{binds[0]}/hooks/bench"
            cmd = [
                sys.executable,
                __file__,
                "--sender",
                url,
                "--posts-file",
                str(posts_file),
                "--concurrency",
                str(concurrency),
            ]
            c0 = time.process_time()
            done = await trio.run_process(cmd, capture_stdout=True)
            c1 = time.process_time()
            stop.set()
        report = json.loads(done.stdout)
        assert report["statuses"] == {"200": count}, report
        return count / report["elapsed"], (c1 - c0) * 1000 / count

    if floor:
        return await run(None, None)
    result, _ = await _with_webhook(run)
    rate, cpu = result
    return rate, cpu


async def sender(url: str, posts: list[tuple[bytes, str]], concurrency: int) -> None:
    """The fake's side: POST every signed body, ``concurrency`` at a time; print the
    statuses and the seconds the POSTs took (the process's start-up not included)."""
    statuses: dict[str, int] = {}
    queue = list(reversed(posts))
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60.0, trust_env=False) as http:

        async def worker() -> None:
            while queue:
                raw, header = queue.pop()
                resp = await http.post(
                    url,
                    content=raw,
                    headers={"x-hub-signature-256": header, "content-type": "application/json"},
                )
                statuses[str(resp.status_code)] = statuses.get(str(resp.status_code), 0) + 1

        t0 = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(worker)
        elapsed = time.perf_counter() - t0
    print(json.dumps({"statuses": statuses, "elapsed": elapsed}))


DEDUP = "floor + durable dedup (one SQLite INSERT/message)"


def median(values: list[float]) -> float:
    return statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--posts", type=int, default=5_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--sender", help=argparse.SUPPRESS)
    parser.add_argument("--posts-file", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sender:
        data = json.loads(Path(args.posts_file).read_text())
        trio.run(sender, args.sender, [(bytes.fromhex(b), h) for b, h in data], args.concurrency)
        return
    configure_logging("warning", "console")
    raws = make_stream(args.posts)
    posts = [(raw, sign(raw)) for raw in raws]
    sizes = [len(r) for r in raws]
    print_stream_line("bench_whatsapp", "signed webhook POSTs", sizes)
    results = Figures()
    verdicts: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix="dshim-bench-posts-") as tmp:
        posts_file = Path(tmp) / "posts.json"
        posts_file.write_text(json.dumps([(raw.hex(), header) for raw, header in posts]))
        for rep in range(args.repeat):
            results.add("floor: hmac + json.loads + dict access", *bench_sync(floor_map, posts))
            results.add(
                DEDUP,
                *trio.run(bench_floor_dedup, posts, Path(tmp) / f"floor-{rep}.sqlite3"),
            )
            results.add("mapping: signature + split + decode", *bench_sync(edge_map, posts))
            rate, cpu, verdicts = trio.run(bench_pipeline, posts)
            results.add("pipeline: handler + reader + steps 1-6", rate, cpu)
            results.add(
                "http floor: endpoint, 200 at once",
                *trio.run(
                    partial(bench_http, posts_file, len(posts), args.concurrency, floor=True)
                ),
            )
            results.add(
                "http: endpoint + pipeline steps 1-6",
                *trio.run(
                    partial(bench_http, posts_file, len(posts), args.concurrency, floor=False)
                ),
            )
    floor_cpu = median(results["floor: hmac + json.loads + dict access"][1])
    dedup_cpu = median(results[DEDUP][1])
    http_floor_cpu = median(results["http floor: endpoint, 200 at once"][1])
    print(
        f"{'path':50} {'POSTs/s':>10} {'CPU ms/POST':>12} {'(min-max)':>15} {'vs floor (CPU)':>15}"
    )
    for name, (rates, cpus) in results.items():
        base = (
            http_floor_cpu
            if name.startswith("http")
            else dedup_cpu
            if name.startswith("pipeline")
            else floor_cpu
        )
        spread = f"{min(cpus):.4f}-{max(cpus):.4f}"
        print(
            f"{name:50} {median(rates):10,.0f} {median(cpus):12.4f} {spread:>15} "
            f"{median(cpus) / base:14.2f}x"
        )
    print(
        "# the pipeline against floor + dedup, http rows against the http floor, the rest "
        f"against the floor; pipeline verdicts: {dict(sorted(verdicts.items()))}"
    )


if __name__ == "__main__":
    main()
