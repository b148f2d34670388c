"""Table tests of the web chat's sans-IO code: frames in, events, messages and frames out."""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import pytest
import trio

from dshim.channels.base import LoggedMessage
from dshim.channels.webchat import models as m
from dshim.channels.webchat import protocol as p
from dshim.model import Attachment, InboundMessage, Option, ReplyReference, Skip

ME = p.BotIdentity.for_bot("web")
ANN = p.Member("c1", "direct", "u-ann", "Ann")
ROOM = p.Member("r1", "room", "u-ann", "Ann")
T0 = 1_790_000_000.0
PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16
WEBP = b"RIFF\x10\0\0\0WEBPVP8 " + b"\0" * 8


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def send(text: str = "hello", **kw: Any) -> m.SendFrame:
    return m.SendFrame(client_id=kw.pop("client_id", "k1"), conversation="c1", text=text, **kw)


def mapped(
    text: str = "hello", member: p.Member = ANN, lookup: Any = None, **kw: Any
) -> p.Received:
    frame = send(text, **kw)
    frame = msgspec.structs.replace(frame, conversation=member.conversation)
    got = p.map_event(p.build_event(frame, member, at=T0), ME, lookup=lookup)
    assert isinstance(got, p.Received)
    return got


def refused(frame: m.SendFrame, member: p.Member = ANN) -> p.FrameError:
    with pytest.raises(p.FrameError) as info:
        p.build_event(frame, member, at=T0)
    return info.value


# --- client frames ---------------------------------------------------------------------------


def test_the_four_client_frames_parse() -> None:
    join = p.parse_frame(
        '{"type":"join","conversation":"c1","kind":"room","user":{"id":"u1","name":"Ann"}}'
    )
    assert join == m.JoinFrame(conversation="c1", user=m.User("u1", "Ann"), kind="room")
    sent = p.parse_frame(
        '{"type":"send","client_id":"k1","conversation":"c1","text":"hi","reply_to":null,'
        '"files":[{"name":"a.txt","mime":"text/plain","data_b64":"aGk="}],"extra":1}'
    )
    assert sent == m.SendFrame(
        client_id="k1",
        conversation="c1",
        text="hi",
        files=[m.FileUpload("a.txt", "text/plain", "aGk=")],
    )
    answer = p.parse_frame(
        '{"type":"answer","client_id":"k2","conversation":"c1","interaction":"b-1","option":"x"}'
    )
    assert isinstance(answer, m.AnswerFrame) and answer.option == "x"
    assert p.parse_frame('{"type":"leave","conversation":"c1"}') == m.LeaveFrame("c1")


@pytest.mark.parametrize(
    ("data", "code"),
    [
        ("{not json", "bad_json"),
        ('{"type":"send"', "bad_json"),
        ("[" * 200 + "]" * 200, "bad_json"),  # nested too deep: refused, never a RecursionError
        (b'{"type":"join"}', "bad_frame"),  # binary
        ('["join"]', "bad_frame"),
        ('"join"', "bad_frame"),
        ('{"conversation":"c1"}', "bad_frame"),
        ('{"type":7}', "bad_frame"),
        ('{"type":"hello"}', "unknown_type"),
        ('{"type":"JOIN","conversation":"c1"}', "unknown_type"),
        ('{"type":"join","conversation":"c1"}', "bad_frame"),  # no user
        ('{"type":"send","client_id":"k1","conversation":"c1","text":5}', "bad_frame"),
        ('{"type":"leave"}', "bad_frame"),
    ],
)
def test_bad_frames_are_refused_with_a_code(data: str | bytes, code: str) -> None:
    with pytest.raises(p.FrameError) as info:
        p.parse_frame(data)
    assert info.value.code == code
    assert info.value.message


def test_a_bad_send_names_its_client_id_so_the_page_can_mark_it() -> None:
    with pytest.raises(p.FrameError) as info:
        p.parse_frame('{"type":"send","client_id":"k9","conversation":"c1","files":"x"}')
    assert (info.value.code, info.value.client_id) == ("bad_frame", "k9")


def test_an_oversized_frame_is_refused_before_it_is_parsed() -> None:
    frame = json.dumps({"type": "send", "client_id": "k", "conversation": "c", "text": "x" * 101})
    with pytest.raises(p.FrameError) as info:
        p.parse_frame(frame, max_bytes=100)
    assert info.value.code == "too_large"
    assert isinstance(p.parse_frame(frame, max_bytes=len(frame)), m.SendFrame)


# --- join ---------------------------------------------------------------------------------------


def join(
    conversation: str = "c1", kind: str = "direct", uid: str = "u1", name: Any = "Ann"
) -> m.JoinFrame:
    return m.JoinFrame(conversation=conversation, user=m.User(uid, name), kind=kind)


