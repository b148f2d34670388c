"""Leases, heartbeats and fencing of the PostgreSQL store (:class:`SharesBots`).

On the session's throwaway cluster (:mod:`tests.pgkit`), each test in a schema of its own.
Two stores opened on one URL are two instances (two pools).  A second, plain connection
holds locks and rows in open transactions to make a write or a takeover wait, and watches
``pg_stat_activity`` to see who waits for whom.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager, closing
from pathlib import Path
from typing import Any

import pytest
import structlog
import trio

import dshim.store.postgres as pg_store
from dshim.errors import FencedError, StoreError
from dshim.store import open_store
from dshim.store.base import (
    Lease,
    LoggedMessage,
    OutboundEntry,
    PromptRow,
    SharesBots,
    Store,
    TurnRecord,
)
from dshim.store.postgres import SCHEMA_VERSION, PostgresStore, open_postgres_store
from tests.pgkit import PgCluster

T0 = 1_790_000_000.0
BOT = "bot"
#: The tables a bot's writes go to (the leases and heartbeats aside).
DATA_TABLES = (
    "anchors",
    "bindings",
    "cursors",
    "dedup",
    "inbox",
    "inbox_state",
    "last_direct",
    "messages",
    "outbound",
    "outbox",
    "transcript",
)


@pytest.fixture
def url(pg_cluster: PgCluster) -> str:
    return pg_cluster.fresh_url()


@asynccontextmanager
async def opened(url: str) -> AsyncIterator[PostgresStore]:
    async with open_postgres_store(url) as store:
        yield store


def db_now(cluster: PgCluster, url: str) -> float:
    return float(cluster.query(url, f"SELECT {pg_store.DB_NOW}")[0][0])


def snapshot(cluster: PgCluster, url: str) -> dict[str, list[str]]:
    """Every row of the data tables (as text, sorted)."""
    return {
        t: sorted(repr(row) for row in cluster.query(url, f"SELECT * FROM {t}"))
        for t in DATA_TABLES
    }


async def waiting(cluster: PgCluster, url: str, statement: str) -> None:
    """Until a session waits for a lock in a statement containing ``statement``."""
    while True:
        [(count,)] = cluster.query(
            url,
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE wait_event_type = 'Lock' AND query LIKE %s",
            (f"%{statement}%",),
        )
        if count:
            return
        await trio.sleep(0.02)


def entry(mid: str, at: float) -> OutboundEntry:
    return OutboundEntry(
        message_ids=[mid, f"{mid}-alt"], text=f"answer {mid}", sent_at=at, completed_at=at
    )


def logged(mid: str, at: float) -> LoggedMessage:
    return LoggedMessage(message_id=mid, author_id="u1", author_name="Ann", text="hi", at=at)


async def seed(store: Store) -> None:
    """A bot with something of everything, so updates and deletes would change rows."""
    assert await store.accept(BOT, "c1", "m1", now=T0, ttl_s=600, raw=b"r1")
    assert await store.accept(BOT, "c1", "m2", now=T0, ttl_s=600, raw=b"r2")
    await store.outbox_put(BOT, "c1", "m2", "undelivered answer", now=T0)
    await store.set_binding(BOT, "c1", "", "s1", title="chat", now=T0)
    await store.set_cursor(BOT, "offset", "41")
    await store.add_outbound(BOT, "c1", entry("b1", T0), now=T0)
    await store.put_anchor(BOT, "c1", "", "turn0", "a0", now=T0, keep=5)
    assert await store.log_message(BOT, "c1", logged("w1", T0), now=T0)
    await store.append_transcript(BOT, "s1", "user", "hello", at=T0, completed=True)
    await store.set_last_direct(BOT, "c1", now=T0)


Write = Callable[[Store, str], Awaitable[object]]

#: Every write of the Store protocol (some twice: where it may legitimately write nothing),
#: with arguments as the pipeline and the channels give them.  The second argument is the
#: bot the write is for.
WRITES: dict[str, Write] = {
    "accept": lambda s, b: s.accept(b, "c1", "m9", now=T0 + 1, ttl_s=600, raw=b"r9"),
    "accept a duplicate": lambda s, b: s.accept(b, "c1", "m1", now=T0 + 1, ttl_s=600, raw=b"x"),
    "accept a key only": lambda s, b: s.accept(b, "c1", "m9", now=T0 + 1, ttl_s=600, raw=None),
    "accept_many": lambda s, b: s.accept_many(
        b, [("c1", "m9", b"r9"), ("c1", "m1", b"x")], now=T0 + 1, ttl_s=600
    ),
    "inbox_set_state running": lambda s, b: s.inbox_set_state(b, "c1", "m1", "running"),
    "inbox_set_state queued": lambda s, b: s.inbox_set_state(b, "c1", "m2", "queued"),
    "outbox_put": lambda s, b: s.outbox_put(b, "c1", "m1", "final text", now=T0 + 1),
    "outbox_done": lambda s, b: s.outbox_done(b, "c1", "m2"),
    "inbox_resumed": lambda s, b: s.inbox_resumed(b, "c1", "m1"),
    "inbox_done": lambda s, b: s.inbox_done(b, "c1", "m1"),
    "inbox_done of nothing": lambda s, b: s.inbox_done(b, "c1", "gone"),
    "begin_turn": lambda s, b: s.begin_turn(b, "c1", "", [("c1", "m1")], last_direct=("c2", T0)),
    "begin_turn without keys": lambda s, b: s.begin_turn(b, "c9", "", []),
    "begin_turn with a key twice": lambda s, b: s.begin_turn(
        b, "c1", "", [("c1", "m1"), ("c1", "m1")]
    ),
    "mark_delivered": lambda s, b: s.mark_delivered(
        b, [("c1", "m1")], prompt=PromptRow(session_id="s1", text="hi", at=T0 + 1)
    ),
    "mark_delivered without a prompt": lambda s, b: s.mark_delivered(
        b, [("c1", "m1")], prompt=None
    ),
    "record_turn": lambda s, b: s.record_turn(
        b,
        "c1",
        TurnRecord(
            session_id="s1",
            user_text="hi",
            user_at=T0 + 1,
            answer_text="hello",
            answer_at=T0 + 2,
            completed=True,
            delivered=[entry("b2", T0 + 2)],
            inbox_done=[("c1", "m1")],
        ),
        now=T0 + 2,
    ),
    "set_binding": lambda s, b: s.set_binding(b, "c1", "", "s2", title=None, now=T0 + 1),
    "clear_binding": lambda s, b: s.clear_binding(b, "c1", ""),
    "set_cursor": lambda s, b: s.set_cursor(b, "offset", "42"),
    "add_outbound": lambda s, b: s.add_outbound(b, "c1", entry("b2", T0 + 1), now=T0 + 1),
    "update_outbound": lambda s, b: s.update_outbound(
        b, "c1", "b1", now=T0 + 1, text="edited", add_ids=["card-1"], state="deleted"
    ),
    "put_anchor": lambda s, b: s.put_anchor(b, "c1", "", "turn1", "a1", now=T0 + 1, keep=5),
    "log_message": lambda s, b: s.log_message(b, "c1", logged("w2", T0 + 1), now=T0 + 1),
    "log_message already there": lambda s, b: s.log_message(
        b, "c1", logged("w1", T0 + 1), now=T0 + 1
    ),
    "append_transcript": lambda s, b: s.append_transcript(
        b, "s1", "assistant", "answer", at=T0 + 1, completed=True
    ),
    "set_last_direct": lambda s, b: s.set_last_direct(b, "c2", now=T0 + 1),
}


# -- the protocol ------------------------------------------------------------------------------


async def test_the_postgresql_store_shares_bots_and_sqlite_does_not(
    url: str, tmp_path: Path
) -> None:
    with trio.fail_after(30):
        async with opened(url) as store:
            assert isinstance(store, SharesBots)
            lease = await store.take_lease(BOT, "a", lease_s=15)
            assert lease is not None
            assert await store.fenced(lease).schema_version() == SCHEMA_VERSION
        async with open_store(tmp_path) as sqlite:
            assert not isinstance(sqlite, SharesBots)


# -- take, renew, release ----------------------------------------------------------------------


async def test_take_renew_and_release_follow_owner_epoch_and_the_databases_clock(
    pg_cluster: PgCluster, url: str
) -> None:
    with trio.fail_after(30):
        async with opened(url) as store:
            before = db_now(pg_cluster, url)
            a = await store.take_lease(BOT, "a", lease_s=15)
            after = db_now(pg_cluster, url)
            assert a is not None and (a.bot, a.owner, a.epoch) == (BOT, "a", 1)
            assert before + 15 <= a.expires_at <= after + 15
            # Held: another owner gets nothing; the holder renews it, same epoch.
            assert await store.take_lease(BOT, "b", lease_s=15) is None
            again = await store.take_lease(BOT, "a", lease_s=15)
            assert again is not None and again.epoch == 1 and again.expires_at >= a.expires_at
            renewed = await store.renew_lease(a, lease_s=60)
            assert renewed is not None and (renewed.owner, renewed.epoch) == ("a", 1)
            assert renewed.expires_at >= after + 60
            # Only the owner with the current epoch renews or releases.
            assert (
                await store.renew_lease(
                    Lease(bot=BOT, owner="b", epoch=1, expires_at=0), lease_s=60
                )
                is None
            )
            assert (
                await store.renew_lease(
                    Lease(bot=BOT, owner="a", epoch=2, expires_at=0), lease_s=60
                )
                is None
            )
            assert (
                await store.renew_lease(
                    Lease(bot="other", owner="a", epoch=1, expires_at=0), lease_s=60
                )
                is None
            )
            await store.release_lease(Lease(bot=BOT, owner="b", epoch=1, expires_at=0))
            assert await store.leases() == [renewed]
            # Released: it expires now and the next taker gets the next epoch.
            await store.release_lease(renewed)
            [released] = await store.leases()
            assert (released.owner, released.epoch) == ("a", 1)
            assert released.expires_at <= db_now(pg_cluster, url)
            b = await store.take_lease(BOT, "b", lease_s=15)
            assert b is not None and (b.owner, b.epoch) == ("b", 2)
            # The old holder can neither renew nor release it now.
            assert await store.renew_lease(renewed, lease_s=15) is None
            await store.release_lease(renewed)
            assert await store.leases() == [b]
            assert await store.take_lease(BOT, "a", lease_s=15) is None


async def test_an_expired_lease_is_taken_over_with_the_next_epoch(
    pg_cluster: PgCluster, url: str
) -> None:
    with trio.fail_after(30):
        async with opened(url) as store:
            a = await store.take_lease(BOT, "a", lease_s=0.3)
            assert a is not None and a.epoch == 1
            assert await store.take_lease(BOT, "b", lease_s=15) is None
            await trio.sleep(max(0.0, a.expires_at - db_now(pg_cluster, url)) + 0.05)
            b = await store.take_lease(BOT, "b", lease_s=15)
            assert b is not None and (b.owner, b.epoch) == ("b", 2)
            assert await store.renew_lease(a, lease_s=15) is None
            # The owner taking back its own lease after it ran out starts a new epoch too.
            await store.release_lease(b)
            b3 = await store.take_lease(BOT, "b", lease_s=15)
            assert b3 is not None and b3.epoch == 3


async def test_a_lease_that_ran_out_is_renewed_while_nobody_took_it(
    pg_cluster: PgCluster, url: str
) -> None:
    """The chosen reading: renewing needs owner and epoch, not time (the epoch did not
    move, so no other instance ran the bot); its writes never stopped being valid."""
    with trio.fail_after(30):
        async with opened(url) as store:
            a = await store.take_lease(BOT, "a", lease_s=0)
            assert a is not None and a.expires_at <= db_now(pg_cluster, url)
            await store.fenced(a).set_cursor(BOT, "offset", "1")
            renewed = await store.renew_lease(a, lease_s=15)
            assert renewed is not None and renewed.epoch == 1
            assert renewed.expires_at > db_now(pg_cluster, url) + 10
            assert await store.take_lease(BOT, "b", lease_s=15) is None


async def test_two_instances_racing_for_free_and_expired_leases_get_one_winner_each(
    pg_cluster: PgCluster, url: str
) -> None:
    bots = [f"bot{i}" for i in range(20)]
    with trio.fail_after(60):
        async with opened(url) as a, opened(url) as b:
            for epoch in (1, 2):
                won: dict[str, set[tuple[str, int]]] = {}

                async def take(
                    won: dict[str, set[tuple[str, int]]], name: str, store: PostgresStore, bot: str
                ) -> None:
                    lease = await store.take_lease(bot, name, lease_s=30)
                    if lease is not None:
                        won.setdefault(bot, set()).add((lease.owner, lease.epoch))

                async with trio.open_nursery() as nursery:
                    for i, bot in enumerate(bots):
                        pair = (("a", a), ("b", b)) if i % 2 else (("b", b), ("a", a))
                        for _ in range(2):
                            for name, store in pair:
                                nursery.start_soon(take, won, name, store, bot)
                assert sorted(won) == sorted(bots)
                assert all(len(holders) == 1 for holders in won.values()), won
                assert {e for holders in won.values() for _, e in holders} == {epoch}
                leases = await b.leases()
                assert {(x.bot, x.owner, x.epoch) for x in leases} == {
                    (bot, owner, e) for bot, holders in won.items() for owner, e in holders
                }
                # Every lease runs out at once: the next round races for expired ones.
                pg_cluster.query(url, "UPDATE leases SET expires_at = 0")


# -- fencing -----------------------------------------------------------------------------------


@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
async def test_the_holders_view_writes_and_the_old_holders_view_is_fenced(
    pg_cluster: PgCluster, url: str, write: str
) -> None:
    with trio.fail_after(30):
        async with opened(url) as store:
            old = await store.take_lease(BOT, "a", lease_s=0)
            assert old is not None
            await seed(store.fenced(old))  # the old holder wrote all this while it held it
            new = await store.take_lease(BOT, "b", lease_s=15)
            assert new is not None and new.epoch == old.epoch + 1
            before = snapshot(pg_cluster, url)
            stale = store.fenced(old)
            with pytest.raises(FencedError) as refused:
                await WRITES[write](stale, BOT)
            message = str(refused.value)
            assert "'bot'" in message and "epoch 1" in message
            assert "postgresql" not in message and "127.0.0.1" not in message
            assert snapshot(pg_cluster, url) == before  # nothing written
            # Reads through the old view still work; the new holder's view writes.
            assert len(await stale.inbox_pending(BOT)) == 2
            assert await stale.get_cursor(BOT, "offset") == "41"
            await WRITES[write](store.fenced(new), BOT)


@pytest.mark.parametrize("write", list(WRITES), ids=list(WRITES))
async def test_a_fenced_view_refuses_another_bots_write(url: str, write: str) -> None:
    with trio.fail_after(30):
        async with opened(url) as store:
            lease = await store.take_lease(BOT, "a", lease_s=15)
            assert lease is not None
            with pytest.raises(ValueError, match="for bot 'bot' only"):
                await WRITES[write](store.fenced(lease), "other")


async def test_the_unfenced_store_writes_whatever_the_leases(url: str) -> None:
    with trio.fail_after(30):
        async with opened(url) as store:
            await seed(store)
            assert await store.take_lease(BOT, "b", lease_s=15) is not None
            for write in WRITES.values():
                await write(store, BOT)
            assert await store.get_cursor(BOT, "offset") == "42"


async def test_results_through_a_valid_fenced_view_are_the_stores(url: str) -> None:
    """The fence changes nothing of what a write returns (duplicates, misses, ids)."""
    with trio.fail_after(30):
        async with opened(url) as store:
            lease = await store.take_lease(BOT, "a", lease_s=15)
            assert lease is not None
            view = store.fenced(lease)
            await seed(view)
            assert not await view.accept(BOT, "c1", "m1", now=T0 + 1, ttl_s=600, raw=b"x")
            assert await view.accept_many(
                BOT, [("c1", "m9", b"r"), ("c1", "m1", b"x")], now=T0 + 1, ttl_s=600
            ) == [True, False]
            assert await view.inbox_resumed(BOT, "c1", "m1") == 0
            assert await view.inbox_resumed(BOT, "c1", "gone") == 0
            binding = await view.begin_turn(BOT, "c1", "", [("c1", "m1")])
            assert binding is not None and binding.session_id == "s1"
            assert await view.begin_turn(BOT, "c9", "", []) is None
            assert not await view.log_message(BOT, "c1", logged("w1", T0 + 1), now=T0 + 1)
            assert await view.update_outbound(BOT, "c1", "b1", now=T0 + 1, state="deleted")
            assert not await view.update_outbound(BOT, "c1", "nope", now=T0 + 1, state="deleted")
            first = await view.append_transcript(BOT, "s1", "user", "a", at=T0, completed=True)
            second = await view.append_transcript(BOT, "s1", "user", "b", at=T0, completed=True)
            assert second > first
            assert await view.clear_binding(BOT, "c1", "")
            assert not await view.clear_binding(BOT, "c1", "")
            [pending] = [e for e in await view.inbox_pending(BOT) if e.message_id == "m1"]
            assert (pending.state, pending.attempts) == ("running", 2)


async def test_the_fenced_error_never_shows_the_password(pg_cluster: PgCluster, url: str) -> None:
    secret_url = url.replace(f"{pg_cluster.user}@", f"{pg_cluster.user}:s3cret-pw@", 1)
    with trio.fail_after(30):
        async with opened(secret_url) as store:
            old = await store.take_lease(BOT, "a", lease_s=0)
            assert old is not None and await store.take_lease(BOT, "b", lease_s=15)
            with pytest.raises(FencedError) as refused:
                await store.fenced(old).set_cursor(BOT, "offset", "1")
            text = f"{refused.value!s} {refused.value!r} {refused.value.__cause__!r}"
            assert "s3cret" not in text and urllib.parse.quote("s3cret") not in text


async def test_once_fenced_a_view_refuses_every_write_without_a_round_trip(
    pg_cluster: PgCluster, url: str
) -> None:
    with trio.fail_after(30):
        async with opened(url) as store:
            old = await store.take_lease(BOT, "a", lease_s=0)
            assert old is not None and await store.take_lease(BOT, "b", lease_s=15)
            view = store.fenced(old)
            with pytest.raises(FencedError):
                await view.set_cursor(BOT, "offset", "1")
            pg_cluster.query(url, "DROP FUNCTION dshim_fence")  # a round trip would fail otherwise
            for write in WRITES.values():
                with pytest.raises(FencedError, match="'bot'"):
                    await write(view, BOT)
            assert await view.get_cursor(BOT, "offset") is None  # reads still go through


async def test_closing_a_view_leaves_the_store_open(url: str) -> None:
    with trio.fail_after(30):
        async with opened(url) as store:
            lease = await store.take_lease(BOT, "a", lease_s=15)
            assert lease is not None
            view = store.fenced(lease)
            await view.aclose()
            await view.set_cursor(BOT, "offset", "1")
            assert await store.get_cursor(BOT, "offset") == "1"
        with pytest.raises(StoreError, match="closed"):
            await view.set_cursor(BOT, "offset", "2")


# -- a takeover and a write in flight ----------------------------------------------------------

#: A write that waits for a row of a plain connection's open transaction after its fence,
#: how that connection holds the row, and the statement the write then waits in.
IN_FLIGHT: dict[str, tuple[Write, str, str]] = {
    "accept (the fence in the statement)": (
        lambda s, b: s.accept(b, "c1", "m9", now=T0, ttl_s=600, raw=b"r9"),
        "INSERT INTO dedup (bot, conversation_id, message_id, expires_at)"
        " VALUES ('bot', 'c1', 'm9', 0)",
        "INSERT INTO dedup",
    ),
    "log_message (the fence first in a transaction)": (
        lambda s, b: s.log_message(b, "c1", logged("w9", T0), now=T0),
        "INSERT INTO messages (bot, conversation_id, message_id, author_id, author_bot, text,"
        " attachments, at) VALUES ('bot', 'c1', 'w9', 'u', false, '', '[]', 0)",
        "INSERT INTO messages",
    ),
}


@pytest.mark.parametrize("case", list(IN_FLIGHT), ids=list(IN_FLIGHT))
async def test_a_takeover_waits_for_the_old_holders_write_in_flight(
    pg_cluster: PgCluster, url: str, case: str
) -> None:
    """The write holds the lease row FOR SHARE: the takeover after the expiry waits until
    it committed (so it happened before the takeover), and every later write is refused."""
    write, hold, waits_in = IN_FLIGHT[case]
    with trio.fail_after(30):
        async with opened(url) as a, opened(url) as b:
            old = await a.take_lease(BOT, "a", lease_s=0)  # expired at once
            assert old is not None
            await a.set_cursor(BOT, "offset", "1")
            with closing(pg_cluster.connect(url)) as other:
                other.execute("BEGIN")
                other.execute(hold)  # type: ignore[arg-type]
                results: dict[str, Any] = {}

                async def old_write() -> None:
                    results["write"] = await write(a.fenced(old), BOT)

                async def takeover() -> None:
                    results["lease"] = await b.take_lease(BOT, "b", lease_s=15)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(old_write)
                    await waiting(pg_cluster, url, waits_in)
                    nursery.start_soon(takeover)
                    await waiting(pg_cluster, url, "INSERT INTO leases")
                    await trio.sleep(0.2)
                    assert results == {}  # both wait: the write for the row, b for the write
                    other.execute("ROLLBACK")
            assert results["write"] is True
            lease = results["lease"]
            assert lease is not None and (lease.owner, lease.epoch) == ("b", 2)
            with pytest.raises(FencedError):
                await write(a.fenced(old), BOT)
            with pytest.raises(FencedError):
                await a.fenced(old).set_cursor(BOT, "offset", "2")
            assert await b.get_cursor(BOT, "offset") == "1"


@pytest.mark.parametrize("commit", [True, False], ids=["committed", "rolled back"])
@pytest.mark.parametrize(
    ("write", "waits_in"),
    [
        (WRITES["set_cursor"], "INSERT INTO cursors"),
        (WRITES["put_anchor"], "SELECT dshim_fence"),
    ],
    ids=["set_cursor", "put_anchor"],
)
async def test_a_write_waits_for_a_takeover_in_flight_and_is_refused_once_it_committed(
    pg_cluster: PgCluster, url: str, write: Write, waits_in: str, commit: bool
) -> None:
    with trio.fail_after(30):
        async with opened(url) as store:
            old = await store.take_lease(BOT, "a", lease_s=0)
            assert old is not None
            await seed(store)
            before = snapshot(pg_cluster, url)
            with closing(pg_cluster.connect(url)) as other:
                other.execute("BEGIN")
                other.execute("UPDATE leases SET owner = 'b', epoch = epoch + 1")
                outcome: list[BaseException | None] = []

                async def old_write() -> None:
                    try:
                        await write(store.fenced(old), BOT)
                    except FencedError as exc:
                        outcome.append(exc)
                    else:
                        outcome.append(None)

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(old_write)
                    await waiting(pg_cluster, url, waits_in)
                    await trio.sleep(0.2)
                    assert outcome == []
                    other.execute("COMMIT" if commit else "ROLLBACK")
            if commit:
                assert isinstance(outcome[0], FencedError)
                assert snapshot(pg_cluster, url) == before
            else:
                assert outcome == [None]
                assert snapshot(pg_cluster, url) != before


# -- instances ---------------------------------------------------------------------------------


async def test_heartbeats_list_the_live_instances_on_the_databases_clock(
    pg_cluster: PgCluster, url: str
) -> None:
    with trio.fail_after(30):
        async with opened(url) as a, opened(url) as b:
            assert await a.instances(within_s=60) == []
            before = db_now(pg_cluster, url)
            await a.heartbeat("host-a:1", started_at=T0)
            await b.heartbeat("host-b:2", started_at=T0 + 5)
            listed = await b.instances(within_s=60)
            assert [(i.name, i.started_at) for i in listed] == [
                ("host-a:1", T0),
                ("host-b:2", T0 + 5),
            ]
            assert all(before <= i.seen_at <= db_now(pg_cluster, url) for i in listed)
            # b's last heartbeat is two minutes old: not live within 60 s, live within 300.
            pg_cluster.query(
                url, "UPDATE instances SET seen_at = seen_at - 120 WHERE name = 'host-b:2'"
            )
            assert [i.name for i in await a.instances(within_s=60)] == ["host-a:1"]
            assert [i.name for i in await a.instances(within_s=300)] == ["host-a:1", "host-b:2"]
            await b.heartbeat("host-b:2", started_at=T0 + 5)
            [_, again] = await a.instances(within_s=60)
            assert again.name == "host-b:2" and again.seen_at >= listed[1].seen_at


# -- migration ---------------------------------------------------------------------------------


async def test_a_schema_1_database_with_data_is_migrated_to_leases(
    pg_cluster: PgCluster, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert SCHEMA_VERSION >= 2
    monkeypatch.setattr(pg_store, "MIGRATIONS", pg_store.MIGRATIONS[:1])
    monkeypatch.setattr(pg_store, "SCHEMA_VERSION", 1)
    with trio.fail_after(30):
        async with opened(url) as old:
            assert await old.schema_version() == 1
            await seed(old)
        before = snapshot(pg_cluster, url)
        monkeypatch.undo()
        with structlog.testing.capture_logs() as logs:
            async with opened(url) as store:
                assert await store.schema_version() == SCHEMA_VERSION
                assert snapshot(pg_cluster, url) == before
                assert await store.leases() == []
                lease = await store.take_lease(BOT, "a", lease_s=15)
                assert lease is not None and lease.epoch == 1
                await store.fenced(lease).set_cursor(BOT, "offset", "42")
                assert await store.get_cursor(BOT, "offset") == "42"
    [migrated] = [e for e in logs if e["event"].startswith("store_")]
    assert (migrated["event"], migrated["from_schema"], migrated["schema"]) == (
        "store_migrated",
        1,
        SCHEMA_VERSION,
    )


async def test_under_load_every_write_is_before_the_takeover_or_refused(
    pg_cluster: PgCluster, url: str
) -> None:
    """Tasks of the old holder accept messages without pause while another instance takes
    the expired lease over: each accept that returned True is in the inbox, each refused one
    is not, and none that started after the takeover returned got through."""
    accepted: list[str] = []
    refused: list[str] = []
    late: list[str] = []
    taken = trio.Event()
    busy = trio.Event()
    with trio.fail_after(60):
        async with opened(url) as a, opened(url) as b:
            old = await a.take_lease(BOT, "a", lease_s=0)
            assert old is not None
            view = a.fenced(old)

            async def writer(w: int) -> None:
                for i in range(10_000):
                    mid = f"w{w}-{i}"
                    after_takeover = taken.is_set()
                    try:
                        assert await view.accept(BOT, "c", mid, now=T0, ttl_s=600, raw=b"r")
                    except FencedError:
                        refused.append(mid)
                        return
                    accepted.append(mid)
                    if len(accepted) >= 50:
                        busy.set()
                    if after_takeover:
                        late.append(mid)

            async with trio.open_nursery() as nursery:
                for w in range(4):
                    nursery.start_soon(writer, w)
                await busy.wait()
                lease = await b.take_lease(BOT, "b", lease_s=15)
                taken.set()
            assert lease is not None and lease.epoch == 2
            assert late == [] and len(refused) == 4
            inbox = {e.message_id for e in await b.inbox_pending(BOT)}
            assert inbox == set(accepted)
