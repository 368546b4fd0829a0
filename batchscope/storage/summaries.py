"""Summaries of the raw rows, kept up to date as the rows arrive.

A live refresh of the dashboard over a fleet's traffic (hundreds of thousands of
requests in a quarter of an hour) cannot aggregate raw rows every few seconds, so
every write of ``requests`` or ``batches`` rows also adds them, in the same
transaction, to three summary tables (``batchscope.storage.schema``), each at a fine
span and per minute (``span_s``):

* ``summary_stats`` (per second and per minute): per instance and model, the counts by
  outcome and the sums behind every mean of the headline and the timelines (requests by
  the second they finished in, batches by the second they ended in);
* ``summary_latency`` (per 5 seconds and per minute): per instance, model, priority and
  outcome, the count, and for completed requests a latency histogram of 32 buckets per
  decade (upper bounds ``1e-4 * 10 ** (bucket / 32)`` s, so a percentile read from it is
  at most 7.5 % above the exact one) with latency and queue wait sums per bucket;
* ``summary_shapes`` (per 5 seconds and per minute): per instance and model, batches by
  size, length bucket and outcome, with their compute time and elements.

A reader takes the whole minutes of a window from the minute rows and its edges from the
fine ones (:func:`span_where`), so a window costs rows in proportion to its length in
minutes, not to the traffic in it.

They are written by SQL over the rows just inserted (``INSERT ... SELECT ... GROUP BY
... ON CONFLICT DO UPDATE``), the same statements on SQLite and PostgreSQL, so the
database does the work and the writer's Python cost does not grow with the rows. Keys
start with the span and the time, then model and instance: each instance adds to its own
rows, so instances sharing a database never contend for one. Retention deletes summaries
with the raw rows they summarise. Every 4th bucket bound is one of the roll-ups' bounds
(``retention.LATENCY_BOUNDS_S``, 8 per decade): ``retention.rollup_key`` maps a bucket
to the roll-up histogram key.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Connection, text

from batchscope.storage.schema import LatencySummary, ShapeSummary, StatsSummary

#: the migration that made the summary tables as this module writes them: a database
#: upgraded from before it gets its summaries rebuilt from its raw rows
SINCE_REVISION = "0003"
#: the fine span of the latency and shape summaries, and the coarse span of all three
SLOT_S = 5
MINUTE_S = 60
#: table -> its spans, seconds (fine first)
SPANS = {StatsSummary.__tablename__: (1, MINUTE_S), LatencySummary.__tablename__: (SLOT_S, MINUTE_S),
         ShapeSummary.__tablename__: (SLOT_S, MINUTE_S)}
BUCKETS_PER_DECADE = 32
#: the lowest bucket's upper bound and the highest finite one, seconds
MIN_LATENCY_S = 1e-4
MAX_LATENCY_S = 100.0
#: the bucket of latencies above ``MAX_LATENCY_S``
OVERFLOW_BUCKET = BUCKETS_PER_DECADE * round(math.log10(MAX_LATENCY_S / MIN_LATENCY_S)) + 1
#: what ``bucket`` holds for requests that did not complete (no latency histogram)
NOT_OK_BUCKET = -1
#: what ``summary_shapes.bucket`` holds for a batch of fixed-size inputs (no length bucket)
NO_LENGTH_BUCKET = -2

BUCKET_SQL = (f"CASE WHEN latency_s <= {MIN_LATENCY_S!r} THEN 0 "
               f"WHEN latency_s > {MAX_LATENCY_S!r} THEN {OVERFLOW_BUCKET} "
               f"ELSE CAST(CEIL({BUCKETS_PER_DECADE} * LN(latency_s / {MIN_LATENCY_S!r}) / LN(10.0)) "
               "AS INTEGER) END")


def latency_bucket(latency_s: float) -> int:
    """The histogram bucket of ``latency_s`` (what the SQL computes)."""
    if latency_s <= MIN_LATENCY_S:
        return 0
    if latency_s > MAX_LATENCY_S:
        return OVERFLOW_BUCKET
    return int(math.ceil(BUCKETS_PER_DECADE * math.log(latency_s / MIN_LATENCY_S) / math.log(10.0)))


def bucket_upper_s(bucket: int) -> float:
    """The upper bound of ``bucket``, seconds (``inf`` for the overflow bucket)."""
    if bucket >= OVERFLOW_BUCKET:
        return math.inf
    return MIN_LATENCY_S * 10 ** (bucket / BUCKETS_PER_DECADE)


# -- writing -------------------------------------------------------------------------
def _greatest(table: str, column: str) -> str:
    """The larger of the stored and the new value, either of them NULL (SQLite's
    two-argument MAX is NULL when one is; PostgreSQL spells it GREATEST)."""
    return (f"{column} = CASE WHEN {table}.{column} IS NULL OR excluded.{column} > {table}.{column} "
            f"THEN excluded.{column} ELSE {table}.{column} END")


def _upsert(table: str, key: dict[str, str], values: dict[str, str], source: str, where: str,
            *, greatest: tuple[str, ...] = ()) -> str:
    """One statement adding the ``source`` rows matching ``where`` to ``table`` at both
    its spans, reading them once: the fine groups (``WITH fine``), and the minute groups
    made of those, inserted or added to what is there (``ON CONFLICT DO UPDATE``: sums
    added, ``greatest`` columns kept at their max). ``key`` and ``values`` map each
    column to its expression over ``source``."""
    at = "finished_at" if source == "requests" else "ended_at"
    fine, minute = SPANS[table]
    keys = {"span_s": str(fine), "start_s": f"CAST(FLOOR({at} / {fine}) AS BIGINT) * {fine}", **key}
    columns = [*keys, *values]
    fine_select = ", ".join(f"{expr} AS {name}" for name, expr in [*keys.items(), *values.items()])
    minute_keys = [str(minute), f"CAST(FLOOR(start_s / {minute}) AS BIGINT) * {minute}", *key]
    minute_values = [f"MAX({c})" if c in greatest else f"SUM({c})" for c in values]
    updates = [_greatest(table, c) if c in greatest else f"{c} = {table}.{c} + excluded.{c}" for c in values]
    groups = ", ".join(str(i + 1) for i in range(len(keys)))
    return (f"WITH fine AS (SELECT {fine_select} FROM {source} WHERE {where} GROUP BY {groups}) "
            f"INSERT INTO {table} ({', '.join(columns)}) "
            f"SELECT {', '.join(columns)} FROM fine WHERE 1 = 1 UNION ALL "
            f"SELECT {', '.join([*minute_keys, *minute_values])} FROM fine WHERE 1 = 1 GROUP BY {groups} "
            f"ON CONFLICT ({', '.join(keys)}) DO UPDATE SET {', '.join(updates)}")


def _ok(expr: str) -> str:
    return f"COALESCE(SUM(CASE WHEN outcome = 'ok' THEN {expr} END), 0)"


def _n(condition: str) -> str:
    return f"SUM(CASE WHEN {condition} THEN 1 ELSE 0 END)"


_OWNER = {"model": "model", "instance_id": "instance_id"}


def request_statements(where: str) -> list[str]:
    """The statements that add the ``requests`` rows matching ``where`` to the summaries."""
    stats = _upsert(StatsSummary.__tablename__, _OWNER, {
        "requests": "COUNT(*)", "ok": _n("outcome = 'ok'"), "rejected": _n("outcome = 'rejected'"),
        "expired": _n("outcome = 'expired'"), "failed": _n("outcome IN ('error', 'oom')"),
        "ok_latency_sum_s": _ok("latency_s"), "ok_queue_wait_sum_s": _ok("queue_wait_s"),
    }, "requests", where)
    latency = _upsert(LatencySummary.__tablename__, {
        **_OWNER, "priority": "priority", "outcome": "outcome",
        "bucket": f"CASE WHEN outcome = 'ok' THEN {BUCKET_SQL} ELSE {NOT_OK_BUCKET} END"}, {
        "n": "COUNT(*)", "latency_sum_s": "SUM(latency_s)", "queue_wait_sum_s": "SUM(queue_wait_s)",
    }, "requests", where)
    return [stats, latency]


def batch_statements(where: str) -> list[str]:
    """The statements that add the ``batches`` rows matching ``where`` to the summaries."""
    stats = _upsert(StatsSummary.__tablename__, _OWNER, {
        "batches": "COUNT(*)", "batch_items": "SUM(batch_size)", "batch_compute_sum_s": "SUM(compute_s)",
        "batch_queue_wait_sum_s": "SUM(queue_wait_mean_s)", "queue_depth_sum": "COALESCE(SUM(queue_depth), 0)",
        "queue_depth_count": "COUNT(queue_depth)", "queue_depth_max": "MAX(queue_depth)",
        "max_batch_size_max": "MAX(max_batch_size)", "oom_batches": _n("outcome = 'oom'"),
        "real_elements": "SUM(real_elements)", "padded_elements": "SUM(padded_elements)",
    }, "batches", where, greatest=("queue_depth_max", "max_batch_size_max"))
    shapes = _upsert(ShapeSummary.__tablename__, {
        **_OWNER, "batch_size": "batch_size", "bucket": f"COALESCE(bucket, {NO_LENGTH_BUCKET})",
        "outcome": "outcome"}, {
        "n": "COUNT(*)", "compute_sum_s": "SUM(compute_s)", "real_elements": "SUM(real_elements)",
        "padded_elements": "SUM(padded_elements)", "max_batch_size_max": "MAX(max_batch_size)",
    }, "batches", where, greatest=("max_batch_size_max",))
    return [stats, shapes]


#: the row ids just inserted: a range on SQLite (one writer at a time, so they are
#: consecutive), the list of them on PostgreSQL (several writers interleave a sequence;
#: the range lets the planner read them by the primary key)
ID_RANGE = "id BETWEEN :lo AND :hi"
ID_LIST = "id BETWEEN :lo AND :hi AND id = ANY(:ids)"

STATEMENTS = {"requests": request_statements, "batches": batch_statements}
TABLES = (StatsSummary, LatencySummary, ShapeSummary)


def add_rows(conn: Connection, table: str, where: str, params: dict[str, Any]) -> None:
    """Add the ``table`` rows (``requests`` or ``batches``) matching ``where`` to the
    summaries, in ``conn``'s transaction."""
    for sql in STATEMENTS[table](where):
        conn.execute(text(sql), params)


