"""The live bundle's frames aggregated from the raw rows, with exact percentiles.

What the summaries stand for: ``raw_bundle`` is the whole bundle made of these, which
tests and benchmarks compare with ``live_bundle``. The frames' shapes (rates per bucket,
items per compute second, padding waste, device share) are finished here for every
source alike (``request_rates`` ... ``share_of``). The headline's device figures, drops
and rates come from ``finish_headline``, and the settings of the newest batch from
``last_batch``, whatever the rest of the headline came from.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from batchscope.analysis.queries.catalog import events
from batchscope.analysis.queries.window import (
    RAW, Resolution, Window, bucket_index, count_if, in_window, pct_select, ranked, read_frame)


# -- headline -------------------------------------------------------------------------
def raw_headline(engine: Engine, w: Window) -> pd.DataFrame:
    where, params = in_window(w, "finished_at")
    req = read_frame(engine, f"""
        SELECT COUNT(*) AS requests, COALESCE({count_if("outcome = 'ok'")}, 0) AS ok,
               COALESCE({count_if("outcome = 'rejected'")}, 0) AS rejected,
               COALESCE({count_if("outcome = 'expired'")}, 0) AS expired,
               COALESCE({count_if("outcome IN ('error', 'oom')")}, 0) AS errors,
               AVG(CASE WHEN outcome = 'ok' THEN queue_wait_s END) AS queue_wait_mean_s,
               MIN(finished_at) AS first_finished_at
        FROM requests WHERE {where}""", params)
    where_b, params_b = in_window(w, "ended_at")
    bat = read_frame(engine, f"""
        SELECT COUNT(*) AS batches, AVG(batch_size) AS mean_batch_size,
               SUM(batch_size) AS batched_items, MAX(max_batch_size) AS max_batch_size_seen,
               AVG(compute_s) AS compute_mean_s, SUM(compute_s) AS compute_total_s,
               AVG(queue_depth) AS queue_depth_mean,
               SUM(CASE WHEN outcome = 'oom' THEN 1 ELSE 0 END) AS oom_batches,
               SUM(real_elements) AS real_elements, SUM(padded_elements) AS padded_elements
        FROM batches WHERE {where_b}""", params_b)
    row = {**req.iloc[0].to_dict(), **exact_pcts(engine, w), **bat.iloc[0].to_dict(),
           **last_batch(engine, w)}
    return finish_headline(engine, w, row, RAW)


def exact_pcts(engine: Engine, w: Window) -> dict:
    """The window's exact latency percentiles (``latency_p50`` ...) from the raw rows."""
    where, params = in_window(w, "finished_at")
    return read_frame(engine, f"""
        SELECT {pct_select('latency_s', 'latency')}
        FROM (SELECT latency_s, {ranked('latency_s')} FROM requests
              WHERE {where} AND outcome = 'ok') AS ranked""", params).iloc[0].to_dict()


def last_batch(engine: Engine, w: Window, since: float | None = None) -> dict:
    """The settings the newest batch in the window ran with (None when there is none);
    ``since``: no batch of the window ended before it (the search starts there)."""
    where_b, params_b = in_window(w if since is None else Window(max(w.start_s, since), w.end_s, w.model,
                                                              w.instance_id), "ended_at")
    # without a model or instance no index orders by time: the newest rows come last
    order = "ended_at DESC" if w.model or w.instance_id else "id DESC"
    last = read_frame(engine, f"""
        SELECT max_batch_size, queue_depth, policy, settings_version FROM batches
        WHERE {where_b} ORDER BY {order} LIMIT 1""", params_b)
    if not len(last):
        return dict.fromkeys(("max_batch_size", "queue_depth_last", "policy", "settings_version"))
    one = last.iloc[0]
    return {"max_batch_size": one["max_batch_size"], "queue_depth_last": one["queue_depth"],
            "policy": one["policy"], "settings_version": one["settings_version"]}


