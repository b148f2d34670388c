"""The hand-written iLink client: thin trio I/O over the bot's one ``httpx.AsyncClient``.

Every call is ``POST {base}/ilink/bot/<path>`` with a JSON body carrying ``base_info``
and the iLink headers (``AuthorizationType: ilink_bot_token``, ``Authorization: Bearer``,
a fresh ``X-WECHAT-UIN`` per request); the QR login calls go to the login host without
the token.  httpx failures are mapped once by the kit (:func:`~dshim.net.http.counted`),
``ret``/``errcode`` by :func:`dshim.channels.weixin.protocol.api_error`.  iLink has no
idempotency key: nothing here repeats a send on its own.  No message built here contains
a URL, a token, a context token or a typing ticket.
"""

from __future__ import annotations

import random
import urllib.parse
from typing import Any

import httpx
import msgspec

import dshim
from dshim.channels.weixin import media as crypto
from dshim.channels.weixin import models as m
from dshim.channels.weixin import protocol
from dshim.channels.weixin.protocol import MediaHandle, UpdateBatch
from dshim.errors import ChannelError, RateLimited, TooLarge, TransportError
from dshim.model import Fetcher
from dshim.net import http as kit_http

USER_AGENT = f"dshim/{dshim.__version__} (+weixin ilink client)"
BOT_AGENT = f"dshim/{dshim.__version__}"
APP_ID = "bot"
#: Ordinary calls: connect, write and pool 10 s; read 15 s.
CALL_TIMEOUT = httpx.Timeout(10.0, read=15.0)
#: The long poll's read timeout stays this far above the server's window.
POLL_READ_MARGIN_S = 10.0
#: ``get_qrcode_status`` is held by the server; the plugin waits 35 s.
QR_STATUS_TIMEOUT = httpx.Timeout(10.0, read=40.0)
DOWNLOAD_TIMEOUT = httpx.Timeout(10.0, read=60.0)
#: The hosts media may be downloaded from (besides the configured CDN's).
CDN_HOSTS = frozenset({"novac2c.cdn.weixin.qq.com"})


def poll_timeout(window_s: float) -> httpx.Timeout:
    return httpx.Timeout(10.0, read=window_s + POLL_READ_MARGIN_S)


