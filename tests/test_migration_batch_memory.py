"""Revision 0005 -> 0006 (schema version 7): ``batches.peak_memory_increase_bytes``
appears, reads NULL for the rows already there, and takes the recorder's rows."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from batchscope.storage import db as storage_db
from batchscope.storage.db import make_engine, schema_revision, schema_version
from batchscope.storage.records import BatchRow
from batchscope.storage.recorder import Recorder
from batchscope.storage.schema import SCHEMA_VERSION, BatchRecord
from tests.factories import database_at

pytestmark = pytest.mark.both_backends

#: a batch as a release at revision 0005 (schema version 6) wrote it
REVISION_0005_BATCH = """
INSERT INTO batches (instance_id, model, seq, policy, settings_version, max_batch_size, bucket,
  batch_size, real_elements, padded_elements, queue_wait_min_s, queue_wait_mean_s,
  queue_wait_max_s, compute_s, started_at, ended_at, outcome, peak_memory_bytes, cuda_graph,
  queue_depth) VALUES ('rt-1', 'mlp', 1, 'dynamic', 1, 8, NULL, 4, 4, 4, 0.0, 0.001, 0.002,
  0.01, 10.0, 10.01, 'ok', 80000000000, FALSE, 3)
"""


def test_a_database_of_schema_version_6_upgrades_and_takes_the_increase(db_url):
    database_at(db_url, "0005", REVISION_0005_BATCH)
    engine = make_engine(db_url)
    try:
        assert schema_version(engine) == SCHEMA_VERSION >= 7
        assert schema_revision(engine) == storage_db._head()
        rec = Recorder(engine)
        rec.put(BatchRow("rt-1", "mlp", 2, "dynamic", 1, 8, None, 4, 4, 4, 0.0, 0.001, 0.002,
                         0.01, 11.0, 11.01, "ok", 80_000_000_000, True, 2,
                         peak_memory_increase_bytes=3_000_000_000))
        rec.put(BatchRow("rt-1", "mlp", 3, "dynamic", 1, 8, None, 4, 4, 4, 0.0, 0.001, 0.002,
                         0.01, 12.0, 12.01))
        assert rec.flush() == 2
        with engine.connect() as conn:
            rows = conn.execute(select(BatchRecord.seq, BatchRecord.peak_memory_bytes,
                                       BatchRecord.peak_memory_increase_bytes)
                                .order_by(BatchRecord.seq)).all()
        assert [tuple(r) for r in rows] == [(1, 80_000_000_000, None),
                                            (2, 80_000_000_000, 3_000_000_000), (3, None, None)]
    finally:
        engine.dispose()
