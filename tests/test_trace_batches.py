"""Traced requests handed over together: ``TraceBatch`` (the rows built off the serving
thread), the tracer's flush (at a count, after a delay on the event loop, at once
without one, and at close), the database writer's child building the rows, and the
OpenTelemetry span process counting what it cannot export. Outcomes depend on counts and
on the recorded values, never on timing."""

from __future__ import annotations

import asyncio
import pickle

import pytest

from batchscope.storage.db import make_engine
from batchscope.storage.recorder import Recorder, TeeRecorder
from batchscope.storage.records import TRACE_FIELDS, ListRecorder, TraceBatch, TraceRow
from runtime.core.clock import FakeClock
from runtime.api.errors import QueueFull
from runtime.core.tracing import (PLAIN_SPAN, PLAIN_TRACE_ID, RequestTrace, full,
                                  parse_traceparent, plain_trace, span_ids, span_line,
                                  traceparent_bytes)
from runtime.engine import tracing
from runtime.engine.otel_spans import FinishedTrace, SpanIds, finished_from, plain_finished
from runtime.engine.otel_process import SpanProcess
from runtime.engine.tracing import Tracer


def traced(clock: FakeClock, trace_id: int = 1) -> RequestTrace:
    """A request traced through a batch whose items overlap (a later stamp earlier than
    the one before it, which the row clamps)."""
    trace = RequestTrace(trace_id, "m", "http", clock.now(), request_id=f"r{trace_id}",
                         w3c=("ab" * 16, "cd" * 8, True))
    trace.recv_start, trace.recv_end = clock.now() - 0.002, clock.now() - 0.001
    trace.ran(clock.now() + 0.001, clock.now() + 0.003, clock.now() + 0.0025,
              clock.now() + 0.004, clock.now() + 0.005, 7, clock.now() + 0.006, "ok")
    trace.send_start, trace.send_end = clock.now() + 0.007, clock.now() + 0.008
    return trace


def row_at_once(trace: RequestTrace, clock: FakeClock) -> TraceRow:
    """The row as it would be built in one go from ``RequestTrace.timeline``."""
    at = [None if t is None else clock.to_wall(t) for _, t in trace.timeline()]
    return TraceRow("i", trace.model, trace.trace_id, trace.protocol, trace.outcome, at[2],
                    at[8], trace.request_id, trace.batch_seq, at[0], at[1], at[3], at[4],
                    at[5], at[6], at[7], at[9], at[10], trace.w3c_trace_id,
                    trace.w3c_parent_span_id)


def test_a_trace_batch_gives_the_rows_built_at_once():
    clock = FakeClock()
    trace = traced(clock)
    assert trace.compute_input_end < trace.compute_start  # overlapping: clamped in the row
    untraced = RequestTrace(2, "m", "grpc", clock.now())  # refused: most stamps missing
    untraced.request_end, untraced.outcome = clock.now() + 0.001, "rejected"
    in_order = RequestTrace(3, "m", "http", clock.now(), recv_start=clock.now() - 0.002,
                            recv_end=clock.now() - 0.001)  # every stamp, none out of order
    in_order.ran(clock.now() + 0.001, clock.now() + 0.002, clock.now() + 0.003,
                 clock.now() + 0.004, clock.now() + 0.005, 8, clock.now() + 0.006, "ok")
    in_order.send_start, in_order.send_end = clock.now() + 0.007, clock.now() + 0.008
    traces = (trace, untraced, in_order)
    fields = [tuple(getattr(t, name) for name in TRACE_FIELDS) for t in traces]
    rows = TraceBatch("i", clock.to_wall(0.0), fields).rows()
    assert rows == [row_at_once(t, clock) for t in traces]
    assert None not in (rows[2].recv_start_at, rows[2].compute_input_end_at, rows[2].send_end_at)
    assert rows[0].compute_input_end_at == rows[0].compute_start_at
    assert rows[1].queue_start_at is None and rows[1].send_end_at is None


