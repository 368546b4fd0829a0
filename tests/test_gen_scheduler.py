"""The generation scheduler as a state machine: time and sampled tokens are passed in."""

from __future__ import annotations

import random

import pytest

from runtime.api.errors import ClientError, ValidationError
from runtime.generation.config import GenerationConfig
from runtime.generation.kv_cache import BlockManager
from runtime.generation.scheduler import FINISHED, RUNNING, WAITING, Scheduler, Sequence

EOS = 99


def make(mode: str = "continuous", **kw) -> Scheduler:
    base = dict(mode=mode, block_size=4, num_cache_blocks=16, max_model_len=64,
                max_num_seqs=8, max_num_batched_tokens=64)
    base.update(kw)
    return Scheduler(GenerationConfig(**base), eos_token_id=EOS, vocab_size=128)


def seq(seq_id: int, prompt_len: int, max_new: int, *, priority: int = 1,
        arrival: float = 0.0, deadline: float | None = None, ignore_eos: bool = True) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_ids=[(seq_id * 7 + i) % 90 for i in range(prompt_len)],
                    max_new_tokens=max_new, priority=priority, arrival_s=arrival,
                    deadline_s=deadline, ignore_eos=ignore_eos)


def step(sch: Scheduler, now: float = 0.0, token_of=lambda seq_id: 5):
    out = sch.schedule(now)
    sampled = {c.seq_id: token_of(c.seq_id) for c in out.chunks if c.completes}
    return out, sch.update_from_output(out, sampled, now)


def check_invariants(sch: Scheduler) -> None:
    owners = set(sch.blocks.owners())
    assert owners <= {s.seq_id for s in sch.running + sch.padded}
    assert not sch.padded or sch.running  # pad rows only while their batch runs
    used = sum(len(sch.blocks.block_table(i)) for i in owners)
    assert used == sch.blocks.num_used
    assert len(sch.running) <= sch.config.max_num_seqs
    for s in sch.running:
        assert s.status == RUNNING
        assert sch.blocks.blocks_for(s.num_computed) <= len(sch.blocks.block_table(s.seq_id))
    for s in sch.waiting:
        assert s.status == WAITING and s.num_computed == 0


# -- the block manager ------------------------------------------------------------------
def test_block_manager_allocates_all_or_nothing_and_frees():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.allocate(1, 9)  # 3 blocks
    assert bm.num_free == 1
    assert not bm.allocate(2, 8)  # needs 2, one free: nothing changes
    assert bm.num_free == 1 and bm.block_table(2) == []
    assert bm.allocate(1, 12)  # still 3 blocks
    assert bm.allocate(1, 13) and bm.num_free == 0
    assert bm.free(1) == 4 and bm.num_free == 4


# -- joining and leaving ------------------------------------------------------------------
def test_new_request_joins_running_batch_at_next_step():
    sch = make()
    a = seq(1, 6, 10)
    sch.add_request(a)
    out, _ = step(sch)
    assert out.admitted == [1] and out.prefill_tokens == 6
    step(sch)  # a decodes
    sch.add_request(seq(2, 5, 3, arrival=1.0))
    out, res = step(sch, 1.0)
    assert out.admitted == [2]
    assert {c.seq_id: c.is_decode for c in out.chunks} == {1: True, 2: False}
    assert out.decode_tokens == 1 and out.prefill_tokens == 5
    assert [s.seq_id for s, _ in res.new_tokens] == [1, 2]


def test_finished_sequence_leaves_at_once_and_frees_its_blocks():
    sch = make()
    sch.add_request(seq(1, 4, 2))
    sch.add_request(seq(2, 4, 6))
    step(sch)  # prefill: both get their first token
    out, res = step(sch)  # seq 1 gets its 2nd token: done
    assert [s.seq_id for s in res.finished] == [1]
    assert res.finished[0].finish_reason == "length" and res.finished[0].status == FINISHED
    assert sch.blocks.block_table(1) == []
    assert sch.blocks.num_used == len(sch.blocks.block_table(2)) == 2
    out, _ = step(sch)
    assert [c.seq_id for c in out.chunks] == [2]


