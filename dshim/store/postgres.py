"""The shared PostgreSQL store: the :class:`~dshim.store.base.Store` on a PostgreSQL database.

The same tables, semantics and bounds as the SQLite store (:mod:`dshim.store.sqlite`, whose
docstring describes every table), so that several ``dshim serve`` instances can share one
store.  What differs:

- Types: times are ``double precision``, raw events ``bytea``, flags ``boolean``; the ids of
  an outbound index entry are a ``text[]`` (looked up with ``= ANY``), attachments JSON text.
  Row order where SQLite used the rowid (the inbox, the anchors) is a ``bigserial`` column;
  a replaced row takes a new one, as SQLite's ``INSERT OR REPLACE`` gives a new rowid.
- PostgreSQL's ``text`` cannot hold U+0000: free text (message and answer texts, author
  names, titles) has it replaced by U+FFFD; ids are stored as given.
- Dedup is global: the dedup key is the primary key, and an accept is one statement (an
  upsert that only replaces an *expired* key), so two connections -- two instances -- can
  never both accept one message id: the second waits for the first's commit and then finds
  the key unexpired.
- Schema versions: :data:`MIGRATIONS` (own, starting at 1), the version in the one-row table
  ``dshim_schema``.  Migrating takes the transaction-scoped advisory lock
  :data:`ADVISORY_LOCK_KEY` (``pg_advisory_xact_lock``) for each step, so instances starting
  together migrate once and never race; a step is one transaction (DDL is transactional).

Theory of operation: a small :class:`psycopg_pool.ConnectionPool` (at most
:data:`POOL_MAX` autocommit connections) of synchronous psycopg 3 connections.  Every call
runs in a worker thread (``trio.to_thread.run_sync`` under a :class:`trio.CapacityLimiter`
the pool's size), takes a connection, runs its statements (one statement on its own, several
in an explicit transaction) and gives the connection back.  The calls of every event -- the
accept, a turn's begin, delivery mark and record -- are one statement each (data-modifying
``WITH`` clauses): one round trip, atomic without ``BEGIN``/``COMMIT``.  A started call runs to
completion (a cancelled caller waits for it: ``to_thread`` without abandoning), so a
transaction is never torn by cancellation; a caller cancelled before its call started writes
nothing.  ``inline=True`` runs each call on the trio thread instead (virtual clocks).

The URL's password (in the URL, or ``password``) is never logged and never part of an error
message: messages name the store by :func:`safe_target` and psycopg's errors pass through
:func:`redact` first.

Sharing the bots (:class:`~dshim.store.base.SharesBots`, schema 2)
-------------------------------------------------------------------
Tables ``leases`` (``bot`` primary key, ``owner``, ``epoch`` bigint, ``expires_at``) and
``instances`` (``name`` primary key, ``started_at``, ``seen_at``).  Every time a lease or a
heartbeat gets is the database's clock (:data:`DB_NOW`, ``clock_timestamp()``), never the
caller's; ``started_at`` is stored as the caller gives it.

- ``take_lease`` is one upsert: a new row (epoch 1), or the row updated only where its owner
  is the caller or it has expired.  The caller's own *unexpired* lease keeps its epoch (a
  renewal); an expired one -- the caller's own included -- or a released one is taken with
  ``epoch + 1``, so the writes of any earlier run of the bot are fenced.  Concurrent takers
  conflict on the primary key: the second waits for the first's commit, then finds the row
  held and unexpired (None).  Exactly one wins.
- ``renew_lease`` updates ``expires_at`` where bot, owner and epoch still match, also when
  the lease already ran out and nobody took it since (the choice made: safe, because the
  epoch did not move, so no other instance ran the bot -- and a fenced write never looks at
  the time either).  None when the epoch moved or the owner changed.
- ``release_lease`` sets ``expires_at`` to now where bot, owner and epoch still match.

Fencing: :meth:`PostgresStore.fenced` is a view of the same store (same pool, limiter and
estimates) whose writes carry the lease's (owner, epoch); a write of another bot through it
raises ValueError.  The check is the SQL function ``dshim_fence(bot, owner, epoch)``
(schema 2): it locks the bot's lease row ``FOR SHARE`` where owner and epoch still match
and returns true, else raises SQLSTATE :data:`FENCE_SQLSTATE`, which the store turns into
:class:`~dshim.errors.FencedError` naming the bot (never the URL).  A failed fence fails
its statement or transaction, so nothing of the write is kept; the error is a raise, not a
row count, so "fenced" never mixes with a write that legitimately changes nothing (a
duplicate accept, a missing entry).  The function is VOLATILE: its query takes a fresh
snapshot, so it sees a takeover that committed after the write's statement began; the
``FOR SHARE`` lock (held to the commit) makes a takeover's update of the lease row -- and a
renewal, a release -- wait for the writes in flight, and a write wait for a takeover in
flight (then refused if it committed).  A write is thus either before the takeover or
refused.  Which writes, and how:

- In the write's own statement (``SELECT dshim_fence(...)`` as the statement's one-row
  main query, the writes as data-modifying ``WITH`` clauses: still one round trip):
  ``accept`` (``accept_many``: every statement of its transaction), ``inbox_set_state``,
  ``inbox_resumed``, ``inbox_done``, ``begin_turn`` (with a key twice: the transaction's
  last statement), ``mark_delivered``, ``record_turn`` and ``add_outbound`` (and the cap's
  cut in the same transaction), ``set_binding``, ``clear_binding``, ``set_cursor``,
  ``append_transcript``, ``set_last_direct``.
- As the first statement of the write's transaction (one round trip more; rarer writes
  that already were several statements): ``outbox_put``, ``outbox_done``,
  ``update_outbound``, ``put_anchor``, ``log_message``.
- Once a view's write was fenced, every later write of that view raises FencedError at
  once (the epoch never comes back), without a round trip.
- Not fenced: ``prune`` (expiry and age limits, the same for every instance), every read,
  ``schema_version``; ``aclose`` of a view closes nothing (the pool is the store's).
- The unfenced store (what ``serve`` without leases, ``probe`` and ``migrate`` use) writes
  ``true`` in the function's place: the same statements, no lease lookups.

The webhook relay (:class:`~dshim.store.base.RelaysWebhooks`, schema 3)
-------------------------------------------------------------------------
Table ``relay`` (``seq`` bigserial, ``bot``, ``body`` bytea, ``received_at``).  An instance
that receives a webhook for a bot it does not run verifies it and ``relay_put``s the body:
one statement inserts it and calls ``pg_notify`` on :data:`RELAY_CHANNEL` with the bot's
name, delivered when it commits.  ``listen_relays`` holds one connection of its own
(outside the pool) that ``LISTEN``s, and wakes the bot's ``relay_wait``; after a
(re)connection it wakes every waiter once, as notifications may have been missed.  The
runner reads ``relay_pending`` from the first row each time (rows go once taken), so a
row whose insert committed after a higher ``seq`` was read is not skipped.
``relay_done`` deletes a row, fenced in its statement (not the put: its instance holds no
lease); ``prune`` drops rows older than :data:`~dshim.store.base.RELAY_MAX_AGE_S`.
"""

from __future__ import annotations

import copy
import re
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, TypeVarTuple

import msgspec
import psycopg
import psycopg_pool
import structlog
import trio
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from dshim.errors import FencedError, StoreError
from dshim.model import Attachment
from dshim.store.base import (
    INDEX_STATES,
    RELAY_MAX_AGE_S,
    Binding,
    InboxEntry,
    Instance,
    Lease,
    LoggedMessage,
    OutboundEntry,
    OutboxEntry,
    PromptRow,
    Relayed,
    RelaysWebhooks,
    Retention,
    SharesBots,
    Store,
    TranscriptRow,
    TurnRecord,
)
from dshim.store.sqlite import (
    INBOX_STATES,
    MESSAGE_LOG_CAP,
    MESSAGE_TEXT_MAX,
    OUTBOUND_CAP,
    OUTBOUND_CUT_SLACK,
    OUTBOUND_MAX_AGE_S,
    OUTBOUND_TEXT_MAX,
)

__all__ = [
    "ADVISORY_LOCK_KEY",
    "DB_NOW",
    "FENCE_SQLSTATE",
    "MIGRATIONS",
    "POOL_MAX",
    "SCHEMA_VERSION",
    "Migration",
    "PostgresStore",
    "open_postgres_store",
    "read_postgres_schema_version",
    "redact",
    "safe_target",
]

log = structlog.get_logger("dshim.store")

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")

#: Connections the pool keeps open at least, and at most (calls run at most this many at once).
POOL_MIN = 1
POOL_MAX = 4
#: How long opening waits for the server, and a call for a free connection, in seconds.
CONNECT_TIMEOUT_S = 10
POOL_TIMEOUT_S = 30.0
#: Rows one pruning transaction deletes at most (per table).
PRUNE_BATCH = 2000
#: Sessions one pruning transaction cuts to ``transcript_keep`` at most.
PRUNE_SESSIONS = 200
#: Sessions remembered as grown between two prunes at most (more: the prune looks at all).
GROWN_MAX = 100_000
#: The ``LISTEN``/``NOTIFY`` channel of the relay (the payload: the bot's name).
RELAY_CHANNEL = "dshim_relay"
#: How long the relay listener waits for notifications per thread call (it checks for
#: cancellation between calls), and before reconnecting after its connection failed.
LISTEN_POLL_S = 1.0
LISTEN_RETRY_S = 2.0
#: The advisory lock migrations hold (``pg_advisory_xact_lock``): b"dshm" as an integer.
ADVISORY_LOCK_KEY = 0x6473686D


class Migration(NamedTuple):
    """One schema step: the statements that take the schema from version N-1 to N.

    The version of a migration is its 1-based position in :data:`MIGRATIONS`.  Never edit
    or reorder a released migration; append a new one.
    """

    summary: str
    statements: tuple[str, ...]


