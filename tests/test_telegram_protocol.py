"""Table tests of the sans-IO Telegram code: Update -> InboundMessage, errors, the poller.

Payloads are Update objects shaped exactly as getUpdates returns them (Bot API 10.x).
No I/O, no clock: these run in microseconds.  Fuzzed payloads must never raise.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dshim.channels.telegram import models
from dshim.channels.telegram.protocol import (
    ALLOWED_UPDATES,
    POLL_TIMEOUT_S,
    AlbumLimits,
    BotIdentity,
    ChatMigrated,
    NotModified,
    ThreadNotFound,
    UpdateFeed,
    api_error,
    decode_envelope,
    decode_update,
    decode_updates,
    parse_offset,
    parse_update,
    poll_params,
    token_bot_id,
    utf16_len,
)
from dshim.errors import (
    AuthError,
    ChannelError,
    Conflict,
    NotFound,
    PermissionDenied,
    RateLimited,
    RemoteProtocolError,
    TransportError,
)
from dshim.model import InboundMessage, MediaRef, Skip

ME = BotIdentity(987654321, "DshimBot")
BOT_USER = {"id": 987654321, "is_bot": True, "first_name": "Dshim", "username": "DshimBot"}
ADA = {"id": 42, "is_bot": False, "first_name": "Ada", "last_name": "Lovelace", "username": "ada"}
BOB = {"id": 43, "is_bot": False, "first_name": "Bob"}
DM = {"id": 42, "type": "private", "first_name": "Ada"}
GROUP = {"id": -1001234567890, "type": "supergroup", "title": "Research"}
FORUM = {"id": -1009876543210, "type": "supergroup", "title": "Lab", "is_forum": True}
T = 1_796_032_800


def u16(s: str) -> int:
    return utf16_len(s)


def ent(text: str, sub: str, kind: str = "mention", **extra: Any) -> dict[str, Any]:
    i = text.index(sub)
    return {"type": kind, "offset": u16(text[:i]), "length": u16(sub), **extra}


def message(
    mid: int = 10, chat: dict[str, Any] = DM, sender: dict[str, Any] | None = ADA, **fields: Any
) -> dict[str, Any]:
    m: dict[str, Any] = {"message_id": mid, "chat": chat, "date": T, **fields}
    if sender is not None:
        m["from"] = sender
    return m


def decode(msg: dict[str, Any], update_id: int = 1) -> InboundMessage | Skip:
    return decode_update(json.dumps({"update_id": update_id, "message": msg}).encode(), ME)


def inbound(msg: dict[str, Any]) -> InboundMessage:
    item = decode(msg)
    assert isinstance(item, InboundMessage), item
    return item


# --- basic mapping ------------------------------------------------------------------------


def test_direct_message_maps_every_field() -> None:
    item = inbound(message(11, DM, ADA, text="  What is the capital of France?  "))
    assert item.channel == "telegram"
    assert item.bot_id == "987654321"
    assert item.message_id == "11"
    assert item.conversation_id == "42"
    assert item.conversation_type == "direct"
    assert item.thread_id is None
    assert item.sender_id == "42"
    assert item.sender_name == "Ada Lovelace"
    assert item.sender_is_bot is False
    assert item.addressed is True
    assert item.content == "What is the capital of France?"
    assert item.received_at == float(T)
    assert item.reply_to is None


@pytest.mark.parametrize(
    ("sender", "name"),
    [
        (
            {"id": 1, "first_name": "Ada", "last_name": "Lovelace", "username": "ada"},
            "Ada Lovelace",
        ),
        ({"id": 1, "first_name": "Ada", "username": "ada"}, "Ada"),
        ({"id": 1, "first_name": "", "username": "grace_h"}, "grace_h"),
        ({"id": 1, "first_name": "", "last_name": "Hopper"}, "Hopper"),
        ({"id": 1, "first_name": ""}, None),
    ],
)
def test_sender_name_is_first_and_last_name_else_username(
    sender: dict[str, Any], name: str | None
) -> None:
    assert inbound(message(sender=sender, text="hi")).sender_name == name


@pytest.mark.parametrize(
    ("chat", "kind"),
    [(DM, "direct"), ({"id": -5, "type": "group", "title": "g"}, "group"), (GROUP, "group")],
)
def test_chat_types(chat: dict[str, Any], kind: str) -> None:
    assert (
        inbound(
            message(
                chat=chat,
                text="@DshimBot hi",
                entities=[{"type": "mention", "offset": 0, "length": 9}],
            )
        ).conversation_type
        == kind
    )


def test_large_ids_are_exact() -> None:
    chat = {"id": -1009007199254740993, "type": "supergroup"}
    item = inbound(
        message(
            chat=chat,
            sender={"id": 9007199254740993, "first_name": "X"},
            text="@DshimBot x",
            entities=[{"type": "mention", "offset": 0, "length": 9}],
        )
    )
    assert item.conversation_id == "-1009007199254740993"
    assert item.sender_id == "9007199254740993"


@pytest.mark.parametrize(
    ("update", "reason"),
    [
        (
            {
                "update_id": 1,
                "channel_post": {
                    "message_id": 1,
                    "chat": {"id": -100, "type": "channel"},
                    "date": T,
                    "text": "x",
                },
            },
            "ignored",
        ),
        ({"update_id": 1, "edited_message": message(text="edited")}, "ignored"),
        (
            {"update_id": 1, "message": message(chat={"id": -100, "type": "channel"}, text="x")},
            "ignored",
        ),
        ({"update_id": 1, "message": message(new_chat_members=[BOB])}, "ignored"),
        ({"update_id": 1, "message": message(migrate_to_chat_id=-1001)}, "ignored"),
        ({"update_id": 1, "message": message(sticker={"file_id": "s"})}, "ignored"),
        ({"update_id": 1, "message": message(sender=None, text="anonymous")}, "ignored"),
        ({"update_id": 1, "message": {"message_id": "x", "chat": 5}}, "malformed"),
        ({"update_id": "one"}, "malformed"),
    ],
)
def test_updates_that_are_not_answered_become_a_skip(update: dict[str, Any], reason: str) -> None:
    item = decode_update(json.dumps(update).encode(), ME)
    assert isinstance(item, Skip)
    assert item.reason == reason


def test_malformed_update_still_tells_its_id_so_it_is_confirmed() -> None:
    parsed = parse_update(b'{"update_id": 77, "message": {"message_id": "x"}}', ME)
    assert parsed.update_id == 77
    assert isinstance(parsed.item, Skip) and parsed.item.reason == "malformed"
    assert parse_update(b"not json", ME).update_id is None


LONE_SURROGATE = (
    b'{"update_id": 78, "message": {"message_id": 5, "chat": {"id": 42, "type": "private"},'
    b' "from": {"id": 42, "first_name": "Ada"}, "date": 1796032800, "text": "broken \\ud800"}}'
)


def deeply_nested(uid: int, depth: int = 1500) -> bytes:
    return (
        f'{{"update_id": {uid}, "message": {{"message_id": 6, "chat": {{"id": 42, "type": '
        f'"private"}}, "date": 1796032800, "text": "hi", "x": '.encode()
        + b"[" * depth
        + b"]" * depth
        + b"}}"
    )


@pytest.mark.parametrize(
    ("raw", "uid"),
    [
        (LONE_SURROGATE, 78),
        (deeply_nested(79), 79),
        (deeply_nested(80, 1000), 80),
        (deeply_nested(84, 100), 84),  # far below the interpreter's limit: still bounded
        (  # inside a field that is decoded into Python objects
            b'{"update_id": 83, "message": {"message_id": 1, "chat": {"id": 1, "type": '
            b'"private"}, "date": 1, "reply_to_story": '
            + b'{"a":' * 3000
            + b"1"
            + b"}" * 3000
            + b"}}",
            83,
        ),
        (b'{"update_id": 81, "message": {"message_id": 1, "text": "\xff\xfe"}}', 81),
        (b'{"message": {"text": "\\ud800"}, "update_id": 82}', 82),
    ],
)
def test_an_undecodable_update_is_malformed_and_still_tells_its_id(raw: bytes, uid: int) -> None:
    """A lone surrogate, invalid UTF-8 or 1,000+ levels of nesting: a drop, never a crash."""
    parsed = parse_update(raw, ME)
    assert parsed.update_id == uid
    assert isinstance(parsed.item, Skip) and parsed.item.reason == "malformed"
    assert isinstance(decode_update(raw, ME), Skip)


def test_the_updates_of_an_answer_are_split_even_when_one_does_not_decode() -> None:
    good = [
        json.dumps({"update_id": 90 + i, "message": message(90 + i, text="ok")}).encode()
        for i in range(2)
    ]
    for bad in (LONE_SURROGATE, deeply_nested(79)):
        body = b'{"ok":true,"result":[' + good[0] + b", " + bad + b"," + good[1] + b"]}"
        assert decode_updates("getUpdates", 200, body) == [good[0], bad, good[1]]
    body = b'{"ok":true,"result":[' + b",".join(good) + b"]}"
    assert decode_updates("getUpdates", 200, body) == good  # the fast path, same answer
    assert decode_updates("getUpdates", 200, b'{"ok":true,"result":[]}') == []


@pytest.mark.parametrize(
    "body",
    [
        b'{"ok":true,"result":[{"update_id":1},',  # truncated
        b'{"ok":true,"result":{"update_id":1}}',  # not a list
        b'{"ok":true}',
        b"<html>502</html>",
    ],
)
def test_an_answer_that_cannot_be_split_is_a_protocol_error(body: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_updates("getUpdates", 200, body)


def test_an_error_answer_is_still_classified_when_the_updates_cannot_be() -> None:
    with pytest.raises(Conflict):
        decode_updates(
            "getUpdates", 409, b'{"ok":false,"error_code":409,"description":"Conflict: x"}'
        )


def test_migration_is_reported() -> None:
    parsed = parse_update(
        json.dumps(
            {"update_id": 5, "message": message(chat=GROUP, migrate_to_chat_id=-1009)}
        ).encode(),
        ME,
    )
    assert parsed.migration == (GROUP["id"], -1009)
    parsed = parse_update(
        json.dumps(
            {
                "update_id": 6,
                "message": message(
                    chat={"id": -1009, "type": "supergroup"}, migrate_from_chat_id=-55
                ),
            }
        ).encode(),
        ME,
    )
    assert parsed.migration == (-55, -1009)


def test_echo_and_bots_are_marked_for_the_pipeline() -> None:
    own = inbound(message(chat=GROUP, sender=BOT_USER, text="my answer"))
    assert own.sender_id == own.bot_id  # the pipeline drops it as "echo"
    other = inbound(
        message(chat=GROUP, sender={"id": 5, "is_bot": True, "first_name": "B"}, text="x")
    )
    assert other.sender_is_bot is True


# --- addressing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "entities", "addressed", "content"),
    [
        ("@DshimBot what is 2+2?", [("@DshimBot", "mention")], True, "what is 2+2?"),
        ("@dshimbot hi", [("@dshimbot", "mention")], True, "hi"),
        ("hi @DSHIMBOT there", [("@DSHIMBOT", "mention")], True, "hi there"),
        ("🧪 test @DshimBot what?", [("@DshimBot", "mention")], True, "🧪 test what?"),
        ("👩‍👩‍👧‍👦👩‍👩‍👧‍👦 @DshimBot go", [("@DshimBot", "mention")], True, "👩‍👩‍👧‍👦👩‍👩‍👧‍👦 go"),
        ("ask @other_bot instead", [("@other_bot", "mention")], False, "ask @other_bot instead"),
        ("@DshimBotX hi", [("@DshimBotX", "mention")], False, "@DshimBotX hi"),
        ("/new@DshimBot", [("/new@DshimBot", "bot_command")], True, "/new@DshimBot"),
        ("/help@dshimbot", [("/help@dshimbot", "bot_command")], True, "/help@dshimbot"),
        ("/new@other_bot", [("/new@other_bot", "bot_command")], False, "/new@other_bot"),
        ("/new", [("/new", "bot_command")], False, "/new"),
        ("plain text", [], False, "plain text"),
    ],
)
def test_group_addressing_by_entities(
    text: str, entities: list[tuple[str, str]], addressed: bool, content: str
) -> None:
    ents = [ent(text, sub, kind) for sub, kind in entities]
    item = inbound(message(chat=GROUP, text=text, entities=ents))
    assert item.addressed is addressed
    assert item.content == content


def test_offsets_are_utf16_units_not_code_points() -> None:
    # "😀" is one code point but two UTF-16 units: a code-point offset would cut "@Dshim".
    text = "😀😀 @DshimBot ok"
    offset = u16("😀😀 ")
    assert offset == 5 and text.index("@") == 3
    item = inbound(
        message(
            chat=GROUP, text=text, entities=[{"type": "mention", "offset": offset, "length": 9}]
        )
    )
    assert item.addressed and item.content == "😀😀 ok"
    # A code-point offset (wrong) does not match the bot.
    wrong = inbound(
        message(chat=GROUP, text=text, entities=[{"type": "mention", "offset": 3, "length": 9}])
    )
    assert not wrong.addressed


@pytest.mark.parametrize(
    "entity",
    [
        {"type": "mention", "offset": 40, "length": 9},
        {"type": "mention", "offset": -1, "length": 9},
        {"type": "mention", "offset": 0, "length": 0},
        {"type": "mention", "offset": 1, "length": 9},  # starts inside a surrogate pair
    ],
)
def test_broken_entities_are_ignored_not_fatal(entity: dict[str, Any]) -> None:
    item = inbound(message(chat=GROUP, text="😀@DshimBot", entities=[entity]))
    assert item.addressed is False


def test_text_mention_of_the_bot_addresses_and_is_removed() -> None:
    text = "Hey Dshim summarize"
    item = inbound(
        message(chat=GROUP, text=text, entities=[ent(text, "Dshim", "text_mention", user=BOT_USER)])
    )
    assert item.addressed and item.content == "Hey summarize"
    other = inbound(
        message(chat=GROUP, text=text, entities=[ent(text, "Dshim", "text_mention", user=BOB)])
    )
    assert not other.addressed and other.content == text


def test_caption_mention_addresses_a_photo() -> None:
    item = inbound(
        message(
            chat=GROUP,
            caption="@DshimBot what is this?",
            caption_entities=[{"type": "mention", "offset": 0, "length": 9}],
            photo=[
                {"file_id": "s", "width": 90, "height": 90, "file_size": 10},
                {"file_id": "b", "width": 900, "height": 900, "file_size": 1000},
            ],
        )
    )
    assert item.addressed and item.content == "what is this?"
    assert len(item.images) == 1 and item.images[0].size == 1000


def test_reply_to_the_bot_addresses_reply_to_a_person_does_not() -> None:
    to_bot = inbound(
        message(
            chat=GROUP, text="more?", reply_to_message=message(5, GROUP, BOT_USER, text="an answer")
        )
    )
    assert to_bot.addressed
    to_bob = inbound(
        message(chat=GROUP, text="more?", reply_to_message=message(5, GROUP, BOB, text="hello"))
    )
    assert not to_bob.addressed


def test_direct_messages_are_always_addressed_and_the_mention_is_still_removed() -> None:
    item = inbound(
        message(text="@DshimBot hello", entities=[{"type": "mention", "offset": 0, "length": 9}])
    )
    assert item.addressed and item.content == "hello"


# --- forum topics --------------------------------------------------------------------------


def _root(creator: dict[str, Any] = BOT_USER) -> dict[str, Any]:
    return message(
        1100,
        FORUM,
        creator,
        message_thread_id=1100,
        is_topic_message=True,
        forum_topic_created={"name": "Experiments", "icon_color": 1},
    )


def test_topic_root_is_neither_a_reply_nor_a_quote() -> None:
    item = inbound(
        message(
            1101,
            FORUM,
            ADA,
            text="anyone?",
            message_thread_id=1100,
            is_topic_message=True,
            reply_to_message=_root(),
        )
    )
    assert item.reply_to is None
    assert item.addressed is False  # the bot created the topic, but nobody replied to it
    assert item.thread_id == "1100"


def test_topic_root_without_the_service_payload_is_recognised_by_its_id() -> None:
    root = message(
        1100, FORUM, BOT_USER, text="Topic intro", message_thread_id=1100, is_topic_message=True
    )
    item = inbound(
        message(
            1101,
            FORUM,
            ADA,
            text="hi",
            message_thread_id=1100,
            is_topic_message=True,
            reply_to_message=root,
        )
    )
    assert item.reply_to is None and not item.addressed


def test_a_real_reply_inside_a_topic_is_a_reply() -> None:
    replied = message(
        1103, FORUM, BOT_USER, text="Run B first.", message_thread_id=1100, is_topic_message=True
    )
    item = inbound(
        message(
            1104,
            FORUM,
            BOB,
            text="which?",
            message_thread_id=1100,
            is_topic_message=True,
            reply_to_message=replied,
        )
    )
    assert item.addressed and item.thread_id == "1100"
    assert item.reply_to is not None and item.reply_to.content == "Run B first."


def test_reply_thread_in_a_non_forum_supergroup_is_a_reply_not_a_topic() -> None:
    # message_thread_id without is_topic_message: an ordinary reply thread, no thread_id.
    replied = message(900, GROUP, BOT_USER, text="root answer")
    item = inbound(
        message(901, GROUP, ADA, text="and?", message_thread_id=900, reply_to_message=replied)
    )
    assert item.thread_id is None
    assert item.addressed and item.reply_to is not None and item.reply_to.message_id == "900"


# --- quoted messages -----------------------------------------------------------------------


def test_reply_reference_from_a_text_message() -> None:
    ref = inbound(
        message(text="why?", reply_to_message=message(5, DM, ADA, text="because"))
    ).reply_to
    assert ref is not None
    assert (ref.message_id, ref.author_id, ref.author_name, ref.content) == (
        "5",
        "42",
        "Ada Lovelace",
        "because",
    )
    assert ref.attachments == [] and ref.recover is False


def test_reply_reference_caption_and_largest_photo() -> None:
    replied = message(
        5,
        DM,
        BOB,
        caption="our lab",
        photo=[
            {"file_id": "a", "width": 1, "height": 1},
            {"file_id": "b", "width": 9, "height": 9},
        ],
    )
    ref = inbound(message(text="what?", reply_to_message=replied)).reply_to
    assert ref is not None and ref.content == "our lab"
    assert [(a.kind, a.name) for a in ref.attachments] == [("image", None)]  # type: ignore[union-attr]


def test_reply_reference_attachment_kinds() -> None:
    replied = message(
        5,
        DM,
        BOB,
        document={"file_id": "d", "file_name": "notes.pdf", "mime_type": "application/pdf"},
        audio={"file_id": "a", "file_name": "song.mp3"},
        voice={"file_id": "v"},
        video={"file_id": "vi", "file_name": "clip.mp4"},
        video_note={"file_id": "vn"},
        sticker={"file_id": "st"},
    )
    ref = inbound(message(text="?", reply_to_message=replied)).reply_to
    assert ref is not None
    assert [(a.kind, a.name) for a in ref.attachments] == [  # type: ignore[union-attr]
        ("file", "notes.pdf"),
        ("audio", "song.mp3"),
        ("audio", None),
        ("video", "clip.mp4"),
        ("video", None),
        ("image", None),
    ]


def test_animation_counts_once_even_though_it_also_arrives_as_a_document() -> None:
    replied = message(
        5,
        DM,
        BOB,
        animation={"file_id": "g", "file_name": "fun.mp4"},
        document={"file_id": "g", "file_name": "fun.mp4", "mime_type": "video/mp4"},
    )
    ref = inbound(message(text="?", reply_to_message=replied)).reply_to
    assert ref is not None and [(a.kind, a.name) for a in ref.attachments] == [("video", "fun.mp4")]  # type: ignore[union-attr]


def test_image_document_in_a_quote_is_an_image() -> None:
    replied = message(
        5, DM, BOB, document={"file_id": "d", "file_name": "scan.png", "mime_type": "image/png"}
    )
    ref = inbound(message(text="?", reply_to_message=replied)).reply_to
    assert ref is not None and [(a.kind, a.name) for a in ref.attachments] == [
        ("image", "scan.png")
    ]  # type: ignore[union-attr]


def test_quote_text_is_used_only_when_the_replied_message_has_no_text() -> None:
    quote = {"text": "fragment", "position": 0, "is_manual": True}
    with_text = inbound(
        message(
            text="?",
            reply_to_message=message(5, DM, BOB, text="full text with fragment"),
            quote=quote,
        )
    ).reply_to
    assert with_text is not None and with_text.content == "full text with fragment"
    without = inbound(message(text="?", reply_to_message=message(5, DM, BOB), quote=quote)).reply_to
    assert without is not None and without.content == "fragment"


def test_sender_chat_is_the_author_of_an_anonymous_message() -> None:
    replied = message(
        5,
        GROUP,
        {"id": 1087968824, "is_bot": True, "first_name": "Group", "username": "GroupAnonymousBot"},
        text="admin note",
        sender_chat=GROUP,
    )
    ref = inbound(
        message(
            chat=GROUP,
            text="@DshimBot ?",
            entities=[{"type": "mention", "offset": 0, "length": 9}],
            reply_to_message=replied,
        )
    ).reply_to
    assert ref is not None and (ref.author_id, ref.author_name) == (str(GROUP["id"]), "Research")


# --- forwards and messages sent on behalf of a chat (issue 9 #6, #10) ---------------------


@pytest.mark.parametrize(
    "fields",
    [
        {"forward_origin": {"type": "user", "date": T, "sender_user": BOB}},
        {"forward_origin": {"type": "hidden_user", "date": T, "sender_user_name": "Someone"}},
        {"forward_origin": {"type": "chat", "date": T, "sender_chat": GROUP}},
        {
            "forward_origin": {
                "type": "channel",
                "date": T,
                "chat": {"id": -1001, "type": "channel", "title": "News"},
                "message_id": 77,
            }
        },
        # Bot API before 7.0 (and servers that still send both):
        {"forward_from": BOB, "forward_date": T},
        {"forward_from_chat": {"id": -1001, "type": "channel", "title": "News"}, "forward_date": T},
        {"forward_sender_name": "Someone", "forward_date": T},
        {"forward_date": T},
    ],
)
def test_a_forwarded_message_is_marked_and_its_sender_is_who_forwarded_it(
    fields: dict[str, Any],
) -> None:
    item = inbound(message(text="/new yes", **fields))
    assert item.forwarded is True
    assert item.content == "/new yes"  # still the message's content for the agent
    assert (item.sender_id, item.sender_name, item.sender_is_bot) == ("42", "Ada Lovelace", False)


def test_a_forwarded_photo_is_marked_too() -> None:
    photo = [{"file_id": "p1", "width": 10, "height": 10}]
    item = inbound(
        message(
            caption="look",
            photo=photo,
            forward_origin={"type": "user", "date": T, "sender_user": BOB},
        )
    )
    assert item.forwarded and item.content == "look" and len(item.images) == 1


def test_an_own_message_is_not_forwarded() -> None:
    assert inbound(message(text="/new")).forwarded is False


GROUP_ANONYMOUS_BOT = {
    "id": 1087968824,
    "is_bot": True,
    "first_name": "Group",
    "username": "GroupAnonymousBot",
}
CHANNEL_BOT = {"id": 136817688, "is_bot": True, "first_name": "Channel", "username": "Channel_Bot"}


@pytest.mark.parametrize(
    ("sender", "sender_chat", "expected"),
    [
        (GROUP_ANONYMOUS_BOT, GROUP, (str(GROUP["id"]), "Research")),
        (
            CHANNEL_BOT,
            {"id": -1005555, "type": "channel", "title": "Lab news", "username": "labnews"},
            ("-1005555", "Lab news"),
        ),
        (
            CHANNEL_BOT,
            {"id": -1005556, "type": "channel", "username": "labnews"},
            ("-1005556", "labnews"),
        ),
    ],
)
def test_a_message_sent_on_behalf_of_a_chat_is_a_persons_message_from_that_chat(
    sender: dict[str, Any], sender_chat: dict[str, Any], expected: tuple[str, str]
) -> None:
    text = "@DshimBot status?"
    item = inbound(
        message(
            chat=GROUP,
            sender=sender,
            text=text,
            entities=[ent(text, "@DshimBot")],
            sender_chat=sender_chat,
        )
    )
    assert item.sender_is_bot is False  # not a bot: an anonymous admin or a channel
    assert (item.sender_id, item.sender_name) == expected
    assert item.addressed and item.content == "status?"


def test_a_real_bot_is_still_a_bot() -> None:
    other = {"id": 555, "is_bot": True, "first_name": "Other", "username": "other_bot"}
    assert inbound(message(chat=GROUP, sender=other, text="hi")).sender_is_bot is True


@pytest.mark.parametrize(
    ("origin", "author"),
    [
        ({"type": "user", "date": T, "sender_user": ADA}, ("42", "Ada Lovelace")),
        ({"type": "hidden_user", "date": T, "sender_user_name": "Someone"}, (None, "Someone")),
        ({"type": "chat", "date": T, "sender_chat": GROUP}, (str(GROUP["id"]), "Research")),
        (
            {
                "type": "channel",
                "date": T,
                "chat": {"id": -1001, "type": "channel", "title": "News"},
                "message_id": 77,
            },
            ("-1001", "News"),
        ),
    ],
)
def test_external_reply_author_from_its_origin(
    origin: dict[str, Any], author: tuple[str | None, str]
) -> None:
    item = inbound(
        message(
            text="and this?",
            external_reply={"origin": origin},
            quote={"text": "quoted bit", "position": 0},
        )
    )
    ref = item.reply_to
    assert ref is not None
    got_id = ref.author_id if isinstance(ref.author_id, str) else None
    assert (got_id, ref.author_name) == author
    assert ref.content == "quoted bit"


def test_external_reply_without_quote_has_only_media() -> None:
    ext = {
        "origin": {
            "type": "channel",
            "date": T,
            "chat": {"id": -1001, "type": "channel", "title": "News"},
            "message_id": 77,
        },
        "chat": {"id": -1001, "type": "channel", "title": "News"},
        "message_id": 77,
        "photo": [{"file_id": "p", "width": 10, "height": 10}],
    }
    ref = inbound(message(text="look", external_reply=ext)).reply_to
    assert ref is not None and ref.message_id == "77"
    assert not isinstance(ref.content, str)
    assert [a.kind for a in ref.attachments] == ["image"]  # type: ignore[union-attr]


def test_bots_own_message_without_text_asks_for_core_recovery() -> None:
    item = inbound(
        message(text="again?", reply_to_message=message(801, DM, BOT_USER, date=T - 600))
    )
    ref = item.reply_to
    assert ref is not None and ref.recover is True and ref.recover_at == float(T - 600)
    assert ref.message_id == "801"


@pytest.mark.parametrize(
    "replied_fields",
    [{"text": "shown"}, {"photo": [{"file_id": "p", "width": 1, "height": 1}]}],
)
def test_no_recovery_when_the_quote_carries_text_or_media(replied_fields: dict[str, Any]) -> None:
    ref = inbound(
        message(text="?", reply_to_message=message(801, DM, BOT_USER, **replied_fields))
    ).reply_to
    assert ref is not None and ref.recover is False


def test_no_recovery_when_the_user_quoted_a_fragment() -> None:
    ref = inbound(
        message(text="?", reply_to_message=message(801, DM, BOT_USER), quote={"text": "fragment"})
    ).reply_to
    assert ref is not None and ref.recover is False and ref.content == "fragment"


def test_no_recovery_for_someone_elses_empty_message() -> None:
    ref = inbound(message(text="?", reply_to_message=message(801, DM, BOB))).reply_to
    assert ref is not None and ref.recover is False


def test_nested_reply_is_not_expanded() -> None:
    inner = message(3, DM, BOB, text="deep")
    replied = message(5, DM, ADA, text="middle", reply_to_message=inner)
    ref = inbound(message(text="?", reply_to_message=replied)).reply_to
    assert ref is not None and ref.content == "middle" and ref.message_id == "5"


def test_reply_to_story_is_unsupported() -> None:
    ref = inbound(message(text="nice story", reply_to_story={"chat": DM, "id": 3})).reply_to
    assert ref is not None and ref.unavailable_reason == "unsupported"


# --- current media ------------------------------------------------------------------------


def test_current_media_with_lazy_fetchers() -> None:
    made: list[tuple[str, int | None]] = []

    def factory(file_id: str, size: int | None) -> Any:
        made.append((file_id, size))

        async def fetch(max_bytes: int) -> bytes:
            raise AssertionError("nothing is downloaded while mapping")

        return fetch

    msg = message(
        caption="files",
        photo=[
            {"file_id": "small", "width": 90, "height": 60, "file_size": 100},
            {"file_id": "big", "width": 1280, "height": 853, "file_size": 9000},
        ],
        document={
            "file_id": "doc",
            "file_name": "scan.PNG",
            "mime_type": "IMAGE/PNG",
            "file_size": 50,
        },
        audio={"file_id": "au", "file_name": "a.mp3", "mime_type": "audio/mpeg", "file_size": 7},
        voice={"file_id": "vo", "mime_type": "audio/ogg", "file_size": 8},
        video={"file_id": "vi", "file_name": "v.mp4", "mime_type": "video/mp4", "file_size": 9},
    )
    item = decode_update(json.dumps({"update_id": 1, "message": msg}).encode(), ME, fetcher=factory)
    assert isinstance(item, InboundMessage)
    assert [(r.kind, r.name, r.size) for r in item.images] == [
        ("image", None, 9000),
        ("image", "scan.PNG", 50),
    ]
    assert [(r.kind, r.name, r.mime) for r in item.files] == [
        ("audio", "a.mp3", "audio/mpeg"),
        ("audio", None, "audio/ogg"),
        ("video", "v.mp4", "video/mp4"),
    ]
    assert all(isinstance(r, MediaRef) and r.fetch is not None for r in item.images + item.files)
    assert made[0] == ("big", 9000)


def test_non_image_document_is_a_file() -> None:
    item = inbound(
        message(
            document={
                "file_id": "d",
                "file_name": "notes.pdf",
                "mime_type": "application/pdf",
                "file_size": 4,
            }
        )
    )
    assert [(r.kind, r.name) for r in item.files] == [("file", "notes.pdf")] and item.images == []


# --- fuzz -----------------------------------------------------------------------------------

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "message",
                    "text",
                    "chat",
                    "from",
                    "id",
                    "type",
                    "entities",
                    "offset",
                    "length",
                    "reply_to_message",
                    "message_id",
                    "date",
                    "photo",
                    "quote",
                    "external_reply",
                    "origin",
                    "update_id",
                    "is_topic_message",
                    "message_thread_id",
                ]
            ),
            children,
            max_size=6,
        )
    ),
    max_leaves=25,
)


@settings(max_examples=300, deadline=None)
@given(_json)
def test_fuzzed_payloads_never_raise(payload: Any) -> None:
    raw = json.dumps(payload).encode()
    assert isinstance(decode_update(raw, ME), (InboundMessage, Skip))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40), st.integers(-5, 50), st.integers(-5, 50))
def test_fuzzed_entities_never_raise(text: str, offset: int, length: int) -> None:
    for kind in ("mention", "text_mention", "bot_command"):
        msg = message(
            chat=GROUP,
            text=text,
            entities=[{"type": kind, "offset": offset, "length": length, "user": BOT_USER}],
        )
        assert isinstance(decode(msg), (InboundMessage, Skip))


# --- errors ---------------------------------------------------------------------------------


def env(status: int, description: str, **parameters: Any) -> models.Envelope:
    body: dict[str, Any] = {"ok": False, "error_code": status, "description": description}
    if parameters:
        body["parameters"] = parameters
    return models.ENVELOPE_DECODER.decode(json.dumps(body).encode())


@pytest.mark.parametrize(
    ("status", "description", "parameters", "kind"),
    [
        (429, "Too Many Requests: retry after 7", {"retry_after": 7}, RateLimited),
        (
            400,
            "Bad Request: message is not modified: specified new message content and reply markup are exactly the same",
            {},
            NotModified,
        ),
        (400, "Bad Request: message to edit not found", {}, NotFound),
        (400, "Bad Request: message to be replied not found", {}, NotFound),
        (400, "Bad Request: reply message not found", {}, NotFound),
        (400, "Bad Request: chat not found", {}, NotFound),
        (400, "Bad Request: message thread not found", {}, ThreadNotFound),
        (400, "Bad Request: message can't be edited", {}, PermissionDenied),
        (
            400,
            "Bad Request: group chat was upgraded to a supergroup chat",
            {"migrate_to_chat_id": -1009},
            ChatMigrated,
        ),
        (400, "Bad Request: message is too long", {}, ChannelError),
        (401, "Unauthorized", {}, AuthError),
        (404, "Not Found", {}, AuthError),
        (403, "Forbidden: bot was blocked by the user", {}, PermissionDenied),
        (403, "Forbidden: bot was kicked from the supergroup chat", {}, PermissionDenied),
        (
            409,
            "Conflict: terminated by other getUpdates request; make sure that only one bot instance is running",
            {},
            Conflict,
        ),
        (
            409,
            "Conflict: can't use getUpdates method while webhook is active; use deleteWebhook to delete the webhook first",
            {},
            Conflict,
        ),
        (500, "Internal Server Error", {}, TransportError),
        (502, "Bad Gateway", {}, TransportError),
    ],
)
def test_api_errors_are_classified_once(
    status: int, description: str, parameters: dict[str, Any], kind: type[ChannelError]
) -> None:
    err = api_error("sendMessage", status, env(status, description, **parameters))
    assert type(err) is kind
    assert err.status == status
    assert str(err).startswith("sendMessage: ")


def test_rate_limited_carries_retry_after_and_migration_the_new_id() -> None:
    err = api_error(
        "editMessageText", 429, env(429, "Too Many Requests: retry after 7", retry_after=7)
    )
    assert isinstance(err, RateLimited) and err.retry_after == 7
    mig = api_error(
        "sendMessage",
        400,
        env(400, "Bad Request: group chat was upgraded", migrate_to_chat_id=-1009),
    )
    assert isinstance(mig, ChatMigrated) and mig.migrate_to_chat_id == -1009


def test_conflict_explains_what_to_do() -> None:
    err = api_error("getUpdates", 409, env(409, "Conflict: terminated by other getUpdates request"))
    assert "one dshim per bot token" in str(err) and "webhook" in str(err)


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (502, b"<html>Bad Gateway</html>", TransportError),
        (429, b"slow down", RateLimited),
        (200, b"<html>captive portal</html>", RemoteProtocolError),
        (401, b"", AuthError),
    ],
)
def test_non_json_answers_are_classified(
    status: int, body: bytes, kind: type[ChannelError]
) -> None:
    with pytest.raises(kind):
        decode_envelope("getMe", status, body)


def test_ok_envelope_decodes() -> None:
    env_ok = decode_envelope(
        "getMe", 200, b'{"ok":true,"result":{"id":1,"is_bot":true,"first_name":"b","username":"b"}}'
    )
    assert msgspec.json.decode(env_ok.result)["id"] == 1


# --- tokens, poller, backoff --------------------------------------------------------------


@pytest.mark.parametrize(
    ("token", "bot_id"),
    [
        ("123456:TEST-token-for-dshim-tests-only", 123456),
        ("12345678901:abcdefghijklmnopqrstuvwxyz_-0123", 12345678901),
        ("1234:short-bot-id-not-allowed-here", None),
        ("123456:short", None),
        ("123456 TEST-token-for-dshim-tests-only", None),
        ("", None),
    ],
)
def test_token_shape(token: str, bot_id: int | None) -> None:
    assert token_bot_id(token) == bot_id


def test_polls_are_long_polls_from_the_offset() -> None:
    first = poll_params(None)
    assert first == {"timeout": POLL_TIMEOUT_S, "limit": 100, "allowed_updates": ALLOWED_UPDATES}
    assert first["allowed_updates"] == ["message"] and first["timeout"] == 25
    assert poll_params(501)["offset"] == 501


@pytest.mark.parametrize(
    ("cursor", "offset"),
    [
        (None, None),
        ("", None),
        ("501", 501),
        (" 77 ", 77),
        ("-1", -1),
        ("x12", None),
        ("1.5", None),
    ],
)
def test_the_stored_cursor_is_the_offset(cursor: str | None, offset: int | None) -> None:
    assert parse_offset(cursor) == offset


def update_raw(uid: int, text: str = "hi") -> bytes:
    return json.dumps({"update_id": uid, "message": message(uid, text=text)}).encode()


def test_each_update_is_confirmed_by_its_id_plus_one_and_old_ones_are_dropped() -> None:
    feed = UpdateFeed(ME)
    raws = [update_raw(499), update_raw(500), update_raw(507)]
    ready = feed.take(raws, 500)
    assert [(r.parsed.update_id, r.offset) for r in ready] == [(500, 501), (507, 508)]
    assert [r.raw for r in ready] == raws[1:]
    assert [r.parsed.update_id for r in UpdateFeed(ME).take(raws, None)] == [499, 500, 507]
    assert feed.take(raws, 500) == []  # already handed over in this run


def test_an_update_without_a_readable_id_confirms_nothing() -> None:
    [ready] = UpdateFeed(ME).take([b'{"message": {"message_id": 1}}'], 10)
    assert ready.offset is None and isinstance(ready.parsed.item, Skip)
    assert ready.parsed.item.reason == "malformed"


def test_configured_username_with_an_at_sign_still_matches() -> None:
    me = BotIdentity(987654321, "@DshimBot")
    raw = json.dumps(
        {
            "update_id": 1,
            "message": message(
                chat=GROUP,
                text="@dshimbot hi",
                entities=[{"type": "mention", "offset": 0, "length": 9}],
            ),
        }
    ).encode()
    item = decode_update(raw, me)
    assert isinstance(item, InboundMessage) and item.addressed and item.content == "hi"


# --- albums (issue 9 #11) ------------------------------------------------------------------


def album_part(
    uid: int,
    *,
    group: str = "g1",
    chat: dict[str, Any] = DM,
    caption: str | None = None,
    sender: dict[str, Any] = ADA,
    **fields: Any,
) -> bytes:
    msg = message(
        uid,
        chat,
        sender,
        photo=[{"file_id": f"p{uid}", "width": 10, "height": 10}],
        media_group_id=group,
        **fields,
    )
    if caption is not None:
        msg["caption"] = caption
        if "@" in caption:
            msg["caption_entities"] = [ent(caption, "@DshimBot")]
    return json.dumps({"update_id": uid, "message": msg}).encode()


def fetcher(file_id: str, size: int | None) -> Any:
    async def fetch(limit: int) -> bytes:
        return file_id.encode()

    return fetch


def test_an_album_is_handed_over_as_one_message_once_it_is_complete() -> None:
    feed = UpdateFeed(ME, fetcher=fetcher)
    caption = "@DshimBot which one?"
    raws = [
        album_part(100, chat=GROUP),
        update_raw(101, "meanwhile"),
        album_part(102, chat=GROUP, caption=caption),
        album_part(103, chat=GROUP),
    ]
    ready = feed.take(raws, 100, now=10.0)
    # The other update goes on at once, but its offset stops below the album.
    assert [(r.parsed.update_id, r.offset) for r in ready] == [(101, 100)]
    assert feed.holding and feed.due_at() == 11.0
    assert feed.take([], 100, now=10.9) == []
    [album] = feed.take([], 100, now=11.0)
    assert album.offset == 104 and not feed.holding and feed.due_at() is None
    item = album.parsed.item
    assert isinstance(item, InboundMessage)
    assert item.message_id == "100"  # the album is its first part
    assert item.content == "which one?" and item.addressed  # the caption's mention counts
    assert [ref.kind for ref in item.images] == ["image"] * 3
    # The durable inbox keeps the parts as one JSON array and reads the same message back.
    assert json.loads(album.raw) == [json.loads(r) for r in (raws[0], raws[2], raws[3])]
    again = decode_update(album.raw, ME, fetcher=fetcher)
    assert isinstance(again, InboundMessage)
    assert (again.message_id, again.content, again.addressed, len(again.images)) == (
        "100",
        "which one?",
        True,
        3,
    )


async def test_an_albums_images_keep_their_order_and_their_downloads() -> None:
    feed = UpdateFeed(ME, fetcher=fetcher)
    feed.take([album_part(7), album_part(8, caption="hi"), album_part(9)], None, now=0.0)
    [album] = feed.take([], None, now=1.0)
    item = album.parsed.item
    assert isinstance(item, InboundMessage)
    got = [await ref.fetch(100) for ref in item.images if ref.fetch is not None]
    assert got == [b"p7", b"p8", b"p9"]


def test_an_unaddressed_group_album_stays_unaddressed() -> None:
    feed = UpdateFeed(ME)
    feed.take([album_part(1, chat=GROUP), album_part(2, chat=GROUP, caption="nice")], None, now=0)
    [album] = feed.take([], None, now=5)
    assert isinstance(album.parsed.item, InboundMessage)
    assert album.parsed.item.addressed is False


def test_a_late_part_extends_the_window_within_a_bound() -> None:
    feed = UpdateFeed(ME)
    feed.take([album_part(1)], None, now=0.0)
    assert feed.take([album_part(2)], None, now=0.9) == []  # quiet again until 1.9
    assert feed.take([], None, now=1.5) == [] and feed.due_at() == 1.9
    for i, t in enumerate((1.8, 2.7, 3.6, 4.5), start=3):
        assert feed.take([album_part(i)], None, now=t) == []
    [album] = feed.take([], None, now=5.0)  # never longer than 5 s after the first part
    assert isinstance(album.parsed.item, InboundMessage) and len(album.parsed.item.images) == 6


def test_an_album_at_telegrams_limit_of_ten_parts_is_handed_over_at_once() -> None:
    feed = UpdateFeed(ME)
    ready = feed.take([album_part(i) for i in range(1, 12)], None, now=0.0)
    assert [(r.parsed.update_id, r.offset) for r in ready] == [(1, 11)]  # part 11: a new album
    assert feed.holding


def test_albums_are_per_chat_and_bounded_in_number() -> None:
    feed = UpdateFeed(ME, albums=AlbumLimits(max_open=2))
    other = {"id": 43, "type": "private", "first_name": "Bob"}
    raws = [album_part(1), album_part(2, chat=other), album_part(3, group="g2")]
    [oldest] = feed.take(raws, None, now=0.0)  # a third album: the oldest is handed over
    assert oldest.parsed.update_id == 1 and oldest.offset == 2  # stops below the others
    rest = feed.take([], None, now=1.0)
    assert [(r.parsed.update_id, r.offset) for r in rest] == [(2, 3), (3, 4)]


def test_updates_seen_while_an_album_is_held_are_not_handed_over_twice() -> None:
    feed = UpdateFeed(ME)
    first = [album_part(50), update_raw(51)]
    assert [r.parsed.update_id for r in feed.take(first, 50, now=0.0)] == [51]
    # The bot re-polls from 50 (below the album): Telegram answers with both again.
    assert feed.take(first + [update_raw(52)], 50, now=0.5)[0].parsed.update_id == 52
    [album] = feed.take(first, 50, now=1.0)
    assert album.parsed.update_id == 50 and album.offset == 53


def test_a_one_part_album_keeps_its_own_raw() -> None:
    feed = UpdateFeed(ME)
    raw = album_part(5, caption="just one")
    feed.take([raw], None, now=0.0)
    [album] = feed.take([], None, now=1.0)
    assert album.raw == raw and album.offset == 6


@pytest.mark.parametrize("raw", [b"[", b"[1, 2]", b'[{"update_id": 1}]', b"  [ ]"])
def test_an_unreadable_stored_album_is_malformed(raw: bytes) -> None:
    item = decode_update(raw, ME)
    assert isinstance(item, Skip) and item.reason == "malformed"
