"""Serving the endpoint: hypercorn's trio worker in ``serve``'s root nursery.

hypercorn runs ASGI applications natively on trio (its trio worker), so dshim ships no
HTTP server of its own: :func:`serve_endpoint` binds ``[http] listen``, reports the bound
addresses through ``task_status`` (the bots start after that), and stops when
``shutdown`` is set — open websockets are closed first, then hypercorn finishes the
requests in flight (at most :data:`GRACEFUL_S`).  A bind failure (the port is taken, the
address is not ours) is a :class:`~dshim.errors.ConfigError` naming ``http.listen``.
"""

from __future__ import annotations

import errno
import logging

import structlog
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from dshim.errors import ConfigError
from dshim.http.app import GRACEFUL_S, MAX_BODY, Endpoint

__all__ = ["GRACEFUL_S", "serve_endpoint"]

log = structlog.get_logger("dshim.http")

#: Websocket messages up to this size reach the handler (which answers an oversized one
#: with an error frame and keeps the socket); only beyond it does the server close the
#: socket (1009).  Twice the largest body a handler accepts.
WS_MAX_MESSAGE = 2 * MAX_BODY


def _hypercorn_config(listen: str) -> HypercornConfig:
    config = HypercornConfig()
    config.bind = [listen]
    config.graceful_timeout = GRACEFUL_S
    config.websocket_max_message_size = WS_MAX_MESSAGE
    config.include_server_header = False
    config.accesslog = None
    # hypercorn's own error log goes through stdlib logging (structlog renders it); its
    # info lines ("Running on ...") repeat http_listening, so only warnings and errors.
    config.errorlog = _HYPERCORN_LOG
    return config


_HYPERCORN_LOG = logging.getLogger("hypercorn.error.dshim")
_HYPERCORN_LOG.setLevel(logging.WARNING)


async def serve_endpoint(
    endpoint: Endpoint,
    listen: str,
    *,
    shutdown: trio.Event,
    label: str = "http.listen",
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``endpoint`` on ``listen`` (``host:port``) until ``shutdown`` is set."""

    async def stopping() -> None:
        await shutdown.wait()
        await endpoint.close_sockets()

    try:
        await serve(
            endpoint,  # type: ignore[arg-type]  # hypercorn's ASGI typing is stricter than ours
            _hypercorn_config(listen),
            shutdown_trigger=stopping,
            task_status=task_status,
        )
    except* OSError as group:
        exc = _first(group)
        why = "the address is already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
        raise ConfigError(f"{label}: cannot listen on {listen}: {why or exc}") from None


def _first(group: BaseExceptionGroup[OSError]) -> OSError:
    exc: BaseException = group
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    assert isinstance(exc, OSError)
    return exc
