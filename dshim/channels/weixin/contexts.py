"""The latest ``context_token`` per user, durable: iLink accepts a reply only with it.

Every user message carries a ``context_token``; a send must echo the newest one of that
user (newer ``seq``, else newer time, wins — a redelivered old message never replaces
it).  The tokens are kept in the bot's cursors (``ctx:<user>``) so they survive a
restart, tagged with a fingerprint of the bot token: a new login (another token) starts
with none.  At most :data:`~dshim.channels.weixin.protocol.CONTEXT_USERS_MAX` users are
kept in memory; the rest are read back from the store on demand.  Tokens are secrets:
registered with the log redactor, never logged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import structlog

from dshim.channels.base import ChannelStore
from dshim.channels.weixin.protocol import CONTEXT_USERS_MAX, ContextToken

log = structlog.get_logger("dshim.weixin")

PREFIX = "ctx:"


class _Stored(msgspec.Struct, kw_only=True):
    h: str
    t: str
    seq: int | None = None
    ms: int | None = None
    at: float = 0.0


_DECODER = msgspec.json.Decoder(_Stored)


@dataclass(frozen=True, slots=True)
class UserContext:
    """A user's latest token and when their last message arrived (epoch seconds)."""

    token: ContextToken
    last_seen: float


class ContextBook:
    """Latest context token per user, backed by the bot's cursors."""

    def __init__(
        self,
        store: ChannelStore,
        *,
        credential: str,
        clock: Callable[[], float],
        register_secret: Callable[[str], None],
    ) -> None:
        self._store = store
        self._credential = credential
        self._clock = clock
        self._register = register_secret
        self._mem: OrderedDict[str, UserContext | None] = OrderedDict()

    async def get(self, user: str) -> UserContext | None:
        """The user's context (None: they never wrote to this login)."""
        if user in self._mem:
            self._mem.move_to_end(user)
            return self._mem[user]
        found: UserContext | None = None
        raw = await self._store.get_cursor(PREFIX + user)
        if raw:
            try:
                s = _DECODER.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.warning("context_token_unreadable")
            else:
                if s.h == self._credential:  # a token of another login is worthless
                    self._register(s.t)
                    found = UserContext(ContextToken(s.t, s.seq, s.ms), s.at)
        self._remember(user, found)
        return found

    async def observe(self, user: str, token: ContextToken, *, at: float | None = None) -> bool:
        """A user's message carried ``token``: keep it when it is newer.  True if kept."""
        current = await self.get(user)
        if current is not None and not token.newer_than(current.token):
            return False
        self._register(token.token)
        seen = self._clock() if at is None else at
        ctx = UserContext(token, seen)
        self._remember(user, ctx)
        stored = _Stored(
            h=self._credential, t=token.token, seq=token.seq, ms=token.time_ms, at=seen
        )
        await self._store.set_cursor(PREFIX + user, msgspec.json.encode(stored).decode())
        return True

    def _remember(self, user: str, ctx: UserContext | None) -> None:
        self._mem[user] = ctx
        self._mem.move_to_end(user)
        while len(self._mem) > CONTEXT_USERS_MAX:
            self._mem.popitem(last=False)
