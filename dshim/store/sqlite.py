"""The embedded SQLite store: one WAL-mode file under the data directory.

Tables (schema version 8; see :data:`MIGRATIONS`):

``dedup``        (bot, conversation_id, message_id) -> expires_at.  Accepted inbound keys;
                 a key whose ``expires_at <= now`` counts as unseen and is replaced.
``inbox``        (bot, conversation_id, message_id) -> raw, accepted_at.  Accepted
                 messages whose handling has not finished; written in the same
                 transaction as their dedup key, deleted by ``inbox_done``.
``inbox_state``  (bot, conversation_id, message_id) -> state, attempts.  The state of an
                 inbox entry once it is not ``queued`` any more: ``running`` (a turn
                 started: ``attempts`` counts how often) or ``delivered`` (part of the
                 answer may have reached the user); no row means ``queued``, 0 attempts.
                 Apart from ``inbox`` so that a state change rewrites a small row, not
                 the raw event (a few KB) it belongs to.
``outbox``       (bot, conversation_id, message_id) -> text, created_at.  The final text
                 of an answer the platform certainly did not take (an outage longer
                 than the engine's retries); its inbox entry stays, in state
                 ``undelivered``, until the text (or a notice) is delivered.
``bindings``     (bot, conversation_id, thread_id) -> session_id, title, created_at,
                 updated_at.  ``thread_id`` is ``""`` for "no thread".
``cursors``      (bot, name) -> value.  Transport offsets, sequence numbers, session ids.
``outbound``     id -> bot, conversation_id, message_ids (JSON list), text, sent_at,
                 completed_at, inbound, author_id, author_name, attachments (JSON list),
                 state.  The message index: the bot's delivered messages per conversation
                 and, for channels that record them, accepted user messages: at most the
                 newest :data:`OUTBOUND_CAP` by ``sent_at``, none completed more than
                 :data:`OUTBOUND_MAX_AGE_S` ago, text cut to :data:`OUTBOUND_TEXT_MAX`
                 code points.
``anchors``      (bot, conversation_id, thread_id, turn_id) -> anchor_id, updated_at.
                 The reply anchors of substitute turns, the newest 32 per conversation.
``transcript``   id (autoincrement) -> bot, session_id, role, text, at, completed.  Paged
                 newest first by an index range scan on (session_id, id).  ``prune``
                 keeps each session's newest ``transcript_keep`` rows and drops rows
                 older than ``transcript_max_age_s`` of sessions no binding names
                 (:class:`~dshim.store.base.Retention`).
``last_direct``  bot -> conversation_id, updated_at.
``messages``     seq -> bot, conversation_id, message_id (unique per bot+conversation),
                 author_id, author_name, author_bot, text, reply_to, attachments (JSON
                 list of ``{kind, name}``), client_id, at.  The message log of channels that
                 keep their own (the web chat): both directions, at most the newest
                 :data:`MESSAGE_LOG_CAP` per conversation by ``at``, text cut to
                 :data:`MESSAGE_TEXT_MAX` code points.

Theory of operation: one ``sqlite3`` connection, shared by the trio thread and the store's
own worker thread (:class:`_DbThread`), never by both at once (a lock).

- The quick calls (everything bounded to a few rows: accepting a batch, a turn's begin,
  delivery mark and record, cursors, bindings, index entries) run *on the trio thread*,
  gathered: the first call of a trio scheduling batch lets the rest of the batch run, then
  runs every call made meanwhile in one transaction (a failure in it reruns each call
  alone) and hands each caller its result after that one COMMIT.  A transaction of a
  few small rows costs tens of microseconds of CPU; running it here instead of handing it
  to a thread saves the thread's share of the GIL traffic (each SQLite statement releases
  and takes the GIL again), which costs more than the work itself.
- It never waits there for anything but the CPU: the connection's busy timeout is 0 on
  the trio thread, so when another process holds the write lock (or the worker thread
  holds the connection) the gathered calls go to the worker thread instead, which waits
  up to :data:`BUSY_TIMEOUT_MS` for the lock.  The WAL is not checkpointed by a commit
  (``wal_autocheckpoint = 0``): the worker thread checkpoints it every
  :data:`CHECKPOINT_EVERY` commits, between two of them, so the one write that syncs the
  disk happens there and the WAL starts over after each.
- Calls that can read or write many rows (the inbox at start-up, transcript and message
  log pages, pruning) and opening and closing run on the worker thread.

Either way a started call runs to completion (a cancelled caller waits for it), so a
transaction is never torn by cancellation.  The connection runs in autocommit
mode; multi-statement writes are explicit ``BEGIN IMMEDIATE`` ... ``COMMIT`` transactions.
WAL with ``synchronous=NORMAL`` makes a commit an append to the WAL without an fsync (a
power loss may lose the last commits, never corrupt the file).  sqlite3 errors become
:class:`~dshim.errors.StoreError` in exactly one place, :meth:`SqliteStore._call`.

The schema version lives in ``PRAGMA user_version``; ``PRAGMA application_id`` marks the
file as a dshim store.  A new schema version is a new entry appended to
:data:`MIGRATIONS`; each migration runs in its own transaction on open.
"""

from __future__ import annotations

import os
import queue
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any, NamedTuple, TypeVar, TypeVarTuple

import msgspec
import outcome
import structlog
import trio

from dshim.errors import StoreError
from dshim.model import Attachment
from dshim.store.base import (
    INDEX_STATES,
    Binding,
    InboxEntry,
    LoggedMessage,
    OutboundEntry,
    OutboxEntry,
    PromptRow,
    Retention,
    TranscriptRow,
    TurnRecord,
)

__all__ = [
    "MESSAGE_LOG_CAP",
    "MESSAGE_TEXT_MAX",
    "MIGRATIONS",
    "OUTBOUND_CAP",
    "OUTBOUND_MAX_AGE_S",
    "OUTBOUND_TEXT_MAX",
    "SCHEMA_VERSION",
    "Migration",
    "SqliteStore",
    "open_sqlite_store",
]

log = structlog.get_logger("dshim.store")

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")

#: Queued store calls the worker thread commits together at most.
GROUP_MAX = 64
#: Gathered calls the trio thread commits together at most (a bound on its pause).
GATHER_MAX = 64
#: The worker thread checkpoints the WAL after this many commits on the trio thread.
CHECKPOINT_EVERY = 20
#: Rows one pruning transaction deletes at most (per table).
PRUNE_BATCH = 2000
#: Sessions one pruning transaction cuts to ``transcript_keep`` at most.
PRUNE_SESSIONS = 200
#: Sessions remembered as grown between two prunes at most (more: the prune looks at all).
GROWN_MAX = 100_000
#: Entries kept per bot + conversation in the outbound index.
OUTBOUND_CAP = 200
#: A conversation's index may briefly hold this many entries beyond the cap (see
#: _insert_outbound); they are never listed.
OUTBOUND_CUT_SLACK = 32
#: Outbound entries completed longer ago than this are dropped (30 days).
OUTBOUND_MAX_AGE_S = 30 * 24 * 3600.0
#: Outbound text is cut to this many Unicode code points.
OUTBOUND_TEXT_MAX = 8000
#: Messages kept per bot + conversation in the message log.
MESSAGE_LOG_CAP = 500
#: Logged text is cut to this many Unicode code points.
MESSAGE_TEXT_MAX = 100_000
#: Inbox states the pipeline may set.
INBOX_STATES = frozenset({"queued", "running", "delivered", "undelivered"})

#: ``PRAGMA application_id`` of a dshim store: b"dshm" as a big-endian int.
APPLICATION_ID = 0x6473686D
#: How long a statement waits for another process's write lock, in milliseconds.
BUSY_TIMEOUT_MS = 5000


