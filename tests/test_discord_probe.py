"""``dshim probe`` for a Discord bot, against the fake Discord on 127.0.0.1.

The probe reads a real config file (token from the environment), so these tests go
through the same path as the command line; each has a hard deadline.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from dshim.probe import _probe, format_table
from dshim.testing.fakes.discord import FakeDiscord, open_fake_discord
from tests import probekit
from tests.probekit import probe_until_closed, probed_fake, row

DEADLINE = 20.0


def write_config(path: Path, fake: FakeDiscord) -> Path:
    table = {"name": "disco", "channel": "discord", "token": "${DISCORD_BOT_TOKEN}"}
    return probekit.write_config(
        path, {**table, "api_base": fake.api_base, "gateway_url": fake.gateway_url}
    )


#: The fake of one test, with the bot's token (or the one given) in the environment.
discord = functools.partial(
    probed_fake, open_fake_discord, DEADLINE, "DISCORD_BOT_TOKEN", lambda fake: fake.token
)


async def test_probe_checks_identity_gateway_ready_and_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with discord(monkeypatch, heartbeat_interval_ms=5000) as fake:
        fake.identify_remaining = 997
        rows, code = await probe_until_closed(fake, write_config(tmp_path, fake), tmp_path / "data")
    table = format_table(rows)
    assert code == 0, table
    assert row(rows, "disco: credentials").result == "ok"
    assert row(rows, "disco: identity").detail == f"dshim-bot (id {fake.bot_user['id']})"
    assert "identifies left today 997/1000" in row(rows, "disco: gateway info").detail
    ready = row(rows, "disco: gateway")
    assert ready.result == "ok" and ready.detail.startswith("READY in ")
    assert row(rows, "disco: store").result == "ok"
    assert "disco: send test" not in table
    # connected once, identified once, then closed cleanly (1000) by the probe
    [conn] = fake.connections
    assert (conn.closed_by, conn.closed_code) == ("client", 1000)
    assert len(fake.identifies) == 1
    assert fake.token not in table


async def test_probe_send_test_needs_a_direct_conversation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with discord(monkeypatch, heartbeat_interval_ms=5000) as fake:
        config = write_config(tmp_path, fake)
        rows, code = await _probe(config, tmp_path / "data", "disco", True)
        assert code == 0  # a warning: nothing is wrong with the bot
        no_dm = row(rows, "disco: send test")
        assert no_dm.result == "warn" and "no direct conversation yet" in no_dm.detail
        # an identify within 5 s of the last one is refused with op 9 (max_concurrency)
        rows, code = await _probe(config, tmp_path / "data", "disco", False)
        assert "invalid session" in row(rows, "disco: gateway").detail
        fake.identify_window_s = 0.0
        # remember a DM the way the pipeline does, then probe again
        from dshim.store import open_store

        async with open_store(tmp_path / "data") as store:
            await store.set_last_direct("disco", fake.dm_channel, now=0.0)
        rows, code = await _probe(config, tmp_path / "data", "disco", True)
    assert code == 0, format_table(rows)
    assert row(rows, "disco: send test").result == "ok"
    [sent] = fake.bot_messages(fake.dm_channel)
    assert "connection test" in sent["content"]


async def test_probe_reports_a_bad_token_without_showing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wrong = "MTIzNDU2Nzg5MDEyMzQ1Njc4.GaBcDe.wrong-token-value-abcdefghijklmnop"
    async with discord(monkeypatch, wrong) as fake:
        rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", None, False)
    table = format_table(rows)
    assert code == 1
    identity = row(rows, "disco: identity")
    assert identity.result == "fail" and "401" in identity.detail
    assert wrong not in table and "wrong-token" not in table
    assert not fake.connections  # no gateway attempt with a rejected token


async def test_probe_fails_on_gateway_close_4004_and_when_no_identify_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with discord(monkeypatch) as fake:
        config = write_config(tmp_path, fake)
        fake.close_on_identify = 4004
        rows, code = await _probe(config, tmp_path / "data", None, False)
        assert code == 1
        gateway = row(rows, "disco: gateway")
        assert gateway.result == "fail" and "4004" in gateway.detail
        fake.close_on_identify = None
        fake.identify_remaining = 0
        rows, code = await _probe(config, tmp_path / "data", None, False)
    assert code == 1
    assert row(rows, "disco: gateway info").result == "fail"
    assert len(fake.identifies) == 1  # the second probe did not identify


async def test_substitute_rows_check_each_target_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with discord(monkeypatch, heartbeat_interval_ms=5000) as fake:
        olga = fake.make_user("olga", global_name="Olga")
        fake.known_users[olga["id"]] = olga
        config = write_config(tmp_path, fake)
        with config.open("a", encoding="utf-8") as f:
            f.write(
                "message_content = false\n[bots.substitute]\nenabled = true\n"
                f'targets = [{{name = "Olga", id = "{olga["id"]}"}},'
                ' {name = "Ghost", id = "123456789012345678"}, {name = "Name", username = "x"}]\n'
            )
        rows, code = await _probe(config, tmp_path / "data", None, False)
    assert row(rows, "disco: substitute: group messages").result == "warn"
    ok = row(rows, "disco: substitute target Olga")
    assert (ok.result, ok.detail) == ("ok", f"Olga (id {olga['id']})")
    assert row(rows, "disco: substitute target Ghost").result == "warn"
    assert "never matches" in row(rows, "disco: substitute target Name").detail
    assert code == 0
