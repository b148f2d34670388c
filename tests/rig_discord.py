"""The Discord :class:`~tests.channel_contract.ChannelRig`: the fake REST API and gateway."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from dshim.channels.discord import channel as discord_channel
from dshim.harness.echo import EchoHarness
from dshim.testing.fakes.discord import FakeDiscord, open_fake_discord
from tests.channel_contract import Answer
from tests.rigkit import Bot, Configure, FakeRig, bot_on_fake, im_source, seeded

#: Virtual seconds: far above what any test scripts, far below the suite's hard deadline.
DEADLINE = 900.0
CREATE = "POST /channels/{channel_id}/messages"
EDIT = "PATCH /channels/{channel_id}/messages/{message_id}"


class DiscordRig(FakeRig[FakeDiscord]):
    """Discord under the shared scenarios (see ``tests/channel_contract.py``)."""

    def __init__(self) -> None:
        super().__init__(seeded(discord_channel, 11), open_fake_discord)

    @property
    def secret(self) -> str:
        return self.fake.token

    @property
    def bot_author(self) -> tuple[str, str]:
        user = self.fake.bot_user
        return str(user["id"]), str(user.get("global_name") or user["username"])

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        return {
            "token": self.fake.token if valid_credentials else "a-token-discord-does-not-know",
            "api_base": self.fake.api_base,
            "gateway_url": self.fake.gateway_url,
        }

    def connected(self) -> bool:
        conn = self.fake.live
        return conn is not None and conn.authenticated

    def source(self, kind: str) -> str:
        return source(self.fake.user, kind)

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

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        self.fake.rate_limit(method="POST", route=r"/messages$", count=1, retry_after=retry_after)
        self.fake.rate_limit(method="PATCH", count=count, retry_after=retry_after)


# --- the e2e bot --------------------------------------------------------------------------------


def source(sender: dict[str, Any], kind: str, name: str | None = None) -> str:
    """The ``<dsh_im_source>`` block of a Discord user (``name``: their name there)."""
    name = name or sender.get("global_name") or sender["username"]
    return im_source("discord", kind, sender["id"], name)


@asynccontextmanager
async def running_bot(
    tmp_path: Path,
    *,
    configure: Configure[FakeDiscord] = None,
    gateway_override: bool = True,
    wait_ready: bool = True,
    deadline: float = DEADLINE,
    harness: EchoHarness | None = None,
    **options: Any,
) -> AsyncIterator[tuple[Bot, FakeDiscord]]:
    """The bot (``serve_bots``, a real store) against a fresh fake, within ``deadline``.

    ``configure`` sets the fake's knobs before the bot starts; ``options`` are ``[[bots]]``
    keys; the block starts once the gateway is READY (unless ``wait_ready`` is False).
    Leaving it shuts the bot down the way SIGTERM does.  The channel's jitter is pinned
    with a fresh seed each time: a bot sees the same random draws whatever ran before it
    (a shared Random made tests order-dependent).
    """

    def bot_table(fake: FakeDiscord) -> dict[str, Any]:
        table = {
            "name": "disco",
            "channel": "discord",
            "token": fake.token,
            "api_base": fake.api_base,
        }
        table.update(options)
        if gateway_override:  # else the URL comes from GET /gateway/bot
            table["gateway_url"] = fake.gateway_url
        return table

    async with bot_on_fake(
        open_fake_discord,
        bot_table,
        seeded(discord_channel, 7),
        tmp_path,
        harness=harness or EchoHarness(slow_interval_s=0.4),
        deadline=deadline,
        ready=(lambda fake: fake.ready_count >= 1) if wait_ready else None,
        configure=configure,
    ) as started:
        yield started
