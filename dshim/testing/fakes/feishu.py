"""A fake Feishu / Lark: the Open API and the long-connection websocket on 127.0.0.1.

It speaks the real wire protocol of /shared/protocols/feishu.md -- the ``{code, msg,
data}`` envelope and error codes, ``pbbp2.Frame`` binary frames with pings, pongs
carrying ``ClientConfig``, fragmentation and acks, schema 2.0 event envelopes -- so the
real channel runs against it unchanged (``api_base`` = :attr:`FakeFeishu.api_base`).
Usage::

    async with open_fake_feishu() as fake:
        ...  # run the bot with app_id/app_secret = fake.app_id/fake.app_secret
        await fake.wait_until(lambda: fake.live is not None)
        sent = await fake.user_message(fake.dm_chat, "hello")
        await fake.wait_until(lambda: fake.bot_messages(fake.dm_chat))

Open API: token (``expire_tokens()`` makes every issued token fail with 99991663), bot
info, ws endpoint (a fresh ticket per call), message get / reply / create / edit (20
edits) / card patch, CardKit create, element content and settings (``sequence`` must
increase: 300317), reactions, resources, and the contact directory for substitute targets
(``contact/v3/users/batch_get_id`` by email, ``contact/v3/users/{id}`` by open_id or
union_id from :attr:`FakeFeishu.contacts`; ``contact_errors`` answers an id with a code
such as 99992361 / 41050 / 41012 / 40003, ``contact_empty`` with code 0 and no user,
``batch_get_id_error`` fails the batch).  A create with ``receive_id_type=open_id`` is a
DM (:attr:`FakeFeishu.dm_chats`).  Every ``uuid`` is remembered: a repeated
create/reply/update with the same uuid answers the first result and does nothing
(Feishu's idempotency); a CardKit card create takes ``type`` and ``data`` only (any
other field, a ``uuid`` too, is refused with 99992402) and makes a new entity each
time.  ``cardkit_enabled = False`` refuses CardKit with 99991672;
``lookup_denied`` (message ids) answers lookups with 99991672; the shared fault queue
keyed by ``"METHOD /template"`` (e.g. ``"PUT /open-apis/cardkit/v1/cards/{card_id}/elements/
{element_id}/content"``) answers ``fail_next(op, n, status=429|400|5xx, code=...)`` in
Feishu's shape (429 with ``x-ogw-ratelimit-reset``);
:meth:`~dshim.testing.fakes.base.FakePlatform.outage` for a time (every call, or the ops
named, answers 500, is dropped unprocessed, or is processed with its answer lost).  A
chat in :attr:`FakeFeishu.dm_chats` is a DM too (``dm_chats[open_id] = chat_id``: one
more person's DM with the bot).

Long connection: pings are answered with pongs (``answer_pings = False``: a dead
server) carrying ``pong_config`` when set; events go out as DATA ``type=event`` frames,
``fragments = k`` splits each into k frames; an event not acked within ``ack_timeout_s``
(3 s) is pushed again with a new ``event_id`` (``redeliver``), like the platform;
:meth:`redeliver_with_new_id` does it on demand; :meth:`drop_connection` cuts the TCP
connection, :meth:`close_connection` closes it cleanly; ``drop_after(k)`` after k more
events; ``max_connections`` refuses more with 514 / ``Handshake-Autherrcode: 1000040350``;
``global_rate_limit = n`` answers the next n Open API calls (any route) with 429;
:meth:`lose_response_next` carries a call out and then drops its answer.  Injection: :meth:`user_message`
(text, post, image, file...; mentions of the bot, of ``people``, replies, topics -- ``topic=``
a topic's root message, :attr:`topic_chat` a native topic group whose first messages carry
their ``omt_`` thread id unless ``starter_thread_ids = False``), :meth:`recall`,
:meth:`click` (a card button: ``card.action.trigger``), :meth:`push_event` (any event),
:meth:`push_frame` (raw bytes).

Reading: :attr:`calls` (every REST request), :attr:`acks`, :attr:`pings`,
:attr:`connections`, :meth:`bot_messages` (the bot's messages as the chat shows them
now, with every text each one showed).
"""

from __future__ import annotations

import html
import itertools
import json
import re
import secrets
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from dshim.channels.feishu.protocol import (
    METHOD_CONTROL,
    METHOD_DATA,
    Frame,
    FrameError,
    decode_frame,
    encode_frame,
)
from dshim.testing.fakes.base import FakePlatform, Fault, IdleBench, open_servers
from dshim.testing.fakes.http import DropConnection, Request, Response, json_response, serve_http

__all__ = ["FakeFeishu", "RestCall", "open_fake_feishu"]

_ids = itertools.count(1)
SERVICE_ID = 7
CARD_SCOPE_MSG = "Access denied. One of the following scopes is required: [cardkit:card:write]"
#: The body of ``POST /open-apis/cardkit/v1/cards`` (CardKit "创建卡片实体").
CARD_CREATE_FIELDS = frozenset({"type", "data"})


def _id(prefix: str) -> str:
    return f"{prefix}{next(_ids):06d}{secrets.token_hex(6)}"


@dataclass
class RestCall:
    """One REST request (``path`` without the query; ``op`` the fault key)."""

    method: str
    path: str
    op: str
    json: Any
    status: int
    code: int
    at: float
    query: dict[str, str] = field(default_factory=dict)


@dataclass
class Connection:
    id: int
    ws: WebSocketConnection
    opened_at: float
    outbox: trio.MemorySendChannel[tuple[str, Any]]
    closed_by: str | None = None
    pings: int = 0

    def push(self, kind: str, value: Any = None) -> None:
        try:
            self.outbox.send_nowait((kind, value))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass


