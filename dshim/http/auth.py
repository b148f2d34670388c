"""Who may use the local HTTP endpoint: ``Host``, the bearer token, its cookie, ``Origin``.

Rules (``[http] token``, ``[http] public_host``):

- a request must name the endpoint in its ``Host`` header (:class:`HostPolicy`): the
  listen address (for a wildcard listen address, any IP literal), for a loopback one
  ``localhost``, ``127.0.0.1`` and ``[::1]``, and ``[http] public_host``; with or without
  a port.  Any other name is a page that had its own name resolved to this address (DNS
  rebinding) and gets ``421``: without that check such a page could read ``/``,
  ``/readyz`` and ``/metrics`` of an endpoint without a token.  A request without
  ``Host`` (HTTP/1.0) is not a browser's and is not refused for it;
- without a token (only allowed on loopback) every route is open;
- with one, every route but ``/healthz`` and the login form needs
  ``Authorization: Bearer <token>`` or the session cookie; both are compared in constant
  time.  The cookie (:data:`COOKIE`, HttpOnly, SameSite=Strict, Path=/) is set by the login
  form (``GET /login`` shows it, ``POST /login`` with ``token=...`` checks it); its value
  is an HMAC of the token, so the token itself is never stored in the browser;
- websocket upgrades that carry ``Origin`` (browsers always send it) must come from the
  endpoint's own address: scheme ``http``, the configured host or, for a loopback host,
  any loopback name (``localhost``, ``127.0.0.1``, ``[::1]``), and the port actually
  bound.  A wildcard listen address (``0.0.0.0``, ``::``) accepts the origin the request's
  ``Host`` names.  An upgrade without ``Origin`` is a program, not a page: it is allowed
  (with the token when one is configured).  A page served under ``[http] public_host``
  (behind a reverse proxy, ``http`` or ``https``, any port) may open sockets too;
- guesses are slowed per client address (:class:`GuessThrottle`, a token bucket: a few
  tries, then one every :data:`GUESS_REFILL_S`): a wrong ``POST /login`` or a wrong
  bearer token costs a try; with none left, every try from that address — the right
  token too, so the answer is no oracle — gets ``429`` with ``Retry-After``.  Other
  addresses are not slowed.  A request without any credential costs nothing (a browser
  opening the page is sent to the form), nor does a stale session cookie (an HMAC nobody
  guesses: that browser is sent to the form).  Addresses are grouped as the limits see a
  client (:func:`client_key`: an IPv4 address, an IPv6 /64).

The token never appears in a response, a log line or an error.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import ipaddress
import math
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Literal

import trio

from dshim.config import is_loopback
from dshim.http.types import HttpRequest, HttpResponse

__all__ = [
    "COOKIE",
    "Auth",
    "GuessThrottle",
    "HostPolicy",
    "OriginPolicy",
    "client_key",
    "host_name",
    "login_page",
]

COOKIE = "dshim_session"
#: How long the browser keeps the session cookie.
COOKIE_MAX_AGE_S = 30 * 24 * 3600
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})
#: Guesses one client address may make at once ...
GUESS_BURST = 5
#: ... and then one per this many seconds (ten a minute).
GUESS_REFILL_S = 6.0
#: Client addresses the throttle remembers (the least recently seen are forgotten).
GUESS_CLIENTS_MAX = 10_000

Verdict = Literal["ok", "missing", "wrong"]


class Auth:
    """Checks requests against ``token`` (None: everything is allowed)."""

    def __init__(self, token: str | None) -> None:
        self._token = token.encode() if token else None
        self._cookie = (
            hmac.new(self._token, b"dshim web chat session v1", hashlib.sha256).hexdigest()
            if self._token
            else None
        )

    @property
    def required(self) -> bool:
        return self._token is not None

    def allows(self, headers: Iterable[tuple[str, str]]) -> bool:
        """True for a valid bearer header or session cookie (or when no token is set)."""
        return self.check(headers) == "ok"

    def check(self, headers: Iterable[tuple[str, str]]) -> Verdict:
        """``ok`` (a valid bearer header or session cookie, or no token set), ``wrong`` (a
        bearer token that is not the token: a guess) or ``missing``.  A session cookie
        that is not valid is ``missing``, not a guess: it is an HMAC nobody guesses, and a
        browser holding one from before the token changed is sent to the form."""
        if self._token is None:
            return "ok"
        ok = False
        offered = False
        for name, value in headers:
            if name == "authorization":
                scheme, _, credential = value.strip().partition(" ")
                if scheme.lower() == "bearer":
                    offered = True
                    ok |= self.token_matches(credential.strip())
            elif name == "cookie":
                cookie = _cookie_value(value, COOKIE)
                if cookie is not None and self._cookie is not None:
                    ok |= hmac.compare_digest(cookie.encode(), self._cookie.encode())
        if ok:
            return "ok"
        return "wrong" if offered else "missing"

    def token_matches(self, candidate: str) -> bool:
        if self._token is None:
            return False
        return hmac.compare_digest(candidate.encode("utf-8", "surrogateescape"), self._token)

    def set_cookie(self) -> tuple[str, str]:
        """The ``Set-Cookie`` header of a successful login."""
        assert self._cookie is not None
        return (
            "set-cookie",
            f"{COOKIE}={self._cookie}; HttpOnly; SameSite=Strict; Path=/; "
            f"Max-Age={COOKIE_MAX_AGE_S}",
        )


def _cookie_value(header: str, name: str) -> str | None:
    for part in header.split(";"):
        key, sep, value = part.strip().partition("=")
        if sep and key == name:
            return value.strip().strip('"')
    return None


def host_name(value: str) -> str | None:
    """The name a ``Host`` header (or ``[http] public_host``) gives, lower case, without
    the port, the brackets of an IPv6 literal or a final dot; None when it is not one."""
    value = value.strip().lower()
    if value.startswith("["):
        name, sep, port = value[1:].partition("]")
        if not sep or (port and not (port[:1] == ":" and port[1:].isdigit())):
            return None
    else:
        name, sep, port = value.partition(":")
        if sep and not port.isdigit():
            return None
    name = name.removesuffix(".")
    if not name:
        return None
    try:
        return str(ipaddress.ip_address(name))  # one spelling per address
    except ValueError:
        return name


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostPolicy:
    """Which ``Host`` a request may name (see the module docstring).

    ``listen_host``: the configured listen host; ``public_host``: ``[http] public_host``.
    """

    def __init__(self, listen_host: str, public_host: str | None = None) -> None:
        listen = listen_host.strip("[]").lower()
        self.wildcard = listen in WILDCARDS
        names = {host_name(listen) or listen}
        if self.wildcard or is_loopback(listen):
            names |= LOOPBACK_NAMES
        self.public = host_name(public_host) if public_host else None
        if self.public is not None:
            names.add(self.public)
        self.names = frozenset(names)

    def allows(self, host_header: str | None) -> bool:
        if host_header is None:
            return True
        name = host_name(host_header)
        if name is None:
            return False
        return name in self.names or (self.wildcard and _is_ip(name))


def client_key(address: str) -> str:
    """A client address as the endpoint's limits group it: an IPv4 address (also when
    mapped into IPv6), an IPv6 /64 (one host holds a whole /64), anything else as is."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class GuessThrottle:
    """Credential guesses per client address: a token bucket (see the module docstring).

    ``clock``: seconds (trio's clock).  At most ``max_clients`` addresses are remembered;
    beyond, the one seen least recently is forgotten (it starts again with a full bucket).
    """

    def __init__(
        self,
        *,
        burst: int = GUESS_BURST,
        refill_s: float = GUESS_REFILL_S,
        max_clients: int = GUESS_CLIENTS_MAX,
        clock: Callable[[], float] = trio.current_time,
    ) -> None:
        self.burst = burst
        self.refill_s = refill_s
        self.max_clients = max_clients
        self._clock = clock
        #: address -> (tries left, when that was counted)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    def _left(self, client: str) -> float:
        entry = self._buckets.get(client)
        if entry is None:
            return float(self.burst)
        left, at = entry
        return min(float(self.burst), left + (self._clock() - at) / self.refill_s)

    def wait_s(self, client: str) -> float:
        """0 when ``client`` may try now, else the seconds until it may."""
        left = self._left(client)
        return 0.0 if left >= 1 else (1 - left) * self.refill_s

    def retry_after(self, client: str) -> str:
        """``Retry-After``: whole seconds, at least 1."""
        return str(max(1, math.ceil(self.wait_s(client))))

    def failed(self, client: str) -> None:
        """A wrong try: it costs one."""
        left = max(0.0, self._left(client) - 1)
        self._buckets[client] = (left, self._clock())
        self._buckets.move_to_end(client)
        while len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)

    def succeeded(self, client: str) -> None:
        """The right token: the address starts again with a full bucket."""
        self._buckets.pop(client, None)