class Migration(NamedTuple):
    """One schema step: the statements that take the schema from version N-1 to N.

    The version of a migration is its 1-based position in :data:`MIGRATIONS`.  Never edit
    or reorder a released migration; append a new one.
    """

    summary: str
    statements: tuple[str, ...]


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        "initial tables",
        (
            f"PRAGMA application_id = {APPLICATION_ID}",
            # Small fixed-size rows looked up by full key: WITHOUT ROWID saves a b-tree.
            """CREATE TABLE dedup (
                bot TEXT NOT NULL,
                conversation_id TEXT NOT NULL,
                message_id TEXT NOT NULL,
                expires_at REAL NOT NULL,
                PRIMARY KEY (bot, conversation_id, message_id)
            ) WITHOUT ROWID""",
            "CREATE INDEX dedup_expires ON dedup (expires_at)",
            # raw can be large, so a rowid table (WITHOUT ROWID suits small rows only).  The
            # inbox holds only unfinished messages, so inbox_pending sorts a handful of rows
            # rather than paying for a second index on every accept().
            """CREATE TABLE inbox (
                bot TEXT NOT NULL,
                conversation_id TEXT NOT NULL,
                message_id TEXT NOT NULL,
                raw BLOB NOT NULL,
                state TEXT NOT NULL,
                accepted_at REAL NOT NULL,
                PRIMARY KEY (bot, conversation_id, message_id)
            )""",
            """CREATE TABLE bindings (
                bot TEXT NOT NULL,
                conversation_id TEXT NOT NULL,
                thread_id TEXT NOT NULL,
                session_id TEXT NOT NULL,
                title TEXT,
                created_at REAL NOT NULL,
                updated_at REAL NOT NULL,
                PRIMARY KEY (bot, conversation_id, thread_id)
            ) WITHOUT ROWID""",
            """CREATE TABLE cursors (
                bot TEXT NOT NULL,
                name TEXT NOT NULL,
                value TEXT NOT NULL,
                PRIMARY KEY (bot, name)
            ) WITHOUT ROWID""",
            """CREATE TABLE outbound (
                id INTEGER PRIMARY KEY,
                bot TEXT NOT NULL,
                conversation_id TEXT NOT NULL,
                message_ids TEXT NOT NULL,
                text TEXT NOT NULL,
                sent_at REAL NOT NULL,
                completed_at REAL NOT NULL
            )""",
            # Newest-first listing and the per-insert cap are reverse scans of this index.
            "CREATE INDEX outbound_recent ON outbound (bot, conversation_id, sent_at, id)",
            "CREATE INDEX outbound_completed ON outbound (completed_at)",
            # AUTOINCREMENT: ids are never reused, so a client's before_id stays meaningful.
            """CREATE TABLE transcript (
                id INTEGER PRIMARY KEY AUTOINCREMENT,
                bot TEXT NOT NULL,
                session_id TEXT NOT NULL,
                role TEXT NOT NULL,
                text TEXT NOT NULL,
                at REAL NOT NULL,
                completed INTEGER NOT NULL
            )""",
            "CREATE INDEX transcript_session ON transcript (session_id, id)",
            """CREATE TABLE last_direct (
                bot TEXT PRIMARY KEY,
                conversation_id TEXT NOT NULL,
                updated_at REAL NOT NULL
            ) WITHOUT ROWID""",
        ),
    ),
    Migration(
        "count the turns started for each inbox entry",
        ("ALTER TABLE inbox ADD COLUMN attempts INTEGER NOT NULL DEFAULT 0",),
    ),
    Migration(
        "a message log per conversation (the web chat)",
        (
            """CREATE TABLE messages (
                seq INTEGER PRIMARY KEY,
                bot TEXT NOT NULL,
                conversation_id TEXT NOT NULL,
                message_id TEXT NOT NULL,
                author_id TEXT NOT NULL,
                author_name TEXT,
                author_bot INTEGER NOT NULL,
                text TEXT NOT NULL,
                reply_to TEXT,
                attachments TEXT NOT NULL,
                client_id TEXT,
                at REAL NOT NULL
            )""",
            # Lookup by id (quotes) and the insert's "already there?" check.
            "CREATE UNIQUE INDEX messages_id ON messages (bot, conversation_id, message_id)",
            # History (newest first) and the per-insert cap are reverse scans of this index.
            "CREATE INDEX messages_recent ON messages (bot, conversation_id, at, seq)",
        ),
    ),
    Migration(
        "the outbound index holds both directions: authors, attachments and a state",
        (
            "ALTER TABLE outbound ADD COLUMN inbound INTEGER NOT NULL DEFAULT 0",
            "ALTER TABLE outbound ADD COLUMN author_id TEXT",
            "ALTER TABLE outbound ADD COLUMN author_name TEXT",
            "ALTER TABLE outbound ADD COLUMN attachments TEXT NOT NULL DEFAULT '[]'",
            "ALTER TABLE outbound ADD COLUMN state TEXT NOT NULL DEFAULT 'ok'",
        ),
    ),
    Migration(
        "reply anchors of substitute turns",
        (
            """CREATE TABLE anchors (
                bot TEXT NOT NULL,
                conversation_id TEXT NOT NULL,
                thread_id TEXT NOT NULL,
                turn_id TEXT NOT NULL,
                anchor_id TEXT NOT NULL,
                updated_at REAL NOT NULL,
                PRIMARY KEY (bot, conversation_id, thread_id, turn_id)
            )""",
            "CREATE INDEX anchors_recent ON anchors (bot, conversation_id, thread_id, updated_at)",
        ),
    ),
    Migration(
        "the inbox's states apart from its raw events",
        (
            """CREATE TABLE inbox_state (
                bot TEXT NOT NULL,
                conversation_id TEXT NOT NULL,
                message_id TEXT NOT NULL,
                state TEXT NOT NULL,
                attempts INTEGER NOT NULL,
                PRIMARY KEY (bot, conversation_id, message_id)
            ) WITHOUT ROWID""",
            """INSERT INTO inbox_state (bot, conversation_id, message_id, state, attempts)
                SELECT bot, conversation_id, message_id, state, attempts FROM inbox
                WHERE state != 'queued' OR attempts != 0""",
            "ALTER TABLE inbox DROP COLUMN state",
            "ALTER TABLE inbox DROP COLUMN attempts",
        ),
    ),
    Migration(
        "answers the platform did not take yet (the durable outbox)",
        (
            """CREATE TABLE outbox (
                bot TEXT NOT NULL,
                conversation_id TEXT NOT NULL,
                message_id TEXT NOT NULL,
                text TEXT NOT NULL,
                created_at REAL NOT NULL,
                PRIMARY KEY (bot, conversation_id, message_id)
            ) WITHOUT ROWID""",
        ),
    ),
    Migration(
        "find the sessions a binding names (transcript retention)",
        ("CREATE INDEX bindings_session ON bindings (session_id)",),
    ),
)

#: The schema version this code writes and understands.
SCHEMA_VERSION = len(MIGRATIONS)


# -- SQL ---------------------------------------------------------------------------------------

# An unexpired key makes the upsert a no-op (rowcount 0); an expired one is replaced.
_ACCEPT_KEY = """
    INSERT INTO dedup (bot, conversation_id, message_id, expires_at) VALUES (?, ?, ?, ?)
    ON CONFLICT (bot, conversation_id, message_id)
    DO UPDATE SET expires_at = excluded.expires_at WHERE dedup.expires_at <= ?
"""
_INBOX_PUT = """
    INSERT OR REPLACE INTO inbox (bot, conversation_id, message_id, raw, accepted_at)
    VALUES (?, ?, ?, ?, ?)
"""
# A new entry is queued: no state row (one left by an expired key's entry goes).
_INBOX_FRESH = "DELETE FROM inbox_state WHERE bot = ? AND conversation_id = ? AND message_id = ?"
_INBOX_RUNNING = """
    INSERT INTO inbox_state (bot, conversation_id, message_id, state, attempts)
    SELECT bot, conversation_id, message_id, 'running', 1 FROM inbox
    WHERE bot = ? AND conversation_id = ? AND message_id = ?
    ON CONFLICT (bot, conversation_id, message_id)
    DO UPDATE SET state = 'running', attempts = inbox_state.attempts + 1
"""
_SEEN = """
    SELECT 1 FROM dedup
    WHERE bot = ? AND conversation_id = ? AND message_id = ? AND expires_at > ?
"""
_SET_BINDING = """
    INSERT INTO bindings
        (bot, conversation_id, thread_id, session_id, title, created_at, updated_at)
    VALUES (?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT (bot, conversation_id, thread_id) DO UPDATE SET
        created_at = CASE WHEN session_id = excluded.session_id
                          THEN created_at ELSE excluded.created_at END,
        session_id = excluded.session_id,
        title = excluded.title,
        updated_at = excluded.updated_at
"""
_OUTBOUND_CUT = """
    DELETE FROM outbound WHERE id IN (
        SELECT id FROM outbound WHERE bot = ? AND conversation_id = ?
        ORDER BY sent_at DESC, id DESC LIMIT -1 OFFSET ?
    )
"""
_OUTBOUND_COLUMNS = (
    "message_ids, text, sent_at, completed_at, inbound, author_id, author_name, attachments, state"
)
_OUTBOUND_LIST = f"""
    SELECT {_OUTBOUND_COLUMNS} FROM outbound
    WHERE bot = ? AND conversation_id = ? AND completed_at >= ?
    ORDER BY sent_at DESC, id DESC LIMIT ?
"""

