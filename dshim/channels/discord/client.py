"""Thin trio I/O for Discord: the REST client (rate limits, error mapping) and the gateway reader.

REST
----
One shared ``httpx.AsyncClient`` per bot; every path is relative to ``api_base`` (default
``https://discord.com/api/v10``).  Rate limits (topics/rate-limits.mdx) are learned from
the response headers, never hard-coded:

* per route: ``X-RateLimit-Bucket`` maps ``METHOD route-template`` to a bucket id; state
  (``-Remaining``, ``-Reset-After``) is kept per (bucket, top-level resource id), so
  ``/channels/A/messages`` and ``/channels/B/messages`` are independent.  A bucket with
  nothing remaining makes the next request wait for its reset;
* global: at most 50 requests per second, and a 429 with ``global: true`` (or
  ``X-RateLimit-Global`` / scope ``global``) pauses every request;
* 429: wait ``retry_after`` (body, else ``Retry-After``) and retry, up to a cap; a wait
  longer than ``max_wait_s`` is raised as :class:`~dshim.errors.RateLimited`.

Errors are mapped once, here, from the HTTP status and the JSON ``code``: 10003 unknown
channel and 10008 unknown message -> :class:`NotFound`; 50001 missing access and 50013
missing permissions -> :class:`PermissionDenied`; 401 -> :class:`AuthError` (and
:attr:`RestClient.auth_failed` is set: the channel stops the bot); 5xx and network
errors -> :class:`TransportError`.  The token is sent only to ``api_base`` and never
appears in an error.

Gateway
-------
:func:`run_gateway` drives :class:`~.protocol.GatewayProtocol` over trio-websocket.  Per
connection a reader task feeds frames to the protocol, performs its actions and awaits
the handler of each wanted dispatch, in order, before reading on (backpressure without
a queue); a timer task sends heartbeats and checks for zombies meanwhile (without judging
the connection while the handler is busy, since nobody is reading it).  Nothing cancels
a dispatch in hand, so a received event is never lost between the socket and the
pipeline.
"""

from __future__ import annotations

import urllib.parse
from collections import deque
from collections.abc import Awaitable, Callable, Collection
from typing import Any, NoReturn, TypeVar

import httpx
import msgspec
import structlog
import trio
from trio_websocket import (
    ConnectionClosed,
    HandshakeError,
    WebSocketConnection,
    open_websocket_url,
)

from dshim import __version__
from dshim.channels.discord import models as m
from dshim.channels.discord.protocol import (
    CloseConnection,
    Connected,
    ConnectPlan,
    Dispatch,
    GatewayProtocol,
    Ignored,
    SendFrame,
)
from dshim.errors import (
    AuthError,
    ChannelError,
    NotFound,
    PermissionDenied,
    RateLimited,
    RemoteProtocolError,
    TransportError,
)

log = structlog.get_logger("dshim.discord")

DEFAULT_API_BASE = "https://discord.com/api/v10"
USER_AGENT = f"DiscordBot (https://github.com/dshim/dshim, {__version__})"
#: Hosts attachments may be downloaded from (besides ``api_base``'s own host).
MEDIA_HOSTS = frozenset({"cdn.discordapp.com", "media.discordapp.net"})
GLOBAL_LIMIT_PER_S = 50
NOT_FOUND_CODES = frozenset({10003, 10008})
PERMISSION_CODES = frozenset({50001, 50013})
HTTP_TIMEOUT = httpx.Timeout(30.0, connect=10.0)

T = TypeVar("T")


class _Bucket:
    __slots__ = ("limit", "remaining", "reset_at")

    def __init__(self) -> None:
        self.limit = 1
        self.remaining = 1
        self.reset_at = 0.0


def open_http_client() -> httpx.AsyncClient:
    """The bot's one shared HTTP client (no credentials in its defaults)."""
    return httpx.AsyncClient(
        timeout=HTTP_TIMEOUT, headers={"User-Agent": USER_AGENT}, follow_redirects=False
    )


