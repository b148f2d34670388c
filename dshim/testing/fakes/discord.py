"""A fake Discord: REST v10 and Gateway v10 on 127.0.0.1, with fault knobs.

It speaks the real wire protocol -- opcodes, payload shapes, close codes, error bodies and
rate-limit headers as documented in discord-api-docs -- so the real channel code runs
against it unchanged (``api_base`` = :attr:`FakeDiscord.api_base`, ``gateway_url`` =
:attr:`FakeDiscord.gateway_url`).  Usage::

    async with open_fake_discord(heartbeat_interval_ms=200) as fake:
        ...  # run the bot against fake.api_base / fake.gateway_url
        await fake.wait_until(lambda: fake.ready_count >= 1)
        msg = await fake.user_message(fake.dm_channel, "hello")
        await fake.wait_until(lambda: fake.bot_messages(fake.dm_channel))

Transport compression: a client that connects with ``compress=zlib-stream`` in the query
gets every frame as a binary message from one zlib stream per connection, each ending
with a ``Z_SYNC_FLUSH`` (``00 00 ff ff``), as Discord sends it.

Gateway: Hello -> Identify (new session, READY, GUILD_CREATE) or Resume (missed dispatches
replayed in order, then RESUMED) -> dispatches, heartbeats answered with op 11.  Resumes go
to ``/resume`` (the READY's ``resume_gateway_url``), so a test can see that the client
used it.  Injected messages are appended to the current session's event log; while no
session exists they wait for the next READY (a convenience; Discord would not keep them).

Knobs (attributes, changeable at any time) and fault actions:

* ``heartbeat_interval_ms``; ``ack_heartbeats`` (False: a zombie connection);
  ``heartbeat_timeout_factor`` (close 4009 when the client stops beating; None: off);
* ``drop_after(k)``: drop the TCP connection (no close frame) after k more MESSAGE_CREATE
  dispatches; :meth:`drop_connection` now;
* :meth:`send_reconnect` (op 7), :meth:`send_invalid_session` (op 9, d true/false),
  :meth:`request_heartbeat` (op 1), :meth:`close_gateway` (any close code);
  ``close_on_identify`` (answer every Identify with this close code, e.g. 4004);
* ``replay_on_resume`` = n: a Resume also re-sends the n dispatches before the client's
  ``seq`` (duplicates the client must not answer twice);
* ``identify_remaining``, ``identify_window_s``, ``max_concurrency`` (session_start_limit;
  too many identifies in the window -> op 9 d=false); ``message_content_enabled`` (False:
  asking for MESSAGE_CONTENT closes with 4014);
* :meth:`rate_limit`: the next ``count`` matching REST requests get 429 (per route, or
  global); ``bucket_limits``: enforce per-route buckets (``X-RateLimit-*`` headers are
  always sent); ``latency_s`` / ``route_latency``: slow REST answers;
* the shared fault queue (:class:`~dshim.testing.fakes.base.FakePlatform`), keyed by
  ``"METHOD /route/template"`` (e.g. ``"PATCH /channels/{channel_id}/messages/{message_id}"``):
  ``fail_next(op, n, status=..., retry_after=..., code=...)`` answers in Discord's error
  shape (429 with ``retry_after``; ``is_global=True``), ``slow_next(op, s)``, and
  ``drop_next(op)`` closes the connection unanswered and unprocessed;
  :meth:`drop_response_next` processes the request, then closes the connection before
  the answer (a send whose outcome the bot cannot know); :meth:`outage` for a time (every
  REST call, or those of the named routes, answers 500, is dropped before or lost after
  processing; the gateway is not touched);
* ``flood_on_ready`` = n: dispatch n direct messages right after every READY (benchmarks);
* ``forbidden``: channel id -> 50001 (no access: reads and sends fail) or 50013 (no Read
  Message History: reads fail, replies fail with 160002).

Injecting: :meth:`message` / :meth:`user_message` build MESSAGE_CREATE payloads as Discord
sends them: replies (snapshot, bare reference, deleted), mentions of the bot's user or of
its managed role (``bot_role``, listed in GUILD_CREATE with ``tags.bot_id``), forwards
(``forward=``: ``message_snapshots``), stickers; messages in :attr:`thread_channel` (a
thread of :attr:`text_channel`) carry ``channel_type`` 11 and a ``position``;
:meth:`forum_post` opens a post in :attr:`forum_channel` (THREAD_CREATE, then the starter
message with the thread's id); :meth:`dispatch` sends any event and
``conn.push("text", ...)`` any raw frame.

Buttons (message components): a create or edit may carry ``components`` (action rows of
at most 5 buttons, at most 5 rows, ``custom_id`` at most 100 characters, label at most
80: anything else is 400 50035), kept on the message.  :meth:`press` is a user pressing
one of a bot message's buttons: an INTERACTION_CREATE (type 3) with a fresh interaction
id and token, as Discord sends it (``member`` in a guild, ``user`` in a DM, the pressed
``message``).  The bot answers with ``POST /interactions/{id}/{token}/callback``
(:attr:`interactions` records each): the token must match (else 401 50027), at most one
answer (else 400 40060), within ``interaction_window_s`` (3 s; later: 404 10062
Unknown interaction); type 7 (UPDATE_MESSAGE) edits the message (``content``,
``components``), type 6 (DEFERRED_UPDATE_MESSAGE) only acknowledges.  ``press(...,
delay_s=4)`` delivers the press that much after it was made (a slow gateway, a Resume
replay).  The recorded call's path has the token replaced by ``{token}``.

Reading what the bot did: :attr:`calls` (every REST request: method, path relative to
the API base, JSON body, status; 0 for a dropped request), :meth:`bot_messages` (current
state of the bot's messages after edits), :attr:`identifies`, :attr:`resumes`,
:attr:`connections`, :attr:`heartbeats`.  Every ``at`` is trio's clock (virtual on the
autojump clock).  :meth:`wait_until` waits for a condition on any of them.
"""

from __future__ import annotations

import base64
import itertools
import json
import math
import re
import secrets
import sys
import time
import zlib
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from urllib.parse import parse_qs

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest, serve_websocket

from dshim.testing.fakes import cli
from dshim.testing.fakes.base import FakePlatform, Fault, IdleBench, open_servers
from dshim.testing.fakes.http import DropConnection, Request, Response, json_response, serve_http

__all__ = [
    "FakeDiscord",
    "FakeInteraction",
    "RestCall",
    "bench_identity",
    "open_fake_discord",
    "snowflake",
]

