"""The recorder with its database inserts in a child process: rows arrive exactly, a
locked database and a dead child cost counted drops and nothing else, and the child
goes away with the recorder."""

from __future__ import annotations

import os
import signal
import sqlite3

import pytest
from sqlalchemy import select

from batchscope.storage.db import make_engine
from batchscope.storage.records import BatchRow, EventRow, RequestRow
from batchscope.storage.recorder import Recorder
from batchscope.storage.schema import BatchRecord, EventRecord, RequestRecord
from batchscope.storage import writer_process
from batchscope.storage.writer_process import WriterProcess
from runtime.tools.cli import build_parser
from runtime.api.config import ServerConfig
from runtime.api.errors import ConfigError
from tests.factories import count, stored


@pytest.fixture(autouse=True)
def no_starvation_rule(monkeypatch):
    """The parent gives a starved idle child a fair share once a write has waited
    ``STARVED_AFTER_S`` of wall-clock time, which a loaded machine reaches at random;
    here only the backlog rule (counts) decides, and the starvation rule is called
    directly where it is tested."""
    monkeypatch.setattr(writer_process, "STARVED_AFTER_S", 3600.0)


def request(i: int) -> RequestRow:
    return RequestRow(instance_id="rt", model="mlp", batch_seq=i // 8, priority=i % 3,
                      arrived_at=1000.0 + i, finished_at=1000.5 + i, queue_wait_s=0.001 * (i % 7),
                      latency_s=0.01, outcome="ok", bypass=i % 5 == 0,
                      length=None if i % 2 else i % 50)


def batch(i: int) -> BatchRow:
    return BatchRow(instance_id="rt", model="mlp", seq=i, policy="dynamic", settings_version=1,
                    max_batch_size=8, bucket=None, batch_size=8, real_elements=8, padded_elements=8,
                    queue_wait_min_s=0.0, queue_wait_mean_s=0.001, queue_wait_max_s=0.002,
                    compute_s=0.004, started_at=1000.0 + i, ended_at=1000.01 + i,
                    peak_memory_bytes=None if i % 2 else 2**33, cuda_graph=i % 3 == 0)


def test_rows_arrive_exactly_through_the_child(db):
    rec = Recorder(db, max_rows_per_flush=10_000, writer_process=True)
    requests = [request(i) for i in range(700)]
    batches = [batch(i) for i in range(90)]
    rec.put_many(requests)
    for b in batches:
        rec.put(b)
    assert rec.flush() == 790
    pid = rec.process.pid
    assert pid is not None and pid != os.getpid()
    assert stored(db, RequestRecord, RequestRow) == requests
    assert stored(db, BatchRecord, BatchRow) == batches
    if hasattr(os, "SCHED_IDLE"):   # Linux: the child only gets CPU time nothing else wants
        assert rec.process.priority == "idle"
        assert os.sched_getscheduler(pid) == os.SCHED_IDLE
        assert os.sched_getscheduler(0) != os.SCHED_IDLE   # the serving process is untouched
    else:
        assert rec.process.priority in ("nice", "normal")
    rec.close()
    assert rec.process.pid is None   # the child is gone with the recorder
    assert rec.dropped == 0 and rec.written == 790


def test_writer_thread_and_child_together(db):
    rec = Recorder(db, flush_interval_s=0.01, max_rows_per_flush=500, writer_process=True)
    rec.start()
    for i in range(3000):
        rec.put(request(i))
    rec.close()
    assert rec.dropped == 0 and count(db, RequestRecord) == 3000


def test_locked_database_drops_then_recovers(db_url, db):
    rec = Recorder(db, max_rows_per_flush=1000, writer_process=True)
    rec.process = WriterProcess(db_url, busy_timeout_ms=20)
    blocker = sqlite3.connect(db_url.split("///", 1)[1], isolation_level=None)
    blocker.execute("BEGIN EXCLUSIVE")
    for i in range(40):
        rec.put(request(i))
        rec.put(batch(i))
    assert rec.flush() == 0
    assert rec.dropped == 80 and rec.dropped_by_kind == {"requests": 40, "batches": 40}
    assert not rec.healthy
    blocker.execute("ROLLBACK")
    blocker.close()
    rec.put_many([request(i) for i in range(10)])
    assert rec.flush() == 10 and rec.healthy
    assert count(db, RequestRecord) == 10
    assert rec.process.starts == 1  # a database failure does not cost the child
    with db.connect() as conn:
        events = conn.execute(select(EventRecord).where(EventRecord.kind == "recorder_drops")).all()
    assert len(events) == 1
    rec.close()


