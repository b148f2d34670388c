"""The one door to neonize (WhatsApp Web over whatsmeow): everything else of the
channel is sans-IO and never imports it.

The interface
-------------
:class:`WaEngine` is what the channel uses of one linked account -- connect, events,
send, edit, presence, download, mark read, pair by phone, logout, disconnect -- in
dshim's own terms (JIDs as ``user@server`` text, events as the small dataclasses below,
a message as the protobuf JSON :mod:`.protocol` maps).  :class:`NeonizeEngine` is that
interface over neonize; :mod:`dshim.testing.fakes.whatsapp_web` is the scripted fake
the tests run the channel against.  Both hand events over the same way: a message is
:class:`Incoming`, and the engine acknowledges it to WhatsApp only once the channel set
its ``taken`` (the pipeline accepted it; whatsmeow sends the ack when its handler
returns, and :class:`NeonizeEngine`'s handler returns only then), so a message the
process dies on is delivered again at the next connect.

Connection: :meth:`WaEngine.connect` runs the connection and returns only when it ended
(:meth:`~WaEngine.disconnect`, logged out, replaced) or raises
:class:`~dshim.errors.TransportError` when it could not connect; whatsmeow reconnects
by itself after a drop within a connection (``Disconnected`` then ``Connected`` events).

neonize is an optional extra (``dshim[whatsapp-web]``): :func:`load_neonize` imports it
on demand and says how to install it when it is missing.  Its import runs
``os.popen("uname -a").read()`` and never closes the pipe (neonize 0.5.2,
``utils/platform.py``), which leaves a child to reap and an unclosed file for the garbage
collector; during the import ``os.popen`` is one that runs the command to completion and
hands back its output, so nothing is left behind.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import os
import subprocess
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import IO, Any, Protocol

import structlog
import trio

from dshim.channels.whatsapp_web.bridge import ThreadBridge
from dshim.errors import ChannelError, ConfigError, TransportError

log = structlog.get_logger("dshim.whatsapp_web")

#: The versions the adapter is written against (pyproject's extra pins the same range).
NEONIZE_RANGE = ">=0.5.2,<0.6"


def load_neonize(module: str = "neonize") -> ModuleType:
    """Import ``module`` of neonize (``neonize``, ``neonize.proto.Neonize_pb2`` ...)."""
    with _IMPORT_LOCK:
        real, os.popen = os.popen, _popen_done  # type: ignore[assignment]  # for reading only
        try:
            return importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] == "neonize":
                raise ConfigError(
                    "channel 'whatsapp_web' needs neonize: pip install 'dshim[whatsapp-web]'"
                ) from None
            raise
        finally:
            os.popen = real


_IMPORT_LOCK = threading.Lock()


def _popen_done(cmd: str, mode: str = "r", buffering: int = -1, **_: Any) -> IO[str]:
    """``os.popen`` for reading, with the child finished and the pipe closed."""
    done = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=10, check=False)
    return io.StringIO(done.stdout)


#: What the adapter calls on ``neonize.client.NewClient``: the method and the parameters
#: it passes by name (the fake engine offers the same calls; ``tests/test_whatsapp_web_engine.py``
#: checks them against the installed neonize, so neither can drift from the library).
CLIENT_CALLS: dict[str, tuple[str, ...]] = {
    "__init__": ("name", "props"),
    "connect": (),
    "disconnect": (),
    "stop": (),
    "logout": (),
    "get_me": (),
    "PairPhone": ("phone", "show_push_notification"),
    "send_message": ("to", "message", "link_preview"),
    "build_reply_message": ("message", "quoted", "link_preview"),
    "edit_message": ("chat", "message_id", "new_message"),
    "send_chat_presence": ("jid", "state", "media"),
    "send_presence": ("presence",),
    "mark_read": ("chat", "sender", "receipt", "timestamp"),
    "download_any": ("message",),
}

#: The events the adapter subscribes to (``neonize.events``): messages, the QR and pair
#: code of a login, the connection's state, and the two ends that need the user (logged
#: out from the phone) or another client (the session taken over).
EVENTS = (
    "MessageEv",
    "QREv",
    "PairStatusEv",
    "ConnectedEv",
    "DisconnectedEv",
    "LoggedOutEv",
    "StreamReplacedEv",
    "ConnectFailureEv",
    "KeepAliveTimeoutEv",
    "TemporaryBanEv",
    "ClientOutdatedEv",
)


# --- the interface ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Account:
    """The linked account: its phone JID and LID (``user@server``) and push name."""

    jid: str
    lid: str = ""
    push_name: str = ""
    platform: str = ""


@dataclass(frozen=True, slots=True)
class Quote:
    """What a reply quotes: the stanza id, its sender (``user@server``) and a snapshot of
    its content as a ``waE2E.Message`` in protobuf JSON (``{"conversation": "..."}``)."""

    stanza_id: str
    participant: str
    message: dict[str, Any]


@dataclass(eq=False, slots=True)
class Incoming:
    """A message event: neonize's ``Message`` as protobuf JSON (``MessageToDict`` with
    proto field names), acknowledged to WhatsApp once ``taken`` is set."""

    raw: bytes
    taken: trio.Event = field(default_factory=trio.Event)


@dataclass(frozen=True, slots=True)
class QrCode:
    """A QR code to show for linking (WhatsApp rotates them: each one replaces the last)."""

    code: str


@dataclass(frozen=True, slots=True)
class Paired:
    """Linking finished (``PairStatus``): the account, or the error WhatsApp gave."""

    jid: str
    name: str = ""
    error: str = ""


@dataclass(frozen=True, slots=True)
class Connected:
    """The connection is up and authenticated."""


@dataclass(frozen=True, slots=True)
class Disconnected:
    """The connection dropped; whatsmeow reconnects by itself."""


@dataclass(frozen=True, slots=True)
class LoggedOut:
    """The phone removed this device (or WhatsApp revoked the session): a new login is
    needed.  ``reason`` is whatsmeow's (``LOGGED_OUT``, ``MAIN_DEVICE_GONE`` ...)."""

    reason: str = ""
    on_connect: bool = False


