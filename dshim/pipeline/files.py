"""The current attachments that are not images, saved where the agent can read them.

Theory of operation
-------------------
A turn downloads every current non-image attachment (within the bot's
``max_file_bytes``) and saves it under the data directory::

    <data_dir>/files/<bot>/<conversation>/<message>_<n>_<name>

Directories are mode 0700, files 0600.  Every part of that path comes from
:func:`dshim.text.safe_component` / :func:`disk_name`, never from a name as the platform
gave it:

- ``<bot>`` and ``<conversation>`` keep ``A-Z a-z 0-9 . _ -`` and turn anything else
  into ``_``; a value that had to change (or is long, or starts with ``.``) gets a
  short hash of the original appended, so two conversations never share a directory
  and no value reads as ``.`` or ``..``;
- the file name is ``<message id>_<n>_<name>``: the message id in the same alphabet
  without ``_`` (so the first ``_`` ends it), ``n`` the file's 1-based position among
  the message's files, then the user's file name reduced to its last path segment with
  separators, control characters and leading dots removed.  Two files of one message,
  or of two messages, never get the same name; the same message run again (after a
  restart) writes the same names again.

A file is written to ``.<name>.part`` first and renamed when complete, so the agent
never sees half a file; its modification time is set from the bot's clock, and the
sweep (:meth:`FileStash.sweep`, at start and every :data:`SWEEP_EVERY_S`) removes
what is older than ``files_ttl_s`` by that clock, then the directories left empty.
The sweep never follows a symbolic link.

All file system work runs on the trio thread, in slices with a checkpoint between
them: a worker thread would let the test suite's autojump clock leap over a turn's
deadlines while it runs, and a write of a few MB to the page cache is short.
"""

from __future__ import annotations

import mimetypes
import os
import re
import stat
import unicodedata
from collections.abc import Callable
from pathlib import Path

import structlog
import trio

from dshim.text import cut, safe_component, single_line

__all__ = [
    "FILES_DIR",
    "SWEEP_EVERY_S",
    "FileStash",
    "disk_name",
    "display_name",
    "media_type",
]

log = structlog.get_logger("dshim.files")

#: The folder of the data directory that holds saved attachments.
FILES_DIR = "files"
#: How often a running bot sweeps its saved attachments (and once at start).
SWEEP_EVERY_S = 3600.0
#: Bytes written between two checkpoints.
WRITE_SLICE = 1024 * 1024
#: Directory entries looked at between two checkpoints of a sweep.
SWEEP_SLICE = 256
#: The longest display name (code points), as for a quoted attachment's name.
DISPLAY_NAME_MAX = 255
#: The longest user-given part of a name on disk (UTF-8 bytes; the whole stays < 255).
DISK_NAME_MAX = 150

_UNSAFE_ID = re.compile(r"[^A-Za-z0-9.-]")
#: Characters a file name on disk never keeps (separators, shell and Windows specials).
_NAME_UNSAFE = re.compile(r'[/\\<>:"|?*\x00-\x1f\x7f]')
_MEDIA_TYPE = re.compile(r"^[a-z0-9][a-z0-9!#$&^_.+-]*/[a-z0-9][a-z0-9!#$&^_.+-]*$")


def _without_controls(text: str) -> str:
    return "".join(c for c in text if unicodedata.category(c) not in ("Cc", "Cf", "Zl", "Zp"))


def display_name(name: str | None) -> str | None:
    """A file name as the agent is told it: its last path segment (``\\`` counts as
    ``/``), without control or format characters, trimmed, at most 255 code points;
    None when nothing is left (or only dots: ``..`` names no file)."""
    if not name:
        return None
    base = name.replace("\\", "/").rpartition("/")[2]
    text, _ = cut(single_line(base), DISPLAY_NAME_MAX)
    text = _without_controls(text)
    return text if text.strip(".") else None


def _cut_bytes(text: str, limit: int) -> str:
    """``text`` within ``limit`` UTF-8 bytes, its extension kept when it has a short one."""
    if len(text.encode("utf-8", "surrogatepass")) <= limit:
        return text
    stem, dot, ext = text.rpartition(".")
    suffix = f".{ext}" if dot and stem and len(ext) <= 16 else ""
    head = text[: len(text) - len(suffix)] if suffix else text
    room = limit - len(suffix.encode("utf-8", "surrogatepass"))
    encoded = head.encode("utf-8", "surrogatepass")[:room]
    return encoded.decode("utf-8", "ignore") + suffix


def disk_name(message_id: str, index: int, name: str) -> str:
    """The name on disk of the ``index``-th (1-based) attachment ``name`` of a message."""
    clean = _NAME_UNSAFE.sub("_", _without_controls(name)).strip().lstrip(".") or "file"
    message = safe_component(message_id, _UNSAFE_ID, "-")
    return f"{message}_{index}_{_cut_bytes(clean, DISK_NAME_MAX)}"


