"""The ``dshim`` command line: serve, init, probe, login, replay, migrate.  Thin: everything lives in the
package.

Which configuration: ``--config PATH`` (or ``DSHIM_CONFIG``) when given — it must exist —
else ``./dshim.toml`` when it exists, else the built-in default
(:func:`dshim.channels.registry.default_config`: the web chat with the echo harness), so a bare
``dshim serve`` works on a fresh install.

Exit codes: 0 ok, 1 a check or run failed, 2 usage or configuration error.  Heavy modules
(channels, harness adapters, trio, httpx) are imported inside the commands so that
``dshim --help`` starts fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from typer import _click as click  # the click typer vendors: its contexts and errors
from typer._click.exceptions import NoSuchOption
from typer.core import TyperArgument, TyperCommand

from dshim import __version__, launch
from dshim.launch import LOCAL_CONFIG, Globals, config_path, setup_logging

#: The options of ``dshim`` itself: they go before the command.
GLOBAL_OPTIONS = ("--config", "--data-dir", "--log-level", "--log-format", "--version")


class _Argument(TyperArgument):
    """An argument listed in ``--help`` by its metavar (PATH, BOT), never by the Python
    type typer would add (``<list[Path]>``, ``<str>``)."""

    def display_type_rich(self, ctx: click.Context) -> str | None:
        return None


class _Command(TyperCommand):
    """A dshim command: readable arguments in ``--help``, and a global option given after
    the command is answered with where it goes instead of a bare "No such option"."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if type(param) is TyperArgument:
                param.__class__ = _Argument  # typer offers no argument class of its own

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        given = list(args)  # the parser consumes its list
        try:
            return super().parse_args(ctx, args)
        except NoSuchOption as exc:
            if exc.option_name == "--version":
                exc.message += "\nThe version is an option of dshim itself: dshim --version"
            elif exc.option_name in GLOBAL_OPTIONS:
                exc.message += (
                    f"\nGlobal options go before the command: "
                    f"dshim {_moved(exc.option_name, given)} {ctx.info_name} ..."
                )
            raise


def _moved(option: str, args: list[str]) -> str:
    """``option`` with the value that followed it in ``args`` (for the hint)."""
    for i, word in enumerate(args):
        name, eq, _ = word.partition("=")
        if name == option:
            if eq or i + 1 == len(args):
                return word
            return f"{word} {args[i + 1]}"
    return option


app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    # Plain help: typer's rich help shows every flag as "--flag <bool>".
    rich_markup_mode=None,
    pretty_exceptions_enable=False,
    help="dshim connects IM bots on nine platforms to an AI agent (the harness).",
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _load(g: Globals) -> tuple[Any, str]:
    """The configuration and its label for messages (the file's name)."""
    try:
        return launch.load(g)
    except launch.Exit as exc:
        raise typer.Exit(exc.code) from None


def _version(value: bool) -> None:
    if value:
        typer.echo(f"dshim {__version__}")
        raise typer.Exit(0)


