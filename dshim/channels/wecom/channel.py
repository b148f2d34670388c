"""The WeCom AI-bot channel: a bot's nursery, the replay adapter and the probe.

``run`` opens the long connection and subscribes (the credential check: a rejected
``bot_id``/``secret`` is fatal, once), opens the bot's pipeline, counts as started and then
hands every callback, in arrival order, to the pipeline with the frame exactly as received
(the durable inbox decodes it again after a restart).  The connection (:mod:`.client`)
lives in the bot's nursery *around* the pipeline: answers still running at shutdown keep
their socket until they are done.  Events are handled here: ``enter_chat`` gets the
optional welcome (``[bots.welcome] text``, within 5 s), a ``template_card_event`` of one of
our cards updates the card (within 5 s) and reaches the pipeline as the typed answer its
button stands for; ``disconnected_event`` stops the bot without a reconnect.  Jobs that
wait for acks (welcome, card updates) run in a worker task, never in the reader: acks are
read by the same socket reader.  Only AuthError, FatalChannelError and ConfigError escape
``run``.
"""

from __future__ import annotations

import random as _random
import time
import urllib.parse
from dataclasses import dataclass

import httpx
import structlog
import trio

from dshim.channels.base import (
    BotHost,
    ChannelSettings,
    ChannelSpec,
    Check,
    Identity,
    OutboundEntry,
    ProbeResult,
    ProbeRows,
    ReplaySource,
    Secret,
)
from dshim.channels.wecom import media
from dshim.channels.wecom import models as m
from dshim.channels.wecom import protocol as p
from dshim.channels.wecom.client import (
    DOWNLOAD_TIMEOUT,
    USER_AGENT,
    LinkTuning,
    WecomLink,
    download,
)
from dshim.channels.wecom.render import RenderTuning, WecomOutbound, split
from dshim.errors import (
    ChannelError,
    FatalChannelError,
    TooLarge,
    TransportError,
    single_error,
)
from dshim.model import Fetcher, InboundMessage, Skip
from dshim.net.http import default_ssl_context, open_http

log = structlog.get_logger("dshim.wecom")

#: Welcome texts and card updates waiting for the worker (beyond: dropped, logged).
JOBS_MAX = 64
#: Welcome and card updates must reach WeCom within 5 s of their event.
EVENT_REPLY_S = 5.0
TEST_TEXT = "✅ dshim connection test: the WeCom bot {name} can send messages here."
PROBE_TIMEOUT_S = 15.0
TAKEN_OVER = (
    "subscribed, then another connection took the bot over (a running dshim serve or SDK "
    "process?): WeCom keeps one live connection per bot"
)


class WelcomeSettings(ChannelSettings):
    """``[bots.welcome]``: the text sent when a user opens the single chat."""

    #: The welcome text (at most 20480 UTF-8 bytes).
    text: str


class WecomSettings(ChannelSettings):
    """The ``[[bots]]`` keys of a WeCom AI bot (long-connection API mode)."""

    #: The bot's id (aibotid) from the admin console.
    bot_id: str
    #: The bot's secret (write ``"${WECOM_BOT_SECRET}"``).
    secret: Secret
    #: The long-connection URL (private deployments, the fake in tests).
    ws_url: str = p.DEFAULT_WS_URL
    #: An optional welcome for ``enter_chat`` (off by default).
    welcome: WelcomeSettings | None = None

    def __post_init__(self) -> None:
        self.bot_id = self.bot_id.strip()
        if not self.bot_id or any(c.isspace() for c in self.bot_id):
            raise ValueError("bot_id: empty or contains spaces")
        if not self.secret.get().strip():
            raise ValueError("secret: empty")
        if not self.ws_url.startswith(("ws://", "wss://")):
            raise ValueError(f"ws_url: expected a ws:// or wss:// URL, got {self.ws_url!r}")
        if self.welcome is not None:
            # Checked here, not in the nested struct: the loader names this path.
            if not self.welcome.text.strip():
                raise ValueError("welcome: its text is empty")
            if p.utf8_len(self.welcome.text) > p.CONTENT_MAX_BYTES:
                raise ValueError(f"welcome: its text is over {p.CONTENT_MAX_BYTES} UTF-8 bytes")


def media_factory(http: httpx.AsyncClient) -> p.MediaFactory:
    """Download-and-decrypt handles for current attachments (fetched when the turn starts)."""

    def make(kind: str, item: m.Media) -> Fetcher | None:
        url, aeskey = item.url, item.aeskey
        if not url.startswith(("http://", "https://")) or not aeskey:
            return None

        async def fetch(max_bytes: int) -> bytes:
            key = media.media_key(aeskey)
            data = media.decrypt(await download(http, url, max_bytes), key)
            if len(data) > max_bytes:
                raise TooLarge(f"wecom media: over the {max_bytes} byte limit")
            return data

        return fetch

    return make


@dataclass(frozen=True, slots=True)
class _Job:
    """A frame to send for an event (within 5 s), and what to record of it."""

    cmd: str
    req_id: str
    body: dict[str, object]
    conversation: str
    text: str
    at: float  # trio time of the event


