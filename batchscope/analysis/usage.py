"""What was recorded of a model's resource use, read for the recommender
(``load_usage``; ``batchscope.analysis.recommend``).

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
  a GPU) bumps the GPU memory, one with only ``rss_bytes`` bumps the memory. A batch
  refused by a configured memory budget (``memory_budget_mb``: its estimate was over the
  budget, nothing ran out) bumps nothing: VPA bumps on the container's OOM kills, and more
  memory would not let such a batch through. They are counted (``budget_ooms``).
- What the host has: the CPU sampler's ``memory_total_bytes`` (the host's memory), which
  caps the memory upper bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from sqlalchemy import Engine, text

from batchscope.analysis.vpa import VpaOptions

OOM_KINDS = ("oom", "oom_failed")


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
    #: batches refused by a configured memory budget (not OOM kills: they bump nothing)
    budget_ooms: int = 0
    #: the host's memory, from the CPU sampler (None when unknown)
    host_memory_bytes: float | None = None
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


def is_budget_oom(details_json: str | None) -> bool:
    """Whether an OOM event is a batch refused by ``memory_budget_mb`` (the runtime's
    ``MemoryBudgetExceeded``: an estimate over a configured budget, not memory running out)."""
    try:
        details = json.loads(details_json or "{}")
    except ValueError:
        return False
    error = str(details.get("error", "")) if isinstance(details, dict) else ""
    return "MemoryBudgetExceeded" in error or "memory_budget_mb" in error


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
                   MAX(CASE WHEN kind = 'gpu' THEN memory_total_bytes END) AS gpu_total_bytes,
                   MAX(CASE WHEN kind = 'cpu' THEN memory_total_bytes END) AS host_memory_bytes
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
        if row.host_memory_bytes is not None:
            u.host_memory_bytes = max(u.host_memory_bytes or 0.0, float(row.host_memory_bytes))

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
        if is_budget_oom(row.details_json):
            u.budget_ooms += 1
            continue
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
