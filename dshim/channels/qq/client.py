"""Thin trio I/O for QQ: the access token, the OpenAPI client, downloads and the gateway.

Access token
------------
``POST {token_base}/app/getAppAccessToken`` with ``{"appId", "clientSecret"}`` mints a
token (``expires_in`` seconds, a string or a number).  One
:class:`~dshim.net.http.AccessToken` per bot renews it in its last 60-120 s (QQ
issues a new one only in the final 60 s and keeps both valid meanwhile) and once more when
the API answers 401; concurrent callers share one refresh.  A refused secret is an
:class:`~dshim.errors.AuthError` (fatal).  Every new token is registered with the log
redactor before it is used.

OpenAPI
-------
Every path is relative to ``api_base`` on the bot's one HTTP client, with
``Authorization: QQBot <token>`` and ``X-Union-Appid``.  Failures are mapped once by
:func:`~.protocol.classify_error`; httpx failures by the kit
(``TransportError.request_sent``).  The HTTP read timeout is 15 s (QQ: at least 5 s, or a
delivered message looks failed).  This client never retries a send: the renderer does,
reusing the ``msg_seq`` (QQ's idempotency key).  :meth:`QQApi.get_message` (guild channels
only) is the one message lookup QQ has; it runs inside the turn's quote budget.

Gateway
-------
:func:`run_gateway` runs QQ's :class:`~dshim.channels.kit.gateway.GatewaySession` on the
kit's :mod:`~dshim.channels.kit.gateway_run`; before each connection the session gets the
current ``QQBot <token>`` (a new one after a 4004).
"""

from __future__ import annotations

import math
import urllib.parse
from collections.abc import Callable
from typing import Any, NoReturn, TypeVar

import httpx
import msgspec
import structlog
import trio

from dshim import __version__
from dshim.channels.kit import Backoff, gateway_run
from dshim.channels.kit.decode import decode
from dshim.channels.kit.gateway import Dispatch, GatewayBot, GatewaySession, gateway_bot_decoder
from dshim.channels.qq import models as m
from dshim.channels.qq.protocol import auth_header, classify_error, error_body, fetched_message
from dshim.errors import AuthError, ChannelError, NotFound, PermissionDenied, RemoteProtocolError
from dshim.net.http import AccessToken, counted, download_capped, parse_retry_after
from dshim.net.ws import Deliverer, WsOptions

log = structlog.get_logger("dshim.qq")

DEFAULT_API_BASE = "https://api.sgroup.qq.com"
DEFAULT_TOKEN_BASE = "https://bots.qq.com"
USER_AGENT = f"dshim/{__version__} (QQ bot)"
#: QQ asks for a client timeout of at least 5 s on sends.
HTTP_TIMEOUT = httpx.Timeout(10.0, read=15.0)
#: Renew the access token this long before it expires (QQ: new tokens in the last 60 s).
TOKEN_MARGIN_S = 90.0
#: Attachment hosts (Tencent CDNs), matched as a suffix of the URL's host.
MEDIA_HOST_SUFFIXES = (
    ".qpic.cn",
    ".qq.com",
    ".qq.com.cn",
    ".myqcloud.com",
    ".tencentcos.com",
    ".ugcimg.cn",
)
WS_OPTIONS = WsOptions()

T = TypeVar("T")


def _expires_in(value: str | int | float | None) -> float:
    try:
        seconds = float(value) if value is not None else math.nan
    except ValueError:
        seconds = math.nan
    return seconds if math.isfinite(seconds) and seconds > 0 else 7200.0