def media_type(mime: str | None, name: str) -> str:
    """The attachment's media type: as the platform gave it (``type/subtype`` only, lower
    case), else guessed from the name, else ``application/octet-stream``."""
    if mime:
        given = mime.split(";", 1)[0].strip().lower()
        if _MEDIA_TYPE.match(given):
            return given
    guessed, _ = mimetypes.guess_type(name, strict=False)
    return guessed or "application/octet-stream"


def default_name(kind: str, index: int, mime: str | None) -> str:
    """The name of an attachment the platform gave none: ``<kind>-<n>`` and an extension
    from its media type when one is known (``audio-1.ogg``)."""
    ext = mimetypes.guess_extension(mime.split(";", 1)[0].strip().lower()) if mime else None
    return f"{kind}-{index}{ext or ''}"


# --- the blocking parts (run on the trio thread in slices) ------------------------------------


def _make_dirs(root: Path, parts: tuple[str, ...]) -> Path:
    """``root/parts...``, each created with mode 0700 (and set so when it was not)."""
    path = root
    for part in parts:
        path = path / part
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                raise NotADirectoryError(f"{path} is not a directory") from None
            if stat.S_IMODE(st.st_mode) != 0o700:
                os.chmod(path, 0o700)
        else:
            os.chmod(path, 0o700)  # whatever the umask made of it
    return path


def _open_part(path: Path) -> int:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.fchmod(fd, 0o600)
    return fd


def _write_slice(fd: int, view: memoryview) -> int:
    return os.write(fd, view)


def _finish(fd: int, part: Path, final: Path, mtime: float) -> None:
    os.close(fd)
    os.utime(part, (mtime, mtime), follow_symlinks=False)
    os.replace(part, final)


def _discard(fd: int, part: Path) -> None:
    os.close(fd)
    try:
        os.unlink(part)
    except FileNotFoundError:
        pass


def _entries(path: Path) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _remove_if_old(entry: os.DirEntry[str], cutoff: float) -> bool:
    """Remove a file (or link) older than ``cutoff``; True when it was removed."""
    try:
        st = entry.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode) or st.st_mtime >= cutoff:
            return False
        os.unlink(entry.path)
    except FileNotFoundError:
        return False
    return True


def _remove_if_empty(path: str) -> None:
    try:
        os.rmdir(path)
    except OSError:  # not empty (or gone): kept
        pass


class FileStash:
    """One bot's saved attachments: ``<data_dir>/files/<bot>/`` (see the module docstring).

    ``clock`` gives epoch seconds (the bot's clock): it stamps saved files and decides
    what the sweep removes.
    """

    def __init__(
        self, data_dir: Path, bot: str, *, ttl_s: float, clock: Callable[[], float]
    ) -> None:
        self.data_dir = data_dir
        self.bot = bot
        self.ttl_s = ttl_s
        self.clock = clock

    @property
    def root(self) -> Path:
        """This bot's folder (absolute)."""
        return self.data_dir.absolute() / FILES_DIR / safe_component(self.bot)

    def conversation_dir(self, conversation_id: str) -> Path:
        return self.root / safe_component(conversation_id)

    async def save(
        self, conversation_id: str, message_id: str, index: int, name: str, data: bytes
    ) -> Path:
        """Write one attachment; returns its absolute path.  Raises OSError."""
        folder = _make_dirs(
            self.data_dir.absolute(),
            (FILES_DIR, safe_component(self.bot), safe_component(conversation_id)),
        )
        final = folder / disk_name(message_id, index, name)
        part = folder / f".{final.name}.part"
        fd = _open_part(part)
        try:
            view = memoryview(data)
            offset = 0
            while offset < len(view):
                offset += _write_slice(fd, view[offset : offset + WRITE_SLICE])
                await trio.lowlevel.checkpoint()
        except BaseException:
            _discard(fd, part)
            raise
        _finish(fd, part, final, self.clock())
        return final

    async def sweep(self) -> int:
        """Remove saved files older than ``ttl_s`` and the folders left empty; returns
        how many files were removed.  Never raises for a file that vanished meanwhile."""
        cutoff = self.clock() - self.ttl_s
        removed = seen = 0
        root = self.root
        for conv in _entries(root):
            if not conv.is_dir(follow_symlinks=False):
                continue
            for entry in _entries(Path(conv.path)):
                removed += _remove_if_old(entry, cutoff)
                seen += 1
                if seen % SWEEP_SLICE == 0:
                    await trio.lowlevel.checkpoint()
            _remove_if_empty(conv.path)
        await trio.lowlevel.checkpoint()
        if removed:
            log.info("files_swept", removed=removed)
        return removed

    async def run_sweeper(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Sweep now, then every :data:`SWEEP_EVERY_S` (or ``ttl_s``, when shorter), for
        as long as the bot runs.  A sweep that fails is logged and tried again later."""
        task_status.started()
        while True:
            try:
                await self.sweep()
            except OSError as exc:
                log.warning(
                    "files_sweep_failed", error=f"{type(exc).__name__}: {exc.strerror or exc}"
                )
            await trio.sleep(min(SWEEP_EVERY_S, self.ttl_s))