def finish_headline(engine: Engine, w: Window, row: dict, resolution: "Resolution") -> pd.DataFrame:
    """``row`` with the device figures, drops, rates and resolution added, as one row."""
    where_d, params_d = in_window(w, "at", model=False)
    dev = read_frame(engine, f"""
        SELECT AVG(utilization_pct) AS utilization_mean_pct,
               MAX(memory_used_bytes) AS memory_used_max_bytes,
               MAX(memory_total_bytes) AS memory_total_bytes,
               (SELECT utilization_pct FROM device_samples WHERE {where_d}
                ORDER BY at DESC LIMIT 1) AS utilization_last_pct,
               (SELECT memory_used_bytes FROM device_samples WHERE {where_d}
                ORDER BY at DESC LIMIT 1) AS memory_used_last_bytes
        FROM device_samples WHERE {where_d}""", params_d)
    inst = "WHERE id = :inst" if w.instance_id else ""
    drops = read_frame(engine, f"SELECT COALESCE(SUM(records_dropped), 0) AS records_dropped "
                        f"FROM runtime_instances {inst}", {"inst": w.instance_id})
    row = {**row, **dev.iloc[0].to_dict(), **drops.iloc[0].to_dict(), "window_s": w.duration_s}
    active_s = active_seconds(w, row.get("first_finished_at"))
    row["active_s"] = active_s
    row["requests_per_s"] = row["requests"] / active_s
    row["ok_per_s"] = row["ok"] / active_s
    row["batches_per_s"] = row["batches"] / active_s
    row.update(source=resolution.source, resolution_s=resolution.interval_s,
               resolution=resolution.label)
    return pd.DataFrame([row])


def active_seconds(w: Window, first_finished_at: float | None) -> float:
    """The part of ``w`` that has data: from its first finished request (a runtime
    started mid-window, a window just opened after a change) to its end, at least a
    second. Every per-second rate of a window divides by this, so that rates shown side
    by side (the headline's, the per-adapter ones) agree and a window only partly
    covered does not read as a drop in traffic."""
    if first_finished_at is None or pd.isna(first_finished_at):
        return w.duration_s
    return min(w.duration_s, max(1.0, w.end_s - float(first_finished_at)))


def tail_breakdown(engine: Engine, w: Window, threshold_s: float) -> pd.DataFrame:
    """Mean queue wait vs compute of the served requests at or above ``threshold_s``."""
    where, params = in_window(w, "finished_at")
    return read_frame(engine, f"""
        SELECT COUNT(*) AS requests, AVG(queue_wait_s) AS queue_wait_mean_s,
               AVG(latency_s - queue_wait_s) AS compute_mean_s
        FROM requests WHERE {where} AND outcome = 'ok' AND latency_s >= :thr""",
               {**params, "thr": threshold_s})


# -- over time ------------------------------------------------------------------------
def bucket_times(df: pd.DataFrame, bucket_s: float) -> pd.DataFrame:
    """``b`` (bucket index) replaced by ``t``, the bucket's start in wall seconds."""
    df.insert(0, "t", df.pop("b").astype("float64") * bucket_s)
    return df


def request_timeline(engine: Engine, w: Window, bucket_s: float | None = None) -> pd.DataFrame:
    """Per time bucket: request counts by outcome and exact latency percentiles."""
    bucket_s = bucket_s or w.bucket_s()
    where, params = in_window(w, "finished_at")
    params["bucket"] = bucket_s
    bucket_expr = bucket_index("finished_at")
    counts = read_frame(engine, f"""
        SELECT {bucket_expr} AS b, COUNT(*) AS requests, {count_if("outcome = 'ok'")} AS ok,
               {count_if("outcome = 'rejected'")} AS rejected,
               {count_if("outcome = 'expired'")} AS expired,
               {count_if("outcome IN ('error', 'oom')")} AS errors
        FROM requests WHERE {where} GROUP BY 1 ORDER BY b""", params)
    return request_rates(bucket_times(counts.merge(exact_timeline_pcts(engine, w, bucket_s),
                                                     on="b", how="left"), bucket_s), bucket_s, w)


def exact_timeline_pcts(engine: Engine, w: Window, bucket_s: float) -> pd.DataFrame:
    """Per time bucket ``b``: the exact latency percentiles from the raw rows."""
    where, params = in_window(w, "finished_at")
    params["bucket"] = bucket_s
    bucket_expr = bucket_index("finished_at")
    return read_frame(engine, f"""
        SELECT b, {pct_select('latency_s', 'latency')}
        FROM (SELECT {bucket_expr} AS b, latency_s, {ranked('latency_s', bucket_expr)}
              FROM requests WHERE {where} AND outcome = 'ok') AS ranked GROUP BY b""", params)


