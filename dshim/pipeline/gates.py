"""Steps 1-4 as pure judgements: which messages never become work.

:func:`judge` looks at one normalized message and the bot's rules and says why it must be
dropped, or ``None`` when it goes on.  It is sans-IO (no store, no clock: ``now`` is an
argument), so the runtime decides what each verdict costs:

========== ======================================================================
reason     what the runtime does with it
========== ======================================================================
echo       step 1: the bot's own message coming back — dropped
bot        step 1: another bot — dropped
unaddressed step 2: a group message not addressed to the bot — dropped
stale      step 3: older than the backlog limit — dropped (``duplicate`` when its
           key was already accepted, so a redelivered old message is reported as
           what it is); a stale command is never run
ignored    nothing for the agent: no text (after :func:`~dshim.text.clean_text`:
           whitespace, zero-width and control characters do not count), no image,
           no file, no quote — a sticker, a poll, an empty forward; not a turn
denied     step 4: the access policy refuses the current sender — the dedup key is
           recorded first (step 3 comes before step 4), then it is dropped
========== ======================================================================

The gates come in DESIGN.md's order and only read the *current* message: its sender,
its addressing, its time.  A quoted message never changes a verdict and nothing here
triggers a lookup.
"""

from __future__ import annotations

from dshim.config import AccessConfig
from dshim.model import DropReason, InboundMessage
from dshim.text import REMOVED_CHARS, clean_text

__all__ = ["allowed", "judge"]


def allowed(msg: InboundMessage, access: AccessConfig) -> bool:
    """Step 4: may the current sender use the bot here?

    ``open``: everyone.  ``allowlist``: direct chats of the listed users only; every group
    message is denied.
    """
    if access.mode == "open":
        return True
    return msg.conversation_type == "direct" and access.allows(msg.sender_id)


def _has_text(text: str) -> bool:
    """Anything left after :func:`~dshim.text.clean_text` (cheap for ordinary text)."""
    s = text.strip()
    if not s:
        return False
    return s[0] not in REMOVED_CHARS or bool(clean_text(s))


def judge(
    msg: InboundMessage,
    *,
    bot_id: str,
    now: float,
    max_age_s: float,
    access: AccessConfig,
    substitute: bool = False,
) -> DropReason | None:
    """Why ``msg`` is dropped by steps 1-4 (the first gate that refuses it), or None.

    ``substitute``: the message is a substitute trigger (it mentions a person the bot
    answers for), which stands in for being addressed in step 2.
    """
    # Step 1: echoes of our own messages, and other bots.
    if msg.sender_id == msg.bot_id or msg.sender_id == bot_id:
        return "echo"
    if msg.sender_is_bot:
        return "bot"
    # Step 2: in groups only messages addressed to the bot.
    if msg.conversation_type == "group" and not msg.addressed and not substitute:
        return "unaddressed"
    # Step 3 (the part without the store): the backlog limit.
    if msg.received_at and now - msg.received_at > max_age_s:
        return "stale"
    # Nothing for the agent (a sticker, a poll, an empty forward): not a turn.
    if not (msg.images or msg.files or msg.reply_to is not None or _has_text(msg.content)):
        return "ignored"
    # Step 4: the access policy, on the current sender.
    if not allowed(msg, access):
        return "denied"
    return None
