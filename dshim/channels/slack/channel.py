"""The Slack channel: a bot's nursery, the replay adapter and the probe checks.

``run`` checks the bot token with ``auth.test`` (network failures, 5xx and 429 are
retried with the kit's backoff; ``invalid_auth`` / ``account_inactive`` are fatal),
learns the granted scopes (``x-oauth-scopes``) -- the app id comes with the first
``hello`` (``connection_info.app_id``) -- opens the
bot's pipeline, counts as started and then keeps Socket Mode connected
(:func:`~.client.run_socket_mode`).  Each envelope is acknowledged at once and handed, in
the order read, to the pipeline with the frame exactly as received (the durable inbox
keeps it and decodes it again after a restart); what queued up meanwhile goes to the
pipeline's ``accept_many`` together (one store transaction for a burst).  A rejected bot token later on, a
rejected app token or ``link_disabled`` stop the bot without a reconnect loop; other
failures reconnect inside ``run``.  Only AuthError, FatalChannelError and ConfigError
escape it.

The threads the bot posted into are kept in the store (cursor ``threads``, the newest
1,000), so after a restart a reply in such a thread is still conversation, not a quote.
"""

from __future__ import annotations

import dataclasses
import json
import random as _random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

import httpx
import msgspec
import structlog
import trio

from dshim.channels.base import (
    AcceptsMany,
    BotHost,
    ChannelSettings,
    ChannelSpec,
    ChannelStore,
    Check,
    FixtureError,
    Identity,
    ProbeResult,
    ProbeRows,
    ReplaySource,
    Secret,
    SubstituteTarget,
)
from dshim.channels.kit import Backoff
from dshim.channels.kit.decode import decode
from dshim.channels.kit.retry import until_ok
from dshim.channels.slack import models as m
from dshim.channels.slack.client import (
    DEFAULT_API_BASE,
    HTTP_TIMEOUT,
    USER_AGENT,
    WS_OPTIONS,
    WebClient,
    run_socket_mode,
)
from dshim.channels.slack.protocol import (
    USER_ID,
    BotIdentity,
    EventMapper,
    Incoming,
    LookupFactory,
    SocketSession,
    SocketTuning,
    parse_scopes,
    workspace_host,
)
from dshim.channels.slack.render import SlackOutbound, split
from dshim.errors import AuthError, ChannelError, RemoteProtocolError, StoreError
from dshim.model import Fetcher, InboundMessage, Loader, ReplyReference, Skip
from dshim.net.http import open_http
from dshim.net.ws import open_client_websocket

log = structlog.get_logger("dshim.slack")

PROBE_READY_TIMEOUT_S = 15.0
THREADS_CURSOR = "threads"
MAX_PERSISTED_THREADS = 1000
#: The thread memory is written at most this often (see :class:`ThreadMemory`).
SAVE_EVERY_S = 1.0
#: How long the last save may take when the bot stops.
FINAL_SAVE_DEADLINE_S = 5.0
TEST_TEXT = "✅ dshim connection test: the Slack bot {name} can send messages here."
#: Scopes without which the bot cannot work, and those whose lack only degrades quotes.
REQUIRED_SCOPES = ("app_mentions:read", "chat:write", "im:history")
QUOTE_SCOPES = ("channels:history", "groups:history", "mpim:history")
#: Without these, channel messages that do not mention the bot never arrive.
SUBSTITUTE_SCOPES = ("channels:history", "groups:history")


class SlackSettings(ChannelSettings):
    """The ``[[bots]]`` keys of a Slack bot."""

    #: The Bot User OAuth Token (``xoxb-…``; write ``"${SLACK_BOT_TOKEN}"``).
    bot_token: Secret
    #: The app-level token with ``connections:write`` (``xapp-…``) for Socket Mode.
    app_token: Secret
    #: Web API base URL (the fake in tests).
    api_base: str = DEFAULT_API_BASE
    #: Native streaming (``chat.startStream``); false forces postMessage + chat.update.
    stream: bool = True

    def __post_init__(self) -> None:
        bot = self.bot_token.get().strip()
        app = self.app_token.get().strip()
        if not bot.startswith("xoxb-") or any(c.isspace() for c in bot):
            raise ValueError("bot_token: not a Slack bot token (expected xoxb-…)")
        if not app.startswith("xapp-") or any(c.isspace() for c in app):
            raise ValueError("app_token: not a Slack app-level token (expected xapp-…)")
        self.bot_token = Secret(bot)
        self.app_token = Secret(app)
        if not self.api_base.startswith(("http://", "https://")):
            raise ValueError(
                f"api_base: expected an http:// or https:// URL, got {self.api_base!r}"
            )
        self.api_base = self.api_base.rstrip("/")


