"""What the pipeline needs from a channel to answer: the outbound contract.

A channel implements :class:`Outbound`.  The pipeline never formats platform payloads; it
hands over plain text and gets back :class:`~dshim.model.Delivered` records that it writes
to the outbound index and the transcript.

Approvals and questions are text with numbered options everywhere (``send_text``).  A
channel with interactive messages (buttons) also implements the optional
``open_interaction`` (see :func:`interaction_presenter`): the pipeline then hands it an
:class:`InteractionPrompt` instead, and typed answers keep working the same way.

Optional features
-----------------
Each optional member is a small :func:`~typing.runtime_checkable` protocol below, which
the pipeline discovers with ``isinstance`` (a class that has the member has the feature).
A channel's class names the protocols it implements among its bases, so mypy checks the
member's signature there, and ``tests/test_channel_features.py`` lists per channel which
of them its objects implement:

- of a :class:`ReplyStream`: :class:`WatchesDelivery`, :class:`WatchesStop`;
- of an :class:`Outbound`: :class:`PresentsInteractions`,
  :class:`PresentsControlNotices`, :class:`FindsDirectTargets`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Literal, Protocol, runtime_checkable

import msgspec

from dshim.model import Delivered, Option, ReplyTarget

#: Called (awaited) once, before anything of an answer may reach the user.
DeliveryHook = Callable[[], Awaitable[None]]


class ReplyStream(Protocol):
    """One streamed answer.  Opened when the turn starts, finished exactly once.

    ``update`` receives the whole answer so far (not a delta); the channel paces edits
    and may skip intermediate texts.  ``finish`` delivers the complete final text, splits
    it per the platform's limits, and returns every delivered message.  If the context
    manager exits without ``finish`` (cancellation, failure), the channel cleans up what it
    showed (e.g. stops typing) but must not raise.

    Optional features: :class:`WatchesDelivery` (report the first send) and
    :class:`WatchesStop` (a stop button of the platform's own).
    """

    async def update(self, text: str) -> None: ...

    async def progress(self, note: str) -> None: ...

    async def finish(self, text: str) -> list[Delivered]: ...


class Outbound(Protocol):
    """A channel's sending side, as the pipeline sees it."""

    #: The platform's own name for the bot (e.g. Telegram ``username``), for ``/cmd@name``.
    bot_username: str | None

    async def send_text(self, target: ReplyTarget, text: str) -> list[Delivered]:
        """Send a complete text (notices, command replies), split if needed."""
        ...

    def open_stream(self, target: ReplyTarget) -> AbstractAsyncContextManager[ReplyStream]:
        """Start a streamed answer to ``target`` (typing indicator until the first text)."""
        ...


@runtime_checkable
class WatchesDelivery(Protocol):
    """A :class:`ReplyStream` that reports its first send (see :func:`watch_delivery`).

    ``watch_delivery(hook)``: the stream awaits ``hook()`` once, right before its first
    platform call that can show the user any of this answer (the first send; a typing
    indicator does not count).  The pipeline uses it to record, durably and before the
    fact, that a turn may have shown something: after a crash such a turn gets a notice
    instead of a second answer, and a turn that showed nothing runs again.
    :class:`dshim.render.EditStream` implements it.  A stream without it is taken to show
    something from its first ``update``, ``progress`` or ``finish`` on.
    """

    def watch_delivery(self, hook: DeliveryHook) -> None: ...


@runtime_checkable
class WatchesStop(Protocol):
    """A :class:`ReplyStream` with a stop button of the platform's own (Slack's native
    stream: ``stopped_by_user``): ``watch_stop(stop)`` has it call ``stop()`` when the user
    pressed it (see :func:`watch_stop`)."""

    def watch_stop(self, stop: Callable[[], object]) -> None: ...


def watch_delivery(stream: ReplyStream, hook: DeliveryHook) -> bool:
    """Ask ``stream`` to await ``hook`` before its first send; False when it cannot tell
    (it is no :class:`WatchesDelivery`)."""
    # getattr, as isinstance with the Protocol checks it, without its cost (every turn).
    watch: Callable[[DeliveryHook], None] | None = getattr(stream, "watch_delivery", None)
    if watch is None:
        return False
    watch(hook)
    return True


def watch_stop(stream: ReplyStream, stop: Callable[[], object]) -> bool:
    """Ask ``stream`` to call ``stop()`` when the user stopped the answer on the platform
    itself (Slack's stop button on a native stream: ``stopped_by_user``); the turn then
    ends like ``/stop``.  False when the stream has no such button (no :class:`WatchesStop`)."""
    watch: Callable[[Callable[[], object]], None] | None = getattr(stream, "watch_stop", None)
    if watch is None:
        return False
    watch(stop)
    return True


class ControlNotice(msgspec.Struct, frozen=True, kw_only=True):
    """The substitute control notice an operator gets in a DM: ``text``, and the chat it
    is about, for the buttons of a channel with interactive messages (their presses go
    to ``Inbound.substitute_control`` with the action, this chat and the presser)."""

    text: str
    conversation_id: str
    thread_id: str | None = None


#: The buttons of a control notice: (action, label).
CONTROL_ACTIONS = (("stop", "Stop the answer"), ("disable", "Stop answering for me here"))

ControlPresenter = Callable[[ReplyTarget, ControlNotice], Awaitable[list[Delivered]]]


@runtime_checkable
class PresentsControlNotices(Protocol):
    """An :class:`Outbound` that shows a substitute control notice with the
    :data:`CONTROL_ACTIONS` buttons (see :func:`control_presenter`)."""

    async def send_control_notice(
        self, target: ReplyTarget, notice: ControlNotice
    ) -> list[Delivered]: ...


def control_presenter(outbound: Outbound) -> ControlPresenter | None:
    """The channel's optional ``send_control_notice(target, notice)`` (a message with the
    :data:`CONTROL_ACTIONS` buttons, :class:`PresentsControlNotices`), or None (the notice
    is text)."""
    return outbound.send_control_notice if isinstance(outbound, PresentsControlNotices) else None


@runtime_checkable
class FindsDirectTargets(Protocol):
    """An :class:`Outbound` whose platform needs a conversation of its own for a DM
    (Slack's ``conversations.open``): ``direct_target(user_id)`` is where a DM to that
    user goes (None: nowhere).  Without it a DM goes to the user id itself."""

    async def direct_target(self, user_id: str) -> ReplyTarget | None: ...


class InteractionPrompt(msgspec.Struct, frozen=True, kw_only=True):
    """An approval or question, for a channel that shows it with buttons.

    ``prompt`` is what to show above the buttons (the request and how to answer by
    typing); ``text`` the whole request as channels without buttons show it (numbered
    options included).  A button stands for its option: the channel hands the pipeline a
    message from the person who pressed it, whose text is that option's label (or number),
    so a button press is judged exactly like the typed answer.
    """

    kind: Literal["approval", "question"]
    prompt: str
    options: list[Option]
    text: str
    multi_select: bool = False
    allow_free_text: bool = False


#: ``open_interaction(target, prompt)``: show the request natively for as long as the
#: block runs (the pipeline leaves it when the request is answered, stopped, timed out or
#: withdrawn: the channel then disables the buttons); yields the delivered messages.  It
#: raises only ChannelError, and only on entry (then the text is sent instead).
InteractionPresenter = Callable[
    [ReplyTarget, InteractionPrompt], AbstractAsyncContextManager[list[Delivered]]
]


@runtime_checkable
class PresentsInteractions(Protocol):
    """An :class:`Outbound` with interactive messages: ``open_interaction(target, prompt)``
    shows an approval or question with buttons (see :data:`InteractionPresenter` and
    :func:`interaction_presenter`)."""

    def open_interaction(
        self, target: ReplyTarget, prompt: InteractionPrompt
    ) -> AbstractAsyncContextManager[list[Delivered]]: ...


def interaction_presenter(outbound: Outbound) -> InteractionPresenter | None:
    """The channel's optional ``open_interaction`` (:class:`PresentsInteractions`), or None
    (text with numbered options)."""
    return outbound.open_interaction if isinstance(outbound, PresentsInteractions) else None