@app.callback()
def main_callback(
    ctx: typer.Context,
    config: Annotated[
        Path | None,
        typer.Option(
            "--config",
            envvar="DSHIM_CONFIG",
            help="Config file (default: ./dshim.toml; without one, serve runs the built-in "
            "web chat).",
            metavar="PATH",
        ),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(
            "--data-dir",
            envvar="DSHIM_DATA_DIR",
            metavar="PATH",
            help="State directory (default: $XDG_STATE_HOME/dshim, else ~/.local/state/dshim).",
        ),
    ] = None,
    log_level: Annotated[
        str, typer.Option("--log-level", help="debug, info, warning or error.", metavar="LEVEL")
    ] = "info",
    log_format: Annotated[
        str | None,
        typer.Option(
            "--log-format",
            help="console or json (default: console on a TTY, else json).",
            metavar="FORMAT",
        ),
    ] = None,
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        raise typer.BadParameter("expected debug, info, warning or error", param_hint="--log-level")
    if log_format is not None and log_format not in ("console", "json"):
        raise typer.BadParameter("expected console or json", param_hint="--log-format")
    ctx.obj = Globals(config, data_dir, log_level.lower(), log_format)


def _fail(message: str, code: int) -> typer.Exit:
    launch.fail(message, code)
    return typer.Exit(code)


@app.command(cls=_Command)
def serve(
    ctx: typer.Context,
    bot: Annotated[
        list[str] | None,
        typer.Option("--bot", help="Run only this bot (repeat for several).", metavar="NAME"),
    ] = None,
    listen: Annotated[
        str | None,
        typer.Option(
            "--listen",
            envvar="DSHIM_HTTP_LISTEN",
            help="Listen on HOST:PORT instead of [http] listen (port 0: any free port).",
            metavar="HOST:PORT",
        ),
    ] = None,
    capture: Annotated[
        str | None,
        typer.Option(
            "--capture",
            help="Write the traffic as replay fixtures under DIR (overrides [dshim] "
            "capture_dir; the files hold conversation text).",
            metavar="DIR",
        ),
    ] = None,
    instance: Annotated[
        str | None,
        typer.Option(
            "--instance",
            envvar="DSHIM_INSTANCE",
            help="This instance's name in a shared PostgreSQL store ([store] url; default: "
            "the host name and pid).",
            metavar="NAME",
        ),
    ] = None,
) -> None:
    """Run every enabled bot (or the ones named with --bot) until SIGINT/SIGTERM.

    Without a config file: the built-in web chat on http://127.0.0.1:8910/.
    """
    try:
        code = launch.serve(ctx.obj, bot or [], listen, capture, instance)
    except launch.Exit as exc:
        raise typer.Exit(exc.code) from None
    raise typer.Exit(code)


@app.command(cls=_Command)
def init(
    path: Annotated[
        Path,
        typer.Argument(
            help="Where to write it (default: ./dshim.toml; - writes to stdout).", metavar="PATH"
        ),
    ] = LOCAL_CONFIG,
) -> None:
    """Write a commented starter dshim.toml (never overwrites a file); ``-``: to stdout."""
    from dshim.channels.registry import starter_toml
    from dshim.config import write_starter
    from dshim.errors import ConfigError

    if str(path) == "-":
        typer.echo(starter_toml(), nl=False)
        return
    try:
        write_starter(path, starter_toml())
    except ConfigError as exc:
        raise _fail(str(exc), 2) from None
    typer.echo(
        f"wrote {path}: the web chat with the echo harness; uncomment a platform's [[bots]] "
        "block and set its environment variables, then run: dshim serve"
        + ("" if path == LOCAL_CONFIG else f" (with --config {path})")
    )


@app.command(cls=_Command)
def probe(
    ctx: typer.Context,
    bot: Annotated[
        str | None, typer.Argument(help="Only this bot (default: all).", metavar="BOT")
    ] = None,
    send_test: Annotated[
        bool,
        typer.Option(
            "--send-test", help='Send "dshim connection test" to the last direct conversation.'
        ),
    ] = False,
    timeout: Annotated[
        float | None,
        typer.Option(
            "--timeout",
            min=0.1,
            help="Give each check at most this long (default: 20 s for most).",
            metavar="SECONDS",
        ),
    ] = None,
) -> None:
    """Check configuration, data dir, store, harness and each bot's platform connection."""
    g: Globals = ctx.obj
    setup_logging(g, [])
    from dshim.probe import run_probe

    code = run_probe(
        config_path(g), g.data_dir, bot=bot, send_test=send_test, out=typer.echo, timeout_s=timeout
    )
    raise typer.Exit(code)


class _LoginTerminal:
    """The :class:`~dshim.channels.base.LoginContext` of ``dshim login``: the terminal."""

    def __init__(self, bot: Any, data_dir: Path, *, phone: str | None = None) -> None:
        self.bot = bot
        self.data_dir = data_dir
        #: ``--phone``: link with a pair code for this number instead of a QR code.
        self.phone = phone

    def settings_as(self, kind: Any) -> Any:
        from dshim.config import settings_of

        return settings_of(self.bot, kind)

    def register_secret(self, secret: str) -> None:
        from dshim.log import register_secret

        register_secret(secret)

    def say(self, text: str) -> None:
        typer.echo(text)

    async def ask(self, prompt: str) -> str:
        import trio

        return await trio.to_thread.run_sync(input, prompt)


@app.command(cls=_Command)
def login(
    ctx: typer.Context,
    bot: Annotated[str, typer.Argument(help="The bot to log in.", metavar="BOT")],
    phone: Annotated[
        str | None,
        typer.Option(
            "--phone",
            help="WhatsApp Web: link with a pair code for this number (+49...) instead of "
            "a QR code.",
            metavar="NUMBER",
        ),
    ] = None,
) -> None:
    """Log a bot in interactively where its platform needs it (WeChat, WhatsApp Web: scan
    a QR code)."""
    g: Globals = ctx.obj
    cfg, label = _load(g)
    from dshim.channels.base import login_hook
    from dshim.channels.registry import load_channel
    from dshim.config import data_dir_origin, prepare_data_dir
    from dshim.errors import ConfigError, DshimError

    known = {b.name: b for b in cfg.bots}
    if bot not in known:
        raise _fail(f"no bot named {bot!r} in {label} (bots: {', '.join(known) or 'none'})", 2)
    target = known[bot]
    try:
        hook = login_hook(load_channel(target.channel))
        if hook is None:
            raise ConfigError(f"bot {bot!r}: the {target.channel} channel has no login step")
        if phone is not None and target.channel != "whatsapp_web":
            raise ConfigError(f"--phone: the {target.channel} channel links by QR code only")
        data_dir = launch.data_dir(g, cfg)
        prepare_data_dir(data_dir, origin=data_dir_origin(cfg, g.data_dir, label))
    except ConfigError as exc:
        raise _fail(str(exc), 2) from None
    setup_logging(g, cfg.secrets())
    import trio

    try:
        code = trio.run(hook, _LoginTerminal(target, data_dir, phone=phone))
    except DshimError as exc:
        raise _fail(str(exc), 1) from None
    raise typer.Exit(code)


@app.command(cls=_Command)
def replay(
    ctx: typer.Context,
    paths: Annotated[
        list[Path],
        typer.Argument(help="Fixture files or directories (recursive *.json).", metavar="PATH"),
    ],
    check: Annotated[
        bool, typer.Option("--check", help="Compare with each fixture's expect list.")
    ] = False,
    update: Annotated[
        bool,
        typer.Option(
            "--update", help="Rewrite each fixture's expect list with the current output."
        ),
    ] = False,
    only_conversation: Annotated[
        str | None,
        typer.Option(
            "--only-conversation",
            help="Print (with --check: compare) only this conversation's lines; fixtures "
            "without it are skipped. Not with --update.",
            metavar="ID",
        ),
    ] = None,
) -> None:
    """Run captured fixtures through the real parsing code and pipeline (no network)."""
    g: Globals = ctx.obj
    setup_logging(
        g if g.log_level != "info" else Globals(g.config, g.data_dir, "warning", g.log_format), []
    )
    from dshim.replay import replay as run_replay

    code = run_replay(
        paths,
        check=check,
        update=update,
        out=typer.echo,
        err=lambda s: typer.echo(s, err=True),
        only_conversation=only_conversation,
    )
    raise typer.Exit(code)


@app.command(cls=_Command)
def status(
    ctx: typer.Context,
    store: Annotated[
        str | None,
        typer.Option(
            "--store",
            help="The PostgreSQL store's URL (default: [store] url / DSHIM_STORE_URL).",
            metavar="URL",
        ),
    ] = None,
) -> None:
    """Show the instances of a shared PostgreSQL store, the bots each holds and every
    bot's lease (owner, epoch, how long it still runs)."""
    g: Globals = ctx.obj
    cfg, _label = _load(g)
    from dshim.config import override_store_url
    from dshim.errors import ConfigError, DshimError

    try:
        if store is not None:
            cfg = override_store_url(cfg, store)
    except ConfigError as exc:
        raise _fail(str(exc), 2) from None
    setup_logging(g, cfg.secrets())
    import trio

    from dshim.sharing import sharing_report, sharing_table
    from dshim.store import open_store_from_config, store_target
    from dshim.store.base import SharesBots

    data_dir = launch.data_dir(g, cfg)

    async def run() -> str | None:
        async with open_store_from_config(cfg, data_dir) as opened:
            if not isinstance(opened, SharesBots):
                return None
            report = await sharing_report(opened, within_s=cfg.store.lease_s)
            return sharing_table(report)

    try:
        table = trio.run(run)
    except DshimError as exc:
        raise _fail(str(exc), 1) from None
    if table is None:
        typer.echo(
            f"store {store_target(cfg, data_dir)}: SQLite, one instance (a shared store needs "
            "[store] url)"
        )
        return
    typer.echo(f"store {store_target(cfg, data_dir)}")
    typer.echo(table)


@app.command(cls=_Command)
def migrate(ctx: typer.Context) -> None:
    """Bring the store's schema up to date (SQLite in the data directory, or the PostgreSQL
    database of [store] url / DSHIM_STORE_URL, under its advisory lock); prints the schema
    version before and after."""
    g: Globals = ctx.obj
    cfg, label = _load(g)
    from dshim.config import data_dir_origin, prepare_data_dir
    from dshim.errors import ConfigError, DshimError

    data_dir = launch.data_dir(g, cfg)
    try:
        prepare_data_dir(data_dir, origin=data_dir_origin(cfg, g.data_dir, label))
    except ConfigError as exc:
        raise _fail(str(exc), 2) from None
    setup_logging(g, cfg.secrets())
    import trio

    from dshim.store import open_store_from_config, read_schema_version, store_target

    async def run() -> tuple[int, int]:
        before = await read_schema_version(cfg, data_dir)
        async with open_store_from_config(cfg, data_dir) as store:
            return before, await store.schema_version()

    try:
        before, after = trio.run(run)
    except DshimError as exc:
        raise _fail(str(exc), 1) from None
    note = " (already up to date)" if before == after else ""
    typer.echo(f"store {store_target(cfg, data_dir)}: schema version {before} -> {after}{note}")