def web_client(
    http: httpx.AsyncClient, settings: SlackSettings, *, max_wait_s: float = 60.0
) -> WebClient:
    """The bot's Web API client with both tokens."""
    return WebClient(
        http,
        bot_token=settings.bot_token.get(),
        app_token=settings.app_token.get(),
        api_base=settings.api_base,
        max_wait_s=max_wait_s,
    )


def lookup_factory(web: WebClient, mapper: Callable[[], EventMapper]) -> LookupFactory:
    """Loaders that fetch one quoted message of the current channel (one request each)."""

    def make(channel: str, ts: str, thread_ts: str | None) -> Loader:
        async def load() -> ReplyReference | None:
            if thread_ts is None:
                found = await web.history_message(channel, ts)
            else:
                found = await web.thread_message(channel, thread_ts, ts)
            return mapper().fetched_reference(found, ts)

        return load

    return make


def media_factory(web: WebClient) -> Callable[[m.File], Fetcher | None]:
    """Download handles for the current message's files (bot token, inside the turn)."""

    def make(file: m.File) -> Fetcher | None:
        url = file.url_private_download or file.url_private
        if not url:
            return None

        async def fetch(max_bytes: int) -> bytes:
            return await web.download(url, max_bytes)

        return fetch

    return make


async def identify(web: WebClient) -> BotIdentity:
    """``auth.test`` as the bot's identity (the app id is learned from ``hello``)."""
    auth = await web.auth_test()
    if not auth.user_id:
        raise RemoteProtocolError("auth.test: no user_id (not a bot token?)")
    return BotIdentity(
        user_id=auth.user_id,
        bot_id=auth.bot_id,
        team_id=auth.team_id,
        name=auth.user,
        workspace_host=workspace_host(auth.url),
        scopes=parse_scopes(web.scopes_header),
    )


def fixture_bot(me: BotIdentity) -> dict[str, str]:
    """The identity as a fixture's ``bot`` holds it (what :class:`SlackReplayAdapter`
    reads), for ``serve --capture``; unknown fields are left out."""
    out = {
        "user_id": me.user_id,
        "bot_id": me.bot_id,
        "app_id": me.app_id,
        "team_id": me.team_id,
        "name": me.name,
        "url": f"https://{me.workspace_host}/" if me.workspace_host else None,
        "scopes": ",".join(sorted(me.scopes)) if me.scopes is not None else None,
    }
    return {k: v for k, v in out.items() if v is not None}


