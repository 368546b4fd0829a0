"""A SQLite file deleted (or replaced) under a running recorder: the recorder notices,
creates a new database with the schema, writes the later rows there and says, in the new
database, in its counters and in the log, how many rows went into the lost file. Also:
database files BatchScope creates are readable by their owner only."""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest
from sqlalchemy import select

from batchscope.storage.db import DIR_MODE, FILE_MODE, DatabaseNotFound, make_engine
from batchscope.storage.records import RequestRow
from batchscope.storage.recorder import Recorder
from batchscope.storage.schema import EventRecord, RequestRecord
from tests.factories import count, wait_until


def request(i: int) -> RequestRow:
    return RequestRow(instance_id="rt", model="mlp", batch_seq=i // 8, priority=0,
                      arrived_at=1000.0 + i, finished_at=1000.5 + i, queue_wait_s=0.001,
                      latency_s=0.01, outcome="ok", bypass=False, length=None)


def delete_database(path) -> None:
    for suffix in ("", "-wal", "-shm"):
        try:
            os.remove(f"{path}{suffix}")
        except FileNotFoundError:
            pass


def loss_events(engine) -> list[dict]:
    with engine.connect() as conn:
        rows = conn.execute(select(EventRecord.details_json)
                            .where(EventRecord.kind == "recorder_drops")).scalars().all()
    return [json.loads(r) for r in rows]


@pytest.mark.parametrize("writer_process", [False, True], ids=["thread", "process"])
def test_a_deleted_database_is_recreated_and_the_loss_reported(tmp_path, caplog, writer_process):
    path = tmp_path / "rec.db"
    engine = make_engine(f"sqlite:///{path}")
    rec = Recorder(engine, file_check_interval_s=0.0, writer_process=writer_process,
                   instance_id="rt-1")
    try:
        rec.put_many([request(i) for i in range(300)])
        assert rec.flush() == 300
        assert count(engine, RequestRecord) == 300
        delete_database(path)
        assert not path.exists()

        # the 300 rows went into the file that is gone: the next flush notices first
        rec.put_many([request(i) for i in range(300, 420)])
        with caplog.at_level(logging.WARNING, logger="batchscope.storage.recorder"):
            assert rec.flush() == 120
        assert path.exists()
        assert count(engine, RequestRecord) == 120  # the later rows, in the new file
        events = loss_events(engine)
        assert len(events) == 1
        assert events[0]["reason"] == "database file deleted"
        assert events[0]["dropped"] == 300 and events[0]["by_kind"] == {"requests": 300}
        assert rec.dropped == 300 and rec.dropped_by_kind == {"requests": 300}
        assert rec.database_replacements == 1
        assert any("database file deleted" in r.getMessage() and "300 rows" in r.getMessage()
                   for r in caplog.records)
        # a file in place is left alone: no second event, nothing more counted as lost
        rec.put_many([request(i) for i in range(420, 430)])
        assert rec.flush() == 10
        assert len(loss_events(engine)) == 1 and rec.dropped == 300
    finally:
        rec.close()
        engine.dispose()


def test_a_replaced_database_file_is_reopened(tmp_path):
    path = tmp_path / "rec.db"
    engine = make_engine(f"sqlite:///{path}")
    rec = Recorder(engine, file_check_interval_s=0.0)
    try:
        rec.put_many([request(i) for i in range(50)])
        assert rec.flush() == 50
        delete_database(path)
        other = make_engine(f"sqlite:///{path}")  # someone put a fresh database there
        other.dispose()
        rec.put_many([request(i) for i in range(50, 60)])
        assert rec.flush() == 10
        assert count(engine, RequestRecord) == 10
        [event] = loss_events(engine)
        assert event["reason"] == "database file replaced" and event["dropped"] == 50
    finally:
        rec.close()
        engine.dispose()


def test_the_check_runs_at_most_once_per_interval(tmp_path):
    path = tmp_path / "rec.db"
    engine = make_engine(f"sqlite:///{path}")
    rec = Recorder(engine, file_check_interval_s=3600.0)
    try:
        rec.put(request(0))
        rec.flush()          # the first check ran here
        delete_database(path)
        rec.put(request(1))
        rec.flush()          # not checked again within the interval
        assert rec.database_replacements == 0 and not path.exists()
    finally:
        rec.close()
        engine.dispose()


def test_the_writer_thread_notices_without_a_flush_call(tmp_path):
    path = tmp_path / "rec.db"
    engine = make_engine(f"sqlite:///{path}")
    rec = Recorder(engine, flush_interval_s=0.01, file_check_interval_s=0.0)
    rec.start()
    try:
        delete_database(path)
        assert wait_until(lambda: rec.database_replacements == 1 and path.exists())
    finally:
        rec.close()
        engine.dispose()


def test_database_files_are_created_owner_only(tmp_path):
    folder = tmp_path / "data"
    path = folder / "batchscope.db"
    engine = make_engine(f"sqlite:///{path}")
    try:
        with engine.begin() as conn:  # a write, so the -wal and -shm exist
            conn.exec_driver_sql("INSERT INTO schema_meta (key, value) VALUES ('k', 'v')")
        for name in ("batchscope.db", "batchscope.db-wal", "batchscope.db-shm"):
            mode = stat.S_IMODE(os.stat(folder / name).st_mode)
            assert mode & ~FILE_MODE == 0, (name, oct(mode))
        assert stat.S_IMODE(os.stat(folder).st_mode) & ~DIR_MODE == 0
    finally:
        engine.dispose()


def test_open_only_creates_nothing(tmp_path):
    missing = tmp_path / "no" / "such.db"
    with pytest.raises(DatabaseNotFound, match="no SQLite database file"):
        make_engine(f"sqlite:///{missing}", create=False)
    assert not missing.parent.exists()
    # an existing file opens; a missing one is not created behind the check's back either
    path = tmp_path / "there.db"
    make_engine(f"sqlite:///{path}").dispose()
    engine = make_engine(f"sqlite:///{path}", create=False)
    try:
        os.remove(path)
        with pytest.raises(Exception):
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
        assert not path.exists()
    finally:
        engine.dispose()
