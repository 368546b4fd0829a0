"""Tuning sessions and their trials; what replay and resource recommendations lacked
(schema version 5).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-08

Adds ``tuning_sessions`` and ``tuning_trials`` (``batchscope.tuning.store``), empty;
``requests.input_shape_json`` and ``requests.timeout_ms`` (what a replay sends besides
the length); ``runtime_instances.cpu_count`` (the host's CPUs, for CPU
recommendations in cores). The new columns are nullable without a default: rows
already there read NULL ("not recorded"), and neither SQLite nor PostgreSQL rewrites
the table to add them.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import BigInteger, Boolean, Column, Float, Integer, String, Text

from batchscope.storage.migrations import set_schema_version

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

SCHEMA_VERSION = 5

#: an autoincrementing id: BIGINT on PostgreSQL, SQLite's INTEGER rowid
ID = BigInteger().with_variant(Integer(), "sqlite")


def upgrade() -> None:
    op.add_column("runtime_instances", Column("cpu_count", Integer, nullable=True))
    op.add_column("requests", Column("input_shape_json", Text, nullable=True))
    op.add_column("requests", Column("timeout_ms", Float, nullable=True))
    op.create_table(
        "tuning_sessions",
        Column("id", ID, primary_key=True, autoincrement=True),
        Column("instance_id", String(64)),
        Column("url", String(255), nullable=False),
        Column("model", String(128), nullable=False),
        Column("started_at", Float, nullable=False),
        Column("finished_at", Float),
        Column("state", String(16), nullable=False),
        Column("objective", String(16), nullable=False),
        Column("slo_p99_ms", Float, nullable=False),
        Column("target_rps", Float),
        Column("budget_s", Float, nullable=False),
        Column("load_kind", String(16), nullable=False),
        Column("load_description", Text),
        Column("start_settings_json", Text, nullable=False),
        Column("best_settings_json", Text),
        Column("best_trial", Integer),
        Column("sentence", Text),
        Column("stop_reason", Text),
        Column("outcome", Text),
        Column("hardware", String(255)),
        Column("device_kind", String(8)),
        Column("device_memory_bytes", BigInteger),
        Column("requested_by", String(32), nullable=False))
    op.create_index("ix_tuning_sessions_model_started", "tuning_sessions", ["model", "started_at"])
    op.create_index("ix_tuning_sessions_started", "tuning_sessions", ["started_at"])
    op.create_table(
        "tuning_trials",
        Column("session_id", BigInteger, primary_key=True, autoincrement=False),
        Column("number", Integer, primary_key=True, autoincrement=False),
        Column("settings_json", Text, nullable=False),
        Column("changed_json", Text, nullable=False),
        Column("status", String(16), nullable=False),
        Column("feasible", Boolean, nullable=False),
        Column("throughput_rps", Float),
        Column("goodput_rps", Float),
        Column("p50_ms", Float),
        Column("p99_ms", Float),
        Column("reason", Text),
        Column("windows", Integer, nullable=False),
        Column("started_at", Float, nullable=False),
        Column("finished_at", Float))
    set_schema_version(SCHEMA_VERSION)


def downgrade() -> None:
    raise NotImplementedError("BatchScope's schema is not downgraded; restore a backup instead")

