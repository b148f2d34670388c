"""The Telegram channel: a bot's nursery, its replay adapter and its probe checks.

``run`` authenticates (``getMe``; 401 stops the bot for good), warns about a webhook,
registers the command menu, opens the pipeline, reports started, then long-polls:
each update is mapped by :mod:`~dshim.channels.telegram.protocol` and handed to
``BotRuntime.accept`` in order; only after accept returned is the offset advanced and
persisted in the store (cursor ``telegram.offset``), so a crash never loses an accepted
update and never runs a handled one twice (the pipeline's dedup drops the redelivery).
Updates older than ``backlog_max_age_s`` are confirmed and dropped as ``stale`` by the
pipeline.  Network errors, 5xx and 409 back off 1..30 s with jitter; the loop never spins.
"""

from __future__ import annotations

import time
from functools import partial
from typing import TYPE_CHECKING, Any

import structlog
import trio

from dshim.channels.telegram import protocol
from dshim.channels.telegram.client import DEFAULT_API_BASE, BotApiClient, open_http
from dshim.channels.telegram.protocol import BotIdentity, Poller, token_bot_id
from dshim.channels.telegram.render import TelegramOutbound, split
from dshim.config import BotConfig
from dshim.errors import (
    AuthError,
    ChannelError,
    ConfigError,
    Conflict,
    RateLimited,
)
from dshim.log import register_secret
from dshim.model import InboundMessage, Skip

if TYPE_CHECKING:
    from dshim.pipeline.runtime import BotRuntime
    from dshim.probe import ProbeContext, Result
    from dshim.replay import ReplayContext
    from dshim.serve import BotContext

log = structlog.get_logger("dshim.telegram")

OFFSET_CURSOR = "telegram.offset"
PROBE_CURSOR = "telegram.probe"
CURSOR_WRITE_DEADLINE_S = 5.0
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


def _token(bot: BotConfig) -> str:
    """The bot token; a ConfigError (fatal) when missing or not shaped like one."""
    if bot.token is None or not bot.token.get():
        raise ConfigError(f'bots.{bot.name}.token: required for channel "telegram"')
    token = bot.token.get().strip()
    if token_bot_id(token) is None:
        raise ConfigError(
            f"bots.{bot.name}.token: not a Telegram bot token (expected <bot id>:<secret> "
            "as BotFather shows it)"
        )
    return token


def _api_base(bot: BotConfig) -> str:
    return (bot.api_base or DEFAULT_API_BASE).rstrip("/")


