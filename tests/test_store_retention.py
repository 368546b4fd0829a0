"""Retention: raw rows older than the window become roll-ups; totals are preserved."""

from __future__ import annotations

import json
import sqlite3
import threading

import pytest
from sqlalchemy import event, func, select

from batchscope.storage.db import make_engine
from batchscope.storage.records import BatchRow, DeviceRow, EventRow, GenStepRow, RequestRow
from batchscope.storage.recorder import Recorder
from batchscope.storage.retention import (LATENCY_BOUNDS_S, RetentionPolicy, enforce, hist_quantile, latency_bucket,
                                  merge_hists, roll_up, run_retention)
from batchscope.storage.schema import BatchRecord, DeviceSample, EventRecord, GenerationStep, RequestRecord, Rollup

T0 = 28_333_333 * 60.0  # a whole minute, near 2023-11
OUTCOMES = ("ok", "ok", "ok", "rejected", "ok", "expired", "ok", "error")

pytestmark = pytest.mark.both_backends


def traffic(start: float, seconds: int, instance_id: str = "rt", models=("mlp", "enc")):
    """One request per model per second and a batch every 4 s, with known values."""
    rows = []
    for s in range(seconds):
        t = start + s + 0.5
        for m, model in enumerate(models):
            outcome = OUTCOMES[(s + m) % len(OUTCOMES)]
            rows.append(RequestRow(instance_id=instance_id, model=model, batch_seq=s // 4, priority=0,
                                   arrived_at=t - 0.01, finished_at=t, queue_wait_s=0.001 * (s % 5),
                                   latency_s=0.002 * (1 + s % 50), outcome=outcome))
            if s % 4 == 0:
                size = 1 + (s // 4) % 8
                rows.append(BatchRow(instance_id=instance_id, model=model, seq=s // 4, policy="dynamic",
                                     settings_version=1, max_batch_size=8, bucket=None, batch_size=size,
                                     real_elements=size * 10, padded_elements=size * 12,
                                     queue_wait_min_s=0.0, queue_wait_mean_s=0.001, queue_wait_max_s=0.002,
                                     compute_s=0.003, started_at=t - 0.003, ended_at=t))
        if s % 10 == 0:
            rows.append(DeviceRow(instance_id=instance_id, at=t, device="cpu", kind="cpu", utilization_pct=10.0))
            rows.append(GenStepRow(instance_id=instance_id, model="dec", at=t, mode="continuous", running=1,
                                   waiting=0, prefill_tokens=1, decode_tokens=1, blocks_used=1, blocks_free=1,
                                   preemptions=0, step_s=0.01))
            rows.append(EventRow(instance_id=instance_id, model="mlp", at=t, kind="rejected", message="queue full"))
    return rows


def store(db, rows) -> None:
    rec = Recorder(db, buffer_size=len(rows) + 1, max_rows_per_flush=50_000)
    for row in rows:
        rec.put(row)
    rec.close()
    assert rec.written == len(rows)


def count(db, model, *where) -> int:
    with db.connect() as conn:
        return conn.execute(select(func.count()).select_from(model).where(*where)).scalar_one()


def rollup_rows(db):
    with db.connect() as conn:
        return conn.execute(select(Rollup.__table__).order_by(Rollup.model, Rollup.interval_start)).all()


def test_rollup_totals_equal_what_was_deleted(db):
    rows = traffic(T0, 3600)
    store(db, rows)
    cutoff = T0 + 3000
    old_requests = [r for r in rows if isinstance(r, RequestRow) and r.finished_at < cutoff]
    old_batches = [r for r in rows if isinstance(r, BatchRow) and r.ended_at < cutoff]

    stats = roll_up(db, older_than=cutoff + 30, interval_s=60.0, chunk_intervals=7)  # rounds down to cutoff
    assert stats.cutoff == cutoff
    assert stats.requests_rolled == len(old_requests) and stats.batches_rolled == len(old_batches)
    assert count(db, RequestRecord) == 2 * 600 and count(db, BatchRecord) == 2 * 150
    assert count(db, RequestRecord, RequestRecord.finished_at < cutoff) == 0

    rolled = rollup_rows(db)
    assert len(rolled) == 2 * 50 and stats.rollups_inserted == 100  # 50 minutes x 2 models
    assert {r.interval_start for r in rolled} == {T0 + 60 * i for i in range(50)}
    ok = [r for r in old_requests if r.outcome == "ok"]
    assert sum(r.requests for r in rolled) == len(old_requests)
    assert sum(r.requests_ok for r in rolled) == len(ok)
    assert sum(r.requests_failed for r in rolled) == len(old_requests) - len(ok)
    outcomes = merge_hists(*(json.loads(r.outcomes_json) for r in rolled))
    assert outcomes == {o: sum(1 for r in old_requests if r.outcome == o) for o in set(OUTCOMES)}
    assert sum(r.latency_sum_s for r in rolled) == pytest.approx(sum(r.latency_s for r in ok))
    assert sum(r.queue_wait_sum_s for r in rolled) == pytest.approx(sum(r.queue_wait_s for r in ok))
    latency_hist = merge_hists(*(json.loads(r.latency_hist_json) for r in rolled))
    assert latency_hist == {k: sum(1 for r in ok if latency_bucket(r.latency_s) == k) for k in latency_hist}
    assert sum(latency_hist.values()) == len(ok)
    assert sum(r.batches for r in rolled) == len(old_batches)
    assert sum(r.batch_size_sum for r in rolled) == sum(b.batch_size for b in old_batches)
    assert sum(r.real_elements for r in rolled) == sum(b.real_elements for b in old_batches)
    assert sum(r.padded_elements for r in rolled) == sum(b.padded_elements for b in old_batches)
    assert sum(r.compute_sum_s for r in rolled) == pytest.approx(0.003 * len(old_batches))
    sizes = merge_hists(*(json.loads(r.batch_size_hist_json) for r in rolled))
    assert sizes == {str(n): sum(1 for b in old_batches if b.batch_size == n) for n in range(1, 9)}

    # one interval checked by hand: the first minute of "mlp"
    first = next(r for r in rolled if r.model == "mlp" and r.interval_start == T0)
    minute = [r for r in old_requests if r.model == "mlp" and r.finished_at < T0 + 60]
    assert first.requests == len(minute) == 60 and first.instance_id == "rt" and first.interval_s == 60.0
    assert first.batches == 15

    # other tables: only settings changes survive the window
    assert count(db, DeviceSample, DeviceSample.at < cutoff) == 0
    assert count(db, GenerationStep, GenerationStep.at < cutoff) == 0
    assert count(db, EventRecord, EventRecord.at < cutoff) == 0
    assert stats.device_samples_deleted == stats.generation_steps_deleted == stats.events_deleted == 300
    assert count(db, DeviceSample) == 60


def test_raw_window_is_untouched_and_rerun_changes_nothing(db):
    store(db, traffic(T0, 600))
    with db.connect() as conn:
        recent_before = conn.execute(select(RequestRecord.__table__).where(
            RequestRecord.finished_at >= T0 + 300).order_by(RequestRecord.id)).all()
    roll_up(db, older_than=T0 + 300)
    first = rollup_rows(db)
    again = roll_up(db, older_than=T0 + 300)
    assert (again.requests_rolled, again.batches_rolled, again.rollups_inserted, again.rollups_merged) == (0, 0, 0, 0)
    assert rollup_rows(db) == first
    with db.connect() as conn:
        recent_after = conn.execute(select(RequestRecord.__table__).order_by(RequestRecord.id)).all()
    assert recent_after == recent_before


def test_late_rows_merge_into_existing_rollup(db):
    store(db, traffic(T0, 120, models=("mlp",)))
    roll_up(db, older_than=T0 + 120)
    (before,) = [r for r in rollup_rows(db) if r.interval_start == T0]
    late = traffic(T0, 4, models=("mlp",))  # 4 more requests and 1 batch in the first minute
    store(db, late)
    stats = roll_up(db, older_than=T0 + 120)
    assert stats.rollups_merged == 1 and stats.rollups_inserted == 0 and stats.requests_rolled == 4
    (after,) = [r for r in rollup_rows(db) if r.interval_start == T0]
    assert after.id == before.id
    assert after.requests == before.requests + 4 and after.batches == before.batches + 1
    assert sum(json.loads(after.outcomes_json).values()) == after.requests
    assert sum(json.loads(after.latency_hist_json).values()) == after.requests_ok


def test_database_stays_bounded_over_a_long_run(db):
    policy = RetentionPolicy(raw_max_age_s=300.0, interval_s=60.0, rollup_max_age_s=1800.0)
    total_requests = 0
    raw_counts = []
    for hour_part in range(12):  # 12 x 10 minutes of traffic, retention after each
        start = T0 + 600 * hour_part
        rows = traffic(start, 600, models=("mlp",))
        store(db, rows)
        total_requests += sum(1 for r in rows if isinstance(r, RequestRow))
        stats = enforce(db, policy, now=start + 600)
        raw_counts.append(count(db, RequestRecord))
        with db.connect() as conn:
            rolled = conn.execute(select(func.coalesce(func.sum(Rollup.requests), 0))).scalar_one()
        if stats.rollups_deleted == 0:
            assert rolled + raw_counts[-1] == total_requests
    assert max(raw_counts) == 300  # never more than the raw window
    assert count(db, Rollup) <= 31  # 30 minutes of roll-ups, plus the one at the edge
    assert count(db, DeviceSample) <= 30


def test_retention_while_the_recorder_writes(db):
    """Rows with old timestamps keep arriving while roll-ups run: none lost, none doubled."""
    rows = [r for r in traffic(T0, 1500, models=("mlp",)) if isinstance(r, RequestRow)]
    rec = Recorder(db, flush_interval_s=0.005, max_rows_per_flush=50)
    rec.start()
    stop = threading.Event()
    runs = []

    def roller():
        while True:  # at least once, however the threads are scheduled
            runs.append(roll_up(db, older_than=T0 + 1200, interval_s=60.0, chunk_intervals=3))
            if stop.is_set():
                return

    thread = threading.Thread(target=roller)
    thread.start()
    for row in rows:
        rec.put(row)
    rec.close(timeout_s=60.0)
    stop.set()
    thread.join(timeout=60)
    runs.append(roll_up(db, older_than=T0 + 1200))
    assert rec.dropped == 0 and len(runs) >= 2
    with db.connect() as conn:
        rolled = conn.execute(select(func.sum(Rollup.requests))).scalar_one()
    assert rolled + count(db, RequestRecord) == len(rows)
    assert rolled == sum(r.requests_rolled for r in runs) == 1200
    assert count(db, Rollup) == 20


def test_settings_history_survives_retention(db):
    store(db, [EventRow(instance_id="rt", model="mlp", at=T0, kind="settings_change", message="m"),
                   EventRow(instance_id="rt", model="mlp", at=T0, kind="oom", message="m")])
    stats = run_retention(db, now=T0 + 10_000, raw_keep_s=3600)
    assert stats.events_deleted == 1
    assert count(db, EventRecord, EventRecord.kind == "settings_change") == 1


def test_hist_quantile():
    latencies = [0.001 * (i + 1) for i in range(100)]  # 1 ms .. 100 ms
    hist = {}
    for value in latencies:
        key = latency_bucket(value)
        hist[key] = hist.get(key, 0) + 1
    for q in (0.5, 0.9, 0.99):
        exact = sorted(latencies)[int(q * 100) - 1]
        upper = hist_quantile(json.dumps(hist), q)
        lower = max((b for b in LATENCY_BOUNDS_S if b < upper), default=0.0)
        assert lower < exact <= upper
    assert hist_quantile({}, 0.5) is None
    assert hist_quantile({"inf": 3}, 0.5) == float("inf")
    assert latency_bucket(1000.0) == "inf" and latency_bucket(0.0) == "0.0001"
    with pytest.raises(ValueError):
        hist_quantile(hist, 1.5)


def test_policy_validation(db):
    with pytest.raises(ValueError, match="raw_max_age_s"):
        RetentionPolicy(raw_max_age_s=0)
    with pytest.raises(ValueError, match="interval_s"):
        RetentionPolicy(raw_max_age_s=10, interval_s=-1)
    with pytest.raises(ValueError, match="interval_s"):
        roll_up(db, older_than=T0, interval_s=0.0)


def test_rows_changed_between_summary_and_delete_are_summarised_again(tmp_path):
    """Another process deletes a summarised row just before the write transaction: the
    chunk is rolled back and summarised again, so the roll-up matches what was deleted."""
    path = tmp_path / "race.db"
    db = make_engine(f"sqlite:///{path}")
    store(db, traffic(T0, 120, models=("mlp",)))
    raced = []

    @event.listens_for(db, "before_cursor_execute")
    def _race(conn, cursor, statement, *args):
        if statement == "BEGIN IMMEDIATE" and not raced:
            other = sqlite3.connect(path)
            raced.append(other.execute("DELETE FROM requests WHERE id = (SELECT min(id) FROM requests)").rowcount)
            other.commit()
            other.close()

    stats = roll_up(db, older_than=T0 + 120)
    assert raced == [1] and stats.chunks_retried == 1
    assert stats.requests_rolled == 119 and count(db, RequestRecord) == 0
    assert sum(r.requests for r in rollup_rows(db)) == 119
    db.dispose()


def test_instances_running_retention_at_once_roll_every_row_up_once(db_url):
    """Every instance of a fleet runs retention on the shared database: at the same
    moment, they take turns (SQLite's write lock, PostgreSQL's advisory lock)."""
    db = make_engine(db_url)
    rows = traffic(T0, 1200, models=("mlp",))
    store(db, rows)
    barrier = threading.Barrier(4)
    results, errors = [], []

    def instance():
        engine = make_engine(db_url)
        barrier.wait(timeout=30)
        try:
            results.append(roll_up(engine, older_than=T0 + 900, interval_s=60.0, chunk_intervals=2))
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            engine.dispose()

    threads = [threading.Thread(target=instance) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    with db.connect() as conn:
        rolled = conn.execute(select(func.sum(Rollup.requests))).scalar_one()
    assert rolled == sum(r.requests_rolled for r in results) == 900
    assert rolled + count(db, RequestRecord) == sum(isinstance(r, RequestRow) for r in rows)
    assert count(db, Rollup) == 15
    db.dispose()
