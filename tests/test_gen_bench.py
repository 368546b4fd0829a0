"""The generation benchmark on a tiny workload: both modes run the same work."""

from __future__ import annotations

import pytest

from benchmarks.bench_generation import BenchSettings, make_workload, percentile, run_benchmark
from benchmarks.common import torch_threads

pytestmark = pytest.mark.timeout(120)


def test_workload_is_seeded_and_within_ranges():
    a = make_workload(30, seed=3, prompt_range=(4, 20), output_range=(5, 9), arrival="poisson",
                      rate_per_s=10.0)
    assert a == make_workload(30, seed=3, prompt_range=(4, 20), output_range=(5, 9),
                              arrival="poisson", rate_per_s=10.0)
    assert all(4 <= len(j.prompt_ids) <= 20 and 5 <= j.max_new_tokens <= 9 for j in a)
    assert [j.arrival_s for j in a] == sorted(j.arrival_s for j in a) and a[-1].arrival_s > 0
    assert all(j.arrival_s == 0 for j in make_workload(5, arrival="burst"))


def test_percentile_picks_the_nearest_rank():
    assert percentile([3, 1, 2, 4, 5], 50) == 3
    assert percentile(list(range(101)), 99) == 99


def test_both_modes_do_the_same_work_and_static_needs_more_steps():
    settings = BenchSettings(requests=16, prompt_min=4, prompt_max=40, output_min=2,
                             output_max=40, repeats=1, num_cache_blocks=40, max_num_seqs=8,
                             n_layers=1)
    with torch_threads(1):
        result = run_benchmark(settings)
    runs = {r["mode"]: r for r in result["runs"]}
    assert set(runs) == {"continuous", "static"}
    assert runs["continuous"]["output_tokens"] == runs["static"]["output_tokens"]
    assert runs["continuous"]["requests"] == runs["static"]["requests"] == 16
    # with all requests there from the start the step counts do not depend on timing:
    # static batches wait for their longest member, so they take more steps with fewer
    # sequences in each
    assert runs["static"]["steps"] > runs["continuous"]["steps"]
    assert runs["static"]["mean_seqs_per_step"] < runs["continuous"]["mean_seqs_per_step"]
    assert runs["static"]["preemptions"] == 0
    assert set(result["ratios"]) >= {"throughput_continuous_over_static",
                                     "p99_latency_static_over_continuous"}


def test_chunked_prefill_benchmark_slices_the_long_prompt_and_keeps_the_tokens(capsys):
    import json

    from benchmarks.bench_chunked_prefill import main

    with torch_threads(1):
        assert main(["--long-prompt", "256", "--budget", "64", "--output", "40", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["outputs_identical"] is True
    # the whole prompt lands in one step; chunked, it takes one slice of the budget a step
    assert result["whole"]["gaps"] == 8 and result["chunked"]["gaps"] >= 8 * (256 // 64)
