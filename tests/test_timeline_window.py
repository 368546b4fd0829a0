"""The Batch timeline's window: where it ends (never past the sidebar's window, nor now;
never a rerun loop), which clock it shows, the slowest-requests table's tick, the batch
number box (pure functions, then the page through AppTest)."""

from __future__ import annotations

import itertools
import json
import os
import time
from datetime import timezone
from zoneinfo import ZoneInfo

import pandas as pd
import pytest
from sqlalchemy import text

from batchscope.dashboard import timeline_decisions as decisions
from batchscope.dashboard.scope import fmt_time
from batchscope.dashboard.timeline_decisions import (WindowEnd, parse_batch_number, stale_tick,
                                                     window_end)
from batchscope.presentation import timeline_chart
from tests.factories import run_app

PAGE = "batchscope/dashboard/pages/timeline.py"


def following(at) -> bool:
    """Whether the page follows the clock: it offers to stop, not to follow."""
    keys = {b.key for b in at.button}
    assert len({"timeline_stop", "timeline_follow"} & keys) == 1, keys
    return "timeline_stop" in keys


def stop_following(at):
    at.button(key="timeline_stop").click().run()
    assert not following(at)
    return at


# -- where the window ends (pure) ---------------------------------------------------------
def test_a_window_longer_than_the_sidebar_s_is_cut_to_it_and_ends_now_not_later():
    now = 1_000_000.0
    # the probe's case: a live 30-s sidebar window, a 60-s timeline window
    assert window_end(now - 30, now, 60, now, None) == WindowEnd(now, 30.0, None)
    assert window_end(now - 30, now, 30, now, None) == WindowEnd(now, 30.0, None)  # equal
    # whatever end was wanted before (a pick, an old slider value), it ends now
    assert window_end(now - 30, now, 60, now, now - 500) == WindowEnd(now, 30.0, None)
    assert window_end(now - 30, now, 60, now, now + 500) == WindowEnd(now, 30.0, None)
    # a past custom window: it ends where the sidebar's does
    assert window_end(now - 90, now - 60, 60, now, None) == WindowEnd(now - 60, 30.0, None)
    # room to move: a slider from start + length to the end, the wanted end kept inside
    assert window_end(now - 30, now, 10, now, None) == WindowEnd(now, 10.0, (now - 20, now))
    assert window_end(now - 30, now, 10, now, now - 5).end_s == now - 5
    assert window_end(now - 30, now, 10, now, now - 29).end_s == now - 20
    assert window_end(now - 30, now, 10, now, now + 9).end_s == now
    # under a second of room: no slider
    assert window_end(now - 30, now, 29.5, now, now - 3) == WindowEnd(now, 29.5, None)


def test_the_end_decided_is_a_fixed_point_so_no_state_reruns_the_page_again():
    """The page writes the end it settles on back as the wanted end; deciding again from
    it must give the same window, or every run would move it (and rerun) once more."""
    now = 1_000_000.0
    starts = (now - 30, now - 60, now - 300, now - 3600)
    ends = (now, now - 60, now - 0.4, now + 120)  # a snapshot may end after this clock
    lengths = (1, 2, 5, 10, 29.5, 30, 60, 300)
    wanted = (None, now - 7200, now - 45, now - 10.3, now, now + 60)
    for start, end, length, want in itertools.product(starts, ends, lengths, wanted):
        if end <= start:
            continue
        at = window_end(start, end, length, now, want)
        assert at.end_s <= min(end, now)  # never in the future, never after the sidebar's
        assert at.end_s - at.length_s >= start - 1e-9  # never before the sidebar's start
        assert at.length_s == min(length, min(end, now) - start)
        if at.bounds is not None:
            lo, hi = at.bounds
            assert hi - lo >= 1.0 and lo <= at.end_s <= hi
        assert window_end(start, end, length, now, at.end_s) == at, (start, end, length, want)


