"""Resource recommendations from recorded usage, computed the way the Kubernetes VPA
recommender computes them.

What is measured
----------------
- CPU: the device samples of kind ``cpu`` (the sampler's fallback without a GPU) carry the
  host's CPU utilization; ``pct / 100 * host_cpus`` gives cores. The figure is host-wide:
  it includes whatever else ran on the host (a load generator on the same machine
  inflates it). Samples are averaged per ``cpu_sample_interval_s`` (60 s, the rate
  VPA's usage samples come at).
- Memory: the serving process' resident size (``process_rss_bytes``), the maximum per
  ``cpu_sample_interval_s``.
- GPU memory (VPA has no resource for it): per interval, the larger of the PyTorch
  allocator's reserved bytes (else the device's used bytes) and the batches' recorded
  ``peak_memory_bytes``.
- Out of memory: the runtime's ``oom`` and ``oom_failed`` events. A CUDA OOM (figures
  ``peak_bytes``/``reserved_bytes`` in its details, or any OOM on an instance that samples
  a GPU) bumps the GPU memory, one with only ``rss_bytes`` bumps the memory.

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

Several instances serving one model are aggregated like the pods of one VPA target:
their samples and interval peaks go into one histogram. CPU and memory belong to a
process, so an instance serving several models counts whole for each of them.

This module needs only SQLAlchemy and numpy, so ``batchscope k8s`` runs in a serving
install without the dashboard's packages.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import numpy as np
from sqlalchemy import Engine, text

MIB = 1024 ** 2
OOM_KINDS = ("oom", "oom_failed")
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
             confidence: float, options: VpaOptions, **evidence) -> Estimate:
    """Percentiles of ``hist`` into lower bound / target / upper bound (VPA's recommender)."""
    margin = 1.0 + options.margin_fraction
    p50 = hist.percentile(options.lower_percentile)
    p90 = hist.percentile(options.target_percentile)
    p95 = hist.percentile(options.upper_percentile)
    if confidence > 0:
        upper_factor = 1.0 + 1.0 / confidence
        lower_factor = (1.0 + 0.001 / confidence) ** -2.0
    else:
        upper_factor, lower_factor = math.inf, 0.0
    upper = p95 * margin * upper_factor if p95 > 0 else 0.0
    return Estimate(resource=resource, unit=unit, lower=max(minimum, p50 * margin * lower_factor),
                    target=max(minimum, p90 * margin), upper=max(minimum, upper),
                    p50=p50, p90=p90, p95=p95, confidence_days=confidence, **evidence)


# -- what was recorded -----------------------------------------------------------------
@dataclass
class Usage:
    """The usage figures of one instance over the history window."""

    instance_id: str
    #: (at_s, cores), one per ``cpu_sample_interval_s``
    cpu: list[tuple[float, float]] = field(default_factory=list)
    #: (at_s, bytes) maxima per interval
    memory: list[tuple[float, float]] = field(default_factory=list)
    gpu_memory: list[tuple[float, float]] = field(default_factory=list)
    gpu_total_bytes: float | None = None
    #: (at_s, bytes at the failure or 0) per OOM event, by the resource it bumps
    memory_ooms: list[tuple[float, float]] = field(default_factory=list)
    gpu_ooms: list[tuple[float, float]] = field(default_factory=list)
    models: set[str] = field(default_factory=set)
    raw_samples: int = 0
    #: intervals with a CPU utilization figure (turned into ``cpu`` only with host_cpus)
    cpu_intervals: int = 0


def floor_sql(expr: str) -> str:
    """``FLOOR(expr)`` as an integer on SQLite and PostgreSQL alike: ``CAST(... AS
    INTEGER)`` truncates on SQLite but rounds on PostgreSQL, so step back one where the
    cast landed above the value."""
    return (f"(CAST({expr} AS INTEGER) - CASE WHEN CAST({expr} AS INTEGER) > {expr} "
            "THEN 1 ELSE 0 END)")


def _rows(engine: Engine, sql: str, params: dict) -> list:
    with engine.connect() as conn:
        return list(conn.execute(text(sql), params))


def _where(start_s: float, end_s: float, time_col: str,
           instance_id: str | None) -> tuple[str, dict]:
    parts, params = [f"{time_col} >= :t0", f"{time_col} < :t1"], {"t0": start_s, "t1": end_s}
    if instance_id is not None:
        parts.append("instance_id = :inst")
        params["inst"] = instance_id
    return " AND ".join(parts), params


def _oom_figures(details_json: str | None) -> tuple[float, bool | None]:
    """(bytes at the failure, True for device memory / False for host / None unknown)."""
    try:
        details = json.loads(details_json or "{}")
    except ValueError:
        details = {}
    details = details if isinstance(details, dict) else {}
    memory = details.get("memory") if isinstance(details.get("memory"), dict) else {}

    def number(v) -> float:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0

    device = max(number(memory.get(k)) for k in ("peak_bytes", "reserved_bytes", "allocated_bytes"))
    if device > 0:
        return device, True
    if number(memory.get("rss_bytes")) > 0:
        return number(memory["rss_bytes"]), False
    return number(details.get("peak_memory_bytes")), None


def registered_host_cpus(engine: Engine, instance_id: str | None = None) -> int | None:
    """The CPU count the instances (or ``instance_id``) registered, when they all registered
    the same one: what turns their host-wide CPU utilization into cores."""
    where, params = ("WHERE id = :inst", {"inst": instance_id}) if instance_id else ("", {})
    with engine.connect() as conn:
        counts = {r[0] for r in conn.execute(text(
            f"SELECT DISTINCT cpu_count FROM runtime_instances {where}"), params) if r[0]}
    return counts.pop() if len(counts) == 1 else None


def load_usage(engine: Engine, start_s: float, end_s: float, *, options: VpaOptions,
               host_cpus: float | None, instance_id: str | None = None) -> dict[str, Usage]:
    """Every instance's usage between ``start_s`` and ``end_s``, by instance id."""
    iv = options.cpu_sample_interval_s
    usage: dict[str, Usage] = {}

    def of(iid) -> Usage:
        return usage.setdefault(str(iid), Usage(str(iid)))

    where, params = _where(start_s, end_s, "at", instance_id)
    bucket = floor_sql("at / :iv")
    for row in _rows(engine, f"""
            SELECT instance_id, {bucket} AS b, MIN(at) AS at_first,
                   COUNT(*) AS samples,
                   AVG(CASE WHEN kind = 'cpu' THEN utilization_pct END) AS cpu_pct,
                   MAX(process_rss_bytes) AS rss_bytes,
                   MAX(CASE WHEN kind = 'gpu' THEN COALESCE(torch_reserved_bytes, memory_used_bytes)
                       END) AS gpu_bytes,
                   MAX(CASE WHEN kind = 'gpu' THEN memory_total_bytes END) AS gpu_total_bytes
            FROM device_samples WHERE {where}
            GROUP BY instance_id, {bucket}
            ORDER BY instance_id, MIN(at)""", {**params, "iv": iv}):
        u = of(row.instance_id)
        at = float(row.at_first)
        u.raw_samples += int(row.samples)
        if row.cpu_pct is not None:
            u.cpu_intervals += 1
        if row.cpu_pct is not None and host_cpus:
            u.cpu.append((at, float(row.cpu_pct) / 100.0 * float(host_cpus)))
        if row.rss_bytes is not None:
            u.memory.append((at, float(row.rss_bytes)))
        if row.gpu_bytes is not None:
            u.gpu_memory.append((at, float(row.gpu_bytes)))
        if row.gpu_total_bytes is not None:
            u.gpu_total_bytes = max(u.gpu_total_bytes or 0.0, float(row.gpu_total_bytes))

    where, params = _where(start_s, end_s, "ended_at", instance_id)
    bucket = floor_sql("ended_at / :iv")
    for row in _rows(engine, f"""
            SELECT instance_id, model, {bucket} AS b,
                   MIN(ended_at) AS at_first, MAX(peak_memory_bytes) AS peak_bytes
            FROM batches WHERE {where}
            GROUP BY instance_id, model, {bucket}""", {**params, "iv": iv}):
        u = of(row.instance_id)
        u.models.add(str(row.model))
        if row.peak_bytes is not None:
            u.gpu_memory.append((float(row.at_first), float(row.peak_bytes)))

    for table, col in (("requests", "finished_at"), ("generation_steps", "at")):
        where, params = _where(start_s, end_s, col, instance_id)
        for row in _rows(engine, f"SELECT instance_id, model FROM {table} WHERE {where} "
                                 "GROUP BY instance_id, model", params):
            of(row.instance_id).models.add(str(row.model))

    where, params = _where(start_s, end_s, "at", instance_id)
    oom_kinds = ", ".join(f"'{k}'" for k in OOM_KINDS)
    for row in _rows(engine, f"""
            SELECT instance_id, model, at, details_json FROM events
            WHERE {where} AND kind IN ({oom_kinds}) ORDER BY at""", params):
        u = of(row.instance_id)
        if row.model is not None:
            u.models.add(str(row.model))
        used, on_device = _oom_figures(row.details_json)
        if on_device is None:
            on_device = bool(u.gpu_memory) or u.gpu_total_bytes is not None
        (u.gpu_ooms if on_device else u.memory_ooms).append((float(row.at), used))
    # the models each instance registered count too: a replica with samples but no
    # traffic yet belongs to the models it serves
    for iid, raw in _rows(engine, "SELECT id, models_json FROM runtime_instances", {}):
        if str(iid) in usage:
            usage[str(iid)].models.update(_registered(raw))
    for u in usage.values():
        u.gpu_memory.sort()
    return usage


def _registered(raw: str | None) -> list[str]:
    try:
        found = json.loads(raw or "[]")
    except ValueError:
        return []
    return [str(m) for m in found] if isinstance(found, list) else []


# -- recommendations -------------------------------------------------------------------
@dataclass(frozen=True)
class Recommendation:
    """CPU, memory and GPU memory for one instance, or for every instance of a model."""

    #: "instance" or "model"
    scope: str
    key: str
    instances: tuple[str, ...]
    models: tuple[str, ...]
    start_s: float
    end_s: float
    host_cpus: float | None
    cpu: Estimate | None
    memory: Estimate | None
    gpu_memory: Estimate | None
    gpu_total_bytes: float | None = None
    notes: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.scope} {self.key}"

    def to_dict(self) -> dict:
        out = {k: getattr(self, k) for k in ("scope", "key", "start_s", "end_s", "host_cpus",
                                               "gpu_total_bytes")}
        out.update(instances=list(self.instances), models=list(self.models),
                   notes=list(self.notes))
        for res in (CPU, MEMORY, GPU_MEMORY):
            est = getattr(self, res)
            out[res] = est.to_dict() if est is not None else None
        return out


