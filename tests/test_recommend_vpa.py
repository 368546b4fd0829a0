"""The VPA arithmetic on known sample series: buckets, decay, percentiles, margin,
confidence, interval peaks and the bump after an OOM."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from batchscope.analysis import recommend
from batchscope.analysis.recommend import (DecayingHistogram, ExponentialBuckets, Usage,
                                           VpaOptions, interval_peaks)

DAY = 86400.0
GIB, MIB = 2 ** 30, 2 ** 20
T0 = 1_800_000_000.0
OPTS = VpaOptions()


def bucket_end(value: float, first: float, ratio: float = 1.05) -> float:
    """Independent of the code under test: where VPA's bucket holding ``value`` ends."""
    k = 0 if value < first else math.floor(math.log(value * (ratio - 1) / first + 1) / math.log(ratio))
    return first * (ratio ** (k + 1) - 1) / (ratio - 1)


def cpu_end(cores: float) -> float:
    return bucket_end(cores, OPTS.cpu_first_bucket_cores)


def mem_end(num_bytes: float) -> float:
    return bucket_end(num_bytes, OPTS.memory_first_bucket_bytes)


def test_exponential_buckets_match_vpa():
    cpu = ExponentialBuckets(1000.0, 0.001, 1.05)
    memory = ExponentialBuckets(1e12, 1e7, 1.05)
    # numBuckets = ceil(log_1.05(max * 0.05 / first + 1)) + 1
    assert cpu.count == math.ceil(math.log(1000 * 0.05 / 0.001 + 1, 1.05)) + 1 == 223
    assert memory.count == math.ceil(math.log(1e12 * 0.05 / 1e7 + 1, 1.05)) + 1 == 176
    assert cpu.find(0.0) == 0 and cpu.find(0.0009) == 0 and cpu.start(0) == 0.0
    assert cpu.start(1) == pytest.approx(0.001)
    for value in np.random.default_rng(1).uniform(0.001, 900.0, 200):
        b = cpu.find(value)
        assert cpu.start(b) <= value * (1 + 1e-12) and value < cpu.start(b + 1) * (1 + 1e-12)
    assert cpu.find(1e9) == cpu.count - 1  # past the end: the open last bucket


def test_percentile_is_the_end_of_the_bucket():
    hist = recommend.cpu_histogram(OPTS)
    hist.add(0.5, 1.0, T0)
    for p in (0.5, 0.9, 0.95):
        assert hist.percentile(p) == pytest.approx(cpu_end(0.5))
    assert recommend.cpu_histogram(OPTS).percentile(0.9) == 0.0  # empty


def test_decay_halves_the_weight_of_a_sample_a_half_life_older():
    hist = DecayingHistogram(ExponentialBuckets(1000.0, 0.001, 1.05), DAY)
    hist.add(1.0, 1.0, T0)
    hist.add(2.0, 1.0, T0 + DAY)
    hist.add(4.0, 1.0, T0 + 3 * DAY)
    old, new, newest = (hist.weights[hist.buckets.find(v)] for v in (1.0, 2.0, 4.0))
    assert new / old == pytest.approx(2.0) and newest / new == pytest.approx(4.0)


def test_decay_moves_the_median_toward_recent_samples():
    def median(spacing_s: float) -> float:
        hist = DecayingHistogram(ExponentialBuckets(1000.0, 0.001, 1.05), DAY)
        for i in range(4):  # 1, 2, 3, 4 cores, ``spacing_s`` apart
            hist.add(float(i + 1), 1.0, T0 + i * spacing_s)
        return hist.percentile(0.5)

    # at one moment the weights are equal: cumulative 1,2,3,4 of 4, half reached by the 2nd
    assert median(0.0) == pytest.approx(cpu_end(2.0))
    # a day apart they weigh 1,2,4,8 of 15: 7.5 is first reached by the 4th
    assert median(DAY) == pytest.approx(cpu_end(4.0))


