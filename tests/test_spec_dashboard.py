"""Speculative decoding and chunked prefill on the Live page: the generation frames
(tokens per step split prefill / decode / proposed, acceptance rate, tokens per
verification, speculation by batch size, steps by prefill size) on SQLite and
PostgreSQL alike, the generation chart's speculation row with the switch's decisions
marked, a model without speculation drawn as before, and the page itself."""

from __future__ import annotations

import json
import math
import time

import plotly.graph_objects as go
import plotly.io as pio
import pytest

from batchscope.analysis import queries
from batchscope.presentation import charts
from batchscope.storage import control
from batchscope.storage.db import make_engine
from batchscope.storage.recorder import Recorder
from batchscope.storage.records import EventRow
from tests.factories import gen_step, run_app

END = 2_000_000_000.0
WINDOW = queries.Window(END - 120, END + 1, "decoder")
SWITCH_OFF = "speculative decoding off at batch sizes 3-4: 25% of the proposed tokens are accepted"


def decoder_steps(start: float, every_s: float = 0.2) -> list:
    """600 steps of 4 sequences: speculating (12 of 16 proposed tokens accepted), switched
    off from step 300, on again from step 450 (4 of 16 accepted); every 10th step also
    prefills 100 prompt tokens."""
    rows = []
    for i in range(600):
        drafted, accepted = (16, 12) if i < 300 else (0, 0) if i < 450 else (16, 4)
        rows.append(gen_step(start + i * every_s, prefill=100 if i % 10 == 0 else 0,
                             drafted=drafted, accepted=accepted, step_s=0.012 if drafted else 0.01))
    return rows


def switch_event(at: float, message: str = SWITCH_OFF) -> EventRow:
    return EventRow(instance_id="rt", model="decoder", at=at, kind="speculation", severity="info",
                    message=message, details_json=json.dumps({"on": False, "batch_bucket": 4}))


@pytest.fixture(scope="module")
def bundles(backend, new_database_url):
    engine = make_engine(new_database_url(backend))
    rec = Recorder(engine)
    rec.put_many(decoder_steps(END - 120))
    rec.put_many([gen_step(END - 120 + i * 0.2, running=6, model="plain") for i in range(600)])
    rec.put(switch_event(END - 60))
    rec.flush()
    out = {model: queries.live_bundle(engine, queries.Window(END - 120, END + 1, model))
           for model in ("decoder", "plain")}
    engine.dispose()
    return out


pytestmark = pytest.mark.both_backends


def test_timeline_splits_the_tokens_and_rates_speculation(bundles):
    gen_t = bundles["decoder"]["generation_t"]
    assert len(gen_t) == 24 and set(gen_t["steps"]) == {25}  # 5-second buckets
    first, off, last = gen_t.iloc[0], gen_t.iloc[14], gen_t.iloc[-1]
    # 3 of 25 steps prefill 100 tokens; 4 decodes a step, 16 proposed while speculating
    assert first["prefill_per_step"] == pytest.approx(12.0)
    assert (first["decode_per_step"], first["proposed_per_step"]) == (4.0, 16.0)
    assert first["tokens_per_step"] == pytest.approx(32.0)
    assert first["acceptance_rate"] == 0.75 and first["acceptance_length"] == 4.0
    assert first["speculating_fraction"] == 1.0
    # switched off: a proposer, no proposals
    assert (off["spec_steps"], off["speculating_steps"], off["proposed_per_step"]) == (25, 0, 0)
    assert math.isnan(off["acceptance_rate"]) and math.isnan(off["acceptance_length"])
    assert off["speculating_fraction"] == 0.0
    assert last["acceptance_rate"] == 0.25 and last["acceptance_length"] == 2.0
    summary = bundles["decoder"]["generation"].iloc[0]
    assert summary["spec_draft_tokens"] == 450 * 16
    assert summary["spec_accepted_tokens"] == 300 * 12 + 150 * 4
    assert summary["generated_tokens"] == 600 * 4 + summary["spec_accepted_tokens"]


