"""The normalized message and the events that flow between channels, pipeline and harness.

Channels map platform payloads to :class:`InboundMessage` (or :class:`Skip`); the pipeline
decides what to do with it; the harness answers with a stream of turn events; channels
render those events.  Nothing in here knows a platform.

Times are Unix epoch seconds as floats throughout.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec
from msgspec import UNSET, UnsetType

ConversationType = Literal["direct", "group"]
ATTACHMENT_KINDS = frozenset({"image", "file", "audio", "video", "other"})
UNAVAILABLE_REASONS = frozenset(
    {"not-delivered", "not-found", "deleted", "permission-denied", "unsupported"}
)
#: Why an event did not become a turn.  ``ignored`` marks platform events that are not
#: user messages at all (edits, joins, service messages); replay prints no line for them.
DropReason = Literal[
    "echo", "bot", "unaddressed", "duplicate", "stale", "malformed", "denied", "ignored"
]
#: Reasons the pipeline reports when it drops an event (replay prints them).
DROP_REASONS: frozenset[str] = frozenset(
    {"echo", "bot", "unaddressed", "duplicate", "stale", "malformed", "denied", "ignored"}
)

#: A platform lookup for a quoted message.  Returns ``None`` when the platform says the
#: message does not exist.  Raises a ChannelError (with ``status``) on failure.
Loader = Callable[[], Awaitable["ReplyReference | None"]]
#: Downloads a current attachment; the argument is the byte limit it must not exceed.
Fetcher = Callable[[int], Awaitable[bytes]]


class Attachment(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An attachment of a quoted message: only what the agent is told about it."""

    kind: str = "other"
    name: str | int | float | None = None


class ReplyReference(msgspec.Struct, kw_only=True):
    """What the platform told us about the message the user quoted or replied to.

    Fields may be raw (numbers for ids, unclean text): :mod:`dshim.reply` normalizes them.
    ``UNSET`` means "the platform said nothing about this field"; a loaded reference
    overrides only the fields it sets.

    ``loader`` is a platform lookup for when the payload carried only an id.  ``recover``
    asks the core to recover a quoted message the payload gave no content for, from the
    conversation's message index (by ``recover_keys`` in order, then ``message_id``; an
    inbound entry is the user's own message, with its author), then the bot's own answers
    by ``recover_at``, then session history.  Neither is ever serialized or logged; both
    run at most once, inside the turn.
    """

    message_id: str | int | float | None | UnsetType = UNSET
    author_id: str | int | float | None | UnsetType = UNSET
    author_name: str | int | float | None | UnsetType = UNSET
    content: str | int | float | None | UnsetType = UNSET
    attachments: list[Attachment] | UnsetType = UNSET
    unavailable_reason: str | None | UnsetType = UNSET
    recover: bool = False
    recover_at: float | None = None
    recover_keys: list[str] = msgspec.field(default_factory=list)
    loader: Loader | None = None

    def __repr__(self) -> str:  # never show a loader, keep logs short
        parts = []
        for name in ("message_id", "author_id", "unavailable_reason"):
            value = getattr(self, name)
            if value is not UNSET and value is not None:
                parts.append(f"{name}={value!r}")
        if self.loader is not None:
            parts.append("loader=<set>")
        if self.recover:
            parts.append("recover=True")
        return f"ReplyReference({', '.join(parts)})"


class QuotedMessage(msgspec.Struct, kw_only=True, frozen=True):
    """A normalized, cleaned, limited quoted message: what goes into the reply block."""

    message_id: str | None = None
    author_id: str | None = None
    author_name: str | None = None
    content: str | None = None
    attachments: tuple[tuple[str, str | None], ...] = ()
    unavailable_reason: str | None = None
    truncated: bool = False


class MediaRef(msgspec.Struct, kw_only=True):
    """A current attachment of the inbound message: a lazy download handle.

    Nothing is downloaded until the turn runs; ``fetch`` is given the byte limit.
    """

    kind: str = "file"
    name: str | None = None
    mime: str | None = None
    size: int | None = None
    fetch: Fetcher | None = None

    def __repr__(self) -> str:
        return f"MediaRef(kind={self.kind!r}, name={self.name!r}, size={self.size!r})"


#: How the final text of a turn whose agent failed carries the failure (the pipeline writes
#: ``f"{AGENT_FAILED_NOTE} {error}"`` after the partial answer; a channel with a native
#: error state, e.g. DingTalk's AI card, recognises it by this).
AGENT_FAILED_NOTE = "⚠️ The agent failed:"


