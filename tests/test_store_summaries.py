"""Live summaries: every write path keeps them as a rebuild from the raw rows would, the
live bundle read from them matches the raw rows (counts and means exactly, percentiles
within one histogram bucket), and retention takes them away with the raw rows."""

from __future__ import annotations

import random

import numpy as np
import pytest
from sqlalchemy import func, select, text

from batchscope.analysis import queries
from batchscope.analysis.queries import Window
from batchscope.storage import summaries
from batchscope.storage.records import BatchRow, RequestBatch, RequestRow
from batchscope.storage.recorder import Recorder
from batchscope.storage.retention import roll_up, rollup_key
from batchscope.storage.schema import LatencySummary, ShapeSummary, StatsSummary
from batchscope.testing import synthetic

END = 2_000_000_000.0
OUTCOMES = ("ok",) * 6 + ("rejected", "expired", "error", "oom", "cancelled")
TABLES = (StatsSummary, LatencySummary, ShapeSummary)


def traffic(seed: int, n: int = 3000, instance_id: str = "rt", start: float = END - 600):
    """Requests (rows and per-batch ``RequestBatch`` records) and batches with every
    outcome, priority, length bucket and a wide spread of latencies."""
    rng = random.Random(seed)
    rows: list = []
    for i in range(n):
        t = start + rng.uniform(0, 590)
        latency = 10 ** rng.uniform(-4.5, 2.3)  # below the first bucket to past the last
        rows.append(RequestRow(instance_id=instance_id, model=rng.choice(("mlp", "enc")), batch_seq=i,
                               priority=rng.randrange(3), arrived_at=t - latency, finished_at=t,
                               queue_wait_s=latency * rng.random(), latency_s=latency,
                               outcome=rng.choice(OUTCOMES), length=rng.choice((None, 7))))
        if i % 3 == 0:
            size = rng.randint(1, 16)
            rows.append(BatchRow(instance_id=instance_id, model=rng.choice(("mlp", "enc")), seq=i,
                                 policy="dynamic", settings_version=1, max_batch_size=rng.choice((16, 32)),
                                 bucket=rng.choice((None, 64, -1)), batch_size=size, real_elements=size * 3,
                                 padded_elements=size * 4, queue_wait_min_s=0.0, queue_wait_mean_s=0.002,
                                 queue_wait_max_s=0.004, compute_s=0.001 * size, started_at=t - 0.01,
                                 ended_at=t, outcome=rng.choice(("ok", "ok", "error", "oom")),
                                 queue_depth=rng.choice((None, rng.randrange(50)))))
        if i % 50 == 0:
            arrived = sorted(t - 0.05 * rng.random() for _ in range(4))
            rows.append(RequestBatch(instance_id, "mlp", i, "ok", t - 0.01, t, 0.0, [0, 1, 2, 1], arrived,
                                     [False, True, False, False], None))
    return rows


def summary_rows(db) -> dict:
    """Every summary table's rows, keyed, floats rounded (sums in another order differ
    in their last bits)."""
    out = {}
    with db.connect() as conn:
        for table in TABLES:
            key = [c.name for c in table.__table__.primary_key]
            rows = conn.execute(select(table.__table__).order_by(*[table.__table__.c[k] for k in key])).mappings()
            out[table.__tablename__] = [{k: round(v, 9) if isinstance(v, float) else v for k, v in r.items()}
                                        for r in rows]
    return out


def rebuilt(db) -> dict:
    with db.begin() as conn:
        summaries.rebuild(conn)
    return summary_rows(db)


@pytest.mark.both_backends
@pytest.mark.parametrize("path", ["thread", "process"])
def test_every_write_path_keeps_the_summaries_a_rebuild_makes(db, path):
    written_as_a_rebuild_would(db, writer_process=path == "process")


def test_sqlite_through_sqlalchemy_core_keeps_them_too(db, monkeypatch):
    """What a SQLite driver other than ``sqlite3`` takes (PostgreSQL's path, on SQLite)."""
    import batchscope.storage.inserts as inserts_module

    monkeypatch.setattr(inserts_module, "is_pysqlite", lambda _engine: False)
    written_as_a_rebuild_would(db, writer_process=False)


