"""Limits of ``runtime.server.http1`` against slow and hostile clients, on 127.0.0.1.

Header and body timeouts (408), the connection limit (make room, else 503), the
budget of request-body bytes in flight (503 with Retry-After before the body is
read), write backpressure, and the ``early`` hook point. Servers run with short
limits (0.2 s); every test checks outcomes (status, closed or not, counts), never
durations, and every socket read is bounded by a timeout. Where a test needs time
to pass without anything happening, it calls ``HttpServer.expire`` with a clock
moved forward instead of waiting.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import orjson
import pytest

from runtime.server.http1 import EARLY_DRAIN_BYTES, Connection, HttpServer, default_max_connections
from runtime.server.service import bind_socket, new_event_loop
from tests.factories import Reader, request

pytestmark = pytest.mark.slow

TIMEOUT_S = 20.0
SHORT_S = 0.2
JSON = [(b"content-type", b"application/json")]


def error_of(body: bytes) -> str:
    doc = orjson.loads(body)
    assert set(doc) == {"error"}
    return doc["error"]


class Hook:
    """The fast hook: ``/slow`` is held until ``release`` is set, ``/fast`` answers at
    once with the body size; anything else goes to the ASGI app."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.release = threading.Event()
        self.seen: list[str] = []

    def __call__(self, conn, method, path, headers, body, answer) -> bool:
        self.seen.append(path)
        if path == "/slow":
            def poll() -> None:
                if self.release.is_set():
                    answer(200, JSON, b'{"slow": true}')
                else:
                    self.loop.call_later(0.005, poll)

            poll()
            return True
        if path == "/fast":
            answer(200, JSON, orjson.dumps({"body_bytes": len(body)}))
            return True
        return False


class EarlyHook(Hook):
    """A hook with ``early``: sheds ``/shed`` with 429 before the body is read."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(loop)
        self.early_seen: list[tuple[bytes, str]] = []

    def early(self, method, path, headers):
        self.early_seen.append((method, path))
        if path == "/shed":
            assert (b"host", b"127.0.0.1") in headers
            return 429, JSON + [(b"retry-after", b"1")], b'{"error": "queue full"}'
        if path == "/early-bug":
            raise RuntimeError("a bug in the early hook")
        return None


class Server:
    """An ``HttpServer`` with short limits on a loop in a thread."""

    def __init__(self, hook_class=Hook, **limits) -> None:
        self.loop = new_event_loop()
        self.hook = hook_class(self.loop)
        self.sock = bind_socket("127.0.0.1", 0)
        self.address = self.sock.getsockname()[:2]
        limits.setdefault("header_timeout_s", SHORT_S)
        limits.setdefault("body_timeout_s", SHORT_S)
        self.http = HttpServer(self.app, fast=self.hook, **limits)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.call(self.http.start(self.sock))

    async def app(self, scope, receive, send) -> None:
        message = await receive()
        await send({"type": "http.response.start", "status": 200, "headers": JSON})
        await send({"type": "http.response.body", "body": orjson.dumps(
            {"path": scope["path"], "body_bytes": len(message["body"])})})

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(TIMEOUT_S)

    def on_loop(self, fn):
        """Run ``fn()`` on the server's loop and return its result."""
        async def run():
            return fn()
        return self.call(run())

    def connect(self) -> tuple[socket.socket, Reader]:
        sock = socket.create_connection(self.address, timeout=TIMEOUT_S)
        return sock, Reader(sock)

    def wait_for(self, what, message: str) -> None:
        deadline = time.monotonic() + TIMEOUT_S
        while not self.on_loop(what):
            assert time.monotonic() < deadline, message
            time.sleep(0.005)

    def expire_later(self, seconds: float) -> None:
        """Check every connection as if ``seconds`` had passed."""
        self.on_loop(lambda: self.http.expire(self.loop.time() + seconds))

    def close(self) -> None:
        self.hook.release.set()
        try:
            self.call(self.http.shutdown(TIMEOUT_S))
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(TIMEOUT_S)
            self.loop.close()
            self.sock.close()


@pytest.fixture
def make_server():
    servers: list[Server] = []

    def make(hook_class=Hook, **limits) -> Server:
        servers.append(Server(hook_class, **limits))
        return servers[-1]

    yield make
    for server in servers:
        server.close()


