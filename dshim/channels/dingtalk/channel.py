"""The DingTalk channel: a bot's run loop, the replay adapter and the probe.

``run`` gets an access token first (network failures, 5xx and 429 are retried with the
kit's backoff; rejected app credentials are fatal), opens the pipeline, counts as
started and keeps the Stream connection (:func:`.client.run_stream`).  Every robot
callback is acked as soon as it is decoded (see :mod:`.protocol`), mapped, and handed in
arrival order to the pipeline with the callback's ``data`` as its raw bytes (the inbox
decodes it again after a restart).  An accepted message is recorded in the message
index (DingTalk quotes carry no content for many kinds and there is no fetch-by-id API).
Only AuthError, FatalChannelError and ConfigError escape ``run``.

``serve --capture``: the inbox's copy of a message (its ``sessionWebhook`` blanked) is what
the capture records, so no session webhook reaches a capture; access tokens are
registered as secrets when minted; the capture's ``bot`` gets the robot code and the
robot's user id (what :class:`DingTalkReplayAdapter` reads), and an answer shown in an
AI card, which ``finish`` does not return (the card keeps its own index entry), is told
to the capture as the ``send`` replay prints for it (:class:`CapturedOutbound`).
"""

from __future__ import annotations

import random as _random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Literal

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
    WatchesDelivery,
)
from dshim.channels.dingtalk import models as m
from dshim.channels.dingtalk.client import (
    DEFAULT_API_BASE,
    DEFAULT_OAPI_BASE,
    HTTP_TIMEOUT,
    USER_AGENT,
    WS_OPTIONS,
    DingTalkApi,
    next_connection_url,
    run_stream,
)
from dshim.channels.dingtalk.protocol import (
    MessageMapper,
    RobotCallback,
    Route,
    StreamSession,
    without_webhook,
)
from dshim.channels.dingtalk.render import (
    DEFAULT_CARD_TEMPLATE,
    CardStream,
    DingTalkOutbound,
    split,
)
from dshim.channels.kit import Backoff
from dshim.channels.kit.decode import decode
from dshim.channels.kit.index import inbound_entry
from dshim.channels.kit.retry import until_ok
from dshim.errors import AuthError, PermissionDenied
from dshim.model import Delivered, Fetcher, InboundMessage, ReplyTarget, Skip
from dshim.net.http import open_http
from dshim.net.ws import Connected, connect_once

log = structlog.get_logger("dshim.dingtalk")

PROBE_READY_TIMEOUT_S = 15.0
PROBE_PING_WAIT_S = 8.0
TEST_TEXT = "✅ dshim connection test: the DingTalk bot {name} can send messages here."


class DingTalkSettings(ChannelSettings):
    """The ``[[bots]]`` keys of a DingTalk bot (an internal app with the robot feature)."""

    #: The app's Client ID (AppKey).
    client_id: str
    #: The app's Client Secret (AppSecret); write ``"${DINGTALK_CLIENT_SECRET}"``.
    client_secret: Secret
    #: The robot code (internal apps: the Client ID, the default).
    robot_code: str | None = None
    #: The OpenAPI host, also for the Stream-mode registration (the fake in tests).
    api_base: str = DEFAULT_API_BASE
    #: The oapi host: a message's session webhook is only posted to when it points here.
    oapi_base: str = DEFAULT_OAPI_BASE
    #: The streaming AI-card template (default: DingTalk's public AI-card template).
    card_template_id: str = DEFAULT_CARD_TEMPLATE
    #: ``card``: streamed AI cards (markdown when cards fail); ``markdown``: markdown only.
    answer: Literal["card", "markdown"] = "card"

    def __post_init__(self) -> None:
        self.client_id = self.client_id.strip()
        if not self.client_id or any(c.isspace() for c in self.client_id):
            raise ValueError("client_id: not a DingTalk Client ID (empty or contains spaces)")
        secret = self.client_secret.get().strip()
        if not secret or any(c.isspace() for c in secret):
            raise ValueError("client_secret: empty or contains spaces")
        self.client_secret = Secret(secret)
        if self.robot_code is not None:
            self.robot_code = self.robot_code.strip() or None
        for key in ("api_base", "oapi_base"):
            value = getattr(self, key)
            if not value.startswith(("http://", "https://")):
                raise ValueError(f"{key}: expected an http:// or https:// URL, got {value!r}")
            setattr(self, key, value.rstrip("/"))
        if not self.card_template_id.strip():
            raise ValueError("card_template_id: empty")

    @property
    def robot(self) -> str:
        return self.robot_code or self.client_id


