"""What only the PostgreSQL store has: migrations under the advisory lock, dedup that is
global across connections, the password kept out of messages and logs; and the
PostgreSQL counterparts of the SQLite-only tests of tests/test_store.py.

Every test runs on the session's throwaway cluster (:mod:`tests.pgkit`), in a schema of
its own.  The shared behaviour of both backends is tested in tests/test_store.py.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import structlog
import trio
from typer.testing import CliRunner

import dshim.store.postgres as pg_store
import dshim.store.sqlite as sqlite_store
from dshim.channels.registry import default_config, load_config
from dshim.errors import ConfigError, StoreError
from dshim.store import Store, open_store, open_store_from_config, read_schema_version
from dshim.store.postgres import (
    SCHEMA_VERSION,
    Migration,
    open_postgres_store,
    redact,
    safe_target,
)
from tests.helpers import while_locked_elsewhere
from tests.pgkit import PgCluster

T0 = 1_790_000_000.0
TABLES = {
    "anchors",
    "bindings",
    "cursors",
    "dedup",
    "dshim_schema",
    "inbox",
    "inbox_state",
    "instances",
    "last_direct",
    "leases",
    "messages",
    "outbound",
    "outbox",
    "relay",
    "transcript",
}


@pytest.fixture
def url(pg_cluster: PgCluster) -> str:
    return pg_cluster.fresh_url()


def schema_of(url: str) -> str:
    return url.rsplit("%3D", 1)[1]


def tables(cluster: PgCluster, url: str) -> set[str]:
    rows = cluster.query(
        url,
        f"SELECT table_name FROM information_schema.tables WHERE table_schema = '{schema_of(url)}'",
    )
    return {r[0] for r in rows}


# -- migrations --------------------------------------------------------------------------------


async def test_an_empty_database_is_migrated_to_the_current_schema(
    pg_cluster: PgCluster, url: str, tmp_path: Path
) -> None:
    assert tables(pg_cluster, url) == set()
    with structlog.testing.capture_logs() as logs:
        async with open_store(tmp_path, url=url) as store:
            assert await store.schema_version() == SCHEMA_VERSION >= 1
    assert tables(pg_cluster, url) == TABLES
    assert pg_cluster.query(url, "SELECT version FROM dshim_schema") == [(SCHEMA_VERSION,)]
    assert [e["event"] for e in logs if e["event"].startswith("store_")] == ["store_created"]
    # Reopening migrates nothing and logs nothing.
    with structlog.testing.capture_logs() as logs:
        async with open_store(tmp_path, url=url) as store:
            assert await store.schema_version() == SCHEMA_VERSION
    assert [e for e in logs if e["event"].startswith("store_")] == []


async def test_instances_migrating_together_make_one_schema_without_an_error(
    pg_cluster: PgCluster, url: str, tmp_path: Path
) -> None:
    versions: list[int] = []

    async def instance(i: int) -> None:
        async with open_store(tmp_path / f"i{i}", url=url) as store:
            versions.append(await store.schema_version())

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(instance, i)
    assert versions == [SCHEMA_VERSION] * 6
    assert pg_cluster.query(url, "SELECT version FROM dshim_schema") == [(SCHEMA_VERSION,)]
    assert tables(pg_cluster, url) == TABLES


async def test_migrations_wait_for_the_advisory_lock(
    pg_cluster: PgCluster, url: str, tmp_path: Path
) -> None:
    """Another session holding the lock (an instance migrating) holds the open back."""
    holder = pg_cluster.connect(url)
    holder.execute("SELECT pg_advisory_lock(%s)", (pg_store.ADVISORY_LOCK_KEY,))
    opened = trio.Event()

    async def open_one() -> None:
        async with open_store(tmp_path, url=url):
            opened.set()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(open_one)
            await trio.sleep(0.5)
            assert not opened.is_set()
            assert tables(pg_cluster, url) == set()
            holder.execute("SELECT pg_advisory_unlock(%s)", (pg_store.ADVISORY_LOCK_KEY,))
    holder.close()
    assert opened.is_set()


async def test_an_appended_migration_upgrades_an_existing_database(
    pg_cluster: PgCluster, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_store(tmp_path, url=url) as store:
        await store.set_cursor("bot", "offset", "9")
    upgraded = (*pg_store.MIGRATIONS, Migration("a probe", ("CREATE TABLE probe (x integer)",)))
    monkeypatch.setattr(pg_store, "MIGRATIONS", upgraded)
    monkeypatch.setattr(pg_store, "SCHEMA_VERSION", len(upgraded))
    for _ in range(2):
        with structlog.testing.capture_logs() as logs:
            async with open_store(tmp_path, url=url) as store:
                assert await store.schema_version() == SCHEMA_VERSION + 1
                assert await store.get_cursor("bot", "offset") == "9"
    assert pg_cluster.query(url, "SELECT count(*) FROM probe") == [(0,)]
    monkeypatch.undo()
    assert [e["event"] for e in logs if e["event"].startswith("store_")] == []
    # The older code refuses the upgraded database instead of misreading it.
    with pytest.raises(StoreError, match="newer"):
        async with open_store(tmp_path, url=url):
            pass


async def test_a_failed_migration_leaves_the_database_at_the_old_version(
    pg_cluster: PgCluster, url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with open_store(tmp_path, url=url):
        pass
    broken = (
        *pg_store.MIGRATIONS,
        Migration("broken", ("CREATE TABLE half (x integer)", "NOT SQL AT ALL")),
    )
    monkeypatch.setattr(pg_store, "MIGRATIONS", broken)
    monkeypatch.setattr(pg_store, "SCHEMA_VERSION", len(broken))
    with pytest.raises(StoreError, match="cannot migrate"):
        async with open_store(tmp_path, url=url):
            pass
    monkeypatch.undo()
    assert pg_cluster.query(url, "SELECT version FROM dshim_schema") == [(SCHEMA_VERSION,)]
    assert "half" not in tables(pg_cluster, url)


# -- global dedup ------------------------------------------------------------------------------


async def test_two_stores_racing_to_accept_one_message_let_exactly_one_through(
    url: str, tmp_path: Path
) -> None:
    """Two instances (two pools) get the same messages at the same moment: each message
    is accepted by exactly one of them, and has exactly one inbox entry."""
    won: dict[str, list[str]] = {}
    with trio.fail_after(60):
        async with (
            open_store(tmp_path / "a", url=url) as a,
            open_store(tmp_path / "b", url=url) as b,
        ):

            async def accept(name: str, store: Store, i: int) -> None:
                if await store.accept("bot", "c", f"m{i}", now=T0, ttl_s=600, raw=b"r"):
                    won.setdefault(f"m{i}", []).append(name)

            async with trio.open_nursery() as nursery:
                for i in range(100):
                    for name, store in (("a", a), ("b", b)) if i % 2 else (("b", b), ("a", a)):
                        for _ in range(2):
                            nursery.start_soon(accept, name, store, i)
            assert sorted(won) == sorted(f"m{i}" for i in range(100))
            assert all(len(names) == 1 for names in won.values()), won
            assert len(await a.inbox_pending("bot")) == 100
            # Both instances see every key as taken.
            assert not await b.accept("bot", "c", "m0", now=T0 + 1, ttl_s=600, raw=None)
            assert await a.seen("bot", "c", "m99", now=T0 + 1)


async def test_a_lock_held_elsewhere_never_stalls_the_trio_thread(
    pg_cluster: PgCluster, url: str, tmp_path: Path
) -> None:
    """Calls wait for another session's row lock in a worker thread; the bot's other
    tasks keep running meanwhile (the counterpart of SQLite's write-lock test)."""
    async with open_store(tmp_path, url=url) as store:
        assert await store.accept("bot", "c1", "m1", now=T0, ttl_s=60, raw=b"r")
        other = pg_cluster.connect(url)
        other.execute("BEGIN")
        other.execute("SELECT * FROM inbox FOR UPDATE")
        waited, ticks = await while_locked_elsewhere(
            lambda: store.inbox_done("bot", "c1", "m1"), lambda: other.execute("COMMIT")
        )
        other.close()
        assert waited >= 0.4
        assert ticks >= 20
        assert await store.inbox_pending("bot") == []


# -- text, errors, the password ------------------------------------------------------------------


async def test_a_nul_in_free_text_is_stored_as_a_replacement_character(url: str) -> None:
    from dshim.store.base import LoggedMessage

    async with open_postgres_store(url) as store:
        await store.set_binding("bot", "c1", "", "s1", title="a\x00b", now=T0)
        row = await store.append_transcript("bot", "s1", "user", "x\x00y", at=T0, completed=True)
        assert await store.log_message(
            "bot", "c1", LoggedMessage(message_id="m", author_id="u", text="\x00", at=T0), now=T0
        )
        binding = await store.get_binding("bot", "c1", "")
        assert binding is not None and binding.title == "a\ufffdb"
        [page] = await store.transcript_page("s1", before_id=None, limit=5)
        assert (page.id, page.text) == (row, "x\ufffdy")
        logged = await store.logged_message("bot", "c1", "m")
        assert logged is not None and logged.text == "\ufffd"


def test_the_password_never_shows_in_a_target_or_a_redacted_message() -> None:
    url = "postgresql://ann:s3cr%40t@db.example:6543/dshim?sslmode=require&password=other"
    assert safe_target(url) == "postgresql://ann@db.example:6543/dshim"
    assert "s3cr" not in safe_target(url) and "other" not in safe_target(url)
    message = f"failed: {url} and password=hunter2 and password='a b'"
    cleaned = redact(message, "hunter2")
    assert "s3cr" not in cleaned and "hunter2" not in cleaned and "'a b'" not in cleaned
    assert "postgresql://ann:***@db.example" in cleaned


async def test_an_unreachable_server_is_a_store_error_without_the_password(
    tmp_path: Path,
) -> None:
    from tests.pgkit import free_port

    url = f"postgresql://ann:Sup3rSecret@127.0.0.1:{free_port()}/dshim"
    with structlog.testing.capture_logs() as logs:
        with pytest.raises(StoreError) as info:
            async with open_store(tmp_path, url=url):
                pass
    assert "Sup3rSecret" not in str(info.value)
    assert f"postgresql://ann@127.0.0.1:{url.rsplit(':', 1)[1].split('/')[0]}/dshim" in str(
        info.value
    )
    assert "Sup3rSecret" not in repr(logs)
    with pytest.raises(StoreError) as info:
        async with open_store(tmp_path, url=url, password="An0therSecret"):
            pass
    assert "An0therSecret" not in str(info.value) and "Sup3rSecret" not in str(info.value)


async def test_a_password_given_apart_from_the_url_is_used_and_never_logged(
    pg_cluster: PgCluster, url: str, tmp_path: Path
) -> None:
    # A role that needs its password (the cluster trusts loopback, so the server checks
    # nothing; the password still has to travel without showing anywhere).
    with structlog.testing.capture_logs() as logs:
        async with open_store(tmp_path, url=url, password="N0tInTheLogs") as store:
            await store.set_cursor("bot", "k", "v")
    assert "N0tInTheLogs" not in repr(logs)
    assert all("N0tInTheLogs" not in str(e.get("url", "")) for e in logs)


async def test_a_closed_store_says_so_without_a_round_trip(url: str) -> None:
    async with open_postgres_store(url) as store:
        pass
    with pytest.raises(StoreError, match="closed"):
        await store.accept("bot", "c", "m", now=T0, ttl_s=1, raw=None)


async def test_a_lost_connection_is_a_store_error_and_the_next_call_reconnects(
    pg_cluster: PgCluster, url: str
) -> None:
    async with open_postgres_store(url) as store:
        await store.set_cursor("bot", "k", "1")
        pg_cluster.query(
            pg_cluster.url(),
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE application_name = 'dshim' AND pid <> pg_backend_pid()",
        )
        with contextlib.suppress(StoreError):  # the broken connection fails its call
            await store.get_cursor("bot", "k")
        assert await store.get_cursor("bot", "k") == "1"


# -- configuration and the command line ---------------------------------------------------------


def write_config(tmp_path: Path, store: str) -> Path:
    path = tmp_path / "dshim.toml"
    path.write_text(
        f'[harness]\nkind = "echo"\n\n{store}\n[[bots]]\nname = "web"\nchannel = "webchat"\n'
    )
    return path


def test_store_url_password_and_lease_are_read_and_checked(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[store]\nurl = "postgresql://ann@db:5432/dshim"\nlease_s = 9\n')
    config = load_config(path, {})
    assert (config.store.url, config.store.password, config.store.lease_s) == (
        "postgresql://ann@db:5432/dshim",
        None,
        9.0,
    )
    # The whole URL from the environment: its password moves into a Secret.
    path = write_config(tmp_path, '[store]\nurl = "${DB_URL}"\n')
    config = load_config(path, {"DB_URL": "postgresql://ann:pw%2F1@db/dshim"})
    assert config.store.url == "postgresql://ann@db/dshim"
    assert config.store.password is not None and config.store.password.get() == "pw/1"
    assert "pw/1" in config.secrets()
    path = write_config(tmp_path, '[store]\nurl = "postgresql://ann@db/d"\npassword = "${PW}"\n')
    config = load_config(path, {"PW": "x1"})
    assert config.store.password is not None and config.store.password.get() == "x1"
    # Without a url: SQLite, lease_s accepted.
    assert load_config(write_config(tmp_path, ""), {}).store.url is None

    for store, wanted in [
        ('[store]\nurl = "postgresql://ann:hunter2@db/dshim"\n', "never written in the file"),
        ('[store]\nurl = "postgresql://db/d?password=hunter2"\n', "never written in the file"),
        ('[store]\nurl = "postgresql://db/d"\npassword = "hunter2"\n', "store.password"),
        ('[store]\nurl = "mysql://db/d"\n', "postgresql://"),
        ("[store]\nlease_s = 1\n", "lease_s"),
        ('[store]\nurl = "postgresql://db/d"\nlease_s = 301\n', "lease_s"),
        ('[store]\npassword = "${PW}"\n', "only with url"),
        ('[store]\nurl = "postgresql://db/d"\nbogus = 1\n', "bogus"),
    ]:
        with pytest.raises(ConfigError, match=wanted) as info:
            load_config(write_config(tmp_path, store), {"PW": "x"})
        assert "hunter2" not in str(info.value)


def test_dshim_store_url_wins_over_the_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[store]\nurl = "postgresql://file@db/d"\nlease_s = 6\n')
    env = {"DSHIM_STORE_URL": "postgresql://env:pw@other/d2"}
    config = load_config(path, env)
    assert config.store.url == "postgresql://env@other/d2"
    assert config.store.password is not None and config.store.password.get() == "pw"
    assert config.store.lease_s == 6.0
    assert default_config(env).store.url == "postgresql://env@other/d2"
    with pytest.raises(ConfigError, match="DSHIM_STORE_URL") as info:
        load_config(path, {"DSHIM_STORE_URL": "https://x:pw@y/"})
    assert "pw" not in str(info.value)


async def test_open_store_from_config_picks_the_backend(
    pg_cluster: PgCluster, url: str, tmp_path: Path
) -> None:
    sqlite_config = default_config({})
    assert await read_schema_version(sqlite_config, tmp_path) == 0
    async with open_store_from_config(sqlite_config, tmp_path) as store:
        await store.set_cursor("bot", "where", "sqlite")
    assert (tmp_path / "dshim.sqlite3").is_file()
    pg_config = default_config({"DSHIM_STORE_URL": url})
    assert await read_schema_version(pg_config, tmp_path / "pg") == 0
    async with open_store_from_config(pg_config, tmp_path / "pg") as store:
        assert await store.get_cursor("bot", "where") is None
        await store.set_cursor("bot", "where", "postgres")
        assert getattr(store, "data_dir", None) == tmp_path / "pg"
    assert await read_schema_version(pg_config, tmp_path / "pg") == SCHEMA_VERSION
    assert pg_cluster.query(url, "SELECT value FROM cursors") == [("postgres",)]


def run_cli(args: list[str], env: dict[str, str]) -> Any:
    """``dshim ARGS`` in this process; the logging it set up (onto the runner's stream,
    closed afterwards) is taken down again."""
    import logging

    from dshim.cli import app

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    config_before = structlog.get_config()
    try:
        return CliRunner().invoke(app, args, env=env)
    finally:
        for handler in root.handlers[:]:
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
        structlog.configure(**config_before)


def test_dshim_migrate_prints_the_version_before_and_after(
    pg_cluster: PgCluster, url: str, tmp_path: Path
) -> None:
    env = {"DSHIM_STORE_URL": url, "DSHIM_CONFIG": "", "DSHIM_DATA_DIR": str(tmp_path / "d")}
    first = run_cli(["--log-level", "warning", "migrate"], env)
    assert first.exit_code == 0, first.output
    assert f"schema version 0 -> {SCHEMA_VERSION}" in first.output
    assert "postgresql://postgres@127.0.0.1" in first.output
    again = run_cli(["--log-level", "warning", "migrate"], env)
    assert again.exit_code == 0, again.output
    assert f"schema version {SCHEMA_VERSION} -> {SCHEMA_VERSION} (already up to date)" in (
        again.output
    )
    assert tables(pg_cluster, url) == TABLES
    # SQLite in the data directory without a URL.
    env = {"DSHIM_CONFIG": "", "DSHIM_DATA_DIR": str(tmp_path / "s")}
    sqlite = run_cli(["--log-level", "warning", "migrate"], env)
    assert sqlite.exit_code == 0, sqlite.output
    assert f"dshim.sqlite3: schema version 0 -> {sqlite_store.SCHEMA_VERSION}" in sqlite.output
    # An unreachable server: exit 1, one line, no password.
    from tests.pgkit import free_port

    env = {
        "DSHIM_STORE_URL": f"postgresql://u:Hidden1@127.0.0.1:{free_port()}/x",
        "DSHIM_CONFIG": "",
        "DSHIM_DATA_DIR": str(tmp_path / "d"),
    }
    failed = run_cli(["--log-level", "warning", "migrate"], env)
    assert failed.exit_code == 1
    assert "Hidden1" not in failed.output


def test_without_postgresql_the_kit_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import tests.pgkit as pgkit

    monkeypatch.setattr(pgkit.glob, "glob", lambda pattern: [])
    monkeypatch.setenv("DSHIM_PG_BIN", str(tmp_path / "nothing-here"))
    with pytest.raises(pgkit.PostgresMissing, match=r"apt-get install -y postgresql"):
        pgkit.find_bin_dir()
    monkeypatch.delenv("DSHIM_PG_BIN")
    with pytest.raises(pgkit.PostgresMissing, match="Debian's postgresql package"):
        pgkit.start_cluster()
