"""The dashboard's figures agree with each other and read as what they are, each checked
on recorded data: diagnoses that do not contradict each other, per-adapter rates that add
up to the headline, bars below the top of their axis, titles that fit, a sub-millisecond
batch in milliseconds, and resource recommendations with no upper bound beyond what a
machine has."""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from batchscope.analysis import diagnosis, queries, recommend
from batchscope.analysis.usage import Usage
from batchscope.presentation import adapter_charts, charts, fleet_charts, timeline_chart
from batchscope.storage.records import BatchRow, EventRow, RequestRow
from batchscope.storage.recorder import Recorder
from batchscope.testing import synthetic

END = 2_000_000_000.0
GIB = 1024 ** 3
BUDGET_ERROR = ("MemoryBudgetExceeded: out of memory budget: a batch of 4 (length 96) needs "
                "about 3.4 MiB, memory_budget_mb=3")


def _budget_oom(at: float, *, rss: float = 2 * GIB) -> EventRow:
    """An OOM event as the runtime writes one for a batch over its memory budget."""
    details = {"batch_size": 4, "error": BUDGET_ERROR, "memory": {"rss_bytes": rss},
               "action": "split", "effective_max_batch_size": 2}
    return EventRow("synthetic-1", "encoder", at, "oom",
                    "'encoder' ran out of memory on a batch of 4: split", "error",
                    json.dumps(details))


# -- 1. small batches while the queue overflows ---------------------------------------
def test_small_batches_with_a_full_queue_name_the_limits_not_the_clients(db):
    sc = synthetic.SCENARIOS["not_forming"].with_(
        model="encoder", duration_s=120, batches_per_s=8, max_batch_size=16,
        queue_depth_start=20, queue_depth_end=30, rejected_per_s=2.0, expired_per_s=10.0,
        bucket_edges=(32, 64, 128), length_max=128)
    synthetic.generate(db, sc, end_s=END)
    rec = Recorder(db)
    for k in range(5):
        rec.put(_budget_oom(END - 100 + k * 10))
    rec.flush()
    bundle = queries.live_bundle(db, queries.Window(END - 120, END + 1, "encoder"))
    flags = {f.rule: f for f in diagnosis.diagnose(bundle)}
    assert "saturation" in flags
    assert "batches_not_forming" not in flags  # "raise client concurrency" contradicts it
    assert "queue_wait_low_load" not in flags
    capped = flags["batches_capped"]
    steps = " ".join(capped.steps)
    assert "concurrency is not what keeps batches small" in steps
    assert capped.evidence["budget_ooms"] == 5 and "memory_budget_mb" in steps
    assert capped.evidence["rejected"] > 0 and capped.evidence["queue_depth_max"] >= 20
    assert capped.evidence["padded_elements_per_batch"] > 0 and "max_batch_tokens" in steps


# -- 2. per-adapter rates over the headline's seconds ---------------------------------
def test_per_adapter_rates_add_up_to_the_headline_in_a_window_longer_than_the_data(db):
    rec = Recorder(db)
    t0 = END - 120  # two minutes of data in a fifteen-minute window
    for k in range(120 * 4):
        t = t0 + k * 0.25
        rec.put(BatchRow("rt-1", "encoder", k + 1, "dynamic", 1, 16, None, 2, 2, 2, 0.001,
                         0.002, 0.003, 0.01, t, t + 0.01, adapters=1))
        for a in (None, "enc-0"):
            rec.put(RequestRow("rt-1", "encoder", k + 1, 0, t - 0.01, t + 0.01, 0.005, 0.02,
                               "ok", adapter=a))
    rec.flush()
    bundle = queries.live_bundle(db, queries.Window(END - 900, END, "encoder"))
    head = bundle["headline"].iloc[0]
    assert head["ok_per_s"] == pytest.approx(8.0, rel=0.02)
    assert bundle["adapters"]["rps"].sum() == pytest.approx(head["ok_per_s"], rel=1e-9)
    assert bundle["adapter_slots"]["minutes"].iloc[0] == pytest.approx(head["active_s"] / 60)


# -- 3. before / after a change, just after it ----------------------------------------
def test_after_a_change_the_rate_is_over_the_time_the_after_side_covers(db):
    synthetic.generate(db, synthetic.HEALTHY.with_(duration_s=600), end_s=END)
    change = END - 24  # "after covers 0.4 min so far"
    before = queries.headline(db, queries.Window(change - 900, change, "mlp"))
    after = queries.headline(db, queries.Window(change, END, "mlp"))
    assert after["active_s"].iloc[0] <= 24
    assert after["ok_per_s"].iloc[0] == pytest.approx(before["ok_per_s"].iloc[0], rel=0.1)