async def run(
    ctx: BotContext, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run one Telegram bot: authenticate, report started, long-poll until shutdown."""
    bot: BotConfig = ctx.bot
    token = _token(bot)
    register_secret(token)
    async with open_http(_api_base(bot)) as http:
        client = BotApiClient(http, token)
        me = await client.get_me()
        identity = BotIdentity(me.id, me.username)
        log.info("telegram_authenticated", username=me.username, bot_id=me.id)
        await _warn_webhook(client)
        await _set_commands(client)
        outbound = TelegramOutbound(client, clock=ctx.clock, username=me.username)
        decode = partial(protocol.decode_update, me=identity, fetcher=client.fetcher)
        async with ctx.open_runtime(outbound=outbound, bot_id=str(me.id), decode_raw=decode) as rt:
            poller = Poller(await _stored_offset(ctx, bot.name))
            task_status.started()
            reader = partial(_poll_forever, ctx, rt, client, poller, identity, outbound)
            await ctx.serve(rt, reader)


async def _stored_offset(ctx: BotContext, bot_name: str) -> int | None:
    stored = await ctx.store.get_cursor(bot_name, OFFSET_CURSOR)
    if not stored:
        return None
    try:
        return int(stored)
    except ValueError:
        log.warning("telegram_offset_unreadable", stored=stored[:40])
        return None


async def _warn_webhook(client: BotApiClient) -> None:
    try:
        info = await client.get_webhook_info()
    except ChannelError as exc:  # getMe already proved the token: this is only a hint
        log.warning("telegram_webhook_check_failed", error=str(exc))
        return
    if info.url:
        # While a webhook is set, getUpdates answers 409: say why, then keep backing off
        # so the bot recovers by itself once the webhook is deleted.
        log.error(
            "telegram_webhook_set",
            detail="a webhook is set for this bot, so long polling gets 409 Conflict; "
            "delete it (deleteWebhook) or stop the other deployment",
            pending=info.pending_update_count,
        )


async def _set_commands(client: BotApiClient) -> None:
    try:
        await client.set_my_commands(COMMANDS)
    except ChannelError as exc:  # the menu is a convenience; never fatal
        log.info("telegram_set_commands_failed", error=str(exc))


async def _poll_forever(
    ctx: BotContext,
    rt: BotRuntime,
    client: BotApiClient,
    poller: Poller,
    me: BotIdentity,
    outbound: TelegramOutbound,
) -> None:
    """Long-poll until cancelled (shutdown) or the token is rejected (AuthError)."""
    bot_name: str = ctx.bot.name
    while True:
        wait = poller.wait_time(trio.current_time())
        if wait > 0:
            await trio.sleep(wait)
        try:
            raws = await client.get_updates(poller.request())
        except AuthError:
            raise
        except RateLimited as exc:
            delay = poller.failed(trio.current_time(), retry_after=exc.retry_after)
            log.warning("telegram_poll_rate_limited", retry_in_s=round(delay, 2))
            continue
        except Conflict as exc:
            delay = poller.failed(trio.current_time())
            log.error("telegram_poll_conflict", error=str(exc), retry_in_s=round(delay, 2))
            continue
        except ChannelError as exc:  # network, timeout, 5xx, undecodable answer
            delay = poller.failed(trio.current_time())
            log.warning("telegram_poll_failed", error=str(exc), retry_in_s=round(delay, 2))
            continue
        poller.succeeded()
        if not raws:
            continue
        before = poller.offset
        stop = await _handle_batch(ctx, rt, raws, poller, me, outbound, client, bot_name)
        if stop:
            return
        if poller.offset == before:
            # Updates came back but none could be confirmed: never spin on them.
            poller.failed(trio.current_time())


async def _handle_batch(
    ctx: BotContext,
    rt: BotRuntime,
    raws: list[bytes],
    poller: Poller,
    me: BotIdentity,
    outbound: TelegramOutbound,
    client: BotApiClient,
    bot_name: str,
) -> bool:
    """Accept a batch in order; persist the offset of what was accepted.  True = stop."""
    confirmed: int | None = None
    try:
        for raw in raws:
            parsed = protocol.parse_update(raw, me, fetcher=client.fetcher)
            uid = parsed.update_id
            if uid is None:
                log.warning("telegram_update_without_id", size=len(raw))
                continue
            if not poller.is_new(uid):
                continue
            if parsed.migration is not None:
                outbound.migrated(*parsed.migration)
            item: InboundMessage | Skip = parsed.item
            verdict = await rt.accept(item, raw)
            if verdict.reason == "shutdown":
                return True  # not accepted: Telegram sends it again after the restart
            confirmed = poller.confirm(uid) or confirmed
    finally:
        if confirmed is not None:
            # Shielded: a shutdown arriving now must not lose the progress just made.
            with trio.CancelScope(shield=True), trio.move_on_after(CURSOR_WRITE_DEADLINE_S):
                await ctx.store.set_cursor(bot_name, OFFSET_CURSOR, str(confirmed))
    return False


# --- replay ---------------------------------------------------------------------------------


class ReplayAdapter:
    """Decodes fixture events (Update objects) with the real mapping code."""

    def __init__(self, bot: dict[str, Any]) -> None:
        if "id" not in bot:
            raise ConfigError('telegram fixtures need "bot": {"id": ..., "username": ...}')
        self.identity = BotIdentity(int(bot["id"]), bot.get("username"))
        self.bot_id = str(self.identity.id)
        self.bot_username = self.identity.username

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        return protocol.decode_update(raw, self.identity)

    def split(self, text: str) -> list[str]:
        return split(text)


def replay_adapter(fx: ReplayContext) -> ReplayAdapter:
    """The adapter ``dshim replay`` uses for ``"format": "raw"`` Telegram fixtures."""
    return ReplayAdapter(fx.bot)


# --- probe ----------------------------------------------------------------------------------


async def probe_checks(ctx: ProbeContext) -> None:
    """``dshim probe`` rows for a Telegram bot: token, getMe, webhook, getUpdates, store."""
    bot: BotConfig = ctx.bot
    prefix = f"{bot.name}: "
    try:
        token = _token(bot)
    except ConfigError as exc:
        ctx.add(prefix + "token", "fail", str(exc))
        return
    register_secret(token)
    ctx.add(prefix + "token", "ok", f"present and well-formed (bot id {token_bot_id(token)})")
    async with open_http(_api_base(bot)) as http:
        client = BotApiClient(http, token)

        async def get_me() -> tuple[Result, str]:
            me = await client.get_me()
            return "ok", f"@{me.username} (id {me.id})"

        if await ctx.run(prefix + "getMe", get_me) == "fail":
            return

        async def webhook() -> tuple[Result, str]:
            info = await client.get_webhook_info()
            if info.url:
                return "warn", (
                    f"a webhook is set ({_origin(info.url)}): long polling gets 409 Conflict "
                    "until it is deleted (deleteWebhook)"
                )
            return "ok", "no webhook set (long polling works)"

        await ctx.run(prefix + "getWebhookInfo", webhook)

        async def poll_once() -> tuple[Result, str]:
            params: dict[str, Any] = {"timeout": 0, "limit": 1}
            if ctx.store is not None:
                stored = await ctx.store.get_cursor(bot.name, OFFSET_CURSOR)
                if stored:
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

        await ctx.run(prefix + "getUpdates", poll_once)

        async def store_writable() -> tuple[Result, str]:
            if ctx.store is None:
                return "fail", "the store is not open"
            stamp = str(int(time.time()))
            await ctx.store.set_cursor(bot.name, PROBE_CURSOR, stamp)
            back = await ctx.store.get_cursor(bot.name, PROBE_CURSOR)
            if back != stamp:
                return "fail", "a value written to the store did not read back"
            offset = await ctx.store.get_cursor(bot.name, OFFSET_CURSOR)
            return "ok", f"writable; stored offset {offset or 'none yet'}"

        await ctx.run(prefix + "store", store_writable)

        if ctx.send_test:

            async def send_test() -> tuple[Result, str]:
                last = await ctx.store.get_last_direct(bot.name) if ctx.store else None
                if last is None:
                    return "warn", (
                        "no direct conversation yet: send the bot a direct message, then "
                        "run --send-test again"
                    )
                sent = await client.send_message({"chat_id": int(last), "text": TEST_MESSAGE})
                return "ok", f"sent to chat {last} (message {sent.message_id})"

            await ctx.run(prefix + "send test", send_test)


def _origin(url: str) -> str:
    """Scheme and host of a URL (webhook paths often hold a secret)."""
    scheme, _, rest = url.partition("://")
    host = rest.split("/", 1)[0].rsplit("@", 1)[-1]
    return f"{scheme}://{host}" if rest else "set"


__all__ = ["run", "replay_adapter", "probe_checks"]
