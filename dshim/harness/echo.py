"""The echo harness: answers with exactly the prompt text it received.

What an agent would see is visible in the chat, which makes it the harness of tests,
replay and a fresh install.  Directives in the *current* text (the last text part):

- ``echo:slow N``   stream N deltas 0.5 s apart (for /stop and shutdown tests)
- ``echo:sleep S``  wait S seconds (up to 60), then answer at once (a slow agent, for
  benchmarks of head-of-line blocking)
- ``echo:fail``     end the turn with an error
- ``echo:approval`` ask for approval (allow once / allow always / reject) and answer with
  the decision that came back
- ``echo:question`` ask a two-option question (free text allowed) and answer with the
  answer that came back

Interactions are answered through the request's ``reply`` callback, the same way an ACP
agent's permission request is: the pipeline presents the request, waits for the user and
calls ``reply`` before it asks the harness for the next event.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncGenerator, Sequence

import trio

from dshim.errors import HarnessError
from dshim.harness.base import ModelInfo, TurnContext
from dshim.model import (
    ApprovalRequest,
    Option,
    PromptPart,
    QuestionRequest,
    TextDelta,
    TextPart,
    TurnEnd,
    TurnEvent,
)

DELTA_MAX = 64
_SLOW = re.compile(r"^echo:slow\s+(\d{1,4})\b")
_SLEEP = re.compile(r"^echo:sleep\s+(\d{1,2}(?:\.\d{1,3})?)\b")

APPROVAL_OPTIONS = [
    Option(id="allow_once", label="Allow once", kind="allow_once"),
    Option(id="allow_always", label="Allow always", kind="allow_always"),
    Option(id="reject_once", label="Reject", kind="reject_once"),
]
QUESTION_OPTIONS = [
    Option(id="red", label="Red"),
    Option(id="blue", label="Blue"),
]


class _Answer:
    """Collects what the pipeline passed to a request's ``reply`` callback."""

    def __init__(self) -> None:
        self.replied = False
        self.option_id: str | None = None
        self.selected: list[str] = []
        self.custom: str | None = None

    async def decide(self, option_id: str | None) -> None:
        self.replied = True
        self.option_id = option_id

    async def answer(self, selected: list[str], custom: str | None) -> None:
        self.replied = True
        self.selected = list(selected)
        self.custom = custom


class EchoHarness:
    """Deterministic harness that streams the prompt back in deltas of <= 64 characters."""

    kind = "echo"

    def __init__(self, *, slow_interval_s: float = 0.5) -> None:
        self.slow_interval_s = slow_interval_s

    async def check(self) -> str:
        return "echo harness (always reachable)"

    async def create_session(self, *, title: str | None) -> str:
        return "echo-" + uuid.uuid4().hex[:16]

    async def prompt(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        texts = [p.text for p in parts if isinstance(p, TextPart)]
        text = "\n\n".join(texts)
        current = texts[-1].strip() if texts else ""
        if current.startswith("echo:fail"):
            yield TurnEnd(stop_reason="error", error="echo:fail requested a failure")
            return
        if current.startswith("echo:approval"):
            got = _Answer()
            yield ApprovalRequest(
                title="echo: run the scripted action",
                detail="The echo harness asks for permission; nothing is run.",
                options=list(APPROVAL_OPTIONS),
                reply=got.decide,
            )
            yield TextDelta(f"Approval decision: {got.option_id or 'cancelled'}")
            yield TurnEnd()
            return
        if current.startswith("echo:question"):
            got = _Answer()
            yield QuestionRequest(
                question="echo: which colour?",
                options=list(QUESTION_OPTIONS),
                allow_free_text=True,
                reply=got.answer,
            )
            if got.selected or got.custom:
                labels = {o.id: o.label for o in QUESTION_OPTIONS}
                chosen = [labels.get(s, s) for s in got.selected]
                if got.custom:
                    chosen.append(f"“{got.custom}”")
                yield TextDelta("Answer: " + ", ".join(chosen))
            else:
                yield TextDelta("Answer: (none, the question was cancelled)")
            yield TurnEnd()
            return
        pause = _SLEEP.match(current)
        if pause:
            await trio.sleep(min(60.0, float(pause.group(1))))
            current = current[pause.end() :].lstrip()  # "echo:sleep 2 echo:slow 5" does both
        m = _SLOW.match(current)
        if m:
            n = max(1, int(m.group(1)))
            size = max(1, -(-len(text) // n))
            for i in range(n):
                if i:
                    await trio.sleep(self.slow_interval_s)
                piece = text[i * size : (i + 1) * size]
                if piece:
                    yield TextDelta(piece)
        else:
            for i in range(0, len(text), DELTA_MAX):
                yield TextDelta(text[i : i + DELTA_MAX])
        yield TurnEnd()

    async def cancel(self, session_id: str) -> None:
        return None

    async def list_models(self, session_id: str | None) -> list[ModelInfo] | None:
        return None

    async def select_model(self, session_id: str, model: str) -> str:
        raise HarnessError("the echo harness offers no model selection", code="models-unsupported")

    async def steer(self, session_id: str, text: str) -> bool:
        return False

    async def aclose(self) -> None:
        return None
