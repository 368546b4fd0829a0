"""Resource recommendations from recorded usage, computed the way the Kubernetes VPA
recommender computes them.

What is measured is ``batchscope.analysis.usage``'s (CPU, memory and GPU memory samples
and out-of-memory events, per instance); how it becomes a recommendation,
``batchscope.analysis.vpa``'s (VPA's recommender with its default flags: decaying
histograms, interval peaks, percentiles with a safety margin and confidence). This module
puts them together per model and instance and writes the Kubernetes resources block.

Several instances serving one model are aggregated like the pods of one VPA target:
their samples and interval peaks go into one histogram. CPU and memory belong to a
process, so an instance serving several models counts whole for each of them.

This module needs only SQLAlchemy and numpy, so ``batchscope k8s`` runs in a serving
install without the dashboard's packages.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sqlalchemy import Engine

from batchscope.analysis.usage import OOM_KINDS, Usage, load_usage, registered_host_cpus
from batchscope.analysis.vpa import (CPU, GPU_MEMORY, MEMORY, MIB, DecayingHistogram, Estimate,
                                     ExponentialBuckets, Peak, VpaOptions, confidence_days,
                                     cpu_histogram, estimate, interval_peaks, memory_histogram,
                                     oom_bump)

__all__ = ["CPU", "GPU_MEMORY", "MEMORY", "MIB", "OOM_KINDS", "DecayingHistogram", "Estimate",
           "ExponentialBuckets", "Peak", "Recommendation", "Usage", "VpaOptions",
           "confidence_days", "cpu_histogram", "cpu_quantity", "estimate", "for_snapshot",
           "from_usage", "interval_peaks", "load_usage", "memory_histogram", "memory_quantity",
           "oom_bump", "recommend", "recommend_for", "registered_host_cpus", "resources"]


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
    capacity, name = _memory_capacity(usages, resource)
    return estimate(hist, resource=resource, unit="bytes", minimum=minimum,
                    confidence=confidence, options=options, capacity=capacity,
                    capacity_name=name, max_observed=observed,
                    samples=samples, peaks=peaks, oom_bumps=bumps,
                    first_sample_s=min(times), last_sample_s=max(times), source=source)


def _memory_capacity(usages: list[Usage], resource: str) -> tuple[float | None, str]:
    """What the smallest host (memory) or device (GPU memory) of ``usages`` has: no
    upper bound is above it."""
    attr, what = (("host_memory_bytes", "host's memory") if resource == MEMORY
                  else ("gpu_total_bytes", "device's memory"))
    known = [getattr(u, attr) for u in usages if getattr(u, attr)]
    if not known:
        return None, ""
    return min(known), f"the {what} ({min(known) / 2 ** 30:.1f} GiB)"


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
                    confidence=confidence, options=options, capacity=host_cpus,
                    capacity_name=f"the host's {host_cpus:g} CPUs",
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
    budget = sum(u.budget_ooms for u in usages)
    if budget:
        notes.append(f"{budget} batch(es) refused by a configured memory budget "
                     "(memory_budget_mb) are not counted as out-of-memory kills: nothing ran "
                     "out, and more memory would not let them through")
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
