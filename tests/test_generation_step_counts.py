"""Revision 0008 -> 0009 (schema version 10): each generation step records how many
sequences had proposed tokens verified (``spec_sequences``) and how many distinct LoRA
adapters its sequences named (``adapters``). The columns read NULL for the rows already
there and take the recorder's rows on SQLite and PostgreSQL; the runner fills them
exactly; the tokens per verification are computed from them, estimated as before for
rows without them."""

from __future__ import annotations

import math

import pytest
import torch
from sqlalchemy import select

from batchscope.analysis import diagnosis, queries
from batchscope.analysis.queries.raw import generation_speculation, generation_timeline
from batchscope.storage import db as storage_db
from batchscope.storage.db import make_engine, schema_revision, schema_version
from batchscope.storage.records import GenStepRow, ListRecorder
from batchscope.storage.recorder import Recorder
from batchscope.storage.schema import SCHEMA_VERSION, GenerationStep
from runtime.adapters.lora import random_pairs, write_peft
from runtime.generation.config import GenerationConfig
from runtime.generation.runner import StepRunner
from runtime.models.decoder import TinyDecoder
from tests.factories import database_at

pytestmark = pytest.mark.timeout(300)

#: a step as a release at revision 0008 (schema version 9) wrote it
REVISION_0008_STEP = """
INSERT INTO generation_steps (instance_id, model, at, mode, running, waiting, prefill_tokens,
  decode_tokens, blocks_used, blocks_free, preemptions, step_s, spec_draft_tokens,
  spec_accepted_tokens)
  VALUES ('rt-1', 'decoder', 10.0, 'continuous', 4, 0, 0, 12, 4, 60, 0, 0.01, 8, 4)
"""

COLUMNS = (GenerationStep.at, GenerationStep.decode_tokens, GenerationStep.spec_draft_tokens,
           GenerationStep.spec_accepted_tokens, GenerationStep.spec_sequences,
           GenerationStep.adapters)


def step_row(at: float, *, decodes: int = 4, drafted: int | None = None,
             accepted: int | None = None, sequences: int | None = None,
             adapters: int | None = None, step_s: float = 0.01,
             model: str = "decoder") -> GenStepRow:
    """A step of ``decodes`` decoding sequences, ``drafted`` proposed tokens verified for
    ``sequences`` of them (None: not recorded) and ``accepted`` accepted."""
    return GenStepRow("rt-1", model, at, "continuous", decodes, 0, 0, decodes + (drafted or 0),
                      4, 60, 0, step_s, drafted, accepted, sequences, adapters)


# -- storage -------------------------------------------------------------------------------
@pytest.mark.both_backends
def test_a_database_of_schema_version_9_upgrades_and_keeps_its_steps(db_url):
    database_at(db_url, "0008", REVISION_0008_STEP)
    engine = make_engine(db_url)
    try:
        assert schema_version(engine) == SCHEMA_VERSION >= 10
        assert schema_revision(engine) == storage_db._head() >= "0009"
        rec = Recorder(engine)
        rec.put(step_row(11.0, drafted=6, accepted=3, sequences=2, adapters=3))
        rec.put(step_row(12.0, adapters=0))
        rec.put(step_row(13.0))
        assert rec.flush() == 3
        with engine.connect() as conn:
            rows = conn.execute(select(*COLUMNS).order_by(GenerationStep.at)).all()
        assert [tuple(r) for r in rows] == [(10.0, 12, 8, 4, None, None), (11.0, 10, 6, 3, 2, 3),
                                            (12.0, 4, None, None, None, 0),
                                            (13.0, 4, None, None, None, None)]
    finally:
        engine.dispose()


@pytest.mark.both_backends
def test_a_step_row_round_trips_with_the_new_fields(db):
    """Through the recorder, each flush with and without the new fields set (the SQLite
    path leaves out a column that is NULL in every row of a flush)."""
    rec = Recorder(db)
    rec.put(step_row(20.0, drafted=8, accepted=5, sequences=3, adapters=2))
    assert rec.flush() == 1
    rec.put(step_row(21.0))
    rec.put(step_row(22.0, drafted=0, accepted=0, sequences=0, adapters=0))
    assert rec.flush() == 2
    with db.connect() as conn:
        rows = conn.execute(select(*COLUMNS).order_by(GenerationStep.at)).all()
    assert [tuple(r) for r in rows] == [(20.0, 12, 8, 5, 3, 2), (21.0, 4, None, None, None, None),
                                        (22.0, 4, 0, 0, 0, 0)]