def written_as_a_rebuild_would(db, *, writer_process: bool) -> None:
    rec = Recorder(db, max_rows_per_flush=700, writer_process=writer_process)
    rows = traffic(1) + traffic(2, n=500, instance_id="other")
    for row in rows:
        rec.put(row)
    while rec.buffered:
        rec.flush()
    rec.close()
    assert rec.dropped == 0
    incremental = summary_rows(db)
    requests = sum(len(r) if isinstance(r, RequestBatch) else isinstance(r, RequestRow) for r in rows)
    for span in summaries.SPANS["summary_stats"]:  # every request once per span
        assert sum(r["requests"] for r in incremental["summary_stats"] if r["span_s"] == span) == requests
    assert incremental == rebuilt(db)


@pytest.mark.both_backends
def test_histogram_buckets_agree_with_their_bounds(db):
    latencies = [0.00005, 0.0001, 0.00013, 0.0042, 0.05, 0.7, 3.3, 99.0, 100.0, 150.0]
    rows = [RequestRow(instance_id="rt", model="mlp", batch_seq=None, priority=0, arrived_at=END - 1,
                       finished_at=END - 1 + i * 1e-3, queue_wait_s=0.0, latency_s=x, outcome="ok")
            for i, x in enumerate(latencies)]
    rec = Recorder(db)
    for row in rows:
        rec.put(row)
    assert rec.flush() == len(rows)
    with db.connect() as conn:
        stored = dict(conn.execute(select(LatencySummary.bucket, LatencySummary.n)
                                   .where(LatencySummary.span_s == summaries.SLOT_S)).all())
    want: dict[int, int] = {}
    for x in latencies:
        b = summaries.latency_bucket(x)
        want[b] = want.get(b, 0) + 1
        assert summaries.bucket_upper_s(b) >= x > (summaries.bucket_upper_s(b - 1) if b else 0.0)
    assert stored == want and max(stored) == summaries.OVERFLOW_BUCKET
    assert rollup_key(summaries.latency_bucket(0.0042)) == "0.004217"  # the roll-ups' bound above it


@pytest.mark.both_backends
def test_the_live_bundle_from_summaries_matches_the_raw_rows(db, monkeypatch):
    monkeypatch.setattr(queries, "EXACT_PERCENTILES_MAX_OK", 0)  # histogram percentiles here
    for i, name in enumerate(("healthy", "padding", "starvation")):
        sc = synthetic.SCENARIOS[name]
        synthetic.generate(db, sc.with_(duration_s=300, instance_id=f"rt-{i % 2}", rejected_per_s=0.2,
                                        model=("mlp", "enc", "mlp")[i]), end_s=END, seed=i)
    w = Window(END - 300, END + 5, "mlp")  # whole 5-second slots
    live, raw = queries.live_bundle(db, w), queries.raw_bundle(db, w)
    head, exact = live["headline"].iloc[0], raw["headline"].iloc[0]
    assert head["source"] == "summaries" and "histograms" in head["resolution"]
    for key in ("requests", "ok", "rejected", "expired", "errors", "batches", "batched_items",
                "max_batch_size_seen", "oom_batches", "real_elements", "padded_elements",
                "max_batch_size", "policy", "settings_version"):
        assert head[key] == exact[key], key
    for key in ("queue_wait_mean_s", "mean_batch_size", "compute_mean_s", "compute_total_s",
                "queue_depth_mean", "utilization_mean_pct"):
        assert head[key] == pytest.approx(exact[key], rel=1e-9), key
    step = 10 ** (1 / summaries.BUCKETS_PER_DECADE)  # one bucket: at most 7.5 % high
    for p in queries.PCTS:
        assert exact[f"latency_p{p}"] <= head[f"latency_p{p}"] <= exact[f"latency_p{p}"] * step * (1 + 1e-9)

    lt, rt = live["requests_t"], raw["requests_t"]
    assert list(lt["t"]) == list(rt["t"])
    for key in ("requests", "ok", "rejected", "expired", "errors"):
        assert list(lt[key]) == list(rt[key]), key
    assert (lt["latency_p95"] >= rt["latency_p95"]).all()
    assert (lt["latency_p95"] <= rt["latency_p95"] * step * (1 + 1e-9)).all()
    for frame, keys in (("batches_t", ("t", "batches", "items", "max_batch_size", "queue_depth_max")),
                        ("batch_sizes", ("batch_size", "batches", "max_batch_size")),
                        ("model_share", ("model", "batches", "items"))):
        for key in keys:
            assert list(live[frame][key]) == list(raw[frame][key]), (frame, key)
    for frame, key in (("batches_t", "queue_wait_mean_s"), ("batches_t", "compute_mean_s"),
                       ("batches_t", "queue_depth_mean"), ("batch_sizes", "items_per_compute_s"),
                       ("model_share", "share"), ("priority", "queue_wait_mean_s")):
        assert np.allclose(live[frame][key], raw[frame][key], rtol=1e-9, equal_nan=True), (frame, key)
    for key in ("priority", "requests", "ok", "expired", "rejected"):
        assert list(live["priority"][key]) == list(raw["priority"][key]), key
    pad_w = Window(END - 300, END + 5, "enc")
    assert queries.live_bundle(db, pad_w)["padding"][["bucket", "batches", "real_elements"]].equals(
        queries.raw_bundle(db, pad_w)["padding"][["bucket", "batches", "real_elements"]])
    # the tail above p99: the requests of the histogram buckets from p99's up
    assert live["tail"].iloc[0]["requests"] >= raw["tail"].iloc[0]["requests"] > 0


