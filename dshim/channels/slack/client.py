"""Thin trio I/O for Slack: the Web API client and the Socket Mode runner.

Web API
-------
``POST {api_base}/<method>`` with ``Authorization: Bearer <token>`` and a JSON body (the
bot token for everything, the app token only for ``apps.connections.open``); lookups
(``conversations.history`` / ``.replies``) are ``GET`` with query parameters.  Slack
answers errors as HTTP 200 ``{"ok": false, "error": ...}``, mapped once by
:func:`~.protocol.classify_error`; only rate limiting is HTTP 429.  A 429 pauses *that
method* for ``Retry-After`` seconds (other methods are unaffected) and is retried within
``max_wait_s``; beyond it the caller gets :class:`~dshim.errors.RateLimited`.  An
``invalid_auth`` for the bot token sets :attr:`WebClient.auth_failed` (the channel stops
the bot).  Tokens are sent only to ``api_base`` (and file downloads to Slack's file
hosts) and never appear in an error or a log.

Socket Mode
-----------
:class:`SocketRunner` keeps one live connection, each driven by a sans-IO
:class:`~.protocol.SocketSession`: a fresh URL from ``apps.connections.open`` per
connection; one reader (envelopes acknowledged before they are delivered), one timer
(hello and liveness watchdogs, own pings).  A :class:`~.protocol.Handover` opens the
next connection while the current one still delivers; the old one is closed once the
new one said hello (or after the grace).  Deliveries of all connections are serialized,
so the pipeline sees one envelope at a time, in the order they were read.  Failed
connections back off (1-30 s with jitter); ``too_many_websockets`` waits at least 30 s.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import httpx
import msgspec
import structlog
import trio
from trio_websocket import ConnectionClosed, HandshakeError, WebSocketConnection

from dshim import __version__
from dshim.channels.kit import Backoff
from dshim.channels.kit.decode import decode
from dshim.channels.slack import models as m
from dshim.channels.slack.protocol import (
    Handover,
    Incoming,
    Ping,
    SocketAction,
    SocketSession,
    SocketTuning,
    classify_error,
)
from dshim.errors import AuthError, ChannelError, RateLimited, RemoteProtocolError
from dshim.model import Verdict
from dshim.net.http import counted, download_capped, parse_retry_after, status_error
from dshim.net.ws import WsOptions, open_client_websocket
from dshim.net.ws_session import Close, Connected, Deliver, Ignored, Send, WsEnded

log = structlog.get_logger("dshim.slack")

#: Acked envelopes waiting for the pipeline at most (beyond it the reader waits).
PENDING_MAX = 10_000

DEFAULT_API_BASE = "https://slack.com/api"
USER_AGENT = f"dshim/{__version__} (+https://github.com/dshim/dshim)"
HTTP_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
#: Hosts ``url_private_download`` may point to (besides ``api_base``'s own host).
FILE_HOSTS = frozenset({"files.slack.com", "files-edge.slack.com", "slack-files.com"})
#: When Slack gives no Retry-After with a 429.
DEFAULT_RETRY_AFTER_S = 30.0
WS_OPTIONS = WsOptions()

T = TypeVar("T")


class WebClient:
    """The Slack Web API on a shared ``httpx.AsyncClient`` (see the module docstring)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        bot_token: str,
        app_token: str | None = None,
        api_base: str = DEFAULT_API_BASE,
        clock: Callable[[], float] = trio.current_time,
        max_wait_s: float = 60.0,
        max_retries: int = 3,
    ) -> None:
        self._http = http
        self._bot = bot_token
        self._app = app_token
        self.api_base = api_base.rstrip("/")
        self._api_host = (urllib.parse.urlsplit(self.api_base).hostname or "").lower()
        self._clock = clock
        self.max_wait_s = max_wait_s
        self.max_retries = max_retries
        #: method -> trio time until which Slack asked us not to call it (429).
        self.blocked_until: dict[str, float] = {}
        #: Set when Slack rejected the bot token.
        self.auth_failed = trio.Event()
        #: The ``x-oauth-scopes`` header of the last ``auth.test``.
        self.scopes_header: str | None = None

    def __repr__(self) -> str:
        return f"WebClient(api_base={self.api_base!r})"

    # -- the request loop -----------------------------------------------------------

    async def call(
        self,
        method: str,
        decoder: msgspec.json.Decoder[T],
        *,
        body: dict[str, Any] | None = None,
        query: dict[str, str] | None = None,
        app: bool = False,
        retries: int | None = None,
        max_wait_s: float | None = None,
    ) -> T:
        """One Web API call: waits out this method's 429 pause, retries 429s, maps errors."""
        token = self._app if app else self._bot
        if token is None:
            raise AuthError(f"{method}: no token configured")
        headers = {"Authorization": f"Bearer {token}", "User-Agent": USER_AGENT}
        content: bytes | None = None
        if body is not None:
            content = m.encode(body)
            headers["Content-Type"] = "application/json; charset=utf-8"
        url = f"{self.api_base}/{method}"
        if query:
            url += "?" + urllib.parse.urlencode(query)
        limit = self.max_wait_s if max_wait_s is None else max_wait_s
        attempts = self.max_retries if retries is None else retries
        for attempt in range(attempts + 1):
            wait = self.blocked_until.get(method, 0.0) - self._clock()
            if wait > 0:
                if wait > limit:
                    raise RateLimited(f"{method}: rate limited for {wait:.1f} s", retry_after=wait)
                await trio.sleep(wait)
            verb = "POST" if body is not None or not query else "GET"
            resp = await counted(
                method, self._http.request(verb, url, content=content, headers=headers)
            )
            if resp.status_code == 429:
                retry_after = parse_retry_after(resp.headers)
                if retry_after is None:
                    retry_after = DEFAULT_RETRY_AFTER_S
                self.blocked_until[method] = self._clock() + retry_after
                log.info("rate_limited", method=method, retry_after=round(retry_after, 3))
                if attempt >= attempts or retry_after > limit:
                    raise RateLimited(f"{method}: HTTP 429", retry_after=retry_after)
                continue
            if resp.status_code != 200:
                raise status_error(resp.status_code, method, headers=resp.headers)
            if method == "auth.test":
                self.scopes_header = resp.headers.get("x-oauth-scopes")
            try:
                answer = decode(decoder, resp.content)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise RemoteProtocolError(f"{method}: unexpected response") from exc
            ok = getattr(answer, "ok", False)
            if not ok:
                error = getattr(answer, "error", None)
                failure = classify_error(method, error)
                if isinstance(failure, AuthError) and not app:
                    self.auth_failed.set()
                if isinstance(failure, RateLimited):  # chat.postMessage's "rate_limited"
                    retry_after = parse_retry_after(resp.headers) or 1.0
                    self.blocked_until[method] = self._clock() + retry_after
                    if attempt < attempts and retry_after <= limit:
                        continue
                    raise RateLimited(str(failure), retry_after=retry_after, code=failure.code)
                raise failure
            return answer
        raise AssertionError("unreachable")  # pragma: no cover

    # -- methods ----------------------------------------------------------------------

    async def auth_test(self) -> m.AuthTest:
        """``auth.test``: team, bot user, bot id; keeps the ``x-oauth-scopes`` header."""
        return await self.call("auth.test", m.auth_test_decoder, body={})

    async def connections_open(self) -> str:
        """``apps.connections.open`` (app token): a fresh Socket Mode URL."""
        got = await self.call(
            "apps.connections.open", m.connections_open_decoder, body={}, app=True, retries=0
        )
        if not got.url or not got.url.startswith(("ws://", "wss://")):
            raise RemoteProtocolError("apps.connections.open: no websocket URL")
        return got.url

    async def post_message(
        self,
        channel: str,
        *,
        thread_ts: str | None,
        markdown: str | None = None,
        text: str | None = None,
        blocks: list[Any] | None = None,
        retries: int | None = None,
        unfurl: bool = False,
    ) -> m.Posted:
        """``chat.postMessage`` into a thread, no unfurls (``unfurl``: links unfurl, so
        a message permalink shows the quoted message), no ``link_names``."""
        body: dict[str, Any] = {"channel": channel, "unfurl_links": unfurl, "unfurl_media": False}
        if thread_ts is not None:
            body["thread_ts"] = thread_ts
        body.update(_content(markdown, text, blocks))
        return await self.call("chat.postMessage", m.posted_decoder, body=body, retries=retries)

    async def update(
        self,
        channel: str,
        ts: str,
        *,
        markdown: str | None = None,
        text: str | None = None,
        blocks: list[Any] | None = None,
        retries: int | None = None,
    ) -> m.Posted:
        """``chat.update``; ``parse``/``link_names`` are sent (else Slack resets them)."""
        body: dict[str, Any] = {"channel": channel, "ts": ts}
        body.update(_content(markdown, text, blocks))
        return await self.call("chat.update", m.posted_decoder, body=body, retries=retries)

    async def start_stream(
        self,
        channel: str,
        thread_ts: str,
        *,
        user: str | None,
        team: str | None,
        markdown: str | None = None,
    ) -> m.Posted:
        """``chat.startStream`` in the thread, for the recipient of the answer."""
        body: dict[str, Any] = {"channel": channel, "thread_ts": thread_ts}
        if user is not None:
            body["recipient_user_id"] = user
        if team is not None:
            body["recipient_team_id"] = team
        if markdown:
            body["markdown_text"] = markdown
        return await self.call("chat.startStream", m.posted_decoder, body=body, retries=1)

    async def append_stream(self, channel: str, ts: str, markdown: str) -> m.Posted:
        """``chat.appendStream``: ``markdown`` is appended (at most 12,000 characters)."""
        body = {"channel": channel, "ts": ts, "markdown_text": markdown}
        return await self.call("chat.appendStream", m.posted_decoder, body=body, retries=1)

    async def stop_stream(self, channel: str, ts: str, markdown: str | None = None) -> m.Posted:
        """``chat.stopStream`` (optionally with the last piece of text)."""
        body: dict[str, Any] = {"channel": channel, "ts": ts}
        if markdown:
            body["markdown_text"] = markdown
        return await self.call("chat.stopStream", m.posted_decoder, body=body, retries=1)

    async def set_status(self, channel: str, thread_ts: str, status: str) -> None:
        """``assistant.threads.setStatus`` ("is thinking…"); cleared when the app posts."""
        body = {"channel_id": channel, "thread_ts": thread_ts, "status": status}
        await self.call("assistant.threads.setStatus", m.answer_decoder, body=body, retries=0)

    async def history_message(
        self, channel: str, ts: str, *, max_wait_s: float = 10.0
    ) -> m.Event | None:
        """The top-level message ``ts`` via ``conversations.history`` (None: not there)."""
        got = await self.call(
            "conversations.history",
            m.history_decoder,
            query={"channel": channel, "latest": ts, "inclusive": "true", "limit": "1"},
            retries=1,
            max_wait_s=max_wait_s,
        )
        return next((e for e in got.messages if e.ts == ts), None)

    async def thread_message(
        self, channel: str, thread_ts: str, ts: str, *, max_wait_s: float = 10.0
    ) -> m.Event | None:
        """The message ``ts`` of thread ``thread_ts`` via ``conversations.replies``."""
        got = await self.call(
            "conversations.replies",
            m.history_decoder,
            query={
                "channel": channel,
                "ts": thread_ts,
                "latest": ts,
                "oldest": ts,
                "inclusive": "true",
                "limit": "1",
            },
            retries=1,
            max_wait_s=max_wait_s,
        )
        return next((e for e in got.messages if e.ts == ts), None)

    async def user_info(self, user: str) -> m.UserObject:
        """``users.info`` (``users:read``): one user."""
        got = await self.call(
            "users.info", m.user_info_decoder, query={"user": user}, retries=1, max_wait_s=10.0
        )
        if got.user is None:
            raise RemoteProtocolError("users.info: no user in the answer")
        return got.user

    async def open_dm(self, user: str) -> str:
        """``conversations.open`` (``im:write``): the DM channel id with ``user``."""
        got = await self.call(
            "conversations.open", m.conversations_open_decoder, body={"users": user}, retries=1
        )
        if got.channel is None or not got.channel.id:
            raise RemoteProtocolError("conversations.open: no channel in the answer")
        return got.channel.id

    async def download(self, url: str, max_bytes: int) -> bytes:
        """A file (``url_private_download``) with the bot token, at most ``max_bytes``."""
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower()
        if host != self._api_host and parts.scheme != "https":
            raise ChannelError("refusing to download a file over plain http")
        return await download_capped(
            self._http,
            url,
            max_bytes,
            allowed_hosts=FILE_HOSTS | {self._api_host},
            headers={"Authorization": f"Bearer {self._bot}", "User-Agent": USER_AGENT},
            what="file download",
        )


