"""Crashes and shutdowns in the middle of an answer: nothing lost, nothing answered twice.

Testing manifesto: the bot runs through :func:`dshim.serve.serve_bots` — supervisor,
Telegram channel, pipeline, real SQLite store (inline, so the autojump clock only jumps when
everything waits), streaming engine — against the fake Bot API on 127.0.0.1 port 0, with
the echo harness.  A "crash" cancels the whole serve run at a chosen moment; a "restart"
runs serve again on the same store.  Assertions are about what the chat shows.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from dshim.channels.registry import parse_config
from dshim.channels.telegram.channel import CHANNEL
from dshim.harness.base import TurnContext
from dshim.harness.echo import EchoHarness
from dshim.model import PromptPart, ReplyTarget, TextDelta, TextPart, TurnEnd, TurnEvent
from dshim.pipeline.runtime import GAVE_UP_TEXT, INTERRUPTED_TEXT
from dshim.pipeline.turn import CUT_MARK
from dshim.render import EditOutbound
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
        #: Set (and replaced) whenever a prompt arrives.
        self.prompted = trio.Event()

    def prompt(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        current = [p.text for p in parts if isinstance(p, TextPart)][-1]
        self.prompts.append(current)
        self.prompted.set()
        self.prompted = trio.Event()
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


class Chat:
    """Ada's direct chat with one bot whose data directory survives its restarts."""

    def __init__(self, fake: FakeTelegram, data_dir: Path, clock: Clock, agent: Agent) -> None:
        self.fake = fake
        self.data_dir = data_dir
        self.clock = clock
        self.agent = agent
        self.chat = fake.private_chat(ADA)

    def say(self, text: str) -> dict[str, Any]:
        return self.fake.user_message(self.chat, ADA, text)

    @property
    def texts(self) -> list[str]:
        """What the bot's messages in the chat show now."""
        return [m.text for m in self.fake.bot_messages(ADA["id"])]

    async def until(self, predicate: Callable[[], bool]) -> None:
        await self.fake.wait_until(predicate)

    async def prompted(self, n: int) -> None:
        """Until the agent got ``n`` prompts (the agent is no part of the fake)."""
        while len(self.agent.prompts) < n:
            await self.agent.prompted.wait()

    @asynccontextmanager
    async def serving(self) -> AsyncIterator[trio.Event]:
        """Serve the bot; yields the shutdown event.  Set it to drain (the block then
        waits for serve to end); leave the block without it to crash."""
        config = parse_config(
            {
                "bots": [
                    {
                        "name": "tg",
                        "channel": "telegram",
                        "token": "${T}",
                        "api_base": self.fake.url,
                    }
                ]
            },
            env={"T": TEST_TOKEN},
        )
        shutdown = trio.Event()
        async with open_store(self.data_dir, inline=True) as store, trio.open_nursery() as nursery:
            await nursery.start(
                partial(
                    serve_bots,
                    config,
                    store,
                    shutdown=shutdown,
                    channels={"tg": CHANNEL},
                    clock=self.clock,
                    harness=self.agent,
                )
            )
            yield shutdown
            if not shutdown.is_set():
                nursery.cancel_scope.cancel()  # a crash; after a shutdown serve ends by itself


@asynccontextmanager
async def ada_chat(data_dir: Path, agent: Agent | None = None) -> AsyncIterator[Chat]:
    clock = Clock()
    async with open_fake_telegram(clock=clock) as fake:
        yield Chat(fake, data_dir, clock, agent or Agent())


