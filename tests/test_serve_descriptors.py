"""``dshim serve`` and the descriptor limit: each bot holds a connection of its own, so
the soft ``RLIMIT_NOFILE`` is raised to the hard one at the start, and a limit too low
for the configured bots is said clearly in the log."""

from __future__ import annotations

import resource

import pytest
from structlog.testing import capture_logs

from dshim.serve import BASE_DESCRIPTORS, raise_descriptor_limit


class Limits:
    """``getrlimit`` / ``setrlimit`` for RLIMIT_NOFILE, in memory."""

    def __init__(self, soft: int, hard: int) -> None:
        self.soft, self.hard = soft, hard
        self.set_to: list[tuple[int, int]] = []

    def get(self, which: int) -> tuple[int, int]:
        assert which == resource.RLIMIT_NOFILE
        return self.soft, self.hard

    def set(self, which: int, limits: tuple[int, int]) -> None:
        assert which == resource.RLIMIT_NOFILE
        self.set_to.append(limits)
        self.soft, self.hard = limits


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch) -> Limits:
    fake = Limits(1024, 1024)
    monkeypatch.setattr(resource, "getrlimit", fake.get)
    monkeypatch.setattr(resource, "setrlimit", fake.set)
    return fake


def test_the_soft_limit_is_raised_to_the_hard_one(limits: Limits) -> None:
    limits.soft, limits.hard = 1024, 524288
    with capture_logs() as logs:
        found = raise_descriptor_limit(1000)
    assert limits.set_to == [(524288, 524288)]
    assert found is not None and found.soft == 524288
    assert found.needed == BASE_DESCRIPTORS + 1000 and found.wanted == BASE_DESCRIPTORS + 2000
    assert logs == []  # nothing to say


def test_a_hard_limit_below_one_connection_per_bot_is_an_error_in_the_log(
    limits: Limits,
) -> None:
    limits.soft, limits.hard = 256, 1024
    with capture_logs() as logs:
        raise_descriptor_limit(10_000)
    assert limits.set_to == [(1024, 1024)]
    (entry,) = logs
    assert entry["event"] == "descriptor_limit_too_low" and entry["log_level"] == "error"
    assert entry["limit"] == 1024 and entry["needed"] == BASE_DESCRIPTORS + 10_000
    assert "ulimit -n" in entry["detail"] and "10000 bots" in entry["detail"]


def test_a_limit_with_no_room_for_a_second_connection_is_a_warning(limits: Limits) -> None:
    limits.soft = limits.hard = 1500
    with capture_logs() as logs:
        raise_descriptor_limit(1000)
    assert limits.set_to == []  # already at the hard limit
    assert [(e["event"], e["log_level"]) for e in logs] == [("descriptor_limit_low", "warning")]


def test_a_few_bots_under_the_usual_limit_say_nothing(limits: Limits) -> None:
    with capture_logs() as logs:
        raise_descriptor_limit(9)
    assert logs == []


def test_a_limit_that_cannot_be_raised_is_logged_and_kept(
    limits: Limits, monkeypatch: pytest.MonkeyPatch
) -> None:
    limits.soft, limits.hard = 256, 4096

    def refuse(which: int, values: tuple[int, int]) -> None:
        raise ValueError("not allowed")

    monkeypatch.setattr(resource, "setrlimit", refuse)
    with capture_logs() as logs:
        found = raise_descriptor_limit(500)
    assert found is not None and found.soft == 256
    assert [e["event"] for e in logs] == ["descriptor_limit_not_raised", "descriptor_limit_too_low"]
