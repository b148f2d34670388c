"""Step 5: commands and batch input, judged on the current text only.

Quoted text never reaches this module: only ``InboundMessage.content`` (the user's own
text, addressing mention removed) is parsed.  A message with images or files is never a
command (the text is a caption), and neither is a forwarded message
(``InboundMessage.forwarded``: someone else's words) — the runtime does not ask.
Unknown ``/words`` are ordinary text for the harness.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

#: Commands dshim handles itself.  Harness-dependent ones (/models, /model, /steer) are
#: recognized here and answered by the runtime according to the harness' capabilities.
KNOWN_COMMANDS = frozenset(
    {
        "help",
        "new",
        "stop",
        "status",
        "batch",
        "send",
        "cancel",
        "models",
        "model",
        "steer",
        "substitute",
        "agent",
    }
)
#: Commands that take arguments; the rest must be sent exactly (an argument -> usage).
TAKES_ARGS = frozenset({"model", "steer", "substitute", "agent"})
BATCH_LIMIT = 10


class Command(msgspec.Struct, frozen=True):
    name: str  # without the slash, lower case
    args: str


def parse_command(text: str, bot_username: str | None) -> Command | None:
    """``/cmd`` or ``/cmd@botname`` at the start of the text (a leading space is fine).

    ``/cmd@otherbot`` is not for us and is ordinary text.  Returns None for anything that
    is not one of :data:`KNOWN_COMMANDS`.
    """
    s = text.lstrip()
    if not s.startswith("/") or len(s) < 2:
        return None
    head, _, rest = s.partition(" ")
    if "\n" in head:
        head, _, more = head.partition("\n")
        rest = more + (" " + rest if rest else "")
    name = head[1:]
    if "@" in name:
        name, _, target = name.partition("@")
        if bot_username is not None and target.lower() != bot_username.lower().lstrip("@"):
            return None
    name = name.lower()
    if name not in KNOWN_COMMANDS:
        return None
    return Command(name=name, args=rest.strip())


HELP_TEXT = """\
Commands:
/new — start a new conversation (the next message opens a new session)
/stop — stop the answer that is running now (queued messages stay)
/status — harness reachability, session, queue
/models, /model <n|id> — list or choose the agent's model
/steer <text> — add guidance to the running answer (when the agent supports it)
/batch — collect several messages (direct chats); /send submits them as one prompt, /cancel discards
/help — this list
Anything else is sent to the agent."""

#: Added to /help when the bot has substitute mode.
HELP_SUBSTITUTE = "/substitute status|on|off — answering for the people this bot stands in for, in this group (on/off: operators)"

AGENT_USAGE = (
    "Usage: /agent <command> [arguments] — e.g. /agent status. /help lists the agent's commands."
)


def help_text(agent_commands: Sequence[tuple[str, str]] = ()) -> str:
    """``/help``: dshim's commands, then the agent's own (name, description) ones.

    An agent command with the name of a dshim command is reached with ``/agent <name>``;
    the others are passed to the agent as they are typed.
    """
    if not agent_commands:
        return HELP_TEXT
    lines = []
    for name, description in agent_commands[:50]:
        typed = f"/agent {name}" if name.lower() in KNOWN_COMMANDS else f"/{name}"
        lines.append(f"{typed} — {description}" if description else typed)
    return (
        HELP_TEXT
        + "\n\nThe agent's own commands (/agent <command> [args] runs one, also one named"
        + " like a dshim command):\n"
        + "\n".join(lines)
    )


def agent_prompt(args: str) -> str:
    """The text ``/agent <command> [args]`` sends to the agent: ``/<command> [args]``."""
    return "/" + args.strip().lstrip("/")


BATCH_REFUSED_MEDIA = (
    "Batch mode collects text only: images, files or quoted messages are not collected. "
    "Send more text, /send to submit or /cancel to discard."
)


BATCH_REFUSED_FORWARD = (
    "Batch mode collects what you type: forwarded messages are not collected. "
    "Send more text, /send to submit or /cancel to discard."
)


def batch_prompt(texts: list[str]) -> str:
    """The single prompt a batch becomes."""
    sections = [f"[message {i}]\n{t}" for i, t in enumerate(texts, 1)]
    return f"The user sent {len(texts)} messages as one batch:\n\n" + "\n\n".join(sections)
