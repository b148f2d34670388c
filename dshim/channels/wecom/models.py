"""msgspec view structs for the WeCom AI-bot long connection frames dshim reads.

Only the fields dshim uses are named; everything else is skipped by the decoders.  Field
meanings: ../shared/protocols/wecom.md §3 (the SDK's ``src/types/message.ts`` and
``event.ts``, the long-connection doc 101463).  Decoders are built once per type.
"""

from __future__ import annotations

import msgspec


class Headers(msgspec.Struct, kw_only=True, gc=False):
    req_id: str = ""


class Frame(msgspec.Struct, kw_only=True, gc=False):
    """Every frame: ``{cmd, headers: {req_id}, body}``; acks carry no ``cmd`` but
    ``errcode`` and ``errmsg``."""

    cmd: str | None = None
    headers: Headers = msgspec.field(default_factory=Headers)
    body: msgspec.Raw = msgspec.Raw(b"null")
    errcode: int | None = None
    errmsg: str | None = None


class Sender(msgspec.Struct, kw_only=True, gc=False):
    userid: str = ""
    corpid: str | None = None


class Text(msgspec.Struct, kw_only=True, gc=False):
    content: str = ""


class Media(msgspec.Struct, kw_only=True, gc=False):
    """An encrypted download: ``url`` (valid ~5 minutes) and its per-URL ``aeskey``."""

    url: str = ""
    aeskey: str = ""


class MixedItem(msgspec.Struct, kw_only=True, gc=False):
    msgtype: str = ""
    text: Text | None = None
    image: Media | None = None


class Mixed(msgspec.Struct, kw_only=True, gc=False):
    msg_item: list[MixedItem] = msgspec.field(default_factory=list)


class Content(msgspec.Struct, kw_only=True, gc=False):
    """What a message (or the message it quotes) carries, by ``msgtype``."""

    msgtype: str = ""
    text: Text | None = None
    voice: Text | None = None
    image: Media | None = None
    file: Media | None = None
    video: Media | None = None
    mixed: Mixed | None = None


class Quote(Content, kw_only=True, gc=False):
    """``body.quote``: a content snapshot of the quoted message (no id, author or time)."""


class CardEvent(msgspec.Struct, kw_only=True, gc=False):
    card_type: str = ""
    event_key: str = ""
    task_id: str = ""


class Event(msgspec.Struct, kw_only=True, gc=False):
    eventtype: str = ""
    template_card_event: CardEvent | None = None
    #: Older / flat shapes put the card fields right in ``event``.
    event_key: str = ""
    task_id: str = ""


class Body(Content, kw_only=True, gc=False):
    """The body of ``aibot_msg_callback`` and ``aibot_event_callback``."""

    msgid: str
    aibotid: str = ""
    chattype: str = "single"
    chatid: str = ""
    #: ``from`` is a Python keyword.
    sender: Sender = msgspec.field(default_factory=Sender, name="from")
    create_time: float | None = None
    quote: Quote | None = None
    event: Event | None = None


class EventOnly(msgspec.Struct, kw_only=True, gc=False):
    """Just ``body.event``: how a takeover notice is recognised (it may lack ``msgid``)."""

    event: Event | None = None


class AckBody(msgspec.Struct, kw_only=True, gc=False):
    upload_id: str | None = None
    media_id: str | None = None


frame_decoder = msgspec.json.Decoder(Frame)
body_decoder = msgspec.json.Decoder(Body)
event_only_decoder = msgspec.json.Decoder(EventOnly)
encoder = msgspec.json.Encoder()
