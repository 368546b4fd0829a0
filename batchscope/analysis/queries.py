"""Read queries of the dashboard: ``(engine, window) -> pandas.DataFrame``.

``live_bundle`` runs every query of one live refresh. It reads the summaries the
inserts keep up to date (``batchscope.storage.summaries``), so its cost follows the
window's length, not the traffic in it: counts, sums and means per second, exactly;
latency percentiles exact from the raw rows while the window holds at most
``EXACT_PERCENTILES_MAX_OK`` completed requests, else from 5-second latency histograms
(each the upper bound of its bucket: at most 7.5 % above the exact value). A window
reaching back before the raw rows (rolled up by retention) is answered from the
roll-ups, in their intervals. The headline row says which (``source``,
``resolution_s``, ``resolution``).

The other public functions aggregate the raw rows in SQL: time buckets are
``FLOOR(t / :bucket)``, counts and sums SQL aggregates, percentiles exact nearest-rank
values picked with window functions (``ROW_NUMBER() OVER (ORDER BY x)``; rank
``ceil(p * n / 100)``); ``raw_bundle`` is the live bundle made of them. The SQL is the
same on SQLite and PostgreSQL: counts are ``SUM(CASE ...)``, every subquery has an
alias, every selected column is grouped by or aggregated, and the numbers PostgreSQL
returns as ``numeric`` (sums and means of integers) come back as floats.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from decimal import Decimal

import numpy as np
import pandas as pd
from sqlalchemy import Engine, text

from batchscope.storage import retention, summaries

#: percentiles reported everywhere (integers, so the rank is exact integer math)
PCTS = (50, 95, 99)
NICE_BUCKETS_S = (1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 21600, 86400)


@dataclass(frozen=True)
class Window:
    """A time range (wall seconds) and optional model / instance filters."""

    start_s: float
    end_s: float
    model: str | None = None
    instance_id: str | None = None

    @classmethod
    def last(cls, minutes: float, *, now: float, model: str | None = None,
             instance_id: str | None = None) -> "Window":
        return cls(now - minutes * 60.0, now, model, instance_id)

    @property
    def duration_s(self) -> float:
        return max(1e-9, self.end_s - self.start_s)

    def bucket_s(self, target_points: int = 60) -> float:
        """A round bucket width giving about ``target_points`` points."""
        raw = self.duration_s / target_points
        for step in NICE_BUCKETS_S:
            if step >= raw:
                return float(step)
        return float(NICE_BUCKETS_S[-1])

    def shifted(self, by_s: float) -> "Window":
        return Window(self.start_s + by_s, self.end_s + by_s, self.model, self.instance_id)


@dataclass(frozen=True)
class Resolution:
    """Where a window's numbers come from, for the page to say."""

    #: raw (the raw rows) | summaries (the live summaries) | rollups (older than the raw rows)
    source: str
    #: the length of the intervals the counts come in (0 for raw rows)
    interval_s: float
    #: what the page shows, e.g. "per-second summaries (exact percentiles)"
    label: str


RAW = Resolution("raw", 0.0, "raw rows (exact percentiles)")


def _rollups(interval_s: float) -> Resolution:
    return Resolution("rollups", interval_s,
                      f"{interval_s:g} s roll-ups (older than the raw retention; percentiles are "
                      "histogram bucket bounds)")


def _where(w: Window, time_col: str, *, model: bool = True) -> tuple[str, dict]:
    parts = [f"{time_col} >= :t0", f"{time_col} < :t1"]
    params: dict = {"t0": w.start_s, "t1": w.end_s}
    if model and w.model is not None:
        parts.append("model = :model")
        params["model"] = w.model
    if w.instance_id is not None:
        parts.append("instance_id = :inst")
        params["inst"] = w.instance_id
    return " AND ".join(parts), params


def _df(engine: Engine, sql: str, params: dict) -> pd.DataFrame:
    with engine.connect() as conn:
        result = conn.execute(text(sql), params)
        columns = list(result.keys())
        rows = list(map(tuple, result.fetchall()))  # plain tuples: pandas' fast path
    df = pd.DataFrame.from_records(rows, columns=columns)
    for col in df.columns:  # PostgreSQL's numeric (SUM and AVG of integers) as floats
        if df[col].dtype == object:
            values = df[col].dropna()
            if len(values) and isinstance(values.iloc[0], Decimal):
                df[col] = pd.to_numeric(df[col].map(lambda v: float(v) if isinstance(v, Decimal) else v))
    return df


def _count(condition: str) -> str:
    """How many rows match ``condition`` (``SUM(condition)`` is SQLite only)."""
    return f"SUM(CASE WHEN {condition} THEN 1 ELSE 0 END)"


