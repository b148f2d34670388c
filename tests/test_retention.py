"""Transcript retention (``[store] transcript_keep`` / ``transcript_max_age_s``), on both
backends: ``prune`` cuts each session to its newest rows and drops old rows of sessions no
binding names, never an open session's newest rows; plus the migration that adds the
bindings' session index, from the previous schema of each backend.

Times are passed explicitly; rows are counted through a separate plain connection.
"""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import trio

import dshim.store.postgres as pg_store
from dshim.config import ConfigError, StoreSection, apply_store_env
from dshim.store import DB_FILENAME, Store, open_store, open_store_from_config
from dshim.store.base import (
    TRANSCRIPT_KEEP,
    TRANSCRIPT_MAX_AGE_S,
    PromptRow,
    Retention,
    TurnRecord,
)
from dshim.store.postgres import open_postgres_store
from dshim.store.sqlite import SCHEMA_VERSION, open_sqlite_store
from tests.helpers import schema_at
from tests.pgkit import BACKENDS, PgCluster, StoreBackend

DAY = 86400.0
T0 = 1_700_000_000.0
KEEP = 100
SMALL = Retention(transcript_keep=KEEP, transcript_max_age_s=10 * DAY)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> StoreBackend:
    cluster = request.getfixturevalue("pg_cluster") if request.param == "postgres" else None
    return StoreBackend(request.param, tmp_path, cluster)


def opened(backend: StoreBackend, retention: Retention | None = SMALL) -> Any:
    return open_store(backend.data_dir, url=backend.url, retention=retention)


@pytest.fixture
async def store(backend: StoreBackend) -> AsyncIterator[Store]:
    async with opened(backend) as s:
        yield s


def rows_of(backend: StoreBackend, session_id: str) -> list[str]:
    return [
        r[0]
        for r in backend.query(
            f"SELECT text FROM transcript WHERE session_id = '{session_id}' ORDER BY id"
        )
    ]


async def fill(store: Store, session_id: str, n: int, *, at: float, first: int = 0) -> None:
    for i in range(first, first + n):
        await store.append_transcript("bot", session_id, "user", f"r{i}", at=at, completed=True)


async def test_prune_keeps_each_session_s_newest_rows(store: Store, backend: StoreBackend) -> None:
    await store.prune(now=T0)  # the first prune (every session) is behind us
    await fill(store, "long", KEEP + 30, at=T0)
    await fill(store, "short", 5, at=T0)
    await store.prune(now=T0 + 60)
    assert rows_of(backend, "long") == [f"r{i}" for i in range(30, KEEP + 30)]
    assert rows_of(backend, "short") == [f"r{i}" for i in range(5)]
    page = await store.transcript_page("long", before_id=None, limit=3)
    assert [r.text for r in page] == [f"r{KEEP + 29}", f"r{KEEP + 28}", f"r{KEEP + 27}"]


async def test_rows_written_by_turns_count_as_well(store: Store, backend: StoreBackend) -> None:
    await store.prune(now=T0)
    for i in range(KEEP):
        turn = TurnRecord(
            session_id="s",
            user_text=f"q{i}",
            user_at=T0,
            answer_text=f"a{i}",
            answer_at=T0,
            completed=True,
            delivered=[],
            inbox_done=[],
        )
        await store.record_turn("bot", "c", turn, now=T0)
    await store.mark_delivered("bot", [], prompt=PromptRow(session_id="s", text="last", at=T0))
    await store.prune(now=T0 + 60)
    rows = rows_of(backend, "s")
    assert len(rows) == KEEP and rows[-1] == "last" and rows[0] == f"a{KEEP // 2}"


async def test_the_first_prune_after_a_restart_cuts_every_session(
    backend: StoreBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend.module, "PRUNE_SESSIONS", 2)  # the sweep goes in pages
    async with opened(backend, None) as store:  # the defaults: nothing is over
        for s in range(5):
            await fill(store, f"s{s}", KEEP + s, at=T0)
        await store.prune(now=T0)
        assert len(backend.query("SELECT id FROM transcript")) == 5 * KEEP + 10
    async with opened(backend) as store:  # KEEP: a new instance never wrote to them
        await store.prune(now=T0 + 60)
        for s in range(5):
            assert rows_of(backend, f"s{s}") == [f"r{i}" for i in range(s, KEEP + s)]
        # Then only the sessions written to since: another over the cut waits for a write.
        await fill(store, "s0", 3, at=T0, first=KEEP)
        await fill(store, "s1", 3, at=T0, first=KEEP + 1)
        await store.prune(now=T0 + 120)
        assert rows_of(backend, "s0") == [f"r{i}" for i in range(3, KEEP + 3)]
        assert rows_of(backend, "s1") == [f"r{i}" for i in range(4, KEEP + 4)]


