"""OpenTelemetry spans of traced requests and their batches, sent over OTLP.

``batchscope serve --otlp-traces-endpoint URL`` turns it on. Each traced request (see
``runtime.engine.tracing``: 1 in ``trace_rate``, or any request whose caller sent a
sampled W3C ``traceparent``) becomes:

* a ``SERVER`` span ``infer <model>`` (``<operation> <model>`` on the OpenAI routes)
  from the request's first byte to its answer's last, child of the caller's span when
  a ``traceparent`` came (so it joins the caller's trace), else the root of a new trace;
* under it a ``queue`` span (queued until its batch started) and a ``compute`` span
  (the batch's run; for a generation request ``prefill`` until its first token, then
  ``decode`` when a choice decoded tokens past its first, from the first token of such a
  choice to the end of the last; ``prefill`` alone when it ended before its first
  token);
* a link to the span of the batch it ran in: one ``INTERNAL`` span ``batch <model>``
  per batch with a traced member, in a trace of its own (a batch serves many traces),
  with ``batchscope.batch.*`` attributes; a generation request's is ``step <model>``,
  the engine step it was first scheduled in (``BatchInfo`` with its prefill and decode
  tokens). Batches are told apart by (model, number): a generation model numbers its
  steps on its own.

Attributes follow the GenAI semantic conventions where they apply
(``gen_ai.operation.name``, ``gen_ai.request.model``, ``gen_ai.usage.*``,
``gen_ai.response.finish_reasons``) and vLLM's latency names
(``gen_ai.latency.time_in_queue``, ``time_to_first_token``, ``e2e``), in seconds.

Off the request path: the event loop only takes the request span's ids when the trace
begins (so the answer can carry its ``traceparent``; drawn in blocks, ``SpanIds``) and
appends the finished trace to a bounded queue; a thread of this module builds the spans
(``ReadableSpan`` objects with the recorded times and ids) and hands them to the SDK's
``BatchSpanProcessor``, which exports them from its own thread. While the processor's
queue is full the span thread waits for its exporter to take a batch (a burst of traces
is spread over the export rather than dropped), and the traces wait in this module's
queue; spans are dropped only when that queue is full too, or when the exporter has
taken nothing for ``ROOM_WAIT_S`` (an endpoint that does not answer: from then on, until
the processor has room again, each trace that does not fit is dropped at once). The
spans of an export that failed (the collector down, refusing, past its timeout) are
lost too, and so are those left unexported when ``close`` runs out of time. All are
counted (``dropped``) and reported as a ``trace_export_drops`` event.

The exporter follows the standard variables (checked at start,
``runtime.engine.otel_config``): ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`` (or
``OTEL_EXPORTER_OTLP_PROTOCOL``): ``grpc`` (the default) or ``http/protobuf``; headers,
timeouts, compression and TLS from ``OTEL_EXPORTER_OTLP_*``; the processor's queue and
batch sizes from ``OTEL_BSP_*``; the resource from ``OTEL_SERVICE_NAME`` and
``OTEL_RESOURCE_ATTRIBUTES`` (``service.name`` defaults to ``batchscope``).
"""

from __future__ import annotations

import binascii
import collections
import logging
import os
import random
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from batchscope.storage.records import TRACE_FIELDS, wall_times
from batchscope.threadnames import name_native
from runtime.core.tracing import (PLAIN_REQUEST_START, PLAIN_SPAN, SPAN_ID_AT, TRACE_ID_AT,
                                  span_ids, span_line)

log = logging.getLogger(__name__)

#: finished traces waiting for the span thread (past it they are dropped and counted):
#: about 3 s of every request traced at 10,000 requests a second, to ride out an
#: exporter's slow moments; about 400 bytes a trace, some 13 MB when full
QUEUE_MAX = 32768
#: span ids drawn at once (``SpanIds``): some 100 kB of lines
SPAN_ID_BLOCK = 1024
#: the batches remembered for the spans of their traced members (newest kept)
BATCHES_KEPT = 4096
#: while the processor's queue has no room for a trace's spans, the span thread looks
#: again this often, for at most ``ROOM_WAIT_S`` (then the trace is dropped and counted)
ROOM_POLL_S = 0.002
ROOM_WAIT_S = 2.0
#: how long ``close``, out of time, lets the span thread finish the trace in its hands
ABANDON_JOIN_S = 0.05
PROTOCOLS = ("grpc", "http/protobuf")


