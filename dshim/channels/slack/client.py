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
:func:`run_socket_mode` keeps Socket Mode connected on the kit's websocket runner
(:func:`dshim.net.ws.run_ws_handover`), one sans-IO :class:`~.protocol.SocketSession`
per connection: a fresh URL from ``apps.connections.open`` per connection; the runner's
reader acknowledges every envelope as it reads it, its timer runs the session's hello
and liveness watchdogs and own pings (:class:`~dshim.net.ws_session.Ping`).  A
``disconnect`` (``refresh_requested`` / ``warning``) is a
:class:`~dshim.net.ws_session.Handover`: the runner opens the next connection while the
current one still delivers, and closes the old one once the new one said hello (or after
``handover_grace_s``).  The acked envelopes of all connections queue for one delivering
task (at most ``PENDING_MAX``; beyond it the reader waits), which hands what has queued
up by then (at most ``DELIVER_MAX``) to the pipeline at once, in the order they were read
(a burst in one store transaction), while acks never wait for it.  Failed
connections back off (1-30 s with jitter, the runner's and ``apps.connections.open``'s
one :class:`~dshim.backoff.Backoff`); after ``too_many_websockets`` the next connection
waits at least 30 s.  URLs are logged without their query (the ticket).
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn, TypeVar

import httpx
import msgspec
import structlog
import trio

from dshim import __version__
from dshim.channels.kit import Backoff
from dshim.channels.kit.decode import decode
from dshim.channels.slack import models as m
from dshim.channels.slack.protocol import (
    REPLACED,
    Incoming,
    SocketSession,
    SocketTuning,
    classify_error,
)
from dshim.errors import AuthError, ChannelError, RateLimited, RemoteProtocolError, single_error
from dshim.net.http import (
    Answer,
    JsonPoster,
    counted,
    download_capped,
    parse_retry_after,
    status_error,
)
from dshim.net.ws import Connected, WsOptions, run_ws_handover

log = structlog.get_logger("dshim.slack")

#: Acked envelopes waiting for the pipeline at most (beyond it the reader waits).
PENDING_MAX = 10_000
#: Queued envelopes handed to the pipeline together at most (one store transaction).
DELIVER_MAX = 100

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
        #: The bot token's JSON POSTs (nearly every call): prepared once per method on the
        #: fast transport, without httpx's client layers (:class:`~dshim.net.http.JsonPoster`).
        self._poster = JsonPoster(
            http,
            {
                "Authorization": f"Bearer {bot_token}",
                "User-Agent": USER_AGENT,
                "Content-Type": "application/json; charset=utf-8",
            },
        )
        self._timeout = http.timeout

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
            resp: Answer
            if content is not None and not app and not query:
                resp = await counted(method, self._poster.post_bytes(url, content, self._timeout))
            else:
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


#: The channel's side: hand envelopes to the pipeline, in the order read (a burst: the
#: ones queued by then, at most ``DELIVER_MAX`` at once, so one store transaction takes
#: them all).
Deliverer = Callable[[list[Incoming]], Awaitable[None]]


async def connection_url(web: WebClient, backoff: Backoff) -> str:
    """``apps.connections.open`` until it answers; a rejected app token is raised."""
    while True:
        try:
            return await web.connections_open()
        except AuthError as exc:
            raise AuthError(
                f"Slack rejected the app token (apps.connections.open: {exc.code})",
                code=exc.code,
            ) from exc
        except ChannelError as exc:
            retry_after = exc.retry_after if isinstance(exc, RateLimited) else None
            delay = backoff.next_delay(retry_after=retry_after)
            log.warning("ws_url_failed", error=str(exc), retry_in_s=round(delay, 2))
            await trio.sleep(delay)


async def run_socket_mode(
    web: WebClient,
    deliver: Deliverer,
    *,
    app_id: str | None = None,
    tuning: SocketTuning | None = None,
    backoff: Backoff | None = None,
    clock: Callable[[], float] = trio.current_time,
    options: WsOptions = WS_OPTIONS,
    on_connected: Callable[[SocketSession], None] | None = None,
) -> NoReturn:
    """Keep Socket Mode connected forever (see the module docstring).

    ``app_id`` (else the first ``hello``'s) is the app every later ``hello`` must name;
    ``on_connected`` gets the session of each connection that said hello.  Raises a
    rejected app token and ``link_disabled``.
    """
    tuning = tuning or SocketTuning()
    backoff = backoff or Backoff()
    # The session of the newest connection: it said the last hello, and its end (if it
    # ended) is what the next connection follows.
    newest: SocketSession | None = None
    # Acked envelopes wait here for the one delivering task: the reader acks the next
    # envelope at once even while the pipeline takes the previous ones (a burst must not
    # push acks past Slack's 3 s); order is read order, across handovers too.
    queue, pending = trio.open_memory_channel[Incoming](PENDING_MAX)

    def new_session() -> SocketSession:
        nonlocal newest, app_id
        if app_id is None and newest is not None:
            app_id = newest.app_id  # hello's connection_info.app_id: who we are
        newest = SocketSession(app_id=app_id, tuning=tuning)
        return newest

    async def next_url() -> str:
        if newest is not None and newest.not_before is not None:  # too_many_websockets
            wait = newest.not_before - clock()
            if wait > 0:
                reason = newest.disconnect_reason
                log.info("reconnect_delayed", retry_in_s=round(wait, 2), reason=reason)
                await trio.sleep(wait)
        return await connection_url(web, backoff)

    def connected(action: Connected) -> None:
        # Only the newest connection says hello: a handover starts from one that said it.
        if on_connected is not None and newest is not None:
            on_connected(newest)

    async def enqueue(incoming: Incoming) -> None:
        try:
            queue.send_nowait(incoming)
        except trio.WouldBlock:  # a flood: the reader waits (and is not judged dead)
            await queue.send(incoming)

    async def deliverer() -> None:
        async for incoming in pending:
            batch = [incoming]  # and what queued up meanwhile: one store transaction
            while len(batch) < DELIVER_MAX:
                try:
                    batch.append(pending.receive_nowait())
                except trio.WouldBlock:
                    break
            await deliver(batch)

    with single_error():
        async with trio.open_nursery() as nursery:
            nursery.start_soon(deliverer)
            await run_ws_handover(
                new_session,
                next_url,
                enqueue,
                backoff=backoff,
                clock=clock,
                options=options,
                on_connected=connected,
                close_replaced=REPLACED,
                replaced_grace_s=tuning.handover_grace_s,
            )
