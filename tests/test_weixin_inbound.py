"""WeChat's receiving side (``channel.IndexingInbound``) over a ``getupdates`` page: one
``accept_many`` for the page, then each accepted message's context token and index entry
— a sender's in order, nothing for what the pipeline did not take."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import trio

from dshim.channels.weixin import channel
from dshim.channels.weixin.protocol import ContextToken, Route
from dshim.model import InboundMessage, Skip, Verdict
from tests.helpers import T0, msg

Event = tuple[InboundMessage | Skip, bytes | None]


class Runtime:
    """The runtime's side: verdicts by message id (accepted unless told otherwise)."""

    def __init__(self, verdicts: dict[str, Verdict]) -> None:
        self.verdicts = verdicts
        self.calls: list[list[str]] = []

    def _verdict(self, item: InboundMessage | Skip) -> Verdict:
        return self.verdicts.get(item.message_id, Verdict(True))

    async def accept(self, item: InboundMessage | Skip, raw: bytes | None = None) -> Verdict:
        self.calls.append([item.message_id])
        await trio.lowlevel.checkpoint()
        return self._verdict(item)

    async def accept_many(self, events: Sequence[Event]) -> list[Verdict]:
        self.calls.append([item.message_id for item, _ in events])
        await trio.lowlevel.checkpoint()
        return [self._verdict(item) for item, _ in events]


class OneByOne:
    """A runtime that takes one event at a time only."""

    def __init__(self, verdicts: dict[str, Verdict]) -> None:
        self._rt = Runtime(verdicts)
        self.calls = self._rt.calls

    async def accept(self, item: InboundMessage | Skip, raw: bytes | None = None) -> Verdict:
        return await self._rt.accept(item, raw)


class Book:
    """The context book's side: the tokens observed, in the order they were."""

    def __init__(self) -> None:
        self.observed: list[tuple[str, int | None]] = []

    async def observe(self, user: str, token: ContextToken, *, at: float | None = None) -> bool:
        # A slow first write must not let the sender's next token pass it.
        await trio.sleep(0.01 if token.seq == 1 else 0)
        self.observed.append((user, token.seq))
        return True


class Index:
    """The store's side: the message index entries, in the order they were written."""

    def __init__(self) -> None:
        self.recorded: list[tuple[str, str]] = []

    async def record_outbound(self, conversation_id: str, entry: Any, *, now: float) -> None:
        await trio.lowlevel.checkpoint()
        self.recorded.append((conversation_id, entry.message_ids[0]))


def direct(user: str, mid: str, seq: int) -> InboundMessage:
    return msg(
        f"text {mid}",
        message_id=mid,
        conversation_id=user,
        sender_id=user,
        route=Route(context=ContextToken(f"ctx-{mid}", seq, None)),
    )


def page() -> list[Event]:
    return [
        (direct("ada", "a1", 1), b"{}"),
        (direct("bob", "b1", 1), b"{}"),
        (direct("ada", "a2", 2), b"{}"),
        (direct("bob", "dup", 9), b"{}"),  # a redelivery: the store knew its key
        (direct("eve", "e1", 5), b"{}"),  # denied at step 4
        (Skip(reason="malformed", message_id="x"), None),
        (direct("ada", "a3", 3), b"{}"),
    ]


VERDICTS = {"dup": Verdict(False, "duplicate"), "e1": Verdict(True, "denied")}


async def test_a_page_is_one_accept_many_then_each_senders_tokens_in_order(
    autojump_clock: object,
) -> None:
    rt, book, index = Runtime(dict(VERDICTS)), Book(), Index()
    inbound = channel.IndexingInbound(rt, index, lambda: T0, book)  # type: ignore[arg-type]
    verdicts = await inbound.accept_many(page())
    assert rt.calls == [["a1", "b1", "a2", "dup", "e1", "x", "a3"]]
    assert [v.reason for v in verdicts] == [None, None, None, "duplicate", "denied", None, None]
    # ada's tokens in her order (her slow first write held the rest back), bob's beside.
    assert [seq for user, seq in book.observed if user == "ada"] == [1, 2, 3]
    assert sorted(book.observed) == [("ada", 1), ("ada", 2), ("ada", 3), ("bob", 1)]
    # A denied message is indexed but moves no token; a duplicate does neither.
    assert [mid for conv, mid in index.recorded if conv == "ada"] == ["a1", "a2", "a3"]
    assert sorted(index.recorded) == [
        ("ada", "a1"),
        ("ada", "a2"),
        ("ada", "a3"),
        ("bob", "b1"),
        ("eve", "e1"),
    ]


async def test_without_accept_many_the_page_is_accepted_one_by_one(
    autojump_clock: object,
) -> None:
    rt, book, index = OneByOne(dict(VERDICTS)), Book(), Index()
    inbound = channel.IndexingInbound(rt, index, lambda: T0, book)  # type: ignore[arg-type]
    verdicts = await inbound.accept_many(page())
    assert rt.calls == [["a1"], ["b1"], ["a2"], ["dup"], ["e1"], ["x"], ["a3"]]
    assert [v.reason for v in verdicts] == [None, None, None, "duplicate", "denied", None, None]
    assert book.observed == [("ada", 1), ("bob", 1), ("ada", 2), ("ada", 3)]
    assert [mid for _, mid in index.recorded] == ["a1", "b1", "a2", "e1", "a3"]
