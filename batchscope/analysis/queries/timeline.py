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
``(instance_id, seq)``. A request that was traced (``request_traces``, Triton's trace
settings) also gets its trace's timestamps (``TRACED_COLUMNS``: when its bytes arrived,
the device's input and output copies, when its answer went out): ``with_traces`` pairs a
trace with the request row whose arrival is its queue start (the same monotonic reading
with the same wall-clock offset, so they agree to well under ``MATCH_S``). A generation
step's row is written when the step ends (``at``), so it ran from ``at - step_s``.

``assign_lanes`` packs intervals into the fewest rows where none overlap (the greedy
interval partitioning, in start order), for the chart's lanes and for trace tracks
(Perfetto drops complete slices that overlap on one track).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

import numpy as np
import pandas as pd
from sqlalchemy import Engine, inspect
from sqlalchemy.exc import SQLAlchemyError

from batchscope.analysis.queries.catalog import events
from batchscope.analysis.queries.window import Window, connection, filtered, read_frame

#: a batch or request longer than this is not looked for before the window starts (an
#: upper bound on the indexed time column keeps the reads on the index)
MAX_SPAN_S = 600.0
#: the most batches and requests a window may hold before it is refused (see module doc)
MAX_ROWS = 1_000_000
#: the slowest requests of a window a timeline lists
SLOWEST = 20

BATCH_COLUMNS = (
    "id", "instance_id", "model", "seq", "policy", "settings_version", "max_batch_size",
    "bucket", "batch_size", "real_elements", "padded_elements", "queue_wait_min_s",
    "queue_wait_mean_s", "queue_wait_max_s", "compute_s", "started_at", "ended_at", "outcome",
    "peak_memory_bytes", "peak_memory_increase_bytes", "cuda_graph", "queue_depth")
REQUEST_COLUMNS = (
    "id", "instance_id", "model", "batch_seq", "priority", "bypass", "length", "arrived_at",
    "finished_at", "queue_wait_s", "latency_s", "outcome", "ttft_s", "tpot_s",
    "prompt_tokens", "output_tokens", "timeout_ms")
TRACE_COLUMNS = (
    "instance_id", "model", "trace_id", "protocol", "request_id", "queue_start_at",
    "recv_start_at", "recv_end_at", "compute_input_end_at", "compute_output_start_at",
    "send_start_at", "send_end_at", "w3c_trace_id")
#: what a traced request's row gains from its trace (NaN or None where it was not traced);
#: ``client_request_id`` is the ``id`` the client sent (the trace's ``request_id``)
TRACED_COLUMNS = (
    "trace_id", "protocol", "client_request_id", "recv_start_at", "recv_end_at",
    "compute_input_end_at", "compute_output_start_at", "send_start_at", "send_end_at",
    "w3c_trace_id")
#: how far apart a request's arrival and its trace's queue start may be and still pair
MATCH_S = 1e-6
STEP_COLUMNS = ("id", "instance_id", "model", "at", "mode", "running", "waiting",
                "prefill_tokens", "decode_tokens", "blocks_used", "blocks_free", "preemptions",
                "step_s", "seq")


def _step_columns(conn: Any) -> tuple[str, ...]:
    """``STEP_COLUMNS`` that ``generation_steps`` has: a database not yet upgraded to
    schema version 12 (read where nothing is changed, as ``batchscope trace`` reads)
    has no ``seq``, and its steps none."""
    have = {c["name"] for c in inspect(conn).get_columns("generation_steps")}
    return tuple(c for c in STEP_COLUMNS if c in have)


class WindowTooLarge(ValueError):
    """The window holds more rows than may be read at once. ``span``: the first and last
    time of those rows (within the window), which the hint's length is worked out over:
    rows bunched in part of a long window get the length that part allows."""

    def __init__(self, rows: int, max_rows: int, window: Window,
                 span: tuple[float, float] | None = None, *, at_least: bool = False) -> None:
        self.rows = rows
        self.max_rows = max_rows
        first, last = span if span is not None else (window.start_s, window.end_s)
        first, last = max(first, window.start_s), min(last, window.end_s)
        if not last > first:
            first, last = window.start_s, window.end_s
        self.span = (first, last)
        # a tenth less than an even spread allows, two significant digits, rounded down
        self.fits_s = _round_down((last - first) * 0.9 * max_rows / max(rows, 1))
        where = "" if span is None else (
            f"; they lie within {_seconds(last - first)} s from "
            f"{datetime.fromtimestamp(first, timezone.utc):%Y-%m-%d %H:%M:%S} UTC")
        held = f"more than {max_rows:,}" if at_least else f"{rows:,}"
        super().__init__(
            f"the window holds {held} batches and requests, more than {max_rows:,} can be "
            f"read at once{where}; pick a window of at most {_seconds(self.fits_s)} s (or one model "
            "or instance)")


