"""``dshim probe``: run checks and print a table (check, result, detail, ms).

Core checks: config valid, data dir writable, store opens and migrates, harness
reachable.  Each channel adds its own checks through ``probe_checks(ctx)``.  Exit code 0
when nothing failed, 1 when a check failed, 2 for configuration errors.  Details never
contain secrets: they are passed through the log redactor before printing.

A check that fails on the network says which host and why, in its one row: DNS lookup
failed, connection refused, TLS handshake failed, no answer within the check's limit
(``--timeout`` sets every check's limit).  The host comes from the failed request, else
from the URLs in the bot's settings.  The probe takes no lock on the data directory: it
runs next to a running ``dshim serve``.
"""

from __future__ import annotations

import functools
import socket
import tempfile
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import trio

from dshim.channels.base import ChannelStore, Check, Identity, ProbeResult
from dshim.channels.registry import default_config, load_config
from dshim.config import DEFAULT_CONFIG_LABEL, BotConfig, Config, resolve_data_dir, settings_of
from dshim.errors import ConfigError, DshimError
from dshim.log import register_secret
from dshim.store.base import BoundStore, Store

Result = ProbeResult
S = TypeVar("S", bound=msgspec.Struct)
CHECK_TIMEOUT_S = 20.0
#: The cursor the store check writes and reads back.
PROBE_CURSOR = "probe"


class ProbeRow(msgspec.Struct, frozen=True):
    check: str
    result: Result
    detail: str
    ms: float


class BotProbe:
    """The :class:`~dshim.channels.base.ProbeRows` of one bot: its rows of the table."""

    def __init__(
        self,
        *,
        config: Config,
        bot: BotConfig,
        store: Store,
        send_test: bool,
        timeout_s: float | None = None,
        hosts: Sequence[str] = (),
    ) -> None:
        self.config = config
        #: The hosts the bot's settings name, for failures that do not say which one.
        self._hosts = tuple(hosts)
        #: ``--timeout``: every check's limit instead of its own (None: its own).
        self._timeout_s = timeout_s
        self._bot = bot
        self._store = BoundStore(store, bot.name)
        path = getattr(store, "path", None)
        self._data_dir = Path(path).parent if isinstance(path, str) else None
        self._send_test = send_test
        self.rows: list[ProbeRow] = []

    @property
    def store(self) -> ChannelStore:
        return self._store

    @property
    def bot(self) -> BotConfig:
        return self._bot

    @property
    def send_test(self) -> bool:
        return self._send_test

    @property
    def data_dir(self) -> Path | None:
        """The data directory (the store's), where channels keep saved logins."""
        return self._data_dir

    @property
    def http_listen(self) -> str | None:
        return self.config.http.listen if self.config.http.enabled else None

    def settings_as(self, kind: type[S]) -> S:
        return settings_of(self._bot, kind)

    def register_secret(self, secret: str) -> None:
        register_secret(secret)

    def add(self, check: str, result: Result, detail: str, ms: float = 0.0) -> None:
        self.rows.append(ProbeRow(f"{self._bot.name}: {check}", result, _safe(detail), ms))

    async def run(
        self,
        check: str,
        fn: Callable[[], Awaitable[tuple[Result, str]]],
        *,
        timeout_s: float = CHECK_TIMEOUT_S,
    ) -> Result:
        """Time one check; exceptions and timeouts become a ``fail`` row.  A network
        failure's row names the host and the cause (see :func:`network_failure`)."""
        if self._timeout_s is not None:
            timeout_s = self._timeout_s
        t0 = time.perf_counter()
        try:
            with trio.fail_after(timeout_s):
                result, detail = await fn()
        except trio.TooSlowError:
            result, detail = "fail", f"no answer within {timeout_s:g} s{self._from_hosts()}"
        except Exception as exc:
            if not all(isinstance(e, _CHECK_FAILURES) for e in _leaves(exc)):
                raise  # a bug: its traceback is what should be seen
            result, detail = "fail", network_failure(exc, self._hosts) or _plain(exc)
        self.add(check, result, detail, (time.perf_counter() - t0) * 1000)
        return result

    def _from_hosts(self) -> str:
        return f" from {' or '.join(self._hosts)}" if self._hosts else ""

    async def standard(
        self,
        *,
        credentials: str,
        identity: Callable[[], Awaitable[Identity]],
        checks: Sequence[Check] = (),
        send_test: Callable[[str], Awaitable[str]],
    ) -> None:
        """See :meth:`dshim.channels.base.ProbeRows.standard`."""
        self.add("credentials", "ok", credentials)

        async def who() -> tuple[Result, str]:
            me = await identity()
            detail = f"{me.name} (id {me.id})"
            if me.warning:
                return "warn", f"{detail}: {me.warning}"
            return "ok", detail

        if await self.run("identity", who) == "fail":
            return
        channel_ok = True
        for check in checks:
            if await self.run(check.name, check.run, timeout_s=check.timeout_s) == "fail":
                channel_ok = False
                break
        bound = self._store

        async def writable() -> tuple[Result, str]:
            stamp = f"{time.time():.6f}"
            await bound.set_cursor(PROBE_CURSOR, stamp)
            if await bound.get_cursor(PROBE_CURSOR) != stamp:
                return "fail", "a value written to the store did not read back"
            return "ok", "writable (a cursor was written and read back)"

        await self.run("store", writable)
        if not self._send_test or not channel_ok:
            return

        async def test_message() -> tuple[Result, str]:
            conversation = await bound.last_direct()
            if conversation is None:
                return "warn", (
                    "no direct conversation yet: send the bot a direct message, then run "
                    "--send-test again"
                )
            sent = await send_test(conversation)
            return "ok", f"sent to conversation {conversation} (message {sent})"

        await self.run("send test", test_message)


