"""Read queries against a database filled by ``synthetic`` with known numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from batchscope.analysis import queries
from batchscope.testing import synthetic
from batchscope.storage.db import make_engine
from batchscope.analysis.queries import Window, nearest_rank

END = 2_000_000_000.0

pytestmark = pytest.mark.both_backends


@pytest.fixture(scope="module")
def filled(backend, new_database_url):
    engine = make_engine(new_database_url(backend))
    mlp = synthetic.generate(engine, synthetic.HEALTHY.with_(
        duration_s=120, batches_per_s=5, rejected_per_s=0.5, expired_per_s=0.25), end_s=END, seed=1)
    enc = synthetic.generate(engine, synthetic.SCENARIOS["padding"].with_(
        duration_s=120, batches_per_s=3), end_s=END, seed=2)
    yield engine, mlp, enc
    engine.dispose()


def test_headline_counts_and_exact_percentiles(filled):
    engine, mlp, _ = filled
    h = queries.headline(engine, Window(END - 200, END + 1, "mlp")).iloc[0]
    assert h["batches"] == mlp.batches == 600
    assert h["rejected"] == 60 and h["expired"] == 30
    assert h["requests"] == mlp.requests
    assert h["ok"] == len(mlp.latencies_ok_s)
    for p in (50, 95, 99):
        assert h[f"latency_p{p}"] == pytest.approx(nearest_rank(mlp.latencies_ok_s, p), abs=1e-12)
    assert h["mean_batch_size"] == pytest.approx(mlp.batch_sizes.mean())
    assert h["max_batch_size"] == 32


def test_model_filter_and_all_models(filled):
    engine, mlp, enc = filled
    every = queries.headline(engine, Window(END - 200, END + 1)).iloc[0]
    assert every["batches"] == mlp.batches + enc.batches
    assert queries.models(engine) == ["encoder", "mlp"]
    share = queries.model_share(engine, Window(END - 200, END + 1, "mlp"))
    assert list(share["model"]) == ["encoder", "mlp"]
    assert share["share"].sum() == pytest.approx(1.0)


def test_batch_size_histogram_matches_generated(filled):
    engine, mlp, _ = filled
    sizes = queries.batch_sizes(engine, Window(END - 200, END + 1, "mlp"))
    counts = np.bincount(mlp.batch_sizes)
    assert {int(s): int(n) for s, n in zip(sizes["batch_size"], sizes["batches"])} == \
        {s: int(n) for s, n in enumerate(counts) if n}


def test_timeline_buckets_hold_exact_per_bucket_percentiles(filled):
    engine, _, _ = filled
    w = Window(END - 120, END, "mlp")
    tl = queries.request_timeline(engine, w, bucket_s=30)
    assert tl["requests"].sum() > 0
    assert (tl["t"] % 30 == 0).all()
    # recompute one bucket's percentile straight from the rows
    t0 = float(tl["t"].iloc[1])
    with engine.connect() as conn:
        from sqlalchemy import text
        rows = [r[0] for r in conn.execute(text(
            "SELECT latency_s FROM requests WHERE model='mlp' AND outcome='ok' "
            "AND finished_at >= :a AND finished_at < :b"), {"a": t0, "b": t0 + 30})]
    assert tl["latency_p95"].iloc[1] == pytest.approx(nearest_rank(rows, 95), abs=1e-12)
    assert tl["ok"].iloc[1] == len(rows)


def test_a_bucket_cut_by_the_window_is_a_rate_over_the_part_inside(filled):
    # 30-s buckets and a window that starts and ends inside one: the edge buckets hold
    # part of a bucket of rows each, and their rates are those rows over that part
    engine, _, _ = filled
    w = Window(END - 100, END - 10, "mlp")
    tl = queries.request_timeline(engine, w, bucket_s=30)
    t = tl["t"].to_numpy()
    inside = np.minimum(t + 30, w.end_s) - np.maximum(t, w.start_s)
    assert inside[0] < 30 and inside[-1] < 30 and (inside[1:-1] == 30).all()
    assert list(tl["requests_per_s"]) == pytest.approx(list(tl["requests"] / inside))
    batches = queries.batch_timeline(engine, w, bucket_s=30)
    b_inside = np.minimum(batches["t"] + 30, w.end_s) - np.maximum(batches["t"], w.start_s)
    assert list(batches["batches_per_s"]) == pytest.approx(list(batches["batches"] / b_inside))
    # steady traffic reads about the same rate at the edges as inside
    middle = tl["requests_per_s"].iloc[1:-1].mean()
    assert tl["requests_per_s"].iloc[0] == pytest.approx(middle, rel=0.3)
    assert tl["requests_per_s"].iloc[-1] == pytest.approx(middle, rel=0.3)


def test_window_excludes_rows_outside(filled):
    engine, _, _ = filled
    empty = queries.headline(engine, Window(END + 10, END + 20, "mlp")).iloc[0]
    assert empty["requests"] == 0 and empty["batches"] == 0
    assert empty["latency_p50"] is None or math.isnan(empty["latency_p50"])
    assert len(queries.request_timeline(engine, Window(END + 10, END + 20))) == 0


def test_padding_waste_per_bucket(filled):
    engine, _, _ = filled
    pad = queries.padding_by_bucket(engine, Window(END - 200, END + 1, "encoder"))
    assert list(pad["bucket"]) == [256]
    # lengths are uniform in 1..256 padded to 256: about half is padding
    assert 0.4 < float(pad["waste_fraction"].iloc[0]) < 0.6


def test_priority_stats_and_bundle(filled):
    engine, _, _ = filled
    w = Window(END - 200, END + 1, "mlp")
    pr = queries.priority_stats(engine, w)
    assert list(pr["priority"]) == [0, 1, 2]
    assert pr["requests"].sum() == queries.headline(engine, w).iloc[0]["requests"]
    bundle = queries.live_bundle(engine, w)
    assert {"headline", "requests_t", "batches_t", "device_t", "events", "tail"} <= set(bundle)
    assert "generation" not in bundle


def test_nearest_rank_definition():
    assert nearest_rank([5, 1, 3, 2, 4], 50) == 3
    assert nearest_rank([1, 2], 99) == 2
    assert nearest_rank(range(1, 101), 95) == 95
    assert math.isnan(nearest_rank([], 50))


def test_window_bucket_is_round():
    assert Window(0, 900).bucket_s() == 15
    assert Window(0, 60).bucket_s() == 1
    assert Window.last(5, now=1000.0).start_s == 700.0


@pytest.mark.both_backends
def test_windows_older_than_the_raw_rows_read_the_rollups(db):
    from batchscope.analysis import diagnosis
    from batchscope.presentation import charts
    from batchscope.storage.retention import LATENCY_BOUNDS_S, run_retention

    end = 1_999_999_980.0  # a whole minute
    gen = synthetic.generate(db, synthetic.HEALTHY.with_(duration_s=1200, batches_per_s=2,
                                                         rejected_per_s=0.1), end_s=end, seed=4)
    everything = Window(end - 1200, end + 1, "mlp")
    old = Window(end - 1080, end - 780, "mlp")  # whole minutes, all of them rolled up below
    before = {"all": queries.headline(db, everything).iloc[0], "old": queries.headline(db, old).iloc[0]}
    assert before["all"]["source"] == "raw" and before["all"]["resolution_s"] == 0

    run_retention(db, now=end, raw_keep_s=600)  # the first 10 minutes become roll-ups
    bundle = queries.live_bundle(db, everything)
    head = bundle["headline"].iloc[0]
    assert head["source"] == "rollups" and head["resolution_s"] == 60 and "roll-ups" in head["resolution"]
    for key in ("requests", "ok", "rejected", "batches", "batched_items"):
        assert head[key] == before["all"][key], key
    assert head["requests"] == gen.requests
    exact = before["all"]["latency_p99"]  # within the histogram bucket that holds it
    assert head["latency_p99"] >= exact > max(b for b in LATENCY_BOUNDS_S if b < head["latency_p99"])
    assert bundle["requests_t"]["requests"].sum() == gen.requests
    assert (bundle["requests_t"]["t"] % 60 == 0).all()
    # a roll-up interval counts whole, so its rate is over the whole interval: a window
    # starting 50 s into one reads no higher at its first bucket than steady traffic
    cut = queries.live_bundle(db, Window(end - 1150, end - 610, "mlp"))["requests_t"]
    assert cut["requests_per_s"].iloc[0] == pytest.approx(cut["requests"].iloc[0] / 60)
    assert bundle["batch_sizes"]["batches"].sum() == gen.batches
    old_head = queries.headline(db, old).iloc[0]
    assert old_head["source"] == "rollups"
    assert (old_head["requests"], old_head["batches"]) == (before["old"]["requests"], before["old"]["batches"])
    recent = queries.headline(db, Window(end - 300, end + 1, "mlp")).iloc[0]
    assert recent["source"] == "raw"
    diagnosis.diagnose(bundle)  # every rule copes with what roll-ups leave out
    assert "latency" in charts.build_all(bundle, slo_ms=50)
