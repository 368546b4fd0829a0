"""Fleet queries over several instances recorded into one real database.

Rows go through the real ``Recorder`` and the control table functions the runtime uses;
every expected number is computed here with numpy from the very rows written.
"""

from __future__ import annotations

import numpy as np
import pytest

from batchscope.analysis import fleet
from batchscope.analysis.queries import Window
from batchscope.storage import control
from batchscope.storage.records import BatchRow, DeviceRow, RequestRow
from batchscope.storage.recorder import Recorder

pytestmark = pytest.mark.both_backends

NOW = 1_800_000_000.0
W = Window(NOW - 600.0, NOW)


def exact(values, p: float) -> float:
    """numpy's nearest-rank percentile (the definition the queries use)."""
    return float(np.percentile(np.asarray(values), p, method="inverted_cdf"))


def requests_of(iid: str, model: str, latencies, *, start: float, outcome: str = "ok") -> list:
    return [RequestRow(instance_id=iid, model=model, batch_seq=i // 4, priority=0,
                       arrived_at=start + i * 0.5 - lat, finished_at=start + i * 0.5,
                       queue_wait_s=lat / 2, latency_s=float(lat), outcome=outcome)
            for i, lat in enumerate(latencies)]


def batches_of(iid: str, model: str, sizes, depths, *, start: float, version: int = 1) -> list:
    return [BatchRow(instance_id=iid, model=model, seq=i + 1, policy="dynamic",
                     settings_version=version, max_batch_size=16, bucket=None, batch_size=int(s),
                     real_elements=int(s), padded_elements=int(s), queue_wait_min_s=0.0,
                     queue_wait_mean_s=0.001, queue_wait_max_s=0.002, compute_s=0.01,
                     started_at=start + i - 0.01, ended_at=start + i, queue_depth=int(d))
            for i, (s, d) in enumerate(zip(sizes, depths))]


def record(db, rows: list) -> None:
    rec = Recorder(db, flush_interval_s=0.01)
    rec.put_many(rows)
    rec.flush()
    rec.close()
    assert rec.dropped == 0


def register(db, iid: str, models: list[str], *, started: float, seen: float, host: str) -> None:
    control.register_instance(db, instance_id=iid, host=host, pid=1, models=models, url=None,
                              device="cpu", version="test", now=started)
    control.heartbeat(db, iid, seen)


@pytest.fixture
def fleet_db(db):
    """Three instances: ``a`` and ``b`` serve mlp (b with slower, fewer requests), ``c``
    serves encoder and stopped; plus rows outside the window that must not count."""
    rng = np.random.default_rng(7)
    lat = {"a": rng.gamma(2.0, 0.004, 400), "b": rng.gamma(2.0, 0.03, 120),
           "c": rng.gamma(2.0, 0.01, 200)}
    register(db, "a", ["mlp"], started=NOW - 3600, seen=NOW - 1, host="node-1")
    register(db, "b", ["mlp"], started=NOW - 300, seen=NOW - 45, host="node-2")
    register(db, "c", ["encoder"], started=NOW - 3600, seen=NOW - 100, host="node-1")
    control.mark_stopped(db, "c", NOW - 100)
    control.publish_settings(db, instance_id="a", model="mlp", version=3,
                             settings={"max_batch_size": 16}, kind="request", now=NOW - 10)
    rows = (requests_of("a", "mlp", lat["a"], start=NOW - 500)
            + requests_of("a", "mlp", [9.0] * 5, start=NOW - 5000)  # before the window
            + requests_of("a", "mlp", [0.2] * 7, start=NOW - 400, outcome="rejected")
            + requests_of("b", "mlp", lat["b"], start=NOW - 290)
            + requests_of("c", "encoder", lat["c"], start=NOW - 500)
            + batches_of("a", "mlp", [4, 8, 12, 16], [3, 5, 7, 9], start=NOW - 100)
            + batches_of("b", "mlp", [2, 2, 4], [0, 1, 2], start=NOW - 100, version=5)
            + [DeviceRow(instance_id="a", at=NOW - 50 + i, device="cpu", kind="cpu",
                         utilization_pct=u) for i, u in enumerate((40.0, 60.0, 80.0))])
    record(db, rows)
    return db, lat


