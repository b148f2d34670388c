"""The dshim error tree: every error dshim raises on purpose, drawn once.

A failed send ends as one of the outcomes of :func:`dshim.pipeline.notices.outcome_of`:
*unknown* (the platform may have it: never sent again), *later* (certainly not sent, the
platform is down or busy: the outbox delivers it when it is back) or *refused* (it never
will be: the chat is gone, the bot blocked).  Classes of a channel or harness name their
module in brackets (under ``dshim.channels`` for a channel, else under ``dshim``);
``tests/test_error_tree.py`` keeps this drawing and the classes the same.

    DshimError
    ├── ConfigError                 bad dshim.toml / environment; names the key path (exit 2)
    ├── StoreError                  the store cannot be opened, migrated or written: exit 1 at
    │   │                           start; in a turn the answer is still delivered
    │   └── FencedError             a write of a bot whose lease moved to another instance:
    │                               refused; that bot stops at once
    ├── FixtureError                [channels.base] replay: a fixture it cannot use (that fixture
    │                               fails with one line, the others run)
    ├── ChannelError                anything a platform did to us (``status``, ``code`` when it
    │   │                           said them); a send failing with it is *refused*
    │   ├── TransportError          network failure, timeout, 5xx: retry with backoff; a send is
    │   │   │                       *later* when ``request_sent`` is False or a status came, else
    │   │   │                       *unknown*
    │   │   ├── ConnectionLost      [wecom.protocol] the socket closed while a frame waited for
    │   │   │                       its ack (the outcome is unknown)
    │   │   └── Throttled           [whatsapp.protocol] a throughput or pair-rate limit: not sent
    │   │                           (*later*), backed off exponentially (Graph gives no wait)
    │   ├── RemoteProtocolError     the platform sent something we cannot decode: dropped, logged
    │   │   ├── FrameError          [feishu.protocol] bytes that are no ``pbbp2.Frame``
    │   │   ├── FrameError          [webchat.protocol] a page's frame dshim refuses: answered with
    │   │   │                       an error frame, the socket stays open
    │   │   └── BodyError           [whatsapp.protocol] a signed webhook body that is no
    │   │                           notification: the pipeline's ``malformed`` drop, answered 200
    │   ├── AuthError               bad or revoked credentials: fatal for the bot's connection (no
    │   │   │                       retry loop); a send is *later*
    │   │   └── SessionExpired      [weixin.protocol] ``ret -14``: the bot token is dead, only a
    │   │                           new QR login (``dshim login``) helps
    │   ├── RateLimited             429 / flood control: wait ``retry_after`` seconds; a send is
    │   │                           *later*
    │   ├── NotFound                the message/chat/target does not exist (404-like); a quote's
    │   │   │                       lookup gives ``not-found``
    │   │   ├── Deleted             it existed but was deleted (410-like): ``deleted``
    │   │   ├── ThreadNotFound      [telegram.protocol] the forum topic is gone: the answer goes
    │   │   │                       to the chat itself
    │   │   ├── ReplyExpired        [wecom.protocol] 846605, the inbound ``req_id`` is no longer
    │   │   │                       valid: pushed instead
    │   │   └── StreamExpired       [wecom.protocol] 846608, the stream's 6 minutes are over:
    │   │                           continued on a new stream id
    │   ├── PermissionDenied        blocked, kicked, missing access (401/403-like): *refused*; a
    │   │   │                       quote's lookup gives ``permission-denied``
    │   │   └── IpNotAllowed        [qq.protocol] the caller's IP is not on the bot's allowlist
    │   ├── TooLarge                a download is over its byte limit (declared or read): the
    │   │                           attachment is left out
    │   ├── Conflict                another poller / webhook owns the bot (Telegram 409): the
    │   │                           poller logs it and backs off
    │   ├── FatalChannelError       do not reconnect (e.g. Discord close 4004): the bot stops
    │   ├── ReplyWindowClosed       [qq.protocol] the passive-reply window or count is used up:
    │   │                           *refused*, never retried
    │   ├── AlreadySent             [qq.protocol] 40054005, an earlier attempt landed: counts as
    │   │                           sent
    │   ├── PendingAudit            [qq.protocol] accepted, pending manual audit: counts as sent
    │   ├── MarkdownRejected        [qq.protocol] markdown invalid or not permitted: sent as text
    │   ├── StreamPrefixRejected    [qq.protocol] 40007, a stream chunk changed the delivered
    │   │                           prefix: the message is finished, the rest goes anew
    │   ├── ContentRejected         [qq.protocol] sensitive words, an unregistered URL: *refused*
    │   ├── NotModified             [telegram.protocol] an edit that changes nothing: success
    │   ├── ChatMigrated            [telegram.protocol] the group became a supergroup: resent to
    │   │                           ``migrate_to_chat_id``
    │   ├── MediaError              [wecom.media] media that does not decrypt: left out
    │   ├── MediaDecryptError       [weixin.media] media that does not decrypt: left out
    │   ├── ReplyRefused            [weixin.protocol] ``ret -2`` on a send: one retry after a
    │   │                           pause, then *refused*
    │   ├── ReplyNotPossible        [weixin.render] no context token, outside the 24 h window:
    │   │                           *refused*
    │   └── WindowClosed            [whatsapp.protocol] 131047, 24 h since the user last wrote:
    │                               *refused* (only templates go out)
    └── HarnessError                the agent backend failed, refused or is unreachable: the
        │                           turn ends with the error as its answer (``code`` names it)
        ├── AgentRpcError           [harness.acp.protocol] the agent answered a JSON-RPC error
        ├── HostNotLoggedIn         [harness.dsh.protocol] HTTP 401/407: ``[harness] token``
        ├── HostRefused             [harness.dsh.protocol] HTTP 403: the host does not trust us
        ├── HostTooOld              [harness.dsh.protocol] HTTP 404: no such API on the host
        └── DshRpcError             [harness.dsh.protocol] ``{ok:false, error}``: ``rpc_code``

Outside the tree, by design (the test keeps this list too; private ``_`` classes are a
module's own control flow and the :mod:`dshim.testing` fakes' errors are their platforms'):

* WebSocketClosed [http.types] — a signal, not a failure: the peer closed the socket;
  ``WebSocket.receive`` ends with it (it carries the close code), the reader returns.
* Exit [launch] — a signal: the exit code the CLI leaves with (``typer.Exit`` at the edge).
* UndocumentedKey [docs_config] — ``python -m dshim.docs_config``'s check for a settings
  key without a ``#:`` comment, a development tool; the program never raises it.
* BadId, BadTime [channels.kit.ids] — ``ValueError`` signals of the id and time checks,
  caught in each channel's decode and turned into the ``malformed`` drop; they never leave
  it.

Foreign exceptions (httpx, trio-websocket, sqlite3, msgspec) are mapped once, at the
boundary that caught them, with ``raise X from exc``.  Every error that can carry an HTTP
status exposes it as ``ChannelError.status``; the quoted-reply layer classifies lookup
failures by class, then by that status, never by sniffing a foreign exception.
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


class FencedError(StoreError):
    """A write of a bot whose lease moved on (another instance runs the bot now): refused,
    and the writer must stop that bot at once."""


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

    @property
    def outcome_unknown(self) -> bool:
        """The request went out and no answer came back: the platform may have acted on
        it (a send so failed is repeated at most once, unless it is idempotent)."""
        return self.request_sent and self.status is None


def outcome_unknown(exc: BaseException) -> bool:
    """``exc`` is a :class:`TransportError` whose request may have been acted on."""
    return isinstance(exc, TransportError) and exc.outcome_unknown


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
