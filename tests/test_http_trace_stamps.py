"""A traced request to a generation model over ``/v1/completions`` and
``/v1/chat/completions``, one to ``/v1/embeddings``, and a KServe ``/infer`` the
Starlette routes answer (not the fast path), gets every HTTP timestamp of its ``request_traces`` row, as one on the fast
path does: its receive times (from the HTTP/1 server, through the ASGI scope) and its
send times (around the write of its answer; a streamed answer's from its first byte to
its last).

A real ``Service`` on 127.0.0.1 (the HTTP/1 server, the Starlette routes, a tiny decoder
as ``decoder``) records into a fresh database. Each test checks the trace as the
tracer got it (``Tracer.finish`` is watched: the monotonic times before any clamping)
and its row once written: which times are set, and their order, never how long
anything took.
"""

from __future__ import annotations

import threading

import httpx
import pytest

from batchscope.storage.db import make_engine
from batchscope.storage.records import TraceRow
from runtime.api.config import ServerConfig
from runtime.models.decoder import TinyDecoder
from runtime.models.encoder import EncoderModel
from runtime.models.toys import DoubleModel
from runtime.server.service import Service, ServiceThread
from tests.factories import trace_rows_written, wait_until

pytestmark = pytest.mark.slow

TIMEOUT_S = 60.0
#: a traced HTTP request's row columns, in the order they happen
HTTP_ORDER = ("recv_start_at", "recv_end_at", "request_start_at", "queue_start_at",
              "compute_start_at", "compute_input_end_at", "compute_output_start_at",
              "compute_end_at", "request_end_at", "send_start_at", "send_end_at")
#: the columns a generation request's row has (its model step has no input/output phase)
GENERATION_COLUMNS = tuple(c for c in HTTP_ORDER
                           if c not in ("compute_input_end_at", "compute_output_start_at"))
TRACING_ON = {"trace_level": ["TIMESTAMPS"], "trace_rate": "1", "trace_count": "-1"}
TRACING_OFF = {"trace_level": ["OFF"], "trace_rate": "1000", "trace_count": "-1"}
PROMPT = {"model": "decoder", "prompt": "hello there", "max_tokens": 4, "ignore_eos": True}
CHAT = {"model": "decoder", "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4, "ignore_eos": True}


class Served:
    """The server, its database and the traces its tracer finished (raw, as handed over)."""

    def __init__(self, url: str) -> None:
        self.service = Service({"mlp": DoubleModel(), "encoder": EncoderModel()}, None,
                               ServerConfig(database_url=url, grpc_port=0,
                                            heartbeat_interval_s=0.2,
                                            control_poll_interval_s=0.05),
                               generation={"decoder": TinyDecoder(d_model=16, n_layers=1)},
                               instance_id="openai-trace-stamps")
        self.runner = ServiceThread(self.service)
        self.url = self.runner.start()
        self.db = make_engine(url)
        self.tracer = self.service.engine.tracer
        #: trace id -> the trace's times as ``finish`` got them (monotonic, unclamped)
        self.finished: dict[int, dict[str, float | None]] = {}
        self._lock = threading.Lock()
        finish = self.tracer.finish

        def watched(trace, error=None, decode=None):
            if hasattr(trace, "send_end") and hasattr(trace, "first_token"):
                times = {c: getattr(trace, c.removesuffix("_at")) for c in HTTP_ORDER}
                times["first_token"] = trace.first_token
                with self._lock:
                    self.finished[trace.trace_id] = times
            return finish(trace, error, decode)

        self.tracer.finish = watched  # an instance attribute: the routes call it through it

    def raw(self, trace_id: int) -> dict[str, float | None]:
        assert wait_until(lambda: trace_id in self.finished, limit=4000), \
            f"trace {trace_id} was never finished"
        with self._lock:
            return self.finished[trace_id]

    def rows(self, after: int, expected: int) -> list[TraceRow]:
        """The traces numbered after ``after``, once the ``expected`` ones are written."""
        return trace_rows_written(self.db, after, expected)

    def close(self) -> None:
        self.runner.stop()
        self.db.dispose()


@pytest.fixture(scope="module")
def served(backend, new_database_url):
    s = Served(new_database_url(backend))
    yield s
    s.close()


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, timeout=TIMEOUT_S) as client:
        r = client.post("/v2/trace/setting", json=TRACING_ON)
        assert r.status_code == 200, r.text
        yield client
        client.post("/v2/trace/setting", json=TRACING_OFF)


def one_row(served: Served, before: int) -> TraceRow:
    [row] = served.rows(before, 1)
    assert row.trace_id == before + 1
    return row


def assert_row_stamped(row: TraceRow, model: str = "decoder") -> None:
    """Every timestamp a generation request has is set, in order, the HTTP ones included."""
    assert (row.model, row.protocol, row.outcome) == (model, "http", "ok"), row
    times = [getattr(row, c) for c in GENERATION_COLUMNS]
    assert None not in times, {c: getattr(row, c) for c in HTTP_ORDER}
    assert times == sorted(times), {c: getattr(row, c) for c in HTTP_ORDER}


def assert_in_order(raw: dict[str, float | None], *names: str) -> None:
    times = [raw[n] for n in names]
    assert None not in times, raw
    assert times == sorted(times), {n: raw[n] for n in names}