@pytest.mark.both_backends
def test_exact_percentiles_while_the_window_is_small(db):
    synthetic.generate(db, synthetic.HEALTHY.with_(duration_s=60, batches_per_s=5), end_s=END, seed=3)
    w = Window(END - 60, END + 1, "mlp")
    live, raw = queries.live_bundle(db, w), queries.raw_bundle(db, w)
    assert live["headline"].iloc[0]["ok"] <= queries.EXACT_PERCENTILES_MAX_OK
    assert "exact" in live["headline"].iloc[0]["resolution"]
    for p in queries.PCTS:
        assert live["headline"].iloc[0][f"latency_p{p}"] == raw["headline"].iloc[0][f"latency_p{p}"]
    assert live["requests_t"]["latency_p99"].equals(raw["requests_t"]["latency_p99"])


@pytest.mark.both_backends
def test_retention_deletes_the_summaries_of_what_it_rolls_up(db):
    rec = Recorder(db)
    for row in traffic(4):
        rec.put(row)
    rec.flush()
    stats = roll_up(db, older_than=END - 300, interval_s=60.0)
    cutoff = stats.cutoff  # rounded down to a whole interval
    assert stats.summary_rows_deleted > 0 and stats.requests_rolled > 0
    with db.connect() as conn:
        for table in summaries.TABLES:
            assert conn.execute(select(func.min(table.start_s + table.span_s))).scalar() > cutoff
        left = dict(conn.execute(select(StatsSummary.span_s, func.sum(StatsSummary.requests))
                                 .group_by(StatsSummary.span_s)).all())
        raw = conn.execute(text("SELECT COUNT(*) FROM requests")).scalar()
    assert {span: int(n) for span, n in left.items()} == {1: raw, 60: raw}  # the cutoff is a whole minute


@pytest.mark.both_backends
def test_long_windows_read_whole_minutes_and_exact_edges(db, monkeypatch):
    """A window of an hour and more: its whole minutes from the minute rows, its edges
    (not on a minute) from the fine rows; counts still exact to the second."""
    monkeypatch.setattr(queries, "EXACT_PERCENTILES_MAX_OK", 0)
    synthetic.generate(db, synthetic.HEALTHY.with_(duration_s=4000, batches_per_s=1, rejected_per_s=0.1),
                       end_s=END, seed=5)
    w = Window(END - 3725, END - 17, "mlp")
    assert w.bucket_s() % summaries.MINUTE_S == 0
    live, raw = queries.live_bundle(db, w), queries.raw_bundle(db, w)
    for key in ("requests", "ok", "rejected", "batches", "batched_items"):
        assert live["headline"].iloc[0][key] == raw["headline"].iloc[0][key], key
    for key in ("t", "requests", "ok", "rejected"):
        assert list(live["requests_t"][key]) == list(raw["requests_t"][key]), key
    assert list(live["batches_t"]["batches"]) == list(raw["batches_t"]["batches"])
    assert live["model_share"]["batches"].tolist() == raw["model_share"]["batches"].tolist()