def _memory_estimate(usages: list[Usage], *, resource: str, confidence: float,
                     options: VpaOptions, minimum: float, source: str) -> Estimate | None:
    hist = memory_histogram(options)
    peaks = samples = bumps = 0
    observed, times = 0.0, []
    for u in usages:
        series = u.memory if resource == MEMORY else u.gpu_memory
        ooms = u.memory_ooms if resource == MEMORY else u.gpu_ooms
        if not series and not ooms:
            continue
        for peak in interval_peaks(series, ooms, options):
            hist.add(peak.value, 1.0, peak.window_end_s)
            peaks += 1
        samples += len(series)
        bumps += len(ooms)
        observed = max([observed] + [v for _, v in series])
        times += [t for t, _ in series] + [t for t, _ in ooms]
    if not peaks:
        return None
    return estimate(hist, resource=resource, unit="bytes", minimum=minimum,
                    confidence=confidence, options=options, max_observed=observed,
                    samples=samples, peaks=peaks, oom_bumps=bumps,
                    first_sample_s=min(times), last_sample_s=max(times), source=source)


def _cpu_estimate(usages: list[Usage], options: VpaOptions, host_cpus: float | None,
                  confidence: float) -> Estimate | None:
    hist = cpu_histogram(options)
    series = [s for u in usages for s in u.cpu]
    if not series:
        return None
    for at, cores in series:
        hist.add(cores, 1.0, at)
    times = [t for t, _ in series]
    return estimate(hist, resource=CPU, unit="cores", minimum=options.min_cpu_cores,
                    confidence=confidence, options=options,
                    max_observed=max(c for _, c in series), samples=len(series), peaks=0,
                    oom_bumps=0, first_sample_s=min(times), last_sample_s=max(times),
                    source=f"host CPU utilization x {host_cpus:g} CPUs, mean per "
                           f"{options.cpu_sample_interval_s:g} s")