def covered_s(df: pd.DataFrame, bucket_s: float, w: Window | None) -> Any:
    """The seconds of each bucket (``df["t"]``, its start) that lie in window ``w``: the
    first bucket may start before the window and the last end after it (a live window's
    last is still filling), so a count over either is a rate over less than
    ``bucket_s``. At least a second (or the bucket, if shorter): a rate over a sliver
    is noise. ``w`` None: every bucket whole."""
    if w is None or not len(df):
        return bucket_s
    t = df["t"].to_numpy(dtype=float)
    span = np.minimum(t + bucket_s, w.end_s) - np.maximum(t, w.start_s)
    return np.clip(span, min(1.0, bucket_s), bucket_s)


def request_rates(df: pd.DataFrame, bucket_s: float, w: Window | None = None) -> pd.DataFrame:
    """Per-second rates of a bucketed request frame, each bucket's count over the part of
    it in ``w`` (``covered_s``)."""
    if len(df):
        per = covered_s(df, bucket_s, w)
        df["requests_per_s"] = df["requests"] / per
        df["ok_per_s"] = df["ok"] / per
        df["failed_per_s"] = (df["rejected"] + df["expired"] + df["errors"]) / per
    return df


def batch_timeline(engine: Engine, w: Window, bucket_s: float | None = None) -> pd.DataFrame:
    """Per time bucket: batches, sizes, queue wait vs compute, queue depth."""
    bucket_s = bucket_s or w.bucket_s()
    where, params = in_window(w, "ended_at")
    params["bucket"] = bucket_s
    df = read_frame(engine, f"""
        SELECT {bucket_index("ended_at")} AS b, COUNT(*) AS batches,
               SUM(batch_size) AS items, AVG(batch_size) AS mean_batch_size,
               MAX(max_batch_size) AS max_batch_size, AVG(queue_wait_mean_s) AS queue_wait_mean_s,
               AVG(compute_s) AS compute_mean_s, AVG(queue_depth) AS queue_depth_mean,
               MAX(queue_depth) AS queue_depth_max
        FROM batches WHERE {where} GROUP BY 1 ORDER BY b""", params)
    return batch_rates(bucket_times(df, bucket_s), bucket_s, w)


def batch_rates(df: pd.DataFrame, bucket_s: float, w: Window | None = None) -> pd.DataFrame:
    """Per-second rates of a bucketed batch frame (as ``request_rates``)."""
    if len(df):
        per = covered_s(df, bucket_s, w)
        df["batches_per_s"] = df["batches"] / per
        df["items_per_s"] = df["items"] / per
    return df


def device_timeline(engine: Engine, w: Window, bucket_s: float | None = None) -> pd.DataFrame:
    bucket_s = bucket_s or w.bucket_s()
    where, params = in_window(w, "at", model=False)
    params["bucket"] = bucket_s
    df = read_frame(engine, f"""
        SELECT {bucket_index("at")} AS b, device, kind,
               AVG(utilization_pct) AS utilization_pct, MAX(memory_used_bytes) AS memory_used_bytes,
               MAX(memory_total_bytes) AS memory_total_bytes,
               MAX(torch_allocated_bytes) AS torch_allocated_bytes,
               MAX(process_rss_bytes) AS process_rss_bytes
        FROM device_samples WHERE {where}
        GROUP BY 1, device, kind ORDER BY device, b""", params)
    return bucket_times(df, bucket_s)


# -- distributions --------------------------------------------------------------------
def batch_sizes(engine: Engine, w: Window) -> pd.DataFrame:
    """Per batch size: batch count, compute time and items per compute second."""
    where, params = in_window(w, "ended_at")
    df = read_frame(engine, f"""
        SELECT batch_size, COUNT(*) AS batches, SUM(compute_s) AS compute_total_s,
               AVG(compute_s) AS compute_mean_s, MAX(max_batch_size) AS max_batch_size
        FROM batches WHERE {where} AND outcome = 'ok' GROUP BY batch_size ORDER BY batch_size""",
               params)
    return items_per_compute_s(df)


