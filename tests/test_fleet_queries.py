"""Fleet queries over several instances recorded into one real database.

Rows go through the real ``Recorder`` and the control table functions the runtime uses;
every expected number is computed here with numpy from the very rows written.
"""

from __future__ import annotations

import numpy as np
import pytest
from sqlalchemy import text

from batchscope.analysis import fleet
from batchscope.analysis.queries import Window
from batchscope.analysis.queries import exact as exact_figures
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


# -- exact figures from the summaries -----------------------------------------------------
EDGY = Window(NOW - 300.4, NOW - 100.7)  # edges inside a second and inside a 5-second slot


def spread(db, iid: str, latencies, *, start: float, step: float) -> list[RequestRow]:
    rows = requests_of(iid, "mlp", latencies, start=start)
    for i, row in enumerate(rows):  # finishing every ``step`` s, a fraction past the second
        row.finished_at = start + i * step
        row.arrived_at = row.finished_at - row.latency_s
    return rows


@pytest.fixture
def edgy_db(db):
    """Two instances of mlp whose requests finish every 0.13 s / 0.29 s across EDGY and
    beyond it, with latencies over three decades, plus batches at fractional times."""
    rng = np.random.default_rng(11)
    lat = {"a": rng.lognormal(-4.0, 1.2, 2000), "b": rng.lognormal(-3.0, 0.8, 900)}
    register(db, "a", ["mlp"], started=NOW - 3600, seen=NOW - 1, host="node-1")
    register(db, "b", ["mlp"], started=NOW - 3600, seen=NOW - 1, host="node-2")
    rows = spread(db, "a", lat["a"], start=NOW - 330.05, step=0.13)
    rows += spread(db, "b", lat["b"], start=NOW - 320.02, step=0.29)
    rows += batches_of("a", "mlp", [4, 8, 12, 16, 3], [3, 5, 7, 9, 11], start=NOW - 300.9)
    rows += batches_of("a", "mlp", [5, 6], [2, 4], start=NOW - 101.5)  # the last ends after EDGY
    record(db, rows)
    return db, rows


def in_window(rows, w: Window, iid: str | None = None) -> list[RequestRow]:
    return [r for r in rows if isinstance(r, RequestRow) and w.start_s <= r.finished_at < w.end_s
            and (iid is None or r.instance_id == iid) and r.outcome == "ok"]


@pytest.mark.parametrize("w", [EDGY, Window(NOW - 250.3, NOW - 247.9), W], ids=["edges", "short", "aligned"])
def test_counts_and_percentiles_are_those_of_the_raw_rows_at_any_edges(edgy_db, w):
    db, rows = edgy_db
    found = fleet.figures(db, w)
    per_pair = found.per_pair.set_index("instance_id")
    for iid in ("a", "b"):
        mine = in_window(rows, w, iid)
        row = per_pair.loc[iid]
        assert row["requests"] == row["ok"] == len(mine)
        assert row["first_finished_at"] == min(r.finished_at for r in mine)
        assert row["last_finished_at"] == max(r.finished_at for r in mine)
        for p in (50, 95, 99):
            assert row[f"latency_p{p}_s"] == exact([r.latency_s for r in mine], p)
    every = [r.latency_s for r in in_window(rows, w)]
    per_model = found.per_model.set_index("model")
    for p in (50, 95, 99):
        assert per_model.loc["mlp", f"latency_p{p}_s"] == exact(every, p)


def test_batch_figures_and_the_newest_batch_at_fractional_edges(edgy_db):
    db, rows = edgy_db
    a = fleet.figures(db, EDGY).per_pair.set_index("instance_id").loc["a"]
    mine = [r for r in rows if isinstance(r, BatchRow) and EDGY.start_s <= r.ended_at < EDGY.end_s]
    assert a["batches"] == len(mine) == 5  # 4, 8, 12, 16, 3 and 5; 6 ends after the window
    assert a["mean_batch_size"] == pytest.approx(np.mean([r.batch_size for r in mine]))
    assert a["queue_depth_mean"] == pytest.approx(np.mean([r.queue_depth for r in mine]))
    newest = max(mine, key=lambda r: r.ended_at)
    assert (a["queue_depth_last"], a["batch_settings_version"]) == (newest.queue_depth, 1)


def test_exact_percentiles_read_only_the_buckets_that_hold_them(edgy_db):
    db, rows = edgy_db
    found = fleet.figures(db, EDGY)
    total = len(in_window(rows, EDGY))
    assert 0 < found.latencies_read < total / 3  # a few of 32 buckets a decade, not every row


def test_a_bucket_the_summaries_count_differently_falls_back_to_every_latency(edgy_db):
    """Should a database put rows in other buckets than when it summarised them (another
    build's rounding), the group's percentiles come from all its latencies, exact still."""
    db, rows = edgy_db
    with exact_figures.snapshot(db) as conn:
        hist = exact_figures.latency_histogram(conn, W)
    mine = hist[hist["instance_id"] == "b"].sort_values("bucket")
    cum = mine["n"].cumsum().to_numpy()
    p50_bucket = int(mine["bucket"].iloc[int(np.searchsorted(cum, (50 * cum[-1] + 99) // 100))])
    with db.begin() as conn:  # one row of b's p50 bucket counted one bucket higher
        for shift, bucket in ((-1, p50_bucket), (1, p50_bucket + 1)):
            conn.execute(text(
                "UPDATE summary_latency SET n = n + :d WHERE instance_id = 'b' AND outcome = 'ok' "
                "AND bucket = :b AND span_s = 60 AND start_s = (SELECT MIN(start_s) FROM "
                "summary_latency WHERE instance_id = 'b' AND outcome = 'ok' AND span_s = 60 AND "
                "bucket = :p AND n > 1)"), {"d": shift, "b": bucket, "p": p50_bucket})
    with exact_figures.snapshot(db) as conn:
        found = exact_figures.window_percentiles(conn, W)
    assert found.fallbacks == [("b", "mlp")]
    b = found.per_instance.set_index("instance_id").loc["b"]
    for p in (50, 95, 99):
        assert b[f"latency_p{p}_s"] == exact([r.latency_s for r in in_window(rows, W, "b")], p)


def test_a_snapshot_does_not_see_rows_written_after_its_first_read(edgy_db):
    db, _ = edgy_db
    late = requests_of("a", "mlp", [0.5] * 10, start=NOW - 200)
    with exact_figures.snapshot(db) as conn:
        before = exact_figures.window_sums(conn, W).set_index("instance_id").loc["a", "requests"]
        record(db, late)  # another connection writes meanwhile, as the instances do
        assert exact_figures.window_sums(conn, W).set_index("instance_id").loc["a", "requests"] == before
    with db.connect() as conn:
        assert exact_figures.window_sums(conn, W).set_index("instance_id").loc["a", "requests"] == before + 10
