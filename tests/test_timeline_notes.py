"""What the Batch timeline says, and when: a number typed that the page could not go to is
gone to once the sidebar's window holds it, and its note is always said of the window
shown; the note of why following stopped by itself goes with the view it was said of;
a picked step's header and its chart say what each count of sequences is (pure
functions on real rows, then the page through AppTest)."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from batchscope.analysis.queries import Window
from batchscope.analysis.queries.timeline import timeline_rows, with_members
from batchscope.dashboard import timeline_decisions as decisions
from batchscope.dashboard.scope import Scope, fmt_time
from batchscope.dashboard.timeline_decisions import NumberAgain, NumberTried
from batchscope.presentation import timeline_chart
from batchscope.storage.schema import GenerationStep, RequestRecord
from tests.factories import run_app

NOW = 1_800_000_000.0
SOURCE = ("sqlite:///bs.db", None)
#: batch 100, found two minutes before NOW (what ``_picked_by_number`` keeps of it)
BATCH = {"kind": "batch", "key": ("inst-1", 100), "started_at": NOW - 120.0,
         "ended_at": NOW - 119.99}


def _scope(minutes: float, *, ago_min: float = 0.0, model: str | None = "mlp",
           instance: str | None = None, db_url: str = SOURCE[0]) -> Scope:
    """The scope the sidebar builds at ``NOW`` for a window of ``minutes`` ending
    ``ago_min`` before it (live when it ends now), as ``scope.from_sidebar`` computes it."""
    end = NOW - ago_min * 60.0
    return Scope(db_url=db_url, instance=instance, model=model, start_s=end - minutes * 60.0,
                 end_s=end, live=ago_min == 0.0, snapshot=None, slo_ms=50.0)


def _again(tried: NumberTried | None, typed: str, scope: Scope,
           model: str | None = "mlp") -> NumberAgain | None:
    return decisions.number_again(tried, typed, model, scope.instance,
                                 (scope.db_url, scope.snapshot), scope.start_s, scope.end_s,
                                 scope.live)


# -- a number the page could not go to (pure) ---------------------------------------------
def test_a_batch_outside_the_sidebar_s_window_says_which_side_and_when_it_ran():
    started = BATCH["started_at"]
    when = f"it started {fmt_time(started)} {decisions.zone(started)}"
    one = _scope(1)
    said = decisions.outside_window_note("batch", "100", started, one.start_s, one.end_s, True)
    assert said == (f"batch 100 ran before the time window the sidebar sets ({when}): choose "
                    "a longer window, or a custom one that holds it, and the page goes to it")
    hour = _scope(60)
    assert decisions.outside_window_note("batch", "100", started, hour.start_s, hour.end_s,
                                        True) is None
    past = _scope(10, ago_min=30)  # 40 to 30 minutes ago: the batch ran after it
    said = decisions.outside_window_note("step", "100", started, past.start_s, past.end_s, False)
    assert said == (f"step 100 ran after the time window the sidebar sets ({when}): end that "
                    "window later, and the page goes to it")
    # a live window holds what started after its end as of its scope (the clock moved on)
    assert decisions.outside_window_note("batch", "100", one.end_s + 5, one.start_s,
                                        one.end_s, True) is None


def test_a_number_before_the_window_is_gone_to_once_a_longer_window_holds_it():
    """The reviewer's steps: 1 min, batch 100 (two minutes back) typed, then 60 min."""
    one = _scope(1)
    tried = NumberTried("100", "mlp", None, SOURCE, BATCH)
    again = _again(tried, "100", one)
    assert again.action is None and again.note.startswith("batch 100 ran before the time window")
    assert _again(tried, "100", _scope(60)) == NumberAgain("go")
    assert _again(tried, "100", _scope(5)) == NumberAgain("go")
    # a custom window in the past: the note says so of that window, never "before"
    again = _again(tried, "100", _scope(10, ago_min=30))
    assert again.action is None and again.note.startswith("batch 100 ran after the time window")
    assert _again(tried, "100", _scope(10, ago_min=1)) == NumberAgain("go")  # it holds it


