"""The load generator's HTTP client against awkward but valid servers: responses split
across packets, ``Connection: close`` after every answer, a kept-alive connection that
the server drops without answering. Every request still gets exactly one outcome."""

from __future__ import annotations

import asyncio
import threading

import pytest

from batchscope.load.loadgen import run_load


class _Awkward(asyncio.Protocol):
    """Answers each request with a 200 whose bytes arrive in small pieces; ``mode``
    picks the awkwardness: ``split`` (pieces only), ``close`` (``Connection: close``
    after each answer), ``drop`` (every third connection closes on its second request
    without answering)."""

    count = 0

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.buf = b""
        self.served = 0
        _Awkward.count += 1
        self.number = _Awkward.count

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            size = 0
            for line in self.buf[:end].lower().split(b"\r\n"):
                if line.startswith(b"content-length:"):
                    size = int(line[15:])
            if len(self.buf) < end + 4 + size:
                return
            self.buf = self.buf[end + 4 + size:]
            self.served += 1
            if self.mode == "drop" and self.number % 3 == 0 and self.served == 2:
                self.transport.close()
                return
            body = b'{"outputs": []}'
            close = b"connection: close\r\n" if self.mode == "close" else b""
            resp = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n" + close +
                    b"content-length: %d\r\n\r\n" % len(body) + body)
            loop = asyncio.get_running_loop()
            for k, piece in enumerate((resp[:7], resp[7:30], resp[30:-3], resp[-3:])):
                loop.call_later(0.0005 * k, self.transport.write, piece)
            if self.mode == "close":
                loop.call_later(0.002, self.transport.close)
                return


@pytest.fixture(params=["split", "close", "drop"])
def awkward_url(request):
    ready = threading.Event()
    box: dict = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        box["loop"] = loop
        server = loop.run_until_complete(
            loop.create_server(lambda: _Awkward(request.param), "127.0.0.1", 0))
        box["port"] = server.sockets[0].getsockname()[1]
        ready.set()
        loop.run_forever()
        server.close()
        loop.run_until_complete(server.wait_closed())
        loop.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{box['port']}"
    box["loop"].call_soon_threadsafe(box["loop"].stop)
    thread.join(10)


def test_every_request_gets_one_outcome_from_an_awkward_server(awkward_url):
    report = run_load(awkward_url, "m", concurrency=6, duration_s=30, max_requests=120,
                      payloads=[b"{}"], path="/")
    assert report.sent == 120
    assert report.ok + sum(report.errors_by_status.values()) == 120
    # a connection dropped before its answer is retried once on a fresh one: no error
    assert report.ok == 120, report.errors_by_status


def test_open_loop_through_an_awkward_server(awkward_url):
    report = run_load(awkward_url, "m", rate=500, duration_s=30, max_requests=60,
                      payloads=[b"{}"], path="/")
    assert report.mode == "open" and report.sent == 60
    assert report.ok == 60, report.errors_by_status


def test_a_server_that_is_no_kserve_server_is_named_so_in_one_line():
    """An HTTP server that answers its own 404 page: the error says so in one line,
    without the page."""
    import http.server

    from batchscope.load.payloads import LoadError

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0),
                                            http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        with pytest.raises(LoadError) as info:
            run_load(f"http://127.0.0.1:{httpd.server_address[1]}", "mlp", concurrency=1,
                     duration_s=1.0)
    finally:
        httpd.shutdown()
        httpd.server_close()
    message = str(info.value)
    assert "is it a `batchscope serve`" in message and "\n" not in message
    assert "<html" not in message.lower()