def _bucket(col: str) -> str:
    """The index of the ``:bucket``-second interval ``col`` falls in (a whole number;
    a plain ``CAST`` rounds on PostgreSQL instead of truncating)."""
    return f"CAST(FLOOR({col} / :bucket) AS BIGINT)"


def _pct_select(col: str, prefix: str) -> str:
    """``MAX(CASE WHEN rn = ceil(p*n/100) ...)`` columns for each percentile."""
    return ", ".join(f"MAX(CASE WHEN rn_{col} = ({p} * n_{col} + 99) / 100 THEN {col} END)"
                     f" AS {prefix}_p{p}" for p in PCTS)


def _ranked(col: str, partition: str = "") -> str:
    over = f"PARTITION BY {partition} " if partition else ""
    return (f"ROW_NUMBER() OVER ({over}ORDER BY {col}) AS rn_{col}, "
            f"COUNT(*) OVER ({over.strip()}) AS n_{col}")


def nearest_rank(values, pct: float) -> float:
    """The same nearest-rank percentile in Python (used by tests and reports)."""
    xs = sorted(values)
    if not xs:
        return math.nan
    k = max(1, math.ceil(pct * len(xs) / 100))
    return xs[k - 1]


# -- discovery ------------------------------------------------------------------------
def models(engine: Engine, instance_id: str | None = None) -> list[str]:
    """Models known from published settings and instance registrations."""
    names: set[str] = set()
    with engine.connect() as conn:
        q = "SELECT model FROM model_settings" + (" WHERE instance_id = :i" if instance_id else "")
        names.update(r[0] for r in conn.execute(text(q), {"i": instance_id}))
        q = "SELECT models_json FROM runtime_instances" + (" WHERE id = :i" if instance_id else "")
        for (raw,) in conn.execute(text(q), {"i": instance_id}):
            try:
                names.update(str(m) for m in json.loads(raw or "[]"))
            except (ValueError, TypeError):
                continue
    return sorted(names)


def model_kinds(engine: Engine, instance_id: str | None = None) -> dict[str, str]:
    """Each model's published kind ("request", "generate", ...) from ``model_settings``."""
    q = "SELECT model, kind FROM model_settings" + (" WHERE instance_id = :i" if instance_id else "")
    with engine.connect() as conn:
        return {str(m): str(k or "request") for m, k in conn.execute(text(q), {"i": instance_id})}


def instances(engine: Engine) -> pd.DataFrame:
    return _df(engine, "SELECT id, host, pid, models_json, url, device, version, started_at, "
                       "last_seen_at, stopped_at, records_dropped FROM runtime_instances "
                       "ORDER BY last_seen_at DESC", {})


# -- headline -------------------------------------------------------------------------
def headline(engine: Engine, w: Window) -> pd.DataFrame:
    """One row: throughput, latency percentiles, batch sizes, outcomes, device, drops,
    and where the numbers come from (``source``, ``resolution_s``, ``resolution``).
    A window older than the raw rows is answered from the roll-ups (see ``live_bundle``)."""
    if _reaches_rollups(engine, w):
        return _rollup_frames(engine, w, headline_only=True)["headline"]
    return _raw_headline(engine, w)


def _raw_headline(engine: Engine, w: Window) -> pd.DataFrame:
    where, params = _where(w, "finished_at")
    req = _df(engine, f"""
        SELECT COUNT(*) AS requests, COALESCE({_count("outcome = 'ok'")}, 0) AS ok,
               COALESCE({_count("outcome = 'rejected'")}, 0) AS rejected,
               COALESCE({_count("outcome = 'expired'")}, 0) AS expired,
               COALESCE({_count("outcome IN ('error', 'oom')")}, 0) AS errors,
               AVG(CASE WHEN outcome = 'ok' THEN queue_wait_s END) AS queue_wait_mean_s,
               MIN(finished_at) AS first_finished_at
        FROM requests WHERE {where}""", params)
    where_b, params_b = _where(w, "ended_at")
    bat = _df(engine, f"""
        SELECT COUNT(*) AS batches, AVG(batch_size) AS mean_batch_size,
               SUM(batch_size) AS batched_items, MAX(max_batch_size) AS max_batch_size_seen,
               AVG(compute_s) AS compute_mean_s, SUM(compute_s) AS compute_total_s,
               AVG(queue_depth) AS queue_depth_mean,
               SUM(CASE WHEN outcome = 'oom' THEN 1 ELSE 0 END) AS oom_batches,
               SUM(real_elements) AS real_elements, SUM(padded_elements) AS padded_elements
        FROM batches WHERE {where_b}""", params_b)
    row = {**req.iloc[0].to_dict(), **_exact_pcts(engine, w), **bat.iloc[0].to_dict(),
           **_last_batch(engine, w)}
    return _finish_headline(engine, w, row, RAW)


