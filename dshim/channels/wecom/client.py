"""The WeCom long connection, thin trio I/O over :mod:`.protocol`.

:class:`WecomLink` owns the bot's one websocket: the kit's runner
(:func:`~dshim.net.ws.run_ws`) connects it and drives :class:`~.protocol.WecomSession`
(subscribe, pings, takeover), and the link lets any task send a frame on the live socket
(its :class:`~dshim.net.ws.WsOutlet`) and await its ack with :meth:`WecomLink.request` —
strictly one frame at a time per ``req_id`` (a fair lock per ``req_id``, at most
:data:`~.protocol.REQ_QUEUE_MAX` waiting), each waiting at most 5 s for its ack.  When the
socket closes, every frame that was waiting for an ack or queued behind one fails with
:class:`~.protocol.ConnectionLost`; new requests wait (bounded) for the next connection.

Callbacks go to the channel through an unbuffered memory channel, in arrival order: the
reader hands over one callback at a time, so a slow pipeline slows the socket instead of
filling a queue (WeCom needs no callback ack, and acks of our own frames are read by the
same reader, so the pipeline's side must never wait for an ack while holding a callback).

Errors leave :meth:`WecomLink.run` only when fatal: :class:`~dshim.errors.AuthError` (the
subscribe was rejected) and :class:`~dshim.errors.FatalChannelError` (``disconnected_event``:
another connection took the bot over).  Everything else reconnects with the kit's backoff
(1-30 s with jitter; at once after a connection that was live for a while).
"""

from __future__ import annotations

import random as _random
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import structlog
import trio

from dshim.channels.kit import Backoff
from dshim.channels.wecom import protocol as p
from dshim.errors import ChannelError, TransportError
from dshim.net.http import count_request, download_capped
from dshim.net.ws import Connected, Deliverer, WsEnded, WsOptions, WsOutlet, connect_once, run_ws

log = structlog.get_logger("dshim.wecom")

DOWNLOAD_TIMEOUT = httpx.Timeout(30.0, connect=10.0)
USER_AGENT = "dshim-wecom"


@dataclass(frozen=True, slots=True)
class LinkTuning:
    """The connection's timings (tests shrink them)."""

    ping_interval_s: float = p.PING_INTERVAL_S
    ack_timeout_s: float = p.ACK_TIMEOUT_S
    subscribe_timeout_s: float = 10.0
    #: How long a request waits for a live connection before it fails.
    connect_wait_s: float = 30.0
    #: A connection live this long was healthy: reconnect at once, reset the backoff.
    stable_after_s: float = 5.0


class _Waiter:
    __slots__ = ("done", "ack", "lost")

    def __init__(self) -> None:
        self.done = trio.Event()
        self.ack: p.Ack | None = None
        self.lost = False


@dataclass(eq=False)
class _Slot:
    lock: trio.Lock = field(default_factory=trio.Lock)
    waiting: int = 0


def rand_hex() -> str:
    return secrets.token_hex(4)


def req_id_for(cmd: str) -> str:
    """A fresh ``req_id`` in the SDK's convention."""
    return p.new_req_id(cmd, int(time.time() * 1000), rand_hex())


