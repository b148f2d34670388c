"""A fake DSH agent host: the HTTP RPC, the events mux websocket and ``/api/respond``.

One port on 127.0.0.1 serves ``POST /api/<method>`` (``{type:"client-request", rpcId,
method, payload}`` -> ``{type:"server-response", rpcId, result}``), ``POST /api/respond``
and the websocket ``GET /api/events.mux``, like the real host.  Sessions are scripted by
the text of the prompt's first text block's last line (dshim puts the user's text last):

====================  =====================================================================
``dsh:slow N``        N text chunks ``chunk i`` one second apart; ``session.cancel`` ends the
                      turn ``interrupted``; a steer prompt shows up as ``[steer] <text>``
``dsh:tool NAME``     ``tool/call`` then ``tool/result``, then ``tool NAME done``
``dsh:approve``       ``approval/requested`` (tool ``shell``); answers ``approval: <outcome>``
``dsh:ask``           ``question/requested`` (one single-select question, colours); answers
                      ``answer: <labels>`` or ``question: cancelled``
``dsh:ask2``          two questions in one request
``dsh:crash``         one chunk, then ``turn/end {kind:"error", error:{code:"SERVER"}}``
``dsh:hang``          one chunk, then ignores ``session.cancel``
anything else         a reasoning delta ``thinking``, then ``echo: <text>`` in chunks of 16
                      characters, prefixed ``[<model>] `` when another model was selected;
                      images are reported as ``image <mediaType> <bytes> bytes``
====================  =====================================================================

Knobs: ``token`` (require ``Authorization: Bearer``), ``forbidden`` (403 ``forbidden``),
``old`` (404 for every API), ``mux_enabled`` (False: the websocket upgrade gets 404),
``images_refused`` (a prompt with images answers ``attachment-error``),
``down`` (drop every connection unanswered), and the :class:`FakePlatform` faults keyed
by method name (``session.prompt`` ...).  :meth:`FakeDsh.seed_answer` writes a completed
turn into a session's history (for quote recovery); :meth:`FakeDsh.resolve_elsewhere`
answers a pending approval or question as another client would.
"""

from __future__ import annotations

import base64
import functools
import json
import re
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, cast

import trio
import trio.lowlevel
from trio_websocket import ConnectionClosed, WebSocketConnection, wrap_server_stream

from dshim.testing.fakes import http as fake_http
from dshim.testing.fakes.base import FakePlatform, open_servers
from dshim.testing.fakes.http import DropConnection, Request, Response, json_response

__all__ = ["VERSION", "FakeDsh", "RpcCall", "open_fake_dsh"]

VERSION = "0.42.1"
MODELS = [("deepseek", "deepseek-chat"), ("deepseek", "deepseek-reasoner")]
CHUNK = 16
HEAD_MAX = 64 * 1024


@dataclass
class RpcCall:
    """One request dshim made: ``method`` is the RPC method, ``respond`` or ``events.mux``."""

    method: str
    payload: Any
    status: int
    at: float
    rpc_id: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class _Turn:
    number: int
    rpc_id: str
    text: str
    images: list[dict[str, Any]]
    cancel: trio.Event = field(default_factory=trio.Event)
    steers: list[str] = field(default_factory=list)
    steered: trio.Event = field(default_factory=trio.Event)


@dataclass
class _Session:
    id: str
    workspace_id: str
    title: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    turns: int = 0
    running: _Turn | None = None
    queue: list[_Turn] = field(default_factory=list)
    model: tuple[str, str] = MODELS[0]
    wake: trio.Event = field(default_factory=trio.Event)


@dataclass
class _Pending:
    rpc_id: str
    session_id: str
    kind: str  # "approval" | "question"
    approval_id: str | None
    questions: list[dict[str, Any]]
    done: trio.Event = field(default_factory=trio.Event)
    result: Any = None
    request: dict[str, Any] = field(default_factory=dict)


