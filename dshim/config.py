"""dshim.toml: msgspec structs, environment substitution, errors that name the key path.

    [dshim]        data_dir, backlog_max_age_s
    [store]        url (PostgreSQL; also DSHIM_STORE_URL), password ("${ENV}"), lease_s,
                   transcript_keep, transcript_max_age_s
    [harness]      kind = "echo" | "openai" (base_url, api_key, model, system_prompt,
                   max_context_messages, vision) | "acp" (command, env, cwd, mode) |
                   "dsh" (base_url, token, workspace, agent_preset); interaction_timeout_s
    [[bots]]       name, channel, enabled, credentials ("${ENV}"), api_base, backlog_max_age_s,
                   max_file_bytes, files_ttl_s,
                   [bots.access] [bots.prompt] [bots.reply] [bots.lanes]

This module never imports a channel: what the parser needs of them -- the keys, each
channel's settings struct, a few of their traits -- is a :class:`ChannelCatalog` handed
in by the caller.  :mod:`dshim.channels.registry` builds it from the channel specs and
wraps :func:`parse_config`, :func:`load_config` and :func:`default_config` with it
(use those).

Every error is a :class:`~dshim.errors.ConfigError` whose message starts with
``<file>: <key path>:``, e.g. ``dshim.toml: bots[0].access.mode: expected "open" or
"allowlist", got "safe"``.  Values of secret fields are never echoed in errors and are held
in :class:`Secret`, whose ``repr`` is masked.
"""

from __future__ import annotations

import os
import re
import tomllib
import types
import typing
import urllib.parse
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec

from dshim.errors import ConfigError

SOURCE_FIELDS = (
    "channel",
    "conversationType",
    "senderId",
    "senderName",
    "conversationTitle",
    "threadId",
)
DEFAULT_MAX_FILE_BYTES = 20 * 1024 * 1024
DEFAULT_FILES_TTL_S = 7 * 86400.0
ENV_REF = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")


@dataclass(frozen=True)
class ChannelCatalog:
    """What the parser knows of channels, handed in by its caller (the registry)."""

    #: The known ``channel`` values, in the order error messages list them.
    keys: tuple[str, ...]
    #: A channel's settings struct, which validates its own keys of a ``[[bots]]`` table
    #: (may import the channel; a ConfigError when it cannot be had).
    settings_for: Callable[[str], type[msgspec.Struct]]
    #: Channels whose messages arrive only as webhooks: key -> the platform's name.
    webhook_only: Mapping[str, str] = field(default_factory=dict)
    #: Channels that resolve a substitute target's email to an id at start-up.
    resolves_email: frozenset[str] = frozenset()


class Secret:
    """A credential.  ``str()``/``repr()`` never show it; ``.get()`` does."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('***')"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __bool__(self) -> bool:
        return bool(self._value)


class _Base(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, omit_defaults=True):
    pass


class ChannelSettings(_Base):
    """Base of every channel's settings struct: unknown keys are errors, keyword-only."""


class DshimSection(_Base):
    #: The data directory (store, saved files, logins); ``~`` is expanded. Default:
    #: ``$XDG_STATE_HOME/dshim``, else ``~/.local/state/dshim``; ``--data-dir`` /
    #: ``DSHIM_DATA_DIR`` win.
    data_dir: str | None = None
    #: A message older than this when it arrives (after downtime) is dropped as stale, never
    #: run.
    backlog_max_age_s: float = 600.0
    #: How long accepted message ids are remembered, so a redelivery is dropped (48 h).
    dedup_ttl_s: float = 48 * 3600.0
    #: On SIGINT/SIGTERM, running answers get this long to finish before they are cut.
    shutdown_grace_s: float = 10.0
    #: Write every bot's traffic as replay fixtures under this directory (``~`` expanded;
    #: ``dshim serve --capture DIR`` wins); unset: no capture.  The files hold
    #: conversation text: see docs/operations.md, "Capture".
    capture_dir: str | None = None
    #: A capture file (one per bot, conversation and UTC day) past this many MB is
    #: continued in a new one (``<day>.2.json`` ...).
    capture_max_mb: float = 16.0
    #: All capture files together stay under this many MB: the oldest are removed first.
    capture_keep_mb: float = 1024.0

    def __post_init__(self) -> None:
        if not self.capture_max_mb > 0:
            raise ValueError(f"capture_max_mb: expected more than 0, got {self.capture_max_mb}")
        if not self.capture_keep_mb > 0:
            raise ValueError(f"capture_keep_mb: expected more than 0, got {self.capture_keep_mb}")