def _round_down(x: float) -> float:
    """``x`` rounded down to two significant digits (a hint does not name the length it
    was worked out from, which rows spread evenly would refuse again)."""
    if not x > 0:
        return 0.0
    step = 10.0 ** (math.floor(math.log10(x)) - 1)
    return math.floor(x / step) * step


def _seconds(x: float) -> str:
    """A length in seconds for a reader: ``135,000,000``, ``12``, ``0.34``."""
    return f"{x:,.0f}" if x >= 10 else f"{x:.2g}"


def _refusal(conn: Any, w: Window, rows: int, max_rows: int, *,
             requests: bool = True, at_least: bool = False) -> WindowTooLarge:
    """``WindowTooLarge`` with the span of the rows counted: the window's batches, and its
    requests when they were counted (``requests``); without a span when it cannot be
    read. ``at_least``: ``rows`` is a lower bound (a count cut short)."""
    parts = [("batches", "started_at", "ended_at")]
    if requests:
        parts.append(("requests", "arrived_at", "finished_at"))
    firsts: list[float] = []
    lasts: list[float] = []
    try:
        for table, start, end in parts:
            where, params = _overlapping(w, start, end)
            got = read_frame(conn, f"SELECT MIN({start}) AS a, MAX({end}) AS z FROM {table} "
                                   f"WHERE {where}", params)
            firsts += [float(v) for v in got["a"] if pd.notna(v)]
            lasts += [float(v) for v in got["z"] if pd.notna(v)]
    except SQLAlchemyError:  # a hint without the span, rather than a database error
        firsts = lasts = []
    span = (min(firsts), max(lasts)) if firsts and lasts else None
    return WindowTooLarge(rows, max_rows, w, span, at_least=at_least)


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
    #: how many requests overlap the window (``requests`` may hold only some of them)
    requests_in_window: int = 0
    #: how many of ``requests`` carry their trace's timestamps
    traced: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (len(self.batches) or self.requests_in_window or len(self.requests)
                    or len(self.steps))

    def members(self, instance_id: str, seq: int) -> pd.DataFrame:
        """The requests answered by batch ``seq`` of ``instance_id`` (of its model: a
        generation request's ``batch_seq`` numbers its model's steps, counted apart)."""
        r, b = self.requests, self.batches
        model = b.loc[(b["instance_id"] == instance_id) & (b["seq"] == seq), "model"]
        mask = (r["instance_id"] == instance_id) & (r["batch_seq"] == seq)
        if len(model):
            mask &= r["model"] == model.iloc[0]
        return r[mask]


def _overlapping(w: Window, start_col: str, end_col: str) -> tuple[str, dict]:
    """Rows whose [start, end] meets the window (end indexed; bounded by ``MAX_SPAN_S``)."""
    return filtered(w, [f"{end_col} >= :t0", f"{end_col} < :t1_late", f"{start_col} < :t1"],
                    {"t0": w.start_s, "t1": w.end_s, "t1_late": w.end_s + MAX_SPAN_S})


def count_rows(engine: Engine, w: Window, *, requests: bool = True) -> int:
    """How many batches (and requests, unless ``requests`` is False) overlap the window."""
    wb, pb = _overlapping(w, "started_at", "ended_at")
    wr, pr = _overlapping(w, "arrived_at", "finished_at")
    with connection(engine) as conn:
        n = int(read_frame(conn, f"SELECT COUNT(*) AS n FROM batches WHERE {wb}", pb)["n"].iloc[0])
        if requests:
            n += int(read_frame(conn, f"SELECT COUNT(*) AS n FROM requests WHERE {wr}",
                                pr)["n"].iloc[0])
    return n


