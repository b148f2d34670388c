"""Feishu outbound: CardKit streaming cards, the text fallback, reactions, approval cards.

Answers (:meth:`FeishuOutbound.open_stream`) reply to the user's message
(``messages/{id}/reply``; ``reply_in_thread`` when the prompt was in a topic) with a
CardKit card streamed by :mod:`dshim.render`'s engine through :class:`FeishuTransport`:

1. the first text creates the card entity (schema 2.0, ``streaming_mode``, one markdown
   element ``answer``) and sends it once as the reply; its message id goes to the
   outbound index at once (a quote of a card that is still streaming resolves);
2. each later text replaces the element's content with the full text so far, with a
   strictly increasing ``sequence`` per card, at most one update per
   :data:`EDIT_INTERVAL_S` (the platform allows 10 operations/s per card);
3. ``finish`` brings the element to the final text, then turns ``streaming_mode`` off
   with a summary of the first 50 characters.

Text beyond :data:`MAX_CARD_CHARS` continues in follow-up text messages.  Every message
create and reply and every card update carries a ``uuid`` derived from what it is (the
answered message, the slot, the sequence), so a retry after an unknown outcome is
deduplicated by Feishu (one success per uuid per hour): the sends are idempotent, and
the engine retries every failure, of unknown outcome too, for ``send_retry_s`` (120 s).
An answer still unconfirmed after that is handed to the pipeline's outbox as not
delivered (:meth:`FeishuStream.finish`): it is sent once more when Feishu is back, also
after a restart -- at worst one extra copy, never a lost answer.  A card
entity create takes no uuid (its body is ``type`` and ``data``): each slot's card is
created once and a repeated reply sends that same card, so the message Feishu delivered
is the one streamed into.  When CardKit is not permitted
(``cardkit:card:write`` missing) or fails, the answer falls back to a text reply edited in
place (``PUT messages/{id}``, at most 20 edits; after that the final text goes as a new
message); the reason is logged once per bot.

While the agent works the user's message carries an ``OnIt`` reaction, replaced by
``DONE`` at the end (Feishu has no typing API).  Agent markdown is escaped so it cannot
mention ``all`` or inject card elements (``&``, ``<``, ``>`` as character references).

Substitute answers (``target.anchor`` set) are text messages that start with the asker's
``<at user_id="ou_...">name</at>`` (only the first message of the answer), placed by
:func:`placement`: thread -> reply with ``reply_in_thread``, quote -> reply without it,
plain -> a message in the chat.  The operators' control notice
(:meth:`FeishuOutbound.send_control_notice`) is a card with the two control buttons sent
to their open_id.

Approvals and questions (:meth:`FeishuOutbound.open_interaction`): an interactive card
with the request and one button per option; a click comes back over the long
connection as ``card.action.trigger`` and is mapped to a message with that option's
text (see :mod:`.protocol`).  When the pipeline stops waiting, the card is replaced by
one that shows the decision, without buttons.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import structlog
import trio

from dshim.channels.base import (
    CONTROL_ACTIONS,
    ChannelStore,
    ControlNotice,
    InteractionPrompt,
    OutboundEntry,
    PresentsControlNotices,
    PresentsInteractions,
    WatchesDelivery,
)
from dshim.channels.feishu.client import RestClient
from dshim.channels.feishu.protocol import CARD_PERMISSION_CODES, ControlPress
from dshim.errors import (
    ChannelError,
    NotFound,
    PermissionDenied,
    RateLimited,
    StoreError,
    TransportError,
)
from dshim.model import Delivered, ReplyTarget
from dshim.render import (
    EditOutbound,
    EditStream,
    IdempotentSends,
    Limits,
    deliver_text,
    open_edit_stream,
)

log = structlog.get_logger("dshim.feishu")

#: One card carries at most this many characters (cards are limited to 30 KB).
MAX_CARD_CHARS = 28_000
EDIT_INTERVAL_S = 0.3
#: Feishu allows 20 edits of a text message; the last one is kept for the final text.
MAX_TEXT_EDITS = 20
ELEMENT_ID = "answer"
SUMMARY_CHARS = 50
LIMITS = Limits(
    max_len=MAX_CARD_CHARS,
    first_send_delay_s=0.3,
    edit_interval_s=EDIT_INTERVAL_S,
    typing_interval_s=None,
)
CLEANUP_TIMEOUT_S = 5.0
#: A reaction (the "working" marker) that takes longer is given up.
REACTION_TIMEOUT_S = 3.0
#: Showing a press's result on its card is given up after this (the reader waits).
CONTROL_PATCH_TIMEOUT_S = 2.0
#: Control notices remembered for showing a press's result (cleared when full).
MAX_NOTICES = 256
#: Tries to show an approval card before the pipeline falls back to text.
INTERACTION_ATTEMPTS = 3


def split(text: str) -> list[str]:
    """The chunks an answer is delivered in."""
    return LIMITS.split(text)


def escape_markdown(text: str) -> str:
    """Agent text as card markdown that shows literally: no ``<at>``, no injected tags."""
    return text.replace("&", "&#38;").replace("<", "&#60;").replace(">", "&#62;")


def escape_text(text: str) -> str:
    """Agent text for a text message: ``<at ...>`` must not mention anyone."""
    return text.replace("<at", "<\u200bat").replace("<AT", "<\u200bAT")


def uuid_for(*parts: str) -> str:
    """A stable idempotency key (≤ 50 chars) for one operation."""
    return hashlib.sha256("\x1f".join(parts).encode("utf-8")).hexdigest()[:40]


def streaming_card(text: str) -> str:
    """The CardKit 2.0 card of a streamed answer."""
    card = {
        "schema": "2.0",
        "config": {
            "streaming_mode": True,
            "summary": {"content": "…"},
            "streaming_config": {
                "print_frequency_ms": {"default": 70},
                "print_step": {"default": 1},
                "print_strategy": "fast",
            },
        },
        "body": {
            "elements": [
                {"tag": "markdown", "element_id": ELEMENT_ID, "content": escape_markdown(text)}
            ]
        },
    }
    return json.dumps(card, ensure_ascii=False, separators=(",", ":"))


def final_settings(text: str) -> str:
    summary = " ".join(text.split())[:SUMMARY_CHARS]
    return json.dumps(
        {"config": {"streaming_mode": False, "summary": {"content": summary}}},
        ensure_ascii=False,
        separators=(",", ":"),
    )


def at_tag(user_open_id: str, name: str | None) -> str:
    """A text message's mention of one person (``<at user_id="ou_...">name</at>``)."""
    shown = " ".join((name or "").replace("<", "").replace(">", "").split())
    return f'<at user_id="{user_open_id}">{shown}</at>'


