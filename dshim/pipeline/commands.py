"""Step 5: commands and batch input, judged on the current text only.

Quoted text never reaches this module: only ``InboundMessage.content`` (the user's own
text, addressing mention removed) is parsed.  A message with images or files is never a
command (the text is a caption), and neither is a forwarded message
(``InboundMessage.forwarded``: someone else's words) — the runtime does not ask.
Unknown ``/words`` are ordinary text for the harness.

Every command dshim handles itself is one row of :data:`COMMANDS`: its handler, whether it
takes arguments, and whether it may be used while a batch is being collected.  The runtime
parses (:func:`parse_command`), builds a :class:`CommandContext` and calls
:func:`dispatch`; a handler answers through the context (a notice, a lane item, or work
started under the bot's supervision) and finishes the message's inbox entry that way.
Harness-dependent commands (/models, /model, /steer) are answered according to the
harness' capabilities.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import msgspec
import structlog
import trio

from dshim.errors import HarnessError
from dshim.harness.base import HasAgentCommands
from dshim.model import InboundMessage
from dshim.pipeline.lanes import LaneItem
from dshim.pipeline.notices import short
from dshim.pipeline.substitute import chat_allowed

if TYPE_CHECKING:
    from dshim.config import BotConfig
    from dshim.harness.base import Harness
    from dshim.pipeline.batch import Batches, Step
    from dshim.pipeline.interactions import Interactions
    from dshim.pipeline.lanes import LaneSet
    from dshim.pipeline.substitute import SubstituteGate
    from dshim.store.base import Store

log = structlog.get_logger("dshim.pipeline")

STATUS_TIMEOUT_S = 5.0

#: What ``/substitute <word>`` asks for (English and Chinese words; none: status).
SUBSTITUTE_ACTIONS = {
    "": "status",
    "status": "status",
    "on": "on",
    "enable": "on",
    "开启": "on",
    "开": "on",
    "off": "off",
    "disable": "off",
    "关闭": "off",
    "关": "off",
}


class Command(msgspec.Struct, frozen=True):
    name: str  # without the slash, lower case
    args: str


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


def batch_prompt(texts: list[str]) -> str:
    """The single prompt a batch becomes."""
    sections = [f"[message {i}]\n{t}" for i, t in enumerate(texts, 1)]
    return f"The user sent {len(texts)} messages as one batch:\n\n" + "\n\n".join(sections)


# -- the handlers ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CommandContext:
    """What a command handler may use: the message, its command, and the bot's parts.

    ``reply`` answers the message with a notice and finishes its inbox entry; ``finish``
    only finishes it.  ``enqueue`` puts a lane item on the conversation's lane (the item
    finishes the entry).  ``spawn`` runs slow work (a harness call) under the bot's
    supervision without holding up the reader; ``batch_step`` carries out a batch step.
    """

    msg: InboundMessage
    command: Command
    bot: BotConfig
    harness: Harness
    store: Store
    clock: Callable[[], float]
    lanes: LaneSet
    interactions: Interactions
    substitute: SubstituteGate
    batches: Batches
    reply: Callable[[str], Awaitable[None]]
    finish: Callable[[], Awaitable[None]]
    enqueue: Callable[[LaneItem], Awaitable[None]]
    spawn: Callable[[Callable[[], Awaitable[None]]], None]
    batch_step: Callable[[Step], Awaitable[None]]


Handler = Callable[[CommandContext], Awaitable[None]]


def _inbox_keys(msg: InboundMessage) -> list[tuple[str, str]]:
    return [(msg.conversation_id, msg.message_id)]


def agent_commands(harness: Harness) -> list[tuple[str, str]]:
    """The agent's own commands as (name, description), when the harness lists them."""
    if not isinstance(harness, HasAgentCommands):
        return []
    return [(c.name, c.description) for c in harness.agent_commands]


async def _help(ctx: CommandContext) -> None:
    text = help_text(agent_commands(ctx.harness))
    if ctx.bot.substitute.enabled:
        text = text.replace("\n/help", f"\n{HELP_SUBSTITUTE}\n/help", 1)
    await ctx.reply(text)


