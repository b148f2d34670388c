"""ACP mapped to dshim, sans-IO: updates to turn events, results to outcomes, parts to blocks.

Theory of operation
-------------------
Agent Client Protocol v1 (https://agentclientprotocol.com/protocol/overview): JSON-RPC 2.0
in both directions, one compact JSON message per line.  This module knows what the
messages *mean* and nothing about pipes, tasks or time; :mod:`~dshim.harness.acp.rpc` moves
them and :mod:`~dshim.harness.acp.harness` holds the state machine of sessions and turns.

- ``initialize`` (protocol version 1): the agent's capabilities become :class:`Caps` —
  image prompts, ``loadSession``, ``sessionCapabilities.resume``/``close``, and the
  ``_session/steering`` extension when ``_meta.steering.supported`` is true.
- ``session/new``/``resume``/``load`` results carry the session's ``configOptions``
  (the first ``category: "model"`` select is the model choice) or the legacy ``models``
  object; :func:`decode_session`, :func:`model_option`, :func:`choose`.
- A turn is one ``session/prompt`` request with text, image and ``resource_link``
  (a saved file) content blocks (:func:`blocks`); it ends with the response's ``stopReason`` (:func:`prompt_outcome`,
  :func:`end_event`).  Meanwhile ``session/update`` notifications stream the answer:
  :func:`event_for` maps ``agent_message_chunk`` to text (a new ``messageId`` within the
  turn starts a new paragraph), ``agent_thought_chunk`` to thinking, ``tool_call`` /
  ``tool_call_update`` and ``plan`` to progress notes; usage, modes, commands and the
  user-message replay of ``session/load`` show nothing.
- Agent requests: ``session/request_permission`` becomes an approval (the options keep
  the agent's ``kind``: allow_once, reject_once ...); ``elicitation/create`` in form mode
  becomes one question per field, asked in order (:class:`Form`), answered with
  ``{"action": "accept", "content": {...}}`` or ``cancel``/``decline``.
- Errors: a JSON-RPC error of one of our requests is explained in words
  (:func:`explain_rpc_error`: -32000 authentication required, -32002 unknown session ...).
"""

from __future__ import annotations

import base64
import itertools
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import msgspec
import structlog

