"""What the per-channel rigs of the shared contract (``tests/rig_<key>.py``) have in common.

:class:`FakeRig` is a :class:`~tests.channel_contract.ChannelRig` without the platform's
words: the channel under test, its fake opened by ``rig.open()``, waiting on the fake, and
(for fakes with a ``live`` connection) receiving and dropping it.  Each rig subclasses it
and says only what is its platform's: the bot table, how a user writes, what the chat
shows, which calls receive, and its faults.

Also what the channels' e2e tests start bots with: :func:`serving` (``serve_bots`` on a
config and store, shut down gracefully) and :func:`bot_on_fake` (one bot against a fresh
fake, on a real store, within a deadline, once the fake says it is ready).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Generic, TypeVar

import trio

from dshim.channels.base import BotHost, Channel, HttpHandler, WebSocketHandler
from dshim.channels.registry import parse_config
from dshim.config import Config
from dshim.harness.base import Harness
from dshim.http.app import Endpoint
from dshim.http.server import serve_endpoint
from dshim.serve import serve_bots
from dshim.store import open_store
from dshim.store.base import Store
from tests.helpers import Events

F = TypeVar("F")


def seeded(module: ModuleType, seed: int, **run_options: Any) -> Channel:
    """A channel module's ``CHANNEL`` whose ``run`` has a fixed jitter seed (and options)."""
    return dataclasses.replace(
        module.CHANNEL,
        run_fn=functools.partial(module.run, rng=random.Random(seed), **run_options),
    )


def im_source(channel: str, kind: str, sender_id: str, sender_name: str | None = None) -> str:
    """The ``<dsh_im_source>`` block of a sender in a direct or group chat."""
    block = {"channel": channel, "conversationType": kind, "senderId": sender_id}
    if sender_name is not None:
        block["senderName"] = sender_name
    return "<dsh_im_source>" + json.dumps(block, separators=(",", ":")) + "</dsh_im_source>"


class EndpointHost:
    """The serve host of a bot, mounting on a test's own endpoint (``serve_bots`` in the
    shared scenarios runs without one) — or, given none, on the host's own, which refuses
    with the ConfigError of a bot whose ``[http]`` is disabled."""

    def __init__(self, host: BotHost, endpoint: Endpoint | None) -> None:
        self._host = host
        self._endpoint = endpoint

    def __getattr__(self, name: str) -> Any:
        return getattr(self._host, name)

    def mount(self, path: str, handler: HttpHandler, *, public: bool = False) -> None:
        if self._endpoint is None:
            self._host.mount(path, handler, public=public)
        else:
            self._endpoint.mount(self._host.bot.name, path, handler, public=public)

    def mount_websocket(self, path: str, handler: WebSocketHandler) -> None:
        if self._endpoint is None:
            self._host.mount_websocket(path, handler)
        else:
            self._endpoint.mount_websocket(self._host.bot.name, path, handler)


@asynccontextmanager
async def open_endpoint(token: str | None = None) -> AsyncIterator[tuple[Endpoint, str]]:
    """dshim's HTTP endpoint on 127.0.0.1:0: (endpoint, its base URL)."""
    endpoint = Endpoint(token=token)
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            functools.partial(serve_endpoint, endpoint, "127.0.0.1:0", shutdown=stop)
        )
        try:
            yield endpoint, binds[0]
        finally:
            stop.set()


@dataclass
class Run:
    """A running ``serve_bots``: how it ended (empty while it runs), and its events."""

    results: dict[str, str]
    shutdown: trio.Event
    done: trio.Event


@asynccontextmanager
async def serving(
    config: Config, store: Store, *, grace_s: float, **serve_options: Any
) -> AsyncIterator[Run]:
    """``serve_bots(config, store, **serve_options)``, once it has started; leaving the
    block shuts it down gracefully and waits for the end (``grace_s`` plus a minute)."""
    run = Run({}, trio.Event(), trio.Event())
    async with trio.open_nursery() as nursery:

        async def serve(task_status: trio.TaskStatus[None]) -> None:
            run.results.update(
                await serve_bots(
                    config, store, shutdown=run.shutdown, task_status=task_status, **serve_options
                )
            )
            run.done.set()

        await nursery.start(serve)
        try:
            yield run
        finally:
            run.shutdown.set()
        with trio.fail_after(grace_s + 60):
            await run.done.wait()


