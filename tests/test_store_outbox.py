"""The durable outbox in the SQLite store: an undelivered answer and its inbox entry stay
together across a reopen until the answer (or a notice) is delivered."""

from __future__ import annotations

from pathlib import Path

import trio

from dshim.store import open_store

T0 = 1_790_000_000.0


async def test_an_undelivered_answer_outlives_a_reopen_and_leaves_with_its_entry(
    tmp_path: Path,
) -> None:
    with trio.fail_after(30):
        async with open_store(tmp_path) as store:
            assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=600, raw=b"Nraw-1")
            assert await store.accept("bot", "c1", "m2", now=T0, ttl_s=600, raw=b"Nraw-2")
            await store.outbox_put("bot", "c1", "m1", "the answer", now=T0 + 5)
        async with open_store(tmp_path) as store:
            [entry] = await store.outbox_pending("bot")
            assert (entry.message_id, entry.text, entry.raw) == ("m1", "the answer", b"Nraw-1")
            assert entry.created_at == T0 + 5
            states = {e.message_id: e.state for e in await store.inbox_pending("bot")}
            assert states == {"m1": "undelivered", "m2": "queued"}
            assert await store.outbox_pending("other") == []
            await store.outbox_done("bot", "c1", "m1")
            assert await store.outbox_pending("bot") == []
            assert [e.message_id for e in await store.inbox_pending("bot")] == ["m2"]
            # Still deduplicated: a redelivery of the answered message is not new.
            assert not await store.accept("bot", "c1", "m1", now=T0 + 10, ttl_s=600, raw=None)
