"""The message log the web chat keeps per conversation (SQLite schema version 3), on both
backends (a real SQLite file, a PostgreSQL schema of the test cluster)."""

from __future__ import annotations

import contextlib
import sqlite3
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dshim.model import Attachment
from dshim.store import Store
from dshim.store.base import BoundStore, LoggedMessage
from dshim.store.sqlite import (
    MESSAGE_LOG_CAP,
    MESSAGE_TEXT_MAX,
    SCHEMA_VERSION,
    open_sqlite_store,
)
from tests.helpers import schema_at
from tests.pgkit import BACKENDS, StoreBackend

T0 = 1_790_000_000.0


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "dshim.sqlite3"


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    cluster = request.getfixturevalue("pg_cluster") if request.param == "postgres" else None
    async with StoreBackend(request.param, tmp_path, cluster).open(inline=True) as s:
        yield s


def msg(mid: str, at: float, text: str = "hi", **kw: object) -> LoggedMessage:
    return LoggedMessage(message_id=mid, author_id="u1", author_name="Ann", text=text, at=at, **kw)  # type: ignore[arg-type]


async def test_a_message_is_logged_once_per_conversation(store: Store) -> None:
    first = msg("u1/k1", T0, "hello", client_id="k1", reply_to="b-1")
    assert await store.log_message("web", "c1", first, now=T0)
    assert not await store.log_message("web", "c1", msg("u1/k1", T0 + 5, "changed"), now=T0)
    assert await store.logged_message("web", "c1", "u1/k1") == first
    # The same id elsewhere is another message; another bot's log is its own.
    assert await store.logged_message("web", "c2", "u1/k1") is None
    assert await store.logged_message("other", "c1", "u1/k1") is None
    assert await store.log_message("web", "c2", msg("u1/k1", T0), now=T0)


async def test_attachments_and_the_bot_flag_come_back(store: Store) -> None:
    logged = LoggedMessage(
        message_id="b-1",
        author_id="bot:web",
        author_name="web",
        author_bot=True,
        text="",
        at=T0,
        attachments=[Attachment(kind="image", name="cat.png"), Attachment(kind="file")],
    )
    await store.log_message("web", "c1", logged, now=T0)
    assert await store.message_log("web", "c1", limit=10) == [logged]


async def test_the_log_reads_oldest_first_by_time_newest_limit(store: Store) -> None:
    # Logged out of order (an answer is logged when it is final, at its start time).
    for mid, at in [("a", T0), ("c", T0 + 2), ("b", T0 + 1), ("d", T0 + 3)]:
        await store.log_message("web", "c1", msg(mid, at), now=T0)
    assert [m.message_id for m in await store.message_log("web", "c1", limit=10)] == [
        "a",
        "b",
        "c",
        "d",
    ]
    assert [m.message_id for m in await store.message_log("web", "c1", limit=2)] == ["c", "d"]
    with pytest.raises(ValueError):
        await store.message_log("web", "c1", limit=0)


async def test_the_log_keeps_the_newest_per_conversation(store: Store) -> None:
    for i in range(MESSAGE_LOG_CAP + 3):
        await store.log_message("web", "c1", msg(f"m{i}", T0 + i), now=T0)
    await store.log_message("web", "c2", msg("other", T0), now=T0)
    kept = await store.message_log("web", "c1", limit=MESSAGE_LOG_CAP + 10)
    assert len(kept) == MESSAGE_LOG_CAP
    assert kept[0].message_id == "m3"
    assert await store.logged_message("web", "c1", "m0") is None
    assert await store.logged_message("web", "c2", "other") is not None


async def test_text_is_cut_to_its_limit(store: Store) -> None:
    await store.log_message("web", "c1", msg("m", T0, "x" * (MESSAGE_TEXT_MAX + 7)), now=T0)
    logged = await store.logged_message("web", "c1", "m")
    assert logged is not None and len(logged.text) == MESSAGE_TEXT_MAX


async def test_a_bound_store_is_one_bots_log(store: Store) -> None:
    web, other = BoundStore(store, "web"), BoundStore(store, "other")
    assert await web.log_message("c1", msg("m", T0), now=T0)
    assert await web.logged_message("c1", "m") is not None
    assert await other.logged_message("c1", "m") is None
    assert [m.message_id for m in await web.message_log("c1", limit=5)] == ["m"]


async def test_a_version_2_store_gains_the_log_and_keeps_its_data(db_path: Path) -> None:
    with contextlib.closing(sqlite3.connect(db_path, isolation_level=None)) as conn:
        schema_at(conn, 2)
        conn.execute("INSERT INTO cursors VALUES ('web', 'offset', '42')")
    async with open_sqlite_store(db_path) as store:
        assert await store.schema_version() == SCHEMA_VERSION >= 3
        assert await store.get_cursor("web", "offset") == "42"
        assert await store.log_message("web", "c1", msg("m", T0), now=T0)
    async with open_sqlite_store(db_path) as store:
        assert await store.logged_message("web", "c1", "m") is not None
