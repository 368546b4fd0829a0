"""Schema migrations: a database of the previous release upgrades in place and keeps its
rows, a newer one is refused untouched, instances starting together on a fresh
database do not race, and the migrations build exactly the tables the code describes."""

from __future__ import annotations

import os
import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import create_engine, func, inspect, select, text

from batchscope.storage import db as storage_db
from batchscope.storage.db import SchemaTooNew, make_engine, schema_revision, schema_version
from batchscope.storage import control
from batchscope.storage.migrations import VERSION_TABLE
from batchscope.storage.records import DeviceRow, RequestRow, TraceRow
from batchscope.storage.recorder import Recorder
from batchscope.storage.schema import (SCHEMA_VERSION, Base, DeviceSample, RequestRecord,
                                       RequestTraceRecord, Rollup, RuntimeInstance, StatsSummary,
                                       TuningSessionRecord, TuningTrialRecord)
from tests.factories import count, database_at

pytestmark = pytest.mark.both_backends

GIB = 1024 ** 3

#: the tables BatchScope 0.1 made (``create_all`` of its schema, version 2), as it made
#: them; ``{id}`` is an autoincrementing integer id (SERIAL on PostgreSQL)
RELEASE_0_1_TABLES = """
CREATE TABLE schema_meta ("key" VARCHAR(64) NOT NULL, value TEXT NOT NULL, PRIMARY KEY ("key"));
CREATE TABLE runtime_instances (id VARCHAR(64) NOT NULL, host VARCHAR(255) NOT NULL,
  pid INTEGER NOT NULL, models_json TEXT NOT NULL, url VARCHAR(255), device VARCHAR(255),
  version VARCHAR(64), started_at FLOAT NOT NULL, last_seen_at FLOAT NOT NULL, stopped_at FLOAT,
  records_dropped INTEGER NOT NULL, PRIMARY KEY (id));
CREATE INDEX ix_runtime_instances_last_seen_at ON runtime_instances (last_seen_at);
CREATE TABLE batches (id {id} NOT NULL, instance_id VARCHAR(64) NOT NULL, model VARCHAR(128) NOT NULL,
  seq INTEGER NOT NULL, policy VARCHAR(16) NOT NULL, settings_version INTEGER NOT NULL,
  max_batch_size INTEGER NOT NULL, bucket INTEGER, batch_size INTEGER NOT NULL,
  real_elements INTEGER NOT NULL, padded_elements INTEGER NOT NULL, queue_wait_min_s FLOAT NOT NULL,
  queue_wait_mean_s FLOAT NOT NULL, queue_wait_max_s FLOAT NOT NULL, compute_s FLOAT NOT NULL,
  started_at FLOAT NOT NULL, ended_at FLOAT NOT NULL, outcome VARCHAR(16) NOT NULL,
  peak_memory_bytes INTEGER, cuda_graph BOOLEAN NOT NULL, queue_depth INTEGER, PRIMARY KEY (id));
CREATE INDEX ix_batches_instance_ended ON batches (instance_id, ended_at);
CREATE INDEX ix_batches_model_ended ON batches (model, ended_at);
CREATE TABLE requests (id {id} NOT NULL, instance_id VARCHAR(64) NOT NULL, model VARCHAR(128) NOT NULL,
  batch_seq INTEGER, priority INTEGER NOT NULL, bypass BOOLEAN NOT NULL, length INTEGER,
  arrived_at FLOAT NOT NULL, finished_at FLOAT NOT NULL, queue_wait_s FLOAT NOT NULL,
  latency_s FLOAT NOT NULL, outcome VARCHAR(16) NOT NULL, ttft_s FLOAT, tpot_s FLOAT,
  prompt_tokens INTEGER, output_tokens INTEGER, PRIMARY KEY (id));
CREATE INDEX ix_requests_instance_finished ON requests (instance_id, finished_at);
CREATE INDEX ix_requests_model_finished ON requests (model, finished_at);
CREATE TABLE events (id {id} NOT NULL, instance_id VARCHAR(64) NOT NULL, model VARCHAR(128),
  at FLOAT NOT NULL, kind VARCHAR(32) NOT NULL, severity VARCHAR(16) NOT NULL, message TEXT NOT NULL,
  details_json TEXT NOT NULL, PRIMARY KEY (id));
CREATE INDEX ix_events_at ON events (at);
CREATE TABLE device_samples (id {id} NOT NULL, instance_id VARCHAR(64) NOT NULL, at FLOAT NOT NULL,
  device VARCHAR(64) NOT NULL, kind VARCHAR(8) NOT NULL, utilization_pct FLOAT,
  memory_used_bytes INTEGER, memory_total_bytes INTEGER, power_w FLOAT, sm_clock_mhz FLOAT,
  temperature_c FLOAT, torch_allocated_bytes INTEGER, torch_reserved_bytes INTEGER,
  process_rss_bytes INTEGER, PRIMARY KEY (id));
CREATE INDEX ix_device_samples_at ON device_samples (at);
CREATE TABLE generation_steps (id {id} NOT NULL, instance_id VARCHAR(64) NOT NULL,
  model VARCHAR(128) NOT NULL, at FLOAT NOT NULL, mode VARCHAR(16) NOT NULL, running INTEGER NOT NULL,
  waiting INTEGER NOT NULL, prefill_tokens INTEGER NOT NULL, decode_tokens INTEGER NOT NULL,
  blocks_used INTEGER NOT NULL, blocks_free INTEGER NOT NULL, preemptions INTEGER NOT NULL,
  step_s FLOAT NOT NULL, PRIMARY KEY (id));
CREATE INDEX ix_gensteps_model_at ON generation_steps (model, at);
CREATE TABLE model_settings (instance_id VARCHAR(64) NOT NULL, model VARCHAR(128) NOT NULL,
  version INTEGER NOT NULL, settings_json TEXT NOT NULL, kind VARCHAR(16) NOT NULL,
  updated_at FLOAT NOT NULL, PRIMARY KEY (instance_id, model));
CREATE TABLE control_commands (id {id} NOT NULL, instance_id VARCHAR(64), model VARCHAR(128) NOT NULL,
  changes_json TEXT NOT NULL, requested_by VARCHAR(128) NOT NULL, requested_at FLOAT NOT NULL,
  status VARCHAR(16) NOT NULL, reason TEXT, applied_version INTEGER, handled_at FLOAT,
  PRIMARY KEY (id));
CREATE INDEX ix_control_commands_status ON control_commands (status);
CREATE TABLE command_acks (command_id INTEGER NOT NULL, instance_id VARCHAR(64) NOT NULL,
  status VARCHAR(16) NOT NULL, reason TEXT, applied_version INTEGER, handled_at FLOAT NOT NULL,
  PRIMARY KEY (command_id, instance_id));
CREATE TABLE rollups (id {id} NOT NULL, instance_id VARCHAR(64) NOT NULL, model VARCHAR(128) NOT NULL,
  interval_start FLOAT NOT NULL, interval_s FLOAT NOT NULL, requests INTEGER NOT NULL,
  requests_ok INTEGER NOT NULL, requests_failed INTEGER NOT NULL, batches INTEGER NOT NULL,
  batch_size_sum INTEGER NOT NULL, real_elements INTEGER NOT NULL, padded_elements INTEGER NOT NULL,
  queue_wait_sum_s FLOAT NOT NULL, compute_sum_s FLOAT NOT NULL, latency_sum_s FLOAT NOT NULL,
  latency_hist_json TEXT NOT NULL, batch_size_hist_json TEXT NOT NULL, outcomes_json TEXT NOT NULL,
  PRIMARY KEY (id));
CREATE INDEX ix_rollups_key ON rollups (instance_id, model, interval_s, interval_start);
CREATE INDEX ix_rollups_model_start ON rollups (model, interval_start);
"""