def text_content(text: str, *, at: str | None = None) -> str:
    """A text message's content; ``at``: a mention (:func:`at_tag`) put before it."""
    body = escape_text(text) if at is None else f"{at} {escape_text(text)}"
    return json.dumps({"text": body}, ensure_ascii=False, separators=(",", ":"))


def interaction_card(
    prompt: InteractionPrompt, target: ReplyTarget, *, decision: str | None = None
) -> str:
    """An approval/question card: the request and one callback button per option
    (``decision`` set: the answered card, without buttons)."""
    elements: list[dict[str, Any]] = [
        {"tag": "markdown", "content": escape_markdown(prompt.prompt)}
    ]
    if decision is None:
        for number, option in enumerate(prompt.options, 1):
            label = str(option.label).strip() or str(number)
            value = {
                "dshim": 1,
                "answer": _answer_text(prompt, number - 1),
                "chat": target.conversation_id,
                "thread": target.thread_id or "",
                "kind": target.conversation_type,
            }
            elements.append(
                {
                    "tag": "button",
                    "text": {"tag": "plain_text", "content": label[:100]},
                    "type": "primary" if number == 1 else "default",
                    "behaviors": [{"type": "callback", "value": value}],
                }
            )
    else:
        elements.append({"tag": "markdown", "content": escape_markdown(decision)})
    card = {
        "schema": "2.0",
        "config": {"update_multi": True, "summary": {"content": prompt.prompt[:SUMMARY_CHARS]}},
        "header": {
            "title": {
                "tag": "plain_text",
                "content": "Approval needed" if prompt.kind == "approval" else "Question",
            }
        },
        "body": {"elements": elements},
    }
    return json.dumps(card, ensure_ascii=False, separators=(",", ":"))


