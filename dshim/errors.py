"""The dshim error tree.

    DshimError
    ├── ConfigError                 bad dshim.toml / environment; names the key path (exit 2)
    ├── StoreError                  the persistent store cannot be opened or migrated
    ├── ChannelError                anything a platform did to us
    │   ├── TransportError          network failure, timeout, 5xx: retry with backoff
    │   ├── RemoteProtocolError     the platform sent something we cannot decode
    │   ├── AuthError               bad or revoked credentials: fatal, the bot stops
    │   ├── RateLimited             429 / flood control: carries retry_after seconds
    │   ├── NotFound                the message/chat/target does not exist (404-like)
    │   ├── PermissionDenied        blocked, kicked, missing access (401/403-like)
    │   ├── TooLarge                a download is over its byte limit (declared or read)
    │   ├── Conflict                another poller / webhook owns the bot (Telegram 409)
    │   └── FatalChannelError       do not reconnect (e.g. Discord close 4004)
    └── HarnessError                the agent backend failed or is unreachable

Foreign exceptions (httpx, trio-websocket, sqlite3, msgspec) are mapped once, at the
boundary that caught them, with ``raise X from exc``.  Every error that can carry an HTTP
status exposes it as ``.status`` so the quoted-reply layer can classify lookup failures.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class DshimError(Exception):
    """Root of every error dshim raises on purpose."""


class ConfigError(DshimError):
    """The configuration is invalid; the message names the file and the key path."""


class StoreError(DshimError):
    """The store cannot be opened, migrated or written."""


class ChannelError(DshimError):
    """A platform call failed.  ``status`` is the HTTP status when there was one."""

    def __init__(self, message: str, *, status: int | None = None, code: int | str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code


class TransportError(ChannelError):
    """Network error, timeout or server error: transient, retry with backoff.

    ``request_sent`` False means the request certainly never reached the platform (the
    connection could not be made), so repeating it cannot duplicate anything.  True
    means the platform may have processed it (a timeout or a dropped connection after
    the request went out, a 5xx): the outcome is unknown.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        code: int | str | None = None,
        request_sent: bool = True,
    ):
        super().__init__(message, status=status, code=code)
        self.request_sent = request_sent


class RemoteProtocolError(ChannelError):
    """The platform answered with something that does not decode."""


class AuthError(ChannelError):
    """Credentials were rejected.  Fatal for the bot: no retry loop."""


class RateLimited(ChannelError):
    """The platform asked us to slow down for ``retry_after`` seconds."""

    def __init__(
        self,
        message: str,
        *,
        retry_after: float,
        status: int | None = 429,
        code: int | str | None = None,
        is_global: bool = False,
    ):
        super().__init__(message, status=status, code=code)
        self.retry_after = retry_after
        self.is_global = is_global


class NotFound(ChannelError):
    """The addressed message, chat or file does not exist (any more)."""

    def __init__(self, message: str, *, status: int | None = 404, code: int | str | None = None):
        super().__init__(message, status=status, code=code)


class Deleted(NotFound):
    """The addressed message existed but was deleted."""

    def __init__(self, message: str, *, status: int | None = 410, code: int | str | None = None):
        super().__init__(message, status=status, code=code)


class PermissionDenied(ChannelError):
    """The bot may not see or do this (blocked, kicked, missing access)."""

    def __init__(self, message: str, *, status: int | None = 403, code: int | str | None = None):
        super().__init__(message, status=status, code=code)


class TooLarge(ChannelError):
    """A download is over the byte limit it was given (a declared size, or what was read
    before it was cut off): nothing of it is used."""


class Conflict(ChannelError):
    """Another consumer owns the bot's update stream (Telegram 409)."""

    def __init__(self, message: str, *, status: int | None = 409, code: int | str | None = None):
        super().__init__(message, status=status, code=code)


class FatalChannelError(ChannelError):
    """The platform told us never to reconnect with these settings."""


class HarnessError(DshimError):
    """The harness (agent backend) failed, refused or is unreachable."""

    def __init__(self, message: str, *, code: str = "harness-failed"):
        super().__init__(message)
        self.code = code


#: Exceptions that signal a programming error: they are never retried quietly.
BUG_TYPES: tuple[type[BaseException], ...] = (
    TypeError,
    AttributeError,
    AssertionError,
    NameError,
    KeyError,
    IndexError,
)


@contextlib.contextmanager
def single_error() -> Iterator[None]:
    """Re-raise a nursery's ExceptionGroup of exactly one exception as that exception.

    Public ``open_*`` context managers that hold a nursery use it so callers see the
    error (or cancellation) itself, never a group of one.
    """
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) == 1:
            inner = group.exceptions[0]
            raise inner from inner.__cause__
        raise
