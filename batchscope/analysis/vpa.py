"""The Kubernetes VPA recommender's arithmetic: its options (``VpaOptions``, VPA's
defaults), decaying histograms with exponential buckets, a container's memory peaks per
aggregation interval with out-of-memory bumps, and the estimate of one resource from a
histogram. ``batchscope.analysis.recommend`` feeds it what was recorded.

How it is turned into a recommendation (VPA's recommender, default flags)
------------------------------------------------------------------------
- Histograms with exponential buckets, each 5 % wider than the one before (CPU from
  0.001 cores up to 1000 cores, memory from 10 MB up to 1 TB), whose sample weights decay
  with a half-life of 24 h (``2 ** ((t - t_ref) / half_life)``; only ratios matter).
- CPU: every sample goes in with the same weight (VPA weighs by the container's CPU
  request, unknown here and constant within a deployment).
- Memory: one sample per container and aggregation interval (24 h): the peak of that
  interval, stamped at the interval's end, weight 1. An OOM adds ``max(used * 1.2,
  used + 100 MiB)`` as a peak of its interval, ``used`` being the larger of the memory
  at the failure and the interval's usage peak so far (VPA takes the container's memory
  request where this takes the memory at the failure).
- Percentiles: the end of the bucket where the cumulative weight reaches ``p`` of the
  total. Target = p90, lower bound = p50, upper bound = p95, each times 1.15 (the 15 %
  safety margin); the upper bound times ``1 + 1/c`` and the lower bound times
  ``(1 + 0.001/c) ** -2``, where the confidence ``c`` is the history length in days,
  ``min(last - first sample, samples / 1440)`` (1440 = one sample a minute for a day);
  then at least 25 millicores and 250 MiB (GPU memory has no minimum).
- Confidence comes from the CPU samples, as in VPA; instances that record no CPU
  figures (the GPU sampler) take it from their memory samples, else their GPU memory
  samples.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

MIB = 1024 ** 2
#: the resources a recommendation names
CPU, MEMORY, GPU_MEMORY = "cpu", "memory", "gpu_memory"


@dataclass(frozen=True)
class VpaOptions:
    """The recommender's parameters; the defaults are VPA's."""

    half_life_s: float = 24 * 3600.0
    target_percentile: float = 0.90
    lower_percentile: float = 0.50
    upper_percentile: float = 0.95
    margin_fraction: float = 0.15
    bucket_growth: float = 0.05
    cpu_first_bucket_cores: float = 0.001
    cpu_max_cores: float = 1000.0
    memory_first_bucket_bytes: float = 1e7
    memory_max_bytes: float = 1e12
    epsilon: float = 1e-4
    memory_aggregation_interval_s: float = 24 * 3600.0
    #: how far back the history reaches (VPA keeps 8 aggregation intervals)
    history_s: float = 8 * 24 * 3600.0
    oom_bump_ratio: float = 1.2
    oom_min_bump_bytes: float = 100.0 * MIB
    #: usage samples are averaged (CPU) or maxed (memory) over this many seconds
    cpu_sample_interval_s: float = 60.0
    min_cpu_cores: float = 0.025
    min_memory_bytes: float = 250.0 * MIB
    #: limits: the upper bound, but at most this many times the request
    limit_ratio: float = 2.0
    #: the least history (days, VPA's confidence) an upper bound is given with: below it
    #: VPA's ``1 + 1/days`` multiplies the p95 by hundreds (after 14 minutes, 104 times),
    #: a figure no node has; one day (a factor of 2) is also what ``k8s.vpa`` waits for
    #: before it writes ``maxAllowed``
    upper_min_history_days: float = 1.0

    def __post_init__(self) -> None:
        for name in ("target_percentile", "lower_percentile", "upper_percentile"):
            p = getattr(self, name)
            if not 0.0 < p <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {p}")
        for name in ("half_life_s", "memory_aggregation_interval_s", "history_s",
                     "cpu_sample_interval_s", "bucket_growth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.limit_ratio < 1.0:
            raise ValueError(f"limit_ratio must be >= 1 (a limit below the request is "
                             f"refused by Kubernetes), got {self.limit_ratio}")


# -- histograms -----------------------------------------------------------------------
class ExponentialBuckets:
    """Bucket ``i`` starts at ``first * (ratio**i - 1) / (ratio - 1)``; the first covers
    ``[0, first)`` and the last one is open-ended (starts at or past ``max_value``)."""

    def __init__(self, max_value: float, first_bucket: float, ratio: float) -> None:
        if max_value <= 0 or first_bucket <= 0 or ratio <= 1:
            raise ValueError("max_value and first_bucket must be > 0 and ratio > 1")
        self.first, self.ratio = first_bucket, ratio
        self.count = int(math.ceil(math.log(max_value * (ratio - 1) / first_bucket + 1)
                                   / math.log(ratio))) + 1

    def find(self, value: float) -> int:
        if value < self.first:
            return 0
        bucket = int(math.log(value * (self.ratio - 1) / self.first + 1) / math.log(self.ratio))
        return min(bucket, self.count - 1)

    def start(self, bucket: int) -> float:
        if bucket == 0:
            return 0.0
        return self.first * (self.ratio ** bucket - 1) / (self.ratio - 1)


class DecayingHistogram:
    """VPA's decaying histogram: a sample at ``t`` weighs ``weight * 2**((t - ref) / half_life)``,
    so one a half-life older counts half as much. The reference moves forward when the
    exponent grows large, rescaling every weight (ratios, and so percentiles, stay)."""

    MAX_EXPONENT = 100.0

    def __init__(self, buckets: ExponentialBuckets, half_life_s: float,
                 epsilon: float = 1e-4) -> None:
        self.buckets, self.half_life_s, self.epsilon = buckets, half_life_s, epsilon
        self.weights = np.zeros(buckets.count)
        self.reference_s: float | None = None

    def add(self, value: float, weight: float, at_s: float) -> None:
        if self.reference_s is None:
            self.reference_s = math.floor(at_s / 3600.0) * 3600.0
        exponent = (at_s - self.reference_s) / self.half_life_s
        if exponent > self.MAX_EXPONENT:
            shift = math.floor(exponent)
            self.weights *= 2.0 ** -shift
            self.reference_s += shift * self.half_life_s
            exponent -= shift
        self.weights[self.buckets.find(value)] += weight * 2.0 ** exponent

    @property
    def total_weight(self) -> float:
        return float(self.weights.sum())

    def is_empty(self) -> bool:
        return not (self.weights >= self.epsilon).any()

    def percentile(self, p: float) -> float:
        """The end of the bucket where the cumulative weight reaches ``p`` of the total
        (the start of the last bucket, which has no end); 0 when empty."""
        if self.is_empty():
            return 0.0
        used = np.nonzero(self.weights >= self.epsilon)[0]
        lo, hi = int(used[0]), int(used[-1])
        threshold = p * self.total_weight
        cumulative = np.cumsum(self.weights[lo:hi + 1])
        bucket = lo + int(min(np.searchsorted(cumulative, threshold * (1 - 1e-12)), hi - lo))
        if bucket < self.buckets.count - 1:
            return self.buckets.start(bucket + 1)
        return self.buckets.start(bucket)


def cpu_histogram(options: VpaOptions) -> DecayingHistogram:
    return DecayingHistogram(ExponentialBuckets(options.cpu_max_cores,
                                                options.cpu_first_bucket_cores,
                                                1 + options.bucket_growth),
                             options.half_life_s, options.epsilon)


def memory_histogram(options: VpaOptions) -> DecayingHistogram:
    return DecayingHistogram(ExponentialBuckets(options.memory_max_bytes,
                                                options.memory_first_bucket_bytes,
                                                1 + options.bucket_growth),
                             options.half_life_s, options.epsilon)


# -- one container's memory peaks ------------------------------------------------------
@dataclass(frozen=True)
class Peak:
    """The usage peak of one aggregation interval of one container."""

    window_end_s: float
    value: float
    from_oom: bool = False


def oom_bump(used: float, options: VpaOptions) -> float:
    """What an OOM says the container needs: 20 % more than it used, at least 100 MiB more."""
    return max(used + options.oom_min_bump_bytes, used * options.oom_bump_ratio)


def interval_peaks(samples: list[tuple[float, float]], ooms: list[tuple[float, float]],
                   options: VpaOptions) -> list[Peak]:
    """VPA's one peak per aggregation interval, OOMs included, for one container.

    ``samples`` and ``ooms`` are ``(at_s, bytes)``; an OOM's bytes are the memory at the
    failure (0 when unknown). The first sample opens the first interval; a later
    sample past the interval's end opens the interval it falls in.
    """
    interval = options.memory_aggregation_interval_s
    events = sorted([(t, v, False) for t, v in samples] + [(t, v, True) for t, v in ooms],
                    key=lambda e: (e[0], e[2]))
    peaks: dict[float, Peak] = {}
    window_end: float | None = None
    usage_peak = oom_peak = 0.0
    for at, value, is_oom in events:
        if is_oom:
            value = oom_bump(max(value, usage_peak), options)
        if window_end is None:
            window_end = at
        if at < window_end:
            current = max(usage_peak, oom_peak)
            if current == 0 or value <= current:
                continue
        else:
            window_end += math.floor((at - window_end) / interval) * interval + interval
            usage_peak = oom_peak = 0.0
        peaks[window_end] = Peak(window_end, value, is_oom)
        if is_oom:
            oom_peak = value
        else:
            usage_peak = value
    return [peaks[k] for k in sorted(peaks)]


# -- the estimate of one resource -------------------------------------------------------
@dataclass(frozen=True)
class Estimate:
    """Lower bound, target and upper bound of one resource, with the evidence."""

    resource: str
    unit: str
    lower: float
    target: float
    #: ``math.inf`` while there is no history to bound it
    upper: float
    #: the histogram's percentiles before margin and confidence
    p50: float
    p90: float
    p95: float
    max_observed: float
    samples: int
    peaks: int
    oom_bumps: int
    confidence_days: float
    first_sample_s: float | None
    last_sample_s: float | None
    source: str
    #: why ``upper`` is not VPA's figure: too little history to give one, or capped at
    #: what the host or device has ("" when it is VPA's)
    upper_note: str = ""

    def to_dict(self) -> dict:
        out = asdict(self)
        out["upper"] = None if math.isinf(self.upper) else self.upper
        return out


def confidence_days(first_s: float | None, last_s: float | None, samples: int) -> float:
    """VPA's history length in days: the lesser of the time span and samples / 1440."""
    if first_s is None or last_s is None:
        return 0.0
    return min((last_s - first_s) / 86400.0, samples / (60.0 * 24.0))


