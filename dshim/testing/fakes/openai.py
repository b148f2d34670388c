"""A fake OpenAI-compatible Chat Completions server on 127.0.0.1 (port 0), for tests and benches.

It speaks HTTP/1.1 with keep-alive (h11 on trio sockets) and implements
``GET /v1/models`` and ``POST /v1/chat/completions`` with ``stream: true`` as Server-Sent
Events, chunked, exactly as the real servers frame them.  What it answers is chosen by
directives in the *last paragraph* of the last user message (dshim puts the user's own
text there):

======================  ===================================================================
(no directive)          ``reasoning_content`` "Thinking about: ..." then ``echo: <text>``
                        (prefixed ``[<model>]`` for a non-default model), a ``stop``
                        chunk, a usage chunk, ``[DONE]``
``fake:slow N``         N chunks ``chunk i`` spaced ``slow_interval_s`` (default 0.1 s)
``fake:reasoning``      thinking in ``delta.reasoning`` (vLLM/Ollama) instead
``fake:plain``          no thinking: the first data after the role chunk is content
``fake:keepalive``      three ``: keep-alive`` comments before the first data
``fake:error-after``    two chunks, then ``data: {"error": {...}}`` after HTTP 200
``fake:eof``            two chunks, then the connection drops (no ``[DONE]``)
``fake:length``         ``finish_reason: length``
``fake:nodone``         a complete answer that ends without ``data: [DONE]``
``fake:json``           a non-streaming ``chat.completion`` JSON body
``fake:429`` / ``fake:503``  the first attempt of this exact request gets that status
                        (``429`` with ``Retry-After: 1``); ``fake:429x3`` the first three
======================  ===================================================================

Tests can also queue faults for the next chat requests with :meth:`FakeOpenAI.fail_next`.
Every request is recorded (:attr:`FakeOpenAI.requests`); streams the client abandoned are
counted in :attr:`FakeOpenAI.disconnects`.  With ``api_key`` set, requests without
``Authorization: Bearer <key>`` get 401.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import h11
import msgspec
import trio

RECEIVE_SIZE = 64 * 1024
_DIRECTIVE = re.compile(r"fake:([a-z][a-z-]*|\d{3})(?:x(\d+))?(?:\s+(\d+))?")


class RecordedRequest(msgspec.Struct, kw_only=True):
    method: str
    path: str
    headers: dict[str, str]
    body: Any = None


class Fault(msgspec.Struct, kw_only=True, frozen=True):
    status: int
    retry_after: str | None = None
    message: str = "scripted failure"


class _Dropped(Exception):
    """The client went away while we were sending."""


def _user_text(body: Any) -> str:
    messages = body.get("messages") if isinstance(body, dict) else None
    for message in reversed(messages or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "\n\n".join(
                    p.get("text", "")
                    for p in content
                    if isinstance(p, dict) and p.get("type") == "text"
                )
    return ""


class FakeOpenAI:
    """The fake server's state and knobs.  Run :meth:`serve` (or :func:`open_fake_openai`)."""

    def __init__(
        self,
        *,
        models: tuple[str, ...] = ("fake-small", "fake-large"),
        api_key: str | None = None,
        slow_interval_s: float = 0.1,
        chunk_size: int = 16,
    ) -> None:
        self.models = models
        self.api_key = api_key
        self.slow_interval_s = slow_interval_s
        self.chunk_size = chunk_size
        self.requests: list[RecordedRequest] = []
        self.faults: collections.deque[Fault] = collections.deque()
        self.disconnects = 0
        self.completed_streams = 0
        self.port = 0
        self._seen: collections.Counter[str] = collections.Counter()
        self._ids = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def chat_requests(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    def fail_next(
        self,
        status: int,
        *,
        times: int = 1,
        retry_after: str | None = None,
        message: str = "scripted failure",
    ) -> None:
        """The next ``times`` chat requests get HTTP ``status`` (before any streaming)."""
        for _ in range(times):
            self.faults.append(Fault(status=status, retry_after=retry_after, message=message))

    # -- HTTP ------------------------------------------------------------------------------

    async def serve(
        self, *, task_status: trio.TaskStatus[FakeOpenAI] = trio.TASK_STATUS_IGNORED
    ) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            task_status.started(self)
            await trio.serve_listeners(self._connection, listeners, handler_nursery=nursery)

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                event = await self._next(conn, stream)
                if not isinstance(event, h11.Request):
                    return
                body = bytearray()
                while True:
                    ev = await self._next(conn, stream)
                    if isinstance(ev, h11.Data):
                        body += ev.data
                    elif isinstance(ev, h11.EndOfMessage):
                        break
                    else:
                        return
                keep = await self._route(conn, stream, event, bytes(body))
                if not keep or conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (_Dropped, trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            await stream.aclose()

    async def _next(self, conn: h11.Connection, stream: trio.SocketStream) -> Any:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await stream.receive_some(RECEIVE_SIZE)
            conn.receive_data(data)

    async def _send(self, conn: h11.Connection, stream: trio.SocketStream, event: Any) -> None:
        data = conn.send(event)
        if data:
            try:
                await stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
                raise _Dropped() from exc

    async def _json(
        self,
        conn: h11.Connection,
        stream: trio.SocketStream,
        status: int,
        obj: Any,
        extra: list[tuple[str, str]] | None = None,
    ) -> None:
        data = json.dumps(obj).encode()
        headers = [("content-type", "application/json"), ("content-length", str(len(data)))]
        headers += extra or []
        await self._send(conn, stream, h11.Response(status_code=status, headers=headers))
        await self._send(conn, stream, h11.Data(data=data))
        await self._send(conn, stream, h11.EndOfMessage())

    async def _route(
        self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request, raw: bytes
    ) -> bool:
        path = request.target.decode("latin-1").split("?", 1)[0]
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers}
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                body = None
        self.requests.append(
            RecordedRequest(method=request.method.decode(), path=path, headers=headers, body=body)
        )
        if self.api_key is not None and headers.get("authorization") != f"Bearer {self.api_key}":
            await self._json(
                conn,
                stream,
                401,
                {
                    "error": {
                        "message": "Incorrect API key provided.",
                        "type": "invalid_request_error",
                        "code": "invalid_api_key",
                    }
                },
            )
            return True
        if request.method == b"GET" and path.endswith("/models"):
            await self._json(
                conn,
                stream,
                200,
                {
                    "object": "list",
                    "data": [{"id": m, "object": "model", "owned_by": "fake"} for m in self.models],
                },
            )
            return True
        if request.method == b"POST" and path.endswith("/chat/completions"):
            return await self._chat(conn, stream, body, raw)
        await self._json(
            conn, stream, 404, {"error": {"message": f"no route {path}", "type": "not_found"}}
        )
        return True

    # -- chat ------------------------------------------------------------------------------

    def _fault_for(self, raw: bytes, directives: dict[str, tuple[int, int | None]]) -> Fault | None:
        if self.faults:
            return self.faults.popleft()
        digest = hashlib.sha256(raw).hexdigest()
        attempt = self._seen[digest]
        self._seen[digest] += 1
        for status in ("429", "500", "503"):
            if status in directives:
                times = directives[status][0]
                if attempt < times:
                    return Fault(status=int(status), retry_after="1" if status == "429" else None)
        return None

    async def _chat(
        self, conn: h11.Connection, stream: trio.SocketStream, body: Any, raw: bytes
    ) -> bool:
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            await self._json(
                conn,
                stream,
                400,
                {"error": {"message": "messages is required", "type": "invalid_request_error"}},
            )
            return True
        model = str(body.get("model"))
        text = _user_text(body).split("\n\n")[-1].strip()
        directives = {
            m.group(1): (int(m.group(2) or 1), int(m.group(3)) if m.group(3) else None)
            for m in _DIRECTIVE.finditer(text)
        }
        fault = self._fault_for(raw, directives)
        if fault is not None:
            extra = [("retry-after", fault.retry_after)] if fault.retry_after is not None else []
            await self._json(
                conn,
                stream,
                fault.status,
                {
                    "error": {
                        "message": fault.message,
                        "type": "rate_limit_error" if fault.status == 429 else "server_error",
                    }
                },
                extra,
            )
            return True
        if model not in self.models:
            await self._json(
                conn,
                stream,
                404,
                {
                    "error": {
                        "message": f"The model `{model}` does not exist",
                        "type": "invalid_request_error",
                    }
                },
            )
            return True
        prefix = f"[{model}] " if model != self.models[0] else ""
        answer = prefix + "echo: " + text
        if "json" in directives:
            await self._json(
                conn,
                stream,
                200,
                {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "model": model,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": answer},
                            "finish_reason": "stop",
                        }
                    ],
                },
            )
            return True
        self._ids += 1
        cid = f"chatcmpl-fake-{self._ids}"

        def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
            obj = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": 1_790_000_000,
                "model": model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        await self._send(
            conn,
            stream,
            h11.Response(
                status_code=200,
                headers=[("content-type", "text/event-stream"), ("cache-control", "no-cache")],
            ),
        )
        send = self._sender(conn, stream)
        if "keepalive" in directives:
            for _ in range(3):
                await send(b": keep-alive\n\n")
                await trio.sleep(0.01)
        await send(chunk({"role": "assistant", "content": ""}))
        if "slow" in directives:
            n = directives["slow"][1] or 10
            for i in range(n):
                await send(chunk({"content": f"chunk {i + 1} "}))
                await trio.sleep(self.slow_interval_s)
        elif "error-after" in directives or "eof" in directives:
            await send(chunk({"content": "partial "}))
            await send(chunk({"content": "answer "}))
            if "eof" in directives:
                return False  # drop the connection: no [DONE], no chunked terminator
            await send(
                b'data: {"error": {"message": "scripted failure after 200", "type": "server_error", "code": "scripted"}}\n\n'
            )
            await self._send(conn, stream, h11.EndOfMessage())
            return True
        else:
            if "plain" not in directives:
                field = "reasoning" if "reasoning" in directives else "reasoning_content"
                thought = f"Thinking about: {text[:24]}"
                half = max(1, len(thought) // 2)
                await send(chunk({field: thought[:half]}))
                await send(chunk({field: thought[half:]}))
            for i in range(0, len(answer), self.chunk_size):
                await send(chunk({"content": answer[i : i + self.chunk_size]}))
        await send(chunk({}, "length" if "length" in directives else "stop"))
        usage = {
            "id": cid,
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }
        await send(b"data: " + json.dumps(usage).encode() + b"\n\n")
        if "nodone" not in directives:
            await send(b"data: [DONE]\n\n")
        await self._send(conn, stream, h11.EndOfMessage())
        self.completed_streams += 1
        return True

    def _sender(self, conn: h11.Connection, stream: trio.SocketStream) -> Any:
        async def send(data: bytes) -> None:
            try:
                await self._send(conn, stream, h11.Data(data=data))
            except _Dropped:
                self.disconnects += 1
                raise

        return send


@asynccontextmanager
async def open_fake_openai(**options: Any) -> AsyncIterator[FakeOpenAI]:
    """Run a :class:`FakeOpenAI` for the duration of the block."""
    async with trio.open_nursery() as nursery:
        fake = await nursery.start(FakeOpenAI(**options).serve)
        try:
            yield fake
        finally:
            nursery.cancel_scope.cancel()


async def _main() -> None:  # pragma: no cover - manual use
    async with open_fake_openai() as fake:
        print(f"fake OpenAI server at {fake.base_url}", flush=True)
        await trio.sleep_forever()


if __name__ == "__main__":  # pragma: no cover
    trio.run(_main)