@dataclass
class Pushed:
    """An event pushed to the bot, waiting for its ack."""

    frame_id: str
    event: dict[str, Any]
    sent_at: float
    acked: bool = False


@dataclass
class BotMessage:
    message_id: str
    chat_id: str
    msg_type: str
    text: str
    shown: list[str]
    card_id: str | None = None
    parent_id: str | None = None
    edits: int = 0
    #: A reply sent with ``reply_in_thread`` (it opened or continued a thread).
    in_thread: bool = False

    @property
    def pinged(self) -> list[str]:
        """The open_ids a text message's ``<at user_id="...">`` tags notify."""
        return _AT_TAG.findall(self.text) if self.msg_type == "text" else []


_AT_TAG = re.compile(r'<at user_id="([^"]+)">')


_ROUTES: list[tuple[str, re.Pattern[str], str, str]] = [
    (
        "POST",
        re.compile(r"^/open-apis/auth/v3/tenant_access_token/internal$"),
        "/open-apis/auth/v3/tenant_access_token/internal",
        "_token",
    ),
    ("POST", re.compile(r"^/callback/ws/endpoint$"), "/callback/ws/endpoint", "_endpoint"),
    ("GET", re.compile(r"^/open-apis/bot/v3/info$"), "/open-apis/bot/v3/info", "_bot_info"),
    (
        "GET",
        re.compile(r"^/open-apis/im/v1/messages/(?P<mid>[^/]+)$"),
        "/open-apis/im/v1/messages/{message_id}",
        "_get_message",
    ),
    ("GET", re.compile(r"^/open-apis/im/v1/messages$"), "/open-apis/im/v1/messages", "_list"),
    (
        "POST",
        re.compile(r"^/open-apis/im/v1/messages/(?P<mid>[^/]+)/reply$"),
        "/open-apis/im/v1/messages/{message_id}/reply",
        "_reply",
    ),
    ("POST", re.compile(r"^/open-apis/im/v1/messages$"), "/open-apis/im/v1/messages", "_create"),
    (
        "PUT",
        re.compile(r"^/open-apis/im/v1/messages/(?P<mid>[^/]+)$"),
        "/open-apis/im/v1/messages/{message_id}",
        "_edit",
    ),
    (
        "PATCH",
        re.compile(r"^/open-apis/im/v1/messages/(?P<mid>[^/]+)$"),
        "/open-apis/im/v1/messages/{message_id}",
        "_patch",
    ),
    (
        "POST",
        re.compile(r"^/open-apis/im/v1/messages/(?P<mid>[^/]+)/reactions$"),
        "/open-apis/im/v1/messages/{message_id}/reactions",
        "_react",
    ),
    (
        "DELETE",
        re.compile(r"^/open-apis/im/v1/messages/(?P<mid>[^/]+)/reactions/(?P<rid>[^/]+)$"),
        "/open-apis/im/v1/messages/{message_id}/reactions/{reaction_id}",
        "_unreact",
    ),
    (
        "GET",
        re.compile(r"^/open-apis/im/v1/messages/(?P<mid>[^/]+)/resources/(?P<key>[^/]+)$"),
        "/open-apis/im/v1/messages/{message_id}/resources/{file_key}",
        "_resource",
    ),
    ("POST", re.compile(r"^/open-apis/cardkit/v1/cards$"), "/open-apis/cardkit/v1/cards", "_card"),
    (
        "PUT",
        re.compile(r"^/open-apis/cardkit/v1/cards/(?P<cid>[^/]+)/elements/(?P<eid>[^/]+)/content$"),
        "/open-apis/cardkit/v1/cards/{card_id}/elements/{element_id}/content",
        "_card_content",
    ),
    (
        "PATCH",
        re.compile(r"^/open-apis/cardkit/v1/cards/(?P<cid>[^/]+)/settings$"),
        "/open-apis/cardkit/v1/cards/{card_id}/settings",
        "_card_settings",
    ),
    (
        "POST",
        re.compile(r"^/open-apis/contact/v3/users/batch_get_id$"),
        "/open-apis/contact/v3/users/batch_get_id",
        "_batch_get_id",
    ),
    (
        "GET",
        re.compile(r"^/open-apis/contact/v3/users/(?P<uid>[^/]+)$"),
        "/open-apis/contact/v3/users/{user_id}",
        "_user",
    ),
]


class _Fail(Exception):
    def __init__(self, status: int, code: int, msg: str) -> None:
        self.status, self.code, self.msg = status, code, msg