_KEY = "bot text NOT NULL, conversation_id text NOT NULL, message_id text NOT NULL"

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        "initial tables (the SQLite store's schema 7)",
        (
            "CREATE TABLE dshim_schema (version integer NOT NULL)",
            "INSERT INTO dshim_schema (version) VALUES (0)",
            f"""CREATE TABLE dedup (
                {_KEY},
                expires_at double precision NOT NULL,
                PRIMARY KEY (bot, conversation_id, message_id)
            )""",
            "CREATE INDEX dedup_expires ON dedup (expires_at)",
            f"""CREATE TABLE inbox (
                seq bigserial NOT NULL,
                {_KEY},
                raw bytea NOT NULL,
                accepted_at double precision NOT NULL,
                PRIMARY KEY (bot, conversation_id, message_id)
            )""",
            f"""CREATE TABLE inbox_state (
                {_KEY},
                state text NOT NULL,
                attempts integer NOT NULL,
                PRIMARY KEY (bot, conversation_id, message_id)
            )""",
            f"""CREATE TABLE outbox (
                {_KEY},
                text text NOT NULL,
                created_at double precision NOT NULL,
                PRIMARY KEY (bot, conversation_id, message_id)
            )""",
            """CREATE TABLE bindings (
                bot text NOT NULL,
                conversation_id text NOT NULL,
                thread_id text NOT NULL,
                session_id text NOT NULL,
                title text,
                created_at double precision NOT NULL,
                updated_at double precision NOT NULL,
                PRIMARY KEY (bot, conversation_id, thread_id)
            )""",
            """CREATE TABLE cursors (
                bot text NOT NULL,
                name text NOT NULL,
                value text NOT NULL,
                PRIMARY KEY (bot, name)
            )""",
            """CREATE TABLE outbound (
                id bigserial PRIMARY KEY,
                bot text NOT NULL,
                conversation_id text NOT NULL,
                message_ids text[] NOT NULL,
                text text NOT NULL,
                sent_at double precision NOT NULL,
                completed_at double precision NOT NULL,
                inbound boolean NOT NULL DEFAULT false,
                author_id text,
                author_name text,
                attachments text NOT NULL DEFAULT '[]',
                state text NOT NULL DEFAULT 'ok'
            )""",
            "CREATE INDEX outbound_recent ON outbound (bot, conversation_id, sent_at, id)",
            "CREATE INDEX outbound_completed ON outbound (completed_at)",
            """CREATE TABLE anchors (
                seq bigserial NOT NULL,
                bot text NOT NULL,
                conversation_id text NOT NULL,
                thread_id text NOT NULL,
                turn_id text NOT NULL,
                anchor_id text NOT NULL,
                updated_at double precision NOT NULL,
                PRIMARY KEY (bot, conversation_id, thread_id, turn_id)
            )""",
            "CREATE INDEX anchors_recent ON anchors (bot, conversation_id, thread_id, updated_at)",
            """CREATE TABLE transcript (
                id bigserial PRIMARY KEY,
                bot text NOT NULL,
                session_id text NOT NULL,
                role text NOT NULL,
                text text NOT NULL,
                at double precision NOT NULL,
                completed boolean NOT NULL
            )""",
            "CREATE INDEX transcript_session ON transcript (session_id, id)",
            """CREATE TABLE last_direct (
                bot text PRIMARY KEY,
                conversation_id text NOT NULL,
                updated_at double precision NOT NULL
            )""",
            """CREATE TABLE messages (
                seq bigserial PRIMARY KEY,
                bot text NOT NULL,
                conversation_id text NOT NULL,
                message_id text NOT NULL,
                author_id text NOT NULL,
                author_name text,
                author_bot boolean NOT NULL,
                text text NOT NULL,
                reply_to text,
                attachments text NOT NULL,
                client_id text,
                at double precision NOT NULL
            )""",
            "CREATE UNIQUE INDEX messages_id ON messages (bot, conversation_id, message_id)",
            "CREATE INDEX messages_recent ON messages (bot, conversation_id, at, seq)",
        ),
    ),
    Migration(
        "leases, instances and the fence (several instances share the bots)",
        (
            """CREATE TABLE leases (
                bot text PRIMARY KEY,
                owner text NOT NULL,
                epoch bigint NOT NULL,
                expires_at double precision NOT NULL
            )""",
            """CREATE TABLE instances (
                name text PRIMARY KEY,
                started_at double precision NOT NULL,
                seen_at double precision NOT NULL
            )""",
            # True, holding the lease row FOR SHARE until the transaction ends, while
            # (owner, epoch) still hold the bot's lease; else raises FENCE_SQLSTATE.
            # VOLATILE: its query takes a fresh snapshot, so it sees a takeover that
            # committed after the calling statement started.
            """CREATE FUNCTION dshim_fence(p_bot text, p_owner text, p_epoch bigint)
            RETURNS boolean LANGUAGE plpgsql VOLATILE AS $$
            BEGIN
                PERFORM 1 FROM leases
                WHERE bot = p_bot AND owner = p_owner AND epoch = p_epoch FOR SHARE;
                IF NOT FOUND THEN
                    RAISE EXCEPTION 'bot %: the lease of % (epoch %) moved on',
                        p_bot, p_owner, p_epoch USING ERRCODE = 'DF001';
                END IF;
                RETURN true;
            END
            $$""",
        ),
    ),
    Migration(
        "the webhook relay (a webhook received by an instance that does not run its bot)",
        (
            """CREATE TABLE relay (
                seq bigserial PRIMARY KEY,
                bot text NOT NULL,
                body bytea NOT NULL,
                received_at double precision NOT NULL
            )""",
            "CREATE INDEX relay_bot ON relay (bot, seq)",
            "CREATE INDEX relay_received ON relay (received_at)",
        ),
    ),
    Migration(
        "find the sessions a binding names (transcript retention)",
        ("CREATE INDEX bindings_session ON bindings (session_id)",),
    ),
)

#: The schema version this code writes and understands.
SCHEMA_VERSION = len(MIGRATIONS)


# -- the password stays out of messages ----------------------------------------------------

_URL_PASSWORD = re.compile(r"(postgres(?:ql)?://[^:/@\s]*):[^@\s]*@", re.IGNORECASE)
_KV_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def safe_target(url: str) -> str:
    """The store's name for messages and logs: ``postgresql://user@host:port/db``, never
    the password (nor any other parameter)."""
    try:
        params = conninfo_to_dict(url)
    except psycopg.Error:
        return "postgresql://(an invalid URL)"
    user = str(params.get("user") or "")
    host = str(params.get("host") or "")
    port = str(params.get("port") or "")
    dbname = str(params.get("dbname") or "")
    userinfo = f"{user}@" if user else ""
    if host.startswith("/"):  # a unix socket directory
        host = f"[{host}]"
    return f"postgresql://{userinfo}{host}{f':{port}' if port else ''}/{dbname}"


def redact(text: str, password: str | None = None) -> str:
    """``text`` without a URL's or conninfo's password (and without ``password`` itself)."""
    if password:
        text = text.replace(password, "***")
    text = _URL_PASSWORD.sub(r"\1:***@", text)
    return _KV_PASSWORD.sub(r"\1***", text)


def _password_of(conninfo: str) -> str | None:
    try:
        value = conninfo_to_dict(conninfo).get("password")
    except psycopg.Error:
        return None
    return str(value) if value else None


def _free(text: str) -> str:
    """Free text as PostgreSQL's ``text`` can hold it (no U+0000)."""
    return text.replace("\x00", "\ufffd") if "\x00" in text else text


def _free_opt(text: str | None) -> str | None:
    return None if text is None else _free(text)


# -- fencing -------------------------------------------------------------------------------

#: The SQLSTATE ``dshim_fence`` raises when the lease moved on (class "DF": no standard one).
FENCE_SQLSTATE = "DF001"
#: The database's clock, in epoch seconds (the clock of every lease and heartbeat).
DB_NOW = "extract(epoch from clock_timestamp())::float8"
_FENCE_CALL = "dshim_fence(%(bot)s, %(f_owner)s, %(f_epoch)s::bigint)"


class _Fence(NamedTuple):
    """The lease a fenced write must still match (the bot is the write's own)."""

    owner: str
    epoch: int


def _with_fence(sql: str) -> tuple[str, str]:
    """A statement with a ``{fence}`` slot as (unfenced, fenced): ``true``, or the call of
    ``dshim_fence`` (named parameters ``bot``, ``f_owner``, ``f_epoch``), placed where it
    is evaluated exactly once whatever the statement's rows, so one statement checks the
    lease and writes -- or raises and writes nothing."""
    return sql.replace("{fence}", "true"), sql.replace("{fence}", _FENCE_CALL)


def _run(
    conn: psycopg.Connection[Any],
    pair: tuple[str, str],
    params: dict[str, Any],
    fence: _Fence | None,
) -> tuple[Any, ...]:
    """Run a statement of :func:`_with_fence` (fenced when ``fence`` is given); its row."""
    if fence is None:
        sql = pair[0]
    else:
        sql = pair[1]
        params = {**params, "f_owner": fence.owner, "f_epoch": fence.epoch}
    row = conn.execute(sql, params).fetchone()
    assert row is not None  # the statements always give one row
    return tuple(row)


def _check_fence(conn: psycopg.Connection[Any], bot: str, fence: _Fence | None) -> None:
    """The fence as a statement of its own (in a transaction the caller holds)."""
    if fence is not None:
        conn.execute(
            "SELECT dshim_fence(%s, %s, %s::bigint)", (bot, fence.owner, fence.epoch)
        ).fetchone()


# -- schema --------------------------------------------------------------------------------


def _read_version(conn: psycopg.Connection[Any], where: str) -> int:
    """The schema version (0: an empty database); refuses a newer one."""
    row = conn.execute("SELECT to_regclass('dshim_schema')").fetchone()
    if row is None or row[0] is None:
        return 0
    found = conn.execute("SELECT version FROM dshim_schema").fetchone()
    version = 0 if found is None else int(found[0])
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{where} has schema version {version}, newer than this dshim supports "
            f"({SCHEMA_VERSION}); upgrade dshim or use another database"
        )
    return version