def test_reference_shift_keeps_the_percentiles():
    hist = DecayingHistogram(ExponentialBuckets(1000.0, 0.001, 1.05), 3600.0)
    hist.add(1.0, 1.0, T0)
    hist.add(5.0, 1.0, T0 + 150 * 3600.0)  # 150 half-lives later: the reference moves
    assert np.isfinite(hist.weights).all()
    assert hist.percentile(0.5) == pytest.approx(cpu_end(5.0))


def cpu_usage(cores: float, days: float, per_min: int = 1) -> Usage:
    n = int(days * 1440 * per_min)
    return Usage("i", cpu=[(T0 + i * 60.0 / per_min, cores) for i in range(n)], models={"m"})


def test_cpu_estimate_target_bounds_margin_and_confidence():
    rec = recommend.recommend_for([cpu_usage(0.5, 2.0)], scope="instance", key="i", start_s=T0,
                                  end_s=T0 + 2 * DAY, options=OPTS, host_cpus=4)
    est = rec.cpu
    c = min((2 * 1440 - 1) * 60.0 / DAY, 2 * 1440 / 1440)  # span one minute short of 2 days
    assert est.confidence_days == pytest.approx(c)
    assert est.target == pytest.approx(cpu_end(0.5) * 1.15)
    assert est.lower == pytest.approx(cpu_end(0.5) * 1.15 * (1 + 0.001 / c) ** -2)
    assert est.upper == pytest.approx(cpu_end(0.5) * 1.15 * (1 + 1 / c))
    assert est.samples == 2880 and est.max_observed == 0.5
    no_margin = recommend.recommend_for([cpu_usage(0.5, 2.0)], scope="instance", key="i",
                                        start_s=T0, end_s=T0 + 2 * DAY,
                                        options=VpaOptions(margin_fraction=0.0), host_cpus=4)
    assert est.target / no_margin.cpu.target == pytest.approx(1.15)


def test_cpu_target_is_the_p90_of_a_mixed_series():
    # 80 % of the minutes at 1 core, 20 % at 3 cores: p50 at 1, p90 and p95 at 3
    u = Usage("i", cpu=[(T0 + i * 60.0, 3.0 if i % 5 == 0 else 1.0) for i in range(1440)])
    rec = recommend.recommend_for([u], scope="instance", key="i", start_s=T0, end_s=T0 + DAY,
                                  options=VpaOptions(half_life_s=1e12), host_cpus=4)
    assert rec.cpu.p50 == pytest.approx(cpu_end(1.0))
    assert rec.cpu.p90 == pytest.approx(cpu_end(3.0)) == pytest.approx(rec.cpu.p95)


def test_short_history_has_no_upper_bound_and_minimums_apply():
    rec = recommend.recommend_for([Usage("i", cpu=[(T0, 0.002)], memory=[(T0, 50 * MIB)])],
                                  scope="instance", key="i", start_s=T0, end_s=T0 + 60,
                                  options=OPTS, host_cpus=4)
    assert rec.cpu.confidence_days == 0.0 and math.isinf(rec.cpu.upper)
    assert rec.cpu.target == pytest.approx(0.025) and rec.cpu.lower == pytest.approx(0.025)
    assert rec.memory.target == pytest.approx(250 * MIB)
    assert json.loads(json.dumps(rec.to_dict(), allow_nan=False))["cpu"]["upper"] is None