def test_end_token_stops_unless_ignored():
    sch = make()
    sch.add_request(seq(1, 4, 10, ignore_eos=False))
    sch.add_request(seq(2, 4, 3, ignore_eos=True))
    _, res = step(sch, token_of=lambda i: EOS)
    assert [(s.seq_id, s.finish_reason) for s in res.finished] == [(1, "stop")]
    step(sch, token_of=lambda i: EOS)
    _, res = step(sch, token_of=lambda i: EOS)
    assert [(s.seq_id, s.finish_reason) for s in res.finished] == [(2, "length")]


# -- admission control and limits -----------------------------------------------------------
def test_admission_waits_until_the_prompt_blocks_fit():
    sch = make(num_cache_blocks=6)
    sch.add_request(seq(1, 16, 4))  # 4 blocks
    step(sch)
    sch.add_request(seq(2, 12, 2))  # 3 blocks, but only 2 free (1 kept as headroom)
    out, _ = step(sch)
    assert out.admitted == [] and [s.seq_id for s in sch.waiting] == [2]
    while sch.get(1) is not None:
        step(sch)
    out, _ = step(sch)
    assert out.admitted == [2]


def test_max_num_seqs_and_token_budget_bound_each_step():
    sch = make(max_num_seqs=2, max_num_batched_tokens=6, num_cache_blocks=64)
    for i in range(1, 4):
        sch.add_request(seq(i, 10, 3))
    out, _ = step(sch)
    # one prompt fills the budget with a partial chunk: no token sampled for it yet
    assert [(c.seq_id, len(c.token_ids), c.completes) for c in out.chunks] == [(1, 6, False)]
    out, res = step(sch)
    assert [(c.seq_id, len(c.token_ids)) for c in out.chunks] == [(1, 4), (2, 2)]
    assert [s.seq_id for s, _ in res.new_tokens] == [1]
    for _ in range(20):
        out, _ = step(sch)
        assert len(out.chunks) <= 2 and sum(len(c.token_ids) for c in out.chunks) <= 6
        check_invariants(sch)


def test_requests_that_can_never_fit_are_refused_at_submission():
    sch = make(num_cache_blocks=4, max_model_len=64)  # cache: 16 tokens
    with pytest.raises(ValidationError, match="max_model_len=64; shorten the prompt or ask "
                                              "for at most 4 tokens"):
        sch.check([1] * 60, 10)
    # a prompt that alone fills max_model_len: no max_tokens helps, so none is offered
    with pytest.raises(ValidationError, match="leaves no room for one more within "
                                              "max_model_len=64; shorten it to at most 63"):
        sch.check([1] * 64, 1)
    with pytest.raises(ValidationError, match="KV-cache blocks"):
        sch.check([1] * 10, 10)
    with pytest.raises(ClientError, match="empty"):
        sch.check([], 4)
    with pytest.raises(ClientError, match="outside the vocabulary"):
        sch.check([1, 500], 4)
    with pytest.raises(ValidationError, match="max_tokens"):
        sch.check([1], 0)
    sch.check([1] * 10, 6)  # exactly the cache


def test_priority_then_arrival_decides_admission_order():
    sch = make(max_num_seqs=1)
    sch.add_request(seq(1, 4, 1, priority=2, arrival=0.0))
    sch.add_request(seq(2, 4, 1, priority=0, arrival=1.0))
    sch.add_request(seq(3, 4, 1, priority=0, arrival=0.5))
    order = []
    while sch.has_work():
        out, _ = step(sch, 2.0)
        order += out.admitted
    assert order == [3, 2, 1]