# A session's rows older than its newest ``keep`` (the subquery: the keep-th newest id,
# NULL when it has fewer, and then nothing goes).
_TRANSCRIPT_CUT = """
    DELETE FROM transcript WHERE session_id = ? AND id < (
        SELECT id FROM transcript WHERE session_id = ? ORDER BY id DESC LIMIT 1 OFFSET ?
    )
"""
_TRANSCRIPT_EXPIRE = """
    DELETE FROM transcript WHERE id > ? AND id <= ? AND at < ?
    AND NOT EXISTS (SELECT 1 FROM bindings AS b WHERE b.session_id = transcript.session_id)
"""

_MESSAGE_INSERT = """
    INSERT INTO messages (bot, conversation_id, message_id, author_id, author_name, author_bot,
                          text, reply_to, attachments, client_id, at)
    VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)
    ON CONFLICT (bot, conversation_id, message_id) DO NOTHING
"""
_MESSAGE_CUT = """
    DELETE FROM messages WHERE seq IN (
        SELECT seq FROM messages WHERE bot = ? AND conversation_id = ?
        ORDER BY at DESC, seq DESC LIMIT -1 OFFSET ?
    )
"""
_MESSAGE_COLUMNS = (
    "message_id, author_id, author_name, author_bot, text, reply_to, attachments, client_id, at"
)

_ids_encoder = msgspec.json.Encoder()
_ids_decoder = msgspec.json.Decoder(list[str])
_attachments_decoder = msgspec.json.Decoder(list[Attachment])


class _Flat(threading.local):
    #: This thread runs gathered calls in one plain transaction (see _run_gathered).
    on = False


_flat = _Flat()


def _commit_together(
    conn: sqlite3.Connection, calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]
) -> list[outcome.Outcome[Any]] | None:
    """Run ``fn(*args)`` for each call in one transaction and commit once; each outcome
    is final (durable) when this returns.  None when BEGIN fails (nothing ran).

    The calls' own transactions are nothing inside it (:class:`_transaction`).  When one
    call fails (rare), the whole transaction is rolled back and every call runs again on
    its own, so that only the failing one's writes are lost.  A failed COMMIT fails them
    all (none of their writes happened)."""
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error:
        return None
    _flat.on = True
    try:
        results: list[outcome.Outcome[Any]] = [outcome.capture(f, *a) for f, a in calls]
    finally:
        _flat.on = False
    if any(type(r) is outcome.Error for r in results):
        conn.execute("ROLLBACK")
        return [outcome.capture(f, *a) for f, a in calls]
    try:
        conn.execute("COMMIT")
    except sqlite3.Error as exc:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        failed: outcome.Outcome[Any] = outcome.Error(StoreError(f"store commit failed: {exc}"))
        return [failed] * len(calls)
    return results


class _transaction:  # noqa: N801 - used like the function it replaced: `with _transaction(c):`
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception.

    Inside a group commit (:func:`_commit_together`, on either thread) it is nothing at
    all: a failure there rolls the whole transaction back and every call runs again on
    its own, so a failing call still loses only its own writes, without a savepoint per
    call.  Nested in another transaction otherwise, it is a savepoint.  A class, not a
    generator: it wraps every write.
    """

    __slots__ = ("_conn", "_mode")

    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._mode = 0  # 0: nothing, 1: savepoint, 2: own transaction

    def __enter__(self) -> None:
        conn = self._conn
        if conn.in_transaction:
            if not _flat.on:
                conn.execute("SAVEPOINT call")
                self._mode = 1
            return
        # IMMEDIATE takes the write lock up front: no deadlock upgrading a read lock later.
        conn.execute("BEGIN IMMEDIATE")
        self._mode = 2

    def __exit__(self, typ: type[BaseException] | None, exc: object, tb: object) -> None:
        conn, mode = self._conn, self._mode
        if mode == 1:
            if typ is not None:
                conn.execute("ROLLBACK TO call")
            conn.execute("RELEASE call")
        elif mode == 2:
            if typ is None:
                try:
                    conn.execute("COMMIT")
                except BaseException:
                    if conn.in_transaction:
                        conn.execute("ROLLBACK")
                    raise
            elif conn.in_transaction:
                conn.execute("ROLLBACK")


def _wal_checkpoint(conn: sqlite3.Connection) -> None:
    conn.execute("PRAGMA wal_checkpoint(PASSIVE)")


def _user_version(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA user_version").fetchone()[0])


def _check_ownership(conn: sqlite3.Connection, where: str) -> int:
    """Refuse foreign or newer databases; return the current schema version."""
    version = _user_version(conn)
    app_id = int(conn.execute("PRAGMA application_id").fetchone()[0])
    if app_id not in (0, APPLICATION_ID):
        raise StoreError(f"{where} is an SQLite database of another application")
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{where} has schema version {version}, newer than this dshim supports "
            f"({SCHEMA_VERSION}); upgrade dshim or use another data directory"
        )
    if version == 0 and conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
        raise StoreError(f"{where} is an SQLite database that is not a dshim store")
    return version


def _migrate(conn: sqlite3.Connection, where: str) -> None:
    """Bring the schema to :data:`SCHEMA_VERSION`, one transaction per migration.

    Logged once: ``store_created`` for a new store, else ``store_migrated`` with the
    versions applied and what each did (none: nothing is logged)."""
    version = start = _check_ownership(conn, where)
    applied: list[str] = []
    while version < SCHEMA_VERSION:
        target = version + 1
        with _transaction(conn):
            # Another process may have migrated between our check and the write lock.
            version = _check_ownership(conn, where)
            if version >= target:
                continue
            for statement in MIGRATIONS[version].statements:
                conn.execute(statement)
            conn.execute(f"PRAGMA user_version = {target}")
        applied.append(f"{target}: {MIGRATIONS[version].summary}")
        version = target
    if start == 0 and applied:
        log.info("store_created", path=where, schema=version)
    elif applied:
        log.info("store_migrated", path=where, from_schema=start, schema=version, steps=applied)


class _Connection(sqlite3.Connection):
    """The store's connection, with what its writers estimate (see _insert_outbound)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outbound_counts: dict[tuple[str, str], int] = {}


def _open_connection(path: str) -> sqlite3.Connection:
    """Connect, configure and migrate; StoreError on any failure (connection closed)."""
    try:
        conn = sqlite3.connect(
            path, check_same_thread=False, isolation_level=None, factory=_Connection
        )
    except sqlite3.Error as exc:
        raise StoreError(f"cannot open store {path}: {exc}") from exc
    try:
        # The first statement reads the header: this is where a non-database file fails.
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        _migrate(conn, path)
    except sqlite3.Error as exc:
        conn.close()
        raise StoreError(f"cannot open store {path}: {exc}") from exc
    except BaseException:
        conn.close()
        raise
    return conn


@asynccontextmanager
async def open_sqlite_store(
    path: str | os.PathLike[str], *, inline: bool = False, retention: Retention | None = None
) -> AsyncIterator[SqliteStore]:
    """Open (creating and migrating if needed) the SQLite store at ``path``.

    ``inline=True`` runs every call on the trio thread, each in its own transaction, with
    no worker thread at all.  Only for deterministic runs on a virtual clock (replay,
    autojump tests), where a worker thread would look like idleness and let the clock jump
    past deadlines.

    Raises :class:`~dshim.errors.StoreError` if the file cannot be opened, is not a
    database, belongs to another application or has a newer schema version.  The store is
    closed when the block exits, even on cancellation.  ``retention``: how long ``prune``
    keeps transcripts (the defaults of :class:`~dshim.store.base.Retention` when None).
    """
    where = os.fspath(path)
    worker = None if inline else _DbThread(f"dshim-store:{os.path.basename(where)}")
    try:
        if worker is None:
            conn = _open_connection(where)
        else:
            conn = await worker.run(_open_connection, where)
        store = SqliteStore(conn, where, worker, retention)
        if worker is not None:
            # The trio thread never waits for a lock or a checkpoint (module docstring).
            conn.execute("PRAGMA wal_autocheckpoint = 0")
            conn.execute("PRAGMA busy_timeout = 0")
            worker.conn = conn
        try:
            yield store
        finally:
            await store.aclose()
    finally:
        if worker is not None:
            worker.stop()


#: (fn, args, token, waiting task or None, groupable)
_Job = tuple[
    Callable[..., Any], tuple[Any, ...], trio.lowlevel.TrioToken, trio.lowlevel.Task | None, bool
]


def _no_abort(_: Any) -> trio.lowlevel.Abort:
    return trio.lowlevel.Abort.FAILED  # a started call finishes; its caller waits for it


