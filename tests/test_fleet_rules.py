"""Fleet diagnosis rules on constructed fleets: each fires on its problem, stays quiet on a
healthy fleet, and does not fire on look-alikes."""

from __future__ import annotations

import pytest

from batchscope.analysis import fleet, fleet_rules
from batchscope.analysis.queries import Window
from batchscope.storage import control
from batchscope.storage.records import BatchRow, RequestRow
from batchscope.storage.recorder import Recorder

NOW = 1_800_000_000.0
W = Window(NOW - 300.0, NOW)
SETTINGS = {"policy": "dynamic", "max_batch_size": 16, "max_queue_delay_ms": 5.0}


def replica(db, iid: str, *, ok: int, rejected: int = 0, depth: int = 0, seen: float = NOW - 1,
            model: str = "mlp", settings: dict | None = None, version: int = 1,
            stopped: bool = False) -> None:
    """Register ``iid``, publish its settings and record ``ok`` served and ``rejected``
    refused requests and batches whose queue depth is ``depth``."""
    control.register_instance(db, instance_id=iid, host=f"host-{iid}", pid=1, models=[model],
                              url=None, device="cpu", version="test", now=NOW - 280)
    control.publish_settings(db, instance_id=iid, model=model, version=version,
                             settings=settings or SETTINGS, kind="request", now=NOW - 280)
    rows = [RequestRow(instance_id=iid, model=model, batch_seq=None, priority=0,
                       arrived_at=NOW - 250 + i * 0.1, finished_at=NOW - 250 + i * 0.1 + 0.01,
                       queue_wait_s=0.001, latency_s=0.01, outcome="ok") for i in range(ok)]
    rows += [RequestRow(instance_id=iid, model=model, batch_seq=None, priority=0,
                        arrived_at=NOW - 200 + i * 0.1, finished_at=NOW - 200 + i * 0.1,
                        queue_wait_s=0.0, latency_s=0.0, outcome="rejected") for i in range(rejected)]
    rows += [BatchRow(instance_id=iid, model=model, seq=i + 1, policy="dynamic", settings_version=version,
                      max_batch_size=16, bucket=None, batch_size=8, real_elements=8, padded_elements=8,
                      queue_wait_min_s=0.0, queue_wait_mean_s=0.001, queue_wait_max_s=0.002,
                      compute_s=0.01, started_at=NOW - 240 + i, ended_at=NOW - 240 + i + 0.01,
                      queue_depth=depth) for i in range(10)]
    rec = Recorder(db, flush_interval_s=0.01)
    rec.put_many(rows)
    rec.flush()
    rec.close()
    control.heartbeat(db, iid, seen)
    if stopped:
        control.mark_stopped(db, iid, seen)


def flags(db, rule: str | None = None) -> list:
    found = fleet_rules.diagnose(fleet.bundle(db, W, now=NOW))
    return [f for f in found if rule is None or f.rule == rule]


def test_a_healthy_fleet_has_no_flags(db):
    replica(db, "a", ok=400, depth=2)
    replica(db, "b", ok=380, depth=1)
    assert flags(db) == []


def test_imbalance_one_saturated_one_idle(db):
    replica(db, "a", ok=900, rejected=60, depth=80)
    replica(db, "b", ok=30, depth=0)
    (flag,) = flags(db, "imbalance")
    assert flag.severity == "critical" and flag.chart == "fleet_throughput"
    assert [r["instance"] for r in flag.evidence["saturated"]] == ["a"]
    assert [r["instance"] for r in flag.evidence["idle"]] == ["b"]
    assert flag.evidence["busiest_request_share"] > 0.9
    assert flag.evidence["saturated"][0]["rejected_fraction"] == pytest.approx(60 / 960, abs=1e-4)


def test_a_live_replica_with_no_traffic_counts_as_idle(db):
    replica(db, "a", ok=900, depth=64)  # four full batches waiting on average
    replica(db, "b", ok=0)
    (flag,) = flags(db, "imbalance")
    assert flag.evidence["idle"][0]["ok_per_s"] == 0.0


@pytest.mark.parametrize("case", ["all saturated", "idle one is stale", "single replica"])
def test_imbalance_quiet_on_look_alikes(db, case):
    replica(db, "a", ok=900, rejected=60, depth=80)
    if case == "all saturated":  # overload of the whole fleet, not routing
        replica(db, "b", ok=850, rejected=50, depth=70)
    elif case == "idle one is stale":  # not serving any more: the other rule's business
        replica(db, "b", ok=30, seen=NOW - 60)
    assert flags(db, "imbalance") == []


def test_settings_drift_names_the_differing_settings(db):
    replica(db, "a", ok=100, version=2)
    replica(db, "b", ok=100, version=7, settings={**SETTINGS, "max_batch_size": 32})
    (flag,) = flags(db, "settings_drift")
    assert flag.evidence["differences"] == {"max_batch_size": {"a": 16, "b": 32}}
    assert flag.evidence["settings_versions"] == {"a": 2, "b": 7}


def test_settings_drift_quiet_on_equal_settings_and_stopped_replicas(db):
    replica(db, "a", ok=100, version=2)
    replica(db, "b", ok=100, version=9)  # other version number, same settings
    replica(db, "c", ok=100, settings={**SETTINGS, "policy": "static"}, stopped=True)
    assert flags(db, "settings_drift") == []


def test_stopped_reporting_fires_for_a_stale_replica_that_served(db):
    replica(db, "a", ok=100)
    replica(db, "b", ok=100, seen=NOW - 42)
    (flag,) = flags(db, "stopped_reporting")
    assert flag.evidence["instance"] == "b" and flag.severity == "critical"
    assert flag.evidence["heartbeat_age_s"] == pytest.approx(42.0)
    assert flag.evidence["requests_in_window"] == 100


def test_stopped_reporting_quiet_for_clean_stops_and_old_instances(db):
    replica(db, "a", ok=100)
    replica(db, "b", ok=100, seen=NOW - 42, stopped=True)  # said goodbye
    control.register_instance(db, instance_id="old", host="h", pid=1, models=["mlp"], url=None,
                              device="cpu", version="t", now=NOW - 9000)
    control.heartbeat(db, "old", NOW - 8000)  # gone long before the window
    assert flags(db, "stopped_reporting") == []


def test_thresholds_are_respected(db):
    replica(db, "a", ok=900, rejected=60, depth=80)
    replica(db, "b", ok=30)
    strict = fleet_rules.FleetThresholds(saturated_rejected_fraction=0.5, saturated_queue_batches=100)
    assert fleet_rules.diagnose(fleet.bundle(db, W, now=NOW), strict) == []