class WecomLink:
    """The bot's websocket (see the module docstring)."""

    def __init__(
        self,
        url: str,
        bot_id: str,
        secret: str,
        *,
        rng: _random.Random | None = None,
        tuning: LinkTuning | None = None,
        options: WsOptions | None = None,
        new_req_id: Callable[[str], str] = req_id_for,
    ) -> None:
        self.url = url
        self.bot_id = bot_id
        self._secret = secret
        self.rng = rng or _random.Random()
        self.tuning = tuning or LinkTuning()
        self.options = options or WsOptions(stable_after_s=self.tuning.stable_after_s)
        self.new_req_id = new_req_id
        #: Incremented for every subscribed connection.
        self.generation = 0
        self._ws: WsOutlet | None = None
        self._live = trio.Event()
        self._pending: dict[str, _Waiter] = {}
        self._slots: dict[str, _Slot] = {}

    @property
    def live(self) -> bool:
        return self._ws is not None

    async def wait_live(self) -> None:
        await self._live.wait()

    # -- sending ---------------------------------------------------------------------------

    async def request(
        self, cmd: str, req_id: str, body: Any | None, *, what: str, bound: int | None = None
    ) -> p.Ack:
        """Send one frame and return its ack (errcode 0); a non-zero errcode raises its
        :func:`~.protocol.ack_error`.  Frames of one ``req_id`` go strictly in order.

        ``bound``: the frame belongs to what was sent on that connection (a stream): when
        that connection is gone it fails at once with ConnectionLost instead of waiting
        for the next one."""
        if bound is not None and (not self.live or self.generation != bound):
            raise p.ConnectionLost(f"{what}: the socket closed", request_sent=False)
        slot = self._slots.get(req_id)
        if slot is None:
            slot = self._slots[req_id] = _Slot()
        if slot.waiting >= p.REQ_QUEUE_MAX:
            raise ChannelError(f"{what}: {p.REQ_QUEUE_MAX} frames already wait for {cmd}")
        slot.waiting += 1
        queued_on = self.generation if self.live else None
        try:
            async with slot.lock:
                if queued_on is not None and (not self.live or self.generation != queued_on):
                    raise p.ConnectionLost(f"{what}: the socket closed", request_sent=False)
                return await self._send_and_wait(cmd, req_id, body, what)
        finally:
            slot.waiting -= 1
            if slot.waiting == 0 and self._slots.get(req_id) is slot:
                del self._slots[req_id]

    async def _send_and_wait(self, cmd: str, req_id: str, body: Any | None, what: str) -> p.Ack:
        if not self.live:
            with trio.move_on_after(self.tuning.connect_wait_s):
                await self._live.wait()
        ws = self._ws
        if ws is None:
            raise p.ConnectionLost(f"{what}: not connected", request_sent=False)
        waiter = _Waiter()
        self._pending[req_id] = waiter
        try:
            try:
                await ws.send(p.frame(cmd, req_id, body))
            except trio.ClosedResourceError:
                # Closed before the frame was written whole: WeCom never got it.
                raise p.ConnectionLost(f"{what}: the socket closed", request_sent=False) from None
            count_request(cmd, "sent")
            # Shielded: a frame on the wire keeps its req_id busy until its ack (or the
            # timeout), even when the sender is cancelled, so the next frame of that req_id
            # never goes out early and picks up this one's ack.
            with trio.CancelScope(shield=True), trio.move_on_after(self.tuning.ack_timeout_s):
                await waiter.done.wait()
            if waiter.lost:
                raise p.ConnectionLost(f"{what}: the socket closed before the ack")
            ack = waiter.ack
            if ack is None:
                raise TransportError(f"{what}: no ack within {self.tuning.ack_timeout_s:g} s")
            if ack.errcode != 0:
                raise p.ack_error(what, ack.errcode, ack.errmsg)
            return ack
        finally:
            if self._pending.get(req_id) is waiter:
                del self._pending[req_id]

    # -- the connection ----------------------------------------------------------------------

    async def run(
        self,
        callbacks: trio.MemorySendChannel[p.Callback],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Keep the bot connected (the kit's :func:`~dshim.net.ws.run_ws` over a
        :class:`~.protocol.WecomSession`); ``started`` after the first accepted subscribe."""
        session = p.WecomSession(
            self.bot_id,
            self._secret,
            self.new_req_id,
            ping_interval_s=self.tuning.ping_interval_s,
            subscribe_timeout_s=self.tuning.subscribe_timeout_s,
        )
        started = False
        opening: WsOutlet | None = None

        def opened(outlet: WsOutlet) -> None:
            nonlocal opening
            opening = outlet
            count_request(p.SUBSCRIBE, "sent")

        def connected(_: Connected) -> None:
            nonlocal started
            log.info("bot_authenticated", bot_id=self.bot_id)
            self.generation += 1
            self._ws = opening
            self._live.set()
            if not started:
                started = True
                task_status.started()

        async def deliver(got: p.Event) -> None:
            if isinstance(got, p.Callback):
                await callbacks.send(got)
                return
            waiter = self._pending.pop(got.req_id, None)
            if waiter is None:
                log.info("ack_unmatched", req_id=got.req_id[:80], errcode=got.errcode)
                return
            waiter.ack = got
            waiter.done.set()

        async def connect(
            url: str, session: p.WecomSession, deliver: Deliverer[p.Event], **kw: Any
        ) -> WsEnded:
            try:
                return await connect_once(
                    url, session, deliver, on_open=opened, on_connected=connected, **kw
                )
            finally:
                self._lost()

        async def next_url() -> str:
            return self.url

        await run_ws(
            session,
            next_url,
            deliver,
            backoff=Backoff(rng=self.rng),
            options=self.options,
            connect=connect,
        )

    def _lost(self) -> None:
        """The socket is gone: fail every frame waiting for an ack."""
        self._ws = None
        self._live = trio.Event()
        for waiter in self._pending.values():
            waiter.lost = True
            waiter.done.set()
        self._pending.clear()


async def download(http: httpx.AsyncClient, url: str, max_bytes: int) -> bytes:
    """GET an encrypted media URL (no auth), at most ``max_bytes`` (+ one pad block)."""
    return await download_capped(
        http, url, max_bytes + 32, http_timeout=DOWNLOAD_TIMEOUT, what="wecom media download"
    )
