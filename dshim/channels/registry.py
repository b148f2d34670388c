"""The channel registry: the channels dshim has, found from their specs, never hand-kept.

A channel is a subpackage of :mod:`dshim.channels` with a ``spec`` module (see
:mod:`dshim.channels.spec`); :data:`SPECS` holds their entries in ``position`` order and
everything that lists channels reads it: :data:`CHANNEL_KEYS`, the configuration's key
check, :func:`starter_toml` (``dshim init``), the log redactor's token patterns, and the
tests' and benches' lists.  Finding them imports only the light ``spec`` modules;
:func:`load_channel` imports a channel's ``channel.py`` on demand, so that ``dshim
--help`` and the configuration of other channels never import it.

``dshim.config`` does not import channels: :data:`CATALOG` is what its parser needs of
them, and :func:`parse_config`, :func:`load_config` and :func:`default_config` here are
config's with the catalog handed in -- the ones to call.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import pkgutil
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

import dshim.channels
from dshim import config
from dshim.channels.spec import RegistryEntry
from dshim.errors import ConfigError

if TYPE_CHECKING:
    from dshim.channels.base import Channel

__all__ = [
    "CATALOG",
    "CHANNEL_KEYS",
    "SPECS",
    "default_config",
    "load_channel",
    "load_config",
    "parse_config",
    "settings_for",
    "spec",
    "starter_toml",
]

#: Subpackages of dshim.channels that are no channel.
_NOT_CHANNELS = frozenset({"kit"})


def _discover() -> tuple[RegistryEntry, ...]:
    """Every ``dshim.channels.<key>.spec.SPEC``, by position; TypeError on a bad spec."""
    found: list[RegistryEntry] = []
    for module in pkgutil.iter_modules(dshim.channels.__path__):
        if not module.ispkg or module.name in _NOT_CHANNELS:
            continue
        name = f"dshim.channels.{module.name}.spec"
        # Looked for as a file: finding the module would import the package, and a
        # package without a spec (a channel being written) is not a channel yet.
        folder = getattr(module.module_finder, "path", None)
        if folder is None or not (Path(folder) / module.name / "spec.py").is_file():
            continue
        entry = getattr(importlib.import_module(name), "SPEC", None)
        if not isinstance(entry, RegistryEntry) or entry.key != module.name:
            raise TypeError(f"{name}.SPEC is not the {module.name!r} RegistryEntry")
        found.append(entry)
    found.sort(key=lambda e: e.position)
    for before, after in zip(found, found[1:], strict=False):
        if before.position == after.position:
            raise TypeError(
                f"channels {before.key!r} and {after.key!r} have the same position "
                f"{before.position}"
            )
    return tuple(found)


#: Every channel's entry, in position order.
SPECS: tuple[RegistryEntry, ...] = _discover()
#: The ``channel`` values a ``[[bots]]`` table may name, in position order.
CHANNEL_KEYS: tuple[str, ...] = tuple(entry.key for entry in SPECS)
_BY_KEY = {entry.key: entry for entry in SPECS}


def _unknown(key: str) -> ConfigError:
    return ConfigError(f"unknown channel {key!r}; expected one of {', '.join(CHANNEL_KEYS)}")


def spec(key: str) -> RegistryEntry:
    """The registry entry of channel ``key``; ConfigError when there is none."""
    try:
        return _BY_KEY[key]
    except KeyError:
        raise _unknown(key) from None


def load_channel(key: str) -> Channel:
    """Import ``dshim.channels.<key>.channel`` and return its ``CHANNEL``.

    A ConfigError (without a traceback for the user) when the key is unknown or the channel
    is not part of this version of dshim yet.
    """
    from dshim.channels.base import Channel

    if key not in _BY_KEY:
        raise _unknown(key)
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


def settings_for(key: str) -> type[msgspec.Struct]:
    """Channel ``key``'s settings struct (imports the channel)."""
    return load_channel(key).settings


#: What the configuration parser knows of channels.
CATALOG = config.ChannelCatalog(
    keys=CHANNEL_KEYS,
    settings_for=settings_for,
    webhook_only={entry.key: entry.title for entry in SPECS if entry.webhook_only},
    resolves_email=frozenset(entry.key for entry in SPECS if entry.resolves_email),
)


def parse_config(
    raw: dict[str, Any],
    *,
    label: str = "dshim.toml",
    env: typing.Mapping[str, str],
    channel_settings: bool = True,
) -> config.Config:
    """:func:`dshim.config.parse_config` with the registry's channels."""
    return config.parse_config(
        raw, label=label, env=env, channels=CATALOG, channel_settings=channel_settings
    )


def load_config(
    path: str | os.PathLike[str], env: typing.Mapping[str, str] | None = None
) -> config.Config:
    """:func:`dshim.config.load_config` with the registry's channels."""
    return config.load_config(path, env, channels=CATALOG)


def default_config(env: typing.Mapping[str, str] | None = None) -> config.Config:
    """:func:`dshim.config.default_config` with the registry's channels."""
    return config.default_config(env, channels=CATALOG)


#: Between the blocks that load as written and the commented ones.
_PLATFORMS_NOTE = "# Platforms: uncomment a block and set its environment variables.\n"


def starter_toml() -> str:
    """The commented starter file ``dshim init`` writes.

    It loads as written (the web chat bot and the echo harness); each platform block loads
    once uncommented with its environment variables set.
    """
    enabled = [entry.starter for entry in SPECS if entry.starter_enabled]
    commented = [entry.starter for entry in SPECS if not entry.starter_enabled]
    return (
        config.STARTER_HEAD
        + "\n"
        + "\n".join(enabled)
        + "\n"
        + _PLATFORMS_NOTE
        + "\n"
        + "\n".join(commented)
    )
