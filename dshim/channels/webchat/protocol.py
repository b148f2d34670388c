"""The web chat, sans-IO: client frames in, events, normalized messages and frames out.

Theory of operation
-------------------
A browser tab (or a script) holds one websocket to dshim and speaks JSON text frames
(docs/channels/webchat.md documents them for script authors).  Per socket::

    connected --join C--> member of C (history of C sent) --send--> accepted ...
                 (a socket may join several conversations; ``leave`` drops one)

:func:`parse_frame` turns one client frame into a typed frame or raises
:class:`FrameError` (``bad_json``, ``bad_frame``, ``unknown_type``, ``too_large``): the
channel answers it with an ``error`` frame and the socket stays up.  A ``send`` from a
member becomes an :class:`~dshim.channels.webchat.models.Event` (:func:`build_event`):
the frame with the sender and the conversation kind added, validated against the
limits below.  Its bytes are what the durable inbox keeps, what a replay fixture holds
and what :func:`map_event` maps, again after a restart, to the
:class:`~dshim.model.InboundMessage` plus the :class:`~dshim.channels.base.LoggedMessage`
of the conversation's message log.

What the "platform" guarantees is what this module and the page make of it:

* **Ordering**: one socket's frames are handled in the order sent; all sockets of a bot
  feed one reader, so the pipeline sees one order.
* **Redelivery and dedup**: ``client_id`` is the sender's key for a message.  The
  message id is ``<user id>/<client_id>`` (``/`` is not allowed in user ids), so a resend
  after a reconnect (the page resends what was not ``accepted``) has the same id: the
  pipeline's dedup drops it, the log keeps one copy, and the sender gets ``accepted``
  with the same id again.  ``accepted`` is sent only once the pipeline took the message
  (the ack after acceptance); a message refused because the bot is stopping gets an
  ``unavailable`` error instead and is sent again by the page.
* **Addressing**: a direct conversation always addresses the bot; in a room
  (``kind = "room"``, a group) only ``@<bot name>`` (case-insensitive, removed from the
  content) or ``/command@<bot name>`` does, and a button press (the answer to the bot's
  own question).  Quoting a message never addresses the bot.
* **Quotes**: ``reply_to`` is only an id.  The snapshot is built from dshim's own log of
  that conversation (never from anything the client says about the quoted message), by a
  lazy loader run inside the turn; an id the log does not know in this conversation (nor
  the outbound index, which also holds the bot's answers) is ``not-found``.
* **Attachments**: base64 in the frame; images (PNG, JPEG, GIF, WebP, by their bytes)
  reach the harness as image parts; everything else takes every channel's file path (the
  turn saves it in the data directory and lists it in the ``<dsh_im_files>`` block).  At
  most :data:`MAX_ATTACHMENTS` per message, an image at most :data:`IMAGE_MAX_BYTES`, a
  file at most :data:`FILE_MAX_BYTES` and the bot's ``max_file_bytes``, all together at
  most :data:`UPLOAD_TOTAL_MAX_BYTES` (one frame carries them); over a limit the send is
  refused with an error frame saying which file and which limit.

Frames dshim sends are built here too (:func:`message_frame`, :func:`history_frame` ...);
times are ISO 8601 in UTC.  Nothing here imports trio or reads a clock: ``at`` is an
argument.
"""

from __future__ import annotations

import binascii
import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import msgspec

from dshim.channels.base import LoggedMessage
from dshim.channels.kit.decode import decode
from dshim.channels.webchat import models as m
from dshim.errors import RemoteProtocolError
from dshim.model import Attachment, InboundMessage, Loader, MediaRef, ReplyReference, Skip

__all__ = [
    "CHANNEL",
    "FILE_MAX_BYTES",
    "IMAGE_MAX_BYTES",
    "MAX_ATTACHMENTS",
    "MAX_FRAME_BYTES",
    "MAX_TEXT",
    "UPLOAD_TOTAL_MAX_BYTES",
    "BotIdentity",
    "FrameError",
    "Member",
    "Received",
    "accepted_frame",
    "answer_event",
    "answer_text",
    "build_event",
    "check_join",
    "error_frame",
    "history_frame",
    "interaction_closed_frame",
    "interaction_frame",
    "map_event",
    "message_frame",
    "parse_frame",
    "reference_from_log",
    "typing_frame",
]

