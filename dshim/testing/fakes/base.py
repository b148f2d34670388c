"""What every fake platform shares: the call log, waiting without polling, fault knobs.

A fake (``dshim.testing.fakes.<platform>``) subclasses :class:`FakePlatform` and
describes *what* its platform answers; the HTTP server lives in
:mod:`dshim.testing.fakes.http`, the websocket server in trio-websocket.  The base gives
every fake the same three things, so tests read the same on every channel:

- :attr:`FakePlatform.calls`: every request the bot made, in order, with its trio time
  (the record type is the fake's own); :meth:`FakePlatform.record` appends one;
- :meth:`FakePlatform.wait_until`: wait for a condition, re-checked after every change
  the fake reports with :meth:`FakePlatform.changed` (a request, an injected event, a
  connection) — never by polling;
- :attr:`FakePlatform.faults`, a :class:`FaultQueue` keyed by operation name (a Bot
  API method, ``"POST /channels/{channel_id}/messages"``, a frame type ...):
  ``fail_next(op, count, status=..., retry_after=...)``, ``slow_next(op, seconds)``,
  ``drop_next(op)``, and :meth:`FakePlatform.outage` for a time (every call fails with a
  500, is dropped before or lost after processing).  The fake's handler calls :meth:`FakePlatform.faults_for` at the
  start of each operation: slow faults sleep there, drop faults raise
  :class:`~dshim.testing.fakes.http.DropConnection` (the socket closes unanswered and the
  operation is not performed), and the returned status fault (if any) is answered in the
  platform's own error shape.

``open_fake_<platform>`` managers run their servers with :func:`open_servers`, which
raises the one error that ended them, never an ExceptionGroup.  A platform's fake also
says, as its ``IDLE_BENCH`` (an :class:`IdleBench`), how the idle bench
(``scripts/bench/fake_idle.py``) runs it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import trio

from dshim.errors import single_error
from dshim.testing.fakes.http import DropConnection

__all__ = ["Fault", "FaultQueue", "FakePlatform", "IdleBench", "open_servers"]

C = TypeVar("C")


@dataclass
class Fault:
    """One scripted fault: ``kind`` is ``"status"``, ``"slow"`` or ``"drop"``."""

    kind: str
    count: int
    status: int = 0
    retry_after: float | None = None
    seconds: float = 0.0
    description: str | None = None
    #: Platform-specific details for the fake's error body (e.g. migrate_to_chat_id).
    extra: dict[str, Any] = field(default_factory=dict)


class FaultQueue:
    """Faults waiting for the next calls of an operation (names compare case-insensitively)."""

    def __init__(self) -> None:
        self._queue: dict[str, list[Fault]] = {}

    def fail_next(
        self,
        op: str,
        count: int = 1,
        *,
        status: int = 429,
        retry_after: float | None = None,
        description: str | None = None,
        **extra: Any,
    ) -> None:
        """The next ``count`` calls of ``op`` fail with ``status``."""
        self._add(
            op, Fault("status", count, status, retry_after, description=description, extra=extra)
        )

    def slow_next(self, op: str, seconds: float, count: int = 1) -> None:
        """The next ``count`` calls of ``op`` wait ``seconds`` before they are handled."""
        self._add(op, Fault("slow", count, seconds=seconds))

    def drop_next(self, op: str, count: int = 1) -> None:
        """The next ``count`` calls of ``op`` get their connection closed, unanswered and
        unprocessed."""
        self._add(op, Fault("drop", count))

    def clear(self) -> None:
        self._queue.clear()

    def pending(self, op: str) -> int:
        """Shots left for ``op`` (all kinds)."""
        return sum(f.count for f in self._queue.get(op.lower(), []))

    def take(self, op: str) -> list[Fault]:
        """One shot of every fault queued for ``op``, in the order they were added."""
        out: list[Fault] = []
        queue = self._queue.get(op.lower(), [])
        for fault in list(queue):
            if fault.count > 0:
                fault.count -= 1
                out.append(fault)
            if fault.count <= 0:
                queue.remove(fault)
        return out

    def _add(self, op: str, fault: Fault) -> None:
        if fault.count < 1:
            raise ValueError("count must be at least 1")
        self._queue.setdefault(op.lower(), []).append(fault)


class FakePlatform(Generic[C]):
    """Base of the fakes: the call log, the change event and the fault queue."""

    def __init__(self) -> None:
        self.calls: list[C] = []
        self.faults = FaultQueue()
        self._changed = trio.Event()
        self._outages: list[tuple[float, str, frozenset[str]]] = []

    # -- observation ----------------------------------------------------------------------

    def record(self, call: C) -> C:
        """Append a call to the log (and wake waiters)."""
        self.calls.append(call)
        self.changed()
        return call

    def changed(self) -> None:
        """Something observable happened: re-check every :meth:`wait_until` condition."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds; put a deadline around it (``trio.fail_after``)."""
        while not predicate():
            await self._changed.wait()

    # -- faults ---------------------------------------------------------------------------

    def fail_next(self, op: str, count: int = 1, **kw: Any) -> None:
        """See :meth:`FaultQueue.fail_next` (``status``, ``retry_after``, ...)."""
        self.faults.fail_next(op, count, **kw)

    def slow_next(self, op: str, seconds: float, count: int = 1) -> None:
        """See :meth:`FaultQueue.slow_next`."""
        self.faults.slow_next(op, seconds, count)

    def drop_next(self, op: str, count: int = 1) -> None:
        """See :meth:`FaultQueue.drop_next`."""
        self.faults.drop_next(op, count)

    def outage(self, seconds: float, kind: str = "500", ops: tuple[str, ...] = ()) -> None:
        """For the next ``seconds`` (trio time), every call of ``ops`` (empty: of every
        operation) fails: ``"500"`` answers HTTP 500 (processed nothing), ``"drop"``
        closes the connection unanswered and unprocessed, ``"lost"`` processes the call
        and then closes the connection (the fake must ask :meth:`losing` after handling)."""
        if kind not in ("500", "drop", "lost"):
            raise ValueError(f"outage kind must be 500, drop or lost, not {kind!r}")
        until = trio.current_time() + seconds
        self._outages.append((until, kind, frozenset(o.lower() for o in ops)))

    def _outage(self, op: str) -> str | None:
        now = trio.current_time()
        self._outages = [o for o in self._outages if o[0] > now]
        for _, kind, ops in self._outages:
            if not ops or op.lower() in ops:
                return kind
        return None

    def losing(self, op: str) -> bool:
        """True while a ``"lost"`` outage covers ``op``: the processed call's answer is
        to be dropped."""
        return self._outage(op) == "lost"

    async def faults_for(self, op: str) -> Fault | None:
        """Apply the faults queued for one call of ``op`` (and any :meth:`outage`).

        Sleeps for slow faults, raises :class:`DropConnection` for a drop, and returns
        the first status fault for the fake to answer (None: handle the call normally).
        """
        outage = self._outage(op)
        if outage == "drop":
            raise DropConnection(op)
        if outage == "500":
            return Fault("status", 1, 500, description="Internal Server Error")
        status: Fault | None = None
        for fault in self.faults.take(op):
            if fault.kind == "slow":
                await trio.sleep(fault.seconds)
            elif fault.kind == "drop":
                raise DropConnection(op)
            elif status is None:
                status = fault
        return status


