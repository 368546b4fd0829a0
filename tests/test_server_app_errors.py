"""Error answers of the HTTP layer, without a running engine."""

from __future__ import annotations

import logging

from starlette.applications import Starlette
from starlette.routing import Route
from starlette.testclient import TestClient

from runtime.errors import QueueFull, RequestExpired
from runtime.server.app import error_response, guarded


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