import dshim
from dshim.errors import HarnessError
from dshim.harness.acp.models import (
    AUTH_REQUIRED,
    PROTOCOL_VERSION,
    RESOURCE_NOT_FOUND,
    InitResult,
    LegacyModels,
    PromptResult,
    RpcError,
    SessionResult,
    SteerResult,
    Update,
)
from dshim.model import (
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

__all__ = [
    "AgentRpcError",
    "Caps",
    "Form",
    "FormField",
    "UpdateState",
    "blocks",
    "caps_from",
    "choose",
    "decode_session",
    "end_event",
    "event_for",
    "explain_rpc_error",
    "form_fields",
    "initialize_params",
    "legacy_models",
    "model_option",
    "options_list",
    "prompt_outcome",
    "select_values",
    "session_params",
    "steer_outcome",
    "summarize_input",
]

log = structlog.get_logger("dshim.harness.acp")

#: ``stopReason`` values that end a turn without the answer being complete.
STOP_ERRORS = {
    "max_tokens": "the answer was cut off: the model reached its output limit",
    "max_turn_requests": "the agent stopped: too many model requests in one turn",
    "refusal": "the agent refused to continue with this request",
    "cancelled": "the agent cancelled the answer",
}


class AgentRpcError(HarnessError):
    """The agent answered a request with a JSON-RPC error."""

    def __init__(self, method: str, code: int, message: str) -> None:
        super().__init__(explain_rpc_error(method, code, message), code="agent-error")
        self.rpc_code = code


def explain_rpc_error(method: str, code: int, message: str) -> str:
    """A JSON-RPC error of ``method`` in words for the user."""
    detail = " ".join(message.split())[:300] or "no details"
    if code == AUTH_REQUIRED:
        return "the agent needs to be logged in on the host first (authentication required)"
    if code == RESOURCE_NOT_FOUND:
        return f"the agent does not know this session any more ({detail}); send /new to start a new one"
    return f"the agent reported an error for {method}: {detail} (code {code})"


# --- initialize and sessions ------------------------------------------------------------------


def initialize_params() -> dict[str, Any]:
    """Our ``initialize`` request: no file system or terminal, form elicitation."""
    return {
        "protocolVersion": PROTOCOL_VERSION,
        "clientCapabilities": {
            "fs": {"readTextFile": False, "writeTextFile": False},
            "terminal": False,
            "elicitation": {"form": {}},
        },
        "clientInfo": {"name": "dshim", "title": "dshim", "version": dshim.__version__},
    }


def session_params(cwd: str, session_id: str | None = None) -> dict[str, Any]:
    """``session/new`` (no id) or ``session/resume``/``load`` params: the workspace, no MCP."""
    params: dict[str, Any] = {"cwd": cwd, "mcpServers": []}
    if session_id is not None:
        params["sessionId"] = session_id
    return params


class Caps(msgspec.Struct, frozen=True, kw_only=True):
    """What the agent said it can do, from its ``initialize`` result."""

    auth: tuple[AuthMethod, ...] = ()
    image: bool
    embedded_context: bool
    load_session: bool
    resume: bool
    close: bool
    steering: bool
    agent: str


def caps_from(init: InitResult) -> Caps:
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
    return Caps(
        auth=auth_methods(init.auth_methods),
        image=ac.prompt_capabilities.image,
        embedded_context=ac.prompt_capabilities.embedded_context,
        load_session=ac.load_session,
        resume=sc.get("resume") is not None,
        close=sc.get("close") is not None,
        steering=steering,
        agent=agent,
    )


def decode_session(raw: msgspec.Raw, session_id: str | None = None) -> SessionResult:
    """A session result; ``null`` (resume/load may answer that) keeps ``session_id``."""
    if bytes(raw).strip() in (b"null", b""):
        return SessionResult(session_id=session_id)
    try:
        result = msgspec.json.decode(raw, type=SessionResult)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise HarnessError(
            f"the agent sent an invalid session result: {exc}", code="agent-protocol"
        ) from exc
    if result.session_id is None and session_id is not None:
        result = msgspec.structs.replace(result, session_id=session_id)
    return result


def options_list(value: Any) -> list[Any] | None:
    return value if isinstance(value, list) else None


def legacy_models(value: Any) -> LegacyModels | None:
    """The legacy ``models`` object, or None when absent or malformed (logged)."""
    if not isinstance(value, dict):
        return None
    try:
        return msgspec.convert(value, LegacyModels)
    except msgspec.ValidationError:
        log.info("agent_models_ignored", reason="invalid legacy models object")
        return None


def model_option(options: list[Any] | None) -> dict[str, Any] | None:
    """The first ``category: "model"`` select among a session's config options."""
    return category_option(options, "model")


def category_option(options: list[Any] | None, category: str) -> dict[str, Any] | None:
    """The first select of ``category`` (``model``, ``mode``) among a session's options."""
    for option in options or []:
        if (
            isinstance(option, dict)
            and option.get("category") == category
            and option.get("type", "select") == "select"
        ):
            return option
    return None


class AuthMethod(msgspec.Struct, frozen=True):
    """One ``authMethods`` entry of ``initialize``: how to log the agent in."""

    id: str
    name: str
    description: str | None = None


def auth_methods(value: Any) -> tuple[AuthMethod, ...]:
    """The agent's advertised ``authMethods`` (malformed entries skipped)."""
    out = []
    for item in value if isinstance(value, list) else []:
        if isinstance(item, dict) and isinstance(item.get("id"), str):
            name = item.get("name")
            desc = item.get("description")
            out.append(
                AuthMethod(
                    id=item["id"],
                    name=name if isinstance(name, str) and name else item["id"],
                    description=desc if isinstance(desc, str) and desc else None,
                )
            )
    return tuple(out)


#: Login commands of known agents, by a word of the agent's command line.
LOGIN_COMMANDS = (("claude", "claude /login"), ("codex", "codex login"), ("gemini", "gemini"))


def login_command(argv: Sequence[str]) -> str | None:
    """The agent's own login command, known by the program's name — or, for an agent
    started through its interpreter (``node …/claude-agent-acp/dist/index.js``), by the
    package folder in its script's path."""
    words = list(itertools.takewhile(lambda a: not a.startswith("-"), argv))  # no options
    names = [os.path.basename(a).lower() for a in words]
    for word, cmd in LOGIN_COMMANDS:
        if any(word in name for name in names):
            return cmd
    folders = [p.lower() for a in words[1:] for p in a.split("/")[:-1] if "acp" in p.lower()]
    for word, cmd in LOGIN_COMMANDS:
        if any(word in folder for folder in folders):
            return cmd
    return None


def login_text(methods: Sequence[AuthMethod], argv: Sequence[str]) -> str:
    """What to tell the user when the agent needs logging in (-32000 with ``authMethods``)."""
    ways = "; ".join(
        f"{m.name}" + (f" — {' '.join(m.description.split())[:200]}" if m.description else "")
        for m in methods
    )
    command = login_command(argv)
    how = (
        f"run `{command}` on the host as the user dshim runs as"
        if command
        else "log the agent in on the host as the user dshim runs as"
    )
    return (
        f"the agent is not logged in on the host. Log-in methods it offers: {ways}. "
        f"To fix it, {how}, then send your message again."
    )


class AgentCommand(msgspec.Struct, frozen=True):
    """A slash command the agent advertised (``available_commands_update``)."""

    name: str
    description: str = ""
    hint: str | None = None


def agent_commands(value: Any) -> tuple[AgentCommand, ...] | None:
    """The commands of an ``available_commands_update`` (None when malformed)."""
    if not isinstance(value, list):
        return None
    out = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            continue
        name = item["name"].strip().lstrip("/")
        if not name or len(name) > 64 or any(c.isspace() for c in name):
            continue
        desc = item.get("description")
        inp = item.get("input")
        hint = inp.get("hint") if isinstance(inp, dict) else None
        out.append(
            AgentCommand(
                name=name,
                description=" ".join(desc.split())[:200] if isinstance(desc, str) else "",
                hint=hint if isinstance(hint, str) and hint else None,
            )
        )
    return tuple(out[:100])


def select_values(option: dict[str, Any]) -> list[tuple[str, str | None]]:
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


def choose(model: str, values: list[tuple[str, str | None]]) -> str:
    """The value the user meant: exact, then case-insensitive value or name."""
    wanted = model.strip()
    for value, _ in values:
        if value == wanted:
            return value
    for value, name in values:
        if value.casefold() == wanted.casefold() or (name and name.casefold() == wanted.casefold()):
            return value
    raise HarnessError(f"unknown model {wanted!r}; /models lists the choices", code="model-unknown")


def steer_outcome(raw: msgspec.Raw) -> bool:
    """A ``_session/steering`` result: True when injected, else a HarnessError saying why."""
    try:
        result = msgspec.json.decode(raw, type=SteerResult)
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


# --- turns ------------------------------------------------------------------------------------


def blocks(parts: Sequence[PromptPart]) -> list[dict[str, Any]]:
    """Prompt parts as ACP content blocks.

    A saved file is a ``resource_link`` (``file://`` URI of its path, name, mimeType,
    size): every agent must accept one (the baseline content types are text and
    resource_link, https://agentclientprotocol.com/protocol/content), and the text parts
    already carry the files block and any small text file inlined.
    """
    out: list[dict[str, Any]] = []
    for part in parts:
        if isinstance(part, TextPart):
            out.append({"type": "text", "text": part.text})
        elif isinstance(part, ImagePart):
            out.append(
                {
                    "type": "image",
                    "data": base64.b64encode(part.data).decode("ascii"),
                    "mimeType": part.mime,
                }
            )
        elif isinstance(part, FilePart):
            out.append(
                {
                    "type": "resource_link",
                    "uri": Path(part.path).as_uri(),
                    "name": part.name,
                    "mimeType": part.mime,
                    "size": part.size,
                }
            )
    return out


def prompt_outcome(
    error: RpcError | None, result: msgspec.Raw | None, *, cancelling: bool, lost: int
) -> tuple[str | None, str | None]:
    """The ``session/prompt`` response as (stop reason, error text).

    ``lost`` is the code the connection uses for "the process died with the call open":
    its message is already in words.  An error right after we cancelled means cancelled.
    """
    if error is not None:
        if cancelling:
            return "cancelled", None
        if error.code == lost:
            return None, error.message
        return None, explain_rpc_error("session/prompt", error.code, error.message)
    try:
        decoded = msgspec.json.decode(result or b"null", type=PromptResult)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, "the agent sent an invalid session/prompt result"
    return decoded.stop_reason, None


def end_event(stop_reason: str | None, error: str | None) -> TurnEnd:
    """The turn's last event from its outcome."""
    if error is not None:
        return TurnEnd(stop_reason="error", error=error)
    reason = stop_reason or "end_turn"
    if reason == "end_turn":
        return TurnEnd()
    return TurnEnd(stop_reason=reason, error=STOP_ERRORS.get(reason))


class UpdateState:
    """What mapping one turn's updates remembers: tool titles, the current message id."""

    __slots__ = ("tools", "message_id", "text_seen")

    def __init__(self) -> None:
        self.tools: dict[str, str] = {}
        self.message_id: str | None = None
        self.text_seen = False


def text_of(block: Any) -> str:
    """The text a content block shows (links and images as short placeholders)."""
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


def str_or_none(value: Any) -> str | None:
    if value is None:
        return None
    return value if isinstance(value, str) else str(value)


def event_for(update: Update, state: UpdateState) -> TurnEvent | None:
    """One ``session/update`` of a running turn as a dshim turn event (None: show nothing)."""
    kind = update.session_update
    if kind == "agent_message_chunk":
        text = text_of(update.content)
        if not text:
            return None
        mid = str_or_none(update.message_id)
        if mid and mid != state.message_id:
            if state.message_id is not None and state.text_seen:
                text = "\n\n" + text  # a new agent message within the same turn
            state.message_id = mid
        state.text_seen = True
        return TextDelta(text)
    if kind == "agent_thought_chunk":
        text = text_of(update.content)
        return Thinking(text) if text else None
    if kind in ("tool_call", "tool_call_update"):
        tool_id = str_or_none(update.tool_call_id) or ""
        title = str_or_none(update.title)
        if title:
            state.tools[tool_id] = title
        default = "pending" if kind == "tool_call" else "in_progress"
        return ToolProgress(
            title=state.tools.get(tool_id) or "tool",
            status=str_or_none(update.status) or default,
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


def summarize_input(kind: str | None, raw: Any) -> str | None:
    """A permission request's tool input, as detail text for the user."""
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


# --- elicitation forms ---------------------------------------------------------------------------


FieldKind = Literal["select", "multi", "boolean", "text", "integer", "number"]


class FormField(msgspec.Struct, kw_only=True):
    name: str
    label: str
    kind: FieldKind
    options: list[Option]
    required: bool


def enum_options(schema: dict[str, Any]) -> list[Option]:
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


def form_fields(schema: dict[str, Any] | None) -> list[FormField]:
    """The fields of a ``requestedSchema`` (a flat JSON Schema object), in order."""
    if not isinstance(schema, dict):
        return []
    props = schema.get("properties")
    req = schema.get("required")
    required: list[Any] = req if isinstance(req, list) else []
    if not isinstance(props, dict):
        return []
    fields: list[FormField] = []
    for name, prop in props.items():
        if not isinstance(prop, dict):
            continue
        label = str(prop.get("title") or name)
        if isinstance(prop.get("description"), str):
            label += f" — {prop['description']}"
        t = prop.get("type")
        options: list[Option] = []
        kind: FieldKind
        if t == "array":
            items = prop.get("items")
            options = enum_options(items if isinstance(items, dict) else {})
            kind = "multi"
        elif t == "boolean":
            options = [Option(id="true", label="Yes"), Option(id="false", label="No")]
            kind = "boolean"
        elif t == "integer":
            kind = "integer"
        elif t == "number":
            kind = "number"
        else:
            options = enum_options(prop)
            kind = "select" if options else "text"
        fields.append(
            FormField(
                name=str(name), label=label, kind=kind, options=options, required=name in required
            )
        )
    return fields


def field_value(f: FormField, selected: list[str], custom: str | None) -> Any:
    """The JSON value of one answered field."""
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


class Form:
    """An ``elicitation/create`` form asked one field at a time (sans-IO).

    :meth:`question` is the current field as a question; :meth:`answer` records the
    user's answer and says what comes next: ``"next"`` (ask :meth:`question` again),
    ``"accept"`` (send :attr:`content`) or ``"cancel"``.
    """

    def __init__(self, message: str, fields: list[FormField]) -> None:
        self.message = message.strip()
        self.fields = fields
        self.index = 0
        self.content: dict[str, Any] = {}

    def question(
        self,
        *,
        reply: Callable[[list[str], str | None], Awaitable[None]],
        withdrawn: Callable[[], Awaitable[None]],
    ) -> QuestionRequest:
        f = self.fields[self.index]
        i = self.index
        head = f"({i + 1}/{len(self.fields)}) " if len(self.fields) > 1 else ""
        text = f"{self.message}\n{head}{f.label}" if self.message else f"{head}{f.label}"
        return QuestionRequest(
            question=text,
            options=list(f.options),
            multi_select=f.kind == "multi",
            allow_free_text=f.kind in ("text", "integer", "number") or not f.options,
            reply=reply,
            withdrawn=withdrawn,
        )

    def answer(
        self, selected: list[str], custom: str | None
    ) -> Literal["next", "accept", "cancel"]:
        if not selected and custom is None:
            return "cancel"
        f = self.fields[self.index]
        self.content[f.name] = field_value(f, selected, custom)
        self.index += 1
        return "next" if self.index < len(self.fields) else "accept"
