"""Every channel passes the shared scenarios of ``tests/channel_contract.py``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from tests.channel_contract import SCENARIOS, ChannelRig
from tests.rig_dingtalk import DingTalkRig
from tests.rig_discord import DiscordRig
from tests.rig_feishu import FeishuRig
from tests.rig_qq import QQRig
from tests.rig_slack import SlackRig
from tests.rig_telegram import TelegramRig
from tests.rig_webchat import WebchatRig
from tests.rig_wecom import WecomRig
from tests.rig_weixin import WeixinRig
from tests.rig_whatsapp import WhatsAppRig

RIGS: dict[str, Callable[[], ChannelRig]] = {
    "dingtalk": DingTalkRig,
    "discord": DiscordRig,
    "feishu": FeishuRig,
    "slack": SlackRig,
    "qq": QQRig,
    "telegram": TelegramRig,
    "webchat": WebchatRig,
    "weixin": WeixinRig,
    "whatsapp": WhatsAppRig,
    "wecom": WecomRig,
}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
@pytest.mark.parametrize("channel", sorted(RIGS))
async def test_contract(
    channel: str,
    scenario: Callable[[ChannelRig, Path], Awaitable[None]],
    autojump_clock: trio.abc.Clock,
    tmp_path: Path,
) -> None:
    await scenario(RIGS[channel](), tmp_path)