class _Prefixed(trio.abc.Stream):
    """A stream whose first bytes were already read (the request head)."""

    def __init__(self, stream: trio.SocketStream, prefix: bytes) -> None:
        self._stream = stream
        self._prefix = prefix

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        if self._prefix:
            n = max_bytes or len(self._prefix)
            data, self._prefix = self._prefix[:n], self._prefix[n:]
            await trio.lowlevel.checkpoint()
            return data
        return await self._stream.receive_some(max_bytes)

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def send_eof(self) -> None:
        await self._stream.send_eof()

    async def aclose(self) -> None:
        await self._stream.aclose()


class FakeDsh(FakePlatform[RpcCall]):
    """The scripted host.  Start it with :func:`open_fake_dsh`."""

    def __init__(self, *, clock: Callable[[], float] | None = None, slow_s: float = 1.0) -> None:
        super().__init__()
        self.clock = clock
        self.slow_s = slow_s
        self.token: str | None = None
        self.forbidden = False
        self.old = False
        self.down = False
        self.mux_enabled = True
        #: session.prompt with images answers attachment-error (a text-only model).
        self.images_refused = False
        self.url = ""
        self.workspaces: dict[str, str] = {}
        self.sessions: dict[str, _Session] = {}
        self.pending: dict[str, _Pending] = {}
        self.mux: list[trio.MemorySendChannel[str]] = []
        self.mux_opened = 0
        self._counter = 0
        self._nursery: trio.Nursery | None = None

    # -- helpers for tests ------------------------------------------------------------------

    def calls_to(self, *methods: str) -> list[RpcCall]:
        return [c for c in self.calls if c.method in methods]

    def _now(self) -> float:
        return self.clock() if self.clock is not None else trio.current_time()

    def _id(self, prefix: str) -> str:
        self._counter += 1
        return f"{prefix}-{self._counter}"

    def add_workspace(self, path: str) -> str:
        wid = self._id("ws")
        self.workspaces[wid] = path
        return wid

    def seed_answer(self, session_id: str, question: str, answer: str, *, at: float) -> None:
        """A completed turn (asked in another client) in the session's history."""
        s = self.sessions[session_id]
        s.turns += 1
        n = s.turns
        rpc = self._id("web")
        self._event(s, "turn/start", {"turn": n}, at=at)
        self._event(
            s,
            "user/message",
            {"turn": n, "source": {"rpcId": rpc, "kind": "user"}, "content": _text(question)},
            at=at,
        )
        self._event(
            s,
            "assistant/message",
            {"turn": n, "step": 0, "message": {"content": _text(answer)}},
            at=at,
        )
        self._event(s, "turn/end", {"turn": n, "reason": "completed"}, at=at)

    def resolve_elsewhere(self, rpc_id: str, outcome: str = "allowed-once") -> None:
        """Another client answers the pending interaction ``rpc_id``."""
        p = self.pending.pop(rpc_id)
        p.result = {"outcome": outcome, "elsewhere": True}
        p.done.set()
        if p.kind == "approval":
            self._push(
                None,
                {
                    "type": "approval/resolved",
                    "sessionId": p.session_id,
                    "approvalId": p.approval_id,
                    "outcome": outcome,
                },
            )
        else:
            self._push(
                None,
                {
                    "type": "question/resolved",
                    "sessionId": p.session_id,
                    "questionRpcId": rpc_id,
                    "outcome": "answered",
                },
            )

    def prompts(self, mode: str | None = None) -> list[dict[str, Any]]:
        """The payloads of ``session.prompt`` calls (of one mode)."""
        return [
            c.payload
            for c in self.calls_to("session.prompt")
            if c.status == 200 and (mode is None or c.payload.get("mode") == mode)
        ]

    def answers(self, session_id: str) -> list[str]:
        """Final assistant texts of the session's completed turns, oldest first."""
        s = self.sessions[session_id]
        out = []
        last: dict[int, str] = {}
        for e in s.events:
            if e["type"] == "assistant/message":
                last[e["data"]["turn"]] = "".join(
                    b["text"] for b in e["data"]["message"]["content"]
                )
            elif e["type"] == "turn/end" and e["data"]["turn"] in last:
                out.append(last[e["data"]["turn"]])
        return out

    # -- events -----------------------------------------------------------------------------

    def _event(
        self, s: _Session, kind: str, data: dict[str, Any], *, at: float | None = None
    ) -> None:
        seq = len(s.events) + 1
        when = at if at is not None else self._now()
        event = {"seq": seq, "type": kind, "time": int(when * 1000), "data": data}
        s.events.append(event)
        self._push(None, {"type": "session/event", "sessionId": s.id, "event": event})
        self.changed()

    def _push(self, rpc_id: str | None, payload: dict[str, Any]) -> None:
        frame = json.dumps(
            {
                "type": "server-request",
                "rpcId": rpc_id or self._id("evt"),
                "method": payload["type"],
                "payload": payload,
            }
        )
        for send in list(self.mux):
            try:
                send.send_nowait(frame)
            except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
                self.mux.remove(send)

    # -- HTTP -------------------------------------------------------------------------------

    async def handle(self, request: Request) -> Response:
        if self.down:
            raise DropConnection("down")
        name = request.path.removeprefix("/api/")
        headers = {k: v for k, v in request.headers if k in ("authorization", "content-type")}
        try:
            body = request.json() if request.body else {}
        except ValueError:
            body = None
        payload = body.get("payload") if isinstance(body, dict) else None
        rpc_id = body.get("rpcId") if isinstance(body, dict) else None
        call = RpcCall(name, payload, 0, self._now(), rpc_id=rpc_id, headers=headers)
        response = await self._answer(request, name, body, call)
        call.status = response.status
        self.record(call)
        return response

    def _gate(self, request: Request) -> Response | None:
        if self.token is not None and request.header("authorization") != f"Bearer {self.token}":
            return Response(401, b"unauthorized")
        if self.forbidden:
            return Response(403, b"forbidden")
        if self.old:
            return Response(404, b"not found")
        return None

    async def _answer(self, request: Request, name: str, body: Any, call: RpcCall) -> Response:
        refused = self._gate(request)
        if refused is not None:
            return refused
        if request.method != "POST":
            return Response(405, b"method not allowed")
        fault = await self.faults_for(name)
        if fault is not None:
            return Response(fault.status, (fault.description or "fault").encode())
        if name == "respond":
            return json_response(self._respond(body))
        if not isinstance(body, dict) or body.get("type") != "client-request":
            return Response(400, b"bad request")
        method = body.get("method")
        payload = body.get("payload")
        if method != name or not isinstance(payload, dict):
            return Response(400, b"bad request")
        try:
            value = self._method(name, payload, str(body.get("rpcId")))
        except _RpcFailure as exc:
            result: dict[str, Any] = {
                "ok": False,
                "error": {"code": exc.code, "message": exc.message, "details": {}},
            }
        else:
            if value is _MISSING:
                return Response(404, b"not found")
            result = {"ok": True, "value": value}
        return json_response({"type": "server-response", "rpcId": body["rpcId"], "result": result})

    def _session(self, payload: dict[str, Any]) -> _Session:
        s = self.sessions.get(str(payload.get("sessionId")))
        if s is None:
            raise _RpcFailure("session-not-found", "no such session")
        return s

    def _method(self, name: str, p: dict[str, Any], rpc_id: str) -> Any:
        if name == "host.describe":
            return {"version": VERSION, "ready": True, "transport": "http"}
        if name == "workspace.list":
            return {
                "items": [
                    {
                        "workspaceId": wid,
                        "path": path,
                        "sessionIds": [
                            s.id for s in self.sessions.values() if s.workspace_id == wid
                        ],
                    }
                    for wid, path in self.workspaces.items()
                ],
                "archivedSessionIds": [],
            }
        if name == "workspace.create":
            path = p.get("path")
            if not isinstance(path, str) or not path.startswith("/"):
                raise _RpcFailure("workspace-invalid", "path must be absolute")
            return {"workspace": {"workspaceId": self.add_workspace(path)}}
        if name == "session.create":
            wid = p.get("workspaceId")
            if wid not in self.workspaces:
                raise _RpcFailure("workspace-not-found", "no such workspace")
            preset = p.get("agentPreset")
            if preset is not None and preset != "default":
                raise _RpcFailure("agent-preset-not-found", f"no preset {preset}")
            sid = "sess-" + uuid.uuid4().hex[:8]
            self.sessions[sid] = _Session(sid, str(wid))
            return {"sessionId": sid}
        if name == "session.rename":
            s = self._session(p)
            s.title = str(p.get("title"))
            return {"title": s.title, "seq": len(s.events)}
        if name == "session.list":
            return {
                "items": [
                    {
                        "sessionId": s.id,
                        "running": s.running is not None,
                        "cwd": self.workspaces.get(s.workspace_id),
                        "projections": {"values": {"title": s.title}},
                    }
                    for s in self.sessions.values()
                ]
            }
        if name == "session.prompt":
            return self._prompt(self._session(p), p, rpc_id)
        if name == "session.history":
            return self._history(self._session(p), p)
        if name == "session.cancel":
            s = self._session(p)
            if s.running is not None:
                s.running.cancel.set()
            if not p.get("keepInbox"):
                s.queue.clear()
            return {}
        if name == "session.models":
            s = self._session(p)
            return {
                "current": {"provider": s.model[0], "model": s.model[1]},
                "routable": True,
                "groups": _groups(),
                "failures": [],
            }
        if name == "session.selectModel":
            s = self._session(p)
            wanted = (p.get("provider"), p.get("model"))
            if wanted not in MODELS:
                raise _RpcFailure("model-unavailable", f"unknown model {wanted[1]}")
            s.model = (str(wanted[0]), str(wanted[1]))
            return {"selected": {"provider": s.model[0], "model": s.model[1]}}
        if name == "llm.models":
            return {"groups": _groups(), "failures": []}
        return _MISSING

    def _history(self, s: _Session, p: dict[str, Any]) -> dict[str, Any]:
        limit = p.get("maxMessages")
        if not isinstance(limit, int) or limit < 1:
            raise _RpcFailure("invalid-params", "maxMessages must be a positive integer")
        before = p.get("beforeSeq")
        events = [e for e in s.events if before is None or e["seq"] < before]
        page = events[-limit:]
        return {
            "events": [{"event": e} for e in page],
            "hasMore": len(events) > len(page),
        }

    def _prompt(self, s: _Session, p: dict[str, Any], rpc_id: str) -> dict[str, Any]:
        mode = p.get("mode")
        content = p.get("content")
        if mode not in ("queue", "steer") or not isinstance(content, list) or not content:
            raise _RpcFailure("invalid-params", "mode and content are required")
        texts = [
            b.get("text", "") for b in content if isinstance(b, dict) and b.get("type") == "text"
        ]
        images = [b for b in content if isinstance(b, dict) and b.get("type") == "image"]
        if images and self.images_refused:
            raise _RpcFailure("attachment-error", "MODEL_DOES_NOT_SUPPORT_IMAGES")
        text = "\n".join(texts)
        if mode == "steer":
            if s.running is None:
                raise _RpcFailure("no-active-turn", "nothing is running to steer")
            s.running.steers.append(text)
            self._event(
                s,
                "user/message",
                {
                    "turn": s.running.number,
                    "source": {"rpcId": rpc_id, "kind": "steer"},
                    "content": content,
                },
            )
            s.running.steered.set()
            return {}
        s.turns += 1
        turn = _Turn(s.turns, rpc_id, text, images)
        s.queue.append(turn)
        s.wake.set()
        assert self._nursery is not None
        if s.running is None and len(s.queue) == 1:
            self._nursery.start_soon(self._run_session, s)
        return {}

    # -- scripted turns ---------------------------------------------------------------------

    async def _run_session(self, s: _Session) -> None:
        while s.queue:
            turn = s.queue.pop(0)
            s.running = turn
            try:
                await self._run_turn(s, turn)
            finally:
                s.running = None
                self.changed()

    async def _run_turn(self, s: _Session, t: _Turn) -> None:
        n = t.number
        self._event(s, "turn/start", {"turn": n})
        self._event(
            s,
            "user/message",
            {"turn": n, "source": {"rpcId": t.rpc_id, "kind": "user"}, "content": _text(t.text)},
        )
        line = t.text.strip().splitlines()[-1].strip() if t.text.strip() else ""
        parts: list[str] = []

        def chunk(piece: str, step: int = 0) -> None:
            parts.append(piece)
            self._event(
                s,
                "assistant/chunk",
                {
                    "turn": n,
                    "step": step,
                    "chunk": {"type": "text-delta", "index": 0, "text": piece},
                },
            )

        def end(reason: Any, step: int = 0) -> None:
            if parts:
                self._event(
                    s,
                    "assistant/message",
                    {"turn": n, "step": step, "message": {"content": _text("".join(parts))}},
                )
            self._event(s, "turn/end", {"turn": n, "reason": reason})

        m = re.match(r"^dsh:slow (\d+)$", line)
        if m:
            for i in range(int(m.group(1))):
                if i:
                    with trio.move_on_after(self.slow_s):
                        await t.cancel.wait()
                if t.cancel.is_set():
                    end("interrupted")
                    return
                while t.steers:
                    chunk(f"[steer] {t.steers.pop(0)} ")
                chunk(f"chunk {i} ")
            end("completed")
            return
        if line == "dsh:hang":
            chunk("working ")
            await trio.sleep_forever()
        if line == "dsh:crash":
            chunk("partial ")
            self._event(
                s,
                "turn/end",
                {
                    "turn": n,
                    "reason": {
                        "kind": "error",
                        "error": {"code": "SERVER", "message": "agent crashed"},
                    },
                },
            )
            return
        m = re.match(r"^dsh:tool (\S+)$", line)
        if m:
            tool = m.group(1)
            self._event(
                s, "tool/call", {"turn": n, "callId": "call-1", "name": tool, "arguments": "{}"}
            )
            self._event(s, "tool/result", {"turn": n, "callId": "call-1", "name": tool})
            chunk(f"tool {tool} done", step=1)
            end("completed", step=1)
            return
        if line == "dsh:approve":
            outcome = await self._interaction(s, "approval", [])
            chunk(f"approval: {outcome}")
            end("completed")
            return
        if line in ("dsh:ask", "dsh:ask2"):
            questions = [
                {
                    "id": "q1",
                    "question": "Which colour?",
                    "header": "Colour",
                    "options": [{"label": "Red"}, {"label": "Blue", "description": "the sky"}],
                    "multiSelect": False,
                }
            ]
            if line == "dsh:ask2":
                questions.append(
                    {
                        "id": "q2",
                        "question": "Which sizes?",
                        "options": [{"label": "S"}, {"label": "M"}, {"label": "L"}],
                        "multiSelect": True,
                    }
                )
            chunk(f"answer: {await self._interaction(s, 'question', questions)}")
            end("completed")
            return
        prefix = f"[{s.model[1]}] " if s.model != MODELS[0] else ""
        self._event(
            s,
            "assistant/chunk",
            {
                "turn": n,
                "step": 0,
                "chunk": {"type": "reasoning-delta", "index": 0, "text": "thinking"},
            },
        )
        reply = prefix + "echo: " + t.text
        for img in t.images:
            size = len(base64.b64decode(str(img.get("data", ""))))
            reply += f"\nimage {img.get('mediaType')} {size} bytes"
        for i in range(0, len(reply), CHUNK):
            chunk(reply[i : i + CHUNK])
            await trio.lowlevel.checkpoint()
        end("completed")

    async def _interaction(self, s: _Session, kind: str, questions: list[dict[str, Any]]) -> str:
        rpc = self._id(kind)
        approval_id = self._id("appr") if kind == "approval" else None
        p = _Pending(rpc, s.id, kind, approval_id, questions)
        self.pending[rpc] = p
        payload: dict[str, Any]
        if kind == "approval":
            self._event(
                s,
                "tool/call",
                {
                    "turn": s.turns,
                    "callId": "call-x",
                    "name": "shell",
                    "arguments": '{"command": "ls -la"}',
                },
            )
            payload = {
                "type": "approval/requested",
                "sessionId": s.id,
                "approvalId": approval_id,
                "toolName": "shell",
                "callId": "call-x",
                "reason": "run `ls -la`",
            }
        else:
            payload = {"type": "question/requested", "sessionId": s.id, "questions": questions}
        p.request = payload  # replayed on a mux reconnect until answered
        self._push(rpc, payload)
        self.changed()
        cancel = s.running.cancel if s.running is not None else trio.Event()
        async with trio.open_nursery() as nursery:

            async def on_cancel() -> None:
                await cancel.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(on_cancel)
            await p.done.wait()
            nursery.cancel_scope.cancel()
        self.pending.pop(rpc, None)
        result: dict[str, Any] = p.result if p.done.is_set() else {"outcome": "cancelled"}
        if kind == "approval":
            if not result.get("elsewhere"):
                self._push(
                    None,
                    {
                        "type": "approval/resolved",
                        "sessionId": s.id,
                        "approvalId": approval_id,
                        "outcome": result.get("outcome"),
                    },
                )
            return str(result.get("outcome"))
        if not result.get("elsewhere"):
            self._push(
                None,
                {
                    "type": "question/resolved",
                    "sessionId": s.id,
                    "questionRpcId": rpc,
                    "outcome": "cancelled" if result.get("cancelled") else "answered",
                },
            )
        if result.get("cancelled") or result.get("outcome") == "cancelled":
            return "cancelled"
        if result.get("elsewhere"):
            return "answered elsewhere"
        return "; ".join(
            ",".join(a.get("selected", [])) + (f" ({a['custom']})" if a.get("custom") else "")
            for a in result["answers"]
        )

    def _respond(self, body: Any) -> dict[str, Any]:
        if not isinstance(body, dict) or body.get("type") != "client-response":
            return {"accepted": False, "reason": "bad-response"}
        p = self.pending.get(str(body.get("rpcId")))
        if p is None or p.done.is_set():
            return {"accepted": False, "reason": "not-pending"}
        result = body.get("result")
        if not isinstance(result, dict):
            return {"accepted": False, "reason": "bad-response"}
        if result.get("ok") is False:
            error = result.get("error")
            if isinstance(error, dict) and error.get("code") == "cancelled":
                p.result = {"cancelled": True, "outcome": "cancelled"}
                p.done.set()
                return {"accepted": True}
            return {"accepted": False, "reason": "bad-response"}
        value = result.get("value")
        if not isinstance(value, dict) or value.get("sessionId") != p.session_id:
            return {"accepted": False, "reason": "bad-response"}
        if p.kind == "approval":
            if value.get("approvalId") != p.approval_id or value.get("outcome") not in (
                "allowed-once",
                "rejected",
            ):
                return {"accepted": False, "reason": "bad-response"}
            p.result = {"outcome": value["outcome"]}
        else:
            answers = (value.get("answer") or {}).get("answers")
            if not _valid_answers(answers, p.questions):
                return {"accepted": False, "reason": "bad-response"}
            p.result = {"answers": answers}
        p.done.set()
        return {"accepted": True}

    # -- the mux ----------------------------------------------------------------------------

    async def serve_connection(self, stream: trio.SocketStream) -> None:
        head = b""
        try:
            while b"\r\n\r\n" not in head and len(head) < HEAD_MAX:
                data = await stream.receive_some(HEAD_MAX)
                if not data:
                    await stream.aclose()
                    return
                head += data
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return
        first, _, rest = head.partition(b"\r\n")
        lower = rest.split(b"\r\n\r\n", 1)[0].lower()
        prefixed = _Prefixed(stream, head)
        if b"upgrade: websocket" in lower and b"/api/events.mux" in first:
            await self._mux(prefixed, head)
            return
        server = fake_http.HttpServer(0)
        await fake_http._serve_connection(  # noqa: SLF001 - same package, shared HTTP core
            cast(trio.SocketStream, prefixed), self.handle, server, fake_http.MAX_BODY
        )

    async def _mux(self, stream: _Prefixed, head: bytes) -> None:
        headers = {
            k.strip().lower(): v.strip()
            for k, _, v in (
                line.decode("latin-1").partition(":")
                for line in head.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]
            )
        }
        call = RpcCall(
            "events.mux",
            None,
            101,
            self._now(),
            headers={k: v for k, v in headers.items() if k == "authorization"},
        )
        async with trio.open_nursery() as nursery:
            request = await wrap_server_stream(nursery, stream)
            refused = None
            if self.down:
                await stream.aclose()
                return
            if self.token is not None and headers.get("authorization") != f"Bearer {self.token}":
                refused = 401
            elif not self.mux_enabled or self.old:
                refused = 404
            if refused is not None:
                call.status = refused
                self.record(call)
                await request.reject(refused)
                return
            ws = await request.accept()
            self.record(call)
            self.mux_opened += 1
            send, recv = trio.open_memory_channel[str](4096)
            self.mux.append(send)
            for p in list(self.pending.values()):  # the host replays pending interactions
                if not p.done.is_set():
                    await send.send(
                        json.dumps(
                            {
                                "type": "server-request",
                                "rpcId": p.rpc_id,
                                "method": p.request["type"],
                                "payload": p.request,
                            }
                        )
                    )
            self.changed()
            try:
                await self._pump(ws, recv)
            finally:
                if send in self.mux:
                    self.mux.remove(send)
                self.changed()
                nursery.cancel_scope.cancel()

    async def _pump(self, ws: WebSocketConnection, recv: trio.MemoryReceiveChannel[str]) -> None:
        async with trio.open_nursery() as nursery:

            async def drain() -> None:
                try:
                    while True:
                        await ws.get_message()  # receive-only: frames from dshim are ignored
                except ConnectionClosed:
                    nursery.cancel_scope.cancel()

            nursery.start_soon(drain)
            try:
                async for frame in recv:
                    await ws.send_message(frame)
            except ConnectionClosed:
                pass
            nursery.cancel_scope.cancel()

    async def close_mux(self) -> None:
        """Cut every mux connection (the client sees the socket go away)."""
        for send in list(self.mux):
            await send.aclose()
        self.mux.clear()
        self.changed()