def _reschedule_all(done: list[tuple[trio.lowlevel.Task, outcome.Outcome[Any]]]) -> None:
    for task, result in done:
        trio.lowlevel.reschedule(task, result)


class _DbThread:
    """One dedicated thread that runs store calls in order, off the trio thread.

    Cheaper per call than ``trio.to_thread.run_sync`` (no thread cache, limiter or context
    copy): the job goes into a queue, the result comes back through the trio token and
    reschedules the waiting task.  Like ``to_thread`` without ``abandon_on_cancel``, a
    started call always runs to completion: a cancelled caller waits for it, so a
    transaction is never torn and the connection is never used by two threads.

    Group commit: when calls are already waiting in the queue (concurrent turns), up to
    :data:`GROUP_MAX` of them run in one transaction (:func:`_commit_together`) and every
    caller gets its result only after that one COMMIT, so what a
    call returned is as durable as before, for a fraction of the commits.  If the COMMIT
    fails, every call of the group gets the error (none of their writes happened).
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._stopped = False
        #: The connection group commits run on (set once the store is open).
        self.conn: sqlite3.Connection | None = None
        #: Held while the connection is in use, by this thread or by the trio thread.
        self.lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            group = [job]
            stop = False
            while job[4] and len(group) < GROUP_MAX:
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    stop = True
                    break
                if not nxt[4]:  # not groupable (open, close, checkpoint): alone, after
                    self._finish(self._run_group(group))
                    group = [nxt]
                    break
                group.append(nxt)
            if not self._finish(self._run_group(group)) or stop:
                return

    def _run_group(self, group: list[_Job]) -> list[tuple[_Job, outcome.Outcome[Any]]]:
        with self.lock:
            conn = self.conn
            if conn is None:
                return self._run_group_locked(group)
            # Here (and only here) waiting for another process's write lock is right.
            conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
            try:
                return self._run_group_locked(group)
            finally:
                if self.conn is not None:  # (not closed by the group)
                    self.conn.execute("PRAGMA busy_timeout = 0")

    def _run_group_locked(self, group: list[_Job]) -> list[tuple[_Job, outcome.Outcome[Any]]]:
        conn = self.conn
        together = None
        if len(group) > 1 and conn is not None and not conn.in_transaction:
            together = _commit_together(conn, [(job[0], job[1]) for job in group])
        if together is None:  # alone, or BEGIN failed: each call reports its own error
            return [(job, outcome.capture(job[0], *job[1])) for job in group]
        return list(zip(group, together, strict=True))

    def _finish(self, results: list[tuple[_Job, outcome.Outcome[Any]]]) -> bool:
        """Hand the results back: one wake-up of the trio thread for the whole group."""
        waiting = [(job[3], result) for job, result in results if job[3] is not None]
        for job, result in results:
            if job[3] is None and isinstance(result, outcome.Error):  # nobody waits for it
                log.warning("store_background_call_failed", error=str(result.error))
        if not waiting:
            return True
        token = results[0][0][2]
        try:
            token.run_sync_soon(_reschedule_all, waiting)
        except trio.RunFinishedError:  # pragma: no cover - the run ended under us
            return False
        return True

    def submit(self, jobs: list[_Job]) -> None:
        """Queue jobs made elsewhere (the trio thread's gathered calls, a checkpoint);
        a job whose task is None is waited for by nobody."""
        for job in jobs:
            self._jobs.put(job)

    async def run(self, fn: Callable[..., _T], *args: Any, group: bool = False) -> _T:
        await trio.lowlevel.checkpoint_if_cancelled()
        if self._stopped:
            raise StoreError("the store's worker thread has stopped")
        self._jobs.put(
            (fn, args, trio.lowlevel.current_trio_token(), trio.lowlevel.current_task(), group)
        )

        result: _T = await trio.lowlevel.wait_task_rescheduled(_no_abort)
        return result

    def stop(self) -> None:
        self._stopped = True
        self._jobs.put(None)


class SqliteStore:
    """The :class:`~dshim.store.base.Store` on one SQLite file.  Use :func:`open_sqlite_store`.

    All methods are safe to call concurrently from trio tasks; calls are serialized (one
    transaction at a time, on the trio thread or the worker thread, see the module
    docstring).  After :meth:`aclose` every call raises StoreError.
    """

    def __init__(
        self,
        conn: sqlite3.Connection,
        path: str,
        worker: _DbThread | None,
        retention: Retention | None = None,
    ):
        self._conn: sqlite3.Connection | None = conn
        self._path = path
        self._worker = worker  # None: inline, on the trio thread
        self._retention = retention or Retention()
        #: Sessions this store added transcript rows to since the last prune (the ones
        #: that may hold more than ``transcript_keep``); None until the first prune,
        #: which looks at every session.
        self._grown: set[str] | None = None
        #: The quick calls of the current scheduling batch (see the module docstring).
        self._gathering: list[tuple[Callable[..., Any], tuple[Any, ...], Any]] | None = None
        self._commits = 0

    @property
    def path(self) -> str:
        """The database file."""
        return self._path

    async def _call(self, fn: Callable[[sqlite3.Connection, *_Ts], _T], *args: *_Ts) -> _T:
        """Run the quick call ``fn(conn, *args)``, gathered with the other calls of this
        scheduling batch (see the module docstring), mapping sqlite3 errors."""
        worker = self._worker
        if worker is None or self._conn is None:
            await trio.lowlevel.checkpoint()
            return self._guarded(fn, *args)  # inline, or raises "closed" without a hop
        await trio.lowlevel.checkpoint_if_cancelled()
        task = trio.lowlevel.current_task()
        gathering = self._gathering
        if gathering is not None and len(gathering) < GATHER_MAX:
            gathering.append((fn, args, task))  # the batch's first caller runs it
            result: _T = await trio.lowlevel.wait_task_rescheduled(_no_abort)
            return result
        self._gathering = gathering = [(fn, args, task)]
        try:
            await trio.lowlevel.cancel_shielded_checkpoint()  # the rest of the batch joins
        finally:
            if self._gathering is gathering:
                self._gathering = None
        results = self._run_gathered(worker, gathering)
        if results is None:  # the connection is busy: the worker thread takes them all
            token = trio.lowlevel.current_trio_token()
            worker.submit([(self._guarded, (f, *a), token, t, True) for f, a, t in gathering])
            mine: _T = await trio.lowlevel.wait_task_rescheduled(_no_abort)
            return mine
        for (_, _, t), r in zip(gathering[1:], results[1:], strict=True):
            trio.lowlevel.reschedule(t, r)
        return results[0].unwrap()  # type: ignore[no-any-return]

    def _run_gathered(
        self, worker: _DbThread, calls: list[tuple[Callable[..., Any], tuple[Any, ...], Any]]
    ) -> list[outcome.Outcome[Any]] | None:
        """The gathered calls in one transaction on this thread; None when that would mean
        waiting (the worker thread has the connection, another process the write lock)."""
        if not worker.lock.acquire(blocking=False):
            return None
        try:
            conn = self._conn
            if conn is None:
                return [outcome.capture(self._guarded, f, *a) for f, a, _ in calls]  # closed
            # Busy timeout 0: BEGIN fails at once (None) if another process holds the lock.
            results = _commit_together(conn, [(self._guarded, (f, *a)) for f, a, _ in calls])
            if results is None:
                return None
        finally:
            worker.lock.release()
        self._commits += 1
        if self._commits % CHECKPOINT_EVERY == 0:
            token = trio.lowlevel.current_trio_token()
            worker.submit([(self._checkpoint, (), token, None, False)])
        return results

    def _checkpoint(self) -> None:
        """On the worker thread, holding the connection: copy the WAL into the database
        file.  Between two commits, so it copies every frame and the next commit starts
        the WAL over from its beginning (a checkpoint running alongside the commits never
        caught up with them, and the WAL grew without end).  Meanwhile the trio thread's
        calls wait on the worker thread behind it.  PASSIVE: it never waits for another
        process's readers or writers; what it cannot copy now, the next one does."""
        self._guarded(_wal_checkpoint)

    async def _call_off(self, fn: Callable[[sqlite3.Connection, *_Ts], _T], *args: *_Ts) -> _T:
        """Run ``fn(conn, *args)`` on the worker thread: calls that may touch many rows."""
        if self._worker is None or self._conn is None:
            await trio.lowlevel.checkpoint()
            return self._guarded(fn, *args)
        return await self._worker.run(self._guarded, fn, *args, group=True)

    def _guarded(self, fn: Callable[[sqlite3.Connection, *_Ts], _T], *args: *_Ts) -> _T:
        conn = self._conn
        if conn is None:
            raise StoreError(f"store {self._path} is closed")
        try:
            return fn(conn, *args)
        except sqlite3.Error as exc:
            raise StoreError(f"store {self._path}: {exc}") from exc

    # -- dedup and the durable inbox --------------------------------------------------------

    async def accept(
        self,
        bot: str,
        conversation_id: str,
        message_id: str,
        *,
        now: float,
        ttl_s: float,
        raw: bytes | None,
    ) -> bool:
        """Record (bot, conversation, message) as accepted, atomically with its inbox entry.

        Returns False, writing nothing, when the key was already accepted and has not
        expired.  An expired key is replaced (and its inbox entry, if ``raw`` is given,
        starts over as "queued").  ``raw`` None means: remember the key, keep no inbox
        entry.  The key expires at ``now + ttl_s``.
        """
        return await self._call(_accept, bot, conversation_id, message_id, now, ttl_s, raw)

    async def accept_many(
        self,
        bot: str,
        entries: Sequence[tuple[str, str, bytes | None]],
        *,
        now: float,
        ttl_s: float,
    ) -> list[bool]:
        """:meth:`accept` for several (conversation, message, raw) keys in one transaction,
        in order (a key repeated within the batch is a duplicate the second time)."""
        return await self._call(_accept_many, bot, tuple(entries), now, ttl_s)

    async def seen(self, bot: str, conversation_id: str, message_id: str, *, now: float) -> bool:
        """True if the key was accepted and has not expired."""
        return await self._call(_seen, bot, conversation_id, message_id, now)

    async def inbox_set_state(
        self, bot: str, conversation_id: str, message_id: str, state: str
    ) -> None:
        """Set the state ("queued", "running" or "delivered") of an inbox entry; no-op if
        there is none.  Committed before it returns (durable at once)."""
        if state not in INBOX_STATES:
            raise ValueError(f"inbox state must be one of {sorted(INBOX_STATES)}, not {state!r}")
        await self._call(_inbox_set_state, bot, conversation_id, message_id, state)

    async def outbox_put(
        self, bot: str, conversation_id: str, message_id: str, text: str, *, now: float
    ) -> None:
        """Keep the final text of an answer the platform did not take; its inbox entry
        stays (state ``undelivered``) until :meth:`outbox_done`."""
        await self._call(_outbox_put, bot, conversation_id, message_id, text, now)

    async def outbox_pending(self, bot: str) -> list[OutboxEntry]:
        """The bot's undelivered answers, oldest first, with their messages' raw events."""
        entries: list[OutboxEntry] = await self._call(_outbox_pending, bot)
        return entries

    async def outbox_done(self, bot: str, conversation_id: str, message_id: str) -> None:
        """The answer (or a notice in its place) was delivered: drop it and its entry."""
        await self._call(_outbox_done, bot, conversation_id, message_id)

    async def inbox_resumed(self, bot: str, conversation_id: str, message_id: str) -> int:
        """Count one resume of a queued entry after a restart, as an attempt (committed at
        once, so an entry that takes the bot down before its turn starts still reaches the
        limit); returns the attempts counted before this one."""
        counted: int = await self._call(_inbox_resumed, bot, conversation_id, message_id)
        return counted

    async def inbox_done(self, bot: str, conversation_id: str, message_id: str) -> None:
        """Handling finished (answered, refused or dropped after acceptance).

        Removes the inbox entry; the dedup key stays until it expires.
        """
        await self._call(_inbox_done, bot, conversation_id, message_id)

    async def inbox_pending(self, bot: str) -> list[InboxEntry]:
        """Accepted but unfinished messages of a bot, oldest first."""
        return await self._call_off(_inbox_pending, bot)

    # -- bindings ----------------------------------------------------------------------------

    async def begin_turn(
        self,
        bot: str,
        conversation_id: str,
        thread_id: str,
        inbox_keys: list[tuple[str, str]],
        *,
        last_direct: tuple[str, float] | None = None,
    ) -> Binding | None:
        """Mark inbox entries running (counting the attempt), remember the last direct
        conversation (when given) and read the binding, in one transaction."""
        return await self._call(
            _begin_turn, bot, conversation_id, thread_id, inbox_keys, last_direct
        )

    async def mark_delivered(
        self, bot: str, inbox_keys: list[tuple[str, str]], *, prompt: PromptRow | None
    ) -> None:
        """Inbox entries ``delivered`` and the prompt's transcript row, in one transaction."""
        if prompt is not None:
            self._grew(prompt.session_id)
        await self._call(_mark_delivered, bot, inbox_keys, prompt)

    async def record_turn(
        self, bot: str, conversation_id: str, turn: TurnRecord, *, now: float
    ) -> None:
        """Write a finished turn (transcript rows, outbound entries, inbox done) atomically."""
        if turn.session_id is not None and (
            turn.user_text is not None or turn.answer_text is not None
        ):
            self._grew(turn.session_id)
        await self._call(_record_turn, bot, conversation_id, turn, now)

    async def get_binding(self, bot: str, conversation_id: str, thread_id: str) -> Binding | None:
        """The session bound to a conversation + thread (``""`` for no thread), if any."""
        return await self._call(_get_binding, bot, conversation_id, thread_id)

    async def set_binding(
        self,
        bot: str,
        conversation_id: str,
        thread_id: str,
        session_id: str,
        *,
        title: str | None,
        now: float,
    ) -> None:
        """Bind a conversation + thread to a session, replacing any binding.

        ``title`` is stored as given.  ``created_at`` is kept when the same session is bound
        again and reset to ``now`` when the session changes; ``updated_at`` becomes ``now``.
        """
        await self._call(_set_binding, bot, conversation_id, thread_id, session_id, title, now)

    async def clear_binding(self, bot: str, conversation_id: str, thread_id: str) -> bool:
        """Unbind; True if a binding existed."""
        return await self._call(_clear_binding, bot, conversation_id, thread_id)

    # -- transport cursors -------------------------------------------------------------------

    async def get_cursor(self, bot: str, name: str) -> str | None:
        """A bot's named transport cursor (offset, sequence number, session id), if set."""
        return await self._call(_get_cursor, bot, name)

    async def set_cursor(self, bot: str, name: str, value: str) -> None:
        """Store a bot's named transport cursor, replacing the previous value."""
        await self._call(_set_cursor, bot, name, value)

    # -- outbound index ----------------------------------------------------------------------

    async def add_outbound(
        self, bot: str, conversation_id: str, entry: OutboundEntry, *, now: float
    ) -> None:
        """Add an entry; keeps the newest 200 per bot+conversation, none older than 30 days,
        text cut to 8,000 code points.

        "Newest" orders by ``sent_at`` (insertion order breaks ties); "older than 30 days"
        means ``completed_at < now - 30 days``.
        """
        await self._call(_add_outbound, bot, conversation_id, entry, now)

    async def list_outbound(
        self, bot: str, conversation_id: str, *, now: float
    ) -> list[OutboundEntry]:
        """Entries of a bot+conversation, newest first (at most 200, within 30 days)."""
        return await self._call(_list_outbound, bot, conversation_id, now)

    async def update_outbound(
        self,
        bot: str,
        conversation_id: str,
        message_id: str,
        *,
        now: float,
        text: str | None = None,
        completed_at: float | None = None,
        add_ids: Sequence[str] = (),
        state: str | None = None,
    ) -> bool:
        """Change the newest entry carrying ``message_id`` (within 30 days); False if none."""
        if state is not None and state not in INDEX_STATES:
            raise ValueError(f"index entry state must be one of {INDEX_STATES}, got {state!r}")
        return await self._call(
            _update_outbound,
            bot,
            conversation_id,
            message_id,
            now,
            text,
            completed_at,
            tuple(add_ids),
            state,
        )

    # -- reply anchors -----------------------------------------------------------------------

    async def put_anchor(
        self,
        bot: str,
        conversation_id: str,
        thread_id: str,
        turn_id: str,
        anchor_id: str,
        *,
        now: float,
        keep: int,
    ) -> None:
        """Remember a turn's reply anchor; keeps the newest ``keep`` per conversation +
        thread (by update time)."""
        await self._call(
            _put_anchor, bot, conversation_id, thread_id, turn_id, anchor_id, now, keep
        )

    async def get_anchor(
        self, bot: str, conversation_id: str, thread_id: str, turn_id: str
    ) -> str | None:
        """A turn's reply anchor, or None (never recorded, or evicted)."""
        return await self._call(_get_anchor, bot, conversation_id, thread_id, turn_id)

    # -- message log -------------------------------------------------------------------------

    async def log_message(
        self, bot: str, conversation_id: str, message: LoggedMessage, *, now: float
    ) -> bool:
        """Add a message to a conversation's log; False, writing nothing, when its id is
        already logged there.

        Keeps the newest :data:`MESSAGE_LOG_CAP` per bot+conversation ("newest" by ``at``,
        insertion order breaking ties); text is cut to :data:`MESSAGE_TEXT_MAX` code points.
        """
        return await self._call(_log_message, bot, conversation_id, message)

    async def message_log(
        self, bot: str, conversation_id: str, *, limit: int
    ) -> list[LoggedMessage]:
        """The newest ``limit`` messages of a conversation's log, oldest first."""
        if limit < 1:
            raise ValueError(f"limit must be positive, not {limit}")
        return await self._call_off(_message_log, bot, conversation_id, limit)

    async def logged_message(
        self, bot: str, conversation_id: str, message_id: str
    ) -> LoggedMessage | None:
        """One logged message of this bot and conversation, or None."""
        return await self._call(_logged_message, bot, conversation_id, message_id)

    # -- transcript --------------------------------------------------------------------------

    async def append_transcript(
        self, bot: str, session_id: str, role: str, text: str, *, at: float, completed: bool
    ) -> int:
        """Append a prompt or answer to a session's transcript; returns the new row id.

        Ids increase and are never reused.
        """
        self._grew(session_id)
        return await self._call(_append_transcript, bot, session_id, role, text, at, completed)

    async def transcript_page(
        self, session_id: str, *, before_id: int | None, limit: int
    ) -> list[TranscriptRow]:
        """Rows of a session, newest first, with ``id < before_id`` when given.

        Pass the smallest id of a page as ``before_id`` to get the next (older) page.
        ``limit`` must be positive.
        """
        if limit < 1:
            raise ValueError(f"limit must be positive, not {limit}")
        return await self._call_off(_transcript_page, session_id, before_id, limit)

    # -- misc --------------------------------------------------------------------------------

    async def set_last_direct(self, bot: str, conversation_id: str, *, now: float) -> None:
        """Remember the bot's most recent direct conversation (for probes)."""
        await self._call(_set_last_direct, bot, conversation_id, now)

    async def get_last_direct(self, bot: str) -> str | None:
        """The bot's most recent direct conversation, if any."""
        return await self._call(_get_last_direct, bot)

    def _grew(self, session_id: str) -> None:
        grown = self._grown
        if grown is None:
            return  # the next prune looks at every session anyway
        if len(grown) >= GROWN_MAX:
            self._grown = None  # too many to remember: the next prune looks at all
        else:
            grown.add(session_id)

    async def prune(self, *, now: float) -> None:
        """Drop expired dedup keys and outbound entries completed more than 30 days ago,
        then the transcript rows past the store's :class:`~dshim.store.base.Retention`.

        In transactions of at most :data:`PRUNE_BATCH` rows (or sessions), so that the
        turns' own calls run in between even when a day's worth of keys expires at once.
        """
        while await self._call_off(_prune, now, PRUNE_BATCH) >= PRUNE_BATCH:
            pass
        keep = self._retention.transcript_keep
        grown, self._grown = self._grown, set()
        if grown is None:  # the first prune (or too many sessions grew): every session
            after: str | None = ""
            while after is not None:
                after = await self._call_off(_transcript_cut_all, after, keep, PRUNE_SESSIONS)
        else:
            sessions = sorted(grown)
            for k in range(0, len(sessions), PRUNE_SESSIONS):
                chunk = tuple(sessions[k : k + PRUNE_SESSIONS])
                await self._call_off(_transcript_cut, chunk, keep)
        cutoff = now - self._retention.transcript_max_age_s
        after_id: int | None = 0
        while after_id is not None:
            after_id = await self._call_off(_transcript_expire, after_id, cutoff, PRUNE_BATCH)

    async def schema_version(self) -> int:
        """The schema version of the open file (:data:`SCHEMA_VERSION` once open)."""
        return await self._call(_user_version)

    async def aclose(self) -> None:
        """Close the connection (checkpointing the WAL).  Idempotent; shielded from cancellation."""
        if self._worker is None or self._conn is None:
            self._close()
            return
        with trio.CancelScope(shield=True):
            await self._worker.run(self._close)

    def _close(self) -> None:
        conn, self._conn = self._conn, None
        if self._worker is not None:
            self._worker.conn = None
        if conn is None:
            return
        try:
            conn.execute("PRAGMA optimize")
        except sqlite3.Error as exc:
            raise StoreError(f"store {self._path}: {exc}") from exc
        finally:
            conn.close()


# -- worker-thread bodies (called through SqliteStore._call) ---------------------------------


def _accept(
    conn: sqlite3.Connection,
    bot: str,
    conversation_id: str,
    message_id: str,
    now: float,
    ttl_s: float,
    raw: bytes | None,
) -> bool:
    with _transaction(conn):
        cur = conn.execute(_ACCEPT_KEY, (bot, conversation_id, message_id, now + ttl_s, now))
        if cur.rowcount != 1:
            return False
        if raw is not None:
            conn.execute(_INBOX_PUT, (bot, conversation_id, message_id, raw, now))
            conn.execute(_INBOX_FRESH, (bot, conversation_id, message_id))
    return True


def _accept_many(
    conn: sqlite3.Connection,
    bot: str,
    entries: tuple[tuple[str, str, bytes | None], ...],
    now: float,
    ttl_s: float,
) -> list[bool]:
    out: list[bool] = []
    with _transaction(conn):
        for conversation_id, message_id, raw in entries:
            cur = conn.execute(_ACCEPT_KEY, (bot, conversation_id, message_id, now + ttl_s, now))
            fresh = cur.rowcount == 1
            if fresh and raw is not None:
                conn.execute(_INBOX_PUT, (bot, conversation_id, message_id, raw, now))
                conn.execute(_INBOX_FRESH, (bot, conversation_id, message_id))
            out.append(fresh)
    return out


def _seen(
    conn: sqlite3.Connection, bot: str, conversation_id: str, message_id: str, now: float
) -> bool:
    return conn.execute(_SEEN, (bot, conversation_id, message_id, now)).fetchone() is not None


def _inbox_set_state(
    conn: sqlite3.Connection, bot: str, conversation_id: str, message_id: str, state: str
) -> None:
    key = (bot, conversation_id, message_id)
    if state == "queued":  # no state row needed; the attempts counted so far are kept
        conn.execute(
            "UPDATE inbox_state SET state = 'queued'"
            " WHERE bot = ? AND conversation_id = ? AND message_id = ?",
            key,
        )
        return
    conn.execute(
        "INSERT INTO inbox_state (bot, conversation_id, message_id, state, attempts)"
        " SELECT bot, conversation_id, message_id, ?, 0 FROM inbox"
        " WHERE bot = ? AND conversation_id = ? AND message_id = ?"
        " ON CONFLICT (bot, conversation_id, message_id) DO UPDATE SET state = excluded.state",
        (state, *key),
    )


def _outbox_put(
    conn: sqlite3.Connection, bot: str, conversation_id: str, message_id: str, text: str, now: float
) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO outbox (bot, conversation_id, message_id, text, created_at)"
        " VALUES (?, ?, ?, ?, ?)",
        (bot, conversation_id, message_id, text, now),
    )
    _inbox_set_state(conn, bot, conversation_id, message_id, "undelivered")


