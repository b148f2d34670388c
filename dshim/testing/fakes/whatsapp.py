"""A fake WhatsApp Cloud API on 127.0.0.1: the Graph API, a media host, a webhook sender.

Graph API (the paths dshim uses, with Meta's answer and error shapes):

- ``GET /<PHONE_NUMBER_ID>``: the number's ``display_phone_number``, ``verified_name``,
  ``quality_rating``;
- ``POST /<PHONE_NUMBER_ID>/messages``: text and interactive sends (``to`` or, for a
  BSUID, ``recipient``; ``context.message_id`` makes a contextual reply) answered
  ``{"messaging_product", "contacts", "messages": [{"id": "wamid..."}]}``; a body with
  ``status: read`` marks a message read (and shows typing with ``typing_indicator``),
  answered ``{"success": true}``;
- ``GET /<MEDIA_ID>``: ``{url, mime_type, sha256, file_size, id}``, the url on this
  server's media host (``/media/<id>``), which wants the same bearer.

Every call needs ``Authorization: Bearer <token>``: a wrong or expired token is 401 with
code 190.  Knobs: ``pair_interval_s`` (a send to one user sooner than this after the
previous one is refused with 131056), the 24-hour window (a send to a user whose last
message is older than ``window_s`` is refused with 131047; :meth:`FakeWhatsApp.close_window`),
:meth:`expire_token`, and from :class:`~dshim.testing.fakes.base.FakePlatform`
``fail_next(op, status=..., code=...)`` (Graph error ``code``, e.g. 130429), ``slow_next``,
``drop_next`` for the operations ``"send"``, ``"typing"``, ``"phone"``, ``"media"``,
``"download"``; :meth:`lose_response_next` performs a send, then drops the connection;
:meth:`~dshim.testing.fakes.base.FakePlatform.outage` for a time (those operations answer
500 with code 131000, are dropped before or, for sends, lost after processing; an outage
of every operation, or of ``"webhook"``, also holds :meth:`deliver` until it is over).

The webhook sender builds real payload shapes (:meth:`user_message`,
:meth:`status_update`, :meth:`body`), signs them with the app secret and POSTs them to
dshim's ``/hooks/<bot>`` (:meth:`deliver`), retrying non-2xx answers like Meta does; a
wrong signature or none at all is a knob of :meth:`post`.

Use :func:`open_fake_whatsapp` in tests; the server exits with the block.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import trio

from dshim.testing.fakes import cli
from dshim.testing.fakes.base import FakePlatform, FaultQueue, IdleBench, open_servers
from dshim.testing.fakes.http import (
    DropConnection,
    HttpServer,
    Request,
    Response,
    json_response,
    serve_http,
)

TEST_TOKEN = "EAAG-test-token-for-dshim-tests-only-0123456789"
TEST_APP_SECRET = "app-secret-for-dshim-tests-0123456789"
TEST_VERIFY_TOKEN = "verify-token-for-dshim-tests"
PHONE_NUMBER_ID = "106540352242922"
DISPLAY_NUMBER = "15550783881"
WABA_ID = "102290129340398"
VERIFIED_NAME = "dshim test"
MAX_TEXT = 4096
WINDOW_S = 24 * 3600.0


@dataclass
class Call:
    """One Graph API request: ``op`` (send, typing, phone, media, download), its JSON body
    or path parameters, and its trio time; ``status`` once answered."""

    op: str
    body: dict[str, Any]
    at: float
    status: int = 0


@dataclass
class Sent:
    """A message the business sent (what the user's phone shows)."""

    id: str
    to: str
    type: str
    text: str
    reply_to: str | None
    at: float
    interactive: dict[str, Any] | None = None


@dataclass
class User:
    """A WhatsApp user: ``wa_id`` (None for a username user) and BSUID."""

    wa_id: str | None
    name: str
    bsuid: str | None = None
    last_message_at: float = -1e18

    @property
    def key(self) -> str:
        """How dshim keys them (the conversation id): the BSUID when there is one."""
        return self.bsuid or self.wa_id or ""


def _error(status: int, code: int, message: str, subcode: int | None = None) -> Response:
    err: dict[str, Any] = {
        "message": message,
        "type": "OAuthException",
        "code": code,
        "fbtrace_id": "AbCdEfGhIjK",
    }
    if subcode is not None:
        err["error_subcode"] = subcode
    return json_response({"error": err}, status)


_CODE_STATUS = {190: 401, 131047: 400, 131056: 400, 130429: 400, 4: 400, 80007: 400, 100: 400}
_CODE_TEXT = {
    190: "Error validating access token: Session has expired",
    131047: "Re-engagement message",
    131056: "(Business Account, Consumer Account) pair rate limit hit",
    130429: "Rate limit hit",
    4: "Application request limit reached",
    80007: "Rate limit issues",
    131000: "Something went wrong",
}


class FakeWhatsApp(FakePlatform[Call]):
    """The fake's state and its HTTP handler (serve it with :func:`open_fake_whatsapp`)."""

    def __init__(
        self,
        *,
        token: str = TEST_TOKEN,
        app_secret: str = TEST_APP_SECRET,
        phone_number_id: str = PHONE_NUMBER_ID,
        display_phone_number: str = DISPLAY_NUMBER,
        verified_name: str = VERIFIED_NAME,
        clock: Callable[[], float] = time.time,
        pair_interval_s: float | None = None,
        window_s: float = WINDOW_S,
    ) -> None:
        super().__init__()
        self.token = token
        self.app_secret = app_secret.encode()
        self.phone_number_id = phone_number_id
        self.display_phone_number = display_phone_number
        self.verified_name = verified_name
        self.clock = clock
        self.pair_interval_s = pair_interval_s
        self.window_s = window_s
        self.server: HttpServer | None = None
        self.users: dict[str, User] = {}
        self.sent: list[Sent] = []
        self.media: dict[str, tuple[bytes, str]] = {}
        #: The sha256 media info reports for a media id (default: the bytes' real hash).
        self.media_sha256: dict[str, str] = {}
        #: Where :meth:`deliver` POSTs (dshim's ``/hooks/<bot>`` URL).
        self.webhook_url = ""
        #: Every webhook POST: (status answered, body).
        self.deliveries: list[tuple[int, bytes]] = []
        #: Message ids marked read (each typing indicator marks one), in order.
        self.read: list[str] = []
        self.http: httpx.AsyncClient | None = None
        self._expired = False
        self._lost = FaultQueue()
        self._last_send: dict[str, float] = {}
        self._next = 1

    @property
    def url(self) -> str:
        """The ``api_base`` to configure."""
        assert self.server is not None, "not serving: use open_fake_whatsapp()"
        return self.server.url

    # -- people and messages -------------------------------------------------------------

    def user(self, wa_id: str | None, name: str, *, bsuid: str | None = None) -> User:
        u = User(wa_id, name, bsuid)
        self.users[u.key] = u
        if wa_id:
            self.users[wa_id] = u
        return u

    def new_wamid(self) -> str:
        self._next += 1
        return f"wamid.HBgL{self._next:08d}FQIAERgSQUFBQUFBQUFB"

    def to_user(self, key: str) -> list[Sent]:
        """What the business sent to one user (by ``to`` or ``recipient``), in order."""
        u = self.users.get(key)
        keys = {key} | ({u.wa_id, u.bsuid} - {None} if u is not None else set())
        return [s for s in self.sent if s.to in keys]

    def calls_to(self, *ops: str) -> list[Call]:
        return [c for c in self.calls if c.op in ops]

    def add_media(self, data: bytes, *, mime: str = "image/jpeg") -> str:
        media_id = f"{9000000 + len(self.media) + 1}"
        self.media[media_id] = (data, mime)
        return media_id

    def expire_token(self) -> None:
        """Every call from now on is refused with 190 (the token expired)."""
        self._expired = True

    def close_window(self, user: User) -> None:
        """The user's last message is older than 24 hours."""
        user.last_message_at = self.clock() - self.window_s - 1

    def lose_response_next(self, op: str = "send", count: int = 1) -> None:
        """The next sends are *performed*, then the connection drops unanswered."""
        self._lost.drop_next(op, count)

    # -- webhook payloads -------------------------------------------------------------------

    def user_message(
        self,
        user: User,
        text: str | None = None,
        *,
        type: str | None = None,
        reply_to: str | None = None,
        reply_from: str | None = None,
        forwarded: bool = False,
        group_id: str | None = None,
        at: float | None = None,
        wamid: str | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        """A ``messages[]`` item from ``user`` (text unless ``type`` and its field are
        given); ``reply_to`` quotes a wamid (``reply_from``: its sender, default the
        business number when the business sent it)."""
        when = self.clock() if at is None else at
        msg: dict[str, Any] = {}
        if user.wa_id:
            msg["from"] = user.wa_id
        if user.bsuid:
            msg["from_user_id"] = user.bsuid
        msg["id"] = wamid or self.new_wamid()
        msg["timestamp"] = str(int(when))
        if reply_to is not None or forwarded:
            ctx: dict[str, Any] = {}
            if forwarded:
                ctx["forwarded"] = True
            if reply_to is not None:
                sender = reply_from
                if sender is None:
                    ours = any(s.id == reply_to for s in self.sent)
                    sender = self.display_phone_number if ours else (user.wa_id or "")
                ctx["from"] = sender
                ctx["id"] = reply_to
            msg["context"] = ctx
        if group_id is not None:
            msg["group_id"] = group_id
        if type is None:
            msg["type"] = "text"
            msg["text"] = {"body": text or ""}
        else:
            msg["type"] = type
        msg.update(fields)
        user.last_message_at = when
        return msg

    def status_update(
        self, sent: Sent, status: str = "delivered", *, code: int | None = None
    ) -> dict[str, Any]:
        """A ``statuses[]`` item for one of the business's messages."""
        u = self.users.get(sent.to)
        st: dict[str, Any] = {
            "id": sent.id,
            "status": status,
            "timestamp": str(int(self.clock())),
            "recipient_id": (u.wa_id if u is not None and u.wa_id else sent.to),
        }
        if u is not None and u.bsuid:
            st["recipient_user_id"] = u.bsuid
        if code is not None:
            st["errors"] = [
                {
                    "code": code,
                    "title": _CODE_TEXT.get(code, "Message failed to send"),
                    "message": _CODE_TEXT.get(code, "Message failed to send"),
                    "error_data": {"details": "Message failed to send"},
                }
            ]
        return st

    def body(
        self,
        messages: list[dict[str, Any]] = (),  # type: ignore[assignment]
        statuses: list[dict[str, Any]] = (),  # type: ignore[assignment]
    ) -> bytes:
        """A webhook POST body exactly as Meta sends it."""
        value: dict[str, Any] = {
            "messaging_product": "whatsapp",
            "metadata": {
                "display_phone_number": self.display_phone_number,
                "phone_number_id": self.phone_number_id,
            },
        }
        if messages:
            contacts = []
            seen: set[str] = set()
            for msg in messages:
                u = self.users.get(msg.get("from_user_id") or msg.get("from") or "")
                if u is None or u.key in seen:
                    continue
                seen.add(u.key)
                contact: dict[str, Any] = {"profile": {"name": u.name}}
                if u.wa_id:
                    contact["wa_id"] = u.wa_id
                if u.bsuid:
                    contact["user_id"] = u.bsuid
                contacts.append(contact)
            value["contacts"] = contacts
            value["messages"] = list(messages)
        if statuses:
            value["statuses"] = list(statuses)
        payload = {
            "object": "whatsapp_business_account",
            "entry": [{"id": WABA_ID, "changes": [{"value": value, "field": "messages"}]}],
        }
        return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()

    def signature(self, body: bytes) -> str:
        return "sha256=" + hmac.new(self.app_secret, body, hashlib.sha256).hexdigest()

    async def post(
        self,
        body: bytes,
        *,
        signature: str | None | bool = True,
        url: str | None = None,
    ) -> int:
        """POST one body to the webhook once; ``signature``: True signs it, a string is
        sent as the header, False/None sends none.  Returns the HTTP status (0: no answer)."""
        headers = {"content-type": "application/json"}
        if signature is True:
            headers["x-hub-signature-256"] = self.signature(body)
        elif isinstance(signature, str):
            headers["x-hub-signature-256"] = signature
        assert self.http is not None, "use open_fake_whatsapp()"
        try:
            resp = await self.http.post(url or self.webhook_url, content=body, headers=headers)
        except httpx.TransportError:
            status = 0
        else:
            status = resp.status_code
        self.deliveries.append((status, body))
        self.changed()
        return status

    async def deliver(self, body: bytes, *, attempts: int = 8, first_delay_s: float = 1.0) -> int:
        """POST like Meta: signed, retried with exponential backoff on non-2xx (or no
        answer), at most ``attempts`` times.  Returns the last status."""
        delay = first_delay_s
        status = 0
        await self.held()
        for _ in range(attempts):
            status = await self.post(body)
            if 200 <= status < 300:
                return status
            await trio.sleep(delay)
            delay *= 2
        return status

    async def held(self) -> None:
        """While an :meth:`outage` covers every operation (or ``"webhook"``) Meta sends no
        webhooks: wait until it is over (the messages arrive once it is back)."""
        while self._outage("webhook") is not None:
            now = trio.current_time()
            ends = [u for u, _, ops in self._outages if (not ops or "webhook" in ops) and u > now]
            await trio.sleep(max(ends, default=now) - now)

    async def send_messages(self, *messages: dict[str, Any]) -> int:
        """Deliver a body with these messages (see :meth:`deliver`)."""
        return await self.deliver(self.body(list(messages)))

    # -- HTTP -------------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        path = request.path.rstrip("/")
        if path.startswith("/media/"):
            return await self._download(request, path[len("/media/") :])
        try:
            body = request.json() if request.body else {}
        except ValueError:
            body = None
        segments = [s for s in path.split("/") if s]
        # A version prefix (/v23.0/...) is accepted like Graph does.
        if segments and segments[0].startswith("v") and segments[0][1:].replace(".", "").isdigit():
            segments = segments[1:]
        op = _op(request.method, segments, self.phone_number_id, body)
        call = self.record(Call(op, body if isinstance(body, dict) else {}, trio.current_time()))
        if request.header("authorization") != f"Bearer {self.token}" or self._expired:
            return self._answered(call, _error(401, 190, _CODE_TEXT[190], 463))
        if body is None:
            return self._answered(call, _error(400, 100, "Invalid JSON"))
        fault = await self.faults_for(op)
        if fault is not None:
            code = int(fault.extra.get("code", 131000 if fault.status >= 500 else 100))
            text = fault.description or _CODE_TEXT.get(code, f"Error {code}")
            return self._answered(call, _error(fault.status, code, text))
        if op == "phone":
            response = json_response(
                {
                    "verified_name": self.verified_name,
                    "display_phone_number": f"+{self.display_phone_number}",
                    "quality_rating": "GREEN",
                    "id": self.phone_number_id,
                }
            )
        elif op == "media":
            response = self._media_info(segments[0])
        elif op in ("send", "typing"):
            response = self._messages(body)
        else:
            response = _error(400, 100, "Unsupported get request.")
        if op == "send" and (self._lost.take("send") or self.losing(op)):
            call.status = response.status
            self.changed()
            raise DropConnection("send")
        return self._answered(call, response)

    def _answered(self, call: Call, response: Response) -> Response:
        call.status = response.status
        self.changed()
        return response

    def _media_info(self, media_id: str) -> Response:
        item = self.media.get(media_id)
        if item is None:
            return _error(400, 100, "Unsupported get request. Object does not exist")
        data, mime = item
        return json_response(
            {
                "messaging_product": "whatsapp",
                "url": f"{self.url}/media/{media_id}",
                "mime_type": mime,
                "sha256": self.media_sha256.get(media_id, hashlib.sha256(data).hexdigest()),
                "file_size": len(data),
                "id": media_id,
            }
        )

    async def _download(self, request: Request, media_id: str) -> Response:
        call = self.record(Call("download", {"id": media_id}, trio.current_time()))
        if request.header("authorization") != f"Bearer {self.token}":
            return self._answered(call, Response(401, b"unauthorized"))
        fault = await self.faults_for("download")
        if fault is not None:
            return self._answered(call, Response(fault.status, b"error"))
        item = self.media.get(media_id)
        if item is None:
            return self._answered(call, Response(404, b"not found"))
        return self._answered(call, Response(200, item[0], [("content-type", item[1])]))

    def _messages(self, body: dict[str, Any]) -> Response:
        if body.get("messaging_product") != "whatsapp":
            return _error(400, 100, "(#100) The parameter messaging_product is required.")
        if body.get("status") == "read":
            mid = body.get("message_id")
            if not isinstance(mid, str):
                return _error(400, 100, "(#100) The parameter message_id is required.")
            self.read.append(mid)
            self.changed()
            return json_response({"success": True})
        to = body.get("recipient") or body.get("to")
        if not isinstance(to, str) or not to:
            return _error(400, 100, "(#100) The parameter to is required.")
        u = self.users.get(to)
        now = self.clock()
        if u is not None and now - u.last_message_at > self.window_s:
            return _error(400, 131047, _CODE_TEXT[131047])
        last = self._last_send.get(to)
        t = trio.current_time()
        if (
            self.pair_interval_s is not None
            and last is not None
            and t - last < self.pair_interval_s
        ):
            return _error(400, 131056, _CODE_TEXT[131056])
        kind = body.get("type", "text")
        text = ""
        interactive = None
        if kind == "text":
            text = str((body.get("text") or {}).get("body") or "")
            if not text or len(text) > MAX_TEXT:
                return _error(400, 100, "(#100) Param text['body'] must be 1-4096 characters")
        elif kind == "interactive":
            interactive = body.get("interactive") or {}
            text = str((interactive.get("body") or {}).get("text") or "")
        else:
            return _error(400, 100, f"(#100) Unsupported type {kind}")
        ctx = body.get("context") or {}
        sent = Sent(self.new_wamid(), to, kind, text, ctx.get("message_id"), t, interactive)
        self.sent.append(sent)
        self._last_send[to] = t
        contact = {"input": to, "wa_id": (u.wa_id if u is not None and u.wa_id else to)}
        return json_response(
            {"messaging_product": "whatsapp", "contacts": [contact], "messages": [{"id": sent.id}]}
        )


def _op(method: str, segments: list[str], pnid: str, body: Any) -> str:
    if len(segments) == 2 and segments[0] == pnid and segments[1] == "messages":
        if isinstance(body, dict) and body.get("status") == "read":
            return "typing"
        return "send"
    if len(segments) == 1 and segments[0] == pnid and method == "GET":
        return "phone"
    if len(segments) == 1 and method == "GET":
        return "media"
    return "other"


@asynccontextmanager
async def open_fake_whatsapp(
    *, host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> AsyncIterator[FakeWhatsApp]:
    """Serve a :class:`FakeWhatsApp` on 127.0.0.1 (port 0) for the duration of the block."""
    fake = FakeWhatsApp(**kwargs)
    async with (
        httpx.AsyncClient(timeout=60.0, trust_env=False) as http,
        open_servers(partial(serve_http, fake.handle, host=host, port=port)) as (server,),
    ):
        fake.server = server
        fake.http = http
        yield fake


def _announcement(fake: FakeWhatsApp) -> cli.Announcement:
    settings = {
        "phone_number_id": fake.phone_number_id,
        "access_token": fake.token,
        "app_secret": fake.app_secret.decode(),
        "verify_token": TEST_VERIFY_TOKEN,
        "api_base": fake.url,
    }
    notes = {"webhook": "dshim's http://<[http] listen>/hooks/whatsapp-fake (POSTs signed)"}
    return cli.Announcement("WhatsApp Cloud API", fake.url, "whatsapp", settings, notes)


async def webhook_mounted(url: str) -> None:
    """Poll the verification GET at ``url`` (a bot's webhook) until the bot's route answers."""
    query = {"hub.mode": "subscribe", "hub.verify_token": TEST_VERIFY_TOKEN}
    async with httpx.AsyncClient(timeout=2) as client:
        while True:
            try:
                r = await client.get(url, params={**query, "hub.challenge": "up"})
                if r.status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await trio.sleep(0.01)


#: How the idle bench runs this fake.  It only sends webhooks, so the bot never contacts
#: it first: the bench waits until the bot's webhook route is mounted instead.
IDLE_BENCH: IdleBench[FakeWhatsApp] = IdleBench(
    open_fake_whatsapp,
    lambda f: {
        "phone_number_id": f.phone_number_id,
        "access_token": f.token,
        "app_secret": TEST_APP_SECRET,
        "verify_token": TEST_VERIFY_TOKEN,
        "api_base": f.url,
    },
    lambda f: False,
    mounted=webhook_mounted,
)


def main(argv: list[str] | None = None) -> None:
    """Run the fake as a process (see :mod:`dshim.testing.fakes.cli`)."""
    module = "dshim.testing.fakes.whatsapp"
    args = cli.parser(__doc__, module=module).parse_args(argv)
    cli.run(
        args,
        module=module,
        open_fake=lambda: open_fake_whatsapp(host=args.host, port=args.port),
        announce=_announcement,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
