"""OpenTelemetry export (``--otlp-traces-endpoint``) to real OTLP receivers in this
process (a gRPC ``TraceService`` and an HTTP ``/v1/traces`` handler built from
``opentelemetry-proto``), and NVTX ranges (``--nvtx``) on a machine without CUDA."""

from __future__ import annotations

import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from runtime.api.config import ServerConfig
from runtime.device import nvtx
from runtime.engine import otel
from runtime.engine.otel import OtlpSpans
from runtime.engine.otel_spans import BatchInfo, FinishedTrace, SpanBuilder, SpanIds, spans_of
from runtime.generation.http import _decoding
from runtime.generation.scheduler import Sequence
from runtime.models.toys import DoubleModel
from runtime.server.service import Service, ServiceThread
from tests.factories import wait_until

BODY = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]}
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"


class Received:
    """Spans received, from either transport, as (span, resource attributes)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.spans: list = []

    def add(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            for rs in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in rs.resource.attributes}
                for ss in rs.scope_spans:
                    self.spans.extend((s, attrs) for s in ss.spans)


class GrpcReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received: Received) -> None:
        self.received = received
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):  # noqa: N802 - the gRPC method's name
        self.received.add(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def http_receiver(received: Received) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            if self.path == "/v1/traces":
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                received.add(request)
                self.send_response(200)
            else:
                self.send_response(404)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()
            self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def serve_and_send(tmp_path, endpoint: str, n: int) -> tuple[list[httpx.Response], httpx.Response]:
    """A real server exporting to ``endpoint`` and tracing every request: ``n`` plain
    requests, one closing its connection and one carrying a caller's ``traceparent``
    (the answers: the first ``n + 1``, and the last); the server is stopped (its
    spans flushed) before this returns."""
    service = Service({"a": DoubleModel()}, None, ServerConfig(
        database_url=f"sqlite:///{tmp_path / 'otel.db'}", otlp_traces_endpoint=endpoint,
        trace_config=(("trace_rate", "1"),)), instance_id="otel-test")
    runner = ServiceThread(service)
    url = runner.start()
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            answers = [http.post("/v2/models/a/infer", json=BODY) for _ in range(n)]
            # the last answer on its connection is written without a prepared head
            answers.append(http.post("/v2/models/a/infer", json=BODY,
                                     headers={"connection": "close"}))
            joined = http.post("/v2/models/a/infer", json=BODY, headers={
                "traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
            metrics = http.get("/metrics").text
        assert "batchscope_trace_spans_dropped_total 0.0" in metrics
    finally:
        runner.stop()
    return answers, joined


def check_spans(received: Received, answers: list[httpx.Response], joined: httpx.Response) -> None:
    spans = [s for s, _ in received.spans]
    requests = [s for s in spans if s.name == "infer a"]
    batches = {s.span_id: s for s in spans if s.name == "batch a"}
    assert len(requests) == len(answers) + 1
    by_parent: dict[bytes, list] = {}
    for s in spans:
        by_parent.setdefault(s.parent_span_id, []).append(s)
    batch_ids = {}
    for b in batches.values():
        attrs = {a.key: a.value for a in b.attributes}
        batch_ids[b.span_id] = attrs["batchscope.batch.id"].int_value
        assert attrs["batchscope.batch.size"].int_value >= 1
    for r in requests:
        assert r.kind == r.SPAN_KIND_SERVER
        children = sorted(c.name for c in by_parent.get(r.span_id, []))
        assert children == ["compute", "queue"]
        assert len(r.links) == 1 and r.links[0].span_id in batches  # exactly one, received
        attrs = {a.key: a.value for a in r.attributes}
        assert attrs["gen_ai.request.model"].string_value == "a"
        assert attrs["gen_ai.latency.time_in_queue"].double_value >= 0
        assert attrs["batchscope.batch.id"].int_value == batch_ids[r.links[0].span_id]
        assert r.start_time_unix_nano <= r.end_time_unix_nano
    # every answer names its span and its batch
    for answer in [*answers, joined]:
        assert answer.status_code == 200
        _, trace_id, span_id, _ = answer.headers["traceparent"].split("-")
        mine = [r for r in requests if r.span_id.hex() == span_id]
        assert len(mine) == 1 and mine[0].trace_id.hex() == trace_id
        assert int(answer.headers["batchscope-batch-id"]) == batch_ids[mine[0].links[0].span_id]
    # the caller's trace, end to end
    [caller] = [r for r in requests if r.trace_id.hex() == CALLER_TRACE]
    assert caller.parent_span_id.hex() == CALLER_SPAN
    assert all(r.parent_span_id == b"" for r in requests if r is not caller)
    assert {a["service.name"] for _, a in received.spans} == {"batchscope"}


def check_rows_name_their_traces(db, answers: list[httpx.Response],
                                 joined: httpx.Response) -> None:
    """Each request's ``request_traces`` row names the W3C trace of its spans, the one
    its answer's ``traceparent`` names: a trace the server began (no parent span), or
    the caller's (with the caller's span). A trace found in the database or an export is
    found in the collector by that id."""
    from sqlalchemy import create_engine, text

    engine = create_engine(f"sqlite:///{db}")
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT w3c_trace_id, w3c_parent_span_id FROM "
                                     "request_traces")).all()
    finally:
        engine.dispose()
    named = [a.headers["traceparent"].split("-")[1] for a in [*answers, joined]]
    assert sorted(trace for trace, _ in rows) == sorted(named)
    assert {trace: parent for trace, parent in rows if parent} == {CALLER_TRACE: CALLER_SPAN}


@pytest.mark.slow
def test_spans_reach_an_otlp_grpc_receiver(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    received = Received()
    receiver = GrpcReceiver(received)
    try:
        answers, joined = serve_and_send(tmp_path, f"http://127.0.0.1:{receiver.port}", 20)
        assert wait_until(lambda: len(received.spans) >= 21 * 3, limit=400)
        check_spans(received, answers, joined)
        check_rows_name_their_traces(tmp_path / "otel.db", answers, joined)
    finally:
        receiver.server.stop(None)


@pytest.mark.slow
def test_spans_reach_an_otlp_http_receiver(tmp_path, monkeypatch):
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    received = Received()
    server = http_receiver(received)
    try:
        answers, joined = serve_and_send(
            tmp_path, f"http://127.0.0.1:{server.server_address[1]}", 8)
        assert wait_until(lambda: len(received.spans) >= 9 * 3, limit=400)
        check_spans(received, answers, joined)
    finally:
        server.shutdown()


def trace(n: int, seq: int | None = 1, first_token: float | None = None,
          decode_start: float | None = None) -> FinishedTrace:
    return FinishedTrace("m", "infer", 7, 100 + n, None, 10.0, 10.5, 10.0, 10.1, 10.4, "ok",
                         seq, first_token_at=first_token, decode_start_at=decode_start)


def batch(seq: int) -> BatchInfo:
    return BatchInfo(seq, "m", 10.1, 10.4, 4, 8, 32, 20, 16, "dynamic", 3, "ok")


def test_one_batch_span_serves_all_its_members_and_generation_has_prefill_and_decode():
    from opentelemetry.sdk.resources import Resource
    builder = SpanBuilder(Resource.create({}), "i")
    first = builder.spans(trace(1), batch(1))
    again = builder.spans(trace(2), batch(1))
    assert [s.name for s in first] == ["batch m", "infer m", "queue", "compute"]
    assert [s.name for s in again] == ["infer m", "queue", "compute"]  # the batch span once
    assert first[1].links[0].context.span_id == again[0].links[0].context.span_id \
        == first[0].context.span_id
    assert first[0].attributes["batchscope.batch.padded_size"] == 32
    gen = builder.spans(trace(3, seq=None, first_token=10.2, decode_start=10.2), None)
    assert [s.name for s in gen] == ["infer m", "queue", "prefill", "decode"]
    assert gen[0].attributes["gen_ai.latency.time_to_first_token"] == pytest.approx(0.2)
    assert gen[0].links == () or len(gen[0].links) == 0


def test_a_step_span_is_its_own_and_generation_phases_follow_what_ran():
    from opentelemetry.sdk.resources import Resource
    builder = SpanBuilder(Resource.create({}), "i")
    step = BatchInfo(1, "g", 10.1, 10.2, 3, 8, 40, 40, None, "continuous", 2, "ok", 37, 3)
    gen = FinishedTrace("g", "text_completion", 7, 200, None, 10.0, 10.5, 10.0, 10.1, 10.4,
                        "ok", 1, first_token_at=10.2, input_tokens=37, output_tokens=5,
                        finish_reasons=("stop",), decode_start_at=10.2, decode_end_at=10.4)
    spans = builder.spans(gen, step)
    assert [s.name for s in spans] == ["step g", "text_completion g", "queue", "prefill",
                                       "decode"]
    assert spans[0].attributes["batchscope.step.prefill_tokens"] == 37
    assert spans[1].links[0].context.span_id == spans[0].context.span_id
    # a request model's batch 1 is another batch than the generation model's step 1
    assert [s.name for s in builder.spans(trace(1), batch(1))][0] == "batch m"
    # one token: no decode; ended before its first token: its compute was prefill
    one = FinishedTrace("g", "chat", 7, 201, None, 10.0, 10.3, 10.0, 10.1, 10.2, "ok", 1,
                        first_token_at=10.2, input_tokens=4, output_tokens=1,
                        finish_reasons=("length",))
    assert [s.name for s in builder.spans(one, step)] == ["chat g", "queue", "prefill"]
    gone = FinishedTrace("g", "chat", 7, 202, None, 10.0, 10.3, 10.0, 10.1, None,
                         "cancelled", 1, input_tokens=900, output_tokens=0)
    assert [s.name for s in builder.spans(gone, step)] == ["chat g", "queue", "prefill"]


def choice(i: int, tokens: int, first: float, ended: float, reason: str | None,
           outcome: str) -> Sequence:
    """One choice of a request, as the scheduler leaves it once it ended."""
    seq = Sequence(i, [1, 2, 3], 8, 1, 10.0, output_ids=list(range(1, tokens + 1)),
                   first_scheduled_s=10.1, first_token_s=first, finished_s=ended)
    seq.finish_reason, seq.outcome = reason, outcome
    return seq


def test_decode_is_judged_choice_by_choice_and_spans_the_choices_that_decoded():
    from opentelemetry.sdk.resources import Resource
    builder = SpanBuilder(Resource.create({}), "i")
    # one token each: one choice ended at its length, the other was cancelled later
    one_each = [choice(0, 1, 10.2, 10.2, "length", "ok"),
                choice(1, 1, 10.2, 10.4, None, "cancelled")]
    assert _decoding(one_each) is None
    t = FinishedTrace("g", "chat", 7, 300, None, 10.0, 10.5, 10.0, 10.1, 10.4, "ok", 1,
                      first_token_at=10.2, input_tokens=6, output_tokens=2,
                      finish_reasons=("length",))
    assert [s.name for s in builder.spans(t, None)] == ["chat g", "queue", "prefill"]
    assert spans_of(t) == 3
    # the choice that decoded had its first token later and ended before the other was
    # cancelled: its decoding is the span, not the first token to the compute's end
    mixed = [choice(0, 1, 10.2, 10.45, None, "cancelled"),
             choice(1, 3, 10.25, 10.35, "length", "ok")]
    assert _decoding(mixed) == (10.25, 10.35)
    t = FinishedTrace("g", "chat", 7, 301, None, 10.0, 10.5, 10.0, 10.1, 10.45, "ok", 1,
                      first_token_at=10.2, input_tokens=6, output_tokens=4,
                      finish_reasons=("length",), decode_start_at=10.25, decode_end_at=10.35)
    spans = builder.spans(t, None)
    assert [s.name for s in spans] == ["chat g", "queue", "prefill", "decode"]
    prefill, decode = spans[2], spans[3]
    assert prefill.end_time == pytest.approx(10.2e9, abs=1e3)
    assert decode.start_time == pytest.approx(10.25e9, abs=1e3)
    assert decode.end_time == pytest.approx(10.35e9, abs=1e3)
    # a decoding choice still running when the request ended: the compute's end stands
    running = [choice(0, 2, 10.2, 10.3, "length", "ok"), choice(1, 2, 10.2, None, None, "ok")]
    assert _decoding(running) == (10.2, None)
    t.decode_end_at = None
    assert builder.spans(t, None)[3].end_time == pytest.approx(10.45e9, abs=1e3)


@pytest.mark.parametrize("wire", [False, True])
def test_a_trace_s_span_count_is_the_spans_made_of_it(wire):
    from opentelemetry.sdk.resources import Resource
    builder = SpanBuilder(Resource.create({}), "i", wire=wire)
    for queued in (None, 10.05):
        for started in (None, 10.1):
            for first in (None, 10.2):
                for tokens, reasons, decode in ((None, (), None), (0, (), None),
                                                (1, ("length",), None),
                                                (2, (), None),  # two choices cancelled
                                                (5, ("stop",), 10.25)):
                    t = FinishedTrace("m", "infer", 7, 100, None, 10.0, 10.5, queued, started,
                                      10.4 if started else None, "ok", None,
                                      first_token_at=first, output_tokens=tokens,
                                      finish_reasons=reasons,
                                      decode_start_at=decode if first else None)
                    assert spans_of(t) == len(builder.spans(t, None))


class SlowExporter:
    """An exporter that holds its first export until released, so queues fill."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult
        self.ok = SpanExportResult.SUCCESS
        self.release = threading.Event()
        self.exported = 0

    def export(self, spans):
        self.release.wait(10)
        self.exported += len(spans)
        return self.ok

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis=None):
        return True


