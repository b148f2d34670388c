"""A webhook (WhatsApp Cloud) that reaches an instance which does not run its bot, as it
does behind a load balancer; and the web chat's page on such an instance (issue 32).

Two instances (:func:`tests.test_leases_serve.instances`), each with its own HTTP
endpoint on 127.0.0.1, one WhatsApp bot on the fake Cloud API, one PostgreSQL (the
session's throwaway cluster).  The non-holder verifies and relays; the lease holder,
woken by the store's notification, answers — once, whichever instance Meta reaches.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import trio

from dshim.channels.registry import parse_config
from dshim.config import Config
from dshim.http.app import Endpoint
from dshim.testing.fakes.whatsapp import TEST_VERIFY_TOKEN, FakeWhatsApp, open_fake_whatsapp
from tests.pgkit import PgCluster
from tests.rig_whatsapp import bot_table
from tests.rigkit import open_endpoint
from tests.test_leases_serve import LEASE_S, Instance, holders, instances, wait_for

NAMES = ["east", "west"]


def config_for(url: str, fake: FakeWhatsApp, *, webchat: bool = False) -> Config:
    bots: list[dict[str, Any]] = [{"name": "wa", "channel": "whatsapp", **bot_table(fake)}]
    if webchat:
        bots.append({"name": "web", "channel": "webchat"})
    raw = {
        "dshim": {"shutdown_grace_s": 2.0},
        "store": {"url": url, "lease_s": LEASE_S},
        "bots": bots,
    }
    return parse_config(raw, env={})


@asynccontextmanager
async def two_instances(
    config: Config, tmp_path: Path
) -> AsyncIterator[tuple[dict[str, Instance], dict[str, str]]]:
    """east and west, each with an endpoint: (instances by name, base URLs by name)."""
    async with AsyncExitStack() as stack:
        endpoints: dict[str, Endpoint] = {}
        urls: dict[str, str] = {}
        for name in NAMES:
            endpoints[name], urls[name] = await stack.enter_async_context(open_endpoint())
        running, _ = await stack.enter_async_context(instances(config, tmp_path, NAMES, endpoints))
        yield {inst.name: inst for inst in running}, urls


async def holder_of(inst: Instance, bot: str) -> str:
    """The instance holding ``bot``'s lease, once one does."""
    found: dict[str, str] = {}

    async def held() -> bool:
        found.update(await holders(inst.store))
        return bot in found

    await wait_for(held)
    return found[bot]


async def answering(fake: FakeWhatsApp, hook: str) -> None:
    """Until the route answers Meta's verification (the instance has mounted it)."""
    assert fake.http is not None
    query = {"hub.mode": "subscribe", "hub.verify_token": TEST_VERIFY_TOKEN, "hub.challenge": "up"}
    while (await fake.http.get(hook, params=query)).status_code != 200:  # noqa: ASYNC110 - polled over HTTP
        await trio.sleep(0.1)


def other(name: str) -> str:
    return next(n for n in NAMES if n != name)


def relay_rows(pg_cluster: PgCluster, url: str) -> int:
    return int(pg_cluster.query(url, "SELECT count(*) FROM relay")[0][0])


