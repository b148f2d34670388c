"""The QQ channel: a bot's nursery, the quote index, the replay adapter and the probe.

``run`` mints an access token and checks it with ``GET /users/@me`` (network failures, 5xx
and rate limits are retried right there; refused credentials are fatal), opens the bot's
pipeline, counts as started and keeps one gateway session on the kit's websocket runner
(:mod:`.protocol` has the theory of operation).  Each message event is handed, in gateway
order, to the pipeline with the frame exactly as received (the durable inbox keeps it and
decodes it again after a restart).  The websocket has no per-event acknowledgement: the
persisted dedup on ``(id, msg_idx)`` drops a Resume replay and QQ's duplicate pushes.

The quote index: in C2C and groups QQ has no fetch-by-id API and a quote carries a
``REFIDX_…``.  Every accepted message is recorded in the store's message index under its
``id`` and its ``msg_idx`` (text, author, attachment kinds, time; never ``ext``'s
``auth_token``); the pipeline records every answer the bot delivered under its
``ext_info.ref_idx`` (a guild answer, which has none, under its message ``id``).  A quote
is resolved inside the turn from that index, then from the event's ``msg_elements``
snapshot, else ``not-found`` -- never with a network request.  A guild quote
(``message_reference.message_id``) is resolved from the index by that id, then -- in a
guild channel only -- with one ``GET /channels/{channel_id}/messages/{message_id}``
inside the turn's budget (404/50039 -> ``not-found``, a missing permission ->
``permission-denied``, anything else or the deadline -> ``not-delivered``); a guild DM
has no lookup: ``unsupported``.
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable

import httpx
import msgspec
import structlog
import trio

from dshim.channels.base import (
    BotHost,
    ChannelSettings,
    ChannelSpec,
    ChannelStore,
    Check,
    Identity,
    ProbeResult,
    ProbeRows,
    ReceivesEvents,
    ReplaySource,
    Secret,
    Verdict,
)
from dshim.channels.kit import Backoff
from dshim.channels.kit.decode import decode
from dshim.channels.kit.gateway import Dispatch, GatewayBot, frame_decoder, ready_decoder
from dshim.channels.kit.gateway_run import probe_ready
from dshim.channels.kit.index import inbound_entry, reference_from
from dshim.channels.kit.retry import until_ok
from dshim.channels.qq import models as m
from dshim.channels.qq.client import (
    DEFAULT_API_BASE,
    DEFAULT_TOKEN_BASE,
    HTTP_TIMEOUT,
    USER_AGENT,
    QQApi,
    run_gateway,
)
from dshim.channels.qq.protocol import (
    LookupFactory,
    QQMapper,
    Route,
    auth_header,
    fetched_reference,
    gateway_session,
    indexable,
    intents,
    media_url,
    scrub_frame,
)
from dshim.channels.qq.render import DEFAULT_TIMINGS, QQOutbound, Timings
from dshim.errors import AuthError, ChannelError, NotFound, StoreError
from dshim.model import Fetcher, InboundMessage, Loader, ReplyReference, Skip
from dshim.net.http import open_http
from dshim.render import split_text

log = structlog.get_logger("dshim.qq")

PROBE_READY_TIMEOUT_S = 15.0
SEND_TEST_IMPOSSIBLE = (
    "not possible: QQ disabled active messages (2025-04), a bot may only answer a message "
    "it received; write to the bot and watch the answer instead"
)


class QQSettings(ChannelSettings):
    """The ``[[bots]]`` keys of a QQ official bot."""

    #: The bot's AppID (q.qq.com -> 开发设置).
    app_id: str
    #: The AppSecret (write ``"${QQ_CLIENT_SECRET}"``).
    client_secret: Secret
    #: OpenAPI base (``https://sandbox.api.sgroup.qq.com`` for the sandbox; the fake in tests).
    api_base: str = DEFAULT_API_BASE
    #: Where access tokens are minted (``/app/getAppAccessToken``).
    token_base: str = DEFAULT_TOKEN_BASE
    #: Gateway URL override (else the one ``GET /gateway/bot`` hands out).
    gateway_url: str | None = None
    #: Event intents by name (default: group_and_c2c_event, public_guild_messages,
    #: direct_message).  Only approved intents may be asked for.
    intents: list[str] | None = None
    #: Stream C2C answers (and send keyboards) in markdown; text when QQ refuses it.
    markdown: bool = True
    #: Approvals and questions with keyboard buttons (needs QQ's keyboard permission and
    #: markdown; falls back to text with numbered options when refused).
    keyboards: bool = False
    #: Extra attachment hosts allowed besides Tencent's CDNs (exact names; tests).
    media_hosts: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        self.app_id = self.app_id.strip()
        if not self.app_id or any(c.isspace() for c in self.app_id):
            raise ValueError("app_id: not a QQ AppID (empty or contains spaces)")
        secret = self.client_secret.get().strip()
        if not secret or any(c.isspace() for c in secret):
            raise ValueError("client_secret: not a QQ AppSecret (empty or contains spaces)")
        self.client_secret = Secret(secret)
        for key in ("api_base", "token_base"):
            value = getattr(self, key)
            if not value.startswith(("http://", "https://")):
                raise ValueError(f"{key}: expected an http:// or https:// URL, got {value!r}")
            setattr(self, key, value.rstrip("/"))
        if self.gateway_url is not None and not self.gateway_url.startswith(("ws://", "wss://")):
            raise ValueError(
                f"gateway_url: expected a ws:// or wss:// URL, got {self.gateway_url!r}"
            )
        try:
            intents(self.intents)
        except ValueError as exc:
            raise ValueError(f"intents: {exc}") from None


# --- the quote index ----------------------------------------------------------------------------


def lookup_factory(
    store: ChannelStore | None,
    clock: Callable[[], float] | None,
    bot_id: str,
    bot_name: str | None,
    api: QQApi | None = None,
) -> LookupFactory:
    """Loaders of quotes: the message index by ``ref_msg_idx`` (or a guild message id),
    then -- for a guild channel (``fetch_in``) with ``api`` -- one ``GET`` of the message,
    else the snapshot (or None: ``not-found``).  The GET is the only network request."""

    def make(
        conversation_id: str,
        ref_idx: str | None,
        snapshot: ReplyReference | None,
        /,
        *,
        fetch_in: str | None = None,
    ) -> Loader:
        async def load() -> ReplyReference | None:
            if store is not None and clock is not None and ref_idx and indexable(ref_idx):
                entries = await store.indexed(conversation_id, ref_idx, now=clock())
                ref = reference_from(entries, message_id=ref_idx, bot_id=bot_id)
                if ref is not None:
                    if len(entries) == 1 and not entries[0].inbound and bot_name:
                        ref.author_name = bot_name  # the bot's own answer
                    return ref
            if fetch_in is not None and api is not None and ref_idx:
                try:
                    msg = await api.get_message(fetch_in, ref_idx)
                except NotFound:
                    return None
                return fetched_reference(
                    msg, message_id=ref_idx, channel_id=fetch_in, bot_id=bot_id
                )
            return snapshot

        return load

    return make


def index_ids(item: InboundMessage) -> list[str]:
    """The ids an accepted message is indexed by: the message ``id`` and its ``msg_idx``."""
    route = item.route
    if not isinstance(route, Route):
        return []
    return [route.msg_id, *([route.msg_idx] if route.msg_idx else [])]


async def record_inbound(store: ChannelStore, item: InboundMessage, now: float) -> None:
    """Put an accepted message in the quote index (best effort: a failure is logged)."""
    try:
        entry = inbound_entry(item, at=item.received_at or now, extra_ids=index_ids(item))
        await store.record_outbound(item.conversation_id, entry, now=now)
    except StoreError as exc:
        log.warning("message_index_failed", error=str(exc)[:200])


def media_factory(api: QQApi) -> Callable[[m.Attachment], Fetcher | None]:
    """Download handles for the current message's attachments (inside the turn)."""

    def make(attachment: m.Attachment) -> Fetcher | None:
        url = media_url(attachment.voice_wav_url or attachment.url)
        if not url:
            return None

        async def fetch(max_bytes: int) -> bytes:
            return await api.download(url, max_bytes)

        return fetch

    return make


