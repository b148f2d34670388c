"""The Slack :class:`~tests.channel_contract.ChannelRig`: the fake Web API and Socket Mode.

Slack shows an answer's text with ``&``, ``<``, ``>`` decoded from the escaped form the
bot sends, so the rig reads the fake's texts unescaped, as a user sees them.  "Replying
to" one of the bot's answers is a thread reply under that message (``thread_ts`` = its
``ts``, ``parent_user_id`` = the bot): Slack's only reply gesture on a message.
"""

from __future__ import annotations

from typing import Any

from dshim.channels.slack import channel as slack_channel
from dshim.channels.slack.protocol import unescape
from dshim.testing.fakes.slack import FakeSlack, open_fake_slack
from tests.channel_contract import Answer
from tests.rigkit import FakeRig, im_source, seeded

ANSWER_METHODS = ("chat.startStream", "chat.appendStream", "chat.postMessage", "chat.update")


class SlackRig(FakeRig[FakeSlack]):
    """Slack under the shared scenarios (see ``tests/channel_contract.py``)."""

    def __init__(self) -> None:
        super().__init__(seeded(slack_channel, 13), open_fake_slack)

    @property
    def secret(self) -> str:
        return self.fake.bot_token

    @property
    def bot_author(self) -> tuple[str, str]:
        return self.fake.bot_user, self.fake.bot_name

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        return {
            "bot_token": self.fake.bot_token if valid_credentials else "xoxb-not-a-valid-token",
            "app_token": self.fake.app_token,
            "api_base": self.fake.api_base,
        }

    def source(self, kind: str) -> str:
        return im_source("slack", kind, self.fake.user, self.fake.user_name)

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

    def closed(self, conn: Any) -> bool:
        return not conn.open

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        for method in ANSWER_METHODS:
            self.fake.fail_next(method, count, status=429, retry_after=retry_after)


def _mrkdwn(text: str) -> str:
    """What Slack delivers for typed text: ``&``, ``<``, ``>`` escaped."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
