"""The Feishu / Lark channel: a bot's run loop, the replay adapter and the probe checks.

``run`` mints a tenant_access_token and reads the bot's identity (``bot/v3/info``: its
open_id, which mentions are compared with) -- transient failures retried with the kit's
backoff, rejected credentials fatal -- opens the pipeline, counts as started, then keeps
the long connection (see :mod:`.protocol`).  Each complete event is decoded by
:class:`~.protocol.EventMapper`: messages and card clicks go to ``accept`` with the event
JSON as received (the inbox decodes it again after a restart) and are acked once
accepted; a recall goes to ``retract`` (never a turn), a control notice's button to
``substitute_control`` (acked with the result as a toast).  Substitute targets given by
email or union_id are resolved to open_ids before the start (:func:`startup_targets`,
bounded, never fatal) and handed to the pipeline; a hand-typed open_id of another app is
a warning then, as in the probe.  Only AuthError, FatalChannelError and
ConfigError escape ``run``.
"""

from __future__ import annotations

import random as _random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Literal

import structlog
import trio

from dshim.channels.base import (
    BotConfig,
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
    Verdict,
)
from dshim.channels.feishu import models as m
from dshim.channels.feishu.client import (
    DOMAINS,
    HTTP_TIMEOUT,
    USER_AGENT,
    RestClient,
    next_ws_url,
    run_connection,
)
from dshim.channels.feishu.contact import Directory, Resolution, needs_lookup, resolve_targets
from dshim.channels.feishu.protocol import (
    CARD_TOAST,
    MISSING_SCOPE,
    ControlPress,
    EventMapper,
    FeishuEvent,
    FeishuSession,
    LookupFactory,
    Media,
    MediaFactory,
    Recall,
    fetched_reference,
    lookup_failure,
)
from dshim.channels.feishu.render import FeishuOutbound, split, text_content, uuid_for
from dshim.channels.kit import Backoff
from dshim.channels.kit.retry import until_ok
from dshim.errors import ChannelError
from dshim.model import Fetcher, InboundMessage, Loader, ReplyReference, Skip
from dshim.net.http import open_http
from dshim.net.ws import Connected, connect_once

log = structlog.get_logger("dshim.feishu")

PROBE_READY_TIMEOUT_S = 15.0
#: Start-up resolution of substitute targets (email / union_id) gives up after this.
RESOLVE_TIMEOUT_S = 10.0
GROUP_MESSAGES_WARNING = 'substitute triggers need group_messages = "all" (im:message.group_msg)'
#: A probe row's text per line reason (see :mod:`.contact`).
REASON_TEXT = {
    "cross_app_open_id": "the open_id belongs to another app: use the email or the union_id",
    "not_visible": "outside the app's contact visibility: widen it, or use the email",
    "unresolvable": "no such user: check the id or the email",
    "resolve_failed": (
        "the lookup failed (network, or contact:user.id:readonly / "
        "contact:user.base:readonly missing): not a verdict on the target"
    ),
}
TEST_TEXT = "✅ dshim connection test: the Feishu bot {name} can send messages here."
#: A syntactically valid message id that exists nowhere (the probe's scope check).
PROBE_MESSAGE_ID = "om_dshimprobe00000000000000000000"


class FeishuSettings(ChannelSettings):
    """The ``[[bots]]`` keys of a Feishu / Lark bot."""

    #: The app's App ID (``cli_...``), from the developer console's credentials page.
    app_id: str
    #: The App Secret (write ``"${FEISHU_APP_SECRET}"``).
    app_secret: Secret
    #: ``feishu`` (open.feishu.cn) or ``lark`` (open.larksuite.com).
    domain: Literal["feishu", "lark"] = "feishu"
    #: Overrides the domain's API base URL (the fake in tests).
    api_base: str | None = None
    #: ``mentions``: groups reach the bot when it is @-mentioned; ``all`` needs the
    #: ``im:message.group_msg`` scope (every group message arrives; only mentions address).
    group_messages: Literal["mentions", "all"] = "mentions"

    def __post_init__(self) -> None:
        self.app_id = self.app_id.strip()
        if not self.app_id or any(c.isspace() for c in self.app_id):
            raise ValueError("app_id: not a Feishu App ID (empty or contains spaces)")
        secret = self.app_secret.get().strip()
        if not secret or any(c.isspace() for c in secret):
            raise ValueError("app_secret: not a Feishu App Secret (empty or contains spaces)")
        self.app_secret = Secret(secret)
        if self.api_base is not None:
            if not self.api_base.startswith(("http://", "https://")):
                raise ValueError(
                    f"api_base: expected an http:// or https:// URL, got {self.api_base!r}"
                )
            self.api_base = self.api_base.rstrip("/")

    @property
    def base(self) -> str:
        return self.api_base or DOMAINS[self.domain]


