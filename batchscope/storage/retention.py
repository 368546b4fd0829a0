"""Retention: roll raw rows older than a window into per-interval summaries.

``requests`` and ``batches`` rows older than the cutoff are summarised per
(instance, model, interval) into ``rollups`` and deleted in the same transaction, so
every row is counted exactly once: either raw or in a roll-up. Rows inside the raw
window are never touched, so percentiles there stay exact. Events (except
``settings_change``, kept for the settings history), device samples, generation
steps and traced requests (``request_traces``) older than the cutoff are deleted, and so are the live summaries of that time
(``batchscope.storage.summaries``).

What a roll-up row holds:

* ``requests`` (all outcomes), ``requests_ok``, ``requests_failed`` and
  ``outcomes_json`` ({outcome: count});
* ``latency_sum_s``, ``queue_wait_sum_s`` and ``latency_hist_json`` over completed
  (``ok``) requests: mean latency = ``latency_sum_s / requests_ok``; the histogram maps
  each upper bound of :data:`LATENCY_BOUNDS_S` (as text, ``"inf"`` for the rest) to a
  count, and :func:`hist_quantile` reads percentiles from it;
* ``batches``, ``batch_size_sum``, ``real_elements``, ``padded_elements``,
  ``compute_sum_s`` and ``batch_size_hist_json`` ({batch size: count}) over all batches.

The cutoff is rounded down to a whole interval, and an interval that already has a
roll-up (rows that arrived late) is merged into it, so running this again, or while
the recorder writes, is safe. Work is cut into chunks of ``chunk_intervals`` intervals.
Each chunk is summarised by plain reads (writers go on), bounded by the highest row id
seen, then stored and deleted in one short write transaction (on SQLite it takes the
write lock up front, ``BEGIN IMMEDIATE``) that checks it deletes exactly the rows it
summarised, and otherwise rolls back and summarises again. Instances sharing a database
may all run retention at the same moment: their write transactions take turns (on
PostgreSQL under an advisory lock), and a chunk another instance rolled up first is
skipped.
"""

from __future__ import annotations

import json
import math
from bisect import bisect_left
from dataclasses import dataclass, field, replace
from typing import Mapping

from sqlalchemy import Connection, Engine, Integer, case, cast, delete, func, insert, select, text, update

from batchscope.storage import summaries
from batchscope.storage.db import locked_transaction
from batchscope.storage.schema import (BatchRecord, DeviceSample, EventRecord, GenerationStep, LatencySummary,
                                       RequestRecord, RequestTraceRecord, Rollup, ShapeSummary,
                                       StatsSummary)

#: Upper bounds (seconds) of the latency histogram: 8 per decade from 0.1 ms to 100 s.
LATENCY_BOUNDS_S: tuple[float, ...] = tuple(float(f"{1e-4 * 10 ** (i / 8):.4g}") for i in range(49))
_LATENCY_KEYS: tuple[str, ...] = tuple(f"{b:g}" for b in LATENCY_BOUNDS_S) + ("inf",)
#: Event kinds kept beyond the raw window.
KEPT_EVENT_KINDS: tuple[str, ...] = ("settings_change",)
#: how many times a chunk is summarised again when its rows changed meanwhile
MAX_RETRIES = 3
#: the PostgreSQL advisory lock of retention's write transactions
RETENTION_LOCK_KEY = 0x6261_7463_6872_6574  # "batchret"


