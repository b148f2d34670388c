"""What every benchmark fake of the suite shares: the command line, the release of the
updates (all at once, paced, or windowed) and the reply accounting it prints.

A fake (``fake_telegram.py``, ``fake_discord.py``, ``fake_slack.py``) serves its platform,
waits for the candidate's first poll / READY / hello, then calls :meth:`Ledger.run` with
a function that makes update ``k`` available, and feeds the bot's replies to
:meth:`Ledger.reply`.  One JSON object per stdout line: ``{"first_poll": t}``,
``{"released": t}``, ``{"progress": n, "t": t}`` (``--progress``), ``{"done": {...}}``.
Times are ``perf_counter`` values, comparable across processes on one machine.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

_PING = re.compile(r"ping (\d+) ")


def emit(obj: dict[str, Any]) -> None:
    print(json.dumps(obj), flush=True)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def add_arguments(p: argparse.ArgumentParser, *, updates: int = 4000, chats: int = 200) -> None:
    p.add_argument("--updates", type=int, default=updates)
    p.add_argument("--chats", type=int, default=chats)
    p.add_argument("--one-chat", action="store_true", help="every update from one chat")
    p.add_argument("--rate", type=float, default=0.0, help="updates/s (0: all at once)")
    p.add_argument("--hold", type=float, default=3.5)
    p.add_argument("--text-bytes", type=int, default=2100)
    p.add_argument("--layout", choices=["round-robin", "b2"], default="round-robin")
    p.add_argument("--sleep", type=float, default=0.0, help="agent latency (echo:sleep)")
    p.add_argument("--varied", action="store_true", help="latencies 1.0-3.0 s, not --sleep")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--window", type=int, default=0, help="at most W unanswered (0: no bound)")
    p.add_argument("--progress", type=int, default=0, help="print progress every N replies")


def watch_calls(fake: Any, each: Callable[[Any], None]) -> Callable[[], Awaitable[None]]:
    """A task that hands every new entry of ``fake.calls`` to ``each`` as it is logged
    (for fakes without a reply hook: the replies are read off the call log)."""
    seen = 0

    def new_calls() -> bool:
        nonlocal seen
        calls = fake.calls
        for call in calls[seen:]:
            each(call)
        seen = len(calls)
        return False

    async def watch() -> None:
        await fake.wait_until(new_calls)

    return watch


class Ledger:
    """Availability and reply times of updates ``0..n-1``; duplicates; per-chat order."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.filler = "x" * max(0, args.text_bytes - 40)
        self.available: dict[int, float] = {}
        self.answered: dict[int, float] = {}
        self.order: dict[Any, list[int]] = {}
        self.first_reply: dict[Any, float] = {}
        self.duplicates = 0
        self.released = 0.0
        self._all_done = trio.Event()
        self._room = trio.Event()

    def chat_of(self, k: int) -> int:
        """Which chat sends update ``k``: round robin, one chat, or B2's layout (one
        message in each chat, then the extra ones in chat 0)."""
        a = self.args
        if a.one_chat:
            return 0
        if a.layout == "b2":
            return k if k < a.chats else 0
        return int(k % a.chats)

    def text(self, k: int) -> str:
        """Update ``k``'s text: ``echo:sleep S`` (the agent latency every candidate
        honours) when asked, then ``ping K`` and the filler."""
        a = self.args
        directive = ""
        if a.sleep > 0:
            seconds = 1.0 + (k * 7 % 21) / 10 if a.varied else a.sleep
            directive = f"echo:sleep {seconds:.1f} "
        return f"{directive}ping {k} {self.filler}"

    def reply(self, text: str, chat: Any) -> None:
        """The bot answered in ``chat`` with ``text`` (anything without "ping K" is ignored)."""
        m = _PING.search(text)
        if m is None:
            return
        k = int(m.group(1))
        if k in self.answered:
            self.duplicates += 1
            return
        at = self.answered[k] = time.perf_counter()
        self.order.setdefault(chat, []).append(k)
        self.first_reply.setdefault(chat, at)
        self._room.set()
        if self.args.progress and len(self.answered) % self.args.progress == 0:
            emit({"progress": len(self.answered), "t": at})
        if len(self.answered) >= self.args.updates:
            self._all_done.set()

    async def run(
        self,
        inject: Callable[[int, int, str], Awaitable[None] | None],
        extra: Callable[[], dict[str, Any]] = dict,
        watch: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Hold, release the updates through ``inject(k, chat, text)``, wait for every
        reply (or ``--timeout``), print the summary (with ``extra()``'s figures);
        ``watch`` (see :func:`watch_calls`) runs alongside until then."""
        async with trio.open_nursery() as nursery:
            if watch is not None:
                nursery.start_soon(watch)
            await self._run(inject, extra)
            nursery.cancel_scope.cancel()

    async def _run(
        self,
        inject: Callable[[int, int, str], Awaitable[None] | None],
        extra: Callable[[], dict[str, Any]],
    ) -> None:
        a = self.args
        emit({"first_poll": time.perf_counter()})
        await trio.sleep(a.hold)
        self.released = time.perf_counter()
        emit({"released": self.released})
        with trio.move_on_after(a.timeout):
            for k in range(a.updates):
                if a.rate > 0:
                    delay = self.released + k / a.rate - time.perf_counter()
                    if delay > 0:
                        await trio.sleep(delay)
                while a.window and k - len(self.answered) >= a.window:
                    self._room = trio.Event()
                    await self._room.wait()
                self.available[k] = time.perf_counter()
                pending = inject(k, self.chat_of(k), self.text(k))
                if pending is not None:
                    await pending
            await self._all_done.wait()
        self.summary(time.perf_counter(), extra())

    def summary(self, finished: float, extra: dict[str, Any]) -> None:
        answered, available = self.answered, self.available
        latencies = [(answered[k] - available[k]) * 1000 for k in answered if k in available]
        last = max(answered.values()) if answered else finished
        first = self.first_reply
        emit(
            {
                "done": {
                    "updates": self.args.updates,
                    "replies": len(answered),
                    "duplicates": self.duplicates,
                    "in_order": all(seq == sorted(seq) for seq in self.order.values()),
                    "elapsed_s": last - self.released,
                    "chats_answered_s": (max(first.values()) - self.released) if first else None,
                    "chats_answered": len(first),
                    "p50_ms": percentile(latencies, 0.5),
                    "p99_ms": percentile(latencies, 0.99),
                    "mean_ms": statistics.fmean(latencies) if latencies else float("nan"),
                    "timed_out": len(answered) < self.args.updates,
                    **extra,
                }
            }
        )
