"""msgspec "view" structs of the WhatsApp Cloud API: only the fields dshim reads.

Names follow Meta's webhook and Graph API references (``from`` is ``from_``).  Unknown
fields are ignored, so newer payload versions decode fine.  The webhook body is decoded
in two steps: the envelope (:class:`Body`) keeps each message and status as
:class:`msgspec.Raw`, so one bad message is that message's ``malformed`` drop and its
exact bytes can be stored in the durable inbox.  One decoder per type, reused.
"""

from __future__ import annotations

import msgspec


class _View(msgspec.Struct, kw_only=True, rename={"from_": "from"}, gc=False):
    pass


# --- the webhook envelope ---------------------------------------------------------------


class Metadata(_View):
    display_phone_number: str | None = None
    phone_number_id: str | None = None


class Profile(_View):
    name: str | None = None
    username: str | None = None


class Contact(_View):
    profile: Profile | None = None
    wa_id: str | None = None
    #: The business-scoped user id (BSUID, ``CC.<alnum>``), since 2026.
    user_id: str | None = None


class Value(_View):
    messaging_product: str | None = None
    metadata: Metadata | None = None
    contacts: list[Contact] = []
    messages: list[msgspec.Raw] = []
    statuses: list[msgspec.Raw] = []


class Change(_View):
    field: str = ""
    value: msgspec.Raw = msgspec.Raw(b"null")


class Entry(_View):
    id: str | None = None
    changes: list[Change] = []


class Body(_View):
    object: str = ""
    entry: list[Entry] = []
    #: dshim's own mark on a stored one-message body (``protocol.quoting_bot``).
    dshim_quote_of_bot: bool = False


# --- messages -------------------------------------------------------------------------------


class Context(_View):
    id: str | None = None
    from_: str | None = None
    forwarded: bool = False
    frequently_forwarded: bool = False


class Text(_View):
    body: str = ""


class Media(_View):
    """``image`` / ``document`` / ``audio`` / ``video`` / ``sticker``."""

    id: str | None = None
    mime_type: str | None = None
    sha256: str | None = None
    caption: str | None = None
    filename: str | None = None


class Location(_View):
    latitude: float | None = None
    longitude: float | None = None
    name: str | None = None
    address: str | None = None


class ContactName(_View):
    formatted_name: str | None = None


class ContactPhone(_View):
    phone: str | None = None


class SharedContact(_View):
    name: ContactName | None = None
    phones: list[ContactPhone] = []


class Reply(_View):
    """``interactive.button_reply`` / ``interactive.list_reply``."""

    id: str | None = None
    title: str | None = None
    description: str | None = None


class Interactive(_View):
    type: str | None = None
    button_reply: Reply | None = None
    list_reply: Reply | None = None


class Button(_View):
    """A quick-reply button of a template."""

    text: str | None = None
    payload: str | None = None


class Revoke(_View):
    original_message_id: str | None = None


class Edit(_View):
    original_message_id: str | None = None


class Message(_View):
    id: str
    timestamp: str | None = None
    type: str = "unknown"
    from_: str | None = None
    #: The sender's BSUID (newer payloads; ``contacts[].user_id`` carries it too).
    from_user_id: str | None = None
    group_id: str | None = None
    context: Context | None = None
    text: Text | None = None
    image: Media | None = None
    document: Media | None = None
    audio: Media | None = None
    video: Media | None = None
    sticker: Media | None = None
    location: Location | None = None
    contacts: list[SharedContact] | None = None
    interactive: Interactive | None = None
    button: Button | None = None
    revoke: Revoke | None = None
    edit: Edit | None = None


class StatusError(_View):
    code: int | None = None
    title: str | None = None
    message: str | None = None


class Status(_View):
    id: str
    status: str = ""
    timestamp: str | None = None
    recipient_id: str | None = None
    recipient_user_id: str | None = None
    errors: list[StatusError] = []


# --- Graph API answers ------------------------------------------------------------------------


class GraphErrorBody(_View):
    message: str | None = None
    type: str | None = None
    code: int | None = None
    error_subcode: int | None = None


class GraphError(_View):
    error: GraphErrorBody


class SentId(_View):
    id: str


class SendResult(_View):
    messages: list[SentId] = []


class MediaInfo(_View):
    url: str
    mime_type: str | None = None
    sha256: str | None = None
    file_size: int | None = None


class PhoneNumber(_View):
    id: str | None = None
    display_phone_number: str | None = None
    verified_name: str | None = None
    quality_rating: str | None = None


BODY_DECODER = msgspec.json.Decoder(Body)
VALUE_DECODER = msgspec.json.Decoder(Value)
MESSAGE_DECODER = msgspec.json.Decoder(Message)
STATUS_DECODER = msgspec.json.Decoder(Status)
GRAPH_ERROR_DECODER = msgspec.json.Decoder(GraphError)
SEND_DECODER = msgspec.json.Decoder(SendResult)
MEDIA_DECODER = msgspec.json.Decoder(MediaInfo)
PHONE_DECODER = msgspec.json.Decoder(PhoneNumber)
encoder = msgspec.json.Encoder()
