"""A fake DingTalk: the OpenAPI, the Stream gateway and session webhooks on 127.0.0.1.

It speaks the wire protocol of /work/shared/protocols/dingtalk.md so the real channel runs
against it unchanged (``api_base`` = ``oapi_base`` = :attr:`FakeDingTalk.api_base`).
Usage::

    async with open_fake_dingtalk() as fake:
        ...  # run the bot with client_id/client_secret = fake.client_id/fake.client_secret
        await fake.wait_until(lambda: fake.live is not None)
        msg = fake.user_message(fake.dm_conversation, "hello")
        await fake.wait_until(lambda: fake.bot_messages(fake.dm_conversation))

HTTP: ``/v1.0/oauth2/accessToken`` (tokens expire after ``token_lifetime_s``; an expired or
unknown token is 401 everywhere), ``/v1.0/gateway/connections/open`` (a single-use ticket
per call), AI cards (``/v1.0/card/instances`` create / ``deliver`` / update,
``/v1.0/card/streaming``), robot sends (``oToMessages/batchSend``, ``groupMessages/send``
returning a ``processQueryKey``), ``messageFiles/download`` (a download URL on the fake),
``emotion/reply`` / ``recall``, and ``/robot/sendBySession?session=`` (session webhooks
that expire at ``sessionWebhookExpiredTime``).

Stream: the websocket at ``/connect?ticket=`` refuses unknown or used tickets (HTTP 401
upgrade refusal).  Frames are ``{specVersion, type, headers, data}`` with ``data`` a JSON
string.  Robot messages are CALLBACK frames on the newest connection that is not
draining; an unacked one is pushed again after ``redeliver_after_s`` (DingTalk: ~60 s).
Every ack is recorded (:attr:`acks`).  :meth:`send_ping` sends SYSTEM ping (the answers
are in :attr:`pings_answered`), :meth:`send_disconnect` SYSTEM disconnect (the connection
gets no more deliveries at once and is closed ``disconnect_close_s`` later),
:meth:`drop_connection` cuts the TCP connection without a close frame.

Knobs: :meth:`drop_after` (cut the connection after k more robot messages),
``cards_permitted`` (False: card APIs answer 403 missing scope), ``card_qps``
(card calls beyond this many per second answer 403 QPS), the shared fault queue keyed by
``"METHOD /path"`` (``fail_next(op, n, status=..., code=...)``, ``slow_next``,
``drop_next``), :meth:`drop_response_next` (process, then cut the connection unanswered),
:meth:`~dshim.testing.fakes.base.FakePlatform.outage` for a time (every HTTP call, or the
ops named, answers 500, is dropped unprocessed, or is processed with its answer lost),
``webhook_lifetime_s``, ``credentials_valid``.

Users: :meth:`user_message` injects a robot message as DingTalk pushes it (direct or
group, @-mention, quotes of earlier messages: a quote of the bot's card is an
``interactiveCard`` placeholder with ``originalProcessQueryKey``, like the real service;
files, pictures, audio); :meth:`add_user` gives another person a direct chat with the
bot.  :meth:`bot_messages` is what a chat shows of the bot.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from dshim.testing.fakes import cli
from dshim.testing.fakes.base import FakePlatform, Fault, IdleBench, open_servers
from dshim.testing.fakes.http import DropConnection, Request, Response, json_response, serve_http

__all__ = ["ApiCall", "BotMessage", "FakeDingTalk", "StreamConn", "open_fake_dingtalk"]

ROBOT_TOPIC = "/v1.0/im/bot/messages/get"
OUTBOX = 100_000
_ids = itertools.count(1)


def _id(prefix: str) -> str:
    return f"{prefix}{next(_ids):06d}{uuid.uuid4().hex[:10]}"


@dataclass
class ApiCall:
    """One HTTP request the bot made (``path`` without the query)."""

    method: str
    path: str
    json: Any
    status: int
    at: float
    query: dict[str, str] = field(default_factory=dict)

    @property
    def op(self) -> str:
        return f"{self.method} {self.path}"


@dataclass
class StreamConn:
    """One Stream websocket."""

    id: int
    opened_at: float
    ws: WebSocketConnection
    outbox: trio.MemorySendChannel[tuple[str, Any]]
    draining: bool = False
    closed_by: str | None = None  # "server" | "client" | "drop"
    closed_code: int | None = None
    closed_at: float | None = None
    frames_in: int = 0

    def push(self, kind: str, value: Any = None) -> None:
        try:
            self.outbox.send_nowait((kind, value))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    @property
    def open(self) -> bool:
        return self.closed_by is None


@dataclass
class BotMessage:
    """A message of the bot as the chat shows it: a card (``id`` = the server's msgId,
    ``track_id`` its outTrackId) or markdown (webhook or OpenAPI)."""

    id: str
    conversation_id: str
    kind: str  # "card" | "markdown"
    text: str
    at: float
    shown: list[str] = field(default_factory=list)
    track_id: str | None = None
    process_query_key: str | None = None
    via: str = ""
    finalized: bool = False
    flow_status: str | None = None
    error: bool = False
    at_users: Any = None


class FakeDingTalk(FakePlatform[ApiCall]):
    """State and behaviour of the fake; see the module docstring."""

    def __init__(
        self,
        *,
        client_id: str = "dingfakeappkey000001",
        client_secret: str = "fake-dingtalk-secret-0123456789",
    ) -> None:
        super().__init__()
        self.client_id = client_id
        self.client_secret = client_secret
        self.robot_code = client_id
        self.chatbot_user_id = "$:LWCP_v1:$botFAKE000111222333"
        self.bot_name = "dshim bot"
        self.user = {
            "staff_id": "manager4321",
            "sender_id": "$:LWCP_v1:$userADA000999888",
            "nick": "Ada",
        }
        self.dm_conversation = "cidDMada0000000000000000=="
        #: staff id -> (the person, their direct conversation with the bot)
        self.people: dict[str, tuple[dict[str, str], str]] = {
            self.user["staff_id"]: (self.user, self.dm_conversation)
        }
        self.group_conversation = "cidGROUPteam00000000000=="
        self.group_title = "Team room"
        #: Epoch seconds for message times and webhook expiry (tests: the bot's clock).
        self.clock: Callable[[], float] = time.time
        # knobs
        self.token_lifetime_s = 7200.0
        self.webhook_lifetime_s = 3600.0
        self.redeliver_after_s: float | None = 60.0
        self.disconnect_close_s = 10.0
        self.cards_permitted = True
        self.card_qps: int | None = None
        self.credentials_valid = True
        #: Send a SYSTEM ping right after every connect (probes).
        self.ping_on_connect = False
        #: Push this many direct messages right after every connect (benchmarks).
        self.flood_on_connect = 0
        # state
        self.tokens: dict[str, float] = {}
        self.tickets: dict[str, bool] = {}  # ticket -> used
        self.registrations: list[dict[str, Any]] = []
        self.connections: list[StreamConn] = []
        self.acks: list[tuple[float, str, Any]] = []
        self.pings_sent: dict[str, float] = {}
        self.pings_answered: dict[str, float] = {}
        self.pushed: dict[str, dict[str, Any]] = {}  # frame messageId -> robot message
        self.delivered: list[tuple[float, int, str]] = []  # (at, conn id, msgId)
        self.cards: dict[str, dict[str, Any]] = {}  # outTrackId -> card
        self.messages: list[BotMessage] = []
        self.user_messages: dict[str, dict[str, Any]] = {}
        self.webhooks: dict[str, tuple[str, float]] = {}  # session -> (conversation, expiry)
        self.files: dict[str, bytes] = {}
        self.reactions: list[tuple[str, str]] = []  # ("reply" | "recall", msgId)
        self._card_calls: list[float] = []
        self._lost_responses: dict[str, int] = {}
        self._queue: list[str] = []  # frame ids waiting for a connection
        self._drop_after: int | None = None
        self.api_base = ""
        self.ws_url = ""

    # -- reading what the bot did ---------------------------------------------------------

    def calls_to(self, method: str, path_prefix: str = "") -> list[ApiCall]:
        return [c for c in self.calls if c.method == method and c.path.startswith(path_prefix)]

    def bot_messages(self, conversation_id: str) -> list[BotMessage]:
        """What the chat shows of the bot, oldest first (cards after their last update)."""
        return [m for m in self.messages if m.conversation_id == conversation_id]

    @property
    def live(self) -> StreamConn | None:
        """The newest open, not draining connection."""
        for conn in reversed(self.connections):
            if conn.open and not conn.draining:
                return conn
        return None

    def acked(self, frame_id: str) -> bool:
        return any(mid == frame_id for _, mid, _ in self.acks)

    def token_requests(self) -> int:
        return len(self.calls_to("POST", "/v1.0/oauth2/accessToken"))

    # -- fault actions --------------------------------------------------------------------

    def drop_response_next(self, op: str, count: int = 1) -> None:
        """Process the next ``count`` ``op`` requests, then cut the connection unanswered."""
        self._lost_responses[op.lower()] = self._lost_responses.get(op.lower(), 0) + count

    def add_user(self, staff_id: str, nick: str) -> str:
        """One more person who can write the bot directly; returns their conversation."""
        person = {"staff_id": staff_id, "sender_id": f"$:LWCP_v1:${staff_id}", "nick": nick}
        conversation = f"cidDM{staff_id}=="
        self.people[staff_id] = (person, conversation)
        return conversation

    def expire_tokens(self) -> None:
        """Every token issued so far is rejected from now on (401)."""
        self.tokens.clear()

    def drop_after(self, k: int) -> None:
        """Cut the live connection (no close frame) right after k more robot messages."""
        self._drop_after = k

    async def drop_connection(self) -> None:
        conn = self.live
        if conn is not None:
            conn.push("drop")

    def send_ping(self, conn: StreamConn | None = None) -> str:
        """A SYSTEM ping on ``conn`` (default: the live one); returns its opaque."""
        conn = conn or self.live
        opaque = uuid.uuid4().hex
        if conn is not None:
            frame_id = _id("ping-")
            self.pings_sent[opaque] = trio.current_time()
            conn.push(
                "frame",
                _frame("SYSTEM", "ping", frame_id, json.dumps({"opaque": opaque})),
            )
        return opaque

    def send_disconnect(self, reason: str = "connection is expired") -> StreamConn | None:
        """SYSTEM disconnect: no more deliveries on that socket; closed a bit later."""
        conn = self.live
        if conn is None:
            return None
        conn.draining = True
        conn.push(
            "frame", _frame("SYSTEM", "disconnect", _id("sys-"), json.dumps({"reason": reason}))
        )
        conn.push("close_later", self.disconnect_close_s)
        self.changed()
        return conn

    # -- users ----------------------------------------------------------------------------

    def user_message(
        self,
        conversation_id: str,
        text: str = "",
        *,
        msgtype: str = "text",
        content: Any = None,
        mention: bool = True,
        reply_to: str | None = None,
        at: float | None = None,
        extra: dict[str, Any] | None = None,
        push: bool = True,
        user: str | None = None,
    ) -> dict[str, Any]:
        """A robot message from the test user (``user``: the staff id of another person,
        see :meth:`add_user`), pushed as DingTalk does (group messages only reach a robot
        when it is @-mentioned: ``mention=False`` pushes it anyway, with ``isInAtList``
        false, for the negative case)."""
        person = self.people[user][0] if user is not None else self.user
        direct = any(conversation_id == dm for _, dm in self.people.values())
        created_ms = int((at if at is not None else self.clock()) * 1000)
        session = uuid.uuid4().hex
        self.webhooks[session] = (conversation_id, created_ms / 1000 + self.webhook_lifetime_s)
        msg: dict[str, Any] = {
            "conversationId": conversation_id,
            "chatbotCorpId": "dingcorpfake",
            "chatbotUserId": self.chatbot_user_id,
            "msgId": _id("msg"),
            "senderNick": person["nick"],
            "isAdmin": False,
            "senderStaffId": person["staff_id"],
            "sessionWebhookExpiredTime": created_ms + int(self.webhook_lifetime_s * 1000),
            "createAt": created_ms,
            "senderCorpId": "dingcorpfake",
            "conversationType": "1" if direct else "2",
            "senderId": person["sender_id"],
            "sessionWebhook": f"{self.api_base}/robot/sendBySession?session={session}",
            "robotCode": self.robot_code,
            "msgtype": msgtype,
        }
        if not direct:
            msg["conversationTitle"] = self.group_title
            msg["isInAtList"] = mention
            msg["atUsers"] = [{"dingtalkId": self.chatbot_user_id}] if mention else []
            if mention and msgtype == "text":
                text = " " + text
        if msgtype == "text":
            msg["text"] = {"content": text}
        if content is not None:
            msg["content"] = content
        if reply_to is not None:
            quoted, key = self._quote(reply_to)
            msg.setdefault("text", {"content": text})
            msg["text"]["isReplyMsg"] = True
            msg["text"]["repliedMsg"] = quoted
            if key is not None:
                msg["originalProcessQueryKey"] = key
        if extra:
            msg.update(extra)
        self.user_messages[msg["msgId"]] = msg
        if push:
            self.push_message(msg)
        return msg

    def _quote(self, message_id: str) -> tuple[dict[str, Any], str | None]:
        """``text.repliedMsg`` for a quote of ``message_id`` (and its process key)."""
        for bot in self.messages:
            if bot.id == message_id:
                base = {
                    "msgId": bot.id,
                    "senderId": self.chatbot_user_id,
                    "senderNick": self.bot_name,
                    "createdAt": int(bot.at * 1000),
                }
                if bot.kind == "card":
                    # The real service gives only a placeholder for the bot's AI card.
                    return {
                        **base,
                        "msgType": "interactiveCard",
                        "content": "[Interactive Card Message]",
                    }, bot.track_id
                return {
                    **base,
                    "msgType": "markdown",
                    "content": {"text": bot.text},
                }, bot.process_query_key
        user = self.user_messages.get(message_id)
        if user is None:
            return {"msgId": message_id, "msgType": "text"}, None
        quoted = {
            "msgId": message_id,
            "senderId": user["senderId"],
            "senderNick": user.get("senderNick"),
            "createdAt": user["createAt"],
            "msgType": user["msgtype"],
        }
        if user["msgtype"] == "text":
            quoted["content"] = {"content": user["text"]["content"].strip()}
        else:
            content = user.get("content")
            if isinstance(content, str):  # the push carried it as a JSON string
                content = json.loads(content)
            if isinstance(content, dict):
                quoted["content"] = _quoted_content(content)
        return quoted, None

    def push_message(self, msg: dict[str, Any], *, frame_id: str | None = None) -> str:
        """Push a robot message as a CALLBACK frame (queued while no connection is live)."""
        frame_id = frame_id or _id("frame-")
        self.pushed[frame_id] = msg
        conn = self.live
        if conn is None:
            self._queue.append(frame_id)
        else:
            self._send_callback(conn, frame_id)
        return frame_id

    def redeliver(self, frame_id: str) -> None:
        """Push the same message again (a new delivery of the same ``msgId``)."""
        self.push_message(self.pushed[frame_id])

    def _send_callback(self, conn: StreamConn, frame_id: str) -> None:
        msg = self.pushed[frame_id]
        data = json.dumps(msg, ensure_ascii=False, separators=(",", ":"))
        conn.push("frame", _frame("CALLBACK", ROBOT_TOPIC, frame_id, data))
        self.delivered.append((trio.current_time(), conn.id, msg.get("msgId", "")))
        if self._drop_after is not None:
            self._drop_after -= 1
            if self._drop_after <= 0:
                self._drop_after = None
                conn.push("drop")
        if self.redeliver_after_s is not None:
            conn.push("watch_ack", frame_id)
        self.changed()

    # -- the stream ----------------------------------------------------------------------

    async def _stream(self, request: WebSocketRequest) -> None:
        path, _, query = request.path.partition("?")
        ticket = urllib.parse.parse_qs(query).get("ticket", [""])[0]
        if path != "/connect" or self.tickets.get(ticket, True):
            await request.reject(401, body=b'{"code":"invalidTicket"}')
            return
        self.tickets[ticket] = True  # single use
        ws = await request.accept()
        send, recv = trio.open_memory_channel[tuple[str, Any]](OUTBOX)
        conn = StreamConn(len(self.connections), trio.current_time(), ws, send)
        self.connections.append(conn)
        self.changed()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer, conn, recv, nursery)
            if self.ping_on_connect:
                self.send_ping(conn)
            for i in range(self.flood_on_connect):
                self.push_message(
                    self.user_message(
                        self.dm_conversation, f"flood {i} " + "lorem ipsum " * 20, push=False
                    )
                )
            queued, self._queue = self._queue, []
            for frame_id in queued:
                self._send_callback(conn, frame_id)
            try:
                while True:
                    data = await ws.get_message()
                    conn.frames_in += 1
                    self._on_frame(data)
            except ConnectionClosed as exc:
                if conn.closed_by is None:
                    conn.closed_by = "client"
                    conn.closed_code = int(exc.reason.code) if exc.reason else None
                    conn.closed_at = trio.current_time()
            finally:
                send.close()
                self.changed()
                nursery.cancel_scope.cancel()

    async def _writer(
        self,
        conn: StreamConn,
        recv: trio.MemoryReceiveChannel[tuple[str, Any]],
        nursery: trio.Nursery,
    ) -> None:
        ws = conn.ws
        try:
            async for kind, value in recv:
                if kind == "frame":
                    await ws.send_message(
                        json.dumps(value, ensure_ascii=False, separators=(",", ":"))
                    )
                elif kind == "watch_ack":
                    nursery.start_soon(self._redeliver_unacked, value)
                elif kind == "close_later":
                    nursery.start_soon(self._close_later, conn, value)
                elif kind == "close":
                    await self._close(conn, *value)
                    return
                elif kind == "drop":
                    conn.closed_by, conn.closed_code = "drop", None
                    conn.closed_at = trio.current_time()
                    self.changed()
                    await ws._stream.aclose()  # no close frame: a cut connection
                    return
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            return

    async def _close(self, conn: StreamConn, code: int, reason: str) -> None:
        if conn.closed_by is None:
            conn.closed_by, conn.closed_code = "server", code
            conn.closed_at = trio.current_time()
            self.changed()
            with trio.move_on_after(2):
                await conn.ws.aclose(code, reason)

    async def _close_later(self, conn: StreamConn, seconds: float) -> None:
        await trio.sleep(seconds)
        await self._close(conn, 1000, "connection is expired")

    async def _redeliver_unacked(self, frame_id: str) -> None:
        if self.redeliver_after_s is None:
            return
        await trio.sleep(self.redeliver_after_s)
        if not self.acked(frame_id):
            self.redeliver(frame_id)

    def _on_frame(self, data: str | bytes) -> None:
        try:
            frame = json.loads(data)
            headers = frame.get("headers") or {}
            mid = headers.get("messageId")
            body = json.loads(frame.get("data") or "null")
        except (ValueError, TypeError, AttributeError):
            return
        now = trio.current_time()
        self.acks.append((now, str(mid), body))
        if isinstance(body, dict) and body.get("opaque") in self.pings_sent:
            self.pings_answered[body["opaque"]] = now
        self.changed()

    # -- HTTP -------------------------------------------------------------------------------

    async def _http(self, request: Request) -> Response:
        path = request.path
        try:
            body = request.json() if request.body else None
        except ValueError:
            body = None
        op = f"{request.method} {path}"
        try:
            fault = await self.faults_for(op)
        except DropConnection:
            self.record(ApiCall(request.method, path, body, 0, trio.current_time(), request.query))
            raise
        if fault is not None:
            response = _fault_response(fault)
        else:
            response = self._route(request, path, body)
        lost = self._lost_responses.get(op.lower(), 0) or int(self.losing(op))
        self.record(
            ApiCall(
                request.method,
                path,
                body,
                0 if lost else response.status,
                trio.current_time(),
                request.query,
            )
        )
        if lost:  # processed, but the answer never reaches the bot
            if self._lost_responses.get(op.lower(), 0):
                self._lost_responses[op.lower()] -= 1
            raise DropConnection(op)
        return response

    def _route(self, request: Request, path: str, body: Any) -> Response:
        if path == "/v1.0/oauth2/accessToken" and request.method == "POST":
            return self._token(body)
        if path == "/v1.0/gateway/connections/open" and request.method == "POST":
            return self._open(body)
        if path == "/robot/sendBySession" and request.method == "POST":
            return self._webhook(request.query.get("session", ""), body)
        if path.startswith("/files/") and request.method == "GET":
            data = self.files.get(path[len("/files/") :])
            return (
                Response(200, data, [("content-type", "application/octet-stream")])
                if data is not None
                else Response(404)
            )
        token = request.header("x-acs-dingtalk-access-token") or ""
        if self.tokens.get(token, -1.0) < trio.current_time():
            return _error(401, "InvalidAuthentication", "token is not authorized")
        if not isinstance(body, dict):
            return _error(400, "MissingParameter", "body is required")
        if path.startswith("/v1.0/card/"):
            refused = self._card_gate()
            if refused is not None:
                return refused
        handler = _ROUTES.get((request.method, path))
        if handler is None:
            return _error(404, "NotFound", "no such API")
        try:
            response: Response = getattr(self, handler)(body)
        except (KeyError, TypeError, ValueError) as exc:
            return _error(400, "InvalidParameter", f"bad request ({type(exc).__name__})")
        return response

    def _token(self, body: Any) -> Response:
        if (
            not self.credentials_valid
            or not isinstance(body, dict)
            or body.get("appKey") != self.client_id
            or body.get("appSecret") != self.client_secret
        ):
            return _error(400, "invalidClientIdOrSecret", "无效的clientId或者clientSecret")
        token = uuid.uuid4().hex
        self.tokens[token] = trio.current_time() + self.token_lifetime_s
        return json_response({"accessToken": token, "expireIn": int(self.token_lifetime_s)})

    def _open(self, body: Any) -> Response:
        if (
            not self.credentials_valid
            or not isinstance(body, dict)
            or body.get("clientId") != self.client_id
            or body.get("clientSecret") != self.client_secret
        ):
            return _error(401, "Unauthorized", "clientId or clientSecret is invalid")
        self.registrations.append(body)
        ticket = uuid.uuid4().hex
        self.tickets[ticket] = False
        return json_response({"endpoint": self.ws_url + "/connect", "ticket": ticket})

    def _card_gate(self) -> Response | None:
        if not self.cards_permitted:
            return json_response(
                {
                    "code": "Forbidden.AccessDenied.AccessTokenPermissionDenied",
                    "message": "没有调用该接口的权限",
                    "accessdenieddetail": {"requiredScopes": ["Card.Streaming.Write"]},
                },
                status=403,
            )
        if self.card_qps is not None:
            now = trio.current_time()
            self._card_calls = [t for t in self._card_calls if t > now - 1.0]
            if len(self._card_calls) >= self.card_qps:
                return _error(403, "Forbidden.AccessDenied.QpsLimitForAppkeyAndApi", "QPS 限流")
            self._card_calls.append(now)
        return None

    def _create_card(self, body: dict[str, Any]) -> Response:
        track = body["outTrackId"]
        if track in self.cards:
            return _error(400, "param.outTrackIdExists", "outTrackId already exists")
        self.cards[track] = {"body": body, "message": None, "content": ""}
        return json_response({"success": True, "result": {"outTrackId": track}})

    def _deliver_card(self, body: dict[str, Any]) -> Response:
        card = self.cards.get(body["outTrackId"])
        if card is None:
            return _error(404, "cardNotFound", "card instance not found")
        space = str(body["openSpaceId"])
        if space.startswith("dtv1.card//IM_ROBOT."):
            staff = space[len("dtv1.card//IM_ROBOT.") :]
            if staff not in self.people:
                return _error(400, "invalidOpenSpaceId", "unknown user")
            conversation = self.people[staff][1]
            at_users = None
        elif space.startswith("dtv1.card//IM_GROUP."):
            conversation = space[len("dtv1.card//IM_GROUP.") :]
            at_users = (body.get("imGroupOpenDeliverModel") or {}).get("atUserIds")
        else:
            return _error(400, "invalidOpenSpaceId", "bad openSpaceId")
        if card["message"] is None:
            msg = BotMessage(
                id=_id("msgBOT"),
                conversation_id=conversation,
                kind="card",
                text=card["content"],
                at=self.clock(),
                track_id=body["outTrackId"],
                via="card",
                at_users=at_users,
            )
            card["message"] = msg
            self.messages.append(msg)
        return json_response({"success": True, "result": [{"spaceType": "IM", "success": True}]})

    def _stream_card(self, body: dict[str, Any]) -> Response:
        card = self.cards.get(body["outTrackId"])
        if card is None:
            return _error(404, "cardNotFound", "card instance not found")
        if not body.get("guid") or body.get("key") != "msgContent":
            return _error(400, "InvalidParameter", "guid and key are required")
        content = str(body["content"])
        card["content"] = content if body.get("isFull") else card["content"] + content
        msg: BotMessage | None = card["message"]
        if msg is not None:
            if not msg.shown or msg.shown[-1] != card["content"]:  # what the user saw
                msg.shown.append(card["content"])
            msg.text = card["content"]
            msg.finalized = msg.finalized or bool(body.get("isFinalize"))
            msg.error = msg.error or bool(body.get("isError"))
        self.changed()
        return json_response({"success": True})

    def _update_card(self, body: dict[str, Any]) -> Response:
        card = self.cards.get(body["outTrackId"])
        if card is None:
            return _error(404, "cardNotFound", "card instance not found")
        params = (body.get("cardData") or {}).get("cardParamMap") or {}
        msg: BotMessage | None = card["message"]
        if msg is not None and "flowStatus" in params:
            msg.flow_status = str(params["flowStatus"])
        if "msgContent" in params:  # the card variable the streaming key writes too
            card["content"] = str(params["msgContent"])
            if msg is not None:
                if not msg.shown or msg.shown[-1] != card["content"]:
                    msg.shown.append(card["content"])
                msg.text = card["content"]
        self.changed()
        return json_response({"success": True})

    def _send_message(self, conversation: str, param: Any, key: str, via: str) -> BotMessage:
        data = json.loads(param) if isinstance(param, str) else param
        text = str(data.get("text") or data.get("content") or "")
        msg = BotMessage(
            id=_id("msgBOT"),
            conversation_id=conversation,
            kind="markdown",
            text=text,
            at=self.clock(),
            shown=[text],
            process_query_key=key,
            via=via,
        )
        self.messages.append(msg)
        self.changed()
        return msg

    def _batch_send(self, body: dict[str, Any]) -> Response:
        users = body.get("userIds")
        if (
            body.get("robotCode") != self.robot_code
            or not isinstance(users, list)
            or len(users) != 1
            or users[0] not in self.people
        ):
            return _error(400, "staffId.notExisted", "staffId not existed")
        key = _id("pqk")
        self._send_message(self.people[users[0]][1], body["msgParam"], key, "openapi")
        return json_response(
            {"processQueryKey": key, "invalidStaffIdList": [], "flowControlledStaffIdList": []}
        )

    def _group_send(self, body: dict[str, Any]) -> Response:
        if body.get("robotCode") != self.robot_code:
            return _error(400, "robotCode.notExisted", "bad robotCode")
        key = _id("pqk")
        self._send_message(str(body["openConversationId"]), body["msgParam"], key, "openapi")
        return json_response({"processQueryKey": key})

    def _webhook(self, session: str, body: Any) -> Response:
        known = self.webhooks.get(session)
        if known is None or not isinstance(body, dict):
            return json_response({"errcode": 300001, "errmsg": "session不存在"})
        conversation, expires = known
        if self.clock() > expires:
            return json_response({"errcode": 300005, "errmsg": "session已过期"})
        kind = body.get("msgtype")
        text = (body.get(kind) or {}).get("text" if kind == "markdown" else "content", "")
        msg = BotMessage(
            id=_id("msgBOT"),
            conversation_id=conversation,
            kind="markdown",
            text=str(text),
            at=self.clock(),
            shown=[str(text)],
            via="webhook",
            at_users=(body.get("at") or {}).get("atUserIds"),
        )
        self.messages.append(msg)
        self.changed()
        return json_response({"errcode": 0, "errmsg": "ok"})

    def _download(self, body: dict[str, Any]) -> Response:
        code = str(body["downloadCode"])
        if code not in self.files or body.get("robotCode") != self.robot_code:
            return _error(404, "downloadCode.invalid", "unknown downloadCode")
        return json_response({"downloadUrl": f"{self.api_base}/files/{code}"})

    def _emotion(self, kind: str) -> Any:
        def handle(body: dict[str, Any]) -> Response:
            self.reactions.append((kind, str(body["openMsgId"])))
            self.changed()
            return json_response({"success": True})

        return handle

    def _emotion_reply(self, body: dict[str, Any]) -> Response:
        return self._emotion("reply")(body)  # type: ignore[no-any-return]

    def _emotion_recall(self, body: dict[str, Any]) -> Response:
        return self._emotion("recall")(body)  # type: ignore[no-any-return]


_ROUTES: dict[tuple[str, str], str] = {
    ("POST", "/v1.0/card/instances"): "_create_card",
    ("POST", "/v1.0/card/instances/deliver"): "_deliver_card",
    ("PUT", "/v1.0/card/streaming"): "_stream_card",
    ("PUT", "/v1.0/card/instances"): "_update_card",
    ("POST", "/v1.0/robot/oToMessages/batchSend"): "_batch_send",
    ("POST", "/v1.0/robot/groupMessages/send"): "_group_send",
    ("POST", "/v1.0/robot/messageFiles/download"): "_download",
    ("POST", "/v1.0/robot/emotion/reply"): "_emotion_reply",
    ("POST", "/v1.0/robot/emotion/recall"): "_emotion_recall",
}


def _quoted_content(content: dict[str, Any]) -> dict[str, Any]:
    """A media or rich-text message's content as DingTalk quotes it (segments in the
    quote shape ``{msgType, content}`` / ``{msgType: "picture", downloadCode}``)."""
    if "richText" in content:
        segments = []
        for seg in content["richText"]:
            if seg.get("type") == "picture":
                segments.append({"msgType": "picture", "downloadCode": seg.get("downloadCode")})
            elif "text" in seg:
                segments.append({"msgType": "text", "content": seg["text"]})
        return {"richText": segments}
    return {k: content[k] for k in ("downloadCode", "fileName", "recognition") if k in content}


def _frame(kind: str, topic: str, message_id: str, data: str) -> dict[str, Any]:
    return {
        "specVersion": "1.0",
        "type": kind,
        "headers": {
            "appId": "fake-app",
            "connectionId": "fake-conn",
            "contentType": "application/json",
            "messageId": message_id,
            "time": str(int(time.time() * 1000)),
            "topic": topic,
        },
        "data": data,
    }


def _error(status: int, code: str, message: str) -> Response:
    return json_response(
        {"code": code, "message": message, "requestid": uuid.uuid4().hex}, status=status
    )


def _fault_response(fault: Fault) -> Response:
    """A scripted ``fail_next`` fault in DingTalk's error shape (``code=`` sets the code)."""
    code = str(fault.extra.get("code", "Throttling" if fault.status == 429 else "ServiceError"))
    response = _error(fault.status, code, fault.description or f"{fault.status}: scripted failure")
    if fault.retry_after is not None:
        response.headers.append(("retry-after", str(int(fault.retry_after))))
    return response


