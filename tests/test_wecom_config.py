"""The ``[[bots]]`` keys of a WeCom bot, as ``dshim.toml`` gives them."""

from __future__ import annotations

import tomllib

import pytest

from dshim.channels.registry import parse_config
from dshim.channels.wecom.channel import WecomSettings
from dshim.channels.wecom.protocol import DEFAULT_WS_URL
from dshim.errors import ConfigError

ENV = {"WECOM_BOT_ID": "aibXk3fQ0Tzx", "WECOM_BOT_SECRET": "s3cr3t-value"}


def load(toml: str) -> WecomSettings:
    config = parse_config(tomllib.loads(toml), env=ENV)
    settings = config.bots[0].settings
    assert isinstance(settings, WecomSettings)
    return settings


BASE = """
[[bots]]
name = "wecom"
channel = "wecom"
bot_id = "${WECOM_BOT_ID}"
secret = "${WECOM_BOT_SECRET}"
"""


def test_defaults() -> None:
    s = load(BASE)
    assert (s.bot_id, s.secret.get(), s.ws_url, s.welcome) == (
        "aibXk3fQ0Tzx",
        "s3cr3t-value",
        DEFAULT_WS_URL,
        None,
    )
    assert "s3cr3t" not in repr(s)


def test_welcome_table_under_the_bot() -> None:
    s = load(BASE + '[bots.welcome]\ntext = "你好"\n')
    assert s.welcome is not None and s.welcome.text == "你好"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ('ws_url = "https://example.com"\n', r"bots\[0\]\.ws_url: expected a ws://"),
        ("colour = 1\n", r"bots\[0\]\.colour"),
        ('[bots.welcome]\ntxt = "x"\n', r"bots\[0\]\.welcome"),
        ('[bots.welcome]\ntext = "  "\n', r"bots\[0\]\.welcome: its text is empty"),
        ("[bots.welcome]\ntext = 5\n", r"bots\[0\]\.welcome\.text"),
    ],
)
def test_bad_keys_name_their_path(extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(BASE + extra)


def test_missing_secret() -> None:
    with pytest.raises(ConfigError, match=r"bots\[0\]"):
        load(BASE.replace('secret = "${WECOM_BOT_SECRET}"\n', ""))
