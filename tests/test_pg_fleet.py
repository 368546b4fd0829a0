"""Several instances sharing one database, as a fleet does: started at the same moment on
a fresh database, each records every row; sizes of large GPUs fit."""

from __future__ import annotations

import multiprocessing
import time

import pytest
from sqlalchemy import func, select

from batchscope.storage import control
from batchscope.storage.db import make_engine
from batchscope.storage.records import BatchRow, DeviceRow, RequestRow
from batchscope.storage.recorder import Recorder
from batchscope.storage.schema import BatchRecord, DeviceSample, RequestRecord, RuntimeInstance, StatsSummary

pytestmark = pytest.mark.both_backends

GIB = 1024 ** 3


def rows_of(instance_id: str, n: int) -> list:
    """``n`` requests, a batch per 4 and a device sample per 100, with sizes past 2**31."""
    rows: list = []
    for i in range(n):
        t = 1_700_000_000.0 + i * 0.01
        rows.append(RequestRow(instance_id=instance_id, model="mlp", batch_seq=i // 4, priority=0,
                               arrived_at=t - 0.005, finished_at=t, queue_wait_s=0.001,
                               latency_s=0.005, outcome="ok"))
        if i % 4 == 0:
            rows.append(BatchRow(instance_id=instance_id, model="mlp", seq=3 * 2 ** 31 + i // 4,
                                 policy="dynamic", settings_version=1, max_batch_size=4, bucket=None,
                                 batch_size=4, real_elements=4, padded_elements=4,
                                 queue_wait_min_s=0.0, queue_wait_mean_s=0.001, queue_wait_max_s=0.002,
                                 compute_s=0.004, started_at=t - 0.004, ended_at=t,
                                 peak_memory_bytes=40 * GIB))
        if i % 100 == 0:
            rows.append(DeviceRow(instance_id=instance_id, at=t, device="cuda:0", kind="gpu",
                                  utilization_pct=90.0, memory_used_bytes=70 * GIB,
                                  memory_total_bytes=141 * GIB, torch_allocated_bytes=64 * GIB,
                                  torch_reserved_bytes=66 * GIB, process_rss_bytes=3 * GIB))
    return rows


def run_instance(url: str, instance_id: str, start_at: float, n: int) -> dict:
    """One instance's life in its own process: open (creating the schema if it is the
    first), register, record ``n`` requests' worth of rows, report."""
    time.sleep(max(0.0, start_at - time.time()))  # every process starts at the same moment
    engine = make_engine(url)
    control.register_instance(engine, instance_id=instance_id, host="h", pid=1, models=["mlp"],
                              url=None, device="cuda:0", version="test", now=time.time())
    # flushes of a realistic size: SQLite hands its write lock to one waiter at a time, and
    # a writer that queues for it behind others flushing nonstop can wait past its timeout
    rec = Recorder(engine, instance_id=instance_id, flush_interval_s=0.05, max_rows_per_flush=2000)
    rec.start()
    rows = rows_of(instance_id, n)
    for row in rows:
        rec.put(row)
    rec.close(timeout_s=60.0)
    engine.dispose()
    return {"put": len(rows), "written": rec.written, "dropped": rec.dropped}


@pytest.mark.slow
def test_instances_started_together_on_a_fresh_database_record_every_row(db_url):
    n, instances = 2000, 3
    ctx = multiprocessing.get_context("spawn")
    start_at = time.time() + 3.0  # time for the children to import
    with ctx.Pool(instances) as pool:
        results = pool.starmap(run_instance, [(db_url, f"rt-{i}", start_at, n) for i in range(instances)],
                               chunksize=1)
    assert all(r["dropped"] == 0 and r["written"] == r["put"] for r in results), results
    engine = make_engine(db_url)
    with engine.connect() as conn:
        per_instance = dict(conn.execute(select(RequestRecord.instance_id, func.count())
                                         .group_by(RequestRecord.instance_id)).all())
        big = conn.execute(select(func.count()).select_from(DeviceSample)
                           .where(DeviceSample.memory_used_bytes == 70 * GIB)).scalar()
        registered = conn.execute(select(func.count()).select_from(RuntimeInstance)).scalar()
        summarised = dict(conn.execute(select(StatsSummary.instance_id, func.sum(StatsSummary.requests))
                                       .where(StatsSummary.span_s == 1).group_by(StatsSummary.instance_id)).all())
    engine.dispose()
    assert per_instance == {f"rt-{i}": n for i in range(instances)}
    assert {k: int(v) for k, v in summarised.items()} == per_instance  # each wrote its own summaries
    assert big == instances * n // 100 and registered == instances


def test_sizes_past_two_gib_are_stored_exactly(db):
    rec = Recorder(db)
    rows = rows_of("rt", 400)
    for row in rows:
        rec.put(row)
    assert rec.flush() == len(rows) and rec.dropped == 0 and rec.healthy
    control.register_instance(db, instance_id="rt", host="h", pid=1, models=["mlp"], url=None,
                              device="cuda:0", version="test", now=1.0)
    assert control.heartbeat(db, "rt", 2.0, records_dropped=5 * 2 ** 31)
    with db.connect() as conn:
        sample = conn.execute(select(DeviceSample).limit(1)).one()
        batch = conn.execute(select(BatchRecord.seq, BatchRecord.peak_memory_bytes)
                             .order_by(BatchRecord.id).limit(1)).one()
    assert (sample.memory_used_bytes, sample.memory_total_bytes, sample.torch_allocated_bytes,
            sample.torch_reserved_bytes, sample.process_rss_bytes) == (70 * GIB, 141 * GIB, 64 * GIB,
                                                                       66 * GIB, 3 * GIB)
    assert tuple(batch) == (3 * 2 ** 31, 40 * GIB)
    assert control.live_instances(db, now=3.0)[0].records_dropped == 5 * 2 ** 31


@pytest.mark.parametrize("backend", ["postgresql"], indirect=True)
@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
def test_a_url_without_a_driver_opens_with_psycopg(db_url, backend, scheme):
    """``--db postgresql://host/db`` as people write it (SQLAlchemy alone would look for
    psycopg2, which BatchScope does not install)."""
    plain = scheme + "://" + db_url.split("://", 1)[1]
    engine = make_engine(plain)
    try:
        assert engine.dialect.driver == "psycopg"
        control.register_instance(engine, instance_id="rt", host="h", pid=1, models=["mlp"], url=None,
                                  device=None, version="test", now=1.0)
        assert [i.id for i in control.live_instances(engine, now=2.0)] == ["rt"]
    finally:
        engine.dispose()
