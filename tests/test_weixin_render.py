"""WeChat sending and context tokens against the fake iLink API: the 24 h window, the
durable newest-wins token, its reset on another login, ids added to the index."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.base import OutboundEntry
from dshim.channels.weixin.client import USER_AGENT, IlinkClient
from dshim.channels.weixin.contexts import ContextBook
from dshim.channels.weixin.protocol import ContextToken, credential_hash, plain_text
from dshim.channels.weixin.render import MAX_MESSAGES, ReplyNotPossible, WeixinOutbound, split
from dshim.errors import ChannelError, TransportError
from dshim.net.http import open_http
from dshim.store import open_store
from dshim.store.base import BoundStore
from dshim.testing.fakes.weixin import TEST_TOKEN, USER, FakeWeixin, open_fake_weixin
from tests.helpers import Clock


@dataclass
class Rig:
    fake: FakeWeixin
    store: BoundStore
    book: ContextBook
    out: WeixinOutbound
    clock: Clock


@asynccontextmanager
async def rig(tmp_path: Path, *, credential: str = TEST_TOKEN) -> AsyncIterator[Rig]:
    clock = Clock()
    async with (
        open_fake_weixin(clock=clock) as fake,
        open_store(tmp_path, inline=True) as raw,
        open_http(fake.url, user_agent=USER_AGENT) as http,
    ):
        store = BoundStore(raw, "wx")
        book = ContextBook(
            store,
            credential=credential_hash(credential),
            clock=clock,
            register_secret=lambda s: None,
        )
        client = IlinkClient(http, TEST_TOKEN, cdn_base=fake.cdn_url)
        yield Rig(fake, store, book, WeixinOutbound(client, book, store, clock=clock), clock)


async def written(r: Rig, token: str = "ctx-1", *, seq: int = 1, at: float | None = None) -> None:
    """The user wrote: the fake and the book learn the token."""
    r.fake.issue_context(USER, token)
    await r.book.observe(USER, ContextToken(token, seq, None), at=at)


async def test_a_reply_outside_24_h_is_not_attempted(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with rig(tmp_path) as r:
        await written(r, at=r.clock() - 24 * 3600 - 1)
        with capture_logs() as logs, pytest.raises(ReplyNotPossible):
            await r.out.deliver(USER, "late")
        assert r.fake.calls_to("sendmessage") == []
        assert [e["reason"] for e in logs if e["event"] == "reply_not_attempted"] == [
            "reply_window_closed"
        ]
        await written(r, "ctx-2", seq=2)
        [d] = await r.out.deliver(USER, "in time")
    assert [b.text for b in r.fake.sent_to(USER)] == ["in time"]
    assert d.message_id == str(r.fake.bot_messages[0].server_id)


async def test_a_user_who_never_wrote_gets_no_attempt(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with rig(tmp_path) as r:
        with pytest.raises(ReplyNotPossible):
            await r.out.deliver(USER, "hello?")
    assert r.fake.calls == []


async def test_the_newest_token_wins_durably_and_resets_on_another_login(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with rig(tmp_path) as r:
        assert await r.book.observe(USER, ContextToken("new", 5, 2000))
        assert not await r.book.observe(USER, ContextToken("redelivered-old", 4, 3000))
    async with rig(tmp_path) as r:  # a restart: read back from the store
        ctx = await r.book.get(USER)
        assert ctx is not None and ctx.token.token == "new"
    async with rig(tmp_path, credential="another-login-token") as r:
        assert await r.book.get(USER) is None


async def test_the_client_id_is_added_to_the_index_before_the_next_message(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with rig(tmp_path) as r:
        await written(r)
        [d] = await r.out.deliver(USER, "indexed twice")
        # The pipeline records the delivered message under its id after the turn.
        entry = OutboundEntry(
            message_ids=[d.message_id], text=d.text, sent_at=d.sent_at, completed_at=d.completed_at
        )
        await r.store.record_outbound(USER, entry, now=r.clock())
        await r.out.flush_ids(USER)
        client_id = r.fake.bot_messages[0].client_id
        [found] = await r.store.indexed(USER, client_id, now=r.clock())
    assert found.text == "indexed twice" and d.message_id in found.message_ids


async def test_an_unknown_outcome_is_repeated_once_with_the_same_client_id(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with rig(tmp_path) as r:
        await written(r)
        r.fake.outage(100.0, "lost", ("sendmessage",))  # processed, the answers lost
        with pytest.raises(TransportError):
            await r.out.deliver(USER, "maybe")
        sends = r.fake.calls_to("sendmessage")
    assert len(sends) == 2  # the first and one repeat, never a loop
    assert sends[0].body["msg"]["client_id"] == sends[1].body["msg"]["client_id"]
    assert sends[1].at - sends[0].at >= 15  # the repeat waited for the outage to pass


async def test_5xx_answers_created_nothing_and_are_retried_until_one_goes_out(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with rig(tmp_path) as r:
        await written(r)
        r.fake.fail_next("sendmessage", 5, status=502)
        [delivered] = await r.out.deliver(USER, "at last")
        sends = r.fake.calls_to("sendmessage")
    assert [c.status for c in sends] == [502] * 5 + [200]
    assert [b.text for b in r.fake.bot_messages] == ["at last"]
    assert delivered.text == "at last"


def test_split_keeps_at_most_8_messages_and_says_it_cut() -> None:
    text = "\n\n".join("x" * 3000 for _ in range(12))
    chunks = split(text)
    assert len(chunks) == MAX_MESSAGES and all(len(c) <= 4000 for c in chunks)
    assert chunks[-1].endswith("answer cut: WeChat accepts only a few replies per message]")
    assert split("**done**") == ["done"] == [plain_text("**done**")]


async def test_the_quote_loader_finds_by_id_then_time_and_applies_a_partial_quote(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    from dshim.channels.weixin.channel import quote_loader
    from dshim.channels.weixin.models import PartialText
    from dshim.channels.weixin.protocol import QuoteLookup

    async with rig(tmp_path) as r:
        now = r.clock()
        mine = OutboundEntry(
            message_ids=["111"],
            text="alpha beta gamma",
            sent_at=now - 60,
            completed_at=now - 60,
            inbound=True,
            author_id=USER,
        )
        bots = OutboundEntry(
            message_ids=["222"], text="the answer", sent_at=now - 30, completed_at=now - 29
        )
        for e in (mine, bots):
            await r.store.record_outbound(USER, e, now=now)
        factory = quote_loader(r.store, r.clock, bot_id="bot@im.bot", bot_name="wx")
        partial = PartialText(start="beta", end="gamma")
        by_id = await factory(QuoteLookup(USER, ("111",), (), partial))()
        by_time = await factory(QuoteLookup(USER, ("999",), (now - 20,)))()
        far = await factory(QuoteLookup(USER, ("999",), (now - 500,)))()
    assert by_id is not None and (by_id.content, by_id.author_id) == ("beta gamma", USER)
    assert by_time is not None
    assert (by_time.content, by_time.author_id, by_time.author_name) == (
        "the answer",
        "bot@im.bot",
        "wx",
    )
    assert far is not None and far.content is msgspec.UNSET  # nothing: history is next


async def test_the_fake_refuses_an_eleventh_reply_to_one_message(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with rig(tmp_path) as r:
        await written(r)
        for i in range(10):
            await r.out.deliver(USER, f"reply {i}")
        with pytest.raises(ChannelError):
            await r.out.deliver(USER, "one too many")
        rets = [c.ret for c in r.fake.calls_to("sendmessage")]
    assert rets == [0] * 10 + [-2, -2]  # refused, retried once after 3 s, refused again


async def test_the_token_that_worked_survives_a_restart_and_replaces_a_refused_one(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async with rig(tmp_path) as r:
        await written(r, "ctx-good")
        await r.out.deliver(USER, "one")
    async with rig(tmp_path) as r:  # a restart: the book is read back from the store
        r.fake.issue_context(USER, "ctx-good")
        await written(r, "ctx-refused", seq=2)
        r.fake.revoke("ctx-refused")
        await r.out.deliver(USER, "two")
        await r.out.deliver(USER, "three")  # the refused token is not tried first again
        sends = [(c.ret, c.body["msg"]["context_token"]) for c in r.fake.calls_to("sendmessage")]
        await written(r, "ctx-next", seq=3)  # the user writes again: the newest wins
        await r.out.deliver(USER, "four")
        last = r.fake.calls_to("sendmessage")[-1].body["msg"]["context_token"]
    assert sends == [(-2, "ctx-refused"), (0, "ctx-good"), (0, "ctx-good")]
    assert [b.text for b in r.fake.sent_to(USER)] == ["two", "three", "four"]
    assert last == "ctx-next"