@dataclass(frozen=True, slots=True)
class RollupStats:
    cutoff: float
    requests_rolled: int = 0
    batches_rolled: int = 0
    rollups_inserted: int = 0
    rollups_merged: int = 0
    events_deleted: int = 0
    device_samples_deleted: int = 0
    generation_steps_deleted: int = 0
    #: traced requests (``request_traces``) older than the cutoff
    request_traces_deleted: int = 0
    rollups_deleted: int = 0
    #: rows of the live summaries (batchscope.storage.summaries) of the rolled-up time
    summary_rows_deleted: int = 0
    #: chunks summarised again because their rows changed meanwhile
    chunks_retried: int = 0


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """Keep raw rows for ``raw_max_age_s``; summarise older ones per ``interval_s``;
    drop roll-ups older than ``rollup_max_age_s`` (None keeps them forever)."""

    raw_max_age_s: float
    interval_s: float = 60.0
    rollup_max_age_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("raw_max_age_s", "interval_s", "rollup_max_age_s"):
            value = getattr(self, name)
            if value is None and name == "rollup_max_age_s":
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name}={value!r} must be a positive number of seconds")


@dataclass(slots=True)
class Totals:
    """What one roll-up row holds (one instance, model and interval), being built or read."""

    requests: int = 0
    requests_ok: int = 0
    outcomes: dict = field(default_factory=dict)
    queue_wait_sum_s: float = 0.0
    latency_sum_s: float = 0.0
    latency_hist: dict = field(default_factory=dict)
    batches: int = 0
    batch_size_sum: int = 0
    real_elements: int = 0
    padded_elements: int = 0
    compute_sum_s: float = 0.0
    batch_size_hist: dict = field(default_factory=dict)


# ------------------------------------------------------------------ histograms

def latency_bucket(latency_s: float) -> str:
    """The histogram key (upper bound as text) a latency falls into."""
    return _LATENCY_KEYS[bisect_left(LATENCY_BOUNDS_S, latency_s)]


def merge_hists(*hists: Mapping[str, int]) -> dict[str, int]:
    merged: dict[str, int] = {}
    for hist in hists:
        for key, n in hist.items():
            merged[key] = merged.get(key, 0) + int(n)
    return merged


def hist_quantile(hist: Mapping[str, int] | str, q: float) -> float | None:
    """The ``q`` quantile (0..1) of a histogram {upper bound: count}, as the upper bound
    of the bucket holding it (``inf`` when beyond the last bound); None when empty."""
    if isinstance(hist, str):
        hist = json.loads(hist or "{}")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q={q!r} must be between 0 and 1")
    items = sorted((float(k), int(n)) for k, n in hist.items() if int(n) > 0)
    total = sum(n for _, n in items)
    if total == 0:
        return None
    rank = max(1, math.ceil(q * total))
    seen = 0
    for bound, n in items:
        seen += n
        if seen >= rank:
            return bound
    return items[-1][0]


# ------------------------------------------------------------------ transactions

def _write_transaction(engine: Engine):
    """A transaction that holds the write lock from its first statement on SQLite, so
    rows read for the summary cannot change before they are deleted; on PostgreSQL an
    advisory lock, so the instances of a fleet (each runs retention) take turns instead
    of rolling up the same rows at once and undoing each other."""
    return locked_transaction(engine, advisory_key=RETENTION_LOCK_KEY)


def _interval_index(conn: Connection, column, interval_s: float):
    ratio = column / interval_s
    if conn.dialect.name == "sqlite":
        return cast(ratio, Integer)  # truncation = floor for the positive epoch times stored
    return func.floor(ratio)


# ------------------------------------------------------------------ roll-up

