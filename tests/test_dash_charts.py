"""Chart builders: expected traces, reference lines and event markers."""

from __future__ import annotations

import json

import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
import pytest

from batchscope.presentation import charts, fleet_charts
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
    assert {"running", "waiting", "prefill tokens/step", "decode tokens/step", "blocks used",
            "preemptions"} <= set(names(fig))
    lat = charts.generation_latency(bundle["generation"])
    assert names(lat) == ["p50", "p95", "p99"]
    assert list(lat.data[0].x) == ["time to first token", "time per output token"]


def test_empty_data_gives_annotated_empty_figures():
    empty = pd.DataFrame(columns=["t", "latency_p50", "latency_p95", "latency_p99"])
    fig = charts.latency(empty)
    assert not fig.data and fig.layout.annotations[0].text == "no data in this window"
    assert fig.layout.xaxis.visible is False and fig.layout.yaxis.visible is False
    device = charts.device(pd.DataFrame())
    assert device.layout.yaxis2.visible is False  # every axis of a grid
    assert not charts.padding(pd.DataFrame()).data


def first_second(bundle) -> dict:
    """The bundle as a runtime started a second ago gives it: each time series' last
    row, the events of its last second."""
    last = bundle["requests_t"]["t"].max()
    events = bundle["events"][bundle["events"]["at"] > last - 1]
    return {**{k: (v.iloc[-1:] if k.endswith("_t") else v) for k, v in bundle.items()},
            "events": events}


def test_a_window_just_begun_spans_a_readable_time(bundle):
    """One summary row a series (the first second of a runtime) is drawn over
    ``MIN_SPAN_S`` ending just after it, each lone point marked; a longer window keeps
    plotly's own range."""
    short = charts.build_all(first_second(bundle), slo_ms=20)
    full = charts.build_all(bundle, slo_ms=20)
    for key in ("latency", "throughput", "wait_compute", "queue_depth", "device", "generation"):
        fig = short[key]
        lo, hi = (pd.Timestamp(v) for v in fig.layout.xaxis.range)
        assert (hi - lo).total_seconds() == pytest.approx(charts.MIN_SPAN_S), key
        xs = [pd.Timestamp(x) for tr in fig.data if tr.x is not None for x in tr.x]
        assert lo <= min(xs) and max(xs) < hi, key
        lone = [tr for tr in fig.data if tr.type == "scatter" and tr.x is not None
                and len(tr.x) == 1 and "lines" in (tr.mode or "")]
        assert lone and all("markers" in tr.mode for tr in lone), key
        assert full[key].layout.xaxis.range is None, key
        assert all(tr.mode != "lines+markers" for tr in full[key].data
                   if tr.name in ("p50", "served req/s", "queue wait", "mean", "running")), key


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
    # each label in its own unit: served req/s a rate, latencies and waits milliseconds
    row = h.iloc[0]
    labels = dict(zip(fig.data[0].x, fig.data[0].text))
    assert labels["served req/s"] == f"{row['ok_per_s']:.1f}"
    assert labels["p99 latency"] == f"{row['latency_p99'] * 1000:.1f} ms"
    assert labels["mean queue wait"] == f"{row['queue_wait_mean_s'] * 1000:.1f} ms"


def fleet_frames():
    timeline = pd.DataFrame({"instance_id": ["a", "a", "b"], "t": [END, END + 60, END],
                             "ok_per_s": [3.0, 4.0, 1.5]})
    table = pd.DataFrame({"instance_id": ["a", "b"], "latency_p50_s": [0.01, 0.02],
                          "latency_p99_s": [0.05, 0.09]})
    return timeline, table, {"latency_p50_s": 0.012, "latency_p99_s": 0.08}


def every_figure(bundle) -> dict:
    figs = dict(charts.build_all(bundle, slo_ms=20))
    empty = {k: v.iloc[:0] for k, v in bundle.items()}
    nothing = charts.build_all({**empty, "headline": bundle["headline"]})
    figs.update({f"empty {k}": v for k, v in nothing.items()})
    begun = charts.build_all(first_second(bundle), slo_ms=20)
    figs.update({f"begun {k}": v for k, v in begun.items()})
    timeline, table, fleet_row = fleet_frames()
    figs["fleet_throughput"] = fleet_charts.throughput_by_instance(timeline)
    figs["fleet_latency"] = fleet_charts.latency_by_instance(table, fleet_row)
    figs["compare"] = charts.compare(bundle["headline"], bundle["headline"])
    return figs


def test_every_figure_passes_plotly_validation(bundle):
    """The figures are assembled without plotly checking their layout (for speed); built
    again with every check on, each is accepted and comes out the same."""
    for key, fig in every_figure(bundle).items():
        spec = fig.to_dict()
        checked = go.Figure(spec)  # raises ValueError on anything plotly does not know
        assert json.loads(pio.to_json(checked)) == json.loads(pio.to_json(fig)), key
        assert spec["layout"]["template"] == pio.templates["plotly_white"].to_plotly_json(), key


def test_reference_lines_are_what_plotly_would_draw():
    line = dict(color="#d62728", dash="dash")
    fig = charts._lines(charts._base("t"), [charts._vline(16.0, line, "max 16"),
                                            charts._hline(0.5, line, "fleet p99"), charts._vline(3.0, line)])
    ref = charts._base("t")
    ref.add_vline(x=16.0, line=line, annotation_text="max 16", annotation_position="top")
    ref.add_hline(y=0.5, line=line, annotation_text="fleet p99", annotation_position="top left")
    ref.add_vline(x=3.0, line=line)
    assert fig.to_dict()["layout"]["shapes"] == ref.to_dict()["layout"]["shapes"]
    assert fig.to_dict()["layout"]["annotations"] == ref.to_dict()["layout"]["annotations"]


def test_grids_are_plotly_subplots(bundle):
    """The device and generation charts keep make_subplots' axes: the memory on a second
    y axis, the four generation panels on their own axes with their titles."""
    device = charts.device(bundle["device_t"], bundle["events"])
    assert device.layout.yaxis2.overlaying == "y" and device.layout.yaxis2.side == "right"
    assert {t.yaxis for t in device.data if "memory" in (t.name or "")} == {"y2"}
    gen = charts.generation(bundle["generation_t"])
    assert [a.text for a in gen.layout.annotations] == list(charts.GENERATION_PANELS)
    axes = {t.name: (t.xaxis, t.yaxis) for t in gen.data}
    assert axes["decode tokens/step"] == ("x2", "y2") and axes["preemptions"] == ("x4", "y4")
    assert gen.layout.xaxis.matches == "x3"


def test_every_chart_reuses_the_template_and_grids(bundle):
    """A live refresh hands every figure the template and subplot grids made once (it
    took 15-45 ms a figure while plotly built and checked the template each time; the
    time is measured by ``benchmarks/bench_dashboard.py``): three more refreshes make
    neither again."""
    charts.build_all(bundle, slo_ms=20)  # the template and grids are made once
    template, grids = charts._template.cache_info(), charts._grid_json.cache_info()
    for _ in range(3):
        charts.build_all(bundle, slo_ms=20)
    assert charts._template.cache_info().misses == template.misses
    assert charts._template.cache_info().hits > template.hits
    assert charts._grid_json.cache_info().misses == grids.misses
