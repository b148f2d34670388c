"""Several instances sharing the bots of one PostgreSQL store (issue 32), in one process.

Each "instance" is :func:`dshim.serve.serve_bots` with its own name, its own store
connection pool and its own shutdown, on one real PostgreSQL (the session's throwaway
cluster), with Telegram bots on fake Bot APIs on 127.0.0.1.  The real clock (the
database's leases run on its own clock), short leases (3 s: a tick of 1 s), hard
deadlines.  An instance that dies is one whose task is cancelled without releasing
anything (its leases simply stop being renewed), as a SIGKILL leaves them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from dshim.channels.registry import parse_config
from dshim.config import Config
from dshim.harness.echo import EchoHarness
from dshim.http.app import Endpoint
from dshim.serve import serve_bots
from dshim.sharing import sharing_report
from dshim.store import open_store_from_config
from dshim.store.base import SharesBots
from dshim.testing.fakes.telegram import TEST_TOKEN, FakeTelegram, open_fake_telegram
from tests.pgkit import PgCluster

LEASE_S = 3.0
USER = FakeTelegram.user(5001, "Ada")


def config_for(url: str, fakes: list[FakeTelegram]) -> Config:
    bots = [
        {"name": f"tg{i}", "channel": "telegram", "token": TEST_TOKEN, "api_base": fake.url}
        for i, fake in enumerate(fakes)
    ]
    raw = {
        "dshim": {"shutdown_grace_s": 2.0},
        "http": {"enabled": False},
        "store": {"url": url, "lease_s": LEASE_S},
        "bots": bots,
    }
    return parse_config(raw, env={})


@dataclass
class Instance:
    name: str
    store: SharesBots
    shutdown: trio.Event = field(default_factory=trio.Event)
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    results: dict[str, str] | None = None
    done: trio.Event = field(default_factory=trio.Event)


@asynccontextmanager
async def instances(
    config: Config,
    tmp_path: Path,
    names: list[str],
    endpoints: Mapping[str, Endpoint] | None = None,
) -> AsyncIterator[tuple[list[Instance], trio.Nursery]]:
    """The named instances, running (``endpoints``: each one's HTTP endpoint, by name);
    leaving the block stops them gracefully."""
    async with AsyncExitStack() as stack, trio.open_nursery() as nursery:
        running: list[Instance] = []

        async def start(name: str) -> Instance:
            store = await stack.enter_async_context(open_store_from_config(config, tmp_path / name))
            assert isinstance(store, SharesBots)
            inst = Instance(name, store)

            async def run() -> None:
                try:
                    with inst.scope:
                        inst.results = await serve_bots(
                            config,
                            store,  # type: ignore[arg-type]
                            shutdown=inst.shutdown,
                            harness=EchoHarness(),
                            instance=name,
                            endpoint=(endpoints or {}).get(name),
                        )
                finally:
                    inst.done.set()

            nursery.start_soon(run)
            return inst

        for name in names:
            running.append(await start(name))
        try:
            yield running, nursery
        finally:
            for inst in running:
                inst.shutdown.set()
            with trio.move_on_after(15):
                for inst in running:
                    await inst.done.wait()
            nursery.cancel_scope.cancel()


def answers(fake: FakeTelegram) -> list[str]:
    return [m.text for m in fake.bot_messages(USER["id"])]


async def holders(store: SharesBots) -> dict[str, str]:
    """bot -> the instance holding its lease."""
    return {lease.bot: lease.owner for lease in await store.leases() if lease.owner}


async def wait_for(predicate: Any, *, every: float = 0.2) -> None:
    """Poll the database until ``predicate()`` holds (leases change in another pool)."""
    while not await predicate():  # noqa: ASYNC110 - the database has no event to wait on
        await trio.sleep(every)


async def test_two_instances_share_six_bots_and_a_dead_ones_bots_answer_again(
    pg_cluster: PgCluster, tmp_path: Path
) -> None:
    url = pg_cluster.fresh_url()
    with trio.fail_after(120):
        async with AsyncExitStack() as fakes_stack:
            fakes = [await fakes_stack.enter_async_context(open_fake_telegram()) for _ in range(6)]
            config = config_for(url, fakes)
            async with instances(config, tmp_path, ["east", "west"]) as (running, _):
                east, west = running

                async def balanced() -> bool:
                    owners = list((await holders(east.store)).values())
                    return sorted(owners.count(n) for n in ("east", "west")) == [3, 3]

                await wait_for(balanced)
                report = await sharing_report(east.store, within_s=LEASE_S)
                assert sorted(i["name"] for i in report["instances"]) == ["east", "west"]
                assert sorted(len(i["bots"]) for i in report["instances"]) == [3, 3]
                assert all(row["owner"] and row["epoch"] >= 1 for row in report["leases"])
                for i, fake in enumerate(fakes):
                    fake.user_message(fake.private_chat(USER), USER, f"hello {i}")
                for fake in fakes:
                    await fake.wait_until(lambda f=fake: len(answers(f)) == 1)
                before = await holders(east.store)
                east.scope.cancel()  # east dies: nothing released, its leases run out
                died_at = trio.current_time()

                async def west_has_all() -> bool:
                    return set((await holders(west.store)).values()) == {"west"}

                await wait_for(west_has_all)
                failover_s = trio.current_time() - died_at
                moved = [b for b, owner in before.items() if owner == "east"]
                for bot in moved:
                    fake = fakes[int(bot[2:])]
                    fake.user_message(fake.private_chat(USER), USER, f"after {bot}")
                for bot in moved:
                    fake = fakes[int(bot[2:])]
                    await fake.wait_until(lambda f=fake: len(answers(f)) == 2)
                await trio.sleep(2)
    assert failover_s < 30
    for i, fake in enumerate(fakes):
        texts = answers(fake)
        assert texts[0].endswith(f"hello {i}")
        assert len(texts) == (2 if f"tg{i}" in moved else 1)
