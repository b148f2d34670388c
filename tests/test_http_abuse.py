"""The local HTTP endpoint under abuse: what it refuses, and that the right user still gets in.

A token that can be guessed, a login form that answers guesses as fast as they come, a
DNS-rebinding page that reads the endpoint through a name of its own, websocket frames
read whole before their size is checked.  Every test serves a real
:class:`~dshim.http.app.Endpoint` with hypercorn's trio worker on 127.0.0.1, port 0, and
talks to it over real sockets (httpx, raw bytes, trio-websocket); the autojump clock where
time matters, the conftest deadline around each test.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from dshim.channels.registry import parse_config
from dshim.channels.webchat import protocol as webchat_protocol
from dshim.errors import ConfigError
from dshim.http.app import Endpoint
from dshim.http.ops import add_operator_routes
from dshim.http.server import serve_endpoint
from dshim.http.status import BotStatuses
from dshim.http.types import HttpRequest, HttpResponse, WebSocket
from dshim.http.wsstream import PING_INTERVAL_S, WS_MAX_MESSAGE, Pinger
from dshim.metrics import ProcessMetrics
from dshim.serve import make_endpoint
from tests.http_client import open_ws, port_of, raw_request

TOKEN = "s3cret-endpoint-token-0123456789"
REPO = Path(__file__).resolve().parent.parent


@asynccontextmanager
async def serving(endpoint: Endpoint, listen: str = "127.0.0.1:0") -> AsyncIterator[str]:
    """Serve ``endpoint``; yields its base URL (``http://127.0.0.1:PORT``)."""
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(serve_endpoint, endpoint, listen, shutdown=shutdown))
        try:
            yield binds[0]
        finally:
            shutdown.set()


# --- the token and public_host in the configuration ------------------------------------------


@pytest.mark.parametrize("listen", ["0.0.0.0:8910", "192.168.1.5:80", "[::]:8910"])
@pytest.mark.parametrize("token", ["x", "fifteen-chars-x", "   padded-15ch  "])
def test_off_loopback_a_short_token_is_a_config_error_naming_the_key(
    listen: str, token: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"http": {"listen": listen, "token": token}}, env={})
    message = str(info.value)
    assert message.startswith("dshim.toml: http.token: ") and "16" in message
    assert token.strip() not in message  # the token itself is never shown


def test_a_16_character_token_is_enough_and_loopback_needs_none() -> None:
    config = parse_config({"http": {"listen": "0.0.0.0:8910", "token": "0123456789abcdef"}}, env={})
    assert config.http.token is not None and config.http.token.get() == "0123456789abcdef"
    assert parse_config({"http": {"listen": "127.0.0.1:8910"}}, env={}).http.token is None


def test_serve_with_a_short_token_off_loopback_exits_2_naming_the_key(tmp_path: Path) -> None:
    cfg = tmp_path / "dshim.toml"
    cfg.write_text(
        '[http]\nlisten = "0.0.0.0:0"\ntoken = "abc"\n\n[[bots]]\nname = "web"\nchannel = "webchat"\n'
    )
    env = {"DSHIM_DATA_DIR": str(tmp_path / "data"), "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-m", "dshim", "--config", str(cfg), "serve"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert r.returncode == 2, r.stderr
    assert "http.token" in r.stderr and "16" in r.stderr and "Traceback" not in r.stderr
    assert '"abc"' not in r.stderr and "'abc'" not in r.stderr


@pytest.mark.parametrize(
    "value", ["https://chat.example.com", "chat.example.com/x", "two words", "", "a" * 300]
)
def test_a_public_host_that_is_not_a_host_name_is_a_config_error(value: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"http": {"public_host": value}}, env={})
    message = str(info.value)
    assert message.startswith("dshim.toml: http.public_host: ") and "host name" in message


def test_public_host_is_read() -> None:
    http = {"public_host": "Chat.Example.com:8443", "token": TOKEN}
    config = parse_config({"http": http}, env={})
    assert config.http.public_host == "Chat.Example.com:8443"
    assert parse_config({"http": {}}, env={}).http.public_host is None


@pytest.mark.parametrize("token", [None, "short"])
def test_behind_a_proxy_on_loopback_a_public_host_needs_a_token(token: str | None) -> None:
    # A reverse proxy connects from 127.0.0.1: loopback alone says nothing about who the
    # endpoint serves once public_host names it to the world.
    http = {"listen": "127.0.0.1:8910", "public_host": "chat.example.com"}
    if token is not None:
        http["token"] = token
    with pytest.raises(ConfigError) as info:
        parse_config({"http": http}, env={})
    message = str(info.value)
    assert message.startswith("dshim.toml: http.token: ") and "public_host" in message
    assert token is None or token not in message


