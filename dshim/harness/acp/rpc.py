"""JSON-RPC 2.0 over an agent subprocess's stdio: the ACP transport, thin trio I/O.

Theory of operation
-------------------
A :class:`Connection` owns one process.  stdout carries only protocol messages, one
compact JSON message per ``\\n``-terminated line (at most :data:`LINE_MAX`); stderr lines
go to the log.  :meth:`Connection.service` is the connection's one reader task: it runs in
the nursery :func:`dshim.harness.open_harness` attached to the harness and lives exactly
as long as the process.  It decodes each line once and

- resolves our pending calls by id (a late answer to a call we gave up on is dropped);
- hands agent requests (id + method) and notifications (method only) to the
  :class:`RpcHandler`, in order, awaiting each (so a slow consumer slows the reader
  instead of growing a queue).

Writes are serialized by one lock; every message is one ``send_all``.

Misbehaviour — the process exits or closes a pipe, a line is not JSON-RPC, a response
carries an id we never sent, a line over 32 MiB — :meth:`fails <Connection.fail>` the
connection: the process is killed, every pending call is released with
:data:`~dshim.harness.acp.models.CONNECTION_LOST`, and the handler is told once
(:meth:`RpcHandler.on_closed`).  Every foreign error (pipes, OS, JSON) becomes a
:class:`~dshim.errors.HarnessError` here: ``agent-exited``, ``agent-timeout``, or an
:class:`~dshim.harness.acp.protocol.AgentRpcError` for a JSON-RPC error answer.
"""

from __future__ import annotations

import collections
import functools
import os
import signal
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import structlog
import trio

from dshim.errors import HarnessError
from dshim.harness.acp import procs
from dshim.harness.acp.models import (
    CONNECTION_LOST,
    ENCODER,
    ENVELOPE,
    Envelope,
    RequestId,
    RpcError,
)
from dshim.harness.acp.protocol import AgentRpcError

__all__ = ["Call", "Connection", "RpcHandler"]