class OriginPolicy:
    """Which ``Origin`` a websocket upgrade may come from (see the module docstring).

    The port is the one the connection arrived at (the ASGI ``server`` address): the port
    actually bound, also when the configuration says ``:0``.  A page under
    ``public_host`` is behind a reverse proxy: any scheme of the two and any port.
    """

    def __init__(self, host: str, public_host: str | None = None) -> None:
        host = host.strip("[]").lower()
        self.wildcard = host in WILDCARDS
        self.hosts = {host} | (LOOPBACK_NAMES if is_loopback(host) else set())
        self.public = host_name(public_host) if public_host else None

    def allows(self, origin: str, host_header: str | None, port: object) -> bool:
        try:
            parts = urllib.parse.urlsplit(origin.strip())
            origin_port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            return False
        if (
            self.public is not None
            and parts.scheme in ("http", "https")
            and parts.hostname is not None
            and host_name(parts.hostname) == self.public
        ):
            return True
        if parts.scheme != "http" or not parts.hostname or origin_port != port:
            return False
        name = parts.hostname.lower()
        if name in self.hosts:
            return True
        if self.wildcard and host_header:
            return parts.netloc.lower() == host_header.strip().lower()
        return False


_LOGIN_HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>dshim: sign in</title>
<style>
body{font-family:system-ui,sans-serif;max-width:24rem;margin:15vh auto;padding:0 1rem;color:#222}
h1{font-size:1.3rem}label{display:block;margin:1rem 0 .3rem}
input{width:100%;box-sizing:border-box;padding:.5rem;font-size:1rem}
button{margin-top:1rem;padding:.5rem 1.2rem;font-size:1rem}
#error{color:#b00020;min-height:1.2rem;margin-top:.8rem}
</style></head><body>
<h1>dshim</h1>
<p>This dshim needs its access token (<code>[http] token</code> in dshim.toml).</p>
<form id="login" method="post" action="/login">
<input type="hidden" name="next" value="{next}">
<label for="token">Token</label>
<input id="token" name="token" type="password" autocomplete="current-password" required autofocus>
<button type="submit">Sign in</button>
<div id="error" role="alert"></div>
</form>
<script>
document.getElementById("login").addEventListener("submit", async (event) => {
  event.preventDefault();
  const form = event.target;
  const reply = await fetch("/login", {method: "POST", body: new URLSearchParams(new FormData(form)),
                                       redirect: "manual", credentials: "same-origin"});
  if (reply.type === "opaqueredirect" || reply.ok) { location.assign(form.next.value || "/"); return; }
  const wait = reply.headers.get("retry-after");
  document.getElementById("error").textContent =
    reply.status === 401 ? "That is not the token." :
    reply.status === 429 ? "Too many tries: wait " + wait + " s, then try again." :
    "Sign-in failed (HTTP " + reply.status + ").";
});
</script>
</body></html>
"""


def login_page(next_path: str) -> HttpResponse:
    """The login form (``next_path``: where to go after signing in)."""
    body = _LOGIN_HTML.replace("{next}", html.escape(safe_next(next_path), quote=True))
    return HttpResponse(
        200,
        body.encode(),
        "text/html; charset=utf-8",
        headers=(("cache-control", "no-store"),),
    )


def safe_next(path: str) -> str:
    """A local path to go to after login (anything else is ``/``: no open redirect)."""
    if path.startswith("/") and not path.startswith("//") and "\\" not in path:
        return path
    return "/"


def login_form(request: HttpRequest) -> tuple[str, str] | None:
    """``(token, next)`` from a login POST, or None when it is not a login form."""
    kind = (request.header("content-type") or "").split(";")[0].strip().lower()
    if kind != "application/x-www-form-urlencoded":
        return None
    try:
        fields = urllib.parse.parse_qs(
            request.body.decode("utf-8"), strict_parsing=True, max_num_fields=10
        )
    except (UnicodeDecodeError, ValueError):
        return None
    tokens = fields.get("token", [])
    if len(tokens) != 1 or not tokens[0]:
        return None
    return tokens[0], fields.get("next", ["/"])[0]
