"""The tracks and slices of a window's trace, shared by both trace writers.

``build(rows)`` turns ``TimelineRows`` (``analysis.queries.timeline``) into a ``Layout``
that says nothing of any file format:

* a ``Process`` per runtime instance (named by host, pid and device; its ``pid`` in the
  trace is a small number of the trace's own, since two hosts may reuse a pid);
* under it, per model, ``Track``\\ s: the batches (``mlp · batches``, plus ``mlp ·
  batches · lane 2`` ... while batches of the model overlap in time: a viewer drops
  complete slices that overlap on one track, so ``assign_lanes`` spreads them), the
  generation engine's steps (``mlp · steps``, laned the same way) and a pool of request
  tracks (``mlp · requests 1`` ...): requests overlap all the time, so each goes on a
  track picked by ``assign_lanes`` and nests properly there;
* ``Slice``\\ s on them: a batch ``batch <seq> n=<size>/<max>`` with its figures as args;
  a request from arrival to answer with two children, ``queue`` (arrival to the start
  of its batch) and ``compute`` (to the answer); a request that never reached a batch
  (refused, expired) is one slice, or an instant when it took no time, named by its
  outcome; a traced request (Triton's trace settings) also spans its ``receive`` (its
  bytes arriving, before the queue) and ``send`` (its answer going out, after compute),
  and its ``compute`` holds ``input``, ``infer`` and ``output`` (Triton's
  COMPUTE_INPUT_END and COMPUTE_OUTPUT_START), with its trace id in the args; a step
  with its engine figures; an event (settings change, autopilot, OOM, error ...) an
  instant on its process's own track;
* flows: one arrow from each request's ``queue`` slice to the batch it joined (the
  batch slice ends the flows of all its requests).

Times are the recorded wall-clock seconds as integer nanoseconds, ``round(t * 1e9)``,
so a slice lines up with its database row. A row whose times contradict each other (a
queue wait longer than the latency, an end before the start) is clamped into a valid
slice rather than breaking the trace's nesting.

``Layout.events()`` walks the whole trace once, in time order, as ``(ts_ns, phase,
slice)`` with phase ``B`` (begin), ``E`` (end) or ``I`` (instant). On each track the
begins and ends come nested (a parent begins before and ends after its children; a
slice ending at the instant the next one begins ends first); across tracks, at one
timestamp, request tracks come before batch tracks, so a flow's start is always seen
before its end. Slices are made as the walk reaches them (the frames' columns are read
as plain lists once), so a writer holds one slice at a time, not the trace.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Iterator

import numpy as np
import pandas as pd

from batchscope.analysis.queries.timeline import TimelineRows, assign_lanes
from batchscope.analysis.queries.window import Window

#: phases of ``Layout.events``
BEGIN, END, INSTANT = "B", "E", "I"
#: order of the track kinds' events at one timestamp (a flow starts on a request track
#: and ends on a batch track: its start must come first)
KIND_ORDER = {"requests": 0, "batches": 1, "steps": 2, "events": 3, "notes": 4}
#: outcomes of requests that never reached a batch or a step
UNSERVED = ("rejected", "expired")
NO_DATA = "no data"
#: the most events ``timeline_rows`` reads of a window (its newest)
EVENTS_READ = 5_000


@dataclass(frozen=True)
class Process:
    """One runtime instance: a process of the trace."""

    uuid: int
    #: the trace's own process number (1, 2, ...); the real pid is in ``name``
    pid: int
    name: str
    instance_id: str
    #: the track its events (instants) go on: the process itself
    events_track: "Track"


@dataclass(frozen=True)
class Track:
    """One row of the trace: a thread in Chrome's JSON, a child track in Perfetto."""

    uuid: int
    #: the process it belongs to (0: a global track, the export's notes)
    pid: int
    #: a thread id unique in the whole trace (Chrome's JSON wants one per row)
    tid: int
    name: str
    #: requests | batches | steps | events | notes
    kind: str
    #: its place among its process's tracks
    rank: int
    parent_uuid: int | None = None


@dataclass
class Slice:
    """A span of time on a track, or an instant (``end_ns == start_ns``, ``instant``)."""

    track: Track
    start_ns: int
    end_ns: int
    name: str
    #: batch | request | queue | compute | step | event | note
    category: str
    args: dict
    instant: bool = False
    #: the flow that starts here (0: none)
    flow_out: int = 0
    #: the flows that end here
    flows_in: tuple[int, ...] = ()
    children: tuple["Slice", ...] = ()


