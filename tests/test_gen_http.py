"""OpenAI-compatible completions over a real HTTP server (uvicorn) on 127.0.0.1.

The engine runs on a fake clock, so deadlines pass only when a test moves it, and its
model is a ``SteppedModel``: a test holds steps at the gate to fix the order of events.
"""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import orjson
import pytest
import uvicorn

from batchscope.storage.records import EventRow, GenStepRow, ListRecorder, RequestRow
from runtime.core.clock import FakeClock
from runtime.generation.config import GenerationConfig
from runtime.generation.engine import GenerationEngine
from runtime.generation.http import create_app
from runtime.generation.toys import SteppedModel
from runtime.models.decoder import TinyDecoder
from tests.factories import request, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


class Served:
    def __init__(self, **cfg) -> None:
        self.recorder = ListRecorder()
        self.clock = FakeClock()
        self.model = SteppedModel(TinyDecoder(n_layers=2, max_model_len=256))
        base = dict(block_size=8, num_cache_blocks=64, max_model_len=256)
        base.update(cfg)
        self.engine = GenerationEngine(self.model, GenerationConfig(**base), recorder=self.recorder,
                                       clock=self.clock)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.address = sock.getsockname()[:2]
        self.url = f"http://127.0.0.1:{self.address[1]}"
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
        assert wait_until(predicate, limit=max_polls), "condition not reached"


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


def stream_events(client, body) -> tuple[int, str, list]:
    """(status, content type, events) of a streamed completion."""
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        return r.status_code, r.headers["content-type"], sse_events(r.iter_lines())


def test_models_are_listed(client):
    assert client.get("/v1/models").json() == {
        "object": "list",
        "data": [{"id": "decoder", "object": "model", "created": 0, "owned_by": "batchscope"}]}
    assert client.get("/v1/models/decoder").json()["id"] == "decoder"
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


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


def test_n_choices_per_prompt_are_indexed_prompt_major_and_seeded(client):
    body = {"model": "decoder", "prompt": ["ab", "cd"], "n": 3, "max_tokens": 6,
            "ignore_eos": True, "temperature": 1.5, "seed": 5}
    first = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in first["choices"]] == list(range(6))
    assert first["usage"] == {"prompt_tokens": 12, "completion_tokens": 36, "total_tokens": 48}
    # the same seed gives the same choices; choice i samples with seed + i
    again = client.post("/v1/completions", json=body).json()
    assert [c["text"] for c in again["choices"]] == [c["text"] for c in first["choices"]]
    shifted = client.post("/v1/completions", json={**body, "prompt": "ab", "n": 2,
                                                    "seed": 6}).json()
    assert shifted["choices"][0]["text"] == first["choices"][1]["text"]


