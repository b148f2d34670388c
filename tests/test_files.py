"""Files reach the agent: every current attachment that is not an image is downloaded in
the turn (within the bot's ``max_file_bytes``), saved under ``files/<bot>/<conversation>/``
in the data directory (files 0600, directories 0700, removed after ``files_ttl_s``) and
listed in the ``<dsh_im_files>`` block, the prompt's last text part.

Testing manifesto: the end-to-end tests run the real channel code against the fakes on
127.0.0.1 (the Telegram Bot API through ``serve_bots``; the web chat through the local
endpoint and a scripted tab; an ACP agent as a real subprocess), a real SQLite store in
``tmp_path`` and the files on the real file system.  Assertions are about what the agent
receives and what is on disk; names and the sweep also get table tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from dshim.channels.registry import parse_config
from dshim.errors import ConfigError, TooLarge
from dshim.model import FilePart, MediaRef, PromptPart, TextPart
from dshim.net.http import download_capped, open_http
from dshim.pipeline.files import (
    SWEEP_EVERY_S,
    FileStash,
    disk_name,
    display_name,
)
from dshim.pipeline.turn import MEDIA_DEADLINE_S
from dshim.replay import DATA_DIR_MARK, run_fixture
from dshim.text import safe_component
from tests.channel_contract import RecordingHarness as TabHarness
from tests.helpers import T0, msg, open_rig
from tests.rig_telegram import ADA, RecordingHarness, polling, running_bot, telegram_world
from tests.rig_webchat import ChatClient, serving
from tests.test_harness_acp import DEADLINE_S, acp_rig, journal
from tests.test_kit_h11 import read_request, serve_raw

#: The start of a real PDF: its second line is binary (never UTF-8, never inlined).
PDF = b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n" + b"1 0 obj << /Type /Catalog >> endobj\n" * 40
FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
FILE_KEYS = ["name", "kind", "mediaType", "size", "path"]
MISSING_KEYS = ["name", "kind", "unavailableReason"]


def files_block(parts: list[PromptPart]) -> list[dict[str, Any]]:
    """The entries of the ``<dsh_im_files>`` block, which must be the last text part."""
    texts = [p.text for p in parts if isinstance(p, TextPart)]
    last = texts[-1]
    assert last.startswith("<dsh_im_files>") and last.endswith("</dsh_im_files>")
    assert sum("<dsh_im_files>" in t for t in texts) == 1
    entries: list[dict[str, Any]] = json.loads(
        last[len("<dsh_im_files>") : -len("</dsh_im_files>")]
    )
    return entries


def content(path: Path) -> bytes:
    return path.read_bytes()


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def assert_private(path: Path, data_dir: Path) -> None:
    """A saved file: 0600, inside ``data_dir/files``, every folder on the way 0700."""
    assert mode(path) == 0o600
    folder = path.parent
    while folder != data_dir:
        assert mode(folder) == 0o700, folder
        folder = folder.parent
    assert path.relative_to(data_dir / "files")


# --- Telegram: documents over the fake Bot API ---------------------------------------------


async def test_a_telegram_pdf_is_saved_privately_and_listed_last_in_the_prompt(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    harness = RecordingHarness()
    async with telegram_world(tmp_path) as (fake, store, clock):
        chat = fake.private_chat(ADA)
        async with running_bot(fake, store, clock, harness=harness):
            await polling(fake)
            sent = fake.user_message(
                chat, ADA, caption="summarise this", document=("q3.pdf", "application/pdf", PDF)
            )
            await fake.wait_until(lambda: len(fake.bot_messages(42)) == 1)
            await trio.sleep(5)
    [parts] = harness.prompts
    [entry] = files_block(parts)
    assert list(entry) == FILE_KEYS
    path = Path(entry["path"])
    assert entry == {
        "name": "q3.pdf",
        "kind": "file",
        "mediaType": "application/pdf",
        "size": len(PDF),
        "path": str(tmp_path / "files" / "tg" / "42" / f"{sent['message_id']}_1_q3.pdf"),
    }
    assert path.is_absolute() and content(path) == PDF
    assert_private(path, tmp_path)
    texts = [p.text for p in parts if isinstance(p, TextPart)]
    assert texts[-2] == "summarise this"  # the block comes after the current text
    [part] = [p for p in parts if isinstance(p, FilePart)]
    assert (part.path, part.size, part.mime) == (entry["path"], len(PDF), "application/pdf")
    # The echo harness answers with the prompt: the user sees what the agent was told.
    assert fake.bot_messages(42)[0].text.endswith(texts[-1])


async def test_telegram_too_large_is_decided_from_the_declared_size_without_a_download(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    harness = RecordingHarness()
    async with telegram_world(tmp_path) as (fake, store, clock):
        chat = fake.private_chat(ADA)
        async with running_bot(fake, store, clock, harness=harness, max_file_bytes=1000):
            await polling(fake)
            fake.user_message(chat, ADA, caption="big", document=("q3.pdf", "application/pdf", PDF))
            await fake.wait_until(lambda: len(fake.bot_messages(42)) == 1)
            fake.user_message(chat, ADA, caption="small", document=("a.txt", "text/plain", b"ok"))
            await fake.wait_until(lambda: len(fake.bot_messages(42)) == 2)
    big, small = harness.prompts
    assert files_block(big) == [
        {"name": "q3.pdf", "kind": "file", "unavailableReason": "too-large"}
    ]
    assert not [p for p in big if isinstance(p, FilePart)]
    assert files_block(small)[0]["size"] == 2
    assert len(fake.calls_to("getFile")) == 1  # only the small one was fetched
    assert not list((tmp_path / "files" / "tg" / "42").glob("*q3.pdf"))


async def test_telegram_files_that_are_gone_or_fail_are_listed_with_the_reason(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    harness = RecordingHarness()
    async with telegram_world(tmp_path) as (fake, store, clock):
        chat = fake.private_chat(ADA)
        async with running_bot(fake, store, clock, harness=harness) as run:
            await polling(fake)
            fake.fail_next("getFile", 1, status=404, description="Not Found")
            fake.user_message(
                chat, ADA, caption="one", document=("gone.pdf", "application/pdf", PDF)
            )
            await fake.wait_until(lambda: len(fake.bot_messages(42)) == 1)
            fake.fail_next("file", 1, status=500)
            fake.user_message(
                chat, ADA, caption="two", document=("err.pdf", "application/pdf", PDF)
            )
            await fake.wait_until(lambda: len(fake.bot_messages(42)) == 2)
            assert run.results == {}  # the bot never stopped
    gone, failed = harness.prompts
    assert files_block(gone) == [
        {"name": "gone.pdf", "kind": "file", "unavailableReason": "not-found"}
    ]
    assert files_block(failed) == [
        {"name": "err.pdf", "kind": "file", "unavailableReason": "failed"}
    ]
    assert all(list(e) == MISSING_KEYS for e in files_block(gone) + files_block(failed))
    for parts in (gone, failed):
        text = " ".join(p.text for p in parts if isinstance(p, TextPart))
        assert "could not be downloaded" in text and "token" not in text
    assert not list((tmp_path / "files").rglob("*.pdf"))


# --- the web chat: uploads take the same path ----------------------------------------------------


async def test_web_chat_uploads_are_saved_under_safe_distinct_names(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    harness = TabHarness()
    uploads = [
        ("q3.pdf", "application/pdf", PDF),
        ("../../../etc/passwd", "text/plain", b"root:x:0:0"),
        ("notes.txt", "text/plain", b"first"),
        ("notes.txt", "text/plain", b"second"),
        ("..", None, b"\x00\x01"),
    ]
    async with serving(tmp_path, harness=harness) as s, ChatClient(s.ws_url).running() as ann:
        await ann.join("../room")
        await ann.send("../room", "files", files=uploads)
        await ann.wait_until(lambda: any(m.final for m in ann.in_conversation("../room", bot=True)))
    [parts] = harness.prompts
    entries = files_block(parts)
    assert [(e["name"], e["mediaType"], e["size"]) for e in entries] == [
        ("q3.pdf", "application/pdf", len(PDF)),
        ("passwd", "text/plain", 10),
        ("notes.txt", "text/plain", 5),
        ("notes.txt", "text/plain", 6),
        ("file-5", "application/octet-stream", 2),
    ]
    paths = [Path(e["path"]) for e in entries]
    assert len(set(paths)) == 5  # the same name twice: two files
    assert [content(p) for p in paths] == [u[2] for u in uploads]
    conversation = tmp_path / "files" / "web" / safe_component("../room")
    for p in paths:
        assert p.parent == conversation  # nothing escaped the conversation's folder
        assert_private(p, tmp_path)
    assert not (tmp_path / "etc").exists() and not (tmp_path / "files" / "etc").exists()
    texts = [p.text for p in parts if isinstance(p, TextPart)]
    # Small UTF-8 text files are also inlined; the PDF is not.
    assert "[attached file: notes.txt, text/plain, 5 bytes]\nfirst" in texts
    assert not any("%PDF" in t for t in texts)


async def test_a_web_chat_upload_over_the_bots_limit_is_refused_when_sent(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    harness = TabHarness()
    async with (
        serving(tmp_path, harness=harness, bot={"max_file_bytes": 100}) as s,
        ChatClient(s.ws_url).running() as ann,
    ):
        await ann.join("c1")
        cid = await ann.send("c1", "big", files=[("q3.pdf", "application/pdf", PDF)], wait=False)
        await ann.wait_until(lambda: any(e.get("client_id") == cid for e in ann.errors))
        await trio.sleep(3)
    [error] = ann.errors
    assert error["code"] == "attachment_too_large"
    assert error["message"] == f"q3.pdf is {len(PDF)} bytes: a file can be at most 100 bytes"
    assert harness.prompts == [] and not (tmp_path / "files" / "web" / "c1").exists()


# --- ACP: a resource_link per file ------------------------------------------------------------


async def test_acp_gets_each_saved_file_as_a_resource_link(tmp_path: Path) -> None:
    async def pdf(limit: int) -> bytes:
        return PDF

    ref = MediaRef(kind="file", name="q3.pdf", mime="application/pdf", size=len(PDF), fetch=pdf)
    gone = MediaRef(kind="file", name="old.zip", fetch=None)
    with trio.fail_after(DEADLINE_S):
        async with acp_rig(tmp_path) as (rig, _):
            await rig.rt.accept(msg("what is in it?", files=[ref, gone]))
            await rig.rt.wait_idle()
    saved = next((tmp_path / "data" / "files" / "t" / "42").glob("*_1_q3.pdf"))
    prompt = next(m for m in journal(tmp_path) if m.get("method") == "session/prompt")
    blocks = prompt["params"]["prompt"]
    links = [b for b in blocks if b["type"] == "resource_link"]
    assert links == [
        {
            "type": "resource_link",
            "uri": saved.as_uri(),
            "name": "q3.pdf",
            "mimeType": "application/pdf",
            "size": len(PDF),
        }
    ]
    texts = [b["text"] for b in blocks if b["type"] == "text"]
    assert texts[-1] == (
        '<dsh_im_files>[{"name":"q3.pdf","kind":"file","mediaType":"application/pdf",'
        f'"size":{len(PDF)},"path":{json.dumps(str(saved))}}},'
        '{"name":"old.zip","kind":"file","unavailableReason":"failed"}]</dsh_im_files>'
    )
    # The agent could read it: the fake reports what the file:// URI holds.
    assert rig.texts[-1] == (
        f"echo: what is in it?\nfile q3.pdf application/pdf {len(PDF)} bytes, {len(PDF)} on disk"
    )


# --- the time limit of a turn's downloads ---------------------------------------------------------


async def test_files_not_downloaded_within_the_deadline_are_failed(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    async def quick(limit: int) -> bytes:
        return b"quick"

    async def stuck(limit: int) -> bytes:
        await trio.sleep(3 * MEDIA_DEADLINE_S)
        return b"never"

    harness = TabHarness()
    files = [
        MediaRef(kind="file", name="a.txt", fetch=quick),
        MediaRef(kind="file", name="b.bin", fetch=stuck),
        MediaRef(kind="audio", name="c.ogg", fetch=quick),
    ]
    async with open_rig(tmp_path, harness=harness) as rig:
        await rig.rt.accept(msg("three files", files=files))
        await rig.rt.wait_idle()
    [parts] = harness.prompts
    assert [(e["name"], e.get("unavailableReason")) for e in files_block(parts)] == [
        ("a.txt", None),
        ("b.bin", "failed"),
        ("c.ogg", "failed"),
    ]
    notes = [p.text for p in parts if isinstance(p, TextPart) and "took too long" in p.text]
    assert len(notes) == 1


# --- the sweep ------------------------------------------------------------------------------


async def test_saved_files_are_swept_at_start_and_after_their_ttl(
    autojump_clock: trio.abc.Clock, tmp_path: Path
) -> None:
    ttl = 2 * 3600.0
    folder = tmp_path / "files" / "t" / "42"
    folder.mkdir(parents=True)
    old, recent = folder / "m0_1_old.txt", folder / "m0_2_recent.txt"
    for path, age in ((old, ttl + 60), (recent, 60)):
        path.write_bytes(b"x")
        os.utime(path, (T0 - age, T0 - age))
    elsewhere = tmp_path / "keep.txt"  # outside the bot's folder: never touched
    elsewhere.write_bytes(b"x")
    os.utime(elsewhere, (0, 0))
    other_bot = tmp_path / "files" / "other" / "c" / "f"
    other_bot.parent.mkdir(parents=True)
    other_bot.write_bytes(b"x")
    os.utime(other_bot, (0, 0))

    async def note(limit: int) -> bytes:
        return b"note"

    async with open_rig(tmp_path, files_ttl_s=ttl) as rig:
        await trio.sleep(1)
        assert not old.exists() and recent.exists()  # the sweep at start
        await rig.rt.accept(msg("keep", files=[MediaRef(name="n.txt", fetch=note)]))
        await rig.rt.wait_idle()
        [saved] = folder.glob("*_n.txt")
        await trio.sleep(ttl)  # the sweeps an hour apart: "recent" is now too old
        assert saved.exists() and not recent.exists()
        await trio.sleep(SWEEP_EVERY_S)
        assert not saved.exists() and not folder.exists()  # the folder went with it
    assert elsewhere.exists() and other_bot.exists()


async def test_the_sweep_never_follows_a_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "precious.txt"
    target.write_bytes(b"x")
    os.utime(target, (0, 0))
    stash = FileStash(tmp_path / "data", "b", ttl_s=10.0, clock=lambda: T0)
    conv = stash.conversation_dir("c")
    conv.mkdir(parents=True)
    (conv / "link").symlink_to(target)
    os.utime(conv / "link", (0, 0), follow_symlinks=False)
    (stash.root / "dirlink").symlink_to(outside, target_is_directory=True)
    assert await stash.sweep() == 1
    assert target.exists() and not (conv / "link").exists()
    assert (stash.root / "dirlink").is_symlink()


async def test_save_writes_0600_in_0700_folders_whatever_the_umask(tmp_path: Path) -> None:
    stash = FileStash(tmp_path, "b", ttl_s=10.0, clock=lambda: T0)
    previous = os.umask(0o002)
    try:
        path = await stash.save("c", "m1", 1, "a.txt", b"x" * 3_000_000)
    finally:
        os.umask(previous)
    assert content(path) == b"x" * 3_000_000
    assert_private(path, tmp_path)
    assert os.lstat(path).st_mtime == T0  # by the bot's clock: what the sweep compares
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no .part left


# --- names on disk --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        "..",
        ".",
        "",
        "../etc",
        "a/b",
        "a\\b",
        ".hidden",
        "x" * 300,
        "c2c:ABC",
        "o9@im.wechat",
        "a\x00b",
    ],
)
def test_a_conversation_is_one_safe_folder(value: str) -> None:
    name = safe_component(value)
    assert name and "/" not in name and "\\" not in name and "\x00" not in name
    assert not name.startswith(".") and len(name.encode()) <= 100


def test_conversation_folders_never_collide() -> None:
    values = ["a/b", "a_b", "a:b", "a b", "A/B", "..", ".", "_", "x" * 200, "x" * 201]
    assert len({safe_component(v) for v in values}) == len(values)
    assert safe_component("c2c_ABC-1.x") == "c2c_ABC-1.x"  # a plain id stays readable


@pytest.mark.parametrize(
    ("message_id", "index", "name"),
    [
        ("m1", 1, "../../etc/passwd"),
        ("m1", 1, "..\\..\\boot.ini"),
        ("u-ann/k1", 2, ".bashrc"),
        ("m1", 1, "a\u202egnp.exe"),
        ("m1", 1, "報告 2026.pdf"),
        ("m1", 1, "x" * 400 + ".pdf"),
        ("m1", 1, "é" * 300),
        ("m1", 1, "/"),
    ],
)
def test_a_file_name_on_disk_is_one_safe_component(message_id: str, index: int, name: str) -> None:
    got = disk_name(message_id, index, name)
    assert "/" not in got and "\\" not in got and not got.startswith(".")
    assert len(got.encode()) < 255
    assert not any(ord(c) < 32 or 0x202A <= ord(c) <= 0x202E for c in got)


def test_file_names_on_disk_never_collide() -> None:
    names = {
        disk_name("1", 1, "2_x"),
        disk_name("1_1", 2, "x"),
        disk_name("1", 12, "x"),
        disk_name("11", 2, "x"),
        disk_name("m1", 1, "a.txt"),
        disk_name("m1", 2, "a.txt"),
        disk_name("m2", 1, "a.txt"),
        disk_name("a/b", 1, "f"),
        disk_name("a-b", 1, "f"),
    }
    assert len(names) == 9
    assert disk_name("17", 1, "q3.pdf") == "17_1_q3.pdf"
    assert disk_name("m1", 1, "x" * 400 + ".pdf").endswith(".pdf")  # the extension is kept


def test_display_names_are_the_last_segment_single_line() -> None:
    assert display_name("../../etc/passwd") == "passwd"
    assert display_name("C:\\Users\\ann\\q3.pdf") == "q3.pdf"
    assert display_name("  two\nlines\u200b.txt ") == "two lines.txt"
    assert display_name("dir/") is None and display_name(None) is None
    assert display_name("..") is None and display_name("...") is None
    assert display_name("x" * 300) == "x" * 255


# --- downloads: too large without reading everything ----------------------------------------------


async def _too_large(handler: Callable[[trio.SocketStream], Awaitable[None]]) -> None:
    with trio.fail_after(5):
        async with trio.open_nursery() as nursery:
            base = await serve_raw(nursery, handler)
            async with open_http(base, user_agent="t") as http:
                with pytest.raises(TooLarge):
                    await download_capped(http, base + "/file", 1000)
            nursery.cancel_scope.cancel()


async def test_a_declared_size_over_the_limit_is_refused_before_the_body() -> None:
    """Too large is decided from Content-Length before any of the body is read: this
    server never sends it."""

    async def declared(stream: trio.SocketStream) -> None:
        with contextlib.suppress(EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            await read_request(stream, bytearray())
            await stream.send_all(b"HTTP/1.1 200 OK\r\nContent-Length: 30000000\r\n\r\n")
            await trio.sleep_forever()

    await _too_large(declared)


# httpx and httpcore leave their inner body generators to trio's finalizer when a streamed
# answer is abandoned midway (here: at the cap); the connection itself is closed.
@pytest.mark.filterwarnings(
    "ignore:Async generator 'http(x|core)\\..*was garbage collected:ResourceWarning"
)
async def test_an_undeclared_size_is_cut_at_the_limit_as_too_large() -> None:
    """Without Content-Length, reading stops at the cap: this answer never ends."""

    async def endless(stream: trio.SocketStream) -> None:
        with contextlib.suppress(EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
            await read_request(stream, bytearray())
            await stream.send_all(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            while True:
                await stream.send_all(b"258\r\n" + b"x" * 0x258 + b"\r\n")

    await _too_large(endless)


# --- configuration and replay ------------------------------------------------------------------


def test_the_two_file_options_per_bot() -> None:
    bot = parse_config({"bots": [{"name": "w", "channel": "webchat"}]}, env={}).bots[0]
    assert (bot.max_file_bytes, bot.files_ttl_s) == (20 * 1024 * 1024, 7 * 86400.0)
    table = {"name": "w", "channel": "webchat", "max_file_bytes": 5, "files_ttl_s": 60}
    bot = parse_config({"bots": [table]}, env={}).bots[0]
    assert (bot.max_file_bytes, bot.files_ttl_s) == (5, 60.0)
    for key, value in (("max_file_bytes", 0), ("files_ttl_s", 0), ("files_ttl_s", -1.0)):
        with pytest.raises(ConfigError, match=f"bots\\[0\\].{key}"):
            parse_config({"bots": [{"name": "w", "channel": "webchat", key: value}]}, env={})


def test_replay_saves_files_only_in_its_temporary_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.setenv("DSHIM_DATA_DIR", str(tmp_path / "data"))
    lines = run_fixture(FIXTURES / "webchat" / "attachments.json")
    [prompt] = [line for line in lines if line["kind"] == "prompt"]
    block = prompt["text"].rpartition("\n\n")[2]
    [entry] = json.loads(block[len("<dsh_im_files>") : -len("</dsh_im_files>")])
    assert entry["path"].startswith(f"{DATA_DIR_MARK}/files/replay/dm-ann/")
    assert list(tmp_path.iterdir()) == []  # nothing was written outside the run's own folder
