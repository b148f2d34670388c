"""A fake WeCom AI-bot long connection on 127.0.0.1, with encrypted media over HTTP.

It speaks the wire protocol of protocols/wecom.md: JSON text frames
``{cmd, headers: {req_id}, body}``, acks ``{headers: {req_id}, errcode, errmsg}``,
``aibot_subscribe`` with ``bot_id`` and ``secret``, ``ping``, message and event callbacks,
``aibot_respond_msg`` streams (replace semantics, ``finish``, the 6-minute lifetime: 846608,
unknown or revoked ``req_id``: 846605, content over 20,480 bytes refused),
``stream_with_template_card`` (once per message), ``aibot_respond_welcome_msg`` and
``aibot_respond_update_msg`` (5 s windows), ``aibot_send_msg`` pushes.  One live
connection per bot: a new subscribe evicts the old connection with ``disconnected_event``.
Usage::

    async with open_fake_wecom() as fake:
        ...  # run the bot with ws_url = fake.ws_url, bot_id = fake.bot_id, secret = fake.secret
        await fake.wait_until(lambda: fake.live is not None)
        await fake.user_message("hello")
        await fake.wait_until(lambda: fake.answers(fake.user_id))

Knobs: ``ack_pings`` (False: a dead socket), ``ack_delay_s`` (acks come late, so a client
that sends the next frame of a ``req_id`` before the ack is caught: such frames are listed
in :attr:`order_violations`, answered with an error, and fail the test when the fake's
block ends unless ``strict_order`` is off), ``stream_lifetime_s``,
``media_ttl_s``, ``revoke(req_id)`` (846605 from then on), :meth:`drop_connection` (TCP
closed without a close frame), :meth:`drop_after` (after k more callbacks),
:meth:`take_over` (``disconnected_event``, then close), and the shared fault queue keyed by
``cmd``: ``fail_next("aibot_respond_msg", n, status=45009)`` answers with that errcode,
``slow_next(cmd, s)`` delays the ack, ``drop_next(cmd)`` closes the socket instead of
acking (the frame is not processed), and
:meth:`~dshim.testing.fakes.base.FakePlatform.outage` for a time (every frame but
subscribes and pings, or the cmds named: ``"500"`` acks errcode 500, a server error that
processed nothing; ``"drop"`` closes the socket instead, unprocessed; ``"lost"``
processes the frame and never acks it).

Reading what the bot did: :attr:`calls` (every frame received: ``cmd``, ``req_id``, body,
errcode answered, trio time), :attr:`streams`, :attr:`pushes`, :meth:`answers` (what a
conversation shows), :attr:`subscribes`, :attr:`pings`, :attr:`connections`.
"""

from __future__ import annotations

import base64
import itertools
import json
import secrets
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from dshim.channels.wecom.media import encrypt
from dshim.testing.fakes import cli
from dshim.testing.fakes.base import FakePlatform, IdleBench, open_servers
from dshim.testing.fakes.http import DropConnection, Request, Response, serve_http
from dshim.testing.fakes.ws import write_frames

__all__ = ["Answer", "FakeWecom", "Frame", "open_fake_wecom"]

MAX_CONTENT_BYTES = 20_480
OUTBOX = 256
ERR_INVALID = 40058
ERR_AUTH = 40014


@dataclass
class Frame:
    """One frame the bot sent, and what the fake answered."""

    cmd: str
    req_id: str
    body: Any
    at: float
    conn: int
    errcode: int | None = None


@dataclass
class Stream:
    id: str
    req_id: str
    chatid: str
    first_at: float
    contents: list[str] = field(default_factory=list)
    finished: bool = False
    card: Any = None
    seq: int = 0


@dataclass
class Push:
    req_id: str
    chatid: str
    msgtype: str
    content: str
    at: float
    card: Any = None
    seq: int = 0


@dataclass(frozen=True)
class Answer:
    """A bubble or pushed message as the chat shows it."""

    id: str
    text: str
    shown: tuple[str, ...]
    finished: bool
    kind: str  # "stream" | "push"


@dataclass
class Connection:
    index: int
    ws: WebSocketConnection
    send: trio.MemorySendChannel[tuple[str, Any]]
    opened_at: float
    subscribed: bool = False
    closed_by: str | None = None
    closed_at: float | None = None
    #: req_ids with a frame whose ack is not out yet.
    in_flight: set[str] = field(default_factory=set)

    def push(self, kind: str, value: Any = None) -> None:
        try:
            self.send.send_nowait((kind, value))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass


