"""The Discord channel: a bot's nursery, the replay adapter and the probe checks.

``run`` checks the token with ``GET /users/@me``, opens the bot's pipeline and keeps one
gateway session (see :mod:`.protocol`).  The bot counts as started at the first READY.
Each MESSAGE_CREATE is handed, in gateway order, to the pipeline with the frame exactly
as received (the durable inbox keeps it and decodes it again after a restart).  A 401
from any REST call, or a fatal gateway close code, stops the bot without a reconnect
loop; other failures reconnect and resume inside ``run``.
"""

from __future__ import annotations

import random as _random
import time
from collections.abc import Callable

import msgspec
import structlog
import trio

from dshim.channels.discord import models as m
from dshim.channels.discord.client import (
    RestClient,
    connect_once,
    open_http_client,
    run_gateway,
)
from dshim.channels.discord.protocol import (
    Connected,
    Dispatch,
    GatewayProtocol,
    GatewayTuning,
    MessageMapper,
    fetched_reference,
)
from dshim.channels.discord.render import DiscordOutbound, split
from dshim.config import BotConfig
from dshim.errors import AuthError, ConfigError, NotFound
from dshim.log import register_secret
from dshim.model import Fetcher, InboundMessage, Loader, ReplyReference, Skip
from dshim.probe import ProbeContext, Result
from dshim.replay import ReplayContext
from dshim.serve import BotContext

log = structlog.get_logger("dshim.discord")

WANTED_DISPATCHES = frozenset({"MESSAGE_CREATE"})
PROBE_READY_TIMEOUT_S = 15.0
TEST_TEXT = "✅ dshim connection test: the Discord bot {name} can send messages here."


def _token(bot: BotConfig) -> str:
    if bot.token is None or not bot.token.get():
        raise ConfigError(
            f'bots.{bot.name}.token: required for channel "discord" '
            '(write token = "${DISCORD_BOT_TOKEN}")'
        )
    token = bot.token.get().strip()
    if token.lower().startswith("bot "):  # a pasted header value
        token = token[4:].strip()
    return token


def lookup_factory(rest: RestClient) -> Callable[[str, str], Loader]:
    """Loaders that fetch a quoted message of the current channel (one request each)."""

    def make(channel_id: str, message_id: str) -> Loader:
        async def load() -> ReplyReference | None:
            try:
                quoted = await rest.get_message(channel_id, message_id)
            except NotFound:
                return None
            return fetched_reference(quoted, channel_id, message_id)

        return load

    return make


def media_factory(rest: RestClient) -> Callable[[m.Attachment], Fetcher | None]:
    """Download handles for the current message's attachments."""

    def make(attachment: m.Attachment) -> Fetcher | None:
        url = attachment.url
        if not url:
            return None

        async def fetch(max_bytes: int) -> bytes:
            return await rest.download(url, max_bytes)

        return fetch

    return make


async def run(
    ctx: BotContext,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    tuning: GatewayTuning | None = None,
    rng: _random.Random | None = None,
) -> None:
    """Run one Discord bot until cancelled, or until a fatal error (raised)."""
    bot = ctx.bot
    token = _token(bot)
    register_secret(token)
    rng = rng or _random.Random()
    async with open_http_client() as http:
        rest = RestClient(http, token=token, api_base=bot.api_base)
        me = await rest.get_current_user()
        log.info("discord_identity", bot_user=me.username, bot_id=me.id)
        mapper = MessageMapper(me.id, lookup=lookup_factory(rest), media=media_factory(rest))
        outbound = DiscordOutbound(rest, clock=ctx.clock, bot_username=me.username or None)
        gw = GatewayProtocol(
            token=token, random=rng.random, gateway_override=bot.gateway_url, tuning=tuning
        )
        started = False

        def on_connected(event: Connected) -> None:
            nonlocal started
            if not started:
                started = True
                task_status.started()

        async with ctx.open_runtime(
            outbound=outbound, bot_id=me.id, decode_raw=mapper.decode_frame
        ) as rt:

            async def handle(dispatch: Dispatch) -> None:
                # Steps 1-6 in gateway order; the next frame is read once this is durable.
                await rt.accept(mapper.decode_message(dispatch.d), dispatch.frame)

            async def watch_auth() -> None:
                await rest.auth_failed.wait()
                raise AuthError("Discord rejected the bot token (HTTP 401): stopping the bot")

            async def reader() -> None:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_auth)
                    await run_gateway(
                        gw, rest, handle, wanted=WANTED_DISPATCHES, on_connected=on_connected
                    )

            await ctx.serve(rt, reader)