@pytest.mark.parametrize("path, body", [("/v1/completions", PROMPT),
                                        ("/v1/chat/completions", CHAT)])
def test_a_completion_row_has_its_receive_and_send_times_around_the_rest(served, http, path,
                                                                         body):
    before = served.tracer.last_id
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    row = one_row(served, before)
    assert_row_stamped(row)
    # as the tracer got them, before the row keeps each time no earlier than the last
    assert_in_order(served.raw(row.trace_id), "recv_start_at", "recv_end_at",
                    "request_start_at", "queue_start_at", "compute_start_at",
                    "compute_end_at", "request_end_at", "send_start_at", "send_end_at")


def test_a_streamed_completion_is_sent_from_its_first_byte_to_its_last(served, http):
    before = served.tracer.last_id
    with http.stream("POST", "/v1/completions", json={**PROMPT, "stream": True}) as r:
        assert r.status_code == 200
        body = r.read()
    assert body.rstrip().endswith(b"data: [DONE]"), body
    row = one_row(served, before)
    assert_row_stamped(row)
    raw = served.raw(row.trace_id)
    assert_in_order(raw, "recv_start_at", "recv_end_at", "request_start_at", "queue_start_at",
                    "compute_start_at", "compute_end_at", "request_end_at", "send_end_at")
    # the first byte goes once every choice has its first token, the last after the end
    assert_in_order(raw, "compute_start_at", "first_token", "send_start_at", "send_end_at")


def test_a_streamed_chat_completion_row_has_its_receive_and_send_times(served, http):
    before = served.tracer.last_id
    with http.stream("POST", "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        assert r.status_code == 200
        body = r.read()
    assert body.rstrip().endswith(b"data: [DONE]"), body
    row = one_row(served, before)
    assert_row_stamped(row)
    assert_in_order(served.raw(row.trace_id), "recv_start_at", "recv_end_at",
                    "request_start_at", "compute_start_at", "first_token", "send_start_at",
                    "send_end_at")


def test_requests_on_one_connection_each_get_their_own_receive_times(served, http):
    """Three completions one after another on one keep-alive connection: each row's
    receive times are its own request's, after the answer to the one before."""
    before = served.tracer.last_id
    for i in range(3):
        r = http.post("/v1/completions", json={**PROMPT, "stream": i == 1})
        assert r.status_code == 200, r.text
    rows = served.rows(before, 3)
    assert [t.trace_id for t in rows] == [before + 1, before + 2, before + 3]
    for row in rows:
        assert_row_stamped(row)
    for earlier, later in zip(rows, rows[1:]):
        assert earlier.send_end_at <= later.recv_start_at, (earlier, later)


def test_a_completion_refused_after_tracing_began_is_recorded_with_its_send_times(served, http):
    """A prompt longer than the model takes is refused once traced: its row has the
    receive and send times of the 400 it was answered with."""
    before = served.tracer.last_id
    r = http.post("/v1/completions", json={**PROMPT, "prompt": list(range(1, 5000))})
    assert r.status_code == 400, r.text
    assert served.tracer.last_id == before + 1  # traced, then refused by the engine
    row = one_row(served, before)
    assert row.outcome != "ok"
    times = [getattr(row, c) for c in ("recv_start_at", "recv_end_at", "request_start_at",
                                       "send_start_at", "send_end_at")]
    assert None not in times and times == sorted(times), row


def test_an_infer_the_routes_answer_has_its_receive_and_send_times(served, http):
    """A query string takes ``/infer`` off the fast path, to the Starlette route: its
    row has every timestamp a fast-path one has."""
    before = served.tracer.last_id
    r = http.post("/v2/models/mlp/infer?via=routes",
                  json={"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                                    "data": [1, 2, 3, 4]}]})
    assert r.status_code == 200, r.text
    row = one_row(served, before)
    assert (row.model, row.protocol, row.outcome) == ("mlp", "http", "ok"), row
    times = [getattr(row, c) for c in HTTP_ORDER]
    assert None not in times and times == sorted(times), row
    assert r.headers["batchscope-batch-id"] == str(row.batch_seq)


def test_an_embeddings_request_is_one_trace_with_every_timestamp(served, http):
    """``/v1/embeddings`` with two inputs: one trace (as a KServe request of several
    items), its batch named in the answer, every timestamp set and in order."""
    before = served.tracer.last_id
    r = http.post("/v1/embeddings", json={"model": "encoder", "input": ["hello", "world"]})
    assert r.status_code == 200, r.text
    assert served.tracer.last_id == before + 1
    row = one_row(served, before)
    assert (row.model, row.protocol, row.outcome) == ("encoder", "http", "ok"), row
    times = [getattr(row, c) for c in HTTP_ORDER]
    assert None not in times and times == sorted(times), row
    assert r.headers["batchscope-batch-id"] == str(row.batch_seq)


def test_tracing_off_records_no_completion(served, http):
    http.post("/v2/trace/setting", json=TRACING_OFF)
    before, traced = served.tracer.last_id, served.tracer.traced
    assert http.post("/v1/completions", json=PROMPT).status_code == 200
    with http.stream("POST", "/v1/completions", json={**PROMPT, "stream": True}) as r:
        r.read()
    assert (served.tracer.last_id, served.tracer.traced) == (before, traced)