def test_without_an_event_loop_each_trace_is_recorded_at_once():
    clock, recorder = FakeClock(), ListRecorder()
    tracer = Tracer(["m"], recorder, "i", clock)
    tracer.finish(traced(clock))
    assert recorder.records == [row_at_once(traced(clock), clock)]


def test_on_the_event_loop_traces_go_together(monkeypatch):
    monkeypatch.setattr(tracing, "FLUSH_EVERY", 5)
    clock, recorder = FakeClock(), ListRecorder()
    tracer = Tracer(["m"], recorder, "i", clock)

    async def run() -> list[int]:
        seen = []
        for i in range(1, 8):
            tracer.finish(traced(clock, i))
            seen.append(len(recorder.records))
        # the last two wait for the delayed flush
        await asyncio.sleep(tracing.FLUSH_AFTER_S * 3)
        seen.append(len(recorder.records))
        return seen

    assert asyncio.run(run()) == [0, 0, 0, 0, 5, 5, 5, 7]
    assert [r.trace_id for r in recorder.records] == list(range(1, 8))
    assert tracer.traced == 7


def test_close_hands_over_what_is_kept(monkeypatch):
    clock, recorder = FakeClock(), ListRecorder()
    tracer = Tracer(["m"], recorder, "i", clock)

    async def run() -> int:
        tracer.finish(traced(clock))
        return len(recorder.records)

    assert asyncio.run(run()) == 0  # kept: the loop ended before the delayed flush
    tracer.close()
    assert len(recorder.records) == 1


def test_the_writer_process_builds_the_rows(tmp_path):
    url = f"sqlite:///{tmp_path / 'traces.db'}"
    engine = make_engine(url)
    recorder = Recorder(engine, writer_process=True, flush_interval_s=0.05)
    recorder.start()
    clock = FakeClock()
    traces = [traced(clock, i) for i in range(1, 4)]
    try:
        recorder.put(TraceBatch("i", clock.to_wall(0.0), [
            tuple(getattr(t, name) for name in TRACE_FIELDS) for t in traces]))
    finally:
        recorder.close()
    assert recorder.written_by_kind == {"request_traces": 3}
    with engine.connect() as conn:
        found = conn.exec_driver_sql(
            "SELECT " + ", ".join(TraceRow.__slots__) + " FROM request_traces "
            "ORDER BY trace_id").all()
    assert [TraceRow(*r) for r in found] == [row_at_once(t, clock) for t in traces]


def test_the_span_process_counts_what_it_cannot_send():
    told = []
    spans = SpanProcess("http://127.0.0.1:9", "i", on_drops=lambda new, total: told.append(
        (new, total)))
    spans._proc.kill()  # the child is gone: what follows cannot be exported
    spans._proc.join(10)
    for i in range(5):
        spans.put(FinishedTrace("m", "infer", i + 1, i + 1, None, 1.0, 2.0, 1.0, 1.5, 1.9,
                                "ok", None))
    spans.close(timeout_s=5.0)
    assert spans.dropped == 5 * 3  # counted in spans: each trace's own, queue and compute
    assert sum(new for new, _ in told) == 15 and told[-1][1] == 15


