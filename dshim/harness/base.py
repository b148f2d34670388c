"""The harness interface: one async contract, several adapters (echo, openai, acp).

A turn is ``async with aclosing(harness.prompt(session, parts, ctx)) as events``; the
events are :data:`dshim.model.TurnEvent` values and the last one is a
:class:`~dshim.model.TurnEnd`.  A harness instance belongs to one bot (an ACP agent
process is per bot) and is opened and closed by the bot's runtime.

Optional abilities, checked with ``isinstance``: :class:`ProbesCapabilities` (probe rows),
:class:`~dshim.model.ReadsHistory` (the backend's session history for quote recovery; it
lives in the model, so the quoted-reply layer needs nothing of the harness package),
:class:`ClosesSessions` (free a session when its conversation idles or is reset) and
:class:`HasAgentCommands` (the agent's own slash commands).

Current files that are not images reach a harness in the prompt's text already (the
``<dsh_im_files>`` block with each saved file's path, small UTF-8 text files inlined:
:mod:`dshim.prompt`), so a text-only adapter need do nothing more; the
:class:`~dshim.model.FilePart` parts that follow carry path, name, media type and size
for adapters that can hand files on (ACP: ``resource_link`` blocks).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Literal, Protocol, runtime_checkable

import msgspec

from dshim.model import PromptPart, TurnEvent


class TurnContext(msgspec.Struct, kw_only=True, frozen=True):
    """What a harness may know about the turn besides the prompt parts."""

    bot: str
    conversation_id: str
    thread_id: str | None
    sender_id: str
    conversation_type: str
    #: Notes for the user a harness adds while the turn ends (e.g. "the host did not
    #: stop in time"): the pipeline appends them to the final text of a stopped turn.
    notes: list[str] = msgspec.field(default_factory=list)


class ModelInfo(msgspec.Struct, kw_only=True, frozen=True):
    id: str
    name: str | None = None
    current: bool = False


class ProbeItem(msgspec.Struct, kw_only=True, frozen=True):
    """One line of ``dshim probe`` about a harness capability (image, models, steer...)."""

    name: str
    result: Literal["ok", "warn", "fail"]
    detail: str


@runtime_checkable
class ClosesSessions(Protocol):
    """Adapters whose backend holds resources per open session (ACP: a CLI process per
    session): the pipeline says when a conversation went idle (``reason="idle"``) or was
    reset by ``/new`` (``"new"``), so the session can be closed and later resumed."""

    async def close_session(self, session_id: str, *, reason: str) -> bool: ...


@runtime_checkable
class HasAgentCommands(Protocol):
    """Adapters that know the agent's own slash commands (ACP
    ``available_commands_update``): ``/help`` lists them, ``/agent <command>`` runs one."""

    @property
    def agent_commands(self) -> Sequence[AgentCommandInfo]: ...


class AgentCommandInfo(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str: ...


@runtime_checkable
class ProbesCapabilities(Protocol):
    """Adapters that can list their capabilities for ``dshim probe`` (after ``check``)."""

    async def probe_details(self) -> list[ProbeItem]: ...


class Harness(Protocol):
    kind: str

    async def check(self) -> str:
        """Reachability: returns a short detail, raises HarnessError when unreachable."""
        ...

    async def create_session(self, *, title: str | None) -> str:
        """Create a session and return its id."""
        ...

    def prompt(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        """Run one turn; yields events, ends with TurnEnd.  Cancellation stops the turn."""
        ...

    async def cancel(self, session_id: str) -> None:
        """Ask the backend to stop the running turn of a session (best effort)."""
        ...

    async def list_models(self, session_id: str | None) -> list[ModelInfo] | None:
        """Models to choose from, or None when the backend offers no selection."""
        ...

    async def select_model(self, session_id: str, model: str) -> str:
        """Select a model for a session; returns the selected id."""
        ...

    async def steer(self, session_id: str, text: str) -> bool:
        """Inject text into the running turn; False when not supported."""
        ...

    async def aclose(self) -> None: ...
