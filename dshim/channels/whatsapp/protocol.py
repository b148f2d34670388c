"""WhatsApp Cloud API, sans-IO: webhook bodies -> InboundMessage, signatures, Graph errors.

Theory of operation
-------------------
The Cloud API delivers inbound traffic only by webhook
(developers.facebook.com/documentation/business-messaging/whatsapp/webhooks): Meta POSTs
a JSON body ``{"object": "whatsapp_business_account", "entry": [{"id": <WABA>,
"changes": [{"field": "messages", "value": {metadata, contacts, messages, statuses}}]}]}``
to ``/hooks/<bot>``, signed with ``X-Hub-Signature-256: sha256=<hex HMAC-SHA256 of the
raw body keyed with the app secret>``.  There is no connection state: the states are
per request — *unverified* (signature checked on the raw bytes, constant time, before
any parsing: :func:`signature_ok`), *split* (the envelope decoded with bounded depth,
each message and status kept as its own raw bytes: :func:`split_body`), *accepted*
(every message handed to the pipeline, which wrote its dedup key and inbox row), then
answered 200.

What Meta guarantees: a non-2xx (or no answer) is delivered again with exponential
backoff for up to 7 days, so a crash before the 200 loses nothing, and duplicates and
reordering are normal: dedup is by ``messages[].id`` (the wamid, stable across
redeliveries), staleness by ``messages[].timestamp`` (epoch seconds as a *string*).
Meta's latency target (median <= 250 ms) is above what accepting takes (dedup key and
inbox row), so the channel acknowledges only after acceptance.  A body that fails to
decode after a good signature is answered 200 and logged as ``malformed``: a retry
would carry the same bytes.  The verification handshake is a GET with ``hub.mode``,
``hub.verify_token`` and ``hub.challenge`` (:func:`challenge_answer`).

Each message is stored in the durable inbox as a one-message webhook body
(:func:`single_body`: its metadata, its sender's contact and the message's exact
bytes), so :func:`decode_event` reads the inbox, the webhook and replay fixtures alike.

Mapping rules: Cloud API conversations are direct chats keyed by the user's BSUID
(``contacts[].user_id`` / ``from_user_id``, since 2026) else ``wa_id``/``from``; a
message with ``group_id`` comes from a (business-created) group and is addressed when
it mentions the business number or replies to one of the bot's messages, as on
Telegram: ``context.from`` is the business number (the digits of
``display_phone_number``; every webhook's ``metadata`` maps our ``phone_number_id`` to
it), or the channel found ``context.id`` among the bot's answers in the message index
and marked the stored body so (:func:`quoting_bot`).  ``context`` carries ids only
(``id``, ``from``): a quote is looked up in dshim's own message index by the channel's
loader; a message whose ``context`` has no id is forwarded, not a quote.
``reaction``, ``edit``, ``revoke``, ``system``, ``unsupported`` and other non-content
types are not prompts.

Graph errors (``{"error": {"code", "message", ...}}``) are classified once, in
:func:`graph_error`; codes: developers.facebook.com/docs/whatsapp/cloud-api/support/
error-codes.  Nothing here imports trio or httpx or reads a clock.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import urllib.parse
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import UNSET

from dshim.channels.kit import decode as kit_decode
from dshim.channels.kit.ids import (
    DIGITS,
    TOKEN,
    BadId,
    BadTime,
    check_id,
    check_optional_id,
    check_time,
    shape,
    valid_id,
)
from dshim.channels.whatsapp import models as m
from dshim.errors import (
    AuthError,
    ChannelError,
    NotFound,
    PermissionDenied,
    RemoteProtocolError,
    TransportError,
)
from dshim.model import (
    ConversationType,
    Fetcher,
    InboundMessage,
    Loader,
    MediaRef,
    ReplyReference,
    Skip,
)

CHANNEL = "whatsapp"
#: Text message body limit (interactive bodies and captions: 1,024).
MAX_TEXT = 4096
MAX_INTERACTIVE_BODY = 1024
MAX_BUTTON_TITLE = 20
MAX_LIST_ROWS = 10
MAX_ROW_TITLE = 24
SIGNATURE_HEADER = "x-hub-signature-256"
#: Button and list-row ids of the interactions dshim sends: ``dshim.opt.<n>``.
OPTION_ID_PREFIX = "dshim.opt."
#: A BSUID: two-letter country code, a period, then letters and digits (maybe ``ENT.``).
BSUID_RE = re.compile(r"^[A-Z]{2}\.[A-Za-z0-9.]{1,160}$")

# Ids (whatsapp.md §A, kit.ids): a wamid is ``wamid.`` and base64; phone numbers
# (``from``, ``wa_id``) are digits; a BSUID is ``CC.<alnum>``; group and media ids are
# digit strings (letters, ``_``, ``-`` tolerated; media ids go into a URL path).  A message
# whose own id, sender or group is of another shape is malformed; a bad ``context.id``
# only makes the quote ``not-found``.
WAMID = shape("wamid", f"wamid\\.[{TOKEN}=+/]+")
PHONE = DIGITS
BSUID = shape("bsuid", "[A-Z]{2}\\.[A-Za-z0-9.]{1,160}")
GRAPH_ID = shape("graph id", f"[{TOKEN}]+")
#: Types that carry no prompt (revoke also marks the indexed message deleted).
NOT_PROMPTS = frozenset(
    {"reaction", "edit", "revoke", "system", "unsupported", "request_welcome", "order", "unknown"}
)
#: Graph error codes (pywa errors.py; Meta's error-code page).
AUTH_CODES = frozenset({0, 190})
THROTTLE_CODES = frozenset({4, 80007, 130429, 131056})
WINDOW_CLOSED = 131047
UNDELIVERABLE = 131026
TRANSIENT_CODES = frozenset({1, 2, 131000, 131016, 131052, 131053, 135000})

#: (conversation, quoted wamid, quoted sender is the bot) -> a loader reading the index.
LoaderFactory = Callable[[str, str, bool], Loader]
#: (media id, sha256 or None) -> the lazy download of a media item.
FetcherFactory = Callable[[str, "str | None"], Fetcher]


class Throttled(TransportError):
    """A throughput, pair-rate or API-call limit (130429, 131056, 4, 80007): the message
    was not sent; Graph gives no retry-after, so the sender backs off exponentially."""

    def __init__(self, message: str, *, status: int | None = None, code: int | None = None):
        super().__init__(message, status=status, code=code, request_sent=False)


class WindowClosed(ChannelError):
    """131047: more than 24 hours since the user's last message; only templates go out."""


