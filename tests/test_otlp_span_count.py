"""``benchmarks.bench_tracing``'s OTLP receiver counts spans by walking a request's
protobuf bytes, without ``opentelemetry-proto`` (the GPU machine lacks it): checked here
against requests encoded with the real ``opentelemetry-proto`` classes, and end to end
through its gRPC generic handler."""

from __future__ import annotations

import os
import sys
import time
import types

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest, ExportTraceServiceResponse)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans, Span, Status

from benchmarks.bench_tracing import TRACE_SERVICE, Receiver, span_count


def span(i: int) -> Span:
    """A span with every kind of field set: varints, fixed64 times, bytes ids, nested
    attributes, events and links (each of which a walker must step over, not count)."""
    attrs = [KeyValue(key="k", value=AnyValue(string_value="v" * (i % 300))),
             KeyValue(key="n", value=AnyValue(int_value=-i)),
             KeyValue(key="x", value=AnyValue(double_value=i / 7))]
    return Span(trace_id=bytes(range(16)), span_id=i.to_bytes(8, "little"),
                parent_span_id=b"\x01" * 8 if i % 2 else b"", name=f"span {i}",
                kind=Span.SPAN_KIND_SERVER if i % 3 else Span.SPAN_KIND_INTERNAL,
                start_time_unix_nano=1_700_000_000_000_000_000 + i,
                end_time_unix_nano=1_700_000_000_000_000_000 + 2 * i + 1, attributes=attrs,
                events=[Span.Event(time_unix_nano=5, name="e", attributes=attrs)] * (i % 2),
                links=[Span.Link(trace_id=b"\x02" * 16, span_id=b"\x03" * 8,
                                 attributes=attrs)] * (i % 3 == 0),
                status=Status(code=Status.STATUS_CODE_ERROR, message="bad") if i % 5 == 0
                else None, flags=0x100 + i % 2, dropped_attributes_count=i % 4)


def request(shape: list[list[int]]) -> ExportTraceServiceRequest:
    """``shape[r][s]`` spans in scope ``s`` of resource ``r``; schema URLs and scope and
    resource attributes set, so fields 1 and 3 of each level are there to step over."""
    i = 0
    out = ExportTraceServiceRequest()
    for r, scopes in enumerate(shape):
        rs = ResourceSpans(resource=Resource(attributes=[KeyValue(
            key="service.name", value=AnyValue(string_value=f"svc-{r}"))]),
            schema_url=f"https://example.com/r{r}")
        for s, n in enumerate(scopes):
            ss = ScopeSpans(scope=InstrumentationScope(name=f"scope-{s}", version="1"),
                            schema_url="https://example.com/s" if s % 2 else "")
            for _ in range(n):
                ss.spans.append(span(i))
                i += 1
            rs.scope_spans.append(ss)
        out.resource_spans.append(rs)
    return out


SHAPES = [[], [[]], [[0, 0]], [[1]], [[3]], [[2, 0, 5], [1], []], [[7, 1], [0, 4, 4, 2]],
          [[130]], [[1] * 20] * 3]


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s)[:30] for s in SHAPES])
def test_spans_counted_from_the_bytes_equal_the_real_messages(shape):
    req = request(shape)
    data = req.SerializeToString()
    assert span_count(data) == sum(len(ss.spans) for rs in req.resource_spans
                                   for ss in rs.scope_spans) == sum(map(sum, shape))


def test_a_batchscope_export_is_counted_as_the_sdk_encodes_it():
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
    from opentelemetry.sdk.resources import Resource as SdkResource

    from runtime.engine.otel_spans import BatchInfo, FinishedTrace, SpanBuilder
    from runtime.engine.otlp_wire import encode_request

    now = time.time()
    builder = SpanBuilder(SdkResource.create({"service.name": "batchscope"}), "i-1")
    spans = []
    for i in range(50):
        batch = BatchInfo(i // 10, "mlp", now + 0.004, now + 0.009, 10, 32, 10, 10, None,
                          "dynamic", 1, "ok")
        spans += builder.spans(FinishedTrace("mlp", "infer", i + 1, i + 1, None, now, now + 0.01,
                                             now + 0.001, now + 0.004, now + 0.009, "ok",
                                             batch.seq), batch)
    assert len(spans) == 50 * 3 + 5  # each request's three, each batch's one
    assert span_count(encode_spans(spans).SerializeToString()) == len(spans)
    assert span_count(encode_request(spans)) == len(spans)


@pytest.mark.parametrize("data", [b"\x0a\x05\x12\x03", b"\x0b", b"\x0a\x80"])
def test_bytes_that_are_not_a_request_raise(data):
    with pytest.raises((ValueError, IndexError)):
        span_count(data)


def test_the_receiver_answers_an_exporter_and_counts_its_spans(monkeypatch):
    # as after a Streamlit AppTest in the same process: ``__main__`` is a script now gone
    # (a ``multiprocessing`` spawn child would re-run it and fail)
    gone = types.ModuleType("__main__")
    gone.__file__ = "/nonexistent/script.py"
    monkeypatch.setitem(sys.modules, "__main__", gone)
    with Receiver() as receiver:
        with grpc.insecure_channel(f"127.0.0.1:{receiver.port}") as channel:
            export = channel.unary_unary(
                f"/{TRACE_SERVICE}/Export",
                request_serializer=ExportTraceServiceRequest.SerializeToString,
                response_deserializer=ExportTraceServiceResponse.FromString)
            for shape in ([[2, 3], [4]], [[1]], []):
                answer = export(request(shape), timeout=30)
                assert answer == ExportTraceServiceResponse()
        assert receiver.spans == 10


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_the_receiver_runs_in_the_idle_class_unless_asked_not_to():
    with Receiver() as idle, Receiver(idle=False) as normal:
        assert idle.spans == 0 and normal.spans == 0  # both up and answering
        assert os.sched_getscheduler(idle.pid) == os.SCHED_IDLE
        assert os.sched_getscheduler(normal.pid) == os.SCHED_OTHER