def test_a_killed_child_costs_its_rows_and_is_replaced(db):
    rec = Recorder(db, max_rows_per_flush=1000, writer_process=True)
    rec.put(request(0))
    assert rec.flush() == 1
    os.kill(rec.process.pid, signal.SIGKILL)
    rec.process._proc.join(10)
    rec.put_many([request(i) for i in range(1, 6)])
    # the dead child is noticed before the send: a new one takes the rows
    assert rec.flush() == 5 and rec.process.starts == 2
    # a child that dies while writing: those rows are dropped and counted, then a new one
    rec.process.reply_timeout_s = 0.5
    os.kill(rec.process.pid, signal.SIGSTOP)
    try:
        rec.put_many([request(i) for i in range(6, 9)])
        assert rec.flush() == 0
        assert rec.dropped == 3 and not rec.healthy
    finally:
        assert rec.process.pid is None   # the unanswering child was killed
    rec.put(request(9))
    assert rec.flush() == 1 and rec.healthy and rec.process.starts == 3
    rec.close()
    assert count(db, RequestRecord) == 7


def test_a_child_that_cannot_open_the_database_is_a_counted_failure(tmp_path):
    db = make_engine(f"sqlite:///{tmp_path / 'ok.db'}")
    rec = Recorder(db, writer_process=True)
    (tmp_path / "plain-file").write_text("not a folder")
    rec.process = WriterProcess(f"sqlite:///{tmp_path / 'plain-file' / 'x.db'}")
    rec.put(EventRow(instance_id="rt", model=None, at=1.0, kind="note", message="m"))
    assert rec.flush() == 0
    assert rec.dropped == 1 and rec.dropped_by_kind == {"events": 1} and not rec.healthy
    rec.close()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or os.geteuid() != 0,
                    reason="leaving SCHED_IDLE needs Linux and, for most users, privileges")
def test_a_growing_backlog_gets_the_child_a_fair_cpu_share(db):
    rec = Recorder(db, buffer_size=100, max_rows_per_flush=10, writer_process=True)
    rec.put_many([request(i) for i in range(60)])   # 50 left behind the first flush: 0.5 full
    assert rec.flush() == 10
    pid = rec.process.pid
    assert rec.process.priority == "nice"
    assert os.sched_getscheduler(pid) == os.SCHED_OTHER
    assert os.getpriority(os.PRIO_PROCESS, pid) >= 10
    assert rec.flush() == 10 and rec.flush() == 10   # 20 of 100 left: between the marks
    assert rec.process.priority == "nice"
    while rec.buffered:
        rec.flush()                           # the last flush leaves nothing: back to idle
    assert rec.process.priority == "idle" and os.sched_getscheduler(pid) == os.SCHED_IDLE
    rec.close()
    assert count(db, RequestRecord) == 60


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or os.geteuid() != 0,
                    reason="leaving SCHED_IDLE needs Linux and, for most users, privileges")
def test_a_starved_idle_child_is_given_a_fair_share_by_the_parent(db, db_url):
    """On a machine whose CPUs are never idle an idle-scheduled child does not run at all,
    so it cannot ask for more itself: the parent, not answered within STARVED_AFTER_S,
    gives it a fair share (here called directly; the wait is what calls it)."""
    rec = Recorder(db, writer_process=True)
    rec.put(request(1))
    assert rec.flush() == 1  # the child runs, idle
    process = rec.process
    pid = process.pid
    assert os.sched_getscheduler(pid) == os.SCHED_IDLE
    process.boost()
    assert os.sched_getscheduler(pid) == os.SCHED_OTHER
    assert os.getpriority(os.PRIO_PROCESS, pid) >= 10 and process.boosts == 1
    process.boost()  # no longer idle: nothing to do
    assert process.boosts == 1
    rec.put(request(2))
    assert rec.flush() == 1
    # the child took the fair share in (it was "nice" from then on) and, its backlog
    # calm, went back to idle with that write
    assert process.priority == "idle" and os.sched_getscheduler(pid) == os.SCHED_IDLE
    rec.close()
    assert count(db, RequestRecord) == 2


def test_without_idle_scheduling_the_child_is_niced(db, db_url):
    rec = Recorder(db, writer_process=True)
    rec.process = WriterProcess(db_url, idle=False, nice=5)
    rec.put(request(1))
    assert rec.flush() == 1
    assert rec.process.priority == "nice"
    assert os.getpriority(os.PRIO_PROCESS, rec.process.pid) == os.getpriority(os.PRIO_PROCESS, 0) + 5
    rec.close()


def test_server_settings_and_command_line():
    assert ServerConfig().recorder_process is False
    with pytest.raises(ConfigError, match="recorder_process"):
        ServerConfig(recorder_process="yes")
    parser = build_parser()
    assert parser.parse_args(["serve"]).recorder_process is True
    assert parser.parse_args(["serve", "--no-recorder-process"]).recorder_process is False
