"""``dshim login`` and ``dshim probe`` for a WhatsApp Web bot, against the fake account.

The login links the account by QR code (drawn again whenever WhatsApp rotates it) or by
pair code (``--phone``); the probe reads the linked account and the connection's state
without a connection of its own while ``dshim serve`` may hold it.  The login runs on the
autojump clock against the fake on 127.0.0.1; the probe reads a real config and store on
the real clock (a hard deadline of a few seconds).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from dshim.channels.kit.qr import render_qr
from dshim.channels.registry import parse_config
from dshim.channels.whatsapp_web.channel import CHANNEL, STATE_CURSOR, phone_digits
from dshim.channels.whatsapp_web.engine import prepare_session, session_path
from dshim.errors import ConfigError
from dshim.store import open_store
from dshim.store.base import BoundStore
from dshim.testing.fakes.whatsapp_web import FakeWhatsAppWeb, open_fake_whatsapp_web
from tests.probekit import probe_rows

DEADLINE = 900


class Terminal:
    """A scripted terminal for ``dshim login``: keeps what was said."""

    def __init__(self, table: dict[str, Any], data_dir: Path, phone: str | None = None) -> None:
        config = parse_config(
            {"bots": [{"name": "wa", "channel": "whatsapp_web", **table}]}, env={}
        )
        self.bot = config.bots[0]
        self.data_dir = data_dir
        self.phone = phone
        self.said: list[str] = []

    def settings_as(self, kind: Any) -> Any:
        assert isinstance(self.bot.settings, kind)
        return self.bot.settings

    def register_secret(self, secret: str) -> None:
        return None

    def say(self, text: str) -> None:
        self.said.append(text)

    async def ask(self, prompt: str) -> str:
        raise AssertionError("the WhatsApp Web login asks nothing")


async def login(term: Terminal) -> int:
    assert CHANNEL.login_fn is not None
    return await CHANNEL.login_fn(term)


async def scan_after(fake: FakeWhatsAppWeb, codes: int) -> None:
    await fake.wait_until(lambda: len(fake.qr_codes) >= codes)
    await fake.scan()


async def test_the_qr_code_is_drawn_again_as_it_rotates_and_a_scan_links(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_whatsapp_web(paired=False, qr_interval_s=20.0) as fake:
            term = Terminal({"engine_url": fake.url}, tmp_path)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(scan_after, fake, 3)
                assert await login(term) == 0
    codes = {render_qr(code) for code in fake.qr_codes}
    drawings = [text for text in term.said if text in codes]
    assert drawings == [render_qr(code) for code in fake.qr_codes] and len(drawings) == 3
    assert sum("a new code: the last one expired" in t for t in term.said) == 2
    assert term.said[-1].startswith("wa: linked to +4915100000001 (dshim bot)")
    assert fake.live is None  # the login disconnected when it was done


async def test_a_pair_code_links_with_the_phone_number_instead_of_a_qr_code(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_whatsapp_web(paired=False) as fake:
            term = Terminal({"engine_url": fake.url}, tmp_path, phone="+49 (151) 000-00001")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(scan_after, fake, 2)
                assert await login(term) == 0
    assert fake.pair_phones == ["4915100000001"]
    [code] = fake.pair_codes
    [told] = [t for t in term.said if code in t]
    assert "Link with phone number instead" in told
    assert not {render_qr(c) for c in fake.qr_codes} & set(term.said)  # no QR drawn


async def test_no_scan_within_the_deadline_fails_with_what_to_do(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    with trio.fail_after(DEADLINE):
        async with open_fake_whatsapp_web(paired=False) as fake:
            term = Terminal({"engine_url": fake.url}, tmp_path)
            assert await login(term) == 1
    assert term.said[-1] == "wa: no scan within 300 s; run dshim login wa again"


def test_a_phone_number_needs_its_country_code_digits() -> None:
    assert phone_digits("+49 151 2345-678") == "491512345678"
    with pytest.raises(ConfigError, match=r"--phone: expected a number with country code"):
        phone_digits("call me maybe")


def linked_session(data_dir: Path) -> None:
    """A session database as whatsmeow leaves it after a link (its device row only)."""
    path = session_path(data_dir, "wa")
    prepare_session(path)
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute(
            "CREATE TABLE whatsmeow_device (jid TEXT PRIMARY KEY, lid TEXT, noise_key bytea,"
            " platform TEXT NOT NULL DEFAULT '', push_name TEXT NOT NULL DEFAULT '')"
        )
        db.execute(
            "INSERT INTO whatsmeow_device VALUES (?, ?, ?, ?, ?)",
            (
                "4915100000001:3@s.whatsapp.net",
                "100000000000001:3@lid",
                b"n" * 32,
                "android",
                "Ada's spare",
            ),
        )
        db.commit()


async def test_an_account_already_linked_is_kept(tmp_path: Path) -> None:
    with trio.fail_after(20):
        linked_session(tmp_path)
        term = Terminal({}, tmp_path)
        assert await login(term) == 0
    [said] = term.said
    assert said.startswith("wa: already linked to +4915100000001 (Ada's spare).")


# --- probe ------------------------------------------------------------------------------


def write_config(tmp_path: Path) -> Path:
    path = tmp_path / "dshim.toml"
    path.write_text(
        f'[dshim]\ndata_dir = "{tmp_path / "data"}"\n\n[[bots]]\nname = "wa"\n'
        'channel = "whatsapp_web"\n',
        encoding="utf-8",
    )
    return path


async def save_state(tmp_path: Path, state: str, pid: int) -> None:
    async with open_store(tmp_path / "data", inline=True) as store:
        value = {
            "state": state,
            "since": time.time() - 30,
            "number": "4915100000001",
            "push_name": "Ada's spare",
            "host": socket.gethostname(),
            "pid": pid,
        }
        await BoundStore(store, "wa").set_cursor(STATE_CURSOR, json.dumps(value))


async def test_the_probe_reads_the_linked_account_and_the_serves_state(tmp_path: Path) -> None:
    with trio.fail_after(20):
        config = write_config(tmp_path)
        linked_session(tmp_path / "data")
        await save_state(tmp_path, "connected", os.getpid())  # a live serve: this process
        rows, code = await probe_rows(config, "wa", secrets=("n" * 32,))
    assert code == 0
    assert rows["wa: identity"].result == "ok"
    assert "Ada's spare (+4915100000001)" in rows["wa: identity"].detail
    assert rows["wa: connection"].result == "ok"
    assert rows["wa: connection"].detail.startswith("connected for 30 s")


async def test_the_probe_says_how_to_recover_from_a_logout_and_an_unlinked_account(
    tmp_path: Path,
) -> None:
    with trio.fail_after(20):
        config = write_config(tmp_path)
        rows, code = await probe_rows(config, "wa", secrets=())
        assert code == 1
        assert rows["wa: identity"].result == "fail"
        assert "not linked: run `dshim login wa`" in rows["wa: identity"].detail
        linked_session(tmp_path / "data")
        await save_state(tmp_path, "logged_out", 1)
        rows, code = await probe_rows(config, "wa", secrets=())
    assert code == 1
    assert rows["wa: connection"].result == "fail"
    assert "run `dshim login wa` to link the account again" in rows["wa: connection"].detail
