"""The tables of schema version 2 (BatchScope 0.1), created where missing.

Revision ID: 0001
Revises:
Create Date: 2026-12-01

Databases written before migrations existed have no revision table; they hold these
tables already, made by ``create_all`` (a database started at schema version 1 may lack
``command_acks``, ``rollups.outcomes_json`` and the ``ix_rollups_key`` index). So this
revision adds only what is missing, and brings an empty database, a version 1 and a
version 2 database alike to version 2. The definitions are frozen here as they were
then; later changes are later revisions.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy import Boolean, Column, Float, Integer, String, Text

from batchscope.storage.migrations import set_schema_version

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

SCHEMA_VERSION = 2


def _id() -> Column:
    return Column("id", Integer, primary_key=True, autoincrement=True)


def _s(name: str, length: int, nullable: bool = False) -> Column:
    return Column(name, String(length), nullable=nullable)


def _i(name: str, nullable: bool = False) -> Column:
    return Column(name, Integer, nullable=nullable)


def _f(name: str, nullable: bool = False) -> Column:
    return Column(name, Float, nullable=nullable)


def _t(name: str, nullable: bool = False) -> Column:
    return Column(name, Text, nullable=nullable)


def tables() -> dict[str, tuple[list[Column], list[tuple[str, list[str]]]]]:
    """table -> (its columns, its indexes as (name, columns)); new objects on every call,
    since a column belongs to the one table it is created in."""
    return {
        "schema_meta": ([Column("key", String(64), primary_key=True), _t("value")], []),
        "runtime_instances": ([
            Column("id", String(64), primary_key=True), _s("host", 255), _i("pid"), _t("models_json"),
            _s("url", 255, True), _s("device", 255, True), _s("version", 64, True), _f("started_at"),
            _f("last_seen_at"), _f("stopped_at", True), _i("records_dropped"),
        ], [("ix_runtime_instances_last_seen_at", ["last_seen_at"])]),
        "batches": ([
            _id(), _s("instance_id", 64), _s("model", 128), _i("seq"), _s("policy", 16),
            _i("settings_version"), _i("max_batch_size"), _i("bucket", True), _i("batch_size"),
            _i("real_elements"), _i("padded_elements"), _f("queue_wait_min_s"), _f("queue_wait_mean_s"),
            _f("queue_wait_max_s"), _f("compute_s"), _f("started_at"), _f("ended_at"), _s("outcome", 16),
            _i("peak_memory_bytes", True), Column("cuda_graph", Boolean, nullable=False),
            _i("queue_depth", True),
        ], [("ix_batches_model_ended", ["model", "ended_at"]),
            ("ix_batches_instance_ended", ["instance_id", "ended_at"])]),
        "requests": ([
            _id(), _s("instance_id", 64), _s("model", 128), _i("batch_seq", True), _i("priority"),
            Column("bypass", Boolean, nullable=False), _i("length", True), _f("arrived_at"),
            _f("finished_at"), _f("queue_wait_s"), _f("latency_s"), _s("outcome", 16), _f("ttft_s", True),
            _f("tpot_s", True), _i("prompt_tokens", True), _i("output_tokens", True),
        ], [("ix_requests_model_finished", ["model", "finished_at"]),
            ("ix_requests_instance_finished", ["instance_id", "finished_at"])]),
        "events": ([
            _id(), _s("instance_id", 64), _s("model", 128, True), _f("at"), _s("kind", 32),
            _s("severity", 16), _t("message"), _t("details_json"),
        ], [("ix_events_at", ["at"])]),
        "device_samples": ([
            _id(), _s("instance_id", 64), _f("at"), _s("device", 64), _s("kind", 8),
            _f("utilization_pct", True), _i("memory_used_bytes", True), _i("memory_total_bytes", True),
            _f("power_w", True), _f("sm_clock_mhz", True), _f("temperature_c", True),
            _i("torch_allocated_bytes", True), _i("torch_reserved_bytes", True),
            _i("process_rss_bytes", True),
        ], [("ix_device_samples_at", ["at"])]),
        "generation_steps": ([
            _id(), _s("instance_id", 64), _s("model", 128), _f("at"), _s("mode", 16), _i("running"),
            _i("waiting"), _i("prefill_tokens"), _i("decode_tokens"), _i("blocks_used"),
            _i("blocks_free"), _i("preemptions"), _f("step_s"),
        ], [("ix_gensteps_model_at", ["model", "at"])]),
        "model_settings": ([
            Column("instance_id", String(64), primary_key=True),
            Column("model", String(128), primary_key=True), _i("version"), _t("settings_json"),
            _s("kind", 16), _f("updated_at"),
        ], []),
        "control_commands": ([
            _id(), _s("instance_id", 64, True), _s("model", 128), _t("changes_json"),
            _s("requested_by", 128), _f("requested_at"), _s("status", 16), _t("reason", True),
            _i("applied_version", True), _f("handled_at", True),
        ], [("ix_control_commands_status", ["status"])]),
        "command_acks": ([
            Column("command_id", Integer, primary_key=True, autoincrement=False),
            Column("instance_id", String(64), primary_key=True), _s("status", 16), _t("reason", True),
            _i("applied_version", True), _f("handled_at"),
        ], []),
        "rollups": ([
            _id(), _s("instance_id", 64), _s("model", 128), _f("interval_start"), _f("interval_s"),
            _i("requests"), _i("requests_ok"), _i("requests_failed"), _i("batches"),
            _i("batch_size_sum"), _i("real_elements"), _i("padded_elements"), _f("queue_wait_sum_s"),
            _f("compute_sum_s"), _f("latency_sum_s"), _t("latency_hist_json"),
            _t("batch_size_hist_json"), _t("outcomes_json"),
        ], [("ix_rollups_model_start", ["model", "interval_start"]),
            ("ix_rollups_key", ["instance_id", "model", "interval_s", "interval_start"])]),
    }


def upgrade() -> None:
    inspector = sa.inspect(op.get_bind())
    existing = set(inspector.get_table_names())
    for name, (columns, indexes) in tables().items():
        if name not in existing:
            op.create_table(name, *columns)
            present_columns: set[str] = {c.name for c in columns}
            present_indexes: set[str] = set()
        else:
            present_columns = {c["name"] for c in inspector.get_columns(name)}
            present_indexes = {i["name"] for i in inspector.get_indexes(name)}
        for column in columns:
            if column.name not in present_columns:  # version 1: rollups.outcomes_json
                op.add_column(name, Column(column.name, column.type, nullable=True))
        for index, cols in indexes:
            if index not in present_indexes:
                op.create_index(index, name, cols)
    set_schema_version(SCHEMA_VERSION)


def downgrade() -> None:
    raise NotImplementedError("BatchScope's schema is not downgraded; restore a backup instead")