def _migrate(conn: psycopg.Connection[Any], where: str) -> tuple[int, int]:
    """Bring the schema to :data:`SCHEMA_VERSION`, one transaction per step, each under the
    advisory lock (another instance may have migrated meanwhile: each step rereads the
    version under the lock).  Returns (version before, version after); logged like the
    SQLite store's migrations."""
    start: int | None = None
    applied: list[str] = []
    while True:
        with conn.transaction():
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (ADVISORY_LOCK_KEY,))
            version = _read_version(conn, where)
            if start is None:
                start = version
            if version >= SCHEMA_VERSION:
                break
            for statement in MIGRATIONS[version].statements:
                conn.execute(statement)
            conn.execute("UPDATE dshim_schema SET version = %s", (version + 1,))
        applied.append(f"{version + 1}: {MIGRATIONS[version].summary}")
    if start == 0 and applied:
        log.info("store_created", url=where, schema=version)
    elif applied:
        log.info("store_migrated", url=where, from_schema=start, schema=version, steps=applied)
    return start, version


def _connect(conninfo: str, where: str, password: str | None) -> psycopg.Connection[Any]:
    try:
        return psycopg.connect(conninfo, autocommit=True)
    except psycopg.Error as exc:
        raise StoreError(f"cannot open store {where}: {redact(str(exc), password)}") from None


def _conninfo(url: str, password: str | None) -> str:
    try:
        extra: dict[str, Any] = {"connect_timeout": CONNECT_TIMEOUT_S}
        if "application_name" not in conninfo_to_dict(url):
            extra["application_name"] = "dshim"
        if password:
            extra["password"] = password
        return make_conninfo(url, **extra)
    except psycopg.Error as exc:
        raise StoreError(
            f"store URL {safe_target(url)}: not a PostgreSQL URL: {redact(str(exc), password)}"
        ) from None


def _open_and_migrate(conninfo: str, where: str, password: str | None) -> tuple[int, int]:
    conn = _connect(conninfo, where, password)
    try:
        return _migrate(conn, where)
    except psycopg.Error as exc:
        raise StoreError(f"cannot migrate store {where}: {redact(str(exc), password)}") from None
    finally:
        conn.close()


def _version_only(conninfo: str, where: str, password: str | None) -> int:
    conn = _connect(conninfo, where, password)
    try:
        return _read_version(conn, where)
    except psycopg.Error as exc:
        raise StoreError(f"store {where}: {redact(str(exc), password)}") from None
    finally:
        conn.close()


async def read_postgres_schema_version(url: str, *, password: str | None = None) -> int:
    """The schema version of the database at ``url`` (0: empty), without migrating."""
    conninfo = _conninfo(url, password)
    secret = password or _password_of(conninfo)
    return await trio.to_thread.run_sync(_version_only, conninfo, safe_target(url), secret)


@asynccontextmanager
async def open_postgres_store(
    url: str,
    *,
    password: str | None = None,
    inline: bool = False,
    data_dir: Path | None = None,
    retention: Retention | None = None,
) -> AsyncIterator[PostgresStore]:
    """Open the store in the PostgreSQL database at ``url``, migrating it (under the
    advisory lock) first.

    ``password``: when the URL has none (from ``[store] password``).  ``inline=True`` runs
    each call on the trio thread (deterministic runs on a virtual clock).  ``data_dir``:
    where the channels' files are (the SQLite store's is its file's directory).  Raises
    :class:`~dshim.errors.StoreError` if the server cannot be reached, the URL is invalid
    or the schema is newer; the pool is closed when the block exits, even on cancellation.
    ``retention``: how long ``prune`` keeps transcripts (the defaults when None).
    """
    conninfo = _conninfo(url, password)
    secret = password or _password_of(conninfo)
    where = safe_target(url)
    if inline:
        _open_and_migrate(conninfo, where, secret)
    else:
        await trio.to_thread.run_sync(_open_and_migrate, conninfo, where, secret)
    pool: psycopg_pool.ConnectionPool[Any] = psycopg_pool.ConnectionPool(
        conninfo,
        min_size=POOL_MIN,
        max_size=POOL_MAX,
        kwargs={"autocommit": True},
        open=False,
        name="dshim-store",
        timeout=POOL_TIMEOUT_S,
    )

    def open_pool() -> None:
        try:
            pool.open(wait=True, timeout=CONNECT_TIMEOUT_S)
        except psycopg.Error as exc:
            pool.close()
            raise StoreError(f"cannot open store {where}: {redact(str(exc), secret)}") from None

    if inline:
        open_pool()
    else:
        await trio.to_thread.run_sync(open_pool)
    store = PostgresStore(
        pool, where, secret, inline=inline, data_dir=data_dir, retention=retention
    )
    try:
        yield store
    finally:
        await store.aclose()


_ACCEPT = """
    WITH k AS (
        INSERT INTO dedup (bot, conversation_id, message_id, expires_at)
        VALUES (%(bot)s, %(conv)s, %(mid)s, %(expires)s)
        ON CONFLICT (bot, conversation_id, message_id)
        DO UPDATE SET expires_at = excluded.expires_at WHERE dedup.expires_at <= %(now)s
        RETURNING 1
    ), i AS (
        INSERT INTO inbox (bot, conversation_id, message_id, raw, accepted_at)
        SELECT %(bot)s, %(conv)s, %(mid)s, %(raw)s::bytea, %(now)s
        WHERE %(raw)s::bytea IS NOT NULL AND EXISTS (SELECT 1 FROM k)
        ON CONFLICT (bot, conversation_id, message_id) DO UPDATE SET
            raw = excluded.raw, accepted_at = excluded.accepted_at, seq = excluded.seq
    ), s AS (
        DELETE FROM inbox_state
        WHERE bot = %(bot)s AND conversation_id = %(conv)s AND message_id = %(mid)s
          AND %(raw)s::bytea IS NOT NULL AND EXISTS (SELECT 1 FROM k)
    )
    SELECT {fence}, (SELECT count(*) FROM k)
"""
_ACCEPT, _ACCEPT_F = _with_fence(_ACCEPT)
_INBOX_RUNNING = """
    INSERT INTO inbox_state (bot, conversation_id, message_id, state, attempts)
    SELECT bot, conversation_id, message_id, 'running', 1 FROM inbox
    WHERE bot = %s AND conversation_id = %s AND message_id = %s
    ON CONFLICT (bot, conversation_id, message_id)
    DO UPDATE SET state = 'running', attempts = inbox_state.attempts + 1
"""
_SET_BINDING = _with_fence("""
    WITH w AS (
        INSERT INTO bindings
            (bot, conversation_id, thread_id, session_id, title, created_at, updated_at)
        VALUES (%(bot)s, %(conv)s, %(thread)s, %(sid)s, %(title)s, %(now)s, %(now)s)
        ON CONFLICT (bot, conversation_id, thread_id) DO UPDATE SET
            created_at = CASE WHEN bindings.session_id = excluded.session_id
                              THEN bindings.created_at ELSE excluded.created_at END,
            session_id = excluded.session_id,
            title = excluded.title,
            updated_at = excluded.updated_at
    )
    SELECT {fence}
""")
_OUTBOUND_COLUMNS = (
    "message_ids, text, sent_at, completed_at, inbound, author_id, author_name, attachments, state"
)
_OUTBOUND_CUT = """
    DELETE FROM outbound WHERE id IN (
        SELECT id FROM outbound WHERE bot = %s AND conversation_id = %s
        ORDER BY sent_at DESC, id DESC OFFSET %s
    )
"""
# A finished turn: transcript rows, index entries (and this conversation's expired ones),
# inbox completions; every part may be empty (see PostgresStore._write_turn).
_WRITE_TURN = f"""
    WITH t AS (
        INSERT INTO transcript (bot, session_id, role, text, at, completed)
        SELECT %(bot)s, %(sid)s, r.role, r.text, r.at, r.completed
        FROM unnest(%(roles)s::text[], %(texts)s::text[], %(ats)s::float8[], %(dones)s::bool[])
            WITH ORDINALITY AS r(role, text, at, completed, n)
        ORDER BY r.n
    ), o AS (
        INSERT INTO outbound (bot, conversation_id, {_OUTBOUND_COLUMNS})
        SELECT %(bot)s, %(conv)s,
            ARRAY(SELECT jsonb_array_elements_text(e.ids::jsonb)), e.text, e.sent_at,
            e.completed_at, e.inbound, e.author_id, e.author_name, e.attachments, e.state
        FROM unnest(%(o_ids)s::text[], %(o_text)s::text[], %(o_sent)s::float8[],
                    %(o_done)s::float8[], %(o_in)s::bool[], %(o_aid)s::text[],
                    %(o_aname)s::text[], %(o_att)s::text[], %(o_state)s::text[])
            WITH ORDINALITY AS e(ids, text, sent_at, completed_at, inbound, author_id,
                                 author_name, attachments, state, n)
        ORDER BY e.n
    ), aged AS (
        DELETE FROM outbound
        WHERE cardinality(%(o_ids)s::text[]) > 0 AND bot = %(bot)s AND conversation_id = %(conv)s
          AND sent_at < %(cutoff)s AND completed_at < %(cutoff)s
    ), done_state AS (
        DELETE FROM inbox_state
        WHERE bot = %(bot)s AND (conversation_id, message_id) IN (
            SELECT * FROM unnest(%(d_conv)s::text[], %(d_mid)s::text[]))
    ), done AS (
        DELETE FROM inbox
        WHERE bot = %(bot)s AND (conversation_id, message_id) IN (
            SELECT * FROM unnest(%(d_conv)s::text[], %(d_mid)s::text[]))
    )
    SELECT {{fence}}
"""
_WRITE_TURN, _WRITE_TURN_F = _with_fence(_WRITE_TURN)
# A turn starts: its inbox entries running (an attempt counted), the last direct conversation
# remembered (when given), the binding read.  The keys are distinct (else: one per key).
_BEGIN_TURN = """
    WITH r AS (
        INSERT INTO inbox_state (bot, conversation_id, message_id, state, attempts)
        SELECT i.bot, i.conversation_id, i.message_id, 'running', 1 FROM inbox AS i
        WHERE i.bot = %(bot)s AND (i.conversation_id, i.message_id) IN (
            SELECT * FROM unnest(%(k_conv)s::text[], %(k_mid)s::text[]))
        ON CONFLICT (bot, conversation_id, message_id)
        DO UPDATE SET state = 'running', attempts = inbox_state.attempts + 1
    ), d AS (
        INSERT INTO last_direct (bot, conversation_id, updated_at)
        SELECT %(bot)s, %(ld_conv)s::text, %(ld_at)s::float8 WHERE %(ld_conv)s::text IS NOT NULL
        ON CONFLICT (bot) DO UPDATE SET conversation_id = excluded.conversation_id,
            updated_at = excluded.updated_at
    )
    SELECT f.ok, b.session_id, b.title, b.created_at, b.updated_at
    FROM (SELECT {fence} AS ok) AS f LEFT JOIN bindings AS b
    ON b.bot = %(bot)s AND b.conversation_id = %(conv)s AND b.thread_id = %(thread)s
"""
_BEGIN_TURN, _BEGIN_TURN_F = _with_fence(_BEGIN_TURN)
# Right before a turn's first send: its inbox entries delivered, its prompt row (when
# given) in the transcript.
_MARK_DELIVERED = """
    WITH d AS (
        INSERT INTO inbox_state (bot, conversation_id, message_id, state, attempts)
        SELECT i.bot, i.conversation_id, i.message_id, 'delivered', 0 FROM inbox AS i
        WHERE i.bot = %(bot)s AND (i.conversation_id, i.message_id) IN (
            SELECT * FROM unnest(%(k_conv)s::text[], %(k_mid)s::text[]))
        ON CONFLICT (bot, conversation_id, message_id) DO UPDATE SET state = excluded.state
    ), p AS (
        INSERT INTO transcript (bot, session_id, role, text, at, completed)
        SELECT %(bot)s, %(sid)s::text, 'user', %(text)s::text, %(at)s::float8, true
        WHERE %(sid)s::text IS NOT NULL
    )
    SELECT {fence}
"""
_MARK_DELIVERED, _MARK_DELIVERED_F = _with_fence(_MARK_DELIVERED)
_MESSAGE_COLUMNS = (
    "message_id, author_id, author_name, author_bot, text, reply_to, attachments, client_id, at"
)