#: some rows as the previous release wrote them
RELEASE_0_1_ROWS = """
INSERT INTO schema_meta ("key", value) VALUES ('schema_version', '{version}');
INSERT INTO runtime_instances VALUES ('rt-1', 'h', 7, '["mlp"]', NULL, 'cuda:0', '0.1.0', 10.0, 20.0, NULL, 3);
INSERT INTO requests (instance_id, model, batch_seq, priority, bypass, length, arrived_at, finished_at,
  queue_wait_s, latency_s, outcome) VALUES ('rt-1', 'mlp', 1, 0, FALSE, 12, 10.0, 10.5, 0.1, 0.5, 'ok'),
  ('rt-1', 'mlp', NULL, 1, TRUE, NULL, 11.0, 11.0, 0.0, 0.0, 'rejected');
INSERT INTO batches (instance_id, model, seq, policy, settings_version, max_batch_size, bucket, batch_size,
  real_elements, padded_elements, queue_wait_min_s, queue_wait_mean_s, queue_wait_max_s, compute_s,
  started_at, ended_at, outcome, peak_memory_bytes, cuda_graph, queue_depth)
  VALUES ('rt-1', 'mlp', 1, 'dynamic', 1, 8, NULL, 1, 1, 1, 0.1, 0.1, 0.1, 0.4, 10.1, 10.5, 'ok',
          2000000000, FALSE, 0);
INSERT INTO device_samples (instance_id, at, device, kind, memory_used_bytes, memory_total_bytes)
  VALUES ('rt-1', 10.0, 'cuda:0', 'gpu', 2000000000, 2147483647);
INSERT INTO rollups (instance_id, model, interval_start, interval_s, requests, requests_ok, requests_failed,
  batches, batch_size_sum, real_elements, padded_elements, queue_wait_sum_s, compute_sum_s, latency_sum_s,
  latency_hist_json, batch_size_hist_json, outcomes_json)
  VALUES ('rt-1', 'mlp', 0.0, 60.0, 4, 4, 0, 1, 4, 4, 4, 0.4, 0.1, 2.0, '{{"0.5623": 4}}', '{{"4": 1}}',
          '{{"ok": 4}}');
"""


