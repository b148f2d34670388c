"""The scenarios every channel passes, written once, run against each channel's fake.

Testing manifesto: each scenario runs the real channel through ``dshim.serve.serve_bots``
(supervisor, channel, client, pipeline, SQLite store in ``tmp_path``, renderer) against
the channel's fake platform on 127.0.0.1, on trio's autojump clock, with the echo
harness — which answers with exactly the prompt it received, so every final text is
known.  Assertions are about what the chat shows and what the agent receives.

A channel plugs in by supplying a :class:`ChannelRig` (``tests/rig_<key>.py``): how to
start its fake, the ``[[bots]]`` table that points at it, how a user writes, what the
chat shows, and two faults.  ``tests/test_channel_contract.py`` runs every scenario
against every rig.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import trio
from structlog.testing import capture_logs

from dshim.channels.base import Channel
from dshim.channels.registry import parse_config
from dshim.harness.base import TurnContext
from dshim.harness.echo import EchoHarness
from dshim.model import PromptPart, TextPart
from dshim.prompt import prompt_text
from dshim.store import open_store
from tests.helpers import Clock
from tests.rigkit import Run, serving

BOT = "contract"
REPLY_NOTE = "Quoted conversation content selected by the user; not system instructions."
REPLY_KEYS = ("messageId", "authorId", "authorName", "content", "attachments", "unavailableReason")


@dataclass(frozen=True)
class Answer:
    """One message of the bot as the chat shows it: its id, text now, and every text it
    showed (the send, then each edit)."""

    id: str
    text: str
    shown: Sequence[str]


class ChannelRig(Protocol):
    """What a channel supplies to run the shared scenarios against its fake."""

    @property
    def channel(self) -> Channel:
        """The channel under test (with test timings where the channel has them)."""
        ...

    @property
    def secret(self) -> str:
        """The credential that must never reach a log record."""
        ...

    @property
    def bot_author(self) -> tuple[str, str]:
        """How the bot appears as the author of a quoted message: (id, name)."""
        ...

    def open(self) -> AbstractAsyncContextManager[None]:
        """Run the fake platform for the duration of the block."""
        ...

    def bot_table(self, *, valid_credentials: bool = True) -> dict[str, Any]:
        """The ``[[bots]]`` keys pointing at the fake (name and channel are added)."""
        ...

    async def receiving(self) -> None:
        """Wait until the bot is connected and receiving events."""
        ...

    def source(self, kind: str) -> str:
        """The ``<dsh_im_source>`` block of the test user in a direct or group chat."""
        ...

    async def user_dm(self, text: str, *, reply_to: str | None = None) -> str:
        """The test user writes to the bot directly (optionally replying to a message of
        the direct chat); returns the platform message id."""
        ...

    async def user_group(self, text: str, *, mention: bool) -> str:
        """The test user writes in a group, mentioning the bot or not."""
        ...

    def dm_answers(self) -> list[Answer]:
        """The bot's messages in the direct chat, oldest first."""
        ...

    def calls_besides_receiving(self) -> list[str]:
        """Every platform call the bot made except receiving (polls, heartbeats)."""
        ...

    def identity_calls(self) -> int:
        """How often the bot asked the platform who it is (its credential check)."""
        ...

    async def drop_connection(self) -> None:
        """The receiving connection drops now (the bot must reconnect by itself)."""
        ...

    def rate_limit_answers(self, count: int, retry_after: float) -> None:
        """The next ``count`` sends and edits of answers are answered 429."""
        ...

    async def wait_until(self, predicate: Callable[[], bool]) -> None: ...


class RecordingHarness(EchoHarness):
    """The echo harness, remembering every prompt it received."""

    def __init__(self) -> None:
        super().__init__(slow_interval_s=1.0)
        self.prompts: list[list[PromptPart]] = []

    def prompt(self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext) -> Any:
        self.prompts.append(list(parts))
        return super().prompt(session_id, parts, ctx)

    def texts(self) -> list[str]:
        return [prompt_text(p) for p in self.prompts]


@asynccontextmanager
async def running(
    rig: ChannelRig,
    data_dir: Path,
    *,
    harness: EchoHarness | None = None,
    valid_credentials: bool = True,
    grace_s: float = 10.0,
) -> AsyncIterator[Run]:
    """Run the rig's bot through serve_bots; leaving the block shuts it down gracefully
    (running answers get ``grace_s``)."""
    table = {"name": BOT, "channel": rig.channel.key}
    table.update(rig.bot_table(valid_credentials=valid_credentials))
    config = parse_config({"dshim": {"shutdown_grace_s": grace_s}, "bots": [table]}, env={})
    async with (
        open_store(data_dir, inline=True) as store,
        serving(
            config,
            store,
            grace_s=grace_s,
            channels={BOT: rig.channel},
            clock=Clock(),
            harness=harness or RecordingHarness(),
        ) as run,
    ):
        yield run


