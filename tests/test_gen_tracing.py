"""A generation model's traces at their edges, on a real server with a real OTLP receiver:
a refused or expired request's answer carries its trace's ``traceparent`` and its row
pairs with its trace, an expired one never computed, a stop string reached on the last
allowed token is the finish reason its span gives, and the trace export draws each
request's flow to the step it joined."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from sqlalchemy import create_engine, text

from batchscope.analysis.queries.timeline import timeline_rows
from batchscope.analysis.queries.window import Window
from batchscope.trace import check, export_trace
from runtime.api.config import ServerConfig
from runtime.generation.toys import SteppedModel
from runtime.models.decoder import TinyDecoder
from runtime.models.toys import DoubleModel
from runtime.server.service import Service, ServiceThread
from tests.factories import trace_rows_written, wait_until
from tests.test_otel_export import GrpcReceiver, Received

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

BODY = {"model": "decoder", "prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True}


@pytest.fixture
def traced(tmp_path, monkeypatch):
    """A server of ``a`` and a held-at-will ``decoder``, every request traced as spans."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    received = Received()
    receiver = GrpcReceiver(received)
    model = SteppedModel(TinyDecoder(d_model=16, n_layers=1))
    db = f"sqlite:///{tmp_path / 'gen.db'}"
    service = Service({"a": DoubleModel()}, None, ServerConfig(
        database_url=db, otlp_traces_endpoint=f"http://127.0.0.1:{receiver.port}",
        trace_config=(("trace_rate", "1"),)), generation={"decoder": model},
        instance_id="gen-trace")
    runner = ServiceThread(service)
    url = runner.start()
    try:
        yield url, model, service.generation.engines["decoder"], received, db
    finally:
        model.release()
        runner.stop()
        receiver.server.stop(None)


def test_refused_and_expired_answers_carry_their_trace_and_pair_with_their_rows(traced):
    url, model, engine, received, db = traced
    engine.update_settings({"max_num_seqs": 1, "max_queue_size": 2})
    model.hold()
    with httpx.Client(base_url=url, timeout=60) as http, ThreadPoolExecutor(3) as pool:
        running = pool.submit(http.post, "/v1/completions", json=BODY)
        assert wait_until(lambda: engine.stats()["running"] == 1)
        waiting = pool.submit(http.post, "/v1/completions", json=BODY)
        began = time.monotonic()
        expiring = pool.submit(http.post, "/v1/completions", json={**BODY, "timeout_ms": 20})
        assert wait_until(lambda: engine.stats()["waiting"] == 2)
        refused = http.post("/v1/completions", json=BODY)
        # its deadline passes while the model is held: the next plan expires it
        assert wait_until(lambda: time.monotonic() > began + 0.1)
        model.release()
        answers = [f.result(timeout=60) for f in (running, waiting, expiring)]
    assert [a.status_code for a in answers] == [200, 200, 503] and refused.status_code == 429
    for answer in (refused, answers[2]):
        assert answer.headers["traceparent"].startswith("00-")
        assert "batchscope-batch-id" not in answer.headers  # it joined no step
    for answer in answers[:2]:
        assert int(answer.headers["batchscope-batch-id"]) >= 1
    ids = {a.headers["traceparent"].split("-")[1] for a in (*answers, refused)}
    assert wait_until(lambda: ids <= {s.trace_id.hex() for s, _ in received.spans}, limit=400)
    engine_db = create_engine(db)
    traces = {t.outcome: t for t in trace_rows_written(engine_db, 0, 4)}
    assert wait_until(lambda: _count(engine_db, "requests") == 4, limit=400)
    expired = traces["expired"]  # it never computed
    assert (expired.compute_start_at, expired.compute_end_at, expired.batch_seq) == (None,) * 3
    span = (min(t.request_start_at for t in traces.values()),
            max(t.request_end_at for t in traces.values()))
    rows = timeline_rows(engine_db, Window(span[0] - 1, span[1] + 1, "decoder"), requests="all")
    # each request row pairs with its trace: the server's one clock turns both readings of
    # its arrival into the same wall-clock time
    assert sorted(rows.requests["outcome"]) == ["expired", "ok", "ok", "rejected"]
    assert rows.requests["trace_id"].notna().all(), rows.requests[["outcome", "trace_id"]]


def _count(engine_db, table: str) -> int:
    with engine_db.connect() as conn:
        return conn.execute(text(f"SELECT COUNT(*) FROM {table}")).scalar()


