"""Table tests of Discord's button code: custom ids, INTERACTION_CREATE mapping, rows."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dshim.channels.discord.protocol import (
    MessageMapper,
    Press,
    RecentIds,
    control_custom_id,
    option_custom_id,
    parse_control,
    parse_option,
)
from dshim.channels.discord.render import action_rows, button, option_components
from dshim.model import InboundMessage, Option, Skip
from dshim.outbound import InteractionPrompt

BOT = "1504423025049600001"
CHAN = "1573276719513600006"
THREAD = "1573276719513600999"
USER = {"id": "1431945451929600007", "username": "ada", "global_name": "Ada Lovelace"}
BIG = "18446744073709551615"  # the largest snowflake: 20 digits


def interaction(custom_id: str = "dshim:opt:2:-", **over: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": "1576900619141120200",
        "application_id": BOT,
        "type": 3,
        "token": "aW50ZXJhY3Rpb246MTIz",
        "version": 1,
        "channel_id": CHAN,
        "guild_id": "1468184238489600002",
        "member": {"user": USER, "nick": "Ada (ops)", "roles": []},
        "message": {"id": "1576900619141120100", "channel_id": CHAN, "content": "pick one"},
        "data": {"custom_id": custom_id, "component_type": 2},
    }
    d.update(over)
    return d


def mapped(d: dict[str, Any]) -> Press | Skip:
    return MessageMapper(BOT).decode_interaction(json.dumps(d).encode())


def test_custom_ids_fit_discords_100_characters_and_read_back() -> None:
    for action in ("stop", "disable"):
        cid = control_custom_id(action, BIG, BIG)
        assert len(cid) <= 100
        control = parse_control(cid)
        assert control is not None
        assert (control.action, control.conversation_id, control.thread_id) == (action, BIG, BIG)
    assert control_custom_id("stop", CHAN, None) == f"dshim:ctl:stop:{CHAN}:-"
    assert option_custom_id(25, BIG) == f"dshim:opt:25:{BIG}"
    assert parse_option(option_custom_id(3, None)) == (3, None)


@pytest.mark.parametrize(
    "custom_id",
    [
        "dshim:ctl:restart:1:-",  # not an action
        "dshim:ctl:stop:12ab:-",  # not a snowflake
        "dshim:ctl:stop:1:x",  # thread neither "-" nor a snowflake
        "dshim:ctl:stop",
    ],
)
def test_a_broken_control_custom_id_is_not_read(custom_id: str) -> None:
    assert parse_control(custom_id) is None
    assert isinstance(s := mapped(interaction(custom_id)), Skip) and s.reason == "malformed"


@pytest.mark.parametrize("custom_id", ["dshim:opt:0:-", "dshim:opt:26:-", "dshim:opt:x:-"])
def test_an_option_number_outside_1_to_25_is_not_read(custom_id: str) -> None:
    assert parse_option(custom_id) is None


def test_an_option_press_in_a_guild_is_the_pressers_message_with_the_number() -> None:
    press = mapped(interaction(f"dshim:opt:2:{THREAD}"))
    assert isinstance(press, Press) and press.control is None
    answer = press.answer
    assert isinstance(answer, InboundMessage)
    assert (answer.message_id, answer.conversation_id, answer.thread_id) == (
        "1576900619141120200",
        CHAN,
        THREAD,
    )
    assert (answer.sender_id, answer.sender_name, answer.content) == (
        USER["id"],
        "Ada (ops)",
        "2",
    )
    assert answer.conversation_type == "group" and answer.addressed
    assert answer.received_at > 1.7e9  # the interaction id's time
    assert (press.message_id, press.message_content) == ("1576900619141120100", "pick one")


def test_a_control_press_in_a_dm_names_the_chat_and_the_presser() -> None:
    d = interaction(f"dshim:ctl:disable:{CHAN}:-", user=USER)
    del d["member"], d["guild_id"]
    press = mapped(d)
    assert isinstance(press, Press) and press.answer is None and press.control is not None
    assert (press.control.action, press.control.conversation_id) == ("disable", CHAN)
    assert press.control.thread_id is None and press.user_id == USER["id"]


def test_the_token_is_kept_out_of_repr() -> None:
    press = mapped(interaction())
    assert isinstance(press, Press)
    assert press.token == "aW50ZXJhY3Rpb246MTIz" and press.token not in repr(press)


@pytest.mark.parametrize(
    ("over", "reason"),
    [
        ({"type": 2}, "ignored"),  # a slash command
        ({"data": {"custom_id": "someone-else", "component_type": 2}}, "ignored"),
        ({"data": {"custom_id": "dshim:opt:1:-", "component_type": 3}}, "ignored"),  # a select
        ({"token": ""}, "malformed"),
        ({"token": "a/b"}, "malformed"),  # it goes into a URL path
        ({"id": "12x"}, "malformed"),
        ({"message": None}, "malformed"),
        ({"member": None}, "malformed"),  # nobody pressed it
        ({"channel_id": "x"}, "malformed"),
        ({"data": {"custom_id": "dshim:opt:1:-" + "0" * 100, "component_type": 2}}, "malformed"),
    ],
)
def test_what_is_not_one_of_our_presses(over: dict[str, Any], reason: str) -> None:
    item = mapped(interaction(**over))
    assert isinstance(item, Skip) and item.reason == reason


def test_an_undecodable_interaction_is_malformed_and_a_stored_frame_never_a_message() -> None:
    mapper = MessageMapper(BOT)
    assert mapper.decode_interaction(b'{"id": 5}').reason == "malformed"  # type: ignore[union-attr]
    frame = {"op": 0, "t": "INTERACTION_CREATE", "s": 3, "d": interaction()}
    item = mapper.decode_frame(json.dumps(frame).encode())
    assert isinstance(item, Skip) and item.reason == "ignored"


def test_recent_ids_remember_a_bounded_number() -> None:
    seen = RecentIds(limit=2)
    assert seen.add("1") and seen.add("2") and not seen.add("1")
    assert seen.add("3") and seen.add("1")  # "1" was forgotten first


def test_buttons_go_five_to_a_row_at_most_25_with_allow_green_and_reject_red() -> None:
    rows = action_rows([button(str(i), f"c{i}") for i in range(30)])
    assert [len(r["components"]) for r in rows] == [5, 5, 5, 5, 5]
    options = [
        Option(id="a", label="Allow once", kind="allow_once"),
        Option(id="r", label="Reject", kind="reject_once"),
        Option(id="x", label="x" * 100),
    ]
    prompt = InteractionPrompt(kind="approval", prompt="p", options=options, text="t")
    [row] = option_components(prompt, None)
    assert [(b["style"], b["custom_id"]) for b in row["components"]] == [
        (3, "dshim:opt:1:-"),
        (4, "dshim:opt:2:-"),
        (1, "dshim:opt:3:-"),
    ]
    assert len(row["components"][2]["label"]) == 80