# --- run ------------------------------------------------------------------------------------------


def api_for(
    settings: QQSettings, http: httpx.AsyncClient, register_secret: Callable[[str], None]
) -> QQApi:
    """The bot's OpenAPI client; every minted token is registered as a secret."""
    return QQApi(
        http,
        app_id=settings.app_id,
        client_secret=settings.client_secret.get(),
        api_base=settings.api_base,
        token_base=settings.token_base,
        on_new_token=register_secret,
        media_hosts=frozenset(h.lower() for h in settings.media_hosts),
    )


async def run(
    host: BotHost,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    rng: _random.Random | None = None,
    timings: Timings = DEFAULT_TIMINGS,
) -> None:
    """Run one QQ bot until cancelled, or until a fatal error (raised)."""
    settings = host.settings_as(QQSettings)
    rng = rng or _random.Random()
    async with open_http(user_agent=USER_AGENT, timeout=HTTP_TIMEOUT) as http:
        api = api_for(settings, http, host.register_secret)
        # The token and the identity; transient failures are retried, refusals raised.
        me = await until_ok("GET /users/@me", api.get_me, backoff=Backoff(rng=rng))
        log.info("bot_authenticated", bot_user=me.username, bot_id=me.id)
        host.capture_identity({"app_id": settings.app_id})  # what QQReplayAdapter reads
        name = me.username or None
        mapper = QQMapper(
            me.id,
            lookup=lookup_factory(host.store, host.clock, me.id, name, api),
            media=media_factory(api),
        )
        outbound = QQOutbound(
            api,
            clock=host.clock,
            bot_username=name,
            markdown=settings.markdown,
            keyboards=settings.keyboards,
            timings=timings,
        )
        gw = gateway_session(
            token=auth_header(await api.token()),
            random=rng.random,
            intents=intents(settings.intents),
            gateway_override=settings.gateway_url,
        )
        async with host.open_runtime(
            outbound=outbound, bot_id=me.id, decode_raw=mapper.decode_frame
        ) as rt:
            task_status.started()

            async def deliver(dispatch: Dispatch) -> Verdict:
                item = mapper.decode_message(dispatch.t, dispatch.d)
                if isinstance(item, InboundMessage) and isinstance(item.route, Route):
                    item.route.received = trio.current_time()  # the reply window starts now
                # Steps 1-6 in gateway order; the next frame is read once this is durable.
                verdict = await rt.accept(item, scrub_frame(dispatch.frame))
                if verdict.accepted and isinstance(item, InboundMessage):
                    await record_inbound(host.store, item, host.clock())
                return verdict

            async def watch_auth() -> None:
                await api.auth_failed.wait()
                raise AuthError("QQ refused the bot's credentials: stopping the bot")

            async def reader() -> None:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_auth)
                    await run_gateway(gw, api, deliver, backoff=Backoff(rng=rng))

            await host.serve(rt, reader)