def test_a_tick_in_the_slowest_table_is_stale_once_it_names_another_batch():
    picks = [("a", 7.0), ("a", 9.0), ("b", float("nan")), ("b", None)]
    assert not stale_tick(picks, [], ("a", 7))  # nothing ticked
    assert not stale_tick(picks, [1], ("a", 9))  # the row picked the batch shown
    assert stale_tick(picks, [1], ("a", 12))  # another control picked batch 12
    assert stale_tick(picks, [1], ("b", 9))  # same number, another instance
    assert stale_tick(picks, [1], None)  # the batch left the window
    assert stale_tick(picks, [2], ("a", 7)) and stale_tick(picks, [3], ("a", 7))  # no batch
    assert stale_tick(picks, [4], ("a", 7))  # the table got shorter


def test_a_batch_number_is_a_whole_number_not_below_zero():
    assert parse_batch_number(" 1234 ") == 1234 and parse_batch_number("0") == 0
    for text in ("abc", "-5", "+5", "1.5", "1e3", "²", "", "  ", "12 3"):
        assert parse_batch_number(text) is None, text


# -- one clock ----------------------------------------------------------------------------
@pytest.fixture()
def new_york():
    """The process's local time zone is America/New_York for the test."""
    was = os.environ.get("TZ")
    os.environ["TZ"] = "America/New_York"
    time.tzset()
    yield
    if was is None:
        os.environ.pop("TZ", None)
    else:
        os.environ["TZ"] = was
    time.tzset()


def test_the_chart_names_its_start_in_the_zone_it_is_given(new_york):
    t = 1_800_000_000.5  # 2027-01-15 08:00:00.500 UTC, 03:00 in New York (EST)
    assert timeline_chart.clock(t) == "08:00:00.500 UTC"  # the default stays UTC
    assert timeline_chart.clock(t, None) == "03:00:00.500 EST"  # local, as fmt_time
    assert fmt_time(t).endswith("03:00:00") and decisions.zone(t) == "EST"


def test_a_trace_download_is_named_on_the_page_s_clock_with_its_offset(new_york):
    winter, summer = 1_800_000_000.5, 1_784_000_000.0  # EST (-0500), EDT (-0400)
    assert decisions.trace_file_name(winter, ".pftrace") == \
        "batchscope-20270115T030000-0500.pftrace"
    assert fmt_time(winter) == "2027-01-15 03:00:00"  # the caption's clock, the same time
    assert decisions.trace_file_name(summer, ".json") == "batchscope-20260713T233320-0400.json"
    # the same moment in other zones: other names, so downloads from two zones never collide
    assert decisions.trace_file_name(winter, ".json", timezone.utc) == \
        "batchscope-20270115T080000+0000.json"
    assert decisions.trace_file_name(winter, ".json", ZoneInfo("Asia/Kolkata")) == \
        "batchscope-20270115T133000+0530.json"


def test_caption_axis_and_slider_show_one_clock_and_name_it(app_db, new_york):
    at = run_app("timeline")
    stop_following(at)
    assert not at.exception, [e.value for e in at.exception]
    end = at.session_state["timeline_window_end"]
    zone = decisions.zone(end)
    caption = next(c.value for c in at.caption if "batches" in c.value)
    assert caption.startswith(f"{fmt_time(end - 10)} → {fmt_time(end)} {zone} ·"), caption
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    axis = spec["layout"]["xaxis"]["title"]["text"]
    assert axis == f"seconds after {timeline_chart.clock(end - 10, None)}", axis
    assert axis.endswith(f" {zone}") and fmt_time(end - 10)[11:] in axis
    slider = at.slider(key="timeline_end")
    assert slider.label == f"Window ends at ({zone})"
    # the slider holds local wall-clock time, the caption's
    assert slider.value.strftime("%H:%M:%S") == fmt_time(end)[11:]