def control_card(notice: ControlNotice, *, result: str | None = None) -> str:
    """A substitute control notice: its text and the :data:`CONTROL_ACTIONS` buttons
    (``result``: what the last press did, shown under the text; the buttons stay)."""
    elements: list[dict[str, Any]] = [{"tag": "markdown", "content": escape_markdown(notice.text)}]
    if result is not None:
        elements.append({"tag": "markdown", "content": escape_markdown(result)})
    for action, label in CONTROL_ACTIONS:
        value = {
            "dshim": 1,
            "control": action,
            "chat": notice.conversation_id,
            "thread": notice.thread_id or "",
        }
        elements.append(
            {
                "tag": "button",
                "text": {"tag": "plain_text", "content": label},
                "type": "danger" if action == "disable" else "default",
                "behaviors": [{"type": "callback", "value": value}],
            }
        )
    card = {
        "schema": "2.0",
        "config": {"update_multi": True, "summary": {"content": notice.text[:SUMMARY_CHARS]}},
        "header": {"title": {"tag": "plain_text", "content": "Answering for you"}},
        "body": {"elements": elements},
    }
    return json.dumps(card, ensure_ascii=False, separators=(",", ":"))


def _answer_text(prompt: InteractionPrompt, index: int) -> str:
    """What a button stands for: the option's label when that names it alone (and is not
    a number), else its 1-based number -- judged exactly like the typed answer."""
    options = prompt.options
    label = str(options[index].label).strip()
    folded = [" ".join(str(o.label).split()).casefold() for o in options]
    key = " ".join(label.split()).casefold()
    if label and not key.rstrip(".").isdigit() and folded.count(key) == 1:
        return label
    return str(index + 1)


def reply_target_id(target: ReplyTarget) -> str | None:
    """The message an answer replies to (a card click answers under its card)."""
    mid = target.reply_to_message_id
    if mid is not None and mid.startswith("card:"):
        return target.route if isinstance(target.route, str) else None
    return mid


def placement(target: ReplyTarget) -> tuple[str | None, bool]:
    """(the message to reply to or None for a message in the chat, ``reply_in_thread``).

    A substitute answer follows its anchor: ``thread`` replies to it in a thread (opened
    or continued), ``quote`` replies without the flag (a quote in the main flow),
    ``plain`` posts into the chat.  Inside a topic / thread the answer stays there
    (replying in-thread to its trigger): Feishu's ``thread_id`` is no message to reply
    to, and topic groups keep one session per topic.
    """
    anchor = target.anchor
    if anchor is None:
        return reply_target_id(target), target.thread_id is not None
    if anchor.mode == "plain":
        return None, False
    if target.thread_id is not None:
        return target.reply_to_message_id, True
    return anchor.message_id, anchor.mode == "thread"


def receive_id_type(conversation_id: str) -> str:
    """A message to a person by open_id (an operator's DM), else to a chat."""
    return "open_id" if conversation_id.startswith("ou_") else "chat_id"


@dataclass
class _Card:
    card_id: str
    sequence: int = 0
    closed: bool = False


@dataclass
class _Cardkit:
    """Whether CardKit works for this bot (turned off once, with the reason logged)."""

    enabled: bool = True
    reason: str | None = None

    def disable(self, exc: ChannelError) -> None:
        if self.enabled:
            self.enabled = False
            self.reason = str(exc)
            log.warning("cardkit_disabled", reason=str(exc)[:300], fallback="text")


