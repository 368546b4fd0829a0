"""HTTP/1.1 behaviour of ``runtime.server.http1`` over raw sockets on 127.0.0.1.

Two servers: the real ``Service`` (inference fast path + Starlette routes, a
``DoubleModel`` that can be held inside ``predict``), and a bare ``HttpServer``
around a tiny ASGI app for streaming, body limits and shutdown. Every socket read
is bounded by a timeout; outcomes are checked by content, never by duration.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import orjson
import pytest

from runtime.api.config import BatchingConfig, ServerConfig
from runtime.models.toys import DoubleModel
from runtime.server.http1 import HttpServer
from runtime.server.service import Service, ServiceThread, bind_socket, new_event_loop
from tests.factories import Reader, request

pytestmark = pytest.mark.slow

TIMEOUT_S = 20.0
INFER = "/v2/models/double/infer"


def infer_body(value: float) -> bytes:
    return orjson.dumps({"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32",
                                     "data": [value] * 4}]})


def connect(url: str) -> tuple[socket.socket, Reader]:
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
    return sock, Reader(sock)


@pytest.fixture(scope="module")
def service():
    hold = threading.Event()
    hold.set()
    models = {"double": DoubleModel(hold=hold)}
    cfg = ServerConfig(record=False)
    svc = Service(models, {"double": BatchingConfig(max_batch_size=8)}, cfg,
                  instance_id="http1-test")
    runner = ServiceThread(svc)
    url = runner.start()
    yield {"url": url, "hold": hold, "service": svc}
    hold.set()
    runner.stop()


def outputs(body: bytes) -> list[float]:
    return orjson.loads(body)["outputs"][0]["data"]


def test_keep_alive_serves_many_requests_on_one_connection(service):
    sock, rd = connect(service["url"])
    with sock:
        for v in (1.0, 2.0, 3.0):
            sock.sendall(request("POST", INFER, infer_body(v)))
            status, headers, body = rd.response()
            assert status == 200 and headers["content-type"] == "application/json"
            assert outputs(body) == [2 * v] * 4
            assert "connection" not in headers
        sock.sendall(request("GET", "/v2/health/live"))
        status, _, body = rd.response()
        assert status == 200 and orjson.loads(body) == {"live": True}


def test_connection_close_and_http10(service):
    sock, rd = connect(service["url"])
    with sock:
        sock.sendall(request("POST", INFER, infer_body(1.0), headers={"Connection": "close"}))
        status, headers, _ = rd.response()
        assert status == 200 and headers["connection"] == "close"
        assert rd.closed()
    sock, rd = connect(service["url"])
    with sock:
        sock.sendall(request("GET", "/v2/health/live", version="1.0"))
        status, headers, _ = rd.response()
        assert status == 200 and headers["connection"] == "close"
        assert rd.closed()
    sock, rd = connect(service["url"])
    with sock:
        for _ in range(2):
            sock.sendall(request("POST", INFER, infer_body(4.0), version="1.0",
                                 headers={"Connection": "keep-alive"}))
            status, headers, body = rd.response()
            assert status == 200 and headers["connection"] == "keep-alive"
            assert outputs(body) == [8.0] * 4


def test_pipelined_requests_are_answered_in_order(service):
    sock, rd = connect(service["url"])
    with sock:
        burst = (request("POST", INFER, infer_body(1.0)) + request("GET", "/v2/health/live")
                 + request("POST", INFER, infer_body(2.0))
                 + request("POST", "/v2/models/nope/infer", infer_body(3.0))
                 + request("POST", INFER, infer_body(5.0)))
        sock.sendall(burst)
        answers = [rd.response() for _ in range(5)]
    assert [a[0] for a in answers] == [200, 200, 200, 404, 200]
    assert outputs(answers[0][2]) == [2.0] * 4
    assert orjson.loads(answers[1][2]) == {"live": True}
    assert outputs(answers[2][2]) == [4.0] * 4
    assert "unknown model 'nope'" in orjson.loads(answers[3][2])["error"]
    assert outputs(answers[4][2]) == [10.0] * 4


def test_expect_100_continue_then_body(service):
    sock, rd = connect(service["url"])
    body = infer_body(6.0)
    with sock:
        head = request("POST", INFER, headers={"Content-Length": str(len(body)),
                                               "Expect": "100-continue"})
        sock.sendall(head)
        status, _, _ = rd.response()
        assert status == 100
        sock.sendall(body)
        status, _, answer = rd.response()
        assert status == 200 and outputs(answer) == [12.0] * 4


def test_chunked_request_body(service):
    sock, rd = connect(service["url"])
    body = infer_body(7.0)
    chunked = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in (body[:10], body[10:])) + b"0\r\n\r\n"
    with sock:
        sock.sendall(request("POST", INFER, headers={"Transfer-Encoding": "chunked"}) + chunked)
        status, _, answer = rd.response()
        assert status == 200 and outputs(answer) == [14.0] * 4


@pytest.mark.parametrize("coding", ["gzip, chunked", "deflate, chunked", "identity"])
def test_a_transfer_coding_other_than_chunked_is_refused_saying_what_to_send(service, coding):
    sock, rd = connect(service["url"])
    body = infer_body(7.0)
    chunked = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    with sock:
        sock.sendall(request("POST", INFER, headers={"Transfer-Encoding": coding}) + chunked)
        status, _, answer = rd.response()
        assert status == 400 and "Content-Encoding" in orjson.loads(answer)["error"]


@pytest.mark.parametrize("version, hosts", [("1.1", 0), ("1.1", 2), ("1.0", 2)])
def test_a_request_without_exactly_one_host_is_refused(service, version, hosts):
    sock, rd = connect(service["url"])
    head = (f"GET /v2/health/live HTTP/{version}\r\n" + "Host: 127.0.0.1\r\n" * hosts
            + "\r\n").encode()
    with sock:
        sock.sendall(head)
        status, _, answer = rd.response()
        assert status == 400 and "one Host header" in orjson.loads(answer)["error"]


def test_an_http_1_0_request_may_leave_host_out(service):
    sock, rd = connect(service["url"])
    with sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.0\r\n\r\n")
        status, _, answer = rd.response()
        assert status == 200 and orjson.loads(answer) == {"live": True}


def test_head_answers_headers_only(service):
    sock, rd = connect(service["url"])
    with sock:
        sock.sendall(request("HEAD", "/v2/health/live"))
        status, headers, _ = rd.response(head_only=True)
        assert status == 200 and int(headers["content-length"]) > 0
        sock.sendall(request("GET", "/v2/health/live"))
        status, headers, body = rd.response()
        assert status == 200 and orjson.loads(body) == {"live": True}


def test_malformed_request_gets_400_and_close(service):
    sock, rd = connect(service["url"])
    with sock:
        sock.sendall(b"GARBAGE \x00\x01 nonsense\r\n\r\n")
        status, headers, body = rd.response()
        assert status == 400 and headers["connection"] == "close"
        assert "malformed HTTP request" in orjson.loads(body)["error"]
        assert rd.closed()


def test_bad_inference_requests_answer_like_the_app(service):
    sock, rd = connect(service["url"])
    with sock:
        sock.sendall(request("POST", INFER, b"{not json"))
        status, _, body = rd.response()
        assert status == 400 and "not valid JSON" in orjson.loads(body)["error"]
        sock.sendall(request("POST", "/v2/models/double/versions/7/infer", infer_body(1.0)))
        status, _, body = rd.response()
        assert status == 404 and "no version '7'" in orjson.loads(body)["error"]
        sock.sendall(request("POST", "/v2/models/double/versions/1/infer", infer_body(1.5)))
        status, _, body = rd.response()
        assert status == 200 and outputs(body) == [3.0] * 4
        sock.sendall(request("GET", INFER))
        status, _, _ = rd.response()
        assert status == 405


def test_client_gone_mid_request_still_gets_one_outcome(service):
    svc: Service = service["service"]
    hold = service["hold"]
    engine = svc.engine
    before = engine.stats("double")["requests_by_outcome"].get("ok", 0)
    hold.clear()
    try:
        sock, _ = connect(service["url"])
        sock.sendall(request("POST", INFER, infer_body(1.0)))
        deadline = time.monotonic() + TIMEOUT_S
        while engine.stats("double")["in_flight"] == 0 and engine.stats("double")["queue_depth"] == 0:
            assert time.monotonic() < deadline, "the request never reached the engine"
            time.sleep(0.01)
        sock.close()
    finally:
        hold.set()
    deadline = time.monotonic() + TIMEOUT_S
    while engine.stats("double")["requests_by_outcome"].get("ok", 0) != before + 1:
        assert time.monotonic() < deadline, "the abandoned request got no outcome"
        time.sleep(0.01)
    sock, rd = connect(service["url"])
    with sock:
        sock.sendall(request("POST", INFER, infer_body(2.0)))
        status, _, body = rd.response()
        assert status == 200 and outputs(body) == [4.0] * 4


# -- a bare HttpServer around a small ASGI app ----------------------------------------------
class Bare:
    """``HttpServer`` in a thread; the fast hook holds ``/slow`` until ``release`` is set."""

    def __init__(self, *, max_body_bytes: int = 1000) -> None:
        self.release = threading.Event()
        self.loop = new_event_loop()
        self.sock = bind_socket("127.0.0.1", 0)
        host, port = self.sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self.server = HttpServer(self.asgi, fast=self.fast, max_body_bytes=max_body_bytes)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(self.sock), self.loop).result(TIMEOUT_S)

    def fast(self, conn, method, path, headers, body, answer) -> bool:
        if path != "/slow":
            return False

        def poll() -> None:
            if self.release.is_set():
                answer(200, [(b"content-type", b"text/plain")], b"slow done")
            else:
                self.loop.call_later(0.005, poll)

        poll()
        return True

    async def asgi(self, scope, receive, send) -> None:
        message = await receive()
        if scope["path"] == "/stream":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/plain")]})
            for part in (b"one ", b"two ", b"three"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if scope["path"] == "/boom":
            raise RuntimeError("a bug in the app")
        reply = orjson.dumps({"path": scope["path"], "query": scope["query_string"].decode(),
                              "method": scope["method"], "body_bytes": len(message["body"])})
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": reply})

    def shutdown(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.shutdown(TIMEOUT_S), self.loop).result(TIMEOUT_S)

    def close(self) -> None:
        self.release.set()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(TIMEOUT_S)
        self.loop.close()
        self.sock.close()


@pytest.fixture
def bare():
    server = Bare()
    yield server
    server.close()


def test_asgi_bridge_streams_with_chunked_encoding(bare):
    sock, rd = connect(bare.url)
    with sock:
        sock.sendall(request("GET", "/stream"))
        status, headers, body = rd.response()
        assert status == 200 and headers["transfer-encoding"] == "chunked"
        assert body == b"one two three"
        sock.sendall(request("GET", "/a%20b?x=1", b"12345"))
        status, _, body = rd.response()
        assert orjson.loads(body) == {"path": "/a b", "query": "x=1", "method": "GET",
                                      "body_bytes": 5}
    sock, rd = connect(bare.url)
    with sock:  # HTTP/1.0 has no chunked encoding: the body ends with the connection
        sock.sendall(request("GET", "/stream", version="1.0"))
        status, headers, body = rd.response()
        assert "transfer-encoding" not in headers and headers["connection"] == "close"
        assert body == b"one two three"


def test_app_error_is_a_500_and_the_connection_lives_on(bare):
    sock, rd = connect(bare.url)
    with sock:
        sock.sendall(request("GET", "/boom"))
        status, _, body = rd.response()
        message = orjson.loads(body)["error"]
        assert status == 500 and message.startswith("internal error")
        assert "a bug in the app" not in message
        sock.sendall(request("GET", "/after"))
        assert rd.response()[0] == 200


def test_body_limit_is_a_413_and_close(bare):
    sock, rd = connect(bare.url)
    with sock:
        sock.sendall(request("POST", "/x", b"a" * 1001))
        status, headers, body = rd.response()
        assert status == 413 and headers["connection"] == "close"
        assert "larger than this server accepts (1000 bytes)" in orjson.loads(body)["error"]
        assert rd.closed()
    sock, rd = connect(bare.url)
    with sock:  # with Expect: the refusal comes instead of 100 Continue
        sock.sendall(request("POST", "/x", headers={"Content-Length": "5000",
                                                    "Expect": "100-continue"}))
        assert rd.response()[0] == 413
    sock, rd = connect(bare.url)
    with sock:  # chunked bodies are counted as they arrive
        big = b"".join(b"%x\r\n%b\r\n" % (400, b"b" * 400) for _ in range(3)) + b"0\r\n\r\n"
        sock.sendall(request("POST", "/x", headers={"Transfer-Encoding": "chunked"}) + big)
        assert rd.response()[0] == 413


def test_pipelined_fast_and_asgi_answers_keep_order(bare):
    sock, rd = connect(bare.url)
    with sock:
        sock.sendall(request("GET", "/slow") + request("GET", "/quick"))
        bare.loop.call_soon_threadsafe(lambda: None)
        bare.release.set()
        first, second = rd.response(), rd.response()
    assert first[2] == b"slow done"
    assert orjson.loads(second[2])["path"] == "/quick"


def test_graceful_shutdown_finishes_in_flight_then_closes(bare):
    idle, idle_rd = connect(bare.url)
    busy, busy_rd = connect(bare.url)
    with idle, busy:
        idle.sendall(request("GET", "/warm"))
        assert idle_rd.response()[0] == 200
        busy.sendall(request("GET", "/slow"))
        done = threading.Thread(target=bare.shutdown)
        # wait until the request is in: the server sees one busy connection
        deadline = time.monotonic() + TIMEOUT_S
        while not any(c.queue for c in list(bare.server.connections)):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        done.start()
        assert idle_rd.closed()  # idle connections close at once
        bare.release.set()
        status, headers, body = busy_rd.response()
        assert status == 200 and body == b"slow done" and headers["connection"] == "close"
        assert busy_rd.closed()
        done.join(TIMEOUT_S)
        assert not done.is_alive()
    with pytest.raises(OSError):
        socket.create_connection(bare.sock.getsockname()[:2], timeout=TIMEOUT_S).recv(1)


def test_draining_answers_what_was_taken_in_and_refuses_the_rest(bare):
    refusal = (503, [(b"content-type", b"application/json"), (b"retry-after", b"1")],
               b'{"error": "draining"}')
    asked: list[tuple[bytes, str]] = []

    def hook(method: bytes, path: str):
        asked.append((method, path))
        return None if path == "/live" else refusal

    async def start_draining() -> asyncio.Future:
        return bare.server.drain(hook)

    async def drain(owed: asyncio.Future) -> None:
        await owed

    def refused(rd: Reader) -> bool:
        status, headers, body = rd.response()
        return (status == 503 and headers["retry-after"] == "1"
                and headers["connection"] == "close" and body == refusal[2] and rd.closed())

    idle, idle_rd = connect(bare.url)
    busy, busy_rd = connect(bare.url)
    with idle, busy:
        idle.sendall(request("GET", "/warm"))
        assert idle_rd.response()[0] == 200
        busy.sendall(request("GET", "/slow"))
        deadline = time.monotonic() + TIMEOUT_S
        while not any(c.queue for c in list(bare.server.connections)):
            assert time.monotonic() < deadline
            time.sleep(0.005)
        owed = asyncio.run_coroutine_threadsafe(start_draining(), bare.loop).result(TIMEOUT_S)
        drained = asyncio.run_coroutine_threadsafe(drain(owed), bare.loop)
        # the idle keep-alive connection stays open: a request on it is refused, then closed
        idle.sendall(request("POST", "/x?a=1", b"12345"))
        assert refused(idle_rd)
        fresh, fresh_rd = connect(bare.url)  # still listening
        with fresh:
            fresh.sendall(request("GET", "/v1/anything"))
            assert refused(fresh_rd)
        live, live_rd = connect(bare.url)
        with live:  # what the hook lets through is served, as the last on its connection
            live.sendall(request("GET", "/live"))
            status, headers, _ = live_rd.response()
            assert status == 200 and headers["connection"] == "close" and live_rd.closed()
        assert not drained.done()  # /slow was taken in before: still owed
        assert bare.server.owed_answers() == 1
        bare.release.set()
        status, headers, body = busy_rd.response()
        assert status == 200 and body == b"slow done"
        drained.result(TIMEOUT_S)
        busy.sendall(request("GET", "/after"))
        assert refused(busy_rd)
    assert asked == [(b"POST", "/x"), (b"GET", "/v1/anything"), (b"GET", "/live"),
                     (b"GET", "/after")]
    assert bare.server.counts["drain_refusals"] == 3
    bare.shutdown()
    with pytest.raises(OSError):
        socket.create_connection(bare.sock.getsockname()[:2], timeout=TIMEOUT_S).recv(1)


def test_a_long_pipeline_is_answered_in_order(bare):
    sock, rd = connect(bare.url)
    with sock:
        sock.sendall(b"".join(request("GET", f"/q?i={i}") for i in range(150)))
        queries = [orjson.loads(rd.response()[2])["query"] for _ in range(150)]
    assert queries == [f"i={i}" for i in range(150)]