# -- the page (AppTest) ---------------------------------------------------------------------
def _custom_window(at, minutes: float, ago_min: float):
    next(r for r in at.radio if r.label == "Time window").set_value("custom").run()
    at.number_input(key="custom_min").set_value(minutes)
    at.number_input(key="custom_end").set_value(ago_min).run()
    at.switch_page(PAGE).run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def _settled(at) -> float:
    """The end the last run drew, checked to be the one left in session state."""
    assert not at.exception, [e.value for e in at.exception]
    end = at.session_state["timeline_window_end"]
    assert at.session_state["timeline_end"].timestamp() == pytest.approx(end, abs=1e-3)
    return end


def test_a_timeline_window_as_long_as_the_sidebar_s_with_follow_off_settles(app_db):
    """The probe's endless rerun: a live 0.5-min custom window, follow off, a 60-s (or 30-s)
    timeline window. Each run must end (AppTest raises when the script keeps rerunning),
    with the window cut to the sidebar's and no slider."""
    at = _custom_window(run_app("timeline"), 0.5, 0.0)
    stop_following(at)
    assert len(at.slider) == 1  # 10 s in 30 s: room to move
    for length in (60, 30):
        before = time.time()
        at.selectbox(key="timeline_length").set_value(length).run()
        end = _settled(at)
        # ends at the live edge (now, less the recorder's write delay), not in the future
        assert before - decisions.LIVE_LAG_S <= end <= time.time() - decisions.LIVE_LAG_S
        assert not len(at.slider)
        scope = at.session_state["scope"]
        assert abs((scope.end_s - scope.start_s) - 30.0) < 1e-6
        caption = next(c.value for c in at.caption if "batches" in c.value)
        assert caption.startswith(f"{fmt_time(end - 30)} → {fmt_time(end)}"), caption
        cut = [c.value for c in at.caption if "shorter than" in c.value]
        assert cut == ([f"The sidebar's time window is 30 s, shorter than 60 s: the timeline "
                        "shows all of it. Choose a longer time window in the sidebar to see "
                        "more."] if length == 60 else [])
        at.run()  # and again from the state it left
        _settled(at)
    at.selectbox(key="timeline_length").set_value(10).run()
    _settled(at)
    assert len(at.slider) == 1


def test_a_past_window_shorter_than_the_timeline_s_ends_where_it_does(app_db):
    at = _custom_window(run_app("timeline"), 0.5, 1.0)  # 90 s ago to 60 s ago
    assert not following(at) and at.button(key="timeline_follow").disabled
    at.selectbox(key="timeline_length").set_value(60).run()
    end = _settled(at)
    scope = at.session_state["scope"]
    assert not scope.live and end == scope.end_s  # not 30 s past it
    assert not len(at.slider) and any("shorter than 60 s" in c.value for c in at.caption)
    at.run()
    assert _settled(at) == at.session_state["scope"].end_s


def test_a_pick_by_number_clears_a_tick_in_the_slowest_table(app_db):
    at = run_app("timeline")
    first = at.session_state["timeline_slowest_rows"]["pick"].dropna().iloc[0]
    at.text_input(key="timeline_batch_number").input(str(int(first))).run()
    assert not at.exception, [e.value for e in at.exception]
    rows = at.session_state["timeline_slowest_rows"]
    row, mine = next((i, int(p)) for i, p in enumerate(rows["pick"]) if not pd.isna(p))
    with app_db.connect() as conn:  # another batch of the sidebar's window
        other = conn.execute(text("SELECT seq FROM batches WHERE seq != :s AND ended_at < :t "
                                  "ORDER BY ended_at DESC LIMIT 1"),
                             {"s": mine, "t": time.time() - 60}).scalar()
    key = next(d.key for d in at.dataframe if d.key and d.key.startswith("timeline_slowest"))
    # row `row` ticked, as its click leaves it: its batch picked
    at.session_state[key] = {"selection": {"rows": [row], "columns": [], "cells": []}}
    at.session_state["timeline_selected"] = (rows["instance_id"].iloc[row], int(mine))
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    assert list(at.session_state[key]["selection"]["rows"]) == [row]  # kept: it is shown
    assert any(f"**Batch {int(mine)}**" in m.value for m in at.markdown)
    at.text_input(key="timeline_batch_number").input(str(int(other))).run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.session_state["timeline_selected"][1] == int(other)
    now_key = next(d.key for d in at.dataframe if d.key and d.key.startswith("timeline_slowest"))
    assert now_key != key  # a new table, nothing ticked
    assert not list(at.session_state[now_key]["selection"]["rows"])


