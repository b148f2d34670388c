"""Decoding untrusted JSON at the edge: bounded depth, one event at a time.

Two hostile inputs break a naive decode and, with it, a whole bot:

- **nesting**: msgspec (like every recursive parser) raises ``RecursionError`` somewhere
  around 1,000 levels — earlier when the caller's stack is already deep — and nothing
  in a protocol loop should have to catch that.  :func:`decode` refuses input nested
  deeper than :data:`MAX_DEPTH` (far below the interpreter's limit, far above any real
  platform payload) with an ordinary :class:`msgspec.DecodeError`;
- **one bad element in a batch** (a lone surrogate escape ``"\\ud800"``, invalid UTF-8,
  a truncated object): decoding the batch as a whole fails for every event in it.
  :func:`split_array` cuts a JSON array into its elements' raw bytes *without*
  validating them, so each element is decoded — and, if bad, dropped — on its own.

Both scan the bytes with one regular expression (strings are skipped as tokens, so a
bracket inside a string never counts) and never recurse.  The common case costs one
``bytes.translate``: input with fewer brackets than the limit cannot be too deep.
"""

from __future__ import annotations

import re
from typing import TypeVar

import msgspec

__all__ = ["MAX_DEPTH", "decode", "depth_exceeds", "member", "member_span", "split_array"]

T = TypeVar("T")

#: Deepest nesting accepted from a platform (objects and arrays count one level each).
MAX_DEPTH = 64

# A JSON string token (escapes included; its content is not validated here) or one
# structural character.  Unrolled so that long strings cost no backtracking.
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{},]')
_OPEN = frozenset(b"[{")
_CLOSE = frozenset(b"]}")
#: Every byte but the two opening brackets: ``raw.translate(None, _NOT_OPENING)`` keeps
#: only the openers, in one pass (cheaper than two ``count`` calls).
_NOT_OPENING = bytes(b for b in range(256) if b not in b"[{")


def depth_exceeds(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """True when ``raw`` nests objects/arrays deeper than ``limit``."""
    if len(raw.translate(None, _NOT_OPENING)) <= limit:
        return False
    return _deeper_than(raw, limit)


def _deeper_than(raw: bytes, limit: int) -> bool:
    depth = 0
    for match in _TOKENS.finditer(raw):
        c = raw[match.start()]
        if c in _OPEN:
            depth += 1
            if depth > limit:
                return True
        elif c in _CLOSE:
            depth -= 1
    return False


def decode(decoder: msgspec.json.Decoder[T], raw: bytes | str, limit: int = MAX_DEPTH) -> T:
    """``decoder.decode(raw)`` with the nesting bounded.

    Raises :class:`msgspec.DecodeError` for too-deep input (also when the interpreter's
    own limit would be hit first) and :class:`msgspec.ValidationError` as msgspec does.
    """
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    # depth_exceeds, inlined: this runs for every event of every platform.
    if len(data.translate(None, _NOT_OPENING)) > limit and _deeper_than(data, limit):
        raise msgspec.DecodeError(f"JSON nested deeper than {limit} levels")
    try:
        return decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError(f"JSON nested too deeply (limit {limit})") from None


def split_array(raw: bytes) -> list[bytes]:
    """The raw bytes of each element of the JSON array ``raw``, in order.

    The elements are not validated (that is each one's own decode); only the array's
    structure is: ValueError when ``raw`` is not one balanced array.
    """
    start = _skip_space(raw, 0)
    if start >= len(raw) or raw[start] != ord("["):
        raise ValueError("not a JSON array")
    items: list[bytes] = []
    depth = 0
    item_start = start + 1
    for match in _TOKENS.finditer(raw, start):
        pos = match.start()
        c = raw[pos]
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
            if depth == 0:
                last = raw[item_start:pos].strip()
                if last:
                    items.append(last)
                elif items:
                    raise ValueError("a trailing comma in the array")
                if raw[pos + 1 :].strip():
                    raise ValueError("data after the array")
                return items
            if depth < 0:  # pragma: no cover - the first token is the opening bracket
                break
        elif c == ord(",") and depth == 1:
            item = raw[item_start:pos].strip()
            if not item:
                raise ValueError("an empty element in the array")
            items.append(item)
            item_start = pos + 1
    raise ValueError("the array is not closed")


def member(raw: bytes, key: str) -> bytes | None:
    """The raw bytes of the top-level member ``key`` of the JSON object ``raw``.

    Like :func:`split_array`, nothing inside is validated; None when there is no such
    member (or ``raw`` is not an object).  For envelopes whose payload must be split
    before it is decoded (``{"ok": true, "result": [...]}``).
    """
    span = member_span(raw, key)
    return raw[span[0] : span[1]] if span is not None else None


def member_span(raw: bytes, key: str) -> tuple[int, int] | None:
    """Where the value of the top-level member ``key`` of ``raw`` is: ``raw[start:end]``
    (whitespace trimmed), or None.  See :func:`member`."""
    start = _skip_space(raw, 0)
    if start >= len(raw) or raw[start] != ord("{"):
        return None
    wanted = msgspec.json.encode(key)
    depth = 0
    value_start: int | None = None
    expect_key = True
    for match in _TOKENS.finditer(raw, start):
        pos = match.start()
        c = raw[pos]
        if c == ord('"'):
            if depth == 1 and expect_key:
                expect_key = False
                if match.group() == wanted:
                    colon = raw.find(b":", match.end())
                    if colon < 0:
                        return None
                    value_start = colon + 1
            continue
        if c in _OPEN:
            depth += 1
        elif c in _CLOSE:
            depth -= 1
            if depth == 0:
                return _trimmed(raw, value_start, pos)
        elif c == ord(",") and depth == 1:
            if value_start is not None:
                return _trimmed(raw, value_start, pos)
            expect_key = True
    return None


def _trimmed(raw: bytes, start: int | None, end: int) -> tuple[int, int] | None:
    if start is None:
        return None
    start = _skip_space(raw, start)
    while end > start and raw[end - 1] in b" \t\r\n":
        end -= 1
    return (start, end) if end > start else None


def _skip_space(raw: bytes, pos: int) -> int:
    while pos < len(raw) and raw[pos] in b" \t\r\n":
        pos += 1
    return pos