# --- replay --------------------------------------------------------------------------------------


class QQReplayAdapter(ReceivesEvents):
    """Decodes fixture frames with the real mapping; quotes read the replay's store, and
    guild lookups go through ``fx.http`` (the fixture's recorded exchanges).

    The fixture's ``bot`` names ``id`` (the bot's user id, from ``/users/@me``),
    ``username`` and ``app_id``; without ``id`` a READY frame among the events says who
    the bot is.  Accepted messages go into the quote index as the live channel records
    them.
    """

    def __init__(self, fx: ReplaySource) -> None:
        # Without bot.id, a READY frame among the events tells who the bot is.
        self._learn = fx.bot_id is None
        self.bot_id = fx.bot_id if fx.bot_id is not None else "qq-bot"
        self.bot_username = fx.bot_username
        self._store = fx.store
        self._clock = fx.clock
        self._api = QQApi(
            fx.http,
            app_id=str(fx.bot_info.get("app_id") or "replay"),
            client_secret="replay",
            api_base=fx.api_base,
            token_base=fx.api_base,
            fixed_token="replay",
        )
        self._mapper = self._mapper_for(self.bot_id)

    def _mapper_for(self, bot_id: str) -> QQMapper:
        lookup = lookup_factory(self._store, self._clock, bot_id, self.bot_username, self._api)
        return QQMapper(bot_id, lookup=lookup)

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        if self._learn:
            self._learn_from_ready(raw)
        return self._mapper.decode_frame(raw)

    def _learn_from_ready(self, raw: bytes) -> None:
        try:
            frame = decode(frame_decoder, raw)
            if frame.t != "READY":
                return
            ready = ready_decoder.decode(frame.d)
        except msgspec.MsgspecError:
            return
        if ready.user is not None:
            self._learn = False
            self.bot_id = ready.user.id
            self.bot_username = self.bot_username or ready.user.username or None
            self._mapper = self._mapper_for(self.bot_id)

    async def received(self, item: InboundMessage | Skip, raw: bytes) -> None:
        """Index the message as the live channel does once it is accepted (addressed, not
        from a bot, not seen before)."""
        store, clock = self._store, self._clock
        if store is None or clock is None or not isinstance(item, InboundMessage):
            return
        if not item.addressed or item.sender_is_bot or item.sender_id == self.bot_id:
            return
        if await store.indexed(item.conversation_id, item.message_id, now=clock()):
            return  # a redelivery: the pipeline drops it as a duplicate
        await record_inbound(store, item, clock())

    @staticmethod
    def split(text: str) -> list[str]:
        """The chunks an answer is delivered in (2,000 characters)."""
        return split_text(text, 2000)