def test_a_batch_number_that_is_not_one_is_said_so(app_db):
    at = run_app("timeline")
    seq = int(at.session_state["timeline_slowest_rows"]["pick"].dropna().iloc[0])
    at.text_input(key="timeline_batch_number").input(str(seq)).run()
    for text, said in (("abc", "a batch number is a whole number ≥ 0, not 'abc'"),
                       ("-5", "a batch number is a whole number ≥ 0, not '-5'"),
                       ("9" * 25, f"there is no batch or generation step {'9' * 25} in "
                                  "this database")):
        at.text_input(key="timeline_batch_number").input(text).run()
        assert not at.exception, [e.value for e in at.exception]
        said_on_page = [w.value for w in at.warning]
        assert any(w.startswith(said) for w in said_on_page), (text, said_on_page)
        assert not at.toast  # a callback draws nothing: the page says it
        assert at.session_state["timeline_selected"][1] == seq  # the pick is kept


# -- live: where it ends, how often it refreshes, when it stops (pure) -----------------
def test_a_live_window_ends_once_the_recorder_has_written_its_rows():
    import inspect

    from batchscope.storage.recorder import Recorder
    flush = inspect.signature(Recorder.__init__).parameters["flush_interval_s"].default
    assert decisions.RECORDER_FLUSH_S == flush
    assert decisions.LIVE_LAG_S >= 2 * flush  # a flush that began just before is written


def test_the_live_cadence_stretches_with_what_a_refresh_costs():
    every = decisions.live_every_s
    assert every(None, 3.0, 2.0) is None  # not live, or paused
    assert every(2.0, None, None) == 2.0  # nothing measured yet: the sidebar's
    assert every(2.0, 0.1, None) == 2.0 and every(1.5, 0.2, None) == 1.5  # cheap
    assert every(2.0, 0.98, None) == 5.0  # 5 x 0.98 s, in whole seconds
    assert every(2.0, 1.4, 2.0) == 7.0  # outgrown: stretched at once
    # kept while the cost stays between half of it and all of it: no flapping
    assert every(2.0, 1.1, 7.0) == 7.0 and every(2.0, 0.8, 7.0) == 7.0
    assert every(2.0, 0.5, 7.0) == 3.0  # fell to half: shortened
    assert every(2.0, 0.1, 7.0) == 2.0  # down to the sidebar's
    assert every(2.0, 0.3, 1.0) == 2.0  # the sidebar's cadence went up: followed
    for refresh, cost, current in itertools.product((1.0, 1.5, 2.0), (None, 0.05, 0.3, 0.41,
                                                                      0.98, 3.3),
                                                    (None, 1.0, 2.0, 3.0, 7.0, 20.0)):
        got = every(refresh, cost, current)
        assert got >= refresh
        # what the page registers is what the region finds again: no rerun for one state
        assert every(refresh, cost, got) == got, (refresh, cost, current)


def test_a_batch_that_just_ended_is_shown_once_it_is_behind_the_live_edge():
    now, lag = 1_000_000.0, decisions.LIVE_LAG_S
    assert decisions.behind_edge_in_s(now - 5, now) == 0.0  # long behind it
    assert decisions.behind_edge_in_s(now - lag, now) == 0.0
    assert decisions.behind_edge_in_s(now - lag / 4, now) == pytest.approx(3 * lag / 4)
    assert decisions.behind_edge_in_s(now + 30, now) == lag  # never more than the lag


