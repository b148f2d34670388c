"""Tests of the store, shared by both backends: SQLite and PostgreSQL.

The tests of the store's public API run once per backend (the ``backend`` fixture): against
a real SQLite file in ``tmp_path`` (no ``:memory:``), and against a schema of its own in the
session's throwaway PostgreSQL cluster (:mod:`tests.pgkit`).  The tests of what only SQLite
has (WAL, checkpoints, the write lock, its file, migrations from its old schema versions)
take the file directly; the PostgreSQL counterparts are in ``tests/test_postgres_store.py``.  Times are passed explicitly (``now=``), so no test sleeps or reads a clock.
Where the observable behaviour is "the file stays bounded" (caps, pruning), the test counts
rows with a second, plain connection (sqlite3 or psycopg).
"""

from __future__ import annotations

import contextlib
import os
import sqlite3
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

import dshim.store.sqlite as sqlite_store
from dshim.errors import StoreError
from dshim.store import DB_FILENAME, Store, open_store
from dshim.store.base import Binding, InboxEntry, OutboundEntry, PromptRow, TurnRecord
from dshim.store.lock import hold_data_dir_lock
from dshim.store.sqlite import (
    OUTBOUND_CAP,
    OUTBOUND_CUT_SLACK,
    OUTBOUND_MAX_AGE_S,
    OUTBOUND_TEXT_MAX,
    SCHEMA_VERSION,
    Migration,
    open_sqlite_store,
)
from tests.helpers import schema_at, while_locked_elsewhere
from tests.pgkit import BACKENDS, StoreBackend

DAY = 24 * 3600.0
T0 = 1_700_000_000.0


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "store.sqlite3"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> StoreBackend:
    cluster = request.getfixturevalue("pg_cluster") if request.param == "postgres" else None
    return StoreBackend(request.param, tmp_path, cluster)


@pytest.fixture
async def store(backend: StoreBackend) -> AsyncIterator[Store]:
    async with backend.open() as s:
        yield s


