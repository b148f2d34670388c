"""The h11 transport over TLS, against TLS servers on 127.0.0.1 whose certificates a test
CA (made here with ``cryptography``) signed, the client trusting that CA through
``open_http(ssl_context=...)``: calls are answered and reuse one connection, on the
prepared path and through httpx's interface alike; a certificate for another name, or
from a CA the client does not trust (certifi's bundle by default), is refused before
anything is sent, as httpx's ConnectError; a server closing an idle connection (a
``close_notify``, with or without the TCP close) costs a new connection, not the call;
a handshake that never ends is the connect timeout.

Every server listens on port 0; every test has the suite's hard deadline (conftest)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import ipaddress
import json
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import pytest
import trio
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from dshim.errors import TransportError
from dshim.net.h11transport import H11Transport
from dshim.net.http import (
    DEFAULT_TIMEOUT,
    Answer,
    JsonPoster,
    counted,
    open_http,
)
from tests.test_kit_h11 import read_request

# --- certificates ------------------------------------------------------------------------------


class Authority:
    """A certificate authority for one test: issues server certificates."""

    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(self.key.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )

    def pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode("ascii")

    def client_context(self) -> ssl.SSLContext:
        """What an operator trusting this CA would configure: httpx's default, other CAs."""
        return ssl.create_default_context(cadata=self.pem())

    def server_context(self, tmp_path: Path, *names: str) -> ssl.SSLContext:
        """A server context with a certificate for ``names`` (DNS names or IP literals)."""
        key = ec.generate_private_key(ec.SECP256R1())
        alt: list[x509.GeneralName] = []
        for name in names:
            try:
                alt.append(x509.IPAddress(ipaddress.ip_address(name)))
            except ValueError:
                alt.append(x509.DNSName(name))
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, names[0])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(alt), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .sign(self.key, hashes.SHA256())
        )
        chain = tmp_path / f"{names[0]}-{cert.serial_number}.pem"
        chain.write_bytes(
            cert.public_bytes(serialization.Encoding.PEM)
            + key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.load_cert_chain(chain)
        ctx.set_alpn_protocols(["h2", "http/1.1"])  # the server would take h2 if offered
        return ctx


# --- servers -----------------------------------------------------------------------------------


def tls_client(
    ca: Authority, port: int
) -> contextlib.AbstractAsyncContextManager[httpx.AsyncClient]:
    """A bot's HTTP client for the local TLS server, trusting only the test CA."""
    return open_http(
        f"https://localhost:{port}",
        user_agent="t",
        fast_prefix="/api",
        ssl_context=ca.client_context(),
    )


async def serve_raw(
    nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]
) -> int:
    """Serve plain TCP with ``handler`` (it speaks TLS itself, or not at all); the port."""
    serve = functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1")
    [listener] = await nursery.start(serve)
    port: int = listener.socket.getsockname()[1]
    return port


def header(request: bytes, name: str) -> str | None:
    for line in request.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == name.encode():
            return value.strip().decode()
    return None


def json_answer(request: bytes, extra: bytes = b"") -> bytes:
    """A keep-alive answer echoing the request line and body."""
    line = request.split(b"\r\n", 1)[0].decode()
    body = json.dumps({"line": line, "body": request.split(b"\r\n\r\n", 1)[1].decode()})
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        + extra
        + b"content-length: %d\r\n\r\n" % len(body)
        + body.encode()
    )