def items_per_compute_s(df: pd.DataFrame) -> pd.DataFrame:
    if len(df):
        df["items_per_compute_s"] = df["batch_size"] * df["batches"] / df["compute_total_s"]
    return df


def padding_by_bucket(engine: Engine, w: Window) -> pd.DataFrame:
    where, params = in_window(w, "ended_at")
    df = read_frame(engine, f"""
        SELECT bucket, COUNT(*) AS batches, SUM(real_elements) AS real_elements,
               SUM(padded_elements) AS padded_elements
        FROM batches WHERE {where} AND bucket IS NOT NULL GROUP BY bucket ORDER BY bucket""",
               params)
    return waste(df)


def waste(df: pd.DataFrame) -> pd.DataFrame:
    if len(df):
        df["waste_fraction"] = 1.0 - df["real_elements"] / df["padded_elements"].clip(lower=1)
    return df


def priority_stats(engine: Engine, w: Window) -> pd.DataFrame:
    """Per priority level: outcomes, mean queue wait and exact latency percentiles."""
    where, params = in_window(w, "finished_at")
    counts = read_frame(engine, f"""
        SELECT priority, COUNT(*) AS requests, {count_if("outcome = 'ok'")} AS ok,
               {count_if("outcome = 'expired'")} AS expired,
               {count_if("outcome = 'rejected'")} AS rejected,
               AVG(CASE WHEN outcome = 'ok' THEN queue_wait_s END) AS queue_wait_mean_s
        FROM requests WHERE {where} GROUP BY priority ORDER BY priority""", params)
    return counts.merge(exact_priority_pcts(engine, w), on="priority", how="left")


def exact_priority_pcts(engine: Engine, w: Window) -> pd.DataFrame:
    where, params = in_window(w, "finished_at")
    return read_frame(engine, f"""
        SELECT priority, {pct_select('latency_s', 'latency')}
        FROM (SELECT priority, latency_s, {ranked('latency_s', 'priority')}
              FROM requests WHERE {where} AND outcome = 'ok') AS ranked GROUP BY priority""", params)


def model_share(engine: Engine, w: Window) -> pd.DataFrame:
    """Per model (all models, ignoring the model filter): device time share and waits."""
    where, params = in_window(w, "ended_at", model=False)
    df = read_frame(engine, f"""
        SELECT model, COUNT(*) AS batches, SUM(batch_size) AS items,
               SUM(compute_s) AS compute_total_s, AVG(queue_wait_mean_s) AS queue_wait_mean_s
        FROM batches WHERE {where} GROUP BY model ORDER BY model""", params)
    return share_of(df)


def share_of(df: pd.DataFrame) -> pd.DataFrame:
    if len(df):
        df["share"] = df["compute_total_s"] / max(1e-12, float(df["compute_total_s"].sum()))
    return df


# -- generation -----------------------------------------------------------------------
#: a step's decoding sequences: its decode tokens without the proposed tokens verified
#: with them (``decode_tokens`` counts both; ``spec_draft_tokens`` is NULL without speculation)
DECODES = "(decode_tokens - COALESCE(spec_draft_tokens, 0))"
#: a step's sequences that had proposed tokens verified: ``spec_sequences`` as recorded
#: (schema version 10 on), else estimated as the step's decoding sequences when it
#: speculated (every decoding sequence of a speculating step taken to have had proposals)
SPEC_SEQUENCES = (f"COALESCE(spec_sequences, CASE WHEN spec_draft_tokens > 0 THEN {DECODES} "
                  "ELSE 0 END)")