def query(path: Path, sql: str) -> list[tuple[Any, ...]]:
    """Run SQL on the store file through a separate plain connection."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        with conn:
            return conn.execute(sql).fetchall()


def entry(i: int, *, sent_at: float, completed_at: float | None = None) -> OutboundEntry:
    return OutboundEntry(
        message_ids=[f"m{i}", f"m{i}b"],
        text=f"answer {i}",
        sent_at=sent_at,
        completed_at=sent_at if completed_at is None else completed_at,
    )


# -- dedup and inbox ---------------------------------------------------------------------------


async def test_accept_dedups_until_the_key_expires(store: Store) -> None:
    assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=60, raw=None)
    assert not await store.accept("bot", "c1", "m1", now=T0 + 59, ttl_s=60, raw=None)
    assert await store.seen("bot", "c1", "m1", now=T0 + 59.9)
    assert not await store.seen("bot", "c1", "m1", now=T0 + 60)

    # The expired key is replaced, with a fresh expiry counted from the new acceptance.
    assert await store.accept("bot", "c1", "m1", now=T0 + 60, ttl_s=60, raw=None)
    assert await store.seen("bot", "c1", "m1", now=T0 + 119)
    assert not await store.accept("bot", "c1", "m1", now=T0 + 119, ttl_s=60, raw=None)


async def test_dedup_key_is_bot_conversation_and_message(store: Store) -> None:
    assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=60, raw=None)
    assert await store.accept("bot", "c2", "m1", now=T0, ttl_s=60, raw=None)
    assert await store.accept("other", "c1", "m1", now=T0, ttl_s=60, raw=None)
    assert not await store.seen("bot", "c1", "m2", now=T0)


async def test_concurrent_accepts_of_one_key_let_exactly_one_through(store: Store) -> None:
    results: list[bool] = []

    async def one() -> None:
        results.append(await store.accept("bot", "c", "m", now=T0, ttl_s=60, raw=b"x"))

    async with trio.open_nursery() as nursery:
        for _ in range(20):
            nursery.start_soon(one)
    assert sorted(results) == [False] * 19 + [True]
    assert len(await store.inbox_pending("bot")) == 1


async def test_accept_writes_inbox_entry_and_duplicate_writes_nothing(store: Store) -> None:
    assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=60, raw=b"first")
    assert not await store.accept("bot", "c1", "m1", now=T0 + 1, ttl_s=60, raw=b"second")
    assert await store.inbox_pending("bot") == [
        InboxEntry(
            conversation_id="c1", message_id="m1", raw=b"first", state="queued", accepted_at=T0
        )
    ]

    # After handling finished, a redelivery within the TTL must not resurrect the entry.
    await store.inbox_done("bot", "c1", "m1")
    assert not await store.accept("bot", "c1", "m1", now=T0 + 2, ttl_s=60, raw=b"third")
    assert await store.inbox_pending("bot") == []


async def test_accept_without_raw_remembers_key_only(store: Store) -> None:
    assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=60, raw=None)
    assert await store.inbox_pending("bot") == []
    assert await store.seen("bot", "c1", "m1", now=T0)


async def test_reaccepting_an_expired_key_restarts_its_inbox_entry(store: Store) -> None:
    assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=10, raw=b"old")
    await store.inbox_set_state("bot", "c1", "m1", "running")
    assert await store.accept("bot", "c1", "m1", now=T0 + 20, ttl_s=10, raw=b"new")
    assert await store.inbox_pending("bot") == [
        InboxEntry(
            conversation_id="c1", message_id="m1", raw=b"new", state="queued", accepted_at=T0 + 20
        )
    ]


async def test_accept_is_atomic_when_the_inbox_write_fails(
    store: Store, backend: StoreBackend
) -> None:
    # Fault injection from a second connection: every inbox insert aborts.
    backend.fail_inserts("inbox", "disk full")
    with pytest.raises(StoreError, match="disk full") as info:
        await store.accept("bot", "c1", "m1", now=T0, ttl_s=60, raw=b"x")
    assert isinstance(info.value.__cause__, backend.error_type)
    # The dedup key was rolled back with the inbox row: the redelivery is not lost.
    assert not await store.seen("bot", "c1", "m1", now=T0)

    backend.stop_failing("inbox")
    assert await store.accept("bot", "c1", "m1", now=T0 + 1, ttl_s=60, raw=b"x")
    assert [e.message_id for e in await store.inbox_pending("bot")] == ["m1"]


async def test_inbox_lifecycle(store: Store) -> None:
    # Accepted out of time order: pending lists by accepted_at, oldest first.
    for message_id, at in [("m3", T0 + 30), ("m1", T0 + 10), ("m2", T0 + 20)]:
        assert await store.accept(
            "bot", "c1", message_id, now=at, ttl_s=600, raw=message_id.encode()
        )
    assert await store.accept("other", "c9", "m1", now=T0, ttl_s=600, raw=b"other")

    pending = await store.inbox_pending("bot")
    assert [(e.message_id, e.raw, e.state) for e in pending] == [
        ("m1", b"m1", "queued"),
        ("m2", b"m2", "queued"),
        ("m3", b"m3", "queued"),
    ]

    await store.inbox_set_state("bot", "c1", "m2", "running")
    await store.inbox_done("bot", "c1", "m1")
    pending = await store.inbox_pending("bot")
    assert [(e.message_id, e.state) for e in pending] == [("m2", "running"), ("m3", "queued")]

    # Another bot's inbox is separate.
    assert [e.raw for e in await store.inbox_pending("other")] == [b"other"]

    # Finishing or updating an entry that is not there is harmless.
    await store.inbox_done("bot", "c1", "m1")
    await store.inbox_set_state("bot", "c1", "nope", "running")
    assert len(await store.inbox_pending("bot")) == 2


async def test_turns_count_their_attempts_and_delivered_is_durable(backend: StoreBackend) -> None:
    async with backend.open() as store:
        assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=3600, raw=b"x")
        assert [e.attempts for e in await store.inbox_pending("bot")] == [0]
        await store.begin_turn("bot", "c1", "", [("c1", "m1")])
        await store.begin_turn("bot", "c1", "", [("c1", "m1")])
        await store.inbox_set_state("bot", "c1", "m1", "delivered")
        # Written at once: another connection (a process after a crash) sees it.
        assert backend.query("SELECT state, attempts FROM inbox_state") == [("delivered", 2)]
    async with backend.open() as store:
        [e] = await store.inbox_pending("bot")
    assert (e.state, e.attempts) == ("delivered", 2)


async def test_a_version_1_inbox_gains_attempts(db_path: Path) -> None:
    # A store written by the previous release: schema 1, a running turn in its inbox.
    with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as conn:
        for statement in sqlite_store.MIGRATIONS[0].statements:
            conn.execute(statement)
        conn.execute("PRAGMA user_version = 1")
        conn.execute("INSERT INTO inbox VALUES ('bot', 'c1', 'm1', x'01', 'running', ?)", (T0,))
    async with open_sqlite_store(db_path) as store:
        assert await store.schema_version() == SCHEMA_VERSION
        [e] = await store.inbox_pending("bot")
    assert (e.message_id, e.state, e.attempts) == ("m1", "running", 0)


async def test_a_version_5_inbox_keeps_its_states_and_attempts(db_path: Path) -> None:
    # Schema 5 kept state and attempts in the inbox row next to the raw event.
    with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as conn:
        schema_at(conn, 5)
        rows = [("m1", "queued", 0), ("m2", "running", 2), ("m3", "delivered", 1)]
        for i, (mid, state, attempts) in enumerate(rows):
            conn.execute(
                "INSERT INTO inbox VALUES ('bot', 'c1', ?, ?, ?, ?, ?)",
                (mid, mid.encode() * 1000, state, T0 + i, attempts),
            )
    async with open_sqlite_store(db_path) as store:
        assert await store.schema_version() == SCHEMA_VERSION
        pending = await store.inbox_pending("bot")
        assert [(e.message_id, e.state, e.attempts) for e in pending] == rows
        assert [e.raw for e in pending] == [mid.encode() * 1000 for mid, _, _ in rows]
        # The next turn counts on from the migrated attempts.
        await store.begin_turn("bot", "c1", "", [("c1", "m2"), ("c1", "m1")])
        after = {e.message_id: (e.state, e.attempts) for e in await store.inbox_pending("bot")}
    assert after == {"m1": ("running", 1), "m2": ("running", 3), "m3": ("delivered", 1)}


async def test_a_re_accepted_expired_key_starts_queued_again(store: Store) -> None:
    assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=60, raw=b"old")
    await store.begin_turn("bot", "c1", "", [("c1", "m1")])
    await store.inbox_set_state("bot", "c1", "m1", "delivered")
    # The key expired; the platform sends the message again: a new entry, nothing carried over.
    assert await store.accept("bot", "c1", "m1", now=T0 + 61, ttl_s=60, raw=b"new")
    [e] = await store.inbox_pending("bot")
    assert (e.raw, e.state, e.attempts) == (b"new", "queued", 0)
    await store.inbox_done("bot", "c1", "m1")
    assert await store.inbox_pending("bot") == []
    # Done means gone, state included: a later entry under the same key starts afresh.
    assert await store.accept("bot", "c1", "m1", now=T0 + 200, ttl_s=60, raw=b"again")
    [e] = await store.inbox_pending("bot")
    assert (e.state, e.attempts) == ("queued", 0)


async def test_inbox_rejects_unknown_state(store: Store) -> None:
    assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=60, raw=b"x")
    with pytest.raises(ValueError):
        await store.inbox_set_state("bot", "c1", "m1", "exploded")
    assert [e.state for e in await store.inbox_pending("bot")] == ["queued"]


async def test_prune_drops_expired_dedup_keys_only(store: Store, backend: StoreBackend) -> None:
    assert await store.accept("bot", "c", "short", now=T0, ttl_s=10, raw=None)
    assert await store.accept("bot", "c", "long", now=T0, ttl_s=1000, raw=None)
    await store.prune(now=T0 + 10)
    assert backend.query("SELECT message_id FROM dedup") == [("long",)]
    assert await store.seen("bot", "c", "long", now=T0 + 10)


async def test_prune_sweeps_more_than_one_batch(
    store: Store, backend: StoreBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend.module, "PRUNE_BATCH", 3)
    for i in range(10):
        assert await store.accept("bot", "c", f"m{i}", now=T0, ttl_s=10, raw=None)
    assert await store.accept("bot", "c", "live", now=T0, ttl_s=1000, raw=None)
    await store.prune(now=T0 + 10)  # batches of 3: it goes on until none is left
    assert backend.query("SELECT message_id FROM dedup") == [("live",)]


# -- bindings, cursors, last direct ------------------------------------------------------------


async def test_bindings_set_get_clear(store: Store) -> None:
    assert await store.get_binding("bot", "c1", "") is None

    await store.set_binding("bot", "c1", "", "s1", title="first", now=T0)
    assert await store.get_binding("bot", "c1", "") == Binding(
        session_id="s1", title="first", created_at=T0, updated_at=T0
    )

    # Same session again: created_at stays, title and updated_at change.
    await store.set_binding("bot", "c1", "", "s1", title=None, now=T0 + 5)
    assert await store.get_binding("bot", "c1", "") == Binding(
        session_id="s1", title=None, created_at=T0, updated_at=T0 + 5
    )

    # A different session is a new binding.
    await store.set_binding("bot", "c1", "", "s2", title="second", now=T0 + 9)
    assert await store.get_binding("bot", "c1", "") == Binding(
        session_id="s2", title="second", created_at=T0 + 9, updated_at=T0 + 9
    )

    # Threads and bots are bound separately.
    await store.set_binding("bot", "c1", "t1", "s3", title=None, now=T0)
    await store.set_binding("other", "c1", "", "s4", title=None, now=T0)
    binding = await store.get_binding("bot", "c1", "")
    assert binding is not None and binding.session_id == "s2"

    assert await store.clear_binding("bot", "c1", "")
    assert await store.get_binding("bot", "c1", "") is None
    assert not await store.clear_binding("bot", "c1", "")
    thread_binding = await store.get_binding("bot", "c1", "t1")
    assert thread_binding is not None and thread_binding.session_id == "s3"
    other_binding = await store.get_binding("other", "c1", "")
    assert other_binding is not None and other_binding.session_id == "s4"


async def test_cursors(store: Store) -> None:
    assert await store.get_cursor("bot", "offset") is None
    await store.set_cursor("bot", "offset", "41")
    await store.set_cursor("bot", "offset", "42")
    await store.set_cursor("bot", "session", "abc")
    await store.set_cursor("other", "offset", "7")
    assert await store.get_cursor("bot", "offset") == "42"
    assert await store.get_cursor("bot", "session") == "abc"
    assert await store.get_cursor("other", "offset") == "7"


async def test_last_direct(store: Store) -> None:
    assert await store.get_last_direct("bot") is None
    await store.set_last_direct("bot", "dm1", now=T0)
    await store.set_last_direct("bot", "dm2", now=T0 + 1)
    await store.set_last_direct("other", "dm9", now=T0)
    assert await store.get_last_direct("bot") == "dm2"
    assert await store.get_last_direct("other") == "dm9"


# -- outbound index ----------------------------------------------------------------------------


async def test_outbound_keeps_newest_200_per_conversation(
    store: Store, backend: StoreBackend
) -> None:
    await store.add_outbound("bot", "elsewhere", entry(-1, sent_at=T0 - 1), now=T0)
    for i in range(205):
        await store.add_outbound("bot", "c1", entry(i, sent_at=T0 + i), now=T0 + i)

    listed = await store.list_outbound("bot", "c1", now=T0 + 205)
    assert len(listed) == OUTBOUND_CAP == 200
    assert listed[0] == entry(204, sent_at=T0 + 204)
    assert listed[-1] == entry(5, sent_at=T0 + 5)
    assert [e.sent_at for e in listed] == [T0 + i for i in range(204, 4, -1)]

    # Pruned from the file, not just hidden (at most a few beyond the cap wait for the next
    # cut); other conversations are untouched.
    for i in range(205, 500):
        await store.add_outbound("bot", "c1", entry(i, sent_at=T0 + i), now=T0 + i)
    [(kept,)] = backend.query("SELECT count(*) FROM outbound WHERE conversation_id = 'c1'")
    assert OUTBOUND_CAP <= kept <= OUTBOUND_CAP + OUTBOUND_CUT_SLACK
    listed = await store.list_outbound("bot", "c1", now=T0 + 500)
    assert [e.sent_at for e in listed] == [T0 + i for i in range(499, 299, -1)]
    assert await store.list_outbound("bot", "elsewhere", now=T0 + 205) == [
        entry(-1, sent_at=T0 - 1)
    ]


async def test_outbound_newest_is_by_sent_at(store: Store) -> None:
    # A long answer completes (and is indexed) after a later, shorter one.
    await store.add_outbound("bot", "c1", entry(2, sent_at=T0 + 2), now=T0 + 2)
    await store.add_outbound("bot", "c1", entry(1, sent_at=T0 + 1, completed_at=T0 + 9), now=T0 + 9)
    listed = await store.list_outbound("bot", "c1", now=T0 + 9)
    assert [e.message_ids[0] for e in listed] == ["m2", "m1"]


async def test_outbound_entries_expire_after_30_days(store: Store, backend: StoreBackend) -> None:
    await store.add_outbound("bot", "c1", entry(1, sent_at=T0), now=T0)
    await store.add_outbound("bot", "c1", entry(2, sent_at=T0 + 2 * DAY), now=T0 + 2 * DAY)
    await store.add_outbound("bot", "c2", entry(3, sent_at=T0), now=T0)

    # Exactly 30 days is still within the window; just past it is not.
    day30 = T0 + OUTBOUND_MAX_AGE_S
    assert len(await store.list_outbound("bot", "c1", now=day30)) == 2
    listed = await store.list_outbound("bot", "c1", now=day30 + 1)
    assert [e.message_ids for e in listed] == [["m2", "m2b"]]
    assert await store.list_outbound("bot", "c2", now=day30 + 1) == []

    # An insert drops its own conversation's expired entries ...
    await store.add_outbound("bot", "c1", entry(4, sent_at=day30 + 1), now=day30 + 1)
    assert backend.query("SELECT text FROM outbound WHERE conversation_id = 'c1' ORDER BY id") == [
        ("answer 2",),
        ("answer 4",),
    ]
    # ... and prune() sweeps every conversation.
    await store.prune(now=day30 + 1)
    assert backend.query("SELECT count(*) FROM outbound WHERE conversation_id = 'c2'") == [(0,)]
    assert len(await store.list_outbound("bot", "c1", now=day30 + 1)) == 2


async def test_outbound_text_is_cut_to_8000_code_points(store: Store) -> None:
    emoji = "\U0001f600"  # outside the BMP: one code point, two UTF-16 units, four UTF-8 bytes
    texts = {
        "c-emoji": emoji * (OUTBOUND_TEXT_MAX + 1),
        "c-mixed": "a" * (OUTBOUND_TEXT_MAX - 1) + emoji + "\U00020000",
        "c-exact": "\U00020000" * OUTBOUND_TEXT_MAX,
    }
    for conversation_id, text in texts.items():
        e = OutboundEntry(message_ids=["1"], text=text, sent_at=T0, completed_at=T0)
        await store.add_outbound("bot", conversation_id, e, now=T0)

    async def stored(conversation_id: str) -> str:
        (e,) = await store.list_outbound("bot", conversation_id, now=T0)
        return e.text

    assert await stored("c-emoji") == emoji * 8000
    assert await stored("c-mixed") == "a" * 7999 + emoji
    assert await stored("c-exact") == texts["c-exact"]


# -- transcript --------------------------------------------------------------------------------


async def test_transcript_pages_newest_first(store: Store) -> None:
    ids: list[int] = []
    for i in range(350):
        role = "user" if i % 2 == 0 else "assistant"
        ids.append(
            await store.append_transcript(
                "bot", "s1", role, f"text {i}", at=T0 + i, completed=i % 7 != 0
            )
        )
        if i % 3 == 0:  # interleave another session
            await store.append_transcript("bot", "s2", "user", "noise", at=T0, completed=True)
    assert ids == sorted(ids) and len(set(ids)) == 350

    pages: list[list[int]] = []
    before: int | None = None
    while True:
        page = await store.transcript_page("s1", before_id=before, limit=100)
        if not page:
            break
        pages.append([row.id for row in page])
        before = page[-1].id
    assert [len(p) for p in pages] == [100, 100, 100, 50]
    assert [i for p in pages for i in p] == ids[::-1]

    first = (await store.transcript_page("s1", before_id=None, limit=1))[0]
    assert (first.session_id, first.role, first.text, first.at, first.completed) == (
        "s1",
        "assistant",
        "text 349",
        T0 + 349,
        True,
    )
    page = await store.transcript_page("s1", before_id=ids[8], limit=2)
    assert [(r.text, r.role, r.completed) for r in page] == [
        ("text 7", "assistant", False),
        ("text 6", "user", True),
    ]
    assert len(await store.transcript_page("s2", before_id=None, limit=1000)) == 117
    with pytest.raises(ValueError):
        await store.transcript_page("s1", before_id=None, limit=0)


# -- schema, files, restart --------------------------------------------------------------------


async def test_fresh_store_is_wal_at_current_schema(db_path: Path) -> None:
    async with open_sqlite_store(db_path) as store:
        assert await store.schema_version() == SCHEMA_VERSION >= 1
    assert query(db_path, "PRAGMA journal_mode") == [("wal",)]
    assert query(db_path, "PRAGMA user_version") == [(SCHEMA_VERSION,)]


async def test_reopen_does_not_rerun_migrations(backend: StoreBackend) -> None:
    for _ in range(3):
        async with backend.open() as store:
            assert await store.schema_version() == backend.module.SCHEMA_VERSION
            await store.append_transcript("bot", "s", "user", "hi", at=T0, completed=True)
    async with backend.open() as store:
        assert len(await store.transcript_page("s", before_id=None, limit=10)) == 3


async def test_appended_migration_upgrades_an_existing_file(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_sqlite_store(db_path) as store:
        await store.set_cursor("bot", "offset", "9")

    upgraded = (
        *sqlite_store.MIGRATIONS,
        Migration("pending interactions", ("CREATE TABLE probe (x INTEGER)",)),
    )
    monkeypatch.setattr(sqlite_store, "MIGRATIONS", upgraded)
    monkeypatch.setattr(sqlite_store, "SCHEMA_VERSION", len(upgraded))
    for _ in range(2):
        async with open_sqlite_store(db_path) as store:
            assert await store.schema_version() == SCHEMA_VERSION + 1
            assert await store.get_cursor("bot", "offset") == "9"
    assert query(db_path, "SELECT count(*) FROM probe") == [(0,)]

    # The older code refuses the upgraded file instead of misreading it.
    monkeypatch.undo()
    with pytest.raises(StoreError, match="newer"):
        async with open_sqlite_store(db_path):
            pass


async def test_failed_migration_leaves_the_file_at_the_old_version(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_sqlite_store(db_path):
        pass
    broken = (
        *sqlite_store.MIGRATIONS,
        Migration("broken", ("CREATE TABLE half (x INTEGER)", "NOT SQL AT ALL")),
    )
    monkeypatch.setattr(sqlite_store, "MIGRATIONS", broken)
    monkeypatch.setattr(sqlite_store, "SCHEMA_VERSION", len(broken))
    with pytest.raises(StoreError):
        async with open_sqlite_store(db_path):
            pass
    monkeypatch.undo()
    assert query(db_path, "PRAGMA user_version") == [(SCHEMA_VERSION,)]
    assert query(db_path, "SELECT name FROM sqlite_master WHERE name = 'half'") == []


async def test_newer_schema_version_is_refused(db_path: Path) -> None:
    async with open_sqlite_store(db_path):
        pass
    query(db_path, "PRAGMA user_version = 999")
    with pytest.raises(StoreError, match="schema version 999"):
        async with open_sqlite_store(db_path):
            pass


async def test_garbage_file_is_a_store_error(db_path: Path) -> None:
    await trio.Path(db_path).write_bytes(b"this is not a database, just some bytes\n" * 200)
    with pytest.raises(StoreError, match="cannot open store") as info:
        async with open_sqlite_store(db_path):
            pass
    assert isinstance(info.value.__cause__, sqlite3.DatabaseError)


async def test_foreign_sqlite_database_is_refused(db_path: Path) -> None:
    query(db_path, "CREATE TABLE customers (name TEXT)")
    with pytest.raises(StoreError, match="not a dshim store"):
        async with open_sqlite_store(db_path):
            pass
    # Nothing was added to the foreign file.
    assert query(db_path, "SELECT name FROM sqlite_master") == [("customers",)]


async def test_unopenable_path_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError):
        async with open_sqlite_store(tmp_path / "missing-dir" / "store.sqlite3"):
            pass


async def test_closed_store_raises_store_error(backend: StoreBackend) -> None:
    async with backend.open() as store:
        pass
    await store.aclose()  # idempotent
    with pytest.raises(StoreError, match="closed"):
        await store.get_cursor("bot", "offset")


async def test_store_closes_when_the_block_is_cancelled(backend: StoreBackend) -> None:
    with trio.CancelScope() as scope:
        async with backend.open() as store:
            scope.cancel()
            await trio.sleep_forever()
    with pytest.raises(StoreError, match="closed"):
        await store.seen("bot", "c", "m", now=T0)


async def test_state_survives_a_restart(backend: StoreBackend) -> None:
    async with backend.open() as store:
        assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=3600, raw=b"payload")
        assert await store.accept("bot", "c1", "m2", now=T0, ttl_s=3600, raw=None)
        await store.inbox_set_state("bot", "c1", "m1", "running")
        await store.set_binding("bot", "c1", "t", "s1", title="chat", now=T0)
        await store.set_cursor("bot", "offset", "100")
        await store.set_last_direct("bot", "dm", now=T0)
        for i in range(3):
            await store.add_outbound("bot", "c1", entry(i, sent_at=T0 + i), now=T0 + i)
        row_id = await store.append_transcript("bot", "s1", "user", "hello", at=T0, completed=True)

    async with backend.open() as store:
        # Redeliveries after the restart are still recognised as duplicates.
        assert not await store.accept("bot", "c1", "m1", now=T0 + 60, ttl_s=3600, raw=b"again")
        assert not await store.accept("bot", "c1", "m2", now=T0 + 60, ttl_s=3600, raw=None)
        assert await store.inbox_pending("bot") == [
            InboxEntry(
                conversation_id="c1",
                message_id="m1",
                raw=b"payload",
                state="running",
                accepted_at=T0,
            )
        ]
        assert await store.get_binding("bot", "c1", "t") == Binding(
            session_id="s1", title="chat", created_at=T0, updated_at=T0
        )
        assert await store.get_cursor("bot", "offset") == "100"
        assert await store.get_last_direct("bot") == "dm"
        assert await store.list_outbound("bot", "c1", now=T0 + 3) == [
            entry(2, sent_at=T0 + 2),
            entry(1, sent_at=T0 + 1),
            entry(0, sent_at=T0),
        ]
        (row,) = await store.transcript_page("s1", before_id=None, limit=10)
        assert (row.id, row.text) == (row_id, "hello")
        # Ids keep increasing across the restart.
        assert (
            await store.append_transcript("bot", "s1", "assistant", "hi", at=T0, completed=True)
            > row_id
        )


async def test_open_store_creates_private_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "data" / "dshim"
    async with open_store(data_dir) as store:
        await store.set_cursor("bot", "offset", "1")
    assert stat.S_IMODE((await trio.Path(data_dir).stat()).st_mode) == 0o700
    assert await trio.Path(data_dir / DB_FILENAME).is_file()
    async with open_store(data_dir) as store:
        assert await store.get_cursor("bot", "offset") == "1"


async def test_a_cancelled_caller_waits_for_its_write_to_finish(backend: StoreBackend) -> None:
    async with backend.open() as store:
        with trio.CancelScope() as scope:
            scope.cancel()  # cancelled before the call: nothing is written
            await store.set_cursor("bot", "a", "1")
        assert await store.get_cursor("bot", "a") is None
        async with trio.open_nursery() as nursery:

            async def write() -> None:
                # The deadline passes while the call is queued/running on the worker thread.
                nursery.cancel_scope.deadline = trio.current_time()
                await store.add_outbound(
                    "bot",
                    "c",
                    OutboundEntry(message_ids=["1"], text="t", sent_at=T0, completed_at=T0),
                    now=T0,
                )

            nursery.start_soon(write)
        # The write had started: it completed as a whole despite the cancellation.
        assert [e.message_ids for e in await store.list_outbound("bot", "c", now=T0)] == [["1"]]


# -- the message index of both directions ------------------------------------------------------


async def test_index_keeps_inbound_entries_with_author_attachments_and_state(
    store: Store,
) -> None:
    from dshim.model import Attachment

    user = OutboundEntry(
        message_ids=["w1", "REFIDX_1"],
        text="a photo of the bug",
        sent_at=T0,
        completed_at=T0,
        inbound=True,
        author_id="u1",
        author_name="Ann",
        attachments=[Attachment(kind="image", name="bug.png")],
    )
    await store.add_outbound("bot", "chat", user, now=T0)
    await store.add_outbound("bot", "chat", entry(2, sent_at=T0 + 1), now=T0 + 1)
    [newest, oldest] = await store.list_outbound("bot", "chat", now=T0 + 2)
    assert oldest == user
    assert (newest.inbound, newest.author_id, newest.attachments, newest.state) == (
        False,
        None,
        [],
        "ok",
    )


async def test_update_finds_an_entry_by_any_of_its_ids_and_changes_only_what_is_given(
    store: Store,
) -> None:
    await store.add_outbound("bot", "chat", entry(1, sent_at=T0), now=T0)
    await store.add_outbound("bot", "chat", entry(2, sent_at=T0 + 1), now=T0)
    assert await store.update_outbound(
        "bot", "chat", "m1b", now=T0, text="final", completed_at=T0 + 5, add_ids=["card-1", "m1"]
    )
    assert await store.update_outbound("bot", "chat", "card-1", now=T0, state="deleted")
    assert not await store.update_outbound("bot", "chat", "nope", now=T0, state="deleted")
    assert not await store.update_outbound("bot", "other", "m1", now=T0, state="deleted")
    [second, first] = await store.list_outbound("bot", "chat", now=T0)
    assert first == OutboundEntry(
        message_ids=["m1", "m1b", "card-1"],
        text="final",
        sent_at=T0,
        completed_at=T0 + 5,
        state="deleted",
    )
    assert second == entry(2, sent_at=T0 + 1)
    with pytest.raises(ValueError, match="state"):
        await store.update_outbound("bot", "chat", "m1", now=T0, state="gone")


async def test_a_version_3_index_gains_the_inbound_columns(db_path: Path) -> None:
    with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as conn:
        schema_at(conn, 3)
        conn.execute(
            "INSERT INTO outbound (bot, conversation_id, message_ids, text, sent_at,"
            " completed_at) VALUES ('bot', 'c1', '[\"m1\"]', 'old answer', ?, ?)",
            (T0, T0),
        )
    async with open_sqlite_store(db_path) as store:
        assert await store.schema_version() == SCHEMA_VERSION
        [old] = await store.list_outbound("bot", "c1", now=T0)
    assert old == OutboundEntry(message_ids=["m1"], text="old answer", sent_at=T0, completed_at=T0)


async def test_accept_many_takes_a_batch_in_one_go_and_a_repeat_inside_it_is_a_duplicate(
    store: Store,
) -> None:
    await store.accept("bot", "c1", "old", now=T0, ttl_s=60, raw=b"x")
    fresh = await store.accept_many(
        "bot",
        [("c1", "m1", b"r1"), ("c1", "old", b"r0"), ("c2", "m1", None), ("c1", "m1", b"again")],
        now=T0 + 1,
        ttl_s=60,
    )
    assert fresh == [True, False, True, False]
    pending = {(e.conversation_id, e.message_id): e.raw for e in await store.inbox_pending("bot")}
    assert pending == {("c1", "old"): b"x", ("c1", "m1"): b"r1"}  # no entry for raw=None
    assert await store.seen("bot", "c2", "m1", now=T0 + 2)


async def test_concurrent_writes_commit_together_and_one_failure_spoils_only_itself(
    backend: StoreBackend,
) -> None:
    """Many turns writing at once share commits (group commit on the worker thread); a call
    that fails inside the group rolls back its own writes only, and every write that
    returned is in the file."""
    async with backend.open() as store:

        async def accept(i: int) -> None:
            assert await store.accept("bot", f"c{i}", f"m{i}", now=T0, ttl_s=60, raw=b"r")

        async def broken() -> None:
            with pytest.raises(StoreError):  # a value SQLite cannot bind: fails in the call
                await store.set_cursor("bot", "broken", object())  # type: ignore[arg-type]

        async with trio.open_nursery() as nursery:
            for i in range(200):
                nursery.start_soon(accept, i)
                if i == 100:
                    nursery.start_soon(broken)
    assert backend.query("SELECT COUNT(*) FROM inbox") == [(200,)]
    assert backend.query("SELECT COUNT(*) FROM dedup") == [(200,)]


async def test_another_process_holding_the_write_lock_never_stalls_the_trio_thread(
    db_path: Path,
) -> None:
    """Quick calls run on the trio thread, but never wait there: while another connection
    (a second process, a backup tool) holds the write lock, they wait on the worker thread
    and the bot's other tasks keep running."""
    async with open_sqlite_store(db_path) as store:
        assert await store.accept("bot", "c1", "before", now=T0, ttl_s=60, raw=b"r")
        other = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")  # the write lock, held by someone else

        async def during() -> None:
            assert await store.accept("bot", "c1", "during", now=T0, ttl_s=60, raw=b"r")

        waited, ticks = await while_locked_elsewhere(during, lambda: other.execute("COMMIT"))
        other.close()
        assert waited >= 0.4  # it did wait for the lock ...
        assert ticks >= 20  # ... and the trio thread ran everything else meanwhile
        assert {e.message_id for e in await store.inbox_pending("bot")} == {"before", "during"}


