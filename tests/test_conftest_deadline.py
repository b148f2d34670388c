"""The suite's own safety net: a hanging trio test fails at its hard deadline."""

from __future__ import annotations

from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")


def test_hanging_trio_tests_fail_at_their_deadline(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST.read_text(encoding="utf-8"))
    pytester.makeini("[pytest]\ntrio_mode = true\n")
    pytester.makepyfile(
        test_hangs="""
import pytest
import trio

@pytest.mark.deadline(0.5)
async def test_real_clock_hang() -> None:
    await trio.sleep_forever()

async def test_autojump_hang(autojump_clock: object) -> None:
    await trio.sleep_forever()

async def test_own_timeout_is_not_mistaken_for_the_deadline() -> None:
    with pytest.raises(trio.TooSlowError):
        with trio.fail_after(0.01):
            await trio.sleep_forever()
"""
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", timeout=60)
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(["*HardDeadlineExceeded*0.5 s deadline*"])