def test_a_refresh_costs_its_run_and_the_browser_s_drawing_and_big_windows_stop():
    assert decisions.refresh_cost_s(0.2, 0) == 0.2
    assert decisions.refresh_cost_s(0.2, 8000) == pytest.approx(
        0.2 + 8000 * decisions.DRAW_S_PER_BAR)
    assert not decisions.too_many_to_follow(decisions.LIVE_MAX_BARS)
    assert decisions.too_many_to_follow(decisions.LIVE_MAX_BARS + 1)
    said = decisions.stop_note(35_123)
    assert "35,123 batches and steps" in said and f"{decisions.LIVE_MAX_BARS:,}" in said
    assert "refused" not in said


def test_marked_requests_weigh_on_a_live_window_as_a_share_of_a_batch_each():
    """An overloaded server refuses tens of thousands of requests a second, each a mark
    the live page sends and draws at every refresh: 180,000 of them are about 10 MB."""
    per = decisions.MARKS_PER_BAR
    limit = decisions.LIVE_MAX_BARS
    assert decisions.live_load(100, 50 * per) == 150
    assert decisions.refresh_cost_s(0.2, 100, 50 * per) == pytest.approx(
        0.2 + 150 * decisions.DRAW_S_PER_BAR)
    assert not decisions.too_many_to_follow(2_000, (limit - 2_000) * per)
    assert decisions.too_many_to_follow(2_000, (limit - 2_000) * per + per)
    assert decisions.too_many_to_follow(0, 180_000)  # a 10-s window of a server refusing
    said = decisions.stop_note(2_000, 180_000)
    assert "2,000 batches and steps and 180,000 refused, expired, cancelled or bypassed " \
        "requests" in said and f"the equivalent of {2_000 + 180_000 // per:,} batches" in said
    # one mark past the limit: the equivalent said is past it too, never equal to it
    said = decisions.stop_note(limit, 1)
    assert "1 refused, expired, cancelled or bypassed request (" in said
    assert f"the equivalent of {limit + 1:,} batches" in said, said


def test_a_number_of_another_model_or_instance_says_which_and_how_to_see_it():
    note = decisions.not_found_note
    assert note("7", None, "encoder", None) == \
        "there is no batch or generation step 7 in this database"
    mlp = {"model": "mlp", "instance_id": "a"}
    said = note("40769", mlp, "encoder", None)
    assert said.startswith("batch 40769 is a batch of mlp, not of encoder") and \
        '"all models" under Models' in said and "mlp in the sidebar's Model picker" in said
    said = note("40769", mlp, "mlp", "b")
    assert said.startswith("batch 40769 ran on instance a, not on b") and "Instance" in said
    assert note("40769", mlp, None, "b").startswith("batch 40769 ran on instance a")


