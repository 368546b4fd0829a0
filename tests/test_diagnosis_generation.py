"""The generation rules on recorded steps: ``speculation_not_paying`` fires where
speculation costs more per generated token than decoding without it, or where few
proposed tokens are accepted, and stays quiet where it pays; ``long_prefill_stall``
fires where steps carrying a long prefill take many times a decode-only step, and stays
quiet where the prefills are short or cheap. On SQLite and PostgreSQL alike."""

from __future__ import annotations

import pytest

from batchscope.analysis import diagnosis, queries
from batchscope.storage.db import make_engine
from batchscope.storage.recorder import Recorder
from tests.factories import gen_step

END = 2_000_000_000.0
STEPS = 600  # one every 0.2 s over the two minutes before END

pytestmark = pytest.mark.both_backends


def spec_pays(i: int):
    """4 sequences; 4 of 5 steps speculate: 12 of 16 proposed tokens accepted, 0.75 ms a
    token, against 2.5 ms without."""
    if i % 5:
        return dict(running=4, drafted=16, accepted=12, step_s=0.012)
    return dict(running=4, drafted=0, accepted=0, step_s=0.010)


def spec_dearer(i: int):
    """Pays at 2 sequences (0.75 ms a token against 5 ms); at 16 (the second half), a
    token costs 1.25 ms with speculation and 0.75 ms without."""
    if i < STEPS // 2:
        speculated = dict(running=2, drafted=8, accepted=6, step_s=0.006)
        return speculated if i % 5 else dict(running=2, drafted=0, accepted=0, step_s=0.010)
    if i % 5:
        return dict(running=16, drafted=64, accepted=32, step_s=0.060)
    return dict(running=16, drafted=0, accepted=0, step_s=0.012)


def spec_low(i: int):
    """Always speculating (no switch): 1 of 16 proposed tokens accepted."""
    return dict(running=4, drafted=16, accepted=1, step_s=0.012)


def spec_switched_off(i: int):
    """Low acceptance, but the switch turned speculation off after the first quarter."""
    return spec_low(i) if i < STEPS // 4 else dict(running=4, drafted=0, accepted=0, step_s=0.01)


def long_prefill(i: int):
    """8 decodes at 10 ms a step; every 10th step also prefills 2048 tokens (120 ms), every
    10th from the 5th 64 tokens (13 ms)."""
    if i % 10 == 0:
        return dict(running=8, prefill=2048, step_s=0.120)
    if i % 10 == 5:
        return dict(running=8, prefill=64, step_s=0.013)
    return dict(running=8, step_s=0.010)


def chunked_prefill(i: int):
    """The same prompts in slices of 256 tokens: 25 ms a step carrying one."""
    return dict(running=8, prefill=256, step_s=0.025) if i % 2 == 0 else dict(running=8, step_s=0.010)


def plain(i: int):
    """No speculation set up, short prefills."""
    return dict(running=6, prefill=128 if i % 7 == 0 else 0, step_s=0.011 if i % 7 == 0 else 0.010)


DATA = {f.__name__: f for f in (spec_pays, spec_dearer, spec_low, spec_switched_off, long_prefill,
                                chunked_prefill, plain)}
#: data -> the rules it raises
EXPECTED = {
    "spec_pays": set(),
    "spec_dearer": {"speculation_not_paying"},
    "spec_low": {"speculation_not_paying"},
    "spec_switched_off": set(),
    "long_prefill": {"long_prefill_stall"},
    "chunked_prefill": set(),
    "plain": set(),
}


@pytest.fixture(scope="module")
def bundles(backend, new_database_url):
    """Each data set under its own model name in one database, and its window's bundle."""
    engine = make_engine(new_database_url(backend))
    rec = Recorder(engine)
    for name, step in DATA.items():
        rec.put_many([gen_step(END - 120 + i * 0.2, model=name, **step(i)) for i in range(STEPS)])
    rec.flush()
    out = {name: queries.live_bundle(engine, queries.Window(END - 120, END + 1, name))
           for name in DATA}
    engine.dispose()
    return out


def test_generation_rules_fire_exactly_on_their_problem(bundles):
    flags = {name: diagnosis.diagnose(bundle) for name, bundle in bundles.items()}
    assert {name: {f.rule for f in found} for name, found in flags.items()} == EXPECTED
    for f in (f for found in flags.values() for f in found):
        assert f.severity == "warning" and f.chart == "generation" and len(f.steps) >= 3


