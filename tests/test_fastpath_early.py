"""``InferHook.early``: an ``/infer`` request refused on its head alone, before its body
is read or parsed, with the answer the full path gives and its rejection recorded."""

from __future__ import annotations

import asyncio
import socket
import threading

import orjson
import pytest

from batchscope.storage.records import ListRecorder, RequestRow
from runtime.api.config import BatchingConfig
from runtime.engine.engine import Engine
from runtime.models.toys import DoubleModel
from runtime.server.fastpath import InferHook
from runtime.server.routes import build_app

TIMEOUT_S = 20.0
HEADS = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
         (b"content-length", b"120")]
PATH = "/v2/models/double/infer"
GOOD = orjson.dumps({"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32",
                                 "data": [1, 2, 3, 4]}]})


def run(coro, timeout_s: float = TIMEOUT_S):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


class Held:
    """An app whose one model holds its first batch, with a queue of two behind it."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.model = DoubleModel(hold=self.hold)
        self.recorder = ListRecorder()
        self.engine = Engine({"double": self.model}, {"double": BatchingConfig(
            max_batch_size=1, max_queue_size=2)}, recorder=self.recorder)
        self.app = build_app(self.engine)
        self.hook = InferHook(self.app.state)
        self.answers: list[tuple[int, list, bytes]] = []

    def answer(self, status: int, headers: list, body: bytes) -> None:
        self.answers.append((status, headers, body))

    async def fill(self) -> None:
        """One request running (held), two queued: the queue is full."""
        for _ in range(3):
            assert self.hook(None, b"POST", PATH, HEADS, GOOD, self.answer)
            if not self.model.entered.is_set():
                await asyncio.to_thread(self.model.entered.wait, TIMEOUT_S)
        assert self.engine.stats("double")["queue_depth"] == 2

    def rejected_rows(self) -> list[RequestRow]:
        return [r for r in self.recorder.of(RequestRow) if r.outcome == "rejected"]


def test_early_lets_everything_through_while_the_queue_has_room():
    async def main():
        held = Held()
        await held.engine.start()
        hook = held.hook
        assert hook.early(b"POST", PATH, HEADS) is None
        await held.fill()
        # not an inference request to a served model: left to the full path
        for method, path in [(b"GET", PATH), (b"POST", "/v2/models/double"),
                             (b"POST", "/v2/models/nope/infer"),
                             (b"POST", "/v2/models/double/versions/9/infer"),
                             (b"POST", "/v2/models//infer")]:
            assert hook.early(method, path, HEADS) is None
        assert not held.rejected_rows()
        held.hold.set()
        await held.engine.stop()

    run(main())


def test_early_answers_429_with_retry_after_when_the_queue_is_full_and_records_it():
    async def main():
        held = Held()
        await held.engine.start()
        await held.fill()
        status, headers, body = held.hook.early(b"POST", PATH, HEADS)
        assert status == 429
        assert dict(headers)[b"retry-after"].isdigit()
        message = orjson.loads(body)["error"]
        assert "max_queue_size=2" in message and "retry after" in message
        again = held.hook.early(b"POST", "/v2/models/double/versions/1/infer", HEADS)
        assert again[0] == 429
        assert len(held.rejected_rows()) == 2
        assert held.engine.stats("double")["requests_by_outcome"] == {"rejected": 2}
        held.hold.set()
        await held.engine.stop()

    run(main())


def test_edge_gives_the_early_answer_for_raw_targets_and_records_each_refusal():
    async def main():
        held = Held()
        await held.engine.start()
        hook = held.hook
        assert hook.edge(PATH.encode()) is None  # room in the queue: nothing to refuse
        await held.fill()
        early = hook.early(b"POST", PATH, HEADS)
        assert hook.edge(PATH.encode()) == early
        assert hook.edge(b"/v2/models/double/versions/1/infer")[0] == 429
        for target in (b"/v2/models/nope/infer", b"/v2/models/double/versions/7/infer",
                       b"/v2/models/double/ready", b"/v2/models//infer"):
            assert hook.edge(target) is None, target  # the full path says what is wrong
        assert len(held.rejected_rows()) == 3
        assert held.engine.stats("double")["requests_by_outcome"] == {"rejected": 3}
        held.hold.set()
        await held.engine.stop()

    run(main())


def test_early_answers_503_while_loading_and_while_shutting_down():
    async def main():
        held = Held()
        status, _, body = held.hook.early(b"POST", PATH, HEADS)
        assert status == 503 and "loading" in orjson.loads(body)["error"]
        await held.engine.start()
        await held.engine.stop()
        status, _, body = held.hook.early(b"POST", PATH, HEADS)
        assert status == 503 and "shutting down" in orjson.loads(body)["error"]
        assert not held.rejected_rows()

    run(main())


def test_a_full_queue_refuses_before_the_body_is_parsed():
    """Past the head (the body came in while the queue filled): 429, not a parse error."""

    async def main():
        held = Held()
        await held.engine.start()
        await held.fill()
        assert held.hook(None, b"POST", PATH, HEADS, b"{not json", held.answer)
        status, headers, _ = held.answers[-1]  # the three before are still waiting
        assert status == 429 and b"retry-after" in dict(headers)
        assert len(held.rejected_rows()) == 1
        held.hold.set()
        await held.engine.stop()
        assert sorted(a[0] for a in held.answers) == [200, 200, 200, 429]

    run(main())


def _exchange(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT_S) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
        return data


def test_through_the_http_server_a_full_queue_is_refused_on_the_head():
    from runtime.server.http1 import HttpServer
    from runtime.server.service import bind_socket, new_event_loop

    held = Held()
    server = HttpServer(held.app, fast=held.hook)
    if getattr(server, "early", None) is None:
        pytest.skip("this HttpServer does not ask a hook's early method")
    loop = new_event_loop()
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    def call(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(TIMEOUT_S)

    async def fill():
        await held.fill()

    try:
        call(held.engine.start())
        call(server.start(sock))
        call(fill())
        # the head promises a body that never comes: only an early answer can answer it
        head = (f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                "Content-Length: 100\r\nConnection: close\r\n\r\n").encode()
        reply = _exchange(port, head)
        assert reply.startswith(b"HTTP/1.1 429"), reply[:200]
        assert b"retry-after:" in reply.lower()
        assert len(held.rejected_rows()) == 1
    finally:
        held.hold.set()
        try:
            call(server.shutdown(TIMEOUT_S))
            call(held.engine.stop())
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(TIMEOUT_S)
            loop.close()
            sock.close()
