"""DingTalk Stream mode and robot messages, without I/O.

Theory of operation
-------------------
Connection (one :class:`StreamSession` per websocket; protocols/dingtalk.md §2)::

    register   POST /v1.0/gateway/connections/open {clientId, clientSecret,
               subscriptions}  -> {endpoint, ticket}; the ticket is single-use and
               valid 90 s, so every (re)connect registers again (client.py)
    open       websocket to <endpoint>?ticket=<ticket>: live at once (no hello frame
               is promised; CONNECTED/REGISTERED/KEEPALIVE system frames are ignored)
    frames     {specVersion, type, headers{topic, messageId, ...}, data: "<JSON string>"}
               SYSTEM ping        -> ack echoing ``data`` (the opaque) at once; the reader
                                     never waits for a turn (accept only makes the event
                                     durable), so a ping is answered while turns run
               SYSTEM disconnect  -> the kit's ``Handover``: the next connection opens
                                     right away (``run_ws_handover``); this one closes itself
                                     ``handover_close_s`` later (or when the server
                                     closes it), so the new socket is up first
               CALLBACK robot     -> ack ``{"response": null}`` at once, then deliver
               CALLBACK card      -> ack (card buttons are not used yet)
               EVENT              -> ack ``{"status": "SUCCESS"}`` (not for the pipeline)
    dead       the runner's websocket ping (kit ``WsOptions.ping_interval_s``) with a pong
               timeout closes a socket that stopped answering.

Guarantees: robot callbacks are at-least-once: an unacked one is pushed again ~60 s later
and even acked ones can come twice.  The ack deadline is shorter than a durable accept
can be guaranteed to take, so every frame is acked right after decoding, before the
pipeline runs, and redeliveries are dropped by the pipeline's persisted dedup on
``msgId`` (a delivery id would change; ``msgId`` does not).  The cost: a crash between
the ack and the durable accept loses that one message.  Each push goes to one of the
app's connections; order across connections is not promised.

Mapping (:class:`MessageMapper`, table-tested): conversation = ``conversationId``;
``conversationType`` "1" direct, "2" group; the platform pushes group messages only
when the bot is @-mentioned, so a group message is addressed unless ``isInAtList`` is
false, and its leading @bot mention is removed (text and richText alike, when the bot
is the one user @-ed); richText segments are text runs, ``at`` names and pictures (a
segment without ``type`` that carries a ``downloadCode`` is a picture); ``createAt`` and
``sessionWebhookExpiredTime`` are epoch milliseconds, numbers or digit strings (another
string is ``malformed``);
sender ``senderStaffId`` (else ``senderId``), ``senderNick``.  Quotes come from
``text.isReplyMsg`` + ``text.repliedMsg``, the legacy ``quoteMessage``, or only
``originalMsgId``; DingTalk has no fetch-by-id API, so a quote without content is
recovered from the message index (and, for the bot's own card, by
``originalProcessQueryKey``, time and session history) -- never by a request.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import UNSET

from dshim.channels.dingtalk import models as m
from dshim.channels.kit.decode import decode, member_span
from dshim.channels.kit.ids import (
    ALNUM,
    BadId,
    BadTime,
    check_id,
    check_optional_id,
    check_time,
    shape,
    valid_id,
)
from dshim.errors import (
    AuthError,
    ChannelError,
    NotFound,
    PermissionDenied,
    RateLimited,
    TransportError,
)
from dshim.model import (
    Attachment,
    Fetcher,
    InboundMessage,
    MediaRef,
    ReplyReference,
    Skip,
)
from dshim.net.ws_session import (
    Action,
    Close,
    Connected,
    Deliver,
    Handover,
    Ignored,
    Send,
    WsEnded,
)

__all__ = [
    "CARD_CALLBACK_TOPIC",
    "ROBOT_TOPIC",
    "MessageMapper",
    "Route",
    "RobotCallback",
    "StreamSession",
    "card_markdown",
    "classify_error",
    "subscriptions",
]

ROBOT_TOPIC = "/v1.0/im/bot/messages/get"
CARD_CALLBACK_TOPIC = "/v1.0/card/instances/callback"
#: A quote of an AI card that carries nothing but this placeholder is the bot's own card.
CARD_PLACEHOLDER = "[Interactive Card Message]"
#: Message types a user sends (others are platform callbacks unless they carry text).
KNOWN_TYPES = frozenset(
    {"text", "richText", "picture", "audio", "voice", "video", "file", "markdown"}
)
#: Robot payloads larger than this are not messages a user wrote (bounded decode).
MAX_EVENT_BYTES = 1 << 20


def subscriptions() -> list[dict[str, str]]:
    """What ``connections/open`` subscribes to: robot messages and card callbacks."""
    return [
        {"type": "CALLBACK", "topic": ROBOT_TOPIC},
        {"type": "CALLBACK", "topic": CARD_CALLBACK_TOPIC},
    ]


# --- the stream session -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RobotCallback:
    """A robot message frame: ``data`` is the decoded ``data`` string (the robot message)."""

    data: bytes


#: What a Stream session delivers to the channel.
StreamEvent = RobotCallback


def _ack(message_id: str, data: str) -> Send:
    frame = {
        "code": 200,
        "headers": {"contentType": "application/json", "messageId": message_id},
        "message": "OK",
        "data": data,
    }
    return Send(m.encode(frame).decode(), kind="ack", logged=False)


#: The ack ``data`` of a robot callback (the server ignores its content).
CALLBACK_ACK = '{"response":null}'
EVENT_ACK = '{"status":"SUCCESS"}'


class StreamSession:
    """One Stream websocket (see the module docstring); a :class:`WsSession`."""

    def __init__(
        self, *, handover_close_s: float = 10.0, on_ping: Callable[[], None] | None = None
    ) -> None:
        self.handover_close_s = handover_close_s
        self._on_ping = on_ping
        self._close_at: float | None = None
        #: How many SYSTEM pings were answered (probes, tests).
        self.pings = 0
        self.disconnect_reason: str | None = None

    def connection_opened(self, now: float) -> Sequence[Action[StreamEvent]]:
        return [Connected()]

    def receive(self, data: str | bytes, now: float) -> Sequence[Action[StreamEvent]]:
        if isinstance(data, bytes):
            return [Ignored("binary", f"{len(data)} bytes")]
        try:
            frame = decode(m.frame_decoder, data)
            payload = _data_string(frame.data)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeError) as exc:
            return [Ignored("malformed", str(exc)[:200])]
        kind = frame.type.upper()
        topic = frame.headers.topic
        mid = frame.headers.messageId
        if kind == "SYSTEM":
            if topic == "ping":
                self.pings += 1
                if self._on_ping is not None:
                    self._on_ping()
                return [_ack(mid or "", payload)] if mid else [Ignored("ping_without_id")]
            if topic == "disconnect":
                reason = _disconnect_reason(payload)
                self.disconnect_reason = reason
                if self._close_at is None:
                    self._close_at = now + self.handover_close_s
                return [Handover(reason)]
            return []  # CONNECTED, REGISTERED, KEEPALIVE: informational
        if kind == "CALLBACK":
            ack = _ack(mid, CALLBACK_ACK) if mid else None
            if topic == ROBOT_TOPIC:
                raw = payload.encode("utf-8", "surrogatepass")
                return [Deliver(RobotCallback(raw), ack=ack, ack_at_once=True)]
            return [ack] if ack is not None else []
        if kind == "EVENT":
            return [_ack(mid, EVENT_ACK)] if mid else []
        return [Ignored("unknown_frame", kind[:40])]

    def next_timer(self) -> float | None:
        return self._close_at

    def tick(self, now: float, *, reading: bool) -> Sequence[Action[StreamEvent]]:
        if self._close_at is not None and now >= self._close_at:
            self._close_at = None
            return [Close(1000, "disconnect handover")]
        return []

    def connection_lost(self, ended: WsEnded, now: float) -> None:
        self._close_at = None


def _data_string(raw: msgspec.Raw) -> str:
    """The frame's ``data``: a JSON string (the usual case) or, leniently, an object."""
    buf = bytes(raw)
    if buf[:1] == b'"':
        return m.str_decoder.decode(buf)
    return buf.decode("utf-8")


