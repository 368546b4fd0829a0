"""The live bundle for a window reaching back before the raw rows.

Retention summarises raw rows older than the raw retention into per-interval roll-ups
and deletes them (``batchscope.storage.retention``); such a window is answered from the
roll-ups before the raw rows begin and the live summaries after, summarised alike, in the
roll-ups' intervals, with histogram-bound percentiles.
"""

from __future__ import annotations

import dataclasses
import math

import pandas as pd
from sqlalchemy import Engine

from batchscope.analysis.queries.catalog import events
from batchscope.analysis.queries.raw import (
    batch_rates, bucket_times, device_timeline, finish_headline, request_rates, share_of)
from batchscope.analysis.queries.window import PCTS, Resolution, Window
from batchscope.storage import retention


def rollups_resolution(interval_s: float) -> Resolution:
    return Resolution("rollups", interval_s,
                      f"{interval_s:g} s roll-ups (older than the raw retention; percentiles are "
                      "histogram bucket bounds)")


def reaches_rollups(engine: Engine, w: Window) -> bool:
    """Whether part of ``w`` lies before the raw rows, where only roll-ups are left."""
    with engine.connect() as conn:
        boundary = retention.rolled_until(conn)
    return boundary is not None and w.start_s < boundary


#: the columns of the frames the roll-ups cannot fill (they are left empty)
_PADDING_COLUMNS = ("bucket", "batches", "real_elements", "padded_elements", "waste_fraction")
_PRIORITY_COLUMNS = ("priority", "requests", "ok", "expired", "rejected", "queue_wait_mean_s",
                     *(f"latency_p{p}" for p in PCTS))


def _interval_frame(items: list) -> pd.DataFrame:
    """One row per roll-up interval: its time, model and scalar totals."""
    rows = []
    for it in items:
        t = it.totals
        rows.append({"start_s": it.start_s, "model": it.model, "requests": t.requests,
                     "ok": t.requests_ok, "rejected": t.outcomes.get("rejected", 0),
                     "expired": t.outcomes.get("expired", 0),
                     "errors": t.outcomes.get("error", 0) + t.outcomes.get("oom", 0),
                     "queue_wait_sum_s": t.queue_wait_sum_s, "batches": t.batches,
                     "items": t.batch_size_sum, "compute_total_s": t.compute_sum_s,
                     "real_elements": t.real_elements, "padded_elements": t.padded_elements})
    columns = ["start_s", "model", "requests", "ok", "rejected", "expired", "errors",
               "queue_wait_sum_s", "batches", "items", "compute_total_s", "real_elements",
               "padded_elements"]
    return pd.DataFrame(rows, columns=columns)


def _hist_pcts(hists) -> dict:
    merged = retention.merge_hists(*hists)
    out = {}
    for p in PCTS:
        q = retention.hist_quantile(merged, p / 100)
        out[f"latency_p{p}"] = math.nan if q is None else q
    return out


def _ratio(num, den):
    return num / den if den else math.nan