class SpanIds:
    """The ids of request spans, drawn in blocks, each span held as its answer's
    ``traceparent`` header line (``runtime.core.tracing.span_line``).

    A traced request's answer carries its span's ``traceparent``, so the ids are drawn
    when the trace begins, on the event loop. Drawn one by one (two random integers,
    then written in hex into the header) they cost that thread about as much as the
    rest of the trace; here ``block`` of them are drawn at once from the operating
    system's random source, written into their lines with numpy, and each trace takes
    the next line from ``ready`` (``line``: a list pop). A trace id or span id of all
    zeros, which W3C Trace Context calls invalid, is made non-zero."""

    def __init__(self, block: int = SPAN_ID_BLOCK,
                 urandom: Callable[[int], bytes] = os.urandom) -> None:
        if block < 1:
            raise ValueError(f"block={block!r} must be at least 1")
        self.block = block
        self._urandom = urandom
        #: lines drawn and not yet taken (the fast path pops from it itself)
        self.ready: list[bytes] = []

    def line(self) -> bytes:
        """The next span's line: a new trace id and span id."""
        ready = self.ready
        return ready.pop() if ready else self.refill()

    def child_of(self, w3c_trace_id: str | None) -> bytes:
        """The line of a span in the caller's trace ``w3c_trace_id`` (32 hex digits, as
        ``parse_traceparent`` gives it), with a new span id; None: a trace of its own."""
        line = self.line()
        if not w3c_trace_id:
            return line
        return b"traceparent: 00-" + w3c_trace_id.encode() + line[48:]

    def refill(self) -> bytes:
        """Draw a block into ``ready`` and take its first line."""
        n = self.block
        raw = np.frombuffer(bytearray(self._urandom(24 * n)), np.uint8).reshape(n, 24)
        raw[~raw[:, :16].any(axis=1), 15] = 1  # all zeros names no trace (W3C)
        raw[~raw[:, 16:].any(axis=1), 23] = 1  # nor span
        hexed = np.frombuffer(raw.tobytes().hex().encode(), np.uint8).reshape(n, 48)
        lines = np.empty((n, len(_LINE)), np.uint8)
        lines[:] = _LINE
        lines[:, 16:48] = hexed[:, :32]
        lines[:, 49:65] = hexed[:, 32:]
        self.ready[:] = lines.view(f"S{len(_LINE)}").ravel().tolist()
        return self.ready.pop()


#: a span's line with its ids left at zero, what ``SpanIds`` writes them into
_LINE = np.frombuffer(span_line(0, 0), np.uint8)


@dataclass(slots=True)
class BatchInfo:
    """What a batch span says: wall-clock times and the batch's shape and settings."""

    seq: int
    model: str
    started_at: float
    ended_at: float
    size: int
    max_batch_size: int
    padded_elements: int
    real_elements: int
    bucket: int | None
    policy: str
    settings_version: int
    outcome: str
    #: a generation step's (its span is ``step <model>``): the prompt tokens it computed
    #: and the tokens it decoded (None: a request model's batch)
    prefill_tokens: int | None = None
    decode_tokens: int | None = None


@dataclass(slots=True)
class FinishedTrace:
    """One traced request, in wall-clock seconds, as the span thread needs it."""

    model: str
    operation: str
    trace_id: int
    span_id: int
    parent_span_id: int | None
    start_at: float
    end_at: float
    queue_start_at: float | None
    compute_start_at: float | None
    compute_end_at: float | None
    outcome: str
    batch_seq: int | None
    request_id: str | None = None
    first_token_at: float | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    finish_reasons: tuple[str, ...] = ()
    #: a generation request's decoding: from the first token of a choice that decoded
    #: tokens past its first to the end of the last such choice (None: none did; the end
    #: None: not seen, the compute's end stands for it)
    decode_start_at: float | None = None
    decode_end_at: float | None = None


