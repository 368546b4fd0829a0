"""What the spans of a traced request and its batch are, built from the recorded times.

``runtime.engine.otel`` sends them; this module says what they are. Each traced request
becomes:

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

The event loop only takes a request span's ids when its trace begins (``SpanIds``, drawn
in blocks, so that the answer can carry its ``traceparent``); the spans are built on the
span thread (``SpanBuilder``), from what the serving process handed over
(``finished_from``, ``plain_finished``). ``spans_of`` and ``plain_spans_of`` count the
spans a trace makes without making them, for the drop counts (the serving process's
span sender, ``runtime.engine.otel_process``, counts what it drops with them too).
"""

from __future__ import annotations

import binascii
import collections
import os
import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from batchscope.storage.records import TRACE_FIELDS, wall_times
from runtime.core.tracing import (PLAIN_REQUEST_START, PLAIN_SPAN, SPAN_ID_AT, TRACE_ID_AT,
                                  span_ids, span_line)

#: span ids drawn at once (``SpanIds``): some 100 kB of lines
SPAN_ID_BLOCK = 1024
#: the batches whose span ids are remembered for their traced members (newest kept)
BATCHES_KEPT = 4096


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

    def __init__(self, resource: Any, instance_id: str, *, wire: bool = False,
                 ids: random.Random | None = None) -> None:
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
        #: draws the ids of the spans made here (batch spans, ``queue`` and ``compute``): a
        #: generator of its own (``ids``: one seeded, for a test), so that no other thread
        #: drawing from the ``random`` module changes which ids a builder makes
        self._bits = (ids if ids is not None else random.Random()).getrandbits
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
        ids = (self._bits(128) or 1, self._bits(64) or 1)
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
            out.append(self._span(name, t.trace_id, self._bits(64) or 1, t.span_id,
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
            ow, rand, wire_span = self._ow, self._bits, self._wire_span
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
            out.append(wire_span(child(tid, self._bits(64) or 1, mine, self._queue_name,
                                       _ns(queued), _ns(max(z, queued))), resource, scope))
        if started is not None:
            z = ended if ended is not None else end
            out.append(wire_span(child(tid, self._bits(64) or 1, mine,
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
