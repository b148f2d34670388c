"""The one backoff: exponential delays with jitter, sans-IO.

Every retry loop in dshim (the bot supervisor, channel readers, the streaming engine, the
harness adapters) asks a :class:`Backoff` how long to wait after a failure and resets it
after a success.  It never sleeps and never reads a clock: the caller owns time, so the
same object works on trio's autojump clock and in plain table tests.  Randomness comes
from an injected :class:`random.Random` so tests can pin it.

Delay after the n-th consecutive failure (n = 1, 2, ...)::

    base  = min(max_s, min_s * factor ** (n - 1))
    delay = base * (1 + jitter * (2 * rng.random() - 1))      # base ± jitter·base
    delay = max(delay, retry_after)   when the platform said how long to wait
    delay = clamp(delay, min_s, max(max_s, retry_after))

so with the defaults (1 s .. 30 s, factor 2, jitter 0.5) failures wait about 1, 2, 4, 8,
16, 30, 30 ... seconds, never less than ``min_s``: a failing loop can never spin.
"""

from __future__ import annotations

import random

__all__ = ["Backoff"]

#: The default source of jitter, shared: seeding a Random of its own reads os.urandom, a
#: system call per Backoff (the streaming engine makes one per answer).
_RNG = random.Random()


class Backoff:
    """Exponential backoff with jitter.  See the module docstring for the formula."""

    __slots__ = ("min_s", "max_s", "factor", "jitter", "failures", "_rng")

    def __init__(
        self,
        min_s: float = 1.0,
        max_s: float = 30.0,
        factor: float = 2.0,
        jitter: float = 0.5,
        *,
        rng: random.Random | None = None,
    ) -> None:
        if min_s < 0 or max_s < min_s:
            raise ValueError("need 0 <= min_s <= max_s")
        if factor < 1.0:
            raise ValueError("factor must be at least 1")
        if not 0.0 <= jitter < 1.0:
            raise ValueError("jitter must be in [0, 1)")
        self.min_s = min_s
        self.max_s = max_s
        self.factor = factor
        self.jitter = jitter
        #: Consecutive failures since the last :meth:`reset`.
        self.failures = 0
        self._rng = rng if rng is not None else _RNG

    def next_delay(self, *, retry_after: float | None = None) -> float:
        """Count one more failure and return how long to wait before the next attempt.

        ``retry_after`` (a platform's 429 or Retry-After) is honoured in full, also when it
        is longer than ``max_s``.
        """
        self.failures += 1
        base = min(self.max_s, self.min_s * self.factor ** min(self.failures - 1, 64))
        delay = base
        if self.jitter:
            delay = base * (1.0 + self.jitter * (2.0 * self._rng.random() - 1.0))
        delay = min(max(delay, self.min_s), self.max_s)
        if retry_after is not None and retry_after > delay:
            delay = retry_after
        return delay

    def reset(self) -> None:
        """A success: the next failure starts from ``min_s`` again."""
        self.failures = 0

    def __repr__(self) -> str:
        return (
            f"Backoff({self.min_s:g}..{self.max_s:g} s, x{self.factor:g}, "
            f"jitter {self.jitter:g}, failures={self.failures})"
        )
