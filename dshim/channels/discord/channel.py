"""The Discord channel: a bot's nursery, the replay adapter and the probe checks.

``run`` checks the token with ``GET /users/@me`` (network failures, 5xx and 429 are
retried right there with the kit's backoff; a 401 is fatal), opens the bot's pipeline,
counts as started (authenticated) and then keeps one gateway session on the kit's
websocket runner (see :mod:`.protocol` and :mod:`dshim.net.ws`).  Each
MESSAGE_CREATE is handed, in gateway order, to the pipeline with the frame exactly as
received (the durable inbox keeps it and decodes it again after a restart); guild events
go to the mapper only (it learns the bot's managed role there).  INTERACTION_CREATE
button presses are answered here, within Discord's 3 s (see :func:`answer_press`).  A 401
from any REST call, or a fatal gateway close code, stops the bot without a reconnect
loop; other failures reconnect and resume inside ``run``.  Only AuthError,
FatalChannelError and ConfigError escape it.
"""

from __future__ import annotations

import random as _random
from collections.abc import Awaitable, Callable

import msgspec
import structlog
import trio

from dshim.channels.base import (
    BotHost,
    ChannelSettings,
    ChannelSpec,
    Check,
    Identity,
    Inbound,
    ProbeResult,
    ProbeRows,
    ReplaySource,
    Secret,
    Verdict,
)
from dshim.channels.discord import models as m
from dshim.channels.discord.client import (
    DEFAULT_API_BASE,
    HTTP_TIMEOUT,
    USER_AGENT,
    RestClient,
    run_gateway,
)
from dshim.channels.discord.protocol import (
    CALLBACK_DEFERRED_UPDATE,
    CALLBACK_UPDATE_MESSAGE,
    GUILD_EVENTS,
    UNKNOWN_INTERACTION_CODE,
    GatewayProtocol,
    MessageMapper,
    Press,
    RecentIds,
    fetched_reference,
    intents,
)
from dshim.channels.discord.render import CLOSED_NOTE, DiscordOutbound, cut, split
from dshim.channels.kit import Backoff
from dshim.channels.kit.decode import decode
from dshim.channels.kit.gateway import Dispatch, GatewayTuning
from dshim.channels.kit.gateway_run import probe_ready
from dshim.channels.kit.retry import until_ok
from dshim.errors import AuthError, ChannelError, NotFound
from dshim.model import Fetcher, InboundMessage, Loader, ReplyReference, Skip
from dshim.net.http import open_http

log = structlog.get_logger("dshim.discord")

#: Dispatches read: messages for the pipeline, guild events for the mapper (the bot's role),
#: button presses (answered here).
WANTED_DISPATCHES = frozenset({"MESSAGE_CREATE", "INTERACTION_CREATE"}) | GUILD_EVENTS
#: Discord wants the answer to a press within 3 s of it; an attempt never takes longer.
CALLBACK_TIMEOUT_S = 3.0
PROBE_READY_TIMEOUT_S = 15.0
TEST_TEXT = "✅ dshim connection test: the Discord bot {name} can send messages here."