def _cardkit_refused(exc: ChannelError) -> bool:
    return isinstance(exc, PermissionDenied) or exc.code in CARD_PERMISSION_CODES


class FeishuTransport(IdempotentSends):
    """One answer's :class:`~dshim.render.StreamTransport` (cards, or text edits)."""

    #: Every send carries a uuid: Feishu accepts one success per uuid, so repeats are safe.
    idempotent_sends = True

    def __init__(
        self,
        outbound: FeishuOutbound,
        target: ReplyTarget,
        *,
        stream: bool,
        key: str,
    ) -> None:
        self.outbound = outbound
        self.rest = outbound.rest
        self.target = target
        self.stream = stream
        self.key = key
        self.cards: dict[str, _Card] = {}
        self.edits: dict[str, int] = {}
        self.finishing = False
        self._slot = 0
        #: The text of the first attempt of each slot (what a repeat with its uuid gets).
        self._first_text: dict[int, str] = {}
        #: The card entity created for each slot (reused by a repeated send).
        self._slot_cards: dict[int, str] = {}
        #: A substitute answer: its first message mentions the asker (only them).
        anchor = target.anchor
        self._at = (
            at_tag(anchor.mention_id, anchor.mention_name)
            if anchor is not None and anchor.mention_id and anchor.mention_id.startswith("ou_")
            else None
        )
        self._first_id: str | None = None

    async def send(self, text: str, *, reply: bool) -> str:
        slot = self._slot
        # A repeat of a send with the same uuid gets back what the first attempt created,
        # with the first attempt's text: bring it to this text before it counts as sent.
        first = self._first_text.setdefault(slot, text)
        mid = await self._send(text if first == text else first, slot, reply=reply)
        if first != text:
            await self.edit(mid, text)
        self._slot += 1
        if self._first_id is None:
            self._first_id = mid
        await self.outbound.remember(self.target, mid, text)
        return mid

    def _at_for(self, message_id: str | None) -> str | None:
        """The asker's mention for the answer's first message (None for the others)."""
        if self._at is None or (self._first_id is not None and message_id != self._first_id):
            return None
        return self._at

    async def _send(self, text: str, slot: int, *, reply: bool) -> str:
        cardkit = self.outbound.cardkit
        if self._at is not None:  # a substitute answer: text, like a person's message
            return await self._post(
                "text", text_content(text, at=self._at_for(None)), slot, reply=reply
            )
        if reply and self.stream and cardkit.enabled:
            try:
                card_id = await self._card_for(slot, text)
            except ChannelError as exc:
                if not _cardkit_refused(exc) and isinstance(exc, (TransportError, RateLimited)):
                    raise  # transient: the engine retries (an unanswered create is orphaned)
                cardkit.disable(exc)
            else:
                content = json.dumps({"type": "card", "data": {"card_id": card_id}})
                mid = await self._post("interactive", content, slot, reply=True)
                self.cards.setdefault(mid, _Card(card_id))  # a repeat keeps the sequence
                return mid
        return await self._post("text", text_content(text), slot, reply=reply)

    async def _card_for(self, slot: int, text: str) -> str:
        """The card entity of ``slot``, created once.  A card create has no idempotency
        key, while the reply that sends it has: should the reply's outcome be unknown, its
        repeat (same uuid) may be answered with the message delivered the first time,
        which shows this card -- so the repeat sends this card again, never a new one."""
        card_id = self._slot_cards.get(slot)
        if card_id is None:
            card_id = await self.rest.create_card(streaming_card(text))
            self._slot_cards[slot] = card_id
        return card_id

    async def _post(self, msg_type: str, content: str, slot: int, *, reply: bool) -> str:
        uuid = uuid_for(self.key, "send", str(slot))
        parent, in_thread = placement(self.target)
        conversation = self.target.conversation_id
        for attempt in (1, 2):
            try:
                if parent is not None:
                    return await self.rest.reply(
                        parent, msg_type, content, uuid=uuid, in_thread=in_thread
                    )
                return await self.rest.create(
                    conversation,
                    msg_type,
                    content,
                    uuid=uuid,
                    receive_id_type=receive_id_type(conversation),
                )
            except NotFound:
                if parent is None:
                    raise
                parent = None  # the user's message is gone: post into the chat instead
            except TransportError as exc:
                if exc.code == 230049 and attempt == 1:
                    continue  # "being sent": once more with the same uuid
                raise
        raise TransportError("the message could not be confirmed", request_sent=True)

    async def edit(self, message_id: str, text: str) -> None:
        card = self.cards.get(message_id)
        if card is not None:
            card.sequence += 1
            try:
                await self.rest.card_content(
                    card.card_id,
                    ELEMENT_ID,
                    escape_markdown(text),
                    sequence=card.sequence,
                    uuid=uuid_for(card.card_id, "content", str(card.sequence)),
                )
            except ChannelError as exc:
                if exc.code == 300317:  # sequence behind the card's: the next try uses a higher one
                    raise TransportError(str(exc), code=exc.code, request_sent=False) from exc
                if exc.code in (200740, 300309, 200850):  # card gone or closed: post anew
                    raise NotFound(f"card update refused: {exc}", code=exc.code) from exc
                raise
            return
        done = self.edits.get(message_id, 0)
        if done >= MAX_TEXT_EDITS or (done >= MAX_TEXT_EDITS - 1 and not self.finishing):
            raise NotFound("the message has used its edits", code=230072)
        self.edits[message_id] = done + 1
        try:
            await self.rest.edit(
                message_id, "text", text_content(text, at=self._at_for(message_id))
            )
        except ChannelError as exc:
            if exc.code in (230072, 230075):
                raise NotFound(f"edit refused: {exc}", code=exc.code) from exc
            raise

    async def typing(self) -> None:
        return None

    async def close_cards(self, final: str) -> None:
        """Turn streaming mode off on every card of this answer (best effort)."""
        for card in self.cards.values():
            if card.closed:
                continue
            card.sequence += 1
            try:
                await self.rest.card_settings(
                    card.card_id,
                    final_settings(final),
                    sequence=card.sequence,
                    uuid=uuid_for(card.card_id, "settings", str(card.sequence)),
                )
                card.closed = True
            except ChannelError as exc:
                log.warning("card_close_failed", error=str(exc)[:300])