def estimate(hist: DecayingHistogram, *, resource: str, unit: str, minimum: float,
             confidence: float, options: VpaOptions, capacity: float | None = None,
             capacity_name: str = "", **evidence) -> Estimate:
    """Percentiles of ``hist`` into lower bound / target / upper bound (VPA's recommender).

    The upper bound is left unbounded (``math.inf``, with ``upper_note`` saying why)
    while the history is shorter than ``options.upper_min_history_days``, and is at most
    ``capacity`` (what the host or device has, named ``capacity_name``): VPA's
    confidence factor makes it hundreds of times the usage on a short history, which
    reads as a recommendation for a machine that does not exist."""
    margin = 1.0 + options.margin_fraction
    p50 = hist.percentile(options.lower_percentile)
    p90 = hist.percentile(options.target_percentile)
    p95 = hist.percentile(options.upper_percentile)
    if confidence > 0:
        upper_factor = 1.0 + 1.0 / confidence
        lower_factor = (1.0 + 0.001 / confidence) ** -2.0
    else:
        upper_factor, lower_factor = math.inf, 0.0
    upper = max(minimum, p95 * margin * upper_factor if p95 > 0 else 0.0)
    note = ""
    if confidence < options.upper_min_history_days:
        upper, note = math.inf, history_note(confidence, options)
    elif capacity and upper > capacity:
        upper, note = max(capacity, minimum), f"capped at {capacity_name or 'the capacity'}"
    return Estimate(resource=resource, unit=unit, lower=max(minimum, p50 * margin * lower_factor),
                    target=max(minimum, p90 * margin), upper=upper,
                    p50=p50, p90=p90, p95=p95, confidence_days=confidence, upper_note=note,
                    **evidence)


def history_note(confidence: float, options: VpaOptions) -> str:
    """What an upper bound without enough history says instead of a number."""
    have, need = confidence * 1440.0, options.upper_min_history_days * 1440.0
    return f"not enough history for an upper bound: {have:,.0f} min of {need:,.0f} needed"
