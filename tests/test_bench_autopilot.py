"""The changing-traffic benchmark's own arithmetic: phases, violation seconds, and the
fixed setting a session recommends, written so that ``batchscope serve --set`` reads it
back as the same settings."""

from __future__ import annotations

import math

import pytest

from batchscope.load.loadgen import Tally
from benchmarks.bench_autopilot import fixed_text, parse_phases, phased_arrivals, summarize
from runtime.api.config import BatchingConfig
from runtime.tools.cli import build_parser, load_models, model_settings


def test_phases_are_parsed_and_checked():
    assert parse_phases("20:5,60:10") == [(20.0, 5.0), (60.0, 10.0)]
    for bad in ("", "20", "20:0", "-1:5", "a:b"):
        with pytest.raises(SystemExit, match="rate:seconds"):
            parse_phases(bad)


def test_arrivals_follow_each_phase_rate():
    gaps = phased_arrivals([b"x"], [(100.0, 20.0), (10.0, 20.0)], seed=3)
    t, counts = 0.0, [0, 0]
    while t < 40.0:
        _, gap = next(gaps)
        counts[int(t // 20.0)] += 1
        t += gap
    assert 1800 < counts[0] < 2200 and 150 < counts[1] < 250  # Poisson: within 5 sigma


def test_violation_seconds_count_failures_as_infinitely_late():
    tally = Tally()
    began = 100.0
    # second 0: 98 fast answers and two 503s -> its p99 is a failure: a violation
    for i in range(98):
        tally.record(200, 0.010, began + 0.01 * i + 0.010)
    tally.record(503, 0.001, began + 0.5)
    tally.record(503, 0.001, began + 0.6)
    # second 1: all within 50 ms; second 2: the slowest 2 of 100 late -> p99 late
    for i in range(100):
        tally.record(200, 0.020, began + 1.0 + 0.005 * i + 0.020)
    for i in range(100):
        latency = 0.5 if i < 2 else 0.02
        tally.record(200, latency, began + 2.0 + 0.005 * i + latency)
    row = summarize(tally, began, [(100.0, 2.0), (100.0, 1.0)], slo_ms=50.0)
    assert row["violation_s"] == 2 and row["failed"] == 2 and row["seconds"] == 3
    assert row["goodput_rps"] == pytest.approx((98 + 100 + 98) / 3.0)
    assert row["p99_ms_by_second"][0] is None  # the failure: infinitely late
    assert row["p99_ms_by_second"][1:] == [20.0, 500.0]
    assert row["p99_ms_by_phase"] == [20.0, 500.0]  # 2 failures in 200: within the 1 %
    assert not math.isnan(row["throughput_rps"])


def test_a_recommended_setting_reads_back_through_set():
    changes = {"policy": "static", "max_batch_size": 64, "max_queue_delay_ms": None,
               "preferred_batch_sizes": [2, 4, 8], "bucket_edges": [128],
               "max_batch_tokens": 2048}
    text = fixed_text(changes)
    sets = [x for pair in text.split(";") for x in ("--set", f"encoder.{pair}")]
    args = build_parser().parse_args(["serve", "--model", "encoder", *sets])
    models, generation = load_models(["encoder"])
    config = model_settings(args, models, generation)["encoder"]
    assert isinstance(config, BatchingConfig)
    assert (config.policy, config.max_batch_size, config.max_queue_delay_ms) == ("static", 64, None)
    assert tuple(config.preferred_batch_sizes) == (2, 4, 8)
    assert tuple(config.bucket_edges) == (128,)  # a one-item list stays a list
    assert config.max_batch_tokens == 2048
    assert fixed_text({}) == ""