class RestClient:
    """Discord REST v10 on a shared ``httpx.AsyncClient``; see the module docstring."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        token: str,
        api_base: str | None = None,
        clock: Callable[[], float] = trio.current_time,
        max_retries: int = 5,
        max_wait_s: float = 60.0,
    ) -> None:
        self._http = http
        self._auth = {"Authorization": f"Bot {token}", "User-Agent": USER_AGENT}
        self.api_base = (api_base or DEFAULT_API_BASE).rstrip("/")
        self._api_host = urllib.parse.urlsplit(self.api_base).hostname or ""
        self._clock = clock
        self.max_retries = max_retries
        self.max_wait_s = max_wait_s
        self._route_buckets: dict[str, str] = {}
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._global_until = 0.0
        self._recent: deque[float] = deque(maxlen=GLOBAL_LIMIT_PER_S)
        #: Set when Discord answered 401: the token is not valid (any more).
        self.auth_failed = trio.Event()

    def __repr__(self) -> str:
        return f"RestClient(api_base={self.api_base!r})"

    # -- endpoints ---------------------------------------------------------------------

    async def get_current_user(self) -> m.User:
        """``GET /users/@me``: the bot's own user (identity check)."""
        return await self.request("GET", "/users/@me", decoder=m.user_decoder)

    async def get_gateway_bot(self) -> m.GatewayBot:
        """``GET /gateway/bot``: the gateway URL and the identify budget."""
        return await self.request("GET", "/gateway/bot", decoder=m.gateway_bot_decoder)

    async def get_message(self, channel_id: str, message_id: str) -> m.QuotedMessage:
        """``GET /channels/{channel_id}/messages/{message_id}``."""
        return await self.request(
            "GET",
            "/channels/{channel_id}/messages/{message_id}",
            channel_id=channel_id,
            message_id=message_id,
            decoder=m.quoted_decoder,
        )

    async def create_message(
        self,
        channel_id: str,
        content: str,
        *,
        reply_to: str | None = None,
        nonce: str | None = None,
        retries: int | None = None,
    ) -> m.CreatedMessage:
        """``POST /channels/{channel_id}/messages``: never pings anyone.

        With ``reply_to`` the message is a reply that still posts when the target is gone
        (``fail_if_not_exists: false``).  A ``nonce`` makes a retried create idempotent.
        """
        body: dict[str, Any] = {
            "content": content,
            "allowed_mentions": {"parse": [], "replied_user": False},
        }
        if reply_to is not None:
            body["message_reference"] = {"message_id": reply_to, "fail_if_not_exists": False}
        if nonce is not None:
            body["nonce"] = nonce
            body["enforce_nonce"] = True
        return await self.request(
            "POST",
            "/channels/{channel_id}/messages",
            channel_id=channel_id,
            json=body,
            decoder=m.created_decoder,
            retries=retries,
        )

    async def edit_message(
        self, channel_id: str, message_id: str, content: str, *, retries: int | None = None
    ) -> m.CreatedMessage:
        """``PATCH /channels/{channel_id}/messages/{message_id}`` (mentions stay off)."""
        return await self.request(
            "PATCH",
            "/channels/{channel_id}/messages/{message_id}",
            channel_id=channel_id,
            message_id=message_id,
            json={"content": content, "allowed_mentions": {"parse": [], "replied_user": False}},
            decoder=m.created_decoder,
            retries=retries,
        )

    async def trigger_typing(self, channel_id: str, *, retries: int | None = None) -> None:
        """``POST /channels/{channel_id}/typing`` (lasts 10 s or until the bot posts)."""
        await self.request(
            "POST", "/channels/{channel_id}/typing", channel_id=channel_id, retries=retries
        )

    async def download(self, url: str, max_bytes: int) -> bytes:
        """Download an attachment from Discord's CDN, at most ``max_bytes``; no credentials."""
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname or ""
        own = host == self._api_host
        if not own and (parts.scheme != "https" or host not in MEDIA_HOSTS):
            raise ChannelError(f"refusing to download an attachment from {host or url!r}")
        try:
            async with self._http.stream(
                "GET", url, headers={"User-Agent": USER_AGENT}, follow_redirects=False
            ) as resp:
                if resp.status_code != 200:
                    raise _status_error(resp.status_code, 0, "attachment download failed")
                declared = resp.headers.get("content-length")
                if declared and declared.isdigit() and int(declared) > max_bytes:
                    raise ChannelError(f"attachment is {declared} bytes, over {max_bytes}")
                buf = bytearray()
                async for chunk in resp.aiter_bytes():
                    buf += chunk
                    if len(buf) > max_bytes:
                        raise ChannelError(f"attachment is over {max_bytes} bytes")
                return bytes(buf)
        except httpx.HTTPError as exc:
            raise TransportError(f"attachment download failed: {type(exc).__name__}") from exc

    # -- the request loop --------------------------------------------------------------

    async def request(
        self,
        method: str,
        route: str,
        *,
        json: Any = None,
        decoder: msgspec.json.Decoder[T] | None = None,
        retries: int | None = None,
        **params: str,
    ) -> T:
        """One REST call with rate limiting and retries.  Returns the decoded body.

        ``retries`` caps the 429 retries of this call (default ``max_retries``); 0 hands
        every 429 to the caller as :class:`~dshim.errors.RateLimited`.
        """
        path = route.format(**{k: urllib.parse.quote(v, safe="") for k, v in params.items()})
        route_key = f"{method} {route}"
        major = params.get("channel_id") or params.get("guild_id") or params.get("webhook_id") or ""
        body = m.encode(json) if json is not None else None
        headers = dict(self._auth)
        if body is not None:
            headers["Content-Type"] = "application/json"
        max_retries = self.max_retries if retries is None else retries
        for attempt in range(max_retries + 1):
            await self._wait_turn(route_key, major)
            try:
                resp = await self._http.request(
                    method, self.api_base + path, content=body, headers=headers
                )
            except httpx.TimeoutException as exc:
                raise TransportError(f"{method} {route}: timed out") from exc
            except httpx.HTTPError as exc:
                raise TransportError(f"{method} {route}: {type(exc).__name__}") from exc
            now = self._clock()
            self._learn(route_key, major, resp, now)
            status = resp.status_code
            if status == 429:
                limited = self._rate_limited(route_key, major, resp, now)
                if attempt >= max_retries or limited.retry_after > self.max_wait_s:
                    raise limited
                log.info(
                    "discord_rate_limited",
                    route=route_key,
                    retry_after=round(limited.retry_after, 3),
                    is_global=limited.is_global,
                )
                continue
            if status >= 400:
                self._raise_for(method, route, resp)
            if decoder is None:
                return None  # type: ignore[return-value]
            try:
                return decoder.decode(resp.content)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise RemoteProtocolError(
                    f"{method} {route}: unexpected response: {exc}", status=status
                ) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    async def _wait_turn(self, route_key: str, major: str) -> None:
        """Wait until the global limit and the route's bucket allow one more request."""
        key = (self._route_buckets.get(route_key, route_key), major)
        while True:
            now = self._clock()
            wait = self._global_until - now
            bucket = self._buckets.get(key)
            if bucket is not None and bucket.remaining <= 0:
                if bucket.reset_at > now:
                    wait = max(wait, bucket.reset_at - now)
                else:
                    bucket.remaining = max(1, bucket.limit)
            recent = self._recent
            if len(recent) == GLOBAL_LIMIT_PER_S:
                wait = max(wait, recent[0] + 1.0 - now)
            if wait <= 0:
                break
            if wait > self.max_wait_s:
                raise RateLimited(f"{route_key}: rate limited for {wait:.1f} s", retry_after=wait)
            await trio.sleep(wait)
        if bucket is not None:
            bucket.remaining -= 1  # reserve: concurrent callers see it at once
        self._recent.append(now)

    def _learn(self, route_key: str, major: str, resp: httpx.Response, now: float) -> None:
        h = resp.headers
        bucket_id = h.get("x-ratelimit-bucket")
        remaining = h.get("x-ratelimit-remaining")
        reset_after = h.get("x-ratelimit-reset-after")
        if bucket_id is None or remaining is None or reset_after is None:
            return
        try:
            left = int(remaining)
            after = float(reset_after)
        except ValueError:
            return
        self._route_buckets[route_key] = bucket_id
        key = (bucket_id, major)
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) > 4096:  # bounded: forget idle buckets
                self._buckets = {k: b for k, b in self._buckets.items() if b.reset_at > now}
            bucket = self._buckets[key] = _Bucket()
        limit = h.get("x-ratelimit-limit")
        if limit is not None and limit.isdigit():
            bucket.limit = int(limit)
        bucket.remaining = left
        bucket.reset_at = now + after

    def _rate_limited(
        self, route_key: str, major: str, resp: httpx.Response, now: float
    ) -> RateLimited:
        retry_after: float | None = None
        is_global = False
        code = 0
        try:
            err = m.error_decoder.decode(resp.content)
            retry_after, is_global, code = err.retry_after, err.global_, err.code
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass  # e.g. a Cloudflare ban page: fall back to the headers
        h = resp.headers
        if retry_after is None:
            try:
                retry_after = float(h.get("retry-after", "1"))
            except ValueError:
                retry_after = 1.0
        retry_after = max(0.0, retry_after)
        if (
            h.get("x-ratelimit-global", "").lower() == "true"
            or h.get("x-ratelimit-scope") == "global"
        ):
            is_global = True
        if is_global:
            self._global_until = max(self._global_until, now + retry_after)
        else:
            key = (self._route_buckets.get(route_key, route_key), major)
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = _Bucket()
            bucket.remaining = 0
            bucket.reset_at = max(bucket.reset_at, now + retry_after)
        return RateLimited(
            f"{route_key}: rate limited (retry after {retry_after:.2f} s)",
            retry_after=retry_after,
            code=code or None,
            is_global=is_global,
        )

    def _raise_for(self, method: str, route: str, resp: httpx.Response) -> NoReturn:
        code = 0
        message = ""
        try:
            err = m.error_decoder.decode(resp.content)
            code, message = err.code, err.message
        except (msgspec.DecodeError, msgspec.ValidationError):
            pass
        status = resp.status_code
        text = f"{method} {route}: HTTP {status}" + (f" code {code}" if code else "")
        if message:
            text += f": {message[:200]}"
        if status == 401:
            self.auth_failed.set()
            raise AuthError(f"Discord rejected the bot token ({text})", status=401, code=code)
        raise _status_error(status, code, text)


