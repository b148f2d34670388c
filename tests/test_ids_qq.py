"""QQ ids and times checked at decode: table tests on the mapper, and end to end against
the fake (see ``tests/rig_qq.py``: 127.0.0.1, autojump clock, real SQLite store, echo
harness): a 70 KiB ``user_openid`` is a logged ``malformed`` drop and the next message is
answered by the same bot, never restarted."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import trio
from structlog.testing import capture_logs

from dshim.channels.qq.protocol import QQMapper
from dshim.model import InboundMessage, Skip
from tests.rig_qq import echo, running_bot, texts

BOT = "11223344"
USER = "E4F3C2B1A0998877665544332211AABB"
GROUP = "C0FFEE00112233445566778899AABBCC"
MEMBER = "0A1B2C3D4E5F60718293A4B5C6D7E8F9"
IDX = "REFIDX_CJ8BEI2Y3KcGGJj2wI4G=="
HUGE = "A" * (70 * 1024)
BAD = ["x" * 513, HUGE, "a\u0000b", "a\nb", "../x", "a b", "a/b", "a?b", "a#b", ".."]
#: Quote indexes are base64 (``/`` is one of its letters) and only ever store keys.
BAD_INDEX = [b for b in BAD if b != "a/b"]


def frame(t: str, d: dict[str, Any]) -> bytes:
    return json.dumps({"op": 0, "s": 3, "t": t, "id": f"{t}:x1", "d": d}).encode()


def c2c(**extra: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": "ROBOT1.0_kfqRNXYtZ8cFAIy9ETsCsiHOJtUvpUCv2BDv5lkRXDYgE3QC-3aL2jATL3f.4cTL!",
        "author": {"id": USER, "user_openid": USER},
        "content": "hello",
        "timestamp": "2026-11-02T10:00:00+08:00",
        "message_scene": {"source": "default", "ext": [f"msg_idx={IDX}"]},
    }
    d.update(extra)
    return d


def group(**extra: Any) -> dict[str, Any]:
    d = c2c(author={"id": MEMBER, "member_openid": MEMBER}, group_openid=GROUP)
    d.update(extra)
    return d


def guild(**extra: Any) -> dict[str, Any]:
    d: dict[str, Any] = {
        "id": "08f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c601",
        "channel_id": "6344117",
        "guild_id": "5237615478283154023",
        "author": {"id": "144115218181063123", "username": "ada"},
        "content": f"<@!{BOT}> hi",
        "timestamp": "2026-11-02T10:00:00+08:00",
    }
    d.update(extra)
    return d


def decode(t: str, d: dict[str, Any]) -> InboundMessage | Skip:
    return QQMapper(BOT).decode_frame(frame(t, d))


def test_real_ids_pass() -> None:
    for t, d in [
        ("C2C_MESSAGE_CREATE", c2c()),
        ("GROUP_AT_MESSAGE_CREATE", group()),
        ("AT_MESSAGE_CREATE", guild()),
        ("DIRECT_MESSAGE_CREATE", guild()),
    ]:
        assert isinstance(decode(t, d), InboundMessage), t


def malformed(item: InboundMessage | Skip) -> bool:
    return isinstance(item, Skip) and item.reason == "malformed"


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_message_id_is_malformed(bad: str) -> None:
    assert malformed(decode("C2C_MESSAGE_CREATE", c2c(id=bad)))


@pytest.mark.parametrize("bad", BAD_INDEX)
def test_a_bad_msg_idx_is_malformed(bad: str) -> None:
    assert malformed(decode("C2C_MESSAGE_CREATE", c2c(message_scene={"ext": [f"msg_idx={bad}"]})))


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_openid_is_malformed(bad: str) -> None:
    assert malformed(decode("C2C_MESSAGE_CREATE", c2c(author={"user_openid": bad})))
    assert malformed(decode("GROUP_AT_MESSAGE_CREATE", group(group_openid=bad)))
    assert malformed(decode("GROUP_AT_MESSAGE_CREATE", group(author={"member_openid": bad})))


@pytest.mark.parametrize("bad", [*BAD, "12a", "-1", "0x10"])
def test_guild_ids_are_digit_strings(bad: str) -> None:
    assert malformed(decode("AT_MESSAGE_CREATE", guild(channel_id=bad)))
    assert malformed(decode("DIRECT_MESSAGE_CREATE", guild(guild_id=bad)))
    assert malformed(decode("AT_MESSAGE_CREATE", guild(author={"id": bad})))


@pytest.mark.parametrize("bad", BAD_INDEX)
def test_a_bad_quoted_index_keeps_the_message_without_its_quote(bad: str) -> None:
    ext = [f"msg_idx={IDX}", f"ref_msg_idx={bad}"]
    item = decode("C2C_MESSAGE_CREATE", c2c(message_type=103, message_scene={"ext": ext}))
    assert isinstance(item, InboundMessage) and item.content == "hello"
    assert item.reply_to is not None and item.reply_to.unavailable_reason == "not-found"


@pytest.mark.parametrize("when", ["16407412978094929299", "4102444801", 16407412978094929299])
def test_an_absurd_timestamp_is_malformed(when: str | int) -> None:
    assert malformed(decode("C2C_MESSAGE_CREATE", c2c(timestamp=when)))


async def test_a_70_kib_user_openid_is_dropped_and_the_next_message_answered(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    with capture_logs() as logs:
        async with running_bot(tmp_path) as (bot, fake):
            await fake.dispatch("C2C_MESSAGE_CREATE", fake.c2c_payload("poisoned", user=HUGE))
            await fake.dispatch("C2C_MESSAGE_CREATE", fake.c2c_payload("still there?"))
            expected = echo(fake, "still there?")
            await fake.wait_until(lambda: expected in texts(fake, fake.c2c_conversation))
            await trio.sleep(30)
    assert [r for _, r in bot.events.drops] == ["malformed"]
    assert bot.events.prompts == [expected]
    assert texts(fake, fake.c2c_conversation) == [expected]
    assert not [e for e in logs if str(e["event"]).endswith("_restarting")]