API_PREFIX = "/api/v10"
DISCORD_EPOCH_MS = 1420070400000
PRIVILEGED_INTENTS = (1 << 1) | (1 << 8) | (1 << 15)  # members, presences, message content
MESSAGE_CONTENT = 1 << 15
VALID_INTENTS = (1 << 26) - 1
MAX_SEND_BYTES = 4096
MAX_CONTENT = 2000
OUTBOX = 100_000
_CALLBACK = re.compile(r"^/interactions/(?P<id>[^/]+)/(?P<token>[^/]+)/callback$")
CALLBACK_OP = "POST /interactions/{interaction_id}/{interaction_token}/callback"

_counter = itertools.count()


def snowflake(at: float | None = None) -> str:
    """A fresh snowflake id for time ``at`` (epoch seconds, default now)."""
    ms = int((time.time() if at is None else at) * 1000) - DISCORD_EPOCH_MS
    return str((ms << 22) | (next(_counter) & 0x3FFFFF))


def iso_now(at: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if at is None else at, UTC).isoformat()


@dataclass
class RestCall:
    """One REST request the bot made (``path`` relative to ``/api/v10``)."""

    method: str
    path: str
    json: Any
    status: int
    at: float
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class GatewayConnection:
    """One websocket connection (``path`` tells identify URL from resume URL)."""

    id: int
    path: str
    opened_at: float
    ws: WebSocketConnection
    outbox_send: trio.MemorySendChannel[tuple[str, Any]]
    query: str = ""
    session: _Session | None = None
    authenticated: bool = False
    last_beat_at: float = 0.0
    closed_code: int | None = None
    closed_by: str | None = None  # "server" | "client" | "drop"
    closed_at: float | None = None  # trio time
    sends: list[float] = field(default_factory=list)
    #: ``compress=zlib-stream``: the connection's one compressor (frames go out binary).
    zlib_stream: Any = None

    def push(self, kind: str, value: Any = None) -> None:
        try:
            self.outbox_send.send_nowait((kind, value))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass


@dataclass
class _Session:
    id: str
    seq: int = 0
    log: list[tuple[int, str, str]] = field(default_factory=list)
    conn: GatewayConnection | None = None
    valid: bool = True


@dataclass
class FakeInteraction:
    """One button press: its token, when it was made, how the bot answered."""

    id: str
    token: str
    message_id: str
    custom_id: str
    user_id: str
    made_at: float  # trio time
    #: (trio time, callback body, HTTP status) for every callback the bot made.
    callbacks: list[tuple[float, Any, int]] = field(default_factory=list)
    answered: bool = False


@dataclass
class _RateRule:
    method: str | None
    route: re.Pattern[str] | None
    count: int
    retry_after: float
    is_global: bool


@dataclass
class _Bucket:
    remaining: int
    reset_at: float


_ROUTES: list[tuple[str, re.Pattern[str], str, str]] = [
    # method, pattern, route template (for buckets), handler name
    ("GET", re.compile(r"^/users/@me$"), "/users/@me", "_get_me"),
    ("GET", re.compile(r"^/gateway/bot$"), "/gateway/bot", "_get_gateway_bot"),
    (
        "GET",
        re.compile(r"^/channels/(?P<channel>[^/]+)/messages/(?P<message>[^/]+)$"),
        "/channels/{channel_id}/messages/{message_id}",
        "_get_message",
    ),
    (
        "POST",
        re.compile(r"^/channels/(?P<channel>[^/]+)/messages$"),
        "/channels/{channel_id}/messages",
        "_create_message",
    ),
    (
        "PATCH",
        re.compile(r"^/channels/(?P<channel>[^/]+)/messages/(?P<message>[^/]+)$"),
        "/channels/{channel_id}/messages/{message_id}",
        "_edit_message",
    ),
    (
        "POST",
        re.compile(r"^/channels/(?P<channel>[^/]+)/typing$"),
        "/channels/{channel_id}/typing",
        "_typing",
    ),
    (
        "POST",
        re.compile(r"^/channels/(?P<channel>[^/]+)/messages/(?P<message>[^/]+)/threads$"),
        "/channels/{channel_id}/messages/{message_id}/threads",
        "_start_thread",
    ),
    ("POST", re.compile(r"^/users/@me/channels$"), "/users/@me/channels", "_open_dm"),
    ("GET", re.compile(r"^/users/(?P<user>\d+)$"), "/users/{user_id}", "_get_user"),
]


