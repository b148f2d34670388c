"""DSH HTTP RPC, sans-IO: envelopes, errors, events -> turn events, history pages.

Theory of operation
-------------------
DSH (the agent host dsh-im fronts) answers ``POST {base}/api/<method>`` with a body
``{type:"client-request", rpcId, method, payload}``; the answer is
``{type:"server-response", rpcId, result:{ok:true, value} | {ok:false, error:{code,
message, details}}}``.  :func:`request_body` builds one, :func:`parse_response` checks the
echoed ``rpcId`` and ``result.ok`` and returns the value or raises; :func:`http_error` maps
a non-2xx status once (401/407 not logged in, 403 host refuses this client, 404 host too
old for this API).

A session's durable events (``turn/start``, ``user/message``, ``assistant/chunk``,
``assistant/message``, ``tool/call``, ``tool/result``, ``turn/end``; each with a ``seq``)
reach dshim as ``session/event`` frames of the events websocket ``/api/events.mux`` or, when
that is unavailable, as ``session.history`` pages.  :class:`TurnTracker` consumes them in
``seq`` order from either source (an event at or below the last ``seq`` seen is a
duplicate and ignored, so a switch from the mux to polling mid-turn loses and repeats
nothing):

- the ``user/message`` whose ``data.source.rpcId`` is the prompt call's ``rpcId`` fixes the
  turn (``data.turn``); events of other turns (another client's, an earlier one) are ignored;
- ``assistant/chunk`` ``text-delta`` -> text, ``reasoning-delta`` -> thinking; steps are
  joined by a blank line; ``assistant/message`` completes a step (only what the deltas
  did not show is added);
- ``tool/call`` / ``tool/result`` -> tool progress;
- ``turn/end`` of the turn ends it: ``completed`` normally, otherwise with the reason in words.

Approvals (``approval/requested``) and questions (``question/requested``) arrive only on the
mux; their envelope ``rpcId`` is what ``POST /api/respond`` answers
(:func:`respond_body`).  The host replays pending ones when the mux is reopened, so they are
deduplicated by that ``rpcId``.

Quote recovery reads ``session.history`` pages newest first (``beforeSeq`` is an exclusive
upper cursor; a page whose cursor did not advance is refused): :func:`completed_answers`
returns the last ``assistant/message`` of each turn that ended ``completed``.
"""

from __future__ import annotations

import base64
import datetime
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from dshim.channels.kit.decode import decode
from dshim.errors import HarnessError
from dshim.model import (
    ImagePart,
    Option,
    TextDelta,
    Thinking,
    ToolProgress,
    TurnEnd,
    TurnEvent,
)

__all__ = [
    "APPROVAL_OPTIONS",
    "DshRpcError",
    "HostNotLoggedIn",
    "HostRefused",
    "HostTooOld",
    "HistoryAnswer",
    "MuxFrame",
    "TurnTracker",
    "completed_answers",
    "content_blocks",
    "decode_frame",
    "http_error",
    "parse_response",
    "request_body",
    "respond_body",
]

#: The approval choices DSH accepts (``outcome``), as dshim options.
APPROVAL_OPTIONS = [
    Option(id="allowed-once", label="Allow once", kind="allow_once"),
    Option(id="rejected", label="Reject", kind="reject_once"),
]

NOT_LOGGED_IN = (
    "the DSH host asks for credentials (HTTP {status}): set [harness] token "
    '(token = "${{DSH_TOKEN}}") to a token the host accepts'
)
REFUSED = (
    "the DSH host refuses this client (HTTP 403{detail}); it trusts only loopback or "
    "configured hosts: run dshim on the host's machine or allow this client there"
)
TOO_OLD = (
    "the DSH host has no {method} API (HTTP 404): the host is too old for dshim, "
    "or [harness] base_url does not point at DSH"
)
#: Error codes of ``{ok:false}`` results and what the user is told.
CODE_TEXT = {
    "session-not-found": "the DSH session no longer exists; send /new to start a new one",
    "agent-busy": "the DSH agent is busy with another answer in this session; try again shortly",
    "model-unavailable": "the selected model is not available on the DSH host",
    "attachment-error": "the DSH host refused an attachment (the model may not read images)",
}


