#!/usr/bin/env python3
"""The side-by-side benchmark suite: dshim next to python-telegram-bot, aiogram, nonebot2,
hikari and slack-sdk against dshim's own fakes, each candidate and fake in its own process.

Usage::

    python scripts/bench/run.py                 # every scenario, 3 repetitions
    python scripts/bench/run.py --quick         # 1 repetition, smaller counts
    python scripts/bench/run.py --only B1,B2 --candidates dshim,ptb
    python scripts/bench/run.py --only B1 --candidates dshim,dshim@../before  # a lever's
                                            # before/after: another checkout (git worktree)

The peers are installed by the suite itself into their own venvs under ``.bench/venvs``
(benchmark-only dependencies, never dshim's): python-telegram-bot 22.x, aiogram 3,
nonebot2 + nonebot-adapter-telegram with the aiohttp driver, hikari 2, slack-sdk 3.
``--no-install`` uses what is there.  The fakes are dshim's own, each in its own process
(``fake_telegram.py``, ``fake_discord.py``, ``fake_slack.py`` count the replies through
``ledger.py``; ``fake_idle.py`` runs any of the nine for the idle scenario).  ``floor``
is the harness floor (``peers/floor_echo.py``: trio + httpx + msgspec, only to calibrate).

Scenarios:

* **B1 saturated**: 4,000 text updates (~2.1 KB each) available at once, over 200 chats and
  over 1 chat; events/s from release to the last reply, CPU ms per event (the candidate's
  utime+stime from ``/proc`` between release and the last reply, after an idle hold),
  peak RSS (``VmHWM``), duplicates, per-chat order.
* **B1 capture**: B1 saturated over 200 chats for ``dshim`` and ``dshim+capture``
  (``serve --capture`` into the run's directory) side by side: events/s, CPU ms per event
  and the MB captured (``dshim+capture`` is also a ``--candidates`` name).
* **B1 PostgreSQL**: B1 saturated over 200 chats for ``dshim`` on its SQLite store and
  ``dshim+pg`` on a PostgreSQL store (a throwaway cluster on 127.0.0.1) side by side:
  events/s and CPU ms per event, the server's CPU (postmaster and backends) counted.
* **instances**: the same burst over 12 Telegram bots served by 1, 2 and 3 dshim
  instances sharing one PostgreSQL store by lease: aggregate events/s and CPU per event
  (dshim's processes and the server).
* **B1 paced**: 50 / 200 / 500 updates/s over 200 chats; p50/p99 latency from an update's
  availability to its reply, with ``floor`` always in the same run (the p99 gap to it).
* **B2 head-of-line**: a 2 s agent; 20 chats send one message each and one of them 3 more;
  the time until every chat had an answer (ideal ~2 s) and per-chat order; uniform 2 s
  and varied 1-3 s latencies.
* **B3 Discord**: MESSAGE_CREATEs over 200 DMs through the fake gateway (zlib-stream when
  asked) -> REST replies, dshim vs hikari: events/s, CPU ms/event, p50/p99.
* **B4 Slack Socket Mode**: a burst of envelopes, dshim vs slack-sdk's SocketModeClient:
  ack latency p99, replies/s.
* **idle**: startup (process start to the last bot's first poll / READY / hello), RSS and
  CPU after 10 s idle; dshim with 1 bot and with 9 bots of nine channels.
* **B7 soak**: 100,000 events through B1, RSS every 10,000; monotonic growth is a failure.
* **B8 many bots**: 1, 100 and 1,000 Telegram bots (distinct tokens, one fake Bot API
  process, ``fake_telegram.py --bots N``): start to the last bot's first poll, RSS, open
  descriptors and CPU over 10 s idle (the long polls held), the slope (KB per bot), then
  4,000 updates spread over the bots: events/s next to one bot's (B1) in the same run;
  ``--b8-max 10000`` adds one run of that many bots.
* **B9 big store** (``big_store.py``, its own process): a synthetic store of 10,000
  conversations, 1M index and transcript rows, 5M dedup keys; quote recovery by id and by
  time, the history scan, dedup accept and a turn's store work beside a fresh store, the
  slope per 10x store, and B1 on the big store beside a fresh one.
* **B9-retention** (``big_store.py --soak``): 1,000,000 events' store work on a simulated
  clock (200,000 with ``--quick``); store file size, row counts and RSS every 100,000.
* **B10 web chat sockets** (``--only B10``, not in the default set): 1,000 and 100 websocket
  clients on one ``dshim serve`` web chat, 200 messages/s in all; RSS per idle socket and
  send -> streamed answer complete p50/p99 (``webchat_sockets.py``, its own processes).

Every run is bounded in count and time; three repetitions give the median and the spread
(min-max); ratios dshim/peer come from the same run.  Versions and ``nproc`` are printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform as py_platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(__file__).resolve().parent
VENVS = ROOT / ".bench" / "venvs"
LOGS = ROOT / ".bench" / "logs"
TOKEN = "123456:TEST-token-for-the-fake-only"
CLK_TCK = os.sysconf("SC_CLK_TCK")

PEERS: dict[str, tuple[str, list[str], str]] = {
    # name: (venv, pip specs, script)
    "ptb": ("ptb", ["python-telegram-bot~=22.0"], "ptb_echo.py"),
    "aiogram": ("aiogram", ["aiogram~=3.0"], "aiogram_echo.py"),
    "nonebot": (
        "nonebot",
        ["nonebot2[aiohttp]~=2.4", "nonebot-adapter-telegram"],
        "nonebot_echo.py",
    ),
    "hikari": ("hikari", ["hikari~=2.0"], "hikari_echo.py"),
    "slack-sdk": ("slack", ["slack-sdk~=3.0"], "slack_sdk_echo.py"),
}
#: The platform each peer speaks (dshim and the floor: see :func:`candidates`).
PLATFORM_OF = {"hikari": "discord", "slack-sdk": "slack"}
#: Each platform's benchmark fake (a script of this folder, ``fake_<platform>.py``, run in
#: its own process; ``fake_idle.py`` serves any platform, for the idle scenario only).
FAKES = {
    path.stem.removeprefix("fake_"): path.name
    for path in sorted(BENCH.glob("fake_*.py"))
    if path.name != "fake_idle.py"
}


@dataclass(frozen=True)
class Candidate:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    version: str = ""
    platform: str = "telegram"  # "any" for dshim
    #: dshim with ``serve --capture`` into the run's directory (``dshim+capture``).
    capture: bool = False
    #: Other processes whose CPU the candidate's events cost (``dshim+pg``: the
    #: PostgreSQL server's backends): called for their utime+stime in seconds.
    extra_cpu: Callable[[], float] | None = None
    #: More environment for each run, made fresh per run (``dshim+pg``: a new schema, so
    #: a repetition's updates are not the previous one's duplicates).
    env_per_run: Callable[[], dict[str, str]] | None = None

    def speaks(self, platform: str) -> bool:
        return self.platform in ("any", platform)


def venv_python(venv: str) -> Path:
    return VENVS / venv / "bin" / "python"


def ensure_peers(names: set[str], install: bool) -> dict[str, str]:
    """Create the peers' venvs (when missing) and return their versions."""
    versions: dict[str, str] = {}
    for venv, specs, _ in [PEERS[n] for n in sorted(names) if n in PEERS]:
        py = venv_python(venv)
        if not py.exists():
            if not install:
                raise SystemExit(
                    f"{venv}: no venv at {py.parent.parent} (run without --no-install)"
                )
            print(f"installing {' '.join(specs)} into .bench/venvs/{venv} ...", flush=True)
            subprocess.run([sys.executable, "-m", "venv", str(py.parent.parent)], check=True)
            subprocess.run(
                [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", *specs],
                check=True,
            )
        dist = specs[0].split("[")[0].split("~")[0].split("=")[0]
        out = subprocess.run(
            [str(py), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
            capture_output=True,
            text=True,
        )
        versions[venv] = f"{dist} {out.stdout.strip() or '?'}"
    return versions


def dshim_version() -> str:
    sys.path.insert(0, str(ROOT))
    import dshim

    return f"dshim {dshim.__version__}"


def compile_bytecode(tree: Path) -> None:
    """Write a checkout's bytecode before measuring it, as an installed copy has: with
    ``PYTHONDONTWRITEBYTECODE`` set (or a read-only tree), every start would compile the
    modules changed since the last write again — ~20 ms that is not dshim's start-up."""
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(tree / "dshim")],
        check=True,
        stdout=subprocess.DEVNULL,
    )


