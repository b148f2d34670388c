"""The durable outbox, on both backends: an undelivered answer and its inbox entry stay
together across a reopen until the answer (or a notice) is delivered."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from tests.pgkit import BACKENDS, StoreBackend

T0 = 1_790_000_000.0


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> StoreBackend:
    cluster = request.getfixturevalue("pg_cluster") if request.param == "postgres" else None
    return StoreBackend(request.param, tmp_path, cluster)


async def test_an_undelivered_answer_outlives_a_reopen_and_leaves_with_its_entry(
    backend: StoreBackend,
) -> None:
    with trio.fail_after(30):
        async with backend.open() as store:
            assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=600, raw=b"Nraw-1")
            assert await store.accept("bot", "c1", "m2", now=T0, ttl_s=600, raw=b"Nraw-2")
            await store.outbox_put("bot", "c1", "m1", "the answer", now=T0 + 5)
        async with backend.open() as store:
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


async def test_a_second_outbox_put_replaces_the_text(backend: StoreBackend) -> None:
    with trio.fail_after(30):
        async with backend.open() as store:
            assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=600, raw=b"r")
            await store.outbox_put("bot", "c1", "m1", "first", now=T0 + 1)
            await store.outbox_put("bot", "c1", "m1", "second", now=T0 + 2)
            [entry] = await store.outbox_pending("bot")
            assert (entry.text, entry.created_at) == ("second", T0 + 2)
            # An answer whose inbox entry is gone still comes back, without its raw event.
            await store.inbox_done("bot", "c1", "m1")
            [entry] = await store.outbox_pending("bot")
            assert entry.raw is None
