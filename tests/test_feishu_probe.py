"""``dshim probe`` for a Feishu bot, against the fake Feishu on 127.0.0.1.

The probe reads a real config file (the app secret from the environment), so these tests
go through the same path as the command line; each has a hard deadline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from dshim.probe import ProbeRow, _probe, format_table
from dshim.testing.fakes.feishu import FakeFeishu, open_fake_feishu

DEADLINE = 20.0


def write_config(path: Path, fake: FakeFeishu) -> Path:
    config = path / "dshim.toml"
    config.write_text(
        "[[bots]]\n"
        'name = "fs"\n'
        'channel = "feishu"\n'
        f'app_id = "{fake.app_id}"\n'
        'app_secret = "${FEISHU_APP_SECRET}"\n'
        f'api_base = "{fake.api_base}"\n',
        encoding="utf-8",
    )
    return config


def row(rows: list[ProbeRow], check: str) -> ProbeRow:
    [found] = [r for r in rows if r.check == check]
    return found


async def test_probe_checks_token_identity_connection_scopes_and_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_feishu() as fake:
            monkeypatch.setenv("FEISHU_APP_SECRET", fake.app_secret)
            rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", None, False)
            await fake.wait_until(
                lambda: bool(fake.connections) and fake.connections[0].closed_by is not None
            )
    table = format_table(rows)
    assert code == 0, table
    assert row(rows, "fs: identity").detail == f"{fake.bot_name} (id {fake.bot_open_id})"
    conn = row(rows, "fs: long connection")
    assert conn.result == "ok" and "first pong" in conn.detail
    for check in ("message lookup", "cardkit scope", "group messages scope", "store"):
        assert row(rows, f"fs: {check}").result == "ok", table
    [only] = fake.connections
    assert only.closed_by == "client" and only.pings >= 1
    assert fake.app_secret not in table
    assert "ticket=" not in table and "access_key" not in table


async def test_probe_warns_about_missing_scopes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_feishu() as fake:
            monkeypatch.setenv("FEISHU_APP_SECRET", fake.app_secret)
            fake.missing_scopes = {"im:message", "cardkit:card:write", "im:message.group_msg"}
            rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", None, False)
    table = format_table(rows)
    assert code == 0, table  # warnings only
    lookup = row(rows, "fs: message lookup")
    assert lookup.result == "warn" and "im:message" in lookup.detail
    card = row(rows, "fs: cardkit scope")
    assert card.result == "warn" and "answers fall back to text" in card.detail
    group = row(rows, "fs: group messages scope")
    assert (
        group.result == "warn" and "quotes in groups degrade to permission-denied" in group.detail
    )


async def test_probe_fails_on_a_bad_secret_and_sends_a_test(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_feishu() as fake:
            monkeypatch.setenv("FEISHU_APP_SECRET", "not-the-secret")
            rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", None, False)
            assert code == 1 and row(rows, "fs: identity").result == "fail"
            assert fake.connections == []
            monkeypatch.setenv("FEISHU_APP_SECRET", fake.app_secret)
            rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", "fs", True)
    no_dm = row(rows, "fs: send test")
    assert no_dm.result == "warn" and code == 0