def test_request_expires_while_waiting_but_not_once_started():
    sch = make(max_num_seqs=1)
    sch.add_request(seq(1, 4, 5, deadline=0.5))
    sch.add_request(seq(2, 4, 5, deadline=0.5))
    step(sch, 0.0)  # 1 starts, 2 waits
    out, _ = step(sch, 0.6)
    assert [s.seq_id for s in out.expired] == [2]
    assert out.expired[0].outcome == "expired" and out.expired[0].status == FINISHED
    assert sch.get(1) is not None and sch.get(1).outcome is None


# -- preemption ------------------------------------------------------------------------------
def test_preemption_takes_lowest_priority_then_newest_and_requeues_it():
    sch = make(num_cache_blocks=7, block_size=4)
    sch.add_request(seq(1, 4, 20, priority=0, arrival=0.0))
    sch.add_request(seq(2, 4, 20, priority=2, arrival=1.0))
    sch.add_request(seq(3, 4, 20, priority=2, arrival=2.0))
    sch.add_request(seq(4, 4, 20, priority=1, arrival=3.0))
    out, _ = step(sch, 3.0)
    assert out.admitted == [1, 4, 2, 3]  # priority order; one block each
    preempted: list[int] = []
    for _ in range(12):
        out, _ = step(sch, 3.0)
        preempted += out.preempted
        check_invariants(sch)
        if len(preempted) == 2:
            break
    # growing past the first block does not fit for all four: the priority-2 newest goes
    # first, then the other priority-2 one; priority 0 and 1 keep running
    assert preempted == [3, 2]
    assert [s.seq_id for s in sch.running] == [1, 4]
    assert [s.seq_id for s in sch.waiting] == [2, 3]  # back in arrival order
    victim = sch.waiting[1]
    assert victim.num_preemptions == 1 and victim.num_computed == 0
    assert len(victim.output_ids) == 1  # keeps what it generated
    assert sch.blocks.block_table(3) == [] and sch.blocks.block_table(2) == []


def test_preempted_sequence_resumes_by_recomputing_prompt_and_outputs():
    sch = make(num_cache_blocks=6, block_size=4)
    s2 = seq(2, 4, 12, priority=1)
    sch.add_request(seq(1, 4, 16, priority=0))
    sch.add_request(s2)
    generated: dict[int, list[int]] = {1: [], 2: []}
    resumed_chunk = None
    counter = iter(range(10_000))
    while sch.has_work():
        out, res = step(sch, token_of=lambda i: next(counter) % 90)
        for s, t in res.new_tokens:
            generated[s.seq_id].append(t)
        for c in out.chunks:
            if c.seq_id == 2 and s2.num_preemptions and c.start_pos == 0:
                resumed_chunk = c
        check_invariants(sch)
    assert resumed_chunk is not None, "sequence 2 was never preempted and resumed"
    # the recompute chunk replays the prompt and every token generated before preemption
    assert resumed_chunk.token_ids[:4] == s2.prompt_ids
    assert len(resumed_chunk.token_ids) > 4
    assert resumed_chunk.token_ids[4:] == generated[2][:len(resumed_chunk.token_ids) - 4]
    assert len(generated[1]) == 16 and len(generated[2]) == 12
    assert s2.output_ids == generated[2] and s2.outcome == "ok"
    assert sch.blocks.num_used == 0


