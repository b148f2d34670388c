"""msgspec view structs for Slack: only the fields dshim reads.

Socket Mode frames (docs.slack.dev/apis/events-api/using-socket-mode), the Events API
``event_callback`` body and its ``message`` / ``app_mention`` events, Block Kit
``block_actions`` payloads, and the Web API answers dshim decodes.  ``ts`` values stay
strings (a float loses the precision lookups need).  One decoder per type, reused.
"""

from __future__ import annotations

from typing import Any

import msgspec

#: A missing ``payload`` / ``event`` (msgspec cannot mix ``Raw`` with ``None``).
NULL = msgspec.Raw(b"null")


def absent(raw: msgspec.Raw) -> bool:
    """True for a missing or ``null`` raw member."""
    return bytes(raw) in (b"", b"null")


class _View(msgspec.Struct, kw_only=True, gc=False):
    """Unknown fields are ignored (Slack adds fields all the time)."""


# --- Socket Mode --------------------------------------------------------------------------


class ConnectionInfo(_View):
    app_id: str | None = None


class Envelope(_View):
    """One Socket Mode frame: ``hello``, ``disconnect`` or an envelope with a payload."""

    type: str = ""
    envelope_id: str | None = None
    payload: msgspec.Raw = NULL
    accepts_response_payload: bool = False
    retry_attempt: int = 0
    retry_reason: str = ""
    #: ``disconnect`` only.
    reason: str | None = None
    #: ``hello`` only.
    num_connections: int | None = None
    connection_info: ConnectionInfo | None = None


class EnvelopeId(_View):
    """Just enough of a frame to acknowledge it when the rest does not decode."""

    envelope_id: str | None = None


# --- Events API ----------------------------------------------------------------------------


class File(_View):
    id: str = ""
    name: str | None = None
    title: str | None = None
    mimetype: str | None = None
    filetype: str | None = None
    size: int | None = None
    mode: str | None = None
    url_private: str | None = None
    url_private_download: str | None = None


class UserProfile(_View):
    display_name: str | None = None
    real_name: str | None = None
    name: str | None = None


class BotProfile(_View):
    name: str | None = None


class Event(_View):
    """A ``message`` or ``app_mention`` event (also a message returned by a lookup)."""

    type: str = ""
    subtype: str | None = None
    channel: str | None = None
    channel_type: str | None = None
    user: str | None = None
    bot_id: str | None = None
    app_id: str | None = None
    text: str | None = None
    ts: str | None = None
    thread_ts: str | None = None
    parent_user_id: str | None = None
    event_ts: str | None = None
    files: list[File] = msgspec.field(default_factory=list)
    user_team: str | None = None
    team: str | None = None
    source_team: str | None = None
    user_profile: UserProfile | None = None
    bot_profile: BotProfile | None = None
    username: str | None = None


class EventCallback(_View):
    """The ``payload`` of an ``events_api`` envelope."""

    type: str = ""
    team_id: str | None = None
    api_app_id: str | None = None
    event: msgspec.Raw = NULL
    event_id: str | None = None
    event_time: int | float | None = None


# --- interactivity (Block Kit buttons) -------------------------------------------------------


class ActionUser(_View):
    id: str = ""
    username: str | None = None
    name: str | None = None
    team_id: str | None = None


class Container(_View):
    type: str | None = None
    message_ts: str | None = None
    channel_id: str | None = None
    thread_ts: str | None = None


class IdOnly(_View):
    id: str = ""


class ActionMessage(_View):
    ts: str | None = None
    thread_ts: str | None = None
    text: str | None = None


class Action(_View):
    action_id: str = ""
    block_id: str | None = None
    value: str | None = None
    action_ts: str | None = None


class BlockActions(_View):
    """The ``payload`` of an ``interactive`` envelope (only ``block_actions`` is used)."""

    type: str = ""
    api_app_id: str | None = None
    user: ActionUser | None = None
    team: IdOnly | None = None
    channel: IdOnly | None = None
    container: Container | None = None
    message: ActionMessage | None = None
    actions: list[Action] = msgspec.field(default_factory=list)


# --- Web API answers -------------------------------------------------------------------------


class Answer(_View):
    """Every Web API answer: ``ok`` and, when false, ``error`` (plus ``needed``)."""

    ok: bool = False
    error: str | None = None
    needed: str | None = None


class AuthTest(Answer):
    url: str | None = None
    team: str | None = None
    team_id: str | None = None
    user: str | None = None
    user_id: str | None = None
    bot_id: str | None = None


class ConnectionsOpen(Answer):
    url: str | None = None


class Posted(Answer):
    channel: str | None = None
    ts: str | None = None


class History(Answer):
    messages: list[Event] = msgspec.field(default_factory=list)


class UserObject(_View):
    id: str = ""
    name: str | None = None
    real_name: str | None = None
    deleted: bool = False
    is_bot: bool = False
    profile: UserProfile | None = None


class UserInfo(Answer):
    """``users.info``: one user (substitute targets in the probe)."""

    user: UserObject | None = None


class ConversationsOpen(Answer):
    """``conversations.open``: the DM channel with a user."""

    channel: IdOnly | None = None


envelope_decoder = msgspec.json.Decoder(Envelope)
envelope_id_decoder = msgspec.json.Decoder(EnvelopeId)
callback_decoder = msgspec.json.Decoder(EventCallback)
event_decoder = msgspec.json.Decoder(Event)
block_actions_decoder = msgspec.json.Decoder(BlockActions)
answer_decoder = msgspec.json.Decoder(Answer)
auth_test_decoder = msgspec.json.Decoder(AuthTest)
connections_open_decoder = msgspec.json.Decoder(ConnectionsOpen)
posted_decoder = msgspec.json.Decoder(Posted)
history_decoder = msgspec.json.Decoder(History)
user_info_decoder = msgspec.json.Decoder(UserInfo)
conversations_open_decoder = msgspec.json.Decoder(ConversationsOpen)

_encoder = msgspec.json.Encoder()


def encode(obj: Any) -> bytes:
    """Compact JSON (request bodies, acknowledgements)."""
    return _encoder.encode(obj)
