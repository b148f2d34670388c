"""DSH (the agent host dsh-im fronts) over its HTTP RPC and events websocket.

- :mod:`~dshim.harness.dsh.protocol` — sans-IO: envelopes, error mapping, events -> turn
  events, history pages;
- :mod:`~dshim.harness.dsh.harness` — the adapter (:class:`DshHarness`): calls, the events
  websocket, sessions, turns, interactions.
"""

from dshim.harness.dsh.harness import DEFAULT_BASE_URL, DshHarness

__all__ = ["DEFAULT_BASE_URL", "DshHarness"]
