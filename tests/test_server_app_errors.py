"""Error answers of the HTTP layer: the one function that builds them, its Starlette
forms, and the two real inference paths answering alike."""

from __future__ import annotations

import asyncio
import logging
import math
import threading

import httpx
import orjson
import pytest
from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from runtime.api.errors import (BatchScopeError, ClientError, ConfigError, HttpVersionNotSupported,
                                MethodNotAllowed, ModelError, ModelNotFound, ModelNotReady,
                                OutOfMemory, QueueFull, RequestExpired, RequestTooLarge,
                                RouteNotFound, ShuttingDown, UrlTooLong, ValidationError,
                                error_answer, routing_error)
from runtime.server.routes import error_response, guarded

TIMEOUT_S = 20.0
JSON = (b"content-type", b"application/json")


async def explode(request):
    raise RuntimeError("secret internals /srv/model.py line 12")


def internal_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "batchscope.server"
            and "unexpected error answering" in r.getMessage()]


# -- error_answer ---------------------------------------------------------------------------
@pytest.mark.parametrize("error, status", [
    (ClientError("bad"), 400), (ValidationError("bad"), 422), (ConfigError("bad"), 422),
    (ModelNotFound("bad"), 404), (RouteNotFound("bad"), 404), (RequestTooLarge("bad"), 413),
    (UrlTooLong("bad"), 414), (RequestExpired("bad"), 503), (ModelNotReady("bad"), 503),
    (ShuttingDown("bad"), 503), (ModelError("bad"), 500), (HttpVersionNotSupported("bad"), 505),
    (OutOfMemory("bad"), 507), (BatchScopeError("bad"), 500),
])
def test_each_error_answers_its_status_with_its_message(error, status, caplog):
    with caplog.at_level(logging.DEBUG, logger="batchscope.server"):
        answer = error_answer(error, "GET /x")
    assert answer == (status, [JSON], b'{"error":"bad"}')
    assert not caplog.records  # a refusal is not a bug: nothing is logged


@pytest.mark.parametrize("retry_after_s, header", [
    (0.2, b"1"), (1.5, b"2"), (2.2, b"3"), (1.0, b"1"), (3.0, b"3"), (None, b"1"), (0.0, b"1"),
    (-4.0, b"1"), (math.inf, b"1"), (math.nan, b"1"),
])
def test_429_always_carries_retry_after_rounded_up_to_a_whole_second(retry_after_s, header):
    status, headers, _ = error_answer(QueueFull("full", retry_after_s=retry_after_s), "GET /x")
    assert status == 429 and headers == [JSON, (b"retry-after", header)]


def test_503_carries_retry_after_only_when_it_knows_when():
    assert error_answer(RequestExpired("waited"), "w")[1] == [JSON]
    assert error_answer(ModelNotReady("soon", retry_after_s=1.5), "w")[1] == [
        JSON, (b"retry-after", b"2")]
    assert error_answer(ShuttingDown("bye", retry_after_s=0.2), "w")[1] == [
        JSON, (b"retry-after", b"1")]
    # other statuses never do, whatever the error suggests
    assert error_answer(ClientError("bad", retry_after_s=5.0), "w")[1] == [JSON]
    assert error_answer(ModelError("broke", retry_after_s=5.0), "w")[1] == [JSON]


def test_405_carries_allow():
    status, headers, body = error_answer(MethodNotAllowed("use POST", allow=["POST"]), "GET /i")
    assert status == 405 and headers == [JSON, (b"allow", b"POST")]
    assert orjson.loads(body) == {"error": "use POST"}
    headers = error_answer(MethodNotAllowed("no", allow=("GET", "HEAD")), "w")[1]
    assert dict(headers)[b"allow"] == b"GET, HEAD"


def test_body_is_to_dict_or_the_given_document():
    class Detailed(ClientError):
        def to_dict(self):
            return {**super().to_dict(), "field": "max_batch_size"}

    assert orjson.loads(error_answer(Detailed("too big"), "w")[2]) == {
        "error": "too big", "field": "max_batch_size"}
    status, _, body = error_answer(QueueFull("full"), "w", lambda e: {"e": e.reason})
    assert status == 429 and orjson.loads(body) == {"e": "rejected"}


def test_unknown_exception_is_a_500_without_internals_logged_once(caplog):
    try:
        raise RuntimeError("secret internals /srv/model.py line 12")
    except RuntimeError as exc:
        error = exc
    with caplog.at_level(logging.DEBUG, logger="batchscope.server"):
        status, headers, body = error_answer(error, "POST /v2/models/m/infer")
    message = orjson.loads(body)["error"]
    assert status == 500 and headers == [JSON] and set(orjson.loads(body)) == {"error"}
    assert message.startswith("internal error: ") and "(logged on the server" in message
    assert "POST /v2/models/m/infer" in message
    assert "secret" not in message and "Traceback" not in message and "RuntimeError" not in message
    [record] = caplog.records
    assert record.levelno == logging.ERROR and record.exc_info[1] is error
    assert "unexpected error answering POST /v2/models/m/infer" in record.getMessage()
    # the reference in the answer finds the log line
    ref = record.getMessage().split("reference ")[1].rstrip(")")
    assert len(ref) == 8 and ref in message
    # the document shape applies to the 500 too, and a long request name is cut short
    with caplog.at_level(logging.DEBUG, logger="batchscope.server"):
        _, _, body = error_answer(ValueError("x"), "GET /" + "a" * 10_000,
                                  lambda e: {"shaped": e.message})
    assert len(orjson.loads(body)["shaped"]) < 400


