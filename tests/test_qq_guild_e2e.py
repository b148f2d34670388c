"""End to end: QQ guilds (频道) -- quotes of guild messages, guild DMs, ``guild_messages``.

The real QQ channel, run by ``serve_bots``, against the fake QQ; see ``tests/rig_qq.py``
for the testing manifesto (127.0.0.1, autojump clock, real SQLite store, echo harness).
A guild quote carries ``message_reference.message_id`` (a message id, not a REFIDX): the
bot resolves it from its message index, else with one ``GET
/channels/{channel_id}/messages/{message_id}`` inside the turn; guild DMs have no such
lookup.
"""

from __future__ import annotations

import json
from pathlib import Path

import trio

from dshim.testing.fakes.qq import GUILD_MESSAGES, FakeQQ
from tests.channel_contract import REPLY_NOTE
from tests.rig_qq import running_bot

LOOKUP = "GET /channels/{channel_id}/messages/{message_id}"


def guild_source(fake: FakeQQ, name: str | None = "Ada L") -> str:
    block = {"channel": "qq", "conversationType": "group", "senderId": fake.guild_user["id"]}
    if name:
        block["senderName"] = name
    return "<dsh_im_source>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_source>"


def dm_source(fake: FakeQQ) -> str:
    block = {
        "channel": "qq",
        "conversationType": "direct",
        "senderId": fake.guild_user["id"],
        "senderName": fake.guild_user["username"],
    }
    return "<dsh_im_source>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_source>"


def block(**fields: object) -> str:
    body = {"note": REPLY_NOTE, **fields}
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f"<dsh_im_reply_to>{text}</dsh_im_reply_to>"


def approve(fake: FakeQQ) -> None:
    """The bot may subscribe ``guild_messages`` (a private-domain bot's intent)."""
    fake.approved_intents |= GUILD_MESSAGES


def channel_of(fake: FakeQQ) -> str:
    return f"channel:{fake.channel_id}"


def lookups(fake: FakeQQ) -> list[str]:
    return [c.path for c in fake.calls_to("GET", "/channels/")]


def prompt_ending(prompts: list[str], text: str) -> str:
    [found] = [p for p in prompts if p.endswith("\n\n" + text)]
    return found


# --- guild channel quotes ---------------------------------------------------------------------