# -- static mode ----------------------------------------------------------------------------
def test_static_mode_admits_a_batch_and_nobody_joins_until_it_ends():
    sch = make("static", num_cache_blocks=64)
    sch.add_request(seq(1, 4, 2))
    sch.add_request(seq(2, 4, 6))
    out, _ = step(sch)
    assert sorted(out.admitted) == [1, 2]
    # whole possible length reserved up front: 4 + 6 tokens = 3 blocks for seq 2
    assert len(sch.blocks.block_table(2)) == 3
    sch.add_request(seq(3, 4, 2, arrival=1.0))
    _, res = step(sch, 1.0)
    short = res.finished[0]
    assert short.seq_id == 1 and short.outcome == "ok"  # its result is out at once...
    joined_while_running, pad_rows = [], 0
    while sch.get(2) is not None:
        out, res = step(sch, 1.0)
        joined_while_running += out.admitted
        # ...but like a row of a padded batch tensor it keeps its slot and is computed
        assert [(c.seq_id, c.is_padding, c.completes) for c in out.chunks if c.seq_id == 1] \
            == [(1, True, False)]
        assert sch.blocks.block_table(1) != [] or sch.get(2) is None
        pad_rows += out.padding_tokens
    assert joined_while_running == [] and pad_rows == 4
    assert len(short.output_ids) == 2 and sch.blocks.num_used == 0 and sch.padded == []
    out, _ = step(sch, 2.0)
    assert out.admitted == [3] and out.padding_tokens == 0


def test_switching_static_to_continuous_releases_pad_rows():
    sch = make("static", num_cache_blocks=64)
    sch.add_request(seq(1, 4, 1))
    sch.add_request(seq(2, 4, 8))
    step(sch)
    assert [s.seq_id for s in sch.padded] == [1]
    sch.config = sch.config.with_changes({"mode": "continuous"})
    sch.add_request(seq(3, 4, 2))
    out, _ = step(sch)
    assert sch.padded == [] and sch.blocks.block_table(1) == []
    assert out.padding_tokens == 0 and out.admitted == [3]


def test_static_mode_batch_is_bounded_by_the_same_cache():
    sch = make("static", num_cache_blocks=8, block_size=4)
    for i in range(1, 5):
        sch.add_request(seq(i, 4, 8))  # 3 blocks reserved each
    out, _ = step(sch)
    assert sorted(out.admitted) == [1, 2]
    assert out.preempted == []


# -- nothing gets lost ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["continuous", "static"])
def test_every_request_ends_exactly_once_under_a_random_workload(mode):
    rng = random.Random(7)
    sch = make(mode, num_cache_blocks=24, block_size=4, max_num_seqs=5, max_num_batched_tokens=20,
               max_model_len=80)
    expected: dict[int, int] = {}
    ended: list[Sequence] = []
    now = 0.0
    next_id = 1
    for tick in range(3000):
        if next_id <= 60 and rng.random() < 0.3:
            prompt, new = rng.randint(1, 40), rng.randint(1, 40)
            s = seq(next_id, prompt, new, priority=rng.randint(0, 2), arrival=now,
                    ignore_eos=rng.random() < 0.5)
            sch.add_request(s)
            expected[next_id] = new
            next_id += 1
        out, res = step(sch, now, token_of=lambda i: rng.choice([EOS, 3, 4, 5, 6, 7, 8]))
        ended += res.finished + out.expired
        check_invariants(sch)
        now += 0.01
        if next_id > 60 and not sch.has_work():
            break
    assert sorted(s.seq_id for s in ended) == list(range(1, 61))
    for s in ended:
        assert s.outcome == "ok"
        assert 1 <= len(s.output_ids) <= expected[s.seq_id]
        if s.finish_reason == "length":
            assert len(s.output_ids) == expected[s.seq_id]
        else:
            assert s.output_ids[-1] == EOS and not s.ignore_eos
    assert sch.blocks.num_used == 0
    if mode == "continuous":
        assert sch.total_preemptions > 0  # the workload is sized to exercise preemption
    else:
        assert sch.total_preemptions == 0


def test_abort_removes_a_request_wherever_it_is():
    sch = make(max_num_seqs=1)
    sch.add_request(seq(1, 4, 5))
    sch.add_request(seq(2, 4, 5))
    step(sch)
    assert sch.abort(1, 0.1).outcome == "cancelled"
    assert sch.abort(2, 0.1).outcome == "cancelled"
    assert sch.abort(2, 0.1) is None
    assert not sch.has_work() and sch.blocks.num_used == 0