class StoreSection(_Base):
    """Where dshim keeps its state: SQLite in the data directory, or a shared PostgreSQL."""

    #: A PostgreSQL URL (``postgresql://user@host:5432/dshim``): the store lives in that
    #: database, which several instances can share; unset: SQLite in the data directory.
    #: ``DSHIM_STORE_URL`` wins.  A password only from the environment: the whole URL as
    #: ``"${DSHIM_STORE_URL}"``, or ``password``; never logged.
    url: str | None = None
    #: The database password when the URL has none (write ``"${ENV}"``).
    password: Secret | None = None
    #: How long an instance holds a bot of a shared store without renewing (seconds, 3-300).
    lease_s: float = 15.0
    #: Each session's transcript keeps its newest this many rows; the hourly sweep drops
    #: older ones (100-1,000,000; keep it at least ``[harness] max_context_messages`` and
    #: ``[bots.reply]`` pages x rows_per_page).
    transcript_keep: int = 1000
    #: Transcript rows older than this (seconds; 90 days) go once no binding names their
    #: session (after ``/new``); an open session keeps its newest ``transcript_keep``
    #: rows however old.
    transcript_max_age_s: float = 90 * 86400.0

    def __post_init__(self) -> None:
        if not STORE_TRANSCRIPT_KEEP_MIN <= self.transcript_keep <= STORE_TRANSCRIPT_KEEP_MAX:
            raise ValueError(
                f"transcript_keep: expected {STORE_TRANSCRIPT_KEEP_MIN:,} to "
                f"{STORE_TRANSCRIPT_KEEP_MAX:,} rows, got {self.transcript_keep}"
            )
        if not self.transcript_max_age_s >= 86400.0:
            raise ValueError(
                f"transcript_max_age_s: expected at least 86400 (a day), "
                f"got {self.transcript_max_age_s:g}"
            )
        if not STORE_LEASE_MIN_S <= self.lease_s <= STORE_LEASE_MAX_S:
            raise ValueError(
                f"lease_s: expected {STORE_LEASE_MIN_S:g} to {STORE_LEASE_MAX_S:g} seconds, "
                f"got {self.lease_s:g}"
            )
        if self.url is None:
            if self.password is not None:
                raise ValueError("password: only with url (the SQLite store has none)")
            return
        url, password = split_store_password(self.url)
        if password is not None:
            if self.password is not None:
                raise ValueError("url: has a password, and password is set as well: keep one")
            self.password = Secret(password)
        self.url = url


#: The bounds of ``[store] transcript_keep``.
STORE_TRANSCRIPT_KEEP_MIN = 100
STORE_TRANSCRIPT_KEEP_MAX = 1_000_000
#: The bounds of ``[store] lease_s``.
STORE_LEASE_MIN_S = 3.0
STORE_LEASE_MAX_S = 300.0
#: The environment variable that names the store's URL (wins over ``[store] url``).
STORE_URL_ENV = "DSHIM_STORE_URL"


def split_store_password(url: str) -> tuple[str, str | None]:
    """``(url without its password, the password)`` of a PostgreSQL URL; ValueError when it
    is not one.  The password may be in the user part or a ``password=`` parameter."""
    try:
        parts = urllib.parse.urlsplit(url.strip())
    except ValueError:
        raise ValueError("url: expected postgresql://user@host:port/database") from None
    if parts.scheme not in ("postgresql", "postgres") or not parts.netloc and not parts.query:
        raise ValueError(
            "url: expected postgresql://user@host:port/database"
            + (f", got a {parts.scheme}: URL" if parts.scheme else "")
        )
    password: str | None = None
    netloc = parts.netloc
    userinfo, at, hosts = netloc.rpartition("@")
    if at:
        user, colon, secret = userinfo.partition(":")
        if colon:
            password = urllib.parse.unquote(secret)
            netloc = f"{user}@{hosts}" if user else hosts
    # The other parameters stay exactly as written (libpq decodes %XX, never "+").
    kept: list[str] = []
    for item in parts.query.split("&") if parts.query else []:
        name, _, value = item.partition("=")
        if urllib.parse.unquote(name) != "password":
            kept.append(item)
            continue
        given = urllib.parse.unquote(value)
        if password is not None and given != password:
            raise ValueError("url: two different passwords")
        password = given
    rebuilt = urllib.parse.urlunsplit(
        (parts.scheme, netloc, parts.path, "&".join(kept), parts.fragment)
    )
    return rebuilt, password or None


def _has_password(url: str) -> bool:
    try:
        return split_store_password(url)[1] is not None
    except ValueError:
        return False


def _check_store_literals(raw: dict[str, Any], label: str) -> None:
    """A store password is never written in the file (only ``"${ENV}"``)."""
    store = raw.get("store")
    if not isinstance(store, dict):
        return
    url, password = store.get("url"), store.get("password")
    if isinstance(url, str) and not ENV_REF.match(url) and _has_password(url):
        raise ConfigError(
            f"{label}: store.url: a password is never written in the file: take the whole URL "
            f'from the environment (url = "${{{STORE_URL_ENV}}}", or set {STORE_URL_ENV}), '
            f'or write the URL without it and password = "${{ENV}}"'
        )
    if isinstance(password, str) and not ENV_REF.match(password):
        raise ConfigError(
            f'{label}: store.password: write "${{ENV}}" (the environment variable that holds '
            "it), never the password itself"
        )


class HttpSection(_Base):
    """The local HTTP endpoint: web chat, health, metrics, platform webhooks."""

    #: Serve the endpoint; false: none (a WhatsApp bot, which needs its webhook, then refuses
    #: to load).
    enabled: bool = True
    #: ``host:port`` (IPv6 as ``[::1]:8910``); anything but loopback needs ``token``.
    listen: str = "127.0.0.1:8910"
    #: Bearer token every route but /healthz requires (write ``"${DSHIM_HTTP_TOKEN}"``);
    #: required, at least :data:`HTTP_TOKEN_MIN` characters, off loopback and whenever
    #: ``public_host`` is set (behind a proxy the endpoint is public).
    token: Secret | None = None
    #: The name the endpoint is reached by besides its listen address (a reverse proxy's
    #: public host, ``chat.example.com`` or ``chat.example.com:8443``): requests naming
    #: another ``Host`` are refused (DNS rebinding), and pages served under this name may
    #: open the web chat's socket.
    public_host: str | None = None

    @property
    def host(self) -> str:
        return split_listen(self.listen)[0]

    @property
    def port(self) -> int:
        return split_listen(self.listen)[1]


