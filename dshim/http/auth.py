"""Who may use the local HTTP endpoint: the bearer token, its cookie, and ``Origin``.

Rules (``[http] token``):

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
  (with the token when one is configured).

The token never appears in a response, a log line or an error.
"""

from __future__ import annotations

import hashlib
import hmac
import html
import urllib.parse
from collections.abc import Iterable

from dshim.channels.base import HttpRequest, HttpResponse
from dshim.config import is_loopback

__all__ = ["COOKIE", "Auth", "OriginPolicy", "login_page"]

COOKIE = "dshim_session"
#: How long the browser keeps the session cookie.
COOKIE_MAX_AGE_S = 30 * 24 * 3600
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})


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
        if self._token is None:
            return True
        ok = False
        for name, value in headers:
            if name == "authorization":
                scheme, _, credential = value.strip().partition(" ")
                if scheme.lower() == "bearer":
                    ok |= self.token_matches(credential.strip())
            elif name == "cookie":
                cookie = _cookie_value(value, COOKIE)
                if cookie is not None and self._cookie is not None:
                    ok |= hmac.compare_digest(cookie.encode(), self._cookie.encode())
        return ok

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


class OriginPolicy:
    """Which ``Origin`` a websocket upgrade may come from (see the module docstring).

    The port is the one the connection arrived at (the ASGI ``server`` address): the port
    actually bound, also when the configuration says ``:0``.
    """

    def __init__(self, host: str) -> None:
        host = host.strip("[]").lower()
        self.wildcard = host in WILDCARDS
        self.hosts = {host} | (LOOPBACK_NAMES if is_loopback(host) else set())

    def allows(self, origin: str, host_header: str | None, port: object) -> bool:
        try:
            parts = urllib.parse.urlsplit(origin.strip())
            origin_port = parts.port or 80
        except ValueError:
            return False
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
  document.getElementById("error").textContent =
    reply.status === 401 ? "That is not the token." : "Sign-in failed (HTTP " + reply.status + ").";
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
