"""Substitute mode: the bot answers a group message on behalf of the person it mentions.

People in a group @-mention the human owner or the on-call person, not the bot.  With
``[bots.substitute] enabled = true`` a group message that mentions one of the configured
targets becomes a turn the bot answers for that person.

Triggering is part of step 2 (before dedup and before any network call), in this order
— each check is cheaper than the next and the first that fails ends it:

1. substitute is enabled and the message is in a group;
2. the chat passes the ``chats`` allow-list (memory only);
3. topics/threads: only with ``topic_groups = true``;
4. the chat's toggle is on (``/substitute on|off``; persisted, default on);
5. one of the message's structured mentions (in order; mentions inside a quote are not
   in the list) matches a target — first match wins; ids compare by kind only
   (open_id with open_id ...; a Telegram username case-insensitively), an email or a
   name never matches;
6. the slash guard: text that starts with ``/`` after its leading mentions is not a
   trigger (so "@owner /new" cannot run a command).

Step 4 still applies afterwards: a sender the access policy refuses is ``denied``.  A
message that mentions both the bot and a target is an ordinary addressed message that is
also a substitute turn.  The decision (:class:`~dshim.model.SubstituteTurn`) travels
with the message's inbox entry, so a queued turn or one resumed after a restart answers
under its own trigger whatever happened since.

Reply anchors: each substitute turn records its anchor (the trigger, or the thread root)
in the store under its own message id; a conversation keeps the newest
:data:`ANCHORS_PER_SESSION`.  The turn looks its own anchor up when it starts: found ->
``thread`` or ``quote`` per ``reply_mode``; evicted -> a plain message, never another
turn's anchor.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgspec
import structlog

from dshim.config import BotConfig, SubstituteConfig, SubstituteTarget
from dshim.errors import DshimError, TransportError
from dshim.model import Anchor, InboundMessage, Mention, ReplyTarget, SubstituteTurn
from dshim.outbound import ControlNotice, FindsDirectTargets, Outbound, control_presenter
from dshim.pipeline.notices import Notifier
from dshim.store.base import Store
from dshim.text import AUTHOR_NAME_MAX, cut, single_line

__all__ = [
    "ANCHORS_PER_SESSION",
    "SubstituteGate",
    "anchor_for",
    "match_target",
    "control_notice_text",
    "decide",
    "send_control_notice",
    "slash_guarded",
]

log = structlog.get_logger("dshim.substitute")

#: Reply anchors kept per conversation (+ thread); older ones fall back to plain messages.
ANCHORS_PER_SESSION = 32
#: How much of the asker's text the operators' control notice quotes.
NOTICE_QUOTE_MAX = 200

_TOGGLE_CURSOR = "substitute:"
_NOTICE_CURSOR = "substitute_notice:"


def chat_allowed(cfg: SubstituteConfig, conversation_id: str) -> bool:
    """The ``chats`` allow-list (empty: every group)."""
    return not cfg.chats or conversation_id in cfg.chats


def _matches(target: SubstituteTarget, mention: Mention) -> str | None:
    """The kind by which ``mention`` is ``target`` (None: it is not)."""
    wanted = target.ids()
    for kind, value in mention.ids.items():
        expected = wanted.get(kind)
        if expected is None or not value:
            continue
        if kind == "username":
            if value.lstrip("@").lower() == expected.lower():
                return kind
        elif value == expected:
            return kind
    return None


def match_target(
    msg: InboundMessage, cfg: SubstituteConfig
) -> tuple[SubstituteTarget, Mention, str] | None:
    """The first mention (in message order) that is a target: (target, mention, kind)."""
    for mention in msg.mentions:
        for target in cfg.targets:
            kind = _matches(target, mention)
            if kind is not None:
                return target, mention, kind
    return None


def slash_guarded(msg: InboundMessage) -> bool:
    """Does the text start with ``/`` once its leading mentions are stripped?"""
    text = msg.content.lstrip()
    texts = [m.text for m in msg.mentions if m.text]
    stripped = True
    while stripped and text:
        stripped = False
        for t in texts:
            if text.startswith(t):
                text = text[len(t) :].lstrip()
                stripped = True
    return text.startswith("/")


def _untrusted(value: str | None) -> str | None:
    if value is None:
        return None
    text, _ = cut(single_line(value), AUTHOR_NAME_MAX)
    return text or None


def decide(msg: InboundMessage, cfg: SubstituteConfig) -> SubstituteTurn | None:
    """Checks 5 and 6 (the mention and the slash guard) on a message that passed 1-4."""
    found = match_target(msg, cfg)
    if found is None or slash_guarded(msg):
        return None
    target, mention, kind = found
    mentioned_id = mention.ids.get(kind)
    if mentioned_id is not None and kind == "username":
        mentioned_id = "@" + mentioned_id.lstrip("@")
    return SubstituteTurn(
        target_id=target.prompt_id(),
        target_name=target.name,
        mentioned_id=_untrusted(mentioned_id),
        mentioned_name=_untrusted(mention.name),
        disclosure=cfg.disclosure,
        reply_mode=cfg.reply_mode,
        anchor_id=msg.thread_id or msg.message_id,
        stream=cfg.stream,
        in_topic=msg.in_thread,
    )


def anchor_for(msg: InboundMessage, sub: SubstituteTurn, *, kept: bool) -> Anchor:
    """Where the answer of ``msg``'s substitute turn goes (``kept``: its anchor is still
    among the conversation's newest)."""
    return Anchor(
        mode=sub.reply_mode if kept else "plain",
        message_id=sub.anchor_id if kept else None,
        mention_id=msg.sender_id,
        mention_name=msg.sender_name,
    )