def test_a_number_is_looked_up_again_only_where_the_model_instance_or_database_changed():
    hour = _scope(60)
    missing = NumberTried("100", "mlp", None, SOURCE, None)  # no batch 100 of mlp
    assert _again(missing, "100", hour) is None  # its note stands, whatever the window
    assert _again(missing, "100", hour, model=None) == NumberAgain("find")
    assert _again(missing, "100", _scope(60, instance="inst-2")) == NumberAgain("find")
    assert _again(missing, "100", _scope(60, db_url="sqlite:///other.db")) == \
        NumberAgain("find")
    found = NumberTried("100", "mlp", None, SOURCE, BATCH)
    assert _again(found, "100", _scope(1), model="encoder") == NumberAgain("find")
    # another text typed since (the box's callback handled it), or nothing kept
    assert _again(found, "101", hour) is None and _again(None, "100", hour) is None


# -- the note of why following stopped by itself (pure) -----------------------------------
def test_the_stop_note_goes_with_the_view_it_was_said_of():
    """The reviewer's steps: 15 min, Window 300 s stops following; then Window 10 s, the
    sidebar's 1 min, a custom window in the past."""
    quarter = _scope(15)
    view = decisions.following_view(quarter, "mlp", 300)
    kept = (view, decisions.stop_note(52_756))
    assert decisions.stop_note_shown(kept, view, True) == kept[1]
    assert "held 52,756 batches and steps" in kept[1]
    # the same view at a later run: the sidebar's window computed from a later clock
    later = Scope(**{**quarter.__dict__, "start_s": NOW + 1.7 - 900.0, "end_s": NOW + 1.7})
    assert decisions.stop_note_shown(kept, decisions.following_view(later, "mlp", 300.0),
                                    True) == kept[1]
    for other in (decisions.following_view(quarter, "mlp", 10),  # a shorter window
                  decisions.following_view(_scope(1), "mlp", 60),  # the sidebar's 1 min
                  decisions.following_view(quarter, None, 300),  # all models
                  decisions.following_view(_scope(15, instance="inst-2"), "mlp", 300)):
        assert decisions.stop_note_shown(kept, other, True) is None, other
    past = _scope(15, ago_min=30)  # not live: Follow live is off, so no advice to press it
    assert decisions.stop_note_shown(kept, decisions.following_view(past, "mlp", 300),
                                    False) is None
    assert decisions.stop_note_shown(None, view, True) is None


# -- a picked step: the header's counts and the chart's sequences (real rows) -------------
@pytest.fixture()
def step_2563(db):
    """The reviewer's step: 2563 ran 1 sequence with none waiting; a second sequence
    arrived while it ran and joined step 2564."""
    t0 = NOW - 10.0
    with Session(db) as s:
        s.add_all(GenerationStep(
            instance_id="gen-1", model="decoder", at=t0 + 0.02 * (i + 1), mode="continuous",
            running=1 + i, waiting=0, prefill_tokens=32 * i, decode_tokens=1, blocks_used=4,
            blocks_free=60, preemptions=0, step_s=0.02, seq=2563 + i) for i in range(2))
        s.add_all(RequestRecord(
            instance_id="gen-1", model="decoder", batch_seq=joined, priority=1,
            arrived_at=arrived, finished_at=t0 + 1.0, queue_wait_s=wait,
            latency_s=t0 + 1.0 - arrived, outcome="ok", ttft_s=0.1, tpot_s=0.01,
            prompt_tokens=32, output_tokens=90, length=32)
            for joined, arrived, wait in ((2500, t0 - 0.5, 0.01), (2564, t0 + 0.01, 0.01)))
        s.commit()
    return db, t0


def _picked(engine, t0: float, seq: int):
    rows = timeline_rows(engine, Window(t0 - 5, t0 + 5, "decoder"), requests="marks")
    step = rows.steps[rows.steps["seq"] == seq].iloc[0]
    key = (step["instance_id"], -int(step["id"]))
    rows = with_members(engine, rows, key)
    fig, part = timeline_chart.members(rows, key)
    return rows, int(step["id"]), fig, part


def test_a_step_s_header_says_what_its_counts_are_and_why_the_chart_draws_more(step_2563):
    engine, t0 = step_2563
    rows, sid, fig, part = _picked(engine, t0, 2563)
    assert "2 sequences" in fig.layout.title.text and len(part) == 2
    header = decisions.step_header(rows.steps, "gen-1", sid)
    assert header.startswith("**Step 2563** · decoder · 1 running, 0 waiting (the engine's "
                             "counts as it scheduled the step)"), header
    said = decisions.step_sequences_note(rows.steps, "gen-1", sid, part)
    assert said == ("The chart below draws 2 sequences: every one recorded alive at some "
                    "moment of the step, where the 1 running and 0 waiting above were counted "
                    "as it was scheduled. 1 of them arrived while it ran, after that count: "
                    "waiting, in neither number (each joined a later step).")
    # step 2564 ran both: the counts and the chart agree, nothing more is said
    rows, sid, fig, part = _picked(engine, t0, 2564)
    assert len(part) == 2 and decisions.step_sequences_note(rows.steps, "gen-1", sid, part) is None


