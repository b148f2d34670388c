"""The channel contract: what a platform channel is, and what it may use of dshim.

A channel is one object, ``CHANNEL`` at the end of ``dshim/channels/<key>/channel.py``,
that satisfies :class:`Channel` — usually a :class:`ChannelSpec` naming the channel's
functions.  dshim finds it with
:func:`dshim.channels.load_channel`.  Everything a channel may touch of the rest of
the process comes through the objects it is handed: a :class:`BotHost` in ``run``, a
:class:`ProbeRows` in ``probe``, a :class:`ReplaySource` in ``replay_adapter``.  A
channel package imports only this module, :mod:`dshim.channels.kit`, :mod:`dshim.model`,
:mod:`dshim.errors`, :mod:`dshim.render` and its own modules — never ``serve``,
``probe``, ``replay``, the pipeline or a harness (a test checks ``sys.modules``).

Rules every channel follows
---------------------------
1. **Settings.**  ``Channel.settings`` is a :class:`msgspec.Struct` naming the channel's
   own keys of a ``[[bots]]`` table (credentials, ``api_base`` and other URL overrides,
   switches).  It is validated when the configuration loads, so a missing or badly
   shaped credential is a configuration error naming the key path (exit 2), never a bot
   that starts and dies.  A check that needs code (a token's shape) lives in the
   struct's ``__post_init__`` and raises ``ValueError("<key>: <what is wrong>")``;
   the loader turns that into ``bots[i].<key>: <what is wrong>``.  Read the settings
   with ``host.settings_as(MySettings)``.
2. **Started means authenticated.**  ``run`` calls ``task_status.started()`` only after
   the platform's identity call succeeded (Telegram ``getMe``, Discord
   ``GET /users/@me``) and the pipeline is open — not at the first websocket READY.
   A channel with no platform behind it (the web chat) starts once its mounts are in
   place and the pipeline is open.
3. **What escapes ``run``.**  Only :class:`~dshim.errors.AuthError`,
   :class:`~dshim.errors.FatalChannelError` and :class:`~dshim.errors.ConfigError`
   (and cancellation).  Transient failures — network, timeouts, 5xx, 429, a dropped
   socket, an undecodable answer — stay inside ``run``: it backs off
   (:class:`dshim.backoff.Backoff`) and tries again, also before it has started.
   Anything else that escapes is a bug; the supervisor logs it and restarts the bot
   with a growing backoff.
4. **Receiving.**  Each platform event is mapped by pure code in ``protocol.py`` to an
   :class:`~dshim.model.InboundMessage` or a :class:`~dshim.model.Skip`, and handed in
   platform order to :meth:`Inbound.accept` with the event's raw bytes (the durable
   inbox keeps them and decodes them again after a restart with ``decode_raw``).
   Confirm the event to the platform (offset, ack) only once ``accept`` returned and
   its :class:`~dshim.model.Verdict` says ``confirm``; a ``"shutdown"`` verdict is left
   unconfirmed so the platform delivers it again.  One bad event is a ``malformed``
   Skip, never an exception: decode per event, with depth and size bounded.
5. **Quotes and forwards.**  In a :class:`~dshim.model.ReplyReference`, a field the
   platform said nothing about is ``msgspec.UNSET`` (the model's meaning); ``None`` is not
   used for "absent".  A loaded reference overrides only the fields it sets.  A forwarded
   message (the platform's forward marker) is not a quote: its text is the message's
   ``content``, its sender the person who forwarded it, and ``forwarded=True`` — the
   pipeline then never takes it as a command, a /batch word or an answer.  Ids of a known
   shape (Discord snowflakes) are validated before they are used in a lookup.
6. **Sending.**  The channel's :class:`Outbound` delivers text and streams; every
   delivered message comes back as a :class:`~dshim.model.Delivered` with its platform
   id, which the pipeline records in the message index.  A send whose outcome is
   unknown is never repeated in a loop: use the platform's idempotency key where it
   has one.
7. **Secrets.**  Credentials from the settings are registered with the log redactor
   when the configuration loads; a secret learned at runtime (a minted access token)
   is registered with ``host.register_secret`` before it is used.
8. **Replay.**  ``replay_adapter`` decodes fixture events with the same mapping code;
   an unusable fixture raises :class:`FixtureError` (one failed fixture, the others run).
9. **Probe.**  ``probe`` checks the platform the same way everywhere through
   :meth:`ProbeRows.standard`: credentials, the identity call, channel checks (the
   transport reaching ready), the store, and ``--send-test`` to the last direct
   conversation (a ``warn`` when there is none yet).
10. **Login (optional).**  A channel whose credentials come from an interactive step (a
   QR scan) offers it as ``ChannelSpec.login_fn`` (:func:`login_hook`); ``dshim login
   BOT`` runs it with a :class:`LoginContext`.  It saves what it learns in the data
   directory (file 0600, directory 0700), where ``run`` and ``probe`` find it again
   through :func:`data_dir_of` (the optional ``data_dir`` of the host).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, runtime_checkable

import msgspec
import trio

from dshim.config import BotConfig, ChannelSettings, Secret, SubstituteTarget, settings_of
from dshim.errors import DshimError
from dshim.http.types import (
    HttpHandler,
    HttpRequest,
    HttpResponse,
    WebSocket,
    WebSocketClosed,
    WebSocketHandler,
)
from dshim.model import Delivered, InboundMessage, ReplyTarget, Skip, Verdict
from dshim.outbound import (
    CONTROL_ACTIONS,
    ControlNotice,
    FindsDirectTargets,
    InteractionPrompt,
    Outbound,
    PresentsControlNotices,
    PresentsInteractions,
    ReplyStream,
    WatchesDelivery,
    WatchesStop,
)
from dshim.store.base import LoggedMessage, OutboundEntry, Relayed

if TYPE_CHECKING:
    import httpx

__all__ = [
    "AcceptsMany",
    "CONTROL_ACTIONS",
    "Collected",
    "Collecting",
    "ControlNotice",
    "BotConfig",
    "SubstituteTarget",
    "BotHost",
    "Channel",
    "ChannelSettings",
    "ChannelSpec",
    "ChannelStore",
    "Check",
    "ExpandsEvents",
    "FindsDirectTargets",
    "FixtureError",
    "HasDataDir",
    "HasLoginFn",
    "HasRelay",
    "HasRelayFn",
    "HasLoginPhone",
    "Identity",
    "Inbound",
    "InteractionPrompt",
    "LoggedMessage",
    "LoginContext",
    "LoginFn",
    "Relay",
    "RelayFn",
    "Relayed",
    "LogsIn",
    "Outbound",
    "OutboundEntry",
    "PresentsControlNotices",
    "PresentsInteractions",
    "ProbeResult",
    "ProbeRows",
    "RawDecoder",
    "ReceivesEvents",
    "ReplayAdapter",
    "ReplaySource",
    "ReplyStream",
    "RetractOutcome",
    "Secret",
    "Verdict",
    "WatchesDelivery",
    "WatchesStop",
    "HttpHandler",
    "HttpRequest",
    "HttpResponse",
    "WebSocket",
    "WebSocketClosed",
    "WebSocketHandler",
    "data_dir_of",
    "login_hook",
    "relay_hook",
    "relay_of",
    "settings_of",
    "login_phone_of",
]

S = TypeVar("S", bound=msgspec.Struct)

#: Decodes an event's raw bytes as stored in the durable inbox (after a restart).
RawDecoder = Callable[[bytes], "InboundMessage | Skip"]
ProbeResult = Literal["ok", "warn", "fail"]
#: What :meth:`Inbound.retract` did with a withdrawn message.
RetractOutcome = Literal["dropped", "stopped", "none"]


class FixtureError(DshimError):
    """A replay fixture cannot be used (missing bot identity, wrong shape...)."""


# --- what a running bot gets -----------------------------------------------------------------


class ChannelStore(Protocol):
    """The part of the store a channel may use, bound to its bot."""

    async def get_cursor(self, name: str) -> str | None:
        """A transport cursor (offset, sequence number, session id) saved by this bot."""
        ...

    async def set_cursor(self, name: str, value: str) -> None: ...

    async def last_direct(self) -> str | None:
        """The conversation id of the last direct chat that reached a turn (probe)."""
        ...

    async def outbound(self, conversation_id: str, *, now: float) -> list[OutboundEntry]:
        """The message index of a conversation, newest first: the bot's delivered messages
        and the user messages the channel recorded (``inbound``).  At most 200 entries per
        conversation, none completed more than 30 days ago, text cut to 8,000 code points."""
        ...

    async def record_outbound(
        self, conversation_id: str, entry: OutboundEntry, *, now: float
    ) -> None:
        """Add an entry: a message the channel delivered on its own (not through the
        pipeline), or an accepted user message (``inbound=True``, see
        :func:`dshim.channels.kit.index.inbound_entry`) on platforms whose quotes carry only
        an id."""
        ...

    async def indexed(
        self, conversation_id: str, message_id: str, *, now: float
    ) -> list[OutboundEntry]:
        """The index entries of a conversation that carry ``message_id``, newest first."""
        ...

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
        """Change the newest entry carrying ``message_id``: its final text and completion
        time (a streamed card finished), further ids it is known by, its ``state``
        (``deleted`` after a recall, ``undelivered`` after a failed-delivery report).  False
        when the index has no such entry."""
        ...

    async def log_message(
        self, conversation_id: str, message: LoggedMessage, *, now: float
    ) -> bool:
        """Add a message to the conversation's own message log (both directions), for
        platforms without a fetch-by-id API; False, writing nothing, when its id is already
        logged.  Bounded per conversation (the newest 500)."""
        ...

    async def message_log(self, conversation_id: str, *, limit: int) -> list[LoggedMessage]:
        """The newest ``limit`` logged messages of a conversation, oldest first."""
        ...

    async def logged_message(self, conversation_id: str, message_id: str) -> LoggedMessage | None:
        """One logged message of this conversation (None: unknown here)."""
        ...


class Inbound(Protocol):
    """The pipeline's receiving side (steps 1-6), as a channel's reader sees it."""

    async def accept(self, item: InboundMessage | Skip, raw: bytes | None = None) -> Verdict:
        """Run steps 1-6.  When it returns, the event is durable or deliberately dropped."""
        ...

    async def retract(self, conversation_id: str, message_id: str) -> RetractOutcome:
        """The platform withdrew a message (Feishu recall): drop it if it is still queued
        (``"dropped"``), stop its turn like ``/stop`` if it is running (``"stopped"``; the
        user is told once, by the stopped answer), else ``"none"``.  Never a new turn."""
        ...

    async def substitute_control(
        self,
        action: Literal["stop", "disable"],
        conversation_id: str,
        thread_id: str | None,
        user_id: str,
    ) -> str:
        """An operator pressed a button of a substitute control notice (see
        :class:`dshim.outbound.ControlNotice`): ``"stop"`` stops the answer running in
        that chat (like ``/stop`` there), ``"disable"`` turns substitute mode off there
        (like ``/substitute off``).  Returns the text to show the operator (a refusal for
        anyone who is not an operator)."""
        ...


@runtime_checkable
class AcceptsMany(Protocol):
    """An :class:`Inbound` that takes a batch of events at once (the runtime does): every
    key and inbox entry in one store transaction, then steps 5-6 in order; the verdicts
    in the events' order.  :func:`dshim.channels.kit.poll.accept_batch` uses it when
    there."""

    async def accept_many(
        self, events: Sequence[tuple[InboundMessage | Skip, bytes | None]]
    ) -> list[Verdict]: ...


class BotHost(Protocol):
    """What ``Channel.run`` may use of the process, and nothing more."""

    @property
    def bot(self) -> BotConfig:
        """The bot's common configuration (name, access, budgets ...)."""
        ...

    @property
    def store(self) -> ChannelStore: ...

    @property
    def clock(self) -> Callable[[], float]:
        """Wall-clock epoch seconds (virtual in tests and replay)."""
        ...

    def settings_as(self, kind: type[S]) -> S:
        """The channel's validated settings, checked to be a ``kind``."""
        ...

    def open_runtime(
        self,
        *,
        outbound: Outbound,
        bot_id: str,
        decode_raw: RawDecoder | None = None,
        substitute_targets: Sequence[SubstituteTarget] | None = None,
    ) -> AbstractAsyncContextManager[Inbound]:
        """Open the bot's pipeline (resuming accepted-but-unfinished messages).

        ``substitute_targets``: the configured substitute targets as the channel resolved
        them (an email or another id filled in with the id mentions carry); None: the
        configured ones."""
        ...

    async def serve(self, rt: Inbound, reader: Callable[[], Awaitable[None]]) -> None:
        """Run ``reader`` until shutdown, then let running answers finish (bounded).

        The reader returns or raises to end the bot; on shutdown it is cancelled.
        """
        ...

    def register_secret(self, secret: str) -> None:
        """Never log this value (a token minted at runtime)."""
        ...

    def capture_identity(self, info: Mapping[str, Any]) -> None:
        """Tell ``serve --capture`` more of the bot's identity than ``open_runtime`` did
        (its ``bot_id`` and the outbound's ``bot_username`` are reported already): the
        keys the channel's replay adapter reads from ``ReplaySource.bot_info`` (an app
        id, a robot code ...), never a credential.  A no-op when capture is off."""
        ...

    @property
    def capturing(self) -> bool:
        """Whether ``serve --capture`` records this bot (a channel does capture-only
        work, such as :meth:`capture_sent`, only then)."""
        ...

    def capture_sent(self, target: ReplyTarget, delivered: list[Delivered]) -> None:
        """Tell ``serve --capture`` of an answer the user sees that its stream's
        ``finish`` did not return (a DingTalk AI card, whose index entry the channel keeps
        itself), so the capture's ``expect`` holds its ``send`` lines as replay prints
        them.  A no-op when capture is off."""
        ...

    def mount(self, path: str, handler: HttpHandler, *, public: bool = False) -> None:
        """Serve HTTP requests at ``/hooks/<bot>/<path>`` on the local HTTP endpoint
        (platform webhooks; the web chat's page).  ``path`` is relative ("" for the bot's
        root); a later mount of the same path replaces the earlier one (a restarted bot).
        Raises ConfigError when the endpoint is disabled (``[http] enabled = false``).

        ``public=True``: the route is served without the endpoint's ``[http] token`` (a
        platform webhook that cannot send it and authenticates every request by its own
        signature, which the handler checks); its bodies are capped lower
        (``dshim.http.app.PUBLIC_MOUNT_MAX_BODY``, 413 above it).
        """
        ...

    def mount_websocket(self, path: str, handler: WebSocketHandler) -> None:
        """Serve websockets at ``/hooks/<bot>/<path>`` (the web chat), as :meth:`mount`.

        The endpoint serves the mounts of the web chat bot (the embedded default, channel
        ``webchat``) at the root too: ``/`` and ``/ws`` are its page and its socket.
        """
        ...


