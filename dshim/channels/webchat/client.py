"""The web chat's connected tabs: one websocket each, a bounded outbox, broadcast by
conversation.  Thin trio I/O; what goes into the frames is :mod:`.protocol`'s.

Nothing that sends to tabs ever waits for one: :meth:`Tab.push` queues a frame and
returns.  Each tab's writer task sends its queue in order.  Frames that carry the text so
far of a message being written are *coalesced*: a newer frame for the same message
replaces a queued older one in place, so a slow tab gets fewer intermediate texts, never
a stale one after a newer, and never loses the final one.  A tab whose queue still
overflows (:data:`OUTBOX_MAX`) is closed with 1013 ("try again later"): the page
reconnects and reloads the conversation's history.

Admission (:class:`Tabs`): a bot serves at most :data:`TABS_MAX` sockets, one client
address at most :data:`TABS_PER_ADDRESS` of them (an address cannot take every slot) and
one client — a user id from one address — at most :data:`TABS_PER_CLIENT`, counted when
it joins.  A socket that has not joined yet holds its slot loosely: when a new socket
finds its address's share or all slots taken, the oldest socket that has not joined (of
that address, or of all) is dismissed to make room, so sockets that never say anything
cannot keep a real tab out.  Only when every slot in the way is held by a joined tab is
the new socket refused.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator

import structlog
import trio

from dshim.channels.base import WebSocket, WebSocketClosed
from dshim.channels.webchat.protocol import Member

log = structlog.get_logger("dshim.webchat")

#: Frames waiting for one tab's writer before the tab counts as stuck.
OUTBOX_MAX = 512
#: Conversations one socket may have joined at once (the oldest is left).
JOINED_MAX = 64
#: Sockets one bot serves at once.
TABS_MAX = 256
#: Sockets of one client address (a quarter of all: one address cannot take them all).
TABS_PER_ADDRESS = 64
#: Sockets of one client: one user id from one address (a person's tabs).
TABS_PER_CLIENT = 16
TOO_SLOW_CODE = 1013


class Tab:
    """One connected websocket: its memberships and its outbox."""

    def __init__(self, ws: WebSocket, *, client: str = "", outbox_max: int = OUTBOX_MAX) -> None:
        self.ws = ws
        #: The peer's address as the endpoint's limits group it (``WebSocket.client``).
        self.client = client
        #: The user id of its last accepted ``join`` (None: it has not joined).
        self.user: str | None = None
        #: Around the tab's tasks: :meth:`dismiss` cancels it from any task.
        self.scope = trio.CancelScope()
        #: The close code and reason it was dismissed with.
        self.dismissed: tuple[int, str] | None = None
        self.outbox_max = outbox_max
        self.joined: OrderedDict[str, Member] = OrderedDict()
        self._queue: OrderedDict[object, str] = OrderedDict()
        self._serial = 0
        self._wake = trio.Event()
        self.overflowed = False

    def member(self, conversation: str) -> Member | None:
        return self.joined.get(conversation)

    def join(self, member: Member) -> None:
        self.joined.pop(member.conversation, None)
        self.joined[member.conversation] = member
        while len(self.joined) > JOINED_MAX:
            self.joined.popitem(last=False)

    def leave(self, conversation: str) -> None:
        self.joined.pop(conversation, None)

    def dismiss(self, code: int, reason: str) -> None:
        """Stop serving this tab (from any task): its tasks are cancelled and whoever
        serves it closes the socket with ``code`` and ``reason``."""
        if self.dismissed is None:
            self.dismissed = (code, reason)
        self.scope.cancel()

    def push(self, frame: str, *, key: str | None = None) -> None:
        """Queue a frame; one with the ``key`` of a queued frame replaces it in place."""
        if self.overflowed:
            return
        if key is not None and key in self._queue:
            self._queue[key] = frame
            return
        if len(self._queue) >= self.outbox_max:
            self.overflowed = True
            self._wake.set()
            return
        if key is None:
            self._serial += 1
            self._queue[self._serial] = frame
        else:
            self._queue[key] = frame
        self._wake.set()

    @property
    def queued(self) -> int:
        return len(self._queue)

    async def run_writer(self) -> None:
        """Send queued frames in order until the socket closes (or the tab is too slow)."""
        while True:
            if self.overflowed:
                log.warning("tab_dropped", reason="too_slow", queued=len(self._queue))
                await self.ws.close(TOO_SLOW_CODE, "too many frames waiting: reconnect")
                return
            if not self._queue:
                self._wake = trio.Event()
                await self._wake.wait()
                continue
            _, frame = self._queue.popitem(last=False)
            try:
                await self.ws.send(frame)
            except WebSocketClosed:
                return


class Tabs:
    """The tabs of one bot, and which conversations each follows."""

    def __init__(
        self,
        *,
        max_tabs: int = TABS_MAX,
        per_address: int = TABS_PER_ADDRESS,
        per_client: int = TABS_PER_CLIENT,
    ) -> None:
        self.max_tabs = max_tabs
        self.per_address = per_address
        self.per_client = per_client
        #: Oldest first (a dict keeps the order they came in).
        self._tabs: dict[Tab, None] = {}

    def admit(self, tab: Tab) -> list[Tab] | None:
        """Take a new tab (see the module docstring).  Returns the tabs that lost their
        slot to it — not joined, oldest first, already removed: dismiss them — or None
        when there is no room (nothing changed)."""
        victims: list[Tab] = []
        mine = [t for t in self._tabs if t.client == tab.client]
        if len(mine) >= self.per_address:
            victim = _oldest_not_joined(mine)
            if victim is None:
                return None
            victims.append(victim)
        if len(self._tabs) - len(victims) >= self.max_tabs:
            victim = _oldest_not_joined(t for t in self._tabs if t not in victims)
            if victim is None:
                return None
            victims.append(victim)
        for victim in victims:
            del self._tabs[victim]
        self._tabs[tab] = None
        return victims

    def joining(self, tab: Tab, user: str) -> bool:
        """``tab`` joins as ``user``: False when its client (``user`` from its address)
        already has :attr:`per_client` other tabs."""
        others = sum(
            1 for t in self._tabs if t is not tab and t.client == tab.client and t.user == user
        )
        if others >= self.per_client:
            return False
        tab.user = user
        return True

    def remove(self, tab: Tab) -> None:
        self._tabs.pop(tab, None)

    def __len__(self) -> int:
        return len(self._tabs)

    def following(self, conversation: str) -> Iterator[Tab]:
        return (t for t in list(self._tabs) if conversation in t.joined)

    def broadcast(self, conversation: str, frame: str, *, key: str | None = None) -> int:
        """Queue ``frame`` for every tab in ``conversation``; returns how many."""
        n = 0
        for tab in self.following(conversation):
            tab.push(frame, key=key)
            n += 1
        return n

    async def close_all(self, code: int, reason: str) -> None:
        for tab in list(self._tabs):
            await tab.ws.close(code, reason)


def _oldest_not_joined(tabs: Iterable[Tab]) -> Tab | None:
    return next((t for t in tabs if t.user is None), None)
