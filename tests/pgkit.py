"""A throwaway PostgreSQL cluster for the tests: initdb into a temporary directory, listening
on 127.0.0.1 only (a free port) and on a unix socket inside that directory, stopped and
removed at the end of the session.

The server never runs as root: when the tests do (CI), every PostgreSQL program runs as
the unprivileged ``postgres`` user (``runuser -u postgres --``), which owns the temporary
directory.  Authentication is ``trust`` (loopback only, a cluster nobody else knows of).
The binaries are Debian's (``/usr/lib/postgresql/<version>/bin``, the newest), or the
directory ``DSHIM_PG_BIN`` names; without them :func:`start_cluster` raises
:class:`PostgresMissing`, whose message says what to install (the tests fail, never skip).

Each test gets a schema of its own (:meth:`PgCluster.fresh_url`: a URL whose
``search_path`` is a new, empty schema), so tests never see each other's tables and need
no new database each.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg

#: The database the tests use.
DATABASE = "dshim_test"
#: The unprivileged user the server runs as when the tests run as root.
SERVER_USER = "postgres"
INSTALL_HINT = (
    "PostgreSQL is needed by the store tests (a throwaway cluster started by the tests): "
    "install Debian's postgresql package (apt-get install -y postgresql), or name the "
    "directory of initdb and pg_ctl in DSHIM_PG_BIN"
)


class PostgresMissing(RuntimeError):
    """No PostgreSQL binaries: what to install."""


def find_bin_dir() -> Path:
    """The directory of ``initdb`` and ``pg_ctl``; PostgresMissing when there is none."""
    named = os.environ.get("DSHIM_PG_BIN")
    candidates = [named] if named else []
    found = glob.glob("/usr/lib/postgresql/*/bin")
    found.sort(key=lambda p: [int(x) for x in Path(p).parent.name.split(".") if x.isdigit()])
    candidates.extend(reversed(found))
    for candidate in candidates:
        path = Path(candidate)
        if (path / "initdb").is_file() and (path / "pg_ctl").is_file():
            return path
    raise PostgresMissing(INSTALL_HINT)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PgCluster:
    """A running cluster: its port, superuser and database; :meth:`stop` ends it."""

    bin_dir: Path
    root: Path
    port: int
    user: str
    as_user: list[str]
    _schemas: Iterator[int] = field(default_factory=itertools.count)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        return self.root / "sock"

    def url(self, database: str = DATABASE, *, schema: str | None = None) -> str:
        """A URL of the cluster over TCP on 127.0.0.1 (``schema``: its search_path)."""
        query = ""
        if schema is not None:
            query = "?" + urllib.parse.urlencode({"options": f"-csearch_path={schema}"})
        return f"postgresql://{self.user}@127.0.0.1:{self.port}/{database}{query}"

    def connect(self, url: str | None = None) -> psycopg.Connection[Any]:
        """A plain autocommit connection (for the tests' own queries)."""
        return psycopg.connect(url or self.url(), autocommit=True)

    def fresh_url(self, prefix: str = "t") -> str:
        """The URL of a new, empty schema of the test database."""
        name = f"{prefix}_{os.getpid()}_{next(self._schemas)}"
        with contextlib.closing(self.connect()) as conn:
            conn.execute(f'CREATE SCHEMA "{name}"')  # type: ignore[arg-type]
        return self.url(schema=name)

    def query(self, url: str, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        """Run SQL through a separate plain connection to ``url``."""
        with contextlib.closing(self.connect(url)) as conn:
            cur = conn.execute(sql, params)  # type: ignore[arg-type]
            return cur.fetchall() if cur.description is not None else []

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*self.as_user, *args], check=check, capture_output=True, text=True, timeout=120
        )

    def stop(self) -> None:
        """Stop the server at once and remove its directory."""
        try:
            if (self.data / "postmaster.pid").exists():
                self.run(
                    str(self.bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                    "-w", "stop", check=False,
                )  # fmt: skip
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def start_cluster() -> PgCluster:
    """initdb, start (waiting until it accepts connections) and create the test database."""
    bin_dir = find_bin_dir()
    root = Path(tempfile.mkdtemp(prefix="dshim-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        try:
            entry = pwd.getpwnam(SERVER_USER)
        except KeyError:
            shutil.rmtree(root, ignore_errors=True)
            raise PostgresMissing(
                f"the tests run as root, and there is no {SERVER_USER!r} user to run the "
                f"server as; {INSTALL_HINT}"
            ) from None
        os.chown(root, entry.pw_uid, entry.pw_gid)
        as_user = ["runuser", "-u", SERVER_USER, "--"]
    root.chmod(0o700)
    cluster = PgCluster(bin_dir, root, 0, "postgres", as_user)
    try:
        cluster.socket_dir.mkdir()
        if as_user:
            os.chown(cluster.socket_dir, entry.pw_uid, entry.pw_gid)
        init = cluster.run(
            str(bin_dir / "initdb"), "-D", str(cluster.data), "-U", cluster.user,
            "-A", "trust", "-E", "UTF8", "--locale=C", "--no-sync", check=False,
        )  # fmt: skip
        if init.returncode != 0:
            raise RuntimeError(f"initdb failed:\n{init.stdout}\n{init.stderr}")
        for _attempt in range(5):  # a free port may be taken before the server binds it
            cluster.port = free_port()
            options = " ".join(
                [
                    "-c listen_addresses=127.0.0.1",
                    f"-c port={cluster.port}",
                    f"-c unix_socket_directories={cluster.socket_dir}",
                    "-c fsync=off -c synchronous_commit=off -c full_page_writes=off",
                    "-c max_connections=200",
                ]
            )
            started = cluster.run(
                str(bin_dir / "pg_ctl"), "-D", str(cluster.data), "-l",
                str(cluster.root / "server.log"), "-w", "-t", "60", "-o", options, "start",
                check=False,
            )  # fmt: skip
            if started.returncode == 0:
                break
        else:
            log = (cluster.root / "server.log").read_text(errors="replace")
            raise RuntimeError(f"pg_ctl start failed:\n{started.stderr}\n{log[-4000:]}")
        with contextlib.closing(cluster.connect(cluster.url("postgres"))) as conn:
            conn.execute(f'CREATE DATABASE "{DATABASE}"')  # type: ignore[arg-type]
    except BaseException:
        cluster.stop()
        raise
    atexit.register(cluster.stop)  # even when the session ends without its teardown
    return cluster


class StoreBackend:
    """One backend of the shared store tests: the same store each time :meth:`open` is
    called in a test (SQLite: a file in the test's directory; PostgreSQL: a schema of its
    own), and :meth:`query` to look at its tables through a separate plain connection."""

    def __init__(self, name: str, tmp_path: Path, cluster: PgCluster | None) -> None:
        self.name = name
        self.data_dir = tmp_path / "data"
        self.cluster = cluster
        self.url: str | None = None
        if name == "postgres":
            assert cluster is not None
            self.url = cluster.fresh_url()

    @property
    def module(self) -> Any:
        """The backend's module (its constants: PRUNE_BATCH, SCHEMA_VERSION ...)."""
        if self.name == "postgres":
            import dshim.store.postgres as module
        else:
            import dshim.store.sqlite as module  # type: ignore[no-redef]
        return module

    @property
    def error_type(self) -> type[BaseException]:
        """The driver's error class (a StoreError's cause)."""
        if self.name == "postgres":
            return psycopg.Error
        import sqlite3

        return sqlite3.Error

    def open(self, *, inline: bool = False) -> Any:
        from dshim.store import open_store

        return open_store(self.data_dir, inline=inline, url=self.url)

    def query(self, sql: str) -> list[tuple[Any, ...]]:
        if self.url is not None:
            assert self.cluster is not None
            return self.cluster.query(self.url, sql)
        import sqlite3

        from dshim.store import DB_FILENAME

        with contextlib.closing(sqlite3.connect(self.data_dir / DB_FILENAME)) as conn:
            with conn:
                return conn.execute(sql).fetchall()

    def fail_inserts(self, table: str, message: str) -> None:
        """Make every insert into ``table`` fail with ``message`` (fault injection)."""
        if self.url is None:
            self.query(
                f"CREATE TRIGGER fail_{table} BEFORE INSERT ON {table}"
                f" BEGIN SELECT RAISE(ABORT, '{message}'); END"
            )
            return
        self.query(
            f"CREATE FUNCTION fail_{table}() RETURNS trigger LANGUAGE plpgsql"
            f" AS $$ BEGIN RAISE EXCEPTION '{message}'; END $$"
        )
        self.query(
            f"CREATE TRIGGER fail_{table} BEFORE INSERT ON {table}"
            f" FOR EACH ROW EXECUTE FUNCTION fail_{table}()"
        )

    def stop_failing(self, table: str) -> None:
        if self.url is None:
            self.query(f"DROP TRIGGER fail_{table}")
        else:
            self.query(f"DROP TRIGGER fail_{table} ON {table}")


#: The backends of the shared store tests.
BACKENDS = ("sqlite", "postgres")