def rollup_frames(engine: Engine, w: Window, *, headline_only: bool = False) -> dict[str, pd.DataFrame]:
    """The live bundle's frames from per-interval totals: the roll-ups before the raw rows
    begin and the live summaries after, summarised alike. What roll-ups do not keep
    (per-batch settings, queue depths, per-size compute, padding per bucket, priorities,
    the tail) is left empty; device samples, events and generation steps are read as they
    are."""
    with engine.connect() as conn:
        every = retention.intervals(conn, start_s=w.start_s, end_s=w.end_s, instance_id=w.instance_id)
    items = [it for it in every if w.model is None or it.model == w.model]
    interval_s = max((it.interval_s for it in items), default=60.0)
    frame = _interval_frame(items)
    n_ok, n_batches = int(frame["ok"].sum()), int(frame["batches"].sum())
    head = {"requests": int(frame["requests"].sum()), "ok": n_ok,
            "rejected": int(frame["rejected"].sum()), "expired": int(frame["expired"].sum()),
            "errors": int(frame["errors"].sum()),
            "queue_wait_mean_s": _ratio(frame["queue_wait_sum_s"].sum(), n_ok),
            "first_finished_at": frame["start_s"].min() if len(frame) else None,
            **_hist_pcts(it.totals.latency_hist for it in items),
            "batches": n_batches, "mean_batch_size": _ratio(frame["items"].sum(), n_batches),
            "batched_items": int(frame["items"].sum()), "max_batch_size_seen": None,
            "compute_mean_s": _ratio(frame["compute_total_s"].sum(), n_batches),
            "compute_total_s": float(frame["compute_total_s"].sum()), "queue_depth_mean": None,
            "oom_batches": None, "real_elements": int(frame["real_elements"].sum()),
            "padded_elements": int(frame["padded_elements"].sum()),
            **dict.fromkeys(("max_batch_size", "queue_depth_last", "policy", "settings_version"))}
    out = {"headline": finish_headline(engine, w, head, rollups_resolution(interval_s))}
    if headline_only:
        return out
    bucket = max(w.bucket_s(), interval_s)
    frame["b"] = (frame["start_s"] // bucket).astype("int64")
    sums = frame.groupby("b", as_index=False).sum(numeric_only=True)
    hists: dict[int, list] = {}
    for it, b in zip(items, frame["b"]):
        hists.setdefault(int(b), []).append(it.totals.latency_hist)
    req_t = sums[["b", "requests", "ok", "rejected", "expired", "errors"]].copy()
    for p in PCTS:
        req_t[f"latency_p{p}"] = [_hist_pcts(hists[b])[f"latency_p{p}"] for b in sums["b"]]
    # a roll-up interval that overlaps the window counts whole, so the rates are over the
    # whole intervals: the window widened to their edges
    whole = dataclasses.replace(w, start_s=math.floor(w.start_s / interval_s) * interval_s,
                                end_s=math.ceil(w.end_s / interval_s) * interval_s)
    out["requests_t"] = request_rates(bucket_times(req_t, bucket), bucket, whole)
    bat = sums[sums["batches"] > 0].reset_index(drop=True)
    out["batches_t"] = batch_rates(bucket_times(pd.DataFrame({
        "b": bat["b"], "batches": bat["batches"], "items": bat["items"],
        "mean_batch_size": bat["items"] / bat["batches"], "max_batch_size": math.nan,
        "queue_wait_mean_s": math.nan, "compute_mean_s": bat["compute_total_s"] / bat["batches"],
        "queue_depth_mean": math.nan, "queue_depth_max": math.nan}), bucket), bucket, whole)
    out["device_t"] = device_timeline(engine, w, bucket)
    sizes = retention.merge_hists(*(it.totals.batch_size_hist for it in items))
    out["batch_sizes"] = pd.DataFrame(
        [{"batch_size": int(k), "batches": n} for k, n in sorted(sizes.items(), key=lambda kv: int(kv[0]))],
        columns=["batch_size", "batches"]).assign(compute_total_s=math.nan, compute_mean_s=math.nan,
                                                  max_batch_size=math.nan, items_per_compute_s=math.nan)
    out["padding"] = pd.DataFrame(columns=list(_PADDING_COLUMNS))
    out["priority"] = pd.DataFrame(columns=list(_PRIORITY_COLUMNS))
    share = _interval_frame(every).groupby("model", as_index=False)[
        ["batches", "items", "compute_total_s", "queue_wait_sum_s", "ok"]].sum()
    share["queue_wait_mean_s"] = share.pop("queue_wait_sum_s") / share.pop("ok").where(lambda x: x > 0)
    out["model_share"] = share_of(share[share["batches"] > 0].reset_index(drop=True))
    out["events"] = events(engine, w)
    out["tail"] = pd.DataFrame([{"requests": None, "queue_wait_mean_s": None, "compute_mean_s": None}])
    return out
