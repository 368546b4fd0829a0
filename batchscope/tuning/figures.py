"""What one measurement says, and whether it is good enough.

- ``Window``: the figures of one measurement window (requests answered, within the SLO,
  failed; p50/p99; out-of-memory events), and the mean of several.
- ``Stability``: perf_analyzer's rule: the last ``windows`` windows agree, throughput
  and p99 each within ``tolerance`` (10 %) of their mean, within ``max_windows``.
- ``Objective``: goodput (requests per second answered within the SLO) subject to
  p99 <= SLO, or the lowest p99 while serving a target rate; which figures are
  infeasible (over the SLO, more than 1 % failed, out of memory, target missed), the
  score the optimizer is told, and the relative gain between two figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

GOODPUT = "goodput"
LATENCY = "latency"
OBJECTIVES = (GOODPUT, LATENCY)
#: the most failed requests (429, 503, 5xx, lost connections) a feasible trial may have
MAX_FAILED_FRACTION = 0.01
#: the share of the target rate a trial must serve under the latency objective
TARGET_SHARE = 0.95
#: goodputs this close (relative) are a tie, which the lower p99 breaks: an open loop's
#: feasible points all serve about its rate (windows count completions, so a trial that
#: starts with a shorter queue than the last one left reads a few percent above it), a
#: closed loop's differ by about this much from run to run, and a few percent of
#: throughput is not worth a longer tail
GOODPUT_TIE = 0.05


@dataclass(frozen=True)
class Window:
    """One measurement window's figures."""

    duration_s: float
    #: requests answered (200), of them within the SLO, and those that failed
    ok: int
    good: int
    failed: int
    p50_ms: float | None
    p99_ms: float | None
    #: out-of-memory events the server reported during the window
    oom_events: int = 0

    @property
    def throughput_rps(self) -> float:
        return self.ok / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def goodput_rps(self) -> float:
        return self.good / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def failed_fraction(self) -> float:
        total = self.ok + self.failed
        return self.failed / total if total else 0.0

    @classmethod
    def from_latencies(cls, latencies_ms: Sequence[float] | np.ndarray, failed: int,
                       duration_s: float, slo_p99_ms: float, oom_events: int = 0) -> "Window":
        lat = np.asarray(latencies_ms, dtype=np.float64)
        p50 = p99 = None
        if lat.size:
            p50, p99 = (float(v) for v in np.percentile(lat, [50, 99]))
        return cls(duration_s=duration_s, ok=int(lat.size),
                   good=int((lat <= slo_p99_ms).sum()), failed=int(failed), p50_ms=p50,
                   p99_ms=p99, oom_events=oom_events)

    @classmethod
    def mean_of(cls, windows: Sequence["Window"]) -> "Window":
        """The figures of several windows: counts summed, percentiles averaged (as
        perf_analyzer reports a stable measurement)."""
        def mean(values: list[float | None]) -> float | None:
            known = [v for v in values if v is not None]
            return sum(known) / len(known) if known else None

        return cls(duration_s=sum(w.duration_s for w in windows), ok=sum(w.ok for w in windows),
                   good=sum(w.good for w in windows), failed=sum(w.failed for w in windows),
                   p50_ms=mean([w.p50_ms for w in windows]),
                   p99_ms=mean([w.p99_ms for w in windows]),
                   oom_events=sum(w.oom_events for w in windows))


@dataclass(frozen=True)
class Stability:
    """perf_analyzer's stability rule: the last ``windows`` windows agree within
    ``tolerance`` on throughput and p99; at most ``max_windows`` per trial."""

    windows: int = 3
    tolerance: float = 0.10
    max_windows: int = 8

    def __post_init__(self) -> None:
        if self.windows < 1 or self.max_windows < self.windows or not 0 < self.tolerance < 1:
            raise ValueError("stability: need 1 <= windows <= max_windows and a tolerance "
                             "between 0 and 1")

    def agree(self, windows: Sequence[Window]) -> bool:
        if len(windows) < self.windows:
            return False
        last = windows[-self.windows:]
        if all(w.ok == 0 for w in last):  # nothing answered, steadily: decided
            return True
        for values in ([w.throughput_rps for w in last], [w.p99_ms for w in last]):
            if any(v is None for v in values):
                return False
            mean = sum(values) / len(values)
            if any(abs(v - mean) > self.tolerance * mean for v in values):
                return False
        return True


@dataclass(frozen=True)
class Objective:
    """What a session maximizes: goodput under ``p99 <= slo_p99_ms``, or (``latency``)
    the lowest p99 while serving ``target_rps``."""

    slo_p99_ms: float
    kind: str = GOODPUT
    target_rps: float | None = None

    def __post_init__(self) -> None:
        if not (self.slo_p99_ms > 0 and math.isfinite(self.slo_p99_ms)):
            raise ValueError(f"the SLO must be a positive number of ms, not {self.slo_p99_ms!r}")
        if self.kind not in OBJECTIVES:
            raise ValueError(f"objective {self.kind!r}: use one of {', '.join(OBJECTIVES)}")
        if self.kind == LATENCY and not (self.target_rps and self.target_rps > 0):
            raise ValueError("the latency objective needs a target rate (--rate)")

    def problem(self, w: Window) -> str | None:
        """Why ``w`` is infeasible, or None."""
        if w.oom_events:
            return f"ran out of memory ({w.oom_events} OOM event{'s' * (w.oom_events > 1)})"
        if w.ok == 0:
            return "no request was answered"
        if w.failed_fraction > MAX_FAILED_FRACTION:
            return f"{100 * w.failed_fraction:.1f} % of requests failed"
        if w.p99_ms is not None and w.p99_ms > self.slo_p99_ms:
            return f"p99 {w.p99_ms:.1f} ms > SLO {self.slo_p99_ms:g} ms"
        if self.kind == LATENCY and w.throughput_rps < TARGET_SHARE * (self.target_rps or 0):
            return f"served {w.throughput_rps:.0f} req/s of the {self.target_rps:g} asked"
        return None

    def breaks_slo(self, w: Window) -> bool:
        """Whether requests in ``w`` missed the SLO beyond what it allows: p99 over it,
        or more than 1 % failed."""
        return (w.p99_ms is not None and w.p99_ms > self.slo_p99_ms) or \
            w.failed_fraction > MAX_FAILED_FRACTION

    def score(self, w: Window | None, feasible: bool) -> float:
        """Higher is better; what the optimizer is told. Infeasible points score below
        every feasible one of the same load, less the further they miss."""
        if w is None or w.oom_events:
            return 0.0 if self.kind == GOODPUT else -1e9
        p99 = w.p99_ms if w.p99_ms is not None else math.inf
        if self.kind == GOODPUT:
            if feasible:
                return w.goodput_rps
            return 0.5 * w.goodput_rps * min(1.0, self.slo_p99_ms / p99)
        if feasible:
            return -p99
        return -(10 * self.slo_p99_ms + min(p99, 1e6))

    def gain(self, old: Window, new: Window) -> float:
        """How much better ``new`` is than ``old``, relative (0.05 = 5 %)."""
        if self.kind == GOODPUT:
            if old.goodput_rps <= 0:
                return math.inf if new.goodput_rps > 0 else 0.0
            return new.goodput_rps / old.goodput_rps - 1.0
        if not old.p99_ms or new.p99_ms is None:
            return 0.0
        return 1.0 - new.p99_ms / old.p99_ms
