"""dshim.toml: every error names the file and the key path; secrets stay hidden."""

from __future__ import annotations

from pathlib import Path

import pytest

from dshim.channels.registry import load_config, parse_config
from dshim.channels.telegram.channel import TelegramSettings
from dshim.config import Config, Secret, override_listen, resolve_data_dir
from dshim.errors import ConfigError

TOKEN = "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw"


def bots(*tables: dict[str, object]) -> dict[str, object]:
    return {"bots": list(tables)}


def tg(**kw: object) -> dict[str, object]:
    return {"name": "tg", "channel": "telegram", "token": TOKEN, **kw}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (
            bots(tg(), tg(name="b", access={"mode": "safe"})),
            'dshim.toml: bots[1].access.mode: expected "open" or "allowlist", got "safe"',
        ),
        (bots(tg(colour="blue")), "dshim.toml: bots[0].colour: unknown key"),
        ({"dshim": {"backlog_max_age": 5}}, "dshim.toml: dshim.backlog_max_age: unknown key"),
        ({"extra": {}}, "dshim.toml: extra: unknown key"),
        (bots({"channel": "telegram"}), "dshim.toml: bots[0].name: required key is missing"),
        (
            bots(tg(lanes={"max_queue": "8"})),
            'dshim.toml: bots[0].lanes.max_queue: expected an integer, got "8"',
        ),
        (bots(tg(enabled="yes")), 'dshim.toml: bots[0].enabled: expected true or false, got "yes"'),
        (
            {"dshim": {"backlog_max_age_s": "ten"}},
            'dshim.toml: dshim.backlog_max_age_s: expected a number, got "ten"',
        ),
        (
            {"harness": {"kind": "gpt"}},
            'dshim.toml: harness.kind: expected "echo", "openai", "acp" or "dsh", got "gpt"',
        ),
        ({"bots": {"name": "x"}}, "dshim.toml: bots: expected an array, got a table"),
        (bots(tg(channel="icq")), 'dshim.toml: bots[0].channel: expected one of "weixin"'),
        (bots(tg(), tg()), 'dshim.toml: bots[1].name: duplicate bot name "tg"'),
        (
            bots(tg(lanes={"max_queue": 0})),
            "dshim.toml: bots[0].lanes.max_queue: expected at least 1",
        ),
        (
            bots(tg(prompt={"source_fields": ["botId"]})),
            "dshim.toml: bots[0].prompt.source_fields[0]: expected",
        ),
        ({"harness": {"kind": "openai"}}, "dshim.toml: harness.base_url: required"),
        # The channel's own keys are validated by its settings, with the same key paths.
        (
            bots({"name": "tg", "channel": "telegram"}),
            "dshim.toml: bots[0].token: required key is missing",
        ),
        (
            bots(tg(token="not-a-token")),
            "dshim.toml: bots[0].token: not a Telegram bot token",
        ),
        (
            bots(tg(api_base="api.telegram.org")),
            "dshim.toml: bots[0].api_base: expected an http:// or https:// URL",
        ),
        (bots(tg(gateway_url="wss://x")), "dshim.toml: bots[0].gateway_url: unknown key"),
        (
            bots({"name": "d", "channel": "discord", "token": "abc", "gateway_url": "http://x"}),
            "dshim.toml: bots[0].gateway_url: expected a ws:// or wss:// URL",
        ),
        (
            bots({"name": "d", "channel": "discord", "token": "two words"}),
            "dshim.toml: bots[0].token: not a Discord bot token",
        ),
        (
            bots({"name": "w", "channel": "whatsapp"}),
            "dshim.toml: bots[0].phone_number_id: required key is missing",
        ),
    ],
)
def test_errors_name_the_key_path(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(doc, env={})
    assert str(info.value).startswith(message)


def test_credentials_come_from_the_environment_and_stay_hidden() -> None:
    cfg = parse_config(bots(tg(token="${TG_TOKEN}")), env={"TG_TOKEN": TOKEN})
    settings = cfg.bots[0].settings
    assert isinstance(settings, TelegramSettings)
    token = settings.token
    assert isinstance(token, Secret) and token.get() == TOKEN
    assert TOKEN not in repr(cfg) and TOKEN not in str(cfg.bots[0])
    assert cfg.secrets() == [TOKEN]


def test_missing_environment_variable_is_named() -> None:
    with pytest.raises(
        ConfigError, match=r"bots\[0\]\.token: environment variable TG_TOKEN is not set"
    ):
        parse_config(bots(tg(token="${TG_TOKEN}")), env={})


def test_wrong_type_of_secret_never_echoes_the_value() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(bots(tg(token=123456789)), env={})
    assert "123456789" not in str(info.value)
    assert "bots[0].token: expected a string" in str(info.value)


def test_defaults() -> None:
    cfg = parse_config(bots(tg()), env={})
    bot = cfg.bots[0]
    assert cfg.harness.kind == "echo"
    assert cfg.dshim.backlog_max_age_s == 600
    assert bot.enabled and bot.access.mode == "open"
    assert (bot.reply.deadline_s, bot.reply.pages, bot.reply.rows_per_page, bot.reply.window_s) == (
        5,
        3,
        100,
        15,
    )
    assert bot.lanes.max_queue == 8
    assert bot.prompt.source_block
    assert bot.prompt.source_fields == ["channel", "conversationType", "senderId", "senderName"]


def test_numeric_allowlist_users_become_strings() -> None:
    cfg = parse_config(bots(tg(access={"mode": "allowlist", "users": [12345, " 678 "]})), env={})
    assert cfg.bots[0].access.users == ["12345", "678"]


def test_load_config_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "my.toml"
    path.write_text(
        f'[[bots]]\nname = "a"\nchannel = "telegram"\ntoken = "{TOKEN}"\n'
        '[bots.access]\nmode = "safe"\n'
    )
    with pytest.raises(
        ConfigError,
        match=r'^my\.toml: bots\[0\]\.access\.mode: expected "open" or "allowlist", got "safe"$',
    ):
        load_config(path)


def test_invalid_toml_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "dshim.toml"
    path.write_text("[[bots]\nname=")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path)