def write_release_0_1(url: str, *, version: int = 2) -> None:
    """A database as BatchScope 0.1 left it: its tables (without migrations) and rows.
    ``version=1``: without what schema version 2 added (``command_acks``,
    ``rollups.outcomes_json``, the ``ix_rollups_key`` index)."""
    engine = create_engine(url)
    ddl = RELEASE_0_1_TABLES.format(id="SERIAL" if engine.dialect.name == "postgresql" else "INTEGER")
    statements = (ddl + RELEASE_0_1_ROWS.format(version=version)).split(";")
    if version == 1:
        statements += ["DROP TABLE command_acks", "DROP INDEX ix_rollups_key",
                       "ALTER TABLE rollups DROP COLUMN outcomes_json"]
    with engine.begin() as conn:
        for statement in statements:
            if statement.strip():
                conn.exec_driver_sql(statement)
    engine.dispose()


def columns(engine, table: str) -> dict[str, str]:
    return {c["name"]: str(c["type"]) for c in inspect(engine).get_columns(table)}


@pytest.mark.parametrize("version", [2, 1])
def test_a_database_of_the_previous_release_upgrades_in_place(db_url, backend, version):
    write_release_0_1(db_url, version=version)
    engine = make_engine(db_url)
    try:
        assert schema_version(engine) == SCHEMA_VERSION and schema_revision(engine) == storage_db._head()
        assert count(engine, RequestRecord) == 2 and count(engine, Rollup) == 1
        with engine.connect() as conn:
            req = conn.execute(select(RequestRecord).order_by(RequestRecord.id)).all()
            outcomes = conn.execute(select(Rollup.outcomes_json)).scalar()
        assert [(r.id, r.outcome, r.bypass, r.length) for r in req] == [(1, "ok", False, 12),
                                                                       (2, "rejected", True, None)]
        assert outcomes == ('{"ok": 4}' if version == 2 else None)
        with engine.connect() as conn:  # the old rows are in the live summaries too
            summed = conn.execute(select(func.sum(StatsSummary.requests), func.sum(StatsSummary.ok),
                                         func.sum(StatsSummary.batches)).where(StatsSummary.span_s == 1)).one()
        assert tuple(summed) == (2, 1, 1)
        # what the old types refused on PostgreSQL now fits, and ids go on from the old rows
        rec = Recorder(engine)
        rec.put(DeviceRow(instance_id="rt-1", at=11.0, device="cuda:0", kind="gpu",
                          memory_used_bytes=70 * GIB, memory_total_bytes=141 * GIB,
                          torch_allocated_bytes=65 * GIB))
        assert rec.flush() == 1 and rec.dropped == 0
        with engine.connect() as conn:
            ids_bytes = conn.execute(select(DeviceSample.id, DeviceSample.memory_used_bytes)
                                     .order_by(DeviceSample.id)).all()
        assert [tuple(r) for r in ids_bytes] == [(1, 2_000_000_000), (2, 70 * GIB)]
        if backend == "postgresql":
            assert columns(engine, "device_samples")["memory_used_bytes"] == "BIGINT"
            assert columns(engine, "requests")["id"] == "BIGINT"
        # a second start finds it current and changes nothing
        make_engine(db_url).dispose()
        assert count(engine, DeviceSample) == 2
    finally:
        engine.dispose()


