"""Approvals and questions over IM: pending interactions of running turns.

Theory of operation
-------------------
A harness that needs the user yields an :class:`~dshim.model.ApprovalRequest` (ACP
``session/request_permission``) or a :class:`~dshim.model.QuestionRequest` (ACP
elicitation).  The turn (step 7, on the lane's task) calls :meth:`Interactions.ask`,
which

1. posts the request in the conversation (tool title, numbered options, how to answer) —
   or, where the channel has buttons (:func:`dshim.outbound.interaction_presenter`), shows
   it with one button per option for as long as it waits; a button press reaches step 5
   as a message with the option's label, so it is judged like the typed answer,
2. registers it as *the* pending interaction of the conversation lane — only after it
   was visibly presented, so nothing typed earlier can count as an answer,
3. waits for an answer, at most ``[harness] interaction_timeout_s`` (default 10 minutes),
4. hands the decision to the harness through the request's ``reply`` callback and says
   what was decided.  No answer in time: approvals are rejected (the agent's reject
   option, else "cancelled"), questions cancelled, and the user is told.

Answers arrive through pipeline step 5, :meth:`Interactions.try_answer`, which judges the
*current* message only:

- the message's own text is the answer, also when it quotes or replies to another
  message (replying "yes" to the permission prompt is the natural gesture); the quoted
  content never is (so a quoted "yes" under "what about this?" approves nothing);
- a forwarded message (someone else's "yes") and a message with media are new messages,
  never answers;
- only the user who started the turn answers; in a group, another user's message that
  looks like an answer gets a short notice, anything else they write is a normal message;
- approvals accept the option number or label, or yes/no, y/n, approve/reject, 批准/拒绝,
  同意/不同意 (case-insensitive, surrounding spaces ignored); questions accept number(s)
  (comma-separated for multi-select), labels, or free text when the question allows it;
- text from the starter that is not a valid answer is consumed with a reminder.

``/stop`` (step 5 as well) cancels the turn's stop scope and calls :meth:`cancel_for`:
the pending request is answered "cancelled" (a rejection) and the wait ends.  Every
request is answered exactly once, also when the turn is cancelled by shutdown — unless
the harness withdraws it first (the agent died or cancelled the request), in which case
the wait simply ends and the turn goes on to report what happened.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager

import msgspec
import structlog
import trio

from dshim.errors import DshimError
from dshim.model import ApprovalRequest, InboundMessage, Option, QuestionRequest, ReplyTarget
from dshim.outbound import InteractionPrompt, interaction_presenter
from dshim.pipeline.notices import Notifier, short
from dshim.store.base import OutboundEntry

log = structlog.get_logger("dshim.interactions")

LaneKey = tuple[str, str]

YES_WORDS = frozenset({"yes", "y", "approve", "批准", "同意"})
NO_WORDS = frozenset({"no", "n", "reject", "拒绝", "不同意"})
DETAIL_MAX = 1500
REPLY_DEADLINE_S = 10.0
_NUMBER = re.compile(r"\d{1,4}")
_MULTI_SPLIT = re.compile(r"[,，、;；\n]+")
_ALLOW_LABEL = re.compile(r"^(allow|approve|yes|accept|proceed|always)", re.IGNORECASE)
_REJECT_LABEL = re.compile(r"^(reject|deny|no\b|decline|cancel|don)", re.IGNORECASE)


class Decision(msgspec.Struct, frozen=True, kw_only=True):
    """What an approval answer means: the option to send back (None = cancelled)."""

    option_id: str | None
    label: str
    allow: bool | None  # None when the option's meaning is unknown


class QuestionAnswer(msgspec.Struct, frozen=True, kw_only=True):
    selected: list[str]
    custom: str | None


def _norm(text: str) -> str:
    return " ".join(text.split()).casefold()


def _is_allow(option: Option) -> bool | None:
    if option.kind:
        if option.kind.startswith("allow"):
            return True
        if option.kind.startswith("reject"):
            return False
    if _ALLOW_LABEL.match(option.label.strip()):
        return True
    if _REJECT_LABEL.match(option.label.strip()):
        return False
    return None


def _pick(options: Sequence[Option], allow: bool) -> Option | None:
    """The option a plain yes/no stands for: the *_once kind first, then any of its side."""
    once = "allow_once" if allow else "reject_once"
    for option in options:
        if option.kind == once:
            return option
    for option in options:
        if _is_allow(option) is allow:
            return option
    return None


def _match_option(options: Sequence[Option], token: str) -> Option | None:
    """A 1-based option number, or an option label/id (case-insensitive)."""
    t = _norm(token).rstrip(".")
    if _NUMBER.fullmatch(t):
        index = int(t)
        return options[index - 1] if 1 <= index <= len(options) else None
    for option in options:
        if _norm(option.label) == t or _norm(option.id) == t:
            return option
    return None


def parse_approval(options: Sequence[Option], text: str) -> Decision | None:
    """Judge ``text`` (the current message only) as an approval answer; None if it is not one."""
    t = _norm(text)
    if not t:
        return None
    option = _match_option(options, t)
    if option is not None:
        return Decision(option_id=option.id, label=option.label, allow=_is_allow(option))
    if t in YES_WORDS:
        option = _pick(options, True) or (options[0] if options else None)
        if option is None:
            return None
        return Decision(option_id=option.id, label=option.label, allow=True)
    if t in NO_WORDS:
        option = _pick(options, False)
        if option is None:
            return Decision(option_id=None, label="Reject", allow=False)
        return Decision(option_id=option.id, label=option.label, allow=False)
    return None


def parse_question(request: QuestionRequest, text: str) -> QuestionAnswer | None:
    """Judge ``text`` as an answer to a question; None if it is not a valid one."""
    t = " ".join(text.split()) if "\n" not in text else text.strip()
    if not t.strip():
        return None
    options = request.options
    if not options:
        return QuestionAnswer(selected=[], custom=t.strip())
    whole = _match_option(options, t)
    if whole is not None:
        return QuestionAnswer(selected=[whole.id], custom=None)
    if not request.multi_select:
        if request.allow_free_text:
            return QuestionAnswer(selected=[], custom=t.strip())
        return None
    tokens = [tok.strip() for tok in _MULTI_SPLIT.split(t) if tok.strip()]
    if len(tokens) == 1 and all(_NUMBER.fullmatch(x) for x in tokens[0].split()):
        tokens = tokens[0].split()  # "1 3" means 1 and 3
    selected: list[str] = []
    leftovers: list[str] = []
    for token in tokens:
        option = _match_option(options, token)
        if option is None:
            leftovers.append(token)
        elif option.id not in selected:
            selected.append(option.id)
    if leftovers:
        if not request.allow_free_text:
            return None
        return QuestionAnswer(selected=selected, custom="、".join(leftovers))
    return QuestionAnswer(selected=selected, custom=None)


def _duration(seconds: float) -> str:
    if seconds >= 120 and seconds % 60 == 0:
        return f"{int(seconds // 60)} minutes"
    if seconds == 60:
        return "1 minute"
    return f"{seconds:g} seconds"


class _Pending:
    """One presented request waiting for its answer."""

    def __init__(self, request: ApprovalRequest | QuestionRequest, msg: InboundMessage) -> None:
        self.request = request
        self.starter_id = msg.sender_id
        self.starter_name = msg.sender_name or msg.sender_id
        self.group = msg.conversation_type == "group"
        self.target = ReplyTarget.for_message(msg)
        self.done = trio.Event()
        self.decision: Decision | None = None
        self.answer: QuestionAnswer | None = None
        self.stopped = False
        self.withdrawn = False
        self.replied = False

    def parse(self, text: str) -> Decision | QuestionAnswer | None:
        if isinstance(self.request, ApprovalRequest):
            return parse_approval(self.request.options, text)
        return parse_question(self.request, text)

    async def reply_cancelled(self) -> None:
        """Answer the harness with "cancelled" (a rejection) unless already answered."""
        if self.replied:
            return
        self.replied = True
        if isinstance(self.request, ApprovalRequest):
            if self.request.reply is not None:
                await self.request.reply(None)
        elif self.request.reply is not None:
            await self.request.reply([], None)


class Interactions:
    """The pending approvals and questions of one bot, one per conversation lane."""

    def __init__(self, notifier: Notifier, timeout_s: float) -> None:
        self._notifier = notifier
        #: How long a request waits for its answer (``[harness] interaction_timeout_s``).
        self.timeout_s = timeout_s
        self._pending: dict[LaneKey, _Pending] = {}
        self._locks: dict[LaneKey, trio.Lock] = {}

    def pending(self, lane_key: LaneKey) -> bool:
        """True while a request of this conversation waits for its answer."""
        p = self._pending.get(lane_key)
        return p is not None and not p.done.is_set()

    def waiting(self) -> list[LaneKey]:
        """The conversations whose running turn waits for the user's answer."""
        return [key for key, p in self._pending.items() if not p.done.is_set()]

    # -- step 5 ------------------------------------------------------------------------

    async def try_answer(self, msg: InboundMessage) -> bool:
        """True when the message was consumed as (or about) an answer to a pending request."""
        p = self._pending.get(msg.lane_key)
        if p is None or p.done.is_set():
            return False
        # Only the message's own text counts: a quote is context (its content is never read
        # here), while a forward or media makes it a new message, whatever its text says.
        if msg.forwarded or msg.images or msg.files:
            return False
        parsed = p.parse(msg.content)
        if msg.sender_id != p.starter_id:
            if parsed is None:
                return False  # ordinary message of someone else: queued as usual
            log.info("interaction_answer_refused", reason="not_starter", sender=msg.sender_id)
            await self._notifier.notify(
                ReplyTarget.for_message(msg),
                f"Only {p.starter_name}, who started this request, can answer it.",
            )
            return True
        if parsed is None:
            await self._notifier.notify(ReplyTarget.for_message(msg), self._reminder(p))
            return True
        if isinstance(parsed, Decision):
            p.decision = parsed
        else:
            p.answer = parsed
        log.info("interaction_answered", message_id=msg.message_id)
        p.done.set()
        return True

    def cancel_for(self, lane_key: LaneKey) -> bool:
        """Reject the pending request of a conversation (/stop).  True if there was one."""
        p = self._pending.get(lane_key)
        if p is None or p.done.is_set():
            return False
        p.stopped = True
        p.done.set()
        return True

    # -- step 7 ------------------------------------------------------------------------

    async def ask(self, request: ApprovalRequest | QuestionRequest, msg: InboundMessage) -> str:
        """Present a request, wait for the starter's answer and pass it to the harness.

        Returns a short note of the outcome.  Cancellation (``/stop``, shutdown) answers
        the request "cancelled" before it propagates.
        """
        key = msg.lane_key
        lock = self._locks.setdefault(key, trio.Lock())
        async with lock:
            p = _Pending(request, msg)
            try:
                async with self._presented(p):
                    self._pending[key] = p
                    self._notifier.activity.poke()  # the turn now waits for the user
                    log.info(
                        "interaction_presented",
                        kind="approval" if isinstance(request, ApprovalRequest) else "question",
                    )
                    with trio.move_on_after(self.timeout_s):
                        await self._wait(p)
                return await self._conclude(p)
            finally:
                if self._pending.get(key) is p:
                    del self._pending[key]
                if not lock.statistics().tasks_waiting:
                    self._locks.pop(key, None)
                if not p.replied:
                    with trio.CancelScope(shield=True), trio.move_on_after(REPLY_DEADLINE_S):
                        await p.reply_cancelled()

    @asynccontextmanager
    async def _presented(self, p: _Pending) -> AsyncIterator[None]:
        """Show the request for as long as the block runs: with the channel's buttons
        where it has them (recorded in the outbound index like a notice), else as text."""
        presenter = interaction_presenter(self._notifier.outbound)
        if presenter is None:
            await self._notifier.send_now(p.target, self._present(p))
            yield
            return
        notifier = self._notifier
        async with AsyncExitStack() as stack:
            try:
                shown = await stack.enter_async_context(presenter(p.target, self._prompt(p)))
            except DshimError as exc:  # the channel's outbound raises ChannelError only
                log.warning("interaction_buttons_failed", error=short(exc))
                await notifier.send_now(p.target, self._present(p))
            else:
                now = notifier.clock()
                for d in shown:
                    await notifier.store.add_outbound(
                        notifier.bot,
                        p.target.conversation_id,
                        OutboundEntry.from_delivered(d),
                        now=now,
                    )
            yield

    async def _wait(self, p: _Pending) -> None:
        """Until answered, stopped, or withdrawn by the harness."""
        withdrawn = p.request.withdrawn
        if withdrawn is None:
            await p.done.wait()
            return

        async def watch() -> None:
            await withdrawn()
            if not p.done.is_set():
                p.withdrawn = True
                p.done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await p.done.wait()
            nursery.cancel_scope.cancel()

    async def _conclude(self, p: _Pending) -> str:
        request = p.request
        if p.withdrawn:
            p.replied = True  # nobody is waiting for a reply any more
            log.info("interaction_withdrawn")
            return "withdrawn by the agent"
        if p.stopped:
            await p.reply_cancelled()
            log.info("interaction_cancelled", reason="stop")
            return "cancelled by /stop"
        if isinstance(request, ApprovalRequest):
            decision = p.decision
            if decision is None:  # timed out
                reject = _pick(request.options, False)
                p.replied = True
                if request.reply is not None:
                    await request.reply(reject.id if reject is not None else None)
                log.info("interaction_timed_out", kind="approval")
                await self._notifier.send_now(
                    p.target,
                    f"⌛ No answer within {_duration(self.timeout_s)}, so the request "
                    f"“{_one_line(request.title)}” was rejected.",
                )
                return "approval rejected: no answer in time"
            p.replied = True
            if request.reply is not None:
                await request.reply(decision.option_id)
            if decision.allow is True:
                note = f"✅ Approved: {decision.label}."
            elif decision.allow is False:
                note = f"❌ Rejected: {decision.label}."
            else:
                note = f"Answer sent: {decision.label}."
            await self._notifier.send_now(p.target, note)
            return note
        answer = p.answer
        if answer is None:  # timed out
            await p.reply_cancelled()
            log.info("interaction_timed_out", kind="question")
            await self._notifier.send_now(
                p.target,
                f"⌛ No answer within {_duration(self.timeout_s)}, so the question was cancelled.",
            )
            return "question cancelled: no answer in time"
        p.replied = True
        if request.reply is not None:
            await request.reply(list(answer.selected), answer.custom)
        labels = {o.id: o.label for o in request.options}
        shown = [labels.get(s, s) for s in answer.selected]
        if answer.custom:
            shown.append(f"“{answer.custom}”")
        note = "Answer sent: " + ", ".join(shown) + "."
        await self._notifier.send_now(p.target, note)
        return note

    # -- texts -------------------------------------------------------------------------

    def _heading(self, p: _Pending) -> list[str]:
        request = p.request
        if isinstance(request, ApprovalRequest):
            lines = [f"🔐 The agent asks for permission: {_one_line(request.title)}"]
            if request.detail:
                detail = request.detail.strip()
                if len(detail) > DETAIL_MAX:
                    detail = detail[: DETAIL_MAX - 1] + "…"
                lines.append(detail)
            return lines
        return [f"❓ {request.question.strip()}"]

    def _footer(self, p: _Pending) -> list[str]:
        lines = [self._how_to(p)]
        if p.group:
            lines.append(f"Only {p.starter_name} can answer it: mention me with the answer.")
        return lines

    def _present(self, p: _Pending) -> str:
        """The request as text with numbered options (channels without buttons)."""
        lines = self._heading(p)
        for i, option in enumerate(p.request.options, 1):
            desc = f" — {option.description}" if option.description else ""
            lines.append(f"{i}. {option.label}{desc}")
        return "\n".join(lines + self._footer(p))

    def _prompt(self, p: _Pending) -> InteractionPrompt:
        """The request for a channel with buttons (the text above them, and all of it)."""
        request = p.request
        question = isinstance(request, QuestionRequest)
        return InteractionPrompt(
            kind="question" if question else "approval",
            prompt="\n".join(self._heading(p) + self._footer(p)),
            options=list(request.options),
            text=self._present(p),
            multi_select=isinstance(request, QuestionRequest) and request.multi_select,
            allow_free_text=isinstance(request, QuestionRequest) and request.allow_free_text,
        )

    def _how_to(self, p: _Pending) -> str:
        request = p.request
        n = len(request.options)
        if isinstance(request, ApprovalRequest):
            return f"Answer with a number (1-{n}) or an option name, or yes / no. /stop rejects it."
        if not request.options:
            return "Answer with a message. /stop cancels the question."
        if request.multi_select:
            how = f"Answer with one or more numbers separated by commas (e.g. 1, {min(2, n)}) or option names"
        else:
            how = f"Answer with a number (1-{n}) or an option name"
        if request.allow_free_text:
            how += ", or write your own answer"
        return how + ". /stop cancels the question."

    def _reminder(self, p: _Pending) -> str:
        return "That is not an answer to the pending request. " + self._how_to(p)


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "(untitled)"
