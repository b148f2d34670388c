"""The WeChat channel: a bot's nursery, its login, its replay adapter and its probe.

``run`` finds the credentials (the config's ``token``, else the login ``dshim login
BOT`` saved in the data directory), announces the bot (``msg/notifystart``, retried
through transient failures; ``-14`` stops the bot: the session expired, log in again),
opens the pipeline, reports started, then long-polls ``getupdates`` with the kit's poll
loop (:mod:`dshim.channels.kit.poll`): :class:`UpdateSource` maps each message and
hands the batch over in order; the opaque cursor (``weixin.cursor``) is stored only
after the whole batch was accepted.  Once the pipeline took a user message,
:class:`IndexingInbound` keeps its context token when it is the sender's newest
(:mod:`~dshim.channels.weixin.contexts`: a dropped message never moves it) and records
the message in the message index so later quotes of it resolve without a fetch-by-id
API.
Failures back off 2 s, and 30 s from the third in a row (the plugin's policy,
:class:`IlinkBackoff`).  On the way out ``msg/notifystop`` is sent (10 s at most).
"""

from __future__ import annotations

import random
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Literal

import msgspec
import structlog
import trio
from msgspec import UNSET

from dshim.channels.base import (
    AcceptsMany,
    BotHost,
    ChannelSettings,
    ChannelSpec,
    ChannelStore,
    Check,
    FixtureError,
    Identity,
    Inbound,
    LoginContext,
    OutboundEntry,
    ProbeResult,
    ProbeRows,
    ReceivesEvents,
    ReplaySource,
    RetractOutcome,
    Secret,
    Verdict,
    data_dir_of,
)
from dshim.channels.kit import Backoff
from dshim.channels.kit import decode as kit_decode
from dshim.channels.kit.index import inbound_entry, reference_from
from dshim.channels.kit.poll import PollBatch, PollEvent, run_poll_loop
from dshim.channels.kit.retry import until_ok
from dshim.channels.weixin import creds, protocol
from dshim.channels.weixin import models as m
from dshim.channels.weixin.client import CALL_TIMEOUT, USER_AGENT, IlinkClient
from dshim.channels.weixin.contexts import ContextBook
from dshim.channels.weixin.login import run_login
from dshim.channels.weixin.protocol import FetcherFactory, LoaderFactory, QuoteLookup
from dshim.channels.weixin.render import WeixinOutbound, split
from dshim.errors import (
    AuthError,
    ChannelError,
    PermissionDenied,
    RateLimited,
    StoreError,
    TransportError,
)
from dshim.model import InboundMessage, Loader, ReplyReference, Skip
from dshim.net.http import open_http

log = structlog.get_logger("dshim.weixin")

CURSOR = "weixin.cursor"
CURSOR_OWNER = "weixin.cursor_owner"
TEST_MESSAGE = "dshim connection test"
NOTIFY_STOP_DEADLINE_S = 10.0
#: The recovery window around a quoted message's time (the seed's 15 s).
RECOVERY_WINDOW_S = 15.0
GROUPS_LOGGED_MAX = 256


class WeixinSettings(ChannelSettings):
    """The ``[[bots]]`` keys of a WeChat (iLink) bot."""

    #: The iLink bot token (``"${WEIXIN_BOT_TOKEN}"``); without it, the saved QR login.
    token: Secret | None = None
    #: The bot's ``ilink_bot_id`` (``...@im.bot``) when ``token`` is given.
    bot_id: str | None = None
    #: The iLink API and QR-login host (the fake in tests).
    api_base: str = protocol.DEFAULT_API_BASE
    #: The media CDN images and files are downloaded from and uploaded to.
    cdn_base: str = protocol.DEFAULT_CDN_BASE

    def __post_init__(self) -> None:
        if self.token is not None:
            token = self.token.get().strip()
            if not token or any(c.isspace() for c in token):
                raise ValueError("token: empty or contains whitespace")
            self.token = Secret(token)
        for key in ("api_base", "cdn_base"):
            value = getattr(self, key)
            if not value.startswith(("http://", "https://")):
                raise ValueError(f"{key}: expected an http:// or https:// URL, got {value!r}")
            setattr(self, key, value.rstrip("/"))


@dataclass(frozen=True, slots=True)
class Credentials:
    token: str
    bot_id: str
    api_base: str
    owner: str | None
    origin: str


def _login_hint(name: str) -> str:
    return f"run `dshim login {name}` to log in again"


