"""Several ``dshim serve`` instances sharing the bots of one PostgreSQL store, by lease.

Theory of operation
-------------------
With a store that :class:`~dshim.store.base.SharesBots` (``[store] url``), every bot runs
in exactly one instance: the one holding its lease.  Each instance runs one
:class:`LeaseKeeper`; every ``lease_s / 3`` (a *tick*) it

1. writes its heartbeat and reads the live instances (a heartbeat at most ``lease_s``
   old), so ``share = ceil(bots / live instances)``;
2. renews every lease it holds.  A lease it could not renew is *lost*: the keeper cuts
   that bot at once (its turns are cancelled as on SIGTERM's hard stop; the answer a user
   did not see is answered again by whoever holds the bot next, from the durable inbox);
   a renewal that does not come back in time has the same end: every held bot runs under
   a cancel scope whose deadline is the lease's local expiry (measured from *before* the
   last successful renewal was sent, less a margin of up to 1 s), pushed forward by each
   renewal, so
   a keeper that cannot reach the database -- or a process that was paused -- stops its
   bots before another instance may take them;
3. hands bots over when it holds more than its share: those bots stop gracefully (their
   running turns get the shutdown grace), then the lease is released at once, so a new
   instance gets its share within two ticks of its first heartbeat;
4. takes free or expired leases while it holds fewer than its share, in an order that
   differs per instance (so instances starting together do not contend for the same bots
   first).

A bot that stopped for good here (a rejected credential: ``fatal``) keeps its lease,
renewed, without running: moving it would only fail again elsewhere.

Fencing is the store's: a bot runs with ``store.fenced(lease)``, whose every durable
write fails once the lease's epoch moved, so even a bot that is still running when its
lease passed on (a paused process that wakes up) can neither confirm, send from the inbox
nor commit a cursor; and the first refused write cuts the bot at once
(:func:`cut_on_fence`), before a caller that would carry on after a store error (an
answer is delivered even when its delivery mark could not be written) sends anything.  Times of the leases are the database's clock; the keeper's own
deadlines are trio's monotonic clock, never compared with the database's.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import structlog
import trio

from dshim.errors import DshimError, FencedError
from dshim.store.base import Lease, SharesBots, Store

__all__ = ["Held", "LeaseKeeper", "cut_on_fence"]

log = structlog.get_logger("dshim.leases")


@dataclass(eq=False)
class Held:
    """A lease this instance holds, and how its bot runs under it."""

    lease: Lease
    #: The bot's run: cancelled when the lease is lost, its deadline the lease's local
    #: expiry (pushed forward by each renewal).
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: Set when the bot should stop gracefully and give the lease up (balancing).
    handover: trio.Event = field(default_factory=trio.Event)
    #: The bot stopped for good (fatal): the lease is kept without running it.
    parked: bool = False


class LeaseKeeper:
    """One instance's leases (see the module docstring)."""

    def __init__(
        self,
        store: SharesBots,
        instance: str,
        bots: Sequence[str],
        *,
        lease_s: float,
        started_at: float,
    ) -> None:
        self.store = store
        self.instance = instance
        self.bots = list(bots)
        self.lease_s = lease_s
        self.tick_s = lease_s / 3
        self.started_at = started_at
        self.held: dict[str, Held] = {}
        self.live = 1
        self._granted: dict[str, trio.Event] = {bot: trio.Event() for bot in self.bots}
        self.stopping = False

    @property
    def share(self) -> int:
        """The most bots this instance should hold: ``ceil(bots / live instances)``."""
        return math.ceil(len(self.bots) / max(1, self.live))

    def _order(self, bot: str) -> bytes:
        return hashlib.blake2b(f"{self.instance}\0{bot}".encode(), digest_size=8).digest()

    # -- the keeper's task ---------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Tick until cancelled (the first tick has run when it reports started)."""
        await self.tick()
        task_status.started()
        while True:
            await trio.sleep(self.tick_s)
            await self.tick()

    async def tick(self) -> None:
        try:
            await self.store.heartbeat(self.instance, started_at=self.started_at)
            live = await self.store.instances(within_s=self.lease_s)
            self.live = max(1, len(live))
        except DshimError as exc:
            log.warning("lease_heartbeat_failed", error=str(exc)[:300])
        await self._renew()
        if self.stopping:
            return
        self._balance()
        await self._take()

    async def _renew(self) -> None:
        for bot, held in list(self.held.items()):
            sent_at = trio.current_time()
            try:
                renewed = await self.store.renew_lease(held.lease, lease_s=self.lease_s)
            except DshimError as exc:
                # The scope's deadline cuts the bot if this keeps failing.
                log.warning("lease_renew_failed", bot=bot, error=str(exc)[:300])
                continue
            if renewed is None:
                log.error("lease_lost", bot=bot, epoch=held.lease.epoch)
                self.held.pop(bot, None)
                held.scope.cancel()
                continue
            held.lease = renewed
            held.scope.deadline = self._deadline(sent_at)

    def _deadline(self, sent_at: float) -> float:
        """The local moment the bot must be stopped by if no renewal comes: just before
        the lease can run out in the database (it was renewed no earlier than
        ``sent_at``), less a margin for the cut itself."""
        return sent_at + self.lease_s - min(1.0, self.tick_s / 2)

    def _balance(self) -> None:
        running = [b for b, h in self.held.items() if not h.parked and not h.handover.is_set()]
        extra = len(running) - self.share
        if extra <= 0:
            return
        for bot in sorted(running, key=self._order, reverse=True)[:extra]:
            log.info("lease_handover", bot=bot, share=self.share, live=self.live)
            self.held[bot].handover.set()

    async def _take(self) -> None:
        free = [b for b in self.bots if b not in self.held]
        for bot in sorted(free, key=self._order):
            if len(self.held) >= self.share:
                return
            sent_at = trio.current_time()
            try:
                lease = await self.store.take_lease(bot, self.instance, lease_s=self.lease_s)
            except DshimError as exc:
                log.warning("lease_take_failed", bot=bot, error=str(exc)[:300])
                return
            if lease is None:
                continue
            held = Held(lease)
            held.scope.deadline = self._deadline(sent_at)
            self.held[bot] = held
            log.info("lease_taken", bot=bot, epoch=lease.epoch, share=self.share, live=self.live)
            self._granted[bot].set()

    # -- what a bot's runner uses --------------------------------------------------------

    async def granted(self, bot: str) -> Held | None:
        """Wait until this instance holds ``bot``'s lease; None once it stops."""
        while not self.stopping:
            held = self.held.get(bot)
            if held is not None and not held.handover.is_set() and not held.parked:
                return held
            event = self._granted[bot] = trio.Event()
            await event.wait()
        return None

    def stop(self) -> None:
        """Shutdown: no new leases; the bots' runners stop waiting for one."""
        self.stopping = True
        for event in self._granted.values():
            event.set()

    def forget(self, bot: str, held: Held) -> None:
        """``bot``'s run was cut (its lease lost, or its local expiry passed before a
        renewal came back): the lease is no longer used here (it runs out unless this
        keeper takes it again, with a new epoch)."""
        if self.held.get(bot) is held:
            del self.held[bot]

    def park(self, bot: str) -> None:
        """``bot`` stopped for good: keep its lease, do not run it again."""
        held = self.held.get(bot)
        if held is not None:
            held.parked = True
            held.scope.deadline = math.inf
            held.scope = trio.CancelScope()

    async def release(self, bot: str) -> None:
        """Give ``bot``'s lease up (after its run ended gracefully)."""
        held = self.held.pop(bot, None)
        if held is None:
            return
        with trio.CancelScope(shield=True), trio.move_on_after(self.tick_s):
            try:
                await self.store.release_lease(held.lease)
                log.info("lease_released", bot=bot, epoch=held.lease.epoch)
            except DshimError as exc:
                log.warning("lease_release_failed", bot=bot, error=str(exc)[:300])

    async def release_all(self) -> None:
        """At shutdown: every lease goes (the bots have stopped)."""
        self.stop()
        for bot in list(self.held):
            await self.release(bot)


class _CutOnFence:
    """A store whose calls cut the bot on the first :class:`FencedError` (see
    :func:`cut_on_fence`)."""

    def __init__(self, inner: Store, cut: Callable[[], None]) -> None:
        self._inner = inner
        self._cut = cut

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not inspect.iscoroutinefunction(value):
            return value

        @functools.wraps(value)
        async def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return await value(*args, **kwargs)
            except FencedError:
                log.error("bot_fenced", method=name)
                self._cut()
                raise

        return call


def cut_on_fence(view: Store, cut: Callable[[], None]) -> Store:
    """``view`` (a fenced store) whose first refused write calls ``cut`` (the bot's run
    is cancelled) before the error goes on to the caller."""
    return cast(Store, _CutOnFence(view, cut))