class SubstituteGate:
    """A bot's substitute state: the per-chat toggles (cached) and the anchors."""

    def __init__(
        self,
        bot: BotConfig,
        store: Store,
        clock: Callable[[], float],
        *,
        targets: Sequence[SubstituteTarget] | None = None,
    ) -> None:
        self.bot = bot
        #: ``targets``: the channel's resolved copy of the configured targets (matching
        #: and the prompt's target id use it); the configuration itself is untouched.
        self.cfg = (
            bot.substitute
            if targets is None
            else msgspec.structs.replace(bot.substitute, targets=list(targets))
        )
        self.store = store
        self.clock = clock
        self._toggles: dict[str, bool] = {}

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled and bool(self.cfg.targets)

    async def is_on(self, conversation_id: str) -> bool:
        """The chat's toggle (default on), read once from the store, then from memory."""
        on = self._toggles.get(conversation_id)
        if on is None:
            value = await self.store.get_cursor(self.bot.name, _TOGGLE_CURSOR + conversation_id)
            on = value != "off"
            self._toggles[conversation_id] = on
        return on

    async def set_on(self, conversation_id: str, on: bool) -> None:
        await self.store.set_cursor(
            self.bot.name, _TOGGLE_CURSOR + conversation_id, "on" if on else "off"
        )
        self._toggles[conversation_id] = on

    async def evaluate(self, msg: InboundMessage) -> SubstituteTurn | None:
        """Checks 1-6 for a group message; the turn to run, or None."""
        cfg = self.cfg
        if not self.enabled or msg.conversation_type != "group":
            return None
        if not chat_allowed(cfg, msg.conversation_id):
            return None
        if msg.in_thread and not cfg.topic_groups:
            return None
        if not msg.mentions:  # nothing can match: spare the toggle lookup
            return None
        if not await self.is_on(msg.conversation_id):
            return None
        return decide(msg, cfg)

    async def remember_anchor(self, msg: InboundMessage, sub: SubstituteTurn) -> None:
        await self.store.put_anchor(
            self.bot.name,
            msg.conversation_id,
            msg.thread_id or "",
            msg.message_id,
            sub.anchor_id,
            now=self.clock(),
            keep=ANCHORS_PER_SESSION,
        )

    async def target_for(self, msg: InboundMessage, target: ReplyTarget) -> ReplyTarget:
        """``target`` placed by the turn's own anchor (plain when it was evicted)."""
        sub = msg.substitute
        if sub is None:
            return target
        anchor = await self.store.get_anchor(
            self.bot.name, msg.conversation_id, msg.thread_id or "", msg.message_id
        )
        kept = anchor is not None
        if not kept:
            log.info("substitute_anchor_evicted", message_id=msg.message_id)
        return ReplyTarget(
            conversation_id=target.conversation_id,
            conversation_type=target.conversation_type,
            thread_id=target.thread_id,
            reply_to_message_id=target.reply_to_message_id if kept else None,
            route=target.route,
            anchor=anchor_for(msg, sub, kept=kept),
        )

    async def notice_due(self, session_id: str) -> bool:
        """True until the operators' control notice of this session reached one of them."""
        return await self.store.get_cursor(self.bot.name, _NOTICE_CURSOR + session_id) is None

    async def notice_sent(self, session_id: str) -> None:
        """Record that the session's control notice reached an operator (never again)."""
        await self.store.set_cursor(self.bot.name, _NOTICE_CURSOR + session_id, "sent")


