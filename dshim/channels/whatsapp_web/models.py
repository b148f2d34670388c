"""Views of neonize's ``Message`` event, as protobuf JSON.

An event reaches the channel as ``MessageToDict(event, preserving_proto_field_name=True)``
of neonize's ``Neonize_pb2.Message`` (the replay fixtures hold exactly that): ``Info``
(``MessageSource``, ``ID``, ``Pushname``, ``Timestamp`` ...) and ``Message`` (WhatsApp's
own ``waE2E.Message``: ``conversation``, ``extendedTextMessage``, ``imageMessage`` ...).
Only the fields dshim reads are declared; proto JSON leaves out every field at its
default (``IsGroup`` false, an empty string), so every field has one here too, and 64-bit
integers arrive as strings (``Timestamp``, Unix milliseconds; ``fileLength``).
"""

from __future__ import annotations

import msgspec


class JID(msgspec.Struct, frozen=True, omit_defaults=True):
    User: str = ""
    Server: str = ""
    Device: int = 0

    @property
    def text(self) -> str:
        """``user@server`` (what a ``contextInfo`` writes for a JID)."""
        return f"{self.User}@{self.Server}" if self.Server else self.User


class MessageSource(msgspec.Struct, frozen=True):
    Chat: JID = JID()
    Sender: JID = JID()
    IsFromMe: bool = False
    IsGroup: bool = False
    AddressingMode: str = ""
    SenderAlt: JID = JID()
    BroadcastListOwner: JID = JID()


class Info(msgspec.Struct, frozen=True):
    MessageSource: MessageSource = MessageSource()
    ID: str = ""
    Type: str = ""
    Pushname: str = ""
    Timestamp: str | int = 0
    Category: str = ""
    MediaType: str = ""
    Edit: str = ""


class ContextInfo(msgspec.Struct, frozen=True):
    stanzaID: str = ""
    participant: str = ""
    quotedMessage: WaMessage | None = None
    remoteJID: str = ""
    mentionedJID: list[str] = []
    isForwarded: bool = False
    forwardingScore: int = 0


class Text(msgspec.Struct, frozen=True):
    text: str = ""
    contextInfo: ContextInfo | None = None


class Media(msgspec.Struct, frozen=True):
    """An image, video, audio, sticker or document message."""

    mimetype: str = ""
    caption: str = ""
    fileName: str = ""
    title: str = ""
    fileLength: str | int = 0
    PTT: bool = False
    contextInfo: ContextInfo | None = None


class Location(msgspec.Struct, frozen=True):
    degreesLatitude: float = 0.0
    degreesLongitude: float = 0.0
    name: str = ""
    address: str = ""
    contextInfo: ContextInfo | None = None


class Contact(msgspec.Struct, frozen=True):
    displayName: str = ""
    vcard: str = ""
    contextInfo: ContextInfo | None = None


class Contacts(msgspec.Struct, frozen=True):
    displayName: str = ""
    contacts: list[Contact] = []
    contextInfo: ContextInfo | None = None


class Wrapped(msgspec.Struct, frozen=True):
    """``ephemeralMessage``, ``viewOnceMessage`` ... : a message inside a message."""

    message: WaMessage | None = None


class Protocol(msgspec.Struct, frozen=True):
    type: str | int = ""


class Present(msgspec.Struct, frozen=True):
    """A kind of message dshim only needs to recognise (a reaction, a poll update)."""


class WaMessage(msgspec.Struct, frozen=True):
    conversation: str = ""
    extendedTextMessage: Text | None = None
    imageMessage: Media | None = None
    videoMessage: Media | None = None
    audioMessage: Media | None = None
    documentMessage: Media | None = None
    stickerMessage: Media | None = None
    locationMessage: Location | None = None
    liveLocationMessage: Location | None = None
    contactMessage: Contact | None = None
    contactsArrayMessage: Contacts | None = None
    documentWithCaptionMessage: Wrapped | None = None
    ephemeralMessage: Wrapped | None = None
    viewOnceMessage: Wrapped | None = None
    viewOnceMessageV2: Wrapped | None = None
    viewOnceMessageV2Extension: Wrapped | None = None
    editedMessage: Wrapped | None = None
    protocolMessage: Protocol | None = None
    reactionMessage: Present | None = None
    encReactionMessage: Present | None = None
    pollUpdateMessage: Present | None = None


class MessageEvent(msgspec.Struct, frozen=True):
    Info: Info = Info()
    Message: WaMessage = WaMessage()
    IsEdit: bool = False


event_decoder = msgspec.json.Decoder(MessageEvent)
