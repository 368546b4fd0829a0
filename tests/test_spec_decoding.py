"""Speculative decoding: greedy outputs identical to plain decoding, the rejection
sampler's distribution, measured acceptance, KV rollback without leaks, cancellation
and preemption mid-speculation, per-request opt-out, settings and draft checks.

Nothing here asserts a time: every outcome is a count or a token."""

from __future__ import annotations

import asyncio
import json
import random

import numpy as np
import pytest
import torch

from batchscope.storage.records import EventRow, GenStepRow, ListRecorder
from runtime.api.errors import ConfigError
from runtime.core.clock import FakeClock
from runtime.generation.config import GenerationConfig
from runtime.generation.draft import bundled_draft, patterned_target
from runtime.generation.engine import GenerationEngine
from runtime.generation.runner import StepRunner
from runtime.generation.scheduler import Sequence
from runtime.generation.spec import (DraftProposer, DraftRequest, NgramProposer, Proposal, SpecController,
                                     chi_square_p_value, rejection_sample, verify_greedy)
from runtime.generation.toys import SteppedModel
from runtime.models.decoder import TinyDecoder

pytestmark = pytest.mark.timeout(300)

BLOCKS = 160


@pytest.fixture(scope="module")
def target() -> TinyDecoder:
    return TinyDecoder(n_layers=2, max_model_len=256)


@pytest.fixture(scope="module")
def trained_pair():
    """A target and the bundled draft trained on the same patterns (a few seconds)."""
    return patterned_target(max_model_len=256, n_layers=1, train_steps=200), \
        bundled_draft(max_model_len=256, train_steps=200)


def make_runner(model, recorder=None, proposer=None, draft_model=None, clock=None, **cfg):
    base = dict(block_size=8, num_cache_blocks=BLOCKS, max_model_len=256, max_num_seqs=64,
                max_num_batched_tokens=1024, spec_auto_switch=False)
    base.update(cfg)
    runner = StepRunner(model, GenerationConfig(**base), recorder=recorder, proposer=proposer,
                        draft_model=draft_model, clock=clock)
    runner.setup("cpu")
    return runner


def drain(runner: StepRunner, limit: int = 5000) -> int:
    steps = 0
    while runner.has_work() and steps < limit:
        runner.step()
        steps += 1
    assert not runner.has_work()
    return steps


def prompts_50(seed: int = 0) -> list[list[int]]:
    """Mixed prompts; every third one repeats a phrase (where prompt lookup finds matches)."""
    rng = random.Random(seed)
    out = []
    for i in range(50):
        if i % 3 == 0:
            phrase = [rng.randrange(256) for _ in range(rng.randint(2, 6))]
            out.append((phrase * 8)[:rng.randint(8, 40)])
        else:
            out.append([rng.randrange(256) for _ in range(rng.randint(1, 40))])
    return out


def outputs(runner: StepRunner, prompts, max_new=24, **kw) -> list[list[int]]:
    seqs = [runner.new_sequence(p, max_new_tokens=max_new, ignore_eos=True, **kw)
            for p in prompts]
    drain(runner)
    return [s.output_ids for s in seqs]


def assert_no_leaks(runner: StepRunner) -> None:
    assert runner.scheduler.blocks.num_free == BLOCKS and not runner.scheduler.blocks.owners()
    proposer = runner.proposer
    if isinstance(proposer, DraftProposer):
        proposer.propose([])  # drops the state of the sequences that ended
        assert proposer.num_tracked == 0
        assert proposer.blocks.num_free == proposer.blocks.num_blocks


# -- greedy: token-identical ------------------------------------------------------------------
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_outputs_are_identical_with_and_without_speculation(target, method):
    prompts = prompts_50()
    plain = outputs(make_runner(target), prompts)
    runner = make_runner(target, speculative_method=method, num_speculative_tokens=3)
    assert outputs(runner, prompts) == plain
    counts = runner.stats()["speculation"]
    assert counts["num_drafts"] > 0 and counts["num_draft_tokens"] >= counts["num_drafts"]
    assert_no_leaks(runner)


def test_a_trained_draft_is_accepted_and_outputs_stay_identical(trained_pair):
    tgt, draft = trained_pair
    prompts = prompts_50(1)[:20]
    plain_runner = make_runner(tgt)
    plain = outputs(plain_runner, prompts)
    runner = make_runner(tgt, draft_model=draft, speculative_method="draft",
                         num_speculative_tokens=4)
    assert outputs(runner, prompts) == plain
    spec = runner.stats()["speculation"]
    assert spec["acceptance_rate"] > 0.5
    assert runner.steps < plain_runner.steps  # several tokens per step
    assert_no_leaks(runner)


