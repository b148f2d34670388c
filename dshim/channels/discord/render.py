"""Discord outbound: the transport for :mod:`dshim.render`'s streaming-by-edit engine.

An answer is created as a reply to the user's message (``message_reference`` with
``fail_if_not_exists: false``, so a deleted original does not lose the answer) and never
pings anyone (``allowed_mentions {parse: [], replied_user: false}``: model output saying
``@everyone`` stays text).  It is then streamed by ``PATCH`` edits at most once per second
per message; text beyond 2,000 characters continues in follow-up messages (no reply
reference); the typing indicator is refreshed every 8 s until the first message is up
(Discord shows it for 10 s).  Pacing, splitting, retries and "the final text exactly
once" live in :mod:`dshim.render`.

Failures: a 5xx or a connection that could not be made or written is a
:class:`~dshim.errors.TransportError` the engine retries for ``send_retry_s``; a create
whose answer was lost is repeated like one too (``idempotent_sends``, below), and
:meth:`DiscordTransport.reachable` (``GET /users/@me``) tells the engine Discord answers
again.  A send still failing after that leaves the turn (the pipeline's outbox delivers
it later), never the bot.

Rate limits: bucket waits happen in the REST client; a 429 is handed to the engine at
once (``retries=0``), which pauses the chat and sends the *newest* text when it retries
instead of replaying a stale intermediate edit.  Every create carries a ``nonce`` with
``enforce_nonce``: a create retried after its response was lost returns the message that
already exists instead of posting a duplicate.

Buttons (message components: action rows of at most 5 buttons, at most 5 rows):

* A substitute control notice (:meth:`DiscordOutbound.send_control_notice`) is the
  notice text with one row of the :data:`~dshim.outbound.CONTROL_ACTIONS` buttons; their
  ``custom_id`` names the action and the chat (:func:`.protocol.control_custom_id`).
* An approval or question (:meth:`DiscordOutbound.open_interaction`) is a reply to the
  asking message with the request and one button per option (at most 25; allow options
  green, reject options red); a press is judged by the pipeline like the typed answer.
  When the pipeline stops waiting, the message is edited: the buttons go and the
  decision is shown (the starter's pressed option; a typed answer or a timeout shows
  that the request is closed, and the pipeline's own note follows).

Presses are answered in :mod:`.channel` (the 3 s callback).
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import structlog
import trio

from dshim.channels.base import (
    CONTROL_ACTIONS,
    ControlNotice,
    FindsDirectTargets,
    InteractionPrompt,
    PresentsControlNotices,
    PresentsInteractions,
)
from dshim.channels.discord import models as m
from dshim.channels.discord.client import RestClient
from dshim.channels.discord.protocol import (
    BUTTONS_MAX,
    ROW_MAX,
    Route,
    control_custom_id,
    option_custom_id,
)
from dshim.errors import ChannelError
from dshim.model import Delivered, Option, ReplyTarget
from dshim.render import EditOutbound, IdempotentSends, Limits, ProbesReachable

log = structlog.get_logger("dshim.discord")

#: Discord's message length limit, in code points.
MAX_MESSAGE_LEN = 2000
#: "Cannot reply without permission to read message history".
CANNOT_REPLY_CODE = 160002

#: 2,000 code points; the first message after ~1 s of text, then at most one edit a
#: second (the engine's defaults); typing lasts 10 s on Discord, so it is renewed every 8 s.
#: Typing only for a slow answer (1 s without text) and at most once per 8 s per channel:
#: a quick answer costs one REST call, not two, of the global 50 requests per second.
LIMITS = Limits(max_len=MAX_MESSAGE_LEN, typing_interval_s=8.0, typing_grace_s=1.0)


#: Button styles (interactions/message-components.mdx): primary, secondary, success, danger.
PRIMARY, SECONDARY, SUCCESS, DANGER = 1, 2, 3, 4
LABEL_MAX = 80
#: How long the closing edit of a request's message may take.
CLOSE_TIMEOUT_S = 10.0
#: The buttons' styles on a control notice.
CONTROL_STYLES = {"stop": DANGER, "disable": SECONDARY}
#: Shown on a request's message once its buttons no longer count (and no press decided).
CLOSED_NOTE = "This request is closed."


def split(text: str) -> list[str]:
    """The chunks a text is delivered in (2,000 characters each at most)."""
    return LIMITS.split(text)


def cut(text: str, limit: int = MAX_MESSAGE_LEN) -> str:
    """``text`` within ``limit`` code points (an ellipsis marks the cut)."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def button(label: str, custom_id: str, style: int = SECONDARY) -> dict[str, Any]:
    return {"type": 2, "style": style, "label": cut(label, LABEL_MAX), "custom_id": custom_id}


