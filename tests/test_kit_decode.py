"""Hostile JSON at the edge: nesting is bounded, batches split without validating."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from dshim.channels.kit.decode import MAX_DEPTH, decode, depth_exceeds, member, split_array


class View(msgspec.Struct):
    a: int = 0


VIEW = msgspec.json.Decoder(View)


def nested(depth: int) -> bytes:
    return b'{"a":1,"x":' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("depth", [MAX_DEPTH, MAX_DEPTH + 1, 982, 5000, 200_000])
def test_deep_input_is_an_ordinary_decode_error(depth: int) -> None:
    raw = nested(depth)
    if depth + 1 <= MAX_DEPTH:
        assert decode(VIEW, raw).a == 1
    else:
        with pytest.raises(msgspec.DecodeError, match="nested"):
            decode(VIEW, raw)


def test_brackets_inside_strings_do_not_count() -> None:
    text = "[" * 500 + '\\"{' * 300
    raw = json.dumps({"a": 2, "s": text}).encode()
    assert not depth_exceeds(raw)
    assert decode(VIEW, raw).a == 2


def test_a_batch_splits_into_raw_elements_even_when_one_is_invalid() -> None:
    raw = b' [ {"a":1}, {"a":"\\ud800"} ,{"a":3,"s":"x,]y"}, [1,[2]] , 7 ] '
    items = split_array(raw)
    assert items == [b'{"a":1}', b'{"a":"\\ud800"}', b'{"a":3,"s":"x,]y"}', b"[1,[2]]", b"7"]
    with pytest.raises(msgspec.DecodeError):
        decode(VIEW, items[1])
    assert decode(VIEW, items[2]).a == 3
    assert split_array(b"[]") == []


@pytest.mark.parametrize("bad", [b"{}", b"[1,2", b"[1,,2]", b"[1,]", b"[1] x", b"", b"[{]"])
def test_broken_arrays_are_refused(bad: bytes) -> None:
    with pytest.raises(ValueError):
        split_array(bad)


def test_member_finds_a_top_level_value_without_validating_it() -> None:
    raw = b'{"ok":true,"x":{"result":[0]},"result":[{"a":"\\ud800"},{"a":2}],"z":1}'
    assert member(raw, "result") == b'[{"a":"\\ud800"},{"a":2}]'
    assert member(raw, "ok") == b"true"
    assert member(raw, "missing") is None
    assert member(b"[1]", "result") is None


@given(
    st.recursive(st.integers() | st.text(), lambda c: st.lists(c) | st.dictionaries(st.text(), c))
)
def test_split_array_agrees_with_the_json_module(value: object) -> None:
    items = [value, value, {"k": value}]
    raw = json.dumps(items).encode()
    assert [json.loads(i) for i in split_array(raw)] == items
