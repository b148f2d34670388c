"""The QQ renderer against the fake QQ, without the pipeline: streams, budgets, downloads.

The fake runs on 127.0.0.1 (port 0) in the same trio run, on the autojump clock; the
renderer is driven the way the pipeline drives it (``open_stream``, ``update``,
``finish``), so what is asserted is what a QQ user would see.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from dshim.channels.qq.client import QQApi
from dshim.channels.qq.protocol import Route
from dshim.channels.qq.render import QQOutbound
from dshim.errors import PermissionDenied
from dshim.model import ReplyTarget
from dshim.net.http import open_http
from dshim.testing.fakes.qq import FakeQQ, open_fake_qq


@asynccontextmanager
async def outbound() -> AsyncIterator[tuple[QQOutbound, FakeQQ, QQApi]]:
    async with open_fake_qq() as fake, open_http(user_agent="test") as http:
        api = QQApi(
            http,
            app_id=fake.app_id,
            client_secret=fake.client_secret,
            api_base=fake.http_url,
            token_base=fake.http_url,
        )
        yield QQOutbound(api, clock=trio.current_time, bot_username="b"), fake, api


def target_of(fake: FakeQQ, d: dict[str, object], kind: str = "c2c") -> ReplyTarget:
    inbound = fake.inbound[str(d["id"])]
    route = Route(kind, inbound.target, inbound.id, inbound.msg_idx, received=inbound.at)
    conv = f"{kind}:{inbound.target}"
    return ReplyTarget(conversation_id=conv, reply_to_message_id=inbound.id, route=route)


async def test_a_rewrite_of_shown_text_finishes_the_message_and_continues_in_a_new_one(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with outbound() as (out, fake, _):
        target = target_of(fake, fake.c2c_payload("hi"))
        async with out.open_stream(target) as stream:
            await stream.update("The first draft of")
            await trio.sleep(2)
            await stream.update("Actually, a different answer")
            await trio.sleep(2)
            delivered = await stream.finish("Actually, a different answer.")
    first, second = fake.bot_messages(fake.c2c_conversation)
    assert (first.content, first.done) == ("The first draft of", True)
    assert (second.content, second.done) == ("Actually, a different answer.", True)
    assert [d.message_id for d in delivered] == [first.ref_idx, second.ref_idx]
    assert not [c for c in fake.sends() if c.code == 40007]  # never asked QQ to rewrite


async def test_an_answer_past_2000_characters_continues_in_the_next_message(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with outbound() as (out, fake, _):
        target = target_of(fake, fake.c2c_payload("hi"))
        text = ""
        async with out.open_stream(target) as stream:
            for i in range(30):
                text += f"line {i:02d} " + "z" * 120 + "\n"
                await stream.update(text)
                await trio.sleep(0.5)
            delivered = await stream.finish(text)
    msgs = fake.bot_messages(fake.c2c_conversation)
    assert (
        len(msgs) == 2 and all(m.done for m in msgs) and all(len(m.content) <= 2000 for m in msgs)
    )
    assert "\n".join(m.content for m in msgs) == text.strip()
    assert [d.text for d in delivered] == [m.content for m in msgs]
    assert [m.seq for m in msgs] == [1, 2]


async def test_a_text_answer_uses_one_reply_per_chunk_and_stops_at_the_cap(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with outbound() as (out, fake, _):
        target = target_of(fake, fake.group_payload("hi"), "group")
        for _ in range(6):
            await out.send_text(target, "a notice")
    assert [m.seq for m in fake.bot_messages(fake.group_conversation)] == [1, 2, 3, 4, 5]
    assert len(fake.sends()) == 5  # the sixth was never attempted


async def test_the_group_window_is_respected_on_the_autojump_clock(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with outbound() as (out, fake, _):
        target = target_of(fake, fake.group_payload("hi"), "group")
        await trio.sleep(299)
        assert len(await out.send_text(target, "just in time")) == 1
        await trio.sleep(2)
        assert await out.send_text(target, "too late") == []
    assert len(fake.sends()) == 1


@pytest.mark.parametrize(
    "url",
    [
        "https://evil.example.com/a.png",
        "http://gchat.qpic.cn/a.png",
        "https://qpic.cn.evil.com/a.png",
    ],
)
async def test_attachments_download_only_from_tencent_cdn_hosts(url: str) -> None:
    async with outbound() as (_, __, api):
        with pytest.raises(PermissionDenied):
            await api.download(url, 1000)
