"""A fake WhatsApp Web account on 127.0.0.1, at the engine boundary.

The channel's real engine is neonize (whatsmeow) in process; to run the channel against
a scripted WhatsApp -- in a test or behind a real ``dshim serve`` (``engine_url``) --
this fake speaks the websocket protocol of :mod:`dshim.channels.whatsapp_web.wire` and
the channel uses :class:`~dshim.channels.whatsapp_web.wire.WireEngine`.  It keeps what
WhatsApp guarantees and what dshim relies on:

- a paired session answers a connect with ``connected``, then delivers every message not
  yet acknowledged, in order: :meth:`FakeWhatsAppWeb.inject` queues a message (a
  :func:`message_event` dict, neonize's ``Message`` event as ``MessageToDict``) and
  delivers it on the live connection; one not acked (``{"type": "ack"}``) comes again at
  the next connect (WhatsApp's server queues un-acked messages), an acked one never;
- an unpaired session shows QR codes, a fresh one every
  :attr:`~FakeWhatsAppWeb.qr_interval_s`, until :meth:`~FakeWhatsAppWeb.scan` (``paired``,
  then ``connected`` and the waiting messages); ``pair_phone`` hands out a code like
  ``ABCD-1234`` (``scan`` stands for the user typing it too); ``me`` answers null until
  then, and the other calls fail (``transport`` 401: not logged in, nothing done);
- ``logout`` unlinks (unpaired) and closes the connection cleanly, ``disconnect`` closes
  it cleanly;
- one live connection per account: a second one throws the first out (``replaced``,
  then its close), like ``StreamReplaced``;
- the account's messages get WhatsApp-like ids (``3EB0`` + 16 hex digits); an edit names
  one of them (else ``not_found``) within :attr:`~FakeWhatsAppWeb.edit_window_s`
  (WhatsApp's 15 minutes; later: ``refused``); :attr:`~FakeWhatsAppWeb.sent` keeps each as
  sent, :meth:`~FakeWhatsAppWeb.text_of` what it shows after its edits; media of an injected message is served
  to ``download`` once :meth:`~FakeWhatsAppWeb.add_media` gave it.

Lifecycle knobs: :meth:`~FakeWhatsAppWeb.drop_connection` (the socket closes without a
close frame: the client's ``connect`` raises), :meth:`~FakeWhatsAppWeb.log_out`
(``logged_out``, then a clean close, unpaired; with no live connection the next connect
gets ``logged_out`` with ``on_connect`` and a close), :meth:`~FakeWhatsAppWeb.replace`,
:meth:`~FakeWhatsAppWeb.push` (any other event: ``disconnected``, ``keepalive_lost``,
``connect_failed``), :meth:`~FakeWhatsAppWeb.refuse_connects` (the next connects get
``connect_failed`` and a close).

Faults (the base's queue, keyed by op: ``send``, ``edit``, ``presence``, ``mark_read``,
``download``, ``me``, ``pair_phone``, ``logout``, ``connect``):
``fail_next(op, status=...)`` answers an error and performs nothing (404: ``not_found``,
429: ``rate_limited`` with ``retry_after``, any other: ``transport`` with the status;
``kind="refused"`` or ``kind="unknown"`` names the kind instead); for ``connect`` the
websocket handshake is rejected with the status.  ``slow_next(op, s)`` delays the
answer, ``drop_next(op)`` closes the socket instead of answering (not performed),
:meth:`~FakeWhatsAppWeb.lose_next` performs the call and then closes the socket unanswered
(the client cannot know it happened), and
:meth:`~dshim.testing.fakes.base.FakePlatform.outage` for a time (``"500"``: ``transport``
500; ``"drop"``; ``"lost"``: performed, then the socket closes).

Reading what the bot did: :attr:`~FakeWhatsAppWeb.calls` (every call: op, args, trio
time), :attr:`~FakeWhatsAppWeb.sent`, :attr:`~FakeWhatsAppWeb.edits`,
:attr:`~FakeWhatsAppWeb.presences`, :attr:`~FakeWhatsAppWeb.reads`,
:attr:`~FakeWhatsAppWeb.acked`, :attr:`~FakeWhatsAppWeb.deliveries`,
:meth:`~FakeWhatsAppWeb.text_of`, :meth:`~FakeWhatsAppWeb.answers`,
:attr:`~FakeWhatsAppWeb.connections`.  Usage::

    async with open_fake_whatsapp_web() as fake:
        ...  # run the bot with engine_url = fake.url
        await fake.wait_until(lambda: fake.live is not None)
        mid = await fake.inject(message_event("hello"))
        await fake.wait_acked(mid)
        await fake.wait_until(lambda: fake.answers(ADA))  # a direct chat is its user's JID

No neonize here (it is an optional extra): :func:`message_event` writes the protobuf JSON
by hand, as ``MessageToDict`` would (fields at their defaults left out, 64-bit integers
as strings).
"""