def _exact_pcts(engine: Engine, w: Window) -> dict:
    """The window's exact latency percentiles (``latency_p50`` ...) from the raw rows."""
    where, params = _where(w, "finished_at")
    return _df(engine, f"""
        SELECT {_pct_select('latency_s', 'latency')}
        FROM (SELECT latency_s, {_ranked('latency_s')} FROM requests
              WHERE {where} AND outcome = 'ok') AS ranked""", params).iloc[0].to_dict()


def _last_batch(engine: Engine, w: Window, since: float | None = None) -> dict:
    """The settings the newest batch in the window ran with (None when there is none);
    ``since``: no batch of the window ended before it (the search starts there)."""
    where_b, params_b = _where(w if since is None else Window(max(w.start_s, since), w.end_s, w.model,
                                                              w.instance_id), "ended_at")
    # without a model or instance no index orders by time: the newest rows come last
    order = "ended_at DESC" if w.model or w.instance_id else "id DESC"
    last = _df(engine, f"""
        SELECT max_batch_size, queue_depth, policy, settings_version FROM batches
        WHERE {where_b} ORDER BY {order} LIMIT 1""", params_b)
    if not len(last):
        return dict.fromkeys(("max_batch_size", "queue_depth_last", "policy", "settings_version"))
    one = last.iloc[0]
    return {"max_batch_size": one["max_batch_size"], "queue_depth_last": one["queue_depth"],
            "policy": one["policy"], "settings_version": one["settings_version"]}


def _finish_headline(engine: Engine, w: Window, row: dict, resolution: "Resolution") -> pd.DataFrame:
    """``row`` with the device figures, drops, rates and resolution added, as one row."""
    where_d, params_d = _where(w, "at", model=False)
    dev = _df(engine, f"""
        SELECT AVG(utilization_pct) AS utilization_mean_pct,
               MAX(memory_used_bytes) AS memory_used_max_bytes,
               MAX(memory_total_bytes) AS memory_total_bytes,
               (SELECT utilization_pct FROM device_samples WHERE {where_d}
                ORDER BY at DESC LIMIT 1) AS utilization_last_pct,
               (SELECT memory_used_bytes FROM device_samples WHERE {where_d}
                ORDER BY at DESC LIMIT 1) AS memory_used_last_bytes
        FROM device_samples WHERE {where_d}""", params_d)
    inst = "WHERE id = :inst" if w.instance_id else ""
    drops = _df(engine, f"SELECT COALESCE(SUM(records_dropped), 0) AS records_dropped "
                        f"FROM runtime_instances {inst}", {"inst": w.instance_id})
    row = {**row, **dev.iloc[0].to_dict(), **drops.iloc[0].to_dict(), "window_s": w.duration_s}
    # rates over the part of the window that has data (a runtime started mid-window)
    first = row.get("first_finished_at")
    active_s = w.duration_s
    if first is not None and pd.notna(first):
        active_s = min(w.duration_s, max(1.0, w.end_s - float(first)))
    row["active_s"] = active_s
    row["requests_per_s"] = row["requests"] / active_s
    row["ok_per_s"] = row["ok"] / active_s
    row["batches_per_s"] = row["batches"] / active_s
    row.update(source=resolution.source, resolution_s=resolution.interval_s,
               resolution=resolution.label)
    return pd.DataFrame([row])


def tail_breakdown(engine: Engine, w: Window, threshold_s: float) -> pd.DataFrame:
    """Mean queue wait vs compute of the served requests at or above ``threshold_s``."""
    where, params = _where(w, "finished_at")
    return _df(engine, f"""
        SELECT COUNT(*) AS requests, AVG(queue_wait_s) AS queue_wait_mean_s,
               AVG(latency_s - queue_wait_s) AS compute_mean_s
        FROM requests WHERE {where} AND outcome = 'ok' AND latency_s >= :thr""",
               {**params, "thr": threshold_s})


# -- over time ------------------------------------------------------------------------
def _bucket_times(df: pd.DataFrame, bucket_s: float) -> pd.DataFrame:
    """``b`` (bucket index) replaced by ``t``, the bucket's start in wall seconds."""
    df.insert(0, "t", df.pop("b").astype("float64") * bucket_s)
    return df


