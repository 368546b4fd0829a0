"""Recorder: everything is written, drops are counted, database failures are survived."""

from __future__ import annotations

import json
import sqlite3
import time

import pytest
from sqlalchemy import create_engine, event, select

from batchscope.storage.db import make_engine
from batchscope.storage.records import BatchRow, DeviceRow, EventRow, GenStepRow, ListRecorder, RequestRow
from batchscope.storage.recorder import Recorder, TeeRecorder
from batchscope.storage.schema import BatchRecord, DeviceSample, EventRecord, GenerationStep, RequestRecord
from tests.factories import count, stored, wait_until


def request(i: int, model: str = "mlp") -> RequestRow:
    return RequestRow(instance_id="rt", model=model, batch_seq=i // 8, priority=i % 3, arrived_at=1000.0 + i,
                      finished_at=1000.5 + i, queue_wait_s=0.001 * (i % 7), latency_s=0.01, outcome="ok",
                      length=i % 50)


def batch(i: int) -> BatchRow:
    return BatchRow(instance_id="rt", model="mlp", seq=i, policy="dynamic", settings_version=1,
                    max_batch_size=8, bucket=None, batch_size=8, real_elements=8, padded_elements=8,
                    queue_wait_min_s=0.0, queue_wait_mean_s=0.001, queue_wait_max_s=0.002, compute_s=0.004,
                    started_at=1000.0 + i, ended_at=1000.01 + i, peak_memory_bytes=2**33, cuda_graph=True)


def others(i: int) -> list:
    return [EventRow(instance_id="rt", model="mlp", at=1000.0 + i, kind="oom", message=f"oom {i}"),
            DeviceRow(instance_id="rt", at=1000.0 + i, device="cpu", kind="cpu", utilization_pct=50.0),
            GenStepRow(instance_id="rt", model="dec", at=1000.0 + i, mode="continuous", running=4, waiting=1,
                       prefill_tokens=10, decode_tokens=4, blocks_used=3, blocks_free=5, preemptions=0,
                       step_s=0.01)]


def short_busy_timeout(db, ms: int = 20):
    """Make lock waits fail fast so the tests do not wait out the default 5 s."""
    @event.listens_for(db, "connect")
    def _short(dbapi_conn, _record):
        dbapi_conn.execute(f"PRAGMA busy_timeout={ms}")
    db.dispose()


@pytest.mark.both_backends
def test_everything_put_is_written(db):
    rec = Recorder(db, flush_interval_s=0.01, max_rows_per_flush=500)
    rec.start()
    for i in range(3000):
        rec.put(request(i))
        if i % 10 == 0:
            rec.put(batch(i))
        if i % 100 == 0:
            for r in others(i):
                rec.put(r)
    rec.close()
    assert rec.dropped == 0
    assert count(db, RequestRecord) == 3000
    assert count(db, BatchRecord) == 300
    assert count(db, EventRecord) == count(db, DeviceSample) == count(db, GenerationStep) == 30
    assert rec.written == 3000 + 300 + 90
    assert rec.written_by_kind["requests"] == 3000
    with db.connect() as conn:
        row = conn.execute(select(BatchRecord).where(BatchRecord.seq == 10)).one()
    assert row.cuda_graph is True and row.peak_memory_bytes == 2**33 and row.bucket is None


@pytest.mark.both_backends
def test_full_buffer_drops_are_counted_exactly(db):
    rec = Recorder(db, buffer_size=100)  # writer not started: nothing drains the buffer
    for i in range(130):
        rec.put(request(i))
    for i in range(20):
        rec.put(batch(i))
    assert rec.buffered == 100
    assert rec.dropped == 50
    assert rec.dropped_by_kind == {"requests": 30, "batches": 20}
    rec.close()
    assert count(db, RequestRecord) == 100 and rec.written == 100
    # after close, put still never raises and counts what it refuses
    rec.put(request(0))
    assert rec.dropped == 51


@pytest.mark.both_backends
def test_close_flushes_what_is_left(db):
    rec = Recorder(db, flush_interval_s=60.0, max_rows_per_flush=64)
    rec.start()
    for i in range(1000):
        rec.put(request(i))
    rec.close(timeout_s=30.0)
    assert count(db, RequestRecord) == 1000 and rec.dropped == 0 and rec.buffered == 0


