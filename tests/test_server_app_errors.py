"""Error answers of the HTTP layer, without a running engine."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from runtime.api.errors import QueueFull, RequestExpired
from runtime.server.routes import error_response, guarded


async def explode(request):
    raise RuntimeError("secret internals /srv/model.py line 12")


def test_unknown_exception_is_a_bare_500_and_is_logged(caplog):
    app = Starlette(routes=[Route("/boom", guarded(explode))])
    with caplog.at_level(logging.ERROR, logger="batchscope.server"):
        r = TestClient(app).get("/boom")
    assert r.status_code == 500 and r.json() == {"error": "internal error"}
    assert "secret" not in r.text
    assert any("unexpected error answering GET /boom" in rec.getMessage() for rec in caplog.records)


def test_queue_full_carries_retry_after_rounded_up():
    r = error_response(QueueFull("queue is full", retry_after_s=2.2))
    assert r.status_code == 429 and r.headers["Retry-After"] == "3"
    assert error_response(QueueFull("full")).headers["Retry-After"] == "1"
    expired = error_response(RequestExpired("waited too long"))
    assert expired.status_code == 503 and "retry-after" not in expired.headers


def test_fast_path_and_starlette_route_answer_alike():
    import contextlib

    from runtime.engine.engine import Engine
    from runtime.models.toys import DoubleModel
    from runtime.server.routes import FastInfer, build_app

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await app.state.engine.start()
        yield
        await app.state.engine.stop()

    good = {"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32", "data": [1, 2, 3, 4]}],
            "id": "x"}
    bad = {"inputs": [{"name": "INPUT0", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]}]}
    answers = []
    for fast in (False, True):   # a fresh engine each time: an engine starts once
        app = build_app(Engine({"double": DoubleModel()}), lifespan=lifespan)
        with TestClient(FastInfer(app) if fast else app) as client:
            answers.append([(r.status_code, r.json()) for r in (
                client.post("/v2/models/double/infer", json=good),
                client.post("/v2/models/double/versions/1/infer", json=good),
                client.post("/v2/models/double/versions/2/infer", json=good),
                client.post("/v2/models/double/infer", json=bad),
                client.post("/v2/models/nope/infer", json=good))])
    assert answers[0] == answers[1]
    assert [status for status, _ in answers[1]] == [200, 200, 404, 400, 404]
    assert answers[1][0][1]["outputs"][0]["data"] == [2, 4, 6, 8]
