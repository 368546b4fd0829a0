"""Bucket edges derived from the observed lengths: the dynamic programme on known
distributions, and the batcher that refreshes them as traffic changes."""

from __future__ import annotations

import itertools
import random

import pytest

from runtime.api.config import BatchingConfig
from runtime.core.batcher import Batcher
from runtime.core.clock import FakeClock
from runtime.core.edges import DERIVATION_EVERY, FIRST_DERIVATION_AFTER, INITIAL_EDGES
from runtime.core.queues import (EXACT_LENGTHS, MAX_CANDIDATES, OVERFLOW, LengthCounts,
                                 derive_edges, expected_padding, length_bin)
from runtime.core.request import PendingRequest


# -- the search -----------------------------------------------------------------------------
def brute_force(counts: dict[int, float], k: int) -> float:
    """The least expected padding over every choice of at most k edges (the last one at
    the longest length)."""
    xs = sorted(counts)
    best = float("inf")
    for r in range(k):
        for inner in itertools.combinations(xs[:-1], r):
            best = min(best, expected_padding((*inner, xs[-1]), counts))
    return best


def test_the_edges_are_optimal_on_small_random_distributions():
    rng = random.Random(7)
    for _ in range(300):
        xs = rng.sample(range(1, 60), rng.randint(1, 9))
        counts = {x: float(rng.randint(1, 9)) for x in xs}
        k = rng.randint(1, 5)
        edges = derive_edges(counts, k)
        assert len(edges) <= k and edges[-1] == max(xs) and list(edges) == sorted(set(edges))
        assert set(edges) <= set(xs)
        assert expected_padding(edges, counts) == pytest.approx(brute_force(counts, k))


def test_uniform_lengths_get_evenly_spaced_edges():
    counts = {x: 1.0 for x in range(8, 129)}
    edges = derive_edges(counts, 8)
    assert edges == (22, 37, 52, 67, 82, 97, 112, 128)
    # far less padding than the old fixed edges (about 7 tokens a request instead of 23)
    assert expected_padding(edges, counts) < 0.35 * expected_padding((32, 64, 128, 256), counts)


def test_two_clusters_get_one_edge_each_and_no_padding():
    counts = {10: 500.0, 100: 500.0}
    assert derive_edges(counts, 2) == (10, 100)
    assert expected_padding((10, 100), counts) == 0.0
    assert derive_edges(counts, 1) == (100,)
    assert expected_padding((100,), counts) == 45.0


def test_as_many_edges_as_lengths_means_every_length_is_an_edge():
    assert derive_edges({5: 1.0, 9: 2.0, 30: 1.0}, 8) == (5, 9, 30)
    assert derive_edges({}, 4) == ()
    with pytest.raises(ValueError, match="at least 1"):
        derive_edges({5: 1.0}, 0)


def test_a_skewed_distribution_puts_the_edges_where_the_padding_is():
    # most requests short, a few long ones spread wide: the tail holds the padding
    counts = {x: 100.0 for x in range(10, 31)} | {x: 1.0 for x in range(31, 513)}
    edges = derive_edges(counts, 4)
    assert edges == (31, 191, 351, 512)
    even = (128, 256, 384, 512)
    assert expected_padding(edges, counts) < 0.5 * expected_padding(even, counts)
    # a tight long cluster instead: one edge for it, the rest among the short ones
    counts = {x: 100.0 for x in range(10, 31)} | {500: 50.0}
    assert derive_edges(counts, 4)[-1] == 500 and derive_edges(counts, 4)[-2] == 30


def test_many_distinct_lengths_are_merged_before_the_search():
    rng = random.Random(1)
    counts: dict[int, float] = {}
    for _ in range(20_000):
        key = length_bin(rng.randint(1, 200_000))
        counts[key] = counts.get(key, 0.0) + 1.0
    assert len(counts) > MAX_CANDIDATES
    edges = derive_edges(counts, 8)
    assert len(edges) == 8 and edges[-1] == max(counts)
    assert expected_padding(edges, counts) < expected_padding((edges[-1],), counts)


def test_length_bins_are_exact_up_to_256_then_about_two_percent_wide():
    assert [length_bin(n) for n in (1, 7, 256)] == [1, 7, 256]
    previous = EXACT_LENGTHS
    for n in range(257, 50_000, 97):
        upper = length_bin(n)
        assert upper >= n and upper <= n * 1.021 + 1 and upper >= previous
        previous = upper


