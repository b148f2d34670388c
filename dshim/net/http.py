"""HTTP for channels: the bot's client, the one httpx error mapping, capped downloads,
Retry-After, and short-lived access tokens.

Every channel talks HTTP through one ``httpx.AsyncClient`` per bot (:func:`open_http`),
and every httpx exception becomes a :class:`~dshim.errors.TransportError` in exactly one
place (:func:`map_httpx_errors`), which says whether the request can have reached the
platform (``request_sent``): the streaming engine and the senders use that to never
repeat a send whose outcome is unknown in a loop.

Platforms that mint short-lived tokens (Feishu tenant_access_token, DingTalk and QQ
access tokens, WeCom ...) keep one :class:`AccessToken` per bot: it renews before expiry,
shares one refresh between concurrent callers and refreshes once more when the platform
rejects a token that should still be valid.

Counting: every platform request goes through :func:`counted` (or :func:`download_capped`),
which reports ``(what, status)`` to the counter of the bot it runs for — set by the host
around the bot's tasks with :func:`counting_requests` (``dshim serve`` counts them as
``dshim_platform_requests_total``).  The counter travels in a context variable, like the
bot's log context: trio hands it to every task the bot starts.  Without one, nothing
is counted.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import ssl
import sys
import time
import urllib.parse
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Mapping
from contextlib import aclosing, asynccontextmanager
from typing import Any, Protocol, TypeVar, cast

import httpx
import msgspec
import structlog
import trio

from dshim.errors import (
    AuthError,
    ChannelError,
    NotFound,
    PermissionDenied,
    RateLimited,
    TooLarge,
    TransportError,
)
from dshim.net.h11transport import STREAMED, H11Transport, PostTemplate, PreparedPost

__all__ = [
    "AccessToken",
    "Answer",
    "RequestCounter",
    "TokenState",
    "JsonPoster",
    "count_request",
    "counted",
    "counting_requests",
    "download_capped",
    "map_httpx_errors",
    "open_http",
    "open_shared_http",
    "parse_retry_after",
    "status_error",
    "transport_error",
]

log = structlog.get_logger("dshim.kit")

T = TypeVar("T")

#: Ordinary calls: connect, write and pool 10 s; read 30 s.
DEFAULT_TIMEOUT = httpx.Timeout(10.0, read=30.0)
#: Downloads get a longer read timeout (the turn has its own deadline around them).
DOWNLOAD_TIMEOUT = httpx.Timeout(10.0, read=60.0)


@functools.cache
def default_ssl_context() -> ssl.SSLContext:
    """The process's one client TLS context: httpx's verification (certifi's CA bundle,
    host names checked, ``SSL_CERT_FILE`` not read), for every bot's HTTP client and
    websocket.  Built once: loading the CA bundle costs ~15 ms of CPU and ~0.8 MB, which
    nine bots (and every websocket reconnect) paid again each time."""
    return httpx.create_ssl_context(trust_env=False)


@asynccontextmanager
async def open_http(
    api_base: str | None = None,
    *,
    user_agent: str,
    timeout: httpx.Timeout = DEFAULT_TIMEOUT,  # noqa: ASYNC109 - httpx's per-request limits
    max_connections: int = 16,
    fast_prefix: str | None = "/",
    ssl_context: ssl.SSLContext | None = None,
    shared: bool = False,
) -> AsyncIterator[httpx.AsyncClient]:
    """The one HTTP client of a bot: a connection pool shared by receiving and sending.

    No redirects are followed (a redirect could carry credentials elsewhere) and the
    environment's proxy settings are not read.  Paths are relative to ``api_base`` when
    it is given.  ``fast_prefix``: calls under this path (by default all; None: none),
    http and https, go through :class:`~dshim.net.h11transport.H11Transport`,
    about a third of httpcore's CPU per call; streamed answers (:func:`download_capped`)
    and streamed uploads stay on httpx's pool.  ``ssl_context`` verifies servers; by
    default it is httpx's (certifi's CA bundle, host names checked; the environment's
    ``SSL_CERT_FILE`` is not read, as before).  One context serves both transports, so https is verified
    the same way on either.  Both are made when first needed: httpx's pool at the first
    request that is not on the fast path, the default context at the first https
    connection.  ``shared``: the client of many bots (:func:`open_shared_http`): httpx's
    pool (downloads) is not bounded in connections, only in idle ones.
    """
    limits = httpx.Limits(
        # Every connection may stay alive: httpcore closes idle connections whenever the
        # pool holds more than max_keepalive (busy ones count), which under load opened a
        # new TCP connection for almost every call.
        max_connections=None if shared else max_connections,
        max_keepalive_connections=SHARED_IDLE if shared else max_connections,
    )
    transport: httpx.AsyncBaseTransport = _LazyTransport(
        lambda: httpx.AsyncHTTPTransport(
            verify=ssl_context or default_ssl_context(), limits=limits, trust_env=False
        )
    )
    if fast_prefix is not None:
        transport = H11Transport(
            transport,
            prefix=fast_prefix,
            max_connections=max_connections,
            ssl_context=ssl_context or default_ssl_context,
        )
    base = (api_base or "").rstrip("/")
    async with httpx.AsyncClient(
        base_url=base,
        timeout=timeout,
        headers={"user-agent": user_agent},
        transport=transport,
        follow_redirects=False,
        trust_env=False,
        event_hooks={"response": [functools.partial(_report_exchange, _base_path(base))]},
    ) as http:
        yield http


#: Calls in flight each bot adds to a shared client (as its own client allowed).
SHARED_PER_BOT_CONNECTIONS = 16
#: Idle keep-alive connections a shared client keeps per host: this many, plus one more
#: per bot sharing it (a bot's long poll returns its connection, the next poll takes it).
SHARED_IDLE = 32


class _SharedClient:
    __slots__ = ("client", "users", "done")

    def __init__(self, client: httpx.AsyncClient, done: Callable[[], Awaitable[None]]) -> None:
        self.client = client
        self.users = 0
        self.done = done


#: (trio run, api_base, user agent, timeout) -> the client its bots share.
_shared: dict[tuple[object, str, str, str], _SharedClient] = {}


@asynccontextmanager
async def open_shared_http(
    api_base: str,
    *,
    user_agent: str,
    timeout: httpx.Timeout = DEFAULT_TIMEOUT,  # noqa: ASYNC109 - httpx's per-request limits
) -> AsyncIterator[httpx.AsyncClient]:
    """The client of every bot of this process that talks to ``api_base`` (with the same
    user agent and timeouts): one :func:`open_http` client, opened by the first bot and
    closed when the last one leaves.  Each bot adds
    :data:`SHARED_PER_BOT_CONNECTIONS` calls in flight and one idle connection to the
    pool (a held long poll keeps a connection of its own; the idle ones are bounded by
    :data:`SHARED_IDLE` plus one per bot), so a thousand bots of one Bot API server cost
    one client, one transport and one TLS context, not a thousand.  Requests are counted
    for the bot that makes them (the counter is the calling task's, see
    :func:`counting_requests`)."""
    key = (trio.lowlevel.current_trio_token(), api_base.rstrip("/"), user_agent, repr(timeout))
    entry = _shared.get(key)
    if entry is None:
        stack = contextlib.AsyncExitStack()
        client = await stack.enter_async_context(
            open_http(
                api_base,
                user_agent=user_agent,
                timeout=timeout,
                max_connections=SHARED_PER_BOT_CONNECTIONS,
                shared=True,
            )
        )
        entry = _shared[key] = _SharedClient(client, stack.aclose)
    else:
        transport = getattr(entry.client, "_transport", None)
        if isinstance(transport, H11Transport):
            transport.grow(SHARED_PER_BOT_CONNECTIONS, 1)
    entry.users += 1
    try:
        yield entry.client
    finally:
        entry.users -= 1
        if entry.users == 0:
            del _shared[key]
            await entry.done()
        else:  # a bot that restarts joins again: the pool stays the size of its users
            transport = getattr(entry.client, "_transport", None)
            if isinstance(transport, H11Transport):
                transport.shrink(SHARED_PER_BOT_CONNECTIONS, 1)


# --- capture: the exchanges a quote's resolution made -----------------------------------------


class Exchange(msgspec.Struct, frozen=True, kw_only=True):
    """One platform exchange, as a replay fixture's ``http`` lists it: the path is relative
    to the client's ``api_base`` (with its query string), ``json`` the decoded body."""

    method: str
    path: str
    status: int
    json: Any = None