def candidates(selected: list[str], versions: dict[str, str], workdir: Path) -> list[Candidate]:
    out: list[Candidate] = []
    for name in selected:
        if name.startswith("dshim"):
            tree = ROOT if name in ("dshim", "dshim+capture") else Path(name.split("@", 1)[1])
            compile_bytecode(tree.resolve())
        if name in ("dshim", "dshim+capture"):
            out.append(
                Candidate(
                    name,
                    [sys.executable, "-m", "dshim", "--config", "{config}", "serve"],
                    version=dshim_version(),
                    platform="any",
                    capture=name == "dshim+capture",
                )
            )
        elif name.startswith("dshim@"):  # another checkout of dshim: before/after a change
            tree = Path(name.split("@", 1)[1]).resolve()
            out.append(
                Candidate(
                    name,
                    [sys.executable, "-m", "dshim", "--config", "{config}", "serve"],
                    {"PYTHONPATH": str(tree)},
                    version=f"dshim from {tree}",
                    platform="any",
                )
            )
        elif name == "floor":
            out.append(
                Candidate(
                    "floor",
                    [sys.executable, str(BENCH / "peers" / "floor_echo.py")],
                    version="reference loop (trio + httpx + msgspec)",
                )
            )
        elif name in ("ptb", "ptb-c8"):
            env = {"BENCH_CONCURRENT": "8"} if name == "ptb-c8" else {}
            out.append(
                Candidate(
                    name,
                    [str(venv_python("ptb")), str(BENCH / "peers" / "ptb_echo.py")],
                    env,
                    versions.get("ptb", ""),
                )
            )
        elif name in PEERS:
            venv, _, script = PEERS[name]
            out.append(
                Candidate(
                    name,
                    [str(venv_python(venv)), str(BENCH / "peers" / script)],
                    version=versions.get(venv, ""),
                    platform=PLATFORM_OF.get(name, "telegram"),
                )
            )
        else:
            raise SystemExit(f"unknown candidate {name!r}")
    return out


def bot_lines(platform: str, name: str, info: dict[str, Any]) -> list[str]:
    """One ``[[bots]]`` table pointed at a fake (its printed settings; fake tokens only)."""
    lines = ["", "[[bots]]", f'name = "{name}"', f'channel = "{platform}"']
    if "settings" in info:  # fake_idle.py's
        lines += [f"{k} = {json.dumps(v)}" for k, v in info["settings"].items()]
    elif platform == "telegram":
        lines += [f'token = "{info["token"]}"', f'api_base = "{info["url"]}"']
    elif platform == "discord":
        lines += [f'token = "{info["token"]}"', f'api_base = "{info["api_base"]}"']
    elif platform == "slack":
        lines += [
            f'bot_token = "{info["bot_token"]}"',
            f'app_token = "{info["app_token"]}"',
            f'api_base = "{info["api_base"]}"',
            "stream = false  # one chat.postMessage per answer, as the SDK peer does",
        ]
    else:
        raise ValueError(platform)
    return lines


