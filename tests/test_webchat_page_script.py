"""The web chat page's script (docs/channels/webchat.md) really chats with a bot (run as a
subprocess against dshim)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import trio

from tests.rig_webchat import serving, source_block

PAGE = Path(__file__).resolve().parents[1] / "docs" / "channels" / "webchat.md"


def readme_script() -> str:
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index("## The websocket protocol (for scripts)") :]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "the web chat page has no Python example"
    return match.group(1)


async def test_the_readme_script_gets_the_echo(tmp_path: Path) -> None:
    script = readme_script()
    assert 'url: str = "ws://127.0.0.1:8910/ws"' in script
    async with serving(tmp_path, inline=False) as s:
        code = script.replace("ws://127.0.0.1:8910/ws", s.ws_url)
        with trio.fail_after(60):
            done = await trio.run_process(
                [sys.executable, "-c", code], capture_stdout=True, capture_stderr=True
            )
    expected = source_block("direct", "u-script", "Script")
    assert done.stdout.decode() == f"{expected}\n\nhello\n"
