"""The trio half of :mod:`dshim.channels.kit.gateway`: plan, wait, connect, forever.

:func:`run_gateway` keeps a :class:`~dshim.channels.kit.gateway.GatewaySession` connected
on the kit's websocket runner (:func:`dshim.net.ws.run_ws`).  Its plan step,
:func:`next_gateway_url`, asks the session where to connect: it fetches
``GET /gateway/bot`` (the platform's ``fetch_info``) when the session asks for it --
transient failures back off and try again, AuthError and FatalChannelError are raised --
and sleeps as long as the identify budget says.  ``before_connect`` runs right before each
connection (QQ puts its current access token into the session there).  :func:`probe_ready`
is a probe's ``gateway`` row: one connection until READY, closed with 1000.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import NoReturn

import structlog
import trio

from dshim.backoff import Backoff
from dshim.channels.base import ProbeResult
from dshim.channels.kit.gateway import Dispatch, GatewayBot, GatewaySession
from dshim.errors import AuthError, ChannelError, FatalChannelError, RateLimited
from dshim.net.ws import (
    DEFAULT_OPTIONS,
    Connected,
    Deliverer,
    WsOptions,
    connect_once,
    run_ws,
)

__all__ = ["next_gateway_url", "probe_ready", "run_gateway"]

log = structlog.get_logger("dshim.kit")

#: ``GET /gateway/bot`` of the platform (raises the error tree).
InfoFetcher = Callable[[], Awaitable[GatewayBot]]


async def next_gateway_url(
    gw: GatewaySession,
    fetch_info: InfoFetcher,
    *,
    backoff: Backoff,
    clock: Callable[[], float] = trio.current_time,
) -> str:
    """The URL of the next connection, once the session's plan allows one."""
    while True:
        now = clock()
        plan = gw.plan_connection(now)
        if plan.refresh_gateway:
            try:
                info = await fetch_info()
            except (AuthError, FatalChannelError):
                raise
            except ChannelError as exc:
                if gw.gateway_info_unavailable():
                    log.warning("ws_url_failed", error=str(exc), fallback="gateway_url")
                    continue
                retry_after = exc.retry_after if isinstance(exc, RateLimited) else None
                delay = backoff.next_delay(retry_after=retry_after)
                log.warning("ws_url_failed", error=str(exc), retry_in_s=round(delay, 2))
                await trio.sleep(delay)
                continue
            gw.set_gateway_info(info, clock())
            log.info(
                "ws_url_fetched",
                identifies_remaining=info.session_start_limit.remaining,
                max_concurrency=info.session_start_limit.max_concurrency,
            )
            continue
        if plan.not_before > now:
            wait = plan.not_before - now
            if plan.reason or wait >= 1.0:
                log.info("connect_delayed", seconds=round(wait, 2), reason=plan.reason or "wait")
            await trio.sleep_until(plan.not_before)
            continue
        return plan.url


async def run_gateway(
    gw: GatewaySession,
    fetch_info: InfoFetcher,
    deliver: Deliverer[Dispatch],
    *,
    backoff: Backoff | None = None,
    clock: Callable[[], float] = trio.current_time,
    options: WsOptions = DEFAULT_OPTIONS,
    before_connect: Callable[[], Awaitable[None]] | None = None,
) -> NoReturn:
    """Keep a gateway session alive forever: connect, resume or identify, reconnect.

    Every wanted dispatch is awaited with ``deliver``, in gateway order, before the next
    frame is read.  Raises :class:`~dshim.errors.AuthError` /
    :class:`~dshim.errors.FatalChannelError` on fatal close codes.
    """
    backoff = backoff or Backoff()

    async def next_url() -> str:
        url = await next_gateway_url(gw, fetch_info, backoff=backoff, clock=clock)
        if before_connect is not None:
            await before_connect()
        return url

    await run_ws(gw, next_url, deliver, backoff=backoff, clock=clock, options=options)


async def probe_ready(gw: GatewaySession, info: GatewayBot) -> tuple[ProbeResult, str]:
    """Connect once with ``info`` (``GET /gateway/bot``), wait for READY, close cleanly.

    Never identifies against the identify budget; raises what a fatal close code raises.
    """
    gw.set_gateway_info(info, trio.current_time())
    plan = gw.plan_connection(trio.current_time())
    if plan.refresh_gateway or plan.not_before > trio.current_time():
        return "fail", "no identify allowed now (session_start_limit); not connecting"
    t0 = time.perf_counter()
    reached: list[Connected] = []

    async def ignore(dispatch: Dispatch) -> None:
        return None

    ended = await connect_once(
        plan.url, gw, ignore, on_connected=reached.append, stop_when_connected=True
    )
    if not reached:
        gw.connection_lost(ended, trio.current_time())  # raises for fatal codes
        why = gw.last_close_reason or f"close code {ended.code}"
        return "fail", f"the gateway closed before READY ({why})"
    ms = (time.perf_counter() - t0) * 1000
    return "ok", f"READY in {ms:.0f} ms (session {reached[0].session}), closed cleanly"