def test_preemption_and_cancellation_mid_speculation_leave_no_blocks_behind(target):
    prompts = prompts_50(2)[:12]
    plain = outputs(make_runner(target), prompts, max_new=40)
    # a cache too small for all of them at full length: sequences are preempted while
    # they speculate, and recomputed
    small = dict(num_cache_blocks=24, speculative_method="ngram", num_speculative_tokens=4)
    runner = StepRunner(target, GenerationConfig(block_size=8, max_model_len=256,
                                                 max_num_batched_tokens=1024,
                                                 spec_auto_switch=False, **small))
    runner.setup("cpu")
    seqs = [runner.new_sequence(p, max_new_tokens=40, ignore_eos=True) for p in prompts]
    drain(runner)
    assert runner.scheduler.total_preemptions > 0
    assert [s.output_ids for s in seqs] == plain
    assert runner.scheduler.blocks.num_free == 24

    runner = make_runner(target, speculative_method="draft", num_speculative_tokens=4)
    seqs = [runner.new_sequence(p, max_new_tokens=40, ignore_eos=True) for p in prompts]
    for _ in range(4):
        runner.step()
    out = runner.plan()
    assert out.draft_slots > 0
    sampled = runner.execute(out)
    victim = next(c.seq_id for c in out.chunks if c.draft_ids)
    runner.abort(victim)  # cancelled while its proposals were being verified
    runner.commit(out, sampled, 0.0)
    drain(runner)
    assert runner.counts["cancelled"] == 1
    assert [s.output_ids for s in seqs if s.seq_id != victim] == \
        [o for s, o in zip(seqs, plain) if s.seq_id != victim]
    assert_no_leaks(runner)


def test_rollback_frees_the_blocks_of_rejected_positions(target):
    class Wrong:
        """Proposes tokens the model never picks (the vocabulary's reserved ids)."""
        method = "test"

        def propose(self, requests):
            return [Proposal([300 + j for j in range(r.k)]) for r in requests]

        def release(self, seq_id):
            pass

    runner = make_runner(target, proposer=Wrong(), speculative_method="ngram",
                         num_speculative_tokens=16, block_size=4)
    seq = runner.new_sequence([1, 2, 3], max_new_tokens=60, ignore_eos=True)
    runner.step()  # prefill: first token
    out, result = runner.step()
    assert out.draft_tokens == 16 and [t for _, t in result.new_tokens] != []
    assert len(result.new_tokens) == 1 and result.rolled_back_tokens == 16
    # positions 3..19 took 5 blocks of 4; 5 tokens known keep 2, the other 3 are back
    assert seq.num_tokens == 5 and seq.num_computed == 4
    assert runner.scheduler.blocks.num_used == 2 and result.rolled_back_blocks == 3
    drain(runner)
    assert runner.stats()["speculation"]["num_accepted_tokens"] == 0
    assert_no_leaks(runner)


def test_greedy_verification_keeps_the_agreeing_prefix_and_one_more():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 9]) == [5, 6, 7]
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]
    assert verify_greedy([5, 6], [4]) == [5]


# -- sampling: the distribution is the model's ------------------------------------------------
def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum().item()
    expected = probs * n
    stat = float(((counts - expected) ** 2 / expected).sum())
    return chi_square_p_value(stat, len(probs) - 1)


@pytest.mark.parametrize("random_draft", [True, False])
def test_rejection_sampling_leaves_the_target_distribution_unchanged(random_draft):
    gen = torch.Generator().manual_seed(7)
    vocab, k, draws = 6, 3, 100_000
    p_rows = torch.softmax(torch.randn(k + 1, vocab, generator=gen, dtype=torch.float64) * 1.5, -1)
    q_rows = torch.softmax(torch.randn(k, vocab, generator=gen, dtype=torch.float64) * 1.5, -1)
    p = p_rows.expand(draws, k + 1, vocab)
    if random_draft:  # a controlled proposer drawing its guesses from q
        drafts = torch.stack([torch.multinomial(q_rows[j], draws, replacement=True,
                                                generator=gen) for j in range(k)], dim=1)
        q = q_rows.expand(draws, k, vocab)
    else:  # a deterministic proposer: always the same guesses
        drafts = torch.tensor([[2, 0, 5]]).expand(draws, k)
        q = None
    tokens, counts = rejection_sample(p, drafts, q, gen)
    assert ((counts >= 1) & (counts <= k + 1)).all()
    first = torch.bincount(tokens[:, 0], minlength=vocab).double()
    assert chi_square(first, p_rows[0]) > 0.01
    # the second token, where the first was accepted and equals the guess, is p_rows[1]
    second = tokens[(counts >= 2), 1]
    assert chi_square(torch.bincount(second, minlength=vocab).double(), p_rows[1]) > 0.01 \
        if not random_draft else True
    # and a wrong sampler is caught by the same test
    assert chi_square(first, q_rows[0] if random_draft else p_rows[1]) < 0.01