# -- the page's models, and what a number of another model says (AppTest) -----------------
def test_all_models_are_one_choice_away_and_a_number_of_another_model_says_so(app_db):
    from batchscope.testing import synthetic
    # an encoder of 300 batches beside the mlp's 1,200
    synthetic.generate(app_db, synthetic.SCENARIOS["healthy"].with_(
        model="encoder", duration_s=300, batches_per_s=1), end_s=time.time(), seed=5)
    with app_db.connect() as conn:
        seq = conn.execute(text("SELECT seq FROM batches WHERE model = 'mlp' AND seq > 400 "
                                "AND ended_at < :t ORDER BY ended_at DESC LIMIT 1"),
                           {"t": time.time() - 60}).scalar()
    at = run_app("timeline")
    at.selectbox(key="model").set_value("encoder").run()
    assert at.session_state["scope"].model == "encoder"
    caption = next(c.value for c in at.caption if "batches" in c.value)
    assert "· model encoder ·" in caption
    at.text_input(key="timeline_batch_number").input(str(seq)).run()
    assert not at.exception, [e.value for e in at.exception]
    said = [w.value for w in at.warning]
    assert any(w.startswith(f"batch {seq} is a batch of mlp, not of encoder") for w in said), said
    assert "timeline_selected" not in at.session_state
    # as the note says, all models: the number in the box is tried again, and lands (the
    # box acts only when its text changes, so typing it again did nothing)
    at.selectbox(key="timeline_models").set_value("all").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.session_state["timeline_selected"][1] == seq
    assert not at.warning  # the message went with the pick
    caption = next(c.value for c in at.caption if "batches" in c.value)
    assert "· all models ·" in caption
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    assert {"mlp", "encoder"} <= {t.get("name") for t in spec["data"]}  # a lane each
    assert at.session_state["scope"].model == "encoder"  # the sidebar's stays
    at.text_input(key="timeline_batch_number").input(f" {seq}").run()
    assert not at.exception, [e.value for e in at.exception]
    assert at.session_state["timeline_selected"][1] == seq
    assert any(f"**Batch {seq}** · mlp" in m.value for m in at.markdown)
    # the batch's requests: times in ms, no empty columns
    members = next(d.value for d in at.dataframe if "pick" not in d.value.columns)
    assert {"queue wait (ms)", "latency (ms)"} <= set(members.columns), members.columns
    assert not {"queue_wait_s", "latency_s", "first token (ms)", "prompt tokens",
                "output tokens"} & set(members.columns)


def test_a_batch_picked_by_a_click_leaves_the_chart_clicked_as_it_was():
    view = (100.0, 110.0, "mlp", None, 40, 0, 3)
    picked = ("inst", 7)
    assert decisions.marked(None, view, None, None) is None
    assert decisions.marked(picked, view, None, (view, None)) == picked  # by number or table
    # by a click on this view: the chart as it was drawn, its mark (none, or an older pick)
    assert decisions.marked(picked, view, ("inst", 7, view), (view, None)) is None
    assert decisions.marked(picked, view, ("inst", 7, view), (view, ("inst", 3))) == ("inst", 3)
    moved = (101.0, 111.0, *view[2:])  # the window moved since the click: marked anew
    assert decisions.marked(picked, moved, ("inst", 7, view), (view, None)) == picked
    assert decisions.marked(picked, view, ("inst", 8, view), (view, None)) == picked


def test_a_click_on_a_bar_leaves_the_chart_s_figure_as_it_was(app_db):
    """A click picks a batch; the chart drawn after it is the one clicked (the same
    figure: the browser keeps it, and the user's zoom, as they were). A pick by number
    marks the batch's point selected instead, and a click after it keeps that figure."""
    at = run_app("timeline")
    at.button(key="timeline_stop").click().run()
    assert not at.exception, [e.value for e in at.exception]

    def spec() -> dict:
        return json.loads(at.get("plotly_chart")[0].proto.spec)

    def click(inst: str, seq: int) -> None:  # what the chart's callback leaves
        at.session_state["timeline_selected"] = (inst, seq)
        at.session_state["timeline_clicked"] = (inst, seq, at.session_state["timeline_drawn"][0])
        at.run()
        assert not at.exception, [e.value for e in at.exception]
        assert any(f"**Batch {seq}**" in m.value for m in at.markdown)

    def selected_points() -> list:
        return [t["selectedpoints"] for t in spec()["data"] if "selectedpoints" in t]
    before = spec()
    rows = at.session_state["timeline_slowest_rows"].dropna()
    (inst, seq), (_, other) = [(str(i), int(p)) for i, p in rows.drop_duplicates("pick")
                               .itertuples(index=False)][:2]
    click(inst, seq)
    assert spec() == before
    at.text_input(key="timeline_batch_number").input(str(seq)).run()
    assert not at.exception, [e.value for e in at.exception]
    numbered = spec()
    assert sorted(map(len, selected_points()))[-1] == 1  # its point, the others dimmed
    click(inst, other)
    assert spec() == numbered
