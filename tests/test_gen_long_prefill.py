"""``long_prefill_token_threshold``: a long prompt is prefilled in slices while the
running sequences keep decoding in the same steps; preemption and cancellation in the
middle of such a prefill stay correct (no blocks left behind, outputs unchanged)."""

from __future__ import annotations

import pytest

from runtime.generation.config import GenerationConfig
from runtime.generation.scheduler import RUNNING, Scheduler, Sequence


def make(**kw) -> Scheduler:
    base = dict(block_size=4, num_cache_blocks=64, max_model_len=512, max_num_seqs=8,
                max_num_batched_tokens=64)
    base.update(kw)
    return Scheduler(GenerationConfig(**base))


def seq(seq_id: int, prompt_len: int, max_new: int = 8) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_ids=[1] * prompt_len, max_new_tokens=max_new,
                    priority=1, arrival_s=float(seq_id), ignore_eos=True)


def step(sch: Scheduler, now: float = 0.0):
    out = sch.schedule(now)
    sampled = {c.seq_id: 5 for c in out.chunks if c.completes}
    return out, sch.update_from_output(out, sampled, now)


def test_a_long_prompt_is_sliced_and_steps_mix_it_with_decodes():
    sch = make(long_prefill_token_threshold=16)
    for i in (1, 2):
        sch.add_request(seq(i, 4, max_new=40))
    step(sch)  # both prefilled (4 tokens each, under the threshold)
    sch.add_request(seq(3, 100))
    slices = []
    while sch.get(3) is not None and sch.get(3).num_computed < 100:
        out, _ = step(sch)
        by_id = {c.seq_id: c for c in out.chunks}
        assert by_id[1].is_decode and by_id[2].is_decode  # decodes go on every step
        slices.append(len(by_id[3].token_ids))
        assert out.prefill_tokens == slices[-1] and out.decode_tokens == 2
    assert slices == [16] * 6 + [4]
    # without the threshold the step budget alone caps it: 62 tokens next to the 2 decodes
    sch = make()
    for i in (1, 2):
        sch.add_request(seq(i, 4, max_new=40))
    step(sch)
    sch.add_request(seq(3, 100))
    out, _ = step(sch)
    assert [len(c.token_ids) for c in out.chunks] == [1, 1, 62]


def test_cancelled_and_preempted_mid_prefill_leave_no_blocks_behind():
    sch = make(long_prefill_token_threshold=8, num_cache_blocks=20, max_num_batched_tokens=16)
    sch.add_request(seq(1, 40, max_new=30))
    sch.add_request(seq(2, 30, max_new=30))
    step(sch)
    step(sch)
    assert 0 < sch.get(1).num_computed < 40
    sch.abort(1, 1.0)  # cancelled in the middle of its prefill
    assert sch.blocks.owners() == [2]
    sch.add_request(seq(3, 40, max_new=30))
    preempted = 0
    for _ in range(400):
        if not sch.has_work():
            break
        out, _ = step(sch)
        preempted += len(out.preempted)
        running = [s for s in sch.running if s.status == RUNNING]
        assert sum(len(sch.blocks.block_table(s.seq_id)) for s in running) == sch.blocks.num_used
    assert not sch.has_work() and preempted > 0
    assert sch.blocks.num_free == 20


@pytest.mark.parametrize("value", [0, 1, 512])
def test_the_threshold_accepts_its_bounds(value):
    assert make(long_prefill_token_threshold=value).config.long_prefill_token_threshold == value
