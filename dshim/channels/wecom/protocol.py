"""WeCom AI bot (智能机器人), sans-IO: frames, the connection's bookkeeping, the mapping.

Theory of operation
-------------------
One websocket per bot carries everything (../shared/protocols/wecom.md §2-§4; WeCom doc
"智能机器人长连接", developer.work.weixin.qq.com/document/path/101463; the SDK
``@wecom/aibot-node-sdk`` ``src/ws.ts``).  Every frame is UTF-8 JSON
``{cmd, headers: {req_id}, body}``; the server answers every frame we send with an ack
``{headers: {req_id}, errcode, errmsg, body?}`` that carries no ``cmd`` and is matched to
the request by ``req_id`` alone.

Connection states::

    CONNECTING -> (socket open) SUBSCRIBING: aibot_subscribe {bot_id, secret} sent
    SUBSCRIBING -> errcode 0: LIVE (pings every 30 s, callbacks accepted)
                -> errcode != 0: credentials rejected -> fatal (AuthError), no retry loop:
                   the subscribe is rate-protected and a rejection is not transient
                -> no ack within 5 s / socket lost: reconnect with backoff 1-30 s
    LIVE -> 2 pings unacknowledged in a row: dead socket -> close, reconnect
         -> disconnected_event (a newer connection took the bot over; known by its
            event type alone, msgid or not: :class:`Takeover`): FatalChannelError,
            never reconnect (two deployments would evict each other forever)
         -> socket lost: every pending request fails (ConnectionLost), reconnect

:class:`WecomSession` is this state machine for the kit's websocket runner
(:mod:`dshim.net.ws`); :class:`Heartbeat` keeps its ping bookkeeping; :func:`classify`
sorts a received frame into an :class:`Ack` (matched to a pending request by the client)
or a :class:`Callback`.  ``req_id`` values we mint follow the SDK's convention
``<cmd>_<epoch ms>_<8 hex>`` (:func:`new_req_id`): the SDK and WeCom's own tooling
recognise subscribe and ping acks by that prefix.

What WeCom guarantees: callbacks (``aibot_msg_callback``, ``aibot_event_callback``) need no
ack and their redelivery is undocumented, so nothing is confirmed; ``body.msgid`` is the
dedup key (the pipeline's persisted dedup drops a repeat).  Frames that share a
``req_id`` — every reply to one inbound message — must be sent one at a time, each after
the previous ack (acks are matched by ``req_id`` only): the client keeps a bounded FIFO per
``req_id`` with a 5 s ack timeout.

Replies (§4): ``aibot_respond_msg`` with the *inbound* ``req_id`` (for 24 h after the
message), as a native stream: the first frame with a new ``stream.id`` opens the bubble,
later frames replace its whole content, ``finish: true`` ends it.  Content is at most
20,480 UTF-8 bytes (we keep a stream under :data:`STREAM_MAX_BYTES`), a stream expires 6
minutes after its first frame (errcode 846608; we rotate at :data:`STREAM_ROTATE_S`), and
846605 means the ``req_id`` is no longer valid.  Proactive pushes (``aibot_send_msg``,
markdown or template_card) go to ``chatid`` = the group id, or the user id in single chats.
Replies and pushes together are limited to 30 a minute and 1,000 an hour per conversation
(:class:`Budget`).  Welcome texts (``aibot_respond_welcome_msg``) and card updates
(``aibot_respond_update_msg``) must go out within 5 s of their event.

Mapping (§3, :func:`map_message`): ``chattype`` single -> direct (conversation
``from.userid``), group -> group (conversation ``chatid``).  Group callbacks reach the bot
only when it is @-mentioned, so they are addressed; the leading ``@name`` token (up to the
first whitespace) is removed.  ``text``, ``voice.content`` (speech-to-text) and the texts
of ``mixed`` are the content; images, files and videos are lazy download handles (URLs
valid ~5 minutes: they are fetched when the turn starts, see :mod:`.media`).  ``quote``
becomes ``reply_to``: content by ``quote.msgtype``, attachment kinds for media; WeCom
gives no quoted id, author or time, so those stay UNSET; a quote with nothing usable is
``not-delivered``.  Nothing here imports trio or httpx or reads a clock.
"""

