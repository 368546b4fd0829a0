"""The batch timeline's figures as a page shows them: the view kept across refreshes, the
picked batch's point selected on its own lane, labels only where they fit, legends clear
of the toolbar and of the axis titles, and the wording of counts and waits."""

from __future__ import annotations

import json

import plotly.graph_objects as go
import pytest
from sqlalchemy.orm import Session

from batchscope.analysis.queries import Window
from batchscope.analysis.queries.timeline import timeline_rows, with_members
from batchscope.presentation import timeline_chart
from batchscope.storage.schema import BatchRecord, EventRecord, GenerationStep, RequestRecord

T0 = 1_800_000_000.0


def batch(inst: str, model: str, seq: int, start: float, end: float, *, size: int = 1,
          wait: tuple[float, float] = (0.01012, 0.01012), outcome: str = "ok") -> BatchRecord:
    """A batch of ``model`` on ``inst`` from ``T0 + start`` to ``T0 + end``."""
    return BatchRecord(
        instance_id=inst, model=model, seq=seq, policy="adaptive", settings_version=1,
        max_batch_size=16, bucket=None, batch_size=size, real_elements=size,
        padded_elements=size, queue_wait_min_s=wait[0], queue_wait_mean_s=sum(wait) / 2,
        queue_wait_max_s=wait[1], compute_s=end - start, started_at=T0 + start,
        ended_at=T0 + end, outcome=outcome)


def request(inst: str, model: str, seq: int | None, arrived: float, finished: float, *,
            wait: float = 0.01, outcome: str = "ok", **more) -> RequestRecord:
    return RequestRecord(
        instance_id=inst, model=model, batch_seq=seq, priority=1, arrived_at=T0 + arrived,
        finished_at=T0 + finished, queue_wait_s=wait, latency_s=finished - arrived,
        outcome=outcome, length=120, **more)


def step(inst: str, model: str, at: float, *, running: int = 1, decode: int = 1,
         step_s: float = 0.2) -> GenerationStep:
    return GenerationStep(
        instance_id=inst, model=model, at=T0 + at, mode="continuous", running=running,
        waiting=0, prefill_tokens=0, decode_tokens=decode, blocks_used=4, blocks_free=60,
        preemptions=0, step_s=step_s)


def event(kind: str, at: float, message: str) -> EventRecord:
    return EventRecord(instance_id="vm-a", model="encoder", at=T0 + at, kind=kind,
                       severity="info", message=message, details_json="{}")


def stored(engine, records) -> None:
    with Session(engine) as s:
        s.add_all(records)
        s.commit()


@pytest.fixture()
def two_instances(db):
    """An encoder on two instances, "vm-a" with batch 2 overlapping batch 1 (a second
    device process), "vm-b" with a batch 2 of its own; a decoder's steps on both; the
    requests of vm-b's batch 2; settings, autopilot and OOM events."""
    stored(db, [
        batch("vm-a", "encoder", 1, 1.0, 2.0, size=3),
        batch("vm-a", "encoder", 2, 1.5, 2.5, size=1),  # overlaps batch 1: a second row
        batch("vm-a", "encoder", 3, 4.0, 5.0, size=2, outcome="oom"),
        batch("vm-b", "encoder", 2, 3.0, 4.0, size=2, wait=(0.002, 0.009)),
        batch("vm-b", "encoder", 7, 6.0, 7.0, size=1),
        step("vm-a", "decoder", 2.0), step("vm-b", "decoder", 6.0, running=2, decode=2),
        request("vm-b", "encoder", 2, 2.95, 4.0, wait=0.05),
        request("vm-b", "encoder", 2, 2.99, 4.0, wait=0.01),
        request("vm-b", "encoder", 7, 5.99, 7.0, wait=0.01),
        request("vm-a", "encoder", None, 8.0, 8.2, outcome="rejected"),
        event("settings_change", 3.5, "max_batch_size 16"),
        event("autopilot", 5.5, "raised the delay"), event("oom", 4.5, "out of memory"),
    ])
    return db


def points_of(fig: go.Figure) -> dict[tuple[str, int], float]:
    """The lane (y) of every batch and step point, by the key a click on it returns."""
    return {(str(k[0]), int(k[1])): float(y) for t in fig.data
            if t.customdata is not None and t.mode != "lines"
            for k, y in zip(t.customdata, t.y)}


