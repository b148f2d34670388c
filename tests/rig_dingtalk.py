"""The DingTalk :class:`~tests.channel_contract.ChannelRig`: the fake OpenAPI and Stream."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from dshim.channels.base import Channel
from dshim.channels.dingtalk import channel as dingtalk_channel
from dshim.testing.fakes.dingtalk import FakeDingTalk, open_fake_dingtalk
from tests.channel_contract import Answer

#: Receiving: the token (identity), Stream registration; everything else is answering.
RECEIVING = ("/v1.0/oauth2/accessToken", "/v1.0/gateway/connections/open")


class DingTalkRig:
    """DingTalk under the shared scenarios (see ``tests/channel_contract.py``)."""

    def __init__(self) -> None:
        self._fake: FakeDingTalk | None = None
        self._channel = dataclasses.replace(
            dingtalk_channel.CHANNEL,
            run_fn=functools.partial(dingtalk_channel.run, rng=random.Random(13)),
        )

    @property
    def fake(self) -> FakeDingTalk:
        assert self._fake is not None, "use the rig inside rig.open()"
        return self._fake

    @property
    def channel(self) -> Channel:
        return self._channel

    @property
    def secret(self) -> str:
        return self.fake.client_secret

    @property
    def bot_author(self) -> tuple[str, str]:
        return self.fake.chatbot_user_id, self.fake.bot_name

    @asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        async with open_fake_dingtalk() as fake:
            self._fake = fake
            yield

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        return {
            "client_id": self.fake.client_id,
            "client_secret": self.fake.client_secret if valid_credentials else "not-the-secret",
            "api_base": self.fake.api_base,
            "oapi_base": self.fake.api_base,
        }

    async def receiving(self) -> None:
        await self.fake.wait_until(lambda: self.fake.live is not None)

    def source(self, kind: str) -> str:
        block = {
            "channel": "dingtalk",
            "conversationType": kind,
            "senderId": self.fake.user["staff_id"],
            "senderName": self.fake.user["nick"],
        }
        return "<dsh_im_source>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_source>"

    async def user_dm(self, text: str, *, reply_to: str | None = None) -> str:
        msg = self.fake.user_message(self.fake.dm_conversation, text, reply_to=reply_to)
        return str(msg["msgId"])

    async def user_group(self, text: str, *, mention: bool) -> str:
        msg = self.fake.user_message(self.fake.group_conversation, text, mention=mention)
        return str(msg["msgId"])

    def dm_answers(self) -> list[Answer]:
        return [
            Answer(m.id, m.text, tuple(m.shown))
            for m in self.fake.bot_messages(self.fake.dm_conversation)
        ]

    def calls_besides_receiving(self) -> list[str]:
        return [c.op for c in self.fake.calls if c.path not in RECEIVING]

    def identity_calls(self) -> int:
        return self.fake.token_requests()

    async def drop_connection(self) -> None:
        conn = self.fake.live
        await self.fake.drop_connection()
        if conn is not None:
            await self.fake.wait_until(lambda: conn.closed_by is not None)

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        self.fake.fail_next("PUT /v1.0/card/streaming", count, status=429, retry_after=retry_after)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        await self.fake.wait_until(predicate)
