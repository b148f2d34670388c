"""Many bots, one client: :func:`dshim.net.http.open_shared_http` hands every bot of one
API base the same client (opened by the first, closed by the last, grown by each), the
requests are still counted for the bot that makes them, and :class:`PostTemplate`
prepares a path's POST with exactly the head the long way writes."""

from __future__ import annotations

import httpx
import pytest
import trio

from dshim.net.h11transport import H11Transport
from dshim.net.http import (
    SHARED_IDLE,
    SHARED_PER_BOT_CONNECTIONS,
    JsonPoster,
    counted,
    counting_requests,
    open_http,
    open_shared_http,
)
from dshim.net.http import _shared as shared_registry
from dshim.testing.fakes.http import Request, Response, json_response, open_http_server

HEADERS = [("user-agent", "t"), ("accept", "application/json"), ("content-type", "x")]


def transport_of(http: httpx.AsyncClient) -> H11Transport:
    transport = http._transport
    assert isinstance(transport, H11Transport)
    return transport


@pytest.mark.parametrize(
    "base", ["http://127.0.0.1:8081", "http://127.0.0.1:8081/", "http://h/sub/dir/"]
)
@pytest.mark.parametrize("path", ["/bot123:AbC-_x/getMe", "/x", "/a/b.c~d!$&'()*+,;=:@"])
def test_a_template_writes_the_head_prepare_post_writes(base: str, path: str) -> None:
    transport = H11Transport(httpx.AsyncHTTPTransport(), prefix="/")
    template = transport.post_template(httpx.URL(base), HEADERS)
    assert template is not None
    fast = template.prepare(path)
    slow = transport.prepare_post(httpx.URL(base.rstrip("/") + path), HEADERS)
    assert fast is not None and slow is not None
    assert (fast.key, fast.head) == (slow.key, slow.head)
    assert transport.post_template(httpx.URL(base), HEADERS) is template  # made once


@pytest.mark.parametrize("path", ["/a b", "/é", "/a%20b", "/q?x=1", "/a\r\nX: y", "relative"])
def test_a_path_that_needs_encoding_is_left_to_the_long_way(path: str) -> None:
    transport = H11Transport(httpx.AsyncHTTPTransport(), prefix="/")
    template = transport.post_template(httpx.URL("http://127.0.0.1:1"), HEADERS)
    assert template is not None and template.prepare(path) is None


def test_no_template_where_the_transport_does_not_serve_the_base() -> None:
    transport = H11Transport(httpx.AsyncHTTPTransport(), prefix="/api/")
    assert transport.post_template(httpx.URL("http://h/other"), HEADERS) is None
    # https without a TLS context: the default transport's
    plain = H11Transport(httpx.AsyncHTTPTransport(), prefix="/")
    assert plain.post_template(httpx.URL("https://h"), HEADERS) is None


async def test_an_encoded_path_still_goes_out_encoded() -> None:
    seen: list[str] = []

    async def app(request: Request) -> Response:
        seen.append(request.path)
        return json_response({"ok": True})

    async with open_http_server(app) as srv, open_http(srv.url, user_agent="t") as http:
        poster = JsonPoster(http)
        for path in ("/bot1:A/getMe", "/a b"):
            answer = await poster.post(path, {}, httpx.Timeout(5.0))
            assert answer.status_code == 200
    # the space went out as %20 (a raw one is no valid request line); the server decodes
    assert seen == ["/bot1:A/getMe", "/a b"]


async def test_bots_of_one_api_base_share_one_client_grown_by_each() -> None:
    async def app(request: Request) -> Response:
        return json_response({"ok": True, "path": request.path})

    counts: dict[str, list[tuple[str, str]]] = {"a": [], "b": []}
    async with open_http_server(app) as srv, open_http_server(app) as other:
        async with (
            open_shared_http(srv.url, user_agent="t") as first,
            open_shared_http(srv.url + "/", user_agent="t") as second,
            open_shared_http(other.url, user_agent="t") as elsewhere,
        ):
            assert first is second and first is not elsewhere
            transport = transport_of(first)
            assert transport._slots.value == 2 * SHARED_PER_BOT_CONNECTIONS
            assert transport.max_idle == transport_of(elsewhere).max_idle + 1

            async def bot(name: str, http: httpx.AsyncClient) -> None:
                with counting_requests(lambda what, status: counts[name].append((what, status))):
                    post = JsonPoster(http).post(f"/bot{name}/getMe", {}, httpx.Timeout(5.0))
                    await counted("getMe", post)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(bot, "a", first)
                nursery.start_soon(bot, "b", second)
            assert first.is_closed is False
        assert first.is_closed and elsewhere.is_closed
    assert not shared_registry
    # each request counted for the bot that made it, through the one client
    assert counts == {"a": [("getMe", "200")], "b": [("getMe", "200")]}