def dshim_config(workdir: Path, bots: list[tuple[str, dict[str, Any]]]) -> Path:
    """A dshim.toml with one bot per ``(platform, fake info)`` (echo harness, no HTTP
    endpoint unless a fake asks for one, e.g. WhatsApp's webhook)."""
    http = next((info["http"] for _, info in bots if "http" in info), None)
    lines = [
        "[dshim]",
        f'data_dir = "{workdir / "data"}"',
        "",
        "[http]",
        f'enabled = true\nlisten = "{http}"' if http else "enabled = false",
        "",
        "[harness]",
        'kind = "echo"',
    ]
    for i, (platform, info) in enumerate(bots):
        lines += bot_lines(platform, f"{platform}{i}", info)
    path = workdir / "dshim.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def peer_env(platform: str, info: dict[str, Any]) -> dict[str, str]:
    """How a peer finds its fake: ``BENCH_API``, ``BENCH_TOKEN`` (, ``BENCH_APP_TOKEN``)."""
    if "settings" in info:  # fake_idle.py's: the same keys as dshim's
        info = {**info["settings"], "url": info["settings"].get("api_base")}
    if platform == "telegram":
        return {"BENCH_API": info["url"], "BENCH_TOKEN": info["token"]}
    if platform == "discord":
        return {"BENCH_API": info["api_base"], "BENCH_TOKEN": info["token"]}
    return {
        "BENCH_API": info["api_base"],
        "BENCH_TOKEN": info["bot_token"],
        "BENCH_APP_TOKEN": info["app_token"],
    }


# -- processes -----------------------------------------------------------------------------


def cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_mb(pid: int, key: str = "VmHWM") -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def read_line(stream: IO[str], deadline: float) -> dict[str, Any]:
    """The next JSON line from the fake (it bounds its own run; this only guards hangs)."""
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError("the fake said nothing in time")
        line = stream.readline()
        if not line:
            raise RuntimeError(f"the fake exited early (its stderr: {LOGS}/fake-*.err)")
        line = line.strip()
        if line.startswith("{"):
            obj: dict[str, Any] = json.loads(line)
            if "error" in obj:
                raise RuntimeError(f"the fake: {obj['error']}")
            return obj