class Mention(msgspec.Struct, kw_only=True, frozen=True):
    """A structured mention of a person in the message's own text (never one inside a
    quoted or forwarded message), in message order.

    ``ids``: every id the platform gave for the person, by kind — ``id`` (Slack ``U…``,
    Discord snowflake, Telegram numeric user id), ``username`` (Telegram, without ``@``),
    ``open_id`` / ``user_id`` / ``union_id`` (Feishu).  ``text``: the mention as it stands
    in ``content`` (e.g. ``@owner``), when it is still there.
    """

    ids: dict[str, str]
    name: str | None = None
    text: str | None = None


class SubstituteTurn(msgspec.Struct, kw_only=True, frozen=True):
    """A turn the bot answers on behalf of the person a group message mentioned.

    Decided once, when the message is accepted (pipeline step 2), and kept with its inbox
    entry, so queued turns and a restart answer under their own trigger.  ``target_*``
    come from the configuration (trusted), ``mentioned_*`` from the event (untrusted).
    ``anchor_id``: the message the answer is anchored to (the trigger, or the thread root
    when the trigger is inside a thread).
    """

    target_id: str
    target_name: str | None = None
    mentioned_id: str | None = None
    mentioned_name: str | None = None
    disclosure: Literal["prefix", "none"] = "prefix"
    reply_mode: Literal["thread", "quote"] = "thread"
    anchor_id: str
    stream: bool = False
    #: A regular group (not a topic/thread): the first session gets an operator notice.
    in_topic: bool = False


class Anchor(msgspec.Struct, kw_only=True, frozen=True):
    """How a substitute turn's answer is placed: ``thread`` (a thread under
    ``message_id``), ``quote`` (a reply quoting it in the main flow) or ``plain`` (a
    plain message: the anchor was evicted), mentioning the person who asked."""

    mode: Literal["thread", "quote", "plain"]
    message_id: str | None = None
    mention_id: str | None = None
    mention_name: str | None = None


class InboundMessage(msgspec.Struct, kw_only=True):
    """One platform message, normalized.  Channels fill it; the pipeline reads it."""

    channel: str
    bot_id: str
    message_id: str
    conversation_id: str
    conversation_type: ConversationType
    sender_id: str
    thread_id: str | None = None
    sender_name: str | None = None
    sender_is_bot: bool = False
    addressed: bool = True
    content: str = ""
    images: list[MediaRef] = msgspec.field(default_factory=list)
    files: list[MediaRef] = msgspec.field(default_factory=list)
    reply_to: ReplyReference | None = None
    received_at: float = 0.0
    conversation_title: str | None = None
    #: The content was forwarded from elsewhere (Telegram ``forward_origin``, Discord
    #: ``message_snapshots`` ...): it reaches the agent as the message's content, but it
    #: is never a command, a /batch control word or an answer to a pending question.
    forwarded: bool = False
    #: Opaque channel data needed to answer this message (webhook URL, context token,
    #: request id ...).  Only the channel that produced it reads it.
    route: Any = None
    #: Structured mentions of people in the current text, in order (substitute mode).
    mentions: list[Mention] = msgspec.field(default_factory=list)
    #: The bot itself was explicitly @-mentioned (not only replied to).
    mentioned: bool = False
    #: Set by the pipeline when this is a substitute turn.
    substitute: SubstituteTurn | None = None

    @property
    def in_thread(self) -> bool:
        """Whether the message was written inside a thread or topic.  A message whose
        thread is named after the message itself (a Slack top-level message the bot
        answers in its own thread) opened that thread and was written in the chat."""
        return self.thread_id is not None and self.thread_id != self.message_id

    @property
    def lane_key(self) -> tuple[str, str]:
        """Conversation plus thread: one session and one turn at a time per key."""
        return (self.conversation_id, self.thread_id or "")


class Skip(msgspec.Struct, kw_only=True, frozen=True):
    """A platform event the channel could not or would not map (malformed, service...)."""

    reason: DropReason = "malformed"
    detail: str = ""
    message_id: str | None = None


class Verdict(msgspec.Struct, frozen=True):
    """What became of an event handed to the pipeline.

    ``accepted`` True: the event is durable (dedup key and inbox entry written) and the
    channel may confirm it to the platform.  Otherwise ``reason`` says why not: a
    :data:`DropReason` (deliberately dropped: confirm it too, it must not come back), or
    ``"shutdown"`` (not taken because the bot is stopping: do *not* confirm it, so the
    platform delivers it again after the restart).
    """

    accepted: bool
    reason: DropReason | Literal["shutdown"] | None = None

    @property
    def confirm(self) -> bool:
        """True when the channel should confirm the event to the platform (ack/offset)."""
        return self.reason != "shutdown"


# --- prompt parts -------------------------------------------------------------------------


class TextPart(msgspec.Struct, frozen=True):
    text: str


class ImagePart(msgspec.Struct, kw_only=True, frozen=True):
    mime: str
    data: bytes
    name: str | None = None


