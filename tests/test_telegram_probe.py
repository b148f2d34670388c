"""``dshim probe`` for a Telegram bot, against the fake Bot API on 127.0.0.1.

The probe reads a real config file and opens the real store (in a worker thread), so
these tests run on the real clock with a hard deadline of a few seconds each.  Every test
checks the printed table never shows the token.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import structlog
import trio
from typer.testing import CliRunner

from dshim.cli import app
from dshim.probe import ProbeRow, _probe, format_table
from dshim.store import open_store
from dshim.testing.fakes.telegram import TEST_TOKEN, FakeTelegram, open_fake_telegram

DEADLINE = 20
SECRET_PART = TEST_TOKEN.split(":", 1)[1]


def write_config(tmp_path: Path, api_base: str) -> Path:
    path = tmp_path / "dshim.toml"
    path.write_text(
        f'[dshim]\ndata_dir = "{tmp_path / "data"}"\n\n'
        '[[bots]]\nname = "tg"\nchannel = "telegram"\ntoken = "${TG_TOKEN}"\n'
        f'api_base = "{api_base}"\n',
        encoding="utf-8",
    )
    return path


def rows_by_check(rows: list[ProbeRow]) -> dict[str, ProbeRow]:
    return {r.check: r for r in rows}


async def probe(
    tmp_path: Path, fake: FakeTelegram, *, send_test: bool = False
) -> tuple[dict[str, ProbeRow], int, str]:
    rows, code = await _probe(write_config(tmp_path, fake.url), None, "tg", send_test)
    table = format_table(rows)
    assert TEST_TOKEN not in table and SECRET_PART not in table
    return rows_by_check(rows), code, table


@pytest.fixture(autouse=True)
def token_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TG_TOKEN", TEST_TOKEN)


async def test_healthy_bot_passes_every_check_without_moving_the_offset(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_telegram() as fake:
            chat = fake.private_chat(FakeTelegram.user(42))
            fake.user_message(chat, FakeTelegram.user(42), "one")
            first = fake.last_update_id
            fake.user_message(chat, FakeTelegram.user(42), "two")
            assert first is not None
            async with open_store(tmp_path / "data") as store:
                await store.set_cursor("tg", "telegram.offset", str(first + 1))
            rows, code, table = await probe(tmp_path, fake)
            async with open_store(tmp_path / "data") as store:
                after = await store.get_cursor("tg", "telegram.offset")
    assert code == 0
    creds = rows["tg: credentials"]
    assert creds.result == "ok" and "bot id 123456" in creds.detail
    assert (
        rows["tg: identity"].result == "ok"
        and rows["tg: identity"].detail == "@dshim_test_bot (id 123456)"
    )
    assert rows["tg: getWebhookInfo"].result == "ok"
    assert (
        rows["tg: getUpdates"].result == "ok"
        and "at least 1 update waiting" in rows["tg: getUpdates"].detail
    )
    assert rows["tg: store"].result == "ok"
    [poll] = fake.calls_to("getUpdates")
    assert poll.params == {
        "timeout": 0,
        "limit": 1,
        "offset": first + 1,
    }  # no allowed_updates: it is sticky
    assert after == str(first + 1)  # the stored offset did not move
    assert fake.pending_updates == 1  # the unhandled update is still waiting for the bot
    assert "check" in table.splitlines()[0] and "result" in table.splitlines()[0]


async def test_webhook_is_a_warning_that_explains_409(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_telegram() as fake:
            fake.webhook_url = "https://hooks.example/secret-path-abc123"
            rows, code, table = await probe(tmp_path, fake)
    row = rows["tg: getWebhookInfo"]
    assert row.result == "warn" and "409" in row.detail and "deleteWebhook" in row.detail
    assert "secret-path" not in table  # only the host is shown
    assert rows["tg: getUpdates"].result == "fail"  # polling really is blocked
    assert code == 1


async def test_conflict_fails_with_an_explanation(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_telegram() as fake:
            fake.fail_next("getUpdates", 1, status=409)
            rows, code, _ = await probe(tmp_path, fake)
    row = rows["tg: getUpdates"]
    assert row.result == "fail" and "another process is polling" in row.detail
    assert code == 1


async def test_rejected_token_fails_getme_and_stops(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_telegram(token="654321:the-right-token-for-this-fake") as fake:
            rows, code, table = await probe(tmp_path, fake)
    assert rows["tg: identity"].result == "fail" and "rejected" in rows["tg: identity"].detail
    assert "tg: getUpdates" not in rows and "tg: store" not in rows
    assert code == 1
    assert "123456" in table  # the public bot id may show; the secret never does


async def test_malformed_token_is_a_configuration_error_before_any_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TG_TOKEN", "not-a-token-at-all")
    with trio.fail_after(DEADLINE):
        async with open_fake_telegram() as fake:
            rows, code, table = await probe(tmp_path, fake)
    assert rows["config"].result == "fail"
    assert "bots[0].token: not a Telegram bot token" in rows["config"].detail
    assert fake.calls == []
    assert code == 2 and "not-a-token-at-all" not in table


async def test_send_test_without_a_direct_conversation_says_so(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_telegram() as fake:
            rows, code, _ = await probe(tmp_path, fake, send_test=True)
    row = rows["tg: send test"]
    assert row.result == "warn" and "no direct conversation yet" in row.detail
    assert fake.calls_to("sendMessage") == []
    assert code == 0


async def test_send_test_reaches_the_last_direct_conversation(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_telegram() as fake:
            fake.private_chat(FakeTelegram.user(42))
            async with open_store(tmp_path / "data") as store:
                await store.set_last_direct("tg", "42", now=1.0)
            rows, code, _ = await probe(tmp_path, fake, send_test=True)
    assert rows["tg: send test"].result == "ok"
    assert [m.text for m in fake.bot_messages(42)] == ["dshim connection test"]
    assert code == 0


async def test_cli_prints_the_table_and_exits_by_the_result(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_telegram() as fake:
            config = write_config(tmp_path, fake.url)
            config_before = structlog.get_config()

            def invoke() -> tuple[int, str]:
                root = logging.getLogger()
                handlers, level = root.handlers[:], root.level
                try:
                    result = CliRunner().invoke(
                        app, ["--config", str(config), "probe", "tg"], env={"TG_TOKEN": TEST_TOKEN}
                    )
                finally:  # the CLI logs to the runner's stream, closed afterwards
                    for handler in root.handlers[:]:
                        if handler not in handlers:
                            root.removeHandler(handler)
                    root.setLevel(level)
                    structlog.configure(**config_before)
                return result.exit_code, result.output

            code, output = await trio.to_thread.run_sync(invoke)
            fake.fail_next("getMe", 1, status=401, description="Unauthorized")
            bad_code, bad_output = await trio.to_thread.run_sync(invoke)
    assert code == 0, output
    assert "@dshim_test_bot (id 123456)" in output
    assert bad_code == 1 and "fail" in bad_output
    for text in (output, bad_output):
        assert TEST_TOKEN not in text and SECRET_PART not in text


async def test_substitute_rows_warn_about_privacy_mode_and_check_targets(
    tmp_path: Path,
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_telegram() as fake:
            group = fake.group_chat(-100123, "Ops")
            fake.user_message(group, FakeTelegram.user(777, "Olga"), "hello")
            fake.members[(-100123, 778)] = "left"
            path = write_config(tmp_path, fake.url)
            with path.open("a", encoding="utf-8") as f:
                f.write(
                    "[bots.substitute]\nenabled = true\nchats = [-100123]\n"
                    'targets = [{name = "Olga", id = 777}, {name = "Gone", id = 778},'
                    ' {username = "someone"}]\n'
                )
            rows, code = await _probe(path, None, "tg", False)
            by, table = rows_by_check(rows), format_table(rows)
    assert by["tg: substitute: group messages"].result == "warn"
    assert "privacy mode is on" in by["tg: substitute: group messages"].detail
    assert by["tg: substitute target Olga"].result == "ok"
    assert "-100123: member" in by["tg: substitute target Olga"].detail
    assert by["tg: substitute target Gone"].result == "warn"
    assert by["tg: substitute target @someone"].result == "ok"
    assert "resolves no username" in by["tg: substitute target @someone"].detail
    assert code == 0 and TEST_TOKEN not in table