class _RpcFailure(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


_MISSING = object()


def _text(text: str) -> list[dict[str, Any]]:
    return [{"type": "text", "text": text}]


def _groups() -> list[dict[str, Any]]:
    return [
        {
            "id": "deepseek",
            "name": "DeepSeek",
            "models": [{"id": m, "name": m.replace("-", " ").title()} for _, m in MODELS],
        }
    ]


def _valid_answers(answers: Any, questions: list[dict[str, Any]]) -> bool:
    if not isinstance(answers, list) or len(answers) != len(questions):
        return False
    for answer, q in zip(answers, questions, strict=True):
        if not isinstance(answer, dict) or answer.get("id") != q["id"]:
            return False
        selected = answer.get("selected")
        labels = {o["label"] for o in q.get("options", [])}
        if not isinstance(selected, list) or not all(x in labels for x in selected):
            return False
        custom = answer.get("custom")
        if custom is not None and (not isinstance(custom, str) or not custom):
            return False
        if not q.get("multiSelect") and len(selected) + (1 if custom else 0) > 1:
            return False
        if not selected and not custom:
            return False
    return True


async def _serve(fake: FakeDsh, task_status: trio.TaskStatus[FakeDsh]) -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    fake.url = f"http://127.0.0.1:{port}"
    async with trio.open_nursery() as nursery:
        fake._nursery = nursery  # noqa: SLF001 - the fake's own turn tasks
        await nursery.start(trio.serve_listeners, fake.serve_connection, listeners)
        task_status.started(fake)


@asynccontextmanager
async def open_fake_dsh(
    *, clock: Callable[[], float] | None = None, slow_s: float = 1.0
) -> AsyncIterator[FakeDsh]:
    """Run a fake DSH host on 127.0.0.1 (port 0) for the duration of the block."""
    fake = FakeDsh(clock=clock, slow_s=slow_s)
    async with open_servers(functools.partial(_serve, fake)):
        yield fake
