"""The channel kit's HTTP parts against a real HTTP server on 127.0.0.1.

Errors are mapped once (and say whether the request can have been processed), downloads
never read past their cap, Retry-After is read in both of its forms, and short-lived
access tokens are renewed before expiry with one refresh shared by every caller.
"""

from __future__ import annotations

import email.utils

import httpx
import pytest
import trio

from dshim.errors import AuthError, ChannelError, NotFound, PermissionDenied, TransportError
from dshim.net.http import (
    AccessToken,
    counted,
    download_capped,
    map_httpx_errors,
    open_http,
    parse_retry_after,
)
from dshim.testing.fakes.http import DropConnection, Request, Response, open_http_server


async def app(request: Request) -> Response:
    if request.path == "/drop":
        raise DropConnection
    if request.path == "/slow":
        await trio.sleep(5)
        return Response(200, b"late")
    if request.path == "/big":
        return Response(200, b"x" * 100_000)
    if request.path == "/small":
        return Response(200, b"hello")
    return Response(404, b"gone")


async def test_network_failures_say_whether_the_request_can_have_been_processed() -> None:
    async with open_http_server(app) as server, open_http(server.url, user_agent="t") as http:
        with pytest.raises(TransportError) as dropped:
            with map_httpx_errors("sendMessage"):
                await http.post("/drop", json={"text": "hi"})
        with pytest.raises(TransportError) as slow:
            with map_httpx_errors("sendMessage"):
                await http.post("/slow", timeout=httpx.Timeout(5.0, read=0.2))
    async with open_http(server.url, user_agent="t") as http:  # the server is gone now
        with pytest.raises(TransportError) as refused:
            with map_httpx_errors("sendMessage"):
                await http.post("/small")
    assert dropped.value.request_sent and "connection failed" in str(dropped.value)
    assert slow.value.request_sent and "timed out" in str(slow.value)
    assert not refused.value.request_sent and "cannot connect" in str(refused.value)
    for exc in (dropped.value, slow.value, refused.value):
        assert "127.0.0.1" not in str(exc)  # what failed, never the URL


async def test_a_request_that_cannot_be_made_is_a_channel_error_not_a_crash() -> None:
    # A platform id of 70 KiB (or with a control character) in a URL path: httpx refuses
    # to build the request (InvalidURL, no TransportError), on every kind of call.
    huge = "om_" + "x" * 70_000
    async with open_http_server(app) as server, open_http(server.url, user_agent="t") as http:
        calls = [
            lambda: http.get(f"/messages/{huge}"),
            lambda: http.post(f"/messages/{huge}/reply", json={"text": "hi"}),
            lambda: http.get("/messages/a\x00b"),
        ]
        for call in calls:
            with pytest.raises(ChannelError) as caught:
                with map_httpx_errors("reply"):
                    await call()
            assert not isinstance(caught.value, TransportError)  # never retried as transient
            assert "reply" in str(caught.value) and huge not in str(caught.value)
            with pytest.raises(ChannelError):
                await counted("reply", call())
        with pytest.raises(ChannelError):
            await download_capped(http, f"{server.url}/files/{huge}", 1000)
    assert server.requests == 0  # nothing was sent


async def test_downloads_stop_at_the_cap_and_map_statuses() -> None:
    async with open_http_server(app) as server, open_http(user_agent="t") as http:
        assert await download_capped(http, server.url + "/small", 10) == b"hello"
        with pytest.raises(ChannelError, match="over the 1000 byte limit"):
            await download_capped(http, server.url + "/big", 1000)
        with pytest.raises(NotFound):
            await download_capped(http, server.url + "/expired", 1000)
        before = server.requests
        with pytest.raises(PermissionDenied, match="refusing"):
            await download_capped(
                http, server.url + "/small", 10, allowed_hosts=frozenset({"cdn.example"})
            )
        assert server.requests == before  # refused before connecting


def test_retry_after_in_seconds_or_as_a_date() -> None:
    assert parse_retry_after({"retry-after": "3"}) == 3.0
    assert parse_retry_after({"retry-after": " 1.5 "}) == 1.5
    date = email.utils.formatdate(1_000_060.0, usegmt=True)
    assert parse_retry_after({"retry-after": date}, now=1_000_000.0) == 60.0
    assert parse_retry_after({"retry-after": "soon"}) is None
    assert parse_retry_after({}) is None
    assert parse_retry_after({"retry-after": "-4"}) == 0.0


class Minter:
    """Hands out numbered tokens after a delay, valid for ``lifetime`` seconds."""

    def __init__(self, lifetime: float = 7200.0, delay: float = 0.5) -> None:
        self.lifetime = lifetime
        self.delay = delay
        self.minted: list[str] = []

    async def __call__(self) -> tuple[str, float]:
        await trio.sleep(self.delay)
        token = f"t-{len(self.minted) + 1}"
        self.minted.append(token)
        return token, self.lifetime


async def test_concurrent_callers_share_one_refresh(autojump_clock: object) -> None:
    minter = Minter()
    seen: list[str] = []
    token = AccessToken(minter, on_new_token=seen.append)
    got: list[str] = []

    async def use() -> None:
        got.append(await token.get())

    async with trio.open_nursery() as nursery:
        for _ in range(5):
            nursery.start_soon(use)
    assert got == ["t-1"] * 5 and minter.minted == ["t-1"] and seen == ["t-1"]


async def test_renewed_before_the_last_half_hour(autojump_clock: object) -> None:
    minter = Minter(lifetime=7200.0, delay=0.0)
    token = AccessToken(minter, margin_s=1800.0)
    assert await token.get() == "t-1"
    await trio.sleep(5399)
    assert await token.get() == "t-1"
    await trio.sleep(2)  # inside the last 30 minutes of the 2 h token
    assert await token.get() == "t-2"
    short = AccessToken(Minter(lifetime=600.0, delay=0.0), margin_s=1800.0)
    await short.get()
    await trio.sleep(200)
    assert await short.get() == "t-1"  # a short token is kept for half its lifetime


async def test_a_rejected_token_is_refreshed_once_then_the_error_stands(
    autojump_clock: object,
) -> None:
    minter = Minter(delay=0.0)
    token = AccessToken(minter)
    used: list[str] = []

    async def call(t: str) -> str:
        used.append(t)
        if t == "t-1":
            raise AuthError("token expired", code=99991663)
        return "ok"

    assert await token.call(call) == "ok"
    assert used == ["t-1", "t-2"]

    async def always_rejected(t: str) -> str:
        used.append(t)
        raise AuthError("app secret invalid")

    with pytest.raises(AuthError):
        await token.call(always_rejected)
    assert used[2:] == ["t-2", "t-3"] and len(minter.minted) == 3  # one refresh, no loop
