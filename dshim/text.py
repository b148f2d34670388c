"""Text cleaning and escaping shared by the prompt, the quoted-reply layer and the
pipeline's gates: the ground floor (it imports nothing of dshim).

:func:`clean_text` is the one definition of what an agent never sees (control,
zero-width, bidi and BOM characters; CR line ends); :func:`single_line` adds one space
per whitespace run for names and ids; :func:`cut` limits in code points;
:func:`encode_block` writes a prompt block whose content cannot close (or open) a tag.
The exact rules are a contract with agents downstream (see :mod:`dshim.reply`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["REMOVED_CHARS", "clean_text", "cut", "encode_block", "single_line"]

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
_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026"})


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
