"""Platform channels: one package per platform, found by :mod:`dshim.channels.registry`.

``dshim/channels/<key>/spec.py`` declares the channel for the registries (cheap to
import); ``dshim/channels/<key>/channel.py`` ends with ``CHANNEL = <Key>Channel()``, an
object satisfying :class:`dshim.channels.base.Channel` (read that module's docstring for
the rules every channel follows), which
:func:`dshim.channels.registry.load_channel` imports on demand.  This package imports
nothing, so that importing any of its modules starts no cycle.
"""
