"""Approvals and questions on a channel with buttons (``Outbound.open_interaction``).

The pipeline hands such a channel the request (prompt, options, the whole text) instead
of the numbered text, keeps it shown while it waits, and judges the answer the same way:
typed, or the option's label a button press stands for.  A channel whose buttons fail
falls back to the text.  Real runtime, real SQLite file, the echo harness.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

from dshim.errors import ChannelError
from dshim.harness.echo import EchoHarness
from dshim.model import Delivered, ReplyTarget
from dshim.outbound import InteractionPrompt
from dshim.pipeline.runtime import BotRuntime, open_bot_runtime
from dshim.store import open_store
from dshim.store.base import Store
from dshim.testing.outbound import RecordingOutbound
from tests.helpers import BOT_ID, Clock, bot_config, msg


class ButtonOutbound(RecordingOutbound):
    """Records sends, and shows requests with buttons (until the pipeline is done)."""

    def __init__(self, *, fail: bool = False) -> None:
        super().__init__(clock=Clock(), bot_username="dshim_bot")
        self.fail = fail
        self.prompts: list[InteractionPrompt] = []
        self.open: list[str] = []
        self.log: list[str] = []

    @asynccontextmanager
    async def open_interaction(
        self, target: ReplyTarget, prompt: InteractionPrompt
    ) -> AsyncIterator[list[Delivered]]:
        if self.fail:
            raise ChannelError("buttons are broken today")
        self.prompts.append(prompt)
        self.open.append(prompt.kind)
        self.log.append("shown")
        try:
            now = self.clock()
            yield [Delivered(message_id="req-1", text=prompt.text, sent_at=now, completed_at=now)]
        finally:
            self.open.remove(prompt.kind)
            self.log.append("closed")

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        self.log.append(text)
        return await super().send_text(target, text)


@asynccontextmanager
async def runtime(data_dir: Path, out: ButtonOutbound) -> AsyncIterator[tuple[BotRuntime, Store]]:
    config = bot_config()
    async with (
        open_store(data_dir, inline=True) as store,
        open_bot_runtime(
            config=config,
            bot=config.bots[0],
            bot_id=BOT_ID,
            store=store,
            outbound=out,
            harness=EchoHarness(),
            clock=out.clock,
        ) as rt,
    ):
        yield rt, store


async def test_an_approval_gets_buttons_and_the_typed_answer_still_counts(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    out = ButtonOutbound()
    async with runtime(tmp_path, out) as (rt, store):
        await rt.accept(msg("echo:approval"))
        await rt.wait_settled()  # the turn waits for the answer
        assert out.open == ["approval"]
        [prompt] = out.prompts
        assert [o.label for o in prompt.options] == ["Allow once", "Allow always", "Reject"]
        # Above the buttons: the request and how to answer, not the numbered list ...
        assert prompt.prompt.startswith("🔐 The agent asks for permission: echo:")
        assert "1. Allow once" not in prompt.prompt and "/stop rejects it" in prompt.prompt
        # ... which the whole text (for the message, and for quotes of it) still has.
        assert "1. Allow once\n2. Allow always\n3. Reject" in prompt.text
        # The request is in the outbound index, like every notice.
        [entry] = await store.list_outbound("t", "42", now=out.clock())
        assert entry.message_ids == ["req-1"] and entry.text == prompt.text
        await rt.accept(msg("Allow always"))  # what a press of that button sends
        await rt.wait_idle()
    assert out.open == []
    # The buttons go away before the outcome is said.
    assert out.log[:3] == ["shown", "closed", "✅ Approved: Allow always."]
    assert out.sent[-1].text == "Approval decision: allow_always"


async def test_a_question_with_buttons_is_closed_by_stop(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    out = ButtonOutbound()
    async with runtime(tmp_path, out) as (rt, _):
        await rt.accept(msg("echo:question"))
        await rt.wait_settled()
        assert out.open == ["question"]
        [prompt] = out.prompts
        assert prompt.kind == "question" and prompt.allow_free_text
        await rt.accept(msg("/stop"))
        await rt.wait_idle()
    assert out.open == [] and "closed" in out.log


async def test_buttons_that_fail_fall_back_to_the_text(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    out = ButtonOutbound(fail=True)
    async with runtime(tmp_path, out) as (rt, _):
        await rt.accept(msg("echo:approval"))
        await rt.wait_settled()
        assert any("1. Allow once\n2. Allow always\n3. Reject" in t for t in out.log)
        await rt.accept(msg("1"))
        await rt.wait_idle()
    assert out.prompts == []
    assert "✅ Approved: Allow once." in out.log