def _content(markdown: str | None, text: str | None, blocks: list[Any] | None) -> dict[str, Any]:
    """A message's content arguments: ``markdown_text`` (which takes no ``blocks``), or
    mrkdwn ``text`` with ``parse: none`` and ``link_names: false`` (``chat.update`` resets
    both when they are omitted) and the ``blocks``."""
    if markdown is not None:
        return {"markdown_text": markdown}
    body: dict[str, Any] = {"text": text or "", "parse": "none", "link_names": False}
    if blocks is not None:
        body["blocks"] = blocks
    return body


# --- Socket Mode -----------------------------------------------------------------------------


#: The channel's side: hand one envelope to the pipeline.
Deliverer = Callable[[Incoming], Awaitable[Verdict | None]]


@dataclass(eq=False)
class _Conn:
    """One connection's lifecycle, as the runner watches it."""

    session: SocketSession
    ready: trio.Event = field(default_factory=trio.Event)
    ended: trio.Event = field(default_factory=trio.Event)
    handover: trio.Event = field(default_factory=trio.Event)
    close_requested: trio.Event = field(default_factory=trio.Event)
    result: WsEnded | None = None
    connected_at: float | None = None
    delivering: bool = False
    rearm: trio.Event = field(default_factory=trio.Event)
    #: The time the timer task sleeps until (None: no timer).
    armed: float | None = None

    def reschedule(self) -> None:
        """Wake the timer task when the session's next timer moved earlier."""
        timer = self.session.next_timer()
        if timer is not None and (self.armed is None or timer < self.armed):
            self.rearm.set()


