"""Table tests of the sans-IO WhatsApp protocol: signatures, bodies, mapping, errors,
formatting and payloads.  Pure functions: no sockets, no clock."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

import pytest
from msgspec import UNSET

from dshim.channels.kit.whatsapp_format import to_whatsapp
from dshim.channels.whatsapp import protocol
from dshim.channels.whatsapp.protocol import BotIdentity, Throttled, WindowClosed
from dshim.errors import AuthError, ChannelError, NotFound, PermissionDenied, TransportError
from dshim.model import InboundMessage, Skip

ME = BotIdentity("106540352242922", "+1 555-078-3881", "Acme")
SECRET = b"app-secret"


def body(
    *messages: dict[str, Any],
    statuses: list[dict[str, Any]] = (),
    contacts: list[dict[str, Any]] | None = None,
) -> bytes:  # type: ignore[assignment]
    value: dict[str, Any] = {
        "messaging_product": "whatsapp",
        "metadata": {"display_phone_number": "15550783881", "phone_number_id": ME.id},
    }
    if messages:
        value["contacts"] = (
            contacts
            if contacts is not None
            else [
                {"profile": {"name": "Ada"}, "wa_id": "16505551234", "user_id": "US.1349120865530"}
            ]
        )
        value["messages"] = list(messages)
    if statuses:
        value["statuses"] = list(statuses)
    env = {
        "object": "whatsapp_business_account",
        "entry": [{"id": "102290129340398", "changes": [{"value": value, "field": "messages"}]}],
    }
    return json.dumps(env).encode()


def message(type: str = "text", **fields: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "from": "16505551234",
        "id": "wamid.A1",
        "timestamp": "1790000000",
        "type": type,
    }
    if type == "text" and "text" not in fields:
        msg["text"] = {"body": "hello"}
    msg.update(fields)
    return msg


def mapped(*messages: dict[str, Any], **kw: Any) -> InboundMessage | Skip:
    return protocol.decode_event(body(*messages, **kw), ME).item


# --- the webhook edge ----------------------------------------------------------------------


def _sig(secret: bytes, raw: bytes) -> str:
    return "sha256=" + hmac.new(secret, raw, hashlib.sha256).hexdigest()


RAW = b'{"object":"whatsapp_business_account","entry":[]}'


@pytest.mark.parametrize(
    ("raw", "header", "ok"),
    [
        (RAW, _sig(SECRET, RAW), True),
        (RAW, _sig(SECRET, RAW).upper().replace("SHA256=", "sha256="), True),  # hex case
        (RAW, _sig(b"wrong-secret", RAW), False),
        (json.dumps(json.loads(RAW), indent=2).encode(), _sig(SECRET, RAW), False),  # re-serialized
        (RAW, None, False),
        (RAW, "", False),
        (RAW, _sig(SECRET, RAW)[len("sha256=") :], False),  # no prefix
        (RAW, "sha1=" + _sig(SECRET, RAW)[len("sha256=") :], False),
        (RAW + b" ", _sig(SECRET, RAW), False),
    ],
)
def test_signature_table(raw: bytes, header: str | None, ok: bool) -> None:
    assert protocol.signature_ok(SECRET, raw, header) is ok


def test_an_empty_app_secret_never_verifies() -> None:
    assert not protocol.signature_ok(b"", RAW, _sig(b"", RAW))
    assert protocol.sign(SECRET, RAW) == _sig(SECRET, RAW)


@pytest.mark.parametrize(
    ("query", "answer"),
    [
        ("hub.mode=subscribe&hub.verify_token=tok&hub.challenge=1158201444", "1158201444"),
        ("hub.challenge=abc%20d&hub.verify_token=tok&hub.mode=subscribe", "abc d"),
        ("hub.mode=subscribe&hub.verify_token=TOK&hub.challenge=1", None),
        ("hub.mode=unsubscribe&hub.verify_token=tok&hub.challenge=1", None),
        ("hub.mode=subscribe&hub.verify_token=tok", None),
        ("", None),
    ],
)
def test_verification_answers_only_a_subscribe_with_the_token(
    query: str, answer: str | None
) -> None:
    assert protocol.challenge_answer(query, "tok") == answer


def test_a_body_splits_into_one_message_bodies_and_statuses_in_order() -> None:
    second = message(id="wamid.B2", **{"from": "447700900123"})
    raw = body(
        message(),
        second,
        statuses=[
            {"id": "wamid.S", "status": "failed", "recipient_id": "1", "errors": [{"code": 131047}]}
        ],
        contacts=[
            {"profile": {"name": "Ada"}, "wa_id": "16505551234"},
            {"profile": {"name": "Bob"}, "wa_id": "447700900123"},
        ],
    )
    parts = protocol.split_body(raw)
    assert [p.kind for p in parts] == ["message", "message", "status"]
    first, bob = (protocol.decode_event(p.raw, ME).item for p in parts[:2])
    assert isinstance(first, InboundMessage) and first.sender_name == "Ada"
    assert isinstance(bob, InboundMessage) and bob.sender_name == "Bob"
    assert bob.message_id == "wamid.B2" and bob.conversation_id == "447700900123"
    status = parts[2].status
    assert status is not None and status.errors[0].code == 131047
    # Each part is a body of its own, the message bytes exactly as Meta sent them.
    assert json.dumps(second).encode() in parts[1].raw or b'"wamid.B2"' in parts[1].raw


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b'{"object":"page","entry":[]}',
        b'{"object":"whatsapp_business_account","entry":"x"}',
        b"[" * 5000 + b"]" * 5000,
        b'{"object":"whatsapp_business_account","entry":[{"changes":[{"field":"messages","value":{"messages":7}}]}]}',
    ],
)
def test_a_body_that_is_not_a_notification_is_a_body_error(raw: bytes) -> None:
    with pytest.raises(protocol.BodyError):
        protocol.split_body(raw)


def test_other_fields_are_ignored_and_a_bad_message_stays_its_own_part() -> None:
    raw = json.dumps(
        {
            "object": "whatsapp_business_account",
            "entry": [
                {
                    "id": "1",
                    "changes": [
                        {"field": "account_update", "value": {"event": "x"}},
                        {"field": "messages", "value": {"messages": [{"id": 5}, message()]}},
                    ],
                }
            ],
        }
    ).encode()
    parts = protocol.split_body(raw)
    assert len(parts) == 2
    bad, good = (protocol.decode_event(p.raw, ME).item for p in parts)
    assert isinstance(bad, Skip) and bad.reason == "malformed"
    assert isinstance(good, InboundMessage)


# --- mapping -------------------------------------------------------------------------------


def test_a_text_message_keys_the_user_by_bsuid_and_parses_the_string_timestamp() -> None:
    item = mapped(message())
    assert isinstance(item, InboundMessage)
    assert item.conversation_type == "direct" and item.addressed
    assert item.conversation_id == item.sender_id == "US.1349120865530"
    assert item.sender_name == "Ada" and item.content == "hello"
    assert item.received_at == 1790000000.0 and item.message_id == "wamid.A1"
    assert item.bot_id == ME.id and item.reply_to is None and not item.forwarded


def test_without_a_bsuid_the_phone_is_the_key_and_a_username_user_needs_no_phone() -> None:
    item = mapped(message(), contacts=[{"profile": {"name": "Ada"}, "wa_id": "16505551234"}])
    assert isinstance(item, InboundMessage) and item.conversation_id == "16505551234"
    only = message(from_user_id="BR.1502576394655843")
    del only["from"]
    item = mapped(only, contacts=[{"profile": {"name": "Bia"}, "user_id": "BR.1502576394655843"}])
    assert isinstance(item, InboundMessage) and item.sender_id == "BR.1502576394655843"
    nobody = message()
    del nobody["from"]
    assert isinstance(s := mapped(nobody, contacts=[]), Skip) and s.reason == "malformed"


@pytest.mark.parametrize(
    ("msg", "content", "images", "files"),
    [
        (
            message(
                "image",
                image={"id": "1", "mime_type": "image/jpeg", "sha256": "x", "caption": "look"},
            ),
            "look",
            [("image", None)],
            [],
        ),
        (
            message(
                "document",
                document={"id": "2", "mime_type": "application/pdf", "filename": "q3.pdf"},
            ),
            "",
            [],
            [("file", "q3.pdf")],
        ),
        (
            message("document", document={"id": "2", "filename": "a.pdf", "caption": "read this"}),
            "read this",
            [],
            [("file", "a.pdf")],
        ),
        (
            message("audio", audio={"id": "3", "mime_type": "audio/ogg; codecs=opus"}),
            "",
            [],
            [("audio", None)],
        ),
        (message("video", video={"id": "4", "caption": "clip"}), "clip", [], [("video", None)]),
        (
            message("sticker", sticker={"id": "5", "mime_type": "image/webp"}),
            "",
            [("image", None)],
            [],
        ),
        (
            message(
                "location",
                location={
                    "latitude": 48.85,
                    "longitude": 2.35,
                    "name": "Louvre",
                    "address": "Paris",
                },
            ),
            "[location] Louvre, Paris (48.85, 2.35)",
            [],
            [],
        ),
        (
            message(
                "contacts",
                contacts=[
                    {"name": {"formatted_name": "Bob Li"}, "phones": [{"phone": "+44 7700 900123"}]}
                ],
            ),
            "[contact] Bob Li +44 7700 900123",
            [],
            [],
        ),
        (
            message(
                "interactive",
                interactive={
                    "type": "button_reply",
                    "button_reply": {"id": "dshim.opt.2", "title": "Reject"},
                },
            ),
            "2",
            [],
            [],
        ),
        (
            message(
                "interactive",
                interactive={
                    "type": "list_reply",
                    "list_reply": {"id": "other", "title": "Plan B"},
                },
            ),
            "Plan B",
            [],
            [],
        ),
        (message("button", button={"text": "Yes please", "payload": "YES"}), "Yes please", [], []),
    ],
)
def test_content_types_map_to_text_and_lazy_media(
    msg: dict[str, Any],
    content: str,
    images: list[tuple[str, str | None]],
    files: list[tuple[str, str | None]],
) -> None:
    item = mapped(msg)
    assert isinstance(item, InboundMessage), item
    assert item.content == content
    assert [(r.kind, r.name) for r in item.images] == images
    assert [(r.kind, r.name) for r in item.files] == files


def test_media_gets_a_lazy_fetcher_with_its_id_and_hash() -> None:
    asked: list[tuple[str, str | None]] = []

    def fetcher(media_id: str, sha: str | None) -> Any:
        asked.append((media_id, sha))
        return None

    raw = body(message("image", image={"id": "77", "sha256": "abc"}))
    protocol.decode_event(raw, ME, fetcher=fetcher)
    assert asked == [("77", "abc")]  # the handle is built, nothing is downloaded


@pytest.mark.parametrize(
    "msg",
    [
        message("reaction", reaction={"message_id": "wamid.X", "emoji": "👍"}),
        message(
            "edit",
            edit={
                "original_message_id": "wamid.X",
                "message": {"type": "text", "text": {"body": "/new"}},
            },
        ),
        message("revoke", revoke={"original_message_id": "wamid.X"}),
        message("system", system={"body": "changed"}),
        message("unsupported", errors=[{"code": 131051}]),
        message("request_welcome"),
        message("text", text={"body": "   "}),
        message("brand_new_type"),
    ],
)
def test_non_content_messages_are_not_prompts(msg: dict[str, Any]) -> None:
    item = mapped(msg)
    assert isinstance(item, Skip) and item.reason == "ignored"


def test_a_revoke_names_the_deleted_message_of_the_conversation() -> None:
    raw = body(message("revoke", revoke={"original_message_id": "wamid.X"}))
    assert protocol.decode_event(raw, ME).revoked == ("US.1349120865530", "wamid.X")


def test_a_message_from_the_business_number_itself_is_an_echo() -> None:
    item = mapped(message(**{"from": "15550783881"}), contacts=[])
    assert isinstance(item, Skip) and item.reason == "echo"


def test_groups_are_addressed_only_by_a_mention_of_the_business_number() -> None:
    plain = mapped(message(group_id="120363", text={"body": "just chatting"}))
    assert isinstance(plain, InboundMessage) and not plain.addressed
    assert plain.conversation_type == "group" and plain.conversation_id == "120363"
    mention = mapped(message(group_id="120363", text={"body": "@15550783881 what now?"}))
    assert isinstance(mention, InboundMessage) and mention.addressed
    assert mention.content == "what now?" and mention.sender_id == "US.1349120865530"


def test_in_a_group_a_reply_to_the_business_number_addresses_the_bot() -> None:
    # As on Telegram: quoting one of the bot's messages is talking to it, no mention needed.
    ours = {"from": "15550783881", "id": "wamid.OURS"}
    reply = mapped(message(group_id="120363", context=ours, text={"body": "and the second?"}))
    assert isinstance(reply, InboundMessage) and reply.addressed and not reply.mentioned
    assert reply.content == "and the second?"
    assert reply.reply_to is not None and reply.reply_to.author_id == ME.id
    theirs = {"from": "16505551234", "id": "wamid.THEIRS"}
    other = mapped(message(group_id="120363", context=theirs, text={"body": "agreed"}))
    assert isinstance(other, InboundMessage) and not other.addressed
    # Nor is a forward of the bot's message (a context without an id) a reply to it.
    fwd = mapped(message(group_id="120363", context={"from": "15550783881", "forwarded": True}))
    assert isinstance(fwd, InboundMessage) and not fwd.addressed


def test_the_business_number_of_the_webhook_metadata_identifies_the_bot() -> None:
    # GET /<PHONE_NUMBER_ID> may not name the display number; every webhook's metadata
    # maps our phone_number_id to it, which is what context.from and mentions write.
    bare = BotIdentity(ME.id)
    ours = {"from": "15550783881", "id": "wamid.OURS"}
    raw = body(message(group_id="120363", context=ours, text={"body": "why?"}))
    item = protocol.decode_event(raw, bare).item
    assert isinstance(item, InboundMessage) and item.addressed
    raw = body(message(group_id="120363", text={"body": "@15550783881 why?"}))
    item = protocol.decode_event(raw, bare).item
    assert isinstance(item, InboundMessage) and item.addressed and item.content == "why?"
    # The metadata of another phone number of the same app says nothing about us.
    other = body(message(group_id="120363", context=ours)).replace(ME.id.encode(), b"999")
    item = protocol.decode_event(other, bare).item
    assert isinstance(item, InboundMessage) and not item.addressed


def test_a_stored_body_marked_as_a_quote_of_the_bot_stays_addressed() -> None:
    # The channel found the quoted id among the bot's own answers in the index; the inbox
    # keeps that verdict, so the message is not dropped as unaddressed after a restart.
    quote = {"id": "wamid.OURS"}  # no ``from``: only the index knows it is ours
    raw = protocol.split_body(body(message(group_id="120363", context=quote)))[0].raw
    item = protocol.decode_event(raw, ME).item
    assert isinstance(item, InboundMessage) and not item.addressed
    marked = protocol.quoting_bot(raw)
    item = protocol.decode_event(marked, ME).item
    assert isinstance(item, InboundMessage) and item.addressed
    assert item.reply_to is not None and item.reply_to.message_id == "wamid.OURS"
    # A webhook POST cannot carry the mark: cutting a body rebuilds its envelope.
    [part] = protocol.split_body(marked)
    item = protocol.decode_event(part.raw, ME).item
    assert isinstance(item, InboundMessage) and not item.addressed


def test_a_context_id_is_a_quote_looked_up_in_the_index_and_from_us_is_the_bot() -> None:
    asked: list[tuple[str, str, bool]] = []

    def loader(conversation: str, message_id: str, from_bot: bool) -> Any:
        asked.append((conversation, message_id, from_bot))

        async def load() -> None:
            return None

        return load

    raw = body(message(context={"from": "15550783881", "id": "wamid.OURS"}))
    item = protocol.decode_event(raw, ME, loader=loader).item
    assert isinstance(item, InboundMessage) and item.reply_to is not None
    assert item.reply_to.message_id == "wamid.OURS"
    assert item.reply_to.author_id == ME.id and item.reply_to.author_name == "Acme"
    assert item.reply_to.loader is not None
    raw = body(message(context={"from": "16505551234", "id": "wamid.THEIRS"}))
    item = protocol.decode_event(raw, ME, loader=loader).item
    assert isinstance(item, InboundMessage) and item.reply_to is not None
    assert item.reply_to.author_id is UNSET
    assert asked == [
        ("US.1349120865530", "wamid.OURS", True),
        ("US.1349120865530", "wamid.THEIRS", False),
    ]


def test_a_forwarded_message_is_not_a_quote() -> None:
    item = mapped(message(context={"forwarded": True}, text={"body": "/new"}))
    assert isinstance(item, InboundMessage)
    assert item.forwarded and item.reply_to is None and item.content == "/new"
    item = mapped(message(context={"frequently_forwarded": True}))
    assert isinstance(item, InboundMessage) and item.forwarded


@pytest.mark.parametrize(
    "raw",
    [
        body(message(timestamp=1790000000)),  # a number, not the documented string
        body(message(timestamp="yesterday")),
        body(message(text={"body": 5})),
        body(message(id=None)),
        body(message(context="quoted")),
        b'{"object":"whatsapp_business_account","entry":[{"changes":[{"field":"messages","value":{"messages":[{"id":"w","type":"text","text":{"body":"\\ud800"}}]}}]}]}',
        b"\xff\xfe{}",
        b'{"object":"whatsapp_business_account","entry":' + b"[" * 200 + b"]" * 200 + b"}",
    ],
)
def test_bad_input_is_a_malformed_drop_never_an_exception(raw: bytes) -> None:
    item = protocol.decode_event(raw, ME).item
    assert isinstance(item, Skip) and item.reason == "malformed"


def test_huge_fields_map_without_trouble() -> None:
    item = mapped(message(text={"body": "x" * 200_000}))
    assert isinstance(item, InboundMessage) and len(item.content) == 200_000


def test_a_body_of_statuses_only_is_not_a_message() -> None:
    raw = body(statuses=[{"id": "wamid.S", "status": "delivered", "recipient_id": "1"}])
    item = protocol.decode_event(raw, ME).item
    assert isinstance(item, Skip) and item.reason == "ignored"


# --- errors ---------------------------------------------------------------------------------------


def _graph(code: int | None, status: int = 400) -> ChannelError:
    raw = json.dumps({"error": {"message": "m", "type": "OAuthException", "code": code}}).encode()
    return protocol.graph_error("send message", status, raw)


@pytest.mark.parametrize(
    ("code", "status", "kind"),
    [
        (190, 401, AuthError),
        (0, 400, AuthError),
        (None, 401, AuthError),
        (130429, 400, Throttled),
        (131056, 400, Throttled),
        (4, 400, Throttled),
        (80007, 400, Throttled),
        (131047, 400, WindowClosed),
        (131026, 400, NotFound),
        (10, 403, PermissionDenied),
        (200, 400, PermissionDenied),
        (131000, 500, TransportError),
        (None, 503, TransportError),
        (100, 400, ChannelError),
    ],
)
def test_graph_errors_map_by_code(code: int | None, status: int, kind: type[ChannelError]) -> None:
    err = _graph(code, status)
    assert type(err) is kind
    if kind is Throttled:
        assert isinstance(err, TransportError) and not err.request_sent  # nothing was sent


def test_a_non_json_error_body_maps_by_status() -> None:
    assert type(protocol.graph_error("x", 502, b"<html>")) is TransportError
    assert type(protocol.graph_error("x", 404, b"")) is NotFound


def test_a_send_answer_gives_its_wamid_or_a_protocol_error() -> None:
    ok = b'{"messaging_product":"whatsapp","contacts":[{"input":"1","wa_id":"1"}],"messages":[{"id":"wamid.Z"}]}'
    assert protocol.sent_id("send", ok) == "wamid.Z"
    with pytest.raises(ChannelError):
        protocol.sent_id("send", b'{"messages":[]}')


# --- formatting and payloads --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("markdown", "whatsapp"),
    [
        ("**bold** and *italic*", "*bold* and _italic_"),
        ("__bold__ ~~gone~~", "*bold* ~gone~"),
        ("# Title\ntext", "*Title*\ntext"),
        ("* one\n* two", "- one\n- two"),
        ("see [docs](https://example.com/a)", "see docs (https://example.com/a)"),
        ("```\n**not bold** *x*\n```", "```\n**not bold** *x*\n```"),
        ("use `**x**` here", "use `**x**` here"),
        ("2 * 3 * 4", "2 * 3 * 4"),
        ("snake_case_name", "snake_case_name"),
        ('<dsh_im_source>{"a":"b"}</dsh_im_source>', '<dsh_im_source>{"a":"b"}</dsh_im_source>'),
    ],
)
def test_markdown_becomes_whatsapp_formatting(markdown: str, whatsapp: str) -> None:
    assert to_whatsapp(markdown) == whatsapp


def test_text_payloads_reply_in_context_without_previews() -> None:
    assert protocol.text_payload("16505551234", "hi", reply_to="wamid.A") == {
        "messaging_product": "whatsapp",
        "recipient_type": "individual",
        "to": "16505551234",
        "context": {"message_id": "wamid.A"},
        "type": "text",
        "text": {"body": "hi", "preview_url": False},
    }
    bsuid = protocol.text_payload("US.13491208655302741918", "hi", reply_to=None)
    assert bsuid["recipient"] == "US.13491208655302741918" and "to" not in bsuid
    assert "context" not in bsuid
    group = protocol.text_payload("120363", "hi", reply_to=None, group=True)
    assert group["recipient_type"] == "group" and group["to"] == "120363"


def test_typing_marks_read_and_shows_the_indicator() -> None:
    assert protocol.typing_payload("wamid.A") == {
        "messaging_product": "whatsapp",
        "status": "read",
        "message_id": "wamid.A",
        "typing_indicator": {"type": "text"},
    }


def test_interactive_payloads_are_buttons_up_to_three_then_a_list_then_none() -> None:
    three = protocol.interactive_payload(
        "1", "Allow?", ["Allow once", "Always allow", "Reject"], reply_to="w"
    )
    assert three is not None and three["interactive"]["type"] == "button"
    buttons = three["interactive"]["action"]["buttons"]
    assert [b["reply"]["id"] for b in buttons] == ["dshim.opt.1", "dshim.opt.2", "dshim.opt.3"]
    assert all(len(b["reply"]["title"]) <= 20 for b in buttons)
    five = protocol.interactive_payload(
        "1", "Pick", [f"Option number {i}" for i in range(5)], reply_to=None
    )
    assert five is not None and five["interactive"]["type"] == "list"
    assert len(five["interactive"]["action"]["sections"][0]["rows"]) == 5
    assert (
        protocol.interactive_payload("1", "Pick", [str(i) for i in range(11)], reply_to=None)
        is None
    )


def test_a_button_press_is_not_a_quote_of_the_message_with_the_buttons() -> None:
    press = message(
        "interactive",
        context={"from": "15550783881", "id": "wamid.BUTTONS"},
        interactive={
            "type": "button_reply",
            "button_reply": {"id": "dshim.opt.1", "title": "Allow"},
        },
    )
    item = mapped(press)
    assert isinstance(item, InboundMessage) and item.reply_to is None and item.content == "1"


def test_a_username_user_without_a_profile_name_is_named_by_the_username() -> None:
    msg = message(from_user_id="BR.1502576394655843")
    del msg["from"]
    contact = {"profile": {"username": "@bia"}, "user_id": "BR.1502576394655843"}
    item = mapped(msg, contacts=[contact])
    assert isinstance(item, InboundMessage) and item.sender_name == "@bia"


def test_a_bare_429_is_throttling_and_another_object_is_not_a_notification() -> None:
    assert type(protocol.graph_error("send", 429, b"")) is Throttled
    raw = body(message()).replace(b"whatsapp_business_account", b"page")
    item = protocol.decode_event(raw, ME).item
    assert isinstance(item, Skip) and item.reason == "malformed"


def test_the_phone_rides_along_as_the_route_when_the_key_is_the_bsuid() -> None:
    item = mapped(message())
    assert isinstance(item, InboundMessage) and item.route == "16505551234"
    plain = mapped(message(), contacts=[{"profile": {"name": "Ada"}, "wa_id": "16505551234"}])
    assert isinstance(plain, InboundMessage) and plain.route is None
    payload = protocol.text_payload("US.1349120865530", "x", reply_to=None, phone="16505551234")
    assert payload["to"] == "16505551234" and "recipient" not in payload