def request_timeline(engine: Engine, w: Window, bucket_s: float | None = None) -> pd.DataFrame:
    """Per time bucket: request counts by outcome and exact latency percentiles."""
    bucket_s = bucket_s or w.bucket_s()
    where, params = _where(w, "finished_at")
    params["bucket"] = bucket_s
    bucket_expr = _bucket("finished_at")
    counts = _df(engine, f"""
        SELECT {bucket_expr} AS b, COUNT(*) AS requests, {_count("outcome = 'ok'")} AS ok,
               {_count("outcome = 'rejected'")} AS rejected,
               {_count("outcome = 'expired'")} AS expired,
               {_count("outcome IN ('error', 'oom')")} AS errors
        FROM requests WHERE {where} GROUP BY 1 ORDER BY b""", params)
    return _request_rates(_bucket_times(counts.merge(_exact_timeline_pcts(engine, w, bucket_s),
                                                     on="b", how="left"), bucket_s), bucket_s)


def _exact_timeline_pcts(engine: Engine, w: Window, bucket_s: float) -> pd.DataFrame:
    """Per time bucket ``b``: the exact latency percentiles from the raw rows."""
    where, params = _where(w, "finished_at")
    params["bucket"] = bucket_s
    bucket_expr = _bucket("finished_at")
    return _df(engine, f"""
        SELECT b, {_pct_select('latency_s', 'latency')}
        FROM (SELECT {bucket_expr} AS b, latency_s, {_ranked('latency_s', bucket_expr)}
              FROM requests WHERE {where} AND outcome = 'ok') AS ranked GROUP BY b""", params)


def _request_rates(df: pd.DataFrame, bucket_s: float) -> pd.DataFrame:
    if len(df):
        df["requests_per_s"] = df["requests"] / bucket_s
        df["ok_per_s"] = df["ok"] / bucket_s
        df["failed_per_s"] = (df["rejected"] + df["expired"] + df["errors"]) / bucket_s
    return df


def batch_timeline(engine: Engine, w: Window, bucket_s: float | None = None) -> pd.DataFrame:
    """Per time bucket: batches, sizes, queue wait vs compute, queue depth."""
    bucket_s = bucket_s or w.bucket_s()
    where, params = _where(w, "ended_at")
    params["bucket"] = bucket_s
    df = _df(engine, f"""
        SELECT {_bucket("ended_at")} AS b, COUNT(*) AS batches,
               SUM(batch_size) AS items, AVG(batch_size) AS mean_batch_size,
               MAX(max_batch_size) AS max_batch_size, AVG(queue_wait_mean_s) AS queue_wait_mean_s,
               AVG(compute_s) AS compute_mean_s, AVG(queue_depth) AS queue_depth_mean,
               MAX(queue_depth) AS queue_depth_max
        FROM batches WHERE {where} GROUP BY 1 ORDER BY b""", params)
    return _batch_rates(_bucket_times(df, bucket_s), bucket_s)


def _batch_rates(df: pd.DataFrame, bucket_s: float) -> pd.DataFrame:
    if len(df):
        df["batches_per_s"] = df["batches"] / bucket_s
        df["items_per_s"] = df["items"] / bucket_s
    return df


def device_timeline(engine: Engine, w: Window, bucket_s: float | None = None) -> pd.DataFrame:
    bucket_s = bucket_s or w.bucket_s()
    where, params = _where(w, "at", model=False)
    params["bucket"] = bucket_s
    df = _df(engine, f"""
        SELECT {_bucket("at")} AS b, device, kind,
               AVG(utilization_pct) AS utilization_pct, MAX(memory_used_bytes) AS memory_used_bytes,
               MAX(memory_total_bytes) AS memory_total_bytes,
               MAX(torch_allocated_bytes) AS torch_allocated_bytes,
               MAX(process_rss_bytes) AS process_rss_bytes
        FROM device_samples WHERE {where}
        GROUP BY 1, device, kind ORDER BY device, b""", params)
    return _bucket_times(df, bucket_s)


# -- distributions --------------------------------------------------------------------
def batch_sizes(engine: Engine, w: Window) -> pd.DataFrame:
    """Per batch size: batch count, compute time and items per compute second."""
    where, params = _where(w, "ended_at")
    df = _df(engine, f"""
        SELECT batch_size, COUNT(*) AS batches, SUM(compute_s) AS compute_total_s,
               AVG(compute_s) AS compute_mean_s, MAX(max_batch_size) AS max_batch_size
        FROM batches WHERE {where} AND outcome = 'ok' GROUP BY batch_size ORDER BY batch_size""",
               params)
    return _items_per_compute_s(df)


