"""End to end: the real QQ channel, run by ``serve_bots``, against the fake QQ.

See ``tests/rig_qq.py`` for the testing manifesto (127.0.0.1, autojump clock, real
SQLite store, echo harness).
"""

from __future__ import annotations

from pathlib import Path

import trio

from tests.rig_qq import echo, running_bot, texts


async def test_a_direct_message_is_answered_by_a_closed_native_stream(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with running_bot(tmp_path) as (bot, fake):
        d = await fake.c2c_message("echo:slow 6 tell me a story")
        expected = echo(fake, "echo:slow 6 tell me a story")
        await fake.wait_until(lambda: expected in texts(fake, fake.c2c_conversation))
        await trio.sleep(5)
    [answer] = fake.bot_messages(fake.c2c_conversation)
    assert answer.stream and answer.done
    assert answer.content == expected
    assert len(answer.shown) >= 3 and answer.shown.count(expected) == 1
    assert all(expected.startswith(t) for t in answer.shown)
    assert answer.msg_id == d["id"] and answer.seq == 1
    # the answer quotes the user's message by its msg_idx (never by its id)
    assert answer.reference == fake.inbound[d["id"]].msg_idx
    chunks = [c for c in fake.calls if c.path.endswith("/stream_messages")]
    gaps = [b.at - a.at for a, b in zip(chunks, chunks[1:], strict=False)]
    assert min(gaps) >= 0.7 - 1e-9
    assert [c.json["index"] for c in chunks] == list(range(len(chunks)))
    assert chunks[-1].json["input_state"] == 10
    assert all(c.json["msg_seq"] == 1 and c.json["msg_id"] == d["id"] for c in chunks)
