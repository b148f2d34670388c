"""ACP (Agent Client Protocol v1) adapter: an agent subprocess spoken to over stdio.

Theory of operation
-------------------
One agent process per bot (``[harness] command``, ``env``, ``cwd``; the bot's
``workspace`` overrides ``cwd``), spawned lazily with :func:`trio.lowlevel.open_process`
and shared by all sessions of the bot.  The wire is JSON-RPC 2.0, one compact JSON
message per ``\\n``-terminated line; stdout carries only protocol messages, stderr lines
go to the log.  Both sides send requests, responses and notifications.

A :class:`_Conn` owns one process.  Its reader runs in the nursery that
:func:`dshim.harness.open_harness` attaches to the harness; the task lives exactly as long
as the process and is ended by :meth:`AcpHarness.aclose`.  The reader decodes each line
once and

- resolves our pending requests (``initialize``, ``session/new`` ...) by id;
- routes ``session/update`` notifications of a session to that session's running turn as
  dshim turn events (a bounded channel per turn; updates for sessions without a running
  turn — ``session/load`` replay, late updates — are dropped);
- turns agent requests into interactions: ``session/request_permission`` becomes an
  :class:`~dshim.model.ApprovalRequest`, ``elicitation/create`` (form mode) one
  :class:`~dshim.model.QuestionRequest` per field; the pipeline answers through the
  ``reply`` callbacks.  A request the agent withdraws (``$/cancel_request``, answered
  -32800) or that outlives its turn (the process died) is withdrawn from the chat too.
  Every other request gets JSON-RPC error -32601 at once.

Lifecycle: ``initialize`` (protocol version 1; capabilities recorded), then per dshim
session ``session/new`` with the workspace.  A session the current process does not know
(a binding from before a restart) is reopened with ``session/resume`` or ``session/load``
when advertised, else replaced by a new session (the binding keeps its id; an alias maps
it).  A turn is one ``session/prompt`` request: text blocks, image blocks when
``promptCapabilities.image`` (else the images are refused with a clear reply), and it
ends with the response's ``stopReason``.

Cancellation (``/stop``, shutdown) reaches the turn's generator as ``trio.Cancelled`` or
``GeneratorExit``; in a shielded, bounded scope it sends ``session/cancel``, answers the
turn's open permission/elicitation requests with "cancelled", and waits up to
``cancel_timeout_s`` (10 s) for the prompt response.  An agent that does not stop in time
is killed; the next turn starts a fresh process.

Misbehaviour — the process exits, a line is not JSON-RPC, a response carries an id we
never sent — kills the process and fails the running turns with one clear error; the next
turn respawns it after a backoff (``restart_backoff_s`` doubling per consecutive failure,
at most 30 s).  Every foreign error is mapped to :class:`~dshim.errors.HarnessError` here.

Models come from the session's ``configOptions`` (first ``category: "model"`` select,
switched with ``session/set_config_option``) or the legacy ``models`` object
(``session/set_model``).  Steering uses the ``_session/steering`` extension when the agent
advertises ``steering.supported`` in the initialize ``_meta``.
"""

from __future__ import annotations

import base64
import collections
import os
import subprocess
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec
import structlog
import trio

import dshim
from dshim.errors import HarnessError
from dshim.harness.base import ModelInfo, ProbeItem, TurnContext, file_part_text
from dshim.model import (
    ApprovalRequest,
    FilePart,
    ImagePart,
    Option,
    PromptPart,
    QuestionRequest,
    TextDelta,
    TextPart,
    Thinking,
    ToolProgress,
    TurnEnd,
    TurnEvent,
)

if TYPE_CHECKING:
    from dshim.config import HarnessConfig

log = structlog.get_logger("dshim.harness.acp")

PROTOCOL_VERSION = 1
LINE_MAX = 32 * 1024 * 1024
READ_SIZE = 256 * 1024
TURN_BUFFER = 512
REQUEST_TIMEOUT_S = 60.0
CANCEL_TIMEOUT_S = 10.0
RESTART_BACKOFF_S = 1.0
RESTART_BACKOFF_MAX_S = 30.0
CLOSE_TIMEOUT_S = 2.0
STDERR_LINE_MAX = 2000
ABANDONED_IDS = 256

METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
AUTH_REQUIRED = -32000
RESOURCE_NOT_FOUND = -32002
REQUEST_CANCELLED = -32800
CONNECTION_LOST = -32099  # dshim's own code for "the process died with this call open"

IMAGES_REFUSED = (
    "This agent cannot read images, so your message was not sent to it. "
    "Send it again as text only (describe the image if it matters)."
)
NO_MODEL_SELECTION = "this agent does not offer model selection"


# --- wire views: only the fields dshim reads -----------------------------------------------


class _RpcError(msgspec.Struct):
    code: int = 0
    message: str = ""


class _Envelope(msgspec.Struct):
    id: int | str | None | msgspec.UnsetType = msgspec.UNSET
    method: str | msgspec.UnsetType = msgspec.UNSET
    params: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    result: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    error: _RpcError | None | msgspec.UnsetType = msgspec.UNSET


class _PromptCaps(msgspec.Struct, rename="camel"):
    image: bool = False
    audio: bool = False
    embedded_context: bool = False


class _AgentCaps(msgspec.Struct, rename="camel"):
    load_session: bool = False
    prompt_capabilities: _PromptCaps = msgspec.field(default_factory=_PromptCaps)
    session_capabilities: dict[str, Any] | None = None
    meta: dict[str, Any] | None = msgspec.field(default=None, name="_meta")


class _AgentInfo(msgspec.Struct):
    name: str | None = None
    title: str | None = None
    version: str | None = None


