"""``BatchCost``: how long a batch of ``n`` takes, ``per_item_ms * n + per_batch_ms``.

The autopilot's controller predicts with it what a move would do: the time of a full
batch at a new ``max_batch_size`` (latency), the requests per second the device could
serve at a batch size (capacity, ``n / time(n)``), and the device time per request a
longer delay would save by making batches fuller (only when there is a per-batch
cost to share out).

``BatchTimes`` keeps the batch times the engine measured, per batch size (batches and
their summed milliseconds), older windows fading by ``DECAY`` each, and fits the line by
weighted least squares. With one batch size seen it can only say ``time ∝ n`` (no
per-batch part, ``sizes == 1``), which is the cautious guess for every decision: no
capacity to gain from bigger batches, nothing saved by waiting for companions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

#: each judged window, the batch times kept so far are scaled by this
DECAY = 0.7


@dataclass(frozen=True, slots=True)
class BatchCost:
    per_item_ms: float
    per_batch_ms: float
    #: distinct batch sizes it was fitted to (1: a proportional guess)
    sizes: int

    def ms(self, n: float) -> float:
        return self.per_item_ms * n + self.per_batch_ms

    def per_request_ms(self, n: float) -> float:
        return self.ms(n) / n if n > 0 else float("inf")

    def capacity_rps(self, n: float) -> float:
        took = self.ms(n)
        return 1000.0 * n / took if took > 0 else float("inf")

    def largest_within(self, limit_ms: float) -> int:
        """The largest batch that takes at most ``limit_ms`` (0 when none does)."""
        if self.per_item_ms <= 0:
            return 1 << 30 if self.per_batch_ms <= limit_ms else 0
        return max(0, int((limit_ms - self.per_batch_ms) / self.per_item_ms))


def fit(by_size: Mapping[int, tuple[float, float]]) -> BatchCost | None:
    """The line through ``size -> (batches, summed ms)`` (None: no batch seen)."""
    points = [(n, count, total / count) for n, (count, total) in by_size.items()
              if n > 0 and count > 0]
    if not points:
        return None
    w = sum(c for _, c, _ in points)
    sn = sum(c * n for n, c, _ in points)
    sy = sum(c * y for _, c, y in points)
    snn = sum(c * n * n for n, c, _ in points)
    sny = sum(c * n * y for n, c, y in points)
    den = w * snn - sn * sn
    if len(points) < 2 or den <= 1e-12 * w * snn:
        return BatchCost(sny / snn, 0.0, 1)
    a = (w * sny - sn * sy) / den
    b = (sy - a * sn) / w
    if b < 0.0:  # no per-batch part: through the origin
        a, b = sny / snn, 0.0
    elif a < 0.0:  # no per-item part: a constant
        a, b = 0.0, sy / w
    return BatchCost(a, b, len(points))


class BatchTimes:
    """Batch times per size, fading window by window (see the module docstring)."""

    __slots__ = ("_by_size",)

    def __init__(self) -> None:
        self._by_size: dict[int, tuple[float, float]] = {}

    def add(self, window: Mapping[int, tuple[float, float]], decay: float = DECAY) -> None:
        """Fade what is kept, then add one window's ``size -> (batches, summed ms)``."""
        kept = {n: (c * decay, ms * decay) for n, (c, ms) in self._by_size.items()
                if c * decay >= 0.05}
        for n, (c, ms) in window.items():
            if c > 0:
                old_c, old_ms = kept.get(n, (0.0, 0.0))
                kept[n] = (old_c + c, old_ms + ms)
        self._by_size = kept

    def cost(self) -> BatchCost | None:
        return fit(self._by_size)

    def largest(self) -> int:
        """The largest batch size among the times kept (0: none)."""
        return max(self._by_size, default=0)