class ThreadMemory:
    """The threads the bot posted into, persisted in a store cursor (bounded).

    The cursor holds the whole list (up to 1,000 entries), so it is not written per
    answer: :meth:`posted` notes the thread and wakes :meth:`run`, the bot's saver task,
    which writes the list at once and then at most every :data:`SAVE_EVERY_S`, with all
    the threads noted meanwhile (a burst into 2,000 new threads made ~2,000 writes of up
    to 1,000 entries each).  What is noted when the task stops is written then.  A crash
    loses at most the last second's threads: a reply in one of them is then read as a
    quote of its parent, not as conversation (the memory is a hint, not the inbox).
    """

    def __init__(self, store: ChannelStore, mapper: EventMapper, threads: list[str]) -> None:
        self.store = store
        self.mapper = mapper
        self._saved: OrderedDict[str, None] = OrderedDict((t, None) for t in threads)
        self._unsaved = False
        self._wake = trio.Event()

    @staticmethod
    async def load(store: ChannelStore) -> list[str]:
        try:
            raw = await store.get_cursor(THREADS_CURSOR)
        except StoreError as exc:
            log.warning("threads_load_failed", error=str(exc)[:200])
            return []
        if not raw:
            return []
        try:
            value = json.loads(raw)
        except ValueError:
            return []
        return [t for t in value if isinstance(t, str)][-MAX_PERSISTED_THREADS:]

    async def posted(self, channel: str, thread_ts: str) -> None:
        """The bot posted into this thread (the save is :meth:`run`'s, never awaited here)."""
        self.mapper.note_thread(channel, thread_ts)
        key = f"{channel}:{thread_ts}"
        if key in self._saved:
            return
        self._saved[key] = None
        while len(self._saved) > MAX_PERSISTED_THREADS:
            self._saved.popitem(last=False)
        self._unsaved = True
        self._wake.set()

    async def run(self) -> None:
        """Save what :meth:`posted` noted, at once and then at most every
        :data:`SAVE_EVERY_S`, until cancelled; then the rest (bounded in time)."""
        try:
            while True:
                await self._wake.wait()
                self._wake = trio.Event()
                await self._save()
                await trio.sleep(SAVE_EVERY_S)
        finally:
            if self._unsaved:
                with trio.CancelScope(shield=True), trio.move_on_after(FINAL_SAVE_DEADLINE_S):
                    await self._save()

    async def _save(self) -> None:
        if not self._unsaved:
            return
        self._unsaved = False
        value = msgspec.json.encode(list(self._saved)).decode()
        try:
            await self.store.set_cursor(THREADS_CURSOR, value)
        except StoreError as exc:  # costs only the memory across a restart, not the answer
            log.warning("threads_save_failed", error=str(exc)[:200])


async def run(
    host: BotHost,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    tuning: SocketTuning | None = None,
    rng: _random.Random | None = None,
) -> None:
    """Run one Slack bot until cancelled, or until a fatal error (raised)."""
    settings = host.settings_as(SlackSettings)
    rng = rng or _random.Random()
    async with open_http(settings.api_base, user_agent=USER_AGENT, timeout=HTTP_TIMEOUT) as http:
        web = web_client(http, settings)

        async def who() -> BotIdentity:
            return await identify(web)

        me = await until_ok("auth.test", who, backoff=Backoff(rng=rng))
        log.info("bot_authenticated", bot_user=me.name, bot_id=me.user_id, team=me.team_id)
        host.capture_identity(fixture_bot(me))
        threads = await ThreadMemory.load(host.store)
        mapper = EventMapper(me, threads=threads)
        mapper.lookup = lookup_factory(web, lambda: mapper)
        mapper.media = media_factory(web)
        memory = ThreadMemory(host.store, mapper, threads)
        outbound = SlackOutbound(
            web,
            clock=host.clock,
            bot_username=me.name,
            stream=settings.stream,
            on_thread=memory.posted,
            workspace_host=me.workspace_host,
        )
        async with host.open_runtime(
            outbound=outbound, bot_id=me.user_id, decode_raw=mapper.decode_envelope
        ) as rt:
            task_status.started()

            many = rt if isinstance(rt, AcceptsMany) else None  # (a Protocol check: slow)

            async def accept(events: list[tuple[InboundMessage | Skip, bytes | None]]) -> None:
                if len(events) > 1 and many is not None:
                    await many.accept_many(events)  # one store transaction for a burst
                else:
                    for item, raw in events:
                        await rt.accept(item, raw)

            async def deliver(batch: list[Incoming]) -> None:
                """The envelopes queued since the last call, in the order read."""
                events: list[tuple[InboundMessage | Skip, bytes | None]] = []
                for incoming in batch:
                    envelope = incoming.envelope
                    if envelope.type == "interactive":
                        press = mapper.control_press(envelope)
                        if press is not None:  # a control notice's button: never a message
                            await accept(events)  # what came before it goes first
                            events = []
                            result = await rt.substitute_control(
                                press.action, press.conversation_id, press.thread_id, press.user
                            )
                            await outbound.show_control_result(press, result)
                            continue
                    item = mapper.map_envelope(envelope)
                    if envelope.type == "interactive" and isinstance(item, InboundMessage):
                        message_ts = item.message_id.partition("-")[0]
                        outbound.note_press(
                            item.conversation_id, message_ts, item.sender_id, item.content
                        )
                    events.append((item, mapper.stored_frame(envelope)))
                await accept(events)

            async def watch_auth() -> None:
                await web.auth_failed.wait()
                raise AuthError("Slack rejected the bot token (invalid_auth): stopping the bot")

            async def reader() -> None:
                def connected(session: SocketSession) -> None:
                    if mapper.me.app_id is None and session.app_id:
                        mapper.me = dataclasses.replace(mapper.me, app_id=session.app_id)
                        host.capture_identity({"app_id": session.app_id})

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_auth)
                    await run_socket_mode(
                        web,
                        deliver,
                        app_id=me.app_id,
                        tuning=tuning,
                        backoff=Backoff(rng=rng),
                        on_connected=connected,
                    )

            # The saver outlives the reader: answers still finishing after a shutdown
            # began note their threads too, and its last save writes them.
            async with trio.open_nursery() as saving:
                saving.start_soon(memory.run)
                await host.serve(rt, reader)
                saving.cancel_scope.cancel()