@asynccontextmanager
async def open_fake_dingtalk(
    *, host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> AsyncIterator[FakeDingTalk]:
    """Run a fake DingTalk (HTTP + Stream websocket on 127.0.0.1) for the block."""
    fake = FakeDingTalk(**kwargs)

    async def stream(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_websocket(fake._stream, host, 0, None, task_status=task_status)

    async def http(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_http(fake._http, host=host, port=port, task_status=task_status)

    async with open_servers(http, stream) as (http_server, ws_server):
        fake.api_base = http_server.url
        fake.ws_url = f"ws://{host}:{ws_server.port}"
        yield fake


#: How the idle bench runs this fake: the bot's first contact is its Stream connection.
IDLE_BENCH: IdleBench[FakeDingTalk] = IdleBench(
    open_fake_dingtalk,
    lambda f: {
        "client_id": f.client_id,
        "client_secret": f.client_secret,
        "api_base": f.api_base,
        "oapi_base": f.api_base,
    },
    lambda f: bool(f.connections),
)


def main(argv: list[str] | None = None) -> None:
    """Run the fake as a process (see :mod:`dshim.testing.fakes.cli`); ``--flood n``
    (benchmarks) pushes n robot messages after every connect and prints one JSON line."""
    module = "dshim.testing.fakes.dingtalk"
    p = cli.parser(
        __doc__, module=module, flood="robot messages after every connect (benchmarks; prints JSON)"
    )
    args = p.parse_args(argv)

    def announce(fake: FakeDingTalk) -> cli.Announcement:
        if args.flood is not None:
            fake.redeliver_after_s = None
            fake.flood_on_connect = args.flood
        settings = {
            "client_id": fake.client_id,
            "client_secret": fake.client_secret,
            "api_base": fake.api_base,
            "oapi_base": fake.api_base,
        }
        notes = {"stream": fake.ws_url}
        line = {
            "api_base": fake.api_base,
            "client_id": fake.client_id,
            "client_secret": fake.client_secret,
        }
        return cli.Announcement(
            "DingTalk OpenAPI + Stream", fake.api_base, "dingtalk", settings, notes, line
        )

    cli.run(
        args,
        module=module,
        open_fake=lambda: open_fake_dingtalk(host=args.host, port=args.port),
        announce=announce,
        json_line=args.flood is not None,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