@dataclass(frozen=True, slots=True)
class BotIdentity:
    """Who the bot is: the business phone number's id, its display number and name."""

    phone_number_id: str
    display_phone_number: str | None = None
    name: str | None = None

    @property
    def id(self) -> str:
        return self.phone_number_id

    @property
    def digits(self) -> str:
        """The display number's digits (how ``from`` and ``context.from`` write it)."""
        return _digits(self.display_phone_number or "")

    def is_me(self, number: str | None) -> bool:
        return bool(number) and bool(self.digits) and _digits(number or "") == self.digits

    def seen_in(self, metadata: m.Metadata | None) -> BotIdentity:
        """This identity, its display number taken from a webhook's ``metadata`` when
        the Graph API did not give one (only metadata of our own phone number id)."""
        if (
            self.display_phone_number
            or metadata is None
            or not metadata.display_phone_number
            or metadata.phone_number_id != self.phone_number_id
        ):
            return self
        return BotIdentity(self.phone_number_id, metadata.display_phone_number, self.name)


def _digits(number: str) -> str:
    return "".join(c for c in number if c.isdigit())


# --- the webhook edge ----------------------------------------------------------------------


def signature_ok(secret: bytes, body: bytes, header: str | None) -> bool:
    """``X-Hub-Signature-256`` is ``sha256=<hex HMAC-SHA256(app secret, raw body)>``;
    compared in constant time.  A missing or malformed header is False."""
    if not header or not secret:
        return False
    given = header.strip()
    if not given.startswith("sha256="):
        return False
    expected = hmac.new(secret, body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, given[len("sha256=") :].lower())


