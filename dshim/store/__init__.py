"""The persistent store (DESIGN §7): one narrow interface, SQLite as the embedded default.

:func:`open_store` is what the application calls; :mod:`dshim.store.base` defines the
interface and its records, :mod:`dshim.store.sqlite` the implementation.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from dshim.store.base import (
    Binding,
    InboxEntry,
    LoggedMessage,
    OutboundEntry,
    Store,
    TranscriptRow,
)

__all__ = [
    "DB_FILENAME",
    "Binding",
    "InboxEntry",
    "LoggedMessage",
    "OutboundEntry",
    "Store",
    "TranscriptRow",
    "open_store",
]

#: The store's file name inside the data directory.
DB_FILENAME = "dshim.sqlite3"


@asynccontextmanager
async def open_store(data_dir: Path, *, inline: bool = False) -> AsyncIterator[Store]:
    """Open the store in ``data_dir`` (created with mode 0700 if missing).

    The database is ``<data_dir>/dshim.sqlite3``.  Raises
    :class:`~dshim.errors.StoreError` if it cannot be opened or migrated.  ``inline``: see
    :func:`~dshim.store.sqlite.open_sqlite_store`.
    """
    # Imported here: the records above are light, SQLite and its worker thread are not
    # (channels import dshim.store.base without pulling the implementation in).
    from dshim.store.sqlite import open_sqlite_store

    if inline:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)  # noqa: ASYNC240
    else:
        await trio.Path(data_dir).mkdir(mode=0o700, parents=True, exist_ok=True)
    async with open_sqlite_store(data_dir / DB_FILENAME, inline=inline) as store:
        yield store