@dataclass
class _Inbound:
    """A callback the fake delivered: replies to its req_id are allowed."""

    req_id: str
    chatid: str
    at: float
    kind: str
    carded: bool = False


class FakeWecom(FakePlatform[Frame]):
    """The fake platform (see the module docstring)."""

    def __init__(
        self,
        *,
        bot_id: str = "aib-fake-bot",
        secret: str = "fake-wecom-secret-0123456789",
        user_id: str = "zhangsan",
        group_id: str = "wrkSFfCgAAfake",
    ) -> None:
        super().__init__()
        self.bot_id = bot_id
        self.secret = secret
        self.user_id = user_id
        self.group_id = group_id
        self.ws_url = ""
        self.media_base = ""
        self.ack_pings = True
        self.ack_delay_s = 0.0
        self.stream_lifetime_s = 360.0
        self.media_ttl_s = 300.0
        self.connections: list[Connection] = []
        self.subscribes: list[tuple[float, bool]] = []
        self.pings: list[float] = []
        self.streams: dict[str, Stream] = {}
        self.pushes: list[Push] = []
        self.welcomes: list[tuple[str, str, float]] = []
        self.card_updates: list[tuple[str, Any, float]] = []
        self.order_violations: list[Frame] = []
        self.inbound: dict[str, _Inbound] = {}
        self._revoked: set[str] = set()
        self._media: dict[str, tuple[bytes, float, str | None]] = {}
        self._ids = itertools.count(1)
        self._seq = itertools.count(1)
        self._drop_after: int | None = None
        self.callbacks_sent = 0
        #: Leaving ``open_fake_wecom`` fails when a frame broke the per-req_id order.
        self.strict_order = True
        #: Text messages delivered right after every subscribe (benchmarks).
        self.flood_on_subscribe = 0

    # -- reading ---------------------------------------------------------------------------------

    @property
    def live(self) -> Connection | None:
        for conn in reversed(self.connections):
            if conn.subscribed and conn.closed_by is None:
                return conn
        return None

    def frames(self, cmd: str) -> list[Frame]:
        return [f for f in self.calls if f.cmd == cmd]

    def answers(self, chatid: str) -> list[Answer]:
        """The bubbles and pushes of a conversation, in the order they appeared."""
        items: list[tuple[int, Answer]] = []
        for s in self.streams.values():
            if s.chatid == chatid and s.contents:
                items.append(
                    (s.seq, Answer(s.id, s.contents[-1], tuple(s.contents), s.finished, "stream"))
                )
        for p in self.pushes:
            if p.chatid == chatid and p.msgtype == "markdown":
                items.append((p.seq, Answer(p.req_id, p.content, (p.content,), True, "push")))
        items.sort(key=lambda pair: pair[0])
        return [a for _, a in items]

    # -- faults ----------------------------------------------------------------------------------

    def revoke(self, req_id: str) -> None:
        """Replies to ``req_id`` fail with 846605 from now on."""
        self._revoked.add(req_id)

    def drop_after(self, k: int) -> None:
        self._drop_after = k

    async def drop_connection(self) -> None:
        conn = self.live
        if conn is not None:
            conn.push("drop")
            await self.wait_until(lambda: conn.closed_by is not None)

    async def take_over(self, *, msgid: bool = True) -> None:
        """Another process subscribed: ``disconnected_event``, then the server closes.

        ``msgid=False``: the event without a ``msgid`` (only its type says what it is)."""
        conn = self.live
        if conn is None:
            return
        event = self._event_frame("disconnected_event", chattype=None)
        if not msgid:
            del event["body"]["msgid"]
        conn.push("frame", event)
        conn.push("close", (1000, "replaced"))
        await self.wait_until(lambda: conn.closed_by is not None)

    # -- media -----------------------------------------------------------------------------------

    def add_media(self, data: bytes, *, name: str | None = None) -> dict[str, str]:
        """Encrypt ``data`` with a fresh key and serve it; returns ``{url, aeskey}``."""
        key = secrets.token_bytes(32)
        token = secrets.token_hex(8)
        self._media[token] = (encrypt(data, key), trio.current_time(), name)
        aeskey = base64.b64encode(key).decode().rstrip("=")
        return {"url": f"{self.media_base}/media/{token}", "aeskey": aeskey}

    async def _http(self, request: Request) -> Response:
        token = request.path.rsplit("/", 1)[-1]
        item = self._media.get(token)
        if request.method != "GET" or item is None:
            return Response(404, b"not found")
        blob, at, name = item
        if trio.current_time() - at > self.media_ttl_s:
            return Response(403, b"expired")
        headers = [("content-type", "application/octet-stream")]
        if name:
            headers.append(("content-disposition", f"attachment; filename={name}"))
        return Response(200, blob, headers)

    # -- injecting -------------------------------------------------------------------------------

    def _msgid(self) -> str:
        return f"msg{int(time.time())}{next(self._ids):06d}"

    def _req_id(self, cmd: str) -> str:
        return f"{cmd}_{int(time.time() * 1000)}_{secrets.token_hex(4)}"

    def body(
        self,
        msgtype: str = "text",
        *,
        text: str | None = None,
        chattype: str = "single",
        userid: str | None = None,
        chatid: str | None = None,
        quote: dict[str, Any] | None = None,
        mention: bool = True,
        extra: dict[str, Any] | None = None,
        msgid: str | None = None,
    ) -> dict[str, Any]:
        """A message callback body as WeCom sends it."""
        body: dict[str, Any] = {
            "msgid": msgid or self._msgid(),
            "aibotid": self.bot_id,
            "chattype": chattype,
            "from": {"userid": userid or self.user_id},
            "create_time": int(time.time()),
            "msgtype": msgtype,
        }
        if chattype == "group":
            body["chatid"] = chatid or self.group_id
        if msgtype == "text":
            content = text or ""
            if chattype == "group" and mention:
                content = f"@dshim {content}"
            body["text"] = {"content": content}
        elif msgtype == "voice":
            body["voice"] = {"content": text or ""}
        if quote is not None:
            body["quote"] = quote
        body.update(extra or {})
        return body

    async def callback(self, cmd: str, body: dict[str, Any], *, req_id: str | None = None) -> str:
        """Deliver a callback frame on the live connection; returns its req_id."""
        await self.wait_until(lambda: self.live is not None)
        conn = self.live
        assert conn is not None
        rid = req_id or self._req_id(cmd)
        chatid = body.get("chatid") or body.get("from", {}).get("userid", "")
        kind = "event" if cmd == "aibot_event_callback" else "msg"
        self.inbound[rid] = _Inbound(rid, chatid, trio.current_time(), kind)
        frame = {"cmd": cmd, "headers": {"req_id": rid}, "body": body}
        conn.push("frame", frame)
        self.callbacks_sent += 1
        if self._drop_after is not None:
            self._drop_after -= 1
            if self._drop_after <= 0:
                self._drop_after = None
                conn.push("drop")
        self.changed()
        return rid

    async def user_message(self, text: str, **kw: Any) -> dict[str, Any]:
        """The user writes (single chat unless ``chattype="group"``); returns the body."""
        body = self.body("text", text=text, **kw)
        await self.callback("aibot_msg_callback", body)
        return body

    def _event_frame(
        self,
        eventtype: str,
        *,
        chattype: str | None = "single",
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "msgid": self._msgid(),
            "create_time": int(time.time()),
            "aibotid": self.bot_id,
            "from": {"userid": self.user_id},
            "msgtype": "event",
            "event": {"eventtype": eventtype, **(extra or {})},
        }
        if chattype is not None:
            body["chattype"] = chattype
        return {
            "cmd": "aibot_event_callback",
            "headers": {"req_id": self._req_id("aibot_event_callback")},
            "body": body,
        }

    async def event(self, eventtype: str, *, chattype: str | None = "single", **extra: Any) -> str:
        f = self._event_frame(eventtype, chattype=chattype, extra=extra)
        return await self.callback(f["cmd"], f["body"], req_id=f["headers"]["req_id"])

    async def click(self, task_id: str, event_key: str) -> str:
        """The user presses a card button (``template_card_event``)."""
        card = {"card_type": "button_interaction", "event_key": event_key, "task_id": task_id}
        return await self.event("template_card_event", template_card_event=card)

    async def _flood(self, conn: Connection, n: int) -> None:
        """``n`` text messages from ``n`` users, as fast as the socket takes them."""
        for i in range(n):
            body = self.body("text", text=f"message {i} " + "lorem ipsum " * 20, userid=f"u{i}")
            rid = self._req_id("aibot_msg_callback")
            frame = {"cmd": "aibot_msg_callback", "headers": {"req_id": rid}, "body": body}
            try:
                await conn.send.send(("frame", frame))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                return

    # -- the socket ------------------------------------------------------------------------------

    async def _serve(self, request: WebSocketRequest) -> None:
        ws = await request.accept()
        send, recv = trio.open_memory_channel[tuple[str, Any]](OUTBOX)
        conn = Connection(len(self.connections), ws, send, trio.current_time())
        self.connections.append(conn)
        self.changed()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer, conn, recv)
            try:
                while True:
                    data = await ws.get_message()
                    await self._on_frame(conn, data, nursery)
            except ConnectionClosed:
                if conn.closed_by is None:
                    conn.closed_by = "client"
                    conn.closed_at = trio.current_time()
            finally:
                send.close()
                self.changed()
                nursery.cancel_scope.cancel()

    async def _writer(
        self, conn: Connection, recv: trio.MemoryReceiveChannel[tuple[str, Any]]
    ) -> None:
        await write_frames(conn, recv, self.changed)

    def _ack(
        self, conn: Connection, req_id: str, errcode: int, errmsg: str, body: Any = None
    ) -> None:
        out: dict[str, Any] = {"headers": {"req_id": req_id}, "errcode": errcode, "errmsg": errmsg}
        if body is not None:
            out["body"] = body
        conn.push("frame", out)

    async def _on_frame(self, conn: Connection, data: str | bytes, nursery: trio.Nursery) -> None:
        now = trio.current_time()
        try:
            f = json.loads(data)
            cmd = f.get("cmd")
            req_id = f["headers"]["req_id"]
            body = f.get("body")
        except (ValueError, KeyError, TypeError, AttributeError):
            conn.push("close", (1003, "bad frame"))
            return
        frame = self.record(Frame(str(cmd), str(req_id), body, now, conn.index))
        if cmd == "aibot_subscribe":
            ok = (
                isinstance(body, dict)
                and body.get("bot_id") == self.bot_id
                and body.get("secret") == self.secret
            )
            self.subscribes.append((now, ok))
            frame.errcode = 0 if ok else ERR_AUTH
            if not ok:
                self._ack(conn, req_id, ERR_AUTH, "invalid bot_id or secret")
                conn.push("close", (1000, "auth failed"))
                return
            for other in self.connections:  # one live connection per bot
                if other is not conn and other.subscribed and other.closed_by is None:
                    other.push("frame", self._event_frame("disconnected_event", chattype=None))
                    other.push("close", (1000, "replaced"))
            conn.subscribed = True
            self._ack(conn, req_id, 0, "ok")
            self.changed()
            if self.flood_on_subscribe:
                nursery.start_soon(self._flood, conn, self.flood_on_subscribe)
            return
        if not conn.subscribed:
            conn.push("close", (1008, "not subscribed"))
            return
        if cmd == "ping":
            self.pings.append(now)
            frame.errcode = 0
            if self.ack_pings:
                self._ack(conn, req_id, 0, "ok")
            self.changed()
            return
        if req_id in conn.in_flight:
            # The previous frame of this req_id has no ack yet: acks would be mis-attributed.
            self.order_violations.append(frame)
            frame.errcode = ERR_INVALID
            self._ack(conn, req_id, ERR_INVALID, "previous frame of this req_id not acked")
            return
        try:
            fault = await self.faults_for(str(cmd))  # slow: sleeps before the ack
        except DropConnection:
            conn.push("drop")  # closed instead of acked: the frame is not processed
            return
        errcode, errmsg, ack_body = self._handle(str(cmd), str(req_id), body, fault)
        frame.errcode = errcode
        self.changed()
        if self.losing(str(cmd)):
            return  # processed, but its ack never reaches the bot
        conn.in_flight.add(req_id)
        delay = self.ack_delay_s

        async def ack_later() -> None:
            if delay > 0:
                await trio.sleep(delay)
            conn.in_flight.discard(req_id)
            self._ack(conn, req_id, errcode, errmsg, ack_body)

        nursery.start_soon(ack_later)

    def _handle(self, cmd: str, req_id: str, body: Any, fault: Any) -> tuple[int, str, Any]:
        now = trio.current_time()
        if fault is not None:
            return fault.status, fault.description or "fault", None
        if not isinstance(body, dict):
            return ERR_INVALID, "no body", None
        if cmd == "aibot_respond_msg":
            return self._respond(req_id, body, now)
        if cmd == "aibot_send_msg":
            chatid = str(body.get("chatid", ""))
            msgtype = str(body.get("msgtype", ""))
            content = ""
            if msgtype == "markdown":
                content = str((body.get("markdown") or {}).get("content", ""))
                if len(content.encode()) > MAX_CONTENT_BYTES:
                    return ERR_INVALID, "content exceed max length", None
            elif msgtype != "template_card":
                return ERR_INVALID, "unsupported msgtype", None
            card = body.get("template_card")
            self.pushes.append(Push(req_id, chatid, msgtype, content, now, card, next(self._seq)))
            return 0, "ok", None
        inbound = self.inbound.get(req_id)
        if cmd == "aibot_respond_welcome_msg":
            if inbound is None or now - inbound.at > 5.0:
                return 846605, "invalid req_id", None
            self.welcomes.append(
                (inbound.chatid, str((body.get("text") or {}).get("content")), now)
            )
            return 0, "ok", None
        if cmd == "aibot_respond_update_msg":
            if inbound is None or now - inbound.at > 5.0:
                return 846605, "invalid req_id", None
            self.card_updates.append((req_id, body.get("template_card"), now))
            return 0, "ok", None
        return ERR_INVALID, "unknown cmd", None

    def _respond(self, req_id: str, body: dict[str, Any], now: float) -> tuple[int, str, Any]:
        inbound = self.inbound.get(req_id)
        if inbound is None or req_id in self._revoked or inbound.kind != "msg":
            return 846605, "invalid req_id", None
        msgtype = body.get("msgtype")
        if msgtype not in ("stream", "stream_with_template_card"):
            return ERR_INVALID, "unsupported msgtype", None
        st = body.get("stream") or {}
        sid = str(st.get("id", ""))
        content = str(st.get("content", ""))
        if "msg_item" in st:
            return ERR_INVALID, "msg_item not supported", None
        if not sid:
            return ERR_INVALID, "stream.id missing", None
        if len(content.encode()) > MAX_CONTENT_BYTES:
            return ERR_INVALID, "content exceed max length", None
        stream = self.streams.get(sid)
        if stream is None:
            stream = Stream(sid, req_id, inbound.chatid, now, seq=next(self._seq))
            self.streams[sid] = stream
        elif stream.req_id != req_id:
            return ERR_INVALID, "stream id of another message", None
        elif stream.finished:
            return ERR_INVALID, "stream already finished", None
        elif now - stream.first_at > self.stream_lifetime_s:
            return 846608, "stream message update expired", None
        if msgtype == "stream_with_template_card":
            if inbound.carded:
                return ERR_INVALID, "template card already attached", None
            inbound.carded = True
            stream.card = body.get("template_card")
        stream.contents.append(content)
        stream.finished = bool(st.get("finish"))
        return 0, "ok", None


