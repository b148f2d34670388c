"""Text cleaning and escaping shared by the prompt, the quoted-reply layer and the
pipeline's gates: the ground floor (it imports nothing of dshim).

:func:`clean_text` is the one definition of what an agent never sees (control,
zero-width, bidi and BOM characters; CR line ends); :func:`single_line` adds one space
per whitespace run for names and ids; :func:`cut` limits in code points;
:func:`encode_block` writes a prompt block whose content cannot close (or open) a tag.
The exact rules are a contract with agents downstream (see :mod:`dshim.reply`).

:func:`safe_component` makes an id one file name (saved files, capture folders): a
small alphabet, and a short hash of the original whenever it had to change, so two ids
never share a name and none reads as ``.`` or ``..``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "AUTHOR_NAME_MAX",
    "COMPONENT_MAX",
    "REMOVED_CHARS",
    "clean_text",
    "cut",
    "encode_block",
    "safe_component",
    "single_line",
]

_REMOVED_RANGES = (
    (0x0000, 0x0009),
    (0x000B, 0x000C),
    (0x000E, 0x001F),
    (0x007F, 0x009F),
    (0x200B, 0x200B),
    (0x200E, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x2064),
    (0x2066, 0x206F),
    (0xFEFF, 0xFEFF),
)
#: Every character :func:`clean_text` removes (tests and properties use it).
REMOVED_CHARS = frozenset(chr(c) for lo, hi in _REMOVED_RANGES for c in range(lo, hi + 1))
_REMOVED_RE = re.compile(
    "[" + "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in _REMOVED_RANGES) + "]+"
)
_WHITESPACE_RE = re.compile(r"\s+")
#: The longest name of a person an agent is told (a quote's author, a substitute's
#: asker), in code points.
AUTHOR_NAME_MAX = 256
_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})
#: The longest file name part :func:`safe_component` keeps of an id (before the hash).
COMPONENT_MAX = 80
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def clean_text(s: str) -> str:
    """CRLF/CR -> LF, remove control, zero-width, bidi and BOM characters, trim."""
    if "\r" in s:
        s = s.replace("\r\n", "\n").replace("\r", "\n")
    return _REMOVED_RE.sub("", s).strip()


def single_line(s: str) -> str:
    """:func:`clean_text`, then every whitespace run (newlines included) becomes one space."""
    return _WHITESPACE_RE.sub(" ", clean_text(s)).strip()


def cut(s: str, n: int) -> tuple[str, bool]:
    """Keep at most ``n`` code points; a cut is trimmed again.  Returns (text, was_cut)."""
    if len(s) <= n:
        return s, False
    return s[:n].strip(), True


def encode_block(tag: str, obj: Mapping[str, Any] | Sequence[Any]) -> str:
    """``<tag>`` + compact UTF-8 JSON with ``<``, ``>``, ``&`` as ``\\u003c`` ... + ``</tag>``.

    The escaping makes it impossible for any string inside to close (or open) a tag.
    """
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).translate(_ESCAPES)
    return f"<{tag}>{body}</{tag}>"


def safe_component(value: str, unsafe: re.Pattern[str] = _UNSAFE, replacement: str = "_") -> str:
    """``value`` as one file name: every character ``unsafe`` matches (by default all but
    ``A-Z a-z 0-9 . _ -``) becomes ``replacement``; a value that had to change, or is
    empty, long or starts with ``.``, gets a short hash of the original appended."""
    out = unsafe.sub(replacement, value)
    if out != value or not out or out.startswith(".") or len(out) > COMPONENT_MAX:
        # Changed: the hash of the original keeps two values apart.
        digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:12]
        out = f"{out[:COMPONENT_MAX].lstrip('.')}-{digest}".lstrip("-")
    return out