@runtime_checkable
class HasDataDir(Protocol):
    """A :class:`BotHost` or :class:`ProbeRows` with a data directory, where saved logins
    live (see :func:`data_dir_of`)."""

    @property
    def data_dir(self) -> Path | None: ...


class Relay(Protocol):
    """A bot's webhook relay in a store several instances share (PostgreSQL): the bodies
    an instance that does not run the bot received and verified, for the one that does.

    The endpoint of an instance that does not run the bot ``put``s (the channel's
    :data:`RelayFn` handler); the bot's runner reads ``pending`` in arrival order, takes
    each body as if it had arrived at its own webhook and, once its messages are accepted,
    marks it ``done`` (a fenced write); ``wait`` returns when another body was put (woken
    by the store's notifications; bound it with a timeout and read again).
    """

    async def put(self, body: bytes) -> None: ...

    async def pending(self, limit: int) -> list[Relayed]: ...

    async def done(self, seq: int) -> None: ...

    async def wait(self) -> None: ...


@runtime_checkable
class HasRelay(Protocol):
    """A :class:`BotHost` whose store relays webhooks between instances (see
    :func:`relay_of`)."""

    @property
    def relay(self) -> Relay | None: ...


def relay_of(host: object) -> Relay | None:
    """The bot's webhook relay (optional feature :class:`HasRelay`), or None: the store is
    not shared, webhooks arrive where the bot runs."""
    return host.relay if isinstance(host, HasRelay) else None