def media_factory(api: DingTalkApi) -> Callable[[str], Fetcher | None]:
    """Download handles for a message's pictures and files (fetched inside the turn)."""

    def make(download_code: str) -> Fetcher | None:
        async def fetch(max_bytes: int) -> bytes:
            return await api.download(download_code, max_bytes)

        return fetch

    return make


def _api(
    http: httpx.AsyncClient, settings: DingTalkSettings, register: Callable[[str], None]
) -> DingTalkApi:
    return DingTalkApi(
        http,
        client_id=settings.client_id,
        client_secret=settings.client_secret.get(),
        robot_code=settings.robot,
        api_base=settings.api_base,
        oapi_base=settings.oapi_base,
        on_new_token=register,
    )


def _outbound(
    api: DingTalkApi, settings: DingTalkSettings, store: ChannelStore, clock: Callable[[], float]
) -> DingTalkOutbound:
    return DingTalkOutbound(
        api,
        store=store,
        clock=clock,
        answer=settings.answer,
        card_template_id=settings.card_template_id,
    )


#: What is told of an answer a card showed: (target, its text, the card's outTrackId).
CardReport = Callable[[ReplyTarget, str, str], None]


class _ReportedStream(WatchesDelivery):
    """A card stream that reports its final text when the card showed it (``finish``
    returned nothing: no message for the pipeline's index)."""

    def __init__(self, stream: CardStream, target: ReplyTarget, report: CardReport) -> None:
        self._stream = stream
        self._target = target
        self._report = report

    def watch_delivery(self, hook: Callable[[], Awaitable[None]]) -> None:
        self._stream.watch_delivery(hook)

    async def update(self, text: str) -> None:
        await self._stream.update(text)

    async def progress(self, note: str) -> None:
        await self._stream.progress(note)

    async def finish(self, text: str) -> list[Delivered]:
        sent = await self._stream.finish(text)
        if not sent and self._stream.track_id is not None and text.strip():
            self._report(self._target, text, self._stream.track_id)
        return sent


class CapturedOutbound:
    """The bot's :class:`DingTalkOutbound`, telling ``report`` of every answer an AI card
    showed (a streamed one, or the outbox's delivery into a card left open), which the
    pipeline never gets as a delivered message.  Used only when capture is on."""

    def __init__(self, outbound: DingTalkOutbound, report: CardReport) -> None:
        self._outbound = outbound
        self._report = report
        self.bot_username = outbound.bot_username

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        sent = await self._outbound.send_text(target, text)
        if not sent and text.strip():  # it finished a card an earlier attempt left open
            self._report(target, text, "")
        return sent

    @asynccontextmanager
    async def open_stream(self, target: ReplyTarget) -> AsyncIterator[_ReportedStream]:
        async with self._outbound.open_stream(target) as stream:
            yield _ReportedStream(stream, target, self._report)


def chatbot_user_id(raw: bytes) -> str | None:
    """The robot's own user id a robot message names (``chatbotUserId``), if readable."""
    try:
        msg = decode(m.message_decoder, raw)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeError):
        return None
    return msg.chatbotUserId or None


