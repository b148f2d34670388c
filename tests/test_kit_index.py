"""The message index of both directions as a channel uses it: record an accepted user
message, find it again by any of its ids through the bot's bound store, and build the
quote snapshot from it."""

from __future__ import annotations

from pathlib import Path

from dshim.channels.base import OutboundEntry
from dshim.channels.kit.index import inbound_entry, reference_from
from dshim.model import Attachment, InboundMessage, MediaRef
from dshim.reply import normalize
from dshim.store.base import BoundStore
from dshim.store.sqlite import open_sqlite_store

T0 = 1_700_000_000.0


def message() -> InboundMessage:
    return InboundMessage(
        channel="qq",
        bot_id="b",
        message_id="m-1",
        conversation_id="c2c:u1",
        conversation_type="direct",
        sender_id="u1",
        sender_name="Ann",
        content="see the log",
        images=[MediaRef(name="shot.png")],
        files=[MediaRef(kind="file", name="app.log")],
    )


async def test_an_accepted_message_is_found_by_each_of_its_ids(tmp_path: Path) -> None:
    async with open_sqlite_store(tmp_path / "s.sqlite3") as store:
        bound = BoundStore(store, "qqbot")
        await bound.record_outbound(
            "c2c:u1", inbound_entry(message(), at=T0, extra_ids=["REFIDX_9"]), now=T0
        )
        for key in ("m-1", "REFIDX_9"):
            [found] = await bound.indexed("c2c:u1", key, now=T0 + 60)
            ref = reference_from([found], message_id=key, bot_id="b")
            assert ref is not None
            q = normalize(ref)
            assert (q.author_id, q.author_name, q.content) == ("u1", "Ann", "see the log")
            assert q.attachments == (("image", "shot.png"), ("file", "app.log"))
        assert await bound.indexed("c2c:u2", "m-1", now=T0) == []  # another conversation
        assert await bound.update_outbound("c2c:u1", "REFIDX_9", now=T0, state="deleted")
        [gone] = await bound.indexed("c2c:u1", "m-1", now=T0)
        ref = reference_from([gone], message_id="m-1", bot_id="b")
        assert ref is not None and normalize(ref).unavailable_reason == "deleted"


def test_reference_from_none_several_and_the_bots_own() -> None:
    own = OutboundEntry(message_ids=["x"], text="answer", sent_at=T0, completed_at=T0)
    assert reference_from([], message_id="x", bot_id="b") is None
    several = reference_from([own, own], message_id="x", bot_id="b")
    assert several is not None and normalize(several).unavailable_reason == "not-delivered"
    mine = reference_from([own], message_id="x", bot_id="b")
    assert mine is not None
    assert (normalize(mine).author_id, normalize(mine).content) == ("b", "answer")
    entry = inbound_entry(message(), at=T0)
    assert entry.attachments == [
        Attachment(kind="image", name="shot.png"),
        Attachment(kind="file", name="app.log"),
    ]
