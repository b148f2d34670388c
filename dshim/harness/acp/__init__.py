"""ACP (Agent Client Protocol v1): an agent subprocess spoken to over stdio.

The adapter is split the way the next harness adapter should be:

- :mod:`~dshim.harness.acp.models` — msgspec views of the wire messages;
- :mod:`~dshim.harness.acp.protocol` — sans-IO: ACP updates, results and requests mapped
  to dshim turn events and outcomes;
- :mod:`~dshim.harness.acp.rpc` — the JSON-RPC-over-stdio connection to one process;
- :mod:`~dshim.harness.acp.harness` — the adapter: processes, sessions, turns,
  interactions (:class:`AcpHarness`).
"""

from dshim.harness.acp.harness import IMAGES_REFUSED, NO_MODEL_SELECTION, AcpHarness
from dshim.harness.acp.protocol import AgentRpcError

__all__ = ["IMAGES_REFUSED", "NO_MODEL_SELECTION", "AcpHarness", "AgentRpcError"]
