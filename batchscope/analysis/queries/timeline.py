"""Every batch, request, step and event of one window: what the batch timeline draws and
what a trace export writes.

``timeline_rows(engine, window)`` reads the raw rows that overlap the window (a batch
that started before it and ended in it is there; so is a request that arrived before
it), after counting them: a window holding more than ``max_rows`` batches and requests
is refused with ``WindowTooLarge``, which says how many rows it holds and how long a
window would fit, instead of reading them all into memory.

Times are the recorded wall-clock seconds, as in the database. A request's queue wait
ends when its batch starts (``arrived_at + queue_wait_s``), so its two segments (queue,
then compute) need no join; its batch is ``(instance_id, batch_seq)`` →
``(instance_id, seq)``. A generation step's row is written when the step ends
(``at``), so it ran from ``at - step_s``.

``assign_lanes`` packs intervals into the fewest rows where none overlap (the greedy
interval partitioning, in start order), for the chart's lanes and for trace tracks
(Perfetto drops complete slices that overlap on one track).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
from sqlalchemy import Engine

from batchscope.analysis.queries.catalog import events
from batchscope.analysis.queries.window import Window, connection, filtered, read_frame

#: a batch or request longer than this is not looked for before the window starts (an
#: upper bound on the indexed time column keeps the reads on the index)
MAX_SPAN_S = 600.0
#: the most batches and requests a window may hold before it is refused (see module doc)
MAX_ROWS = 1_000_000

BATCH_COLUMNS = (
    "id", "instance_id", "model", "seq", "policy", "settings_version", "max_batch_size",
    "bucket", "batch_size", "real_elements", "padded_elements", "queue_wait_min_s",
    "queue_wait_mean_s", "queue_wait_max_s", "compute_s", "started_at", "ended_at", "outcome",
    "peak_memory_bytes", "cuda_graph", "queue_depth")
REQUEST_COLUMNS = (
    "id", "instance_id", "model", "batch_seq", "priority", "bypass", "length", "arrived_at",
    "finished_at", "queue_wait_s", "latency_s", "outcome", "ttft_s", "tpot_s",
    "prompt_tokens", "output_tokens", "timeout_ms")
STEP_COLUMNS = ("id", "instance_id", "model", "at", "mode", "running", "waiting",
                "prefill_tokens", "decode_tokens", "blocks_used", "blocks_free", "preemptions",
                "step_s")


class WindowTooLarge(ValueError):
    """The window holds more rows than may be read at once."""

    def __init__(self, rows: int, max_rows: int, window: Window) -> None:
        self.rows = rows
        self.max_rows = max_rows
        fits_s = window.duration_s * max_rows / max(rows, 1)
        super().__init__(
            f"the window holds {rows:,} batches and requests, more than {max_rows:,} can be "
            f"read at once; pick a window of at most {fits_s:,.1f} s (or one model or "
            "instance)")


@dataclass
class TimelineRows:
    """The raw rows of one window, oldest first, with the instances they came from."""

    window: Window
    batches: pd.DataFrame
    requests: pd.DataFrame
    steps: pd.DataFrame
    events: pd.DataFrame
    #: id, host, pid, device, version of every instance with a row here
    instances: pd.DataFrame
    notes: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (len(self.batches) or len(self.requests) or len(self.steps))

    def members(self, instance_id: str, seq: int) -> pd.DataFrame:
        """The requests answered by batch ``seq`` of ``instance_id``."""
        r = self.requests
        return r[(r["instance_id"] == instance_id) & (r["batch_seq"] == seq)]


def _overlapping(w: Window, start_col: str, end_col: str) -> tuple[str, dict]:
    """Rows whose [start, end] meets the window (end indexed; bounded by ``MAX_SPAN_S``)."""
    return filtered(w, [f"{end_col} >= :t0", f"{end_col} < :t1_late", f"{start_col} < :t1"],
                    {"t0": w.start_s, "t1": w.end_s, "t1_late": w.end_s + MAX_SPAN_S})


def count_rows(engine: Engine, w: Window) -> int:
    """How many batches and requests overlap the window."""
    wb, pb = _overlapping(w, "started_at", "ended_at")
    wr, pr = _overlapping(w, "arrived_at", "finished_at")
    with connection(engine) as conn:
        b = read_frame(conn, f"SELECT COUNT(*) AS n FROM batches WHERE {wb}", pb)
        r = read_frame(conn, f"SELECT COUNT(*) AS n FROM requests WHERE {wr}", pr)
    return int(b["n"].iloc[0]) + int(r["n"].iloc[0])


def timeline_rows(engine: Engine, w: Window, max_rows: int = MAX_ROWS) -> TimelineRows:
    """The batches, requests, generation steps and events of ``w`` (see module doc);
    raises ``WindowTooLarge`` past ``max_rows`` batches and requests."""
    rows = count_rows(engine, w)
    if rows > max_rows:
        raise WindowTooLarge(rows, max_rows, w)
    wb, pb = _overlapping(w, "started_at", "ended_at")
    wr, pr = _overlapping(w, "arrived_at", "finished_at")
    ws, ps = _overlapping(w, "at - step_s", "at")
    with connection(engine) as conn:
        batches = read_frame(conn, f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches "
                                   f"WHERE {wb} ORDER BY started_at, id", pb)
        requests = read_frame(conn, f"SELECT {', '.join(REQUEST_COLUMNS)} FROM requests "
                                    f"WHERE {wr} ORDER BY arrived_at, id", pr)
        steps = read_frame(conn, f"SELECT {', '.join(STEP_COLUMNS)} FROM generation_steps "
                                 f"WHERE {ws} ORDER BY at, id", ps)
        marks = events(conn, w, limit=5_000)
        ids = sorted(set(batches["instance_id"]) | set(requests["instance_id"])
                     | set(steps["instance_id"]) | set(marks["instance_id"].dropna()))
        instances = _instances(conn, ids)
    batches = _typed(batches, BATCH_COLUMNS)
    requests = _typed(requests, REQUEST_COLUMNS)
    steps = _typed(steps, STEP_COLUMNS)
    if len(batches):
        batches["cuda_graph"] = batches["cuda_graph"].astype(bool)
    if len(requests):
        requests["bypass"] = requests["bypass"].astype(bool)
        requests["started_at"] = requests["arrived_at"] + requests["queue_wait_s"]
    else:
        requests["started_at"] = pd.Series(dtype=float)
    if len(steps):
        steps["started_at"] = steps["at"] - steps["step_s"]
    else:
        steps["started_at"] = pd.Series(dtype=float)
    out = TimelineRows(w, batches, requests, steps, marks, instances)
    if out.empty:
        out.notes.append("no batch, request or generation step was recorded in this window")
    return out


def _typed(df: pd.DataFrame, columns: tuple[str, ...]) -> pd.DataFrame:
    """``df`` with every column present even when no row came back."""
    for col in columns:
        if col not in df.columns:
            df[col] = pd.Series(dtype=float)
    return df


def _instances(conn, ids: list[str]) -> pd.DataFrame:
    cols = "id, host, pid, device, version, url"
    if not ids:
        return pd.DataFrame(columns=cols.split(", "))
    names = ", ".join(f":i{k}" for k in range(len(ids)))
    return read_frame(conn, f"SELECT {cols} FROM runtime_instances WHERE id IN ({names}) "
                            "ORDER BY id", {f"i{k}": v for k, v in enumerate(ids)})


def assign_lanes(starts, ends) -> np.ndarray:
    """For intervals ``[starts[i], ends[i])``, the index of the row each goes in so that
    no two in one row overlap, with as few rows as possible (greedy in start order)."""
    starts = np.asarray(starts, dtype=float)
    ends = np.maximum(np.asarray(ends, dtype=float), starts)
    lanes = np.zeros(len(starts), dtype=np.int64)
    free: list[tuple[float, int]] = []  # (the time a row is free from, row)
    spare: list[int] = []  # rows free now, lowest first
    rows = 0
    for i in np.argsort(starts, kind="stable"):
        s = starts[i]
        while free and free[0][0] <= s:
            heapq.heappush(spare, heapq.heappop(free)[1])
        if spare:
            lane = heapq.heappop(spare)
        else:
            lane = rows
            rows += 1
        lanes[i] = lane
        heapq.heappush(free, (ends[i], lane))
    return lanes
