"""``OutcomeWindow``: one model's running outcome figures, in fixed memory.

The engine's booking adds every request's outcome as it settles: a successful one with
its latency (arrival to answer) into a histogram of fixed buckets, each ``GROWTH`` (5 %)
wider than the last from ``SMALLEST_S`` up to ``LONGEST_S``; any other outcome
(rejected, expired, failed) into a count. Nothing is ever removed, so adding is O(log
buckets) and the memory is the same after a billion requests as after one.

A *window* is the difference of two snapshots: ``figures(before, after, duration_s,
slo_ms)`` gives its request counts, p50/p99 latency (interpolated inside the bucket, so
within 5 % of the exact value), the requests served within the SLO (goodput) and the
mean batch size. The autopilot takes a snapshot when a window starts and judges the
window from the next ones.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

#: the histogram's bucket bounds (seconds): the first bucket holds everything faster
SMALLEST_S = 50e-6
LONGEST_S = 600.0
GROWTH = 1.05
BOUNDS_S: tuple[float, ...] = tuple(
    SMALLEST_S * GROWTH ** i
    for i in range(int(math.ceil(math.log(LONGEST_S / SMALLEST_S) / math.log(GROWTH))) + 1))
#: outcomes that do not count against a model (the client went away, or shutdown)
NOT_COUNTED = frozenset({"cancelled"})


@dataclass(frozen=True, slots=True)
class Snapshot:
    """The running totals at one moment."""

    ok: int
    failed: int
    batches: int
    #: successful requests per latency bucket (``BOUNDS_S``; the last: slower than all)
    latency_counts: tuple[int, ...]


class OutcomeWindow:
    """Running totals of one model's outcomes (changed only by the engine's booking)."""

    __slots__ = ("_counts", "ok", "failed", "batches")

    def __init__(self) -> None:
        self._counts = [0] * (len(BOUNDS_S) + 1)
        self.ok = 0
        self.failed = 0
        #: successful batch parts answered (a batch split by OOM counts once per part)
        self.batches = 0

    def add_ok(self, now_s: float, arrived_s: list[float]) -> None:
        """The requests of one successful batch, answered at ``now_s``."""
        if not arrived_s:
            return
        counts = self._counts
        find = bisect.bisect_left
        for arrived in arrived_s:
            counts[find(BOUNDS_S, now_s - arrived)] += 1
        self.ok += len(arrived_s)
        self.batches += 1

    def add_request(self, outcome: str, now_s: float, arrived_s: float) -> None:
        """One request settled on its own: ok (with its latency), or rejected, expired,
        failed (counted); cancelled is not counted."""
        if outcome == "ok":
            self._counts[bisect.bisect_left(BOUNDS_S, now_s - arrived_s)] += 1
            self.ok += 1
        elif outcome not in NOT_COUNTED:
            self.failed += 1

    def snapshot(self) -> Snapshot:
        return Snapshot(self.ok, self.failed, self.batches, tuple(self._counts))


@dataclass(frozen=True, slots=True)
class WindowFigures:
    """What happened between two snapshots."""

    duration_s: float
    ok: int
    failed: int
    batches: int
    #: latency percentiles of the successful requests (None: none succeeded)
    p50_ms: float | None
    p99_ms: float | None
    #: successful requests within the SLO
    good: int

    @property
    def samples(self) -> int:
        return self.ok + self.failed

    @property
    def goodput_rps(self) -> float:
        return self.good / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def throughput_rps(self) -> float:
        return self.ok / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def settled_rps(self) -> float:
        """Requests that got any outcome per second (about the arrival rate)."""
        return self.samples / self.duration_s if self.duration_s > 0 else 0.0

    @property
    def mean_batch_size(self) -> float | None:
        return self.ok / self.batches if self.batches else None


def _bucket_span(i: int) -> tuple[float, float]:
    low = 0.0 if i == 0 else BOUNDS_S[i - 1]
    high = BOUNDS_S[i] if i < len(BOUNDS_S) else BOUNDS_S[-1] * GROWTH
    return low, high


def _within(low: float, high: float, fraction: float) -> float:
    """The point ``fraction`` of the way through a bucket (geometric, linear in the first)."""
    if low <= 0.0:
        return high * fraction
    return low * (high / low) ** fraction


def quantile_s(counts: list[int] | tuple[int, ...], q: float) -> float | None:
    """The ``q`` quantile (0..1) of a latency histogram, in seconds; None when empty."""
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    seen = 0
    for i, n in enumerate(counts):
        if n and seen + n >= rank:
            low, high = _bucket_span(i)
            return _within(low, high, (rank - seen) / n)
        seen += n
    return _bucket_span(len(counts) - 1)[1]


def count_within(counts: list[int] | tuple[int, ...], limit_s: float) -> int:
    """About how many of the histogram's requests took at most ``limit_s``."""
    i = bisect.bisect_left(BOUNDS_S, limit_s)
    full = sum(counts[:i])
    if i >= len(counts) or not counts[i]:
        return full
    low, high = _bucket_span(i)
    if low <= 0.0:
        part = limit_s / high
    else:
        part = math.log(limit_s / low) / math.log(high / low)
    return full + int(round(counts[i] * min(1.0, max(0.0, part))))


def figures(before: Snapshot, after: Snapshot, duration_s: float,
            slo_ms: float | None = None) -> WindowFigures:
    """The window from ``before`` to ``after``, ``duration_s`` long; ``good`` counts the
    successful requests within ``slo_ms`` (all of them when it is None)."""
    counts = [a - b for a, b in zip(after.latency_counts, before.latency_counts)]
    p50 = quantile_s(counts, 0.50)
    p99 = quantile_s(counts, 0.99)
    ok = after.ok - before.ok
    good = ok if slo_ms is None else count_within(counts, slo_ms / 1000.0)
    return WindowFigures(duration_s, ok, after.failed - before.failed,
                         after.batches - before.batches,
                         None if p50 is None else p50 * 1000.0,
                         None if p99 is None else p99 * 1000.0, good)
