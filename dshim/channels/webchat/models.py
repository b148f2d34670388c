"""The web chat's wire structs: the frames a page (or a script) sends, and the stored event.

View structs in the msgspec sense: they name only what dshim reads; unknown fields are
ignored.  A ``send`` frame carries no sender: the socket's ``join`` said who writes.  The
stored :class:`Event` (the durable inbox entry, and a replay fixture's event) is the
``send`` frame with the sender's ``user`` and the conversation ``kind`` added, so it can
be mapped again after a restart without the socket.
"""

from __future__ import annotations

import msgspec


class User(msgspec.Struct, frozen=True):
    """Who writes: an id the page made up (kept in localStorage) and a display name."""

    id: str
    name: str | None = None


class FileUpload(msgspec.Struct, frozen=True):
    """One attached file or image, base64 in the frame."""

    name: str | None = None
    mime: str | None = None
    data_b64: str = ""


class Envelope(msgspec.Struct, frozen=True):
    """Only the frame's type (the first look at every frame)."""

    type: str


class JoinFrame(msgspec.Struct, frozen=True):
    """``{"type":"join","conversation":C,"kind":"direct"|"room","user":{"id","name"}}``"""

    conversation: str
    user: User
    kind: str = "direct"


class SendFrame(msgspec.Struct, frozen=True):
    """``{"type":"send","client_id":K,"conversation":C,"text":T,"reply_to":ID|null,"files":[...]}``"""

    client_id: str
    conversation: str
    text: str = ""
    reply_to: str | None = None
    files: list[FileUpload] = msgspec.field(default_factory=list)


class AnswerFrame(msgspec.Struct, frozen=True):
    """A button press: ``{"type":"answer","client_id":K,"conversation":C,"interaction":ID,"option":O}``"""

    client_id: str
    conversation: str
    interaction: str
    option: str


class LeaveFrame(msgspec.Struct, frozen=True):
    """``{"type":"leave","conversation":C}``: stop receiving that conversation's frames."""

    conversation: str


ClientFrame = JoinFrame | SendFrame | AnswerFrame | LeaveFrame


class Event(msgspec.Struct, frozen=True, kw_only=True):
    """A received message as stored: the ``send`` frame plus ``user`` and ``kind``.

    ``at`` is when dshim received it (epoch seconds; fixtures may leave it out);
    ``answer`` is the interaction a button press answered (then the text is the option).
    """

    type: str = "send"
    client_id: str
    conversation: str
    text: str = ""
    reply_to: str | None = None
    files: list[FileUpload] = msgspec.field(default_factory=list)
    user: User
    kind: str
    at: float | None = None
    answer: str | None = None


envelope_decoder = msgspec.json.Decoder(Envelope)
join_decoder = msgspec.json.Decoder(JoinFrame)
send_decoder = msgspec.json.Decoder(SendFrame)
answer_decoder = msgspec.json.Decoder(AnswerFrame)
leave_decoder = msgspec.json.Decoder(LeaveFrame)
event_decoder = msgspec.json.Decoder(Event)
encoder = msgspec.json.Encoder()
