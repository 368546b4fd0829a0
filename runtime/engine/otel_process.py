"""The OpenTelemetry span export in a child process of its own.

Building a request's spans with the SDK and encoding them for OTLP costs about 20 us of
CPU per span (the SDK's protobuf encoder dominates), some 70 us for a request with its
``queue`` and ``compute`` children and its share of a batch span. In the serving process
that time would be taken from the event loop under its interpreter lock: with every
request traced, the server lost two thirds of its throughput. ``SpanProcess`` keeps the
serving process to a list append per trace: a sender thread hands the finished traces
and their batches over as plain tuples every ``SEND_INTERVAL_S`` (or at ``SEND_AT``
traces; rarely, as each round costs the event loop), and a child process
(``batchscope.spawn.spawn_child``) runs ``runtime.engine.otel.OtlpSpans`` (span
building, the SDK's ``BatchSpanProcessor``, the OTLP exporter) on them.

The child runs at the lowest CPU priority while it keeps up (``SCHED_IDLE`` on Linux)
and at a fair share of a CPU (``nice`` 0) while its backlog grows
(``batchscope.spawn.BacklogPriority``), as the database writer does at ``nice`` 10:
spans are exported in the CPU time serving leaves, and a machine that never idles still
gets them, at the cost of that share. (At ``nice`` 10, with every request traced on a
machine whose cores serving fills, the child could not keep up and spans were dropped.)
Past ``queue_max`` traces waiting (here or in the child), traces are dropped and their
spans counted;
``dropped`` adds the child's count (its queue, the processor's), reported through
``on_drops`` as ``OtlpSpans`` does. The child inherits the standard ``OTEL_*``
variables.

Messages: ``(batches, traces, raw traces, trace records, wall offset, backlog)`` (tuples
in ``BatchInfo`` and ``FinishedTrace`` field order, and traces as the tracer hands them
over, monotonic, turned into ``FinishedTrace`` in the child by
``runtime.engine.otel_spans.finished_from``; the tracer's ``TraceBatch`` records, whose batches
of plain traces are the engine's booking's, their members' spans written straight from
them, ``runtime.engine.otel_spans.SpanBuilder.plain_spans``: the database writer's process gets
the same records, and each is pickled once, ``TraceBatch.packed``) -> ``(spans handed to
the processor, spans dropped)``; ``b"stop"`` -> the same counts once the child has
exported what it holds (``close``'s timeout); ``b"counts"`` -> the same counts and what the
child still holds (``OtlpSpans.holding``). Every answer carries that too: while the child
holds spans (a collector that is down fails their exports one by one, seconds apart), the
sender thread asks for the counts once a round though nothing new is to be sent, so the
spans lost after the last traces came are counted and reported without more traffic.
"""

from __future__ import annotations

import collections
import logging
import os
import pickle
import threading
import time
from operator import attrgetter
from typing import Any, Callable

from batchscope import gctune
from batchscope.spawn import BacklogPriority, child_priority, spawn_child, stop_child
from batchscope.threadnames import name_native
from runtime.engine import otel_config
from runtime.engine.otel import QUEUE_MAX, OtlpSpans, exporter_for, report_drops
from runtime.engine.otel_spans import (BatchInfo, FinishedTrace, finished_from, plain_spans_of,
                                       spans_of)

log = logging.getLogger(__name__)

#: how often the sender thread hands the traces over, and how many wake it sooner. Each
#: time it runs, the thread takes the interpreter lock from the event loop several times
#: (the hand-over's pickling, the pipe, the child's answer), and on a machine whose cores
#: serving fills the loop then waits for it to be scheduled: at 10 rounds a second that
#: cost a server tracing 1 request in 100 about 2 % of its throughput on 2 vCPUs, and one
#: tracing none 0.3 us a request of the thread's own CPU. Spans still reach the collector
#: within ``OTEL_BSP_SCHEDULE_DELAY`` (5 s) of this.
SEND_INTERVAL_S = 1.0
SEND_AT = 4096
#: how long the child may take to start, and to answer one message
START_TIMEOUT_S = 60.0
REPLY_TIMEOUT_S = 30.0
#: backlog (0..1) at which the idle child asks for a share of a CPU, and gives it back
URGENT_BACKLOG = 0.25
CALM_BACKLOG = 0.05
#: of ``close``'s time, what is left for the child's answer, and for its exit
CLOSE_MARGIN_S = 0.2
_READY = b"ready"
_STOP = b"stop"
_COUNTS = b"counts"
_TRACE_TUPLE = attrgetter(*FinishedTrace.__slots__)
_BATCH_TUPLE = attrgetter(*BatchInfo.__slots__)