def split_listen(listen: str) -> tuple[str, int]:
    """``host:port`` -> (host, port); ValueError when it is not one."""
    host, sep, port = listen.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535 or not host:
        raise ValueError(f"expected host:port, got {listen!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def is_loopback(host: str) -> bool:
    """True for 127.0.0.0/8, ::1 and localhost."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class HarnessConfig(_Base):
    #: The adapter: ``echo`` answers with the prompt it got, ``openai`` a Chat Completions
    #: server, ``acp`` an ACP agent process, ``dsh`` a DSH agent host.
    kind: Literal["echo", "openai", "acp", "dsh"] = "echo"
    # openai, dsh
    #: openai (required): the server, ``POST {base_url}/chat/completions``; dsh: the host
    #: (default ``http://127.0.0.1:3080``).
    base_url: str | None = None
    #: openai: sent as ``Authorization: Bearer``; optional for local servers.
    api_key: Secret | None = None
    #: openai (required): the default model; ``/model`` changes it per conversation.
    model: str | None = None
    #: openai: a system message sent first in every request.
    system_prompt: str | None = None
    #: openai: the newest transcript messages sent as context, the new one included.
    max_context_messages: int = 40
    #: openai: send images as ``image_url`` parts; false: a message with images is refused.
    vision: bool = False
    # acp
    #: acp (required): the agent's argv, e.g. ``["claude-agent-acp"]``.
    command: list[str] | None = None
    #: acp: variables added to dshim's environment for the agent process.
    env: dict[str, str] = msgspec.field(default_factory=dict)
    #: acp: the agent's working directory and session workspace (a bot's ``workspace`` wins;
    #: default: dshim's own).
    cwd: str | None = None
    #: The agent's mode (ACP config option of category "mode"), applied to every session.
    mode: str | None = None
    # dsh
    #: dsh: sent as ``Authorization: Bearer``; optional.
    token: Secret | None = None
    #: dsh: the workspace sessions are created in, registered when missing (a bot's
    #: ``workspace`` wins; else ``cwd``).
    workspace: str | None = None
    #: dsh: ``session.create``'s ``agentPreset``.
    agent_preset: str | None = None
    # shared
    #: Approvals and questions left unanswered this long are rejected, and the chat is told.
    interaction_timeout_s: float = 600.0


class AccessConfig(_Base):
    #: ``open``: everyone; ``allowlist``: only ``users``, in direct chats (groups are denied).
    mode: Literal["open", "allowlist"] = "open"
    #: The platform user ids ``allowlist`` admits.
    users: list[str | int] = msgspec.field(default_factory=list)
    #: Users who may run operator commands (``/substitute on|off``) and get the
    #: substitute control notice.  Empty: nobody.
    operators: list[str | int] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        self.users = [str(u).strip() for u in self.users]
        self.operators = [str(u).strip() for u in self.operators]

    def allows(self, user_id: str) -> bool:
        return user_id in self.users

    def operates(self, user_id: str) -> bool:
        return user_id in self.operators


#: The id kinds a substitute target may carry, in the order a prompt names the target.
TARGET_ID_KINDS = ("open_id", "id", "user_id", "union_id", "username")


class SubstituteTarget(_Base):
    """A person the bot stands in for: the ids its channel knows them by."""

    #: The person's name, as the prompt names them (never matched).
    name: str | None = None
    #: The platform user id (Slack ``U…``, Discord snowflake, Telegram numeric id).
    id: str | int | None = None
    #: Telegram: the username, without ``@``, any case.
    username: str | None = None
    #: Feishu: the user's open_id for this app.
    open_id: str | None = None
    #: Feishu: the user_id.
    user_id: str | None = None
    #: Feishu: the union_id (resolved to an open_id at start).
    union_id: str | None = None
    #: Feishu: resolved to an open_id at start; elsewhere never matched.
    email: str | None = None

    def __post_init__(self) -> None:
        for key in ("name", "username", "open_id", "user_id", "union_id", "email"):
            value = getattr(self, key)
            if isinstance(value, str):
                value = value.strip()
                setattr(self, key, value or None)
        if isinstance(self.id, int):
            self.id = str(self.id)
        elif isinstance(self.id, str):
            self.id = self.id.strip() or None
        if self.username is not None:
            self.username = self.username.lstrip("@") or None

    def ids(self) -> dict[str, str]:
        """The ids that can match a mention at run time (never the email or the name)."""
        out: dict[str, str] = {}
        for kind in TARGET_ID_KINDS:
            value = getattr(self, kind)
            if isinstance(value, str) and value:
                out[kind] = value
        return out

    def prompt_id(self) -> str:
        """The id a prompt names the target by: open_id, else the platform id, else
        user_id/union_id, else ``@username``."""
        for kind in TARGET_ID_KINDS:
            value = getattr(self, kind)
            if isinstance(value, str) and value:
                return "@" + value if kind == "username" else value
        return self.email or ""


class SubstituteConfig(_Base):
    """``[bots.substitute]``: answer group messages that mention a target person."""

    #: Answer group messages that mention a target (needs ``[bots.access] mode = "open"``).
    enabled: bool = False
    #: The people the bot stands in for.
    targets: list[SubstituteTarget] = msgspec.field(default_factory=list)
    #: Group ids where substitute mode works; empty: every group.
    chats: list[str | int] = msgspec.field(default_factory=list)
    #: ``thread``: answer in the trigger's thread; ``quote``: quote it in the main flow.
    reply_mode: Literal["thread", "quote"] = "thread"
    #: ``prefix``: the agent is told to say it answers on the person's behalf; ``none``: it is
    #: not.
    disclosure: Literal["prefix", "none"] = "prefix"
    #: Also in threads and forum topics.
    topic_groups: bool = True
    #: Send the operators a direct message when a substitute turn opens a session.
    control_notice: bool = True
    #: Stream substitute answers in the main chat too; false: one finished message.
    stream: bool = False

    def __post_init__(self) -> None:
        self.chats = list(dict.fromkeys(str(c).strip() for c in self.chats if str(c).strip()))


class PromptConfig(_Base):
    #: Start each prompt with the ``<dsh_im_source>`` block.
    source_block: bool = True
    #: The keys of the source block: ``channel``, ``conversationType``, ``senderId``,
    #: ``senderName``, ``conversationTitle``, ``threadId``.
    source_fields: list[
        Literal[
            "channel", "conversationType", "senderId", "senderName", "conversationTitle", "threadId"
        ]
    ] = msgspec.field(
        default_factory=lambda: ["channel", "conversationType", "senderId", "senderName"]
    )


class ReplyBudget(_Base):
    """Budgets for resolving a quoted message (platform lookup and history recovery)."""

    #: One deadline for looking up a quoted message (platform lookup or history recovery).
    deadline_s: float = 5.0
    #: Session-history recovery reads at most this many pages ...
    pages: int = 3
    #: ... of this many rows.
    rows_per_page: int = 100
    #: A recovered answer must be within this many seconds of the quoted message's time.
    window_s: float = 15.0


class LanesConfig(_Base):
    #: Messages a conversation queues behind a turn that has run for a second or more; more get
    #: a "busy" reply.
    max_queue: int = 8
    #: An idle conversation's lane is released (and an ACP session that can resume is closed)
    #: after this long.
    idle_exit_s: float = 600.0


class BotConfig(_Base):
    """One bot: the keys every channel shares.  The channel's own keys (credentials,
    ``api_base`` ...) are validated by its settings struct into :attr:`settings`."""

    #: The bot's name: 1-64 letters, digits, ``_``, ``-`` or ``.``, unique (log records,
    #: ``--bot``, ``/hooks/<name>``).
    name: str
    #: The platform: one of the channel sections below.
    channel: str
    #: false: ``serve`` does not run this bot.
    enabled: bool = True
    #: false: leave this bot out of a capture (``[dshim] capture_dir`` / ``--capture``).
    capture: bool = True
    #: This bot's ``[dshim] backlog_max_age_s`` (default: that one).
    backlog_max_age_s: float | None = None
    #: A current attachment that is not an image is saved for the agent up to this size.
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    #: Saved attachments are removed this long after they were saved.
    files_ttl_s: float = DEFAULT_FILES_TTL_S
    #: The agent workspace of this bot's sessions (overrides ``[harness] cwd`` /
    #: ``workspace``).
    workspace: str | None = None
    #: Who may use the bot.
    access: AccessConfig = msgspec.field(default_factory=AccessConfig)
    #: What the prompt tells the agent about the message's source.
    prompt: PromptConfig = msgspec.field(default_factory=PromptConfig)
    #: Budgets for resolving quoted messages.
    reply: ReplyBudget = msgspec.field(default_factory=ReplyBudget)
    #: The per-conversation queues.
    lanes: LanesConfig = msgspec.field(default_factory=LanesConfig)
    #: Substitute mode: answer group messages that mention a person.
    substitute: SubstituteConfig = msgspec.field(default_factory=SubstituteConfig)
    #: The channel's settings (``Channel.settings``); None when loaded without them.
    settings: msgspec.Struct | None = None

    def secrets(self) -> list[str]:
        """Every secret value of this bot (for log redaction)."""
        out: list[str] = []
        _collect_secrets(self, out)
        return [s for s in out if s]


S = typing.TypeVar("S", bound=msgspec.Struct)


def settings_of(bot: BotConfig, kind: type[S]) -> S:
    """A bot's channel settings, checked to be ``kind`` (they are validated at load)."""
    settings = bot.settings
    if not isinstance(settings, kind):
        raise ConfigError(
            f"bots.{bot.name}: the {bot.channel} settings were not loaded with the configuration"
        )
    return settings