@pytest.mark.parametrize(
    ("frame", "member"),
    [
        (join(), p.Member("c1", "direct", "u1", "Ann")),
        (join(kind="room"), p.Member("c1", "room", "u1", "Ann")),
        (join(name=None), p.Member("c1", "direct", "u1", "u1")),
        (join(name="  Ann \n  Lee\u200b\x07 "), p.Member("c1", "direct", "u1", "Ann Lee")),
        (join(name="x" * 100), p.Member("c1", "direct", "u1", "x" * 64)),
        (
            join(conversation="room-lab", uid="0f3a-ü"),
            p.Member("room-lab", "direct", "0f3a-ü", "Ann"),
        ),
    ],
)
def test_join_gives_the_membership(frame: m.JoinFrame, member: p.Member) -> None:
    assert p.check_join(frame) == member


@pytest.mark.parametrize(
    "frame",
    [
        join(kind="group"),
        join(conversation=""),
        join(conversation="has space"),
        join(conversation="x" * 129),
        join(uid="a/b"),  # "/" separates user and client_id in message ids
        join(uid="bot:web"),  # the bots' own ids
        join(uid="tab\there"),
        join(uid="u" * 65),
    ],
)
def test_join_refuses_what_could_be_confused(frame: m.JoinFrame) -> None:
    with pytest.raises(p.FrameError) as info:
        p.check_join(frame)
    assert info.value.code == "bad_frame"


# --- events and the normalized message --------------------------------------------------------


def test_a_direct_message_is_addressed_with_a_stable_id() -> None:
    got = mapped("hello there")
    msg = got.message
    assert (msg.channel, msg.bot_id, msg.message_id) == ("webchat", "bot:web", "u-ann/k1")
    assert (msg.conversation_id, msg.conversation_type) == ("c1", "direct")
    assert (msg.sender_id, msg.sender_name, msg.addressed) == ("u-ann", "Ann", True)
    assert (msg.content, msg.received_at, msg.reply_to) == ("hello there", T0, None)
    assert got.logged == LoggedMessage(
        message_id="u-ann/k1",
        author_id="u-ann",
        author_name="Ann",
        text="hello there",
        at=T0,
        client_id="k1",
    )


def test_the_same_client_id_is_the_same_message_and_another_user_is_another() -> None:
    assert mapped(client_id="k7").message.message_id == mapped(client_id="k7").message.message_id
    bob = p.Member("c1", "direct", "u-bob", "Bob")
    assert mapped(client_id="k7", member=bob).message.message_id == "u-bob/k7"


@pytest.mark.parametrize(
    ("text", "addressed", "content"),
    [
        ("just chatting", False, "just chatting"),
        ("@web hello", True, "hello"),
        ("@WEB, hello", True, "hello"),
        ("@web: hello", True, "hello"),
        ("hey @web what now", True, "hey what now"),
        ("thanks @web.", True, "thanks ."),
        ("mail me at ann@web.example", False, "mail me at ann@web.example"),
        ("@webby hello", False, "@webby hello"),
        ("@web.bot hello", False, "@web.bot hello"),
        ("/new@web", True, "/new@web"),
        ("/new", False, "/new"),
        ("/new@otherbot", False, "/new@otherbot"),
        ("> @web quoted by hand", True, "> quoted by hand"),
    ],
)
def test_in_a_room_only_a_mention_of_the_bot_addresses_it(
    text: str, addressed: bool, content: str
) -> None:
    msg = mapped(text, member=ROOM).message
    assert (msg.conversation_type, msg.addressed, msg.content) == ("group", addressed, content)


def test_the_log_keeps_what_was_written_mention_included() -> None:
    assert mapped("@web hello", member=ROOM).logged.text == "@web hello"


def test_a_display_name_is_what_a_mention_names() -> None:
    me = p.BotIdentity.for_bot("web", "Helper")
    raw = p.build_event(
        m.SendFrame(client_id="k", conversation="r1", text="@helper hi"), ROOM, at=T0
    )
    got = p.map_event(raw, me)
    assert isinstance(got, p.Received)
    assert (got.message.addressed, got.message.content, got.message.bot_id) == (
        True,
        "hi",
        "bot:web",
    )


def test_a_quote_is_an_id_resolved_by_the_channels_loader_in_this_conversation() -> None:
    asked: list[tuple[str, str]] = []

    def lookup(conversation: str, message_id: str) -> Any:
        asked.append((conversation, message_id))

        async def load() -> ReplyReference | None:
            return None

        return load

    got = mapped("why?", lookup=lookup, reply_to="b-1234")
    ref = got.message.reply_to
    assert ref is not None and ref.message_id == "b-1234" and ref.loader is not None
    assert ref.content is msgspec.UNSET  # never anything the client says about it
    assert asked == [("c1", "b-1234")]
    assert got.logged.reply_to == "b-1234"
    # A quote alone is a message; it never addresses the bot in a room.
    assert not mapped("", member=ROOM, reply_to="b-1").message.addressed