CHANNEL = "webchat"
MIB = 1024 * 1024
#: Client frames above this are refused (``too_large``); one 20 MiB file fits in base64.
MAX_FRAME_BYTES = 28 * MIB
#: A message's text, in code points.
MAX_TEXT = 100_000
#: The core's limits (``dshim/pipeline/turn.py``), checked before a message is taken.
IMAGE_MAX_BYTES = 5 * MIB
FILE_MAX_BYTES = 20 * MIB
MAX_ATTACHMENTS = 20
#: What one message's attachments may add up to (they travel in one frame).
UPLOAD_TOTAL_MAX_BYTES = 20 * MIB
ID_MAX = 128
USER_ID_MAX = 64
NAME_MAX = 64
FILE_NAME_MAX = 255
#: User ids starting with this are the bots' own.
BOT_ID_PREFIX = "bot:"

# Ids: 1..n characters, none of them whitespace or control characters.
_ID = re.compile(r"[^\s\x00-\x1f\x7f-\x9f]+")
_IMAGE_SIGNATURES: tuple[tuple[int, bytes, str], ...] = (
    (0, b"\x89PNG\r\n\x1a\n", "image/png"),
    (0, b"\xff\xd8\xff", "image/jpeg"),
    (0, b"GIF87a", "image/gif"),
    (0, b"GIF89a", "image/gif"),
    (8, b"WEBP", "image/webp"),
)


class FrameError(RemoteProtocolError):
    """A client frame dshim refuses: answered with ``{"type":"error","code","message"}``.
    ``code`` is the error frame's code (``bad_json``, ``not_joined`` ...)."""

    code: str

    def __init__(self, code: str, message: str, *, client_id: str | None = None) -> None:
        super().__init__(message, code=code)
        self.code = code
        self.message = message
        self.client_id = client_id


@dataclass(frozen=True, slots=True)
class BotIdentity:
    """The bot as the page shows it: ``id`` (``bot:<bot name>``) and its display name,
    which is also what ``@<name>`` addresses."""

    id: str
    name: str

    @classmethod
    def for_bot(cls, bot_name: str, display_name: str | None = None) -> BotIdentity:
        return cls(id=BOT_ID_PREFIX + bot_name, name=display_name or bot_name)

    def mention(self) -> re.Pattern[str]:
        """``@name`` as a word (case-insensitive), with a ``,``/``:`` and spaces after it."""
        return re.compile(
            r"(?<![\w@])@" + re.escape(self.name) + r"(?![\w-]|\.\w)[,:]?[ \t]*", re.IGNORECASE
        )


@dataclass(frozen=True, slots=True)
class Member:
    """A socket's membership of one conversation: who writes there, and what it is."""

    conversation: str
    kind: str  # "direct" | "room"
    user_id: str
    user_name: str


@dataclass(frozen=True, slots=True)
class Received:
    """One mapped event: the message for the pipeline and its entry in the log."""

    message: InboundMessage
    logged: LoggedMessage


# --- client frames ------------------------------------------------------------------------

_DECODERS: dict[str, msgspec.json.Decoder[Any]] = {
    "join": m.join_decoder,
    "send": m.send_decoder,
    "answer": m.answer_decoder,
    "leave": m.leave_decoder,
}


def parse_frame(data: str | bytes, *, max_bytes: int = MAX_FRAME_BYTES) -> m.ClientFrame:
    """One client frame, typed; :class:`FrameError` when it is not one dshim takes."""
    if isinstance(data, bytes):
        raise FrameError("bad_frame", "frames are JSON text frames, not binary")
    if len(data) > max_bytes // 4 and len(data.encode("utf-8", "surrogatepass")) > max_bytes:
        raise FrameError("too_large", f"the frame is larger than {max_bytes // MIB} MiB")
    try:
        kind = decode(m.envelope_decoder, data).type
    except msgspec.ValidationError as exc:  # (a DecodeError too: this comes first)
        raise FrameError("bad_frame", f"expected an object with a string type: {exc}") from None
    except msgspec.DecodeError as exc:
        raise FrameError("bad_json", f"not valid JSON: {exc}") from None
    decoder = _DECODERS.get(kind)
    if decoder is None:
        known = ", ".join(sorted(_DECODERS))
        raise FrameError("unknown_type", f"unknown frame type {kind[:40]!r}; expected {known}")
    try:
        frame: m.ClientFrame = decode(decoder, data)
    except msgspec.MsgspecError as exc:
        raise FrameError(
            "bad_frame", f"bad {kind} frame: {exc}", client_id=_client_id(data)
        ) from None
    return frame