class DiscordSettings(ChannelSettings):
    """The ``[[bots]]`` keys of a Discord bot."""

    #: The bot token from the Developer Portal (write ``"${DISCORD_BOT_TOKEN}"``).
    token: Secret
    #: REST base URL (the fake in tests).
    api_base: str = DEFAULT_API_BASE
    #: Gateway URL override (else the one ``GET /gateway/bot`` hands out).
    gateway_url: str | None = None
    #: Ask for the privileged Message Content intent (Developer Portal: Bot -> Privileged
    #: Gateway Intents).  Without it, message text arrives only in DMs and in messages
    #: that mention the bot.
    message_content: bool = True

    def __post_init__(self) -> None:
        token = self.token.get().strip()
        if token.lower().startswith("bot "):  # a pasted header value
            token = token[4:].strip()
        if not token or any(c.isspace() for c in token):
            raise ValueError("token: not a Discord bot token (empty or contains spaces)")
        self.token = Secret(token)
        if not self.api_base.startswith(("http://", "https://")):
            raise ValueError(
                f"api_base: expected an http:// or https:// URL, got {self.api_base!r}"
            )
        self.api_base = self.api_base.rstrip("/")
        if self.gateway_url is not None and not self.gateway_url.startswith(("ws://", "wss://")):
            raise ValueError(
                f"gateway_url: expected a ws:// or wss:// URL, got {self.gateway_url!r}"
            )


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
    host: BotHost,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    tuning: GatewayTuning | None = None,
    rng: _random.Random | None = None,
) -> None:
    """Run one Discord bot until cancelled, or until a fatal error (raised)."""
    settings = host.settings_as(DiscordSettings)
    token = settings.token.get()
    rng = rng or _random.Random()
    async with open_http(settings.api_base, user_agent=USER_AGENT, timeout=HTTP_TIMEOUT) as http:
        rest = RestClient(http, token=token, api_base=settings.api_base)
        # Transient failures (network, 5xx, 429) are retried here; 401 is raised.
        me = await until_ok("GET /users/@me", rest.get_current_user, backoff=Backoff(rng=rng))
        log.info("bot_authenticated", bot_user=me.username, bot_id=me.id)
        mapper = MessageMapper(me.id, lookup=lookup_factory(rest), media=media_factory(rest))
        outbound = DiscordOutbound(rest, clock=host.clock, bot_username=me.username or None)
        gw = GatewayProtocol(
            token=token,
            random=rng.random,
            intents=intents(message_content=settings.message_content),
            wanted=WANTED_DISPATCHES,
            gateway_override=settings.gateway_url,
            tuning=tuning,
        )

        async with host.open_runtime(
            outbound=outbound, bot_id=me.id, decode_raw=mapper.decode_frame
        ) as rt:
            task_status.started()

            seen = RecentIds()

            async def deliver(dispatch: Dispatch) -> Verdict | None:
                if dispatch.t == "INTERACTION_CREATE":
                    press = mapper.decode_interaction(dispatch.d)
                    if isinstance(press, Skip):
                        return await rt.accept(press)
                    if not seen.add(press.id):  # a Resume replayed it: answered already
                        log.info("interaction_duplicate")
                        return None
                    return await answer_press(press, rest, outbound, rt)
                if dispatch.t != "MESSAGE_CREATE":
                    mapper.learn_guild_event(dispatch.t, dispatch.d)  # not for the pipeline
                    return None
                # Steps 1-6 in gateway order; the next frame is read once this is durable.
                return await rt.accept(mapper.decode_message(dispatch.d), dispatch.frame)

            async def watch_auth() -> None:
                await rest.auth_failed.wait()
                raise AuthError("Discord rejected the bot token (HTTP 401): stopping the bot")

            async def reader() -> None:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_auth)
                    await run_gateway(gw, rest, deliver, backoff=Backoff(rng=rng))

            await host.serve(rt, reader)


async def answer_press(
    press: Press, rest: RestClient, outbound: DiscordOutbound, rt: Inbound
) -> Verdict | None:
    """Answer a button press within Discord's 3 s.

    * A control notice button: the core acts (``Inbound.substitute_control``: operators
      only, anyone else gets the refusal) and the callback (type 7, UPDATE_MESSAGE)
      replaces the notice with the returned text, without buttons.  A late press (the
      callback refused: more than 3 s after the press) was still acted on; the notice
      is then edited to the same text by ``PATCH`` so the operator sees the outcome
      (Discord has shown them "This interaction failed").
    * An option of a request that is still waiting: the callback acknowledges at once
      (type 6, DEFERRED_UPDATE_MESSAGE), then the press goes to the pipeline as the
      presser's message (judged like the typed answer; the starter-only rule applies).
      It is stored normalized, without the frame (which carries the token).  A late
      press still counts.
    * An option of a request that no longer waits (answered, timed out, a restart):
      type 7 takes the buttons away; nothing reaches the pipeline.
    """
    if press.control is not None:
        c = press.control
        text = cut(
            await rt.substitute_control(c.action, c.conversation_id, c.thread_id, press.user_id)
        )
        update = {"type": CALLBACK_UPDATE_MESSAGE, "data": {"content": text, "components": []}}
        if not await _callback(rest, press, update):
            try:
                await rest.edit_message(press.channel_id, press.message_id, text, components=[])
            except ChannelError as exc:
                log.info("control_notice_update_failed", code=exc.code, error=str(exc)[:200])
        return None
    answer = press.answer
    assert answer is not None  # a Press is a control press or an answer
    if not outbound.showing(press.message_id):
        closed = cut(f"{press.message_content}\n\n{CLOSED_NOTE}".strip())
        await _callback(
            rest,
            press,
            {"type": CALLBACK_UPDATE_MESSAGE, "data": {"content": closed, "components": []}},
        )
        log.info("interaction_closed_press")
        return None
    await _callback(rest, press, {"type": CALLBACK_DEFERRED_UPDATE})
    outbound.note_press(press.message_id, press.user_id, int(answer.content))
    return await rt.accept(answer)


async def _callback(rest: RestClient, press: Press, body: dict[str, object]) -> bool:
    """One interaction callback attempt, within the 3 s; False when it did not take."""
    with trio.move_on_after(CALLBACK_TIMEOUT_S):
        try:
            await rest.interaction_callback(press.id, press.token, body)
        except ChannelError as exc:
            late = exc.code == UNKNOWN_INTERACTION_CODE
            log.info("interaction_callback_failed", code=exc.code, late=late, error=str(exc)[:200])
            return False
        return True
    log.info("interaction_callback_failed", code=None, late=True, error="timed out")
    return False