def _items_per_compute_s(df: pd.DataFrame) -> pd.DataFrame:
    if len(df):
        df["items_per_compute_s"] = df["batch_size"] * df["batches"] / df["compute_total_s"]
    return df


def padding_by_bucket(engine: Engine, w: Window) -> pd.DataFrame:
    where, params = _where(w, "ended_at")
    df = _df(engine, f"""
        SELECT bucket, COUNT(*) AS batches, SUM(real_elements) AS real_elements,
               SUM(padded_elements) AS padded_elements
        FROM batches WHERE {where} AND bucket IS NOT NULL GROUP BY bucket ORDER BY bucket""",
               params)
    return _waste(df)


def _waste(df: pd.DataFrame) -> pd.DataFrame:
    if len(df):
        df["waste_fraction"] = 1.0 - df["real_elements"] / df["padded_elements"].clip(lower=1)
    return df


def priority_stats(engine: Engine, w: Window) -> pd.DataFrame:
    """Per priority level: outcomes, mean queue wait and exact latency percentiles."""
    where, params = _where(w, "finished_at")
    counts = _df(engine, f"""
        SELECT priority, COUNT(*) AS requests, {_count("outcome = 'ok'")} AS ok,
               {_count("outcome = 'expired'")} AS expired,
               {_count("outcome = 'rejected'")} AS rejected,
               AVG(CASE WHEN outcome = 'ok' THEN queue_wait_s END) AS queue_wait_mean_s
        FROM requests WHERE {where} GROUP BY priority ORDER BY priority""", params)
    return counts.merge(_exact_priority_pcts(engine, w), on="priority", how="left")


def _exact_priority_pcts(engine: Engine, w: Window) -> pd.DataFrame:
    where, params = _where(w, "finished_at")
    return _df(engine, f"""
        SELECT priority, {_pct_select('latency_s', 'latency')}
        FROM (SELECT priority, latency_s, {_ranked('latency_s', 'priority')}
              FROM requests WHERE {where} AND outcome = 'ok') AS ranked GROUP BY priority""", params)


def model_share(engine: Engine, w: Window) -> pd.DataFrame:
    """Per model (all models, ignoring the model filter): device time share and waits."""
    where, params = _where(w, "ended_at", model=False)
    df = _df(engine, f"""
        SELECT model, COUNT(*) AS batches, SUM(batch_size) AS items,
               SUM(compute_s) AS compute_total_s, AVG(queue_wait_mean_s) AS queue_wait_mean_s
        FROM batches WHERE {where} GROUP BY model ORDER BY model""", params)
    return _share(df)


def _share(df: pd.DataFrame) -> pd.DataFrame:
    if len(df):
        df["share"] = df["compute_total_s"] / max(1e-12, float(df["compute_total_s"].sum()))
    return df


# -- events ---------------------------------------------------------------------------
def events(engine: Engine, w: Window, kinds: tuple[str, ...] | None = None,
           limit: int = 500) -> pd.DataFrame:
    """Events in the window (newest ``limit``), oldest first; includes model-less events."""
    parts = ["at >= :t0", "at < :t1"]
    params: dict = {"t0": w.start_s, "t1": w.end_s, "lim": limit}
    if w.model is not None:
        parts.append("(model = :model OR model IS NULL)")
        params["model"] = w.model
    if w.instance_id is not None:
        parts.append("instance_id = :inst")
        params["inst"] = w.instance_id
    if kinds:
        names = ", ".join(f":k{i}" for i in range(len(kinds)))
        parts.append(f"kind IN ({names})")
        params.update({f"k{i}": k for i, k in enumerate(kinds)})
    df = _df(engine, f"""
        SELECT * FROM (SELECT at, instance_id, model, kind, severity, message, details_json
                       FROM events WHERE {' AND '.join(parts)} ORDER BY at DESC, id DESC
                       LIMIT :lim) AS newest
        ORDER BY at""", params)
    return df


def event_counts(engine: Engine, w: Window) -> pd.DataFrame:
    where, params = _where(w, "at")
    return _df(engine, f"SELECT kind, COUNT(*) AS events FROM events WHERE {where} "
                       "GROUP BY kind ORDER BY kind", params)


# -- generation -----------------------------------------------------------------------
def generation_timeline(engine: Engine, w: Window, bucket_s: float | None = None) -> pd.DataFrame:
    bucket_s = bucket_s or w.bucket_s()
    where, params = _where(w, "at")
    params["bucket"] = bucket_s
    df = _df(engine, f"""
        SELECT {_bucket("at")} AS b, COUNT(*) AS steps,
               AVG(running) AS running, AVG(waiting) AS waiting,
               AVG(prefill_tokens + decode_tokens) AS tokens_per_step,
               AVG(blocks_used) AS blocks_used, MAX(blocks_used + blocks_free) AS blocks_total,
               SUM(preemptions) AS preemptions, AVG(step_s) AS step_mean_s
        FROM generation_steps WHERE {where}
        GROUP BY 1 ORDER BY b""", params)
    return _bucket_times(df, bucket_s)


