"""Measurement windows: what one span of time under one setting looked like.

``LoadMeter`` measures on the client: the session's own load (synthetic or replayed)
times every request from when it was sent (closed loop) or due (open loop), so queueing
in the server counts. ``LiveMeter`` measures traffic the session does not send: from
the server's ``/v2/models/{name}/stats`` (requests by outcome, OOM events) and the
request-latency histogram of its ``/metrics`` (``batchscope_request_latency_seconds``,
answered requests), read at each window's edges and subtracted. Its percentiles are
interpolated within the histogram's buckets, as Prometheus' ``histogram_quantile`` does,
so they are as fine as the buckets (5, 10, 25, 50, 100 ms ...).

Both report out-of-memory events the server counted during the window.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from prometheus_client.parser import text_string_to_metric_families

from batchscope.load.background import BackgroundLoad
from batchscope.tuning.client import ControlClient, TuningError
from batchscope.tuning.figures import Window

LATENCY_FAMILY = "batchscope_request_latency_seconds"


class Meter(Protocol):
    """Measures windows. A meter that can count cheaply what finished so far also has
    ``finished_since_mark(now) -> int``; the shell then lengthens a window that holds
    too few requests to judge."""

    def mark(self, now: float) -> None: ...        # a window starts at ``now``

    def read(self, now: float) -> Window: ...      # the window up to ``now``; the next starts


class LoadMeter:
    """Windows of the session's own load, timed on the client."""

    def __init__(self, load: BackgroundLoad, client: ControlClient, slo_p99_ms: float) -> None:
        self.load, self.client, self.slo_p99_ms = load, client, slo_p99_ms
        self._start = load.now()
        self._oom = 0

    def mark(self, now: float) -> None:
        self._start = now
        self._oom = int(self.client.stats().get("oom_events", 0))

    def finished_since_mark(self, now: float) -> int:
        return self.load.count(self._start, now)

    def read(self, now: float) -> Window:
        done = self.load.window(self._start, now)
        oom = int(self.client.stats().get("oom_events", 0))
        window = Window.from_latencies(done.latencies_ms, done.failed, now - self._start,
                                       self.slo_p99_ms, oom_events=max(0, oom - self._oom))
        self._start, self._oom = now, oom
        return window


@dataclass(frozen=True)
class Histogram:
    """A cumulative latency histogram: upper bounds in ms and counts at or below each."""

    bounds_ms: tuple[float, ...]
    cumulative: tuple[float, ...]

    @property
    def total(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def minus(self, earlier: "Histogram") -> "Histogram":
        if earlier.bounds_ms != self.bounds_ms:
            return self
        return Histogram(self.bounds_ms, tuple(max(0.0, a - b) for a, b in
                                               zip(self.cumulative, earlier.cumulative)))

    def quantile(self, q: float) -> float | None:
        """``histogram_quantile``: linear within the bucket holding rank ``q``; the last
        finite bound when the rank falls in the +Inf bucket."""
        total = self.total
        if total <= 0:
            return None
        rank = q * total
        low_bound, low_count = 0.0, 0.0
        for bound, count in zip(self.bounds_ms, self.cumulative):
            if count >= rank:
                if math.isinf(bound):
                    return low_bound
                span = count - low_count
                return low_bound + (bound - low_bound) * ((rank - low_count) / span if span else 1)
            low_bound, low_count = bound, count
        return low_bound

    def at_most(self, limit_ms: float) -> float:
        """How many observations were at most ``limit_ms`` (linear within a bucket)."""
        low_bound, low_count = 0.0, 0.0
        for bound, count in zip(self.bounds_ms, self.cumulative):
            if limit_ms <= bound:
                if math.isinf(bound):
                    return low_count
                share = (limit_ms - low_bound) / (bound - low_bound) if bound > low_bound else 1
                return low_count + (count - low_count) * share
            low_bound, low_count = bound, count
        return low_count


def latency_histogram(metrics_text: str, model: str, outcome: str = "ok") -> Histogram:
    """The model's request-latency histogram in a ``/metrics`` text, summed over priorities."""
    by_bound: dict[float, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != LATENCY_FAMILY:
            continue
        for sample in family.samples:
            labels = sample.labels
            if (not sample.name.endswith("_bucket") or labels.get("model") != model
                    or labels.get("outcome") != outcome):
                continue
            bound = float(labels["le"]) * 1000.0
            by_bound[bound] = by_bound.get(bound, 0.0) + float(sample.value)
    bounds = tuple(sorted(by_bound))
    return Histogram(bounds, tuple(by_bound[b] for b in bounds))


class LiveMeter:
    """Windows of live traffic, from the server's own counts and latency histogram."""

    def __init__(self, client: ControlClient, slo_p99_ms: float) -> None:
        self.client, self.slo_p99_ms = client, slo_p99_ms
        self._start = 0.0
        self._last: tuple[dict, Histogram] | None = None

    def _snapshot(self) -> tuple[dict, Histogram]:
        stats = self.client.stats()
        return stats, latency_histogram(self.client.metrics_text(), self.client.model)

    def check(self) -> None:
        """A ``TuningError`` when the server exposes no latency histogram for the model."""
        if not self._snapshot()[1].bounds_ms:
            raise TuningError(f"{self.client.url}/metrics has no {LATENCY_FAMILY} series for "
                              f"model {self.client.model!r}; live tuning needs traffic on the "
                              "model (or use --load synthetic)")

    def mark(self, now: float) -> None:
        self._start, self._last = now, self._snapshot()

    def read(self, now: float) -> Window:
        stats, hist = self._snapshot()
        old_stats, old_hist = self._last or (stats, hist)
        self._start, self._last, start = now, (stats, hist), self._start
        delta = hist.minus(old_hist)
        outcomes = stats.get("requests_by_outcome") or {}
        before = old_stats.get("requests_by_outcome") or {}
        failed = sum(max(0, n - before.get(k, 0)) for k, n in outcomes.items() if k != "ok")
        oom = max(0, int(stats.get("oom_events", 0)) - int(old_stats.get("oom_events", 0)))
        total = delta.total
        return Window(duration_s=max(0.0, now - start), ok=int(round(total)),
                      good=int(round(delta.at_most(self.slo_p99_ms))), failed=failed,
                      p50_ms=delta.quantile(0.5), p99_ms=delta.quantile(0.99), oom_events=oom)
