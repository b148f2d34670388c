"""What the pipeline needs from a channel to answer: the outbound contract.

A channel implements :class:`Outbound`.  The pipeline never formats platform payloads; it
hands over plain text and gets back :class:`~dshim.model.Delivered` records that it writes
to the outbound index and the transcript.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Protocol

from dshim.model import Delivered, ReplyTarget

#: Called (awaited) once, before anything of an answer may reach the user.
DeliveryHook = Callable[[], Awaitable[None]]


class ReplyStream(Protocol):
    """One streamed answer.  Opened when the turn starts, finished exactly once.

    ``update`` receives the whole answer so far (not a delta); the channel paces edits
    and may skip intermediate texts.  ``finish`` delivers the complete final text, splits
    it per the platform's limits, and returns every delivered message.  If the context
    manager exits without ``finish`` (cancellation, failure), the channel cleans up what it
    showed (e.g. stops typing) but must not raise.

    Optional member (looked up with :func:`watch_delivery`, so streams without it still
    satisfy the protocol): ``watch_delivery(hook)`` — the stream awaits ``hook()`` once,
    right before its first platform call that can show the user any of this answer (the
    first send; a typing indicator does not count).  The pipeline uses it to record,
    durably and before the fact, that a turn may have shown something: after a crash such
    a turn gets a notice instead of a second answer, and a turn that showed nothing runs
    again.  :class:`dshim.render.EditStream` implements it.  A stream without it is taken to
    show something from its first ``update``, ``progress`` or ``finish`` on.
    """

    async def update(self, text: str) -> None: ...

    async def progress(self, note: str) -> None: ...

    async def finish(self, text: str) -> list[Delivered]: ...


class Outbound(Protocol):
    """A channel's sending side, as the pipeline sees it."""

    #: The platform's own name for the bot (e.g. Telegram ``username``), for ``/cmd@name``.
    bot_username: str | None

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        """Send a complete text (notices, command replies), split if needed."""
        ...

    def open_stream(self, target: ReplyTarget) -> AbstractAsyncContextManager[ReplyStream]:
        """Start a streamed answer to ``target`` (typing indicator until the first text)."""
        ...


def watch_delivery(stream: ReplyStream, hook: DeliveryHook) -> bool:
    """Ask ``stream`` to await ``hook`` before its first send; False when it cannot tell."""
    watch = getattr(stream, "watch_delivery", None)
    if watch is None:
        return False
    watch(hook)
    return True