def test_attachments_become_image_and_file_parts_by_their_bytes() -> None:
    files = [
        m.FileUpload("cat.png", "image/png", b64(PNG)),
        m.FileUpload("C:\\photos\\pic", None, b64(WEBP)),
        m.FileUpload("fake.png", "image/png", b64(b"not an image at all")),
        m.FileUpload(None, "text/plain", b64(b"notes")),
    ]
    got = mapped("see", files=files)
    msg = got.message
    assert [(r.kind, r.name, r.mime, r.size) for r in msg.images] == [
        ("image", "cat.png", "image/png", len(PNG)),
        ("image", "pic", "image/webp", len(WEBP)),
    ]
    assert [(r.kind, r.name, r.mime) for r in msg.files] == [
        ("file", "fake.png", "image/png"),
        ("file", "file-4", "text/plain"),
    ]
    assert got.logged.attachments == [
        Attachment(kind="image", name="cat.png"),
        Attachment(kind="image", name="pic"),
        Attachment(kind="file", name="fake.png"),
        Attachment(kind="file", name="file-4"),
    ]

    async def fetch_all() -> list[bytes]:
        return [await r.fetch(10**9) for r in msg.images + msg.files if r.fetch is not None]

    assert trio.run(fetch_all) == [PNG, WEBP, b"not an image at all", b"notes"]


MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("files", "code", "words"),
    [
        (
            [m.FileUpload("big.png", "image/png", b64(PNG + b"\0" * 5 * MIB))],
            "attachment_too_large",
            "big.png is 5.0 MiB: an image can be at most 5.0 MiB",
        ),
        (
            [m.FileUpload("big.bin", None, b64(b"\0" * (20 * MIB + 1)))],
            "attachment_too_large",
            "big.bin is 20.0 MiB: a file can be at most 20.0 MiB",
        ),
        (
            [m.FileUpload(f"f{i}", None, b64(b"\0" * 6 * MIB)) for i in range(4)],
            "attachment_too_large",
            "add up to more than 20.0 MiB",
        ),
        (
            [m.FileUpload(f"f{i}", None, "") for i in range(21)],
            "too_many_attachments",
            "at most 20 per message",
        ),
        (
            [m.FileUpload("x.txt", None, "not base64!")],
            "bad_attachment",
            "x.txt: data_b64 is not valid base64",
        ),
    ],
)
def test_uploads_over_the_limits_are_refused_naming_the_file(
    files: list[m.FileUpload], code: str, words: str
) -> None:
    error = refused(send("see", files=files, client_id="k5"))
    assert (error.code, error.client_id) == (code, "k5")
    assert words in error.message


def test_uploads_at_the_limits_are_taken() -> None:
    files = [m.FileUpload("max.png", "image/png", b64(PNG + b"\0" * (5 * MIB - len(PNG))))]
    files += [m.FileUpload("max.bin", None, b64(b"\0" * 15 * MIB))]
    got = mapped("", files=files)
    assert [r.size for r in got.message.images + got.message.files] == [5 * MIB, 15 * MIB]
    assert len(got.message.images) == 1 and got.message.content == ""
    twenty = [m.FileUpload(f"f{i}", None, b64(b"x")) for i in range(20)]
    assert len(mapped("", files=twenty).message.files) == 20


@pytest.mark.parametrize(
    ("frame", "code"),
    [
        (send("   \n"), "empty"),
        (send("x" * (p.MAX_TEXT + 1)), "too_large"),
        (send("hi", client_id=""), "bad_frame"),
        (send("hi", client_id="has space"), "bad_frame"),
        (send("hi", reply_to="no spaces please"), "bad_frame"),
    ],
)
def test_sends_that_are_refused(frame: m.SendFrame, code: str) -> None:
    assert refused(frame).code == code


@pytest.mark.parametrize(
    "raw",
    [
        b"{",
        b"[]",
        b'{"type":"send","client_id":"k","conversation":"c","user":{"id":"u"},"kind":"group"}',
        b'{"type":"join","client_id":"k","conversation":"c","user":{"id":"u"},"kind":"direct"}',
        b'{"type":"send","client_id":"k","conversation":"c","text":"hi","kind":"direct"}',
        b'{"type":"send","client_id":"k","conversation":"c","text":"","user":{"id":"u"},"kind":"direct"}',
        b"[" * 100 + b"]" * 100,
    ],
)
def test_unusable_stored_events_are_a_malformed_skip(raw: bytes) -> None:
    got = p.map_event(raw, ME)
    assert isinstance(got, Skip) and got.reason == "malformed" and got.detail


