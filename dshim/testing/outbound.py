"""A recording :class:`~dshim.outbound.Outbound`: delivers nowhere, remembers what it sent.

Used by replay and by pipeline tests.  Message ids are ``out-1``, ``out-2`` ... in order.
Tests keep every intermediate text of a stream (``keep_updates=True``, the default);
replay keeps only the count and the final texts, so memory stays linear in the answer's
length however often a long answer is updated.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import msgspec

from dshim.model import Delivered, ReplyTarget


class Sent(msgspec.Struct, frozen=True, kw_only=True):
    target: ReplyTarget
    message_id: str
    text: str
    #: Intermediate texts shown while streaming (empty for plain sends).
    updates: tuple[str, ...] = ()


def no_split(text: str) -> list[str]:
    return [text]


class RecordingStream:
    def __init__(self, outbound: RecordingOutbound, target: ReplyTarget, *, keep: bool) -> None:
        self._outbound = outbound
        self._target = target
        self._keep = keep
        #: Every intermediate text (only with ``keep_updates``).
        self.updates: list[str] = []
        self.update_count = 0
        self.progress_notes: list[str] = []
        self.finished = False

    async def update(self, text: str) -> None:
        self.update_count += 1
        if self._keep:
            self.updates.append(text)

    async def progress(self, note: str) -> None:
        if self._keep:
            self.progress_notes.append(note)

    async def finish(self, text: str) -> list[Delivered]:
        assert not self.finished, "finish() called twice"
        self.finished = True
        return self._outbound.deliver(self._target, text, tuple(self.updates))


class RecordingOutbound:
    """Records sends; ``on_send`` is called once per delivered message."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        split: Callable[[str], list[str]] = no_split,
        bot_username: str | None = None,
        on_send: Callable[[Sent], None] | None = None,
        keep_updates: bool = True,
    ) -> None:
        self.clock = clock
        self.keep_updates = keep_updates
        self.split = split
        self.bot_username = bot_username
        self.on_send = on_send
        self.sent: list[Sent] = []
        self.streams: list[RecordingStream] = []
        self._next_id = 1

    def deliver(
        self, target: ReplyTarget, text: str, updates: tuple[str, ...] = ()
    ) -> list[Delivered]:
        """Record ``text`` as delivered (split like the channel would)."""
        out: list[Delivered] = []
        for chunk in self.split(text):
            mid = f"out-{self._next_id}"
            self._next_id += 1
            now = self.clock()
            sent = Sent(target=target, message_id=mid, text=chunk, updates=updates)
            self.sent.append(sent)
            if self.on_send is not None:
                self.on_send(sent)
            out.append(Delivered(message_id=mid, text=chunk, sent_at=now, completed_at=now))
        return out

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        return self.deliver(target, text)

    @asynccontextmanager
    async def open_stream(self, target: ReplyTarget) -> AsyncIterator[RecordingStream]:
        stream = RecordingStream(self, target, keep=self.keep_updates)
        self.streams.append(stream)
        yield stream