def lookup_factory(
    rest: RestClient,
    store: ChannelStore | None,
    clock: Callable[[], float],
    bot: m.BotInfo,
) -> LookupFactory:
    """Loaders for quotes: the outbound index first (the bot's own answers, including
    streaming cards), else one ``GET messages/{id}`` checked against the current chat."""

    def make(chat_id: str, message_id: str) -> Loader:
        async def load() -> ReplyReference | None:
            if store is not None:
                entries = await store.outbound(chat_id, now=clock())
                hits = [e for e in entries if message_id in e.message_ids]
                if hits:
                    best = max(hits, key=lambda e: e.completed_at)
                    return ReplyReference(
                        message_id=message_id,
                        author_id=bot.open_id,
                        author_name=bot.app_name or None,
                        content=best.text,
                    )
            try:
                answer = await rest.get_message(message_id)
            except ChannelError as exc:
                log.info("reply_lookup_failed", message_id=message_id, error=str(exc)[:200])
                return lookup_failure(exc)
            return fetched_reference(
                answer,
                chat_id=chat_id,
                message_id=message_id,
                app_id=rest.app_id,
                bot_open_id=bot.open_id,
                bot_name=bot.app_name,
            )

        return load

    return make


def media_factory(rest: RestClient) -> MediaFactory:
    """Download handles for the current message's resources (run inside the turn)."""

    def make(message_id: str, media: Media) -> Fetcher | None:
        async def fetch(max_bytes: int) -> bytes:
            return await rest.download(message_id, media.key, media.kind, max_bytes)

        return fetch

    return make


async def run(
    host: BotHost,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    rng: _random.Random | None = None,
) -> None:
    """Run one Feishu bot until cancelled, or until a fatal error (raised)."""
    settings = host.settings_as(FeishuSettings)
    rng = rng or _random.Random()
    async with _open_rest(settings, host.register_secret) as rest:
        info = await until_ok("GET bot/v3/info", rest.bot_info, backoff=Backoff(rng=rng))
        log.info("bot_authenticated", bot_user=info.app_name, bot_id=info.open_id)
        # What FeishuReplayAdapter reads from a fixture's bot (serve --capture).
        host.capture_identity(
            {"open_id": info.open_id, "app_id": settings.app_id, "name": info.app_name}
        )
        targets = await startup_targets(rest, host.bot)
        outbound = FeishuOutbound(rest, host.store, host.clock)
        mapper = EventMapper(
            bot_open_id=info.open_id,
            app_id=settings.app_id,
            lookup=lookup_factory(rest, host.store, host.clock, info),
            media=media_factory(rest),
        )
        session = FeishuSession(random=rng.random)

        async with host.open_runtime(
            outbound=outbound,
            bot_id=info.open_id,
            decode_raw=mapper.decode_raw,
            substitute_targets=targets,
        ) as rt:
            task_status.started()

            async def deliver(event: FeishuEvent) -> Verdict | None:
                item = mapper.decode(event.payload)
                data: bytes | None = None
                if isinstance(item, Recall):
                    outcome = await rt.retract(item.conversation_id, item.message_id)
                    log.info("message_recalled", message_id=item.message_id, outcome=outcome)
                    verdict = None
                elif isinstance(item, ControlPress):
                    shown = await rt.substitute_control(
                        item.action, item.conversation_id, item.thread_id, item.user_id
                    )
                    # The toast answers the click at once; the card keeps the result.
                    toast = {"toast": {"type": "info", "content": shown[:200]}}
                    session.acknowledge(event, trio.current_time(), data=m.encode(toast))
                    await outbound.show_control_result(item, shown)
                    return None
                else:
                    if isinstance(item, InboundMessage) and item.message_id.startswith("card:"):
                        if isinstance(item.route, str):
                            outbound.clicked(item.route, item.content)
                        data = m.encode(CARD_TOAST)  # the card callback's answer
                    verdict = await rt.accept(item, event.payload)
                if verdict is None or verdict.confirm:
                    session.acknowledge(event, trio.current_time(), data=data)
                return verdict

            async def reader() -> None:
                await run_connection(
                    session,
                    rest,
                    deliver,
                    backoff=Backoff(rng=rng),
                    register_secret=host.register_secret,
                )

            await host.serve(rt, reader)


