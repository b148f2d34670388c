"""Substitute mode on Slack: the mentions the mapping finds (table tests), and end to end
against the fake (Web API + Socket Mode through ``serve_bots``, real SQLite, autojump
clock) — each answer under its own trigger in thread and quote mode, across a restart,
the plain fallback after 32 anchors, no latch on the session, the operators' control
notice with its buttons."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import trio

from dshim.channels.slack import models as m
from dshim.channels.slack.protocol import BotIdentity, EventMapper, people_mentioned
from dshim.config import SubstituteConfig, SubstituteTarget
from dshim.model import InboundMessage, Mention
from dshim.pipeline.substitute import ANCHORS_PER_SESSION, decide
from dshim.testing.fakes.slack import FakeSlack, Msg, _user, open_fake_slack
from tests.test_slack_e2e import running_bot

BOT = "U0BOT0001"
OWNER = "U0OLGA001"
OPS = "U0OPS0001"
SUB: dict[str, Any] = {"enabled": True, "targets": [{"name": "Olga", "id": OWNER}]}
ACCESS = {"operators": [OPS]}


def mapper() -> EventMapper:
    return EventMapper(BotIdentity(user_id=BOT, bot_id="B0BOT0001", app_id="A1", team_id="T1"))


def event(text: str, *, user: str = "U0ADA0001", kind: str = "message", **kw: Any) -> m.Event:
    raw = {
        "type": kind,
        "user": user,
        "text": text,
        "ts": kw.pop("ts", "1700000000.000100"),
        "channel": "C0GEN0001",
        "channel_type": "channel",
        **kw,
    }
    return msgspec.json.decode(json.dumps(raw), type=m.Event)


def mapped(text: str, mp: EventMapper | None = None, **kw: Any) -> InboundMessage:
    item = (mp or mapper()).map_event(event(text, **kw))
    assert isinstance(item, InboundMessage)
    return item


# --- the mapping, table-tested ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (f"<@{OWNER}> is prod down?", [Mention(ids={"id": OWNER}, text=f"@{OWNER}")]),
        ("<@U0OLGA001|olga> hi", [Mention(ids={"id": OWNER}, name="olga", text="@olga")]),
        (
            "ping <@W0ENT0001|Ent> and <@U0B>",
            [
                Mention(ids={"id": "W0ENT0001"}, name="Ent", text="@Ent"),
                Mention(ids={"id": "U0B"}, text="@U0B"),
            ],
        ),
        (f"<@{BOT}> ask <@{OWNER}>", [Mention(ids={"id": OWNER}, text=f"@{OWNER}")]),
        (f"&gt; <@{OWNER}> said so\nreally?", []),  # a quoted line: not this message's
        (f"&gt; quoted\n<@{OWNER}> and you?", [Mention(ids={"id": OWNER}, text=f"@{OWNER}")]),
        ("<!here> <#C0GEN0001> <https://x.example|x>", []),  # not people
    ],
)
def test_user_mentions_in_text_order_without_the_bot_or_quoted_lines(
    text: str, expected: list[Mention]
) -> None:
    item = mapped(text)
    assert item.mentions == expected
    for mention in item.mentions:
        assert mention.text is not None and mention.text in item.content
    assert people_mentioned(text, BOT) == expected


def test_names_come_from_what_the_channel_learned_about_the_person() -> None:
    mp = mapper()
    mapped("hello", mp, user=OWNER, user_profile={"real_name": "Olga K"}, ts="1700000000.000001")
    item = mapped(f"<@{OWNER}> deploy?", mp)
    assert item.mentions == [Mention(ids={"id": OWNER}, name="Olga K", text="@Olga K")]
    assert item.content == "@Olga K deploy?"


@pytest.mark.parametrize(
    ("text", "kind", "mentioned", "addressed"),
    [
        (f"<@{OWNER}> hi", "message", False, False),
        (f"<@{BOT}> <@{OWNER}> hi", "message", True, True),
        (f"<@{BOT}|dshim> hi", "message", True, True),
        (f"<@{BOT}> hi", "app_mention", True, True),
    ],
)
def test_mentioned_is_the_bots_own_mention(
    text: str, kind: str, mentioned: bool, addressed: bool
) -> None:
    item = mapped(text, kind=kind)
    assert (item.mentioned, item.addressed) == (mentioned, addressed)
    assert all(x.ids["id"] != BOT for x in item.mentions)


@pytest.mark.parametrize(
    ("target", "triggers"),
    [
        (SubstituteTarget(name="Olga", id=OWNER), True),
        (SubstituteTarget(name="Olga", username=OWNER), False),  # by id kind only
        (SubstituteTarget(name="Olga", open_id=OWNER), False),
        (SubstituteTarget(name="olga"), False),  # a name never matches
    ],
)
def test_a_slack_mention_matches_a_target_by_its_id(
    target: SubstituteTarget, triggers: bool
) -> None:
    item = mapped(f"<@{OWNER}|olga> is prod down?")
    sub = decide(item, SubstituteConfig(enabled=True, targets=[target]))
    assert (sub is not None) is triggers


def test_the_slash_guard_sees_through_a_leading_slack_mention() -> None:
    cfg = SubstituteConfig(enabled=True, targets=[SubstituteTarget(id=OWNER)])
    assert decide(mapped(f"<@{OWNER}|olga> /new"), cfg) is None
    assert decide(mapped(f"<@{OWNER}> /new"), cfg) is None
    assert decide(mapped(f"<@{OWNER}> please /new"), cfg) is not None


# --- end to end --------------------------------------------------------------------------------


async def until(predicate: Callable[[], bool]) -> None:
    """Wait for what the fake does not see (the pipeline's prompts), on the virtual clock."""
    while not predicate():  # noqa: ASYNC110 - the observer has no event to wait on
        await trio.sleep(0.05)


def add_people(fake: FakeSlack) -> None:
    fake.users[OWNER] = _user(OWNER, "olga", "Olga K")
    fake.users[OPS] = _user(OPS, "oscar", "Oscar Ops")


def answers(fake: FakeSlack) -> list[Msg]:
    return [x for x in fake.bot_messages(fake.general) if not x.streaming]


def permalink(fake: FakeSlack, ts: str) -> str:
    return f"https://fake-ws.slack.com/archives/{fake.general}/p{ts.replace('.', '')}"


def block_for(mentioned: str) -> str:
    block = {
        "note": (
            "The user mentioned the person below, not you. Answer on their behalf and say"
            " openly that you are answering for them."
        ),
        "target": {"id": OWNER, "name": "Olga"},
        "disclosure": "prefix",
        "mentionedAs": {"id": OWNER, "name": mentioned},
    }
    return "<dsh_im_substitute>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_substitute>"


def under(fake: FakeSlack, mode: str, trigger: dict[str, Any]) -> Msg:
    """The one answer placed under ``trigger`` the way ``mode`` places it."""
    found = [
        x
        for x in answers(fake)
        if (mode == "thread" and x.thread_ts == trigger["ts"])
        or (mode == "quote" and x.thread_ts is None and permalink(fake, trigger["ts"]) in x.text)
    ]
    assert len(found) == 1, (mode, trigger["text"], [x.text[:80] for x in answers(fake)])
    return found[0]


@pytest.mark.parametrize("mode", ["thread", "quote"])
async def test_each_answer_lands_under_its_own_trigger_across_a_restart(
    tmp_path: Any, autojump_clock: object, mode: str
) -> None:
    options = {"substitute": {**SUB, "reply_mode": mode}, "access": ACCESS}
    async with open_fake_slack() as fake:
        add_people(fake)
        await restarted(tmp_path, fake, options, mode)


async def restarted(tmp_path: Any, fake: FakeSlack, options: dict[str, Any], mode: str) -> None:
    async with running_bot(tmp_path, reuse=fake, **options) as (bot, _):
        a = await fake.user_message(fake.general, f"echo:slow 60 is the deploy done <@{OWNER}>")
        await until(lambda: len(bot.events.prompts) == 1)
        b = await fake.user_message(
            fake.general, f"<@{OWNER}|olga> can I merge?", user=fake.other_user
        )
        await fake.wait_until(lambda: len(fake.acks) >= 2)
        await trio.sleep(1)
    # A was cut by the shutdown before it showed anything and B was queued behind it:
    # both run again after the restart, each still under its own trigger.
    assert answers(fake) == []
    async with running_bot(tmp_path, reuse=fake, **options) as (bot, _):
        c = await fake.user_message(fake.general, f"what about staging <@{OWNER}>")
        await fake.wait_until(lambda: len(answers(fake)) >= 3)
        await trio.sleep(10)
    assert len(answers(fake)) == 3
    for trigger, asker in ((a, fake.user), (b, fake.other_user), (c, fake.user)):
        answer = under(fake, mode, trigger)
        # The first (only) message pings the asker alone: the agent's text is escaped.
        assert answer.text.startswith(f"<@{asker}> &lt;dsh_im_source&gt;")
        assert answer.text.count("<@") == 1
        assert answer.edits == []  # one finished message, like a person
    assert block_for("olga").replace("<", "&lt;").replace(">", "&gt;") in under(fake, mode, b).text
    posts = [p for p in fake.calls_to("chat.postMessage") if p.args["channel"] == fake.general]
    assert [p.args["unfurl_links"] for p in posts] == [mode == "quote"] * 3
    assert fake.calls_to("chat.startStream") == []


async def test_an_evicted_anchor_answers_with_a_plain_message(
    tmp_path: Any, autojump_clock: object
) -> None:
    n = ANCHORS_PER_SESSION + 1
    options = {"substitute": SUB, "access": ACCESS, "lanes": {"max_queue": 64}}
    async with running_bot(tmp_path, configure=add_people, **options) as (bot, fake):
        blocker = await fake.user_message(fake.general, f"echo:slow 60 blocker <@{OWNER}>")
        await until(lambda: len(bot.events.prompts) == 1)
        first = await fake.user_message(
            fake.general, f"queued first <@{OWNER}>", user=fake.other_user
        )
        triggers = [await fake.user_message(fake.general, f"q{i} <@{OWNER}>") for i in range(n - 1)]
        await fake.wait_until(lambda: len(answers(fake)) >= n + 1)
        await trio.sleep(5)
    assert len(answers(fake)) == n + 1
    for trigger in [blocker, *triggers]:
        under(fake, "thread", trigger)
    # The queued first trigger's anchor was evicted by 32 newer ones: a plain channel post,
    # never under another turn's trigger, still addressed to the asker.
    [plain] = [x for x in answers(fake) if x.thread_ts is None]
    assert plain.text.startswith(f"<@{fake.other_user}> ")
    assert "queued first" in plain.text and "/archives/" not in plain.text
    assert first["ts"] not in {x.thread_ts for x in answers(fake)}


async def test_a_normal_mention_after_substitute_turns_streams_natively(
    tmp_path: Any, autojump_clock: object
) -> None:
    async with running_bot(tmp_path, configure=add_people, substitute=SUB) as (bot, fake):
        sub = await fake.user_message(fake.general, f"echo:slow 4 first <@{OWNER}>")
        await fake.wait_until(lambda: len(answers(fake)) == 1)
        # The person answered for may take over in that thread: it is not the bot's.
        await fake.user_message(fake.general, "I'll take it", user=OWNER, thread_ts=sub["ts"])
        await trio.sleep(3)
        assert bot.drop_reasons()[-1] == "unaddressed"
        normal = await fake.user_message(fake.general, "echo:slow 8 now you", mention=True)
        await fake.wait_until(lambda: len(answers(fake)) == 2)
        await trio.sleep(10)
    first, second = answers(fake)
    assert first.thread_ts == sub["ts"] and first.text.startswith(f"<@{fake.user}> ")
    # The ordinary turn streams natively in its own thread, without the asker's mention.
    [start] = fake.calls_to("chat.startStream")
    assert start.args["thread_ts"] == normal["ts"] == second.thread_ts
    assert len(fake.calls_to("chat.appendStream")) >= 2
    assert not second.text.startswith("<@") and "dsh_im_substitute" not in second.text
    assert len(bot.events.prompts) == 2


def control_buttons(msg: Msg) -> list[dict[str, Any]]:
    assert msg.blocks is not None
    return [el for b in msg.blocks if b.get("type") == "actions" for el in b["elements"]]


async def test_the_control_notice_buttons_stop_or_disable_for_operators_only(
    tmp_path: Any, autojump_clock: object
) -> None:
    options = {"substitute": SUB, "access": ACCESS}
    async with running_bot(tmp_path, configure=add_people, **options) as (bot, fake):
        # The notice follows the first answer of a session: how to take over from here on.
        await fake.user_message(fake.general, f"is the build green? <@{OWNER}>")
        await fake.wait_until(lambda: OPS in fake.dm_channels)
        dm = fake.dm_channels[OPS]
        await fake.wait_until(lambda: bool(fake.bot_messages(dm)))
        [notice] = fake.bot_messages(dm)
        assert "is the build green?" in notice.text and "Ada Lovelace" in notice.text
        buttons = control_buttons(notice)
        assert [(b["action_id"], b["text"]["text"]) for b in buttons] == [
            ("dshim_ctl_stop", "Stop the answer"),
            ("dshim_ctl_disable", "Stop answering for me here"),
        ]
        assert buttons[0]["value"] == f"stop|{fake.general}|-"
        await fake.user_message(fake.general, f"echo:slow 60 a long one <@{OWNER}>")
        await until(lambda: len(bot.events.prompts) == 2)
        # Bob is no operator: refused, nothing stops.
        await fake.press_button(notice, 0, user=fake.other_user)
        await fake.wait_until(lambda: len(notice.edits) == 1)
        assert notice.text.endswith("→ Only the bot's operators may use these buttons.")
        await fake.press_button(notice, 0, user=OPS)
        await fake.wait_until(lambda: len(notice.edits) == 2)
        assert notice.text.endswith("for you in that chat.\n\n→ Stopped the answer.")
        await fake.wait_until(lambda: len(answers(fake)) == 2)
        assert answers(fake)[1].text.endswith("⏹ Stopped.")
        await fake.press_button(notice, 1, user=OPS)
        await fake.wait_until(lambda: len(notice.edits) == 3)
        assert "→ Substitute mode is off in that chat" in notice.text
        assert len(control_buttons(notice)) == 2  # still there for the other action
        # Off in that chat: the next trigger is an unaddressed message, not a turn.
        await fake.user_message(fake.general, f"and now? <@{OWNER}>")
        await trio.sleep(5)
    assert len(bot.events.prompts) == 2
    assert bot.drop_reasons()[-1] == "unaddressed"
    presses = [c for c in fake.calls_to("chat.update") if c.args["channel"] == dm]
    assert len(presses) == 3


async def test_a_trigger_inside_a_thread_is_answered_in_that_thread(
    tmp_path: Any, autojump_clock: object
) -> None:
    options = {"substitute": {**SUB, "topic_groups": True}}
    async with running_bot(tmp_path, configure=add_people, **options) as (bot, fake):
        root = await fake.user_message(fake.general, "release notes are up", user=fake.other_user)
        await fake.user_message(
            fake.general, f"<@{OWNER}> ok to ship?", thread_ts=root["ts"], user=fake.user
        )
        await fake.wait_until(lambda: len(answers(fake)) == 1)
        await trio.sleep(3)
    [answer] = answers(fake)
    assert answer.thread_ts == root["ts"]  # the thread root is the anchor
    assert answer.text.startswith(f"<@{fake.user}> ") and "ok to ship?" in answer.text


async def test_a_streamed_substitute_answer_keeps_the_askers_mention_through_edits(
    tmp_path: Any, autojump_clock: object
) -> None:
    options = {"substitute": {**SUB, "stream": True, "reply_mode": "quote"}}
    async with running_bot(tmp_path, configure=add_people, **options) as (bot, fake):
        trigger = await fake.user_message(fake.general, f"echo:slow 12 status? <@{OWNER}>")
        await fake.wait_until(lambda: bool(answers(fake)) and bool(answers(fake)[0].edits))
        await trio.sleep(15)
    [answer] = answers(fake)
    assert fake.calls_to("chat.startStream") == []  # chat.postMessage, then chat.update
    assert len(answer.shown) >= 3
    link = permalink(fake, trigger["ts"])
    for shown in answer.shown:
        assert shown.startswith(f"<@{fake.user}> ") and shown.endswith(link)
    assert answer.thread_ts is None and "status?" in answer.text


async def test_a_top_level_mention_is_no_thread_message_for_topic_groups_false(
    tmp_path: Any, autojump_clock: object
) -> None:
    # The bot answers a top-level mention in the message's own thread (thread_id = its
    # ts), but the message itself was written in the channel: topic_groups = false does
    # not apply to it, to its /substitute command, nor to the operators' notice.
    options = {"substitute": {**SUB, "topic_groups": False}, "access": ACCESS}
    async with running_bot(tmp_path, configure=add_people, **options) as (bot, fake):
        await fake.user_message(fake.general, f"<@{BOT}> /substitute status")
        await fake.wait_until(lambda: len(answers(fake)) == 1)
        assert "topic_groups = false" not in answers(fake)[0].text
        trigger = await fake.user_message(fake.general, f"<@{BOT}> <@{OWNER}> is prod down?")
        await until(lambda: len(bot.events.prompts) == 1)
        await fake.wait_until(lambda: OPS in fake.dm_channels)
        await fake.wait_until(lambda: len(answers(fake)) == 2)
        await trio.sleep(3)
    assert "<dsh_im_substitute>" in bot.events.prompts[0]
    assert answers(fake)[1].thread_ts == trigger["ts"]
