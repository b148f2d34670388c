"""A fake Slack: the Web API and Socket Mode on 127.0.0.1, with fault knobs.

It speaks Slack's wire protocol as protocols/slack.md records it -- ``{"ok": false,
"error": ...}`` answers with HTTP 200, 429 with ``Retry-After``, the ``x-oauth-scopes``
header, Socket Mode's ``hello``, envelopes, acknowledgements, redeliveries with
``retry_attempt`` and ``disconnect`` frames -- so the real channel code runs against it
unchanged (``api_base`` = :attr:`FakeSlack.api_base`; ``apps.connections.open`` hands
out ``ws://127.0.0.1:<port>/link/?ticket=...`` URLs).  Usage::

    async with open_fake_slack() as fake:
        ...  # run the bot with fake.bot_token / fake.app_token / fake.api_base
        await fake.wait_until(lambda: fake.live is not None)
        await fake.user_message(fake.dm, "hello")
        await fake.wait_until(lambda: fake.bot_messages(fake.dm))

Web API (``POST``/``GET {api_base}/<method>``, JSON, form or query arguments):
``auth.test``, ``apps.connections.open`` (app token only), ``bots.info``,
``chat.postMessage``/``update``/``startStream``/``appendStream``/``stopStream``,
``conversations.history``/``replies`` (scopes enforced per conversation type, membership
enforced), ``assistant.threads.setStatus``, ``users.info`` (:attr:`users`; needs
``users:read``), ``conversations.open`` (one user's DM, :attr:`dm_channels`), and ``GET /files/<id>/<name>`` downloads
with the bot token.

Socket Mode: every envelope waits for its ``{"envelope_id"}``; one not acknowledged
within ``redeliver_after_s`` is sent again (to the newest live connection) with
``retry_attempt`` + 1 and ``retry_reason`` ``"timeout"``, at most ``max_retries`` times,
with the same ``envelope_id`` (bolt-js #2487) unless ``new_envelope_id_on_retry``.  Events
while no connection is up wait and arrive as retries once one is.  Envelopes go to the
newest connection that said hello.

Knobs and fault actions: ``scopes`` (remove one: lookups in those conversations answer
``missing_scope``), ``stream_unsupported`` (channel types whose ``chat.startStream``
answers ``channel_type_not_supported``), :meth:`stop_stream_by_user` (the next
``chat.appendStream`` answers ``stopped_by_user``), ``members`` (channels the bot is in;
others answer ``not_in_channel``), :meth:`disconnect` (``warning``,
``refresh_requested``, ``too_many_websockets``, ``link_disabled``; the server closes the
old socket ``refresh_close_after_s`` later), :meth:`drop_after` (drop the TCP connection
after k envelopes), :meth:`drop_connection`, ``server_ping_interval_s``, ``revoke()``
(the bot token answers ``invalid_auth``), and the shared fault queue keyed by method
name: ``fail_next("chat.update", 2, status=429, retry_after=3)``; ``status=200`` with
``description="not_in_channel"`` answers ``{"ok": false, "error": ...}``;
``outage(10, "500" | "drop" | "lost", ("chat.postMessage", ...))`` makes every Web API
call (or those methods) fail for a time ("lost": processed, then the connection closes
unanswered).  :meth:`add_dm` opens a DM with one more person (many users at once).

Reading what the bot did: :attr:`calls` (method, arguments, status, token kind, trio
time), :meth:`bot_messages` (current text after edits and stream appends),
:attr:`acks`, :attr:`connections`.
"""

from __future__ import annotations

import itertools
import json
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

from dshim.testing.fakes.base import FakePlatform, IdleBench, open_servers
from dshim.testing.fakes.http import (
    DropConnection,
    Request,
    Response,
    json_response,
    serve_http,
)
from dshim.testing.fakes.ws import write_frames

__all__ = ["ApiCall", "FakeSlack", "open_fake_slack"]

API_PREFIX = "/api"
DEFAULT_SCOPES = frozenset(
    {
        "app_mentions:read",
        "chat:write",
        "files:read",
        "users:read",
        "im:write",
        "im:history",
        "channels:history",
        "groups:history",
        "mpim:history",
    }
)
BOT_METHODS_WITHOUT_CHANNEL = frozenset({"auth.test", "bots.info"})
HISTORY_SCOPE = {
    "im": "im:history",
    "channel": "channels:history",
    "group": "groups:history",
    "mpim": "mpim:history",
}

_ts_counter = itertools.count(1)


@dataclass
class ApiCall:
    """One Web API request the bot made."""

    method: str
    args: dict[str, Any]
    status: int
    at: float
    token: str  # "bot" | "app" | "bad" | "none"
    http_method: str = "POST"
    error: str | None = None