def test_a_raw_trace_gives_the_spans_times_of_its_timeline():
    """The tracer hands a traced request to the span exporter as its row's values plus
    its span ids, converting nothing; ``finished_from`` makes the ``FinishedTrace`` the
    spans are built from: wall-clock times of the clamped timeline, the caller's parent."""
    clock = FakeClock()
    trace = traced(clock)
    trace.request_end, trace.outcome = clock.now() + 0.0065, "ok"
    trace.span = span_line(0xAB, 0x12)
    trace.operation, trace.first_token = "chat", clock.now() + 0.0035
    trace.input_tokens, trace.output_tokens, trace.finish_reasons = 5, 9, ("stop",)
    fields = tuple(getattr(trace, name) for name in TRACE_FIELDS)
    decode = (trace.first_token + 0.001, trace.first_token + 0.002)
    got = finished_from((fields, trace.span, "chat", trace.first_token, 5, 9, ("stop",),
                         decode), clock.to_wall(0.0))
    at = [None if t is None else clock.to_wall(t) for _, t in trace.timeline()]
    assert got == FinishedTrace("m", "chat", 0xAB, 0x12, int("cd" * 8, 16), at[0], at[10],
                                at[3], at[4], at[7], "ok", 7, "r1",
                                first_token_at=clock.to_wall(trace.first_token),
                                input_tokens=5, output_tokens=9, finish_reasons=("stop",),
                                decode_start_at=clock.to_wall(decode[0]),
                                decode_end_at=clock.to_wall(decode[1]))
    unended = finished_from((fields, trace.span, "chat", trace.first_token, 5, 9, ("stop",),
                             (decode[0], None)), clock.to_wall(0.0))
    assert (unended.decode_start_at, unended.decode_end_at) == (got.decode_start_at, None)
    refused = RequestTrace(2, "m", "http", clock.now())  # no receive or send stamps
    refused.request_end = clock.now() + 0.001
    raw = (tuple(getattr(refused, name) for name in TRACE_FIELDS), span_line(1, 2), "infer",
           None, None, None, (), None)
    lone = finished_from(raw, clock.to_wall(0.0))
    assert (lone.start_at, lone.end_at) == (clock.to_wall(refused.request_start),
                                            clock.to_wall(refused.request_end))
    assert lone.outcome == "error" and lone.parent_span_id is None


def test_the_span_process_counts_the_raw_traces_it_cannot_send():
    spans = SpanProcess("http://127.0.0.1:9", "i")
    spans._proc.kill()
    spans._proc.join(10)
    clock = FakeClock()
    for i in range(4):
        trace = traced(clock, i + 1)
        fields = tuple(getattr(trace, name) for name in TRACE_FIELDS)
        spans.put_raw((fields, span_line(i + 1, i + 1), "infer", None, None, None, (), None),
                      clock.to_wall(0.0))
    spans.close(timeout_s=5.0)
    assert spans.dropped == 4 * 3


def plain_batch(clock: FakeClock, first_id: int, n: int) -> tuple[tuple, list[RequestTrace]]:
    """A batch of ``n`` plain traces as booking hands it over, and the same traces as
    ``RequestTrace`` s stamped in place (a member's request start is its queue start)."""
    now = clock.now()
    started, input_end, output_start, ended, end = (now + 0.003, now + 0.0035, now + 0.0045,
                                                    now + 0.005, now + 0.006)
    members, same = [], []
    for i in range(n):
        trace_id, arrived = first_id + i, now + 0.001 * i / n
        recv = (now - 0.002, now - 0.001) if i % 2 == 0 else (None, None)
        send = (now + 0.007, now + 0.008)
        member = plain_trace(trace_id, f"p{trace_id}", *recv)
        member[4:7] = arrived, *send
        members.append(member)
        full = RequestTrace(trace_id, "m", "http", arrived, f"p{trace_id}", None, *recv)
        full.ran(arrived, started, input_end, output_start, ended, 11, end, "ok")
        full.send_start, full.send_end = send
        same.append(full)
    return ("m", "http", "ok", 11, started, input_end, output_start, ended, end, members), same


def test_plain_traces_give_the_rows_of_the_same_request_traces():
    clock = FakeClock()
    batch, same = plain_batch(clock, 5, 3)
    other = traced(clock, 1)
    fields = [tuple(getattr(other, name) for name in TRACE_FIELDS)]
    record = TraceBatch("i", clock.to_wall(0.0), fields, [batch])
    assert len(record) == 4
    assert record.rows() == [row_at_once(t, clock) for t in (other, *same)]
    assert record.model_protocols() == {("m", "http"): 4}