from __future__ import annotations

import json
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from dshim.channels.kit.decode import decode, depth_exceeds
from dshim.channels.kit.ids import (
    TOKEN,
    BadId,
    BadTime,
    check_id,
    check_optional_id,
    plausible_time,
    shape,
)
from dshim.channels.wecom import models as m
from dshim.errors import (
    AuthError,
    ChannelError,
    FatalChannelError,
    NotFound,
    RateLimited,
    TransportError,
)
from dshim.model import (
    Attachment,
    Fetcher,
    InboundMessage,
    MediaRef,
    Option,
    ReplyReference,
    Skip,
)
from dshim.net.ws_session import Action, Close, Connected, Deliver, Ignored, Send, WsEnded

CHANNEL = "wecom"
DEFAULT_WS_URL = "wss://openws.work.weixin.qq.com"

# Commands (§2-§4).
SUBSCRIBE = "aibot_subscribe"
PING = "ping"
MSG_CALLBACK = "aibot_msg_callback"
EVENT_CALLBACK = "aibot_event_callback"
RESPOND = "aibot_respond_msg"
RESPOND_WELCOME = "aibot_respond_welcome_msg"
RESPOND_UPDATE = "aibot_respond_update_msg"
SEND = "aibot_send_msg"

#: Ping every 30 s (doc "保持心跳"); two unacknowledged in a row mean a dead socket.
PING_INTERVAL_S = 30.0
PINGS_UNACKED_MAX = 2
#: The SDK's local ack timeout per frame.
ACK_TIMEOUT_S = 5.0
#: The SDK's bound of frames queued behind one ``req_id``.
REQ_QUEUE_MAX = 500

#: ``content`` limit of a stream or markdown message (bytes of UTF-8) and ours, below it.
CONTENT_MAX_BYTES = 20_480
STREAM_MAX_BYTES = 18_000
#: Streams expire 6 minutes after their first frame (846608): finish before 5.
STREAM_ROTATE_S = 300.0
#: At most one intermediate stream frame this often.
STREAM_INTERVAL_S = 0.8
#: Replies are accepted for 24 h after the user's message.
REPLY_WINDOW_S = 24 * 3600.0
#: Replies and pushes per conversation: 30 a minute and 1,000 an hour.
BUDGET_WINDOWS: tuple[tuple[int, float], ...] = ((30, 60.0), (1000, 3600.0))
#: What the stream shows until the first text.
THINKING_MARK = "⏳ …"
#: What a bubble cut off by a lost socket shows once the answer was pushed in full.
MOVED_MARK = "⤵"
#: Bubbles that carry no answer text.
MARKS = frozenset({THINKING_MARK, MOVED_MARK})

ERR_REQ_ID_INVALID = 846605
ERR_STREAM_EXPIRED = 846608
#: WeCom's "API frequency out of limit" family (the socket's own code for the 30/min
#: quota is not documented: these are the server API's, treated as rate limits).
RATE_LIMIT_CODES = frozenset({45009, 45033, 45035})
RATE_LIMIT_RETRY_S = 2.0
#: Card buttons (button_interaction) at most.
CARD_BUTTONS_MAX = 6


# --- errors -----------------------------------------------------------------------------


class ConnectionLost(TransportError):
    """The socket closed while a frame waited for its ack (or before it could go out)."""


class ReplyExpired(NotFound):
    """846605: the inbound ``req_id`` is no longer valid; push instead."""


class StreamExpired(NotFound):
    """846608: the stream's 6 minutes are over; continue on a new stream id."""


def ack_error(what: str, errcode: int, errmsg: str) -> ChannelError:
    """The error of a non-zero ack (errmsg is WeCom's own short text, no secrets)."""
    text = f"{what}: WeCom errcode {errcode} ({errmsg[:200]})"
    if errcode == ERR_REQ_ID_INVALID:
        return ReplyExpired(text, code=errcode)
    if errcode == ERR_STREAM_EXPIRED:
        return StreamExpired(text, code=errcode)
    if errcode in RATE_LIMIT_CODES:
        return RateLimited(text, retry_after=RATE_LIMIT_RETRY_S, status=None, code=errcode)
    if errcode == -1 or 500 <= errcode <= 599:
        # "System busy" / a server error: answered, so certainly not carried out.
        return TransportError(text, code=errcode, request_sent=False)
    return ChannelError(text, code=errcode)