def generation_summary(engine: Engine, w: Window) -> pd.DataFrame:
    """Steps, preemptions, generated tokens, TTFT and per-token latency percentiles."""
    where, params = _where(w, "at")
    steps = _df(engine, f"""
        SELECT COUNT(*) AS steps, COALESCE(SUM(preemptions), 0) AS preemptions,
               COALESCE(SUM(decode_tokens), 0) AS decode_tokens, AVG(running) AS running_mean
        FROM generation_steps WHERE {where}""", params)
    where_r, params_r = _where(w, "finished_at")
    req = _df(engine, f"""
        WITH g AS (SELECT ttft_s, tpot_s, output_tokens FROM requests
                   WHERE {where_r} AND outcome = 'ok' AND ttft_s IS NOT NULL),
        ranked AS (SELECT ttft_s, tpot_s, {_ranked('ttft_s')}, {_ranked('tpot_s')} FROM g)
        SELECT (SELECT COUNT(*) FROM g) AS sequences,
               (SELECT COALESCE(SUM(output_tokens), 0) FROM g) AS output_tokens,
               {_pct_select('ttft_s', 'ttft')}, {_pct_select('tpot_s', 'tpot')} FROM ranked""",
               params_r)
    row = {**steps.iloc[0].to_dict(), **req.iloc[0].to_dict()}
    row["tokens_per_s"] = row["decode_tokens"] / w.duration_s
    return pd.DataFrame([row])


# -- one live refresh from the summaries ------------------------------------------------
#: a window with up to this many completed requests gets exact percentiles from the raw
#: rows (a few milliseconds per thousand); above, they are read from the summaries'
#: latency histograms
EXACT_PERCENTILES_MAX_OK = 10_000
_COUNTS = ("requests", "ok", "rejected", "expired", "failed", "batches", "batch_items", "queue_depth_sum",
           "queue_depth_count", "oom_batches", "real_elements", "padded_elements")
_SUMS = ("ok_latency_sum_s", "ok_queue_wait_sum_s", "batch_compute_sum_s", "batch_queue_wait_sum_s")


def _summary_resolution(exact: bool, group_s: float) -> Resolution:
    detail = ("exact percentiles" if exact else
              f"percentiles per {group_s:g} s from latency histograms, at most 7.5 % high")
    return Resolution("summaries", 1.0, f"per-second summaries ({detail})")


def _owner(w: Window, *, model: bool = True) -> str:
    parts = []
    if model and w.model is not None:
        parts.append("AND model = :model")
    if w.instance_id is not None:
        parts.append("AND instance_id = :inst")
    return " ".join(parts)


def _summary_df(engine: Engine, table: str, select_sql: str, w: Window, s0: int, s1: int, rest: str,
                *, minutes: bool, model: bool = True, **params) -> pd.DataFrame:
    """``SELECT select_sql FROM table WHERE`` (its rows over ``[s0, s1)``, the window's
    whole minutes from the minute rows when ``minutes``) ``rest``."""
    where, spans = summaries.span_where(table, s0, s1, minutes=minutes)
    return _df(engine, f"SELECT {select_sql} FROM {table} WHERE {where} {_owner(w, model=model)} {rest}",
               {**spans, "model": w.model, "inst": w.instance_id, **params})


def _seconds(engine: Engine, w: Window, bucket_s: float, s0: int, s1: int) -> pd.DataFrame:
    """``summary_stats`` over the window per time bucket ``b`` (counts as integers:
    PostgreSQL sums integers into ``numeric``)."""
    counts = ", ".join(f"CAST(SUM({c}) AS BIGINT) AS {c}" for c in _COUNTS)
    sums = ", ".join(f"SUM({c}) AS {c}" for c in _SUMS)
    return _summary_df(engine, "summary_stats", f"""
        CAST(FLOOR(start_s / :bucket) AS BIGINT) AS b, {counts}, {sums},
        MAX(queue_depth_max) AS queue_depth_max, MAX(max_batch_size_max) AS max_batch_size_max,
        MIN(CASE WHEN requests > 0 THEN start_s END) AS first_s,
        MAX(CASE WHEN batches > 0 THEN start_s END) AS last_batch_s""", w, s0, s1,
        "GROUP BY 1 ORDER BY 1", minutes=bucket_s % summaries.MINUTE_S == 0, bucket=bucket_s)


