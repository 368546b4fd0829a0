"""Recommendations from rows recorded into a real database: what is read from the device
samples, batches and OOM events, per instance and per model."""

from __future__ import annotations

import json
import math

import pytest

from batchscope.analysis import recommend
from batchscope.analysis.queries import Window
from batchscope.storage import control
from batchscope.storage.records import BatchRow, DeviceRow, EventRow
from batchscope.storage.recorder import Recorder
from batchscope.testing import synthetic

pytestmark = pytest.mark.both_backends

GIB, MIB = 2 ** 30, 2 ** 20
END = 1_800_000_000.0
HOUR = 3600.0
OPTS = recommend.VpaOptions()
CPU_BUCKETS = recommend.cpu_histogram(OPTS).buckets
MEM_BUCKETS = recommend.memory_histogram(OPTS).buckets


def cpu_end(cores: float) -> float:
    """The end of the CPU bucket holding ``cores`` (the bucket arithmetic itself is
    checked against VPA's formula in test_recommend_vpa)."""
    return CPU_BUCKETS.start(CPU_BUCKETS.find(cores) + 1)


def mem_end(num_bytes: float) -> float:
    return MEM_BUCKETS.start(MEM_BUCKETS.find(num_bytes) + 1)


def cpu_rows(iid: str, *, pct: float, rss: int, hours: float = 2.0, every_s: float = 10.0) -> list:
    n = int(hours * HOUR / every_s)
    return [DeviceRow(instance_id=iid, at=END - hours * HOUR + i * every_s, device="cpu",
                      kind="cpu", utilization_pct=pct, memory_used_bytes=8 * GIB,
                      memory_total_bytes=16 * GIB, process_rss_bytes=rss) for i in range(n)]


def gpu_rows(iid: str, *, reserved: int, hours: float = 2.0) -> list:
    n = int(hours * HOUR / 10)
    return [DeviceRow(instance_id=iid, at=END - hours * HOUR + i * 10, device="cuda:0", kind="gpu",
                      utilization_pct=70.0, memory_used_bytes=reserved + GIB,
                      memory_total_bytes=16 * GIB, torch_reserved_bytes=reserved,
                      process_rss_bytes=3 * GIB) for i in range(n)]


def batch(iid: str, model: str, at: float, peak: int | None) -> BatchRow:
    return BatchRow(instance_id=iid, model=model, seq=int(at), policy="dynamic", settings_version=1,
                    max_batch_size=16, bucket=None, batch_size=8, real_elements=8, padded_elements=8,
                    queue_wait_min_s=0.0, queue_wait_mean_s=0.001, queue_wait_max_s=0.002,
                    compute_s=0.01, started_at=at - 0.01, ended_at=at, peak_memory_bytes=peak)


def oom(iid: str, model: str, at: float, memory: dict) -> EventRow:
    return EventRow(instance_id=iid, model=model, at=at, kind="oom", severity="error",
                    message="out of memory", details_json=json.dumps({"memory": memory}))


def record(db, rows: list) -> None:
    rec = Recorder(db, flush_interval_s=0.01)
    rec.put_many(rows)
    rec.flush()
    rec.close()


def by_name(recs) -> dict:
    return {r.name: r for r in recs}


def test_cpu_memory_per_instance_and_per_model(db):
    record(db, cpu_rows("a", pct=50.0, rss=1 * GIB) + cpu_rows("b", pct=25.0, rss=2 * GIB)
           + [batch("a", "mlp", END - 60, None), batch("b", "mlp", END - 60, None)])
    recs = by_name(recommend.recommend(db, end_s=END, start_s=END - 3 * HOUR, host_cpus=4))
    a, b, mlp = recs["instance a"], recs["instance b"], recs["model mlp"]
    assert a.cpu.samples == 120  # 2 h of 10 s samples, averaged per minute
    assert a.cpu.max_observed == pytest.approx(2.0)  # 50 % of 4 CPUs
    assert a.cpu.target == pytest.approx(cpu_end(2.0) * 1.15)
    assert b.cpu.target == pytest.approx(cpu_end(1.0) * 1.15)
    assert a.memory.peaks == 1 and a.memory.target == pytest.approx(mem_end(GIB) * 1.15)
    assert a.gpu_memory is None
    # the model's containers together, as VPA aggregates a Deployment's pods
    assert mlp.instances == ("a", "b") and mlp.cpu.samples == 240
    assert mlp.cpu.p50 == pytest.approx(cpu_end(1.0)) and mlp.cpu.p90 == pytest.approx(cpu_end(2.0))
    assert mlp.memory.peaks == 2 and mlp.memory.target == pytest.approx(mem_end(2 * GIB) * 1.15)
    assert mlp.cpu.confidence_days == pytest.approx(min((2 * HOUR - 60) / 86400, 240 / 1440), rel=0.02)
    block = recommend.resources(mlp)
    assert set(block["requests"]) == {"cpu", "memory"} and "nvidia.com/gpu" not in block["limits"]
    json.dumps([r.to_dict() for r in recs.values()], allow_nan=False)


def test_history_window_bounds_the_samples(db):
    record(db, cpu_rows("a", pct=50.0, rss=GIB, hours=2.0))
    (only,) = [r for r in recommend.recommend(db, end_s=END, start_s=END - HOUR, host_cpus=4)
               if r.scope == "instance"]
    assert only.cpu.samples == 60