from __future__ import annotations

import base64
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

from dshim.channels.whatsapp_web.engine import Account, unwrapped
from dshim.testing.fakes import cli
from dshim.testing.fakes.base import FakePlatform, Fault, IdleBench, open_servers
from dshim.testing.fakes.http import DropConnection
from dshim.testing.fakes.ws import write_frames

__all__ = [
    "ADA",
    "DEFAULT_ACCOUNT",
    "GROUP",
    "OPS",
    "Call",
    "Connection",
    "Edit",
    "FakeWhatsAppWeb",
    "Presence",
    "Read",
    "Sent",
    "message_event",
    "new_message_id",
    "open_fake_whatsapp_web",
]

#: The linked account of a paired fake.
DEFAULT_ACCOUNT = Account(
    jid="4915100000001@s.whatsapp.net", lid="100000000000001@lid", push_name="dshim bot"
)
#: A user who writes to the bot (``message_event``'s default sender) and a group.
ADA = "4915112345678@s.whatsapp.net"
GROUP = "120363000000000001@g.us"
#: Message frames queued per connection before ``inject`` waits (the client reads slowly).
OUTBOX = 256
#: Room kept beside them for lifecycle events and closes, which never wait.
RESERVE = 64
#: Ops the fake answers (``disconnect`` is answered, then the socket closes cleanly).
OPS = frozenset(
    {
        "me",
        "send",
        "edit",
        "presence",
        "mark_read",
        "download",
        "pair_phone",
        "logout",
        "disconnect",
    }
)
_PAIR_ALPHABET = "ABCDEFGHJKLMNPQRSTVWXYZ0123456789"


def new_message_id() -> str:
    """A message id as WhatsApp Web's own (``3EB0`` + 16 upper hex digits)."""
    return "3EB0" + secrets.token_hex(8).upper()


def _jid(text: str) -> dict[str, Any]:
    """``user[:device]@server`` as a neonize ``JID`` in protobuf JSON."""
    user, _, server = text.partition("@")
    user, _, device = user.partition(":")
    out: dict[str, Any] = {"User": user, "Server": server or "s.whatsapp.net"}
    if device and device != "0":
        out["Device"] = int(device)
    return out


def message_event(
    text: str | None = "hello",
    *,
    sender: str = ADA,
    push_name: str = "Ada",
    group: str | bool = False,
    chat: str | None = None,
    message_id: str | None = None,
    timestamp: int | None = None,
    from_me: bool = False,
    extended: bool = False,
    quoted_id: str = "",
    quoted_participant: str = "",
    quoted_message: dict[str, Any] | None = None,
    mentions: list[str] | tuple[str, ...] = (),
    forwarded: bool = False,
    image: bool = False,
    document: str | None = None,
    mimetype: str | None = None,
    file_length: int = 1024,
) -> dict[str, Any]:
    """neonize's ``Message`` event as ``MessageToDict(event, preserving_proto_field_name=True)``.

    A direct message from ``sender`` unless ``group`` (True: :data:`GROUP`, or a group
    JID); ``chat`` overrides the chat JID.  ``text`` is a ``conversation``, or an
    ``extendedTextMessage`` when it has a context (a quote: ``quoted_id`` with
    ``quoted_participant`` and optionally the ``quoted_message`` snapshot as a
    ``waE2E.Message`` dict; ``mentions``; ``forwarded``) or ``extended``; with ``image``
    or ``document`` (its file name) it is the caption of an ``imageMessage`` /
    ``documentMessage`` (the context then sits in the media message).
    """
    if group:
        chat_jid = chat or (GROUP if group is True else str(group))
    else:
        chat_jid = chat or sender
    source: dict[str, Any] = {"Chat": _jid(chat_jid), "Sender": _jid(sender)}
    if from_me:
        source["IsFromMe"] = True
    if group:
        source["IsGroup"] = True
    context: dict[str, Any] = {}
    if quoted_id:
        context["stanzaID"] = quoted_id
        if quoted_participant:
            context["participant"] = quoted_participant
        if quoted_message is not None:
            context["quotedMessage"] = quoted_message
    if mentions:
        context["mentionedJID"] = list(mentions)
    if forwarded:
        context["isForwarded"] = True
        context["forwardingScore"] = 1
    message: dict[str, Any] = {}
    media_type = ""
    if image or document is not None:
        media: dict[str, Any] = {"fileLength": str(file_length)}
        if text:
            media["caption"] = text
        if context:
            media["contextInfo"] = context
        if image:
            media["mimetype"] = mimetype or "image/jpeg"
            message["imageMessage"] = media
            media_type = "image"
        else:
            media["mimetype"] = mimetype or "application/pdf"
            media["fileName"] = document
            media["title"] = document
            message["documentMessage"] = media
            media_type = "document"
    elif context or extended:
        ext: dict[str, Any] = {}
        if text:
            ext["text"] = text
        if context:
            ext["contextInfo"] = context
        message["extendedTextMessage"] = ext
    elif text:
        message["conversation"] = text
    info: dict[str, Any] = {
        "MessageSource": source,
        "ID": message_id or new_message_id(),
        "Type": "media" if media_type else "text",
        # neonize writes whatsmeow's time as Unix milliseconds.
        "Timestamp": str(int(time.time() * 1000) if timestamp is None else timestamp),
    }
    if push_name:
        info["Pushname"] = push_name
    if media_type:
        info["MediaType"] = media_type
    return {"Info": info, "Message": message}