def _child_main(conn: Any, endpoint: str, instance_id: str, protocol: str | None,
                queue_max: int, nice: int) -> None:
    """Run ``OtlpSpans`` on what the parent sends, until told to stop or orphaned."""
    prio = BacklogPriority(child_priority(), nice, URGENT_BACKLOG, CALM_BACKLOG)
    try:
        spans = OtlpSpans(endpoint, instance_id, protocol=protocol, queue_max=queue_max)
    except Exception as exc:  # noqa: BLE001 - told to the parent, which refuses to start
        conn.send_bytes(pickle.dumps(f"{type(exc).__name__}: {exc}"[:500]))
        return
    gctune.settle()  # the SDK, the exporter and its channel stay for the process's life
    conn.send_bytes(_READY)
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):  # the parent is gone
            break
        if msg.startswith(_STOP):
            spans.close(float(msg[len(_STOP):] or 5.0))
            conn.send_bytes(pickle.dumps((spans.spans_out, spans.dropped, 0)))
            return
        if msg == _COUNTS:
            conn.send_bytes(pickle.dumps(_counts(spans)))
            continue
        batches, traces, raws, records, wall_offset_s, backlog = pickle.loads(msg)
        for b in batches:
            spans.batch(BatchInfo(*b))
        for t in traces:
            spans.put(FinishedTrace(*t))
        for r in raws:
            spans.put(finished_from(r, wall_offset_s))
        for record in records:
            spans.put_traces(record)
        prio.follow(max(backlog, spans.backlog()))
        conn.send_bytes(pickle.dumps(_counts(spans)))
    spans.close(1.0)


def _counts(spans: OtlpSpans) -> tuple[int, int, int]:
    """``(spans handed to the processor, spans dropped, spans held)``: what is held read
    first, so a span it no longer counts is in the other two."""
    holding = spans.holding()
    return spans.spans_out, spans.dropped, holding


def _spans_in(record: Any) -> int:
    """The spans of the plain traces with spans of a ``TraceBatch``."""
    return sum(map(plain_spans_of, record.batches))


