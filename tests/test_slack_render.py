"""Slack outbound against the fake Slack (real HTTP on 127.0.0.1, autojump clock).

The streams are driven directly, as the pipeline drives them (``update`` with the whole
text so far, then ``finish``), so that the cases the echo harness cannot produce -- text
that diverges from what was streamed -- are covered; the end-to-end tests run the rest.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from dshim.channels.slack.client import WebClient
from dshim.channels.slack.protocol import Route
from dshim.channels.slack.render import SlackOutbound
from dshim.model import ReplyTarget
from dshim.testing.fakes.slack import FakeSlack, open_fake_slack


def esc(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


@asynccontextmanager
async def outbound(**kw: Any) -> AsyncIterator[tuple[FakeSlack, SlackOutbound]]:
    with trio.fail_after(600):
        async with open_fake_slack() as fake, httpx.AsyncClient() as http:
            web = WebClient(
                http, bot_token=fake.bot_token, app_token=fake.app_token, api_base=fake.api_base
            )
            yield fake, SlackOutbound(web, clock=time.time, **kw)


def target(fake: FakeSlack, channel: str | None = None) -> ReplyTarget:
    channel = channel or fake.dm
    msg = fake.add_message(channel, "question")
    kind = fake.channel_types[channel]
    return ReplyTarget(
        conversation_id=channel,
        conversation_type="direct" if kind == "im" else "group",
        reply_to_message_id=msg.ts,
        route=Route(thread_ts=msg.ts, user=fake.user, team=fake.team_id, channel_type=kind),
    )


async def test_diverging_text_stops_the_stream_and_finishes_by_update_once(
    autojump_clock: object,
) -> None:
    async with outbound() as (fake, ob):
        to = target(fake)
        async with ob.open_stream(to) as stream:
            await stream.update("Hello wor")
            await trio.sleep(1)
            await stream.update("Hello world, part one <!channel>")
            await trio.sleep(1)
            await stream.update("Rewritten from the start")  # the agent rewrote it
            await trio.sleep(3)
            delivered = await stream.finish("Rewritten from the start, done.")
        [msg] = fake.bot_messages(fake.dm)
        assert msg.text == "Rewritten from the start, done." and not msg.streaming
        assert [d.message_id for d in delivered] == [msg.ts]
        assert delivered[0].text == "Rewritten from the start, done."
        assert len(fake.calls_to("chat.startStream")) == 1
        assert len(fake.calls_to("chat.stopStream")) == 1
        assert not fake.calls_to("chat.postMessage")  # the streamed message was edited
        assert fake.calls_to("chat.update")
        # the mention the model wrote never reached Slack unescaped
        assert all("<!channel>" not in str(c.args) for c in fake.calls)


async def test_streaming_unavailable_falls_back_and_is_remembered(autojump_clock: object) -> None:
    async with outbound() as (fake, ob):
        fake.stream_unsupported.add("channel")
        for n in range(2):
            to = target(fake, fake.general)
            async with ob.open_stream(to) as stream:
                await stream.update(f"answer {n} so far")
                await trio.sleep(2)
                await stream.update(f"answer {n} so far, and more")
                await trio.sleep(2)
                await stream.finish(f"answer {n} so far, and more. The end.")
        assert fake.texts(fake.general) == [
            "answer 0 so far, and more. The end.",
            "answer 1 so far, and more. The end.",
        ]
        assert len(fake.calls_to("chat.startStream")) == 1  # not asked again
        posts = fake.calls_to("chat.postMessage")
        assert len(posts) == 2 and all(p.args["thread_ts"] for p in posts)
        updates = fake.calls_to("chat.update")
        assert all(len(u.args["markdown_text"]) <= 4000 for u in updates)


async def test_rate_limited_appends_still_deliver_the_final_text_once(
    autojump_clock: object,
) -> None:
    async with outbound() as (fake, ob):
        fake.fail_next("chat.appendStream", 3, status=429, retry_after=2)
        to = target(fake)
        text = ""
        async with ob.open_stream(to) as stream:
            for i in range(10):
                text += f"piece {i}. "
                await stream.update(text)
                await trio.sleep(0.2)
            await stream.finish(text.strip())
        assert fake.texts(fake.dm) == [text.strip()]
        limited = [c for c in fake.calls_to("chat.appendStream") if c.status == 429]
        assert len(limited) == 3
        ok = [c.at for c in fake.calls_to("chat.appendStream") if c.status == 200]
        # nothing was sent to the method while Slack asked for silence
        assert all(t >= limited[-1].at + 2 - 1e-6 for t in ok if t > limited[-1].at)


async def test_fallback_splits_long_answers_and_survives_a_429_storm(
    autojump_clock: object,
) -> None:
    async with outbound(stream=False) as (fake, ob):
        fake.fail_next("chat.update", 4, status=429, retry_after=3)
        to = target(fake, fake.general)
        words = " ".join(f"word{i}" for i in range(1200))  # ~9,000 characters
        async with ob.open_stream(to) as stream:
            await stream.update(words[:3000])
            await trio.sleep(2)
            await stream.update(words[:6000])
            await trio.sleep(2)
            delivered = await stream.finish(words)
        texts = fake.texts(fake.general)
        assert len(texts) == 3 and all(len(t) <= 4000 for t in texts)
        assert " ".join(texts) == words
        assert len(delivered) == 3
        assert not fake.calls_to("chat.startStream")
        posts = fake.calls_to("chat.postMessage")
        assert len(posts) == 3
        gaps = [b.at - a.at for a, b in zip(posts, posts[1:], strict=False)]
        assert all(g >= 1.0 - 1e-6 for g in gaps)  # ~1 post per second per channel


async def test_notice_text_is_escaped_and_posted_in_the_thread(autojump_clock: object) -> None:
    async with outbound() as (fake, ob):
        to = target(fake, fake.general)
        [d] = await ob.send_text(to, "Ping <!everyone> & <@U0BOB0002>")
        [msg] = fake.bot_messages(fake.general)
        assert msg.ts == d.message_id and msg.thread_ts == to.reply_to_message_id
        assert msg.text == esc("Ping <!everyone> & <@U0BOB0002>")


async def test_a_post_whose_connection_dropped_is_repeated_once(autojump_clock: object) -> None:
    async with outbound(stream=False) as (fake, ob):
        fake.drop_next("chat.postMessage")
        to = target(fake)
        async with ob.open_stream(to) as stream:
            await stream.update("short answer")
            await trio.sleep(3)
            await stream.finish("short answer, final")
        assert fake.texts(fake.dm) == ["short answer, final"]
        # the dropped request never reached the fake's log; the one repeat did
        assert len(fake.calls_to("chat.postMessage")) == 1


async def test_an_answer_that_comes_whole_is_still_streamed_natively(
    autojump_clock: object,
) -> None:
    async with outbound() as (fake, ob):
        to = target(fake)
        async with ob.open_stream(to) as stream:
            [d] = await stream.finish("all at once")
        [msg] = fake.bot_messages(fake.dm)
        assert msg.text == "all at once" and msg.ts == d.message_id and not msg.streaming
        assert [c.method for c in fake.calls if c.method.startswith("chat.")] == [
            "chat.startStream",
            "chat.stopStream",
        ]