class KeepingExporter:
    """An exporter that keeps what it is given, at once."""

    def __init__(self) -> None:
        from opentelemetry.sdk.trace.export import SpanExportResult
        self.ok = SpanExportResult.SUCCESS
        self.names: list[str] = []

    def export(self, spans):
        self.names.extend(s.name for s in spans)
        return self.ok

    def shutdown(self):
        pass

    def force_flush(self, timeout_millis=None):
        return True


def test_a_burst_larger_than_the_processors_queue_is_exported_not_dropped(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    monkeypatch.setattr(otel, "ROOM_WAIT_S", 60.0)  # an exporter that keeps up is waited for
    exporter = KeepingExporter()
    spans = OtlpSpans("unused", "i", exporter=exporter, queue_max=1000)
    spans.batch(batch(1))
    for n in range(300):  # 901 spans at once into a queue of 8
        spans.put(trace(n))
    spans.close(timeout_s=60.0)
    assert spans.dropped == 0
    assert len(exporter.names) == spans.spans_out == 300 * 3 + 1
    assert exporter.names.count("infer m") == 300 and exporter.names.count("batch m") == 1


def test_spans_lost_to_a_full_queue_are_counted_and_reported(monkeypatch):
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2")
    monkeypatch.setattr(otel, "ROOM_WAIT_S", 0.05)  # an exporter that takes nothing
    reports = []
    exporter = SlowExporter()
    spans = OtlpSpans("unused", "i", exporter=exporter, queue_max=5,
                      on_drops=lambda new, total: reports.append((new, total)))
    spans.batch(batch(1))
    for n in range(40):
        spans.put(trace(n))
    assert wait_until(lambda: not spans.queue, limit=400)
    exporter.release.set()
    spans.close()
    assert spans.dropped > 0
    # every span of the 40 traces (3 each) and the batch span, once built, was exported or
    # counted as dropped: by our queue, before it was built (the processor's queue full
    # for longer than ROOM_WAIT_S), or by the processor
    batch_span = int(("m", 1) in spans.builder.batch_spans)
    assert exporter.exported + spans.dropped == 40 * 3 + batch_span
    assert spans.spans_out < 40 * 3 + batch_span  # the full processor queue saved building
    assert reports and reports[-1][1] == spans.dropped


def test_spans_handed_to_the_processor_together_queue_as_one_by_one():
    """``_emit_all`` puts a list of spans into the SDK's batch processor's queue as its
    ``on_end`` of each would: the same queue, the oldest pushed out past its bound and
    counted as dropped, its exporting thread woken once a batch is waiting."""
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    from runtime.engine.otlp_wire import WireSpan

    made = [WireSpan(bytes([i]), None, None) for i in range(30)]
    seen = []
    for together in (False, True):
        processor = BatchSpanProcessor(KeepingExporter(), max_queue_size=16,
                                       max_export_batch_size=8,
                                       schedule_delay_millis=3_600_000)
        inner, dropped = processor._batch_processor, []
        inner._metrics = otel._DropCounter(inner._metrics, dropped.append)
        # its thread waits on the event it has; this one records the wake-ups alone
        waiting, inner._worker_awaken = inner._worker_awaken, threading.Event()
        emit = otel._emit_all(processor)
        assert emit.__name__ == "emit"  # this SDK shows its queue: one step a list
        woken = []
        for i in range(0, 30, 7):
            (emit if together else lambda spans: [processor.on_end(s) for s in spans])(
                made[i:i + 7])
            woken.append(inner._worker_awaken.is_set())
        seen.append(([s.wire for s in inner._queue], sum(dropped), woken))
        inner._worker_awaken = waiting
        processor.shutdown()
    assert seen[0] == seen[1]
    assert seen[1][1] == 14 and seen[1][2] == [False, True, True, True, True]


def plain(seq: int, first: int, n: int, spans: bool = True) -> tuple:
    """A batch of ``n`` plain traces (``PLAIN_BATCH_FIELDS``), monotonic times."""
    ids = SpanIds()
    members = [[first + i, None, 1.0, 1.001, 1.002, 1.01, 1.011,
                ids.line() if spans else None, seq, None] for i in range(n)]
    return ("m", "http", "ok", seq, 1.003, 1.004, 1.006, 1.008, 1.009, members)


def test_batches_of_plain_traces_are_queued_whole_and_dropped_whole():
    from batchscope.storage.records import TraceBatch
    exporter = KeepingExporter()
    spans = OtlpSpans("unused", "i", exporter=exporter, queue_max=40)
    spans.batch(batch(1))
    spans.batch(batch(2))
    # more members than the queue holds: dropped whole, every span counted; then one that
    # fits, and one with no member with spans (nothing queued)
    spans.put_traces(TraceBatch("i", 1e9, [], [plain(1, 0, 50), plain(2, 50, 30),
                                                plain(2, 80, 5, spans=False)]))
    spans.close(timeout_s=60.0)
    assert spans.dropped == 50 * 3
    assert len(exporter.names) == spans.spans_out == 30 * 3 + 1
    assert exporter.names.count("infer m") == 30 and exporter.names.count("batch m") == 1
    assert spans.backlog() == 0.0


def test_nvtx_ranges_never_raise_without_cuda(monkeypatch):
    monkeypatch.setenv(nvtx.ENV, "1")
    try:
        source = nvtx.reload()
        assert source in ("nvtx", "off")  # torch.cuda.nvtx needs a CUDA build
        with nvtx.batch_range(12, "mlp", 8):
            pass
        with nvtx.step_range(3, "decoder", 4, 16, 3):
            pass
    finally:
        monkeypatch.delenv(nvtx.ENV)
        assert nvtx.reload() == "off"
    with nvtx.batch_range(None, "mlp", 1):  # off: a null context
        pass


@pytest.mark.slow
def test_a_server_with_nvtx_on_serves_as_usual(tmp_path, monkeypatch):
    monkeypatch.delenv(nvtx.ENV, raising=False)
    service = Service({"a": DoubleModel()}, None, ServerConfig(
        database_url=f"sqlite:///{tmp_path / 'nvtx.db'}", nvtx=True), instance_id="nvtx")
    runner = ServiceThread(service)
    url = runner.start()
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            for _ in range(5):
                assert http.post("/v2/models/a/infer", json=BODY).status_code == 200
    finally:
        runner.stop()
        monkeypatch.delenv(nvtx.ENV, raising=False)
        nvtx.reload()


@pytest.mark.slow
def test_generation_requests_become_spans_with_prefill_decode_and_token_counts(tmp_path, monkeypatch):
    from sqlalchemy import create_engine, text

    from runtime.models.decoder import TinyDecoder
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    received = Received()
    receiver = GrpcReceiver(received)
    url_db = f"sqlite:///{tmp_path / 'gen.db'}"
    service = Service({"a": DoubleModel()}, None, ServerConfig(
        database_url=url_db, otlp_traces_endpoint=f"http://127.0.0.1:{receiver.port}",
        trace_config=(("trace_rate", "1"),)),
        generation={"decoder": TinyDecoder(d_model=16, n_layers=1)}, instance_id="gen-otel")
    runner = ServiceThread(service)
    url = runner.start()
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            # model a's first batch is number 1, as the decoder's first step: spans of both
            batch = http.post("/v2/models/a/infer", json=BODY)
            assert batch.headers["batchscope-batch-id"] == "1"
            plain = http.post("/v1/completions", json={
                "model": "decoder", "prompt": [1, 2, 3, 4], "max_tokens": 5, "n": 2,
                "ignore_eos": True})
            streamed = http.post("/v1/completions", json={
                "model": "decoder", "prompt": [5, 6, 7], "max_tokens": 4, "stream": True,
                "ignore_eos": True}, headers={"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"})
            settings = http.get("/v2/models/decoder/trace/setting")
        assert plain.status_code == streamed.status_code == settings.status_code == 200
        assert "traceparent" in plain.headers and "traceparent" in streamed.headers
    finally:
        runner.stop()
        try:
            assert wait_until(lambda: sum(s.name == "text_completion decoder"
                                          for s, _ in received.spans) >= 2, limit=400)
        finally:
            receiver.server.stop(None)
    spans = [s for s, _ in received.spans]
    [first, second] = sorted((s for s in spans if s.name == "text_completion decoder"),
                             key=lambda s: s.start_time_unix_nano)
    kids = {s.parent_span_id: [] for s in spans}
    for s in spans:
        kids[s.parent_span_id].append(s.name)
    for span, n_in, n_out in ((first, 8, 10), (second, 3, 4)):
        attrs = {a.key: a.value for a in span.attributes}
        assert attrs["gen_ai.operation.name"].string_value == "text_completion"
        assert attrs["gen_ai.usage.input_tokens"].int_value == n_in  # over both choices
        assert attrs["gen_ai.usage.output_tokens"].int_value == n_out
        assert attrs["gen_ai.latency.time_to_first_token"].double_value > 0
        assert [v.string_value for v in attrs["gen_ai.response.finish_reasons"].array_value.values]
        assert sorted(kids[span.span_id]) == ["decode", "prefill", "queue"]
    assert second.trace_id.hex() == CALLER_TRACE and second.parent_span_id.hex() == CALLER_SPAN
    # each request links to the span of the step it joined, whose id its answer carries
    steps = {s.span_id: s for s in spans if s.name == "step decoder"}
    assert [s.name for s in spans].count("batch a") == 1
    joined = []
    for span, answer in ((first, plain), (second, streamed)):
        [link] = span.links
        step = steps[link.span_id]
        attrs = {a.key: a.value for a in step.attributes}
        seq = attrs["batchscope.batch.id"].int_value
        assert str(seq) == answer.headers["batchscope-batch-id"]
        assert attrs["batchscope.step.prefill_tokens"].int_value >= 3
        assert step.start_time_unix_nano <= [k for k in spans if k.parent_span_id == span.span_id
                                             and k.name == "prefill"][0].end_time_unix_nano
        joined.append(seq)
    assert len(steps) == len(set(joined)) == 2
    with create_engine(url_db).connect() as conn:
        rows = conn.execute(text("SELECT batch_seq FROM request_traces WHERE model = 'decoder' "
                                 "ORDER BY request_start_at")).scalars().all()
        recorded = conn.execute(text("SELECT batch_seq FROM requests WHERE model = 'decoder' "
                                     "ORDER BY arrived_at, id")).scalars().all()
        numbered = set(conn.execute(text("SELECT seq FROM generation_steps WHERE model = "
                                         "'decoder'")).scalars())
    assert rows == joined and recorded == [joined[0], joined[0], joined[1]]  # n=2: two rows
    assert set(joined) <= numbered


def refusing_receiver(status: int) -> ThreadingHTTPServer:
    """An OTLP/HTTP collector that answers every export with ``status`` (and counts them)."""
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            self.server.exports += 1
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.exports = 0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("status", [400, 500])
def test_spans_a_collector_refuses_are_counted_as_dropped(status):
    """Before: only a full queue counted; a collector answering every export with an
    error lost every span and the count stayed 0."""
    server = refusing_receiver(status)
    reports = []
    try:
        spans = OtlpSpans(f"http://127.0.0.1:{server.server_address[1]}", "i",
                          protocol="http/protobuf",
                          on_drops=lambda new, total: reports.append(total))
        spans.batch(batch(1))
        for n in range(20):
            spans.put(trace(n))
        spans.close(timeout_s=30.0)
    finally:
        server.shutdown()
    assert server.exports >= 1
    assert spans.spans_out == 20 * 3 + 1 and spans.dropped == spans.spans_out
    assert reports and reports[-1] == spans.dropped


def test_the_span_process_reports_spans_lost_after_the_last_traces_came(monkeypatch):
    """The span process's exports fail after the server has handed over its last traces
    (a collector down, traffic stopped): the loss is counted and reported without more
    traffic and without closing. Before, the child's counts came back only with the next
    hand-over, and the metric read 0 for as long as nothing more was traced."""
    from runtime.engine.otel_process import SpanProcess

    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the child inherits it
    server = refusing_receiver(400)
    reports = []
    spans = SpanProcess(f"http://127.0.0.1:{server.server_address[1]}", "i",
                        protocol="http/protobuf",
                        on_drops=lambda new, total: reports.append(total))
    try:
        spans.batch(batch(1))
        for n in range(20):
            spans.put(trace(n))
        # a round takes a second (SEND_INTERVAL_S): the hand-over, then the loss
        assert wait_until(lambda: reports and reports[-1] == 20 * 3 + 1, limit=3000), reports
        assert server.exports >= 1 and spans.spans_out == 20 * 3 + 1
        assert wait_until(lambda: spans._child_holding == 0, limit=3000)
    finally:
        spans.close(timeout_s=5.0)
        server.shutdown()
    assert spans.dropped == 20 * 3 + 1 and reports[-1] == spans.dropped


def test_an_exporter_holds_what_it_has_not_exported_or_lost():
    """``OtlpSpans.holding``: the traces its thread has not taken and the spans its
    processor has neither exported nor lost; 0 once every count is final."""
    from opentelemetry.sdk.trace.export import SpanExportResult

    class Gate:  # exports nothing until opened, then everything
        def __init__(self) -> None:
            self.open = threading.Event()

        def export(self, spans):
            self.open.wait(30)
            return SpanExportResult.SUCCESS

        def shutdown(self):
            self.open.set()

        def force_flush(self, timeout_millis=0):
            return True

    gate = Gate()
    spans = OtlpSpans("http://127.0.0.1:9", "i", exporter=gate)
    try:
        assert spans.holding() == 0
        spans.batch(batch(1))
        for n in range(10):
            spans.put(trace(n))
        assert spans.holding() > 0
        assert wait_until(lambda: spans.spans_out == 10 * 3 + 1, limit=3000)
        assert spans.holding() == 10 * 3 + 1  # handed over, none exported yet
        gate.open.set()
        assert wait_until(lambda: spans.holding() == 0, limit=3000)
    finally:
        spans.close(timeout_s=5.0)
    assert spans._exporter.exported == 10 * 3 + 1 and spans.dropped == 0


def test_closing_towards_a_collector_that_never_answers_ends_in_its_time_and_counts_all():
    """A port that takes the connection and never answers: the SDK's flush and shutdown
    waited on the export for the exporter's own timeout and retries (51 s for a close of
    5 s); now ``close`` ends within its time (a generous bound here: a liveness check)
    and counts every span it could not send, the one export under way included."""
    import socket
    import time

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    held = []
    stop = threading.Event()

    def accept() -> None:  # take connections, read nothing, answer nothing
        silent.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(silent.accept()[0])
            except OSError:
                pass

    threading.Thread(target=accept, daemon=True).start()
    try:
        spans = OtlpSpans(f"http://127.0.0.1:{silent.getsockname()[1]}", "i",
                          protocol="http/protobuf")
        spans.batch(batch(1))
        for n in range(50):
            spans.put(trace(n))
        assert wait_until(lambda: not spans.queue, limit=2000)
        began = time.monotonic()
        spans.close(timeout_s=1.0)
        took = time.monotonic() - began
    finally:
        stop.set()
        for conn in held:
            conn.close()
        silent.close()
    assert took < 10.0, took
    assert spans.spans_out == 50 * 3 + 1 and spans.dropped == spans.spans_out


def test_once_the_collector_takes_nothing_a_trace_that_does_not_fit_is_dropped_at_once(
        monkeypatch):
    """Before: each trace waited ``ROOM_WAIT_S`` in turn, so an outage was counted one
    trace every 2 s while the queue behind grew; now the first wait that runs out stalls
    the span thread's waiting until the processor has room again."""
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "4")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "2")
    monkeypatch.setattr(otel, "ROOM_WAIT_S", 0.5)  # 200 waits in turn: 100 s
    exporter = SlowExporter()
    spans = OtlpSpans("unused", "i", exporter=exporter, queue_max=1000)
    spans.batch(batch(1))
    for n in range(200):
        spans.put(trace(n))
    assert wait_until(lambda: not spans.queue, limit=2000)  # at most 10 s
    assert spans.dropped >= 190 * 3
    exporter.release.set()
    spans.close()
    batch_span = int(("m", 1) in spans.builder.batch_spans)
    assert exporter.exported + spans.dropped == 200 * 3 + batch_span