def _disconnect_reason(payload: str) -> str:
    try:
        data = decode(m.any_decoder, payload)
    except msgspec.DecodeError:
        return ""
    reason = data.get("reason") if isinstance(data, dict) else None
    return reason[:200] if isinstance(reason, str) else ""


# --- routes ------------------------------------------------------------------------------------


class Route(msgspec.Struct, kw_only=True, frozen=True):
    """What is needed to answer one message (``InboundMessage.route``)."""

    msg_id: str
    conversation_id: str
    direct: bool
    staff_id: str
    sender_nick: str | None = None
    robot_code: str | None = None
    session_webhook: str | None = None
    #: Epoch seconds after which ``session_webhook`` stops working (None: unknown).
    webhook_expires_at: float | None = None

    def __repr__(self) -> str:  # the webhook is a signed URL: never in a log
        return f"Route(msg_id={self.msg_id!r}, conversation_id={self.conversation_id!r})"


def without_webhook(raw: bytes) -> bytes:
    """The robot message with its ``sessionWebhook`` (a signed URL) blanked: what the
    durable inbox keeps.  An answer after a restart then goes through the OpenAPI."""
    span = member_span(raw, "sessionWebhook")
    if span is None:
        return raw
    return raw[: span[0]] + b'""' + raw[span[1] :]


