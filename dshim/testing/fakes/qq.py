"""A fake QQ official bot platform: token endpoint, OpenAPI v2 and the gateway, on 127.0.0.1.

It speaks the wire protocol of ``protocols/qq.md`` -- the token call, ``QQBot <token>``
headers, the gateway opcodes (10 Hello, 2 Identify with intents and shard, 6 Resume, 1/11
heartbeats, 7 Reconnect, 9 Invalid Session), close codes, error bodies ``{"code",
"message"}`` -- so the real channel runs against it unchanged (``api_base`` and
``token_base`` = :attr:`FakeQQ.http_url`, ``gateway_url`` = :attr:`FakeQQ.gateway_url`)::

    async with open_fake_qq() as fake:
        ...  # run the bot against the fake
        await fake.wait_until(lambda: fake.ready_count >= 1)
        await fake.c2c_message("hello")
        await fake.wait_until(lambda: fake.bot_messages(fake.c2c_conversation))

Passive replies are enforced as QQ does: every send needs the ``msg_id`` of a message the
fake delivered (else 304026); ``(msg_id, msg_seq)`` is unique (a repeat: 40054005); at most
4 replies per C2C message within 60 min and 5 per group message within 5 min (304103 /
304027 after); answers carry ``ext_info.ref_idx``.  C2C streams
(``/v2/users/{openid}/stream_messages``): the first chunk (no ``stream_msg_id``) is one
reply; ``replace`` chunks must keep the shown prefix (40007); ``input_state`` 10 closes
the message.  Quotes come as QQ sends them: ``message_type`` 103, ``message_scene.ext``
with ``ref_msg_idx``, and a ``msg_elements[0]`` snapshot unless ``snapshot=False``.

Guilds: :meth:`guild_message` posts in the guild channel :attr:`channel_id` as
``AT_MESSAGE_CREATE`` (the @bot event) or ``MESSAGE_CREATE`` (every message, the
``guild_messages`` intent), :meth:`direct_message` in the guild DM :attr:`dms_guild_id`;
a ``reply_to`` message id becomes ``message_reference.message_id``.  A guild send answers
a message object (no ``ext_info``), and with ``guild_messages`` subscribed it comes back
as a ``MESSAGE_CREATE`` by the bot, as QQ sends it.  ``GET
/channels/{channel_id}/messages/{message_id}`` answers the guild channel's messages
(:meth:`guild_post` adds one nobody sent through the gateway), wrapped as ``{"message":
{...}}`` (``wrap_fetched_message = False``: the bare object); an unknown id answers code
50039; ``forbidden_lookup`` answers 11264 (permission missing).  Dispatches go only to a
session whose intents subscribe them (QQ sends nothing else).

Knobs and faults: ``heartbeat_interval_ms``, ``ack_heartbeats``; ``force_close_every_s``
(QQ closes sockets periodically: 4009 after that long, the client resumes);
``drop_after(k)`` / :meth:`drop_connection`; :meth:`send_reconnect`,
:meth:`send_invalid_session`, :meth:`close_gateway`; ``close_on_identify``;
``replay_on_resume`` (a Resume re-sends that many dispatches before the client's seq);
``approved_intents`` (others close Identify with 4014); ``identify_remaining``;
``markdown_allowed`` (False: markdown sends fail with 50056); ``reject_group_reference``,
``reject_stream_reference`` (a quote is refused there); ``keyboards_allowed`` and
:meth:`press` (a command button sends its data as the user's message);
``token_lifetime_s`` and :meth:`expire_tokens` (the next API calls answer 401);
``ip_blocked`` (every API call: the caller's IP is not on the allowlist);
``flood_on_ready`` (benchmarks); the shared fault queue keyed ``"METHOD /route"``
(``fail_next(op, n, status=..., code=...)``, ``slow_next``, ``drop_next``),
:meth:`rate_limit` (429 with code 22009) and :meth:`drop_response_next` (processed,
answer lost); :meth:`~dshim.testing.fakes.base.FakePlatform.outage` for a time (every
call, or the ops named, answers 500, is dropped unprocessed, or is processed with its
answer lost).  Reading: :attr:`calls`, :meth:`bot_messages`, :attr:`identifies`,
:attr:`resumes`, :attr:`connections`, :attr:`token_calls`.
"""

from __future__ import annotations

import itertools
import json
import secrets
import sys
import urllib.parse
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from dshim.testing.fakes.base import FakePlatform, Fault, IdleBench, open_servers
from dshim.testing.fakes.http import DropConnection, Request, Response, json_response, serve_http

__all__ = ["BotMessage", "FakeQQ", "RestCall", "open_fake_qq"]

OUTBOX = 100_000
CST = timezone(timedelta(hours=8))
DEFAULT_INTENTS = (1 << 25) | (1 << 30) | (1 << 12)
GUILD_MESSAGES = 1 << 9
#: The intent bit each dispatch needs (QQ sends a session nothing it did not subscribe).
EVENT_INTENTS = {
    "C2C_MESSAGE_CREATE": 1 << 25,
    "GROUP_AT_MESSAGE_CREATE": 1 << 25,
    "GROUP_MESSAGE_CREATE": 1 << 25,
    "MESSAGE_CREATE": GUILD_MESSAGES,
    "DIRECT_MESSAGE_CREATE": 1 << 12,
    "INTERACTION_CREATE": 1 << 26,
    "AT_MESSAGE_CREATE": 1 << 30,
}
CAPS = {"c2c": 4, "group": 5, "channel": 5, "dms": 5}
WINDOWS_S = {"c2c": 3600.0, "group": 300.0, "channel": 300.0, "dms": 300.0}
MAX_CHARS = 2000

