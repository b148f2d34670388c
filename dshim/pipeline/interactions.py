"""Approvals and questions over IM (pending interactions of running turns).

This is the skeleton the harness adapters plug into: a turn that receives an
ApprovalRequest or QuestionRequest calls :meth:`Interactions.ask`; step 5 of the pipeline
calls :meth:`Interactions.try_answer` with the current input only.  Until an adapter
needs more, an approval is rejected and a question cancelled, and the user is told.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dshim.model import ApprovalRequest, InboundMessage, QuestionRequest

if TYPE_CHECKING:
    from dshim.pipeline.runtime import BotRuntime


class Interactions:
    def __init__(self, runtime: BotRuntime) -> None:
        self._rt = runtime

    async def try_answer(self, msg: InboundMessage) -> bool:
        """True when the message answered a pending interaction (and was consumed)."""
        return False

    def cancel_for(self, lane_key: tuple[str, str]) -> bool:
        """Reject pending interactions of a conversation (/stop).  True if any."""
        return False

    async def ask(self, request: ApprovalRequest | QuestionRequest, msg: InboundMessage) -> str:
        """Present a request and wait for the answer.  Returns a note for the transcript."""
        if isinstance(request, ApprovalRequest):
            if request.reply is not None:
                await request.reply(None)
            return "approval rejected: interactive approvals are not available"
        if request.reply is not None:
            await request.reply([], None)
        return "question cancelled: interactive questions are not available"