# --- mapping -----------------------------------------------------------------------------------

# Ids (dingtalk.md §3, kit.ids).  ``msgId`` (``msg…==``), ``conversationId`` (``cid…==``),
# ``senderId`` (``$:LWCP_v1:$<base64>``), staff ids and ``downloadCode`` s are base64 and
# plain ids: letters, digits, ``+ / = _ - $ : . @``.  ``/`` is a base64 letter, so it is
# accepted -- these ids only ever travel in JSON bodies (``openConversationId``,
# ``userIds``, ``downloadCode``) and store keys, never in a URL path -- but no id may be
# or hold a ``.`` / ``..`` path segment.  A message whose own id, conversation, sender or
# media handle is of another shape is malformed; a bad quoted ``msgId`` /
# ``originalMsgId`` / ``originalProcessQueryKey`` only makes the quote ``not-found``.
DINGTALK_ID = shape("dingtalk", f"(?!(?:.*/)?\\.\\.?(?:/|$))[{ALNUM}+/=_\\-$:.@]+")

#: Download handle factory: a ``downloadCode`` -> a fetcher (None in replay).
MediaFactory = Callable[[str], Fetcher | None]

_AT_TOKEN = re.compile(r"^@\S+\s*")


def _digits(value: str) -> bool:
    value = value.strip()
    return value.isascii() and value.isdigit()


