"""The paged decoder and the synchronous step runner with its records."""

from __future__ import annotations

import json

import pytest
import torch

from batchscope.storage.records import EventRow, GenStepRow, ListRecorder, RequestRow
from runtime.core.clock import FakeClock
from runtime.api.errors import ConfigError, QueueFull, ValidationError
from runtime.generation.config import GenerationConfig
from runtime.generation.model import ByteTokenizer
from runtime.generation.runner import StepRunner
from runtime.generation.scheduler import ScheduledChunk
from runtime.generation.toys import SteppedModel
from runtime.models.decoder import TinyDecoder


@pytest.fixture(scope="module")
def decoder() -> TinyDecoder:
    model = TinyDecoder(n_layers=2, max_model_len=256)
    model.setup("cpu", 64, 8)
    return model


def greedy_reference(model: TinyDecoder, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model.forward_full(ids)[-1].argmax()))
    return ids[len(prompt):]


def runner_for(model, clock=None, recorder=None, **cfg) -> StepRunner:
    base = dict(block_size=8, num_cache_blocks=64, max_model_len=256)
    base.update(cfg)
    runner = StepRunner(model, GenerationConfig(**base), recorder=recorder, clock=clock)
    runner.setup("cpu")
    return runner


def drain(runner: StepRunner, clock: FakeClock | None = None, limit: int = 2000) -> int:
    steps = 0
    while runner.has_work() and steps < limit:
        runner.step()
        if clock is not None:
            clock.advance(0.01)
        steps += 1
    assert not runner.has_work(), "requests still pending after the step limit"
    return steps