async def credentials(
    settings: WeixinSettings, data_dir: Path | None, bot_name: str
) -> Credentials | None:
    """The config's token, else the saved login (None: neither)."""
    saved = await creds.load_login(data_dir, bot_name) if data_dir is not None else None
    if settings.token is not None:
        token = settings.token.get()
        bot_id = settings.bot_id
        if bot_id is None and saved is not None and saved.bot_token == token:
            bot_id = saved.ilink_bot_id
        bot_id = bot_id or f"ilink-{protocol.credential_hash(token)}"
        owner = saved.ilink_user_id if saved is not None else None
        return Credentials(token, bot_id, settings.api_base, owner, "token from the config")
    if saved is None:
        return None
    base = saved.baseurl or settings.api_base
    return Credentials(
        saved.bot_token, saved.ilink_bot_id, base, saved.ilink_user_id, "saved QR login"
    )


class IlinkBackoff(Backoff):
    """The plugin's poll failure policy: 2 s, and 30 s from the third failure in a row."""

    def __init__(self, first_s: float = 2.0, long_s: float = 30.0, after: int = 3) -> None:
        super().__init__(first_s, long_s, 1.0, jitter=0.0)
        self.first_s = first_s
        self.long_s = long_s
        self.after = after

    def next_delay(self, *, retry_after: float | None = None) -> float:
        self.failures += 1
        delay = self.long_s if self.failures >= self.after else self.first_s
        return max(delay, retry_after or 0.0)


def quote_loader(
    store: ChannelStore,
    clock: Callable[[], float],
    *,
    bot_id: str,
    bot_name: str | None,
    window_s: float = RECOVERY_WINDOW_S,
) -> LoaderFactory:
    """The index lookup of a content-less quote: by its ids, then by any of its times.

    A unique hit gives the snapshot (an inbound entry is the user's own message, with
    its author; one of the bot's is authored by the bot); several are ``not-delivered``.
    Nothing found: an empty reference, so the core's recovery goes on to the session
    history (``recover_at``).
    """

    def factory(lookup: QuoteLookup) -> Loader:
        async def load() -> ReplyReference | None:
            entries = await store.outbound(lookup.conversation_id, now=clock())
            matches: list[OutboundEntry] = []
            for key in lookup.keys:
                matches = [e for e in entries if key in e.message_ids]
                if matches:
                    break
            if not matches and lookup.times:
                matches = [
                    e
                    for e in entries
                    if not e.inbound
                    and any(
                        e.sent_at - window_s <= t <= e.completed_at + window_s for t in lookup.times
                    )
                ]
            if len(matches) > 1:
                log.info("reply_index_ambiguous", entries=len(matches))
            if not matches:
                return ReplyReference()  # the core's recovery goes on (history)
            ref = reference_from(
                matches, message_id=lookup.keys[0] if lookup.keys else "", bot_id=bot_id
            )
            assert ref is not None
            if not lookup.keys:
                ref.message_id = UNSET  # the shell carried no id: say nothing about it
            if ref.unavailable_reason is UNSET:  # found: it is the quoted message
                ref.unavailable_reason = None
                if not matches[0].inbound:
                    ref.author_name = bot_name
                if isinstance(ref.content, str) and lookup.partial is not None:
                    ref.content = (
                        protocol.resolve_partial(ref.content, lookup.partial) or ref.content
                    )
            return ref

        return load

    return factory


def mapper(
    *,
    bot_id: str,
    clock: Callable[[], float],
    fetcher_for: FetcherFactory | None,
    loader_for: LoaderFactory | None,
) -> Callable[[bytes], protocol.Mapped]:
    """Decode one ``msgs`` entry with the channel's download and quote lookups."""
    return lambda raw: protocol.map_message(
        raw, bot_id=bot_id, now_ms=clock() * 1000, fetcher_for=fetcher_for, loader_for=loader_for
    )