async def startup_targets(rest: RestClient, bot: BotConfig) -> list[SubstituteTarget] | None:
    """The substitute targets matching uses: those given by email or union_id resolved
    to open_ids (bounded by :data:`RESOLVE_TIMEOUT_S`, never fatal; None: nothing to
    resolve, the configured ones apply).  An unresolvable target is logged and dropped.

    Hand-typed open_ids get the probe's check as well: one that belongs to another app
    (a Feishu open_id is per app, so it never matches a mention here) is a warning naming
    the bot and the key path; the target stays as configured (its other ids may match),
    and any other outcome of that check (a lookup failure included) says nothing."""
    sub = bot.substitute
    typed = any(t.open_id is not None for t in sub.targets)
    lookup = needs_lookup(sub.targets)
    if not sub.enabled or not (typed or lookup):
        return None
    found: list[Resolution] | None = None
    with trio.move_on_after(RESOLVE_TIMEOUT_S):
        found = await resolve_targets(Directory(rest), sub.targets, check_open_ids=typed)
    if found is None:
        if not lookup:  # only the typed open_ids' check ran out of time: they apply as typed
            log.info("substitute_open_ids_unchecked", reason="resolve_failed", timeout=True)
            return None
        log.warning("substitute_targets_unresolved", reason="resolve_failed", timeout=True)
        return [t for t in sub.targets if t.ids()]
    out: list[SubstituteTarget] = []
    for index, r in enumerate(found):
        if r.configured.open_id is not None:
            if r.reason == "cross_app_open_id":
                log.warning(
                    "substitute_target_cross_app",
                    bot=bot.name,
                    key=f"substitute.targets[{index}].open_id",
                    target=r.label,
                    reason=r.reason,
                    hint=REASON_TEXT[r.reason],
                )
            out.append(r.configured)  # as typed: matched as is, as without the check
            continue
        if r.reason is not None:
            log.warning(
                "substitute_target_unresolved",
                target=r.label,
                reason=r.reason,
                dropped=r.target is None,
            )
        if r.target is not None:
            out.append(r.target)
    return out if lookup else None


@asynccontextmanager
async def _open_rest(
    settings: FeishuSettings, register: Callable[[str], None]
) -> AsyncIterator[RestClient]:
    """The bot's HTTP client and its RestClient (minted tokens registered as secrets)."""
    async with open_http(settings.base, user_agent=USER_AGENT, timeout=HTTP_TIMEOUT) as http:
        yield RestClient(
            http,
            app_id=settings.app_id,
            app_secret=settings.app_secret.get(),
            api_base=settings.base,
            on_new_token=register,
        )


class FeishuReplayAdapter:
    """Decodes fixture events with the real mapping; lookups go through ``fx.http``."""

    def __init__(self, fx: ReplaySource) -> None:
        bot = fx.bot_info
        open_id = str(bot.get("open_id") or fx.bot_id or "")
        if not open_id:
            raise FixtureError("feishu fixtures need bot.open_id (the bot's ou_... id)")
        app_id = str(bot.get("app_id") or "cli_replay")
        self.bot_id = open_id
        self.bot_username = None
        info = m.BotInfo(open_id=open_id, app_name=str(bot.get("name") or ""))
        rest = RestClient(
            fx.http,
            app_id=app_id,
            app_secret="replay",
            api_base=fx.api_base,
            fixed_token="t-replay",
        )
        clock = fx.clock or time.time
        self._mapper = EventMapper(
            bot_open_id=open_id,
            app_id=app_id,
            lookup=lookup_factory(rest, fx.store, clock, info),
        )

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        return self._mapper.decode_raw(raw)

    #: The chunks an answer is delivered in (the renderer's own split).
    split = staticmethod(split)


# --- probe -----------------------------------------------------------------------------------


