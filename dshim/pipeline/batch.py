"""Step 5, batch input: ``/batch`` collects a direct chat's messages, ``/send`` submits them
as one prompt, ``/cancel`` discards them.

Pure state and decisions, no I/O: :class:`Batches` says what to answer and what to run;
the runtime sends the answer, finishes the message's inbox entry and queues the turn.
Only the current input counts — the runtime never hands a command here that came from a
quote or a forward, and a message that quotes something, carries media or was
forwarded is refused instead of collected.  A batch lives in memory only: a restart
discards it (each collected message was answered "collected" already).
"""

from __future__ import annotations

from dataclasses import dataclass

from dshim.model import InboundMessage

__all__ = ["Batch", "Batches", "Step"]

LaneKey = tuple[str, str]

#: Messages one batch collects at most.
BATCH_LIMIT = 10

BATCH_REFUSED_MEDIA = (
    "Batch mode collects text only: images, files or quoted messages are not collected. "
    "Send more text, /send to submit or /cancel to discard."
)


BATCH_REFUSED_FORWARD = (
    "Batch mode collects what you type: forwarded messages are not collected. "
    "Send more text, /send to submit or /cancel to discard."
)


class Batch:
    """The texts collected so far in one conversation."""

    __slots__ = ("texts",)

    def __init__(self) -> None:
        self.texts: list[str] = []


@dataclass(frozen=True, slots=True)
class Step:
    """What to do with a message the batch logic handled.

    ``reply``: answer the message with this text.  ``submit``: run the collected texts as
    one turn (``/send``).  Either way the message itself is finished.
    """

    reply: str | None = None
    submit: tuple[str, ...] = ()


class Batches:
    """The open batches of one bot, by conversation lane."""

    def __init__(self) -> None:
        self._open: dict[LaneKey, Batch] = {}

    def get(self, key: LaneKey) -> Batch | None:
        """The batch being collected in a conversation, if any."""
        return self._open.get(key)

    def command(self, msg: InboundMessage, name: str) -> Step:
        """``/batch``, ``/send`` or ``/cancel`` typed by the user."""
        key = msg.lane_key
        batch = self._open.get(key)
        if msg.conversation_type != "direct":
            return Step(reply="/batch, /send and /cancel work in direct chats only.")
        if name == "batch":
            if batch is not None:
                return Step(
                    reply=f"Already collecting: {len(batch.texts)} message(s). /send or /cancel."
                )
            self._open[key] = Batch()
            return Step(
                reply=f"Collecting messages (up to {BATCH_LIMIT}). Send /send to submit them as one prompt, /cancel to discard."
            )
        if name == "cancel":
            if batch is None:
                return Step(reply="No batch in progress.")
            del self._open[key]
            return Step(reply=f"Batch discarded ({len(batch.texts)} message(s)).")
        if name != "send":  # pragma: no cover - the runtime routes only these three
            raise AssertionError(name)
        if batch is None:
            return Step(reply="No batch in progress. Send /batch to start one.")
        if not batch.texts:
            return Step(reply="The batch is empty: send some messages first, or /cancel.")
        del self._open[key]
        return Step(submit=tuple(batch.texts))

    def collect(self, msg: InboundMessage, batch: Batch) -> Step:
        """A message that is not a command while a batch is open."""
        if msg.images or msg.files or msg.reply_to is not None:
            return Step(reply=BATCH_REFUSED_MEDIA)
        if msg.forwarded:
            return Step(reply=BATCH_REFUSED_FORWARD)
        text = msg.content.strip()
        if not text:
            return Step()
        if len(batch.texts) >= BATCH_LIMIT:
            return Step(
                reply=f"The batch is full ({BATCH_LIMIT} messages): this one was not added. /send or /cancel."
            )
        batch.texts.append(text)
        if len(batch.texts) == BATCH_LIMIT:
            return Step(
                reply=f"The batch is full ({BATCH_LIMIT} messages). Send /send to submit or /cancel."
            )
        return Step()
