"""The capture redacts a long text once: what it remembers never outlives a new secret."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import trio

from dshim.capture import Capture
from dshim.channels.registry import parse_config
from dshim.log import register_secret
from dshim.model import InboundMessage


def test_a_secret_registered_later_is_masked_in_a_text_seen_before(tmp_path: Path) -> None:
    config = parse_config(
        {"dshim": {"capture_dir": str(tmp_path)}, "bots": [{"name": "web", "channel": "webchat"}]},
        env={},
    )
    cap = Capture.from_config(config, clock=lambda: 1_790_000_000.0)
    assert cap is not None
    bc = cap.for_bot(config.bots[0])
    assert bc is not None
    token = "late-" + secrets.token_hex(16)
    text = f"the key is {token} " + "x" * 200  # long: remembered by the capture

    def event(i: int) -> None:
        item = InboundMessage(
            channel="webchat",
            bot_id="web",
            message_id=f"u/k{i}",
            conversation_id="dm",
            conversation_type="direct",
            sender_id="u",
            content=text,
        )
        bc.event(item, json.dumps({"type": "send", "text": text}).encode())

    event(1)  # not a secret yet: kept as it is
    register_secret(token)
    event(2)

    async def flush() -> None:
        with trio.fail_after(30):
            await cap.flush()

    trio.run(flush)
    [path] = (tmp_path / "web" / "dm").iterdir()
    events = json.loads(path.read_bytes())["events"]
    assert token in events[0]["text"]
    assert token not in events[1]["text"] and "***" in events[1]["text"]
