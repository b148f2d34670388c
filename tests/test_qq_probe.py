"""``dshim probe`` for a QQ bot, against the fake QQ on 127.0.0.1 (real config file path)."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from dshim.probe import ProbeRow, _probe, format_table
from dshim.testing.fakes.qq import FakeQQ, open_fake_qq

DEADLINE = 20.0


def write_config(path: Path, fake: FakeQQ, *, markdown: bool = True) -> Path:
    config = path / "dshim.toml"
    config.write_text(
        "[[bots]]\n"
        'name = "qq"\n'
        'channel = "qq"\n'
        f'app_id = "{fake.app_id}"\n'
        'client_secret = "${QQ_CLIENT_SECRET}"\n'
        f'api_base = "{fake.http_url}"\n'
        f'token_base = "{fake.http_url}"\n'
        f'gateway_url = "{fake.gateway_url}"\n'
        f"markdown = {'true' if markdown else 'false'}\n",
        encoding="utf-8",
    )
    return config


def row(rows: list[ProbeRow], check: str) -> ProbeRow:
    [found] = [r for r in rows if r.check == check]
    return found


async def test_probe_checks_token_identity_gateway_ready_markdown_and_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_qq(heartbeat_interval_ms=5000) as fake:
            monkeypatch.setenv("QQ_CLIENT_SECRET", fake.client_secret)
            fake.identify_remaining = 997
            rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", None, False)
            await fake.wait_until(
                lambda: bool(fake.connections) and fake.connections[0].closed_by is not None
            )
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
    with trio.fail_after(DEADLINE):
        async with open_fake_qq() as fake:
            monkeypatch.setenv("QQ_CLIENT_SECRET", fake.client_secret)
            fake.ip_blocked = True
            rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", None, False)
    identity = row(rows, "qq: identity")
    assert code == 1 and identity.result == "fail"
    assert "allowlist" in identity.detail and "IP" in identity.detail
    assert not fake.connections


async def test_probe_fails_on_a_refused_secret(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_qq() as fake:
            monkeypatch.setenv("QQ_CLIENT_SECRET", "not-the-secret")
            rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", None, False)
    identity = row(rows, "qq: identity")
    assert code == 1 and identity.result == "fail" and "client_secret" in identity.detail
    assert "not-the-secret" not in format_table(rows)


async def test_probe_send_test_explains_that_qq_cannot_send_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dshim.store import open_store

    with trio.fail_after(DEADLINE):
        async with open_fake_qq(heartbeat_interval_ms=5000) as fake:
            monkeypatch.setenv("QQ_CLIENT_SECRET", fake.client_secret)
            async with open_store(tmp_path / "data", inline=True) as store:
                await store.set_last_direct("qq", f"c2c:{fake.user_openid}", now=1.0)
            config = write_config(tmp_path, fake, markdown=False)
            rows, code = await _probe(config, tmp_path / "data", "qq", True)
    assert row(rows, "qq: markdown").result == "ok"
    sent = row(rows, "qq: send test")
    assert sent.result == "fail" and "active messages" in sent.detail
    assert not fake.sends()
