"""The operators' routes: ``GET /readyz`` and ``GET /metrics``.

``/readyz`` answers 200 when the store is open and every enabled bot reported started,
else 503; the body is a JSON array with one ``{"name", "channel", "state", "since",
"detail"}`` object per bot (:mod:`dshim.http.status`).  ``/metrics`` is the Prometheus
text exposition of the process's registry (:mod:`dshim.metrics`).
"""

from __future__ import annotations

from dshim.http.app import Endpoint
from dshim.http.status import BotStatuses
from dshim.http.types import HttpRequest, HttpResponse
from dshim.metrics import ProcessMetrics

__all__ = ["add_operator_routes"]


def add_operator_routes(endpoint: Endpoint, statuses: BotStatuses, metrics: ProcessMetrics) -> None:
    """Serve ``/readyz`` from ``statuses`` and ``/metrics`` from ``metrics``."""

    async def readyz(request: HttpRequest) -> HttpResponse:
        status, body = statuses.readyz()
        return HttpResponse(status, body, "application/json", (("cache-control", "no-store"),))

    async def exposition(request: HttpRequest) -> HttpResponse:
        body, content_type = metrics.render()
        return HttpResponse(200, body, content_type, (("cache-control", "no-store"),))

    endpoint.route("GET", "/readyz", readyz)
    endpoint.route("GET", "/metrics", exposition)
