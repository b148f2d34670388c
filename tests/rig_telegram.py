"""The Telegram :class:`~tests.channel_contract.ChannelRig`: the fake Bot API on 127.0.0.1."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from dshim.channels.base import Channel
from dshim.channels.telegram.channel import CHANNEL
from dshim.testing.fakes.telegram import TEST_TOKEN, FakeTelegram, open_fake_telegram
from tests.channel_contract import Answer
from tests.helpers import Clock

ADA = FakeTelegram.user(42, "Ada", "Lovelace", "ada")
GROUP_ID = -1001234567890
#: Calls that only receive (long polls): everything else is a call "for" a message.
RECEIVING = ("getUpdates",)


class TelegramRig:
    """Telegram under the shared scenarios (see ``tests/channel_contract.py``)."""

    channel: Channel = CHANNEL
    secret = TEST_TOKEN

    def __init__(self) -> None:
        self._fake: FakeTelegram | None = None

    @property
    def fake(self) -> FakeTelegram:
        assert self._fake is not None, "use the rig inside rig.open()"
        return self._fake

    @property
    def bot_author(self) -> tuple[str, str]:
        return str(self.fake.bot["id"]), str(self.fake.bot["first_name"])

    @asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        async with open_fake_telegram(clock=Clock()) as fake:
            self._fake = fake
            fake.private_chat(ADA)
            fake.group_chat(GROUP_ID, "Research")
            yield

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        token = TEST_TOKEN if valid_credentials else "123456:a-token-telegram-does-not-know"
        return {"token": token, "api_base": self.fake.url}

    async def receiving(self) -> None:
        # A poll in flight that started after the last one ended: the bot is up and reading.
        start = len(self.fake.calls_to(*RECEIVING))
        await self.fake.wait_until(
            lambda: any(c.status == 0 for c in self.fake.calls_to(*RECEIVING)[start:])
        )

    def source(self, kind: str) -> str:
        block = {
            "channel": "telegram",
            "conversationType": kind,
            "senderId": str(ADA["id"]),
            "senderName": "Ada Lovelace",
        }
        return "<dsh_im_source>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_source>"

    async def user_dm(self, text: str, *, reply_to: str | None = None) -> str:
        chat = self.fake.chats[int(ADA["id"])].data
        sent = self.fake.user_message(
            chat, ADA, text, reply_to=int(reply_to) if reply_to is not None else None
        )
        return str(sent["message_id"])

    async def user_group(self, text: str, *, mention: bool) -> str:
        chat = self.fake.chats[GROUP_ID].data
        body = f"@{self.fake.bot['username']} {text}" if mention else text
        return str(self.fake.user_message(chat, ADA, body)["message_id"])

    def dm_answers(self) -> list[Answer]:
        return [
            Answer(str(m.message_id), m.text, tuple(m.history))
            for m in self.fake.bot_messages(int(ADA["id"]))
        ]

    def calls_besides_receiving(self) -> list[str]:
        return [c.method for c in self.fake.calls_except(*RECEIVING)]

    def identity_calls(self) -> int:
        return len(self.fake.calls_to("getMe"))

    async def drop_connection(self) -> None:
        # The poll in flight is answered by nothing: its connection closes.
        self.fake.drop_polls()

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        self.fake.fail_next("sendMessage", count // 4 or 1, status=429, retry_after=retry_after)
        self.fake.fail_next("editMessageText", count, status=429, retry_after=retry_after)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        await self.fake.wait_until(predicate)
