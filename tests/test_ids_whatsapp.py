"""WhatsApp Cloud ids and times checked at decode (table tests on ``decode_event``): a
wamid of 500,000 characters, or ids of another shape, are ``malformed`` drops; a bad
``context.id`` only makes the quote ``not-found``."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dshim.channels.whatsapp import protocol
from dshim.channels.whatsapp.protocol import BotIdentity
from dshim.model import InboundMessage, Skip

ME = BotIdentity("106540352242922", "+1 555-078-3881", "Acme")
WAMID = "wamid.HBgLMTY1MDU1NTEyMzQVAgASGBQzQTAwMDAwMDAwMDAwMDAwMD011A"
BAD = ["x" * 513, "a\u0000b", "a\nb", "../x", "a b", "a/b", "a?b", "a#b", ".."]
BAD_WAMID = [*BAD, "wamid." + "A" * 500_000, "wamid.a b", "wamid.a?b", "wamid.", "m1"]


def body(msg: dict[str, Any], contact: dict[str, Any] | None = None) -> bytes:
    value = {
        "messaging_product": "whatsapp",
        "metadata": {"display_phone_number": "15550783881", "phone_number_id": ME.id},
        "contacts": [contact or {"profile": {"name": "Ada"}, "wa_id": "16505551234"}],
        "messages": [msg],
    }
    env = {
        "object": "whatsapp_business_account",
        "entry": [{"id": "102290129340398", "changes": [{"value": value, "field": "messages"}]}],
    }
    return json.dumps(env).encode()


def message(**fields: Any) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "from": "16505551234",
        "id": WAMID,
        "timestamp": "1790000000",
        "type": "text",
        "text": {"body": "hello"},
    }
    msg.update(fields)
    return msg


def decoded(msg: dict[str, Any], contact: dict[str, Any] | None = None) -> InboundMessage | Skip:
    return protocol.decode_event(body(msg, contact), ME).item


def malformed(item: InboundMessage | Skip) -> bool:
    return isinstance(item, Skip) and item.reason == "malformed" and len(item.detail) <= 300


def test_real_ids_pass() -> None:
    item = decoded(
        message(
            group_id="120363025246125486",
            from_user_id="US.1349120865530",
            context={"id": WAMID.replace("11A", "12A"), "from": "15550783881"},
            text={"body": "@15550783881 hi"},
        )
    )
    assert isinstance(item, InboundMessage) and item.message_id == WAMID
    assert item.reply_to is not None and item.reply_to.message_id == WAMID.replace("11A", "12A")


@pytest.mark.parametrize("bad", BAD_WAMID)
def test_a_bad_wamid_is_malformed(bad: str) -> None:
    assert malformed(decoded(message(id=bad)))


@pytest.mark.parametrize("bad", [*BAD, "+16505551234", "1650555123a"])
def test_a_sender_that_is_no_phone_number_is_malformed(bad: str) -> None:
    assert malformed(decoded(message(**{"from": bad})))
    assert malformed(decoded(message(), {"wa_id": bad}))


@pytest.mark.parametrize("bad", [*BAD, "us.123", "US.", "US.1/2"])
def test_a_bad_bsuid_is_malformed(bad: str) -> None:
    assert malformed(decoded(message(from_user_id=bad)))


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_group_or_media_id_is_malformed(bad: str) -> None:
    assert malformed(decoded(message(group_id=bad)))
    image = message(type="image", image={"id": bad, "mime_type": "image/jpeg"})
    del image["text"]
    assert malformed(decoded(image))


@pytest.mark.parametrize("bad", BAD_WAMID)
def test_a_bad_quoted_id_keeps_the_message_without_its_quote(bad: str) -> None:
    item = decoded(message(context={"id": bad, "from": "16505559999"}))
    assert isinstance(item, InboundMessage) and item.content == "hello"
    assert item.reply_to is not None and item.reply_to.unavailable_reason == "not-found"


def test_an_absurd_timestamp_is_malformed() -> None:
    assert malformed(decoded(message(timestamp="999999999999")))
