"""The hand-written Bot API client: thin trio I/O over one shared ``httpx.AsyncClient``.

Every method is one HTTPS request ``POST {api_base}/bot<token>/<method>`` with a JSON
body; the envelope is decoded and errors are classified once, in
:func:`dshim.channels.telegram.protocol.api_error`.  httpx exceptions are mapped here, at
the boundary, by the kit (:func:`~dshim.net.http.map_httpx_errors`): a
:class:`~dshim.errors.TransportError` says with ``request_sent`` whether the request can
have reached Telegram.  Telegram has no idempotency key, so nothing here repeats a call
on its own: whoever retries a send decides knowing that.  The token sits in the URL path:
no message built here contains a URL, and the token is registered with the log redactor
by the channel as a backstop.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

from dshim.channels.telegram import models as m
from dshim.channels.telegram import protocol
from dshim.channels.telegram.protocol import NotModified
from dshim.errors import NotFound, TooLarge
from dshim.model import Fetcher
from dshim.net import http as kit_http

DEFAULT_API_BASE = "https://api.telegram.org"
#: Ordinary calls: connect, write and pool 10 s; read 30 s.
CALL_TIMEOUT = httpx.Timeout(10.0, read=30.0)
#: getUpdates: the read timeout is comfortably above the 25 s long-poll window, so a
#: quiet chat ends with the server's empty answer, not with a client timeout.
POLL_READ_MARGIN_S = 15.0
#: File downloads: slow links get a longer read timeout (the turn has its own deadline).
DOWNLOAD_TIMEOUT = httpx.Timeout(10.0, read=60.0)
USER_AGENT = "dshim (+telegram bot api client)"


def poll_timeout(poll_s: float) -> httpx.Timeout:
    return httpx.Timeout(10.0, read=poll_s + POLL_READ_MARGIN_S)


class BotApiClient:
    """The Bot API methods dshim uses.  Raises the :mod:`dshim.errors` tree.

    ``http`` is the bot's one client, from :func:`dshim.net.http.open_http`
    with :data:`USER_AGENT` and :data:`CALL_TIMEOUT` (one pool for polling and sending).
    """

    def __init__(self, http: httpx.AsyncClient, token: str) -> None:
        self._http = http
        self._token = token
        self._poster = kit_http.JsonPoster(http)

    def __repr__(self) -> str:
        return f"BotApiClient(base={str(self._http.base_url)!r})"

    # -- transport ---------------------------------------------------------------------

    async def _post(
        self, method: str, params: dict[str, Any], http_timeout: httpx.Timeout
    ) -> kit_http.Answer:
        return await kit_http.counted(
            method, self._poster.post(f"/bot{self._token}/{method}", params, http_timeout)
        )

    async def call(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        http_timeout: httpx.Timeout = CALL_TIMEOUT,
        file: bool = False,
    ) -> m.Envelope:
        """Call a method; returns the envelope of a successful answer.

        ``file`` marks getFile (see :func:`~dshim.channels.telegram.protocol.api_error`).
        """
        resp = await self._post(method, params or {}, http_timeout)
        return protocol.decode_envelope(method, resp.status_code, resp.content, file=file)

    async def _result(
        self,
        method: str,
        params: dict[str, Any] | None,
        decoder: msgspec.json.Decoder[Any],
        *,
        http_timeout: httpx.Timeout = CALL_TIMEOUT,
        file: bool = False,
    ) -> Any:
        env = await self.call(method, params, http_timeout=http_timeout, file=file)
        return protocol.decode_result(method, env, decoder)

    # -- methods -----------------------------------------------------------------------

    async def get_me(self) -> m.Me:
        me: m.Me = await self._result("getMe", None, m.ME_DECODER)
        return me

    async def get_chat_member(self, chat_id: int, user_id: int) -> str:
        """A user's status in a chat (``member``, ``administrator``, ``left`` ...)."""
        member: m.ChatMember = await self._result(
            "getChatMember", {"chat_id": chat_id, "user_id": user_id}, m.CHAT_MEMBER_DECODER
        )
        return member.status

    async def get_webhook_info(self) -> m.WebhookInfo:
        info: m.WebhookInfo = await self._result("getWebhookInfo", None, m.WEBHOOK_DECODER)
        return info

    async def get_updates(self, params: dict[str, Any]) -> list[bytes]:
        """One (long) poll; returns each update's raw JSON (for the durable inbox).

        The updates are split, not decoded: each is decoded on its own by the mapping.
        """
        wait = float(params.get("timeout", 0))
        resp = await self._post("getUpdates", params, poll_timeout(wait))
        return protocol.decode_updates("getUpdates", resp.status_code, resp.content)

    async def send_message(self, params: dict[str, Any]) -> m.SentMessage:
        sent: m.SentMessage = await self._result("sendMessage", params, m.SENT_DECODER)
        return sent

    async def edit_message_text(
        self,
        chat_id: int,
        message_id: int,
        text: str,
        *,
        entities: list[dict[str, Any]] | None = None,
    ) -> None:
        """Edit a text message; an edit that changes nothing is a success."""
        params: dict[str, Any] = {
            "chat_id": chat_id,
            "message_id": message_id,
            "text": text,
            "link_preview_options": {"is_disabled": True},
        }
        if entities:
            params["entities"] = entities
        try:
            await self.call("editMessageText", params)
        except NotModified:
            return

    async def send_chat_action(
        self, chat_id: int, action: str = "typing", *, thread_id: int | None = None
    ) -> None:
        params: dict[str, Any] = {"chat_id": chat_id, "action": action}
        if thread_id is not None:
            params["message_thread_id"] = thread_id
        await self.call("sendChatAction", params)

    async def set_my_commands(self, commands: list[tuple[str, str]]) -> None:
        await self.call(
            "setMyCommands",
            {"commands": [{"command": c, "description": d} for c, d in commands]},
        )

    async def get_file(self, file_id: str) -> m.File:
        f: m.File = await self._result("getFile", {"file_id": file_id}, m.FILE_DECODER, file=True)
        return f

    async def download(self, file_path: str, max_bytes: int) -> bytes:
        """Download a file, never reading more than ``max_bytes`` (ChannelError when over).

        A link that expired or a file that is gone answers 404: NotFound, never AuthError.
        """
        try:
            return await kit_http.download_capped(
                self._http,
                f"/file/bot{self._token}/{file_path}",
                max_bytes,
                http_timeout=DOWNLOAD_TIMEOUT,
                what="file download",
            )
        except NotFound as exc:
            raise NotFound(
                f"file download: the file is unavailable (HTTP {exc.status}: the link "
                "expired or the file is gone)",
                status=exc.status,
            ) from exc

    async def fetch_file(self, file_id: str, max_bytes: int) -> bytes:
        """getFile, then download (the link is fresh: it is asked for inside the turn)."""
        f = await self.get_file(file_id)
        if f.file_size is not None and f.file_size > max_bytes:
            raise TooLarge(f"the file is {f.file_size} bytes, over the {max_bytes} byte limit")
        if not f.file_path:
            raise NotFound("getFile: the file is unavailable (no file_path in the answer)")
        return await self.download(f.file_path, max_bytes)

    def fetcher(self, file_id: str, size: int | None) -> Fetcher:
        """A lazy download handle for :class:`~dshim.model.MediaRef` (nothing happens yet)."""

        async def fetch(max_bytes: int) -> bytes:
            return await self.fetch_file(file_id, max_bytes)

        return fetch