def test_per_instance_rows_carry_state_load_and_exact_percentiles(fleet_db):
    db, lat = fleet_db
    table = fleet.instance_table(db, W, now=NOW).set_index(["instance_id", "model"])
    a, b, c = table.loc[("a", "mlp")], table.loc[("b", "mlp")], table.loc[("c", "encoder")]
    assert (a["state"], b["state"], c["state"]) == ("live", "stale", "stopped")
    assert (a["node"], b["node"]) == ("node-1", "node-2")
    assert a["heartbeat_age_s"] == pytest.approx(1.0)
    assert a["requests"] == 407 and a["ok"] == 400 and a["rejected"] == 7
    for iid, row in (("a", a), ("b", b), ("c", c)):
        assert row["latency_p50_s"] == pytest.approx(exact(lat[iid], 50), abs=0)
        assert row["latency_p99_s"] == pytest.approx(exact(lat[iid], 99), abs=0)
    assert a["mean_batch_size"] == pytest.approx(10.0)
    assert a["queue_depth_mean"] == pytest.approx(6.0) and a["queue_depth_last"] == 9
    assert b["queue_depth_last"] == 2
    assert a["utilization_mean_pct"] == pytest.approx(60.0)
    # published settings win; without them the last batch's version
    assert a["settings_version"] == 3 and b["settings_version"] == 5
    # throughput over the part of the window each one was up: a the whole window,
    # b from its start to its last heartbeat (stale), c until it stopped
    assert a["ok_per_s"] == pytest.approx(400 / 600.0)
    assert b["ok_per_s"] == pytest.approx(120 / (NOW - 45 - (NOW - 300)))
    assert c["ok_per_s"] == pytest.approx(200 / 500.0)


def test_fleet_percentiles_rank_every_row_together(fleet_db):
    db, lat = fleet_db
    per_model = fleet.fleet_latency(db, W).set_index("model")
    both = np.concatenate([lat["a"], lat["b"]])
    mlp = per_model.loc["mlp"]
    assert mlp["instances"] == 2 and mlp["ok"] == 520 and mlp["rejected"] == 7
    for p in (50, 95, 99):
        assert mlp[f"latency_p{p}_s"] == pytest.approx(exact(both, p), abs=0)
    # the exact fleet p99 is not what averaging the replicas' p99 would say
    averaged = (exact(lat["a"], 99) + exact(lat["b"], 99)) / 2
    assert abs(mlp["latency_p99_s"] - averaged) > 0.01
    assert per_model.loc["encoder", "latency_p50_s"] == pytest.approx(exact(lat["c"], 50), abs=0)


def test_model_filter_and_busiest(fleet_db):
    db, _ = fleet_db
    only = fleet.instance_table(db, Window(W.start_s, W.end_s, "encoder"), now=NOW)
    assert list(zip(only["instance_id"], only["model"])) == [("c", "encoder")]
    assert fleet.busiest(db, W) == ("a", "mlp")
    assert fleet.busiest(db, Window(NOW + 10, NOW + 20)) is None


def test_registered_instance_without_traffic_is_listed(fleet_db):
    db, _ = fleet_db
    register(db, "d", ["mlp"], started=NOW - 20, seen=NOW - 2, host="node-3")
    row = fleet.instance_table(db, W, now=NOW).set_index(["instance_id", "model"]).loc[("d", "mlp")]
    assert row["state"] == "live" and row["requests"] == 0 and row["ok_per_s"] == 0.0


def test_timeline_counts_each_instance(fleet_db):
    db, _ = fleet_db
    t = fleet.throughput_timeline(db, Window(W.start_s, W.end_s, "mlp"), bucket_s=60.0)
    totals = (t.groupby("instance_id")["ok_per_s"].sum() * 60.0).round().astype(int).to_dict()
    assert totals == {"a": 400, "b": 120}


def test_state_of():
    assert fleet.state_of(NOW - 5, None, now=NOW) == "live"
    assert fleet.state_of(NOW - 11, None, now=NOW) == "stale"
    assert fleet.state_of(NOW - 1, NOW - 1, now=NOW) == "stopped"
    assert fleet.state_of(NOW - 30, None, now=NOW, stale_after_s=60) == "live"


def test_instances_gone_before_the_window_are_left_out(fleet_db):
    db, _ = fleet_db
    register(db, "old", ["mlp"], started=NOW - 9000, seen=NOW - 8000, host="node-9")
    assert "old" not in set(fleet.instance_table(db, W, now=NOW)["instance_id"])
    assert "old" not in set(fleet.bundle(db, W, now=NOW)["instances"]["id"])
    assert "old" in set(fleet.instances(db, now=NOW)["id"])