def test_missing_file_says_how_to_create_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.toml")
    text = str(info.value)
    assert "not found" in text and "[[bots]]" in text and "DSHIM_CONFIG" in text


def test_data_dir_resolution(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert resolve_data_dir(None, None) == tmp_path / "xdg" / "dshim"
    cfg = parse_config({"dshim": {"data_dir": str(tmp_path / "conf")}}, env={})
    assert resolve_data_dir(cfg, None) == tmp_path / "conf"
    assert resolve_data_dir(cfg, tmp_path / "flag") == tmp_path / "flag"
    monkeypatch.delenv("XDG_STATE_HOME")
    assert resolve_data_dir(Config(), None) == Path.home() / ".local" / "state" / "dshim"


@pytest.mark.parametrize(
    ("http", "message"),
    [
        ({"listen": "0.0.0.0:8910"}, "dshim.toml: http.token: required when http.listen is not"),
        ({"listen": "192.168.1.5:80"}, "dshim.toml: http.token: required"),
        ({"listen": "[::]:8910"}, "dshim.toml: http.token: required"),
        ({"listen": "8910"}, "dshim.toml: http.listen: expected host:port"),
        ({"listen": "localhost:99999"}, "dshim.toml: http.listen: expected host:port"),
        ({"token": 5}, "dshim.toml: http.token: expected a string, got an integer"),
        ({"bind": "x"}, "dshim.toml: http.bind: unknown key"),
    ],
)
def test_http_errors_name_the_key(http: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config({"http": http}, env={})
    assert str(info.value).startswith(message)


def wa(**kw: object) -> dict[str, object]:
    return {
        "name": "wa",
        "channel": "whatsapp",
        "phone_number_id": "106540352242922",
        "access_token": "EAAG-test-access-token",
        "app_secret": "test-app-secret",
        "verify_token": "test-verify-token",
        **kw,
    }


def test_a_whatsapp_bot_without_the_http_endpoint_is_a_configuration_error() -> None:
    # Meta delivers WhatsApp messages only by webhook, to the local endpoint: a bot
    # without it would never receive anything.  Said at load, naming the key.
    off = {"http": {"enabled": False}}
    with pytest.raises(ConfigError) as info:
        parse_config({**off, **bots(tg(), wa())}, env={})
    message = str(info.value)
    assert message.startswith("dshim.toml: http.enabled: ")
    assert 'bots[1] ("wa")' in message and "webhook" in message
    assert "test-app-secret" not in message
    # A disabled WhatsApp bot, or none at all, needs no endpoint.
    assert parse_config({**off, **bots(tg(), wa(enabled=False))}, env={}).bots[1].name == "wa"
    assert not parse_config({**off, **bots(tg())}, env={}).http.enabled
    assert parse_config(bots(wa()), env={}).http.enabled


def test_dshim_serve_refuses_a_whatsapp_bot_without_the_endpoint_with_exit_2(
    tmp_path: Path,
) -> None:
    from tests.test_cli import dshim

    cfg = tmp_path / "dshim.toml"
    # api_base on a closed local port: nothing would reach Meta even if it started.
    table = "".join(f'{k} = "{v}"\n' for k, v in wa(api_base="http://127.0.0.1:9").items())
    cfg.write_text(f"[http]\nenabled = false\n\n[[bots]]\n{table}")
    r = dshim("--config", str(cfg), "--data-dir", str(tmp_path / "data"), "serve", timeout=20)
    assert r.returncode == 2, r.stderr
    assert "dshim.toml: http.enabled: " in r.stderr and "Traceback" not in r.stderr
    assert "bot_started" not in r.stderr and "test-app-secret" not in r.stderr


def test_http_defaults_and_the_token_from_the_environment() -> None:
    cfg = parse_config({}, env={})
    assert (cfg.http.enabled, cfg.http.listen, cfg.http.token) == (True, "127.0.0.1:8910", None)
    secret = "a-long-http-bearer-token-0123"
    cfg = parse_config(
        {"http": {"listen": "0.0.0.0:8910", "token": "${DSHIM_HTTP_TOKEN}"}},
        env={"DSHIM_HTTP_TOKEN": secret},
    )
    assert cfg.http.token == Secret(secret) and secret in cfg.secrets()
    assert secret not in repr(cfg)
    with pytest.raises(ConfigError, match="http.token: environment variable DSHIM_HTTP_TOKEN"):
        parse_config({"http": {"token": "${DSHIM_HTTP_TOKEN}"}}, env={})
    # Off: any address is fine (nothing listens).
    assert not parse_config(
        {"http": {"enabled": False, "listen": "0.0.0.0:1"}}, env={}
    ).http.enabled
    for loopback in ("127.0.0.1:0", "localhost:8910", "[::1]:8910", "127.1.2.3:8910"):
        assert parse_config({"http": {"listen": loopback}}, env={}).http.listen == loopback


def test_listen_override() -> None:
    cfg = parse_config({"http": {"listen": "127.0.0.1:8910"}}, env={})
    moved = override_listen(cfg, " 127.0.0.1:0 ", origin="--listen")
    assert moved.http.listen == "127.0.0.1:0" and cfg.http.listen == "127.0.0.1:8910"
    with pytest.raises(ConfigError, match=r"^--listen: http\.token: required"):
        override_listen(cfg, "0.0.0.0:8910", origin="--listen")
    with pytest.raises(ConfigError, match=r"^--listen: http\.listen: expected host:port"):
        override_listen(cfg, "nowhere", origin="--listen")
    guarded = parse_config({"http": {"token": "t0ken-for-the-endpoint"}}, env={})
    assert override_listen(guarded, "0.0.0.0:8910", origin="--listen").http.listen == "0.0.0.0:8910"