def _client_id(data: str) -> str | None:
    """The frame's client_id when it has a usable one (for the error frame)."""
    try:
        value = msgspec.json.decode(data, type=dict[str, Any]).get("client_id")
    except (msgspec.MsgspecError, RecursionError):
        return None
    return value if isinstance(value, str) and _is_id(value, ID_MAX) else None


def _is_id(value: str, limit: int) -> bool:
    return len(value) <= limit and _ID.fullmatch(value) is not None


def _check_id(value: str, what: str, limit: int = ID_MAX, *, client_id: str | None = None) -> str:
    if not _is_id(value, limit):
        raise FrameError(
            "bad_frame",
            f"{what}: expected 1-{limit} characters without spaces or control characters",
            client_id=client_id,
        )
    return value


def _display_name(value: str | None, fallback: str) -> str:
    """One line, no control or format characters, at most NAME_MAX code points."""
    if not value:
        return fallback
    kept = "".join(c for c in value if unicodedata.category(c) not in ("Cc", "Cf"))
    line = " ".join(kept.split())[:NAME_MAX].strip()
    return line or fallback


def check_join(frame: m.JoinFrame) -> Member:
    """The membership a ``join`` asks for; :class:`FrameError` when it is not valid."""
    conversation = _check_id(frame.conversation, "conversation")
    if frame.kind not in ("direct", "room"):
        raise FrameError("bad_frame", f'kind: expected "direct" or "room", got {frame.kind[:20]!r}')
    user_id = _check_id(frame.user.id, "user.id", USER_ID_MAX)
    if "/" in user_id or user_id.startswith(BOT_ID_PREFIX):
        raise FrameError(
            "bad_frame", f"user.id: must not contain '/' or start with {BOT_ID_PREFIX!r}"
        )
    return Member(conversation, frame.kind, user_id, _display_name(frame.user.name, user_id))


# --- events ----------------------------------------------------------------------------------


class _Upload:
    __slots__ = ("name", "mime", "data", "image")

    def __init__(self, name: str, mime: str | None, data: bytes, image: str | None) -> None:
        self.name = name
        self.mime = image or mime
        self.data = data
        self.image = image is not None


def _image_type(data: bytes) -> str | None:
    for offset, signature, mime in _IMAGE_SIGNATURES:
        if data[offset : offset + len(signature)] == signature:
            return mime if offset == 0 or data[:4] == b"RIFF" else None
    return None


def _file_name(value: str | None, index: int, image: bool) -> str:
    name = _display_name((value or "").replace("\\", "/").rpartition("/")[2], "")
    if not name:
        return f"{'image' if image else 'file'}-{index}"
    return name[:FILE_NAME_MAX]


def _size(n: int) -> str:
    return f"{n / MIB:.1f} MiB" if n >= MIB else f"{n} bytes"


def _uploads(
    files: Sequence[m.FileUpload], client_id: str | None, file_max: int = FILE_MAX_BYTES
) -> list[_Upload]:
    """Decode and check the attachments against the limits (FrameError names the file);
    ``file_max`` is the bot's own limit for a file (never above :data:`FILE_MAX_BYTES`)."""
    if len(files) > MAX_ATTACHMENTS:
        raise FrameError(
            "too_many_attachments",
            f"{len(files)} attachments: at most {MAX_ATTACHMENTS} per message",
            client_id=client_id,
        )
    out: list[_Upload] = []
    total = 0
    for i, f in enumerate(files, 1):
        label = f.name or f"attachment {i}"
        try:
            data = binascii.a2b_base64(f.data_b64, strict_mode=True)
        except (binascii.Error, ValueError):
            raise FrameError(
                "bad_attachment", f"{label[:80]}: data_b64 is not valid base64", client_id=client_id
            ) from None
        image = _image_type(data)
        limit = IMAGE_MAX_BYTES if image else min(FILE_MAX_BYTES, file_max)
        if len(data) > limit:
            what = "an image" if image else "a file"
            raise FrameError(
                "attachment_too_large",
                f"{label[:80]} is {_size(len(data))}: {what} can be at most {_size(limit)}",
                client_id=client_id,
            )
        total += len(data)
        if total > UPLOAD_TOTAL_MAX_BYTES:
            raise FrameError(
                "attachment_too_large",
                f"the attachments add up to more than {_size(UPLOAD_TOTAL_MAX_BYTES)} "
                "(the most one message can carry)",
                client_id=client_id,
            )
        out.append(_Upload(_file_name(f.name, i, image is not None), f.mime, data, image))
    return out