def picked_of(fig: go.Figure) -> tuple[tuple[str, int], float, float] | None:
    """The key, lane and x of the one point drawn selected (None: none is); every other
    batch and step point is drawn unselected."""
    points = [t for t in fig.data if t.customdata is not None and t.mode != "lines"]
    chosen = [(t, i) for t in points for i in (t.selectedpoints or ())]
    if not chosen:
        assert all(t.selectedpoints is None for t in points)
        return None
    assert all(t.selectedpoints is not None for t in points)
    ((t, i),) = chosen
    return (str(t.customdata[i][0]), int(t.customdata[i][1])), float(t.y[i]), float(t.x[i])


# -- 1. the view ---------------------------------------------------------------------------
def test_a_zoom_survives_refreshes_and_picks_of_one_view_and_a_new_choice_resets_it(
        two_instances):
    """Plotly keeps a user's zoom over a new figure (``Plotly.react``) while the figure's
    ``uirevision`` and the attribute's given value (here the x range) stay the same."""
    engine = two_instances
    rows = timeline_rows(engine, Window(T0, T0 + 10, "encoder"))
    first = timeline_chart.timeline(rows)
    # a live refresh two seconds on, and a pick in it: the same view, the same revision
    later = timeline_chart.timeline(timeline_rows(engine, Window(T0 + 2, T0 + 12, "encoder")))
    picked = timeline_chart.timeline(rows, selected=("vm-b", 7))
    assert first.layout.uirevision == later.layout.uirevision == picked.layout.uirevision
    # ... and the same x range given, which plotly keeps the user's zoom over
    assert list(first.layout.xaxis.range) == list(later.layout.xaxis.range) == [0, 10]
    # another window length, model or instance: another revision, the whole window shown
    others = [Window(T0, T0 + 30, "encoder"), Window(T0, T0 + 10, "decoder"),
              Window(T0, T0 + 10), Window(T0, T0 + 10, "encoder", "vm-a")]
    revisions = {timeline_chart.timeline(timeline_rows(engine, w)).layout.uirevision
                 for w in others}
    assert len(revisions) == len(others) and first.layout.uirevision not in revisions
    # the caller may name the view itself
    assert timeline_chart.timeline(rows, revision="mine").layout.uirevision == "mine"
    # a picked batch's chart keeps its zoom until another batch is picked
    rows = with_members(engine, rows, ("vm-b", 2))
    same = [timeline_chart.members(rows, ("vm-b", 2))[0].layout.uirevision for _ in range(2)]
    other = timeline_chart.members(rows, ("vm-b", 7))[0].layout.uirevision
    assert same[0] == same[1] != other


# -- 2. the picked batch ------------------------------------------------------------------
@pytest.mark.parametrize("key, lane", [
    (("vm-a", 2), "encoder @ vm-a · batches 2"),  # overlaps batch 1: the second row
    (("vm-a", 1), "encoder @ vm-a · batches"),
    (("vm-a", 3), "encoder @ vm-a · batches"),  # failed (OOM): a trace of its own
    (("vm-b", 2), "encoder @ vm-b · batches"),  # the same number on the other instance
    (("vm-b", 7), "encoder @ vm-b · batches")])
def test_the_picked_batch_s_point_is_selected_on_its_own_lane(two_instances, key, lane):
    rows = timeline_rows(two_instances, Window(T0, T0 + 10))
    fig = timeline_chart.timeline(rows, selected=key)
    lanes = list(fig.layout.yaxis.ticktext)
    got, y, x = picked_of(fig)
    assert got == key and y == points_of(fig)[key]  # the point a click on its bar selects
    b = rows.batches
    row = b[(b["instance_id"] == key[0]) & (b["seq"] == key[1])].iloc[0]
    assert x == pytest.approx((row["started_at"] + row["ended_at"]) / 2 - T0)
    assert lanes[int(y)] == lane


def test_a_picked_step_s_point_is_selected_on_its_instance_s_lane(two_instances):
    rows = timeline_rows(two_instances, Window(T0, T0 + 10))
    steps = rows.steps.set_index("instance_id")
    for inst in ("vm-a", "vm-b"):
        key = (inst, -int(steps.loc[inst, "id"]))
        fig = timeline_chart.timeline(rows, selected=key)
        got, y, _ = picked_of(fig)
        assert got == key and y == points_of(fig)[key]
        assert fig.layout.yaxis.ticktext[int(y)] == f"decoder @ {inst} · steps"
    # a batch not in the window selects nothing, and nothing is dimmed
    assert picked_of(timeline_chart.timeline(rows, selected=("vm-b", 99))) is None
    assert picked_of(timeline_chart.timeline(rows)) is None