#: the length of a ``RawTrace``'s first member (``TRACE_FIELDS``): 8 values, 11 times
_FIELDS = len(TRACE_FIELDS)


def finished_from(raw: tuple, wall_offset_s: float) -> FinishedTrace:
    """The ``FinishedTrace`` of a raw trace, as the serving process hands it over without
    converting anything: ``(fields, span, operation, first token, input tokens, output
    tokens, finish reasons, decode)``, ``span`` its ids as their ``traceparent`` line
    (``runtime.core.tracing.span_line``), ``fields`` the trace's row values in
    ``TRACE_FIELDS`` order with monotonic times (``RequestTrace``), ``decode`` None or
    (start, end or None) of a generation request's decoding, ``wall_offset_s`` what turns
    them into wall-clock seconds."""
    fields, span, operation, first, in_tokens, out_tokens, reasons, decode = raw
    trace_id, span_id = span_ids(span)
    (_, model, _, outcome, request_id, batch_seq, _, w3c_parent) = fields[:8]
    at = wall_times(fields[8:_FIELDS], wall_offset_s)
    start = at[0] if at[0] is not None else at[2]
    end = next((t for t in (at[10], at[9], at[8]) if t is not None), start)
    return FinishedTrace(model, operation, trace_id, span_id,
                         int(w3c_parent, 16) if w3c_parent else None, start, end,
                         at[3], at[4], at[7], outcome or "error", batch_seq, request_id,
                         first_token_at=None if first is None else first + wall_offset_s,
                         input_tokens=in_tokens, output_tokens=out_tokens,
                         finish_reasons=reasons,
                         decode_start_at=None if decode is None else decode[0] + wall_offset_s,
                         decode_end_at=None if decode is None or decode[1] is None
                         else decode[1] + wall_offset_s)


def plain_finished(batch: tuple, wall_offset_s: float) -> list[FinishedTrace]:
    """The ``FinishedTrace`` of each member with spans of a batch of plain traces, as the
    engine's booking hands it over: a ``PLAIN_BATCH_FIELDS`` tuple of
    ``batchscope.storage.records`` (what the members share, held once, then the members,
    each a ``PLAIN_MEMBER_FIELDS`` sequence whose ``span`` is its ids' line, or None
    where its spans are not exported). ``wall_offset_s``: what turns its monotonic
    times into wall-clock seconds. Each is ``finished_from`` of the raw trace the member
    stands for (a member's queue starts at its request's start)."""
    model, protocol, outcome, seq, started, input_end, output_start, ended, end, members = batch
    return [finished_from(((trace_id, model, protocol, outcome, request_id, seq, None, None,
                            recv_start, recv_end, start, start, started, input_end,
                            output_start, ended, end, send_start, send_end), span, "infer",
                           None, None, None, (), None), wall_offset_s)
            for trace_id, request_id, recv_start, recv_end, start, send_start, send_end, span,
            *_ in members if span is not None]


def _ns(t: float) -> int:
    """Wall-clock seconds as nanoseconds. Truncated, not rounded (half the cost): a float
    of today's epoch seconds resolves about 240 ns anyway."""
    return int(t * 1e9)