def _check_event(ev: m.Event, file_max: int = FILE_MAX_BYTES) -> tuple[Member, list[_Upload]]:
    """Validate a ``send`` with its sender (FrameError says what is wrong)."""
    cid = _check_id(ev.client_id, "client_id")
    member = check_join(m.JoinFrame(conversation=ev.conversation, user=ev.user, kind=ev.kind))
    if ev.reply_to is not None:
        _check_id(ev.reply_to, "reply_to", client_id=cid)
    if len(ev.text) > MAX_TEXT:
        raise FrameError(
            "too_large", f"the text is longer than {MAX_TEXT} characters", client_id=cid
        )
    uploads = _uploads(ev.files, cid, file_max)
    if not ev.text.strip() and not uploads and ev.reply_to is None:
        raise FrameError("empty", "nothing to send: no text, no file", client_id=cid)
    return member, uploads


def build_event(
    frame: m.SendFrame, member: Member, *, at: float, file_max: int = FILE_MAX_BYTES
) -> bytes:
    """The stored event of a member's ``send`` (validated; FrameError when refused).
    ``file_max``: the bot's ``max_file_bytes`` (a file above it is refused here, where
    the sender learns it at once, rather than listed as too large to the agent)."""
    ev = m.Event(
        client_id=frame.client_id,
        conversation=frame.conversation,
        text=frame.text,
        reply_to=frame.reply_to,
        files=list(frame.files),
        user=m.User(member.user_id, member.user_name),
        kind=member.kind,
        at=at,
    )
    _check_event(ev, file_max)
    return m.encoder.encode(ev)


def answer_text(options: Sequence[Any], option_id: str) -> str | None:
    """The text a button press stands for: the option's label when that names it alone
    (and is not a number), else its 1-based number; None for an unknown option."""
    ids = [str(o.id) for o in options]
    if option_id not in ids:
        return None
    index = ids.index(option_id)
    label = str(options[index].label).strip()
    folded = [" ".join(str(o.label).split()).casefold() for o in options]
    key = " ".join(label.split()).casefold()
    if label and not key.rstrip(".").isdigit() and folded.count(key) == 1:
        return label
    return str(index + 1)


def answer_event(frame: m.AnswerFrame, member: Member, text: str, *, at: float) -> bytes:
    """The stored event of a button press: a message from the member with the option."""
    ev = m.Event(
        client_id=_check_id(frame.client_id, "client_id"),
        conversation=frame.conversation,
        text=text,
        user=m.User(member.user_id, member.user_name),
        kind=member.kind,
        at=at,
        answer=_check_id(frame.interaction, "interaction"),
    )
    _check_event(ev)
    return m.encoder.encode(ev)


#: Makes the loader of a quote: (conversation id, quoted message id) -> Loader.
LookupFactory = Callable[[str, str], Loader]


def map_event(
    raw: bytes, me: BotIdentity, *, lookup: LookupFactory | None = None
) -> Received | Skip:
    """Map a stored event to the pipeline's message and its log entry (never raises)."""
    try:
        ev = decode(m.event_decoder, raw)
        if ev.type != "send":
            return Skip(reason="malformed", detail=f"not a send event: {ev.type[:40]!r}")
        member, uploads = _check_event(ev)
    except msgspec.MsgspecError as exc:
        return Skip(reason="malformed", detail=str(exc)[:300])
    except FrameError as exc:
        return Skip(reason="malformed", detail=exc.message)
    message_id = f"{member.user_id}/{ev.client_id}"
    group = member.kind == "room"
    content, mentioned = _addressing(ev.text, me)
    reply_to = None
    if ev.reply_to is not None:
        reply_to = ReplyReference(
            message_id=ev.reply_to,
            loader=lookup(member.conversation, ev.reply_to) if lookup is not None else None,
        )
    message = InboundMessage(
        channel=CHANNEL,
        bot_id=me.id,
        message_id=message_id,
        conversation_id=member.conversation,
        conversation_type="group" if group else "direct",
        sender_id=member.user_id,
        sender_name=member.user_name,
        addressed=not group or mentioned or ev.answer is not None,
        content=content,
        images=[_media(u) for u in uploads if u.image],
        files=[_media(u) for u in uploads if not u.image],
        reply_to=reply_to,
        received_at=ev.at or 0.0,
    )
    logged = LoggedMessage(
        message_id=message_id,
        author_id=member.user_id,
        author_name=member.user_name,
        text=ev.text,
        at=ev.at or 0.0,
        reply_to=ev.reply_to,
        attachments=[Attachment(kind="image" if u.image else "file", name=u.name) for u in uploads],
        client_id=ev.client_id,
    )
    return Received(message, logged)