def test_starlette_adapters_keep_status_headers_and_body():
    r = error_response(QueueFull("queue is full", retry_after_s=2.2))
    assert r.status_code == 429 and r.headers["Retry-After"] == "3"
    assert r.headers["content-type"] == "application/json"
    assert orjson.loads(r.body) == {"error": "queue is full"}
    assert error_response(QueueFull("full")).headers["Retry-After"] == "1"
    expired = error_response(RequestExpired("waited too long"))
    assert expired.status_code == 503 and "retry-after" not in expired.headers


def test_generation_errors_have_the_openai_shape_and_the_same_retry_after():
    from runtime.generation.http import error_response as openai_error

    r = openai_error(QueueFull("full", retry_after_s=1.5))
    assert r.status_code == 429 and r.headers["Retry-After"] == "2"  # rounded up, not to nearest
    assert orjson.loads(r.body) == {"error": {"message": "full", "type": "rate_limit_error",
                                              "param": None, "code": "rate_limit_exceeded"}}
    bug = openai_error(KeyError("secret"), "POST /v1/completions")
    error = orjson.loads(bug.body)["error"]
    assert bug.status_code == 500 and error["type"] == "server_error"
    assert error["message"].startswith("internal error") and "secret" not in error["message"]


def test_routing_errors_say_what_to_do():
    missing = routing_error(404, "GET", "/x")
    assert isinstance(missing, RouteNotFound) and missing.http_status == 404
    assert missing.message == ('no route for GET /x; see "HTTP API" in docs/protocols.md for the '
                               "routes served")
    wrong = routing_error(405, "GET", "/v2/models/m/infer", ["POST"])
    assert error_answer(wrong, "w") == (405, [JSON, (b"allow", b"POST")], orjson.dumps(
        {"error": "GET is not accepted on /v2/models/m/infer; use POST"}))
    other = routing_error(400, "GET", "/x", detail="bad form")
    assert other.http_status == 400 and "bad form" in other.message


def test_standalone_generation_app_refuses_routes_in_the_openai_shape():
    from runtime.generation.http import create_app

    with TestClient(create_app({})) as client:
        missing = client.get("/nope")
        wrong = client.get("/v1/completions")
    assert missing.status_code == 404 and missing.json()["error"]["message"].startswith(
        "no route for GET /nope")
    assert wrong.status_code == 405 and wrong.headers["allow"] == "POST"
    assert wrong.json()["error"]["code"] == "method_not_allowed"


def test_guarded_route_answers_an_unknown_exception_with_a_bare_500_and_logs_it(caplog):
    app = Starlette(routes=[Route("/boom", guarded(explode))])
    with caplog.at_level(logging.ERROR, logger="batchscope.server"):
        r = TestClient(app).get("/boom")
    assert r.status_code == 500 and r.json()["error"].startswith("internal error")
    assert "secret" not in r.text
    assert len(internal_records(caplog)) == 1
    assert any("unexpected error answering GET /boom" in rec.getMessage() for rec in caplog.records)


# -- the two real inference paths -------------------------------------------------------------
class Served:
    """``build_app`` behind the real ``HttpServer`` on 127.0.0.1, with or without the
    ``InferHook`` fast path; counts the requests the hook took."""

    def __init__(self, fast: bool) -> None:
        from runtime.engine.engine import Engine
        from runtime.models.toys import DoubleModel
        from runtime.server.fastpath import InferHook
        from runtime.server.http1 import HttpServer
        from runtime.server.routes import build_app
        from runtime.server.service import bind_socket, new_event_loop

        self.app = build_app(Engine({"double": DoubleModel()}))
        self.taken = 0
        hook = InferHook(self.app.state)

        def counting(*args) -> bool:
            taken = hook(*args)
            self.taken += taken
            return taken

        self.loop = new_event_loop()
        self.sock = bind_socket("127.0.0.1", 0)
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self.server = HttpServer(self.app, fast=counting if fast else None)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self.app.state.engine.start())
        self.call(self.server.start(self.sock))

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT_S)

    def close(self) -> None:
        try:
            self.call(self.server.shutdown(TIMEOUT_S))
            self.call(self.app.state.engine.stop())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(TIMEOUT_S)
            self.loop.close()
            self.sock.close()


@pytest.mark.slow
def test_fast_path_and_starlette_route_answer_alike():
    good = {"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
            "id": "x"}
    bad = {"inputs": [{"name": "INPUT0", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]}]}
    answers = []
    taken = []
    for fast in (False, True):   # a fresh engine each time: an engine starts once
        served = Served(fast)
        try:
            with httpx.Client(base_url=served.url, timeout=TIMEOUT_S) as client:
                answers.append([(r.status_code, r.headers["content-type"], r.json()) for r in (
                    client.post("/v2/models/double/infer", json=good),
                    client.post("/v2/models/double/versions/1/infer", json=good),
                    client.post("/v2/models/double/versions/2/infer", json=good),
                    client.post("/v2/models/double/infer", json=bad),
                    client.post("/v2/models/nope/infer", json=good))])
        finally:
            served.close()
        taken.append(served.taken)
    assert taken == [0, 5]  # the second run really went through the hook
    assert answers[0] == answers[1]
    assert [status for status, _, _ in answers[1]] == [200, 200, 404, 400, 404]
    assert {media for _, media, _ in answers[1]} == {"application/json"}
    assert answers[1][0][2]["outputs"][0]["data"] == [2, 4, 6, 8]