# -- 3. labels -----------------------------------------------------------------------------
def labels_of(fig: go.Figure, span_s: float) -> list[tuple[float, float, float, str]]:
    """Every label written on a bar: its lane, its left and right edges at
    ``PLOT_WIDTH_PX`` (pixels) and its text."""
    px = timeline_chart.PLOT_WIDTH_PX / span_s
    out = []
    for t in fig.data:
        if t.text is None:
            continue
        for x, y, text in zip(t.x, t.y, t.text):
            if text:
                half = len(text) * timeline_chart.LABEL_CHAR_PX / 2
                out.append((float(y), x * px - half, x * px + half, text))
    return out


def overlapping(labels) -> list:
    by_lane: dict[float, list] = {}
    for y, left, right, text in labels:
        by_lane.setdefault(y, []).append((left, right, text))
    return [(a, b) for lane in by_lane.values() for a, b in zip(sorted(lane), sorted(lane)[1:])
            if b[0] < a[1]]


def test_a_dense_window_writes_no_label_on_bars_too_narrow_for_one(db):
    # 140 batches of 30 ms in 10 s (an encoder under load, as in the review): 2.4 px
    # each at PLOT_WIDTH_PX, where their labels ran together; and one of 0.7 s, 56 px
    stored(db, [batch("vm-a", "encoder", i, 0.07 * i, 0.07 * i + 0.03, size=1 + i % 16)
                for i in range(140)] + [batch("vm-a", "encoder", 1000, 9.2, 9.9, size=16)])
    rows = timeline_rows(db, Window(T0, T0 + 10, "encoder"))
    assert [text for *_, text in labels_of(timeline_chart.timeline(rows), 10)] == ["16/16"]
    # half a second of the same batches: 48 px each, every one labelled, none overlapping
    near = timeline_rows(db, Window(T0, T0 + 0.5, "encoder"))
    labels = labels_of(timeline_chart.timeline(near), 0.5)
    assert len(labels) == len(near.batches) == 8 and not overlapping(labels)


def test_a_sparse_window_labels_every_bar_and_labels_never_overlap(db):
    stored(db, [batch("vm-a", "encoder", i, 1.5 * i, 1.5 * i + 1.0, size=3) for i in range(6)]
           + [batch("vm-a", "encoder", 100 + i, 1.5 * i + 0.5, 1.5 * i + 0.9, size=12)
              for i in range(6)]  # overlapping: a second row, labelled as well
           + [step("vm-a", "decoder", 2.0 + i, running=4, step_s=0.5) for i in range(5)])
    rows = timeline_rows(db, Window(T0, T0 + 10))
    fig = timeline_chart.timeline(rows)
    labels = labels_of(fig, 10)
    assert sorted(text for *_, text in labels) == ["12/16"] * 6 + ["3/16"] * 6 + ["4"] * 5
    assert len({y for y, *_ in labels}) == 3 and not overlapping(labels)
    # the same bars in a window 20 times longer are each a few pixels wide: no label
    long = timeline_rows(db, Window(T0 - 190, T0 + 10))
    assert labels_of(timeline_chart.timeline(long), 200) == []


# -- 4. legends ----------------------------------------------------------------------------
def test_legends_sit_below_the_axis_title_with_room_for_their_rows(two_instances):
    rows = with_members(two_instances, timeline_rows(two_instances, Window(T0, T0 + 10)),
                        ("vm-b", 2))
    fig = timeline_chart.timeline(rows, selected=("vm-b", 2))
    names = [t.name for t in fig.data if t.showlegend is not False]
    assert {"encoder @ vm-a (failed / OOM)", "OOM / errors", "settings changes",
            "autopilot decisions"} <= set(names)
    members, _ = timeline_chart.members(rows, ("vm-b", 2))
    for f in (fig, members):
        legend = f.layout.legend
        # in the bottom margin of the figure, not above the plot (under the toolbar)
        assert (legend.orientation, legend.yref, legend.y, legend.yanchor) == \
            ("h", "container", 0, "bottom")
        assert f.layout.margin.b >= timeline_chart.AXIS_BELOW_PX + timeline_chart.LEGEND_ROW_PX
        go.Figure(f.to_dict())  # passes plotly's full validation
    # the timeline's nine entries wrap into rows, each given room; the plot keeps its height
    assert fig.layout.margin.b >= timeline_chart.AXIS_BELOW_PX + 2 * timeline_chart.LEGEND_ROW_PX
    plot_px = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
    assert plot_px >= 34 * len(fig.layout.yaxis.ticktext)
    assert members.layout.margin.b == timeline_chart.AXIS_BELOW_PX + timeline_chart.LEGEND_ROW_PX