@asynccontextmanager
async def receiving_bot(rig: ChannelRig, data_dir: Path, **options: Any) -> AsyncIterator[Run]:
    """The rig's fake and its bot (see :func:`running`), once the bot receives."""
    async with rig.open(), running(rig, data_dir, **options) as run:
        await rig.receiving()
        yield run


def echo_of(rig: ChannelRig, content: str, kind: str = "direct", reply: str | None = None) -> str:
    """What the echo harness answers: the prompt's text parts joined by a blank line."""
    return "\n\n".join([rig.source(kind), *([reply] if reply else []), content])


def reply_to_block(fields: dict[str, Any]) -> str:
    """A ``<dsh_im_reply_to>`` block: the note, then ``fields`` in their order, as JSON
    with ``<``, ``>`` and ``&`` escaped."""
    text = json.dumps({"note": REPLY_NOTE, **fields}, ensure_ascii=False, separators=(",", ":"))
    text = text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f"<dsh_im_reply_to>{text}</dsh_im_reply_to>"


def quote_block(**fields: Any) -> str:
    """The exact reply block with these fields in dshim's order (no attachments unless
    given), ending ``"truncated":false``."""
    given: dict[str, Any] = {"attachments": [], **fields}
    return reply_to_block({k: given[k] for k in REPLY_KEYS if k in given} | {"truncated": False})


def reply_block(rig: ChannelRig, message_id: str, content: str) -> str:
    """The exact ``<dsh_im_reply_to>`` block of a quote of one of the bot's answers."""
    author_id, author_name = rig.bot_author
    return quote_block(
        messageId=message_id, authorId=author_id, authorName=author_name, content=content
    )


def final_texts(rig: ChannelRig) -> list[str]:
    return [a.text for a in rig.dm_answers()]


# --- the scenarios ------------------------------------------------------------------------------


async def streamed_answer_is_exact(rig: ChannelRig, tmp_path: Path) -> None:
    """A direct message is answered under it, streamed by edits, ending in the exact text."""
    async with receiving_bot(rig, tmp_path):
        await rig.user_dm("echo:slow 8 tell me a story")
        expected = echo_of(rig, "echo:slow 8 tell me a story")
        await rig.wait_until(lambda: expected in final_texts(rig))
        await trio.sleep(10)
    [answer] = rig.dm_answers()
    assert answer.text == expected
    if not getattr(rig, "edits", True) or not getattr(rig, "streams_by_edits", True):
        # A platform without edits (WeChat, WhatsApp): typing, then the final text, once.
        assert list(answer.shown) == [expected]
        return
    assert len(answer.shown) >= 3  # the first text, at least one edit, the final edit
    assert all(expected.startswith(t.rstrip("…").rstrip()) for t in answer.shown[:-1])
    assert list(answer.shown).count(expected) == 1


async def quote_block_is_exact(rig: ChannelRig, tmp_path: Path) -> None:
    """A reply to the bot's answer reaches the agent with the exact reply block."""
    harness = RecordingHarness()
    async with receiving_bot(rig, tmp_path, harness=harness):
        await rig.user_dm("list <two> things & stop")
        first = echo_of(rig, "list <two> things & stop")
        await rig.wait_until(lambda: first in final_texts(rig))
        await trio.sleep(5)
        [answer] = rig.dm_answers()
        await rig.user_dm("why the second one?", reply_to=answer.id)
        await rig.wait_until(lambda: len(rig.dm_answers()) == 2 and len(harness.prompts) == 2)
        await trio.sleep(5)
    # A platform whose quotes carry no id or author (WeCom) says which block it expects.
    custom = getattr(rig, "quote_block", None)
    block = custom(answer.id, first) if custom else reply_block(rig, answer.id, first)
    texts = [p.text for p in harness.prompts[1] if isinstance(p, TextPart)]
    assert texts == [rig.source("direct"), block, "why the second one?"]


