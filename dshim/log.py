"""Logging: structlog configured once, stdlib logging routed to the same stream, secrets masked.

Every record -- from a structlog logger or from a library that logs through stdlib
``logging`` (httpx, httpcore, hypercorn, trio-websocket) -- ends as one line on the stream of
the root handler configure_logging installs.  dshim's own records skip the stdlib machinery
(no LogRecord, no handler walk): they are rendered in the structlog chain and written under
the handler's lock; foreign records go through the handler's
:class:`structlog.stdlib.ProcessorFormatter`, which runs the same tail::

    structlog loggers:  level (stdlib's, checked before the event dict is built)
                        -> merge_contextvars -> add_log_level -> add_logger_name
                        -> ISO timestamp -> stack/exception info as text
                        -> REDACTION -> console or JSON renderer -> handler's stream
    stdlib records:     merge_contextvars -> add_log_level -> add_logger_name -> ISO timestamp
                        -> exception info as text -> REDACTION -> console or JSON renderer
                        -> handler's stream

The level is the stdlib one (root's, or a named logger's if one was set), read at each call.
Loggers are not cached, so :func:`configure_logging` again and
``structlog.testing.capture_logs`` reach loggers created at import time.

Redaction runs after exceptions are rendered to text, so tracebacks and exception messages
are masked too.  It is a backstop: secrets should never be handed to a logger in the first
place.  What it masks, in every string of the event dict (recursively through dicts, lists
and tuples; other objects are replaced by the ``repr`` the renderer would have printed;
in a dshim record, the level, logger name and timestamp its own chain wrote are not
scanned):

- every registered secret value of 6 characters or more (``configure_logging(secrets=...)``
  and :func:`register_secret` for tokens learned at runtime), also URL-quoted and
  JSON-escaped;
- the token patterns the channels declare (``log_tokens`` of their specs, see
  :mod:`dshim.channels.spec`): Telegram bot tokens ``<bot id>:<35 chars>``, also inside
  URL paths (``/bot<token>/getMe``), the bot id kept; Slack ``xox?-...`` and
  ``xapp-...`` tokens; Discord bot tokens;
- the value after ``Bearer``;
- credential query parameters (``access_token=``, ``corpsecret=``, ``appsecret=`` ...).

Context: bind ``bot``, ``conversation`` and ``turn`` with :func:`log_context` (or
structlog's :func:`bound_contextvars`); trio child tasks inherit it.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import re
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any, TextIO

import msgspec
import structlog
from structlog.contextvars import bound_contextvars
from structlog.types import EventDict, Processor, WrappedLogger

from dshim.channels.registry import SPECS
from dshim.config import Secret
from dshim.errors import ConfigError

__all__ = [
    "MASK",
    "MIN_SECRET_LEN",
    "Redactor",
    "bound_contextvars",
    "configure_logging",
    "get_logger",
    "log_context",
    "redact",
    "register_secret",
]

MASK = "***"
MIN_SECRET_LEN = 6
"""Shorter registered values are ignored: masking them would garble ordinary text."""

LEVELS: dict[str, int] = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "warn": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

# httpx logs every request URL at INFO (Telegram puts the token in the path); httpcore is
# chatty at DEBUG.  Lower them again after configure_logging() when debugging transport.
QUIET_LOGGERS = ("httpx", "httpcore")

_MAX_DEPTH = 16  # deeper (or cyclic) structures are masked as their repr

# No pattern below matches fewer characters ("xoxb-1"; registered values are at least
# MIN_SECRET_LEN long), so a shorter string is left as it is without running the regex.
_SHORTEST_MATCH = MIN_SECRET_LEN
# Set by add_log_level, add_logger_name and the timestamper, which overwrite a caller's
# value of the same key: never a secret by the time the redactor sees a dshim record.
_OWN_KEYS = frozenset(("level", "logger", "timestamp"))
# What the redactor remembers: strings up to _MEMO_MAX_LEN characters, at most
# _MEMO_ENTRIES of them (then it starts over): about a megabyte at most.
_MEMO_MAX_LEN = 64
_MEMO_ENTRIES = 4096

# Built-in patterns: the channels' token patterns (each spec's ``log_tokens``, in registry
# order), then the ones every platform shares.  Each alternative owns exactly one named
# group: the part of the match that is kept (possibly empty); the rest is replaced.
_PATTERNS = (
    *(pattern for entry in SPECS for pattern in entry.log_tokens),
    # Authorization: Bearer <token> -- keep the scheme.
    r"(?P<bearer>\b(?i:bearer)\s+)[^\s'\",;\\]+",
    # WeCom / DingTalk / WeChat put credentials in the query string.
    r"(?P<query>[?&](?i:access_token|token|secret|corpsecret|appsecret|app_secret"
    r"|client_secret|api_key|apikey)=)[^&#\s'\"\\]+",
)


def _mask(match: re.Match[str]) -> str:
    kind = match.lastgroup
    if kind == "secret":
        return MASK
    assert kind is not None
    return match[kind] + MASK


def _variants(value: str) -> set[str]:
    """The raw value and the forms it takes inside URLs and JSON text."""
    return {
        value,
        urllib.parse.quote(value, safe=""),
        urllib.parse.quote_plus(value, safe=""),
        json.dumps(value)[1:-1],
    }


class Redactor:
    """Masks secrets in strings and event dicts; an instance is a structlog processor.

    Thread-safe: values may be registered from any thread while others log.
    """

    def __init__(self, secrets: Iterable[str | Secret] = ()) -> None:
        self._lock = threading.Lock()
        self._secrets: set[str] = set()
        self._sub: Callable[[str], str] = self._compile()
        self.reset(secrets)

    def reset(self, secrets: Iterable[str | Secret] = ()) -> None:
        """Replace every registered value with *secrets*."""
        with self._lock:
            self._secrets = set()
            self._add_locked(secrets)

    def add(self, value: str | Secret) -> None:
        """Register one more value to mask; values shorter than 6 characters are ignored."""
        with self._lock:
            self._add_locked((value,))

    def redact(self, text: str) -> str:
        """*text* with every secret and token pattern masked."""
        return self._sub(text)

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        sub = self._sub  # one snapshot per record, even if a secret is added meanwhile
        for key, value in event_dict.items():
            event_dict[key] = _walk(value, sub, 0)
        return event_dict

    def redact_record(
        self, logger: WrappedLogger, method_name: str, event_dict: EventDict
    ) -> EventDict:
        """The processor for dshim's own records: what calling the instance does, minus
        the values that cannot hold a secret -- the level, logger name and timestamp the
        chain wrote itself, numbers, and strings shorter than any pattern can match."""
        sub = self._sub
        for key, value in event_dict.items():
            cls = value.__class__
            if cls is str:
                if len(value) >= _SHORTEST_MATCH and key not in _OWN_KEYS:
                    event_dict[key] = sub(value)
            elif value is not None and cls is not bool and cls is not int and cls is not float:
                event_dict[key] = _walk(value, sub, 0)
        return event_dict

    def _add_locked(self, values: Iterable[str | Secret]) -> None:
        new: set[str] = set()
        for value in values:
            raw = value.get() if isinstance(value, Secret) else value
            if len(raw) >= MIN_SECRET_LEN:
                new |= {v for v in _variants(raw) if len(v) >= MIN_SECRET_LEN}
        if not new <= self._secrets:
            self._secrets |= new
            self._sub = self._compile()

    def _compile(self) -> Callable[[str], str]:
        alternatives = list(_PATTERNS)
        if self._secrets:
            # Longest first, so a secret containing another is masked whole.
            literals = sorted(self._secrets, key=len, reverse=True)
            alternatives.insert(0, "(?P<secret>" + "|".join(map(re.escape, literals)) + ")")
        pattern = re.compile("|".join(alternatives))
        # Short strings repeat (event names, conversation ids): each is masked once per
        # compiled pattern.  A new secret compiles a new pattern, with an empty memo.
        memo: dict[str, str] = {}

        def sub(text: str) -> str:
            if len(text) > _MEMO_MAX_LEN:
                return pattern.sub(_mask, text)
            masked = memo.get(text)
            if masked is None:
                masked = pattern.sub(_mask, text)
                if len(memo) >= _MEMO_ENTRIES:
                    memo.clear()
                memo[text] = masked
            return masked

        return sub


def _walk(value: Any, sub: Callable[[str], str], depth: int) -> Any:
    if isinstance(value, str):
        return sub(value)
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if depth < _MAX_DEPTH:
        if isinstance(value, dict):
            return {
                (sub(k) if isinstance(k, str) else k): _walk(v, sub, depth + 1)
                for k, v in value.items()
            }
        if isinstance(value, list):
            return [_walk(v, sub, depth + 1) for v in value]
        if isinstance(value, tuple):
            return tuple(_walk(v, sub, depth + 1) for v in value)
        # What JSONRenderer would print for it (ConsoleRenderer prints repr too), masked.
        hook = getattr(value, "__structlog__", None)
        if callable(hook):
            return _walk(hook(), sub, depth + 1)
    return sub(repr(value))


_redactor = Redactor()


def register_secret(value: str | Secret) -> None:
    """Mask *value* in every later log record (e.g. an access token fetched at runtime).

    Values shorter than 6 characters are ignored.  Works before and after
    :func:`configure_logging`; a later ``configure_logging`` call replaces the set.
    """
    _redactor.add(value)


def redact(text: str) -> str:
    """*text* as the log redaction would write it (for messages shown outside logging)."""
    return _redactor.redact(text)


def redaction_version() -> object:
    """A value that changes whenever the set of masked secrets changes (a cache of
    redacted texts is valid while it stays the same)."""
    return _redactor._sub


class _DshimHandler(logging.StreamHandler[TextIO]):
    """The root handler configure_logging owns (found again by type on reconfiguration).

    Foreign records arrive through :meth:`handle` as usual, dshim's own already rendered
    through :meth:`write_line`; both write under the handler's lock, so lines never
    interleave.
    """

    def write_line(self, line: str, logger: logging.Logger, levelno: int) -> None:
        """Write one rendered line and flush, as :meth:`emit` does for a record."""
        self.acquire()
        try:
            self.stream.write(line + self.terminator)
            self.flush()
        except RecursionError:
            raise
        except Exception:  # a closed stream, say: reported as logging reports it, not raised
            self.handleError(
                logger.makeRecord(logger.name, levelno, "(unknown file)", 0, line, (), None)
            )
        finally:
            self.release()


_root = logging.getLogger()

# Logger method name -> stdlib level, for the methods structlog.stdlib.BoundLogger proxies.
_METHOD_LEVELS: dict[str, int] = {**LEVELS, "exception": logging.ERROR, "notset": logging.NOTSET}


class _Sink:
    """What dshim's bound loggers wrap instead of a :class:`logging.Logger`.

    The level methods take the rendered line and write it through *handler* while the root
    logger still has it; once someone removed it (``logging.config.dictConfig``, a test
    restoring logging), the line goes to the stdlib logger of the same name like any
    foreign record.  Everything else (``name``, ``level``, ``setLevel`` ...) is that stdlib
    logger's, which also decides the level.
    """

    __slots__ = ("_handler", "logger", "name")

    def __init__(self, handler: _DshimHandler, name: str) -> None:
        self._handler = handler
        self.logger = logging.getLogger(name)
        self.name = self.logger.name

    def __getattr__(self, name: str) -> Any:
        if name in _Sink.__slots__:  # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.logger, name)

    def write(self, levelno: int, line: str) -> None:
        if self._handler in _root.handlers:
            self._handler.write_line(line, self.logger, levelno)
        else:
            self.logger.log(levelno, line)

    def debug(self, line: str) -> None:
        self.write(logging.DEBUG, line)

    def info(self, line: str) -> None:
        self.write(logging.INFO, line)

    def warning(self, line: str) -> None:
        self.write(logging.WARNING, line)

    def error(self, line: str) -> None:
        self.write(logging.ERROR, line)

    exception = error

    def critical(self, line: str) -> None:
        self.write(logging.CRITICAL, line)


def _caller_module() -> str:
    """The module calling into structlog, as :class:`structlog.stdlib.LoggerFactory` guesses
    it for a logger created without a name (called by the factory, called by structlog)."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None:
        name: str = frame.f_globals.get("__name__") or "?"
        if not name.startswith("structlog"):
            return name
        frame = frame.f_back
    return "?"