def test_a_fixture_event_needs_no_time() -> None:
    raw = b'{"type":"send","client_id":"k1","conversation":"c1","text":"hi","reply_to":null,"files":[],"user":{"id":"u1","name":"Ann"},"kind":"direct"}'
    got = p.map_event(raw, ME)
    assert isinstance(got, p.Received) and got.message.received_at == 0.0


def test_a_button_press_is_the_members_message_and_addresses_the_bot() -> None:
    frame = m.AnswerFrame(client_id="k3", conversation="r1", interaction="b-9", option="allow")
    got = p.map_event(p.answer_event(frame, ROOM, "Allow once", at=T0), ME)
    assert isinstance(got, p.Received)
    msg = got.message
    assert (msg.message_id, msg.content, msg.addressed, msg.reply_to) == (
        "u-ann/k3",
        "Allow once",
        True,
        None,
    )


@pytest.mark.parametrize(
    ("labels", "option", "text"),
    [
        (["Allow once", "Allow always", "Reject"], "o2", "Allow always"),
        (["Yes", "yes ", "No"], "o1", "1"),  # the label does not name it alone
        (["3", "1", "2"], "o1", "1"),  # a number would be read as an option number
        (["Red", "Blue"], "nope", None),
    ],
)
def test_a_button_stands_for_its_label_or_its_number(
    labels: list[str], option: str, text: str | None
) -> None:
    options = [Option(id=f"o{i}", label=label) for i, label in enumerate(labels, 1)]
    assert p.answer_text(options, option) == text


# --- frames out -----------------------------------------------------------------------------------


def test_the_message_frame_has_every_field_of_the_readme() -> None:
    logged = LoggedMessage(
        message_id="b-1",
        author_id="bot:web",
        author_name="web",
        author_bot=True,
        text="<b>hi</b>",
        at=T0 + 0.25,
        reply_to="u1/k1",
        attachments=[Attachment(kind="file", name="a.txt")],
    )
    assert json.loads(p.message_frame("c1", logged, final=False)) == {
        "type": "message",
        "conversation": "c1",
        "id": "b-1",
        "author": {"id": "bot:web", "name": "web", "bot": True},
        "text": "<b>hi</b>",
        "reply_to": "u1/k1",
        "at": "2026-09-21T14:13:20.250Z",
        "final": False,
        "files": [{"kind": "file", "name": "a.txt"}],
    }
    user = mapped().logged
    frame = json.loads(p.message_frame("c1", user))
    assert (frame["client_id"], frame["final"], frame["reply_to"]) == ("k1", True, None)
    history = json.loads(p.history_frame("c1", [(user, True), (logged, False)]))
    assert history["type"] == "history" and history["conversation"] == "c1"
    assert [(x["id"], x["final"]) for x in history["messages"]] == [
        ("u-ann/k1", True),
        ("b-1", False),
    ]


def test_the_other_frames() -> None:
    assert json.loads(p.accepted_frame("k1", "u1/k1", "c1")) == {
        "type": "accepted",
        "client_id": "k1",
        "id": "u1/k1",
        "conversation": "c1",
    }
    assert json.loads(p.error_frame("bad_json", "no")) == {
        "type": "error",
        "code": "bad_json",
        "message": "no",
    }
    assert json.loads(p.error_frame("empty", "no", client_id="k")).get("client_id") == "k"
    frame = json.loads(
        p.interaction_frame(
            "c1", "b-2", kind="approval", prompt="May I?", options=[Option(id="y", label="Yes")]
        )
    )
    assert frame == {
        "type": "interaction",
        "conversation": "c1",
        "id": "b-2",
        "kind": "approval",
        "prompt": "May I?",
        "options": [{"id": "y", "label": "Yes"}],
        "multi_select": False,
        "allow_free_text": False,
    }
    assert json.loads(p.interaction_closed_frame("c1", "b-2"))["type"] == "interaction_closed"


def test_a_quote_snapshot_comes_from_the_log_only() -> None:
    logged = LoggedMessage(
        message_id="u1/k1",
        author_id="u1",
        author_name="Ann",
        text="see the file",
        at=T0,
        attachments=[Attachment(kind="image", name="cat.png")],
    )
    ref = p.reference_from_log(logged)
    assert (ref.message_id, ref.author_id, ref.author_name, ref.content) == (
        "u1/k1",
        "u1",
        "Ann",
        "see the file",
    )
    assert ref.attachments == [Attachment(kind="image", name="cat.png")]
    assert ref.loader is None and not ref.recover


def test_the_pipeline_gets_a_plain_inbound_message() -> None:
    assert isinstance(mapped().message, InboundMessage)
