"""Shared pytest set-up: a hard deadline on every trio test.

Every ``async def`` test gets a watchdog in its trio run: when the deadline passes, the
test is cancelled and fails with :class:`HardDeadlineExceeded` instead of hanging CI.
The deadline is on trio's clock: real seconds on the real clock, virtual seconds on the
autojump clock (where a hang jumps straight to the deadline, so it fails at once).
``@pytest.mark.deadline(seconds)`` sets another limit for one test.

``pg_cluster``: a throwaway PostgreSQL cluster for the session (:mod:`tests.pgkit`),
started when a test first asks for it; without PostgreSQL the test fails, saying what to
install (never skipped).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Iterator
from typing import TYPE_CHECKING

import pytest
import trio

if TYPE_CHECKING:
    from tests.pgkit import PgCluster

pytest_plugins = ("pytester",)

#: Real seconds: generous for a loaded 2-core CI machine, far below "stalled".
REAL_CLOCK_DEADLINE_S = 90.0
#: Virtual seconds: above the longest waits the tests script (429 budgets, backoffs).
AUTOJUMP_DEADLINE_S = 4 * 3600.0


class HardDeadlineExceeded(Exception):
    """The test ran past its hard deadline."""


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "deadline(seconds): the hard deadline of this trio test (trio's clock)"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if isinstance(item, pytest.Function) and inspect.iscoroutinefunction(item.obj):
            item.obj = _with_deadline(item.obj, _deadline_of(item))


def _deadline_of(item: pytest.Function) -> float:
    marker = item.get_closest_marker("deadline")
    if marker is not None:
        return float(marker.args[0])
    if {"autojump_clock", "mock_clock"} & set(item.fixturenames):
        return AUTOJUMP_DEADLINE_S
    return REAL_CLOCK_DEADLINE_S


def _with_deadline(
    fn: Callable[..., Awaitable[object]], limit: float
) -> Callable[..., Awaitable[object]]:
    """The test body under ``trio.fail_after(limit)`` (fixtures are set up outside it)."""

    @functools.wraps(fn)
    async def run_with_deadline(*args: object, **kwargs: object) -> object:
        with trio.move_on_after(limit) as scope:
            return await fn(*args, **kwargs)
        assert scope.cancelled_caught
        raise HardDeadlineExceeded(f"the test ran past its {limit:g} s deadline")

    return run_with_deadline


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[PgCluster]:
    """The session's throwaway PostgreSQL cluster (stopped and removed at its end)."""
    from tests.pgkit import PostgresMissing, start_cluster

    try:
        cluster = start_cluster()
    except PostgresMissing as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield cluster
    finally:
        cluster.stop()
