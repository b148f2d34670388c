"""``dshim replay``: run captured fixtures through the real parsing code and pipeline.

Each fixture runs in its own trio run on a virtual clock (deterministic, instant), with a
fresh temporary store, the echo harness and no network: platform lookups are answered by
the fixture's recorded ``http`` exchanges (unmatched requests answer 404; a recorded path
without a query string matches any query, one with a query string matches the same
parameters in any order).  Events are fed
one at a time and the pipeline is allowed to settle after each, so the output follows
event order: the clock moves to an event's time when it lies ahead, and a pending
approval or question waits for the next event (it may be the answer) rather than for
its timeout; after the last event everything runs to its end.  An event time that is no
plausible clock reading (:func:`dshim.channels.kit.ids.plausible_time`: past the year
2100, negative, not finite) is a ``malformed`` drop, as the channels' decode makes it in
``serve``; a plausible one more than :data:`MAX_LEAP_S` ahead does not move the clock
(the message arrives at once, as in ``serve`` a message from a clock running ahead), and
the virtual deadline (:data:`VIRTUAL_DEADLINE_S`, which bounds the work) does not count
the clock's moves, so no event time can stall or end a fixture.  Files a turn saves for the
agent go to the run's temporary data directory, never anywhere else, and their paths are
printed under ``$DATA_DIR``.  Output lines (JSON, one per line)::

    {"fixture":F,"kind":"prompt","conversation":C,"thread":T,"text":TEXT,"images":N,"files":N}
    {"fixture":F,"kind":"send","conversation":C,"reply_to":ID_OR_NULL,"text":FINAL_TEXT}
    {"fixture":F,"kind":"send","conversation":C,"reply_to":ID_OR_NULL,"anchor":MODE,
     "mention":USER,"text":FINAL_TEXT}                    (a substitute turn's answer)
    {"fixture":F,"kind":"drop","index":I,"reason":R}     (echo, bot, unaddressed, duplicate,
                                                          stale, malformed, denied)
    {"fixture":F,"kind":"command","index":I,"name":NAME}
    {"fixture":F,"kind":"http","method":M,"path":P}

A channel whose reader holds events back in ``serve`` (Telegram collects an album's
parts into one message) does the same here, with the same code, through its adapter's
``collect`` (:class:`~dshim.channels.base.Collecting`), on the fixture's timeline (each event at its time):
what it holds is handed over when it is due (before a later event, or after the last one,
the virtual clock moving there), so the output is what ``serve`` answers and the
collection window takes no real time.
"""

from __future__ import annotations

import difflib
import json
import math
import tempfile
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx
import msgspec
import trio
import trio.testing

import dshim.lines
from dshim import normalized
from dshim.channels.base import (
    Collecting,
    ExpandsEvents,
    FixtureError,
    ReceivesEvents,
    ReplayAdapter,
    ReplaySource,
)
from dshim.channels.kit.decode import decode as bounded_decode
from dshim.channels.kit.decode import member_span, split_array
from dshim.channels.kit.ids import plausible_time
from dshim.channels.registry import CHANNEL_KEYS, parse_config
from dshim.errors import ConfigError
from dshim.harness.base import TurnContext
from dshim.harness.echo import EchoHarness
from dshim.model import (
    Attachment,
    InboundMessage,
    PromptPart,
    Skip,
    TextDelta,
    TextPart,
    TurnEnd,
    TurnEvent,
)
from dshim.pipeline.runtime import open_bot_runtime
from dshim.store import open_store
from dshim.store.base import BoundStore, OutboundEntry
from dshim.testing.outbound import RecordingOutbound, Sent

Line = dict[str, Any]
REPLAY_BOT = "replay"
#: Printed texts (prompts, answers) longer than this are cut, with a note of how much.
TEXT_PRINT_MAX = dshim.lines.TEXT_PRINT_MAX
#: Lookups of raw fixtures go here; the recorded exchanges answer (nothing leaves).
REPLAY_API_BASE = "https://replay.invalid"
VIRTUAL_DEADLINE_S = 3600.0
#: The furthest ahead an event's time moves the clock (one day); one further ahead is
#: taken for a clock running ahead and arrives at once.
MAX_LEAP_S = 86_400.0


class HttpExchange(msgspec.Struct, kw_only=True):
    method: str
    path: str
    status: int = 200
    json: Any = None


