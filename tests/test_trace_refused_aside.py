"""A traced request whose large body was parsed off the loop, and that the engine then
refused (its queue filled meanwhile), is answered through its trace: its 429 carries the
``traceparent`` of the server's span, as every traced answer does, and its trace is
recorded as rejected, with its send times. Driven deterministically: the parser pool is
a gate the test opens, and the model holds its batch until released."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import orjson
import pytest

from batchscope.storage.records import ListRecorder, TraceRow
from runtime.api.config import BatchingConfig
from runtime.core.tracing import span_ids
from runtime.engine.engine import Engine
from runtime.models.toys import DoubleModel
from runtime.server import fastpath
from runtime.server.fastpath import InferHook
from runtime.server.routes import build_app

TIMEOUT_S = 20.0
PATH = "/v2/models/double/infer"
BODY = orjson.dumps({"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32",
                                 "data": [1, 2, 3, 4]}]})
HEADS = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
         (b"content-length", b"%d" % len(BODY))]
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{CALLER_TRACE}-00f067aa0ba902b7-01".encode()


class GatePool:
    """The parser pool: parses at once, except the one it is told to hold."""

    def __init__(self) -> None:
        self.hold_next = False
        self.held: list = []

    def submit(self, parse) -> None:
        if self.hold_next:
            self.hold_next = False
            self.held.append(parse)
        else:
            parse()


class Spans:
    """The span exporter's side the tracer talks to: what it was handed."""

    def __init__(self) -> None:
        self.raw: list[tuple] = []

    def put_raw(self, raw: tuple, wall_offset_s: float) -> None:
        self.raw.append(raw)

    def put_traces(self, record: object) -> None:
        raise AssertionError("no batch of plain traces is expected here")


async def until(check, what: str) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def test_a_traced_request_refused_after_its_body_was_parsed_aside_carries_its_trace(
        monkeypatch):
    pool = GatePool()
    monkeypatch.setattr(fastpath, "LARGE_BODY_BYTES", 16)  # every body here is parsed aside
    monkeypatch.setattr(fastpath, "_parser_pool", lambda: pool)

    async def main():
        hold = threading.Event()
        model = DoubleModel(hold=hold)
        recorder = ListRecorder()
        engine = Engine({"double": model}, {"double": BatchingConfig(
            max_batch_size=1, max_queue_size=1)}, recorder=recorder)
        spans = engine.tracer.otel = Spans()
        hook = InferHook(build_app(engine).state)
        answers: list[tuple[str, int, dict, bytes]] = []

        def answer_of(who: str):
            return lambda status, headers, body: answers.append(
                (who, status, dict(headers), body))

        conn = SimpleNamespace(began_s=time.monotonic(), last_active_s=time.monotonic())
        await engine.start()
        try:
            assert hook(conn, b"POST", PATH, HEADS, BODY, answer_of("running"))
            await asyncio.to_thread(model.entered.wait, TIMEOUT_S)  # held in its batch
            pool.hold_next = True  # the traced one passes admission, then waits to parse
            assert hook(conn, b"POST", PATH, [*HEADS, (b"traceparent", TRACEPARENT)], BODY,
                        answer_of("traced"))
            assert len(pool.held) == 1 and not answers
            assert hook(conn, b"POST", PATH, HEADS, BODY, answer_of("queued"))
            await until(lambda: engine.stats("double")["queue_depth"] == 1, "a full queue")
            pool.held.pop()()  # parsed now; its submit finds the queue full
            await until(lambda: any(a[0] == "traced" for a in answers), "the refusal")
            who, status, headers, body = next(a for a in answers if a[0] == "traced")
            assert status == 429 and "max_queue_size=1" in orjson.loads(body)["error"]
            parent = headers[b"traceparent"].decode()
            assert parent.startswith(f"00-{CALLER_TRACE}-") and parent.endswith("-01")
            assert parent != TRACEPARENT.decode()  # the server's own span in that trace
            hold.set()
            await until(lambda: len(answers) == 3, "every answer")
            assert sorted((a[0], a[1]) for a in answers) == [
                ("queued", 200), ("running", 200), ("traced", 429)]
        finally:
            hold.set()
            await engine.stop()
        traces = recorder.of(TraceRow)
        assert len(traces) == 1 and traces[0].outcome == "rejected"
        assert traces[0].w3c_trace_id == CALLER_TRACE
        assert traces[0].send_start_at is not None and traces[0].send_end_at is not None
        assert len(spans.raw) == 1 and spans.raw[0][0][3] == "rejected"  # its outcome
        assert f"{span_ids(spans.raw[0][1])[0]:032x}" == CALLER_TRACE

    asyncio.run(asyncio.wait_for(main(), TIMEOUT_S * 2))