def _ms(value: object) -> float | None:
    """Epoch milliseconds (number or digit string) as epoch seconds."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str) and _digits(value):
        value = int(value.strip())
    if isinstance(value, int | float) and 0 < value < 1e15:  # finite, before year 33658
        return float(value) / 1000.0
    return None


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


class MessageMapper:
    """Robot messages -> :class:`InboundMessage` (pure; ``media`` makes download handles)."""

    def __init__(
        self,
        *,
        bot_id: str,
        robot_code: str,
        media: MediaFactory | None = None,
        chatbot_user_id: str | None = None,
    ) -> None:
        self.bot_id = bot_id
        self.robot_code = robot_code
        self._media = media
        #: The bot's user id when an event does not say (``chatbotUserId`` is in every
        #: real callback; replay fixtures may give it in their ``bot`` table).
        self.chatbot_user_id = chatbot_user_id

    def decode_raw(self, raw: bytes) -> InboundMessage | Skip:
        """One robot message (the callback's decoded ``data``); never raises."""
        if len(raw) > MAX_EVENT_BYTES:
            return Skip(reason="malformed", detail=f"event of {len(raw)} bytes")
        try:
            msg = decode(m.message_decoder, raw)
            return self.map(msg)
        except (BadId, BadTime) as exc:
            return Skip(reason="malformed", detail=str(exc))
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeError, ValueError) as exc:
            return Skip(reason="malformed", detail=str(exc)[:200])

    def map(self, msg: m.RobotMessage) -> InboundMessage | Skip:
        ctype = str(msg.conversationType).strip()
        if ctype not in ("1", "2"):
            return Skip(
                reason="malformed", detail=f"conversationType {ctype[:20]!r}", message_id=msg.msgId
            )
        direct = ctype == "1"
        if not msg.msgId or not msg.conversationId:
            return Skip(reason="malformed", detail="no msgId or conversationId")
        check_id(msg.msgId, DINGTALK_ID, "msgId")
        check_id(msg.conversationId, DINGTALK_ID, "conversationId")
        check_optional_id(msg.senderId, DINGTALK_ID, "senderId")
        check_optional_id(msg.senderStaffId, DINGTALK_ID, "senderStaffId")
        if isinstance(msg.createAt, int | float) and msg.createAt < 0:
            raise BadTime("createAt: not a plausible time")
        for name, value in (
            ("createAt", msg.createAt),
            ("sessionWebhookExpiredTime", msg.sessionWebhookExpiredTime),
        ):
            # Epoch milliseconds come as numbers, and from some clients as digit strings.
            if isinstance(value, str) and not _digits(value):
                return Skip(
                    reason="malformed",
                    detail=f"{name}: not epoch milliseconds",
                    message_id=msg.msgId,
                )
        bot_user = msg.chatbotUserId or self.chatbot_user_id
        if bot_user and msg.senderId == bot_user:
            return Skip(reason="echo", message_id=msg.msgId)
        sender = msg.senderStaffId or msg.senderId
        if not sender:
            return Skip(reason="malformed", detail="no sender", message_id=msg.msgId)
        content = _content(msg.content)
        text, images, files = self._body(msg, content, direct=direct)
        if msg.msgtype not in KNOWN_TYPES and not text and not images and not files:
            # A callback that is not a user message (interactiveCardCallback ...).
            return Skip(
                reason="ignored", detail=f"msgtype {msg.msgtype[:40]}", message_id=msg.msgId
            )
        # DingTalk pushes group messages only when the robot is @-mentioned; the flag,
        # when present, says so (an explicit false is not for the bot).
        addressed = True if direct else msg.isInAtList is not False
        reply_to = self._reply(msg, bot_user)
        route = Route(
            msg_id=msg.msgId,
            conversation_id=msg.conversationId,
            direct=direct,
            staff_id=sender,
            sender_nick=msg.senderNick,
            robot_code=msg.robotCode or self.robot_code,
            session_webhook=msg.sessionWebhook,
            webhook_expires_at=_ms(msg.sessionWebhookExpiredTime),
        )
        return InboundMessage(
            channel="dingtalk",
            bot_id=self.bot_id,
            message_id=msg.msgId,
            conversation_id=msg.conversationId,
            conversation_type="direct" if direct else "group",
            sender_id=sender,
            sender_name=_str(msg.senderNick),
            addressed=addressed,
            content=text,
            images=images,
            files=files,
            reply_to=reply_to,
            received_at=check_time(_ms(msg.createAt) or 0.0, "createAt"),
            conversation_title=None if direct else _str(msg.conversationTitle),
            route=route,
        )

    # -- the message body ---------------------------------------------------------------------

    def _handle(self, kind: str, code: object, name: str | None = None) -> MediaRef | None:
        if not isinstance(code, str) or not code:
            return None
        check_id(code, DINGTALK_ID, f"{kind} downloadCode")
        fetch = self._media(code) if self._media is not None else None
        return MediaRef(kind=kind, name=name, fetch=fetch)

    def _body(
        self, msg: m.RobotMessage, content: Any, *, direct: bool
    ) -> tuple[str, list[MediaRef], list[MediaRef]]:
        kind = msg.msgtype
        images: list[MediaRef] = []
        files: list[MediaRef] = []
        text = ""
        c = content if isinstance(content, dict) else {}
        # In a group the text still starts with the @bot mention (removed like this).
        mention = not direct and msg.isInAtList is not False
        if kind == "text":
            text = msg.text.content if msg.text is not None else ""
            text = text.strip()
            if mention:
                text = _strip_bot_mention(text, msg)
        elif kind == "richText":
            parts: list[tuple[str, bool]] = []  # (text, is an at segment)
            for seg in _segments(c.get("richText")):
                if (code := _picture_code(seg)) is not None:
                    if (ref := self._handle("image", code)) is not None:
                        images.append(ref)
                if (piece := _segment_text(seg)) is not None:  # an untyped picture's too
                    parts.append((piece, _seg_type(seg) == "at"))
            if mention and _sole_at_is_bot(msg):
                # The leading mention: an at segment of its own, or the first run's "@name".
                first = next((i for i, (t, _) in enumerate(parts) if t.strip()), None)
                if first is not None and parts[first][1]:
                    del parts[first]
                    text = "".join(t for t, _ in parts).strip()
                else:
                    text = _strip_bot_mention("".join(t for t, _ in parts).strip(), msg)
            else:
                text = "".join(t for t, _ in parts).strip()
        elif kind == "picture":
            ref = self._handle("image", c.get("downloadCode") or c.get("pictureDownloadCode"))
            if ref is not None:
                images.append(ref)
        elif kind in ("audio", "voice"):
            text = (_str(c.get("recognition")) or "").strip()
            if (ref := self._handle("audio", c.get("downloadCode"))) is not None:
                files.append(ref)
        elif kind == "video":
            if (ref := self._handle("video", c.get("downloadCode"))) is not None:
                files.append(ref)
        elif kind == "file":
            name = _str(c.get("fileName"))
            if (ref := self._handle("file", c.get("downloadCode"), name)) is not None:
                files.append(ref)
        elif kind == "markdown":
            text = (_str(c.get("text")) or "").strip()
        else:
            text = msg.text.content.strip() if msg.text is not None else ""
        return text, images, files

    # -- quotes ---------------------------------------------------------------------------------

    def _reply(self, msg: m.RobotMessage, bot_user: str | None) -> ReplyReference | None:
        quoted: Any = _json(msg.text.repliedMsg) if msg.text is not None else None
        if not isinstance(quoted, dict):
            legacy = _json(msg.quoteMessage)
            quoted = _legacy_quote(legacy) if isinstance(legacy, dict) else None
        if msg.originalMsgId and not valid_id(msg.originalMsgId, DINGTALK_ID):
            return ReplyReference(unavailable_reason="not-found")  # never recovered
        if msg.originalProcessQueryKey and not valid_id(msg.originalProcessQueryKey, DINGTALK_ID):
            return ReplyReference(unavailable_reason="not-found")
        if not isinstance(quoted, dict):
            if msg.originalMsgId:
                # Only an id: the message index knows it (every accepted message is there).
                return ReplyReference(message_id=msg.originalMsgId, recover=True)
            return None
        if not _str(quoted.get("msgId")) and msg.originalMsgId:
            quoted = {**quoted, "msgId": msg.originalMsgId}  # the id given beside it
        return quote_reference(quoted, bot_user=bot_user, process_key=msg.originalProcessQueryKey)