#: ``relay_fn(bot, relay)``: the handler an instance that does not run ``bot`` mounts at
#: the bot's webhook route (``/hooks/<bot>``, public): it verifies a request as the
#: channel's own handler does and ``put``s what the runner must take (a channel whose
#: events arrive by webhook names one, see ``ChannelSpec.relay_fn``).
RelayFn = Callable[[BotConfig, Relay], HttpHandler]


@runtime_checkable
class HasRelayFn(Protocol):
    """A :class:`Channel` that may relay its webhooks (:class:`ChannelSpec` does)."""

    @property
    def relay_fn(self) -> RelayFn | None: ...


def relay_hook(channel: object) -> RelayFn | None:
    """The channel's relay handler factory (``ChannelSpec.relay_fn``), or None."""
    hook: object = channel.relay_fn if isinstance(channel, HasRelayFn) else None
    return hook if callable(hook) else None


# --- replay -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplaySource:
    """What ``replay_adapter`` gets: the fixture's bot identity and a recording HTTP client.

    ``http`` answers from the fixture's recorded exchanges (paths relative to
    ``api_base``; anything else is 404) and records every request.  ``store`` is the
    replay bot's store (fresh per fixture, seeded with its ``outbound`` and ``history``)
    and ``clock`` the replay's virtual epoch clock, for channels whose lookups read the
    store (the web chat's message log); both are usable once the events run.
    """

    bot_id: str | None
    bot_username: str | None
    http: httpx.AsyncClient
    api_base: str
    store: ChannelStore | None = None
    clock: Callable[[], float] | None = None
    #: The fixture's whole ``bot`` table, for channels whose identity has more than an id
    #: and a username (Feishu: ``open_id``, ``app_id``, ``name``; Slack: ``user_id``,
    #: ``bot_id``, ``app_id``, ``team_id``; WhatsApp: ``phone_number_id``,
    #: ``display_phone_number``; DingTalk: ``robot_code``, ``chatbot_user_id``).
    bot_info: Mapping[str, Any] = field(default_factory=dict)


