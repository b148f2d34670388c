"""The persistent store (DESIGN §7): one narrow interface, SQLite as the embedded default.

:func:`open_store` is what the application calls; :mod:`dshim.store.base` defines the
interface and its records, :mod:`dshim.store.sqlite` the default implementation (one file in
the data directory) and :mod:`dshim.store.postgres` the shared one (a PostgreSQL database,
``[store] url``).  :func:`open_store_from_config` picks the backend from the configuration.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from dshim.store.base import (
    Binding,
    InboxEntry,
    LoggedMessage,
    OutboundEntry,
    Retention,
    Store,
    TranscriptRow,
)

if TYPE_CHECKING:
    from dshim.config import Config

__all__ = [
    "DB_FILENAME",
    "Binding",
    "InboxEntry",
    "LoggedMessage",
    "OutboundEntry",
    "Retention",
    "Store",
    "TranscriptRow",
    "open_store",
    "open_store_from_config",
    "read_schema_version",
    "store_target",
]

#: The store's file name inside the data directory.
DB_FILENAME = "dshim.sqlite3"


@asynccontextmanager
async def open_store(
    data_dir: Path,
    *,
    inline: bool = False,
    url: str | None = None,
    password: str | None = None,
    retention: Retention | None = None,
) -> AsyncIterator[Store]:
    """Open the store: the PostgreSQL database at ``url`` when given, else the SQLite file
    ``<data_dir>/dshim.sqlite3``.  The data directory is created with mode 0700 if missing
    either way (the channels keep their files there).

    Migrates the schema first (on PostgreSQL under an advisory lock).  Raises
    :class:`~dshim.errors.StoreError` if the store cannot be opened or migrated.
    ``inline``: see :func:`~dshim.store.sqlite.open_sqlite_store`.  ``password``: the
    database's, when the URL has none (never logged).  ``retention``: how long ``prune``
    keeps transcripts (:class:`~dshim.store.base.Retention`'s defaults when None).
    """
    # Imported here: the records above are light, the backends and their threads are not
    # (channels import dshim.store.base without pulling an implementation in).
    if inline:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # noqa: ASYNC240
    else:
        await trio.Path(data_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    if url is not None:
        _need_psycopg()
        from dshim.store.postgres import open_postgres_store

        async with open_postgres_store(
            url, password=password, inline=inline, data_dir=data_dir, retention=retention
        ) as pg:
            yield pg
        return
    from dshim.store.sqlite import open_sqlite_store

    async with open_sqlite_store(
        data_dir / DB_FILENAME, inline=inline, retention=retention
    ) as store:
        yield store


def _need_psycopg() -> None:
    """StoreError when the PostgreSQL driver is not installed (the ``postgres`` extra)."""
    import importlib.util

    from dshim.errors import StoreError

    if (
        importlib.util.find_spec("psycopg") is None
        or importlib.util.find_spec("psycopg_pool") is None
    ):
        raise StoreError(
            "the PostgreSQL store ([store] url / DSHIM_STORE_URL) needs psycopg: "
            "pip install 'dshim[postgres]'"
        )


def _backend(config: Config | None) -> tuple[str | None, str | None]:
    from dshim.config import store_section

    section = store_section(config)
    password = section.password.get() if section.password is not None else None
    return section.url, password


@asynccontextmanager
async def open_store_from_config(
    config: Config | None,
    data_dir: Path,
    *,
    inline: bool = False,
) -> AsyncIterator[Store]:
    """:func:`open_store` with the backend the configuration names: ``[store] url`` (or
    ``DSHIM_STORE_URL``, applied when the configuration was parsed): PostgreSQL; else
    SQLite in ``data_dir``."""
    url, password = _backend(config)
    retention = _retention(config)
    async with open_store(
        data_dir, inline=inline, url=url, password=password, retention=retention
    ) as store:
        yield store


def _retention(config: Config | None) -> Retention:
    from dshim.config import store_section

    section = store_section(config)
    return Retention(
        transcript_keep=section.transcript_keep,
        transcript_max_age_s=section.transcript_max_age_s,
    )


def store_target(config: Config | None, data_dir: Path) -> str:
    """The store the configuration names, for messages: the SQLite file's path or the
    PostgreSQL URL without its password."""
    url, _ = _backend(config)
    if url is None:
        return str(data_dir / DB_FILENAME)
    _need_psycopg()
    from dshim.store.postgres import safe_target

    return safe_target(url)  # user, host, port and database: never the password


async def read_schema_version(config: Config | None, data_dir: Path) -> int:
    """The schema version of the store the configuration names, without migrating it
    (0: no store yet)."""
    url, password = _backend(config)
    if url is not None:
        _need_psycopg()
        from dshim.store.postgres import read_postgres_schema_version

        return await read_postgres_schema_version(url, password=password)
    return await trio.to_thread.run_sync(_sqlite_version, data_dir / DB_FILENAME)


def _sqlite_version(path: Path) -> int:
    """The SQLite store's ``user_version``, read-only (0: no file yet)."""
    import contextlib
    import sqlite3

    from dshim.errors import StoreError

    if not path.exists():
        return 0
    try:
        with contextlib.closing(sqlite3.connect(f"{path.as_uri()}?mode=ro", uri=True)) as conn:
            return int(conn.execute("PRAGMA user_version").fetchone()[0])
    except sqlite3.Error as exc:
        raise StoreError(f"cannot read store {path}: {exc}") from exc
