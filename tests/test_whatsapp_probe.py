"""``dshim probe`` for a WhatsApp bot, against the fake Cloud API and, where the test runs
one, a real ``dshim serve`` endpoint on 127.0.0.1.

The probe reads a real config file and opens the real store, so these tests run on the
real clock under the conftest's deadline.  Every test checks the printed table never
shows a credential.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from dshim.channels.registry import load_config
from dshim.channels.whatsapp import channel as wa_channel
from dshim.probe import ProbeRow
from dshim.serve import serve_bots
from dshim.store import open_store
from dshim.testing.fakes.whatsapp import (
    TEST_APP_SECRET,
    TEST_TOKEN,
    TEST_VERIFY_TOKEN,
    FakeWhatsApp,
    open_fake_whatsapp,
)
from tests.probekit import probe_rows
from tests.rig_whatsapp import ENDPOINT_TOKEN, EndpointHost, mounted, open_endpoint

SECRETS = (TEST_TOKEN, TEST_APP_SECRET, TEST_VERIFY_TOKEN, ENDPOINT_TOKEN)


@pytest.fixture(autouse=True)
def secrets_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WA_TOKEN", TEST_TOKEN)
    monkeypatch.setenv("WA_SECRET", TEST_APP_SECRET)
    monkeypatch.setenv("WA_VERIFY", TEST_VERIFY_TOKEN)
    monkeypatch.setenv("HTTP_TOKEN", ENDPOINT_TOKEN)


def write_config(tmp_path: Path, fake: FakeWhatsApp, listen: str, *, enabled: bool = True) -> Path:
    path = tmp_path / "dshim.toml"
    path.write_text(
        f'[dshim]\ndata_dir = "{tmp_path / "data"}"\n\n'
        f'[http]\nenabled = {"true" if enabled else "false"}\nlisten = "{listen}"\n'
        'token = "${HTTP_TOKEN}"\n\n'
        '[[bots]]\nname = "wa"\nchannel = "whatsapp"\n'
        f'phone_number_id = "{fake.phone_number_id}"\naccess_token = "${{WA_TOKEN}}"\n'
        'app_secret = "${WA_SECRET}"\nverify_token = "${WA_VERIFY}"\n'
        f'api_base = "{fake.url}"\n',
        encoding="utf-8",
    )
    return path


async def probe(path: Path, *, send_test: bool = False) -> tuple[dict[str, ProbeRow], int]:
    return await probe_rows(path, "wa", secrets=SECRETS, send_test=send_test)


@asynccontextmanager
async def serving(
    tmp_path: Path, fake: FakeWhatsApp, *, clock: Callable[[], float] = time.time
) -> AsyncIterator[str]:
    """A real ``dshim serve`` of the bot (endpoint with a token); yields its listen address."""
    async with open_endpoint() as (endpoint, url):
        listen = url.removeprefix("http://")
        config = load_config(write_config(tmp_path, fake, listen))

        async def run(
            host: Any, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
        ) -> None:
            await wa_channel.run(EndpointHost(host, endpoint), task_status=task_status)

        channel = dataclasses.replace(wa_channel.CHANNEL, run_fn=run)
        shutdown = trio.Event()
        async with (
            open_store(tmp_path / "data", inline=True) as store,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(
                lambda: serve_bots(
                    config, store, shutdown=shutdown, channels={"wa": channel}, clock=clock
                )
            )
            fake.webhook_url = f"{url}/hooks/wa"
            await mounted(fake)
            try:
                yield listen
            finally:
                shutdown.set()


async def test_with_dshim_serve_running_every_check_passes_and_the_send_test_reaches_the_user(
    tmp_path: Path,
) -> None:
    async with open_fake_whatsapp() as fake, serving(tmp_path, fake) as listen:
        ada = fake.user("16505551234", "Ada Lovelace")
        await fake.send_messages(fake.user_message(ada, "hello", at=time.time()))
        await fake.wait_until(lambda: len(fake.to_user(ada.key)) == 1)
        await trio.sleep(0.5)
        rows, code = await probe(tmp_path / "dshim.toml", send_test=True)
    assert code == 0, rows
    assert rows["wa: identity"].detail == (
        f"dshim test (+{fake.display_phone_number}, quality GREEN) (id {fake.phone_number_id})"
    )
    route = rows["wa: webhook route"]
    assert route.result == "ok" and listen in route.detail
    assert "https://<your public host>/hooks/wa" in route.detail
    assert rows["wa: signature self-test"].result == "ok"
    assert "running route" in rows["wa: signature self-test"].detail
    assert rows["wa: send test"].result == "ok"
    assert "wa: 24-hour window" not in rows
    assert [s.text for s in fake.to_user(ada.key)][-1] == "dshim connection test"


async def test_without_dshim_serve_the_route_is_a_warning_and_the_signature_checked_in_process(
    tmp_path: Path,
) -> None:
    async with open_fake_whatsapp() as fake:
        rows, code = await probe(write_config(tmp_path, fake, "127.0.0.1:9"))
    assert code == 0
    assert rows["wa: webhook route"].result == "warn"
    assert "start `dshim serve`" in rows["wa: webhook route"].detail
    assert rows["wa: signature self-test"].result == "ok"
    assert "in-process" in rows["wa: signature self-test"].detail
    assert rows["wa: store"].result == "ok"


async def test_a_disabled_endpoint_is_a_configuration_error_before_any_check(
    tmp_path: Path,
) -> None:
    async with open_fake_whatsapp() as fake:
        rows, code = await probe(write_config(tmp_path, fake, "127.0.0.1:9", enabled=False))
    assert code == 2
    assert list(rows) == ["config"] and rows["config"].result == "fail"
    assert "dshim.toml: http.enabled: " in rows["config"].detail
    assert not fake.calls  # nothing asked of Meta


async def test_a_disabled_bot_without_the_endpoint_fails_only_its_route_check(
    tmp_path: Path,
) -> None:
    async with open_fake_whatsapp() as fake:
        path = write_config(tmp_path, fake, "127.0.0.1:9", enabled=False)
        path.write_text(path.read_text() + "enabled = false\n", encoding="utf-8")
        rows, code = await probe(path)
    assert code == 1
    assert rows["wa: enabled"].result == "warn"
    assert rows["wa: webhook route"].result == "fail"
    assert "[http] enabled = false" in rows["wa: webhook route"].detail


async def test_a_rejected_token_fails_the_identity_and_stops_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WA_TOKEN", "EAAG-not-a-token-meta-knows")
    async with open_fake_whatsapp() as fake:
        rows, code = await probe(write_config(tmp_path, fake, "127.0.0.1:9"))
    assert code == 1
    assert rows["wa: identity"].result == "fail" and "190" in rows["wa: identity"].detail
    assert "wa: webhook route" not in rows


async def test_the_send_test_warns_when_the_user_wrote_more_than_24_hours_ago(
    tmp_path: Path,
) -> None:
    day_ago = time.time() - 25 * 3600
    async with open_fake_whatsapp() as fake:
        ada = fake.user("16505551234", "Ada Lovelace")
        fake.window_s = 1e9  # the bot answered back then
        async with serving(tmp_path, fake, clock=lambda: time.time() - 25 * 3600):
            await fake.send_messages(fake.user_message(ada, "hello", at=day_ago))
            await fake.wait_until(lambda: len(fake.to_user(ada.key)) == 1)
            await trio.sleep(0.5)
        fake.window_s = 24 * 3600.0
        rows, code = await probe(tmp_path / "dshim.toml", send_test=True)
    assert rows["wa: 24-hour window"].result == "warn"
    assert rows["wa: send test"].result == "fail"
    assert "24-hour window" in rows["wa: send test"].detail
    assert code == 1