class SpanBuilder:
    """Spans of finished traces (``spans``); remembers which batch spans it made.

    With ``wire`` the spans are ``runtime.engine.otlp_wire.WireSpan``s, each written as
    its OTLP message at once (for the gRPC exporter of ``otlp_wire``, which sends them as
    they are); else the SDK's ``ReadableSpan``s (any exporter)."""

    def __init__(self, resource: Any, instance_id: str, *, wire: bool = False) -> None:
        from opentelemetry import trace as api
        from opentelemetry.sdk.trace import ReadableSpan
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        #: the SDK's types, looked up once (the module imports no OpenTelemetry itself)
        self._api, self._readable = api, ReadableSpan
        self._ok, self._error = api.Status(api.StatusCode.UNSET), api.Status(api.StatusCode.ERROR)
        self._sampled = api.TraceFlags(api.TraceFlags.SAMPLED)
        self._internal, self._server = api.SpanKind.INTERNAL, api.SpanKind.SERVER
        #: each kind's value, read once (an enum's ``value`` is a property)
        self._kinds = {kind: kind.value for kind in api.SpanKind}
        self.resource = resource
        self.instance_id = instance_id
        self.scope = InstrumentationScope("batchscope.runtime")
        self.wire = wire
        if wire:
            from runtime.engine import otlp_wire
            self._wire_span, self._wire = otlp_wire.WireSpan, otlp_wire.wire_span
            self._ow = otlp_wire
            #: written once: the two latency attributes up to their values, the children's
            #: names
            self._e2e = otlp_wire.double_head("gen_ai.latency.e2e")
            self._in_queue = otlp_wire.double_head("gen_ai.latency.time_in_queue")
            self._queue_name = otlp_wire.name_field("queue")
            self._compute_name = otlp_wire.name_field("compute")
            #: what repeats between spans, written once: (operation, model) -> the request
            #: span's name and its attributes; outcome -> its attributes; a batch's seq ->
            #: (its link, its members' batch attributes, the ``BatchInfo`` and batch span
            #: ids they were written from)
            self._heads: dict[tuple[str, str], tuple[bytes, bytes]] = {}
            self._outcomes: dict[str, bytes] = {}
            self._blocks: collections.OrderedDict[tuple[str, int], tuple] = \
                collections.OrderedDict()
        #: seq -> (trace id, span id) of the batch's span, for batches whose span was made
        #: by (model, seq): a generation model's steps are numbered apart from the batches
        self.batch_spans: collections.OrderedDict[tuple[str, int], tuple[int, int]] = \
            collections.OrderedDict()

    def _span(self, name: str, trace_id: int, span_id: int, parent_id: int | None,
              parent_remote: bool, start: float, end: float, *, kind: Any = None,
              attributes: dict | None = None, links: tuple = (), error: bool = False):
        """One span; ``links``: (trace id, span id, attributes) of local spans."""
        kind = kind or self._internal
        start_ns, end_ns = _ns(start), _ns(max(end, start))
        if self.wire:
            return self._wire_span(self._wire(name, trace_id, span_id, parent_id,
                                              parent_remote, self._kinds[kind], start_ns, end_ns,
                                              attributes, links, error),
                                   self.resource, self.scope)
        api = self._api
        parent = None if parent_id is None else self._context(trace_id, parent_id,
                                                              parent_remote)
        return self._readable(
            name, context=self._context(trace_id, span_id), parent=parent,
            resource=self.resource, attributes=attributes or {},
            links=[api.Link(self._context(t, s), a) for t, s, a in links], kind=kind,
            status=self._error if error else self._ok, start_time=start_ns,
            end_time=end_ns, instrumentation_scope=self.scope)

    def _context(self, trace_id: int, span_id: int, remote: bool = False):
        return self._api.SpanContext(trace_id, span_id, is_remote=remote,
                                     trace_flags=self._sampled)

    def batch_span(self, b: BatchInfo) -> tuple[Any, tuple[int, int]]:
        """(the span, its (trace id, span id)) of batch ``b``."""
        ids = (random.getrandbits(128) or 1, random.getrandbits(64) or 1)
        step = b.prefill_tokens is not None
        extra = {"batchscope.step.prefill_tokens": b.prefill_tokens,
                 "batchscope.step.decode_tokens": b.decode_tokens} if step else {}
        span = self._span(f"{'step' if step else 'batch'} {b.model}", *ids, None, False,
                          b.started_at, b.ended_at, attributes={**extra,
                              "batchscope.batch.id": b.seq, "batchscope.batch.size": b.size,
                              "batchscope.batch.max_size": b.max_batch_size,
                              "batchscope.batch.padded_size": b.padded_elements,
                              "batchscope.batch.real_size": b.real_elements,
                              "batchscope.batch.bucket": -2 if b.bucket is None else b.bucket,
                              "batchscope.batch.policy": b.policy,
                              "batchscope.batch.settings_version": b.settings_version,
                              "batchscope.batch.outcome": b.outcome,
                              "batchscope.instance.id": self.instance_id,
                              "gen_ai.request.model": b.model},
                          error=b.outcome != "ok")
        return span, ids

    def spans(self, t: FinishedTrace, batch: BatchInfo | None) -> list:
        """The spans of one finished trace: its batch's (the first time), the request's
        and its children's."""
        if self.wire and t.first_token_at is None and t.input_tokens is None \
                and t.output_tokens is None and not t.finish_reasons:
            return self._wire_spans(t, batch)
        out = []
        links: tuple = ()
        if batch is not None:
            ids = self._batch_ids(batch, out)
            links = ((*ids, {"batchscope.batch.id": batch.seq}),)
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": t.operation, "gen_ai.request.model": t.model,
            "gen_ai.latency.e2e": t.end_at - t.start_at,
            "batchscope.request.outcome": t.outcome,
            "batchscope.instance.id": self.instance_id}
        if t.request_id:
            attributes["batchscope.request.id"] = t.request_id
        if t.queue_start_at is not None and t.compute_start_at is not None:
            attributes["gen_ai.latency.time_in_queue"] = t.compute_start_at - t.queue_start_at
        if t.first_token_at is not None:
            attributes["gen_ai.latency.time_to_first_token"] = t.first_token_at - t.start_at
        if t.input_tokens is not None:
            attributes["gen_ai.usage.input_tokens"] = t.input_tokens
        if t.output_tokens is not None:
            attributes["gen_ai.usage.output_tokens"] = t.output_tokens
        if t.finish_reasons:
            attributes["gen_ai.response.finish_reasons"] = list(t.finish_reasons)
        if batch is not None:
            attributes.update({"batchscope.batch.id": batch.seq,
                               "batchscope.batch.size": batch.size,
                               "batchscope.batch.padded_size": batch.padded_elements,
                               "batchscope.batch.bucket": -2 if batch.bucket is None
                               else batch.bucket,
                               "batchscope.batch.policy": batch.policy,
                               "batchscope.batch.settings_version": batch.settings_version})
        failed = t.outcome != "ok"
        out.append(self._span(f"{t.operation} {t.model}", t.trace_id, t.span_id,
                              t.parent_span_id, t.parent_span_id is not None, t.start_at,
                              t.end_at, kind=self._server, attributes=attributes, links=links,
                              error=failed))
        for name, a, z in self._phases(t):
            out.append(self._span(name, t.trace_id, random.getrandbits(64) or 1, t.span_id,
                                  False, a, z))
        return out

    def _wire_spans(self, t: FinishedTrace, batch: BatchInfo | None) -> list:
        """``spans`` of a request model's trace written straight as ``WireSpan``s, the
        same bytes: what repeats (the constant attributes, a batch's attributes and its
        link) is written once and joined; the children share the request's id bytes."""
        out: list = []
        links, battrs = self._batch_blocks(batch, out) if batch is not None else (b"", b"")
        self._wire_request(out, t.trace_id.to_bytes(16, "big"), t.span_id.to_bytes(8, "big"),
                           t.parent_span_id, self._named(t.operation, t.model),
                           self._outcome_block(t.outcome), t.outcome != "ok", t.start_at,
                           t.end_at, t.request_id, t.queue_start_at, t.compute_start_at,
                           t.compute_end_at, links, battrs)
        return out

    def plain_spans(self, batch: tuple, wall_offset_s: float, info: BatchInfo | None) -> list:
        """The spans of the members with spans of a batch of plain traces (as
        ``plain_finished`` takes it), in order: for each, ``spans(t, info)`` of its
        ``FinishedTrace`` ``t``, the same spans (the same bytes, random ids drawn in the same
        order). Written straight from the members where spans are written at once
        (``wire``), without making their ``FinishedTrace``s; what the members share (the
        batch's times and blocks, the name, the outcome) is read once."""
        if not self.wire:
            return [span for t in plain_finished(batch, wall_offset_s)
                    for span in self.spans(t, info)]
        model, _, outcome, _, started, input_end, output_start, ended, end, members = batch
        out: list = []
        links, battrs = self._batch_blocks(info, out) if info is not None else (b"", b"")
        outcome = outcome or "error"
        named, block = self._named("infer", model), self._outcome_block(outcome)
        failed = outcome != "ok"
        request, unhex = self._wire_request, binascii.unhexlify
        shared = self._shared_times(batch) if started is not None and ended is not None \
            else None
        if shared is not None:  # the common batch: its members' spans joined from parts
            ow, rand, wire_span = self._ow, random.getrandbits, self._wire_span
            resource, scope, pack, pack64 = self.resource, self.scope, ow.pack_double, \
                ow.pack_fixed64
            id_head, span_head, parent_head = ow.ID_HEAD, ow.SPAN_HEAD, ow.PARENT_HEAD
            last, started_w, server_head, attrs_head, server_end, queue_head, queue_end, \
                compute_parts = self._batch_parts(shared, wall_offset_s, named, links, battrs,
                                                  failed)
            in_queue = self._in_queue
        for _, request_id, recv_start, recv_end, start, send_start, send_end, span, *_ in members:
            if span is None:
                continue
            if shared is not None and recv_start is not None and recv_end is not None \
                    and send_start is not None and send_end is not None \
                    and recv_start <= recv_end <= start <= started \
                    and last <= send_start <= send_end:
                # nothing of this member's to put in order (``wall_times``): its times are
                # as recorded, its batch's shared; the same bytes as ``_wire_request``'s
                begin, finish, queued = (recv_start + wall_offset_s, send_end + wall_offset_s,
                                         start + wall_offset_s)
                begin_ns, finish_ns = int(begin * 1e9), int(finish * 1e9)
                if begin_ns and finish_ns:
                    tid, mine = unhex(span[TRACE_ID_AT]), unhex(span[SPAN_ID_AT])
                    out.append(wire_span(b"".join((
                        id_head, tid, span_head, mine, server_head, pack64(begin_ns), ow.END_HEAD,
                        pack64(finish_ns), attrs_head, pack(finish - begin), block,
                        ow.attributes_block({"batchscope.request.id": request_id})
                        if request_id else b"", in_queue, pack(started_w - queued),
                        server_end)), resource, scope))
                    out.append(wire_span(b"".join((
                        id_head, tid, span_head, (rand(64) or 1).to_bytes(8, "big"), parent_head,
                        mine, queue_head, pack64(int(queued * 1e9)), queue_end)), resource, scope))
                    out.append(wire_span(b"".join((
                        id_head, tid, span_head, (rand(64) or 1).to_bytes(8, "big"), parent_head,
                        mine, compute_parts)), resource, scope))
                    continue
            at = wall_times((recv_start, recv_end, start, start, started, input_end,
                             output_start, ended, end, send_start, send_end), wall_offset_s)
            begin = at[0] if at[0] is not None else at[2]
            finish = at[10]
            if finish is None:
                finish = at[9] if at[9] is not None else at[8] if at[8] is not None else begin
            request(out, unhex(span[TRACE_ID_AT]), unhex(span[SPAN_ID_AT]), None, named,
                    block, failed, begin, finish, request_id, at[3], at[4], at[7], links,
                    battrs)
        return out

    @staticmethod
    def _shared_times(batch: tuple) -> tuple[list, float] | None:
        """The times a batch of plain traces gives all its members (compute start, inputs
        ready, outputs taken, compute end, answered), each put no earlier than the one
        before (``wall_times``, offset 0), and the last of them."""
        shared = wall_times(batch[4:9], 0.0)
        last = next(t for t in reversed(shared) if t is not None)
        return shared, last

    def _batch_parts(self, shared: tuple[list, float], offset_s: float, named: tuple,
                     links: bytes, battrs: bytes, failed: bool) -> tuple:
        """What ``plain_spans`` writes once a batch for its members whose times need no
        putting in order: (the shared times' last, monotonic; the compute start, wall
        clock; the parts of the request span before its start,
        its attributes before ``e2e``'s value and what follows its attributes; the
        ``queue`` span's parts before its start and after it; the ``compute`` span's
        after its parent)."""
        ow = self._ow
        times, last = shared
        started_w, ended_w = times[0] + offset_s, times[3] + offset_s
        started_b = ow.pack_fixed64(int(started_w * 1e9))
        return (last, started_w, ow.server_head(named[0]), named[1] + self._e2e,
                battrs + ow.server_end(links, failed), ow.child_head(self._queue_name),
                ow.END_HEAD + started_b + ow.CHILD_END,
                ow.child_head(self._compute_name) + started_b + ow.END_HEAD
                + ow.pack_fixed64(int(ended_w * 1e9)) + ow.CHILD_END)

    def _batch_blocks(self, batch: BatchInfo, out: list) -> tuple[bytes, bytes]:
        """(the link to ``batch``'s span, its members' batch attributes), written once a
        batch; the batch's span is appended to ``out`` when it is made (its first member)."""
        ow = self._ow
        seq = batch.seq
        key = (batch.model, seq)
        ids = self._batch_ids(batch, out)
        held = self._blocks.get(key)
        if held is None or held[2] is not batch or held[3] != ids:
            held = (ow.link_block(*ids, {"batchscope.batch.id": seq}), ow.attributes_block({
                "batchscope.batch.id": seq, "batchscope.batch.size": batch.size,
                "batchscope.batch.padded_size": batch.padded_elements,
                "batchscope.batch.bucket": -2 if batch.bucket is None else batch.bucket,
                "batchscope.batch.policy": batch.policy,
                "batchscope.batch.settings_version": batch.settings_version}), batch, ids)
            self._blocks[key] = held
            while len(self._blocks) > BATCHES_KEPT:
                self._blocks.popitem(last=False)
        return held[0], held[1]

    def _batch_ids(self, batch: BatchInfo, out: list) -> tuple[int, int]:
        """(trace id, span id) of ``batch``'s span, which is made and appended to ``out``
        the first time (the newest ``BATCHES_KEPT`` batches' ids are kept)."""
        key = (batch.model, batch.seq)
        ids = self.batch_spans.get(key)
        if ids is None:
            span, ids = self.batch_span(batch)
            out.append(span)
            self.batch_spans[key] = ids
            while len(self.batch_spans) > BATCHES_KEPT:
                self.batch_spans.popitem(last=False)
        return ids

    def _named(self, operation: str, model: str) -> tuple[bytes, bytes]:
        """A request span's name field and its constant attributes, written once."""
        named = self._heads.get((operation, model))
        if named is None:
            ow = self._ow
            named = self._heads[(operation, model)] = (
                ow.name_field(f"{operation} {model}"), ow.attributes_block(
                    {"gen_ai.operation.name": operation, "gen_ai.request.model": model}))
        return named

    def _outcome_block(self, outcome: str) -> bytes:
        """A request span's attributes that follow its outcome, written once."""
        block = self._outcomes.get(outcome)
        if block is None:
            block = self._outcomes[outcome] = self._ow.attributes_block(
                {"batchscope.request.outcome": outcome,
                 "batchscope.instance.id": self.instance_id})
        return block

    def _wire_request(self, out: list, tid: bytes, mine: bytes, parent: int | None,
                      named: tuple[bytes, bytes], outcome: bytes, failed: bool, start: float,
                      end: float, request_id: str | None, queued: float | None,
                      started: float | None, ended: float | None, links: bytes,
                      battrs: bytes) -> None:
        """Append a request span (trace id ``tid``, span id ``mine``, both as bytes) and its
        ``queue`` and ``compute`` children to ``out`` as ``WireSpan``s; ``outcome`` its
        ``_outcome_block``, ``failed`` whether its status is an error."""
        ow = self._ow
        pack = ow.pack_double
        parts = [named[1], self._e2e, pack(end - start), outcome]
        if request_id:
            parts.append(ow.attributes_block({"batchscope.request.id": request_id}))
        if queued is not None and started is not None:
            parts += (self._in_queue, pack(started - queued))
        parts.append(battrs)
        wire_span, scope, resource = self._wire_span, self.scope, self.resource
        out.append(wire_span(ow.server_span(
            tid, mine, parent, parent is not None, named[0], _ns(start), _ns(max(end, start)),
            b"".join(parts), links, failed), resource, scope))
        if queued is None and started is None:
            return
        child = ow.child_span
        if queued is not None:
            z = started if started is not None else end
            out.append(wire_span(child(tid, random.getrandbits(64) or 1, mine, self._queue_name,
                                       _ns(queued), _ns(max(z, queued))), resource, scope))
        if started is not None:
            z = ended if ended is not None else end
            out.append(wire_span(child(tid, random.getrandbits(64) or 1, mine,
                                       self._compute_name, _ns(started), _ns(max(z, started))),
                                 resource, scope))

    def count(self, t: FinishedTrace, batch: BatchInfo | None) -> int:
        """How many spans ``spans(t, batch)`` would make."""
        return int(batch is not None and (batch.model, batch.seq) not in self.batch_spans) \
            + spans_of(t)

    def plain_count(self, batch: tuple, info: BatchInfo | None) -> int:
        """How many spans ``plain_spans(batch, ..., info)`` would make."""
        return int(info is not None and (info.model, info.seq) not in self.batch_spans) \
            + plain_spans_of(batch)

    @staticmethod
    def _phases(t: FinishedTrace) -> list[tuple[str, float, float]]:
        """The request span's children: ``queue``, then ``compute`` (a request model's),
        or ``prefill`` and ``decode`` (a generation request's: ``prefill`` alone when it
        ended before its first token, no ``decode`` when no choice had a token after its
        first)."""
        queued, started, ended = t.queue_start_at, t.compute_start_at, t.compute_end_at
        out = []
        if queued is not None:
            out.append(("queue", queued, started if started is not None else t.end_at))
        if started is not None:
            end = ended if ended is not None else t.end_at
            first = t.first_token_at
            if first is not None:
                out.append(("prefill", started, first))
                if _decoded(t):
                    out.append(("decode", t.decode_start_at,
                                end if t.decode_end_at is None else t.decode_end_at))
            elif t.output_tokens is not None:  # generation that ended in its prefill
                out.append(("prefill", started, end))
            else:
                out.append(("compute", started, end))
        return out