def test_positional_rows_written_before_the_new_fields_still_build():
    row = GenStepRow("rt", "decoder", 1.0, "continuous", 2, 0, 0, 10, 4, 60, 0, 0.01, 8, 5)
    assert (row.spec_draft_tokens, row.spec_accepted_tokens) == (8, 5)
    assert row.spec_sequences is None and row.adapters is None


# -- the runner -----------------------------------------------------------------------------
def _runner(model, recorder, **cfg) -> StepRunner:
    base = dict(block_size=8, num_cache_blocks=160, max_model_len=256, max_num_seqs=64,
                max_num_batched_tokens=1024, spec_auto_switch=False)
    base.update(cfg)
    runner = StepRunner(model, GenerationConfig(**base), recorder=recorder)
    return runner


def _prompts() -> list[list[int]]:
    """Repetitive prompts (prompt lookup finds matches) and random ones (it mostly does not)."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for i in range(12):
        if i % 2 == 0:
            phrase = torch.randint(0, 256, (3 + i % 4,), generator=gen).tolist()
            out.append((phrase * 10)[:24 + i])
        else:
            out.append(torch.randint(0, 256, (20 + i,), generator=gen).tolist())
    return out


def test_the_runner_records_the_sequences_that_speculated_exactly():
    rec = ListRecorder()
    model = TinyDecoder(n_layers=2, max_model_len=256)
    model.adapter_targets = {}  # a model without adapters
    runner = _runner(model, rec, speculative_method="ngram", num_speculative_tokens=3)
    runner.setup("cpu")
    for prompt in _prompts():
        runner.new_sequence(prompt, max_new_tokens=24, ignore_eos=True)
    while runner.has_work():
        runner.step()
    steps = rec.of(GenStepRow)
    spec = runner.stats()["speculation"]
    # each verification that carried proposals is one sequence of one step
    assert sum(s.spec_sequences for s in steps) == spec["num_drafts"] > 0
    assert sum(s.spec_draft_tokens for s in steps) == spec["num_draft_tokens"]
    for s in steps:
        decodes = s.decode_tokens - s.spec_draft_tokens
        assert (s.spec_sequences > 0) == (s.spec_draft_tokens > 0)
        assert s.spec_sequences <= min(decodes, s.spec_draft_tokens)
        assert s.adapters is None
    # prompt lookup found nothing for some sequences of a speculating step: the estimate
    # (every decoding sequence) would count them
    assert any(0 < s.spec_sequences < s.decode_tokens - s.spec_draft_tokens for s in steps)
    # so the step rows give the metrics' tokens per verification
    from_rows = 1.0 + sum(s.spec_accepted_tokens for s in steps) / sum(s.spec_sequences
                                                                      for s in steps)
    assert from_rows == pytest.approx(spec["mean_acceptance_length"])


def test_a_runner_without_a_proposer_records_no_speculation_counts():
    rec = ListRecorder()
    model = TinyDecoder(n_layers=1, max_model_len=64)
    runner = _runner(model, rec, max_model_len=64)
    runner.setup("cpu")
    runner.new_sequence([1, 2, 3], max_new_tokens=3, ignore_eos=True)
    while runner.has_work():
        runner.step()
    steps = rec.of(GenStepRow)
    assert steps and all(s.spec_sequences is None and s.spec_draft_tokens is None for s in steps)
    # the decoder takes adapters: a step of base sequences only mixed none
    assert all(s.adapters == 0 for s in steps)


def test_the_runner_records_the_distinct_adapters_of_each_step(tmp_path):
    model = TinyDecoder(d_model=64, n_layers=2, seed=3)
    targets = model.adapter_targets
    config = dict(block_size=4, num_cache_blocks=256, max_model_len=128, max_num_seqs=8,
                  max_num_batched_tokens=40, long_prefill_token_threshold=8)
    rec = ListRecorder()
    runner = _runner(model, rec, **config)
    for i, name in enumerate(("a", "b", "c")):
        path = str(tmp_path / name)
        write_peft(path, random_pairs(targets, 4, seed=20 + i, std=0.05), base_model="decoder")
        runner.adapters.add(runner.adapters.read(name, path), runner.config.adapter_memory_mb, 0.0)
    runner.setup("cpu")
    gen = torch.Generator().manual_seed(5)
    requests = [(None, 23), ("a", 17), ("b", 9), ("c", 30), ("a", 5), (None, 12), ("b", 26)]
    adapter_of = {}
    for name, n in requests:
        seq = runner.new_sequence(torch.randint(0, 256, (n,), generator=gen).tolist(),
                                  max_new_tokens=6 if name else 20, ignore_eos=True,
                                  adapter=name)
        adapter_of[seq.seq_id] = name
    expected = []
    while runner.has_work():
        out, _ = runner.step()
        if not out.is_empty:
            expected.append(len({adapter_of[c.seq_id] for c in out.chunks
                                 if adapter_of[c.seq_id] is not None and not c.is_padding}))
    got = [s.adapters for s in rec.of(GenStepRow)]
    assert got == expected
    assert max(got) == 3 and got[-1] == 0  # the base sequences outlive the others


# -- the queries ----------------------------------------------------------------------------
@pytest.mark.both_backends
def test_tokens_per_verification_from_the_column_and_estimated_without_it(db):
    rec = Recorder(db)
    rec.put_many([
        # recorded: 2 of 4 decoding sequences had 6 tokens verified, 3 accepted
        step_row(100.0, decodes=4, drafted=6, accepted=3, sequences=2),
        # a step that did not speculate, with a proposer
        step_row(100.5, decodes=4, drafted=0, accepted=0, sequences=0),
        # no proposer set up
        step_row(101.0, decodes=4),
    ])
    assert rec.flush() == 3
    w = queries.Window(99.0, 130.0, "decoder")
    t = generation_timeline(db, w, bucket_s=60.0)
    assert len(t) == 1
    row = t.iloc[0]
    assert row["spec_sequences"] == 2 and row["spec_accepted_tokens"] == 3
    assert row["acceptance_length"] == pytest.approx(1.0 + 3 / 2)
    # a row recorded before the column: all 5 decoding sequences of the speculating step
    rec.put(step_row(102.0, decodes=5, drafted=10, accepted=4))
    assert rec.flush() == 1
    row = generation_timeline(db, w, bucket_s=60.0).iloc[0]
    assert row["spec_sequences"] == 2 + 5
    assert row["acceptance_length"] == pytest.approx(1.0 + (3 + 4) / (2 + 5))
    spec = generation_speculation(db, w)
    on = spec[spec["speculated"] == 1]
    assert int(on["spec_sequences"].sum()) == 7 and int(on["sequences"].sum()) == 9
    off = spec[spec["speculated"] == 0]
    assert int(off["spec_sequences"].sum()) == 0


END = 2_000_000_000.0


@pytest.mark.both_backends
@pytest.mark.parametrize("recorded", [True, False])
def test_the_speculation_rule_counts_the_sequences_that_speculated(db, recorded):
    """Half of 4 decoding sequences get 4 proposed tokens each, 1 of 8 accepted: exactly
    1.5 tokens per verification and 4 proposed per sequence; rows without the column
    estimate every decoding sequence (1.25 and 2)."""
    rec = Recorder(db)
    rec.put_many([step_row(END - 120 + i * 0.2, decodes=4, drafted=8, accepted=1,
                           sequences=2 if recorded else None, step_s=0.012)
                  for i in range(600)])
    rec.flush()
    bundle = queries.live_bundle(db, queries.Window(END - 120, END + 1, "decoder"))
    flag = diagnosis.rule_speculation_not_paying(bundle, diagnosis.Thresholds())
    assert flag is not None
    ev = flag.evidence
    assert ev["acceptance_rate"] == 0.125
    if recorded:
        assert ev["tokens_per_verification"] == 1.5 and ev["proposed_per_sequence"] == 4.0
    else:
        assert ev["tokens_per_verification"] == 1.25 and ev["proposed_per_sequence"] == 2.0
    assert not math.isnan(bundle["generation_t"]["acceptance_length"].iloc[-1])
