"""Thin trio I/O for Discord: the REST client and the gateway loop.

REST
----
Every path is relative to ``api_base`` (default ``https://discord.com/api/v10``) on the
bot's one HTTP client (:func:`dshim.net.http.open_http`).  :meth:`RestClient.request`
is a loop around the sans-IO parts of :mod:`.protocol`: before each request it asks the
:class:`~.protocol.RateLimiter` for its turn (sleeping when a bucket or the global limit
says so; a wait longer than ``max_wait_s`` is raised as :class:`~dshim.errors.RateLimited`),
after it tells the limiter the ``X-RateLimit-*`` headers; a 429 is retried after
``retry_after`` up to a cap; other failures are mapped once by
:func:`~.protocol.classify_error`.  A 401 also sets :attr:`RestClient.auth_failed` (the
channel stops the bot).  httpx failures become :class:`~dshim.errors.TransportError` in
:func:`~dshim.net.http.map_httpx_errors` (``request_sent`` says whether the
request may have been processed).  The token is sent only to ``api_base`` and never
appears in an error.

Gateway
-------
:func:`run_gateway` runs :class:`~.protocol.GatewayProtocol` on the kit's websocket
runner through the kit's :mod:`dshim.channels.kit.gateway_run` (shared with QQ);
:func:`next_gateway_url` is its plan step: ``GET /gateway/bot`` when the protocol asks for
it (retried with backoff on transient failures), and the waits of the identify budget.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import httpx
import msgspec
import structlog
import trio

from dshim import __version__
from dshim.channels.discord import models as m
from dshim.channels.discord.protocol import (
    GatewayProtocol,
    RateLimiter,
    classify_error,
    error_body,
    rate_limit_hit,
)
from dshim.channels.kit import Backoff, gateway_run
from dshim.channels.kit.decode import decode
from dshim.channels.kit.gateway import Dispatch
from dshim.errors import (
    AuthError,
    PermissionDenied,
    RateLimited,
    RemoteProtocolError,
)
from dshim.net.http import Answer, JsonPoster, counted, download_capped
from dshim.net.ws import Deliverer, WsOptions

log = structlog.get_logger("dshim.discord")

DEFAULT_API_BASE = "https://discord.com/api/v10"
USER_AGENT = f"DiscordBot (https://github.com/dshim/dshim, {__version__})"
#: Hosts attachments may be downloaded from (besides ``api_base``'s own host).
MEDIA_HOSTS = frozenset({"cdn.discordapp.com", "media.discordapp.net"})
HTTP_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
#: The gateway's websocket settings (the kit's defaults: 64 KiB reads, 64 queued frames).
WS_OPTIONS = WsOptions()

T = TypeVar("T")


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
        self._api_host = (urllib.parse.urlsplit(self.api_base).hostname or "").lower()
        self._clock = clock
        self.max_retries = max_retries
        self.max_wait_s = max_wait_s
        self.limits = RateLimiter()
        #: Set when Discord answered 401: the token is not valid (any more).
        self.auth_failed = trio.Event()
        #: JSON POSTs (every reply): prepared once per path on the fast transport, without
        #: httpx's client layers (:class:`~dshim.net.http.JsonPoster`).
        self._poster = JsonPoster(http, self._auth)
        #: Callers waiting for the global limit, in arrival order (trio's Lock is fair).
        self._global_queue = trio.Lock()
        self._timeout = http.timeout

    def __repr__(self) -> str:
        return f"RestClient(api_base={self.api_base!r})"

    # -- endpoints ---------------------------------------------------------------------

    async def get_current_user(self) -> m.User:
        """``GET /users/@me``: the bot's own user (identity check)."""
        return await self.request("GET", "/users/@me", decoder=m.user_decoder)

    async def get_user(self, user_id: str) -> m.User:
        """``GET /users/{user_id}``: a user (substitute targets in probe)."""
        return await self.request(
            "GET", "/users/{user_id}", user_id=user_id, decoder=m.user_decoder
        )

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
        ping: str | None = None,
        components: list[dict[str, Any]] | None = None,
    ) -> m.CreatedMessage:
        """``POST /channels/{channel_id}/messages``: never pings anyone but ``ping`` (a
        user id whose ``<@id>`` the content carries: a substitute answer's asker).

        With ``reply_to`` the message is a reply that still posts when the target is gone
        (``fail_if_not_exists: false``).  A ``nonce`` makes a retried create idempotent.
        ``components``: action rows of buttons (see :mod:`.render`).
        """
        allowed: dict[str, Any] = {"parse": [], "replied_user": False}
        if ping is not None:
            allowed["users"] = [ping]
        body: dict[str, Any] = {"content": content, "allowed_mentions": allowed}
        if components is not None:
            body["components"] = components
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

    async def start_thread(
        self, channel_id: str, message_id: str, name: str, *, retries: int | None = None
    ) -> m.CreatedChannel:
        """``POST /channels/{channel_id}/messages/{message_id}/threads``: a thread on a
        message (its id is the message's)."""
        return await self.request(
            "POST",
            "/channels/{channel_id}/messages/{message_id}/threads",
            channel_id=channel_id,
            message_id=message_id,
            json={"name": name[:100] or "answer", "auto_archive_duration": 1440},
            decoder=m.channel_decoder,
            retries=retries,
        )

    async def open_dm(self, user_id: str) -> m.CreatedChannel:
        """``POST /users/@me/channels``: the DM channel with a user (created if needed)."""
        return await self.request(
            "POST",
            "/users/@me/channels",
            json={"recipient_id": user_id},
            decoder=m.channel_decoder,
        )

    async def edit_message(
        self,
        channel_id: str,
        message_id: str,
        content: str,
        *,
        retries: int | None = None,
        components: list[dict[str, Any]] | None = None,
    ) -> m.CreatedMessage:
        """``PATCH /channels/{channel_id}/messages/{message_id}`` (mentions stay off;
        ``components=[]`` removes the buttons)."""
        body: dict[str, Any] = {
            "content": content,
            "allowed_mentions": {"parse": [], "replied_user": False},
        }
        if components is not None:
            body["components"] = components
        return await self.request(
            "PATCH",
            "/channels/{channel_id}/messages/{message_id}",
            channel_id=channel_id,
            message_id=message_id,
            json=body,
            decoder=m.created_decoder,
            retries=retries,
        )

    async def interaction_callback(
        self, interaction_id: str, token: str, body: dict[str, Any]
    ) -> None:
        """``POST /interactions/{id}/{token}/callback``: answer a button press (once,
        within 3 s of the press).

        Authenticated by the interaction token in the path (a secret: it is never
        logged and never in an error; errors name the route template).  Not subject to
        the bot's rate limits, so it bypasses the limiter; one attempt, no retries (a
        late answer is refused anyway).
        """
        route = "POST /interactions/{interaction_id}/{interaction_token}/callback"
        path = "/interactions/{}/{}/callback".format(
            urllib.parse.quote(interaction_id, safe=""), urllib.parse.quote(token, safe="")
        )
        resp = await counted(
            route,
            self._http.post(
                self.api_base + path,
                content=m.encode(body),
                headers={"User-Agent": USER_AGENT, "Content-Type": "application/json"},
            ),
        )
        if resp.status_code >= 400:
            err = error_body(resp.content)
            raise classify_error(resp.status_code, err.code, route, err.message)

    async def trigger_typing(self, channel_id: str, *, retries: int | None = None) -> None:
        """``POST /channels/{channel_id}/typing`` (lasts 10 s or until the bot posts)."""
        await self.call(
            "POST", "/channels/{channel_id}/typing", channel_id=channel_id, retries=retries
        )

    async def download(self, url: str, max_bytes: int) -> bytes:
        """Download an attachment from Discord's CDN, at most ``max_bytes``; no credentials."""
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower()
        if host != self._api_host and parts.scheme != "https":
            raise PermissionDenied(f"refusing to download an attachment over {parts.scheme!r}")
        return await download_capped(
            self._http,
            url,
            max_bytes,
            allowed_hosts=MEDIA_HOSTS | {self._api_host},
            headers={"User-Agent": USER_AGENT},
            what="attachment download",
        )

    # -- the request loop --------------------------------------------------------------

    async def request(
        self,
        method: str,
        route: str,
        *,
        decoder: msgspec.json.Decoder[T],
        json: Any = None,
        retries: int | None = None,
        **params: str,
    ) -> T:
        """:meth:`call`, then the body decoded (bounded depth) with ``decoder``."""
        content = await self.call(method, route, json=json, retries=retries, **params)
        try:
            return decode(decoder, content)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RemoteProtocolError(
                f"{method} {route}: unexpected response: {str(exc)[:200]}"
            ) from exc

    async def _wait_turn(self, route_key: str, major: str) -> None:
        """Wait until the limiter lets this request go (and counted it).

        A wait for the route's own bucket is slept alone; a wait for the global limit in
        a queue (first come, first served): only its head sleeps until a slot frees, the
        others wait behind it.  Without it every waiting caller woke for every freed
        slot, and all but one went back to sleep — 200 chats waiting on the 50
        requests/s cost ~200 wake-ups per request.
        """
        while True:
            wait, by_bucket = self._reserve(route_key, major)
            if wait <= 0:
                return
            if by_bucket:
                await trio.sleep(wait)  # the bucket's reset: nobody else's business
                continue
            async with self._global_queue:
                while True:
                    wait, by_bucket = self._reserve(route_key, major)
                    if wait <= 0:
                        return
                    if by_bucket:
                        break  # now the bucket holds it back: out of the queue
                    await trio.sleep(wait)

    def _reserve(self, route_key: str, major: str) -> tuple[float, bool]:
        """The limiter's wait for this request (0: it is counted and may go) and whether
        the route's own bucket, not the global limit, is what holds it back; a wait past
        ``max_wait_s`` is :class:`RateLimited`."""
        now = self._clock()
        wait = self.limits.reserve(route_key, major, now)
        if wait > self.max_wait_s:
            raise RateLimited(f"{route_key}: rate limited for {wait:.1f} s", retry_after=wait)
        return wait, wait > 0 and self.limits.global_wait(now) < wait

    async def call(
        self,
        method: str,
        route: str,
        *,
        json: Any = None,
        retries: int | None = None,
        **params: str,
    ) -> bytes:
        """One REST call with rate limiting and retries.  Returns the response body.

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
        limits = self.limits
        for attempt in range(max_retries + 1):
            if limits.reserve(route_key, major, self._clock()) > 0:
                await self._wait_turn(route_key, major)
            resp: Answer
            if method == "POST" and body is not None:
                resp = await counted(
                    route_key, self._poster.post_bytes(self.api_base + path, body, self._timeout)
                )
            else:
                resp = await counted(
                    route_key,
                    self._http.request(method, self.api_base + path, content=body, headers=headers),
                )
            now = self._clock()
            limits.learn(route_key, major, resp.headers, now)
            status = resp.status_code
            if status == 429:
                hit = rate_limit_hit(resp.content, resp.headers)
                limits.hit(route_key, major, hit, now)
                if attempt >= max_retries or hit.retry_after > self.max_wait_s:
                    raise limits.limited_error(route_key, hit)
                log.info(
                    "rate_limited",
                    route=route_key,
                    retry_after=round(hit.retry_after, 3),
                    is_global=hit.is_global,
                )
                continue
            if status >= 400:
                err = error_body(resp.content)
                exc = classify_error(status, err.code, route_key, err.message)
                if isinstance(exc, AuthError):
                    self.auth_failed.set()
                raise exc
            return resp.content
        raise AssertionError("unreachable")  # pragma: no cover


# --- gateway -------------------------------------------------------------------------------


async def next_gateway_url(
    gw: GatewayProtocol,
    rest: RestClient,
    *,
    backoff: Backoff,
    clock: Callable[[], float] = trio.current_time,
) -> str:
    """The URL of the next connection (the kit's :func:`~dshim.channels.kit.gateway_run.next_gateway_url`
    with ``GET /gateway/bot``)."""
    return await gateway_run.next_gateway_url(
        gw, rest.get_gateway_bot, backoff=backoff, clock=clock
    )


async def run_gateway(
    gw: GatewayProtocol,
    rest: RestClient,
    deliver: Deliverer[Dispatch],
    *,
    backoff: Backoff | None = None,
    clock: Callable[[], float] = trio.current_time,
) -> NoReturn:
    """Keep a gateway session alive forever: connect, resume or identify, reconnect.

    Every wanted dispatch is awaited with ``deliver``, in gateway order, before the next
    frame is read.  Raises :class:`~dshim.errors.AuthError` /
    :class:`~dshim.errors.FatalChannelError` on fatal close codes.
    """
    await gateway_run.run_gateway(
        gw, rest.get_gateway_bot, deliver, backoff=backoff, clock=clock, options=WS_OPTIONS
    )
