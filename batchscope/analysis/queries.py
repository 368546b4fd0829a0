"""Read queries of the dashboard: ``(engine, window) -> pandas.DataFrame``.

Everything is aggregated in SQL: time buckets are ``CAST(t / :bucket AS
INTEGER)``, counts and sums are SQL aggregates, and percentiles are exact
nearest-rank values picked with window functions (``ROW_NUMBER() OVER (ORDER
BY x)``; rank ``ceil(p * n / 100)``), so only what a chart draws leaves the
database. ``live_bundle`` runs every query of one live refresh.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

import pandas as pd
from sqlalchemy import Engine, text

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
        return pd.DataFrame(result.fetchall(), columns=list(result.keys()))


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
    """One row: throughput, latency percentiles, batch sizes, outcomes, device, drops."""
    where, params = _where(w, "finished_at")
    req = _df(engine, f"""
        SELECT COUNT(*) AS requests, COALESCE(SUM(outcome = 'ok'), 0) AS ok,
               COALESCE(SUM(outcome = 'rejected'), 0) AS rejected,
               COALESCE(SUM(outcome = 'expired'), 0) AS expired,
               COALESCE(SUM(outcome IN ('error', 'oom')), 0) AS errors,
               AVG(CASE WHEN outcome = 'ok' THEN queue_wait_s END) AS queue_wait_mean_s,
               MIN(finished_at) AS first_finished_at
        FROM requests WHERE {where}""", params)
    pct = _df(engine, f"""
        SELECT {_pct_select('latency_s', 'latency')}
        FROM (SELECT latency_s, {_ranked('latency_s')} FROM requests
              WHERE {where} AND outcome = 'ok')""", params)
    where_b, params_b = _where(w, "ended_at")
    bat = _df(engine, f"""
        SELECT COUNT(*) AS batches, AVG(batch_size) AS mean_batch_size,
               SUM(batch_size) AS batched_items, MAX(max_batch_size) AS max_batch_size_seen,
               AVG(compute_s) AS compute_mean_s, SUM(compute_s) AS compute_total_s,
               AVG(queue_depth) AS queue_depth_mean,
               SUM(CASE WHEN outcome = 'oom' THEN 1 ELSE 0 END) AS oom_batches,
               SUM(real_elements) AS real_elements, SUM(padded_elements) AS padded_elements
        FROM batches WHERE {where_b}""", params_b)
    last = _df(engine, f"""
        SELECT max_batch_size, queue_depth, policy, settings_version FROM batches
        WHERE {where_b} ORDER BY ended_at DESC LIMIT 1""", params_b)
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
    row = {**req.iloc[0].to_dict(), **pct.iloc[0].to_dict(), **bat.iloc[0].to_dict(), **dev.iloc[0].to_dict(),
           **drops.iloc[0].to_dict()}
    row.update({"max_batch_size": last.iloc[0]["max_batch_size"] if len(last) else None,
                "queue_depth_last": last.iloc[0]["queue_depth"] if len(last) else None,
                "policy": last.iloc[0]["policy"] if len(last) else None,
                "settings_version": last.iloc[0]["settings_version"] if len(last) else None,
                "window_s": w.duration_s})
    # rates over the part of the window that has data (a runtime started mid-window)
    first = row.get("first_finished_at")
    active_s = w.duration_s
    if first is not None and pd.notna(first):
        active_s = min(w.duration_s, max(1.0, w.end_s - float(first)))
    row["active_s"] = active_s
    row["requests_per_s"] = row["requests"] / active_s
    row["ok_per_s"] = row["ok"] / active_s
    row["batches_per_s"] = row["batches"] / active_s
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
def request_timeline(engine: Engine, w: Window, bucket_s: float | None = None) -> pd.DataFrame:
    """Per time bucket: request counts by outcome and exact latency percentiles."""
    bucket_s = bucket_s or w.bucket_s()
    where, params = _where(w, "finished_at")
    params["bucket"] = bucket_s
    bucket_expr = "CAST(finished_at / :bucket AS INTEGER)"
    counts = _df(engine, f"""
        SELECT {bucket_expr} AS b, COUNT(*) AS requests, SUM(outcome = 'ok') AS ok,
               SUM(outcome = 'rejected') AS rejected, SUM(outcome = 'expired') AS expired,
               SUM(outcome IN ('error', 'oom')) AS errors
        FROM requests WHERE {where} GROUP BY {bucket_expr} ORDER BY b""", params)
    pcts = _df(engine, f"""
        SELECT b, {_pct_select('latency_s', 'latency')}
        FROM (SELECT {bucket_expr} AS b, latency_s, {_ranked('latency_s', bucket_expr)}
              FROM requests WHERE {where} AND outcome = 'ok') GROUP BY b""", params)
    df = counts.merge(pcts, on="b", how="left")
    df.insert(0, "t", df["b"] * bucket_s)
    df = df.drop(columns=["b"])
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
        SELECT CAST(ended_at / :bucket AS INTEGER) * :bucket AS t, COUNT(*) AS batches,
               SUM(batch_size) AS items, AVG(batch_size) AS mean_batch_size,
               MAX(max_batch_size) AS max_batch_size, AVG(queue_wait_mean_s) AS queue_wait_mean_s,
               AVG(compute_s) AS compute_mean_s, AVG(queue_depth) AS queue_depth_mean,
               MAX(queue_depth) AS queue_depth_max
        FROM batches WHERE {where} GROUP BY CAST(ended_at / :bucket AS INTEGER) ORDER BY t""",
               params)
    if len(df):
        df["batches_per_s"] = df["batches"] / bucket_s
        df["items_per_s"] = df["items"] / bucket_s
    return df


