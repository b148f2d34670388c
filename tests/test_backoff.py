"""The one backoff: growth, cap, jitter bounds, retry-after, reset."""

from __future__ import annotations

import random

import pytest

from dshim.backoff import Backoff


class Fixed(random.Random):
    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def random(self) -> float:
        return self.value


def test_delays_double_up_to_the_cap_without_jitter() -> None:
    b = Backoff(1.0, 30.0, 2.0, 0.0)
    assert [b.next_delay() for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert b.failures == 7


def test_jitter_stays_within_its_band_and_never_below_the_minimum() -> None:
    low = Backoff(1.0, 30.0, 2.0, 0.5, rng=Fixed(0.0))
    high = Backoff(1.0, 30.0, 2.0, 0.5, rng=Fixed(0.999999))
    assert [round(low.next_delay(), 3) for _ in range(4)] == [1.0, 1.0, 2.0, 4.0]
    assert [round(high.next_delay(), 2) for _ in range(6)] == [1.5, 3.0, 6.0, 12.0, 24.0, 30.0]
    many = Backoff(rng=random.Random(3))
    assert all(1.0 <= many.next_delay() <= 30.0 for _ in range(200))


def test_retry_after_is_honoured_in_full() -> None:
    b = Backoff(1.0, 30.0, jitter=0.0)
    assert b.next_delay(retry_after=90.0) == 90.0
    assert b.next_delay(retry_after=0.2) == 2.0  # never shorter than the backoff


def test_reset_starts_over() -> None:
    b = Backoff(jitter=0.0)
    for _ in range(5):
        b.next_delay()
    b.reset()
    assert b.next_delay() == 1.0


@pytest.mark.parametrize(
    "kwargs", [{"min_s": -1}, {"min_s": 5, "max_s": 1}, {"factor": 0.5}, {"jitter": 1.0}]
)
def test_nonsense_parameters_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Backoff(**kwargs)
