"""A scripted web chat tab: the client side of dshim's web chat websocket protocol.

For the web chat the "platform" is dshim itself, so its fake is the other end: a tab as a
script sees it.  It speaks the frames README.md documents ("The websocket protocol (for
scripts)") over one websocket and behaves like the page (``static/app.js``), so the same
client drives tests, benchmarks and demos.  It is written against the protocol only: it
imports nothing of the channel.  Usage::

    async with open_webchat_client("ws://127.0.0.1:8910/ws", user="u-ann", name="Ann") as tab:
        await tab.join("c1")
        accepted = await tab.send("c1", "hello")
        await tab.wait_until(lambda: any(m.final for m in tab.answers_to(accepted["id"])))
        print(tab.bot_texts("c1")[-1])

As a process (``python -m dshim.testing.fakes.webchat``): ``--say TEXT URL`` prints the
bot's final answer; ``--flood N URL`` sends N messages as fast as the socket takes them
and prints one JSON line (benchmarks: ``scripts/bench_webchat.py``).

What the tab does, like the page:

- **Connection**: one websocket, opened on a TCP stream the tab owns (so :meth:`drop`
  can cut it without a closing handshake).  Whenever it ends (network error, a close
  from dshim — 1012 restarting, 1013 too slow —, a 404 because the bot has not mounted
  its socket yet) the tab reconnects with backoff (about 0.5 s, doubling up to 10 s,
  jittered; reset once connected).  On every connection it joins again every
  conversation it joined and sends again every ``send``/``answer`` not yet ``accepted``,
  with the same ``client_id`` (dshim answers a resend with the same id and does not
  answer it twice).  An upgrade refused with 401 or 403 (the token, the ``Origin``) is
  not retried: it ends the tab with :class:`UpgradeRefused`.
- **Errors**: ``open_webchat_client`` raises one error, never an ExceptionGroup: the
  body's own, :class:`UpgradeRefused`, or :class:`BadServerFrame` when dshim sends
  something that is not a JSON object (a dshim bug: the tab does not guess).  An error
  frame about a frame the tab sent is recorded (:attr:`WebchatClient.errors`); ``send``
  and ``answer`` raise it as :class:`FrameRefused`, except ``unavailable`` (dshim is
  restarting), after which the frame stays queued for the next connection, as on the page.
- **Observation**: :attr:`WebchatClient.frames` is every frame received, in order, and
  :attr:`WebchatClient.received` the same with its trio time (virtual on the autojump
  clock); :attr:`WebchatClient.messages` every message by id with each text it showed
  (the streamed texts of an answer, in order) and when; :attr:`WebchatClient.accepted`,
  :attr:`interactions <WebchatClient.interactions>`, :attr:`close_codes
  <WebchatClient.close_codes>`.  :meth:`WebchatClient.wait_until` waits for a condition,
  re-checked after every change (a frame, a connection, a drop): no polling.
- **Faults**: :meth:`WebchatClient.drop` cuts the TCP connection (no close frame);
  :meth:`WebchatClient.stall` stops reading for a while (a stalled browser: dshim's
  outbox for the tab fills); :meth:`WebchatClient.send_raw` sends any bytes or text.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import itertools
import json
import os
import random
import sys
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    HandshakeError,
    WebSocketConnection,
)

from dshim.backoff import Backoff
from dshim.net.ws import WsOptions, open_client_websocket

__all__ = [
    "BadServerFrame",
    "FloodResult",
    "FrameRefused",
    "ReceivedFrame",
    "SeenMessage",
    "UpgradeRefused",
    "WebchatClient",
    "WebchatClientError",
    "flood",
    "flood_frames",
    "join_frame",
    "open_socket",
    "open_webchat_client",
    "send_frame",
    "upgrade_headers",
]

Frame = dict[str, Any]
#: What one frame from dshim may be: its history of 500 messages of 100,000 characters.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
#: Upgrade answers that mean "never with these credentials": not retried.
FATAL_STATUSES = frozenset({401, 403})
#: The TCP connection and the upgrade, together (``trio.TooSlowError`` after that).
CONNECT_TIMEOUT_S = 10.0
#: How long closing a websocket waits for the peer's close frame.
CLOSE_WAIT_S = 0.25
#: How long leaving :meth:`WebchatClient.running` waits for the closing handshake.
GOODBYE_S = 2.0
#: Error codes after which the page keeps the frame and sends it again on reconnect.
RETRY_CODES = frozenset({"unavailable"})


# --- errors ------------------------------------------------------------------------------------


class WebchatClientError(Exception):
    """Root of the errors the scripted tab raises."""


class UpgradeRefused(WebchatClientError):
    """dshim refused the websocket upgrade with 401 (the token) or 403 (the ``Origin``)."""

    def __init__(self, status: int, body: bytes | None) -> None:
        super().__init__(f"the websocket upgrade was refused with HTTP {status}")
        self.status = status
        self.body = body or b""


class FrameRefused(WebchatClientError):
    """dshim answered a frame of the tab with an ``error`` frame."""

    def __init__(self, frame: Frame) -> None:
        super().__init__(f"{frame.get('code')}: {frame.get('message')}")
        self.frame = frame
        self.code = str(frame.get("code"))
        self.message = str(frame.get("message"))


class BadServerFrame(WebchatClientError):
    """dshim sent a frame that is not a JSON object with a ``type``."""


# --- frames out --------------------------------------------------------------------------------


def join_frame(conversation: str, kind: str, user: Mapping[str, str]) -> Frame:
    """``join``: become a member of ``conversation`` (``direct`` or ``room``) as ``user``."""
    return {"type": "join", "conversation": conversation, "kind": kind, "user": dict(user)}


def send_frame(
    client_id: str,
    conversation: str,
    text: str,
    *,
    reply_to: str | None = None,
    files: Sequence[tuple[str, str, bytes]] = (),
) -> Frame:
    """``send``: a message with ``files`` as ``(name, mime, data)`` (sent base64)."""
    return {
        "type": "send",
        "client_id": client_id,
        "conversation": conversation,
        "text": text,
        "reply_to": reply_to,
        "files": [
            {"name": name, "mime": mime, "data_b64": base64.b64encode(data).decode("ascii")}
            for name, mime, data in files
        ],
    }


def _encode(frame: Frame) -> str:
    return json.dumps(frame, ensure_ascii=False, separators=(",", ":"))


# --- the socket --------------------------------------------------------------------------------


@contextlib.contextmanager
def _one_error() -> Iterator[None]:
    """The one real error out of a nursery, never a group: trio-websocket's reader task
    may add its own cancellation next to it (cancellation is level-triggered, so it comes
    back anyway)."""
    try:
        yield
    except BaseExceptionGroup as group:
        real = [e for e in group.exceptions if not isinstance(e, trio.Cancelled)]
        if len(real) == 1:
            raise real[0] from real[0].__cause__
        if not real:
            raise group.exceptions[0] from None
        raise


def _target(url: str) -> tuple[str, int, str, str]:
    """(host, port, Host header, request target) of a ``ws://`` URL."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "ws" or not parts.hostname:
        raise ValueError(f"not a ws:// URL: {url!r}")
    port = parts.port or 80
    host_header = parts.netloc.rpartition("@")[2]
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.hostname, port, host_header, target


