"""The fault matrix on Discord: a 10-second outage while 20 users wait for answers.

The bot runs through serve_bots against the fake Discord (127.0.0.1, autojump clock, real
SQLite store, echo harness; see ``tests/test_discord_e2e.py``).  The fake's ``outage``
makes every REST call (or only the creates and edits of messages) fail for 10 s --
answered with a 500, dropped before it is processed, or processed with its answer lost;
the gateway stays up, as it does when Discord's API has trouble.  What the users see is
counted: every answer arrives exactly once.  Creates carry a ``nonce`` with
``enforce_nonce``, so even a create whose answer was lost is repeated without a second
copy; the bot never restarts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.discord.client import USER_AGENT, RestClient
from dshim.channels.discord.render import DiscordTransport
from dshim.errors import TransportError
from dshim.model import ReplyTarget
from dshim.net.http import open_http
from dshim.testing.fakes.discord import FakeDiscord, open_fake_discord, snowflake
from tests.fault_matrix import matrix, restarts
from tests.rig_discord import DEADLINE, running_bot, source

CREATE = "POST /channels/{channel_id}/messages"
EDIT = "PATCH /channels/{channel_id}/messages/{message_id}"
SENDS = (CREATE, EDIT)
MATRIX = matrix(SENDS)


def question(user: dict[str, Any]) -> str:
    return f"echo:sleep 2 question of {user['username']}"


def answer_of(user: dict[str, Any], text: str) -> str:
    return f"{source(user, 'direct')}\n\n{text}"


def dm_with(fake: FakeDiscord, user: dict[str, Any]) -> str:
    """A DM channel between ``user`` and the bot."""
    channel_id = snowflake()
    fake.channels[channel_id] = {"id": channel_id, "type": 1}
    fake.dm_channels[str(user["id"])] = channel_id
    return channel_id


def shown(fake: FakeDiscord, channel_id: str) -> list[str]:
    return [m["content"] for m in fake.bot_messages(channel_id)]


async def ask_everyone(fake: FakeDiscord) -> list[tuple[dict[str, Any], str]]:
    people = []
    for i in range(20):
        user = fake.make_user(f"user{i:02d}")
        channel_id = dm_with(fake, user)
        await fake.user_message(channel_id, question(user), author=user)
        people.append((user, channel_id))
    return people


def answered(fake: FakeDiscord, people: list[tuple[dict[str, Any], str]]) -> bool:
    return all(answer_of(u, question(u)) in shown(fake, c) for u, c in people)


@pytest.mark.parametrize(("kind", "ops"), [*MATRIX, ("lost", SENDS)])
async def test_a_ten_second_outage_loses_no_answer_and_doubles_none(
    tmp_path: Path, autojump_clock: trio.abc.Clock, kind: str, ops: tuple[str, ...]
) -> None:
    with capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            people = await ask_everyone(fake)
            await trio.sleep(0.5)
            fake.outage(10.0, kind, ops)
            await fake.wait_until(lambda: answered(fake, people))
            await trio.sleep(300)  # every retry the bot would make has happened
    for user, channel_id in people:
        # Lost answers too: the repeated create carries the same nonce (enforce_nonce).
        assert shown(fake, channel_id) == [answer_of(user, question(user))]
    assert len(fake.calls_to("POST", "/channels/")) > len(people)  # the outage hit sends
    assert restarts(logs) == []
    assert [e for e in logs if e["event"] == "answer_postponed"] == []


async def test_an_outage_longer_than_the_retries_delivers_from_the_outbox_when_back(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            fake.outage(300.0, "500", (CREATE,))
            await fake.user_message(fake.dm_channel, "echo:sleep 2 are you there?")
            await trio.sleep(250)
            assert shown(fake, fake.dm_channel) == []  # still down, nothing given up
            await fake.wait_until(lambda: len(shown(fake, fake.dm_channel)) >= 1)
            await trio.sleep(120)
    assert shown(fake, fake.dm_channel) == [answer_of(fake.user, "echo:sleep 2 are you there?")]
    assert [e["event"] for e in logs if e["event"] == "answer_postponed"] == ["answer_postponed"]
    assert restarts(logs) == []


async def test_the_transport_probes_discord_with_its_identity_call() -> None:
    with trio.fail_after(DEADLINE):
        async with (
            open_fake_discord() as fake,
            open_http(fake.api_base, user_agent=USER_AGENT) as http,
        ):
            rest = RestClient(http, token=fake.token, api_base=fake.api_base)
            transport = DiscordTransport(
                rest, ReplyTarget(conversation_id=fake.dm_channel, conversation_type="direct")
            )
            await transport.reachable()
            assert [c.path for c in fake.calls] == ["/users/@me"]
            fake.outage(5.0, "drop")
            with pytest.raises(TransportError):
                await transport.reachable()
