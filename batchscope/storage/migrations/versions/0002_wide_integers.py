"""64-bit byte sizes, ids and growing counts; roll-ups indexed by time (schema version 3).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01

Version 2 declared them ``INTEGER``: 32-bit on PostgreSQL, where a device sample of a
GPU with more than 2 GiB in use was refused ("integer out of range"). PostgreSQL
rewrites each table once (all of its columns in one ``ALTER TABLE``) and widens the
sequences behind the ids; on a large table that takes a while and blocks writers to it
meanwhile. SQLite stores every integer in up to 8 bytes whatever the declared type, so
nothing changes there.

The index on ``rollups.interval_start`` lets the dashboard find where the raw rows
begin (the newest roll-up) with one index lookup on every refresh.
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from batchscope.storage.migrations import set_schema_version

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

SCHEMA_VERSION = 3

#: table -> the columns that become BIGINT ("id" is also a sequence on PostgreSQL)
WIDENED: dict[str, tuple[str, ...]] = {
    "runtime_instances": ("records_dropped",),
    "batches": ("id", "seq", "peak_memory_bytes"),
    "requests": ("id", "batch_seq"),
    "events": ("id",),
    "device_samples": ("id", "memory_used_bytes", "memory_total_bytes", "torch_allocated_bytes",
                       "torch_reserved_bytes", "process_rss_bytes"),
    "generation_steps": ("id",),
    "control_commands": ("id",),
    "command_acks": ("command_id",),
    "rollups": ("id", "requests", "requests_ok", "requests_failed", "batches", "batch_size_sum",
                "real_elements", "padded_elements"),
}


def upgrade() -> None:
    bind = op.get_bind()
    dialect = bind.dialect.name
    if dialect == "postgresql":
        for table, columns in WIDENED.items():
            alters = ", ".join(f"ALTER COLUMN {c} TYPE BIGINT" for c in columns)
            bind.exec_driver_sql(f"ALTER TABLE {table} {alters}")
            if "id" in columns:
                sequence = bind.execute(sa.text("SELECT pg_get_serial_sequence(:t, 'id')"),
                                        {"t": table}).scalar()
                if sequence:
                    bind.exec_driver_sql(f"ALTER SEQUENCE {sequence} AS BIGINT")
    elif dialect != "sqlite":
        for table, columns in WIDENED.items():
            for column in columns:
                op.alter_column(table, column, type_=sa.BigInteger(), existing_type=sa.Integer())
    op.create_index("ix_rollups_start", "rollups", ["interval_start"])
    set_schema_version(SCHEMA_VERSION)


def downgrade() -> None:
    raise NotImplementedError("BatchScope's schema is not downgraded; restore a backup instead")