def sign(secret: bytes, body: bytes) -> str:
    """The ``X-Hub-Signature-256`` value Meta would send for ``body`` (probe, fake)."""
    return "sha256=" + hmac.new(secret, body, hashlib.sha256).hexdigest()


def challenge_answer(query: str, verify_token: str) -> str | None:
    """The verification GET: the raw ``hub.challenge`` when ``hub.mode`` is ``subscribe``
    and ``hub.verify_token`` matches (constant time), else None (answer 403)."""
    params = dict(urllib.parse.parse_qsl(query, keep_blank_values=True))
    mode = params.get("hub.mode", "")
    token = params.get("hub.verify_token", "")
    challenge = params.get("hub.challenge")
    if mode != "subscribe" or challenge is None or not verify_token:
        return None
    if not hmac.compare_digest(token.encode(), verify_token.encode()):
        return None
    return challenge


@dataclass(frozen=True, slots=True)
class Part:
    """One message or status of a webhook body, as a one-item body of its own."""

    kind: str  # "message" | "status" | "malformed" (a body that is no notification)
    raw: bytes
    #: The status, decoded (statuses are handled by the channel, never the pipeline).
    status: m.Status | None = None
    #: Why a ``malformed`` body is one.
    detail: str = ""


class BodyError(RemoteProtocolError, ValueError):
    """The webhook body is not a WhatsApp notification (a ``malformed`` drop, answered 200)."""


def single_body(
    entry_id: str | None,
    metadata: m.Metadata | None,
    contacts: list[m.Contact],
    *,
    messages: Sequence[bytes] = (),
    statuses: Sequence[bytes] = (),
) -> bytes:
    """A webhook body holding exactly the given messages/statuses (their exact bytes)."""
    value = (
        b'{"messaging_product":"whatsapp","metadata":'
        + m.encoder.encode(metadata)
        + b',"contacts":'
        + m.encoder.encode(contacts)
    )
    if messages:
        value += b',"messages":[' + b",".join(messages) + b"]"
    if statuses:
        value += b',"statuses":[' + b",".join(statuses) + b"]"
    return (
        b'{"object":"whatsapp_business_account","entry":[{"id":'
        + m.encoder.encode(entry_id)
        + b',"changes":[{"field":"messages","value":'
        + value
        + b"}}]}]}"
    )


#: The envelope key of a stored body whose quote the index showed to be the bot's.
QUOTE_OF_BOT_KEY = b'"dshim_quote_of_bot":true'


def quoting_bot(raw: bytes) -> bytes:
    """A one-message body (:func:`single_body`) marked as replying to one of the bot's
    messages, as found in the message index: the inbox keeps the verdict, so after a
    restart the message is still addressed.  Webhook POSTs never carry the mark:
    :func:`split_body` rebuilds every envelope."""
    if not raw.startswith(b"{") or raw.startswith(b"{" + QUOTE_OF_BOT_KEY):
        return raw
    return b"{" + QUOTE_OF_BOT_KEY + b"," + raw[1:]


def _contact_for(contacts: list[m.Contact], msg_raw: bytes) -> list[m.Contact]:
    """The sender's contact for one message (by wa_id / user_id; the only one else)."""
    if len(contacts) <= 1:
        return contacts
    try:
        msg = m.MESSAGE_DECODER.decode(msg_raw)  # within a body already depth-checked
    except (msgspec.DecodeError, msgspec.ValidationError):
        return contacts[:1]
    for c in contacts:
        if (c.wa_id and c.wa_id == msg.from_) or (c.user_id and c.user_id == msg.from_user_id):
            return [c]
    return contacts[:1]


