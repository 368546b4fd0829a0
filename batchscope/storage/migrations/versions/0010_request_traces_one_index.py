"""One time index on the traced requests (schema version 11).

Revision ID: 0010
Revises: 0009
Create Date: 2027-02-01

Drops ``ix_request_traces_model_end``. Every read of ``request_traces`` (the trace
export's window, the retention sweep) selects by ``request_end_at`` alone, which
``ix_request_traces_end`` serves; the index on ``(model, request_end_at)`` only cost
the writer: with it, writing a traced request's row took about half as long again
as without (``batchscope.storage.writer_process``, SQLite, measured in the changelog).
Nothing else changes; the rows stay as they are.
"""

from __future__ import annotations

from alembic import op

from batchscope.storage.migrations import set_schema_version

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None

SCHEMA_VERSION = 11


def upgrade() -> None:
    op.drop_index("ix_request_traces_model_end", table_name="request_traces")
    set_schema_version(SCHEMA_VERSION)


def downgrade() -> None:
    raise NotImplementedError("BatchScope's schema is not downgraded; restore a backup instead")