class SlackReplayAdapter:
    """Decodes fixture envelopes with the real mapping; lookups go through ``fx.http``.

    The fixture's ``bot`` holds ``user_id``, ``bot_id``, ``app_id``, ``team_id`` (and
    optionally ``name``, ``url`` = the workspace URL, ``scopes``).
    """

    def __init__(self, fx: ReplaySource) -> None:
        info = fx.bot_info

        def text(key: str) -> str | None:
            value = info.get(key)
            return str(value) if isinstance(value, (str, int)) and str(value) else None

        user_id = text("user_id") or fx.bot_id
        if not user_id:
            raise FixtureError("a Slack fixture's bot needs user_id (and bot_id, app_id)")
        scopes = info.get("scopes")
        me = BotIdentity(
            user_id=user_id,
            bot_id=text("bot_id"),
            app_id=text("app_id"),
            team_id=text("team_id"),
            name=text("name") or fx.bot_username,
            workspace_host=workspace_host(text("url")),
            scopes=parse_scopes(scopes) if isinstance(scopes, str) else None,
        )
        self.bot_id = user_id
        self.bot_username = me.name
        web = WebClient(fx.http, bot_token="xoxb-replay", api_base=fx.api_base)
        self._mapper = EventMapper(me)
        self._mapper.lookup = lookup_factory(web, lambda: self._mapper)

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        return self._mapper.decode_envelope(raw)

    #: The chunks an answer is delivered in (the fallback's split).
    split = staticmethod(split)


def replay_adapter(fx: ReplaySource) -> SlackReplayAdapter:
    """The adapter for ``fixtures/slack``: ``bot`` holds user_id, bot_id, app_id, team_id."""
    return SlackReplayAdapter(fx)


# --- probe -----------------------------------------------------------------------------------


def scope_check(scopes: frozenset[str] | None) -> tuple[ProbeResult, str]:
    """The probe's scope row from the granted scopes."""
    if scopes is None:
        return "warn", "Slack sent no x-oauth-scopes header: scopes unknown"
    missing = [s for s in REQUIRED_SCOPES if s not in scopes]
    if missing:
        return "fail", f"missing {', '.join(missing)}: add them under OAuth & Permissions"
    degraded = [s for s in QUOTE_SCOPES if s not in scopes]
    if degraded:
        return (
            "warn",
            f"missing {', '.join(degraded)}: quotes in those conversations degrade to "
            "permission-denied",
        )
    return "ok", ", ".join(sorted(scopes))


async def socket_hello(web: WebClient) -> tuple[ProbeResult, str]:
    """``apps.connections.open``, then the websocket until ``hello``, then close."""
    url = await web.connections_open()
    t0 = time.perf_counter()
    async with open_client_websocket(url, WS_OPTIONS) as (ws, _):
        while True:
            data = await ws.get_message()
            raw = data.encode() if isinstance(data, str) else data
            try:
                env = decode(m.envelope_decoder, raw)
            except msgspec.MsgspecError:
                continue
            if env.type == "hello":
                ms = (time.perf_counter() - t0) * 1000
                await ws.aclose(1000, "probe done")
                return "ok", f"hello in {ms:.0f} ms (connections {env.num_connections}), closed"
            if env.type == "disconnect":
                return "fail", f"Slack sent disconnect ({env.reason}) before hello"


