"""WhatsApp Web mapping (``channels/whatsapp_web/protocol.py``) on events built with
neonize's own protobuf classes and serialized exactly as the fixtures hold them:
``MessageToDict(event, preserving_proto_field_name=True)``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from google.protobuf.json_format import MessageToDict

from dshim.channels.whatsapp_web.engine import load_neonize
from dshim.channels.whatsapp_web.protocol import BotIdentity, map_event
from dshim.model import InboundMessage, Skip

N = load_neonize("neonize.proto.Neonize_pb2")
BOT = BotIdentity(jid="4915199999999@s.whatsapp.net", lid="123456789012345@lid", name="dshim")
ADA = "4915112345678"
GROUP = "120363000000000001"


def event(
    fill: Callable[[Any], None] | None = None,
    *,
    group: bool = False,
    sender: str = ADA,
    chat: str | None = None,
    text: str | None = "hello",
) -> bytes:
    ev = N.Message()
    src = ev.Info.MessageSource
    if group:
        src.Chat.User, src.Chat.Server, src.IsGroup = GROUP, "g.us", True
    else:
        src.Chat.User, src.Chat.Server = sender, "s.whatsapp.net"
    if chat is not None:
        src.Chat.User, _, src.Chat.Server = chat.partition("@")
    src.Sender.User, src.Sender.Server = sender, "s.whatsapp.net"
    ev.Info.ID = "3EB0C0FFEE"
    ev.Info.Pushname = "Ada"
    ev.Info.Timestamp = 1_796_000_000_123
    if text is not None:
        ev.Message.conversation = text
    if fill is not None:
        fill(ev)
    return json.dumps(MessageToDict(ev, preserving_proto_field_name=True)).encode()


def mapped(raw: bytes) -> InboundMessage:
    msg = map_event(raw, bot_id="bot:wa", me=BOT)
    assert isinstance(msg, InboundMessage), msg
    return msg


def test_a_direct_text_is_addressed_with_its_chat_sender_and_time() -> None:
    msg = mapped(event())
    assert (msg.conversation_id, msg.conversation_type) == (f"{ADA}@s.whatsapp.net", "direct")
    assert (msg.sender_id, msg.sender_name, msg.message_id) == (ADA, "Ada", "3EB0C0FFEE")
    assert (msg.content, msg.addressed, msg.received_at) == ("hello", True, 1_796_000_000.123)


def _extended(text: str, **ctx: Any) -> Callable[[Any], None]:
    def fill(ev: Any) -> None:
        ev.Message.ClearField("conversation")
        ext = ev.Message.extendedTextMessage
        ext.text = text
        for key, value in ctx.items():
            if key == "mentionedJID":
                ext.contextInfo.mentionedJID.extend(value)
            elif key == "quoted":
                value(ext.contextInfo.quotedMessage)
            else:
                setattr(ext.contextInfo, key, value)

    return fill


def test_a_group_message_is_addressed_only_by_a_mention_or_a_reply_to_the_bot() -> None:
    assert not mapped(event(group=True)).addressed
    by_jid = mapped(event(_extended("@bot hi", mentionedJID=[BOT.jid]), group=True))
    by_lid = mapped(event(_extended("@bot hi", mentionedJID=[BOT.lid]), group=True))
    assert by_jid.addressed and by_jid.mentioned and by_lid.addressed and by_lid.mentioned
    other = mapped(
        event(_extended("@bob", mentionedJID=["4915100000000@s.whatsapp.net"]), group=True)
    )
    assert not other.addressed
    reply = _extended("and now?", stanzaID="3EB0BOT", participant=BOT.jid)
    replied = mapped(event(reply, group=True))
    assert replied.addressed and not replied.mentioned
    assert replied.reply_to is not None and replied.reply_to.author_id == BOT.id


def test_a_quote_carries_id_author_content_and_attachments_of_the_quoted_message() -> None:
    def image(q: Any) -> None:
        q.imageMessage.caption = "a cat"
        q.imageMessage.mimetype = "image/jpeg"

    msg = mapped(
        event(
            _extended("cute", stanzaID="3EB0Q1", participant=f"{ADA}@s.whatsapp.net", quoted=image)
        )
    )
    ref = msg.reply_to
    assert ref is not None
    assert (ref.message_id, ref.author_id, ref.content) == ("3EB0Q1", ADA, "a cat")
    assert ref.author_name == "Ada"  # she quotes herself: her push name is the author's
    assert [(a.kind, a.name) for a in ref.attachments] == [("image", None)]  # type: ignore[union-attr]

    def document(q: Any) -> None:
        q.documentMessage.fileName = "report.pdf"

    doc = mapped(event(_extended("see?", stanzaID="3EB0Q2", participant=BOT.lid, quoted=document)))
    assert doc.reply_to is not None
    assert [(a.kind, a.name) for a in doc.reply_to.attachments] == [("file", "report.pdf")]  # type: ignore[union-attr]
    assert doc.reply_to.author_id == BOT.id and doc.reply_to.author_name == "dshim"


def test_a_quote_without_quoted_message_asks_for_recovery_from_the_index() -> None:
    msg = mapped(event(_extended("what?", stanzaID="3EB0ANSWER", participant=BOT.jid)))
    assert msg.reply_to is not None
    assert msg.reply_to.recover and msg.reply_to.message_id == "3EB0ANSWER"


def test_captions_media_locations_and_contacts() -> None:
    def image(ev: Any) -> None:
        ev.Message.imageMessage.caption = "look"
        ev.Message.imageMessage.mimetype = "image/jpeg"
        ev.Message.imageMessage.fileLength = 2048

    pic = mapped(event(image, text=None))
    assert pic.content == "look" and [(i.kind, i.mime, i.size) for i in pic.images] == [
        ("image", "image/jpeg", 2048)
    ]

    def voice(ev: Any) -> None:
        ev.Message.audioMessage.PTT = True
        ev.Message.audioMessage.mimetype = "audio/ogg; codecs=opus"

    assert [f.kind for f in mapped(event(voice, text=None)).files] == ["audio"]

    def document(ev: Any) -> None:
        inner = ev.Message.documentWithCaptionMessage.message.documentMessage
        inner.fileName, inner.caption = "q3.xlsx", "figures"

    doc = mapped(event(document, text=None))
    assert doc.content == "figures" and [(f.kind, f.name) for f in doc.files] == [
        ("file", "q3.xlsx")
    ]

    def location(ev: Any) -> None:
        loc = ev.Message.locationMessage
        loc.degreesLatitude, loc.degreesLongitude, loc.name = 52.52, 13.405, "Alexanderplatz"

    assert (
        mapped(event(location, text=None)).content
        == "[location: Alexanderplatz (52.520000, 13.405000)]"
    )

    def contact(ev: Any) -> None:
        ev.Message.contactMessage.displayName = "Bob"

    assert mapped(event(contact, text=None)).content == "[contact: Bob]"


def test_an_ephemeral_message_is_read_inside_its_wrapper_and_forwards_are_marked() -> None:
    def ephemeral(ev: Any) -> None:
        ext = ev.Message.ephemeralMessage.message.extendedTextMessage
        ext.text = "fwd"
        ext.contextInfo.isForwarded = True

    msg = mapped(event(ephemeral, text=None))
    assert (msg.content, msg.forwarded) == ("fwd", True)


def _own(ev: Any) -> None:
    ev.Info.MessageSource.IsFromMe = True


def _reaction(ev: Any) -> None:
    ev.Message.ClearField("conversation")
    ev.Message.reactionMessage.text = "👍"


def _edit(ev: Any) -> None:
    ev.Info.Edit = "1"


def _protocol_edit(ev: Any) -> None:
    ev.Message.ClearField("conversation")
    ev.Message.protocolMessage.type = 14  # MESSAGE_EDIT


def _poll(ev: Any) -> None:
    ev.Message.ClearField("conversation")
    ev.Message.pollUpdateMessage.SetInParent()


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (event(_own), "echo"),
        (event(chat="status@broadcast"), "ignored"),
        (event(chat="120363111111111111@newsletter"), "ignored"),
        (event(_reaction), "ignored"),
        (event(_edit), "ignored"),
        (event(_protocol_edit), "ignored"),
        (event(_poll), "ignored"),
        (b'{"Info": {"ID": "x"}}', "malformed"),
        (b"[" * 200, "malformed"),
        (b'{"Info": {"ID": 5}}', "malformed"),
    ],
)
def test_what_is_dropped_and_why(raw: bytes, reason: str) -> None:
    out = map_event(raw, bot_id="bot:wa", me=BOT)
    assert isinstance(out, Skip) and out.reason == reason


def test_the_mention_of_the_bot_is_taken_out_of_the_text_in_either_form() -> None:
    def by(user: str, server: str) -> Callable[[Any], None]:
        def fill(ev: Any) -> None:
            ev.Message.ClearField("conversation")
            ext = ev.Message.extendedTextMessage
            ext.text = f"@{user} what is due today? cc @4915100000042"
            ext.contextInfo.mentionedJID.extend(
                [f"{user}@{server}", "4915100000042@s.whatsapp.net"]
            )

        return fill

    for user, server in (("4915199999999", "s.whatsapp.net"), ("123456789012345", "lid")):
        msg = mapped(event(by(user, server), group=True))
        assert msg.addressed and msg.mentioned
        assert msg.content == "what is due today? cc @4915100000042"


def test_the_route_holds_what_the_answer_quotes_and_no_media_key() -> None:
    def fill(ev: Any) -> None:
        ev.Message.ClearField("conversation")
        img = ev.Message.imageMessage
        img.caption, img.mimetype = "the receipt", "image/jpeg"
        img.mediaKey, img.directPath = b"\x01" * 32, "/v/t62.7118-24/secret-path"
        img.URL, img.JPEGThumbnail = "https://mmg.whatsapp.net/v/secret", b"\xff\xd8" * 50

    msg = mapped(event(fill, group=True))
    assert msg.route == {
        "participant": f"{ADA}@s.whatsapp.net",
        "timestamp": 1_796_000_000,
        "quoted": {"imageMessage": {"caption": "the receipt", "mimetype": "image/jpeg"}},
    }
    assert mapped(event(text="x" * 5000)).route["quoted"] == {"conversation": "x" * 1024}


def test_the_time_is_read_as_milliseconds_and_an_implausible_one_is_malformed() -> None:
    def at(value: int) -> Callable[[Any], None]:
        def fill(ev: Any) -> None:
            ev.Info.Timestamp = value

        return fill

    assert mapped(event(at(1_796_000_000_500))).route["timestamp"] == 1_796_000_000
    dropped = map_event(event(at(1_796_000_000_000_000)), bot_id="bot:wa", me=BOT)  # in µs
    assert isinstance(dropped, Skip) and dropped.reason == "malformed"