# --- frames we send ---------------------------------------------------------------------


def new_req_id(cmd: str, now_ms: int, rand_hex: str) -> str:
    """``<cmd>_<epoch ms>_<8 hex>``, the SDK's convention."""
    return f"{cmd}_{now_ms}_{rand_hex}"


def frame(cmd: str, req_id: str, body: Any | None = None) -> str:
    """One outbound frame as text."""
    out: dict[str, Any] = {"cmd": cmd, "headers": {"req_id": req_id}}
    if body is not None:
        out["body"] = body
    return json.dumps(out, ensure_ascii=False, separators=(",", ":"))


def subscribe_body(bot_id: str, secret: str) -> dict[str, Any]:
    return {"bot_id": bot_id, "secret": secret}


def stream_body(stream_id: str, content: str, *, finish: bool) -> dict[str, Any]:
    """An ``aibot_respond_msg`` stream frame (``content`` replaces the bubble's text)."""
    return {
        "msgtype": "stream",
        "stream": {"id": stream_id, "finish": finish, "content": content},
    }


def stream_card_body(
    stream_id: str, content: str, card: dict[str, Any], *, finish: bool
) -> dict[str, Any]:
    """A stream frame with a template card attached (once per inbound message)."""
    return {
        "msgtype": "stream_with_template_card",
        "stream": {"id": stream_id, "finish": finish, "content": content},
        "template_card": card,
    }


def push_markdown_body(chatid: str, content: str) -> dict[str, Any]:
    """``aibot_send_msg`` markdown to a conversation (user id or group chatid)."""
    return {"chatid": chatid, "msgtype": "markdown", "markdown": {"content": content}}


def push_card_body(chatid: str, card: dict[str, Any]) -> dict[str, Any]:
    return {"chatid": chatid, "msgtype": "template_card", "template_card": card}


def welcome_body(text: str) -> dict[str, Any]:
    return {"msgtype": "text", "text": {"content": text}}


def update_card_body(card: dict[str, Any], userids: Sequence[str] = ()) -> dict[str, Any]:
    body: dict[str, Any] = {"response_type": "update_template_card", "template_card": card}
    if userids:
        body["userids"] = list(userids)
    return body