def _confidence(usages: list[Usage]) -> float:
    """From the CPU samples (as VPA); from the memory samples when there are none."""
    series = ([s for u in usages for s in u.cpu] or [s for u in usages for s in u.memory]
              or [s for u in usages for s in u.gpu_memory])
    if not series:
        return 0.0
    times = [t for t, _ in series]
    return confidence_days(min(times), max(times), len(series))


def recommend_for(usages: list[Usage], *, scope: str, key: str, start_s: float, end_s: float,
                  options: VpaOptions, host_cpus: float | None) -> Recommendation:
    """The recommendation for the containers ``usages`` (one instance, or a model's)."""
    confidence = _confidence(usages)
    notes = []
    cpu = _cpu_estimate(usages, options, host_cpus, confidence)
    if cpu is None and any(u.cpu_intervals for u in usages):
        notes.append("CPU utilization was recorded, but the hosts' CPU count is unknown: "
                     "pass host_cpus to turn it into cores")
    elif cpu is None:
        notes.append("no CPU figures: these instances sampled a GPU, and the GPU sampler "
                     "records no CPU utilization")
    memory = _memory_estimate(usages, resource=MEMORY, confidence=confidence, options=options,
                              minimum=options.min_memory_bytes,
                              source="serving process resident size (RSS)")
    gpu = _memory_estimate(usages, resource=GPU_MEMORY, confidence=confidence, options=options,
                           minimum=0.0, source="PyTorch reserved bytes and batch memory peaks")
    if any(len(u.models) > 1 for u in usages):
        notes.append("an instance serving several models counts whole for each of them")
    totals = [u.gpu_total_bytes for u in usages if u.gpu_total_bytes]
    if gpu is not None and totals and gpu.target > min(totals):
        notes.append(f"the GPU memory target ({gpu.target / 2 ** 30:.1f} GiB) is more than the "
                     f"device has ({min(totals) / 2 ** 30:.1f} GiB): give the model a larger "
                     "GPU, or lower max_batch_size so batches fit")
    return Recommendation(scope=scope, key=key,
                          instances=tuple(sorted(u.instance_id for u in usages)),
                          models=tuple(sorted({m for u in usages for m in u.models})),
                          start_s=start_s, end_s=end_s, host_cpus=host_cpus, cpu=cpu,
                          memory=memory, gpu_memory=gpu,
                          gpu_total_bytes=min(totals) if totals else None,
                          notes=tuple(notes))