class IndexingInbound:
    """The pipeline's receiving side: once ``accept`` took a direct message, its context
    token is kept (when it is the sender's newest) and the message is recorded in the
    message index.

    Only a message that became work moves the token: a dropped one (stale, duplicate,
    unaddressed, malformed, ignored) or a denied one (accepted, but refused at step 4)
    may carry a higher ``seq`` and a token iLink refuses, which would silence every
    later answer to that user."""

    def __init__(
        self,
        inner: Inbound,
        store: ChannelStore,
        clock: Callable[[], float],
        contexts: ContextBook,
    ) -> None:
        self._inner = inner
        self._store = store
        self._clock = clock
        self._contexts = contexts

    async def accept(self, item: InboundMessage | Skip, raw: bytes | None = None) -> Verdict:
        verdict = await self._inner.accept(item, raw)
        if verdict.accepted and isinstance(item, InboundMessage):
            await self._took(item, verdict)
        return verdict

    async def accept_many(
        self, events: Sequence[tuple[InboundMessage | Skip, bytes | None]]
    ) -> list[Verdict]:
        """:meth:`accept` for a ``getupdates`` page: the runtime takes every key and inbox
        entry in one store transaction (when it can), then the tokens and index entries
        are written, each sender's in order and the senders side by side, so that the
        store commits them together."""
        if not isinstance(self._inner, AcceptsMany):
            return [await self.accept(item, raw) for item, raw in events]
        verdicts = await self._inner.accept_many(events)
        by_sender: dict[str, list[tuple[InboundMessage, Verdict]]] = {}
        for (item, _), verdict in zip(events, verdicts, strict=True):
            if verdict.accepted and isinstance(item, InboundMessage):
                by_sender.setdefault(item.sender_id, []).append((item, verdict))
        if len(by_sender) == 1:
            [taken] = by_sender.values()
            await self._took_in_order(taken)
        elif by_sender:
            async with trio.open_nursery() as nursery:
                for taken in by_sender.values():
                    nursery.start_soon(self._took_in_order, taken)
        return verdicts

    async def _took_in_order(self, taken: list[tuple[InboundMessage, Verdict]]) -> None:
        for item, verdict in taken:
            await self._took(item, verdict)

    async def _took(self, item: InboundMessage, verdict: Verdict) -> None:
        """``item`` was accepted: keep its context token (when it became work and is the
        sender's newest) and record it in the message index."""
        route = item.route
        if verdict.reason is None and isinstance(route, protocol.Route) and route.context:
            try:
                await self._contexts.observe(item.sender_id, route.context, at=self._clock())
            except StoreError as exc:  # the turn's answer adopts it from its route
                log.warning("context_token_write_failed", error=str(exc))
        try:
            await record_inbound(self._store, item, self._clock())
        except StoreError as exc:  # the message is taken; only a later quote of it suffers
            log.warning("message_index_write_failed", error=str(exc))

    async def retract(self, conversation_id: str, message_id: str) -> RetractOutcome:
        return await self._inner.retract(conversation_id, message_id)

    async def substitute_control(
        self,
        action: Literal["stop", "disable"],
        conversation_id: str,
        thread_id: str | None,
        user_id: str,
    ) -> str:
        return await self._inner.substitute_control(action, conversation_id, thread_id, user_id)


async def record_inbound(store: ChannelStore, msg: InboundMessage, now: float) -> None:
    if msg.conversation_type != "direct":
        return
    extra = msg.route.extra_ids if isinstance(msg.route, protocol.Route) else ()
    entry = inbound_entry(msg, at=msg.received_at or now, extra_ids=extra)
    await store.record_outbound(msg.conversation_id, entry, now=now)