def roll_up(engine: Engine, *, older_than: float, interval_s: float = 60.0,
            chunk_intervals: int = 60) -> RollupStats:
    """Summarise and delete raw rows older than ``older_than`` (wall seconds).

    The cutoff is ``older_than`` rounded down to a multiple of ``interval_s``. Returns
    what was done. Idempotent; safe while the recorder writes."""
    if not (math.isfinite(interval_s) and interval_s > 0):
        raise ValueError(f"interval_s={interval_s!r} must be a positive number of seconds")
    if chunk_intervals < 1:
        raise ValueError(f"chunk_intervals={chunk_intervals!r} must be at least 1")
    cutoff = math.floor(older_than / interval_s) * interval_s
    totals = {"requests_rolled": 0, "batches_rolled": 0, "rollups_inserted": 0, "rollups_merged": 0}
    retries = 0
    while True:
        with engine.connect() as conn:
            oldest = [conn.execute(select(func.min(col)).where(col < cutoff)).scalar()
                      for col in (RequestRecord.finished_at, BatchRecord.ended_at)]
        oldest = [t for t in oldest if t is not None]
        if not oldest:
            break
        chunk_end = min(cutoff, (math.floor(min(oldest) / interval_s) + chunk_intervals) * interval_s)
        try:
            done = _roll_chunk(engine, before=chunk_end, interval_s=interval_s)
        except ChunkTaken:  # another instance rolled these rows up meanwhile: go on from there
            continue
        except RowsChanged:
            retries += 1
            if retries > MAX_RETRIES:
                raise
            continue
        for key, n in done.items():
            totals[key] += n
    with _write_transaction(engine) as conn:
        events = conn.execute(delete(EventRecord).where(
            EventRecord.at < cutoff, EventRecord.kind.not_in(KEPT_EVENT_KINDS))).rowcount
        samples = conn.execute(delete(DeviceSample).where(DeviceSample.at < cutoff)).rowcount
        steps = conn.execute(delete(GenerationStep).where(GenerationStep.at < cutoff)).rowcount
        traces = conn.execute(delete(RequestTraceRecord).where(
            RequestTraceRecord.request_end_at < cutoff)).rowcount
        summary_rows = summaries.delete_before(conn, cutoff)
    return RollupStats(cutoff=cutoff, events_deleted=events, device_samples_deleted=samples,
                       generation_steps_deleted=steps, request_traces_deleted=traces,
                       summary_rows_deleted=summary_rows,
                       chunks_retried=retries, **totals)


class RowsChanged(RuntimeError):
    """Raw rows changed between their summary and their deletion (another roll-up ran)."""


class ChunkTaken(RowsChanged):
    """Every row summarised was gone by the time of the deletion: another instance's
    retention rolled the same chunk up first."""


@dataclass(slots=True)
class _Summary:
    accs: dict
    requests: int
    batches: int
    request_filter: tuple
    batch_filter: tuple


def _roll_chunk(engine: Engine, *, before: float, interval_s: float) -> dict[str, int]:
    """Summarise rows older than ``before`` without blocking writers, then store the
    summary and delete exactly those rows in one short write transaction."""
    with engine.connect() as conn:
        summary = _summarise(conn, before=before, interval_s=interval_s)
    with _write_transaction(engine) as conn:
        inserted, merged = _store(conn, summary.accs, interval_s)
        deleted = (conn.execute(delete(RequestRecord).where(*summary.request_filter)).rowcount,
                   conn.execute(delete(BatchRecord).where(*summary.batch_filter)).rowcount)
        if deleted == (0, 0) and summary.requests + summary.batches:
            raise ChunkTaken("another instance rolled these rows up first")  # rolled back
        if deleted != (summary.requests, summary.batches):
            # rolled back: nothing is lost or counted twice
            raise RowsChanged(f"retention summarised {summary.requests} requests/{summary.batches} batches "
                              f"but found {deleted[0]}/{deleted[1]} to delete")
    return {"requests_rolled": summary.requests, "batches_rolled": summary.batches,
            "rollups_inserted": inserted, "rollups_merged": merged}


def _summarise(conn: Connection, *, before: float, interval_s: float) -> _Summary:
    req, bat = RequestRecord, BatchRecord
    # rows committed after this point get higher ids and are left for the next run
    req_max = conn.execute(select(func.max(req.id))).scalar() or 0
    bat_max = conn.execute(select(func.max(bat.id))).scalar() or 0
    req_where = (req.finished_at < before, req.id <= req_max)
    bat_where = (bat.ended_at < before, bat.id <= bat_max)
    accs, requests, batches = _aggregate(conn, req_where, bat_where, interval_s)
    return _Summary(accs=accs, requests=requests, batches=batches, request_filter=req_where,
                    batch_filter=bat_where)