_json_encoder = msgspec.json.Encoder()
_attachments_decoder = msgspec.json.Decoder(list[Attachment])

_Conn = psycopg.Connection[Any]


class PostgresStore:
    """The :class:`~dshim.store.base.Store` on a PostgreSQL database.  Use
    :func:`open_postgres_store`.

    All methods are safe to call concurrently from trio tasks (each call takes a pooled
    connection in a worker thread).  After :meth:`aclose` every call raises StoreError.
    """

    def __init__(
        self,
        pool: psycopg_pool.ConnectionPool[Any],
        where: str,
        password: str | None,
        *,
        inline: bool = False,
        data_dir: Path | None = None,
        retention: Retention | None = None,
    ) -> None:
        self._pool: psycopg_pool.ConnectionPool[Any] | None = pool
        #: The store whose pool this one uses (itself, unless it is a fenced view).
        self._root = self
        #: The lease a fenced view writes under (None: the store itself, unfenced).
        self._lease: Lease | None = None
        #: A write of this view was fenced: the epoch never comes back, so every later
        #: write is refused at once, without a round trip.
        self._lost = False
        self._where = where
        self._password = password
        self._inline = inline
        self._limiter = trio.CapacityLimiter(POOL_MAX)
        self._data_dir = data_dir
        #: Outbound entries per (bot, conversation), estimated from above (see _insert_outbound).
        self._outbound_counts: dict[tuple[str, str], int] = {}
        #: The relay's waiters (bot -> the event a notification sets) and the bots notified
        #: since their last ``relay_pending`` (a wake-up between a read and a wait is kept).
        #: Shared by the fenced views (copies share these objects).
        self._relay_events: dict[str, trio.Event] = {}
        self._relay_woken: set[str] = set()
        self._retention = retention or Retention()
        #: Sessions this instance added transcript rows to since its last prune (the ones
        #: that may hold more than ``transcript_keep``); None until the first prune, which
        #: looks at every session.  The root's (views write through ``_root``).
        self._grown: set[str] | None = None

    @property
    def url(self) -> str:
        """The database, without its password."""
        return self._where

    @property
    def data_dir(self) -> Path | None:
        """The data directory of the channels' files (given when opened)."""
        return self._data_dir

    async def _call(self, fn: Callable[[_Conn, *_Ts], _T], *args: *_Ts) -> _T:
        if self._inline or self._root._pool is None:
            await trio.lowlevel.checkpoint()
            return self._guarded(fn, *args)
        return await trio.to_thread.run_sync(self._guarded, fn, *args, limiter=self._limiter)

    def _guarded(self, fn: Callable[[_Conn, *_Ts], _T], *args: *_Ts) -> _T:
        pool = self._root._pool
        if pool is None:
            raise StoreError(f"store {self._where} is closed")
        try:
            with pool.connection() as conn:
                return fn(conn, *args)
        except psycopg.Error as exc:
            if exc.sqlstate == FENCE_SQLSTATE:
                self._lost = True
                raise FencedError(self._fenced_message()) from None
            raise StoreError(f"store {self._where}: {redact(str(exc), self._password)}") from exc

    def _fence(self, bot: str) -> _Fence | None:
        """The fence of a write of ``bot``: None for the store itself; a fenced view's
        lease, refusing any other bot's write (ValueError)."""
        lease = self._lease
        if lease is None:
            return None
        if bot != lease.bot:
            raise ValueError(
                f"this view of the store writes for bot {lease.bot!r} only, not {bot!r}"
            )
        if self._lost:
            raise FencedError(self._fenced_message())
        return _Fence(lease.owner, lease.epoch)

    def _fenced_message(self) -> str:
        lease = self._lease
        if lease is None:  # cannot happen: only a view's writes call the fence
            return "a write was refused: its bot's lease moved on"
        return (
            f"bot {lease.bot!r}: its lease (instance {lease.owner!r}, epoch {lease.epoch}) "
            "moved on; the write is refused and the bot must stop here"
        )

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
        """See :meth:`dshim.store.sqlite.SqliteStore.accept`; one statement, so global."""
        fence = self._fence(bot)
        return await self._call(_accept, bot, conversation_id, message_id, now, ttl_s, raw, fence)

    async def accept_many(
        self,
        bot: str,
        entries: Sequence[tuple[str, str, bytes | None]],
        *,
        now: float,
        ttl_s: float,
    ) -> list[bool]:
        """:meth:`accept` for several keys in one transaction, in order."""
        fence = self._fence(bot)
        return await self._call(_accept_many, bot, tuple(entries), now, ttl_s, fence)

    async def seen(self, bot: str, conversation_id: str, message_id: str, *, now: float) -> bool:
        return await self._call(_seen, bot, conversation_id, message_id, now)

    async def inbox_set_state(
        self, bot: str, conversation_id: str, message_id: str, state: str
    ) -> None:
        if state not in INBOX_STATES:
            raise ValueError(f"inbox state must be one of {sorted(INBOX_STATES)}, not {state!r}")
        fence = self._fence(bot)
        await self._call(_inbox_set_state, bot, conversation_id, message_id, state, fence)

    async def outbox_put(
        self, bot: str, conversation_id: str, message_id: str, text: str, *, now: float
    ) -> None:
        fence = self._fence(bot)
        await self._call(_outbox_put, bot, conversation_id, message_id, text, now, fence)

    async def outbox_pending(self, bot: str) -> list[OutboxEntry]:
        return await self._call(_outbox_pending, bot)

    async def outbox_done(self, bot: str, conversation_id: str, message_id: str) -> None:
        await self._call(_outbox_done, bot, conversation_id, message_id, self._fence(bot))

    async def inbox_resumed(self, bot: str, conversation_id: str, message_id: str) -> int:
        fence = self._fence(bot)
        return await self._call(_inbox_resumed, bot, conversation_id, message_id, fence)

    async def inbox_done(self, bot: str, conversation_id: str, message_id: str) -> None:
        await self._call(_inbox_done, bot, conversation_id, message_id, self._fence(bot))

    async def inbox_pending(self, bot: str) -> list[InboxEntry]:
        return await self._call(_inbox_pending, bot)

    # -- turns -------------------------------------------------------------------------------

    async def begin_turn(
        self,
        bot: str,
        conversation_id: str,
        thread_id: str,
        inbox_keys: list[tuple[str, str]],
        *,
        last_direct: tuple[str, float] | None = None,
    ) -> Binding | None:
        fence = self._fence(bot)
        return await self._call(
            _begin_turn, bot, conversation_id, thread_id, list(inbox_keys), last_direct, fence
        )

    async def mark_delivered(
        self, bot: str, inbox_keys: list[tuple[str, str]], *, prompt: PromptRow | None
    ) -> None:
        if prompt is not None:
            self._grew(prompt.session_id)
        await self._call(_mark_delivered, bot, list(inbox_keys), prompt, self._fence(bot))

    async def record_turn(
        self, bot: str, conversation_id: str, turn: TurnRecord, *, now: float
    ) -> None:
        fence = self._fence(bot)
        if turn.session_id is not None and (
            turn.user_text is not None or turn.answer_text is not None
        ):
            self._grew(turn.session_id)
        await self._call(self._record_turn, bot, conversation_id, turn, now, fence)

    # -- bindings ----------------------------------------------------------------------------

    async def get_binding(self, bot: str, conversation_id: str, thread_id: str) -> Binding | None:
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
        fence = self._fence(bot)
        await self._call(
            _set_binding, bot, conversation_id, thread_id, session_id, title, now, fence
        )

    async def clear_binding(self, bot: str, conversation_id: str, thread_id: str) -> bool:
        fence = self._fence(bot)
        return await self._call(_clear_binding, bot, conversation_id, thread_id, fence)

    # -- transport cursors -------------------------------------------------------------------

    async def get_cursor(self, bot: str, name: str) -> str | None:
        return await self._call(_get_cursor, bot, name)

    async def set_cursor(self, bot: str, name: str, value: str) -> None:
        await self._call(_set_cursor, bot, name, value, self._fence(bot))

    # -- outbound index ----------------------------------------------------------------------

    async def add_outbound(
        self, bot: str, conversation_id: str, entry: OutboundEntry, *, now: float
    ) -> None:
        fence = self._fence(bot)
        await self._call(self._add_outbound, bot, conversation_id, entry, now, fence)

    async def list_outbound(
        self, bot: str, conversation_id: str, *, now: float
    ) -> list[OutboundEntry]:
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
            self._fence(bot),
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
        fence = self._fence(bot)
        await self._call(
            _put_anchor, bot, conversation_id, thread_id, turn_id, anchor_id, now, keep, fence
        )

    async def get_anchor(
        self, bot: str, conversation_id: str, thread_id: str, turn_id: str
    ) -> str | None:
        return await self._call(_get_anchor, bot, conversation_id, thread_id, turn_id)

    # -- message log -------------------------------------------------------------------------

    async def log_message(
        self, bot: str, conversation_id: str, message: LoggedMessage, *, now: float
    ) -> bool:
        fence = self._fence(bot)
        return await self._call(_log_message, bot, conversation_id, message, fence)

    async def message_log(
        self, bot: str, conversation_id: str, *, limit: int
    ) -> list[LoggedMessage]:
        if limit < 1:
            raise ValueError(f"limit must be positive, not {limit}")
        return await self._call(_message_log, bot, conversation_id, limit)

    async def logged_message(
        self, bot: str, conversation_id: str, message_id: str
    ) -> LoggedMessage | None:
        return await self._call(_logged_message, bot, conversation_id, message_id)

    # -- transcript --------------------------------------------------------------------------

    async def append_transcript(
        self, bot: str, session_id: str, role: str, text: str, *, at: float, completed: bool
    ) -> int:
        fence = self._fence(bot)
        self._grew(session_id)
        return await self._call(
            _append_transcript, bot, session_id, role, text, at, completed, fence
        )

    async def transcript_page(
        self, session_id: str, *, before_id: int | None, limit: int
    ) -> list[TranscriptRow]:
        if limit < 1:
            raise ValueError(f"limit must be positive, not {limit}")
        return await self._call(_transcript_page, session_id, before_id, limit)

    # -- misc --------------------------------------------------------------------------------

    async def set_last_direct(self, bot: str, conversation_id: str, *, now: float) -> None:
        await self._call(_set_last_direct, bot, conversation_id, now, self._fence(bot))

    async def get_last_direct(self, bot: str) -> str | None:
        return await self._call(_get_last_direct, bot)

    async def prune(self, *, now: float) -> None:
        """Drop expired dedup keys, outbound entries completed more than 30 days ago and
        relayed bodies nobody took in :data:`~dshim.store.base.RELAY_MAX_AGE_S`, in
        transactions of at most :data:`PRUNE_BATCH` rows per table; then the transcript
        rows past the store's :class:`~dshim.store.base.Retention` (the sessions this
        instance wrote to since its last prune; at the first, every session)."""
        while await self._call(_prune, now, PRUNE_BATCH) >= PRUNE_BATCH:
            pass
        root = self._root
        keep = root._retention.transcript_keep
        grown, root._grown = root._grown, set()
        if grown is None:
            after: str | None = ""
            while after is not None:
                after = await self._call(_transcript_cut_all, after, keep, PRUNE_SESSIONS)
        else:
            sessions = sorted(grown)
            for k in range(0, len(sessions), PRUNE_SESSIONS):
                chunk = sessions[k : k + PRUNE_SESSIONS]
                await self._call(_transcript_cut, chunk, keep)
        cutoff = now - root._retention.transcript_max_age_s
        after_id: int | None = 0
        while after_id is not None:
            after_id = await self._call(_transcript_expire, after_id, cutoff, PRUNE_BATCH)

    def _grew(self, session_id: str) -> None:
        root = self._root
        grown = root._grown
        if grown is None:
            return  # the next prune looks at every session anyway
        if len(grown) >= GROWN_MAX:
            root._grown = None  # too many to remember: the next prune looks at all
        else:
            grown.add(session_id)

    async def schema_version(self) -> int:
        return await self._call(_schema_version)

    # -- sharing the bots: leases, heartbeats, the fenced view (SharesBots) -----------------

    async def heartbeat(self, instance: str, *, started_at: float) -> None:
        """Record that ``instance`` (started at ``started_at``) is alive, now by the
        database's clock."""
        await self._call(_heartbeat, instance, started_at)

    async def instances(self, *, within_s: float) -> list[Instance]:
        """The instances whose heartbeat is at most ``within_s`` old, by name."""
        return await self._call(_instances, within_s)

    async def take_lease(self, bot: str, owner: str, *, lease_s: float) -> Lease | None:
        """Take a free or expired lease (``epoch`` + 1, even when it was the caller's own
        and ran out), renew one ``owner`` holds unexpired (same epoch), or None while
        another instance holds it unexpired.  One statement: of concurrent takers of a
        free or expired lease exactly one wins.  A takeover waits for the fenced writes
        of the old holder in flight (they hold the lease row ``FOR SHARE``)."""
        return await self._call(_take_lease, bot, owner, lease_s)

    async def renew_lease(self, lease: Lease, *, lease_s: float) -> Lease | None:
        """The lease runs ``lease_s`` more from now (the database's clock) if its owner and
        epoch still hold it -- also when it already ran out and nobody took it since: the
        epoch did not move, so no other instance ran the bot meanwhile.  None when lost."""
        return await self._call(_renew_lease, lease, lease_s)

    async def release_lease(self, lease: Lease) -> None:
        """The lease expires now, if its owner and epoch still hold it (else nothing)."""
        await self._call(_release_lease, lease)

    async def leases(self) -> list[Lease]:
        """Every bot's lease, held or expired, by bot."""
        return await self._call(_leases)

    # -- the webhook relay (RelaysWebhooks) --------------------------------------------------

    async def relay_put(self, bot: str, body: bytes, *, now: float) -> int:
        """Keep a verified webhook body for ``bot``; its runner is notified at the commit
        (one statement).  Not fenced: the receiving instance does not run the bot."""
        return await self._call(_relay_put, bot, body, now)

    async def relay_pending(self, bot: str, *, limit: int) -> list[Relayed]:
        """The bot's relayed bodies, oldest first.  Always from the first: a body whose
        insert committed late (a lower ``seq`` than one already read) is never skipped."""
        self._relay_woken.discard(bot)
        return await self._call(_relay_pending, bot, limit)

    async def relay_done(self, bot: str, seq: int) -> None:
        """The runner accepted the body (its messages are in the inbox): it goes.  Fenced."""
        await self._call(_relay_done, bot, seq, self._fence(bot))

    async def relay_wait(self, bot: str) -> None:
        """Until a body for ``bot`` was put since the last :meth:`relay_pending` of it (by
        any instance, seen through :meth:`listen_relays`); callers bound it with a timeout."""
        root = self._root
        if bot in root._relay_woken:
            await trio.lowlevel.checkpoint()
            return
        event = root._relay_events.get(bot)
        if event is None:
            event = root._relay_events[bot] = trio.Event()
        await event.wait()

    def _wake(self, bots: Sequence[str] | None) -> None:
        """Notified: wake the waiters of ``bots`` (None: of every bot; after the listener
        (re)connected, notifications may have been missed meanwhile)."""
        root = self._root
        names = list(root._relay_events) if bots is None else bots
        for bot in names:
            root._relay_woken.add(bot)
            event = root._relay_events.pop(bot, None)
            if event is not None:
                event.set()

    async def listen_relays(self) -> None:
        """Receive the relay's notifications on a connection of its own and wake the
        waiters, until cancelled; a lost connection is opened again (the waiters poll
        meanwhile)."""
        root = self._root
        while True:
            pool = root._pool
            if pool is None:
                return
            conninfo = pool.conninfo
            assert isinstance(conninfo, str)  # open_postgres_store gives a string
            try:
                conn = await trio.to_thread.run_sync(
                    _connect, conninfo, root._where, root._password
                )
            except StoreError as exc:
                log.warning("relay_listener_failed", error=str(exc)[:300])
                await trio.sleep(LISTEN_RETRY_S)
                continue
            try:
                await trio.to_thread.run_sync(_listen, conn)
                log.debug("relay_listening", channel=RELAY_CHANNEL)
                self._wake(None)
                while True:
                    self._wake(await trio.to_thread.run_sync(_notified, conn, LISTEN_POLL_S))
            except psycopg.Error as exc:
                log.warning("relay_listener_failed", error=redact(str(exc), root._password)[:300])
            finally:
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(conn.close)
            await trio.sleep(LISTEN_RETRY_S)

    def fenced(self, lease: Lease) -> PostgresStore:
        """The store as the bot of ``lease`` writes it: the same pool; every write of that
        bot checks ``lease`` in its own transaction and raises FencedError once the owner
        or epoch no longer hold it; another bot's write raises ValueError; reads, pruning
        and the schema version are the store's.  Closing the view closes nothing."""
        view = copy.copy(self._root)
        view._lease = lease
        view._lost = False
        return view

    async def aclose(self) -> None:
        """Close the pool.  Idempotent; shielded from cancellation.  A fenced view's
        does nothing (the pool is its store's)."""
        if self._root is not self:
            return
        pool, self._pool = self._pool, None
        if pool is None:
            return
        if self._inline:
            pool.close()
            return
        with trio.CancelScope(shield=True):
            await trio.to_thread.run_sync(pool.close)

    # -- bodies that use the store's estimate of the index's size -----------------------------

    def _add_outbound(
        self,
        conn: _Conn,
        bot: str,
        conversation_id: str,
        entry: OutboundEntry,
        now: float,
        fence: _Fence | None,
    ) -> None:
        self._write_turn(conn, bot, conversation_id, None, [entry], [], now, fence)

    def _record_turn(
        self,
        conn: _Conn,
        bot: str,
        conversation_id: str,
        turn: TurnRecord,
        now: float,
        fence: _Fence | None,
    ) -> None:
        rows: list[tuple[str, str, float, bool]] = []
        if turn.session_id is not None:
            if turn.user_text is not None:
                rows.append(("user", turn.user_text, turn.user_at, True))
            if turn.answer_text is not None:
                rows.append(("assistant", turn.answer_text, turn.answer_at, turn.completed))
        transcript = (turn.session_id, rows) if rows and turn.session_id is not None else None
        self._write_turn(
            conn, bot, conversation_id, transcript, turn.delivered, turn.inbox_done, now, fence
        )

    def _write_turn(
        self,
        conn: _Conn,
        bot: str,
        conversation_id: str,
        transcript: tuple[str, list[tuple[str, str, float, bool]]] | None,
        entries: Sequence[OutboundEntry],
        inbox_done: Sequence[tuple[str, str]],
        now: float,
        fence: _Fence | None,
    ) -> None:
        """Transcript rows, index entries (each conversation's own expired entries go) and
        inbox completions in one statement: one round trip, atomic on its own.

        The cap's cut (entries past the newest :data:`OUTBOUND_CAP`) must see the new
        entries, which a sibling of the insert in the same statement cannot: it follows as
        a second statement of the same transaction, and, as in the SQLite store, only once
        the conversation may hold :data:`OUTBOUND_CUT_SLACK` more (this store's estimate,
        from above; unknown after a restart: cut at once).  An entry that is already past
        the age limit when it is added is never listed and goes with the next prune.
        """
        key = (bot, conversation_id)
        counts = self._outbound_counts
        n = counts.get(key)
        cut = bool(entries) and (n is None or n + len(entries) > OUTBOUND_CAP + OUTBOUND_CUT_SLACK)
        roles: list[str] = []
        texts: list[str] = []
        ats: list[float] = []
        dones: list[bool] = []
        session_id = None
        if transcript is not None:
            session_id = transcript[0]
            for role, text, at, completed in transcript[1]:
                roles.append(role)
                texts.append(_free(text))
                ats.append(at)
                dones.append(completed)
        params: dict[str, Any] = {
            "bot": bot,
            "conv": conversation_id,
            "sid": session_id,
            "roles": roles,
            "texts": texts,
            "ats": ats,
            "dones": dones,
            "o_ids": [_json_encoder.encode(e.message_ids).decode() for e in entries],
            "o_text": [_free(e.text[:OUTBOUND_TEXT_MAX]) for e in entries],
            "o_sent": [e.sent_at for e in entries],
            "o_done": [e.completed_at for e in entries],
            "o_in": [e.inbound for e in entries],
            "o_aid": [e.author_id for e in entries],
            "o_aname": [_free_opt(e.author_name) for e in entries],
            "o_att": [_json_encoder.encode(e.attachments).decode() for e in entries],
            "o_state": [e.state for e in entries],
            "cutoff": now - OUTBOUND_MAX_AGE_S,
            "d_conv": [c for c, _ in inbox_done],
            "d_mid": [m for _, m in inbox_done],
        }
        if cut:
            with conn.transaction():
                _run(conn, (_WRITE_TURN, _WRITE_TURN_F), params, fence)
                conn.execute(_OUTBOUND_CUT, (bot, conversation_id, OUTBOUND_CAP))
            n = OUTBOUND_CAP
        else:
            _run(conn, (_WRITE_TURN, _WRITE_TURN_F), params, fence)
            if n is not None:
                n += len(entries)
        if n is not None:
            if len(counts) >= 10_000:
                counts.clear()
            counts[key] = n