def media_secrets(raw: bytes) -> list[str]:
    """What unlocks a ``msgs`` entry's media — AES keys, signed CDN parameters and URLs,
    of its items and of the items it quotes — so that they are registered as secrets
    before the entry is accepted: no log record and no capture holds them (the inbox
    keeps the entry whole, a restart still downloads)."""
    # iLink writes these keys plainly; an entry without any is not decoded a second time.
    if b'"aes' not in raw and b"encrypt_query_param" not in raw and b"full_url" not in raw:
        return []
    try:
        msg = kit_decode.decode(m.MESSAGE_DECODER, raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return []
    found: list[str | None] = []
    items = list(msg.item_list)
    while items:
        item = items.pop()
        if item.image_item is not None:
            found.append(item.image_item.aeskey)
        for holder in (item.image_item, item.voice_item, item.file_item, item.video_item):
            media = holder.media if holder is not None else None
            if media is not None:
                found += [media.aes_key, media.encrypt_query_param, media.full_url]
        if item.ref_msg is not None and item.ref_msg.message_item is not None:
            items.append(item.ref_msg.message_item)
    return [v for v in found if v]


class UpdateSource:
    """WeChat's side of the kit's poll loop: ``getupdates`` from the cursor, mapped."""

    def __init__(
        self,
        client: IlinkClient,
        decode: Callable[[bytes], protocol.Mapped],
        outbound: WeixinOutbound,
        clock: Callable[[], float],
        register_secret: Callable[[str], None] = lambda s: None,
    ) -> None:
        self.client = client
        self.decode = decode
        self.outbound = outbound
        self.clock = clock
        self._register = register_secret
        self.window_s = protocol.POLL_WINDOW_S
        self._groups: OrderedDict[str, None] = OrderedDict()

    async def poll(self, cursor: str | None) -> PollBatch:
        batch = await self.client.get_updates(cursor, self.window_s)
        if batch.window_s is not None and batch.window_s != self.window_s:
            log.info("poll_window_adopted", window_s=batch.window_s)
            self.window_s = batch.window_s
        events: list[PollEvent] = []
        for raw in batch.raws:
            for secret in media_secrets(raw):
                self._register(secret)
            mapped = self.decode(raw)
            if mapped.group_id is not None:
                self._group_seen(mapped.group_id)
            elif mapped.user is not None:
                # The context token waits for the pipeline's verdict (IndexingInbound).
                await self.outbound.flush_ids(mapped.user)
            events.append(PollEvent(mapped.item, raw))
        # The cursor moves only with a non-empty one, once the whole batch is accepted.
        return PollBatch(events, cursor=batch.cursor, received=len(batch.raws))

    def _group_seen(self, group: str) -> None:
        if group in self._groups:
            return
        log.info("group_message_ignored", group=group, detail="iLink bots answer direct chats")
        self._groups[group] = None
        while len(self._groups) > GROUPS_LOGGED_MAX:
            self._groups.popitem(last=False)


async def run(
    host: BotHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Run one WeChat bot: authenticate, report started, long-poll until shutdown."""
    settings = host.settings_as(WeixinSettings)
    name = host.bot.name
    found = await credentials(settings, data_dir_of(host), name)
    if found is None:
        raise AuthError(f"no WeChat credentials: set token or run `dshim login {name}`")
    host.register_secret(found.token)
    rng = random.Random()
    async with open_http(found.api_base, user_agent=USER_AGENT, timeout=CALL_TIMEOUT) as http:
        client = IlinkClient(http, found.token, cdn_base=settings.cdn_base, rng=rng)
        try:
            await until_ok("notifystart", partial(announce, client))
        except protocol.SessionExpired as exc:
            raise AuthError(f"{exc}: {_login_hint(name)}", code=exc.code) from exc
        log.info("bot_authenticated", bot_id=found.bot_id, credentials=found.origin)
        store = host.store
        credential = protocol.credential_hash(found.token)
        if await store.get_cursor(CURSOR_OWNER) != credential:
            # Another login: the old cursor and context tokens belong to it.
            await store.set_cursor(CURSOR, "")
            await store.set_cursor(CURSOR_OWNER, credential)
        contexts = ContextBook(
            store, credential=credential, clock=host.clock, register_secret=host.register_secret
        )
        outbound = WeixinOutbound(
            client, contexts, store, clock=host.clock, rng=rng, register_secret=host.register_secret
        )
        loader_for = quote_loader(store, host.clock, bot_id=found.bot_id, bot_name=name)
        # The bot's answers are authored by its configured name (replay reads ``name``).
        host.capture_identity({"name": name})
        decode = mapper(
            bot_id=found.bot_id, clock=host.clock, fetcher_for=client.fetcher, loader_for=loader_for
        )
        try:
            async with host.open_runtime(
                outbound=outbound, bot_id=found.bot_id, decode_raw=lambda raw: decode(raw).item
            ) as rt:
                task_status.started()
                source = UpdateSource(
                    client, decode, outbound, host.clock, register_secret=host.register_secret
                )
                inbound = IndexingInbound(rt, store, host.clock, contexts)
                reader = partial(_poll, source, inbound, store, name)
                await host.serve(rt, reader)
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(NOTIFY_STOP_DEADLINE_S):
                try:
                    await client.notify_stop()
                except ChannelError as exc:
                    log.info("notify_stop_failed", error=str(exc))


async def announce(client: IlinkClient) -> None:
    """``msg/notifystart``: proves the token (``-14``, 401/403 are fatal) and waits out
    transient failures; any other refusal (a server without the call) is only logged —
    the first poll proves the token then."""
    try:
        await client.notify_start()
    except (AuthError, TransportError, RateLimited, PermissionDenied):
        raise
    except ChannelError as exc:
        log.warning("notify_start_failed", error=str(exc))


async def _poll(
    source: UpdateSource, inbound: IndexingInbound, store: ChannelStore, name: str
) -> None:
    try:
        await run_poll_loop(source, inbound, store, cursor_name=CURSOR, backoff=IlinkBackoff())
    except protocol.SessionExpired as exc:
        raise AuthError(f"{exc}: {_login_hint(name)}", code=exc.code) from exc


# --- login ----------------------------------------------------------------------------------


async def login(ctx: LoginContext) -> int:
    """``dshim login BOT``: the QR flow (see :mod:`dshim.channels.weixin.login`)."""
    settings = ctx.settings_as(WeixinSettings)
    return await run_login(ctx, api_base=settings.api_base, cdn_base=settings.cdn_base)


# --- replay ---------------------------------------------------------------------------------


class ReplayAdapter(ReceivesEvents):
    """Decodes fixture events (WeixinMessage objects) with the real mapping code.

    Each accepted-to-be message is recorded in the fixture's message index right before
    it is handed to the pipeline (``received``), as :class:`IndexingInbound` does."""

    def __init__(self, fx: ReplaySource) -> None:
        if not fx.bot_id:
            raise FixtureError('weixin fixtures need "bot": {"id": "<ilink_bot_id>"}')
        self.bot_id = fx.bot_id
        self.bot_username = fx.bot_username
        self._store = fx.store
        self._clock = fx.clock or (lambda: 0.0)
        # A capture names the bot as the live one does (its configured ``name``); a
        # hand-written fixture by its ``username``.
        name = fx.bot_info.get("name") or fx.bot_username
        loader_for = (
            quote_loader(
                fx.store, self._now, bot_id=fx.bot_id, bot_name=str(name) if name else None
            )
            if fx.store is not None
            else None
        )
        self._decode = mapper(
            bot_id=fx.bot_id, clock=self._now, fetcher_for=None, loader_for=loader_for
        )

    def _now(self) -> float:
        return self._clock()

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        return self._decode(raw).item

    async def received(self, item: InboundMessage | Skip, raw: bytes | None) -> None:
        if self._store is not None and isinstance(item, InboundMessage) and item.addressed:
            existing = await self._store.indexed(
                item.conversation_id, item.message_id, now=self._clock()
            )
            if not existing:
                await record_inbound(self._store, item, self._clock())

    #: The chunks an answer is delivered in (the renderer's own split).
    split = staticmethod(split)


# --- probe ----------------------------------------------------------------------------------


async def probe(rows: ProbeRows) -> None:
    """``dshim probe`` rows: credentials, a token check that reads no updates, store,
    and ``--send-test`` with the user's stored context token."""
    settings = rows.settings_as(WeixinSettings)
    name = rows.bot.name
    try:
        found = await credentials(settings, data_dir_of(rows), name)
    except AuthError as exc:
        rows.add("credentials", "fail", str(exc))
        return
    if found is None:
        rows.add(
            "credentials",
            "fail",
            f"no token in the config and no saved login: run `dshim login {name}`",
        )
        return
    rows.register_secret(found.token)
    async with open_http(found.api_base, user_agent=USER_AGENT, timeout=CALL_TIMEOUT) as http:
        client = IlinkClient(http, found.token, cdn_base=settings.cdn_base)
        credential = protocol.credential_hash(found.token)
        contexts = ContextBook(
            rows.store, credential=credential, clock=time.time, register_secret=rows.register_secret
        )

        async def identity() -> Identity:
            user = await rows.store.last_direct() or found.owner
            try:
                if user:
                    ctx = await contexts.get(user)
                    await client.get_typing_ticket(user, ctx.token.token if ctx else None)
                else:
                    await client.notify_start()
            except protocol.SessionExpired as exc:
                raise AuthError(f"session expired (-14): {_login_hint(name)}") from exc
            return Identity(name=name, id=found.bot_id)

        async def context() -> tuple[ProbeResult, str]:
            user = await rows.store.last_direct()
            if user is None:
                return "warn", "no direct chat yet: a user must write to the bot first"
            ctx = await contexts.get(user)
            if ctx is None:
                return "warn", "no context token stored for the last direct user"
            return "ok", "context token stored for the last direct user"

        async def send_test(conversation_id: str) -> str:
            ctx = await contexts.get(conversation_id)
            if ctx is None:
                raise ChannelError(
                    "no context token stored for the last direct user: they must write first"
                )
            outbound = WeixinOutbound(client, contexts, rows.store, clock=time.time)
            sent = await outbound.deliver(conversation_id, TEST_MESSAGE)
            return sent[0].message_id if sent else ""

        await rows.standard(
            credentials=f"{found.origin} (bot {found.bot_id})",
            identity=identity,
            checks=[Check("context token", context)],
            send_test=send_test,
        )


#: key, settings, run, replay adapter, probe, login (see ChannelSpec).
CHANNEL = ChannelSpec("weixin", WeixinSettings, run, ReplayAdapter, probe, login)

__all__ = ["CHANNEL", "WeixinSettings"]
