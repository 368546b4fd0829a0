"""Speculative decoding in the generation steps (schema version 8).

Revision ID: 0007
Revises: 0006
Create Date: 2027-01-08

Adds ``generation_steps.spec_draft_tokens`` and ``generation_steps.spec_accepted_tokens``:
how many proposed tokens a step verified (they are also counted in ``decode_tokens``,
as the model computed them) and how many of them it accepted. Nullable without a
default: rows already there, and steps of a model served without speculation, read
NULL, and neither SQLite nor PostgreSQL rewrites the table to add them. Nothing else
changes.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import Column, Integer

from batchscope.storage.migrations import set_schema_version

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

SCHEMA_VERSION = 8


def upgrade() -> None:
    op.add_column("generation_steps", Column("spec_draft_tokens", Integer, nullable=True))
    op.add_column("generation_steps", Column("spec_accepted_tokens", Integer, nullable=True))
    set_schema_version(SCHEMA_VERSION)


def downgrade() -> None:
    raise NotImplementedError("BatchScope's schema is not downgraded; restore a backup instead")