def _outbox_pending(conn: sqlite3.Connection, bot: str) -> list[OutboxEntry]:
    rows = conn.execute(
        "SELECT o.conversation_id, o.message_id, o.text, o.created_at, i.raw"
        " FROM outbox AS o LEFT JOIN inbox AS i ON i.bot = o.bot"
        " AND i.conversation_id = o.conversation_id AND i.message_id = o.message_id"
        " WHERE o.bot = ? ORDER BY o.created_at",
        (bot,),
    )
    return [
        OutboxEntry(conversation_id=c, message_id=m, text=t, created_at=a, raw=r)
        for c, m, t, a, r in rows
    ]


def _outbox_done(conn: sqlite3.Connection, bot: str, conversation_id: str, message_id: str) -> None:
    conn.execute(
        "DELETE FROM outbox WHERE bot = ? AND conversation_id = ? AND message_id = ?",
        (bot, conversation_id, message_id),
    )
    _inbox_done(conn, bot, conversation_id, message_id)


def _inbox_resumed(
    conn: sqlite3.Connection, bot: str, conversation_id: str, message_id: str
) -> int:
    key = (bot, conversation_id, message_id)
    row = conn.execute(
        "SELECT attempts FROM inbox_state WHERE bot = ? AND conversation_id = ? AND message_id = ?",
        key,
    ).fetchone()
    conn.execute(
        "INSERT INTO inbox_state (bot, conversation_id, message_id, state, attempts)"
        " SELECT bot, conversation_id, message_id, 'queued', 1 FROM inbox"
        " WHERE bot = ? AND conversation_id = ? AND message_id = ?"
        " ON CONFLICT (bot, conversation_id, message_id)"
        " DO UPDATE SET attempts = inbox_state.attempts + 1",
        key,
    )
    return int(row[0]) if row is not None else 0