# -- header and body timeouts --------------------------------------------------------------
def test_an_incomplete_head_is_answered_408_and_closed(make_server):
    server = make_server()
    sock, rd = server.connect()
    with sock:
        sock.sendall(b"POST /fast HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        status, headers, body = rd.response()
        assert status == 408 and headers["connection"] == "close"
        assert "request head" in error_of(body) and "within 0.2 s" in error_of(body)
        assert rd.closed()
    assert server.http.counts["header_timeouts"] == 1
    assert server.hook.seen == []


def test_a_trickled_head_is_cut_off_though_bytes_keep_coming(make_server):
    server = make_server()
    sock, rd = server.connect()
    with sock:
        sock.sendall(b"GET /fast HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: ")
        sock.settimeout(0.01)
        status = None
        deadline = time.monotonic() + TIMEOUT_S
        while status is None and time.monotonic() < deadline:
            try:
                sock.sendall(b"a")  # a byte at a time: the head never completes
            except OSError:
                pass
            try:
                if rd._fill() and b"\r\n\r\n" in rd.buf:
                    sock.settimeout(TIMEOUT_S)
                    status = rd.response()[0]
            except socket.timeout:
                pass
        assert status == 408
    assert server.http.counts["header_timeouts"] == 1


def test_a_body_shorter_than_its_content_length_is_answered_408(make_server):
    server = make_server()
    sock, rd = server.connect()
    with sock:
        sock.sendall(request("POST", "/fast", headers={"Content-Length": "100"}) + b"x" * 10)
        status, headers, body = rd.response()
        assert status == 408 and headers["connection"] == "close"
        assert "stalled" in error_of(body) and "10 of 100 bytes" in error_of(body)
        assert rd.closed()
    assert server.http.counts["body_timeouts"] == 1
    assert server.on_loop(lambda: server.http.inflight_body_bytes) == 0


def test_a_body_slower_than_the_minimum_rate_is_answered_408(make_server):
    server = make_server(min_body_bytes_per_s=10_000)
    sock, rd = server.connect()
    with sock:
        sock.sendall(request("POST", "/fast", headers={"Content-Length": "100000"}))
        sock.settimeout(0.02)
        status = None
        deadline = time.monotonic() + TIMEOUT_S
        while status is None and time.monotonic() < deadline:
            try:
                sock.sendall(b"x")  # some progress all the time, but far too little
            except OSError:
                pass
            try:
                if rd._fill() and b"\r\n\r\n" in rd.buf:
                    sock.settimeout(TIMEOUT_S)
                    status, _, body = rd.response()
            except socket.timeout:
                pass
        assert status == 408 and "too slowly" in error_of(body)
    assert server.http.counts["body_timeouts"] == 1


def test_idle_keep_alive_and_an_unrequested_body_are_not_timed(make_server):
    server = make_server()
    idle, idle_rd = server.connect()
    waiting, waiting_rd = server.connect()
    with idle, waiting:
        idle.sendall(request("POST", "/fast", b"abc"))
        assert idle_rd.response()[0] == 200
        # a body behind a held request, with Expect: the server has not asked for it
        waiting.sendall(request("GET", "/slow")
                        + request("POST", "/fast", headers={"Content-Length": "4",
                                                            "Expect": "100-continue"}))
        server.wait_for(lambda: any(c.current is not None for c in server.http.connections),
                        "the second head never arrived")
        server.expire_later(30.0)  # far past the head and body timeouts, before keep-alive
        server.hook.release.set()
        assert waiting_rd.response()[0] == 200
        assert waiting_rd.response()[0] == 100
        waiting.sendall(b"abcd")
        status, _, body = waiting_rd.response()
        assert status == 200 and orjson.loads(body) == {"body_bytes": 4}
        idle.sendall(request("POST", "/fast", b"de"))
        assert idle_rd.response()[0] == 200
        server.expire_later(61.0)  # past keep_alive_s: idle connections close as before
        assert idle_rd.closed() and waiting_rd.closed()
    assert server.http.counts["header_timeouts"] == server.http.counts["body_timeouts"] == 0


def test_a_client_that_reads_no_answers_is_dropped_after_keep_alive(make_server):
    server = make_server()
    sock, _ = server.connect()
    with sock:
        sock.sendall(request("GET", "/fast"))
        server.wait_for(lambda: len(server.http.connections) == 1, "no connection")

        def block() -> Connection:
            conn = next(iter(server.http.connections))
            conn.pause_writing()  # as the transport does when its buffer is full
            return conn

        conn = server.on_loop(block)
        server.expire_later(30.0)
        assert not conn.closed
        server.expire_later(61.0)
        server.wait_for(lambda: conn.closed, "the blocked connection was not dropped")
    assert server.http.counts["write_timeouts"] == 1


# -- the connection limit ---------------------------------------------------------------------
def test_at_the_connection_limit_the_longest_idle_connection_makes_room(make_server):
    server = make_server(max_connections=3)
    socks = [server.connect() for _ in range(3)]
    try:
        for sock, rd in socks:  # in order: the first is idle longest
            sock.sendall(request("POST", "/fast", b"x"))
            assert rd.response()[0] == 200
        newcomer, new_rd = server.connect()
        with newcomer:
            newcomer.sendall(request("POST", "/fast", b"yy"))
            assert new_rd.response()[0] == 200
            assert socks[0][1].closed()
            for sock, rd in socks[1:]:
                sock.sendall(request("POST", "/fast", b"z"))
                assert rd.response()[0] == 200
    finally:
        for sock, _ in socks:
            sock.close()
    assert server.http.counts["evicted_idle"] == 1


def test_at_the_connection_limit_a_stalled_head_is_closed_with_408(make_server):
    server = make_server(max_connections=2, header_timeout_s=60.0)
    stalled, stalled_rd = server.connect()
    busy, busy_rd = server.connect()
    with stalled, busy:
        stalled.sendall(b"GET /fast HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        server.wait_for(lambda: any(c.head_since for c in server.http.connections),
                        "the partial head never arrived")
        busy.sendall(request("GET", "/slow"))
        server.wait_for(lambda: "/slow" in server.hook.seen, "the held request never came")
        newcomer, new_rd = server.connect()
        with newcomer:
            status, _, body = stalled_rd.response()
            assert status == 408 and "make room" in error_of(body)
            newcomer.sendall(request("POST", "/fast", b"q"))
            assert new_rd.response()[0] == 200
        server.hook.release.set()
        assert busy_rd.response()[0] == 200  # the connection the server owed stays
    assert server.http.counts["evicted_mid_request"] == 1


def test_when_every_connection_waits_on_the_server_a_new_one_gets_503(make_server):
    server = make_server(max_connections=2)
    held = [server.connect() for _ in range(2)]
    try:
        for sock, _ in held:
            sock.sendall(request("GET", "/slow"))
        server.wait_for(lambda: server.hook.seen.count("/slow") == 2, "held requests missing")
        extra, extra_rd = server.connect()
        with extra:
            status, headers, body = extra_rd.response()
            assert status == 503 and headers["retry-after"] == "1"
            assert headers["connection"] == "close"
            assert "limit of 2 connections" in error_of(body)
            assert extra_rd.closed()
        server.hook.release.set()
        for _, rd in held:
            assert rd.response()[0] == 200
    finally:
        for sock, _ in held:
            sock.close()
    assert server.http.counts["refused_at_connection_limit"] == 1


def test_the_default_connection_limit_is_below_the_open_file_limit():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = default_max_connections()
    assert 16 <= limit and (soft == resource.RLIM_INFINITY or limit < soft)
    assert HttpServer(None).max_connections == limit
    with pytest.raises(ValueError, match="max_inflight_body_bytes"):
        HttpServer(None, max_body_bytes=100, max_inflight_body_bytes=50)
    with pytest.raises(ValueError, match="header_timeout_s must be positive"):
        HttpServer(None, header_timeout_s=0)


# -- the budget of body bytes in flight -------------------------------------------------------
def test_bodies_in_flight_share_one_budget_refused_by_declared_size(make_server):
    server = make_server(max_body_bytes=1000, max_inflight_body_bytes=1500,
                         body_timeout_s=60.0, header_timeout_s=60.0)
    http = server.http
    holder, holder_rd = server.connect()
    other, other_rd = server.connect()
    with holder, other:
        holder.sendall(request("POST", "/fast", headers={"Content-Length": "1000"}) + b"h" * 10)
        server.wait_for(lambda: http.inflight_body_bytes == 1000, "the body was not counted")
        # does not fit what is left: refused from its head, before any body byte
        other.sendall(request("POST", "/fast", headers={"Content-Length": "800"}))
        status, headers, body = other_rd.response()
        assert status == 503 and headers["retry-after"] == "1"
        assert "does not fit the 500 bytes left" in error_of(body)
        assert other_rd.closed()
        small, small_rd = server.connect()
        with small:  # what fits is served meanwhile
            small.sendall(request("POST", "/fast", b"s" * 400))
            assert small_rd.response()[0] == 200
            chunked = b"".join(b"%x\r\n%b\r\n" % (300, b"c" * 300) for _ in range(2)) + b"0\r\n\r\n"
            small.sendall(request("POST", "/fast", headers={"Transfer-Encoding": "chunked"})
                          + chunked)  # counted as it arrives: the second chunk does not fit
            status, _, body = small_rd.response()
            assert status == 503 and "600 bytes so far" in error_of(body)
        too_big, too_big_rd = server.connect()
        with too_big:  # over the per-request limit is a 413, as before
            too_big.sendall(request("POST", "/fast", headers={"Content-Length": "1001"}))
            assert too_big_rd.response()[0] == 413
        holder.sendall(b"h" * 990)
        status, _, body = holder_rd.response()
        assert status == 200 and orjson.loads(body) == {"body_bytes": 1000}
        server.wait_for(lambda: http.inflight_body_bytes == 0, "the budget was not given back")
        again, again_rd = server.connect()
        with again:
            again.sendall(request("POST", "/fast", b"a" * 800))
            assert again_rd.response()[0] == 200
    assert http.counts["refused_body_budget"] == 2


def test_a_client_gone_mid_body_gives_its_bytes_back(make_server):
    server = make_server(max_body_bytes=1000, max_inflight_body_bytes=1000, body_timeout_s=60.0)
    sock, _ = server.connect()
    sock.sendall(request("POST", "/fast", headers={"Content-Length": "900"}) + b"x")
    server.wait_for(lambda: server.http.inflight_body_bytes == 900, "the body was not counted")
    sock.close()
    server.wait_for(lambda: server.http.inflight_body_bytes == 0, "the bytes were not given back")


# -- the early hook point ------------------------------------------------------------------
def test_an_early_answer_comes_before_the_body_and_keeps_the_connection(make_server):
    server = make_server(EarlyHook)
    sock, rd = server.connect()
    with sock:
        sock.sendall(request("POST", "/shed", headers={"Content-Length": "500"}))
        status, headers, body = rd.response()  # without having sent a byte of the body
        assert status == 429 and headers["retry-after"] == "1" and "connection" not in headers
        assert orjson.loads(body) == {"error": "queue full"}
        sock.sendall(b"b" * 500 + request("POST", "/fast", b"xyz"))
        status, _, body = rd.response()
        assert status == 200 and orjson.loads(body) == {"body_bytes": 3}
    assert server.hook.seen == ["/fast"]  # the shed request never reached the hook
    assert server.hook.early_seen == [(b"POST", "/shed"), (b"POST", "/fast")]
    assert server.on_loop(lambda: server.http.inflight_body_bytes) == 0


def test_early_answers_close_when_the_body_is_not_worth_reading(make_server):
    server = make_server(EarlyHook, max_body_bytes=4 * EARLY_DRAIN_BYTES,
                         max_inflight_body_bytes=4 * EARLY_DRAIN_BYTES)
    cases = [{"Content-Length": str(2 * EARLY_DRAIN_BYTES)},
             {"Transfer-Encoding": "chunked"},
             {"Content-Length": "10", "Expect": "100-continue"},
             {"Content-Length": "10", "Connection": "close"}]
    for headers in cases:
        sock, rd = server.connect()
        with sock:
            sock.sendall(request("POST", "/shed", headers=headers))
            status, answer_headers, _ = rd.response()
            assert status == 429 and answer_headers["connection"] == "close", headers
            assert rd.closed(), headers
    assert server.hook.seen == []


def test_early_answers_keep_pipeline_order_and_none_goes_on(make_server):
    server = make_server(EarlyHook)
    sock, rd = server.connect()
    with sock:
        sock.sendall(request("GET", "/slow") + request("POST", "/shed", b"12345")
                     + request("POST", "/fast", b"12") + request("GET", "/app?x=1"))
        server.wait_for(lambda: "/fast" in server.hook.seen, "the pipeline was not read")
        server.hook.release.set()
        answers = [rd.response() for _ in range(4)]
    assert [a[0] for a in answers] == [200, 429, 200, 200]
    assert orjson.loads(answers[0][2]) == {"slow": True}
    assert orjson.loads(answers[3][2])["path"] == "/app"
    # a target with a query goes to the app without asking early, as the fast hook does
    assert [p for _, p in server.hook.early_seen] == ["/slow", "/shed", "/fast"]


def test_a_failing_early_hook_is_a_500_without_internals(make_server):
    server = make_server(EarlyHook)
    sock, rd = server.connect()
    with sock:
        sock.sendall(request("POST", "/early-bug", b"abc"))
        status, _, body = rd.response()
        assert status == 500 and error_of(body).startswith("internal error")
        assert "a bug in the early hook" not in error_of(body)
        sock.sendall(request("POST", "/fast", b"1"))
        assert rd.response()[0] == 200