def _aggregate(conn: Connection, req_where: tuple, bat_where: tuple,
               interval_s: float) -> tuple[dict[tuple[str, str, int], Totals], int, int]:
    """The raw rows matching the filters summarised per (instance, model, interval
    index), and how many requests and batches that was."""
    req, bat = RequestRecord, BatchRecord
    accs: dict[tuple[str, str, int], Totals] = {}

    k = _interval_index(conn, req.finished_at, interval_s).label("k")
    bucket = case((req.outcome != "ok", -1),
                  *[(req.latency_s <= b, i) for i, b in enumerate(LATENCY_BOUNDS_S)],
                  else_=len(LATENCY_BOUNDS_S)).label("bucket")
    groups = (req.instance_id, req.model, k, req.outcome, bucket)
    rows = conn.execute(select(*groups, func.count(), func.sum(req.queue_wait_s), func.sum(req.latency_s))
                        .where(*req_where).group_by(*groups))
    requests = 0
    for instance_id, model, idx, outcome, b, n, wait_s, latency_s in rows:
        acc = accs.setdefault((instance_id, model, int(idx)), Totals())
        acc.requests += n
        acc.outcomes[outcome] = acc.outcomes.get(outcome, 0) + n
        requests += n
        if outcome == "ok":
            acc.requests_ok += n
            acc.queue_wait_sum_s += wait_s or 0.0
            acc.latency_sum_s += latency_s or 0.0
            key = _LATENCY_KEYS[b]
            acc.latency_hist[key] = acc.latency_hist.get(key, 0) + n

    k = _interval_index(conn, bat.ended_at, interval_s).label("k")
    groups = (bat.instance_id, bat.model, k, bat.batch_size)
    rows = conn.execute(select(*groups, func.count(), func.sum(bat.real_elements), func.sum(bat.padded_elements),
                               func.sum(bat.compute_s)).where(*bat_where).group_by(*groups))
    batches = 0
    for instance_id, model, idx, size, n, real, padded, compute_s in rows:
        acc = accs.setdefault((instance_id, model, int(idx)), Totals())
        acc.batches += n
        acc.batch_size_sum += n * size
        acc.real_elements += real or 0
        acc.padded_elements += padded or 0
        acc.compute_sum_s += compute_s or 0.0
        acc.batch_size_hist[str(size)] = acc.batch_size_hist.get(str(size), 0) + n
        batches += n
    return accs, requests, batches


def _store(conn: Connection, accs: dict[tuple[str, str, int], Totals], interval_s: float) -> tuple[int, int]:
    if not accs:
        return 0, 0
    starts = [idx * interval_s for _, _, idx in accs]
    existing = {(r.instance_id, r.model, r.interval_start): r for r in conn.execute(
        select(Rollup.__table__).where(Rollup.interval_s == interval_s,
                                       Rollup.interval_start >= min(starts),
                                       Rollup.interval_start <= max(starts)))}
    new_rows, merged = [], 0
    for (instance_id, model, idx), acc in accs.items():
        start = idx * interval_s
        values = _values(acc)
        old = existing.get((instance_id, model, start))
        if old is None:
            new_rows.append({"instance_id": instance_id, "model": model, "interval_start": start,
                             "interval_s": interval_s, **values})
            continue
        merged += 1
        conn.execute(update(Rollup).where(Rollup.id == old.id).values(_merge(old, values)))
    if new_rows:
        conn.execute(insert(Rollup), new_rows)
    return len(new_rows), merged