def _model_share_from_seconds(engine: Engine, w: Window, s0: int, s1: int) -> pd.DataFrame:
    df = _summary_df(engine, "summary_stats", """
        model, CAST(SUM(batches) AS BIGINT) AS batches, CAST(SUM(batch_items) AS BIGINT) AS items,
        SUM(batch_compute_sum_s) AS compute_total_s, SUM(batch_queue_wait_sum_s) AS wait_sum_s""",
        w, s0, s1, "GROUP BY model HAVING SUM(batches) > 0 ORDER BY model", minutes=True, model=False)
    df["queue_wait_mean_s"] = df.pop("wait_sum_s") / df["batches"]
    return _share(df)


def _slots(engine: Engine, w: Window, group_s: float, s0: int, s1: int) -> pd.DataFrame:
    """``summary_latency`` of the window per ``group_s``-second group ``g``, priority,
    outcome and latency bucket (whole slots from the one holding the window's start)."""
    return _summary_df(engine, "summary_latency", """
        CAST(FLOOR(start_s / :group) AS BIGINT) AS g, priority, outcome, bucket,
        CAST(SUM(n) AS BIGINT) AS n, SUM(latency_sum_s) AS latency_sum_s,
        SUM(queue_wait_sum_s) AS queue_wait_sum_s""", w, s0, s1, "GROUP BY 1, 2, 3, 4",
        minutes=group_s % summaries.MINUTE_S == 0, group=group_s)


def _shapes(engine: Engine, w: Window, s0: int, s1: int) -> pd.DataFrame:
    return _summary_df(engine, "summary_shapes", """
        batch_size, bucket, outcome, CAST(SUM(n) AS BIGINT) AS batches,
        SUM(compute_sum_s) AS compute_total_s, CAST(SUM(real_elements) AS BIGINT) AS real_elements,
        CAST(SUM(padded_elements) AS BIGINT) AS padded_elements, MAX(max_batch_size_max) AS max_batch_size""",
        w, s0, s1, "GROUP BY 1, 2, 3 ORDER BY 1, 2", minutes=True)


def _hist_quantiles(keys: np.ndarray, buckets: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, dict]:
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


def _ints(series: pd.Series) -> np.ndarray:
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
            **_last_batch(engine, w, since=float(sec["last_batch_s"].max()) if some else None)}
    return _finish_headline(engine, w, head, resolution)