class HostNotLoggedIn(HarnessError):
    """HTTP 401/407: the host wants credentials (``[harness] token``)."""


class HostRefused(HarnessError):
    """HTTP 403: the host does not trust this client."""


class HostTooOld(HarnessError):
    """HTTP 404: the host has no such API (too old, or not DSH at all)."""


class DshRpcError(HarnessError):
    """The host answered ``{ok:false, error}``; ``rpc_code`` is its ``error.code``."""

    def __init__(self, method: str, rpc_code: str, message: str) -> None:
        explained = CODE_TEXT.get(rpc_code)
        text = f"{method}: {message}" if message else method
        if explained:
            text = f"{explained} ({text})"
        super().__init__(text, code=rpc_code)
        self.rpc_code = rpc_code


# --- envelopes ------------------------------------------------------------------------------


def request_body(rpc_id: str, method: str, payload: Mapping[str, Any]) -> bytes:
    """The JSON body of ``POST /api/<method>``."""
    return msgspec.json.encode(
        {"type": "client-request", "rpcId": rpc_id, "method": method, "payload": payload}
    )


class _Error(msgspec.Struct):
    code: Any = None
    message: Any = None


class _Result(msgspec.Struct):
    ok: bool
    value: Any = None
    error: _Error | None = None


class _Response(msgspec.Struct):
    type: str
    rpcId: str  # noqa: N815 - wire name
    result: _Result


_RESPONSE = msgspec.json.Decoder(_Response)
_ANY = msgspec.json.Decoder()