# --- failures ---------------------------------------------------------------------------------

#: What a check may fail with (anything else is a bug and propagates).
_CHECK_FAILURES = (DshimError, OSError, trio.BrokenResourceError)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for sub in exc.exceptions for leaf in _leaves(sub)]
    return [exc]


def _plain(exc: BaseException) -> str:
    return "; ".join(f"{type(e).__name__}: {e}" for e in _leaves(exc))


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc``, what caused it (``__cause__`` / ``__context__``) and the members of every
    group on the way, in that order, each once."""
    out: list[BaseException] = []
    todo = [exc]
    while todo:
        e = todo.pop(0)
        if any(e is seen for seen in out):
            continue
        out.append(e)
        if isinstance(e, BaseExceptionGroup):
            todo.extend(e.exceptions)
        for nxt in (e.__cause__, e.__context__):
            if nxt is not None:
                todo.append(nxt)
    return out


def host_of(url: str) -> str | None:
    """``host`` or ``host:port`` (a port only when the URL gives one) of a URL; never its
    user, path or query (those can carry tokens)."""
    try:
        parts = urllib.parse.urlsplit(url)
        host, port = parts.hostname, parts.port
    except ValueError:
        return None
    if not host:
        return None
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{port}" if port is not None else host


def _request_host(exc: BaseException) -> str | None:
    import httpx

    if not isinstance(exc, httpx.RequestError):
        return None
    try:
        url = exc.request.url
    except RuntimeError:  # raised without its request
        return None
    return host_of(str(url))


def network_failure(exc: BaseException, hosts: Sequence[str] = ()) -> str | None:
    """One line naming the host and the cause of a network failure (DNS, refused, TLS,
    timeout, reset) in ``exc`` or what caused it; None when it is not one.

    The host is the failed request's (httpx errors carry it), else ``hosts`` (the ones
    the bot's settings name).
    """
    import ssl

    import httpx

    chain = _causes(exc)
    host = next((h for h in map(_request_host, chain) if h is not None), None)
    where = host or " or ".join(hosts) or "the platform"
    for e in chain:
        if isinstance(e, socket.gaierror):
            return f"DNS lookup of {where} failed: {e.strerror or e}"
    for e in chain:
        if isinstance(e, ssl.SSLCertVerificationError):
            return f"TLS handshake with {where} failed: {e.verify_message or e.reason or e}"
        if isinstance(e, ssl.SSLError):
            reason = (e.reason or str(e)).replace("_", " ").lower()
            hint = " (is it a TLS port?)" if "wrong version" in reason else ""
            return f"TLS handshake with {where} failed: {reason}{hint}"
    for e in chain:
        if isinstance(e, ConnectionRefusedError):
            return f"cannot connect to {where}: connection refused"
    for e in chain:
        if isinstance(e, httpx.ConnectTimeout):
            return f"cannot connect to {where}: timed out"
        if isinstance(e, (httpx.TimeoutException, TimeoutError)):
            return f"no answer from {where}: timed out"
    for e in chain:
        if isinstance(e, ConnectionResetError):
            return f"the connection to {where} was reset"
        if isinstance(e, trio.BrokenResourceError | httpx.RemoteProtocolError):
            return f"the connection to {where} broke: {_plain(e)}"
    for e in chain:
        if isinstance(e, OSError):
            return f"cannot connect to {where}: {e.strerror or e}"
    return None


def _safe(text: str) -> str:
    from dshim.log import redact

    return redact(" ".join(text.split()))


def format_table(rows: list[ProbeRow]) -> str:
    header = ("check", "result", "detail", "ms")
    body = [(r.check, r.result, r.detail, f"{r.ms:.0f}") for r in rows]
    widths = [
        max(len(header[i]), *(len(b[i]) for b in body)) if body else len(header[i])
        for i in range(4)
    ]
    widths[2] = min(widths[2], 90)

    def fmt(cols: tuple[str, ...]) -> str:
        return "  ".join(
            (c.rjust(widths[i]) if i == 3 else c.ljust(widths[i])) for i, c in enumerate(cols)
        ).rstrip()

    lines = [fmt(header), fmt(tuple("-" * w for w in widths))]
    lines += [fmt(b) for b in body]
    return "\n".join(lines)


async def _probe(
    config_path: Path | None,
    data_dir_opt: Path | None,
    bot_name: str | None,
    send_test: bool,
    *,
    timeout_s: float | None = None,
) -> tuple[list[ProbeRow], int]:
    rows: list[ProbeRow] = []
    t0 = time.perf_counter()
    try:
        config = load_config(config_path) if config_path is not None else default_config()
    except ConfigError as exc:
        rows.append(ProbeRow("config", "fail", _safe(str(exc)), (time.perf_counter() - t0) * 1000))
        return rows, 2
    rows.append(
        ProbeRow(
            "config",
            "ok",
            f"{config_path or DEFAULT_CONFIG_LABEL}: {len(config.bots)} bot(s), "
            f"harness {config.harness.kind}",
            (time.perf_counter() - t0) * 1000,
        )
    )
    from dshim.log import register_secret

    for secret in config.secrets():
        register_secret(secret)
    bots = config.bots
    if not bots:
        rows.append(
            ProbeRow(
                "bots",
                "fail",
                "no bots in the configuration: add a [[bots]] table (see docs/configuration.md)",
                0.0,
            )
        )
    if bot_name is not None:
        bots = [b for b in config.bots if b.name == bot_name]
        if not bots:
            rows.append(ProbeRow("config", "fail", f"no bot named {bot_name!r}", 0.0))
            return rows, 2
    data_dir = resolve_data_dir(config, data_dir_opt)
    t0 = time.perf_counter()
    writable, detail = await trio.to_thread.run_sync(_check_writable, data_dir)
    rows.append(
        ProbeRow(
            "data dir", "ok" if writable else "fail", detail, (time.perf_counter() - t0) * 1000
        )
    )
    if not writable:
        return rows, 1

    from dshim.store import open_store_from_config

    t0 = time.perf_counter()
    try:
        async with open_store_from_config(config, data_dir) as store:
            version = await store.schema_version()
            rows.append(
                ProbeRow(
                    "store", "ok", f"schema version {version}", (time.perf_counter() - t0) * 1000
                )
            )
            await _harness_check(config, rows, timeout_s or CHECK_TIMEOUT_S)
            for bot in bots:
                rows.extend(await _bot_checks(config, bot, store, send_test, timeout_s))
    except DshimError as exc:
        rows.append(ProbeRow("store", "fail", _safe(str(exc)), (time.perf_counter() - t0) * 1000))
    if not config.bots:
        return rows, 2  # like serve: there is nothing to run
    failed = any(r.result == "fail" for r in rows)
    return rows, 1 if failed else 0


def _check_writable(path: Path) -> tuple[bool, str]:
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".probe-", delete=True) as f:
            f.write(b"ok")
            f.flush()
    except OSError as exc:
        return False, f"{path}: {exc.strerror or exc}"
    return True, f"{path} is writable"


async def _harness_check(
    config: Config, rows: list[ProbeRow], timeout_s: float = CHECK_TIMEOUT_S
) -> None:
    """The harness row, then one row per capability the adapter reports (ACP: image,
    load session, models, steer; OpenAI: vision).  ACP agents are spawned, initialized,
    asked and shut down again; OpenAI checks that ``GET /models`` lists the model."""
    from dshim.harness import create_harness, open_harness
    from dshim.harness.base import ProbesCapabilities

    t0 = time.perf_counter()
    try:
        harness = create_harness(config.harness, bot="probe", store=None, workspace=None)
        async with open_harness(harness) as h:
            with trio.fail_after(timeout_s):
                detail = await h.check()
            rows.append(
                ProbeRow(
                    "harness",
                    "ok",
                    _safe(f"{config.harness.kind}: {detail}"),
                    (time.perf_counter() - t0) * 1000,
                )
            )
            if isinstance(h, ProbesCapabilities):
                t1 = time.perf_counter()
                with trio.fail_after(timeout_s):
                    items = await h.probe_details()
                ms = (time.perf_counter() - t1) * 1000
                for item in items:
                    rows.append(
                        ProbeRow(f"harness: {item.name}", item.result, _safe(item.detail), ms)
                    )
    except (DshimError, OSError, trio.TooSlowError) as exc:
        rows.append(
            ProbeRow(
                "harness",
                "fail",
                _safe(f"{config.harness.kind}: {exc}"),
                (time.perf_counter() - t0) * 1000,
            )
        )


async def _bot_checks(
    config: Config, bot: BotConfig, store: Store, send_test: bool, timeout_s: float | None
) -> list[ProbeRow]:
    from dshim.channels.registry import load_channel

    try:
        channel = load_channel(bot.channel)
    except ConfigError as exc:
        rows = BotProbe(config=config, bot=bot, store=store, send_test=send_test)
        rows.add("channel", "fail", str(exc))
        return rows.rows
    rows = BotProbe(
        config=config,
        bot=bot,
        store=store,
        send_test=send_test,
        timeout_s=timeout_s,
        hosts=_setting_hosts(bot, channel.settings),
    )
    if not bot.enabled:
        rows.add("enabled", "warn", "enabled = false: serve will not start this bot")
    await channel.probe(rows)
    return rows.rows


def _setting_hosts(bot: BotConfig, kind: type[msgspec.Struct]) -> list[str]:
    """The hosts of the URLs in the bot's settings (``api_base``, ``ws_url`` ...,
    their defaults included), in field order, each once."""
    try:
        settings = settings_of(bot, kind)
    except ConfigError:
        return []
    hosts: list[str] = []
    for field in msgspec.structs.fields(kind):
        value = getattr(settings, field.name, None)
        if isinstance(value, str) and value.startswith(("http://", "https://", "ws://", "wss://")):
            host = host_of(value)
            if host is not None and host not in hosts:
                hosts.append(host)
    return hosts


def run_probe(
    config_path: Path | None,
    data_dir: Path | None,
    *,
    bot: str | None,
    send_test: bool,
    out: Callable[[str], Any],
    timeout_s: float | None = None,
) -> int:
    """Run ``dshim probe`` and print its table; the exit code.  ``timeout_s`` (``--timeout``)
    is the limit of every check instead of its own (20 s for most)."""
    rows, code = trio.run(
        functools.partial(_probe, config_path, data_dir, bot, send_test, timeout_s=timeout_s)
    )
    out(format_table(rows))
    return code