class QQApi:
    """The access token and QQ OpenAPI v2 on a shared ``httpx.AsyncClient``."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        app_id: str,
        client_secret: str,
        api_base: str = DEFAULT_API_BASE,
        token_base: str = DEFAULT_TOKEN_BASE,
        on_new_token: Callable[[str], None] | None = None,
        media_hosts: frozenset[str] = frozenset(),
        clock: Callable[[], float] = trio.current_time,
        fixed_token: str | None = None,
    ) -> None:
        self._http = http
        self.app_id = app_id
        self._secret = client_secret
        self.api_base = api_base.rstrip("/")
        self.token_base = token_base.rstrip("/")
        self._media_hosts = media_hosts
        fetch = self._fetch_token
        if fixed_token is not None:  # replay: lookups only, no token endpoint

            async def fetch() -> tuple[str, float]:
                return fixed_token, 7200.0

        self.tokens = AccessToken(
            fetch, margin_s=TOKEN_MARGIN_S, on_new_token=on_new_token, clock=clock
        )
        #: Set when QQ rejected the credentials for good (the channel stops the bot).
        self.auth_failed = trio.Event()

    def __repr__(self) -> str:  # never the secret
        return f"QQApi(app_id={self.app_id!r}, api_base={self.api_base!r})"

    # -- the token ---------------------------------------------------------------------

    async def _fetch_token(self) -> tuple[str, float]:
        what = "POST /app/getAppAccessToken"
        resp = await counted(
            what,
            self._http.post(
                self.token_base + "/app/getAppAccessToken",
                content=m.encode({"appId": self.app_id, "clientSecret": self._secret}),
                headers={"Content-Type": "application/json"},
            ),
        )
        body = m.AccessTokenBody()
        try:
            body = decode(m.token_decoder, resp.content)
        except (msgspec.DecodeError, msgspec.ValidationError):
            if resp.status_code < 400:
                raise RemoteProtocolError(f"{what}: unexpected response") from None
        if resp.status_code >= 500:
            raise classify_error(resp.status_code, error_body(resp.content), what)
        if resp.status_code >= 400 or not body.access_token:
            self.auth_failed.set()
            detail = f"code {body.code}: {(body.message or '')[:200]}" if body.code else ""
            raise AuthError(
                f"QQ refused the app credentials (HTTP {resp.status_code} {detail}): check "
                "app_id and client_secret".replace("  ", " "),
                status=resp.status_code,
                code=body.code,
            )
        return body.access_token, _expires_in(body.expires_in)

    async def token(self) -> str:
        """A valid access token (fetched or renewed as needed)."""
        return await self.tokens.get()

    # -- endpoints ---------------------------------------------------------------------

    async def get_me(self) -> m.Me:
        """``GET /users/@me``: the bot's id and name."""
        return await self.request("GET", "/users/@me", decoder=m.me_decoder)

    async def get_gateway_bot(self) -> GatewayBot:
        """``GET /gateway/bot``: the websocket URL and the identify budget (``GET /gateway``,
        the URL alone, where the former is not offered)."""
        try:
            return await self.request("GET", "/gateway/bot", decoder=gateway_bot_decoder)
        except NotFound:
            log.info("gateway_bot_missing", fallback="GET /gateway")
            return await self.request("GET", "/gateway", decoder=gateway_bot_decoder)

    async def send(self, kind: str, target: str, body: dict[str, Any]) -> m.Sent:
        """Post one message: ``/v2/users/{openid}/messages`` (C2C), ``/v2/groups/{id}/messages``,
        ``/channels/{id}/messages`` (guild) or ``/dms/{guild_id}/messages`` (guild DM)."""
        route = SEND_ROUTES[kind]
        return await self.request("POST", route, decoder=m.sent_decoder, json=body, id=target)

    async def get_message(self, channel_id: str, message_id: str) -> m.Message:
        """``GET /channels/{channel_id}/messages/{message_id}``: one guild channel message
        (the bare object or ``{"message": {...}}``; a quote lookup, never retried)."""
        content = await self.request_bytes(
            "GET", MESSAGE_ROUTE, channel_id=channel_id, message_id=message_id
        )
        try:
            return fetched_message(content or b"{}")
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RemoteProtocolError(
                f"GET {MESSAGE_ROUTE}: unexpected response: {str(exc)[:200]}"
            ) from exc

    async def stream(self, openid: str, body: dict[str, Any]) -> m.Sent:
        """``POST /v2/users/{openid}/stream_messages``: one chunk of a C2C stream."""
        return await self.request(
            "POST", STREAM_ROUTE, decoder=m.sent_decoder, json=body, id=openid
        )

    async def download(self, url: str, max_bytes: int) -> bytes:
        """An attachment from a Tencent CDN host (HTTPS), at most ``max_bytes``; no token."""
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower()
        extra = host in self._media_hosts
        if not extra and (parts.scheme != "https" or not host.endswith(MEDIA_HOST_SUFFIXES)):
            raise PermissionDenied(f"refusing to download an attachment from host {host!r}")
        return await download_capped(
            self._http, url, max_bytes, headers={"User-Agent": USER_AGENT}, what="QQ attachment"
        )

    # -- the request -------------------------------------------------------------------

    async def request(
        self,
        method: str,
        route: str,
        *,
        decoder: msgspec.json.Decoder[T],
        json: Any = None,
        **params: str,
    ) -> T:
        """One OpenAPI call, the token refreshed once on 401; the body decoded."""
        content = await self.request_bytes(method, route, json=json, **params)
        try:
            return decode(decoder, content or b"{}")
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RemoteProtocolError(
                f"{method} {route}: unexpected response: {str(exc)[:200]}"
            ) from exc

    async def request_bytes(
        self, method: str, route: str, *, json: Any = None, **params: str
    ) -> bytes:
        """One OpenAPI call, the token refreshed once on 401; the body as received."""

        async def call(token: str) -> bytes:
            return await self._call(method, route, token, json, params)

        try:
            return await self.tokens.call(call)
        except AuthError:
            self.auth_failed.set()
            raise

    async def _call(
        self, method: str, route: str, token: str, json: Any, params: dict[str, str]
    ) -> bytes:
        path = route.format(**{k: urllib.parse.quote(v, safe="") for k, v in params.items()})
        what = f"{method} {route}"
        headers = {"Authorization": auth_header(token), "X-Union-Appid": self.app_id}
        body = m.encode(json) if json is not None else None
        if body is not None:
            headers["Content-Type"] = "application/json"
        resp = await counted(
            what, self._http.request(method, self.api_base + path, content=body, headers=headers)
        )
        status = resp.status_code
        if status >= 400:
            raise classify_error(
                status, error_body(resp.content), what, retry_after=parse_retry_after(resp.headers)
            )
        err = error_body(resp.content)
        if err.code and b'"id"' not in resp.content:
            # Some failures come back as HTTP 200 with an error body.
            raise classify_error(status, err, what)
        return resp.content


