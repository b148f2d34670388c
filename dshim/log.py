"""Logging: structlog configured once, stdlib logging routed through it, secrets masked.

Every record -- from a structlog logger or from a library that logs through stdlib
``logging`` (httpx, httpcore, trio-websocket) -- ends in one root handler whose
:class:`structlog.stdlib.ProcessorFormatter` runs the same tail::

    structlog loggers:  filter_by_level -> merge_contextvars -> add_log_level -> add_logger_name
                        -> ISO timestamp -> stack/exception info as text -> (to logging)
    stdlib records:     merge_contextvars -> add_log_level -> add_logger_name -> ISO timestamp
    both, in handler:   exception info as text -> REDACTION -> console or JSON renderer -> stderr

Redaction runs after exceptions are rendered to text, so tracebacks and exception messages
are masked too.  It is a backstop: secrets should never be handed to a logger in the first
place.  What it masks, in every string of the event dict (recursively through dicts, lists
and tuples; other objects are replaced by the ``repr`` the renderer would have printed):

- every registered secret value of 6 characters or more (``configure_logging(secrets=...)``
  and :func:`register_secret` for tokens learned at runtime), also URL-quoted and
  JSON-escaped;
- Telegram bot tokens ``<bot id>:<35 chars>``, also inside URL paths (``/bot<token>/getMe``);
  the bot id is kept;
- Slack ``xox?-...`` and ``xapp-...`` tokens; Discord bot tokens;
- the value after ``Bearer``;
- credential query parameters (``access_token=``, ``corpsecret=``, ``appsecret=`` ...).

Context: bind ``bot``, ``conversation`` and ``turn`` with :func:`log_context` (or
structlog's :func:`bound_contextvars`); trio child tasks inherit it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

import msgspec
import structlog
from structlog.contextvars import bound_contextvars
from structlog.types import EventDict, Processor, WrappedLogger

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

# Built-in patterns.  Each alternative owns exactly one named group, which tells _mask what
# to keep; everything else in the match is replaced.
_PATTERNS = (
    # Telegram: "<bot id>:<35 chars>", also as "/bot<token>/getMe" (no boundary before
    # the digits on purpose).
    r"(?P<telegram>\d{5,20}):[A-Za-z0-9_-]{35}",
    # Slack: bot/user/app-level tokens.
    r"(?P<slack>xox[a-z]|xapp)-[A-Za-z0-9-]+",
    # Discord: base64(user id) "." timestamp "." HMAC.
    r"(?P<discord>[A-Za-z0-9_-]{23,28}\.[A-Za-z0-9_-]{6,7}\.[A-Za-z0-9_-]{27,})",
    # Authorization: Bearer <token> -- keep the scheme.
    r"(?P<bearer>\b(?i:bearer)\s+)[^\s'\",;\\]+",
    # WeCom / DingTalk / WeChat put credentials in the query string.
    r"(?P<query>[?&](?i:access_token|token|secret|corpsecret|appsecret|app_secret"
    r"|client_secret|api_key|apikey)=)[^&#\s'\"\\]+",
)


def _mask(match: re.Match[str]) -> str:
    kind = match.lastgroup
    if kind == "secret" or kind == "discord":
        return MASK
    if kind == "telegram":
        return f"{match['telegram']}:{MASK}"
    if kind == "slack":
        return f"{match['slack']}-{MASK}"
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
        return lambda text: pattern.sub(_mask, text)


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


class _DshimHandler(logging.StreamHandler[TextIO]):
    """The root handler configure_logging owns (found again by type on reconfiguration)."""


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

    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            timestamper,
            structlog.processors.StackInfoRenderer(),
            # Rendered here, while sys.exc_info() still refers to the caller's exception.
            structlog.processors.format_exc_info,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        context_class=dict,
        # Not cached: reconfiguration and structlog.testing.capture_logs must reach
        # loggers created at import time.
        cache_logger_on_first_use=False,
    )

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