# -- 4. bars inside their axes --------------------------------------------------------
def _top(fig, axis: str = "yaxis") -> float:
    return json.loads(fig.to_json())["layout"][axis]["range"][1]


def test_bars_end_below_the_top_of_their_axis():
    stats = pd.DataFrame({"priority": [0, 1, 2], "latency_p50": [0.01, 0.02, 0.1],
                          "latency_p95": [0.03, 0.05, 0.5], "latency_p99": [0.05, 0.08, math.inf]})
    fig = charts.priority(stats)
    bars = np.concatenate([np.asarray(t.y, dtype=float) for t in fig.data])
    assert not np.isinf(bars).any()  # a bar to infinity has no top
    assert _top(fig) >= 1.1 * np.nanmax(bars)
    ad = pd.DataFrame({"adapter": ["", "enc-0"], "rps": [9.5, 1.9],
                       "latency_p50": [0.05, 0.06], "latency_p99": [0.6, 0.66]})
    fig = adapter_charts.per_adapter(ad)
    layout = json.loads(fig.to_json())["layout"]
    assert _top(fig) >= 1.1 * 9.5
    assert _top(fig, "yaxis2") >= 1.1 * 660
    # the ms axis ticks by itself, not synced to the requests/s ticks (0 / 332 / 663)
    assert layout["yaxis2"]["tickmode"] == "auto"


# -- 5. padding chart's axis title -----------------------------------------------------
def test_padding_axis_title_is_short_and_the_hover_explains_it():
    pad = pd.DataFrame({"bucket": [32, 64], "batches": [5, 5], "real_elements": [10, 20],
                        "padded_elements": [20, 30], "waste_fraction": [0.5, 1 / 3]})
    fig = charts.padding(pad)
    assert len(fig.layout.yaxis.title.text) <= 12
    assert "of computed elements are padding" in fig.data[0].hovertemplate


# -- 6. resource upper bounds ------------------------------------------------------------
T0 = 1_700_000_000.0


def test_short_history_gives_no_upper_figure_but_says_how_much_is_needed():
    u = Usage("i", cpu=[(T0 + i * 60.0, 4.0) for i in range(14)],
              memory=[(T0 + i * 60.0, 2 * GIB) for i in range(14)], models={"m"})
    rec = recommend.recommend_for([u], scope="instance", key="i", start_s=T0,
                                  end_s=T0 + 900, options=recommend.VpaOptions(), host_cpus=16)
    for est in (rec.cpu, rec.memory):
        assert math.isinf(est.upper)
        assert est.upper_note == ("not enough history for an upper bound: 13 min of 1,440 "
                                  "needed")
    fig = fleet_charts.usage({"i": u.cpu}, rec.cpu)
    first, _, second = fig.layout.title.text.partition("<br>")
    assert len(first) <= 40 and "13 min of 1,440 needed" in second


def test_upper_bound_is_capped_at_what_the_host_has():
    u = Usage("i", cpu=[(T0 + i * 60.0, 3.5) for i in range(1440 * 2)],
              memory=[(T0 + i * 60.0, 3 * GIB) for i in range(1440 * 2)], models={"m"},
              host_memory_bytes=4 * GIB)
    rec = recommend.recommend_for([u], scope="instance", key="i", start_s=T0,
                                  end_s=T0 + 2 * 86400, options=recommend.VpaOptions(),
                                  host_cpus=4)
    assert rec.cpu.upper == 4 and rec.cpu.upper_note == "capped at the host's 4 CPUs"
    assert rec.memory.upper == 4 * GIB and "host's memory" in rec.memory.upper_note


def test_memory_budget_refusals_do_not_bump_the_memory_recommendation(db):
    synthetic.generate(db, synthetic.HEALTHY.with_(model="encoder", duration_s=300), end_s=END)
    rec = Recorder(db)
    for k in range(45):
        rec.put(_budget_oom(END - 250 + k, rss=20 * GIB))
    rec.flush()
    (model, *_) = recommend.recommend(db, end_s=END + 1, start_s=END - 400, host_cpus=4)
    assert model.memory is None or model.memory.oom_bumps == 0
    assert model.gpu_memory is None or model.gpu_memory.oom_bumps == 0
    assert any("45 batch(es) refused by a configured memory budget" in n for n in model.notes)


# -- 7. a sub-millisecond batch's members in milliseconds --------------------------------
def test_member_axis_of_a_short_batch_is_in_milliseconds():
    times = np.array([4.9965, 4.9990, 5.0]) + END
    axis = timeline_chart.MemberAxis.of(times, END)
    assert axis.unit == "ms" and axis.title.startswith("ms after the first arrival")
    assert axis.x(times).tolist() == pytest.approx([0.0, 2.5, 3.5], abs=1e-3)
    long = timeline_chart.MemberAxis.of(np.array([0.0, 30.0]) + END, END)
    assert long.unit == "s"