def test_chi_square_p_value_matches_known_points():
    assert chi_square_p_value(3.841, 1) == pytest.approx(0.05, abs=1e-3)
    assert chi_square_p_value(15.086, 5) == pytest.approx(0.01, abs=1e-3)


# -- a synthetic proposer with acceptance 0.7 -------------------------------------------------
class SyntheticProposer:
    """Knows the greedy continuation; each guess is right with probability ``rate``."""

    method = "synthetic"

    def __init__(self, reference: dict[tuple[int, ...], list[int]], rate: float) -> None:
        self.reference, self.rate = reference, rate
        self.rng = random.Random(3)

    def propose(self, requests):
        out = []
        for r in requests:
            ref = self.reference[tuple(r.seq.prompt_ids)]
            done = len(r.seq.output_ids)
            out.append(Proposal([t if self.rng.random() < self.rate else (t + 1) % 256
                                 for t in ref[done:done + r.k]]))
        return out

    def release(self, seq_id):
        pass


def test_a_synthetic_proposer_at_acceptance_0_7_measures_0_7(target):
    rate, k = 0.7, 4
    rng = random.Random(11)
    prompts = [[rng.randrange(256) for _ in range(rng.randint(2, 20))] for _ in range(16)]
    plain = outputs(make_runner(target), prompts, max_new=200)
    proposer = SyntheticProposer({tuple(p): o for p, o in zip(prompts, plain)}, rate)
    runner = make_runner(target, proposer=proposer, speculative_method="ngram",
                         num_speculative_tokens=k)
    assert outputs(runner, prompts, max_new=200) == plain
    spec = runner.stats()["speculation"]
    per_pos = spec["accepted_per_pos"]
    # each guess is judged only when those before it were accepted: the conditional rate
    reached = spec["num_drafts"] + sum(per_pos[:k - 1])
    assert sum(per_pos) / reached == pytest.approx(rate, abs=0.03)
    theory = 1 + rate * (1 - rate ** k) / (1 - rate)
    assert spec["mean_acceptance_length"] == pytest.approx(theory, rel=0.05)


# -- the proposers ------------------------------------------------------------------------------
def test_prompt_lookup_proposes_what_followed_the_latest_match():
    ng = NgramProposer(1, 3)
    assert ng.lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 3) == [7, 1, 2]
    assert ng.lookup([5, 6, 7, 8], 2) == []
    assert ng.lookup([4, 4], 3) == [4]
    with pytest.raises(ConfigError):
        NgramProposer(3, 2)