class FeishuStream(WatchesDelivery):
    """A streamed answer: the engine's :class:`EditStream` plus closing the card."""

    def __init__(self, inner: EditStream, transport: FeishuTransport) -> None:
        self.inner = inner
        self.transport = transport
        self.finished = False
        self.last_text = ""

    def watch_delivery(self, hook: Callable[[], Awaitable[None]]) -> None:
        self.inner.watch_delivery(hook)

    async def update(self, text: str) -> None:
        self.last_text = text
        await self.inner.update(text)

    async def progress(self, note: str) -> None:
        await self.inner.progress(note)

    async def finish(self, text: str) -> list[Delivered]:
        self.transport.finishing = True
        try:
            delivered = await self.inner.finish(text)
        except TransportError as exc:
            unconfirmed = _unconfirmed(exc)
            if unconfirmed is exc:
                raise
            raise unconfirmed from exc
        self.finished = True
        await self.transport.close_cards(split(text)[0] if text.strip() else text)
        return delivered


#: How long Feishu takes a repeated ``uuid`` for the same send (one hour), with a margin.
UUID_DEDUP_S = 3000.0
UNCONFIRMED_KEPT = 1024


def _unconfirmed(exc: TransportError) -> TransportError:
    """A send that stayed unconfirmed through every retry with its uuid, as not delivered.

    Feishu was unreachable, or took one try and lost every answer: the pipeline's outbox
    sends it again when Feishu is back (a notice's uuid follows from its text, so within
    Feishu's hour that repeat is the same send) -- one extra copy at worst, never a
    silently lost answer.  Other failures pass unchanged."""
    if not exc.outcome_unknown:
        return exc
    log.warning("answer_unconfirmed", error=str(exc)[:300])
    return TransportError(
        f"{exc} (unconfirmed after every retry with its uuid)", code=exc.code, request_sent=False
    )


