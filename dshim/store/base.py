"""The store interface: everything dshim persists, behind one narrow protocol.

The SQLite implementation (:mod:`dshim.store.sqlite`) is the default; the interface stays
narrow so that a shared PostgreSQL store can follow.  Every method is async and safe to
call from the trio thread (implementations do blocking work in a worker thread).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol, runtime_checkable

import msgspec

from dshim.model import Attachment, Delivered


class Binding(msgspec.Struct, frozen=True, kw_only=True):
    """A conversation (+ thread) bound to a harness session."""

    session_id: str
    title: str | None
    created_at: float
    updated_at: float


class OutboundEntry(msgspec.Struct, frozen=True, kw_only=True):
    """One entry of a conversation's message index (the "outbound index").

    Mostly the bot's own delivered messages, kept so quotes of them can be resolved later
    (``inbound`` false; the author is the bot).  Channels whose platform never gives a
    quoted message's content and has no fetch-by-id API (WeChat, DingTalk, QQ, WhatsApp)
    also record every accepted user message here (``inbound`` true, with its author), so
    the index holds both directions under the same bounds.

    ``message_ids``: every id the message is known by (platform message id, client id,
    quote index keys, card track ids), matched exactly.  ``attachments``: kinds and names
    only.  ``state``: ``ok``; ``deleted`` (recalled/revoked: a quote of it is
    ``deleted``); ``undelivered`` (the platform reported the send failed).
    """

    message_ids: list[str]
    text: str
    sent_at: float
    completed_at: float
    inbound: bool = False
    author_id: str | None = None
    author_name: str | None = None
    attachments: list[Attachment] = msgspec.field(default_factory=list)
    state: str = "ok"

    @classmethod
    def from_delivered(cls, d: Delivered) -> OutboundEntry:
        """The index entry of one delivered message."""
        return cls(
            message_ids=[d.message_id], text=d.text, sent_at=d.sent_at, completed_at=d.completed_at
        )


#: The states of an index entry.
INDEX_STATES = ("ok", "deleted", "undelivered")


class LoggedMessage(msgspec.Struct, frozen=True, kw_only=True):
    """One message of a conversation as a channel that keeps its own message log saw it.

    Platforms without a fetch-by-id API (the web chat) resolve quotes and rebuild a
    conversation's history from this log.  ``message_id`` is unique per conversation;
    ``attachments`` carry kinds and names only (never the data); ``client_id`` is the
    sender's own key for the message, when it has one.
    """

    message_id: str
    author_id: str
    author_name: str | None = None
    author_bot: bool = False
    text: str = ""
    at: float
    reply_to: str | None = None
    attachments: list[Attachment] = msgspec.field(default_factory=list)
    client_id: str | None = None


class TranscriptRow(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt or answer relayed through a session."""

    id: int
    session_id: str
    role: str  # "user" | "assistant"
    text: str
    at: float
    completed: bool


class OutboxEntry(msgspec.Struct, frozen=True, kw_only=True):
    """The final text of an answer the platform did not take yet, and the raw event of
    the message it answers (None if that entry is gone)."""

    conversation_id: str
    message_id: str
    text: str
    created_at: float
    raw: bytes | None


class InboxEntry(msgspec.Struct, frozen=True, kw_only=True):
    """An accepted message whose handling has not finished (survives a restart).

    ``state``: ``queued`` (waiting for its turn), ``running`` (its turn started and had
    shown nothing yet), ``delivered`` (its turn may have shown the user part of an answer),
    ``undelivered`` (its answer waits in the outbox).
    ``attempts``: how many turns were started for it.
    """

    conversation_id: str
    message_id: str
    raw: bytes
    state: str  # "queued" | "running" | "delivered" | "undelivered"
    accepted_at: float
    attempts: int = 0


class PromptRow(msgspec.Struct, frozen=True, kw_only=True):
    """The transcript row of a turn's prompt, written together with its delivery mark."""

    session_id: str
    text: str
    at: float


