"""Slack ids and times checked at decode (table tests on the event mapper): channel,
user, ``ts``/``thread_ts`` and file ids of another shape, and a ``ts`` past 2100, are
``malformed`` drops; real ids pass."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dshim.channels.slack.protocol import BotIdentity, EventMapper
from dshim.model import InboundMessage, Skip

ME = BotIdentity(
    user_id="U0BOT0001",
    bot_id="B0BOT0001",
    app_id="A0APP0001",
    team_id="T0FAKE001",
    name="dshim",
    workspace_host="acme.slack.com",
)
BAD = ["x" * 513, "A" * 513, "A\u0000B", "A\nB", "../x", "A B", "A/B", "A?B", "A#B", ".."]


def envelope(**event: Any) -> bytes:
    body = {
        "type": "message",
        "channel": "D0DM00001",
        "channel_type": "im",
        "user": "U0ADA0001",
        "text": "hi",
        "ts": "1700000000.000100",
        **event,
    }
    payload = {"type": "event_callback", "team_id": "T0FAKE001", "api_app_id": "A0APP0001"}
    return json.dumps(
        {"envelope_id": "e1", "type": "events_api", "payload": {**payload, "event": body}}
    ).encode()


def decoded(**event: Any) -> InboundMessage | Skip:
    return EventMapper(ME).decode_envelope(envelope(**event))


def malformed(item: InboundMessage | Skip) -> bool:
    return isinstance(item, Skip) and item.reason == "malformed"


def test_real_ids_pass() -> None:
    item = decoded(
        thread_ts="1700000000.000050",
        files=[{"id": "F0FILE0001", "name": "a.txt", "mimetype": "text/plain"}],
    )
    assert isinstance(item, InboundMessage)
    assert (item.message_id, item.conversation_id, item.sender_id) == (
        "1700000000.000100",
        "D0DM00001",
        "U0ADA0001",
    )


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_channel_or_user_is_malformed(bad: str) -> None:
    assert malformed(decoded(channel=bad))
    assert malformed(decoded(user=bad))


@pytest.mark.parametrize("bad", [*BAD, "1700000000", "1700000000.1.2", "1e9.5"])
def test_a_bad_ts_or_thread_ts_is_malformed(bad: str) -> None:
    assert malformed(decoded(ts=bad))
    assert malformed(decoded(thread_ts=bad))


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_file_id_is_malformed(bad: str) -> None:
    assert malformed(decoded(files=[{"id": bad, "name": "a.txt", "mimetype": "text/plain"}]))


def test_a_ts_past_2100_is_malformed() -> None:
    assert malformed(decoded(ts="999999999999.000100"))