def test_plain_rows_put_any_member_s_times_in_order_as_a_trace_row_does():
    """``TraceBatch.tuples`` takes a member whose times come in order around its batch's
    as they are and puts any other member's in order one by one: every row is the row a
    ``RequestTrace`` with the same times gives (``wall_times`` over its timeline), whatever
    times are missing or out of order, the batch's own included."""
    import random

    from batchscope.storage.records import wall_times

    rng = random.Random(5)
    offset, batches, expected = 1.7e9, [], []
    for seq in range(200):
        t0 = 1000.0 + seq * 1e-3
        shared = [None if rng.random() < 0.15 else t0 + d + rng.uniform(-2e-4, 2e-4)
                  for d in (1e-4, 2e-4, 5e-4, 8e-4, 1e-3)]
        members = []
        for i in range(rng.randint(1, 6)):
            start = t0 - rng.uniform(-2e-4, 1e-3)
            recv = [None if rng.random() < 0.1 else start - rng.uniform(-1e-5, 1e-4),
                    None if rng.random() < 0.1 else start - rng.uniform(-1e-5, 5e-5)]
            send = [None if rng.random() < 0.1 else t0 + rng.uniform(8e-4, 2e-3)]
            send.append(None if rng.random() < 0.1 else (send[0] or t0) + rng.uniform(-1e-5, 1e-4))
            members.append((seq * 10 + i, f"r{i}" if i % 2 else None, *recv, start, *send, None))
            at = wall_times((*recv, start, start, *shared, *send), offset)
            expected.append(("i", "m", seq * 10 + i, "http", "ok", at[2], at[8],
                             f"r{i}" if i % 2 else None, seq, at[0], at[1], at[3], at[4],
                             at[5], at[6], at[7], at[9], at[10], None, None))
        batches.append(("m", "http", "ok", seq, *shared, members))
    assert TraceBatch("i", offset, [], batches).tuples() == expected


def test_plain_batches_are_kept_and_flushed_with_the_other_traces(monkeypatch):
    monkeypatch.setattr(tracing, "FLUSH_EVERY", 5)
    clock, recorder = FakeClock(), ListRecorder()
    tracer = Tracer(["m"], recorder, "i", clock)

    async def run() -> list[int]:
        seen = []
        tracer.finish(traced(clock, 1))
        seen.append(len(recorder.records))
        tracer.plain_batch(plain_batch(clock, 2, 3)[0])  # 4 kept: not yet
        seen.append(len(recorder.records))
        tracer.plain_batch(plain_batch(clock, 5, 2)[0])  # 6: handed over
        seen.append(len(recorder.records))
        return seen

    assert asyncio.run(run()) == [0, 0, 6]
    assert sorted(r.trace_id for r in recorder.records) == list(range(1, 7))
    assert tracer.traced == 6


def test_a_plain_trace_refused_by_the_engine_is_recorded_with_its_outcome():
    clock, recorder = FakeClock(), ListRecorder()
    tracer = Tracer(["m"], recorder, "i", clock)
    tracer.update(None, {"trace_level": ("TIMESTAMPS",), "trace_rate": 1})
    trace = tracer.begin("m", "http", "id-1", recv_start=clock.now() - 0.001, plain=True)
    assert trace == plain_trace(1, "id-1", clock.now() - 0.001, None)  # its list, inline
    tracer.finish(full(trace, "m", clock.now()), QueueFull("full"))
    [row] = recorder.records
    assert (row.trace_id, row.request_id, row.outcome) == (1, "id-1", "rejected")
    assert row.request_start_at == row.request_end_at == clock.to_wall(clock.now())
    assert row.recv_start_at == clock.to_wall(clock.now() - 0.001) and row.batch_seq is None


def test_a_model_writing_a_trace_file_gets_request_traces(tmp_path):
    clock = FakeClock()
    tracer = Tracer(["m", "n"], ListRecorder(), "i", clock)
    tracer.update(None, {"trace_level": ("TIMESTAMPS",), "trace_rate": 1})
    assert type(tracer.begin("m", "http", plain=True)) is list
    tracer.update("m", {"trace_file": str(tmp_path / "t.json")})  # the answer is remembered,
    assert isinstance(tracer.begin("m", "http", plain=True), RequestTrace)  # then redone
    assert type(tracer.begin("n", "http", plain=True)) is list
    tracer.close()


