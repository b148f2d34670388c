"""The Discord :class:`~tests.channel_contract.ChannelRig`: the fake REST API and gateway."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from dshim.channels.base import Channel
from dshim.channels.discord import channel as discord_channel
from dshim.testing.fakes.discord import FakeDiscord, open_fake_discord
from tests.channel_contract import Answer

CREATE = "POST /channels/{channel_id}/messages"
EDIT = "PATCH /channels/{channel_id}/messages/{message_id}"


class DiscordRig:
    """Discord under the shared scenarios (see ``tests/channel_contract.py``)."""

    def __init__(self) -> None:
        self._fake: FakeDiscord | None = None
        self._channel = dataclasses.replace(
            discord_channel.CHANNEL,
            run_fn=functools.partial(discord_channel.run, rng=random.Random(11)),
        )

    @property
    def fake(self) -> FakeDiscord:
        assert self._fake is not None, "use the rig inside rig.open()"
        return self._fake

    @property
    def channel(self) -> Channel:
        return self._channel

    @property
    def secret(self) -> str:
        return self.fake.token

    @property
    def bot_author(self) -> tuple[str, str]:
        user = self.fake.bot_user
        return str(user["id"]), str(user.get("global_name") or user["username"])

    @asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        async with open_fake_discord() as fake:
            self._fake = fake
            yield

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        return {
            "token": self.fake.token if valid_credentials else "a-token-discord-does-not-know",
            "api_base": self.fake.api_base,
            "gateway_url": self.fake.gateway_url,
        }

    async def receiving(self) -> None:
        await self.fake.wait_until(lambda: self._live_and_ready())

    def _live_and_ready(self) -> bool:
        conn = self.fake.live
        return conn is not None and conn.authenticated

    def source(self, kind: str) -> str:
        user = self.fake.user
        block = {
            "channel": "discord",
            "conversationType": kind,
            "senderId": user["id"],
            "senderName": user.get("global_name") or user["username"],
        }
        return "<dsh_im_source>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_source>"

    async def user_dm(self, text: str, *, reply_to: str | None = None) -> str:
        sent = await self.fake.user_message(self.fake.dm_channel, text, reply_to=reply_to)
        return str(sent["id"])

    async def user_group(self, text: str, *, mention: bool) -> str:
        sent = await self.fake.user_message(self.fake.text_channel, text, mention_bot=mention)
        return str(sent["id"])

    def dm_answers(self) -> list[Answer]:
        return [
            Answer(str(m["id"]), str(m["content"]), tuple(self.fake.edits.get(m["id"], [])))
            for m in self.fake.bot_messages(self.fake.dm_channel)
        ]

    def calls_besides_receiving(self) -> list[str]:
        # The gateway (and GET /gateway/bot, which finds it) is receiving; REST is the rest.
        return [
            f"{c.method} {c.path}" for c in self.fake.calls if not c.path.startswith("/gateway")
        ]

    def identity_calls(self) -> int:
        return len(self.fake.calls_to("GET", "/users/@me"))

    async def drop_connection(self) -> None:
        conn = self.fake.live
        await self.fake.drop_connection()
        if conn is not None:
            await self.fake.wait_until(lambda: conn.closed_by is not None)

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        self.fake.rate_limit(method="POST", route=r"/messages$", count=1, retry_after=retry_after)
        self.fake.rate_limit(method="PATCH", count=count, retry_after=retry_after)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        await self.fake.wait_until(predicate)
