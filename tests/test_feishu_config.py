"""The ``[[bots]]`` keys of a Feishu bot: validated when the configuration loads, every
error naming its key path; the secret comes from the environment and never shows."""

from __future__ import annotations

from typing import Any

import pytest

from dshim.channels.feishu.channel import FeishuSettings
from dshim.channels.feishu.client import DOMAINS
from dshim.channels.registry import parse_config
from dshim.errors import ConfigError


def load(**keys: Any) -> FeishuSettings:
    table = {"name": "fs", "channel": "feishu", "app_id": "cli_a1b2", **keys}
    table.setdefault("app_secret", "${FEISHU_APP_SECRET}")
    config = parse_config({"bots": [table]}, env={"FEISHU_APP_SECRET": "s3cr3t-value"})
    settings = config.bots[0].settings
    assert isinstance(settings, FeishuSettings)
    return settings


def test_defaults_and_domains() -> None:
    s = load()
    # The platforms' own hosts come from the channel's table; tests never reach them.
    assert (s.domain, s.group_messages, s.base) == ("feishu", "mentions", DOMAINS["feishu"])
    assert load(domain="lark").base == DOMAINS["lark"] != DOMAINS["feishu"]
    assert load(domain="lark", api_base="http://127.0.0.1:9/").base == "http://127.0.0.1:9"
    assert s.app_secret.get() == "s3cr3t-value" and "s3cr3t" not in repr(s)


@pytest.mark.parametrize(
    "keys,where",
    [
        ({"domain": "weixin"}, "bots[0].domain"),
        ({"group_messages": "some"}, "bots[0].group_messages"),
        ({"api_base": "open.feishu.cn"}, "bots[0].api_base"),
        ({"app_id": "cli a"}, "bots[0].app_id"),
        ({"app_secret": ""}, "bots[0].app_secret"),
        ({"token": "x"}, "bots[0]"),
    ],
)
def test_bad_keys_name_their_path(keys: dict[str, Any], where: str) -> None:
    with pytest.raises(ConfigError) as err:
        load(**keys)
    assert where in str(err.value)