#: Told of every exchange with a JSON answer made in this context (``serve --capture``
#: sets it around a turn's quote resolution only; None, the default, costs one lookup).
EXCHANGES: contextvars.ContextVar[Callable[[Exchange], None] | None] = contextvars.ContextVar(
    "dshim_exchanges", default=None
)


def _base_path(base: str) -> str:
    return httpx.URL(base).raw_path.decode("ascii", "replace").rstrip("/") if base else ""


async def _report_exchange(base_path: str, response: httpx.Response) -> None:
    sink = EXCHANGES.get()
    if sink is None:
        return
    if "json" not in response.headers.get("content-type", ""):
        return  # a download or a page: nothing replay answers with
    try:
        body = msgspec.json.decode(await response.aread())
    except (msgspec.DecodeError, httpx.HTTPError):
        return
    request = response.request
    path = request.url.raw_path.decode("ascii", "replace")
    if base_path and path.startswith(base_path):
        path = path[len(base_path) :] or "/"
    sink(Exchange(method=request.method, path=path, status=response.status_code, json=body))


class _LazyTransport(httpx.AsyncBaseTransport):
    """httpx's transport, made at the first request that needs it.

    A Telegram bot sends its API calls through the h11 transport, so it may never need
    httpcore's pool at all; making it (and importing httpcore, ~15 ms) and loading the
    CA bundle (~15 ms) waits until a request does.  httpcore is imported without h2:
    dshim speaks HTTP/1.1 only, and h2 is ~10 ms and ~1 MB of every start otherwise.
    """

    def __init__(self, make: Callable[[], httpx.AsyncBaseTransport]) -> None:
        self._make: Callable[[], httpx.AsyncBaseTransport] | None = make
        self._made: httpx.AsyncBaseTransport | None = None

    def _transport(self) -> httpx.AsyncBaseTransport:
        if self._made is None:
            if self._make is None:
                raise RuntimeError("the HTTP client is closed")
            _import_httpcore_without_h2()
            self._made, self._make = self._make(), None
        return self._made

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._transport().handle_async_request(request)

    async def aclose(self) -> None:
        self._make = None
        if self._made is not None:
            await self._made.aclose()


