"""The Batch timeline for a generation model: its engine steps are found by number, name
their number where they are shown, and a picked step says what it was and where it lies
among its sequences (rows from ``batchscope.testing.synthetic``; the page through AppTest)."""

from __future__ import annotations

import json
import time

import pytest
from sqlalchemy import text
from sqlalchemy.orm import Session

from batchscope.analysis.queries import Window
from batchscope.analysis.queries.timeline import find_step, timeline_rows, with_members
from batchscope.dashboard import timeline
from batchscope.dashboard import timeline_decisions as decisions
from batchscope.presentation import timeline_chart
from batchscope.storage.schema import RequestRecord
from batchscope.testing import synthetic
from tests.factories import run_app

#: step numbers start here, apart from the batches' (which start at 1)
FIRST_STEP = 100_000


def _decoder(engine, end: float, *, duration_s: float = 20) -> None:
    """A decoder's steps, numbered as the runtime numbers them (``seq``), and five
    sequences alive over many of them, each joined at a step of the window."""
    synthetic.generate(engine, synthetic.SCENARIOS["generation"].with_(
        duration_s=duration_s), end_s=end, seed=3)
    with engine.begin() as conn:
        conn.execute(text("UPDATE generation_steps SET seq = id + :k WHERE model = 'decoder'"),
                     {"k": FIRST_STEP})
        joined = [int(v) for v in conn.execute(text(
            "SELECT seq FROM generation_steps WHERE at > :t ORDER BY at LIMIT 5"),
            {"t": end - 4}).scalars()]
    with Session(engine) as s:
        s.add_all(RequestRecord(
            instance_id="synthetic-1", model="decoder", batch_seq=joined[i], priority=1,
            arrived_at=end - 4 + 0.1 * i, finished_at=end - 1 + 0.1 * i, queue_wait_s=0.05,
            latency_s=3.0 + 0.1 * i, outcome="ok", ttft_s=0.2, tpot_s=0.01, prompt_tokens=32,
            output_tokens=280, length=32) for i in range(5))
        s.commit()


@pytest.fixture()
def decoder(db):
    end = 1_800_000_000.0
    synthetic.generate(db, synthetic.SCENARIOS["healthy"].with_(duration_s=20,
                                                                 batches_per_s=50), end_s=end)
    _decoder(db, end)
    return db, end


def test_a_step_is_found_by_its_number_and_a_batch_of_that_number_comes_first(decoder):
    engine, end = decoder
    with engine.connect() as conn:
        sid, seq, at, step_s = conn.execute(text(
            "SELECT id, seq, at, step_s FROM generation_steps ORDER BY at DESC LIMIT 1")).one()
        batch = conn.execute(text("SELECT MAX(seq) FROM batches WHERE model = 'mlp'")).scalar()
        conn.execute(text("UPDATE generation_steps SET seq = :b WHERE id = (SELECT MIN(id) "
                          "FROM generation_steps)"), {"b": batch})
        conn.commit()
    found = find_step(engine, seq)
    assert found["id"] == sid and found["model"] == "decoder"
    assert found["started_at"] == pytest.approx(at - step_s) and found["ended_at"] == at
    assert find_step(engine, seq, model="decoder")["id"] == sid
    assert find_step(engine, seq, model="mlp") is None
    assert find_step(engine, 999_999_999) is None
    step = timeline.find_numbered(engine, seq, "decoder", None)
    assert step["kind"] == "step" and step["key"] == ("synthetic-1", -sid)
    # a number both a batch (of mlp) and a step (of decoder) have
    assert timeline.find_numbered(engine, batch, None, None)["kind"] == "batch"
    assert timeline.find_numbered(engine, batch, "decoder", None)["kind"] == "step"
    assert timeline.find_numbered(engine, 2**70, None, None) is None
    said = decisions.not_found_note(str(seq), step, "mlp", None)
    assert said.startswith(f"step {seq} is a step of decoder, not of mlp"), said


def test_a_step_s_hover_names_its_number_and_the_kv_cache_used_and_free(decoder):
    engine, end = decoder
    rows = timeline_rows(engine, Window(end - 3, end - 2, "decoder"), requests="marks")
    fig = timeline_chart.timeline(rows)
    points = next(t for t in fig.data if t.name == "decoder steps" and t.mode != "lines")
    first = rows.steps.iloc[0]
    hover = points.hovertext[0]
    assert hover.startswith(f"<b>step {int(first['seq'])}</b> · decoder"), hover
    assert (f"KV blocks {int(first['blocks_used'])} used, {int(first['blocks_free'])} free"
            in hover), hover
    assert f"step {1000 * first['step_s']:.2f} ms" in hover
    # a step recorded without its number (before schema version 12) is a plain "step"
    unnumbered = timeline_chart._step_hover(rows.steps.drop(columns=["seq"]).iloc[:1])
    assert unnumbered[0].startswith("<b>step</b> · decoder")


