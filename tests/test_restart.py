"""Crashes and shutdowns in the middle of an answer: nothing lost, nothing answered twice.

Testing manifesto: the bot runs through :func:`dshim.serve.serve_bots` — supervisor,
Telegram channel, pipeline, real SQLite store (inline, so the autojump clock only jumps when
everything waits), streaming engine — against the fake Bot API on 127.0.0.1 port 0, with
the echo harness.  A "crash" cancels the whole serve run at a chosen moment; a "restart"
runs serve again on the same store.  Assertions are about what the chat shows.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import trio

from dshim.channels.telegram.channel import CHANNEL
from dshim.config import parse_config
from dshim.harness.base import TurnContext
from dshim.harness.echo import EchoHarness
from dshim.model import PromptPart, TextDelta, TextPart, TurnEnd, TurnEvent
from dshim.pipeline.runtime import INTERRUPTED_TEXT
from dshim.pipeline.turn import CUT_MARK
from dshim.serve import serve_bots
from dshim.store import open_store
from dshim.testing.fakes.telegram import TEST_TOKEN, FakeTelegram, open_fake_telegram
from tests.helpers import Clock

ADA = FakeTelegram.user(42, "Ada", "Lovelace", "ada")
SOURCE = (
    '<dsh_im_source>{"channel":"telegram","conversationType":"direct","senderId":"42",'
    '"senderName":"Ada Lovelace"}</dsh_im_source>'
)


def answer_to(text: str) -> str:
    return f"{SOURCE}\n\n{text}"


class Agent(EchoHarness):
    """The echo harness with a count of prompts, a slow start and a scripted bug."""

    def __init__(self, *, think_s: float = 0.0) -> None:
        super().__init__()
        self.think_s = think_s
        self.prompts: list[str] = []

    def prompt(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        current = [p.text for p in parts if isinstance(p, TextPart)][-1]
        self.prompts.append(current)
        if current == "poison":
            return self._bug()
        if self.think_s:
            return self._slow_start(session_id, parts, ctx)
        return super().prompt(session_id, parts, ctx)

    async def _slow_start(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        await trio.sleep(self.think_s)
        async for event in super().prompt(session_id, parts, ctx):
            yield event

    async def _bug(self) -> AsyncGenerator[TurnEvent, None]:
        yield TextDelta("")
        raise ValueError("a bug that takes the bot down")
        yield TurnEnd()  # pragma: no cover


@asynccontextmanager
async def serving(
    fake: FakeTelegram, tmp_path: Path, clock: Clock, agent: EchoHarness, **dshim: Any
) -> AsyncIterator[trio.Event]:
    """Serve one bot; yields the shutdown event.  Set it to drain (the block then waits
    for serve to end); leave the block without it to crash."""
    config = parse_config(
        {
            "dshim": dshim,
            "bots": [{"name": "tg", "channel": "telegram", "token": "${T}", "api_base": fake.url}],
        },
        env={"T": TEST_TOKEN},
    )
    shutdown = trio.Event()
    async with open_store(tmp_path, inline=True) as store, trio.open_nursery() as nursery:
        await nursery.start(
            partial(
                serve_bots,
                config,
                store,
                shutdown=shutdown,
                channels={"tg": CHANNEL},
                clock=clock,
                harness=agent,
            )
        )
        yield shutdown
        if not shutdown.is_set():
            nursery.cancel_scope.cancel()  # a crash; after a shutdown serve ends by itself


def texts(fake: FakeTelegram) -> list[str]:
    return [m.text for m in fake.bot_messages(42)]


async def test_a_turn_that_showed_nothing_is_answered_after_a_crash(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    clock = Clock()
    agent = Agent()
    async with open_fake_telegram(clock=clock) as fake:
        chat = fake.private_chat(ADA)
        async with serving(fake, tmp_path, clock, agent):
            fake.user_message(chat, ADA, "echo:slow 10 the question")
            await fake.wait_until(lambda: len(agent.prompts) == 1)
            await trio.sleep(0.5)  # typing shows, the first message is 0.5 s away
            assert texts(fake) == []
            # crash
        async with serving(fake, tmp_path, clock, agent):
            await fake.wait_until(lambda: len(texts(fake)) == 1)
            await trio.sleep(30)
    assert texts(fake) == [answer_to("echo:slow 10 the question")]  # answered, once
    assert len(agent.prompts) == 2


async def test_a_turn_that_showed_part_of_its_answer_gets_the_notice_after_a_crash(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    clock = Clock()
    agent = Agent()
    async with open_fake_telegram(clock=clock) as fake:
        chat = fake.private_chat(ADA)
        async with serving(fake, tmp_path, clock, agent):
            first = fake.user_message(chat, ADA, "echo:slow 20 the question")
            await fake.wait_until(lambda: len(texts(fake)) == 1)
            # crash
        async with serving(fake, tmp_path, clock, agent):
            await fake.wait_until(lambda: len(texts(fake)) == 2)
            await trio.sleep(30)
    partial, notice = fake.bot_messages(42)
    assert partial.text != answer_to("echo:slow 20 the question")
    assert notice.text == INTERRUPTED_TEXT and notice.reply_to_message_id == first["message_id"]
    assert len(agent.prompts) == 1  # not run twice


async def test_an_answer_cut_by_shutdown_is_marked_at_once_not_after_the_restart(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    clock = Clock()
    agent = Agent()
    async with open_fake_telegram(clock=clock) as fake:
        chat = fake.private_chat(ADA)
        async with serving(fake, tmp_path, clock, agent) as shutdown:
            fake.user_message(chat, ADA, "echo:slow 100 a long story")
            await fake.wait_until(lambda: len(texts(fake)) == 1)
            t0 = trio.current_time()
            shutdown.set()  # SIGTERM: 10 s of grace
            await fake.wait_until(lambda: CUT_MARK in texts(fake)[0])
            cut_after = trio.current_time() - t0
        [answer] = fake.bot_messages(42)
        assert answer.text.startswith(SOURCE[:20]) and answer.text.endswith(CUT_MARK), answer.text
        assert 10 <= cut_after < 12  # marked when the grace ended, by an edit
        async with serving(fake, tmp_path, clock, agent):
            await trio.sleep(60)
    assert texts(fake) == [answer.text]  # no notice, no second answer after the restart
    assert len(agent.prompts) == 1


async def test_an_answer_that_had_shown_nothing_at_shutdown_runs_after_the_restart(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    clock = Clock()
    agent = Agent(think_s=30)  # thinks longer than the grace
    async with open_fake_telegram(clock=clock) as fake:
        chat = fake.private_chat(ADA)
        async with serving(fake, tmp_path, clock, agent) as shutdown:
            fake.user_message(chat, ADA, "a hard question")
            await fake.wait_until(lambda: len(agent.prompts) == 1)
            shutdown.set()
            await trio.sleep(60)
            assert texts(fake) == []  # nothing to mark: nothing was shown
        agent.think_s = 0
        async with serving(fake, tmp_path, clock, agent):
            await fake.wait_until(lambda: len(texts(fake)) == 1)
            await trio.sleep(30)
    assert texts(fake) == [answer_to("a hard question")]
    assert len(agent.prompts) == 2


async def test_a_message_that_crashes_the_bot_is_tried_twice_then_gets_the_notice(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    clock = Clock()
    agent = Agent()
    async with open_fake_telegram(clock=clock) as fake:
        chat = fake.private_chat(ADA)
        async with serving(fake, tmp_path, clock, agent):
            fake.user_message(chat, ADA, "poison")
            await fake.wait_until(lambda: INTERRUPTED_TEXT in texts(fake))
            fake.user_message(chat, ADA, "are you back?")
            await fake.wait_until(lambda: len(texts(fake)) == 2)
            await trio.sleep(120)
    assert texts(fake) == [INTERRUPTED_TEXT, answer_to("are you back?")]
    assert agent.prompts == ["poison", "poison", "are you back?"]


async def test_a_turn_that_had_shown_an_approval_request_is_not_run_again(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    clock = Clock()
    agent = Agent()
    async with open_fake_telegram(clock=clock) as fake:
        chat = fake.private_chat(ADA)
        async with serving(fake, tmp_path, clock, agent):
            fake.user_message(chat, ADA, "echo:approval")
            await fake.wait_until(lambda: len(texts(fake)) == 1)  # the request is shown
            # crash
        async with serving(fake, tmp_path, clock, agent):
            await fake.wait_until(lambda: len(texts(fake)) == 2)
            await trio.sleep(30)
    request, notice = texts(fake)
    assert request.startswith("🔐 The agent asks for permission")
    assert notice == INTERRUPTED_TEXT  # the user is not asked twice
    assert len(agent.prompts) == 1