class FakeFeishu(FakePlatform[RestCall]):
    """State and behaviour of the fake; see the module docstring."""

    def __init__(self, *, ping_interval_s: float = 120.0) -> None:
        super().__init__()
        self.app_id = "cli_fake0000000001"
        self.app_secret = "fake-feishu-app-secret-" + secrets.token_hex(8)
        self.bot_open_id = "ou_bot000000000000000000000000001"
        self.bot_name = "dshim bot"
        self.user = {"open_id": "ou_user00000000000000000000000001", "name": "Ada"}
        self.other_user = {"open_id": "ou_user00000000000000000000000002", "name": "Bob"}
        self.dm_chat = "oc_dm000000000000000000000000001"
        self.group_chat = "oc_group0000000000000000000000001"
        #: A native topic group (``chat_type`` ``topic_group``): every top-level message
        #: opens a topic.
        self.topic_chat = "oc_topic0000000000000000000000001"
        #: Whether a topic's first message carries its ``thread_id`` (real starters are
        #: seen both with and without it; replies in the topic always carry it).
        self.starter_thread_ids = True
        #: A topic's root message id -> its ``thread_id`` (``omt_...``).
        self.topics: dict[str, str] = {}
        self.http_url = ""
        self.api_base = ""
        self.ws_url = ""
        # knobs
        self.ping_interval_s = ping_interval_s
        self.reconnect_interval_s = 1.0
        self.reconnect_nonce_s = 0.5
        self.pong_config: dict[str, Any] | None = None
        self.answer_pings = True
        self.fragments = 1
        self.redeliver = True
        self.ack_timeout_s = 3.0
        self.cardkit_enabled = True
        self.lookup_denied: set[str] = set()
        #: Scopes the app lacks: ``im:message`` (no lookups), ``im:message.group_msg``
        #: (no group-message reads), ``cardkit:card:write`` (like ``cardkit_enabled``).
        self.missing_scopes: set[str] = set()
        self.endpoint_code = 0
        #: More live connections than this are refused with 514 / 1000040350 (None: no limit).
        self.max_connections: int | None = None
        #: The next this many Open API calls (any route) answer 429 (a global rate limit).
        self.global_rate_limit = 0
        #: The contact directory (``contact/v3``): open_id -> a user (``open_id``,
        #: ``union_id``, ``user_id``, ``name``, ``email``, ``avatar`` as Feishu has them).
        self.contacts: dict[str, dict[str, Any]] = {}
        #: An id (open_id / union_id) whose profile lookup answers (http status, code):
        #: 99992361 cross-app, 41050 not visible, 41012 / 40001 invalid, 40003 internal.
        self.contact_errors: dict[str, tuple[int, int]] = {}
        #: Ids whose profile answers code 0 without a user.
        self.contact_empty: set[str] = set()
        #: ``batch_get_id`` answers (http status, code) when set.
        self.batch_get_id_error: tuple[int, int] | None = None
        #: open_id -> the p2p chat of the bot with that person (DMs by open_id).
        self.dm_chats: dict[str, str] = {}
        # state
        self.tokens: set[str] = set()
        self.token_requests = 0
        self.tickets: set[str] = set()
        self.connections: list[Connection] = []
        self.rejected = 0
        self.pushed: dict[str, Pushed] = {}
        self.acks: list[Frame] = []
        self.pings: list[float] = []
        self.messages: dict[str, dict[str, Any]] = {}
        self.bot_msgs: dict[str, BotMessage] = {}
        self.cards: dict[str, dict[str, Any]] = {}
        self.reactions: list[tuple[str, str, str]] = []  # (message id, emoji, "add"|"delete")
        self._uuids: dict[str, Any] = {}
        self._backlog: list[dict[str, Any]] = []
        self._drop_after: int | None = None
        self._lost: dict[str, int] = {}

    # -- reading ------------------------------------------------------------------------

    @property
    def live(self) -> Connection | None:
        for conn in reversed(self.connections):
            if conn.closed_by is None:
                return conn
        return None

    def bot_messages(self, chat_id: str) -> list[BotMessage]:
        return [b for b in self.bot_msgs.values() if b.chat_id == chat_id]

    def calls_to(self, op: str) -> list[RestCall]:
        return [c for c in self.calls if c.op.lower() == op.lower()]

    # -- knobs --------------------------------------------------------------------------

    def expire_tokens(self) -> None:
        self.tokens.clear()

    def lose_response_next(self, op: str, count: int = 1) -> None:
        """The next ``count`` calls of ``op`` are carried out, then the connection closes
        before the answer (a send whose outcome the bot cannot know)."""
        self._lost[op.lower()] = self._lost.get(op.lower(), 0) + count

    def drop_after(self, k: int) -> None:
        self._drop_after = k

    async def close_connection(self, code: int = 1000, reason: str = "") -> None:
        """Close the live connection cleanly from the server side (a server-initiated
        disconnect: the bot reconnects with a fresh URL)."""
        conn = self.live
        if conn is not None:
            conn.push("close", (code, reason))
            await self.wait_until(lambda: conn.closed_by is not None)

    async def drop_connection(self) -> None:
        conn = self.live
        if conn is not None:
            conn.push("drop")
            await self.wait_until(lambda: conn.closed_by is not None)

    # -- injecting ----------------------------------------------------------------------

    def envelope(self, event_type: str, event: dict[str, Any]) -> dict[str, Any]:
        return {
            "schema": "2.0",
            "header": {
                "event_id": secrets.token_hex(16),
                "token": "",
                "create_time": str(int(time.time() * 1000)),
                "event_type": event_type,
                "tenant_key": "tenant_fake",
                "app_id": self.app_id,
            },
            "event": event,
        }

    async def user_message(
        self,
        chat_id: str,
        text: str = "",
        *,
        sender: dict[str, str] | None = None,
        mention_bot: bool = False,
        mention_other: bool = False,
        reply_to: str | None = None,
        topic: str | None = None,
        msg_type: str = "text",
        content: dict[str, Any] | None = None,
        people: list[dict[str, str]] | None = None,
    ) -> dict[str, Any]:
        """A user's message, delivered as ``im.message.receive_v1`` (and kept for lookups).

        ``people``: more persons mentioned (``open_id``, ``name``, optional ``union_id`` /
        ``user_id``); each placeholder goes where the text has ``{0}``, ``{1}`` ... (or
        before the text when it has none).  ``topic``: the root message of the topic the
        message is posted in (``thread_id`` the topic's, ``root_id`` = ``parent_id`` = the
        root, as Feishu has a topic reply); a top-level message of :attr:`topic_chat`
        opens a topic of its own.
        """
        sender = sender or self.user
        mentions: list[dict[str, Any]] = []
        prefix = ""
        if mention_bot:
            key = f"@_user_{len(mentions) + 1}"
            mentions.append(self._mention(key, self.bot_open_id, self.bot_name))
            prefix += key + " "
        if mention_other:
            key = f"@_user_{len(mentions) + 1}"
            mentions.append(self._mention(key, self.other_user["open_id"], self.other_user["name"]))
            prefix += key + " "
        keys: list[str] = []
        for person in people or []:
            key = f"@_user_{len(mentions) + 1}"
            mentions.append(
                {
                    "key": key,
                    "id": {
                        "open_id": person["open_id"],
                        "union_id": person.get("union_id"),
                        "user_id": person.get("user_id"),
                    },
                    "name": person["name"],
                    "tenant_key": "tenant_fake",
                }
            )
            keys.append(key)
        if keys and "{0}" in text:
            text = text.format(*keys)
        elif keys:
            prefix += " ".join(keys) + " "
        if content is None:
            content = {"text": prefix + text}
        mid = _id("om_")
        message: dict[str, Any] = {
            "message_id": mid,
            "create_time": str(int(time.time() * 1000)),
            "update_time": str(int(time.time() * 1000)),
            "chat_id": chat_id,
            "chat_type": self._chat_type(chat_id),
            "message_type": msg_type,
            "content": json.dumps(content, ensure_ascii=False),
            "mentions": mentions or None,
        }
        if reply_to is not None:
            parent = self.messages.get(reply_to, {})
            message["parent_id"] = reply_to
            message["root_id"] = parent.get("root_id") or reply_to
        if topic is not None:
            message["thread_id"] = self.topics.setdefault(topic, _id("omt_"))
            message.setdefault("root_id", topic)
            message.setdefault("parent_id", topic)
        elif reply_to is None and chat_id == self.topic_chat:
            thread = self.topics.setdefault(mid, _id("omt_"))
            if self.starter_thread_ids:
                message["thread_id"] = thread
        if message.get("mentions") is None:
            del message["mentions"]
        self.messages[mid] = {
            **message,
            "sender": {"id": sender["open_id"], "id_type": "open_id", "sender_type": "user"},
        }
        event = {
            "sender": {
                "sender_id": {"open_id": sender["open_id"], "union_id": "on_x", "user_id": None},
                "sender_type": "user",
                "tenant_key": "tenant_fake",
            },
            "message": message,
        }
        await self.push_event(self.envelope("im.message.receive_v1", event))
        return message

    def _chat_type(self, chat_id: str) -> str:
        if chat_id == self.dm_chat or chat_id in self.dm_chats.values():
            return "p2p"
        return "topic_group" if chat_id == self.topic_chat else "group"

    def _mention(self, key: str, open_id: str, name: str) -> dict[str, Any]:
        return {
            "key": key,
            "id": {"open_id": open_id, "union_id": "on_x", "user_id": None},
            "name": name,
            "tenant_key": "tenant_fake",
        }

    async def recall(self, message_id: str) -> None:
        msg = self.messages.get(message_id, {})
        msg["deleted"] = True
        await self.push_event(
            self.envelope(
                "im.message.recalled_v1",
                {
                    "message_id": message_id,
                    "chat_id": msg.get("chat_id", ""),
                    "recall_time": str(int(time.time() * 1000)),
                    "recall_type": "message_owner",
                },
            )
        )

    def buttons(self, message_id: str) -> list[dict[str, Any]]:
        """The callback values of a card message's buttons."""
        card = self.bot_msgs[message_id]
        data = self.cards.get(card.card_id or "", {}).get("card") or {}
        out = []
        for el in (data.get("body") or {}).get("elements", []):
            if el.get("tag") == "button":
                for b in el.get("behaviors", []):
                    if b.get("type") == "callback":
                        out.append(b["value"])
        return out

    async def click(
        self, message_id: str, index: int, *, user: dict[str, str] | None = None
    ) -> None:
        """Press button ``index`` of a card (``card.action.trigger``)."""
        user = user or self.user
        value = self.buttons(message_id)[index]
        await self.push_event(
            self.envelope(
                "card.action.trigger",
                {
                    "operator": {"tenant_key": "tenant_fake", "open_id": user["open_id"]},
                    "token": "c-" + secrets.token_hex(12),
                    "action": {"value": value, "tag": "button"},
                    "host": "im_message",
                    "context": {
                        "open_message_id": message_id,
                        "open_chat_id": self.bot_msgs[message_id].chat_id,
                    },
                },
            )
        )

    async def push_event(self, event: dict[str, Any]) -> None:
        conn = self.live
        if conn is None:
            self._backlog.append(event)
            return
        self._send_event(conn, event)
        await trio.lowlevel.checkpoint()

    def push_frame(self, data: bytes) -> None:
        conn = self.live
        if conn is not None:
            conn.push("bytes", data)

    async def redeliver_with_new_id(self, frame_id: str) -> None:
        pushed = self.pushed[frame_id]
        event = json.loads(json.dumps(pushed.event))
        event["header"]["event_id"] = secrets.token_hex(16)
        await self.push_event(event)

    def _send_event(self, conn: Connection, event: dict[str, Any]) -> None:
        frame_id = secrets.token_hex(8)
        payload = json.dumps(event, ensure_ascii=False).encode("utf-8")
        k = max(1, min(self.fragments, len(payload)))
        size = -(-len(payload) // k)
        parts = [payload[i * size : (i + 1) * size] for i in range(k)]
        parts = [p for p in parts if p] or [b""]
        for seq, part in enumerate(parts):
            frame = Frame(
                seq_id=next(_ids),
                log_id=next(_ids),
                service=SERVICE_ID,
                method=METHOD_DATA,
                headers=[
                    ("type", "event"),
                    ("message_id", frame_id),
                    ("sum", str(len(parts))),
                    ("seq", str(seq)),
                    ("trace_id", secrets.token_hex(8)),
                    ("instance_id", "inst-1"),
                ],
                payload=part,
            )
            conn.push("bytes", encode_frame(frame))
        self.pushed[frame_id] = Pushed(frame_id, event, trio.current_time())
        self.changed()
        if self._drop_after is not None:
            self._drop_after -= 1
            if self._drop_after <= 0:
                self._drop_after = None
                conn.push("drop")

    # -- the long connection ------------------------------------------------------------

    async def _ws(self, request: WebSocketRequest) -> None:
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(request.path).query))
        if query.get("ticket") not in self.tickets:
            await request.reject(403, extra_headers=[(b"Handshake-Status", b"403")])
            return
        self.tickets.discard(query["ticket"])
        live = [c for c in self.connections if c.closed_by is None]
        if self.max_connections is not None and len(live) >= self.max_connections:
            await request.reject(
                514,
                extra_headers=[
                    (b"Handshake-Status", b"514"),
                    (b"Handshake-Msg", b"connection limit exceeded"),
                    (b"Handshake-Autherrcode", b"1000040350"),
                ],
            )
            self.rejected += 1
            self.changed()
            return
        ws = await request.accept()
        send, recv = trio.open_memory_channel[tuple[str, Any]](100_000)
        conn = Connection(len(self.connections), ws, trio.current_time(), send)
        self.connections.append(conn)
        self.changed()
        backlog, self._backlog = self._backlog, []
        for event in backlog:
            self._send_event(conn, event)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer, conn, recv)
            try:
                while True:
                    data = await ws.get_message()
                    self._on_frame(conn, data)
            except ConnectionClosed:
                if conn.closed_by is None:
                    conn.closed_by = "client"
            finally:
                send.close()
                self.changed()
                nursery.cancel_scope.cancel()

    async def _writer(
        self, conn: Connection, recv: trio.MemoryReceiveChannel[tuple[str, Any]]
    ) -> None:
        try:
            async for kind, value in recv:
                if kind == "bytes":
                    await conn.ws.send_message(value)
                elif kind == "close":
                    conn.closed_by = "server"
                    self.changed()
                    with trio.move_on_after(2):
                        await conn.ws.aclose(*value)
                    return
                elif kind == "drop":
                    conn.closed_by = "drop"
                    self.changed()
                    await conn.ws._stream.aclose()
                    return
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            return

    def _on_frame(self, conn: Connection, data: str | bytes) -> None:
        if isinstance(data, str):
            return
        try:
            frame = decode_frame(data)
        except FrameError:
            return
        kind = frame.header("type")
        if frame.method == METHOD_CONTROL and kind == "ping":
            conn.pings += 1
            self.pings.append(trio.current_time())
            self.changed()
            if self.answer_pings:
                cfg = self.pong_config
                pong = Frame(
                    service=frame.service,
                    method=METHOD_CONTROL,
                    headers=[("type", "pong")],
                    payload=json.dumps(cfg).encode() if cfg else None,
                )
                conn.push("bytes", encode_frame(pong))
        elif frame.method == METHOD_DATA:
            fid = frame.header("message_id") or ""
            self.acks.append(frame)
            pushed = self.pushed.get(fid)
            if pushed is not None:
                pushed.acked = True
            self.changed()

    async def _redeliverer(self) -> None:
        """Events not acked within ``ack_timeout_s`` are pushed again (new event_id)."""
        while True:
            await trio.sleep(0.5)
            if not self.redeliver:
                continue
            now = trio.current_time()
            for pushed in list(self.pushed.values()):
                if not pushed.acked and now - pushed.sent_at >= self.ack_timeout_s:
                    pushed.acked = True  # this copy is given up; the new one waits
                    event = json.loads(json.dumps(pushed.event))
                    event["header"]["event_id"] = secrets.token_hex(16)
                    conn = self.live
                    if conn is None:
                        self._backlog.append(event)
                    else:
                        self._send_event(conn, event)

    # -- REST ---------------------------------------------------------------------------

    async def _http(self, request: Request) -> Response:
        try:
            body = request.json() if request.body else None
        except ValueError:
            body = None
        for method, pattern, template, handler in _ROUTES:
            match = pattern.match(request.path)
            if match is None or method != request.method:
                continue
            op = f"{method} {template}"
            if self.global_rate_limit > 0 and handler not in ("_token", "_endpoint"):
                self.global_rate_limit -= 1
                response, code = _fault_response(Fault("status", 1, 429, 1.0))
                self._record(request, op, body, 429, code)
                return response
            try:
                fault = await self.faults_for(op)
            except DropConnection:
                self._record(request, op, body, 0, 0)
                raise
            if fault is not None:
                response, code = _fault_response(fault)
                self._record(request, op, body, response.status, code)
                return response
            try:
                if handler not in ("_token", "_endpoint"):
                    self._check_token(request)
                data = getattr(self, handler)(body or {}, request, **match.groupdict())
            except _Fail as fail:
                self._record(request, op, body, fail.status, fail.code)
                return json_response({"code": fail.code, "msg": fail.msg}, status=fail.status)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                self._record(request, op, body, 400, 9499)
                return json_response(
                    {"code": 9499, "msg": f"Bad Request: {type(exc).__name__}"}, status=400
                )
            if isinstance(data, Response):
                self._record(request, op, body, data.status, 0)
                return data
            self._record(request, op, body, 200, 0)
            if self._lost.get(op.lower(), 0) or self.losing(op):
                if self._lost.get(op.lower(), 0):
                    self._lost[op.lower()] -= 1
                raise DropConnection(op)  # done, but the answer never reaches the bot
            return json_response(data)
        self._record(request, request.path, body, 404, 404)
        return json_response({"code": 404, "msg": "404 page not found"}, status=404)

    def _record(self, request: Request, op: str, body: Any, status: int, code: int) -> None:
        self.record(
            RestCall(
                request.method,
                request.path,
                op,
                body,
                status,
                code,
                trio.current_time(),
                dict(request.query),
            )
        )

    def _check_token(self, request: Request) -> None:
        auth = request.header("authorization") or ""
        if not auth.startswith("Bearer ") or auth[7:] not in self.tokens:
            raise _Fail(400, 99991663, "Invalid access token for authorization.")

    def _token(self, body: Any, request: Request) -> Any:
        self.token_requests += 1
        if body.get("app_id") != self.app_id or body.get("app_secret") != self.app_secret:
            raise _Fail(400, 10014, "app secret invalid")
        token = "t-" + secrets.token_hex(16)
        self.tokens.add(token)
        return {"code": 0, "msg": "ok", "tenant_access_token": token, "expire": 7200}

    def _endpoint(self, body: Any, request: Request) -> Any:
        if body.get("AppID") != self.app_id or body.get("AppSecret") != self.app_secret:
            return {"code": 1000040351, "msg": "app id or secret invalid", "data": None}
        if self.endpoint_code:
            return {"code": self.endpoint_code, "msg": "system busy", "data": None}
        ticket = secrets.token_hex(16)
        self.tickets.add(ticket)
        url = (
            f"{self.ws_url}/ws/v2?fpid=1&aid=552564&device_id=dev{next(_ids)}"
            f"&access_key={secrets.token_hex(8)}&service_id={SERVICE_ID}&ticket={ticket}"
        )
        return {
            "code": 0,
            "msg": "ok",
            "data": {
                "URL": url,
                "ClientConfig": {
                    "ReconnectCount": -1,
                    "ReconnectInterval": self.reconnect_interval_s,
                    "ReconnectNonce": self.reconnect_nonce_s,
                    "PingInterval": self.ping_interval_s,
                },
            },
        }

    def _bot_info(self, body: Any, request: Request) -> Any:
        return {
            "code": 0,
            "msg": "ok",
            "bot": {
                "activate_status": 2,
                "app_name": self.bot_name,
                "avatar_url": "",
                "ip_white_list": [],
                "open_id": self.bot_open_id,
            },
        }

    def _get_message(self, body: Any, request: Request, mid: str) -> Any:
        if mid in self.lookup_denied:
            raise _Fail(400, 99991672, "Access denied. scope required: [im:message.group_msg]")
        if "im:message" in self.missing_scopes:
            raise _Fail(400, 99991672, "Access denied. scope required: [im:message]")
        item = self._item(mid)
        if item is None:
            raise _Fail(400, 230001, "invalid message_id")
        if item["chat_id"] == self.group_chat and "im:message.group_msg" in self.missing_scopes:
            raise _Fail(400, 99991672, "Access denied. scope required: [im:message.group_msg]")
        return {"code": 0, "msg": "success", "data": {"items": [item]}}

    def _list(self, body: Any, request: Request) -> Any:
        if request.query.get("container_id_type") == "chat" and (
            "im:message.group_msg" in self.missing_scopes
        ):
            raise _Fail(400, 99991672, "Access denied. scope required: [im:message.group_msg]")
        return {"code": 0, "msg": "success", "data": {"items": [], "has_more": False}}

    def _cardkit_ok(self) -> None:
        if not self.cardkit_enabled or "cardkit:card:write" in self.missing_scopes:
            raise _Fail(400, 99991672, CARD_SCOPE_MSG)

    def _item(self, mid: str) -> dict[str, Any] | None:
        if mid in self.bot_msgs:
            b = self.bot_msgs[mid]
            if b.card_id is not None:
                card = self.cards[b.card_id]
                content = json.dumps({"json_card": json.dumps(card["card"], ensure_ascii=False)})
            else:
                content = json.dumps({"text": b.text}, ensure_ascii=False)
            return {
                "message_id": mid,
                "msg_type": b.msg_type,
                "chat_id": b.chat_id,
                "deleted": False,
                "create_time": str(int(time.time() * 1000)),
                "sender": {"id": self.app_id, "id_type": "app_id", "sender_type": "app"},
                "body": {"content": content},
            }
        msg = self.messages.get(mid)
        if msg is None:
            return None
        return {
            "message_id": mid,
            "msg_type": msg["message_type"],
            "chat_id": msg["chat_id"],
            "deleted": bool(msg.get("deleted")),
            "create_time": msg["create_time"],
            "sender": {**msg["sender"], "tenant_key": "tenant_fake"},
            "body": {"content": "" if msg.get("deleted") else msg["content"]},
            "mentions": msg.get("mentions") or [],
        }

    def _once(self, body: Any, op: str) -> Any:
        uuid = body.get("uuid") if isinstance(body, dict) else None
        return self._uuids.get(f"{op}:{uuid}") if uuid else None

    def _remember(self, body: Any, op: str, answer: Any) -> Any:
        uuid = body.get("uuid") if isinstance(body, dict) else None
        if uuid:
            self._uuids[f"{op}:{uuid}"] = answer
        return answer

    def _reply(self, body: Any, request: Request, mid: str) -> Any:
        again = self._once(body, "send")
        if again is not None:
            return again
        parent = self.messages.get(mid) or self.bot_msgs.get(mid)
        if parent is None:
            raise _Fail(400, 230011, "The message has been withdrawn or does not exist.")
        chat = parent["chat_id"] if isinstance(parent, dict) else parent.chat_id
        new = self._new_bot_message(chat, body, parent_id=mid)
        if body.get("reply_in_thread") is True:
            self.bot_msgs[new["data"]["message_id"]].in_thread = True
        return self._remember(body, "send", new)

    def _create(self, body: Any, request: Request) -> Any:
        again = self._once(body, "send")
        if again is not None:
            return again
        kind = request.query.get("receive_id_type")
        chat = body["receive_id"]
        if kind == "open_id":  # a DM: the bot's p2p chat with that person
            if not str(chat).startswith("ou_"):
                raise _Fail(400, 99992361, "open_id cross app")
            if chat == self.user["open_id"]:
                self.dm_chats.setdefault(chat, self.dm_chat)
            chat = self.dm_chats.setdefault(chat, _id("oc_dm"))
        elif kind != "chat_id":
            raise _Fail(400, 230001, "invalid receive_id_type")
        new = self._new_bot_message(chat, body, parent_id=None)
        return self._remember(body, "send", new)

    def _new_bot_message(self, chat: str, body: Any, *, parent_id: str | None) -> Any:
        msg_type = body["msg_type"]
        content = json.loads(body["content"])
        mid = _id("om_bot")
        card_id: str | None = None
        if msg_type == "text":
            text = content["text"]
        elif msg_type == "interactive":
            if content.get("type") == "card":
                card_id = content["data"]["card_id"]
                card = self.cards.get(card_id)
                if card is None:
                    raise _Fail(400, 200740, "card not found")
                if card.get("sent"):
                    raise _Fail(400, 230099, "card entity already sent")
                card["sent"] = True
            else:
                card_id = _id("card_msg")
                self.cards[card_id] = {"card": content, "sequence": 0, "text": "", "sent": True}
            text = _card_visible(self.cards[card_id]["card"])
        else:
            text = json.dumps(content, ensure_ascii=False)
        self.bot_msgs[mid] = BotMessage(mid, chat, msg_type, text, [text], card_id, parent_id)
        self.changed()
        return {
            "code": 0,
            "msg": "success",
            "data": {"message_id": mid, "chat_id": chat, "msg_type": msg_type},
        }

    def _edit(self, body: Any, request: Request, mid: str) -> Any:
        b = self.bot_msgs.get(mid)
        if b is None:
            raise _Fail(400, 230011, "message not found")
        if b.edits >= 20:
            raise _Fail(
                400, 230072, "The message has reached the number of times it can be edited."
            )
        b.edits += 1
        b.text = json.loads(body["content"])["text"]
        b.shown.append(b.text)
        self.changed()
        return {"code": 0, "msg": "success", "data": {}}

    def _patch(self, body: Any, request: Request, mid: str) -> Any:
        b = self.bot_msgs.get(mid)
        if b is None or b.card_id is None:
            raise _Fail(400, 230011, "message not found")
        card = json.loads(body["content"])
        self.cards[b.card_id]["card"] = card
        b.text = _card_visible(card)
        b.shown.append(b.text)
        self.changed()
        return {"code": 0, "msg": "success", "data": {}}

    def _react(self, body: Any, request: Request, mid: str) -> Any:
        emoji = body["reaction_type"]["emoji_type"]
        rid = _id("rc_")
        self.reactions.append((mid, emoji, "add"))
        self.changed()
        return {"code": 0, "msg": "success", "data": {"reaction_id": rid}}

    def _unreact(self, body: Any, request: Request, mid: str, rid: str) -> Any:
        self.reactions.append((mid, rid, "delete"))
        self.changed()
        return {"code": 0, "msg": "success", "data": {}}

    def _resource(self, body: Any, request: Request, mid: str, key: str) -> Response:
        if mid not in self.messages:
            raise _Fail(400, 234003, "file key not in message")
        return Response(
            200, b"\x89PNG\r\n\x1a\nfake-" + key.encode(), [("content-type", "image/png")]
        )

    def _card(self, body: Any, request: Request) -> Any:
        """A card entity: the body is ``type`` and ``data`` only (the API's schema refuses
        anything else, a ``uuid`` too: creating a card is not idempotent)."""
        self._cardkit_ok()
        unknown = sorted(set(body) - CARD_CREATE_FIELDS)
        if unknown or body.get("type") != "card_json" or not isinstance(body.get("data"), str):
            raise _Fail(400, 99992402, f"field validation failed: {', '.join(unknown) or 'type'}")
        card = json.loads(body["data"])
        cid = _id("card_")
        self.cards[cid] = {"card": card, "sequence": 0, "sent": False}
        self.changed()
        return {"code": 0, "msg": "success", "data": {"card_id": cid}}

    def _sequence(self, card: dict[str, Any], body: Any) -> None:
        seq = int(body["sequence"])
        if seq <= card["sequence"]:
            raise _Fail(400, 300317, "sequence number compare failed")
        card["sequence"] = seq

    def _card_content(self, body: Any, request: Request, cid: str, eid: str) -> Any:
        self._cardkit_ok()
        card = self.cards.get(cid)
        if card is None:
            raise _Fail(400, 200740, "card not found")
        again = self._once(body, f"content:{cid}")
        if again is not None:
            return again
        self._sequence(card, body)
        for el in card["card"].get("body", {}).get("elements", []):
            if el.get("element_id") == eid:
                el["content"] = body["content"]
                break
        else:
            raise _Fail(400, 300310, "element not found")
        for b in self.bot_msgs.values():
            if b.card_id == cid:
                b.text = _card_visible(card["card"])
                b.shown.append(b.text)
        self.changed()
        return self._remember(body, f"content:{cid}", {"code": 0, "msg": "success", "data": {}})

    def _card_settings(self, body: Any, request: Request, cid: str) -> Any:
        self._cardkit_ok()
        card = self.cards.get(cid)
        if card is None:
            raise _Fail(400, 200740, "card not found")
        again = self._once(body, f"settings:{cid}")
        if again is not None:
            return again
        self._sequence(card, body)
        settings = json.loads(body["settings"])
        card["card"].setdefault("config", {}).update(settings.get("config", {}))
        self.changed()
        return self._remember(body, f"settings:{cid}", {"code": 0, "msg": "success", "data": {}})

    def _batch_get_id(self, body: Any, request: Request) -> Any:
        """Emails -> ids (``user_id_type`` in the query); an unknown email has no id."""
        if self.batch_get_id_error is not None:
            status, code = self.batch_get_id_error
            raise _Fail(status, code, "batch_get_id failed")
        kind = request.query.get("user_id_type", "open_id")
        out = []
        for email in body.get("emails") or []:
            user = next(
                (
                    u
                    for u in self.contacts.values()
                    if str(u.get("email", "")).lower() == email.lower()
                ),
                None,
            )
            out.append({"email": email, "user_id": user[kind]} if user else {"email": email})
        return {"code": 0, "msg": "success", "data": {"user_list": out}}

    def _user(self, body: Any, request: Request, uid: str) -> Any:
        """A user's profile by ``user_id_type`` open_id / union_id."""
        if uid in self.contact_errors:
            status, code = self.contact_errors[uid]
            raise _Fail(status, code, "contact lookup failed")
        if uid in self.contact_empty:
            return {"code": 0, "msg": "success", "data": {}}
        kind = request.query.get("user_id_type", "open_id")
        user = next((u for u in self.contacts.values() if u.get(kind) == uid), None)
        if user is None:
            raise _Fail(400, 41012, "invalid user id")
        return {"code": 0, "msg": "success", "data": {"user": user}}