def test_a_picked_step_is_described_and_marked_among_its_sequences(decoder):
    engine, end = decoder
    rows = timeline_rows(engine, Window(end - 5, end), requests="marks")
    step = rows.steps[rows.steps["at"] > end - 1.5].iloc[0]
    key = (step["instance_id"], -int(step["id"]))
    rows = with_members(engine, rows, key)
    fig, seqs = timeline_chart.members(rows, key)
    assert len(seqs) == 5
    band = [s for s in fig.layout.shapes if s.type == "rect"]
    assert len(band) == 1
    # the member chart counts from the first arrival, in ms (the sequences span under 10 s)
    assert fig.layout.xaxis.title.text.startswith("ms after the first arrival")
    first = float(seqs["arrived_at"].min())
    assert band[0].x0 == pytest.approx(1000 * (step["started_at"] - first), abs=1e-3)
    assert band[0].x1 == pytest.approx(1000 * (step["at"] - first), abs=1e-3)
    said = decisions.step_header(rows.steps, step["instance_id"], int(step["id"]))
    assert said.startswith(f"**Step {int(step['seq'])}** · decoder · "
                           f"{int(step['running'])} running, {int(step['waiting'])} waiting")
    assert (f"KV blocks {int(step['blocks_used'])} used, {int(step['blocks_free'])} free · "
            f"preempted {int(step['preemptions'])}") in said
    # a batch's requests get no band
    b = rows.batches.iloc[len(rows.batches) // 2]
    bkey = (b["instance_id"], int(b["seq"]))
    bfig, _ = timeline_chart.members(with_members(engine, rows, bkey), bkey)
    assert not [s for s in bfig.layout.shapes if s.type == "rect"]


# -- the page (AppTest) ---------------------------------------------------------------------
def _ok(at) -> None:
    assert not at.exception, [e.value for e in at.exception]


def test_a_step_is_picked_by_its_number_and_by_its_request_s_row(app_db):
    now = time.time()
    _decoder(app_db, now - 30, duration_s=60)
    with app_db.connect() as conn:  # the step the first sequence joined
        sid, seq = conn.execute(text(
            "SELECT g.id, g.seq FROM generation_steps g JOIN requests r ON r.batch_seq = g.seq "
            "AND r.model = 'decoder' ORDER BY r.arrived_at LIMIT 1")).one()
        batch = conn.execute(text("SELECT seq FROM batches WHERE ended_at < :t ORDER BY "
                                  "ended_at DESC LIMIT 1"), {"t": now - 40}).scalar()
    at = run_app("timeline")
    # the sidebar's mlp: a step number of the decoder says whose it is
    at.text_input(key="timeline_batch_number").input(str(seq)).run()
    _ok(at)
    said = [w.value for w in at.warning]
    assert any(w.startswith(f"step {seq} is a step of decoder, not of mlp") for w in said), said
    at.selectbox(key="model").set_value("decoder").run()
    at.text_input(key="timeline_batch_number").input("").run()  # typed anew
    at.text_input(key="timeline_batch_number").input(str(seq)).run()
    _ok(at)
    said = [w.value for w in at.warning if not w.value.startswith("No runtime")]
    assert not said, said
    assert at.session_state["timeline_selected"] == ("synthetic-1", -sid)
    assert any(m.value.startswith(f"**Step {seq}** · decoder") for m in at.markdown)
    spec = json.loads(at.get("plotly_chart")[0].proto.spec)
    marked = [t for t in spec["data"] if t.get("selectedpoints")]
    assert len(marked) == 1 and marked[0]["customdata"][marked[0]["selectedpoints"][0]] == \
        ["synthetic-1", -sid]
    # all models: a number of a batch of mlp is still that batch
    at.selectbox(key="timeline_models").set_value("all").run()
    at.text_input(key="timeline_batch_number").input(str(batch)).run()
    _ok(at)
    assert at.session_state["timeline_selected"][1] == batch
    # a generation request's row of the slowest table picks the step it joined
    at.text_input(key="timeline_batch_number").input(f" {seq}").run()
    _ok(at)
    rows = at.session_state["timeline_slowest_rows"]
    assert -sid in {int(p) for p in rows["pick"].dropna()}, rows