def _inbox_done(conn: sqlite3.Connection, bot: str, conversation_id: str, message_id: str) -> None:
    key = (bot, conversation_id, message_id)
    conn.execute("DELETE FROM inbox WHERE bot = ? AND conversation_id = ? AND message_id = ?", key)
    conn.execute(
        "DELETE FROM inbox_state WHERE bot = ? AND conversation_id = ? AND message_id = ?", key
    )


def _inbox_pending(conn: sqlite3.Connection, bot: str) -> list[InboxEntry]:
    rows = conn.execute(
        "SELECT i.conversation_id, i.message_id, i.raw, coalesce(s.state, 'queued'),"
        " i.accepted_at, coalesce(s.attempts, 0)"
        " FROM inbox AS i LEFT JOIN inbox_state AS s"
        " ON s.bot = i.bot AND s.conversation_id = i.conversation_id"
        " AND s.message_id = i.message_id"
        " WHERE i.bot = ? ORDER BY i.accepted_at, i.rowid",
        (bot,),
    )
    return [
        InboxEntry(conversation_id=c, message_id=m, raw=r, state=s, accepted_at=a, attempts=n)
        for c, m, r, s, a, n in rows
    ]


def _get_binding(
    conn: sqlite3.Connection, bot: str, conversation_id: str, thread_id: str
) -> Binding | None:
    row = conn.execute(
        "SELECT session_id, title, created_at, updated_at FROM bindings"
        " WHERE bot = ? AND conversation_id = ? AND thread_id = ?",
        (bot, conversation_id, thread_id),
    ).fetchone()
    if row is None:
        return None
    return Binding(session_id=row[0], title=row[1], created_at=row[2], updated_at=row[3])


