"""WeCom pushes (``aibot_send_msg``) through failures, against the fake long connection
on 127.0.0.1 (autojump clock): WeCom keeps no record of a push's req_id, so a push whose
ack never came is repeated once, after ``unknown_repeat_wait_s`` and once a socket is
up, and never a third time; one that certainly never went out is retried."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from dshim.channels.wecom import protocol as p
from dshim.channels.wecom.client import LinkTuning, WecomLink
from dshim.channels.wecom.render import WecomOutbound
from dshim.errors import TransportError
from dshim.pipeline.notices import outcome_of
from dshim.testing.fakes.wecom import FakeWecom, open_fake_wecom


@asynccontextmanager
async def outbound(fake: FakeWecom) -> AsyncIterator[WecomOutbound]:
    link = WecomLink(
        fake.ws_url, fake.bot_id, fake.secret, rng=random.Random(1), tuning=LinkTuning()
    )
    callbacks_in, _callbacks = trio.open_memory_channel[p.Callback](16)
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run, callbacks_in)
        yield WecomOutbound(link, clock=trio.current_time)
        nursery.cancel_scope.cancel()


async def test_a_push_dropped_with_the_socket_is_repeated_once_it_is_back(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(120):
        async with open_fake_wecom() as fake, outbound(fake) as out:
            fake.drop_next(p.SEND)  # closed instead of acked, unprocessed
            [d] = await out.push(fake.user_id, ["hello"])
    first, second = fake.frames(p.SEND)
    assert second.at - first.at >= 15.0  # the pause before the one repeat
    assert second.conn != first.conn  # on the socket that came back
    assert [m.content for m in fake.pushes] == ["hello"]
    assert d.message_id == second.req_id


async def test_a_push_never_acked_twice_is_not_sent_a_third_time(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(300):
        async with open_fake_wecom() as fake, outbound(fake) as out:
            fake.outage(1000.0, "lost", (p.SEND,))  # processed, the ack never comes
            with pytest.raises(TransportError) as caught:
                await out.push(fake.user_id, ["hello"])
            await trio.sleep(200)
    assert len(fake.frames(p.SEND)) == 2
    assert outcome_of(caught.value) == "unknown"  # maybe shown: not for the outbox


async def test_a_push_refused_with_server_errors_goes_to_the_outbox_after_120_s(
    autojump_clock: trio.abc.Clock,
) -> None:
    with trio.fail_after(300):
        async with open_fake_wecom() as fake, outbound(fake) as out:
            fake.outage(1000.0, "500", (p.SEND,))
            t0 = trio.current_time()
            with pytest.raises(TransportError) as caught:
                await out.push(fake.user_id, ["hello"])
            took = trio.current_time() - t0
    assert 90.0 <= took <= 120.0 + 5.0
    assert outcome_of(caught.value) == "later"
    assert fake.pushes == []
