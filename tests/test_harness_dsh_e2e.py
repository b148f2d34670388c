"""End to end: a Telegram bot in front of a DSH host, through ``dshim serve``'s code path.

Testing manifesto: :func:`dshim.serve.serve_bots` runs the Telegram channel against
:mod:`dshim.testing.fakes.telegram` and the harness built from ``[harness] kind = "dsh"``
against :mod:`dshim.testing.fakes.dsh` (HTTP RPC and the events websocket on one port),
both on 127.0.0.1 port 0, with a real SQLite store.  Nothing reaches the internet.  Every
test runs on trio's autojump clock with a hard virtual deadline.  Assertions are about
what the chat shows and what the host received.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import structlog
import trio

from dshim.channels.registry import parse_config
from dshim.channels.telegram.channel import CHANNEL
from dshim.serve import serve_bots
from dshim.store import open_store
from dshim.store.base import Store
from dshim.testing.fakes.dsh import VERSION, FakeDsh, open_fake_dsh
from dshim.testing.fakes.telegram import TEST_TOKEN, FakeTelegram, open_fake_telegram
from tests.helpers import Clock
from tests.rig_telegram import ADA, echo_of, final_texts, polling, source

DEADLINE = 900
CHAT = 42


class World:
    def __init__(self, tg: FakeTelegram, dsh: FakeDsh, store: Store, clock: Clock, ws: Path):
        self.tg = tg
        self.dsh = dsh
        self.store = store
        self.clock = clock
        self.workspace = ws
        self.chat = tg.private_chat(ADA)

    def say(self, text: str, **kw: Any) -> dict[str, Any]:
        return self.tg.user_message(self.chat, ADA, text, **kw)

    def texts(self) -> list[str]:
        return final_texts(self.tg, CHAT)

    async def until(self, predicate: Callable[[], bool]) -> None:
        while not predicate():  # noqa: ASYNC110 - two fakes: poll both
            await trio.sleep(0.05)

    async def answered(self, count: int) -> list[str]:
        await self.until(lambda: len(self.tg.bot_messages(CHAT)) >= count)
        await trio.sleep(3)  # the last edit lands
        return self.texts()


@asynccontextmanager
async def dsh_world(tmp_path: Path, **harness: Any) -> AsyncIterator[World]:
    """Both fakes, a store and a running Telegram bot whose harness is the DSH host."""
    clock = Clock()
    workspace = tmp_path / "work"
    workspace.mkdir()
    async with (
        open_fake_telegram(clock=clock) as tg,
        open_fake_dsh(clock=clock) as dsh,
        open_store(tmp_path, inline=True) as store,
    ):
        config = parse_config(
            {
                "harness": {
                    "kind": "dsh",
                    "base_url": dsh.url,
                    "workspace": str(workspace),
                    "interaction_timeout_s": 60,
                    **harness,
                },
                "bots": [
                    {"name": "tg", "channel": "telegram", "token": "${TG}", "api_base": tg.url}
                ],
            },
            env={"TG": TEST_TOKEN, "DSH_TOKEN": "dsh-secret-token"},
        )
        shutdown = trio.Event()
        async with trio.open_nursery() as nursery:

            async def serve(task_status: trio.TaskStatus[None]) -> None:
                await serve_bots(
                    config,
                    store,
                    shutdown=shutdown,
                    channels={"tg": CHANNEL},
                    clock=clock,
                    task_status=task_status,
                )

            await nursery.start(serve)
            await polling(tg)
            try:
                yield World(tg, dsh, store, clock, workspace)
            finally:
                shutdown.set()


def prompt_texts(dsh: FakeDsh, mode: str = "queue") -> list[str]:
    return [p["content"][0]["text"] for p in dsh.prompts(mode)]


async def test_streamed_answer_is_exact_and_the_session_is_created_once(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE), structlog.testing.capture_logs() as logs:
        async with dsh_world(tmp_path) as w:
            w.say("hello host")
            [first] = await w.answered(1)
            w.say("dsh:tool grep")
            texts = await w.answered(2)
    assert first == "echo: " + echo_of(ADA, "hello host")
    assert texts[1] == "tool grep done"
    # one workspace (created, it was not registered), one session for the chat, named
    assert [c.payload for c in w.dsh.calls_to("workspace.create")] == [{"path": str(w.workspace)}]
    [create] = w.dsh.calls_to("session.create")
    assert create.payload == {"workspaceId": "ws-1"}
    [rename] = w.dsh.calls_to("session.rename")
    assert rename.payload["title"] == "hello host"
    prompts = w.dsh.prompts()
    assert [p["mode"] for p in prompts] == ["queue", "queue"]
    assert prompts[0]["content"] == [{"type": "text", "text": echo_of(ADA, "hello host")}]
    assert isinstance(prompts[0]["clientTimeZone"], str) and prompts[0]["clientTimeZone"]
    # the answer came over the events websocket, not by polling history
    assert not w.dsh.calls_to("session.history")
    assert any(e["event"] == "turn_events_streamed" for e in logs)
    streamed = w.tg.bot_messages(CHAT)[0]
    assert streamed.history[-1] == first and streamed.history.count(first) == 1


async def test_token_is_sent_as_bearer_and_never_logged(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE), structlog.testing.capture_logs() as logs:
        async with dsh_world(tmp_path, token="${DSH_TOKEN}") as w:
            w.dsh.token = "dsh-secret-token"
            w.say("with a token")
            [answer] = await w.answered(1)
    assert answer == "echo: " + echo_of(ADA, "with a token")
    assert {c.headers.get("authorization") for c in w.dsh.calls} == {"Bearer dsh-secret-token"}
    assert "dsh-secret-token" not in repr(logs)


async def test_steer_mid_turn_reaches_the_host_as_steer_mode(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with dsh_world(tmp_path) as w:
            w.say("dsh:slow 6")
            await w.until(lambda: any("chunk 1" in m.text for m in w.tg.bot_messages(CHAT)))
            w.say("/steer mind the tests")
            await w.until(lambda: len(w.tg.bot_messages(CHAT)) >= 2)
            await w.until(lambda: any("chunk 5" in t for t in w.texts()))
            await trio.sleep(3)
    [steer] = w.dsh.prompts("steer")
    assert steer["content"] == [{"type": "text", "text": "mind the tests"}]
    assert steer["sessionId"] == w.dsh.prompts("queue")[0]["sessionId"]
    texts = w.texts()
    assert "Sent to the running answer." in texts
    [answer] = [t for t in texts if t.startswith("chunk 0")]
    assert "[steer] mind the tests" in answer and answer.endswith("chunk 5")


async def test_stop_cancels_the_turn_on_the_host_and_keeps_the_inbox(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE), structlog.testing.capture_logs() as logs:
        async with dsh_world(tmp_path) as w:
            w.say("dsh:slow 50")
            await w.until(lambda: any("chunk 1" in m.text for m in w.tg.bot_messages(CHAT)))
            w.say("/stop")
            await w.until(lambda: any(e["event"] == "turn_finished" for e in logs))
            await trio.sleep(3)
            w.say("after the stop")
            await w.until(lambda: any("after the stop" in t for t in w.texts()))
    [cancel] = w.dsh.calls_to("session.cancel")
    assert cancel.payload["keepInbox"] is True
    stopped = w.texts()[0]
    assert stopped.startswith("chunk 0") and "chunk 49" not in stopped
    assert any(e["event"] == "turn_cancelled" for e in logs)
    assert w.texts()[-1] == "echo: " + echo_of(ADA, "after the stop")


async def test_stop_of_a_host_that_ignores_cancel_abandons_the_turn_within_10_s(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE), structlog.testing.capture_logs() as logs:
        async with dsh_world(tmp_path) as w:
            w.say("dsh:hang")
            await w.until(lambda: any("working" in m.text for m in w.tg.bot_messages(CHAT)))
            stop_at = trio.current_time()
            w.say("/stop")
            await w.until(lambda: any(e["event"] == "turn_finished" for e in logs))
            took = trio.current_time() - stop_at
    assert any(e["event"] == "turn_abandoned" for e in logs)
    assert took <= 12
    assert "stopped" in w.texts()[0].lower()
    # The chat says that the host did not stop in time (not only the log).
    assert "did not stop this answer within 10 s" in w.texts()[0]


async def test_approval_is_answered_over_im(autojump_clock: trio.abc.Clock, tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with dsh_world(tmp_path) as w:
            w.say("dsh:approve")
            await w.until(lambda: any("shell" in t for t in w.texts()))
            w.say("yes")
            await w.until(lambda: any(t.startswith("approval:") for t in w.texts()))
            await trio.sleep(3)
    texts = w.texts()
    [asked] = [t for t in texts if "shell" in t and "1." in t]
    assert "Allow once" in asked and "Reject" in asked and "run `ls -la`" in asked
    assert 'arguments: {"command": "ls -la"}' in asked
    assert "approval: allowed-once" in texts
    [respond] = w.dsh.calls_to("respond")
    assert respond.rpc_id is not None and respond.rpc_id.startswith("approval-")


async def test_approval_resolved_in_another_client_closes_it_in_chat(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with dsh_world(tmp_path) as w:
            w.say("dsh:approve")
            await w.until(lambda: any("shell" in t for t in w.texts()))
            [rpc] = list(w.dsh.pending)
            w.dsh.resolve_elsewhere(rpc, "rejected")
            await w.until(lambda: any("approval: rejected" in t for t in w.texts()))
            await trio.sleep(3)
            w.say("yes")  # no longer an answer: a new prompt
            await w.until(lambda: any(t.endswith("yes") for t in w.texts()))
    [answer] = [t for t in w.texts() if "approval: rejected" in t]
    assert "answered in another client: rejected" in answer
    assert not w.dsh.calls_to("respond")


async def test_question_is_answered_by_number(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with dsh_world(tmp_path) as w:
            w.say("dsh:ask2")
            await w.until(lambda: any("Which colour?" in t for t in w.texts()))
            w.say("2")
            await w.until(lambda: any("Which sizes?" in t for t in w.texts()))
            w.say("1, 3")
            await w.until(lambda: any(t.startswith("answer:") for t in w.texts()))
            await trio.sleep(3)
    assert "answer: Blue; S,L" in w.texts()
    [respond] = w.dsh.calls_to("respond")
    assert respond.status == 200


async def test_quote_of_an_old_answer_is_recovered_from_the_host_history(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with dsh_world(tmp_path) as w:
            w.say("first")
            await w.answered(1)
            [sid] = list(w.dsh.sessions)
            # An answer dshim's transcript lacks (given in DSH's own UI, an hour ago),
            # shown in the chat by an earlier install of the bot: Telegram sends it bare.
            old_at = w.clock() - 3600
            w.dsh.seed_answer(sid, "what is 6x7?", "It is 42, as always.", at=old_at)
            bot = {"id": 123456, "is_bot": True, "first_name": "dshim test"}
            w.tg.add_update(
                {
                    "message": {
                        "message_id": 500,
                        "from": ADA,
                        "chat": w.chat,
                        "date": int(w.clock()),
                        "text": "why?",
                        "reply_to_message": {
                            "message_id": 77,
                            "from": bot,
                            "chat": w.chat,
                            "date": int(old_at),
                        },
                    }
                }
            )
            await w.until(lambda: len(w.dsh.prompts()) == 2)
            await w.answered(2)
    text = prompt_texts(w.dsh)[1]
    block = text.split("<dsh_im_reply_to>", 1)[1].split("</dsh_im_reply_to>", 1)[0]
    quoted = json.loads(block)
    assert quoted["messageId"] == "77"
    assert quoted["content"] == "It is 42, as always."
    assert text.startswith(source(ADA)) and text.endswith("why?")
    history = w.dsh.calls_to("session.history")
    assert history and all(c.payload["maxMessages"] == 100 for c in history)


async def test_host_down_gets_one_clear_reply_and_the_next_message_works(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with dsh_world(tmp_path) as w:
            w.say("hello")
            await w.answered(1)
            w.dsh.down = True
            await w.dsh.close_mux()
            w.say("are you there?")
            await w.answered(2)
            w.dsh.down = False
            w.say("back again")
            await w.until(lambda: any("back again" in t for t in w.texts()))
            await trio.sleep(3)
    texts = w.texts()
    assert len(texts) == 3
    assert "cannot reach the DSH host" in texts[1]
    assert texts[2] == "echo: " + echo_of(ADA, "back again")


async def test_mux_unavailable_falls_back_to_polling_and_answers_once(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE), structlog.testing.capture_logs() as logs:
        async with dsh_world(tmp_path) as w:
            w.dsh.mux_enabled = False
            await w.dsh.close_mux()
            w.say("dsh:slow 3")
            [answer] = await w.answered(1)
    assert answer == "chunk 0 chunk 1 chunk 2"
    polled = [e for e in logs if e["event"] == "turn_events_polled"]
    assert polled and polled[0]["reason"] == "events mux unavailable"
    history = w.dsh.calls_to("session.history")
    assert len(history) >= 3
    assert all(b.at - a.at >= 0.3 - 1e-6 for a, b in zip(history[1:], history[2:], strict=False))
    assert w.tg.bot_messages(CHAT)[0].history.count(answer) == 1


async def test_status_names_the_host_version_and_models_are_listed_and_chosen(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with dsh_world(tmp_path) as w:
            w.say("/status")
            await w.answered(1)
            w.say("/models")
            await w.answered(2)
            w.say("/model 2")
            await w.answered(3)
            w.say("which model?")
            await w.until(lambda: any("which model?" in t for t in w.texts()))
            await trio.sleep(3)
    status, models, chosen, answer = w.texts()
    assert f"Harness (dsh): reachable — DSH host {VERSION} at {w.dsh.url}" in status
    assert models == "Models:\n1. deepseek/deepseek-chat\n2. deepseek/deepseek-reasoner"
    assert chosen == "Model set to deepseek/deepseek-reasoner."
    assert answer.startswith("[deepseek-reasoner] echo: ")
