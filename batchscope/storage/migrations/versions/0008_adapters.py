"""LoRA adapters in the batch and request rows (schema version 9).

Revision ID: 0008
Revises: 0007
Create Date: 2027-01-15

Adds ``batches.adapters`` (how many distinct LoRA adapters a batch mixed; 0 for a batch
of base rows only) and ``requests.adapter`` (the adapter a request named). Nullable
without a default: rows already there, and rows of models served without adapters
(or requests for the base model), read NULL, and neither SQLite nor PostgreSQL
rewrites the table to add them. Nothing else changes.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import Column, Integer, String

from batchscope.storage.migrations import set_schema_version

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

SCHEMA_VERSION = 9


def upgrade() -> None:
    op.add_column("batches", Column("adapters", Integer, nullable=True))
    op.add_column("requests", Column("adapter", String(64), nullable=True))
    set_schema_version(SCHEMA_VERSION)


def downgrade() -> None:
    raise NotImplementedError("BatchScope's schema is not downgraded; restore a backup instead")
