"""The DingTalk :class:`~tests.channel_contract.ChannelRig`: the fake OpenAPI and Stream."""

from __future__ import annotations

from typing import Any

from dshim.channels.dingtalk import channel as dingtalk_channel
from dshim.testing.fakes.dingtalk import FakeDingTalk, open_fake_dingtalk
from tests.channel_contract import Answer
from tests.rigkit import FakeRig, im_source, seeded

#: Receiving: the token (identity), Stream registration; everything else is answering.
RECEIVING = ("/v1.0/oauth2/accessToken", "/v1.0/gateway/connections/open")


class DingTalkRig(FakeRig[FakeDingTalk]):
    """DingTalk under the shared scenarios (see ``tests/channel_contract.py``)."""

    def __init__(self) -> None:
        super().__init__(seeded(dingtalk_channel, 13), open_fake_dingtalk)

    @property
    def secret(self) -> str:
        return self.fake.client_secret

    @property
    def bot_author(self) -> tuple[str, str]:
        return self.fake.chatbot_user_id, self.fake.bot_name

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        return {
            "client_id": self.fake.client_id,
            "client_secret": self.fake.client_secret if valid_credentials else "not-the-secret",
            "api_base": self.fake.api_base,
            "oapi_base": self.fake.api_base,
        }

    def source(self, kind: str) -> str:
        user = self.fake.user
        return im_source("dingtalk", kind, user["staff_id"], user["nick"])

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

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        self.fake.fail_next("PUT /v1.0/card/streaming", count, status=429, retry_after=retry_after)