def _values(acc: Totals) -> dict:
    return {"requests": acc.requests, "requests_ok": acc.requests_ok,
            "requests_failed": acc.requests - acc.requests_ok, "batches": acc.batches,
            "batch_size_sum": acc.batch_size_sum, "real_elements": acc.real_elements,
            "padded_elements": acc.padded_elements, "queue_wait_sum_s": acc.queue_wait_sum_s,
            "compute_sum_s": acc.compute_sum_s, "latency_sum_s": acc.latency_sum_s,
            "latency_hist_json": json.dumps(acc.latency_hist, sort_keys=True),
            "batch_size_hist_json": json.dumps(acc.batch_size_hist, sort_keys=True),
            "outcomes_json": json.dumps(acc.outcomes, sort_keys=True)}


def _merge(old, values: dict) -> dict:
    merged = {}
    for name, value in values.items():
        if name.endswith("_json"):
            merged[name] = json.dumps(merge_hists(json.loads(getattr(old, name) or "{}"), json.loads(value)),
                                      sort_keys=True)
        else:
            merged[name] = (getattr(old, name) or 0) + value
    return merged


# ------------------------------------------------------------------ reading

@dataclass(frozen=True, slots=True)
class Interval:
    """The totals of one instance and model over ``[start_s, start_s + interval_s)``."""

    instance_id: str
    model: str
    start_s: float
    interval_s: float
    totals: Totals


def rolled_until(conn: Connection) -> float | None:
    """Where the raw rows begin: the end of the newest roll-up (older raw rows were
    rolled up and deleted); None when nothing was rolled up yet."""
    row = conn.execute(select(Rollup.interval_start, Rollup.interval_s)
                       .order_by(Rollup.interval_start.desc()).limit(1)).first()
    return None if row is None else row[0] + row[1]


def intervals(conn: Connection, *, start_s: float, end_s: float, model: str | None = None,
              instance_id: str | None = None, default_interval_s: float = 60.0) -> list[Interval]:
    """Per-interval totals over ``[start_s, end_s)``, oldest first: the stored roll-ups
    before :func:`rolled_until`, and the raw rows after it summarised the same way
    (in intervals as long as the roll-ups', ``default_interval_s`` when there are
    none). Intervals are whole: those overlapping the window's edges count entirely."""
    boundary = rolled_until(conn)
    out: list[Interval] = []
    interval_s = default_interval_s
    if boundary is not None and start_s < boundary:
        query = select(Rollup.__table__).where(Rollup.interval_start < min(end_s, boundary),
                                               Rollup.interval_start + Rollup.interval_s > start_s)
        if model is not None:
            query = query.where(Rollup.model == model)
        if instance_id is not None:
            query = query.where(Rollup.instance_id == instance_id)
        for r in conn.execute(query.order_by(Rollup.interval_start)):
            interval_s = r.interval_s
            out.append(Interval(r.instance_id, r.model, r.interval_start, r.interval_s, _read(r)))
    raw_start = start_s if boundary is None else max(start_s, boundary)
    if raw_start < end_s:
        accs = _from_summaries(conn, math.floor(raw_start / interval_s) * interval_s, end_s,
                               interval_s, model, instance_id)
        out += [Interval(inst, m, idx * interval_s, interval_s, acc)
                for (inst, m, idx), acc in sorted(accs.items(), key=lambda kv: kv[0][2])]
    return out