F = TypeVar("F", bound=FakePlatform[Any])


@dataclass(frozen=True)
class IdleBench(Generic[F]):
    """How the idle and startup bench (``scripts/bench/fake_idle.py``) runs a fake: it
    opens it, prints the bot settings, then waits for the bot's first contact."""

    #: Open the fake (with what the bench's peers need of it).
    open: Callable[[], AbstractAsyncContextManager[F]]
    #: The ``[[bots]]`` keys that point dshim at the fake (fake credentials only).
    settings: Callable[[F], dict[str, Any]]
    #: The bot made its first contact: its first long poll, READY, hello, connection.
    contact: Callable[[F], bool]
    #: A platform that only sends webhooks: instead of ``contact``, wait until the bot's
    #: webhook (this URL) answers -- its route is mounted.
    mounted: Callable[[str], Awaitable[None]] | None = None


@asynccontextmanager
async def open_servers(
    *servers: Callable[..., Awaitable[Any]],
) -> AsyncIterator[list[Any]]:
    """Start each server with ``nursery.start`` and yield what they reported started.

    Leaving the block stops them all.  An error that ends a server (or the block) is
    raised as itself, never wrapped in an ExceptionGroup.
    """
    with single_error():
        async with trio.open_nursery() as nursery:
            started = [await nursery.start(server) for server in servers]
            try:
                yield started
            finally:
                nursery.cancel_scope.cancel()
