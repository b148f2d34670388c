"""``dshim login`` for WeChat while the user takes their time: the terminal and the log say
a status once, when it changes, not once a poll (the flow polls every second).

Against the fake iLink login API on 127.0.0.1, on trio's autojump clock.
"""

from __future__ import annotations

from pathlib import Path

import structlog
import trio

from dshim.testing.fakes.weixin import open_fake_weixin
from tests.rig_weixin import DEADLINE
from tests.test_weixin_login import Terminal, login


async def test_a_slow_confirmation_is_told_once_not_every_second(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_weixin() as fake:
            # 30 s of waiting for the scan, 30 s scanned but not yet confirmed.
            fake.login_script = (
                [{"status": "wait"}] * 30 + [{"status": "scaned"}] * 30 + [{"status": "confirmed"}]
            )
            term = Terminal(fake, tmp_path)
            with structlog.testing.capture_logs() as logs:
                assert await login(term) == 0
    assert len(fake.calls_to("get_qrcode_status")) == 61
    assert term.said.count("scanned, confirm on the phone") == 1
    statuses = [r["action"] for r in logs if r["event"].startswith("login_status")]
    assert statuses == ["wait", "wait", "confirmed"]  # waiting, scanned, confirmed
