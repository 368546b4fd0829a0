"""A layout written in Perfetto's native format (a ``.pftrace``), for ui.perfetto.dev.

The trace is a stream of ``TracePacket``\\ s built with the official protos of the
``perfetto`` package (``perfetto_trace_pb2``) and written one by one through its
``StreamingTraceProtoBuilder``, so the file is never whole in memory. Both are imported
when a trace is written, not with this module: the protos' module is large, and
importing BatchScope stays fast.

What goes in, in this order, all on one packet sequence (``SEQUENCE_ID``):

* a ``ClockSnapshot`` saying the trace clock is the wall clock (``BOOTTIME`` =
  ``REALTIME``), so the UI can show times of day; the timestamps are the recorded wall
  times in nanoseconds;
* a ``TrackDescriptor`` per process (an instance: its trace pid and name, children in
  the layout's order) and per track (a child of its process, named); the first packet
  clears the sequence's incremental state (``SEQ_INCREMENTAL_STATE_CLEARED``), which the
  interned names below live in;
* ``TrackEvent``\\ s: ``TYPE_SLICE_BEGIN`` / ``TYPE_SLICE_END`` for slices, nested as
  the layout walks them, ``TYPE_INSTANT`` for instants, the slice's args as debug
  annotations, a request's queue slice starting a flow (``flow_ids``) that its batch's
  slice ends (``terminating_flow_ids``). Event names, categories and annotation names
  that repeat are interned (sent once in ``interned_data``, then referred to by number,
  with ``SEQ_NEEDS_INCREMENTAL_STATE``); the names of batches and requests, unique
  each, are written as they are.
"""

from __future__ import annotations

from typing import BinaryIO

from batchscope.trace.layout import BEGIN, END, Layout, Slice, Track

#: the ``trusted_packet_sequence_id`` of every packet
SEQUENCE_ID = 1
#: ``ClockSnapshot.Clock`` ids (``BuiltinClock``)
CLOCK_REALTIME, CLOCK_BOOTTIME = 1, 6


def protos():
    """``perfetto_trace_pb2`` (imported on first use: a large module)."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2

    return perfetto_trace_pb2


class _Writer:
    """Turns the layout's walk into packets, interning what repeats."""

    def __init__(self, fh: BinaryIO) -> None:
        from perfetto.trace_builder.proto_builder import StreamingTraceProtoBuilder

        pb = protos()
        self.pb = pb
        self.builder = StreamingTraceProtoBuilder(fh)
        self.names: dict[str, int] = {}
        self.categories: dict[str, int] = {}
        self.keys: dict[str, int] = {}
        self.first = True
        self.BEGIN = pb.TrackEvent.TYPE_SLICE_BEGIN
        self.END = pb.TrackEvent.TYPE_SLICE_END
        self.INSTANT = pb.TrackEvent.TYPE_INSTANT
        self.CLEARED = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
        self.NEEDS = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE

    def packet(self):
        p = self.builder.create_packet()
        p.trusted_packet_sequence_id = SEQUENCE_ID
        if self.first:
            p.sequence_flags = self.CLEARED
            p.first_packet_on_sequence = True
            p.previous_packet_dropped = 1  # nothing before it to rely on
            self.first = False
        return p

    def clock(self, at_ns: int) -> None:
        p = self.builder.create_packet()
        p.trusted_packet_sequence_id = SEQUENCE_ID
        snap = p.clock_snapshot
        for clock_id in (CLOCK_BOOTTIME, CLOCK_REALTIME):
            c = snap.clocks.add()
            c.clock_id = clock_id
            c.timestamp = at_ns
        snap.primary_trace_clock = CLOCK_BOOTTIME
        self.builder.write_packet(p)

    def process(self, uuid: int, pid: int, name: str) -> None:
        p = self.packet()
        d = p.track_descriptor
        d.uuid = uuid
        d.process.pid = pid
        d.process.process_name = name
        d.child_ordering = self.pb.TrackDescriptor.EXPLICIT
        self.builder.write_packet(p)

    def track(self, track: Track) -> None:
        p = self.packet()
        d = p.track_descriptor
        d.uuid = track.uuid
        if track.parent_uuid is not None:
            d.parent_uuid = track.parent_uuid
        d.name = track.name
        d.sibling_order_rank = track.rank
        self.builder.write_packet(p)

    def _iid(self, table: dict[str, int], value: str, packet, field: str) -> int:
        iid = table.get(value)
        if iid is None:
            iid = table[value] = len(table) + 1
            entry = getattr(packet.interned_data, field).add()
            entry.iid = iid
            entry.name = value
        return iid

    def event(self, ts: int, phase: str, item: Slice) -> None:
        p = self.packet()
        p.timestamp = ts
        e = p.track_event
        e.track_uuid = item.track.uuid
        if phase == END:
            e.type = self.END
            self.builder.write_packet(p)
            return
        p.sequence_flags |= self.NEEDS
        e.type = self.BEGIN if phase == BEGIN else self.INSTANT
        e.category_iids.append(self._iid(self.categories, item.category, p, "event_categories"))
        if item.category == "batch" or (item.category == "request" and item.children):
            e.name = item.name  # unique: interning would only add to it
        else:
            e.name_iid = self._iid(self.names, item.name, p, "event_names")
        for key, value in item.args.items():
            a = e.debug_annotations.add()
            a.name_iid = self._iid(self.keys, key, p, "debug_annotation_names")
            if isinstance(value, bool):
                a.bool_value = value
            elif isinstance(value, int):
                a.int_value = value
            elif isinstance(value, float):
                a.double_value = value
            else:
                a.string_value = str(value)
        if item.flow_out:
            e.flow_ids.append(item.flow_out)
        if item.flows_in:
            e.terminating_flow_ids.extend(item.flows_in)
        self.builder.write_packet(p)


def write(layout: Layout, fh: BinaryIO) -> None:
    """Write ``layout`` to the binary file ``fh`` as a Perfetto trace (see module doc)."""
    w = _Writer(fh)
    w.clock(round(layout.window.start_s * 1e9))
    for process in layout.processes:
        w.process(process.uuid, process.pid, process.name)
    for track in layout.tracks:
        if track.kind != "events":  # a process's events go on the process's own track
            w.track(track)
    for ts, phase, item in layout.events():
        w.event(ts, phase, item)
