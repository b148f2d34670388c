"""The latest ``context_token`` per user, durable: iLink accepts a reply only with it.

Every user message carries a ``context_token``; a send must echo the newest one of that
user (newer ``seq``, else newer time, wins — a redelivered old message never replaces
it).  Only a message the pipeline took may move it (:meth:`ContextBook.observe` is
called once the verdict is in): a stale, duplicate, unaddressed, denied or malformed
one can carry a higher ``seq`` and a token iLink refuses, and would silence every later
answer.  Beside the latest, the book keeps the last token a send succeeded with
(:meth:`ContextBook.worked`): a send refused for its token falls back to it once.

The tokens are kept in the bot's cursors (``ctx:<user>``) so they survive a restart,
tagged with a fingerprint of the bot token: a new login (another token) starts with
none.  At most :data:`~dshim.channels.weixin.protocol.CONTEXT_USERS_MAX` users are kept
in memory; the rest are read back from the store on demand.  Tokens are secrets:
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


class _Token(msgspec.Struct, kw_only=True):
    t: str
    seq: int | None = None
    ms: int | None = None


class _Stored(msgspec.Struct, kw_only=True):
    h: str
    t: str
    seq: int | None = None
    ms: int | None = None
    at: float = 0.0
    #: The last token a send succeeded with (absent in records of older versions).
    ok: _Token | None = None


_DECODER = msgspec.json.Decoder(_Stored)


def _token(s: _Token) -> ContextToken:
    return ContextToken(s.t, s.seq, s.ms)


def _stored(t: ContextToken) -> _Token:
    return _Token(t=t.token, seq=t.seq, ms=t.time_ms)


@dataclass(frozen=True, slots=True)
class UserContext:
    """A user's latest token, when their last message arrived (epoch seconds), and the
    last token a send to them succeeded with (None: none yet)."""

    token: ContextToken
    last_seen: float
    worked: ContextToken | None = None


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
                    worked = _token(s.ok) if s.ok is not None else None
                    if worked is not None:
                        self._register(worked.token)
                    found = UserContext(ContextToken(s.t, s.seq, s.ms), s.at, worked)
        self._remember(user, found)
        return found

    async def observe(self, user: str, token: ContextToken, *, at: float | None = None) -> bool:
        """A message of the user's that the pipeline took carried ``token``: keep it when
        it is newer.  True if kept."""
        current = await self.get(user)
        if current is not None and (
            token.token == current.token.token or not token.newer_than(current.token)
        ):
            return False
        self._register(token.token)
        seen = self._clock() if at is None else at
        await self._keep(user, UserContext(token, seen, current.worked if current else None))
        return True

    async def worked(
        self, user: str, token: ContextToken, *, instead_of: ContextToken | None = None
    ) -> None:
        """A send to ``user`` succeeded with ``token``.  ``instead_of``: it stood in for
        that one, refused — if that is still the latest, ``token`` takes its place, so
        the refused token is never tried first again (a later message replaces it)."""
        current = await self.get(user)
        if current is None:
            return
        latest = current.token
        if instead_of is not None and latest.token == instead_of.token:
            latest = token
        if latest is current.token and current.worked == token:
            return  # nothing new: no write per message sent
        await self._keep(user, UserContext(latest, current.last_seen, token))

    async def _keep(self, user: str, ctx: UserContext) -> None:
        self._remember(user, ctx)
        stored = _Stored(
            h=self._credential,
            t=ctx.token.token,
            seq=ctx.token.seq,
            ms=ctx.token.time_ms,
            at=ctx.last_seen,
            ok=_stored(ctx.worked) if ctx.worked is not None else None,
        )
        await self._store.set_cursor(PREFIX + user, msgspec.json.encode(stored).decode())

    def _remember(self, user: str, ctx: UserContext | None) -> None:
        self._mem[user] = ctx
        self._mem.move_to_end(user)
        while len(self._mem) > CONTEXT_USERS_MAX:
            self._mem.popitem(last=False)
