"""Substitute mode on Discord end to end: the upstream bug (each of three triggers answered
under its own trigger while earlier ones run), in quote and thread mode, and a queued
trigger whose anchor was evicted answering with a plain message."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from dshim.pipeline.substitute import ANCHORS_PER_SESSION
from tests.test_discord_e2e import running_bot

OWNER_ID = "111111111111111111"
OWNER = {"id": OWNER_ID, "username": "olga", "global_name": "Olga"}


def options(mode: str, **more: Any) -> dict[str, Any]:
    return {
        "substitute": {"enabled": True, "reply_mode": mode, "targets": [{"id": OWNER_ID}]},
        **more,
    }


@pytest.mark.parametrize("mode", ["thread", "quote"])
async def test_each_trigger_is_answered_under_itself_while_earlier_ones_run(
    tmp_path: Path, autojump_clock: object, mode: str
) -> None:
    async with running_bot(tmp_path, **options(mode)) as (bot, fake):
        chan = fake.text_channel
        bob = fake.make_user("bob", global_name="Bob")
        a = await fake.user_message(
            chan, f"echo:slow 8 deploy? <@{OWNER_ID}>", mention_users=[OWNER]
        )
        await trio.sleep(0.5)  # A runs
        b = await fake.user_message(
            chan, f"merge? <@{OWNER_ID}>", author=bob, mention_users=[OWNER]
        )
        c = await fake.user_message(chan, f"staging? <@{OWNER_ID}>", mention_users=[OWNER])
        triggers = [a, b, c]

        def done() -> bool:
            if mode == "thread":
                return all(fake.bot_messages(t["id"]) for t in triggers)
            refs = {
                m.get("message_reference", {}).get("message_id") for m in fake.bot_messages(chan)
            }
            return all(t["id"] in refs for t in triggers)

        await fake.wait_until(done)
        await trio.sleep(5)
    for trigger, asker in ((a, fake.user), (b, bob), (c, fake.user)):
        if mode == "thread":
            [answer] = fake.bot_messages(trigger["id"])  # in the thread opened on it
        else:
            [answer] = [
                m
                for m in fake.bot_messages(chan)
                if m.get("message_reference", {}).get("message_id") == trigger["id"]
            ]
        assert answer["content"].startswith(f"<@{asker['id']}> ")
        assert trigger["content"].split(" <@")[0].removeprefix("echo:slow 8 ") in answer["content"]
    if mode == "quote":
        assert not any(t["id"] in fake.channels for t in triggers)  # no threads in quote mode


async def test_a_queued_trigger_whose_anchor_was_evicted_gets_a_plain_message(
    tmp_path: Path, autojump_clock: object
) -> None:
    n = ANCHORS_PER_SESSION
    async with running_bot(tmp_path, **options("quote", lanes={"max_queue": 64})) as (bot, fake):
        chan = fake.text_channel
        await fake.user_message(chan, f"echo:slow 60 blocker <@{OWNER_ID}>", mention_users=[OWNER])
        await trio.sleep(0.5)
        first = await fake.user_message(chan, f"queued first <@{OWNER_ID}>", mention_users=[OWNER])
        for i in range(n):
            await fake.user_message(chan, f"q{i} <@{OWNER_ID}>", mention_users=[OWNER])
        await fake.wait_until(lambda: len(fake.bot_messages(chan)) >= n + 2)
        await trio.sleep(5)
    plain = [m for m in fake.bot_messages(chan) if "queued first" in m["content"]]
    assert len(plain) == 1 and "message_reference" not in plain[0]  # evicted: plain
    refs = [m.get("message_reference", {}).get("message_id") for m in fake.bot_messages(chan)]
    assert first["id"] not in refs