async def probe(rows: ProbeRows) -> None:
    """Tokens, ``auth.test``, scopes, Socket Mode hello within 15 s, store, ``--send-test``."""
    settings = rows.settings_as(SlackSettings)
    async with open_http(settings.api_base, user_agent=USER_AGENT, timeout=HTTP_TIMEOUT) as http:
        web = web_client(http, settings, max_wait_s=10.0)

        async def identity() -> Identity:
            auth = await web.auth_test()
            return Identity(
                name=f"{auth.user or '?'} (team {auth.team or auth.team_id or '?'})",
                id=auth.user_id or "?",
            )

        async def scopes() -> tuple[ProbeResult, str]:
            return scope_check(parse_scopes(web.scopes_header))

        async def socket() -> tuple[ProbeResult, str]:
            return await socket_hello(web)

        async def send_test(conversation_id: str) -> str:
            posted = await web.post_message(
                conversation_id, thread_ts=None, text=TEST_TEXT.format(name=rows.bot.name)
            )
            return posted.ts or "?"

        checks = [
            Check("scopes", scopes),
            Check("socket mode", socket, timeout_s=PROBE_READY_TIMEOUT_S),
        ]
        sub = rows.bot.substitute
        if sub.enabled:

            async def group_messages() -> tuple[ProbeResult, str]:
                return substitute_scope_check(parse_scopes(web.scopes_header))

            checks.append(Check("substitute: group messages", group_messages))
            for target in sub.targets:
                label = f"substitute target {target.name or target.prompt_id()}"
                checks.append(Check(label, target_check(web, target)))
        await rows.standard(
            credentials="bot token (xoxb-) and app token (xapp-) present",
            identity=identity,
            checks=checks,
            send_test=send_test,
        )


def substitute_scope_check(scopes: frozenset[str] | None) -> tuple[ProbeResult, str]:
    """Whether group messages that mention only a person (not the bot) can arrive."""
    events = "subscribe to the message.channels and message.groups bot events"
    if scopes is None:
        return "warn", f"scopes unknown: make sure of {', '.join(SUBSTITUTE_SCOPES)} and {events}"
    missing = [s for s in SUBSTITUTE_SCOPES if s not in scopes]
    if missing:
        return "warn", (
            f"missing {', '.join(missing)}: channel messages that only mention a substitute "
            f"target never arrive (add the scopes, and {events})"
        )
    return "ok", (
        f"{', '.join(SUBSTITUTE_SCOPES)} granted; {events} (Slack does not show a bot "
        "token its event subscriptions)"
    )


def target_check(
    web: WebClient, target: SubstituteTarget
) -> Callable[[], Awaitable[tuple[ProbeResult, str]]]:
    """The probe row of one substitute target: ``users.info`` on its Slack user id."""

    async def run() -> tuple[ProbeResult, str]:
        uid = target.id if isinstance(target.id, str) else None
        if uid is None or not USER_ID.fullmatch(uid):
            return "warn", "no Slack user id (U…): this target never matches here"
        try:
            user = await web.user_info(uid)
        except ChannelError as exc:
            if exc.code == "user_not_found":
                return "warn", f"no Slack user {uid}: this target never matches"
            return "warn", f"cannot check {uid} ({exc.code}; users.info needs users:read)"
        name = (user.profile.display_name if user.profile else None) or user.real_name or user.name
        if user.deleted:
            return "warn", f"{name or uid} (id {uid}) is deactivated"
        return "ok", f"{name or '?'} (id {user.id or uid})"

    return run


#: key, settings, run, replay adapter, probe (see ChannelSpec).
CHANNEL = ChannelSpec("slack", SlackSettings, run, replay_adapter, probe)
"""Tests bind timings and jitter: ``replace(CHANNEL, run_fn=partial(run, rng=...))``."""

__all__ = ["CHANNEL", "SlackSettings"]
