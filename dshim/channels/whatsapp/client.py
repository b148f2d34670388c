"""The hand-written Graph API client: thin trio I/O over one shared ``httpx.AsyncClient``.

Every call carries ``Authorization: Bearer <access token>``; answers that are not 2xx
are classified once, in :func:`dshim.channels.whatsapp.protocol.graph_error`, and httpx
exceptions are mapped at this boundary by the kit (``request_sent`` tells whether a
send can have reached Meta).  The Cloud API has no idempotency key, so nothing here
repeats a call on its own.  The token is in a header, never in a URL or a message.
"""

from __future__ import annotations

import base64
import hashlib
import urllib.parse
from typing import Any, TypeVar

import httpx
import msgspec

from dshim.channels.kit import decode as kit_decode
from dshim.channels.whatsapp import models as m
from dshim.channels.whatsapp import protocol
from dshim.errors import ChannelError, PermissionDenied, RemoteProtocolError, TooLarge
from dshim.model import Fetcher
from dshim.net import http as kit_http

DEFAULT_API_BASE = "https://graph.facebook.com/v23.0"
#: Ordinary calls: connect, write and pool 10 s; read 30 s.
CALL_TIMEOUT = httpx.Timeout(10.0, read=30.0)
T = TypeVar("T")
USER_AGENT = "dshim (+whatsapp cloud api client)"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
PHONE_FIELDS = "id,display_phone_number,verified_name,quality_rating"


class GraphClient:
    """The Graph API calls dshim makes for one business phone number."""

    def __init__(self, http: httpx.AsyncClient, token: str, phone_number_id: str) -> None:
        self._http = http
        self._auth = {"authorization": f"Bearer {token}"}
        self.phone_number_id = phone_number_id
        base = urllib.parse.urlsplit(str(http.base_url))
        self._api_host = (base.hostname or "").lower()

    def __repr__(self) -> str:
        return f"GraphClient(base={str(self._http.base_url)!r})"

    async def _call(
        self, what: str, method: str, path: str, *, json: Any = None, params: Any = None
    ) -> bytes:
        resp = await kit_http.counted(
            what,
            self._http.request(method, path, json=json, params=params, headers=self._auth),
        )
        if not 200 <= resp.status_code < 300:
            raise protocol.graph_error(what, resp.status_code, resp.content)
        return resp.content

    async def send(self, payload: dict[str, Any]) -> str:
        """``POST /<PHONE_NUMBER_ID>/messages``; returns the new message's wamid."""
        what = "send message"
        body = await self._call(what, "POST", f"/{self.phone_number_id}/messages", json=payload)
        return protocol.sent_id(what, body)

    async def typing(self, message_id: str) -> None:
        """Mark the user's message read and show the typing indicator."""
        await self._call(
            "typing indicator",
            "POST",
            f"/{self.phone_number_id}/messages",
            json=protocol.typing_payload(message_id),
        )

    async def phone_number(self) -> m.PhoneNumber:
        """``GET /<PHONE_NUMBER_ID>``: the display number, verified name, quality."""
        what = "phone number"
        body = await self._call(
            what, "GET", f"/{self.phone_number_id}", params={"fields": PHONE_FIELDS}
        )
        return _decode(what, m.PHONE_DECODER, body)

    async def media_info(self, media_id: str) -> m.MediaInfo:
        what = "media info"
        body = await self._call(what, "GET", f"/{urllib.parse.quote(media_id, safe='')}")
        return _decode(what, m.MEDIA_DECODER, body)

    async def fetch_media(self, media_id: str, sha256: str | None, max_bytes: int) -> bytes:
        """``GET /<MEDIA_ID>``, then its URL with the same bearer (valid for 5 minutes:
        asked for inside the turn), at most ``max_bytes``; the ``sha256`` is checked."""
        info = await self.media_info(media_id)
        if info.file_size is not None and info.file_size > max_bytes:
            raise TooLarge(f"the media is {info.file_size} bytes, over the {max_bytes} limit")
        parts = urllib.parse.urlsplit(info.url)
        host = (parts.hostname or "").lower()
        # The bearer goes along: never in clear text, but to a local stand-in (the fake).
        if parts.scheme != "https" and host not in (self._api_host, *LOOPBACK):
            raise PermissionDenied("media download: refusing a non-https media URL")
        data = await kit_http.download_capped(
            self._http, info.url, max_bytes, headers=self._auth, what="media download"
        )
        expected = info.sha256 or sha256
        if expected and not _sha_matches(data, expected):
            raise ChannelError("media download: the sha256 does not match")
        return data

    def fetcher(self, media_id: str, sha256: str | None) -> Fetcher:
        """A lazy download handle for :class:`~dshim.model.MediaRef` (nothing happens yet)."""

        async def fetch(max_bytes: int) -> bytes:
            return await self.fetch_media(media_id, sha256, max_bytes)

        return fetch


def _sha_matches(data: bytes, expected: str) -> bool:
    """Meta writes the hash as hex (media info) or base64 (webhooks)."""
    digest = hashlib.sha256(data).digest()
    expected = expected.strip()
    return expected.lower() == digest.hex() or expected == base64.b64encode(digest).decode()


def _decode(what: str, decoder: msgspec.json.Decoder[T], body: bytes) -> T:
    try:
        return kit_decode.decode(decoder, body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise RemoteProtocolError(f"{what}: unexpected answer: {str(exc)[:200]}") from None