#: rows as a release at revision 0003 (schema version 4) wrote them
REVISION_0003_ROWS = """
INSERT INTO runtime_instances (id, host, pid, models_json, url, device, version, started_at,
  last_seen_at, stopped_at, records_dropped) VALUES ('rt-1', 'h', 7, '["mlp"]', 'http://h:8000',
  'cpu', '0.2.0', 10.0, 20.0, NULL, 0);
INSERT INTO requests (instance_id, model, batch_seq, priority, bypass, length, arrived_at, finished_at,
  queue_wait_s, latency_s, outcome) VALUES ('rt-1', 'mlp', 1, 0, FALSE, 12, 10.0, 10.5, 0.1, 0.5, 'ok'),
  ('rt-1', 'mlp', NULL, 1, TRUE, NULL, 11.0, 11.0, 0.0, 0.0, 'rejected');
INSERT INTO summary_stats (span_s, start_s, model, instance_id, requests, ok)
  VALUES (1, 10, 'mlp', 'rt-1', 2, 1);
"""


def test_a_database_of_schema_version_4_upgrades_in_place_with_its_rows(db_url):
    """Revision 0003 -> 0004: the tuning tables appear, the new columns read NULL for the
    rows already there, and nothing else moves (its summaries are not rebuilt)."""
    database_at(db_url, "0003", *REVISION_0003_ROWS.split(";"))
    plain = create_engine(db_url)
    assert not inspect(plain).has_table(TuningSessionRecord.__tablename__)
    plain.dispose()
    engine = make_engine(db_url)
    try:
        assert schema_version(engine) == SCHEMA_VERSION and schema_revision(engine) == storage_db._head()
        with engine.connect() as conn:
            req = conn.execute(select(RequestRecord.id, RequestRecord.outcome, RequestRecord.length,
                                      RequestRecord.input_shape_json, RequestRecord.timeout_ms)
                               .order_by(RequestRecord.id)).all()
            inst = conn.execute(select(RuntimeInstance.url, RuntimeInstance.cpu_count)).one()
            summed = conn.execute(select(func.sum(StatsSummary.requests))).scalar()
        assert [tuple(r) for r in req] == [(1, "ok", 12, None, None), (2, "rejected", None, None, None)]
        assert tuple(inst) == ("http://h:8000", None) and summed == 2
        assert count(engine, TuningSessionRecord) == 0 and count(engine, TuningTrialRecord) == 0
        # the new columns and tables take rows, and ids go on from the old ones
        rec = Recorder(engine)
        rec.put(RequestRow("rt-1", "mlp", 2, 0, 12.0, 12.1, 0.0, 0.1, "ok", length=5,
                           input_shape_json='{"X":[5]}', timeout_ms=250.0))
        assert rec.flush() == 1
        control.register_instance(engine, instance_id="rt-1", host="h", pid=8, models=["mlp"],
                                  url="http://h:8000", device="cpu", version="x", now=30.0)
        with engine.connect() as conn:
            row = conn.execute(select(RequestRecord.id, RequestRecord.input_shape_json,
                                      RequestRecord.timeout_ms).where(RequestRecord.id == 3)).one()
            cpus = conn.execute(select(RuntimeInstance.cpu_count)).scalar()
        assert tuple(row) == (3, '{"X":[5]}', 250.0) and cpus == os.cpu_count()
    finally:
        engine.dispose()