async def test_the_last_bot_to_leave_closes_the_client_and_a_new_one_opens_afresh() -> None:
    async def app(request: Request) -> Response:
        return json_response({"ok": True})

    async with open_http_server(app) as srv:
        async with open_shared_http(srv.url, user_agent="t") as first:
            for _ in range(3):  # a bot that restarts, again and again
                async with open_shared_http(srv.url, user_agent="t") as second:
                    assert second is first
                    assert transport_of(first)._slots.value == 2 * SHARED_PER_BOT_CONNECTIONS
            assert not first.is_closed  # one bot still uses it
            # the pool is one bot's again
            assert transport_of(first)._slots.value == SHARED_PER_BOT_CONNECTIONS
            assert transport_of(first).max_idle == SHARED_IDLE
        assert first.is_closed
        async with open_shared_http(srv.url, user_agent="t") as again:
            assert again is not first and not again.is_closed
            assert transport_of(again)._slots.value == SHARED_PER_BOT_CONNECTIONS


async def test_connections_are_opened_a_bounded_number_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dshim.net import h11transport

    opening = peak = 0
    real = trio.open_tcp_stream

    async def counted_open(host: str, port: int) -> trio.SocketStream:
        nonlocal opening, peak
        opening += 1
        peak = max(peak, opening)
        try:
            await trio.sleep(0.01)  # a connect that takes a while (a busy server)
            return await real(host, port)
        finally:
            opening -= 1

    monkeypatch.setattr(h11transport.trio, "open_tcp_stream", counted_open)

    async def app(request: Request) -> Response:
        await trio.sleep(0.5)  # every call holds its connection, as a long poll does
        return json_response({"ok": True})

    bots = 3 * h11transport.MAX_CONNECTING
    answered = 0
    async with open_http_server(app) as srv:
        async with trio.open_nursery() as nursery:

            async def bot(i: int) -> None:
                nonlocal answered
                async with open_shared_http(srv.url, user_agent="t") as http:
                    await JsonPoster(http).post(f"/bot{i}/getUpdates", {}, httpx.Timeout(5.0))
                    answered += 1

            for i in range(bots):
                nursery.start_soon(bot, i)
    assert answered == bots
    assert peak == h11transport.MAX_CONNECTING  # waves, never a flood


async def test_bots_of_one_client_make_their_start_up_calls_a_bounded_number_at_a_time() -> None:
    from dshim.channels.telegram import channel

    async def app(request: Request) -> Response:
        return json_response({"ok": True})

    async with open_http_server(app) as srv:
        async with (
            open_shared_http(srv.url, user_agent="t") as first,
            open_shared_http(srv.url, user_agent="t") as second,
            open_shared_http(srv.url + "/other", user_agent="t") as third,
        ):
            gate = channel._start_gate(first)
            assert channel._start_gate(second) is gate  # one gate per shared client
            assert channel._start_gate(third) is not gate
            assert gate.value == channel.START_AT_ONCE


async def test_slots_taken_back_while_in_use_are_taken_as_their_calls_end() -> None:
    release = trio.Event()

    async def app(request: Request) -> Response:
        await release.wait()
        return json_response({"ok": True})

    async with open_http_server(app) as srv, open_http(srv.url, user_agent="t") as http:
        transport = transport_of(http)
        transport.grow(2, 0)  # 16 + 2 slots
        async with trio.open_nursery() as nursery:
            for i in range(18):
                nursery.start_soon(JsonPoster(http).post, f"/c{i}", {}, httpx.Timeout(5.0))
            await trio.sleep(0.2)
            assert transport._slots.value == 0
            transport.shrink(2, 0)  # every slot busy: owed
            release.set()
        assert transport._slots.value == 16
