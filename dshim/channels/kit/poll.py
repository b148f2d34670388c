"""The long-poll loop: poll, hand each event to the pipeline in order, then move a durable
cursor — never past an event the pipeline has not accepted.

For platforms that deliver events by long polling against a server-side cursor: Telegram
(``getUpdates``' ``offset``: asking from ``update_id + 1`` confirms everything below it)
and WeChat iLink (``getupdates``' opaque ``get_updates_buf``).  The loop knows neither:
the cursor is an opaque string, and what a batch of events is and which cursor confirms
which event is the channel's :class:`PollSource`.

Theory of operation
-------------------
The loop owns one cursor, persisted in the bot's store under ``cursor_name`` (None until
something was confirmed).  Each round:

1. ``source.poll(cursor)`` asks the platform for what follows ``cursor`` and returns a
   :class:`PollBatch`: the events ready for the pipeline, in platform order, each with its
   raw bytes (the durable inbox keeps them) and the cursor that confirms it and everything
   before it (None where only the end of the batch moves the cursor), plus the cursor the
   whole batch ends at (None: unchanged);
2. each event goes to :meth:`Inbound.accept` in order.  When the verdict says
   ``confirm`` (accepted, or deliberately dropped), the in-memory cursor moves to the
   event's cursor.  A ``"shutdown"`` verdict ends the loop there: that event and every
   later one stay unconfirmed, and the platform delivers them again after the restart;
3. after the batch — also when it ended early or was cancelled — a cursor that moved is
   written with ``store.set_cursor`` in a shielded scope bounded by
   :data:`CURSOR_WRITE_DEADLINE_S`: a shutdown arriving mid-batch cannot lose the progress
   just made, and a stuck store cannot hold the shutdown forever (the platform then
   re-sends, the pipeline's persisted dedup drops the copies).

The platform learns the new cursor only with the next poll, so a crash anywhere
re-delivers at most what follows the last persisted cursor: nothing accepted is lost and
nothing handled runs twice.

Failures of a poll: :class:`~dshim.errors.AuthError` and
:class:`~dshim.errors.FatalChannelError` end the loop (the bot stops);
:class:`~dshim.errors.RateLimited` waits ``retry_after`` (at least the backoff), logged
``rate_limited``; :class:`~dshim.errors.Conflict` (another consumer owns the stream) is
logged as an error, ``poll_conflict``, every time, and backs off; every other
:class:`~dshim.errors.ChannelError` (network, timeout, 5xx, an undecodable answer) is
``poll_failed`` and backs off — the kit's :class:`~dshim.backoff.Backoff`, 1 s doubling to
30 s with jitter, reset by the next poll that answers.  A batch whose events moved the
cursor nowhere (their ids were unreadable) backs off as well, ``poll_unconfirmed``, unless
the source says it is holding events back on purpose (an album being collected): the
loop never spins on the same events.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import structlog
import trio

from dshim.backoff import Backoff
from dshim.channels.base import AcceptsMany, ChannelStore, Inbound
from dshim.errors import AuthError, ChannelError, Conflict, FatalChannelError, RateLimited
from dshim.model import InboundMessage, Skip

__all__ = [
    "CURSOR_WRITE_DEADLINE_S",
    "PollBatch",
    "PollEvent",
    "PollSource",
    "accept_batch",
    "run_poll_loop",
]

log = structlog.get_logger("dshim.kit")

#: How long a cursor write may hold up a shutdown.
CURSOR_WRITE_DEADLINE_S = 5.0


@dataclass(frozen=True, slots=True)
class PollEvent:
    """One platform event, mapped, ready for :meth:`Inbound.accept`."""

    item: InboundMessage | Skip
    #: The event's bytes as the platform sent them (the durable inbox keeps them).
    raw: bytes | None = None
    #: The cursor that confirms this event and every earlier one (None: only the batch's
    #: own cursor moves it, once every event of the batch is confirmed).
    cursor: str | None = None


@dataclass(frozen=True, slots=True)
class PollBatch:
    """What one poll returned."""

    events: Sequence[PollEvent] = ()
    #: The cursor once every event of the batch is confirmed (None: unchanged).
    cursor: str | None = None
    #: How many platform events the poll returned, ready or not (None: ``len(events)``);
    #: when some came back but the cursor did not move, the loop backs off.
    received: int | None = None
    #: The source holds events back on purpose (e.g. parts of an album it is still
    #: collecting): a cursor that did not move is expected, not a stuck batch.
    holding: bool = False

    @property
    def arrived(self) -> int:
        """How many platform events the poll returned."""
        return self.received if self.received is not None else len(self.events)


class PollSource(Protocol):
    """A channel's side of the loop: one poll, mapped into events."""

    async def poll(self, cursor: str | None) -> PollBatch:
        """Ask the platform for what follows ``cursor``.  Raises the error tree."""
        ...


