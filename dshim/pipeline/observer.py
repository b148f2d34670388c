"""What replay and tests may watch of the pipeline: its decisions, in order.

:class:`dshim.lines.Lines` turns those decisions into the output lines of ``dshim replay``
(the ``expect`` list of a fixture).
"""

from __future__ import annotations

from typing import Protocol

from dshim.model import InboundMessage, PromptPart, Skip

__all__ = ["Observer"]


class Observer(Protocol):
    """Hooks for replay and tests: what the pipeline decided, in order."""

    def on_drop(self, item: InboundMessage | Skip, reason: str) -> None: ...

    def on_command(self, msg: InboundMessage, name: str) -> None: ...

    def on_prompt(self, msg: InboundMessage, parts: list[PromptPart]) -> None: ...
