"""The ACP adapter: a bot's agent subprocess, its sessions and turns, behind dshim's
:class:`~dshim.harness.base.Harness` interface.

Theory of operation
-------------------
One agent process per bot (``[harness] command``, ``env``, ``cwd``; the bot's
``workspace`` overrides ``cwd``), spawned lazily with :func:`trio.lowlevel.open_process`
and shared by all sessions of the bot.  The wire (:mod:`~dshim.harness.acp.rpc`) and the
meaning of its messages (:mod:`~dshim.harness.acp.protocol`) live next door; this module is
the state machine:

- an :class:`_Agent` is one process: its connection, capabilities, sessions and running
  turns.  It routes ``session/update`` notifications of a session to that session's
  running turn (a bounded channel per turn; updates for sessions without a running turn —
  ``session/load`` replay, late updates — are dropped) and turns agent requests into
  interactions: ``session/request_permission`` becomes an
  :class:`~dshim.model.ApprovalRequest`, ``elicitation/create`` (form mode) one
  :class:`~dshim.model.QuestionRequest` per field; the pipeline answers through the
  ``reply`` callbacks.  A request the agent withdraws (``$/cancel_request``, answered
  -32800) or that outlives its turn (the process died) is withdrawn from the chat too.
  Every other request gets JSON-RPC error -32601 at once.
- Lifecycle: ``initialize`` (protocol version 1; capabilities recorded), then per dshim
  session ``session/new`` with the workspace.  A session the current process does not
  know (a binding from before a restart) is reopened with ``session/resume`` or
  ``session/load`` when advertised, else replaced by a new session (the binding keeps its
  id; an alias maps it).  A turn is one ``session/prompt`` request: text blocks, image
  blocks when ``promptCapabilities.image`` (else the images are refused with a clear
  reply), and it ends with the response's ``stopReason``.

Cancellation (``/stop``, shutdown) reaches the turn's generator as ``trio.Cancelled`` or
``GeneratorExit``; in a shielded, bounded scope it sends ``session/cancel``, answers the
turn's open permission/elicitation requests with "cancelled", and waits up to
``cancel_timeout_s`` (10 s) for the prompt response.  An agent that does not stop in time
is killed; the next turn starts a fresh process.

When the process fails (see :mod:`~dshim.harness.acp.rpc`) the running turns fail with
one clear error; the next turn respawns it after a backoff (``restart_backoff_s``
doubling per consecutive failure, at most 30 s; a turn that ends well resets it).
Everything that leaves this adapter is a turn event or a
:class:`~dshim.errors.HarnessError`.

Resources: the agent runs in its own process group (``start_new_session``), which is
ended as a whole when the process fails, is abandoned or is closed (see
:mod:`~dshim.harness.acp.rpc`).  With ``sessionCapabilities.close`` a session is closed
(``session/close``) when its conversation went idle (only when it can be resumed: the
next turn reopens it with its history) or was reset by ``/new``
(:meth:`AcpHarness.close_session`, called by the pipeline).  ``[harness] mode`` is set
with ``session/set_config_option`` (the ``category: "mode"`` select) on every new or
reopened session.  ``available_commands_update`` keeps :attr:`AcpHarness.agent_commands`
(``/help``, ``/agent``).  ``session/new`` answered -32000 by an agent that lists
``authMethods`` becomes a reply naming them and the log-in command.  The reader task
runs without the log context of the turn that spawned the agent; each routed event binds
the context of its own turn.

Models come from the session's ``configOptions`` (first ``category: "model"`` select,
switched with ``session/set_config_option``) or the legacy ``models`` object
(``session/set_model``).  Steering uses the ``_session/steering`` extension when the agent
advertises ``steering.supported`` in the initialize ``_meta``.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import structlog
import trio

from dshim.backoff import Backoff
from dshim.errors import HarnessError
from dshim.harness.acp import procs, protocol
from dshim.harness.acp.models import (
    AUTH_REQUIRED,
    CONNECTION_LOST,
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    PROTOCOL_VERSION,
    REQUEST_CANCELLED,
    CancelRequest,
    ElicitParams,
    InitResult,
    LegacyModels,
    Notification,
    PermissionParams,
    RequestId,
    SessionResult,
)
from dshim.harness.acp.protocol import AgentRpcError, Caps, Form
from dshim.harness.acp.rpc import Call, Connection, Params
from dshim.harness.base import ModelInfo, ProbeItem, TurnContext
from dshim.model import (
    ApprovalRequest,
    ImagePart,
    Option,
    PromptPart,
    QuestionRequest,
    TextDelta,
    TurnEnd,
    TurnEvent,
)

if TYPE_CHECKING:
    from dshim.config import HarnessConfig

__all__ = ["IMAGES_REFUSED", "NO_MODEL_SELECTION", "AcpHarness"]

log = structlog.get_logger("dshim.harness.acp")

P = TypeVar("P", bound=msgspec.Struct)

TURN_BUFFER = 512
REQUEST_TIMEOUT_S = 60.0
CANCEL_TIMEOUT_S = 10.0
#: After a cancelled turn, how long the tools it started may take to stop by themselves
#: before dshim ends them (:meth:`AcpHarness._end_turn_strays`).
STRAY_GRACE_S = 2.0
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0

IMAGES_REFUSED = (
    "This agent cannot read images, so your message was not sent to it. "
    "Send it again as text only (describe the image if it matters)."
)
NO_MODEL_SELECTION = "this agent does not offer model selection"


# --- turns and sessions ----------------------------------------------------------------------


class _OpenRequest:
    """An agent request (permission, elicitation) waiting for the user's answer."""

    def __init__(self, cancelled: dict[str, Any]) -> None:
        #: The result to send if the turn is cancelled first.
        self.cancelled = cancelled
        #: Set when the answer is no longer wanted (turn over, ``$/cancel_request``).
        self.withdrawn = trio.Event()


