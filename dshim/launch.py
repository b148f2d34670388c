"""The ``dshim`` entry point, and ``dshim serve`` without the command-line framework.

``serve`` is what runs in production and what restarts after every deploy or crash, so
it should start quickly and stay small.  typer (with the click it vendors and the
pydantic its adapters load) costs ~50 ms and ~10 MB on every start, all for parsing a
handful of options.  So :func:`main` reads the usual forms of a serve command itself::

    dshim [--config PATH] [--data-dir PATH] [--log-level LEVEL] [--log-format FORMAT]
          serve [--bot NAME]... [--listen HOST:PORT] [--capture DIR]

(each also as ``--option=value``, with ``DSHIM_CONFIG`` / ``DSHIM_DATA_DIR`` /
``DSHIM_HTTP_LISTEN`` read as typer reads them) and runs it directly.  Anything else —
another command, ``--help``, ``--version``, an unknown or misspelt option, a value typer
would reject — goes to the typer application in :mod:`dshim.cli`, which then answers
exactly as it always did.  Both routes run the one :func:`serve` below.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Read when neither --config nor DSHIM_CONFIG names a file.
LOCAL_CONFIG = Path("dshim.toml")
RUNNING = "dshim is running: open {url}"
ZERO_CONFIG_HINT = (
    "dshim: no dshim.toml here, so this is the built-in web chat with the echo harness; "
    "`dshim init` writes a dshim.toml to add a platform (Telegram, Discord, Slack ...)"
)
LOG_LEVELS = ("debug", "info", "warning", "error")
LOG_FORMATS = ("console", "json")


class Globals:
    """The options before the command (``--config``, ``--data-dir``, logging)."""

    def __init__(
        self, config: Path | None, data_dir: Path | None, log_level: str, log_format: str | None
    ) -> None:
        #: The config file given (--config / DSHIM_CONFIG), or None.
        self.config = config
        self.data_dir = data_dir
        self.log_level = log_level
        self.log_format = log_format


class Exit(Exception):
    """End the command with this exit code (its message, if any, already printed)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class EarlySignals:
    """SIGINT/SIGTERM while ``serve`` starts (before its own signal receiver is open) or
    after that receiver closed: remembered instead of a KeyboardInterrupt traceback or
    the default SIGTERM death.  ``serve`` then stops at once, with exit code 0."""

    def __init__(self) -> None:
        #: The first such signal, if any.
        self.received: int | None = None

    def install(self) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._record)

    def _record(self, signum: int, frame: object) -> None:
        if self.received is None:
            self.received = signum

    def __call__(self) -> bool:
        return self.received is not None


def fail(message: str, code: int) -> Exit:
    """Print ``dshim: message`` to stderr; the :class:`Exit` to raise."""
    print(f"dshim: {message}", file=sys.stderr, flush=True)
    return Exit(code)


def config_path(g: Globals) -> Path | None:
    """The file to read, or None for the built-in default (see :mod:`dshim.cli`)."""
    if g.config is not None:
        return g.config
    return LOCAL_CONFIG if LOCAL_CONFIG.exists() else None


def load(g: Globals) -> tuple[Any, str]:
    """The configuration and its label for messages (the file's name)."""
    from dshim.channels.registry import default_config, load_config
    from dshim.config import DEFAULT_CONFIG_LABEL
    from dshim.errors import ConfigError

    path = config_path(g)
    try:
        if path is None:
            return default_config(), DEFAULT_CONFIG_LABEL
        return load_config(path), path.name
    except ConfigError as exc:
        raise fail(str(exc), 2) from None


def data_dir(g: Globals, cfg: Any) -> Path:
    from dshim.config import resolve_data_dir

    return resolve_data_dir(cfg, g.data_dir)


def setup_logging(g: Globals, secrets: list[str]) -> None:
    from dshim.log import configure_logging

    configure_logging(g.log_level, g.log_format, secrets)


