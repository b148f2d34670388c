"""``dshim probe`` for a Feishu bot, against the fake Feishu on 127.0.0.1.

The probe reads a real config file (the app secret from the environment), so these tests
go through the same path as the command line; each has a hard deadline.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from dshim.probe import _probe, format_table
from dshim.testing.fakes.feishu import FakeFeishu, open_fake_feishu
from tests import probekit
from tests.probekit import probe_until_closed, probed_fake, row

DEADLINE = 20.0


def write_config(path: Path, fake: FakeFeishu) -> Path:
    table = {"name": "fs", "channel": "feishu", "app_id": fake.app_id}
    return probekit.write_config(
        path, {**table, "app_secret": "${FEISHU_APP_SECRET}", "api_base": fake.api_base}
    )


#: The fake of one test, with the app secret (or the one given) in the environment.
feishu = functools.partial(
    probed_fake, open_fake_feishu, DEADLINE, "FEISHU_APP_SECRET", lambda fake: fake.app_secret
)


async def test_probe_checks_token_identity_connection_scopes_and_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with feishu(monkeypatch) as fake:
        rows, code = await probe_until_closed(fake, write_config(tmp_path, fake), tmp_path / "data")
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
    async with feishu(monkeypatch) as fake:
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
    async with feishu(monkeypatch, "not-the-secret") as fake:
        rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", None, False)
        assert code == 1 and row(rows, "fs: identity").result == "fail"
        assert fake.connections == []
        monkeypatch.setenv("FEISHU_APP_SECRET", fake.app_secret)
        rows, code = await _probe(write_config(tmp_path, fake), tmp_path / "data", "fs", True)
    no_dm = row(rows, "fs: send test")
    assert no_dm.result == "warn" and code == 0


async def test_substitute_rows_resolve_each_target_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = {
        name: f"ou_{name}" + "0" * 20 for name in ("ok", "xapp", "hidden", "bad", "flaky", "empty")
    }
    async with feishu(monkeypatch) as fake:
        fake.contacts[ids["ok"]] = {
            "open_id": ids["ok"],
            "union_id": "on_ok",
            "name": "Olga",
            "email": "olga@example.com",
            "avatar": {"avatar_72": "", "avatar_240": "https://example.invalid/o240.png"},
        }
        fake.contact_errors[ids["xapp"]] = (403, 99992361)
        fake.contact_errors[ids["hidden"]] = (400, 41050)
        fake.contact_errors[ids["bad"]] = (400, 41012)
        fake.contact_errors[ids["flaky"]] = (500, 40003)
        fake.contact_empty.add(ids["empty"])
        config = write_config(tmp_path, fake)
        lines = ", ".join(f'{{name = "{n}", open_id = "{i}"}}' for n, i in ids.items())
        with config.open("a", encoding="utf-8") as f:
            f.write(
                "[bots.substitute]\nenabled = true\n"
                f'targets = [{lines}, {{name = "Mail", email = "OLGA@example.com"}},'
                ' {name = "Nobody", email = "nobody@example.com"},'
                ' {name = "Tenant", user_id = "u_tenant"}]\n'
            )
        rows, code = await _probe(config, tmp_path / "data", None, False)
    table = format_table(rows)
    assert row(rows, "fs: substitute: group messages").result == "warn"
    assert row(rows, "fs: substitute: group messages").detail == (
        'substitute triggers need group_messages = "all" (im:message.group_msg)'
    )

    def target(name: str) -> tuple[str, str]:
        found = row(rows, f"fs: substitute target {name}")
        return found.result, found.detail

    assert target("ok") == (
        "ok",
        f"Olga (open_id {ids['ok']}, avatar https://example.invalid/o240.png)",
    )
    assert target("Mail") == target("ok")  # the email names the same person
    for name, reason in (
        ("xapp", "cross_app_open_id"),
        ("hidden", "not_visible"),
        ("empty", "not_visible"),
        ("bad", "unresolvable"),
        ("flaky", "resolve_failed"),
        ("Nobody", "unresolvable"),
    ):
        result, detail = target(name)
        assert result == "warn" and detail.startswith(reason + ": "), (name, detail)
    assert target("Tenant") == ("ok", "user_id u_tenant: matched as is (no name lookup)")
    assert code == 0, table
    # One lookup per open_id: the email's person ("Mail" is "ok") comes from the cache.
    profiles = [c.path for c in fake.calls_to("GET /open-apis/contact/v3/users/{user_id}")]
    assert sorted(profiles) == sorted(f"/open-apis/contact/v3/users/{i}" for i in ids.values())


async def test_the_group_messages_row_is_ok_with_all_group_messages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with feishu(monkeypatch) as fake:
        config = write_config(tmp_path, fake)
        with config.open("a", encoding="utf-8") as f:
            f.write(
                'group_messages = "all"\n[bots.substitute]\nenabled = true\n'
                'targets = [{user_id = "u_1"}]\n'
            )
        rows, _ = await _probe(config, tmp_path / "data", None, False)
    assert row(rows, "fs: substitute: group messages").result == "ok"
    assert fake.calls_to("GET /open-apis/contact/v3/users/{user_id}") == []