async def test_a_guild_quote_of_a_message_the_bot_saw_is_resolved_from_its_index(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        first = await fake.guild_message("the deploy is at 5 pm")
        await fake.wait_until(lambda: len(fake.bot_messages(channel_of(fake))) == 1)
        [answer] = fake.bot_messages(channel_of(fake))
        await fake.guild_message("when was it?", reply_to=first["id"])
        await fake.guild_message("and you said?", reply_to=answer.id)
        await fake.wait_until(lambda: len(fake.bot_messages(channel_of(fake))) == 3)
    user_quote = block(
        messageId=first["id"],
        authorId=fake.guild_user["id"],
        authorName="Ada L",
        content="the deploy is at 5 pm",
        attachments=[],
        truncated=False,
    )
    assert prompt_ending(bot.events.prompts, "when was it?") == "\n\n".join(
        [guild_source(fake), user_quote, "when was it?"]
    )
    bot_quote = block(
        messageId=answer.id,
        authorId=fake.bot_user["id"],
        authorName=fake.bot_user["username"],
        content=answer.content,
        attachments=[],
        truncated=False,
    )
    assert bot_quote in prompt_ending(bot.events.prompts, "and you said?")
    assert lookups(fake) == []  # both known: no request


async def test_a_guild_quote_the_bot_never_saw_is_fetched_once_in_either_answer_form(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    bob = {"id": "14451342099999999999", "username": "bob", "bot": False}
    async with running_bot(tmp_path) as (bot, fake):
        plan = fake.guild_post(
            "<@!14451342012345678901> meeting moved to Friday",
            author=bob,
            nick="Bobby",
            attachments=[
                {
                    "content_type": "image/png",
                    "filename": "plan.png",
                    "url": "gchat.qpic.cn/qmeetpic/0/plan.png",
                    "width": 640,
                    "height": 480,
                    "size": 2048,
                }
            ],
        )
        await fake.guild_message("what did he say?", reply_to=plan["id"])
        await fake.wait_until(lambda: len(fake.bot_messages(channel_of(fake))) == 1)
        fake.wrap_fetched_message = False  # the bare message object (bot-docs' example)
        old = fake.guild_post("the old plan", author=bob, nick=None)
        await fake.guild_message("and before?", reply_to=old["id"])
        await fake.wait_until(lambda: len(fake.bot_messages(channel_of(fake))) == 2)
    assert lookups(fake) == [
        f"/channels/{fake.channel_id}/messages/{plan['id']}",
        f"/channels/{fake.channel_id}/messages/{old['id']}",
    ]
    fetched = block(
        messageId=plan["id"],
        authorId=bob["id"],
        authorName="Bobby",
        content="<@!14451342012345678901> meeting moved to Friday",
        attachments=[{"kind": "image", "name": "plan.png"}],
        truncated=False,
    )
    assert prompt_ending(bot.events.prompts, "what did he say?") == "\n\n".join(
        [guild_source(fake), fetched, "what did he say?"]
    )
    bare = block(
        messageId=old["id"],
        authorId=bob["id"],
        authorName="bob",
        content="the old plan",
        attachments=[],
        truncated=False,
    )
    assert bare in prompt_ending(bot.events.prompts, "and before?")


async def test_a_failed_guild_lookup_gives_the_reason_and_the_question_is_still_answered(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        await fake.guild_message("and this one?", reply_to="08unknownmessage00")
        await fake.wait_until(lambda: len(fake.bot_messages(channel_of(fake))) == 1)
        fake.forbidden_lookup = True
        hidden = fake.guild_post("hidden text")
        await fake.guild_message("and the hidden one?", reply_to=hidden["id"])
        await fake.wait_until(lambda: len(fake.bot_messages(channel_of(fake))) == 2)
        fake.forbidden_lookup = False
        broken = fake.guild_post("broken text")
        fake.fail_next(LOOKUP, 1, status=500, code=50001)
        await fake.guild_message("and the broken one?", reply_to=broken["id"])
        await fake.wait_until(lambda: len(fake.bot_messages(channel_of(fake))) == 3)
        slow = fake.guild_post("slow text")
        fake.slow_next(LOOKUP, 30.0)
        t0 = trio.current_time()
        await fake.guild_message("and the slow one?", reply_to=slow["id"])
        await fake.wait_until(lambda: len(fake.bot_messages(channel_of(fake))) == 4)
        answered_in = trio.current_time() - t0
        await trio.sleep(30)  # the slow lookup's answer comes (and is recorded), unread
    reasons = {
        "and this one?": ("08unknownmessage00", "not-found"),
        "and the hidden one?": (hidden["id"], "permission-denied"),
        "and the broken one?": (broken["id"], "not-delivered"),
        "and the slow one?": (slow["id"], "not-delivered"),
    }
    for text, (message_id, reason) in reasons.items():
        expected = block(
            messageId=message_id, attachments=[], unavailableReason=reason, truncated=False
        )
        assert prompt_ending(bot.events.prompts, text) == "\n\n".join(
            [guild_source(fake), expected, text]
        )
    assert len(lookups(fake)) == 4  # one request per quote, never retried
    assert answered_in < 10.0  # the 5 s lookup budget, not the platform's 30 s
    assert all(m.content.endswith("?") for m in fake.bot_messages(channel_of(fake)))


async def test_an_unaddressed_guild_message_never_looks_its_quote_up(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path, configure=approve, intents=["guild_messages"]) as (bot, fake):
        other = fake.guild_post("something")
        await fake.guild_message(
            "just chatting", event="MESSAGE_CREATE", mention=False, reply_to=other["id"]
        )
        await fake.wait_until(lambda: "unaddressed" in [r for _, r in bot.events.drops])
        await trio.sleep(5)
    assert lookups(fake) == [] and bot.events.prompts == []


# --- guild DMs ----------------------------------------------------------------------------------


async def test_a_guild_dm_quote_comes_from_the_index_or_is_unsupported_never_fetched(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        dms = f"dms:{fake.dms_guild_id}"
        first = await fake.direct_message("my ticket is 4711")
        await fake.wait_until(lambda: len(fake.bot_messages(dms)) == 1)
        await fake.direct_message("which ticket?", reply_to=first["id"])
        await fake.direct_message("and that?", reply_to="08dmsneverseen00")
        await fake.wait_until(lambda: len(fake.bot_messages(dms)) == 3)
    known = block(
        messageId=first["id"],
        authorId=fake.guild_user["id"],
        authorName=fake.guild_user["username"],
        content="my ticket is 4711",
        attachments=[],
        truncated=False,
    )
    assert prompt_ending(bot.events.prompts, "which ticket?") == "\n\n".join(
        [dm_source(fake), known, "which ticket?"]
    )
    unknown = block(
        messageId="08dmsneverseen00",
        attachments=[],
        unavailableReason="unsupported",
        truncated=False,
    )
    assert unknown in prompt_ending(bot.events.prompts, "and that?")
    assert lookups(fake) == [] and fake.calls_to("GET", "/dms/") == []


# --- the guild_messages intent (MESSAGE_CREATE) ---------------------------------------------------


async def test_with_guild_messages_a_mention_is_answered_and_other_messages_are_only_seen(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path, configure=approve, intents=["guild_messages"]) as (bot, fake):
        plain = await fake.guild_message("just chatting", event="MESSAGE_CREATE", mention=False)
        asked = await fake.guild_message("status?", event="MESSAGE_CREATE")
        await fake.wait_until(lambda: len(fake.bot_messages(channel_of(fake))) == 1)
        # the bot's own answer came back as a MESSAGE_CREATE: seen, never answered
        await fake.wait_until(lambda: "echo" in [r for _, r in bot.events.drops])
        await trio.sleep(30)
    assert fake.identifies[-1]["intents"] == GUILD_MESSAGES
    [answer] = fake.bot_messages(channel_of(fake))
    assert answer.msg_id == asked["id"]
    assert answer.content == "\n\n".join([guild_source(fake), "status?"])
    assert (plain["id"], "unaddressed") in bot.events.drops
    assert (answer.id, "echo") in bot.events.drops
    assert len(bot.events.prompts) == 1


async def test_with_both_guild_intents_a_mention_delivered_twice_is_answered_once(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    intents = ["public_guild_messages", "guild_messages"]
    async with running_bot(tmp_path, configure=approve, intents=intents) as (bot, fake):
        d = await fake.guild_message("once please")  # AT_MESSAGE_CREATE
        await fake.dispatch("MESSAGE_CREATE", d)  # QQ sends the same message again
        await fake.wait_until(lambda: len(fake.bot_messages(channel_of(fake))) == 1)
        await trio.sleep(30)
    [answer] = fake.bot_messages(channel_of(fake))
    assert answer.msg_id == d["id"] and len(bot.events.prompts) == 1
    assert (d["id"], "duplicate") in bot.events.drops