async def test_a_webhook_at_either_instance_is_verified_there_and_answered_once(
    pg_cluster: PgCluster, tmp_path: Path
) -> None:
    url = pg_cluster.fresh_url()
    with trio.fail_after(60):
        async with open_fake_whatsapp() as fake:
            config = config_for(url, fake)
            async with two_instances(config, tmp_path) as (insts, urls):
                holder = await holder_of(insts["east"], "wa")
                away = other(holder)
                for base in urls.values():
                    await answering(fake, f"{base}/hooks/wa")
                ada = fake.user("16505551234", "Ada")
                hook = {name: f"{base}/hooks/wa" for name, base in urls.items()}
                http = fake.http
                assert http is not None
                # Meta's verification handshake, answered by either instance.
                for name in NAMES:
                    query = {
                        "hub.mode": "subscribe",
                        "hub.verify_token": TEST_VERIFY_TOKEN,
                        "hub.challenge": f"c-{name}",
                    }
                    got = await http.get(hook[name], params=query)
                    assert (got.status_code, got.text) == (200, f"c-{name}")
                    wrong = await http.get(hook[name], params={**query, "hub.verify_token": "x"})
                    assert wrong.status_code == 403
                # Unsigned or wrongly signed: refused where it arrives, nothing kept.
                first = fake.body([fake.user_message(ada, "first")])
                assert await fake.post(first, signature=False, url=hook[away]) == 401
                assert await fake.post(first, signature="sha256=00", url=hook[away]) == 401
                assert relay_rows(pg_cluster, url) == 0
                # Signed, at the instance that does not run the bot: 200, and the holder
                # answers it.
                assert await fake.post(first, url=hook[away]) == 200
                await fake.wait_until(lambda: len(fake.to_user(ada.key)) == 1)
                assert fake.to_user(ada.key)[0].text.endswith("first")
                # At the holder, as before.
                second = fake.body([fake.user_message(ada, "second")])
                assert await fake.post(second, url=hook[holder]) == 200
                await fake.wait_until(lambda: len(fake.to_user(ada.key)) == 2)
                # Meta delivers both again, each to the other instance: dedup is global.
                assert await fake.post(first, url=hook[holder]) == 200
                assert await fake.post(second, url=hook[away]) == 200

                async def drained() -> bool:
                    return relay_rows(pg_cluster, url) == 0

                await wait_for(drained)
                await trio.sleep(1.5)
                assert [s.text.rsplit("\n", 1)[-1] for s in fake.to_user(ada.key)] == [
                    "first",
                    "second",
                ]
                # A self-test body (no change) is not kept.
                empty = b'{"object":"whatsapp_business_account","entry":[]}'
                assert await fake.post(empty, url=hook[away]) == 200
                assert relay_rows(pg_cluster, url) == 0


async def test_a_webhook_while_no_instance_runs_the_bot_is_answered_after_the_failover(
    pg_cluster: PgCluster, tmp_path: Path
) -> None:
    """The holder dies (its leases simply run out); the survivor accepts the webhook before
    it holds the bot, and answers it once it took the bot over."""
    url = pg_cluster.fresh_url()
    with trio.fail_after(60):
        async with open_fake_whatsapp() as fake:
            config = config_for(url, fake)
            async with two_instances(config, tmp_path) as (insts, urls):
                holder = await holder_of(insts["east"], "wa")
                survivor = other(holder)
                await answering(fake, f"{urls[survivor]}/hooks/wa")
                insts[holder].scope.cancel()
                ada = fake.user("16505551234", "Ada")
                body = fake.body([fake.user_message(ada, "while nobody runs it")])
                assert await fake.post(body, url=f"{urls[survivor]}/hooks/wa") == 200
                assert relay_rows(pg_cluster, url) == 1
                assert fake.to_user(ada.key) == []
                posted = trio.current_time()
                await fake.wait_until(lambda: len(fake.to_user(ada.key)) == 1)
                assert trio.current_time() - posted < 30
                assert await holders(insts[survivor].store) == {"wa": survivor}
                await trio.sleep(1.5)
                assert len(fake.to_user(ada.key)) == 1
                assert relay_rows(pg_cluster, url) == 0


async def test_the_web_chat_page_on_another_instance_names_the_one_that_runs_it(
    pg_cluster: PgCluster, tmp_path: Path
) -> None:
    url = pg_cluster.fresh_url()
    with trio.fail_after(60):
        async with open_fake_whatsapp() as fake:
            config = config_for(url, fake, webchat=True)
            async with (
                two_instances(config, tmp_path) as (insts, urls),
                httpx.AsyncClient(trust_env=False) as http,
            ):
                holder = await holder_of(insts["east"], "web")

                async def page(name: str) -> httpx.Response:
                    return await http.get(f"{urls[name]}/hooks/web/")

                async def served() -> bool:
                    got = [(await page(n)).status_code for n in (holder, other(holder))]
                    return got[0] == 200 and got[1] != 404  # both instances are up

                await wait_for(served)
                assert "<html" in (await page(holder)).text.lower()
                away = await page(other(holder))
                assert away.status_code == 503
                assert f"<b>{holder}</b>" in away.text
                assert away.headers["retry-after"] == "5"