def flood_event(i: int) -> dict[str, Any]:
    """Message ``i`` of a benchmark flood: a ~0.3 KB direct text from user ``i % 200``."""
    return message_event(
        f"message {i} " + "lorem ipsum " * 20,
        sender=f"4917{i % 200:09d}@s.whatsapp.net",
        message_id=f"3EB0{i:016X}",
        timestamp=int(time.time() * 1000),
    )


# --- records ----------------------------------------------------------------------------


@dataclass
class Call:
    """One call the bot made, and what the fake answered (``result`` or an error kind)."""

    op: str
    args: dict[str, Any]
    at: float
    conn: int
    error: str | None = None


@dataclass(frozen=True)
class Sent:
    """A message the account sent, as sent (``quote``: the wire's quote dict or None;
    :meth:`FakeWhatsAppWeb.text_of` says what it shows after edits)."""

    id: str
    chat: str
    text: str
    quote: dict[str, Any] | None
    at: float


@dataclass(frozen=True)
class Edit:
    chat: str
    message_id: str
    text: str
    at: float


@dataclass(frozen=True)
class Presence:
    chat: str
    composing: bool
    at: float


@dataclass(frozen=True)
class Read:
    chat: str
    sender: str
    ids: tuple[str, ...]
    timestamp: int
    at: float


@dataclass
class Connection:
    """One websocket a client opened."""

    index: int
    ws: WebSocketConnection
    send: trio.MemorySendChannel[tuple[str, Any]]
    opened_at: float
    #: ``client``, ``server`` (a clean close), ``drop`` (no close frame); None: open.
    closed_by: str | None = None
    closed_at: float | None = None
    #: Messages go out under this lock, in order (the backlog at connect, then injects).
    delivering: trio.Lock = field(default_factory=trio.Lock)
    #: ``connected`` went out: injected messages are delivered here.
    ready: bool = False
    qr_scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: Message frames that may still be queued (released as the writer sends them).
    room: trio.Semaphore = field(default_factory=lambda: trio.Semaphore(OUTBOX))

    def push(self, kind: str, value: Any = None) -> None:
        try:
            self.send.send_nowait((kind, value))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def event(self, name: str, /, **fields: Any) -> None:
        self.push("frame", {"type": "event", "event": name, **fields})


