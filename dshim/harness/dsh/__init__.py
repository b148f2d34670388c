"""DSH (the agent host dsh-im fronts) over its HTTP RPC and events websocket.

- :mod:`~dshim.harness.dsh.protocol` — sans-IO: envelopes, error mapping, events -> turn
  events, history pages;
- :mod:`~dshim.harness.dsh.rpc` — the HTTP RPC client: ``POST /api/<method>``, the
  envelope checks, the HTTP error mapping, deadlines;
- :mod:`~dshim.harness.dsh.events` — the events websocket, its history-polling fallback,
  approvals and questions;
- :mod:`~dshim.harness.dsh.harness` — the adapter (:class:`DshHarness`): sessions, turns,
  /stop, /steer, models, history, health.
"""

from dshim.harness.dsh.harness import DEFAULT_BASE_URL, DshHarness

__all__ = ["DEFAULT_BASE_URL", "DshHarness"]
