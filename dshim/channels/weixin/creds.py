"""Saved WeChat logins: ``<data dir>/weixin/<bot>.json``, file 0600, directory 0700.

``dshim login BOT`` writes the ``bot_token``, ``ilink_bot_id``, API ``baseurl`` and the
scanning user's ``ilink_user_id`` after a confirmed QR scan; ``serve`` and ``probe`` use
them when the bot's configuration has no ``token``.  Written atomically (temporary file,
then rename).  The token never appears in a message built here.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import msgspec
import trio

from dshim.errors import AuthError


class SavedLogin(msgspec.Struct, kw_only=True):
    """What a confirmed QR login leaves behind."""

    bot_token: str
    ilink_bot_id: str
    baseurl: str | None = None
    ilink_user_id: str | None = None
    saved_at: float = 0.0

    def __repr__(self) -> str:
        return f"SavedLogin(bot={self.ilink_bot_id!r}, baseurl={self.baseurl!r})"


_DECODER = msgspec.json.Decoder(SavedLogin)


def login_path(data_dir: Path, bot_name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", bot_name) or "bot"
    return data_dir / "weixin" / f"{safe}.json"


def _read(path: Path) -> SavedLogin | None:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise AuthError(f"saved WeChat login {path}: cannot read ({exc.strerror})") from None
    try:
        return _DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise AuthError(f"saved WeChat login {path} is damaged: run `dshim login` again") from None


def _write(path: Path, login: SavedLogin) -> None:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, msgspec.json.encode(login))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


async def load_login(data_dir: Path, bot_name: str) -> SavedLogin | None:
    """The bot's saved login, or None when it never logged in.

    Read on the trio thread: one small local file, once when a bot starts (a worker
    thread would let an autojump clock leap past deadlines in tests)."""
    await trio.lowlevel.checkpoint()
    return _read(login_path(data_dir, bot_name))


async def save_login(data_dir: Path, bot_name: str, login: SavedLogin) -> Path:
    """Save a login (0600 in a 0700 directory); returns the file."""
    if not login.saved_at:
        login.saved_at = time.time()
    path = login_path(data_dir, bot_name)
    await trio.lowlevel.checkpoint()
    _write(path, login)
    return path