def test_a_database_of_schema_version_5_upgrades_in_place_and_takes_traces(db_url):
    """Revision 0004 -> 0005: ``request_traces`` appears, empty, and takes rows."""
    database_at(db_url, "0004")
    plain = create_engine(db_url)
    assert not inspect(plain).has_table(RequestTraceRecord.__tablename__)
    plain.dispose()
    engine = make_engine(db_url)
    try:
        assert schema_version(engine) == SCHEMA_VERSION and schema_revision(engine) == storage_db._head()
        assert count(engine, RequestTraceRecord) == 0
        rec = Recorder(engine)
        rec.put(TraceRow("rt-1", "mlp", 1, "http", "ok", 12.0, 12.5, request_id="r-1",
                         batch_seq=3, queue_start_at=12.1, w3c_trace_id="ab" * 16,
                         w3c_parent_span_id="cd" * 8))
        rec.put(TraceRow("rt-1", "mlp", 2, "grpc", "rejected", 13.0, 13.0))
        assert rec.flush() == 2
        with engine.connect() as conn:
            rows = conn.execute(select(RequestTraceRecord.trace_id, RequestTraceRecord.request_id,
                                       RequestTraceRecord.queue_start_at,
                                       RequestTraceRecord.w3c_parent_span_id)
                                .order_by(RequestTraceRecord.id)).all()
        assert [tuple(r) for r in rows] == [(1, "r-1", 12.1, "cd" * 8), (2, None, None, None)]
    finally:
        engine.dispose()


def test_a_database_of_schema_version_10_drops_the_model_time_index_of_traces(db_url):
    """Revision 0009 -> 0010: ``request_traces`` keeps its rows and its time index; the
    (model, time) index, which no read used, is gone; new rows are written."""
    database_at(db_url, "0009", """
        INSERT INTO request_traces (instance_id, model, trace_id, protocol, outcome,
          request_start_at, request_end_at) VALUES ('rt-1', 'mlp', 1, 'http', 'ok', 12.0, 12.5)
        """)
    plain = create_engine(db_url)
    before = {ix["name"] for ix in inspect(plain).get_indexes("request_traces")}
    plain.dispose()
    assert before == {"ix_request_traces_model_end", "ix_request_traces_end"}
    engine = make_engine(db_url)
    try:
        assert schema_version(engine) == SCHEMA_VERSION >= 11
        assert schema_revision(engine) == storage_db._head() >= "0010"
        after = {ix["name"] for ix in inspect(engine).get_indexes("request_traces")}
        assert after == {"ix_request_traces_end"}
        rec = Recorder(engine)
        rec.put(TraceRow("rt-1", "mlp", 2, "grpc", "ok", 13.0, 13.2))
        assert rec.flush() == 1
        with engine.connect() as conn:
            ids = conn.execute(select(RequestTraceRecord.trace_id)
                               .order_by(RequestTraceRecord.id)).scalars().all()
        assert ids == [1, 2]
    finally:
        engine.dispose()