class _Turn:
    """One running ``session/prompt``: its event channel, open agent requests, outcome."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.send, self.recv = trio.open_memory_channel[TurnEvent](TURN_BUFFER)
        self.finished = trio.Event()
        self.stop_reason: str | None = None
        self.error: str | None = None
        self.cancelling = False
        self.open_requests: dict[RequestId, _OpenRequest] = {}
        self.updates = protocol.UpdateState()
        #: When it started, in process start-time ticks (:func:`procs.now_ticks`).
        self.started_ticks = procs.now_ticks()
        #: The pipeline's log context of this turn, bound by the reader per event (the
        #: reader task itself belongs to no turn).
        ctx = structlog.contextvars.get_contextvars()
        self.log_context = {k: ctx[k] for k in ("conversation", "turn") if k in ctx}

    def finish(self, *, stop_reason: str | None = None, error: str | None = None) -> None:
        if self.finished.is_set():
            return
        self.stop_reason = stop_reason
        self.error = error
        self.finished.set()
        self.send.close()
        for request in self.open_requests.values():
            request.withdrawn.set()

    def prompt_done(self, call: Call) -> None:
        """The ``session/prompt`` response arrived (or the process died with it open)."""
        stop_reason, error = protocol.prompt_outcome(
            call.error, call.result, cancelling=self.cancelling, lost=CONNECTION_LOST
        )
        self.finish(stop_reason=stop_reason, error=error)

    async def push(self, event: TurnEvent) -> bool:
        """Hand an event to the turn; False when the turn no longer listens."""
        try:
            await self.send.send(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    def end_event(self) -> TurnEnd:
        return protocol.end_event(self.stop_reason, self.error)


class _SessionState:
    def __init__(self, result: SessionResult) -> None:
        self.config_options: list[Any] | None = protocol.options_list(result.config_options)
        self.legacy_models: LegacyModels | None = protocol.legacy_models(result.models)


# --- one agent process ------------------------------------------------------------------------


class _Agent:
    """One agent process: its connection, capabilities, sessions and running turns.

    It is the connection's :class:`~dshim.harness.acp.rpc.RpcHandler`.
    """

    def __init__(
        self, proc: trio.Process, *, label: str, harness: AcpHarness, tag: str | None = None
    ) -> None:
        self.conn = Connection(proc, label=label, handler=self, group=True, tag=tag)
        self._harness = harness
        self.caps: Caps | None = None
        self.sessions: dict[str, _SessionState] = {}
        self.turns: dict[str, _Turn] = {}
        #: The ``initialize`` call in flight and its deadline (survives a caller's cancel).
        self.init_call: tuple[int, Call, float] | None = None

    @property
    def alive(self) -> bool:
        return self.conn.alive

    @property
    def pid(self) -> int:
        return self.conn.proc.pid

    # -- RpcHandler ----------------------------------------------------------------------

    def on_closed(self, conn: Connection, reason: str, *, failed: bool) -> None:
        for turn in list(self.turns.values()):
            with structlog.contextvars.bound_contextvars(**turn.log_context):
                if failed:
                    log.warning("agent_turn_failed", reason=reason)
                turn.finish(error=reason)
        if failed:
            self._harness.agent_failed(self)

    async def on_notification(self, conn: Connection, method: str, params: Params) -> None:
        if method == "$/cancel_request" and isinstance(params, msgspec.Raw):
            await self._on_cancel_request(params)
            return
        if method != "session/update" or not isinstance(params, msgspec.Raw):
            return  # elicitation/complete, vendor extensions: nothing to do
        try:
            note = msgspec.json.decode(params, type=Notification)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.info("agent_update_ignored", error=str(exc)[:200])
            return
        update = note.update
        state = self.sessions.get(note.session_id)
        if update.session_update == "config_option_update" and state is not None:
            options = protocol.options_list(update.config_options)
            if options is not None:
                state.config_options = options
            return
        if update.session_update == "available_commands_update":
            commands = protocol.agent_commands(update.available_commands)
            if commands is not None:
                self._harness.agent_commands = commands
                log.info("agent_commands_updated", count=len(commands))
            return
        turn = self.turns.get(note.session_id)
        if turn is None or turn.finished.is_set():
            return  # replay during session/load, or late updates of a finished turn
        with structlog.contextvars.bound_contextvars(**turn.log_context):
            event = protocol.event_for(update, turn.updates)
            if event is not None:
                await turn.push(event)

    async def _on_cancel_request(self, params: msgspec.Raw) -> None:
        """The agent withdrew one of its requests: answer it -32800, stop asking the user."""
        try:
            rid = msgspec.json.decode(params, type=CancelRequest).request_id
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        for turn in self.turns.values():
            request = turn.open_requests.pop(rid, None)
            if request is not None:
                request.withdrawn.set()
                await self.conn.respond_error(rid, REQUEST_CANCELLED, "Request cancelled")
                log.info("agent_request_withdrawn")
                return

    async def on_request(
        self, conn: Connection, rid: RequestId, method: str, params: Params
    ) -> None:
        if method in ("session/request_permission", "elicitation/create"):
            turn = next(iter(self.turns.values()), None) if len(self.turns) == 1 else None
            with structlog.contextvars.bound_contextvars(
                **(turn.log_context if turn is not None else {})
            ):
                if method == "session/request_permission":
                    await self._on_permission(rid, params)
                else:
                    await self._on_elicitation(rid, params)
        else:
            log.info("agent_request_unsupported", method=method)
            await self.conn.respond_error(rid, METHOD_NOT_FOUND, f"Method not found: {method}")

    async def _params(self, rid: RequestId, params: Params, kind: type[P]) -> P | None:
        """A request's params as ``kind``; None (answered -32602) when they do not decode."""
        try:
            return msgspec.json.decode(
                params if isinstance(params, msgspec.Raw) else b"null", type=kind
            )
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await self.conn.respond_error(rid, INVALID_PARAMS, f"Invalid params: {exc}")
            return None

    async def _on_permission(self, rid: RequestId, params: Params) -> None:
        cancelled = {"outcome": {"outcome": "cancelled"}}
        conn = self.conn
        p = await self._params(rid, params, PermissionParams)
        if p is None:
            return
        turn = self.turns.get(p.session_id)
        if turn is None or turn.cancelling or turn.finished.is_set() or not p.options:
            await conn.respond_quietly(rid, cancelled)
            return
        tool = p.tool_call
        title = tool.title or turn.updates.tools.get(tool.tool_call_id) or "a tool call"
        detail = protocol.summarize_input(tool.kind, tool.raw_input)
        open_request = _OpenRequest(cancelled)
        turn.open_requests[rid] = open_request

        async def reply(option_id: str | None) -> None:
            if turn.open_requests.pop(rid, None) is None:
                return  # already answered (cancelled with the turn)
            outcome: dict[str, Any] = (
                {"outcome": "selected", "optionId": option_id}
                if option_id is not None
                else {"outcome": "cancelled"}
            )
            await conn.respond_quietly(rid, {"outcome": outcome})

        request = ApprovalRequest(
            title=title,
            detail=detail,
            options=[
                Option(id=o.option_id, label=o.name or o.option_id, kind=o.kind) for o in p.options
            ],
            reply=reply,
            withdrawn=open_request.withdrawn.wait,
        )
        if not await turn.push(request):
            if turn.open_requests.pop(rid, None) is not None:
                await conn.respond_quietly(rid, cancelled)

    async def _on_elicitation(self, rid: RequestId, params: Params) -> None:
        conn = self.conn
        p = await self._params(rid, params, ElicitParams)
        if p is None:
            return
        if p.mode != "form":
            await conn.respond_quietly(rid, {"action": "decline"})
            return
        turn = self.turns.get(p.session_id or "")
        if turn is None and len(self.turns) == 1 and p.session_id is None:
            turn = next(iter(self.turns.values()))  # request-scoped: the only running turn
        fields = protocol.form_fields(p.requested_schema)
        if turn is None or turn.cancelling or turn.finished.is_set() or not fields:
            await conn.respond_quietly(rid, {"action": "cancel"})
            return
        open_request = _OpenRequest({"action": "cancel"})
        turn.open_requests[rid] = open_request
        asking = _FormAsk(conn, turn, rid, Form(p.message, fields), open_request)
        if not await turn.push(asking.question()):
            if turn.open_requests.pop(rid, None) is not None:
                await conn.respond_quietly(rid, {"action": "cancel"})