def recommend(engine: Engine, *, end_s: float, start_s: float | None = None,
              model: str | None = None, instance_id: str | None = None,
              host_cpus: float | None = None,
              options: VpaOptions | None = None) -> list[Recommendation]:
    """One recommendation per model and one per instance from the recorded history
    (``options.history_s`` back from ``end_s`` unless ``start_s`` is given); models first.

    ``host_cpus``: the CPU count of the hosts the instances ran on, to turn their CPU
    utilization into cores (without it there is no CPU estimate).
    """
    options = options or VpaOptions()
    start = end_s - options.history_s if start_s is None else start_s
    usage = load_usage(engine, start, end_s, options=options, host_cpus=host_cpus,
                       instance_id=instance_id)
    return from_usage(usage, start_s=start, end_s=end_s, model=model, options=options,
                      host_cpus=host_cpus)


def from_usage(usage: dict[str, Usage], *, start_s: float, end_s: float,
               model: str | None = None, options: VpaOptions | None = None,
               host_cpus: float | None = None) -> list[Recommendation]:
    """``recommend`` over usage already loaded with ``load_usage``."""
    options = options or VpaOptions()
    common = dict(start_s=start_s, end_s=end_s, options=options, host_cpus=host_cpus)
    models = sorted({m for u in usage.values() for m in u.models})
    out = [recommend_for([u for u in usage.values() if m in u.models], scope="model", key=m,
                         **common)
           for m in models if model is None or m == model]
    out += [recommend_for([u], scope="instance", key=iid, **common)
            for iid, u in sorted(usage.items()) if model is None or model in u.models]
    return out


def for_snapshot(engine: Engine, window, *, host_cpus: float | None = None) -> list[dict]:
    """The recommendations over a snapshot's window (``start_s``, ``end_s``, ``model``,
    ``instance_id``), as plain JSON values for its manifest."""
    recs = recommend(engine, end_s=window.end_s, start_s=window.start_s, model=window.model,
                     instance_id=window.instance_id, host_cpus=host_cpus)
    return [r.to_dict() for r in recs]


# -- Kubernetes quantities and the resources block ---------------------------------------
def cpu_quantity(cores: float) -> str:
    """Cores as a Kubernetes quantity, rounded up to the millicore (``"250m"``, ``"2"``)."""
    milli = max(1, int(math.ceil(round(cores * 1000.0, 6))))
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def memory_quantity(num_bytes: float) -> str:
    """Bytes as a Kubernetes quantity, rounded up to the MiB (``"512Mi"``, ``"2Gi"``)."""
    mib = max(1, int(math.ceil(round(num_bytes / MIB, 6))))
    return f"{mib // 1024}Gi" if mib % 1024 == 0 else f"{mib}Mi"


def _limit(est: Estimate, options: VpaOptions) -> float:
    return min(max(est.upper, est.target), options.limit_ratio * est.target)


def resources(rec: Recommendation, options: VpaOptions | None = None) -> dict:
    """The container's ``resources:`` block: requests at the target, limits at the upper
    bound capped at ``limit_ratio`` times the request, one GPU when the instances ran on
    one. A resource without figures is left out (the caller's default applies)."""
    options = options or VpaOptions()
    requests, limits = {}, {}
    if rec.cpu is not None:
        requests["cpu"] = cpu_quantity(rec.cpu.target)
        limits["cpu"] = cpu_quantity(_limit(rec.cpu, options))
    if rec.memory is not None:
        requests["memory"] = memory_quantity(rec.memory.target)
        limits["memory"] = memory_quantity(_limit(rec.memory, options))
    if rec.gpu_memory is not None:
        limits["nvidia.com/gpu"] = 1
    out = {}
    if requests:
        out["requests"] = requests
    if limits:
        out["limits"] = limits
    return out