@dataclass
class SocketConn:
    """One Socket Mode websocket."""

    id: int
    ws: WebSocketConnection
    opened_at: float
    outbox: trio.MemorySendChannel[tuple[str, Any]]
    hello_at: float | None = None
    envelopes: int = 0
    closed_by: str | None = None  # "server" | "client" | "drop"
    closed_at: float | None = None

    @property
    def open(self) -> bool:
        return self.closed_by is None

    def push(self, kind: str, value: Any = None) -> None:
        try:
            self.outbox.send_nowait((kind, value))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass


@dataclass
class Pending:
    """An envelope waiting for its acknowledgement."""

    envelope: dict[str, Any]
    attempts: int = 0
    sent_at: float = 0.0
    acked: bool = False


@dataclass
class Msg:
    """A message in a conversation (users' and the bot's)."""

    channel: str
    ts: str
    text: str
    user: str | None = None
    bot_id: str | None = None
    thread_ts: str | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    blocks: list[Any] | None = None
    streaming: bool = False
    edits: list[str] = field(default_factory=list)
    subtype: str | None = None
    #: Every text the message showed: the first, then after each edit or append.
    shown: list[str] = field(default_factory=list)

    def as_api(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "message", "ts": self.ts, "text": self.text}
        if self.user:
            out["user"] = self.user
        if self.bot_id:
            out["bot_id"] = self.bot_id
        if self.thread_ts:
            out["thread_ts"] = self.thread_ts
        if self.files:
            out["files"] = self.files
        if self.blocks is not None:
            out["blocks"] = self.blocks
        if self.subtype:
            out["subtype"] = self.subtype
        return out


def new_ts(at: float | None = None) -> str:
    """A fresh, growing message ts (``"1700000000.000100"``)."""
    now = time.time() if at is None else at
    return f"{int(now)}.{next(_ts_counter) % 1_000_000:06d}"