def control_notice_text(msg: InboundMessage, bot_name: str) -> str:
    """The operators' DM when a substitute turn first opens a session in a chat."""
    chat = msg.conversation_title or msg.conversation_id
    who = msg.sender_name or msg.sender_id
    asked, was_cut = cut(single_line(msg.content), NOTICE_QUOTE_MAX)
    if was_cut:
        asked += "…"
    return (
        f"I am answering for you in {chat}: {who} asked “{asked}”.\n"
        "To take over: send /stop in that chat to stop the answer, or /substitute off"
        f" there (mentioning {bot_name}) to stop answering for you in that chat."
    )


async def direct_target(outbound: Outbound, user_id: str) -> ReplyTarget | None:
    """Where a DM to ``user_id`` goes: the channel's ``direct_target`` when it has one
    (platforms where a DM needs its own conversation id: :class:`FindsDirectTargets`),
    else the user id itself."""
    if not isinstance(outbound, FindsDirectTargets):
        return ReplyTarget(conversation_id=user_id, conversation_type="direct")
    return await outbound.direct_target(user_id)


async def send_control_notice(
    gate: SubstituteGate,
    outbound: Outbound,
    notifier: Notifier,
    msg: InboundMessage,
    session_id: str,
) -> None:
    """DM every operator (not the asker) once per session that a substitute turn opened.

    The notice counts as sent once a DM reached an operator (or may have: an unknown
    outcome is never sent again) and is recorded right then; when no DM got through, the
    session's next substitute turn tries again — once per turn, never in a loop."""
    if not gate.cfg.control_notice:
        return
    operators = [
        op for op in dict.fromkeys(map(str, gate.bot.access.operators)) if op != msg.sender_id
    ]
    if not operators or not await gate.notice_due(session_id):
        return
    text = control_notice_text(msg, outbound.bot_username or gate.bot.name)
    presenter = control_presenter(outbound)
    notice = ControlNotice(text=text, conversation_id=msg.conversation_id, thread_id=msg.thread_id)
    told = 0
    for op in operators:
        try:
            target = await direct_target(outbound, op)
            if target is None:
                continue
            if presenter is None:
                if not await notifier.send_now(target, text):  # failed (and logged)
                    continue
            else:  # with buttons: stop the answer, stop answering for them here
                await presenter(target, notice)
        except TransportError as exc:
            log.warning("control_notice_failed", operator=op, error=str(exc))
            if not exc.request_sent:
                continue  # it never left: nobody was told
        except DshimError as exc:
            log.warning("control_notice_failed", operator=op, error=str(exc))
            continue
        if not told:
            await gate.notice_sent(session_id)
        told += 1
    if told:
        log.info("control_notice_sent", operators=told)
    else:
        log.warning("control_notice_undelivered", operators=len(operators))