async def test_old_rows_of_a_session_no_binding_names_go(
    store: Store, backend: StoreBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(backend.module, "PRUNE_BATCH", 3)  # several windows of rows
    await store.set_binding("bot", "c1", "", "open", title=None, now=T0)
    await store.set_binding("bot", "c2", "t", "threaded", title=None, now=T0)
    await fill(store, "open", 4, at=T0)
    await fill(store, "threaded", 2, at=T0)
    await fill(store, "closed", 7, at=T0)
    await fill(store, "closed", 2, at=T0 + 5 * DAY, first=7)
    await fill(store, "open", 2, at=T0 + 11 * DAY, first=4)
    now = T0 + 11 * DAY
    await store.prune(now=now)  # cutoff T0 + DAY
    assert rows_of(backend, "closed") == ["r7", "r8"]  # younger than 10 days: kept
    assert rows_of(backend, "open") == [f"r{i}" for i in range(6)]  # bound: kept, however old
    assert rows_of(backend, "threaded") == ["r0", "r1"]
    # /new: c1's old session is no binding's any more; its old rows go at the next sweep.
    await store.set_binding("bot", "c1", "", "next", title=None, now=now)
    assert await store.clear_binding("bot", "c2", "t")
    await store.prune(now=now + 60)
    assert rows_of(backend, "open") == ["r4", "r5"]
    assert rows_of(backend, "threaded") == []
    await store.prune(now=T0 + 16 * DAY)
    assert rows_of(backend, "closed") == []


async def test_without_old_rows_the_sweep_reads_one_window(
    store: Store, backend: StoreBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The age sweep stops at the first window of rows newer than the cutoff."""
    monkeypatch.setattr(backend.module, "PRUNE_BATCH", 2)
    windows: list[int] = []
    expire = backend.module._transcript_expire

    def counting(conn: Any, after_id: int, cutoff: float, limit: int) -> int | None:
        windows.append(after_id)
        result: int | None = expire(conn, after_id, cutoff, limit)
        return result

    monkeypatch.setattr(backend.module, "_transcript_expire", counting)
    await fill(store, "closed", 3, at=T0)
    await fill(store, "closed", 6, at=T0 + 20 * DAY, first=3)
    await store.prune(now=T0 + 20 * DAY)
    assert rows_of(backend, "closed") == [f"r{i}" for i in range(3, 9)]
    assert len(windows) == 3  # [r0 r1] [r2 r3]: cut; [r4 r5]: all newer, stop


async def test_a_long_run_keeps_the_transcript_bounded(store: Store, backend: StoreBackend) -> None:
    """Sessions come and go (``/new`` every two days), a day passes between sweeps: the
    transcript holds each session's newest KEEP rows, and the closed sessions' only for
    10 days -- without retention it would reach 40 x 60 rows."""
    now = T0
    counts: list[int] = []
    for day in range(40):
        session = f"s{day // 2}"
        await store.set_binding("bot", "c", "", session, title=None, now=now)
        await fill(store, session, 60, at=now, first=day * 60)
        now += DAY
        await store.prune(now=now)
        counts.append(len(backend.query("SELECT id FROM transcript")))
    # Within 10 days: at most 6 sessions (5 closed, 1 open), each cut to KEEP.
    assert max(counts) <= 6 * KEEP
    assert counts[-1] == counts[-3] == counts[-5]  # steady: as much goes as comes
    assert len(rows_of(backend, "s19")) == KEEP  # the open session: its newest KEEP


# -- configuration ---------------------------------------------------------------------------


def test_the_store_section_bounds_retention() -> None:
    assert StoreSection().transcript_keep == TRANSCRIPT_KEEP == 1000
    assert StoreSection().transcript_max_age_s == TRANSCRIPT_MAX_AGE_S == 90 * DAY
    with pytest.raises(ValueError, match="transcript_keep"):
        StoreSection(transcript_keep=99)
    with pytest.raises(ValueError, match="transcript_max_age_s"):
        StoreSection(transcript_max_age_s=3600)
    assert StoreSection(transcript_keep=100, transcript_max_age_s=DAY).transcript_keep == 100


def test_the_store_url_from_the_environment_keeps_the_retention() -> None:
    from dshim.config import Config

    config = Config(store=StoreSection(transcript_keep=500, transcript_max_age_s=7 * DAY))
    applied = apply_store_env(config, {"DSHIM_STORE_URL": "postgresql://u@h:5432/d"})
    assert applied.store.url == "postgresql://u@h:5432/d"
    assert (applied.store.transcript_keep, applied.store.transcript_max_age_s) == (500, 7 * DAY)
    with pytest.raises(ConfigError):
        apply_store_env(config, {"DSHIM_STORE_URL": "mysql://x"})


async def test_the_configured_retention_reaches_the_store(tmp_path: Path) -> None:
    from dshim.config import Config

    config = Config(store=StoreSection(transcript_keep=100))
    async with open_store_from_config(config, tmp_path) as store:
        await store.prune(now=T0)
        await fill(store, "s", 130, at=T0)
        await store.prune(now=T0 + 60)
    with contextlib.closing(sqlite3.connect(tmp_path / DB_FILENAME)) as conn:
        assert conn.execute("SELECT count(*) FROM transcript").fetchone() == (100,)


# -- migrations from the previous schema -----------------------------------------------------


async def test_a_version_7_sqlite_store_gains_the_session_index_and_keeps_its_rows(
    tmp_path: Path,
) -> None:
    db = tmp_path / "store.sqlite3"
    with contextlib.closing(sqlite3.connect(db, isolation_level=None)) as conn:
        schema_at(conn, 7)
        conn.execute("INSERT INTO bindings VALUES ('bot', 'c', '', 's', NULL, ?, ?)", (T0, T0))
        for i in range(3):
            conn.execute(
                "INSERT INTO transcript (bot, session_id, role, text, at, completed)"
                " VALUES ('bot', 's', 'user', ?, ?, 1)",
                (f"r{i}", T0),
            )
    with structlog.testing.capture_logs() as logs:
        async with open_sqlite_store(db) as store:
            assert await store.schema_version() == SCHEMA_VERSION == 8
            binding = await store.get_binding("bot", "c", "")
            assert binding is not None and binding.session_id == "s"
            await store.prune(now=T0 + 365 * DAY)  # bound: kept however old
            page = await store.transcript_page("s", before_id=None, limit=10)
            assert [r.text for r in page] == ["r2", "r1", "r0"]
    [migrated] = [e for e in logs if e["event"] == "store_migrated"]
    assert (migrated["from_schema"], migrated["schema"]) == (7, 8)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        plan = conn.execute(
            "EXPLAIN QUERY PLAN SELECT 1 FROM bindings WHERE session_id = 's'"
        ).fetchall()
    assert "bindings_session" in str(plan)


async def test_a_schema_3_postgres_store_gains_the_session_index_and_keeps_its_rows(
    pg_cluster: PgCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = pg_cluster.fresh_url()
    assert pg_store.SCHEMA_VERSION == 4
    monkeypatch.setattr(pg_store, "MIGRATIONS", pg_store.MIGRATIONS[:3])
    monkeypatch.setattr(pg_store, "SCHEMA_VERSION", 3)
    with trio.fail_after(30):
        async with open_postgres_store(url) as old:
            assert await old.schema_version() == 3
            await old.set_binding("bot", "c", "", "s", title=None, now=T0)
            await fill(old, "s", 3, at=T0)
            await fill(old, "gone", 2, at=T0)
            await old.relay_put("bot", b"body", now=T0 + 365 * DAY)
        monkeypatch.undo()
        with structlog.testing.capture_logs() as logs:
            async with open_postgres_store(url, retention=SMALL) as store:
                assert await store.schema_version() == 4
                await store.prune(now=T0 + 365 * DAY)
                page = await store.transcript_page("s", before_id=None, limit=10)
                assert [r.text for r in page] == ["r2", "r1", "r0"]
                assert await store.transcript_page("gone", before_id=None, limit=10) == []
                assert len(await store.relay_pending("bot", limit=10)) == 1
    [migrated] = [e for e in logs if e["event"] == "store_migrated"]
    assert (migrated["from_schema"], migrated["schema"]) == (3, 4)
    names = pg_cluster.query(url, "SELECT indexname FROM pg_indexes WHERE tablename = 'bindings'")
    assert ("bindings_session",) in names