class Exported:
    """Stands where the span exporter would: keeps what the tracer hands it."""

    def __init__(self) -> None:
        self.records: list[TraceBatch] = []

    def put_traces(self, record: TraceBatch) -> None:
        self.records.append(record)


def test_plain_traces_with_spans_reach_the_exporter_as_request_traces_would():
    """The tracer's record goes to the exporter as the recorder gets it; the traces made
    of its batches there are those of the members with spans, as the same requests traced
    as ``RequestTrace`` s give them."""
    clock, recorder = FakeClock(), ListRecorder()
    tracer = Tracer(["m", "n"], recorder, "i", clock)
    tracer.otel = exported = Exported()
    tracer.update(None, {"trace_level": ("TIMESTAMPS",), "trace_rate": 1,
                         "trace_mode": "opentelemetry"})
    tracer.update("n", {"trace_mode": "triton"})
    spanned = tracer.begin("m", "http", "q1", plain=True)
    assert type(spanned) is list and spanned[PLAIN_SPAN] is not None
    assert tracer.begin("n", "http", plain=True)[PLAIN_SPAN] is None  # its own mode: none
    batch, same = plain_batch(clock, spanned[PLAIN_TRACE_ID], 2)
    batch[-1][0][PLAIN_SPAN] = spanned[PLAIN_SPAN]  # the first member exports spans
    other = plain_batch(clock, 9, 3)[0]  # none has spans

    async def kept() -> list:  # on an event loop, kept until the flush
        tracer.plain_batch(batch)
        tracer.plain_batch(other)
        before = list(exported.records)
        tracer.flush()
        return before

    assert asyncio.run(kept()) == []
    [record] = exported.records
    assert record.batches == [batch, other] and len(recorder.records) == 5  # the same traces
    offset = record.wall_offset_s
    assert offset == clock.to_wall(0.0)
    same[0].span = spanned[PLAIN_SPAN]
    fields = tuple(getattr(same[0], name) for name in TRACE_FIELDS)
    raw = (fields, spanned[PLAIN_SPAN], "infer", None, None, None, (), None)
    made = [t for b in record.batches for t in plain_finished(b, offset)]
    assert made == [finished_from(raw, offset)]
    assert made[0].span_id == span_ids(spanned[PLAIN_SPAN])[1]
    tracer.flush()  # nothing kept: nothing handed over
    assert len(exported.records) == 1

    async def without_spans() -> None:  # a record with no member with spans: not handed
        tracer.plain_batch(plain_batch(clock, 20, 2)[0])
        tracer.flush()

    asyncio.run(without_spans())
    assert len(exported.records) == 1 and len(recorder.records) == 7
    tracer.close()


class Handed:
    """A recorder that keeps the records it is handed, and says whether it would send
    them to another process (``pickles_records``)."""

    accepts_request_batches = True
    dropped = 0

    def __init__(self, pickles: bool) -> None:
        self.pickles_records = pickles
        self.records: list = []

    def put(self, record) -> None:
        self.records.append(record)


@pytest.mark.parametrize("pickles", [True, False])
def test_the_flush_packs_a_record_that_goes_to_another_process(pickles, tmp_path):
    clock, recorder = FakeClock(), Handed(pickles)
    tracer = Tracer(["m"], recorder, "i", clock)
    tracer.plain_batch(plain_batch(clock, 1, 3)[0])  # no event loop: flushed at once
    [record] = recorder.records
    assert (record._packed is not None) == pickles
    if pickles:  # the bytes of the record as it is
        assert pickle.loads(pickle.dumps(record)).tuples() == record.tuples()
    # the real recorder says so where its rows go to the database writer's process
    for writer_process in (True, False):
        real = Recorder(make_engine(f"sqlite:///{tmp_path}/{writer_process}.db"),
                        writer_process=writer_process)
        assert real.pickles_records == writer_process
        real.close()
    assert TeeRecorder(Handed(False), Handed(True)).pickles_records
    assert not TeeRecorder(Handed(False), ListRecorder()).pickles_records
    assert SpanProcess.pickles_records