def _set_binding(
    conn: sqlite3.Connection,
    bot: str,
    conversation_id: str,
    thread_id: str,
    session_id: str,
    title: str | None,
    now: float,
) -> None:
    conn.execute(_SET_BINDING, (bot, conversation_id, thread_id, session_id, title, now, now))


def _clear_binding(
    conn: sqlite3.Connection, bot: str, conversation_id: str, thread_id: str
) -> bool:
    cur = conn.execute(
        "DELETE FROM bindings WHERE bot = ? AND conversation_id = ? AND thread_id = ?",
        (bot, conversation_id, thread_id),
    )
    return cur.rowcount > 0


def _get_cursor(conn: sqlite3.Connection, bot: str, name: str) -> str | None:
    row = conn.execute(
        "SELECT value FROM cursors WHERE bot = ? AND name = ?", (bot, name)
    ).fetchone()
    return None if row is None else str(row[0])


def _set_cursor(conn: sqlite3.Connection, bot: str, name: str, value: str) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO cursors (bot, name, value) VALUES (?, ?, ?)", (bot, name, value)
    )


def _add_outbound(
    conn: sqlite3.Connection, bot: str, conversation_id: str, entry: OutboundEntry, now: float
) -> None:
    with _transaction(conn):
        _insert_outbound(conn, bot, conversation_id, entry, now)


def _insert_outbound(
    conn: sqlite3.Connection, bot: str, conversation_id: str, entry: OutboundEntry, now: float
) -> None:
    """Insert and prune; the caller holds the transaction."""
    ids = _ids_encoder.encode(entry.message_ids).decode()
    text = entry.text[:OUTBOUND_TEXT_MAX]
    key = (bot, conversation_id)  # str indexes code points, so no pair is split
    conn.execute(
        f"INSERT INTO outbound (bot, conversation_id, {_OUTBOUND_COLUMNS})"
        " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            bot,
            conversation_id,
            ids,
            text,
            entry.sent_at,
            entry.completed_at,
            int(entry.inbound),
            entry.author_id,
            entry.author_name,
            _ids_encoder.encode(entry.attachments).decode(),
            entry.state,
        ),
    )
    # The cap: entries past the newest OUTBOUND_CAP go.  The cut walks the cap's worth of
    # index entries, so it runs only once a conversation may hold OUTBOUND_CUT_SLACK more
    # (listing reads the newest OUTBOUND_CAP anyway); the count is this connection's
    # estimate, from above (unknown after a restart: cut at once).
    counts = getattr(conn, "outbound_counts", None)
    n = counts.get(key) if counts is not None else None
    if n is None or n >= OUTBOUND_CAP + OUTBOUND_CUT_SLACK:
        conn.execute(_OUTBOUND_CUT, (bot, conversation_id, OUTBOUND_CAP))
        n = OUTBOUND_CAP
    else:
        n += 1
    if counts is not None:
        if len(counts) >= 10_000:
            counts.clear()
        counts[key] = n
    # Only this conversation: bounded work per insert; prune() sweeps the rest.  An entry
    # completed before the cutoff was sent before it too, so the sent_at range of the
    # index finds the candidates without reading the whole conversation.
    cutoff = now - OUTBOUND_MAX_AGE_S
    conn.execute(
        "DELETE FROM outbound WHERE bot = ? AND conversation_id = ? AND sent_at < ?"
        " AND completed_at < ?",
        (bot, conversation_id, cutoff, cutoff),
    )


def _list_outbound(
    conn: sqlite3.Connection, bot: str, conversation_id: str, now: float
) -> list[OutboundEntry]:
    rows = conn.execute(
        _OUTBOUND_LIST, (bot, conversation_id, now - OUTBOUND_MAX_AGE_S, OUTBOUND_CAP)
    )
    return [_entry(row) for row in rows]


def _entry(row: tuple[Any, ...]) -> OutboundEntry:
    ids, text, sent_at, completed_at, inbound, author_id, author_name, attachments, state = row
    return OutboundEntry(
        message_ids=_ids_decoder.decode(ids),
        text=text,
        sent_at=sent_at,
        completed_at=completed_at,
        inbound=bool(inbound),
        author_id=author_id,
        author_name=author_name,
        attachments=_attachments_decoder.decode(attachments),
        state=state,
    )


def _put_anchor(
    conn: sqlite3.Connection,
    bot: str,
    conversation_id: str,
    thread_id: str,
    turn_id: str,
    anchor_id: str,
    now: float,
    keep: int,
) -> None:
    with _transaction(conn):
        conn.execute(
            "INSERT OR REPLACE INTO anchors VALUES (?, ?, ?, ?, ?, ?)",
            (bot, conversation_id, thread_id, turn_id, anchor_id, now),
        )
        conn.execute(
            "DELETE FROM anchors WHERE bot = ? AND conversation_id = ? AND thread_id = ?"
            " AND turn_id IN (SELECT turn_id FROM anchors WHERE bot = ? AND conversation_id = ?"
            " AND thread_id = ? ORDER BY updated_at DESC, rowid DESC LIMIT -1 OFFSET ?)",
            (bot, conversation_id, thread_id, bot, conversation_id, thread_id, keep),
        )


def _get_anchor(
    conn: sqlite3.Connection, bot: str, conversation_id: str, thread_id: str, turn_id: str
) -> str | None:
    row = conn.execute(
        "SELECT anchor_id FROM anchors WHERE bot = ? AND conversation_id = ? AND thread_id = ?"
        " AND turn_id = ?",
        (bot, conversation_id, thread_id, turn_id),
    ).fetchone()
    return None if row is None else str(row[0])


def _update_outbound(
    conn: sqlite3.Connection,
    bot: str,
    conversation_id: str,
    message_id: str,
    now: float,
    text: str | None,
    completed_at: float | None,
    add_ids: Sequence[str],
    state: str | None,
) -> bool:
    with _transaction(conn):
        row = conn.execute(
            "SELECT id, message_ids FROM outbound"
            " WHERE bot = ? AND conversation_id = ? AND completed_at >= ?"
            " AND EXISTS (SELECT 1 FROM json_each(outbound.message_ids) WHERE value = ?)"
            " ORDER BY sent_at DESC, id DESC LIMIT 1",
            (bot, conversation_id, now - OUTBOUND_MAX_AGE_S, message_id),
        ).fetchone()
        if row is None:
            return False
        rowid, ids_json = row
        ids: list[str] = _ids_decoder.decode(ids_json)
        ids.extend(i for i in dict.fromkeys(add_ids) if i not in ids)
        conn.execute(
            "UPDATE outbound SET message_ids = ?, text = COALESCE(?, text),"
            " completed_at = COALESCE(?, completed_at), state = COALESCE(?, state)"
            " WHERE id = ?",
            (
                _ids_encoder.encode(ids).decode(),
                None if text is None else text[:OUTBOUND_TEXT_MAX],
                completed_at,
                state,
                rowid,
            ),
        )
    return True