class _SinkFactory:
    """structlog's logger factory: one :class:`_Sink` per logger name (kept, as
    ``logging.getLogger`` keeps its loggers), all writing through one handler."""

    def __init__(self, handler: _DshimHandler) -> None:
        self._handler = handler
        self._sinks: dict[str, _Sink] = {}

    def __call__(self, *args: Any) -> _Sink:
        name: str = args[0] if args else _caller_module()
        sink = self._sinks.get(name)
        if sink is None:
            sink = self._sinks.setdefault(name, _Sink(self._handler, name))
        return sink


_filter_by_level = structlog.stdlib.filter_by_level


class _BoundLogger(structlog.stdlib.BoundLogger):
    """:class:`structlog.stdlib.BoundLogger`'s API over a :class:`_Sink`.

    While the chain is configure_logging's (it starts with ``filter_by_level``), a record
    the stdlib logger would not take (``isEnabledFor``, as ``logging.Logger.info`` asks it)
    is dropped before its event dict is built, and the rendered line is written straight
    to the sink.  Otherwise -- ``capture_logs`` replaced the chain -- structlog's own path
    runs.
    """

    def debug(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        return self._emit("debug", event, args, kw)

    def info(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        return self._emit("info", event, args, kw)

    def warning(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        return self._emit("warning", event, args, kw)

    warn = warning

    def error(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        return self._emit("error", event, args, kw)

    def critical(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        return self._emit("critical", event, args, kw)

    fatal = critical

    def exception(self, event: str | None = None, *args: Any, **kw: Any) -> Any:
        kw.setdefault("exc_info", True)
        return self._emit("exception", event, args, kw)

    def _proxy_to_logger(
        self, method_name: str, event: str | None = None, *event_args: Any, **event_kw: Any
    ) -> Any:
        return self._emit(method_name, event, event_args, event_kw)

    def _emit(
        self, method_name: str, event: str | None, args: tuple[Any, ...], kw: dict[str, Any]
    ) -> Any:
        procs = self._processors
        sink: Any = self._logger
        if not (
            procs.__class__ is list
            and procs
            and procs[0] is _filter_by_level
            and sink.__class__ is _Sink
        ):
            return super()._proxy_to_logger(method_name, event, *args, **kw)
        levelno = _METHOD_LEVELS[method_name]
        if not sink.logger.isEnabledFor(levelno):
            return None
        if args:  # kept, as structlog.stdlib.BoundLogger keeps them
            kw["positional_args"] = args
        event_dict: Any = self._context.copy()
        event_dict.update(kw)
        if event is not None:
            event_dict["event"] = event
        try:
            for proc in itertools.islice(procs, 1, None):
                event_dict = proc(sink, method_name, event_dict)
        except structlog.DropEvent:
            return None
        sink.write(levelno, event_dict)
        return None


class _IsoUtcStamper:
    """``TimeStamper(fmt="iso", utc=True)``'s ``timestamp`` for half its cost: the same text
    (``2024-05-01T12:00:00.123456Z``; no fraction on a whole second, as
    ``datetime.isoformat`` writes it), with the date and time of day formatted once a
    second."""

    __slots__ = ("_second",)

    def __init__(self) -> None:
        self._second: tuple[int, str] = (-1, "")  # one tuple: threads swap it whole

    def __call__(self, logger: WrappedLogger, method_name: str, event_dict: EventDict) -> EventDict:
        # Truncated to microseconds, as datetime.now() truncates the same clock.
        second, micro = divmod(time.time_ns() // 1000, 1_000_000)
        cached, text = self._second
        if second != cached:
            text = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._second = (second, text)
        event_dict["timestamp"] = f"{text}.{micro:06d}Z" if micro else f"{text}Z"
        return event_dict


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty(), or closed
        return False


def _unknown(obj: object) -> str:
    return repr(obj)


_line_encoder = msgspec.json.Encoder(enc_hook=_unknown)


def _json_line(obj: object, **_: object) -> str:
    """One record as compact JSON, by msgspec (several times faster than ``json.dumps``);
    anything msgspec does not know is written as its ``repr``.  A record msgspec cannot
    encode (a lone surrogate from a hostile event) falls back to ``json.dumps``."""
    try:
        return _line_encoder.encode(obj).decode()
    except (UnicodeEncodeError, TypeError, OverflowError, msgspec.EncodeError):
        return json.dumps(obj, default=_unknown)


def configure_logging(
    level: str = "info",
    fmt: str | None = None,
    secrets: Iterable[str | Secret] = (),
    *,
    stream: TextIO | None = None,
) -> None:
    """Configure structlog and stdlib logging for the process.

    *level* is a level name (``debug`` ... ``critical``).  *fmt* is ``"console"`` or
    ``"json"`` (one object per line); ``None`` picks console when the stream is a TTY and
    JSON otherwise.  *secrets* (e.g. ``Config.secrets()``) are masked in every record and
    replace any registered before.  Output goes to *stream*, default ``sys.stderr`` as of
    this call.

    Calling it again reconfigures: the previous dshim handler is removed, handlers
    installed by others (e.g. pytest's) are left alone.  httpx and httpcore are set to
    WARNING (or *level*, if higher) because httpx logs request URLs at INFO.

    Raises ConfigError for an unknown level or format.
    """
    levelno = LEVELS.get(level.lower())
    if levelno is None:
        raise ConfigError(
            f"log level: expected one of debug, info, warning, error, critical, got {level!r}"
        )
    out = sys.stderr if stream is None else stream
    if fmt is None:
        fmt = "console" if _isatty(out) else "json"
    renderer: Processor
    if fmt == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=_isatty(out))
    elif fmt == "json":
        renderer = structlog.processors.JSONRenderer(serializer=_json_line)
    else:
        raise ConfigError(f'log format: expected "console" or "json", got {fmt!r}')

    _redactor.reset(secrets)

    timestamper = _IsoUtcStamper()
    handler = _DshimHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.contextvars.merge_contextvars,
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                timestamper,
            ],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                _redactor,
                renderer,
            ],
        )
    )
    structlog.configure(
        processors=[
            # Applied by _BoundLogger before the event dict is built; it must stay first.
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            timestamper,
            # The stack ends at the caller, not at _BoundLogger.
            structlog.processors.StackInfoRenderer(additional_ignores=[__name__]),
            # Rendered here, while sys.exc_info() still refers to the caller's exception.
            structlog.processors.format_exc_info,
            _redactor.redact_record,
            renderer,
        ],
        logger_factory=_SinkFactory(handler),
        wrapper_class=_BoundLogger,
        context_class=dict,
        # Not cached: reconfiguration and structlog.testing.capture_logs must reach
        # loggers created at import time.
        cache_logger_on_first_use=False,
    )

    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _DshimHandler)]:
        root.removeHandler(old)
        with contextlib.suppress(ValueError):  # its stream may be closed already
            old.flush()
        old.close()  # deregisters only; StreamHandler never closes its stream
    root.addHandler(handler)
    root.setLevel(levelno)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(max(logging.WARNING, levelno))


def get_logger(name: str | None = None) -> structlog.stdlib.BoundLogger:
    """A structlog logger named *name*, default the calling module's ``__name__``."""
    if name is None:
        name = sys._getframe(1).f_globals.get("__name__", "dshim")
    logger: structlog.stdlib.BoundLogger = structlog.stdlib.get_logger(name)
    return logger


@contextlib.contextmanager
def log_context(
    *,
    bot: str | None = None,
    conversation: str | None = None,
    turn: str | int | None = None,
    **extra: Any,
) -> Iterator[None]:
    """Bind ``bot``, ``conversation``, ``turn`` (and *extra*) to every record in this block.

    A thin wrapper over :func:`structlog.contextvars.bound_contextvars` that fixes the key
    names and skips ``None``.  trio tasks started inside the block inherit the context.
    """
    keys = {"bot": bot, "conversation": conversation, "turn": turn, **extra}
    with bound_contextvars(**{k: v for k, v in keys.items() if v is not None}):
        yield