class IlinkClient:
    """The iLink calls dshim makes.  Raises the :mod:`dshim.errors` tree."""

    def __init__(
        self,
        http: httpx.AsyncClient,
        token: str | None,
        *,
        cdn_base: str = protocol.DEFAULT_CDN_BASE,
        rng: random.Random | None = None,
    ) -> None:
        self._http = http
        self._token = token
        self._rng = rng or random.Random()
        self.cdn_base = cdn_base.rstrip("/")
        self._version = dshim.__version__
        cdn = urllib.parse.urlsplit(self.cdn_base)
        self._cdn_hosts = CDN_HOSTS | {(cdn.hostname or "").lower()}
        self._cdn_scheme = cdn.scheme

    def __repr__(self) -> str:
        return f"IlinkClient(base={str(self._http.base_url)!r})"

    # -- transport ---------------------------------------------------------------------

    def _headers(self, *, auth: bool) -> dict[str, str]:
        headers = {
            "iLink-App-Id": APP_ID,
            "iLink-App-ClientVersion": str(protocol.client_version(self._version)),
            "AuthorizationType": "ilink_bot_token",
            "X-WECHAT-UIN": protocol.uin_header(self._rng.getrandbits(32)),
        }
        if auth and self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        return headers

    def _base_info(self) -> dict[str, str]:
        return {"channel_version": self._version, "bot_agent": BOT_AGENT}

    async def _post(
        self,
        path: str,
        body: dict[str, Any],
        *,
        http_timeout: httpx.Timeout = CALL_TIMEOUT,
        auth: bool = True,
        base: str | None = None,
    ) -> bytes:
        url = f"{base.rstrip('/')}/ilink/bot/{path}" if base else f"/ilink/bot/{path}"
        payload = msgspec.json.encode(body)
        resp = await kit_http.counted(
            path,
            self._http.post(
                url,
                content=payload,
                headers={**self._headers(auth=auth), "Content-Type": "application/json"},
                timeout=http_timeout,
            ),
        )
        if resp.status_code != 200:
            raise kit_http.status_error(resp.status_code, path, headers=resp.headers)
        return resp.content

    async def call(
        self,
        path: str,
        body: dict[str, Any],
        decoder: msgspec.json.Decoder[Any] = m.ENVELOPE_DECODER,
        *,
        http_timeout: httpx.Timeout = CALL_TIMEOUT,
    ) -> Any:
        """One authenticated call with ``base_info``; returns the decoded answer."""
        raw = await self._post(
            path, {**body, "base_info": self._base_info()}, http_timeout=http_timeout
        )
        return protocol.decode_envelope(path, raw, decoder)

    # -- lifecycle ---------------------------------------------------------------------

    async def notify_start(self) -> None:
        """``msg/notifystart``: announces the bot (and proves the token)."""
        await self.call("msg/notifystart", {})

    async def notify_stop(self) -> None:
        await self.call("msg/notifystop", {})

    # -- receiving ---------------------------------------------------------------------

    async def get_updates(self, cursor: str | None, window_s: float) -> UpdateBatch:
        """One long poll from ``cursor``.  A client-side read timeout is an empty batch."""
        body = {"get_updates_buf": cursor or "", "base_info": self._base_info()}
        try:
            raw = await self._post("getupdates", body, http_timeout=poll_timeout(window_s))
        except TransportError as exc:
            if isinstance(exc.__cause__, httpx.ReadTimeout):
                return UpdateBatch([], None, None)
            raise
        return protocol.decode_updates(raw)

    # -- sending -----------------------------------------------------------------------

    async def send_message(self, msg: dict[str, object]) -> str | None:
        """``sendmessage``; the server's ``message_id`` when the answer carries one.
        ``ret != 0`` on HTTP 200 raises (it is never a delivery)."""
        sent: m.Sent = await self.call("sendmessage", {"msg": msg}, m.SENT_DECODER)
        return protocol.id_str(sent.message_id)

    async def get_typing_ticket(self, user: str, context_token: str | None) -> str | None:
        body: dict[str, Any] = {"ilink_user_id": user}
        if context_token:
            body["context_token"] = context_token
        cfg: m.Config = await self.call("getconfig", body, m.CONFIG_DECODER)
        return cfg.typing_ticket or None

    async def reachable(self, user: str | None = None) -> None:
        """Does iLink answer?  ``getconfig`` (a typing ticket: read-only, nothing the user
        sees, no cursor; ``getupdates`` would race the poller and ``notifystart`` announces
        the bot).  Any iLink answer counts, also a ``ret`` refusal; only a network failure,
        a 5xx or a 429 raises."""
        try:
            await self.call("getconfig", {"ilink_user_id": user or ""}, m.CONFIG_DECODER)
        except (TransportError, RateLimited):
            raise
        except ChannelError:
            return

    async def send_typing(self, user: str, ticket: str, status: int) -> None:
        await self.call(
            "sendtyping", {"ilink_user_id": user, "typing_ticket": ticket, "status": status}
        )

    # -- login (no token, no base_info) ------------------------------------------------

    async def get_bot_qrcode(self, base: str, local_tokens: list[str]) -> m.QrCode:
        raw = await self._post(
            "get_bot_qrcode?bot_type=3",
            {"local_token_list": local_tokens[:10]},
            auth=False,
            base=base,
        )
        qr = protocol.decode_envelope("get_bot_qrcode", raw, m.QRCODE_DECODER)
        return qr

    async def get_qrcode_status(
        self, base: str, qrcode: str, verify_code: str | None = None
    ) -> m.QrStatus:
        """One status poll; a client timeout or a gateway error is ``wait``."""
        params = {"qrcode": qrcode}
        if verify_code:
            params["verify_code"] = verify_code
        url = f"{base.rstrip('/')}/ilink/bot/get_qrcode_status?{urllib.parse.urlencode(params)}"
        headers = {k: v for k, v in self._headers(auth=False).items() if k.startswith("iLink")}
        try:
            resp = await kit_http.counted(
                "get_qrcode_status",
                self._http.get(url, headers=headers, timeout=QR_STATUS_TIMEOUT),
            )
        except TransportError as exc:
            if isinstance(exc.__cause__, httpx.TimeoutException):
                return m.QrStatus(status="wait")
            raise
        if resp.status_code in (502, 504, 524):
            return m.QrStatus(status="wait")
        if resp.status_code != 200:
            raise kit_http.status_error(resp.status_code, "get_qrcode_status")
        st = protocol.decode_envelope("get_qrcode_status", resp.content, m.QRSTATUS_DECODER)
        return st

    # -- media -------------------------------------------------------------------------

    def media_url(self, handle: MediaHandle) -> str:
        """Where to download a media item: its ``full_url`` when it is on the CDN, else
        the CDN's download route with the signed parameter."""
        if handle.full_url:
            parts = urllib.parse.urlsplit(handle.full_url)
            secure = parts.scheme == "https" or parts.scheme == self._cdn_scheme
            if secure and (parts.hostname or "").lower() in self._cdn_hosts:
                return handle.full_url
        if not handle.param:
            raise ChannelError("media: no download reference")
        query = urllib.parse.quote(handle.param, safe="")
        return f"{self.cdn_base}/download?encrypted_query_param={query}"

    async def download(self, handle: MediaHandle, max_bytes: int) -> bytes:
        """Download and decrypt one media item, never more than ``max_bytes`` of it."""
        data = await kit_http.download_capped(
            self._http,
            self.media_url(handle),
            max_bytes + crypto.BLOCK,
            allowed_hosts=frozenset(self._cdn_hosts),
            http_timeout=DOWNLOAD_TIMEOUT,
            what=f"{handle.kind} download",
        )
        plain = crypto.decrypt(data, handle.key) if handle.key is not None else data
        if len(plain) > max_bytes:
            raise TooLarge(f"{handle.kind} download: over the {max_bytes} byte limit")
        return plain

    def fetcher(self, handle: MediaHandle) -> Fetcher:
        """A lazy download handle for :class:`~dshim.model.MediaRef` (nothing happens yet)."""

        async def fetch(max_bytes: int) -> bytes:
            return await self.download(handle, max_bytes)

        return fetch