class TlsServer:
    """Serves ``answer(request)`` for each request over TLS, keep-alive; records what the
    handshakes saw (SNI, ALPN) and what was asked."""

    def __init__(self, ctx: ssl.SSLContext) -> None:
        self.ctx = ctx
        self.answer: Callable[[bytes], bytes] = json_answer
        self.close_after_answer = False  # close_notify, then the TCP close
        self.connections = 0
        self.handshakes_failed = 0
        self.sni: list[str | None] = []
        self.alpn: list[str | None] = []
        self.requests: list[bytes] = []
        self.closed = trio.Event()
        self._failed = trio.Condition()
        ctx.sni_callback = lambda _obj, name, _ctx: self.sni.append(name)

    async def handle(self, stream: trio.SSLStream[trio.SocketStream]) -> None:
        self.connections += 1
        try:
            await stream.do_handshake()
        except trio.BrokenResourceError:
            await stream.transport_stream.aclose()
            async with self._failed:
                self.handshakes_failed += 1
                self._failed.notify_all()
            return
        self.alpn.append(stream.selected_alpn_protocol())
        buffered = bytearray()
        with contextlib.suppress(EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            async with stream:
                while True:
                    request = await read_request(stream, buffered)
                    self.requests.append(request)
                    await stream.send_all(self.answer(request))
                    if self.close_after_answer:
                        break
        self.closed.set()

    async def wait_failed_handshakes(self, count: int) -> None:
        """Until ``count`` handshakes failed here (the client's refusal reaches us later)."""
        async with self._failed:
            while self.handshakes_failed < count:
                await self._failed.wait()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        """Serve for the block; yields the port."""
        async with trio.open_nursery() as nursery:
            serve = functools.partial(
                # https_compatible=False: aclose() sends close_notify before the TCP close.
                trio.serve_ssl_over_tcp,
                self.handle,
                0,
                self.ctx,
                host="127.0.0.1",
                https_compatible=False,
            )
            [listener] = await nursery.start(serve)
            yield listener.transport_listener.socket.getsockname()[1]
            nursery.cancel_scope.cancel()


async def posted(poster: JsonPoster, path: str, body: object, limits: httpx.Timeout) -> Answer:
    return await counted("send", poster.post(path, body, limits))


# --- the tests ---------------------------------------------------------------------------------


async def test_posts_over_tls_are_answered_and_reuse_one_verified_connection(
    tmp_path: Path,
) -> None:
    ca = Authority("test CA")
    server = TlsServer(ca.server_context(tmp_path, "localhost"))
    async with server.running() as port:
        async with open_http(
            f"https://localhost:{port}",
            user_agent="ua/1",
            fast_prefix="/api",
            ssl_context=ca.client_context(),
        ) as http:
            assert isinstance(http._transport, H11Transport)
            poster = JsonPoster(http)
            for i in range(3):  # the prepared path
                resp = await posted(poster, "/api/send", {"n": i}, DEFAULT_TIMEOUT)
                assert resp.status_code == 200
                assert json.loads(resp.content)["body"] == f'{{"n":{i}}}'
            resp2 = await http.post("/api/other", json={"m": 1})  # httpx's interface
            assert resp2.json()["line"] == "POST /api/other HTTP/1.1"
            assert server.connections == 1  # all four on one connection, kept by this transport
            assert sum(len(conns) for conns in http._transport._idle.values()) == 1
            files = await http.get("/files/x")  # outside the prefix: httpcore, same context
            assert files.status_code == 200
    assert server.connections == 2 and server.handshakes_failed == 0
    assert server.sni == ["localhost", "localhost"]
    assert server.alpn == ["http/1.1", "http/1.1"]  # h2 never offered
    first = server.requests[0]
    assert header(first, "host") == f"localhost:{port}"
    assert header(first, "user-agent") == "ua/1"
    assert header(first, "content-length") == str(len(b'{"n":0}'))


async def test_a_certificate_for_another_host_name_is_refused_before_sending(
    tmp_path: Path,
) -> None:
    ca = Authority("test CA")
    server = TlsServer(ca.server_context(tmp_path, "other.example", "127.0.0.2"))
    async with server.running() as port:
        async with tls_client(ca, port) as http:
            with pytest.raises(TransportError) as fast:
                await posted(JsonPoster(http), "/api/send", {}, DEFAULT_TIMEOUT)
            with pytest.raises(httpx.ConnectError) as raw:
                await http.post("/api/send", json={})
            with pytest.raises(httpx.ConnectError):  # httpcore refuses it alike
                await http.get("/files/x")
        await server.wait_failed_handshakes(3)
    assert not fast.value.request_sent and "ConnectError" in str(fast.value)
    assert "certificate verify failed" in str(raw.value)
    assert server.requests == [] and server.handshakes_failed == server.connections == 3


async def test_a_certificate_from_an_untrusted_authority_is_refused(tmp_path: Path) -> None:
    trusted, other = Authority("trusted CA"), Authority("someone else's CA")
    server = TlsServer(other.server_context(tmp_path, "localhost"))
    async with server.running() as port:
        url = f"https://localhost:{port}"
        async with open_http(
            url, user_agent="t", fast_prefix="/api", ssl_context=trusted.client_context()
        ) as http:
            with pytest.raises(TransportError) as refused:
                await posted(JsonPoster(http), "/api/send", {}, DEFAULT_TIMEOUT)
        # By default: httpx's context (certifi's public CAs), which never signed a test CA.
        async with open_http(url, user_agent="t", fast_prefix="/api") as default:
            with pytest.raises(TransportError) as by_default:
                await posted(JsonPoster(default), "/api/send", {}, DEFAULT_TIMEOUT)
            with pytest.raises(httpx.ConnectError):
                await default.get("/files/x")  # and through httpcore, likewise
        await server.wait_failed_handshakes(3)
    for info in (refused, by_default):
        assert not info.value.request_sent and "ConnectError" in str(info.value)
    assert server.requests == [] and server.connections == 3


async def test_an_idle_connection_the_server_closed_is_replaced(tmp_path: Path) -> None:
    ca = Authority("test CA")
    server = TlsServer(ca.server_context(tmp_path, "localhost"))
    server.close_after_answer = True  # answers with keep-alive, then close_notify and FIN
    async with server.running() as port:
        async with tls_client(ca, port) as http:
            poster = JsonPoster(http)
            for _ in range(3):
                assert (await posted(poster, "/api/x", {}, DEFAULT_TIMEOUT)).status_code == 200
                await server.closed.wait()
                server.closed = trio.Event()
                await trio.sleep(0.05)  # the close reaches us while the connection is idle
    assert server.connections == 3 and len(server.requests) == 3


async def test_a_close_notify_sent_with_the_answer_is_not_mistaken_for_a_live_connection(
    tmp_path: Path,
) -> None:
    """The answer and the server's close_notify in one write, the TCP connection left open:
    the socket is quiet, the close waits in TLS's buffer — the next call opens a new one."""
    ctx = Authority("test CA")
    server_ctx = ctx.server_context(tmp_path, "localhost")
    connections = 0

    async def answer_then_close_notify(stream: trio.SocketStream) -> None:
        nonlocal connections
        connections += 1
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = server_ctx.wrap_bio(incoming, outgoing, server_side=True)

        async def flush() -> None:
            if outgoing.pending:
                await stream.send_all(outgoing.read())

        async def more() -> None:
            data = await stream.receive_some(65536)
            if not data:
                raise EOFError
            incoming.write(data)

        with contextlib.suppress(EOFError, trio.BrokenResourceError):
            while True:
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    await flush()
                    await more()
            await flush()
            request = b""
            while b"\r\n\r\n" not in request:
                try:
                    request += tls.read(65536)
                except ssl.SSLWantReadError:
                    await more()
            tls.write(json_answer(request))
            with contextlib.suppress(ssl.SSLWantReadError):
                tls.unwrap()  # queues close_notify after the answer
            await flush()  # one write: the answer and the close_notify
            await trio.sleep_forever()  # the TCP connection stays open

    async with trio.open_nursery() as nursery:
        port = await serve_raw(nursery, answer_then_close_notify)
        async with tls_client(ctx, port) as http:
            poster = JsonPoster(http)
            for _ in range(3):
                assert (await posted(poster, "/api/x", {}, DEFAULT_TIMEOUT)).status_code == 200
        nursery.cancel_scope.cancel()
    assert connections == 3


async def test_chunked_answers_and_connection_close_over_tls(tmp_path: Path) -> None:
    ca = Authority("test CA")
    server = TlsServer(ca.server_context(tmp_path, "localhost"))
    closing = False

    def chunked(request: bytes) -> bytes:
        close = b"connection: close\r\n" if closing else b""
        return (
            b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n"
            + close
            + b'\r\n5\r\n{"ok"\r\n6\r\n:true}\r\n0\r\n\r\n'
        )

    server.answer = chunked
    async with server.running() as port:
        async with tls_client(ca, port) as http:
            poster = JsonPoster(http)
            for _ in range(2):
                resp = await posted(poster, "/api/x", {}, DEFAULT_TIMEOUT)
                assert resp.content == b'{"ok":true}'
            assert server.connections == 1
            closing = True
            for _ in range(2):
                assert (await posted(poster, "/api/x", {}, DEFAULT_TIMEOUT)).status_code == 200
            assert server.connections == 2  # the first closing answer ended the kept one


async def test_a_handshake_that_never_completes_is_the_connect_timeout() -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await trio.sleep_forever()  # accepts TCP, never answers the ClientHello

    async with trio.open_nursery() as nursery:
        port = await serve_raw(nursery, silent)
        async with tls_client(Authority("test CA"), port) as http:
            with pytest.raises(TransportError) as info:
                await posted(JsonPoster(http), "/api/x", {}, httpx.Timeout(30.0, connect=0.3))
        nursery.cancel_scope.cancel()
    assert not info.value.request_sent and "ConnectTimeout" in str(info.value)


def test_every_client_shares_one_verifying_tls_context() -> None:
    """Nine bots and their websocket reconnects load the CA bundle once, and what they share
    still verifies certificates and host names."""
    import ssl

    from dshim.net.http import default_ssl_context

    ctx = default_ssl_context()
    assert ctx is default_ssl_context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert ctx.cert_store_stats()["x509_ca"] > 50  # a real CA bundle, not an empty store


async def test_the_default_context_is_made_at_the_first_https_connection_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bot's client loads the process's CA bundle when it first connects over https,
    once, and verifies with it; until then nothing is loaded."""
    import dshim.net.http as kit_http

    ca = Authority("test CA")
    made: list[ssl.SSLContext] = []

    def default() -> ssl.SSLContext:
        made.append(ca.client_context())
        return made[-1]

    monkeypatch.setattr(kit_http, "default_ssl_context", default)
    server = TlsServer(ca.server_context(tmp_path, "localhost"))
    async with server.running() as port:
        async with open_http(
            f"https://localhost:{port}", user_agent="t", fast_prefix="/api"
        ) as http:
            assert made == []
            for i in range(2):
                resp = await posted(JsonPoster(http), "/api/send", {"n": i}, DEFAULT_TIMEOUT)
                assert resp.status_code == 200
            assert len(made) == 1
            files = await http.get("/files/x")  # httpx's pool, made now, same default
            assert files.status_code == 200
    assert len(made) == 2 and server.handshakes_failed == 0
    assert server.alpn == ["http/1.1", "http/1.1"]