# -- 5. wording ----------------------------------------------------------------------------
def test_counts_and_waits_read_as_words_and_an_empty_window_has_no_lane_ticks(two_instances):
    engine = two_instances
    rows = timeline_rows(engine, Window(T0, T0 + 10))
    for key, title in ((("vm-b", 7), "Batch 7: 1 request —"),
                       (("vm-b", 2), "Batch 2: 2 requests —")):
        fig, _ = timeline_chart.members(with_members(engine, rows, key), key)
        assert fig.layout.title.text.startswith(title), fig.layout.title.text
    steps = rows.steps.set_index("instance_id")
    fig, part = timeline_chart.members(rows, ("vm-a", -int(steps.loc["vm-a", "id"])))
    assert " 0 sequences —" in fig.layout.title.text
    stored(engine, [request("vm-a", "decoder", None, 1.0, 2.5, ttft_s=0.1, prompt_tokens=8,
                            output_tokens=20)])
    rows = timeline_rows(engine, Window(T0, T0 + 10))
    fig, part = timeline_chart.members(rows, ("vm-a", -int(steps.loc["vm-a", "id"])))
    assert len(part) == 1 and " 1 sequence —" in fig.layout.title.text
    hover = {k: h for t in timeline_chart.timeline(rows).data if t.customdata is not None
             for k, h in zip(map(tuple, t.customdata), t.hovertext)}
    assert "wait 10.12 ms<br>" in hover[("vm-b", 7)]  # one request: one wait
    assert "wait 2.00 ms–9.00 ms<br>" in hover[("vm-b", 2)]
    assert "decode 1 token<br>" in hover[("vm-a", -int(steps.loc["vm-a", "id"]))]
    assert "decode 2 tokens<br>" in hover[("vm-b", -int(steps.loc["vm-b", "id"]))]
    # an empty window: no lanes, so no tick (it showed a lone "0")
    empty = timeline_chart.timeline(timeline_rows(engine, Window(T0 + 3600, T0 + 3610)))
    axis = json.loads(empty.to_json())["layout"]["yaxis"]
    assert axis.get("visible") is False and not axis.get("tickvals")
    assert "no batch" in empty.layout.annotations[0].text


def test_marks_are_one_trace_per_kind_of_one_symbol_and_colour(db):
    """Refused, expired, cancelled and bypass requests on a model's marks lane: one trace
    per kind with one symbol and one colour (a symbol and a colour per point made a
    window of 180,000 expired requests take 20 s to build), each point with its hover."""
    kinds = ["rejected", "expired", "expired", "cancelled"]
    stored(db, [batch("vm-a", "encoder", 1, 1.0, 2.0, size=1),
                request("vm-a", "encoder", 1, 0.9, 2.0),
                *[request("vm-a", "encoder", None, 3.0 + i, 3.5 + i, outcome=k)
                  for i, k in enumerate(kinds)],
                request("vm-a", "encoder", None, 8.0, 8.1, bypass=True)])
    fig = timeline_chart.timeline(timeline_rows(db, Window(T0, T0 + 10)))
    marks = {t.name: t for t in fig.data if t.name and t.name.startswith("encoder ")
             and t.customdata is None}
    assert sorted(marks) == ["encoder bypass", "encoder cancelled", "encoder expired",
                             "encoder rejected"]
    assert len(marks["encoder expired"].x) == 2 and len(marks["encoder bypass"].x) == 1
    for t in marks.values():
        assert isinstance(t.marker.symbol, str) and isinstance(t.marker.color, str)
        assert len(t.hovertext) == len(t.x)
    assert marks["encoder bypass"].marker.color != timeline_chart.FAILED_BATCH
    assert marks["encoder expired"].hovertext[0].startswith("expired · priority 1 · waited")
    # the models' colours are never the red of failed batches and refused requests
    colors = timeline_chart.model_colors([f"m{i}" for i in range(12)]).values()
    assert not {"#EF553B", "#FF6692", timeline_chart.FAILED_BATCH} & set(colors)