# -- bodies (run in a worker thread with a pooled connection) -------------------------------


def _accept_one(
    conn: _Conn,
    bot: str,
    conversation_id: str,
    message_id: str,
    now: float,
    ttl_s: float,
    raw: bytes | None,
    fence: _Fence | None,
) -> bool:
    params = {
        "bot": bot,
        "conv": conversation_id,
        "mid": message_id,
        "expires": now + ttl_s,
        "now": now,
        "raw": raw,
    }
    return int(_run(conn, (_ACCEPT, _ACCEPT_F), params, fence)[1]) == 1


def _accept(
    conn: _Conn,
    bot: str,
    conversation_id: str,
    message_id: str,
    now: float,
    ttl_s: float,
    raw: bytes | None,
    fence: _Fence | None,
) -> bool:
    return _accept_one(conn, bot, conversation_id, message_id, now, ttl_s, raw, fence)


def _accept_many(
    conn: _Conn,
    bot: str,
    entries: tuple[tuple[str, str, bytes | None], ...],
    now: float,
    ttl_s: float,
    fence: _Fence | None,
) -> list[bool]:
    with conn.transaction():
        return [
            _accept_one(conn, bot, conversation_id, message_id, now, ttl_s, raw, fence)
            for conversation_id, message_id, raw in entries
        ]


