"""Thin trio I/O for Feishu / Lark: the Open API client and the long-connection loop.

REST
----
Paths are relative to the bot's ``api_base`` (``https://open.feishu.cn`` or
``https://open.larksuite.com``) on its one HTTP client.  Every call but the token and the
endpoint call carries ``Authorization: Bearer <tenant_access_token>`` from one
:class:`~dshim.net.http.AccessToken` (renewed when less than 30 minutes are left,
refreshed once on the token error codes, one refresh shared by concurrent callers).
Every answer's JSON ``code`` is checked (HTTP 200 with ``code != 0`` is a failure, and
business errors come as HTTP 400) and mapped once by
:func:`~.protocol.classify_error`; a 429's ``x-ogw-ratelimit-reset`` becomes
``RateLimited.retry_after``.  httpx failures become TransportError in the kit.

Long connection
---------------
:func:`run_connection` runs :class:`~.protocol.FeishuSession` on the kit's websocket
runner; its plan step fetches a fresh URL from ``POST /callback/ws/endpoint`` before every
connection (the URL carries credentials: it is registered as a secret and never logged).
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
from dshim.channels.feishu import models as m
from dshim.channels.feishu.protocol import (
    FeishuEvent,
    FeishuSession,
    classify_error,
    endpoint_error,
)
from dshim.channels.kit import Backoff
from dshim.channels.kit.decode import decode
from dshim.errors import AuthError, ChannelError, FatalChannelError, RemoteProtocolError
from dshim.net.http import AccessToken, counted, download_capped, status_error
from dshim.net.ws import Deliverer, WsOptions, run_ws

log = structlog.get_logger("dshim.feishu")

DOMAINS = {"feishu": "https://open.feishu.cn", "lark": "https://open.larksuite.com"}
USER_AGENT = f"dshim/{__version__} (feishu)"
HTTP_TIMEOUT = httpx.Timeout(10.0, read=30.0)
WS_OPTIONS = WsOptions()
TOKEN_PATH = "/open-apis/auth/v3/tenant_access_token/internal"
ENDPOINT_PATH = "/callback/ws/endpoint"

T = TypeVar("T")


class RestClient:
    """The Feishu Open API on a shared ``httpx.AsyncClient``; see the module docstring."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        app_id: str,
        app_secret: str,
        api_base: str,
        on_new_token: Callable[[str], None] | None = None,
        clock: Callable[[], float] = trio.current_time,
        fixed_token: str | None = None,
    ) -> None:
        self._http = http
        self.app_id = app_id
        self._app_secret = app_secret
        self.api_base = api_base.rstrip("/")
        self._host = (urllib.parse.urlsplit(self.api_base).hostname or "").lower()
        fetch = self._fetch_token
        if fixed_token is not None:  # replay: lookups only, no token endpoint

            async def fetch() -> tuple[str, float]:
                return fixed_token, 7200.0

        self.token = AccessToken(fetch, on_new_token=on_new_token, clock=clock)

    def __repr__(self) -> str:
        return f"RestClient(api_base={self.api_base!r})"

    # -- auth ---------------------------------------------------------------------------

    async def _fetch_token(self) -> tuple[str, float]:
        body = {"app_id": self.app_id, "app_secret": self._app_secret}
        content = await self._post_plain(TOKEN_PATH, body, "POST tenant_access_token")
        answer = self._decode(m.token_decoder, content, "tenant_access_token")
        if answer.code != 0 or not answer.tenant_access_token:
            raise AuthError(
                f"tenant_access_token: Feishu rejected the app credentials (code {answer.code})",
                code=answer.code,
            )
        return answer.tenant_access_token, float(answer.expire or 7200)

    async def ws_endpoint(self) -> m.EndpointData:
        """``POST /callback/ws/endpoint``: a fresh long-connection URL and its ClientConfig."""
        body = {"AppID": self.app_id, "AppSecret": self._app_secret}
        content = await self._post_plain(
            ENDPOINT_PATH, body, "POST /callback/ws/endpoint", headers={"locale": "zh"}
        )
        answer = self._decode(m.endpoint_decoder, content, "ws endpoint")
        if answer.code != 0 or answer.data is None or not answer.data.url:
            raise endpoint_error(answer.code, answer.msg)
        return answer.data

    async def _post_plain(
        self, path: str, body: Any, what: str, *, headers: dict[str, str] | None = None
    ) -> bytes:
        """A POST without a token (token and endpoint calls)."""
        resp = await counted(
            what,
            self._http.post(
                path,
                content=m.encode(body),
                headers={"Content-Type": "application/json; charset=utf-8", **(headers or {})},
            ),
        )
        if resp.status_code >= 500 or resp.status_code == 429:
            raise status_error(resp.status_code, what, headers=resp.headers)
        return resp.content

    # -- endpoints ----------------------------------------------------------------------

    async def bot_info(self) -> m.BotInfo:
        """``GET /open-apis/bot/v3/info``: the bot's open_id and name."""
        content = await self.call("GET", "/open-apis/bot/v3/info", what="GET bot/v3/info")
        answer = self._decode(m.bot_decoder, content, "bot info")
        if answer.bot is None or not answer.bot.open_id:
            raise RemoteProtocolError("bot info: no bot in the answer (is the bot enabled?)")
        return answer.bot

    async def get_message(self, message_id: str) -> m.MessageAnswer:
        """``GET /open-apis/im/v1/messages/{id}`` with open ids and the raw card content."""
        content = await self.call(
            "GET",
            f"/open-apis/im/v1/messages/{_q(message_id)}",
            params={"user_id_type": "open_id", "card_msg_content_type": "raw_card_content"},
            what="GET im/v1/messages/{message_id}",
        )
        return self._decode(m.message_decoder, content, "message get")

    async def user_profile(self, user_id: str, id_type: str = "open_id") -> m.ContactAnswer:
        """``GET /open-apis/contact/v3/users/{id}`` (``user_id_type`` open_id / union_id)."""
        content = await self.call(
            "GET",
            f"/open-apis/contact/v3/users/{_q(user_id)}",
            params={"user_id_type": id_type},
            what="GET contact/v3/users/{user_id}",
        )
        return self._decode(m.contact_decoder, content, "user get")

    async def ids_by_email(self, emails: list[str]) -> m.IdAnswer:
        """``POST /open-apis/contact/v3/users/batch_get_id`` for open_ids by email."""
        content = await self.call(
            "POST",
            "/open-apis/contact/v3/users/batch_get_id",
            json={"emails": emails},
            params={"user_id_type": "open_id"},
            what="POST contact/v3/users/batch_get_id",
        )
        return self._decode(m.ids_decoder, content, "batch_get_id")

    async def reply(
        self,
        message_id: str,
        msg_type: str,
        content: str,
        *,
        uuid: str,
        in_thread: bool = False,
    ) -> str:
        """``POST messages/{id}/reply``; returns the new message's id."""
        body: dict[str, Any] = {"msg_type": msg_type, "content": content, "uuid": uuid}
        if in_thread:
            body["reply_in_thread"] = True
        return await self._sent(
            "POST",
            f"/open-apis/im/v1/messages/{_q(message_id)}/reply",
            body,
            "POST im/v1/messages/{message_id}/reply",
        )

    async def create(
        self,
        chat_id: str,
        msg_type: str,
        content: str,
        *,
        uuid: str,
        receive_id_type: str = "chat_id",
    ) -> str:
        """``POST messages?receive_id_type=chat_id`` (or ``open_id``: a person's DM);
        returns the new message's id."""
        body = {"receive_id": chat_id, "msg_type": msg_type, "content": content, "uuid": uuid}
        return await self._sent(
            "POST",
            "/open-apis/im/v1/messages",
            body,
            "POST im/v1/messages",
            params={"receive_id_type": receive_id_type},
        )

    async def edit(self, message_id: str, msg_type: str, content: str) -> None:
        """``PUT messages/{id}``: replace a text/post message's content (at most 20 times)."""
        await self.call(
            "PUT",
            f"/open-apis/im/v1/messages/{_q(message_id)}",
            json={"msg_type": msg_type, "content": content},
            what="PUT im/v1/messages/{message_id}",
        )

    async def patch_card(self, message_id: str, card_json: str) -> None:
        """``PATCH messages/{id}``: replace a sent card (not a CardKit entity)."""
        await self.call(
            "PATCH",
            f"/open-apis/im/v1/messages/{_q(message_id)}",
            json={"content": card_json},
            what="PATCH im/v1/messages/{message_id}",
        )

    async def create_card(self, card_json: str) -> str:
        """``POST cardkit/v1/cards``: a card entity; returns its ``card_id``.  The body is
        ``type`` and ``data`` only: there is no idempotency key, every call is a new
        entity (the caller reuses the id it got)."""
        content = await self.call(
            "POST",
            "/open-apis/cardkit/v1/cards",
            json={"type": "card_json", "data": card_json},
            what="POST cardkit/v1/cards",
        )
        answer = self._decode(m.sent_decoder, content, "card create")
        if answer.data is None or not answer.data.card_id:
            raise RemoteProtocolError("card create: no card_id in the answer")
        return answer.data.card_id

    async def card_content(
        self, card_id: str, element_id: str, text: str, *, sequence: int, uuid: str
    ) -> None:
        """``PUT cardkit/v1/cards/{id}/elements/{element}/content``: the full text so far."""
        await self.call(
            "PUT",
            f"/open-apis/cardkit/v1/cards/{_q(card_id)}/elements/{_q(element_id)}/content",
            json={"content": text, "sequence": sequence, "uuid": uuid},
            what="PUT cardkit/v1/cards/{card_id}/elements/{element_id}/content",
        )

    async def card_settings(self, card_id: str, settings: str, *, sequence: int, uuid: str) -> None:
        """``PATCH cardkit/v1/cards/{id}/settings`` (streaming mode off, summary)."""
        await self.call(
            "PATCH",
            f"/open-apis/cardkit/v1/cards/{_q(card_id)}/settings",
            json={"settings": settings, "sequence": sequence, "uuid": uuid},
            what="PATCH cardkit/v1/cards/{card_id}/settings",
        )

    async def add_reaction(self, message_id: str, emoji: str) -> str:
        """``POST messages/{id}/reactions``; returns the reaction id."""
        content = await self.call(
            "POST",
            f"/open-apis/im/v1/messages/{_q(message_id)}/reactions",
            json={"reaction_type": {"emoji_type": emoji}},
            what="POST im/v1/messages/{message_id}/reactions",
        )
        answer = self._decode(m.sent_decoder, content, "reaction")
        return answer.data.reaction_id if answer.data is not None else ""

    async def delete_reaction(self, message_id: str, reaction_id: str) -> None:
        await self.call(
            "DELETE",
            f"/open-apis/im/v1/messages/{_q(message_id)}/reactions/{_q(reaction_id)}",
            what="DELETE im/v1/messages/{message_id}/reactions/{reaction_id}",
        )

    async def download(self, message_id: str, key: str, kind: str, max_bytes: int) -> bytes:
        """``GET messages/{id}/resources/{key}?type=image|file``, at most ``max_bytes``."""
        rtype = "image" if kind == "image" else "file"
        url = (
            f"{self.api_base}/open-apis/im/v1/messages/{_q(message_id)}/resources/{_q(key)}"
            f"?type={rtype}"
        )

        async def fetch(token: str) -> bytes:
            return await download_capped(
                self._http,
                url,
                max_bytes,
                allowed_hosts=frozenset({self._host}),
                headers={"Authorization": f"Bearer {token}"},
                what="GET im/v1/messages/{message_id}/resources/{file_key}",
            )

        return await self.token.call(fetch)

    # -- the request loop ---------------------------------------------------------------

    async def _sent(
        self, method: str, path: str, body: Any, what: str, *, params: dict[str, str] | None = None
    ) -> str:
        content = await self.call(method, path, json=body, params=params, what=what)
        answer = self._decode(m.sent_decoder, content, what)
        if answer.data is None or not answer.data.message_id:
            raise RemoteProtocolError(f"{what}: no message_id in the answer")
        return answer.data.message_id

    async def call(
        self,
        method: str,
        path: str,
        *,
        what: str,
        json: Any = None,
        params: dict[str, str] | None = None,
    ) -> bytes:
        """One authenticated call; the body of a ``code == 0`` answer, else the error tree."""
        body = m.encode(json) if json is not None else None

        async def once(token: str) -> bytes:
            headers = {"Authorization": f"Bearer {token}"}
            if body is not None:
                headers["Content-Type"] = "application/json; charset=utf-8"
            resp = await counted(
                what,
                self._http.request(method, path, content=body, headers=headers, params=params),
            )
            return self._check(resp, what)

        return await self.token.call(once)

    def _check(self, resp: httpx.Response, what: str) -> bytes:
        status = resp.status_code
        try:
            err = decode(m.error_decoder, resp.content)
        except (msgspec.DecodeError, msgspec.ValidationError):
            if status >= 400:
                raise status_error(status, what, headers=resp.headers) from None
            raise RemoteProtocolError(f"{what}: the answer is not JSON") from None
        if status < 400 and err.code == 0:
            return resp.content
        reset = _float(resp.headers.get("x-ogw-ratelimit-reset"))
        raise classify_error(status, err.code, what, err.msg, reset_s=reset)

    @staticmethod
    def _decode(decoder: msgspec.json.Decoder[T], content: bytes, what: str) -> T:
        try:
            return decode(decoder, content)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RemoteProtocolError(f"{what}: unexpected answer: {str(exc)[:200]}") from exc