@dataclass(frozen=True, slots=True)
class Replaced:
    """Another client connected with this session's keys (``StreamReplaced``)."""


@dataclass(frozen=True, slots=True)
class ConnectFailed:
    """WhatsApp refused the connection (``ConnectFailure``, ``TemporaryBan``,
    ``ClientOutdated``): ``reason`` in WhatsApp's words."""

    reason: str
    message: str = ""


@dataclass(frozen=True, slots=True)
class KeepAliveLost:
    """Keepalive pings go unanswered (whatsmeow reconnects when it gives up)."""

    errors: int = 0


EngineEvent = (
    Incoming
    | QrCode
    | Paired
    | Connected
    | Disconnected
    | LoggedOut
    | Replaced
    | ConnectFailed
    | KeepAliveLost
)

#: ``ConnectFailure`` reasons that end a session for good (a new login is needed).
LOGOUT_REASONS = frozenset({"LOGGED_OUT", "MAIN_DEVICE_GONE", "UNKNOWN_LOGOUT"})


class WaEngine(Protocol):
    """One linked account, as the channel uses it (see the module docstring)."""

    def events(self) -> AsyncIterator[EngineEvent]:
        """Every event in the order the library gave them, until :meth:`close`."""
        ...

    async def connect(self) -> None:
        """Run the connection until it ends; TransportError when it cannot connect."""
        ...

    async def me(self) -> Account | None:
        """The linked account, or None when the session database holds none."""
        ...

    async def send(self, chat: str, text: str, *, quote: Quote | None = None) -> str:
        """Send ``text`` to ``chat`` (quoting ``quote``); the new message's id."""
        ...

    async def edit(self, chat: str, message_id: str, text: str) -> None:
        """Replace the text of one of the account's messages (WhatsApp: 15 minutes)."""
        ...

    async def presence(self, chat: str, *, composing: bool) -> None:
        """``composing`` (typing) or ``paused`` in ``chat``."""
        ...

    async def mark_read(
        self, chat: str, sender: str, message_ids: list[str], *, timestamp: int
    ) -> None:
        """Blue ticks for the messages (``sender``: who wrote them; in a direct chat the
        chat itself)."""
        ...

    async def download(self, raw: bytes, field: str) -> bytes:
        """The media of message field ``field`` (``imageMessage`` ...) of the event
        ``raw`` (an :class:`Incoming`'s bytes, also after a restart)."""
        ...

    async def pair_phone(self, phone: str) -> str:
        """Ask WhatsApp for a pair code for ``phone`` (digits with country code): the code
        the user types under Linked devices -> Link with phone number."""
        ...

    async def logout(self) -> None:
        """Unlink this device (the session ends for good)."""
        ...

    async def disconnect(self) -> None:
        """End the connection (``connect`` returns)."""
        ...

    def close(self) -> None:
        """No more events; handlers waiting on the pipeline are let go."""
        ...


# --- over neonize -----------------------------------------------------------------------


