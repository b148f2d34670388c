"""Step 6: conversation lanes — one turn at a time per (conversation, thread), FIFO, bounded.

The bound (``[bots.lanes] max_queue``) is for slow agents: a lane whose running turn has
taken :data:`SLOW_TURN_S` or longer refuses an item beyond ``max_queue`` (the user gets
"busy").  While the agent keeps up — a burst from one chat, a restart backlog — items
beyond ``max_queue`` are queued, up to :data:`MAX_BACKLOG` per lane; they are in the
durable inbox already, so memory is the only thing this protects.

A lane is a FIFO of items served by at most one worker task at a time, so a
conversation's items run one after another and conversations run in parallel.  A worker
runs each item in its own cancel scope (so ``/stop`` cancels exactly the running turn and
leaves the queue alone); when its lane is empty it leaves it and waits, parked without a
timer, for the next lane that has work (at most :data:`SPARE_WORKERS` wait; one more
ends).  So a new conversation costs a dict entry and a wake-up, not a channel, a task and
a timer: a flood of first messages from distinct users is the common case of a busy bot.

A lane without work for ``idle_exit_s`` is removed (and ``on_idle`` told, so the harness
may free its session) by one reaper task per bot, which sleeps until the oldest idle
lane's time is up; lanes go idle in time order, so that is the head of a FIFO.  Creating,
serving and removing lanes happens on the trio thread without awaits in between, so a
message can never be put into a lane that is being removed.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec
import outcome
import structlog
import trio

from dshim.model import InboundMessage

log = structlog.get_logger("dshim.lanes")

LaneKey = tuple[str, str]
Handler = Callable[[Any, "Lane"], Awaitable[None]]
#: Told that a lane went idle and was removed (the harness may free its session).
IdleHook = Callable[[LaneKey], Awaitable[None]]
StopReason = Literal["user", "shutdown"]

#: A running turn this old means the agent is slow: the lane bound applies.
SLOW_TURN_S = 1.0
#: Items a lane holds at most, however fast its turns are.
MAX_BACKLOG = 10_000
#: Workers without a lane that wait for one; a worker that would be one more ends.
SPARE_WORKERS = 16


class LaneItem(msgspec.Struct, kw_only=True):
    """One unit of work on a conversation lane: a turn, or a ``/new``."""

    kind: Literal["turn", "new"]
    msg: InboundMessage
    #: Replaces the message text (a /batch submission).
    text: str | None = None
    #: Source of the session title when it is not the message text (a batch: its first text).
    title_text: str | None = None
    #: Inbox keys to finish with this item (a batch covers several messages).
    inbox_keys: list[tuple[str, str]] = msgspec.field(default_factory=list)
    #: The text is an agent command (``/agent <command>``): sent as the prompt's only block.
    agent_command: bool = False


class Lane:
    """One conversation's queue and its running item."""

    __slots__ = (
        "key",
        "max_queue",
        "items",
        "served",
        "idle_since",
        "started_at",
        "stop_scope",
        "stop_reason",
        "running",
    )

    def __init__(self, key: LaneKey, max_queue: int) -> None:
        self.key = key
        self.max_queue = max_queue
        #: Waiting items, oldest first.
        self.items: deque[Any] = deque()
        #: A worker serves the lane (runs its items, or is about to).
        self.served = False
        #: When its last item ended (trio time), for the reaper.
        self.idle_since = 0.0
        #: When the running item started (trio time; None: idle).
        self.started_at: float | None = None
        #: Cancels the running item's stoppable part (/stop).
        self.stop_scope: trio.CancelScope | None = None
        #: Why it was cancelled: ``"user"`` (/stop) or ``"shutdown"`` (the grace ended).
        self.stop_reason: StopReason | None = None
        self.running: Any = None

    @property
    def queued(self) -> int:
        return len(self.items)

    def full(self) -> bool:
        """Refuse the next item?  Only beyond ``max_queue`` while the agent is slow."""
        queued = len(self.items)
        if queued < self.max_queue:
            return False
        if queued >= max(self.max_queue, MAX_BACKLOG):
            return True
        started = self.started_at
        return started is not None and trio.current_time() - started >= SLOW_TURN_S

    def stop(self, reason: StopReason = "user") -> bool:
        """Cancel the running item's stoppable part.  True when something was running."""
        if self.stop_scope is not None and not self.stop_scope.cancel_called:
            self.stop_reason = reason
            self.stop_scope.cancel()
            return True
        return False


