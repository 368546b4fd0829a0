"""Traced requests: Triton's trace timestamps of sampled requests (schema version 6).

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-10

Adds ``request_traces`` (``runtime.core.tracing``, written by the engine's tracer
through the recorder), empty. Nothing else changes.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import BigInteger, Column, Float, Integer, String

from batchscope.storage.migrations import set_schema_version

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

SCHEMA_VERSION = 6

#: an autoincrementing id: BIGINT on PostgreSQL, SQLite's INTEGER rowid
ID = BigInteger().with_variant(Integer(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "request_traces",
        Column("id", ID, primary_key=True, autoincrement=True),
        Column("instance_id", String(64), nullable=False),
        Column("model", String(128), nullable=False),
        Column("trace_id", BigInteger, nullable=False),
        Column("protocol", String(8), nullable=False),
        Column("outcome", String(16), nullable=False),
        Column("request_id", String(256)),
        Column("batch_seq", BigInteger),
        Column("recv_start_at", Float),
        Column("recv_end_at", Float),
        Column("request_start_at", Float, nullable=False),
        Column("queue_start_at", Float),
        Column("compute_start_at", Float),
        Column("compute_input_end_at", Float),
        Column("compute_output_start_at", Float),
        Column("compute_end_at", Float),
        Column("request_end_at", Float, nullable=False),
        Column("send_start_at", Float),
        Column("send_end_at", Float),
        Column("w3c_trace_id", String(32)),
        Column("w3c_parent_span_id", String(16)))
    op.create_index("ix_request_traces_model_end", "request_traces", ["model", "request_end_at"])
    op.create_index("ix_request_traces_end", "request_traces", ["request_end_at"])
    set_schema_version(SCHEMA_VERSION)


def downgrade() -> None:
    raise NotImplementedError("BatchScope's schema is not downgraded; restore a backup instead")