def test_a_database_of_schema_version_11_is_read_as_it_is_then_numbers_its_steps(db_url,
                                                                                  tmp_path):
    """Revision 0010 -> 0011: ``generation_steps`` gains ``seq``. Before the upgrade, a
    reader that changes nothing (``batchscope trace``, ``snapshot export``) reads its
    steps without numbers; after it, old rows read NULL and new ones are numbered."""
    from batchscope.analysis.queries.timeline import timeline_rows
    from batchscope.analysis.queries.window import Window
    from batchscope.presentation import snapshot
    from batchscope.storage.records import GenStepRow

    database_at(db_url, "0010", """
        INSERT INTO generation_steps (instance_id, model, at, mode, running, waiting,
          prefill_tokens, decode_tokens, blocks_used, blocks_free, preemptions, step_s)
        VALUES ('rt-1', 'decoder', 12.0, 'continuous', 2, 0, 8, 2, 4, 60, 0, 0.01)
        """)
    reader = make_engine(db_url, create=False)
    try:
        rows = timeline_rows(reader, Window(11.0, 13.0))
        assert len(rows.steps) == 1 and rows.steps["seq"].isna().all()
        out = tmp_path / "old.zip"
        assert snapshot.export_snapshot(reader, Window(11.0, 13.0), out) is not None
        snap = snapshot.load_snapshot(out)
        try:
            with snap.engine.connect() as conn:
                assert conn.execute(text("SELECT seq, running FROM generation_steps")
                                    ).all() == [(None, 2)]
        finally:
            snap.close()
        assert schema_version(reader) == 11  # read, not upgraded
    finally:
        reader.dispose()
    engine = make_engine(db_url)
    try:
        assert schema_version(engine) == SCHEMA_VERSION >= 12
        rec = Recorder(engine)
        rec.put(GenStepRow("rt-1", "decoder", 13.0, "continuous", 1, 0, 0, 1, 4, 60, 0, 0.01,
                           seq=7))
        assert rec.flush() == 1
        with engine.connect() as conn:
            assert conn.execute(text("SELECT seq FROM generation_steps ORDER BY at")
                                ).scalars().all() == [None, 7]
    finally:
        engine.dispose()


def test_a_database_of_schema_version_12_finds_batches_and_steps_by_their_number(db_url):
    """Revision 0011 -> 0012: ``batches`` and ``generation_steps`` keep their rows and
    gain an index led by their number, and the timeline's lookups by number
    (``find_batch``, ``find_step``) read through it: on SQLite, whose planner has no
    statistics, the query plan names it, with and without a model given."""
    from batchscope.analysis.queries.timeline import find_batch, find_step

    database_at(db_url, "0011", """
        INSERT INTO batches (instance_id, model, seq, policy, settings_version,
          max_batch_size, batch_size, real_elements, padded_elements, queue_wait_min_s,
          queue_wait_mean_s, queue_wait_max_s, compute_s, started_at, ended_at, outcome,
          cuda_graph) VALUES ('rt-1', 'mlp', 41, 'dynamic', 1, 32, 4, 4, 4, 0.001, 0.002,
          0.003, 0.002, 12.0, 12.002, 'ok', false)
        """, """
        INSERT INTO generation_steps (instance_id, model, at, mode, running, waiting,
          prefill_tokens, decode_tokens, blocks_used, blocks_free, preemptions, step_s, seq)
        VALUES ('rt-1', 'decoder', 12.0, 'continuous', 2, 0, 8, 2, 4, 60, 0, 0.01, 41)
        """)
    engine = make_engine(db_url)
    try:
        assert schema_version(engine) == SCHEMA_VERSION >= 13
        indexes = {t: {ix["name"]: ix["column_names"] for ix in inspect(engine).get_indexes(t)}
                   for t in ("batches", "generation_steps")}
        assert indexes["batches"]["ix_batches_seq"] == ["seq", "model", "ended_at"]
        assert indexes["generation_steps"]["ix_gensteps_seq"] == ["seq", "model", "at"]
        assert find_batch(engine, 41, model="mlp")["started_at"] == 12.0
        assert find_step(engine, 41, model="decoder")["ended_at"] == 12.0
        assert find_batch(engine, 41, model="decoder") is None
        if engine.dialect.name == "sqlite":
            with engine.connect() as conn:
                for sql in ("SELECT id FROM batches WHERE seq = 41 AND model = 'mlp' "
                            "AND instance_id = 'rt-1' ORDER BY ended_at DESC LIMIT 1",
                            "SELECT id FROM batches WHERE seq = 41 ORDER BY ended_at DESC",
                            "SELECT id FROM generation_steps WHERE seq = 41 AND "
                            "model = 'decoder' ORDER BY at DESC LIMIT 1"):
                    plan = " ".join(str(r[-1]) for r in
                                    conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql))
                    assert "_seq (seq=?" in plan, (sql, plan)
    finally:
        engine.dispose()