def _import_httpcore_without_h2() -> None:
    """Import httpcore with h2 hidden (its HTTP/2 classes then raise if used; dshim never
    asks for HTTP/2).  A no-op once either is imported (hypercorn brings h2 along)."""
    if "httpcore" in sys.modules or "h2" in sys.modules:
        return
    sys.modules["h2"] = None  # type: ignore[assignment]
    try:
        import httpcore  # noqa: F401
    finally:
        del sys.modules["h2"]


# --- errors -----------------------------------------------------------------------------------

#: httpx failures that happen before a request is on the wire: a retry cannot duplicate.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)
#: Failures while the request was being written: it never reached the platform whole, and
#: a platform does not act on half a request.
_NOT_WRITTEN = (httpx.WriteError, httpx.WriteTimeout)


def transport_error(what: str, exc: httpx.TransportError) -> TransportError:
    """An httpx network failure as a TransportError (see :func:`map_httpx_errors`)."""
    name = type(exc).__name__
    if isinstance(exc, (*_NOT_SENT, httpx.ProxyError)):
        return TransportError(f"{what}: cannot connect ({name})", request_sent=False)
    if isinstance(exc, _NOT_WRITTEN):
        return TransportError(f"{what}: the request was not sent ({name})", request_sent=False)
    if isinstance(exc, httpx.TimeoutException):
        return TransportError(f"{what}: timed out ({name})", request_sent=True)
    return TransportError(f"{what}: connection failed ({name})", request_sent=True)


#: Every other failure httpx raises: the request cannot be made at all (a URL too long
#: or with a control character — a hostile id in a path —, a body that cannot be
#: encoded, a redirect loop, a response that does not decode).
HTTPX_FAILURES = (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError, httpx.CookieConflict)


def httpx_error(what: str, exc: Exception) -> ChannelError:
    """Any httpx failure as the error tree: network failures as TransportError (see
    :func:`transport_error`), the rest as a ChannelError that retrying cannot fix.  The
    message names ``what`` and the failure's kind, never the URL or httpx's text (both
    can carry an id of any length, or a token)."""
    if isinstance(exc, httpx.TransportError):
        return transport_error(what, exc)
    return ChannelError(f"{what}: the request cannot be made ({type(exc).__name__})")


@contextlib.contextmanager
def map_httpx_errors(what: str) -> Iterator[None]:
    """Map every httpx failure inside the block to the error tree, once.

    ``request_sent`` is False when the connection could not be made or the request could
    not be written whole; read timeouts and connections lost after the request went out
    may have been processed.  A request
    httpx refuses to build is a plain ChannelError.  The message names ``what`` (a method
    or route), never a URL (URLs can carry tokens).
    """
    try:
        yield
    except HTTPX_FAILURES as exc:
        raise httpx_error(what, exc) from exc