def test_speculation_by_batch_size_and_steps_by_prefill(bundles):
    spec = bundles["decoder"]["generation_spec"]
    assert list(spec["batch_bucket"]) == [4, 4] and list(spec["speculated"]) == [0, 1]
    off, on = spec.iloc[0], spec.iloc[1]
    assert (off["steps"], on["steps"]) == (150, 450)
    assert (on["draft_tokens"], on["accepted_tokens"]) == (7200, 4200)
    # over the steps without prefill: 405 speculating ones of 12 ms
    assert on["decode_steps"] == 405 and on["decode_step_s"] == pytest.approx(405 * 0.012)
    assert on["decode_step_tokens"] == 405 * 4 + 270 * 12 + 135 * 4
    assert (off["draft_tokens"], off["decode_steps"], off["decode_step_tokens"]) == (0, 135, 540)
    pre = bundles["decoder"]["generation_prefill"]
    assert list(pre["prefill_from"]) == [0, 64] and list(pre["decoding"]) == [1, 1]
    assert list(pre["steps"]) == [540, 60] and list(pre["prefill_tokens"]) == [0, 6000]
    assert pre.iloc[1]["decodes"] == 240


def test_a_model_without_speculation_draws_as_before(bundles):
    bundle = bundles["plain"]
    assert "generation_spec" not in bundle
    assert bundle["generation_t"]["spec_steps"].sum() == 0
    assert bundle["generation"].iloc[0]["spec_draft_tokens"] is None
    fig = charts.build_all(bundle)["generation"]
    assert fig.layout.title.text == charts.CHARTS["generation"] and fig.layout.height == 480
    assert [a.text for a in fig.layout.annotations] == list(charts.GENERATION_PANELS)
    assert [t.name for t in fig.data] == ["running", "waiting", "decode tokens/step",
                                          "prefill tokens/step", "blocks used", "blocks total",
                                          "preemptions"]


def test_speculation_row_with_the_switch_marked(bundles):
    bundle = bundles["decoder"]
    fig = charts.build_all(bundle)["generation"]
    assert fig.layout.title.text.endswith(", speculation") and fig.layout.height == 680
    assert [a.text for a in fig.layout.annotations] == list(charts.GENERATION_PANELS
                                                            + charts.SPECULATION_PANELS)
    axes = {t.name: (t.xaxis, t.yaxis) for t in fig.data if t.name != charts.SPECULATION_MARKER}
    assert axes["proposed tokens/step"] == ("x2", "y2")
    assert axes["acceptance rate %"] == axes["steps speculating %"] == ("x5", "y5")
    assert axes["tokens per verification"] == ("x6", "y6")
    stacked = [t for t in fig.data if t.type == "scatter" and t.stackgroup == "tokens"]
    assert [t.name for t in stacked] == ["decode tokens/step", "proposed tokens/step",
                                         "prefill tokens/step"]
    rate = next(t for t in fig.data if t.name == "acceptance rate %")
    assert rate.y[0] == 75.0 and math.isnan(rate.y[14]) and rate.y[-1] == 25.0
    # the switch's decision: one legend entry, marked on the sequences, tokens and
    # speculation panels, a dotted line through each
    marks = [t for t in fig.data if t.name == charts.SPECULATION_MARKER]
    assert [(t.xaxis, t.yaxis, t.showlegend) for t in marks] == [
        ("x", "y", True), ("x2", "y2", False), ("x5", "y5", False), ("x6", "y6", False)]
    assert {t.legendgroup for t in marks} == {charts.SPECULATION_MARKER}
    assert all(list(t.hovertext) == [SWITCH_OFF] for t in marks)
    lines = {(s.xref, s.yref) for s in fig.layout.shapes}
    assert lines == {("x", "y domain"), ("x2", "y2 domain"), ("x5", "y5 domain"),
                     ("x6", "y6 domain")}
    checked = go.Figure(fig.to_dict())  # plotly's full validation accepts it unchanged
    assert json.loads(pio.to_json(checked)) == json.loads(pio.to_json(fig))


def test_the_live_page_draws_speculation_and_flags_it(app_db):
    now = time.time()
    rec = Recorder(app_db)
    rec.put_many(decoder_steps(now - 125))
    # then nothing accepted, 30 ms a step: dearer per token than without
    rec.put_many([gen_step(now - 5 + i * 0.005, drafted=16, accepted=0, step_s=0.03)
                  for i in range(1000)])
    rec.put(switch_event(now - 65))
    rec.flush()
    control.publish_settings(app_db, instance_id="rt", model="decoder", version=1,
                             settings={"mode": "continuous", "speculative_method": "ngram"},
                             kind="generate", now=now)
    at = run_app()
    at.selectbox(key="instance").set_value("all").run()
    at.selectbox(key="model").set_value("decoder").run()
    assert not at.exception
    specs = json.dumps([c.proto.spec for c in at.get("plotly_chart")])
    for text in (*charts.SPECULATION_PANELS, "proposed tokens", charts.SPECULATION_MARKER):
        assert text in specs
    assert any("Speculative decoding does not pay" in e.label for e in at.expander)
