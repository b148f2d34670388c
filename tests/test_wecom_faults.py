"""The fault matrix on WeCom: a 10-second outage while 20 users wait for answers.

The bot runs through serve_bots against the fake WeCom long connection (127.0.0.1,
autojump clock, real SQLite store, echo harness; see ``tests/rig_wecom.py``).  The fake's
``outage`` models on the websocket what a 500 or a dropped connection is over HTTP: for
10 s every frame (or only the replies and pushes) is answered with a server-error ack
(processed nothing), or the socket is closed instead of acking it (unprocessed), or the
frame is processed and its ack never comes.  Half of the users get an answer that comes
whole after 2 s, half one written in 6 pieces.  What the users see is counted: every
answer arrives, exactly once and complete (no bubble left streaming), except that a
push whose ack never came may show one extra copy; the bot never restarts.  An outage
longer than the retries leaves the answer to the outbox, whose delivery finishes the
bubble the answer left open.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.wecom.protocol import MARKS
from dshim.harness.echo import EchoHarness
from dshim.testing.fakes.wecom import FakeWecom
from tests.channel_contract import running
from tests.fault_matrix import matrix, restarts
from tests.rig_wecom import RESPOND, SEND, WecomRig

USERS = [f"user{i:02d}" for i in range(20)]
SENDS = (RESPOND, SEND)
MATRIX = matrix(SENDS)
DEADLINE = 1200.0


def question(i: int) -> str:
    pace = "echo:sleep 2" if i % 2 == 0 else "echo:sleep 1 echo:slow 6"
    return f"{pace} question of user {i}"


def answer_of(i: int) -> str:
    block = {"channel": "wecom", "conversationType": "direct", "senderId": USERS[i]}
    src = "<dsh_im_source>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_source>"
    return f"{src}\n\n{question(i)}"


def shown(fake: FakeWecom, i: int) -> list[str]:
    """What user ``i``'s chat shows of the bot (bubbles that show only a mark aside)."""
    return [a.text for a in fake.answers(USERS[i]) if a.text not in MARKS]


def answered(fake: FakeWecom) -> bool:
    return all(answer_of(i) in shown(fake, i) for i in range(len(USERS)))


def streaming(fake: FakeWecom) -> list[str]:
    return [s.id for s in fake.streams.values() if not s.finished]


@asynccontextmanager
async def twenty_chats(tmp_path: Path) -> AsyncIterator[FakeWecom]:
    rig = WecomRig()
    async with rig.open(), running(rig, tmp_path, harness=EchoHarness(slow_interval_s=0.4)):
        await rig.receiving()
        for i, user in enumerate(USERS):
            await rig.fake.user_message(question(i), userid=user)
        await trio.sleep(0.5)
        yield rig.fake


@pytest.mark.parametrize(("kind", "ops"), MATRIX)
async def test_a_ten_second_outage_loses_no_answer(
    tmp_path: Path, autojump_clock: trio.abc.Clock, kind: str, ops: tuple[str, ...]
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with twenty_chats(tmp_path) as fake:
            fake.outage(10.0, kind, ops)
            with trio.move_on_after(500):  # else the assertions below say what is missing
                await fake.wait_until(lambda: answered(fake))
            await trio.sleep(300)
    for i in range(len(USERS)):
        assert shown(fake, i) == [answer_of(i)], i
    assert streaming(fake) == []
    assert restarts(logs) == []


async def test_frames_lost_after_processing_show_at_most_one_extra_copy(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with twenty_chats(tmp_path) as fake:
            fake.outage(10.0, "lost", SENDS)
            with trio.move_on_after(500):
                await fake.wait_until(lambda: answered(fake))
            await trio.sleep(300)
    for i in range(len(USERS)):
        texts = shown(fake, i)
        assert texts.count(answer_of(i)) in (1, 2), texts
        assert len(texts) <= 2, texts
    assert streaming(fake) == []
    assert restarts(logs) == []


async def test_an_outage_longer_than_the_retries_delivers_from_the_outbox_when_back(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with trio.fail_after(DEADLINE), capture_logs() as logs:
        async with twenty_chats(tmp_path) as fake:
            # Longer than the engine's retries (120 s), short enough that the outbox's next
            # try (its backoff is jittered) lands well inside WeCom's 360 s stream life.
            fake.outage(200.0, "500", SENDS)
            await trio.sleep(180)
            assert all(shown(fake, i) == [] for i in range(len(USERS)))  # nothing given up
            with trio.move_on_after(400):
                await fake.wait_until(lambda: answered(fake))
            await trio.sleep(60)
    for i in range(len(USERS)):
        assert shown(fake, i) == [answer_of(i)], i
        # The thinking bubble itself got the answer: no second bubble, no push.
        [bubble] = fake.answers(USERS[i])
        assert bubble.kind == "stream" and bubble.finished, bubble
    assert streaming(fake) == []
    assert restarts(logs) == []
    assert [e for e in logs if e["event"] == "answer_postponed"]
