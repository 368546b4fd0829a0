"""Fleet queries: every instance side by side, and fleet-wide latency from all of them.

A fleet is the set of runtimes recording into one database (replicas behind a router,
processes on several machines). Each query is ``(engine, window) -> DataFrame`` like
``queries``; the window's model filter applies, its instance filter does not (the point
is to see every instance).

The per-instance figures (outcome counts, throughput, mean batch size, queue depth)
come from the per-second summaries the recorder writes (``queries.exact.window_sums``):
exactly the figures of every raw row of the window, the fractions of a second at its
ends read from the raw rows. Percentiles are exact nearest-rank values (rank
``ceil(p * n / 100)``, numpy's ``inverted_cdf``) per instance and fleet-wide, where the
fleet's p99 is the p99 of every completed request of the model across instances ranked
together, never an average of per-instance percentiles: the summaries' latency
histograms say which bucket holds each rank, and only the raw latencies of those
buckets are read (``queries.exact.window_percentiles``). The newest batch's settings
and the first and last request of each instance are single index look-ups. Everything
of one refresh is read in one snapshot (``figures``).

Portability: the SQL runs unchanged on SQLite and PostgreSQL. Conditional counts are
``SUM(CASE ... THEN 1 ELSE 0 END)``, averages of integer columns are taken over
``CAST(... AS FLOAT)``, every subquery has an alias and every ``GROUP BY`` names all
grouped columns.

An instance's state comes from its heartbeat: ``stopped`` once it marked itself stopped
(``runtime_instances.stopped_at``), ``live`` while its last heartbeat is at most
``stale_after_s`` old, ``stale`` after that (it stopped reporting without saying so).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from decimal import Decimal

import pandas as pd
from sqlalchemy import Connection, Engine, text

from batchscope.analysis.flags import json_object
from batchscope.analysis.queries import Window, exact
from batchscope.analysis.queries.window import connection

#: the heartbeat age after which an instance that did not stop counts as stale
#: (the same default as ``control.live_instances``)
STALE_AFTER_S = 10.0
PCTS = (50, 95, 99)
LIVE, STALE, STOPPED, UNREGISTERED = "live", "stale", "stopped", "unregistered"

TABLE_COLUMNS = (
    "instance_id", "node", "state", "model", "settings_version", "requests", "ok",
    "rejected", "expired", "errors", "ok_per_s", "latency_p50_s", "latency_p99_s",
    "batches", "mean_batch_size", "max_batch_size", "queue_depth_mean", "queue_depth_last",
    "utilization_mean_pct", "device_kind", "heartbeat_age_s", "last_finished_at", "active_s")


def _df(db: Engine | Connection, sql: str, params: dict) -> pd.DataFrame:
    with connection(db) as conn:
        result = conn.execute(text(sql), params)
        df = pd.DataFrame(result.fetchall(), columns=list(result.keys()))
    for col in df.columns:  # PostgreSQL answers AVG/SUM of integers as Decimal
        if df[col].map(lambda v: isinstance(v, Decimal)).any():
            df[col] = pd.to_numeric(df[col], errors="coerce").astype("float64")
    return df


# -- instances ------------------------------------------------------------------------
def state_of(last_seen_at: float | None, stopped_at: float | None, *, now: float,
             stale_after_s: float = STALE_AFTER_S) -> str:
    """``stopped``, ``live`` or ``stale`` from the heartbeat and the stopped marker."""
    if stopped_at is not None and not _missing(stopped_at):
        return STOPPED
    if last_seen_at is None or _missing(last_seen_at):
        return UNREGISTERED
    return LIVE if now - float(last_seen_at) <= stale_after_s else STALE


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def instances(engine: Engine, *, now: float, stale_after_s: float = STALE_AFTER_S,
              window: Window | None = None) -> pd.DataFrame:
    """Every registered instance with its node, state and heartbeat age, newest first;
    with ``window``, only those up during it (started before its end, seen after its start)."""
    where, params = "", {}
    if window is not None:
        where = " WHERE started_at < :t1 AND last_seen_at >= :t0"
        params = {"t0": window.start_s, "t1": window.end_s}
    df = _df(engine, f"SELECT * FROM runtime_instances{where} ORDER BY last_seen_at DESC, id",
             params)
    if "node" not in df.columns:  # the node is the host the instance registered from
        df["node"] = df["host"] if "host" in df.columns else None
    raw_models = df.get("models_json", pd.Series(dtype=object))
    df["models"] = [tuple(_json_list(raw)) for raw in raw_models]
    df["state"] = [state_of(seen, stopped, now=now, stale_after_s=stale_after_s)
                   for seen, stopped in zip(df["last_seen_at"], df["stopped_at"])]
    # a heartbeat written after ``now`` was read is as fresh as it gets, not negative
    df["heartbeat_age_s"] = (now - df["last_seen_at"].astype("float64")).clip(lower=0.0)
    return df


def _json_list(raw) -> list[str]:
    try:
        found = json.loads(raw or "[]")
    except (TypeError, ValueError):
        return []
    return [str(m) for m in found] if isinstance(found, list) else []


def settings(engine: Engine, model: str | None = None) -> pd.DataFrame:
    """The settings each (instance, model) published last, decoded."""
    where = " WHERE model = :model" if model is not None else ""
    df = _df(engine, "SELECT instance_id, model, version, settings_json, kind, updated_at "
                     f"FROM model_settings{where} ORDER BY model, instance_id", {"model": model})
    df["settings"] = [json_object(raw) for raw in df["settings_json"]]
    return df


# -- per instance and model -----------------------------------------------------------
#: the columns of ``Figures.per_pair`` besides instance_id and model
PAIR_COLUMNS = ("requests", "ok", "rejected", "expired", "errors", "first_finished_at",
                "last_finished_at", *(f"latency_p{p}_s" for p in PCTS), "batches",
                "mean_batch_size", "items", "compute_total_s", "queue_depth_mean", "oom_batches",
                "queue_depth_last", "max_batch_size", "batch_settings_version")


@dataclass
class Figures:
    """One window's figures per (instance, model) that recorded in it (``per_pair``:
    ``PAIR_COLUMNS``) and per model across instances (``per_model``: the exact
    percentiles), read in one snapshot. ``latencies_read``: the raw latencies the exact
    percentiles took."""

    per_pair: pd.DataFrame
    per_model: pd.DataFrame
    latencies_read: int


def figures(engine: Engine, w: Window) -> Figures:
    """Counts, throughput inputs, batch figures and exact percentiles of the window."""
    with exact.snapshot(engine) as conn:
        sums = exact.window_sums(conn, w)
        pcts = exact.window_percentiles(conn, w)
        ends = _first_and_last(conn, w, sums)
        last = _newest_batches(conn, w, sums)
    df = sums.merge(ends, on=["instance_id", "model"], how="left")
    df = df.merge(pcts.per_instance, on=["instance_id", "model"], how="left")
    df = df.merge(last, on=["instance_id", "model"], how="left")
    batches = df["batches"].where(df["batches"] > 0)
    df["mean_batch_size"] = df["items"] / batches
    depths = df["queue_depth_count"].where(df["queue_depth_count"] > 0)
    df["queue_depth_mean"] = df["queue_depth_sum"] / depths
    for col in ("items", "compute_total_s", "oom_batches"):  # sums over no batch: none, as in SQL
        df[col] = df[col].where(df["batches"] > 0)
    for col in PAIR_COLUMNS:
        if col not in df:
            df[col] = math.nan
    return Figures(df[["instance_id", "model", *PAIR_COLUMNS]], pcts.per_model, pcts.read_rows)


def _pairs_sql(pairs: pd.DataFrame, select: str, table: str, where: str, order: str,
               params: dict) -> tuple[str, dict]:
    """One statement: for each (instance, model) of ``pairs``, its first row of ``table``
    by ``order`` among those matching ``where`` (``{n}`` stands for the pair's number and
    names its parameters ``lo{n}``/``hi{n}``), each found through an index."""
    subs = []
    for n, (iid, model) in enumerate(zip(pairs["instance_id"], pairs["model"])):
        params = {**params, f"i{n}": iid, f"m{n}": model}
        subs.append(f"SELECT * FROM (SELECT instance_id, model, {select} FROM {table} "
                    f"WHERE instance_id = :i{n} AND model = :m{n} AND {where.format(n=n)} "
                    f"ORDER BY {order} LIMIT 1) AS q{n}")
    return " UNION ALL ".join(subs), params


def _first_and_last(conn: Connection, w: Window, sums: pd.DataFrame) -> pd.DataFrame:
    """Each pair's first and last request's finish time in the window, starting the look-up
    from the bounds ``window_sums`` gives (within a minute of the row)."""
    served = sums[sums["requests"] > 0].reset_index(drop=True)
    out = pd.DataFrame({"instance_id": served["instance_id"], "model": served["model"]})
    if not len(served):
        return out.assign(first_finished_at=[], last_finished_at=[])
    params = {"t0": w.start_s, "t1": w.end_s,
              **{f"lo{n}": max(w.start_s, float(v)) for n, v in enumerate(served["first_s"])},
              **{f"hi{n}": float(v) for n, v in enumerate(served["last_s"])}}
    for name, where, order in (
            ("first_finished_at", "finished_at >= :lo{n} AND finished_at < :t1", "finished_at"),
            ("last_finished_at", "finished_at <= :hi{n} AND finished_at < :t1 AND finished_at >= :t0",
             "finished_at DESC")):
        sql, bound = _pairs_sql(served, f"finished_at AS {name}", "requests", where, order, params)
        out = out.merge(_df(conn, sql, bound), on=["instance_id", "model"], how="left")
    return out


def _newest_batches(conn: Connection, w: Window, sums: pd.DataFrame) -> pd.DataFrame:
    """Each pair's newest batch in the window: its queue depth, max batch size and
    settings version."""
    batched = sums[sums["batches"] > 0].reset_index(drop=True)
    columns = ["instance_id", "model", "queue_depth_last", "max_batch_size", "batch_settings_version"]
    if not len(batched):
        return pd.DataFrame(columns=columns)
    params = {"t1": w.end_s, **{f"lo{n}": max(w.start_s, float(v))
                                for n, v in enumerate(batched["last_batch_s"])}}
    sql, bound = _pairs_sql(batched, "queue_depth AS queue_depth_last, max_batch_size, "
                            "settings_version AS batch_settings_version", "batches",
                            "ended_at >= :lo{n} AND ended_at < :t1", "ended_at DESC, id DESC", params)
    return _df(conn, sql, bound)[columns]


def device_stats(engine: Engine | Connection, w: Window) -> pd.DataFrame:
    """Per instance: mean device utilization and memory peaks in the window."""
    return _df(engine, """
        SELECT instance_id, AVG(utilization_pct) AS utilization_mean_pct,
               MAX(memory_used_bytes) AS memory_used_max_bytes,
               MAX(memory_total_bytes) AS memory_total_bytes,
               MAX(process_rss_bytes) AS process_rss_max_bytes, MAX(kind) AS device_kind
        FROM device_samples WHERE at >= :t0 AND at < :t1 GROUP BY instance_id""",
               {"t0": w.start_s, "t1": w.end_s})


def _active_s(w: Window, row) -> float:
    """Seconds of the window the instance was up: from its start (or first request) to
    its stop (or last heartbeat when stale), at least one second."""
    begin = w.start_s
    for candidate in (row.get("started_at"), row.get("first_finished_at")):
        if not _missing(candidate):
            begin = max(begin, float(candidate))
            break
    end = w.end_s
    if row.get("state") == STOPPED and not _missing(row.get("stopped_at")):
        end = min(end, float(row["stopped_at"]))
    elif row.get("state") == STALE and not _missing(row.get("last_seen_at")):
        end = min(end, float(row["last_seen_at"]))
    return max(1.0, end - begin)


def instance_table(engine: Engine, w: Window, *, now: float,
                   stale_after_s: float = STALE_AFTER_S, found: Figures | None = None,
                   published: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (instance, model) that recorded in the window or, up during it,
    registered the model.

    Columns: ``TABLE_COLUMNS`` (throughput ``ok_per_s`` over the part of the window the
    instance was up; latencies in seconds; ``settings_version`` the one published last,
    else the last batch's). ``found`` and ``published``: the window's ``figures`` and
    ``settings`` when already read.
    """
    inst = instances(engine, now=now, stale_after_s=stale_after_s)
    up = (inst["started_at"] < w.end_s) & (inst["last_seen_at"] >= w.start_s)
    per_pair = (found or figures(engine, w)).per_pair
    pairs = set(zip(per_pair["instance_id"], per_pair["model"]))
    for iid, models in zip(inst.loc[up, "id"], inst.loc[up, "models"]):
        pairs |= {(iid, m) for m in models if w.model is None or m == w.model}
    if not pairs:
        return pd.DataFrame(columns=list(TABLE_COLUMNS))
    df = pd.DataFrame(sorted(pairs), columns=["instance_id", "model"])
    df = df.merge(per_pair, on=["instance_id", "model"], how="left")
    df = df.merge(device_stats(engine, w), on="instance_id", how="left")
    meta = inst.rename(columns={"id": "instance_id"})[
        ["instance_id", "node", "state", "heartbeat_age_s", "started_at", "last_seen_at",
         "stopped_at"]]
    df = df.merge(meta, on="instance_id", how="left")
    df["state"] = df["state"].fillna(UNREGISTERED)
    pub = (settings(engine, w.model) if published is None else published)[["instance_id", "model", "version"]]
    df = df.merge(pub, on=["instance_id", "model"], how="left")
    df["settings_version"] = df["version"].combine_first(df["batch_settings_version"])
    for col in ("requests", "ok", "rejected", "expired", "errors", "batches"):
        df[col] = df[col].fillna(0).astype("int64")
    df["active_s"] = [_active_s(w, row) for row in df.to_dict("records")]
    df["ok_per_s"] = df["ok"] / df["active_s"]
    return df[list(TABLE_COLUMNS)].sort_values(["model", "instance_id"]).reset_index(drop=True)


