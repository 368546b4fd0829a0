"""Batches and generation steps found by their number (schema version 13).

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-06

Adds ``ix_batches_seq`` on ``batches (seq, model, ended_at)`` and ``ix_gensteps_seq`` on
``generation_steps (seq, model, at)``. The timeline page finds a batch or step by the
number a user types (``find_batch``, ``find_step``: ``WHERE seq = ? [AND model = ?]
ORDER BY ended_at DESC LIMIT 1``); without these indexes that read walked every row of
the model (about 0.15 s per lookup at a million batches on SQLite), with them it reads
one. The column order lets SQLite's planner, which has no statistics, prefer them to the
``(model, ended_at)`` index. They cost the writer about 0.5 us a batch row (one row per
batch, not per request). Nothing else changes; the rows stay as they are.
"""

from __future__ import annotations

from alembic import op

from batchscope.storage.migrations import set_schema_version

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

SCHEMA_VERSION = 13


def upgrade() -> None:
    op.create_index("ix_batches_seq", "batches", ["seq", "model", "ended_at"])
    op.create_index("ix_gensteps_seq", "generation_steps", ["seq", "model", "at"])
    set_schema_version(SCHEMA_VERSION)


def downgrade() -> None:
    raise NotImplementedError("BatchScope's schema is not downgraded; restore a backup instead")