def test_length_counts_fade():
    counts = LengthCounts()
    for n in (10, 10, 300):
        counts.add(n)
    assert counts.counts == {10: 2.0, length_bin(300): 1.0} and counts.total == 3.0
    counts.decay(0.5)
    assert counts.counts[10] == 1.0 and counts.total == 1.5
    for _ in range(10):
        counts.decay(0.5)
    assert counts.counts == {} and counts.total == 0.0


# -- the batcher ------------------------------------------------------------------------------
def submit(b: Batcher, clock: FakeClock, lengths) -> list[PendingRequest]:
    out = []
    for n in lengths:
        req = PendingRequest(None, length=n, priority=1, arrived_s=clock.now())
        b.submit(req, clock.now())
        out.append(req)
    return out


def drain(b: Batcher, clock: FakeClock) -> None:
    while b.next_batch(clock.now()) is not None:
        pass


def make(**changes) -> tuple[Batcher, FakeClock]:
    config = BatchingConfig().with_changes({"max_queue_size": 100_000, **changes})
    return Batcher("enc", config, variable_length=True), FakeClock()


def test_derived_edges_start_from_the_initial_ones_then_follow_the_lengths():
    b, clock = make()
    assert b.config.bucket_edges is None and b.bucket_edges == INITIAL_EDGES
    rng = random.Random(2)
    queued = submit(b, clock, [rng.randint(8, 128) for _ in range(FIRST_DERIVATION_AFTER - 1)])
    assert b.bucket_edges == INITIAL_EDGES and b.edge_changes == 0
    queued += submit(b, clock, [rng.randint(8, 128)])
    edges = b.bucket_edges
    assert b.edge_changes == 1 and len(edges) == 8 and edges[-1] <= 128
    assert edges[0] < 32  # finer than the initial edges
    # the queued requests moved to their new buckets, none lost
    assert b.depth == FIRST_DERIVATION_AFTER
    assert all(r.bucket == b.bucket_of(r.length) for r in queued)
    assert sum(b.depth_by_bucket().values()) == b.depth
    assert b.bucket_keys() == [*edges, OVERFLOW]
    drain(b, clock)
    # once settled, the same traffic does not move the edges (no churn on noise)
    submit(b, clock, [rng.randint(8, 128) for _ in range(2 * DERIVATION_EVERY)])
    drain(b, clock)
    settled, changes = b.bucket_edges, b.edge_changes
    assert changes <= 2
    for _ in range(3):
        submit(b, clock, [rng.randint(8, 128) for _ in range(DERIVATION_EVERY)])
        drain(b, clock)
    assert b.edge_changes == changes and b.bucket_edges == settled
    # the traffic shifts to longer inputs: the edges follow (older counts fade)
    submit(b, clock, [rng.randint(200, 300) for _ in range(3 * DERIVATION_EVERY)])
    assert b.edge_changes >= 2
    assert sum(1 for e in b.bucket_edges if e >= 200) >= 5 and b.bucket_edges[-1] >= 290


def test_fixed_edges_never_move_and_a_settings_change_switches_between_the_two():
    b, clock = make(bucket_edges=[16, 64])
    rng = random.Random(3)
    submit(b, clock, [rng.randint(8, 128) for _ in range(2 * DERIVATION_EVERY)])
    assert b.bucket_edges == (16, 64) and b.edge_changes == 0
    drain(b, clock)
    # to derived edges: the initial ones until enough lengths were seen again
    b.set_config(b.config.with_changes({"bucket_edges": None}), version=2)
    assert b.bucket_edges == INITIAL_EDGES
    submit(b, clock, [rng.randint(8, 128) for _ in range(FIRST_DERIVATION_AFTER)])
    assert b.edge_changes == 1 and len(b.bucket_edges) == 8
    # fewer derived edges: searched again at once from the counts kept
    b.set_config(b.config.with_changes({"auto_bucket_count": 3}), version=3)
    assert len(b.bucket_edges) == 3
    # back to fixed edges
    b.set_config(b.config.with_changes({"bucket_edges": [32]}), version=4)
    assert b.bucket_edges == (32,) and b.bucket_keys() == [32, OVERFLOW]