def _decoded(t: FinishedTrace) -> bool:
    """Whether a generation request that had its first token gets a ``decode`` span: one
    of its choices had tokens after its own first (``decode_start_at``, judged choice by
    choice where the request ended: totals over its choices cannot tell one choice of
    two tokens from two of one)."""
    return t.first_token_at is not None and t.decode_start_at is not None


def spans_of(t: FinishedTrace) -> int:
    """The spans of trace ``t`` itself (its batch's aside): drops are counted in spans.
    As many as ``SpanBuilder._phases`` makes, counted without making them."""
    n = 2 if t.queue_start_at is not None else 1
    if t.compute_start_at is not None:
        n += 1 + _decoded(t)
    return n


def plain_spans_of(batch: tuple) -> int:
    """``spans_of`` summed over the members with spans of a batch of plain traces (as
    ``plain_finished`` takes it; the batch's own span aside), counted from the members: a
    member's ``queue`` span starts at its request's start, its ``compute`` span at the
    batch's."""
    started = batch[4] is not None
    return sum(1 + (member[PLAIN_REQUEST_START] is not None) + started
               for member in batch[-1] if member[PLAIN_SPAN] is not None)


def plain_traces_of(batch: tuple) -> int:
    """The members with spans of a batch of plain traces."""
    return sum(member[PLAIN_SPAN] is not None for member in batch[-1])


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
                if result != self._success and not self._given_up:
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
        """Queue the members with spans of a batch of plain traces (as ``plain_finished``
        takes it) as one entry: the span thread writes their spans together
        (``SpanBuilder.plain_spans``). They are queued, or dropped and counted, together."""
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
        self._count(count)

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
                emit(spans)
                self.spans_out += len(spans)
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
