"""Process metrics: what the pipeline counts, exposed as Prometheus text at ``/metrics``.

Theory of operation
-------------------
The pipeline of a bot reports through a :class:`BotMetrics` it is handed when it opens
(:func:`dshim.pipeline.runtime.open_bot_runtime`).  The default is :data:`NO_METRICS`,
whose methods do nothing, so replay, tests and benchmarks pay one empty call per hook.
``dshim serve`` creates one :class:`ProcessMetrics` per process and hands each bot
``metrics.for_bot(name, channel)``.

Counters and histograms are plain dictionaries and lists written on the trio thread (the
only writer), so an event costs a dictionary update — no lock, no label lookup in a
client library.  ``prometheus_client`` renders them at scrape time from a collector in a
:class:`~prometheus_client.CollectorRegistry` of this process (never the library's global
registry), together with the gauges, which are read at that moment: the lanes of every
open bot runtime, and which bots are up.

Names and labels (docs/operations.md lists them too)::

    dshim_events_total{bot,channel,outcome}       accepted, or the drop reason
    dshim_turns_total{bot,result}                 ok, error, stopped, busy
    dshim_reply_lookups_total{bot,channel,result} snapshot, loaded, recovered, or the
                                                  unavailable reason
    dshim_platform_requests_total{bot,method,status}
    dshim_turn_first_delta_seconds                histogram: turn start -> first text
    dshim_turn_duration_seconds                   histogram: turn start -> end
    dshim_lanes_active                            gauge: lanes running a turn now
    dshim_lane_queue_depth                        gauge: messages waiting in lanes
    dshim_bot_up{bot}                             gauge: 1 when the bot is started
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

__all__ = [
    "NO_METRICS",
    "BotMetrics",
    "LaneStats",
    "NoMetrics",
    "ProcessMetrics",
    "TURN_RESULTS",
]

#: The ``result`` label values of ``dshim_turns_total``.
TURN_RESULTS = ("ok", "error", "stopped", "busy")

FIRST_DELTA_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class LaneStats(Protocol):
    """What the lane gauges read of a bot's lanes."""

    def running_count(self) -> int: ...

    def queued_count(self) -> int: ...


class BotMetrics(Protocol):
    """The counting hooks of one bot's pipeline (and its platform requests)."""

    def event(self, outcome: str) -> None:
        """An event handed to the pipeline: ``accepted`` or the drop reason."""
        ...

    def turn(
        self, result: str, *, first_delta_s: float | None = None, duration_s: float | None = None
    ) -> None:
        """A turn ended (:data:`TURN_RESULTS`); ``busy``: it could not be queued."""
        ...

    def reply_lookup(self, result: str) -> None:
        """A quoted message was resolved: snapshot, loaded, recovered or the reason."""
        ...

    def platform_request(self, method: str, status: str) -> None:
        """One request to the platform (``status``: the HTTP status, or ``error``)."""
        ...

    def watch_lanes(self, lanes: LaneStats) -> None:
        """Count these lanes in the lane gauges (until :meth:`unwatch_lanes`)."""
        ...

    def unwatch_lanes(self, lanes: LaneStats) -> None: ...


class NoMetrics:
    """Counts nothing (replay, tests, benchmarks)."""

    def event(self, outcome: str) -> None:
        pass

    def turn(
        self, result: str, *, first_delta_s: float | None = None, duration_s: float | None = None
    ) -> None:
        pass

    def reply_lookup(self, result: str) -> None:
        pass

    def platform_request(self, method: str, status: str) -> None:
        pass

    def watch_lanes(self, lanes: LaneStats) -> None:
        pass

    def unwatch_lanes(self, lanes: LaneStats) -> None:
        pass


NO_METRICS: BotMetrics = NoMetrics()


class _Histogram:
    """Bucket counts, sum and count of one unlabelled histogram."""

    __slots__ = ("bounds", "counts", "total", "count")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def buckets(self) -> list[tuple[str, float]]:
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out


class _BotCounters:
    """The :class:`BotMetrics` of one bot under :class:`ProcessMetrics`."""

    __slots__ = ("_p", "_bot", "_channel", "_events", "_turns", "_lookups", "_requests")

    def __init__(self, process: ProcessMetrics, bot: str, channel: str) -> None:
        self._p = process
        self._bot = bot
        self._channel = channel
        # One dictionary per counter and bot: the label key is the varying label only.
        self._events = process.events.setdefault((bot, channel), {})
        self._turns = process.turns.setdefault(bot, {})
        self._lookups = process.lookups.setdefault((bot, channel), {})
        self._requests = process.requests.setdefault(bot, {})
        self._events.setdefault("accepted", 0)
        self._turns.setdefault("ok", 0)

    def event(self, outcome: str) -> None:
        self._events[outcome] = self._events.get(outcome, 0) + 1

    def turn(
        self, result: str, *, first_delta_s: float | None = None, duration_s: float | None = None
    ) -> None:
        self._turns[result] = self._turns.get(result, 0) + 1
        if first_delta_s is not None:
            self._p.first_delta.observe(max(0.0, first_delta_s))
        if duration_s is not None:
            self._p.duration.observe(max(0.0, duration_s))

    def reply_lookup(self, result: str) -> None:
        self._lookups[result] = self._lookups.get(result, 0) + 1

    def platform_request(self, method: str, status: str) -> None:
        key = (method, status)
        self._requests[key] = self._requests.get(key, 0) + 1

    def watch_lanes(self, lanes: LaneStats) -> None:
        self._p.lanes.add(lanes)

    def unwatch_lanes(self, lanes: LaneStats) -> None:
        self._p.lanes.discard(lanes)