def _json(raw: msgspec.Raw) -> Any:
    try:
        value = decode(m.any_decoder, bytes(raw))
    except msgspec.DecodeError:
        return None
    if isinstance(value, str):  # a JSON string holding the object
        try:
            return decode(m.any_decoder, value)
        except msgspec.DecodeError:
            return value
    return value


def _content(raw: msgspec.Raw) -> Any:
    """A robot message's ``content``: an object, or a JSON string holding one."""
    return _json(raw)


def _sole_at_is_bot(msg: m.RobotMessage) -> bool:
    """The bot is the one user @-ed: a leading mention must be it."""
    ats = msg.atUsers or []
    return len(ats) == 1 and ats[0].dingtalkId == msg.chatbotUserId


def _strip_bot_mention(text: str, msg: m.RobotMessage) -> str:
    """Drop a leading ``@name`` only when the bot is the one user @-ed (it must be it)."""
    if _sole_at_is_bot(msg) and text.startswith("@"):
        return _AT_TOKEN.sub("", text, count=1).strip()
    return text


def _segments(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        return []
    return [seg for seg in value if isinstance(seg, dict)]


def _seg_type(seg: Mapping[str, Any]) -> str:
    kind = seg.get("type", seg.get("msgType", "text"))
    return kind if isinstance(kind, str) else ""


def _picture_code(seg: Mapping[str, Any]) -> str | None:
    """A picture segment's download code ("" when it has none); None for other segments.

    A segment with no ``type`` is a picture when it carries a download code (the SDKs
    tell pictures from text runs by that key alone)."""
    code = seg.get("downloadCode") or seg.get("pictureDownloadCode")
    untyped = "type" not in seg and "msgType" not in seg
    if _seg_type(seg) != "picture" and not (untyped and isinstance(code, str) and code):
        return None
    return code if isinstance(code, str) else ""


def _segment_text(seg: Mapping[str, Any]) -> str | None:
    kind = _seg_type(seg)
    if kind == "at":
        name = seg.get("atName")
        return f"@{name}" if isinstance(name, str) and name else None
    if kind == "text":
        for key in ("text", "content"):
            value = seg.get(key)
            if isinstance(value, str):
                return value
    return None


def _legacy_quote(q: Mapping[str, Any]) -> dict[str, Any]:
    """``quoteMessage{msgId, senderId, text.content, msgtype}`` in the repliedMsg shape."""
    text = q.get("text")
    body = text.get("content") if isinstance(text, dict) else None
    return {
        "msgId": q.get("msgId"),
        "senderId": q.get("senderId"),
        "senderNick": q.get("senderNick"),
        "createdAt": q.get("createdAt", q.get("createAt")),
        "msgType": q.get("msgtype", q.get("msgType", "text")),
        "content": q.get("content", {"content": body} if isinstance(body, str) else None),
    }


def _card_text(content: Mapping[str, Any]) -> str | None:
    """The visible text of a quoted card: the TEXT nodes of ``cardContent``, else the
    card's ``cardParamMap`` text variables."""
    tree = content.get("cardContent")
    if isinstance(tree, str):
        tree = _json(msgspec.Raw(m.encode(tree)))
    texts: list[str] = []
    stack: list[Any] = [tree]
    seen = 0
    while stack and seen < 2000:
        node = stack.pop()
        seen += 1
        if isinstance(node, list):
            stack.extend(reversed(node))
        elif isinstance(node, dict):
            if str(node.get("elementType", "")).upper() == "TEXT":
                value = node.get("value")
                if isinstance(value, str) and value.strip():
                    texts.append(value.strip())
            children = node.get("children")
            if isinstance(children, list):
                stack.extend(reversed(children))
    if texts:
        return "\n".join(texts)
    data = content.get("cardData")
    params = data.get("cardParamMap") if isinstance(data, dict) else None
    if isinstance(params, dict):
        for key in ("msgContent", "staticMsgContent", "content", "markdown", "text"):
            value = params.get(key)
            if isinstance(value, str) and value.strip():
                return value
    return None


def quote_reference(
    q: Mapping[str, Any], *, bot_user: str | None, process_key: str | None
) -> ReplyReference:
    """The :class:`ReplyReference` of a ``repliedMsg`` object (also legacy quotes).

    Content by ``msgType`` with the inbound extraction; attachments as kinds and names
    (never download codes).  No usable content -> recovery from the message index: for
    the bot's own message (or a card placeholder) also by ``originalProcessQueryKey``,
    quoted time and session history.
    """
    qid = _str(q.get("msgId"))
    if qid is not None and not valid_id(qid, DINGTALK_ID):
        return ReplyReference(unavailable_reason="not-found")  # never recovered
    sender = _str(q.get("senderId"))
    nick = _str(q.get("senderNick"))
    created = _ms(q.get("createdAt", q.get("createAt")))
    kind_value = q.get("msgType", q.get("msgtype", "text"))
    kind = kind_value if isinstance(kind_value, str) else ""
    raw_content = q.get("content")
    if isinstance(raw_content, str) and raw_content[:1] in "{[":
        parsed = _json(msgspec.Raw(m.encode(raw_content)))
        raw_content = parsed if isinstance(parsed, dict | list) else raw_content
    c: Mapping[str, Any] = raw_content if isinstance(raw_content, dict) else {}
    bare = raw_content if isinstance(raw_content, str) else None
    text: str | None = None
    attachments: list[Attachment] = []
    unsupported = False
    if kind in ("text", "markdown", ""):
        text = _str(c.get("content")) or _str(c.get("text")) or bare
    elif kind == "richText":
        parts: list[str] = []
        for seg in _segments(c.get("richText")):
            if _picture_code(seg) is not None:
                attachments.append(Attachment(kind="image"))
            if (piece := _segment_text(seg)) is not None:
                parts.append(piece)
        text = "".join(parts) or bare
    elif kind == "picture":
        attachments.append(Attachment(kind="image"))
    elif kind == "file":
        attachments.append(Attachment(kind="file", name=_str(c.get("fileName"))))
    elif kind in ("audio", "voice"):
        text = _str(c.get("recognition"))
        attachments.append(Attachment(kind="audio"))
    elif kind == "video":
        attachments.append(Attachment(kind="video"))
    elif kind == "chatRecord":
        text = _str(c.get("summary")) or _str(c.get("title")) or bare
    elif kind == "interactiveCard":
        text = _card_text(c)
        if text is None and bare is not None and bare.strip() != CARD_PLACEHOLDER:
            text = bare
    else:
        text = _str(c.get("content")) or _str(c.get("text")) or bare
        unsupported = text is None
    is_bot = bool(bot_user) and sender == bot_user
    # A card quote without visible text is the bot's own card -- unless DingTalk names
    # another sender (another robot's card: only the index may know it, never by time).
    own_card = kind == "interactiveCard" and text is None and (sender is None or sender == bot_user)
    ref = ReplyReference(message_id=qid if qid is not None else UNSET)
    if is_bot or own_card:
        ref.author_id = bot_user if bot_user else (sender if sender else UNSET)
        ref.author_name = nick if nick is not None else UNSET
    else:
        ref.author_id = sender if sender is not None else UNSET
        ref.author_name = nick if nick is not None else UNSET
    if text is not None and text.strip():
        ref.content = text
    if attachments:
        ref.attachments = attachments
    if ref.content is not UNSET or attachments:
        return ref
    if unsupported and not is_bot:
        ref.unavailable_reason = "unsupported"
        return ref
    # No usable content: the message index (every accepted and every sent message).
    ref.recover = True
    if is_bot or own_card:
        ref.recover_keys = [process_key] if process_key else []
        ref.recover_at = created
    return ref


# --- errors ------------------------------------------------------------------------------------

#: 403 codes that mean "over the QPS quota", not "not permitted".
_QPS_HINTS = ("qps", "flowcontrol", "throttl", "ratelimit", "limit", "限流")
#: oapi errcodes that are transient (system busy, throttled, send too fast).
_TRANSIENT_ERRCODES = frozenset({-1, 88, 130101, 410100})


def error_body(content: bytes) -> m.ErrorBody:
    try:
        return decode(m.error_decoder, content)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return m.ErrorBody()


def classify_error(
    status: int, body: m.ErrorBody, what: str, *, retry_after: float | None = None
) -> ChannelError:
    """One failed DingTalk call as the error tree (the only mapping of DingTalk errors).

    401 -> AuthError (the token is refreshed once); 403 with a QPS code and 429 ->
    RateLimited; other 403 (missing scope) -> PermissionDenied; 404 -> NotFound; 5xx and
    transient errcodes -> TransportError; an ``errcode`` != 0 on 200 -> ChannelError.
    """
    code = body.code if body.code is not None else body.errcode
    detail = (body.message or body.errmsg or "")[:200]
    text = f"{what}: HTTP {status}" + (f" {code}" if code is not None else "")
    if detail:
        text += f" ({detail})"
    code_text = f"{code} {detail}".lower()
    if status == 401:
        return AuthError(text, status=status, code=code)
    if status == 429 or (status == 403 and any(h in code_text for h in _QPS_HINTS)):
        return RateLimited(text, retry_after=retry_after or 1.0, status=status)
    if status == 403:
        return PermissionDenied(text, status=status, code=code)
    if status in (404, 410):
        return NotFound(text, status=status, code=code)
    if status >= 500:
        return TransportError(text, status=status, code=code, request_sent=True)
    if body.errcode is not None and body.errcode in _TRANSIENT_ERRCODES:
        if body.errcode in (130101, 410100, 88):
            return RateLimited(text, retry_after=retry_after or 3.0, status=status)
        return TransportError(text, status=status, code=code, request_sent=True)
    return ChannelError(text, status=status, code=code)


def is_auth_rejection(status: int, body: m.ErrorBody) -> bool:
    """A credential the platform refuses (token or connections/open): fatal."""
    code = str(body.code or "").lower()
    return status in (400, 401, 403) and (
        status == 401 or "invalid" in code or "unauthorized" in code or "forbidden" in code
    )


# --- rendering helpers -------------------------------------------------------------------------

_FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
#: A line that starts a block of its own: the line break before it stays a line break.
_BLOCK_START = re.compile(r"^\s{0,3}(?:[-*+] |\d+[.)] |#{1,6} |\||> )")
_HEADING = re.compile(r"^\s{0,3}#{1,6} ")


def card_markdown(text: str) -> str:
    """Markdown as the AI card renders it: the card shows a single line break only as
    ``<br>``, so one between two lines of text becomes ``<br>``; blank lines, code blocks
    and the breaks before list items, headings, quotes, tables and code fences (and after
    a heading) stay as they are."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    out: list[str] = []
    in_code = False
    last = len(lines) - 1
    for i, line in enumerate(lines):
        fence = _FENCE.match(line) is not None
        was_in_code = in_code
        if fence:
            in_code = not in_code
        if i == last:
            out.append(line)
            continue
        nxt = lines[i + 1]
        keep = (
            was_in_code
            or in_code
            or fence
            or not line
            or not nxt
            or _BLOCK_START.match(nxt) is not None
            or _FENCE.match(nxt) is not None
            or _HEADING.match(line) is not None
        )
        out.append(line + ("\n" if keep else "<br>"))
    return "".join(out)


def new_track_id(rand: Callable[[], uuid.UUID] = uuid.uuid4) -> str:
    """A fresh card ``outTrackId`` (randomness injected in tests)."""
    return f"dshim-{rand().hex}"
