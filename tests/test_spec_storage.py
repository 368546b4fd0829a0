"""Revision 0006 -> 0007 (schema version 8): the generation steps' speculative-decoding
columns appear, read NULL for the rows already there and take the recorder's rows; and
the speculation series on /metrics."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from batchscope.storage import db as storage_db
from batchscope.storage.db import make_engine, schema_revision, schema_version
from batchscope.storage.records import GenStepRow, RequestRow
from batchscope.storage.recorder import Recorder
from batchscope.storage.schema import SCHEMA_VERSION, GenerationStep
from runtime.server.metrics import MetricsRecorder
from tests.factories import database_at

#: a step as a release at revision 0006 (schema version 7) wrote it
REVISION_0006_STEP = """
INSERT INTO generation_steps (instance_id, model, at, mode, running, waiting, prefill_tokens,
  decode_tokens, blocks_used, blocks_free, preemptions, step_s)
  VALUES ('rt-1', 'decoder', 10.0, 'continuous', 2, 0, 0, 2, 4, 60, 0, 0.01)
"""


@pytest.mark.both_backends
def test_a_database_of_schema_version_7_upgrades_and_takes_the_speculation_columns(db_url):
    database_at(db_url, "0006", REVISION_0006_STEP)
    engine = make_engine(db_url)
    try:
        assert schema_version(engine) == SCHEMA_VERSION >= 8
        assert schema_revision(engine) == storage_db._head() >= "0007"
        rec = Recorder(engine)
        rec.put(GenStepRow("rt-1", "decoder", 11.0, "continuous", 2, 0, 0, 10, 4, 60, 0, 0.01,
                           spec_draft_tokens=8, spec_accepted_tokens=5))
        rec.put(GenStepRow("rt-1", "decoder", 12.0, "continuous", 2, 0, 0, 2, 4, 60, 0, 0.01))
        assert rec.flush() == 2
        with engine.connect() as conn:
            rows = conn.execute(select(GenerationStep.at, GenerationStep.decode_tokens,
                                       GenerationStep.spec_draft_tokens,
                                       GenerationStep.spec_accepted_tokens)
                                .order_by(GenerationStep.at)).all()
        assert [tuple(r) for r in rows] == [(10.0, 2, None, None), (11.0, 10, 8, 5),
                                            (12.0, 2, None, None)]
    finally:
        engine.dispose()


def test_speculation_and_step_series_have_vllms_names():
    stats = {"decoder": {"num_cache_blocks": 64, "speculation": {
        "num_drafts": 3, "num_draft_tokens": 12, "num_accepted_tokens": 7,
        "accepted_per_pos": [3, 2, 2], "requests_without_proposer": 1}}}
    metrics = MetricsRecorder(stats=lambda: stats)
    metrics.put(GenStepRow("rt", "decoder", 1.0, "continuous", 2, 0, 30, 10, 4, 60, 0, 0.01,
                           spec_draft_tokens=8, spec_accepted_tokens=5))
    metrics.put(RequestRow("rt", "decoder", None, 0, 0.0, 1.0, 0.25, 1.0, "ok", ttft_s=0.5,
                           tpot_s=0.05, prompt_tokens=5, output_tokens=11))
    text = metrics.render().decode()
    for line in ('batchscope_spec_decode_num_drafts_total{model_name="decoder"} 3.0',
                 'batchscope_spec_decode_num_draft_tokens_total{model_name="decoder"} 12.0',
                 'batchscope_spec_decode_num_accepted_tokens_total{model_name="decoder"} 7.0',
                 'batchscope_spec_decode_num_accepted_tokens_per_pos_total{model_name="decoder",'
                 'position="2"} 2.0',
                 'batchscope_spec_decode_requests_without_proposer_total{model_name="decoder"} 1.0',
                 'batchscope_iteration_tokens_total_sum{model_name="decoder"} 40.0',
                 'batchscope_request_prefill_time_seconds_sum{model_name="decoder"} 0.25',
                 'batchscope_request_decode_time_seconds_sum{model_name="decoder"} 0.5',
                 'batchscope_inter_token_latency_seconds_count{model_name="decoder"} 10.0'):
        assert line in text, line
