"""A layout written as Chrome's Trace Event JSON, for chrome://tracing and Perfetto.

``{"displayTimeUnit": "ms", "otherData": {...}, "traceEvents": [...]}``, times in
microseconds. The events:

* ``M`` metadata: the name and order of each process (an instance) and thread (a track
  of the layout: one thread id per track, so per batch lane, step lane and request
  track);
* ``X`` complete events for every slice (batches, steps, requests and, nested in a
  request on the same thread, its ``queue`` and ``compute``), ``i`` instants for the
  rest: a request that took no time (thread scope), an event of an instance (process
  scope), the export's notes (global scope);
* flows, one per batched request: ``s`` on the request's thread inside its queue slice,
  ``f`` with ``bp: "e"`` on the batch's thread inside the batch slice (both at the
  slice's middle, so each binds to that slice whatever order a viewer sorts equal
  timestamps in).

Requests are thread slices, on the layout's pool of request tracks, rather than async
(``b``/``e``) events: both viewers bind ``s``/``f`` flow events only to slices of a
thread, and an async slice can carry at most one flow through a ``bind_id``, while a
batch ends the flows of all its requests.

Timestamps are written from the integer nanoseconds as exact decimals (``123.456`` µs):
a float holds wall-clock microseconds only to about a quarter of one. The file is
written as the layout is walked, a megabyte at a time (``orjson`` for each event).
"""

from __future__ import annotations

from typing import BinaryIO

import orjson

from batchscope.trace.layout import BEGIN, END, Layout, Slice

#: bytes gathered before a write
FLUSH_BYTES = 1 << 20
FLOW_CATEGORY, FLOW_NAME = "flow", "joins batch"


def us(ns: int) -> bytes:
    """Nanoseconds as exact decimal microseconds."""
    whole, frac = divmod(int(ns), 1000)
    return b"%d.%03d" % (whole, frac)


def _event(fields: dict, ts_ns: int, dur_ns: int | None = None) -> bytes:
    head = b'{"ts":' + us(ts_ns) + (b',"dur":' + us(dur_ns) if dur_ns is not None else b"")
    return head + b"," + orjson.dumps(fields)[1:]


class _Out:
    def __init__(self, fh: BinaryIO) -> None:
        self.fh = fh
        self.parts: list[bytes] = []
        self.size = 0
        self.count = 0

    def add(self, event: bytes) -> None:
        if self.count:
            self.parts.append(b",\n")
        self.parts.append(event)
        self.count += 1
        self.size += len(event) + 2
        if self.size >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        self.fh.write(b"".join(self.parts))
        self.parts, self.size = [], 0


def _metadata(layout: Layout) -> list[bytes]:
    out = []
    for process in layout.processes:
        out.append(orjson.dumps({"ph": "M", "name": "process_name", "pid": process.pid,
                                 "args": {"name": process.name}}))
        out.append(orjson.dumps({"ph": "M", "name": "process_sort_index", "pid": process.pid,
                                 "args": {"sort_index": process.pid}}))
    for track in layout.tracks:
        if track.kind in ("events", "notes"):
            continue
        out.append(orjson.dumps({"ph": "M", "name": "thread_name", "pid": track.pid,
                                 "tid": track.tid, "args": {"name": track.name}}))
        out.append(orjson.dumps({"ph": "M", "name": "thread_sort_index", "pid": track.pid,
                                 "tid": track.tid, "args": {"sort_index": track.rank}}))
    return out


def _instant(item: Slice) -> bytes:
    track = item.track
    fields = {"ph": "i", "name": item.name, "cat": item.category, "pid": track.pid,
              "args": item.args}
    if track.kind == "events":
        fields["s"] = "p"
    elif track.kind == "notes":
        fields["s"] = "g"
    else:
        fields.update(s="t", tid=track.tid)
    return _event(fields, item.start_ns)


def write(layout: Layout, fh: BinaryIO) -> None:
    """Write ``layout`` to the binary file ``fh`` as Trace Event JSON (see module doc)."""
    w = layout.window
    other = {"source": "BatchScope", "window_start_s": repr(w.start_s),
             "window_end_s": repr(w.end_s), "model": w.model or "", "instance_id":
             w.instance_id or "", "notes": " | ".join(layout.notes)}
    fh.write(b'{"displayTimeUnit":"ms","otherData":' + orjson.dumps(other)
             + b',"traceEvents":[\n')
    out = _Out(fh)
    for event in _metadata(layout):
        out.add(event)
    for ts, phase, item in layout.events():
        if phase == END:
            continue
        if phase != BEGIN:
            out.add(_instant(item))
            continue
        track = item.track
        dur = item.end_ns - item.start_ns
        out.add(_event({"ph": "X", "name": item.name, "cat": item.category, "pid": track.pid,
                        "tid": track.tid, "args": item.args}, ts, dur))
        middle = item.start_ns + dur // 2
        if item.flow_out:
            out.add(_event({"ph": "s", "id": item.flow_out, "cat": FLOW_CATEGORY,
                            "name": FLOW_NAME, "pid": track.pid, "tid": track.tid}, middle))
        for flow in item.flows_in:
            out.add(_event({"ph": "f", "bp": "e", "id": flow, "cat": FLOW_CATEGORY,
                            "name": FLOW_NAME, "pid": track.pid, "tid": track.tid}, middle))
    out.flush()
    fh.write(b"\n]}\n")
