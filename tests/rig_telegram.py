"""The Telegram :class:`~tests.channel_contract.ChannelRig`: the fake Bot API on 127.0.0.1.

Also :func:`telegram_bed`, what ``tests/test_telegram_e2e.py`` runs its bots on: the fake
with Ada's private chat, and bots run through ``serve_bots`` against it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from dshim.channels.base import Channel
from dshim.channels.registry import parse_config
from dshim.channels.telegram.channel import CHANNEL
from dshim.harness.base import TurnContext
from dshim.harness.echo import EchoHarness
from dshim.model import PromptPart
from dshim.prompt import prompt_text
from dshim.serve import serve_bots
from dshim.store import open_store
from dshim.store.base import Store
from dshim.testing.fakes.telegram import TEST_TOKEN, FakeTelegram, open_fake_telegram
from tests.channel_contract import Answer
from tests.helpers import Clock, Events

ADA = FakeTelegram.user(42, "Ada", "Lovelace", "ada")
BOB = FakeTelegram.user(43, "Bob")
GROUP_ID = -1001234567890
DEADLINE = 900  # virtual seconds, for a whole e2e test
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
        return source(ADA, kind)

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


# --- the e2e bed ----------------------------------------------------------------------------


def source(sender: dict[str, Any], kind: str = "direct") -> str:
    """The ``<dsh_im_source>`` block of a Telegram user in a direct or group chat."""
    name = " ".join(p for p in (sender.get("first_name"), sender.get("last_name")) if p)
    block = {
        "channel": "telegram",
        "conversationType": kind,
        "senderId": str(sender["id"]),
        "senderName": name,
    }
    return "<dsh_im_source>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_source>"


def echo_of(
    sender: dict[str, Any], content: str, kind: str = "direct", reply_block: str | None = None
) -> str:
    """What the echo harness answers: the prompt's text parts joined by a blank line."""
    parts = [source(sender, kind)] + ([reply_block] if reply_block else []) + [content]
    return "\n\n".join(parts)


class RecordingHarness(EchoHarness):
    """The echo harness, remembering every prompt it received and its session."""

    def __init__(self) -> None:
        super().__init__()
        self.prompts: list[list[PromptPart]] = []
        #: The session of each prompt, in order.
        self.sessions: list[str] = []

    def prompt(self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext) -> Any:
        self.prompts.append(list(parts))
        self.sessions.append(session_id)
        return super().prompt(session_id, parts, ctx)

    @property
    def texts(self) -> list[str]:
        return [prompt_text(p) for p in self.prompts]


@dataclass
class BotRun:
    """A running bot: its store, how it ended (empty while it runs), and its scope
    (cancel it to kill the process mid-answer)."""

    store: Store
    results: dict[str, str]
    scope: trio.CancelScope


@asynccontextmanager
async def running_bot(
    fake: FakeTelegram,
    store: Store,
    clock: Clock,
    *,
    harness: EchoHarness | None = None,
    token: str = TEST_TOKEN,
    observer: Events | None = None,
    **options: Any,
) -> AsyncIterator[BotRun]:
    """Run one Telegram bot through serve_bots on ``store``; leaving the block shuts it
    down gracefully.  ``options`` are ``[[bots]]`` keys."""
    table = {"name": "tg", "channel": "telegram", "token": "${TG_TOKEN}"}
    config = parse_config(
        {"bots": [{**table, "api_base": fake.url, **options}]}, env={"TG_TOKEN": token}
    )
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        run = BotRun(store, {}, nursery.cancel_scope)

        async def serve(task_status: trio.TaskStatus[None]) -> None:
            run.results.update(
                await serve_bots(
                    config,
                    store,
                    shutdown=shutdown,
                    channels={"tg": CHANNEL},
                    clock=clock,
                    harness=harness or EchoHarness(),
                    observer=observer,
                    task_status=task_status,
                )
            )

        await nursery.start(serve)
        yield run
        shutdown.set()


@asynccontextmanager
async def telegram_world(tmp_path: Path) -> AsyncIterator[tuple[FakeTelegram, Store, Clock]]:
    """The fake Bot API and a real SQLite store (inline: the autojump clock stays exact)."""
    clock = Clock()
    async with (
        open_fake_telegram(clock=clock) as fake,
        open_store(tmp_path, inline=True) as store,
    ):
        yield fake, store, clock


async def polling(fake: FakeTelegram) -> None:
    """Wait until the bot is up and long-polling."""
    await fake.wait_until(
        lambda: (
            any(c.status == 0 for c in fake.calls_to("getUpdates"))
            or len(fake.calls_to("getUpdates")) > 1
        )
    )


def final_texts(fake: FakeTelegram, chat_id: int) -> list[str]:
    """The bot's messages in a chat as it shows them now, oldest first."""
    return [m.text for m in fake.bot_messages(chat_id)]


class TelegramBed:
    """The fake Bot API with Ada's private chat (``dm``); ``bot()`` runs a bot on it."""

    def __init__(self, fake: FakeTelegram, clock: Clock, data_dir: Path) -> None:
        self.fake = fake
        self.clock = clock
        self.data_dir = data_dir
        self.dm = fake.private_chat(ADA)

    def say(self, text: str | None = None, **options: Any) -> dict[str, Any]:
        """Ada writes to the bot in her private chat; returns the message."""
        return self.fake.user_message(self.dm, ADA, text, **options)

    def texts(self, chat_id: int = 42) -> list[str]:
        """The bot's messages in a chat as it shows them now, oldest first."""
        return final_texts(self.fake, chat_id)

    async def answered(self, count: int, chat_id: int = 42) -> None:
        """Wait until the bot has sent ``count`` messages into the chat."""
        await self.fake.wait_until(lambda: len(self.fake.bot_messages(chat_id)) == count)

    async def polling(self) -> None:
        """Wait until the bot is up and long-polling."""
        await polling(self.fake)

    @asynccontextmanager
    async def bot(self, *, poll: bool = True, **options: Any) -> AsyncIterator[BotRun]:
        """Run one bot (see :func:`running_bot`) on a real SQLite store in the data
        directory (inline: the autojump clock stays exact), once it polls (unless ``poll``
        is False)."""
        async with (
            open_store(self.data_dir, inline=True) as store,
            running_bot(self.fake, store, self.clock, **options) as run,
        ):
            if poll:
                await self.polling()
            yield run


@asynccontextmanager
async def telegram_bed(
    data_dir: Path, **fake_options: Any
) -> AsyncIterator[tuple[TelegramBed, FakeTelegram]]:
    """The fake Bot API on 127.0.0.1 for one e2e test, within its ``DEADLINE``: the bed
    and (for brevity) its fake."""
    with trio.fail_after(DEADLINE):
        clock = Clock()
        async with open_fake_telegram(clock=clock, **fake_options) as fake:
            yield TelegramBed(fake, clock, data_dir), fake
