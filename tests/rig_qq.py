"""Running the real QQ channel through ``dshim.serve.serve_bots`` against the fake QQ.

Testing manifesto: everything runs on 127.0.0.1 with kernel-chosen ports in the same trio
run as the bot, on trio's autojump clock, so QQ's real timings (41.25 s heartbeats, the
5-minute group window, 700 ms stream pacing, the 10 s "working" reply) take no real time
and are exact.  The store is a real SQLite file in ``tmp_path`` kept on the trio thread;
the echo harness answers with the exact prompt.  Assertions are about what a QQ user or
operator would see: the bot's messages and their texts, the sends and their ``msg_seq``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from dshim.channels.qq import channel as qq_channel
from dshim.harness.echo import EchoHarness
from dshim.testing.fakes.qq import FakeQQ, open_fake_qq
from tests.channel_contract import Answer
from tests.rigkit import Bot, Configure, FakeRig, bot_on_fake, im_source, seeded

DEADLINE = 1800.0
SEEDED = seeded(qq_channel, 5)


def source(fake: FakeQQ, kind: str) -> str:
    return im_source("qq", kind, fake.user_openid if kind == "direct" else fake.member_openid)


def echo(fake: FakeQQ, text: str, kind: str = "direct", reply: str | None = None) -> str:
    return "\n\n".join([source(fake, kind), *([reply] if reply else []), text])


def bot_table(fake: FakeQQ, **options: Any) -> dict[str, Any]:
    """The ``[[bots]]`` table pointing at the fake; an option set to None is left out."""
    table = {
        "name": "qqbot",
        "channel": "qq",
        "app_id": fake.app_id,
        "client_secret": fake.client_secret,
        "api_base": fake.http_url,
        "token_base": fake.http_url,
        "gateway_url": fake.gateway_url,
        "media_hosts": ["127.0.0.1"],
        **options,
    }
    return {k: v for k, v in table.items() if v is not None}


@asynccontextmanager
async def running_bot(
    tmp_path: Path,
    *,
    wait_ready: bool = True,
    harness: EchoHarness | None = None,
    channel: Any = SEEDED,
    configure: Configure[FakeQQ] = None,
    fake: FakeQQ | None = None,
    crash: bool = False,
    **options: Any,
) -> AsyncIterator[tuple[Bot, FakeQQ]]:
    """The bot (``serve_bots``, a real store) against a fresh fake (or ``fake``); leaving
    the block shuts it down like SIGTERM, or with ``crash`` cancels it at once."""
    async with bot_on_fake(
        open_fake_qq,
        lambda fake: bot_table(fake, **options),
        channel,
        tmp_path,
        harness=harness or EchoHarness(slow_interval_s=0.4),
        deadline=DEADLINE,
        ready=(lambda fake: fake.ready_count >= 1) if wait_ready else None,
        configure=configure,
        fake=fake,
        crash=crash,
    ) as started:
        yield started


def texts(fake: FakeQQ, conversation: str) -> list[str]:
    return [m.content for m in fake.bot_messages(conversation)]


# --- the shared contract's rig ----------------------------------------------------------------


class QQRig(FakeRig[FakeQQ]):
    """QQ under the shared scenarios (see ``tests/channel_contract.py``).  A quoted
    answer is known by its ``ref_idx`` (what a QQ quote carries)."""

    STREAM = "POST /v2/users/{openid}/stream_messages"
    C2C_SEND = "POST /v2/users/{openid}/messages"

    def __init__(self) -> None:
        super().__init__(seeded(qq_channel, 11), open_fake_qq)

    @property
    def secret(self) -> str:
        return self.fake.client_secret

    @property
    def bot_author(self) -> tuple[str, str]:
        return str(self.fake.bot_user["id"]), str(self.fake.bot_user["username"])

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        table = bot_table(self.fake)
        del table["name"], table["channel"]
        if not valid_credentials:
            table["client_secret"] = "a-secret-qq-does-not-know"
        return table

    def connected(self) -> bool:
        return self.fake.live is not None and self.fake.live.authenticated

    def source(self, kind: str) -> str:
        return source(self.fake, kind)

    async def user_dm(self, text: str, *, reply_to: str | None = None) -> str:
        d = await self.fake.c2c_message(text, quote=reply_to)
        return str(d["id"])

    async def user_group(self, text: str, *, mention: bool) -> str:
        d = await self.fake.group_message(text, mention=mention)
        return str(d["id"])

    def dm_answers(self) -> list[Answer]:
        return [
            Answer(m.ref_idx, m.content, tuple(m.shown))
            for m in self.fake.bot_messages(self.fake.c2c_conversation)
        ]

    def calls_besides_receiving(self) -> list[str]:
        # The gateway (and GET /gateway/bot, the token that opens it) is receiving.
        return [
            f"{c.method} {c.path}"
            for c in self.fake.calls
            if not c.path.startswith(("/gateway", "/app/getAppAccessToken"))
        ]

    def identity_calls(self) -> int:
        return len(self.fake.token_calls)

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        self.fake.rate_limit(self.C2C_SEND, 1, retry_after)
        self.fake.rate_limit(self.STREAM, count, retry_after)
