"""The web chat under test: dshim serving it on 127.0.0.1 port 0, and a scripted tab.

:func:`serving` runs what ``dshim serve`` runs for a web chat bot — the real SQLite store,
the local HTTP endpoint (hypercorn on port 0) and ``serve_bots`` with the echo harness.
:class:`ChatClient` is a tab as a script sees it: one websocket (trio-websocket), the
frames of the README, and the page's reconnect rule (reconnect with backoff, join again,
send again what was not ``accepted``).  It records every frame it received, so tests
assert what a user would see.  :class:`WebchatRig` plugs both into the shared channel
scenarios (``tests/channel_contract.py``).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import functools
import itertools
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio
from trio_websocket import (
    ConnectionClosed,
    HandshakeError,
    WebSocketConnection,
    wrap_client_stream,
)

from dshim.channels.base import BotHost, Channel, HttpHandler, WebSocketHandler
from dshim.channels.webchat import channel as webchat_channel
from dshim.config import parse_config
from dshim.harness.base import Harness
from dshim.http.app import Endpoint
from dshim.http.server import serve_endpoint
from dshim.serve import serve_bots
from dshim.store import open_store
from dshim.store.base import Store
from tests.channel_contract import BOT, REPLY_NOTE, Answer

Frame = dict[str, Any]
REPLY_KEYS = ("messageId", "authorId", "authorName", "content", "attachments", "unavailableReason")


def source_block(kind: str = "direct", user: str = "u-ann", name: str = "Ann") -> str:
    """The ``<dsh_im_source>`` block of a web chat user."""
    block = {"channel": "webchat", "conversationType": kind, "senderId": user, "senderName": name}
    return "<dsh_im_source>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_source>"


def reply_block(**fields: Any) -> str:
    """The exact ``<dsh_im_reply_to>`` block with these fields (keys in the fixed order)."""
    given: dict[str, Any] = {"attachments": [], **fields}
    obj = {"note": REPLY_NOTE} | {k: given[k] for k in REPLY_KEYS if k in given}
    text = json.dumps(obj | {"truncated": False}, ensure_ascii=False, separators=(",", ":"))
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f"<dsh_im_reply_to>{text}</dsh_im_reply_to>"


def bot_quote(message_id: str, content: str, bot: str = "web") -> str:
    """The reply block of a quote of the bot's answer."""
    return reply_block(messageId=message_id, authorId=f"bot:{bot}", authorName=bot, content=content)


# --- the scripted tab ------------------------------------------------------------------------


@contextlib.contextmanager
def _the_error() -> Iterator[None]:
    """The one real error out of the socket's nursery (trio-websocket's reader task may add
    its own cancellation to it; cancellation is level-triggered, so it comes back anyway)."""
    try:
        yield
    except BaseExceptionGroup as group:
        real = [e for e in group.exceptions if not isinstance(e, trio.Cancelled)]
        if len(real) == 1:
            raise real[0] from None
        if not real and len(group.exceptions) == 1:
            raise group.exceptions[0] from None
        raise


@asynccontextmanager
async def open_socket(
    url: str, headers: Sequence[tuple[bytes, bytes]] = ()
) -> AsyncIterator[tuple[WebSocketConnection, trio.SocketStream]]:
    """A client websocket on a TCP stream we own (trio-websocket's ``open_websocket_url``
    leaves the socket open after a refused upgrade, see dshim/channels/kit/ws.py); the
    stream too, so a test can drop the connection the hard way."""
    rest = url.split("://", 1)[1]
    hostport, _, path = rest.partition("/")
    host, _, port = hostport.rpartition(":")
    stream = await trio.open_tcp_stream(host, int(port))
    try:
        with _the_error():
            async with trio.open_nursery() as nursery:
                ws = await wrap_client_stream(
                    nursery, stream, hostport, "/" + path, extra_headers=list(headers)
                )
                try:
                    yield ws, stream
                finally:
                    with trio.CancelScope(shield=True), trio.move_on_after(5):
                        await ws.aclose()
                    nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await stream.aclose()