def serve(
    g: Globals,
    bots: Sequence[str],
    listen: str | None,
    capture: str | None = None,
    instance: str | None = None,
) -> int:
    """``dshim serve``: run every enabled bot (or the named ones) until SIGINT/SIGTERM;
    the exit code (0 after a signal, whenever it came).  Raises :class:`Exit` for a
    configuration or store error (printed)."""
    early = EarlySignals()
    early.install()
    cfg, label = load(g)
    zero_config = config_path(g) is None
    from dshim.config import data_dir_origin, override_listen, prepare_data_dir
    from dshim.errors import ConfigError, StoreError

    try:
        if listen is not None:
            cfg = override_listen(cfg, listen, origin="--listen / DSHIM_HTTP_LISTEN")
        if capture is not None:
            cfg = override_capture(cfg, capture)
        if bots:
            cfg = only_bots(cfg, bots, label)
        where = data_dir(g, cfg)
        prepare_data_dir(where, origin=data_dir_origin(cfg, g.data_dir, label))
    except ConfigError as exc:
        raise fail(str(exc), 2) from None
    setup_logging(g, cfg.secrets())
    from dshim.serve import run_serve

    def announce(url: str) -> None:
        print(RUNNING.format(url=url), flush=True)
        if zero_config:
            print(ZERO_CONFIG_HINT, file=sys.stderr, flush=True)

    if early():
        return 0  # stopped before anything started
    try:
        return run_serve(cfg, where, announce=announce, signalled=early, instance=instance)
    except ConfigError as exc:
        raise fail(str(exc), 2) from None
    except StoreError as exc:
        raise fail(str(exc), 1) from None


def override_capture(cfg: Any, capture: str) -> Any:
    """The configuration with ``[dshim] capture_dir`` set to ``--capture DIR``."""
    import msgspec

    return msgspec.structs.replace(
        cfg, dshim=msgspec.structs.replace(cfg.dshim, capture_dir=capture)
    )


def only_bots(cfg: Any, names: Sequence[str], label: str) -> Any:
    """The configuration with only the named bots (each must exist and be enabled)."""
    import msgspec

    from dshim.errors import ConfigError

    known = {b.name: b for b in cfg.bots}
    for name in names:
        if name not in known:
            choices = ", ".join(known) or "none"
            raise ConfigError(f"--bot {name}: no bot named {name!r} in {label} (bots: {choices})")
        if not known[name].enabled:
            raise ConfigError(f"--bot {name}: the bot is disabled (enabled = false in {label})")
    wanted = set(names)
    return msgspec.structs.replace(cfg, bots=[b for b in cfg.bots if b.name in wanted])


# --- the direct route ---------------------------------------------------------------------

_GLOBAL_OPTIONS = ("--config", "--data-dir", "--log-level", "--log-format")
_SERVE_OPTIONS = ("--bot", "--listen", "--capture", "--instance")


def _options(args: list[str], known: tuple[str, ...]) -> list[tuple[str, str]] | None:
    """``[(option, value)]`` for a run of known ``--option value`` / ``--option=value``
    pairs consumed from the front of *args*; stops at the first word that is not an
    option.  None when something is off (unknown option, missing or dash-led value)."""
    out: list[tuple[str, str]] = []
    while args and args[0].startswith("-"):
        word = args.pop(0)
        name, eq, value = word.partition("=")
        if name not in known:
            return None
        if not eq:
            if not args:
                return None
            value = args.pop(0)
        if not value or value.startswith("-"):
            return None
        out.append((name, value))
    return out


def _env(name: str) -> str | None:
    return os.environ.get(name) or None  # typer ignores a set but empty variable


def parse_serve(
    argv: Sequence[str],
) -> tuple[Globals, list[str], str | None, str | None, str | None] | None:
    """``(globals, --bot names, --listen, --capture, --instance)`` when *argv* (without the
    program name) is a
    plain serve command that typer would accept with the same meaning; None otherwise,
    and typer then handles it (help, errors, other commands)."""
    args = list(argv)
    before = _options(args, _GLOBAL_OPTIONS)
    if before is None or args[:1] != ["serve"]:
        return None
    del args[0]
    after = _options(args, _SERVE_OPTIONS)
    if after is None or args:
        return None
    given = dict(before)  # a repeated option: the last one counts, as in typer
    level = given.get("--log-level", "info").lower()
    fmt = given.get("--log-format")
    if level not in LOG_LEVELS or (fmt is not None and fmt not in LOG_FORMATS):
        return None
    config = given.get("--config") or _env("DSHIM_CONFIG")
    data = given.get("--data-dir") or _env("DSHIM_DATA_DIR")
    g = Globals(Path(config) if config else None, Path(data) if data else None, level, fmt)
    bots = [value for name, value in after if name == "--bot"]
    listen = dict(after).get("--listen") or _env("DSHIM_HTTP_LISTEN")
    instance = dict(after).get("--instance") or _env("DSHIM_INSTANCE")
    return g, bots, listen, dict(after).get("--capture"), instance
