"""The live bundle from the summaries the inserts keep up to date.

``batchscope.storage.summaries`` adds every written row, in the insert's transaction, to
per-second (``summary_stats``) and per-5-second (``summary_latency``, ``summary_shapes``)
rows, and to per-minute ones; ``summary_frames`` reads the window's whole minutes from
the minute rows and its edges from the fine ones, so its cost follows the window's
length, not the traffic in it. Counts, sums and means are exact, over the window's whole
seconds; latency percentiles are exact from the raw rows while the window holds at most
``exact_max_ok`` completed requests, else read from the 5-second latency histograms
(each the upper bound of its bucket: at most 7.5 % above the exact value). The
helpers that read the summary tables (``summary_frame``, ``hist_quantiles``) serve the
fleet queries too.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from sqlalchemy import Connection, Engine

from batchscope.analysis.queries.catalog import events
from batchscope.analysis.queries.raw import (
    batch_rates, bucket_times, device_timeline, exact_pcts, exact_priority_pcts, exact_timeline_pcts,
    finish_headline, items_per_compute_s, last_batch, request_rates, share_of, tail_breakdown, waste)
from batchscope.analysis.queries.window import PCTS, Resolution, Window, read_frame
from batchscope.storage import summaries

_COUNTS = ("requests", "ok", "rejected", "expired", "failed", "batches", "batch_items", "queue_depth_sum",
           "queue_depth_count", "oom_batches", "real_elements", "padded_elements")
_SUMS = ("ok_latency_sum_s", "ok_queue_wait_sum_s", "batch_compute_sum_s", "batch_queue_wait_sum_s")


def _summary_resolution(exact: bool, group_s: float) -> Resolution:
    detail = ("exact percentiles" if exact else
              f"percentiles per {group_s:g} s from latency histograms, at most 7.5 % high")
    return Resolution("summaries", 1.0, f"per-second summaries ({detail})")


def owner_sql(w: Window, *, model: bool = True) -> str:
    parts = []
    if model and w.model is not None:
        parts.append("AND model = :model")
    if w.instance_id is not None:
        parts.append("AND instance_id = :inst")
    return " ".join(parts)


def summary_frame(engine: Engine | Connection, table: str, select_sql: str, w: Window, s0: int, s1: int,
                  rest: str, *, minutes: bool, model: bool = True, **params) -> pd.DataFrame:
    """``SELECT select_sql FROM table WHERE`` (its rows over ``[s0, s1)``, the window's
    whole minutes from the minute rows when ``minutes``) ``rest``."""
    where, spans = summaries.span_where(table, s0, s1, minutes=minutes)
    return read_frame(engine, f"SELECT {select_sql} FROM {table} WHERE {where} {owner_sql(w, model=model)} {rest}",
                      {**spans, "model": w.model, "inst": w.instance_id, **params})


def _seconds(engine: Engine, w: Window, bucket_s: float, s0: int, s1: int) -> pd.DataFrame:
    """``summary_stats`` over the window per time bucket ``b`` (counts as integers:
    PostgreSQL sums integers into ``numeric``)."""
    counts = ", ".join(f"CAST(SUM({c}) AS BIGINT) AS {c}" for c in _COUNTS)
    sums = ", ".join(f"SUM({c}) AS {c}" for c in _SUMS)
    return summary_frame(engine, "summary_stats", f"""
        CAST(FLOOR(start_s / :bucket) AS BIGINT) AS b, {counts}, {sums},
        MAX(queue_depth_max) AS queue_depth_max, MAX(max_batch_size_max) AS max_batch_size_max,
        MIN(CASE WHEN requests > 0 THEN start_s END) AS first_s,
        MAX(CASE WHEN batches > 0 THEN start_s END) AS last_batch_s""", w, s0, s1,
        "GROUP BY 1 ORDER BY 1", minutes=bucket_s % summaries.MINUTE_S == 0, bucket=bucket_s)


def _model_share_from_seconds(engine: Engine, w: Window, s0: int, s1: int) -> pd.DataFrame:
    df = summary_frame(engine, "summary_stats", """
        model, CAST(SUM(batches) AS BIGINT) AS batches, CAST(SUM(batch_items) AS BIGINT) AS items,
        SUM(batch_compute_sum_s) AS compute_total_s, SUM(batch_queue_wait_sum_s) AS wait_sum_s""",
        w, s0, s1, "GROUP BY model HAVING SUM(batches) > 0 ORDER BY model", minutes=True, model=False)
    df["queue_wait_mean_s"] = df.pop("wait_sum_s") / df["batches"]
    return share_of(df)


def _slots(engine: Engine, w: Window, group_s: float, s0: int, s1: int) -> pd.DataFrame:
    """``summary_latency`` of the window per ``group_s``-second group ``g``, priority,
    outcome and latency bucket (whole slots from the one holding the window's start)."""
    return summary_frame(engine, "summary_latency", """
        CAST(FLOOR(start_s / :group) AS BIGINT) AS g, priority, outcome, bucket,
        CAST(SUM(n) AS BIGINT) AS n, SUM(latency_sum_s) AS latency_sum_s,
        SUM(queue_wait_sum_s) AS queue_wait_sum_s""", w, s0, s1, "GROUP BY 1, 2, 3, 4",
        minutes=group_s % summaries.MINUTE_S == 0, group=group_s)


def _shapes(engine: Engine, w: Window, s0: int, s1: int) -> pd.DataFrame:
    return summary_frame(engine, "summary_shapes", """
        batch_size, bucket, outcome, CAST(SUM(n) AS BIGINT) AS batches,
        SUM(compute_sum_s) AS compute_total_s, CAST(SUM(real_elements) AS BIGINT) AS real_elements,
        CAST(SUM(padded_elements) AS BIGINT) AS padded_elements, MAX(max_batch_size_max) AS max_batch_size""",
        w, s0, s1, "GROUP BY 1, 2, 3 ORDER BY 1, 2", minutes=True)


def hist_quantiles(keys: np.ndarray, buckets: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, dict]:
    """Nearest-rank percentiles of histogram rows per key: each the upper bound of the
    bucket holding rank ``ceil(p * n / 100)``. Returns the keys and ``latency_p<p>`` arrays."""
    order = np.lexsort((buckets, keys))
    keys, buckets, n = keys[order], buckets[order], n[order]
    groups, starts = np.unique(keys, return_index=True)
    cum = np.cumsum(n)
    before = np.concatenate(([0], cum))[starts]
    totals = np.append(before[1:], cum[-1] if len(cum) else 0) - before
    out = {}
    for p in PCTS:
        idx = np.searchsorted(cum, before + (p * totals + 99) // 100, side="left")
        b = buckets[np.minimum(idx, len(buckets) - 1)]
        out[f"latency_p{p}"] = np.where(b >= summaries.OVERFLOW_BUCKET, math.inf,
                                        summaries.MIN_LATENCY_S * 10.0 ** (b / summaries.BUCKETS_PER_DECADE))
    return groups, out


def ints(series: pd.Series) -> np.ndarray:
    return series.to_numpy(dtype="int64")


def _summary_headline(engine: Engine, w: Window, sec: pd.DataFrame, pcts: dict,
                      resolution: Resolution) -> pd.DataFrame:
    tot = {c: int(sec[c].sum()) for c in _COUNTS}
    tot.update({c: float(sec[c].sum()) for c in _SUMS})
    n_ok, n_batches = tot["ok"], tot["batches"]
    some = n_batches > 0  # a mean or sum over no batches is None, as an SQL aggregate over no rows

    def per_batch(col: str):
        return tot[col] / n_batches if some else None

    head = {"requests": tot["requests"], "ok": n_ok, "rejected": tot["rejected"], "expired": tot["expired"],
            "errors": tot["failed"], "queue_wait_mean_s": tot["ok_queue_wait_sum_s"] / n_ok if n_ok else None,
            "first_finished_at": float(sec["first_s"].min()) if tot["requests"] else None, **pcts,
            "batches": n_batches, "mean_batch_size": per_batch("batch_items"),
            "batched_items": tot["batch_items"] if some else None,
            "max_batch_size_seen": sec["max_batch_size_max"].max() if some else None,
            "compute_mean_s": per_batch("batch_compute_sum_s"),
            "compute_total_s": tot["batch_compute_sum_s"] if some else None,
            "queue_depth_mean": (tot["queue_depth_sum"] / tot["queue_depth_count"]
                                 if tot["queue_depth_count"] else None),
            "oom_batches": tot["oom_batches"] if some else None,
            "real_elements": tot["real_elements"] if some else None,
            "padded_elements": tot["padded_elements"] if some else None,
            **last_batch(engine, w, since=float(sec["last_batch_s"].max()) if some else None)}
    return finish_headline(engine, w, head, resolution)


def summary_frames(engine: Engine, w: Window, bucket_s: float, *,
                   exact_max_ok: int) -> dict[str, pd.DataFrame]:
    """The live bundle's frames from the summaries, over the window in whole seconds
    (latency histograms and batch shapes in whole 5-second slots); percentiles exact
    from the raw rows while the window holds at most ``exact_max_ok`` completed requests."""
    s0, s1 = math.ceil(w.start_s), math.ceil(w.end_s)
    sec = _seconds(engine, w, bucket_s, s0, s1)
    exact = int(sec["ok"].sum()) <= exact_max_ok
    group_s = max(bucket_s, float(summaries.SLOT_S))  # percentiles per bucket, or per slot when shorter
    slots = _slots(engine, w, group_s, s0, s1)
    ok = slots[slots["outcome"] == "ok"]
    g, bucket, n = ints(ok["g"]), ints(ok["bucket"]), ints(ok["n"])
    if exact:
        head_pcts = exact_pcts(engine, w)
    else:
        _, whole = hist_quantiles(np.zeros(len(n), dtype="int64"), bucket, n)
        head_pcts = {k: float(v[0]) if len(v) else math.nan for k, v in whole.items()}
    out = {"headline": _summary_headline(engine, w, sec, head_pcts, _summary_resolution(exact, group_s))}

    req = sec[sec["requests"] > 0]
    req_t = pd.DataFrame({"b": req["b"], "requests": req["requests"], "ok": req["ok"],
                          "rejected": req["rejected"], "expired": req["expired"], "errors": req["failed"]})
    if exact:
        req_t = req_t.merge(exact_timeline_pcts(engine, w, bucket_s), on="b", how="left")
    else:
        groups, pcts = hist_quantiles(g, bucket, n)
        group_of = (req_t["b"] * bucket_s // group_s).astype("int64")
        for key, values in pcts.items():
            req_t[key] = group_of.map(pd.Series(values, index=groups))
    out["requests_t"] = request_rates(bucket_times(req_t.reset_index(drop=True), bucket_s),
                                      bucket_s, w)

    bat = sec[sec["batches"] > 0]
    out["batches_t"] = batch_rates(bucket_times(pd.DataFrame({
        "b": bat["b"], "batches": bat["batches"], "items": bat["batch_items"],
        "mean_batch_size": bat["batch_items"] / bat["batches"], "max_batch_size": bat["max_batch_size_max"],
        "queue_wait_mean_s": bat["batch_queue_wait_sum_s"] / bat["batches"],
        "compute_mean_s": bat["batch_compute_sum_s"] / bat["batches"],
        "queue_depth_mean": bat["queue_depth_sum"] / bat["queue_depth_count"].where(bat["queue_depth_count"] > 0),
        "queue_depth_max": bat["queue_depth_max"],
    }).reset_index(drop=True), bucket_s), bucket_s, w)
    out["device_t"] = device_timeline(engine, w, bucket_s)

    shapes = _shapes(engine, w, s0, s1)
    sizes = shapes[shapes["outcome"] == "ok"].groupby("batch_size", as_index=False).agg(
        batches=("batches", "sum"), compute_total_s=("compute_total_s", "sum"),
        max_batch_size=("max_batch_size", "max"))
    sizes.insert(3, "compute_mean_s", sizes["compute_total_s"] / sizes["batches"])
    out["batch_sizes"] = items_per_compute_s(sizes)
    out["padding"] = waste(shapes[shapes["bucket"] != summaries.NO_LENGTH_BUCKET].groupby(
        "bucket", as_index=False)[["batches", "real_elements", "padded_elements"]].sum())
    out["priority"] = _summary_priorities(engine, w, slots, ok, exact)
    out["model_share"] = _model_share_from_seconds(engine, w, s0, s1)
    out["events"] = events(engine, w)
    out["tail"] = _summary_tail(engine, w, ok, head_pcts["latency_p99"], exact)
    return out


def _summary_priorities(engine: Engine, w: Window, slots: pd.DataFrame, ok: pd.DataFrame,
                        exact: bool) -> pd.DataFrame:
    """Per priority level: requests by outcome, mean queue wait, latency percentiles."""
    counts = slots.pivot_table(index="priority", columns="outcome", values="n", aggfunc="sum", fill_value=0)
    prio = pd.DataFrame({"priority": counts.index.to_numpy(dtype="int64"),
                         "requests": counts.sum(axis=1).to_numpy(dtype="int64")})
    for outcome in ("ok", "expired", "rejected"):
        prio[outcome] = counts[outcome].to_numpy(dtype="int64") if outcome in counts else 0
    waits = ok.groupby("priority")["queue_wait_sum_s"].sum()
    prio["queue_wait_mean_s"] = prio["priority"].map(waits) / prio["ok"].where(prio["ok"] > 0)
    if exact:
        return prio.merge(exact_priority_pcts(engine, w), on="priority", how="left")
    levels, pcts = hist_quantiles(ints(ok["priority"]), ints(ok["bucket"]), ints(ok["n"]))
    return prio.merge(pd.DataFrame({"priority": levels, **pcts}), on="priority", how="left")


def _summary_tail(engine: Engine, w: Window, ok: pd.DataFrame, p99: float, exact: bool) -> pd.DataFrame:
    """The requests at or above p99: their mean queue wait and compute (from the
    histogram buckets from p99's up when the percentiles come from histograms)."""
    if exact:
        return tail_breakdown(engine, w, float(p99) if pd.notna(p99) else math.inf)
    upper = summaries.MIN_LATENCY_S * 10.0 ** (ok["bucket"] / summaries.BUCKETS_PER_DECADE)
    tail = ok[(upper >= p99 * (1 - 1e-12)) | (ok["bucket"] >= summaries.OVERFLOW_BUCKET)]
    n = int(tail["n"].sum())
    wait, lat = float(tail["queue_wait_sum_s"].sum()), float(tail["latency_sum_s"].sum())
    return pd.DataFrame([{"requests": n, "queue_wait_mean_s": wait / n if n else None,
                          "compute_mean_s": (lat - wait) / n if n else None}])
