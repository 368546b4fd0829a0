"""The LoRA adapters of a window, from the raw rows (``requests.adapter``,
``batches.adapters``, ``generation_steps.adapters``) and the slot cache's
``adapter_load``/``adapter_evict`` events. The slot hits are the request batches' (a
generation model keeps its adapters pinned across steps: its loads and evictions count,
its steps are not hits).

``adapter_frames`` gives, for a window whose batches or generation steps recorded
adapters (a model that takes them; None otherwise):

* ``adapters``: one row per adapter (``""`` for the base model): requests, outcomes,
  throughput and exact p50/p95/p99 latency of the answered ones;
* ``adapter_mix``: batches by the number of distinct adapters they mixed;
* ``adapter_slots``: one row: slot loads (misses), hits, evictions and evictions per
  minute over the window.
"""

from __future__ import annotations

import pandas as pd
from sqlalchemy import Engine, text

from batchscope.analysis.queries.raw import active_seconds
from batchscope.analysis.queries.window import (Window, count_if, in_window, pct_select,
                                                ranked, read_frame)

#: the label of the base model's rows (no adapter)
BASE = ""


def has_adapters(engine: Engine, w: Window) -> bool:
    """Whether any batch or generation step of the window ran an adapter (a model that
    takes adapters but ran none records 0: its page stays as before)."""
    cond, params = in_window(w, "ended_at")
    gcond, gparams = in_window(w, "at")
    with engine.connect() as conn:
        if conn.execute(text(f"SELECT 1 FROM batches WHERE {cond} AND adapters > 0 "
                             "LIMIT 1"), params).first() is not None:
            return True
        return conn.execute(text(f"SELECT 1 FROM generation_steps WHERE {gcond} AND adapters "
                                 "> 0 LIMIT 1"), gparams).first() is not None


def window_active_s(engine: Engine, w: Window) -> float:
    """The seconds of ``w`` that have data, as the headline counts them (from the
    window's first finished request, ``raw.active_seconds``)."""
    where, params = in_window(w, "finished_at")
    first = read_frame(engine, f"SELECT MIN(finished_at) AS first FROM requests WHERE {where}",
                       params)
    return active_seconds(w, first["first"].iloc[0] if len(first) else None)


def adapter_stats(engine: Engine, w: Window, active_s: float | None = None) -> pd.DataFrame:
    """Per adapter of the window's requests of models that take adapters (the base as
    ``""``): requests, ok, expired, rejected, rps (answered per second) and latency
    percentiles of the answered ones. ``rps`` divides by ``active_s``, the headline's
    seconds with data (read here when not given), so the adapters' rates add up to the
    headline's served rate instead of being diluted by the part of the window before
    the runtime started."""
    where, params = in_window(w, "finished_at")
    taking = ("(model IN (SELECT DISTINCT model FROM batches WHERE "
              + in_window(w, "ended_at", bounds=("b0", "b1"))[0] + " AND adapters IS NOT NULL)"
              " OR model IN (SELECT DISTINCT model FROM generation_steps WHERE "
              + in_window(w, "at", bounds=("b0", "b1"))[0] + " AND adapters IS NOT NULL))")
    params = {**params, "b0": w.start_s, "b1": w.end_s}
    counts = read_frame(engine, f"""
        SELECT COALESCE(adapter, '') AS adapter, COUNT(*) AS requests,
               {count_if("outcome = 'ok'")} AS ok, {count_if("outcome = 'expired'")} AS expired,
               {count_if("outcome = 'rejected'")} AS rejected
        FROM requests WHERE {where} AND {taking}
        GROUP BY COALESCE(adapter, '') ORDER BY COALESCE(adapter, '')""", params)
    pcts = read_frame(engine, f"""
        SELECT adapter, {pct_select('latency_s', 'latency')}
        FROM (SELECT COALESCE(adapter, '') AS adapter, latency_s,
                     {ranked('latency_s', "COALESCE(adapter, '')")}
              FROM requests WHERE {where} AND {taking} AND outcome = 'ok') AS ranked
        GROUP BY adapter""", params)
    if not len(counts):
        return counts.assign(rps=[], latency_p50=[], latency_p95=[], latency_p99=[])
    out = counts.merge(pcts, on="adapter", how="left")
    seconds = window_active_s(engine, w) if active_s is None else active_s
    out["rps"] = out["ok"].astype(float) / seconds
    return out


def adapter_mix(engine: Engine, w: Window) -> pd.DataFrame:
    """Batches by the number of distinct adapters they mixed (0: base rows only); a
    generation model's steps count as its batches (``requests``: their running
    sequences)."""
    where, params = in_window(w, "ended_at")
    gwhere, gparams = in_window(w, "at", bounds=("g0", "g1"))
    return read_frame(engine, f"""
        SELECT adapters, COUNT(*) AS batches, SUM(n) AS requests
        FROM (SELECT adapters, batch_size AS n FROM batches
              WHERE {where} AND adapters IS NOT NULL
              UNION ALL
              SELECT adapters, running AS n FROM generation_steps
              WHERE {gwhere} AND adapters IS NOT NULL) AS mixed
        GROUP BY adapters ORDER BY adapters""", {**params, **gparams})


def adapter_slots(engine: Engine, w: Window, active_s: float | None = None) -> pd.DataFrame:
    """One row: the slot cache over the window. ``loads`` (misses) and ``evictions``
    from the events; ``hits``: the adapters batches used without a load (each batch
    takes each of its adapters once); ``evictions_per_min`` over the seconds with data
    (``active_s``, as ``adapter_stats``)."""
    where, params = in_window(w, "at")
    ev = read_frame(engine, f"""
        SELECT {count_if("kind = 'adapter_load'")} AS loads,
               {count_if("kind = 'adapter_evict'")} AS evictions
        FROM events WHERE {where}""", params)
    bwhere, bparams = in_window(w, "ended_at")
    used = read_frame(engine, f"SELECT SUM(adapters) AS uses FROM batches WHERE {bwhere}",
                      bparams)
    loads = int(ev["loads"].fillna(0).iloc[0]) if len(ev) else 0
    evictions = int(ev["evictions"].fillna(0).iloc[0]) if len(ev) else 0
    uses = int(used["uses"].fillna(0).iloc[0]) if len(used) else 0
    minutes = (window_active_s(engine, w) if active_s is None else active_s) / 60.0
    return pd.DataFrame([{"loads": loads, "misses": loads, "hits": max(0, uses - loads),
                          "evictions": evictions, "evictions_per_min": evictions / minutes,
                          "minutes": minutes}])


def adapter_frames(engine: Engine, w: Window,
                   active_s: float | None = None) -> dict[str, pd.DataFrame] | None:
    """``adapters``, ``adapter_mix`` and ``adapter_slots`` of the window, or None when
    no batch of it recorded adapters. ``active_s``: the headline's seconds with data,
    which the rates divide by (read from the window when not given)."""
    if not has_adapters(engine, w):
        return None
    if active_s is None:
        active_s = window_active_s(engine, w)
    return {"adapters": adapter_stats(engine, w, active_s), "adapter_mix": adapter_mix(engine, w),
            "adapter_slots": adapter_slots(engine, w, active_s)}
