"""Sequences that speculated and adapters mixed per generation step (schema version 10).

Revision ID: 0009
Revises: 0008
Create Date: 2027-01-22

Adds ``generation_steps.spec_sequences`` (how many sequences had proposed tokens
verified in the step; NULL where no speculation was set up, as ``spec_draft_tokens``)
and ``generation_steps.adapters`` (how many distinct LoRA adapters the step's sequences
named; 0 for a step of base sequences only, NULL for a model that takes no adapters).
Nullable without a default: rows already there read NULL, and neither SQLite nor
PostgreSQL rewrites the table to add them. Nothing else changes.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import Column, Integer

from batchscope.storage.migrations import set_schema_version

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

SCHEMA_VERSION = 10


def upgrade() -> None:
    op.add_column("generation_steps", Column("spec_sequences", Integer, nullable=True))
    op.add_column("generation_steps", Column("adapters", Integer, nullable=True))
    set_schema_version(SCHEMA_VERSION)


def downgrade() -> None:
    raise NotImplementedError("BatchScope's schema is not downgraded; restore a backup instead")
