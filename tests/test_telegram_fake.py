"""The fake Bot API itself: its fault knobs answer the way Telegram does, and its manager
raises errors as themselves.

The fake is part of the product (tests, benchmarks and demos drive it), so the knobs other
tests rely on are checked here with a plain httpx client on 127.0.0.1.
"""

from __future__ import annotations

import httpx
import pytest
import trio

from dshim.testing.fakes.telegram import TEST_TOKEN, open_fake_telegram


async def test_an_error_inside_the_block_comes_out_as_itself() -> None:
    with pytest.raises(LookupError, match="boom"):
        async with open_fake_telegram():
            raise LookupError("boom")


async def test_status_faults_use_the_bot_api_error_shape() -> None:
    async with open_fake_telegram() as fake, httpx.AsyncClient(base_url=fake.url) as http:
        fake.fail_next("sendMessage", 1, status=429)
        fake.fail_next("getUpdates", 1, status=409)
        fake.fail_next("sendMessage", 2, status=400, migrate_to_chat_id=-1002, description="x")
        rate = await http.post(f"/bot{TEST_TOKEN}/sendMessage", json={})
        conflict = await http.post(f"/bot{TEST_TOKEN}/getUpdates", json={})
        migrated = await http.post(f"/bot{TEST_TOKEN}/sendMessage", json={})
    assert rate.status_code == 429
    assert rate.json()["parameters"] == {"retry_after": 3}
    assert conflict.json()["description"].startswith("Conflict: terminated by other getUpdates")
    assert migrated.json() == {
        "ok": False,
        "error_code": 400,
        "description": "x",
        "parameters": {"migrate_to_chat_id": -1002},
    }
    assert [c.status for c in fake.calls] == [429, 409, 400]


async def test_a_dropped_call_is_not_performed_a_lost_response_is() -> None:
    async with open_fake_telegram() as fake, httpx.AsyncClient(base_url=fake.url) as http:
        fake.private_chat(fake.user(42))
        send = {"chat_id": 42, "text": "hi"}
        fake.drop_next("sendMessage")
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post(f"/bot{TEST_TOKEN}/sendMessage", json=send)
        assert fake.bot_messages(42) == []
        fake.lose_response_next("sendMessage")
        with pytest.raises(httpx.RemoteProtocolError):
            await http.post(f"/bot{TEST_TOKEN}/sendMessage", json=send)
        ok = await http.post(f"/bot{TEST_TOKEN}/sendMessage", json=send)
    assert ok.json()["ok"] is True
    assert [m.text for m in fake.bot_messages(42)] == ["hi", "hi"]  # the user sees both
    assert [c.status for c in fake.calls_to("sendMessage")] == [0, 200, 200]


async def test_downloads_are_calls_with_their_own_faults() -> None:
    async with open_fake_telegram() as fake, httpx.AsyncClient(base_url=fake.url) as http:
        file_id, _ = fake.add_file(b"data", name="a.txt")
        path = fake.files[file_id][0]
        fake.fail_next("file", 1, status=404)
        gone = await http.get(f"/file/bot{TEST_TOKEN}/{path}")
        ok = await http.get(f"/file/bot{TEST_TOKEN}/{path}")
        with trio.fail_after(1):
            await fake.wait_until(lambda: len(fake.calls_to("file")) == 2)
    assert (gone.status_code, ok.status_code, ok.content) == (404, 200, b"data")