def timeline_rows(engine: Engine, w: Window, max_rows: int = MAX_ROWS, *,
                  requests: str = "all", slowest: int = SLOWEST) -> TimelineRows:
    """The batches, requests, generation steps and events of ``w`` (see module doc);
    raises ``WindowTooLarge`` past ``max_rows`` rows read.

    ``requests``: ``"all"``, or ``"marks"`` for only those a timeline marks or lists —
    the ones not answered ``ok``, the bypassed, and the ``slowest`` slowest — which is
    what a page needs until a batch is picked (``with_members`` adds its requests)."""
    every = requests == "all"
    rows = count_rows(engine, w, requests=every)
    if rows > max_rows:
        with connection(engine) as conn:
            raise _refusal(conn, w, rows, max_rows, requests=every)
    wb, pb = _overlapping(w, "started_at", "ended_at")
    wr, pr = _overlapping(w, "arrived_at", "finished_at")
    ws, ps = _overlapping(w, "at - step_s", "at")
    cols = ", ".join(REQUEST_COLUMNS)
    with connection(engine) as conn:
        batches = read_frame(conn, f"SELECT {', '.join(BATCH_COLUMNS)} FROM batches "
                                   f"WHERE {wb} ORDER BY started_at, id", pb)
        if every:
            reqs = read_frame(conn, f"SELECT {cols} FROM requests WHERE {wr} "
                                    "ORDER BY arrived_at, id", pr)
        else:
            marks = read_frame(conn, f"SELECT {cols} FROM requests WHERE {wr} AND "
                                     f"(outcome <> 'ok' OR bypass = :yes) ORDER BY arrived_at, id "
                                     "LIMIT :lim", {**pr, "yes": True, "lim": max_rows - rows + 1})
            if rows + len(marks) > max_rows:
                # the marks were read up to the limit: the count is a lower bound, and
                # the span that of the batches
                raise _refusal(conn, w, rows + len(marks), max_rows, requests=False,
                               at_least=True)
            slow = read_frame(conn, f"SELECT {cols} FROM requests WHERE {wr} "
                                    "ORDER BY latency_s DESC LIMIT :n", {**pr, "n": slowest})
            reqs = _merged(marks, slow)
            in_window = int(read_frame(conn, f"SELECT COUNT(*) AS n FROM requests WHERE {wr}",
                                       pr)["n"].iloc[0])
        traces = None
        if every:
            wt, pt = _overlapping(w, "request_start_at", "request_end_at")
            traces = read_frame(conn, f"SELECT {', '.join(TRACE_COLUMNS)} FROM request_traces "
                                      f"WHERE {wt} LIMIT :lim",
                                {**pt, "lim": max_rows - rows + 1})
        steps = read_frame(conn, f"SELECT {', '.join(_step_columns(conn))} FROM "
                                 f"generation_steps WHERE {ws} ORDER BY at, id", ps)
        marks_ev = events(conn, w, limit=5_000)
        ids = sorted(set(batches["instance_id"]) | set(reqs["instance_id"].unique())
                     | set(steps["instance_id"]) | set(marks_ev["instance_id"].dropna()))
        instances = _instances(conn, ids)
    notes = []
    if traces is not None and rows + len(traces) > max_rows:
        notes.append(f"the window's traced requests are drawn without their trace timestamps: "
                     f"with them it would hold more than {max_rows:,} rows; pick a shorter "
                     "window to see them")
        traces = None
    requests_frame = with_traces(_requests(reqs), traces)
    out = TimelineRows(w, _batches(batches), requests_frame, _steps(steps), marks_ev, instances,
                       len(reqs) if every else in_window, notes=notes,
                       traced=int(requests_frame["trace_id"].notna().sum()))
    if out.empty and not out.requests_in_window:
        out.notes.append("no batch, request or generation step was recorded in this window")
    return out


def with_traces(requests: pd.DataFrame, traces: pd.DataFrame | None) -> pd.DataFrame:
    """``requests`` (oldest first) with ``TRACED_COLUMNS`` from the ``traces`` rows
    (``TRACE_COLUMNS``) of the same instance and model whose queue start is the request's
    arrival (within ``MATCH_S``); the columns are there, empty, for untraced requests."""
    req = requests.drop(columns=[c for c in TRACED_COLUMNS if c in requests.columns])
    if traces is None or not len(traces) or not len(req):
        return _typed(req, TRACED_COLUMNS)
    t = traces.dropna(subset=["queue_start_at"]).rename(columns={"request_id":
                                                                 "client_request_id"})
    if not len(t):
        return _typed(req, TRACED_COLUMNS)
    t = t.astype({"queue_start_at": float}).sort_values("queue_start_at", kind="stable")
    req = req.sort_values(["arrived_at", "id"], kind="stable").reset_index(drop=True)
    keep = ["instance_id", "model", "queue_start_at", *TRACED_COLUMNS]
    out = pd.merge_asof(req.astype({"arrived_at": float}), t[keep], left_on="arrived_at",
                        right_on="queue_start_at", by=["instance_id", "model"],
                        tolerance=MATCH_S, direction="nearest")
    return out.drop(columns=["queue_start_at"])