async def probe(rows: ProbeRows) -> None:
    """Token, bot info, the long connection up to its first pong, scopes, store, send test."""
    settings = rows.settings_as(FeishuSettings)
    async with _open_rest(settings, rows.register_secret) as rest:
        found: list[m.BotInfo] = []

        async def identity() -> Identity:
            await rest.token.get()
            info = await rest.bot_info()
            found.append(info)
            return Identity(name=info.app_name or "?", id=info.open_id)

        async def connection() -> tuple[ProbeResult, str]:
            session = FeishuSession(random=_random.random)
            t0 = time.perf_counter()
            url = await next_ws_url(
                session, rest, backoff=Backoff(), register_secret=rows.register_secret
            )
            reached: list[Connected] = []

            async def ignore(event: FeishuEvent) -> None:
                return None

            ended = await connect_once(
                url, session, ignore, on_connected=reached.append, stop_when_connected=True
            )
            if not reached:
                return "fail", f"no pong from the long connection (close code {ended.code})"
            ms = (time.perf_counter() - t0) * 1000
            return "ok", f"endpoint, connect and first pong in {ms:.0f} ms, closed cleanly"

        async def lookup_scope() -> tuple[ProbeResult, str]:
            try:
                await rest.get_message(PROBE_MESSAGE_ID)
            except ChannelError as exc:
                if exc.code == MISSING_SCOPE:
                    return "warn", (
                        "message lookups are not permitted: enable im:message or "
                        "im:message:readonly (quotes degrade to permission-denied)"
                    )
                return "ok", f"message lookups permitted (unknown id: code {exc.code})"
            return "ok", "message lookups permitted"

        async def cardkit_scope() -> tuple[ProbeResult, str]:
            try:
                await rest.card_settings(
                    "probe_card_that_does_not_exist", "{}", sequence=1, uuid=uuid_for("probe")
                )
            except ChannelError as exc:
                if exc.code == MISSING_SCOPE:
                    return "warn", "cardkit:card:write missing: answers fall back to text"
                return "ok", "cardkit:card:write granted (streaming cards)"
            return "ok", "cardkit:card:write granted (streaming cards)"

        async def group_scope() -> tuple[ProbeResult, str]:
            # The group-message scope has no side-effect-free check of its own: a lookup
            # of a group message without it answers 99991672 as well.
            try:
                await rest.call(
                    "GET",
                    "/open-apis/im/v1/messages",
                    params={"container_id_type": "chat", "container_id": "oc_dshimprobe"},
                    what="GET im/v1/messages",
                )
            except ChannelError as exc:
                if exc.code == MISSING_SCOPE:
                    return "warn", (
                        "im:message.group_msg missing: quotes in groups degrade to "
                        "permission-denied"
                    )
            return "ok", "im:message.group_msg granted (group quotes can be looked up)"

        async def send_test(conversation_id: str) -> str:
            name = found[0].app_name if found else rows.bot.name
            return await rest.create(
                conversation_id,
                "text",
                text_content(TEST_TEXT.format(name=name)),
                uuid=uuid_for("probe", conversation_id, str(time.time())),
            )

        checks = [
            Check("long connection", connection, timeout_s=PROBE_READY_TIMEOUT_S),
            Check("message lookup", lookup_scope),
            Check("cardkit scope", cardkit_scope),
            Check("group messages scope", group_scope),
        ]
        sub = rows.bot.substitute
        if sub.enabled:
            checks.append(Check("substitute: group messages", partial(_group_messages, settings)))
            resolved = _Resolutions(Directory(rest), sub.targets)
            for index, target in enumerate(sub.targets):
                label = f"substitute target {target.name or target.prompt_id()}"
                checks.append(Check(label, partial(resolved.row, index)))
        await rows.standard(
            credentials=f"app_id {settings.app_id}, app_secret present",
            identity=identity,
            checks=checks,
            send_test=send_test,
        )


async def _group_messages(settings: FeishuSettings) -> tuple[ProbeResult, str]:
    if settings.group_messages == "all":
        return "ok", (
            'group_messages = "all": group messages that only mention a target arrive '
            "(needs im:message.group_msg)"
        )
    return "warn", GROUP_MESSAGES_WARNING


class _Resolutions:
    """The probe's target rows: every target resolved once (typed open_ids checked too)."""

    def __init__(self, directory: Directory, targets: list[SubstituteTarget]) -> None:
        self.directory = directory
        self.targets = targets
        self.found: list[Resolution] | None = None

    async def row(self, index: int) -> tuple[ProbeResult, str]:
        if self.found is None:
            self.found = await resolve_targets(self.directory, self.targets, check_open_ids=True)
        r = self.found[index]
        if r.reason is not None:
            kept = "" if r.target is None else " (kept: it still matches by its other ids)"
            return "warn", f"{r.reason}: {REASON_TEXT[r.reason]}{kept}"
        target = r.target or r.configured
        profile = r.profile
        if target.open_id is None:
            return "ok", f"user_id {target.user_id}: matched as is (no name lookup)"
        if profile is None or profile.outcome != "ok":
            return "ok", f"open_id {target.open_id} (no profile: name as configured)"
        avatar = f", avatar {profile.avatar_url}" if profile.avatar_url else ""
        return "ok", f"{profile.name} (open_id {target.open_id}{avatar})"


#: key, settings, run, replay adapter, probe (see ChannelSpec).
CHANNEL = ChannelSpec("feishu", FeishuSettings, run, FeishuReplayAdapter, probe)
"""Tests bind jitter: ``replace(CHANNEL, run_fn=partial(run, rng=...))``."""

__all__ = ["CHANNEL", "FeishuSettings"]