def rebuild(conn: Connection) -> None:
    """Summarise every raw row anew (a database whose rows came without summaries: one
    written before they existed, a snapshot's temporary database)."""
    for table in TABLES:
        conn.execute(table.__table__.delete())
    for source in STATEMENTS:
        add_rows(conn, source, "1 = 1", {})


def delete_before(conn: Connection, cutoff_s: float) -> int:
    """Delete the summaries of everything before ``cutoff_s`` (retention); spans that
    reach past it are kept. Returns how many summary rows went."""
    gone = 0
    for table in TABLES:
        gone += conn.execute(table.__table__.delete().where(table.start_s + table.span_s <= cutoff_s)).rowcount
    return gone


# -- reading -------------------------------------------------------------------------
def span_where(table: str, s0: int, s1: int, *, minutes: bool = True) -> tuple[str, dict[str, int]]:
    """The condition (and its parameters) that picks ``table``'s rows covering the
    seconds ``[s0, s1)``: the whole minutes inside from the minute rows (``minutes``),
    the rest from the fine rows, whole fine spans from the one holding ``s0``."""
    fine = SPANS[table][0]
    f0 = s0 // fine * fine
    m0, m1 = -(-s0 // MINUTE_S) * MINUTE_S, s1 // MINUTE_S * MINUTE_S
    if not minutes or m0 >= m1:
        return "(span_s = :fine AND start_s >= :f0 AND start_s < :s1)", {"fine": fine, "f0": f0, "s1": s1}
    return ("((span_s = :minute AND start_s >= :m0 AND start_s < :m1) OR (span_s = :fine AND "
            "((start_s >= :f0 AND start_s < :m0) OR (start_s >= :m1 AND start_s < :s1))))",
            {"minute": MINUTE_S, "fine": fine, "f0": f0, "m0": m0, "m1": m1, "s1": s1})