def _addressing(text: str, me: BotIdentity) -> tuple[str, bool]:
    """(text without ``@<bot name>``, whether it addressed the bot)."""
    content, n = me.mention().subn("", text)
    if n:
        return content.strip(), True
    command = text.lstrip().split(None, 1)[0] if text.strip() else ""
    _, at, target = command.partition("@")
    return text, command.startswith("/") and bool(at) and target.casefold() == me.name.casefold()


def _media(upload: _Upload) -> MediaRef:
    data = upload.data

    async def fetch(limit: int) -> bytes:
        return data

    return MediaRef(
        kind="image" if upload.image else "file",
        name=upload.name,
        mime=upload.mime,
        size=len(data),
        fetch=fetch,
    )


def reference_from_log(logged: LoggedMessage) -> ReplyReference:
    """The quote snapshot of a logged message: id, author, content, attachment kinds and
    names (never any data)."""
    return ReplyReference(
        message_id=logged.message_id,
        author_id=logged.author_id,
        author_name=logged.author_name,
        content=logged.text,
        attachments=[Attachment(kind=a.kind, name=a.name) for a in logged.attachments],
    )


# --- frames dshim sends --------------------------------------------------------------------


def iso(t: float) -> str:
    """Epoch seconds as ISO 8601 in UTC with milliseconds (``2026-09-21T12:00:00.000Z``)."""
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _encode(obj: dict[str, Any]) -> str:
    return m.encoder.encode(obj).decode()


def _message(conversation: str, logged: LoggedMessage, final: bool) -> dict[str, Any]:
    out: dict[str, Any] = {
        "type": "message",
        "conversation": conversation,
        "id": logged.message_id,
        "author": {
            "id": logged.author_id,
            "name": logged.author_name or logged.author_id,
            "bot": logged.author_bot,
        },
        "text": logged.text,
        "reply_to": logged.reply_to,
        "at": iso(logged.at),
        "final": final,
        "files": [{"kind": a.kind, "name": a.name} for a in logged.attachments],
    }
    if logged.client_id is not None:
        out["client_id"] = logged.client_id
    return out


def message_frame(conversation: str, logged: LoggedMessage, *, final: bool = True) -> str:
    """``{"type":"message", ...}``: one message, or the text so far of one being written."""
    return _encode(_message(conversation, logged, final))


def history_frame(conversation: str, messages: Iterable[tuple[LoggedMessage, bool]]) -> str:
    """``{"type":"history","conversation":C,"messages":[MESSAGE...]}`` (oldest first;
    each pair is a message and whether it is final)."""
    return _encode(
        {
            "type": "history",
            "conversation": conversation,
            "messages": [_message(conversation, lm, final) for lm, final in messages],
        }
    )


def accepted_frame(client_id: str, message_id: str, conversation: str) -> str:
    return _encode(
        {"type": "accepted", "client_id": client_id, "id": message_id, "conversation": conversation}
    )


def error_frame(code: str, message: str, *, client_id: str | None = None) -> str:
    out: dict[str, Any] = {"type": "error", "code": code, "message": message}
    if client_id is not None:
        out["client_id"] = client_id
    return _encode(out)


def interaction_frame(
    conversation: str,
    interaction_id: str,
    *,
    kind: str,
    prompt: str,
    options: Sequence[Any],
    multi_select: bool = False,
    allow_free_text: bool = False,
) -> str:
    """``{"type":"interaction", ...}``: buttons for the bot's message ``interaction_id``."""
    return _encode(
        {
            "type": "interaction",
            "conversation": conversation,
            "id": interaction_id,
            "kind": kind,
            "prompt": prompt,
            "options": [{"id": str(o.id), "label": str(o.label)} for o in options],
            "multi_select": multi_select,
            "allow_free_text": allow_free_text,
        }
    )


def interaction_closed_frame(conversation: str, interaction_id: str) -> str:
    """The request no longer waits for an answer: its buttons go away."""
    return _encode(
        {"type": "interaction_closed", "conversation": conversation, "id": interaction_id}
    )


def typing_frame(conversation: str, name: str) -> str:
    """The bot is writing an answer (until its first ``message`` frame)."""
    return _encode({"type": "typing", "conversation": conversation, "name": name})