#: The keys of a ``[[bots]]`` table that are not the channel's own.
COMMON_BOT_KEYS = frozenset(BotConfig.__struct_fields__) - {"settings"}


class Config(_Base):
    dshim: DshimSection = msgspec.field(default_factory=DshimSection)
    http: HttpSection = msgspec.field(default_factory=HttpSection)
    store: StoreSection = msgspec.field(default_factory=StoreSection)
    harness: HarnessConfig = msgspec.field(default_factory=HarnessConfig)
    bots: list[BotConfig] = msgspec.field(default_factory=list)

    def secrets(self) -> list[str]:
        """Every secret value in the configuration (for log redaction)."""
        out: list[str] = []
        _collect_secrets(self, out)
        return [s for s in out if s]

    def bot(self, name: str) -> BotConfig:
        for bot in self.bots:
            if bot.name == name:
                return bot
        raise ConfigError(f"no bot named {name!r} in the configuration")


def backlog_max_age(config: Config, bot: BotConfig) -> float:
    return (
        bot.backlog_max_age_s
        if bot.backlog_max_age_s is not None
        else config.dshim.backlog_max_age_s
    )


def _collect_secrets(obj: Any, out: list[str]) -> None:
    if isinstance(obj, Secret):
        out.append(obj.get())
    elif isinstance(obj, msgspec.Struct):
        for name in obj.__struct_fields__:
            _collect_secrets(getattr(obj, name), out)
    elif isinstance(obj, list):
        for item in obj:
            _collect_secrets(item, out)
    elif isinstance(obj, dict):
        for item in obj.values():
            _collect_secrets(item, out)


# --- loading --------------------------------------------------------------------------------


