"""``/readyz`` as an orchestrator reads it, through ``dshim serve``'s own code path.

:func:`dshim.serve.serve_process` runs the endpoint (127.0.0.1, port 0) and the
supervisors with a real SQLite store; the bots are scripted channels (started when the
test says so, failing as scripted) or the Telegram channel against the fake Bot API.
Real clock: the endpoint's sockets are real, and a restart backoff takes its first second.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from dshim.channels.base import BotHost, Channel
from dshim.channels.registry import parse_config
from dshim.config import Config
from dshim.errors import AuthError, TransportError
from dshim.http.status import BotStatuses, iso_time
from dshim.log import register_secret
from dshim.serve import Running, serve_process
from dshim.store import open_store
from dshim.testing.fakes.telegram import TEST_TOKEN, open_fake_telegram
from tests.test_serve import ScriptedChannel

KEYS = {"name", "channel", "state", "since", "detail"}
SECRET = "987654:leaked-secret-value-in-an-error-message"


class GatedChannel(ScriptedChannel):
    """Fails as scripted, then authenticates once ``gate`` is set (and serves until shutdown)."""

    def __init__(self, failures: list[BaseException] | None = None) -> None:
        super().__init__(failures)
        self.gate = trio.Event()

    async def run(
        self, ctx: BotHost, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        if not self.failures:
            await self.gate.wait()
        await super().run(ctx, task_status=task_status)


def config(
    *bots: dict[str, Any], settings: bool = False, env: dict[str, str] | None = None
) -> Config:
    return parse_config(
        {"http": {"listen": "127.0.0.1:0"}, "bots": list(bots)},
        env=env or {},
        channel_settings=settings,
    )


@asynccontextmanager
async def serving(
    tmp_path: Path, cfg: Config, channels: dict[str, Channel] | None = None
) -> AsyncIterator[tuple[httpx.AsyncClient, Running]]:
    shutdown = trio.Event()
    async with open_store(tmp_path) as store, trio.open_nursery() as nursery:
        running: Running = await nursery.start(
            partial(serve_process, cfg, store, shutdown=shutdown, channels=channels)
        )
        assert running.url is not None
        try:
            async with httpx.AsyncClient(base_url=running.url) as http:
                yield http, running
        finally:
            shutdown.set()


async def readyz(http: httpx.AsyncClient) -> tuple[int, dict[str, dict[str, str]]]:
    resp = await http.get("/readyz")
    assert resp.headers["content-type"] == "application/json"
    bots = resp.json()
    assert isinstance(bots, list) and all(set(b) == KEYS for b in bots), bots
    return resp.status_code, {b["name"]: b for b in bots}


async def until(
    http: httpx.AsyncClient, check: Callable[[int, dict[str, dict[str, str]]], bool]
) -> tuple[int, dict[str, dict[str, str]]]:
    with trio.fail_after(20):
        while True:
            status, bots = await readyz(http)
            if check(status, bots):
                return status, bots
            await trio.sleep(0.02)


@asynccontextmanager
async def beside_a_good_bot(
    tmp_path: Path, name: str, channel: GatedChannel, state: str
) -> AsyncIterator[tuple[httpx.AsyncClient, Running, dict[str, dict[str, str]]]]:
    """``channel`` as bot ``name`` next to a bot that starts at once, once ``name`` is in
    ``state`` (and the good bot is up)."""
    good = GatedChannel()
    good.gate.set()
    cfg = config({"name": name, "channel": "telegram"}, {"name": "good", "channel": "telegram"})
    async with serving(tmp_path, cfg, {name: channel, "good": good}) as (http, running):
        _, bots = await until(
            http, lambda s, b: b[name]["state"] == state and b["good"]["state"] == "up"
        )
        yield http, running, bots


def parse_iso(value: str) -> float:
    assert value.endswith("Z"), value
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


async def test_readyz_is_503_until_every_bot_has_started(tmp_path: Path) -> None:
    a, b = GatedChannel(), GatedChannel()
    cfg = config({"name": "a", "channel": "telegram"}, {"name": "b", "channel": "telegram"})
    async with serving(tmp_path, cfg, {"a": a, "b": b}) as (http, running):
        assert (await http.get("/healthz")).status_code == 200  # alive while not ready
        status, bots = await readyz(http)
        assert status == 503
        assert {n: (s["channel"], s["state"]) for n, s in bots.items()} == {
            "a": ("telegram", "starting"),
            "b": ("telegram", "starting"),
        }
        assert abs(parse_iso(bots["a"]["since"]) - time.time()) < 5
        a.gate.set()
        status, bots = await until(http, lambda s, b: b["a"]["state"] == "up")
        assert status == 503 and bots["b"]["state"] == "starting"
        b.gate.set()
        status, bots = await until(http, lambda s, b: s == 200)
        assert {n: s["state"] for n, s in bots.items()} == {"a": "up", "b": "up"}
        assert all(s["detail"] == "" for s in bots.values())
        assert running.statuses.ready


async def test_readyz_shows_a_bot_in_backoff_with_its_retry_time(tmp_path: Path) -> None:
    flaky = GatedChannel([TransportError("getMe: connection reset by peer")])
    async with beside_a_good_bot(tmp_path, "flaky", flaky, "backoff") as (http, _, bots):
        status, bots = await readyz(http)
        assert status == 503
        detail = bots["flaky"]["detail"]
        assert detail.startswith("retry at ") and "connection reset by peer" in detail
        retry_at = parse_iso(detail.split()[2])
        since = parse_iso(bots["flaky"]["since"])
        assert 1.0 - 0.01 <= retry_at - since <= 1.5 + 0.01  # the first backoff: 1 s, +50 % jitter
        flaky.gate.set()
        status, bots = await until(http, lambda s, b: s == 200)  # restarted after the wait
        assert bots["flaky"]["state"] == "up" and flaky.starts == 2


async def test_readyz_shows_a_stopped_bot_with_its_reason_and_never_a_secret(
    tmp_path: Path,
) -> None:
    register_secret(SECRET)
    bad = GatedChannel([AuthError(f"getMe: HTTP 401 Unauthorized for token {SECRET}", status=401)])
    async with beside_a_good_bot(tmp_path, "bad", bad, "stopped") as (http, running, _):
        status, bots = await readyz(http)
        assert status == 503
        assert "AuthError" in bots["bad"]["detail"] and "401" in bots["bad"]["detail"]
        resp = await http.get("/readyz")
        assert SECRET not in resp.text and SECRET.split(":")[1] not in resp.text
        metrics = (await http.get("/metrics")).text
        assert 'dshim_bot_up{bot="bad"} 0.0' in metrics
        assert 'dshim_bot_up{bot="good"} 1.0' in metrics
    # After the shutdown every bot is stopped and the store is closed: not ready.
    assert not running.statuses.ready
    assert {s.state for s in running.statuses.all()} == {"stopped"}


async def test_readyz_with_the_telegram_channel(tmp_path: Path) -> None:
    async with open_fake_telegram() as fake:
        fake.slow_next("getMe", 0.5)  # authenticating takes a moment
        cfg = config(
            {"name": "tg", "channel": "telegram", "token": "${T}", "api_base": fake.url},
            {"name": "revoked", "channel": "telegram", "token": "${R}", "api_base": fake.url},
            settings=True,
            env={"T": TEST_TOKEN, "R": "123456:a-token-the-fake-does-not-know-00"},
        )
        async with serving(tmp_path, cfg) as (http, _):
            status, bots = await readyz(http)
            assert status == 503 and bots["tg"]["state"] == "starting"
            status, bots = await until(
                http, lambda s, b: b["tg"]["state"] == "up" and b["revoked"]["state"] == "stopped"
            )
            assert status == 503  # one bot is stopped for good: not ready
            assert "Unauthorized" in bots["revoked"]["detail"]
            assert "a-token-the-fake-does-not-know" not in bots["revoked"]["detail"]


def test_not_ready_while_the_store_is_closed() -> None:
    statuses = BotStatuses(lambda: 1_790_000_000.0)
    statuses.starting("a", "telegram")
    statuses.up("a")
    assert statuses.readyz()[0] == 503  # the store is not open (yet, or any more)
    statuses.store_open = True
    code, body = statuses.readyz()
    assert code == 200
    assert body == (
        b'[{"name":"a","channel":"telegram","state":"up","since":"2026-09-21T14:13:20.000Z",'
        b'"detail":""}]'
    )
    assert iso_time(1_790_000_000.25) == "2026-09-21T14:13:20.250Z"