class FilePart(msgspec.Struct, kw_only=True, frozen=True):
    """A current attachment that is not an image, saved for the agent in the data
    directory (``path``, absolute).  ``data`` is its content when it is small enough to
    be inlined into the prompt as text (:data:`dshim.prompt.FILE_INLINE_MAX`), else empty:
    the file itself is at ``path``."""

    name: str
    path: str
    size: int
    mime: str
    kind: str = "file"
    data: bytes = b""


class MissingFile(msgspec.Struct, kw_only=True, frozen=True):
    """A current attachment that is not an image and could not be had: listed in the
    prompt's files block with its ``reason`` (:data:`FILE_UNAVAILABLE_REASONS`)."""

    name: str
    reason: str
    kind: str = "file"


#: Why a current file is not on disk for the agent (``unavailableReason`` of the block).
FILE_UNAVAILABLE_REASONS = frozenset({"too-large", "not-found", "failed"})

PromptPart = TextPart | ImagePart | FilePart


# --- turn events (harness -> pipeline -> renderer) ---------------------------------------


class TextDelta(msgspec.Struct, frozen=True):
    """A piece of the answer text, to be appended."""

    text: str


class Thinking(msgspec.Struct, frozen=True):
    """A piece of the agent's reasoning; rendered only where the channel supports it."""

    text: str


class ToolProgress(msgspec.Struct, kw_only=True, frozen=True):
    """A tool call started, progressed or finished."""

    title: str
    status: str = "running"
    tool_id: str | None = None


class Option(msgspec.Struct, kw_only=True, frozen=True):
    """One choice of an approval or question.  ``kind`` classifies approval options
    (``allow_once``, ``allow_always``, ``reject_once``, ``reject_always``) so that a
    "yes" or "no" can be mapped to the agent's own option ids."""

    id: str
    label: str
    description: str | None = None
    kind: str | None = None


class ApprovalRequest(msgspec.Struct, kw_only=True):
    """The agent asks permission to run a tool.  The pipeline answers via ``reply``."""

    title: str
    options: list[Option]
    detail: str | None = None
    reply: Callable[[str | None], Awaitable[None]] | None = None
    #: Returns when the harness withdraws the request (agent gone, request cancelled);
    #: the pipeline then stops waiting for the user and does not reply.
    withdrawn: Callable[[], Awaitable[None]] | None = None


class QuestionRequest(msgspec.Struct, kw_only=True):
    """The agent asks the user a question with numbered options or free text."""

    question: str
    options: list[Option]
    multi_select: bool = False
    allow_free_text: bool = True
    reply: Callable[[list[str], str | None], Awaitable[None]] | None = None
    #: As for :class:`ApprovalRequest`.
    withdrawn: Callable[[], Awaitable[None]] | None = None


class TurnEnd(msgspec.Struct, kw_only=True, frozen=True):
    """The turn is over.  ``error`` is a user-presentable failure text, if it failed."""

    stop_reason: str = "end_turn"
    error: str | None = None


TurnEvent = TextDelta | Thinking | ToolProgress | ApprovalRequest | QuestionRequest | TurnEnd


# --- a backend's session history (harness -> quote recovery) ------------------------------


class HistoryPage(msgspec.Struct, kw_only=True, frozen=True):
    """One page of a backend's session history, for the core's bounded quote recovery."""

    #: The answers of completed turns in this page as (text, epoch seconds), newest first.
    items: list[tuple[str, float]]
    #: Cursor of the next older page (pass as ``before``); None when there is none.
    before: str | None
    #: Time of the oldest event in the page (epoch seconds), when known.
    oldest_at: float | None = None


@runtime_checkable
class ReadsHistory(Protocol):
    """Adapters whose backend keeps session history (DSH): ``history(session, before,
    limit)`` pages it newest first, so a quote of an answer dshim's own transcript lacks
    can still be recovered."""

    async def history(self, session_id: str, *, before: str | None, limit: int) -> HistoryPage: ...


# --- outbound -------------------------------------------------------------------------------


class ReplyTarget(msgspec.Struct, kw_only=True, frozen=True):
    """Where an answer goes: the conversation, thread, and the message it answers."""

    conversation_id: str
    conversation_type: ConversationType = "direct"
    thread_id: str | None = None
    reply_to_message_id: str | None = None
    route: Any = None
    #: A substitute turn's placement (None: the channel's ordinary reply).
    anchor: Anchor | None = None

    @classmethod
    def for_message(cls, msg: InboundMessage) -> ReplyTarget:
        return cls(
            conversation_id=msg.conversation_id,
            conversation_type=msg.conversation_type,
            thread_id=msg.thread_id,
            reply_to_message_id=msg.message_id,
            route=msg.route,
        )


class Delivered(msgspec.Struct, kw_only=True, frozen=True):
    """One platform message the bot delivered (after its last edit)."""

    message_id: str
    text: str
    sent_at: float
    completed_at: float
