"""Replay's output lines: what the pipeline decided, one JSON object each.

:class:`Lines` turns the pipeline's decisions (what an
:class:`dshim.pipeline.observer.Observer` sees) into the output lines of ``dshim replay``
(the ``expect`` list of a fixture).  Replay and ``dshim serve --capture`` both build their
lines with it, so a capture's ``expect`` is what ``dshim replay --update`` would write.
It lives below the pipeline so that capture, which the pipeline feeds, needs nothing of
the pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dshim.model import InboundMessage, PromptPart, ReplyTarget
from dshim.prompt import prompt_text

__all__ = ["DATA_DIR_MARK", "TEXT_PRINT_MAX", "Line", "Lines", "bounded"]

Line = dict[str, Any]
#: Printed texts (prompts, answers) longer than this are cut, with a note of how much.
TEXT_PRINT_MAX = 100_000
#: Printed in place of the data directory (saved files' paths in prompts).
DATA_DIR_MARK = "$DATA_DIR"


def bounded(text: str) -> str:
    """``text``, cut after :data:`TEXT_PRINT_MAX` characters with a note of the rest."""
    if len(text) <= TEXT_PRINT_MAX:
        return text
    return text[:TEXT_PRINT_MAX] + f"…[{len(text) - TEXT_PRINT_MAX} more characters]"


class Lines:
    """Builds replay's output lines (without the ``fixture`` key).

    ``data_dir``: the data directory of the run; inside texts it is written as
    :data:`DATA_DIR_MARK`, so the path of a saved file is the same from run to run.
    """

    def __init__(self, data_dir: Path | None = None) -> None:
        self._data_dir = str(data_dir.absolute()) if data_dir is not None else None

    def text(self, text: str) -> str:
        if self._data_dir is not None:
            text = text.replace(self._data_dir, DATA_DIR_MARK)
        return bounded(text)

    def drop(self, index: int, reason: str) -> Line | None:
        # Platform events that are not messages at all (channel posts, edits, service
        # messages, non-message dispatches) are not drops of a message: no line.
        if reason == "ignored":
            return None
        return {"kind": "drop", "index": index, "reason": reason}

    def command(self, index: int, name: str) -> Line:
        return {"kind": "command", "index": index, "name": name}

    def prompt(self, msg: InboundMessage, parts: list[PromptPart]) -> Line:
        return {
            "kind": "prompt",
            "conversation": msg.conversation_id,
            "thread": msg.thread_id,
            "text": self.text(prompt_text(parts)),
            "images": len(msg.images),
            "files": len(msg.files),
        }

    def send(self, target: ReplyTarget, text: str) -> Line:
        anchor = target.anchor
        if anchor is None:
            return {
                "kind": "send",
                "conversation": target.conversation_id,
                "reply_to": target.reply_to_message_id,
                "text": self.text(text),
            }
        # A substitute answer: placed by its own anchor, addressed to the asker.
        return {
            "kind": "send",
            "conversation": target.conversation_id,
            "reply_to": anchor.message_id,
            "anchor": anchor.mode,
            "mention": anchor.mention_id,
            "text": self.text(text),
        }

    def http(self, method: str, path: str) -> Line:
        return {"kind": "http", "method": method, "path": path}
