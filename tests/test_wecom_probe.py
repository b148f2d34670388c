"""``dshim probe`` for a WeCom bot, against the fake long connection on 127.0.0.1.

The probe reads a real config file (the secret from the environment), the same path as
the command line; each test has a hard deadline on the real clock.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import trio

from dshim.probe import _probe, format_table
from dshim.store import open_store
from dshim.testing.fakes.wecom import FakeWecom, open_fake_wecom
from tests import probekit
from tests.probekit import probed_fake, row

DEADLINE = 30.0


def write_config(path: Path, fake: FakeWecom) -> Path:
    table = {"name": "wx", "channel": "wecom", "bot_id": fake.bot_id}
    return probekit.write_config(
        path,
        {**table, "secret": "${WECOM_BOT_SECRET}", "ws_url": fake.ws_url},
        '[bots.welcome]\ntext = "欢迎"\n',
    )


#: The fake of one test, with the bot's secret (or the one given) in the environment.
wecom = functools.partial(
    probed_fake, open_fake_wecom, DEADLINE, "WECOM_BOT_SECRET", lambda fake: fake.secret
)


async def test_probe_subscribes_pings_and_closes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with wecom(monkeypatch) as fake:
        rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", None, False)
        await fake.wait_until(lambda: all(c.closed_by for c in fake.connections))
    table = format_table(rows)
    assert code == 0, table
    assert row(rows, "wx: credentials").result == "ok"
    assert row(rows, "wx: identity").detail == f"wx (id {fake.bot_id})"
    conn = row(rows, "wx: long connection")
    assert conn.result == "ok" and "ping acknowledged" in conn.detail
    assert row(rows, "wx: store").result == "ok"
    assert [ok for _, ok in fake.subscribes] == [True]
    assert len(fake.frames("ping")) == 1
    assert [c.closed_by for c in fake.connections] == ["client"]
    assert fake.secret not in table


async def test_probe_reports_a_rejected_secret_without_showing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = "not-the-secret-0123456789abcdef"
    async with wecom(monkeypatch, wrong) as fake:
        rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", None, False)
    table = format_table(rows)
    assert code == 1
    identity = row(rows, "wx: identity")
    assert identity.result == "fail" and "rejected" in identity.detail
    assert wrong not in table
    assert len(fake.subscribes) == 1  # no retry loop


async def test_probe_send_test_pushes_to_the_last_direct_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with wecom(monkeypatch) as fake:
        config = write_config(tmp_path, fake)
        rows, code = await _probe(config, tmp_path / "data", "wx", True)
        assert code == 0
        no_dm = row(rows, "wx: send test")
        assert no_dm.result == "warn" and "no direct conversation yet" in no_dm.detail
        async with open_store(tmp_path / "data") as store:
            await store.set_last_direct("wx", fake.user_id, now=0.0)
        rows, code = await _probe(config, tmp_path / "data", "wx", True)
    assert code == 0, format_table(rows)
    assert row(rows, "wx: send test").result == "ok"
    [push] = fake.pushes
    assert push.chatid == fake.user_id and "connection test" in push.content


async def test_probe_warns_when_another_connection_takes_the_bot_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with wecom(monkeypatch) as fake, trio.open_nursery() as nursery:
        fake.ack_pings = False  # the probe's ping waits: meanwhile another process connects

        async def another_process() -> None:
            await fake.wait_until(lambda: fake.live is not None)
            await fake.take_over()

        nursery.start_soon(another_process)
        rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", None, False)
    conn = row(rows, "wx: long connection")
    assert conn.result == "warn" and "took the bot over" in conn.detail
    assert code == 0