def test_without_host_cpus_there_is_no_cpu_estimate(db):
    record(db, cpu_rows("a", pct=50.0, rss=GIB) + [batch("a", "mlp", END - 60, None)])
    rec = by_name(recommend.recommend(db, end_s=END, host_cpus=None))["instance a"]
    assert rec.cpu is None and rec.memory is not None
    assert any("host_cpus" in n for n in rec.notes)


def test_gpu_memory_from_reserved_bytes_and_batch_peaks(db):
    record(db, gpu_rows("g", reserved=4 * GIB)
           + [batch("g", "encoder", END - 600, 6 * GIB), batch("g", "encoder", END - 300, 5 * GIB)])
    rec = by_name(recommend.recommend(db, end_s=END, host_cpus=8))["model encoder"]
    assert rec.gpu_memory.max_observed == 6 * GIB  # the batch peak beats the reserved bytes
    assert rec.gpu_memory.target == pytest.approx(mem_end(6 * GIB) * 1.15)
    assert rec.memory.target == pytest.approx(mem_end(3 * GIB) * 1.15)  # the process' RSS
    assert rec.cpu is None and any("GPU sampler" in n for n in rec.notes)
    assert rec.gpu_total_bytes == 16 * GIB
    assert recommend.resources(rec)["limits"]["nvidia.com/gpu"] == 1


def test_oom_events_bump_the_memory_they_ran_out_of(db):
    record(db, gpu_rows("g", reserved=4 * GIB) + cpu_rows("c", pct=10.0, rss=1 * GIB)
           + [batch("g", "encoder", END - 600, 5 * GIB), batch("c", "mlp", END - 600, None),
              oom("g", "encoder", END - 500, {"peak_bytes": 7 * GIB, "reserved_bytes": 6 * GIB,
                                              "allocated_bytes": 5 * GIB, "total_bytes": 16 * GIB}),
              oom("c", "mlp", END - 500, {"allocated_bytes": None, "rss_bytes": int(1.5 * GIB)})])
    recs = by_name(recommend.recommend(db, end_s=END, host_cpus=8))
    g, c = recs["instance g"], recs["instance c"]
    assert g.gpu_memory.oom_bumps == 1 and g.memory.oom_bumps == 0
    assert g.gpu_memory.target == pytest.approx(mem_end(7 * GIB * 1.2) * 1.15)
    assert c.memory.oom_bumps == 1 and c.gpu_memory is None
    assert c.memory.target == pytest.approx(mem_end(1.5 * GIB * 1.2) * 1.15)


def test_a_gpu_target_beyond_the_device_is_said(db):
    synthetic.generate(db, synthetic.SCENARIOS["repeated_oom"].with_(duration_s=120), end_s=END)
    (rec,) = [r for r in recommend.recommend(db, end_s=END) if r.scope == "model"]
    assert rec.gpu_memory.oom_bumps == 6
    assert rec.gpu_memory.target > 16 * GIB
    assert any("more than the device has" in n for n in rec.notes)
    assert math.isinf(rec.gpu_memory.upper) or rec.gpu_memory.upper >= rec.gpu_memory.target


def test_snapshot_entries_are_plain_json(db):
    record(db, cpu_rows("a", pct=50.0, rss=GIB) + [batch("a", "mlp", END - 60, None)])
    window = Window(END - HOUR, END, "mlp", None)
    entries = recommend.for_snapshot(db, window, host_cpus=4)
    assert [(e["scope"], e["key"]) for e in entries] == [("model", "mlp"), ("instance", "a")]
    again = json.loads(json.dumps(entries, allow_nan=False))
    # an hour of history bounds nothing: no upper figure, and the entry says why
    assert again[0]["cpu"]["samples"] == 60 and again[0]["cpu"]["upper"] is None
    assert again[0]["cpu"]["upper_note"].startswith("not enough history for an upper bound")
    assert again[0]["memory"]["source"].startswith("serving process resident size")


def test_a_replica_without_traffic_counts_for_the_models_it_registered(db):
    control.register_instance(db, instance_id="spare", host="h", pid=1, models=["mlp"], url=None,
                              device="cpu", version="t", now=END - HOUR)
    record(db, cpu_rows("a", pct=50.0, rss=GIB) + [batch("a", "mlp", END - 60, None)]
           + cpu_rows("spare", pct=10.0, rss=GIB // 2))
    rec = by_name(recommend.recommend(db, end_s=END, host_cpus=4))["model mlp"]
    assert rec.instances == ("a", "spare")


def test_the_host_cpu_count_comes_from_the_registered_instances(db):
    assert recommend.registered_host_cpus(db) is None  # nobody registered yet
    for iid, cpus in (("a", 8), ("b", 8)):
        control.register_instance(db, instance_id=iid, host="h", pid=1, models=["mlp"], url=None,
                                  device="cpu", version="t", now=1_700_000_000.0, cpu_count=cpus)
    assert recommend.registered_host_cpus(db) == 8
    control.register_instance(db, instance_id="c", host="h2", pid=2, models=["mlp"], url=None,
                              device="cpu", version="t", now=1_700_000_000.0, cpu_count=4)
    assert recommend.registered_host_cpus(db) is None  # hosts differ: the caller must say
    assert recommend.registered_host_cpus(db, "c") == 4