@asynccontextmanager
async def open_fake_wecom(
    *, host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> AsyncIterator[FakeWecom]:
    """Run a fake WeCom (websocket + media HTTP on 127.0.0.1, kernel ports) for the block;
    ``port`` is the websocket's."""
    fake = FakeWecom(**kwargs)

    async def ws(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_websocket(fake._serve, host, port, None, task_status=task_status)

    async def http(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_http(fake._http, host=host, task_status=task_status)

    async with open_servers(http, ws) as (http_server, ws_server):
        fake.media_base = http_server.url
        fake.ws_url = f"ws://{host}:{ws_server.port}"
        yield fake
    if fake.strict_order and fake.order_violations:
        # A frame sent before the previous ack of its req_id: acks would be mis-attributed.
        bad = ", ".join(f"{f.cmd} {f.req_id}" for f in fake.order_violations[:5])
        raise AssertionError(f"frames sent before the previous ack of their req_id: {bad}")


#: How the idle bench runs this fake: the bot's first contact is its subscribe.
IDLE_BENCH: IdleBench[FakeWecom] = IdleBench(
    open_fake_wecom,
    lambda f: {"bot_id": f.bot_id, "secret": f.secret, "ws_url": f.ws_url},
    lambda f: bool(f.subscribes),
)


def main(argv: list[str] | None = None) -> None:
    """Run the fake as a process (see :mod:`dshim.testing.fakes.cli`; ``--port`` is the
    websocket's); ``--flood n`` (benchmarks) delivers n text messages after every
    subscribe and prints one JSON line."""
    module = "dshim.testing.fakes.wecom"
    p = cli.parser(
        __doc__, module=module, flood="messages after each subscribe (benchmarks; prints JSON)"
    )
    args = p.parse_args(argv)

    def announce(fake: FakeWecom) -> cli.Announcement:
        if args.flood is not None:
            fake.flood_on_subscribe = args.flood
        settings = {"bot_id": fake.bot_id, "secret": fake.secret, "ws_url": fake.ws_url}
        notes = {"media_host": fake.media_base}
        line = {"ws_url": fake.ws_url, "bot_id": fake.bot_id, "secret": fake.secret}
        return cli.Announcement(
            "WeCom AI-bot long connection", fake.media_base, "wecom", settings, notes, line
        )

    cli.run(
        args,
        module=module,
        open_fake=lambda: open_fake_wecom(host=args.host, port=args.port),
        announce=announce,
        json_line=args.flood is not None,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
