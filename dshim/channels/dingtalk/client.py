"""Thin trio I/O for DingTalk: the OpenAPI client and the Stream connection loop.

OpenAPI
-------
:class:`DingTalkApi` makes every call on the bot's one HTTP client.  Calls on
``api_base`` (``https://api.dingtalk.com``) carry the app access token in
``x-acs-dingtalk-access-token``; the token is a kit :class:`~dshim.net.http.AccessToken`
(``/v1.0/oauth2/accessToken``, renewed 5 minutes before expiry, one refresh for concurrent
callers, refreshed once on a 401).  Failures are mapped once, by
:func:`.protocol.classify_error`; httpx failures by the kit (``request_sent``).  The
token, the app secret and tickets never appear in an error or a log.  The
``sessionWebhook`` of a message is only ever posted to when it points at ``oapi_base``'s
host (it comes from a payload) and never gets the token.

Stream
------
:func:`run_stream` keeps the app's Stream connection: register (a new single-use ticket
every time), connect, and run one :class:`.protocol.StreamSession` per connection on the
kit's runner (:func:`dshim.net.ws.run_ws_handover`, with websocket pings and a
pong timeout).  A ``disconnect`` frame starts the next connection at once while the old
one is still open (it closes itself a few seconds later): DingTalk may stop delivering
on a socket as soon as it announced its end.  The runner hands the deliveries of both
sockets over one at a time.
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
from dshim.channels.dingtalk import models as m
from dshim.channels.dingtalk.protocol import (
    RobotCallback,
    StreamSession,
    classify_error,
    error_body,
    is_auth_rejection,
    subscriptions,
)
from dshim.channels.kit import Backoff
from dshim.channels.kit.decode import decode
from dshim.errors import (
    AuthError,
    ChannelError,
    FatalChannelError,
    PermissionDenied,
    RateLimited,
    RemoteProtocolError,
)
from dshim.model import Verdict
from dshim.net.http import (
    AccessToken,
    counted,
    download_capped,
    parse_retry_after,
)
from dshim.net.ws import Connected, WsOptions, run_ws_handover

log = structlog.get_logger("dshim.dingtalk")

DEFAULT_API_BASE = "https://api.dingtalk.com"
DEFAULT_OAPI_BASE = "https://oapi.dingtalk.com"
USER_AGENT = f"dshim/{__version__} (dingtalk-stream; python)"
HTTP_TIMEOUT = httpx.Timeout(10.0, read=30.0)
#: Renew the ~2 h token 5 minutes before it expires.
TOKEN_MARGIN_S = 300.0
#: Websocket pings every 30 s, a missing pong within 20 s cuts the socket.
WS_OPTIONS = WsOptions(ping_interval_s=30.0, pong_timeout_s=20.0)

T = TypeVar("T")


class DingTalkApi:
    """DingTalk OpenAPI calls of one app (see the module docstring)."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        client_id: str,
        client_secret: str,
        robot_code: str,
        api_base: str = DEFAULT_API_BASE,
        oapi_base: str = DEFAULT_OAPI_BASE,
        #: Called with every token and ticket before it is used (the log redactor).
        on_new_token: Callable[[str], None] | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._http = http
        self._client_id = client_id
        self._secret = client_secret
        self.robot_code = robot_code
        self.api_base = api_base.rstrip("/")
        self.oapi_base = oapi_base.rstrip("/")
        self._oapi_host = (urllib.parse.urlsplit(self.oapi_base).hostname or "").lower()
        self._api_host = (urllib.parse.urlsplit(self.api_base).hostname or "").lower()
        self._on_secret = on_new_token
        self.token = AccessToken(
            self._fetch_token, margin_s=TOKEN_MARGIN_S, on_new_token=on_new_token, clock=clock
        )
        #: Set when DingTalk rejected the app credentials: the channel stops the bot.
        self.auth_failed = trio.Event()

    def __repr__(self) -> str:
        return f"DingTalkApi(api_base={self.api_base!r})"

    # -- credentials --------------------------------------------------------------------

    async def _fetch_token(self) -> tuple[str, float]:
        what = "POST /v1.0/oauth2/accessToken"
        resp = await counted(
            what,
            self._http.post(
                self.api_base + "/v1.0/oauth2/accessToken",
                content=m.encode({"appKey": self._client_id, "appSecret": self._secret}),
                headers={"Content-Type": "application/json", "Accept": "application/json"},
            ),
        )
        if resp.status_code != 200:
            body = error_body(resp.content)
            if is_auth_rejection(resp.status_code, body):
                self.auth_failed.set()
                raise AuthError(
                    f"{what}: DingTalk rejected the app credentials "
                    f"(HTTP {resp.status_code} {body.code or ''})".rstrip()
                )
            raise classify_error(resp.status_code, body, what)
        token = self._decoded(m.token_decoder, resp.content, what)
        return token.accessToken, token.expireIn

    async def reachable(self) -> None:
        """Does the OpenAPI answer again?  (A fresh access token: cheap, changes nothing;
        before the one repeat of a send whose outcome is unknown, see :mod:`.render`.)"""
        await self._fetch_token()

    async def open_connection(self) -> m.Connection:
        """``POST /v1.0/gateway/connections/open``: a Stream endpoint and a fresh ticket."""
        what = "POST /v1.0/gateway/connections/open"
        body = {
            "clientId": self._client_id,
            "clientSecret": self._secret,
            "subscriptions": subscriptions(),
            "ua": f"dshim/{__version__}",
        }
        resp = await counted(
            what,
            self._http.post(
                self.api_base + "/v1.0/gateway/connections/open",
                content=m.encode(body),
                headers={"Content-Type": "application/json", "Accept": "application/json"},
            ),
        )
        if resp.status_code != 200:
            err = error_body(resp.content)
            if is_auth_rejection(resp.status_code, err):
                self.auth_failed.set()
                raise AuthError(f"{what}: DingTalk rejected the app credentials")
            raise classify_error(
                resp.status_code, err, what, retry_after=parse_retry_after(resp.headers)
            )
        conn = self._decoded(m.connection_decoder, resp.content, what)
        if self._on_secret is not None:
            self._on_secret(conn.ticket)  # a credential for 90 s: never logged
        return conn

    # -- the request loop ---------------------------------------------------------------

    def _decoded(self, decoder: msgspec.json.Decoder[T], content: bytes, what: str) -> T:
        try:
            return decode(decoder, content)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RemoteProtocolError(f"{what}: unexpected response: {str(exc)[:200]}") from exc

    async def call(self, method: str, path: str, body: Any, *, what: str | None = None) -> bytes:
        """One OpenAPI call on ``api_base`` with the access token (refreshed once on 401)."""
        name = what or f"{method} {path}"
        payload = m.encode(body) if body is not None else None

        async def attempt(token: str) -> bytes:
            resp = await counted(
                name,
                self._http.request(
                    method,
                    self.api_base + path,
                    content=payload,
                    headers={
                        "Content-Type": "application/json",
                        "Accept": "application/json",
                        "x-acs-dingtalk-access-token": token,
                    },
                ),
            )
            if resp.status_code >= 400:
                raise classify_error(
                    resp.status_code,
                    error_body(resp.content),
                    name,
                    retry_after=parse_retry_after(resp.headers),
                )
            return resp.content

        try:
            return await self.token.call(attempt)
        except AuthError:
            self.auth_failed.set()
            raise

    # -- endpoints ------------------------------------------------------------------------

    async def create_card(self, out_track_id: str, template_id: str) -> None:
        """``POST /v1.0/card/instances``: a streaming AI card, not delivered yet."""
        await self.call(
            "POST",
            "/v1.0/card/instances",
            {
                "cardTemplateId": template_id,
                "outTrackId": out_track_id,
                "cardData": {"cardParamMap": {"config": '{"autoLayout":true}'}},
                "callbackType": "STREAM",
                "imGroupOpenSpaceModel": {"supportForward": True},
                "imRobotOpenSpaceModel": {"supportForward": True},
            },
        )

    async def deliver_card(
        self,
        out_track_id: str,
        *,
        direct: bool,
        staff_id: str,
        conversation_id: str,
        at: dict[str, str] | None = None,
    ) -> None:
        """``POST /v1.0/card/instances/deliver`` to the direct chat or the group."""
        body: dict[str, Any] = {"outTrackId": out_track_id, "userIdType": 1}
        if direct:
            body["openSpaceId"] = f"dtv1.card//IM_ROBOT.{staff_id}"
            body["imRobotOpenDeliverModel"] = {
                "spaceType": "IM_ROBOT",
                "robotCode": self.robot_code,
            }
        else:
            body["openSpaceId"] = f"dtv1.card//IM_GROUP.{conversation_id}"
            model: dict[str, Any] = {"robotCode": self.robot_code}
            if at:
                model["atUserIds"] = at
            body["imGroupOpenDeliverModel"] = model
        await self.call("POST", "/v1.0/card/instances/deliver", body)

    async def stream_card(
        self, out_track_id: str, guid: str, content: str, *, finalize: bool, error: bool = False
    ) -> None:
        """``PUT /v1.0/card/streaming``: the whole text (``isFull``) under a new ``guid``."""
        await self.call(
            "PUT",
            "/v1.0/card/streaming",
            {
                "outTrackId": out_track_id,
                "guid": guid,
                "key": "msgContent",
                "content": content,
                "isFull": True,
                "isFinalize": finalize,
                "isError": error,
            },
        )

    async def update_card(self, out_track_id: str, params: dict[str, str]) -> None:
        """``PUT /v1.0/card/instances``: card variables (``flowStatus``)."""
        await self.call(
            "PUT",
            "/v1.0/card/instances",
            {
                "outTrackId": out_track_id,
                "cardData": {"cardParamMap": params},
                "cardUpdateOptions": {"updateCardDataByKey": True},
            },
        )

    async def send_markdown(
        self, *, direct: bool, staff_id: str, conversation_id: str, title: str, text: str
    ) -> str:
        """Robot OpenAPI send (``oToMessages/batchSend`` / ``groupMessages/send``); returns
        the ``processQueryKey``."""
        param = m.encode({"title": title, "text": text}).decode()
        if direct:
            path = "/v1.0/robot/oToMessages/batchSend"
            body: dict[str, Any] = {"robotCode": self.robot_code, "userIds": [staff_id]}
        else:
            path = "/v1.0/robot/groupMessages/send"
            body = {"robotCode": self.robot_code, "openConversationId": conversation_id}
        body.update({"msgKey": "sampleMarkdown", "msgParam": param})
        content = await self.call("POST", path, body)
        result = self._decoded(m.send_decoder, content, f"POST {path}")
        if not result.processQueryKey:
            raise RemoteProtocolError(f"POST {path}: no processQueryKey in the answer")
        return result.processQueryKey

    def webhook_allowed(self, url: str) -> bool:
        """A payload's ``sessionWebhook`` is used only on ``oapi_base``'s host."""
        parts = urllib.parse.urlsplit(url)
        return (parts.hostname or "").lower() == self._oapi_host and parts.scheme in (
            "https",
            urllib.parse.urlsplit(self.oapi_base).scheme,
        )

    async def send_webhook(self, url: str, body: dict[str, Any]) -> None:
        """``POST <sessionWebhook>``; an ``errcode`` != 0 on 200 is an error too."""
        what = "POST sessionWebhook"
        if not self.webhook_allowed(url):
            raise PermissionDenied(f"{what}: refusing a webhook outside {self._oapi_host}")
        resp = await counted(
            what,
            self._http.post(
                url, content=m.encode(body), headers={"Content-Type": "application/json"}
            ),
        )
        err = error_body(resp.content)
        if resp.status_code >= 400 or (err.errcode not in (None, 0)):
            raise classify_error(
                resp.status_code, err, what, retry_after=parse_retry_after(resp.headers)
            )

    async def download(self, download_code: str, max_bytes: int) -> bytes:
        """``POST /v1.0/robot/messageFiles/download`` then the short-lived URL, capped."""
        content = await self.call(
            "POST",
            "/v1.0/robot/messageFiles/download",
            {"downloadCode": download_code, "robotCode": self.robot_code},
        )
        url = self._decoded(m.download_decoder, content, "messageFiles/download").downloadUrl
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower()
        if parts.scheme != "https" and host not in (self._api_host, self._oapi_host):
            raise PermissionDenied("media download: refusing a non-https URL")
        return await download_capped(self._http, url, max_bytes, what="media download")

    async def add_reaction(self, msg_id: str, conversation_id: str) -> None:
        """``POST /v1.0/robot/emotion/reply``: the "working on it" reaction."""
        await self.call("POST", "/v1.0/robot/emotion/reply", self._emotion(msg_id, conversation_id))

    async def remove_reaction(self, msg_id: str, conversation_id: str) -> None:
        await self.call(
            "POST", "/v1.0/robot/emotion/recall", self._emotion(msg_id, conversation_id)
        )

    def _emotion(self, msg_id: str, conversation_id: str) -> dict[str, Any]:
        name = "🤔思考中"
        return {
            "robotCode": self.robot_code,
            "openMsgId": msg_id,
            "openConversationId": conversation_id,
            "emotionType": 2,
            "emotionName": name,
            "textEmotion": {
                "emotionId": "2659900",
                "emotionName": name,
                "text": name,
                "backgroundId": "im_bg_1",
            },
        }


