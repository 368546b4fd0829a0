"""Read queries of the dashboard: ``(engine, window) -> pandas.DataFrame``.

``live_bundle`` runs every query of one live refresh. It reads the summaries the
inserts keep up to date (``live``), so its cost follows the window's length, not the
traffic in it: counts, sums and means per second, exactly; latency percentiles exact
from the raw rows while the window holds at most ``EXACT_PERCENTILES_MAX_OK`` completed
requests, else from 5-second latency histograms (each the upper bound of its bucket: at
most 7.5 % above the exact value). A window reaching back before the raw rows (rolled up
by retention) is answered from the roll-ups (``rollups``), in their intervals. The
headline row says which (``source``, ``resolution_s``, ``resolution``).

The parts, each a module of this package:

* ``window``: ``Window``, ``Resolution`` and the SQL every query shares (portable to
  SQLite and PostgreSQL alike);
* ``catalog``: the models, instances and events a database holds;
* ``raw``: every frame aggregated from the raw rows, with exact percentiles, and
  ``raw_bundle``, the live bundle made of them (what the summaries stand for);
* ``live``: the frames from the summaries;
* ``rollups``: the frames of windows older than the raw rows;
* ``adapters``: the LoRA adapters of a window (per adapter, batches by adapters mixed,
  the slot cache), added to the bundle when its batches recorded adapters.

This module puts the public names of all of them in one place, so callers import
``batchscope.analysis.queries`` alone.
"""

from __future__ import annotations

import pandas as pd
from sqlalchemy import Engine, text

from batchscope.analysis.queries.adapters import adapter_frames
from batchscope.analysis.queries.catalog import (event_counts, events, instances, model_kinds,
                                                 model_sources, models)
from batchscope.analysis.queries.live import summary_frames
from batchscope.analysis.queries.raw import (
    batch_sizes, batch_timeline, device_timeline, generation_prefill, generation_speculation,
    generation_summary, generation_timeline, model_share, padding_by_bucket, priority_stats,
    raw_bundle, raw_headline, request_timeline, tail_breakdown)
from batchscope.analysis.queries.rollups import reaches_rollups, rollup_frames
from batchscope.analysis.queries.window import (
    NICE_BUCKETS_S, PCTS, RAW, Resolution, Window, in_window, nearest_rank)

__all__ = [
    "EXACT_PERCENTILES_MAX_OK", "NICE_BUCKETS_S", "adapter_frames", "PCTS", "RAW", "Resolution", "Window",
    "batch_sizes", "batch_timeline", "device_timeline", "event_counts", "events",
    "generation_prefill", "generation_speculation", "generation_summary", "generation_timeline",
    "headline", "instances", "live_bundle", "model_kinds", "model_share", "model_sources",
    "models", "nearest_rank", "padding_by_bucket", "priority_stats", "raw_bundle",
    "request_timeline", "tail_breakdown",
]

#: a window with up to this many completed requests gets exact percentiles from the raw
#: rows (a few milliseconds per thousand); above, they are read from the summaries'
#: latency histograms
EXACT_PERCENTILES_MAX_OK = 10_000


def headline(engine: Engine, w: Window) -> pd.DataFrame:
    """One row: throughput, latency percentiles, batch sizes, outcomes, device, drops,
    and where the numbers come from (``source``, ``resolution_s``, ``resolution``).
    A window older than the raw rows is answered from the roll-ups (see ``live_bundle``)."""
    if reaches_rollups(engine, w):
        return rollup_frames(engine, w, headline_only=True)["headline"]
    return raw_headline(engine, w)


def live_bundle(engine: Engine, w: Window, *, generation: bool | None = None) -> dict[str, pd.DataFrame]:
    """Every query of one live refresh of the dashboard, keyed by name.

    A window that reaches back before the raw rows (rolled up and deleted by retention)
    is answered from the roll-ups, in their intervals; ``headline`` says which
    (``source``, ``resolution_s``, ``resolution``)."""
    bucket = w.bucket_s()
    if reaches_rollups(engine, w):
        out = rollup_frames(engine, w)
        bucket = max(bucket, float(out["headline"].iloc[0]["resolution_s"]))
        return _with_generation(engine, w, out, bucket, generation)
    frames = summary_frames(engine, w, bucket, exact_max_ok=EXACT_PERCENTILES_MAX_OK)
    return _with_generation(engine, w, frames, bucket, generation)


def _with_generation(engine: Engine, w: Window, out: dict, bucket: float,
                     generation: bool | None) -> dict[str, pd.DataFrame]:
    """``out`` with the generation frames when the window has generation steps:
    ``generation_t`` over time, ``generation`` (one row), ``generation_prefill`` (steps by
    prefill tokens) and, when any step had a proposer, ``generation_spec`` (speculation
    by batch size)."""
    if generation is None:
        with engine.connect() as conn:
            cond, params = in_window(w, "at")
            generation = conn.execute(text(f"SELECT 1 FROM generation_steps WHERE {cond} LIMIT 1"),
                                      params).first() is not None
    if generation:
        out["generation_t"] = generation_timeline(engine, w, bucket)
        out["generation"] = generation_summary(engine, w)
        out["generation_prefill"] = generation_prefill(engine, w)
        if out["generation_t"]["spec_steps"].sum() > 0:
            out["generation_spec"] = generation_speculation(engine, w)
    if not reaches_rollups(engine, w):
        # LoRA adapters, of request and generation models: from the raw rows
        head = out.get("headline")
        active_s = float(head["active_s"].iloc[0]) if head is not None and len(head) else None
        adapters = adapter_frames(engine, w, active_s)  # rates over the headline's seconds
        if adapters is not None:
            out.update(adapters)
    return out