@dataclass
class Counts:
    """What a layout holds (the export summary's figures)."""

    processes: int = 0
    tracks: int = 0
    batch_slices: int = 0
    #: requests drawn as slices or instants (each batched one also has queue and compute)
    request_slices: int = 0
    flows: int = 0
    step_slices: int = 0
    events: int = 0


@dataclass
class Layout:
    """The processes, tracks and (lazily made) slices of one window."""

    window: Window
    processes: list[Process]
    tracks: list[Track]
    counts: Counts
    notes: list[str] = field(default_factory=list)
    #: where the trace's instants of notes go (at the window's start)
    notes_track: Track | None = None
    #: (track, a function giving the walk of its slices) per track, in ``tracks`` order
    _sources: list = field(default_factory=list, repr=False)

    @property
    def empty(self) -> bool:
        return not self.processes

    def events(self) -> Iterator[tuple[int, str, Slice]]:
        """Every begin, end and instant of the trace in time order (see module doc)."""
        streams = [_keyed(make(), KIND_ORDER[track.kind]) for track, make in self._sources]
        for ts, _, phase, item in heapq.merge(*streams, key=itemgetter(0, 1)):
            yield ts, phase, item


def _keyed(events: Iterator[tuple[int, str, Slice]], order: int):
    """``events`` as ``(ts, order, phase, slice)``, merged on ``(ts, order)`` (ties are
    broken by ``heapq.merge`` in stream order, which keeps each track's own order)."""
    return ((ts, order, phase, item) for ts, phase, item in events)


def _walk(item: Slice) -> Iterator[tuple[int, str, Slice]]:
    """A slice's begin, its children's, their ends and its end, nested."""
    if item.instant:
        yield item.start_ns, INSTANT, item
        return
    yield item.start_ns, BEGIN, item
    for child in item.children:
        yield from _walk(child)
    yield item.end_ns, END, item


#: the latest nanosecond a trace holds (64-bit integers; timespec.LATEST_S is well before)
_MAX_NS = 9.2e18


def ns(values) -> np.ndarray:
    """Wall-clock seconds as integer nanoseconds, ``round(t * 1e9)``; -1 for what is no
    time a trace can hold: NaN (a NULL), an infinity, a time before 1970 (a trace's
    timestamps are unsigned) or past 64-bit nanoseconds."""
    with np.errstate(over="ignore", invalid="ignore"):  # 1e300 s: no time, not a warning
        x = np.asarray(values, dtype=float) * 1e9
        good = np.isfinite(x) & (x >= 0) & (x < _MAX_NS)
    return np.where(good, np.rint(np.where(good, x, 0.0)), -1).astype(np.int64)


def _lanes(start_ns: np.ndarray, end_ns: np.ndarray) -> np.ndarray:
    """``assign_lanes`` on integer nanoseconds (made relative first: floats hold
    nanoseconds exactly only up to 2**53, about 104 days)."""
    if not len(start_ns):
        return np.zeros(0, dtype=np.int64)
    base = int(start_ns.min())
    return assign_lanes(start_ns - base, end_ns - base)


def _clean(value):
    """A value as an arg: plain Python, or None when missing."""
    if value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, np.generic):
        return _clean(value.item())
    return value