async def _agent(ctx: CommandContext) -> None:
    if not ctx.command.args:
        await ctx.reply(AGENT_USAGE)
        return
    await ctx.enqueue(
        LaneItem(
            kind="turn",
            msg=ctx.msg,
            text=agent_prompt(ctx.command.args),
            inbox_keys=_inbox_keys(ctx.msg),
            agent_command=True,
        )
    )


async def _stop(ctx: CommandContext) -> None:
    msg = ctx.msg
    lane = ctx.lanes.get(msg.lane_key)
    stopped = lane.stop() if lane is not None else False
    rejected = ctx.interactions.cancel_for(msg.lane_key)
    if stopped:
        log.info("turn_stop_requested", conversation=msg.conversation_id)
        await ctx.finish()  # the stopped answer tells the user
    elif rejected:
        await ctx.reply("Stopped: the pending request was rejected.")
    else:
        await ctx.reply("Nothing to stop.")


async def _new(ctx: CommandContext) -> None:
    # On the lane, so it takes effect after the answers queued before it.
    await ctx.enqueue(LaneItem(kind="new", msg=ctx.msg, inbox_keys=_inbox_keys(ctx.msg)))


async def _batch(ctx: CommandContext) -> None:
    await ctx.batch_step(ctx.batches.command(ctx.msg, ctx.command.name))


async def _status(ctx: CommandContext) -> None:
    ctx.spawn(partial(_status_reply, ctx))


async def _status_reply(ctx: CommandContext) -> None:
    harness = ctx.harness
    try:
        with trio.fail_after(STATUS_TIMEOUT_S):
            detail = await harness.check()
        harness_line = f"Harness ({harness.kind}): reachable — {detail}"
    except (HarnessError, trio.TooSlowError, OSError) as exc:
        harness_line = f"Harness ({harness.kind}): NOT reachable — {short(exc)}"
    binding = await ctx.store.get_binding(ctx.bot.name, *ctx.msg.lane_key)
    if binding is None:
        session_line = "Session: none bound (the next message starts one)"
    else:
        title = f" “{binding.title}”" if binding.title else ""
        session_line = f"Session: bound{title}"
    lane = ctx.lanes.get(ctx.msg.lane_key)
    running = 1 if lane is not None and lane.running is not None else 0
    queued = lane.queued if lane is not None else 0
    queue_line = f"Queue: {'1 answer running' if running else 'nothing running'}, {queued} waiting"
    await ctx.reply("\n".join([harness_line, session_line, queue_line]))


HarnessText = Callable[[CommandContext, "str | None"], Awaitable[str]]


def _harness_command(text: HarnessText) -> Handler:
    """A command answered by the harness: run off the reader, its refusal shown."""

    async def handler(ctx: CommandContext) -> None:
        ctx.spawn(partial(_harness_reply, ctx, text))

    return handler


async def _harness_reply(ctx: CommandContext, text: HarnessText) -> None:
    binding = await ctx.store.get_binding(ctx.bot.name, *ctx.msg.lane_key)
    session = binding.session_id if binding else None
    try:
        answer = await text(ctx, session)
    except HarnessError as exc:
        answer = f"The agent refused: {short(exc)}"
    await ctx.reply(answer)


async def _steer_text(ctx: CommandContext, session: str | None) -> str:
    args = ctx.command.args
    if not args:
        return "Usage: /steer <text>"
    lane = ctx.lanes.get(ctx.msg.lane_key)
    if lane is None or lane.running is None or session is None:
        return "Nothing is running to steer."
    if await ctx.harness.steer(session, args):
        return "Sent to the running answer."
    return "Steering is not supported by this agent; the message was not queued."


async def _model_text(ctx: CommandContext, session: str | None) -> str:
    """``/models`` and ``/model [n|id]`` (no argument: the list)."""
    harness, command = ctx.harness, ctx.command
    models = await harness.list_models(session)
    if models is None:
        return "This agent does not offer model selection."
    if command.name == "models" or not command.args:
        lines = [f"{i}. {m.id}{' (current)' if m.current else ''}" for i, m in enumerate(models, 1)]
        return "Models:\n" + "\n".join(lines) if lines else "The agent lists no models."
    choice = command.args.strip()
    if choice.isdigit():
        index = int(choice)
        if not 1 <= index <= len(models):
            return f"There is no model {index}; /models lists {len(models)}."
        choice = models[index - 1].id
    if session is None:
        session = await harness.create_session(title=None)
        await ctx.store.set_binding(
            ctx.bot.name, *ctx.msg.lane_key, session, title=None, now=ctx.clock()
        )
    selected = await harness.select_model(session, choice)
    return f"Model set to {selected}."


