"""The Telegram channel: a bot's nursery, its replay adapter and its probe checks.

``run`` authenticates (``getMe``, retried through network errors, 5xx and 429 before the
bot counts as started; 401 stops the bot for good), registers the
command menu, opens the pipeline, reports started, then long-polls with the kit's poll
loop (:mod:`dshim.channels.kit.poll`): :class:`UpdateSource` asks ``getUpdates`` from the
stored offset (cursor ``telegram.offset``) and maps each update with
:mod:`~dshim.channels.telegram.protocol`; the loop hands them to the pipeline in order
and moves and persists the offset only past what was accepted, so a crash never loses an
accepted update and never runs a handled one twice (the pipeline's dedup drops the
redelivery).  An album (several photos, one update each) is collected for about a second
and answered as one message.  Updates older than ``backlog_max_age_s`` are confirmed and dropped as
``stale`` by the pipeline.  Network errors, 5xx and 409 back off 1..30 s with jitter; the
loop never spins.  A webhook (which makes getUpdates answer 409) is asked about
(``getWebhookInfo``) at the first 409 of a run, not at every start: that logs why
polling is blocked.

Every bot of the process on one Bot API server shares one HTTP client
(:func:`~dshim.net.http.open_shared_http`): the token is in each call's path, so a
thousand bots need one connection pool, not a thousand (each held long poll still has
a connection of its own).
"""

from __future__ import annotations

import weakref
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import structlog
import trio

from dshim.channels.base import (
    BotHost,
    ChannelSettings,
    ChannelSpec,
    Check,
    Collecting,
    FixtureError,
    Identity,
    ProbeResult,
    ProbeRows,
    ReplaySource,
    Secret,
    SubstituteTarget,
)
from dshim.channels.kit.poll import PollBatch, PollEvent, run_poll_loop
from dshim.channels.kit.retry import until_ok
from dshim.channels.telegram import protocol
from dshim.channels.telegram.client import CALL_TIMEOUT, DEFAULT_API_BASE, USER_AGENT, BotApiClient
from dshim.channels.telegram.models import Me
from dshim.channels.telegram.protocol import BotIdentity, UpdateFeed, token_bot_id
from dshim.channels.telegram.render import TelegramOutbound, split
from dshim.errors import ChannelError, Conflict
from dshim.model import InboundMessage, Skip
from dshim.net.http import open_http, open_shared_http

log = structlog.get_logger("dshim.telegram")

OFFSET_CURSOR = "telegram.offset"
TEST_MESSAGE = "dshim connection test"
#: The command menu (setMyCommands); the commands themselves are the pipeline's.
COMMANDS = [
    ("new", "Start a new conversation"),
    ("stop", "Stop the running answer"),
    ("status", "Agent, session and queue status"),
    ("models", "List the agent's models"),
    ("batch", "Collect several messages into one prompt"),
    ("help", "List the commands"),
]


class TelegramSettings(ChannelSettings):
    """The ``[[bots]]`` keys of a Telegram bot."""

    #: The bot token from @BotFather, ``<bot id>:<secret>`` (write ``"${TELEGRAM_BOT_TOKEN}"``).
    token: Secret
    #: The Bot API server (a local Bot API server, or the fake in tests).
    api_base: str = DEFAULT_API_BASE

    def __post_init__(self) -> None:
        token = self.token.get().strip()
        if token_bot_id(token) is None:
            raise ValueError(
                "token: not a Telegram bot token (expected <bot id>:<secret> as BotFather shows it)"
            )
        self.token = Secret(token)
        if not self.api_base.startswith(("http://", "https://")):
            raise ValueError(
                f"api_base: expected an http:// or https:// URL, got {self.api_base!r}"
            )
        self.api_base = self.api_base.rstrip("/")


