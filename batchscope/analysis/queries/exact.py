"""Exact figures of a window from the summaries, with raw rows read only where they must be.

The summaries (``batchscope.storage.summaries``) count every row exactly, in whole
seconds (``summary_stats``) and whole 5-second slots (``summary_latency``). A window's
exact counts and sums (``window_sums``) are the summaries of its whole seconds plus the
raw rows of the fractions of a second at either end: the same figures as aggregating
every raw row of ``[start_s, end_s)``, at the cost of a few seconds of rows.

Exact percentiles (``window_percentiles``): the latency histograms keep every completed
request's count per bucket (32 a decade), only the values inside a bucket are gone. So
the nearest-rank percentile of rank ``k = ceil(p * n / 100)`` lies in the first bucket
where the running count reaches ``k``, as the ``(k - before)``-th smallest latency in
it. The window's histogram comes from the summaries (the partial slots at its ends from
the raw rows); then one read of the raw rows returns only the latencies in the buckets
that hold a wanted rank, and numpy picks the ranks among them. The database still walks
the window's rows (there is no index on latency), but sends back only those few
buckets' rows: at fleet scale that is what costs, about 1 µs a row. Each bucket read
is checked against its count: a row given another bucket when read than when it was
summarised (the database's logarithm and numpy's can round apart on a bucket's bound,
as can another SQLite or PostgreSQL build) moves a rank only when it crosses the bucket
holding that rank, whose count then differs, and that group's percentiles are taken
from all its latencies instead.

Every read of one answer goes through one ``snapshot``, so rows written meanwhile by
the instances cannot make the summaries and the raw rows disagree.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import pandas as pd
from sqlalchemy import Connection, Engine, text

from batchscope.analysis.queries.live import owner_sql
from batchscope.analysis.queries.window import PCTS, Window, count_if, in_window, read_frame
from batchscope.storage import summaries

#: a request row's latency bucket: the expression the summaries are written with
BUCKET_SQL = summaries.BUCKET_SQL  # the very expression the summaries bucket by
KEYS = ("instance_id", "model")

#: name -> (its ``summary_stats`` column, what it sums over the raw rows); requests by the
#: time they finished, batches by the time they ended
REQUEST_SUMS = {
    "requests": ("requests", "COUNT(*)"), "ok": ("ok", count_if("outcome = 'ok'")),
    "rejected": ("rejected", count_if("outcome = 'rejected'")),
    "expired": ("expired", count_if("outcome = 'expired'")),
    "errors": ("failed", count_if("outcome IN ('error', 'oom')")),
}
BATCH_SUMS = {
    "batches": ("batches", "COUNT(*)"), "items": ("batch_items", "SUM(batch_size)"),
    "compute_total_s": ("batch_compute_sum_s", "SUM(compute_s)"),
    "queue_depth_sum": ("queue_depth_sum", "SUM(queue_depth)"),
    "queue_depth_count": ("queue_depth_count", "COUNT(queue_depth)"),
    "oom_batches": ("oom_batches", count_if("outcome = 'oom'")),
}
_FLOATS = ("compute_total_s",)


@contextlib.contextmanager
def snapshot(engine: Engine) -> Iterator[Connection]:
    """A connection whose reads all see the database as of the first of them:
    ``REPEATABLE READ`` on PostgreSQL; on SQLite a read transaction (``BEGIN``), which
    its Python driver does not start for reads by itself."""
    with engine.connect() as conn:
        if conn.dialect.name == "postgresql":
            conn.execution_options(isolation_level="REPEATABLE READ")
        elif conn.dialect.name == "sqlite" and not conn.connection.dbapi_connection.in_transaction:
            conn.exec_driver_sql("BEGIN")
        yield conn


# -- the window in whole spans and raw edges ----------------------------------------------
def inner(w: Window, span_s: int) -> tuple[int, int] | None:
    """The whole ``span_s``-second spans inside ``w`` as ``[a, b)``; None when there is none."""
    a, b = math.ceil(w.start_s / span_s) * span_s, math.floor(w.end_s / span_s) * span_s
    return (a, b) if a < b else None


def edges(w: Window, whole: tuple[int, int] | None) -> list[tuple[float, float]]:
    """The parts of ``w`` outside ``whole`` (all of it when ``whole`` is None)."""
    if whole is None:
        return [(w.start_s, w.end_s)]
    return [(lo, hi) for lo, hi in ((w.start_s, whole[0]), (whole[1], w.end_s)) if lo < hi]


def _raw_where(w: Window, col: str, part: int, lo: float, hi: float,
               instances: Sequence[str]) -> tuple[str, dict] | None:
    """Rows of ``[lo, hi)`` (edge ``part`` of the window, naming its bounds' parameters)
    through an index: by the window's model or instance, else of ``instances`` (None when
    that leaves no row to read)."""
    cond, params = in_window(Window(lo, hi, w.model, w.instance_id), col, bounds=(f"e{part}", f"f{part}"))
    if w.model is None and w.instance_id is None:
        if not instances:
            return None
        cond += f" AND instance_id IN ({', '.join(f':i{n}' for n in range(len(instances)))})"
        params.update({f"i{n}": iid for n, iid in enumerate(instances)})
    return cond, params


def _summary_where(table: str, w: Window, whole: tuple[int, int], *,
                   minutes: bool = True) -> tuple[str, dict]:
    """``table``'s rows over the whole spans ``whole``, of the window's model and instance."""
    cond, params = summaries.span_where(table, *whole, minutes=minutes)
    return f"{cond} {owner_sql(w)}", {**params, "model": w.model, "inst": w.instance_id}


def edge_instances(conn: Connection, w: Window, parts: list[tuple[float, float]]) -> list[str]:
    """The instances with rows in ``parts`` of the window (from the per-second summaries,
    which hold every second that had a row), for reading those rows by instance."""
    if not parts or w.model is not None or w.instance_id is not None:
        return []
    ranges = " OR ".join(f"(start_s >= :a{n} AND start_s < :b{n})" for n in range(len(parts)))
    params = {"fine": 1}
    for n, (lo, hi) in enumerate(parts):
        params.update({f"a{n}": math.floor(lo), f"b{n}": math.ceil(hi)})
    found = conn.execute(text(f"SELECT DISTINCT instance_id FROM summary_stats WHERE span_s = :fine "
                              f"AND ({ranges})"), params)
    return sorted(str(r[0]) for r in found)


# -- counts and sums ------------------------------------------------------------------------
def window_sums(conn: Connection, w: Window, *, bucket_s: float | None = None) -> pd.DataFrame:
    """Per instance and model (and time bucket ``b`` with ``bucket_s``): the counts and
    sums of ``REQUEST_SUMS`` and ``BATCH_SUMS`` over exactly ``[w.start_s, w.end_s)``,
    with ``first_s`` / ``last_s`` (no request finished before / after them) and
    ``last_batch_s`` (no batch ended after it) as bounds for finding those rows. One
    statement: the summaries' rows of the whole seconds and the raw rows of the edges,
    added up by the database."""
    names = [*REQUEST_SUMS, *BATCH_SUMS]
    keys = ", ".join([*KEYS, *(["b"] if bucket_s else [])])
    params: dict = {"bucket": bucket_s} if bucket_s else {}
    parts = []
    whole = inner(w, 1)
    if whole is not None:
        cond, spans = _summary_where("summary_stats", w, whole,
                                     minutes=bucket_s is None or bucket_s % summaries.MINUTE_S == 0)
        params.update(spans)
        b = ", CAST(FLOOR(start_s / :bucket) AS BIGINT) AS b" if bucket_s else ""
        parts.append(f"""
            SELECT instance_id, model{b}, {', '.join(f'{col} AS {name}' for name, (col, _) in
                                                       (*REQUEST_SUMS.items(), *BATCH_SUMS.items()))},
                   CASE WHEN requests > 0 THEN start_s END AS first_s,
                   CASE WHEN requests > 0 THEN start_s + span_s END AS last_s,
                   CASE WHEN batches > 0 THEN start_s END AS last_batch_s
            FROM summary_stats WHERE {cond}""")
    outside = edges(w, whole)
    instances = edge_instances(conn, w, outside)
    for part, (lo, hi) in enumerate(outside):
        for table, col, sums, bounds in (
                ("requests", "finished_at", REQUEST_SUMS,
                 "MIN(finished_at) AS first_s, MAX(finished_at) AS last_s, NULL AS last_batch_s"),
                ("batches", "ended_at", BATCH_SUMS,
                 "NULL AS first_s, NULL AS last_s, MAX(ended_at) AS last_batch_s")):
            found = _raw_where(w, col, part, lo, hi, instances)
            if found is None:
                continue
            cond, more = found
            params.update(more)
            b = f", CAST(FLOOR({col} / :bucket) AS BIGINT) AS b" if bucket_s else ""
            select = ", ".join(f"{sums[name][1] if name in sums else '0'} AS {name}" for name in names)
            parts.append(f"SELECT instance_id, model{b}, {select}, {bounds} FROM {table} WHERE {cond} "
                         f"GROUP BY {keys}")
    columns = [*KEYS, *(["b"] if bucket_s else []), *names, "first_s", "last_s", "last_batch_s"]
    if not parts:
        return pd.DataFrame(columns=columns)
    total = ", ".join(f"SUM({name}) AS {name}" if name in _FLOATS
                      else f"CAST(SUM({name}) AS BIGINT) AS {name}" for name in names)
    df = read_frame(conn, f"""
        SELECT {keys}, {total}, MIN(first_s) AS first_s, MAX(last_s) AS last_s,
               MAX(last_batch_s) AS last_batch_s
        FROM ({' UNION ALL '.join(parts)}) AS parts GROUP BY {keys} ORDER BY {keys}""", params)
    for name in ("first_s", "last_s", "last_batch_s"):
        df[name] = df[name].astype("float64")
    return df[columns]


# -- exact percentiles ----------------------------------------------------------------------
@dataclass
class Percentiles:
    """``per_instance``: instance_id, model, ``latency_p<p>_s``; ``per_model``: model and
    the same over all its instances' requests ranked together. ``read_rows``: the raw
    latencies read to find them; ``fallbacks``: groups read whole (see the module doc)."""

    per_instance: pd.DataFrame
    per_model: pd.DataFrame
    read_rows: int = 0
    fallbacks: list = field(default_factory=list)


def latency_histogram(conn: Connection, w: Window) -> pd.DataFrame:
    """Completed requests per instance, model and latency bucket over exactly the window
    (one statement, like ``window_sums``)."""
    parts, params = [], {}
    whole = inner(w, summaries.SLOT_S)
    if whole is not None:
        cond, params = _summary_where("summary_latency", w, whole)
        parts.append(f"SELECT instance_id, model, bucket, n FROM summary_latency WHERE {cond} "
                     "AND outcome = 'ok'")
    outside = edges(w, whole)
    instances = edge_instances(conn, w, outside)
    for part, (lo, hi) in enumerate(outside):
        found = _raw_where(w, "finished_at", part, lo, hi, instances)
        if found is not None:
            cond, more = found
            params.update(more)
            parts.append(f"SELECT instance_id, model, {BUCKET_SQL} AS bucket, COUNT(*) AS n FROM requests "
                         f"WHERE {cond} AND outcome = 'ok' GROUP BY 1, 2, 3")
    if not parts:
        return pd.DataFrame({"instance_id": [], "model": [], "bucket": [], "n": []})
    return read_frame(conn, f"""
        SELECT instance_id, model, bucket, CAST(SUM(n) AS BIGINT) AS n
        FROM ({' UNION ALL '.join(parts)}) AS parts GROUP BY instance_id, model, bucket
        ORDER BY instance_id, model, bucket""", params).astype({"bucket": "int64", "n": "int64"})


@dataclass(frozen=True)
class _Target:
    """Rank ``rank`` of ``group`` (an instance id, or None for the model's fleet) lies in
    ``bucket``, as the ``within``-th of its ``count`` values there."""

    group: str | None
    pct: int
    bucket: int
    within: int
    count: int


def _targets(group: str | None, hist: pd.DataFrame, pcts: Sequence[int]) -> list[_Target]:
    by_bucket = hist.groupby("bucket")["n"].sum().sort_index()
    buckets, counts = by_bucket.index.to_numpy(dtype="int64"), by_bucket.to_numpy(dtype="int64")
    cum = np.cumsum(counts)
    total = int(cum[-1]) if len(cum) else 0
    out = []
    for p in pcts if total else ():
        rank = max(1, (p * total + 99) // 100)
        i = int(np.searchsorted(cum, rank, side="left"))
        before = int(cum[i - 1]) if i else 0
        out.append(_Target(group, p, int(buckets[i]), rank - before, int(counts[i])))
    return out


def window_percentiles(conn: Connection, w: Window, *, instance_pcts: Sequence[int] = PCTS,
                       fleet_pcts: Sequence[int] = PCTS) -> Percentiles:
    """Exact nearest-rank latency percentiles of the window's completed requests: per
    instance and model (``instance_pcts``) and per model over every instance
    (``fleet_pcts``). ``conn`` should be a ``snapshot``."""
    hist = latency_histogram(conn, w)
    inst_rows, model_rows, read, fallbacks = [], [], 0, []
    for model, of_model in hist.groupby("model", sort=True):
        targets = _targets(None, of_model, fleet_pcts)
        for iid, of_instance in of_model.groupby("instance_id", sort=True):
            targets += _targets(str(iid), of_instance, instance_pcts)
        ids = sorted({t.group for t in targets if t.group is not None})
        rows = _bucket_rows(conn, w, str(model), targets, ids)
        read += len(rows)
        values: dict[tuple[str | None, int], float] = {}
        broken: set[str | None] = set()
        for t in targets:
            mask = rows[:, 1] == t.bucket
            if t.group is not None:
                mask &= rows[:, 0] == ids.index(t.group)
            found = rows[mask, 2]
            if len(found) != t.count:  # a row read in another bucket than it was summarised in
                broken.add(t.group)
            else:
                values[(t.group, t.pct)] = float(np.partition(found, t.within - 1)[t.within - 1])
        for group in sorted(broken, key=str):
            fallbacks.append((group, str(model)))
            values.update(_from_all(conn, w, str(model), group,
                                    fleet_pcts if group is None else instance_pcts))
        model_rows.append({"model": model, **{f"latency_p{p}_s": values.get((None, p), math.nan)
                                               for p in fleet_pcts}})
        inst_rows += [{"instance_id": iid, "model": model,
                       **{f"latency_p{p}_s": values.get((iid, p), math.nan) for p in instance_pcts}}
                      for iid in ids]
    return Percentiles(
        pd.DataFrame(inst_rows, columns=["instance_id", "model",
                                         *(f"latency_p{p}_s" for p in instance_pcts)]),
        pd.DataFrame(model_rows, columns=["model", *(f"latency_p{p}_s" for p in fleet_pcts)]),
        read, fallbacks)


def latency_buckets(latency_s: np.ndarray) -> np.ndarray:
    """``summaries.latency_bucket`` of each latency, the same arithmetic in numpy (a row
    its rounding puts in another bucket than the SQL did shows in the bucket counts)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        inside = np.ceil(summaries.BUCKETS_PER_DECADE * np.log(latency_s / summaries.MIN_LATENCY_S)
                         / np.log(10.0))
    return np.where(latency_s <= summaries.MIN_LATENCY_S, 0,
                    np.where(latency_s > summaries.MAX_LATENCY_S, summaries.OVERFLOW_BUCKET,
                             np.nan_to_num(inside))).astype("int64")


def _latency_ranges(buckets: Sequence[int]) -> str:
    """``latency_s`` in any of ``buckets`` (runs of neighbours as one range), each range a
    hair wider than its buckets so that no row on a bound is missed."""
    runs: list[list[int]] = []
    for b in sorted(set(buckets)):
        if runs and b == runs[-1][1] + 1:
            runs[-1][1] = b
        else:
            runs.append([b, b])
    parts = []
    for lo, hi in runs:
        bounds = []
        if lo > 0:
            bounds.append(f"latency_s > {summaries.bucket_upper_s(lo - 1) * (1 - 1e-9)!r}")
        if hi < summaries.OVERFLOW_BUCKET:
            bounds.append(f"latency_s <= {summaries.bucket_upper_s(hi) * (1 + 1e-9)!r}")
        parts.append(f"({' AND '.join(bounds) or '1 = 1'})")
    return f"({' OR '.join(parts)})"


def _bucket_rows(conn: Connection, w: Window, model: str, targets: list[_Target],
                 ids: list[str]) -> np.ndarray:
    """``[instance index, bucket, latency]`` of the model's completed requests in the
    window with a latency in a bucket that holds a target rank: a fleet target's bucket
    for every instance, an instance's for that instance only. The database only compares
    latencies with the buckets' bounds (computing each row's bucket there costs as much
    as sending it); numpy gives each row its bucket."""
    if not targets:
        return np.empty((0, 3))
    fleet = sorted({t.bucket for t in targets if t.group is None})
    own: dict[int, set[str]] = {}
    for t in targets:
        if t.group is not None and t.bucket not in fleet:
            own.setdefault(t.bucket, set()).add(t.group)
    params: dict = {"t0": w.start_s, "t1": w.end_s, "model": model,
                    **{f"i{n}": iid for n, iid in enumerate(ids)}}
    which = [_latency_ranges(fleet)] if fleet else []
    for b, groups in sorted(own.items()):
        names = ", ".join(f":i{ids.index(g)}" for g in sorted(groups))
        which.append(f"({_latency_ranges([b])} AND instance_id IN ({names}))")
    index = " ".join(f"WHEN :i{n} THEN {n}" for n in range(len(ids)))
    sql = f"""
        SELECT CASE instance_id {index} ELSE -1 END, latency_s FROM requests
        WHERE model = :model AND finished_at >= :t0 AND finished_at < :t1 AND outcome = 'ok'
            AND ({' OR '.join(which)})"""
    result = conn.execute(text(sql), params)
    try:
        rows = result.cursor.fetchall()  # plain tuples straight from the driver: the costly part
    finally:
        result.close()
    found = np.array(rows, dtype="float64").reshape(-1, 2)
    return np.column_stack([found[:, 0], latency_buckets(found[:, 1]), found[:, 1]])


def _from_all(conn: Connection, w: Window, model: str, instance_id: str | None,
              pcts: Sequence[int]) -> dict[tuple[str | None, int], float]:
    """The group's percentiles from all its completed requests' latencies."""
    sql = ("SELECT latency_s FROM requests WHERE model = :model AND finished_at >= :t0 AND "
           "finished_at < :t1 AND outcome = 'ok'" + (" AND instance_id = :inst" if instance_id else ""))
    found = conn.execute(text(sql), {"model": model, "t0": w.start_s, "t1": w.end_s, "inst": instance_id})
    values = np.fromiter(found.scalars(), dtype="float64")
    return {(instance_id, p): nearest_rank_np(values, p) for p in pcts}


def nearest_rank_np(values: np.ndarray, pct: float) -> float:
    """The smallest value with at least ``pct`` % of the values at or below it."""
    if not len(values):
        return math.nan
    k = max(1, math.ceil(pct * len(values) / 100))
    return float(np.partition(values, k - 1)[k - 1])
