"""Between neonize's threads and trio: events in through a bounded channel, calls out on
worker threads with a limiter and a deadline.

neonize (whatsmeow, in Go) calls its event handlers on threads of its own.  Nothing of
dshim's pipeline may run there, so a handler only hands the event to trio:
:meth:`ThreadBridge.hand_over` blocks *that* thread until the event is in a bounded
memory channel (``trio.from_thread`` with the run's token), so a burst waits in
whatsmeow instead of growing a queue, and the trio side reads the events in the order
they were handed over (:meth:`ThreadBridge.events`).  An event that must be durable
before the library acknowledges it to WhatsApp (a message: whatsmeow sends its ack when
the handler returns) is handed over with ``until=`` a :class:`trio.Event` the trio side
sets once the pipeline accepted it; the handler thread waits for that too.  Once the
bridge is closed (the bot stops), a handler returns at once and says so (False), and
the handlers still waiting are let go: it never blocks a thread of a library that is
being disconnected.

The other direction: every call into neonize is blocking (cgo), so it runs on a worker
thread (``trio.to_thread.run_sync``) under one :class:`trio.CapacityLimiter` per bot and
a deadline.  A call past its deadline is abandoned (the thread finishes on its own) and
raised as a :class:`~dshim.errors.TransportError` whose outcome is unknown (the call may
have been carried out: a send may be on its way); an exception the library raises is a
:class:`~dshim.errors.TransportError` too, with the library's words, unless a caller
maps it first (``errors``).
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Generic, TypeVar

import structlog
import trio

from dshim.errors import ChannelError, TransportError

__all__ = ["ThreadBridge"]

log = structlog.get_logger("dshim.whatsapp_web")

E = TypeVar("E")
T = TypeVar("T")

#: Events waiting for the pipeline before a handler thread blocks.
EVENT_BUFFER = 64
#: Calls into neonize at once, per bot.
CALLS_AT_ONCE = 4
#: A call into neonize that takes longer is given up (its outcome unknown).
CALL_DEADLINE_S = 30.0


class ThreadBridge(Generic[E]):
    """One bot's crossing between neonize's threads and its trio run (create it in trio)."""

    def __init__(
        self,
        *,
        buffer: int = EVENT_BUFFER,
        calls_at_once: int = CALLS_AT_ONCE,
        deadline_s: float = CALL_DEADLINE_S,
    ) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._send, self._receive = trio.open_memory_channel[E](buffer)
        self._limiter = trio.CapacityLimiter(calls_at_once)
        self.deadline_s = deadline_s
        self.closed = False
        self._waiting: set[trio.CancelScope] = set()

    # -- neonize's threads ----------------------------------------------------------------

    def hand_over(self, event: E, *, until: trio.Event | None = None) -> bool:
        """On a foreign thread: wait until ``event`` is in the channel (and, with
        ``until``, until the trio side set it).  False when the bridge is closed first."""
        if self.closed:
            return False
        try:
            return trio.from_thread.run(self._deliver, event, until, trio_token=self._token)
        except (trio.RunFinishedError, trio.ClosedResourceError, trio.BrokenResourceError):
            return False
        except trio.Cancelled:
            return False

    async def _deliver(self, event: E, until: trio.Event | None) -> bool:
        if until is None:
            await self._send.send(event)
            return True
        with trio.CancelScope() as scope:
            self._waiting.add(scope)
            try:
                await self._send.send(event)
                await until.wait()
                return True
            finally:
                self._waiting.discard(scope)
        return False  # closed while it waited

    # -- the trio side -------------------------------------------------------------------

    async def events(self) -> AsyncIterator[E]:
        """The events in the order they were handed over, until the bridge is closed."""
        async with self._receive:
            async for event in self._receive:
                yield event

    def close(self) -> None:
        """No more events: handlers return at once, :meth:`events` ends after the ones
        already in the channel."""
        self.closed = True
        self._send.close()
        for scope in list(self._waiting):
            scope.cancel()

    async def call(
        self,
        what: str,
        fn: Callable[..., T],
        *args: object,
        deadline_s: float | None = None,
        errors: Mapping[type[BaseException], Callable[[BaseException], ChannelError]] | None = None,
        **kwargs: object,
    ) -> T:
        """``fn(*args, **kwargs)`` on a worker thread, within the deadline (see the module
        docstring).  ``errors`` maps the library's exceptions to channel errors."""
        deadline = self.deadline_s if deadline_s is None else deadline_s
        job = functools.partial(fn, *args, **kwargs)
        try:
            with trio.fail_after(deadline):
                return await trio.to_thread.run_sync(
                    job, limiter=self._limiter, abandon_on_cancel=True
                )
        except trio.TooSlowError:
            log.warning("engine_call_timed_out", what=what, deadline_s=deadline)
            raise TransportError(f"{what}: no answer within {deadline:g} s") from None
        except ChannelError:
            raise
        except Exception as exc:
            for kind, make in (errors or {}).items():
                if isinstance(exc, kind):
                    raise make(exc) from exc
            raise TransportError(f"{what}: {type(exc).__name__}: {str(exc)[:200]}") from exc