class _InitResult(msgspec.Struct, rename="camel"):
    protocol_version: int = 0
    agent_capabilities: _AgentCaps = msgspec.field(default_factory=_AgentCaps)
    agent_info: _AgentInfo | None = None
    meta: dict[str, Any] | None = msgspec.field(default=None, name="_meta")


class _LegacyModel(msgspec.Struct, rename="camel"):
    model_id: str
    name: str | None = None


class _LegacyModels(msgspec.Struct, rename="camel"):
    current_model_id: str | None = None
    available_models: list[_LegacyModel] = msgspec.field(default_factory=list)


class _SessionResult(msgspec.Struct, rename="camel"):
    session_id: str | None = None
    config_options: Any = None
    models: Any = None  # legacy; converted leniently by _legacy_models


class _Update(msgspec.Struct, rename="camel"):
    # Lenient on purpose: one odd field must not lose the whole update.
    session_update: str = ""
    content: Any = None
    message_id: Any = None
    tool_call_id: Any = None
    title: Any = None
    status: Any = None
    entries: Any = None
    config_options: Any = None


class _Notification(msgspec.Struct, rename="camel"):
    session_id: str
    update: _Update


class _PermissionOption(msgspec.Struct, rename="camel"):
    option_id: str
    name: str = ""
    kind: str | None = None


class _ToolCallRef(msgspec.Struct, rename="camel"):
    tool_call_id: str = ""
    title: str | None = None
    kind: str | None = None
    raw_input: Any = None


class _PermissionParams(msgspec.Struct, rename="camel"):
    session_id: str
    tool_call: _ToolCallRef = msgspec.field(default_factory=_ToolCallRef)
    options: list[_PermissionOption] = msgspec.field(default_factory=list)


class _ElicitParams(msgspec.Struct, rename="camel"):
    session_id: str | None = None
    mode: str = "form"
    message: str = ""
    requested_schema: dict[str, Any] | None = None


class _CancelRequest(msgspec.Struct, rename="camel"):
    request_id: int | str


class _PromptResult(msgspec.Struct, rename="camel"):
    stop_reason: str = "end_turn"


class _SteerResult(msgspec.Struct):
    outcome: str = "failed"
    reason: str | None = None


_ENVELOPE = msgspec.json.Decoder(_Envelope)
_ENCODER = msgspec.json.Encoder()


class AgentRpcError(HarnessError):
    """The agent answered a request with a JSON-RPC error."""

    def __init__(self, method: str, code: int, message: str) -> None:
        super().__init__(_explain_rpc_error(method, code, message), code="agent-error")
        self.rpc_code = code


def _explain_rpc_error(method: str, code: int, message: str) -> str:
    detail = " ".join(message.split())[:300] or "no details"
    if code == AUTH_REQUIRED:
        return "the agent needs to be logged in on the host first (authentication required)"
    if code == RESOURCE_NOT_FOUND:
        return f"the agent does not know this session any more ({detail}); send /new to start a new one"
    return f"the agent reported an error for {method}: {detail} (code {code})"


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
        self.open_requests: dict[int | str, _OpenRequest] = {}
        self.tools: dict[str, str] = {}
        self.message_id: str | None = None
        self.text_seen = False

    def finish(self, *, stop_reason: str | None = None, error: str | None = None) -> None:
        if self.finished.is_set():
            return
        self.stop_reason = stop_reason
        self.error = error
        self.finished.set()
        self.send.close()
        for request in self.open_requests.values():
            request.withdrawn.set()

    async def push(self, event: TurnEvent) -> bool:
        """Hand an event to the turn; False when the turn no longer listens."""
        try:
            await self.send.send(event)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        return True

    def end_event(self) -> TurnEnd:
        if self.error is not None:
            return TurnEnd(stop_reason="error", error=self.error)
        reason = self.stop_reason or "end_turn"
        if reason == "end_turn":
            return TurnEnd()
        errors = {
            "max_tokens": "the answer was cut off: the model reached its output limit",
            "max_turn_requests": "the agent stopped: too many model requests in one turn",
            "refusal": "the agent refused to continue with this request",
            "cancelled": "the agent cancelled the answer",
        }
        return TurnEnd(stop_reason=reason, error=errors.get(reason))


class _SessionState:
    def __init__(self, result: _SessionResult) -> None:
        self.config_options: list[Any] | None = _options_list(result.config_options)
        self.legacy_models: _LegacyModels | None = _legacy_models(result.models)


def _options_list(value: Any) -> list[Any] | None:
    return value if isinstance(value, list) else None


def _legacy_models(value: Any) -> _LegacyModels | None:
    if not isinstance(value, dict):
        return None
    try:
        return msgspec.convert(value, _LegacyModels)
    except msgspec.ValidationError:
        log.info("agent_models_ignored", reason="invalid legacy models object")
        return None


class _Call:
    def __init__(self, method: str, on_done: Callable[[_Call], None] | None = None) -> None:
        self.method = method
        self.on_done = on_done
        self.done = trio.Event()
        self.result: msgspec.Raw | None = None
        self.error: _RpcError | None = None


class _Caps(msgspec.Struct, frozen=True, kw_only=True):
    image: bool
    embedded_context: bool
    load_session: bool
    resume: bool
    close: bool
    steering: bool
    agent: str


def _caps_from(init: _InitResult) -> _Caps:
    ac = init.agent_capabilities
    sc = ac.session_capabilities or {}
    steering = False
    for meta in (init.meta, ac.meta):
        s = (meta or {}).get("steering")
        if isinstance(s, dict) and s.get("supported") is True:
            steering = True
    info = init.agent_info
    agent = "agent"
    if info is not None and (info.title or info.name):
        agent = str(info.title or info.name) + (f" {info.version}" if info.version else "")
    return _Caps(
        image=ac.prompt_capabilities.image,
        embedded_context=ac.prompt_capabilities.embedded_context,
        load_session=ac.load_session,
        resume=sc.get("resume") is not None,
        close=sc.get("close") is not None,
        steering=steering,
        agent=agent,
    )


