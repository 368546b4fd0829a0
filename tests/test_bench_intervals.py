"""``benchmarks.intervals.paired_ratio``: the figure benchmarks judge targets by."""

from __future__ import annotations

import math

import pytest

from benchmarks.intervals import Interval, paired_ratio


def test_equal_rounds_give_one_and_a_closed_interval():
    got = paired_ratio([100.0, 200.0, 50.0], [100.0, 200.0, 50.0])
    assert (got.ratio, got.low, got.high, got.rounds) == (1.0, 1.0, 1.0, 3)


def test_the_ratio_is_the_geometric_mean_of_the_rounds_ratios():
    # drift between rounds (100 -> 400) cancels: each round is compared with its own base
    got = paired_ratio([100.0, 400.0], [90.0, 400.0 * 0.95])
    assert got.ratio == pytest.approx(math.sqrt(0.90 * 0.95))
    assert got.low == pytest.approx(0.90) and got.high == pytest.approx(0.95)


def test_the_interval_holds_the_ratio_narrows_with_rounds_and_repeats():
    noisy = [0.97, 1.02, 0.99, 1.01, 0.98, 1.00, 1.03, 0.96]
    few = paired_ratio([1.0] * 4, noisy[:4])
    many = paired_ratio([1.0] * 32, noisy * 4)
    assert few.low <= few.ratio <= few.high and many.low <= many.ratio <= many.high
    assert many.high - many.low < few.high - few.low
    assert paired_ratio([1.0] * 32, noisy * 4) == many  # a fixed seed: the same figures agree
    assert many.text().startswith(f"{many.ratio:.3f} (")


def test_a_run_that_misses_a_target_is_told_from_one_within_it():
    # 20 rounds 3 % down with 1 % spread: the whole interval lies below 0.99
    rounds = [0.97 + 0.01 * ((i % 3) - 1) for i in range(20)]
    assert paired_ratio([1.0] * 20, rounds).high < 0.99


def test_mistakes_are_refused():
    with pytest.raises(ValueError, match="one pair a round"):
        paired_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="above zero"):
        paired_ratio([0.0], [1.0])
    with pytest.raises(ValueError, match="between 0 and 1"):
        paired_ratio([1.0], [1.0], confidence=1.5)
    assert paired_ratio([2.0], [1.0]).ratio == pytest.approx(0.5)


def test_the_a_a_check_tells_a_runs_resolution():
    from benchmarks.bench_tracing import resolution

    assert resolution(None) is None
    held = resolution(Interval(1.005, 0.987, 1.024, 16))
    assert "1.005 (0.987-1.024)" in held and "(3.7%)" in held and "not resolved" in held
    missed = resolution(Interval(0.954, 0.944, 0.965, 2))
    assert "missing 1" in missed and "none of them is to be trusted" in missed