def _seen(conn: _Conn, bot: str, conversation_id: str, message_id: str, now: float) -> bool:
    row = conn.execute(
        "SELECT 1 FROM dedup WHERE bot = %s AND conversation_id = %s AND message_id = %s"
        " AND expires_at > %s",
        (bot, conversation_id, message_id, now),
    ).fetchone()
    return row is not None


_INBOX_QUEUED = _with_fence(
    "WITH w AS (UPDATE inbox_state SET state = 'queued'"
    " WHERE bot = %(bot)s AND conversation_id = %(conv)s AND message_id = %(mid)s)"
    " SELECT {fence}"
)
_INBOX_STATE = _with_fence(
    "WITH w AS (INSERT INTO inbox_state (bot, conversation_id, message_id, state, attempts)"
    " SELECT bot, conversation_id, message_id, %(state)s::text, 0 FROM inbox"
    " WHERE bot = %(bot)s AND conversation_id = %(conv)s AND message_id = %(mid)s"
    " ON CONFLICT (bot, conversation_id, message_id) DO UPDATE SET state = excluded.state)"
    " SELECT {fence}"
)


def _inbox_set_state(
    conn: _Conn,
    bot: str,
    conversation_id: str,
    message_id: str,
    state: str,
    fence: _Fence | None,
) -> None:
    params = {"bot": bot, "conv": conversation_id, "mid": message_id, "state": state}
    # "queued" needs no state row; the attempts counted so far are kept.
    _run(conn, _INBOX_QUEUED if state == "queued" else _INBOX_STATE, params, fence)


def _outbox_put(
    conn: _Conn,
    bot: str,
    conversation_id: str,
    message_id: str,
    text: str,
    now: float,
    fence: _Fence | None,
) -> None:
    with conn.transaction():
        _check_fence(conn, bot, fence)
        conn.execute(
            "INSERT INTO outbox (bot, conversation_id, message_id, text, created_at)"
            " VALUES (%s, %s, %s, %s, %s)"
            " ON CONFLICT (bot, conversation_id, message_id)"
            " DO UPDATE SET text = excluded.text, created_at = excluded.created_at",
            (bot, conversation_id, message_id, _free(text), now),
        )
        _inbox_set_state(conn, bot, conversation_id, message_id, "undelivered", None)


def _outbox_pending(conn: _Conn, bot: str) -> list[OutboxEntry]:
    rows = conn.execute(
        "SELECT o.conversation_id, o.message_id, o.text, o.created_at, i.raw"
        " FROM outbox AS o LEFT JOIN inbox AS i ON i.bot = o.bot"
        " AND i.conversation_id = o.conversation_id AND i.message_id = o.message_id"
        " WHERE o.bot = %s ORDER BY o.created_at",
        (bot,),
    ).fetchall()
    return [
        OutboxEntry(
            conversation_id=c,
            message_id=m,
            text=t,
            created_at=a,
            raw=None if r is None else bytes(r),
        )
        for c, m, t, a, r in rows
    ]


def _outbox_done(
    conn: _Conn, bot: str, conversation_id: str, message_id: str, fence: _Fence | None
) -> None:
    with conn.transaction():
        _check_fence(conn, bot, fence)
        conn.execute(
            "DELETE FROM outbox WHERE bot = %s AND conversation_id = %s AND message_id = %s",
            (bot, conversation_id, message_id),
        )
        _inbox_done(conn, bot, conversation_id, message_id, None)


_INBOX_RESUMED = _with_fence(
    "WITH w AS (INSERT INTO inbox_state (bot, conversation_id, message_id, state, attempts)"
    " SELECT bot, conversation_id, message_id, 'queued', 1 FROM inbox"
    " WHERE bot = %(bot)s AND conversation_id = %(conv)s AND message_id = %(mid)s"
    " ON CONFLICT (bot, conversation_id, message_id)"
    " DO UPDATE SET attempts = inbox_state.attempts + 1"
    " RETURNING attempts)"
    " SELECT {fence}, (SELECT attempts FROM w)"
)
# One statement: the inbox row and its state row go together.
_INBOX_DONE = _with_fence(
    "WITH s AS (DELETE FROM inbox_state"
    " WHERE bot = %(bot)s AND conversation_id = %(conv)s AND message_id = %(mid)s),"
    " i AS (DELETE FROM inbox WHERE bot = %(bot)s AND conversation_id = %(conv)s"
    " AND message_id = %(mid)s)"
    " SELECT {fence}"
)


def _inbox_resumed(
    conn: _Conn, bot: str, conversation_id: str, message_id: str, fence: _Fence | None
) -> int:
    params = {"bot": bot, "conv": conversation_id, "mid": message_id}
    attempts = _run(conn, _INBOX_RESUMED, params, fence)[1]
    return 0 if attempts is None else int(attempts) - 1


def _inbox_done(
    conn: _Conn, bot: str, conversation_id: str, message_id: str, fence: _Fence | None
) -> None:
    _run(conn, _INBOX_DONE, {"bot": bot, "conv": conversation_id, "mid": message_id}, fence)


def _inbox_pending(conn: _Conn, bot: str) -> list[InboxEntry]:
    rows = conn.execute(
        "SELECT i.conversation_id, i.message_id, i.raw, coalesce(s.state, 'queued'),"
        " i.accepted_at, coalesce(s.attempts, 0)"
        " FROM inbox AS i LEFT JOIN inbox_state AS s"
        " ON s.bot = i.bot AND s.conversation_id = i.conversation_id"
        " AND s.message_id = i.message_id"
        " WHERE i.bot = %s ORDER BY i.accepted_at, i.seq",
        (bot,),
    ).fetchall()
    return [
        InboxEntry(
            conversation_id=c, message_id=m, raw=bytes(r), state=s, accepted_at=a, attempts=n
        )
        for c, m, r, s, a, n in rows
    ]


def _get_binding(conn: _Conn, bot: str, conversation_id: str, thread_id: str) -> Binding | None:
    row = conn.execute(
        "SELECT session_id, title, created_at, updated_at FROM bindings"
        " WHERE bot = %s AND conversation_id = %s AND thread_id = %s",
        (bot, conversation_id, thread_id),
    ).fetchone()
    if row is None:
        return None
    return Binding(session_id=row[0], title=row[1], created_at=row[2], updated_at=row[3])


