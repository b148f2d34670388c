"""``dshim probe`` for a Slack bot, against the fake Slack on 127.0.0.1.

The probe reads a real config file (tokens from the environment), the same path as the
command line; each test has a hard deadline.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from dshim.probe import ProbeRow, _probe, format_table
from dshim.testing.fakes.slack import FakeSlack, open_fake_slack

DEADLINE = 20.0


def write_config(path: Path, fake: FakeSlack) -> Path:
    config = path / "dshim.toml"
    config.write_text(
        "[[bots]]\n"
        'name = "slacky"\n'
        'channel = "slack"\n'
        'bot_token = "${SLACK_BOT_TOKEN}"\n'
        'app_token = "${SLACK_APP_TOKEN}"\n'
        f'api_base = "{fake.api_base}"\n',
        encoding="utf-8",
    )
    return config


def row(rows: list[ProbeRow], check: str) -> ProbeRow:
    [found] = [r for r in rows if r.check == check]
    return found


async def probe(
    tmp_path: Path, fake: FakeSlack, mp: pytest.MonkeyPatch, send: bool = False
) -> tuple[list[ProbeRow], int]:
    mp.setenv("SLACK_BOT_TOKEN", fake.bot_token)
    mp.setenv("SLACK_APP_TOKEN", fake.app_token)
    return await _probe(write_config(tmp_path, fake), tmp_path / "data", None, send)


async def test_probe_checks_identity_scopes_socket_and_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_slack() as fake:
            rows, code = await probe(tmp_path, fake, monkeypatch)
            await fake.wait_until(lambda: bool(fake.connections) and not fake.connections[0].open)
    table = format_table(rows)
    assert code == 0, table
    assert row(rows, "slacky: credentials").result == "ok"
    assert row(rows, "slacky: identity").detail == (
        f"dshim (team Fake Workspace) (id {fake.bot_user})"
    )
    assert row(rows, "slacky: scopes").result == "ok"
    socket = row(rows, "slacky: socket mode")
    assert socket.result == "ok" and socket.detail.startswith("hello in ")
    assert row(rows, "slacky: store").result == "ok"
    [conn] = fake.connections
    assert conn.closed_by == "client"
    assert fake.bot_token not in table and fake.app_token not in table
    assert "ticket" not in table


async def test_missing_quote_scopes_warn_and_missing_required_scopes_fail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_slack() as fake:
            fake.scopes -= {"groups:history", "mpim:history"}
            rows, code = await probe(tmp_path, fake, monkeypatch)
            scopes = row(rows, "slacky: scopes")
            assert code == 0 and scopes.result == "warn"
            assert scopes.detail == (
                "missing groups:history, mpim:history: quotes in those conversations "
                "degrade to permission-denied"
            )
            fake.scopes.discard("im:history")
            rows, code = await probe(tmp_path, fake, monkeypatch)
            assert code == 1
            assert row(rows, "slacky: scopes").result == "fail"
            assert "im:history" in row(rows, "slacky: scopes").detail


async def test_send_test_goes_to_the_last_direct_conversation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_slack() as fake:
            rows, code = await probe(tmp_path, fake, monkeypatch, send=True)
            no_dm = row(rows, "slacky: send test")
            assert code == 0 and no_dm.result == "warn"
            assert not fake.calls_to("chat.postMessage")


async def test_rejected_tokens_fail_the_probe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_slack() as fake:
            fake.revoke()
            rows, code = await probe(tmp_path, fake, monkeypatch)
            assert code == 1
            assert row(rows, "slacky: identity").result == "fail"
            assert "invalid_auth" in row(rows, "slacky: identity").detail


async def test_badly_shaped_tokens_are_a_config_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dshim.channels.registry import parse_config
    from dshim.errors import ConfigError

    with pytest.raises(ConfigError, match=r"bots\[0\]\.app_token: not a Slack app-level token"):
        parse_config(
            {
                "bots": [
                    {"name": "s", "channel": "slack", "bot_token": "xoxb-1", "app_token": "xoxb-2"}
                ]
            },
            env={},
        )
    with pytest.raises(ConfigError, match=r"bots\[0\]\.bot_token"):
        parse_config(
            {
                "bots": [
                    {"name": "s", "channel": "slack", "bot_token": "xoxp-1", "app_token": "xapp-2"}
                ]
            },
            env={},
        )
    with pytest.raises(ConfigError, match=r"bots\[0\]\.strem"):
        parse_config(
            {
                "bots": [
                    {
                        "name": "s",
                        "channel": "slack",
                        "bot_token": "xoxb-1",
                        "app_token": "xapp-2",
                        "strem": True,
                    }
                ]
            },
            env={},
        )


async def test_send_test_posts_to_the_last_direct_conversation(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:  # real clock: the probe's store runs on a worker thread
    from tests.test_slack_e2e import answered, esc, running_bot, source

    async with open_fake_slack() as fake:
        async with running_bot(tmp_path, reuse=fake):
            await fake.user_message(fake.dm, "hello")
            await answered(fake, fake.dm, esc(source(fake, "direct") + "\n\nhello"))
        monkeypatch.setenv("SLACK_BOT_TOKEN", fake.bot_token)
        monkeypatch.setenv("SLACK_APP_TOKEN", fake.app_token)
        rows, code = await _probe(write_config(tmp_path, fake), tmp_path, None, True)
        sent = row(rows, "slacky: send test")
        assert code == 0 and sent.result == "ok", format_table(rows)
        [post] = [c for c in fake.calls_to("chat.postMessage") if "test" in str(c.args)]
        assert post.args["channel"] == fake.dm and "connection test" in post.args["text"]
        assert "thread_ts" not in post.args


SUBSTITUTE_TABLE = (
    "[bots.substitute]\nenabled = true\n"
    'targets = [{name = "Olga", id = "U0OLGA001"}, {name = "Ghost", id = "U0GHOST01"},'
    ' {name = "Name", username = "olga"}]\n'
)


async def test_substitute_rows_check_group_messages_and_each_target_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_slack() as fake:
            fake.users["U0OLGA001"] = {
                "id": "U0OLGA001",
                "name": "olga",
                "real_name": "Olga K",
                "profile": {"display_name": "olga.k", "real_name": "Olga K"},
            }
            monkeypatch.setenv("SLACK_BOT_TOKEN", fake.bot_token)
            monkeypatch.setenv("SLACK_APP_TOKEN", fake.app_token)
            config = write_config(tmp_path, fake)
            with config.open("a", encoding="utf-8") as f:
                f.write(SUBSTITUTE_TABLE)
            rows, code = await _probe(config, tmp_path / "data", None, False)
            ok_group = row(rows, "slacky: substitute: group messages")
            fake.scopes.discard("groups:history")
            warned, _ = await _probe(config, tmp_path / "data", None, False)
    assert code == 0, format_table(rows)
    assert ok_group.result == "ok" and "message.channels and message.groups" in ok_group.detail
    olga = row(rows, "slacky: substitute target Olga")
    assert (olga.result, olga.detail) == ("ok", "olga.k (id U0OLGA001)")
    ghost = row(rows, "slacky: substitute target Ghost")
    assert (ghost.result, ghost.detail) == (
        "warn",
        "no Slack user U0GHOST01: this target never matches",
    )
    assert "never matches" in row(rows, "slacky: substitute target Name").detail
    [info] = [c for c in fake.calls_to("users.info") if c.args["user"] == "U0OLGA001"][:1]
    assert info.token == "bot"
    group = row(warned, "slacky: substitute: group messages")
    assert group.result == "warn" and group.detail.startswith("missing groups:history: ")


async def test_no_substitute_rows_when_substitute_mode_is_off(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_slack() as fake:
            rows, code = await probe(tmp_path, fake, monkeypatch)
    assert code == 0
    assert not [r for r in rows if "substitute" in r.check]
    assert fake.calls_to("users.info") == []