async def _substitute(ctx: CommandContext) -> None:
    await ctx.reply(await _substitute_text(ctx))


async def _substitute_text(ctx: CommandContext) -> str:
    """``/substitute status|on|off`` (see :mod:`dshim.pipeline.substitute`)."""
    msg = ctx.msg
    action = SUBSTITUTE_ACTIONS.get(ctx.command.args.strip().lower())
    if action is None:
        return "Usage: /substitute status|on|off"
    if msg.conversation_type != "group":
        return "/substitute works only in groups: it controls answering for others there."
    if not msg.mentioned:
        return "Mention me to use /substitute in a group (for example: @bot /substitute status)."
    cfg = ctx.bot.substitute
    if not cfg.enabled:
        return "Substitute mode is not enabled for this bot (see [bots.substitute] in the configuration)."
    if msg.in_thread and not cfg.topic_groups:
        return "Substitute mode is disabled for topic groups and threads on this bot (topic_groups = false)."
    if not chat_allowed(cfg, msg.conversation_id):
        return "Substitute mode does not apply to this chat (it is not in the bot's chats list)."
    if action != "status":
        if not ctx.bot.access.operates(msg.sender_id):
            return "Only the bot's operators may turn substitute mode on or off."
        await ctx.substitute.set_on(msg.conversation_id, action == "on")
        log.info("substitute_toggled", on=action == "on", conversation=msg.conversation_id)
    on = await ctx.substitute.is_on(msg.conversation_id)
    names = ", ".join(t.name or t.prompt_id() for t in cfg.targets)
    state = "on" if on else "off"
    return f"Substitute mode is {state} in this chat (answering for: {names})."


# -- the table -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CommandSpec:
    """One command: its handler; ``takes_args`` (else an argument gets the usage);
    ``in_batch``: usable while a batch is being collected (else refused until /send or
    /cancel)."""

    handler: Handler
    takes_args: bool = False
    in_batch: bool = False


#: Every command dshim handles itself, by name (without the slash, lower case).
COMMANDS: dict[str, CommandSpec] = {
    "help": CommandSpec(_help, in_batch=True),
    "new": CommandSpec(_new),
    "stop": CommandSpec(_stop, in_batch=True),
    "status": CommandSpec(_status, in_batch=True),
    "batch": CommandSpec(_batch, in_batch=True),
    "send": CommandSpec(_batch, in_batch=True),
    "cancel": CommandSpec(_batch, in_batch=True),
    "models": CommandSpec(_harness_command(_model_text)),
    "model": CommandSpec(_harness_command(_model_text), takes_args=True),
    "steer": CommandSpec(_harness_command(_steer_text), takes_args=True),
    "substitute": CommandSpec(_substitute, takes_args=True),
    "agent": CommandSpec(_agent, takes_args=True),
}
#: Commands dshim handles itself; other ``/words`` are text for the harness.
KNOWN_COMMANDS = frozenset(COMMANDS)
#: Commands that take arguments; the rest must be sent exactly (an argument -> usage).
TAKES_ARGS = frozenset(name for name, spec in COMMANDS.items() if spec.takes_args)


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


async def dispatch(ctx: CommandContext, *, batching: bool) -> None:
    """Run a parsed command through :data:`COMMANDS` (``batching``: a batch is open in
    the conversation)."""
    name = ctx.command.name
    spec = COMMANDS[name]
    if ctx.command.args and not spec.takes_args:
        await ctx.reply(f"Usage: /{name} (without arguments). /help lists the commands.")
        return
    if batching and not spec.in_batch:
        await ctx.reply(
            "A batch is being collected: send /send to submit it or /cancel to discard it first."
        )
        return
    await spec.handler(ctx)