def _log_message(
    conn: sqlite3.Connection, bot: str, conversation_id: str, message: LoggedMessage
) -> bool:
    attachments = _ids_encoder.encode(message.attachments).decode()
    with _transaction(conn):
        cur = conn.execute(
            _MESSAGE_INSERT,
            (
                bot,
                conversation_id,
                message.message_id,
                message.author_id,
                message.author_name,
                int(message.author_bot),
                message.text[:MESSAGE_TEXT_MAX],
                message.reply_to,
                attachments,
                message.client_id,
                message.at,
            ),
        )
        if cur.rowcount != 1:
            return False
        conn.execute(_MESSAGE_CUT, (bot, conversation_id, MESSAGE_LOG_CAP))
    return True


def _logged(row: tuple[Any, ...]) -> LoggedMessage:
    mid, author_id, author_name, author_bot, text, reply_to, attachments, client_id, at = row
    return LoggedMessage(
        message_id=mid,
        author_id=author_id,
        author_name=author_name,
        author_bot=bool(author_bot),
        text=text,
        reply_to=reply_to,
        attachments=_attachments_decoder.decode(attachments),
        client_id=client_id,
        at=at,
    )


def _message_log(
    conn: sqlite3.Connection, bot: str, conversation_id: str, limit: int
) -> list[LoggedMessage]:
    rows = conn.execute(
        f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE bot = ? AND conversation_id = ?"
        " ORDER BY at DESC, seq DESC LIMIT ?",
        (bot, conversation_id, limit),
    ).fetchall()
    return [_logged(row) for row in reversed(rows)]


def _logged_message(
    conn: sqlite3.Connection, bot: str, conversation_id: str, message_id: str
) -> LoggedMessage | None:
    row = conn.execute(
        f"SELECT {_MESSAGE_COLUMNS} FROM messages"
        " WHERE bot = ? AND conversation_id = ? AND message_id = ?",
        (bot, conversation_id, message_id),
    ).fetchone()
    return None if row is None else _logged(row)


def _append_transcript(
    conn: sqlite3.Connection,
    bot: str,
    session_id: str,
    role: str,
    text: str,
    at: float,
    completed: bool,
) -> int:
    cur = conn.execute(
        "INSERT INTO transcript (bot, session_id, role, text, at, completed)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (bot, session_id, role, text, at, int(completed)),
    )
    assert cur.lastrowid is not None
    return cur.lastrowid


def _transcript_page(
    conn: sqlite3.Connection, session_id: str, before_id: int | None, limit: int
) -> list[TranscriptRow]:
    if before_id is None:
        rows = conn.execute(
            "SELECT id, role, text, at, completed FROM transcript"
            " WHERE session_id = ? ORDER BY id DESC LIMIT ?",
            (session_id, limit),
        )
    else:
        rows = conn.execute(
            "SELECT id, role, text, at, completed FROM transcript"
            " WHERE session_id = ? AND id < ? ORDER BY id DESC LIMIT ?",
            (session_id, before_id, limit),
        )
    return [
        TranscriptRow(id=i, session_id=session_id, role=r, text=t, at=a, completed=bool(c))
        for i, r, t, a, c in rows
    ]


def _set_last_direct(conn: sqlite3.Connection, bot: str, conversation_id: str, now: float) -> None:
    conn.execute(
        "INSERT OR REPLACE INTO last_direct (bot, conversation_id, updated_at) VALUES (?, ?, ?)",
        (bot, conversation_id, now),
    )


def _get_last_direct(conn: sqlite3.Connection, bot: str) -> str | None:
    row = conn.execute("SELECT conversation_id FROM last_direct WHERE bot = ?", (bot,)).fetchone()
    return None if row is None else str(row[0])


def _prune(conn: sqlite3.Connection, now: float, limit: int) -> int:
    """Delete up to ``limit`` expired dedup keys and ``limit`` old outbound entries; returns
    the larger of the two counts (``limit``: there may be more)."""
    with _transaction(conn):
        keys = conn.execute(
            "DELETE FROM dedup WHERE (bot, conversation_id, message_id) IN ("
            " SELECT bot, conversation_id, message_id FROM dedup WHERE expires_at <= ? LIMIT ?)",
            (now, limit),
        ).rowcount
        entries = conn.execute(
            "DELETE FROM outbound WHERE id IN ("
            " SELECT id FROM outbound WHERE completed_at < ? LIMIT ?)",
            (now - OUTBOUND_MAX_AGE_S, limit),
        ).rowcount
    return max(keys, entries)


def _transcript_cut(conn: sqlite3.Connection, sessions: tuple[str, ...], keep: int) -> None:
    """Each session's rows past its newest ``keep`` go (an index walk of ``keep``)."""
    with _transaction(conn):
        for session_id in sessions:
            conn.execute(_TRANSCRIPT_CUT, (session_id, session_id, keep - 1))


def _transcript_cut_all(conn: sqlite3.Connection, after: str, keep: int, limit: int) -> str | None:
    """:func:`_transcript_cut` for the sessions with more than ``keep`` rows among the next
    ``limit`` sessions after ``after`` (by id); returns the last one looked at, None at
    the end."""
    rows = conn.execute(
        "SELECT session_id, count(*) FROM transcript WHERE session_id > ?"
        " GROUP BY session_id ORDER BY session_id LIMIT ?",
        (after, limit),
    ).fetchall()
    over = tuple(s for s, n in rows if n > keep)
    if over:
        _transcript_cut(conn, over, keep)
    return str(rows[-1][0]) if len(rows) == limit else None


def _transcript_expire(
    conn: sqlite3.Connection, after_id: int, cutoff: float, limit: int
) -> int | None:
    """Of the next ``limit`` rows after ``after_id`` (oldest first), those older than
    ``cutoff`` whose session no binding names go; returns the last id looked at, None once
    the rows looked at are all newer than ``cutoff`` (ids grow with time) or there are none."""
    with _transaction(conn):
        upto, oldest = conn.execute(
            "SELECT max(id), min(at) FROM"
            " (SELECT id, at FROM transcript WHERE id > ? ORDER BY id LIMIT ?)",
            (after_id, limit),
        ).fetchone()
        if upto is None or oldest >= cutoff:
            return None
        conn.execute(_TRANSCRIPT_EXPIRE, (after_id, upto, cutoff))
    return int(upto)


def _begin_turn(
    conn: sqlite3.Connection,
    bot: str,
    conversation_id: str,
    thread_id: str,
    inbox_keys: list[tuple[str, str]],
    last_direct: tuple[str, float] | None,
) -> Binding | None:
    with _transaction(conn):
        for conv, mid in inbox_keys:
            conn.execute(_INBOX_RUNNING, (bot, conv, mid))
        if last_direct is not None:
            _set_last_direct(conn, bot, last_direct[0], last_direct[1])
        return _get_binding(conn, bot, conversation_id, thread_id)


def _mark_delivered(
    conn: sqlite3.Connection, bot: str, inbox_keys: list[tuple[str, str]], prompt: PromptRow | None
) -> None:
    with _transaction(conn):
        for conv, mid in inbox_keys:
            _inbox_set_state(conn, bot, conv, mid, "delivered")
        if prompt is not None:
            _append_transcript(conn, bot, prompt.session_id, "user", prompt.text, prompt.at, True)


def _record_turn(
    conn: sqlite3.Connection,
    bot: str,
    conversation_id: str,
    turn: TurnRecord,
    now: float,
) -> None:
    with _transaction(conn):
        if turn.session_id is not None:
            if turn.user_text is not None:
                _append_transcript(
                    conn, bot, turn.session_id, "user", turn.user_text, turn.user_at, True
                )
            if turn.answer_text is not None:
                _append_transcript(
                    conn,
                    bot,
                    turn.session_id,
                    "assistant",
                    turn.answer_text,
                    turn.answer_at,
                    turn.completed,
                )
        for entry in turn.delivered:
            _insert_outbound(conn, bot, conversation_id, entry, now)
        for conv, mid in turn.inbox_done:
            _inbox_done(conn, bot, conv, mid)
