"""``until_ok``: a start-up identity call rides out transient failures, never fatal ones."""

from __future__ import annotations

import pytest
import trio

from dshim.backoff import Backoff
from dshim.channels.kit.retry import until_ok
from dshim.errors import AuthError, PermissionDenied, RateLimited, TransportError


class Script:
    def __init__(self, *outcomes: BaseException | str) -> None:
        self.outcomes = list(outcomes)
        self.at: list[float] = []

    async def __call__(self) -> str:
        self.at.append(trio.current_time())
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


async def test_transient_failures_back_off_then_succeed(autojump_clock: trio.abc.Clock) -> None:
    call = Script(TransportError("reset"), TransportError("5xx", status=502), "me")
    assert await until_ok("getMe", call, backoff=Backoff(jitter=0.0)) == "me"
    assert [round(b - a, 3) for a, b in zip(call.at, call.at[1:], strict=False)] == [1.0, 2.0]


async def test_a_rate_limit_waits_as_long_as_asked(autojump_clock: trio.abc.Clock) -> None:
    call = Script(RateLimited("slow down", retry_after=42.0), "me")
    assert await until_ok("getMe", call) == "me"
    assert call.at[1] - call.at[0] >= 42.0


@pytest.mark.parametrize("error", [AuthError("401"), PermissionDenied("403")])
async def test_credentials_that_cannot_work_end_at_once(
    autojump_clock: trio.abc.Clock, error: Exception
) -> None:
    call = Script(error, "never")
    with pytest.raises(AuthError):
        await until_ok("getMe", call)
    assert len(call.at) == 1


async def test_bugs_are_not_retried(autojump_clock: trio.abc.Clock) -> None:
    call = Script(TypeError("bug"), "never")
    with pytest.raises(TypeError):
        await until_ok("getMe", call)
    assert len(call.at) == 1
