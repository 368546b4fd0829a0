"""OpenAI-compatible completions over a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
import uvicorn

from batchscope.storage.records import GenStepRow, ListRecorder, RequestRow
from runtime.generation.config import GenerationConfig
from runtime.generation.engine import GenerationEngine
from runtime.generation.http import create_app
from runtime.generation.toys import SteppedModel
from runtime.models.decoder import TinyDecoder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


class Served:
    def __init__(self, **cfg) -> None:
        self.recorder = ListRecorder()
        self.model = SteppedModel(TinyDecoder(n_layers=2, max_model_len=256))
        base = dict(block_size=8, num_cache_blocks=64, max_model_len=256)
        base.update(cfg)
        self.engine = GenerationEngine(self.model, GenerationConfig(**base), recorder=self.recorder)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(create_app({"decoder": self.engine}),
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        for _ in range(2000):
            if self.server.started:
                break
            time.sleep(0.005)
        assert self.server.started, "the server did not start"

    def close(self) -> None:
        self.model.release()
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def wait_for(self, predicate, max_polls: int = 4000) -> None:
        for _ in range(max_polls):
            if predicate():
                return
            time.sleep(0.005)
        raise AssertionError("condition not reached")


@pytest.fixture(scope="module")
def served():
    s = Served()
    yield s
    s.close()


@pytest.fixture
def client(served):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        yield c


def sse_events(lines) -> list:
    """Parse an SSE body strictly: `data: ...` lines each followed by a blank line."""
    events, expect_blank = [], False
    for line in lines:
        if expect_blank:
            assert line == "", f"missing blank line after an event, got {line!r}"
            expect_blank = False
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        payload = line[len("data: "):]
        events.append(payload if payload == "[DONE]" else orjson.loads(payload))
        expect_blank = True
    return events


def test_models_are_listed(client):
    assert client.get("/v1/models").json() == {
        "object": "list",
        "data": [{"id": "decoder", "object": "model", "created": 0, "owned_by": "batchscope"}]}
    assert client.get("/v1/models/decoder").json()["id"] == "decoder"
    assert client.get("/v1/models/other").status_code == 404


def test_completion_has_the_openai_shape(client):
    r = client.post("/v1/completions", json={"model": "decoder", "prompt": "Hello there",
                                              "max_tokens": 7, "ignore_eos": True})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"id", "object", "created", "model", "choices", "usage"}
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion"
    assert body["model"] == "decoder" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "text": body["choices"][0]["text"], "logprobs": None,
                                "finish_reason": "length"}]
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}
    # greedy is deterministic: the same request gives the same text
    again = client.post("/v1/completions", json={"model": "decoder", "prompt": "Hello there",
                                                  "max_tokens": 7, "ignore_eos": True}).json()
    assert again["choices"][0]["text"] == body["choices"][0]["text"]


def test_token_id_prompts_and_several_prompts_give_one_choice_each(client):
    r = client.post("/v1/completions", json={"model": "decoder", "prompt": [[1, 2, 3], "abc"],
                                              "max_tokens": 4, "ignore_eos": True,
                                              "temperature": 0.7, "seed": 11})
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert all(c["finish_reason"] == "length" for c in body["choices"])
    assert body["usage"]["prompt_tokens"] == 6 and body["usage"]["completion_tokens"] == 8


def test_stream_is_server_sent_events_ending_with_done(client):
    with client.stream("POST", "/v1/completions", json={
            "model": "decoder", "prompt": [5, 6, 7], "max_tokens": 6, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert len(chunks) == 6
    assert all(c["object"] == "text_completion" and c["choices"][0]["index"] == 0 for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    full = client.post("/v1/completions", json={"model": "decoder", "prompt": [5, 6, 7],
                                                 "max_tokens": 6, "ignore_eos": True}).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]


@pytest.mark.parametrize("body, status, code, fragment", [
    ({"model": "nope", "prompt": "x"}, 404, "model_not_found", "does not exist"),
    ({"prompt": "x"}, 400, "bad_request", "model is required"),
    ({"model": "decoder", "prompt": []}, 400, "bad_request", "prompt must be"),
    ({"model": "decoder", "prompt": "x", "n": 2}, 400, "bad_request", "n must be 1"),
    ({"model": "decoder", "prompt": "x", "max_tokens": 0}, 422, "invalid", "max_tokens"),
    ({"model": "decoder", "prompt": "x", "max_tokens": 400}, 422, "invalid", "max_model_len"),
    ({"model": "decoder", "prompt": [1, 9999]}, 400, "bad_request", "outside the vocabulary"),
    ({"model": "decoder", "prompt": "x", "priority": 9}, 422, "invalid", "priority"),
])
def test_errors_use_the_openai_error_shape(client, body, status, code, fragment):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and fragment in error["message"]
    assert error["type"] == "invalid_request_error"


def test_bad_json_is_a_400(client):
    r = client.post("/v1/completions", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_a_new_request_joins_while_a_stream_is_running_and_finishes_first(served, client):
    served.recorder.records.clear()
    model, engine = served.model, served.engine
    model.hold()  # steps wait at the gate until released: the order of events is fixed
    with client.stream("POST", "/v1/completions", json={
            "model": "decoder", "prompt": "a long story", "max_tokens": 60, "stream": True,
            "ignore_eos": True}) as stream:
        assert stream.status_code == 200
        served.wait_for(lambda: engine.stats()["running"] == 1)  # its prefill is at the gate
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(client.post, "/v1/completions", json={
                "model": "decoder", "prompt": "quick", "max_tokens": 3, "ignore_eos": True})
            served.wait_for(lambda: engine.stats()["waiting"] == 1)
            model.release()
            quick = joined.result(timeout=60)
        events = sse_events(stream.iter_lines())
    assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] == 3
    assert events[-1] == "[DONE]" and len(events) == 61
    steps = served.recorder.of(GenStepRow)
    # the quick request's prompt was prefilled in a step where the stream decoded a token
    assert any(s.prefill_tokens == len("quick") and s.decode_tokens == 1 and s.running == 2
               for s in steps)
    finished = [(r.prompt_tokens, r.output_tokens) for r in served.recorder.of(RequestRow)]
    assert finished == [(5, 3), (12, 60)]  # the late short request left first


def test_queue_full_is_a_429_with_retry_after(served, client):
    model = served.model
    served.engine.update_settings({"max_num_seqs": 1, "max_queue_size": 1})
    try:
        model.hold()
        with ThreadPoolExecutor(2) as pool:
            body = {"model": "decoder", "prompt": "x", "max_tokens": 2, "ignore_eos": True}
            running = pool.submit(client.post, "/v1/completions", json=body)
            served.wait_for(lambda: served.engine.stats()["running"] == 1)
            waiting = pool.submit(client.post, "/v1/completions", json=body)
            served.wait_for(lambda: served.engine.stats()["waiting"] == 1)
            refused = client.post("/v1/completions", json=body)
            model.release()
            assert running.result(timeout=60).status_code == 200
            assert waiting.result(timeout=60).status_code == 200
    finally:
        model.release()
        served.engine.update_settings({"max_num_seqs": 32, "max_queue_size": 1024})
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "max_queue_size=1" in error["message"]


def test_a_client_that_goes_away_cancels_its_generation(served, client):
    engine = served.engine
    cancelled_before = engine.stats()["requests"]["cancelled"]
    with client.stream("POST", "/v1/completions", json={
            "model": "decoder", "prompt": "bye", "max_tokens": 240, "stream": True,
            "ignore_eos": True}) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        served.model.hold()  # it cannot finish on its own before the server notices
    # the connection is closed: the server notices and stops generating for it
    try:
        served.wait_for(lambda: engine.stats()["requests"]["cancelled"] == cancelled_before + 1)
        stats = engine.stats()
    finally:
        served.model.release()
    assert stats["running"] == 0 and stats["blocks_used"] == 0