async def accept_batch(
    inbound: Inbound,
    store: ChannelStore,
    batch: PollBatch,
    *,
    cursor_name: str,
    cursor: str | None,
) -> tuple[str | None, bool]:
    """Hand a batch to the pipeline in order and persist how far it was confirmed.

    Returns ``(cursor, stop)``: the cursor now persisted (the one given when nothing
    moved it) and whether a ``"shutdown"`` verdict ended the batch early.
    """
    start = cursor
    stopped = False
    try:
        # The runtime's accept_many takes the whole batch in one store transaction.
        verdicts = (
            await inbound.accept_many([(e.item, e.raw) for e in batch.events])
            if isinstance(inbound, AcceptsMany)
            else None
        )
        for i, event in enumerate(batch.events):
            verdict = (
                verdicts[i] if verdicts is not None else await inbound.accept(event.item, event.raw)
            )
            if not verdict.confirm:
                stopped = True  # not taken: the platform delivers it again after the restart
                break
            if event.cursor is not None:
                cursor = event.cursor
        else:
            if batch.cursor is not None:
                cursor = batch.cursor
    finally:
        if cursor is not None and cursor != start:
            # Shielded: a shutdown arriving now must not lose the progress just made;
            # bounded: a stuck store must not hold the shutdown forever.
            with trio.CancelScope(shield=True), trio.move_on_after(CURSOR_WRITE_DEADLINE_S) as s:
                await store.set_cursor(cursor_name, cursor)
            if s.cancelled_caught:
                log.warning("cursor_write_timed_out", cursor=cursor_name)
    return cursor, stopped


async def run_poll_loop(
    source: PollSource,
    inbound: Inbound,
    store: ChannelStore,
    *,
    cursor_name: str,
    backoff: Backoff | None = None,
) -> None:
    """Poll until a ``"shutdown"`` verdict (returns), cancellation, or a fatal error.

    See the module docstring.  Only AuthError and FatalChannelError (and cancellation)
    leave it; every other ChannelError backs off and polls again.
    """
    backoff = backoff if backoff is not None else Backoff()
    cursor = await store.get_cursor(cursor_name)
    while True:
        try:
            batch = await source.poll(cursor)
        except (AuthError, FatalChannelError):
            raise
        except RateLimited as exc:
            delay = backoff.next_delay(retry_after=exc.retry_after)
            log.warning("rate_limited", what="poll", retry_in_s=round(delay, 2))
            await trio.sleep(delay)
            continue
        except Conflict as exc:
            delay = backoff.next_delay()
            log.error("poll_conflict", error=str(exc), retry_in_s=round(delay, 2))
            await trio.sleep(delay)
            continue
        except ChannelError as exc:  # network, timeout, 5xx, an undecodable answer
            delay = backoff.next_delay()
            log.warning("poll_failed", error=str(exc), retry_in_s=round(delay, 2))
            await trio.sleep(delay)
            continue
        before = cursor
        cursor, stop = await accept_batch(
            inbound, store, batch, cursor_name=cursor_name, cursor=cursor
        )
        if stop:
            return
        if batch.arrived and cursor == before and not batch.holding:
            # Events came back but none could be confirmed: never spin on them.
            delay = backoff.next_delay()
            log.warning("poll_unconfirmed", events=batch.arrived, retry_in_s=round(delay, 2))
            await trio.sleep(delay)
            continue
        backoff.reset()
