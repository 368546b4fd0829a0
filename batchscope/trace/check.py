"""Reading a written trace back and checking that a viewer will draw it as meant.

``read_perfetto(data)`` parses a ``.pftrace`` with the official protos and replays it
the way Perfetto's importer does: the sequence's interned names (cleared with
``SEQ_INCREMENTAL_STATE_CLEARED``), a stack of open slices per track, flows from
``flow_ids`` to ``terminating_flow_ids``. ``read_chrome(data)`` does the same for the
Trace Event JSON (complete events nested per thread, ``s``/``f`` flows bound to the
slice they fall in). Both give a ``TraceCheck``: the slices found, by category, the
flows, and ``problems``, every way the file breaks what the writers promise:

* every begin has its end on the same track, later or at the same time;
* on one track slices nest properly (none overlaps another but by containing it), and
  the events come in time order;
* every track, name and annotation an event refers to was described before it;
* every flow starts once and ends once, not before it starts, on a slice;
* no time is negative (before 1970: Perfetto's timestamps are unsigned).

The tests and ``benchmarks/trace_export.py`` use it; it reads a whole file into memory.
"""

from __future__ import annotations

import bisect
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from decimal import Decimal


@dataclass
class Slice:
    """One slice (or instant: ``end_ns == start_ns``) read back from a trace."""

    track: int | tuple
    start_ns: int
    end_ns: int
    name: str
    category: str
    depth: int
    args: dict
    flow_out: list = field(default_factory=list)
    flows_in: list = field(default_factory=list)