def card_reporter(host: BotHost) -> CardReport:
    """Tell ``serve --capture`` of an answer a card showed, as one delivered message."""

    def report(target: ReplyTarget, text: str, track_id: str) -> None:
        now = host.clock()
        host.capture_sent(
            target, [Delivered(message_id=track_id, text=text, sent_at=now, completed_at=now)]
        )

    return report


async def record_inbound(store: ChannelStore, item: InboundMessage, now: float) -> None:
    """Index an accepted user message (a later quote of it carries only its id)."""
    await store.record_outbound(
        item.conversation_id, inbound_entry(item, at=item.received_at or now), now=now
    )


async def run(
    host: BotHost,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    rng: _random.Random | None = None,
    handover_close_s: float = 10.0,
) -> None:
    """Run one DingTalk bot until cancelled, or until a fatal error (raised)."""
    settings = host.settings_as(DingTalkSettings)
    rng = rng or _random.Random()
    async with open_http(user_agent=USER_AGENT, timeout=HTTP_TIMEOUT) as http:
        api = _api(http, settings, host.register_secret)
        await until_ok("POST /v1.0/oauth2/accessToken", api.token.get, backoff=Backoff(rng=rng))
        robot = settings.robot
        log.info("bot_authenticated", robot_code=robot)
        host.capture_identity({"robot_code": robot})  # what DingTalkReplayAdapter reads
        mapper = MessageMapper(bot_id=robot, robot_code=robot, media=media_factory(api))
        cards = _outbound(api, settings, host.store, host.clock)
        outbound = CapturedOutbound(cards, card_reporter(host)) if host.capturing else cards
        bot_user: list[str] = []
        async with host.open_runtime(
            outbound=outbound, bot_id=robot, decode_raw=mapper.decode_raw
        ) as rt:
            task_status.started()

            async def deliver(callback: RobotCallback) -> Verdict | None:
                item = mapper.decode_raw(callback.data)
                if not bot_user and host.capturing:
                    # The robot's user id comes with every message, never at start.
                    if (user := chatbot_user_id(callback.data)) is not None:
                        bot_user.append(user)
                        host.capture_identity({"chatbot_user_id": user})
                # The inbox keeps the message without its session webhook (a signed URL).
                verdict = await rt.accept(item, without_webhook(callback.data))
                if verdict.accepted and isinstance(item, InboundMessage):
                    await record_inbound(host.store, item, host.clock())
                return verdict

            async def watch_auth() -> None:
                await api.auth_failed.wait()
                raise AuthError("DingTalk rejected the app credentials: stopping the bot")

            async def reader() -> None:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(watch_auth)
                    await run_stream(
                        api, deliver, backoff=Backoff(rng=rng), handover_close_s=handover_close_s
                    )

            await host.serve(rt, reader)


class DingTalkReplayAdapter(ReceivesEvents):
    """Decodes fixture events (robot messages as in a callback's ``data``) with the real
    mapping; accepted messages go to the replay store's message index like in ``run``."""

    def __init__(self, fx: ReplaySource) -> None:
        robot = fx.bot_info.get("robot_code")
        user = fx.bot_info.get("chatbot_user_id")
        robot_code = str(robot) if robot else None
        self.bot_id = robot_code or (fx.bot_id if fx.bot_id is not None else "dingtalk-robot")
        self.bot_username = fx.bot_username
        self._mapper = MessageMapper(
            bot_id=self.bot_id,
            robot_code=self.bot_id,
            chatbot_user_id=str(user) if user else None,
        )
        self._store = fx.store
        self._clock = fx.clock
        self._seen: set[str] = set()

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        return self._mapper.decode_raw(raw)

    async def received(self, item: InboundMessage | Skip, raw: bytes | None) -> None:
        if not isinstance(item, InboundMessage) or self._store is None or self._clock is None:
            return
        if item.message_id in self._seen or not item.addressed:
            return
        self._seen.add(item.message_id)
        await record_inbound(self._store, item, self._clock())

    split = staticmethod(split)


