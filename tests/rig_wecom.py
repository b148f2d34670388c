"""The WeCom :class:`~tests.channel_contract.ChannelRig`: the fake long connection."""

from __future__ import annotations

from typing import Any

from dshim.channels.base import Channel
from dshim.channels.wecom import channel as wecom_channel
from dshim.channels.wecom.client import LinkTuning
from dshim.channels.wecom.protocol import MARKS
from dshim.testing.fakes.wecom import FakeWecom, open_fake_wecom
from tests.channel_contract import Answer, quote_block
from tests.rigkit import FakeRig, im_source, seeded

RESPOND = "aibot_respond_msg"
SEND = "aibot_send_msg"
#: Frames that only keep the connection (everything else is a call "for" a message).
RECEIVING = ("aibot_subscribe", "ping")


def wecom_under_test(**tuning: Any) -> Channel:
    """The channel with a fixed jitter seed (and optional link timings)."""
    return seeded(wecom_channel, 14, tuning=LinkTuning(**tuning))


class WecomRig(FakeRig[FakeWecom]):
    """WeCom under the shared scenarios (see ``tests/channel_contract.py``)."""

    def __init__(self, extra: dict[str, Any] | None = None, **tuning: Any) -> None:
        """``extra``: more ``[[bots]]`` keys; ``tuning``: link timings."""
        super().__init__(wecom_under_test(**tuning), open_fake_wecom)
        self.extra = extra or {}

    @property
    def secret(self) -> str:
        return self.fake.secret

    @property
    def bot_author(self) -> tuple[str, str]:
        return self.fake.bot_id, "dshim"

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        return {
            "bot_id": self.fake.bot_id,
            "secret": self.fake.secret if valid_credentials else "a-secret-wecom-does-not-know",
            "ws_url": self.fake.ws_url,
            **self.extra,
        }

    def source(self, kind: str) -> str:
        return im_source("wecom", kind, self.fake.user_id)

    def quote_block(self, message_id: str, content: str) -> str:
        """WeCom quotes carry content only: no id, author or time (never guessed)."""
        del message_id
        return quote_block(content=content)

    async def user_dm(self, text: str, *, reply_to: str | None = None) -> str:
        quote = None
        if reply_to is not None:
            [quoted] = [a for a in self.dm_answers() if a.id == reply_to]
            quote = {"msgtype": "text", "text": {"content": quoted.text}}
        body = await self.fake.user_message(text, quote=quote)
        return str(body["msgid"])

    async def user_group(self, text: str, *, mention: bool) -> str:
        if not mention:
            # WeCom delivers group messages only when they @-mention the bot: nothing
            # reaches the bot, which is what "no call at all" rests on.
            return "not-delivered"
        body = await self.fake.user_message(text, chattype="group", mention=True)
        return str(body["msgid"])

    def dm_answers(self) -> list[Answer]:
        # The thinking marker is the typing indicator's stand-in, not answer text; a
        # bubble that ends as a marker (cut off by a lost socket) shows no answer.
        return [
            Answer(a.id, a.text, tuple(t for t in a.shown if t not in MARKS))
            for a in self.fake.answers(self.fake.user_id)
            if a.text not in MARKS
        ]

    def calls_besides_receiving(self) -> list[str]:
        return [f"{f.cmd} {f.req_id}" for f in self.fake.calls if f.cmd not in RECEIVING]

    def identity_calls(self) -> int:
        return len(self.fake.subscribes)

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        del retry_after  # WeCom's limit errcode carries no retry-after
        self.fake.fail_next(RESPOND, count, status=45009, description="api freq out of limit")