#: the lower edges of the prefill-token classes of ``generation_prefill``
PREFILL_EDGES = (0, 1, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
#: the tops of the batch-size buckets of ``generation_speculation``: 1, 2, 3-4, 5-8, ... as
#: the runtime's speculation switch measures them
BATCH_BUCKETS = tuple(1 << i for i in range(14))


def lower_edge(col: str, edges: tuple[int, ...]) -> str:
    """The largest of ``edges`` (increasing) at most ``col``, as SQL."""
    whens = " ".join(f"WHEN {col} >= {e} THEN {e}" for e in reversed(edges[1:]))
    return f"CASE {whens} ELSE {edges[0]} END"


def upper_edge(col: str, edges: tuple[int, ...]) -> str:
    """The smallest of ``edges`` (increasing) at least ``col`` (the last beyond it), as SQL."""
    whens = " ".join(f"WHEN {col} <= {e} THEN {e}" for e in edges[:-1])
    return f"CASE {whens} ELSE {edges[-1]} END"


def generation_timeline(engine: Engine, w: Window, bucket_s: float | None = None) -> pd.DataFrame:
    """Per time bucket: sequences, tokens per step (prefill, decode and proposed), cache
    blocks, preemptions, step time, and speculation's proposed and accepted tokens with
    their rates (``speculation_rates``)."""
    bucket_s = bucket_s or w.bucket_s()
    where, params = in_window(w, "at")
    params["bucket"] = bucket_s
    df = read_frame(engine, f"""
        SELECT {bucket_index("at")} AS b, COUNT(*) AS steps,
               AVG(running) AS running, AVG(waiting) AS waiting,
               AVG(prefill_tokens + decode_tokens) AS tokens_per_step,
               AVG(prefill_tokens) AS prefill_per_step, AVG({DECODES}) AS decode_per_step,
               AVG(COALESCE(spec_draft_tokens, 0)) AS proposed_per_step,
               AVG(blocks_used) AS blocks_used, MAX(blocks_used + blocks_free) AS blocks_total,
               SUM(preemptions) AS preemptions, AVG(step_s) AS step_mean_s,
               COUNT(spec_draft_tokens) AS spec_steps,
               {count_if("spec_draft_tokens > 0")} AS speculating_steps,
               SUM(spec_draft_tokens) AS spec_draft_tokens,
               SUM(spec_accepted_tokens) AS spec_accepted_tokens,
               SUM({SPEC_SEQUENCES}) AS spec_sequences
        FROM generation_steps WHERE {where}
        GROUP BY 1 ORDER BY b""", params)
    return speculation_rates(bucket_times(df, bucket_s))


def speculation_rates(df: pd.DataFrame) -> pd.DataFrame:
    """``acceptance_rate`` (accepted over proposed tokens), ``acceptance_length`` (tokens
    a sequence gains per verification: 1 + accepted per sequence that had proposals
    verified, ``SPEC_SEQUENCES``) and ``speculating_fraction`` (of the steps with a
    proposer, those that proposed), NaN where there is nothing to divide."""
    for col in ("spec_steps", "speculating_steps", "spec_draft_tokens", "spec_accepted_tokens",
                "spec_sequences"):
        df[col] = df[col].astype("float64")
    df["acceptance_rate"] = df["spec_accepted_tokens"] / df["spec_draft_tokens"].where(
        df["spec_draft_tokens"] > 0)
    df["acceptance_length"] = 1.0 + df["spec_accepted_tokens"] / df["spec_sequences"].where(
        df["spec_sequences"] > 0)
    df["speculating_fraction"] = df["speculating_steps"] / df["spec_steps"].where(
        df["spec_steps"] > 0)
    return df


def generation_speculation(engine: Engine, w: Window) -> pd.DataFrame:
    """Per batch-size bucket (``batch_bucket``: the top of 1, 2, 3-4, 5-8, ... running
    sequences) and ``speculated`` (1: the step verified proposed tokens): steps, proposed
    and accepted tokens, decoding sequences, the sequences that had proposals verified
    (``spec_sequences``, ``SPEC_SEQUENCES``), and over the steps without prefill their
    time and the tokens they gave (``decode_step_s``, ``decode_step_tokens``: what one
    generated token costs with and without speculation)."""
    where, params = in_window(w, "at")
    decode_only = f"prefill_tokens = 0 AND {DECODES} > 0"
    return read_frame(engine, f"""
        SELECT {upper_edge("running", BATCH_BUCKETS)} AS batch_bucket,
               CASE WHEN spec_draft_tokens > 0 THEN 1 ELSE 0 END AS speculated,
               COUNT(*) AS steps, COALESCE(SUM(spec_draft_tokens), 0) AS draft_tokens,
               COALESCE(SUM(spec_accepted_tokens), 0) AS accepted_tokens,
               SUM({DECODES}) AS sequences, SUM({SPEC_SEQUENCES}) AS spec_sequences,
               {count_if(decode_only)} AS decode_steps,
               SUM(CASE WHEN {decode_only} THEN step_s ELSE 0 END) AS decode_step_s,
               SUM(CASE WHEN {decode_only} THEN {DECODES} + COALESCE(spec_accepted_tokens, 0)
                   ELSE 0 END) AS decode_step_tokens
        FROM generation_steps WHERE {where}
        GROUP BY 1, 2 ORDER BY 1, 2""", params)


def generation_prefill(engine: Engine, w: Window) -> pd.DataFrame:
    """Per class of prefill tokens in a step (``prefill_from``: the class's lower edge,
    ``PREFILL_EDGES``; 0: no prefill) and ``decoding`` (1: the step also decoded): steps,
    prefill tokens, decoding sequences, and the steps' total and longest time."""
    where, params = in_window(w, "at")
    return read_frame(engine, f"""
        SELECT {lower_edge("prefill_tokens", PREFILL_EDGES)} AS prefill_from,
               CASE WHEN {DECODES} > 0 THEN 1 ELSE 0 END AS decoding,
               COUNT(*) AS steps, SUM(prefill_tokens) AS prefill_tokens,
               SUM({DECODES}) AS decodes, SUM(step_s) AS step_s_sum, MAX(step_s) AS step_max_s
        FROM generation_steps WHERE {where}
        GROUP BY 1, 2 ORDER BY 1, 2""", params)


def generation_summary(engine: Engine, w: Window) -> pd.DataFrame:
    """Steps, preemptions, decode and generated tokens, speculation's proposed and
    accepted tokens (None without speculation), TTFT and per-token latency percentiles."""
    where, params = in_window(w, "at")
    steps = read_frame(engine, f"""
        SELECT COUNT(*) AS steps, COALESCE(SUM(preemptions), 0) AS preemptions,
               COALESCE(SUM(decode_tokens), 0) AS decode_tokens,
               COALESCE(SUM({DECODES} + COALESCE(spec_accepted_tokens, 0)), 0) AS generated_tokens,
               SUM(spec_draft_tokens) AS spec_draft_tokens,
               SUM(spec_accepted_tokens) AS spec_accepted_tokens, AVG(running) AS running_mean
        FROM generation_steps WHERE {where}""", params)
    where_r, params_r = in_window(w, "finished_at")
    req = read_frame(engine, f"""
        WITH g AS (SELECT ttft_s, tpot_s, output_tokens FROM requests
                   WHERE {where_r} AND outcome = 'ok' AND ttft_s IS NOT NULL),
        ranked AS (SELECT ttft_s, tpot_s, {ranked('ttft_s')}, {ranked('tpot_s')} FROM g)
        SELECT (SELECT COUNT(*) FROM g) AS sequences,
               (SELECT COALESCE(SUM(output_tokens), 0) FROM g) AS output_tokens,
               {pct_select('ttft_s', 'ttft')}, {pct_select('tpot_s', 'tpot')} FROM ranked""",
               params_r)
    row = {**steps.iloc[0].to_dict(), **req.iloc[0].to_dict()}
    # decode_tokens counts the proposed tokens verified too; a step generates its
    # decodes and the proposed tokens accepted
    row["tokens_per_s"] = row["generated_tokens"] / w.duration_s
    return pd.DataFrame([row])


# -- the whole bundle -------------------------------------------------------------------
def raw_bundle(engine: Engine, w: Window) -> dict[str, pd.DataFrame]:
    """The same frames as ``live_bundle``, every one aggregated from the raw rows with
    exact percentiles (what the summaries stand for; tests and benchmarks compare)."""
    bucket = w.bucket_s()
    out = {
        "headline": raw_headline(engine, w),
        "requests_t": request_timeline(engine, w, bucket),
        "batches_t": batch_timeline(engine, w, bucket),
        "device_t": device_timeline(engine, w, bucket),
        "batch_sizes": batch_sizes(engine, w),
        "padding": padding_by_bucket(engine, w),
        "priority": priority_stats(engine, w),
        "model_share": model_share(engine, w),
        "events": events(engine, w),
    }
    p99 = out["headline"].iloc[0]["latency_p99"]
    out["tail"] = tail_breakdown(engine, w, float(p99) if pd.notna(p99) else math.inf)
    return out
