"""The per-pass budget of ``runtime.server.http1.HttpServer``: how many requests it takes
in before the event loop's other callbacks get a turn.

Connections are driven through ``data_received`` over a fake transport, inside a
running loop (the budget bounds a pass of one), so every outcome depends on counts
and on the order of ``call_soon`` callbacks, never on time.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from runtime.server.http1 import Connection, HttpServer
from tests.factories import RecordingTransport as Transport

BODY = b'{"x":1}'
REQUEST = (b"POST /v2/models/m/infer HTTP/1.1\r\nHost: 127.0.0.1\r\n"
           b"Content-Length: %d\r\n\r\n%b" % (len(BODY), BODY))
HEADERS = [(b"content-type", b"application/json")]


class Hook:
    """Answers every request at once and remembers which connection sent it."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def __call__(self, conn, method, path, headers, body, answer) -> bool:
        self.seen.append(conn)
        answer(200, HEADERS, b"{}")
        return True


def run(test) -> None:
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(asyncio.wait_for(test(loop), 10.0))
    finally:
        loop.close()


def server_with(loop: asyncio.AbstractEventLoop, budget: int, n: int
                ) -> tuple[HttpServer, Hook, list[Connection], list[Transport]]:
    hook = Hook()
    server = HttpServer(None, fast=hook, pass_budget=budget)
    server.loop = loop
    conns, transports = [], []
    for _ in range(n):
        conn = Connection(server)
        transport = Transport()
        conn.connection_made(transport)
        conns.append(conn)
        transports.append(transport)
    return server, hook, conns, transports


def test_reads_past_the_budget_wait_for_the_next_slice() -> None:
    async def body(loop):
        server, hook, conns, transports = server_with(loop, 2, 3)
        for conn in conns:
            conn.data_received(REQUEST)
        assert hook.seen == conns[:2]
        assert transports[2].paused and transports[2].written == b""
        assert server.counts["held_reads"] == 1
        await asyncio.sleep(0)
        assert hook.seen == conns
        assert not transports[2].paused
        assert transports[2].written.startswith(b"HTTP/1.1 200 OK\r\n")
        assert server.budget == 1  # renewed by the slice, one request taken since

    run(body)


def test_other_callbacks_run_between_slices() -> None:
    async def body(loop):
        server, hook, conns, _ = server_with(loop, 2, 6)
        for conn in conns:
            conn.data_received(REQUEST)
        assert len(hook.seen) == 2
        seen_between: list[int] = []
        # queued after the first slice, as a batch completion arriving meanwhile would be
        loop.call_soon(lambda: seen_between.append(len(hook.seen)))
        for _ in range(3):
            await asyncio.sleep(0)
        assert seen_between == [4]
        assert hook.seen == conns  # the held ones in the order their bytes arrived
        assert not server.held

    run(body)


def test_pipelined_requests_count_one_each() -> None:
    async def body(loop):
        server, hook, conns, transports = server_with(loop, 2, 2)
        conns[0].data_received(REQUEST * 3)  # one read: parsed whole, over the budget
        assert hook.seen == [conns[0]] * 3
        assert server.budget == -1
        conns[0].data_received(REQUEST)  # a later read of the same connection waits
        conns[1].data_received(REQUEST)
        assert len(hook.seen) == 3
        assert transports[0].paused and transports[1].paused
        await asyncio.sleep(0)
        assert hook.seen == [conns[0]] * 4 + [conns[1]]
        assert transports[0].written.count(b"HTTP/1.1 200 OK") == 4

    run(body)


def test_bytes_split_across_held_reads_stay_in_order() -> None:
    async def body(loop):
        server, hook, conns, _ = server_with(loop, 1, 2)
        conns[0].data_received(REQUEST)
        half = len(REQUEST) // 2
        conns[1].data_received(REQUEST[:half])
        conns[1].data_received(REQUEST[half:])  # e.g. delivered before the pause took
        await asyncio.sleep(0)
        assert hook.seen == conns

    run(body)


def test_a_closed_connection_drops_what_it_held() -> None:
    async def body(loop):
        server, hook, conns, _ = server_with(loop, 1, 2)
        conns[0].data_received(REQUEST)
        conns[1].data_received(REQUEST)
        conns[1].connection_lost(None)
        await asyncio.sleep(0)
        assert hook.seen == [conns[0]]
        assert server.budget == 1

    run(body)


def test_no_running_loop_means_no_hold() -> None:
    loop = asyncio.new_event_loop()
    try:
        server, hook, conns, transports = server_with(loop, 2, 1)
        for _ in range(5):
            conns[0].data_received(REQUEST)
        assert len(hook.seen) == 5
        assert not transports[0].paused and not server.held
    finally:
        loop.close()


def test_the_budget_must_be_positive() -> None:
    with pytest.raises(ValueError, match="pass_budget"):
        HttpServer(None, pass_budget=0)


def test_no_bound_by_default() -> None:
    async def body(loop):
        hook = Hook()
        server = HttpServer(None, fast=hook)
        server.loop = loop
        conns = []
        for _ in range(300):
            conn = Connection(server)
            conn.connection_made(Transport())
            conn.data_received(REQUEST)
            conns.append(conn)
        assert hook.seen == conns and not server.held

    run(body)
