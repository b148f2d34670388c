"""The data directory's lock: one ``dshim serve`` per data directory.

Two processes serving the same store would both answer every bot (two pollers, two
replies, two turns of one inbox entry).  So ``serve`` holds an exclusive ``flock`` on
``<data_dir>/dshim.lock`` for its whole life and a second one refuses to start.  The
kernel drops the lock with the process, however it ends (a crash or ``kill -9`` leaves
no stale lock behind); the file itself stays.  It holds the owner's pid, for the message.

``dshim probe`` and ``dshim replay`` do not take it: probe shares the store with a
running serve as SQLite allows (WAL), replay runs on a store of its own.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dshim.errors import StoreError

#: The lock file's name inside the data directory.
LOCK_FILENAME = "dshim.lock"


@contextmanager
def hold_data_dir_lock(data_dir: Path) -> Iterator[None]:
    """Hold the exclusive lock on ``data_dir`` for the block (without waiting for it).

    Raises :class:`~dshim.errors.StoreError` naming the directory (and the holder's pid
    when it is known) when another process holds it, or when the lock file cannot be
    opened.
    """
    path = data_dir / LOCK_FILENAME
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StoreError(f"cannot open the lock file {path}: {exc.strerror or exc}") from exc
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            raise StoreError(
                f"another dshim serve{f' (pid {holder})' if holder else ''} is running on the "
                f"data directory {data_dir}: stop it first, or give this one its own "
                "--data-dir"
            ) from None
        except OSError as exc:
            raise StoreError(f"cannot lock {path}: {exc.strerror or exc}") from exc
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:
            raise StoreError(f"cannot write {path}: {exc.strerror or exc}") from exc
        yield
    finally:
        os.close(fd)  # releases the lock


def _holder(fd: int) -> int | None:
    """The pid the lock's holder wrote into the file, if it did."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
