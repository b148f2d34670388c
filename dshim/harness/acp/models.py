"""ACP wire views: msgspec structs naming only the fields dshim reads.

Agent Client Protocol v1 (https://agentclientprotocol.com/protocol/overview) over
JSON-RPC 2.0.  Every message is decoded once at the edge: the envelope with
``msgspec.Raw`` for ``params``/``result``, then the one struct its method calls for.
Update views are lenient on purpose (``Any`` for fields agents fill differently): one odd
field must not lose a whole update.  Field names follow the wire (camelCase via
``rename="camel"``).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "AUTH_REQUIRED",
    "CONNECTION_LOST",
    "ENCODER",
    "ENVELOPE",
    "INVALID_PARAMS",
    "METHOD_NOT_FOUND",
    "PROTOCOL_VERSION",
    "REQUEST_CANCELLED",
    "RESOURCE_NOT_FOUND",
    "AgentCaps",
    "AgentInfo",
    "CancelRequest",
    "ElicitParams",
    "Envelope",
    "InitResult",
    "LegacyModel",
    "LegacyModels",
    "Notification",
    "PermissionOption",
    "PermissionParams",
    "PromptCaps",
    "PromptResult",
    "RequestId",
    "RpcError",
    "SessionResult",
    "SteerResult",
    "ToolCallRef",
    "Update",
]

PROTOCOL_VERSION = 1

# JSON-RPC 2.0 error codes (https://www.jsonrpc.org/specification#error_object) and ACP's.
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
AUTH_REQUIRED = -32000
RESOURCE_NOT_FOUND = -32002
REQUEST_CANCELLED = -32800
#: dshim's own code for "the process died with this call open" (never on the wire).
CONNECTION_LOST = -32099

#: A JSON-RPC request id: ours are ints, an agent's may be either.
RequestId = int | str


class RpcError(msgspec.Struct):
    code: int = 0
    message: str = ""


class Envelope(msgspec.Struct):
    """Any JSON-RPC message: a request (id + method), a notification (method) or a response."""

    id: int | str | None | msgspec.UnsetType = msgspec.UNSET
    method: str | msgspec.UnsetType = msgspec.UNSET
    params: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    result: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    error: RpcError | None | msgspec.UnsetType = msgspec.UNSET


# --- initialize ----------------------------------------------------------------------------


class PromptCaps(msgspec.Struct, rename="camel"):
    image: bool = False
    audio: bool = False
    embedded_context: bool = False


class AgentCaps(msgspec.Struct, rename="camel"):
    load_session: bool = False
    prompt_capabilities: PromptCaps = msgspec.field(default_factory=PromptCaps)
    session_capabilities: dict[str, Any] | None = None
    meta: dict[str, Any] | None = msgspec.field(default=None, name="_meta")


class AgentInfo(msgspec.Struct):
    name: str | None = None
    title: str | None = None
    version: str | None = None


class InitResult(msgspec.Struct, rename="camel"):
    protocol_version: int = 0
    agent_capabilities: AgentCaps = msgspec.field(default_factory=AgentCaps)
    agent_info: AgentInfo | None = None
    auth_methods: Any = None
    meta: dict[str, Any] | None = msgspec.field(default=None, name="_meta")


# --- sessions ------------------------------------------------------------------------------


class LegacyModel(msgspec.Struct, rename="camel"):
    model_id: str
    name: str | None = None


class LegacyModels(msgspec.Struct, rename="camel"):
    current_model_id: str | None = None
    available_models: list[LegacyModel] = msgspec.field(default_factory=list)


class SessionResult(msgspec.Struct, rename="camel"):
    session_id: str | None = None
    config_options: Any = None
    models: Any = None  # legacy; converted leniently (protocol.legacy_models)


# --- updates and agent requests ------------------------------------------------------------


class Update(msgspec.Struct, rename="camel"):
    # Lenient on purpose: one odd field must not lose the whole update.
    session_update: str = ""
    content: Any = None
    message_id: Any = None
    tool_call_id: Any = None
    title: Any = None
    status: Any = None
    entries: Any = None
    config_options: Any = None
    available_commands: Any = None


class Notification(msgspec.Struct, rename="camel"):
    """``session/update`` params."""

    session_id: str
    update: Update


class PermissionOption(msgspec.Struct, rename="camel"):
    option_id: str
    name: str = ""
    kind: str | None = None


class ToolCallRef(msgspec.Struct, rename="camel"):
    tool_call_id: str = ""
    title: str | None = None
    kind: str | None = None
    raw_input: Any = None


class PermissionParams(msgspec.Struct, rename="camel"):
    """``session/request_permission`` params."""

    session_id: str
    tool_call: ToolCallRef = msgspec.field(default_factory=ToolCallRef)
    options: list[PermissionOption] = msgspec.field(default_factory=list)


class ElicitParams(msgspec.Struct, rename="camel"):
    """``elicitation/create`` params (form mode is the one dshim answers)."""

    session_id: str | None = None
    mode: str = "form"
    message: str = ""
    requested_schema: dict[str, Any] | None = None


class CancelRequest(msgspec.Struct, rename="camel"):
    """``$/cancel_request`` params."""

    request_id: int | str


# --- results of our requests ---------------------------------------------------------------


class PromptResult(msgspec.Struct, rename="camel"):
    stop_reason: str = "end_turn"


class SteerResult(msgspec.Struct):
    outcome: str = "failed"
    reason: str | None = None


ENVELOPE = msgspec.json.Decoder(Envelope)
ENCODER = msgspec.json.Encoder()