def action_rows(buttons: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Buttons in action rows of at most 5 (at most 25 buttons in 5 rows)."""
    buttons = buttons[:BUTTONS_MAX]
    return [
        {"type": 1, "components": buttons[i : i + ROW_MAX]} for i in range(0, len(buttons), ROW_MAX)
    ]


def control_components(notice: ControlNotice) -> list[dict[str, Any]]:
    """The control notice's row: stop the answer, stop answering for them there."""
    return action_rows(
        [
            button(
                label,
                control_custom_id(action, notice.conversation_id, notice.thread_id),
                CONTROL_STYLES.get(action, SECONDARY),
            )
            for action, label in CONTROL_ACTIONS
        ]
    )


def _option_style(option: Option) -> int:
    kind = option.kind or ""
    if kind.startswith("allow"):
        return SUCCESS
    if kind.startswith("reject"):
        return DANGER
    return PRIMARY


def option_components(prompt: InteractionPrompt, thread_id: str | None) -> list[dict[str, Any]]:
    """One button per option of a request (its label; numbered 1..n in ``custom_id``)."""
    return action_rows(
        [
            button(o.label or str(i), option_custom_id(i, thread_id), _option_style(o))
            for i, o in enumerate(prompt.options[:BUTTONS_MAX], start=1)
        ]
    )


async def create_reply(
    rest: RestClient,
    channel_id: str,
    text: str,
    *,
    reply_to: str | None,
    **kw: Any,
) -> tuple[m.CreatedMessage, bool]:
    """A message under ``reply_to``; without the reference when the bot may not read the
    channel's history (Discord refuses such a reply with 160002).  The flag says whether
    a reply was possible."""
    try:
        return await rest.create_message(channel_id, text, reply_to=reply_to, **kw), True
    except ChannelError as exc:
        if reply_to is None or exc.code != CANNOT_REPLY_CODE:
            raise
    return await rest.create_message(channel_id, text, **kw), False


class DiscordTransport(IdempotentSends, ProbesReachable):
    """One answer's messages in one channel (see :class:`dshim.render.StreamTransport`)."""

    #: Creates carry ``nonce`` + ``enforce_nonce``: a create repeated after its response
    #: was lost returns the existing message, so the engine may retry unknown outcomes.
    idempotent_sends = True

    def __init__(self, rest: RestClient, target: ReplyTarget) -> None:
        self.rest = rest
        self.channel_id = target.thread_id or target.conversation_id
        self.reply_to = target.reply_to_message_id
        # A nonce per logical message: retries of the same message reuse it.
        self._nonce_base = secrets.token_hex(8)
        self._sent = 0
        #: A substitute answer: a thread to open on the anchor first, and the asker to
        #: mention (and ping: only them) in the first message.
        self._thread_on: str | None = None
        self._thread_name = "answer"
        self._ping: str | None = None
        self._first_id: str | None = None
        anchor = target.anchor
        if anchor is not None:
            self._ping = anchor.mention_id
            self._thread_name = f"{anchor.mention_name or 'Answer'}: answered for them"
            if anchor.mode == "plain":
                self.reply_to = None
            elif anchor.mode == "quote":
                self.reply_to = anchor.message_id
            elif target.thread_id is not None:  # already in a thread: continue it
                self.reply_to = None
            else:
                self._thread_on = anchor.message_id
                self.reply_to = None

    def _addressed(self, text: str) -> str:
        if self._ping is None:
            return text
        out = f"<@{self._ping}> {text}"
        return out if len(out) <= MAX_MESSAGE_LEN else text

    async def _open_thread(self) -> None:
        anchor, self._thread_on = self._thread_on, None
        if anchor is None:
            return
        try:
            thread = await self.rest.start_thread(
                self.channel_id, anchor, self._thread_name, retries=0
            )
        except ChannelError as exc:  # no permission, a thread exists already ...
            log.info("reply_thread_failed", code=exc.code, error=str(exc))
            self.reply_to = anchor  # still under the trigger, as a reply
            return
        self.channel_id = thread.id

    async def send(self, text: str, *, reply: bool) -> str:
        if self._thread_on is not None:
            await self._open_thread()
        ping = self._ping if self._first_id is None else None
        if ping is not None:
            text = self._addressed(text)
        nonce = f"{self._nonce_base}{self._sent:03d}"
        reply_to = self.reply_to if reply else None
        created, replied = await create_reply(
            self.rest, self.channel_id, text, reply_to=reply_to, nonce=nonce, retries=0, ping=ping
        )
        if not replied:
            self.reply_to = None  # no Read Message History: later sends skip the reference
        self._sent += 1
        if self._first_id is None:
            self._first_id = created.id
        if created.content is not None and created.content != text:
            # The nonce matched a create whose response we lost, with older text.
            await self.rest.edit_message(self.channel_id, created.id, text, retries=0)
        return created.id

    async def edit(self, message_id: str, text: str) -> None:
        if message_id == self._first_id:
            text = self._addressed(text)
        await self.rest.edit_message(self.channel_id, message_id, text, retries=0)

    async def typing(self) -> None:
        await self.rest.trigger_typing(self.channel_id, retries=0)

    async def reachable(self) -> None:
        """Discord answers again: ``GET /users/@me``, its cheapest identity call (the
        engine's probe before repeating a send it is unsure of; the REST client waits
        out 429s as usual)."""
        await self.rest.get_current_user()


class _Shown:
    """A request shown with buttons: who may decide, and the option they pressed."""

    def __init__(self, starter: str | None) -> None:
        self.starter = starter
        self.pressed: int | None = None


class DiscordButtons(PresentsControlNotices, PresentsInteractions):
    """The buttons part of :class:`DiscordOutbound`: control notices and requests."""

    rest: RestClient
    clock: Callable[[], float]

    def __init__(self) -> None:
        #: message id -> the request it shows, while the pipeline waits for an answer.
        self._shown: dict[str, _Shown] = {}

    def showing(self, message_id: str) -> bool:
        """The message is a request whose buttons still count."""
        return message_id in self._shown

    def note_press(self, message_id: str, user_id: str, number: int) -> None:
        """A button of a shown request was pressed: the first press of its starter is
        the decision shown when it closes (the pipeline judges the press itself)."""
        shown = self._shown.get(message_id)
        if shown is None or shown.pressed is not None:
            return
        if shown.starter is None or shown.starter == user_id:
            shown.pressed = number

    async def send_control_notice(
        self, target: ReplyTarget, notice: ControlNotice
    ) -> list[Delivered]:
        """The substitute control notice in an operator's DM, with its two buttons."""
        sent_at = self.clock()
        text = cut(notice.text)
        created = await self.rest.create_message(
            target.thread_id or target.conversation_id,
            text,
            nonce=secrets.token_hex(8),
            components=control_components(notice),
        )
        return [Delivered(message_id=created.id, text=text, sent_at=sent_at, completed_at=sent_at)]

    @asynccontextmanager
    async def open_interaction(
        self, target: ReplyTarget, prompt: InteractionPrompt
    ) -> AsyncIterator[list[Delivered]]:
        """Show a request with buttons until the block ends (see the module docstring)."""
        channel_id = target.thread_id or target.conversation_id
        sent_at = self.clock()
        text = cut(prompt.prompt)
        created, _ = await create_reply(
            self.rest,
            channel_id,
            text,
            reply_to=target.reply_to_message_id,
            nonce=secrets.token_hex(8),
            components=option_components(prompt, target.thread_id),
        )
        starter = target.route.user_id if isinstance(target.route, Route) else None
        shown = _Shown(starter)
        self._shown[created.id] = shown
        try:
            yield [
                Delivered(message_id=created.id, text=text, sent_at=sent_at, completed_at=sent_at)
            ]
        finally:
            del self._shown[created.id]
            number = shown.pressed
            if number is not None and number <= len(prompt.options):
                note = f"→ {prompt.options[number - 1].label or number}"
            else:
                note = CLOSED_NOTE
            with trio.CancelScope(shield=True), trio.move_on_after(CLOSE_TIMEOUT_S):
                try:
                    await self.rest.edit_message(
                        channel_id, created.id, cut(f"{text}\n\n{note}"), components=[]
                    )
                except ChannelError as exc:
                    log.info("interaction_update_failed", code=exc.code, error=str(exc)[:200])


class DiscordOutbound(DiscordButtons, EditOutbound, FindsDirectTargets):
    """The channel's :class:`dshim.outbound.Outbound`: replies, notices, streamed answers,
    control notices and requests with buttons."""

    def __init__(
        self,
        rest: RestClient,
        *,
        clock: Callable[[], float],
        bot_username: str | None = None,
        limits: Limits = LIMITS,
    ) -> None:
        EditOutbound.__init__(self, limits=limits, clock=clock, bot_username=bot_username)
        DiscordButtons.__init__(self)
        self.rest = rest

    def transport(self, target: ReplyTarget) -> DiscordTransport:
        return DiscordTransport(self.rest, target)

    async def direct_target(self, user_id: str) -> ReplyTarget:
        """A DM to ``user_id`` goes to its DM channel (opened on first use)."""
        channel = await self.rest.open_dm(user_id)
        return ReplyTarget(conversation_id=channel.id, conversation_type="direct")
