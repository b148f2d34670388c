"""The sans-IO half of :mod:`dshim.net.ws`: the session protocol and its actions.

A websocket channel's ``protocol.py`` implements :class:`WsSession` and returns these
actions; it imports this module, never :mod:`dshim.net.ws` (which is trio code),
so that it stays free of trio, sockets and clocks.  Read :mod:`dshim.net.ws` for
what the runner does with each action.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar, runtime_checkable

__all__ = [
    "Action",
    "Close",
    "Connected",
    "Deliver",
    "Handover",
    "Ignored",
    "Ping",
    "Pinging",
    "Send",
    "WsEnded",
    "WsSession",
]

E = TypeVar("E")


# --- actions a session returns ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    """Send one frame: ``str`` as a text frame, ``bytes`` as a binary frame.

    ``kind`` names it in logs (the payload may carry a token); ``logged`` False keeps
    frequent frames (heartbeats, acks) out of the log.
    """

    data: str | bytes
    kind: str = "frame"
    logged: bool = True

    def __repr__(self) -> str:
        return f"Send(kind={self.kind!r})"


@dataclass(frozen=True, slots=True)
class Close:
    """Close the websocket with this code; the session then gets ``connection_lost``."""

    code: int
    reason: str


@dataclass(slots=True)  # not frozen: one is built per event, and frozen init is 3x slower
class Deliver(Generic[E]):
    """Hand ``event`` to the channel's ``deliver`` callback, in order.

    ``ack`` (if any) is sent after ``deliver`` returned a confirming verdict, or before it
    is called when ``ack_at_once`` is set (see the module docstring).
    """

    event: E
    ack: Send | None = None
    ack_at_once: bool = False


@dataclass(frozen=True, slots=True)
class Connected:
    """The session is live (READY, RESUMED, subscribed ...); ``session`` is for logs."""

    resumed: bool = False
    session: str | None = None


@dataclass(frozen=True, slots=True)
class Ignored:
    """A frame the session dropped (malformed, unknown opcode ...); logged, nothing else."""

    reason: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Handover:
    """The server announced that this connection ends soon (DingTalk ``disconnect``,
    Slack ``refresh_requested``): start the next connection now, while this one stays
    open -- it may still deliver -- until it closes (the session's own :class:`Close`,
    the server, or the runner once the next one is live: ``close_replaced``).  Acted on
    by :func:`dshim.net.ws.run_ws_handover`; elsewhere it is only logged."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Ping:
    """Send a websocket ping (protocol level) now, for a session that judges liveness by
    its own pongs (Slack Socket Mode): when the pong arrives the runner calls the
    session's ``pong(now)`` (:class:`Pinging`).  The session stays in charge of the
    timing, unlike ``WsOptions.ping_interval_s``."""


Action = Send | Close | Deliver[E] | Connected | Ignored | Handover | Ping


@dataclass(frozen=True, slots=True)
class WsEnded:
    """How one connection ended.

    ``code`` is the close code (ours when we closed, else the peer's; None when the
    network failed or the connection never opened), ``rejected`` the HTTP status of a
    refused upgrade (``rejected_headers`` its headers), ``connected_for`` how long the
    session was live (None: it never got :class:`Connected`).
    """

    code: int | None
    reason: str | None = None
    by_us: bool = False
    rejected: int | None = None
    connected_for: float | None = None
    #: The headers of a refused upgrade (lower-case names), for platforms that say why
    #: there (Feishu's ``Handshake-Autherrcode``).
    rejected_headers: tuple[tuple[str, str], ...] = ()

    def rejected_header(self, name: str) -> str | None:
        name = name.lower()
        return next((v for k, v in self.rejected_headers if k == name), None)

    @property
    def connected(self) -> bool:
        return self.connected_for is not None


class WsSession(Protocol[E]):
    """A platform's connection logic without I/O.  Time is an argument; never a clock."""

    def connection_opened(self, now: float) -> Sequence[Action[E]]:
        """A websocket is open (first frames to send, e.g. a subscribe or a ping)."""
        ...

    def receive(self, data: str | bytes, now: float) -> Sequence[Action[E]]:
        """One frame from the server.  Bad input is an :class:`Ignored`, never an error."""
        ...

    def next_timer(self) -> float | None:
        """When :meth:`tick` must run next (None: no timer)."""
        ...

    def tick(self, now: float, *, reading: bool) -> Sequence[Action[E]]:
        """Timers are due.  ``reading`` False: the shell is blocked in ``deliver``."""
        ...

    def connection_lost(self, ended: WsEnded, now: float) -> None:
        """The connection ended; plan the next one.  Raise to stop for good."""
        ...


@runtime_checkable
class Pinging(Protocol):
    """A session that returns :class:`Ping` actions is told about their pongs."""

    def pong(self, now: float) -> None:
        """The pong of the last :class:`Ping` arrived."""
        ...
