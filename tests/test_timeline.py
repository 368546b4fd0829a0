"""The batch timeline: the rows of a window, its lanes, the chart and the page (AppTest)."""

from __future__ import annotations

from dataclasses import replace

import time

import numpy as np
import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from batchscope.analysis.queries import Window
from batchscope.analysis.queries.timeline import (WindowTooLarge, assign_lanes, count_rows,
                                                  timeline_rows, with_members)
from batchscope.presentation import timeline_chart
from batchscope.storage.schema import RequestRecord
from batchscope.testing import synthetic
from tests.factories import run_app


@pytest.fixture()
def filled(db):
    """20 s of an mlp at 50 batches a second and of a decoder, on SQLite and PostgreSQL."""
    engine = db
    end = 1_800_000_000.0
    synthetic.generate(engine, synthetic.SCENARIOS["healthy"].with_(
        duration_s=20, batches_per_s=50, rejected_per_s=2, expired_per_s=1), end_s=end)
    synthetic.generate(engine, synthetic.SCENARIOS["generation"].with_(duration_s=20),
                       end_s=end, seed=3)
    with Session(engine) as s:  # sequences of the decoder, each alive over many steps
        s.add_all(RequestRecord(
            instance_id="synthetic-1", model="decoder", batch_seq=None, priority=1,
            arrived_at=end - 4 + 0.1 * i, finished_at=end - 1 + 0.1 * i, queue_wait_s=0.05,
            latency_s=3.0, outcome="ok", ttft_s=0.2, tpot_s=0.01, prompt_tokens=32,
            output_tokens=280, length=32) for i in range(5))
        s.commit()
    return engine, end


def test_assign_lanes_packs_intervals_apart_in_few_rows():
    rng = np.random.default_rng(0)
    starts = rng.uniform(0, 100, 2_000)
    ends = starts + rng.exponential(1.0, 2_000)
    lanes = assign_lanes(starts, ends)
    for lane in np.unique(lanes):
        sel = np.argsort(starts[lanes == lane])
        s, e = starts[lanes == lane][sel], ends[lanes == lane][sel]
        assert (s[1:] >= e[:-1]).all()  # none overlap in one row
    # as few rows as the most intervals alive at once (greedy interval partitioning)
    points = sorted([(t, 1) for t in starts] + [(t, -1) for t in ends], key=lambda p: (p[0], p[1]))
    depth = np.cumsum([d for _, d in points]).max()
    assert lanes.max() + 1 == depth
    assert assign_lanes([], []).tolist() == []
    assert assign_lanes([0, 1, 2], [1, 2, 3]).tolist() == [0, 0, 0]  # touching is not overlap


