"""``dshim serve``: the root nursery — store, HTTP endpoint, one supervised nursery per bot.

Theory of operation
-------------------
The root nursery holds a signal watcher and :func:`serve_process`: the local HTTP endpoint
(when ``[http]`` is enabled), started with ``nursery.start`` so that it listens before any
bot starts, and one supervisor per enabled bot.  A supervisor starts its channel with
``nursery.start`` (the bot counts as up only after it authenticated), and restarts it with
exponential backoff and jitter (1 s .. 30 s) when it fails with a transient error.  Fatal
errors (bad credentials, a platform's "never reconnect" close code, configuration) and
bugs (TypeError, AssertionError ...) stop that bot loudly and are not retried; other bots
are untouched.

Every supervisor reports its bot's state to the process's :class:`BotStatuses`
(``starting`` -> ``up`` at ``task_status.started()``, ``backoff`` with the retry time,
``stopped`` with the reason), which ``/readyz`` and ``dshim_bot_up`` read.  Each bot's
pipeline counts into the process's :class:`ProcessMetrics` (``/metrics``), and its
platform requests are counted through the kit's request counter, set around the bot's
tasks.

SIGINT/SIGTERM sets the shutdown event: the endpoint closes its open websockets and
finishes the requests in flight, every bot stops reading new events, running turns get
up to ``shutdown_grace_s`` (10 s) to finish, then everything is cancelled.  Accepted
messages that did not run stay in the durable inbox and run after the next start.  A bot
that is still starting (retrying an unreachable platform) or waiting out its backoff stops
at once.  A second signal cancels at once.  Either way the exit code is 0 (1 only when
every bot ended on its own), with no traceback.
"""

from __future__ import annotations

import contextlib
import functools
import html
import os
import random
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard, TypeVar

import msgspec
import structlog
import trio

from dshim.backoff import Backoff
from dshim.capture import Capture, open_capture
from dshim.channels.base import (
    Channel,
    ChannelStore,
    HasDataDir,
    HttpHandler,
    HttpRequest,
    HttpResponse,
    Inbound,
    RawDecoder,
    WebSocketHandler,
    relay_hook,
)
from dshim.channels.registry import load_channel
from dshim.config import BotConfig, Config, SubstituteTarget, settings_of
from dshim.errors import (
    BUG_TYPES,
    AuthError,
    ConfigError,
    DshimError,
    FatalChannelError,
    single_error,
)
from dshim.harness.base import Harness
from dshim.http.app import GRACEFUL_S, Endpoint
from dshim.http.ops import add_operator_routes
from dshim.http.status import BotStatuses
from dshim.leases import LeaseKeeper, cut_on_fence
from dshim.log import redact, register_secret
from dshim.metrics import NO_METRICS, BotMetrics, ProcessMetrics
from dshim.model import Delivered, InboundMessage, PromptPart, ReplyTarget, Skip
from dshim.net.http import counting_requests
from dshim.outbound import Outbound
from dshim.pipeline.runtime import BotRuntime, Clock, Observer, open_bot_runtime, wall_clock
from dshim.store import open_store_from_config
from dshim.store.base import BotRelay, BoundStore, RelaysWebhooks, SharesBots, Store
from dshim.store.lock import hold_data_dir_lock

log = structlog.get_logger("dshim.serve")

S = TypeVar("S", bound=msgspec.Struct)

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0
#: A bot that ran this long before failing starts its backoff from the minimum again.
HEALTHY_RUN_S = 60.0
#: The channel whose bot is the embedded default: its page and socket are also at the root.
ROOT_CHANNEL = "webchat"
#: The store's expired dedup keys and old outbound entries are swept this long after the
#: start (not during it: start-up stays quick) and then at this interval.
PRUNE_FIRST_S = 60.0
PRUNE_INTERVAL_S = 3600.0


class ShutdownScopes:
    """The cancel scopes to cancel when one shutdown event is set, watched by one task
    (:meth:`run`) for every bot of the process instead of a task per bot: a thousand
    bots waiting for the shutdown cost a set of scopes, not a thousand parked tasks."""

    def __init__(self, event: trio.Event) -> None:
        self.event = event
        self._scopes: set[trio.CancelScope] = set()

    @contextlib.contextmanager
    def cancelled_at_shutdown(self) -> Iterator[trio.CancelScope]:
        """A scope cancelled when the shutdown comes (at once if it already came)."""
        with trio.CancelScope() as scope:
            if self.event.is_set():
                scope.cancel()
            self._scopes.add(scope)
            try:
                yield scope
            finally:
                self._scopes.discard(scope)

    async def run(self) -> None:
        await self.event.wait()
        for scope in list(self._scopes):
            scope.cancel()