def test_speculation_dearer_than_without_names_both_costs_and_a_batch_limit(bundles):
    flag = diagnosis.rule_speculation_not_paying(bundles["spec_dearer"], diagnosis.Thresholds())
    ev = flag.evidence
    assert ev["batch_sizes"] == "9-16" and ev["batch_size_now"] == 16
    assert ev["ms_per_token_with"] == 1.25 and ev["ms_per_token_without"] == 0.75
    assert ev["acceptance_rate"] == 0.5 and ev["tokens_per_verification"] == 3.0
    assert "1.25 ms" in flag.title and "0.75 ms" in flag.title
    # measured cheaper at 2 sequences: speculation off above 2
    assert flag.steps[0].startswith("Set speculative_disable_by_batch_size to 2:")
    assert "num_speculative_tokens (to about 3)" in flag.steps[1]


def test_low_acceptance_without_a_measurement_without_speculation(bundles):
    flag = diagnosis.rule_speculation_not_paying(bundles["spec_low"], diagnosis.Thresholds())
    ev = flag.evidence
    assert ev["acceptance_rate"] == 0.062 and ev["ms_per_token_without"] is None
    assert ev["speculating_share_now"] == 1.0 and ev["proposed_per_sequence"] == 4.0
    assert "6% of the proposed tokens" in flag.title
    # nothing measured says a smaller batch pays: fewer tokens, another method, the switch
    assert flag.steps[0].startswith("Lower num_speculative_tokens (to about 2)")
    assert '"speculative": false' in flag.steps[1] and "spec_auto_switch on" in flag.steps[2]
    assert not any("speculative_disable_by_batch_size" in s for s in flag.steps)


def test_speculation_paying_is_quiet_even_below_the_acceptance_threshold(bundles):
    th = diagnosis.Thresholds(spec_low_acceptance_rate=0.8)  # 0.75 accepted is "low" here
    assert diagnosis.rule_speculation_not_paying(bundles["spec_pays"], th) is None
    # ... but not when a token is not measured cheaper by the margin
    th = diagnosis.Thresholds(spec_low_acceptance_rate=0.8, spec_cost_ratio=4.0)
    assert diagnosis.rule_speculation_not_paying(bundles["spec_pays"], th) is not None


def test_long_prefill_stall_suggests_a_cap_from_the_measured_prefill_cost(bundles):
    flag = diagnosis.rule_long_prefill_stall(bundles["long_prefill"], diagnosis.Thresholds())
    ev = flag.evidence
    assert ev["long_prefill_steps"] == 60 and ev["decode_only_steps"] == 480
    assert ev["mean_prefill_tokens"] == 2048 and ev["ratio"] == 12.0
    assert ev["step_mean_ms_long_prefill"] == 120.0 and ev["step_mean_ms_decode_only"] == 10.0
    assert ev["decodes_stalled"] == 60 * 8
    # (60 x 110 ms + 60 x 3 ms) over 60 x (2048 + 64) prefill tokens: 53.5 us a token; a
    # step of 2 x 10 ms holds about 187 of them, 176 in whole blocks of 16
    assert ev["prefill_ms_per_1k_tokens"] == pytest.approx(53.5, abs=0.05)
    assert ev["suggested_long_prefill_token_threshold"] == 176
    assert "long_prefill_token_threshold to about 176" in flag.steps[0]
    assert "max_num_batched_tokens to about 176 plus the 8 decodes" in flag.steps[1]


def test_thresholds_move_the_generation_rules(bundles):
    lenient = diagnosis.Thresholds(long_prefill_stall_ratio=20.0, spec_cost_ratio=2.0,
                                   spec_low_acceptance_rate=0.01)
    assert diagnosis.rule_long_prefill_stall(bundles["long_prefill"], lenient) is None
    assert diagnosis.rule_speculation_not_paying(bundles["spec_dearer"], lenient) is None
    strict = diagnosis.Thresholds(long_prefill_stall_ratio=2.0, long_prefill_min_tokens=256)
    assert diagnosis.rule_long_prefill_stall(bundles["chunked_prefill"], strict) is not None


def test_generation_rules_tolerate_bundles_without_their_frames(bundles):
    th = diagnosis.Thresholds()
    assert "generation_spec" not in bundles["plain"]
    for rule in (diagnosis.rule_speculation_not_paying, diagnosis.rule_long_prefill_stall):
        assert rule({"headline": bundles["plain"]["headline"]}, th) is None
        empty = {k: v.iloc[:0] for k, v in bundles["spec_low"].items()}
        assert rule(empty, th) is None