class _Events:
    """The channel's side of event callbacks (see the module docstring)."""

    def __init__(
        self,
        host: BotHost,
        outbound: WecomOutbound,
        jobs: trio.MemorySendChannel[_Job],
        welcome: str | None,
        mapper: p.Mapper,
    ) -> None:
        self.mapper = mapper
        self.host = host
        self.outbound = outbound
        self.jobs = jobs
        self.welcome = welcome

    def _queue(self, job: _Job) -> None:
        try:
            self.jobs.send_nowait(job)
        except trio.WouldBlock:
            log.warning("event_reply_dropped", cmd=job.cmd, reason="too many waiting")

    def on_event(
        self, ev: p.ChatEvent, body: m.Body, item: InboundMessage | Skip
    ) -> InboundMessage | Skip:
        """Side effects of one event; returns what the pipeline gets (``item``, or the
        answer a click on a waiting card stands for)."""
        now = trio.current_time()
        if ev.kind == "enter_chat":
            if self.welcome is not None:
                self._queue(
                    _Job(
                        p.RESPOND_WELCOME,
                        ev.req_id,
                        p.welcome_body(self.welcome),
                        ev.conversation_id,
                        self.welcome,
                        now,
                    )
                )
            return item
        if ev.kind != "template_card_event" or not ev.task_id:
            log.info("event_ignored", eventtype=ev.kind[:40])
            return item
        item = self.mapper.card_answer(ev, body)
        pending = self.outbound.card(ev.task_id)
        if pending is None or pending.conversation != ev.conversation_id:
            if isinstance(item, InboundMessage):
                card = p.decided_card(ev.task_id, "dshim", "This request no longer waits")
                self._queue(
                    _Job(p.RESPOND_UPDATE, ev.req_id, p.update_card_body(card), "", "", now)
                )
            return Skip(reason="ignored", detail="card of no waiting request", message_id=ev.msgid)
        if isinstance(item, InboundMessage):
            index = int(item.content) - 1
            label = (
                str(pending.options[index].label)
                if 0 <= index < len(pending.options)
                else item.content
            )
            card = p.decided_card(ev.task_id, pending.title, f"Chosen: {label}")
            self._queue(
                _Job(
                    p.RESPOND_UPDATE,
                    ev.req_id,
                    p.update_card_body(card),  # for everyone who sees the card
                    "",
                    "",
                    now,
                )
            )
        return item

    async def work(self, jobs: trio.MemoryReceiveChannel[_Job]) -> None:
        """Send each job's frame, unless its 5 s are already over."""
        async for job in jobs:
            left = job.at + EVENT_REPLY_S - trio.current_time()
            if left <= 0:
                log.warning("event_reply_skipped", reason="past its 5 s", cmd=job.cmd)
                continue
            sent_at = self.host.clock()
            try:
                with trio.fail_after(left):
                    await self.outbound.link.request(job.cmd, job.req_id, job.body, what=job.cmd)
            except (ChannelError, trio.TooSlowError) as exc:
                log.warning("event_reply_failed", cmd=job.cmd, error=str(exc)[:200])
                continue
            if job.text:
                entry = OutboundEntry(
                    message_ids=[job.req_id],
                    text=job.text,
                    sent_at=sent_at,
                    completed_at=self.host.clock(),
                )
                await self.host.store.record_outbound(job.conversation, entry, now=sent_at)


async def run(
    host: BotHost,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    tuning: LinkTuning | None = None,
    render_tuning: RenderTuning | None = None,
    rng: _random.Random | None = None,
) -> None:
    """Run one WeCom bot until cancelled, or until a fatal error (raised)."""
    settings = host.settings_as(WecomSettings)
    host.register_secret(settings.secret.get())
    rng = rng or _random.Random()
    async with open_http(user_agent=USER_AGENT, timeout=DOWNLOAD_TIMEOUT) as http:
        link = WecomLink(
            settings.ws_url, settings.bot_id, settings.secret.get(), rng=rng, tuning=tuning
        )
        outbound = WecomOutbound(link, clock=host.clock, tuning=render_tuning)
        mapper = p.Mapper(settings.bot_id, media=media_factory(http))
        callbacks_in, callbacks = trio.open_memory_channel[p.Callback](0)
        jobs_in, jobs = trio.open_memory_channel[_Job](JOBS_MAX)
        events = _Events(
            host, outbound, jobs_in, settings.welcome.text if settings.welcome else None, mapper
        )
        with single_error():
            async with trio.open_nursery() as nursery:
                await nursery.start(link.run, callbacks_in)  # subscribed: authenticated
                nursery.start_soon(events.work, jobs)
                async with host.open_runtime(
                    outbound=outbound, bot_id=settings.bot_id, decode_raw=mapper.decode_frame
                ) as rt:
                    task_status.started()

                    async def reader() -> None:
                        async for cb in callbacks:
                            item = mapper.decode_frame(cb.raw)
                            if cb.cmd == p.EVENT_CALLBACK:
                                decoded = p.decode_body(cb.raw)
                                if isinstance(decoded, tuple):
                                    ev = p.map_event(*decoded)
                                    if isinstance(ev, p.ChatEvent):
                                        item = events.on_event(ev, decoded[1], item)
                            # The stored copy carries no signed URL or key.
                            await rt.accept(item, p.scrub(cb.raw))

                    await host.serve(rt, reader)
                nursery.cancel_scope.cancel()


