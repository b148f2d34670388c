"""The shared id and time checks of ``dshim.channels.kit.ids`` (table tests)."""

from __future__ import annotations

import math

import pytest

from dshim.channels.kit.ids import (
    DIGITS,
    MAX_ID_CHARS,
    TOKEN,
    BadId,
    BadTime,
    check_id,
    check_optional_id,
    check_time,
    plausible_time,
    shape,
    valid_id,
)

WORD = shape("word", f"[{TOKEN}.]+")


@pytest.mark.parametrize("good", ["om_dc13264520392913993dd051dba21dcf", "a", "x" * MAX_ID_CHARS])
def test_ids_of_the_shape_up_to_512_characters_pass(good: str) -> None:
    assert check_id(good, WORD, "message_id") == good
    assert valid_id(good, WORD)


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "x" * (MAX_ID_CHARS + 1),
        "x" * 70_000,
        "a b",
        "a\nb",
        "a\x00b",
        "../x",
        "a/b",
        "a?b",
        "a#b",
        ".",
        "..",
        "引用",
        "\u200bx",
    ],
)
def test_other_ids_are_refused_without_repeating_them(bad: str) -> None:
    assert not valid_id(bad, WORD)
    with pytest.raises(BadId) as exc:
        check_id(bad, WORD, "message_id")
    assert str(exc.value).startswith("message_id: ")
    if len(bad) > 3:
        assert bad not in str(exc.value)
    assert isinstance(exc.value, ValueError)  # what the channels' decode already drops


def test_digits_and_optional_ids() -> None:
    assert valid_id("1234567890123456789", DIGITS)
    assert not valid_id("12a", DIGITS) and not valid_id("-1", DIGITS)
    assert check_optional_id(None, DIGITS, "f") is None
    assert check_optional_id("", DIGITS, "f") is None
    with pytest.raises(BadId):
        check_optional_id("x", DIGITS, "f")
    assert not valid_id(None, DIGITS)


@pytest.mark.parametrize("good", [0.0, 1.0, 1_795_000_000.0, 4_102_444_800.0])
def test_plausible_times_pass(good: float) -> None:
    assert plausible_time(good) and check_time(good, "t") == good


@pytest.mark.parametrize("bad", [-1.0, 16407412978094929.299, 4_102_444_801.0, math.inf, math.nan])
def test_absurd_times_are_refused(bad: float) -> None:
    assert not plausible_time(bad)
    with pytest.raises(BadTime):
        check_time(bad, "timestamp")