@dataclass
class Seen:
    """One message as a tab saw it: every text it showed, and whether it ended."""

    id: str
    conversation: str
    author: dict[str, Any]
    reply_to: str | None
    texts: list[str] = field(default_factory=list)
    final: bool = False
    files: list[dict[str, Any]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.texts[-1] if self.texts else ""

    @property
    def bot(self) -> bool:
        return bool(self.author.get("bot"))


class ChatClient:
    """A scripted tab (see the module docstring).  Use inside :meth:`running`."""

    def __init__(
        self,
        url: str,
        *,
        user: tuple[str, str] = ("u-ann", "Ann"),
        headers: Sequence[tuple[bytes, bytes]] = (),
        reconnect_s: float = 0.2,
    ) -> None:
        self.url = url
        self.user = {"id": user[0], "name": user[1]}
        self.headers = list(headers)
        self.reconnect_s = reconnect_s
        self.frames: list[Frame] = []
        self.messages: dict[str, Seen] = {}
        self.accepted: dict[str, str] = {}
        self.errors: list[Frame] = []
        self.interactions: dict[str, Frame] = {}
        self.closed_interactions: set[str] = set()
        self.joined: dict[str, str] = {}
        self.unacked: dict[str, Frame] = {}
        self.last_sent: Frame | None = None
        self.connections = 0
        self.ws: WebSocketConnection | None = None
        self._stream: trio.SocketStream | None = None
        self.paused_until = 0.0
        self._ids = itertools.count(1)
        self._changed = trio.Event()

    # -- running -------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ChatClient]:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._run)
            try:
                yield self
            finally:
                nursery.cancel_scope.cancel()

    async def _run(self) -> None:
        while True:
            try:
                async with open_socket(self.url, self.headers) as (ws, stream):
                    self.ws, self._stream = ws, stream
                    self.connections += 1
                    for conversation, kind in list(self.joined.items()):
                        await self._send(self._join_frame(conversation, kind))
                    for frame in list(self.unacked.values()):
                        await self._send(frame)
                    self._wake()
                    while True:
                        if trio.current_time() < self.paused_until:
                            await trio.sleep_until(self.paused_until)
                        self._on_frame(json.loads(await ws.get_message()))
            except (ConnectionClosed, HandshakeError, OSError):
                pass
            self.ws = None
            self._wake()
            await trio.sleep(self.reconnect_s)

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    async def _send(self, frame: Frame) -> None:
        if self.ws is not None:
            try:
                await self.ws.send_message(json.dumps(frame))
            except ConnectionClosed:
                pass

    async def send_raw(self, data: str | bytes) -> None:
        await self.wait_until(lambda: self.ws is not None)
        assert self.ws is not None
        await self.ws.send_message(data)

    # -- frames in -------------------------------------------------------------------------

    def _on_frame(self, frame: Frame) -> None:
        self.frames.append(frame)
        kind = frame.get("type")
        if kind == "message":
            self._on_message(frame)
        elif kind == "history":
            for message in frame["messages"]:
                self._on_message(message)
        elif kind == "accepted":
            self.accepted[frame["client_id"]] = frame["id"]
            self.unacked.pop(frame["client_id"], None)
        elif kind == "error":
            self.errors.append(frame)
        elif kind == "interaction":
            self.interactions[frame["id"]] = frame
        elif kind == "interaction_closed":
            self.closed_interactions.add(frame["id"])
        self._wake()

    def _on_message(self, frame: Frame) -> None:
        seen = self.messages.get(frame["id"])
        if seen is None:
            seen = self.messages[frame["id"]] = Seen(
                frame["id"], frame["conversation"], frame["author"], frame["reply_to"]
            )
        if not seen.texts or seen.texts[-1] != frame["text"]:
            seen.texts.append(frame["text"])
        seen.final = seen.final or bool(frame["final"])
        seen.files = frame.get("files", [])

    # -- frames out ------------------------------------------------------------------------

    def _join_frame(self, conversation: str, kind: str) -> Frame:
        return {"type": "join", "conversation": conversation, "kind": kind, "user": self.user}

    async def join(self, conversation: str, kind: str = "direct") -> Frame:
        """Join and wait for the conversation's history frame."""
        self.joined[conversation] = kind
        await self.wait_until(lambda: self.ws is not None)
        n = len(self.frames)
        await self._send(self._join_frame(conversation, kind))
        return await self.next_frame("history", after=n)

    async def next_frame(self, kind: str, *, after: int = 0) -> Frame:
        def found() -> Frame | None:
            return next((f for f in self.frames[after:] if f.get("type") == kind), None)

        await self.wait_until(lambda: found() is not None)
        frame = found()
        assert frame is not None
        return frame

    async def send(
        self,
        conversation: str,
        text: str,
        *,
        reply_to: str | None = None,
        files: Sequence[tuple[str, str, bytes]] = (),
        client_id: str | None = None,
        wait: bool = True,
    ) -> str:
        """Send a message; returns its id once ``accepted`` (or its client_id, ``wait=False``)."""
        cid = client_id or f"k{next(self._ids)}"
        frame = {
            "type": "send",
            "client_id": cid,
            "conversation": conversation,
            "text": text,
            "reply_to": reply_to,
            "files": [
                {"name": n, "mime": mime, "data_b64": base64.b64encode(data).decode()}
                for n, mime, data in files
            ],
        }
        self.unacked[cid] = frame
        self.last_sent = frame
        await self.wait_until(lambda: self.ws is not None)
        await self._send(frame)
        if not wait:
            return cid
        await self.wait_until(lambda: cid in self.accepted or self._error_for(cid) is not None)
        error = self._error_for(cid)
        if error is not None and cid not in self.accepted:
            raise AssertionError(f"send refused: {error}")
        return self.accepted[cid]

    def _error_for(self, client_id: str) -> Frame | None:
        return next((e for e in self.errors if e.get("client_id") == client_id), None)

    async def answer(self, conversation: str, interaction: str, option: str) -> str:
        cid = f"k{next(self._ids)}"
        frame = {
            "type": "answer",
            "client_id": cid,
            "conversation": conversation,
            "interaction": interaction,
            "option": option,
        }
        self.unacked[cid] = frame
        await self._send(frame)
        await self.wait_until(lambda: cid in self.accepted or self._error_for(cid) is not None)
        return self.accepted.get(cid, "")

    async def drop(self, *, resend_last: bool = True) -> None:
        """The connection drops (no closing handshake); the tab reconnects by itself and,
        like a page that may have missed the ``accepted``, sends its last message again."""
        stream, before = self._stream, self.connections
        if resend_last and self.last_sent is not None:
            self.unacked[self.last_sent["client_id"]] = self.last_sent
        if stream is not None:
            await stream.aclose()
        await self.wait_until(lambda: self.connections > before and self.ws is not None)

    # -- what the chat shows --------------------------------------------------------------------

    def in_conversation(self, conversation: str, *, bot: bool | None = None) -> list[Seen]:
        return [
            s
            for s in self.messages.values()
            if s.conversation == conversation and (bot is None or s.bot == bot)
        ]

    def bot_texts(self, conversation: str) -> list[str]:
        return [s.text for s in self.in_conversation(conversation, bot=True)]

    def bot_frames(self, conversation: str) -> list[Frame]:
        """Frames about the bot's own messages and requests (not the transport's)."""
        out = []
        for f in self.frames:
            if f.get("conversation") != conversation:
                continue
            if f.get("type") in ("interaction", "typing") or (
                f.get("type") == "message" and f["author"]["bot"]
            ):
                out.append(f)
        return out


# --- dshim serving the web chat ----------------------------------------------------------------


@dataclass
class Served:
    url: str
    store: Store
    endpoint: Endpoint
    results: dict[str, str]

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://", 1) + "/ws"


@asynccontextmanager
async def serving(
    data_dir: Path,
    *,
    harness: Harness | None = None,
    bot: dict[str, Any] | None = None,
    listen: str = "127.0.0.1:0",
    grace_s: float = 10.0,
    inline: bool = True,
    token: str | None = None,
) -> AsyncIterator[Served]:
    """``dshim serve`` with one web chat bot ``web`` (the root bot) on ``listen``
    (with ``token``, the endpoint requires it: the page signs in through the login form)."""
    table = {"name": "web", "channel": "webchat", **(bot or {})}
    config = parse_config({"dshim": {"shutdown_grace_s": grace_s}, "bots": [table]}, env={})
    endpoint = Endpoint(token=token)
    endpoint.root_bot = table["name"]
    results: dict[str, str] = {}
    async with open_store(data_dir, inline=inline) as store, trio.open_nursery() as nursery:
        stop_http = trio.Event()
        binds = await nursery.start(
            functools.partial(serve_endpoint, endpoint, listen, shutdown=stop_http)
        )
        shutdown = trio.Event()
        done = trio.Event()

        async def bots(task_status: trio.TaskStatus[None]) -> None:
            results.update(
                await serve_bots(
                    config,
                    store,
                    shutdown=shutdown,
                    harness=harness,
                    endpoint=endpoint,
                    task_status=task_status,
                )
            )
            done.set()

        await nursery.start(bots)
        try:
            yield Served(binds[0], store, endpoint, results)
        finally:
            shutdown.set()
            with trio.move_on_after(grace_s + 30):
                await done.wait()
            stop_http.set()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


# --- the shared scenarios ------------------------------------------------------------------------

DM = "dm-1"
ROOM = "room-1"
SECRET = "wc-bearer-3f9a1c7e5b2d4a68"


class _EndpointHost:
    """The serve host of the scenarios' bot, mounting on the rig's endpoint (the shared
    scenarios run ``serve_bots`` without one) — or on none, like ``enabled = false``."""

    def __init__(self, host: BotHost, endpoint: Endpoint | None) -> None:
        self._host = host
        self._endpoint = endpoint

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)

    def mount(self, path: str, handler: HttpHandler) -> None:
        if self._endpoint is None:
            self._host.mount(path, handler)  # raises the ConfigError the host has for this
        else:
            self._endpoint.mount(self._host.bot.name, path, handler)

    def mount_websocket(self, path: str, handler: WebSocketHandler) -> None:
        if self._endpoint is None:
            self._host.mount_websocket(path, handler)
        else:
            self._endpoint.mount_websocket(self._host.bot.name, path, handler)