# -- the model ---------------------------------------------------------------------------
def test_paged_step_matches_full_recompute_for_mixed_chunks(decoder):
    a = list(range(30, 61))  # 31 tokens
    b = list(range(200, 206))
    ref_a, ref_b = decoder.forward_full(a), decoder.forward_full(b)
    ta, tb = [3, 9, 4, 7], [12]
    first = decoder.step([ScheduledChunk(1, a[:13], 0, ta, False, False),
                          ScheduledChunk(2, b[:5], 0, tb, False, False)])
    # a mixed step: one decode token and the rest of a long prompt (chunked prefill)
    second = decoder.step([ScheduledChunk(1, a[13:], 13, ta, True, False),
                           ScheduledChunk(2, b[5:], 5, tb, True, True)])
    torch.testing.assert_close(first[0], ref_a[12], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(first[1], ref_b[4], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second[0], ref_a[30], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second[1], ref_b[5], atol=1e-4, rtol=1e-4)


def test_weights_are_generated_from_the_seed():
    a, b, c = TinyDecoder(n_layers=1, seed=1), TinyDecoder(n_layers=1, seed=1), TinyDecoder(n_layers=1, seed=2)
    ids = [1, 2, 3]
    assert torch.equal(a.forward_full(ids), b.forward_full(ids))
    assert not torch.equal(a.forward_full(ids), c.forward_full(ids))


def test_byte_tokenizer_round_trips_and_holds_back_split_characters():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert tok.decode(ids) == "héllo ✓"
    dec = tok.decoder()
    pieces = [dec.feed(t) for t in tok.encode("✓")]
    assert pieces == ["", "", "✓"]
    assert dec.feed(tok.eos_token_id) == "" and dec.feed(400) == ""


# -- generation through the runner ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_greedy_outputs_match_the_reference_whatever_the_batching(decoder, mode):
    # a small cache and a small step budget force chunked prefill and, in continuous
    # mode, preemption with recomputation; the tokens must not change
    runner = runner_for(decoder, mode=mode, num_cache_blocks=8, max_num_batched_tokens=16,
                        max_num_seqs=4)
    prompts = [list(range(10 + i, 10 + i + n)) for i, n in enumerate([5, 23, 9, 14, 3])]
    seqs = [runner.new_sequence(p, max_new_tokens=12 + 3 * i, ignore_eos=True)
            for i, p in enumerate(prompts)]
    drain(runner)
    if mode == "continuous":
        assert runner.scheduler.total_preemptions > 0
    for s, p in zip(seqs, prompts):
        assert s.outcome == "ok" and s.finish_reason == "length"
        assert s.output_ids == greedy_reference(decoder, p, len(s.output_ids))


def test_seeded_sampling_does_not_depend_on_the_company(decoder):
    def sample_with(others: int) -> list[int]:
        runner = runner_for(decoder)
        seq = runner.new_sequence([5, 6, 7], max_new_tokens=10, ignore_eos=True,
                                  temperature=0.9, seed=42)
        for i in range(others):
            runner.new_sequence([20 + i] * (3 + i), max_new_tokens=6, ignore_eos=True,
                                temperature=1.0, seed=i)
        drain(runner)
        return seq.output_ids

    alone = sample_with(0)
    assert alone == sample_with(3)
    assert alone != greedy_reference(decoder, [5, 6, 7], 10)


def test_records_steps_requests_and_aggregated_preemptions(decoder):
    clock, rec = FakeClock(), ListRecorder()
    runner = runner_for(decoder, clock=clock, recorder=rec, num_cache_blocks=10,
                        preemption_event_interval_s=1000.0)
    for i in range(4):
        runner.new_sequence([1 + i] * 8, max_new_tokens=20, ignore_eos=True)
    steps = drain(runner, clock)
    runner.flush_events()
    step_rows = rec.of(GenStepRow)
    assert len(step_rows) == steps
    assert sum(r.decode_tokens for r in step_rows) + 4 + runner.scheduler.total_preemptions \
        >= 4 * 20
    assert all(r.blocks_used + r.blocks_free == 10 and r.mode == "continuous" for r in step_rows)
    assert sum(r.preemptions for r in step_rows) == runner.scheduler.total_preemptions > 1
    events = [e for e in rec.of(EventRow) if e.kind == "preemption"]
    # the first preemption is reported at once, the rest held back and then flushed together
    assert len(events) == 2
    assert sum(json.loads(e.details_json)["count"] for e in events) == runner.scheduler.total_preemptions
    reqs = rec.of(RequestRow)
    assert len(reqs) == 4 and all(r.outcome == "ok" and r.output_tokens == 20 for r in reqs)
    for r in reqs:
        assert r.prompt_tokens == 8 and 0 <= r.ttft_s <= r.latency_s
        assert r.tpot_s == pytest.approx((r.latency_s - r.ttft_s) / 19)


def test_timeout_backpressure_and_validation(decoder):
    clock, rec = FakeClock(), ListRecorder()
    runner = runner_for(decoder, clock=clock, recorder=rec, max_num_seqs=1, max_queue_size=2)
    first = runner.new_sequence([1, 2], max_new_tokens=5, ignore_eos=True)
    late = runner.new_sequence([1, 2], max_new_tokens=5, timeout_ms=20)
    with pytest.raises(QueueFull) as err:
        runner.new_sequence([3], max_new_tokens=2)
    assert err.value.retry_after_s and err.value.http_status == 429
    with pytest.raises(ValidationError, match="priority"):
        runner.new_sequence([3], priority=7)
    drain(runner, clock)
    assert first.outcome == "ok" and late.outcome == "expired" and late.output_ids == []
    outcomes = sorted(r.outcome for r in rec.of(RequestRow))
    assert outcomes == ["expired", "ok", "rejected"]


def test_settings_change_applies_at_the_next_step_and_is_recorded(decoder):
    rec = ListRecorder()
    runner = runner_for(decoder, recorder=rec, max_num_seqs=1)
    for i in range(3):
        runner.new_sequence([1 + i, 2], max_new_tokens=4, ignore_eos=True)
    out, _ = runner.step()
    assert len(out.chunks) == 1
    version, cfg = runner.update_settings({"max_num_seqs": 3}, requested_by="dashboard")
    assert version == 2 and cfg.max_num_seqs == 3
    out, _ = runner.step()
    assert len(out.chunks) == 3
    with pytest.raises(ConfigError, match="size the KV cache"):
        runner.update_settings({"num_cache_blocks": 5})
    with pytest.raises(ConfigError, match="max_num_seqs"):
        runner.update_settings({"max_num_seqs": 0})
    assert runner.get_settings() == (2, cfg)
    event = next(e for e in rec.of(EventRow) if e.kind == "settings_change")
    details = json.loads(event.details_json)
    assert details["old"]["max_num_seqs"] == 1 and details["new"]["max_num_seqs"] == 3
    assert details["requested_by"] == "dashboard"


def test_a_failing_step_fails_only_its_requests(decoder):
    rec = ListRecorder()
    model = SteppedModel(decoder)
    runner = runner_for(model, recorder=rec, max_num_seqs=1)
    a = runner.new_sequence([1, 2, 3], max_new_tokens=3, ignore_eos=True)
    b = runner.new_sequence([4, 5, 6], max_new_tokens=3, ignore_eos=True)
    model.fail_next_step(RuntimeError("device fell over"))
    runner.step()
    assert a.outcome == "error" and "device fell over" in str(a.error)
    drain(runner)
    assert b.outcome == "ok" and len(b.output_ids) == 3
    assert any(e.kind == "model_error" for e in rec.of(EventRow))


def test_config_validation_names_the_field():
    with pytest.raises(ConfigError, match="max_num_batched_tokens=4 is below max_num_seqs=8"):
        GenerationConfig(max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ConfigError, match="mode='batchy'"):
        GenerationConfig().with_changes({"mode": "batchy"})
    with pytest.raises(ConfigError, match="unknown setting"):
        GenerationConfig().with_changes({"max_batch": 3})
    assert GenerationConfig().with_changes({"default_timeout_ms": 5}).default_timeout_ms == 5.0
    with pytest.raises(ConfigError, match="exceeds what model"):
        StepRunner(TinyDecoder(max_model_len=64), GenerationConfig(max_model_len=128))


def test_a_tiny_temperature_samples_the_most_likely_token_instead_of_failing():
    import torch

    from runtime.generation.model import sample

    logits = torch.tensor([[1.0, 3.0, 2.0]])
    gen = torch.Generator().manual_seed(0)
    assert sample(logits, [(0, 1e-300, gen)]) == [1]
