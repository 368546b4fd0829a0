"""The schema's migrations (Alembic), run by ``batchscope.storage.db.init_schema``.

``env.py`` is Alembic's entry point; ``versions/`` holds one revision per schema version:

* ``0001_schema_v2``: the tables of BatchScope 0.1 (schema version 2), created where
  missing, so that a database of that release (which had no migrations, only
  ``schema_meta``) and an empty one both start from here;
* ``0002_wide_integers``: byte sizes, ids and growing counts become 64-bit, roll-ups
  are indexed by time (schema version 3);
* ``0003_live_summaries``: the summaries the live dashboard reads
  (``batchscope.storage.summaries``; schema version 4), filled from the raw rows there;
* ``0004_tuning_sessions``: tuning sessions and their trials, the requests' input shapes
  and timeouts, the hosts' CPU count (schema version 5).
* ``0005_request_traces``: the traced requests' timestamps (Triton's trace extension;
  schema version 6).
* ``0006_batch_memory_increase``: a batch's own peak memory increase beside the
  device's absolute peak (schema version 7).
* ``0007_generation_step_speculation``: the proposed and accepted tokens of each
  generation step (speculative decoding; schema version 8).
* ``0008_adapters``: the distinct LoRA adapters of each batch and the adapter of each
  request (schema version 9).
* ``0009_generation_step_counts``: the sequences that speculated and the distinct LoRA
  adapters of each generation step (schema version 10).
* ``0010_request_traces_one_index``: the traced requests keep only their time index
  (schema version 11).
* ``0011_generation_step_seq``: a generation step's number (schema version 12).
* ``0012_numbers_indexed``: batches and generation steps are indexed by their number
  (schema version 13).

A new revision: a file here with the next number, ``down_revision`` the last one, its
``upgrade`` written against the tables as the previous revisions left them (never
against ``schema.py``, which moves on), ending with ``set_schema_version``; then the
same change in ``schema.py`` and its ``SCHEMA_VERSION``. ``tests/test_migrations.py``
checks that both agree.

Each revision also writes its schema version into ``schema_meta``, which releases before
migrations read to refuse a database newer than themselves.
"""

from pathlib import Path

#: the folder Alembic reads (``script_location``)
SCRIPT_LOCATION = str(Path(__file__).resolve().parent)
#: Alembic's table of the applied revision; named for BatchScope so that a PostgreSQL
#: database shared with another application's Alembic history keeps both apart
VERSION_TABLE = "batchscope_alembic_version"


def set_schema_version(version: int) -> None:
    """Within a revision: write ``version`` into ``schema_meta`` (the row that releases
    before migrations read, so that they refuse a database newer than themselves)."""
    import sqlalchemy as sa
    from alembic import op

    meta = sa.table("schema_meta", sa.column("key", sa.String), sa.column("value", sa.Text))
    bind = op.get_bind()
    bind.execute(sa.delete(meta).where(meta.c.key == "schema_version"))
    bind.execute(sa.insert(meta).values(key="schema_version", value=str(version)))
