"""Chart builders: expected traces, reference lines and event markers."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from batchscope.presentation import charts
from batchscope.analysis import queries
from batchscope.testing import synthetic
from batchscope.storage.db import make_engine

END = 2_000_000_000.0


@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    engine = make_engine(f"sqlite:///{tmp_path_factory.mktemp('c') / 'c.db'}")
    sc = synthetic.SCENARIOS["preemption"].with_(
        duration_s=120, batches_per_s=4, oom_events=2,
        settings_changes=((0.5, {"max_num_seqs": 16}),))
    synthetic.generate(engine, sc, end_s=END)
    out = queries.live_bundle(engine, queries.Window(END - 120, END + 1, sc.model))
    engine.dispose()
    return out


def names(fig):
    return [t.name for t in fig.data]


def test_every_chart_is_built(bundle):
    figs = charts.build_all(bundle, slo_ms=20)
    assert set(figs) == set(charts.CHARTS)


def test_latency_chart_has_percentiles_slo_and_markers(bundle):
    fig = charts.latency(bundle["requests_t"], bundle["events"], slo_ms=20)
    assert names(fig)[:4] == ["p50", "p95", "p99", "SLO"]
    assert list(fig.data[3].y) == [20, 20]
    settings = next(t for t in fig.data if t.name == charts.SETTINGS_MARKER)
    faults = next(t for t in fig.data if t.name == charts.FAULT_MARKER)
    assert len(settings.x) == 1 and "max_num_seqs: 24 → 16" in settings.hovertext[0]
    assert len(faults.x) == 2 and "out of memory" in faults.hovertext[0]
    # one dotted vertical line per marker
    assert len(fig.layout.shapes) == 3


def test_time_charts_all_carry_markers(bundle):
    figs = charts.build_all(bundle)
    for key in ("latency", "throughput", "wait_compute", "queue_depth", "device", "generation"):
        assert charts.SETTINGS_MARKER in names(figs[key]), key
        assert charts.FAULT_MARKER in names(figs[key]), key


def test_batch_size_histogram_marks_configured_max(bundle):
    fig = charts.batch_sizes(bundle["batch_sizes"], 16.0)
    assert fig.data[0].type == "bar"
    assert sum(fig.data[0].y) == int(bundle["headline"].iloc[0]["batches"])
    assert [s.x0 for s in fig.layout.shapes] == [16.0]


def test_wait_vs_compute_is_stacked(bundle):
    fig = charts.wait_vs_compute(bundle["batches_t"])
    assert names(fig) == ["queue wait", "compute"]
    assert {t.stackgroup for t in fig.data} == {"one"}


def test_generation_views(bundle):
    fig = charts.generation(bundle["generation_t"])
    assert {"running", "waiting", "tokens/step", "blocks used", "preemptions"} <= set(names(fig))
    lat = charts.generation_latency(bundle["generation"])
    assert names(lat) == ["p50", "p95", "p99"]
    assert list(lat.data[0].x) == ["time to first token", "time per output token"]


def test_empty_data_gives_annotated_empty_figures():
    empty = pd.DataFrame(columns=["t", "latency_p50", "latency_p95", "latency_p99"])
    fig = charts.latency(empty)
    assert not fig.data and fig.layout.annotations[0].text == "no data in this window"
    assert not charts.padding(pd.DataFrame()).data


def test_settings_marker_hover_survives_bad_details():
    ev = pd.DataFrame([{"at": END, "kind": "settings_change", "message": "settings v2",
                        "details_json": "not json"},
                       {"at": END, "kind": "settings_change", "message": "m",
                        "details_json": json.dumps({"old": {"policy": "static"},
                                                    "new": {"policy": "dynamic"},
                                                    "requested_by": "dashboard"})}])
    fig = charts.add_event_markers(charts._base("t"), ev, y=1.0)
    assert fig.data[0].hovertext[0] == "settings v2"
    assert fig.data[0].hovertext[1] == "policy: static → dynamic<br>by dashboard"


def test_autopilot_reasons_are_markers_of_their_own():
    reason = "p99 480 ms > SLO 400 ms, a batch of 32 takes about 384 ms: max_batch_size 32 -> 16"
    ev = pd.DataFrame([{"at": END, "kind": "autopilot", "message": reason, "details_json": "{}"},
                       {"at": END, "kind": "rejected", "message": "12 rejected",
                        "details_json": "{}"}])
    fig = charts.add_event_markers(charts._base("t"), ev, y=1.0)
    assert names(fig) == [charts.AUTOPILOT_MARKER]
    assert list(fig.data[0].hovertext) == [reason]


def test_compare_is_relative_to_before(bundle):
    h = bundle["headline"]
    fig = charts.compare(h, h)
    assert names(fig) == ["before", "after"]
    assert all(v == pytest.approx(1.0) for v in fig.data[1].y if v is not None)
