"""Shedding at the edge: while the fast hook refuses requests, ``HttpServer.shed``
answers a plain, complete request from its raw bytes, before the parser sees it.

Connections are driven through ``data_received`` over a fake transport; whether a
request was shed or parsed shows in ``counts`` and in what the hook saw, never in time.
"""

from __future__ import annotations

import asyncio
import re

import pytest

from runtime.server.http1 import Connection, HttpServer
from tests.factories import RecordingTransport

BODY = b'{"inputs":[]}'
HEAD = b"POST /v2/models/m/infer HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nContent-Length: %d\r\n"
REFUSAL = (429, [(b"content-type", b"application/json"), (b"retry-after", b"1")],
           b'{"error":"queue of m is full; retry after 1 s"}')


def request(extra: bytes = b"", body: bytes = BODY, head: bytes = HEAD) -> bytes:
    return (head % len(body)) + extra + b"\r\n" + body


class Hook:
    """Refuses on the head and at the edge while ``refusing``; answers 200 otherwise."""

    def __init__(self) -> None:
        self.refusing = True
        self.edges: list[bytes] = []
        self.early_asks = 0
        self.served = 0

    def __call__(self, conn, method, path, headers, body, answer) -> bool:
        self.served += 1
        answer(200, [(b"content-type", b"application/json")], b"{}")
        return True

    def early(self, method, path, headers):
        self.early_asks += 1
        return REFUSAL if self.refusing else None

    def edge(self, target: bytes):
        self.edges.append(target)
        return REFUSAL if self.refusing else None


@pytest.fixture
def served():
    loop = asyncio.new_event_loop()
    hook = Hook()
    server = HttpServer(None, fast=hook)
    server.loop = loop
    conn = Connection(server)
    transport = RecordingTransport()
    conn.connection_made(transport)
    yield server, hook, conn, transport
    loop.close()


def statuses(written: bytes) -> list[int]:
    return [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", written)]


def test_after_one_refusal_on_the_head_plain_requests_are_refused_at_the_edge(served):
    server, hook, conn, transport = served
    conn.data_received(request())  # the parser's early path refuses and starts shedding
    assert server.shedding and hook.early_asks == 1 and not hook.edges
    for _ in range(5):
        conn.data_received(request())
    assert hook.edges == [b"/v2/models/m/infer"] * 5
    assert hook.early_asks == 1  # none of the five reached the parser
    assert server.counts["shed_answers"] == 5
    assert statuses(transport.written) == [429] * 6
    # the edge answer is the head path's answer, byte for byte (same second, same head)
    answers = transport.written.split(b"HTTP/1.1 ")[1:]
    assert len(set(answers)) == 1 and answers[0].endswith(REFUSAL[2])
    assert b"retry-after: 1\r\n" in answers[0]
    assert not transport.closed and conn.current is None and not conn.queue


def test_the_edge_stops_shedding_when_the_model_takes_requests_again(served):
    server, hook, conn, transport = served
    conn.data_received(request())
    hook.refusing = False
    conn.data_received(request())  # edge says no: parsed, served, shedding off
    assert not server.shedding and hook.served == 1
    conn.data_received(request())  # the usual path only now
    assert len(hook.edges) == 1 and hook.served == 2 and hook.early_asks == 3
    assert statuses(transport.written) == [429, 200, 200]


@pytest.mark.parametrize("data", [
    request(b"Transfer-Encoding: chunked\r\n"),
    request(b"Expect: 100-continue\r\n"),
    request(b"Connection: close\r\n"),
    request(b"Connection: Upgrade\r\nUpgrade: h2c\r\n"),
    request(b"Content-Length: 13\r\n"),                       # a second Content-Length
    request() + request(),                                     # two requests in one read
    request()[:-3],                                            # the body not all here
    request(head=HEAD.replace(b"HTTP/1.1", b"HTTP/1.0")),
    request(head=HEAD.replace(b"POST", b"PUT")),
    request(head=HEAD.replace(b"Content-Length: %d\r\n", b"X-Length: %d\r\n")),
    request(head=HEAD.replace(b"Content-Length: %d", b"Content-Length: 1x%d")),
], ids=["chunked", "expect", "close", "upgrade", "two-lengths", "pipelined", "partial",
        "http10", "put", "no-length", "bad-length"])
def test_anything_not_plain_goes_to_the_parser(served, data):
    server, hook, conn, transport = served
    conn.data_received(request())
    asks = hook.early_asks
    conn.data_received(data)
    assert not hook.edges, "the edge must not be asked about a request it cannot frame"
    assert server.counts["shed_answers"] == 0
    assert hook.early_asks > asks or transport.closed or conn.current is not None


def test_a_connection_mid_request_is_not_shed(served):
    server, hook, conn, transport = served
    conn.data_received(request())
    whole = request()
    conn.data_received(whole[:20])  # a head under way: the parser holds state
    conn.data_received(whole[20:])
    assert not hook.edges and hook.early_asks == 2
    assert statuses(transport.written) == [429, 429]


def test_a_stopping_server_does_not_shed(served):
    server, hook, conn, transport = served
    conn.data_received(request())
    server.stopping = True
    conn.data_received(request())
    assert not hook.edges
