"""Substitute mode: trigger rules (pure), and end to end against the fake Bot API — each
answer lands under its own trigger (the upstream bug), no latch on the session, the
operators' control notice, ``/substitute`` and the per-turn anchors' eviction."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio

from dshim.channels.registry import parse_config
from dshim.config import SubstituteConfig, SubstituteTarget
from dshim.errors import ConfigError
from dshim.model import InboundMessage, Mention
from dshim.pipeline.substitute import ANCHORS_PER_SESSION, decide, match_target, slash_guarded
from dshim.prompt import substitute_block
from dshim.testing.fakes.telegram import FakeTelegram
from tests.rig_telegram import (
    ADA,
    BOB,
    DEADLINE,
    GROUP_ID,
    RecordingHarness,
    polling,
    running_bot,
    telegram_world,
)

SUBSTITUTE = {
    "enabled": True,
    "targets": [{"name": "Olga (on call)", "username": "Owner_Olga", "id": 777}],
}
ACCESS = {"operators": ["900", "43"]}
PREFIX_NOTE = (
    "The user mentioned the person below, not you. Answer on their behalf and say openly"
    " that you are answering for them."
)


def group_msg(content: str, *mentions: Mention, **kw: Any) -> InboundMessage:
    fields: dict[str, Any] = {
        "channel": "telegram",
        "bot_id": "1",
        "message_id": "m1",
        "conversation_id": "g1",
        "conversation_type": "group",
        "sender_id": "42",
        "sender_name": "Ada",
        "addressed": False,
        "content": content,
        "mentions": list(mentions),
    }
    fields.update(kw)
    return InboundMessage(**fields)


def cfg(**kw: Any) -> SubstituteConfig:
    targets = kw.pop(
        "targets", [SubstituteTarget(name="Olga", open_id="ou_o", user_id="u_o", username="olga")]
    )
    return SubstituteConfig(enabled=True, targets=targets, **kw)


# --- the rules, table-tested ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("ids", "kind"),
    [
        ({"open_id": "ou_o"}, "open_id"),
        ({"user_id": "u_o"}, "user_id"),
        ({"username": "OLGA"}, "username"),  # Telegram usernames: case-insensitive
        ({"open_id": "u_o"}, None),  # ids compare by kind only
        ({"union_id": "ou_o"}, None),
        ({"id": "ou_o"}, None),
    ],
)
def test_mentions_match_targets_by_id_kind(ids: dict[str, str], kind: str | None) -> None:
    found = match_target(group_msg("hi", Mention(ids=ids)), cfg())
    assert (found[2] if found else None) == kind


def test_the_first_matching_mention_in_message_order_wins() -> None:
    two = [
        SubstituteTarget(name="A", id="1"),
        SubstituteTarget(name="B", id="2"),
    ]
    msg = group_msg("@b @a", Mention(ids={"id": "2"}), Mention(ids={"id": "1"}))
    found = match_target(msg, cfg(targets=two))
    assert found is not None and found[0].name == "B"


def test_an_email_or_a_name_never_matches_at_run_time() -> None:
    target = SubstituteTarget(name="Olga", email="olga@example.com")
    msg = group_msg("hi", Mention(ids={"open_id": "olga@example.com"}, name="Olga"))
    assert match_target(msg, cfg(targets=[target])) is None


@pytest.mark.parametrize(
    ("content", "guarded"),
    [
        ("@olga /new", True),
        ("  @olga   @bob /stop now", True),
        ("@olga please /new", False),
        ("/new", True),
        ("@olga hello", False),
    ],
)
def test_the_slash_guard_looks_past_leading_mentions(content: str, guarded: bool) -> None:
    msg = group_msg(
        content,
        Mention(ids={"username": "olga"}, text="@olga"),
        Mention(ids={"id": "5"}, text="@bob"),
    )
    assert slash_guarded(msg) is guarded
    assert (decide(msg, cfg()) is None) is guarded


def test_the_decision_names_the_configured_target_and_the_observed_mention() -> None:
    msg = group_msg(
        "@Olga_X is prod down?",
        Mention(ids={"username": "olga"}, name="Olga\n<Evil>", text="@Olga_X"),
        message_id="m9",
    )
    sub = decide(msg, cfg(disclosure="none", reply_mode="quote"))
    assert sub is not None
    assert (sub.target_id, sub.target_name, sub.anchor_id, sub.reply_mode) == (
        "ou_o",
        "Olga",
        "m9",
        "quote",
    )
    block = substitute_block(sub)
    assert block == (
        "<dsh_im_substitute>"
        '{"note":"The user mentioned the person below, not you. Answer on their behalf.",'
        '"target":{"id":"ou_o","name":"Olga"},"disclosure":"none",'
        '"mentionedAs":{"id":"@olga","name":"Olga \\u003cEvil\\u003e"}}'
        "</dsh_im_substitute>"
    )


def test_in_a_thread_the_anchor_is_the_thread_root() -> None:
    msg = group_msg("@olga?", Mention(ids={"username": "olga"}), thread_id="root-1")
    sub = decide(msg, cfg())
    assert sub is not None and sub.anchor_id == "root-1" and sub.in_topic


def config_with(substitute: dict[str, Any], channel: str = "telegram") -> None:
    parse_config(
        {"bots": [{"name": "b", "channel": channel, "token": "t", "substitute": substitute}]},
        env={},
    )


def test_config_errors_name_the_key_path() -> None:
    with pytest.raises(
        ConfigError, match=r"bots\[0\]\.substitute\.targets\[1\]: needs at least one"
    ):
        config_with({"targets": [{"id": 1}, {"name": "nobody"}]})
    with pytest.raises(ConfigError, match=r"bots\[0\]\.substitute\.targets: enabled = true"):
        config_with({"enabled": True, "targets": [{"email": "o@example.com"}]})
    with pytest.raises(ConfigError, match=r"reply_mode"):
        config_with({"targets": [{"id": 1}], "reply_mode": "sideways"})


# --- end to end on Telegram ----------------------------------------------------------------


def answers_in_group(fake: Any) -> list[Any]:
    return fake.bot_messages(GROUP_ID)


def substitute_block_for(typed: str) -> str:
    mentioned: dict[str, str] = {"id": typed}  # the mention as the event shows it
    block = {
        "note": PREFIX_NOTE,
        "target": {"id": "777", "name": "Olga (on call)"},
        "disclosure": "prefix",
        "mentionedAs": mentioned,
    }
    return "<dsh_im_substitute>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_substitute>"


@pytest.mark.parametrize("mode", ["thread", "quote"])
async def test_each_answer_lands_under_its_own_trigger_while_earlier_ones_run(
    autojump_clock: trio.abc.Clock, tmp_path: Path, mode: str
) -> None:
    harness = RecordingHarness()
    with trio.fail_after(DEADLINE):
        async with telegram_world(tmp_path) as (fake, store, clock):
            chat = fake.group_chat(GROUP_ID, "Ops")
            options = {"substitute": {**SUBSTITUTE, "reply_mode": mode}, "access": ACCESS}
            async with running_bot(fake, store, clock, harness=harness, **options):
                await polling(fake)
                a = fake.user_message(chat, ADA, "echo:slow 6 is the deploy done @Owner_Olga")
                await fake.wait_until(lambda: len(harness.prompts) == 1)
                b = fake.user_message(chat, BOB, "@owner_olga can I merge?")
                c = fake.user_message(chat, ADA, "what about staging @OWNER_OLGA")
                await fake.wait_until(lambda: len(answers_in_group(fake)) >= 3)
                await trio.sleep(5)
    answers = answers_in_group(fake)
    assert len(answers) == 3
    by_trigger = {m.reply_to_message_id: m for m in answers}
    assert set(by_trigger) == {a["message_id"], b["message_id"], c["message_id"]}
    # Each answer addresses the person who asked, with a text_mention (not the owner).
    for trigger, asker in ((a, ADA), (b, BOB), (c, ADA)):
        answer = by_trigger[trigger["message_id"]]
        assert answer.data["entities"][0]["type"] == "text_mention"
        assert answer.data["entities"][0]["user"] == {"id": asker["id"]}
        assert answer.text.startswith(asker["first_name"])
    # One finished message each, like a person: no streamed edits.
    assert fake.calls_to("editMessageText") == []
    # The prompt carries the exact block, after the source block, before the text.
    parts = harness.texts[1].split("\n\n")
    assert parts[1] == substitute_block_for("@owner_olga")
    assert parts[2] == "@owner_olga can I merge?"


async def test_a_restart_between_triggers_keeps_each_anchor(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    harness = RecordingHarness()
    options = {"substitute": SUBSTITUTE, "access": ACCESS}
    with trio.fail_after(DEADLINE):
        async with telegram_world(tmp_path) as (fake, store, clock):
            chat = fake.group_chat(GROUP_ID, "Ops")
            async with running_bot(fake, store, clock, harness=harness, **options) as run:
                await polling(fake)
                a = fake.user_message(chat, ADA, "echo:slow 40 long one @Owner_Olga")
                await fake.wait_until(lambda: len(harness.prompts) == 1)
                b = fake.user_message(chat, BOB, "echo:slow 3 queued @Owner_Olga")
                await fake.wait_until(lambda: fake.pending_updates == 0)
                await trio.sleep(1)
                run.scope.cancel()  # a crash: A is running, B is queued
            c = fake.user_message(chat, ADA, "and C @Owner_Olga")
            async with running_bot(fake, store, clock, harness=harness, **options):
                await fake.wait_until(lambda: len(answers_in_group(fake)) >= 3)
                await trio.sleep(30)
    replies = [m.reply_to_message_id for m in answers_in_group(fake)]
    assert sorted(replies) == sorted([a["message_id"], b["message_id"], c["message_id"]])


async def test_a_normal_mention_after_substitute_turns_streams_as_usual(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with telegram_world(tmp_path) as (fake, store, clock):
            chat = fake.group_chat(GROUP_ID, "Ops")
            options = {"substitute": SUBSTITUTE, "access": ACCESS}
            async with running_bot(fake, store, clock, **options):
                await polling(fake)
                fake.user_message(chat, ADA, "echo:slow 4 first @Owner_Olga")
                await fake.wait_until(lambda: len(answers_in_group(fake)) == 1)
                await trio.sleep(3)
                assert fake.calls_to("editMessageText") == []
                normal = fake.user_message(chat, ADA, "echo:slow 8 @dshim_test_bot now you")
                await fake.wait_until(lambda: len(answers_in_group(fake)) == 2)
                await trio.sleep(10)
    answer = answers_in_group(fake)[-1]
    assert answer.reply_to_message_id == normal["message_id"]
    assert "entities" not in answer.data  # an ordinary answer: no mention of the asker
    assert len(fake.calls_to("editMessageText")) >= 1  # streamed by edits


async def test_the_control_notice_goes_once_per_session_to_operators_only(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with telegram_world(tmp_path) as (fake, store, clock):
            chat = fake.group_chat(GROUP_ID, "Ops")
            fake.private_chat(FakeTelegram.user(900, "Oscar"))
            fake.private_chat(BOB)
            options = {"substitute": SUBSTITUTE, "access": ACCESS}
            async with running_bot(fake, store, clock, **options):
                await polling(fake)
                fake.user_message(chat, BOB, "is the build green? @Owner_Olga")
                await fake.wait_until(lambda: len(answers_in_group(fake)) == 1)
                fake.user_message(chat, ADA, "and prod? @Owner_Olga")
                await fake.wait_until(lambda: len(answers_in_group(fake)) == 2)
                await trio.sleep(5)
    dms = [c for c in fake.calls_to("sendMessage") if c.params["chat_id"] > 0]
    # Operators 900 and 43; Bob (43) asked, so only 900 is told, once for the session.
    assert [c.params["chat_id"] for c in dms] == [900]
    text = dms[0].params["text"]
    assert "Ops" in text and "Bob" in text and "is the build green?" in text
    assert "/stop" in text and "/substitute off" in text


async def test_substitute_command_needs_a_mention_and_an_operator(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    harness = RecordingHarness()
    with trio.fail_after(DEADLINE):
        async with telegram_world(tmp_path) as (fake, store, clock):
            chat = fake.group_chat(GROUP_ID, "Ops")
            dm = fake.private_chat(ADA)
            options = {"substitute": SUBSTITUTE, "access": ACCESS}
            async with running_bot(fake, store, clock, harness=harness, **options):
                await polling(fake)

                async def say(c: dict[str, Any], who: dict[str, Any], text: str) -> str:
                    before = len(fake.calls_to("sendMessage"))
                    fake.user_message(c, who, text)
                    await fake.wait_until(lambda: len(fake.calls_to("sendMessage")) > before)
                    return str(fake.calls_to("sendMessage")[-1].params["text"])

                assert "only in groups" in await say(dm, ADA, "/substitute status")
                refused = await say(chat, ADA, "/substitute@dshim_test_bot off")
                assert "Only the bot's operators" in refused
                assert "Usage" in await say(chat, BOB, "@dshim_test_bot /substitute sideways")
                assert "is on in this chat" in await say(chat, BOB, "@dshim_test_bot /substitute")
                assert "is off in this chat" in await say(
                    chat, BOB, "@dshim_test_bot /substitute 关"
                )
                fake.user_message(chat, ADA, "anyone? @Owner_Olga")  # off: not a trigger
                assert "is on" in await say(chat, BOB, "/substitute@dshim_test_bot enable")
                fake.user_message(chat, ADA, "now? @Owner_Olga")
                await fake.wait_until(lambda: len(harness.prompts) == 1)
    assert harness.texts[0].endswith("now? @Owner_Olga")


async def test_an_evicted_anchor_falls_back_to_a_plain_message(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    harness = RecordingHarness()
    n = ANCHORS_PER_SESSION + 1
    with trio.fail_after(DEADLINE * 4):
        async with telegram_world(tmp_path) as (fake, store, clock):
            chat = fake.group_chat(GROUP_ID, "Ops")
            options = {
                "substitute": SUBSTITUTE,
                "access": ACCESS,
                "lanes": {"max_queue": 64},
            }
            async with running_bot(fake, store, clock, harness=harness, **options):
                await polling(fake)
                fake.user_message(chat, ADA, "echo:slow 60 blocker @Owner_Olga")
                await fake.wait_until(lambda: len(harness.prompts) == 1)
                first = fake.user_message(chat, ADA, "queued first @Owner_Olga")
                for i in range(n - 1):
                    fake.user_message(chat, BOB, f"q{i} @Owner_Olga")
                await fake.wait_until(lambda: len(answers_in_group(fake)) >= n + 1)
                await trio.sleep(5)
    answers = {m.reply_to_message_id: m for m in answers_in_group(fake)}
    # The queued first trigger's anchor was evicted by the 32 newer ones before its turn
    # started: it gets a plain message (never another turn's anchor).
    assert first["message_id"] not in answers
    assert None in answers and answers[None].text.startswith("Ada")
    assert "queued first" in answers[None].text
    assert len(answers) == n + 1


# --- end to end on Discord -----------------------------------------------------------------


async def test_discord_answers_each_trigger_in_its_own_thread_and_pings_only_the_asker(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    from tests.rig_discord import running_bot as discord_bot

    owner_id = "111111111111111111"
    options = {
        "substitute": {"enabled": True, "targets": [{"name": "Olga", "id": owner_id}]},
        "access": {"operators": ["222222222222222222"]},
    }
    async with discord_bot(tmp_path, **options) as (bot, fake):
        owner = {"id": owner_id, "username": "olga", "global_name": "Olga"}
        bob = fake.make_user("bob", global_name="Bob")
        chan = fake.text_channel
        a = await fake.user_message(
            chan, f"echo:slow 5 deploy? <@{owner_id}>", mention_users=[owner]
        )
        b = await fake.user_message(
            chan, f"<@{owner_id}> can I merge?", author=bob, mention_users=[owner]
        )
        await fake.wait_until(
            lambda: bool(fake.bot_messages(a["id"])) and bool(fake.bot_messages(b["id"]))
        )
        guarded = await fake.user_message(chan, f"<@{owner_id}> /new", mention_users=[owner])
        await trio.sleep(10)
    # Each answer is in a thread opened on its own trigger, and pings only the asker.
    for trigger, asker in ((a, fake.user), (b, bob)):
        assert fake.channels[trigger["id"]]["parent_id"] == chan
        [answer] = fake.bot_messages(trigger["id"])
        assert answer["content"].startswith(f"<@{asker['id']}> ")
        assert answer["mentions"] == [{"id": asker["id"]}]
    creates = [c for c in fake.calls_to("POST", "/channels/") if c.path.endswith("/messages")]
    for call in creates:
        users = call.json["allowed_mentions"].get("users", [])
        assert users in ([], [fake.user["id"]], [bob["id"]]) and owner_id not in users
    # The slash guard: "@owner /new" is no trigger (and no command): no thread, no answer.
    assert guarded["id"] not in fake.channels
    assert "unaddressed" in bot.drop_reasons()
    # The operator was told once, in a DM channel opened for them.
    assert list(fake.dm_channels) == ["222222222222222222"]
    [notice] = fake.bot_messages(fake.dm_channels["222222222222222222"])
    assert "deploy?" in notice["content"]


async def test_control_buttons_stop_the_answer_or_disable_the_chat_for_operators_only(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    from tests.helpers import msg, open_rig

    sub = {"enabled": True, "targets": [{"id": "777"}]}
    async with open_rig(tmp_path, substitute=sub, access={"operators": ["900"]}) as rig:
        await rig.rt.accept(
            msg(
                "echo:slow 20 long", conversation_id="g1", conversation_type="group", addressed=True
            )
        )
        await trio.sleep(1)
        refused = await rig.rt.substitute_control("stop", "g1", None, "42")
        assert refused.startswith("Only the bot's operators")
        assert await rig.rt.substitute_control("stop", "g1", None, "900") == "Stopped the answer."
        await rig.rt.wait_idle()
        assert rig.texts[-1].endswith("⏹ Stopped.")
        text = await rig.rt.substitute_control("disable", "g1", None, "900")
        assert text.startswith("Substitute mode is off")
        assert not await rig.rt.substitute.is_on("g1")


async def test_discord_control_notice_with_buttons_once_per_session_not_to_the_asker(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    from tests.rig_discord import running_bot as discord_bot

    owner_id, operator_id, asker_id = "111111111111111111", "222222222222222222", "3" * 18
    owner = {"id": owner_id, "username": "olga", "global_name": "Olga"}
    asker = {"id": asker_id, "username": "ada", "global_name": "Ada"}  # an operator too
    options = {
        "substitute": {"enabled": True, "targets": [{"name": "Olga", "id": owner_id}]},
        "access": {"operators": [operator_id, asker_id]},
    }
    async with discord_bot(tmp_path, **options) as (bot, fake):
        chan = fake.text_channel
        for text in ("deploy?", "and merge?"):
            await fake.user_message(
                chan, f"{text} <@{owner_id}>", author=asker, mention_users=[owner]
            )
            await trio.sleep(5)
        assert list(fake.dm_channels) == [operator_id]
        [notice] = fake.bot_messages(fake.dm_channels[operator_id])
        assert "deploy?" in notice["content"]
        assert [b["custom_id"] for row in notice["components"] for b in row["components"]] == [
            f"dshim:ctl:stop:{chan}:-",
            f"dshim:ctl:disable:{chan}:-",
        ]


async def test_the_control_notice_is_retried_when_no_operator_could_be_told(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with telegram_world(tmp_path) as (fake, store, clock):
            chat = fake.group_chat(GROUP_ID, "Ops")
            options = {"substitute": SUBSTITUTE, "access": {"operators": ["900"]}}
            async with running_bot(fake, store, clock, **options):
                await polling(fake)
                # Operator 900 never opened a chat with the bot: the DM fails ("chat not
                # found"), so nobody was told and the notice is still due.
                fake.user_message(chat, BOB, "is the build green? @Owner_Olga")
                await fake.wait_until(lambda: len(answers_in_group(fake)) == 1)
                fake.private_chat(FakeTelegram.user(900, "Oscar"))
                fake.user_message(chat, ADA, "and prod? @Owner_Olga")
                await fake.wait_until(lambda: len(answers_in_group(fake)) == 2)
                fake.user_message(chat, ADA, "and staging? @Owner_Olga")
                await fake.wait_until(lambda: len(answers_in_group(fake)) == 3)
                await trio.sleep(5)
    dms = [c for c in fake.calls_to("sendMessage") if c.params["chat_id"] > 0]
    # The failed DM, then the one that reached Oscar (about Ada's question), and no more.
    assert [c.params["chat_id"] for c in dms] == [900, 900]
    assert "and prod?" in dms[1].params["text"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_substitute_turn_in_a_forum_topic_streams_like_a_normal_turn(
    autojump_clock: trio.abc.Clock, tmp_path: Path, stream: bool
) -> None:
    # Topic substitute sessions keep the normal streaming (the seed's rule); `stream`
    # decides it only for substitute turns in the chat itself.
    with trio.fail_after(DEADLINE):
        async with telegram_world(tmp_path) as (fake, store, clock):
            chat = fake.group_chat(GROUP_ID, "Ops", supergroup=True)
            topic = fake.create_topic(GROUP_ID, "Deploys", creator=ADA)
            options = {"substitute": {**SUBSTITUTE, "stream": stream}, "access": ACCESS}
            async with running_bot(fake, store, clock, **options):
                await polling(fake)
                fake.user_message(
                    chat, ADA, "echo:slow 8 in the topic @Owner_Olga", thread_id=topic
                )
                await fake.wait_until(lambda: len(answers_in_group(fake)) == 1)
                await trio.sleep(12)
                in_topic_edits = len(fake.calls_to("editMessageText"))
                fake.user_message(chat, ADA, "echo:slow 8 in the chat @Owner_Olga")
                await fake.wait_until(lambda: len(answers_in_group(fake)) == 2)
                await trio.sleep(12)
                in_chat_edits = len(fake.calls_to("editMessageText")) - in_topic_edits
    first = answers_in_group(fake)[0]
    assert first.data.get("message_thread_id") == topic
    assert in_topic_edits >= 1  # streamed by edits, whatever `stream` says
    assert (in_chat_edits >= 1) is stream