def test_after_an_outage_a_burst_is_waited_for_again(monkeypatch):
    """The stall (drop at once what does not fit) lasts until the processor has room
    again: before, it lasted for good, and every later burst that filled the processor's
    queue for a moment lost spans."""
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "8")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "4")
    monkeypatch.setattr(otel, "ROOM_WAIT_S", 0.05)
    exporter = SlowExporter()
    spans = OtlpSpans("unused", "i", exporter=exporter, queue_max=10_000)
    spans.batch(batch(1))
    for n in range(20):  # the exporter holds its first export: an outage
        spans.put(trace(n))
    assert wait_until(lambda: not spans.queue, limit=2000)
    lost = spans.dropped
    assert lost > 0
    exporter.release.set()  # the collector is back
    assert wait_until(lambda: spans._room() >= 8, limit=2000)
    monkeypatch.setattr(otel, "ROOM_WAIT_S", 60.0)  # a burst is waited for, not dropped
    for n in range(20, 320):
        spans.put(trace(n))
    spans.close(timeout_s=60.0)
    assert spans.dropped == lost
    batch_span = int(("m", 1) in spans.builder.batch_spans)
    assert exporter.exported + spans.dropped == 320 * 3 + batch_span


def test_a_close_out_of_time_counts_every_span_once(monkeypatch):
    """A collector that never answers and a close that runs out of time: each span put is
    counted as dropped exactly once, whichever thread dropped it (the event loop's queue,
    the span thread, the processor's, the export under way, what was left). Before, the
    counts of other threads were overwritten as ``close`` added what was left."""
    exporter = SlowExporter()  # holds its first export for 10 s: past this close
    spans = OtlpSpans("unused", "i", exporter=exporter, queue_max=5_000)
    spans.batch(batch(1))
    n = 20_000
    for i in range(n):
        spans.put(trace(i))
    spans.close(timeout_s=0.3)
    batch_span = int(("m", 1) in spans.builder.batch_spans)
    assert exporter.exported == 0
    assert spans.dropped == n * 3 + batch_span
    exporter.release.set()