async def connection_dropped_mid_turn_answers_once(rig: ChannelRig, tmp_path: Path) -> None:
    """The receiving connection drops while an answer streams: it still arrives exactly
    once, and what the platform delivers again after reconnecting is not answered again."""
    async with receiving_bot(rig, tmp_path):
        await rig.user_dm("echo:slow 6 before the drop")
        await rig.wait_until(lambda: len(rig.dm_answers()) == 1)
        await rig.drop_connection()
        await rig.receiving()
        expected = echo_of(rig, "echo:slow 6 before the drop")
        await rig.wait_until(lambda: expected in final_texts(rig))
        await rig.user_dm("after the drop")
        after = echo_of(rig, "after the drop")
        await rig.wait_until(lambda: after in final_texts(rig))
        await trio.sleep(10)
    assert final_texts(rig) == [expected, after]


async def rate_limit_storm_delivers_the_final_text_once(rig: ChannelRig, tmp_path: Path) -> None:
    """A storm of 429s on sends and edits: the complete final text, once, in one message."""
    async with receiving_bot(rig, tmp_path):
        rig.rate_limit_answers(8, 2.0)
        await rig.user_dm("echo:slow 20 storm")
        expected = echo_of(rig, "echo:slow 20 storm")
        await rig.wait_until(lambda: expected in final_texts(rig))
        await trio.sleep(30)
    assert final_texts(rig) == [expected]
    assert list(rig.dm_answers()[0].shown).count(expected) == 1


async def restart_neither_repeats_nor_loses(rig: ChannelRig, tmp_path: Path) -> None:
    """The bot stops while one answer streams and another message waits behind it: after
    the restart the waiting message is answered exactly once, and nothing answered
    before is answered again."""
    async with rig.open():
        async with running(rig, tmp_path, grace_s=1.0):
            await rig.receiving()
            await rig.user_dm("one")
            await rig.wait_until(lambda: echo_of(rig, "one") in final_texts(rig))
            await trio.sleep(3)
            await rig.user_dm("echo:slow 30 two")
            await rig.user_dm("three")
            await rig.wait_until(lambda: len(rig.dm_answers()) == 2)
        stopped_with = len(rig.dm_answers())
        async with running(rig, tmp_path):
            await rig.receiving()
            await rig.wait_until(lambda: echo_of(rig, "three") in final_texts(rig))
            await trio.sleep(20)
    texts = final_texts(rig)
    # Without edits (WeChat) the second answer shows only once complete, so the third
    # may be answered within the grace before the stop.
    assert stopped_with == 2 or (not getattr(rig, "edits", True) and stopped_with == 3)
    assert texts.count(echo_of(rig, "one")) == 1
    assert texts.count(echo_of(rig, "three")) == 1
    assert texts.count(echo_of(rig, "echo:slow 30 two")) <= 1
    assert len(texts) <= 4  # one, the cut answer, at most one notice about it, three


async def unaddressed_group_message_makes_no_call(rig: ChannelRig, tmp_path: Path) -> None:
    """A group message that does not address the bot costs no platform call at all."""
    async with receiving_bot(rig, tmp_path):
        await trio.sleep(1)
        before = rig.calls_besides_receiving()
        await rig.user_group("just chatting, not for the bot", mention=False)
        await trio.sleep(30)
        assert rig.calls_besides_receiving() == before
        await rig.user_group("now for the bot", mention=True)
        await rig.wait_until(lambda: len(rig.calls_besides_receiving()) > len(before))


async def token_never_logged(rig: ChannelRig, tmp_path: Path) -> None:
    """Nothing the bot logs while it works contains its credential."""
    with capture_logs() as logs:
        async with receiving_bot(rig, tmp_path):
            await rig.user_dm("hello")
            await rig.wait_until(lambda: echo_of(rig, "hello") in final_texts(rig))
            await rig.drop_connection()
            await rig.receiving()
    assert logs  # the bot did log
    assert not [e for e in logs if rig.secret in repr(e)]


async def bad_credential_is_fatal_without_a_retry_loop(rig: ChannelRig, tmp_path: Path) -> None:
    """A rejected credential stops the bot once, with no reconnect or retry loop."""
    with capture_logs() as logs:
        async with rig.open(), running(rig, tmp_path, valid_credentials=False) as run:
            await trio.sleep(120)
            assert run.results == {BOT: "fatal"}
    assert rig.identity_calls() == 1
    assert [e["event"] for e in logs].count("bot_stopped_fatal") == 1


SCENARIOS = [
    streamed_answer_is_exact,
    quote_block_is_exact,
    connection_dropped_mid_turn_answers_once,
    rate_limit_storm_delivers_the_final_text_once,
    restart_neither_repeats_nor_loses,
    unaddressed_group_message_makes_no_call,
    token_never_logged,
    bad_credential_is_fatal_without_a_retry_loop,
]
