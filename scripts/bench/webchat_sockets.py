#!/usr/bin/env python3
"""B10: many websocket clients on one ``dshim serve`` web chat (the echo harness).

Usage::

    python scripts/bench/webchat_sockets.py                  # 1,000 and 100 clients, 3 reps
    python scripts/bench/webchat_sockets.py --quick          # 1 repetition, 5 s of load
    python scripts/bench/webchat_sockets.py --clients 1000 --small 100 --rate 200 --seconds 10

Per repetition a fresh ``dshim serve`` (no ``dshim.toml``: the built-in web chat with the
echo harness, ``--listen 127.0.0.1:0``, its own data directory; no ``[http] token`` is
needed on loopback) runs in its own process, and the clients in theirs (``--procs``
processes of this script in ``client`` mode, trio + trio-websocket, driven over their
stdin/stdout).  Each client is one websocket that joins its own direct conversation (as
a page does: ``join``, then the ``history`` frame), from one of several loopback source
addresses (127.0.0.2 ...: the web chat admits at most 64 sockets per client address).

1. **RSS per idle socket**: after a warm-up (one socket that sends a few messages, then
   closes), the dshim process's ``VmRSS`` with 0 sockets, with ``--small`` joined idle
   sockets and with ``--clients`` (each figure after the sockets connected, joined and
   got their history, and a settle pause).  The slopes are KB per socket (0 -> N and
   small -> N).
2. **Latency**: ``--rate`` messages/s in all, spread round-robin over the connected
   clients, for ``--seconds``; per message the time from the client's ``send`` to the
   bot's final ``message`` frame (the streamed answer complete) in that client, p50 and
   p99; first with ``--clients`` sockets, then with ``--small`` (the others closed).

Medians and spread (min-max) over ``--reps``; ``nproc`` and versions printed.  The
clients' own cost is in the latency (they share the machine): compare within one run.
RLIMIT_NOFILE's soft limit is raised to the hard limit in every process this script
starts (a descriptor per socket); the figure it had is printed.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform as py_platform
import re
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
CLK_TCK = os.sysconf("SC_CLK_TCK")
#: Sockets per loopback source address (the web chat's per-address cap is 64).
PER_ADDRESS = 50
TEXT = "hello from a benchmark client, message {n}: a short line like a person types"
#: How dshim is started (``DSHIM_B10_SCRIPT``: a wrapper script, for profiling).
DSHIM = [os.environ["DSHIM_B10_SCRIPT"]] if os.environ.get("DSHIM_B10_SCRIPT") else ["-m", "dshim"]
SERIAL = re.compile(r"message (\d+):")
READY = re.compile(r"open (http://127\.0\.0\.1:(\d+))/")


def raise_nofile() -> tuple[int, int]:
    """The soft descriptor limit up to the hard one; returns what it was."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, hard


# --- the client process -------------------------------------------------------------------