def _status_error(status: int, code: int, text: str) -> ChannelError:
    if code in NOT_FOUND_CODES or status == 404:
        return NotFound(text, status=status, code=code or None)
    if code in PERMISSION_CODES or status == 403:
        return PermissionDenied(text, status=status, code=code or None)
    if status >= 500:
        return TransportError(text, status=status, code=code or None)
    return ChannelError(text, status=status, code=code or None)


# --- gateway -------------------------------------------------------------------------------

#: Large READY / GUILD_CREATE payloads are fine; a 64 KiB receive buffer is ~1.6x faster.
WS_OPTIONS: dict[str, Any] = {
    "connect_timeout": 20.0,
    "disconnect_timeout": 2.0,
    "message_queue_size": 64,
    "max_message_size": 16 * 1024 * 1024,
    "receive_buffer_size": 64 * 1024,
}
CLOSE_WAIT_S = 2.0
SHUTDOWN_CLOSE_S = 0.25

#: Handles one wanted dispatch; awaited inline by the reader (backpressure).
DispatchHandler = Callable[[Dispatch], Awaitable[None]]


class _Connection:
    """One websocket connection driven by the protocol (see :func:`run_gateway`).

    Two tasks share the protocol object (its methods never await, so each call is atomic):
    the reader feeds frames to ``receive`` and awaits the dispatch handler inline; the
    timer task sleeps until ``next_timer`` and runs ``tick`` (heartbeats, zombie check,
    Hello deadline).  While the handler is busy the reader is not reading, so ``tick`` is
    told not to judge the connection.  Neither task ever cancels a dispatch in hand: the
    reader ends by itself once the socket is closed.
    """

    def __init__(
        self,
        ws: WebSocketConnection,
        gw: GatewayProtocol,
        on_dispatch: DispatchHandler,
        wanted: Collection[str],
        on_connected: Callable[[Connected], None],
        clock: Callable[[], float],
        stop_when_connected: bool,
    ) -> None:
        self.ws = ws
        self.gw = gw
        self.on_dispatch = on_dispatch
        self.wanted = wanted
        self.on_connected = on_connected
        self.clock = clock
        self.stop_when_connected = stop_when_connected
        self.delivering = False
        self.own_close: int | None = None
        self._armed: float | None = None
        self._rearm = trio.Event()

    async def drive(self) -> int | None:
        """Run until the connection ends; returns the close code (None: network)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._timers)
            code = await self._read()
            nursery.cancel_scope.cancel()
        return self.own_close if self.own_close is not None else code

    async def _read(self) -> int | None:
        gw = self.gw
        while True:
            try:
                data = await self.ws.get_message()
            except ConnectionClosed as exc:
                return _close_code(exc)
            for action in gw.receive(data, self.clock()):
                if isinstance(action, Dispatch):
                    if action.t in self.wanted:
                        self.delivering = True
                        try:
                            await self.on_dispatch(action)
                        finally:
                            self.delivering = False
                elif await self._perform(action):
                    return self.own_close
            if gw.next_timer() != self._armed:
                self._rearm.set()

    async def _timers(self) -> None:
        gw = self.gw
        while True:
            timer = gw.next_timer()
            if timer is None:
                return
            self._armed = timer
            with trio.move_on_at(timer):
                await self._rearm.wait()
                self._rearm = trio.Event()
                continue  # the timer moved (Hello): sleep again
            for action in gw.tick(self.clock(), reading=not self.delivering):
                if await self._perform(action):
                    return

    async def _perform(self, action: object) -> bool:
        """Do one action; True when this side closed the connection."""
        if isinstance(action, SendFrame):
            try:
                await self.ws.send_message(action.payload.decode())
            except ConnectionClosed:
                return False  # the reader sees the close and ends
            if action.kind != "heartbeat":
                log.info("gateway_sent", op=action.kind)
            return False
        if isinstance(action, CloseConnection):
            log.info("gateway_closing", code=action.code, reason=action.reason)
            self.own_close = action.code
            with trio.move_on_after(CLOSE_WAIT_S):
                await self.ws.aclose(action.code, action.reason)
            return True
        if isinstance(action, Connected):
            log.info(
                "gateway_resumed" if action.resumed else "gateway_ready",
                session=action.session_id,
                seq=self.gw.seq,
            )
            self.on_connected(action)
            if self.stop_when_connected:
                self.own_close = 1000
                with trio.move_on_after(CLOSE_WAIT_S):
                    await self.ws.aclose(1000, "probe done")
                return True
            return False
        if isinstance(action, Ignored):
            log.warning("gateway_frame_dropped", reason=action.reason, detail=action.detail)
            return False
        raise AssertionError(f"unknown action {action!r}")


def _close_code(exc: BaseException) -> int | None:
    if isinstance(exc, ConnectionClosed) and exc.reason is not None:
        return int(exc.reason.code)
    return None


async def _release(ws: WebSocketConnection) -> None:
    """Close the TCP stream of a websocket that ended without a closing handshake.

    trio-websocket 0.12 marks such a connection closed but leaves its socket open, and
    its ``aclose()`` then returns early; without this the socket leaks until GC.
    """
    if ws.closed is not None:
        with trio.CancelScope(shield=True):
            await ws._close_stream()


async def connect_once(
    gw: GatewayProtocol,
    plan: ConnectPlan,
    on_dispatch: DispatchHandler,
    *,
    wanted: Collection[str],
    on_connected: Callable[[Connected], None],
    clock: Callable[[], float] = trio.current_time,
    stop_when_connected: bool = False,
) -> int | None:
    """One connection to ``plan.url``; returns its close code (None: network failure)."""
    log.info("gateway_connecting", mode=plan.mode.value, url=plan.url)
    try:
        async with open_websocket_url(plan.url, **WS_OPTIONS) as ws:
            try:
                gw.connection_opened(plan.mode, clock())
                conn = _Connection(
                    ws, gw, on_dispatch, wanted, on_connected, clock, stop_when_connected
                )
                return await conn.drive()
            finally:
                if ws.closed is None:
                    # Shutdown or a failure: end the session with 1000 so the bot goes
                    # offline.  The frame goes out at once; the reply is not awaited long
                    # (when cancelled, nobody reads it).
                    with trio.CancelScope(shield=True), trio.move_on_after(SHUTDOWN_CLOSE_S):
                        await ws.aclose(1000, "closing")
                await _release(ws)
    except (ConnectionClosed, HandshakeError, OSError, trio.BrokenResourceError) as exc:
        code = _close_code(exc)
        log.warning("gateway_connection_failed", error=type(exc).__name__, code=code)
        return code


async def run_gateway(
    gw: GatewayProtocol,
    rest: RestClient,
    on_dispatch: DispatchHandler,
    *,
    wanted: Collection[str],
    on_connected: Callable[[Connected], None],
    clock: Callable[[], float] = trio.current_time,
    connect: Callable[..., Awaitable[int | None]] = connect_once,
) -> NoReturn:
    """Keep a gateway session alive forever: connect, resume or identify, reconnect.

    Every wanted dispatch is awaited with ``on_dispatch``, in gateway order, before the
    next frame is read.  Raises :class:`~dshim.errors.AuthError` /
    :class:`~dshim.errors.FatalChannelError` on fatal close codes, and REST errors from
    ``GET /gateway/bot``.
    """
    while True:
        now = clock()
        plan = gw.plan_connection(now)
        if plan.refresh_gateway:
            try:
                info = await rest.get_gateway_bot()
            except AuthError:
                raise
            except ChannelError as exc:
                if not gw.gateway_info_unavailable():
                    raise
                log.warning("gateway_info_unavailable", error=str(exc))
                continue
            gw.set_gateway_info(info, clock())
            log.info(
                "gateway_info",
                identifies_remaining=info.session_start_limit.remaining,
                max_concurrency=info.session_start_limit.max_concurrency,
            )
            continue
        if plan.not_before > now:
            wait = plan.not_before - now
            if plan.reason or wait >= 1.0:
                log.info("gateway_waiting", seconds=round(wait, 2), reason=plan.reason or "backoff")
            await trio.sleep_until(plan.not_before)
            continue
        code = await connect(
            gw, plan, on_dispatch, wanted=wanted, on_connected=on_connected, clock=clock
        )
        log.info("gateway_disconnected", code=code, seq=gw.seq)
        gw.connection_lost(code, clock())
