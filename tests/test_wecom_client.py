"""The WeCom long connection (``WecomLink``) against the fake, on the autojump clock:
per-``req_id`` ordering, ack timeouts, pending frames failing when the socket closes,
the subscribe as the credential check."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

import pytest
import trio

from dshim.channels.wecom import protocol as p
from dshim.channels.wecom.client import LinkTuning, WecomLink
from dshim.errors import AuthError, ChannelError, TransportError
from dshim.testing.fakes.wecom import FakeWecom, open_fake_wecom


@asynccontextmanager
async def linked(fake: FakeWecom, **tuning: float) -> AsyncIterator[WecomLink]:
    link = WecomLink(
        fake.ws_url, fake.bot_id, fake.secret, rng=random.Random(1), tuning=LinkTuning(**tuning)
    )
    callbacks_in, _callbacks = trio.open_memory_channel[p.Callback](16)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run, callbacks_in)
        yield link
        nursery.cancel_scope.cancel()


def push(text: str) -> dict[str, object]:
    return p.push_markdown_body("zhangsan", text)


async def test_frames_of_one_req_id_wait_for_each_ack(autojump_clock: trio.abc.Clock) -> None:
    async with open_fake_wecom() as fake, linked(fake) as link:
        fake.ack_delay_s = 0.5
        await fake.user_message("hi")
        [rid] = [f.req_id for f in fake.inbound.values() if f.kind == "msg"]
        async with trio.open_nursery() as nursery:
            for i in range(6):
                body_i = p.stream_body("s1", f"text {i}", finish=False)
                nursery.start_soon(partial(link.request, p.RESPOND, rid, body_i, what="s"))
    frames = fake.frames(p.RESPOND)
    assert fake.order_violations == []
    assert [f.errcode for f in frames] == [0] * 6
    assert sorted(f.body["stream"]["content"] for f in frames) == [f"text {i}" for i in range(6)]
    assert all(b.at - a.at >= 0.5 for a, b in zip(frames, frames[1:], strict=False))


async def test_other_req_ids_do_not_wait(autojump_clock: trio.abc.Clock) -> None:
    async with open_fake_wecom() as fake, linked(fake) as link:
        fake.ack_delay_s = 1.0
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            for i in range(5):
                rid = f"aibot_send_msg_{i}"
                nursery.start_soon(partial(link.request, p.SEND, rid, push("x"), what="push"))
        assert trio.current_time() - t0 < 1.5


async def test_a_missing_ack_times_out_after_five_seconds(autojump_clock: trio.abc.Clock) -> None:
    async with open_fake_wecom() as fake, linked(fake) as link:
        fake.slow_next(p.SEND, 30.0)
        t0 = trio.current_time()
        with pytest.raises(TransportError) as info:
            await link.request(p.SEND, "aibot_send_msg_1", push("x"), what="push")
        assert trio.current_time() - t0 == pytest.approx(5.0, abs=0.1)
        assert info.value.request_sent


async def test_pending_frames_fail_when_the_socket_closes(autojump_clock: trio.abc.Clock) -> None:
    async with open_fake_wecom() as fake, linked(fake) as link:
        fake.drop_next(p.SEND)
        fake.ack_delay_s = 0.5
        results: list[str] = []

        async def one(i: int) -> None:
            try:
                await link.request(p.SEND, "aibot_send_msg_same", push(str(i)), what="push")
                results.append("ok")
            except p.ConnectionLost:
                results.append("lost")

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
        assert results == ["lost", "lost", "lost"]  # the queued ones fail too
        await fake.wait_until(lambda: fake.live is not None and fake.live.index == 1)
        await link.request(p.SEND, "aibot_send_msg_after", push("again"), what="push")
    assert [x.content for x in fake.pushes] == ["again"]


async def test_a_rejected_subscribe_is_fatal_at_once(autojump_clock: trio.abc.Clock) -> None:
    async with open_fake_wecom() as fake:
        link = WecomLink(fake.ws_url, fake.bot_id, "wrong-secret", rng=random.Random(1))
        callbacks_in, _callbacks = trio.open_memory_channel[p.Callback](1)
        with pytest.raises(AuthError) as info:
            await link.run(callbacks_in)
        assert "wrong-secret" not in str(info.value)
        assert [ok for _, ok in fake.subscribes] == [False]


async def test_unreachable_server_backs_off(autojump_clock: trio.abc.Clock) -> None:
    link = WecomLink("ws://127.0.0.1:9", "b", "s", rng=random.Random(1))
    callbacks_in, _callbacks = trio.open_memory_channel[p.Callback](1)
    t0 = trio.current_time()
    with trio.move_on_after(60):
        await link.run(callbacks_in)
    assert trio.current_time() - t0 >= 60
    assert not link.live


async def test_a_cancelled_sender_keeps_its_req_id_busy_until_the_ack(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_fake_wecom() as fake, linked(fake) as link:
        fake.ack_delay_s = 2.0
        with trio.move_on_after(0.5):
            await link.request(p.SEND, "aibot_send_msg_x", push("first"), what="push")
        await link.request(p.SEND, "aibot_send_msg_x", push("second"), what="push")
        [a, b] = fake.frames(p.SEND)
        assert b.at - a.at >= 2.0
    assert fake.order_violations == []


async def test_the_queue_per_req_id_is_bounded(
    autojump_clock: trio.abc.Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(p, "REQ_QUEUE_MAX", 2)
    async with open_fake_wecom() as fake, linked(fake) as link:
        fake.ack_delay_s = 1.0
        refused: list[str] = []

        async def one(i: int) -> None:
            try:
                await link.request(p.SEND, "aibot_send_msg_q", push(str(i)), what="push")
            except ChannelError as exc:
                refused.append(str(exc))

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(one, i)
        assert len(refused) == 1 and "already wait" in refused[0]
        assert len(fake.pushes) == 2