def _set_binding(
    conn: _Conn,
    bot: str,
    conversation_id: str,
    thread_id: str,
    session_id: str,
    title: str | None,
    now: float,
    fence: _Fence | None,
) -> None:
    params = {
        "bot": bot,
        "conv": conversation_id,
        "thread": thread_id,
        "sid": session_id,
        "title": _free_opt(title),
        "now": now,
    }
    _run(conn, _SET_BINDING, params, fence)


_CLEAR_BINDING = _with_fence(
    "WITH w AS (DELETE FROM bindings WHERE bot = %(bot)s AND conversation_id = %(conv)s"
    " AND thread_id = %(thread)s RETURNING 1)"
    " SELECT {fence}, (SELECT count(*) FROM w)"
)


def _clear_binding(
    conn: _Conn, bot: str, conversation_id: str, thread_id: str, fence: _Fence | None
) -> bool:
    params = {"bot": bot, "conv": conversation_id, "thread": thread_id}
    return int(_run(conn, _CLEAR_BINDING, params, fence)[1]) > 0


def _get_cursor(conn: _Conn, bot: str, name: str) -> str | None:
    row = conn.execute(
        "SELECT value FROM cursors WHERE bot = %s AND name = %s", (bot, name)
    ).fetchone()
    return None if row is None else str(row[0])


_SET_CURSOR = _with_fence(
    "WITH w AS (INSERT INTO cursors (bot, name, value) VALUES (%(bot)s, %(name)s, %(value)s)"
    " ON CONFLICT (bot, name) DO UPDATE SET value = excluded.value)"
    " SELECT {fence}"
)


def _set_cursor(conn: _Conn, bot: str, name: str, value: str, fence: _Fence | None) -> None:
    _run(conn, _SET_CURSOR, {"bot": bot, "name": name, "value": value}, fence)


def _list_outbound(conn: _Conn, bot: str, conversation_id: str, now: float) -> list[OutboundEntry]:
    rows = conn.execute(
        f"SELECT {_OUTBOUND_COLUMNS} FROM outbound"
        " WHERE bot = %s AND conversation_id = %s AND completed_at >= %s"
        " ORDER BY sent_at DESC, id DESC LIMIT %s",
        (bot, conversation_id, now - OUTBOUND_MAX_AGE_S, OUTBOUND_CAP),
    ).fetchall()
    return [_entry(row) for row in rows]


def _entry(row: tuple[Any, ...]) -> OutboundEntry:
    ids, text, sent_at, completed_at, inbound, author_id, author_name, attachments, state = row
    return OutboundEntry(
        message_ids=list(ids),
        text=text,
        sent_at=sent_at,
        completed_at=completed_at,
        inbound=bool(inbound),
        author_id=author_id,
        author_name=author_name,
        attachments=_attachments_decoder.decode(attachments),
        state=state,
    )


def _update_outbound(
    conn: _Conn,
    bot: str,
    conversation_id: str,
    message_id: str,
    now: float,
    text: str | None,
    completed_at: float | None,
    add_ids: Sequence[str],
    state: str | None,
    fence: _Fence | None,
) -> bool:
    with conn.transaction():
        _check_fence(conn, bot, fence)
        row = conn.execute(
            "SELECT id, message_ids FROM outbound"
            " WHERE bot = %s AND conversation_id = %s AND completed_at >= %s"
            " AND %s = ANY(message_ids)"
            " ORDER BY sent_at DESC, id DESC LIMIT 1 FOR UPDATE",
            (bot, conversation_id, now - OUTBOUND_MAX_AGE_S, message_id),
        ).fetchone()
        if row is None:
            return False
        rowid, found = row
        ids: list[str] = list(found)
        ids.extend(i for i in dict.fromkeys(add_ids) if i not in ids)
        conn.execute(
            "UPDATE outbound SET message_ids = %s, text = COALESCE(%s, text),"
            " completed_at = COALESCE(%s, completed_at), state = COALESCE(%s, state)"
            " WHERE id = %s",
            (
                ids,
                None if text is None else _free(text[:OUTBOUND_TEXT_MAX]),
                completed_at,
                state,
                rowid,
            ),
        )
    return True


def _put_anchor(
    conn: _Conn,
    bot: str,
    conversation_id: str,
    thread_id: str,
    turn_id: str,
    anchor_id: str,
    now: float,
    keep: int,
    fence: _Fence | None,
) -> None:
    with conn.transaction():
        _check_fence(conn, bot, fence)
        conn.execute(
            "INSERT INTO anchors (bot, conversation_id, thread_id, turn_id, anchor_id, updated_at)"
            " VALUES (%s, %s, %s, %s, %s, %s)"
            " ON CONFLICT (bot, conversation_id, thread_id, turn_id) DO UPDATE SET"
            " anchor_id = excluded.anchor_id, updated_at = excluded.updated_at,"
            " seq = excluded.seq",
            (bot, conversation_id, thread_id, turn_id, anchor_id, now),
        )
        conn.execute(
            "DELETE FROM anchors WHERE bot = %s AND conversation_id = %s AND thread_id = %s"
            " AND turn_id IN (SELECT turn_id FROM anchors WHERE bot = %s"
            " AND conversation_id = %s AND thread_id = %s"
            " ORDER BY updated_at DESC, seq DESC OFFSET %s)",
            (bot, conversation_id, thread_id, bot, conversation_id, thread_id, keep),
        )


def _get_anchor(
    conn: _Conn, bot: str, conversation_id: str, thread_id: str, turn_id: str
) -> str | None:
    row = conn.execute(
        "SELECT anchor_id FROM anchors WHERE bot = %s AND conversation_id = %s"
        " AND thread_id = %s AND turn_id = %s",
        (bot, conversation_id, thread_id, turn_id),
    ).fetchone()
    return None if row is None else str(row[0])


def _log_message(
    conn: _Conn, bot: str, conversation_id: str, message: LoggedMessage, fence: _Fence | None
) -> bool:
    with conn.transaction():
        _check_fence(conn, bot, fence)
        cur = conn.execute(
            f"INSERT INTO messages (bot, conversation_id, {_MESSAGE_COLUMNS})"
            " VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s)"
            " ON CONFLICT (bot, conversation_id, message_id) DO NOTHING",
            (
                bot,
                conversation_id,
                message.message_id,
                message.author_id,
                _free_opt(message.author_name),
                message.author_bot,
                _free(message.text[:MESSAGE_TEXT_MAX]),
                message.reply_to,
                _json_encoder.encode(message.attachments).decode(),
                message.client_id,
                message.at,
            ),
        )
        if cur.rowcount != 1:
            return False
        conn.execute(
            "DELETE FROM messages WHERE seq IN ("
            " SELECT seq FROM messages WHERE bot = %s AND conversation_id = %s"
            " ORDER BY at DESC, seq DESC OFFSET %s)",
            (bot, conversation_id, MESSAGE_LOG_CAP),
        )
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


def _message_log(conn: _Conn, bot: str, conversation_id: str, limit: int) -> list[LoggedMessage]:
    rows = conn.execute(
        f"SELECT {_MESSAGE_COLUMNS} FROM messages WHERE bot = %s AND conversation_id = %s"
        " ORDER BY at DESC, seq DESC LIMIT %s",
        (bot, conversation_id, limit),
    ).fetchall()
    return [_logged(row) for row in reversed(rows)]


def _logged_message(
    conn: _Conn, bot: str, conversation_id: str, message_id: str
) -> LoggedMessage | None:
    row = conn.execute(
        f"SELECT {_MESSAGE_COLUMNS} FROM messages"
        " WHERE bot = %s AND conversation_id = %s AND message_id = %s",
        (bot, conversation_id, message_id),
    ).fetchone()
    return None if row is None else _logged(row)


_APPEND_TRANSCRIPT = _with_fence(
    "WITH w AS (INSERT INTO transcript (bot, session_id, role, text, at, completed)"
    " VALUES (%(bot)s, %(sid)s, %(role)s, %(text)s, %(at)s, %(done)s) RETURNING id)"
    " SELECT {fence}, (SELECT id FROM w)"
)


def _append_transcript(
    conn: _Conn,
    bot: str,
    session_id: str,
    role: str,
    text: str,
    at: float,
    completed: bool,
    fence: _Fence | None,
) -> int:
    params = {
        "bot": bot,
        "sid": session_id,
        "role": role,
        "text": _free(text),
        "at": at,
        "done": completed,
    }
    return int(_run(conn, _APPEND_TRANSCRIPT, params, fence)[1])


def _transcript_page(
    conn: _Conn, session_id: str, before_id: int | None, limit: int
) -> list[TranscriptRow]:
    if before_id is None:
        rows = conn.execute(
            "SELECT id, role, text, at, completed FROM transcript"
            " WHERE session_id = %s ORDER BY id DESC LIMIT %s",
            (session_id, limit),
        ).fetchall()
    else:
        rows = conn.execute(
            "SELECT id, role, text, at, completed FROM transcript"
            " WHERE session_id = %s AND id < %s ORDER BY id DESC LIMIT %s",
            (session_id, before_id, limit),
        ).fetchall()
    return [
        TranscriptRow(id=int(i), session_id=session_id, role=r, text=t, at=a, completed=bool(c))
        for i, r, t, a, c in rows
    ]


_SET_LAST_DIRECT = _with_fence(
    "WITH w AS (INSERT INTO last_direct (bot, conversation_id, updated_at)"
    " VALUES (%(bot)s, %(conv)s, %(now)s)"
    " ON CONFLICT (bot) DO UPDATE SET conversation_id = excluded.conversation_id,"
    " updated_at = excluded.updated_at)"
    " SELECT {fence}"
)


def _set_last_direct(
    conn: _Conn, bot: str, conversation_id: str, now: float, fence: _Fence | None
) -> None:
    _run(conn, _SET_LAST_DIRECT, {"bot": bot, "conv": conversation_id, "now": now}, fence)


def _get_last_direct(conn: _Conn, bot: str) -> str | None:
    row = conn.execute("SELECT conversation_id FROM last_direct WHERE bot = %s", (bot,)).fetchone()
    return None if row is None else str(row[0])