async def test_commits_reach_the_database_file_through_checkpoints(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The WAL is copied into the database file by the worker thread every few commits:
    the file itself (read without the WAL) holds what was written."""
    monkeypatch.setattr(sqlite_store, "CHECKPOINT_EVERY", 3)
    async with open_sqlite_store(db_path) as store:
        for i in range(6):
            assert await store.accept("bot", "c1", f"m{i}", now=T0, ttl_s=60, raw=None)
        await store.get_cursor("bot", "sync")  # a later call: the checkpoint job ran before
        with trio.fail_after(10):
            while True:
                with contextlib.closing(
                    sqlite3.connect(f"file:{db_path}?immutable=1", uri=True)
                ) as plain:  # the database file alone, the WAL ignored
                    try:
                        found = plain.execute("SELECT COUNT(*) FROM dedup").fetchone()[0]
                    except sqlite3.OperationalError:  # not even the tables copied yet
                        found = 0
                if found == 6:
                    break
                await trio.sleep(0.05)


async def test_the_wal_starts_over_under_a_steady_stream_of_commits(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checkpoints run between commits, so the WAL is reused from its start instead of
    growing with every write while the bot is busy (and its index with it, in memory)."""
    monkeypatch.setattr(sqlite_store, "CHECKPOINT_EVERY", 5)
    raw = b"x" * 4000
    async with open_sqlite_store(db_path) as store:

        async def accept(i: int) -> None:
            assert await store.accept("bot", f"c{i % 50}", f"m{i}", now=T0, ttl_s=60, raw=raw)
            await store.inbox_done("bot", f"c{i % 50}", f"m{i}")

        with trio.fail_after(60):
            for start in range(0, 6000, 100):  # ~24 MB of rows written in all
                async with trio.open_nursery() as nursery:
                    for i in range(start, start + 100):
                        nursery.start_soon(accept, i)
        wal = db_path.with_name(db_path.name + "-wal").stat().st_size
    assert wal < 6_000_000, f"the WAL grew to {wal:,} bytes"


async def test_calls_sent_to_the_worker_thread_commit_together_and_a_failure_spoils_only_itself(
    db_path: Path,
) -> None:
    """While another process holds the write lock, the batch waits on the worker thread;
    there too a failing call loses only its own writes."""
    async with open_sqlite_store(db_path) as store:
        other = sqlite3.connect(db_path, isolation_level=None, check_same_thread=False)
        other.execute("BEGIN IMMEDIATE")

        async def accept(i: int) -> None:
            assert await store.accept("bot", f"c{i}", f"m{i}", now=T0, ttl_s=60, raw=b"r")

        async def broken() -> None:
            with pytest.raises(StoreError):
                await store.set_cursor("bot", "broken", object())  # type: ignore[arg-type]

        async def release_later() -> None:
            await trio.sleep(0.3)
            other.execute("COMMIT")

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(release_later)
                for i in range(50):
                    nursery.start_soon(accept, i)
                    if i == 25:
                        nursery.start_soon(broken)
        other.close()
        assert await store.get_cursor("bot", "broken") is None
    assert query(db_path, "SELECT COUNT(*) FROM inbox") == [(50,)]


def test_the_data_dir_lock_is_held_once_and_released_on_exit(tmp_path: Path) -> None:
    data_dir = tmp_path / "state"
    with hold_data_dir_lock(data_dir):
        assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
        with pytest.raises(StoreError) as refused, hold_data_dir_lock(data_dir):
            pass
        message = str(refused.value)
        assert "another dshim serve" in message and f"pid {os.getpid()}" in message
        assert str(data_dir) in message
    with hold_data_dir_lock(data_dir):  # released: taken again at once
        pass


async def test_the_data_dir_lock_does_not_keep_the_store_from_opening(tmp_path: Path) -> None:
    """probe opens the store while serve holds the lock."""
    with hold_data_dir_lock(tmp_path):
        async with open_store(tmp_path) as s:
            await s.set_cursor("bot", "probe", "1")
            assert await s.schema_version() == SCHEMA_VERSION


# -- turns, resumes and anchors (the composite writes) -----------------------------------------


async def test_a_turn_begins_is_marked_delivered_and_is_recorded(
    store: Store, backend: StoreBackend
) -> None:
    await store.set_binding("bot", "c1", "", "s1", title=None, now=T0)
    assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=600, raw=b"r1")
    assert await store.accept("bot", "c1", "m2", now=T0, ttl_s=600, raw=b"r2")
    keys = [("c1", "m1"), ("c1", "m2")]
    binding = await store.begin_turn("bot", "c1", "", keys, last_direct=("c1", T0))
    assert binding is not None and binding.session_id == "s1"
    assert await store.get_last_direct("bot") == "c1"
    assert [(e.state, e.attempts) for e in await store.inbox_pending("bot")] == [
        ("running", 1),
        ("running", 1),
    ]
    await store.mark_delivered("bot", keys, prompt=PromptRow(session_id="s1", text="hi", at=T0))
    assert {e.state for e in await store.inbox_pending("bot")} == {"delivered"}
    turn = TurnRecord(
        session_id="s1",
        user_text=None,
        user_at=T0,
        answer_text="hello",
        answer_at=T0 + 1,
        completed=False,
        delivered=[entry(1, sent_at=T0 + 1)],
        inbox_done=keys,
    )
    await store.record_turn("bot", "c1", turn, now=T0 + 1)
    assert await store.inbox_pending("bot") == []
    assert backend.query("SELECT count(*) FROM inbox_state") == [(0,)]
    rows = await store.transcript_page("s1", before_id=None, limit=10)
    assert [(r.role, r.text, r.completed) for r in rows] == [
        ("assistant", "hello", False),
        ("user", "hi", True),
    ]
    assert await store.list_outbound("bot", "c1", now=T0 + 1) == [entry(1, sent_at=T0 + 1)]
    # No binding, no keys: begin_turn only reads.
    assert await store.begin_turn("bot", "c9", "", []) is None


