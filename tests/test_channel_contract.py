"""Every channel passes the shared scenarios of ``tests/channel_contract.py``.

The rigs are found by convention, one per channel of the registry:
``tests/rig_<key>.py`` defines the class ``<key>Rig`` (any capitalisation: ``QQRig``,
``WhatsAppRig``), which builds a :class:`~tests.channel_contract.ChannelRig`.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from dshim.channels.registry import CHANNEL_KEYS
from tests.channel_contract import SCENARIOS, ChannelRig

TESTS = Path(__file__).resolve().parent


def rig_of(key: str) -> Callable[[], ChannelRig]:
    """The rig class of ``tests/rig_<key>.py``; a failure that says what is missing."""
    if not (TESTS / f"rig_{key}.py").is_file():
        pytest.fail(
            f"channel {key!r} has no test rig: write tests/rig_{key}.py with a class "
            f"{key}Rig (any capitalisation) that runs the channel against its fake"
        )
    module = importlib.import_module(f"tests.rig_{key}")
    found = [
        value
        for name, value in vars(module).items()
        if name.lower() == f"{key}rig" and isinstance(value, type)
    ]
    if len(found) != 1:
        pytest.fail(f"tests/rig_{key}.py defines no class {key}Rig (any capitalisation)")
    rig: Callable[[], ChannelRig] = found[0]
    return rig


RIGS: dict[str, Callable[[], ChannelRig]] = {key: rig_of(key) for key in CHANNEL_KEYS}


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.__name__ for s in SCENARIOS])
@pytest.mark.parametrize("channel", sorted(RIGS))
async def test_contract(
    channel: str,
    scenario: Callable[[ChannelRig, Path], Awaitable[None]],
    autojump_clock: trio.abc.Clock,
    tmp_path: Path,
) -> None:
    await scenario(RIGS[channel](), tmp_path)