def jid_text(jid: Any) -> str:
    """A neonize ``JID`` as ``user@server`` (the device left out); "" when empty."""
    if jid is None or not getattr(jid, "User", "") or getattr(jid, "IsEmpty", False):
        return ""
    return f"{jid.User}@{jid.Server}"


def session_path(data_dir: Path, bot: str) -> Path:
    """Where a bot's session database lives: ``<data dir>/whatsapp_web/<bot>.db``."""
    return data_dir / "whatsapp_web" / f"{bot}.db"


def saved_account(path: Path) -> Account | None:
    """The account a session database holds, read without connecting (a second
    connection with the same keys would throw the running one out: ``StreamReplaced``).
    None when there is no database or no linked device in it.  Reads whatsmeow's
    ``whatsmeow_device`` table (its ids and names only, never a key)."""
    import sqlite3

    if not path.is_file() or path.stat().st_size == 0:
        return None
    try:
        with contextlib.closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)) as db:
            row = db.execute(
                "SELECT jid, COALESCE(lid, ''), push_name, platform FROM whatsmeow_device LIMIT 1"
            ).fetchone()
    except sqlite3.Error:
        return None
    if row is None or not row[0]:
        return None
    return Account(
        jid=_no_device(str(row[0])),
        lid=_no_device(str(row[1])),
        push_name=str(row[2]),
        platform=str(row[3]),
    )


def _no_device(jid: str) -> str:
    """``user[:device]@server`` without the device."""
    if not jid:
        return ""
    user, _, server = jid.partition("@")
    return f"{user.partition(':')[0]}@{server}" if server else user.partition(":")[0]


