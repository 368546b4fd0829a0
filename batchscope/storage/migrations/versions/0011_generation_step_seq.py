"""A generation step's number (schema version 12).

Revision ID: 0011
Revises: 0010
Create Date: 2027-02-10

Adds ``generation_steps.seq``: the step's number in its model's engine (1, 2, ...). A
generation request's ``batch_seq`` (in ``requests`` and ``request_traces``) is the number
of the step it was first scheduled in, the batch it joined, as a request model's is its
batch's ``seq``; the trace export draws its flow to that step. Nullable without a
default: rows already there read NULL, and neither SQLite nor PostgreSQL rewrites the
table to add it. Nothing else changes.
"""

from __future__ import annotations

from alembic import op
from sqlalchemy import BigInteger, Column

from batchscope.storage.migrations import set_schema_version

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

SCHEMA_VERSION = 12


def upgrade() -> None:
    op.add_column("generation_steps", Column("seq", BigInteger, nullable=True))
    set_schema_version(SCHEMA_VERSION)


def downgrade() -> None:
    raise NotImplementedError("BatchScope's schema is not downgraded; restore a backup instead")