def test_an_empty_database_gets_every_table(db):
    assert schema_version(db) == SCHEMA_VERSION and schema_revision(db) == storage_db._head()
    assert set(Base.metadata.tables) <= set(inspect(db).get_table_names())


def test_the_migrations_build_exactly_the_tables_of_the_code(db_url, backend):
    """Fresh and upgraded databases alike: Alembic finds nothing to add, drop or change
    (column types are compared on PostgreSQL, where they differ; SQLite keeps whatever
    integer it is given)."""
    for fresh in (True, False):
        if not fresh:
            with create_engine(db_url).begin() as conn:
                for table in [*reversed(Base.metadata.sorted_tables)]:
                    conn.exec_driver_sql(f"DROP TABLE IF EXISTS {table.name}")
                conn.exec_driver_sql(f"DROP TABLE IF EXISTS {VERSION_TABLE}")
            write_release_0_1(db_url)
        engine = make_engine(db_url)
        with engine.connect() as conn:
            context = MigrationContext.configure(conn, opts={
                "compare_type": backend == "postgresql", "version_table": VERSION_TABLE})
            diffs = compare_metadata(context, Base.metadata)
        engine.dispose()
        assert diffs == [], (fresh, diffs)


def test_a_database_newer_than_the_code_is_refused_untouched(db_url):
    make_engine(db_url).dispose()
    plain = create_engine(db_url)
    with plain.begin() as conn:
        conn.execute(text(f"UPDATE {VERSION_TABLE} SET version_num = '0099_from_the_future'"))
        conn.execute(text("CREATE TABLE future_only (x INTEGER)"))
    with pytest.raises(SchemaTooNew, match="newer BatchScope.*0099_from_the_future|0099_from_the_future.*newer"):
        make_engine(db_url)
    with pytest.raises(RuntimeError, match="upgrade BatchScope"):
        storage_db.init_schema(plain)
    with plain.connect() as conn:
        assert conn.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalar() == "0099_from_the_future"
    plain.dispose()


def test_a_release_without_migrations_but_a_newer_version_is_refused(db_url):
    write_release_0_1(db_url, version=SCHEMA_VERSION + 5)
    with pytest.raises(SchemaTooNew, match=f"schema version {SCHEMA_VERSION + 5}"):
        make_engine(db_url)
    plain = create_engine(db_url)
    assert not inspect(plain).has_table(VERSION_TABLE)  # nothing was changed
    plain.dispose()


def test_instances_starting_together_on_a_fresh_database_all_succeed(db_url):
    """Several processes' worth of engines create the schema at the same moment: one
    creates it under the lock, the others wait and find it done."""
    n = 6
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []
    engines = []

    def start() -> None:
        barrier.wait(timeout=30)
        try:
            engines.append(make_engine(db_url))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=start) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(engines) == n
    with engines[0].connect() as conn:
        assert conn.execute(text(f"SELECT COUNT(*) FROM {VERSION_TABLE}")).scalar() == 1
        assert conn.execute(text("SELECT COUNT(*) FROM schema_meta")).scalar() == 1
    for engine in engines:
        engine.dispose()
