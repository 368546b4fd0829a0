"""``runtime.engine.otlp_wire`` against the SDK's own OTLP encoder: for the same spans,
the bytes parse back to an ``ExportTraceServiceRequest`` equal to ``encode_spans``'s; and
its exporter delivers both kinds of batch (its bytes, the SDK's message) to a real gRPC
``TraceService``."""

from __future__ import annotations

import random
import time

import pytest
from opentelemetry import trace as api
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from runtime.engine.otel_spans import (BatchInfo, FinishedTrace, SpanBuilder, SpanIds,
                                       plain_finished, plain_spans_of, spans_of)
from runtime.engine.otlp_wire import Unsupported, WireSpan, encode_request, fast_grpc_exporter
from tests.test_otel_export import GrpcReceiver, Received

RESOURCE = Resource.create({"service.name": "batchscope", "service.instance.id": "i-1"})
VALUES = ["text", "", "ünïcode ✓", True, False, 0, 1, -2, 127, 128, 2**63 - 1, -2**63, 0.0,
          -1.5, 3.25e-9, b"\x00\xffraw", ["a", "b"], [1, 2, 3], [True, False], [0.5], (),
          {"k": "v", "n": 3}]


def same(spans) -> None:
    mine = ExportTraceServiceRequest.FromString(encode_request(spans))
    assert mine == encode_spans(spans)


def context(rng, remote=False, state=None):
    return api.SpanContext(rng.getrandbits(128) or 1, rng.getrandbits(64) or 1,
                           is_remote=remote, trace_flags=api.TraceFlags(api.TraceFlags.SAMPLED),
                           trace_state=state)


def test_batchscope_s_own_spans_encode_as_the_sdk_encodes_them():
    builder = SpanBuilder(RESOURCE, "i-1")
    now = time.time()
    spans = []
    for i in range(200):
        batch = BatchInfo(i // 10, "mlp", now + 0.004, now + 0.009, 10, 32, 12, 10,
                          None if i % 3 else 64, "dynamic", 2, "ok" if i % 7 else "error")
        t = FinishedTrace("mlp", "infer", random.getrandbits(128), random.getrandbits(64),
                          random.getrandbits(64) if i % 2 else None, now, now + 0.01,
                          now + 0.001, now + 0.004, now + 0.009, "ok" if i % 5 else "error",
                          batch.seq, f"req-{i}" if i % 4 else None,
                          first_token_at=now + 0.006 if i % 6 == 0 else None,
                          input_tokens=i if i % 6 == 0 else None,
                          output_tokens=2 * i if i % 6 == 0 else None,
                          finish_reasons=("length",) if i % 6 == 0 else ())
        spans += builder.spans(t, batch if i % 8 else None)
    same(spans)


def test_spans_written_at_once_are_the_bytes_of_the_sdk_s_spans():
    """``SpanBuilder(wire=True)`` writes each span as its message at once
    (``WireSpan``): for the same traces (and the same random ids) the request is byte for
    byte the one written from the SDK's ``ReadableSpan``s, itself checked above against
    the SDK's encoder; the SDK's batch processor takes them as sampled spans."""
    now = time.time()
    cases = []
    for i in range(120):
        batch = BatchInfo(i // 10, "mlp", now + 0.004, now + 0.009, 10, 32, 12, 10,
                          None if i % 3 else 64, "dynamic", 2, "ok" if i % 7 else "error")
        t = FinishedTrace("decoder" if i % 6 == 0 else "mlp", "chat" if i % 6 == 0 else "infer",
                          random.getrandbits(128), random.getrandbits(64),
                          random.getrandbits(64) if i % 2 else None, now, now + 0.01,
                          now + 0.001 if i % 9 else None, now + 0.004, now + 0.009,
                          "ok" if i % 5 else "error", batch.seq, f"req-{i}" if i % 4 else None,
                          first_token_at=now + 0.006 if i % 6 == 0 else None,
                          input_tokens=i if i % 6 == 0 else None,
                          output_tokens=2 * i if i % 6 == 0 else None,
                          finish_reasons=("length", "stop") if i % 6 == 0 else ())
        cases.append((t, batch if i % 8 else None))
    built = {}
    for wire in (False, True):
        builder = SpanBuilder(RESOURCE, "i-1", wire=wire, ids=random.Random(7))
        built[wire] = [s for t, b in cases for s in builder.spans(t, b)]
    assert all(type(s) is WireSpan for s in built[True])
    assert len(built[True]) == len(built[False])
    assert encode_request(built[True]) == encode_request(built[False])
    assert all(s.context.trace_flags.sampled for s in built[True])


