"""The DSH events: the events websocket, its history-polling fallback, interactions.

Theory of operation
-------------------
One websocket per bot to ``{base_url}/api/events.mux`` (``ws:``/``wss:`` after the base
URL's scheme; ``Authorization: Bearer <token>`` when ``[harness] token`` is set), opened by
the first turn that needs it and run in the nursery :func:`dshim.harness.open_harness`
attached; it is reconnected with backoff (0.5 s to 30 s) for as long as the bot runs.  Its
one reader decodes each frame once (:func:`~dshim.harness.dsh.protocol.decode_frame`) and
offers it to the running turn of the frame's session, if any: one bounded channel per turn
(:data:`SUB_BUFFER` frames; a turn that falls that far behind is dropped to polling,
logged ``turn_events_overflowed``).

A turn subscribes to its session (:meth:`DshEvents.subscribe`) before it sends the prompt,
so it sees every event of its turn.  When the mux is not connected within ``mux_wait_s``
(5 s) the turn follows ``session.history`` instead (the latest :data:`POLL_WINDOW` events
every 300 ms, from the ``seq`` before its prompt) and says so in the log
(``turn_events_polled``).  When the mux breaks during a turn, every subscription is lost
and the turn goes on polling from the last ``seq`` it saw (older windows, at most
:data:`POLL_PAGES`, are read when more happened than one holds); once the mux is back it
subscribes again and catches up from history.  The
:class:`~dshim.harness.dsh.protocol.TurnTracker` drops an event at or below the last
``seq`` it saw, so a switch loses and repeats nothing.  The quiet window
(``reply_timeout_s``, 10 minutes) resets on every new event; when it passes, the turn
ends with an error unless ``session.list`` says the session is still running.

Approvals and questions come only over the mux: a turn that polls says so at once (a
:class:`~dshim.model.ToolProgress` notice, :data:`NO_MUX_NOTE`), and a tool call with no news
for :data:`APPROVAL_HINT_S` is named as maybe waiting for an approval to give in the DSH UI.
Over the mux they come for the session of a running turn of this
bot, and only once the turn is identified (earlier ones belong to another turn and are
ignored).  The host replays pending ones on a reconnect, so they are deduplicated by their
envelope ``rpcId``.  They become :class:`~dshim.model.ApprovalRequest` /
:class:`~dshim.model.QuestionRequest` (one per question) answered through ``POST
/api/respond`` (``allowed-once`` / ``rejected``; question answers ``{answers:[{id,
selected:[labels], custom?}]}``; a question left unanswered is answered ``{ok:false,
error:{code:"cancelled"}}``).  A ``*/resolved`` for one we did not answer (another client
answered it, or the host withdrew it) withdraws it from the chat and the answer says so.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

import structlog
import trio
import trio_websocket

from dshim.backoff import Backoff
from dshim.errors import HarnessError
from dshim.harness.dsh import protocol
from dshim.harness.dsh.protocol import APPROVAL_OPTIONS, MuxFrame, TurnTracker
from dshim.harness.dsh.rpc import DshRpc
from dshim.model import (
    ApprovalRequest,
    Option,
    QuestionRequest,
    TextDelta,
    ToolProgress,
    TurnEvent,
)
from dshim.net.ws import WsOptions, open_client_websocket

__all__ = [
    "MUX_WAIT_S",
    "POLL_INTERVAL_S",
    "REPLY_TIMEOUT_S",
    "DshEvents",
    "mux_url",
]

log = structlog.get_logger("dshim.harness.dsh")

POLL_INTERVAL_S = 0.3
POLL_WINDOW = 50
#: While polling (no events websocket): what the chat is told at once, and after how long
#: without news a running tool call is said to be maybe waiting for an approval.
NO_MUX_NOTE = (
    "dshim's events connection to the DSH host is down: approvals and questions cannot "
    "reach this chat — answer them in the DSH UI"
)
WAITING_NOTE = (
    "waiting — if it needs an approval, give it in the DSH UI (it cannot reach this chat "
    "while dshim's events connection is down), or /stop"
)
APPROVAL_HINT_S = 5.0
#: Windows read per poll at most when more happened than one window holds.
POLL_PAGES = 5
MUX_WAIT_S = 5.0
REPLY_TIMEOUT_S = 600.0
SUB_BUFFER = 1024
MUX_OPTIONS = WsOptions(connect_timeout_s=10.0, message_queue_size=256)


def mux_url(base_url: str) -> str:
    """The events websocket's URL for a host's base URL (``http:`` -> ``ws:``)."""
    scheme = "wss" if base_url.startswith("https:") else "ws"
    return scheme + base_url[base_url.index(":") :] + "/api/events.mux"


class _Open:
    """An approval or question of a running turn, waiting for its answer."""

    def __init__(self) -> None:
        self.withdrawn = trio.Event()
        self.answered = False
        #: The outcome another client gave it (from ``*/resolved``).
        self.elsewhere: str | None = None


class _Sub:
    """A running turn's view of the mux: its session's frames, in order."""

    def __init__(self, session_id: str, owner: object, *, after: _Sub | None = None) -> None:
        self.session_id = session_id
        #: The turn following it (a token): one turn per session at a time.
        self.owner = owner
        self.send, self.recv = trio.open_memory_channel[MuxFrame](SUB_BUFFER)
        #: Interactions asked already (the host replays pending ones on a reconnect).
        self.seen: set[str] = after.seen if after is not None else set()
        #: Open interactions by approvalId / question rpcId.
        self.open: dict[str, _Open] = after.open if after is not None else {}
        #: Closed and emptied: the turn polls until the mux is back.
        self.drained = False

    def lose(self) -> None:
        """The mux broke (or this turn fell behind): the turn goes on by polling."""
        self.send.close()

    def offer(self, frame: MuxFrame) -> None:
        kind = frame.kind
        if kind in ("approval/resolved", "question/resolved"):
            key = frame.payload.get(
                "approvalId" if kind == "approval/resolved" else "questionRpcId"
            )
            waiting = self.open.get(key) if isinstance(key, str) else None
            if waiting is not None and not waiting.answered:
                outcome = frame.payload.get("outcome")
                waiting.elsewhere = outcome if isinstance(outcome, str) else "answered"
                waiting.withdrawn.set()
            return
        if kind in ("approval/requested", "question/requested"):
            if frame.rpc_id is None or frame.rpc_id in self.seen:
                return  # replayed after a reconnect: asked already
            self.seen.add(frame.rpc_id)
        try:
            self.send.send_nowait(frame)
        except trio.WouldBlock:
            log.warning("turn_events_overflowed")
            self.lose()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass


class DshEvents:
    """A bot's events from its DSH host: one mux, the running turns' subscriptions, and
    the history polling that stands in for the mux when it is not there."""

    def __init__(
        self,
        rpc: DshRpc,
        *,
        bot: str,
        token: str | None,
        poll_interval_s: float = POLL_INTERVAL_S,
        mux_wait_s: float = MUX_WAIT_S,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
    ) -> None:
        self.bot = bot
        self._rpc = rpc
        self._token = token
        self._mux_url = mux_url(rpc.base_url)
        self.poll_interval_s = poll_interval_s
        self.mux_wait_s = mux_wait_s
        self.reply_timeout_s = reply_timeout_s
        self._subs: dict[str, _Sub] = {}
        self._mux_up = False
        self._mux_changed = trio.Event()
        self._mux_started = False
        #: A first connection attempt has ended (until then a turn waits for the mux).
        self._mux_tried = False
        self._nursery: trio.Nursery | None = None

    def attach(self, nursery: trio.Nursery) -> None:
        """Give the mux the nursery it runs in (the harness's, see open_harness)."""
        self._nursery = nursery

    # -- the events websocket ------------------------------------------------------------

    def _ensure_mux(self) -> None:
        if not self._mux_started and self._nursery is not None:
            self._mux_started = True
            self._nursery.start_soon(self._run_mux, name=f"dsh-events:{self.bot}")

    def _set_mux(self, up: bool) -> None:
        self._mux_up = up
        self._mux_changed.set()
        self._mux_changed = trio.Event()

    async def _run_mux(self) -> None:
        # Started by the first turn that needed it: that turn's log context is not ours.
        structlog.contextvars.unbind_contextvars("turn", "conversation", "message_id")
        backoff = Backoff(0.5, 30.0, 2.0, jitter=0.2)
        headers = [(b"authorization", f"Bearer {self._token}".encode())] if self._token else []
        while True:
            opened_at: float | None = None
            try:
                async with open_client_websocket(
                    self._mux_url, MUX_OPTIONS, extra_headers=headers
                ) as (ws, _stream):
                    opened_at = trio.current_time()
                    backoff.reset()
                    log.info("events_connected")
                    self._set_mux(True)
                    while True:
                        message = await ws.get_message()
                        self._dispatch(message)
            except (
                OSError,
                trio.TooSlowError,
                trio_websocket.HandshakeError,
                trio_websocket.ConnectionClosed,
                trio.BrokenResourceError,
            ) as exc:
                reason = type(exc).__name__
                if isinstance(exc, trio_websocket.ConnectionRejected):
                    reason = f"HTTP {exc.status_code}"
                if opened_at is None:
                    log.info("events_connect_failed", reason=reason)
                else:
                    log.warning("events_disconnected", reason=reason)
            finally:
                self._mux_tried = True
                if self._mux_up or opened_at is None:
                    self._set_mux(False)
                    for sub in list(self._subs.values()):
                        sub.lose()
            await trio.sleep(backoff.next_delay())

    def _dispatch(self, message: str | bytes) -> None:
        frame = protocol.decode_frame(message)
        if frame is None:
            log.warning("event_dropped", reason="malformed")
            return
        sub = self._subs.get(frame.session_id)
        if sub is not None:
            sub.offer(frame)

    async def subscribe(self, session_id: str, owner: object) -> bool:
        """Follow a session over the mux for the turn ``owner`` (a token); False when the
        mux is not up within ``mux_wait_s`` (the turn then polls from the start)."""
        self._ensure_mux()
        if not self._mux_up and self._nursery is not None:
            with trio.move_on_after(self.mux_wait_s):
                while not self._mux_up and not self._mux_tried:
                    await self._mux_changed.wait()
        if not self._mux_up:
            return False
        self._subs[session_id] = _Sub(session_id, owner)
        return True

    def _sub_of(self, session_id: str, owner: object) -> _Sub | None:
        sub = self._subs.get(session_id)
        return sub if sub is not None and sub.owner is owner else None

    def withdraw_open(self, session_id: str, owner: object) -> None:
        """The turn is ending: its open approvals and questions leave the chat."""
        current = self._sub_of(session_id, owner)
        if current is not None:
            for waiting in current.open.values():
                waiting.withdrawn.set()

    def unsubscribe(self, session_id: str, owner: object) -> None:
        """The turn ended: the mux stops feeding it."""
        if self._sub_of(session_id, owner) is not None:
            del self._subs[session_id]

    async def follow(
        self, session_id: str, tracker: TurnTracker, owner: object
    ) -> AsyncGenerator[TurnEvent, None]:
        """The turn's events until its ``turn/end``: from the mux while it is up, else
        from ``session.history`` (and back to the mux when it returns); approvals and
        questions become interactions answered through ``/api/respond``."""
        quiet_until = trio.current_time() + self.reply_timeout_s
        warned = False
        #: While polling: the tool call the host may be holding for an approval, since when.
        waiting: tuple[str, float] | None = None
        hinted: set[str] = set()
        while not tracker.done:
            before = tracker.last_seq
            sub = self._sub_of(session_id, owner)
            if sub is not None and not sub.drained:
                with trio.move_on_at(quiet_until):
                    try:
                        frame = await sub.recv.receive()
                    except (trio.EndOfChannel, trio.ClosedResourceError):
                        log.info("turn_events_polled", reason="events mux lost")
                        sub.drained = True
                        continue
                    if frame.kind == "session/event":
                        for event in tracker.feed([frame.payload.get("event")]):
                            yield event
                    elif not tracker.matched:
                        log.info("interaction_ignored", kind=frame.kind, reason="before this turn")
                    elif frame.kind == "approval/requested":
                        async for event in self._approval(sub, frame, tracker):
                            yield event
                    elif frame.kind == "question/requested":
                        async for event in self._questions(sub, frame):
                            yield event
                    quiet_until = trio.current_time() + self.reply_timeout_s
            elif self._mux_up:
                # The mux is back: subscribe again (it buffers from now on), then catch up
                # on what happened meanwhile; events seen twice are dropped by their seq.
                self._subs[session_id] = _Sub(session_id, owner, after=sub)
                log.info("turn_events_streamed", reason="events mux back")
                for event in tracker.feed(await self._recent_events(session_id, tracker.last_seq)):
                    yield event
            else:
                if not warned:
                    # Approvals and questions come only over the mux: say so at once,
                    # not after the host gave up waiting for an answer that cannot come.
                    warned = True
                    log.warning("turn_interactions_unavailable", reason="events mux down")
                    yield ToolProgress(title=NO_MUX_NOTE, status="notice")
                await trio.sleep(self.poll_interval_s)
                events = await self._recent_events(session_id, tracker.last_seq)
                for event in tracker.feed(events):
                    if isinstance(event, ToolProgress):
                        running = event.status == "running"
                        waiting = (event.title, trio.current_time()) if running else None
                    yield event
                if tracker.last_seq > before:
                    quiet_until = trio.current_time() + self.reply_timeout_s
                elif (
                    waiting is not None
                    and waiting[0] not in hinted
                    and trio.current_time() - waiting[1] >= APPROVAL_HINT_S
                ):
                    hinted.add(waiting[0])
                    log.warning("turn_waits_for_tool", tool=waiting[0], reason="events mux down")
                    yield ToolProgress(title=f"{waiting[0]}: {WAITING_NOTE}", status="waiting")
            if not tracker.done and trio.current_time() >= quiet_until:
                if await self._running(session_id):
                    quiet_until = trio.current_time() + self.reply_timeout_s
                    continue
                raise HarnessError(
                    f"the DSH host sent nothing for {self.reply_timeout_s:g} s and the "
                    "session is not running",
                    code="harness-reply-timeout",
                )

    async def _approval(
        self, sub: _Sub, frame: MuxFrame, tracker: TurnTracker
    ) -> AsyncGenerator[TurnEvent, None]:
        p = frame.payload
        rpc = frame.rpc_id
        approval_id = p.get("approvalId")
        if rpc is None or not isinstance(approval_id, str):
            log.warning("event_dropped", reason="malformed", detail="approval without ids")
            return
        waiting = _Open()
        sub.open[approval_id] = waiting
        tool = p.get("toolName") if isinstance(p.get("toolName"), str) else "a tool"
        reason = p.get("reason") if isinstance(p.get("reason"), str) else None
        call_id = p.get("callId")
        args = tracker.tool_args.get(call_id) if isinstance(call_id, str) else None
        if args and args not in ("{}", "null"):
            reason = f"{reason}\narguments: {args}" if reason else f"arguments: {args}"

        async def reply(option_id: str | None) -> None:
            if waiting.answered or waiting.elsewhere is not None:
                return
            waiting.answered = True
            outcome = option_id if option_id in ("allowed-once", "rejected") else "rejected"
            await self._rpc.respond(
                rpc,
                {"sessionId": sub.session_id, "approvalId": approval_id, "outcome": outcome},
            )

        yield ApprovalRequest(
            title=str(tool),
            detail=reason,
            options=list(APPROVAL_OPTIONS),
            reply=reply,
            withdrawn=waiting.withdrawn.wait,
        )
        sub.open.pop(approval_id, None)
        if waiting.elsewhere is not None and not waiting.answered:
            log.info("interaction_resolved_elsewhere", outcome=waiting.elsewhere)
            if waiting.elsewhere in ("allowed-once", "rejected"):
                note = (
                    f"(The request “{tool}” was answered in another client: {waiting.elsewhere}.)"
                )
            else:
                note = f"(The request “{tool}” was withdrawn by the DSH host: {waiting.elsewhere}.)"
            yield TextDelta(note + "\n\n")

    async def _questions(self, sub: _Sub, frame: MuxFrame) -> AsyncGenerator[TurnEvent, None]:
        rpc = frame.rpc_id
        items = frame.payload.get("questions")
        questions = [q for q in items if isinstance(q, dict)] if isinstance(items, list) else []
        if rpc is None or not questions:
            log.warning("event_dropped", reason="malformed", detail="question without items")
            return
        waiting = _Open()
        sub.open[rpc] = waiting
        answers: list[dict[str, Any]] = []
        cancelled = False
        for q in questions:
            got: dict[str, Any] = {}
            options = [
                Option(id=o["label"], label=o["label"], description=o.get("description"))
                for o in q.get("options") or []
                if isinstance(o, dict) and isinstance(o.get("label"), str)
            ]

            async def reply(
                selected: list[str], custom: str | None, got: dict[str, Any] = got
            ) -> None:
                got["selected"] = list(selected)
                got["custom"] = custom

            text = q.get("question") if isinstance(q.get("question"), str) else "The agent asks:"
            header = q.get("header")
            yield QuestionRequest(
                question=f"{header}: {text}" if isinstance(header, str) and header else str(text),
                options=options,
                multi_select=q.get("multiSelect") is True,
                allow_free_text=True,
                reply=reply,
                withdrawn=waiting.withdrawn.wait,
            )
            if waiting.elsewhere is not None:
                break
            if not got or (not got["selected"] and not got["custom"]):
                cancelled = True
                break
            answer: dict[str, Any] = {"id": q.get("id"), "selected": got["selected"]}
            if got["custom"]:
                answer["custom"] = got["custom"]
            answers.append(answer)
        sub.open.pop(rpc, None)
        if waiting.elsewhere is not None:
            log.info("interaction_resolved_elsewhere", outcome=waiting.elsewhere)
            if waiting.elsewhere == "answered":
                yield TextDelta("(The question was answered in another client.)\n\n")
            else:
                yield TextDelta("(The question was withdrawn by the DSH host.)\n\n")
            return
        waiting.answered = True
        if cancelled:
            await self._rpc.respond(rpc, None, cancelled=True)
        else:
            await self._rpc.respond(
                rpc, {"sessionId": sub.session_id, "answer": {"answers": answers}}
            )

    async def _recent_events(self, session_id: str, after: float) -> list[dict[str, Any]]:
        """The session's events after ``after``: the newest window, and older windows (at
        most :data:`POLL_PAGES` in all) while a gap to ``after`` remains."""
        events: list[dict[str, Any]] = []
        payload: dict[str, Any] = {"sessionId": session_id, "maxMessages": POLL_WINDOW}
        for _ in range(POLL_PAGES):
            value = await self._rpc.call("session.history", payload)
            page, more = protocol.page_events(value)
            events.extend(page)
            oldest = min((e["seq"] for e in page), default=None)
            if not more or oldest is None or oldest <= after + 1:
                break
            if "beforeSeq" in payload and oldest >= payload["beforeSeq"]:
                break  # the cursor did not advance: refuse to loop
            payload = {**payload, "beforeSeq": oldest}
        return events

    async def latest_seq(self, session_id: str) -> float:
        """The session's last ``seq``: a polled turn reads only what comes after it."""
        value = await self._rpc.call("session.history", {"sessionId": session_id, "maxMessages": 1})
        events, _ = protocol.page_events(value)
        return protocol.max_seq(events)

    async def _running(self, session_id: str) -> bool:
        value = await self._rpc.call("session.list", {})
        items = value.get("items") if isinstance(value, dict) else None
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and item.get("sessionId") == session_id:
                return item.get("running") is True
        return False
