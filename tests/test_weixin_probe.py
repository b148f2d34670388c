"""``dshim probe`` for a WeChat bot, against the fake iLink API on 127.0.0.1.

The probe reads a real config file and opens the real store (in a worker thread), so
these tests run on the real clock with a hard deadline of a few seconds each.  Every
table is checked never to show the token or a context token.
"""

from __future__ import annotations

import time
from pathlib import Path

import trio

from dshim.channels.weixin import creds
from dshim.channels.weixin.channel import CURSOR
from dshim.channels.weixin.contexts import ContextBook
from dshim.channels.weixin.protocol import ContextToken, credential_hash
from dshim.probe import ProbeRow
from dshim.store import open_store
from dshim.store.base import BoundStore
from dshim.testing.fakes.weixin import TEST_TOKEN, USER, FakeWeixin, open_fake_weixin
from tests.probekit import probe_rows

DEADLINE = 20
CONTEXT = "ctx-probe-secret-0123456789"


def write_config(tmp_path: Path, fake: FakeWeixin, *, token: bool = True) -> Path:
    path = tmp_path / "dshim.toml"
    lines = [
        f'[dshim]\ndata_dir = "{tmp_path / "data"}"\n',
        '[[bots]]\nname = "wx"\nchannel = "weixin"',
        f'api_base = "{fake.url}"\ncdn_base = "{fake.cdn_url}"',
    ]
    if token:
        lines.append(f'token = "{TEST_TOKEN}"\nbot_id = "{fake.bot_id}"')
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


async def probe(
    tmp_path: Path, fake: FakeWeixin, *, send_test: bool = False, token: bool = True
) -> tuple[dict[str, ProbeRow], int]:
    config = write_config(tmp_path, fake, token=token)
    return await probe_rows(config, "wx", secrets=(TEST_TOKEN, CONTEXT), send_test=send_test)


async def seed_user(tmp_path: Path, fake: FakeWeixin) -> None:
    """The user wrote once: the last direct chat and their context token are stored."""
    async with open_store(tmp_path / "data") as store:
        await store.set_last_direct("wx", USER, now=time.time())
        book = ContextBook(
            BoundStore(store, "wx"),
            credential=credential_hash(TEST_TOKEN),
            clock=time.time,
            register_secret=lambda s: None,
        )
        await book.observe(USER, ContextToken(CONTEXT, 1, int(time.time() * 1000)))
    fake.issue_context(USER, CONTEXT)


async def test_healthy_bot_passes_without_reading_updates(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_weixin() as fake:
            await seed_user(tmp_path, fake)
            rows, code = await probe(tmp_path, fake, send_test=True)
            async with open_store(tmp_path / "data") as store:
                cursor = await store.get_cursor("wx", CURSOR)
    assert code == 0, rows
    assert rows["wx: credentials"].result == "ok"
    assert "token from the config" in rows["wx: credentials"].detail
    assert rows["wx: identity"].result == "ok" and fake.bot_id in rows["wx: identity"].detail
    assert rows["wx: context token"].result == "ok"
    assert rows["wx: send test"].result == "ok"
    assert [b.text for b in fake.sent_to(USER)] == ["dshim connection test"]
    assert fake.calls_to("getupdates") == [] and cursor is None  # no update consumed
    assert fake.calls_to("getconfig")[0].body["ilink_user_id"] == USER


async def test_an_expired_session_fails_and_says_to_log_in(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_weixin() as fake:
            await seed_user(tmp_path, fake)
            fake.expire()
            rows, code = await probe(tmp_path, fake)
    assert code == 1
    assert rows["wx: identity"].result == "fail"
    assert "dshim login wx" in rows["wx: identity"].detail


async def test_no_credentials_fail_and_a_saved_login_is_used(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_weixin() as fake:
            rows, code = await probe(tmp_path, fake, token=False)
            assert code == 1 and rows["wx: credentials"].result == "fail"
            assert "dshim login wx" in rows["wx: credentials"].detail
            login = creds.SavedLogin(
                bot_token=TEST_TOKEN, ilink_bot_id=fake.bot_id, baseurl=fake.url, ilink_user_id=USER
            )
            await creds.save_login(tmp_path / "data", "wx", login)
            rows, code = await probe(tmp_path, fake, token=False)
    assert code == 0, rows
    assert "saved QR login" in rows["wx: credentials"].detail
    assert rows["wx: context token"].result == "warn"  # nobody wrote yet


async def test_send_test_without_a_context_token_says_so(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_weixin() as fake:
            async with open_store(tmp_path / "data") as store:
                await store.set_last_direct("wx", USER, now=time.time())
            rows, code = await probe(tmp_path, fake, send_test=True)
    assert code == 1
    assert rows["wx: send test"].result == "fail"
    assert "no context token" in rows["wx: send test"].detail
    assert fake.calls_to("sendmessage") == []