def rollup_key(bucket: int) -> str:
    """The roll-up histogram key holding the live summaries' latency ``bucket`` (every
    4th of their bounds is one of :data:`LATENCY_BOUNDS_S`)."""
    if bucket >= summaries.OVERFLOW_BUCKET:
        return "inf"
    return _LATENCY_KEYS[-(-bucket // 4)]


def _from_summaries(conn: Connection, start_s: float, end_s: float, interval_s: float,
                    model: str | None, instance_id: str | None) -> dict[tuple[str, str, int], Totals]:
    """The live summaries over ``[start_s, end_s)`` as per-interval roll-up totals."""
    accs: dict[tuple[str, str, int], Totals] = {}

    s0, s1 = math.floor(start_s), math.ceil(end_s)
    minutes = interval_s % summaries.MINUTE_S == 0

    def grouped(table, keys: tuple, *sums):
        """``table``'s rows in the window: per instance, model, interval and ``keys``."""
        k = func.floor(table.start_s / interval_s).label("k")
        where, params = summaries.span_where(table.__tablename__, s0, s1, minutes=minutes)
        query = select(table.instance_id, table.model, k, *keys, *map(func.sum, sums)).where(
            text(where).bindparams(**params))
        if model is not None:
            query = query.where(table.model == model)
        if instance_id is not None:
            query = query.where(table.instance_id == instance_id)
        return conn.execute(query.group_by(table.instance_id, table.model, k, *keys))

    sec = StatsSummary
    for inst, m, k, req, ok, wait, lat, bat, items, real, padded, compute in grouped(
            sec, (), sec.requests, sec.ok, sec.ok_queue_wait_sum_s, sec.ok_latency_sum_s, sec.batches,
            sec.batch_items, sec.real_elements, sec.padded_elements, sec.batch_compute_sum_s):
        acc = accs.setdefault((inst, m, int(k)), Totals())
        acc.requests, acc.requests_ok, acc.queue_wait_sum_s, acc.latency_sum_s = int(req), int(ok), wait, lat
        acc.batches, acc.batch_size_sum, acc.real_elements, acc.padded_elements = (
            int(bat), int(items), int(real), int(padded))
        acc.compute_sum_s = compute
    slot = LatencySummary
    for inst, m, k, outcome, bucket, n in grouped(slot, (slot.outcome, slot.bucket), slot.n):
        acc = accs.setdefault((inst, m, int(k)), Totals())
        acc.outcomes[outcome] = acc.outcomes.get(outcome, 0) + int(n)
        if outcome == "ok":
            key = rollup_key(int(bucket))
            acc.latency_hist[key] = acc.latency_hist.get(key, 0) + int(n)
    shape = ShapeSummary
    for inst, m, k, size, n in grouped(shape, (shape.batch_size,), shape.n):
        acc = accs.setdefault((inst, m, int(k)), Totals())
        acc.batch_size_hist[str(size)] = acc.batch_size_hist.get(str(size), 0) + int(n)
    return accs


def _read(row) -> Totals:
    """A stored roll-up row as ``Totals`` (histograms decoded)."""
    def hist(raw: str | None) -> dict:
        return {k: int(n) for k, n in json.loads(raw or "{}").items()}

    return Totals(requests=row.requests or 0, requests_ok=row.requests_ok or 0,
                  outcomes=hist(row.outcomes_json), queue_wait_sum_s=row.queue_wait_sum_s or 0.0,
                  latency_sum_s=row.latency_sum_s or 0.0, latency_hist=hist(row.latency_hist_json),
                  batches=row.batches or 0, batch_size_sum=row.batch_size_sum or 0,
                  real_elements=row.real_elements or 0, padded_elements=row.padded_elements or 0,
                  compute_sum_s=row.compute_sum_s or 0.0, batch_size_hist=hist(row.batch_size_hist_json))


# ------------------------------------------------------------------ policy

def enforce(engine: Engine, policy: RetentionPolicy, now: float) -> RollupStats:
    """Apply ``policy`` at wall time ``now``: roll up, then drop roll-ups past their age."""
    stats = roll_up(engine, older_than=now - policy.raw_max_age_s, interval_s=policy.interval_s)
    if policy.rollup_max_age_s is None:
        return stats
    with _write_transaction(engine) as conn:
        gone = conn.execute(delete(Rollup).where(
            Rollup.interval_start + Rollup.interval_s <= now - policy.rollup_max_age_s)).rowcount
    return replace(stats, rollups_deleted=gone)


def run_retention(engine: Engine, *, now: float, raw_keep_s: float, interval_s: float = 60.0) -> RollupStats:
    """What the runtime calls periodically: keep ``raw_keep_s`` of raw rows."""
    return enforce(engine, RetentionPolicy(raw_max_age_s=raw_keep_s, interval_s=interval_s), now)