def test_a_batch_of_two_resources_mixed_encodes_as_the_sdk_encodes_it():
    """``encode_request`` takes a batch of one resource and scope in one pass, and groups
    any other batch by resource and scope: spans of two resources interleaved, written at
    once and as the SDK's, give the SDK's encoding of the SDK's spans."""
    other = Resource.create({"service.name": "batchscope", "service.instance.id": "i-2"})
    now = time.time()
    built = {}
    for wire in (False, True):
        builders = [SpanBuilder(RESOURCE, "i-1", wire=wire, ids=random.Random(5)),
                    SpanBuilder(other, "i-2", wire=wire, ids=random.Random(6))]
        built[wire] = [s for i in range(40) for s in builders[i % 3 == 0].spans(
            FinishedTrace("mlp", "infer", 7 + i, 9 + i, None, now, now + 0.01, now + 0.001,
                          now + 0.004, now + 0.009, "ok", i // 4),
            BatchInfo(i // 4, "mlp", now + 0.004, now + 0.009, 4, 32, 4, 4, None, "dynamic",
                      2, "ok"))]
    assert all(type(s) is WireSpan for s in built[True])
    same(built[False])
    assert encode_request(built[True]) == encode_request(built[False])
    one = [s for s in built[True] if s.resource is RESOURCE]  # one resource: one pass
    assert ExportTraceServiceRequest.FromString(encode_request(one)) == encode_spans(
        [s for s in built[False] if s.resource is RESOURCE])


@pytest.mark.parametrize("wire", [True, False])
def test_plain_traces_spans_are_those_of_their_finished_traces(wire):
    """``SpanBuilder.plain_spans`` writes a batch of plain traces' spans straight from its
    members: the same bytes (the same random ids) as ``spans`` of each member's
    ``FinishedTrace`` (``plain_finished``), whatever times are missing or out of order,
    with or without the batch's ``BatchInfo``; and as many as it says it makes."""
    ids = SpanIds()
    rng = random.Random(3)
    cases = []
    for seq in range(200):
        t0 = 1000.0 + seq * 1e-3
        members = []
        for i in range(rng.randint(1, 9)):
            t = t0 - rng.random() * 1e-3
            sent = t0 + rng.uniform(8e-4, 2e-3)  # some before the batch's answer (t0 + 1 ms)
            members.append([seq * 10 + i, f"q{i}" if i % 3 == 0 else None,
                            None if i % 4 == 1 else t - 1e-4,
                            t - rng.uniform(-2e-5, 5e-5) if i % 5 else None,
                            t, sent if i % 6 else None,
                            sent + rng.uniform(-2e-5, 1e-4) if i % 7 else None,
                            ids.line() if i % 4 != 2 else None, seq, None])
        started = None if seq % 11 == 5 else t0 - rng.uniform(-1e-4, 3e-4)
        batch = ("mlp", "http", (None, "ok", "error")[seq % 3], seq, started, t0 + 2e-4,
                 t0 + 8e-4, None if seq % 13 == 1 else t0 + 9e-4, t0 + 1e-3, members)
        info = BatchInfo(seq, "mlp", 1.7e9 + t0, 1.7e9 + t0 + 1e-3, len(members), 32,
                         len(members), len(members), None, "dynamic", 1, "ok")
        cases.append((batch, info if seq % 4 else None))
    offset = 1.7e9
    old = SpanBuilder(RESOURCE, "i-1", wire=wire, ids=random.Random(11))
    new = SpanBuilder(RESOURCE, "i-1", wire=wire, ids=random.Random(11))
    expected = [s for batch, info in cases for t in plain_finished(batch, offset)
                for s in old.spans(t, info)]
    counted, made = 0, []
    for batch, info in cases:
        counted += new.plain_count(batch, info)
        made += new.plain_spans(batch, offset, info)
    assert len(made) == len(expected) == counted
    assert encode_request(made) == encode_request(expected)
    assert sum(map(plain_spans_of, (b for b, _ in cases))) == sum(
        spans_of(t) for b, _ in cases for t in plain_finished(b, offset))


@pytest.mark.parametrize("seed", range(20))
def test_any_span_the_sdk_makes_encodes_as_the_sdk_encodes_it(seed):
    rng = random.Random(seed)
    scopes = [InstrumentationScope("batchscope.runtime"), InstrumentationScope("other", "1.2",
              schema_url="https://schema/1", attributes={"scope.attr": 5}), None]
    resources = [RESOURCE, Resource.create({"service.name": "two"}, schema_url="https://r/1")]
    spans = []
    for _ in range(30):
        attrs = {f"key.{j}": rng.choice(VALUES) for j in range(rng.randrange(0, 12))}
        links = [api.Link(context(rng, remote=rng.random() < 0.5),
                          {"link.n": rng.randrange(-5, 5), "why": "batch"} if rng.random() < 0.7
                          else None) for _ in range(rng.randrange(0, 3))]
        status = rng.choice([api.Status(api.StatusCode.UNSET), api.Status(api.StatusCode.OK),
                             api.Status(api.StatusCode.ERROR, "it failed"),
                             api.Status(api.StatusCode.ERROR)])
        parent = rng.choice([None, context(rng), context(rng, remote=True)])
        state = api.TraceState([("vendor", "v1"), ("other", "x")]) if rng.random() < 0.2 else None
        start = time.time_ns() - rng.randrange(10**9)
        spans.append(ReadableSpan(
            rng.choice(["infer mlp", "queue", "", "ünïcode"]), context=context(rng, state=state),
            parent=parent, resource=rng.choice(resources), attributes=attrs, links=links,
            kind=rng.choice(list(api.SpanKind)), status=status, start_time=start,
            end_time=start + rng.randrange(10**7), instrumentation_scope=rng.choice(scopes)))
    same(spans)


def test_a_span_with_events_is_left_to_the_sdk_encoder():
    rng = random.Random(1)
    span = ReadableSpan("with event", context=context(rng), resource=RESOURCE,
                        events=[Event("retry", {"n": 1}, timestamp=5)], start_time=1, end_time=2)
    with pytest.raises(Unsupported):
        encode_request([span])
    exporter = fast_grpc_exporter(endpoint="http://127.0.0.1:9", insecure=True)
    try:
        assert exporter._translate_data([span]) == encode_spans([span])
    finally:
        exporter.shutdown()


def test_the_exporter_sends_its_bytes_and_the_sdk_s_messages_to_a_real_receiver():
    rng = random.Random(2)
    plain = [ReadableSpan(f"span {i}", context=context(rng), resource=RESOURCE,
                          attributes={"n": i}, start_time=1, end_time=2) for i in range(3)]
    with_event = ReadableSpan("with event", context=context(rng), resource=RESOURCE,
                              events=[Event("retry", {"n": 1}, timestamp=5)], start_time=1,
                              end_time=2)
    received = Received()
    receiver = GrpcReceiver(received)
    exporter = fast_grpc_exporter(endpoint=f"http://127.0.0.1:{receiver.port}", insecure=True,
                                  timeout=10)
    try:
        assert isinstance(exporter._translate_data(plain), bytes)  # sent as it is
        assert exporter.export(plain) == SpanExportResult.SUCCESS
        assert exporter.export([with_event]) == SpanExportResult.SUCCESS  # the SDK's message
    finally:
        exporter.shutdown()
        receiver.server.stop(None)
    got = [span for span, _ in received.spans]
    assert [s.name for s in got] == ["span 0", "span 1", "span 2", "with event"]
    assert got[:3] == list(encode_spans(plain).resource_spans[0].scope_spans[0].spans)
    assert [e.name for e in got[3].events] == ["retry"]


def test_the_http_exporter_posts_written_spans_and_the_sdk_s_to_a_real_receiver():
    """Over HTTP/protobuf the exporter takes ``WireSpan``s too and posts their bytes; a
    batch of the SDK's spans is still the SDK's encoder's."""
    from opentelemetry.exporter.otlp.proto.http import trace_exporter

    from runtime.engine.otel import exporter_for
    from tests.test_otel_export import http_receiver

    now = time.time()
    batch = BatchInfo(4, "mlp", now + 0.004, now + 0.009, 2, 32, 2, 2, None, "dynamic", 1, "ok")
    traces = [FinishedTrace("mlp", "infer", 1000 + i, 2000 + i, None, now, now + 0.01,
                            now + 0.001, now + 0.004, now + 0.009, "ok", 4, f"r{i}")
              for i in range(2)]
    builder = SpanBuilder(RESOURCE, "i-1", wire=True)
    wire = [s for t in traces for s in builder.spans(t, batch)]
    rng = random.Random(3)
    plain = [ReadableSpan(f"span {i}", context=context(rng), resource=RESOURCE,
                          attributes={"n": i}, start_time=1, end_time=2) for i in range(2)]
    received = Received()
    server = http_receiver(received)
    exporter = exporter_for(f"http://127.0.0.1:{server.server_address[1]}", "http/protobuf")
    try:
        assert exporter.takes_wire_spans
        assert trace_exporter.encode_spans(plain) == encode_spans(plain)  # left as it was
        assert exporter.export(wire) == SpanExportResult.SUCCESS
        assert exporter.export(plain) == SpanExportResult.SUCCESS
    finally:
        exporter.shutdown()
        server.shutdown()
    sent = ExportTraceServiceRequest.FromString(encode_request(wire))
    expected = [*sent.resource_spans[0].scope_spans[0].spans,
                *encode_spans(plain).resource_spans[0].scope_spans[0].spans]
    assert [span for span, _ in received.spans] == expected
    assert [s.name for s in expected][-2:] == ["span 0", "span 1"] and len(expected) == 1 + 2 * 3 + 2
