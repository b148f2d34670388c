"""Platform channels: one package per platform, imported lazily by key.

``dshim/channels/<key>/channel.py`` ends with ``CHANNEL = <Key>Channel()``, an object
satisfying :class:`dshim.channels.base.Channel` (read that module's docstring for the
rules every channel follows).  :func:`load_channel` imports it on demand, so that
``dshim --help`` and the configuration of other channels never import it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from dshim.config import CHANNEL_KEYS
from dshim.errors import ConfigError

if TYPE_CHECKING:
    from dshim.channels.base import Channel


def load_channel(key: str) -> Channel:
    """Import ``dshim.channels.<key>.channel`` and return its ``CHANNEL``.

    A ConfigError (without a traceback for the user) when the key is unknown or the channel
    is not part of this version of dshim yet.
    """
    from dshim.channels.base import Channel

    if key not in CHANNEL_KEYS:
        raise ConfigError(f"unknown channel {key!r}; expected one of {', '.join(CHANNEL_KEYS)}")
    try:
        module = importlib.import_module(f"dshim.channels.{key}.channel")
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith(f"dshim.channels.{key}"):
            raise ConfigError(
                f"channel {key!r} is not available in this version of dshim yet"
            ) from None
        raise
    channel = getattr(module, "CHANNEL", None)
    if not isinstance(channel, Channel) or channel.key != key:
        raise TypeError(f"dshim.channels.{key}.channel.CHANNEL is not the {key!r} Channel")
    return channel
