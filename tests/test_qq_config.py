"""The ``[[bots]]`` keys of a QQ bot: validated when the configuration loads, by key path."""

from __future__ import annotations

from typing import Any

import pytest

from dshim.channels.qq.channel import QQSettings
from dshim.channels.qq.client import DEFAULT_API_BASE, DEFAULT_TOKEN_BASE
from dshim.channels.qq.protocol import DEFAULT_INTENTS, intents
from dshim.channels.registry import parse_config
from dshim.config import ConfigError, Secret

SECRET = "qq-app-secret-value"


def qq(**keys: Any) -> dict[str, Any]:
    table = {"name": "q", "channel": "qq", "app_id": "102030405", "client_secret": SECRET}
    table.update(keys)
    return {"bots": [{k: v for k, v in table.items() if v is not None}]}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        (qq(app_id=None), "dshim.toml: bots[0].app_id: required key is missing"),
        (qq(client_secret=None), "dshim.toml: bots[0].client_secret: required key is missing"),
        (qq(client_secret="two words"), "dshim.toml: bots[0].client_secret: not a QQ AppSecret"),
        (qq(app_id=" "), "dshim.toml: bots[0].app_id: not a QQ AppID"),
        (qq(api_base="api.sgroup.qq.com"), "dshim.toml: bots[0].api_base: expected an http://"),
        (qq(token_base="bots.qq.com"), "dshim.toml: bots[0].token_base: expected an http://"),
        (qq(gateway_url="https://x"), "dshim.toml: bots[0].gateway_url: expected a ws://"),
        (qq(intents=["everything"]), "dshim.toml: bots[0].intents: unknown intent 'everything'"),
        (qq(intents="group"), "dshim.toml: bots[0].intents: expected"),
        (qq(token="x"), "dshim.toml: bots[0].token: unknown key"),
        (qq(markdown="yes"), "dshim.toml: bots[0].markdown: expected"),
    ],
)
def test_errors_name_the_key_path(doc: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(doc, env={})
    assert str(info.value).startswith(message), str(info.value)


def test_the_secret_comes_from_the_environment_and_stays_hidden() -> None:
    cfg = parse_config(qq(client_secret="${QQ_CLIENT_SECRET}"), env={"QQ_CLIENT_SECRET": SECRET})
    settings = cfg.bots[0].settings
    assert isinstance(settings, QQSettings)
    assert isinstance(settings.client_secret, Secret) and settings.client_secret.get() == SECRET
    assert SECRET not in repr(cfg) and cfg.secrets() == [SECRET]
    assert (settings.api_base, settings.token_base) == (DEFAULT_API_BASE, DEFAULT_TOKEN_BASE)
    assert intents(settings.intents) == DEFAULT_INTENTS and settings.markdown