# --- one agent process ----------------------------------------------------------------------


class _Conn:
    """One agent process: its pipes, reader, requests in flight and running turns."""

    def __init__(
        self, proc: trio.Process, *, label: str, on_fail: Callable[[_Conn, str], None]
    ) -> None:
        self.proc = proc
        self.label = label
        self.alive = True
        self.failure: str | None = None
        self.caps: _Caps | None = None
        self.sessions: dict[str, _SessionState] = {}
        self.turns: dict[str, _Turn] = {}
        self._on_fail = on_fail
        self._next_id = 0
        self._calls: dict[int, _Call] = {}
        self._abandoned: collections.deque[int] = collections.deque(maxlen=ABANDONED_IDS)
        self._write_lock = trio.Lock()
        self._scope = trio.CancelScope()
        self.stopped = trio.Event()
        self.exit_status: int | None = None
        #: The ``initialize`` call in flight and its deadline (survives a caller's cancel).
        self.init_call: tuple[int, _Call, float] | None = None

    # -- process lifetime --------------------------------------------------------------

    def _release(self, reason: str) -> None:
        """Mark the connection dead and release every waiter with ``reason``."""
        self.alive = False
        self.failure = reason
        calls = list(self._calls.values())
        self._calls.clear()
        for call in calls:
            call.error = _RpcError(code=CONNECTION_LOST, message=reason)
            call.done.set()
            if call.on_done is not None:
                call.on_done(call)
        for turn in list(self.turns.values()):
            turn.finish(error=reason)

    def fail(self, reason: str) -> None:
        """Mark the process dead, release every waiter, kill the process (idempotent)."""
        if not self.alive:
            return
        log.warning("agent_failed", reason=reason, pid=self.proc.pid)
        self._release(reason)
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except OSError:  # already gone
                pass
        self._on_fail(self, reason)

    async def service(self) -> None:
        """The system task: read stdout and stderr until the process ends or aclose."""
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._read_stderr)
                    await self._read_stdout()
                    # stdout is done; give stderr a moment to drain its last lines.
                    nursery.cancel_scope.deadline = trio.current_time() + CLOSE_TIMEOUT_S
        except Exception as exc:  # the reader must never crash trio itself
            log.exception("agent_reader_crashed")
            self.fail(f"dshim's agent reader failed: {type(exc).__name__}")
        finally:
            self.fail(self._exit_reason())
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
                self.exit_status = await self.proc.wait()
            self.stopped.set()

    def _exit_reason(self) -> str:
        code = self.proc.returncode
        if code is None:
            return "the agent process stopped answering"
        return f"the agent process exited unexpectedly (exit status {code})"

    async def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        buf = bytearray()
        while self.alive:
            try:
                data = await self.proc.stdout.receive_some(READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            if not data:
                with trio.move_on_after(CLOSE_TIMEOUT_S):
                    await self.proc.wait()
                self.fail(self._exit_reason())
                return
            buf += data
            while self.alive:
                end = buf.find(b"\n")
                if end < 0:
                    break
                line = bytes(buf[:end])
                del buf[: end + 1]
                if line.strip():
                    await self._handle_line(line)
            if len(buf) > LINE_MAX:
                self.fail("the agent sent a message longer than 32 MiB")

    async def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        buf = bytearray()
        while True:
            try:
                data = await self.proc.stderr.receive_some(READ_SIZE)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                data = b""
            if not data:
                if buf.strip():
                    self._log_stderr(bytes(buf))
                return
            buf += data
            while (end := buf.find(b"\n")) >= 0:
                line = bytes(buf[:end])
                del buf[: end + 1]
                if line.strip():
                    self._log_stderr(line)
            if len(buf) > STDERR_LINE_MAX:
                self._log_stderr(bytes(buf))
                buf.clear()

    def _log_stderr(self, line: bytes) -> None:
        text = line.decode("utf-8", "replace").rstrip()[:STDERR_LINE_MAX]
        log.info("agent_stderr", agent=self.label, line=text)

    async def close(self) -> None:
        """Stop the process: close stdin (agents exit on EOF), then terminate, then kill."""
        if self.alive:
            self._release("dshim is shutting down")
        try:
            if self.proc.stdin is not None:
                await self.proc.stdin.aclose()
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            pass
        with trio.move_on_after(CLOSE_TIMEOUT_S):
            await self.proc.wait()
        if self.proc.returncode is None:
            self.proc.terminate()
            with trio.move_on_after(1.0):
                await self.proc.wait()
        if self.proc.returncode is None:
            self.proc.kill()
        self._scope.cancel()
        with trio.move_on_after(CLOSE_TIMEOUT_S):
            await self.stopped.wait()

    # -- writing -----------------------------------------------------------------------

    async def _write(self, message: dict[str, Any]) -> None:
        if not self.alive:
            raise HarnessError(
                self.failure or "the agent process is not running", code="agent-exited"
            )
        data = _ENCODER.encode(message) + b"\n"
        assert self.proc.stdin is not None
        try:
            async with self._write_lock:
                await self.proc.stdin.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.fail("the agent process closed its input")
            raise HarnessError(
                self.failure or "the agent process is not running", code="agent-exited"
            ) from exc

    async def start_call(
        self, method: str, params: dict[str, Any], on_done: Callable[[_Call], None] | None = None
    ) -> tuple[int, _Call]:
        self._next_id += 1
        rid = self._next_id
        call = _Call(method, on_done)
        self._calls[rid] = call
        try:
            await self._write({"jsonrpc": "2.0", "id": rid, "method": method, "params": params})
        except BaseException:
            self._calls.pop(rid, None)
            raise
        return rid, call

    async def request(
        self, method: str, params: dict[str, Any], *, timeout_s: float = REQUEST_TIMEOUT_S
    ) -> msgspec.Raw:
        """Send a request and wait for its result.  Raises HarnessError / AgentRpcError."""
        rid, call = await self.start_call(method, params)
        return await self.wait_call(rid, call, deadline=trio.current_time() + timeout_s)

    async def wait_call(self, rid: int, call: _Call, *, deadline: float) -> msgspec.Raw:
        """Wait for the result of a call already sent (a caller's cancellation leaves the
        call pending, so another caller can wait for it again)."""
        method = call.method
        with trio.move_on_at(deadline):
            await call.done.wait()
        if not call.done.is_set():
            self._calls.pop(rid, None)
            self._abandoned.append(rid)
            raise HarnessError(f"the agent did not answer {method} in time", code="agent-timeout")
        if call.error is not None:
            if not self.alive and call.error.code == CONNECTION_LOST:
                raise HarnessError(call.error.message, code="agent-exited")
            raise AgentRpcError(method, call.error.code, call.error.message)
        return call.result if call.result is not None else msgspec.Raw(b"null")

    async def notify(self, method: str, params: dict[str, Any]) -> None:
        await self._write({"jsonrpc": "2.0", "method": method, "params": params})

    async def respond(self, rid: int | str, result: dict[str, Any]) -> None:
        await self._write({"jsonrpc": "2.0", "id": rid, "result": result})

    async def respond_quietly(self, rid: int | str, result: dict[str, Any]) -> None:
        """Answer an agent request; a dead process is not an error here."""
        try:
            await self.respond(rid, result)
        except HarnessError:
            log.info("agent_reply_dropped", reason=self.failure)

    async def respond_error(self, rid: int | str, code: int, message: str) -> None:
        try:
            await self._write(
                {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}
            )
        except HarnessError:
            pass

    # -- reading -----------------------------------------------------------------------

    async def _handle_line(self, line: bytes) -> None:
        try:
            env = _ENVELOPE.decode(line)
        except msgspec.DecodeError:
            log.warning("agent_sent_malformed_line", sample=line[:120].decode("utf-8", "replace"))
            self.fail("the agent sent a malformed message (not JSON-RPC)")
            return
        has_id = env.id is not msgspec.UNSET and env.id is not None
        if isinstance(env.method, str):
            if has_id:
                assert not isinstance(env.id, msgspec.UnsetType) and env.id is not None
                await self._on_request(env.id, env.method, env.params)
            else:
                await self._on_notification(env.method, env.params)
            return
        if has_id and (env.result is not msgspec.UNSET or env.error is not msgspec.UNSET):
            self._on_response(env)
            return
        log.warning("agent_sent_malformed_line", sample=line[:120].decode("utf-8", "replace"))
        self.fail("the agent sent a malformed message (neither request, response nor notification)")

    def _on_response(self, env: _Envelope) -> None:
        rid = env.id
        call = self._calls.pop(rid, None) if isinstance(rid, int) else None
        if call is None:
            if isinstance(rid, int) and rid in self._abandoned:
                return  # a late answer to a request we gave up on
            self.fail(f"the agent answered a request dshim never sent (id {rid!r})")
            return
        if isinstance(env.error, _RpcError):
            call.error = env.error
        elif isinstance(env.result, msgspec.Raw):
            call.result = env.result
        else:
            call.error = _RpcError(code=-32603, message="empty error")
        call.done.set()
        if call.on_done is not None:
            call.on_done(call)

    async def _on_notification(self, method: str, params: msgspec.Raw | msgspec.UnsetType) -> None:
        if method == "$/cancel_request" and isinstance(params, msgspec.Raw):
            await self._on_cancel_request(params)
            return
        if method != "session/update" or not isinstance(params, msgspec.Raw):
            return  # elicitation/complete, vendor extensions: nothing to do
        try:
            note = msgspec.json.decode(params, type=_Notification)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.info("agent_update_ignored", error=str(exc)[:200])
            return
        update = note.update
        state = self.sessions.get(note.session_id)
        if update.session_update == "config_option_update" and state is not None:
            options = _options_list(update.config_options)
            if options is not None:
                state.config_options = options
            return
        turn = self.turns.get(note.session_id)
        if turn is None or turn.finished.is_set():
            return  # replay during session/load, or late updates of a finished turn
        event = _event_for(update, turn)
        if event is not None:
            await turn.push(event)

    async def _on_cancel_request(self, params: msgspec.Raw) -> None:
        """The agent withdrew one of its requests: answer it -32800, stop asking the user."""
        try:
            rid = msgspec.json.decode(params, type=_CancelRequest).request_id
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        for turn in self.turns.values():
            request = turn.open_requests.pop(rid, None)
            if request is not None:
                request.withdrawn.set()
                await self.respond_error(rid, REQUEST_CANCELLED, "Request cancelled")
                log.info("agent_request_withdrawn")
                return

    async def _on_request(
        self, rid: int | str, method: str, params: msgspec.Raw | msgspec.UnsetType
    ) -> None:
        if method == "session/request_permission":
            await self._on_permission(rid, params)
        elif method == "elicitation/create":
            await self._on_elicitation(rid, params)
        else:
            log.info("agent_request_unsupported", method=method)
            await self.respond_error(rid, METHOD_NOT_FOUND, f"Method not found: {method}")

    async def _on_permission(self, rid: int | str, params: msgspec.Raw | msgspec.UnsetType) -> None:
        cancelled = {"outcome": {"outcome": "cancelled"}}
        try:
            p = msgspec.json.decode(
                params if isinstance(params, msgspec.Raw) else b"null", type=_PermissionParams
            )
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await self.respond_error(rid, INVALID_PARAMS, f"Invalid params: {exc}")
            return
        turn = self.turns.get(p.session_id)
        if turn is None or turn.cancelling or turn.finished.is_set() or not p.options:
            await self.respond_quietly(rid, cancelled)
            return
        title = p.tool_call.title or turn.tools.get(p.tool_call.tool_call_id) or "a tool call"
        detail = _summarize_input(p.tool_call.kind, p.tool_call.raw_input)
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
            await self.respond_quietly(rid, {"outcome": outcome})

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
                await self.respond_quietly(rid, cancelled)

    async def _on_elicitation(
        self, rid: int | str, params: msgspec.Raw | msgspec.UnsetType
    ) -> None:
        try:
            p = msgspec.json.decode(
                params if isinstance(params, msgspec.Raw) else b"null", type=_ElicitParams
            )
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            await self.respond_error(rid, INVALID_PARAMS, f"Invalid params: {exc}")
            return
        if p.mode != "form":
            await self.respond_quietly(rid, {"action": "decline"})
            return
        turn = self.turns.get(p.session_id or "")
        if turn is None and len(self.turns) == 1 and p.session_id is None:
            turn = next(iter(self.turns.values()))  # request-scoped: the only running turn
        fields = _form_fields(p.requested_schema)
        if turn is None or turn.cancelling or turn.finished.is_set() or not fields:
            await self.respond_quietly(rid, {"action": "cancel"})
            return
        open_request = _OpenRequest({"action": "cancel"})
        turn.open_requests[rid] = open_request
        form = _Form(self, turn, rid, p.message, fields, open_request)
        if not await turn.push(form.question(0)):
            if turn.open_requests.pop(rid, None) is not None:
                await self.respond_quietly(rid, {"action": "cancel"})


def _text_of(block: Any) -> str:
    if not isinstance(block, dict):
        return ""
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        return text if isinstance(text, str) else ""
    if kind == "resource_link":
        name = block.get("title") or block.get("name") or block.get("uri") or "link"
        return f"[{name}]({block.get('uri', '')})"
    if kind == "image":
        return "[image]"
    return ""


def _event_for(update: _Update, turn: _Turn) -> TurnEvent | None:
    kind = update.session_update
    if kind == "agent_message_chunk":
        text = _text_of(update.content)
        if not text:
            return None
        mid = _str_or_none(update.message_id)
        if mid and mid != turn.message_id:
            if turn.message_id is not None and turn.text_seen:
                text = "\n\n" + text  # a new agent message within the same turn
            turn.message_id = mid
        turn.text_seen = True
        return TextDelta(text)
    if kind == "agent_thought_chunk":
        text = _text_of(update.content)
        return Thinking(text) if text else None
    if kind in ("tool_call", "tool_call_update"):
        tool_id = _str_or_none(update.tool_call_id) or ""
        title = _str_or_none(update.title)
        if title:
            turn.tools[tool_id] = title
        default = "pending" if kind == "tool_call" else "in_progress"
        return ToolProgress(
            title=turn.tools.get(tool_id) or "tool",
            status=_str_or_none(update.status) or default,
            tool_id=tool_id or None,
        )
    if kind == "plan":
        raw = update.entries if isinstance(update.entries, list) else []
        entries = [e for e in raw if isinstance(e, dict)]
        if not entries:
            return None
        done = sum(1 for e in entries if e.get("status") == "completed")
        current = next(
            (e for e in entries if e.get("status") == "in_progress"),
            next((e for e in entries if e.get("status") != "completed"), entries[-1]),
        )
        return ToolProgress(
            title=f"Plan: {current.get('content', '')}",
            status=f"{done}/{len(entries)} done",
            tool_id="plan",
        )
    return None  # usage, modes, commands, session info, user replay: nothing to show


def _str_or_none(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else str(value)


def _summarize_input(kind: str | None, raw: Any) -> str | None:
    parts: list[str] = []
    if kind:
        parts.append(f"Kind: {kind}")
    if raw is not None:
        try:
            text = msgspec.json.format(msgspec.json.encode(raw), indent=2).decode()
        except (TypeError, msgspec.EncodeError):
            text = str(raw)
        parts.append(text)
    return "\n".join(parts) or None


# --- elicitation forms -------------------------------------------------------------------------


class _Field(msgspec.Struct, kw_only=True):
    name: str
    label: str
    kind: str  # "select" | "multi" | "boolean" | "text" | "integer" | "number"
    options: list[Option]
    required: bool


def _enum_options(schema: dict[str, Any]) -> list[Option]:
    one_of = schema.get("oneOf") or schema.get("anyOf")
    if isinstance(one_of, list):
        out = []
        for o in one_of:
            if isinstance(o, dict) and isinstance(o.get("const"), str):
                out.append(
                    Option(
                        id=o["const"],
                        label=str(o.get("title") or o["const"]),
                        description=o.get("description")
                        if isinstance(o.get("description"), str)
                        else None,
                    )
                )
        return out
    values = schema.get("enum")
    names = schema.get("enumNames")
    if isinstance(values, list):
        return [
            Option(
                id=str(v),
                label=str(names[i]) if isinstance(names, list) and i < len(names) else str(v),
            )
            for i, v in enumerate(values)
        ]
    return []


def _form_fields(schema: dict[str, Any] | None) -> list[_Field]:
    if not isinstance(schema, dict):
        return []
    props = schema.get("properties")
    req = schema.get("required")
    required: list[Any] = req if isinstance(req, list) else []
    if not isinstance(props, dict):
        return []
    fields: list[_Field] = []
    for name, prop in props.items():
        if not isinstance(prop, dict):
            continue
        label = str(prop.get("title") or name)
        if isinstance(prop.get("description"), str):
            label += f" — {prop['description']}"
        t = prop.get("type")
        options: list[Option] = []
        if t == "array":
            items = prop.get("items")
            options = _enum_options(items if isinstance(items, dict) else {})
            kind = "multi"
        elif t == "boolean":
            options = [Option(id="true", label="Yes"), Option(id="false", label="No")]
            kind = "boolean"
        elif t in ("integer", "number"):
            kind = t
        else:
            options = _enum_options(prop)
            kind = "select" if options else "text"
        fields.append(
            _Field(
                name=str(name), label=label, kind=kind, options=options, required=name in required
            )
        )
    return fields


class _Form:
    """An ``elicitation/create`` form asked one field at a time; answered when complete."""

    def __init__(
        self,
        conn: _Conn,
        turn: _Turn,
        rid: int | str,
        message: str,
        fields: list[_Field],
        open_request: _OpenRequest,
    ) -> None:
        self.conn = conn
        self.turn = turn
        self.rid = rid
        self.open_request = open_request
        self.message = message.strip()
        self.fields = fields
        self.index = 0
        self.content: dict[str, Any] = {}

    def question(self, i: int) -> QuestionRequest:
        f = self.fields[i]
        head = f"({i + 1}/{len(self.fields)}) " if len(self.fields) > 1 else ""
        text = f"{self.message}\n{head}{f.label}" if self.message else f"{head}{f.label}"
        return QuestionRequest(
            question=text,
            options=list(f.options),
            multi_select=f.kind == "multi",
            allow_free_text=f.kind in ("text", "integer", "number") or not f.options,
            reply=self._answer,
            withdrawn=self.open_request.withdrawn.wait,
        )

    async def _answer(self, selected: list[str], custom: str | None) -> None:
        if self.rid not in self.turn.open_requests:
            return
        f = self.fields[self.index]
        if not selected and custom is None:
            self.turn.open_requests.pop(self.rid, None)
            await self.conn.respond_quietly(self.rid, {"action": "cancel"})
            return
        self.content[f.name] = _field_value(f, selected, custom)
        self.index += 1
        if self.index < len(self.fields):
            try:
                self.turn.send.send_nowait(self.question(self.index))
                return
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                self.turn.open_requests.pop(self.rid, None)
                await self.conn.respond_quietly(self.rid, {"action": "cancel"})
                return
        self.turn.open_requests.pop(self.rid, None)
        await self.conn.respond_quietly(self.rid, {"action": "accept", "content": self.content})


def _field_value(f: _Field, selected: list[str], custom: str | None) -> Any:
    if f.kind == "multi":
        return list(selected) + ([custom] if custom else [])
    if f.kind == "boolean":
        return (selected[0] if selected else (custom or "")).strip().lower() in ("true", "yes", "y")
    if selected:
        return selected[0]
    text = (custom or "").strip()
    if f.kind == "integer":
        try:
            return int(text)
        except ValueError:
            return text
    if f.kind == "number":
        try:
            return float(text)
        except ValueError:
            return text
    return text


# --- prompt content -------------------------------------------------------------------------


def _blocks(parts: Sequence[PromptPart]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, TextPart):
            blocks.append({"type": "text", "text": part.text})
        elif isinstance(part, ImagePart):
            blocks.append(
                {
                    "type": "image",
                    "data": base64.b64encode(part.data).decode("ascii"),
                    "mimeType": part.mime,
                }
            )
        elif isinstance(part, FilePart):
            blocks.append({"type": "text", "text": file_part_text(part)})
    return blocks


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
        self._conn: _Conn | None = None
        self._spawn_lock = trio.Lock()
        self._session_lock = trio.Lock()
        self._failures = 0
        self._not_before = 0.0
        self._aliases: dict[str, str] = {}
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
        conn = self._conn
        return conn.proc.pid if conn is not None and conn.alive else None

    # -- process -----------------------------------------------------------------------

    def _note_failure(self) -> None:
        """One more consecutive failure: the next start waits 1 s, 2 s, 4 s ... <= 30 s."""
        self._failures += 1
        delay = min(RESTART_BACKOFF_MAX_S, self.restart_backoff_s * 2 ** (self._failures - 1))
        self._not_before = trio.current_time() + delay

    def _conn_failed(self, conn: _Conn, reason: str) -> None:
        if not self._closed and conn is self._conn:
            self._note_failure()

    async def _ensure_conn(self) -> _Conn:
        if self._closed:
            raise HarnessError("the agent adapter is closed", code="agent-closed")
        conn = self._conn
        if conn is not None and conn.alive and conn.caps is not None:
            return conn
        async with self._spawn_lock:
            conn = self._conn
            if conn is None or not conn.alive:
                wait = self._not_before - trio.current_time()
                if wait > 0:
                    log.info("agent_restart_backoff", seconds=round(wait, 2))
                    await trio.sleep(wait)
                conn = await self._spawn()
                self._conn = conn
            if conn.caps is None:
                # If our caller is cancelled meanwhile (/status has a short deadline) the
                # process and its pending initialize stay; the next caller waits for it.
                await self._initialize(conn)
            return conn

    async def _spawn(self) -> _Conn:
        if not await trio.Path(self.cwd).is_dir():
            self._note_failure()
            raise HarnessError(
                f"the agent's workspace {self.cwd} is not a directory", code="agent-start-failed"
            )
        try:
            proc = await trio.lowlevel.open_process(
                self._argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=self._env,
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
        conn = _Conn(proc, label=label, on_fail=self._conn_failed)
        if self._nursery is None:
            conn.fail("internal error: the ACP harness was not opened with open_harness")
            raise AssertionError("AcpHarness must be opened with dshim.harness.open_harness")
        self._nursery.start_soon(conn.service, name=f"acp-agent:{self.bot}")
        log.info("agent_started", agent=label, pid=proc.pid, cwd=self.cwd)
        return conn

    async def _initialize(self, conn: _Conn) -> None:
        if conn.init_call is None:
            rid, call = await conn.start_call(
                "initialize",
                {
                    "protocolVersion": PROTOCOL_VERSION,
                    "clientCapabilities": {
                        "fs": {"readTextFile": False, "writeTextFile": False},
                        "terminal": False,
                        "elicitation": {"form": {}},
                    },
                    "clientInfo": {
                        "name": "dshim",
                        "title": "dshim",
                        "version": dshim.__version__,
                    },
                },
            )
            conn.init_call = (rid, call, trio.current_time() + self.request_timeout_s)
        rid, call, deadline = conn.init_call
        try:
            raw = await conn.wait_call(rid, call, deadline=deadline)
        except HarnessError:
            conn.fail("the agent failed to initialize")
            raise
        try:
            init = msgspec.json.decode(raw, type=_InitResult)
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
        conn.caps = _caps_from(init)
        log.info("agent_initialized", agent=conn.caps.agent, caps=msgspec.structs.asdict(conn.caps))

    # -- sessions ----------------------------------------------------------------------

    def _session_params(self, session_id: str | None = None) -> dict[str, Any]:
        params: dict[str, Any] = {"cwd": self.cwd, "mcpServers": []}
        if session_id is not None:
            params["sessionId"] = session_id
        return params

    async def _new_session(self, conn: _Conn) -> str:
        raw = await conn.request(
            "session/new", self._session_params(), timeout_s=self.request_timeout_s
        )
        result = _decode_session(raw)
        if not result.session_id:
            raise HarnessError("the agent created a session without an id", code="agent-protocol")
        conn.sessions[result.session_id] = _SessionState(result)
        return result.session_id

    async def _ensure_session(self, conn: _Conn, session_id: str) -> str:
        async with self._session_lock:
            sid = self._aliases.get(session_id, session_id)
            if sid in conn.sessions:
                return sid
            caps = conn.caps
            assert caps is not None
            method = (
                "session/resume" if caps.resume else "session/load" if caps.load_session else None
            )
            if method is not None:
                try:
                    raw = await conn.request(
                        method, self._session_params(sid), timeout_s=self.request_timeout_s
                    )
                    conn.sessions[sid] = _SessionState(_decode_session(raw, sid))
                    log.info("agent_session_reopened", method=method)
                    return sid
                except AgentRpcError as exc:
                    log.warning("agent_session_not_reopened", method=method, error=str(exc))
            new = await self._new_session(conn)
            self._aliases[session_id] = new
            log.warning("agent_session_replaced", reason="not resumable", method=method)
            return new

    async def create_session(self, *, title: str | None) -> str:
        conn = await self._ensure_conn()
        spare, self._spare = self._spare, None
        if spare is not None and spare in conn.sessions:
            return spare
        return await self._new_session(conn)

    async def _any_session(self, conn: _Conn) -> str:
        """A session to read model options from when the chat has none: kept as a spare."""
        if self._spare is None or self._spare not in conn.sessions:
            self._spare = await self._new_session(conn)
        return self._spare

    # -- turns -------------------------------------------------------------------------

    async def prompt(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        conn = await self._ensure_conn()
        sid = await self._ensure_session(conn, session_id)
        assert conn.caps is not None
        if any(isinstance(p, ImagePart) for p in parts) and not conn.caps.image:
            log.info("agent_images_refused")
            yield TextDelta(IMAGES_REFUSED)
            yield TurnEnd(stop_reason="refusal")
            return
        if sid in conn.turns:
            raise HarnessError("an answer is already running in this session", code="agent-busy")
        turn = _Turn(sid)
        conn.turns[sid] = turn
        ended = False
        try:
            await conn.start_call(
                "session/prompt",
                {"sessionId": sid, "prompt": _blocks(parts)},
                on_done=lambda call: _prompt_done(turn, call),
            )
            async for event in turn.recv:
                yield event
            await turn.finished.wait()
            end = turn.end_event()
            ended = True
            if end.error is None:
                self._failures = 0
            yield end
        finally:
            if not ended:
                with trio.CancelScope(shield=True):
                    await self._abort_turn(conn, turn)
            if conn.turns.get(sid) is turn:
                del conn.turns[sid]

    async def _abort_turn(self, conn: _Conn, turn: _Turn) -> None:
        """/stop or shutdown: session/cancel, cancel open requests, wait (bounded)."""
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
            return
        log.warning("agent_cancel_timed_out", seconds=self.cancel_timeout_s)
        conn.fail(f"the agent did not stop within {self.cancel_timeout_s:g} s; it was restarted")
        self._not_before = 0.0  # an abandoned turn is not a crash: restart without waiting

    async def cancel(self, session_id: str) -> None:
        conn = self._conn
        if conn is None or not conn.alive:
            return
        sid = self._aliases.get(session_id, session_id)
        if sid in conn.turns:
            try:
                await conn.notify("session/cancel", {"sessionId": sid})
            except HarnessError:
                pass

    # -- models and steering -----------------------------------------------------------

    async def _state(self, session_id: str | None) -> tuple[_Conn, str, _SessionState]:
        conn = await self._ensure_conn()
        sid = (
            await self._ensure_session(conn, session_id)
            if session_id is not None
            else await self._any_session(conn)
        )
        return conn, sid, conn.sessions[sid]

    async def list_models(self, session_id: str | None) -> list[ModelInfo] | None:
        _, _, state = await self._state(session_id)
        option = _model_option(state.config_options)
        if option is not None:
            current = option.get("currentValue")
            return [
                ModelInfo(id=value, name=name, current=value == current)
                for value, name in _select_values(option)
            ]
        legacy = state.legacy_models
        if legacy is not None and legacy.available_models:
            return [
                ModelInfo(id=m.model_id, name=m.name, current=m.model_id == legacy.current_model_id)
                for m in legacy.available_models
            ]
        return None

    async def select_model(self, session_id: str, model: str) -> str:
        conn, sid, state = await self._state(session_id)
        option = _model_option(state.config_options)
        if option is not None:
            values = _select_values(option)
            chosen = _choose(model, values)
            raw = await conn.request(
                "session/set_config_option",
                {"sessionId": sid, "configId": option.get("id"), "value": chosen},
                timeout_s=self.request_timeout_s,
            )
            options = _options_list(_decode_session(raw, sid).config_options)
            if options is not None:
                state.config_options = options
            return chosen
        legacy = state.legacy_models
        if legacy is not None and legacy.available_models:
            chosen = _choose(model, [(m.model_id, m.name) for m in legacy.available_models])
            await conn.request(
                "session/set_model",
                {"sessionId": sid, "modelId": chosen},
                timeout_s=self.request_timeout_s,
            )
            state.legacy_models = msgspec.structs.replace(legacy, current_model_id=chosen)
            return chosen
        raise HarnessError(NO_MODEL_SELECTION, code="models-unsupported")

    async def steer(self, session_id: str, text: str) -> bool:
        conn = await self._ensure_conn()
        assert conn.caps is not None
        if not conn.caps.steering:
            return False
        sid = self._aliases.get(session_id, session_id)
        try:
            raw = await conn.request(
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
                conn.caps = msgspec.structs.replace(conn.caps, steering=False)
                return False
            raise
        try:
            result = msgspec.json.decode(raw, type=_SteerResult)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise HarnessError(
                "the agent sent an invalid steering result", code="agent-protocol"
            ) from exc
        if result.outcome == "injected":
            return True
        if result.outcome in ("promptRequired", "startedNewTurn"):
            raise HarnessError(
                "the answer had already finished; send your text as a new message",
                code="steer-idle",
            )
        raise HarnessError(
            f"the agent could not take the guidance{': ' + result.reason if result.reason else ''}",
            code="steer-failed",
        )

    # -- health ------------------------------------------------------------------------

    async def check(self) -> str:
        conn = await self._ensure_conn()
        caps = conn.caps
        assert caps is not None
        return f"{caps.agent}, ACP protocol {PROTOCOL_VERSION}, pid {conn.proc.pid}"

    async def probe_details(self) -> list[ProbeItem]:
        """Capabilities for ``dshim probe``: image, load session, models, steer."""
        conn = await self._ensure_conn()
        caps = conn.caps
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

    async def aclose(self) -> None:
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            with trio.CancelScope(shield=True):
                await conn.close()


def _prompt_done(turn: _Turn, call: _Call) -> None:
    if call.error is not None:
        if turn.cancelling:
            turn.finish(stop_reason="cancelled")  # an error right after cancel means cancelled
        elif call.error.code == CONNECTION_LOST:
            turn.finish(error=call.error.message)
        else:
            turn.finish(
                error=_explain_rpc_error("session/prompt", call.error.code, call.error.message)
            )
        return
    try:
        result = msgspec.json.decode(call.result or b"null", type=_PromptResult)
    except (msgspec.DecodeError, msgspec.ValidationError):
        turn.finish(error="the agent sent an invalid session/prompt result")
        return
    turn.finish(stop_reason=result.stop_reason)


def _decode_session(raw: msgspec.Raw, session_id: str | None = None) -> _SessionResult:
    if bytes(raw).strip() in (b"null", b""):
        return _SessionResult(session_id=session_id)
    try:
        result = msgspec.json.decode(raw, type=_SessionResult)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HarnessError(
            f"the agent sent an invalid session result: {exc}", code="agent-protocol"
        ) from exc
    if result.session_id is None and session_id is not None:
        result = msgspec.structs.replace(result, session_id=session_id)
    return result


def _model_option(options: list[Any] | None) -> dict[str, Any] | None:
    for option in options or []:
        if (
            isinstance(option, dict)
            and option.get("category") == "model"
            and option.get("type", "select") == "select"
        ):
            return option
    return None


def _select_values(option: dict[str, Any]) -> list[tuple[str, str | None]]:
    """Flatten a select's options (which may be grouped) into (value, name) pairs."""
    out: list[tuple[str, str | None]] = []

    def walk(items: Any) -> None:
        for item in items if isinstance(items, list) else []:
            if not isinstance(item, dict):
                continue
            if isinstance(item.get("options"), list):
                walk(item["options"])
            elif isinstance(item.get("value"), str):
                name = item.get("name")
                out.append((item["value"], name if isinstance(name, str) else None))

    walk(option.get("options"))
    return out


def _choose(model: str, values: list[tuple[str, str | None]]) -> str:
    wanted = model.strip()
    for value, _ in values:
        if value == wanted:
            return value
    for value, name in values:
        if value.casefold() == wanted.casefold() or (name and name.casefold() == wanted.casefold()):
            return value
    raise HarnessError(f"unknown model {wanted!r}; /models lists the choices", code="model-unknown")


__all__ = ["AcpHarness", "AgentRpcError"]