@dataclass
class TraceCheck:
    slices: list[Slice] = field(default_factory=list)
    #: track (uuid, or (pid, tid) in JSON) -> its name
    track_names: dict = field(default_factory=dict)
    #: flow id -> (outgoing slice, incoming slice)
    flows: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def by_category(self) -> Counter:
        return Counter(s.category for s in self.slices)

    def problem(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(text)


def _value(a) -> object:
    kind = a.WhichOneof("value")
    return getattr(a, kind) if kind else None


def read_perfetto(data: bytes) -> TraceCheck:
    """A Perfetto trace read back and checked (see module doc)."""
    from batchscope.trace.perfetto import protos

    pb = protos()
    trace = pb.Trace()
    trace.ParseFromString(data)
    out = TraceCheck()
    names: dict[int, str] = {}
    cats: dict[int, str] = {}
    keys: dict[int, str] = {}
    cleared = False
    stacks: dict[int, list[Slice]] = defaultdict(list)
    last_ts: dict[int, int] = {}
    starts: dict[int, Slice] = {}
    ends: dict[int, Slice] = {}
    for p in trace.packet:
        if p.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED:
            names, cats, keys, cleared = {}, {}, {}, True
        if p.HasField("interned_data"):
            for e in p.interned_data.event_names:
                names[e.iid] = e.name
            for e in p.interned_data.event_categories:
                cats[e.iid] = e.name
            for e in p.interned_data.debug_annotation_names:
                keys[e.iid] = e.name
        if p.HasField("track_descriptor"):
            d = p.track_descriptor
            if d.HasField("parent_uuid") and d.parent_uuid not in out.track_names:
                out.problem(f"track {d.uuid} has an unknown parent {d.parent_uuid}")
            out.track_names[d.uuid] = d.process.process_name if d.HasField("process") else d.name
            continue
        if not p.HasField("track_event"):
            continue
        e = p.track_event
        ts, track = p.timestamp, e.track_uuid
        if track not in out.track_names:
            out.problem(f"an event at {ts} is on the undescribed track {track}")
        if ts < last_ts.get(track, 0):
            out.problem(f"track {track}: an event at {ts} comes after one at {last_ts[track]}")
        last_ts[track] = ts
        stack = stacks[track]
        if e.type == pb.TrackEvent.TYPE_SLICE_END:
            if not stack:
                out.problem(f"track {track}: an end at {ts} with no slice open")
                continue
            item = stack.pop()
            item.end_ns = ts
            continue
        uses_iids = e.name_iid or len(e.category_iids) or any(
            a.name_iid for a in e.debug_annotations)
        needs = p.sequence_flags & pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
        if uses_iids and not (cleared and needs):
            out.problem(f"an event at {ts} uses interned names without SEQ_NEEDS_INCREMENTAL_STATE "
                        "after a SEQ_INCREMENTAL_STATE_CLEARED")
        name = e.name if e.HasField("name") else names.get(e.name_iid)
        if name is None:
            out.problem(f"an event at {ts} names the unknown iid {e.name_iid}")
        cat = ",".join(cats.get(i, "?") for i in e.category_iids) or ",".join(e.categories)
        args = {}
        for a in e.debug_annotations:
            key = a.name if a.HasField("name") else keys.get(a.name_iid)
            if key is None:
                out.problem(f"an annotation at {ts} names the unknown iid {a.name_iid}")
            args[key] = _value(a)
        item = Slice(track, ts, ts, name or "", cat, len(stack), args, list(e.flow_ids),
                     list(e.terminating_flow_ids))
        out.slices.append(item)
        for flow in e.flow_ids:
            if flow in starts:
                out.problem(f"flow {flow} starts twice")
            starts[flow] = item
        for flow in e.terminating_flow_ids:
            if flow in ends:
                out.problem(f"flow {flow} ends twice")
            ends[flow] = item
        if e.type == pb.TrackEvent.TYPE_SLICE_BEGIN:
            stack.append(item)
        elif e.type != pb.TrackEvent.TYPE_INSTANT:
            out.problem(f"an event at {ts} has the unexpected type {e.type}")
    for track, stack in stacks.items():
        for item in stack:
            out.problem(f"track {track}: {item.name!r} at {item.start_ns} never ends")
    _pair_flows(out, starts, ends)
    return out


def _pair_flows(out: TraceCheck, starts: dict, ends: dict) -> None:
    for flow, src in starts.items():
        dst = ends.get(flow)
        if dst is None:
            out.problem(f"flow {flow} never ends")
            continue
        if dst.start_ns < src.start_ns:
            out.problem(f"flow {flow} ends at {dst.start_ns}, before it starts ({src.start_ns})")
        out.flows[flow] = (src, dst)
    for flow in ends.keys() - starts.keys():
        out.problem(f"flow {flow} ends but never starts")


def _ns(us: Decimal | int | float) -> int:
    """Microseconds (as written: exact decimals) as nanoseconds."""
    return int((Decimal(str(us)) if not isinstance(us, Decimal) else us) * 1000)


def _innermost(items: list[Slice], begins: list[int], at: int) -> Slice | None:
    """The deepest of ``items`` (nested, by start) that ``at`` falls in: the last one to
    start by then that has not ended (a slice's parents start before it)."""
    i = bisect.bisect_right(begins, at) - 1
    while i >= 0:
        if items[i].end_ns >= at:
            return items[i]
        i -= 1
    return None


def read_chrome(data: bytes) -> TraceCheck:
    """A Trace Event JSON trace read back and checked (see module doc)."""
    out = TraceCheck()
    doc = json.loads(data, parse_float=Decimal)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    complete: dict[tuple, list[Slice]] = defaultdict(list)
    flow_marks: list[tuple[str, dict]] = []
    asyncs: dict[tuple, list[dict]] = defaultdict(list)
    for ev in events:
        ph = ev.get("ph")
        key = (ev.get("pid"), ev.get("tid"))
        if ph == "M":
            if ev.get("name") == "thread_name":
                out.track_names[key] = ev["args"]["name"]
            elif ev.get("name") == "process_name":
                out.track_names[(ev.get("pid"), None)] = ev["args"]["name"]
        elif ph == "X":
            start = _ns(ev["ts"])
            if start < 0 or _ns(ev["dur"]) < 0:
                out.problem(f"thread {key}: {ev.get('name')!r} at {ev['ts']} for {ev['dur']} "
                            "has a negative time or length")
            complete[key].append(Slice(key, start, start + _ns(ev["dur"]), ev.get("name", ""),
                                       ev.get("cat", ""), 0, ev.get("args", {})))
        elif ph in ("i", "I"):
            at = _ns(ev["ts"])
            if at < 0:
                out.problem(f"an instant {ev.get('name')!r} at {ev['ts']} has a negative time")
            out.slices.append(Slice(key, at, at, ev.get("name", ""), ev.get("cat", ""), 0,
                                    ev.get("args", {})))
        elif ph in ("s", "f"):
            flow_marks.append((ph, ev))
        elif ph in ("b", "e"):
            asyncs[(ev.get("pid"), ev.get("cat"), ev.get("id"))].append(ev)
    for key, items in complete.items():
        if key not in out.track_names:
            out.problem(f"thread {key} has slices but no thread_name")
        items.sort(key=lambda s: (s.start_ns, -s.end_ns))
        stack: list[Slice] = []
        for item in items:
            while stack and stack[-1].end_ns <= item.start_ns:
                stack.pop()
            if stack and item.end_ns > stack[-1].end_ns:
                out.problem(f"thread {key}: {item.name!r} [{item.start_ns}, {item.end_ns}] "
                            f"overlaps {stack[-1].name!r} [{stack[-1].start_ns}, "
                            f"{stack[-1].end_ns}] without nesting in it")
            item.depth = len(stack)
            stack.append(item)
            out.slices.append(item)
    for key, evs in asyncs.items():
        depth = 0
        for ev in sorted(evs, key=lambda e: _ns(e["ts"])):
            depth += 1 if ev["ph"] == "b" else -1
            if depth < 0:
                out.problem(f"async {key}: an 'e' at {ev['ts']} with no 'b' open")
                depth = 0
        if depth:
            out.problem(f"async {key}: {depth} 'b' without their 'e'")
    starts: dict = {}
    ends: dict = {}
    begins = {key: [s.start_ns for s in items] for key, items in complete.items()}
    for ph, ev in flow_marks:
        key, at = (ev.get("pid"), ev.get("tid")), _ns(ev["ts"])
        target = _innermost(complete.get(key, []), begins.get(key, []), at)
        if target is None:
            out.problem(f"flow {ph} {ev.get('id')} at {at} on {key} is in no slice")
            continue
        table = starts if ph == "s" else ends
        if ev.get("id") in table:
            out.problem(f"flow {ev.get('id')} has two {ph!r} events")
        table[ev.get("id")] = target
        (target.flow_out if ph == "s" else target.flows_in).append(ev.get("id"))
    _pair_flows(out, starts, ends)
    return out
