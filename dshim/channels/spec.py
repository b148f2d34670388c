"""What a channel declares for dshim's registries, read without importing the channel.

Every channel package has a light ``spec.py`` next to its ``channel.py``: it ends with
``SPEC = RegistryEntry(...)`` and imports nothing but this module (no httpx, no trio, not
the channel), so that listing the channels -- ``dshim --help``, the configuration's key
check, ``dshim init``, the log redactor's token patterns -- stays cheap.
:mod:`dshim.channels.registry` finds the specs; tests, benches and docs read their lists
from it, so adding a channel touches only its own package (plus its fixtures, tests and
docs page).

The channel object itself (``CHANNEL`` in ``channel.py``, usually a
:class:`dshim.channels.base.ChannelSpec`) is what runs; this entry is only what the
registries list.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RegistryEntry"]


@dataclass(frozen=True, kw_only=True)
class RegistryEntry:
    """One channel's entry in the registries (``SPEC`` in ``dshim/channels/<key>/spec.py``)."""

    #: The ``channel = "<key>"`` of a ``[[bots]]`` table; also the package's name.
    key: str
    #: Where the channel sorts among the others: error messages, docs and ``dshim init``
    #: list channels in this order (ascending; leave gaps for new channels).
    position: int
    #: The platform's name in messages ("WhatsApp").
    title: str
    #: The channel's block of the ``dshim init`` starter file, ending with a newline:
    #: commented out (it loads once uncommented with its environment variables set) unless
    #: ``starter_enabled``.
    starter: str
    #: The block loads as written (the web chat): it precedes the commented platform blocks.
    starter_enabled: bool = False
    #: Fixture file stems ``fixtures/<key>/`` must have (CHANNELS.md §10 lists the cases),
    #: beyond the channel's own.
    fixture_cases: frozenset[str] = frozenset()
    #: Regular expressions of the platform's credentials that the log redactor masks
    #: wherever they appear.  Each has exactly one named group, unique among all channels:
    #: the part of the match that is kept (possibly empty); the rest is masked.
    log_tokens: tuple[str, ...] = ()
    #: The platform is dshim itself (the web chat): no remote platform, so no fake server
    #: of it (its fake in :mod:`dshim.testing.fakes` is a client) and no bench against one.
    local: bool = False
    #: Messages arrive only as webhooks on the local HTTP endpoint (a bot then needs
    #: ``[http] enabled = true``).
    webhook_only: bool = False
    #: A substitute target's ``email`` is resolved to a platform id at start-up (elsewhere
    #: an email alone never matches a mention).
    resolves_email: bool = False