def clip_bytes(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` UTF-8 bytes (on a code point boundary)."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", "ignore")


def utf8_len(text: str) -> int:
    return len(text.encode("utf-8"))


# --- template cards (approvals and questions) ------------------------------------------


def option_key(index: int) -> str:
    """A button's ``key``: the 1-based option number, which the typed answer also is."""
    return f"dshim_opt_{index + 1}"


def key_answer(event_key: str) -> str | None:
    """The typed answer a button key stands for (its number), None for a foreign key."""
    prefix = "dshim_opt_"
    if not event_key.startswith(prefix):
        return None
    number = event_key[len(prefix) :]
    if not number.isdigit() or not 0 < int(number) <= 99:
        return None
    return str(int(number))


def interaction_card(
    task_id: str, title: str, prompt: str, options: Sequence[Option]
) -> dict[str, Any]:
    """A ``button_interaction`` card: one button per option (at most six)."""
    return {
        "card_type": "button_interaction",
        "main_title": {"title": clip_bytes(title, 108), "desc": clip_bytes(prompt, 600)},
        "task_id": task_id,
        "button_list": [
            {"text": clip_bytes(str(o.label), 30) or str(i + 1), "style": 1, "key": option_key(i)}
            for i, o in enumerate(options[:CARD_BUTTONS_MAX])
        ],
    }


def decided_card(task_id: str, title: str, decision: str) -> dict[str, Any]:
    """The card after a click: the decision shown, one inert button naming it."""
    return {
        "card_type": "button_interaction",
        "main_title": {"title": clip_bytes(title, 108), "desc": clip_bytes(decision, 600)},
        "task_id": task_id,
        "button_list": [{"text": clip_bytes(decision, 30) or "✓", "style": 2, "key": "dshim_done"}],
    }


# --- frames we receive ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ack:
    """The server's answer to one of our frames."""

    req_id: str
    errcode: int
    errmsg: str
    body: msgspec.Raw


@dataclass(frozen=True, slots=True)
class Callback:
    """A message or event callback, with the frame's bytes exactly as received."""

    cmd: str
    req_id: str
    raw: bytes


@dataclass(frozen=True, slots=True)
class Takeover:
    """``disconnected_event``: a newer connection of this bot took over; stop for good."""

    req_id: str


@dataclass(frozen=True, slots=True)
class Unusable:
    """A frame that is neither (undecodable, unknown command): logged and dropped."""

    detail: str


Received = Ack | Callback | Takeover | Unusable

TAKEOVER_EVENT = "disconnected_event"
_TAKEOVER_BYTES = TAKEOVER_EVENT.encode()


def is_takeover(body: msgspec.Raw | bytes) -> bool:
    """A callback body whose ``event.eventtype`` is ``disconnected_event``.

    Its type alone decides: the server's takeover notice need not carry a ``msgid`` (or
    a sender or chat), and missing it must not make dshim reconnect and evict the
    connection that took over."""
    try:
        ev = m.event_only_decoder.decode(body).event
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeError):
        return False
    return ev is not None and ev.eventtype == TAKEOVER_EVENT


def classify(data: str | bytes) -> Received:
    """Sort one received frame; never raises for bad input."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    try:
        f = decode(m.frame_decoder, raw)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeError) as exc:
        return Unusable(_short(exc))
    if f.cmd is None:
        return Ack(f.headers.req_id, f.errcode or 0, f.errmsg or "", f.body)
    if f.cmd in (MSG_CALLBACK, EVENT_CALLBACK):
        # The byte search first: nearly every frame is something else.
        if _TAKEOVER_BYTES in raw and is_takeover(f.body):  # depth checked on the frame
            return Takeover(f.headers.req_id)
        return Callback(f.cmd, f.headers.req_id, raw)
    return Unusable(f"unknown cmd {f.cmd[:40]!r}")


class Heartbeat:
    """Ping bookkeeping of one live connection (time is an argument)."""

    def __init__(self, interval_s: float = PING_INTERVAL_S, max_unacked: int = PINGS_UNACKED_MAX):
        self.interval_s = interval_s
        self.max_unacked = max_unacked
        self.next_at = 0.0
        self.unacked = 0
        self._outstanding: set[str] = set()

    def start(self, now: float) -> None:
        """Subscribed: the first ping goes out one interval later (the SDK's setInterval)."""
        self.next_at = now + self.interval_s
        self.unacked = 0
        self._outstanding.clear()

    def due(self, now: float) -> bool:
        return now >= self.next_at

    def dead(self) -> bool:
        """True when the pings sent so far went unanswered too often: replace the socket."""
        return self.unacked >= self.max_unacked

    def sent(self, req_id: str, now: float) -> None:
        self.unacked += 1
        self._outstanding.add(req_id)
        self.next_at = now + self.interval_s

    def acked(self, req_id: str) -> bool:
        """An ack arrived; True when it was one of our pings."""
        if req_id in self._outstanding:
            self._outstanding.discard(req_id)
            self.unacked = 0
            return True
        return False


#: What reaches the channel from a live connection: callbacks for the pipeline, and the
#: acks of its own frames (matched to their requests by ``req_id`` in the client).
Event = Callback | Ack


class WecomSession:
    """The long connection as a :class:`~dshim.net.ws_session.WsSession` (the states of
    the module docstring), run by the kit's :func:`~dshim.net.ws.run_ws`.

    ``new_req_id(cmd)`` mints the subscribe's and the pings' ``req_id``.  A rejected
    subscribe and a takeover close the connection and are raised by
    :meth:`connection_lost` (no reconnect)."""

    def __init__(
        self,
        bot_id: str,
        secret: str,
        new_req_id: Callable[[str], str],
        *,
        ping_interval_s: float = PING_INTERVAL_S,
        subscribe_timeout_s: float = 10.0,
    ) -> None:
        self.bot_id = bot_id
        self._secret = secret
        self.new_req_id = new_req_id
        self.subscribe_timeout_s = subscribe_timeout_s
        self.heartbeat = Heartbeat(ping_interval_s)
        self.live = False
        self._subscribe_id = ""
        self._subscribe_by: float | None = None
        self._closing = False
        self._fatal: ChannelError | None = None

    def connection_opened(self, now: float) -> Sequence[Action[Event]]:
        self.live = False
        self._closing = False
        self._subscribe_id = req_id = self.new_req_id(SUBSCRIBE)
        self._subscribe_by = now + self.subscribe_timeout_s
        body = subscribe_body(self.bot_id, self._secret)
        return [Send(frame(SUBSCRIBE, req_id, body), kind=SUBSCRIBE)]

    def receive(self, data: str | bytes, now: float) -> Sequence[Action[Event]]:
        got = classify(data)
        if not self.live:
            if not isinstance(got, Ack) or got.req_id != self._subscribe_id:
                return [Ignored("before subscribe")]  # nothing else is expected first
            return self._subscribed(got, now)
        if isinstance(got, Callback):
            return [Deliver(got)]
        if isinstance(got, Ack):
            return () if self.heartbeat.acked(got.req_id) else [Deliver(got)]
        if isinstance(got, Takeover):
            self._fatal = FatalChannelError(
                "WeCom disconnected this bot: another connection with the same "
                "bot_id took it over (another dshim or SDK process?); not "
                "reconnecting, so the two do not evict each other"
            )
            return self._close("taken over")
        return [Ignored("unusable", got.detail)]

    def _subscribed(self, ack: Ack, now: float) -> Sequence[Action[Event]]:
        self._subscribe_by = None
        if ack.errcode != 0:
            # Not transient, and the subscribe is rate-protected: no retry loop.
            self._fatal = AuthError(
                f"WeCom rejected the bot's subscribe (errcode {ack.errcode}: "
                f"{ack.errmsg[:200]}): check bot_id and secret, and that the bot's API mode "
                "is long connection"
            )
            return self._close("subscribe rejected")
        self.live = True
        self.heartbeat.start(now)
        return [Connected(session=self.bot_id)]

    def _close(self, reason: str) -> list[Action[Event]]:
        self._closing = True
        return [Close(1000, reason)]

    def next_timer(self) -> float | None:
        if self._closing:
            return None
        return self.heartbeat.next_at if self.live else self._subscribe_by

    def tick(self, now: float, *, reading: bool) -> Sequence[Action[Event]]:
        if self._closing:
            return ()
        if not self.live:
            if self._subscribe_by is not None and now >= self._subscribe_by:
                return self._close("no subscribe ack")
            return ()
        hb = self.heartbeat
        if not hb.due(now):
            return ()
        # Unread acks may wait while the channel holds a callback: dead only when reading.
        if hb.dead() and reading:
            return self._close("no ping ack")
        req_id = self.new_req_id(PING)
        hb.sent(req_id, now)
        return [Send(frame(PING, req_id), kind=PING, logged=False)]

    def connection_lost(self, ended: WsEnded, now: float) -> None:
        self.live = False
        self._subscribe_by = None
        if self._fatal is not None:
            raise self._fatal


class Budget:
    """Sliding-window send budget per conversation (30/min and 1,000/h), bounded LRU."""

    def __init__(
        self,
        windows: Sequence[tuple[int, float]] = BUDGET_WINDOWS,
        *,
        max_conversations: int = 4096,
    ) -> None:
        self.windows = tuple(windows)
        self.max_conversations = max_conversations
        self._sent: OrderedDict[str, deque[float]] = OrderedDict()

    def wait_time(self, key: str, now: float) -> float:
        """Seconds until one more send into ``key`` fits every window."""
        sent = self._sent.get(key)
        if not sent:
            return 0.0
        wait = 0.0
        for limit, per_s in self.windows:
            inside = [t for t in sent if t > now - per_s]
            if len(inside) >= limit:
                wait = max(wait, inside[-limit] + per_s - now)
        return max(0.0, wait)

    def take(self, key: str, now: float) -> None:
        sent = self._sent.get(key)
        if sent is None:
            longest = max(limit for limit, _ in self.windows)
            sent = self._sent[key] = deque(maxlen=longest)
            while len(self._sent) > self.max_conversations:
                self._sent.popitem(last=False)
        else:
            self._sent.move_to_end(key)
        sent.append(now)


def reply_window_open(received_at: float, now: float) -> bool:
    """Replies bound to a message are accepted for 24 h after it (unknown time: open)."""
    return not received_at or now - received_at < REPLY_WINDOW_S


# --- mapping ----------------------------------------------------------------------------


class Route(msgspec.Struct, frozen=True, kw_only=True):
    """What answering one message needs: its ``req_id``, where pushes go, its time."""

    req_id: str
    chatid: str
    chattype: str = "single"
    received_at: float = 0.0
    #: The card a click came from (template_card_event), for the card update.
    task_id: str | None = None


@dataclass(frozen=True, slots=True)
class ChatEvent:
    """An ``aibot_event_callback`` that is not for the pipeline as a message."""

    kind: str
    req_id: str
    msgid: str
    conversation_id: str
    user_id: str
    task_id: str = ""
    event_key: str = ""


#: Makes a download handle for one encrypted media item (None: nothing to download).
MediaFactory = Callable[[str, m.Media], Fetcher | None]


def _short(exc: BaseException) -> str:
    return (str(exc) or type(exc).__name__)[:200]


def epoch_seconds(value: float | None) -> float:
    """``create_time`` is seconds in the docs' examples; milliseconds are accepted too."""
    if value is None or value <= 0:
        return 0.0
    return value / 1000.0 if value > 1e11 else float(value)


def strip_mention(text: str) -> str:
    """Remove the leading ``@name`` token (up to the first whitespace) of a group text."""
    rest = text.lstrip()
    if not rest.startswith("@"):
        return text.strip()
    for i, ch in enumerate(rest):
        if ch.isspace():
            return rest[i:].strip()
    return ""


def _mixed_texts(mixed: m.Mixed | None) -> str:
    if mixed is None:
        return ""
    parts = [it.text.content for it in mixed.msg_item if it.msgtype == "text" and it.text]
    return "\n".join(p for p in parts if p)


def quote_reference(quote: m.Quote) -> ReplyReference:
    """``body.quote`` as a reply reference (content snapshot; no id, author or time)."""
    kind = quote.msgtype
    content = ""
    attachments: list[Attachment] = []
    if kind == "text" and quote.text is not None:
        content = quote.text.content
    elif kind == "voice" and quote.voice is not None:
        content = quote.voice.content
    elif kind == "mixed" and quote.mixed is not None:
        content = _mixed_texts(quote.mixed)
        attachments = [
            Attachment(kind="image") for it in quote.mixed.msg_item if it.msgtype == "image"
        ]
    elif kind == "image" and quote.image is not None:
        attachments = [Attachment(kind="image")]
    elif kind == "file" and quote.file is not None:
        attachments = [Attachment(kind="file")]
    elif kind == "video" and quote.video is not None:
        attachments = [Attachment(kind="video")]
    ref = ReplyReference()
    if content.strip():
        ref.content = content
    if attachments:
        ref.attachments = attachments
    if not content.strip() and not attachments:
        ref.unavailable_reason = "not-delivered"
    return ref


#: Every WeCom id dshim reads -- ``msgid``, ``chatid``, ``from.userid``, ``aibotid``, the
#: callback's ``req_id`` (answered under) -- is letters, digits and ``_ - @ .`` (a
#: userid is "1-64 bytes of digits, letters and _-@.", wecom.md §3; kit.ids).  One of
#: another shape, or a ``create_time`` past 2100 or negative, makes the callback a
#: ``malformed`` drop.  WeCom quotes carry no id (:func:`quote_reference`).
WECOM_ID = shape("wecom", f"[{TOKEN}@.]+")


def _check_ids(f: m.Frame, body: m.Body) -> None:
    check_id(body.msgid, WECOM_ID, "msgid")
    check_optional_id(body.chatid, WECOM_ID, "chatid")
    check_optional_id(body.sender.userid, WECOM_ID, "from.userid")
    check_optional_id(body.aibotid, WECOM_ID, "aibotid")
    check_optional_id(f.headers.req_id, WECOM_ID, "req_id")
    t = body.create_time
    if t is not None and (t < 0 or not plausible_time(epoch_seconds(t))):
        raise BadTime("create_time: not a plausible time")


def decode_body(raw: bytes) -> tuple[m.Frame, m.Body] | Skip:
    """The callback frame and its body, or a ``malformed`` Skip (also for ids and times
    of another shape, :data:`WECOM_ID`)."""
    try:
        f = decode(m.frame_decoder, raw)
        body = m.body_decoder.decode(f.body)  # depth checked on the whole frame
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeError) as exc:
        return Skip(reason="malformed", detail=_short(exc))
    if not body.msgid:
        return Skip(reason="malformed", detail="body.msgid is empty")
    try:
        _check_ids(f, body)
    except (BadId, BadTime) as exc:
        return Skip(reason="malformed", detail=_short(exc))
    return f, body


def conversation_of(body: m.Body) -> tuple[str, str] | None:
    """(conversation id, "direct" | "group"), None when the body names neither."""
    if body.chattype == "group":
        return (body.chatid, "group") if body.chatid else None
    return (body.sender.userid, "direct") if body.sender.userid else None


def map_event(f: m.Frame, body: m.Body) -> ChatEvent | Skip:
    """An event callback: enter_chat, template_card_event, disconnected_event, others."""
    ev = body.event
    kind = ev.eventtype if ev is not None else ""
    conv = conversation_of(body)
    if kind == "disconnected_event":
        return ChatEvent(kind, f.headers.req_id, body.msgid, conv[0] if conv else "", "")
    if conv is None or ev is None:
        return Skip(reason="ignored", detail=f"event {kind[:40]}", message_id=body.msgid)
    card = ev.template_card_event
    return ChatEvent(
        kind,
        f.headers.req_id,
        body.msgid,
        conv[0],
        body.sender.userid,
        task_id=(card.task_id if card else "") or ev.task_id,
        event_key=(card.event_key if card else "") or ev.event_key,
    )


#: What a media URL becomes in the stored copy of a frame (signed URLs and keys are
#: secrets: they never reach the store).
REMOVED_URL = "dshim:removed"
_SECRET_KEYS = frozenset({"url", "aeskey"})


def scrub(raw: bytes) -> bytes:
    """``raw`` with every media ``url`` and ``aeskey`` replaced, for the durable inbox.

    The message after a restart (:meth:`Mapper.decode_frame` of this copy) still has its
    attachments, as handles whose download fails with a clear note (the URLs expire
    within minutes anyway).  Frames without media are returned unchanged."""
    if (b'"url"' not in raw and b'"aeskey"' not in raw) or depth_exceeds(raw):
        return raw  # nothing to scrub, or a malformed drop that is never stored as a message
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw  # undecodable: it is a malformed drop and stored as such

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            return {
                k: (REMOVED_URL if k == "url" else "") if k in _SECRET_KEYS else walk(v)
                for k, v in node.items()
            }
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return json.dumps(walk(doc), ensure_ascii=False, separators=(",", ":")).encode("utf-8")


async def _removed(max_bytes: int) -> bytes:
    raise ChannelError("the download link is gone (the message was resumed after a restart)")


class Mapper:
    """Maps callback frames to messages (pure; downloads are the factory's handles)."""

    def __init__(
        self,
        bot_id: str,
        *,
        media: MediaFactory | None = None,
        removed: Fetcher | None = _removed,
    ) -> None:
        self.bot_id = bot_id
        self.media = media
        #: What a scrubbed link (:data:`REMOVED_URL`) fetches: a failure in ``serve`` (the
        #: link is gone after a restart); nothing in replay, which downloads nothing, so a
        #: captured image is the placeholder every replayed image is.
        self.removed = removed

    def _handle(self, kind: str, item: m.Media | None) -> MediaRef | None:
        if item is None or not item.url:
            return None
        if item.url == REMOVED_URL:
            return MediaRef(kind=kind, fetch=self.removed)
        fetch = self.media(kind, item) if self.media is not None else None
        return MediaRef(kind=kind, fetch=fetch)

    def decode_frame(self, raw: bytes | str) -> InboundMessage | Skip:
        """A whole frame as received (the durable inbox, replay).  Events are ``ignored``
        here: the channel handles them as they arrive — a card click only counts while its
        request waits (:meth:`card_answer`), never when decoded again after a restart."""
        data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
        decoded = decode_body(data)
        if isinstance(decoded, Skip):
            if isinstance(classify(data), Takeover):  # an event, with or without msgid
                return Skip(reason="ignored", detail=f"event {TAKEOVER_EVENT}")
            return decoded
        f, body = decoded
        if f.cmd == EVENT_CALLBACK or body.msgtype == "event":
            ev = map_event(f, body)
            detail = ev.kind if isinstance(ev, ChatEvent) else ev.detail
            return Skip(reason="ignored", detail=f"event {detail}"[:100], message_id=body.msgid)
        if f.cmd != MSG_CALLBACK:
            return Skip(reason="ignored", detail=f"cmd {f.cmd}"[:100], message_id=body.msgid)
        return self.map_message(f, body)

    def card_answer(self, ev: ChatEvent, body: m.Body) -> InboundMessage | Skip:
        """A button click as the typed answer it stands for (the option's number)."""
        answer = key_answer(ev.event_key)
        conv = conversation_of(body)
        if answer is None or conv is None or not ev.user_id:
            return Skip(
                reason="ignored", detail="card event of no dshim button", message_id=ev.msgid
            )
        return InboundMessage(
            channel=CHANNEL,
            bot_id=self.bot_id,
            message_id=ev.msgid,
            conversation_id=conv[0],
            conversation_type="group" if conv[1] == "group" else "direct",
            sender_id=ev.user_id,
            content=answer,
            received_at=epoch_seconds(body.create_time),
            route=Route(
                req_id=ev.req_id,
                chatid=conv[0],
                chattype=body.chattype,
                received_at=epoch_seconds(body.create_time),
                task_id=ev.task_id or None,
            ),
        )

    def map_message(self, f: m.Frame, body: m.Body) -> InboundMessage | Skip:
        """One ``aibot_msg_callback`` body (see the module docstring)."""
        conv = conversation_of(body)
        if conv is None:
            return Skip(reason="malformed", detail="no chatid / from.userid", message_id=body.msgid)
        conversation_id, kind = conv
        images: list[MediaRef] = []
        files: list[MediaRef] = []
        text = ""
        t = body.msgtype
        if t == "text" and body.text is not None:
            text = body.text.content
        elif t == "voice" and body.voice is not None:
            text = body.voice.content  # WeCom's speech-to-text; no audio is delivered
        elif t == "mixed" and body.mixed is not None:
            text = _mixed_texts(body.mixed)
            for it in body.mixed.msg_item:
                if it.msgtype == "image":
                    ref = self._handle("image", it.image)
                    if ref is not None:
                        images.append(ref)
        elif t == "image":
            ref = self._handle("image", body.image)
            if ref is not None:
                images.append(ref)
        elif t in ("file", "video"):
            ref = self._handle(t, body.file if t == "file" else body.video)
            if ref is not None:
                files.append(ref)
        elif t not in ("text", "voice", "mixed", "image"):
            return Skip(reason="ignored", detail=f"msgtype {t[:40]}", message_id=body.msgid)
        if kind == "group":
            text = strip_mention(text)
        received_at = epoch_seconds(body.create_time)
        return InboundMessage(
            channel=CHANNEL,
            bot_id=self.bot_id,
            message_id=body.msgid,
            conversation_id=conversation_id,
            conversation_type="group" if kind == "group" else "direct",
            sender_id=body.sender.userid,
            addressed=True,  # groups deliver only messages that @-mention the bot
            content=text.strip(),
            images=images,
            files=files,
            reply_to=quote_reference(body.quote) if body.quote is not None else None,
            received_at=received_at,
            route=Route(
                req_id=f.headers.req_id,
                chatid=conversation_id,
                chattype=body.chattype,
                received_at=received_at,
            ),
        )