SEND_ROUTES = {
    "c2c": "/v2/users/{id}/messages",
    "group": "/v2/groups/{id}/messages",
    "channel": "/channels/{id}/messages",
    "dms": "/dms/{id}/messages",
}
STREAM_ROUTE = "/v2/users/{id}/stream_messages"
MESSAGE_ROUTE = "/channels/{channel_id}/messages/{message_id}"


async def run_gateway(
    gw: GatewaySession,
    api: QQApi,
    deliver: Deliverer[Dispatch],
    *,
    backoff: Backoff | None = None,
    clock: Callable[[], float] = trio.current_time,
) -> NoReturn:
    """Keep QQ's gateway session alive forever (resume after QQ's periodic closes).

    Before each connection the session gets the current ``QQBot <token>``; after a close
    with 4004 the old token is dropped first.  Raises AuthError / FatalChannelError.
    """

    token_backoff = Backoff()

    async def before_connect() -> None:
        if gw.token_rejected:
            gw.token_rejected = False
            api.tokens.invalidate(gw.token.removeprefix("QQBot "))
            log.info("access_token_rejected_refreshing", by="gateway")
        while True:
            try:
                gw.token = auth_header(await api.token())
            except AuthError:
                raise
            except ChannelError as exc:  # transient (network, 5xx): back off, try again
                delay = token_backoff.next_delay()
                log.warning("access_token_failed", error=str(exc), retry_in_s=round(delay, 2))
                await trio.sleep(delay)
                continue
            token_backoff.reset()
            return

    await gateway_run.run_gateway(
        gw,
        api.get_gateway_bot,
        deliver,
        backoff=backoff,
        clock=clock,
        options=WS_OPTIONS,
        before_connect=before_connect,
    )