class HistoryEntry(msgspec.Struct, kw_only=True):
    role: str
    text: str
    at: str | float
    completed: bool = True


class OutboundSeed(msgspec.Struct, kw_only=True):
    message_ids: list[str | int]
    text: str
    sent_at: str | float
    completed_at: str | float | None = None
    #: A user's message (channels that index both directions), with its author.
    inbound: bool = False
    author_id: str | None = None
    author_name: str | None = None
    attachments: list[Attachment] = msgspec.field(default_factory=list)
    #: ``ok``, ``deleted`` or ``undelivered`` (see the store's OutboundEntry).
    state: Literal["ok", "deleted", "undelivered"] = "ok"


class RecordedAnswer(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """One turn's answer as the agent gave it live: its text, and its error if it failed."""

    text: str = ""
    error: str | None = None


class RecordedHarness(EchoHarness):
    """Answers each prompt of a conversation with the next answer the agent gave live
    (``Fixture.answers``), so replaying a capture of a real agent delivers what was
    delivered; past the recorded answers (and for conversations without any) it echoes."""

    kind = "recorded"

    def __init__(self, answers: dict[str, list[RecordedAnswer]]) -> None:
        super().__init__()
        self._left = {conv: list(items) for conv, items in answers.items()}

    async def prompt(
        self, session_id: str, parts: Sequence[PromptPart], ctx: TurnContext
    ) -> AsyncGenerator[TurnEvent, None]:
        left = self._left.get(ctx.conversation_id)
        if not left:
            async for event in super().prompt(session_id, parts, ctx):
                yield event
            return
        answer = left.pop(0)
        if answer.text:
            yield TextDelta(answer.text)
        if answer.error is not None:
            yield TurnEnd(stop_reason="error", error=answer.error)
        else:
            yield TurnEnd()


class Fixture(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    channel: str
    events: list[msgspec.Raw]
    format: Literal["raw", "normalized"] = "normalized"
    bot: dict[str, Any] = msgspec.field(default_factory=dict)
    options: dict[str, Any] = msgspec.field(default_factory=dict)
    now: str | float | None = None
    http: list[HttpExchange] = msgspec.field(default_factory=list)
    history: dict[str, list[HistoryEntry]] = msgspec.field(default_factory=dict)
    outbound: dict[str, list[OutboundSeed]] = msgspec.field(default_factory=dict)
    expect: list[dict[str, Any]] | None = None
    description: str | None = None
    #: Conversation -> the answers the agent gave, in turn order (a capture of a bot
    #: that ran another harness than echo): replay answers with them instead of echoing.
    answers: dict[str, list[RecordedAnswer]] = msgspec.field(default_factory=dict)


class NormalizedAdapter:
    def __init__(self, channel: str, bot: dict[str, Any]) -> None:
        self.channel = channel
        self.bot_id = str(bot.get("id", "bot"))
        username = bot.get("username")
        self.bot_username = str(username) if username else None

    def decode(self, raw: bytes) -> InboundMessage | Skip:
        try:
            return normalized.decode_event(raw, channel=self.channel, bot_id=self.bot_id)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            return Skip(reason="malformed", detail=str(exc))

    def split(self, text: str) -> list[str]:
        return [text]


def iter_fixture_files(paths: list[Path]) -> Iterator[Path]:
    for p in paths:
        if p.is_dir():
            yield from sorted(x for x in p.rglob("*.json") if x.is_file())
        elif p.is_file():
            yield p
        else:
            raise FixtureError(f"{p}: no such file or directory")


_FIXTURE_DECODER = msgspec.json.Decoder(Fixture)


def load_fixture(path: Path) -> Fixture:
    """Read a fixture file.  Its events are split without being decoded, so that one
    hostile event (nested too deep, a lone surrogate, invalid UTF-8) is that event's
    ``malformed`` drop, not a broken file."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise FixtureError(f"{path}: cannot read: {exc.strerror or exc}") from None
    events: list[bytes] = []
    span = member_span(data, "events")
    if span is not None:
        try:
            events = split_array(data[span[0] : span[1]])
        except ValueError as exc:
            raise FixtureError(f"{path}: invalid fixture: events: {exc}") from None
        data = data[: span[0]] + b"[]" + data[span[1] :]
    try:
        fx = bounded_decode(_FIXTURE_DECODER, data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FixtureError(f"{path}: invalid fixture: {exc}") from None
    fx.events = [msgspec.Raw(ev) for ev in events]
    if fx.channel not in CHANNEL_KEYS:
        raise FixtureError(
            f"{path}: channel: expected one of {', '.join(CHANNEL_KEYS)}, got {fx.channel!r}"
        )
    return fx


def _ts(value: str | float) -> float:
    t = normalized.parse_time(value)
    assert t is not None
    return t


#: Printed in place of the fixture's temporary data directory (saved files' paths).
DATA_DIR_MARK = dshim.lines.DATA_DIR_MARK


class _Recorder:
    """Collects output lines; implements the pipeline Observer (the lines are
    :class:`~dshim.lines.Lines`, shared with ``serve --capture``)."""

    def __init__(self, name: str, data_dir: Path | None = None) -> None:
        self.name = name
        self.lines: list[Line] = []
        self.index = 0
        self._make = dshim.lines.Lines(data_dir)

    def _add(self, line: Line | None) -> None:
        if line is not None:
            self.lines.append({"fixture": self.name, **line})

    def emit(self, kind: str, **fields: Any) -> None:
        self.lines.append({"fixture": self.name, "kind": kind, **fields})

    def on_drop(self, item: InboundMessage | Skip, reason: str) -> None:
        self._add(self._make.drop(self.index, reason))

    def on_command(self, msg: InboundMessage, name: str) -> None:
        self._add(self._make.command(self.index, name))

    def on_prompt(self, msg: InboundMessage, parts: list[PromptPart]) -> None:
        self._add(self._make.prompt(msg, parts))

    def on_send(self, sent: Sent) -> None:
        self._add(self._make.send(sent.target, sent.text))


_bounded = dshim.lines.bounded


def _query_set(query: str) -> list[tuple[str, str]]:
    """A query string's parameters, decoded, in a canonical order (matching ignores order)."""
    return sorted(httpx.QueryParams(query).multi_items())


def _mock_transport(fx: Fixture, rec: _Recorder, base_path: str) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        path, _, query = request.url.raw_path.decode("ascii", "replace").partition("?")
        if base_path and path.startswith(base_path):
            path = path[len(base_path) :] or "/"
        rec._add(rec._make.http(request.method, path))
        params = _query_set(query)
        for ex in fx.http:
            ex_path, has_query, ex_query = ex.path.partition("?")
            if ex.method.upper() != request.method or ex_path != path:
                continue
            if not has_query or _query_set(ex_query) == params:
                return httpx.Response(ex.status, json=ex.json)
        return httpx.Response(404, json={"message": "not found (no recorded exchange)", "code": 0})

    return httpx.MockTransport(handle)


class _EpochClock:
    """The replay's epoch clock on trio's virtual one: 0 until :meth:`start` sets "now"
    (known once the events are decoded; lookups that read it run later, in the turns)."""

    def __init__(self) -> None:
        self.now0 = 0.0
        self.t0 = trio.current_time()

    def start(self, now0: float) -> None:
        self.now0, self.t0 = now0, trio.current_time()

    def __call__(self) -> float:
        return self.now0 + (trio.current_time() - self.t0)


def _timed(item: InboundMessage | Skip) -> InboundMessage | Skip:
    """``item``, or a malformed drop when its time is no plausible clock reading (the
    channels already refuse one; this holds for normalized fixtures and any adapter)."""
    if isinstance(item, InboundMessage) and not plausible_time(item.received_at):
        return Skip(reason="malformed", detail="received_at: not a plausible time")
    return item


async def _run_fixture(
    fx: Fixture,
    name: str,
    data_dir: Path,
    deadline: trio.CancelScope | None = None,
    conversations: list[str | None] | None = None,
) -> list[Line]:
    """Replay ``fx``; ``conversations``, when given, receives each (expanded) event's
    conversation (None: it maps to none), the index ``drop`` and ``command`` lines name."""
    rec = _Recorder(name, data_dir)
    bot_table: dict[str, Any] = {"name": REPLAY_BOT, "channel": fx.channel, **fx.options}
    try:
        config = parse_config(
            {"bots": [bot_table]}, label=f"{name}: options", env={}, channel_settings=False
        )
    except ConfigError as exc:
        raise FixtureError(str(exc)) from None
    bot_cfg = config.bots[0]
    # A capture names its bot (``options.name``): saved files keep their live paths.
    bot_name = bot_cfg.name
    api_base = REPLAY_API_BASE
    base_path = httpx.URL(api_base).raw_path.decode().rstrip("/")
    clock = _EpochClock()
    async with (
        httpx.AsyncClient(transport=_mock_transport(fx, rec, base_path), base_url=api_base) as http,
        open_store(data_dir, inline=True) as store,
    ):
        adapter: ReplayAdapter
        if fx.format == "normalized":
            adapter = NormalizedAdapter(fx.channel, fx.bot)
        else:
            from dshim.channels.registry import load_channel

            try:
                channel = load_channel(fx.channel)
            except ConfigError as exc:
                raise FixtureError(f"{name}: {exc}") from None
            bot_id = fx.bot.get("id")
            username = fx.bot.get("username")
            source = ReplaySource(
                bot_id=str(bot_id) if bot_id is not None else None,
                bot_username=str(username) if username else None,
                http=http,
                api_base=api_base,
                store=BoundStore(store, bot_name),
                clock=clock,
                bot_info=dict(fx.bot),
            )
            adapter = channel.replay_adapter(source)
        raws = [bytes(ev) for ev in fx.events]
        # A channel whose events carry several messages (a webhook body) cuts them apart.
        if isinstance(adapter, ExpandsEvents):
            raws = [part for raw in raws for part in adapter.expand(raw)]
        items = [_timed(adapter.decode(raw)) for raw in raws]
        if conversations is not None:
            conversations.extend(
                it.conversation_id if isinstance(it, InboundMessage) else None for it in items
            )
        if fx.now is not None:
            now0 = _ts(fx.now)
        else:
            times = [
                it.received_at for it in items if isinstance(it, InboundMessage) and it.received_at
            ]
            now0 = max(times) if times else 0.0
        clock.start(now0)
        outbound = RecordingOutbound(
            clock=clock,
            split=adapter.split,
            bot_username=adapter.bot_username,
            on_send=rec.on_send,
            keep_updates=False,
        )
        for conv, entries in fx.history.items():
            session = f"replay-session-{conv}"
            await store.set_binding(bot_name, conv, "", session, title=None, now=now0)
            for h in entries:
                await store.append_transcript(
                    bot_name, session, h.role, h.text, at=_ts(h.at), completed=h.completed
                )
        for conv, seeds in fx.outbound.items():
            for s in seeds:
                sent_at = _ts(s.sent_at)
                done_at = _ts(s.completed_at) if s.completed_at is not None else sent_at
                await store.add_outbound(
                    bot_name,
                    conv,
                    OutboundEntry(
                        message_ids=[str(m) for m in s.message_ids],
                        text=s.text,
                        sent_at=sent_at,
                        completed_at=done_at,
                        inbound=s.inbound,
                        author_id=s.author_id,
                        author_name=s.author_name,
                        attachments=list(s.attachments),
                        state=s.state,
                    ),
                    now=now0,
                )
        # A channel that does something of its own with every event (the web chat logs it).
        received = adapter.received if isinstance(adapter, ReceivesEvents) else None
        async with open_bot_runtime(
            config=config,
            bot=bot_cfg,
            bot_id=adapter.bot_id,
            store=store,
            outbound=outbound,
            harness=RecordedHarness(fx.answers) if fx.answers else EchoHarness(),
            clock=clock,
            observer=rec,
            decode_raw=adapter.decode,
            restore=False,
        ) as rt:
            collector = adapter if isinstance(adapter, Collecting) else None

            async def move_to(t: float) -> None:
                # The clock moves to an event's time (unless that is more than MAX_LEAP_S
                # ahead); the deadline bounds the work, so it moves along.
                leap = t - clock()
                if 0 < leap <= MAX_LEAP_S:
                    if deadline is not None:
                        deadline.deadline += leap
                    await trio.sleep(leap)

            async def hand(item: InboundMessage | Skip, raw: bytes, index: int) -> None:
                rec.index = index
                if received is not None:
                    await received(item, raw)
                await rt.accept(item, raw if fx.format == "raw" else None)
                # A pending approval or question waits for the next event (perhaps its
                # answer) instead of running out its timeout on the virtual clock.
                await rt.wait_settled()

            async def hand_held(until: float) -> None:
                # What the adapter holds, each when it is due, up to ``until``; the clock
                # moves to a due time that lies ahead.
                assert collector is not None
                while (due := collector.collect_due()) is not None and due <= until:
                    if due > clock():
                        await move_to(due)
                    for ready in collector.collect_ready(due):
                        await hand(*ready)

            # The collection runs on the fixture's timeline (epoch seconds): each event
            # arrives at its own time (or, when that lies before the previous event's,
            # right after it), so what serve would hand over before an event comes first.
            arrived = -math.inf
            for i, (item, raw) in enumerate(zip(items, raws, strict=True)):
                if isinstance(item, InboundMessage) and item.received_at:
                    arrived = max(arrived, item.received_at)
                elif arrived == -math.inf:
                    arrived = clock()
                if collector is not None:
                    await hand_held(arrived)
                if isinstance(item, InboundMessage) and item.received_at > clock():
                    await move_to(item.received_at)  # time moves to the event
                if collector is None:
                    await hand(item, raw, i)
                    continue
                for ready in collector.collect(raw, i, arrived):
                    await hand(*ready)
            if collector is not None:
                await hand_held(math.inf)
            await rt.wait_idle()
    return rec.lines


def run_fixture(
    path: Path, name: str | None = None, *, conversations: list[str | None] | None = None
) -> list[Line]:
    """Replay one fixture file and return its output lines (``conversations``: see
    :func:`_run_fixture`)."""
    fx = load_fixture(path)
    label = name or str(path)

    async def main() -> list[Line]:
        with tempfile.TemporaryDirectory(prefix="dshim-replay-") as tmp:
            with trio.fail_after(VIRTUAL_DEADLINE_S) as deadline:
                return await _run_fixture(fx, label, Path(tmp), deadline, conversations)

    return trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


def conversation_lines(
    lines: list[Line], conversation: str, events: list[str | None]
) -> list[Line]:
    """The lines of one conversation (``--only-conversation``): ``prompt`` and ``send``
    lines by their ``conversation``, ``drop`` and ``command`` lines by the conversation
    of the event at their ``index`` (``events``, see :func:`_run_fixture`), an ``http``
    line with the line after it (a lookup is made before the prompt it serves), or with
    the one before it when none follows."""

    def owner(line: Line) -> str | None:
        kind = line.get("kind")
        if kind in ("prompt", "send"):
            return line.get("conversation")
        index = line.get("index")
        if kind in ("drop", "command") and isinstance(index, int) and 0 <= index < len(events):
            return events[index]
        return None

    owners = [None if line.get("kind") == "http" else owner(line) for line in lines]
    after: str | None = None
    for i in reversed(range(len(lines))):
        if lines[i].get("kind") == "http":
            owners[i] = after
        else:
            after = owners[i]
    before: str | None = None
    for i, line in enumerate(lines):
        if line.get("kind") != "http":
            before = owners[i]
        elif owners[i] is None:
            owners[i] = before
    return [line for line, who in zip(lines, owners, strict=True) if who == conversation]


def dump_line(line: Line) -> str:
    return json.dumps(line, ensure_ascii=False, separators=(",", ":"))


def _strip(line: Line) -> Line:
    return {k: v for k, v in line.items() if k != "fixture"}


def diff_lines(expected: list[Line], actual: list[Line]) -> str:
    exp = [dump_line(_strip(x)) for x in expected]
    act = [dump_line(_strip(x)) for x in actual]
    return "\n".join(difflib.unified_diff(exp, act, "expected", "actual", lineterm=""))


def _write_expect(path: Path, expect: list[Line]) -> None:
    """Rewrite the fixture's ``expect`` list (the whole file re-indented, as reviewers
    know it; a file the json module cannot round-trip gets the list spliced in)."""
    # Everything is encoded before the file is opened for writing: a text that cannot be
    # UTF-8 (a lone surrogate in a hostile fixture's golden) must not leave it truncated.
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        raw["expect"] = expect
        text = json.dumps(raw, ensure_ascii=False, indent=2) + "\n"
        try:
            encoded = text.encode("utf-8")
        except UnicodeEncodeError:  # keep such characters as \u escapes
            encoded = (json.dumps(raw, ensure_ascii=True, indent=2) + "\n").encode("ascii")
        path.write_bytes(encoded)
        return
    except (RecursionError, ValueError, UnicodeDecodeError):
        pass
    data = path.read_bytes()
    body = json.dumps(expect, ensure_ascii=True, indent=2).replace("\n", "\n  ").encode()
    span = member_span(data, "expect")
    if span is not None:
        data = data[: span[0]] + body + data[span[1] :]
    else:
        end = data.rstrip().rfind(b"}")
        data = data[:end].rstrip() + b',\n  "expect": ' + body + b"\n}\n"
    path.write_bytes(data)


class _HeldLogs:
    """Log lines written while a fixture runs, held back: a fixture that passed its check
    expected its warnings (a malformed event dropped, a lookup refused), so they are not
    printed; any other outcome prints them after its own message."""

    def __init__(self, err: Callable[[str], None]) -> None:
        self._err = err
        self._shown = True
        self._saved: list[tuple[Any, Any]] = []

    def discard(self) -> None:
        self._shown = False

    def __enter__(self) -> _HeldLogs:
        import io
        import logging

        self._buffer = io.StringIO()
        for handler in logging.getLogger().handlers:
            if type(handler) is not logging.FileHandler and isinstance(
                handler, logging.StreamHandler
            ):
                self._saved.append((handler, handler.setStream(self._buffer)))
        return self

    def __exit__(self, *exc: object) -> None:
        for handler, stream in self._saved:
            handler.setStream(stream)
        held = self._buffer.getvalue().rstrip("\n")
        if self._shown and held:
            self._err(held)


def replay(
    paths: list[Path],
    *,
    check: bool,
    update: bool,
    out: Callable[[str], None],
    err: Callable[[str], None],
    only_conversation: str | None = None,
) -> int:
    """Run fixtures; print lines (or check them against ``expect``).  Returns the exit code.

    ``only_conversation``: every fixture still runs whole, but only that conversation's
    lines (:func:`conversation_lines`) are printed, and ``check`` compares only those of
    ``expect`` with them; a fixture with no event and no line of the conversation is
    skipped.
    ``update`` rewrites whole ``expect`` lists, so it does not combine with it."""
    if update and only_conversation is not None:
        err(
            "--update rewrites every line of expect: it cannot be combined with --only-conversation"
        )
        return 2
    try:
        files = list(iter_fixture_files(paths))
    except FixtureError as exc:
        err(str(exc))
        return 2
    if not files:
        err("no fixture files found")
        return 2
    failures = skipped = 0
    for path in files:
        with _HeldLogs(err) as logs:
            try:
                fx = load_fixture(path)
                events: list[str | None] = []
                lines = run_fixture(path, conversations=events)
            except FixtureError as exc:
                err(f"FAIL {path}: {exc}")
                failures += 1
                continue
            except Exception as exc:  # a bug: report it, and still run the other fixtures
                err(f"FAIL {path}: crashed: {type(exc).__name__}: {str(exc)[:300]}")
                failures += 1
                continue
            expect = fx.expect
            if only_conversation is not None:
                lines = conversation_lines(lines, only_conversation, events)
                if expect is not None:
                    expect = conversation_lines(expect, only_conversation, events)
                if only_conversation not in events and not lines and not expect:
                    logs.discard()
                    skipped += 1
                    continue
            if update:
                _write_expect(path, [_strip(x) for x in lines])
                out(f"updated {path} ({len(lines)} lines)")
            elif check:
                if expect is None:
                    err(f"FAIL {path}: no 'expect' list to check against")
                    failures += 1
                elif [_strip(x) for x in expect] != [_strip(x) for x in lines]:
                    err(f"FAIL {path}\n{diff_lines(expect, lines)}")
                    failures += 1
                else:
                    logs.discard()
                    out(f"ok   {path} ({len(lines)} lines)")
            else:
                for line in lines:
                    out(dump_line(line))
    if only_conversation is not None and skipped == len(files):
        err(f"no fixture has conversation {only_conversation!r}")
        return 2
    if check:
        summary = f"{len(files) - failures - skipped} passed, {failures} failed"
        if skipped:
            summary += f", {skipped} skipped (without conversation {only_conversation!r})"
        out(summary)
    return 1 if failures else 0


__all__ = ["Fixture", "FixtureError", "ReplayAdapter", "TextPart", "replay", "run_fixture"]