class LaneSet:
    """All lanes of one bot."""

    def __init__(
        self,
        nursery: trio.Nursery,
        handler: Handler,
        *,
        max_queue: int,
        idle_exit_s: float,
        on_idle: IdleHook | None = None,
    ) -> None:
        self._nursery = nursery
        self._handler = handler
        self._max_queue = max_queue
        self._idle_exit_s = idle_exit_s if idle_exit_s > 0 else math.inf
        self._on_idle = on_idle
        self._lanes: dict[LaneKey, Lane] = {}
        self._running = 0
        self._none_running = trio.Event()
        self._none_running.set()
        #: Workers parked until a lane has work for them (the newest last).
        self._spare: list[trio.lowlevel.Task] = []
        #: The lanes without work, the longest idle first.
        self._idle: OrderedDict[LaneKey, Lane] = OrderedDict()
        self._reaping = False

    def get(self, key: LaneKey) -> Lane | None:
        return self._lanes.get(key)

    def __len__(self) -> int:
        return len(self._lanes)

    def enqueue(self, key: LaneKey, item: Any) -> bool:
        """Put an item on its lane.  False when the lane's queue is full (nothing queued)."""
        lane = self._lanes.get(key)
        if lane is None:
            lane = Lane(key, self._max_queue)
            self._lanes[key] = lane
        elif lane.full():
            return False
        lane.items.append(item)
        if not lane.served:
            lane.served = True
            self._idle.pop(key, None)
            if self._spare:
                trio.lowlevel.reschedule(self._spare.pop(), outcome.Value(lane))
            else:
                self._nursery.start_soon(self._work, lane, name="lane-worker")
        return True

    def running_with(self, inbox_key: tuple[str, str]) -> Lane | None:
        """The lane whose running item covers this (conversation, message id), if any."""
        for lane in self._lanes.values():
            item = lane.running
            if item is not None and inbox_key in getattr(item, "inbox_keys", ()):
                return lane
        return None

    def running_count(self) -> int:
        return self._running

    def queued_count(self) -> int:
        """Items waiting in all lanes (the lane queue gauge)."""
        return sum(len(lane.items) for lane in self._lanes.values())

    def stop_all(self, reason: StopReason) -> int:
        """Stop every running item (shutdown).  Returns how many were stopped."""
        return sum(1 for lane in list(self._lanes.values()) if lane.stop(reason))

    async def wait_none_running(self) -> None:
        """Wait until no lane is running an item."""
        while self._running:
            await self._none_running.wait()

    async def _work(self, lane: Lane) -> None:
        """A worker: serve ``lane`` until it is empty, then the next lane with work."""
        while True:
            await self._serve(lane)
            lane.served = False
            self._went_idle(lane)
            if len(self._spare) >= SPARE_WORKERS:
                return
            task = trio.lowlevel.current_task()
            self._spare.append(task)

            def abort(_: Any, task: trio.lowlevel.Task = task) -> trio.lowlevel.Abort:
                self._spare.remove(task)
                return trio.lowlevel.Abort.SUCCEEDED

            lane = await trio.lowlevel.wait_task_rescheduled(abort)

    async def _serve(self, lane: Lane) -> None:
        """Run the lane's items one after another (each after a checkpoint but the first:
        the worker was just woken or started) until none is left."""
        items = lane.items
        while True:
            item = items.popleft()
            lane.running = item
            lane.started_at = trio.current_time()
            self._running += 1
            if self._none_running.is_set():
                self._none_running = trio.Event()
            try:
                await self._handler(item, lane)
            finally:
                lane.running = None
                lane.started_at = None
                lane.stop_scope = None
                lane.stop_reason = None
                self._running -= 1
                if not self._running:
                    self._none_running.set()
            if not items:
                return
            await trio.lowlevel.checkpoint()  # one turn after another still yields

    def _went_idle(self, lane: Lane) -> None:
        """``lane`` has no work: it is removed after ``idle_exit_s`` unless work comes."""
        if self._idle_exit_s == math.inf:
            return
        lane.idle_since = trio.current_time()
        self._idle[lane.key] = lane
        if not self._reaping:
            self._reaping = True
            self._nursery.start_soon(self._reap, name="lane-reaper")

    async def _reap(self) -> None:
        """Remove the lanes idle for ``idle_exit_s`` (oldest first), until none is idle."""
        idle = self._idle
        try:
            while idle:
                key, lane = next(iter(idle.items()))
                when = lane.idle_since + self._idle_exit_s
                if trio.current_time() < when:
                    await trio.sleep_until(when)  # it may get work meanwhile: look again
                    continue
                del idle[key], self._lanes[key]
                log.debug("lane_idle_exit", conversation=lane.key[0], thread=lane.key[1])
                if self._on_idle is not None:
                    self._nursery.start_soon(self._on_idle, lane.key)
        finally:
            self._reaping = False