# --- the stream ----------------------------------------------------------------------------

#: The channel's side: one robot callback into the pipeline (None: not a message).
StreamDeliverer = Callable[[RobotCallback], Awaitable[Verdict | None]]


async def next_connection_url(api: DingTalkApi, *, backoff: Backoff) -> str:
    """Register for a fresh ticket, retrying transient failures; AuthError is raised."""
    while True:
        try:
            conn = await api.open_connection()
        except (AuthError, FatalChannelError):
            raise
        except PermissionDenied as exc:
            raise AuthError(f"Stream registration refused: {exc}") from exc
        except ChannelError as exc:
            retry_after = exc.retry_after if isinstance(exc, RateLimited) else None
            delay = backoff.next_delay(retry_after=retry_after)
            log.warning("stream_registration_failed", error=str(exc), retry_in_s=round(delay, 2))
            await trio.sleep(delay)
            continue
        if not conn.endpoint.startswith(("ws://", "wss://")):
            delay = backoff.next_delay()
            log.warning("stream_endpoint_refused", reason="not a websocket URL", retry_in_s=delay)
            await trio.sleep(delay)
            continue
        sep = "&" if "?" in conn.endpoint else "?"
        return f"{conn.endpoint}{sep}ticket={urllib.parse.quote(conn.ticket, safe='')}"


async def run_stream(
    api: DingTalkApi,
    deliver: StreamDeliverer,
    *,
    backoff: Backoff | None = None,
    options: WsOptions = WS_OPTIONS,
    handover_close_s: float = 10.0,
    on_connected: Callable[[Connected], None] | None = None,
) -> NoReturn:
    """Keep the Stream connection forever (see the module docstring).

    Raises AuthError when the credentials are refused; every other end reconnects: at
    once after a connection that was live ``stable_after_s``, else after the backoff.
    """
    backoff = backoff or Backoff()

    async def next_url() -> str:
        return await next_connection_url(api, backoff=backoff)

    def new_session() -> StreamSession:
        return StreamSession(handover_close_s=handover_close_s)

    await run_ws_handover(
        new_session, next_url, deliver, backoff=backoff, options=options, on_connected=on_connected
    )
