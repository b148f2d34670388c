"""What the ``dshim probe`` tests of the channels share.

Each test runs the probe the way the command line does: a real config file for one bot
(its secret from the environment) against the channel's fake on 127.0.0.1, within a hard
deadline; assertions read the probe's rows.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trio

from dshim.probe import ProbeRow, _probe, format_table

F = TypeVar("F")


def row(rows: list[ProbeRow], check: str) -> ProbeRow:
    """The one row of a check."""
    [found] = [r for r in rows if r.check == check]
    return found


def write_config(path: Path, bot: dict[str, Any], more: str = "") -> Path:
    """``path/dshim.toml`` with one ``[[bots]]`` table (strings, numbers, booleans) and
    ``more`` TOML after it."""
    lines = ["[[bots]]"] + [f"{key} = {json.dumps(value)}" for key, value in bot.items()]
    config = path / "dshim.toml"
    config.write_text("\n".join(lines) + "\n" + more, encoding="utf-8")
    return config


@asynccontextmanager
async def probed_fake(
    open_fake: Callable[..., AbstractAsyncContextManager[F]],
    deadline: float,
    env: str,
    secret_of: Callable[[F], str],
    monkeypatch: pytest.MonkeyPatch,
    secret: str | None = None,
    **options: Any,
) -> AsyncIterator[F]:
    """The fake (``open_fake(**options)``) of one probe test, within ``deadline``, with
    the bot's secret in the environment variable ``env``: the one the fake knows
    (``secret_of``), or ``secret``.  A channel's tests bind the first four."""
    with trio.fail_after(deadline):
        async with open_fake(**options) as fake:
            monkeypatch.setenv(env, secret if secret is not None else secret_of(fake))
            yield fake


async def probe_until_closed(fake: Any, config: Path, data_dir: Path) -> tuple[list[ProbeRow], int]:
    """Probe every bot (no send test), then wait until the probe's connection is closed."""
    rows, code = await _probe(config, data_dir, None, False)
    await fake.wait_until(
        lambda: bool(fake.connections) and fake.connections[0].closed_by is not None
    )
    return rows, code


async def probe_rows(
    config: Path, bot: str, *, secrets: Sequence[str], send_test: bool = False
) -> tuple[dict[str, ProbeRow], int]:
    """Probe one bot (the data directory is the config's), check that the printed table
    shows none of ``secrets``, and give the rows by check, and the exit code."""
    rows, code = await _probe(config, None, bot, send_test)
    table = format_table(rows)
    assert not [s for s in secrets if s in table]
    return {r.check: r for r in rows}, code