def test_a_trace_record_is_pickled_once_for_both_child_processes():
    clock = FakeClock()
    record = TraceBatch("i", clock.to_wall(0.0), [], [plain_batch(clock, 1, 3)[0]])
    first = pickle.dumps(("TraceBatch", [record], 0.0))
    packed = record._packed
    assert packed is not None and packed in first
    second = pickle.dumps(([], [], [], [record], 0.0, 0.0))  # the span sender's message
    assert record._packed is packed and packed in second
    got = pickle.loads(second)[3][0]
    assert got == record and got.rows() == record.rows()


def test_the_span_process_counts_the_plain_traces_it_cannot_send():
    spans = SpanProcess("http://127.0.0.1:9", "i")
    spans._proc.kill()
    spans._proc.join(10)
    clock = FakeClock()
    batch, _ = plain_batch(clock, 1, 4)
    for m in batch[-1][:3]:
        m[PLAIN_SPAN] = span_line(m[PLAIN_TRACE_ID], m[PLAIN_TRACE_ID])
    # 3 members with spans, 3 spans each
    spans.put_traces(TraceBatch("i", clock.to_wall(0.0), [], [batch]))
    spans.close(timeout_s=5.0)
    assert spans.dropped == 3 * 3


def test_the_span_process_closes_in_its_time_counting_what_a_dead_collector_never_got():
    """Nothing listens at the endpoint: the exporter retries each export until its own
    timeout, and closing took 12-14 s past a drain of 5 s, the spans still queued lost
    without a count. Now it ends within its time (a generous bound: a liveness check)
    and every span handed to its processor is counted as dropped."""
    import time

    spans = SpanProcess("http://127.0.0.1:9", "i")
    clock = FakeClock()
    for seq in range(1, 21):
        batch, _ = plain_batch(clock, seq * 10, 4)
        for m in batch[-1]:
            m[PLAIN_SPAN] = span_line(m[PLAIN_TRACE_ID], m[PLAIN_TRACE_ID])
        spans.put_traces(TraceBatch("i", clock.to_wall(0.0), [], [batch]))
    began = time.monotonic()
    spans.close(timeout_s=1.5)
    assert time.monotonic() - began < 10.0
    assert spans.spans_out == 20 * 4 * 3 and spans.dropped == spans.spans_out


def test_span_ids_are_drawn_in_blocks_as_valid_traceparent_lines():
    drawn: list[int] = []

    def source(n: int) -> bytes:  # the first block: zeros, then the bytes counting up
        drawn.append(n)
        return bytes(n) if len(drawn) == 1 else bytes(i % 256 for i in range(n))

    ids = SpanIds(block=3, urandom=source)
    first = [ids.line() for _ in range(3)]
    assert drawn == [72]  # one draw for the block
    # all-zero ids are invalid (W3C): made non-zero, and still well formed
    assert {span_ids(line) for line in first} == {(1, 1)}
    for line in first:
        assert parse_traceparent(traceparent_bytes(line)) == ("0" * 31 + "1", "0" * 15 + "1", True)
        assert line == span_line(1, 1)
    second = [ids.line() for _ in range(3)]
    assert drawn == [72, 72] and len(set(second)) == 3
    expected = {span_line(int.from_bytes(bytes(range(24 * i, 24 * i + 16)), "big"),
                      int.from_bytes(bytes(range(24 * i + 16, 24 * i + 24)), "big"))
                for i in range(3)}
    assert set(second) == expected
    caller = "ab" * 16
    child = ids.child_of(caller)
    assert parse_traceparent(traceparent_bytes(child))[0] == caller
    assert ids.child_of(None).startswith(b"traceparent: 00-")
    with pytest.raises(ValueError):
        SpanIds(block=0)


def test_span_ids_from_the_system_source_differ():
    ids = SpanIds(block=64)
    lines = [ids.line() for _ in range(200)]
    assert len(set(lines)) == 200 and len({span_ids(line)[0] for line in lines}) == 200
    assert all(parse_traceparent(traceparent_bytes(line)) is not None for line in lines)