def test_fixed_size_inputs_and_bucketing_off_have_no_edges():
    fixed = Batcher("mlp", BatchingConfig(), variable_length=False)
    assert fixed.bucket_edges == () and fixed.bucket_keys() == [None]
    b, clock = make(bucketing=False)
    submit(b, clock, [10] * (2 * DERIVATION_EVERY))
    assert b.bucket_keys() == [None] and b.edge_changes == 0


def test_size_caps_survive_new_edges():
    b, clock = make()
    b.set_size_cap(64, 4)  # an OOM lowered the bucket holding lengths 33..64
    submit(b, clock, [40] * 128 + [100] * 128)
    assert b.edge_changes == 1 and b.bucket_edges == (40, 100)
    # 40 fell in the old bucket 64: it keeps that cap; 100 (old bucket 128) had none
    assert b.cap(40) == 4 and b.cap(100) == b.config.max_batch_size


# -- the token limit --------------------------------------------------------------------------
def sizes_and_tokens(b: Batcher, clock: FakeClock) -> list[tuple[int, int]]:
    out = []
    while (batch := b.next_batch(clock.now())) is not None:
        out.append((len(batch.requests), batch.padded_elements))
    return out


def test_max_batch_tokens_holds_every_batch_to_the_limit_in_each_kind_of_queue():
    limit = 256
    # an edge bucket: the cap is the limit over the edge, with either padding
    for pad_to in ("batch_max", "bucket"):
        b, clock = make(bucket_edges=(32, 128), max_batch_tokens=limit, pad_to=pad_to)
        assert b.cap(32) == 8 and b.cap(128) == 2 and b.cap(OVERFLOW) == 32
        submit(b, clock, [30] * 20 + [100] * 5)
        got = sizes_and_tokens(b, clock)
        assert sum(n for n, _ in got) == 25 and all(t <= limit for _, t in got), got
        assert max(n for n, _ in got) == 8
    # no buckets: requests are taken in order while the batch, padded to its longest,
    # stays within the limit; a request longer than the limit runs alone
    b, clock = make(bucketing=False, max_batch_tokens=limit)
    submit(b, clock, [10, 20, 60, 60, 10, 300, 5, 5])
    got = sizes_and_tokens(b, clock)
    assert got == [(4, 240), (1, 10), (1, 300), (2, 10)], got


def test_without_max_batch_tokens_batches_are_held_by_size_only():
    b, clock = make(bucketing=False)
    submit(b, clock, [100] * 40)
    assert sizes_and_tokens(b, clock) == [(32, 3200), (8, 800)]
    fixed = Batcher("mlp", BatchingConfig(max_batch_tokens=4), variable_length=False)
    assert fixed.cap(None) == 32  # ignored for fixed-shape models


def test_max_batch_tokens_is_bounded_and_nullable():
    from runtime.api.config import ConfigError

    assert BatchingConfig(max_batch_tokens=None).max_batch_tokens is None
    for bad in (0, -5, 10_000_001):
        with pytest.raises(ConfigError, match="max_batch_tokens"):
            BatchingConfig(max_batch_tokens=bad)


def at_rate(b: Batcher, clock: FakeClock, lengths, per_s: float) -> None:
    for n in lengths:
        submit(b, clock, [n])
        clock.advance(1.0 / per_s)
    drain(b, clock)


def test_a_light_rate_gets_learned_edges_within_its_first_second_and_relearns_in_seconds():
    from runtime.core.edges import DERIVATION_INTERVAL_S, DERIVATION_MIN_NEW

    b, clock = make()
    rng = random.Random(5)
    per_s = 80.0  # far below FIRST_DERIVATION_AFTER requests in the first second
    first_second = int(per_s * DERIVATION_INTERVAL_S)
    assert DERIVATION_MIN_NEW <= first_second < FIRST_DERIVATION_AFTER
    at_rate(b, clock, [rng.randint(8, 64) for _ in range(first_second - 1)], per_s)
    assert b.bucket_edges == INITIAL_EDGES  # not a second yet
    at_rate(b, clock, [rng.randint(8, 64) for _ in range(2)], per_s)
    assert b.edge_changes == 1 and b.bucket_edges[-1] <= 64 and b.bucket_edges[0] < 32
    # the traffic shifts to long inputs; at 80 requests/s the edges follow within seconds
    at_rate(b, clock, [rng.randint(200, 300) for _ in range(int(per_s * 4))], per_s)
    assert sum(1 for e in b.bucket_edges if e >= 200) >= 4 and b.bucket_edges[-1] >= 290