class DiscordReplayAdapter:
    """Decodes fixture frames with the real mapping; lookups go through ``fx.http``."""

    def __init__(self, fx: ReplayContext) -> None:
        bot_id = fx.bot.get("id")
        username = fx.bot.get("username")
        self._learn = bot_id is None  # then the fixture's READY frame tells who the bot is
        self.bot_id = str(bot_id) if bot_id is not None else "0"
        self.bot_username = str(username) if username else None
        self._lookup = lookup_factory(RestClient(fx.http, token="replay", api_base=fx.api_base))
        self._mapper = MessageMapper(self.bot_id, lookup=self._lookup)

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        if self._learn:
            self._learn_from_ready(raw)
        return self._mapper.decode_frame(raw)

    def _learn_from_ready(self, raw: bytes) -> None:
        try:
            frame = m.frame_decoder.decode(raw)
            if frame.t != "READY":
                return
            ready = m.ready_decoder.decode(frame.d)
        except msgspec.MsgspecError:
            return
        if ready.user is not None:
            self._learn = False
            self.bot_id = ready.user.id
            self.bot_username = self.bot_username or ready.user.username or None
            self._mapper = MessageMapper(self.bot_id, lookup=self._lookup)

    def split(self, text: str) -> list[str]:
        return split(text)


def replay_adapter(fx: ReplayContext) -> DiscordReplayAdapter:
    return DiscordReplayAdapter(fx)


# --- probe -----------------------------------------------------------------------------------


async def probe_checks(ctx: ProbeContext) -> None:
    """Identity, gateway info (identify budget), READY within 15 s, store, ``--send-test``."""
    bot = ctx.bot
    name = bot.name
    try:
        token = _token(bot)
    except ConfigError as exc:
        ctx.add(f"{name}: token", "fail", str(exc))
        return
    register_secret(token)
    async with open_http_client() as http:
        rest = RestClient(http, token=token, api_base=bot.api_base, max_wait_s=10.0)
        me: list[m.User] = []
        info: list[m.GatewayBot] = []

        async def identity() -> tuple[Result, str]:
            user = await rest.get_current_user()
            me.append(user)
            kind = "bot" if user.bot else "NOT a bot account"
            return ("ok" if user.bot else "warn"), f"{user.username} (id {user.id}, {kind})"

        if await ctx.run(f"{name}: identity", identity) == "fail":
            return

        async def gateway_info() -> tuple[Result, str]:
            got = await rest.get_gateway_bot()
            info.append(got)
            limit = got.session_start_limit
            detail = (
                f"{got.url}; identifies left today {limit.remaining}/{limit.total}, "
                f"reset in {limit.reset_after / 3_600_000:.1f} h, "
                f"max_concurrency {limit.max_concurrency}, shards {got.shards}"
            )
            return ("ok" if limit.remaining > 0 else "fail"), detail

        if await ctx.run(f"{name}: gateway info", gateway_info) == "fail" or not info:
            return

        async def ready() -> tuple[Result, str]:
            gw = GatewayProtocol(
                token=token, random=_random.random, gateway_override=bot.gateway_url
            )
            gw.set_gateway_info(info[0], trio.current_time())
            plan = gw.plan_connection(trio.current_time())
            if plan.refresh_gateway or plan.not_before > trio.current_time():
                return "fail", "no identify allowed now (session_start_limit); not connecting"
            t0 = time.perf_counter()
            reached: list[Connected] = []

            async def ignore(dispatch: Dispatch) -> None:
                return None

            code = await connect_once(
                gw, plan, ignore, wanted=(), on_connected=reached.append, stop_when_connected=True
            )
            if not reached:
                gw.connection_lost(code, trio.current_time())  # raises for fatal codes
                why = gw.last_close_reason or f"close code {code}"
                return "fail", f"the gateway closed before READY ({why})"
            ms = (time.perf_counter() - t0) * 1000
            return "ok", f"READY in {ms:.0f} ms (session {reached[0].session_id}), closed cleanly"

        await ctx.run(f"{name}: gateway", ready, timeout_s=PROBE_READY_TIMEOUT_S)

        store = ctx.store
        if store is not None:

            async def writable() -> tuple[Result, str]:
                stamp = f"{time.time():.3f}"
                await store.set_cursor(name, "probe", stamp)
                back = await store.get_cursor(name, "probe")
                if back != stamp:
                    return "fail", "the store did not return what was written"
                return "ok", "cursor written and read back"

            await ctx.run(f"{name}: store", writable)

        if ctx.send_test:

            async def send_test() -> tuple[Result, str]:
                target = await store.get_last_direct(name) if store is not None else None
                if target is None:
                    return "fail", "no direct conversation yet: send the bot a DM, then retry"
                created = await rest.create_message(target, TEST_TEXT.format(name=name))
                return "ok", f"sent message {created.id} to direct conversation {target}"

            await ctx.run(f"{name}: send test", send_test)