@asynccontextmanager
async def open_socket(
    url: str,
    headers: Sequence[tuple[bytes, bytes]] = (),
    *,
    max_message_size: int = MAX_MESSAGE_BYTES,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> AsyncIterator[tuple[WebSocketConnection, trio.SocketStream]]:
    """One client websocket and its TCP stream (the kit's
    :func:`~dshim.net.ws.open_client_websocket`, which owns the stream so that
    every way out closes the socket).  Leaving the block closes the websocket (1000) when
    it is still open, waiting for dshim's answer at most :data:`CLOSE_WAIT_S`.
    """
    options = WsOptions(
        connect_timeout_s=connect_timeout_s,
        max_message_size=max_message_size,
        shutdown_close_code=1000,
        shutdown_close_s=CLOSE_WAIT_S,
    )
    with _one_error():
        async with open_client_websocket(url, options, extra_headers=headers) as (ws, stream):
            assert isinstance(stream, trio.SocketStream)  # ws:// only
            yield ws, stream


def upgrade_headers(
    *,
    token: str | None = None,
    origin: str | None = None,
    extra: Sequence[tuple[bytes, bytes]] = (),
) -> list[tuple[bytes, bytes]]:
    """The upgrade's headers: the bearer token, the ``Origin`` a page would send, more."""
    out: list[tuple[bytes, bytes]] = []
    if token is not None:
        out.append((b"authorization", f"Bearer {token}".encode()))
    if origin is not None:
        out.append((b"origin", origin.encode()))
    return out + list(extra)


# --- what the tab shows ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReceivedFrame:
    """One frame from dshim and when it arrived (trio's clock)."""

    at: float
    frame: Frame


@dataclass
class SeenMessage:
    """One message as the tab showed it: every text it showed, when, and whether it ended."""

    id: str
    conversation: str
    author: dict[str, Any]
    reply_to: str | None
    #: Each text the message showed, in order (an answer's streamed texts, then the final).
    texts: list[str] = field(default_factory=list)
    #: When each of ``texts`` arrived (trio's clock).
    times: list[float] = field(default_factory=list)
    final: bool = False
    #: When the final text arrived (None while it is written).
    final_at: float | None = None
    files: list[dict[str, Any]] = field(default_factory=list)
    client_id: str | None = None

    @property
    def text(self) -> str:
        """The text shown now."""
        return self.texts[-1] if self.texts else ""

    @property
    def bot(self) -> bool:
        return bool(self.author.get("bot"))


# --- the tab -----------------------------------------------------------------------------------


class WebchatClient:
    """A scripted tab (see the module docstring).  Use :func:`open_webchat_client`, or
    :meth:`running` on an instance made beforehand.

    ``conversations`` (id -> ``direct``/``room``) are joined on every connection, also the
    first, without waiting; :meth:`join` adds one and waits for its history.
    """

    def __init__(
        self,
        url: str,
        *,
        user: str,
        name: str,
        token: str | None = None,
        origin: str | None = None,
        headers: Sequence[tuple[bytes, bytes]] = (),
        conversations: Mapping[str, str] | None = None,
        reconnect_min_s: float = 0.5,
        reconnect_max_s: float = 10.0,
        rng: random.Random | None = None,
    ) -> None:
        _target(url)  # a bad URL fails here, not in the background
        self.url = url
        self.user = {"id": user, "name": name}
        self._headers = upgrade_headers(token=token, origin=origin, extra=headers)
        self._backoff = Backoff(reconnect_min_s, max(reconnect_min_s, reconnect_max_s), rng=rng)
        #: Every frame received, in order (the dicts of :attr:`received`).
        self.frames: list[Frame] = []
        #: Every frame received with its arrival time.
        self.received: list[ReceivedFrame] = []
        #: Every message seen (own, other users', the bot's), by id, in first-seen order.
        self.messages: dict[str, SeenMessage] = {}
        #: client_id -> message id, for every ``accepted`` frame.
        self.accepted: dict[str, str] = {}
        self.errors: list[Frame] = []
        #: Open and closed requests with buttons, by id (the ``interaction`` frame).
        self.interactions: dict[str, Frame] = {}
        self.closed_interactions: set[str] = set()
        #: Conversations joined again on every connection: id -> kind.
        self.joined: dict[str, str] = dict(conversations or {})
        #: Frames sent but not yet ``accepted``, by client_id: sent again on reconnect.
        self.unacked: dict[str, Frame] = {}
        self.last_sent: Frame | None = None
        #: Connections made so far.
        self.connections = 0
        #: The close code of every connection that ended (1006: cut, no close frame).
        self.close_codes: list[int | None] = []
        self._ws: WebSocketConnection | None = None
        self._stream: trio.SocketStream | None = None
        self._stalled_until = 0.0
        self._offline = False
        self._ids = itertools.count(1)
        self._changed = trio.Event()
        self._online = trio.Event()
        self._online.set()
        #: Around the reading of the current connection (cancelled when the block ends).
        self._reading = trio.CancelScope()

    # -- running ---------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[WebchatClient]:
        """Connect (and keep reconnecting) for the duration of the block; leaving it
        closes the websocket with a closing handshake, like a tab that is closed."""
        with _one_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._run)
                try:
                    yield self
                finally:
                    # Stop reading: the connection task closes the socket while
                    # trio-websocket's reader still runs to read dshim's answer.
                    self._online = trio.Event()  # never set: no reconnect from here on
                    self._reading.cancel()
                    with trio.CancelScope(shield=True), trio.move_on_after(GOODBYE_S):
                        await self.wait_until(lambda: self._ws is None)
                    nursery.cancel_scope.cancel()

    async def _run(self) -> None:
        while True:
            await self._online.wait()
            # Made before connecting: leaving the block while this connection is being
            # made cancels it before it reads anything.
            self._reading = reading = trio.CancelScope()
            try:
                async with open_socket(self.url, self._headers) as (ws, stream):
                    with reading:
                        await self._connected(ws, stream)
                        await self._read(ws)
            except ConnectionRejected as exc:
                if exc.status_code in FATAL_STATUSES:
                    raise UpgradeRefused(exc.status_code, exc.body) from None
            except (HandshakeError, OSError, trio.BrokenResourceError, trio.TooSlowError):
                pass
            finally:
                if self._ws is not None:
                    self._ws = self._stream = None
                    self._wake()
            await trio.sleep(self._backoff.next_delay())

    async def _connected(self, ws: WebSocketConnection, stream: trio.SocketStream) -> None:
        self._ws, self._stream = ws, stream
        self.connections += 1
        self._backoff.reset()
        for conversation, kind in list(self.joined.items()):
            await self._send(join_frame(conversation, kind, self.user))
        for frame in list(self.unacked.values()):
            await self._send(frame)
        self._wake()

    async def _read(self, ws: WebSocketConnection) -> None:
        while True:
            if trio.current_time() < self._stalled_until:
                await trio.sleep_until(self._stalled_until)
            try:
                data = await ws.get_message()
            except ConnectionClosed as exc:
                self.close_codes.append(int(exc.reason.code) if exc.reason else None)
                return
            self._on_frame(_decode(data))

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checked after every change (a frame, a
        connection, a drop); put a deadline around it (``trio.fail_after``)."""
        while not predicate():
            await self._changed.wait()

    async def wait_connected(self) -> None:
        await self.wait_until(lambda: self._ws is not None)

    @property
    def ws(self) -> WebSocketConnection | None:
        """The open websocket, None while (re)connecting."""
        return self._ws

    @property
    def connected(self) -> bool:
        return self._ws is not None

    async def _send(self, frame: Frame) -> None:
        """Send when connected (a frame that must arrive is in :attr:`unacked` or
        :attr:`joined`, and goes again on the next connection)."""
        if self._ws is not None:
            with contextlib.suppress(ConnectionClosed):
                await self._ws.send_message(_encode(frame))

    async def send_raw(self, data: str | bytes) -> None:
        """Send anything as one websocket message (bad frames for dshim to refuse)."""
        await self.wait_connected()
        assert self._ws is not None
        await self._ws.send_message(data)

    # -- frames in -------------------------------------------------------------------------

    def _on_frame(self, frame: Frame) -> None:
        self.frames.append(frame)
        now = trio.current_time()
        self.received.append(ReceivedFrame(now, frame))
        kind = frame.get("type")
        if kind == "message":
            self._on_message(frame, now)
        elif kind == "history":
            for message in frame.get("messages", ()):
                self._on_message(message, now)
        elif kind == "accepted":
            self.accepted[frame["client_id"]] = frame["id"]
            self.unacked.pop(frame["client_id"], None)
        elif kind == "error":
            self.errors.append(frame)
            client_id = frame.get("client_id")
            if client_id is not None and frame.get("code") not in RETRY_CODES:
                self.unacked.pop(client_id, None)  # the page marks it failed
        elif kind == "interaction":
            self.interactions[frame["id"]] = frame
        elif kind == "interaction_closed":
            self.closed_interactions.add(frame["id"])
        self._wake()

    def _on_message(self, frame: Frame, now: float) -> None:
        seen = self.messages.get(frame["id"])
        if seen is None:
            seen = self.messages[frame["id"]] = SeenMessage(
                frame["id"],
                frame["conversation"],
                frame["author"],
                frame.get("reply_to"),
                client_id=frame.get("client_id"),
            )
        if not seen.texts or seen.texts[-1] != frame["text"]:
            seen.texts.append(frame["text"])
            seen.times.append(now)
        if frame.get("final") and not seen.final:
            seen.final, seen.final_at = True, now
        seen.files = frame.get("files", [])

    # -- frames out ------------------------------------------------------------------------

    def next_client_id(self) -> str:
        """A fresh ``client_id`` (``k1``, ``k2`` ...)."""
        return f"k{next(self._ids)}"

    async def join(self, conversation: str, kind: str = "direct") -> Frame:
        """Join ``conversation`` (again on every reconnection) and return its history frame."""
        await self.wait_connected()
        self.joined[conversation] = kind
        mark = len(self.frames)
        await self._send(join_frame(conversation, kind, self.user))
        return await self.next_frame("history", after=mark, conversation=conversation)

    async def leave(self, conversation: str) -> None:
        """No more frames of ``conversation``."""
        self.joined.pop(conversation, None)
        await self._send({"type": "leave", "conversation": conversation})

    async def next_frame(
        self, kind: str, *, after: int = 0, conversation: str | None = None
    ) -> Frame:
        """The first frame of ``kind`` at or after index ``after`` of :attr:`frames`
        (waiting for it)."""

        def found() -> Frame | None:
            return next(
                (
                    f
                    for f in self.frames[after:]
                    if f.get("type") == kind
                    and (conversation is None or f.get("conversation") == conversation)
                ),
                None,
            )

        await self.wait_until(lambda: found() is not None)
        frame = found()
        assert frame is not None
        return frame

    async def submit(self, frame: Frame) -> str:
        """Send a ``send`` or ``answer`` frame now (or on the next connection) and keep it
        until it is ``accepted``; returns its client_id without waiting."""
        client_id = str(frame["client_id"])
        self.unacked[client_id] = frame
        self.last_sent = frame
        await self.wait_connected()
        await self._send(frame)
        return client_id

    async def outcome(self, client_id: str, *, after: int = 0) -> Frame:
        """The first ``accepted`` frame of ``client_id`` at or after index ``after`` of
        :attr:`frames` (waiting for it).  An error frame about it raises
        :class:`FrameRefused`, except ``unavailable``: the frame goes again on the next
        connection and the wait goes on."""

        def answer() -> Frame | None:
            for f in self.frames[after:]:
                if f.get("client_id") != client_id:
                    continue
                kind = f.get("type")
                if kind == "accepted" or (kind == "error" and f.get("code") not in RETRY_CODES):
                    return f
            return None

        await self.wait_until(lambda: answer() is not None)
        frame = answer()
        assert frame is not None
        if frame["type"] == "error":
            raise FrameRefused(frame)
        return frame

    async def _submit_and_wait(self, frame: Frame) -> Frame:
        mark = len(self.frames)
        return await self.outcome(await self.submit(frame), after=mark)

    async def send(
        self,
        conversation: str,
        text: str,
        *,
        reply_to: str | None = None,
        files: Sequence[tuple[str, str, bytes]] = (),
        client_id: str | None = None,
    ) -> Frame:
        """Send a message (``files``: ``(name, mime, data)``) and return its ``accepted``
        frame (its ``id`` is the message's id); :class:`FrameRefused` when refused."""
        frame = send_frame(
            client_id or self.next_client_id(), conversation, text, reply_to=reply_to, files=files
        )
        return await self._submit_and_wait(frame)

    async def answer(
        self, conversation: str, interaction: str, option: str, *, client_id: str | None = None
    ) -> Frame:
        """Press the button ``option`` of the request ``interaction``; returns the
        ``accepted`` frame (:class:`FrameRefused`: e.g. ``not_found`` when it no longer
        waits)."""
        frame = {
            "type": "answer",
            "client_id": client_id or self.next_client_id(),
            "conversation": conversation,
            "interaction": interaction,
            "option": option,
        }
        return await self._submit_and_wait(frame)

    # -- faults ----------------------------------------------------------------------------

    async def drop(self, *, resend_last: bool = True, reconnect: bool = True) -> None:
        """Cut the TCP connection (no closing handshake).  Like a page that may have
        missed the ``accepted``, the tab sends its last message again (``resend_last``)
        once it reconnected; with ``reconnect=False`` it stays offline until
        :meth:`reconnect`.  Returns once reconnected (or at once when offline)."""
        stream, before = self._stream, self.connections
        if resend_last and self.last_sent is not None:
            self.unacked[str(self.last_sent["client_id"])] = self.last_sent
        if not reconnect:
            self._offline = True
            self._online = trio.Event()
        if stream is not None:
            await stream.aclose()
        if reconnect:
            await self.wait_until(lambda: self.connections > before and self.connected)
        else:
            await self.wait_until(lambda: not self.connected)

    async def reconnect(self) -> None:
        """A new connection: back online after ``drop(reconnect=False)``, else the
        current connection is cut first.  Returns once connected."""
        if not self._offline:
            await self.drop(resend_last=False)
            return
        before = self.connections
        self._offline = False
        self._online.set()
        await self.wait_until(lambda: self.connections > before and self.connected)

    def stall(self, seconds: float) -> None:
        """Stop reading frames for ``seconds`` (from now): a stalled browser."""
        self._stalled_until = max(self._stalled_until, trio.current_time() + seconds)

    # -- what the chat shows ---------------------------------------------------------------

    def in_conversation(self, conversation: str, *, bot: bool | None = None) -> list[SeenMessage]:
        """The messages of ``conversation`` in first-seen order (``bot``: only the bot's,
        or only the users')."""
        return [
            s
            for s in self.messages.values()
            if s.conversation == conversation and (bot is None or s.bot == bot)
        ]

    def bot_messages(self, conversation: str) -> list[SeenMessage]:
        """The bot's messages in ``conversation``, each with its streamed texts."""
        return self.in_conversation(conversation, bot=True)

    def bot_texts(self, conversation: str) -> list[str]:
        """The text each of the bot's messages in ``conversation`` shows now."""
        return [s.text for s in self.bot_messages(conversation)]

    def answers_to(self, message_id: str) -> list[SeenMessage]:
        """The bot's messages that reply to ``message_id``."""
        return [s for s in self.messages.values() if s.bot and s.reply_to == message_id]

    def bot_frames(self, conversation: str) -> list[Frame]:
        """Frames about the bot's own messages and requests in ``conversation`` (not the
        transport's: no ``accepted``, no history, no user's message shown back)."""
        return [
            f
            for f in self.frames
            if f.get("conversation") == conversation
            and (
                f.get("type") in ("interaction", "typing")
                or (f.get("type") == "message" and f["author"]["bot"])
            )
        ]


def _decode(data: str | bytes) -> Frame:
    try:
        frame = json.loads(data)
    except ValueError as exc:
        raise BadServerFrame(f"dshim sent a frame that is not JSON: {str(data)[:80]!r}") from exc
    if not isinstance(frame, dict) or not isinstance(frame.get("type"), str):
        raise BadServerFrame(f"dshim sent a frame without a type: {str(data)[:80]!r}")
    return frame


@asynccontextmanager
async def open_webchat_client(
    url: str,
    *,
    user: str,
    name: str,
    token: str | None = None,
    origin: str | None = None,
    headers: Sequence[tuple[bytes, bytes]] = (),
    conversations: Mapping[str, str] | None = None,
    reconnect_min_s: float = 0.5,
    reconnect_max_s: float = 10.0,
    rng: random.Random | None = None,
) -> AsyncIterator[WebchatClient]:
    """A scripted tab on ``url`` (``ws://host:port/ws`` or ``/hooks/<bot>/ws``) as the
    user ``user`` named ``name``, for the duration of the block.

    ``token``: sent as ``Authorization: Bearer``; ``origin``: the ``Origin`` header a
    page would send (``http://host:port``); ``headers``: more upgrade headers.  The block
    starts at once, connecting in the background (``join``/``send`` wait for it).  Raises
    one error, never an ExceptionGroup (see the module docstring).
    """
    client = WebchatClient(
        url,
        user=user,
        name=name,
        token=token,
        origin=origin,
        headers=headers,
        conversations=conversations,
        reconnect_min_s=reconnect_min_s,
        reconnect_max_s=reconnect_max_s,
        rng=rng,
    )
    async with client.running():
        yield client


# --- flooding (benchmarks) -------------------------------------------------------------------

LOREM = (
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud "
    "exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat. 🧪 "
)


@dataclass(frozen=True, slots=True)
class FloodResult:
    """What a flood saw: frames sent, ``accepted`` and error answers, wall seconds from
    the first send to the last answer (or the close), and how the socket ended."""

    sent: int
    accepted: int
    refused: int
    seconds: float
    close_code: int | None

    def as_json(self) -> str:
        return json.dumps(
            {
                "sent": self.sent,
                "accepted": self.accepted,
                "refused": self.refused,
                "seconds": round(self.seconds, 6),
                "close_code": self.close_code,
            }
        )


def flood_frames(
    n: int, *, conversations: int = 20, size: int = 1000, prefix: str = "flood"
) -> tuple[list[str], list[str]]:
    """(join frames as text, N send frames as text) for :func:`flood`: direct
    conversations ``<prefix>-<i>`` taken in turn, texts of ``size`` characters."""
    body = (LOREM * (size // len(LOREM) + 1))[:size]
    user = {"id": "u-flood", "name": "Flood"}
    convs = [f"{prefix}-{i}" for i in range(max(1, conversations))]
    joins = [_encode(join_frame(c, "direct", user)) for c in convs]
    sends = [_encode(send_frame(f"f{i}", convs[i % len(convs)], f"{i} {body}")) for i in range(n)]
    return joins, sends


async def flood(
    url: str,
    n: int,
    *,
    conversations: int = 20,
    size: int = 1000,
    headers: Sequence[tuple[bytes, bytes]] = (),
) -> FloodResult:
    """Join ``conversations`` direct chats and send ``n`` messages as fast as the socket
    takes them (frames built beforehand), reading dshim's answers meanwhile.  Ends when
    every message was answered (``accepted`` or an error) or when dshim closes the socket
    (a floor server that does not answer).  One connection, no reconnect, no resend."""
    joins, sends = flood_frames(n, conversations=conversations, size=size)
    answered = [0, 0]  # accepted, refused
    close_code: int | None = None
    async with open_socket(url, headers) as (ws, _):
        for data in joins:
            await ws.send_message(data)
        done = trio.Event()

        async def read() -> None:
            nonlocal close_code
            try:
                while sum(answered) < n:
                    frame = _decode(await ws.get_message())
                    if frame["type"] == "accepted":
                        answered[0] += 1
                    elif frame["type"] == "error" and "client_id" in frame:
                        answered[1] += 1
            except ConnectionClosed as exc:
                close_code = int(exc.reason.code) if exc.reason else None
            done.set()

        sent = 0
        with _one_error():
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                t0 = time.perf_counter()
                with contextlib.suppress(ConnectionClosed):
                    for data in sends:
                        await ws.send_message(data)
                        sent += 1
                await done.wait()
                seconds = time.perf_counter() - t0
    return FloodResult(sent, answered[0], answered[1], seconds, close_code)


# --- the process -------------------------------------------------------------------------------


async def _say(url: str, text: str, headers: Sequence[tuple[bytes, bytes]]) -> str:
    async with open_webchat_client(url, user="u-script", name="Script", headers=headers) as tab:
        conversation = f"script-{os.getpid()}"
        await tab.join(conversation)
        mid = (await tab.send(conversation, text))["id"]
        await tab.wait_until(lambda: any(s.final for s in tab.answers_to(mid)))
        return next(s.text for s in tab.answers_to(mid) if s.final)


def main(argv: list[str] | None = None) -> None:
    """``python -m dshim.testing.fakes.webchat (--say TEXT | --flood N) URL``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the chat's socket, e.g. ws://127.0.0.1:8910/ws")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--say", metavar="TEXT", help="send TEXT, print the bot's final answer")
    mode.add_argument("--flood", type=int, metavar="N", help="send N messages, print JSON")
    parser.add_argument("--conversations", type=int, default=20, help="flood: chats in turn")
    parser.add_argument("--size", type=int, default=1000, help="flood: characters per text")
    parser.add_argument("--token-env", metavar="VAR", help="read the bearer token from VAR")
    parser.add_argument("--origin", help="send this Origin header (as a page would)")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up after this long")
    args = parser.parse_args(argv)
    token = os.environ.get(args.token_env) if args.token_env else None
    if args.token_env and not token:
        parser.error(f"--token-env: {args.token_env} is not set")
    headers = upgrade_headers(token=token, origin=args.origin)

    async def run() -> str:
        with trio.fail_after(args.timeout):
            if args.say is not None:
                return await _say(args.url, args.say, headers)
            result = await flood(
                args.url,
                args.flood,
                conversations=args.conversations,
                size=args.size,
                headers=headers,
            )
            return result.as_json()

    try:
        print(trio.run(run), flush=True)
    except (WebchatClientError, OSError, HandshakeError, trio.TooSlowError) as exc:
        sys.exit(f"webchat client: {exc.__class__.__name__}: {exc}")


if __name__ == "__main__":
    main(sys.argv[1:])