_counter = itertools.count(1)


def _uid(prefix: str) -> str:
    return f"{prefix}{next(_counter):06d}{secrets.token_hex(6)}"


def refidx() -> str:
    """A fresh quote index as QQ writes them (base64-ish, ``==`` at the end)."""
    return f"REFIDX_{secrets.token_urlsafe(12)}=="


def iso_now() -> str:
    return datetime.now(CST).isoformat(timespec="seconds")


@dataclass
class RestCall:
    """One HTTP request the bot made (``path`` as sent; ``status`` 0: dropped)."""

    method: str
    path: str
    json: Any
    status: int
    at: float
    code: int = 0
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class BotMessage:
    """A message the bot sent: ``content`` now, ``shown`` every distinct text it showed."""

    id: str
    ref_idx: str
    kind: str
    target: str
    msg_id: str
    seq: int
    content: str
    at: float
    stream: bool = False
    done: bool = True
    index: int = 0
    reference: str | None = None
    msg_type: int = 0
    shown: list[str] = field(default_factory=list)
    keyboard: dict[str, Any] | None = None

    def buttons(self) -> list[dict[str, Any]]:
        """The keyboard's buttons, row by row."""
        rows = (self.keyboard or {}).get("content", {}).get("rows", [])
        return [b for row in rows for b in row.get("buttons", [])]

    @property
    def conversation(self) -> str:
        return f"{self.kind}:{self.target}"


@dataclass
class Inbound:
    """A user message the fake delivered: what passive replies to it may do."""

    id: str
    kind: str
    target: str
    at: float
    msg_idx: str
    text: str
    author: dict[str, Any]
    seqs: set[int] = field(default_factory=set)
    replies: int = 0


@dataclass
class GatewayConnection:
    id: int
    path: str
    opened_at: float
    ws: WebSocketConnection
    outbox_send: trio.MemorySendChannel[tuple[str, Any]]
    session: _Session | None = None
    authenticated: bool = False
    last_beat_at: float = 0.0
    closed_code: int | None = None
    closed_by: str | None = None  # "server" | "client" | "drop"
    closed_at: float | None = None

    def push(self, kind: str, value: Any = None) -> None:
        try:
            self.outbox_send.send_nowait((kind, value))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass


@dataclass
class _Session:
    id: str
    intents: int = 0
    seq: int = 0
    log: list[tuple[int, str, str]] = field(default_factory=list)
    conn: GatewayConnection | None = None
    valid: bool = True


def _error(status: int, code: int, message: str) -> Response:
    return json_response(
        {"code": code, "message": message, "err_code": code, "trace_id": secrets.token_hex(8)},
        status=status,
    )