# -- fleet-wide -----------------------------------------------------------------------
def fleet_latency(engine: Engine, w: Window, found: Figures | None = None) -> pd.DataFrame:
    """Per model across every instance: outcomes, throughput and exact percentiles.

    The counts add up the instances'; the percentiles are those of all ok request rows
    of the model in the window (every instance's rows ranked together), not a mean of
    per-instance percentiles.
    """
    found = found or figures(engine, w)
    served = found.per_pair[found.per_pair["requests"] > 0]
    counts = served.groupby("model", as_index=False).agg(
        instances=("instance_id", "nunique"), requests=("requests", "sum"), ok=("ok", "sum"),
        rejected=("rejected", "sum"), expired=("expired", "sum"), errors=("errors", "sum"),
        first_finished_at=("first_finished_at", "min"),
        last_finished_at=("last_finished_at", "max"))
    df = counts.merge(found.per_model, on="model", how="left")
    if len(df):
        first = df["first_finished_at"].astype("float64").clip(lower=w.start_s)
        df["ok_per_s"] = df["ok"] / (w.end_s - first).clip(lower=1.0)
    return df.sort_values("model").reset_index(drop=True)


def throughput_timeline(engine: Engine, w: Window, bucket_s: float | None = None) -> pd.DataFrame:
    """Per instance and time bucket: ok requests per second (for the fleet chart)."""
    bucket_s = bucket_s or w.bucket_s()
    with engine.connect() as conn:
        sums = exact.window_sums(conn, w, bucket_s=bucket_s)
    df = sums[sums["ok"] > 0].groupby(["instance_id", "b"], as_index=False, sort=True)["ok"].sum()
    df["t"] = df["b"].astype("float64") * bucket_s
    df["ok_per_s"] = df["ok"] / bucket_s
    return df[["instance_id", "t", "ok_per_s"]]


def busiest(engine: Engine, w: Window, found: Figures | None = None) -> tuple[str, str] | None:
    """The (instance, model) with the most requests in the window; None without traffic."""
    per_pair = (found or figures(engine, w)).per_pair
    served = per_pair[per_pair["requests"] > 0].sort_values(
        ["requests", "instance_id", "model"], ascending=[False, True, True])
    if not len(served):
        return None
    return str(served.iloc[0]["instance_id"]), str(served.iloc[0]["model"])


def bundle(engine: Engine, w: Window, *, now: float,
           stale_after_s: float = STALE_AFTER_S) -> dict:
    """Every fleet query of one refresh, keyed by name (what ``fleet_rules`` reads)."""
    found = figures(engine, w)
    published = settings(engine, w.model)
    return {
        "window": w,
        "now": now,
        "stale_after_s": stale_after_s,
        "instances": instances(engine, now=now, stale_after_s=stale_after_s, window=w),
        "table": instance_table(engine, w, now=now, stale_after_s=stale_after_s, found=found,
                                published=published),
        "fleet": fleet_latency(engine, w, found),
        "settings": published,
        "busiest": busiest(engine, w, found),
        "latencies_read": found.latencies_read,
    }