@dataclass
class _Pending:
    message_id: str
    prompt: InteractionPrompt
    target: ReplyTarget
    decision: str | None = None


class FeishuOutbound(EditOutbound, PresentsControlNotices, PresentsInteractions):
    """The bot's sending side (see the module docstring)."""

    def __init__(self, rest: RestClient, store: ChannelStore, epoch: Callable[[], float]) -> None:
        super().__init__(limits=LIMITS, clock=epoch, bot_username=None)
        self.rest = rest
        self.store = store
        self.epoch = epoch
        self.cardkit = _Cardkit()
        self._interactions: dict[str, _Pending] = {}
        #: Control notices sent since the start, by card message id (a press shows its
        #: result under the notice's text; after a restart under an empty one).
        self._notices: dict[str, ControlNotice] = {}
        #: Texts under a message whose send stayed unconfirmed, and since when (oldest
        #: first, at most UNCONFIRMED_KEPT).
        self._unconfirmed_since: dict[str, float] = {}

    def transport(self, target: ReplyTarget, text: str = "") -> FeishuTransport:
        # Under a message, the uuids follow from the message and the text: the outbox's
        # repeats of one postponed answer are one send to Feishu (within its hour).
        mid = target.reply_to_message_id
        if mid and text:
            key = f"{mid}:{uuid_for(text)}"
        else:  # a card (approval, control notice) or a message into the chat: one each
            key = f"{mid or target.conversation_id}:{self.epoch()}"
        return FeishuTransport(self, target, stream=False, key=f"notice:{key}")

    async def remember(self, target: ReplyTarget, message_id: str, text: str) -> None:
        """Put a just-sent message into the outbound index (before its final text)."""
        now = self.epoch()
        try:
            await self.store.record_outbound(
                target.conversation_id,
                OutboundEntry(message_ids=[message_id], text=text, sent_at=now, completed_at=now),
                now=now,
            )
        except StoreError as exc:  # the message is sent; only the index entry is missing
            log.warning("outbound_record_failed", error=str(exc)[:200])

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        try:
            return await deliver_text(
                self.transport(target, text),
                self.limits,
                text,
                clock=self.clock,
                pacer=self.pacer(target),
            )
        except TransportError as exc:
            mid = target.reply_to_message_id
            unconfirmed = _unconfirmed(exc)
            if unconfirmed is exc or mid is None:
                raise
            # This is also the outbox's delivery: its repeats are one send to Feishu only
            # within the uuid's hour, so an unknown outcome counts as "later" only while
            # the first unconfirmed try of this text is younger than that; then *unknown*
            # (never sent again), never a loop of copies.
            key = f"{mid}:{uuid_for(text)}"
            now = trio.current_time()  # the process's own clock (the epoch may be wound)
            first = self._unconfirmed_since.setdefault(key, now)
            while len(self._unconfirmed_since) > UNCONFIRMED_KEPT:
                del self._unconfirmed_since[next(iter(self._unconfirmed_since))]
            if now - first >= UUID_DEDUP_S:
                raise
            raise unconfirmed from exc

    @asynccontextmanager
    async def open_stream(self, target: ReplyTarget) -> AsyncIterator[FeishuStream]:
        key = target.reply_to_message_id or f"{target.conversation_id}:{self.epoch()}"
        transport = FeishuTransport(self, target, stream=True, key=f"answer:{key}")
        reaction = await self._react(target, "OnIt")
        stream: FeishuStream | None = None
        try:
            async with open_edit_stream(
                transport, self.limits, clock=self.clock, pacer=self.pacer(target)
            ) as inner:
                stream = FeishuStream(inner, transport)
                yield stream
        finally:
            with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_TIMEOUT_S):
                if stream is not None and not stream.finished:
                    await transport.close_cards(stream.last_text or "…")
                await self._unreact(target, reaction)
                await self._react(target, "DONE")

    async def _react(self, target: ReplyTarget, emoji: str) -> str | None:
        mid = reply_target_id(target)
        if mid is None:
            return None
        with trio.move_on_after(REACTION_TIMEOUT_S):  # a marker: never hold up the answer
            try:
                return await self.rest.add_reaction(mid, emoji) or None
            except ChannelError as exc:
                log.info("reaction_failed", emoji=emoji, error=str(exc)[:200])
        return None

    async def _unreact(self, target: ReplyTarget, reaction: str | None) -> None:
        mid = reply_target_id(target)
        if mid is None or reaction is None:
            return
        with trio.move_on_after(REACTION_TIMEOUT_S):
            try:
                await self.rest.delete_reaction(mid, reaction)
            except ChannelError as exc:
                log.info("reaction_failed", emoji="OnIt", error=str(exc)[:200])

    # -- substitute control notices ----------------------------------------------------

    async def send_control_notice(
        self, target: ReplyTarget, notice: ControlNotice
    ) -> list[Delivered]:
        """The operator's DM: the notice as a card with the two control buttons (their
        presses come back as ``card.action.trigger``, see :class:`.protocol.ControlPress`)."""
        sent_at = self.epoch()
        mid = await self.transport(target)._post(
            "interactive", control_card(notice), 0, reply=False
        )
        if len(self._notices) >= MAX_NOTICES:
            self._notices.clear()
        self._notices[mid] = notice
        return [Delivered(message_id=mid, text=notice.text, sent_at=sent_at, completed_at=sent_at)]

    async def show_control_result(self, press: ControlPress, result: str) -> None:
        """Put what a press did on its notice card (best effort, bounded)."""
        notice = self._notices.get(press.card_message_id) or ControlNotice(
            text="", conversation_id=press.conversation_id, thread_id=press.thread_id
        )
        with trio.move_on_after(CONTROL_PATCH_TIMEOUT_S):  # the reader waits for it
            try:
                await self.rest.patch_card(
                    press.card_message_id, control_card(notice, result=result)
                )
            except ChannelError as exc:
                log.info("card_update_failed", error=str(exc)[:200])

    # -- approvals and questions --------------------------------------------------------

    def clicked(self, card_message_id: str, answer: str) -> None:
        """A button of a card was pressed (the decision shown when the card closes)."""
        pending = self._interactions.get(card_message_id)
        if pending is not None and pending.decision is None:
            pending.decision = answer

    @asynccontextmanager
    async def open_interaction(
        self, target: ReplyTarget, prompt: InteractionPrompt
    ) -> AsyncIterator[list[Delivered]]:
        """Show a request as a card with buttons until the block ends."""
        sent_at = self.epoch()
        transport = self.transport(target)
        card = interaction_card(prompt, target)
        mid = ""
        for attempt in range(1, INTERACTION_ATTEMPTS + 1):
            try:
                mid = await transport._post("interactive", card, 0, reply=True)
                break
            except (TransportError, RateLimited) as exc:
                # The same uuid each time: a repeat never shows the card twice.
                if attempt == INTERACTION_ATTEMPTS:
                    raise
                wait = exc.retry_after if isinstance(exc, RateLimited) else float(attempt)
                await trio.sleep(min(wait, 10.0))
        pending = _Pending(mid, prompt, target)
        self._interactions[mid] = pending
        try:
            yield [
                Delivered(message_id=mid, text=prompt.text, sent_at=sent_at, completed_at=sent_at)
            ]
        finally:
            del self._interactions[mid]
            decision = (
                f"✅ Answered: {pending.decision}"
                if pending.decision
                else "This request is closed."
            )
            with trio.CancelScope(shield=True), trio.move_on_after(CLEANUP_TIMEOUT_S):
                try:
                    await self.rest.patch_card(
                        mid, interaction_card(prompt, target, decision=decision)
                    )
                except ChannelError as exc:
                    log.info("card_update_failed", error=str(exc)[:200])
