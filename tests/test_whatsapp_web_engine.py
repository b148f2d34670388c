"""The WhatsApp Web adapter against the installed neonize: every call it makes exists
with the parameters it passes, every event it subscribes to exists, and importing
neonize leaves no child process or open pipe behind."""

from __future__ import annotations

import contextlib
import inspect
import sqlite3
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import trio

from dshim.channels.whatsapp_web.engine import (
    CLIENT_CALLS,
    EVENTS,
    Account,
    NeonizeEngine,
    Quote,
    load_neonize,
    prepare_session,
    saved_account,
    session_path,
    tighten_session,
)
from dshim.errors import ConfigError


@pytest.mark.parametrize(("name", "params"), sorted(CLIENT_CALLS.items()))
def test_every_client_call_exists_with_the_parameters_the_adapter_passes(
    name: str, params: tuple[str, ...]
) -> None:
    client = load_neonize("neonize.client").NewClient
    method = getattr(client, name, None)
    assert callable(method), f"NewClient.{name} is gone"
    accepted = inspect.signature(method).parameters
    assert [p for p in params if p not in accepted] == []


def test_every_event_the_adapter_subscribes_to_exists() -> None:
    events = load_neonize("neonize.events")
    assert [name for name in EVENTS if not hasattr(events, name)] == []


def test_a_missing_neonize_names_the_extra_to_install() -> None:
    with pytest.raises(ConfigError, match=r"dshim\[whatsapp-web\]"):
        load_neonize("neonize.not_a_module_of_neonize_at_all")


def test_importing_neonize_leaves_nothing_behind() -> None:
    code = textwrap.dedent(
        """\
        import gc, warnings
        warnings.simplefilter("error")
        from dshim.channels.whatsapp_web.engine import load_neonize
        load_neonize("neonize")
        gc.collect()
        print("clean")
        """
    )
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-c", code], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "clean", done.stderr[-2000:]
    assert "ResourceWarning" not in done.stderr


def test_the_session_database_is_private_before_whatsmeow_opens_it(tmp_path: Path) -> None:
    path = session_path(tmp_path, "personal")
    prepare_session(path)
    assert path == tmp_path / "whatsapp_web" / "personal.db"
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    wal = path.with_name(path.name + "-wal")
    wal.write_bytes(b"")
    wal.chmod(0o644)
    tighten_session(path)
    assert stat.S_IMODE(wal.stat().st_mode) == 0o600


def test_the_linked_account_is_read_from_the_session_without_its_keys(tmp_path: Path) -> None:
    path = session_path(tmp_path, "personal")
    assert saved_account(path) is None  # never linked
    prepare_session(path)
    assert saved_account(path) is None  # an empty database: not linked yet
    with contextlib.closing(sqlite3.connect(path)) as db:
        db.execute(
            "CREATE TABLE whatsmeow_device (jid TEXT PRIMARY KEY, lid TEXT, noise_key bytea,"
            " platform TEXT NOT NULL DEFAULT '', push_name TEXT NOT NULL DEFAULT '')"
        )
        db.commit()
        assert saved_account(path) is None  # the table, no device
        db.execute(
            "INSERT INTO whatsmeow_device VALUES (?, ?, ?, ?, ?)",
            (
                "4915100000001:17@s.whatsapp.net",
                "100000000000001:17@lid",
                b"k" * 32,
                "android",
                "Ada's spare",
            ),
        )
        db.commit()
    assert saved_account(path) == Account(
        jid="4915100000001@s.whatsapp.net",
        lid="100000000000001@lid",
        push_name="Ada's spare",
        platform="android",
    )


async def test_a_reply_is_built_with_the_quote_whatsapp_shows(tmp_path: Path) -> None:
    """The adapter's reply on neonize's own classes: an extendedTextMessage whose
    contextInfo has the stanza id, the participant and the quoted snapshot."""
    with trio.fail_after(60):
        engine = NeonizeEngine(session_path(tmp_path, "personal"))
        await engine._load()
        quote = Quote(
            "3EB0A1B2C3D4E5F60718",
            "4915112345678@s.whatsapp.net",
            {"imageMessage": {"caption": "the receipt", "mimetype": "image/jpeg"}},
        )
        message = engine._text_message("*Total*: 12 EUR", quote)
        plain = engine._text_message("no quote", None)
        await engine.disconnect()
        engine.close()
    json_format = load_neonize("google.protobuf.json_format")
    assert json_format.MessageToDict(message, preserving_proto_field_name=True) == {
        "extendedTextMessage": {
            "text": "*Total*: 12 EUR",
            "contextInfo": {
                "stanzaID": "3EB0A1B2C3D4E5F60718",
                "participant": "4915112345678@s.whatsapp.net",
                "quotedMessage": {
                    "imageMessage": {"caption": "the receipt", "mimetype": "image/jpeg"}
                },
            },
        }
    }
    assert json_format.MessageToDict(plain) == {"conversation": "no quote"}
    assert stat.S_IMODE(session_path(tmp_path, "personal").stat().st_mode) == 0o600