class TurnRecord(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a finished turn writes, in one transaction."""

    session_id: str | None
    user_text: str | None
    user_at: float
    answer_text: str | None
    answer_at: float
    completed: bool
    delivered: list[OutboundEntry]
    inbox_done: list[tuple[str, str]]


#: A session's transcript keeps at least its newest this many rows (``[store]
#: transcript_keep``): more than the openai harness's context and the history recovery's
#: page budget need.
TRANSCRIPT_KEEP = 1000
#: Transcript rows older than this (90 days) go once no binding names their session any
#: more (``[store] transcript_max_age_s``).
TRANSCRIPT_MAX_AGE_S = 90 * 86400.0


class Retention(msgspec.Struct, frozen=True, kw_only=True):
    """How long the store keeps a session's transcript (``[store]``), applied by
    :meth:`Store.prune`:

    - ``transcript_keep``: each session keeps its newest this many rows; older rows of a
      session go (the openai harness reads the newest ``max_context_messages``, history
      recovery the newest ``pages`` x ``rows_per_page``: never more);
    - ``transcript_max_age_s``: rows older than this go once no binding names their
      session (after ``/new``, or a conversation unbound); an open session's rows are only
      ever cut to ``transcript_keep``, however old.
    """

    transcript_keep: int = TRANSCRIPT_KEEP
    transcript_max_age_s: float = TRANSCRIPT_MAX_AGE_S


class Store(Protocol):
    """Everything dshim persists.  See :mod:`dshim.store.sqlite` for the default."""

    # -- dedup and the durable inbox --------------------------------------------------
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
        expired.  ``raw`` None means: remember the key, keep no inbox entry.
        """
        ...

    async def accept_many(
        self,
        bot: str,
        entries: Sequence[tuple[str, str, bytes | None]],
        *,
        now: float,
        ttl_s: float,
    ) -> list[bool]:
        """``accept`` for several (conversation, message, raw) keys in one transaction."""
        ...

    async def seen(self, bot: str, conversation_id: str, message_id: str, *, now: float) -> bool:
        """True if the key was accepted and has not expired."""
        ...

    async def inbox_set_state(
        self, bot: str, conversation_id: str, message_id: str, state: str
    ) -> None: ...

    async def outbox_put(
        self, bot: str, conversation_id: str, message_id: str, text: str, *, now: float
    ) -> None:
        """Keep the final text of an answer the platform did not take (see the sqlite store)."""
        ...

    async def outbox_pending(self, bot: str) -> list[OutboxEntry]:
        """The bot's undelivered answers, oldest first."""
        ...

    async def outbox_done(self, bot: str, conversation_id: str, message_id: str) -> None:
        """The answer (or a notice in its place) was delivered."""
        ...

    async def inbox_resumed(self, bot: str, conversation_id: str, message_id: str) -> int:
        """Count one resume of a queued entry after a restart (as an attempt, like a turn
        start); returns the attempts counted before this one."""
        ...

    async def inbox_done(self, bot: str, conversation_id: str, message_id: str) -> None:
        """Handling finished (answered, refused or dropped after acceptance)."""
        ...

    async def inbox_pending(self, bot: str) -> list[InboxEntry]:
        """Accepted but unfinished messages of a bot, oldest first."""
        ...

    # -- turns (composite writes keep a turn to three store round trips) --------------
    async def begin_turn(
        self,
        bot: str,
        conversation_id: str,
        thread_id: str,
        inbox_keys: list[tuple[str, str]],
        *,
        last_direct: tuple[str, float] | None = None,
    ) -> Binding | None:
        """Mark the turn's inbox entries running and count the attempt, remember
        ``(conversation, now)`` as the last direct conversation when given, and return the
        conversation's binding."""
        ...

    async def mark_delivered(
        self, bot: str, inbox_keys: list[tuple[str, str]], *, prompt: PromptRow | None
    ) -> None:
        """Right before a turn's first send: its inbox entries become ``delivered`` and its
        prompt row (when given) joins the transcript, in one transaction, durable on return."""
        ...

    async def record_turn(
        self, bot: str, conversation_id: str, turn: TurnRecord, *, now: float
    ) -> None:
        """Write the transcript rows, outbound index entries and inbox completion of a turn."""
        ...

    # -- bindings ----------------------------------------------------------------------
    async def get_binding(
        self, bot: str, conversation_id: str, thread_id: str
    ) -> Binding | None: ...

    async def set_binding(
        self,
        bot: str,
        conversation_id: str,
        thread_id: str,
        session_id: str,
        *,
        title: str | None,
        now: float,
    ) -> None: ...

    async def clear_binding(self, bot: str, conversation_id: str, thread_id: str) -> bool:
        """Unbind; True if a binding existed."""
        ...

    # -- transport cursors (offsets, sequence numbers, session ids) -------------------
    async def get_cursor(self, bot: str, name: str) -> str | None: ...

    async def set_cursor(self, bot: str, name: str, value: str) -> None: ...

    # -- outbound index ----------------------------------------------------------------
    async def add_outbound(
        self, bot: str, conversation_id: str, entry: OutboundEntry, *, now: float
    ) -> None:
        """Add an entry; keeps the newest 200 per bot+conversation, none older than 30 days,
        text cut to 8,000 code points."""
        ...

    async def list_outbound(
        self, bot: str, conversation_id: str, *, now: float
    ) -> list[OutboundEntry]:
        """Entries of a bot+conversation, newest first (at most 200, within 30 days)."""
        ...

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
        """Change the newest entry of a bot+conversation that carries ``message_id``: set
        the given fields, add ids it is also known by.  False when there is none."""
        ...

    # -- reply anchors of substitute turns ---------------------------------------------
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
        """Remember a turn's anchor; keep the newest ``keep`` per conversation + thread."""
        ...

    async def get_anchor(
        self, bot: str, conversation_id: str, thread_id: str, turn_id: str
    ) -> str | None:
        """A turn's anchor, or None when it was never recorded or was evicted."""
        ...

    # -- message log (channels that keep their own: the web chat) -----------------------
    async def log_message(
        self, bot: str, conversation_id: str, message: LoggedMessage, *, now: float
    ) -> bool:
        """Add a message to a conversation's log; False, writing nothing, when its id is
        already there.  Keeps the newest 500 per bot+conversation (by ``at``), text cut to
        100,000 code points."""
        ...

    async def message_log(
        self, bot: str, conversation_id: str, *, limit: int
    ) -> list[LoggedMessage]:
        """The newest ``limit`` messages of a conversation's log, oldest first."""
        ...

    async def logged_message(
        self, bot: str, conversation_id: str, message_id: str
    ) -> LoggedMessage | None:
        """One message of a conversation's log, or None (another conversation's is None)."""
        ...

    # -- transcript --------------------------------------------------------------------
    async def append_transcript(
        self, bot: str, session_id: str, role: str, text: str, *, at: float, completed: bool
    ) -> int: ...

    async def transcript_page(
        self, session_id: str, *, before_id: int | None, limit: int
    ) -> list[TranscriptRow]:
        """Rows of a session, newest first, with ``id < before_id`` when given."""
        ...

    # -- misc --------------------------------------------------------------------------
    async def set_last_direct(self, bot: str, conversation_id: str, *, now: float) -> None: ...

    async def get_last_direct(self, bot: str) -> str | None: ...

    async def prune(self, *, now: float) -> None:
        """Drop expired dedup keys, outbound entries past their age and transcript rows
        past the store's :class:`Retention`."""
        ...

    async def schema_version(self) -> int: ...

    async def aclose(self) -> None: ...


class Lease(msgspec.Struct, frozen=True, kw_only=True):
    """One bot's lease in a shared store: the instance that runs it (``owner``), the
    lease's generation (``epoch``: +1 at every change of hands) and when it runs out
    (``expires_at``: the database's clock, epoch seconds)."""

    bot: str
    owner: str
    epoch: int
    expires_at: float


class Instance(msgspec.Struct, frozen=True, kw_only=True):
    """A ``dshim serve`` instance of a shared store, as its last heartbeat left it."""

    name: str
    started_at: float
    seen_at: float


class Relayed(NamedTuple):
    """A webhook body in a shared store's relay, in arrival order (``seq``)."""

    seq: int
    body: bytes


@runtime_checkable
class RelaysWebhooks(Protocol):
    """A shared store's relay (PostgreSQL): the webhook bodies an instance received for a
    bot that another instance runs (or that no instance runs right now), verified by the
    receiving instance, kept until the bot's runner took them.

    - :meth:`relay_put`: keep ``body`` for ``bot`` and wake the instances that wait on it
      (``LISTEN``/``NOTIFY``, sent when the insert commits);
    - :meth:`relay_pending`: the bot's bodies in arrival order, at most ``limit``;
    - :meth:`relay_done`: the runner accepted the body: it goes (a fenced write);
    - :meth:`relay_wait`: until a body for ``bot`` is put (by any instance); woken only
      while :meth:`listen_relays` runs in this process, so a runner waits under a
      timeout and reads again (it polls).
    - :meth:`listen_relays`: receive the store's wake-ups, until cancelled.
    Bodies nobody took are dropped by ``prune`` after :data:`RELAY_MAX_AGE_S`.
    """

    async def relay_put(self, bot: str, body: bytes, *, now: float) -> int: ...

    async def relay_pending(self, bot: str, *, limit: int) -> list[Relayed]: ...

    async def relay_done(self, bot: str, seq: int) -> None: ...

    async def relay_wait(self, bot: str) -> None: ...

    async def listen_relays(self) -> None: ...


#: Relayed webhook bodies that no runner took in this long are pruned: Meta gives up
#: redelivering a notification after about as long.
RELAY_MAX_AGE_S = 7 * 86400.0


class BotRelay:
    """A :class:`RelaysWebhooks` store's relay bound to one bot (what a channel and the
    endpoint see: :class:`dshim.channels.base.Relay`)."""

    __slots__ = ("_store", "_bot", "_clock")

    def __init__(self, store: RelaysWebhooks, bot: str, clock: Callable[[], float]) -> None:
        self._store = store
        self._bot = bot
        self._clock = clock

    async def put(self, body: bytes) -> None:
        await self._store.relay_put(self._bot, body, now=self._clock())

    async def pending(self, limit: int) -> list[Relayed]:
        return await self._store.relay_pending(self._bot, limit=limit)

    async def done(self, seq: int) -> None:
        await self._store.relay_done(self._bot, seq)

    async def wait(self) -> None:
        await self._store.relay_wait(self._bot)


@runtime_checkable
class SharesBots(Protocol):
    """A store several ``dshim serve`` instances share (PostgreSQL): every bot runs in the
    one instance that holds its lease.  Times are the database's clock (one clock for all
    instances); only the epoch decides who may write (fencing), never a time.

    - :meth:`take_lease`: a free or expired lease is taken (``epoch`` + 1); one the
      caller holds already is renewed (same epoch); one another instance holds unexpired
      gives None.
    - :meth:`renew_lease`: the lease runs ``lease_s`` more from now, if ``owner`` and
      ``epoch`` still hold it; None when it was lost (taken over after it expired).
    - :meth:`release_lease`: the lease expires now, if it is still the caller's.
    - :meth:`fenced`: the store as the bot of ``lease`` sees it.  Every durable write of
      that bot -- dedup accept and inbox, confirm/state changes, cursors, outbound index
      and message log, outbox, transcripts, bindings, anchors -- is checked against the
      lease in the same transaction and raises :class:`~dshim.errors.FencedError` once
      the epoch moved or the owner changed; reads are unchanged.  So an instance that was
      paused past its lease (GC, SIGSTOP, a partition) cannot confirm, send from the
      inbox or commit a cursor when it wakes.
    """

    async def heartbeat(self, instance: str, *, started_at: float) -> None: ...

    async def instances(self, *, within_s: float) -> list[Instance]:
        """The instances whose heartbeat is at most ``within_s`` old."""
        ...

    async def take_lease(self, bot: str, owner: str, *, lease_s: float) -> Lease | None: ...

    async def renew_lease(self, lease: Lease, *, lease_s: float) -> Lease | None: ...

    async def release_lease(self, lease: Lease) -> None: ...

    async def leases(self) -> list[Lease]:
        """Every bot's lease, held or expired."""
        ...

    def fenced(self, lease: Lease) -> Store: ...


class BoundStore:
    """The part of a :class:`Store` a channel may use, bound to one bot.

    Implements :class:`dshim.channels.base.ChannelStore`.
    """

    __slots__ = ("_store", "_bot")

    def __init__(self, store: Store, bot: str) -> None:
        self._store = store
        self._bot = bot

    async def get_cursor(self, name: str) -> str | None:
        return await self._store.get_cursor(self._bot, name)

    async def set_cursor(self, name: str, value: str) -> None:
        await self._store.set_cursor(self._bot, name, value)

    async def last_direct(self) -> str | None:
        return await self._store.get_last_direct(self._bot)

    async def outbound(self, conversation_id: str, *, now: float) -> list[OutboundEntry]:
        return await self._store.list_outbound(self._bot, conversation_id, now=now)

    async def record_outbound(
        self, conversation_id: str, entry: OutboundEntry, *, now: float
    ) -> None:
        await self._store.add_outbound(self._bot, conversation_id, entry, now=now)

    async def indexed(
        self, conversation_id: str, message_id: str, *, now: float
    ) -> list[OutboundEntry]:
        return [
            e
            for e in await self._store.list_outbound(self._bot, conversation_id, now=now)
            if message_id in e.message_ids
        ]

    async def update_outbound(
        self,
        conversation_id: str,
        message_id: str,
        *,
        now: float,
        text: str | None = None,
        completed_at: float | None = None,
        add_ids: Sequence[str] = (),
        state: str | None = None,
    ) -> bool:
        return await self._store.update_outbound(
            self._bot,
            conversation_id,
            message_id,
            now=now,
            text=text,
            completed_at=completed_at,
            add_ids=add_ids,
            state=state,
        )

    async def log_message(
        self, conversation_id: str, message: LoggedMessage, *, now: float
    ) -> bool:
        return await self._store.log_message(self._bot, conversation_id, message, now=now)

    async def message_log(self, conversation_id: str, *, limit: int) -> list[LoggedMessage]:
        return await self._store.message_log(self._bot, conversation_id, limit=limit)

    async def logged_message(self, conversation_id: str, message_id: str) -> LoggedMessage | None:
        return await self._store.logged_message(self._bot, conversation_id, message_id)