class _Error(Exception):
    """An error answer: ``kind``, status and retry_after as the wire has them."""

    def __init__(
        self, kind: str, message: str, status: int | None = None, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.kind, self.message, self.status, self.retry_after = kind, message, status, retry_after


class FakeWhatsAppWeb(FakePlatform[Call]):
    """The fake account (see the module docstring)."""

    def __init__(
        self,
        *,
        paired: bool = True,
        account: Account = DEFAULT_ACCOUNT,
        qr_interval_s: float = 20.0,
    ) -> None:
        super().__init__()
        self.account = account
        self.paired = paired
        self.url = ""
        #: Seconds between QR codes of an unpaired connection (whatsmeow: 60, then 20).
        self.qr_interval_s = qr_interval_s
        #: Edits later than this after the send are refused (WhatsApp: 15 minutes).
        self.edit_window_s: float | None = 900.0
        self.connections: list[Connection] = []
        self.sent: list[Sent] = []
        self.edits: list[Edit] = []
        self.presences: list[Presence] = []
        self.reads: list[Read] = []
        #: Ack ids (the message ids) the client acknowledged, in order.
        self.acked: list[str] = []
        #: (message id, connection index, trio time) of every delivery, redeliveries too.
        self.deliveries: list[tuple[str, int, float]] = []
        self.qr_codes: list[str] = []
        self.pair_phones: list[str] = []
        self.pair_codes: list[str] = []
        self.logouts = 0
        #: Benchmarks: after every paired connect, this many text messages from distinct
        #: users (the same ids each time: a bench's runs each bring a fresh store).
        self.flood_on_connect = 0
        self._unacked: dict[str, dict[str, Any]] = {}
        self._media: dict[str, bytes] = {}
        self._lost_next: dict[str, int] = {}
        self._logged_out_offline: str | None = None
        self._refusals: list[tuple[str, str]] = []

    # -- reading ---------------------------------------------------------------------------

    @property
    def live(self) -> Connection | None:
        """The open connection (None: the client is not connected)."""
        for conn in reversed(self.connections):
            if conn.closed_by is None:
                return conn
        return None

    def ops(self, op: str) -> list[Call]:
        return [c for c in self.calls if c.op == op]

    def text_of(self, message_id: str) -> str:
        """The text a sent message shows now (after its edits)."""
        for edit in reversed(self.edits):
            if edit.message_id == message_id:
                return edit.text
        for msg in self.sent:
            if msg.id == message_id:
                return msg.text
        raise KeyError(message_id)

    def answers(self, chat: str) -> list[str]:
        """The account's messages in ``chat`` as they read now, in the order sent."""
        return [self.text_of(msg.id) for msg in self.sent if msg.chat == chat]

    @property
    def unacked(self) -> list[str]:
        """Message ids waiting for their ack (delivered again at the next connect)."""
        return list(self._unacked)

    async def wait_connected(self) -> Connection:
        """Wait for a live connection that got ``connected`` (paired); put a deadline
        around it."""
        await self.wait_until(lambda: self.live is not None and self.live.ready)
        conn = self.live
        assert conn is not None
        return conn

    async def wait_acked(self, message_id: str) -> None:
        """Wait until the client acknowledged ``message_id`` (put a deadline around it)."""
        await self.wait_until(lambda: message_id in self.acked)

    # -- scripting -------------------------------------------------------------------------

    async def inject(self, event: dict[str, Any]) -> str:
        """A message arrives (a :func:`message_event` dict): delivered now on the live
        connection, else at the next connect; returns its message id."""
        info = event.setdefault("Info", {})
        message_id = str(info.get("ID") or "")
        if not message_id:
            message_id = info["ID"] = new_message_id()
        self._unacked[message_id] = event
        self.changed()
        conn = self.live
        if conn is not None and conn.ready:
            async with conn.delivering:
                await self._deliver(conn, message_id)
        return message_id

    def add_media(self, message_id: str, data: bytes) -> None:
        """What ``download`` answers for the media of message ``message_id``."""
        self._media[message_id] = data

    def lose_next(self, op: str, count: int = 1) -> None:
        """The next ``count`` calls of ``op`` are performed, then the socket closes
        unanswered (the client cannot know the call was carried out)."""
        self._lost_next[op.lower()] = self._lost_next.get(op.lower(), 0) + count

    async def drop_connection(self) -> None:
        """Close the live socket without a close frame (the client's connect raises)."""
        conn = self.live
        if conn is not None:
            conn.push("drop")
            await self.wait_until(lambda: conn.closed_by is not None)

    async def log_out(self, reason: str = "LOGGED_OUT") -> None:
        """The phone removed this device: ``logged_out`` and a clean close, unpaired.  With
        no live connection, the next connect is told so (``on_connect``) and closed."""
        self.paired = False
        conn = self.live
        if conn is None:
            self._logged_out_offline = reason
            self.changed()
            return
        conn.event("logged_out", reason=reason, on_connect=False)
        conn.push("close", (1000, "logged out"))
        await self.wait_until(lambda: conn.closed_by is not None)

    async def replace(self) -> None:
        """Another client took the session: ``replaced``, then a clean close."""
        conn = self.live
        if conn is not None:
            conn.event("replaced")
            conn.push("close", (1000, "replaced"))
            await self.wait_until(lambda: conn.closed_by is not None)

    def push(self, event: str, /, **fields: Any) -> None:
        """Any event on the live connection (``disconnected``, ``keepalive_lost``
        ``errors=``, ``connect_failed`` ``reason=, message=`` ...)."""
        conn = self.live
        if conn is not None:
            conn.event(event, **fields)

    def refuse_connects(
        self, reason: str = "TEMP_BANNED", message: str = "", count: int = 1
    ) -> None:
        """The next ``count`` connects get ``connect_failed`` and a clean close."""
        self._refusals.extend([(reason, message)] * count)

    async def scan(self) -> None:
        """The user scans the QR code (or types the pair code): ``paired``, then
        ``connected`` on the live connection, then the waiting messages."""
        await self.wait_until(lambda: self.live is not None)
        conn = self.live
        assert conn is not None
        if self.paired:
            raise RuntimeError("the fake account is already paired")
        conn.qr_scope.cancel()
        self.paired = True
        conn.event("paired", jid=self.account.jid, name=self.account.push_name, error="")
        self.changed()
        await self._ready(conn)

    # -- the socket ------------------------------------------------------------------------

    async def _serve(self, request: WebSocketRequest) -> None:
        try:
            fault = await self.faults_for("connect")
        except DropConnection:
            ws = await request.accept()
            await ws._stream.aclose()  # opened, then gone without a close frame
            return
        if fault is not None:
            await request.reject(fault.status, body=(fault.description or "refused").encode())
            return
        ws = await request.accept()
        send, recv = trio.open_memory_channel[tuple[str, Any]](OUTBOX + RESERVE)
        conn = Connection(len(self.connections), ws, send, trio.current_time())
        for other in self.connections:  # one live connection per account
            if other.closed_by is None:
                other.event("replaced")
                other.push("close", (1000, "replaced"))
        self.connections.append(conn)
        self.changed()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer, conn, recv)
            try:
                await self._greet(conn, nursery)
                while True:
                    data = await ws.get_message()
                    await self._on_frame(conn, data)
            except ConnectionClosed:
                if conn.closed_by is None:
                    conn.closed_by, conn.closed_at = "client", trio.current_time()
            finally:
                conn.ready = False
                send.close()
                conn.room.release()  # a delivery waiting for room fails now (closed), not hangs
                self.changed()
                nursery.cancel_scope.cancel()

    async def _greet(self, conn: Connection, nursery: trio.Nursery) -> None:
        if self._logged_out_offline is not None:
            reason, self._logged_out_offline = self._logged_out_offline, None
            conn.event("logged_out", reason=reason, on_connect=True)
            conn.push("close", (1000, "logged out"))
        elif self._refusals:
            reason, message = self._refusals.pop(0)
            conn.event("connect_failed", reason=reason, message=message)
            conn.push("close", (1000, "connect failed"))
        elif self.paired:
            nursery.start_soon(self._ready, conn)  # the backlog, while calls are answered
        else:
            nursery.start_soon(self._show_qr, conn)

    async def _ready(self, conn: Connection) -> None:
        """``connected``, then the backlog in order; injects queue behind it."""
        async with conn.delivering:
            conn.event("connected")
            conn.ready = True
            self.changed()
            for message_id in list(self._unacked):
                await self._deliver(conn, message_id)
            for i in range(self.flood_on_connect):
                event = flood_event(i)
                self._unacked[event["Info"]["ID"]] = event
                await self._deliver(conn, event["Info"]["ID"])

    async def _deliver(self, conn: Connection, message_id: str) -> None:
        event = self._unacked.get(message_id)
        if event is None or conn.closed_by is not None:
            return
        frame = {"type": "event", "event": "message", "raw": event, "ack": message_id}
        await conn.room.acquire()
        try:
            conn.send.send_nowait(("message", frame))
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            conn.room.release()
            return
        self.deliveries.append((message_id, conn.index, trio.current_time()))
        self.changed()

    async def _show_qr(self, conn: Connection) -> None:
        with conn.qr_scope:
            while not self.paired:
                code = "2@" + ",".join(
                    base64.b64encode(secrets.token_bytes(n)).decode() for n in (18, 32, 32, 32)
                )
                self.qr_codes.append(code)
                conn.event("qr", code=code)
                self.changed()
                await trio.sleep(self.qr_interval_s)

    async def _writer(
        self, conn: Connection, recv: trio.MemoryReceiveChannel[tuple[str, Any]]
    ) -> None:
        def sent(kind: str) -> None:
            if kind == "message":
                conn.room.release()

        await write_frames(conn, recv, self.changed, on_sent=sent)

    async def _on_frame(self, conn: Connection, data: str | bytes) -> None:
        try:
            frame = json.loads(data)
            kind = frame["type"]
        except (ValueError, KeyError, TypeError):
            conn.push("close", (1003, "bad frame"))
            return
        if kind == "ack":
            ack = str(frame.get("ack"))
            if self._unacked.pop(ack, None) is not None:
                self.acked.append(ack)
                self.changed()
            return
        if kind != "call" or not isinstance(frame.get("args", {}), dict):
            conn.push("close", (1003, "bad frame"))
            return
        call_id, op, args = frame.get("id"), str(frame.get("op")), frame.get("args") or {}
        call = self.record(Call(op, args, trio.current_time(), conn.index))
        try:
            fault = await self.faults_for(op)
        except DropConnection:
            call.error = "dropped"
            conn.push("drop")  # closed instead of answered: not performed
            return
        try:
            if fault is not None:
                raise self._fault_error(fault)
            result = self._handle(conn, op, args)
        except _Error as err:
            call.error = err.kind
            answer: dict[str, Any] = {
                "type": "error",
                "id": call_id,
                "kind": err.kind,
                "message": err.message,
                "status": err.status,
                "retry_after": err.retry_after,
            }
        else:
            answer = {"type": "result", "id": call_id, "result": result}
        self.changed()
        if self._losing(op):
            call.error = "lost"
            conn.push("drop")  # performed, but the answer never reaches the client
            return
        try:
            await conn.send.send(("frame", answer))  # waits for a client that reads slowly
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            return
        if op == "disconnect" or (op == "logout" and call.error is None):
            conn.push("close", (1000, op))

    def _losing(self, op: str) -> bool:
        left = self._lost_next.get(op.lower(), 0)
        if left > 0:
            self._lost_next[op.lower()] = left - 1
            return True
        return self.losing(op)

    @staticmethod
    def _fault_error(fault: Fault) -> _Error:
        message = fault.description or f"fault {fault.status}"
        kind = fault.extra.get("kind")
        if kind is not None:
            return _Error(str(kind), message, fault.status, fault.retry_after)
        if fault.status == 404:
            return _Error("not_found", message, 404)
        if fault.status == 429:
            retry = 1.0 if fault.retry_after is None else fault.retry_after
            return _Error("rate_limited", message, 429, retry)
        return _Error("transport", message, fault.status)

    # -- the calls -------------------------------------------------------------------------

    def _handle(self, conn: Connection, op: str, args: dict[str, Any]) -> Any:
        now = trio.current_time()
        if op not in OPS:
            raise _Error("refused", f"unknown op {op[:40]!r}")
        if op == "me":
            if not self.paired:
                return None
            a = self.account
            return {"jid": a.jid, "lid": a.lid, "push_name": a.push_name, "platform": a.platform}
        if op == "disconnect":
            return None
        if op == "pair_phone":
            if self.paired:
                raise _Error("refused", "already paired")
            phone = str(args.get("phone", ""))
            if not phone.isdigit() or not 7 <= len(phone) <= 15:
                raise _Error("refused", "phone must be digits with the country code")
            self.pair_phones.append(phone)
            code = "".join(secrets.choice(_PAIR_ALPHABET) for _ in range(8))
            code = f"{code[:4]}-{code[4:]}"
            self.pair_codes.append(code)
            return code
        if not self.paired:  # whatsmeow's ErrNotLoggedIn: certainly not carried out
            raise _Error("transport", "not logged in", 401)
        if op == "logout":
            self.paired = False
            self.logouts += 1
            return None
        if op == "download":
            return self._download(args)
        chat = str(args.get("chat", ""))
        if "@" not in chat:
            raise _Error("refused", "bad chat JID")
        if op == "send":
            text = str(args.get("text", ""))
            quote = args.get("quote")
            if quote is not None and not isinstance(quote, dict):
                raise _Error("refused", "bad quote")
            message_id = new_message_id()
            self.sent.append(Sent(message_id, chat, text, quote, now))
            return message_id
        if op == "edit":
            message_id, text = str(args.get("message_id", "")), str(args.get("text", ""))
            target = next((m for m in self.sent if m.id == message_id), None)
            if target is None or target.chat != chat:
                raise _Error("not_found", "no such message of the account in that chat", 404)
            if self.edit_window_s is not None and now - target.at > self.edit_window_s:
                raise _Error("refused", "the message is too old to edit")
            self.edits.append(Edit(chat, message_id, text, now))
            return None
        if op == "presence":
            self.presences.append(Presence(chat, bool(args.get("composing")), now))
            return None
        if op == "mark_read":
            ids = args.get("message_ids")
            if not isinstance(ids, list) or not ids:
                raise _Error("refused", "no message ids")
            sender = str(args.get("sender", ""))
            stamp = int(args.get("timestamp", 0))
            self.reads.append(Read(chat, sender, tuple(str(i) for i in ids), stamp, now))
            return None
        raise AssertionError(op)  # every op of OPS is handled above

    def _download(self, args: dict[str, Any]) -> str:
        raw, name = args.get("raw"), str(args.get("field", ""))
        if not isinstance(raw, dict):
            raise _Error("refused", "no event")
        message = unwrapped(raw.get("Message") or {})
        if not isinstance(message.get(name), dict):
            raise _Error("refused", f"the message has no {name[:40]}")
        data = self._media.get(str((raw.get("Info") or {}).get("ID", "")))
        if data is None:
            raise _Error("not_found", "media not found (expired)", 404)
        return base64.b64encode(data).decode()


