"""The web chat's connected tabs: one websocket each, a bounded outbox, broadcast by
conversation.  Thin trio I/O; what goes into the frames is :mod:`.protocol`'s.

Nothing that sends to tabs ever waits for one: :meth:`Tab.push` queues a frame and
returns.  Each tab's writer task sends its queue in order; it runs only while frames
wait (an idle tab holds no writer task: with many open tabs, that is memory).  Frames that carry the text so
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
from typing import Protocol, runtime_checkable

import structlog
import trio

from dshim.channels.base import WebSocket, WebSocketClosed
from dshim.channels.webchat.protocol import Member

log = structlog.get_logger("dshim.webchat")

#: Frames waiting for one tab's writer before the tab counts as stuck.
OUTBOX_MAX = 512
#: Conversations one socket may have joined at once (the oldest is left).
JOINED_MAX = 64
#: Sockets one bot serves at once (an idle one costs the process ~20 KB; the descriptor
#: limit, RLIMIT_NOFILE, must allow as many).
TABS_MAX = 2048
#: Sockets of one client address (a quarter of all: one address cannot take them all).
TABS_PER_ADDRESS = 64
#: Sockets of one client: one user id from one address (a person's tabs).
TABS_PER_CLIENT = 16
TOO_SLOW_CODE = 1013


@runtime_checkable
class SendsMany(Protocol):
    """A websocket that sends several frames in one write (the endpoint's does)."""

    async def send_many(self, texts: list[str]) -> None: ...


class Tab:
    """One connected websocket: its memberships and its outbox.

    Its writer is a task only while frames wait: :meth:`push` starts one in the nursery
    given to :meth:`attach`, and it ends when the outbox is empty (an idle tab holds no
    task for writing)."""

    __slots__ = (
        "ws",
        "client",
        "user",
        "scope",
        "dismissed",
        "outbox_max",
        "joined",
        "overflowed",
        "_queue",
        "_serial",
        "_nursery",
        "_writing",
        "_gone",
        "_tabs",
    )

    def __init__(self, ws: WebSocket, *, client: str = "", outbox_max: int = OUTBOX_MAX) -> None:
        self.ws = ws
        #: The peer's address as the endpoint's limits group it (``WebSocket.client``).
        self.client = client
        #: The user id of its last accepted ``join`` (None: it has not joined).
        self.user: str | None = None
        #: Around the tab's tasks (its nursery's, from :meth:`attach`): :meth:`dismiss`
        #: cancels it from any task.
        self.scope: trio.CancelScope | None = None
        #: The close code and reason it was dismissed with.
        self.dismissed: tuple[int, str] | None = None
        self.outbox_max = outbox_max
        #: Its conversations, the oldest joined first.
        self.joined: dict[str, Member] = {}
        self.overflowed = False
        #: Frames waiting for the writer (made when the first one comes).
        self._queue: OrderedDict[object, str] | None = None
        self._serial = 0
        self._nursery: trio.Nursery | None = None
        self._writing = False
        #: The socket is closed (or the tab ended): frames for it are dropped.
        self._gone = False
        #: The bot's tabs once admitted (they index the tab by conversation).
        self._tabs: Tabs | None = None

    def member(self, conversation: str) -> Member | None:
        return self.joined.get(conversation)

    def join(self, member: Member) -> None:
        conversation = member.conversation
        self.joined.pop(conversation, None)
        self.joined[conversation] = member
        if self._tabs is not None:
            self._tabs._follow(self, conversation)
        while len(self.joined) > JOINED_MAX:
            self.leave(next(iter(self.joined)))

    def leave(self, conversation: str) -> None:
        if self.joined.pop(conversation, None) is not None and self._tabs is not None:
            self._tabs._unfollow(self, conversation)

    def dismiss(self, code: int, reason: str) -> None:
        """Stop serving this tab (from any task): its tasks are cancelled and whoever
        serves it closes the socket with ``code`` and ``reason``."""
        if self.dismissed is None:
            self.dismissed = (code, reason)
        if self.scope is not None:
            self.scope.cancel()

    def push(self, frame: str, *, key: str | None = None) -> None:
        """Queue a frame; one with the ``key`` of a queued frame replaces it in place."""
        if self.overflowed or self._gone:
            return
        queue = self._queue
        if queue is None:
            queue = self._queue = OrderedDict()
        if key is not None and key in queue:
            queue[key] = frame
            return
        if len(queue) >= self.outbox_max:
            self.overflowed = True
        elif key is None:
            self._serial += 1
            queue[self._serial] = frame
        else:
            queue[key] = frame
        self._wake()

    @property
    def queued(self) -> int:
        return len(self._queue) if self._queue is not None else 0

    def attach(self, nursery: trio.Nursery) -> None:
        """Serve the tab in ``nursery`` from now on (until :meth:`detach`): its writer
        runs there, and :meth:`dismiss` cancels it."""
        self._nursery = nursery
        self.scope = nursery.cancel_scope
        if self.dismissed is not None:
            self.scope.cancel()
        self._wake()

    def detach(self) -> None:
        """The tab ended: nothing more is written (queued frames are dropped)."""
        self._nursery = None
        self._gone = True
        self._queue = None

    def _wake(self) -> None:
        if self._writing or self._nursery is None:
            return
        if not self.overflowed and not self._queue:
            return
        self._writing = True
        try:
            self._nursery.start_soon(self._write)
        except RuntimeError:  # the nursery is closing: the tab is ending
            self._writing = False

    async def _write(self) -> None:
        """Send queued frames in order until none is left, the socket closes or the tab
        is too slow (then it is closed with 1013)."""
        try:
            while True:
                if self.overflowed:
                    log.warning("tab_dropped", reason="too_slow", queued=self.queued)
                    self._gone = True
                    self._queue = None
                    await self.ws.close(TOO_SLOW_CODE, "too many frames waiting: reconnect")
                    return
                queue = self._queue
                if not queue:
                    return
                try:
                    if len(queue) > 1 and isinstance(self.ws, SendsMany):
                        # Every frame waiting, in one write (one system call, not one each).
                        frames = list(queue.values())
                        queue.clear()
                        await self.ws.send_many(frames)
                    else:
                        _, frame = queue.popitem(last=False)
                        await self.ws.send(frame)
                except WebSocketClosed:
                    self._gone = True
                    self._queue = None
                    return
        finally:
            self._writing = False


class Tabs:
    """The tabs of one bot, which conversations each follows (indexed both ways) and
    which tabs each client address has."""

    def __init__(
        self,
        *,
        max_tabs: int | None = None,
        per_address: int = TABS_PER_ADDRESS,
        per_client: int = TABS_PER_CLIENT,
    ) -> None:
        self.max_tabs = TABS_MAX if max_tabs is None else max_tabs
        self.per_address = per_address
        self.per_client = per_client
        #: Oldest first (a dict keeps the order they came in).
        self._tabs: dict[Tab, None] = {}
        self._by_address: dict[str, dict[Tab, None]] = {}
        self._by_conversation: dict[str, dict[Tab, None]] = {}

    def admit(self, tab: Tab) -> list[Tab] | None:
        """Take a new tab (see the module docstring).  Returns the tabs that lost their
        slot to it — not joined, oldest first, already removed: dismiss them — or None
        when there is no room (nothing changed)."""
        victims: list[Tab] = []
        mine = self._by_address.get(tab.client, {})
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
            self.remove(victim)
        self._tabs[tab] = None
        self._by_address.setdefault(tab.client, {})[tab] = None
        tab._tabs = self
        for conversation in tab.joined:
            self._follow(tab, conversation)
        return victims

    def joining(self, tab: Tab, user: str) -> bool:
        """``tab`` joins as ``user``: False when its client (``user`` from its address)
        already has :attr:`per_client` other tabs."""
        mine = self._by_address.get(tab.client, {})
        others = sum(1 for t in mine if t is not tab and t.user == user)
        if others >= self.per_client:
            return False
        tab.user = user
        return True

    def remove(self, tab: Tab) -> None:
        if tab not in self._tabs:
            return
        del self._tabs[tab]
        mine = self._by_address.get(tab.client)
        if mine is not None:
            mine.pop(tab, None)
            if not mine:
                del self._by_address[tab.client]
        for conversation in tab.joined:
            self._unfollow(tab, conversation)
        if tab._tabs is self:
            tab._tabs = None

    def _follow(self, tab: Tab, conversation: str) -> None:
        if tab in self._tabs:
            self._by_conversation.setdefault(conversation, {})[tab] = None

    def _unfollow(self, tab: Tab, conversation: str) -> None:
        following = self._by_conversation.get(conversation)
        if following is not None:
            following.pop(tab, None)
            if not following:
                del self._by_conversation[conversation]

    def __len__(self) -> int:
        return len(self._tabs)

    def following(self, conversation: str) -> Iterator[Tab]:
        return iter(list(self._by_conversation.get(conversation, ())))

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