class FakeQQ(FakePlatform[RestCall]):
    """State and behaviour of the fake; see the module docstring for the knobs."""

    def __init__(
        self,
        *,
        app_id: str = "102030405",
        client_secret: str = "fake-qq-app-secret-0123456789",
        heartbeat_interval_ms: float = 41250,
    ) -> None:
        super().__init__()
        self.app_id = app_id
        self.client_secret = client_secret
        self.bot_user = {"id": "1122334455667788990", "username": "dshim-qq", "bot": True}
        self.user_openid = "E4F3C2B1A0998877665544332211AABB"
        self.group_openid = "C0FFEE00112233445566778899AABBCC"
        self.member_openid = "0A1B2C3D4E5F60718293A4B5C6D7E8F9"
        self.other_member = "FEDCBA98765432100123456789ABCDEF"
        self.user_name = "Ada"
        self.guild_id = "5237615478283154023"
        self.channel_id = "6344117"
        #: The guild (of its own) a guild DM session lives in, and its channel.
        self.dms_guild_id = "7713500012345678901"
        self.dms_channel_id = "9913500"
        self.guild_user = {"id": "14451342012345678901", "username": "ada", "bot": False}
        # knobs
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.ack_heartbeats = True
        self.force_close_every_s: float | None = None
        self.close_on_identify: int | None = None
        self.replay_on_resume = 0
        self.approved_intents = DEFAULT_INTENTS | (1 << 26)
        self.identify_remaining = 1000
        self.markdown_allowed = True
        self.reject_group_reference = False
        self.reject_stream_reference = False
        #: The bot may send custom keyboards (False: 11264, permission not granted).
        self.keyboards_allowed = True
        self.token_lifetime_s = 7200.0
        self.flood_on_ready = 0
        self.latency_s = 0.0
        #: The caller's IP is not on the bot's allowlist: every API call is refused.
        self.ip_blocked = False
        #: ``GET /channels/{id}/messages/{id}`` answers ``{"message": {...}}`` (else bare).
        self.wrap_fetched_message = True
        #: ``GET /channels/{id}/messages/{id}`` is refused (11264, permission missing).
        self.forbidden_lookup = False
        self._drop_after: int | None = None
        self._lost: dict[str, int] = {}
        self._rate: dict[str, list[float]] = {}
        # state
        self.tokens: dict[str, float] = {}
        self.token_calls: list[float] = []
        self.messages: list[BotMessage] = []
        self.inbound: dict[str, Inbound] = {}
        self.by_ref: dict[str, Inbound | BotMessage] = {}
        #: Guild channel messages by id, as ``GET /channels/{id}/messages/{id}`` answers them.
        self.guild_log: dict[str, dict[str, Any]] = {}
        self.identifies: list[dict[str, Any]] = []
        self.resumes: list[dict[str, Any]] = []
        self.connections: list[GatewayConnection] = []
        self.heartbeats: list[tuple[float, Any]] = []
        self.ready_count = 0
        self.resumed_count = 0
        self._sessions: dict[str, _Session] = {}
        self._current: _Session | None = None
        self._pending: list[tuple[str, Any]] = []
        self.http_url = ""
        self.gateway_url = ""

    @property
    def c2c_conversation(self) -> str:
        return f"c2c:{self.user_openid}"

    @property
    def group_conversation(self) -> str:
        return f"group:{self.group_openid}"

    # -- reading what the bot did ------------------------------------------------------

    def calls_to(self, method: str, path_prefix: str = "") -> list[RestCall]:
        return [c for c in self.calls if c.method == method and c.path.startswith(path_prefix)]

    def sends(self) -> list[RestCall]:
        """Every send attempt (messages and stream chunks), in order."""
        return [c for c in self.calls if c.method == "POST" and c.path.endswith("messages")]

    def bot_messages(self, conversation: str) -> list[BotMessage]:
        """The bot's messages in a conversation (``c2c:…`` / ``group:…``), oldest first."""
        return [m for m in self.messages if m.conversation == conversation]

    @property
    def live(self) -> GatewayConnection | None:
        s = self._current
        if s is None or s.conn is None or s.conn.closed_by is not None:
            return None
        return s.conn

    # -- faults ------------------------------------------------------------------------

    def drop_after(self, k: int) -> None:
        """Drop the connection (no close frame) after k more message dispatches."""
        self._drop_after = k

    async def drop_connection(self) -> None:
        conn = self.live
        if conn is not None:
            conn.push("drop")

    async def send_reconnect(self) -> None:
        conn = self.live
        if conn is not None:
            conn.push("frame", {"op": 7})

    async def send_invalid_session(self) -> None:
        conn = self.live
        if conn is not None:
            if conn.session is not None:
                conn.session.valid = False
            conn.push("frame", {"op": 9, "d": False})

    async def close_gateway(self, code: int, reason: str = "") -> None:
        conn = self.live
        if conn is not None:
            conn.push("close", (code, reason))

    def expire_tokens(self) -> None:
        """Every token issued so far is rejected from now on (401 / close 4004)."""
        self.tokens.clear()

    def rate_limit(self, op: str, count: int = 1, retry_after: float = 1.0) -> None:
        """The next ``count`` calls of ``op`` answer 429 with code 22009."""
        self._rate.setdefault(op.lower(), []).extend([retry_after] * count)

    def drop_response_next(self, op: str, count: int = 1) -> None:
        """The next ``count`` calls of ``op`` are performed, then the answer is lost."""
        self._lost[op.lower()] = self._lost.get(op.lower(), 0) + count

    # -- injecting user messages -------------------------------------------------------

    def _scene(self, msg_idx: str, ref: str | None) -> dict[str, Any]:
        ext = [f"msg_idx={msg_idx}"]
        if ref is not None:
            ext.append(f"ref_msg_idx={ref}")
        ext.append(f"auth_token={self.auth_token}")
        return {"source": "default", "ext": ext}

    #: The ``auth_token`` the fake puts in every ``ext`` (a secret the bot must not leak).
    auth_token = "AUTHTOKEN-fake-qq-do-not-log-5f1e"

    def _quote(self, d: dict[str, Any], quote: str | None, snapshot: bool) -> None:
        if quote is None:
            return
        d["message_type"] = 103
        target = self.by_ref.get(quote)
        d["message_scene"] = self._scene(d["message_scene"]["ext"][0][8:], quote)
        if not snapshot:
            return
        if isinstance(target, BotMessage):
            d["msg_elements"] = [{"message_type": 0, "content": target.content}]
        elif isinstance(target, Inbound):
            d["msg_elements"] = [
                {"msg_idx": target.msg_idx, "message_type": 0, "content": target.text}
            ]

    def _register(
        self, kind: str, target: str, d: dict[str, Any], author: dict[str, Any]
    ) -> Inbound:
        ext = d["message_scene"]["ext"]
        msg_idx = next(e.split("=", 1)[1] for e in ext if e.startswith("msg_idx="))
        inbound = Inbound(d["id"], kind, target, trio.current_time(), msg_idx, d["content"], author)
        self.inbound[d["id"]] = inbound
        self.by_ref[msg_idx] = inbound
        return inbound

    def c2c_payload(
        self,
        content: str,
        *,
        quote: str | None = None,
        snapshot: bool = True,
        attachments: list[dict[str, Any]] | None = None,
        user: str | None = None,
    ) -> dict[str, Any]:
        """A C2C_MESSAGE_CREATE ``d`` (registered for passive replies); ``quote`` is the
        ``ref_idx`` of the quoted message; ``user`` another user's openid (its
        conversation is ``c2c:<openid>``) than :attr:`user_openid`."""
        msg_idx = refidx()
        openid = user or self.user_openid
        author = {"id": openid, "user_openid": openid}
        d: dict[str, Any] = {
            "id": _uid("ROBOT1.0_c2c"),
            "author": author,
            "content": content,
            "timestamp": iso_now(),
            "attachments": attachments or [],
            "message_type": 0,
            "message_scene": self._scene(msg_idx, None),
        }
        self._quote(d, quote, snapshot)
        self._register("c2c", openid, d, author)
        return d

    def group_payload(
        self,
        content: str,
        *,
        member: str | None = None,
        quote: str | None = None,
        snapshot: bool = True,
    ) -> dict[str, Any]:
        """A GROUP_AT_MESSAGE_CREATE ``d``: the @bot prefix removed, a space left."""
        msg_idx = refidx()
        author = {"id": member or self.member_openid, "member_openid": member or self.member_openid}
        d: dict[str, Any] = {
            "id": _uid("ROBOT1.0_grp"),
            "author": author,
            "content": f" {content} ",
            "timestamp": iso_now(),
            "group_openid": self.group_openid,
            "group_id": self.group_openid,
            "attachments": [],
            "message_type": 0,
            "message_scene": self._scene(msg_idx, None),
            "mentions": [],
        }
        self._quote(d, quote, snapshot)
        self._register("group", self.group_openid, d, author)
        return d

    def guild_post(
        self,
        content: str,
        *,
        author: dict[str, Any] | None = None,
        attachments: list[dict[str, Any]] | None = None,
        nick: str | None = "Ada L",
    ) -> dict[str, Any]:
        """A message in the guild channel that only ``GET`` knows (not dispatched)."""
        d: dict[str, Any] = {
            "id": _uid("08guild"),
            "channel_id": self.channel_id,
            "guild_id": self.guild_id,
            "author": author or dict(self.guild_user),
            "content": content,
            "timestamp": iso_now(),
        }
        if nick is not None:
            d["member"] = {"nick": nick, "roles": ["1"]}
        if attachments:
            d["attachments"] = attachments
        self.guild_log[d["id"]] = d
        return d

    async def guild_message(
        self,
        content: str,
        *,
        event: str = "AT_MESSAGE_CREATE",
        mention: bool = True,
        reply_to: str | None = None,
        author: dict[str, Any] | None = None,
        attachments: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """A message in the guild channel :attr:`channel_id`: ``AT_MESSAGE_CREATE`` (``<@!bot>``
        first) or ``MESSAGE_CREATE`` (the ``<@!bot>`` token and a ``mentions`` entry when
        ``mention``); ``reply_to`` quotes that message id."""
        body = f"<@!{self.bot_user['id']}> {content}" if mention else content
        d = self.guild_post(body, author=author, attachments=attachments)
        if mention:
            d["mentions"] = [dict(self.bot_user)]
        if reply_to is not None:
            d["message_reference"] = {"message_id": reply_to}
        inbound = Inbound(
            d["id"], "channel", self.channel_id, trio.current_time(), "", content, d["author"]
        )
        self.inbound[d["id"]] = inbound
        await self.dispatch(event, d)
        return d

    async def direct_message(self, content: str, *, reply_to: str | None = None) -> dict[str, Any]:
        """A DIRECT_MESSAGE_CREATE in the guild DM :attr:`dms_guild_id`; ``reply_to`` quotes
        that message id."""
        d: dict[str, Any] = {
            "id": _uid("08dms"),
            "channel_id": self.dms_channel_id,
            "guild_id": self.dms_guild_id,
            "src_guild_id": self.guild_id,
            "author": dict(self.guild_user),
            "member": {"joined_at": iso_now()},
            "content": content,
            "timestamp": iso_now(),
            "direct_message": True,
        }
        if reply_to is not None:
            d["message_reference"] = {"message_id": reply_to}
        inbound = Inbound(
            d["id"], "dms", self.dms_guild_id, trio.current_time(), "", content, d["author"]
        )
        self.inbound[d["id"]] = inbound
        await self.dispatch("DIRECT_MESSAGE_CREATE", d)
        return d

    async def press(self, message: BotMessage, label: str) -> dict[str, Any]:
        """The user presses a command button: its ``data`` is sent as their message."""
        [button] = [b for b in message.buttons() if b["render_data"]["label"] == label]
        action = button["action"]
        assert action["type"] == 2 and action.get("enter"), action
        if message.kind == "group":
            return await self.group_message(action["data"])
        return await self.c2c_message(action["data"])

    async def c2c_message(self, content: str, **kw: Any) -> dict[str, Any]:
        d = self.c2c_payload(content, **kw)
        await self.dispatch("C2C_MESSAGE_CREATE", d)
        return d

    async def group_message(
        self, content: str, *, mention: bool = True, **kw: Any
    ) -> dict[str, Any]:
        """A group message: GROUP_AT_MESSAGE_CREATE when it @-mentions the bot, else the
        all-messages event GROUP_MESSAGE_CREATE (which QQ sends only when allowed)."""
        d = self.group_payload(content, **kw)
        if mention:
            await self.dispatch("GROUP_AT_MESSAGE_CREATE", d)
        else:
            d["content"] = content
            await self.dispatch("GROUP_MESSAGE_CREATE", d)
        return d

    async def dispatch(self, t: str, d: Any) -> None:
        """Append a dispatch to the current session and send it if connected."""
        session = self._current
        if session is None or not session.valid:
            self._pending.append((t, d))
            return
        self._dispatch_to(session, t, d)
        await trio.lowlevel.checkpoint()

    def _dispatch_to(self, session: _Session, t: str, d: Any) -> None:
        bit = EVENT_INTENTS.get(t)
        if bit is not None and not session.intents & bit:
            return  # not subscribed: QQ does not send it
        session.seq += 1
        frame = json.dumps(
            {"op": 0, "s": session.seq, "t": t, "id": f"{t}:{_uid('')}", "d": d},
            separators=(",", ":"),
            ensure_ascii=False,
        )
        session.log.append((session.seq, t, frame))
        conn = session.conn
        if conn is not None and conn.closed_by is None and conn.authenticated:
            conn.push("text", frame)
            if t.endswith("MESSAGE_CREATE") and self._drop_after is not None:
                self._drop_after -= 1
                if self._drop_after <= 0:
                    self._drop_after = None
                    conn.push("drop")

    # -- gateway -----------------------------------------------------------------------

    async def _gateway(self, request: WebSocketRequest) -> None:
        ws = await request.accept()
        send, recv = trio.open_memory_channel[tuple[str, Any]](OUTBOX)
        conn = GatewayConnection(len(self.connections), request.path, trio.current_time(), ws, send)
        self.connections.append(conn)
        self.changed()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer, conn, recv)
            conn.push("frame", {"op": 10, "d": {"heartbeat_interval": self.heartbeat_interval_ms}})
            conn.last_beat_at = trio.current_time()
            nursery.start_soon(self._watchdog, conn)
            try:
                while True:
                    data = await ws.get_message()
                    self._on_frame(conn, data)
            except ConnectionClosed as exc:
                if conn.closed_by is None:
                    conn.closed_by = "client"
                    conn.closed_code = int(exc.reason.code) if exc.reason else None
                    conn.closed_at = trio.current_time()
            finally:
                send.close()
                if conn.session is not None and conn.session.conn is conn:
                    conn.session.conn = None
                self.changed()
                nursery.cancel_scope.cancel()

    async def _writer(
        self, conn: GatewayConnection, recv: trio.MemoryReceiveChannel[tuple[str, Any]]
    ) -> None:
        ws = conn.ws
        try:
            async for kind, value in recv:
                if kind == "frame":
                    await ws.send_message(json.dumps(value, separators=(",", ":")))
                elif kind == "text":
                    await ws.send_message(value)
                elif kind == "close":
                    code, reason = value
                    conn.closed_by, conn.closed_code = "server", code
                    conn.closed_at = trio.current_time()
                    self.changed()
                    with trio.move_on_after(2):
                        await ws.aclose(code, reason)
                    return
                elif kind == "drop":
                    conn.closed_by, conn.closed_code = "drop", None
                    conn.closed_at = trio.current_time()
                    self.changed()
                    await ws._stream.aclose()  # an abrupt TCP close, no close frame
                    return
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            return

    async def _watchdog(self, conn: GatewayConnection) -> None:
        """Close a connection whose client stopped heartbeating (4009), and force a close
        every ``force_close_every_s`` (QQ does so periodically)."""
        while conn.closed_by is None:
            interval = self.heartbeat_interval_ms / 1000
            deadline = conn.last_beat_at + interval * 2 + 0.5
            if self.force_close_every_s is not None:
                deadline = min(deadline, conn.opened_at + self.force_close_every_s)
            if trio.current_time() >= deadline:
                conn.push("close", (4009, "connection expired"))
                return
            await trio.sleep_until(deadline)

    def _valid_token(self, value: Any) -> bool:
        if not isinstance(value, str) or not value.startswith("QQBot "):
            return False
        expires = self.tokens.get(value[6:])
        return expires is not None and trio.current_time() < expires

    def _on_frame(self, conn: GatewayConnection, data: str | bytes) -> None:
        try:
            frame = json.loads(data)
            op = frame["op"]
            d = frame.get("d")
        except (ValueError, KeyError, TypeError):
            conn.push("close", (4002, "invalid payload"))
            return
        now = trio.current_time()
        if op == 1:
            conn.last_beat_at = now
            self.heartbeats.append((now, d))
            self.changed()
            if self.ack_heartbeats:
                conn.push("frame", {"op": 11})
        elif op == 2:
            self._identify(conn, d)
        elif op == 6:
            self._resume(conn, d)
        else:
            conn.push("close", (4001, "invalid opcode"))

    def _identify(self, conn: GatewayConnection, d: Any) -> None:
        d = d if isinstance(d, dict) else {}
        record = {
            "at": trio.current_time(),
            "intents": d.get("intents"),
            "shard": d.get("shard"),
            "token_ok": self._valid_token(d.get("token")),
        }
        self.identifies.append(record)
        self.changed()
        if self.close_on_identify is not None:
            conn.push("close", (self.close_on_identify, "closed on identify"))
            return
        if not record["token_ok"]:
            conn.push("close", (4004, "invalid token"))
            return
        intents = d.get("intents")
        if not isinstance(intents, int) or intents & ~self.approved_intents:
            conn.push("close", (4014, "disallowed intents"))
            return
        if self.identify_remaining <= 0:
            conn.push("close", (4008, "send too fast"))
            return
        self.identify_remaining -= 1
        session = _Session(secrets.token_hex(16), intents)
        self._sessions[session.id] = session
        self._current = session
        session.conn = conn
        conn.session = session
        conn.authenticated = True
        self._dispatch_to(
            session,
            "READY",
            {"version": 1, "session_id": session.id, "user": self.bot_user, "shard": [0, 1]},
        )
        self.ready_count += 1
        pending, self._pending = self._pending, []
        for t, payload in pending:
            self._dispatch_to(session, t, payload)
        for _ in range(self.flood_on_ready):
            self._dispatch_to(session, "C2C_MESSAGE_CREATE", self.c2c_payload("ping"))
        self.changed()

    def _resume(self, conn: GatewayConnection, d: Any) -> None:
        d = d if isinstance(d, dict) else {}
        session = self._sessions.get(str(d.get("session_id", "")))
        seq = d.get("seq")
        self.resumes.append(
            {"at": trio.current_time(), "session_id": d.get("session_id"), "seq": seq}
        )
        self.changed()
        if not self._valid_token(d.get("token")):
            conn.push("close", (4004, "invalid token"))
            return
        if (
            session is None
            or not session.valid
            or session is not self._current
            or not isinstance(seq, int)
            or seq > session.seq
        ):
            conn.push("frame", {"op": 9, "d": False})
            return
        old = session.conn
        if old is not None and old is not conn and old.closed_by is None:
            old.push("close", (4009, "session resumed elsewhere"))
        session.conn = conn
        conn.session = session
        conn.authenticated = True
        start = max(0, seq - self.replay_on_resume)
        for s, t, frame in session.log:
            if s > start and t not in ("READY", "RESUMED"):
                conn.push("text", frame)
        self._dispatch_to(session, "RESUMED", "")
        self.resumed_count += 1
        self.changed()

    # -- HTTP --------------------------------------------------------------------------

    async def _http(self, request: Request) -> Response:
        path = request.path
        try:
            body = request.json() if request.body else None
        except ValueError:
            body = None
        if path.startswith("/media/"):  # the CDN: no token needed (and none may be sent)
            headers = {k: v for k, v in request.headers}
            self.record(RestCall(request.method, path, None, 200, trio.current_time(), 0, headers))
            return Response(
                200, b"RIFF\x00\x00\x00\x00WAVEfake-qq", [("content-type", "audio/wav")]
            )
        op, handler, arg = self._route(request.method, path)
        headers = {k: v for k, v in request.headers if k not in ("authorization",)}
        if self.latency_s:
            await trio.sleep(self.latency_s)
        try:
            fault = await self.faults_for(op)
        except DropConnection:
            self.record(RestCall(request.method, path, body, 0, trio.current_time(), 0, headers))
            raise
        response: Response
        if fault is not None:
            response = _fault_response(fault)
        elif handler is None:
            response = _error(404, 404, "not found")
        elif op.startswith("POST /app/"):
            response = handler(body, arg)
        elif self.ip_blocked:
            response = _error(401, 40023002, "接口访问源IP不在白名单")
        elif not self._valid_token(request.header("authorization")):
            response = _error(401, 11244, "token not exist or expire")
        elif self._rate.get(op.lower()):
            wait = self._rate[op.lower()].pop(0)
            response = _error(429, 22009, "msg limit exceed")
            response.headers.append(("retry-after", f"{wait:g}"))
        else:
            try:
                response = handler(body if isinstance(body, dict) else {}, arg)
            except (KeyError, TypeError, ValueError) as exc:
                response = _error(400, 40034002, f"invalid request ({type(exc).__name__})")
        code = 0
        if response.status >= 400:
            try:
                code = int(json.loads(response.body).get("code", 0))
            except (ValueError, AttributeError):
                code = 0
        self.record(
            RestCall(
                request.method, path, body, response.status, trio.current_time(), code, headers
            )
        )
        lost = self._lost.get(op.lower(), 0)
        if lost or self.losing(op):  # processed, but the answer never reaches the bot
            if lost:
                self._lost[op.lower()] = lost - 1
            raise DropConnection(op)
        return response

    def _route(self, method: str, path: str) -> tuple[str, Any, str]:
        parts = path.strip("/").split("/")
        if method == "POST" and path == "/app/getAppAccessToken":
            return "POST /app/getAppAccessToken", self._token, ""
        if method == "GET" and path == "/users/@me":
            return "GET /users/@me", self._me, ""
        if method == "GET" and path == "/gateway/bot":
            return "GET /gateway/bot", self._gateway_bot, ""
        if method == "GET" and path == "/gateway":
            return "GET /gateway", self._gateway_url, ""
        if (
            method == "GET"
            and len(parts) == 4
            and parts[0] == "channels"
            and parts[2] == "messages"
        ):
            return "GET /channels/{channel_id}/messages/{message_id}", self._get_message, path
        if method == "POST" and len(parts) == 3 and parts[2] == "messages":
            if parts[0] == "channels":
                return "POST /channels/{channel_id}/messages", self._send_channel, parts[1]
            if parts[0] == "dms":
                return "POST /dms/{guild_id}/messages", self._send_dms, parts[1]
        if method == "POST" and len(parts) == 4 and parts[0] == "v2":
            if parts[1] == "users" and parts[3] == "messages":
                return "POST /v2/users/{openid}/messages", self._send_c2c, parts[2]
            if parts[1] == "groups" and parts[3] == "messages":
                return "POST /v2/groups/{group_openid}/messages", self._send_group, parts[2]
            if parts[1] == "users" and parts[3] == "stream_messages":
                return "POST /v2/users/{openid}/stream_messages", self._stream, parts[2]
        return f"{method} {path}", None, ""

    def _token(self, body: Any, _: str) -> Response:
        self.token_calls.append(trio.current_time())
        self.changed()
        if (
            not isinstance(body, dict)
            or body.get("appId") != self.app_id
            or body.get("clientSecret") != self.client_secret
        ):
            return json_response({"code": 100016, "message": "invalid appid or secret"})
        token = secrets.token_urlsafe(24)
        self.tokens[token] = trio.current_time() + self.token_lifetime_s
        return json_response({"access_token": token, "expires_in": f"{self.token_lifetime_s:.0f}"})

    def _me(self, body: Any, _: str) -> Response:
        return json_response({"id": self.bot_user["id"], "username": self.bot_user["username"]})

    def _gateway_url(self, body: Any, _: str) -> Response:
        return json_response({"url": self.gateway_url})

    def _gateway_bot(self, body: Any, _: str) -> Response:
        return json_response(
            {
                "url": self.gateway_url,
                "shards": 1,
                "session_start_limit": {
                    "total": 1000,
                    "remaining": self.identify_remaining,
                    "reset_after": 86_400_000,
                    "max_concurrency": 1,
                },
            }
        )

    def _passive(
        self, kind: str, target: str, body: dict[str, Any], *, reply: bool
    ) -> Response | Inbound:
        """The passive-reply rules; the inbound message, or the error answer."""
        msg_id = body.get("msg_id")
        if not msg_id:
            return _error(400, 40034105, "active messages are not available")
        inbound = self.inbound.get(str(msg_id))
        if inbound is None or inbound.kind != kind or inbound.target != target:
            return _error(400, 304026, "invalid msg_id")
        if trio.current_time() > inbound.at + WINDOWS_S[kind]:
            return _error(400, 304027, "reply window expired")
        seq = body.get("msg_seq", 1)
        if reply:
            if kind in ("c2c", "group") and seq in inbound.seqs:
                return _error(400, 40054005, "message deduplicated (msg_seq)")
            if inbound.replies >= CAPS[kind]:
                return _error(400, 304103, "passive reply count exceeded")
        return inbound

    def _message(self, kind: str, target: str, body: dict[str, Any]) -> Response:
        checked = self._passive(kind, target, body, reply=True)
        if isinstance(checked, Response):
            return checked
        msg_type = body.get("msg_type", 0)
        if msg_type == 2:
            if not self.markdown_allowed:
                return _error(400, 50056, "markdown not allowed")
            content = (body.get("markdown") or {}).get("content", "")
            if body.get("content"):
                return _error(400, 50057, "content must be empty with markdown")
        else:
            content = body.get("content", "")
        if not isinstance(content, str) or not content.strip():
            return _error(400, 50006, "empty message")
        if len(content) > MAX_CHARS:
            return _error(400, 40054007, "message too long")
        keyboard = body.get("keyboard") if msg_type == 2 else None
        if keyboard is not None and not self.keyboards_allowed:
            return _error(403, 11264, "keyboard permission not granted")
        reference = (body.get("message_reference") or {}).get("message_id")
        if reference is not None and kind == "group" and self.reject_group_reference:
            return _error(400, 50099, "message_reference not supported here")
        checked.seqs.add(body.get("msg_seq", 1))
        checked.replies += 1
        msg = BotMessage(
            _uid("ROBOT1.0_bot"),
            refidx(),
            kind,
            target,
            checked.id,
            body.get("msg_seq", 1),
            content,
            trio.current_time(),
            reference=reference,
            msg_type=msg_type,
            shown=[content],
            keyboard=keyboard,
        )
        self.messages.append(msg)
        self.by_ref[msg.ref_idx] = msg
        self.changed()
        if kind in ("channel", "dms"):
            return json_response(self._guild_sent(msg, target))
        return json_response(
            {"id": msg.id, "timestamp": iso_now(), "ext_info": {"ref_idx": msg.ref_idx}}
        )

    def _guild_sent(self, msg: BotMessage, target: str) -> dict[str, Any]:
        """A guild send's answer: the message object (post_messages.md), no ``ext_info``;
        with ``guild_messages`` subscribed it also comes back as the bot's MESSAGE_CREATE."""
        channel = target if msg.kind == "channel" else self.dms_channel_id
        guild = self.guild_id if msg.kind == "channel" else target
        d: dict[str, Any] = {
            "id": msg.id,
            "channel_id": channel,
            "guild_id": guild,
            "content": msg.content,
            "timestamp": iso_now(),
            "author": dict(self.bot_user),
        }
        if msg.kind == "channel":
            self.guild_log[msg.id] = d
            session = self._current
            if session is not None and session.valid and session.intents & GUILD_MESSAGES:
                self._dispatch_to(session, "MESSAGE_CREATE", d)
        return d

    def _get_message(self, body: Any, path: str) -> Response:
        """``GET /channels/{channel_id}/messages/{message_id}`` (guild channels only)."""
        _, channel_id, _, message_id = path.strip("/").split("/")
        if self.forbidden_lookup:
            return _error(403, 11264, "guild permission not granted")
        d = self.guild_log.get(urllib.parse.unquote(message_id))
        if d is None or d["channel_id"] != urllib.parse.unquote(channel_id):
            return _error(404, 50039, "get message failed")
        return json_response({"message": d} if self.wrap_fetched_message else d)

    def _send_channel(self, body: dict[str, Any], channel_id: str) -> Response:
        return self._message("channel", channel_id, body)

    def _send_dms(self, body: dict[str, Any], guild_id: str) -> Response:
        return self._message("dms", guild_id, body)

    def _send_c2c(self, body: dict[str, Any], openid: str) -> Response:
        return self._message("c2c", openid, body)

    def _send_group(self, body: dict[str, Any], group: str) -> Response:
        return self._message("group", group, body)

    def _stream(self, body: dict[str, Any], openid: str) -> Response:
        stream_id = body.get("stream_msg_id")
        content = body.get("content_raw", "")
        state = body.get("input_state")
        index = body.get("index")
        if body.get("content_type") == "markdown" and not self.markdown_allowed:
            return _error(400, 50056, "markdown not allowed")
        if (
            body.get("input_mode") != "replace"
            or state not in (1, 10)
            or not isinstance(index, int)
        ):
            return _error(400, 40034002, "invalid stream parameters")
        if not isinstance(content, str) or len(content) > MAX_CHARS:
            return _error(400, 40054018, "stream chunk too long")
        if stream_id is None and body.get("message_reference") and self.reject_stream_reference:
            return _error(400, 40034002, "message_reference is not a stream parameter")
        if stream_id is None:
            checked = self._passive("c2c", openid, body, reply=True)
            if isinstance(checked, Response):
                return checked
            checked.seqs.add(body.get("msg_seq", 1))
            checked.replies += 1
            msg = BotMessage(
                _uid("STREAM_"),
                refidx(),
                "c2c",
                openid,
                checked.id,
                body.get("msg_seq", 1),
                content,
                trio.current_time(),
                stream=True,
                done=state == 10,
                index=index,
                reference=(body.get("message_reference") or {}).get("message_id"),
                shown=[content] if content else [],
            )
            self.messages.append(msg)
            self.by_ref[msg.ref_idx] = msg
            self.changed()
            return json_response({"id": msg.id, "ext_info": {"ref_idx": msg.ref_idx}})
        found = next((x for x in self.messages if x.id == stream_id and x.stream), None)
        if found is None or found.target != openid:
            return _error(400, 40034024, "invalid stream_msg_id")
        msg = found
        checked = self._passive("c2c", openid, body, reply=False)
        if isinstance(checked, Response):
            return checked
        if msg.done:
            return _error(400, 40054015, "stream already finished")
        if index < msg.index:
            return _error(400, 40054014, "stream index went back")
        if not content.startswith(msg.content):
            return _error(400, 40007, "delivered prefix cannot change")
        msg.index = index
        if content != msg.content:
            msg.content = content
            msg.shown.append(content)
        msg.done = state == 10
        self.changed()
        return json_response({"id": msg.id, "ext_info": {"ref_idx": msg.ref_idx}})


