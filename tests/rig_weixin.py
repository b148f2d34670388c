"""Shared helpers of the WeChat tests (``RecordingHarness`` is the contract's): the fake iLink API, a real store, one bot through
:func:`dshim.serve.serve_bots`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from dshim.channels.registry import parse_config
from dshim.channels.weixin.channel import CHANNEL
from dshim.harness.echo import EchoHarness
from dshim.store import open_store
from dshim.store.base import Store
from dshim.testing.fakes.weixin import TEST_TOKEN, USER, FakeWeixin, open_fake_weixin
from tests.channel_contract import Answer
from tests.helpers import Clock
from tests.rigkit import FakeRig, Run, im_source, serving

BOT = "wx"
DEADLINE = 900


def source(user: str = USER, kind: str = "direct") -> str:
    return im_source("weixin", kind, user)


def echo_of(content: str, *, user: str = USER, reply_block: str | None = None) -> str:
    parts = [source(user)] + ([reply_block] if reply_block else []) + [content]
    return "\n\n".join(parts)


@dataclass
class World:
    fake: FakeWeixin
    store: Store
    clock: Clock
    data_dir: Path

    @asynccontextmanager
    async def bot(self, *, poll: bool = True, **options: Any) -> AsyncIterator[Run]:
        """Run one bot (see :func:`running_bot`), once it long-polls (unless ``poll`` is
        False)."""
        async with running_bot(self, **options) as run:
            if poll:
                await polling(self.fake)
            yield run


@asynccontextmanager
async def weixin_world(tmp_path: Path) -> AsyncIterator[World]:
    clock = Clock()
    async with (
        open_fake_weixin(clock=clock) as fake,
        open_store(tmp_path, inline=True) as store,
    ):
        yield World(fake, store, clock, tmp_path)


def bot_table(fake: FakeWeixin, **options: Any) -> dict[str, Any]:
    table: dict[str, Any] = {
        "name": BOT,
        "channel": "weixin",
        "token": TEST_TOKEN,
        "bot_id": fake.bot_id,
        "api_base": fake.url,
        "cdn_base": fake.cdn_url,
    }
    table.update(options)
    return {k: v for k, v in table.items() if v is not None}


@asynccontextmanager
async def running_bot(
    w: World,
    *,
    harness: EchoHarness | None = None,
    grace_s: float = 10.0,
    **options: Any,
) -> AsyncIterator[Run]:
    """Run one WeChat bot through serve_bots; leaving the block shuts it down."""
    config = parse_config(
        {"dshim": {"shutdown_grace_s": grace_s}, "bots": [bot_table(w.fake, **options)]},
        env={},
    )
    channels = {BOT: CHANNEL}
    async with serving(
        config,
        w.store,
        grace_s=grace_s,
        channels=channels,
        clock=w.clock,
        harness=harness or EchoHarness(),
    ) as run:
        yield run


async def polling(fake: FakeWeixin) -> None:
    """Wait until the bot long-polls (a poll is in flight)."""
    start = len(fake.calls_to("getupdates"))
    await fake.wait_until(lambda: any(c.status == 0 for c in fake.calls_to("getupdates")[start:]))


def texts(fake: FakeWeixin, user: str = USER) -> list[str]:
    return [m.text for m in fake.sent_to(user)]


# --- the contract rig ---------------------------------------------------------------------------

#: Calls that only receive (long polls).
RECEIVING = ("getupdates",)


class WeixinRig(FakeRig[FakeWeixin]):
    """WeChat under the shared scenarios (see ``tests/channel_contract.py``).

    iLink has no edit API (``edits = False``: an answer is shown once, complete) and no
    group traffic for bots: a group message is never addressed, so the scenario's
    "mention" — the only way to address the bot there — is a direct message.
    """

    secret = TEST_TOKEN
    edits = False

    def __init__(self) -> None:
        super().__init__(CHANNEL, lambda: open_fake_weixin(clock=Clock()))

    @property
    def bot_author(self) -> tuple[str, str]:
        return self.fake.bot_id, "contract"

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        table = bot_table(self.fake)
        del table["name"], table["channel"]
        if not valid_credentials:
            table["token"] = "a-token-ilink-does-not-know"
        return table

    async def receiving(self) -> None:
        await polling(self.fake)

    def source(self, kind: str) -> str:
        return source(USER, kind)

    async def user_dm(self, text: str, *, reply_to: str | None = None) -> str:
        quote = self.fake.quote_of(reply_to) if reply_to is not None else None
        return str(self.fake.user_message(text, quote=quote)["message_id"])

    async def user_group(self, text: str, *, mention: bool) -> str:
        if mention:
            return str(self.fake.user_message(text)["message_id"])
        return str(self.fake.user_message(text, group_id="1234@chatroom")["message_id"])

    def dm_answers(self) -> list[Answer]:
        return [Answer(str(b.server_id), b.text, (b.text,)) for b in self.fake.sent_to(USER)]

    def calls_besides_receiving(self) -> list[str]:
        return [c.op for c in self.fake.calls_except(*RECEIVING)]

    def identity_calls(self) -> int:
        return len(self.fake.calls_to("msg/notifystart"))

    async def drop_connection(self) -> None:
        self.fake.drop_polls()

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        self.fake.fail_next("sendmessage", count, status=429, retry_after=retry_after)


@asynccontextmanager
async def weixin_bed(
    tmp_path: Path, *, deadline: float = DEADLINE, serve: bool = True, **bot_options: Any
) -> AsyncIterator[World]:
    """The world of one e2e test, within its ``deadline``: with a bot (``running_bot``
    with ``bot_options``) that already long-polls, unless ``serve`` is False."""
    with trio.fail_after(deadline):
        async with weixin_world(tmp_path) as w:
            if not serve:
                yield w
                return
            async with w.bot(**bot_options):
                yield w