class ServeHost(HasDataDir):
    """The :class:`~dshim.channels.base.BotHost` of one bot under ``dshim serve``."""

    def __init__(
        self,
        *,
        config: Config,
        bot: BotConfig,
        store: Store,
        shutdown: trio.Event,
        clock: Clock = wall_clock,
        observer: Observer | None = None,
        harness: Harness | None = None,
        endpoint: Endpoint | None = None,
        metrics: BotMetrics = NO_METRICS,
        statuses: BotStatuses | None = None,
        capture: Capture | None = None,
        shutdown_scopes: ShutdownScopes | None = None,
    ) -> None:
        self.config = config
        self._endpoint = endpoint
        #: Where a scope is cancelled at ``shutdown`` without a task of this bot's
        #: (None, or another event's: a task of its own waits for ``shutdown``).
        self.shutdown_scopes = (
            shutdown_scopes
            if shutdown_scopes is not None and shutdown_scopes.event is shutdown
            else None
        )
        #: This bot's part of ``serve --capture`` (None: off, or ``capture = false``).
        self.capture = capture.for_bot(bot) if capture is not None else None
        self.metrics = metrics
        #: Where this bot's state is reported (None: nowhere).
        self.statuses = statuses
        self._bot = bot
        self._store = store
        self._bound = BoundStore(store, bot.name)
        self.shutdown = shutdown
        self._clock = clock
        self.observer = observer
        self.harness = harness
        self._runtime: BotRuntime | None = None
        for secret in bot.secrets():
            register_secret(secret)

    @property
    def bot(self) -> BotConfig:
        return self._bot

    @property
    def store(self) -> ChannelStore:
        return self._bound

    @property
    def clock(self) -> Callable[[], float]:
        return self._clock

    @property
    def relay(self) -> BotRelay | None:
        """The bot's webhook relay when the store is shared (a webhook another instance
        received comes this way), else None."""
        store = self._store
        return BotRelay(store, self._bot.name, self._clock) if _relays(store) else None

    @property
    def data_dir(self) -> Path | None:
        """The data directory (the store's), where channels keep saved logins."""
        data_dir = getattr(self._store, "data_dir", None)  # the PostgreSQL store's
        if isinstance(data_dir, Path):
            return data_dir
        path = getattr(self._store, "path", None)
        return Path(path).parent if isinstance(path, str) else None

    def settings_as(self, kind: type[S]) -> S:
        return settings_of(self._bot, kind)

    def register_secret(self, secret: str) -> None:
        register_secret(secret)

    def capture_identity(self, info: Mapping[str, Any]) -> None:
        """What the channel learned about itself, for a capture's ``bot`` (no-op when off)."""
        if self.capture is not None:
            self.capture.identity(info)

    @property
    def capturing(self) -> bool:
        return self.capture is not None

    def capture_sent(self, target: ReplyTarget, delivered: list[Delivered]) -> None:
        """An answer the stream's ``finish`` did not return, for the capture (no-op when off)."""
        if self.capture is not None:
            self.capture.sent(target, delivered)

    def mount(self, path: str, handler: HttpHandler, *, public: bool = False) -> None:
        self._need_endpoint().mount(self._bot.name, path, handler, public=public)

    def mount_websocket(self, path: str, handler: WebSocketHandler) -> None:
        self._need_endpoint().mount_websocket(self._bot.name, path, handler)

    def _need_endpoint(self) -> Endpoint:
        if self._endpoint is None:
            raise ConfigError(
                f"bots.{self._bot.name}: the {self._bot.channel} channel needs the local "
                "HTTP endpoint: remove `enabled = false` from [http]"
            )
        return self._endpoint

    @asynccontextmanager
    async def open_runtime(
        self,
        *,
        outbound: Outbound,
        bot_id: str,
        decode_raw: RawDecoder | None = None,
        substitute_targets: Sequence[SubstituteTarget] | None = None,
    ) -> AsyncIterator[Inbound]:
        """Open the bot's pipeline (resuming accepted-but-unfinished messages)."""
        observer = self.observer
        capture = self.capture
        if capture is not None:
            capture.identity(
                {"id": bot_id, "username": outbound.bot_username}
                if outbound.bot_username
                else {"id": bot_id}
            )
            observer = capture if observer is None else _Both(observer, capture)
        async with open_bot_runtime(
            config=self.config,
            bot=self._bot,
            bot_id=bot_id,
            store=self._store,
            outbound=outbound,
            harness=self.harness,
            clock=self._clock,
            observer=observer,
            decode_raw=decode_raw,
            metrics=self.metrics,
            substitute_targets=substitute_targets,
            capture=capture,
        ) as rt:
            self._runtime = rt
            try:
                yield rt
            finally:
                self._runtime = None

    @asynccontextmanager
    async def _watching(self) -> AsyncIterator[trio.CancelScope]:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                await self.shutdown.wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            yield nursery.cancel_scope
            nursery.cancel_scope.cancel()

    def cancelled_at_shutdown(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """A block cancelled when ``shutdown`` is set: through :attr:`shutdown_scopes`
        when it watches this event, else with a task of this bot's that waits for it."""
        if self.shutdown_scopes is not None:
            return _AsAsync(self.shutdown_scopes.cancelled_at_shutdown())
        return self._watching()

    async def serve(self, rt: Inbound, reader: Callable[[], Awaitable[None]]) -> None:
        """Run the channel's reader until shutdown, then drain running turns.

        The reader returns or raises to end the bot; on shutdown it is cancelled (a
        cancellation between accepting an event and confirming it to the platform is
        safe: the platform redelivers, dedup drops the copy, the inbox runs the original).
        """
        runtime = self._runtime
        if runtime is None or rt is not runtime:
            raise RuntimeError("serve() needs the runtime opened by this host's open_runtime()")
        async with self.cancelled_at_shutdown():
            await reader()
        if self.shutdown.is_set():
            if self.statuses is not None:
                self.statuses.stopped(self._bot.name, "shutting down")
            log.info("bot_draining", grace_s=self.config.dshim.shutdown_grace_s)
            await runtime.drain(self.config.dshim.shutdown_grace_s)


class _AsAsync(contextlib.AbstractAsyncContextManager[Any]):
    """A plain context manager used as an async one (no checkpoint, no task)."""

    def __init__(self, cm: contextlib.AbstractContextManager[Any]) -> None:
        self._cm = cm

    async def __aenter__(self) -> Any:
        return self._cm.__enter__()

    async def __aexit__(self, *exc: Any) -> bool | None:
        return self._cm.__exit__(*exc)


class _Both:
    """Two observers, told in order (a test's, then the capture)."""

    def __init__(self, first: Observer, second: Observer) -> None:
        self._first, self._second = first, second

    def on_drop(self, item: InboundMessage | Skip, reason: str) -> None:
        self._first.on_drop(item, reason)
        self._second.on_drop(item, reason)

    def on_command(self, msg: InboundMessage, name: str) -> None:
        self._first.on_command(msg, name)
        self._second.on_command(msg, name)

    def on_prompt(self, msg: InboundMessage, parts: list[PromptPart]) -> None:
        self._first.on_prompt(msg, parts)
        self._second.on_prompt(msg, parts)


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        out: list[BaseException] = []
        for sub in exc.exceptions:
            out.extend(_leaves(sub))
        return out
    return [exc]


def classify_failure(exc: BaseException) -> str:
    """'fatal', 'bug' or 'transient' for an exception that ended a bot."""
    leaves = _leaves(exc)
    if any(isinstance(e, (AuthError, FatalChannelError, ConfigError)) for e in leaves):
        return "fatal"
    if any(isinstance(e, BUG_TYPES) for e in leaves):
        return "bug"
    return "transient"


async def supervise_bot(
    channel: Channel,
    host: ServeHost,
    *,
    rng: random.Random | None = None,
) -> str:
    """Run one bot until shutdown or a fatal error.  Returns why it ended.

    Restarts after a failure wait 1, 2, 4 ... 30 s (with jitter, never under 1 s); the
    schedule starts over only after the bot ran for ``HEALTHY_RUN_S`` — a bot that
    starts and fails at once is not restarted in a tight loop.
    """
    backoff = Backoff(BACKOFF_MIN_S, BACKOFF_MAX_S, rng=rng)
    bot = host.bot
    status = _Reporter(host)
    with (
        structlog.contextvars.bound_contextvars(bot=bot.name, channel=bot.channel),
        counting_requests(host.metrics.platform_request),
    ):
        while not host.shutdown.is_set():
            started_at = trio.current_time()
            status.starting()
            try:
                async with trio.open_nursery() as nursery:
                    if await _start_unless_shutdown(nursery, channel, host):
                        status.up()
                        log.info("bot_started")
            except Exception as exc:
                kind = classify_failure(exc)
                if kind == "fatal":
                    log.error("bot_stopped_fatal", error=_describe(exc))
                    status.stopped(_describe(exc))
                    return "fatal"
                if kind == "bug":
                    log.error("bot_crashed_bug", exc_info=exc)
                    status.stopped(f"crashed (a bug; see the log): {_describe(exc)}")
                    return "bug"
                if trio.current_time() - started_at > HEALTHY_RUN_S:
                    backoff.reset()
                delay = backoff.next_delay()
                log.warning(
                    "bot_failed_restarting",
                    error=_describe(exc),
                    retry_in_s=round(delay, 2),
                    failures=backoff.failures,
                )
                status.backoff(delay, _describe(exc))
                with trio.move_on_after(delay):
                    await host.shutdown.wait()
                continue
            if host.shutdown.is_set():
                break
            if trio.current_time() - started_at > HEALTHY_RUN_S:
                backoff.reset()
            delay = backoff.next_delay()
            log.warning("bot_reader_ended_restarting", retry_in_s=round(delay, 2))
            status.backoff(delay, "the channel's reader ended")
            with trio.move_on_after(delay):
                await host.shutdown.wait()
    log.info("bot_stopped")
    status.stopped("shutdown")
    return "shutdown"


async def _start_unless_shutdown(nursery: trio.Nursery, channel: Channel, host: ServeHost) -> bool:
    """Start the channel's run in ``nursery``; False when shutdown came first.

    A channel retries its own start-up (an unreachable platform, a failing login) before
    it reports started, and only a started bot watches the shutdown event (in
    :meth:`ServeHost.serve`).  Until then there is nothing to drain: the start is
    cancelled as soon as shutdown is set.
    """
    async with host.cancelled_at_shutdown() as guard:
        await nursery.start(channel.run, host)
        guard.cancel()
        return True
    log.info("bot_start_cancelled")
    return False


class _Reporter:
    """A supervisor's reports to its host's :class:`BotStatuses` (if any)."""

    def __init__(self, host: ServeHost) -> None:
        self._statuses = host.statuses
        self._bot = host.bot
        self._clock = host.clock

    def starting(self) -> None:
        if self._statuses is not None:
            self._statuses.starting(self._bot.name, self._bot.channel)

    def up(self) -> None:
        if self._statuses is not None:
            self._statuses.up(self._bot.name)

    def backoff(self, delay: float, reason: str) -> None:
        if self._statuses is not None:
            self._statuses.backoff(self._bot.name, retry_at=self._clock() + delay, reason=reason)

    def stopped(self, reason: str) -> None:
        if self._statuses is not None:
            self._statuses.stopped(self._bot.name, reason)


def _describe(exc: BaseException) -> str:
    leaves = _leaves(exc)
    return redact("; ".join(f"{type(e).__name__}: {e}" for e in leaves))[:500]


async def serve_bots(
    config: Config,
    store: Store,
    *,
    shutdown: trio.Event,
    channels: Mapping[str, Channel] | None = None,
    clock: Clock = wall_clock,
    observer: Observer | None = None,
    harness: Harness | None = None,
    endpoint: Endpoint | None = None,
    metrics: ProcessMetrics | None = None,
    statuses: BotStatuses | None = None,
    capture: Capture | None = None,
    instance: str | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> dict[str, str]:
    """Supervise every enabled bot until all have ended.  Returns bot -> why it ended.

    ``channels`` maps bot names to their channel (default: loaded by the bot's key).
    Every enabled bot is registered as ``starting`` in ``statuses`` before any starts.
    With a store several instances share (:class:`~dshim.store.base.SharesBots`), a bot
    runs only while this instance (``instance``, default: host name and pid) holds its
    lease (:mod:`dshim.leases`).
    """
    results: dict[str, str] = {}
    enabled = [bot for bot in config.bots if bot.enabled]
    if statuses is not None:
        for bot in enabled:
            statuses.starting(bot.name, bot.channel)
    scopes = ShutdownScopes(shutdown)  # one task watches the shutdown for every bot

    def host_for(bot: BotConfig, bot_store: Store, bot_shutdown: trio.Event) -> ServeHost:
        return ServeHost(
            config=config,
            bot=bot,
            store=bot_store,
            shutdown=bot_shutdown,
            clock=clock,
            observer=observer,
            harness=harness,
            endpoint=endpoint,
            metrics=metrics.for_bot(bot.name, bot.channel) if metrics is not None else NO_METRICS,
            statuses=statuses,
            capture=capture,
            shutdown_scopes=scopes,
        )

    async def one(bot: BotConfig, channel: Channel) -> None:
        results[bot.name] = await supervise_bot(channel, host_for(bot, store, shutdown))

    def channel_of(bot: BotConfig) -> Channel:
        if channels is not None and bot.name in channels:
            return channels[bot.name]
        return load_channel(bot.channel)

    if isinstance(store, SharesBots):
        keeper = LeaseKeeper(
            store,
            instance or default_instance(),
            [b.name for b in enabled],
            lease_s=config.store.lease_s,
            started_at=clock(),
        )

        def elsewhere(bot: BotConfig, channel: Channel) -> None:
            if endpoint is not None:
                mount_elsewhere(endpoint, bot, channel, store, clock)

        async def leased(bot: BotConfig, channel: Channel) -> None:
            results[bot.name] = await run_leased(
                bot, channel, keeper, store, shutdown, host_for, statuses, elsewhere=elsewhere
            )

        async def stop_keeper() -> None:
            await shutdown.wait()
            keeper.stop()

        async with trio.open_nursery() as nursery:
            await nursery.start(keeper.run)
            nursery.start_soon(stop_keeper)
            if isinstance(store, RelaysWebhooks):
                nursery.start_soon(store.listen_relays)
            log.info("instance_started", instance=keeper.instance, lease_s=keeper.lease_s)
            async with trio.open_nursery() as bots:
                for bot in enabled:
                    channel = channel_of(bot)
                    elsewhere(bot, channel)  # served before the endpoint's first request
                    bots.start_soon(leased, bot, channel)
                task_status.started()
            await keeper.release_all()
            nursery.cancel_scope.cancel()
        return results

    async with trio.open_nursery() as watching:
        watching.start_soon(scopes.run)
        async with trio.open_nursery() as nursery:
            for bot in enabled:
                nursery.start_soon(one, bot, channel_of(bot))
            task_status.started()
        watching.cancel_scope.cancel()
    return results


def add_status_route(
    endpoint: Endpoint, store: SharesBots, instance: str, *, lease_s: float
) -> None:
    """``GET /status`` (behind the endpoint's token like every route): the shared store's
    live instances, the bots each holds and every lease (:mod:`dshim.sharing`)."""
    from dshim.sharing import sharing_report

    async def status(request: HttpRequest) -> HttpResponse:
        try:
            report = await sharing_report(store, within_s=lease_s)
        except DshimError as exc:
            body = msgspec.json.encode({"instance": instance, "error": str(exc)[:300]})
            return HttpResponse(503, body, "application/json", (("cache-control", "no-store"),))
        body = msgspec.json.encode({"instance": instance, **report})
        return HttpResponse(200, body, "application/json", (("cache-control", "no-store"),))

    endpoint.route("GET", "/status", status)


def default_instance() -> str:
    """An instance's name when none is given: the host's name and the process id."""
    return f"{socket.gethostname()}-{os.getpid()}"


async def run_leased(
    bot: BotConfig,
    channel: Channel,
    keeper: LeaseKeeper,
    store: SharesBots,
    shutdown: trio.Event,
    host_for: Callable[[BotConfig, Store, trio.Event], ServeHost],
    statuses: BotStatuses | None = None,
    *,
    elsewhere: Callable[[BotConfig, Channel], None] | None = None,
) -> str:
    """One bot of a shared store: run it whenever this instance holds its lease, until
    shutdown.  A lost lease cuts the run at once; a handover stops it gracefully and
    gives the lease up; a bot that stopped for good keeps its lease, parked.
    ``elsewhere(bot, channel)`` is called whenever the bot does not run here (at the
    start and after each run): what the endpoint serves for it meanwhile."""
    ended = "shutdown"
    with structlog.contextvars.bound_contextvars(bot=bot.name, channel=bot.channel):
        while True:
            if elsewhere is not None:
                elsewhere(bot, channel)
            if statuses is not None and bot.name not in keeper.held:
                statuses.elsewhere(bot.name, "another instance holds its lease and runs it")
            held = await keeper.granted(bot.name)
            if held is None:
                return ended
            run_shutdown = trio.Event()
            async with trio.open_nursery() as follow:
                follow.start_soon(_set_on_first, run_shutdown, (shutdown, held.handover))
                with held.scope:
                    log.info("bot_leased", epoch=held.lease.epoch, instance=keeper.instance)
                    fenced = cut_on_fence(store.fenced(held.lease), held.scope.cancel)
                    ended = await supervise_bot(channel, host_for(bot, fenced, run_shutdown))
                follow.cancel_scope.cancel()
            if held.scope.cancelled_caught:
                log.error("bot_cut_lease_lost", epoch=held.lease.epoch)
                keeper.forget(bot.name, held)
                ended = "lease lost"
                continue
            if ended in ("fatal", "bug"):
                keeper.park(bot.name)
                return ended
            await keeper.release(bot.name)


def mount_elsewhere(
    endpoint: Endpoint, bot: BotConfig, channel: Channel, store: SharesBots, clock: Clock
) -> None:
    """What this instance's endpoint serves for ``bot`` while another instance runs it:
    the channel's relay handler at its webhook route (a webhook may reach any instance
    behind a load balancer: verified here, run by the lease holder), the web chat's page
    naming the instance that runs it; nothing for the other channels."""
    endpoint.unmount(bot.name)
    hook = relay_hook(channel)
    if hook is not None and _relays(store):
        endpoint.mount(bot.name, "", hook(bot, BotRelay(store, bot.name, clock)), public=True)
    elif bot.channel == ROOT_CHANNEL:
        endpoint.mount(bot.name, "", elsewhere_page(bot.name, store))


def _relays(store: object) -> TypeGuard[RelaysWebhooks]:
    return isinstance(store, RelaysWebhooks)


def elsewhere_page(bot: str, store: SharesBots) -> HttpHandler:
    """The web chat's page on an instance that does not run it: 503 and the name of the
    instance that does (its chat and history live there)."""

    async def page(request: HttpRequest) -> HttpResponse:
        try:
            owner = next((lease.owner for lease in await store.leases() if lease.bot == bot), None)
        except DshimError:
            owner = None
        where = (
            f"on the dshim instance <b>{html.escape(owner)}</b>"
            if owner
            else "on another dshim instance (none holds it right now: try again shortly)"
        )
        body = (
            "<!doctype html><meta charset=utf-8><title>dshim: this chat runs elsewhere</title>"
            f"<h1>This chat runs elsewhere</h1><p>The web chat <b>{html.escape(bot)}</b> runs "
            f"{where}. Open that instance's address; see docs/multi-instance.md (web chat)."
        ).encode()
        return HttpResponse(
            503,
            body,
            "text/html; charset=utf-8",
            (("cache-control", "no-store"), ("retry-after", "5")),
        )

    return page


async def _set_on_first(target: trio.Event, events: Sequence[trio.Event]) -> None:
    """Set ``target`` as soon as one of ``events`` is set."""
    async with trio.open_nursery() as nursery:

        async def wait(event: trio.Event) -> None:
            await event.wait()
            nursery.cancel_scope.cancel()

        for event in events:
            nursery.start_soon(wait, event)
    target.set()


@dataclass(frozen=True, slots=True)
class Running:
    """What :func:`serve_process` reports once it listens (tests read it)."""

    #: The endpoint's URL for a browser (``http://127.0.0.1:8910/``); None when disabled.
    url: str | None
    endpoint: Endpoint | None
    statuses: BotStatuses
    metrics: ProcessMetrics


def browser_url(bind: str) -> str:
    """A bound address as hypercorn reports it (``http://0.0.0.0:8910``) as the URL to open:
    a wildcard address becomes its loopback form."""
    scheme, _, address = bind.partition("://")
    host, _, port = address.rpartition(":")
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "[::]":
        host = "[::1]"
    return f"{scheme}://{host}:{port}/"


def make_endpoint(config: Config, statuses: BotStatuses, metrics: ProcessMetrics) -> Endpoint:
    """The endpoint ``[http]`` describes, with the operators' routes."""
    http = config.http
    endpoint = Endpoint(
        token=http.token.get() if http.token else None,
        host=http.host,
        public_host=http.public_host,
    )
    endpoint.root_bot = next(
        (b.name for b in config.bots if b.enabled and b.channel == ROOT_CHANNEL), None
    )
    add_operator_routes(endpoint, statuses, metrics)
    return endpoint


async def prune_periodically(store: Store, clock: Clock) -> None:
    """Sweep what the store keeps only for a while (dedup keys past their TTL, outbound
    entries past 30 days, transcript rows past their retention, relayed webhook bodies
    nobody took): :data:`PRUNE_FIRST_S` after the start, then every
    :data:`PRUNE_INTERVAL_S`.  A failed sweep is logged and tried again next time."""
    await trio.sleep(PRUNE_FIRST_S)
    while True:
        try:
            await store.prune(now=clock())
        except DshimError as exc:
            log.warning("store_prune_failed", error=str(exc))
        await trio.sleep(PRUNE_INTERVAL_S)


async def serve_process(
    config: Config,
    store: Store,
    *,
    shutdown: trio.Event,
    channels: Mapping[str, Channel] | None = None,
    clock: Clock = wall_clock,
    observer: Observer | None = None,
    harness: Harness | None = None,
    announce: Callable[[str], None] | None = None,
    capture: Capture | None = None,
    instance: str | None = None,
    task_status: trio.TaskStatus[Running] = trio.TASK_STATUS_IGNORED,
) -> dict[str, str]:
    """The HTTP endpoint (when ``[http]`` is enabled) and every enabled bot, until every
    bot has ended.  Returns bot -> why it ended.

    The endpoint listens before the bots start; its URL goes to ``announce`` and
    ``task_status``.  ``shutdown`` stops the endpoint (open websockets closed, requests in
    flight finished) and the bots; when the bots end on their own it stops too.
    """
    statuses = BotStatuses(clock)
    statuses.store_open = True  # the caller opened it; it stays open while this runs
    metrics = ProcessMetrics(statuses.up_flags)
    endpoint = make_endpoint(config, statuses, metrics) if config.http.enabled else None
    if isinstance(store, SharesBots):
        instance = instance or default_instance()
        if endpoint is not None:
            add_status_route(endpoint, store, instance, lease_s=config.store.lease_s)
    stop_http = trio.Event()
    endpoint_done = trio.Event()
    try:
        with single_error():
            async with trio.open_nursery() as nursery:
                url = None
                if endpoint is not None:
                    binds = await nursery.start(
                        _run_endpoint, endpoint, config.http.listen, stop_http, endpoint_done
                    )
                    log.info("http_listening", urls=binds)
                    url = browser_url(binds[0])
                    if announce is not None:
                        announce(url)
                else:
                    endpoint_done.set()

                async def follow_shutdown() -> None:
                    await shutdown.wait()
                    stop_http.set()  # open chat sockets close, requests in flight finish

                nursery.start_soon(follow_shutdown)
                nursery.start_soon(prune_periodically, store, clock)
                task_status.started(Running(url, endpoint, statuses, metrics))
                results = await serve_bots(
                    config,
                    store,
                    shutdown=shutdown,
                    channels=channels,
                    clock=clock,
                    observer=observer,
                    harness=harness,
                    endpoint=endpoint,
                    metrics=metrics,
                    statuses=statuses,
                    capture=capture,
                    instance=instance,
                )
                stop_http.set()  # every bot ended: the endpoint stops too, gracefully
                with trio.move_on_after(GRACEFUL_S + 1):
                    await endpoint_done.wait()
                nursery.cancel_scope.cancel()
    finally:
        statuses.store_open = False
    return results


async def _run_endpoint(
    endpoint: Endpoint,
    listen: str,
    stop: trio.Event,
    done: trio.Event,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        # hypercorn is imported only when the endpoint runs (a third of dshim's start-up).
        from dshim.http.server import serve_endpoint

        await serve_endpoint(endpoint, listen, shutdown=stop, task_status=task_status)
    finally:
        done.set()


async def _serve_main(
    config: Config,
    data_dir: Path,
    announce: Callable[[str], None] | None,
    signalled: Callable[[], bool],
    instance: str | None = None,
) -> int:
    enabled = [b for b in config.bots if b.enabled]
    if not enabled:
        raise ConfigError(
            "no enabled bots in the configuration: add a [[bots]] table (see docs/configuration.md)"
        )
    channels = {b.name: load_channel(b.channel) for b in enabled}
    shutdown = trio.Event()
    #: Stays empty when a second signal (or the hard stop) cancels the bots.
    results: dict[str, str] = {}
    # The receiver is open until the store is closed: a signal at any point of the
    # shutdown is ours (never a KeyboardInterrupt out of trio.run, i.e. a traceback).
    with (
        trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received,
        single_error(),
    ):
        async with (
            open_store_from_config(config, data_dir) as store,
            open_capture(config, clock=wall_clock, data_dir=data_dir) as capture,
            trio.open_nursery() as root,
        ):

            async def signals() -> None:
                async for signum in received:
                    if not shutdown.is_set():
                        log.info("shutdown_requested", signal=signal.Signals(signum).name)
                        shutdown.set()
                        root.start_soon(hard_stop)
                    else:
                        log.warning("shutdown_forced", signal=signal.Signals(signum).name)
                        root.cancel_scope.cancel()

            async def hard_stop() -> None:
                await trio.sleep(config.dshim.shutdown_grace_s + 5)
                log.warning("shutdown_timed_out")
                root.cancel_scope.cancel()

            root.start_soon(signals)
            if signalled():  # a signal came before the receiver was open
                log.info("shutdown_requested", signal="before the start")
                shutdown.set()
                root.start_soon(hard_stop)
            log.info("serve_started", bots=[b.name for b in enabled], data_dir=str(data_dir))
            results = await serve_process(
                config,
                store,
                shutdown=shutdown,
                channels=channels,
                announce=announce,
                capture=capture,
                instance=instance,
            )
            root.cancel_scope.cancel()
    log.info("serve_stopped", results=results)
    return 0 if shutdown.is_set() else 1


#: Descriptors besides the bots' connections: the store, the endpoint, logs, a margin.
BASE_DESCRIPTORS = 64


@dataclass(frozen=True, slots=True)
class Descriptors:
    """What :func:`raise_descriptor_limit` found and did (``RLIMIT_NOFILE``)."""

    soft: int
    hard: int
    #: At least this many: one connection per bot (its long poll or websocket) and the base.
    needed: int
    #: Comfortable: two connections per bot (one held, one to send) and the base.
    wanted: int


def raise_descriptor_limit(bots: int) -> Descriptors | None:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one (each bot holds a connection of
    its own: a thousand bots need a thousand descriptors), and log an error when even the
    hard limit is below what ``bots`` bots need (a warning when it is only below the
    comfortable figure).  None where the limit cannot be read (not POSIX)."""
    try:
        import resource
    except ImportError:  # pragma: no cover - Windows
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed, wanted = BASE_DESCRIPTORS + bots, BASE_DESCRIPTORS + 2 * bots
    if soft != hard and (hard == resource.RLIM_INFINITY or soft < hard):
        target = hard if hard != resource.RLIM_INFINITY else max(soft, wanted)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (OSError, ValueError) as exc:
            log.warning("descriptor_limit_not_raised", soft=soft, hard=hard, error=str(exc))
    limit = soft if soft != resource.RLIM_INFINITY else wanted
    found = Descriptors(limit, hard, needed, wanted)
    how = "raise it: `ulimit -n`, systemd LimitNOFILE=, docker run --ulimit nofile="
    if limit < needed:
        log.error(
            "descriptor_limit_too_low",
            detail=f"{bots} bots hold a connection each: at least {needed} open files are "
            f"needed, the limit (RLIMIT_NOFILE) is {limit}; bots past it fail to connect "
            f"and keep retrying; {how}",
            limit=limit,
            needed=needed,
        )
    elif limit < wanted:
        log.warning(
            "descriptor_limit_low",
            detail=f"{bots} bots: the limit (RLIMIT_NOFILE) is {limit}, {wanted} gives each "
            f"bot room for a second connection; {how}",
            limit=limit,
            wanted=wanted,
        )
    return found


def run_serve(
    config: Config,
    data_dir: Path,
    *,
    announce: Callable[[str], None] | None = None,
    signalled: Callable[[], bool] = lambda: False,
    instance: str | None = None,
) -> int:
    """Run ``dshim serve`` to completion; returns the exit code.

    ``announce`` gets the endpoint's URL once it listens (the CLI prints it);
    ``signalled`` says whether SIGINT/SIGTERM came before the run (it then stops at once:
    the caller's handler remembered it, see :class:`dshim.launch.EarlySignals`).  The data
    directory is locked for the whole run: a second serve on it raises
    :class:`~dshim.errors.StoreError` before it starts anything.  The soft descriptor
    limit is raised to the hard one first, and a limit too low for the enabled bots is
    logged (:func:`raise_descriptor_limit`).
    """
    raise_descriptor_limit(sum(1 for b in config.bots if b.enabled))
    with hold_data_dir_lock(data_dir):
        return trio.run(
            functools.partial(_serve_main, config, data_dir, announce, signalled, instance)
        )