def test_a_stop_string_on_the_last_allowed_token_is_the_span_s_finish_reason(traced):
    url, _, _, received, _ = traced
    with httpx.Client(base_url=url, timeout=60) as http:
        with http.stream("POST", "/v1/completions", json={**BODY, "max_tokens": 12,
                                                          "stream": True}) as r:
            pieces = [line for line in r.iter_lines() if line.startswith("data: {")]
        texts = [httpx.Response(200, content=p[6:]).json()["choices"][0]["text"] for p in pieces]
        # the first piece that is not empty and is not in the text before it
        k = next(i for i, t in enumerate(texts) if t.strip() and t not in "".join(texts[:i]))
        answer = http.post("/v1/completions", json={**BODY, "max_tokens": k + 1,
                                                    "stop": [texts[k]]})
    assert answer.json()["choices"][0]["finish_reason"] == "stop"
    trace_id = answer.headers["traceparent"].split("-")[1]

    def reasons():
        for s, _ in received.spans:
            if s.trace_id.hex() == trace_id and s.name == "text_completion decoder":
                attrs = {a.key: a.value for a in s.attributes}
                return [v.string_value for v in
                        attrs["gen_ai.response.finish_reasons"].array_value.values]
        return None

    assert wait_until(lambda: reasons() is not None, limit=400)
    assert reasons() == ["stop"]


def test_the_export_draws_each_generation_request_s_flow_to_the_step_it_joined(traced, tmp_path):
    url, _, _, _, db = traced
    with httpx.Client(base_url=url, timeout=60) as http:
        answers = [http.post("/v1/completions", json={**BODY, "prompt": [1 + i, 2, 3]})
                   for i in range(4)]
        http.post("/v2/models/a/infer", json={"inputs": [{
            "name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]}]})
    assert all(a.status_code == 200 for a in answers)
    engine_db = create_engine(db)
    assert wait_until(lambda: _count(engine_db, "requests") == 5, limit=400)
    assert wait_until(lambda: _count(engine_db, "request_traces") == 5, limit=400)
    with engine_db.connect() as conn:
        t0, t1 = conn.execute(text("SELECT MIN(arrived_at), MAX(finished_at) FROM requests")
                              ).one()
    out = tmp_path / "gen.pftrace"
    with open(out, "wb") as fh:
        summary = export_trace(engine_db, Window(t0 - 1, t1 + 1), fh, fmt="perfetto")
    parsed = check.read_perfetto(out.read_bytes())
    assert not parsed.problems
    # every request (4 decoder, 1 of model a) has its flow, each ending on its step or batch
    assert summary.flows == 5 and len(parsed.flows) == 5 and not summary.notes
    ends = sorted(into.category for _, into in parsed.flows.values())
    assert ends == ["batch", "step", "step", "step", "step"]
    joined = {int(a.headers["batchscope-batch-id"]) for a in answers}
    assert {into.args["seq"] for _, into in parsed.flows.values()
            if into.category == "step"} == joined



def test_choices_cancelled_after_their_first_token_get_no_decode_span(traced):
    """Two choices, each cancelled (its client went away) after its first token: their
    totals (2 tokens, no finish reason) look like one choice that decoded a second token,
    but the request's spans judge each choice, and neither decoded."""
    url, model, engine, received, _ = traced
    body = {**BODY, "n": 2, "max_tokens": 8, "stream": True}
    started, leave = threading.Event(), threading.Event()

    def read_then_leave() -> str:
        with httpx.Client(base_url=url, timeout=60) as http, \
                http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # the answer begins once every choice has its first token
            started.set()
            assert leave.wait(60)
            return r.headers["traceparent"].split("-")[1]

    before = model.steps_done
    model.hold()
    with ThreadPoolExecutor(1) as pool:
        reader = pool.submit(read_then_leave)
        assert wait_until(lambda: engine.stats()["running"] == 2)
        while not model.wait_for_steps(before + 1, 0.1):  # let exactly one step through
            model.release()
            model.hold()
        assert started.wait(60)  # both first tokens sent; the next step waits at the gate
        leave.set()
        trace_id = reader.result(timeout=60)
    assert wait_until(lambda: engine.stats()["running"] == 0)  # both cancelled
    model.release()

    def spans():
        mine = [s for s, _ in received.spans if s.trace_id.hex() == trace_id]
        request = [s for s in mine if s.name == "text_completion decoder"]
        return (request[0], mine) if request and len(mine) >= 3 else None

    assert wait_until(lambda: spans() is not None, limit=400)
    request, mine = spans()
    attrs = {a.key: a.value for a in request.attributes}
    assert attrs["gen_ai.usage.output_tokens"].int_value == 2
    assert "gen_ai.response.finish_reasons" not in attrs
    assert attrs["batchscope.request.outcome"].string_value == "cancelled"
    children = sorted(s.name for s in mine if s.parent_span_id == request.span_id)
    assert children == ["prefill", "queue"]
