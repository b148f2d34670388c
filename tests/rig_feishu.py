"""The Feishu :class:`~tests.channel_contract.ChannelRig`: the fake Open API and long connection."""

from __future__ import annotations

import functools
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from dshim.channels.feishu import channel as feishu_channel
from dshim.harness.base import TurnContext
from dshim.harness.echo import EchoHarness
from dshim.model import PromptPart, TurnEvent
from dshim.testing.fakes.feishu import FakeFeishu, open_fake_feishu
from tests.channel_contract import Answer
from tests.rigkit import Bot, Configure, FakeRig, bot_on_fake, im_source, seeded

DEADLINE = 900.0
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
        return source(self.fake, kind)

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


# --- the e2e bot --------------------------------------------------------------------------------

SEEDED = seeded(feishu_channel, 3)


def source(fake: FakeFeishu, kind: str = "direct", user: dict[str, str] | None = None) -> str:
    """The ``<dsh_im_source>`` block of the test user (or ``user``)."""
    return im_source("feishu", kind, (user or fake.user)["open_id"])


class SessionsHarness(EchoHarness):
    """The echo harness, remembering the session each prompt went to."""

    def __init__(self, *, slow_interval_s: float) -> None:
        super().__init__(slow_interval_s=slow_interval_s)
        self.sessions: list[str] = []

    def prompt(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        self.sessions.append(session_id)
        return super().prompt(session_id, parts, ctx)


@asynccontextmanager
async def running_bot(
    tmp_path: Path,
    *,
    configure: Configure[FakeFeishu] = None,
    deadline: float = DEADLINE,
    **options: Any,
) -> AsyncIterator[tuple[Bot, FakeFeishu]]:
    """The bot (``serve_bots``, a real store, a :class:`SessionsHarness`) against a fresh
    fake, within ``deadline``, once the long connection is up (``configure`` sets the
    fake's knobs first; ``options`` are ``[[bots]]`` keys)."""

    def bot_table(fake: FakeFeishu) -> dict[str, Any]:
        keys = {"app_id": fake.app_id, "app_secret": fake.app_secret, "api_base": fake.api_base}
        return {"name": "fs", "channel": "feishu", **keys, **options}

    async with bot_on_fake(
        open_fake_feishu,
        bot_table,
        SEEDED,
        tmp_path,
        harness=SessionsHarness(slow_interval_s=0.4),
        deadline=deadline,
        ready=lambda fake: fake.live is not None and fake.live.pings > 0,
        configure=configure,
    ) as started:
        yield started
