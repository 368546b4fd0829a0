"""Every refusal of the real server is a JSON error, never a plain-text page, a 500 or
a traceback in the log: unknown routes (404), wrong methods (405 with ``Allow``),
methods the server does not serve (``CONNECT``, ``TRACE``...), URLs over 64 KiB.

The real ``Service`` (fast inference hook + Starlette routes on the HTTP/1 server)
runs on an ephemeral 127.0.0.1 port; requests go over raw sockets or httpx, every
read bounded by a timeout.
"""

from __future__ import annotations

import logging
import re
import socket

import httpx
import orjson
import pytest

from runtime.api.config import BatchingConfig, ServerConfig
from runtime.models.toys import DoubleModel
from runtime.server.http1 import MAX_URL_BYTES
from runtime.server.service import Service, ServiceThread

pytestmark = pytest.mark.slow

TIMEOUT_S = 20.0
INFER = "/v2/models/double/infer"


@pytest.fixture(scope="module")
def url():
    svc = Service({"double": DoubleModel()}, {"double": BatchingConfig(max_batch_size=8)},
                  ServerConfig(record=False), instance_id="errors-json-test")
    runner = ServiceThread(svc)
    yield runner.start()
    runner.stop()


@pytest.fixture
def http(url):
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as client:
        yield client


@pytest.fixture
def quiet_log(caplog):
    """Fails the test when the server logs a warning or worse (a traceback, a 500)."""
    with caplog.at_level(logging.WARNING):
        yield
    noisy = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert not noisy, [r.getMessage() for r in noisy]


def raw(url: str, data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``data`` on a fresh connection; the first response (Content-Length framed)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(data)
        buf = b""
        while b"\r\n\r\n" not in buf:
            chunk = sock.recv(65536)
            assert chunk, f"closed before a response head; got {buf!r}"
            buf += chunk
        head, body = buf.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines)}
        length = int(headers["content-length"])
        while len(body) < length:
            chunk = sock.recv(65536)
            assert chunk, "closed mid-body"
            body += chunk
        return int(status_line.split()[1]), headers, body[:length]


def head(method: str, target: str) -> bytes:
    return f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode()


def error_of(headers: dict[str, str], body: bytes) -> str:
    assert headers["content-type"] == "application/json"
    doc = orjson.loads(body)
    assert set(doc) == {"error"} and isinstance(doc["error"], str)
    return doc["error"]


# -- unknown routes and wrong methods ---------------------------------------------------------
@pytest.mark.parametrize("method, path", [
    ("GET", "/x"), ("GET", "/v2/nothing/here"), ("POST", "/v2/models"), ("DELETE", "/x"),
    ("GET", "/v2/models/double/infer/more"),
    # a slash added is not found (no redirect: it would name whatever Host the client sent)
    ("POST", f"{INFER}/"), ("GET", "/v2/health/live/"), ("POST", "/v2/trace/setting/"),
])
def test_unknown_route_is_a_json_404_naming_the_request(http, quiet_log, method, path):
    r = http.request(method, path)
    assert r.status_code == 404 and r.headers["content-type"] == "application/json"
    assert r.json() == {"error": f"no route for {method} {path}; see \"HTTP API\" in "
                                 "docs/protocols.md for the routes served"}


def test_head_of_an_unknown_route_is_a_404_without_a_body(http, quiet_log):
    r = http.head("/x")
    assert r.status_code == 404 and r.content == b""
    assert r.headers["content-type"] == "application/json"


@pytest.mark.parametrize("method, path, allow", [
    ("GET", INFER, "POST"),
    ("PUT", "/v2/models/double/versions/1/infer", "POST"),
    ("POST", "/v2/health/live", "GET, HEAD"),
    ("DELETE", "/v2/models/double/batching", "GET, HEAD, PATCH, POST"),
    ("PATCH", "/metrics", "GET, HEAD"),
    ("OPTIONS", "/v2", "GET, HEAD"),
])
def test_wrong_method_is_a_json_405_with_allow(http, quiet_log, method, path, allow):
    r = http.request(method, path)
    assert r.status_code == 405 and r.headers["allow"] == allow
    message = error_of(r.headers, r.content)
    assert message.startswith(f"{method} is not accepted on {path}; use ")
    assert all(m in message for m in allow.split(", "))


# -- methods the server does not serve ---------------------------------------------------------
@pytest.mark.parametrize("request_head", [
    b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
    head("TRACE", "/v2"), head("PROPFIND", "/v2"), head("MKCOL", INFER),
])
def test_unsupported_method_is_a_json_405_and_close(url, quiet_log, request_head):
    status, headers, body = raw(url, request_head)
    method = request_head.split(b" ", 1)[0].decode()
    assert status == 405 and headers["connection"] == "close"
    assert headers["allow"] == "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"
    assert error_of(headers, body).startswith(f"{method} is not supported: ")


def test_connect_says_the_server_is_not_a_proxy(url, quiet_log):
    _, headers, body = raw(url, b"CONNECT example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n")
    assert "not a proxy" in error_of(headers, body)


def test_unknown_method_token_is_a_json_400(url, quiet_log):
    status, headers, body = raw(url, head("BREW", "/v2"))
    assert status == 400 and "malformed HTTP request" in error_of(headers, body)


# -- URL length -----------------------------------------------------------------------------------
@pytest.mark.parametrize("method, target", [
    ("GET", "/v2/health/live?pad=" + "a" * MAX_URL_BYTES),
    ("GET", "/" + "a" * (MAX_URL_BYTES + 1)),
    ("POST", "/v2/models/" + "m" * MAX_URL_BYTES + "/infer"),  # the fast path's route
    ("POST", INFER + "?pad=" + "b" * (2 * MAX_URL_BYTES)),
])
def test_url_over_the_limit_is_a_json_414_on_any_route(url, quiet_log, method, target):
    status, headers, body = raw(url, head(method, target))
    assert status == 414 and headers["connection"] == "close"
    assert f"({MAX_URL_BYTES} bytes)" in error_of(headers, body)


def test_a_huge_url_is_answered_not_reset(url, quiet_log):
    # the server drains what the client still sends after the refusal, so the client
    # reads the 414 instead of a connection reset
    status, headers, body = raw(url, head("GET", "/" + "a" * (128 * MAX_URL_BYTES)))
    assert status == 414 and f"({MAX_URL_BYTES} bytes)" in error_of(headers, body)


def test_a_refusal_behind_a_pipelined_request_is_answered_in_order(url, quiet_log):
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=TIMEOUT_S) as sock:
        sock.sendall(head("GET", "/v2/health/live") + head("TRACE", "/v2")
                     + head("GET", "/v2/health/live"))
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    statuses = [int(code) for code in re.findall(rb"HTTP/1\.1 (\d{3}) ", data)]
    assert statuses == [200, 405]  # nothing after the refusal is answered


def test_a_long_url_under_the_limit_is_routed(http, quiet_log):
    r = http.get("/v2/health/live", params={"pad": "a" * (MAX_URL_BYTES - 100)})
    assert r.status_code == 200 and r.json() == {"live": True}
    r = http.get("/" + "a" * (MAX_URL_BYTES - 100))
    assert r.status_code == 404 and r.json()["error"].startswith("no route for GET /aaa")


def test_refusals_leave_the_server_serving(url, http, quiet_log):
    raw(url, b"CONNECT example.com:443 HTTP/1.1\r\nHost: x\r\n\r\n")
    raw(url, head("GET", "/" + "a" * (MAX_URL_BYTES + 1)))
    r = http.post(INFER, json={"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32",
                                           "data": [1, 2, 3, 4]}]})
    assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2, 4, 6, 8]