def start_fake(args: list[str], platform: str = "telegram") -> tuple[subprocess.Popen[str], Any]:
    """Start a platform's benchmark fake; its first line is its settings (``info``)."""
    extra = ["--token", TOKEN] if platform == "telegram" else []
    LOGS.mkdir(parents=True, exist_ok=True)
    with open(LOGS / f"fake-{platform}.err", "w", encoding="utf-8") as err:  # the last one
        fake = subprocess.Popen(
            [sys.executable, str(BENCH / FAKES[platform]), *extra, *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    assert fake.stdout is not None
    info = read_line(fake.stdout, time.monotonic() + 30)
    if platform == "telegram":
        info["token"] = TOKEN
    return fake, info


def start_candidate(
    cand: Candidate, workdir: Path, bots: list[tuple[str, dict[str, Any]]]
) -> subprocess.Popen[str]:
    """A candidate against its fake(s): dshim with one bot per fake, a peer with the
    first fake's settings in its environment."""
    fresh = cand.env_per_run() if cand.env_per_run is not None else {}
    env = {**os.environ, **cand.env, **fresh, **peer_env(*bots[0])}
    env.pop("DSHIM_HTTP_LISTEN", None)
    argv = [a.replace("{config}", str(dshim_config(workdir, bots))) for a in cand.argv]
    if cand.capture:
        argv += ["--capture", str(workdir / "capture")]
    return subprocess.Popen(
        argv,
        env=env,
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
    )


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def captured_mb(root: Path) -> float:
    """The size of what ``serve --capture`` wrote under ``root`` (fixtures only)."""
    return sum(p.stat().st_size for p in root.rglob("*.json")) / 1e6


def run_once(
    cand: Candidate, fake_args: list[str], timeout: float, platform: str = "telegram"
) -> dict[str, Any]:
    """One candidate against one fresh fake: the fake's figures plus CPU and RSS (and, for
    ``dshim+capture``, the MB captured, measured once it stopped: its last write is then)."""
    with tempfile.TemporaryDirectory(prefix="dshim-bench-") as tmp:
        workdir = Path(tmp)
        fake, info = start_fake([*fake_args, "--timeout", str(timeout)], platform)
        spawned = time.perf_counter()
        proc = start_candidate(cand, workdir, [(platform, info)])
        try:
            assert fake.stdout is not None
            limit = time.monotonic() + timeout + 60
            first = read_line(fake.stdout, limit)
            released = read_line(fake.stdout, limit)
            extra0 = cand.extra_cpu() if cand.extra_cpu is not None else 0.0
            cpu0 = cpu_s(proc.pid)
            done = read_line(fake.stdout, limit)["done"]
            cpu1 = cpu_s(proc.pid)
            extra1 = cand.extra_cpu() if cand.extra_cpu is not None else 0.0
            used = (cpu1 - cpu0) + (extra1 - extra0)
            done["cpu_ms_per_event"] = used * 1000 / max(1, done["replies"])
            done["peak_rss_mb"] = rss_mb(proc.pid)
            done["startup_ms"] = (first["first_poll"] - spawned) * 1000
            del released
        finally:
            stop(proc)
            stop(fake)
        if cand.capture:
            done["capture_mb"] = captured_mb(workdir / "capture")
        return done


# -- reporting -----------------------------------------------------------------------------


def med(values: list[float]) -> tuple[float, float, float]:
    clean = [v for v in values if v == v]  # NaN-free
    if not clean:
        return float("nan"), float("nan"), float("nan")
    return statistics.median(clean), min(clean), max(clean)


def fmt(values: list[float], digits: int = 0) -> str:
    m, lo, hi = med(values)
    if m != m:
        return "—"
    if len(values) == 1:
        return f"{m:,.{digits}f}"
    return f"{m:,.{digits}f} ({lo:,.{digits}f}–{hi:,.{digits}f})"


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    sys.stdout.flush()


def ratio_row(name: str, figures: dict[str, list[float]], key: str, higher_is_better: bool) -> str:
    mine = med(figures.get("dshim", [float("nan")]))[0]
    theirs = med(figures.get(name, [float("nan")]))[0]
    if name == "dshim" or mine != mine or theirs != theirs or theirs == 0:
        return "—"
    r = mine / theirs
    return f"{r:.2f}x"


# -- scenarios -----------------------------------------------------------------------------


def scenario_burst(
    title: str,
    cands: list[Candidate],
    reps: int,
    n: int,
    args: list[str],
    platform: str = "telegram",
    latency: bool = False,
) -> None:
    """``n`` events available at once (B1 saturated, B3, B4): events/s, CPU ms/event,
    peak RSS, duplicates, per-chat order, answered; with ``latency`` the p50/p99 from
    an event's availability to its reply (queueing included: a burst) and, where the
    fake measures acks (Slack), the ack p99."""
    cands = [c for c in cands if c.speaks(platform)]
    results: dict[str, list[dict[str, Any]]] = {c.name: [] for c in cands}
    for rep in range(reps):
        for cand in cands:  # interleaved: drift hits everyone alike
            r = run_once(cand, ["--updates", str(n), *args], 180, platform)
            results[cand.name].append(r)
            print(
                f"  {title} rep {rep + 1} {cand.name}: "
                f"{r['replies']}/{n} in {r['elapsed_s']:.2f} s",
                flush=True,
            )
    eps = {k: [r["replies"] / r["elapsed_s"] for r in v] for k, v in results.items()}
    cpu = {k: [r["cpu_ms_per_event"] for r in v] for k, v in results.items()}
    acks = any("ack_p99_ms" in r for v in results.values() for r in v)
    captures = any("capture_mb" in r for v in results.values() for r in v)
    rows = []
    for cand in cands:
        v = results[cand.name]
        lat = [fmt([r["p50_ms"] for r in v], 1), fmt([r["p99_ms"] for r in v], 1)]
        ack = [fmt([r.get("ack_p99_ms", float("nan")) for r in v], 1)]
        cap = [fmt([r.get("capture_mb", float("nan")) for r in v], 1)]
        rows.append(
            [
                cand.name,
                fmt(eps[cand.name]),
                fmt(cpu[cand.name], 2),
                *(lat if latency else []),
                *(ack if acks else []),
                *(cap if captures else []),
                fmt([r["peak_rss_mb"] for r in v]),
                str(sum(r["duplicates"] for r in v)),
                "yes" if all(r["in_order"] for r in v) else "NO",
                str(min(r["replies"] for r in v)) + f"/{n}",
                ratio_row(cand.name, eps, "eps", True),
                ratio_row(cand.name, cpu, "cpu", False),
            ]
        )
    table(
        title,
        [
            "candidate",
            "events/s",
            "CPU ms/event",
            *(["p50 ms", "p99 ms"] if latency else []),
            *(["ack p99 ms"] if acks else []),
            *(["capture MB"] if captures else []),
            "peak RSS MB",
            "dupes",
            "order",
            "answered",
            "dshim/peer events/s",
            "dshim/peer CPU",
        ],
        rows,
    )


def scenario_b1(cands: list[Candidate], reps: int, n: int, one_chat: bool) -> None:
    args = ["--chats", "1", "--one-chat"] if one_chat else ["--chats", "200"]
    chats = "1 chat" if one_chat else "200 chats"
    scenario_burst(f"B1 saturated echo, {n} updates, {chats}", cands, reps, n, args)


def scenario_b1_capture(reps: int, n: int) -> None:
    """B1 saturated (200 chats) for dshim with ``serve --capture`` off and on, side by side
    in the same run (whatever ``--candidates`` says): the capture's cost per event."""
    cands = candidates(["dshim", "dshim+capture"], {}, Path("."))
    scenario_burst(
        f"B1 saturated echo, capture off and on, {n} updates, 200 chats",
        cands,
        reps,
        n,
        ["--chats", "200"],
    )


def tree_cpu_s(root: int) -> float:
    """utime + stime of ``root`` and every process below it (a PostgreSQL server: the
    postmaster and its backends), in seconds; processes that ended are not counted."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text(encoding="ascii")
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    tree, frontier = {root}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, ppid in parents.items():
            if ppid == parent and pid not in tree:
                tree.add(pid)
                frontier.append(pid)
    total = 0.0
    for pid in tree:
        try:
            total += cpu_s(pid)
        except OSError:
            pass
    return total


def scenario_b1_pg(reps: int, n: int) -> None:
    """B1 saturated (200 chats) for dshim on its SQLite store and on a PostgreSQL store
    (a throwaway cluster on 127.0.0.1, ``tests/pgkit.py``), side by side in the same run;
    the PostgreSQL run's CPU includes the server's (postmaster and backends)."""
    sys.path.insert(0, str(ROOT))
    from tests.pgkit import start_cluster

    cluster = start_cluster()
    try:
        postmaster = int((cluster.data / "postmaster.pid").read_text().split()[0])
        [sqlite] = candidates(["dshim"], {}, Path("."))
        pg = dataclasses.replace(
            sqlite,
            name="dshim+pg",
            env_per_run=lambda: {"DSHIM_STORE_URL": cluster.fresh_url("bench")},
            version=f"{sqlite.version} on PostgreSQL (server CPU counted)",
            extra_cpu=lambda: tree_cpu_s(postmaster),
        )
        scenario_burst(
            f"B1 saturated echo, SQLite and PostgreSQL stores, {n} updates, 200 chats",
            [sqlite, pg],
            reps,
            n,
            ["--chats", "200"],
        )
    finally:
        cluster.stop()


def instances_once(
    cluster: Any, postmaster: int, instances: int, bots: int, n: int
) -> dict[str, float]:
    """``n`` updates over ``bots`` Telegram bots (a fake process each, 200 chats in all)
    served by ``instances`` dshim processes sharing one fresh PostgreSQL schema (the
    default 15 s leases: shorter ones risk cutting a bot on a saturated machine); each
    fake releases 25 s after its first poll, when the bots are balanced.  Aggregate
    events/s from the first release to the last reply; CPU of every dshim process and of
    the server."""
    with tempfile.TemporaryDirectory(prefix="dshim-bench-") as tmp:
        workdir = Path(tmp)
        per_bot = n // bots
        fakes = [
            start_fake(
                [
                    "--updates",
                    str(per_bot),
                    "--chats",
                    str(max(1, 200 // bots)),
                    "--hold",
                    "25",
                    "--timeout",
                    "180",
                ]
            )
            for _ in range(bots)
        ]
        config = dshim_config(workdir, [("telegram", info) for _, info in fakes])
        text = config.read_text(encoding="utf-8").replace(f'data_dir = "{workdir / "data"}"', "")
        config.write_text(text + "\n[store]\nlease_s = 15\n", encoding="utf-8")
        env = {**os.environ, "DSHIM_STORE_URL": cluster.fresh_url("inst")}
        env.pop("DSHIM_HTTP_LISTEN", None)
        procs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "dshim",
                    "--config",
                    str(config),
                    "--data-dir",
                    str(workdir / f"data-{i}"),
                    "serve",
                    "--instance",
                    f"i{i}",
                ],
                env=env,
                cwd=workdir,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            for i in range(instances)
        ]
        try:
            limit = time.monotonic() + 240
            released, ends, replies = [], [], 0
            for fake, _ in fakes:
                assert fake.stdout is not None
                read_line(fake.stdout, limit)  # first poll
            for fake, _ in fakes:
                assert fake.stdout is not None
                released.append(read_line(fake.stdout, limit)["released"])
            cpu0 = sum(cpu_s(p.pid) for p in procs) + tree_cpu_s(postmaster)
            for (fake, _), start in zip(fakes, released, strict=True):
                assert fake.stdout is not None
                done = read_line(fake.stdout, limit)["done"]
                replies += done["replies"]
                ends.append(start + done["elapsed_s"])
            cpu1 = sum(cpu_s(p.pid) for p in procs) + tree_cpu_s(postmaster)
        finally:
            for proc in procs:
                stop(proc)
            for fake, _ in fakes:
                stop(fake)
        span = max(ends) - min(released)
        return {
            "eps": replies / span if span > 0 else float("nan"),
            "cpu_ms": (cpu1 - cpu0) * 1000 / max(1, replies),
            "replies": replies,
        }


def scenario_instances(reps: int, n: int) -> None:
    """Aggregate events/s with 1, 2 and 3 dshim instances sharing 12 Telegram bots on one
    PostgreSQL store (a throwaway cluster on 127.0.0.1, the same cores)."""
    sys.path.insert(0, str(ROOT))
    from tests.pgkit import start_cluster

    cluster = start_cluster()
    try:
        postmaster = int((cluster.data / "postmaster.pid").read_text().split()[0])
        figures: dict[int, list[dict[str, float]]] = {1: [], 2: [], 3: []}
        for rep in range(reps):
            for k in figures:  # interleaved
                r = instances_once(cluster, postmaster, k, 12, n)
                figures[k].append(r)
                print(
                    f"  instances rep {rep + 1} x{k}: {r['replies']:.0f}/{n} at "
                    f"{r['eps']:.0f} events/s",
                    flush=True,
                )
        rows = [
            [
                str(k),
                fmt([r["eps"] for r in v]),
                fmt([r["cpu_ms"] for r in v], 2),
                f"{min(r['replies'] for r in v):.0f}/{n - n % 12}",
            ]
            for k, v in figures.items()
        ]
        table(
            f"Instances on one PostgreSQL store: {n} updates over 12 Telegram bots (200 chats)",
            ["instances", "aggregate events/s", "CPU ms/event (dshim + server)", "answered"],
            rows,
        )
    finally:
        cluster.stop()


def scenario_paced(cands: list[Candidate], reps: int, rates: list[int], seconds: float) -> None:
    """Paced B1; the harness floor (``floor``) always runs too, interleaved, so "p99
    within 2 ms of the floor measured in the same run" reads off the last column."""
    cands = [c for c in cands if c.speaks("telegram")]
    if not any(c.name == "floor" for c in cands):
        cands = [*cands, *candidates(["floor"], {}, Path("."))]
    rows = []
    for rate in rates:
        n = int(rate * seconds)
        p50: dict[str, list[float]] = {c.name: [] for c in cands}
        p99: dict[str, list[float]] = {c.name: [] for c in cands}
        for _ in range(reps):
            for cand in cands:  # interleaved: drift hits everyone alike
                r = run_once(cand, ["--updates", str(n), "--rate", str(rate)], timeout=seconds + 60)
                p50[cand.name].append(r["p50_ms"])
                p99[cand.name].append(r["p99_ms"])
        floor99 = med(p99["floor"])[0]
        for cand in cands:
            gap = med(p99[cand.name])[0] - floor99
            rows.append(
                [
                    f"{rate}/s",
                    cand.name,
                    fmt(p50[cand.name], 2),
                    fmt(p99[cand.name], 2),
                    "—" if cand.name == "floor" or gap != gap else f"{gap:+.2f}",
                ]
            )
            print(
                f"  paced {rate}/s {cand.name}: p50 {fmt(p50[cand.name], 2)} "
                f"p99 {fmt(p99[cand.name], 2)}",
                flush=True,
            )
    table(
        f"B1 paced, 200 chats, {seconds:.0f} s each (floor = the reference loop, same run)",
        ["rate", "candidate", "p50 ms", "p99 ms", "p99 − floor p99 ms"],
        rows,
    )


def scenario_soak(cands: list[Candidate], n: int, every: int, timeout: float) -> None:
    """B7: ``n`` events through B1 (at most 2,000 unanswered at a time), the candidate's
    RSS sampled every ``every`` replies; growth at every sample after the first counts
    as monotonic growth (a failure)."""
    rows = []
    for cand in cands:
        r = soak_once(cand, n, every, timeout)
        series = r["rss_mb"]
        steps = [b - a for a, b in zip(series[1:], series[2:], strict=False)]
        monotonic = bool(steps) and all(s > 0 for s in steps)
        rows.append(
            [
                cand.name,
                f"{r['replies']:,}/{n:,}",
                f"{r['replies'] / r['elapsed_s']:,.0f}" if r["elapsed_s"] else "—",
                " ".join(f"{v:.1f}" for v in series),
                f"{(series[-1] - series[0]):+.1f}" if len(series) > 1 else "—",
                "YES (failure)" if monotonic else "no",
                str(r["duplicates"]),
            ]
        )
        print(f"  soak {cand.name}: {r['replies']}/{n}, RSS {series}", flush=True)
    table(
        f"B7 soak: {n:,} events through B1 (200 chats), RSS every {every:,}",
        [
            "candidate",
            "answered",
            "events/s",
            f"RSS MB at each {every:,}",
            "last − first MB",
            "monotonic growth",
            "dupes",
        ],
        rows,
    )


def soak_once(cand: Candidate, n: int, every: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dshim-bench-") as tmp:
        workdir = Path(tmp)
        args = ["--updates", str(n), "--window", "2000", "--progress", str(every)]
        fake, info = start_fake([*args, "--hold", "1", "--timeout", str(timeout)])
        proc = start_candidate(cand, workdir, [("telegram", info)])
        try:
            assert fake.stdout is not None
            limit = time.monotonic() + timeout + 60
            series: list[float] = []
            while True:
                obj = read_line(fake.stdout, limit)
                if "progress" in obj:
                    series.append(rss_mb(proc.pid, "VmRSS"))
                elif "done" in obj:
                    done: dict[str, Any] = obj["done"]
                    done["rss_mb"] = series
                    return done
        finally:
            stop(proc)
            stop(fake)


def scenario_b2(cands: list[Candidate], reps: int) -> None:
    cands = [c for c in cands if c.speaks("telegram") and c.name != "floor"]
    rows = []
    for varied in (False, True):
        args = ["--updates", "23", "--chats", "20", "--layout", "b2", "--sleep", "2"]
        if varied:
            args.append("--varied")
        for cand in cands:
            t, order, all_chats = [], True, True
            for _ in range(reps):
                r = run_once(cand, args, timeout=120)
                t.append(r["chats_answered_s"] or float("nan"))
                order = order and r["in_order"]
                all_chats = all_chats and r["chats_answered"] == 20 and r["replies"] == 23
            rows.append(
                [
                    "1–3 s" if varied else "2 s",
                    cand.name,
                    fmt(t, 2),
                    "yes" if order else "NO",
                    "yes" if all_chats else "NO",
                ]
            )
            print(
                f"  B2 {'varied' if varied else 'uniform'} {cand.name}: {fmt(t, 2)} s", flush=True
            )
    table(
        "B2 head-of-line: 20 chats + 3 more in one, slow agent",
        ["agent latency", "candidate", "all 20 chats answered after s", "per-chat order", "23/23"],
        rows,
    )


def platform_channels() -> list[str]:
    """Every channel with a remote platform (all but the web chat): Telegram first, as in
    the one-bot setup (the first fake's settings go to the candidate's environment, see
    :func:`start_candidate`), then the others in registry order."""
    from dshim.channels.registry import SPECS

    remote = [entry.key for entry in SPECS if not entry.local]
    return sorted(remote, key=lambda key: key != "telegram")


def scenario_idle(cands: list[Candidate], reps: int, idle_s: float) -> None:
    """B6: process start to the first poll / READY / hello of every bot, then RSS and
    CPU over ``idle_s`` idle seconds; dshim with one Telegram bot and with one bot of every
    channel that has a platform (nine: each against its fake in its own process), each
    peer with one bot."""
    rows = []
    for cand in cands:
        if cand.name == "floor":
            continue
        every = platform_channels()
        setups = [["telegram"], every] if cand.platform == "any" else [[cand.platform]]
        for platforms in setups:
            rss, cpu, start = [], [], []
            slowest = ""
            for _ in range(reps):
                r = idle_once(cand, platforms, idle_s)
                rss.append(r["rss_mb"])
                cpu.append(r["cpu_pct"])
                start.append(r["startup_ms"])
                slowest = r["slowest"]
            bots = f"{len(platforms)} ({', '.join(platforms)})" if len(platforms) > 1 else "1"
            rows.append(
                [
                    cand.name,
                    bots if len(platforms) > 1 else f"1 ({platforms[0]})",
                    fmt(start),
                    slowest,
                    fmt(rss, 1),
                    fmt(cpu, 2),
                ]
            )
            print(f"  idle {cand.name} x{len(platforms)}: {fmt(rss, 1)} MB", flush=True)
    table(
        f"Idle and startup (after {idle_s:.0f} s idle)",
        [
            "candidate",
            "bots",
            "start to the last bot's first poll/READY ms",
            "last to be ready",
            "RSS MB",
            "CPU %",
        ],
        rows,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def idle_once(cand: Candidate, platforms: list[str], idle_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dshim-bench-") as tmp:
        workdir = Path(tmp)
        http = f"127.0.0.1:{free_port()}"
        fakes: list[subprocess.Popen[str]] = []
        bots: list[tuple[str, dict[str, Any]]] = []
        try:
            for i, platform in enumerate(platforms):
                argv = [sys.executable, str(BENCH / "fake_idle.py"), "--platform", platform]
                argv += ["--lifetime", str(idle_s + 120)]
                info: dict[str, Any] = {}
                if platform == "whatsapp":
                    argv += ["--webhook", f"http://{http}/hooks/{platform}{i}"]
                    info["http"] = http
                fake = subprocess.Popen(
                    argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
                )
                fakes.append(fake)
                assert fake.stdout is not None
                info.update(read_line(fake.stdout, time.monotonic() + 30))
                bots.append((platform, info))
            spawned = time.perf_counter()
            proc = start_candidate(cand, workdir, bots)
            try:
                firsts = []
                for fake in fakes:
                    assert fake.stdout is not None
                    firsts.append(read_line(fake.stdout, time.monotonic() + 60)["first_poll"])
                startup = (max(firsts) - spawned) * 1000
                time.sleep(2.0)
                c0, t0 = cpu_s(proc.pid), time.monotonic()
                time.sleep(idle_s)
                c1, t1 = cpu_s(proc.pid), time.monotonic()
                return {
                    "rss_mb": rss_mb(proc.pid, "VmRSS"),
                    "cpu_pct": (c1 - c0) * 100 / (t1 - t0),
                    "startup_ms": startup,
                    "slowest": platforms[firsts.index(max(firsts))],
                }
            finally:
                stop(proc)
        finally:
            for fake in fakes:
                stop(fake)


def b8_once(cand: Candidate, bots: int, n: int, idle_s: float) -> dict[str, Any]:
    """B8: ``bots`` Telegram bots against one fake process; start-up, idle RSS / CPU /
    descriptors during the fake's hold, then ``n`` updates over ``max(200, bots)`` chats."""
    chats = max(200, bots)
    hold = idle_s + 3.0
    timeout = 300.0
    with tempfile.TemporaryDirectory(prefix="dshim-bench-") as tmp:
        workdir = Path(tmp)
        args = ["--updates", str(n), "--chats", str(chats), "--hold", str(hold)]
        fake, info = start_fake([*args, "--bots", str(bots), "--timeout", str(timeout)])
        tokens = info.get("tokens") or [info["token"]]
        config = [("telegram", {"token": t, "url": info["url"]}) for t in tokens]
        spawned = time.perf_counter()
        proc = start_candidate(cand, workdir, config)
        try:
            assert fake.stdout is not None
            limit = time.monotonic() + timeout + 60
            line = read_line(fake.stdout, limit)
            start_cpu = cpu_s(proc.pid)  # read just after the last bot's first poll
            last_poll = line.get("all_polling", line.get("first_poll"))
            if "all_polling" in line:
                read_line(fake.stdout, limit)  # the ledger's first_poll
            time.sleep(2.0)
            c0, t0 = cpu_s(proc.pid), time.monotonic()
            time.sleep(idle_s)
            c1, t1 = cpu_s(proc.pid), time.monotonic()
            idle = {
                "rss_mb": rss_mb(proc.pid, "VmRSS"),
                "cpu_pct": (c1 - c0) * 100 / (t1 - t0),
                "fds": len(os.listdir(f"/proc/{proc.pid}/fd")),
                "startup_ms": (last_poll - spawned) * 1000,
                "start_cpu_s": start_cpu,
            }
            read_line(fake.stdout, limit)  # released
            c2 = cpu_s(proc.pid)
            done = read_line(fake.stdout, limit)["done"]
            done["cpu_ms_per_event"] = (cpu_s(proc.pid) - c2) * 1000 / max(1, done["replies"])
            done["peak_rss_mb"] = rss_mb(proc.pid)
            return {**done, **idle}
        finally:
            stop(proc)
            stop(fake)


def scenario_b8(cands: list[Candidate], reps: int, n: int, sizes: list[int], idle_s: float) -> None:
    """B8 many bots: per size, start to the last bot's first poll, idle RSS, CPU and
    descriptors, then ``n`` updates over the bots; the slope in KB per bot between the
    two largest sizes; events/s relative to one bot's in the same run."""
    for cand in [c for c in cands if c.platform == "any"]:
        rows, slope = [], []
        figures: dict[int, dict[str, list[float]]] = {}
        for size in sizes:
            f = figures.setdefault(size, {})
            for _ in range(reps):
                r = b8_once(cand, size, n, idle_s)
                for key in (
                    "startup_ms",
                    "start_cpu_s",
                    "rss_mb",
                    "cpu_pct",
                    "fds",
                    "events_per_s",
                ):
                    value = r["replies"] / r["elapsed_s"] if key == "events_per_s" else r[key]
                    f.setdefault(key, []).append(value)
                f.setdefault("lost", []).append(r["updates"] - r["replies"])
                f.setdefault("dupes", []).append(r["duplicates"])
                f.setdefault("order", []).append(1.0 if r["in_order"] else 0.0)
                f.setdefault("cpu_ms", []).append(r["cpu_ms_per_event"])
            print(f"  B8 {cand.name} x{size}: {fmt(f['rss_mb'], 1)} MB", flush=True)
        one = med(figures[sizes[0]]["events_per_s"])[0]
        for size in sizes:
            f = figures[size]
            rows.append(
                [
                    cand.name,
                    f"{size:,}",
                    fmt(f["startup_ms"]),
                    fmt(f["start_cpu_s"], 2),
                    fmt(f["rss_mb"], 1),
                    fmt(f["fds"]),
                    fmt(f["cpu_pct"], 2),
                    fmt(f["events_per_s"]),
                    f"{med(f['events_per_s'])[0] / one:.2f}x" if one else "—",
                    fmt(f["cpu_ms"], 2),
                    f"{max(f['lost']):.0f}",
                    f"{max(f['dupes']):.0f}",
                    "yes" if min(f["order"]) == 1.0 else "NO",
                ]
            )
        for a, b in zip(sizes, sizes[1:], strict=False):
            per_run = [
                (y - x) * 1024 / (b - a)
                for x, y in zip(figures[a]["rss_mb"], figures[b]["rss_mb"], strict=True)
            ]
            slope.append(f"{a:,} -> {b:,} bots: {fmt(per_run, 1)} KB per bot")
        table(
            f"B8 many Telegram bots, one fake Bot API, idle {idle_s:.0f} s, "
            f"then {n} updates spread over the bots",
            [
                "candidate",
                "bots",
                "start to the last bot's first poll ms",
                "dshim CPU s by then",
                "idle RSS MB",
                "descriptors",
                "idle CPU %",
                "events/s",
                "vs 1 bot",
                "CPU ms/event",
                "lost",
                "dupes",
                "order",
            ],
            rows,
        )
        print("\nSlope (idle RSS, per run then median): " + "; ".join(slope))


def scenario_big_store(argv: list[str]) -> None:
    """B9 and B9-retention: ``big_store.py`` in its own process (it prints its tables)."""
    print(f"\n## big_store.py {' '.join(argv)}\n", flush=True)
    done = subprocess.run([sys.executable, str(BENCH / "big_store.py"), *argv], check=False)
    if done.returncode:
        raise RuntimeError(f"big_store.py exited {done.returncode}")


def scenario_b10(reps: int, quick: bool) -> None:
    """B10: ``webchat_sockets.py`` in its own process (it starts dshim and the clients)."""
    cmd = [sys.executable, str(BENCH / "webchat_sockets.py"), "--reps", str(reps)]
    done = subprocess.run([*cmd, *(["--quick"] if quick else [])], check=False)
    if done.returncode != 0:
        raise RuntimeError(f"webchat_sockets.py exited with {done.returncode}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 repetition, smaller counts")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--updates", type=int, default=None, help="B1 updates (4,000; --quick 1,000)")
    p.add_argument("--only", default="B1,B1-1chat,B1-capture,paced,B2,B3,B4,idle,B7,B8")
    p.add_argument("--soak", type=int, default=None, help="B7 events (100,000; --quick 20,000)")
    p.add_argument(
        "--candidates", default="dshim,floor,ptb,ptb-c8,aiogram,nonebot,hikari,slack-sdk"
    )
    p.add_argument("--no-install", action="store_true")
    p.add_argument("--b8-max", type=int, default=1000, help="B8's largest bot count")
    p.add_argument("--b8-sizes", default="", help="B8's bot counts (default 1,100,1000)")
    args = p.parse_args(argv)
    reps = 1 if args.quick else args.reps
    n = args.updates or (1000 if args.quick else 4000)
    soak = args.soak or (20_000 if args.quick else 100_000)
    names = [c.strip() for c in args.candidates.split(",") if c.strip()]
    versions = ensure_peers(
        {"ptb" if c.startswith("ptb") else c for c in names}, not args.no_install
    )
    with tempfile.TemporaryDirectory() as tmp:
        cands = candidates(names, versions, Path(tmp))
    only = {s.strip() for s in args.only.split(",")}
    print(f"# dshim benchmark suite — {time.strftime('%Y-%m-%d %H:%M')}")
    print(f"nproc {os.cpu_count()}, Python {py_platform.python_version()}, {py_platform.machine()}")
    print("candidates: " + "; ".join(f"{c.name} ({c.version})" for c in cands))
    print(f"repetitions: {reps} (median, spread min–max)")
    runs: dict[str, Callable[[], None]] = {
        "B1": lambda: scenario_b1(cands, reps, n, one_chat=False),
        "B1-1chat": lambda: scenario_b1(cands, reps, n, one_chat=True),
        "B1-capture": lambda: scenario_b1_capture(reps, n),
        "B1-pg": lambda: scenario_b1_pg(reps, n),
        "instances": lambda: scenario_instances(reps, n),
        "paced": lambda: scenario_paced(cands, reps, [50, 200, 500], 5.0 if args.quick else 10.0),
        "B2": lambda: scenario_b2(cands, reps),
        "B3": lambda: scenario_burst(
            f"B3 Discord gateway dispatch -> reply, {n // 4} MESSAGE_CREATEs over 200 DMs, ~1 KB",
            cands,
            reps,
            n // 4,
            ["--chats", "200"],
            "discord",
            latency=True,
        ),
        "B4": lambda: scenario_burst(
            f"B4 Slack Socket Mode, a burst of {n // 2} envelopes in {n // 2} DMs, ~1 KB",
            cands,
            reps,
            n // 2,
            ["--chats", str(n // 2)],
            "slack",
            latency=True,
        ),
        "idle": lambda: scenario_idle(cands, reps, 5.0 if args.quick else 10.0),
        "B10": lambda: scenario_b10(reps, args.quick),
        "B7": lambda: scenario_soak(
            [c for c in cands if c.name == "dshim"] or cands[:1],
            soak,
            max(1, soak // 10),
            600.0,
        ),
        "B8": lambda: scenario_b8(
            cands,
            reps,
            n,
            sorted({int(x) for x in args.b8_sizes.split(",")})
            if args.b8_sizes
            else sorted({1, 100, min(1000, args.b8_max), args.b8_max}),
            5.0 if args.quick else 10.0,
        ),
        "B9": lambda: scenario_big_store(["--quick"] if args.quick else []),
        "B9-retention": lambda: scenario_big_store(
            ["--soak", "200000" if args.quick else "1000000", "--step", "20"]
        ),
    }
    for key, fn in runs.items():
        if key in only:
            try:
                fn()
            except (OSError, RuntimeError, TimeoutError, KeyError) as exc:  # the others go on
                print(f"\n### {key}: not measured ({type(exc).__name__}: {exc})\n", flush=True)


if __name__ == "__main__":
    main()