def reference_lookup(context: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Prompt lookup by brute force: the longest n first, its latest earlier match."""
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start:start + n] == suffix:
                return context[start + n:start + n + k]
    return []


@pytest.mark.parametrize("min_n, max_n", [(1, 4), (2, 3), (1, 1), (3, 5)])
def test_prompt_lookup_grown_step_by_step_equals_brute_force(min_n, max_n):
    """The proposer keeps each sequence's tokens between steps; whatever the steps append
    (one token, an accepted run), every proposal equals the brute-force lookup."""
    rng = np.random.default_rng(min_n * 10 + max_n)
    ng = NgramProposer(min_n, max_n)
    seqs = [Sequence(seq_id=i, prompt_ids=rng.integers(0, 6, rng.integers(1, 40)).tolist(),
                     max_new_tokens=500, priority=0, arrival_s=0.0) for i in range(4)]
    for _ in range(60):
        got = ng.propose([DraftRequest(s, 3) for s in seqs])
        for s, proposal in zip(seqs, got):
            assert proposal.token_ids == reference_lookup(s.prompt_ids + s.output_ids, 3, min_n, max_n)
            s.output_ids.extend(rng.integers(0, 6, rng.integers(1, 5)).tolist())
    ng.release(0)
    ng.propose([DraftRequest(seqs[1], 3)])
    assert 0 not in ng._tokens and 1 in ng._tokens
    for seq_id in range(100, 1100):  # ended without a proposal: nothing is kept for them
        ng.release(seq_id)
    assert ng._releases.take() == []


# -- requests and settings -----------------------------------------------------------------------
def test_opt_out_and_asking_a_model_without_a_proposer_are_served_and_counted(target):
    runner = make_runner(target, speculative_method="ngram", num_speculative_tokens=2)
    a = runner.new_sequence([7, 7, 7, 7, 7, 7], max_new_tokens=12, ignore_eos=True,
                            speculative=False)
    b = runner.new_sequence([7, 7, 7, 7, 7, 7], max_new_tokens=12, ignore_eos=True)
    drafted_for = set()
    while runner.has_work():
        out, _ = runner.step()
        drafted_for |= {c.seq_id for c in out.chunks if c.num_draft_slots}
    assert a.seq_id not in drafted_for and b.seq_id in drafted_for
    assert runner.stats()["speculation"]["requests_opted_out"] == 1

    plain = make_runner(target)
    seq = plain.new_sequence([1, 2, 3], max_new_tokens=5, speculative=True)
    drain(plain)
    assert seq.outcome == "ok" and len(seq.output_ids) == 5
    assert plain.stats()["speculation"]["requests_without_proposer"] == 1


@pytest.mark.parametrize("changes, fragment", [
    ({"num_speculative_tokens": 0}, "num_speculative_tokens=0 must be an integer from 1 to 16"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens=17"),
    ({"speculative_method": "medusa"}, "is not one of none, ngram, draft"),
    ({"long_prefill_token_threshold": -1}, "long_prefill_token_threshold=-1"),
    ({"spec_min_acceptance_rate": 1.5}, "spec_min_acceptance_rate=1.5"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 2}, "prompt_lookup_min=5 is above"),
])
def test_speculation_settings_out_of_bounds_are_refused(changes, fragment):
    with pytest.raises(ConfigError, match=fragment):
        GenerationConfig().with_changes(changes)


def test_a_draft_with_another_vocabulary_is_refused_at_start(target):
    with pytest.raises(ConfigError, match="vocabulary of 300 tokens but 'decoder' has 512"):
        StepRunner(target, GenerationConfig(max_model_len=256, speculative_method="draft"),
                   draft_model=TinyDecoder(vocab_size=300, max_model_len=256))
    with pytest.raises(ConfigError, match="vocabulary of 260 tokens"):
        StepRunner(target, GenerationConfig(max_model_len=256, speculative_method="draft"),
                   draft_model=bundled_draft(vocab_size=260, max_model_len=256, train_steps=1))
    # switching to it at run time is refused the same way, and changes nothing
    runner = StepRunner(target, GenerationConfig(max_model_len=256),
                        draft_model=TinyDecoder(vocab_size=300, max_model_len=256))
    with pytest.raises(ConfigError, match="vocabulary"):
        runner.update_settings({"speculative_method": "draft"})
    assert runner.config.speculative_method == "none" and runner.proposer is None


def test_switching_the_method_at_run_time_keeps_outputs(target):
    prompts = prompts_50(4)[:6]
    plain = outputs(make_runner(target), prompts, max_new=30)
    runner = make_runner(target)
    seqs = [runner.new_sequence(p, max_new_tokens=30, ignore_eos=True) for p in prompts]
    for _ in range(5):
        runner.step()
    runner.update_settings({"speculative_method": "draft", "num_speculative_tokens": 3})
    for _ in range(5):
        runner.step()
    runner.update_settings({"speculative_method": "ngram"})
    drain(runner)
    assert [s.output_ids for s in seqs] == plain
    assert runner.stats()["speculation"]["num_drafts"] > 0


# -- the automatic off-switch --------------------------------------------------------------------
def feed(ctl: SpecController, cfg: GenerationConfig, batch: int, cost_on: float,
         cost_off: float, steps: int, acceptance: float = 0.8) -> list:
    switches = []
    for _ in range(steps):
        k = ctl.num_spec_tokens(cfg, batch)
        tokens = batch * (3 if k else 1)
        drafted = batch * k
        step_s = (cost_on if k else cost_off) * tokens
        sw = ctl.observe(cfg, batch, bool(k), drafted, int(drafted * acceptance), tokens, step_s)
        if sw is not None:
            switches.append(sw)
    return switches


def test_the_controller_speculates_where_it_is_cheaper_per_token_and_probes_again():
    cfg = GenerationConfig(speculative_method="ngram", spec_probe_interval_steps=50)
    ctl = SpecController()
    # batch 1: 0.4 ms per token with speculation, 1 ms without -> on
    switches = feed(ctl, cfg, 1, 0.4e-3, 1e-3, 40)
    assert [s.on for s in switches] == [True] and ctl.num_spec_tokens(cfg, 1) == 4
    # batch 32: speculation costs more per token -> off, with the figures in the reason
    switches = feed(ctl, cfg, 32, 2e-3, 1e-3, 40)
    assert [s.on for s in switches] == [False] and "without" in switches[0].reason
    assert ctl.num_spec_tokens(cfg, 32) == 0
    # after the probe interval it measures again; now speculation pays at 32 as well
    switches = feed(ctl, cfg, 32, 0.5e-3, 1e-3, 120)
    assert [s.on for s in switches] == [True] and ctl.num_spec_tokens(cfg, 32) == 4
    # low acceptance turns it off whatever the times say
    ctl2 = SpecController()
    switches = feed(ctl2, cfg, 1, 0.4e-3, 1e-3, 40, acceptance=0.05)
    assert [s.on for s in switches] == [False] and "accepted" in switches[0].reason
    # the batch-size bound and the switch itself
    bound = cfg.with_changes({"speculative_disable_by_batch_size": 8})
    assert ctl.num_spec_tokens(bound, 9) == 0 and ctl.num_spec_tokens(bound, 1) == 4
    fixed = cfg.with_changes({"spec_auto_switch": False})
    assert SpecController().num_spec_tokens(fixed, 32) == 4
    assert SpecController().num_spec_tokens(GenerationConfig(), 1) == 0


def test_switches_are_events_and_steps_record_their_drafts(target):
    rec = ListRecorder()
    runner = make_runner(target, recorder=rec, speculative_method="draft",
                         spec_auto_switch=True, spec_min_acceptance_rate=0.9,
                         clock=FakeClock())
    outputs(runner, prompts_50(5)[:4], max_new=40)
    events = [e for e in rec.of(EventRow) if e.kind == "speculation"]
    # the untrained target rarely agrees with the bundled draft: speculation goes off
    assert events and json.loads(events[-1].details_json)["on"] is False
    assert "accepted" in events[-1].message
    steps = rec.of(GenStepRow)
    assert sum(s.spec_draft_tokens for s in steps) == runner.stats()["speculation"][
        "num_draft_tokens"] > 0
    assert sum(s.spec_accepted_tokens for s in steps) == runner.stats()["speculation"][
        "num_accepted_tokens"]
    plain = ListRecorder()
    outputs(make_runner(target, recorder=plain), [[1, 2]], max_new=3)
    assert all(s.spec_draft_tokens is None for s in plain.of(GenStepRow))


# -- the engine: several tokens of one request per step -------------------------------------------
def test_streams_get_every_token_once_in_order_and_stop_strings_cut_mid_step(trained_pair):
    tgt, draft = trained_pair
    cfg = GenerationConfig(block_size=8, num_cache_blocks=64, max_model_len=256,
                           speculative_method="draft", spec_auto_switch=False)
    prompt = [65, 66, 67]
    plain_runner = make_runner(tgt)
    reference = outputs(plain_runner, [prompt], max_new=30)[0]

    async def main():
        engine = GenerationEngine(SteppedModel(tgt), cfg, draft_model=draft)
        await engine.start()
        events = [e async for e in engine.generate(prompt, max_new_tokens=30, ignore_eos=True)]
        await engine.stop()
        return engine, events

    engine, events = asyncio.run(main())
    assert [e.token_id for e in events] == reference
    assert [e.index for e in events] == list(range(30))
    assert [e.finish_reason for e in events] == [None] * 29 + ["length"]
    assert engine.runner.steps < 30


def test_low_acceptance_at_a_large_batch_switches_off_after_one_step():
    cfg = GenerationConfig(speculative_method="ngram")
    ctl = SpecController()
    # 32 sequences x 4 proposals: one step holds 128 proposals, enough to call 5 % low
    first = feed(ctl, cfg, 32, 2e-3, 1e-3, 1, acceptance=0.05)
    assert [s.on for s in first] == [False] and ctl.num_spec_tokens(cfg, 32) == 0
    # at batch 1 four proposals a step are not enough evidence yet
    ctl1 = SpecController()
    assert feed(ctl1, cfg, 1, 2e-3, 1e-3, 1, acceptance=0.05) == []
    assert ctl1.num_spec_tokens(cfg, 1) == 4
