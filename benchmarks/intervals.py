"""How far a ratio measured on a noisy machine can be trusted: paired rounds, one interval.

A benchmark that alternates a feature with its baseline round after round gets one pair of
figures per round (the two measured back to back, so they share the machine's state at
that moment). ``paired_ratio`` turns the pairs into one ratio, the geometric mean of the
rounds' ratios, and a bootstrap interval for it: the rounds resampled with replacement
(a fixed seed, so the same figures give the same interval), the interval the middle
``confidence`` of the resampled geometric means. A target such as "within 1 %" is met
when the whole interval lies above 0.99, not when one run's ratio happens to.
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple, Sequence


class Interval(NamedTuple):
    ratio: float
    low: float
    high: float
    rounds: int

    def text(self) -> str:
        """``0.988 (0.979-0.997)``."""
        return f"{self.ratio:.3f} ({self.low:.3f}-{self.high:.3f})"


def paired_ratio(base: Sequence[float], other: Sequence[float], *, confidence: float = 0.95,
                 resamples: int = 10_000, seed: int = 0) -> Interval:
    """``other / base`` over paired rounds, with its bootstrap interval.

    ``base[i]`` and ``other[i]`` are round i's figures (throughput, or a latency
    percentile). Fewer than two rounds give an interval of the one ratio itself."""
    if len(base) != len(other):
        raise ValueError(f"{len(base)} base figures against {len(other)} others: one pair a round")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence {confidence} must lie between 0 and 1")
    logs = [math.log(b / a) for a, b in zip(base, other) if a > 0 and b > 0]
    if not logs:
        raise ValueError("no round with both figures above zero")
    mean = math.fsum(logs) / len(logs)
    if len(logs) < 2:
        return Interval(math.exp(mean), math.exp(mean), math.exp(mean), len(logs))
    rng = random.Random(seed)
    n = len(logs)
    means = sorted(math.fsum(rng.choices(logs, k=n)) / n for _ in range(resamples))
    tail = (1.0 - confidence) / 2.0
    low = means[int(tail * (resamples - 1))]
    high = means[int(math.ceil((1.0 - tail) * (resamples - 1)))]
    return Interval(math.exp(mean), math.exp(low), math.exp(high), n)