def test_a_step_s_sequences_not_yet_recorded_are_said_to_be_missing(step_2563):
    engine, t0 = step_2563
    with engine.begin() as conn:  # step 2564 counted 5: three have not ended yet
        conn.execute(text("UPDATE generation_steps SET running = 5 WHERE seq = 2564"))
    rows, sid, _, part = _picked(engine, t0, 2564)
    said = decisions.step_sequences_note(rows.steps, "gen-1", sid, part)
    assert said.startswith("The chart below draws 2 sequences") and said.endswith(
        "3 counted are not drawn: a sequence is recorded when it ends, and these had not "
        "(or were not recorded).")


# -- the page (AppTest) -------------------------------------------------------------------
def _ok(at) -> None:
    assert not at.exception, [e.value for e in at.exception]


def _window(at, choice: str):
    next(r for r in at.radio if r.label == "Time window").set_value(choice).run()
    _ok(at)
    return at


def test_the_page_goes_to_a_number_once_the_sidebar_s_window_holds_it(app_db):
    with app_db.connect() as conn:  # a batch two minutes back
        seq = conn.execute(text("SELECT seq FROM batches WHERE ended_at < :t ORDER BY ended_at "
                                "DESC LIMIT 1"), {"t": time.time() - 120}).scalar()
    at = _window(run_app("timeline"), "custom")  # 1 min ending 30 min ago: after it
    at.number_input(key="custom_min").set_value(1.0)
    at.number_input(key="custom_end").set_value(30.0).run()
    at.text_input(key="timeline_batch_number").input(str(seq)).run()
    _ok(at)
    said = [w.value for w in at.warning if f"batch {seq}" in w.value]
    assert len(said) == 1 and said[0].startswith(f"batch {seq} ran after the time window"), said
    # the sidebar's 1 min: the note is said of that window, not of the one it was typed in
    _window(at, "1 min")
    said = [w.value for w in at.warning if f"batch {seq}" in w.value]
    assert len(said) == 1 and said[0].startswith(f"batch {seq} ran before the time window"), said
    assert "timeline_selected" not in at.session_state
    # as the note says, a window that holds it: the page goes to it, and the note goes
    _window(at, "60 min")
    assert at.session_state["timeline_selected"][1] == seq
    assert any(f"**Batch {seq}**" in m.value for m in at.markdown)
    assert not [w.value for w in at.warning if f"batch {seq}" in w.value]
    at.run()  # and stays there, nothing tried again
    _ok(at)
    assert at.session_state["timeline_selected"][1] == seq
    assert "timeline_number_tried" not in at.session_state


def test_the_stop_note_goes_once_the_window_changes_and_never_shows_where_it_cannot_follow(
        app_db, monkeypatch):
    monkeypatch.setattr(decisions, "LIVE_MAX_BARS", 300)  # 300 s of 4 batches a second: over
    at = run_app("timeline")
    at.selectbox(key="timeline_length").set_value(300).run()
    _ok(at)
    said = [i.value for i in at.info if i.value.startswith("Follow live stopped by itself")]
    assert len(said) == 1 and "more than the 300 batches a live page" in said[0], said
    assert "timeline_follow" in {b.key for b in at.button}
    at.selectbox(key="timeline_length").set_value(10).run()  # about 40: few enough
    _ok(at)
    assert not [i.value for i in at.info if "stopped by itself" in i.value]
    at.button(key="timeline_follow").click().run()  # and it follows again
    _ok(at)
    assert "timeline_stop" in {b.key for b in at.button}
    at.selectbox(key="timeline_length").set_value(300).run()  # stops again, then a past window
    _ok(at)
    assert any("stopped by itself" in i.value for i in at.info)
    _window(at, "custom")
    at.number_input(key="custom_end").set_value(1.0).run()
    _ok(at)
    assert at.button(key="timeline_follow").disabled
    assert not [i.value for i in at.info if "stopped by itself" in i.value]