def test_stream_is_server_sent_events_ending_with_done(client):
    body = {"model": "decoder", "prompt": [5, 6, 7], "max_tokens": 6, "ignore_eos": True}
    status, media, events = stream_events(client, {**body,
                                                   "stream_options": {"include_usage": True}})
    assert status == 200 and media.startswith("text/event-stream")
    assert events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert len(chunks) == 6
    assert all(c["object"] == "text_completion" and c["choices"][0]["index"] == 0 for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * 5 + ["length"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    full = client.post("/v1/completions", json=body).json()
    assert "".join(c["choices"][0]["text"] for c in chunks) == full["choices"][0]["text"]


def test_stop_strings_cut_the_text_streamed_or_not(served, client):
    counts = served.engine.stats()["requests"]
    body = {"model": "decoder", "prompt": "Once upon", "max_tokens": 40, "ignore_eos": True}
    text = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = text[12:14]  # a piece of the greedy text: generation must end where it appears
    expected = text[:text.find(stop)]
    cut = client.post("/v1/completions", json={**body, "stop": [stop, "\x00never"]}).json()
    assert cut["choices"][0] == {"index": 0, "text": expected, "logprobs": None,
                                 "finish_reason": "stop"}
    assert 1 <= cut["usage"]["completion_tokens"] < 40
    status, _, events = stream_events(client, {**body, "stop": stop})
    chunks = events[:-1]
    assert status == 200 and events[-1] == "[DONE]"
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    # both stopped requests ended as successes, not as cancellations
    after = served.engine.stats()["requests"]
    assert after["ok"] == counts["ok"] + 3 and after["cancelled"] == counts["cancelled"]
    assert served.engine.stats()["blocks_used"] == 0


@pytest.mark.parametrize("body, param, code, fragment", [
    ({"prompt": "x"}, "model", "bad_request", "model is required"),
    ({"model": "decoder", "prompt": []}, "prompt", "bad_request", "prompt must be"),
    ({"model": "decoder", "prompt": "x", "n": 0}, "n", "bad_request", "from 1 to 128"),
    ({"model": "decoder", "prompt": "x", "max_tokens": 0}, "max_tokens", "bad_request",
     "positive integer"),
    ({"model": "decoder", "prompt": "x", "max_tokens": 400}, "max_tokens", "invalid",
     "max_model_len"),
    ({"model": "decoder", "prompt": [1, 9999]}, "prompt", "bad_request",
     "outside the vocabulary"),
    ({"model": "decoder", "prompt": "x", "priority": 9}, "priority", "invalid", "priority"),
    ({"model": "decoder", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop",
     "bad_request", "at most 4"),
    ({"model": "decoder", "prompt": "x", "stop": [""]}, "stop", "bad_request", "1 to 256"),
    ({"model": "decoder", "prompt": "x", "top_p": 0.5}, "top_p", "bad_request", "top_p must be 1"),
    ({"model": "decoder", "prompt": "x", "temperature": 3}, "temperature", "bad_request",
     "from 0 to 2"),
    ({"model": "decoder", "prompt": "x", "seed": 2 ** 64}, "seed", "bad_request", "64-bit"),
])
def test_invalid_requests_are_openai_shaped_400s(client, body, param, code, fragment):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code and fragment in error["message"], error
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_unknown_model_unknown_route_and_bad_json(client):
    r = client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert "no generation model named 'nope'" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "model"
    r = client.post("/v1/completions", content=b"{nope",
                    headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "no_route"


def test_a_new_request_joins_while_a_stream_is_running_and_finishes_first(served, client):
    served.recorder.records.clear()
    model, engine = served.model, served.engine
    model.hold()  # steps wait at the gate until released: the order of events is fixed
    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(stream_events, client, {
            "model": "decoder", "prompt": "a long story", "max_tokens": 60, "ignore_eos": True})
        served.wait_for(lambda: engine.stats()["running"] == 1)  # its prefill is at the gate
        joined = pool.submit(client.post, "/v1/completions", json={
            "model": "decoder", "prompt": "quick", "max_tokens": 3, "ignore_eos": True})
        served.wait_for(lambda: engine.stats()["waiting"] == 1)
        model.release()
        quick = joined.result(timeout=60)
        status, _, events = long.result(timeout=60)
    assert quick.status_code == 200 and quick.json()["usage"]["completion_tokens"] == 3
    assert status == 200 and events[-1] == "[DONE]" and len(events) == 61
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
            streamed = client.post("/v1/completions", json={**body, "stream": True})
            model.release()
            assert running.result(timeout=60).status_code == 200
            assert waiting.result(timeout=60).status_code == 200
    finally:
        model.release()
        served.engine.update_settings({"max_num_seqs": 32, "max_queue_size": 1024})
    for r in (refused, streamed):
        assert r.status_code == 429 and r.headers["retry-after"] == "1"
        error = r.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and "max_queue_size=1" in error["message"]


def test_a_request_of_several_choices_is_refused_whole_before_any_is_queued(served, client):
    model, engine, rec = served.model, served.engine, served.recorder
    engine.update_settings({"max_num_seqs": 1, "max_queue_size": 4})
    body = {"model": "decoder", "prompt": "x", "max_tokens": 2, "ignore_eos": True}
    before = len(rec.of(RequestRow))
    try:
        too_many = client.post("/v1/completions", json={**body, "n": 5})  # no retry mends it
        assert too_many.status_code == 400 and "max_queue_size=4" in too_many.json()["error"][
            "message"]
        assert len(rec.of(RequestRow)) == before  # a mistake, not a refusal: nothing recorded
        model.hold()
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(client.post, "/v1/completions", json=body)
            served.wait_for(lambda: engine.stats()["running"] == 1)
            waiting = pool.submit(client.post, "/v1/completions", json=body)
            served.wait_for(lambda: engine.stats()["waiting"] == 1)
            refused = client.post("/v1/completions", json={**body, "prompt": ["a", "b"],
                                                           "n": 2})
            model.release()
            assert running.result(timeout=60).status_code == 200
            assert waiting.result(timeout=60).status_code == 200
    finally:
        model.release()
        engine.update_settings({"max_num_seqs": 32, "max_queue_size": 1024})
    assert refused.status_code == 429
    assert "room for 3 more, this request holds 4" in refused.json()["error"]["message"]
    served.wait_for(lambda: len(rec.of(RequestRow)) == before + 6)
    outcomes = sorted(r.outcome for r in rec.of(RequestRow)[before:])
    assert outcomes == ["ok", "ok", "rejected", "rejected", "rejected", "rejected"]
    assert any(e.kind == "rejected" and e.severity == "warning" for e in rec.of(EventRow))


def test_a_stream_that_expires_in_the_queue_gets_503_before_it_starts(served, client):
    """The status line waits for the first token: an expiry before it is a plain 503."""
    model, engine = served.model, served.engine
    engine.update_settings({"max_num_seqs": 1})
    try:
        model.hold()
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(client.post, "/v1/completions", json={
                "model": "decoder", "prompt": "x", "max_tokens": 2, "ignore_eos": True})
            served.wait_for(lambda: engine.stats()["running"] == 1)
            expiring = pool.submit(client.post, "/v1/completions", json={
                "model": "decoder", "prompt": "y", "max_tokens": 2, "stream": True,
                "timeout_ms": 100})
            served.wait_for(lambda: engine.stats()["waiting"] == 1)
            served.clock.advance(1.0)  # past its deadline while it still waits
            model.release()
            assert running.result(timeout=60).status_code == 200
            expired = expiring.result(timeout=60)
    finally:
        model.release()
        engine.update_settings({"max_num_seqs": 32})
    assert expired.status_code == 503
    assert expired.headers["content-type"] == "application/json"
    assert expired.json()["error"]["code"] == "expired"
    assert any(e.kind == "expired" and "expired in the queue of 'decoder'" in e.message
               for e in served.recorder.of(EventRow))


def test_a_client_that_goes_away_cancels_its_stream(served, client):
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


def test_clients_that_go_away_before_the_first_token_cancel_their_completions(served):
    """Non-streamed ones, and streamed ones whose status line still waits."""
    engine, model = served.engine, served.model
    before = engine.stats()
    model.hold()  # nothing can finish before the clients leave
    socks = []
    try:
        for i in range(8):
            body = orjson.dumps({"model": "decoder", "prompt": "never read", "max_tokens": 200,
                                 "ignore_eos": True, "stream": i % 2 == 1})
            sock = socket.create_connection(served.address, timeout=10)
            sock.sendall(request("POST", "/v1/completions", body,
                                 headers={"Content-Type": "application/json"}))
            socks.append(sock)
        served.wait_for(lambda: engine.stats()["requests"]["ok"] == before["requests"]["ok"]
                        and engine.stats()["running"] + engine.stats()["waiting"] == 8)
        for sock in socks:
            sock.close()
        served.wait_for(lambda: engine.stats()["requests"]["cancelled"]
                        == before["requests"]["cancelled"] + 8)
    finally:
        model.release()
    served.wait_for(lambda: engine.stats()["blocks_used"] == 0)
    after = engine.stats()
    assert after["running"] == after["waiting"] == 0
    assert after["tokens_generated"] == before["tokens_generated"]  # the held step gave nothing
