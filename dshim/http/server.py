"""Serving the endpoint: hypercorn's trio worker in ``serve``'s root nursery.

hypercorn runs ASGI applications natively on trio (its trio worker), so dshim ships no
HTTP server of its own: :func:`serve_endpoint` binds ``[http] listen``, reports the bound
addresses through ``task_status`` (the bots start after that), and stops when
``shutdown`` is set — open websockets are closed first, then hypercorn finishes the
requests in flight (at most :data:`GRACEFUL_S`).  A bind failure (the port is taken, the
address is not ours) is a :class:`~dshim.errors.ConfigError` naming ``http.listen``.

Websockets are read by :class:`~dshim.http.wsstream.DshimWSStream` with one
:class:`~dshim.http.wsstream.WsLimits` per server: a message over
:data:`~dshim.http.wsstream.WS_MAX_MESSAGE` (28 MiB) is refused (1009) as its bytes pass
the cap, all sockets share one budget for what they hold, silent sockets are pinged and
closed (by one :class:`~dshim.http.wsstream.Pinger` task, run here next to the server).
"""

from __future__ import annotations

import errno
import logging

import structlog
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve

from dshim.errors import ConfigError
from dshim.http.app import GRACEFUL_S, Endpoint
from dshim.http.wsstream import WS_MAX_MESSAGE, DshimConfig, WsLimits, install

__all__ = ["GRACEFUL_S", "WS_MAX_MESSAGE", "serve_endpoint"]

log = structlog.get_logger("dshim.http")


def _hypercorn_config(listen: str, limits: WsLimits) -> HypercornConfig:
    install()
    config = DshimConfig()
    config.ws_limits = limits
    config.bind = [listen]
    config.graceful_timeout = GRACEFUL_S
    config.websocket_max_message_size = limits.max_message
    config.websocket_ping_interval = limits.ping_interval_s
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
    ws_limits: WsLimits | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``endpoint`` on ``listen`` (``host:port``) until ``shutdown`` is set
    (``ws_limits``: the websockets' limits, dshim's defaults when None)."""

    async def stopping() -> None:
        await shutdown.wait()
        await endpoint.close_sockets()

    limits = ws_limits or WsLimits()
    try:
        async with trio.open_nursery() as nursery:
            if limits.pinger is not None:
                nursery.start_soon(limits.pinger.run)
            try:
                await serve(
                    endpoint,  # type: ignore[arg-type]  # hypercorn's ASGI typing is stricter
                    _hypercorn_config(listen, limits),
                    shutdown_trigger=stopping,
                    task_status=task_status,
                )
            finally:
                nursery.cancel_scope.cancel()
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