async def test_a_resume_counts_an_attempt_and_says_how_many_came_before(store: Store) -> None:
    assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=600, raw=b"r")
    assert await store.inbox_resumed("bot", "c1", "m1") == 0
    assert await store.inbox_resumed("bot", "c1", "m1") == 1
    await store.begin_turn("bot", "c1", "", [("c1", "m1")])
    assert await store.inbox_resumed("bot", "c1", "m1") == 3
    [e] = await store.inbox_pending("bot")
    assert (e.state, e.attempts) == ("running", 4)
    # Setting it queued again keeps the count; an entry that is not there counts nothing.
    await store.inbox_set_state("bot", "c1", "m1", "queued")
    [e] = await store.inbox_pending("bot")
    assert (e.state, e.attempts) == ("queued", 4)
    assert await store.inbox_resumed("bot", "c1", "gone") == 0
    assert await store.inbox_pending("bot") == [e]


async def test_anchors_keep_the_newest_per_conversation_and_thread(
    store: Store, backend: StoreBackend
) -> None:
    for i in range(5):
        await store.put_anchor("bot", "c1", "t", f"turn{i}", f"a{i}", now=T0 + i, keep=3)
    await store.put_anchor("bot", "c1", "other", "turn0", "x", now=T0, keep=3)
    assert [await store.get_anchor("bot", "c1", "t", f"turn{i}") for i in range(5)] == [
        None,
        None,
        "a2",
        "a3",
        "a4",
    ]
    # Replacing one makes it the newest; the thread next door is untouched.
    await store.put_anchor("bot", "c1", "t", "turn2", "a2b", now=T0 + 10, keep=3)
    await store.put_anchor("bot", "c1", "t", "turn5", "a5", now=T0 + 11, keep=3)
    assert await store.get_anchor("bot", "c1", "t", "turn2") == "a2b"
    assert await store.get_anchor("bot", "c1", "t", "turn3") is None
    assert await store.get_anchor("bot", "c1", "other", "turn0") == "x"
    assert await store.get_anchor("other", "c1", "t", "turn5") is None
    assert backend.query("SELECT count(*) FROM anchors WHERE thread_id = 't'") == [(3,)]


async def test_the_message_log_stays_bounded_in_the_table(
    store: Store, backend: StoreBackend
) -> None:
    from dshim.store.base import LoggedMessage
    from dshim.store.sqlite import MESSAGE_LOG_CAP

    for i in range(MESSAGE_LOG_CAP + 20):
        message = LoggedMessage(message_id=f"m{i}", author_id="u", text="t", at=T0 + i)
        assert await store.log_message("bot", "c1", message, now=T0)
    assert backend.query("SELECT count(*) FROM messages") == [(MESSAGE_LOG_CAP,)]
