"""A fake WeChat iLink bot API on 127.0.0.1: the real wire protocol, in memory.

It speaks iLink's JSON-over-HTTP (``POST /ilink/bot/<path>``, answers ``{ret, ...}`` on
HTTP 200) with the semantics dshim relies on:

- ``get_bot_qrcode`` / ``get_qrcode_status``: a scripted sequence of QR states
  (:attr:`FakeWeixin.login_script`: ``wait``, ``scaned``, ``need_verifycode`` — the next
  poll must carry :attr:`verify_code` —, ``expired``, ``scaned_but_redirect`` to the
  second server :attr:`redirect_url`, ``binded_redirect``, ``confirmed``);
- ``msg/notifystart`` / ``msg/notifystop``; a wrong or expired token answers ``-14``
  (:meth:`expire` kills the token);
- ``getupdates`` long-polls: the cursor ``get_updates_buf`` is an opaque position in the
  message log; a poll answers at once when messages follow it, else after the window
  (``longpolling_timeout_ms``, :attr:`window_ms`) with an empty list and the same
  cursor.  :meth:`redeliver` appends an earlier message again (at-least-once delivery);
- every user message carries a fresh ``context_token``; ``sendmessage`` answers
  ``{"ret": -2, "errmsg": ""}`` on HTTP 200 (real iLink's refusal, issues #204, #225)
  for a token that is missing, was never issued for that user, or was revoked
  (:meth:`revoke`, ``user_message(revoked=True)``: the server no longer honours it —
  expired like a backlog message's); iLink does not say whether an older token of the
  user still works, the fake keeps every unrevoked one valid.  Also ``-2``: the
  ~10-replies-per-inbound cap.  One item per request; answers the server
  ``message_id`` (:attr:`return_message_id`);
- ``getconfig`` hands out a typing ticket, ``sendtyping`` records the status;
- a CDN (``/c2c/download?encrypted_query_param=``) serving AES-128-ECB encrypted media
  (:meth:`add_media`);
- quotes of the bot's messages arrive as metadata shells (``type`` 8, only times; with
  ``svr_id`` when :attr:`shell_svr_id`), like the real service.

From :class:`~dshim.testing.fakes.base.FakePlatform`: :attr:`calls` (every request with
its trio time), :meth:`wait_until`, and the fault knobs (``fail_next(op, status=...)``
for an HTTP status, ``fail_next(op, ret=-2)`` for an iLink error code on HTTP 200,
``slow_next``, ``drop_next``); :meth:`drop_polls` closes the poll in flight;
:meth:`~dshim.testing.fakes.base.FakePlatform.outage` for a time (the calls answer HTTP
500, are dropped before or, for ``sendmessage``, lost after processing; a long poll in
flight that wakes up during an outage of ``getupdates`` fails the same way, so messages
written meanwhile arrive once it is over).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import trio

from dshim.channels.weixin import media as crypto
from dshim.testing.fakes import cli
from dshim.testing.fakes.base import FakePlatform, IdleBench, open_servers
from dshim.testing.fakes.http import (
    DropConnection,
    HttpServer,
    Request,
    Response,
    json_response,
    serve_http,
)

TEST_TOKEN = "weixin-test-token-0123456789abcdef"
BOT_ID = "b0f5e7c1d2a3@im.bot"
USER = "o9cq8000aaaaaaa@im.wechat"
MAX_REPLIES_PER_INBOUND = 10
DEFAULT_WINDOW_MS = 35_000


class Call:
    """One request the bot made."""

    __slots__ = ("op", "body", "query", "at", "status", "ret", "host")

    def __init__(self, op: str, body: dict[str, Any], query: dict[str, str], at: float) -> None:
        self.op = op
        self.body = body
        self.query = query
        self.at = at
        self.status = 0
        self.ret: int | None = None
        self.host = ""

    def __repr__(self) -> str:
        return f"Call({self.op}, status={self.status}, ret={self.ret}, at={self.at:.3f})"


class BotMessage:
    """A message the bot sent."""

    def __init__(self, server_id: int, client_id: str, to_user: str, text: str, at_ms: int) -> None:
        self.server_id = server_id
        self.client_id = client_id
        self.to_user = to_user
        self.text = text
        self.at_ms = at_ms

    def __repr__(self) -> str:
        return f"BotMessage({self.server_id}, {self.text[:30]!r})"


class FakeWeixin(FakePlatform[Call]):
    """The fake iLink state and its HTTP handler (serve it with :func:`open_fake_weixin`)."""

    def __init__(
        self,
        *,
        token: str = TEST_TOKEN,
        bot_id: str = BOT_ID,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.token = token
        self.bot_id = bot_id
        self.clock = clock
        self.server: HttpServer | None = None
        self.redirect_server: HttpServer | None = None
        self.expired = False
        self.window_ms = DEFAULT_WINDOW_MS
        #: At most this many messages per getupdates answer.
        self.batch_max = 100
        self.return_message_id = True
        self.shell_svr_id = True
        #: Every message delivered through getupdates, in order (a redelivery repeats one).
        self.log: list[dict[str, Any]] = []
        self.user_messages: dict[str, dict[str, Any]] = {}
        self.bot_messages: list[BotMessage] = []
        #: Every context token a user message carried: token -> user.
        self.issued: dict[str, str] = {}
        #: Issued tokens the server refuses from now on.
        self.revoked: set[str] = set()
        self.replies_since_inbound: dict[str, int] = {}
        self.typing: list[tuple[str, int]] = []
        self.media: dict[str, bytes] = {}
        #: QR statuses answered in order (the last one repeats); see the module docstring.
        self.login_script: list[dict[str, Any]] = [{"status": "confirmed"}]
        self.verify_code = "42"
        self.qrcodes = 0
        self._seq = 0
        self._counter = 0
        self._new = trio.Event()
        self._drop = trio.Event()

    # -- addresses ------------------------------------------------------------------------

    @property
    def url(self) -> str:
        assert self.server is not None, "use open_fake_weixin()"
        return self.server.url

    @property
    def redirect_url(self) -> str:
        assert self.redirect_server is not None, "use open_fake_weixin()"
        return self.redirect_server.url

    @property
    def cdn_url(self) -> str:
        return f"{self.url}/c2c"

    # -- ids ------------------------------------------------------------------------------

    def _now_ms(self) -> int:
        return int(self.clock() * 1000)

    def new_id(self, at_ms: int | None = None) -> int:
        """A 64-bit id whose upper bits are its millisecond time (like iLink's)."""
        self._counter += 1
        return ((at_ms or self._now_ms()) << 22) | (self._counter & 0x3FFFFF)

    # -- injecting messages ---------------------------------------------------------------

    def add_message(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Deliver a raw WeixinMessage with the next getupdates (a user's: its context
        token becomes the user's latest and resets the reply cap)."""
        if msg.get("message_type") == 1 and msg.get("from_user_id"):
            user = str(msg["from_user_id"])
            if msg.get("context_token"):
                self.issue_context(user, str(msg["context_token"]))
            self.user_messages[str(msg.get("message_id"))] = msg
        self.log.append(msg)
        self._new.set()
        self._new = trio.Event()
        self.changed()
        return msg

    def issue_context(self, user: str, token: str) -> None:
        """The server hands ``token`` out for ``user`` (with a message of theirs): it is
        valid for replies from now on, and the reply cap starts again."""
        self.issued[token] = user
        self.replies_since_inbound[user] = 0

    def revoke(self, token: str) -> None:
        """The server refuses ``token`` from now on (``-2``)."""
        self.revoked.add(token)

    def user_message(
        self,
        text: str | None = None,
        *,
        user: str = USER,
        items: list[dict[str, Any]] | None = None,
        quote: dict[str, Any] | None = None,
        group_id: str | None = None,
        seq: int | None = None,
        sent_ms: int | None = None,
        revoked: bool = False,
    ) -> dict[str, Any]:
        """A user writes ``text`` (or ``items``), optionally quoting (``ref_msg``).

        ``seq`` overrides the next sequence number (the counter does not move),
        ``sent_ms`` the time it was written (a backlog message), ``revoked`` makes its
        context token one the server refuses."""
        now = self._now_ms() if sent_ms is None else sent_ms
        if seq is None:
            self._seq += 1
            seq = self._seq
        item_list = list(items or [])
        if text is not None:
            item_list.insert(0, {"type": 1, "text_item": {"text": text}})
        for item in item_list:
            item.setdefault("msg_id", str(self.new_id(now)))
            item.setdefault("create_time_ms", now)
        if quote is not None and item_list:
            item_list[0]["ref_msg"] = quote
        msg: dict[str, Any] = {
            "seq": seq,
            "message_id": self.new_id(now),
            "from_user_id": user,
            "to_user_id": self.bot_id,
            "create_time_ms": now,
            "session_id": f"session-{user}",
            "message_type": 1,
            "message_state": 2,
            "item_list": item_list,
            "context_token": f"ctx-{os.urandom(8).hex()}",
        }
        if group_id is not None:
            msg["group_id"] = group_id
        if revoked:
            self.revoke(msg["context_token"])
        return self.add_message(msg)

    def quote_of(self, message_id: str | int, *, id_only: bool = False) -> dict[str, Any]:
        """The ``ref_msg`` a client sends when the user quotes a message: a bot message
        is a metadata shell (``type`` 8, times only), a user message carries its item
        (``id_only``: the mid-2026 shell, ``type`` 0 with only the id)."""
        key = str(message_id)
        for bm in self.bot_messages:
            if key in (str(bm.server_id), bm.client_id):
                shell: dict[str, Any] = {
                    "message_item": {
                        "type": 8,
                        "create_time_ms": bm.at_ms,
                        "update_time_ms": bm.at_ms,
                    }
                }
                if self.shell_svr_id:
                    shell["svr_id"] = bm.server_id
                return shell
        msg = self.user_messages[key]
        item = dict(msg["item_list"][0])
        item.pop("ref_msg", None)
        if id_only:
            return {
                "svr_id": msg["message_id"],
                "message_item": {"type": 0, "msg_id": item.get("msg_id")},
            }
        return {"svr_id": msg["message_id"], "message_item": item}

    def redeliver(self, message: dict[str, Any]) -> None:
        """Deliver a message again (iLink redelivers up to ~50 minutes later)."""
        self.log.append(message)
        self._new.set()
        self._new = trio.Event()
        self.changed()

    def add_media(self, data: bytes) -> tuple[str, str]:
        """Put ``data`` on the CDN, encrypted; returns (encrypt_query_param, aeskey hex)."""
        key = os.urandom(16)
        param = f"param-{os.urandom(6).hex()}"
        self.media[param] = crypto.encrypt(data, key)
        return param, key.hex()

    # -- faults and views -----------------------------------------------------------------

    def expire(self) -> None:
        """The session expires: every authenticated call answers ``-14`` from now on."""
        self.expired = True
        self.changed()

    def drop_polls(self) -> None:
        """The poll in flight gets its connection closed, unanswered."""
        self._drop.set()
        self._drop = trio.Event()

    def calls_to(self, *ops: str) -> list[Call]:
        return [c for c in self.calls if c.op in ops]

    def calls_except(self, *ops: str) -> list[Call]:
        return [c for c in self.calls if c.op not in ops]

    def sent_to(self, user: str = USER) -> list[BotMessage]:
        return [b for b in self.bot_messages if b.to_user == user]

    # -- the HTTP handler -----------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        path = request.path
        if path.startswith("/c2c/download"):
            return await self._download(request)
        if not path.startswith("/ilink/bot/"):
            return json_response({"ret": -1, "errmsg": "not found"}, status=404)
        op = path[len("/ilink/bot/") :]
        try:
            body = request.json() if request.body else {}
        except ValueError:
            body = {}
        call = self.record(
            Call(op, body if isinstance(body, dict) else {}, request.query, trio.current_time())
        )
        call.host = request.header("host") or ""
        fault = await self.faults_for(op)
        if fault is not None:
            ret = fault.extra.get("ret")
            if ret is not None:
                return self._answer(call, {"ret": ret, "errmsg": fault.description or ""})
            call.status = fault.status
            self.changed()
            resp = json_response({"ret": -1, "errmsg": "fault"}, status=fault.status)
            if fault.retry_after is not None:
                resp.headers.append(("retry-after", f"{fault.retry_after:g}"))
            return resp
        if op in ("get_bot_qrcode", "get_qrcode_status"):
            return self._answer(call, self._login(op, call))
        if self.expired or request.header("authorization") != f"Bearer {self.token}":
            return self._answer(call, {"ret": -14, "errcode": -14, "errmsg": "session timeout"})
        if op == "getupdates":
            return await self._getupdates(call)
        if op == "sendmessage" and self.losing(op):  # processed, the answer never arrives
            self._answer(call, self._sendmessage(call))
            raise DropConnection(op)
        handler = {
            "msg/notifystart": self._ok,
            "msg/notifystop": self._ok,
            "sendmessage": self._sendmessage,
            "getconfig": self._getconfig,
            "sendtyping": self._sendtyping,
        }.get(op)
        if handler is None:
            return self._answer(call, {"ret": -1, "errmsg": "unknown path"})
        return self._answer(call, handler(call))

    def _answer(self, call: Call, obj: dict[str, Any] | None) -> Response:
        call.status = 200
        call.ret = obj.get("ret") if obj else 0
        self.changed()
        if obj is None:
            return Response(200, b"", [("content-type", "application/json")])
        return json_response(obj)

    def _ok(self, call: Call) -> dict[str, Any]:
        return {"ret": 0}

    def _login(self, op: str, call: Call) -> dict[str, Any]:
        if op == "get_bot_qrcode":
            self.qrcodes += 1
            return {
                "ret": 0,
                "qrcode": f"qr-{self.qrcodes}-{os.urandom(4).hex()}",
                "qrcode_img_content": f"https://liteapp.weixin.qq.com/q/fake{self.qrcodes}",
            }
        code = call.query.get("verify_code")
        if code is not None and code != self.verify_code:
            return {"ret": 0, "status": "need_verifycode"}  # a wrong number: ask again
        step = self.login_script[0] if self.login_script else {"status": "wait"}
        if len(self.login_script) > 1:
            self.login_script.pop(0)
        answer = {"ret": 0, **step}
        if answer.get("status") == "scaned_but_redirect" and "redirect_host" not in answer:
            answer["redirect_host"] = self.redirect_url.split("://", 1)[1]
        if answer.get("status") == "confirmed":
            answer.setdefault("bot_token", self.token)
            answer.setdefault("ilink_bot_id", self.bot_id)
            answer.setdefault("baseurl", self.url)
            answer.setdefault("ilink_user_id", USER)
        return answer

    async def _getupdates(self, call: Call) -> Response:
        buf = str(call.body.get("get_updates_buf") or "")
        start = int(buf[4:]) if buf.startswith("pos:") and buf[4:].isdigit() else 0
        drop = self._drop
        with trio.move_on_after(self.window_ms / 1000):
            while len(self.log) <= start:
                new = self._new
                async with trio.open_nursery() as nursery:

                    async def stop_on(event: trio.Event) -> None:
                        await event.wait()
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(stop_on, new)
                    nursery.start_soon(stop_on, drop)
                if drop.is_set():
                    raise DropConnection("getupdates")
        outage = self._outage("getupdates")  # the outage began while the poll was held
        if outage in ("drop", "lost"):
            raise DropConnection("getupdates")
        if outage == "500":
            call.status = 500
            self.changed()
            return json_response({"ret": -1, "errmsg": "fault"}, status=500)
        msgs = self.log[start : start + self.batch_max]
        answer = {
            "ret": 0,
            "msgs": msgs,
            "get_updates_buf": f"pos:{start + len(msgs)}" if msgs else buf,
            "longpolling_timeout_ms": self.window_ms,
        }
        return self._answer(call, answer)

    def _sendmessage(self, call: Call) -> dict[str, Any] | None:
        msg = call.body.get("msg")
        if not isinstance(msg, dict):
            return {"ret": -1, "errmsg": "no msg"}
        user = str(msg.get("to_user_id") or "")
        items = msg.get("item_list")
        if not isinstance(items, list) or len(items) != 1:
            return {"ret": -1, "errmsg": "one item per message"}
        token = msg.get("context_token")
        if not token or self.issued.get(str(token)) != user or token in self.revoked:
            return {"ret": -2, "errmsg": ""}
        if self.replies_since_inbound.get(user, 0) >= MAX_REPLIES_PER_INBOUND:
            return {"ret": -2, "errmsg": ""}
        self.replies_since_inbound[user] = self.replies_since_inbound.get(user, 0) + 1
        text = str((items[0].get("text_item") or {}).get("text") or "")
        now = self._now_ms()
        server_id = self.new_id(now)
        self.bot_messages.append(BotMessage(server_id, str(msg.get("client_id")), user, text, now))
        if self.return_message_id:
            return {"ret": 0, "message_id": server_id}
        return None

    def _getconfig(self, call: Call) -> dict[str, Any]:
        user = str(call.body.get("ilink_user_id") or "")
        return {"ret": 0, "typing_ticket": f"ticket-{user}-{os.urandom(4).hex()}"}

    def _sendtyping(self, call: Call) -> dict[str, Any]:
        self.typing.append((str(call.body.get("ilink_user_id")), int(call.body.get("status", 0))))
        return {"ret": 0}

    async def _download(self, request: Request) -> Response:
        call = self.record(Call("cdn/download", {}, request.query, trio.current_time()))
        fault = await self.faults_for("cdn/download")
        if fault is not None:
            call.status = fault.status
            return Response(fault.status, b"")
        data = self.media.get(request.query.get("encrypted_query_param", ""))
        call.status = 200 if data is not None else 404
        self.changed()
        if data is None:
            return Response(404, b"")
        return Response(200, data, [("content-type", "application/octet-stream")])


def dump(msg: dict[str, Any]) -> bytes:
    """A message as getupdates' JSON carries it (64-bit ids as bare numbers)."""
    return json.dumps(msg, ensure_ascii=False).encode()


@asynccontextmanager
async def open_fake_weixin(
    *, host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> AsyncIterator[FakeWeixin]:
    """Run a :class:`FakeWeixin` (and its redirect host) for the duration of the block."""
    fake = FakeWeixin(**kwargs)
    async with open_servers(
        partial(serve_http, fake.handle, host=host, port=port),
        partial(serve_http, fake.handle, host=host),
    ) as (
        main,
        second,
    ):
        fake.server = main
        fake.redirect_server = second
        yield fake


def _announcement(fake: FakeWeixin) -> cli.Announcement:
    settings = {
        "token": fake.token,
        "bot_id": fake.bot_id,
        "api_base": fake.url,
        "cdn_base": fake.cdn_url,
    }
    notes = {"redirect_host": fake.redirect_url}
    return cli.Announcement("WeChat iLink bot API", fake.url, "weixin", settings, notes)


#: How the idle bench runs this fake: the bot's first contact is its first call (a poll).
IDLE_BENCH: IdleBench[FakeWeixin] = IdleBench(
    open_fake_weixin,
    lambda f: {"token": f.token, "bot_id": f.bot_id, "api_base": f.url, "cdn_base": f.cdn_url},
    lambda f: bool(f.calls),
)


def main(argv: list[str] | None = None) -> None:
    """Run the fake as a process (see :mod:`dshim.testing.fakes.cli`)."""
    module = "dshim.testing.fakes.weixin"
    args = cli.parser(__doc__, module=module).parse_args(argv)
    cli.run(
        args,
        module=module,
        open_fake=lambda: open_fake_weixin(host=args.host, port=args.port),
        announce=_announcement,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