def _group_has_live_members(pgid: int) -> bool:
    """Whether a process group has a member that is not a zombie (Linux ``/proc``; True
    where it cannot tell).  Zombies left to an init that does not reap must not hold the
    bounded wait open."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return True
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rpartition(b")")[2].split()
        if len(fields) > 2 and fields[2] == str(pgid).encode() and fields[0] != b"Z":
            return True
    return False


log = structlog.get_logger("dshim.harness.acp")

LINE_MAX = 32 * 1024 * 1024
READ_SIZE = 256 * 1024
REQUEST_TIMEOUT_S = 60.0
CLOSE_TIMEOUT_S = 2.0
#: After the agent's process group got SIGTERM: how long its members may take to exit.
GROUP_TERM_S = 2.0
STDERR_LINE_MAX = 2000
#: Ids of calls we gave up on, remembered so their late answers are not protocol errors.
ABANDONED_IDS = 256

Params = msgspec.Raw | msgspec.UnsetType


class RpcHandler(Protocol):
    """What the connection hands up: agent requests, notifications, and its end."""

    async def on_request(
        self, conn: Connection, rid: RequestId, method: str, params: Params
    ) -> None:
        """An agent request; answer it (now or later) with ``respond``/``respond_error``."""
        ...

    async def on_notification(self, conn: Connection, method: str, params: Params) -> None: ...

    def on_closed(self, conn: Connection, reason: str, *, failed: bool) -> None:
        """The connection ended (``failed``: it broke, not closed by us); called once."""
        ...


class Call:
    """One of our requests waiting for its response."""

    def __init__(self, method: str, on_done: Callable[[Call], None] | None = None) -> None:
        self.method = method
        self.on_done = on_done
        self.done = trio.Event()
        self.result: msgspec.Raw | None = None
        self.error: RpcError | None = None

    def resolve(self, *, result: msgspec.Raw | None = None, error: RpcError | None = None) -> None:
        self.result = result
        self.error = error
        self.done.set()
        if self.on_done is not None:
            self.on_done(self)


class Connection:
    """One agent process spoken to in JSON-RPC (see the module docstring)."""

    def __init__(
        self,
        proc: trio.Process,
        *,
        label: str,
        handler: RpcHandler,
        group: bool = False,
        tag: str | None = None,
    ) -> None:
        self.proc = proc
        #: The process leads its own process group (started with ``start_new_session``):
        #: the whole group is ended with it, so no child outlives the agent.
        self.group = group
        #: The ``DSHIM_AGENT_RUN`` value of its environment (:mod:`.procs`): the processes
        #: it started in sessions of their own are ended with it too.
        self.tag = tag

        self.label = label
        self.alive = True
        self.failure: str | None = None
        self._handler = handler
        self._closed_reported = False
        self._next_id = 0
        self._calls: dict[int, Call] = {}
        self._abandoned: collections.deque[int] = collections.deque(maxlen=ABANDONED_IDS)
        self._write_lock = trio.Lock()
        self._scope = trio.CancelScope()
        self.stopped = trio.Event()
        self.exit_status: int | None = None

    # -- lifetime ----------------------------------------------------------------------

    def _release(self, reason: str, *, failed: bool) -> None:
        """Mark the connection dead, release every pending call, tell the handler once."""
        self.alive = False
        self.failure = reason
        calls = list(self._calls.values())
        self._calls.clear()
        for call in calls:
            call.resolve(error=RpcError(code=CONNECTION_LOST, message=reason))
        if not self._closed_reported:
            self._closed_reported = True
            self._handler.on_closed(self, reason, failed=failed)

    def fail(self, reason: str) -> None:
        """The connection broke: release everything and kill the process (idempotent)."""
        if not self.alive:
            return
        log.warning("agent_failed", reason=reason, pid=self.proc.pid)
        self._signal_group(signal.SIGTERM)
        if self.proc.returncode is None:
            try:
                self.proc.kill()
            except OSError:  # already gone
                pass
        self._release(reason, failed=True)

    def _signal_group(self, sig: int) -> bool:
        """Signal the agent's process group; False when it has no member left."""
        if not self.group:
            return False
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        except PermissionError:  # the group id was reused by someone else's processes
            return False
        return True

    async def _end_group(self) -> None:
        """TERM the agent's process group (its CLIs, tool subprocesses) and the processes
        it started outside the group (:mod:`.procs`), KILL what stays."""
        # By the tag: the agent is gone by now and its tools were re-parented (a /proc
        # scan of the tree before the kill would block the trio thread in ``fail``).
        strays: set[int] = set()
        if self.tag is not None:
            strays = await trio.to_thread.run_sync(procs.strays, self.proc.pid, self.tag)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._end_own_group)
            nursery.start_soon(functools.partial(procs.end, strays, why="the agent ended"))

    async def _end_own_group(self) -> None:
        if not self._signal_group(signal.SIGTERM):
            return
        with trio.move_on_after(GROUP_TERM_S):
            # The OS offers no event for "a process group emptied": poll it.
            # The /proc scan runs off the trio thread (it reads every process's stat file).
            while self._signal_group(0) and await trio.to_thread.run_sync(  # noqa: ASYNC110
                _group_has_live_members, self.proc.pid
            ):
                await trio.sleep(0.05)
            return
        if self._signal_group(signal.SIGKILL):
            log.warning("agent_group_killed", pid=self.proc.pid)

    async def service(self) -> None:
        """The reader task: stdout and stderr until the process ends or :meth:`close`.

        It is started from whatever turn first needed the agent; that turn's log context
        is dropped here (the handler binds the turn of each event itself).
        """
        structlog.contextvars.unbind_contextvars("turn", "conversation", "message_id")
        try:
            with self._scope:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._read_stderr)
                    nursery.start_soon(self._watch_exit, nursery.cancel_scope)
                    await self._read_stdout()
                    # stdout is done; give stderr a moment to drain its last lines.
                    nursery.cancel_scope.deadline = min(
                        nursery.cancel_scope.deadline, trio.current_time() + CLOSE_TIMEOUT_S
                    )
        except Exception as exc:  # a reader bug fails this agent, not the bot
            log.exception("agent_reader_crashed")
            self.fail(f"dshim's agent reader failed: {type(exc).__name__}")
        finally:
            self.fail(self._exit_reason())
            with trio.CancelScope(shield=True):
                with trio.move_on_after(CLOSE_TIMEOUT_S):
                    self.exit_status = await self.proc.wait()
                await self._end_group()
            self.stopped.set()

    async def _watch_exit(self, readers: trio.CancelScope) -> None:
        """The process exited: its pipes may stay open (a child inherited them), so the
        readers get a moment to drain what was written, then stop."""
        await self.proc.wait()
        readers.deadline = min(readers.deadline, trio.current_time() + CLOSE_TIMEOUT_S)

    def _exit_reason(self) -> str:
        code = self.proc.returncode
        if code is None:
            return "the agent process stopped answering"
        if code < 0:
            return f"the agent process was killed by signal {-code}{_signal_name(-code)}"
        return f"the agent process exited unexpectedly (exit status {code})"

    async def close(self) -> None:
        """Stop the process: close stdin (agents exit on EOF), then terminate, then kill."""
        if self.alive:
            self._release("dshim is shutting down", failed=False)
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

    def _gone(self) -> HarnessError:
        return HarnessError(self.failure or "the agent process is not running", code="agent-exited")

    async def _write(self, message: dict[str, Any]) -> None:
        if not self.alive:
            raise self._gone()
        data = ENCODER.encode(message) + b"\n"
        assert self.proc.stdin is not None
        try:
            async with self._write_lock:
                await self.proc.stdin.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError) as exc:
            self.fail("the agent process closed its input")
            raise self._gone() from exc

    async def start_call(
        self, method: str, params: dict[str, Any], on_done: Callable[[Call], None] | None = None
    ) -> tuple[int, Call]:
        """Send a request; ``on_done`` runs (on the reader's task) when it is answered."""
        self._next_id += 1
        rid = self._next_id
        call = Call(method, on_done)
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

    async def wait_call(self, rid: int, call: Call, *, deadline: float) -> msgspec.Raw:
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

    async def respond(self, rid: RequestId, result: dict[str, Any]) -> None:
        await self._write({"jsonrpc": "2.0", "id": rid, "result": result})

    async def respond_quietly(self, rid: RequestId, result: dict[str, Any]) -> None:
        """Answer an agent request; a dead process is not an error here."""
        try:
            await self.respond(rid, result)
        except HarnessError:
            log.info("agent_reply_dropped", reason=self.failure)

    async def respond_error(self, rid: RequestId, code: int, message: str) -> None:
        try:
            await self._write(
                {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": message}}
            )
        except HarnessError:
            pass

    # -- reading -----------------------------------------------------------------------

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

    async def _handle_line(self, line: bytes) -> None:
        try:
            env = ENVELOPE.decode(line)
        except msgspec.DecodeError:
            log.warning("agent_sent_malformed_line", sample=line[:120].decode("utf-8", "replace"))
            self.fail("the agent sent a malformed message (not JSON-RPC)")
            return
        has_id = env.id is not msgspec.UNSET and env.id is not None
        if isinstance(env.method, str):
            if has_id:
                assert not isinstance(env.id, msgspec.UnsetType) and env.id is not None
                await self._handler.on_request(self, env.id, env.method, env.params)
            else:
                await self._handler.on_notification(self, env.method, env.params)
            return
        if has_id and (env.result is not msgspec.UNSET or env.error is not msgspec.UNSET):
            self._on_response(env)
            return
        log.warning("agent_sent_malformed_line", sample=line[:120].decode("utf-8", "replace"))
        self.fail("the agent sent a malformed message (neither request, response nor notification)")

    def _on_response(self, env: Envelope) -> None:
        rid = env.id
        call = self._calls.pop(rid, None) if isinstance(rid, int) else None
        if call is None:
            if isinstance(rid, int) and rid in self._abandoned:
                return  # a late answer to a request we gave up on
            self.fail(f"the agent answered a request dshim never sent (id {rid!r})")
            return
        if isinstance(env.error, RpcError):
            call.resolve(error=env.error)
        elif isinstance(env.result, msgspec.Raw):
            call.resolve(result=env.result)
        else:
            call.resolve(error=RpcError(code=-32603, message="empty error"))


def _signal_name(number: int) -> str:
    """`` (SIGKILL)`` for 9; empty for a number this system does not name."""
    try:
        return f" ({signal.Signals(number).name})"
    except ValueError:
        return ""
