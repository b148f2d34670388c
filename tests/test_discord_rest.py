"""The Discord REST client over ``httpx.MockTransport``: rate limits, retries, error mapping;
and table tests of the sans-IO parts it runs on (``classify_error``, ``RateLimiter``).

Every client test runs on trio's autojump clock (the client reads ``trio.current_time``), so
waits for ``retry_after`` and bucket resets are exact and instant; each has a hard
deadline.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import trio

from dshim.channels.discord.client import USER_AGENT, RestClient
from dshim.channels.discord.protocol import (
    MAX_BUCKETS,
    MAX_RETRY_AFTER_S,
    RateLimiter,
    RateLimitHit,
    classify_error,
    rate_limit_hit,
)
from dshim.errors import (
    AuthError,
    ChannelError,
    NotFound,
    PermissionDenied,
    RateLimited,
    RemoteProtocolError,
    TransportError,
)

TOKEN = "MTA1.secret-token.value"
BASE = "https://discord.test/api/v10"
DEADLINE = 120  # virtual seconds


class Server:
    """A scripted REST endpoint: answers from a function, records (time, request)."""

    def __init__(self, answer: Callable[[httpx.Request, int], httpx.Response]) -> None:
        self.answer = answer
        self.seen: list[tuple[float, httpx.Request]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.seen.append((trio.current_time(), request))
        return self.answer(request, len(self.seen))

    def paths(self) -> list[str]:
        return [r.method + " " + r.url.path.removeprefix("/api/v10") for _, r in self.seen]


def ok(
    body: Any = None, headers: dict[str, str] | None = None, status: int = 200
) -> httpx.Response:
    return httpx.Response(status, json=body if body is not None else {"id": "1"}, headers=headers)


def limited(
    retry_after: float, *, is_global: bool = False, headers: dict[str, str] | None = None
) -> httpx.Response:
    h = {
        "retry-after": str(int(retry_after) + 1),
        "x-ratelimit-scope": "global" if is_global else "user",
    }
    if is_global:
        h["x-ratelimit-global"] = "true"
    h.update(headers or {})
    return httpx.Response(
        429,
        json={
            "message": "You are being rate limited.",
            "retry_after": retry_after,
            "global": is_global,
        },
        headers=h,
    )


def client(server: Server, **kw: Any) -> tuple[httpx.AsyncClient, RestClient]:
    http = httpx.AsyncClient(transport=httpx.MockTransport(server))
    return http, RestClient(http, token=TOKEN, api_base=BASE, **kw)


async def test_sends_bot_authorization_user_agent_and_json(autojump_clock: object) -> None:
    server = Server(lambda r, n: ok({"id": "55", "channel_id": "7", "content": "hi"}))
    http, rest = client(server)
    async with http:
        with trio.fail_after(DEADLINE):
            created = await rest.create_message("7", "hi", reply_to="42", nonce="abc")
    assert created.id == "55"
    _, req = server.seen[0]
    assert req.headers["authorization"] == f"Bot {TOKEN}"
    assert req.headers["user-agent"] == USER_AGENT and USER_AGENT.startswith("DiscordBot (")
    assert req.headers["content-type"] == "application/json"
    assert json.loads(req.content) == {
        "content": "hi",
        "allowed_mentions": {"parse": [], "replied_user": False},
        "message_reference": {"message_id": "42", "fail_if_not_exists": False},
        "nonce": "abc",
        "enforce_nonce": True,
    }
    assert server.paths() == ["POST /channels/7/messages"]


async def test_429_waits_retry_after_then_retries(autojump_clock: object) -> None:
    server = Server(lambda r, n: limited(2.5) if n == 1 else ok())
    http, rest = client(server)
    async with http:
        with trio.fail_after(DEADLINE):
            await rest.edit_message("7", "9", "text")
    (t1, _), (t2, _) = server.seen
    assert t2 - t1 == pytest.approx(2.5)


async def test_429_retries_are_capped(autojump_clock: object) -> None:
    server = Server(lambda r, n: limited(1.0))
    http, rest = client(server, max_retries=3)
    async with http:
        with trio.fail_after(DEADLINE), pytest.raises(RateLimited) as exc_info:
            await rest.edit_message("7", "9", "text")
    assert len(server.seen) == 4
    assert exc_info.value.retry_after == 1.0 and exc_info.value.status == 429


async def test_retries_zero_hands_429_to_the_caller_and_the_bucket_remembers(
    autojump_clock: object,
) -> None:
    server = Server(lambda r, n: limited(3.0) if n == 1 else ok())
    http, rest = client(server)
    async with http:
        with trio.fail_after(DEADLINE):
            with pytest.raises(RateLimited):
                await rest.edit_message("7", "9", "a", retries=0)
            t0 = trio.current_time()
            await rest.edit_message("7", "9", "b", retries=0)  # waits for the pause first
    assert trio.current_time() - t0 == pytest.approx(3.0)
    assert len(server.seen) == 2


async def test_long_retry_after_is_raised_not_slept(autojump_clock: object) -> None:
    server = Server(lambda r, n: limited(3600.0))
    http, rest = client(server, max_wait_s=60.0)
    async with http:
        with trio.fail_after(DEADLINE), pytest.raises(RateLimited):
            await rest.get_current_user()
    assert len(server.seen) == 1


async def test_global_429_pauses_every_route(autojump_clock: object) -> None:
    def answer(r: httpx.Request, n: int) -> httpx.Response:
        return limited(4.0, is_global=True) if n == 1 else ok({"id": "1", "username": "b"})

    server = Server(answer)
    http, rest = client(server)
    async with http:
        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(rest.edit_message, "7", "9", "text")
                await trio.sleep(0.5)
                nursery.start_soon(rest.get_current_user)  # another route, same pause
    times = [t for t, _ in server.seen]
    assert times[0] == pytest.approx(0.0)
    assert all(t >= 4.0 - 1e-6 for t in times[1:]) and len(times) == 3


async def test_exhausted_bucket_waits_for_reset_per_channel(autojump_clock: object) -> None:
    def answer(r: httpx.Request, n: int) -> httpx.Response:
        return ok(
            headers={
                "x-ratelimit-bucket": "abcd1234",
                "x-ratelimit-limit": "5",
                "x-ratelimit-remaining": "0",
                "x-ratelimit-reset-after": "1.75",
            }
        )

    server = Server(answer)
    http, rest = client(server)
    async with http:
        with trio.fail_after(DEADLINE):
            await rest.create_message("A", "1")
            await rest.create_message("B", "1")  # another channel: its own bucket
            await rest.create_message("A", "2")  # A is exhausted: waits for its reset
    times = [t for t, _ in server.seen]
    assert times[0] == pytest.approx(0.0) and times[1] == pytest.approx(0.0)
    assert times[2] == pytest.approx(1.75)
    assert [r.url.path for _, r in server.seen] == [
        "/api/v10/channels/A/messages",
        "/api/v10/channels/B/messages",
        "/api/v10/channels/A/messages",
    ]


async def test_routes_sharing_a_bucket_share_its_limit(autojump_clock: object) -> None:
    headers = {
        "x-ratelimit-bucket": "shared",
        "x-ratelimit-limit": "1",
        "x-ratelimit-remaining": "0",
        "x-ratelimit-reset-after": "2",
    }
    server = Server(lambda r, n: ok(headers=headers))
    http, rest = client(server)
    async with http:
        with trio.fail_after(DEADLINE):
            await rest.edit_message("A", "1", "x")
            await rest.edit_message("A", "2", "y")  # same route template and channel
    assert server.seen[1][0] == pytest.approx(2.0)


async def test_global_limit_of_50_per_second(autojump_clock: object) -> None:
    server = Server(lambda r, n: ok())
    http, rest = client(server)
    async with http:
        with trio.fail_after(DEADLINE):
            for i in range(120):
                await rest.trigger_typing(str(i))
    times = [t for t, _ in server.seen]
    for i in range(50, 120):
        assert times[i] - times[i - 50] >= 1.0 - 1e-9


async def test_callers_waiting_for_the_global_limit_queue_and_wake_one_at_a_time(
    autojump_clock: object,
) -> None:
    """200 chats answering at once: the 50 requests/s hold, the requests go in the order
    their callers arrived, and the limiter is asked about twice per request, not once per
    waiting caller per freed slot (every waiter used to wake for every slot)."""
    server = Server(lambda r, n: ok({"id": "1", "channel_id": "1", "content": "x"}))
    http, rest = client(server)
    asked = 0
    reserve = rest.limits.reserve

    def counting(route_key: str, major: str, now: float) -> float:
        nonlocal asked
        asked += 1
        return reserve(route_key, major, now)

    rest.limits.reserve = counting  # type: ignore[method-assign]
    async with http:
        with trio.fail_after(DEADLINE):
            async with trio.open_nursery() as nursery:
                for i in range(300):
                    nursery.start_soon(rest.create_message, str(i), f"m{i}")
                    await trio.testing.wait_all_tasks_blocked()  # arrive in this order
    times = [t for t, _ in server.seen]
    assert len(times) == 300
    for i in range(50, 300):
        assert times[i] - times[i - 50] >= 1.0 - 1e-9
    assert times[-1] < 6.0  # still as fast as the limit allows
    assert [r.url.path for _, r in server.seen] == [
        f"/api/v10/channels/{i}/messages" for i in range(300)
    ]
    assert asked <= 3 * 300


async def test_a_bucket_wait_does_not_hold_up_the_global_queue(autojump_clock: object) -> None:
    """A caller whose own bucket is exhausted sleeps alone: the others, waiting for the
    global limit meanwhile, go as soon as it allows."""
    exhausted = {
        "x-ratelimit-bucket": "b",
        "x-ratelimit-limit": "1",
        "x-ratelimit-remaining": "0",
        "x-ratelimit-reset-after": "10",
    }

    def answer(r: httpx.Request, n: int) -> httpx.Response:
        return ok(headers=exhausted if r.url.path.endswith("/A/messages") else None)

    server = Server(answer)
    http, rest = client(server)
    async with http:
        with trio.fail_after(DEADLINE):
            await rest.create_message("A", "1")  # A's bucket: empty for 10 s
            async with trio.open_nursery() as nursery:
                for i in range(49):
                    nursery.start_soon(rest.create_message, f"B{i}", "x")  # the second full
                await trio.testing.wait_all_tasks_blocked()
                nursery.start_soon(rest.create_message, "A", "2")
                await trio.testing.wait_all_tasks_blocked()
                for i in range(20):
                    nursery.start_soon(rest.create_message, f"C{i}", "x")
    by_path = {r.url.path: t for t, r in server.seen}
    assert all(by_path[f"/api/v10/channels/C{i}/messages"] <= 1.0 + 1e-6 for i in range(20))
    assert server.seen[-1][1].url.path == "/api/v10/channels/A/messages"
    assert server.seen[-1][0] == pytest.approx(10.0)


@pytest.mark.parametrize(
    ("status", "body", "error", "code"),
    [
        (404, {"message": "Unknown Message", "code": 10008}, NotFound, 10008),
        (404, {"message": "Unknown Channel", "code": 10003}, NotFound, 10003),
        (403, {"message": "Missing Access", "code": 50001}, PermissionDenied, 50001),
        (403, {"message": "Missing Permissions", "code": 50013}, PermissionDenied, 50013),
        (400, {"message": "Invalid Form Body", "code": 50035}, ChannelError, 50035),
        (502, {"message": "Bad Gateway", "code": 0}, TransportError, None),
    ],
)
async def test_errors_are_mapped_from_status_and_code(
    autojump_clock: object,
    status: int,
    body: dict[str, Any],
    error: type[Exception],
    code: int | None,
) -> None:
    server = Server(lambda r, n: httpx.Response(status, json=body))
    http, rest = client(server)
    async with http:
        with trio.fail_after(DEADLINE), pytest.raises(error) as exc_info:
            await rest.get_message("7", "9")
    exc = exc_info.value
    assert isinstance(exc, ChannelError)
    assert exc.status == status and exc.code == code
    assert TOKEN not in str(exc)
    assert not rest.auth_failed.is_set()


async def test_401_is_an_auth_error_and_signals_the_channel(autojump_clock: object) -> None:
    server = Server(
        lambda r, n: httpx.Response(401, json={"message": "401: Unauthorized", "code": 0})
    )
    http, rest = client(server)
    async with http:
        with trio.fail_after(DEADLINE), pytest.raises(AuthError) as exc_info:
            await rest.get_current_user()
    assert rest.auth_failed.is_set()
    assert exc_info.value.status == 401 and TOKEN not in str(exc_info.value)
    assert len(server.seen) == 1  # never retried


async def test_network_errors_and_bad_json_are_mapped(autojump_clock: object) -> None:
    def broken(r: httpx.Request, n: int) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=r)

    http, rest = client(Server(broken))
    async with http:
        with trio.fail_after(DEADLINE), pytest.raises(TransportError):
            await rest.get_current_user()
    http, rest = client(Server(lambda r, n: httpx.Response(200, content=b"<html>")))
    async with http:
        with trio.fail_after(DEADLINE), pytest.raises(RemoteProtocolError):
            await rest.get_current_user()


async def test_downloads_only_from_discord_cdn_and_without_the_token(
    autojump_clock: object,
) -> None:
    server = Server(lambda r, n: httpx.Response(200, content=b"x" * 100))
    http, rest = client(server)
    async with http:
        with trio.fail_after(DEADLINE):
            data = await rest.download("https://cdn.discordapp.com/attachments/1/2/a.png", 1000)
            with pytest.raises(ChannelError):
                await rest.download("https://evil.example/a.png", 1000)
            with pytest.raises(ChannelError):
                await rest.download("http://cdn.discordapp.com/a.png", 1000)
            with pytest.raises(ChannelError, match="over"):
                await rest.download("https://cdn.discordapp.com/big.png", 50)
    assert data == b"x" * 100
    assert len(server.seen) == 2
    assert all("authorization" not in r.headers for _, r in server.seen)


async def test_network_failures_say_whether_the_request_may_have_been_processed(
    autojump_clock: object,
) -> None:
    # kit.http.map_httpx_errors: a send that never left cannot duplicate; a timeout can.
    def refused(r: httpx.Request, n: int) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=r)

    def read_timeout(r: httpx.Request, n: int) -> httpx.Response:
        raise httpx.ReadTimeout("no answer", request=r)

    for answer, sent in ((refused, False), (read_timeout, True)):
        http, rest = client(Server(answer))
        async with http:
            with trio.fail_after(DEADLINE), pytest.raises(TransportError) as exc_info:
                await rest.create_message("7", "hi", nonce="n1")
        assert exc_info.value.request_sent is sent
        assert "POST /channels/{channel_id}/messages" in str(exc_info.value)
        assert TOKEN not in str(exc_info.value) and "discord.test" not in str(exc_info.value)


async def test_a_broken_retry_after_is_capped_not_slept_on(autojump_clock: object) -> None:
    server = Server(
        lambda r, n: httpx.Response(
            429, content=b'{"message":"slow","retry_after":1e300,"global":false}'
        )
    )
    http, rest = client(server)
    async with http:
        with trio.fail_after(DEADLINE), pytest.raises(RateLimited) as exc_info:
            await rest.get_current_user()
    assert exc_info.value.retry_after == MAX_RETRY_AFTER_S and len(server.seen) == 1


# -- the sans-IO parts (protocol.py) ---------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "error"),
    [
        (401, 0, AuthError),
        (401, 40001, AuthError),
        (404, 10008, NotFound),
        (400, 10003, NotFound),  # the code decides, whatever the status
        (403, 50001, PermissionDenied),
        (400, 50013, PermissionDenied),
        (403, 0, PermissionDenied),
        (500, 0, TransportError),
        (503, 0, TransportError),
        (400, 50035, ChannelError),
        (400, 160002, ChannelError),
    ],
)
def test_classify_error(status: int, code: int, error: type[ChannelError]) -> None:
    exc = classify_error(status, code, "GET /channels/{channel_id}", "Some message")
    assert type(exc) is error
    assert exc.status == status and exc.code == (code or None)
    assert "GET /channels/{channel_id}: HTTP" in str(exc)
    if isinstance(exc, TransportError):
        assert exc.request_sent


def headers(bucket: str, remaining: int, reset_after: float, limit: int = 5) -> dict[str, str]:
    return {
        "x-ratelimit-bucket": bucket,
        "x-ratelimit-limit": str(limit),
        "x-ratelimit-remaining": str(remaining),
        "x-ratelimit-reset-after": str(reset_after),
    }


def test_rate_limiter_learns_buckets_per_top_level_resource() -> None:
    rl = RateLimiter()
    route = "POST /channels/{channel_id}/messages"
    assert rl.reserve(route, "A", 0.0) == 0.0  # unknown: go
    rl.learn(route, "A", headers("b1", 0, 2.5), 0.0)
    assert rl.reserve(route, "A", 1.0) == pytest.approx(1.5)  # exhausted until 2.5
    assert rl.reserve(route, "B", 1.0) == 0.0  # another channel, its own bucket
    assert rl.reserve(route, "A", 2.5) == 0.0  # reset: go (and count it)
    other = "PATCH /channels/{channel_id}/messages/{message_id}"
    rl.learn(other, "A", headers("b1", 0, 4.0), 2.5)  # shares bucket b1
    assert rl.reserve(route, "A", 3.0) == pytest.approx(3.5)


def test_rate_limiter_counts_reservations_and_pauses_on_429() -> None:
    rl = RateLimiter()
    route = "PATCH /x"
    rl.learn(route, "A", headers("b", 2, 10.0), 0.0)
    assert [rl.reserve(route, "A", 0.0) for _ in range(3)] == [0.0, 0.0, pytest.approx(10.0)]
    rl.hit(route, "B", RateLimitHit(3.0), 0.0)
    assert rl.reserve(route, "B", 1.0) == pytest.approx(2.0)
    rl.hit(route, "C", RateLimitHit(4.0, is_global=True), 0.0)
    assert rl.reserve("GET /users/@me", "", 1.0) == pytest.approx(3.0)  # every route


def test_rate_limiter_keeps_the_global_limit_of_50_per_second() -> None:
    rl = RateLimiter()
    assert all(rl.reserve("GET /a", str(i), 0.0) == 0.0 for i in range(50))
    assert rl.reserve("GET /a", "51", 0.5) == pytest.approx(0.5)
    assert rl.reserve("GET /a", "51", 1.0) == 0.0


def test_rate_limit_hit_reads_the_body_then_the_headers() -> None:
    body = b'{"message":"You are being rate limited.","retry_after":64.57,"global":false}'
    assert rate_limit_hit(body, {}) == RateLimitHit(64.57)
    assert rate_limit_hit(b"<html>cloudflare</html>", {"retry-after": "7"}) == RateLimitHit(7.0)
    scoped = rate_limit_hit(b"{}", {"retry-after": "2", "x-ratelimit-scope": "global"})
    assert scoped.is_global and scoped.retry_after == 2.0
    assert rate_limit_hit(b"", {"retry-after": "soon"}).retry_after == 1.0


def test_a_flood_of_buckets_stays_bounded() -> None:
    rl = RateLimiter()
    for i in range(MAX_BUCKETS + 500):
        rl.learn("POST /channels/{channel_id}/messages", str(i), headers("b", 1, 100.0), 0.0)
    assert len(rl._buckets) <= MAX_BUCKETS
