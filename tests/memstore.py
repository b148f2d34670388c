"""A small in-memory store for tests of the quoted-reply layer.

It implements the parts of :class:`dshim.store.base.Store` that :mod:`dshim.reply` uses
(outbound index and transcript) with the same semantics as the SQLite store: the outbound
index keeps the newest 200 entries per bot+conversation by ``sent_at`` (insertion order
breaks ties), drops entries completed more than 30 days ago and cuts text to 8,000 code
points; transcript pages are newest first by id.  Each call is a checkpoint, like a
real store.  ``delay`` makes every call take that long (a slow store); ``calls`` counts
calls per method.
"""

from __future__ import annotations

from collections import Counter

import trio

from dshim.store.base import OutboundEntry, TranscriptRow

OUTBOUND_CAP = 200
OUTBOUND_MAX_AGE_S = 30 * 24 * 3600.0
OUTBOUND_TEXT_MAX = 8000


class MemStore:
    """Outbound index and transcript in memory."""

    def __init__(self, *, delay: float = 0.0) -> None:
        self.delay = delay
        self.calls: Counter[str] = Counter()
        self._outbound: dict[tuple[str, str], list[tuple[int, OutboundEntry]]] = {}
        self._transcript: list[TranscriptRow] = []
        self._seq = 0

    async def _tick(self, name: str) -> None:
        self.calls[name] += 1
        if self.delay:
            await trio.sleep(self.delay)
        else:
            await trio.lowlevel.checkpoint()

    # -- outbound index ---------------------------------------------------------------------

    async def add_outbound(
        self, bot: str, conversation_id: str, entry: OutboundEntry, *, now: float
    ) -> None:
        await self._tick("add_outbound")
        self._seq += 1
        entry = OutboundEntry(
            message_ids=list(entry.message_ids),
            text=entry.text[:OUTBOUND_TEXT_MAX],
            sent_at=entry.sent_at,
            completed_at=entry.completed_at,
        )
        rows = self._outbound.setdefault((bot, conversation_id), [])
        rows.append((self._seq, entry))
        rows.sort(key=lambda r: (r[1].sent_at, r[0]), reverse=True)
        del rows[OUTBOUND_CAP:]
        rows[:] = [r for r in rows if r[1].completed_at >= now - OUTBOUND_MAX_AGE_S]

    async def list_outbound(
        self, bot: str, conversation_id: str, *, now: float
    ) -> list[OutboundEntry]:
        await self._tick("list_outbound")
        rows = self._outbound.get((bot, conversation_id), [])
        return [e for _, e in rows if e.completed_at >= now - OUTBOUND_MAX_AGE_S][:OUTBOUND_CAP]

    # -- transcript -------------------------------------------------------------------------

    async def append_transcript(
        self, bot: str, session_id: str, role: str, text: str, *, at: float, completed: bool
    ) -> int:
        await self._tick("append_transcript")
        self._seq += 1
        self._transcript.append(
            TranscriptRow(
                id=self._seq,
                session_id=session_id,
                role=role,
                text=text,
                at=at,
                completed=completed,
            )
        )
        return self._seq

    async def transcript_page(
        self, session_id: str, *, before_id: int | None, limit: int
    ) -> list[TranscriptRow]:
        await self._tick("transcript_page")
        if limit < 1:
            raise ValueError(f"limit must be positive, not {limit}")
        rows = [
            r
            for r in reversed(self._transcript)
            if r.session_id == session_id and (before_id is None or r.id < before_id)
        ]
        return rows[:limit]
