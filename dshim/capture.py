"""``dshim serve --capture DIR``: real traffic written as replay fixtures.

Theory of operation
-------------------
A :class:`Capture` belongs to the process (``serve`` opens it with :func:`open_capture`
when ``[dshim] capture_dir`` or ``--capture`` is set); :meth:`Capture.for_bot` gives each
bot with ``capture = true`` a :class:`BotCapture`, which the bot's :class:`ServeHost`
hands to the pipeline.  Nothing else changes: with capture off the pipeline's hooks are
one ``is None`` check each.

A bot's events are kept per conversation and UTC day, one in-memory :class:`_File` each:
``<DIR>/<bot>/<conversation>/<YYYY-MM-DD>.json`` (the conversation made path-safe like
saved files; ``.2.json``, ``.3.json`` ... once a part grew past ``capture_max_mb``).
An event that maps to no conversation (a malformed one) goes to ``<DIR>/<bot>/_unsorted``.
Every part is a complete fixture in the format :mod:`dshim.replay` reads:

* ``events``: every event handed to ``Inbound.accept(item, raw)`` (dropped ones too), as
  the decoded JSON of the raw bytes the inbox keeps, in arrival order;
* ``bot``: the identity the channel learned at start (``id``, ``username`` from what the
  runtime knows; more through ``BotHost.capture_identity``), ``options``: the bot's
  configuration table without its ``channel`` and without any credential;
* ``expect``: the output lines ``dshim replay --update`` would write, built from the
  same observer events with the same code (:class:`dshim.lines.Lines`);
* ``http``, ``outbound``, ``history``: what a turn's quote was resolved from — the
  platform exchanges made while the quote resolved (the kit's HTTP client reports them
  through :data:`dshim.net.http.EXCHANGES`, set only around ``reply.resolve``),
  and the message-index entries and transcript rows that could answer the quote, as
  they were just before it resolved.  Entries that replaying the part recreates (an
  inbound entry of a message in the part, a transcript row written after the part began)
  are left out, so the replay finds exactly one answer where ``serve`` found one.

Every string written (events, lines, exchanges, seeds) first goes through the log's
redactor (:func:`dshim.log.redact`: every configured secret, every secret registered at
runtime, the token patterns), and ``options`` leaves out every ``Secret`` field.  A long
string is redacted once (:class:`_Scrub`): an event's text comes back in its prompt and
in the echo's answer, and the redactor costs about 0.1 µs a character.

Cost: each event, line and exchange is redacted and encoded (compact JSON) once, when it
arrives; a flush only joins the cached pieces of a changed part (one piece a line) with
its small header, so writing a part never encodes again what it already held.

Writing: a part changed is written at most every :data:`FLUSH_S` seconds (and once more
at shutdown), whole, to a temporary ``.<name>.tmp`` beside it (mode 0600, fsynced), then
renamed over it: a reader — or a crash at any moment — sees the previous complete file
or the new one.  Directories are 0700.  After writing, the oldest files of the whole
capture directory are removed until it holds at most ``capture_keep_mb`` (the parts still
being written are kept).  A leftover temporary file (a crash mid-write) is never read by
replay (it does not end in ``.json``) and is removed at the next start.

Answers: when the bots run an agent (``[harness] kind`` is not ``echo``), each turn's
answer (its text, and its error when it failed) is kept in the fixture's ``answers``, per
conversation in turn order, and replay answers with them
(:class:`dshim.replay.RecordedHarness`), so the ``send`` lines of an agent's capture replay
too; with the echo harness replay echoes, as ``serve`` did.

Limits (``dshim replay --check`` on a capture): approvals and questions are not recorded
(replay's echo of a recorded answer asks nothing); replay runs one event at a time, so a conversation whose messages arrived while a turn
was still answering may list the same lines in another order; Telegram albums are
captured as their parts' updates only when the channel hands them so.
"""

from __future__ import annotations

import bisect
import datetime as dt
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import msgspec
import structlog
import trio

import dshim.log
from dshim.config import BotConfig, Config, Secret
from dshim.lines import Line, Lines
from dshim.log import redact
from dshim.model import Delivered, InboundMessage, PromptPart, ReplyTarget, Skip
from dshim.net.http import EXCHANGES, Exchange
from dshim.store.base import OutboundEntry, Store
from dshim.text import safe_component