def _summary_frames(engine: Engine, w: Window, bucket_s: float) -> dict[str, pd.DataFrame]:
    """The live bundle's frames from the summaries, over the window in whole seconds
    (latency histograms and batch shapes in whole 5-second slots); percentiles exact
    from the raw rows while the window holds few completed requests."""
    s0, s1 = math.ceil(w.start_s), math.ceil(w.end_s)
    sec = _seconds(engine, w, bucket_s, s0, s1)
    exact = int(sec["ok"].sum()) <= EXACT_PERCENTILES_MAX_OK
    group_s = max(bucket_s, float(summaries.SLOT_S))  # percentiles per bucket, or per slot when shorter
    slots = _slots(engine, w, group_s, s0, s1)
    ok = slots[slots["outcome"] == "ok"]
    g, bucket, n = _ints(ok["g"]), _ints(ok["bucket"]), _ints(ok["n"])
    if exact:
        head_pcts = _exact_pcts(engine, w)
    else:
        _, whole = _hist_quantiles(np.zeros(len(n), dtype="int64"), bucket, n)
        head_pcts = {k: float(v[0]) if len(v) else math.nan for k, v in whole.items()}
    out = {"headline": _summary_headline(engine, w, sec, head_pcts, _summary_resolution(exact, group_s))}

    req = sec[sec["requests"] > 0]
    req_t = pd.DataFrame({"b": req["b"], "requests": req["requests"], "ok": req["ok"],
                          "rejected": req["rejected"], "expired": req["expired"], "errors": req["failed"]})
    if exact:
        req_t = req_t.merge(_exact_timeline_pcts(engine, w, bucket_s), on="b", how="left")
    else:
        groups, pcts = _hist_quantiles(g, bucket, n)
        group_of = (req_t["b"] * bucket_s // group_s).astype("int64")
        for key, values in pcts.items():
            req_t[key] = group_of.map(pd.Series(values, index=groups))
    out["requests_t"] = _request_rates(_bucket_times(req_t.reset_index(drop=True), bucket_s), bucket_s)

    bat = sec[sec["batches"] > 0]
    out["batches_t"] = _batch_rates(_bucket_times(pd.DataFrame({
        "b": bat["b"], "batches": bat["batches"], "items": bat["batch_items"],
        "mean_batch_size": bat["batch_items"] / bat["batches"], "max_batch_size": bat["max_batch_size_max"],
        "queue_wait_mean_s": bat["batch_queue_wait_sum_s"] / bat["batches"],
        "compute_mean_s": bat["batch_compute_sum_s"] / bat["batches"],
        "queue_depth_mean": bat["queue_depth_sum"] / bat["queue_depth_count"].where(bat["queue_depth_count"] > 0),
        "queue_depth_max": bat["queue_depth_max"],
    }).reset_index(drop=True), bucket_s), bucket_s)
    out["device_t"] = device_timeline(engine, w, bucket_s)

    shapes = _shapes(engine, w, s0, s1)
    sizes = shapes[shapes["outcome"] == "ok"].groupby("batch_size", as_index=False).agg(
        batches=("batches", "sum"), compute_total_s=("compute_total_s", "sum"),
        max_batch_size=("max_batch_size", "max"))
    sizes.insert(3, "compute_mean_s", sizes["compute_total_s"] / sizes["batches"])
    out["batch_sizes"] = _items_per_compute_s(sizes)
    out["padding"] = _waste(shapes[shapes["bucket"] != summaries.NO_LENGTH_BUCKET].groupby(
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
        return prio.merge(_exact_priority_pcts(engine, w), on="priority", how="left")
    levels, pcts = _hist_quantiles(_ints(ok["priority"]), _ints(ok["bucket"]), _ints(ok["n"]))
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


# -- windows older than the raw rows ---------------------------------------------------
def _reaches_rollups(engine: Engine, w: Window) -> bool:
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


def _rollup_frames(engine: Engine, w: Window, *, headline_only: bool = False) -> dict[str, pd.DataFrame]:
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
    out = {"headline": _finish_headline(engine, w, head, _rollups(interval_s))}
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
    out["requests_t"] = _request_rates(_bucket_times(req_t, bucket), bucket)
    bat = sums[sums["batches"] > 0].reset_index(drop=True)
    out["batches_t"] = _batch_rates(_bucket_times(pd.DataFrame({
        "b": bat["b"], "batches": bat["batches"], "items": bat["items"],
        "mean_batch_size": bat["items"] / bat["batches"], "max_batch_size": math.nan,
        "queue_wait_mean_s": math.nan, "compute_mean_s": bat["compute_total_s"] / bat["batches"],
        "queue_depth_mean": math.nan, "queue_depth_max": math.nan}), bucket), bucket)
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
    out["model_share"] = _share(share[share["batches"] > 0].reset_index(drop=True))
    out["events"] = events(engine, w)
    out["tail"] = pd.DataFrame([{"requests": None, "queue_wait_mean_s": None, "compute_mean_s": None}])
    return out


# -- one live refresh -----------------------------------------------------------------
def live_bundle(engine: Engine, w: Window, *, generation: bool | None = None) -> dict[str, pd.DataFrame]:
    """Every query of one live refresh of the dashboard, keyed by name.

    A window that reaches back before the raw rows (rolled up and deleted by retention)
    is answered from the roll-ups, in their intervals; ``headline`` says which
    (``source``, ``resolution_s``, ``resolution``)."""
    bucket = w.bucket_s()
    if _reaches_rollups(engine, w):
        out = _rollup_frames(engine, w)
        bucket = max(bucket, float(out["headline"].iloc[0]["resolution_s"]))
        return _with_generation(engine, w, out, bucket, generation)
    return _with_generation(engine, w, _summary_frames(engine, w, bucket), bucket, generation)


def raw_bundle(engine: Engine, w: Window) -> dict[str, pd.DataFrame]:
    """The same frames as ``live_bundle``, every one aggregated from the raw rows with
    exact percentiles (what the summaries stand for; tests and benchmarks compare)."""
    bucket = w.bucket_s()
    out = {
        "headline": _raw_headline(engine, w),
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


def _with_generation(engine: Engine, w: Window, out: dict, bucket: float,
                     generation: bool | None) -> dict[str, pd.DataFrame]:
    """``out`` with the generation frames when the window has generation steps."""
    if generation is None:
        with engine.connect() as conn:
            where, params = _where(w, "at")
            generation = conn.execute(text(f"SELECT 1 FROM generation_steps WHERE {where} LIMIT 1"),
                                      params).first() is not None
    if generation:
        out["generation_t"] = generation_timeline(engine, w, bucket)
        out["generation"] = generation_summary(engine, w)
    return out