def test_one_memory_peak_per_interval():
    # three days of hourly samples, each day's peak at noon: 1, 2 and 3 GiB
    samples = [(T0 + h * 3600.0, (1 + h // 24) * GIB * (1.0 if h % 24 == 12 else 0.5))
               for h in range(72)]
    peaks = interval_peaks(samples, [], OPTS)
    assert [p.value for p in peaks] == [1 * GIB, 2 * GIB, 3 * GIB]
    assert [p.window_end_s - T0 for p in peaks] == [DAY, 2 * DAY, 3 * DAY]
    rec = recommend.recommend_for([Usage("i", memory=samples)], scope="instance", key="i",
                                  start_s=T0, end_s=T0 + 3 * DAY, options=OPTS, host_cpus=None)
    # the peaks weigh 1, 2, 4 (a day apart): half of 7 is reached by the 3 GiB peak
    assert rec.memory.peaks == 3
    assert rec.memory.p50 == pytest.approx(mem_end(3 * GIB))
    flat = recommend.recommend_for([Usage("i", memory=samples)], scope="instance", key="i",
                                   start_s=T0, end_s=T0 + 3 * DAY,
                                   options=VpaOptions(half_life_s=1e12), host_cpus=None)
    assert flat.memory.p50 == pytest.approx(mem_end(2 * GIB))


def test_oom_bump():
    assert recommend.oom_bump(1.5 * GIB, OPTS) == pytest.approx(1.5 * GIB * 1.2)
    assert recommend.oom_bump(200 * MIB, OPTS) == pytest.approx(300 * MIB)  # at least +100 MiB
    samples = [(T0, 1 * GIB), (T0 + 3600, 1.2 * GIB)]
    # the failure's own figure is larger than the usage peak so far: bump that
    (peak,) = interval_peaks(samples, [(T0 + 7200, 1.5 * GIB)], OPTS)
    assert peak.value == pytest.approx(1.8 * GIB) and peak.from_oom
    # no figure at the failure: bump the interval's usage peak so far
    (peak,) = interval_peaks(samples, [(T0 + 7200, 0.0)], OPTS)
    assert peak.value == pytest.approx(1.2 * GIB * 1.2)
    # a larger usage sample later in the interval still replaces it
    (peak,) = interval_peaks(samples + [(T0 + 9000, 2 * GIB)], [(T0 + 7200, 0.0)], OPTS)
    assert peak.value == 2 * GIB and not peak.from_oom
    # the OOM raises the recommendation
    base = Usage("i", memory=samples)
    bumped = Usage("i", memory=samples, memory_ooms=[(T0 + 7200, 1.5 * GIB)])
    recs = [recommend.recommend_for([u], scope="instance", key="i", start_s=T0, end_s=T0 + DAY,
                                    options=OPTS, host_cpus=None) for u in (base, bumped)]
    assert recs[0].memory.target == pytest.approx(mem_end(1.2 * GIB) * 1.15)
    assert recs[1].memory.target == pytest.approx(mem_end(1.8 * GIB) * 1.15)
    assert recs[1].memory.oom_bumps == 1


def test_quantities_and_resources_block():
    assert recommend.cpu_quantity(0.2501) == "251m"
    assert recommend.cpu_quantity(2.0) == "2"
    assert recommend.memory_quantity(512 * MIB) == "512Mi"
    assert recommend.memory_quantity(2 * GIB + 1) == "2049Mi"
    assert recommend.memory_quantity(4 * GIB) == "4Gi"
    rec = recommend.recommend_for([cpu_usage(0.5, 2.0)], scope="instance", key="i", start_s=T0,
                                  end_s=T0 + 2 * DAY, options=OPTS, host_cpus=4)
    block = recommend.resources(rec)
    assert block["requests"]["cpu"] == recommend.cpu_quantity(rec.cpu.target)
    # the upper bound is 1.5x the target here, under the 2x cap
    assert block["limits"]["cpu"] == recommend.cpu_quantity(rec.cpu.upper)
    capped = recommend.resources(rec, VpaOptions(limit_ratio=1.2))
    assert capped["limits"]["cpu"] == recommend.cpu_quantity(1.2 * rec.cpu.target)
    with pytest.raises(ValueError, match="limit_ratio"):
        VpaOptions(limit_ratio=0.5)
    with pytest.raises(ValueError, match="target_percentile"):
        VpaOptions(target_percentile=90)