async def test_a_turn_that_showed_nothing_is_answered_after_a_crash(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with ada_chat(tmp_path) as c:
        async with c.serving():
            c.say("echo:slow 10 the question")
            await c.prompted(1)
            await trio.sleep(0.5)  # typing shows, the first message is 0.5 s away
            assert c.texts == []
            # crash
        async with c.serving():
            await c.until(lambda: len(c.texts) == 1)
            await trio.sleep(30)
    assert c.texts == [answer_to("echo:slow 10 the question")]  # answered, once
    assert len(c.agent.prompts) == 2


async def test_a_turn_that_showed_part_of_its_answer_gets_the_notice_after_a_crash(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with ada_chat(tmp_path) as c:
        async with c.serving():
            first = c.say("echo:slow 20 the question")
            await c.until(lambda: len(c.texts) == 1)
            # crash
        async with c.serving():
            await c.until(lambda: len(c.texts) == 2)
            await trio.sleep(30)
        partial, notice = c.fake.bot_messages(ADA["id"])
    assert partial.text != answer_to("echo:slow 20 the question")
    assert notice.text == INTERRUPTED_TEXT and notice.reply_to_message_id == first["message_id"]
    assert len(c.agent.prompts) == 1  # not run twice


async def test_a_turn_that_had_shown_an_approval_request_is_not_run_again(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with ada_chat(tmp_path) as c:
        async with c.serving():
            c.say("echo:approval")
            await c.until(lambda: len(c.texts) == 1)  # the request is shown
            # crash
        async with c.serving():
            await c.until(lambda: len(c.texts) == 2)
            await trio.sleep(30)
    request, notice = c.texts
    assert request.startswith("🔐 The agent asks for permission")
    assert notice == INTERRUPTED_TEXT  # the user is not asked twice
    assert len(c.agent.prompts) == 1


async def test_an_answer_cut_by_shutdown_is_marked_at_once_not_after_the_restart(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with ada_chat(tmp_path) as c:
        async with c.serving() as shutdown:
            c.say("echo:slow 100 a long story")
            await c.until(lambda: len(c.texts) == 1)
            t0 = trio.current_time()
            shutdown.set()  # SIGTERM: 10 s of grace
            await c.until(lambda: CUT_MARK in c.texts[0])
            cut_after = trio.current_time() - t0
        [cut] = c.texts
        assert cut.startswith(SOURCE[:20]) and cut.endswith("\n\n" + CUT_MARK)
        assert 10 <= cut_after < 12  # marked when the grace ended, by an edit
        async with c.serving():
            await trio.sleep(60)
    assert c.texts == [cut]  # no notice, no second answer after the restart
    assert len(c.agent.prompts) == 1


async def test_an_answer_that_had_shown_nothing_at_shutdown_runs_after_the_restart(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with ada_chat(tmp_path, Agent(think_s=30)) as c:  # thinks longer than the grace
        async with c.serving() as shutdown:
            c.say("a hard question")
            await c.prompted(1)
            shutdown.set()
            await trio.sleep(60)
            assert c.texts == []  # nothing to mark: nothing was shown
        c.agent.think_s = 0
        async with c.serving():
            await c.until(lambda: len(c.texts) == 1)
            await trio.sleep(30)
    assert c.texts == [answer_to("a hard question")]
    assert len(c.agent.prompts) == 2


async def test_a_message_that_crashes_the_bot_is_tried_twice_then_gets_the_notice(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with ada_chat(tmp_path) as c:
        async with c.serving():
            c.say("poison")
            await c.until(lambda: INTERRUPTED_TEXT in c.texts)
            c.say("are you back?")
            await c.until(lambda: len(c.texts) == 2)
            await trio.sleep(120)
    assert c.texts == [INTERRUPTED_TEXT, answer_to("are you back?")]
    assert c.agent.prompts == ["poison", "poison", "are you back?"]


async def test_the_restart_notice_survives_a_second_crash_before_it_went_out(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with ada_chat(tmp_path) as c:
        async with c.serving():
            first = c.say("echo:slow 20 the question")
            await c.until(lambda: len(c.texts) == 1)
            # crash 1: part of the answer is shown
        c.fake.fail_next("sendMessage", 1_000, status=502)  # the platform is down...
        async with c.serving():
            await c.until(lambda: len(c.fake.calls_to("sendMessage")) >= 2)
            await trio.sleep(3)
            # ...and crash 2 comes before the notice could be delivered
        c.fake.faults.clear()
        async with c.serving():
            await c.until(lambda: len(c.texts) == 2)
            await trio.sleep(30)
        partial, notice = c.fake.bot_messages(ADA["id"])
    assert notice.text == INTERRUPTED_TEXT and notice.reply_to_message_id == first["message_id"]
    assert len(c.agent.prompts) == 1


async def test_a_message_that_takes_the_bot_down_before_its_turn_starts_is_given_up(
    autojump_clock: trio.abc.Clock, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Opening the answer's stream fails with a bug for one message, before its turn is
    # marked running: every start resumes it and goes down again. Every resume counts as
    # an attempt, so after two the bot gives up on it (with a notice) and answers again.
    poisoned: set[str] = set()
    opened = EditOutbound.open_stream

    def open_stream(self: EditOutbound, target: ReplyTarget) -> Any:
        if target.reply_to_message_id in poisoned:
            raise RuntimeError("a bug before the turn starts")
        return opened(self, target)

    monkeypatch.setattr(EditOutbound, "open_stream", open_stream)
    async with ada_chat(tmp_path) as c:
        async with c.serving():
            poisoned.add(str(c.say("poison")["message_id"]))
            await c.until(lambda: GAVE_UP_TEXT in c.texts)
            c.say("are you back?")
            await c.until(lambda: len(c.texts) == 2)
            await trio.sleep(120)
    assert c.texts == [GAVE_UP_TEXT, answer_to("are you back?")]
    assert c.agent.prompts == ["are you back?"]