def test_locked_database_drops_then_recovers(db_url, db):
    short_busy_timeout(db)
    rec = Recorder(db, flush_interval_s=0.01, instance_id="rt-9")
    rec.start()
    rec.put(request(0))
    assert wait_until(lambda: rec.written == 1)

    blocker = sqlite3.connect(db_url.split("///", 1)[1], isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        for i in range(1, 201):
            rec.put(request(i))
        assert wait_until(lambda: rec.dropped > 0 and not rec.healthy)
        # the hot path is unaffected: puts keep going into the buffer, never raising
        for i in range(201, 301):
            rec.put(request(i))
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    for i in range(301, 401):
        rec.put(request(i))
    assert wait_until(lambda: rec.healthy and rec.written + rec.dropped >= 401 and rec.buffered == 0)
    rec.close()
    assert rec.written + rec.dropped == 401
    assert count(db, RequestRecord) == rec.written
    assert rec.dropped_by_kind == {"requests": rec.dropped}
    with db.connect() as conn:
        events = conn.execute(select(EventRecord).where(EventRecord.kind == "recorder_drops")).all()
    assert len(events) == 1
    details = json.loads(events[0].details_json)
    assert events[0].instance_id == "rt-9" and details["dropped"] == rec.dropped
    assert details["by_kind"] == {"requests": rec.dropped}
    # the event says why: the writes failed (the buffer never filled), naming the error
    assert details["dropped_write_failed"] == rec.dropped and details["dropped_buffer_full"] == 0
    assert "locked" in details["last_failure"] and "writing failed" in events[0].message
    assert "buffer was full" not in events[0].message


def test_drops_held_back_by_the_report_interval_are_reported_without_new_rows(db_url, db):
    """Rows lost soon after a report are reported once the interval has passed, also when
    no row comes after the fault (before, only a flush with rows could report them)."""
    short_busy_timeout(db)
    rec = Recorder(db, flush_interval_s=0.01, instance_id="rt-9")
    rec.start()
    blocker = sqlite3.connect(db_url.split("///", 1)[1], isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    try:
        for i in range(50):
            rec.put(request(i))
        assert wait_until(lambda: rec.dropped == 50)
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    rec._last_report_at = time.monotonic()  # as if a report had just been written
    rec.put(request(50))
    assert wait_until(lambda: rec.written == 1 and rec.healthy)  # writes work again...
    with db.connect() as conn:  # ...but the interval holds the report back
        assert not conn.execute(select(EventRecord).where(
            EventRecord.kind == "recorder_drops")).all()
    rec._last_report_at = -1e9  # the interval has passed; nothing more is put
    def reported():
        with db.connect() as conn:
            return conn.execute(select(EventRecord).where(
                EventRecord.kind == "recorder_drops")).all()
    assert wait_until(lambda: len(reported()) == 1)
    rec.close()
    assert json.loads(reported()[0].details_json)["by_kind"] == {"requests": 50}


def test_locked_database_with_synchronous_flush(db_url, db):
    """Deterministic variant: no writer thread, flushes driven by the test."""
    short_busy_timeout(db)
    rec = Recorder(db, max_rows_per_flush=1000)
    blocker = sqlite3.connect(db_url.split("///", 1)[1], isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    for i in range(40):
        rec.put(request(i))
        rec.put(batch(i))
    assert rec.flush() == 0
    assert rec.dropped == 80 and rec.dropped_by_kind == {"requests": 40, "batches": 40} and not rec.healthy
    blocker.execute("ROLLBACK")
    blocker.close()
    for i in range(10):
        rec.put(request(i))
    assert rec.flush() == 10 and rec.healthy
    assert count(db, RequestRecord) == 10
    assert count(db, EventRecord) == 1  # the drops report


def test_unwritable_database_never_raises(tmp_path):
    broken = create_engine(f"sqlite:///{tmp_path / 'missing-dir' / 'x.db'}")
    rec = Recorder(broken, flush_interval_s=0.01)
    rec.start()
    for i in range(50):
        rec.put(request(i))
    assert wait_until(lambda: rec.dropped == 50)
    rec.put(object())  # not a record at all: still no exception on the hot path
    rec.close(timeout_s=5.0)
    assert rec.written == 0 and rec.dropped == 51 and rec.dropped_by_kind["object"] == 1


def test_tee_fans_out(db):
    memory = ListRecorder()
    rec = Recorder(db, buffer_size=5)
    tee = TeeRecorder(memory, rec)
    for i in range(8):
        tee.put(request(i))
    assert len(memory.records) == 8 and tee.dropped == 3
    tee.close()
    assert count(db, RequestRecord) == 5


def test_rejects_nonsense_sizes(db):
    with pytest.raises(ValueError, match="buffer_size"):
        Recorder(db, buffer_size=0)


# ---------------------------------------------------------------------------- SQLite fast path
def generation_request(i: int) -> RequestRow:
    return RequestRow(instance_id="rt", model="dec", batch_seq=None, priority=1, arrived_at=2000.0 + i,
                      finished_at=2001.0 + i, queue_wait_s=0.002, latency_s=1.0, outcome="ok", bypass=i % 2 == 0,
                      length=None, ttft_s=0.05 * i, tpot_s=None if i % 3 else 0.01, prompt_tokens=i,
                      output_tokens=2 * i)


@pytest.mark.both_backends
def test_rows_read_back_exactly_as_put(db):
    """Mixed groups: None and bool values, all-None columns, partial statements."""
    plain = [request(i) for i in range(1000)]  # ttft/tpot/tokens None in every row
    gen = [generation_request(i) for i in range(37)]  # some None, some values, bools both ways
    batches = [batch(i) for i in range(300)]
    batches[7].bucket, batches[8].cuda_graph, batches[9].queue_depth = 64, False, 3
    rec = Recorder(db, max_rows_per_flush=10_000)
    for r in plain + batches + gen:
        rec.put(r)
    assert rec.flush() == 1337 and rec.dropped == 0
    assert stored(db, RequestRecord, RequestRow) == plain + gen
    assert stored(db, BatchRecord, BatchRow) == batches
    with db.connect() as conn:
        kinds = conn.execute(select(RequestRecord.bypass).where(RequestRecord.model == "dec")).scalars().all()
    assert kinds == [i % 2 == 0 for i in range(37)] and all(type(k) is bool for k in kinds)


def test_core_path_writes_the_same_rows(db, db_url, tmp_path, monkeypatch):
    """Databases other than SQLite go through SQLAlchemy Core; the rows are identical."""
    import batchscope.storage.inserts as inserts_module

    records = [request(i) for i in range(50)] + [generation_request(i) for i in range(9)] + [batch(1)]
    fast = Recorder(db)
    for r in records:
        fast.put(r)
    assert fast.flush() == 60
    monkeypatch.setattr(inserts_module, "is_pysqlite", lambda _engine: False)
    other = make_engine(f"sqlite:///{tmp_path / 'core.db'}")
    core = Recorder(other)
    for r in records:
        core.put(r)
    assert core.flush() == 60
    assert stored(other, RequestRecord, RequestRow) == stored(db, RequestRecord, RequestRow)
    assert stored(other, BatchRecord, BatchRow) == stored(db, BatchRecord, BatchRow) == [batch(1)]
    other.dispose()


def test_a_flush_uses_few_statements(db):
    """1000 rows are a handful of multi-row INSERTs, not one statement per row."""
    statements: list[str] = []

    @event.listens_for(db, "connect")
    def _trace(dbapi_conn, _record):
        dbapi_conn.set_trace_callback(statements.append)

    db.dispose()
    rec = Recorder(db, max_rows_per_flush=5000)
    for i in range(1000):
        rec.put(request(i))
    assert rec.flush() == 1000
    inserts = [s for s in statements if s.startswith('INSERT INTO "requests"')]
    # 3 statements of 256 rows, then 128 + 64 + 32 + 8 for the remaining 232
    assert len(inserts) == 7
    assert count(db, RequestRecord) == 1000


def test_small_parameter_limit_splits_statements(db):
    from batchscope.storage.inserts import SqliteInserts

    table = RequestRecord.__table__
    inserts = SqliteInserts(RequestRow, table, max_params=40)
    assert inserts.rows_per_statement(len(RequestRow.__slots__)) == 2
    rows = [generation_request(i) for i in range(5)]
    raw = db.raw_connection()
    try:
        cursor = raw.cursor()
        inserts.run(cursor, rows)
        raw.commit()
    finally:
        raw.close()
    assert stored(db, RequestRecord, RequestRow) == rows


@pytest.mark.both_backends
def test_a_refused_group_is_dropped_alone(db):
    """One table's rows failing (an unbindable value) loses only that table's rows."""
    rec = Recorder(db)
    bad = batch(1)
    bad.bucket = [1, 2]  # sqlite3 cannot bind a list
    for i in range(20):
        rec.put(request(i))
    rec.put(bad)
    rec.put(batch(2))
    assert rec.flush() == 20
    assert rec.dropped == 2 and rec.dropped_by_kind == {"batches": 2} and not rec.healthy
    assert count(db, RequestRecord) == 20 and count(db, BatchRecord) == 0
    rec.put(batch(3))
    assert rec.flush() == 1 and rec.healthy
    assert stored(db, BatchRecord, BatchRow) == [batch(3)]


def test_tee_keeps_feeding_after_a_broken_target(db):
    class Broken:
        def put(self, record):
            raise RuntimeError("broken")

    memory = ListRecorder()
    tee = TeeRecorder(Broken(), memory)
    for i in range(4):
        tee.put(request(i))
    assert len(memory.records) == 4


@pytest.mark.both_backends
def test_put_many_keeps_order_and_counts_what_does_not_fit(db):
    rec = Recorder(db, buffer_size=100)  # writer not started
    rec.put_many([request(i) for i in range(60)])
    rec.put_many([request(i) for i in range(60, 130)])   # 40 fit, 30 are dropped
    assert rec.buffered == 100 and rec.dropped == 30
    assert rec.dropped_by_kind == {"requests": 30}
    rec.close()
    assert stored(db, RequestRecord, RequestRow) == [request(i) for i in range(100)]
    rec.put_many([request(0), request(1)])  # closed: refused and counted, never raised
    assert rec.dropped == 32


def test_tee_put_many_reaches_targets_with_and_without_put_many(db):
    class Broken:
        def put_many(self, records):
            raise RuntimeError("broken")

        def put(self, record):
            raise RuntimeError("broken")

    class OnlyPut:
        def __init__(self):
            self.seen = []

        def put(self, record):
            self.seen.append(record)

    memory, plain = ListRecorder(), OnlyPut()
    tee = TeeRecorder(Broken(), memory, plain)
    rows = [request(i) for i in range(5)]
    tee.put_many(rows)
    tee.put(request(5))
    assert memory.records == rows + [request(5)] and plain.seen == rows + [request(5)]