# --- Host: DNS rebinding ---------------------------------------------------------------------


async def page(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, b"<p>the web chat</p>", "text/html; charset=utf-8")


async def webhook(request: HttpRequest) -> HttpResponse:
    return HttpResponse(200, b"EVENT_RECEIVED", "text/plain")


def operator_endpoint(**kw: Any) -> Endpoint:
    """An endpoint with the web chat's page at the root, a signed webhook, and the
    operators' routes (``/readyz``, ``/metrics``) as ``dshim serve`` adds them."""
    endpoint = Endpoint(**kw)
    endpoint.mount("web", "", page)
    endpoint.mount_websocket("web", "ws", echo_socket)
    endpoint.mount("wa", "", webhook, public=True)
    endpoint.root_bot = "web"
    statuses = BotStatuses(time.time)
    statuses.store_open = True
    add_operator_routes(endpoint, statuses, ProcessMetrics(statuses.up_flags))
    return endpoint


async def echo_socket(ws: WebSocket) -> None:
    while True:
        await ws.send("echo:" + str(await ws.receive()))


async def get(
    base: str, path: str, host: str | None, *extra: str, method: str = "GET"
) -> tuple[int, bytes]:
    """One request with ``Host: host`` (None: no Host header, HTTP/1.0) as raw bytes."""
    version = "HTTP/1.1" if host is not None else "HTTP/1.0"
    lines = [f"{method} {path} {version}", *([f"Host: {host}"] if host is not None else [])]
    status, _, body = await raw_request(base, ("\r\n".join([*lines, *extra]) + "\r\n\r\n").encode())
    return status, body


async def ws_upgrade(base: str, path: str, host: str, *extra: str) -> tuple[int, bytes]:
    """A websocket upgrade with ``Host: host``; the HTTP status (101: accepted)."""
    return await get(
        base,
        path,
        host,
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
        *extra,
    )


REBINDING = ["evil.example", "evil.example:8910", "127.0.0.1.evil.example", "localhost.evil"]


async def test_a_page_naming_another_host_reads_nothing_without_a_token() -> None:
    # No token on loopback: only the Host header tells a DNS-rebinding page (its own name
    # resolved to 127.0.0.1) from the user's browser at 127.0.0.1 or localhost.
    async with serving(operator_endpoint()) as base:
        port = port_of(base)
        for host in REBINDING:
            for path in ("/", "/readyz", "/metrics", "/hooks/web/", "/no/such/page"):
                status, body = await get(base, path, host)
                assert status == 421, (host, path, status)
                assert len(body) < 200 and b"the web chat" not in body and b"dshim_" not in body
            # The socket too, before Origin or the token are looked at.
            status, _ = await ws_upgrade(base, "/ws", host)
            assert status == 421
        for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", "LOCALHOST", "[::1]"):
            status, body = await get(base, "/", host)
            assert (status, body) == (200, b"<p>the web chat</p>"), host
            assert (await get(base, "/readyz", host))[0] == 200
            assert (await get(base, "/metrics", host))[0] == 200
        # /healthz says only "ok": load balancers probe it by any name.
        assert await get(base, "/healthz", "evil.example") == (200, b"ok")


async def test_the_public_host_and_the_listen_address_are_answered_and_webhooks_by_any_name() -> (
    None
):
    endpoint = operator_endpoint(token=TOKEN, host="0.0.0.0", public_host="Chat.Example.com:8443")
    auth = f"Authorization: Bearer {TOKEN}"
    async with serving(endpoint, "127.0.0.1:0") as base:
        port = port_of(base)
        # A wildcard listen address answers its addresses (any IP literal: a rebinding
        # page has a name of its own), loopback names and the public host, port or not.
        for host in (
            f"127.0.0.1:{port}",
            "10.1.2.3:8910",
            "[2001:db8::7]:8910",
            "localhost",
            "chat.example.com",
            "chat.example.com:443",
            "CHAT.EXAMPLE.COM.",
        ):
            assert await get(base, "/", host, auth) == (200, b"<p>the web chat</p>"), host
        for host in ("evil.example", "example.com", "chat.example.com.evil", "[::1"):
            status, body = await get(base, "/readyz", host, auth)
            assert status == 421 and b"Host" in body, host
        # A signed webhook (public mount) is served by whatever name the platform or the
        # reverse proxy in front uses: it authenticates each request itself.
        status, body = await get(base, "/hooks/wa", "dshim-proxy.internal:8080", method="GET")
        assert (status, body) == (200, b"EVENT_RECEIVED")
        # Without a Host header (HTTP/1.0: not a browser) the request is not refused for it.
        assert (await get(base, "/readyz", None, auth))[0] == 200


