"""The Feishu :class:`~tests.channel_contract.ChannelRig`: the fake Open API and long connection."""

from __future__ import annotations

import functools
from typing import Any

from dshim.channels.feishu import channel as feishu_channel
from dshim.testing.fakes.feishu import FakeFeishu, open_fake_feishu
from tests.channel_contract import Answer
from tests.rigkit import FakeRig, im_source, seeded

CARD_CONTENT = "PUT /open-apis/cardkit/v1/cards/{card_id}/elements/{element_id}/content"
REPLY = "POST /open-apis/im/v1/messages/{message_id}/reply"
#: Receiving, not answering: the token, the endpoint and the identity.
RECEIVING = ("/callback/ws/endpoint", "/open-apis/auth/", "/open-apis/bot/v3/info")


class FeishuRig(FakeRig[FakeFeishu]):
    """Feishu under the shared scenarios (see ``tests/channel_contract.py``)."""

    def __init__(self, **fake_options: Any) -> None:
        opener = functools.partial(open_fake_feishu, **fake_options)
        super().__init__(seeded(feishu_channel, 11), opener)

    @property
    def secret(self) -> str:
        return self.fake.app_secret

    @property
    def bot_author(self) -> tuple[str, str]:
        return self.fake.bot_open_id, self.fake.bot_name

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        return {
            "app_id": self.fake.app_id,
            "app_secret": self.fake.app_secret if valid_credentials else "not-the-app-secret",
            "api_base": self.fake.api_base,
        }

    def connected(self) -> bool:
        return self.fake.live is not None and self.fake.live.pings > 0

    def source(self, kind: str) -> str:
        return im_source("feishu", kind, self.fake.user["open_id"])

    async def user_dm(self, text: str, *, reply_to: str | None = None) -> str:
        sent = await self.fake.user_message(self.fake.dm_chat, text, reply_to=reply_to)
        return str(sent["message_id"])

    async def user_group(self, text: str, *, mention: bool) -> str:
        sent = await self.fake.user_message(self.fake.group_chat, text, mention_bot=mention)
        return str(sent["message_id"])

    def dm_answers(self) -> list[Answer]:
        return [
            Answer(b.message_id, b.text, tuple(b.shown))
            for b in self.fake.bot_messages(self.fake.dm_chat)
        ]

    def calls_besides_receiving(self) -> list[str]:
        return [c.op for c in self.fake.calls if not c.path.startswith(RECEIVING)]

    def identity_calls(self) -> int:
        return self.fake.token_requests

    async def drop_connection(self) -> None:
        await self.fake.drop_connection()

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        self.fake.fail_next(REPLY, 1, status=429, retry_after=retry_after)
        self.fake.fail_next(CARD_CONTENT, count, status=429, retry_after=retry_after)