def parse_retry_after(headers: Mapping[str, str], *, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (seconds or an HTTP date), else None."""
    value = headers.get("retry-after")
    if value is None:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        import email.utils  # rare (seconds are the usual form); ~2 ms of start-up otherwise

        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if not math.isfinite(seconds):
        return None
    return max(0.0, seconds)


def status_error(
    status: int, what: str, *, headers: Mapping[str, str] | None = None
) -> ChannelError:
    """A generic HTTP failure status as the error tree (platform codes are the channel's)."""
    text = f"{what}: HTTP {status}"
    if status == 429:
        retry = parse_retry_after(headers or {})
        return RateLimited(text, retry_after=retry if retry is not None else 1.0, status=status)
    if status in (404, 410):
        return NotFound(text, status=status)
    if status in (401, 403):
        return PermissionDenied(text, status=status)
    if status >= 500:
        return TransportError(text, status=status, request_sent=True)
    return ChannelError(text, status=status)


# --- counting -----------------------------------------------------------------------------------

#: Counts one platform request: ``(what, status)`` — ``what`` names the method or route
#: template (never an id or a URL), ``status`` is the HTTP status or ``"error"``.
RequestCounter = Callable[[str, str], None]

_counter: contextvars.ContextVar[RequestCounter | None] = contextvars.ContextVar(
    "dshim_request_counter", default=None
)


@contextlib.contextmanager
def counting_requests(counter: RequestCounter) -> Iterator[None]:
    """Count the platform requests of the tasks started inside the block with ``counter``."""
    token = _counter.set(counter)
    try:
        yield
    finally:
        _counter.reset(token)


def count_request(what: str, status: int | str) -> None:
    """Count one request of the current bot (nothing when no counter is set)."""
    counter = _counter.get()
    if counter is not None:
        counter(what, str(status))


@contextlib.contextmanager
def _counting(what: str) -> Iterator[Callable[[int], None]]:
    """Count the request made in the block: call the yielded function with its status;
    a network failure before that counts as ``error``."""
    answered = False

    def answer(status: int) -> None:
        nonlocal answered
        answered = True
        count_request(what, status)

    try:
        yield answer
    except HTTPX_FAILURES:
        if not answered:
            count_request(what, "error")
        raise


class Answer(Protocol):
    """What callers read from an API call's response: an ``httpx.Response``, or the
    transport's light :class:`~dshim.net.h11transport.ApiResponse`."""

    @property
    def status_code(self) -> int: ...
    @property
    def content(self) -> bytes: ...
    @property
    def headers(self) -> Mapping[str, str]: ...


class _HasStatus(Protocol):
    @property
    def status_code(self) -> int: ...


R = TypeVar("R", bound=_HasStatus)


async def counted(what: str, request: Awaitable[R]) -> R:
    """Await one platform request: its httpx failures mapped (:func:`map_httpx_errors`)
    and the request counted with its status (a network failure counts as ``error``)."""
    # Spelled out rather than map_httpx_errors + _counting: it runs on every API call.
    try:
        resp = await request
    except HTTPX_FAILURES as exc:
        count_request(what, "error")
        raise httpx_error(what, exc) from exc
    count_request(what, resp.status_code)
    return resp


class JsonPoster:
    """POSTs JSON bodies to the API paths of one client, on its hot path.

    Through an :class:`~dshim.net.h11transport.H11Transport` (``open_http(...,
    fast_prefix=...)``) each path is prepared once: the paths the transport serves get
    their request head as bytes (see
    :meth:`~dshim.net.h11transport.H11Transport.prepare_post`) and a call goes to
    the transport without an ``httpx.Request`` or ``httpx.Response``; the others (outside
    its prefix) get their URL, and a call builds its request from it and hands it to the
    client's transport — httpx's client layers (URL merging, redirects, auth, cookies,
    event hooks) and its models cost about as much CPU again as the transport itself.  Without
    the transport a call is ``http.post(path, json=body)``.  The body is encoded with
    msgspec.  The answer is an :class:`Answer` (status, body, headers).
    """

    __slots__ = ("_http", "_fast", "_base", "_targets", "_headers", "_template")

    def __init__(self, http: httpx.AsyncClient, headers: Mapping[str, str] | None = None) -> None:
        self._http = http
        transport = getattr(http, "_transport", None)
        self._fast = transport if isinstance(transport, H11Transport) else None
        self._base = str(http.base_url).rstrip("/")
        #: path -> its prepared POST, or its URL when the fast transport does not serve it.
        self._targets: dict[str, PreparedPost | httpx.URL] = {}
        fields = dict(_poster_headers(http.headers.get("user-agent", "dshim")))
        # ``headers`` (an Authorization, say) go into every request; a name given there
        # replaces the default one.  They sit in the prepared heads, never in a log.
        fields.update({k.lower(): v for k, v in (headers or {}).items()})
        self._headers = list(fields.items())
        #: Prepares the paths under the client's base (None: path by path).  Only for a
        #: poster without headers of its own: the transport shares one template among
        #: the posters of its clients (the bots on one Bot API server), so a poster's own
        #: headers (a token) never go into it.
        self._template: PostTemplate | None = None
        if self._fast is not None and not headers:
            self._template = _template(self._fast, http.base_url, self._headers[0][1])

    async def post(self, path: str, body: Any, timeout: httpx.Timeout) -> Answer:  # noqa: ASYNC109 - httpx per-request limits
        """POST ``body`` as JSON to ``path``; raises httpx's errors (see :func:`counted`)."""
        if self._fast is None and len(self._headers) == 3:
            return await self._http.post(path, json=body, timeout=timeout)
        template = self._template
        if template is not None:
            target = self._targets.get(path)
            if target is None:
                target = template.prepare(path)
                if target is not None and len(self._targets) < 256:
                    self._targets[path] = target
            if isinstance(target, PreparedPost):
                assert self._fast is not None
                return await self._fast.post(target, _json_body.encode(body), timeout)
        return await self.post_bytes(self._base + path, _json_body.encode(body), timeout)

    async def post_bytes(self, url: str, content: bytes, timeout: httpx.Timeout) -> Answer:  # noqa: ASYNC109 - httpx per-request limits
        """POST ``content`` (JSON already encoded) to the absolute ``url``, the same way."""
        target = self._targets.get(url)
        if target is None:
            parsed = httpx.URL(url)
            fast = self._fast
            target = (fast.prepare_post(parsed, self._headers) if fast else None) or parsed
            if len(self._targets) >= 256:  # bounded: many paths (one per chat) are prepared again
                self._targets.clear()
            self._targets[url] = target
        if isinstance(target, PreparedPost):
            assert self._fast is not None
            return await self._fast.post(target, content, timeout)
        request = httpx.Request(
            "POST",
            target,
            content=content,
            headers=self._headers,
            extensions={"timeout": timeout.as_dict()},
        )
        return await self._http.send(request)


_json_body = msgspec.json.Encoder()


def _poster_headers(user_agent: str) -> list[tuple[str, str]]:
    return [
        ("user-agent", user_agent),
        ("accept", "application/json"),
        ("content-type", "application/json"),
    ]


def _template(fast: H11Transport, base: httpx.URL, user_agent: str) -> PostTemplate | None:
    """The transport's post template for ``base`` with a poster's headers (the
    transport makes it once: the bots sharing a client share it)."""
    return fast.post_template(base, _poster_headers(user_agent))


# --- downloads ----------------------------------------------------------------------------------


async def download_capped(
    http: httpx.AsyncClient,
    url: str,
    max_bytes: int,
    *,
    allowed_hosts: frozenset[str] | None = None,
    headers: Mapping[str, str] | None = None,
    http_timeout: httpx.Timeout = DOWNLOAD_TIMEOUT,
    what: str = "download",
) -> bytes:
    """GET ``url`` and return its body, never reading more than ``max_bytes``.

    ``allowed_hosts`` (when given) is the set of host names a URL taken from a payload may
    point to; anything else is refused before a connection is made.  A declared size
    (``Content-Length``) over the limit raises TooLarge before the body is read, and so
    does a body that grows past it (reading stops there); 404/410 raise NotFound (the file is
    gone or too old), 401/403 PermissionDenied, 5xx and network failures TransportError.
    """
    if allowed_hosts is not None:
        parts = urllib.parse.urlsplit(url)
        host = (parts.hostname or "").lower()
        if host not in allowed_hosts:
            raise PermissionDenied(f"{what}: refusing to download from host {host!r}")
    with map_httpx_errors(what), _counting(what) as answered:
        async with http.stream(
            "GET",
            url,
            headers=dict(headers or {}),
            timeout=http_timeout,
            follow_redirects=False,
            extensions={STREAMED: True},  # read within the cap, never whole
        ) as resp:
            answered(resp.status_code)
            if resp.status_code != 200:
                raise status_error(resp.status_code, what, headers=resp.headers)
            declared = resp.headers.get("content-length", "")
            if declared.isdigit() and int(declared) > max_bytes:
                raise TooLarge(f"{what}: {declared} bytes is over the {max_bytes} byte limit")
            data = bytearray()
            # aiter_bytes is an async generator: close it when stopping early.
            chunk_gen = cast(AsyncGenerator[bytes, None], resp.aiter_bytes())
            async with aclosing(chunk_gen) as chunks:
                async for chunk in chunks:
                    data += chunk
                    if len(data) > max_bytes:
                        raise TooLarge(f"{what}: over the {max_bytes} byte limit")
            return bytes(data)


# --- short-lived access tokens ------------------------------------------------------------------


class TokenState:
    """Sans-IO: the current token and when to renew it.  Time is an argument.

    A token is renewed ``margin_s`` before it expires — but never earlier than half its
    lifetime, so a platform that hands out short tokens is not asked again at once.
    """

    __slots__ = ("token", "expires_at", "renew_at", "margin_s")

    def __init__(self, *, margin_s: float = 1800.0) -> None:
        self.token: str | None = None
        self.expires_at = -math.inf
        self.renew_at = -math.inf
        self.margin_s = margin_s

    def current(self, now: float) -> str | None:
        """The token to use now, or None when it must be renewed first."""
        if self.token is None or now >= self.renew_at:
            return None
        return self.token

    def set(self, token: str, expires_in_s: float, now: float) -> None:
        lifetime = max(0.0, expires_in_s)
        self.token = token
        self.expires_at = now + lifetime
        self.renew_at = now + max(lifetime - self.margin_s, lifetime / 2)

    def invalidate(self, token: str) -> bool:
        """The platform rejected ``token``: forget it if it is still the current one.

        Returns True when it was (the next caller refreshes), False when a newer token
        already replaced it (the caller just retries with that one).
        """
        if self.token is not None and self.token == token:
            self.token = None
            self.renew_at = -math.inf
            return True
        return False


#: Mints a token: returns (token, lifetime in seconds).  Raises the error tree.
TokenFetcher = Callable[[], Awaitable[tuple[str, float]]]


class AccessToken:
    """A bot's short-lived access token, renewed before expiry; one refresh at a time.

    ``get()`` returns a valid token, fetching one when needed; concurrent callers wait
    for the same fetch.  ``call(fn)`` runs ``fn(token)`` and, when it raises
    :class:`~dshim.errors.AuthError` (the platform's "token expired/invalid" codes mapped
    by the channel), refreshes once and runs it once more — a second AuthError is final
    (a bad app secret is fatal, never a loop).  Every new token is passed to
    ``on_new_token`` (register it with the log redactor) before it is used.
    """

    def __init__(
        self,
        fetch: TokenFetcher,
        *,
        margin_s: float = 1800.0,
        on_new_token: Callable[[str], None] | None = None,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self._fetch = fetch
        self._state = TokenState(margin_s=margin_s)
        self._on_new = on_new_token
        self._clock = clock
        self._lock = trio.Lock()
        #: How many tokens were fetched (probes and tests read it).
        self.fetches = 0

    @property
    def expires_at(self) -> float:
        return self._state.expires_at

    async def get(self) -> str:
        """A token valid for now (fetched when missing or due for renewal)."""
        token = self._state.current(self._clock())
        if token is not None:
            return token
        async with self._lock:
            token = self._state.current(self._clock())  # another caller refreshed meanwhile
            if token is not None:
                return token
            new, expires_in = await self._fetch()
            self.fetches += 1
            if self._on_new is not None:
                self._on_new(new)
            self._state.set(new, expires_in, self._clock())
            log.info("access_token_refreshed", expires_in_s=round(expires_in))
            return new

    def invalidate(self, token: str) -> None:
        """Forget ``token`` after the platform rejected it (see :meth:`TokenState.invalidate`)."""
        self._state.invalidate(token)

    async def call(self, fn: Callable[[str], Awaitable[T]]) -> T:
        """``fn(token)``; on AuthError refresh once and try once more."""
        token = await self.get()
        try:
            return await fn(token)
        except AuthError:
            self.invalidate(token)
            log.info("access_token_rejected_refreshing")
        return await fn(await self.get())
