"""Steps 1-4 of the pipeline: what every platform event goes through before it is work.

:class:`Intake` owns the judgement of an event (decode result, the gates of
:mod:`dshim.pipeline.gates`, substitute triggers, the backlog limit), the persisted dedup
key with its durable inbox entry (one store call per event, or one per batch), the
``closing`` flag (a draining bot refuses new events, so the platform delivers them again
after the restart) and the form in which the inbox keeps an accepted event — and reads
it back after a restart (:meth:`Intake.decode_stored`).  Steps 5 and 6 are not its
business: an accepted message goes on through the ``dispatch`` callback the runtime
hands in.

It is apart from :class:`~dshim.pipeline.runtime.BotRuntime` because it is the hot path —
every event passes here and most end here (redeliveries, unaddressed group chatter,
denied senders) — and because what it needs is small and fixed: it gets exactly that at
construction, bound once, and nothing of the lanes, commands or turns.

The stored form is one tag byte and a body: ``R`` the platform's raw bytes (decoded again
by the channel's ``decode_raw``), ``N`` the normalized event (:mod:`dshim.normalized`),
``S`` a substitute decision, a newline, then one of the other two.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec
import structlog

from dshim import normalized
from dshim.model import DropReason, InboundMessage, Skip, SubstituteTurn, Verdict
from dshim.pipeline import gates

if TYPE_CHECKING:
    from dshim.capture import BotCapture
    from dshim.config import BotConfig
    from dshim.metrics import BotMetrics
    from dshim.pipeline.observer import Observer
    from dshim.pipeline.substitute import SubstituteGate
    from dshim.store.base import Store

__all__ = ["ACCEPTED", "Dispatch", "Intake", "RawDecoder"]

log = structlog.get_logger("dshim.pipeline")

RawDecoder = Callable[[bytes], "InboundMessage | Skip"]
#: Steps 5 and 6 for an accepted message (the runtime's).
Dispatch = Callable[[InboundMessage], Awaitable[None]]

ACCEPTED = Verdict(True)
_SHUTDOWN = Verdict(False, "shutdown")

_substitute_decoder = msgspec.json.Decoder(SubstituteTurn)


class _Judged(NamedTuple):
    """An event steps 1-4 let through: what the store keeps for it, and when."""

    msg: InboundMessage
    stored: bytes | None
    denied: bool
    now: float


class Intake:
    """Steps 1-4 for one bot, then ``dispatch`` for what they let through."""

    def __init__(
        self,
        *,
        bot: BotConfig,
        bot_id: str,
        store: Store,
        clock: Callable[[], float],
        dedup_ttl_s: float,
        backlog_max_age_s: float,
        substitute: SubstituteGate,
        observer: Observer | None,
        metrics: BotMetrics,
        capture: BotCapture | None,
        decode_raw: RawDecoder | None,
        dispatch: Dispatch,
    ) -> None:
        self._bot = bot
        self._bot_name = bot.name
        self._bot_id = bot_id
        self._store = store
        self._clock = clock
        self._ttl_s = dedup_ttl_s
        self._max_age_s = backlog_max_age_s
        self._substitute = substitute
        self._observer = observer
        self._metrics = metrics
        self._capture = capture
        self._decode_raw = decode_raw
        self._dispatch = dispatch
        #: Draining: events are refused (not accepted), the platform redelivers them.
        self.closing = False

    def drop(self, item: InboundMessage | Skip, reason: DropReason, **kw: Any) -> Verdict:
        """Log, observe and count a dropped event; its verdict."""
        level = "warning" if reason == "malformed" else "info"
        getattr(log, level)(
            "event_dropped",
            reason=reason,
            message_id=item.message_id,
            **({"detail": item.detail} if isinstance(item, Skip) and item.detail else {}),
            **kw,
        )
        if self._observer is not None:
            self._observer.on_drop(item, reason)
        self._metrics.event(reason)
        return Verdict(False, reason)

    async def accept(self, item: InboundMessage | Skip, raw: bytes | None = None) -> Verdict:
        """Steps 1-6 for one event (see :meth:`dshim.pipeline.runtime.BotRuntime.accept`)."""
        if self._capture is not None and raw is not None:
            self._capture.event(item, raw)
        judged = await self._judge(item, raw)
        if isinstance(judged, Verdict):
            return judged
        fresh = await self._store.accept(
            self._bot_name,
            judged.msg.conversation_id,
            judged.msg.message_id,
            now=judged.now,
            ttl_s=self._ttl_s,
            raw=judged.stored,
        )
        return await self._accepted(judged, fresh)

    async def accept_many(
        self, events: Sequence[tuple[InboundMessage | Skip, bytes | None]]
    ) -> list[Verdict]:
        """:meth:`accept` for a batch: every key and inbox entry in one store transaction,
        then steps 5-6 in order.  Once one event is refused for shutdown, the rest are too
        (the platform delivers them again)."""
        verdicts: list[Verdict | _Judged] = []
        for item, raw in events:
            if self._capture is not None and raw is not None:
                self._capture.event(item, raw)
            if verdicts and verdicts[-1] is _SHUTDOWN:
                verdicts.append(_SHUTDOWN)
                continue
            judged = await self._judge(item, raw)
            verdicts.append(_SHUTDOWN if judged == _SHUTDOWN else judged)
        pending = [v for v in verdicts if isinstance(v, _Judged)]
        fresh = iter(
            await self._store.accept_many(
                self._bot_name,
                [(p.msg.conversation_id, p.msg.message_id, p.stored) for p in pending],
                now=self._clock(),
                ttl_s=self._ttl_s,
            )
            if pending
            else []
        )
        out: list[Verdict] = []
        for v in verdicts:
            out.append(await self._accepted(v, next(fresh)) if isinstance(v, _Judged) else v)
        return out

    async def _judge(self, item: InboundMessage | Skip, raw: bytes | None) -> _Judged | Verdict:
        """Steps 1-4 and what the store keeps: a verdict when the event is dropped here."""
        if isinstance(item, Skip):
            return self.drop(item, item.reason)
        msg = item
        now = self._clock()
        access = self._bot.access
        reason = gates.judge(
            msg, bot_id=self._bot_id, now=now, max_age_s=self._max_age_s, access=access
        )
        if self._substitute.enabled and reason in ("unaddressed", None):
            # Step 2, substitute triggers: before dedup and before any network call.
            sub = await self._substitute.evaluate(msg)
            if sub is not None:
                msg.substitute = sub
                if reason == "unaddressed":
                    reason = gates.judge(
                        msg,
                        bot_id=self._bot_id,
                        now=now,
                        max_age_s=self._max_age_s,
                        access=access,
                        substitute=True,
                    )
        if reason == "stale":
            if await self._store.seen(self._bot_name, msg.conversation_id, msg.message_id, now=now):
                return self.drop(msg, "duplicate")
            return self.drop(msg, "stale", age_s=round(now - msg.received_at, 1))
        if reason is not None and reason != "denied":
            return self.drop(msg, reason)
        if self.closing:
            # Not accepted: the platform will redeliver after the restart.
            self._metrics.event("shutdown")
            return _SHUTDOWN
        denied = reason == "denied"
        stored: bytes | None
        if denied:
            stored = None  # remember the key (step 3 comes first), keep no inbox entry
        elif raw is not None:
            stored = b"R" + raw
        else:
            stored = b"N" + normalized.encode_event(msg)
        if stored is not None and msg.substitute is not None:
            stored = b"S" + msgspec.json.encode(msg.substitute) + b"\n" + stored
        return _Judged(msg, stored, denied, now)

    async def _accepted(self, judged: _Judged, fresh: bool) -> Verdict:
        """After the store took (or refused, as a duplicate) the key: on to steps 5 and 6."""
        msg = judged.msg
        if not fresh:
            return self.drop(msg, "duplicate")
        if judged.denied:
            self.drop(msg, "denied", sender=msg.sender_id)
            # Durable (its key is kept) but never work: a channel must not act on it.
            return Verdict(True, "denied")
        self._metrics.event("accepted")
        if msg.substitute is not None:
            await self._substitute.remember_anchor(msg, msg.substitute)
            log.info("substitute_triggered", message_id=msg.message_id)
        await self._dispatch(msg)
        return ACCEPTED

    def decode_stored(self, data: bytes) -> InboundMessage | Skip:
        """An inbox (or outbox) entry's stored event, as the channel would hand it.

        Raises what the decoders raise (msgspec errors, ValueError) for a damaged entry."""
        if data[:1] == b"S":  # a substitute turn: its decision, then the message
            decision, _, inner = data[1:].partition(b"\n")
            item = self.decode_stored(inner)
            if isinstance(item, InboundMessage):
                item.substitute = _substitute_decoder.decode(decision)
            return item
        kind, body = data[:1], data[1:]
        if kind == b"R" and self._decode_raw is not None:
            return self._decode_raw(body)
        if kind == b"N":
            return normalized.decode_event(body, channel=self._bot.channel, bot_id=self._bot_id)
        return Skip(reason="malformed", detail="unknown inbox format")