def split_body(body: bytes) -> list[Part]:
    """Cut a webhook body into its messages and statuses, in body order.

    Raises :class:`BodyError` when the envelope is not a notification at all; a single
    message that is bad stays a part of its own (its decode is its ``malformed`` drop).
    Changes of other fields (account updates, templates) are ignored.
    """
    try:
        env = kit_decode.decode(m.BODY_DECODER, body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise BodyError(f"not a webhook body: {str(exc)[:200]}") from None
    if env.object != "whatsapp_business_account":
        raise BodyError(f"object is {env.object[:60]!r}, not whatsapp_business_account")
    parts: list[Part] = []
    for entry in env.entry:
        for change in entry.changes:
            if change.field != "messages":
                continue
            try:
                value = m.VALUE_DECODER.decode(change.value)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                raise BodyError(f"change value: {str(exc)[:200]}") from None
            for raw in value.messages:
                msg_raw = bytes(raw)
                contacts = _contact_for(value.contacts, msg_raw)
                parts.append(
                    Part(
                        "message",
                        single_body(entry.id, value.metadata, contacts, messages=[msg_raw]),
                    )
                )
            for raw in value.statuses:
                try:
                    status = m.STATUS_DECODER.decode(raw)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    status = None
                parts.append(
                    Part(
                        "status",
                        single_body(entry.id, value.metadata, [], statuses=[bytes(raw)]),
                        status,
                    )
                )
    return parts


# --- mapping -------------------------------------------------------------------------------


def parse_timestamp(value: str | None) -> float | None:
    """``timestamp`` is epoch seconds as a string; None when absent or not a number."""
    if value is None:
        return None
    value = value.strip()
    if not value.isdigit() or len(value) > 12:
        return None
    return float(value)


def user_key(msg: m.Message, contact: m.Contact | None) -> str | None:
    """The user's key: the BSUID when the payload has one, else the phone (``wa_id``)."""
    bsuid = msg.from_user_id or (contact.user_id if contact is not None else None)
    if bsuid:
        return bsuid
    return msg.from_ or (contact.wa_id if contact is not None else None)


def is_bsuid(key: str) -> bool:
    return bool(BSUID_RE.match(key))


def _media(kind: str, media: m.Media, fetcher: FetcherFactory | None) -> MediaRef:
    check_optional_id(media.id, GRAPH_ID, "media id")
    return MediaRef(
        kind=kind,
        name=media.filename,
        mime=media.mime_type,
        fetch=fetcher(media.id, media.sha256) if fetcher is not None and media.id else None,
    )


def _location_text(loc: m.Location) -> str:
    where = ", ".join(p for p in (loc.name, loc.address) if p)
    coords = (
        f"{loc.latitude}, {loc.longitude}"
        if loc.latitude is not None and loc.longitude is not None
        else ""
    )
    if where and coords:
        return f"[location] {where} ({coords})"
    return f"[location] {where or coords}".rstrip()


def _contacts_text(contacts: list[m.SharedContact]) -> str:
    lines = []
    for c in contacts[:10]:
        name = c.name.formatted_name if c.name is not None and c.name.formatted_name else ""
        phones = ", ".join(p.phone for p in c.phones[:5] if p.phone)
        lines.append("[contact] " + " ".join(x for x in (name, phones) if x))
    return "\n".join(lines)


def _interactive_text(inter: m.Interactive) -> str:
    reply = inter.button_reply or inter.list_reply
    if reply is None:
        return ""
    rid = reply.id or ""
    # A press of one of dshim's own option buttons answers with the option's number,
    # so the interaction state machine judges it exactly like the typed number.
    if rid.startswith(OPTION_ID_PREFIX) and rid[len(OPTION_ID_PREFIX) :].isdigit():
        return rid[len(OPTION_ID_PREFIX) :]
    return reply.title or rid


def _content(
    msg: m.Message, fetcher: FetcherFactory | None
) -> tuple[str, list[MediaRef], list[MediaRef]]:
    images: list[MediaRef] = []
    files: list[MediaRef] = []
    t = msg.type
    if t == "text" and msg.text is not None:
        return msg.text.body, images, files
    if t in ("image", "sticker"):
        media = msg.image if t == "image" else msg.sticker
        if media is not None:
            images.append(_media("image", media, fetcher))
            return media.caption or "", images, files
    if t in ("document", "audio", "video"):
        media = getattr(msg, t)
        if media is not None:
            files.append(_media("file" if t == "document" else t, media, fetcher))
            return media.caption or "", images, files
    if t == "location" and msg.location is not None:
        return _location_text(msg.location), images, files
    if t == "contacts" and msg.contacts:
        return _contacts_text(msg.contacts), images, files
    if t == "interactive" and msg.interactive is not None:
        return _interactive_text(msg.interactive), images, files
    if t == "button" and msg.button is not None:
        return msg.button.text or msg.button.payload or "", images, files
    return "", images, files


def _mention(text: str, me: BotIdentity) -> tuple[bool, str]:
    """A group mention of the business number (``@<digits>``), removed from the text."""
    if not me.digits:
        return False, text
    pattern = re.compile(r"@\+?" + re.escape(me.digits) + r"\b\s?")
    if not pattern.search(text):
        return False, text
    return True, pattern.sub("", text).strip()


def map_message(
    msg: m.Message,
    contact: m.Contact | None,
    me: BotIdentity,
    *,
    loader: LoaderFactory | None = None,
    fetcher: FetcherFactory | None = None,
    quote_of_bot: bool = False,
) -> InboundMessage | Skip:
    """Map one decoded message to the normalized message (or a Skip with the reason).

    ``quote_of_bot``: the index showed that the quoted message is one of the bot's.
    """
    mid = check_id(msg.id, WAMID, "id")
    if msg.from_:
        check_id(msg.from_, PHONE, "from")
    if msg.from_user_id:
        check_id(msg.from_user_id, BSUID, "from_user_id")
    if contact is not None:
        check_optional_id(contact.wa_id, PHONE, "wa_id")
        check_optional_id(contact.user_id, BSUID, "user_id")
    check_optional_id(msg.group_id, GRAPH_ID, "group_id")
    if msg.type in NOT_PROMPTS:
        return Skip(reason="ignored", detail=f"{msg.type} is not a prompt", message_id=mid)
    key = user_key(msg, contact)
    if not key:
        return Skip(reason="malformed", detail="the message has no sender", message_id=mid)
    if me.is_me(msg.from_):
        return Skip(reason="echo", detail="sent by this business number", message_id=mid)
    at = parse_timestamp(msg.timestamp)
    if at is None:
        return Skip(reason="malformed", detail="timestamp: not epoch seconds", message_id=mid)
    check_time(at, "timestamp")
    content, images, files = _content(msg, fetcher)
    phone = msg.from_ or (contact.wa_id if contact is not None else None)
    conversation_type: ConversationType = "direct"
    conversation = key
    addressed = mentioned = False
    ctx = msg.context
    # A reply to one of the bot's messages: context.from is the business number (Meta
    # sets it to the quoted message's sender), or the index knew the id as ours.
    to_bot = ctx is not None and bool(ctx.id) and (me.is_me(ctx.from_) or quote_of_bot)
    if msg.group_id:
        # Cloud API groups are business-created: answer a mention of the number, or a
        # reply to the bot (as on Telegram).
        conversation_type, conversation = "group", msg.group_id
        mentioned, content = _mention(content, me)
        addressed = mentioned or to_bot
    else:
        addressed = True
    profile = contact.profile if contact is not None else None
    # The profile name, else the username a username user chose (2026).
    name = (profile.name or profile.username) if profile is not None else None
    reply_to: ReplyReference | None = None
    forwarded = False
    if ctx is not None:
        forwarded = ctx.forwarded or ctx.frequently_forwarded
        if ctx.id and not valid_id(ctx.id, WAMID) and msg.type not in ("interactive", "button"):
            reply_to = ReplyReference(unavailable_reason="not-found")  # never looked up
        elif ctx.id and msg.type not in ("interactive", "button"):
            # A button press carries the id of the message with the buttons: that is
            # the press's origin, not a quote (a quote would never count as an answer).
            # Only ids: what was quoted comes from dshim's own message index, in the turn.
            from_bot = to_bot
            reply_to = ReplyReference(
                message_id=ctx.id,
                author_id=me.id if from_bot else UNSET,
                author_name=(me.name or UNSET) if from_bot else UNSET,
            )
            if loader is not None:
                reply_to.loader = loader(conversation, ctx.id, from_bot)
    if not content.strip() and not images and not files:
        return Skip(reason="ignored", detail=f"{msg.type} has no content", message_id=mid)
    return InboundMessage(
        channel=CHANNEL,
        bot_id=me.id,
        message_id=mid,
        conversation_id=conversation,
        conversation_type=conversation_type,
        sender_id=key,
        sender_name=name or None,
        addressed=addressed,
        mentioned=mentioned,
        content=content,
        images=images,
        files=files,
        reply_to=reply_to,
        received_at=at,
        forwarded=forwarded,
        # The phone number, when the payload has it and the key is the BSUID: answers go
        # to the number (every account can send there), the BSUID only without one.
        route=phone if phone and phone != key else None,
    )


@dataclass(frozen=True, slots=True)
class Decoded:
    """One part decoded: the pipeline item, and what the channel does with it besides."""

    item: InboundMessage | Skip
    #: (conversation, wamid) of a message the user deleted (``revoke``).
    revoked: tuple[str, str] | None = None


def decode_event(
    raw: bytes,
    me: BotIdentity,
    *,
    loader: LoaderFactory | None = None,
    fetcher: FetcherFactory | None = None,
) -> Decoded:
    """Decode a one-message webhook body (the inbox, a fixture, a part of a POST).

    Never raises for bad input: a ``malformed`` Skip.  A body with several messages maps
    the first (the channel splits bodies with :func:`split_body` first); a body with only
    statuses is ``ignored``.
    """
    try:
        env = kit_decode.decode(m.BODY_DECODER, raw)
        if env.object != "whatsapp_business_account":
            return Decoded(Skip(reason="malformed", detail="not a WhatsApp notification"))
        for entry in env.entry:
            for change in entry.changes:
                if change.field != "messages":
                    continue
                value = m.VALUE_DECODER.decode(change.value)
                if not value.messages:
                    continue
                msg = m.MESSAGE_DECODER.decode(value.messages[0])
                contact = value.contacts[0] if value.contacts else None
                item = map_message(
                    msg,
                    contact,
                    me.seen_in(value.metadata),
                    loader=loader,
                    fetcher=fetcher,
                    quote_of_bot=env.dshim_quote_of_bot,
                )
                revoked = None
                if (
                    msg.type == "revoke"
                    and msg.revoke
                    and valid_id(msg.revoke.original_message_id, WAMID)
                ):
                    key = user_key(msg, contact)
                    if key:
                        revoked = (msg.group_id or key, msg.revoke.original_message_id)
                return Decoded(item, revoked)
    except (msgspec.DecodeError, msgspec.ValidationError, BadId, BadTime) as exc:
        return Decoded(Skip(reason="malformed", detail=str(exc)[:300]))
    except (RecursionError, UnicodeError, ValueError) as exc:
        return Decoded(Skip(reason="malformed", detail=type(exc).__name__))
    return Decoded(Skip(reason="ignored", detail="no message in the body"))


def status_conversation(status: m.Status) -> str | None:
    """The conversation a status belongs to (the recipient's key)."""
    return status.recipient_user_id or status.recipient_id


# --- sending --------------------------------------------------------------------------------


def recipient(conversation: str, phone: str | None = None) -> dict[str, str]:
    """Who a message goes to: the phone number (``to``) when it is known — the
    conversation's own key or the ``route`` of the message answered — else the BSUID
    (``recipient``) of a user who hides their number."""
    if phone:
        return {"to": phone}
    if is_bsuid(conversation):
        return {"recipient": conversation}
    return {"to": conversation}


def _addressed_to(conversation: str, group: bool, phone: str | None = None) -> dict[str, Any]:
    if group:  # a Cloud API group (business-created): recipient_type "group"
        return {"messaging_product": "whatsapp", "recipient_type": "group", "to": conversation}
    return {
        "messaging_product": "whatsapp",
        "recipient_type": "individual",
        **recipient(conversation, phone),
    }


def text_payload(
    conversation: str,
    text: str,
    *,
    reply_to: str | None,
    group: bool = False,
    phone: str | None = None,
) -> dict[str, Any]:
    """A text message (a contextual reply when ``reply_to`` is set), no link preview."""
    body = _addressed_to(conversation, group, phone)
    if reply_to:
        body["context"] = {"message_id": reply_to}
    body["type"] = "text"
    body["text"] = {"body": text, "preview_url": False}
    return body


def typing_payload(message_id: str) -> dict[str, Any]:
    """Mark ``message_id`` read and show "typing…" (up to 25 s or until we answer)."""
    return {
        "messaging_product": "whatsapp",
        "status": "read",
        "message_id": message_id,
        "typing_indicator": {"type": "text"},
    }


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def interactive_payload(
    conversation: str,
    body: str,
    labels: list[str],
    *,
    reply_to: str | None,
    group: bool = False,
    phone: str | None = None,
) -> dict[str, Any] | None:
    """Reply buttons for up to 3 options, a list message for up to 10; None beyond
    (the caller sends text).  Ids are ``dshim.opt.<n>`` (1-based)."""
    if not labels or len(labels) > MAX_LIST_ROWS:
        return None
    interactive: dict[str, Any]
    if len(labels) <= 3:
        interactive = {
            "type": "button",
            "body": {"text": _cut(body, MAX_INTERACTIVE_BODY)},
            "action": {
                "buttons": [
                    {
                        "type": "reply",
                        "reply": {
                            "id": f"{OPTION_ID_PREFIX}{i}",
                            "title": _cut(label, MAX_BUTTON_TITLE),
                        },
                    }
                    for i, label in enumerate(labels, 1)
                ]
            },
        }
    else:
        interactive = {
            "type": "list",
            "body": {"text": _cut(body, MAX_INTERACTIVE_BODY)},
            "action": {
                "button": "Choose",
                "sections": [
                    {
                        "title": "Options",
                        "rows": [
                            {"id": f"{OPTION_ID_PREFIX}{i}", "title": _cut(label, MAX_ROW_TITLE)}
                            for i, label in enumerate(labels, 1)
                        ],
                    }
                ],
            },
        }
    out = _addressed_to(conversation, group, phone)
    if reply_to:
        out["context"] = {"message_id": reply_to}
    out["type"] = "interactive"
    out["interactive"] = interactive
    return out


def sent_id(what: str, body: bytes) -> str:
    """The wamid of a send's answer ``{"messages": [{"id": ...}]}``."""
    try:
        result = kit_decode.decode(m.SEND_DECODER, body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise RemoteProtocolError(f"{what}: the answer is not a send result") from None
    if not result.messages:
        raise RemoteProtocolError(f"{what}: the answer names no message id")
    return result.messages[0].id


def graph_error(what: str, status: int, body: bytes) -> ChannelError:
    """A Graph API failure as the error tree (by error code first, then HTTP status)."""
    code: int | None = None
    text = f"{what}: HTTP {status}"
    try:
        err = kit_decode.decode(m.GRAPH_ERROR_DECODER, body).error
        code = err.code
        if err.message:
            text = f"{what}: {err.message[:200]} (code {code}, HTTP {status})"
    except (msgspec.DecodeError, msgspec.ValidationError):
        pass
    if code in AUTH_CODES or status == 401:
        return AuthError(
            text + ": the access token is invalid or expired", status=status, code=code
        )
    if code in THROTTLE_CODES or (status == 429 and code is None):
        return Throttled(text, status=status, code=code)
    if code == WINDOW_CLOSED:
        return WindowClosed(text, status=status, code=code)
    if code == UNDELIVERABLE or status in (404, 410):
        return NotFound(text, status=status, code=code)
    if code is not None and (code == 10 or 200 <= code <= 299) or status == 403:
        return PermissionDenied(text, status=status, code=code)
    if code in TRANSIENT_CODES or status >= 500:
        return TransportError(text, status=status, code=code, request_sent=True)
    return ChannelError(text, status=status, code=code)