def _q(value: str) -> str:
    return urllib.parse.quote(value, safe="")


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


# --- the long connection ---------------------------------------------------------------------


async def next_ws_url(
    session: FeishuSession,
    rest: RestClient,
    *,
    backoff: Backoff,
    register_secret: Callable[[str], None],
) -> str:
    """The URL of the next connection: wait as the reconnect rules say, then fetch one."""
    while True:
        delay = session.reconnect_delay()
        if delay > 0:
            log.info("reconnect_delayed", retry_in_s=round(delay, 2), reason="client_config")
            await trio.sleep(delay)
        try:
            endpoint = await rest.ws_endpoint()
        except (AuthError, FatalChannelError):
            raise
        except ChannelError as exc:
            wait = backoff.next_delay()
            log.warning("ws_url_failed", error=str(exc), retry_in_s=round(wait, 2))
            await trio.sleep(wait)
            continue
        for values in urllib.parse.parse_qs(urllib.parse.urlsplit(endpoint.url).query).values():
            for value in values:
                if len(value) >= 8:
                    register_secret(value)
        register_secret(endpoint.url)
        session.set_endpoint(endpoint.url, endpoint.client_config)
        log.info("ws_url_fetched", ping_interval_s=session.settings.ping_interval)
        return endpoint.url


async def run_connection(
    session: FeishuSession,
    rest: RestClient,
    deliver: Deliverer[FeishuEvent],
    *,
    backoff: Backoff,
    register_secret: Callable[[str], None],
    clock: Callable[[], float] = trio.current_time,
) -> NoReturn:
    """Keep the long connection alive forever; raises only for fatal errors."""

    async def next_url() -> str:
        return await next_ws_url(session, rest, backoff=backoff, register_secret=register_secret)

    await run_ws(session, next_url, deliver, backoff=backoff, clock=clock, options=WS_OPTIONS)