class WecomReplayAdapter:
    """Decodes fixture frames with the real mapping (no lookups exist on WeCom)."""

    def __init__(self, fx: ReplaySource) -> None:
        self.bot_id = fx.bot_id or "wecom-bot"
        self.bot_username: str | None = fx.bot_username
        self._mapper = p.Mapper(self.bot_id, removed=None)

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        return self._mapper.decode_frame(raw)

    #: The chunks an answer is delivered in (the stream's part, then the pushes).
    split = staticmethod(split)


# --- probe -----------------------------------------------------------------------------------


async def _reach(url: str) -> None:
    """One TCP connection to the long connection's host (and its TLS handshake for
    ``wss://``), closed at once; TransportError (caused by the network's error) when it
    fails.  The link retries a failed connection for as long as it runs, as serve needs:
    the probe fails here at once instead, and can say why (DNS, refused, TLS)."""
    parts = urllib.parse.urlsplit(url)
    secure = parts.scheme == "wss"
    host = parts.hostname or ""
    try:
        stream = await trio.open_tcp_stream(host, parts.port or (443 if secure else 80))
        async with stream:
            if secure:
                tls = trio.SSLStream(
                    stream, default_ssl_context(), server_hostname=host, https_compatible=True
                )
                await tls.do_handshake()
    except (OSError, trio.BrokenResourceError) as exc:
        raise TransportError(
            f"long connection: cannot connect ({type(exc).__name__})", request_sent=False
        ) from exc


async def _probe_connection(settings: WecomSettings) -> tuple[ProbeResult, str]:
    """Reach the host, connect, subscribe (AuthError when rejected), one ping and its ack,
    close."""
    await _reach(settings.ws_url)
    tuning = LinkTuning(connect_wait_s=5.0)
    link = WecomLink(settings.ws_url, settings.bot_id, settings.secret.get(), tuning=tuning)
    callbacks_in, _callbacks = trio.open_memory_channel[p.Callback](16)
    t0 = time.perf_counter()
    try:
        with single_error():
            async with trio.open_nursery() as nursery:
                await nursery.start(link.run, callbacks_in)
                ms = (time.perf_counter() - t0) * 1000
                await link.request(p.PING, link.new_req_id(p.PING), None, what="ping")
                nursery.cancel_scope.cancel()
    except (p.ConnectionLost, FatalChannelError):
        return "warn", TAKEN_OVER
    except BaseExceptionGroup as group:  # the reader's end and the ping's, together
        _, rest = group.split((p.ConnectionLost, FatalChannelError))
        if rest is not None:
            raise
        return "warn", TAKEN_OVER
    return "ok", (
        f"subscribed in {ms:.0f} ms, ping acknowledged, closed (connecting evicts another "
        "live connection of this bot: a running dshim serve stops and must be restarted)"
    )


async def probe(rows: ProbeRows) -> None:
    """Credentials, connect + subscribe + ping, store, ``--send-test`` by push."""
    settings = rows.settings_as(WecomSettings)
    rows.register_secret(settings.secret.get())
    connected: list[tuple[ProbeResult, str]] = []

    async def identity() -> Identity:
        # WeCom has no identity call: the subscribe is the credential check.
        connected.append(await _probe_connection(settings))
        return Identity(name=rows.bot.name, id=settings.bot_id)

    async def connection() -> tuple[ProbeResult, str]:
        return connected[-1]

    async def send_test(conversation_id: str) -> str:
        link = WecomLink(settings.ws_url, settings.bot_id, settings.secret.get())
        callbacks_in, _callbacks = trio.open_memory_channel[p.Callback](16)
        req_id = link.new_req_id(p.SEND)
        with single_error():
            async with trio.open_nursery() as nursery:
                await nursery.start(link.run, callbacks_in)
                text = TEST_TEXT.format(name=rows.bot.name)
                await link.request(
                    p.SEND, req_id, p.push_markdown_body(conversation_id, text), what="push"
                )
                nursery.cancel_scope.cancel()
        return req_id

    await rows.standard(
        credentials=f"bot_id {settings.bot_id} and secret present",
        identity=identity,
        checks=[Check("long connection", connection, timeout_s=PROBE_TIMEOUT_S)],
        send_test=send_test,
    )


#: key, settings, run, replay adapter, probe (see ChannelSpec).
CHANNEL = ChannelSpec("wecom", WecomSettings, run, WecomReplayAdapter, probe)
"""Tests bind timings: ``replace(CHANNEL, run_fn=partial(run, tuning=..., rng=...))``."""

__all__ = ["CHANNEL", "WecomSettings"]
