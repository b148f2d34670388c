"""``dshim probe`` for a DingTalk bot, against the fake DingTalk on 127.0.0.1.

The probe reads a real config file (the secret from the environment), so these tests go
through the same path as the command line; each has a hard deadline.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from dshim.channels.base import OutboundEntry
from dshim.probe import ProbeRow, _probe, format_table
from dshim.store import open_store
from dshim.testing.fakes.dingtalk import FakeDingTalk, open_fake_dingtalk

DEADLINE = 30.0


def write_config(path: Path, fake: FakeDingTalk, *, answer: str = "card") -> Path:
    config = path / "dshim.toml"
    config.write_text(
        "[[bots]]\n"
        'name = "ding"\n'
        'channel = "dingtalk"\n'
        f'client_id = "{fake.client_id}"\n'
        'client_secret = "${DINGTALK_CLIENT_SECRET}"\n'
        f'api_base = "{fake.api_base}"\n'
        f'oapi_base = "{fake.api_base}"\n'
        f'answer = "{answer}"\n',
        encoding="utf-8",
    )
    return config


@asynccontextmanager
async def probing(
    monkeypatch: pytest.MonkeyPatch, *, secret: str | None = None
) -> AsyncIterator[FakeDingTalk]:
    """A fake that pings at once, the secret in the environment, the suite's deadline."""
    with trio.fail_after(DEADLINE):
        async with open_fake_dingtalk() as fake:
            fake.ping_on_connect = True
            monkeypatch.setenv("DINGTALK_CLIENT_SECRET", secret or fake.client_secret)
            yield fake


async def probe(
    path: Path, fake: FakeDingTalk, *, send_test: bool = False, answer: str = "card"
) -> tuple[list[ProbeRow], int]:
    config = write_config(path, fake, answer=answer)
    return await _probe(config, path / "data", "ding" if send_test else None, send_test)


def row(rows: list[ProbeRow], check: str) -> ProbeRow:
    [found] = [r for r in rows if r.check == check]
    return found


async def test_probe_checks_token_stream_ping_cards_and_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with probing(monkeypatch) as fake:
        rows, code = await probe(tmp_path, fake)
        await fake.wait_until(lambda: bool(fake.connections) and not fake.connections[0].open)
    table = format_table(rows)
    assert code == 0, table
    assert row(rows, "ding: identity").detail == f"ding (id {fake.robot_code})"
    stream = row(rows, "ding: stream")
    assert stream.result == "ok" and "first ping answered" in stream.detail, table
    assert fake.pings_answered  # the ping really was answered
    assert row(rows, "ding: card permission").result == "ok"
    assert not fake.calls_to("POST", "/v1.0/card/instances/deliver")  # created, not delivered
    assert row(rows, "ding: store").result == "ok"
    assert fake.client_secret not in table
    assert all(t not in table for t in fake.tokens) and all(t not in table for t in fake.tickets)


async def test_probe_warns_when_cards_are_not_permitted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with probing(monkeypatch) as fake:
        fake.cards_permitted = False
        rows, code = await probe(tmp_path, fake)
    cards = row(rows, "ding: card permission")
    assert code == 0
    assert cards.result == "warn" and "answers fall back to markdown" in cards.detail


async def test_probe_fails_on_rejected_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with probing(monkeypatch, secret="not-the-secret") as fake:
        rows, code = await probe(tmp_path, fake)
    assert code == 1
    assert row(rows, "ding: identity").result == "fail"
    assert not fake.registrations


@pytest.mark.parametrize("answer", ["card", "markdown"])
async def test_send_test_reaches_the_last_direct_user(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, answer: str
) -> None:
    async with probing(monkeypatch) as fake:
        async with open_store(tmp_path / "data") as store:
            now = time.time()
            await store.set_last_direct("ding", fake.dm_conversation, now=now)
            entry = OutboundEntry(
                message_ids=["msg1"],
                text="hi",
                sent_at=now,
                completed_at=now,
                inbound=True,
                author_id=fake.user["staff_id"],
            )
            await store.add_outbound("ding", fake.dm_conversation, entry, now=now)
        rows, code = await probe(tmp_path, fake, send_test=True, answer=answer)
    assert code == 0, format_table(rows)
    sent = row(rows, "ding: send test")
    assert sent.result == "ok"
    [msg] = fake.bot_messages(fake.dm_conversation)
    assert "connection test" in msg.text
    if answer == "card":
        assert msg.kind == "card" and msg.flow_status == "3" and msg.track_id in sent.detail
    else:
        assert msg.via == "openapi" and msg.process_query_key in sent.detail