class FakeDiscord(FakePlatform[RestCall]):
    """State and behaviour of the fake; see the module docstring for the knobs."""

    def __init__(
        self,
        *,
        token: str = "fake-discord-token",
        bot_id: str | None = None,
        bot_username: str = "dshim-bot",
        heartbeat_interval_ms: float = 41250,
        guild_id: str | None = None,
    ) -> None:
        super().__init__()
        self.token = token
        self.bot_user = {
            "id": bot_id or snowflake(),
            "username": bot_username,
            "global_name": None,
            "discriminator": "0",
            "avatar": None,
            "bot": True,
        }
        self.guild_id = guild_id or snowflake()
        #: The managed role Discord gives the bot in the guild (``tags.bot_id``).
        self.bot_role = snowflake()
        #: Another role (not the bot's) for "a role mention is not the bot" cases.
        self.other_role = snowflake()
        self.text_channel = snowflake()
        self.other_channel = snowflake()
        self.thread_channel = snowflake()
        #: A forum channel (type 15): only threads (posts) are created in it.
        self.forum_channel = snowflake()
        self.user = {
            "id": snowflake(),
            "username": "ada",
            "global_name": "Ada Lovelace",
            "discriminator": "0",
            "avatar": None,
        }
        self.dm_channel = snowflake()
        #: channel id -> {"id", "type", "guild_id"?, "parent_id"?}
        self.channels: dict[str, dict[str, Any]] = {
            self.dm_channel: {"id": self.dm_channel, "type": 1},
            self.text_channel: {"id": self.text_channel, "type": 0, "guild_id": self.guild_id},
            self.other_channel: {"id": self.other_channel, "type": 0, "guild_id": self.guild_id},
            self.thread_channel: {
                "id": self.thread_channel,
                "type": 11,
                "guild_id": self.guild_id,
                "parent_id": self.text_channel,
            },
            self.forum_channel: {"id": self.forum_channel, "type": 15, "guild_id": self.guild_id},
        }
        #: user id -> DM channel id (``POST /users/@me/channels``)
        self.dm_channels: dict[str, str] = {}
        #: user id -> user object, for ``GET /users/{id}``
        self.known_users: dict[str, dict[str, Any]] = {}
        # knobs
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.ack_heartbeats = True
        self.heartbeat_timeout_factor: float | None = 2.0
        self.close_on_identify: int | None = None
        self.replay_on_resume = 0
        self.identify_remaining = 1000
        self.identify_total = 1000
        self.identify_reset_after_ms = 3_600_000
        self.identify_window_s = 5.0
        self.max_concurrency = 1
        self.message_content_enabled = True
        self.latency_s = 0.0
        self.route_latency: dict[str, float] = {}
        self.bucket_limits: dict[str, tuple[int, float]] = {}
        self.forbidden: dict[str, int] = {}
        self.flood_on_ready = 0
        self.interaction_window_s = 3.0
        #: interaction id -> the press and the bot's callbacks
        self.interactions: dict[str, FakeInteraction] = {}
        self._drop_after: int | None = None
        self._lost_responses: dict[str, int] = {}
        self._rate_rules: list[_RateRule] = []
        self._buckets: dict[tuple[str, str], _Bucket] = {}
        self._global_until = 0.0
        # state
        self.messages: dict[str, dict[str, Any]] = {}
        self.edits: dict[str, list[str]] = {}
        self.identifies: list[dict[str, Any]] = []
        self.resumes: list[dict[str, Any]] = []
        self.connections: list[GatewayConnection] = []
        self.heartbeats: list[tuple[float, Any]] = []
        self.ready_count = 0
        self.resumed_count = 0
        self.invalid_sessions = 0
        self._sessions: dict[str, _Session] = {}
        self._current: _Session | None = None
        self._pending: list[tuple[str, Any]] = []
        self._nonces: dict[tuple[str, str], str] = {}
        self._identify_times: list[float] = []
        self.api_base = ""
        self.gateway_url = ""
        self.http_url = ""

    # -- reading what the bot did ------------------------------------------------------

    def calls_to(self, method: str, path_prefix: str = "") -> list[RestCall]:
        return [c for c in self.calls if c.method == method and c.path.startswith(path_prefix)]

    def bot_messages(self, channel_id: str) -> list[dict[str, Any]]:
        """The bot's messages in a channel, oldest first, as they are now (after edits)."""
        bot_id = self.bot_user["id"]
        return [
            msg
            for msg in self.messages.values()
            if msg["channel_id"] == channel_id and msg["author"]["id"] == bot_id
        ]

    @property
    def live(self) -> GatewayConnection | None:
        """The current session's open connection."""
        s = self._current
        if s is None or s.conn is None or s.conn.closed_by is not None:
            return None
        return s.conn

    # -- fault actions -----------------------------------------------------------------

    def drop_after(self, k: int) -> None:
        """Drop the connection (no close frame) after k more MESSAGE_CREATE dispatches."""
        self._drop_after = k

    async def drop_connection(self) -> None:
        conn = self.live
        if conn is not None:
            conn.push("drop")

    async def send_reconnect(self) -> None:
        """Op 7 Reconnect; the server closes the socket a moment later if the client does not."""
        conn = self.live
        if conn is not None:
            conn.push("frame", {"op": 7, "d": None})

    async def send_invalid_session(self, resumable: bool) -> None:
        """Op 9 Invalid Session.  ``d=false`` also ends the session on the server."""
        conn = self.live
        if conn is None:
            return
        if not resumable and conn.session is not None:
            conn.session.valid = False
        self.invalid_sessions += 1
        conn.push("frame", {"op": 9, "d": resumable})

    async def request_heartbeat(self) -> None:
        conn = self.live
        if conn is not None:
            conn.push("frame", {"op": 1, "d": None})

    async def close_gateway(self, code: int, reason: str = "") -> None:
        """Close the live connection with ``code`` (4004, 4014, 4009 ...)."""
        conn = self.live
        if conn is not None:
            conn.push("close", (code, reason))

    def rate_limit(
        self,
        *,
        method: str | None = None,
        route: str | None = None,
        count: int = 1,
        retry_after: float = 0.5,
        is_global: bool = False,
    ) -> None:
        """The next ``count`` requests matching ``method`` and ``route`` (a regex on the
        path relative to ``/api/v10``; None: any) answer 429."""
        self._rate_rules.append(
            _RateRule(method, re.compile(route) if route else None, count, retry_after, is_global)
        )

    def drop_response_next(self, op: str, count: int = 1) -> None:
        """The next ``count`` calls of ``op`` are performed, but their connection closes
        before the answer is sent (the response is lost)."""
        self._lost_responses[op.lower()] = self._lost_responses.get(op.lower(), 0) + count

    def delete_message(self, message_id: str) -> None:
        self.messages.pop(message_id, None)

    # -- injecting user messages -------------------------------------------------------

    def make_user(
        self, username: str, *, global_name: str | None = None, bot: bool = False
    ) -> dict[str, Any]:
        user: dict[str, Any] = {
            "id": snowflake(),
            "username": username,
            "global_name": global_name,
            "discriminator": "0",
            "avatar": None,
        }
        if bot:
            user["bot"] = True
        return user

    def message(
        self,
        channel_id: str,
        content: str,
        *,
        author: dict[str, Any] | None = None,
        nick: str | None = None,
        mention_bot: bool = False,
        mention_text: bool = True,
        mention_role: str | None = None,
        reply_to: dict[str, Any] | str | None = None,
        reference: str = "snapshot",
        attachments: list[dict[str, Any]] | None = None,
        forward: dict[str, Any] | None = None,
        stickers: list[str] | None = None,
        mention_users: list[dict[str, Any]] | None = None,
        message_id: str | None = None,
    ) -> dict[str, Any]:
        """Build a MESSAGE_CREATE ``d`` as Discord sends it (and store the message).

        ``reply_to`` (a stored message or its id) makes it a reply; ``reference`` says
        what Discord includes: ``"snapshot"`` (``referenced_message`` object), ``"bare"``
        (no ``referenced_message`` key), ``"deleted"`` (``referenced_message: null``).
        ``mention_bot`` adds the bot to ``mentions`` and, with ``mention_text``,
        ``<@id>`` in front of the content; ``mention_role`` (a role id, e.g.
        :attr:`bot_role`) puts ``<@&role>`` there and the role in ``mention_roles``.
        ``forward`` (a stored message) makes it a forward of that message: a reference of
        type 1 and its text and attachments in ``message_snapshots`` (no author), the
        content empty as Discord sends it.  ``stickers`` are sticker names.
        ``mention_users`` (users whose ``<@id>`` the content carries) go into ``mentions``.
        ``message_id``: the id to give it (a forum post's starter has its thread's id).
        """
        chan = self.channels[channel_id]
        author = author or self.user
        bot_id = self.bot_user["id"]
        now = time.time()
        mid = message_id or snowflake(now)
        if mention_bot and mention_text:
            content = f"<@{bot_id}> {content}"
        if mention_role is not None:
            content = f"<@&{mention_role}> {content}"
        msg: dict[str, Any] = {
            "id": mid,
            "type": 0,
            "channel_id": channel_id,
            "author": author,
            "content": content,
            "timestamp": iso_now(now),
            "edited_timestamp": None,
            "tts": False,
            "mention_everyone": False,
            "mentions": ([dict(self.bot_user)] if mention_bot else [])
            + [dict(u) for u in mention_users or []],
            "mention_roles": [mention_role] if mention_role is not None else [],
            "attachments": attachments or [],
            "embeds": [],
            "pinned": False,
            "flags": 0,
            "components": [],
            "channel_type": chan["type"],
        }
        if stickers:
            msg["sticker_items"] = [
                {"id": snowflake(now), "name": name, "format_type": 1} for name in stickers
            ]
        if "guild_id" in chan:
            msg["guild_id"] = chan["guild_id"]
            msg["member"] = {"nick": nick, "roles": [], "joined_at": iso_now(now)}
        if chan["type"] in (10, 11, 12):
            msg["position"] = sum(
                1 for m in self.messages.values() if m["channel_id"] == channel_id
            )
        if reply_to is not None:
            target = self.messages.get(reply_to) if isinstance(reply_to, str) else reply_to
            target_id = reply_to if isinstance(reply_to, str) else reply_to["id"]
            target_channel = target["channel_id"] if target else channel_id
            msg["type"] = 19
            msg["message_reference"] = {
                "type": 0,
                "message_id": target_id,
                "channel_id": target_channel,
            }
            if "guild_id" in chan:
                msg["message_reference"]["guild_id"] = chan["guild_id"]
            if reference == "snapshot" and target is not None:
                msg["referenced_message"] = {
                    k: v for k, v in target.items() if k not in ("referenced_message", "member")
                }
            elif reference == "deleted":
                msg["referenced_message"] = None
                self.messages.pop(target_id, None)
        if forward is not None:
            msg["message_reference"] = {
                "type": 1,
                "message_id": forward["id"],
                "channel_id": forward["channel_id"],
            }
            if "guild_id" in forward:
                msg["message_reference"]["guild_id"] = forward["guild_id"]
            snapshot: dict[str, Any] = {
                k: forward[k]
                for k in ("type", "content", "embeds", "attachments", "timestamp", "flags")
                if k in forward
            }
            snapshot.update(
                edited_timestamp=None,
                mentions=forward.get("mentions", []),
                mention_roles=forward.get("mention_roles", []),
            )
            msg["message_snapshots"] = [{"message": snapshot}]
        self.messages[mid] = msg
        return msg

    async def user_message(self, channel_id: str, content: str, **kw: Any) -> dict[str, Any]:
        """Build a user message (see :meth:`message`) and dispatch MESSAGE_CREATE."""
        msg = self.message(channel_id, content, **kw)
        await self.dispatch("MESSAGE_CREATE", msg)
        return msg

    async def forum_post(self, title: str, content: str, **kw: Any) -> dict[str, Any]:
        """A user opens a post in :attr:`forum_channel`: THREAD_CREATE for the post's
        thread, then MESSAGE_CREATE for its starter message, which has the thread's id
        (developers/topics/threads.mdx, "Forums").  Returns the starter message."""
        thread_id = snowflake()
        thread: dict[str, Any] = {
            "id": thread_id,
            "type": 11,
            "guild_id": self.guild_id,
            "parent_id": self.forum_channel,
            "owner_id": (kw.get("author") or self.user)["id"],
            "name": title[:100],
            "newly_created": True,
        }
        self.channels[thread_id] = thread
        await self.dispatch("THREAD_CREATE", thread)
        return await self.user_message(thread_id, content, message_id=thread_id, **kw)

    async def press(
        self,
        message: dict[str, Any] | str,
        *,
        label: str | None = None,
        custom_id: str | None = None,
        user: dict[str, Any] | None = None,
        nick: str | None = None,
        delay_s: float = 0.0,
    ) -> FakeInteraction:
        """A user presses a button of a bot message (by ``label`` or ``custom_id``; the
        first button when neither is given): INTERACTION_CREATE, ``delay_s`` after the
        press.  Raises LookupError when the message has no such (enabled) button."""
        msg = self.messages[message if isinstance(message, str) else message["id"]]
        buttons = [c for row in msg.get("components", []) for c in row.get("components", [])]
        found = [
            b
            for b in buttons
            if (label is None or b.get("label") == label)
            and (custom_id is None or b.get("custom_id") == custom_id)
            and not b.get("disabled")
        ]
        if not found:
            raise LookupError(f"no button {label or custom_id!r} on message {msg['id']}")
        pressed = found[0]
        user = user or self.user
        chan = self.channels[msg["channel_id"]]
        now = time.time()
        inter = FakeInteraction(
            id=snowflake(now),
            token="aW50ZXJhY3Rpb246" + secrets.token_urlsafe(48),
            message_id=msg["id"],
            custom_id=pressed["custom_id"],
            user_id=str(user["id"]),
            made_at=trio.current_time(),
        )
        self.interactions[inter.id] = inter
        d: dict[str, Any] = {
            "id": inter.id,
            "application_id": self.bot_user["id"],
            "type": 3,
            "token": inter.token,
            "version": 1,
            "channel_id": msg["channel_id"],
            "channel": {"id": msg["channel_id"], "type": chan["type"]},
            "message": {k: v for k, v in msg.items() if k != "nonce"},
            "data": {"custom_id": pressed["custom_id"], "component_type": 2},
            "app_permissions": "2248473465835073",
            "locale": "en-US",
            "entitlements": [],
            "authorizing_integration_owners": {"0": chan.get("guild_id", "0")},
            "context": 0 if "guild_id" in chan else 1,
        }
        if "guild_id" in chan:
            d["guild_id"] = chan["guild_id"]
            d["guild_locale"] = "en-US"
            d["member"] = {"user": user, "nick": nick, "roles": [], "permissions": "0"}
        else:
            d["user"] = user
        if delay_s:
            await trio.sleep(delay_s)
        await self.dispatch("INTERACTION_CREATE", d)
        return inter

    async def dispatch(self, t: str, d: Any) -> None:
        """Append a dispatch to the current session and send it if connected."""
        session = self._current
        if session is None or not session.valid:
            self._pending.append((t, d))
            return
        self._dispatch_to(session, t, d)
        await trio.lowlevel.checkpoint()

    def _dispatch_to(self, session: _Session, t: str, d: Any) -> None:
        session.seq += 1
        frame = json.dumps({"op": 0, "t": t, "s": session.seq, "d": d}, separators=(",", ":"))
        session.log.append((session.seq, t, frame))
        conn = session.conn
        if conn is not None and conn.closed_by is None and conn.authenticated:
            conn.push("text", frame)
            if t == "MESSAGE_CREATE" and self._drop_after is not None:
                self._drop_after -= 1
                if self._drop_after <= 0:
                    self._drop_after = None
                    conn.push("drop")

    # -- gateway -----------------------------------------------------------------------

    async def _gateway(self, request: WebSocketRequest) -> None:
        ws = await request.accept()
        send, recv = trio.open_memory_channel[tuple[str, Any]](OUTBOX)
        path, _, query = request.path.partition("?")
        conn = GatewayConnection(
            len(self.connections), path, trio.current_time(), ws, send, query=query
        )
        if "zlib-stream" in parse_qs(query).get("compress", []):
            conn.zlib_stream = zlib.compressobj()
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
                    await self._on_frame(conn, data)
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

        async def send(text: str) -> None:
            if conn.zlib_stream is None:
                await ws.send_message(text)
            else:
                z = conn.zlib_stream
                await ws.send_message(z.compress(text.encode()) + z.flush(zlib.Z_SYNC_FLUSH))

        try:
            async for kind, value in recv:
                if kind == "frame":
                    await send(json.dumps(value, separators=(",", ":")))
                elif kind == "text":
                    await send(value)
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
                    # An abrupt TCP close without a websocket close frame.
                    await ws._stream.aclose()
                    return
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
            return

    async def _watchdog(self, conn: GatewayConnection) -> None:
        """Close a connection whose client stopped heartbeating (like Discord: 4009)."""
        while conn.closed_by is None:
            factor = self.heartbeat_timeout_factor
            interval = self.heartbeat_interval_ms / 1000
            if factor is None:
                await trio.sleep(interval)
                continue
            deadline = conn.last_beat_at + interval * factor + 0.5
            if trio.current_time() >= deadline:
                conn.push("close", (4009, "Session timed out"))
                return
            await trio.sleep_until(deadline)

    def _close(self, conn: GatewayConnection, code: int, reason: str) -> None:
        conn.push("close", (code, reason))

    async def _on_frame(self, conn: GatewayConnection, data: str | bytes) -> None:
        raw = data.encode() if isinstance(data, str) else data
        if len(raw) > MAX_SEND_BYTES:
            self._close(conn, 4002, "Decode error")
            return
        now = trio.current_time()
        conn.sends = [t for t in conn.sends if t > now - 60] + [now]
        if len(conn.sends) > 120:
            self._close(conn, 4008, "Rate limited")
            return
        try:
            frame = json.loads(raw)
            op = frame["op"]
            d = frame.get("d")
        except (ValueError, KeyError, TypeError):
            self._close(conn, 4002, "Decode error")
            return
        if op == 1:
            conn.last_beat_at = now
            self.heartbeats.append((now, d))
            self.changed()
            if self.ack_heartbeats:
                conn.push("frame", {"op": 11})
        elif op == 2:
            await self._identify(conn, d)
        elif op == 6:
            self._resume(conn, d)
        elif not conn.authenticated:
            self._close(conn, 4003, "Not authenticated")
        else:
            self._close(conn, 4001, "Unknown opcode")

    async def _identify(self, conn: GatewayConnection, d: Any) -> None:
        if conn.authenticated:
            self._close(conn, 4005, "Already authenticated")
            return
        record = {
            "at": trio.current_time(),
            "intents": d.get("intents") if isinstance(d, dict) else None,
            "properties": d.get("properties") if isinstance(d, dict) else None,
            "token_ok": isinstance(d, dict) and d.get("token") == self.token,
            "path": conn.path,
        }
        self.identifies.append(record)
        self.changed()
        if self.close_on_identify is not None:
            self._close(conn, self.close_on_identify, "Closed on identify")
            return
        if not record["token_ok"]:
            self._close(conn, 4004, "Authentication failed")
            return
        intents = record["intents"]
        if not isinstance(intents, int) or isinstance(intents, bool) or intents & ~VALID_INTENTS:
            self._close(conn, 4013, "Invalid intent(s)")
            return
        if intents & MESSAGE_CONTENT and not self.message_content_enabled:
            self._close(conn, 4014, "Disallowed intent(s)")
            return
        now = trio.current_time()
        self._identify_times = [t for t in self._identify_times if t > now - self.identify_window_s]
        if len(self._identify_times) >= self.max_concurrency:
            self.invalid_sessions += 1
            conn.push("frame", {"op": 9, "d": False})
            return
        self._identify_times.append(now)
        self.identify_remaining -= 1
        session = _Session(secrets.token_hex(16))
        self._sessions[session.id] = session
        self._current = session
        session.conn = conn
        conn.session = session
        conn.authenticated = True
        self._dispatch_to(
            session,
            "READY",
            {
                "v": 10,
                "user": self.bot_user,
                "guilds": [{"id": self.guild_id, "unavailable": True}],
                "session_id": session.id,
                "resume_gateway_url": f"{self.gateway_url}/resume",
                "shard": [0, 1],
                "application": {"id": self.bot_user["id"], "flags": 0},
            },
        )
        self.ready_count += 1
        self._dispatch_to(
            session,
            "GUILD_CREATE",
            {
                "id": self.guild_id,
                "name": "Fake Guild",
                "unavailable": False,
                "channels": [c for c in self.channels.values() if c["type"] in (0, 15)],
                "threads": [c for c in self.channels.values() if c["type"] in (10, 11, 12)],
                "members": [],
                "roles": [
                    {"id": self.guild_id, "name": "@everyone", "managed": False},
                    {
                        "id": self.bot_role,
                        "name": self.bot_user["username"],
                        "managed": True,
                        "tags": {"bot_id": self.bot_user["id"]},
                    },
                    {"id": self.other_role, "name": "helpers", "managed": False},
                ],
            },
        )
        pending, self._pending = self._pending, []
        for t, payload in pending:
            self._dispatch_to(session, t, payload)
        for _ in range(self.flood_on_ready):
            self._dispatch_to(session, "MESSAGE_CREATE", self.message(self.dm_channel, "ping"))
        self.changed()

    def _resume(self, conn: GatewayConnection, d: Any) -> None:
        ok = isinstance(d, dict)
        session = self._sessions.get(d.get("session_id", "")) if isinstance(d, dict) else None
        seq = d.get("seq") if isinstance(d, dict) else None
        self.resumes.append(
            {
                "at": trio.current_time(),
                "session_id": d.get("session_id") if ok else None,
                "seq": seq,
                "path": conn.path,
                "token_ok": ok and d.get("token") == self.token,
            }
        )
        self.changed()
        if not ok or d.get("token") != self.token:
            self._close(conn, 4004, "Authentication failed")
            return
        if (
            session is None
            or not session.valid
            or session is not self._current
            or not isinstance(seq, int)
            or seq > session.seq
        ):
            self.invalid_sessions += 1
            conn.push("frame", {"op": 9, "d": False})
            return
        old = session.conn
        if old is not None and old is not conn and old.closed_by is None:
            old.push("close", (4000, "Session resumed elsewhere"))
        session.conn = conn
        conn.session = session
        conn.authenticated = True
        start = max(0, seq - self.replay_on_resume)
        for s, t, frame in session.log:
            if s > start and t not in ("READY", "RESUMED"):  # never replayed by Discord
                conn.push("text", frame)
        self._dispatch_to(session, "RESUMED", None)
        self.resumed_count += 1
        self.changed()

    # -- REST --------------------------------------------------------------------------

    async def _http(self, request: Request) -> Response:
        path = request.path
        if not path.startswith(API_PREFIX):
            if path.startswith("/attachments/"):
                return Response(200, b"\x89PNG\r\n\x1a\nfake", [("content-type", "image/png")])
            return _error(404, 0, "404: Not Found")
        rel = path[len(API_PREFIX) :] or "/"
        try:
            body = request.json() if request.body else None
        except ValueError:
            body = None
        headers = {k: v for k, v in request.headers if k != "authorization"}
        callback = _CALLBACK.match(rel) if request.method == "POST" else None
        if callback is not None:
            return await self._interaction_callback(body, headers, **callback.groupdict())
        for method, pattern, template, handler in _ROUTES:
            match = pattern.match(rel)
            if match is None or method != request.method:
                continue
            major = match.groupdict().get("channel", "")
            op = f"{method} {template}"
            delay = self.route_latency.get(op, self.latency_s)
            if delay:
                await trio.sleep(delay)
            try:
                fault = await self.faults_for(op)
            except DropConnection:
                self.record(RestCall(method, rel, body, 0, trio.current_time(), headers))
                raise
            # A scripted fault answers before anything else (a failing Discord checks nothing).
            if fault is not None:
                response: Response | None = _fault_response(fault)
            else:
                response = self._precheck(request, rel, method, template, major)
            if response is None:
                try:
                    response = getattr(self, handler)(body, **match.groupdict())
                except (KeyError, TypeError, AttributeError) as exc:
                    response = _error(400, 50035, f"Invalid Form Body ({type(exc).__name__})")
            break
        else:
            response = _error(404, 0, "404: Not Found")
            template, major = rel, ""
        self._add_bucket_headers(response, request.method, template, major)
        self.record(
            RestCall(request.method, rel, body, response.status, trio.current_time(), headers)
        )
        op = f"{request.method} {template}"
        lost = self._lost_responses.get(op.lower(), 0)
        if lost or self.losing(op):  # processed, but the answer never reaches the bot
            if lost:
                self._lost_responses[op.lower()] = lost - 1
            raise DropConnection(template)
        return response

    def _precheck(
        self, request: Request, rel: str, method: str, template: str, major: str
    ) -> Response | None:
        if request.header("authorization") != f"Bot {self.token}":
            return _error(401, 0, "401: Unauthorized")
        now = trio.current_time()
        if self._global_until > now:
            return _rate_limited(self._global_until - now, True)
        for rule in self._rate_rules:
            if rule.count <= 0:
                continue
            if rule.method is not None and rule.method != method:
                continue
            if rule.route is not None and not rule.route.search(rel):
                continue
            rule.count -= 1
            if rule.is_global:
                self._global_until = now + rule.retry_after
            return _rate_limited(rule.retry_after, rule.is_global)
        self._rate_rules = [r for r in self._rate_rules if r.count > 0]
        limit = self.bucket_limits.get(f"{method} {template}")
        if limit is not None:
            bucket = self._bucket(method, template, major, now)
            if bucket.remaining <= 0:
                return _rate_limited(bucket.reset_at - now, False)
            bucket.remaining -= 1
        return None

    def _bucket(self, method: str, template: str, major: str, now: float) -> _Bucket:
        limit, window = self.bucket_limits.get(f"{method} {template}", (50, 1.0))
        key = (f"{method} {template}", major)
        bucket = self._buckets.get(key)
        if bucket is None or bucket.reset_at <= now:
            bucket = self._buckets[key] = _Bucket(limit, now + window)
        return bucket

    def _add_bucket_headers(
        self, response: Response, method: str, template: str, major: str
    ) -> None:
        now = trio.current_time()
        limit, _ = self.bucket_limits.get(f"{method} {template}", (50, 1.0))
        bucket = self._bucket(method, template, major, now)
        if f"{method} {template}" not in self.bucket_limits and response.status != 429:
            bucket.remaining = max(0, bucket.remaining - 1)
        after = max(0.0, bucket.reset_at - now)
        response.headers += [
            ("x-ratelimit-limit", str(limit)),
            ("x-ratelimit-remaining", str(max(0, bucket.remaining))),
            ("x-ratelimit-reset", f"{time.time() + after:.3f}"),
            ("x-ratelimit-reset-after", f"{after:.3f}"),
            ("x-ratelimit-bucket", _bucket_hash(method, template)),
        ]

    async def _interaction_callback(
        self, body: Any, headers: dict[str, str], id: str, token: str
    ) -> Response:
        """``POST /interactions/{id}/{token}/callback`` (no bot token needed: the
        interaction token authenticates it)."""
        delay = self.route_latency.get(CALLBACK_OP, self.latency_s)
        if delay:
            await trio.sleep(delay)
        now = trio.current_time()
        inter = self.interactions.get(id)
        fault = await self.faults_for(CALLBACK_OP)
        if fault is not None:
            response = _fault_response(fault)
        elif inter is None:
            response = _error(404, 10062, "Unknown interaction")
        elif not secrets.compare_digest(token, inter.token):
            response = _error(401, 50027, "Invalid Webhook Token")
        elif now - inter.made_at > self.interaction_window_s:
            response = _error(404, 10062, "Unknown interaction")
        elif inter.answered:
            response = _error(400, 40060, "Interaction has already been acknowledged.")
        else:
            response = self._answer_interaction(inter, body)
        if inter is not None:
            inter.callbacks.append((now, body, response.status))
        rel = f"/interactions/{id}/{{token}}/callback"
        self.record(RestCall("POST", rel, body, response.status, now, headers))
        return response

    def _answer_interaction(self, inter: FakeInteraction, body: Any) -> Response:
        kind = body.get("type") if isinstance(body, dict) else None
        if kind == 6:
            inter.answered = True
            return Response(204)
        if kind != 7:
            return _error(400, 50035, "Invalid Form Body (type)")
        data = body.get("data")
        msg = self.messages.get(inter.message_id)
        if not isinstance(data, dict) or msg is None:
            return _error(400, 50035, "Invalid Form Body (data)")
        bad = self._apply_edit(msg, data)
        if bad is not None:
            return bad
        inter.answered = True
        return Response(204)

    def _apply_edit(self, msg: dict[str, Any], body: dict[str, Any]) -> Response | None:
        """Apply ``content`` / ``components`` of an edit; an error response, or None."""
        content = body.get("content")
        if content is not None and (not isinstance(content, str) or len(content) > MAX_CONTENT):
            return _error(400, 50035, "Invalid Form Body (content)")
        if "components" in body:
            problem = _components_problem(body["components"])
            if problem is not None:
                return _error(400, 50035, f"Invalid Form Body (components: {problem})")
            msg["components"] = body["components"]
        if content is not None:
            msg["content"] = content
            msg["edited_timestamp"] = iso_now()
            self.edits.setdefault(msg["id"], []).append(content)
        return None

    def _get_me(self, body: Any) -> Response:
        return json_response(self.bot_user)

    def _get_gateway_bot(self, body: Any) -> Response:
        return json_response(
            {
                "url": self.gateway_url,
                "shards": 1,
                "session_start_limit": {
                    "total": self.identify_total,
                    "remaining": max(0, self.identify_remaining),
                    "reset_after": self.identify_reset_after_ms,
                    "max_concurrency": self.max_concurrency,
                },
            }
        )

    def _get_message(self, body: Any, channel: str, message: str) -> Response:
        if channel not in self.channels:
            return _error(404, 10003, "Unknown Channel")
        if channel in self.forbidden:
            code = self.forbidden[channel]
            return _error(403, code, "Missing Access" if code == 50001 else "Missing Permissions")
        msg = self.messages.get(message)
        if msg is None or msg["channel_id"] != channel:
            return _error(404, 10008, "Unknown Message")
        out = {
            k: v
            for k, v in msg.items()
            if k not in ("member", "guild_id", "channel_type", "position")
        }
        if not self.message_content_enabled and msg["author"]["id"] != self.bot_user["id"]:
            out["content"] = ""
        return json_response(out)

    def _create_message(self, body: Any, channel: str) -> Response:
        if channel not in self.channels:
            return _error(404, 10003, "Unknown Channel")
        if not isinstance(body, dict):
            return _error(400, 50035, "Invalid Form Body")
        content = body.get("content", "")
        if not isinstance(content, str) or not content or len(content) > MAX_CONTENT:
            return _error(400, 50035, "Invalid Form Body (content)")
        ref = body.get("message_reference")
        if self.forbidden.get(channel) == 50001:
            return _error(403, 50001, "Missing Access")
        if self.forbidden.get(channel) == 50013 and isinstance(ref, dict):
            return _error(400, 160002, "Cannot reply without permission to read message history")
        problem = _components_problem(body.get("components", []))
        if problem is not None:
            return _error(400, 50035, f"Invalid Form Body (components: {problem})")
        nonce = body.get("nonce")
        if body.get("enforce_nonce") and nonce is not None:
            existing = self._nonces.get((channel, str(nonce)))
            if existing is not None and existing in self.messages:
                return json_response(self.messages[existing])
        chan = self.channels[channel]
        now = time.time()
        allowed = body.get("allowed_mentions")
        pinged = allowed.get("users", []) if isinstance(allowed, dict) else []
        msg: dict[str, Any] = {
            "id": snowflake(now),
            "type": 0,
            "channel_id": channel,
            "author": self.bot_user,
            "content": content,
            "timestamp": iso_now(now),
            "edited_timestamp": None,
            "tts": False,
            "mention_everyone": False,
            "mentions": [{"id": u} for u in pinged if f"<@{u}>" in content],
            "mention_roles": [],
            "attachments": [],
            "embeds": [],
            "pinned": False,
            "flags": 0,
            "components": body.get("components", []),
        }
        if isinstance(ref, dict) and ref.get("message_id"):
            target = self.messages.get(str(ref["message_id"]))
            if target is None and ref.get("fail_if_not_exists", True):
                return _error(400, 50035, "Invalid Form Body (message_reference: Unknown message)")
            if target is not None:
                msg["type"] = 19
                msg["message_reference"] = {
                    "type": 0,
                    "message_id": target["id"],
                    "channel_id": channel,
                }
                msg["referenced_message"] = {
                    k: v for k, v in target.items() if k not in ("referenced_message", "member")
                }
        if nonce is not None:
            msg["nonce"] = nonce
            self._nonces[(channel, str(nonce))] = msg["id"]
        self.messages[msg["id"]] = msg
        self.edits[msg["id"]] = [content]
        echo = dict(msg)
        echo["channel_type"] = chan["type"]
        if "guild_id" in chan:
            echo["guild_id"] = chan["guild_id"]
        if self._current is not None and self._current.valid:
            self._dispatch_to(self._current, "MESSAGE_CREATE", echo)
        return json_response(msg)

    def _edit_message(self, body: Any, channel: str, message: str) -> Response:
        msg = self.messages.get(message)
        if msg is None or msg["channel_id"] != channel:
            return _error(404, 10008, "Unknown Message")
        if msg["author"]["id"] != self.bot_user["id"]:
            return _error(403, 50005, "Cannot edit a message authored by another user")
        if not isinstance(body, dict):
            return _error(400, 50035, "Invalid Form Body")
        return self._apply_edit(msg, body) or json_response(msg)

    def _start_thread(self, body: Any, channel: str, message: str) -> Response:
        """A thread on a message: a public thread whose id is the message's id."""
        parent = self.channels.get(channel)
        target = self.messages.get(message)
        if parent is None or target is None or target["channel_id"] != channel:
            return _error(404, 10008, "Unknown Message")
        if parent["type"] in (10, 11, 12):
            return _error(400, 50024, "Cannot execute action on this channel type")
        if message in self.channels:
            return _error(400, 160004, "A thread has already been created for this message")
        name = body.get("name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not 1 <= len(name) <= 100:
            return _error(400, 50035, "Invalid Form Body (name)")
        thread: dict[str, Any] = {
            "id": message,
            "type": 11,
            "parent_id": channel,
            "name": name,
        }
        if "guild_id" in parent:
            thread["guild_id"] = parent["guild_id"]
        self.channels[message] = thread
        return json_response(thread)

    def _get_user(self, body: Any, user: str) -> Response:
        """A user the fake knows: the default user, the authors and mentions it saw, or
        :attr:`known_users`."""
        found = self.known_users.get(user)
        if found is None and user == self.user["id"]:
            found = self.user
        if found is None:
            for msg in self.messages.values():
                for u in [msg.get("author") or {}, *msg.get("mentions", [])]:
                    if u.get("id") == user:
                        found = u
        if found is None:
            return _error(404, 10013, "Unknown User")
        return json_response(found)

    def _open_dm(self, body: Any) -> Response:
        """The DM channel with a user (one per user)."""
        recipient = body.get("recipient_id") if isinstance(body, dict) else None
        if not isinstance(recipient, str) or not recipient.isdigit():
            return _error(400, 50035, "Invalid Form Body (recipient_id)")
        channel_id = self.dm_channels.get(recipient)
        if channel_id is None:
            channel_id = snowflake()
            self.dm_channels[recipient] = channel_id
            self.channels[channel_id] = {"id": channel_id, "type": 1}
        return json_response({"id": channel_id, "type": 1, "recipients": [{"id": recipient}]})

    def _typing(self, body: Any, channel: str) -> Response:
        if channel not in self.channels:
            return _error(404, 10003, "Unknown Channel")
        return Response(204)


def _components_problem(rows: Any) -> str | None:
    """What is wrong with a message's ``components`` (action rows of buttons), or None."""
    if not isinstance(rows, list) or len(rows) > 5:
        return "at most 5 action rows"
    ids: set[str] = set()
    for row in rows:
        if not isinstance(row, dict) or row.get("type") != 1:
            return "not an action row"
        buttons = row.get("components")
        if not isinstance(buttons, list) or not 1 <= len(buttons) <= 5:
            return "1-5 buttons per row"
        for b in buttons:
            if not isinstance(b, dict) or b.get("type") != 2 or b.get("style") not in (1, 2, 3, 4):
                return "not a button"
            label, custom_id = b.get("label"), b.get("custom_id")
            if not isinstance(label, str) or not 1 <= len(label) <= 80:
                return "label: 1-80 characters"
            if not isinstance(custom_id, str) or not 1 <= len(custom_id) <= 100:
                return "custom_id: 1-100 characters"
            if custom_id in ids:
                return "custom_id: duplicate"
            ids.add(custom_id)
    return None


def _bucket_hash(method: str, template: str) -> str:
    return f"{abs(hash((method, template))) % 16**12:012x}"


def _fault_response(fault: Fault) -> Response:
    """A scripted ``fail_next`` fault in Discord's error shape (``code=`` sets the JSON code)."""
    if fault.status == 429:
        return _rate_limited(
            fault.retry_after if fault.retry_after is not None else 1.0,
            bool(fault.extra.get("is_global", False)),
        )
    code = int(fault.extra.get("code", 0))
    return _error(fault.status, code, fault.description or f"{fault.status}: scripted failure")


def _error(status: int, code: int, message: str) -> Response:
    return json_response({"message": message, "code": code}, status=status)


def _rate_limited(retry_after: float, is_global: bool) -> Response:
    retry_after = max(0.0, retry_after)
    response = json_response(
        {
            "message": "You are being rate limited.",
            "retry_after": round(retry_after, 3),
            "global": is_global,
        },
        status=429,
    )
    response.headers += [
        ("retry-after", str(max(1, math.ceil(retry_after)))),
        ("x-ratelimit-scope", "global" if is_global else "user"),
    ]
    if is_global:
        response.headers.append(("x-ratelimit-global", "true"))
    return response


@asynccontextmanager
async def open_fake_discord(
    *, host: str = "127.0.0.1", port: int = 0, **kwargs: Any
) -> AsyncIterator[FakeDiscord]:
    """Run a fake Discord (REST + gateway on 127.0.0.1, kernel-chosen ports) for the block."""
    fake = FakeDiscord(**kwargs)

    async def gateway(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_websocket(fake._gateway, host, 0, None, task_status=task_status)

    async def http(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_http(fake._http, host=host, port=port, task_status=task_status)

    async with open_servers(http, gateway) as (http_server, ws_server):
        fake.http_url = http_server.url
        fake.api_base = http_server.url + API_PREFIX
        fake.gateway_url = f"ws://{host}:{ws_server.port}"
        yield fake


def bench_identity() -> dict[str, str]:
    """A bot id and a token of Discord's shape (hikari reads the id from its first part)."""
    bot_id = snowflake()
    token = base64.b64encode(bot_id.encode()).decode().rstrip("=") + ".fake.bench-only"
    return {"token": token, "bot_id": bot_id}


def _open_for_bench() -> AbstractAsyncContextManager[FakeDiscord]:
    identity = bench_identity()
    return open_fake_discord(token=identity["token"], bot_id=identity["bot_id"])


#: How the idle bench runs this fake (with a token of Discord's shape, as the peers need):
#: the bot's first contact is READY.
IDLE_BENCH: IdleBench[FakeDiscord] = IdleBench(
    _open_for_bench,
    lambda f: {"token": f.token, "api_base": f.api_base},
    lambda f: f.ready_count > 0,
)


def main(argv: list[str] | None = None) -> None:
    """Run the fake as a process (see :mod:`dshim.testing.fakes.cli`); ``--flood n``
    (benchmarks) dispatches n MESSAGE_CREATEs after every READY and prints one JSON line."""
    module = "dshim.testing.fakes.discord"
    p = cli.parser(
        __doc__, module=module, flood="MESSAGE_CREATEs after each READY (benchmarks; prints JSON)"
    )
    p.add_argument("--heartbeat-ms", type=float, default=41250, metavar="MS")
    p.add_argument("--token", default="fake-discord-token", metavar="TOKEN")
    args = p.parse_args(argv)

    def announce(fake: FakeDiscord) -> cli.Announcement:
        if args.flood is not None:
            fake.flood_on_ready = args.flood
            fake.identify_window_s = 0.0
        settings = {"token": fake.token, "api_base": fake.api_base, "gateway_url": fake.gateway_url}
        notes = {"bot_id": str(fake.bot_user["id"]), "dm_channel": str(fake.dm_channel)}
        line = {**settings, "bot_id": fake.bot_user["id"]}
        return cli.Announcement(
            "Discord REST + Gateway", fake.api_base, "discord", settings, notes, line
        )

    cli.run(
        args,
        module=module,
        open_fake=lambda: open_fake_discord(
            host=args.host,
            port=args.port,
            token=args.token,
            heartbeat_interval_ms=args.heartbeat_ms,
        ),
        announce=announce,
        json_line=args.flood is not None,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
