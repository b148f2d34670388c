#!/usr/bin/env python3
"""Where B8's per-bot cost goes: ``dshim serve`` with N Telegram bots in this process,
against ``fake_telegram.py --bots N`` in its own, measured once every bot polls.

Usage::

    python scripts/bench/b8_profile.py --bots 1000 --memory [--top 30]   # tracemalloc
    python scripts/bench/b8_profile.py --bots 1000 --cpu                 # cProfile start-up
    python scripts/bench/b8_profile.py --bots 10000 --idle 60            # RSS, fds, CPU

``--memory`` prints the allocations alive once every bot polls, grouped by line (run it
at 100 and 1,000 bots: what grows by bot is the difference); ``--cpu`` profiles the start
(process start to the last bot's first poll) and prints the top functions by cumulative
time.  Fake tokens only; nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bots", type=int, default=1000)
    p.add_argument("--memory", action="store_true")
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--top", type=int, default=30)
    p.add_argument("--frames", type=int, default=1)
    p.add_argument("--idle", type=float, default=0.0, help="then CPU %% over this many s")
    args = p.parse_args()
    fake = subprocess.Popen(
        [sys.executable, str(BENCH / "fake_telegram.py"), "--bots", str(args.bots)]
        + ["--updates", "1", "--hold", "600", "--timeout", "900"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert fake.stdout is not None
    info = json.loads(fake.stdout.readline())
    tokens = info.get("tokens") or ["123456:TEST-token-for-dshim-tests-only"]
    work = Path(tempfile.mkdtemp(prefix="dshim-b8-"))
    lines = [
        f'[dshim]\ndata_dir = "{work / "data"}"\n[http]\nenabled = false\n[harness]\nkind = "echo"'
    ]
    for i, token in enumerate(tokens):
        lines.append(f'[[bots]]\nname = "t{i}"\nchannel = "telegram"\ntoken = "{token}"')
        lines.append(f'api_base = "{info["url"]}"')
    (work / "dshim.toml").write_text("\n".join(lines) + "\n")
    started = time.perf_counter()
    prof = cProfile.Profile() if args.cpu else None
    if args.memory:
        tracemalloc.start(args.frames)

    def watch() -> None:
        assert fake.stdout is not None
        line = json.loads(fake.stdout.readline())
        print(f"all polling after {(line['all_polling'] - started) * 1000:.0f} ms", flush=True)
        mine = os.times()
        with open(f"/proc/{fake.pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        theirs = (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
        print(f"CPU s by then: dshim {mine.user + mine.system:.2f}, the fake {theirs:.2f}")
        if prof is not None:
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(args.top)
            pstats.Stats(prof).sort_stats("tottime").print_stats(args.top)
        time.sleep(2.0)
        if args.memory:
            snap = tracemalloc.take_snapshot()
            stats = snap.statistics("lineno" if args.frames == 1 else "traceback")
            total = sum(s.size for s in stats)
            if args.frames > 1:  # each allocation to the innermost dshim line that made it
                mine: dict[str, list[int]] = {}
                for s in stats:
                    where = next(
                        (
                            f"{f.filename.rsplit('/dshim/', 1)[-1]}:{f.lineno}"
                            for f in reversed(s.traceback)
                            if "/dshim/" in f.filename and "/.venv/" not in f.filename
                        ),
                        "(outside dshim)",
                    )
                    acc = mine.setdefault(where, [0, 0])
                    acc[0] += s.size
                    acc[1] += s.count
                print("by dshim line:")
                for where, (size, count) in sorted(mine.items(), key=lambda kv: -kv[1][0])[
                    : args.top
                ]:
                    print(f"{size / 1024:9.1f} KB {count:7d}  {where}")
                stats = []
            print(f"traced {total / 1e6:.1f} MB, {total / args.bots / 1024:.1f} KB per bot")
            for s in stats[: args.top]:
                print(f"{s.size / 1024:9.1f} KB {s.count:7d}  {s.traceback}")
                if args.frames > 1:
                    for line in s.traceback.format()[-args.frames * 2 :]:
                        print("        " + line)
        with open(f"/proc/{os.getpid()}/status") as f:
            print(next(x for x in f if x.startswith("VmRSS")).strip(), flush=True)
        print(f"descriptors {len(os.listdir(f'/proc/{os.getpid()}/fd'))}", flush=True)
        if args.idle:
            c0, t0 = sum(os.times()[:2]), time.monotonic()
            time.sleep(args.idle)
            c1, t1 = sum(os.times()[:2]), time.monotonic()
            print(f"idle CPU {(c1 - c0) * 100 / (t1 - t0):.2f} % over {t1 - t0:.0f} s", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()
    from dshim import launch

    g = launch.Globals(work / "dshim.toml", None, os.environ.get("B8_LOG", "warning"), "json")
    if prof is not None:
        prof.enable()
    try:
        launch.serve(g, [], None)
    finally:
        fake.terminate()


if __name__ == "__main__":
    main()