# --- probe -----------------------------------------------------------------------------------


async def _last_direct_user(store: ChannelStore, conversation_id: str, now: float) -> str | None:
    """The staff id of the user of a direct chat (from its indexed messages)."""
    for entry in await store.outbound(conversation_id, now=now):
        if entry.inbound and entry.author_id:
            return entry.author_id
    return None


async def probe(rows: ProbeRows) -> None:
    """Token, Stream registration + connect + first ping, card permission, store, send."""
    settings = rows.settings_as(DingTalkSettings)
    async with open_http(user_agent=USER_AGENT, timeout=HTTP_TIMEOUT) as http:
        api = _api(http, settings, rows.register_secret)

        async def identity() -> Identity:
            await api.token.get()
            return Identity(name=rows.bot.name, id=settings.robot)

        async def stream() -> tuple[ProbeResult, str]:
            t0 = time.perf_counter()
            url = await next_connection_url(api, backoff=Backoff(max_s=2.0))
            pinged = trio.Event()
            session = StreamSession(on_ping=pinged.set)
            reached: list[Connected] = []

            async def ignore(event: object) -> None:
                return None

            async with trio.open_nursery() as nursery:

                async def connect() -> None:
                    await connect_once(
                        url, session, ignore, options=WS_OPTIONS, on_connected=reached.append
                    )

                nursery.start_soon(connect)
                with trio.move_on_after(PROBE_PING_WAIT_S):
                    await pinged.wait()
                    await trio.sleep(0.2)  # the ack leaves right after the ping is read
                nursery.cancel_scope.cancel()
            ms = (time.perf_counter() - t0) * 1000
            if not reached:
                return "fail", "the Stream websocket did not open"
            if not pinged.is_set():
                return (
                    "warn",
                    f"connected in {ms:.0f} ms; no SYSTEM ping within {PROBE_PING_WAIT_S:.0f} s",
                )
            return "ok", f"registered, connected, first ping answered in {ms:.0f} ms; closed"

        async def cards() -> tuple[ProbeResult, str]:
            if settings.answer != "card":
                return "ok", "answer = markdown (cards not used)"
            try:
                await api.create_card(f"dshim-probe-{int(time.time())}", settings.card_template_id)
            except PermissionDenied as exc:
                return "warn", (
                    f"card instances not permitted ({exc.code or exc.status}): answers fall back "
                    "to markdown; enable Card.Instance.Write and Card.Streaming.Write"
                )
            return "ok", "AI card instance created (not delivered)"

        async def send_test(conversation_id: str) -> str:
            now = time.time()
            staff = await _last_direct_user(rows.store, conversation_id, now)
            route = Route(
                msg_id="",
                conversation_id=conversation_id,
                direct=True,
                staff_id=staff or conversation_id,
            )
            outbound = _outbound(api, settings, rows.store, time.time)
            target = ReplyTarget(conversation_id=conversation_id, route=route)
            text = TEST_TEXT.format(name=rows.bot.name)
            if settings.answer != "card":
                sent = await outbound.send_text(target, text)
                return sent[0].message_id if sent else "?"
            # The way answers go: an AI card (markdown when the card cannot be used).
            async with outbound.open_stream(target) as stream:
                sent = await stream.finish(text)
            return stream.track_id or (sent[0].message_id if sent else "?")

        await rows.standard(
            credentials=f"client_id {settings.client_id}, robot_code {settings.robot}",
            identity=identity,
            checks=[
                Check("stream", stream, timeout_s=PROBE_READY_TIMEOUT_S + 5),
                Check("card permission", cards),
            ],
            send_test=send_test,
        )


#: key, settings, run, replay adapter, probe (see ChannelSpec).
CHANNEL = ChannelSpec("dingtalk", DingTalkSettings, run, DingTalkReplayAdapter, probe)

__all__ = ["CHANNEL", "DingTalkSettings"]
