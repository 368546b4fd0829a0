"""Summaries kept up to date as rows arrive, for the live dashboard (schema version 4).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01

Adds ``summary_stats``, ``summary_latency`` and ``summary_shapes`` (see
``batchscope.storage.summaries``), empty. ``batchscope.storage.db.init_schema`` fills
them from the raw rows already there once the upgrade that created them has run
(``summaries.SINCE_REVISION``), with the code that maintains them, so a dashboard over an
upgraded database shows its history at once.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy import BigInteger, Column, Float, Integer, String

from batchscope.storage.migrations import set_schema_version

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

SCHEMA_VERSION = 4


def _key(*more: Column) -> list[Column]:
    return [Column("span_s", Integer, primary_key=True), Column("start_s", BigInteger, primary_key=True),
            Column("model", String(128), primary_key=True),
            Column("instance_id", String(64), primary_key=True), *more]


def _count(name: str) -> Column:
    return Column(name, BigInteger, nullable=False, server_default=sa.text("0"))


def _sum(name: str) -> Column:
    return Column(name, Float, nullable=False, server_default=sa.text("0"))


def upgrade() -> None:
    op.create_table(
        "summary_stats",
        *_key(_count("requests"), _count("ok"), _count("rejected"), _count("expired"), _count("failed"),
              _sum("ok_latency_sum_s"), _sum("ok_queue_wait_sum_s"), _count("batches"),
              _count("batch_items"), _sum("batch_compute_sum_s"), _sum("batch_queue_wait_sum_s"),
              _count("queue_depth_sum"), _count("queue_depth_count"), Column("queue_depth_max", Integer),
              Column("max_batch_size_max", Integer), _count("oom_batches"), _count("real_elements"),
              _count("padded_elements")),
        sqlite_with_rowid=False)
    op.create_table(
        "summary_latency",
        *_key(Column("priority", Integer, primary_key=True), Column("outcome", String(16), primary_key=True),
              Column("bucket", Integer, primary_key=True), _count("n"), _sum("latency_sum_s"),
              _sum("queue_wait_sum_s")),
        sqlite_with_rowid=False)
    op.create_table(
        "summary_shapes",
        *_key(Column("batch_size", Integer, primary_key=True), Column("bucket", Integer, primary_key=True),
              Column("outcome", String(16), primary_key=True), _count("n"), _sum("compute_sum_s"),
              _count("real_elements"), _count("padded_elements"), Column("max_batch_size_max", Integer)),
        sqlite_with_rowid=False)
    set_schema_version(SCHEMA_VERSION)


def downgrade() -> None:
    raise NotImplementedError("BatchScope's schema is not downgraded; restore a backup instead")
