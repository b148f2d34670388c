"""End to end: ``dshim serve``'s own code path against the fake iLink API.

Testing manifesto: the bot runs through :func:`dshim.serve.serve_bots` -- supervisor,
channel, client, pipeline, SQLite store, renderer -- against
:mod:`dshim.testing.fakes.weixin` on 127.0.0.1, port 0, with the echo harness, on trio's
autojump clock, with a hard virtual deadline.  Assertions are about what the chat shows
and what the agent receives.
"""

from __future__ import annotations

from pathlib import Path

import trio

from tests.weixin_world import DEADLINE, echo_of, polling, running_bot, texts, weixin_world


async def test_dm_is_answered_once_with_the_exact_text_and_typing(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with weixin_world(tmp_path) as w, running_bot(w):
            await polling(w.fake)
            w.fake.user_message("echo:slow 12 tell me a story")
            expected = echo_of("echo:slow 12 tell me a story")
            await w.fake.wait_until(lambda: expected in texts(w.fake))
            await trio.sleep(10)
    assert texts(w.fake) == [expected]
    statuses = [s for _, s in w.fake.typing]
    assert statuses.count(1) >= 2 and statuses[-1] == 2
    send_at = w.fake.calls_to("sendmessage")[0].at
    assert w.fake.calls_to("sendtyping")[-1].at <= send_at