@pytest.mark.both_backends
def test_rows_of_a_window_overlap_it_and_link_requests_to_batches(filled):
    engine, end = filled
    w = Window(end - 5, end - 2)
    rows = timeline_rows(engine, w)
    b, r = rows.batches, rows.requests
    assert len(b) and len(r) and len(rows.steps)
    assert (b["ended_at"] >= w.start_s).all() and (b["started_at"] < w.end_s).all()
    assert (r["finished_at"] >= w.start_s).all() and (r["arrived_at"] < w.end_s).all()
    assert count_rows(engine, w) == len(b) + len(r)
    ok = r[r["outcome"] == "ok"]
    starts = b.set_index(["instance_id", "seq"])["started_at"]
    linked = [starts.get((i, s)) for i, s in zip(ok["instance_id"], ok["batch_seq"])]
    known = [(x, y) for x, y in zip(linked, ok["started_at"]) if x is not None]
    assert known and all(abs(x - y) < 1e-6 for x, y in known)  # queue wait ends at batch start
    one = b.iloc[len(b) // 2]
    assert len(rows.members(one["instance_id"], int(one["seq"]))) > 0
    mine = timeline_rows(engine, Window(end - 5, end - 2, model="mlp"))
    assert set(mine.batches["model"]) == {"mlp"} and not len(mine.steps)


@pytest.mark.both_backends
def test_a_page_reads_marked_and_slowest_requests_then_a_picked_batch(filled):
    engine, end = filled
    w = Window(end - 5, end - 2)
    every = timeline_rows(engine, w)
    page = timeline_rows(engine, w, requests="marks", slowest=7)
    assert page.requests_in_window == len(every.requests) > len(page.requests)
    assert len(page.batches) == len(every.batches)
    r = every.requests
    marked = r[(r["outcome"] != "ok") | r["bypass"]]
    assert len(marked) and set(marked["id"]) <= set(page.requests["id"])
    assert set(r.nlargest(7, "latency_s")["id"]) <= set(page.requests["id"])
    assert (timeline_chart.slowest(page, 7)["latency_ms"].to_numpy()
            == timeline_chart.slowest(every, 7)["latency_ms"].to_numpy()).all()
    one = every.batches.iloc[len(every.batches) // 3]
    key = (one["instance_id"], int(one["seq"]))
    picked = with_members(engine, page, key)
    assert sorted(picked.members(*key)["id"]) == sorted(every.members(*key)["id"])
    assert picked.requests["id"].is_unique
    step = every.steps.iloc[len(every.steps) // 2]
    skey = (step["instance_id"], -int(step["id"]))
    _, in_page = timeline_chart.members(with_members(engine, page, skey), skey)
    _, in_all = timeline_chart.members(every, skey)
    assert sorted(in_page["id"]) == sorted(in_all["id"]) and len(in_all)


def test_a_pick_s_requests_are_listed_in_ms_with_generation_columns_only_when_filled(filled):
    from batchscope.dashboard.timeline import requests_table
    engine, end = filled
    rows = timeline_rows(engine, Window(end - 5, end - 2))
    b = rows.batches[rows.batches["model"] == "mlp"].iloc[0]
    _, part = timeline_chart.members(rows, (b["instance_id"], int(b["seq"])))
    table = requests_table(part)
    assert list(table.columns) == ["priority", "length", "outcome", "queue wait (ms)",
                                   "start to answer (ms)", "latency (ms)", "bypass"]
    assert table["latency (ms)"].to_numpy() == pytest.approx(1000 * part["latency_s"].to_numpy())
    # latency less queue wait (the batch's compute alone is in its header)
    assert table["start to answer (ms)"].to_numpy() == pytest.approx(
        1000 * (part["latency_s"] - part["queue_wait_s"]).to_numpy())
    step = rows.steps.iloc[len(rows.steps) // 2]  # a generation model's step: its columns
    _, part = timeline_chart.members(rows, (step["instance_id"], -int(step["id"])))
    table = requests_table(part)
    assert {"first token (ms)", "prompt tokens", "output tokens"} <= set(table.columns)
    assert table["first token (ms)"].to_numpy() == pytest.approx(1000 * part["ttft_s"].to_numpy())


def test_the_slowest_table_puts_its_latency_and_batch_first_and_names_its_units():
    from batchscope.dashboard.timeline import SLOWEST_COLUMNS
    # the sort key and the batch a row picks stay on screen at 1440 px
    assert list(SLOWEST_COLUMNS)[:3] == ["latency_ms", "batch", "batch_size"]
    labels = [c["label"] for c in SLOWEST_COLUMNS.values()]
    assert "latency (ms)" in labels and "finished (s after the window's start)" in labels
    assert not [x for x in labels if "_" in x]  # no column name as the table holds it


@pytest.mark.both_backends
def test_a_window_too_large_is_refused_with_its_size_and_an_empty_one_says_so(filled):
    engine, end = filled
    w = Window(end - 10, end)
    with pytest.raises(WindowTooLarge) as info:
        timeline_rows(engine, w, max_rows=100)
    assert info.value.rows == count_rows(engine, w) and "pick a window of at most" in str(info.value)
    # the rows lie in the last seconds of a long window: the hint is worked out over them,
    # and a window of the length it names, from where they start, is taken
    with pytest.raises(WindowTooLarge) as info:
        timeline_rows(engine, Window(end - 86_400, end), max_rows=100)
    first, _ = info.value.span
    assert first > end - 86_400 and "they lie within" in str(info.value)
    taken = timeline_rows(engine, Window(first, first + info.value.fits_s), max_rows=100)
    assert not taken.empty
    empty = timeline_rows(engine, Window(end + 3600, end + 3610))
    assert empty.empty and "no batch, request or generation step" in empty.notes[0]
    fig = timeline_chart.timeline(empty)
    assert "no batch" in fig.layout.annotations[0].text


@pytest.mark.both_backends
def test_the_chart_draws_every_batch_once_and_picks_members(filled, monkeypatch):
    engine, end = filled
    rows = timeline_rows(engine, Window(end - 3, end))
    fig = timeline_chart.timeline(rows)
    points = [t for t in fig.data if t.customdata is not None and t.mode != "lines"]
    keys = [tuple(k) for t in points for k in t.customdata]
    batch_keys = [k for k in keys if int(k[1]) >= 0]
    assert sorted(batch_keys) == sorted(zip(rows.batches["instance_id"], rows.batches["seq"]))
    step_keys = [k for k in keys if int(k[1]) < 0]
    assert len(step_keys) == len(rows.steps)
    labels = list(fig.layout.yaxis.ticktext)
    assert any("decoder · steps" in lab for lab in labels)
    assert any("refused / expired" in lab for lab in labels)
    # a window of a few hundred points draws no WebGL (a live page would use up the
    # browser's contexts); past SVG_POINTS_MAX the points are WebGL
    assert {t.type for t in fig.data} == {"scatter"}
    assert len(keys) <= timeline_chart.SVG_POINTS_MAX
    monkeypatch.setattr(timeline_chart, "SVG_POINTS_MAX", len(keys) - 1)
    assert {t.type for t in timeline_chart.timeline(rows).data if t.mode != "lines"} == {
        "scattergl"}
    inst, seq = batch_keys[0]
    members, table = timeline_chart.members(rows, (inst, int(seq)))
    assert len(table) == len(rows.members(inst, int(seq)))
    assert [t.name for t in members.data] == ["queue", "compute"]
    selected = timeline_chart.timeline(rows, selected=(inst, int(seq)))
    chosen = [tuple(t.customdata[i]) for t in selected.data for i in t.selectedpoints or ()]
    assert [(str(k), int(q)) for k, q in chosen] == [(str(inst), int(seq))]
    step = rows.steps.iloc[len(rows.steps) // 2]  # at about end - 1.5 s: all five alive
    fig, seqs = timeline_chart.members(rows, (step["instance_id"], -int(step["id"])))
    assert len(seqs) == 5 and (seqs["arrived_at"] <= step["at"]).all()
    assert [t.name for t in fig.data] == ["waiting", "prefill", "decode"]
    prefill = fig.data[1]
    # from its start until the first token, in ms (the sequences span under 10 s)
    assert fig.layout.xaxis.title.text.startswith("ms after the first arrival")
    assert prefill.x[0] == pytest.approx(150.0, abs=1e-3)
    slow = timeline_chart.slowest(rows, 5)
    assert list(slow["latency_ms"]) == sorted(slow["latency_ms"], reverse=True)
    assert slow["latency_ms"].iloc[0] == pytest.approx(1000 * rows.requests["latency_s"].max())
    # batches and steps not in the window: their sizes are empty cells, not "None"
    n = len(rows.requests)
    every, alone = (timeline_chart.slowest(r, n) for r in (
        rows, replace(rows, batches=rows.batches.iloc[:0], steps=rows.steps.iloc[:0])))
    assert str(alone["batch_size"].dtype) == str(every["batch_size"].dtype) == "Int64"
    assert alone["batch_size"].isna().all() and alone["pick"].isna().all()
    assert alone["batch"].equals(every["batch"]) and every["batch_size"].notna().any()


def test_the_page_shows_a_batch_picked_by_number(app_db):
    at = run_app("timeline")
    assert len(at.get("plotly_chart")) == 1
    assert any("Pick a batch" in i.value for i in at.info)
    caption = next(c.value for c in at.caption if "batches" in c.value)
    assert "requests" in caption and "drawn" in caption
    seq = at.session_state["timeline_slowest_rows"]["pick"].dropna().iloc[0]
    at.text_input(key="timeline_batch_number").input(str(int(seq))).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.session_state["timeline_selected"][1] == int(seq)
    assert len(at.get("plotly_chart")) == 2  # the timeline and the batch's members
    assert any(f"**Batch {int(seq)}**" in m.value for m in at.markdown)
    assert "timeline_follow" in {b.key for b in at.button}  # picking stopped following
    at.text_input(key="timeline_batch_number").input("99999999").run()  # no such batch
    assert not at.exception and at.session_state["timeline_selected"][1] == int(seq)


def test_going_to_an_older_batch_moves_the_window_to_it(app_db):
    with app_db.connect() as conn:  # a batch two minutes back, outside the first window
        seq, ended = conn.execute(text(
            "SELECT seq, ended_at FROM batches WHERE ended_at < :t ORDER BY ended_at DESC "
            "LIMIT 1"), {"t": time.time() - 120}).one()
    at = run_app("timeline")
    at.text_input(key="timeline_batch_number").input(str(seq)).run()
    assert not at.exception, [e.value for e in at.exception]
    end = at.session_state["timeline_end"].timestamp()
    assert end - 10 <= ended <= end
    assert any(f"**Batch {seq}**" in m.value for m in at.markdown)


def test_the_page_refuses_a_window_too_large(app_db, monkeypatch):
    from batchscope.dashboard import timeline
    monkeypatch.setattr(timeline, "PAGE_MAX_ROWS", 3)
    at = run_app("timeline")
    assert any("more than 3 can be read at once" in w.value for w in at.warning)


def test_a_batch_before_the_sidebar_s_window_is_named_not_silently_ignored(app_db):
    with app_db.connect() as conn:  # a batch two minutes back, before a 1-min window
        seq = conn.execute(text("SELECT seq FROM batches WHERE ended_at < :t ORDER BY ended_at "
                                "DESC LIMIT 1"), {"t": time.time() - 120}).scalar()
    at = run_app("timeline")
    next(r for r in at.radio if r.label == "Time window").set_value("1 min").run()
    at.text_input(key="timeline_batch_number").input(str(seq)).run()
    assert not at.exception, [e.value for e in at.exception]
    assert "timeline_selected" not in at.session_state  # nothing picked
    assert any(f"batch {seq} ran before the time window" in w.value for w in at.warning)