def device_timeline(engine: Engine, w: Window, bucket_s: float | None = None) -> pd.DataFrame:
    bucket_s = bucket_s or w.bucket_s()
    where, params = _where(w, "at", model=False)
    params["bucket"] = bucket_s
    return _df(engine, f"""
        SELECT CAST(at / :bucket AS INTEGER) * :bucket AS t, device, kind,
               AVG(utilization_pct) AS utilization_pct, MAX(memory_used_bytes) AS memory_used_bytes,
               MAX(memory_total_bytes) AS memory_total_bytes,
               MAX(torch_allocated_bytes) AS torch_allocated_bytes,
               MAX(process_rss_bytes) AS process_rss_bytes
        FROM device_samples WHERE {where}
        GROUP BY device, CAST(at / :bucket AS INTEGER) ORDER BY device, t""", params)


# -- distributions --------------------------------------------------------------------
def batch_sizes(engine: Engine, w: Window) -> pd.DataFrame:
    """Per batch size: batch count, compute time and items per compute second."""
    where, params = _where(w, "ended_at")
    df = _df(engine, f"""
        SELECT batch_size, COUNT(*) AS batches, SUM(compute_s) AS compute_total_s,
               AVG(compute_s) AS compute_mean_s, MAX(max_batch_size) AS max_batch_size
        FROM batches WHERE {where} AND outcome = 'ok' GROUP BY batch_size ORDER BY batch_size""",
               params)
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
    if len(df):
        df["waste_fraction"] = 1.0 - df["real_elements"] / df["padded_elements"].clip(lower=1)
    return df


def priority_stats(engine: Engine, w: Window) -> pd.DataFrame:
    """Per priority level: outcomes, mean queue wait and exact latency percentiles."""
    where, params = _where(w, "finished_at")
    counts = _df(engine, f"""
        SELECT priority, COUNT(*) AS requests, SUM(outcome = 'ok') AS ok,
               SUM(outcome = 'expired') AS expired, SUM(outcome = 'rejected') AS rejected,
               AVG(CASE WHEN outcome = 'ok' THEN queue_wait_s END) AS queue_wait_mean_s
        FROM requests WHERE {where} GROUP BY priority ORDER BY priority""", params)
    pcts = _df(engine, f"""
        SELECT priority, {_pct_select('latency_s', 'latency')}
        FROM (SELECT priority, latency_s, {_ranked('latency_s', 'priority')}
              FROM requests WHERE {where} AND outcome = 'ok') GROUP BY priority""", params)
    return counts.merge(pcts, on="priority", how="left")


def model_share(engine: Engine, w: Window) -> pd.DataFrame:
    """Per model (all models, ignoring the model filter): device time share and waits."""
    where, params = _where(w, "ended_at", model=False)
    df = _df(engine, f"""
        SELECT model, COUNT(*) AS batches, SUM(batch_size) AS items,
               SUM(compute_s) AS compute_total_s, AVG(queue_wait_mean_s) AS queue_wait_mean_s
        FROM batches WHERE {where} GROUP BY model ORDER BY model""", params)
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
                       FROM events WHERE {' AND '.join(parts)} ORDER BY at DESC LIMIT :lim)
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
    return _df(engine, f"""
        SELECT CAST(at / :bucket AS INTEGER) * :bucket AS t, COUNT(*) AS steps,
               AVG(running) AS running, AVG(waiting) AS waiting,
               AVG(prefill_tokens + decode_tokens) AS tokens_per_step,
               AVG(blocks_used) AS blocks_used, MAX(blocks_used + blocks_free) AS blocks_total,
               SUM(preemptions) AS preemptions, AVG(step_s) AS step_mean_s
        FROM generation_steps WHERE {where}
        GROUP BY CAST(at / :bucket AS INTEGER) ORDER BY t""", params)


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


# -- one live refresh -----------------------------------------------------------------
def live_bundle(engine: Engine, w: Window, *, generation: bool | None = None) -> dict[str, pd.DataFrame]:
    """Every query of one live refresh of the dashboard, keyed by name."""
    bucket = w.bucket_s()
    out = {
        "headline": headline(engine, w),
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
    if generation is None:
        with engine.connect() as conn:
            where, params = _where(w, "at")
            generation = conn.execute(text(f"SELECT 1 FROM generation_steps WHERE {where} LIMIT 1"),
                                      params).first() is not None
    if generation:
        out["generation_t"] = generation_timeline(engine, w, bucket)
        out["generation"] = generation_summary(engine, w)
    return out