async def _first(*events: trio.Event) -> None:
    """Return once any of ``events`` is set."""
    if any(e.is_set() for e in events):
        return
    async with trio.open_nursery() as nursery:

        async def wait(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        for event in events:
            nursery.start_soon(wait, event)


class SocketRunner:
    """Keeps Socket Mode connected (see the module docstring)."""

    def __init__(
        self,
        web: WebClient,
        deliver: Deliverer,
        *,
        app_id: str | None = None,
        tuning: SocketTuning | None = None,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = trio.current_time,
        options: WsOptions = WS_OPTIONS,
        on_connected: Callable[[SocketSession], None] | None = None,
    ) -> None:
        self.web = web
        self.deliver = deliver
        self.app_id = app_id
        self.tuning = tuning or SocketTuning()
        self.backoff = backoff or Backoff()
        self.clock = clock
        self.options = options
        self.on_connected = on_connected
        self._delivery = trio.Lock()
        # Acked envelopes wait here for the one delivering task: the reader acks the next
        # envelope at once even while the pipeline takes the previous ones (a burst must
        # not push acks past Slack's 3 s); order is read order, across handovers too.
        self._pending_send, self._pending = trio.open_memory_channel[Any](PENDING_MAX)
        #: Connections opened so far (for tests and the probe).
        self.connections = 0

    async def run(self) -> NoReturn:
        """Forever: connect, hand over on refresh, reconnect.  Raises fatal errors."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._deliverer)
            current = await self._start(nursery)
            while True:
                await _first(current.ended, current.handover)
                if current.handover.is_set() and not current.ended.is_set():
                    nxt = await self._start(nursery)
                    with trio.move_on_after(self.tuning.handover_grace_s):
                        await _first(nxt.ready, nxt.ended)
                    log.info("ws_handed_over", ready=nxt.ready.is_set())
                    current.close_requested.set()
                    current = nxt
                    continue
                await self._after(current)
                current = await self._start(nursery)

    async def _deliverer(self) -> None:
        """Hand the acked envelopes to the pipeline, one at a time, in read order."""
        async for conn, event in self._pending:
            async with self._delivery:
                conn.delivering = True
                try:
                    await self.deliver(event)
                finally:
                    conn.delivering = False

    async def _after(self, conn: _Conn) -> None:
        """A connection ended: raise for fatal ends, else wait as the backoff says."""
        ended = conn.result or WsEnded(None)
        log.info(
            "ws_disconnected",
            code=ended.code,
            by_us=ended.by_us,
            reason=conn.session.disconnect_reason,
            connected_s=None if ended.connected_for is None else round(ended.connected_for, 3),
        )
        conn.session.connection_lost(ended, self.clock())
        floor = conn.session.backoff_at_least
        if floor == 0 and ended.connected_for is not None:
            if ended.connected_for >= self.options.stable_after_s:
                self.backoff.reset()
                return
        delay = max(floor, self.backoff.next_delay())
        log.info("reconnect_delayed", retry_in_s=round(delay, 2), failures=self.backoff.failures)
        await trio.sleep(delay)

    async def _next_url(self) -> str:
        """``apps.connections.open`` until it answers; AuthError is fatal."""
        while True:
            try:
                return await self.web.connections_open()
            except AuthError as exc:
                raise AuthError(
                    f"Slack rejected the app token (apps.connections.open: {exc.code})",
                    code=exc.code,
                ) from exc
            except ChannelError as exc:
                retry_after = exc.retry_after if isinstance(exc, RateLimited) else None
                delay = self.backoff.next_delay(retry_after=retry_after)
                log.warning("ws_url_failed", error=str(exc), retry_in_s=round(delay, 2))
                await trio.sleep(delay)

    async def _start(self, nursery: trio.Nursery) -> _Conn:
        url = await self._next_url()
        conn = _Conn(SocketSession(app_id=self.app_id, tuning=self.tuning))
        self.connections += 1
        nursery.start_soon(self._connection, url, conn)
        return conn

    # -- one connection ---------------------------------------------------------------

    async def _connection(self, url: str, conn: _Conn) -> None:
        code: int | None = None
        by_us = False
        try:
            log.info("ws_connecting", url=_loggable(url))
            async with open_client_websocket(url, self.options) as (ws, _):
                for action in conn.session.connection_opened(self.clock()):
                    await self._perform(ws, conn, action, None)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._timers, ws, conn, nursery)
                    nursery.start_soon(self._closer, ws, conn)
                    code, by_us = await self._read(ws, conn, nursery)
                    nursery.cancel_scope.cancel()
        except (
            ConnectionClosed,
            HandshakeError,
            OSError,
            trio.BrokenResourceError,
            trio.TooSlowError,
        ) as exc:
            log.warning("ws_connection_failed", error=type(exc).__name__)
        finally:
            connected_for = None
            if conn.connected_at is not None:
                connected_for = max(0.0, self.clock() - conn.connected_at)
            conn.result = WsEnded(code, by_us=by_us, connected_for=connected_for)
            conn.ended.set()

    async def _read(
        self, ws: WebSocketConnection, conn: _Conn, nursery: trio.Nursery
    ) -> tuple[int | None, bool]:
        session = conn.session
        while True:
            try:
                data = await ws.get_message()
            except ConnectionClosed as exc:
                return (int(exc.reason.code) if exc.reason else None), False
            for action in session.receive(data, self.clock()):
                if await self._perform(ws, conn, action, nursery):
                    return RECONNECT_CODE, True
            conn.reschedule()  # frames only move the watchdog later, except the hello

    async def _perform(
        self,
        ws: WebSocketConnection,
        conn: _Conn,
        action: SocketAction,
        nursery: trio.Nursery | None,
    ) -> bool:
        """Do one action; True when this side closed the connection."""
        if isinstance(action, Deliver):
            if action.ack is not None:
                await self._send(ws, action.ack)  # at once: Slack redelivers after 3 s
            try:
                self._pending_send.send_nowait((conn, action.event))
            except trio.WouldBlock:  # a flood: the reader waits (and is not judged dead)
                conn.delivering = True
                try:
                    await self._pending_send.send((conn, action.event))
                finally:
                    conn.delivering = False
            return False
        if isinstance(action, Send):
            await self._send(ws, action)
            return False
        if isinstance(action, Close):
            log.info("ws_closing", code=action.code, reason=action.reason)
            with trio.move_on_after(self.options.close_wait_s):
                await ws.aclose(action.code, action.reason)
            return True
        if isinstance(action, Connected):
            if self.app_id is None:  # hello's connection_info.app_id: who we are
                self.app_id = conn.session.app_id
            conn.connected_at = self.clock()
            conn.ready.set()
            log.info("ws_connected", session=action.session)
            if self.on_connected is not None:
                self.on_connected(conn.session)
            return False
        if isinstance(action, Handover):
            log.info("ws_refresh_requested", reason=action.reason)
            conn.handover.set()
            return False
        if isinstance(action, Ping):
            if nursery is not None:
                nursery.start_soon(self._ping, ws, conn)
            return False
        if isinstance(action, Ignored):
            log.warning("frame_dropped", reason=action.reason, detail=action.detail)
            return False
        raise AssertionError(f"unknown action {action!r}")

    async def _send(self, ws: WebSocketConnection, action: Send) -> None:
        try:
            await ws.send_message(action.data)
        except ConnectionClosed:
            return  # the reader sees the close
        if action.logged:
            log.info("frame_sent", kind=action.kind)

    async def _ping(self, ws: WebSocketConnection, conn: _Conn) -> None:
        try:
            await ws.ping()
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            return
        conn.session.pong(self.clock())
        conn.reschedule()

    async def _timers(self, ws: WebSocketConnection, conn: _Conn, nursery: trio.Nursery) -> None:
        session = conn.session
        while True:
            conn.armed = timer = session.next_timer()
            conn.rearm = trio.Event()
            if timer is None:
                await conn.rearm.wait()
                continue
            with trio.move_on_at(timer):
                await conn.rearm.wait()
                continue  # an earlier timer: sleep again
            if session.next_timer() != timer:
                continue  # the timer moved later meanwhile (frames, pongs)
            for action in session.tick(self.clock(), reading=not conn.delivering):
                if await self._perform(ws, conn, action, nursery):
                    return  # closed: the reader sees it and ends

    async def _closer(self, ws: WebSocketConnection, conn: _Conn) -> None:
        """Close this connection when the runner replaced it (handover)."""
        await conn.close_requested.wait()
        await self._perform(ws, conn, conn.session.close_for_handover(), None)


RECONNECT_CODE = 4000


def _loggable(url: str) -> str:
    """A Socket Mode URL without its query (the ticket)."""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, parts.path, "", ""))