def parse_response(method: str, rpc_id: str, body: bytes) -> Any:
    """The ``value`` of a 2xx answer; raises HarnessError for a bad envelope or ``ok:false``."""
    try:
        resp = decode(_RESPONSE, body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HarnessError(
            f"{method}: the DSH host sent an invalid answer", code="harness-response-invalid"
        ) from exc
    if resp.type != "server-response" or resp.rpcId != rpc_id:
        raise HarnessError(
            f"{method}: the DSH host answered another request", code="harness-response-invalid"
        )
    if not resp.result.ok:
        err = resp.result.error or _Error()
        code = err.code if isinstance(err.code, str) and err.code else "internal"
        message = err.message if isinstance(err.message, str) else ""
        raise DshRpcError(method, code, " ".join(message.split())[:300])
    return resp.result.value


def http_error(method: str, status: int, body: bytes, *, loopback: bool) -> HarnessError:
    """A non-2xx answer of the host, mapped once (the seed's transport error taxonomy)."""
    if status in (401, 407):
        code = "harness-auth-required" if status == 401 else "harness-proxy-auth-required"
        return HostNotLoggedIn(NOT_LOGGED_IN.format(status=status), code=code)
    if status == 403:
        if body[:64].strip() == b"forbidden":
            code = "harness-loopback-forbidden" if loopback else "harness-host-untrusted"
        else:
            code = "harness-request-forbidden"
        return HostRefused(REFUSED.format(detail=f", {code}"), code=code)
    if status == 404:
        return HostTooOld(TOO_OLD.format(method=method), code="harness-api-not-found")
    return HarnessError(
        f"{method}: the DSH host failed (HTTP {status})", code="harness-http-failed"
    )


def respond_body(rpc_id: str, value: Any | None, *, cancelled: bool = False) -> bytes:
    """The body of ``POST /api/respond`` answering the interaction ``rpc_id``."""
    result: dict[str, Any] = (
        {"ok": False, "error": {"code": "cancelled", "message": "cancelled", "details": {}}}
        if cancelled
        else {"ok": True, "value": value}
    )
    return msgspec.json.encode({"type": "client-response", "rpcId": rpc_id, "result": result})


class _Receipt(msgspec.Struct):
    accepted: bool
    reason: str | None = None


_RECEIPT = msgspec.json.Decoder(_Receipt)


def parse_receipt(body: bytes) -> tuple[bool, str | None]:
    """``(accepted, reason)`` of a respond receipt; an unreadable one is ``(False, "invalid")``."""
    try:
        receipt = decode(_RECEIPT, body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False, "invalid"
    return receipt.accepted, receipt.reason


def content_blocks(text: str, images: Sequence[ImagePart]) -> list[dict[str, Any]]:
    """``session.prompt`` content: one text block, then the images (base64)."""
    blocks: list[dict[str, Any]] = [{"type": "text", "text": text}]
    for image in images:
        block: dict[str, Any] = {
            "type": "image",
            "mediaType": image.mime,
            "data": base64.b64encode(image.data).decode("ascii"),
        }
        if image.name:
            block["name"] = image.name
        blocks.append(block)
    return blocks


def workspace_id(value: Any, path: str) -> str | None:
    """The ``workspaceId`` a ``workspace.list`` value gives ``path`` (compared normalized:
    ``/w/`` is ``/w``), or None."""
    items = value.get("items") if isinstance(value, dict) else None
    want = posixpath.normpath(path)
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict) or not isinstance(item.get("path"), str):
            continue
        wid = item.get("workspaceId")
        if posixpath.normpath(item["path"]) == want and isinstance(wid, str):
            return wid
    return None


# --- mux frames -----------------------------------------------------------------------------


class MuxFrame(msgspec.Struct, frozen=True):
    """One mux message: its ``rpcId``, ``payload.type`` and the payload itself."""

    rpc_id: str | None
    kind: str
    session_id: str
    payload: dict[str, Any]


def decode_frame(data: str | bytes) -> MuxFrame | None:
    """A mux text frame, or None when malformed (binary, bad JSON, method != payload.type)."""
    if isinstance(data, bytes):
        return None
    try:
        obj = decode(_ANY, data)
    except msgspec.DecodeError:
        return None
    if not isinstance(obj, dict) or obj.get("type") != "server-request":
        return None
    payload = obj.get("payload")
    if not isinstance(payload, dict):
        return None
    kind = payload.get("type")
    session_id = payload.get("sessionId")
    if not isinstance(kind, str) or kind != obj.get("method") or not isinstance(session_id, str):
        return None
    rpc_id = obj.get("rpcId")
    return MuxFrame(
        rpc_id=rpc_id if isinstance(rpc_id, str) else None,
        kind=kind,
        session_id=session_id,
        payload=payload,
    )


# --- events -> turn events ------------------------------------------------------------------


def _seq(event: Any) -> float | None:
    if not isinstance(event, dict):
        return None
    seq = event.get("seq")
    if isinstance(seq, bool) or not isinstance(seq, int | float):
        return None
    return float(seq)


def event_time(event: Mapping[str, Any]) -> float | None:
    """An event's ``time`` in epoch seconds (milliseconds, seconds or ISO 8601 accepted)."""
    t = event.get("time")
    if isinstance(t, bool):
        return None
    if isinstance(t, int | float):
        return float(t) / 1000.0 if t > 1e11 else float(t)
    if isinstance(t, str):
        try:
            return datetime.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def _text_of(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        return ""
    return "".join(
        b["text"]
        for b in content
        if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str)
    )


#: turn/end reasons that are not "completed": (stop reason, what the user is told).
_END_REASONS = {
    "max-tokens": ("max_tokens", "the answer was cut off: the model reached its output limit"),
    "blocked": ("refusal", "the host blocked this turn"),
    "interrupted": ("cancelled", None),
    "stopped": ("cancelled", None),
    "cancelled": ("cancelled", None),
    "canceled": ("cancelled", None),
    "aborted": ("cancelled", "the host aborted this turn"),
}


def end_for(reason: Any) -> TurnEnd:
    """The dshim end of a turn from ``turn/end.data.reason`` (a string or ``{kind, ...}``)."""
    kind = reason if isinstance(reason, str) else None
    detail: Any = None
    if isinstance(reason, dict):
        kind = reason.get("kind") if isinstance(reason.get("kind"), str) else None
        detail = reason.get("error") or reason.get("failure")
    if kind == "completed":
        return TurnEnd()
    if kind in _END_REASONS:
        stop, text = _END_REASONS[kind]
        return TurnEnd(stop_reason=stop, error=text)
    message = None
    if isinstance(detail, dict):
        code, msg = detail.get("code"), detail.get("message")
        message = " ".join(
            str(x) for x in (msg, f"({code})" if code else None) if isinstance(x, str) and x
        )
    return TurnEnd(
        stop_reason="error", error=f"the agent's turn failed: {message or kind or 'unknown reason'}"
    )


def _turn_of(data: Mapping[str, Any]) -> int | None:
    turn = data.get("turn")
    return turn if isinstance(turn, int) and not isinstance(turn, bool) else None


#: Characters of a tool call's arguments shown with its approval request.
TOOL_ARGS_MAX = 300


class TurnTracker:
    """One prompt's turn, followed through its session's events (from the mux or history)."""

    def __init__(self, prompt_rpc_id: str, *, after_seq: float = -1.0) -> None:
        self.prompt_rpc_id = prompt_rpc_id
        #: The highest ``seq`` consumed (events at or below it are duplicates).
        self.last_seq = after_seq
        #: Our ``user/message`` was seen (the prompt reached the session).
        self.matched = False
        #: Our turn's number (None: not known, or the host numbers no turns).
        self.turn: int | None = None
        self._open_turn: int | None = None
        #: Our message was queued behind a running turn: ours is the next ``turn/start``.
        self._await_start = False
        self.end: TurnEnd | None = None
        self._step: Any = None
        self._step_text = ""
        self._sep = False
        #: The host numbers its turns (so a message without a number waits for one).
        self._seen_start = False
        #: Arguments of this turn's tool calls by callId (shown with their approvals).
        self.tool_args: dict[str, str] = {}
        self.text = ""

    @property
    def done(self) -> bool:
        return self.end is not None

    def feed(self, events: Sequence[Any]) -> list[TurnEvent]:
        """New events (any order, duplicates fine) -> the turn events they mean."""
        fresh = [(s, e) for e in events if (s := _seq(e)) is not None and s > self.last_seq]
        fresh.sort(key=lambda pair: pair[0])
        out: list[TurnEvent] = []
        for seq, event in fresh:
            if self.done:
                break
            self.last_seq = seq
            out.extend(self._one(event))
        return out

    def _one(self, event: dict[str, Any]) -> list[TurnEvent]:
        kind = event.get("type")
        data = event.get("data")
        if not isinstance(data, dict):
            return []
        turn = _turn_of(data)
        if kind == "turn/start" and turn is not None:
            self._seen_start = True
            if self.matched and self.turn is None:
                self.turn, self._await_start = turn, False  # ours started (it was queued)
            elif not self.matched:
                self._open_turn = turn
            return []
        if not self.matched:
            source = data.get("source")
            if (
                kind == "user/message"
                and isinstance(source, dict)
                and source.get("rpcId") == self.prompt_rpc_id
            ):
                # The message names its turn; else it belongs to the open turn (the seed's
                # rule); else, when the host numbers turns, ours is the next turn/start.
                self.matched = True
                self.turn = turn if turn is not None else self._open_turn
                self._await_start = self.turn is None and self._seen_start
            elif kind == "turn/end" and turn is not None and turn == self._open_turn:
                self._open_turn = None
            return []
        if self._await_start:
            return []
        if self.turn is not None and "turn" in data and turn != self.turn:
            return []
        if kind == "assistant/chunk":
            chunk = data.get("chunk")
            if not isinstance(chunk, dict) or not isinstance(chunk.get("text"), str):
                return []
            if chunk.get("type") == "text-delta":
                return self._add(data.get("step"), chunk["text"])
            if chunk.get("type") == "reasoning-delta" and chunk["text"]:
                return [Thinking(chunk["text"])]
            return []
        if kind == "assistant/message":
            full = _text_of(data.get("message"))
            step = data.get("step", self._step)
            if step != self._step:
                return self._add(step, full)
            if full.startswith(self._step_text):
                return self._add(step, full[len(self._step_text) :])
            return []  # the final text differs from the streamed one: keep what was shown
        if kind == "tool/call":
            name = data.get("name")
            call_id = data.get("callId")
            args = data.get("arguments")
            if isinstance(call_id, str) and len(self.tool_args) < 100:
                text = args if isinstance(args, str) else msgspec.json.encode(args).decode()
                self.tool_args[call_id] = " ".join(text.split())[:TOOL_ARGS_MAX]
            return [
                ToolProgress(
                    title=name if isinstance(name, str) and name else "tool",
                    status="running",
                    tool_id=call_id if isinstance(call_id, str) else None,
                )
            ]
        if kind == "tool/result":
            message = data.get("message")
            source = message.get("source") if isinstance(message, dict) else None
            call_id = source.get("callId") if isinstance(source, dict) else None
            call_id = call_id or data.get("callId") or data.get("subCallId")
            name = data.get("name")
            return [
                ToolProgress(
                    title=name if isinstance(name, str) and name else "tool",
                    status="failed" if data.get("error") else "completed",
                    tool_id=call_id if isinstance(call_id, str) else None,
                )
            ]
        if kind == "turn/end":
            self.end = end_for(data.get("reason"))
            return []
        return []

    def _add(self, step: Any, text: str) -> list[TurnEvent]:
        if step != self._step:
            self._step = step
            self._step_text = ""
            self._sep = bool(self.text)  # a new step's text starts after a blank line
        if not text:
            return []
        out = ("\n\n" if self._sep else "") + text
        self._sep = False
        self._step_text += text
        self.text += out
        return [TextDelta(out)]


# --- history --------------------------------------------------------------------------------


class HistoryAnswer(msgspec.Struct, frozen=True):
    """The final answer of a completed turn, as ``session.history`` shows it."""

    text: str
    at: float
    seq: float


def page_events(value: Any) -> tuple[list[dict[str, Any]], bool]:
    """``(events, hasMore)`` of a ``session.history`` value (entries ``{event:{...}}``)."""
    if not isinstance(value, dict):
        return [], False
    items = value.get("events")
    events = []
    for item in items if isinstance(items, list) else []:
        event = item.get("event") if isinstance(item, dict) else None
        if isinstance(event, dict) and _seq(event) is not None:
            events.append(event)
    return events, value.get("hasMore") is True


def max_seq(events: Sequence[Mapping[str, Any]]) -> float:
    return max((s for e in events if (s := _seq(e)) is not None), default=-1.0)


class AnswerScan:
    """Completed answers found while reading history pages newest first."""

    def __init__(self) -> None:
        self._completed: set[Any] = set()
        self._seen: set[Any] = set()
        self.answers: list[HistoryAnswer] = []

    def feed(self, events: Sequence[dict[str, Any]]) -> None:
        """One page (any order); pages must come newest first."""
        for event in sorted(events, key=lambda e: -(_seq(e) or 0.0)):
            data = event.get("data")
            if not isinstance(data, dict):
                continue
            turn = data.get("turn")
            if isinstance(turn, bool) or not isinstance(turn, int | str):
                continue  # malformed: a turn number is an int (or an id)
            kind = event.get("type")
            if kind == "turn/end":
                reason = data.get("reason")
                if reason == "completed" or (
                    isinstance(reason, dict) and reason.get("kind") == "completed"
                ):
                    self._completed.add(turn)
            elif kind == "assistant/message" and turn in self._completed:
                if turn in self._seen:
                    continue  # an earlier step of a turn whose last message was taken
                self._seen.add(turn)
                text = _text_of(data.get("message")).strip()
                at = event_time(event)
                seq = _seq(event)
                if text and at is not None and seq is not None:
                    self.answers.append(HistoryAnswer(text=text, at=at, seq=seq))


def completed_answers(events: Sequence[dict[str, Any]]) -> list[HistoryAnswer]:
    """The last ``assistant/message`` of every turn in ``events`` that ended completed."""
    scan = AnswerScan()
    scan.feed(events)
    return scan.answers
