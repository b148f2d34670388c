"""``dshim probe`` for a QQ bot, against the fake QQ on 127.0.0.1 (real config file path)."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from dshim.probe import _probe, format_table
from dshim.testing.fakes.qq import FakeQQ, open_fake_qq
from tests import probekit
from tests.probekit import probe_until_closed, probed_fake, row

DEADLINE = 20.0


def write_config(path: Path, fake: FakeQQ, *, markdown: bool = True) -> Path:
    bot = {
        "name": "qq",
        "channel": "qq",
        "app_id": fake.app_id,
        "client_secret": "${QQ_CLIENT_SECRET}",
        "api_base": fake.http_url,
        "token_base": fake.http_url,
        "gateway_url": fake.gateway_url,
        "markdown": markdown,
    }
    return probekit.write_config(path, bot)


#: The fake of one test, with the bot's secret (or the one given) in the environment.
qq = functools.partial(
    probed_fake, open_fake_qq, DEADLINE, "QQ_CLIENT_SECRET", lambda fake: fake.client_secret
)


async def test_probe_checks_token_identity_gateway_ready_markdown_and_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with qq(monkeypatch, heartbeat_interval_ms=5000) as fake:
        fake.identify_remaining = 997
        rows, code = await probe_until_closed(fake, write_config(tmp_path, fake), tmp_path / "data")
    table = format_table(rows)
    assert code == 0, table
    assert row(rows, "qq: credentials").detail == f"app_id {fake.app_id}, client secret present"
    assert row(rows, "qq: identity").detail == f"dshim-qq (id {fake.bot_user['id']})"
    assert "identifies left 997/1000" in row(rows, "qq: gateway info").detail
    ready = row(rows, "qq: gateway")
    assert ready.result == "ok" and ready.detail.startswith("READY in ")
    markdown = row(rows, "qq: markdown")
    assert markdown.result == "warn" and "50056" in markdown.detail
    assert row(rows, "qq: store").result == "ok"
    [conn] = fake.connections
    assert (conn.closed_by, conn.closed_code) == ("client", 1000)
    assert fake.identifies[0]["token_ok"] and fake.identifies[0]["shard"] == [0, 1]
    assert fake.client_secret not in table and not any(t in table for t in fake.tokens)


async def test_probe_says_when_the_ip_is_not_on_the_allowlist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with qq(monkeypatch) as fake:
        fake.ip_blocked = True
        rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", None, False)
    identity = row(rows, "qq: identity")
    assert code == 1 and identity.result == "fail"
    assert "allowlist" in identity.detail and "IP" in identity.detail
    assert not fake.connections


async def test_probe_fails_on_a_refused_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with qq(monkeypatch, "not-the-secret") as fake:
        rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", None, False)
    identity = row(rows, "qq: identity")
    assert code == 1 and identity.result == "fail" and "client_secret" in identity.detail
    assert "not-the-secret" not in format_table(rows)


async def test_probe_send_test_explains_that_qq_cannot_send_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dshim.store import open_store

    async with qq(monkeypatch, heartbeat_interval_ms=5000) as fake:
        async with open_store(tmp_path / "data", inline=True) as store:
            await store.set_last_direct("qq", f"c2c:{fake.user_openid}", now=1.0)
        config = write_config(tmp_path, fake, markdown=False)
        rows, code = await _probe(config, tmp_path / "data", "qq", True)
    assert row(rows, "qq: markdown").result == "ok"
    sent = row(rows, "qq: send test")
    assert sent.result == "fail" and "active messages" in sent.detail
    assert not fake.sends()
