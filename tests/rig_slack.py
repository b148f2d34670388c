"""The Slack :class:`~tests.channel_contract.ChannelRig`: the fake Web API and Socket Mode.

Slack shows an answer's text with ``&``, ``<``, ``>`` decoded from the escaped form the
bot sends, so the rig reads the fake's texts unescaped, as a user sees them.  "Replying
to" one of the bot's answers is a thread reply under that message (``thread_ts`` = its
``ts``, ``parent_user_id`` = the bot): Slack's only reply gesture on a message.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from dshim.channels.base import Channel
from dshim.channels.slack import channel as slack_channel
from dshim.channels.slack.protocol import unescape
from dshim.testing.fakes.slack import FakeSlack, open_fake_slack
from tests.channel_contract import Answer

ANSWER_METHODS = ("chat.startStream", "chat.appendStream", "chat.postMessage", "chat.update")


class SlackRig:
    """Slack under the shared scenarios (see ``tests/channel_contract.py``)."""

    def __init__(self) -> None:
        self._fake: FakeSlack | None = None
        self._channel = dataclasses.replace(
            slack_channel.CHANNEL,
            run_fn=functools.partial(slack_channel.run, rng=random.Random(13)),
        )

    @property
    def fake(self) -> FakeSlack:
        assert self._fake is not None, "use the rig inside rig.open()"
        return self._fake

    @property
    def channel(self) -> Channel:
        return self._channel

    @property
    def secret(self) -> str:
        return self.fake.bot_token

    @property
    def bot_author(self) -> tuple[str, str]:
        return self.fake.bot_user, self.fake.bot_name

    @asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        async with open_fake_slack() as fake:
            self._fake = fake
            yield

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        return {
            "bot_token": self.fake.bot_token if valid_credentials else "xoxb-not-a-valid-token",
            "app_token": self.fake.app_token,
            "api_base": self.fake.api_base,
        }

    async def receiving(self) -> None:
        await self.fake.wait_until(lambda: self.fake.live is not None)

    def source(self, kind: str) -> str:
        block = {
            "channel": "slack",
            "conversationType": kind,
            "senderId": self.fake.user,
            "senderName": self.fake.user_name,
        }
        return "<dsh_im_source>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_source>"

    async def user_dm(self, text: str, *, reply_to: str | None = None) -> str:
        ev = await self.fake.user_message(self.fake.dm, _mrkdwn(text), thread_ts=reply_to)
        return str(ev["ts"])

    async def user_group(self, text: str, *, mention: bool) -> str:
        ev = await self.fake.user_message(self.fake.general, _mrkdwn(text), mention=mention)
        return str(ev["ts"])

    def dm_answers(self) -> list[Answer]:
        return [
            Answer(m.ts, unescape(m.text), tuple(unescape(t) for t in m.shown))
            for m in self.fake.bot_messages(self.fake.dm)
        ]

    def calls_besides_receiving(self) -> list[str]:
        return [c.method for c in self.fake.calls if c.method != "apps.connections.open"]

    def identity_calls(self) -> int:
        return len(self.fake.calls_to("auth.test"))

    async def drop_connection(self) -> None:
        conn = self.fake.live
        await self.fake.drop_connection()
        if conn is not None:
            await self.fake.wait_until(lambda: not conn.open)

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        for method in ANSWER_METHODS:
            self.fake.fail_next(method, count, status=429, retry_after=retry_after)

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        await self.fake.wait_until(predicate)


def _mrkdwn(text: str) -> str:
    """What Slack delivers for typed text: ``&``, ``<``, ``>`` escaped."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
