"""A batch's own peak memory beside the device's absolute peak (schema version 7).

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-12

Adds ``batches.peak_memory_increase_bytes``: what a batch allocated at its peak above
what was allocated when it started (``peak_memory_bytes`` stays the device's absolute
peak, weights and KV cache included). Nullable without a default: rows already there
read NULL ("not recorded"), and neither SQLite nor PostgreSQL rewrites the table to add
it. Nothing else changes.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import BigInteger, Column

from batchscope.storage.migrations import set_schema_version

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

SCHEMA_VERSION = 7


def upgrade() -> None:
    op.add_column("batches", Column("peak_memory_increase_bytes", BigInteger, nullable=True))
    set_schema_version(SCHEMA_VERSION)


def downgrade() -> None:
    raise NotImplementedError("BatchScope's schema is not downgraded; restore a backup instead")