def load_config(
    path: str | os.PathLike[str],
    env: typing.Mapping[str, str] | None = None,
    *,
    channels: ChannelCatalog,
) -> Config:
    """Read, substitute and validate a config file.  Raises ConfigError."""
    p = Path(path)
    label = p.name
    try:
        text = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(
            f"{p}: config file not found. Write a commented starter file with "
            f"`dshim init {p}` (see docs/configuration.md), or pass another "
            f"--config PATH / DSHIM_CONFIG. A minimal file:\n\n"
            f'[harness]\nkind = "echo"\n\n[[bots]]\nname = "mybot"\nchannel = "telegram"\n'
            f'token = "${{TELEGRAM_BOT_TOKEN}}"\n'
        ) from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config file: {exc.strerror}") from None
    try:
        raw = tomllib.loads(text.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError(f"{label}: not valid UTF-8") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{label}: invalid TOML: {exc}") from None
    env = os.environ if env is None else env
    return apply_store_env(parse_config(raw, label=label, env=env, channels=channels), env)


def parse_config(
    raw: dict[str, Any],
    *,
    label: str = "dshim.toml",
    env: typing.Mapping[str, str],
    channels: ChannelCatalog,
    channel_settings: bool = True,
) -> Config:
    """Validate an already parsed TOML document.

    Each ``[[bots]]`` table is split into the common keys (:class:`BotConfig`) and the
    channel's own keys, which the struct ``channels.settings_for`` names validates (the
    registry imports the channel module for that).  ``channel_settings=False`` skips the channel's keys
    (replay fixtures and tests of the pipeline alone): ``settings`` stays None.
    """
    _check_store_literals(raw, label)
    substituted = _substitute(raw, env, label, ())
    rests: list[dict[str, Any]] = []
    if isinstance(substituted, dict) and isinstance(substituted.get("bots"), list):
        commons: list[Any] = []
        for item in substituted["bots"]:
            if isinstance(item, dict):
                commons.append({k: v for k, v in item.items() if k in COMMON_BOT_KEYS})
                rests.append({k: v for k, v in item.items() if k not in COMMON_BOT_KEYS})
            else:
                commons.append(item)
                rests.append({})
        substituted = {**substituted, "bots": commons}
    try:
        config = msgspec.convert(substituted, Config, dec_hook=_dec_hook, str_keys=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(str(exc), substituted, label)) from None
    _check_semantics(config, label, channels)
    if channel_settings:
        for i, bot in enumerate(config.bots):
            bot.settings = _channel_settings(bot, rests[i], label, i, channels)
    return config


def _channel_settings(
    bot: BotConfig, keys: dict[str, Any], label: str, index: int, channels: ChannelCatalog
) -> msgspec.Struct:
    where: tuple[str | int, ...] = ("bots", index)
    try:
        settings = channels.settings_for(bot.channel)
    except ConfigError as exc:
        raise ConfigError(f"{label}: {_fmt_path((*where, 'channel'))}: {exc}") from None
    try:
        return msgspec.convert(keys, settings, dec_hook=_dec_hook, str_keys=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_explain(str(exc), keys, label, root=settings, prefix=where)) from None


def _substitute(
    node: Any, env: typing.Mapping[str, str], label: str, path: tuple[str | int, ...]
) -> Any:
    if isinstance(node, dict):
        return {k: _substitute(v, env, label, (*path, k)) for k, v in node.items()}
    if isinstance(node, list):
        return [_substitute(v, env, label, (*path, i)) for i, v in enumerate(node)]
    if isinstance(node, str):
        m = ENV_REF.match(node)
        if m:
            name = m.group(1)
            value = env.get(name)
            if value is None or value == "":
                raise ConfigError(
                    f"{label}: {_fmt_path(path)}: environment variable {name} is not set"
                )
            return value
    return node


def _dec_hook(tp: type, obj: Any) -> Any:
    if tp is Secret:
        if isinstance(obj, str):
            return Secret(obj)
        raise TypeError("Expected `str`")  # msgspec adds the key path to TypeErrors
    raise NotImplementedError


def _fmt_path(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out or "(top level)"


_PATH_RE = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_SEG_RE = re.compile(r"\.([^.\[]+)|\[(\d+)\]|\[\"?([^\]]*?)\"?\]")


def _parse_msgspec_path(s: str) -> tuple[str | int, ...]:
    parts: list[str | int] = []
    for m in _SEG_RE.finditer(s):
        if m.group(1) is not None:
            parts.append(m.group(1))
        elif m.group(2) is not None:
            parts.append(int(m.group(2)))
        else:
            parts.append(m.group(3))
    return tuple(parts)


def _lookup(doc: Any, path: tuple[str | int, ...]) -> Any:
    node = doc
    for part in path:
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return node


_MISSING = object()


def _field_type(path: tuple[str | int, ...], root: Any) -> Any:
    """The annotated type at a key path of ``root``, or None when unknown."""
    tp: Any = root
    for part in path:
        tp = _strip_optional(tp)
        if isinstance(part, int):
            args = typing.get_args(tp)
            if typing.get_origin(tp) in (list, tuple) and args:
                tp = args[0]
            else:
                return None
        elif isinstance(tp, type) and issubclass(tp, msgspec.Struct):
            hints = typing.get_type_hints(tp)
            if part not in hints:
                return None
            tp = hints[part]
        elif typing.get_origin(tp) is dict:
            tp = typing.get_args(tp)[1]
        else:
            return None
    return tp


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def _describe_type(tp: Any) -> str:
    tp = _strip_optional(tp)
    origin = typing.get_origin(tp)
    if origin is Literal:
        values = [f'"{v}"' if isinstance(v, str) else repr(v) for v in typing.get_args(tp)]
        if len(values) == 1:
            return values[0]
        return ", ".join(values[:-1]) + " or " + values[-1]
    if tp is Secret or tp is str:
        return "a string"
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if origin is list:
        return "an array"
    if origin is dict or (isinstance(tp, type) and issubclass(tp, msgspec.Struct)):
        return "a table"
    return "a different value"


def _describe_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        shown = value if len(value) <= 60 else value[:57] + "..."
        return '"' + shown.replace('"', '\\"') + '"'
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


_FIELD_MESSAGE = re.compile(r"^(?P<key>[A-Za-z_][A-Za-z0-9_]*): (?P<text>.+)$", re.DOTALL)


def _explain(
    message: str,
    doc: Any,
    label: str,
    *,
    root: Any = None,
    prefix: tuple[str | int, ...] = (),
) -> str:
    """A msgspec validation message as ``<label>: <key path>: <what is wrong>``.

    ``root`` is the struct type ``doc`` was validated against (default :class:`Config`);
    ``prefix`` is where ``doc`` sits in the whole file.
    """
    root = Config if root is None else root
    m = _PATH_RE.search(message)
    path: tuple[str | int, ...] = _parse_msgspec_path(m.group("path")) if m else ()
    head = message[: m.start()] if m else message
    full = (*prefix, *path)
    unknown = re.match(r"Object contains unknown field `(.+)`", head)
    if unknown:
        key = unknown.group(1)
        return f"{label}: {_fmt_path((*full, key))}: unknown key"
    missing = re.match(r"Object missing required field `(.+)`", head)
    if missing:
        key = missing.group(1)
        return f"{label}: {_fmt_path((*full, key))}: required key is missing"
    tp = _field_type(path, root)
    named = _FIELD_MESSAGE.match(head)
    if named and _is_struct(tp) and named.group("key") in tp.__struct_fields__:
        # A __post_init__ check: "<key>: <what is wrong>" about a field of that struct.
        return f"{label}: {_fmt_path((*full, named.group('key')))}: {named.group('text')}"
    value = _lookup(doc, path)
    secret = _strip_optional(tp) is Secret
    if tp is not None:
        expected = _describe_type(tp)
        if value is _MISSING or secret:
            got = "" if value is _MISSING else f", got {_kind_of(value)}"
        else:
            got = f", got {_describe_value(value)}"
        return f"{label}: {_fmt_path(full)}: expected {expected}{got}"
    return f"{label}: {_fmt_path(full)}: {head[:1].lower() + head[1:]}"


def _is_struct(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, msgspec.Struct)


def _kind_of(value: Any) -> str:
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return type(value).__name__


_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def _check_semantics(config: Config, label: str, channels: ChannelCatalog) -> None:
    seen: set[str] = set()
    for i, bot in enumerate(config.bots):
        where = f"{label}: bots[{i}]"
        if not _NAME_RE.match(bot.name):
            raise ConfigError(
                f"{where}.name: expected 1-64 letters, digits, '_', '-' or '.', got {_describe_value(bot.name)}"
            )
        if bot.name in seen:
            raise ConfigError(f"{where}.name: duplicate bot name {_describe_value(bot.name)}")
        seen.add(bot.name)
        if bot.channel not in channels.keys:
            choices = ", ".join(f'"{c}"' for c in channels.keys)
            raise ConfigError(
                f"{where}.channel: expected one of {choices}, got {_describe_value(bot.channel)}"
            )
        if bot.lanes.max_queue < 1:
            raise ConfigError(
                f"{where}.lanes.max_queue: expected at least 1, got {bot.lanes.max_queue}"
            )
        if bot.max_file_bytes < 1:
            raise ConfigError(
                f"{where}.max_file_bytes: expected at least 1, got {_describe_value(bot.max_file_bytes)}"
            )
        if not 0 < bot.files_ttl_s < float("inf"):
            raise ConfigError(
                f"{where}.files_ttl_s: expected a positive number of seconds, got {bot.files_ttl_s!r}"
            )
        if bot.reply.pages < 0 or bot.reply.rows_per_page < 1:
            raise ConfigError(f"{where}.reply: pages must be >= 0 and rows_per_page >= 1")
        if bot.reply.deadline_s <= 0:
            raise ConfigError(
                f"{where}.reply.deadline_s: expected a positive number, got {bot.reply.deadline_s!r}"
            )
        for j, user in enumerate(bot.access.users):
            if not str(user).strip():
                raise ConfigError(f"{where}.access.users[{j}]: empty user id")
        for j, user in enumerate(bot.access.operators):
            if not str(user).strip():
                raise ConfigError(f"{where}.access.operators[{j}]: empty user id")
        _check_substitute(
            bot.substitute, bot.channel in channels.resolves_email, f"{where}.substitute"
        )
    h = config.harness
    if h.kind == "openai":
        if not h.base_url:
            raise ConfigError(f'{label}: harness.base_url: required when kind = "openai"')
        if not h.model:
            raise ConfigError(f'{label}: harness.model: required when kind = "openai"')
        if not h.base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"{label}: harness.base_url: expected an http:// or https:// URL, got {_describe_value(h.base_url)}"
            )
    if h.kind == "dsh" and h.base_url and not h.base_url.startswith(("http://", "https://")):
        raise ConfigError(
            f"{label}: harness.base_url: expected an http:// or https:// URL, got {_describe_value(h.base_url)}"
        )
    if h.kind == "acp" and not h.command:
        raise ConfigError(f'{label}: harness.command: required when kind = "acp"')
    if h.max_context_messages < 1:
        raise ConfigError(
            f"{label}: harness.max_context_messages: expected at least 1, got {h.max_context_messages}"
        )
    if h.interaction_timeout_s <= 0:
        raise ConfigError(
            f"{label}: harness.interaction_timeout_s: expected a positive number, got {h.interaction_timeout_s!r}"
        )
    if config.dshim.backlog_max_age_s <= 0:
        raise ConfigError(f"{label}: dshim.backlog_max_age_s: expected a positive number")
    _check_http(config.http, f"{label}: ")
    _check_webhook_bots(config, label, channels)


def _check_substitute(sub: SubstituteConfig, resolves_email: bool, where: str) -> None:
    for j, target in enumerate(sub.targets):
        if not target.ids() and not target.email:
            raise ConfigError(
                f"{where}.targets[{j}]: needs at least one of id, username, open_id, user_id,"
                " union_id or email"
            )
    # Feishu resolves an email to an open_id at start-up; elsewhere an email never matches.
    usable = [t for t in sub.targets if t.ids() or (resolves_email and t.email)]
    if sub.enabled and not usable:
        raise ConfigError(
            f"{where}.targets: enabled = true needs at least one target with an id a mention"
            " can match (id, username, open_id, user_id or union_id; an email alone never"
            " matches until it is resolved)"
        )


def _check_webhook_bots(config: Config, label: str, channels: ChannelCatalog) -> None:
    """A bot that receives only by webhook needs ``[http]``: without it, it would run
    and never receive a message."""
    if config.http.enabled:
        return
    for i, bot in enumerate(config.bots):
        platform = channels.webhook_only.get(bot.channel)
        if platform is not None and bot.enabled:
            raise ConfigError(
                f"{label}: http.enabled: is false, but bots[{i}] ({_describe_value(bot.name)}) "
                f"is a {platform} bot: {platform} delivers messages only by webhook, to "
                f"/hooks/{bot.name} on the local HTTP endpoint; set [http] enabled = true "
                "(or enabled = false on the bot)"
            )


#: The shortest ``[http] token`` accepted off loopback (characters).
HTTP_TOKEN_MIN = 16
_HOST_NAME = re.compile(
    r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.)*[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?\.?"
)


def _check_http(http: HttpSection, prefix: str) -> None:
    try:
        host, _ = split_listen(http.listen)
    except ValueError as exc:
        raise ConfigError(f"{prefix}http.listen: {exc}") from None
    if http.public_host is not None and not is_host_name(http.public_host):
        raise ConfigError(
            f"{prefix}http.public_host: expected a host name, optionally with a port "
            f"(chat.example.com, chat.example.com:8443, [2001:db8::1]), got "
            f"{_describe_value(http.public_host[:100])}"
        )
    # Reachable from elsewhere: off loopback, or on loopback behind a reverse proxy that
    # serves it under public_host (the proxy's requests come from 127.0.0.1).
    where = (
        f"http.listen is not a loopback address ({http.listen})"
        if not is_loopback(host)
        else "http.public_host is set (the endpoint is reached through a proxy)"
    )
    exposed = not is_loopback(host) or http.public_host is not None
    if http.enabled and exposed and not http.token:
        fix = "or listen on 127.0.0.1" if not is_loopback(host) else "or remove public_host"
        raise ConfigError(
            f'{prefix}http.token: required when {where}: set token = "${{DSHIM_HTTP_TOKEN}}", {fix}'
        )
    if http.enabled and exposed and http.token:
        # The token is all that guards an exposed endpoint: a short one is guessed.
        if len(http.token.get().strip()) < HTTP_TOKEN_MIN:
            raise ConfigError(
                f"{prefix}http.token: must be at least {HTTP_TOKEN_MIN} characters when "
                f"{where}; make one with "
                "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`"
            )


def is_host_name(value: str) -> bool:
    """``name``, ``name:port``, an IPv4 address or a bracketed IPv6 one (with a port or
    not): what a ``Host`` header may name."""
    import ipaddress

    if not value or len(value) > 260:
        return False
    name, port = value, ""
    if value.startswith("["):
        name, sep, rest = value[1:].partition("]")
        if not sep or (rest and not (rest[:1] == ":" and rest[1:].isdigit())):
            return False
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return False
        return True
    if value.count(":") == 1:
        name, _, port = value.partition(":")
        if not port.isdigit() or int(port) > 65535:
            return False
    return len(name) <= 253 and _HOST_NAME.fullmatch(name) is not None


def override_listen(config: Config, listen: str, *, origin: str) -> Config:
    """``config`` with ``[http] listen`` replaced (``serve --listen``, ``DSHIM_HTTP_LISTEN``).

    The same checks as in the file apply; errors start with ``origin``.
    """
    http = msgspec.structs.replace(config.http, listen=listen.strip())
    _check_http(http, f"{origin}: ")
    return msgspec.structs.replace(config, http=http)


#: The label of :func:`default_config` in error messages.
DEFAULT_CONFIG_LABEL = "the built-in default configuration"
#: The web chat bot of the built-in default configuration.
DEFAULT_BOT_NAME = "web"


def default_config(
    env: typing.Mapping[str, str] | None = None, *, channels: ChannelCatalog
) -> Config:
    """What ``dshim serve`` runs without a config file: the echo harness, one ``webchat``
    bot named ``web`` and the HTTP endpoint on 127.0.0.1:8910 (data in the default data
    directory)."""
    env = os.environ if env is None else env
    config = parse_config(
        {"bots": [{"name": DEFAULT_BOT_NAME, "channel": "webchat"}]},
        label=DEFAULT_CONFIG_LABEL,
        env=env,
        channels=channels,
    )
    return apply_store_env(config, env)


def apply_store_env(config: Config, env: typing.Mapping[str, str]) -> Config:
    """``config`` with ``[store] url`` replaced by ``DSHIM_STORE_URL`` when that is set
    (:func:`load_config` and :func:`default_config` apply it).  Its password, if it has one,
    is moved out into ``[store] password`` (a :class:`Secret`)."""
    url = env.get(STORE_URL_ENV)
    if not url:
        return config
    current = config.store
    try:
        config.store = StoreSection(
            url=url,
            password=None if _has_password(url) else current.password,
            lease_s=current.lease_s,
            transcript_keep=current.transcript_keep,
            transcript_max_age_s=current.transcript_max_age_s,
        )
    except ValueError as exc:
        raise ConfigError(f"{STORE_URL_ENV}: {str(exc).removeprefix('url: ')}") from None
    return config


def override_store_url(config: Config, url: str) -> Config:
    """``config`` with ``[store] url`` replaced (``dshim status --store URL``): as
    ``DSHIM_STORE_URL``, its password moved into ``[store] password``."""
    try:
        return apply_store_env(config, {STORE_URL_ENV: url})
    except ConfigError as exc:
        raise ConfigError(str(exc).replace(STORE_URL_ENV, "--store", 1)) from None


def store_section(config: Config | None) -> StoreSection:
    """The ``[store]`` section (``DSHIM_STORE_URL`` already applied by the parser); the
    default (SQLite) without a configuration."""
    return config.store if config is not None else StoreSection()


def default_data_dir(env: typing.Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    xdg = env.get("XDG_STATE_HOME")
    if xdg:
        return Path(xdg) / "dshim"
    return Path.home() / ".local" / "state" / "dshim"


def resolve_data_dir(config: Config | None, override: Path | None) -> Path:
    """--data-dir / DSHIM_DATA_DIR, else ``[dshim] data_dir``, else the XDG default."""
    if override is not None:
        return override
    if config is not None and config.dshim.data_dir:
        return Path(os.path.expanduser(config.dshim.data_dir))
    return default_data_dir()


def prepare_data_dir(path: Path, *, origin: str) -> None:
    """Create the data directory (mode 0700) or raise a ConfigError naming ``origin``.

    ``origin`` says where the path came from (``"dshim.toml: dshim.data_dir"``,
    ``"--data-dir / DSHIM_DATA_DIR"``, ``"the default data directory"``).
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except FileExistsError:
        raise ConfigError(f"{origin}: {path} exists and is not a directory") from None
    except NotADirectoryError:
        raise ConfigError(f"{origin}: {path}: a parent of it is a file, not a directory") from None
    except OSError as exc:
        raise ConfigError(f"{origin}: cannot create {path}: {exc.strerror or exc}") from None
    if not path.is_dir():
        raise ConfigError(f"{origin}: {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{origin}: {path} is not writable")


def data_dir_origin(config: Config | None, override: Path | None, label: str) -> str:
    """Where :func:`resolve_data_dir`'s answer came from, for error messages."""
    if override is not None:
        return "--data-dir / DSHIM_DATA_DIR"
    if config is not None and config.dshim.data_dir:
        return f"{label}: dshim.data_dir"
    return "the default data directory"


# --- dshim init ---------------------------------------------------------------------------------

#: The start of the commented starter file ``dshim init`` writes (the tables every
#: configuration has); :func:`dshim.channels.registry.starter_toml` adds the channels'
#: blocks.  Credentials are never written there: ``"${NAME}"`` reads them from the
#: environment.
STARTER_HEAD = """\
# dshim.toml, written by `dshim init`.  docs/configuration.md explains every key.
# Credentials are never written in this file: "${NAME}" reads the environment variable NAME.

[dshim]
# data_dir = "~/.local/state/dshim"   # default: $XDG_STATE_HOME/dshim, else ~/.local/state/dshim
backlog_max_age_s = 600               # messages older than this (after downtime) are never run
shutdown_grace_s = 10                 # SIGINT/SIGTERM: running answers get this long to finish

[http]                                # the local endpoint: web chat, /healthz /readyz /metrics, webhooks
enabled = true
listen = "127.0.0.1:8910"             # anything but a loopback address needs a token
# token = "${DSHIM_HTTP_TOKEN}"       # then every route but /healthz needs it (the page asks once)

[harness]
kind = "echo"                         # answers with exactly the prompt it received
interaction_timeout_s = 600           # approvals and questions unanswered this long are rejected

# An ACP agent instead: replace the [harness] table above with
# [harness]
# kind = "acp"
# command = ["gemini", "--acp"]       # or ["claude-agent-acp"], ["codex-acp"]
# env = { GEMINI_API_KEY = "${GEMINI_API_KEY}" }
# cwd = "/srv/agent-work"             # the agent's workspace
# mode = "default"                    # the agent mode that asks before tools (claude-agent-acp)

# A DSH agent host instead: replace the [harness] table with
# [harness]
# kind = "dsh"
# base_url = "http://127.0.0.1:3080"
# token = "${DSH_TOKEN}"              # optional
# workspace = "/srv/agent-work"

# An OpenAI-compatible Chat Completions server instead: replace the [harness] table with
# [harness]
# kind = "openai"
# base_url = "https://api.deepseek.com"
# api_key = "${DEEPSEEK_API_KEY}"     # optional for local servers (Ollama, llama.cpp, vLLM)
# model = "deepseek-chat"
"""


def write_starter(path: Path, text: str) -> None:
    """Write the starter file ``text`` to ``path``; ConfigError when it exists (never
    overwritten)."""
    try:
        with path.open("x", encoding="utf-8") as f:
            f.write(text)
    except FileExistsError:
        raise ConfigError(f"{path} already exists: not overwriting it") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot write it: {exc.strerror or exc}") from None
