"""A scripted ACP v1 agent, run as a subprocess: ``python -m dshim.testing.fakes.acp_agent``.

It speaks the real wire format (JSON-RPC 2.0, one message per line on stdio) so the
adapter's spawn, framing, EOF and restart paths are exercised for real.  Behaviour is
chosen by the user's text: the first text block of a prompt after dshim's leading
blocks (``<dsh_im_source>``, ``<dsh_im_reply_to>`` ...; what follows it -- inlined files,
notes, the ``<dsh_im_files>`` block -- is not a command):

====================  =====================================================================
``/slow N [ms]``      N message chunks ``chunk i``, ``ms`` (default 100) apart; a
                      ``session/cancel`` ends the turn with ``stopReason: cancelled``;
                      ``_session/steering`` text shows up as ``[steer] <text>`` in the stream
``/hang``             streams one chunk, then ignores ``session/cancel`` (never answers)
``/escape [crash]``   starts ``sleep`` in a session of its own (outside the agent's group)
                      and reports ``escaped <pid>``; waits for ``session/cancel`` and
                      answers ``cancelled``, leaving the sleep running (or exits, status 3)
``/tool NAME [fail]`` ``tool_call`` pending -> ``tool_call_update`` in_progress -> completed
                      (or failed), then ``tool NAME done``
``/plan``             a three-entry ``plan``, updated twice, then ``plan done``
``/approve [TITLE]``  ``session/request_permission`` (allow once/always, reject once/always);
                      answers ``permission: <optionId>`` or ``permission: cancelled``
``/approve-crash``    asks permission, then exits (status 4) before any answer
``/approve-withdraw`` asks permission, then withdraws it with ``$/cancel_request`` and
                      reports the error code it got back (``withdrawn: error -32800``)
``/ask``              ``elicitation/create`` (form: one single-select ``colour``); answers
                      ``answers: {...}`` or ``elicitation: <action>``
``/ask3``             a form with single-select, multi-select and free-text fields
``/clientreq``        sends ``fs/read_text_file`` to the client, reports the answer
``/error CODE``       answers the prompt with JSON-RPC error CODE
``/refuse``           ``stopReason: refusal``;  ``/maxtokens``: ``max_tokens``
``/crash [kill]``     one chunk, then the process exits with status 3 (``kill``: SIGKILLs
                      itself)
``/child [crash]``    starts a child process (``sleep``) in the agent's process group and
                      reports ``child <pid>``; then hangs (or exits with status 3)
``/recall``           ``recall: <earlier prompts of this session, joined by " | ">`` (kept
                      across ``session/close`` + ``session/resume``)
``/mode``             ``mode: <the session's current mode>``
``/status``           ``agent status: fine`` (an agent command dshim's /status shadows);
                      like ``/compact`` (``compacted``), an advertised command: it counts
                      only as the prompt's first block, as real agents read commands
``/garbage``          one chunk, then a line that is not JSON
``/unknown-id``       one chunk, then a response to a request id the client never sent
anything else         a thought ``thinking about: ...`` then ``echo: <text>`` in chunks,
                      prefixed ``[<model>]`` when a non-default model is selected; image
                      blocks are reported as ``image <mime> <bytes> bytes``, resource
                      links as ``file <name> <mimeType> <size> bytes, <n> on disk`` (``n``:
                      what the ``file://`` URI holds, ``-`` when it cannot be read)
====================  =====================================================================

Flags turn capabilities off so "unsupported" branches can be tested: ``--no-image``,
``--no-load`` (neither load nor resume), ``--load-only`` (load, no resume),
``--no-steer``, ``--no-close``, ``--models config|legacy|none``, ``--protocol-version N``;
``--auth-required`` answers ``session/new`` with -32000 and advertises ``authMethods``.
``--journal FILE`` appends every message the agent receives, one JSON object per line;
``--sessions-file FILE`` holds the ids of the open sessions (rewritten on every change).
Sessions offer the modes ``auto`` (the default), ``ask`` and ``plan`` (a ``mode`` config
option), and the agent advertises the commands ``status`` and ``compact``
(``available_commands_update`` after ``session/new``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from typing import Any

import trio

#: The commands the agent advertises (``available_commands_update``): name -> description.
ADVERTISED = {"status": "Show the agent's own status", "compact": "Compact the conversation"}
DEFAULT_MODEL = "fake-small"
MODELS = [("fake-small", "Fake Small"), ("fake-large", "Fake Large")]


class _Prompt:
    def __init__(self) -> None:
        self.cancelled = trio.Event()
        self.steers: list[str] = []


class FakeAgent:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = trio.lowlevel.FdStream(os.dup(1))
        self.inp = trio.lowlevel.FdStream(os.dup(0))
        self.write_lock = trio.Lock()
        self.sessions: dict[str, dict[str, Any]] = {}
        #: Histories of closed sessions, restored by session/resume or load.
        self.closed: dict[str, list[str]] = {}
        self.active: dict[str, _Prompt] = {}
        self.waiting: dict[int, trio.Event] = {}
        self.answers: dict[int, dict[str, Any]] = {}
        self.next_id = 1000
        self.counter = 0
        self.client_caps: dict[str, Any] = {}
        self.journal = open(args.journal, "a", encoding="utf-8") if args.journal else None  # noqa: SIM115

    # -- wire ------------------------------------------------------------------------------

    async def send(self, message: dict[str, Any]) -> None:
        data = json.dumps({"jsonrpc": "2.0", **message}, separators=(",", ":")).encode() + b"\n"
        async with self.write_lock:
            await self.out.send_all(data)

    async def send_raw(self, data: bytes) -> None:
        async with self.write_lock:
            await self.out.send_all(data)

    async def update(self, sid: str, update: dict[str, Any]) -> None:
        await self.send(
            {"method": "session/update", "params": {"sessionId": sid, "update": update}}
        )

    async def chunk(
        self, sid: str, text: str, *, kind: str = "agent_message_chunk", mid: str | None = None
    ) -> None:
        update: dict[str, Any] = {"sessionUpdate": kind, "content": {"type": "text", "text": text}}
        if mid is not None:
            update["messageId"] = mid
        await self.update(sid, update)

    async def ask_client(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        self.next_id += 1
        rid = self.next_id
        done = trio.Event()
        self.waiting[rid] = done
        await self.send({"id": rid, "method": method, "params": params})
        await done.wait()
        return self.answers.pop(rid)

    # -- main loop -------------------------------------------------------------------------

    async def run(self) -> None:
        buf = b""
        async with trio.open_nursery() as nursery:
            while True:
                data = await self.inp.receive_some(65536)
                if not data:
                    break
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if not line.strip():
                        continue
                    msg = json.loads(line)
                    if self.journal is not None:
                        self.journal.write(json.dumps(msg) + "\n")
                        self.journal.flush()
                    await self.dispatch(msg, nursery)
            nursery.cancel_scope.cancel()

    async def dispatch(self, msg: dict[str, Any], nursery: trio.Nursery) -> None:
        method = msg.get("method")
        rid = msg.get("id")
        params = msg.get("params") or {}
        if method is None:  # a response to one of our requests
            if rid in self.waiting:
                self.answers[rid] = msg
                self.waiting.pop(rid).set()
            return
        if rid is None:  # notification
            if method == "session/cancel":
                prompt = self.active.get(str(params.get("sessionId")))
                if prompt is not None:
                    prompt.cancelled.set()
            return
        handler = getattr(self, "on_" + method.replace("/", "_").lstrip("_"), None)
        if method == "session/prompt":
            nursery.start_soon(self.run_prompt, rid, params)
        elif handler is not None:
            await handler(rid, params)
        else:
            await self.send(
                {"id": rid, "error": {"code": -32601, "message": f"Method not found: {method}"}}
            )

    # -- lifecycle -------------------------------------------------------------------------

    async def on_initialize(self, rid: Any, params: dict[str, Any]) -> None:
        self.client_caps = params.get("clientCapabilities") or {}
        a = self.args
        session_caps: dict[str, Any] = {} if a.no_close else {"close": {}}
        if not a.no_load and not a.load_only:
            session_caps["resume"] = {}
        result: dict[str, Any] = {
            "protocolVersion": a.protocol_version,
            "agentCapabilities": {
                "loadSession": not a.no_load,
                "promptCapabilities": {"image": not a.no_image, "embeddedContext": True},
                "sessionCapabilities": session_caps,
            },
            "agentInfo": {"name": "fake-acp-agent", "title": "Fake ACP agent", "version": "1.0"},
            "authMethods": [
                {
                    "id": "fake-login",
                    "name": "Log in with Fake",
                    "description": "Run `fake-agent login` in a terminal",
                }
            ]
            if a.auth_required
            else [],
        }
        if not a.no_steer:
            result["_meta"] = {"steering": {"supported": True}}
        await self.send({"id": rid, "result": result})

    def session_result(self, sid: str) -> dict[str, Any]:
        model = self.sessions[sid]["model"]
        result: dict[str, Any] = {"sessionId": sid}
        if self.args.models == "config":
            result["configOptions"] = [
                {
                    "id": "model",
                    "name": "Model",
                    "category": "model",
                    "type": "select",
                    "currentValue": model,
                    "options": [
                        {
                            "group": "small",
                            "name": "Small",
                            "options": [{"value": MODELS[0][0], "name": MODELS[0][1]}],
                        },
                        {
                            "group": "large",
                            "name": "Large",
                            "options": [{"value": MODELS[1][0], "name": MODELS[1][1]}],
                        },
                    ],
                },
                {
                    "id": "mode",
                    "name": "Mode",
                    "category": "mode",
                    "type": "select",
                    "currentValue": self.sessions[sid].get("mode", "auto"),
                    "options": [
                        {"value": "auto", "name": "Auto (never asks)"},
                        {"value": "ask", "name": "Ask before tools"},
                        {"value": "plan", "name": "Plan only"},
                    ],
                },
            ]
        elif self.args.models == "legacy":
            result["models"] = {
                "currentModelId": model,
                "availableModels": [{"modelId": m, "name": n} for m, n in MODELS],
            }
        return result

    def open_session(self, sid: str, cwd: str) -> None:
        history = self.closed.pop(sid, [])
        self.sessions.setdefault(sid, {"model": DEFAULT_MODEL, "cwd": cwd, "history": history})
        self.save_sessions()

    def save_sessions(self) -> None:
        if self.args.sessions_file:  # atomically: a test may read it at any moment
            tmp = self.args.sessions_file + ".tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(sorted(self.sessions), f)
            os.replace(tmp, self.args.sessions_file)

    async def on_session_new(self, rid: Any, params: dict[str, Any]) -> None:
        if self.args.auth_required:
            await self.send(
                {"id": rid, "error": {"code": -32000, "message": "Authentication required"}}
            )
            return
        self.counter += 1
        sid = f"fake-{os.getpid()}-{self.counter}"
        self.open_session(sid, params.get("cwd", ""))
        await self.send({"id": rid, "result": self.session_result(sid)})
        await self.update(
            sid,
            {
                "sessionUpdate": "available_commands_update",
                "availableCommands": [
                    {"name": "status", "description": ADVERTISED["status"]},
                    {
                        "name": "compact",
                        "description": ADVERTISED["compact"],
                        "input": {"hint": "instructions"},
                    },
                ],
            },
        )

    async def on_session_load(self, rid: Any, params: dict[str, Any]) -> None:
        if self.args.no_load:
            await self.send({"id": rid, "error": {"code": -32601, "message": "Method not found"}})
            return
        sid = params["sessionId"]
        self.open_session(sid, params.get("cwd", ""))
        # load replays the history before answering; a client must not show it as new.
        await self.chunk(sid, "(replayed question)", kind="user_message_chunk")
        await self.chunk(sid, "(replayed answer)", mid="replay-1")
        result = self.session_result(sid)
        result.pop("sessionId")
        await self.send({"id": rid, "result": result})

    async def on_session_resume(self, rid: Any, params: dict[str, Any]) -> None:
        if self.args.no_load or self.args.load_only:
            await self.send({"id": rid, "error": {"code": -32601, "message": "Method not found"}})
            return
        sid = params["sessionId"]
        self.open_session(sid, params.get("cwd", ""))
        result = self.session_result(sid)
        result.pop("sessionId")
        await self.send({"id": rid, "result": result})

    async def on_session_close(self, rid: Any, params: dict[str, Any]) -> None:
        if self.args.no_close:
            await self.send({"id": rid, "error": {"code": -32601, "message": "Method not found"}})
            return
        sid = str(params.get("sessionId"))
        session = self.sessions.pop(sid, None)
        if session is not None:
            self.closed[sid] = session["history"]
        self.save_sessions()
        await self.send({"id": rid, "result": {}})

    async def on_session_set_config_option(self, rid: Any, params: dict[str, Any]) -> None:
        sid = params.get("sessionId")
        value = params.get("value")
        if params.get("configId") == "mode" and sid in self.sessions:
            if value not in ("auto", "ask", "plan"):
                await self.send({"id": rid, "error": {"code": -32602, "message": "Invalid mode"}})
                return
            self.sessions[sid]["mode"] = value
            await self.send(
                {"id": rid, "result": {"configOptions": self.session_result(sid)["configOptions"]}}
            )
            return
        if (
            self.args.models != "config"
            or sid not in self.sessions
            or params.get("configId") != "model"
            or value not in dict(MODELS)
        ):
            await self.send({"id": rid, "error": {"code": -32602, "message": "Invalid params"}})
            return
        self.sessions[sid]["model"] = value
        await self.send(
            {"id": rid, "result": {"configOptions": self.session_result(sid)["configOptions"]}}
        )

    async def on_session_set_model(self, rid: Any, params: dict[str, Any]) -> None:
        sid = params.get("sessionId")
        value = params.get("modelId")
        if self.args.models != "legacy" or sid not in self.sessions or value not in dict(MODELS):
            await self.send({"id": rid, "error": {"code": -32602, "message": "Invalid params"}})
            return
        self.sessions[sid]["model"] = value
        await self.send({"id": rid, "result": {}})

    async def on_session_steering(self, rid: Any, params: dict[str, Any]) -> None:
        if self.args.no_steer:
            await self.send({"id": rid, "error": {"code": -32601, "message": "Method not found"}})
            return
        prompt = self.active.get(str(params.get("sessionId")))
        texts = [b.get("text", "") for b in params.get("prompt", []) if b.get("type") == "text"]
        if prompt is not None:
            prompt.steers.append(" ".join(texts))
            await self.send({"id": rid, "result": {"outcome": "injected"}})
            return
        idle = ((params.get("_meta") or {}).get("steering") or {}).get("idleBehavior")
        await self.send(
            {
                "id": rid,
                "result": {
                    "outcome": "promptRequired" if idle == "promptRequired" else "startedNewTurn"
                },
            }
        )

    # -- turns -----------------------------------------------------------------------------

    async def run_prompt(self, rid: Any, params: dict[str, Any]) -> None:
        sid = params.get("sessionId")
        if sid not in self.sessions:
            await self.send(
                {"id": rid, "error": {"code": -32002, "message": f"Session not found: {sid}"}}
            )
            return
        prompt = _Prompt()
        self.active[sid] = prompt
        try:
            outcome = await self.script(sid, params.get("prompt") or [], prompt)
        finally:
            self.active.pop(sid, None)
        if isinstance(outcome, dict):
            await self.send({"id": rid, "error": outcome})
        else:
            await self.send({"id": rid, "result": {"stopReason": outcome}})

    async def script(
        self, sid: str, blocks: list[dict[str, Any]], prompt: _Prompt
    ) -> str | dict[str, Any]:
        texts = [b.get("text", "") for b in blocks if b.get("type") == "text"]
        users = [t for t in texts if not t.startswith("<dsh_im_")]
        current = users[0].strip() if users else ""
        words = current.split()
        command = words[0] if words and words[0].startswith("/") else ""
        if command[1:] in ADVERTISED:
            # Like codex-acp and claude-agent-acp: an advertised command counts only as
            # the prompt's first content block; after dshim's blocks it is plain text.
            first = blocks[0].get("text", "") if blocks and blocks[0].get("type") == "text" else ""
            if first.strip().split()[:1] != [command]:
                command = ""
        model = self.sessions[sid]["model"]
        prefix = f"[{model}] " if model != DEFAULT_MODEL else ""
        history: list[str] = self.sessions[sid]["history"]
        history.append(current)
        if command == "/recall":
            await self.chunk(sid, "recall: " + " | ".join(history[:-1]))
            return "end_turn"
        if command == "/mode":
            await self.chunk(sid, f"mode: {self.sessions[sid].get('mode', 'auto')}")
            return "end_turn"
        if command == "/status":
            await self.chunk(sid, "agent status: fine")
            return "end_turn"
        if command == "/compact":
            await self.chunk(sid, f"compacted: {' '.join(words[1:]) or '-'}")
            return "end_turn"
        if command == "/child":
            child = subprocess.Popen(["sleep", "600"])  # noqa: ASYNC220 - a test fixture
            await self.chunk(sid, f"child {child.pid} ")
            if "crash" in words[1:]:
                os._exit(3)
            await trio.sleep(3600)
            return "end_turn"
        if command == "/slow":
            n = int(words[1]) if len(words) > 1 else 10
            delay = (int(words[2]) if len(words) > 2 else 100) / 1000
            for i in range(n):
                if prompt.cancelled.is_set():
                    return "cancelled"
                while prompt.steers:
                    await self.chunk(sid, f"[steer] {prompt.steers.pop(0)} ")
                await self.chunk(sid, f"chunk {i + 1} ")
                with trio.move_on_after(delay):
                    await prompt.cancelled.wait()
            return "cancelled" if prompt.cancelled.is_set() else "end_turn"
        if command == "/escape":
            # A tool in a session of its own (as Claude's and Codex's adapters start them):
            # outside the agent's process group, left running when the turn is cancelled.
            child = subprocess.Popen(["sleep", "600"], start_new_session=True)  # noqa: ASYNC220
            await self.chunk(sid, f"escaped {child.pid} ")
            if "crash" in words[1:]:
                os._exit(3)
            await prompt.cancelled.wait()
            return "cancelled"
        if command == "/hang":
            await self.chunk(sid, "hanging ")
            await trio.sleep(3600)
            return "end_turn"
        if command == "/tool":
            name = words[1] if len(words) > 1 else "run tests"
            failed = "fail" in words[2:]
            await self.update(
                sid,
                {
                    "sessionUpdate": "tool_call",
                    "toolCallId": "call-1",
                    "title": name,
                    "kind": "execute",
                    "status": "pending",
                },
            )
            await self.update(
                sid,
                {
                    "sessionUpdate": "tool_call_update",
                    "toolCallId": "call-1",
                    "status": "in_progress",
                    "content": [
                        {"type": "content", "content": {"type": "text", "text": "working"}}
                    ],
                },
            )
            await self.update(
                sid,
                {
                    "sessionUpdate": "tool_call_update",
                    "toolCallId": "call-1",
                    "status": "failed" if failed else "completed",
                },
            )
            await self.chunk(sid, f"tool {name} {'failed' if failed else 'done'}")
            return "end_turn"
        if command == "/plan":
            entries = [
                {"content": c, "priority": "medium", "status": "pending"}
                for c in ("read", "write", "test")
            ]
            for step in range(3):
                for i, e in enumerate(entries):
                    e["status"] = (
                        "completed" if i < step else "in_progress" if i == step else "pending"
                    )
                await self.update(sid, {"sessionUpdate": "plan", "entries": entries})
            await self.chunk(sid, "plan done")
            return "end_turn"
        if command in ("/approve-crash", "/approve-withdraw"):
            self.next_id += 1
            rid = self.next_id
            done = trio.Event()
            self.waiting[rid] = done
            await self.send(
                {
                    "id": rid,
                    "method": "session/request_permission",
                    "params": {
                        "sessionId": sid,
                        "toolCall": {"toolCallId": "call-8", "title": "Delete everything"},
                        "options": [
                            {"optionId": "ok", "name": "Allow", "kind": "allow_once"},
                            {"optionId": "no", "name": "Reject", "kind": "reject_once"},
                        ],
                    },
                }
            )
            await trio.sleep(0.3)
            if command == "/approve-crash":
                os._exit(4)
            await self.send({"method": "$/cancel_request", "params": {"requestId": rid}})
            await done.wait()
            error = self.answers.pop(rid).get("error") or {}
            await self.chunk(sid, f"withdrawn: error {error.get('code')}")
            return "end_turn"
        if command == "/approve":
            title = " ".join(words[1:]) or "Write /tmp/fake.txt"
            await self.update(
                sid,
                {
                    "sessionUpdate": "tool_call",
                    "toolCallId": "call-9",
                    "title": title,
                    "kind": "edit",
                    "status": "pending",
                },
            )
            answer = await self.ask_client(
                "session/request_permission",
                {
                    "sessionId": sid,
                    "toolCall": {
                        "toolCallId": "call-9",
                        "title": title,
                        "kind": "edit",
                        "rawInput": {"path": "/tmp/fake.txt"},
                    },
                    "options": [
                        {"optionId": "allow-once", "name": "Allow once", "kind": "allow_once"},
                        {
                            "optionId": "allow-always",
                            "name": "Always allow",
                            "kind": "allow_always",
                        },
                        {"optionId": "reject-once", "name": "Reject", "kind": "reject_once"},
                        {
                            "optionId": "reject-always",
                            "name": "Never allow",
                            "kind": "reject_always",
                        },
                    ],
                },
            )
            outcome = (answer.get("result") or {}).get("outcome") or {}
            if prompt.cancelled.is_set():
                return "cancelled"
            chosen = (
                outcome.get("optionId") if outcome.get("outcome") == "selected" else "cancelled"
            )
            await self.chunk(sid, f"permission: {chosen}")
            return "end_turn"
        if command in ("/ask", "/ask3"):
            props: dict[str, Any] = {
                "colour": {
                    "type": "string",
                    "title": "Favourite colour",
                    "oneOf": [
                        {"const": "red", "title": "Red"},
                        {"const": "green", "title": "Green"},
                        {"const": "blue", "title": "Blue"},
                    ],
                }
            }
            if command == "/ask3":
                props["toppings"] = {
                    "type": "array",
                    "title": "Toppings",
                    "items": {"type": "string", "enum": ["cheese", "ham", "olives"]},
                }
                props["note"] = {"type": "string", "title": "Anything else?"}
            if "form" not in (self.client_caps.get("elicitation") or {}):
                await self.chunk(sid, "elicitation: not supported by the client")
                return "end_turn"
            answer = await self.ask_client(
                "elicitation/create",
                {
                    "sessionId": sid,
                    "mode": "form",
                    "message": "A quick question",
                    "requestedSchema": {
                        "type": "object",
                        "properties": props,
                        "required": list(props),
                    },
                },
            )
            result = answer.get("result") or {}
            if prompt.cancelled.is_set():
                return "cancelled"
            if result.get("action") == "accept":
                await self.chunk(
                    sid, "answers: " + json.dumps(result.get("content"), sort_keys=True)
                )
            else:
                await self.chunk(sid, f"elicitation: {result.get('action')}")
            return "end_turn"
        if command == "/clientreq":
            answer = await self.ask_client(
                "fs/read_text_file", {"sessionId": sid, "path": "/etc/hostname"}
            )
            if "error" in answer:
                await self.chunk(sid, f"client answered: error {answer['error'].get('code')}")
            else:
                await self.chunk(sid, "client answered: result")
            return "end_turn"
        if command == "/error":
            code = int(words[1]) if len(words) > 1 else -32603
            return {"code": code, "message": f"scripted error {code}"}
        if command == "/refuse":
            return "refusal"
        if command == "/maxtokens":
            await self.chunk(sid, "partial")
            return "max_tokens"
        if command == "/crash":
            await self.chunk(sid, "about to crash ")
            if "kill" in words[1:]:
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(3)
        if command == "/garbage":
            await self.chunk(sid, "before garbage ")
            await self.send_raw(b"this is not json\n")
            await trio.sleep(3600)
            return "end_turn"
        if command == "/unknown-id":
            await self.chunk(sid, "before unknown id ")
            await self.send({"id": 987654, "result": {}})
            await trio.sleep(3600)
            return "end_turn"
        # default: think, then echo
        await self.chunk(sid, f"thinking about: {current[:30]}", kind="agent_thought_chunk")
        lines = [
            f"image {b.get('mimeType')} {len(_b64len(b.get('data', '')))} bytes"
            for b in blocks
            if b.get("type") == "image"
        ]
        lines += [
            f"file {b.get('name')} {b.get('mimeType')} {b.get('size')} bytes, "
            f"{_on_disk(str(b.get('uri', '')))} on disk"
            for b in blocks
            if b.get("type") == "resource_link"
        ]
        text = prefix + "echo: " + current + ("\n" + "\n".join(lines) if lines else "")
        self.counter += 1
        mid = f"msg-{self.counter}"
        for i in range(0, len(text), 20):
            await self.chunk(sid, text[i : i + 20], mid=mid)
        await self.update(sid, {"sessionUpdate": "usage_update", "used": 10, "size": 1000})
        return "end_turn"


def _on_disk(uri: str) -> str:
    """How many bytes the file a ``file://`` URI names holds, ``-`` when unreadable."""
    import urllib.parse

    parts = urllib.parse.urlsplit(uri)
    if parts.scheme != "file":
        return "-"
    try:
        return str(os.path.getsize(urllib.parse.unquote(parts.path)))
    except OSError:
        return "-"


def _b64len(data: str) -> bytes:
    import base64

    return base64.b64decode(data)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dshim.testing.fakes.acp_agent")
    parser.add_argument("--no-image", action="store_true")
    parser.add_argument("--no-load", action="store_true")
    parser.add_argument("--load-only", action="store_true")
    parser.add_argument("--no-steer", action="store_true")
    parser.add_argument("--models", choices=["config", "legacy", "none"], default="config")
    parser.add_argument("--protocol-version", type=int, default=1)
    parser.add_argument("--journal", default=None)
    parser.add_argument("--sessions-file", default=None)
    parser.add_argument("--no-close", action="store_true")
    parser.add_argument("--auth-required", action="store_true")
    args = parser.parse_args(argv)
    print("fake-acp-agent: started", file=sys.stderr, flush=True)
    trio.run(FakeAgent(args).run)


if __name__ == "__main__":
    main()