def with_members(engine: Engine, rows: TimelineRows, key: tuple[str, int]) -> TimelineRows:
    """``rows`` with every request of the picked batch (``key``: instance, seq), or for a
    generation step (seq ``-id``) every sequence alive during it, added: new rows, the
    ones given left as they were."""
    inst, seq = key
    if seq >= 0:
        b = rows.batches[(rows.batches["instance_id"] == inst) & (rows.batches["seq"] == seq)]
        if not len(b):
            return rows
        # a batch's requests finish when it ends (answers follow the batch): the indexed
        # finished_at narrows the search to that moment
        sql = ("instance_id = :inst AND model = :model AND batch_seq = :seq AND "
               "finished_at >= :t0 AND finished_at < :t1")
        params = {"inst": inst, "model": b["model"].iloc[0], "seq": seq,
                  "t0": float(b["started_at"].iloc[0]), "t1": float(b["ended_at"].iloc[0]) + 60}
    else:
        s = rows.steps[(rows.steps["instance_id"] == inst) & (rows.steps["id"] == -seq)]
        if not len(s):
            return rows
        sql = ("instance_id = :inst AND model = :model AND finished_at >= :t0 AND "
               "finished_at < :late AND arrived_at <= :t1")
        t0, t1 = float(s["started_at"].iloc[0]), float(s["at"].iloc[0])
        params = {"inst": inst, "model": s["model"].iloc[0], "t0": t0, "t1": t1,
                  "late": t1 + MAX_SPAN_S}
    found = read_frame(engine, f"SELECT {', '.join(REQUEST_COLUMNS)} FROM requests WHERE {sql} "
                               "ORDER BY arrived_at, id", params)
    # the traces of the requests found: those of the batch, or those that ended with the
    # step's sequences (request_end_at is indexed, and is their finished_at or later)
    tsql = sql.replace("finished_at", "request_end_at").replace("arrived_at",
                                                                 "request_start_at")
    traces = read_frame(engine, f"SELECT {', '.join(TRACE_COLUMNS)} FROM request_traces "
                                f"WHERE {tsql}", params)
    before = rows.requests.drop(columns=["started_at", *TRACED_COLUMNS], errors="ignore")
    requests = with_traces(_requests(_merged(before, found)), traces)
    return replace(rows, requests=requests, traced=int(requests["trace_id"].notna().sum()))


def find_batch(engine: Engine, seq: int, *, model: str | None = None,
               instance_id: str | None = None) -> dict | None:
    """Batch ``seq`` (of ``model`` / ``instance_id`` when given; the newest when several
    instances have one): its instance, model, start and end, or None."""
    where, params = filtered(Window(0.0, 0.0, model, instance_id), ["seq = :seq"],
                             {"seq": int(seq)})
    found = read_frame(engine, f"SELECT instance_id, model, started_at, ended_at FROM batches "
                               f"WHERE {where} ORDER BY ended_at DESC LIMIT 1", params)
    return None if not len(found) else found.iloc[0].to_dict()


def find_step(engine: Engine, seq: int, *, model: str | None = None,
              instance_id: str | None = None) -> dict | None:
    """Engine step ``seq`` of a generation model (of ``model`` / ``instance_id`` when
    given; the newest when several have one): its row ``id`` (the chart's key is
    ``-id``), instance, model, start and end (``started_at``, ``ended_at``), or None. A
    step's number counts its model's steps, apart from the batches' numbers; a database
    whose steps have no number (before schema version 12) has none to find."""
    where, params = filtered(Window(0.0, 0.0, model, instance_id), ["seq = :seq"],
                             {"seq": int(seq)})
    with connection(engine) as conn:
        if "seq" not in _step_columns(conn):
            return None
        found = read_frame(conn, "SELECT id, instance_id, model, at - step_s AS started_at, "
                                 f"at AS ended_at FROM generation_steps WHERE {where} "
                                 "ORDER BY at DESC LIMIT 1", params)
    return None if not len(found) else found.iloc[0].to_dict()


def _merged(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    if not len(b):
        return a
    if not len(a):
        return b
    return pd.concat([a, b]).drop_duplicates("id").sort_values(["arrived_at", "id"])


def _batches(df: pd.DataFrame) -> pd.DataFrame:
    df = _typed(df, BATCH_COLUMNS)
    if len(df):
        df["cuda_graph"] = df["cuda_graph"].astype(bool)
    return df


def _requests(df: pd.DataFrame) -> pd.DataFrame:
    df = _typed(df, REQUEST_COLUMNS).reset_index(drop=True)
    if len(df):
        df["bypass"] = df["bypass"].astype(bool)
        df["started_at"] = df["arrived_at"] + df["queue_wait_s"]
    else:
        df["started_at"] = pd.Series(dtype=float)
    return df


def _steps(df: pd.DataFrame) -> pd.DataFrame:
    df = _typed(df, STEP_COLUMNS)
    df["started_at"] = df["at"] - df["step_s"] if len(df) else pd.Series(dtype=float)
    return df


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
