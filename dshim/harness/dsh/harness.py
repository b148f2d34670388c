"""The DSH adapter: dshim in front of a DSH agent host over its HTTP RPC.

Theory of operation
-------------------
Calls go through :class:`~dshim.harness.dsh.rpc.DshRpc` (``POST {base_url}/api/<method>``,
the envelope and the error mapping of :mod:`dshim.harness.dsh.protocol`, every httpx
exception mapped there, once): what leaves the adapter is a
:class:`~dshim.errors.HarnessError` or a turn event.

Sessions: ``create_session`` finds the workspace (``workspace.list``; ``workspace.create``
when the path is not registered yet; the bot's ``workspace`` wins over ``[harness]
workspace``), then ``session.create`` (with ``agentPreset`` when configured) and names it
with ``session.rename`` (best effort).  A turn is one ``session.prompt`` with ``mode:
"queue"``, the prompt text and images, and ``clientTimeZone``; its ``rpcId`` identifies
the turn among the session's events (:class:`~dshim.harness.dsh.protocol.TurnTracker`).
A prompt is sent again only when the host refused it: with its images left out (and a
note) after ``attachment-error``, or to a new session after ``session-not-found`` (the
binding then maps to the new session); after a timeout it is never sent again.  Answers
are read up to 32 MiB.

Events: one websocket per bot to ``/api/events.mux`` (reconnected with backoff, 0.5 s to
30 s) feeds the running turns: a turn subscribes to its session before it sends the
prompt, so it sees every event of its turn.  When the mux is not connected within
``mux_wait_s`` the turn follows ``session.history`` instead (the latest 50 events every
300 ms, bounded by the turn's quiet window) and says so in the log
(``turn_events_polled``); when the mux breaks during a turn the turn goes on polling from
the last ``seq`` it saw (older windows are read when more happened than one holds), so
nothing is lost or shown twice, and returns to the mux once it is back.  The quiet window
(``reply_timeout_s``, 10 minutes) resets on every new event; when it passes, the turn
ends with an error unless ``session.list`` says the session is still running.

Approvals and questions come only over the mux, for the session of a running turn of this
bot: they become :class:`~dshim.model.ApprovalRequest` / :class:`~dshim.model.QuestionRequest`
answered through ``POST /api/respond`` (``allowed-once`` / ``rejected``; question answers
``{answers:[{id, selected:[labels], custom?}]}``; a cancelled question is answered
``{ok:false, error:{code:"cancelled"}}``).  A ``*/resolved`` for one we did not answer
(another client answered it) withdraws it from the chat and the answer says so.

``/stop`` cancels the turn's generator: in a shielded scope it sends ``session.cancel
{keepInbox: true}`` and waits up to ``stop_timeout_s`` (10 s) for the ``turn/end``; a turn
that does not end in time is abandoned (logged ``turn_abandoned``).  ``/steer`` is
``session.prompt`` with ``mode: "steer"``.  ``/models`` is ``session.models`` (or
``llm.models`` without a session), ``/model`` ``session.selectModel``.  ``history`` reads
``session.history`` pages for the core's quote recovery.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

import structlog
import trio
import trio_websocket

from dshim.backoff import Backoff
from dshim.channels.kit.ws import WsOptions, open_client_websocket
from dshim.errors import HarnessError
from dshim.harness.base import HistoryPage, ModelInfo, ProbeItem, TurnContext
from dshim.harness.dsh import protocol
from dshim.harness.dsh.protocol import (
    APPROVAL_OPTIONS,
    DshRpcError,
    HistoryAnswer,
    MuxFrame,
    TurnTracker,
)
from dshim.harness.dsh.rpc import DEFAULT_BASE_URL, RPC_TIMEOUT_S, DshRpc, new_rpc_id
from dshim.model import (
    ApprovalRequest,
    ImagePart,
    Option,
    PromptPart,
    QuestionRequest,
    TextDelta,
    TurnEvent,
)
from dshim.prompt import prompt_text

if TYPE_CHECKING:
    import httpx

    from dshim.config import HarnessConfig

__all__ = ["DEFAULT_BASE_URL", "DshHarness"]

log = structlog.get_logger("dshim.harness.dsh")

DESCRIBE_TIMEOUT_S = 5.0
POLL_INTERVAL_S = 0.3
POLL_WINDOW = 50
#: Windows read per poll at most when more happened than one window holds.
POLL_PAGES = 5
MUX_WAIT_S = 5.0
STOP_TIMEOUT_S = 10.0
ABANDONED_NOTE = (
    "The DSH host did not stop this answer within {s} s; dshim stopped waiting for it"
    " (the host may still finish it there)."
)
REPLY_TIMEOUT_S = 600.0
SUB_BUFFER = 1024
MUX_OPTIONS = WsOptions(connect_timeout_s=10.0, message_queue_size=256)


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


class DshHarness:
    """A bot's DSH host: HTTP RPC calls, one events websocket, sessions bound per chat."""

    kind = "dsh"

    def __init__(
        self,
        cfg: HarnessConfig,
        *,
        bot: str,
        workspace: str | None = None,
        client: httpx.AsyncClient | None = None,
        poll_interval_s: float = POLL_INTERVAL_S,
        mux_wait_s: float = MUX_WAIT_S,
        stop_timeout_s: float = STOP_TIMEOUT_S,
        reply_timeout_s: float = REPLY_TIMEOUT_S,
    ) -> None:
        self.bot = bot
        self.base_url = (cfg.base_url or DEFAULT_BASE_URL).rstrip("/")
        self._token = cfg.token.get() if cfg.token is not None else None
        base = workspace or cfg.workspace or cfg.cwd or os.getcwd()
        self.workspace = os.path.abspath(os.path.expanduser(base))
        self.agent_preset = cfg.agent_preset
        self.poll_interval_s = poll_interval_s
        self.mux_wait_s = mux_wait_s
        self.stop_timeout_s = stop_timeout_s
        self.reply_timeout_s = reply_timeout_s
        self._rpc = DshRpc(self.base_url, self._token, client=client)
        scheme = "wss" if self.base_url.startswith("https:") else "ws"
        self._mux_url = scheme + self.base_url[self.base_url.index(":") :] + "/api/events.mux"
        self._workspace_id: str | None = None
        self._workspace_lock = trio.Lock()
        self._subs: dict[str, _Sub] = {}
        self._mux_up = False
        self._mux_changed = trio.Event()
        self._mux_started = False
        #: A first connection attempt has ended (until then a turn waits for the mux).
        self._mux_tried = False
        self._nursery: trio.Nursery | None = None
        self.host_version: str | None = None
        #: Bound session ids the host lost -> the sessions that replaced them.
        self._aliases: dict[str, str] = {}

    def attach(self, nursery: trio.Nursery) -> None:
        """Give the harness the nursery its events websocket runs in (see open_harness)."""
        self._nursery = nursery

    # -- calls -------------------------------------------------------------------------

    async def call(
        self,
        method: str,
        payload: dict[str, Any],
        *,
        rpc_id: str | None = None,
        timeout_s: float = RPC_TIMEOUT_S,
    ) -> Any:
        """One RPC: its ``value``, or a HarnessError (see :class:`~.rpc.DshRpc`)."""
        return await self._rpc.call(method, payload, rpc_id=rpc_id, timeout_s=timeout_s)

    async def _respond(self, rpc_id: str, value: Any | None, *, cancelled: bool = False) -> None:
        """Answer an interaction (never raises: the turn goes on and reports what happens)."""
        await self._rpc.respond(rpc_id, value, cancelled=cancelled)

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

    async def _subscribe(self, session_id: str, owner: object) -> _Sub | None:
        """Follow a session over the mux; None when the mux is not up within mux_wait_s."""
        self._ensure_mux()
        if not self._mux_up and self._nursery is not None:
            with trio.move_on_after(self.mux_wait_s):
                while not self._mux_up and not self._mux_tried:
                    await self._mux_changed.wait()
        if not self._mux_up:
            return None
        sub = _Sub(session_id, owner)
        self._subs[session_id] = sub
        return sub

    def _sub_of(self, session_id: str, owner: object) -> _Sub | None:
        sub = self._subs.get(session_id)
        return sub if sub is not None and sub.owner is owner else None

    # -- sessions ------------------------------------------------------------------------

    async def _workspace(self) -> str:
        async with self._workspace_lock:
            if self._workspace_id is None:
                self._workspace_id = await self._find_workspace() or await self._create_workspace()
            return self._workspace_id

    async def _find_workspace(self) -> str | None:
        """The id ``workspace.list`` gives our path (compared normalized), if any."""
        return protocol.workspace_id(await self.call("workspace.list", {}), self.workspace)

    async def _create_workspace(self) -> str:
        try:
            created = await self.call("workspace.create", {"path": self.workspace})
        except DshRpcError:
            # Registered meanwhile (another client), under a spelling we did not match:
            # look once more before giving up.
            found = await self._find_workspace()
            if found is None:
                raise
            return found
        ws = created.get("workspace") if isinstance(created, dict) else None
        wid = ws.get("workspaceId") if isinstance(ws, dict) else None
        if not isinstance(wid, str):
            raise HarnessError(
                "workspace.create: the DSH host sent no workspaceId",
                code="harness-response-invalid",
            )
        log.info("workspace_created", path=self.workspace)
        return wid

    async def create_session(self, *, title: str | None) -> str:
        payload: dict[str, Any] = {"workspaceId": await self._workspace()}
        if self.agent_preset:
            payload["agentPreset"] = self.agent_preset
        value = await self.call("session.create", payload)
        sid = value.get("sessionId") if isinstance(value, dict) else None
        if not isinstance(sid, str) or not sid:
            raise HarnessError(
                "session.create: the DSH host sent no sessionId", code="harness-response-invalid"
            )
        if title:
            try:
                await self.call("session.rename", {"sessionId": sid, "title": title})
            except HarnessError as exc:
                log.info("session_rename_failed", error=str(exc))
        return sid

    # -- turns ---------------------------------------------------------------------------

    async def prompt(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        try:
            async with aclosing(self._turn(self._sid(session_id), parts, ctx)) as events:
                async for event in events:
                    yield event
            return
        except _SessionGone:
            pass
        # The host lost the session (deleted in its UI, a new host): the conversation goes
        # on in a new one.  The prompt was refused, so sending it again cannot duplicate it.
        new = await self.create_session(title=None)
        self._aliases[session_id] = new
        log.warning("session_replaced", reason="the DSH host no longer knows the session")
        async with aclosing(self._turn(new, parts, ctx)) as events:
            async for event in events:
                yield event

    def _sid(self, session_id: str) -> str:
        return self._aliases.get(session_id, session_id)

    async def _turn(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        text = prompt_text(parts)
        images = [p for p in parts if isinstance(p, ImagePart)]
        rpc_id = new_rpc_id()
        owner = object()
        sub = await self._subscribe(session_id, owner)
        tracker: TurnTracker | None = None
        accepted = False
        try:
            if sub is None:
                log.info("turn_events_polled", reason="events mux unavailable")
                try:
                    after = await self._latest_seq(session_id)
                except DshRpcError as exc:
                    if exc.rpc_code == "session-not-found":
                        raise _SessionGone from exc
                    raise
            else:
                log.info("turn_events_streamed")
                after = -1.0
            tracker = TurnTracker(rpc_id, after_seq=after)
            await self._send_prompt(session_id, rpc_id, text, images)
            accepted = True
            async for event in self._follow(session_id, tracker, owner):
                yield event
            assert tracker.end is not None
            yield tracker.end
        finally:
            current = self._sub_of(session_id, owner)
            if current is not None:
                for waiting in current.open.values():
                    waiting.withdrawn.set()
            if accepted and tracker is not None and not tracker.done:
                with trio.CancelScope(shield=True):
                    if not await self._stop(session_id, tracker, owner):
                        ctx.notes.append(ABANDONED_NOTE.format(s=round(self.stop_timeout_s)))
            if self._sub_of(session_id, owner) is not None:
                del self._subs[session_id]

    async def _send_prompt(
        self, session_id: str, rpc_id: str, text: str, images: list[ImagePart]
    ) -> None:
        """``session.prompt`` (mode queue).  A refusal of the images (the model cannot read
        them) sends it once more without them, with a note, under the same ``rpcId``
        (refused: nothing ran).  A timeout is never followed by a second send."""
        try:
            try:
                await self._prompt_call(session_id, rpc_id, text, images)
            except DshRpcError as exc:
                if not images or exc.rpc_code != "attachment-error":
                    raise
                log.info("prompt_images_refused", images=len(images))
                note = (
                    f"[{len(images)} image(s) attached by the user were left out: the "
                    "selected model cannot read images]"
                )
                await self._prompt_call(session_id, rpc_id, f"{text}\n\n{note}", [])
        except HarnessError as exc:
            if isinstance(exc, DshRpcError) and exc.rpc_code == "session-not-found":
                raise _SessionGone from exc
            if exc.code != "harness-timeout":
                raise
            # Sent, outcome unknown: never sent again (it would run twice).
            raise HarnessError(
                "the DSH host did not confirm the message in time; it may still be "
                "answered there (check the DSH UI, or /stop) before you send it again",
                code="harness-result-uncertain",
            ) from exc

    async def _prompt_call(
        self, session_id: str, rpc_id: str, text: str, images: list[ImagePart]
    ) -> None:
        await self.call(
            "session.prompt",
            {
                "sessionId": session_id,
                "mode": "queue",
                "content": protocol.content_blocks(text, images),
                "clientTimeZone": _time_zone(),
            },
            rpc_id=rpc_id,
        )

    async def _follow(
        self, session_id: str, tracker: TurnTracker, owner: object
    ) -> AsyncGenerator[TurnEvent, None]:
        """The turn's events until its ``turn/end``: from the mux while it is up, else
        from ``session.history`` (and back to the mux when it returns)."""
        quiet_until = trio.current_time() + self.reply_timeout_s
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
                await trio.sleep(self.poll_interval_s)
                events = await self._recent_events(session_id, tracker.last_seq)
                for event in tracker.feed(events):
                    yield event
                if tracker.last_seq > before:
                    quiet_until = trio.current_time() + self.reply_timeout_s
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
            await self._respond(
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
            await self._respond(rpc, None, cancelled=True)
        else:
            await self._respond(rpc, {"sessionId": sub.session_id, "answer": {"answers": answers}})

    async def _stop(self, session_id: str, tracker: TurnTracker, owner: object) -> bool:
        """/stop or shutdown: ``session.cancel``, then wait (bounded) for the turn's end.
        False when the host did not end the turn in time (it is abandoned)."""
        started = trio.current_time()
        with trio.move_on_after(self.stop_timeout_s):
            try:
                await self.call("session.cancel", {"sessionId": session_id, "keepInbox": True})
                async for _ in self._follow(session_id, tracker, owner):
                    pass
            except HarnessError as exc:
                log.warning("turn_cancel_failed", error=str(exc))
                return False
        if tracker.done:
            log.info("turn_cancelled", ms=round((trio.current_time() - started) * 1000))
            return True
        log.warning("turn_abandoned", seconds=self.stop_timeout_s)
        return False

    async def _recent_events(self, session_id: str, after: float) -> list[dict[str, Any]]:
        """The session's events after ``after``: the newest window, and older windows (at
        most :data:`POLL_PAGES` in all) while a gap to ``after`` remains."""
        events: list[dict[str, Any]] = []
        payload: dict[str, Any] = {"sessionId": session_id, "maxMessages": POLL_WINDOW}
        for _ in range(POLL_PAGES):
            value = await self.call("session.history", payload)
            page, more = protocol.page_events(value)
            events.extend(page)
            oldest = min((e["seq"] for e in page), default=None)
            if not more or oldest is None or oldest <= after + 1:
                break
            if "beforeSeq" in payload and oldest >= payload["beforeSeq"]:
                break  # the cursor did not advance: refuse to loop
            payload = {**payload, "beforeSeq": oldest}
        return events

    async def _latest_seq(self, session_id: str) -> float:
        value = await self.call("session.history", {"sessionId": session_id, "maxMessages": 1})
        events, _ = protocol.page_events(value)
        return protocol.max_seq(events)

    async def _running(self, session_id: str) -> bool:
        value = await self.call("session.list", {})
        items = value.get("items") if isinstance(value, dict) else None
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict) and item.get("sessionId") == session_id:
                return item.get("running") is True
        return False

    async def cancel(self, session_id: str) -> None:
        try:
            await self.call(
                "session.cancel", {"sessionId": self._sid(session_id), "keepInbox": True}
            )
        except HarnessError as exc:
            log.info("turn_cancel_failed", error=str(exc))

    async def steer(self, session_id: str, text: str) -> bool:
        try:
            await self.call(
                "session.prompt",
                {
                    "sessionId": self._sid(session_id),
                    "mode": "steer",
                    "content": [{"type": "text", "text": text}],
                    "clientTimeZone": _time_zone(),
                },
            )
        except DshRpcError as exc:
            if exc.rpc_code in ("no-active-turn", "not-running", "session-idle"):
                raise HarnessError(
                    "nothing is running in the DSH session to steer", code=exc.rpc_code
                ) from exc
            raise
        return True

    # -- models --------------------------------------------------------------------------

    async def list_models(self, session_id: str | None) -> list[ModelInfo] | None:
        if session_id is not None:
            value = await self.call("session.models", {"sessionId": self._sid(session_id)})
        else:
            value = await self.call("llm.models", {})
        current = value.get("current") if isinstance(value, dict) else None
        cur = (current.get("provider"), current.get("model")) if isinstance(current, dict) else None
        out = []
        groups = value.get("groups") if isinstance(value, dict) else None
        for group in groups if isinstance(groups, list) else []:
            if not isinstance(group, dict):
                continue
            provider = group.get("id")
            for m in group.get("models") or []:
                if isinstance(m, dict) and isinstance(m.get("id"), str):
                    out.append(
                        ModelInfo(
                            id=f"{provider}/{m['id']}",
                            name=m.get("name") if isinstance(m.get("name"), str) else None,
                            current=cur == (provider, m["id"]),
                        )
                    )
        return out

    async def select_model(self, session_id: str, model: str) -> str:
        models = await self.list_models(session_id) or []
        wanted = model.strip()
        chosen = next((m for m in models if m.id == wanted), None) or next(
            (m for m in models if m.id.split("/", 1)[-1].casefold() == wanted.casefold()), None
        )
        if chosen is None:
            raise HarnessError(
                f"unknown model {wanted!r}; /models lists the choices", code="model-unknown"
            )
        provider, _, name = chosen.id.partition("/")
        await self.call(
            "session.selectModel",
            {"sessionId": self._sid(session_id), "provider": provider, "model": name},
        )
        return chosen.id

    # -- history -------------------------------------------------------------------------

    async def history(self, session_id: str, *, before: str | None, limit: int) -> HistoryPage:
        """One ``session.history`` page (newest first): the completed turns' answers."""
        payload: dict[str, Any] = {"sessionId": self._sid(session_id), "maxMessages": limit}
        if before is not None:
            payload["beforeSeq"] = float(before) if "." in before else int(before)
        value = await self.call("session.history", payload, timeout_s=5.0)
        events, more = protocol.page_events(value)
        if not events:
            return HistoryPage(items=[], before=None)
        oldest = min(e["seq"] for e in events)
        if before is not None and oldest >= float(before):
            raise HarnessError(
                "session.history: the page cursor did not advance", code="harness-response-invalid"
            )
        answers: list[HistoryAnswer] = protocol.completed_answers(events)
        times = [t for e in events if (t := protocol.event_time(e)) is not None]
        return HistoryPage(
            items=[(a.text, a.at) for a in answers],
            before=str(oldest) if more else None,
            oldest_at=min(times) if times else None,
        )

    # -- health --------------------------------------------------------------------------

    async def check(self) -> str:
        value = await self.call("host.describe", {}, timeout_s=DESCRIBE_TIMEOUT_S)
        version = value.get("version") if isinstance(value, dict) else None
        self.host_version = version if isinstance(version, str) else None
        return f"DSH host {self.host_version or '(version unknown)'} at {self.base_url}"

    async def probe_details(self) -> list[ProbeItem]:
        """Rows for ``dshim probe`` after :meth:`check` (host and version): workspace, models."""
        items = []
        exists = _is_dir(self.workspace)
        try:
            value = await self.call("workspace.list", {})
        except HarnessError as exc:
            items.append(ProbeItem(name="workspace", result="fail", detail=str(exc)))
        else:
            listed = protocol.workspace_id(value, self.workspace) is not None
            where = "registered on the host" if listed else "created on first use"
            items.append(
                ProbeItem(
                    name="workspace",
                    result="ok" if exists else "warn",
                    detail=f"{self.workspace} ({where})"
                    + ("" if exists else "; the directory does not exist here"),
                )
            )
        try:
            models = await self.list_models(None) or []
        except HarnessError as exc:
            items.append(ProbeItem(name="models", result="fail", detail=str(exc)))
        else:
            shown = ", ".join(m.id for m in models[:8])
            items.append(
                ProbeItem(
                    name="models",
                    result="ok" if models else "warn",
                    detail=f"{len(models)}: {shown}" if models else "the host lists no models",
                )
            )
        return items

    async def aclose(self) -> None:
        await self._rpc.aclose()


class _SessionGone(Exception):
    """``session.prompt`` answered ``session-not-found``: nothing was started."""


def _time_zone() -> str:
    """The IANA zone of this machine (``TZ``, else /etc/localtime's link), else UTC."""
    tz = os.environ.get("TZ", "").lstrip(":")
    if tz and "/" in tz:
        return tz
    try:
        link = os.readlink("/etc/localtime")
    except OSError:
        return time.tzname[0] if time.tzname[0] == "UTC" else "UTC"
    _, sep, name = link.partition("zoneinfo/")
    return name if sep and name else "UTC"


def _is_dir(path: str) -> bool:
    """One local stat, on the trio thread on purpose (a worker thread is not worth it)."""
    return os.path.isdir(path)