async def client_main(port: int, index_base: int, procs: int) -> None:
    """Commands on stdin (one JSON line each), one JSON answer line per command."""
    import trio
    import trio_websocket

    class Client:
        def __init__(self, n: int, ws: trio_websocket.WebSocketConnection) -> None:
            self.n = n
            self.ws = ws
            self.conversation = f"bench-{n}"
            #: Serial -> when it was sent (the echo answer names the serial: TEXT).
            self.sent: dict[int, float] = {}
            self.serial = 0

    clients: dict[int, Client] = {}
    latencies: list[float] = []
    lost = [0]
    failed = [0]

    async def reader(c: Client, joined: trio.Event) -> None:
        try:
            while True:
                frame = json.loads(await c.ws.get_message())
                kind = frame.get("type")
                if kind == "history":
                    joined.set()
                elif kind == "message" and frame["author"]["bot"] and frame["final"]:
                    got = SERIAL.search(frame["text"])
                    at = c.sent.pop(int(got.group(1)), None) if got else None
                    if at is not None:
                        latencies.append(trio.current_time() - at)
        except trio_websocket.ConnectionClosed:
            lost[0] += len(c.sent)
            c.sent.clear()

    async def connect(nursery: trio.Nursery, n: int, name: str = "u") -> None:
        await nursery.start(hold, n, name)

    async def hold(n: int, name: str, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        """One client, in a nursery of its own: its library's failure (trio-websocket
        can fail answering a ping while it closes) ends only this client."""
        started = False
        try:
            async with trio.open_nursery() as own:
                sock = trio.socket.socket()
                await sock.bind((f"127.0.0.{2 + n // PER_ADDRESS}", 0))
                await sock.connect(("127.0.0.1", port))
                stream = trio.SocketStream(sock)
                ws = await trio_websocket.wrap_client_stream(own, stream, "127.0.0.1", "/ws")
                c = Client(n, ws)
                c.conversation = f"{name}-{n}"
                user = {"id": f"{name}-{n}", "name": f"Bench {n}"}
                join = {"type": "join", "conversation": c.conversation, "kind": "direct"}
                joined = trio.Event()
                own.start_soon(reader, c, joined)
                await ws.send_message(json.dumps({**join, "user": user}))
                await joined.wait()
                clients[n] = c
                started = True
                task_status.started()
        except Exception:  # noqa: BLE001 (a benchmark client: counted, not raised)
            clients.pop(n, None)
            failed[0] += 1
            if not started:
                task_status.started()

    async def send(c: Client) -> None:
        c.serial += 1
        frame = {
            "type": "send",
            "client_id": f"k{c.serial}",  # a fresh dshim per repetition: unique
            "conversation": c.conversation,
            "text": TEXT.format(n=c.serial),
            "reply_to": None,
            "files": [],
        }
        c.sent[c.serial] = trio.current_time()
        await c.ws.send_message(json.dumps(frame))

    async def load(rate: float, seconds: float, among: dict[int, Client]) -> dict[str, Any]:
        latencies.clear()
        lost[0] = 0
        order = [among[n] for n in sorted(among)]
        count = int(rate * seconds) if order else 0
        start = trio.current_time()
        async with trio.open_nursery() as senders:
            for i in range(count):
                await trio.sleep_until(start + i / rate)
                senders.start_soon(send, order[i % len(order)])
        with trio.move_on_after(10):
            while len(latencies) + lost[0] < count:  # noqa: ASYNC110 (polls a count)
                await trio.sleep(0.01)
        late = trio.current_time() - start - seconds
        return {"latencies": list(latencies), "sent": count, "lost": lost[0], "late_s": late}

    async def warmup() -> dict[str, Any]:
        async with trio.open_nursery() as nursery:
            await connect(nursery, index_base, "warm")
            c = clients.pop(index_base)
            await load(20, 0.5, {c.n: c})
            with contextlib.suppress(Exception):
                await c.ws.aclose()
            nursery.cancel_scope.cancel()
        return {"ok": True}

    stdin = trio.lowlevel.FdStream(os.dup(0))
    out = sys.stdout
    buffer = b""
    async with trio.open_nursery() as nursery:
        while True:
            while b"\n" not in buffer:
                chunk = await stdin.receive_some()
                if not chunk:
                    nursery.cancel_scope.cancel()
                    return
                buffer += chunk
            line, _, buffer = buffer.partition(b"\n")
            cmd = json.loads(line)
            op = cmd["op"]
            answer: dict[str, Any]
            if op == "warmup":
                answer = await warmup()
            elif op == "connect":  # up to this many sockets of this process
                want = [
                    index_base + procs * k
                    for k in range(cmd["count"])
                    if index_base + procs * k not in clients
                ]
                t0 = time.monotonic()
                for lo in range(0, len(want), 50):  # 50 handshakes at a time
                    async with trio.open_nursery() as batch:
                        for n in want[lo : lo + 50]:
                            batch.start_soon(connect, nursery, n)
                answer = {
                    "sockets": len(clients),
                    "connect_s": time.monotonic() - t0,
                    "failed": failed[0],
                }
            elif op == "close":  # down to this many sockets
                for n in sorted(clients)[cmd["count"] :]:
                    with contextlib.suppress(Exception):
                        await clients.pop(n).ws.aclose()
                answer = {"sockets": len(clients)}
            elif op == "load":
                answer = await load(cmd["rate"], cmd["seconds"], clients)
            else:
                nursery.cancel_scope.cancel()
                return
            out.write(json.dumps(answer) + "\n")
            out.flush()


# --- the driver -----------------------------------------------------------------------------


class ClientProcs:
    """``procs`` client processes, each with its share of the sockets and of the rate."""

    def __init__(self, port: int, procs: int) -> None:
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, "client", str(port), str(i), str(procs)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                preexec_fn=raise_nofile,
            )
            for i in range(procs)
        ]

    def ask(self, cmds: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for proc, cmd in zip(self.procs, cmds, strict=True):
            assert proc.stdin is not None
            proc.stdin.write(json.dumps(cmd) + "\n")
            proc.stdin.flush()
        out = []
        for proc in self.procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if not line:
                raise RuntimeError(f"a client process ended (exit {proc.wait()})")
            out.append(json.loads(line))
        return out

    def all(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        return self.ask([cmd] * len(self.procs))

    def sockets(self, op: str, total: int) -> list[dict[str, Any]]:
        n = len(self.procs)
        return self.ask([{"op": op, "count": total // n + (i < total % n)} for i in range(n)])

    def load(self, rate: float, seconds: float) -> dict[str, Any]:
        n = len(self.procs)
        got = self.all({"op": "load", "rate": rate / n, "seconds": seconds})
        return {
            "latencies": [x for g in got for x in g["latencies"]],
            "sent": sum(g["sent"] for g in got),
            "lost": sum(g["lost"] for g in got),
            "late_s": max(g["late_s"] for g in got),
        }

    def stop(self) -> None:
        for proc in self.procs:
            assert proc.stdin is not None
            try:
                proc.stdin.write('{"op":"quit"}\n')
                proc.stdin.close()
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


def start_dshim(
    workdir: Path, log: IO[bytes], profile: str | None = None
) -> tuple[subprocess.Popen[bytes], int]:
    env = {**os.environ, "DSHIM_DATA_DIR": str(workdir / "data")}
    env.pop("DSHIM_CONFIG", None)
    prof = ["-m", "cProfile", "-o", profile] if profile else []
    proc = subprocess.Popen(
        [sys.executable, *prof, *DSHIM, "serve", "--listen", "127.0.0.1:0"],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log,
        preexec_fn=raise_nofile,
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline().decode()
        if not line:
            break
        got = READY.search(line)
        if got:
            return proc, int(got.group(2))
    proc.kill()
    raise RuntimeError("dshim serve did not print its URL")


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def cpu_s(pid: int, which: tuple[int, ...] = (11, 12)) -> float:
    """utime + stime (or one of them) of ``pid`` (all its threads), seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return sum(int(fields[i]) for i in which) / CLK_TCK


def settled_rss_kb(pid: int, settle_s: float) -> int:
    time.sleep(settle_s)
    if os.environ.get("DSHIM_B10_SNAPSHOT"):  # the wrapper script writes a snapshot
        os.kill(pid, signal.SIGUSR1)
        time.sleep(settle_s)
    return rss_kb(pid)


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def once(args: argparse.Namespace, rep: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="b10-") as tmp:
        work = Path(tmp)
        logs = ROOT / ".bench" / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        with open(logs / f"b10-dshim-{rep + 1}.log", "wb") as log:
            proc, port = start_dshim(work, log, args.profile)
            clients = ClientProcs(port, args.procs)
            try:
                clients.all({"op": "warmup"})
                out: dict[str, float] = {"rss0": settled_rss_kb(proc.pid, args.settle)}
                got = clients.sockets("connect", args.small)
                out[f"rss{args.small}"] = settled_rss_kb(proc.pid, args.settle)
                got = clients.sockets("connect", args.clients)
                out["connect_s"] = max(g["connect_s"] for g in got)
                out[f"rss{args.clients}"] = settled_rss_kb(proc.pid, args.settle)
                for count in (args.clients, args.small):
                    clients.sockets("close", count)
                    cpu0, sys0 = cpu_s(proc.pid), cpu_s(proc.pid, (12,))
                    res = clients.load(args.rate, args.seconds)
                    sent = max(1, res["sent"])
                    out[f"cpu_{count}"] = (cpu_s(proc.pid) - cpu0) * 1000 / sent
                    out[f"sys_{count}"] = (cpu_s(proc.pid, (12,)) - sys0) * 1000 / sent
                    lat = res["latencies"]
                    out[f"p50_{count}"] = pct(lat, 0.50) * 1000
                    out[f"p99_{count}"] = pct(lat, 0.99) * 1000
                    out[f"max_{count}"] = max(lat, default=float("nan")) * 1000
                    out[f"missing_{count}"] = res["sent"] - len(lat)
                    out[f"late_{count}"] = res["late_s"]
                out["rss_after"] = rss_kb(proc.pid)
            finally:
                clients.stop()
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        out["slope_all"] = (out[f"rss{args.clients}"] - out["rss0"]) / args.clients
        out["slope_small"] = (out[f"rss{args.clients}"] - out[f"rss{args.small}"]) / (
            args.clients - args.small
        )
        print(f"  rep {rep + 1}: " + ", ".join(f"{k} {v:.3g}" for k, v in out.items()), flush=True)
        return out


def fmt(values: list[float], digits: int = 1) -> str:
    """Median (min–max) of the repetitions that have the figure."""
    got = [v for v in values if v == v]  # not NaN (nothing answered)
    if not got:
        return "–"
    lo, mid, hi = min(got), statistics.median(got), max(got)
    note = "" if len(got) == len(values) else f", {len(got)} of {len(values)} reps"
    return f"{mid:.{digits}f} ({lo:.{digits}f}–{hi:.{digits}f}{note})"


def versions() -> str:
    names = ["dshim", "trio", "trio-websocket", "hypercorn", "wsproto", "msgspec"]
    return ", ".join(f"{n} {importlib.metadata.version(n)}" for n in names)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=1000)
    p.add_argument("--small", type=int, default=100, help="the smaller count (the slope)")
    p.add_argument("--rate", type=float, default=200.0, help="messages/s in all")
    p.add_argument("--seconds", type=float, default=None, help="load per count (10; quick 5)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--procs", type=int, default=2, help="client processes")
    p.add_argument("--settle", type=float, default=2.0, help="pause before an RSS reading")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--profile", help="run dshim under cProfile, writing this file (one rep)")
    args = p.parse_args(argv)
    if args.seconds is None:
        args.seconds = 5.0 if args.quick else 10.0
    reps = 1 if args.quick else args.reps
    soft, hard = raise_nofile()
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True)
    print(
        f"# B10 web chat sockets — {time.strftime('%Y-%m-%d %H:%M')}, {head.stdout.decode().strip()}"
    )
    print(f"nproc {os.cpu_count()}, Python {py_platform.python_version()}, {versions()}")
    print(f"RLIMIT_NOFILE soft {soft} (raised to {hard} in the bench's processes)")
    print(f"load average before: {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print(
        f"{args.clients} and {args.small} clients in {args.procs} processes, "
        f"{args.rate:g} messages/s for {args.seconds:g} s, {reps} repetitions (median, min–max)"
    )
    runs = [once(args, rep) for rep in range(reps)]

    def col(key: str) -> list[float]:
        return [r[key] for r in runs]

    big, small = args.clients, args.small
    print()
    print("| figure | value |")
    print("|---|---|")
    print(f"| RSS, 0 sockets (MB) | {fmt([v / 1024 for v in col('rss0')])} |")
    print(f"| RSS, {small} idle sockets (MB) | {fmt([v / 1024 for v in col(f'rss{small}')])} |")
    print(f"| RSS, {big} idle sockets (MB) | {fmt([v / 1024 for v in col(f'rss{big}')])} |")
    print(f"| KB per idle socket, 0 -> {big} | {fmt(col('slope_all'))} |")
    print(f"| KB per idle socket, {small} -> {big} | {fmt(col('slope_small'))} |")
    print(f"| connecting {big} sockets (s, all handshakes + join) | {fmt(col('connect_s'), 2)} |")
    for count in (big, small):
        print(f"| {count} clients, send -> final answer p50 (ms) | {fmt(col(f'p50_{count}'))} |")
        print(f"| {count} clients, send -> final answer p99 (ms) | {fmt(col(f'p99_{count}'))} |")
        print(f"| {count} clients, max (ms) | {fmt(col(f'max_{count}'))} |")
        print(f"| {count} clients, unanswered | {fmt(col(f'missing_{count}'), 0)} |")
        print(f"| {count} clients, dshim CPU ms per message | {fmt(col(f'cpu_{count}'), 2)} |")
        print(f"| {count} clients, of it system (kernel) | {fmt(col(f'sys_{count}'), 2)} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        import trio

        raise_nofile()
        trio.run(client_main, int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
    else:
        main()