def _prune(conn: _Conn, now: float, limit: int) -> int:
    with conn.transaction():
        keys = conn.execute(
            "DELETE FROM dedup WHERE (bot, conversation_id, message_id) IN ("
            " SELECT bot, conversation_id, message_id FROM dedup WHERE expires_at <= %s"
            " LIMIT %s)",
            (now, limit),
        ).rowcount
        entries = conn.execute(
            "DELETE FROM outbound WHERE id IN ("
            " SELECT id FROM outbound WHERE completed_at < %s LIMIT %s)",
            (now - OUTBOUND_MAX_AGE_S, limit),
        ).rowcount
        relayed = conn.execute(
            "DELETE FROM relay WHERE seq IN ("
            " SELECT seq FROM relay WHERE received_at < %s LIMIT %s)",
            (now - RELAY_MAX_AGE_S, limit),
        ).rowcount
    return max(keys, entries, relayed)


# A session's rows older than its newest ``keep`` (the subquery: the keep-th newest id,
# NULL when it has fewer, and then nothing goes).
_TRANSCRIPT_CUT = """
    DELETE FROM transcript WHERE session_id = %(sid)s AND id < (
        SELECT id FROM transcript WHERE session_id = %(sid)s ORDER BY id DESC
        LIMIT 1 OFFSET %(skip)s
    )
"""


def _transcript_cut(conn: _Conn, sessions: Sequence[str], keep: int) -> None:
    """Each session's rows past its newest ``keep`` go (an index walk of ``keep``)."""
    with conn.transaction():
        for session_id in sessions:
            conn.execute(_TRANSCRIPT_CUT, {"sid": session_id, "skip": keep - 1})


def _transcript_cut_all(conn: _Conn, after: str, keep: int, limit: int) -> str | None:
    """:func:`_transcript_cut` for the sessions with more than ``keep`` rows among the next
    ``limit`` sessions after ``after``; returns the last one looked at, None at the end."""
    rows = conn.execute(
        "SELECT session_id, count(*) FROM transcript WHERE session_id > %s"
        " GROUP BY session_id ORDER BY session_id LIMIT %s",
        (after, limit),
    ).fetchall()
    over = [s for s, n in rows if n > keep]
    if over:
        _transcript_cut(conn, over, keep)
    return str(rows[-1][0]) if len(rows) == limit else None


def _transcript_expire(conn: _Conn, after_id: int, cutoff: float, limit: int) -> int | None:
    """Of the next ``limit`` rows after ``after_id`` (oldest first), those older than
    ``cutoff`` whose session no binding names go; returns the last id looked at, None once
    the rows looked at are all newer than ``cutoff`` (ids grow with time) or there are none."""
    with conn.transaction():
        row = conn.execute(
            "SELECT max(id), min(at) FROM"
            " (SELECT id, at FROM transcript WHERE id > %s ORDER BY id LIMIT %s) AS w",
            (after_id, limit),
        ).fetchone()
        if row is None or row[0] is None or row[1] >= cutoff:
            return None
        conn.execute(
            "DELETE FROM transcript WHERE id > %s AND id <= %s AND at < %s"
            " AND NOT EXISTS (SELECT 1 FROM bindings AS b"
            " WHERE b.session_id = transcript.session_id)",
            (after_id, row[0], cutoff),
        )
    return int(row[0])


def _begin_turn(
    conn: _Conn,
    bot: str,
    conversation_id: str,
    thread_id: str,
    inbox_keys: list[tuple[str, str]],
    last_direct: tuple[str, float] | None,
    fence: _Fence | None,
) -> Binding | None:
    if len(set(inbox_keys)) != len(inbox_keys):  # a key twice counts twice: one at a time
        with conn.transaction():  # the last statement's fence covers the whole transaction
            for conv, mid in inbox_keys:
                conn.execute(_INBOX_RUNNING, (bot, conv, mid))
            return _begin_turn(conn, bot, conversation_id, thread_id, [], last_direct, fence)
    row = _run(
        conn,
        (_BEGIN_TURN, _BEGIN_TURN_F),
        {
            "bot": bot,
            "conv": conversation_id,
            "thread": thread_id,
            "k_conv": [c for c, _ in inbox_keys],
            "k_mid": [m for _, m in inbox_keys],
            "ld_conv": None if last_direct is None else last_direct[0],
            "ld_at": None if last_direct is None else last_direct[1],
        },
        fence,
    )
    if row[1] is None:  # no binding (session_id is never NULL in one)
        return None
    return Binding(session_id=row[1], title=row[2], created_at=row[3], updated_at=row[4])


def _mark_delivered(
    conn: _Conn,
    bot: str,
    inbox_keys: list[tuple[str, str]],
    prompt: PromptRow | None,
    fence: _Fence | None,
) -> None:
    _run(
        conn,
        (_MARK_DELIVERED, _MARK_DELIVERED_F),
        {
            "bot": bot,
            "k_conv": [c for c, _ in inbox_keys],
            "k_mid": [m for _, m in inbox_keys],
            "sid": None if prompt is None else prompt.session_id,
            "text": None if prompt is None else _free(prompt.text),
            "at": None if prompt is None else prompt.at,
        },
        fence,
    )


_LEASE_COLUMNS = "bot, owner, epoch, expires_at"
_TAKE_LEASE = f"""
    INSERT INTO leases AS l (bot, owner, epoch, expires_at)
    VALUES (%(bot)s, %(owner)s, 1, {DB_NOW} + %(lease_s)s)
    ON CONFLICT (bot) DO UPDATE SET
        epoch = CASE WHEN l.owner = excluded.owner AND l.expires_at > {DB_NOW}
                     THEN l.epoch ELSE l.epoch + 1 END,
        owner = excluded.owner,
        expires_at = {DB_NOW} + %(lease_s)s
    WHERE l.owner = excluded.owner OR l.expires_at <= {DB_NOW}
    RETURNING {_LEASE_COLUMNS}
"""
_RENEW_LEASE = f"""
    UPDATE leases SET expires_at = {DB_NOW} + %(lease_s)s
    WHERE bot = %(bot)s AND owner = %(owner)s AND epoch = %(epoch)s
    RETURNING {_LEASE_COLUMNS}
"""
_RELEASE_LEASE = f"""
    UPDATE leases SET expires_at = least(expires_at, {DB_NOW})
    WHERE bot = %(bot)s AND owner = %(owner)s AND epoch = %(epoch)s
"""


def _lease_of(row: tuple[Any, ...] | None) -> Lease | None:
    if row is None:
        return None
    return Lease(bot=row[0], owner=row[1], epoch=int(row[2]), expires_at=float(row[3]))


def _take_lease(conn: _Conn, bot: str, owner: str, lease_s: float) -> Lease | None:
    params = {"bot": bot, "owner": owner, "lease_s": lease_s}
    return _lease_of(conn.execute(_TAKE_LEASE, params).fetchone())


def _renew_lease(conn: _Conn, lease: Lease, lease_s: float) -> Lease | None:
    params = {"bot": lease.bot, "owner": lease.owner, "epoch": lease.epoch, "lease_s": lease_s}
    return _lease_of(conn.execute(_RENEW_LEASE, params).fetchone())


def _release_lease(conn: _Conn, lease: Lease) -> None:
    conn.execute(_RELEASE_LEASE, {"bot": lease.bot, "owner": lease.owner, "epoch": lease.epoch})


def _leases(conn: _Conn) -> list[Lease]:
    rows = conn.execute(f"SELECT {_LEASE_COLUMNS} FROM leases ORDER BY bot").fetchall()
    return [lease for lease in map(_lease_of, rows) if lease is not None]


def _heartbeat(conn: _Conn, instance: str, started_at: float) -> None:
    conn.execute(
        f"INSERT INTO instances (name, started_at, seen_at) VALUES (%s, %s, {DB_NOW})"
        " ON CONFLICT (name) DO UPDATE SET started_at = excluded.started_at,"
        " seen_at = excluded.seen_at",
        (instance, started_at),
    )


def _instances(conn: _Conn, within_s: float) -> list[Instance]:
    rows = conn.execute(
        f"SELECT name, started_at, seen_at FROM instances WHERE seen_at >= {DB_NOW} - %s"
        " ORDER BY name",
        (within_s,),
    ).fetchall()
    return [Instance(name=n, started_at=float(a), seen_at=float(b)) for n, a, b in rows]


def _relay_put(conn: _Conn, bot: str, body: bytes, now: float) -> int:
    row = conn.execute(
        "WITH r AS (INSERT INTO relay (bot, body, received_at) VALUES (%(bot)s, %(body)s,"
        " %(now)s) RETURNING seq) SELECT r.seq, pg_notify(%(channel)s, %(bot)s) FROM r",
        {"bot": bot, "body": body, "now": now, "channel": RELAY_CHANNEL},
    ).fetchone()
    assert row is not None
    return int(row[0])


def _relay_pending(conn: _Conn, bot: str, limit: int) -> list[Relayed]:
    rows = conn.execute(
        "SELECT seq, body FROM relay WHERE bot = %s ORDER BY seq LIMIT %s", (bot, limit)
    ).fetchall()
    return [Relayed(int(seq), bytes(body)) for seq, body in rows]


_RELAY_DONE = _with_fence(
    "WITH d AS (DELETE FROM relay WHERE bot = %(bot)s AND seq = %(seq)s) SELECT {fence}"
)


def _relay_done(conn: _Conn, bot: str, seq: int, fence: _Fence | None) -> None:
    _run(conn, _RELAY_DONE, {"bot": bot, "seq": seq}, fence)


def _listen(conn: psycopg.Connection[Any]) -> None:
    conn.execute(f"LISTEN {RELAY_CHANNEL}")


def _notified(conn: psycopg.Connection[Any], timeout: float) -> list[str]:
    """The bots notified within ``timeout`` (at least one notification ends the wait)."""
    bots: list[str] = []
    for notify in conn.notifies(timeout=timeout, stop_after=1):
        bots.append(notify.payload)
    # What arrived with it (a burst), without waiting.
    for notify in conn.notifies(timeout=0.0):
        bots.append(notify.payload)
    return bots


def _schema_version(conn: _Conn) -> int:
    row = conn.execute("SELECT version FROM dshim_schema").fetchone()
    return 0 if row is None else int(row[0])


if TYPE_CHECKING:  # the store and its fenced view implement both protocols

    def _implements(
        store: PostgresStore, lease: Lease
    ) -> tuple[Store, SharesBots, RelaysWebhooks, Store]:
        return store, store, store, store.fenced(lease)
