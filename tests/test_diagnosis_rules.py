"""Each diagnosis rule fires on recorded data that shows its problem and stays quiet
on data that does not (the healthy baseline and the other problems)."""

from __future__ import annotations

import pandas as pd
import pytest

from batchscope.analysis import diagnosis, queries
from batchscope.testing import synthetic
from batchscope.storage.db import make_engine

END = 2_000_000_000.0

#: scenario -> the rules it must raise (and nothing else)
EXPECTED = {
    "healthy": set(),
    "generation": set(),
    "oom": {"oom"},
    "repeated_oom": {"oom", "repeated_oom"},
    "tail_latency": {"tail_latency"},
    "not_forming": {"batches_not_forming"},
    "wait_low_load": {"queue_wait_low_load"},
    "saturation": {"saturation"},
    "padding": {"padding_waste"},
    "diminishing": {"diminishing_returns"},
    "low_util": {"low_utilization"},
    "preemption": {"preemption_thrash"},
    "starvation": {"starvation", "tail_latency"},
}


pytestmark = pytest.mark.both_backends


@pytest.fixture(scope="module")
def bundles(backend, new_database_url):
    out = {}
    for name in EXPECTED:
        engine = make_engine(new_database_url(backend))
        sc = synthetic.SCENARIOS[name]
        synthetic.generate(engine, sc.with_(duration_s=120, batches_per_s=min(sc.batches_per_s, 8)),
                           end_s=END)
        out[name] = queries.live_bundle(engine, queries.Window(END - 120, END + 1, sc.model))
        engine.dispose()
    return out


@pytest.mark.parametrize("scenario", sorted(EXPECTED))
def test_rules_fire_exactly_on_their_problem(bundles, scenario):
    flags = diagnosis.diagnose(bundles[scenario])
    assert {f.rule for f in flags} == EXPECTED[scenario]
    for f in flags:
        assert f.severity in diagnosis.SEVERITY_ORDER and f.steps and f.evidence and f.chart


def test_flags_sorted_by_severity(bundles):
    flags = diagnosis.diagnose(bundles["repeated_oom"])
    assert [f.severity for f in flags] == sorted((f.severity for f in flags),
                                                 key=diagnosis.SEVERITY_ORDER.get)


def test_oom_evidence_names_batch_size_and_action(bundles):
    flag = diagnosis.rule_oom(bundles["oom"], diagnosis.Thresholds())
    assert flag.severity == "critical" and flag.evidence["oom_events"] == 2
    assert flag.evidence["batch_size_at_failure"] == 32
    assert "split" in flag.evidence["runtime_action"]
    assert flag.evidence["memory_peak_fraction"] > 0.9


def test_tail_latency_says_which_part_dominates(bundles):
    flag = diagnosis.rule_tail_latency(bundles["tail_latency"], diagnosis.Thresholds())
    assert flag.evidence["dominant"] == "queue wait"
    assert flag.evidence["ratio"] >= 4


def test_not_forming_states_needed_concurrency(bundles):
    flag = diagnosis.rule_batches_not_forming(bundles["not_forming"], diagnosis.Thresholds())
    assert flag.evidence["concurrency_needed"] == 32
    assert flag.evidence["requests_in_flight"] < 1
    assert "32 concurrent" in flag.steps[0]


def test_diminishing_returns_finds_knee(bundles):
    flag = diagnosis.rule_diminishing_returns(bundles["diminishing"], diagnosis.Thresholds())
    assert flag.evidence["gain"] < 1.15
    assert flag.evidence["knee_batch_size"] < flag.evidence["batch_size_large"]


def test_starvation_names_the_level(bundles):
    flag = diagnosis.rule_starvation(bundles["starvation"], diagnosis.Thresholds())
    assert flag.evidence["priority"] == 2
    assert flag.evidence["expired_fraction"] > 0.2


def test_model_starvation_from_device_share():
    share = pd.DataFrame({"model": ["a", "b"], "batches": [100, 3], "items": [800, 3],
                          "compute_total_s": [50.0, 0.2], "queue_wait_mean_s": [0.004, 1.5],
                          "share": [0.996, 0.004]})
    flag = diagnosis.rule_starvation({"model_share": share}, diagnosis.Thresholds())
    assert flag.evidence["model"] == "b"
    fair = share.assign(queue_wait_mean_s=[0.004, 0.006])
    assert diagnosis.rule_starvation({"model_share": fair}, diagnosis.Thresholds()) is None


def test_thresholds_are_respected(bundles):
    loose = diagnosis.Thresholds(tail_ratio=1000.0)
    assert diagnosis.rule_tail_latency(bundles["tail_latency"], loose) is None


def test_rules_tolerate_an_empty_window(db):
    engine = db
    bundle = queries.live_bundle(engine, queries.Window(END - 60, END))
    assert diagnosis.diagnose(bundle) == []