class WebchatRig:
    """The web chat under the shared scenarios (see ``tests/channel_contract.py``).

    What the scenarios' platform words mean here: the "fake platform" is the endpoint and
    one scripted tab (user ``u-ann``, "Ann") that has joined a direct conversation and a
    room; a "platform call" is a frame about the bot's own messages (``message`` from the
    bot, ``typing``, ``interaction``) — ``accepted`` and the tab's own message shown back
    are the transport; the "credential" is the endpoint's bearer token the tab sends with
    the upgrade (it must never be logged); a "rejected credential" is a bot that cannot
    mount its page ([http] disabled); "the connection drops" is the tab's socket dropping,
    after which it reconnects and sends its last message again; "429s" are a tab that
    stops reading for that long.
    """

    def __init__(self) -> None:
        self.endpoint: Endpoint | None = None
        self.url = ""
        self.client: ChatClient | None = None
        self.runs = 0
        self._no_endpoint = False
        self._channel = dataclasses.replace(webchat_channel.CHANNEL, run_fn=self._run)

    async def _run(
        self, host: BotHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        self.runs += 1
        endpoint = None if self._no_endpoint else self.endpoint
        await webchat_channel.run(_EndpointHost(host, endpoint), task_status=task_status)

    @property
    def tab(self) -> ChatClient:
        assert self.client is not None, "use the rig inside rig.open()"
        return self.client

    @property
    def channel(self) -> Channel:
        return self._channel

    @property
    def secret(self) -> str:
        return SECRET

    @property
    def bot_author(self) -> tuple[str, str]:
        return f"bot:{BOT}", BOT

    @asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        self.endpoint = Endpoint()
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            binds = await nursery.start(
                functools.partial(serve_endpoint, self.endpoint, "127.0.0.1:0", shutdown=stop)
            )
            self.url = binds[0].replace("http://", "ws://", 1) + f"/hooks/{BOT}/ws"
            headers = [
                (b"authorization", f"Bearer {SECRET}".encode()),
                (b"cookie", f"dshim_token={SECRET}".encode()),
            ]
            self.client = ChatClient(self.url, headers=headers)
            self.client.joined = {DM: "direct", ROOM: "room"}
            async with self.client.running():
                try:
                    yield
                finally:
                    stop.set()

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        self._no_endpoint = not valid_credentials
        return {}

    async def receiving(self) -> None:
        tab = self.tab
        await tab.wait_until(
            lambda: (
                tab.ws is not None
                and sum(1 for f in tab.frames if f.get("type") == "history") >= 2 * tab.connections
            )
        )

    def source(self, kind: str) -> str:
        return source_block(kind)

    async def user_dm(self, text: str, *, reply_to: str | None = None) -> str:
        return await self.tab.send(DM, text, reply_to=reply_to)

    async def user_group(self, text: str, *, mention: bool) -> str:
        return await self.tab.send(ROOM, f"@{BOT} {text}" if mention else text)

    def dm_answers(self) -> list[Answer]:
        return [
            Answer(s.id, s.text, tuple(s.texts)) for s in self.tab.in_conversation(DM, bot=True)
        ]

    def calls_besides_receiving(self) -> list[str]:
        return [f"{f['type']} {f.get('id', '')}" for f in self.tab.bot_frames(ROOM)]

    def identity_calls(self) -> int:
        return self.runs

    async def drop_connection(self) -> None:
        await self.tab.drop()

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        self.tab.paused_until = trio.current_time() + count * retry_after

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        await self.tab.wait_until(predicate)