class FakeSlack(FakePlatform[ApiCall]):
    """State and behaviour of the fake; see the module docstring for the knobs."""

    def __init__(self) -> None:
        super().__init__()
        self.bot_token = "xoxb-fake-" + secrets.token_hex(6)
        self.app_token = "xapp-1-fake-" + secrets.token_hex(6)
        self.team_id = "T0FAKE001"
        self.team = "Fake Workspace"
        self.workspace_url = "https://fake-ws.slack.com/"
        self.bot_user = "U0BOT0001"
        self.bot_name = "dshim"
        self.bot_id = "B0BOT0001"
        self.app_id = "A0APP0001"
        self.user = "U0ADA0001"
        self.user_name = "Ada Lovelace"
        self.other_user = "U0BOB0002"
        self.dm = "D0DM00001"
        self.general = "C0GEN0001"
        self.private = "G0PRIV001"
        self.mpim = "C0MPIM001"
        self.outside = "C0OUT0001"  # a channel the bot is not in
        self.channel_types: dict[str, str] = {
            self.dm: "im",
            self.general: "channel",
            self.private: "group",
            self.mpim: "mpim",
            self.outside: "channel",
        }
        self.members: set[str] = {self.dm, self.general, self.private, self.mpim}
        #: ``users.info``: user id -> user object (Ada and Bob to begin with).
        self.users: dict[str, dict[str, Any]] = {
            self.user: _user(self.user, "ada", self.user_name),
            self.other_user: _user(self.other_user, "bob", "Bob Builder"),
        }
        #: user id -> DM channel id (``conversations.open``).
        self.dm_channels: dict[str, str] = {self.user: self.dm}
        # knobs
        self.scopes: set[str] = set(DEFAULT_SCOPES)
        self.stream_unsupported: set[str] = set()
        self.redeliver_after_s = 3.0
        self.max_retries = 3
        self.new_envelope_id_on_retry = False
        self.refresh_close_after_s = 10.0
        self.server_ping_interval_s: float | None = 30.0
        self.subscribe_message_events = True
        #: Send this many direct-message envelopes right after every hello (benchmarks).
        self.flood_on_hello = 0
        self.revoked = False
        #: Hand out Socket Mode URLs through a TCP relay that :meth:`freeze` can stall
        #: (a half-open socket: nothing passes, nothing closes).  Set before the bot starts.
        self.relay = False
        self.relay_url = ""
        self._frozen = trio.Event()
        self._stop_by_user = 0
        self._drop_after: int | None = None
        # state
        self.messages: dict[tuple[str, str], Msg] = {}
        self.connections: list[SocketConn] = []
        self.tickets: set[str] = set()
        self.pending: dict[str, Pending] = {}
        self.waiting: list[dict[str, Any]] = []
        self.acks: list[tuple[float, str]] = []
        self.sent_envelopes: list[dict[str, Any]] = []
        self.statuses: list[dict[str, Any]] = []
        self.files: dict[str, bytes] = {}
        self.api_base = ""
        self.http_url = ""
        self.ws_url = ""
        self._nursery: trio.Nursery | None = None

    # -- reading what the bot did ------------------------------------------------------

    def calls_to(self, method: str) -> list[ApiCall]:
        return [c for c in self.calls if c.method == method]

    def bot_messages(self, channel: str) -> list[Msg]:
        """The bot's messages in a conversation, oldest first, as they are now."""
        return [
            msg
            for msg in sorted(self.messages.values(), key=lambda x: float(x.ts))
            if msg.channel == channel and msg.bot_id == self.bot_id
        ]

    def texts(self, channel: str) -> list[str]:
        return [msg.text for msg in self.bot_messages(channel)]

    @property
    def live(self) -> SocketConn | None:
        """The newest connection that said hello and is still open."""
        for conn in reversed(self.connections):
            if conn.open and conn.hello_at is not None:
                return conn
        return None

    def open_connections(self) -> list[SocketConn]:
        return [c for c in self.connections if c.open]

    # -- knobs and faults ----------------------------------------------------------------

    def stop_stream_by_user(self, count: int = 1) -> None:
        """The next ``count`` ``chat.appendStream`` calls answer ``stopped_by_user``."""
        self._stop_by_user += count

    def drop_after(self, k: int) -> None:
        """Drop the live connection (no close frame) after k more envelopes."""
        self._drop_after = k

    async def drop_connection(self) -> None:
        conn = self.live
        if conn is not None:
            conn.push("drop")

    def freeze(self) -> None:
        """Every relayed connection stops passing bytes, both ways, without closing (a
        NAT that dropped the flow): only the client's own watchdog can notice.  New
        connections pass again."""
        self._frozen.set()
        self._frozen = trio.Event()

    async def _relay(self, client: trio.SocketStream) -> None:
        frozen = self._frozen
        port = int(self.ws_url.rsplit(":", 1)[1])
        async with client, await trio.open_tcp_stream("127.0.0.1", port) as server:

            async def pump(src: trio.SocketStream, dst: trio.SocketStream) -> None:
                try:
                    while data := await src.receive_some(65536):
                        if frozen.is_set():
                            await trio.sleep_forever()
                        await dst.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass
                nursery.cancel_scope.cancel()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(pump, client, server)
                nursery.start_soon(pump, server, client)

    def revoke(self) -> None:
        """The bot token stops working (``invalid_auth``)."""
        self.revoked = True

    async def disconnect(self, reason: str = "refresh_requested") -> SocketConn | None:
        """Send a ``disconnect`` frame on the live connection; Slack closes it later."""
        conn = self.live
        if conn is None:
            return None
        conn.push(
            "frame",
            {"type": "disconnect", "reason": reason, "debug_info": {"host": "applink-fake-1"}},
        )
        delay = self.refresh_close_after_s if reason in ("warning", "refresh_requested") else 1.0
        assert self._nursery is not None
        self._nursery.start_soon(self._close_later, conn, delay)
        return conn

    async def _close_later(self, conn: SocketConn, delay: float) -> None:
        await trio.sleep(delay)
        if conn.open:
            conn.push("close", (1000, "server closed"))

    # -- injecting events ----------------------------------------------------------------

    def add_message(
        self,
        channel: str,
        text: str,
        *,
        user: str | None = None,
        bot: bool = False,
        thread_ts: str | None = None,
        ts: str | None = None,
        files: list[dict[str, Any]] | None = None,
    ) -> Msg:
        """Put a message into a conversation's history (no event)."""
        msg = Msg(
            channel=channel,
            ts=ts or new_ts(),
            text=text,
            user=None if bot else (user or self.user),
            bot_id=self.bot_id if bot else None,
            thread_ts=thread_ts,
            files=files or [],
        )
        self.messages[(channel, msg.ts)] = msg
        return msg

    def add_dm(self, user: str, name: str) -> str:
        """A person (``users.info``) with a DM open to the bot; returns the DM's channel id."""
        self.users.setdefault(user, _user(user, name.lower(), name))
        channel = self.dm_channels.get(user)
        if channel is None:
            channel = f"D{len(self.dm_channels) + 1:08d}"
            self.dm_channels[user] = channel
            self.channel_types[channel] = "im"
            self.members.add(channel)
        return channel

    def file(self, name: str, data: bytes, mimetype: str) -> dict[str, Any]:
        """A ``files[]`` entry whose ``url_private_download`` this fake serves."""
        fid = "F" + secrets.token_hex(5).upper()
        self.files[fid] = data
        url = f"{self.http_url}/files/{fid}/{urllib.parse.quote(name)}"
        return {
            "id": fid,
            "name": name,
            "title": name,
            "mimetype": mimetype,
            "filetype": name.rpartition(".")[2],
            "size": len(data),
            "mode": "hosted",
            "url_private": url,
            "url_private_download": url,
        }

    def event(
        self,
        channel: str,
        text: str,
        *,
        user: str | None = None,
        thread_ts: str | None = None,
        files: list[dict[str, Any]] | None = None,
        kind: str = "message",
        subtype: str | None = None,
        ts: str | None = None,
    ) -> dict[str, Any]:
        """A ``message`` / ``app_mention`` event as Slack sends it (stored in history)."""
        msg = self.add_message(channel, text, user=user, thread_ts=thread_ts, files=files, ts=ts)
        ev: dict[str, Any] = {
            "type": kind,
            "user": msg.user,
            "text": text,
            "ts": msg.ts,
            "channel": channel,
            "event_ts": msg.ts,
            "team": self.team_id,
            "client_msg_id": secrets.token_hex(8),
            "blocks": [],
        }
        if kind == "message":
            ev["channel_type"] = self.channel_types.get(channel, "channel")
        if subtype:
            ev["subtype"] = subtype
        if thread_ts:
            ev["thread_ts"] = thread_ts
            parent = self.messages.get((channel, thread_ts))
            if parent is not None:
                ev["parent_user_id"] = parent.user or self.bot_user
        if files:
            ev["files"] = files
            ev.setdefault("subtype", "file_share")
        if user in (None, self.user):
            ev["user_profile"] = {"display_name": "", "real_name": self.user_name, "name": "ada"}
        return ev

    def envelope(self, event: dict[str, Any], *, retry_attempt: int = 0) -> dict[str, Any]:
        """An ``events_api`` envelope around an event."""
        return {
            "envelope_id": secrets.token_hex(16),
            "type": "events_api",
            "accepts_response_payload": False,
            "retry_attempt": retry_attempt,
            "retry_reason": "timeout" if retry_attempt else "",
            "payload": {
                "token": "legacy-verification-token",
                "team_id": self.team_id,
                "api_app_id": self.app_id,
                "event": event,
                "type": "event_callback",
                "event_id": "Ev" + secrets.token_hex(5).upper(),
                "event_time": int(float(event.get("ts", "0"))),
                "authorizations": [
                    {"team_id": self.team_id, "user_id": self.bot_user, "is_bot": True}
                ],
                "is_ext_shared_channel": False,
            },
        }

    async def user_message(
        self,
        channel: str,
        text: str,
        *,
        mention: bool = False,
        twins: bool = True,
        **kw: Any,
    ) -> dict[str, Any]:
        """A user writes: the ``message`` event (when subscribed) and, when the text
        mentions the bot, the ``app_mention`` twin of the same message."""
        if mention and f"<@{self.bot_user}>" not in text:
            text = f"<@{self.bot_user}> {text}"
        ev = self.event(channel, text, **kw)
        sent = False
        if self.subscribe_message_events:
            await self.send_envelope(self.envelope(ev))
            sent = True
        if f"<@{self.bot_user}>" in text and channel != self.dm and (twins or not sent):
            twin = {k: v for k, v in ev.items() if k != "channel_type"}
            twin["type"] = "app_mention"
            await self.send_envelope(self.envelope(twin))
        return ev

    async def press_button(
        self, bot_msg: Msg, index: int = 0, *, user: str | None = None
    ) -> dict[str, Any]:
        """Someone presses button ``index`` of one of the bot's interaction messages."""
        assert bot_msg.blocks is not None, "not an interaction message"
        buttons = [
            el
            for block in bot_msg.blocks
            if block.get("type") == "actions"
            for el in block.get("elements", [])
        ]
        button = buttons[index]
        block_id = next(
            block.get("block_id", "b")
            for block in bot_msg.blocks
            if block.get("type") == "actions" and button in block.get("elements", [])
        )
        uid = user or self.user
        action_ts = new_ts()
        payload = {
            "type": "block_actions",
            "api_app_id": self.app_id,
            "team": {"id": self.team_id, "domain": "fake-ws"},
            "user": {
                "id": uid,
                "username": "ada" if uid == self.user else "bob",
                "name": "ada" if uid == self.user else "bob",
                "team_id": self.team_id,
            },
            "container": {
                "type": "message",
                "message_ts": bot_msg.ts,
                "channel_id": bot_msg.channel,
                "is_ephemeral": False,
                "thread_ts": bot_msg.thread_ts,
            },
            "channel": {"id": bot_msg.channel, "name": "x"},
            "message": {"ts": bot_msg.ts, "thread_ts": bot_msg.thread_ts, "text": bot_msg.text},
            "actions": [
                {
                    "action_id": button["action_id"],
                    "block_id": block_id,
                    "value": button.get("value"),
                    "type": "button",
                    "action_ts": action_ts,
                }
            ],
            "trigger_id": "1.2.3",
            "response_url": f"{self.http_url}/respond/x",
        }
        env = {
            "envelope_id": secrets.token_hex(16),
            "type": "interactive",
            "accepts_response_payload": False,
            "payload": payload,
        }
        await self.send_envelope(env)
        return env

    async def send_envelope(self, envelope: dict[str, Any]) -> None:
        """Deliver an envelope now (or once a connection is up), tracking its ack."""
        eid = envelope["envelope_id"]
        self.pending[eid] = Pending(envelope)
        self._send(eid)

    def send_raw(self, text: str) -> None:
        conn = self.live
        if conn is not None:
            conn.push("text", text)

    def _send(self, eid: str) -> None:
        p = self.pending[eid]
        conn = self.live
        if conn is None:
            if p.envelope not in self.waiting:
                self.waiting.append(p.envelope)
            return
        p.sent_at = trio.current_time()
        self.sent_envelopes.append(p.envelope)
        conn.push("frame", p.envelope)
        conn.envelopes += 1
        if self._drop_after is not None:
            self._drop_after -= 1
            if self._drop_after <= 0:
                self._drop_after = None
                conn.push("drop")
        assert self._nursery is not None
        self._nursery.start_soon(self._redeliver_later, eid, p.attempts)
        self.changed()

    async def _redeliver_later(self, eid: str, attempt: int) -> None:
        await trio.sleep(self.redeliver_after_s)
        p = self.pending.get(eid)
        if p is None or p.acked or p.attempts != attempt:
            return
        if p.attempts >= self.max_retries:
            del self.pending[eid]
            return
        p.attempts += 1
        env = dict(p.envelope)
        env["retry_attempt"] = p.attempts
        env["retry_reason"] = "timeout"
        if self.new_envelope_id_on_retry:
            env["envelope_id"] = secrets.token_hex(16)
            del self.pending[eid]
            eid = env["envelope_id"]
            self.pending[eid] = p
        p.envelope = env
        self._send(eid)

    # -- Socket Mode server --------------------------------------------------------------

    async def _socket(self, request: WebSocketRequest) -> None:
        path, _, query = request.path.partition("?")
        ticket = urllib.parse.parse_qs(query).get("ticket", [""])[0]
        if path.rstrip("/") != "/link" or ticket not in self.tickets:
            await request.reject(401, body=b"invalid ticket")
            return
        self.tickets.discard(ticket)
        ws = await request.accept()
        send, recv = trio.open_memory_channel[tuple[str, Any]](10_000)
        conn = SocketConn(len(self.connections), ws, trio.current_time(), send)
        self.connections.append(conn)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer, conn, recv)
            if self.server_ping_interval_s:
                nursery.start_soon(self._pinger, conn, self.server_ping_interval_s)
            conn.push(
                "frame",
                {
                    "type": "hello",
                    "num_connections": len(self.open_connections()),
                    "debug_info": {
                        "host": "applink-fake-1",
                        "build_number": 1,
                        "approximate_connection_time": 18060,
                    },
                    "connection_info": {"app_id": self.app_id},
                },
            )
            conn.hello_at = trio.current_time()
            # Events from a gap without a socket arrive now, as retries.
            waiting, self.waiting = self.waiting, []
            for env in waiting:
                eid = env["envelope_id"]
                p = self.pending.get(eid)
                if p is None:
                    continue
                p.attempts += 1
                p.envelope = dict(env, retry_attempt=p.attempts, retry_reason="timeout")
                self._send(eid)
            for i in range(self.flood_on_hello):
                text = f"flood {i} " + "lorem ipsum dolor sit amet " * 20
                env = self.envelope(self.event(self.dm, text))
                self.pending[env["envelope_id"]] = Pending(env)
                conn.push("frame", env)
            self.changed()
            try:
                while True:
                    data = await ws.get_message()
                    self._on_frame(conn, data)
            except ConnectionClosed:
                if conn.closed_by is None:
                    conn.closed_by = "client"
                    conn.closed_at = trio.current_time()
            finally:
                send.close()
                self.changed()
                nursery.cancel_scope.cancel()

    def _on_frame(self, conn: SocketConn, data: str | bytes) -> None:
        try:
            frame = json.loads(data)
            eid = frame["envelope_id"]
        except (ValueError, KeyError, TypeError):
            return
        self.acks.append((trio.current_time(), str(eid)))
        p = self.pending.get(eid)
        if p is not None:
            p.acked = True
            del self.pending[eid]
        self.changed()

    async def _writer(
        self, conn: SocketConn, recv: trio.MemoryReceiveChannel[tuple[str, Any]]
    ) -> None:
        await write_frames(
            conn, recv, self.changed, dumps=lambda v: json.dumps(v, separators=(",", ":"))
        )

    async def _pinger(self, conn: SocketConn, interval: float) -> None:
        while conn.open:
            await trio.sleep(interval)
            try:
                await conn.ws.ping()
            except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
                return

    # -- Web API -------------------------------------------------------------------------

    async def _http(self, request: Request) -> Response:
        if request.path.startswith("/files/"):
            return self._download(request)
        if not request.path.startswith(API_PREFIX + "/"):
            return json_response({"ok": False, "error": "unknown_method"}, status=404)
        method = request.path[len(API_PREFIX) + 1 :]
        try:
            args = request.params()
        except (ValueError, UnicodeDecodeError):
            args = {}
        auth = request.header("authorization") or ""
        token = auth[7:] if auth.startswith("Bearer ") else ""
        kind = (
            "bot"
            if token == self.bot_token
            else "app"
            if token == self.app_token
            else "none"
            if not token
            else "bad"
        )
        call = ApiCall(method, args, 200, trio.current_time(), kind, http_method=request.method)
        fault = await self.faults_for(method)
        if fault is not None:
            if fault.status == 429:
                call.status = 429
                self.record(call)
                retry = fault.retry_after if fault.retry_after is not None else 1.0
                return Response(
                    429,
                    b'{"ok":false,"error":"ratelimited"}',
                    [("content-type", "application/json"), ("retry-after", f"{retry:g}")],
                )
            if fault.status != 200:
                call.status = fault.status
                self.record(call)
                return json_response({"ok": False, "error": "internal_error"}, fault.status)
            call.error = fault.description or "internal_error"
            self.record(call)
            return json_response({"ok": False, "error": call.error})
        try:
            body = self._answer(method, args, kind)
        except _ApiError as exc:
            body = {"ok": False, "error": exc.error, **exc.extra}
        call.error = None if body.get("ok") else str(body.get("error"))
        self.record(call)
        if self.losing(method):
            # Processed, but the answer never reaches the bot (connection lost after it).
            raise DropConnection(method)
        response = json_response(body)
        if method == "auth.test" and body.get("ok"):
            response.headers.append(("x-oauth-scopes", ",".join(sorted(self.scopes))))
        return response

    def _answer(self, method: str, args: dict[str, Any], kind: str) -> dict[str, Any]:
        if method == "apps.connections.open":
            if kind != "app":
                raise _ApiError("invalid_auth" if kind != "bot" else "not_allowed_token_type")
            ticket = secrets.token_hex(12)
            self.tickets.add(ticket)
            base = self.relay_url if self.relay else self.ws_url
            return {"ok": True, "url": f"{base}/link/?ticket={ticket}&app_id={self.app_id}"}
        if kind == "none":
            raise _ApiError("not_authed")
        if kind != "bot" or self.revoked:
            raise _ApiError("invalid_auth" if kind != "app" else "not_allowed_token_type")
        handler = getattr(self, "_m_" + method.replace(".", "_"), None)
        if handler is None:
            raise _ApiError("unknown_method")
        result: dict[str, Any] = handler(args)
        return result

    def _channel(self, args: dict[str, Any], key: str = "channel") -> str:
        channel = str(args.get(key) or "")
        if channel not in self.channel_types:
            raise _ApiError("channel_not_found")
        if channel not in self.members:
            raise _ApiError("not_in_channel")
        return channel

    def _bot_msg(self, args: dict[str, Any]) -> Msg:
        channel = self._channel(args)
        msg = self.messages.get((channel, str(args.get("ts") or "")))
        if msg is None:
            raise _ApiError("message_not_found")
        if msg.bot_id != self.bot_id:
            raise _ApiError("cant_update_message")
        return msg

    def _m_auth_test(self, args: dict[str, Any]) -> dict[str, Any]:
        return {
            "ok": True,
            "url": self.workspace_url,
            "team": self.team,
            "user": self.bot_name,
            "team_id": self.team_id,
            "user_id": self.bot_user,
            "bot_id": self.bot_id,
            "is_enterprise_install": False,
        }

    def _m_bots_info(self, args: dict[str, Any]) -> dict[str, Any]:
        if args.get("bot") != self.bot_id:
            raise _ApiError("bot_not_found")
        return {
            "ok": True,
            "bot": {"id": self.bot_id, "app_id": self.app_id, "user_id": self.bot_user},
        }

    def _new_bot_msg(self, channel: str, thread_ts: str | None, text: str) -> Msg:
        msg = Msg(
            channel=channel,
            ts=new_ts(),
            text=text,
            bot_id=self.bot_id,
            thread_ts=thread_ts,
            shown=[text] if text else [],
        )
        self.messages[(channel, msg.ts)] = msg
        return msg

    def _text(self, args: dict[str, Any], limit: int) -> str:
        markdown = args.get("markdown_text")
        text = str(markdown if markdown is not None else args.get("text") or "")
        if len(text) > limit:
            raise _ApiError("msg_too_long")
        return text

    def _m_chat_postMessage(self, args: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(args)
        if args.get("markdown_text") is not None and args.get("text"):
            raise _ApiError("markdown_text_conflict")
        limit = 12_000 if args.get("markdown_text") is not None else 40_000
        text = self._text(args, limit)
        if not text and not args.get("blocks"):
            raise _ApiError("no_text")
        thread = args.get("thread_ts")
        msg = self._new_bot_msg(channel, str(thread) if thread else None, text)
        if args.get("blocks"):
            msg.blocks = list(args["blocks"])
        return {"ok": True, "channel": channel, "ts": msg.ts, "message": msg.as_api()}

    def _m_chat_update(self, args: dict[str, Any]) -> dict[str, Any]:
        msg = self._bot_msg(args)
        if msg.streaming:
            raise _ApiError("streaming_state_conflict")
        text = self._text(args, 4000)
        msg.text = text
        msg.edits.append(text)
        msg.shown.append(text)
        msg.blocks = list(args["blocks"]) if args.get("blocks") else None
        return {"ok": True, "channel": msg.channel, "ts": msg.ts, "text": text}

    def _m_chat_startStream(self, args: dict[str, Any]) -> dict[str, Any]:
        channel = self._channel(args)
        ctype = self.channel_types[channel]
        if ctype in self.stream_unsupported:
            raise _ApiError("channel_type_not_supported")
        thread = args.get("thread_ts")
        if not thread:
            raise _ApiError("invalid_arguments")
        if ctype != "im":
            if not args.get("recipient_user_id"):
                raise _ApiError("missing_recipient_user_id")
            if not args.get("recipient_team_id"):
                raise _ApiError("missing_recipient_team_id")
        text = self._text(args, 12_000)
        msg = self._new_bot_msg(channel, str(thread), text)
        msg.streaming = True
        return {"ok": True, "channel": channel, "ts": msg.ts}

    def _streaming(self, args: dict[str, Any]) -> Msg:
        msg = self._bot_msg(args)
        if not msg.streaming:
            raise _ApiError("message_not_in_streaming_state")
        return msg

    def _m_chat_appendStream(self, args: dict[str, Any]) -> dict[str, Any]:
        msg = self._streaming(args)
        if self._stop_by_user > 0:
            self._stop_by_user -= 1
            msg.streaming = False
            raise _ApiError("stopped_by_user")
        piece = self._text(args, 12_000)
        msg.text += piece
        msg.edits.append(msg.text)
        msg.shown.append(msg.text)
        return {"ok": True, "channel": msg.channel, "ts": msg.ts}

    def _m_chat_stopStream(self, args: dict[str, Any]) -> dict[str, Any]:
        msg = self._streaming(args)
        piece = self._text(args, 12_000)
        msg.text += piece
        msg.streaming = False
        if piece:
            msg.edits.append(msg.text)
            msg.shown.append(msg.text)
        return {"ok": True, "channel": msg.channel, "ts": msg.ts, "message": msg.as_api()}

    def _m_assistant_threads_setStatus(self, args: dict[str, Any]) -> dict[str, Any]:
        self._channel(args, "channel_id")
        self.statuses.append(dict(args))
        return {"ok": True}

    def _m_users_info(self, args: dict[str, Any]) -> dict[str, Any]:
        if "users:read" not in self.scopes:
            raise _ApiError("missing_scope", needed="users:read")
        user = self.users.get(str(args.get("user") or ""))
        if user is None:
            raise _ApiError("user_not_found")
        return {"ok": True, "user": user}

    def _m_conversations_open(self, args: dict[str, Any]) -> dict[str, Any]:
        """The DM with one user (``users``: one id; several would be an mpim)."""
        users = str(args.get("users") or "")
        if users not in self.users:
            raise _ApiError("user_not_found")
        user = self.users[users]
        return {"ok": True, "channel": {"id": self.add_dm(users, str(user.get("real_name")))}}

    def _history_channel(self, args: dict[str, Any]) -> str:
        channel = str(args.get("channel") or "")
        ctype = self.channel_types.get(channel)
        if ctype is None:
            raise _ApiError("channel_not_found")
        needed = HISTORY_SCOPE[ctype]
        if needed not in self.scopes:
            raise _ApiError("missing_scope", needed=needed, provided=",".join(sorted(self.scopes)))
        if channel not in self.members:
            raise _ApiError("not_in_channel")
        return channel

    def _m_conversations_history(self, args: dict[str, Any]) -> dict[str, Any]:
        channel = self._history_channel(args)
        latest = float(args.get("latest") or "inf")
        inclusive = str(args.get("inclusive", "false")).lower() in ("true", "1")
        limit = int(args.get("limit") or 100)
        top = [
            msg
            for msg in self.messages.values()
            if msg.channel == channel
            and (msg.thread_ts is None or msg.thread_ts == msg.ts)
            and (float(msg.ts) < latest or (inclusive and float(msg.ts) == latest))
        ]
        top.sort(key=lambda x: float(x.ts), reverse=True)
        return {"ok": True, "messages": [x.as_api() for x in top[:limit]], "has_more": False}

    def _m_conversations_replies(self, args: dict[str, Any]) -> dict[str, Any]:
        channel = self._history_channel(args)
        ts = str(args.get("ts") or "")
        target = self.messages.get((channel, ts))
        if target is None:
            raise _ApiError("thread_not_found")
        parent_ts = target.thread_ts or target.ts
        parent = self.messages.get((channel, parent_ts))
        oldest = float(args.get("oldest") or 0)
        latest = float(args.get("latest") or "inf")
        replies = [
            msg
            for msg in self.messages.values()
            if msg.channel == channel
            and msg.thread_ts == parent_ts
            and msg.ts != parent_ts
            and oldest <= float(msg.ts) <= latest
        ]
        replies.sort(key=lambda x: float(x.ts))
        out = ([parent.as_api()] if parent is not None else []) + [x.as_api() for x in replies]
        return {"ok": True, "messages": out, "has_more": False}

    def _download(self, request: Request) -> Response:
        auth = request.header("authorization") or ""
        parts = request.path.split("/")
        data = self.files.get(parts[2]) if len(parts) > 2 else None
        ok = auth == f"Bearer {self.bot_token}"
        self.record(
            ApiCall(
                "files.download",
                {"path": request.path},
                200 if ok else 403,
                trio.current_time(),
                "bot" if ok else "bad",
                http_method="GET",
            )
        )
        if not ok:
            return Response(403, b"forbidden")
        if data is None:
            return Response(404, b"not found")
        return Response(200, data, [("content-type", "application/octet-stream")])


def _user(uid: str, name: str, real_name: str) -> dict[str, Any]:
    """A ``users.info`` user object."""
    return {
        "id": uid,
        "name": name,
        "real_name": real_name,
        "deleted": False,
        "is_bot": False,
        "profile": {"display_name": "", "real_name": real_name},
    }


class _ApiError(Exception):
    def __init__(self, error: str, **extra: Any) -> None:
        super().__init__(error)
        self.error = error
        self.extra = extra


@asynccontextmanager
async def open_fake_slack(*, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[FakeSlack]:
    """Run a fake Slack (Web API + Socket Mode on 127.0.0.1, kernel-chosen ports)."""
    fake = FakeSlack()

    async def socket(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_websocket(fake._socket, host, 0, None, task_status=task_status)

    async def http(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_http(fake._http, host=host, port=port, task_status=task_status)

    async def background(
        *, task_status: trio.TaskStatus[trio.Nursery] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started(nursery)
            await trio.sleep_forever()

    async def relay(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, fake._relay, listeners)
            task_status.started(listeners[0].socket.getsockname()[1])

    async with open_servers(http, socket, background, relay) as (
        http_server,
        ws_server,
        nursery,
        relay_port,
    ):
        fake.http_url = http_server.url
        fake.api_base = http_server.url + API_PREFIX
        fake.ws_url = f"ws://{host}:{ws_server.port}"
        fake.relay_url = f"ws://127.0.0.1:{relay_port}"
        fake._nursery = nursery
        yield fake


#: How the idle bench runs this fake: the bot's first contact is hello on Socket Mode.
IDLE_BENCH: IdleBench[FakeSlack] = IdleBench(
    open_fake_slack,
    lambda f: {"bot_token": f.bot_token, "app_token": f.app_token, "api_base": f.api_base},
    lambda f: f.live is not None,
)


def main(argv: list[str] | None = None) -> None:
    """Run the fake as a process (see :mod:`dshim.testing.fakes.cli`); ``--flood n``
    (benchmarks) sends n DMs after every hello and prints one JSON line."""
    from dshim.testing.fakes import cli

    module = "dshim.testing.fakes.slack"
    p = cli.parser(__doc__, module=module, flood="DMs after each hello (benchmarks; prints JSON)")
    args = p.parse_args(argv)

    def announce(fake: FakeSlack) -> cli.Announcement:
        if args.flood is not None:
            fake.redeliver_after_s = 3600.0
            fake.flood_on_hello = args.flood
        settings = {
            "bot_token": fake.bot_token,
            "app_token": fake.app_token,
            "api_base": fake.api_base,
        }
        notes = {"socket_mode": fake.ws_url, "dm": fake.dm, "bot_user": fake.bot_user}
        line = {**settings, "dm": fake.dm, "bot_user": fake.bot_user}
        return cli.Announcement(
            "Slack Web API + Socket Mode", fake.api_base, "slack", settings, notes, line
        )

    cli.run(
        args,
        module=module,
        open_fake=lambda: open_fake_slack(host=args.host, port=args.port),
        announce=announce,
        json_line=args.flood is not None,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