class ReplayAdapter(Protocol):
    """Decodes a channel's raw fixture events with the real mapping code.

    Optional features, each a protocol the adapter's class names among its bases (replay
    discovers them with ``isinstance``): :class:`ReceivesEvents`, :class:`ExpandsEvents`,
    :class:`Collecting`.
    """

    @property
    def bot_id(self) -> str: ...

    @property
    def bot_username(self) -> str | None: ...

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        """One event; never raises for bad input (a ``malformed`` Skip)."""
        ...

    def split(self, text: str) -> list[str]:
        """The chunks an answer of this length is delivered in."""
        ...


@runtime_checkable
class ReceivesEvents(Protocol):
    """A :class:`ReplayAdapter` of a channel that does something of its own with every event
    it receives (the web chat logs it): ``received(item, raw)`` is awaited right before
    each event is handed to the pipeline."""

    async def received(self, item: InboundMessage | Skip, raw: bytes) -> None: ...


@runtime_checkable
class ExpandsEvents(Protocol):
    """A :class:`ReplayAdapter` whose fixture events carry several events (a webhook body
    with several messages): ``expand(raw)`` cuts one apart, each then decoded on its own."""

    def expand(self, raw: bytes) -> list[bytes]: ...


#: An event ready for the pipeline: what it maps to, its raw form, and the index of the
#: fixture event it stands for (an album: its first part).
Collected = tuple[InboundMessage | Skip, bytes, int]