class ProcessMetrics:
    """The metrics of one ``dshim serve`` process, in a registry of its own.

    ``bots_up`` returns ``(bot, up)`` for every enabled bot when ``/metrics`` is read.
    """

    def __init__(self, bots_up: Callable[[], Iterable[tuple[str, bool]]] = tuple) -> None:
        self.events: dict[tuple[str, str], dict[str, int]] = {}
        self.turns: dict[str, dict[str, int]] = {}
        self.lookups: dict[tuple[str, str], dict[str, int]] = {}
        self.requests: dict[str, dict[tuple[str, str], int]] = {}
        self.first_delta = _Histogram(FIRST_DELTA_BUCKETS)
        self.duration = _Histogram(DURATION_BUCKETS)
        self.lanes: set[LaneStats] = set()
        self._bots_up = bots_up
        #: Made at the first scrape: prometheus_client is imported only then (importing it
        #: costs a process ~35 ms of start-up and a few MB, for a page nobody may read).
        self._registry: CollectorRegistry | None = None

    @property
    def registry(self) -> CollectorRegistry:
        """The registry ``/metrics`` renders (this process's own, not the global one)."""
        if self._registry is None:
            from prometheus_client import CollectorRegistry

            self._registry = CollectorRegistry(auto_describe=False)
            self._registry.register(_Collector(self))
        return self._registry

    def for_bot(self, bot: str, channel: str) -> BotMetrics:
        """The hooks of one bot (its counters start at zero in this process)."""
        return _BotCounters(self, bot, channel)

    def render(self) -> tuple[bytes, str]:
        """The text exposition and its content type."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def collect(self) -> Iterator[Any]:
        """The metric families, built now (the registry's collector)."""
        from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily

        yield _counter(
            "dshim_events",
            "Events handed to the pipeline, by outcome (accepted or the drop reason).",
            ("bot", "channel", "outcome"),
            (
                (*key, outcome, n)
                for key, outcomes in self.events.items()
                for outcome, n in outcomes.items()
            ),
        )
        yield _counter(
            "dshim_turns",
            "Turns by result (ok, error, stopped, busy).",
            ("bot", "result"),
            (
                (bot, result, n)
                for bot, results in self.turns.items()
                for result, n in results.items()
            ),
        )
        yield _counter(
            "dshim_reply_lookups",
            "Quoted messages resolved, by result (snapshot, loaded, recovered, or the "
            "unavailable reason).",
            ("bot", "channel", "result"),
            (
                (*key, result, n)
                for key, results in self.lookups.items()
                for result, n in results.items()
            ),
        )
        yield _counter(
            "dshim_platform_requests",
            "Requests to the platforms' APIs, by method and HTTP status (error: no answer).",
            ("bot", "method", "status"),
            ((bot, *call, n) for bot, calls in self.requests.items() for call, n in calls.items()),
        )
        for name, doc, hist in (
            (
                "dshim_turn_first_delta_seconds",
                "Seconds from a turn's start to the agent's first text.",
                self.first_delta,
            ),
            (
                "dshim_turn_duration_seconds",
                "Seconds from a turn's start to its end.",
                self.duration,
            ),
        ):
            yield HistogramMetricFamily(name, doc, buckets=hist.buckets(), sum_value=hist.total)
        lanes = list(self.lanes)
        yield GaugeMetricFamily(
            "dshim_lanes_active",
            "Conversation lanes running a turn now.",
            value=sum(lane.running_count() for lane in lanes),
        )
        yield GaugeMetricFamily(
            "dshim_lane_queue_depth",
            "Messages waiting in conversation lanes now.",
            value=sum(lane.queued_count() for lane in lanes),
        )
        up = GaugeMetricFamily("dshim_bot_up", "1 when the bot is started.", labels=("bot",))
        for bot, is_up in self._bots_up():
            up.add_metric((bot,), 1.0 if is_up else 0.0)
        yield up


def _counter(name: str, doc: str, labels: tuple[str, ...], rows: Iterable[tuple[Any, ...]]) -> Any:
    """A counter family from rows of label values followed by the count."""
    from prometheus_client.core import CounterMetricFamily

    family = CounterMetricFamily(name, doc, labels=labels)
    for *values, n in rows:
        family.add_metric(values, n)
    return family


class _Collector:
    """Adapts :class:`ProcessMetrics` to the registry (it calls ``collect``)."""

    def __init__(self, metrics: ProcessMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        return self._metrics.collect()