class FakeRig(Generic[F]):
    """A channel under the shared scenarios against its fake platform (``F``)."""

    def __init__(self, channel: Channel, open_fake: Callable[[], AbstractAsyncContextManager[F]]):
        self._channel = channel
        self._open_fake = open_fake
        self._fake: F | None = None

    @property
    def channel(self) -> Channel:
        return self._channel

    @property
    def fake(self) -> F:
        assert self._fake is not None, "use the rig inside rig.open()"
        return self._fake

    @asynccontextmanager
    async def open(self) -> AsyncIterator[None]:
        async with self._open_fake() as fake:
            self._fake = fake
            yield

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        fake: Any = self.fake
        await fake.wait_until(predicate)

    async def receiving(self) -> None:
        await self.wait_until(self.connected)

    def connected(self) -> bool:
        """The bot's receiving connection is up (the fake's ``live`` one, by default)."""
        fake: Any = self.fake
        return fake.live is not None

    async def drop_connection(self) -> None:
        """The fake drops its live connection; wait until the bot has seen it close."""
        fake: Any = self.fake
        conn = fake.live
        await fake.drop_connection()
        if conn is not None:
            await self.wait_until(lambda: self.closed(conn))

    def closed(self, conn: Any) -> bool:
        """A dropped connection is closed (by default: the fake says who closed it)."""
        return conn.closed_by is not None


# --- one bot against a fresh fake, for a channel's e2e tests ---------------------------------


#: How a test sets the fake's knobs before the bot starts: a function, or the attributes.
Configure = Callable[[F], None] | Mapping[str, Any] | None


class Bot:
    """A running bot: its fake, the observer, its harness and store, and how it ended."""

    def __init__(self, fake: Any, harness: Harness) -> None:
        self.fake = fake
        self.events = Events()
        self.harness = harness
        self.results: dict[str, str] | None = None
        self.ended = trio.Event()
        self.shutdown = trio.Event()
        self.store: Store | None = None

    def drop_reasons(self) -> list[str]:
        return [r for _, r in self.events.drops]


@asynccontextmanager
async def bot_on_fake(
    open_fake: Callable[[], AbstractAsyncContextManager[F]],
    bot_table: Callable[[F], dict[str, Any]],
    channel: Channel,
    data_dir: Path,
    *,
    harness: Harness,
    deadline: float,
    ready: Callable[[F], bool] | None = None,
    configure: Configure[F] = None,
    fake: F | None = None,
    crash: bool = False,
) -> AsyncIterator[tuple[Bot, F]]:
    """One bot (``serve_bots`` on a real store in ``data_dir``) against a fresh fake (or
    ``fake``), all within ``deadline``.  ``configure`` sets the fake's knobs before the bot
    starts (a dict: the attributes to set); ``bot_table`` gives its ``[[bots]]`` table; the block starts once ``ready``
    holds.  Leaving it shuts the bot down the way SIGTERM does, or with ``crash`` cancels
    it at once."""
    with trio.fail_after(deadline):
        async with _given_or(fake, open_fake) as fake_:
            if isinstance(configure, Mapping):
                for name, value in configure.items():
                    assert hasattr(fake_, name), f"the fake has no knob {name!r}"
                    setattr(fake_, name, value)
            elif configure is not None:
                configure(fake_)
            table = bot_table(fake_)
            config = parse_config({"bots": [table]}, env={})
            bot = Bot(fake_, harness)
            async with open_store(data_dir, inline=True) as store, trio.open_nursery() as nursery:
                bot.store = store

                async def serve() -> None:
                    bot.results = await serve_bots(
                        config,
                        store,
                        shutdown=bot.shutdown,
                        channels={table["name"]: channel},
                        observer=bot.events,
                        harness=harness,
                    )
                    bot.ended.set()

                nursery.start_soon(serve)
                try:
                    if ready is not None:
                        fake_any: Any = fake_
                        await fake_any.wait_until(lambda: ready(fake_))
                    yield bot, fake_
                finally:
                    if not crash:
                        bot.shutdown.set()
                        with trio.move_on_after(30):
                            await bot.ended.wait()
                    nursery.cancel_scope.cancel()


@asynccontextmanager
async def _given_or(
    fake: F | None, open_fake: Callable[[], AbstractAsyncContextManager[F]]
) -> AsyncIterator[F]:
    if fake is not None:
        yield fake
        return
    async with open_fake() as new:
        yield new