async def run(
    host: BotHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run one Telegram bot: authenticate, report started, long-poll until shutdown."""
    settings = host.settings_as(TelegramSettings)
    token = settings.token.get()
    # One client for every bot of this process on this Bot API server (the token is in
    # each call's path): a thousand bots, one pool.
    shared = open_shared_http(settings.api_base, user_agent=USER_AGENT, timeout=CALL_TIMEOUT)
    async with shared as http:
        client = BotApiClient(http, token)
        gate = _start_gate(http)

        async def get_me() -> Me:
            async with gate:
                return await client.get_me()

        # Network errors, 5xx and 429 are waited out here; a rejected token raises at once.
        me = await until_ok("getMe", get_me)
        identity = BotIdentity(me.id, me.username)
        log.info("bot_authenticated", username=me.username, bot_id=me.id)
        async with gate:
            await _set_commands(client)
        outbound = TelegramOutbound(client, clock=host.clock, username=me.username)
        decode = partial(protocol.decode_update, me=identity, fetcher=client.fetcher)
        async with host.open_runtime(outbound=outbound, bot_id=str(me.id), decode_raw=decode) as rt:
            task_status.started()
            source = UpdateSource(client, identity, outbound)
            reader = partial(run_poll_loop, source, rt, host.store, cursor_name=OFFSET_CURSOR)
            await host.serve(rt, reader)


#: Bots of one shared client making their start-up calls (getMe, setMyCommands) at a
#: time: ten thousand bots starting together would otherwise ask a Bot API server for
#: ten thousand answers at once, time out waiting (30 s) and ask again, and a busy server
#: would spend its time on answers nobody waits for.  Long polls are not gated.
START_AT_ONCE = 64
_gates: weakref.WeakKeyDictionary[Any, trio.Semaphore] = weakref.WeakKeyDictionary()


def _start_gate(http: Any) -> trio.Semaphore:
    """The start-up gate of the bots sharing ``http`` (one per client)."""
    gate = _gates.get(http)
    if gate is None:
        gate = _gates[http] = trio.Semaphore(START_AT_ONCE)
    return gate


class UpdateSource:
    """Telegram's side of the kit's poll loop: ``getUpdates`` from the offset, mapped."""

    def __init__(self, client: BotApiClient, me: BotIdentity, outbound: TelegramOutbound) -> None:
        self.client = client
        self.outbound = outbound
        self.feed = UpdateFeed(me, fetcher=client.fetcher)
        self._cursor: str | None = None
        self._offset: int | None = None
        #: Whether a 409 already made it ask getWebhookInfo (once per run).
        self._webhook_checked = False

    def offset_of(self, cursor: str | None) -> int | None:
        """The offset a stored cursor stands for (an unreadable one is logged, once)."""
        if cursor != self._cursor:
            self._cursor = cursor
            self._offset = protocol.parse_offset(cursor)
            if self._offset is None and cursor:
                log.warning("offset_unreadable", stored=cursor[:40])
        return self._offset

    async def poll(self, cursor: str | None) -> PollBatch:
        offset = self.offset_of(cursor)
        due = self.feed.due_at()
        if due is None:
            params = protocol.poll_params(offset)
        else:
            # An album is being collected: the offset must stay below its parts, so a
            # long poll would come back at once with what was already seen.  Wait until
            # the album would be complete, then ask once more without waiting.
            await trio.sleep_until(due)
            params = protocol.poll_params(offset, timeout_s=0)
        try:
            raws = await self.client.get_updates(params)
        except Conflict:
            if not self._webhook_checked:
                # Only now is a webhook worth asking about (it is what makes getUpdates
                # answer 409): a start of a thousand bots saves a call each.
                self._webhook_checked = True
                await _warn_webhook(self.client)
            raise
        return self.batch(raws, offset, now=trio.current_time())

    def batch(self, raws: list[bytes], offset: int | None, *, now: float = 0.0) -> PollBatch:
        """Map one getUpdates answer into the loop's events (``now``: trio time)."""
        events: list[PollEvent] = []
        for parsed, raw, confirms in self.feed.take(raws, offset, now=now):
            if parsed.migration is not None:
                self.outbound.migrated(*parsed.migration)
            cursor = str(confirms) if confirms is not None else None
            events.append(PollEvent(parsed.item, raw, cursor))
        return PollBatch(events, received=len(raws), holding=self.feed.holding)


async def _warn_webhook(client: BotApiClient) -> None:
    try:
        info = await client.get_webhook_info()
    except ChannelError as exc:  # getMe already proved the token: this is only a hint
        log.warning("webhook_check_failed", error=str(exc))
        return
    if info.url:
        # While a webhook is set, getUpdates answers 409: say why, then keep backing off
        # so the bot recovers by itself once the webhook is deleted.
        log.error(
            "webhook_set",
            detail="a webhook is set for this bot, so long polling gets 409 Conflict; "
            "delete it (deleteWebhook) or stop the other deployment",
            pending=info.pending_update_count,
        )


async def _set_commands(client: BotApiClient) -> None:
    try:
        await client.set_my_commands(COMMANDS)
    except ChannelError as exc:  # the menu is a convenience; never fatal
        log.info("command_menu_failed", error=str(exc))


# --- replay ---------------------------------------------------------------------------------


#: An event ready for replay's pipeline: its item, its raw form, the fixture event's index.
_Ready = tuple[InboundMessage | Skip, bytes, int]


class ReplayAdapter(Collecting):
    """Decodes fixture events (Update objects) with the real mapping code, and collects
    albums as the reader does (:class:`~.protocol.AlbumCollector`, on the replay's
    timeline: ``dshim.channels.base.Collecting``)."""

    def __init__(self, fx: ReplaySource) -> None:
        if fx.bot_id is None or not fx.bot_id.lstrip("-").isdigit():
            raise FixtureError(
                'telegram fixtures need "bot": {"id": <numeric bot id>, "username": ...}'
            )
        self.identity = BotIdentity(int(fx.bot_id), fx.bot_username)
        self.bot_id = str(self.identity.id)
        self.bot_username = self.identity.username
        self.albums = protocol.AlbumCollector(protocol.ALBUM_LIMITS)
        #: update_id of a held album part -> the fixture event it came in.
        self._index: dict[int, int] = {}

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        return protocol.decode_update(raw, self.identity)

    def collect(self, raw: bytes, index: int, now: float) -> list[_Ready]:
        """One fixture update: an album part is held (what it completes is handed over),
        anything else is ready at once."""
        parsed = protocol.parse_update(raw, self.identity)
        uid = parsed.update_id
        if parsed.album is None or not isinstance(parsed.item, InboundMessage) or uid is None:
            return [(parsed.item, raw, index)]
        self._index[uid] = index
        return self._ready(self.albums.add(parsed.album, uid, parsed.item, raw, now))

    def collect_due(self) -> float | None:
        return self.albums.due_at()

    def collect_ready(self, now: float) -> list[_Ready]:
        return self._ready(self.albums.due(now))

    def _ready(self, albums: list[protocol.Collected]) -> list[_Ready]:
        return [(a.item, a.raw, self._index.pop(a.update_id, 0)) for a in albums]

    #: The chunks an answer is delivered in (the renderer's own split).
    split = staticmethod(split)


# --- probe ----------------------------------------------------------------------------------


async def probe(rows: ProbeRows) -> None:
    """``dshim probe`` rows for a Telegram bot: getMe, webhook, getUpdates, store, send test."""
    settings = rows.settings_as(TelegramSettings)
    token = settings.token.get()
    async with open_http(settings.api_base, user_agent=USER_AGENT, timeout=CALL_TIMEOUT) as http:
        client = BotApiClient(http, token)

        async def identity() -> Identity:
            me = await client.get_me()
            return Identity(name=f"@{me.username}", id=str(me.id))

        async def webhook() -> tuple[ProbeResult, str]:
            info = await client.get_webhook_info()
            if info.url:
                return "warn", (
                    f"a webhook is set ({_origin(info.url)}): long polling gets 409 Conflict "
                    "until it is deleted (deleteWebhook)"
                )
            return "ok", "no webhook set (long polling works)"

        async def poll_once() -> tuple[ProbeResult, str]:
            params: dict[str, Any] = {"timeout": 0, "limit": 1}
            stored = await rows.store.get_cursor(OFFSET_CURSOR)
            if stored and stored.isdigit():
                # The stored offset only confirms what dshim already handled.
                params["offset"] = int(stored)
            try:
                raws = await client.get_updates(params)
            except Conflict:
                return "fail", (
                    "409 Conflict: another process is polling this bot token or a webhook is "
                    "set; run one dshim per token (a running `dshim serve` recovers by itself)"
                )
            waiting = "at least 1 update waiting" if raws else "no updates waiting"
            return "ok", f"getUpdates answers; {waiting}"

        async def send_test(conversation_id: str) -> str:
            sent = await client.send_message(
                {"chat_id": int(conversation_id), "text": TEST_MESSAGE}
            )
            return str(sent.message_id)

        async def group_messages() -> tuple[ProbeResult, str]:
            me = await client.get_me()
            if me.can_read_all_group_messages:
                return "ok", "privacy mode is off: group messages that mention a target arrive"
            return "warn", (
                "privacy mode is on: group messages that only mention a substitute target "
                "never reach the bot (turn it off with @BotFather /setprivacy, then re-add "
                "the bot to its groups)"
            )

        checks = [Check("getWebhookInfo", webhook), Check("getUpdates", poll_once)]
        sub = rows.bot.substitute
        if sub.enabled:
            checks.append(Check("substitute: group messages", group_messages))
            for target in sub.targets:
                checks.append(
                    Check(
                        f"substitute target {target.name or target.prompt_id()}",
                        _target_check(client, target, sub.chats),
                    )
                )
        await rows.standard(
            credentials=f"token present and well-formed (bot id {token_bot_id(token)})",
            identity=identity,
            checks=checks,
            send_test=send_test,
        )


def _target_check(
    client: BotApiClient, target: SubstituteTarget, chats: list[str | int]
) -> Callable[[], Awaitable[tuple[ProbeResult, str]]]:
    """A target's probe row: its membership of the allowed chats, where Telegram can say."""

    async def run() -> tuple[ProbeResult, str]:
        user = target.id if isinstance(target.id, str) and target.id.lstrip("-").isdigit() else None
        if user is None:
            return "ok", (
                f"matched by @{target.username} (Telegram resolves no username to a user id)"
                if target.username
                else "no Telegram id or username: never matches here"
            )
        if not chats:
            return "ok", f"user {user}; list substitute.chats to check membership"
        found: list[str] = []
        for chat in chats:
            try:
                status = await client.get_chat_member(int(str(chat)), int(user))
            except (ChannelError, ValueError) as exc:
                return "warn", f"user {user} in chat {chat}: {exc}"
            found.append(f"{chat}: {status}")
        absent = [f for f in found if f.endswith((": left", ": kicked"))]
        return ("warn" if absent else "ok"), f"user {user}: " + ", ".join(found)

    return run


def _origin(url: str) -> str:
    """Scheme and host of a URL (webhook paths often hold a secret)."""
    scheme, _, rest = url.partition("://")
    host = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    return f"{scheme}://{host}" if rest else "set"


#: key, settings, run, replay adapter, probe (see ChannelSpec).
CHANNEL = ChannelSpec("telegram", TelegramSettings, run, ReplayAdapter, probe)

__all__ = ["CHANNEL", "TelegramSettings"]
