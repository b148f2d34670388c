"""The ``[[bots]]`` keys of a WhatsApp bot: validated when the configuration loads, with
errors that name the key path; secrets never shown."""

from __future__ import annotations

from typing import Any

import pytest

from dshim.channels.registry import parse_config
from dshim.channels.whatsapp.channel import WhatsAppSettings
from dshim.channels.whatsapp.client import DEFAULT_API_BASE
from dshim.config import settings_of
from dshim.errors import ConfigError

ENV = {"T": "EAAG-token-0123456789", "S": "app-secret-0123", "V": "verify-0123"}


def table(**over: Any) -> dict[str, Any]:
    bot = {
        "name": "wa",
        "channel": "whatsapp",
        "phone_number_id": "106540352242922",
        "access_token": "${T}",
        "app_secret": "${S}",
        "verify_token": "${V}",
    }
    bot.update(over)
    return {"bots": [{k: v for k, v in bot.items() if v is not None}]}


def test_a_complete_table_loads_with_the_default_graph_base() -> None:
    config = parse_config(table(), env=ENV)
    settings = settings_of(config.bots[0], WhatsAppSettings)
    assert settings.api_base == DEFAULT_API_BASE  # Meta's Graph host: named, never reached
    assert settings.access_token.get() == ENV["T"]
    assert ENV["S"] not in repr(settings) and ENV["T"] not in repr(settings)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"phone_number_id": "+1 555 0100"}, "bots[0].phone_number_id"),
        ({"phone_number_id": None}, "phone_number_id"),
        ({"app_secret": None}, "app_secret"),
        ({"verify_token": ""}, "bots[0].verify_token"),
        ({"api_base": "graph.facebook.com"}, "bots[0].api_base"),
        ({"access_tokn": "x"}, "access_tokn"),
        ({"phone_number_id": 106540352242922}, "bots[0].phone_number_id"),
    ],
)
def test_bad_keys_are_errors_naming_the_key_path(over: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config(table(**over), env=ENV)
    assert message in str(err.value)
    assert not [v for v in ENV.values() if v in str(err.value)]