class SpanProcess:
    """``OtlpSpans``'s interface (``batch``, ``put``, ``close``, ``dropped``,
    ``spans_out``), the work done in a child process (module doc). Raises
    ``ImportError`` when the SDK or the exporter is missing, ``RuntimeError`` when the
    child does not start."""

    def __init__(self, endpoint: str, instance_id: str, *, protocol: str | None = None,
                 on_drops: Callable[[int, int], None] | None = None,
                 queue_max: int = QUEUE_MAX, nice: int = 0) -> None:
        otel_config.check(endpoint, protocol, os.environ)  # ConfigurationError: here
        exporter_for(endpoint, protocol)  # missing packages: here
        import opentelemetry.sdk.trace.export  # noqa: F401
        self.endpoint = endpoint
        self.on_drops = on_drops
        self.queue_max = queue_max
        #: filled on the event loop, emptied by the sender thread (deque: both ends safe)
        self._traces: collections.deque = collections.deque()
        self._raws: collections.deque = collections.deque()
        self._batches: collections.deque = collections.deque()
        #: the tracer's records (``put_traces``), and the plain traces of those put and
        #: of those taken by the sender thread (each count written by one thread alone)
        self._records: collections.deque = collections.deque()
        self._plain_put = 0
        self._plain_taken = 0
        #: what turns the raw traces' monotonic times into wall-clock seconds
        self._wall_offset_s = 0.0
        #: traces dropped here (queue full or the child gone) and the child's count
        self._dropped_here = 0
        self._dropped_there = 0
        self.reported = 0
        self.spans_out = 0
        #: what the child held as it last answered (``OtlpSpans.holding``): while it
        #: holds any, each round asks for its counts
        self._child_holding = 0
        self._wake = threading.Event()
        self._closed = False
        #: held while the pipe is used: the sender thread's rounds and ``close``
        self._conn_lock = threading.Lock()
        child = spawn_child(_child_main, (endpoint, instance_id, protocol, queue_max, nice),
                            name="batchscope-otlp-spans", idle=True, nice=nice)
        self._proc, self._conn = child.process, child.conn
        if not self._conn.poll(START_TIMEOUT_S):
            self._stop_child()
            raise RuntimeError("the OpenTelemetry span process did not start within "
                               f"{START_TIMEOUT_S:.0f} s")
        try:
            first = self._conn.recv_bytes()
        except (EOFError, OSError):
            self._stop_child()
            raise RuntimeError("the OpenTelemetry span process exited while starting") from None
        if first != _READY:
            self._stop_child()
            raise RuntimeError(f"the OpenTelemetry span exporter did not start: "
                               f"{pickle.loads(first)}")
        self._thread = threading.Thread(target=self._work, name="otlp-spans-sender",
                                        daemon=True)
        self._thread.start()

    @property
    def dropped(self) -> int:
        return self._dropped_here + self._dropped_there

    #: the records it is handed go to the child process, pickled
    pickles_records = True

    # -- on the event loop --------------------------------------------------------------
    def batch(self, info: BatchInfo) -> None:
        """Remember a batch that has a traced member (its span is made with the first)."""
        self._batches.append(info)

    def _held(self) -> int:
        """The traces waiting for the sender thread."""
        return len(self._traces) + len(self._raws) + self._plain_put - self._plain_taken

    def put(self, trace: FinishedTrace) -> None:
        """Queue a finished trace for its spans; dropped (and counted) when full."""
        traces = self._traces
        if self._held() >= self.queue_max:
            self._dropped_here += spans_of(trace)
            return
        traces.append(trace)
        if len(traces) == SEND_AT:
            self._wake.set()

    def put_raw(self, raw: tuple, wall_offset_s: float) -> None:
        """``put`` of a trace as the tracer hands it over (``finished_from``): nothing
        is converted on the event loop."""
        raws = self._raws
        if self._held() >= self.queue_max:
            self._dropped_here += spans_of(finished_from(raw, wall_offset_s))
            return
        self._wall_offset_s = wall_offset_s
        raws.append(raw)
        if len(raws) == SEND_AT:
            self._wake.set()

    def put_traces(self, record: Any) -> None:
        """``put`` of the plain traces with spans of a ``TraceBatch`` (its other traces
        come through ``put_raw``), handed over as the record it is: the child writes
        their spans from it (``SpanBuilder.plain_spans``)."""
        plain = sum(len(b[-1]) for b in record.batches)
        if self._held() >= self.queue_max:
            self._dropped_here += _spans_in(record)
            return
        self._records.append(record)
        before = self._plain_put - self._plain_taken
        self._plain_put += plain
        if before < SEND_AT <= self._plain_put - self._plain_taken:
            self._wake.set()

    # -- the sender thread --------------------------------------------------------------
    def _work(self) -> None:
        name_native()
        while True:
            self._wake.wait(SEND_INTERVAL_S)
            self._wake.clear()
            closed = self._closed
            self._send()
            report_drops(self)
            if closed:
                return

    def _send(self) -> None:
        # the traces first: a batch is queued before its members finish, so every batch a
        # trace taken here refers to is taken below too
        traces, raws, batches, records = self._traces, self._raws, self._batches, self._records
        taken = [traces.popleft() for _ in range(len(traces))]
        raw = [raws.popleft() for _ in range(len(raws))]
        plain = [records.popleft() for _ in range(len(records))]
        infos = [batches.popleft() for _ in range(len(batches))]
        self._plain_taken += sum(len(b[-1]) for r in plain for b in r.batches)
        if not taken and not raw and not plain and not infos:
            if self._child_holding:
                self._ask_counts()
            return
        offset = self._wall_offset_s
        with self._conn_lock:  # ``close`` uses the pipe too: one at a time
            conn = self._conn
            if conn is None:
                self._lost(taken, raw, plain, offset)
                return
            payload = pickle.dumps((list(map(_BATCH_TUPLE, infos)),
                                    list(map(_TRACE_TUPLE, taken)), raw, plain, offset,
                                    self._held() / self.queue_max), protocol=5)
            try:
                conn.send_bytes(payload)
                self._take_counts(conn)
            except (EOFError, OSError, TimeoutError):
                self._child_failed()
                self._lost(taken, raw, plain, offset)

    def _take_counts(self, conn: Any) -> None:
        """The child's answer: its counts, and what it still holds."""
        if not conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError
        self.spans_out, self._dropped_there, self._child_holding = pickle.loads(
            conn.recv_bytes())

    def _ask_counts(self) -> None:
        """The child's counts, asked for though there is nothing to send."""
        with self._conn_lock:
            conn = self._conn
            if conn is None:
                self._child_holding = 0
                return
            try:
                conn.send_bytes(_COUNTS)
                self._take_counts(conn)
            except (EOFError, OSError, TimeoutError):
                self._child_failed()

    def _child_failed(self) -> None:
        log.error("the OpenTelemetry span process %s; spans are dropped from now on",
                  "did not answer" if self._proc.is_alive() else "exited")
        self._child_holding = 0
        self._stop_child()

    def _lost(self, traces: list, raws: list, records: list, wall_offset_s: float) -> None:
        """Count the spans of traces that cannot be sent."""
        self._dropped_here += sum(map(spans_of, traces)) + sum(
            spans_of(finished_from(r, wall_offset_s)) for r in raws) + sum(
            map(_spans_in, records))


    # -- stopping -----------------------------------------------------------------------
    def close(self, timeout_s: float = 5.0) -> None:
        """Hand over what is queued, let the child export it and stop: within
        ``timeout_s`` and a fraction of a second (the child counts as dropped what it
        could not export by then)."""
        deadline = time.monotonic() + timeout_s
        self._closed = True
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()) * 0.5)
        # the pipe, once the sender thread's last hand-over is done with it
        if not self._conn_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            log.error("the OpenTelemetry span process did not take the last spans in time; "
                      "what it holds is lost")
            self._lost(*self._take_all())
            report_drops(self)
            return
        try:
            self._lost(*self._take_all())  # put after the sender's last round: not sent
            conn = self._conn
            if conn is not None:
                budget = max(0.1, deadline - time.monotonic() - 2 * CLOSE_MARGIN_S)
                try:
                    conn.send_bytes(_STOP + str(budget).encode())
                    if conn.poll(budget + CLOSE_MARGIN_S):
                        self.spans_out, self._dropped_there, _ = pickle.loads(
                            conn.recv_bytes())
                except (EOFError, OSError):
                    pass
                self._stop_child(timeout_s=CLOSE_MARGIN_S / 2)
        finally:
            self._conn_lock.release()
        report_drops(self)

    def _take_all(self) -> tuple[list, list, list, float]:
        """What waits for the sender thread, taken out (to be counted as lost)."""
        take = [self._traces, self._raws, self._records]
        traces, raws, records = ([q.popleft() for _ in range(len(q))] for q in take)
        self._batches.clear()
        return traces, raws, records, self._wall_offset_s

    def _stop_child(self, timeout_s: float = 2.0) -> None:
        proc, conn = self._proc, self._conn
        self._conn = None
        if conn is not None:
            stop_child(proc, conn, _STOP, timeout_s=timeout_s)
