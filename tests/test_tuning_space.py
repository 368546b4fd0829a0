"""The search space read from a model's settings document and metadata: which settings
are tuned, the candidates (starting values always among them), the grid, and the
optimizer's parameters for the starting point."""

from __future__ import annotations

import optuna
import pytest

from batchscope.tuning.space import (AUTO, START, SearchSpace, SpaceError, SpaceOptions,
                                     edges_every, format_point, parse_values, point_key)

SETTINGS = {"policy": "adaptive", "max_batch_size": 24, "max_queue_delay_ms": 3.0,
            "preferred_batch_sizes": [8, 16], "bucket_edges": [32, 64, 128],
            "auto_bucket_count": 8, "max_queue_size": 100}
VARLEN = {"name": "v", "inputs": [{"name": "X", "datatype": "INT64", "shape": [-1]}]}
FIXED = {"name": "f", "inputs": [{"name": "X", "datatype": "FP32", "shape": [8]}]}


def doc(**changes) -> dict:
    return {"model": "m", "kind": "request", "version": 3, "settings": {**SETTINGS, **changes}}


def test_starting_values_are_always_candidates_and_come_first():
    space = SearchSpace.for_model(doc(), VARLEN, longest_length=100)
    assert space.start == {k: SETTINGS[k] for k in ("policy", "max_batch_size",
                                                    "max_queue_delay_ms", "preferred_batch_sizes",
                                                    "bucket_edges")}
    assert space.policies == ("adaptive", "dynamic", "static")
    assert space.max_batch_sizes == (4, 8, 16, 24, 32, 64, 128)
    assert space.queue_delays_ms == (None, 1.0, 2.0, 3.0, 5.0, 10.0)
    assert space.preferred == (START, "none", "powers_of_two")
    assert space.bucket_edges[START] == (32, 64, 128) and space.bucket_edges[AUTO] is None
    assert space.bucket_edges["16"] == (16, 32, 48, 64, 80, 96, 112)  # to the longest, 100
    grid = space.grid()
    assert grid[0] == space.start and len({point_key(p) for p in grid}) == len(grid)
    # the delay only varies under the dynamic policy; preferred sizes never exceed the max
    assert {p["max_queue_delay_ms"] for p in grid if p["policy"] != "dynamic"} == {3.0}
    assert all(max(p["preferred_batch_sizes"] or [0]) <= p["max_batch_size"] for p in grid)


def test_a_fixed_length_model_has_no_bucket_edges_and_settings_it_lacks_are_left_out():
    settings = {k: v for k, v in SETTINGS.items() if k != "preferred_batch_sizes"}
    space = SearchSpace.for_model({"model": "m", "settings": settings}, FIXED)
    assert "bucket_edges" not in space.start and "preferred_batch_sizes" not in space.start
    assert space.bucket_edges == {} and space.preferred == ()
    assert space.size() == 7 * (1 + 1 + 6)   # sizes x (adaptive, static, dynamic x 6 delays)


def test_the_optimizer_picks_points_of_the_same_space():
    space = SearchSpace.for_model(doc(), VARLEN, longest_length=100)
    fixed = optuna.trial.FixedTrial(space.start_params())
    assert space.suggest(fixed) == space.start
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1))
    keys = {point_key(p) for p in space.grid()}
    for _ in range(50):
        assert point_key(space.suggest(study.ask())) in keys


def test_options_and_documents_that_cannot_be_searched_are_refused():
    with pytest.raises(SpaceError, match="autopilot"):
        SearchSpace.for_model(doc(autopilot_slo_p99_ms=40.0), VARLEN)
    with pytest.raises(SpaceError, match="tuning covers request models"):
        SearchSpace.for_model({"model": "g", "settings": {"max_num_seqs": 4}}, FIXED)
    with pytest.raises(SpaceError, match="max_batch_size=0"):
        SpaceOptions(max_batch_sizes=(0, 8)).check()
    with pytest.raises(SpaceError, match="use some of"):
        SpaceOptions(policies=("eager",)).check()
    assert parse_values("none,2,5", "delay", "--queue-delays-ms") == (None, 2.0, 5.0)
    with pytest.raises(SpaceError, match="is not understood"):
        parse_values("2,x", "int", "--max-batch-sizes")


def test_edges_and_points_in_words():
    assert edges_every(32, 100) == [32, 64, 96, 128]
    assert len(edges_every(1, 10_000)) <= 64
    assert format_point({"max_batch_size": 64, "max_queue_delay_ms": None,
                         "bucket_edges": [16, 32], "preferred_batch_sizes": []}) == (
        "max_batch_size=64, max_queue_delay_ms=null, bucket_edges=16,32, preferred_batch_sizes=[]")


def test_a_variable_length_model_tunes_its_token_limit_from_the_longest_length():
    space = SearchSpace.for_model(doc(max_batch_tokens=300), VARLEN, longest_length=100)
    # no limit, 4/8/16 times the longest length, and the starting value
    assert space.batch_tokens == (None, 300, 400, 800, 1600)
    assert space.start["max_batch_tokens"] == 300
    assert {p["max_batch_tokens"] for p in space.grid()} == {None, 300, 400, 800, 1600}
    assert space.suggest(optuna.trial.FixedTrial(space.start_params())) == space.start
    assert "max_batch_tokens null,300,400,800,1600" in space.describe()
    # asked for by value, or not tuned at all (the starting limit stays in every point)
    chosen = SearchSpace.for_model(doc(max_batch_tokens=None), VARLEN,
                                   options=SpaceOptions(batch_tokens=(512,)))
    assert chosen.batch_tokens == (None, 512)
    kept = SearchSpace.for_model(doc(max_batch_tokens=300), VARLEN,
                                 options=SpaceOptions(batch_tokens=()))
    assert kept.batch_tokens == () and {p["max_batch_tokens"] for p in kept.grid()} == {300}
    assert kept.size() * 5 == space.size()
    # a fixed-shape model ignores the limit, so it is not searched
    fixed = SearchSpace.for_model(doc(max_batch_tokens=300), FIXED)
    assert fixed.batch_tokens == () and "max_batch_tokens" not in fixed.start
    with pytest.raises(SpaceError, match="max_batch_tokens"):
        SpaceOptions(batch_tokens=(0,)).check()
    assert parse_values("none,512", "int_or_none", "--batch-tokens") == (None, 512)