def prepare_session(path: Path) -> None:
    """The database's directory (0700) and the file itself (0600) before whatsmeow opens
    it, so the keys are never readable by others, not even for a moment."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    tighten_session(path)


def tighten_session(path: Path) -> None:
    """0600 on the database and the journal files SQLite keeps next to it."""
    for candidate in (path, *(path.with_name(path.name + s) for s in ("-wal", "-shm", "-journal"))):
        try:
            os.chmod(candidate, 0o600)
        except FileNotFoundError:
            pass


class NeonizeEngine(WaEngine):
    """:class:`WaEngine` over ``neonize.client.NewClient`` (create it inside the bot's trio
    run: its bridge binds to the run).  Every call runs on a worker thread under the
    bridge's limiter and deadline; :meth:`connect` runs whatsmeow's blocking connection on
    a thread of its own."""

    def __init__(self, path: Path, *, device_name: str = "dshim") -> None:
        self.path = path
        self.device_name = device_name
        self.bridge: ThreadBridge[EngineEvent] = ThreadBridge()
        self._client: Any = None
        self._lib: dict[str, ModuleType] = {}
        self._connect_limiter = trio.CapacityLimiter(1)
        self._quotes: OrderedDict[str, Quote] = OrderedDict()

    # -- loading ---------------------------------------------------------------------------

    async def _load(self) -> Any:
        if self._client is None:
            self._client = await trio.to_thread.run_sync(self._make_client)
        return self._client

    def _make_client(self) -> Any:
        for key, name in (
            ("client", "neonize.client"),
            ("events", "neonize.events"),
            ("pb", "neonize.proto.Neonize_pb2"),
            ("companion", "neonize.proto.waCompanionReg.WAWebProtobufsCompanionReg_pb2"),
            ("wa", "neonize.proto.waE2E.WAWebProtobufsE2E_pb2"),
            ("enum", "neonize.utils.enum"),
            ("json_format", "google.protobuf.json_format"),
        ):
            self._lib[key] = load_neonize(name)
        # neonize logs (and warns of a missing ffmpeg) on its own loggers: dshim's log
        # says what matters, in its own records.
        logging.getLogger("neonize").setLevel(logging.ERROR)
        logging.getLogger("whatsmeow").setLevel(logging.ERROR)
        prepare_session(self.path)
        device = self._lib["companion"].DeviceProps
        props = device(os=self.device_name, platformType=device.DESKTOP)
        client = self._lib["client"].NewClient(name=str(self.path), props=props)
        ev = self._lib["events"]
        client.event(ev.MessageEv)(self._on_message)
        client.event(ev.PairStatusEv)(self._on_pair)
        client.event(ev.ConnectedEv)(self._on_connected)
        client.event(ev.DisconnectedEv)(lambda _c, _e: self.bridge.hand_over(Disconnected()))
        client.event(ev.LoggedOutEv)(self._on_logged_out)
        client.event(ev.StreamReplacedEv)(lambda _c, _e: self.bridge.hand_over(Replaced()))
        client.event(ev.ConnectFailureEv)(self._on_failure)
        client.event(ev.TemporaryBanEv)(self._on_ban)
        client.event(ev.ClientOutdatedEv)(
            lambda _c, _e: self.bridge.hand_over(ConnectFailed(reason="CLIENT_OUTDATED"))
        )
        client.event(ev.KeepAliveTimeoutEv)(
            lambda _c, e: self.bridge.hand_over(KeepAliveLost(int(e.ErrorCount)))
        )
        client.qr(lambda _c, data: self.bridge.hand_over(QrCode(bytes(data).decode())))
        return client

    # -- neonize's threads -----------------------------------------------------------------

    def _on_message(self, _client: Any, event: Any) -> None:
        as_dict = self._lib["json_format"].MessageToDict(event, preserving_proto_field_name=True)
        incoming = Incoming(json.dumps(as_dict, separators=(",", ":")).encode())
        self.bridge.hand_over(incoming, until=incoming.taken)

    def _on_connected(self, client: Any, _event: Any) -> None:
        # whatsmeow: send a presence once after connecting, or contacts see no push name
        # (and chat presence, "typing...", is not shown).  While the account is
        # "available" here, WhatsApp holds back the phone's own notifications.
        try:
            client.send_presence(presence=self._lib["enum"].Presence.AVAILABLE)
        except Exception as exc:
            log.info("presence_failed", error=str(exc)[:200])
        self.bridge.hand_over(Connected())

    def _on_pair(self, _client: Any, event: Any) -> None:
        self.bridge.hand_over(
            Paired(jid=jid_text(event.ID), name=event.BusinessName, error=event.Error)
        )

    def _on_logged_out(self, _client: Any, event: Any) -> None:
        reason = self._lib["pb"].ConnectFailure.DESCRIPTOR.fields_by_name["Reason"]
        name = reason.enum_type.values_by_number.get(event.Reason)
        self.bridge.hand_over(
            LoggedOut(reason=name.name if name else str(event.Reason), on_connect=event.OnConnect)
        )

    def _on_failure(self, _client: Any, event: Any) -> None:
        reason = event.DESCRIPTOR.fields_by_name["Reason"].enum_type.values_by_number.get(
            event.Reason
        )
        name = reason.name if reason else str(event.Reason)
        if name in LOGOUT_REASONS:
            self.bridge.hand_over(LoggedOut(reason=name, on_connect=True))
        else:
            self.bridge.hand_over(ConnectFailed(reason=name, message=event.Message))

    def _on_ban(self, _client: Any, event: Any) -> None:
        code = event.DESCRIPTOR.fields_by_name["Code"].enum_type.values_by_number.get(event.Code)
        self.bridge.hand_over(
            ConnectFailed(
                reason="TEMP_BANNED",
                message=f"{code.name if code else event.Code}, expires in {event.Expire} s",
            )
        )

    # -- the interface ---------------------------------------------------------------------

    def events(self) -> AsyncIterator[EngineEvent]:
        return self.bridge.events()

    def close(self) -> None:
        self.bridge.close()

    async def connect(self) -> None:
        client = await self._load()
        try:
            await trio.to_thread.run_sync(
                client.connect, limiter=self._connect_limiter, abandon_on_cancel=True
            )
        except Exception as exc:
            raise TransportError(f"connect: {str(exc)[:300]}") from exc
        finally:
            await trio.to_thread.run_sync(tighten_session, self.path)

    async def me(self) -> Account | None:
        client = await self._load()
        device = await self.bridge.call("get_me", client.get_me)
        jid = jid_text(device.JID)
        if not jid:
            return None
        return Account(
            jid=jid, lid=jid_text(device.LID), push_name=device.PushName, platform=device.Platform
        )

    def _jid(self, text: str) -> Any:
        user, _, server = text.partition("@")
        return self._lib["pb"].JID(
            User=user,
            Server=server or "s.whatsapp.net",
            RawAgent=0,
            Device=0,
            Integrator=0,
            IsEmpty=False,
        )

    def _text_message(self, text: str, quote: Quote | None) -> Any:
        wa = self._lib["wa"]
        if quote is None:
            return wa.Message(conversation=text)
        quoted = self._lib["json_format"].ParseDict(
            quote.message, wa.Message(), ignore_unknown_fields=True
        )
        context = wa.ContextInfo(
            stanzaID=quote.stanza_id, participant=quote.participant, quotedMessage=quoted
        )
        return wa.Message(
            extendedTextMessage=wa.ExtendedTextMessage(text=text, contextInfo=context)
        )

    async def send(self, chat: str, text: str, *, quote: Quote | None = None) -> str:
        client = await self._load()
        message = self._text_message(text, quote)
        sent = await self.bridge.call(
            "send_message",
            client.send_message,
            to=self._jid(chat),
            message=message,
            link_preview=False,
            errors={Exception: send_error},
        )
        if not sent.ID:
            raise ChannelError("send_message: WhatsApp returned no message id")
        message_id = str(sent.ID)
        if quote is not None:  # an edit keeps the reply's quote (see edit)
            self._quotes[message_id] = quote
            while len(self._quotes) > QUOTES_KEPT:
                self._quotes.popitem(last=False)
        return message_id

    async def edit(self, chat: str, message_id: str, text: str) -> None:
        client = await self._load()
        # The new content has the shape of the first send: a reply stays a reply (with
        # its contextInfo) on every edit.
        await self.bridge.call(
            "edit_message",
            client.edit_message,
            chat=self._jid(chat),
            message_id=message_id,
            new_message=self._text_message(text, self._quotes.get(message_id)),
            errors={Exception: send_error},
        )

    async def presence(self, chat: str, *, composing: bool) -> None:
        client = await self._load()
        enum = self._lib["enum"]
        state = (
            enum.ChatPresence.CHAT_PRESENCE_COMPOSING
            if composing
            else enum.ChatPresence.CHAT_PRESENCE_PAUSED
        )
        await self.bridge.call(
            "send_chat_presence",
            client.send_chat_presence,
            jid=self._jid(chat),
            state=state,
            media=enum.ChatPresenceMedia.CHAT_PRESENCE_MEDIA_TEXT,
        )

    async def mark_read(
        self, chat: str, sender: str, message_ids: list[str], *, timestamp: int
    ) -> None:
        client = await self._load()
        await self.bridge.call(
            "mark_read",
            client.mark_read,
            *message_ids,
            chat=self._jid(chat),
            sender=self._jid(sender),
            receipt=self._lib["enum"].ReceiptType.READ,
            timestamp=timestamp,
        )

    async def download(self, raw: bytes, field: str) -> bytes:
        client = await self._load()
        wa = self._lib["wa"]
        event = json.loads(raw)
        message = unwrapped(event.get("Message") or {})
        media = message.get(field)
        if not isinstance(media, dict):
            raise ChannelError(f"the message has no {field}")
        parsed = self._lib["json_format"].ParseDict(
            {field: media}, wa.Message(), ignore_unknown_fields=True
        )
        data = await self.bridge.call("download_any", client.download_any, message=parsed)
        return bytes(data)

    async def pair_phone(self, phone: str) -> str:
        client = await self._load()
        code = await self.bridge.call(
            "PairPhone", client.PairPhone, phone=phone, show_push_notification=True
        )
        return str(code)

    async def logout(self) -> None:
        client = await self._load()
        await self.bridge.call("logout", client.logout)

    async def disconnect(self) -> None:
        if self._client is None:
            return
        client = self._client
        await self.bridge.call("disconnect", client.disconnect, deadline_s=2.5)
        # ``connect`` blocks in whatsmeow until its context is cancelled.
        await self.bridge.call("stop", client.stop, deadline_s=2.5)


#: Quotes of sent replies kept for their edits (an answer's messages, for a while).
QUOTES_KEPT = 1024
#: whatsmeow errors raised before anything went out (not connected, no session with a
#: device, no device list): the send certainly created nothing and may be retried.
_NOT_SENT = (
    "not connected",
    "not logged in",
    "failed to get device list",
    "no signal session",
    "failed to encrypt",
    "usync",
    "failed to get user info",
)


def send_error(exc: BaseException) -> ChannelError:
    """A send's or an edit's library error: certainly not sent (retried with backoff) when
    whatsmeow failed before the message left, else of unknown outcome."""
    text = str(exc)[:300]
    if any(marker in text.lower() for marker in _NOT_SENT):
        return TransportError(f"send_message: {text}", request_sent=False)
    return TransportError(f"send_message: {text}")


_WRAPPERS = (
    "ephemeralMessage",
    "viewOnceMessage",
    "viewOnceMessageV2",
    "viewOnceMessageV2Extension",
    "documentWithCaptionMessage",
)


def unwrapped(message: dict[str, Any]) -> dict[str, Any]:
    """The ``waE2E.Message`` inside the ephemeral / view-once wrappers (protobuf JSON)."""
    for _ in range(4):
        for wrapper in _WRAPPERS:
            inner = message.get(wrapper)
            if isinstance(inner, dict) and isinstance(inner.get("message"), dict):
                message = inner["message"]
                break
        else:
            return message
    return message