class DiscordReplayAdapter:
    """Decodes fixture frames with the real mapping; lookups go through ``fx.http``."""

    def __init__(self, fx: ReplaySource) -> None:
        self._learn = fx.bot_id is None  # then the fixture's READY frame tells who the bot is
        self.bot_id = fx.bot_id if fx.bot_id is not None else "0"
        self.bot_username = fx.bot_username
        self._lookup = lookup_factory(RestClient(fx.http, token="replay", api_base=fx.api_base))
        self._mapper = MessageMapper(self.bot_id, lookup=self._lookup)

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        if self._learn:
            self._learn_from_ready(raw)
        return self._mapper.decode_frame(raw)

    def _learn_from_ready(self, raw: bytes) -> None:
        try:
            frame = decode(m.frame_decoder, raw)  # bounded depth, like every decode here
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

    #: The chunks an answer is delivered in (the renderer's own split).
    split = staticmethod(split)


# --- probe -----------------------------------------------------------------------------------


async def probe(rows: ProbeRows) -> None:
    """Identity, gateway info (identify budget), READY within 15 s, store, ``--send-test``."""
    settings = rows.settings_as(DiscordSettings)
    token = settings.token.get()
    async with open_http(settings.api_base, user_agent=USER_AGENT, timeout=HTTP_TIMEOUT) as http:
        rest = RestClient(http, token=token, api_base=settings.api_base, max_wait_s=10.0)
        info: list[m.GatewayBot] = []

        async def identity() -> Identity:
            user = await rest.get_current_user()
            warning = None if user.bot else "NOT a bot account"
            return Identity(name=user.username or "?", id=user.id, warning=warning)

        async def gateway_info() -> tuple[ProbeResult, str]:
            got = await rest.get_gateway_bot()
            info.append(got)
            limit = got.session_start_limit
            detail = (
                f"{got.url}; identifies left today {limit.remaining}/{limit.total}, "
                f"reset in {limit.reset_after / 3_600_000:.1f} h, "
                f"max_concurrency {limit.max_concurrency}, shards {got.shards}"
            )
            return ("ok" if limit.remaining > 0 else "fail"), detail

        async def ready() -> tuple[ProbeResult, str]:
            gw = GatewayProtocol(
                token=token,
                random=_random.random,
                intents=intents(message_content=settings.message_content),
                wanted=frozenset(),
                gateway_override=settings.gateway_url,
            )
            return await probe_ready(gw, info[0])

        async def send_test(conversation_id: str) -> str:
            created = await rest.create_message(
                conversation_id, TEST_TEXT.format(name=rows.bot.name)
            )
            return created.id

        async def message_content() -> tuple[ProbeResult, str]:
            if settings.message_content:
                return "ok", (
                    "the MESSAGE_CONTENT intent is requested (enable it in the Developer "
                    "Portal, or the gateway closes with 4014)"
                )
            return "warn", (
                "message_content = false: guild messages that only mention a substitute "
                "target arrive without text, so they never trigger"
            )

        def target_check(user_id: str) -> Callable[[], Awaitable[tuple[ProbeResult, str]]]:
            async def run() -> tuple[ProbeResult, str]:
                try:
                    user = await rest.get_user(user_id)
                except NotFound:
                    return "warn", f"no Discord user {user_id}: this target never matches"
                return "ok", f"{user.global_name or user.username} (id {user.id})"

            return run

        checks = [
            Check("gateway info", gateway_info),
            Check("gateway", ready, timeout_s=PROBE_READY_TIMEOUT_S),
        ]
        sub = rows.bot.substitute
        if sub.enabled:
            checks.append(Check("substitute: group messages", message_content))
            for target in sub.targets:
                label = f"substitute target {target.name or target.prompt_id()}"
                tid = target.id if isinstance(target.id, str) and target.id.isdigit() else None
                if tid is None:
                    checks.append(Check(label, _no_discord_id))
                else:
                    checks.append(Check(label, target_check(tid)))
        await rows.standard(
            credentials="token present",
            identity=identity,
            checks=checks,
            send_test=send_test,
        )


async def _no_discord_id() -> tuple[ProbeResult, str]:
    return "warn", "no Discord user id (a snowflake): this target never matches here"


#: key, settings, run, replay adapter, probe (see ChannelSpec).
CHANNEL = ChannelSpec("discord", DiscordSettings, run, DiscordReplayAdapter, probe)
"""Tests bind timings and jitter: ``replace(CHANNEL, run_fn=partial(run, rng=...))``."""

__all__ = ["CHANNEL", "DiscordSettings"]