def _card_visible(card: dict[str, Any]) -> str:
    """What a Feishu client shows of one of our cards (markdown references decoded)."""
    parts = []
    for el in (card.get("body") or {}).get("elements", []):
        if el.get("tag") == "markdown":
            parts.append(html.unescape(el.get("content", "")))
    return "\n\n".join(p for p in parts if p)


def _fault_response(fault: Fault) -> tuple[Response, int]:
    if fault.status == 429:
        code = int(fault.extra.get("code", 99991400))
        response = json_response({"code": code, "msg": "request trigger frequency limit"}, 429)
        reset = fault.retry_after if fault.retry_after is not None else 1.0
        response.headers += [
            ("x-ogw-ratelimit-limit", "50"),
            ("x-ogw-ratelimit-reset", str(int(reset)) if reset == int(reset) else str(reset)),
        ]
        return response, code
    code = int(fault.extra.get("code", 9499 if fault.status < 500 else 1))
    msg = fault.description or f"scripted failure {fault.status}"
    return json_response({"code": code, "msg": msg}, fault.status), code


@asynccontextmanager
async def open_fake_feishu(
    *, host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> AsyncIterator[FakeFeishu]:
    """Run a fake Feishu (Open API + long connection on 127.0.0.1) for the block."""
    fake = FakeFeishu(**kwargs)

    async def ws(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_websocket(fake._ws, host, 0, None, task_status=task_status)

    async def http(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_http(fake._http, host=host, port=port, task_status=task_status)

    async def redeliverer(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started(None)
        await fake._redeliverer()

    async with open_servers(http, ws, redeliverer) as (http_server, ws_server, _):
        fake.http_url = http_server.url
        fake.api_base = http_server.url
        fake.ws_url = f"ws://{host}:{ws_server.port}"
        yield fake


#: How the idle bench runs this fake: the bot's first contact is its long connection.
IDLE_BENCH: IdleBench[FakeFeishu] = IdleBench(
    open_fake_feishu,
    lambda f: {"app_id": f.app_id, "app_secret": f.app_secret, "api_base": f.api_base},
    lambda f: bool(f.connections),
)


def main(argv: list[str] | None = None) -> None:
    """Run the fake as a process (see :mod:`dshim.testing.fakes.cli`); ``--flood n``
    (benchmarks) sends n direct messages on every new connection and prints one JSON
    line."""
    from dshim.testing.fakes import cli

    module = "dshim.testing.fakes.feishu"
    p = cli.parser(__doc__, module=module, flood="DMs on each connection (benchmarks)")
    args = p.parse_args(argv)

    def announce(fake: FakeFeishu) -> cli.Announcement:
        settings = {"app_id": fake.app_id, "app_secret": fake.app_secret, "api_base": fake.api_base}
        notes = {"long_connection": fake.ws_url, "dm_chat": fake.dm_chat}
        line = {**settings, "dm_chat": fake.dm_chat}
        return cli.Announcement(
            "Feishu Open API + long connection", fake.api_base, "feishu", settings, notes, line
        )

    async def flood(fake: FakeFeishu) -> None:
        # A flood outruns the 3 s ack timeout on a busy machine: its redeliveries would
        # count as events (the floor) or duplicates (dshim), and pile up without end.
        fake.redeliver = False
        seen = [0]
        while True:
            await fake.wait_until(lambda: len(fake.connections) > seen[0])
            seen[0] = len(fake.connections)
            for i in range(args.flood or 0):
                await fake.user_message(fake.dm_chat, f"bench {i}")

    cli.run(
        args,
        module=module,
        open_fake=lambda: open_fake_feishu(host=args.host, port=args.port),
        announce=announce,
        serve=flood if args.flood else None,
        json_line=args.flood is not None,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