# --- probe ---------------------------------------------------------------------------------------


async def probe(rows: ProbeRows) -> None:
    """Credentials, token and identity, gateway info, READY within 15 s, markdown, store."""
    settings = rows.settings_as(QQSettings)
    async with open_http(user_agent=USER_AGENT, timeout=HTTP_TIMEOUT) as http:
        api = api_for(settings, http, rows.register_secret)
        info: list[GatewayBot] = []

        async def identity() -> Identity:
            me = await api.get_me()  # mints the token first
            return Identity(name=me.username or "?", id=me.id)

        async def gateway_info() -> tuple[ProbeResult, str]:
            got = await api.get_gateway_bot()
            info.append(got)
            limit = got.session_start_limit
            detail = (
                f"{got.url}; identifies left {limit.remaining}/{limit.total}, reset in "
                f"{limit.reset_after / 1000:.0f} s, max_concurrency {limit.max_concurrency}"
            )
            return ("ok" if limit.remaining > 0 else "fail"), detail

        async def ready() -> tuple[ProbeResult, str]:
            gw = gateway_session(
                token=auth_header(await api.token()),
                random=_random.random,
                intents=intents(settings.intents),
                gateway_override=settings.gateway_url,
                wanted=frozenset(),
            )
            return await probe_ready(gw, info[0])

        async def markdown() -> tuple[ProbeResult, str]:
            if not settings.markdown:
                return "ok", "off (answers are plain text)"
            return "warn", (
                "markdown permission cannot be checked before a message arrives: if QQ "
                "refuses markdown (50055/50056) answers fall back to text; apply for it on "
                "q.qq.com, or set markdown = false"
            )

        async def send_test(conversation_id: str) -> str:
            raise ChannelError(SEND_TEST_IMPOSSIBLE)

        await rows.standard(
            credentials=f"app_id {settings.app_id}, client secret present",
            identity=identity,
            checks=[
                Check("gateway info", gateway_info),
                Check("gateway", ready, timeout_s=PROBE_READY_TIMEOUT_S),
                Check("markdown", markdown),
            ],
            send_test=send_test,
        )


#: key, settings, run, replay adapter, probe (see ChannelSpec).
CHANNEL = ChannelSpec("qq", QQSettings, run, QQReplayAdapter, probe)
"""Tests bind timings and jitter: ``replace(CHANNEL, run_fn=partial(run, rng=...))``."""

__all__ = ["CHANNEL", "QQSettings"]
