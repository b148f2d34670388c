"""Retrying a call through transient failures, for channels that have not started yet.

A channel's ``run`` must not let transient errors escape (see
:mod:`dshim.channels.base`): when the identity call at start-up meets a network
failure, a 5xx or a 429, it waits and tries again, with the shared backoff, until it
succeeds or a fatal error (bad credentials) ends the bot.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog
import trio

from dshim.backoff import Backoff
from dshim.errors import (
    AuthError,
    ChannelError,
    FatalChannelError,
    PermissionDenied,
    RateLimited,
)

__all__ = ["until_ok"]

log = structlog.get_logger("dshim.kit")

T = TypeVar("T")


async def until_ok(
    what: str,
    fn: Callable[[], Awaitable[T]],
    *,
    backoff: Backoff | None = None,
) -> T:
    """``await fn()`` until it returns.  Transient ChannelErrors back off and retry.

    :class:`~dshim.errors.AuthError` and :class:`~dshim.errors.FatalChannelError` are
    raised at once; :class:`~dshim.errors.PermissionDenied` too, as an AuthError (the
    credentials are valid but may not do what the bot needs: nothing a retry can fix,
    and only AuthError, FatalChannelError and ConfigError may end a channel's ``run``).
    Anything that is not a ChannelError is not caught.
    """
    backoff = backoff or Backoff()
    while True:
        try:
            return await fn()
        except (AuthError, FatalChannelError):
            raise
        except PermissionDenied as exc:
            raise AuthError(f"{what}: {exc}", status=exc.status, code=exc.code) from exc
        except RateLimited as exc:
            delay = backoff.next_delay(retry_after=exc.retry_after)
            log.warning("rate_limited", what=what, retry_in_s=round(delay, 2))
        except ChannelError as exc:
            delay = backoff.next_delay()
            log.warning(
                "call_failed_retrying", what=what, error=str(exc), retry_in_s=round(delay, 2)
            )
        await trio.sleep(delay)
