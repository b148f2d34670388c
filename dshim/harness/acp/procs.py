"""The processes an agent started, found also when they left its process group.

Claude's and Codex's adapters start tool processes in sessions of their own (``setsid``),
so ending the agent's process group does not reach them, and a tool the agent leaves
running after a cancel, or after the agent was killed, would run on.  Two marks find them
(Linux ``/proc``; elsewhere nothing is found and only the group is ended):

- **the tree**: every process whose parent chain leads to the agent, while the agent
  lives (the sweep after a stopped turn; a tool that detached still has its parent);
- **the tag**: the agent is started with ``DSHIM_AGENT_RUN=<random>`` in its environment,
  which its descendants inherit, so one that was re-parented (its parent died) is still
  known by it.  The name carries no KEY/SECRET/TOKEN, so agents that scrub such variables
  from their tools' environment keep it.

A process is ended with SIGTERM, then SIGKILL after a grace; only processes of dshim's
own user can be read or signalled, and dshim itself is never one of them.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

import structlog
import trio

log = structlog.get_logger("dshim.harness.acp")

TAG_VARIABLE = "DSHIM_AGENT_RUN"
#: How long ended processes may take to exit after SIGTERM, before SIGKILL.
TERM_GRACE_S = 2.0


def new_tag() -> str:
    return secrets.token_hex(8)


@dataclass(frozen=True, slots=True)
class Proc:
    pid: int
    ppid: int
    pgid: int
    #: Start time in clock ticks since boot (``/proc/<pid>/stat`` field 22).
    started: int
    zombie: bool


def _stat(pid: int) -> Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw.rpartition(b")")[2].split()
    try:
        return Proc(pid, int(fields[1]), int(fields[2]), int(fields[19]), fields[0] == b"Z")
    except (IndexError, ValueError):
        return None


def table() -> dict[int, Proc]:
    """Every process of the system (what ``/proc`` shows), by pid."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}
    out: dict[int, Proc] = {}
    for entry in entries:
        if entry.isdigit():
            proc = _stat(int(entry))
            if proc is not None:
                out[proc.pid] = proc
    return out


def descendants(root: int, procs: dict[int, Proc]) -> set[int]:
    """The pids whose parent chain leads to ``root`` (``root`` not included)."""
    children: dict[int, list[int]] = {}
    for proc in procs.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def tagged(tag: str, procs: Iterable[int]) -> set[int]:
    """The pids whose environment holds ``DSHIM_AGENT_RUN=<tag>`` (readable ones only)."""
    needle = f"{TAG_VARIABLE}={tag}".encode()
    found: set[int] = set()
    for pid in procs:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.add(pid)
    return found


def strays(root: int, tag: str, *, since: int | None = None) -> set[int]:
    """The agent's processes (by the tree and by the tag), without the agent itself and
    without dshim; ``since``: only those started at or after that tick."""
    procs = table()
    found = descendants(root, procs) | tagged(tag, procs)
    found -= {root, os.getpid()}
    return {
        pid
        for pid in found
        if pid in procs and not procs[pid].zombie and (since is None or procs[pid].started >= since)
    }


_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def now_ticks() -> int:
    """The current time in the unit of :attr:`Proc.started` (ticks since boot; one tick
    earlier, so a process started in this very tick counts as started after it)."""
    clock = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)
    return max(0, int(time.clock_gettime(clock) * _TICKS) - 1)


def _signal(pids: Iterable[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _alive(pids: Iterable[int]) -> set[int]:
    out = set()
    for pid in pids:
        proc = _stat(pid)
        if proc is not None and not proc.zombie:
            out.add(pid)
    return out


async def end(pids: set[int], *, why: str, grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM ``pids``, SIGKILL what still runs after ``grace_s``."""
    if not pids:
        return
    log.warning("agent_strays_ended", count=len(pids), pids=sorted(pids)[:20], why=why)
    _signal(pids, signal.SIGTERM)
    with trio.move_on_after(grace_s):
        while await trio.to_thread.run_sync(_alive, pids):  # noqa: ASYNC110 - no event for an exit
            await trio.sleep(0.05)
        return
    left = await trio.to_thread.run_sync(_alive, pids)
    _signal(left, signal.SIGKILL)
    log.warning("agent_strays_killed", count=len(left))