@runtime_checkable
class Collecting(Protocol):
    """A :class:`ReplayAdapter` whose channel holds events back before the pipeline sees
    them (Telegram's albums), with the collection code its reader runs in ``serve``.
    ``now`` is the fixture's timeline: epoch seconds, never decreasing."""

    def collect(self, raw: bytes, index: int, now: float) -> list[Collected]:
        """Take fixture event ``index``; the events ready now (possibly none)."""
        ...

    def collect_due(self) -> float | None:
        """When held events are next ready (None: nothing is held)."""
        ...

    def collect_ready(self, now: float) -> list[Collected]:
        """The held events ready at ``now``."""
        ...


# --- probe ----------------------------------------------------------------------------------------


class Identity(msgspec.Struct, frozen=True, kw_only=True):
    """Who the platform says the bot is."""

    name: str
    id: str
    #: Set when the identity is not what a bot should be (e.g. not a bot account).
    warning: str | None = None


@dataclass(frozen=True, slots=True)
class Check:
    """One channel-specific probe row: ``run`` returns (result, detail)."""

    name: str
    run: Callable[[], Awaitable[tuple[ProbeResult, str]]]
    timeout_s: float = 20.0


class ProbeRows(Protocol):
    """What ``Channel.probe`` gets: the bot, its store and the table being printed."""

    @property
    def bot(self) -> BotConfig: ...

    @property
    def send_test(self) -> bool:
        """``--send-test`` was given."""
        ...

    @property
    def store(self) -> ChannelStore:
        """The bot's store (read cursors; a probe must not move them)."""
        ...

    @property
    def http_listen(self) -> str | None:
        """The local HTTP endpoint's ``[http] listen`` address (None: ``enabled = false``),
        for channels whose webhooks a running ``dshim serve`` receives there."""
        ...

    def settings_as(self, kind: type[S]) -> S: ...

    def register_secret(self, secret: str) -> None: ...

    def add(self, check: str, result: ProbeResult, detail: str, ms: float = 0.0) -> None:
        """Add a row (the bot's name is prefixed; the detail is redacted)."""
        ...

    async def run(
        self,
        check: str,
        fn: Callable[[], Awaitable[tuple[ProbeResult, str]]],
        *,
        timeout_s: float = 20.0,
    ) -> ProbeResult:
        """Time one check; DshimError, OSError and a timeout become a ``fail`` row."""
        ...

    async def standard(
        self,
        *,
        credentials: str,
        identity: Callable[[], Awaitable[Identity]],
        checks: Sequence[Check] = (),
        send_test: Callable[[str], Awaitable[str]],
    ) -> None:
        """The probe every channel runs, in this order:

        ``credentials`` (ok, with this detail: the settings already validated them),
        ``identity`` (stops here when it fails), each of ``checks`` (a ``fail`` skips
        the rest of them and the send test), ``store`` (a cursor written and read
        back), and with ``--send-test`` ``send test``: ``send_test(conversation_id)``
        to the last direct conversation, returning the sent message's id — a ``warn``
        when there is no direct conversation yet.
        """
        ...