log = structlog.get_logger("dshim.capture")

__all__ = ["FLUSH_S", "UNSORTED", "BotCapture", "Capture", "open_capture"]

#: A changed file is written at most this often (and at shutdown).
FLUSH_S = 0.5
#: The conversation of events that map to none (a malformed event).
UNSORTED = "_unsorted"
#: How many recent events are remembered to attribute a drop or command to its event.
_RECENT = 512
_MB = 1024 * 1024

#: Strings the scrub remembers: longer than the log's redactor remembers itself, at most
#: _MEMO_MAX_LEN characters, at most _MEMO_CHARS characters in all (the oldest forgotten
#: first): a few hundred events' texts, long enough for a turn to come back with them.
_MEMO_MIN_LEN = 64
_MEMO_MAX_LEN = 64 * 1024
_MEMO_CHARS = 2 * 1024 * 1024

_encoder = msgspec.json.Encoder()
_encode = _encoder.encode


def _redacted(value: Any) -> Any:
    """``value`` (decoded JSON) with every string redacted."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {redact(str(k)): _redacted(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redacted(v) for v in value]
    return value


def _redaction_version() -> object:
    """What changes whenever a secret is registered (:func:`dshim.log.redaction_version`)."""
    return dshim.log.redaction_version()


class _Scrub:
    """:func:`_redacted` that redacts a long string once while no secret is added.

    The capture sees the same long text several times (an event, its prompt line, the
    echo's answer); the log's redactor remembers only short strings.  Everything it
    remembers is forgotten as soon as a secret is registered, so a string redacted before
    is redacted again against the new secret.
    """

    def __init__(self) -> None:
        self._memo: dict[str, str] = {}
        self._chars = 0
        self._version: object = None

    def text(self, text: str) -> str:
        n = len(text)
        if n <= _MEMO_MIN_LEN or n > _MEMO_MAX_LEN:
            return redact(text)
        version = _redaction_version()
        if version is None:
            return redact(text)
        if version is not self._version:
            self._memo.clear()
            self._chars = 0
            self._version = version
        memo = self._memo
        masked = memo.get(text)
        if masked is None:
            masked = redact(text)
            while memo and self._chars + n > _MEMO_CHARS:  # the oldest go first
                self._chars -= len(memo.pop(next(iter(memo))))
            memo[text] = masked
            self._chars += n
        return masked

    def value(self, value: Any) -> Any:
        """``value`` (decoded JSON) with every string (keys too) redacted."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            text = self.text
            return {text(str(k)): self.value(v) for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        return value


def _array(pieces: list[bytes]) -> bytes:
    """A JSON array of encoded ``pieces``, one a line."""
    if not pieces:
        return b"[]"
    return b"[\n" + b",\n".join(pieces) + b"\n]"


def _json_of(raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        # Not JSON at all: kept as text, which replay maps to the same malformed drop.
        return raw.decode("utf-8", "replace")


def _options(bot: BotConfig) -> dict[str, Any]:
    """The bot's configuration table without its channel and any credential."""

    def table(struct: msgspec.Struct) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in struct.__struct_fields__:
            value = getattr(struct, name)
            if isinstance(value, Secret) or name in ("settings", "channel"):
                continue
            if isinstance(value, msgspec.Struct):
                value = table(value)
            else:
                value = msgspec.to_builtins(value, enc_hook=lambda _: None)
            out[name] = value
        return out

    opts = table(bot)
    if bot.settings is not None:
        opts.update(table(bot.settings))
    return _redacted(opts)  # type: ignore[no-any-return]


def _date(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%d")


class _Day:
    """:func:`_date`, formatted once a day (it is asked for at every event and line)."""

    def __init__(self) -> None:
        self._start = 0.0
        self._end = 0.0
        self._date = ""

    def __call__(self, t: float) -> str:
        if not self._start <= t < self._end:
            self._date = _date(t)
            self._start = t - t % 86400
            self._end = self._start + 86400
        return self._date


class _File:
    """One part of a conversation's day: a fixture being filled."""

    def __init__(self, path: Path, channel: str, started: float) -> None:
        self.path = path
        self.channel = channel
        self.started = started
        #: Each piece redacted and encoded once (compact JSON), in the order written.
        self.events: list[bytes] = []
        self._expect: list[bytes] = []
        #: The event index each ``expect`` line came from (replay's order: see ``line``).
        self.origins: list[int] = []
        self.http: list[bytes] = []
        self.outbound: dict[str, list[dict[str, Any]]] = {}
        self.history: dict[str, list[dict[str, Any]]] = {}
        #: Conversation -> the agent's answers in turn order (a bot that ran an agent).
        self.answers: dict[str, list[dict[str, Any]]] = {}
        #: Message id -> index of the part's first event with it (its index entries are
        #: recreated by replay).
        self.message_ids: dict[str, int] = {}
        self._seeded: set[tuple[str, str]] = set()
        self.size = 0
        self.dirty = True

    @property
    def expect(self) -> list[Line]:
        """The ``expect`` lines, decoded (the file holds them encoded)."""
        return [msgspec.json.decode(piece) for piece in self._expect]

    def line(self, line: Line, origin: int | None) -> None:
        """Add ``line`` (redacted), caused by event ``origin`` (None: the latest one).
        Replay lets the pipeline settle after each event, so its lines come in event order
        even where ``serve`` interleaved them (a duplicate judged while the first copy's
        turn ran)."""
        at = len(self.events) - 1 if origin is None else origin
        pos = bisect.bisect_right(self.origins, at)
        self._expect.insert(pos, _encode(line))
        self.origins.insert(pos, at)
        self.dirty = True

    def origin(self, message_id: str | None) -> int | None:
        return self.message_ids.get(message_id) if message_id else None

    def encode(self, bot: bytes, options: bytes) -> bytes:
        """The whole fixture: ``bot`` and ``options`` encoded, the rest from the pieces
        (only ``outbound`` and ``history``, seeded for quotes alone, are encoded here)."""
        data = b"".join(
            (
                b'{"channel":',
                _encode(self.channel),
                b',"format":"raw","description":"captured by dshim serve --capture","bot":',
                bot,
                b',"options":',
                options,
                b',"now":',
                _encode(self.started),
                b',"http":',
                _array(self.http),
                b',"outbound":',
                _encode(self.outbound),
                b',"history":',
                _encode(self.history),
                *((b',"answers":', _encode(self.answers)) if self.answers else ()),
                b',\n"events":',
                _array(self.events),
                b',\n"expect":',
                _array(self._expect),
                b"}\n",
            )
        )
        self.size = len(data)
        return data

    def seed_outbound(self, conversation: str, entry: OutboundEntry) -> None:
        key = (conversation, "\x00".join(entry.message_ids))
        if key in self._seeded:
            return
        self._seeded.add(key)
        seed = msgspec.to_builtins(entry)
        self.outbound.setdefault(conversation, []).append(_redacted(seed))
        self.dirty = True

    def seed_history(self, conversation: str, rows: list[dict[str, Any]]) -> None:
        have = self.history.setdefault(conversation, [])
        known = {(r["role"], r["at"], r["text"]) for r in have}
        for row in rows:
            row = _redacted(row)
            if (row["role"], row["at"], row["text"]) not in known:
                have.append(row)
        have.sort(key=lambda r: r["at"])
        self.dirty = True


class BotCapture:
    """One bot's capture: what the pipeline and the channel host report to it.

    The pipeline calls :meth:`event` (``accept``), the observer methods, :meth:`sent`
    (every delivered answer or notice) and :meth:`resolving` (around a quote's
    resolution); the host calls :meth:`identity` once the channel opened its runtime.
    """

    def __init__(self, capture: Capture, bot: BotConfig) -> None:
        self._capture = capture
        self.bot = bot
        self.dir = capture.root / safe_component(bot.name)
        self.options = _options(bot)
        self.options_json = _encode(self.options)
        self.bot_info: dict[str, Any] = {}
        self._scrub = capture.scrub
        self._lines = Lines(capture.data_dir)
        self._files: dict[str, _File] = {}
        #: Parts replaced by a newer one (rotated, or a new day) not yet written.
        self._retired: list[_File] = []
        #: id(item) -> (item, file, index) of recent events.
        self._recent: OrderedDict[int, tuple[object, _File, int]] = OrderedDict()

    @property
    def files(self) -> list[_File]:
        """The parts being written, and the replaced ones still to write."""
        self._retired = [f for f in self._retired if f.dirty]
        return [*self._retired, *self._files.values()]

    # -- identity ------------------------------------------------------------------------

    def identity(self, info: Mapping[str, Any]) -> None:
        """Merge what the channel learned about itself into the fixtures' ``bot``."""
        self.bot_info.update(_redacted(dict(info)))
        for f in self._files.values():
            f.dirty = True

    # -- events --------------------------------------------------------------------------

    def _file(self, conversation: str | None) -> _File:
        conv = conversation if conversation else UNSORTED
        now = self._capture.clock()
        f = self._files.get(conv)
        date = self._capture.date(now)
        if f is not None and f.path.name.startswith(date):
            if f.size <= self._capture.max_bytes or not f.events:
                return f
        folder = self.dir / (safe_component(conv) if conv != UNSORTED else UNSORTED)
        part = 1
        while True:
            name = f"{date}.json" if part == 1 else f"{date}.{part}.json"
            path = folder / name
            if not path.exists() and (f is None or f.path != path):
                break
            part += 1
        if f is not None:
            self._retired.append(f)
        f = _File(path, self.bot.channel, now)
        self._files[conv] = f
        return f

    def forget_before(self, today: str) -> None:
        """Let go of the parts of earlier days once written: a conversation that went
        quiet holds no memory, and its files fall under ``capture_keep_mb`` like any
        other (only today's parts are kept from pruning).  One that speaks again starts
        today's part."""
        for conv, f in list(self._files.items()):
            if not f.dirty and not f.path.name.startswith(today):
                del self._files[conv]

    def event(self, item: InboundMessage | Skip, raw: bytes) -> None:
        """One event handed to the pipeline (before it is judged)."""
        conversation = item.conversation_id if isinstance(item, InboundMessage) else None
        f = self._file(conversation)
        f.events.append(_encode(self._scrub.value(_json_of(raw))))
        if item.message_id:
            f.message_ids.setdefault(item.message_id, len(f.events) - 1)
        f.dirty = True
        self._recent[id(item)] = (item, f, len(f.events) - 1)
        if len(self._recent) > _RECENT:
            self._recent.popitem(last=False)
        self._capture.changed()

    def _origin(self, item: InboundMessage | Skip) -> tuple[_File, int]:
        got = self._recent.get(id(item))
        if got is not None and got[0] is item:
            return got[1], got[2]
        conversation = item.conversation_id if isinstance(item, InboundMessage) else None
        f = self._file(conversation)
        return f, max(len(f.events) - 1, 0)

    def _add(self, f: _File, line: Line | None, origin: int | None = None) -> None:
        if line is not None:
            f.line(self._scrub.value(line), origin)
            self._capture.changed()

    # -- the observer ----------------------------------------------------------------------

    def on_drop(self, item: InboundMessage | Skip, reason: str) -> None:
        f, index = self._origin(item)
        self._add(f, self._lines.drop(index, reason), index)

    def on_command(self, msg: InboundMessage, name: str) -> None:
        f, index = self._origin(msg)
        self._add(f, self._lines.command(index, name), index)

    def on_prompt(self, msg: InboundMessage, parts: list[PromptPart]) -> None:
        f = self._file(msg.conversation_id)
        self._add(f, self._lines.prompt(msg, parts), f.origin(msg.message_id))

    def answered(self, conversation_id: str, text: str, error: str | None) -> None:
        """What the agent answered in one turn (kept only when the bots run an agent:
        replay answers with it, so the capture's ``send`` lines replay too)."""
        if not self._capture.record_answers:
            return
        f = self._file(conversation_id)
        answer: dict[str, Any] = {"text": self._scrub.text(text)}
        if error is not None:
            answer["error"] = self._scrub.text(error)
        f.answers.setdefault(conversation_id, []).append(answer)
        f.dirty = True
        self._capture.changed()

    def sent(self, target: ReplyTarget, delivered: list[Delivered]) -> None:
        """Messages the pipeline delivered (an answer's, a notice's)."""
        f = self._file(target.conversation_id)
        origin = f.origin(target.reply_to_message_id)
        for d in delivered:
            self._add(f, self._lines.send(target, d.text), origin)

    # -- quotes ----------------------------------------------------------------------------

    @asynccontextmanager
    async def resolving(
        self, msg: InboundMessage, store: Store, session_id: str | None
    ) -> AsyncIterator[None]:
        """Around ``reply.resolve``: seed what could answer the quote, record lookups."""
        f = self._file(msg.conversation_id)
        ref = msg.reply_to
        if ref is not None:
            try:
                await self._seed(f, msg, store, session_id)
            except Exception as exc:  # a capture never costs the turn
                log.warning("capture_seed_failed", error=type(exc).__name__)
        origin = f.origin(msg.message_id)
        token = EXCHANGES.set(lambda ex: self._exchange(f, ex, origin))
        try:
            yield
        finally:
            EXCHANGES.reset(token)

    async def _seed(
        self, f: _File, msg: InboundMessage, store: Store, session_id: str | None
    ) -> None:
        ref = msg.reply_to
        assert ref is not None
        conv = msg.conversation_id
        budget = self.bot.reply
        keys = {str(k) for k in [*ref.recover_keys, ref.message_id] if isinstance(k, str | int)}
        t = ref.recover_at if isinstance(ref.recover_at, int | float) else None
        entries = await store.list_outbound(self.bot.name, conv, now=self._capture.clock())
        for e in entries:
            by_id = bool(keys.intersection(e.message_ids))
            by_time = (
                t is not None
                and not e.inbound
                and e.sent_at - budget.window_s <= t <= e.completed_at + budget.window_s
            )
            recreated = e.inbound and f.message_ids.keys() & set(e.message_ids)
            # The bot's own messages are always seeded: their live ids never come back
            # in a replay (it numbers its sends out-1, out-2 ...).
            if (by_id or by_time) and not recreated:
                f.seed_outbound(conv, e)
        if session_id is None or t is None:
            return
        rows: list[dict[str, Any]] = []
        before: int | None = None
        for _page in range(budget.pages):
            page = await store.transcript_page(
                session_id, before_id=before, limit=budget.rows_per_page
            )
            rows.extend(
                {"role": r.role, "text": r.text, "at": r.at, "completed": r.completed}
                for r in page
                if r.at < f.started and abs(r.at - t) <= budget.window_s
            )
            if not page or len(page) < budget.rows_per_page or min(r.at for r in page) < t:
                break
            before = min(r.id for r in page)
        if rows:
            f.seed_history(conv, rows)

    def _exchange(self, f: _File, ex: Exchange, origin: int | None) -> None:
        exchange = {"method": ex.method, "path": ex.path, "status": ex.status, "json": ex.json}
        f.http.append(_encode(self._scrub.value(exchange)))
        self._add(f, self._lines.http(ex.method, redact(ex.path.partition("?")[0])), origin)


class Capture:
    """The process's capture directory and its writer (see the module docstring)."""

    def __init__(
        self,
        root: Path,
        *,
        max_bytes: int,
        keep_bytes: int,
        clock: Callable[[], float],
        data_dir: Path | None = None,
        inline: bool = False,
        record_answers: bool = False,
    ) -> None:
        self.root = root
        #: The bots run an agent (not echo): each turn's answer is kept in ``answers``,
        #: which replay then answers with (``dshim.replay.RecordedHarness``).
        self.record_answers = record_answers
        #: Write on the trio thread (tests on the autojump clock, like the store's).
        self.inline = inline
        self.max_bytes = max_bytes
        self.keep_bytes = keep_bytes
        self.clock = clock
        self.data_dir = data_dir
        self._bots: list[BotCapture] = []
        self._changed = trio.Event()
        self.scrub = _Scrub()
        self.date = _Day()

    @classmethod
    def from_config(
        cls,
        config: Config,
        *,
        clock: Callable[[], float],
        data_dir: Path | None = None,
        inline: bool = False,
    ) -> Capture | None:
        where = config.dshim.capture_dir
        if not where:
            return None
        return cls(
            Path(where).expanduser(),
            max_bytes=int(config.dshim.capture_max_mb * _MB),
            keep_bytes=int(config.dshim.capture_keep_mb * _MB),
            clock=clock,
            data_dir=data_dir,
            inline=inline,
            record_answers=config.harness.kind != "echo",
        )

    def for_bot(self, bot: BotConfig) -> BotCapture | None:
        """The bot's capture; None when the bot has ``capture = false``."""
        if not bot.capture:
            return None
        got = BotCapture(self, bot)
        self._bots.append(got)
        return got

    def changed(self) -> None:
        self._changed.set()

    def prepare(self) -> None:
        """Create the directory (0700) and remove temporary files a crash left."""
        _mkdir(self.root)
        for tmp in self.root.rglob(".*.tmp"):
            tmp.unlink(missing_ok=True)

    async def run(self) -> None:
        """Write changed files, at most every :data:`FLUSH_S` seconds, forever."""
        while True:
            await self._changed.wait()
            self._changed = trio.Event()
            await self.flush()
            await trio.sleep(FLUSH_S)

    async def flush(self) -> None:
        """Write every changed file now, then keep the directory within its bound."""
        writes: list[tuple[Path, bytes]] = []
        active: set[Path] = set()
        today = self.date(self.clock())
        for bc in self._bots:
            bc.forget_before(today)  # written parts of earlier days: no longer protected
            bot = _encode(bc.bot_info)
            for f in bc.files:
                active.add(f.path)
                if f.dirty and f.events:
                    f.dirty = False
                    writes.append((f.path, f.encode(bot, bc.options_json)))
        if writes:
            if self.inline:
                self._write(writes, active)
            else:
                await trio.to_thread.run_sync(self._write, writes, active)

    def _write(self, writes: list[tuple[Path, bytes]], active: set[Path]) -> None:
        for path, data in writes:
            try:
                write_atomic(path, data)
            except OSError as exc:
                log.warning("capture_write_failed", path=str(path), error=str(exc))
        try:
            enforce_keep(self.root, self.keep_bytes, keep=active)
        except OSError as exc:
            log.warning("capture_prune_failed", error=str(exc))


def _mkdir(path: Path) -> None:
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` so that it is the old file or the new one, never half."""
    for parent in reversed([path.parent, *path.parent.parents]):
        if not parent.exists():
            _mkdir(parent)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        view = memoryview(data)
        while view:  # os.write may take less than it was given (a full disk, a signal)
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def _captured(root: Path) -> Iterator[tuple[float, int, Path]]:
    for p in root.rglob("*.json"):
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        yield st.st_mtime, st.st_size, p


def enforce_keep(root: Path, keep_bytes: int, *, keep: AbstractSet[Path] = frozenset()) -> None:
    """Remove the oldest capture files until all of them hold at most ``keep_bytes``."""
    files = sorted(_captured(root))
    total = sum(size for _, size, _ in files)
    for _, size, path in files:
        if total <= keep_bytes:
            break
        if path in keep:
            continue
        path.unlink(missing_ok=True)
        total -= size
        log.info("capture_file_removed", path=str(path), size=size)


@asynccontextmanager
async def open_capture(
    config: Config,
    *,
    clock: Callable[[], float],
    data_dir: Path | None = None,
    inline: bool = False,
) -> AsyncIterator[Capture | None]:
    """The process's capture (None when ``capture_dir`` is unset), written until exit and
    flushed once more then (also when cancelled).  ``inline``: file I/O on the trio
    thread instead of a worker thread (tests on the autojump clock)."""
    capture = Capture.from_config(config, clock=clock, data_dir=data_dir, inline=inline)
    if capture is None:
        yield None
        return
    if inline:
        capture.prepare()
    else:
        await trio.to_thread.run_sync(capture.prepare)
    log.info("capture_started", dir=str(capture.root))
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(capture.run)
            try:
                yield capture
            finally:
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await capture.flush()