async def test_a_listen_address_names_only_itself() -> None:
    async with serving(operator_endpoint(host="127.0.0.1")) as base:
        for host in ("127.0.0.2", "10.0.0.1", "0.0.0.0", "[::2]"):
            assert (await get(base, "/", host))[0] == 421, host


# --- /login and bearer guesses: a token bucket per address -------------------------------------


FORM = {"content-type": "application/x-www-form-urlencoded"}


async def test_login_guesses_are_slowed_per_address_and_the_right_token_elsewhere_is_not(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with serving(Endpoint(token=TOKEN)) as base:
        here = httpx.AsyncClient(base_url=base)
        # Another client address (Linux routes all of 127.0.0.0/8 to loopback).
        there = httpx.AsyncClient(
            base_url=base, transport=httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        )
        async with here, there:
            answers = [
                (await here.post("/login", content=f"token=guess-{i}", headers=FORM)).status_code
                for i in range(50)
            ]
            # A few tries are checked, then every further one is 429 at once.
            assert answers[:5] == [401] * 5 and set(answers[5:]) == {429}, answers
            refused = await here.post("/login", content=f"token={TOKEN}", headers=FORM)
            assert refused.status_code == 429  # no oracle: the right one waits too
            assert refused.json()["error"] == "too_many_requests"
            retry_after = int(refused.headers["retry-after"])
            assert 1 <= retry_after <= 60 and "set-cookie" not in refused.headers
            # Another address signs in at once.
            ok = await there.post("/login", content=f"token={TOKEN}", headers=FORM)
            assert ok.status_code == 303 and "set-cookie" in ok.headers
            # Once Retry-After has passed, this address may try again.
            await trio.sleep(retry_after)
            again = await here.post("/login", content=f"token={TOKEN}", headers=FORM)
            assert again.status_code == 303


async def test_bearer_guesses_are_slowed_like_login_tries(
    autojump_clock: trio.abc.Clock,
) -> None:
    endpoint = operator_endpoint(token=TOKEN)
    async with serving(endpoint) as base:
        port = port_of(base)
        host = f"127.0.0.1:{port}"
        statuses = [
            (await get(base, "/metrics", host, f"Authorization: Bearer guess-{i}"))[0]
            for i in range(20)
        ]
        assert statuses[:5] == [401] * 5 and set(statuses[5:]) == {429}, statuses
        # No credential at all is not a guess: a browser is still sent to the form.
        status, _ = await get(base, "/", host, "Accept: text/html")
        assert status == 303
        # The right token from another address is served at once.
        there = httpx.AsyncClient(
            base_url=base, transport=httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        )
        async with there:
            resp = await there.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
            assert resp.status_code == 200
        # A websocket upgrade with a guessed token is refused the same way.
        status, _ = await ws_upgrade(base, "/ws", host, "Authorization: Bearer guess")
        assert status == 429


async def test_dshim_serve_answers_the_configured_public_host() -> None:
    config = parse_config({"http": {"public_host": "chat.example.com", "token": TOKEN}}, env={})
    statuses = BotStatuses(time.time)
    endpoint = make_endpoint(config, statuses, ProcessMetrics(statuses.up_flags))
    async with serving(endpoint) as base:
        bearer = f"Authorization: Bearer {TOKEN}"
        assert (await get(base, "/readyz", "chat.example.com", bearer))[0] == 503  # no store
        assert (await get(base, "/readyz", "chat.example.org", bearer))[0] == 421


# --- websocket frames: the cap while reading, one budget across sockets ------------------------

MIB = 1024 * 1024


class RawSocket:
    """A websocket client written from RFC 6455 alone, for what real clients never do:
    announce a frame and send only part of it, never answer a ping.  ``local`` is the
    address to connect from (127.0.0.0/8 is all loopback on Linux: other clients)."""

    def __init__(self, stream: trio.SocketStream, answer: bytes) -> None:
        self.stream = stream
        self.answer = answer
        self._buffer = b""

    @classmethod
    @asynccontextmanager
    async def open(
        cls, base: str, path: str = "/ws", *headers: str, local: str | None = None
    ) -> AsyncIterator[RawSocket]:
        stream = await trio.open_tcp_stream("127.0.0.1", port_of(base), local_address=local)
        async with stream:
            request = [
                f"GET {path} HTTP/1.1",
                f"Host: 127.0.0.1:{port_of(base)}",
                "Upgrade: websocket",
                "Connection: Upgrade",
                "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
                "Sec-WebSocket-Version: 13",
                *headers,
            ]
            await stream.send_all(("\r\n".join(request) + "\r\n\r\n").encode())
            sock = cls(stream, b"")
            while b"\r\n\r\n" not in sock._buffer:
                chunk = await stream.receive_some(65536)
                assert chunk, "closed during the handshake"
                sock._buffer += chunk
            sock.answer, _, sock._buffer = sock._buffer.partition(b"\r\n\r\n")
            yield sock

    @property
    def status(self) -> int:
        return int(self.answer.split(b" ", 2)[1])

    async def send_header(self, length: int, opcode: int = 0x1) -> None:
        """A final frame's header announcing ``length`` payload bytes (mask key 0: the
        payload goes as it is)."""
        if length < 126:
            size = bytes([0x80 | length])
        elif length < 65536:
            size = bytes([0x80 | 126]) + length.to_bytes(2, "big")
        else:
            size = bytes([0x80 | 127]) + length.to_bytes(8, "big")
        await self.stream.send_all(bytes([0x80 | opcode]) + size + b"\0\0\0\0")

    async def send_frame(self, payload: bytes, opcode: int = 0x1) -> None:
        await self.send_header(len(payload), opcode)
        await self.stream.send_all(payload)

    async def read_frame(self) -> tuple[int, bytes] | None:
        """The next frame from the server (opcode, payload); None at EOF."""
        while True:
            frame = self._parse()
            if frame is not None:
                return frame
            try:
                chunk = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:
                return None
            if not chunk:
                return None
            self._buffer += chunk

    def _parse(self) -> tuple[int, bytes] | None:
        data = self._buffer
        if len(data) < 2:
            return None
        length, at = data[1] & 0x7F, 2
        if length == 126:
            length, at = int.from_bytes(data[2:4], "big"), 4
        elif length == 127:
            length, at = int.from_bytes(data[2:10], "big"), 10
        if len(data) < at + length:
            return None
        self._buffer = data[at + length :]
        return data[0] & 0x0F, data[at : at + length]

    async def read_message(self) -> tuple[int, bytes] | None:
        """The next frame that is not a ping or a pong (they are not answered)."""
        while (frame := await self.read_frame()) is not None and frame[0] in (0x9, 0xA):
            pass
        return frame

    async def close_code(self) -> int | None:
        """Read (ignoring pings and messages) until the server's close frame; its code."""
        while True:
            frame = await self.read_frame()
            if frame is None:
                return None
            opcode, payload = frame
            if opcode == 0x8:
                return int.from_bytes(payload[:2], "big")


async def chunked_send(sock: RawSocket, size: int) -> None:
    """``size`` bytes of payload in 1 MiB writes (stops quietly when the server hung up)."""
    chunk = b"x" * MIB
    sent = 0
    try:
        while sent < size:
            piece = chunk[: min(MIB, size - sent)]
            await sock.stream.send_all(piece)
            sent += len(piece)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def socket_endpoint() -> Endpoint:
    endpoint = Endpoint()
    endpoint.mount_websocket("web", "ws", echo_socket)
    endpoint.root_bot = "web"
    return endpoint


async def test_a_frame_over_the_cap_is_refused_while_it_is_read() -> None:
    async with serving(socket_endpoint()) as base, RawSocket.open(base) as sock:
        assert sock.status == 101
        # 63 MiB announced; the server closes (1009) after the cap, before the rest comes.
        await sock.send_header(63 * MIB)
        await chunked_send(sock, WS_MAX_MESSAGE + MIB)
        with trio.fail_after(20):
            assert await sock.close_code() == 1009


async def test_the_cap_is_the_web_chats_frame_limit() -> None:
    # A frame the web chat would refuse as too large never reaches it whole.
    assert WS_MAX_MESSAGE == webchat_protocol.MAX_FRAME_BYTES


async def test_one_budget_bounds_what_all_sockets_hold_and_one_address_holds_half() -> None:
    near_cap = WS_MAX_MESSAGE - MIB
    async with serving(socket_endpoint()) as base, trio.open_nursery() as nursery:
        socks: list[RawSocket] = []
        for local in ("127.0.0.1", "127.0.0.1", "127.0.0.2", "127.0.0.2"):
            sock = await nursery.start(hold_partial, base, local, near_cap)
            socks.append(sock)
        # Four sockets hold 4 x 27 MiB of frames they have not finished: the budget is spent.
        async with RawSocket.open(base, local="127.0.0.3") as late:
            await late.send_header(near_cap)
            await chunked_send(late, near_cap)
            with trio.fail_after(20):
                assert await late.close_code() == 1013  # try again later
        # A third from an address that already holds its share is refused the same way,
        # while a small message from anyone still goes through.
        async with RawSocket.open(base, local="127.0.0.1") as third:
            await third.send_header(near_cap)
            await chunked_send(third, near_cap)
            with trio.fail_after(20):
                assert await third.close_code() == 1013
        async with RawSocket.open(base, local="127.0.0.4") as small:
            await small.send_frame(b"hello")
            with trio.fail_after(20):
                assert await small.read_message() == (0x1, b"echo:hello")
        # One holder finishes its frame: what it held is free again for another.
        await chunked_send(socks[0], MIB)
        with trio.fail_after(20):
            assert await socks[0].read_message() == (0x1, b"echo:" + b"x" * WS_MAX_MESSAGE)
        async with RawSocket.open(base, local="127.0.0.3") as next_one:
            await next_one.send_frame(b"y" * near_cap)
            with trio.fail_after(20):
                assert await next_one.read_message() == (0x1, b"echo:" + b"y" * near_cap)
        nursery.cancel_scope.cancel()


async def hold_partial(
    base: str, local: str, size: int, *, task_status: trio.TaskStatus[RawSocket]
) -> None:
    """A socket that sends all of a ``size + 1 MiB`` frame but its last MiB, and holds it."""
    async with RawSocket.open(base, local=local) as sock:
        await sock.send_header(size + MIB)
        await chunked_send(sock, size)
        await trio.sleep(0.5)  # the server has read it
        task_status.started(sock)
        await trio.sleep_forever()


async def test_compression_is_not_negotiated_so_no_frame_inflates_past_the_cap() -> None:
    async with serving(socket_endpoint()) as base:
        async with RawSocket.open(
            base, "/ws", "Sec-WebSocket-Extensions: permessage-deflate; client_max_window_bits"
        ) as sock:
            assert sock.status == 101
            assert b"sec-websocket-extensions" not in sock.answer.lower()
            await sock.send_frame(b"plain")
            with trio.fail_after(20):
                assert await sock.read_message() == (0x1, b"echo:plain")


# --- websockets that stop answering -----------------------------------------------------------


@pytest.fixture(params=["one-pinger", "each-socket-alone"])
def pinging(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The server's one pinger task pings the sockets, or (it does not run) each socket
    pings itself."""
    if request.param == "each-socket-alone":

        async def not_running(self: Pinger) -> None:
            await trio.sleep_forever()

        monkeypatch.setattr(Pinger, "run", not_running)
    return str(request.param)


async def test_a_socket_that_stops_answering_pings_is_closed(
    autojump_clock: trio.abc.Clock, pinging: str
) -> None:
    async with serving(socket_endpoint()) as base:
        async with RawSocket.open(base) as dead:
            start = trio.current_time()
            with trio.fail_after(600):
                frames = []
                while (frame := await dead.read_frame()) is not None:
                    frames.append(frame[0])  # it reads, but never answers
            gone = trio.current_time() - start
        assert 0x9 in frames  # it was pinged
        assert PING_INTERVAL_S <= gone <= 3 * PING_INTERVAL_S


async def test_a_socket_that_answers_pings_stays_open_however_quiet(
    autojump_clock: trio.abc.Clock, pinging: str
) -> None:
    async with serving(socket_endpoint()) as base, open_ws(base, "/ws") as ws:
        await trio.sleep(30 * PING_INTERVAL_S)  # trio-websocket answers every ping
        await ws.send_message("still there?")
        assert await ws.get_message() == "echo:still there?"