def _fault_response(fault: Fault) -> Response:
    """A scripted ``fail_next`` fault in QQ's error shape (``code=`` sets the code)."""
    code = int(fault.extra.get("code", 22009 if fault.status == 429 else fault.status))
    response = _error(fault.status, code, fault.description or "scripted failure")
    if fault.retry_after is not None:
        response.headers.append(("retry-after", f"{fault.retry_after:g}"))
    return response


@asynccontextmanager
async def open_fake_qq(
    *, host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> AsyncIterator[FakeQQ]:
    """Run a fake QQ (HTTP + gateway on 127.0.0.1, kernel-chosen ports) for the block."""
    fake = FakeQQ(**kwargs)

    async def gateway(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_websocket(fake._gateway, host, 0, None, task_status=task_status)

    async def http(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_http(fake._http, host=host, port=port, task_status=task_status)

    async with open_servers(http, gateway) as (http_server, ws_server):
        fake.http_url = http_server.url
        fake.gateway_url = f"ws://{host}:{ws_server.port}/websocket"
        yield fake


#: How the idle bench runs this fake: the bot's first contact is READY.
IDLE_BENCH: IdleBench[FakeQQ] = IdleBench(
    open_fake_qq,
    lambda f: {
        "app_id": f.app_id,
        "client_secret": f.client_secret,
        "api_base": f.http_url,
        "token_base": f.http_url,
        "gateway_url": f.gateway_url,
    },
    lambda f: f.ready_count > 0,
)


def main(argv: list[str] | None = None) -> None:
    """Run the fake as a process (see :mod:`dshim.testing.fakes.cli`); ``--flood n``
    (benchmarks) sends n C2C messages after every READY and prints one JSON line."""
    from dshim.testing.fakes import cli

    module = "dshim.testing.fakes.qq"
    p = cli.parser(
        __doc__, module=module, flood="C2C messages after each READY (benchmarks; prints JSON)"
    )
    args = p.parse_args(argv)

    def announce(fake: FakeQQ) -> cli.Announcement:
        if args.flood is not None:
            fake.flood_on_ready = args.flood
        settings = {
            "app_id": fake.app_id,
            "client_secret": fake.client_secret,
            "api_base": fake.http_url,
            "token_base": fake.http_url,
            "gateway_url": fake.gateway_url,
        }
        notes = {"bot_id": str(fake.bot_user["id"])}
        line = {
            "http_url": fake.http_url,
            "gateway_url": fake.gateway_url,
            "app_id": fake.app_id,
            "client_secret": fake.client_secret,
            "bot_id": fake.bot_user["id"],
        }
        return cli.Announcement(
            "QQ bot OpenAPI v2 + gateway", fake.http_url, "qq", settings, notes, line
        )

    cli.run(
        args,
        module=module,
        open_fake=lambda: open_fake_qq(host=args.host, port=args.port),
        announce=announce,
        json_line=args.flood is not None,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