@asynccontextmanager
async def open_fake_whatsapp_web(
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    paired: bool = True,
    account: Account = DEFAULT_ACCOUNT,
    qr_interval_s: float = 20.0,
) -> AsyncIterator[FakeWhatsAppWeb]:
    """Run a fake WhatsApp Web account (a websocket on ``host``, a kernel port unless
    ``port``) for the block; :attr:`FakeWhatsAppWeb.url` is its ``ws://`` URL."""
    fake = FakeWhatsAppWeb(paired=paired, account=account, qr_interval_s=qr_interval_s)

    async def ws(*, task_status: trio.TaskStatus[Any] = trio.TASK_STATUS_IGNORED) -> None:
        await serve_websocket(fake._serve, host, port, None, task_status=task_status)

    async with open_servers(ws) as (server,):
        fake.url = f"ws://{host}:{server.port}"
        yield fake


#: How the idle bench runs this fake: the bot's first contact is its connection.
IDLE_BENCH: IdleBench[FakeWhatsAppWeb] = IdleBench(
    open_fake_whatsapp_web,
    lambda f: {"engine_url": f.url},
    lambda f: bool(f.connections),
)


def main(argv: list[str] | None = None) -> None:
    """Run the fake as a process (see :mod:`dshim.testing.fakes.cli`; ``--port`` is the
    websocket's); ``--unpaired`` starts it unpaired (QR codes until a login); ``--flood n``
    (benchmarks) delivers n text messages after every connect and prints one JSON line."""
    module = "dshim.testing.fakes.whatsapp_web"
    p = cli.parser(
        __doc__, module=module, flood="messages after each connect (benchmarks; prints JSON)"
    )
    p.add_argument("--unpaired", action="store_true", help="start unpaired: QR codes until a login")
    args = p.parse_args(argv)

    def announce(fake: FakeWhatsAppWeb) -> cli.Announcement:
        if args.flood is not None:
            fake.flood_on_connect = args.flood
        http = fake.url.replace("ws://", "http://", 1)
        notes = {"account": fake.account.jid, "paired": "yes" if fake.paired else "no"}
        account = fake.account
        line = {"engine_url": fake.url, "jid": account.jid, "lid": account.lid}
        return cli.Announcement(
            "WhatsApp Web account (engine wire protocol)",
            http,
            "whatsapp_web",
            {"engine_url": fake.url},
            notes,
            line,
        )

    cli.run(
        args,
        module=module,
        open_fake=lambda: open_fake_whatsapp_web(
            host=args.host, port=args.port, paired=not args.unpaired
        ),
        announce=announce,
        json_line=args.flood is not None,
    )


if __name__ == "__main__":
    main(sys.argv[1:])
