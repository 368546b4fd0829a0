"""The window every dashboard query reads, and the SQL the queries share.

A query is ``(engine, window) -> pandas.DataFrame``. The SQL is the same on SQLite and
PostgreSQL: time buckets are ``FLOOR(t / :bucket)``, counts are ``SUM(CASE ...)``
(``count_if``), every subquery has an alias, every selected column is grouped by or
aggregated, and the numbers PostgreSQL returns as ``numeric`` (sums and means of
integers) come back as floats (``read_frame``). Percentiles are exact nearest-rank values
picked with window functions (``ROW_NUMBER() OVER (ORDER BY x)``; rank ``ceil(p * n / 100)``):
``ranked`` numbers the rows, ``pct_select`` picks the ranks.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from decimal import Decimal
from typing import ContextManager

import pandas as pd
from sqlalchemy import Connection, Engine, text

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


def in_window(w: Window, time_col: str, *, model: bool = True,
              bounds: tuple[str, str] = ("t0", "t1")) -> tuple[str, dict]:
    """The condition (and its parameters) for rows of ``w``: ``time_col`` in its range
    (parameters named ``bounds``), of its model (unless ``model`` is False) and instance."""
    lo, hi = bounds
    return filtered(w, [f"{time_col} >= :{lo}", f"{time_col} < :{hi}"],
                    {lo: w.start_s, hi: w.end_s}, model=model)


def filtered(w: Window, parts: list[str], params: dict, *, model: bool = True
             ) -> tuple[str, dict]:
    """``parts`` and ``params`` with the window's model (unless ``model`` is False) and
    instance added, as one condition."""
    if model and w.model is not None:
        parts.append("model = :model")
        params["model"] = w.model
    if w.instance_id is not None:
        parts.append("instance_id = :inst")
        params["inst"] = w.instance_id
    return " AND ".join(parts), params


def connection(db: Engine | Connection) -> ContextManager[Connection]:
    """A connection of ``db``: a new one of an engine (closed after), or ``db`` itself
    (several reads in one snapshot, see ``exact.snapshot``)."""
    return contextlib.nullcontext(db) if isinstance(db, Connection) else db.connect()


def read_frame(db: Engine | Connection, sql: str, params: dict) -> pd.DataFrame:
    with connection(db) as conn:
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


def count_if(condition: str) -> str:
    """How many rows match ``condition`` (``SUM(condition)`` is SQLite only)."""
    return f"SUM(CASE WHEN {condition} THEN 1 ELSE 0 END)"


def bucket_index(col: str) -> str:
    """The index of the ``:bucket``-second interval ``col`` falls in (a whole number;
    a plain ``CAST`` rounds on PostgreSQL instead of truncating)."""
    return f"CAST(FLOOR({col} / :bucket) AS BIGINT)"


def pct_select(col: str, prefix: str) -> str:
    """``MAX(CASE WHEN rn = ceil(p*n/100) ...)`` columns for each percentile."""
    return ", ".join(f"MAX(CASE WHEN rn_{col} = ({p} * n_{col} + 99) / 100 THEN {col} END)"
                     f" AS {prefix}_p{p}" for p in PCTS)


def ranked(col: str, partition: str = "") -> str:
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