def _whole(value) -> int | None:
    """A whole-number column's value as an int; None when missing or no number (an
    infinity, or text, which SQLite keeps in any column)."""
    value = _clean(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if isinstance(value, float):
        if not -2.0**63 <= value < 2.0**63:
            return None
        return int(value)
    return value


def _args(pairs) -> dict:
    return {k: v for k, v in ((k, _clean(v)) for k, v in pairs) if v is not None}


def _ms(seconds) -> float | None:
    seconds = _clean(seconds)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return None  # missing, or no number
    return round(seconds * 1000.0, 6)


#: columns that hold whole numbers (read as floats when a value is missing)
INTEGERS = {"id", "seq", "settings_version", "max_batch_size", "bucket", "batch_size",
            "real_elements", "padded_elements", "peak_memory_bytes",
            "peak_memory_increase_bytes", "queue_depth",
            "batch_seq", "priority", "length", "prompt_tokens", "output_tokens", "running",
            "waiting", "prefill_tokens", "decode_tokens", "blocks_used", "blocks_free",
            "preemptions", "trace_id"}


def _columns(df: pd.DataFrame, names) -> dict[str, list]:
    """The columns as plain lists (fast to index one row at a time): None for a missing
    value, whole-number columns as ints."""
    out = {}
    for name in names:
        col = df[name] if name in df.columns else pd.Series([None] * len(df), index=df.index,
                                                            dtype=object)
        values = [None if (isinstance(v, float) and math.isnan(v)) else v
                  for v in col.astype(object).tolist()]
        if name in INTEGERS:
            values = [None if v is None else _whole(v) for v in values]
        out[name] = values
    return out


def _process_name(row: dict | None, instance_id: str) -> str:
    if row is None:
        return instance_id
    parts = [str(row.get("host") or "?")]
    if _whole(row.get("pid")) is not None:
        parts.append(f"pid {_whole(row['pid'])}")
    if row.get("device"):
        parts.append(str(row["device"]))
    return f"{' · '.join(parts)} ({instance_id})"


class _Builder:
    """Numbers tracks and processes as ``build`` adds them."""

    def __init__(self) -> None:
        self.next_uuid = 0
        self.next_tid = 0
        self.tracks: list[Track] = []
        #: (track, a function giving its walk)
        self.sources: list = []

    def uuid(self) -> int:
        self.next_uuid += 1
        return self.next_uuid

    def tid(self) -> int:
        self.next_tid += 1
        return self.next_tid

    def add(self, track: Track, source) -> Track:
        """Add ``track``, whose slices ``source(track)`` walks."""
        self.tracks.append(track)
        self.sources.append((track, lambda: source(track)))
        return track

    def lanes(self, process: Process, rank: int, idx: np.ndarray, start: np.ndarray,
              end: np.ndarray, label, kind: str, source) -> tuple[int, int]:
        """Tracks for the rows ``idx`` (``start``/``end`` in nanoseconds), as few as
        will hold them without overlap: track ``k`` is named ``label(k)`` and walks
        ``source(its rows)(track)``. The next rank, and how many rows went in."""
        lanes = _lanes(start[idx], end[idx])
        for lane in range(int(lanes.max()) + 1 if len(lanes) else 0):
            mine = _ordered(idx[lanes == lane], start, end)
            self.add(Track(uuid=self.uuid(), pid=process.pid, tid=self.tid(), name=label(lane),
                           kind=kind, rank=rank, parent_uuid=process.uuid), source(mine))
            rank += 1
        return rank, len(idx)


def build(rows: TimelineRows) -> Layout:
    """The layout of ``rows`` (see module doc); an empty window gives a layout with no
    process and one note saying so."""
    b = _Builder()
    counts = Counts()
    notes = list(rows.notes)
    batches, requests, steps, marks = rows.batches, rows.requests, rows.steps, rows.events
    registered = {str(r["id"]): r for r in rows.instances.to_dict("records")}
    ids = sorted(set(map(str, batches["instance_id"])) | set(map(str, requests["instance_id"]))
                 | set(map(str, steps["instance_id"]))
                 | set(map(str, marks["instance_id"].dropna())))

    bcols = _columns(batches, ("id", "instance_id", "model", "seq", "policy", "settings_version",
                               "max_batch_size", "bucket", "batch_size", "real_elements",
                               "padded_elements", "queue_wait_mean_s", "queue_wait_max_s",
                               "compute_s", "outcome", "peak_memory_bytes",
                               "peak_memory_increase_bytes", "cuda_graph", "queue_depth"))
    floor = int(ns([rows.window.start_s])[0])
    untimed = Counter()
    b_start, b_end = _span(ns(batches["started_at"]), ns(batches["ended_at"]), floor,
                           untimed, "batch")
    rcols = _columns(requests, ("id", "instance_id", "model", "batch_seq", "priority", "bypass",
                                "length", "queue_wait_s", "latency_s", "outcome", "ttft_s",
                                "tpot_s", "prompt_tokens", "output_tokens", "timeout_ms",
                                "trace_id", "protocol", "client_request_id", "w3c_trace_id"))
    r_arr, r_fin = _span(ns(requests["arrived_at"]), ns(requests["finished_at"]), floor,
                         untimed, "request")
    r_sta = ns(requests["started_at"])
    # a request has a queue and a compute part when it started (and was not refused)
    segmented = (r_sta >= 0) & ~requests["outcome"].isin(UNSERVED).to_numpy(dtype=bool)
    r_sta = np.clip(r_sta, r_arr, r_fin)
    stamps = _trace_stamps(requests, r_arr, r_sta, r_fin)
    scols = _columns(steps, ("id", "instance_id", "model", "seq", "mode", "running", "waiting",
                             "prefill_tokens", "decode_tokens", "blocks_used", "blocks_free",
                             "preemptions", "step_s"))
    s_start, s_end = _span(ns(steps["started_at"]), ns(steps["at"]), floor, untimed, "step")
    flow_of, flows_in, step_flows_in = _link(bcols, b_start, scols, s_start, rcols, r_arr,
                                             segmented, counts, notes)
    if len(marks) >= EVENTS_READ:
        notes.append(f"only the window's newest {EVENTS_READ:,} events are shown")
    ecols = _columns(marks, ("instance_id", "model", "kind", "severity", "message", "details_json"))
    e_at = ns(marks["at"])
    if untimed:
        told = " and ".join(f"{n:,} {kind}(s)" for kind, n in untimed.items())
        notes.append(f"{told} have a time that is no time (infinite, or before 1970): "
                     "drawn with no length, at the time they have")

    processes = []
    for pid, inst in enumerate(ids, start=1):
        uuid = b.uuid()
        # the process's own track: its events go there
        events_track = Track(uuid=uuid, pid=pid, tid=b.tid(), name="events", kind="events",
                             rank=0)
        process = Process(uuid=uuid, pid=pid, name=_process_name(registered.get(inst), inst),
                          instance_id=inst, events_track=events_track)
        processes.append(process)
        rank = 1
        for model in sorted(set().union(*(map(str, df.loc[df["instance_id"] == inst, "model"])
                                          for df in (batches, requests, steps)))):
            rank, n = b.lanes(process, rank, _of(batches, inst, model), b_start, b_end,
                              lambda lane: f"{model} · batches" + (f" · lane {lane + 1}"
                                                                   if lane else ""),
                              "batches", lambda idx: _batch_source(idx, bcols, b_start, b_end,
                                                                   flows_in))
            counts.batch_slices += n
            rank, n = b.lanes(process, rank, _of(steps, inst, model), s_start, s_end,
                              lambda lane: f"{model} · steps" + (f" · lane {lane + 1}"
                                                                 if lane else ""),
                              "steps", lambda idx: _step_source(idx, scols, s_start, s_end,
                                                                 step_flows_in))
            counts.step_slices += n
            rank, n = b.lanes(process, rank, _of(requests, inst, model), stamps["lo"],
                              stamps["hi"], lambda lane: f"{model} · requests {lane + 1}",
                              "requests",
                              lambda idx: _request_source(idx, rcols, r_arr, r_sta, r_fin,
                                                          segmented, flow_of, stamps))
            counts.request_slices += n
        idx = np.flatnonzero(marks["instance_id"].astype(str).to_numpy() == inst)
        if len(idx):
            b.add(events_track, _event_source(idx[np.argsort(e_at[idx], kind="stable")], ecols,
                                              e_at))
            counts.events += len(idx)

    notes_track = None
    if not processes:  # nothing to draw: the notes say why (the first, that it is empty)
        notes = [f"{NO_DATA}: " + (rows.notes[0] if rows.notes
                                   else "nothing was recorded in this window"),
                 *rows.notes[1:]]
    if notes:
        notes_track = b.add(Track(uuid=b.uuid(), pid=0, tid=b.tid(), name="BatchScope export",
                                  kind="notes", rank=0), _note_source(notes, rows.window))
    counts.processes = len(processes)
    counts.tracks = len(b.tracks)
    return Layout(window=rows.window, processes=processes, tracks=b.tracks, counts=counts,
                  notes=notes, notes_track=notes_track, _sources=b.sources)


def _step_name(prefill_tokens, decode_tokens) -> str:
    """A step's slice name: what it computed (``prefill``, ``decode`` or both)."""
    if not prefill_tokens:
        return "decode"
    return "prefill+decode" if decode_tokens else "prefill"


def _span(start: np.ndarray, end: np.ndarray, floor: int, untimed: Counter,
          kind: str) -> tuple[np.ndarray, np.ndarray]:
    """Rows' start and end in nanoseconds as slices can take them (a trace's times are
    unsigned): a time that is none (-1 from ``ns``: a start recorded as -inf or before
    1970) is the row's other one, so the row is drawn with no length at the time it has
    (at ``floor``, the window's start, should it have neither: the window's query reads
    none such); the end is never before the start. Counts the rows whose time was made
    up in ``untimed[kind]``."""
    bad = (start < 0) | (end < 0)
    if bad.any():
        untimed[kind] += int(bad.sum())
        start, end = np.where(start < 0, end, start), np.where(end < 0, start, end)
        start, end = np.where(start < 0, floor, start), np.where(end < 0, floor, end)
    return start, np.maximum(end, start)


def _of(df: pd.DataFrame, instance_id: str, model: str) -> np.ndarray:
    """The positions of ``df``'s rows of one instance and model."""
    return np.flatnonzero((df["instance_id"] == instance_id).to_numpy(dtype=bool)
                          & (df["model"] == model).to_numpy(dtype=bool))


def _link(bcols: dict, b_start: np.ndarray, scols: dict, s_start: np.ndarray, rcols: dict,
          r_arr: np.ndarray, segmented: np.ndarray, counts: Counts, notes: list[str]):
    """The flow of each request (0: none), the flows each batch ends and those each
    generation step ends: a request's batch is the batch of its instance and model whose
    ``seq`` is its ``batch_seq`` (the first, should a seq repeat); a generation request's
    is the step it was first scheduled in, the step of its model with that ``seq``. A
    request without its batch in the window, or recorded as arriving after its batch
    started, gets no flow (and a note says how many)."""
    def index(cols: dict) -> dict[tuple[str, str, int], int]:
        found: dict[tuple[str, str, int], int] = {}
        for i, key in enumerate(zip(cols["instance_id"], cols["model"], cols["seq"])):
            if key[2] is not None:
                found.setdefault((str(key[0]), str(key[1]), int(key[2])), i)
        return found

    batch_of, step_of = index(bcols), index(scols)
    flow_of = np.zeros(len(r_arr), dtype=np.int64)
    flows_in: dict[int, list[int]] = {}
    step_flows_in: dict[int, list[int]] = {}
    late = missing = 0
    for i in np.flatnonzero(segmented).tolist():
        seq = rcols["batch_seq"][i]
        if seq is None:
            continue
        key = (str(rcols["instance_id"][i]), str(rcols["model"][i]), int(seq))
        j, start, into = batch_of.get(key), b_start, flows_in
        if j is None:
            j, start, into = step_of.get(key), s_start, step_flows_in
        if j is None:
            missing += 1
        elif r_arr[i] > start[j]:  # an arrow back in time would be dropped by a viewer
            late += 1
        else:
            counts.flows += 1
            flow_of[i] = counts.flows
            into.setdefault(j, []).append(counts.flows)
    if late:
        notes.append(f"{late} request(s) are recorded as arriving after their batch started; "
                     "they have no flow arrow")
    if missing:
        notes.append(f"{missing} request(s) joined a batch outside the window (or not "
                     "recorded); they have no flow arrow")
    return flow_of, flows_in, step_flows_in


def _ordered(idx: np.ndarray, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """``idx`` by start, then end (an instant before a slice that starts with it)."""
    return idx[np.lexsort((end[idx], start[idx]))]


def _batch_source(idx, cols, start, end, flows_in):
    def walk(track: Track):
        for i in idx.tolist():
            size, top = cols["batch_size"][i], cols["max_batch_size"][i]
            real, padded = _clean(cols["real_elements"][i]), _clean(cols["padded_elements"][i])
            outcome = cols["outcome"][i]
            name = f"batch {cols['seq'][i]} n={size}/{top}"
            if outcome not in (None, "ok"):
                name += f" {outcome}"
            args = _args((
                ("batch_id", cols["id"][i]), ("seq", cols["seq"][i]), ("batch_size", size),
                ("max_batch_size", top),
                # "none": the batch had no bucket (fixed-size inputs), not a value left out
                ("bucket", "none" if cols["bucket"][i] is None else cols["bucket"][i]),
                ("real_elements", real), ("padded_elements", padded),
                ("padding_share", round(1.0 - real / padded, 6) if real is not None and padded
                 else None),
                ("policy", cols["policy"][i]), ("settings_version", cols["settings_version"][i]),
                ("outcome", outcome), ("cuda_graph", _flag(cols["cuda_graph"][i])),
                ("queue_depth", cols["queue_depth"][i]), ("compute_ms", _ms(cols["compute_s"][i])),
                ("queue_wait_mean_ms", _ms(cols["queue_wait_mean_s"][i])),
                ("queue_wait_max_ms", _ms(cols["queue_wait_max_s"][i])),
                ("peak_memory_bytes", cols["peak_memory_bytes"][i]),
                ("peak_memory_increase_bytes", cols["peak_memory_increase_bytes"][i]),
                ("requests_in_trace", len(flows_in.get(i, ())))))
            yield from _walk(Slice(track, int(start[i]), int(end[i]), name, "batch", args,
                                   flows_in=tuple(flows_in.get(i, ()))))
    return walk


def _flag(value):
    return None if value is None else bool(value)


def _trace_stamps(requests: pd.DataFrame, arrived: np.ndarray, started: np.ndarray,
                  finished: np.ndarray) -> dict[str, np.ndarray]:
    """A traced request's own timestamps in nanoseconds, clamped so that its parts nest
    and follow each other (receive before arrival, input and output inside compute, send
    after the answer), -1 where it was not traced or the server did not see them; and
    each request's whole span, ``lo`` to ``hi`` (arrival to answer for one not traced)."""
    def col(name: str) -> np.ndarray:
        if name not in requests.columns:
            return np.full(len(requests), -1, dtype=np.int64)
        return ns(pd.to_numeric(requests[name], errors="coerce"))

    def clamp(x: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return np.where(x >= 0, np.clip(x, lo, np.maximum(lo, hi)), -1)

    recv_start, recv_end = col("recv_start_at"), col("recv_end_at")
    send_start, send_end = col("send_start_at"), col("send_end_at")
    received = (recv_start >= 0) & (recv_end >= 0)
    sent = (send_start >= 0) & (send_end >= 0)
    lo = np.where(received, np.minimum(recv_start, arrived), arrived)
    hi = np.where(sent, np.maximum(send_end, finished), finished)
    out = {"lo": lo, "hi": hi}
    out["recv_start"] = np.where(received, recv_start.clip(max=arrived), -1)
    out["recv_end"] = np.where(received, np.clip(recv_end, out["recv_start"], arrived), -1)
    out["send_start"] = np.where(sent, np.maximum(send_start, finished), -1)
    out["send_end"] = np.where(sent, np.maximum(send_end, out["send_start"]), -1)
    input_end = clamp(col("compute_input_end_at"), started, finished)
    output_start = clamp(col("compute_output_start_at"), input_end, finished)
    both = (input_end >= 0) & (output_start >= 0)
    out["input_end"] = np.where(both, input_end, -1)
    out["output_start"] = np.where(both, output_start, -1)
    return out


def _traced_parts(i: int, track: Track, stamps: dict, middle: tuple) -> tuple:
    """``middle`` (the queue and compute slices, or none) between the receive and send
    slices of request ``i``, where it has them."""
    parts = []
    if stamps["recv_start"][i] >= 0:
        parts.append(Slice(track, int(stamps["recv_start"][i]), int(stamps["recv_end"][i]),
                           "receive", "receive", {}))
    parts.extend(middle)
    if stamps["send_start"][i] >= 0:
        parts.append(Slice(track, int(stamps["send_start"][i]), int(stamps["send_end"][i]),
                           "send", "send", {}))
    return tuple(parts)


def _compute_parts(i: int, track: Track, s: int, f: int, stamps: dict) -> tuple:
    """The ``input``, ``infer`` and ``output`` parts of a traced request's compute."""
    ie, os_ = int(stamps["input_end"][i]), int(stamps["output_start"][i])
    if ie < 0:
        return ()
    return (Slice(track, s, ie, "input", "input", {}), Slice(track, ie, os_, "infer", "infer", {}),
            Slice(track, os_, f, "output", "output", {}))


def _request_source(idx, cols, arrived, started, finished, segmented, flow_of, stamps):
    def walk(track: Track):
        for i in idx.tolist():
            a, s, f = int(arrived[i]), int(started[i]), int(finished[i])
            lo, hi = int(stamps["lo"][i]), int(stamps["hi"][i])
            outcome = cols["outcome"][i]
            args = _args((
                ("request_id", cols["id"][i]), ("priority", cols["priority"][i]),
                ("length", cols["length"][i]), ("bypass", _flag(cols["bypass"][i])),
                ("outcome", outcome), ("batch_seq", cols["batch_seq"][i]),
                ("latency_ms", _ms(cols["latency_s"][i])),
                ("queue_ms", _ms(cols["queue_wait_s"][i])),
                ("timeout_ms", cols["timeout_ms"][i]), ("ttft_ms", _ms(cols["ttft_s"][i])),
                ("tpot_ms", _ms(cols["tpot_s"][i])),
                ("prompt_tokens", cols["prompt_tokens"][i]),
                ("output_tokens", cols["output_tokens"][i]),
                ("trace_id", cols["trace_id"][i]), ("protocol", cols["protocol"][i]),
                ("client_request_id", cols["client_request_id"][i]),
                ("w3c_trace_id", cols["w3c_trace_id"][i]),
                ("receive_ms", _span_ms(stamps["recv_start"][i], stamps["recv_end"][i])),
                ("send_ms", _span_ms(stamps["send_start"][i], stamps["send_end"][i]))))
            if not segmented[i]:  # never reached a batch: named by its outcome
                yield from _walk(Slice(track, lo, hi, str(outcome), "request", args,
                                       instant=(hi == lo),
                                       children=_traced_parts(i, track, stamps, ())))
                continue
            name = f"request {cols['id'][i]}" if outcome == "ok" else f"{outcome} {cols['id'][i]}"
            children = (Slice(track, a, s, "queue", "queue", {}, flow_out=int(flow_of[i])),
                        Slice(track, s, f, "compute", "compute", {},
                              children=_compute_parts(i, track, s, f, stamps)))
            yield from _walk(Slice(track, lo, hi, name, "request", args,
                                   children=_traced_parts(i, track, stamps, children)))
    return walk


def _span_ms(start_ns, end_ns) -> float | None:
    """Milliseconds from ``start_ns`` to ``end_ns`` (None where either is missing)."""
    return None if start_ns < 0 or end_ns < 0 else round((int(end_ns) - int(start_ns)) / 1e6, 6)


def _step_source(idx, cols, start, end, flows_in):
    def walk(track: Track):
        for i in idx.tolist():
            prefill = cols["prefill_tokens"][i]
            joined = tuple(flows_in.get(i, ()))
            args = _args((
                ("step_id", cols["id"][i]), ("seq", cols["seq"][i]),
                ("requests_joined_in_trace", len(joined) or None),
                ("mode", cols["mode"][i]), ("running", cols["running"][i]),
                ("waiting", cols["waiting"][i]), ("prefill_tokens", prefill),
                ("decode_tokens", cols["decode_tokens"][i]),
                ("blocks_used", cols["blocks_used"][i]), ("blocks_free", cols["blocks_free"][i]),
                ("preemptions", cols["preemptions"][i]), ("step_ms", _ms(cols["step_s"][i]))))
            name = _step_name(prefill, cols["decode_tokens"][i])
            yield from _walk(Slice(track, int(start[i]), int(end[i]), name, "step", args,
                                   flows_in=joined))
    return walk


def _event_source(idx, cols, at):
    def walk(track: Track):
        for i in idx.tolist():
            args = _args((("severity", cols["severity"][i]), ("model", cols["model"][i]),
                          ("message", cols["message"][i]),
                          ("details", cols["details_json"][i])))
            yield from _walk(Slice(track, int(at[i]), int(at[i]), str(cols["kind"][i]), "event",
                                   args, instant=True))
    return walk


def _note_source(notes: list[str], window: Window):
    at = int(ns([window.start_s])[0])
    args = _args((("window_start_s", window.start_s), ("window_end_s", window.end_s),
                  ("model", window.model), ("instance_id", window.instance_id)))

    def walk(track: Track):
        for note in notes:
            yield from _walk(Slice(track, at, at, note, "note", dict(args), instant=True))
    return walk
