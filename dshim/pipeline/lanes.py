"""Step 6: conversation lanes — one turn at a time per (conversation, thread), FIFO, bounded.

The bound (``[bots.lanes] max_queue``) is for slow agents: a lane whose running turn has
taken :data:`SLOW_TURN_S` or longer refuses an item beyond ``max_queue`` (the user gets
"busy").  While the agent keeps up — a burst from one chat, a restart backlog — items
beyond ``max_queue`` are queued, up to :data:`MAX_BACKLOG` per lane; they are in the
durable inbox already, so memory is the only thing this protects.

A lane is a bounded memory channel plus one worker task in the bot's nursery.  The worker
runs each item in its own cancel scope (so ``/stop`` cancels exactly the running turn and
leaves the queue alone) and exits after ``idle_exit_s`` without work.  Creating and
removing lanes happens on the trio thread without awaits in between, so a message can
never be put into a lane whose worker has just decided to exit.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import msgspec
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

    def __init__(self, key: LaneKey, max_queue: int) -> None:
        self.key = key
        self.max_queue = max_queue
        self.send, self.receive = trio.open_memory_channel[Any](max(max_queue, MAX_BACKLOG))
        #: When the running item started (trio time; None: idle).
        self.started_at: float | None = None
        #: Cancels the running item's stoppable part (/stop).
        self.stop_scope: trio.CancelScope | None = None
        #: Why it was cancelled: ``"user"`` (/stop) or ``"shutdown"`` (the grace ended).
        self.stop_reason: StopReason | None = None
        self.running: Any = None

    @property
    def queued(self) -> int:
        return self.send.statistics().current_buffer_used

    def full(self) -> bool:
        """Refuse the next item?  Only beyond ``max_queue`` while the agent is slow."""
        queued = self.queued
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
            self._nursery.start_soon(self._work, lane, name=f"lane:{key[0]}:{key[1]}")
        if lane.full():
            return False
        try:
            lane.send.send_nowait(item)
        except trio.WouldBlock:
            return False
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
        return sum(lane.queued for lane in self._lanes.values())

    def stop_all(self, reason: StopReason) -> int:
        """Stop every running item (shutdown).  Returns how many were stopped."""
        return sum(1 for lane in list(self._lanes.values()) if lane.stop(reason))

    async def wait_none_running(self) -> None:
        """Wait until no lane is running an item."""
        while self._running:
            await self._none_running.wait()

    async def _work(self, lane: Lane) -> None:
        while True:
            item: Any = None
            try:
                item = lane.receive.receive_nowait()  # a busy lane: no timer to set up
            except trio.WouldBlock:
                with trio.move_on_after(self._idle_exit_s):
                    item = await lane.receive.receive()
            else:
                await trio.lowlevel.checkpoint()  # one turn after another still yields
            if item is None:
                # Idle: leave only if nothing arrived meanwhile (no await since the check).
                try:
                    item = lane.receive.receive_nowait()
                except trio.WouldBlock:
                    del self._lanes[lane.key]
                    log.debug("lane_idle_exit", conversation=lane.key[0], thread=lane.key[1])
                    if self._on_idle is not None:
                        await self._on_idle(lane.key)
                    return
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