class _FormAsk:
    """One ``elicitation/create`` being asked in a turn: the form and its I/O."""

    def __init__(
        self, conn: Connection, turn: _Turn, rid: RequestId, form: Form, open_request: _OpenRequest
    ) -> None:
        self.conn = conn
        self.turn = turn
        self.rid = rid
        self.form = form
        self.open_request = open_request

    def question(self) -> QuestionRequest:
        return self.form.question(reply=self._answer, withdrawn=self.open_request.withdrawn.wait)

    async def _answer(self, selected: list[str], custom: str | None) -> None:
        if self.rid not in self.turn.open_requests:
            return
        step = self.form.answer(selected, custom)
        if step == "next":
            try:
                self.turn.send.send_nowait(self.question())
                return
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                step = "cancel"
        self.turn.open_requests.pop(self.rid, None)
        if step == "accept":
            await self.conn.respond_quietly(
                self.rid, {"action": "accept", "content": self.form.content}
            )
        else:
            await self.conn.respond_quietly(self.rid, {"action": "cancel"})


# --- the adapter -----------------------------------------------------------------------------


class AcpHarness:
    """A bot's ACP agent: one subprocess, several sessions, one turn per session."""

    kind = "acp"

    def __init__(
        self,
        cfg: HarnessConfig,
        *,
        bot: str,
        workspace: str | None = None,
        cancel_timeout_s: float = CANCEL_TIMEOUT_S,
        restart_backoff_s: float = RESTART_BACKOFF_S,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
    ) -> None:
        if not cfg.command:
            raise HarnessError('harness.command is required when kind = "acp"', code="config")
        self.bot = bot
        self._argv = [str(a) for a in cfg.command]
        self._env = {**os.environ, **cfg.env}
        base = workspace or cfg.cwd or os.getcwd()
        self.cwd = os.path.abspath(os.path.expanduser(base))
        self.cancel_timeout_s = cancel_timeout_s
        self.restart_backoff_s = restart_backoff_s
        self.request_timeout_s = request_timeout_s
        #: ``[harness] mode``: the agent mode applied to every session (category "mode").
        self.mode = cfg.mode
        #: Slash commands the agent advertised (``available_commands_update``).
        self.agent_commands: tuple[protocol.AgentCommand, ...] = ()
        #: Sessions with a turn starting or running (never closed under it).
        self._in_use: dict[str, int] = {}
        self._agent: _Agent | None = None
        self._spawn_lock = trio.Lock()
        self._session_lock = trio.Lock()
        # Exact delays (no jitter): one process per bot, nothing to spread out.
        self._restarts = Backoff(
            restart_backoff_s, max(RESTART_BACKOFF_MAX_S, restart_backoff_s), 2.0, jitter=0.0
        )
        self._not_before = 0.0
        self._aliases: dict[str, str] = {}
        #: The model a chat chose (``/model``), by dshim's session id: applied again to the
        #: session whenever it is reopened (agents such as codex-acp forget it on close).
        self._models: dict[str, str] = {}
        #: The mode the agent reported for the last session dshim opened (``/status``).
        self._reported_mode: str | None = None
        self._spare: str | None = None
        self._closed = False
        self._nursery: trio.Nursery | None = None
        self.spawn_count = 0

    def attach(self, nursery: trio.Nursery) -> None:
        """Give the harness the nursery its agent readers run in (see open_harness)."""
        self._nursery = nursery

    @property
    def pid(self) -> int | None:
        """The running agent's process id (None when not running)."""
        agent = self._agent
        return agent.pid if agent is not None and agent.alive else None

    # -- process -----------------------------------------------------------------------

    def _note_failure(self) -> None:
        """One more consecutive failure: the next start waits 1 s, 2 s, 4 s ... <= 30 s."""
        self._not_before = trio.current_time() + self._restarts.next_delay()

    def agent_failed(self, agent: _Agent) -> None:
        """An agent process broke (called by the agent once)."""
        if not self._closed and agent is self._agent:
            self._note_failure()

    async def _ensure_agent(self) -> _Agent:
        if self._closed:
            raise HarnessError("the agent adapter is closed", code="agent-closed")
        agent = self._agent
        if agent is not None and agent.alive and agent.caps is not None:
            return agent
        async with self._spawn_lock:
            agent = self._agent
            if agent is None or not agent.alive:
                wait = self._not_before - trio.current_time()
                if wait > 0:
                    log.info("agent_restart_backoff", seconds=round(wait, 2))
                    await trio.sleep(wait)
                agent = await self._spawn()
                self._agent = agent
            if agent.caps is None:
                # If our caller is cancelled meanwhile (/status has a short deadline) the
                # process and its pending initialize stay; the next caller waits for it.
                await self._initialize(agent)
            return agent

    async def _spawn(self) -> _Agent:
        if not await trio.Path(self.cwd).is_dir():
            self._note_failure()
            raise HarnessError(
                f"the agent's workspace {self.cwd} is not a directory", code="agent-start-failed"
            )
        tag = procs.new_tag()
        try:
            proc = await trio.lowlevel.open_process(
                self._argv,
                stdin=subprocess.PIPE,
                # Its own process group: ended as a whole, so the adapter's CLI children
                # and tool subprocesses never outlive it (see rpc.Connection).
                start_new_session=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**self._env, procs.TAG_VARIABLE: tag},
                cwd=self.cwd,
            )
        except OSError as exc:
            self._note_failure()
            raise HarnessError(
                f"cannot start the agent ({self._argv[0]}): {exc.strerror or exc}",
                code="agent-start-failed",
            ) from exc
        self.spawn_count += 1
        label = os.path.basename(self._argv[0])
        agent = _Agent(proc, label=label, harness=self, tag=tag)
        if self._nursery is None:
            agent.conn.fail("internal error: the ACP harness was not opened with open_harness")
            raise AssertionError("AcpHarness must be opened with dshim.harness.open_harness")
        self._nursery.start_soon(agent.conn.service, name=f"acp-agent:{self.bot}")
        log.info("agent_started", agent=label, pid=proc.pid, cwd=self.cwd)
        return agent

    async def _initialize(self, agent: _Agent) -> None:
        conn = agent.conn
        if agent.init_call is None:
            rid, call = await conn.start_call("initialize", protocol.initialize_params())
            agent.init_call = (rid, call, trio.current_time() + self.request_timeout_s)
        rid, call, deadline = agent.init_call
        try:
            raw = await conn.wait_call(rid, call, deadline=deadline)
        except HarnessError:
            conn.fail("the agent failed to initialize")
            raise
        try:
            init = msgspec.json.decode(raw, type=InitResult)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            conn.fail("the agent sent an invalid initialize result")
            raise HarnessError(
                f"the agent sent an invalid initialize result: {exc}", code="agent-protocol"
            ) from exc
        if init.protocol_version != PROTOCOL_VERSION:
            conn.fail(f"unsupported ACP protocol version {init.protocol_version}")
            raise HarnessError(
                f"the agent speaks ACP protocol version {init.protocol_version}; dshim speaks {PROTOCOL_VERSION}",
                code="agent-protocol",
            )
        agent.caps = protocol.caps_from(init)
        log.info(
            "agent_initialized", agent=agent.caps.agent, caps=msgspec.structs.asdict(agent.caps)
        )

    # -- sessions ----------------------------------------------------------------------

    async def _new_session(self, agent: _Agent) -> str:
        try:
            raw = await agent.conn.request(
                "session/new", protocol.session_params(self.cwd), timeout_s=self.request_timeout_s
            )
        except AgentRpcError as exc:
            caps = agent.caps
            if exc.rpc_code == AUTH_REQUIRED and caps is not None and caps.auth:
                log.warning("agent_login_needed", methods=[m.id for m in caps.auth])
                raise HarnessError(
                    protocol.login_text(caps.auth, self._argv), code="agent-auth-required"
                ) from exc
            raise
        result = protocol.decode_session(raw)
        if not result.session_id:
            raise HarnessError("the agent created a session without an id", code="agent-protocol")
        state = _SessionState(result)
        agent.sessions[result.session_id] = state
        await self._apply_mode(agent, result.session_id, state)
        return result.session_id

    async def _apply_mode(self, agent: _Agent, sid: str, state: _SessionState) -> None:
        """Switch a new or reopened session to ``[harness] mode`` (when it differs)."""
        try:
            await self._switch_mode(agent, sid, state)
        finally:
            option = protocol.category_option(state.config_options, "mode")
            if option is not None and isinstance(option.get("currentValue"), str):
                self._reported_mode = option["currentValue"]

    async def _switch_mode(self, agent: _Agent, sid: str, state: _SessionState) -> None:
        if not self.mode:
            return
        option = protocol.category_option(state.config_options, "mode")
        if option is None:
            log.warning("agent_mode_ignored", mode=self.mode, reason="the agent offers no modes")
            return
        values = protocol.select_values(option)
        try:
            chosen = protocol.choose(self.mode, values)
        except HarnessError:
            log.warning(
                "agent_mode_ignored",
                mode=self.mode,
                reason="not offered",
                available=[v for v, _ in values],
            )
            return
        if option.get("currentValue") == chosen:
            return
        await self._set_option(agent, sid, state, option, chosen)
        log.info("agent_mode_set", mode=chosen)

    async def _set_option(
        self, agent: _Agent, sid: str, state: _SessionState, option: dict[str, Any], value: str
    ) -> None:
        """``session/set_config_option``; the session's options become the answer's."""
        raw = await agent.conn.request(
            "session/set_config_option",
            {"sessionId": sid, "configId": option.get("id"), "value": value},
            timeout_s=self.request_timeout_s,
        )
        options = protocol.options_list(protocol.decode_session(raw, sid).config_options)
        if options is not None:
            state.config_options = options

    def mode_text(self) -> str | None:
        """The agent mode for ``/status``: the current value, and whether it is configured."""
        agent = self._agent
        current = None
        if agent is not None:
            for state in agent.sessions.values():
                option = protocol.category_option(state.config_options, "mode")
                if option is not None and isinstance(option.get("currentValue"), str):
                    current = option["currentValue"]
        current = current or self._reported_mode
        if current is None:
            if not self.mode:
                return None
            return (
                f"mode not reported yet (no session opened; [harness] mode = {self.mode!r} "
                "is applied to each session)"
            )
        if self.mode:
            return f"mode {current}, as the agent reports it ([harness] mode = {self.mode!r})"
        return f"mode {current} (the agent's default; set [harness] mode to change it)"

    async def close_session(self, session_id: str, *, reason: str) -> bool:
        """Free the agent's session when its conversation went idle (``reason="idle"``) or
        was reset (``"new"``): ``session/close`` when advertised.  An idle session is
        closed only when the agent can resume it — the next message then reopens it with
        its history.  True when it was closed."""
        agent = self._agent
        caps = agent.caps if agent is not None and agent.alive else None
        if agent is None or caps is None or not caps.close:
            return False
        if reason == "idle" and not (caps.resume or caps.load_session):
            return False
        async with self._session_lock:
            sid = self._aliases.get(session_id, session_id)
            busy = self._in_use.get(session_id) or self._in_use.get(sid)
            if sid not in agent.sessions or sid in agent.turns or busy:
                return False
            if sid == self._spare:
                return False
            try:
                await agent.conn.request(
                    "session/close", {"sessionId": sid}, timeout_s=self.request_timeout_s
                )
            except HarnessError as exc:
                log.warning("agent_session_close_failed", reason=reason, error=str(exc))
                return False
            agent.sessions.pop(sid, None)
            if reason == "new":
                self._aliases.pop(session_id, None)
                self._models.pop(session_id, None)
        log.info("agent_session_closed", reason=reason)
        return True

    async def _ensure_session(self, agent: _Agent, session_id: str) -> str:
        async with self._session_lock:
            sid = self._aliases.get(session_id, session_id)
            if sid in agent.sessions:
                return sid
            caps = agent.caps
            assert caps is not None
            method = (
                "session/resume" if caps.resume else "session/load" if caps.load_session else None
            )
            if method is not None:
                try:
                    raw = await agent.conn.request(
                        method,
                        protocol.session_params(self.cwd, sid),
                        timeout_s=self.request_timeout_s,
                    )
                    state = _SessionState(protocol.decode_session(raw, sid))
                    agent.sessions[sid] = state
                    log.info("agent_session_reopened", method=method)
                    await self._apply_mode(agent, sid, state)
                    await self._apply_model(agent, session_id, sid, state)
                    return sid
                except AgentRpcError as exc:
                    log.warning("agent_session_not_reopened", method=method, error=str(exc))
            new = await self._new_session(agent)
            self._aliases[session_id] = new
            log.warning("agent_session_replaced", reason="not resumable", method=method)
            await self._apply_model(agent, session_id, new, agent.sessions[new])
            return new

    async def create_session(self, *, title: str | None) -> str:
        agent = await self._ensure_agent()
        spare, self._spare = self._spare, None
        if spare is not None and spare in agent.sessions:
            return spare
        return await self._new_session(agent)

    async def _any_session(self, agent: _Agent) -> str:
        """A session to read model options from when the chat has none: kept as a spare."""
        if self._spare is None or self._spare not in agent.sessions:
            self._spare = await self._new_session(agent)
        return self._spare

    # -- turns -------------------------------------------------------------------------

    async def prompt(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        self._in_use[session_id] = self._in_use.get(session_id, 0) + 1
        try:
            async with aclosing(self._prompt(session_id, parts)) as events:
                async for event in events:
                    yield event
        finally:
            left = self._in_use.pop(session_id, 1) - 1
            if left:
                self._in_use[session_id] = left

    async def _prompt(
        self, session_id: str, parts: Sequence[PromptPart]
    ) -> AsyncGenerator[TurnEvent, None]:
        agent = await self._ensure_agent()
        sid = await self._ensure_session(agent, session_id)
        assert agent.caps is not None
        if any(isinstance(p, ImagePart) for p in parts) and not agent.caps.image:
            log.info("agent_images_refused")
            yield TextDelta(IMAGES_REFUSED)
            yield TurnEnd(stop_reason="refusal")
            return
        if sid in agent.turns:
            raise HarnessError("an answer is already running in this session", code="agent-busy")
        turn = _Turn(sid)
        agent.turns[sid] = turn
        ended = False
        try:
            await agent.conn.start_call(
                "session/prompt",
                {"sessionId": sid, "prompt": protocol.blocks(parts)},
                on_done=turn.prompt_done,
            )
            async for event in turn.recv:
                yield event
            await turn.finished.wait()
            end = turn.end_event()
            ended = True
            if end.error is None:
                self._restarts.reset()
            yield end
        finally:
            if not ended:
                with trio.CancelScope(shield=True):
                    await self._abort_turn(agent, turn)
            if agent.turns.get(sid) is turn:
                del agent.turns[sid]

    async def _abort_turn(self, agent: _Agent, turn: _Turn) -> None:
        """/stop or shutdown: session/cancel, cancel open requests, wait (bounded)."""
        conn = agent.conn
        turn.cancelling = True
        turn.recv.close()  # the reader never blocks on this turn again
        if turn.finished.is_set() or not conn.alive:
            return
        started = trio.current_time()
        with trio.move_on_after(self.cancel_timeout_s):
            try:
                await conn.notify("session/cancel", {"sessionId": turn.session_id})
                for rid, request in list(turn.open_requests.items()):
                    turn.open_requests.pop(rid, None)
                    await conn.respond_quietly(rid, request.cancelled)
            except HarnessError:
                return
            await turn.finished.wait()
        if turn.finished.is_set():
            log.info(
                "agent_turn_cancelled",
                stop_reason=turn.stop_reason,
                ms=round((trio.current_time() - started) * 1000),
            )
            if self._nursery is not None:
                self._nursery.start_soon(self._end_turn_strays, agent, turn)
            return
        log.warning("agent_cancel_timed_out", seconds=self.cancel_timeout_s)
        conn.fail(f"the agent did not stop within {self.cancel_timeout_s:g} s; it was restarted")
        self._not_before = 0.0  # an abandoned turn is not a crash: restart without waiting

    async def _end_turn_strays(self, agent: _Agent, turn: _Turn) -> None:
        """After a cancelled turn: the tool processes the agent started during it and left
        running (in sessions of their own, outside its group) are ended after a grace —
        only while no other turn runs on the agent (theirs cannot be told apart)."""
        await trio.sleep(STRAY_GRACE_S)
        tag = agent.conn.tag
        if tag is None or not agent.alive or agent.turns:
            return
        strays = await trio.to_thread.run_sync(
            functools.partial(procs.strays, agent.pid, tag, since=turn.started_ticks)
        )
        if strays and not agent.turns:
            with structlog.contextvars.bound_contextvars(**turn.log_context):
                await procs.end(strays, why="left running after the turn was stopped")

    async def cancel(self, session_id: str) -> None:
        agent = self._agent
        if agent is None or not agent.alive:
            return
        sid = self._aliases.get(session_id, session_id)
        if sid in agent.turns:
            try:
                await agent.conn.notify("session/cancel", {"sessionId": sid})
            except HarnessError:
                pass

    # -- models and steering -----------------------------------------------------------

    async def _state(self, session_id: str | None) -> tuple[_Agent, str, _SessionState]:
        agent = await self._ensure_agent()
        sid = (
            await self._ensure_session(agent, session_id)
            if session_id is not None
            else await self._any_session(agent)
        )
        return agent, sid, agent.sessions[sid]

    async def list_models(self, session_id: str | None) -> list[ModelInfo] | None:
        _, _, state = await self._state(session_id)
        option = protocol.model_option(state.config_options)
        if option is not None:
            current = option.get("currentValue")
            return [
                ModelInfo(id=value, name=name, current=value == current)
                for value, name in protocol.select_values(option)
            ]
        legacy = state.legacy_models
        if legacy is not None and legacy.available_models:
            return [
                ModelInfo(id=m.model_id, name=m.name, current=m.model_id == legacy.current_model_id)
                for m in legacy.available_models
            ]
        return None

    async def select_model(self, session_id: str, model: str) -> str:
        agent, sid, state = await self._state(session_id)
        chosen = await self._set_model(agent, sid, state, model)
        self._models[session_id] = chosen
        return chosen

    async def _set_model(self, agent: _Agent, sid: str, state: _SessionState, model: str) -> str:
        """Switch the session to ``model`` (config option or legacy ``session/set_model``)."""
        option = protocol.model_option(state.config_options)
        if option is not None:
            chosen = protocol.choose(model, protocol.select_values(option))
            if option.get("currentValue") != chosen:
                await self._set_option(agent, sid, state, option, chosen)
            return chosen
        legacy = state.legacy_models
        if legacy is not None and legacy.available_models:
            chosen = protocol.choose(model, [(m.model_id, m.name) for m in legacy.available_models])
            if legacy.current_model_id != chosen:
                await agent.conn.request(
                    "session/set_model",
                    {"sessionId": sid, "modelId": chosen},
                    timeout_s=self.request_timeout_s,
                )
                state.legacy_models = msgspec.structs.replace(legacy, current_model_id=chosen)
            return chosen
        raise HarnessError(NO_MODEL_SELECTION, code="models-unsupported")

    async def _apply_model(
        self, agent: _Agent, session_id: str, sid: str, state: _SessionState
    ) -> None:
        """A reopened (or replaced) session gets the model its chat chose again."""
        model = self._models.get(session_id)
        if model is None:
            return
        try:
            await self._set_model(agent, sid, state, model)
        except HarnessError as exc:
            log.warning("agent_model_not_reapplied", model=model, error=str(exc)[:300])
            return
        log.info("agent_model_reapplied", model=model)

    async def steer(self, session_id: str, text: str) -> bool:
        agent = await self._ensure_agent()
        assert agent.caps is not None
        if not agent.caps.steering:
            return False
        sid = self._aliases.get(session_id, session_id)
        try:
            raw = await agent.conn.request(
                "_session/steering",
                {
                    "sessionId": sid,
                    "prompt": [{"type": "text", "text": text}],
                    "_meta": {"steering": {"idleBehavior": "promptRequired"}},
                },
                timeout_s=self.request_timeout_s,
            )
        except AgentRpcError as exc:
            if exc.rpc_code == METHOD_NOT_FOUND:
                agent.caps = msgspec.structs.replace(agent.caps, steering=False)
                return False
            raise
        return protocol.steer_outcome(raw)

    # -- health ------------------------------------------------------------------------

    async def check(self) -> str:
        agent = await self._ensure_agent()
        caps = agent.caps
        assert caps is not None
        mode = self.mode_text()
        return f"{caps.agent}, ACP protocol {PROTOCOL_VERSION}, pid {agent.pid}" + (
            f", {mode}" if mode else ""
        )

    async def probe_details(self) -> list[ProbeItem]:
        """Capabilities for ``dshim probe``: image, load session, models, steer."""
        agent = await self._ensure_agent()
        caps = agent.caps
        assert caps is not None
        items = [
            ProbeItem(
                name="image",
                result="ok" if caps.image else "warn",
                detail="image prompts supported"
                if caps.image
                else "not supported: messages with images are refused",
            ),
        ]
        if caps.resume or caps.load_session:
            how = "session/resume" if caps.resume else "session/load"
            items.append(
                ProbeItem(
                    name="load session",
                    result="ok",
                    detail=f"sessions survive agent restarts ({how})",
                )
            )
        else:
            items.append(
                ProbeItem(
                    name="load session",
                    result="warn",
                    detail="not supported: an agent restart starts new sessions",
                )
            )
        try:
            models = await self.list_models(None)
        except HarnessError as exc:
            items.append(ProbeItem(name="models", result="fail", detail=str(exc)))
        else:
            if models:
                shown = ", ".join(m.id + (" (current)" if m.current else "") for m in models[:8])
                more = f" and {len(models) - 8} more" if len(models) > 8 else ""
                items.append(
                    ProbeItem(name="models", result="ok", detail=f"{len(models)}: {shown}{more}")
                )
            else:
                items.append(ProbeItem(name="models", result="warn", detail=NO_MODEL_SELECTION))
        items.append(await self._mode_probe())
        items.append(
            ProbeItem(
                name="steer",
                result="ok" if caps.steering else "warn",
                detail="_session/steering advertised"
                if caps.steering
                else "not supported by this agent",
            )
        )
        return items

    async def _mode_probe(self) -> ProbeItem:
        """The agent's modes (config option of category "mode") and the configured one."""
        try:
            _, _, state = await self._state(None)
        except HarnessError as exc:
            return ProbeItem(name="mode", result="fail", detail=str(exc))
        option = protocol.category_option(state.config_options, "mode")
        if option is None:
            return ProbeItem(
                name="mode",
                result="fail" if self.mode else "ok",
                detail="the agent offers no modes",
            )
        values = [v for v, _ in protocol.select_values(option)]
        available = ", ".join(values)
        current = option.get("currentValue")
        if not self.mode:
            return ProbeItem(
                name="mode",
                result="warn",
                detail=f"not set: the agent's default {current!r} applies; available: {available}",
            )
        try:
            chosen = protocol.choose(self.mode, protocol.select_values(option))
        except HarnessError:
            return ProbeItem(
                name="mode",
                result="fail",
                detail=f"[harness] mode = {self.mode!r} is not offered; available: {available}",
            )
        if current != chosen:
            return ProbeItem(
                name="mode",
                result="fail",
                detail=f"[harness] mode = {self.mode!r} was applied, but the agent reports "
                f"{current!r}; available: {available}",
            )
        return ProbeItem(
            name="mode",
            result="ok",
            detail=f"{current}, as the agent reports it after dshim applied [harness] mode "
            f"(available: {available})",
        )

    async def aclose(self) -> None:
        self._closed = True
        agent, self._agent = self._agent, None
        if agent is not None:
            with trio.CancelScope(shield=True):
                await agent.conn.close()