# --- the channel ----------------------------------------------------------------------------------


@runtime_checkable
class Channel(Protocol):
    """A platform channel.  See the module docstring for the rules."""

    @property
    def key(self) -> str:
        """The ``channel = "..."`` key."""
        ...

    @property
    def settings(self) -> type[msgspec.Struct]:
        """The channel's own ``[[bots]]`` keys, validated when the configuration loads."""
        ...

    async def run(
        self, host: BotHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Authenticate, open the pipeline, ``task_status.started()``, read until shutdown."""
        ...

    def replay_adapter(self, fx: ReplaySource) -> ReplayAdapter:
        """An adapter for ``"format": "raw"`` fixtures; FixtureError when unusable."""
        ...

    async def probe(self, rows: ProbeRows) -> None:
        """``dshim probe`` rows for one bot (see :meth:`ProbeRows.standard`)."""
        ...


RunFn = Callable[..., Awaitable[None]]


# --- login (optional) -----------------------------------------------------------------------


class LoginContext(Protocol):
    """What a channel's optional ``login`` hook gets from ``dshim login BOT``: the bot, the
    data directory (saved credentials live there, file 0600, directory 0700), and the
    terminal (``say`` prints a line; ``ask`` reads one)."""

    @property
    def bot(self) -> BotConfig: ...

    @property
    def data_dir(self) -> Path: ...

    def settings_as(self, kind: type[S]) -> S: ...

    def register_secret(self, secret: str) -> None: ...

    def say(self, text: str) -> None: ...

    async def ask(self, prompt: str) -> str: ...


@runtime_checkable
class HasLoginPhone(Protocol):
    """A :class:`LoginContext` with the number ``dshim login --phone`` gave (link by pair
    code instead of a QR code; see :func:`login_phone_of`)."""

    @property
    def phone(self) -> str | None: ...


def login_phone_of(ctx: object) -> str | None:
    """The ``--phone`` of a login (None: link by QR code)."""
    value = ctx.phone if isinstance(ctx, HasLoginPhone) else None
    return value if isinstance(value, str) and value.strip() else None


#: ``login(ctx)``: an interactive login (QR scan ...); returns the exit code.
LoginFn = Callable[[LoginContext], Awaitable[int]]


@runtime_checkable
class HasLoginFn(Protocol):
    """A :class:`Channel` that may name a login step (:class:`ChannelSpec` does)."""

    @property
    def login_fn(self) -> LoginFn | None: ...


@runtime_checkable
class LogsIn(Protocol):
    """A :class:`Channel` with a ``login`` method (a channel that is not a ChannelSpec)."""

    async def login(self, ctx: LoginContext) -> int: ...


def login_hook(channel: object) -> LoginFn | None:
    """The channel's optional login step (``ChannelSpec.login_fn``, :class:`HasLoginFn`, or
    a ``login`` method, :class:`LogsIn`), or None: the channel has no login step."""
    hook: object = channel.login_fn if isinstance(channel, HasLoginFn) else None
    if not hook and isinstance(channel, LogsIn):
        hook = channel.login
    return hook if callable(hook) else None


def data_dir_of(host: object) -> Path | None:
    """The data directory of a :class:`BotHost` or :class:`ProbeRows` (optional feature
    :class:`HasDataDir`: where saved logins live), or None when the host has none."""
    value = host.data_dir if isinstance(host, HasDataDir) else None
    return value if isinstance(value, Path) else None


@dataclass(frozen=True, slots=True)
class ChannelSpec(HasLoginFn, HasRelayFn):
    """A :class:`Channel` made of a channel module's functions.

    ``run(host, *, task_status)``, ``replay_adapter(source)`` and ``probe(rows)`` are the
    channel's own; tests make variants with :func:`dataclasses.replace` (e.g. ``run`` with
    shrunk timings bound by ``functools.partial``).
    """

    key: str
    settings: type[msgspec.Struct]
    run_fn: RunFn
    replay_fn: Callable[[ReplaySource], ReplayAdapter]
    probe_fn: Callable[[ProbeRows], Awaitable[None]]
    #: Optional interactive login (``dshim login BOT``), see :func:`login_hook`.
    login_fn: LoginFn | None = None
    #: Optional webhook relay handler (instances sharing the bots), see :func:`relay_hook`.
    relay_fn: RelayFn | None = None

    async def run(
        self, host: BotHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await self.run_fn(host, task_status=task_status)

    def replay_adapter(self, fx: ReplaySource) -> ReplayAdapter:
        return self.replay_fn(fx)

    async def probe(self, rows: ProbeRows) -> None:
        await self.probe_fn(rows)
