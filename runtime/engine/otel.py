"""OpenTelemetry export of traced requests' spans over OTLP: the span thread, the SDK's
batch processor and the exporter.

``batchscope serve --otlp-traces-endpoint URL`` turns it on. Each traced request (see
``runtime.engine.tracing``: 1 in ``trace_rate``, or any request whose caller sent a
sampled W3C ``traceparent``) becomes a request span with ``queue`` and ``compute``
children, linked to its batch's span (``runtime.engine.otel_spans`` says what each span
is and holds, and builds them).

Off the request path: the event loop only takes the request span's ids when the trace
begins (so the answer can carry its ``traceparent``; drawn in blocks,
``otel_spans.SpanIds``) and appends the finished trace to a bounded queue; a thread of
this module builds the spans (``ReadableSpan`` objects with the recorded times and ids)
and hands them to the SDK's ``BatchSpanProcessor``, which exports them from its own
thread. While the processor's queue is full the span thread waits for its exporter to
take a batch (a burst of traces is spread over the export rather than dropped), and the
traces wait in this module's queue; spans are dropped only when that queue is full too,
or when the exporter has taken nothing for ``ROOM_WAIT_S`` (an endpoint that does not
answer: from then on, until the processor has room again, each trace that does not fit
is dropped at once). The spans of an export that failed (the collector down, refusing,
past its timeout) are lost too, and so are those left unexported when ``close`` runs
out of time. All are counted (``dropped``) and reported as a ``trace_export_drops``
event.

The exporter follows the standard variables (checked at start,
``runtime.engine.otel_config``): ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (or
``OTEL_EXPORTER_OTLP_PROTOCOL``): ``grpc`` (the default) or ``http/protobuf``; headers,
timeouts, compression and TLS from ``OTEL_EXPORTER_OTLP_*``; the processor's queue and
batch sizes from ``OTEL_BSP_*``; the resource from ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` (``service.name`` defaults to ``batchscope``).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

from batchscope.threadnames import name_native
from runtime.engine.otel_spans import (BATCHES_KEPT, BatchInfo, FinishedTrace, SpanBuilder,
                                       finished_from, plain_spans_of, plain_traces_of,
                                       spans_of)

log = logging.getLogger(__name__)

#: finished traces waiting for the span thread (past it they are dropped and counted):
#: about 3 s of every request traced at 10,000 requests a second, to ride out an
#: exporter's slow moments; about 400 bytes a trace, some 13 MB when full
QUEUE_MAX = 32768
#: while the processor's queue has no room for a trace's spans, the span thread looks
#: again this often, for at most ``ROOM_WAIT_S`` (then the trace is dropped and counted)
ROOM_POLL_S = 0.002
ROOM_WAIT_S = 2.0
#: how long ``close``, out of time, lets the span thread finish the trace in its hands
ABANDON_JOIN_S = 0.05
PROTOCOLS = ("grpc", "http/protobuf")


def report_drops(exporter: Any) -> None:
    """Tell ``exporter.on_drops(new, total)`` of the spans dropped since it was last told
    (``exporter.dropped`` against ``exporter.reported``). Threads that report at once
    (a sender's last round and ``close``) each tell a share, never the same one twice."""
    with _REPORTING:
        dropped = exporter.dropped
        if dropped <= exporter.reported or exporter.on_drops is None:
            return
        new = dropped - exporter.reported
        exporter.reported = dropped
    try:
        exporter.on_drops(new, dropped)
    except Exception:  # noqa: BLE001
        log.exception("could not report dropped spans")


#: held while a count of dropped spans is taken as reported
_REPORTING = threading.Lock()


class _DropCounter:
    """Stands for the processor's own metrics: counts what it drops (queue full)."""

    def __init__(self, inner: Any, on_drop: Callable[[int], None]) -> None:
        self.inner = inner
        self.on_drop = on_drop

    def register_queue_size(self, get_queue_size) -> None:
        self.inner.register_queue_size(get_queue_size)

    def drop_items(self, count: int, error_type: str = "queue_full") -> None:
        self.on_drop(count)
        self.inner.drop_items(count, error_type)

    def finish_items(self, count: int) -> None:
        self.inner.finish_items(count)


def exporter_for(endpoint: str, protocol: str | None = None) -> Any:
    """The OTLP span exporter for ``endpoint`` over ``protocol`` (default: the
    standard variables', else ``grpc``)."""
    from runtime.engine.otel_config import protocol_of

    protocol = protocol_of(protocol, os.environ)
    if protocol == "grpc":  # the SDK's exporter, its encoding ours (runtime.engine.otlp_wire)
        from runtime.engine.otlp_wire import fast_grpc_exporter
        insecure = endpoint.startswith("http://") or None
        return fast_grpc_exporter(endpoint=endpoint, insecure=insecure)
    if protocol == "http/protobuf":  # the same, over HTTP
        from runtime.engine.otlp_wire import fast_http_exporter
        if "://" in endpoint and not endpoint.rstrip("/").endswith("/v1/traces"):
            endpoint = endpoint.rstrip("/") + "/v1/traces"
        return fast_http_exporter(endpoint=endpoint)
    raise ValueError(f"OTLP protocol {protocol!r} is not supported; use one of {PROTOCOLS}")


class _CountingExporter:
    """The exporter, with the spans of every export that failed (the collector down,
    refusing or past its timeout) counted as dropped through ``on_failed``: the SDK's
    processor logs such a failure and goes on, its spans lost."""

    def __init__(self, inner: Any, on_failed: Callable[[int], None]) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._inner = inner
        self._on_failed = on_failed
        self._success = SpanExportResult.SUCCESS
        #: the spans of the export under way (the processor exports one batch at a time)
        self.in_flight = 0
        #: the spans of every export that succeeded
        self.exported = 0
        self._given_up = False
        #: an export's end and ``give_up`` each count its spans, never both
        self._lock = threading.Lock()

    def export(self, spans: Sequence[Any]) -> Any:
        n = len(spans)
        with self._lock:
            self.in_flight = n
        result = None
        try:
            result = self._inner.export(spans)
            return result
        finally:
            with self._lock:
                self.in_flight = 0
                if result == self._success:
                    self.exported += n
                elif not self._given_up:
                    self._on_failed(n)

    def give_up(self) -> int:
        """The spans of the export under way, counted as lost now (closing ran out of
        time); its failure, should it come later, is not counted again."""
        with self._lock:
            self._given_up = True
            return self.in_flight

    def __getattr__(self, name: str) -> Any:  # shutdown, force_flush, takes_wire_spans...
        return getattr(self._inner, name)


def _room_of(processor: Any) -> Callable[[], int] | None:
    """How many more spans the SDK's batch processor ``processor`` (its private
    ``_queue`` and ``_max_queue_size``) takes; None when this SDK has neither."""
    queue, bound = getattr(processor, "_queue", None), getattr(processor, "_max_queue_size", None)
    if queue is None or not isinstance(bound, int):
        return None
    return lambda: bound - len(queue)


def _emit_all(processor: Any) -> Callable[[list], None]:
    """``processor.on_end`` of each span of a list, in one step where the SDK's batch
    processor shows its queue: the spans go into the same queue, under the same bound
    (what does not fit pushes out the oldest, counted as dropped) and wake its exporting
    thread as ``emit`` does, without a Python call and an ``os.getpid`` a span (0.47 us a
    span, a third of the span thread's work). Span by span where this SDK's processor is
    made otherwise, shut down, or inherited by a forked process (``on_end`` handles
    those)."""
    on_end = processor.on_end
    inner = getattr(processor, "_batch_processor", None)
    queue = getattr(inner, "_queue", None)

    def each(spans: list) -> None:
        for span in spans:
            on_end(span)

    if type(queue) is not collections.deque or queue.maxlen is None or not all(
            hasattr(inner, name) for name in ("_shutdown", "_pid", "_metrics",
                                              "_max_export_batch_size", "_worker_awaken")):
        return each
    bound, awake = queue.maxlen, inner._worker_awaken

    def emit(spans: list) -> None:
        if inner._shutdown or inner._pid != os.getpid():
            each(spans)
            return
        over = len(queue) + len(spans) - bound
        if over > 0:
            log.warning("the span processor's queue is full: %d spans dropped", over)
            inner._metrics.drop_items(over)
        queue.extendleft(spans)
        if len(queue) >= inner._max_export_batch_size and not awake.is_set():
            awake.set()
    return emit


class OtlpSpans:
    """The span thread, the SDK's ``BatchSpanProcessor`` and the exporter (module doc)."""

    def __init__(self, endpoint: str, instance_id: str, *, protocol: str | None = None,
                 exporter: Any = None, on_drops: Callable[[int, int], None] | None = None,
                 queue_max: int = QUEUE_MAX) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        attributes = {"service.instance.id": instance_id}
        if not os.environ.get("OTEL_SERVICE_NAME"):
            attributes["service.name"] = "batchscope"
        exporter = self._exporter = _CountingExporter(
            exporter or exporter_for(endpoint, protocol), self._dropped_by_processor)
        self.builder = SpanBuilder(Resource.create(attributes), instance_id,
                                   wire=bool(getattr(exporter, "takes_wire_spans", False)))
        self.processor = BatchSpanProcessor(exporter)
        inner = getattr(self.processor, "_batch_processor", None)
        if inner is not None and hasattr(inner, "_metrics"):
            inner._metrics = _DropCounter(inner._metrics, self._dropped_by_processor)
        #: the processor's queue and its bound, when this SDK shows them: a trace that
        #: would not fit is dropped before its spans are built (building them, and the
        #: processor turning each away with a log record, cost more than sending one)
        self._room = _room_of(inner)
        self._emit = _emit_all(self.processor)
        self.endpoint = endpoint
        self.on_drops = on_drops
        #: finished traces, and batches of plain traces ``(batch, wall offset, members)``
        self.queue: collections.deque = collections.deque()
        self.queue_max = queue_max
        #: traces queued and taken by the span thread (each count written by one thread)
        self._put = 0
        self._taken = 0
        #: by (model, seq), as ``SpanBuilder.batch_spans``
        self.batches: collections.OrderedDict[tuple[str, int], BatchInfo] = \
            collections.OrderedDict()
        self.lock = threading.Lock()
        #: spans (and traces refused by our queue) lost, and spans handed to the processor
        self.dropped = 0
        self._count_lock = threading.Lock()
        #: set once ``close`` has run out of time: what the span thread still takes is
        #: counted as dropped rather than handed to a processor nothing exports any more
        self._abandoned = False
        self.reported = 0
        self.spans_out = 0
        #: of ``dropped``, the spans handed to the processor and lost there (pushed out of
        #: its full queue, or in an export that failed)
        self._lost_handed = 0
        self._wake = threading.Event()
        #: set once closing has waited its time: ends a wait for room at once
        self._room_wake = threading.Event()
        #: a wait for room ran out (the collector takes nothing): until room comes back,
        #: what does not fit is dropped at once, not after a wait of its own
        self._stalled = False
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="otlp-spans", daemon=True)
        self._thread.start()

    # -- on the event loop --------------------------------------------------------------
    def batch(self, info: BatchInfo) -> None:
        """Remember a batch that has a traced member (its span is made with the first)."""
        with self.lock:
            self.batches[(info.model, info.seq)] = info
            while len(self.batches) > BATCHES_KEPT:
                self.batches.popitem(last=False)

    def put(self, trace: FinishedTrace) -> None:
        """Queue a finished trace for its spans; dropped (and counted) when full."""
        if self._put - self._taken >= self.queue_max:
            self._count(spans_of(trace))
            return
        self.queue.append(trace)
        self._put += 1
        if len(self.queue) == 1:
            self._wake.set()

    def put_raw(self, raw: tuple, wall_offset_s: float) -> None:
        """``put`` of a raw trace (``finished_from``)."""
        self.put(finished_from(raw, wall_offset_s))

    def put_plain(self, batch: tuple, wall_offset_s: float) -> None:
        """Queue the members with spans of a batch of plain traces (as
        ``otel_spans.plain_finished`` takes it) as one entry: the span thread writes their
        spans together (``SpanBuilder.plain_spans``). They are queued, or dropped and
        counted, together."""
        members = plain_traces_of(batch)
        if not members:
            return
        if self._put - self._taken + members > self.queue_max:
            self._count(plain_spans_of(batch))
            return
        self.queue.append((batch, wall_offset_s, members))
        self._put += members
        if len(self.queue) == 1:
            self._wake.set()

    def put_traces(self, record: Any) -> None:
        """``put_plain`` of each batch of plain traces of a ``TraceBatch`` (its other
        traces come through ``put_raw``)."""
        for batch in record.batches:
            self.put_plain(batch, record.wall_offset_s)

    # -- the span thread ----------------------------------------------------------------
    def _dropped_by_processor(self, count: int) -> None:
        with self._count_lock:
            self.dropped += count
            self._lost_handed += count

    def holding(self) -> int:
        """What this exporter holds that is neither exported nor counted dropped: the
        traces waiting for the span thread, and the spans handed to the processor that
        it has not exported or lost yet (0: every count is final until more comes). Read
        in this order, a span is never seen settled before it is: ``spans_out`` counts
        a span before the processor gets it."""
        settled = self._exporter.exported + self._lost_handed
        return (self._put - self._taken) + max(0, self.spans_out - settled)

    def _count(self, spans: int) -> None:
        """Count ``spans`` as dropped: from the event loop's thread, the span thread, the
        processor's exporting thread and ``close`` alike (one lock: no count lost)."""
        with self._count_lock:
            self.dropped += spans

    def _work(self) -> None:
        name_native()
        while True:
            self._wake.wait(0.5)
            self._wake.clear()
            self._drain()
            self._report()
            if self._closed and not self.queue:
                return

    def _drain(self) -> None:
        room = self._room
        builder, emit = self.builder, self._emit
        while self.queue:
            t = self.queue.popleft()
            if type(t) is tuple:  # a batch of plain traces (``put_plain``)
                plain, offset, members = t
                self._taken += members
                with self.lock:
                    batch = self.batches.get((plain[0], plain[3]))
                wanted = room is not None and builder.plain_count(plain, batch)
            else:
                self._taken += 1
                with self.lock:
                    batch = self.batches.get((t.model, t.batch_seq)) \
                        if t.batch_seq is not None else None
                wanted = room is not None and builder.count(t, batch)
            if self._abandoned:
                self._count(plain_spans_of(plain) if type(t) is tuple else spans_of(t))
                continue
            if wanted:
                if room() < wanted:
                    if not self._wait_for_room(room, wanted):
                        self._count(wanted)
                        continue
                else:
                    self._stalled = False  # room again: the next wait is a wait
            try:
                spans = builder.plain_spans(plain, offset, batch) if type(t) is tuple \
                    else builder.spans(t, batch)
                self.spans_out += len(spans)  # before the processor has them (``holding``)
                emit(spans)
            except Exception:  # noqa: BLE001 - a bad trace must not stop the exporter
                log.exception("could not build the spans of a trace")

    def _wait_for_room(self, room: Callable[[], int], wanted: int) -> bool:
        """Wait until the processor's queue takes ``wanted`` more spans: False when it
        has not within ``ROOM_WAIT_S``, or once ``close`` has waited its time."""
        waited = 0.0
        while room() < wanted:
            if self._stalled or self._room_wake.is_set() or waited >= ROOM_WAIT_S:
                self._stalled = True
                return False
            self._room_wake.wait(ROOM_POLL_S)
            waited += ROOM_POLL_S
        self._stalled = False
        return True

    def backlog(self) -> float:
        """How full the span thread's queue is, 0..1 (the span process's priority
        follows it)."""
        return (self._put - self._taken) / self.queue_max

    def _report(self) -> None:
        report_drops(self)

    def close(self, timeout_s: float = 5.0) -> None:
        """Build what is queued and export it, then stop: all within ``timeout_s`` (the
        SDK's flush and shutdown wait on an export as long as the exporter's own timeout
        and retries, so they run on a thread of their own, waited for until then). What
        is left unexported then is counted as dropped."""
        deadline = time.monotonic() + timeout_s
        self._closed = True
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        self._room_wake.set()
        processor = self.processor

        def finish() -> None:
            try:
                processor.force_flush(max(1, int((deadline - time.monotonic()) * 1000)))
            finally:
                processor.shutdown()

        ender = threading.Thread(target=finish, name="otlp-spans-close", daemon=True)
        ender.start()
        ender.join(max(0.0, deadline - time.monotonic()))
        if ender.is_alive() or self._thread.is_alive():  # out of time: count what is left
            self._abandoned = True  # the span thread counts what it still takes
            self._thread.join(ABANDON_JOIN_S)  # and finishes the trace in hand, if it can
            self._count(self._exporter.give_up() + self._left_unexported())
        self._report()

    def _left_unexported(self) -> int:
        """The spans still waiting in the processor's queue and the traces' spans still in
        this one (counted once: each is taken out as it is counted)."""
        left = 0
        inner = getattr(self.processor, "_batch_processor", None)
        queue = getattr(inner, "_queue", None)
        if isinstance(queue, collections.deque):
            while queue:
                try:
                    queue.pop()
                except IndexError:  # taken by the exporting thread meanwhile
                    break
                left += 1
        while self.queue:
            try:
                t = self.queue.popleft()
            except IndexError:
                break
            left += plain_spans_of(t[0]) if type(t) is tuple else spans_of(t)
        return left
