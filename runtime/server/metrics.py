"""Prometheus metrics fed from the same records the database gets.

``MetricsRecorder`` is recorder-like (``put(record)``): tee it with the database
recorder and the engine keeps one recording path. Queue depths and recorder
drops are read at scrape time, so nothing extra runs per request for them.
Everything lives in the recorder's own ``CollectorRegistry``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from batchscope.records import BatchRow, RequestRow

CONTENT_TYPE = CONTENT_TYPE_LATEST

_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0, 30.0)


class _ScrapeCollector:
    """Gauges read when Prometheus scrapes: queue depth per model, recorder drops."""

    def __init__(self, stats: Callable[[], dict[str, dict[str, Any]]],
                 dropped: Callable[[], int]) -> None:
        self._stats = stats
        self._dropped = dropped

    def describe(self) -> Iterable:
        return []

    def collect(self) -> Iterable:
        depth = GaugeMetricFamily("batchscope_queue_depth", "Requests waiting per model",
                                  labels=["model"])
        in_flight = GaugeMetricFamily("batchscope_in_flight_requests",
                                      "Requests in the batch running now", labels=["model"])
        eff = GaugeMetricFamily("batchscope_effective_max_batch_size",
                                "Max batch size after OOM backoff", labels=["model"])
        for model, st in self._stats().items():
            depth.add_metric([model], float(st.get("queue_depth", 0)))
            in_flight.add_metric([model], float(st.get("in_flight", 0)))
            if st.get("effective_max_batch_size") is not None:
                eff.add_metric([model], float(st["effective_max_batch_size"]))
        drops = GaugeMetricFamily("batchscope_recorder_dropped_records",
                                  "Records the database recorder dropped since start "
                                  "(its buffer was full)")
        drops.add_metric([], float(self._dropped()))
        return [depth, in_flight, eff, drops]


class MetricsRecorder:
    """Turns BatchRow/RequestRow records into Prometheus series; other records are ignored."""

    def __init__(self, *, stats: Callable[[], dict[str, dict[str, Any]]] | None = None,
                 dropped: Callable[[], int] | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        r = self.registry
        self.batch_size = Histogram("batchscope_batch_size", "Requests per executed batch",
                                    ["model"], buckets=_BATCH_BUCKETS, registry=r)
        self.compute_seconds = Histogram("batchscope_batch_compute_seconds",
                                         "Time the model spent on one batch", ["model"],
                                         buckets=_SECONDS_BUCKETS, registry=r)
        self.batches = Counter("batchscope_batches", "Executed batches", ["model", "outcome"],
                               registry=r)
        self.queue_wait_seconds = Histogram("batchscope_queue_wait_seconds",
                                            "Time a request waited before its batch ran",
                                            ["model"], buckets=_SECONDS_BUCKETS, registry=r)
        self.latency_seconds = Histogram("batchscope_request_latency_seconds",
                                         "Arrival to answer, per request",
                                         ["model", "outcome", "priority"],
                                         buckets=_SECONDS_BUCKETS, registry=r)
        self.requests = Counter("batchscope_requests", "Finished requests by outcome",
                                ["model", "outcome"], registry=r)
        self._stats = stats or (lambda: {})
        self._dropped = dropped or (lambda: 0)
        r.register(_ScrapeCollector(lambda: self._stats(), lambda: self._dropped()))
        # labelled children cached: a dict lookup instead of prometheus' label resolution
        self._batch_children: dict[tuple[str, str], tuple] = {}
        self._request_children: dict[tuple[str, str, int], tuple] = {}

    def bind(self, *, stats: Callable[[], dict[str, dict[str, Any]]] | None = None,
             dropped: Callable[[], int] | None = None) -> None:
        """Attach the scrape-time sources once the engine and recorder exist."""
        if stats is not None:
            self._stats = stats
        if dropped is not None:
            self._dropped = dropped

    # -- RecorderLike -------------------------------------------------------------------
    @property
    def dropped(self) -> int:
        return 0

    def put(self, record: Any) -> None:
        kind = type(record)
        if kind is RequestRow:
            self._request(record)
        elif kind is BatchRow:
            self._batch(record)

    def _batch(self, b: BatchRow) -> None:
        key = (b.model, b.outcome)
        ch = self._batch_children.get(key)
        if ch is None:
            ch = (self.batch_size.labels(b.model), self.compute_seconds.labels(b.model),
                  self.batches.labels(b.model, b.outcome))
            self._batch_children[key] = ch
        ch[0].observe(b.batch_size)
        ch[1].observe(b.compute_s)
        ch[2].inc()

    def _request(self, q: RequestRow) -> None:
        key = (q.model, q.outcome, q.priority)
        ch = self._request_children.get(key)
        if ch is None:
            ch = (self.queue_wait_seconds.labels(q.model),
                  self.latency_seconds.labels(q.model, q.outcome, str(q.priority)),
                  self.requests.labels(q.model, q.outcome))
            self._request_children[key] = ch
        if q.outcome == "ok":
            ch[0].observe(q.queue_wait_s)
        ch[1].observe(q.latency_s)
        ch[2].inc()

    # -- exposition ---------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)
