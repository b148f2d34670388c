"""The webhook relay of the PostgreSQL store (:class:`RelaysWebhooks`, schema 3): bodies an
instance received for a bot another instance runs, kept in arrival order until the runner
took them (a fenced write), its waiter woken by ``LISTEN``/``NOTIFY``.

On the session's throwaway cluster (:mod:`tests.pgkit`), each test in a schema of its own;
two stores opened on one URL are two instances.
"""

from __future__ import annotations

import pytest
import structlog
import trio

import dshim.store.postgres as pg_store
from dshim.errors import FencedError
from dshim.store.base import RELAY_MAX_AGE_S, BotRelay, Relayed
from dshim.store.postgres import SCHEMA_VERSION, open_postgres_store
from tests.pgkit import PgCluster
from tests.test_postgres_leases import BOT, seed, snapshot

T0 = 1_790_000_000.0


@pytest.fixture
def url(pg_cluster: PgCluster) -> str:
    return pg_cluster.fresh_url()


async def test_bodies_come_out_in_arrival_order_until_each_is_done(url: str) -> None:
    with trio.fail_after(30):
        async with open_postgres_store(url) as a, open_postgres_store(url) as b:
            first = await a.relay_put(BOT, b'{"n":1}', now=T0)
            second = await b.relay_put(BOT, b'{"n":2}', now=T0 + 1)
            await a.relay_put("other", b'{"n":3}', now=T0 + 2)
            assert first < second
            assert await b.relay_pending(BOT, limit=10) == [
                Relayed(first, b'{"n":1}'),
                Relayed(second, b'{"n":2}'),
            ]
            assert await b.relay_pending(BOT, limit=1) == [Relayed(first, b'{"n":1}')]
            lease = await b.take_lease(BOT, "b", lease_s=15)
            assert lease is not None
            await b.fenced(lease).relay_done(BOT, first)
            # Read again from the first row: what is left, nothing skipped.
            assert await a.relay_pending(BOT, limit=10) == [Relayed(second, b'{"n":2}')]
            assert [r.body for r in await a.relay_pending("other", limit=10)] == [b'{"n":3}']


async def test_a_runner_whose_lease_moved_on_cannot_take_a_body(url: str) -> None:
    with trio.fail_after(30):
        async with open_postgres_store(url) as a, open_postgres_store(url) as b:
            seq = await a.relay_put(BOT, b"body", now=T0)
            old = await a.take_lease(BOT, "a", lease_s=0)
            assert old is not None
            new = await b.take_lease(BOT, "b", lease_s=15)  # a's lease ran out: b has it
            assert new is not None and new.epoch == old.epoch + 1
            with pytest.raises(FencedError):
                await a.fenced(old).relay_done(BOT, seq)
            assert await b.relay_pending(BOT, limit=10) == [Relayed(seq, b"body")]
            await b.fenced(new).relay_done(BOT, seq)
            assert await b.relay_pending(BOT, limit=10) == []


async def test_a_put_in_another_instance_wakes_the_runner_at_once(url: str) -> None:
    """The runner (b) waits on its relay; the receiving instance (a) puts a body: b's
    listener hears the notification and b reads it, well before any poll would."""
    with trio.fail_after(30):
        async with (
            open_postgres_store(url) as a,
            open_postgres_store(url) as b,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(b.listen_relays)
            relay = BotRelay(b, BOT, lambda: T0)
            assert await relay.pending(10) == []
            # The listener needs to be listening before the put (it wakes every waiter
            # once when it connects: that wake-up is taken here).
            with trio.fail_after(10):
                await relay.wait()
            assert await relay.pending(10) == []
            woken = trio.Event()

            async def runner() -> None:
                await relay.wait()
                woken.set()

            nursery.start_soon(runner)
            await trio.sleep(0.3)
            assert not woken.is_set()
            started = trio.current_time()
            await a.relay_put(BOT, b"hello", now=T0)
            with trio.fail_after(5):
                await woken.wait()
            assert trio.current_time() - started < pg_store.LISTEN_POLL_S * 3
            assert [r.body for r in await relay.pending(10)] == [b"hello"]
            # A put between a read and the next wait is not lost: the wait returns at once.
            await a.relay_put(BOT, b"again", now=T0)
            await trio.sleep(0.5)
            with trio.fail_after(1):
                await relay.wait()
            nursery.cancel_scope.cancel()


async def test_bodies_nobody_took_for_a_week_are_pruned(url: str) -> None:
    with trio.fail_after(30):
        async with open_postgres_store(url) as store:
            await store.relay_put(BOT, b"old", now=T0)
            await store.relay_put(BOT, b"new", now=T0 + RELAY_MAX_AGE_S - 60)
            await store.prune(now=T0 + RELAY_MAX_AGE_S + 1)
            assert [r.body for r in await store.relay_pending(BOT, limit=10)] == [b"new"]


async def test_a_schema_2_database_with_data_gets_the_relay_and_keeps_its_rows(
    pg_cluster: PgCluster, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert SCHEMA_VERSION >= 3
    monkeypatch.setattr(pg_store, "MIGRATIONS", pg_store.MIGRATIONS[:2])
    monkeypatch.setattr(pg_store, "SCHEMA_VERSION", 2)
    with trio.fail_after(30):
        async with open_postgres_store(url) as old:
            assert await old.schema_version() == 2
            await seed(old)
            lease = await old.take_lease(BOT, "a", lease_s=15)
        before = snapshot(pg_cluster, url)
        monkeypatch.undo()
        with structlog.testing.capture_logs() as logs:
            async with open_postgres_store(url) as store:
                assert await store.schema_version() == SCHEMA_VERSION
                assert snapshot(pg_cluster, url) == before
                assert [(x.bot, x.owner) for x in await store.leases()] == [(BOT, "a")]
                seq = await store.relay_put(BOT, b"body", now=T0)
                assert lease is not None
                await store.fenced(lease).relay_done(BOT, seq)
                assert await store.relay_pending(BOT, limit=10) == []
    [migrated] = [e for e in logs if e["event"] == "store_migrated"]
    assert (migrated["from_schema"], migrated["schema"]) == (2, SCHEMA_VERSION)
