"""The LoRA adapters on the dashboard's side: the queries (per adapter, batches by
adapters mixed, the slot cache) on SQLite and PostgreSQL, the live bundle taking them
only for a window with adapter rows, the three diagnosis rules firing on their problem
and staying quiet on healthy traffic, and the charts."""

from __future__ import annotations

import random

import pytest

from batchscope.analysis import diagnosis, queries
from batchscope.analysis.queries.adapters import adapter_frames
from batchscope.storage.records import BatchRow, EventRow, RequestRow
from batchscope.storage.recorder import Recorder

pytestmark = pytest.mark.both_backends

T0 = 1_000_000.0
NAMES = [f"enc-{i}" for i in range(8)]


def _write(engine, *, mixing: bool = True, evictions: int = 0, slow: str | None = None,
           seconds: int = 60) -> None:
    """``seconds`` of traffic over 8 adapters and the base: one batch of 8 per 0.25 s."""
    rng = random.Random(1)
    rec = Recorder(engine)
    seq = 0
    for k in range(seconds * 4):
        t = T0 + k * 0.25
        seq += 1
        if mixing:
            adapters = [rng.choice([None, *NAMES]) for _ in range(8)]
        else:
            adapters = [NAMES[k % len(NAMES)]] * 8
        rec.put(BatchRow("rt-1", "encoder", seq, "dynamic", 1, 32, None, 8, 64, 64, 0.001,
                         0.002, 0.003, 0.01, t, t + 0.01,
                         adapters=len(set(adapters) - {None})))
        for a in adapters:
            lat = 0.5 if slow is not None and a == slow else 0.02 + rng.random() * 0.01
            rec.put(RequestRow("rt-1", "encoder", seq, 0, t + 0.01 - lat, t + 0.01, 0.005, lat,
                               "ok", adapter=a))
    for i in range(evictions):
        t = T0 + i * seconds / max(1, evictions)
        rec.put(EventRow("rt-1", "encoder", t, "adapter_evict", "evicted", "info",
                         '{"adapter": "enc-0"}'))
        rec.put(EventRow("rt-1", "encoder", t, "adapter_load", "loaded", "info",
                         '{"adapter": "enc-1"}'))
    rec.flush()


def _window():
    return queries.Window(T0 - 1, T0 + 61, model="encoder")


def _rules(bundle) -> set[str]:
    return {f.rule for f in diagnosis.diagnose(bundle)}


ADAPTER_RULES = {"adapter_thrash", "adapter_starving", "adapter_mixing_off"}


def test_frames_per_adapter_mix_and_slots(db):
    _write(db, evictions=4)
    frames = adapter_frames(db, _window())
    ad = frames["adapters"].set_index("adapter")
    assert set(ad.index) == {"", *NAMES}
    assert int(ad["requests"].sum()) == 240 * 8 and (ad["ok"] == ad["requests"]).all()
    assert (ad["latency_p99"] < 0.05).all() and (ad["rps"] > 0).all()
    mix = frames["adapter_mix"]
    assert int(mix["batches"].sum()) == 240 and int(mix["adapters"].max()) >= 4
    slots = frames["adapter_slots"].iloc[0]
    assert slots["evictions"] == 4 and slots["loads"] == 4
    assert slots["hits"] == int((mix["adapters"] * mix["batches"]).sum()) - 4
    bundle = queries.live_bundle(db, _window())
    assert "adapters" in bundle and not (ADAPTER_RULES & _rules(bundle))


def test_a_window_without_adapter_rows_has_no_adapter_frames(db):
    rec = Recorder(db)
    rec.put(BatchRow("rt-1", "mlp", 1, "dynamic", 1, 8, None, 1, 1, 1, 0, 0, 0, 0.01, T0, T0 + 0.01))
    # a model that takes adapters, served with none: its batches record 0, base rows only
    rec.put(BatchRow("rt-1", "encoder", 1, "dynamic", 1, 8, None, 1, 1, 1, 0, 0, 0, 0.01,
                     T0 + 1, T0 + 1.01, adapters=0))
    rec.flush()
    assert adapter_frames(db, _window()) is None
    assert "adapters" not in queries.live_bundle(db, queries.Window(T0 - 1, T0 + 61))


def test_thrash_fires_on_many_evictions(db):
    _write(db, evictions=30)
    flags = {f.rule: f for f in diagnosis.diagnose(queries.live_bundle(db, _window()))}
    assert "adapter_thrash" in flags
    assert flags["adapter_thrash"].evidence["evictions"] == 30
    assert any("adapter_slots" in s for s in flags["adapter_thrash"].steps)


def test_starving_adapter_is_named(db):
    _write(db, slow="enc-3")
    flags = {f.rule: f for f in diagnosis.diagnose(queries.live_bundle(db, _window()))}
    assert flags["adapter_starving"].evidence["adapter"] == "enc-3"


def test_mixing_off_with_traffic_over_many_adapters(db):
    _write(db, mixing=False)
    flags = {f.rule: f for f in diagnosis.diagnose(queries.live_bundle(db, _window()))}
    assert "adapter_mixing_off" in flags
    assert any("adapter_mixing" in s for s in flags["adapter_mixing_off"].steps)
    assert flags["adapter_mixing_off"].evidence["adapters_with_traffic"] == 8


def test_charts_of_a_window_with_adapters(db):
    from batchscope.presentation.adapter_charts import build_adapter_charts
    from batchscope.presentation.charts import ADAPTER_EVICT_MARKER, add_event_markers, latency

    _write(db, evictions=3)
    bundle = queries.live_bundle(db, _window())
    figs = build_adapter_charts(bundle)
    assert set(figs) == {"adapters", "adapter_mix", "adapter_slots"}
    assert len(figs["adapters"].data) == 3 and len(figs["adapter_mix"].data[0].x) >= 4
    fig = add_event_markers(latency(bundle["requests_t"]), bundle["events"])
    assert ADAPTER_EVICT_MARKER in {t.name for t in fig.data}
    assert build_adapter_charts({"headline": bundle["headline"]}) == {}


def test_generation_steps_with_adapters_join_the_adapter_frames(db):
    """A generation model's steps count as its batches in the mix; its requests per
    adapter join the per-adapter figures; its steps are not slot hits."""
    from batchscope.storage.records import GenStepRow

    rec = Recorder(db)
    for k in range(40):
        t = T0 + k * 0.5
        mixed = 1 + k % 3  # steps mixing 1, 2, 3 adapters in turn
        rec.put(GenStepRow("rt-1", "decoder", t, "decode", 4, 0, 0, 4, 10, 90, 0, 0.002,
                           adapters=mixed))
        rec.put(RequestRow("rt-1", "decoder", None, 0, t - 0.2, t, 0.01, 0.2, "ok",
                           adapter=["dec-0", "dec-1", None][k % 3]))
    rec.flush()
    window = queries.Window(T0 - 1, T0 + 61, model="decoder")
    frames = adapter_frames(db, window)
    mix = frames["adapter_mix"].set_index("adapters")
    assert mix["batches"].to_dict() == {1: 14, 2: 13, 3: 13}
    assert int(mix["requests"].sum()) == 40 * 4
    ad = frames["adapters"].set_index("adapter")
    assert ad["requests"].to_dict() == {"": 13, "dec-0": 14, "dec-1": 13}
    assert frames["adapter_slots"].iloc[0]["hits"] == 0
    bundle = queries.live_bundle(db, window)
    assert "generation_t" in bundle and "adapters" in bundle
