"""The Slack Web API client against the fake: per-method 429 pauses, lookups, errors."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest
import trio

from dshim.channels.slack.client import WebClient
from dshim.errors import AuthError, PermissionDenied, RateLimited
from dshim.testing.fakes.slack import FakeSlack, open_fake_slack


@asynccontextmanager
async def client() -> AsyncIterator[tuple[FakeSlack, WebClient]]:
    with trio.fail_after(600):
        async with open_fake_slack() as fake, httpx.AsyncClient() as http:
            yield (
                fake,
                WebClient(
                    http, bot_token=fake.bot_token, app_token=fake.app_token, api_base=fake.api_base
                ),
            )


async def test_a_429_pauses_only_that_method(autojump_clock: object) -> None:
    async with client() as (fake, web):
        msg = fake.add_message(fake.dm, "hi", bot=True)
        fake.fail_next("chat.update", 1, status=429, retry_after=5)
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: web.update(fake.dm, msg.ts, markdown="edited"))
            await trio.sleep(0.1)
            posted = await web.post_message(fake.dm, thread_ts=None, markdown="meanwhile")
            assert posted.ts and trio.current_time() - t0 < 1.0  # not held by chat.update
        updates = fake.calls_to("chat.update")
        assert [u.status for u in updates] == [429, 200]
        assert updates[1].at - updates[0].at >= 5.0 - 1e-6
        assert fake.messages[(fake.dm, msg.ts)].text == "edited"


async def test_lookup_retries_a_short_429_once_and_gives_up_on_a_long_one(
    autojump_clock: object,
) -> None:
    async with client() as (fake, web):
        target = fake.add_message(fake.general, "quoted", user=fake.other_user)
        fake.fail_next("conversations.history", 1, status=429, retry_after=2)
        found = await web.history_message(fake.general, target.ts)
        assert found is not None and found.text == "quoted"
        fake.fail_next("conversations.history", 1, status=429, retry_after=60)
        with pytest.raises(RateLimited):
            await web.history_message(fake.general, target.ts)
        assert len(fake.calls_to("conversations.history")) == 3
        # the method stays paused: the next lookup fails without a request
        with pytest.raises(RateLimited):
            await web.history_message(fake.general, target.ts)
        assert len(fake.calls_to("conversations.history")) == 3


async def test_error_strings_become_the_error_tree(autojump_clock: object) -> None:
    async with client() as (fake, web):
        fake.scopes.discard("channels:history")
        with pytest.raises(PermissionDenied) as denied:
            await web.history_message(fake.general, "1.000001")
        assert denied.value.code == "missing_scope"
        fake.revoke()
        with pytest.raises(AuthError):
            await web.auth_test()
        assert web.auth_failed.is_set()


async def test_lookups_are_get_requests_with_query_parameters(autojump_clock: object) -> None:
    async with client() as (fake, web):
        parent = fake.add_message(fake.general, "root", user=fake.other_user)
        reply = fake.add_message(fake.general, "inside", user=fake.other_user, thread_ts=parent.ts)
        found = await web.thread_message(fake.general, parent.ts, reply.ts)
        assert found is not None and found.text == "inside"
        [call] = fake.calls_to("conversations.replies")
        assert call.http_method == "GET"
        assert call.args == {
            "channel": fake.general,
            "ts": parent.ts,
            "latest": reply.ts,
            "oldest": reply.ts,
            "inclusive": "true",
            "limit": "1",
        }
        assert await web.thread_message(fake.general, parent.ts, "1.000001") is None
