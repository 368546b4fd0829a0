"""Admission by predicted wait: a request whose queue ahead would take longer to drain
than its timeout is refused at once (429 with Retry-After), not queued to expire.

The batcher is driven with a fake clock: the drain rate comes from the batches it is
told returned (``complete(batch, now, compute_s)``), so every figure is exact.
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import orjson
import pytest

from runtime.api.config import BatchingConfig
from runtime.api.errors import QueueFull
from runtime.core.batcher import MIN_RETRY_AFTER_S, Batcher
from runtime.core.clock import FakeClock
from runtime.core.request import PendingRequest


def make(**changes) -> tuple[Batcher, FakeClock]:
    config = BatchingConfig(max_batch_size=10, max_queue_size=1000).with_changes(changes)
    return Batcher("toy", config, variable_length=False), FakeClock()


def add(b: Batcher, clock: FakeClock, *, timeout_s: float | None = None, priority: int = 1,
        bypass: bool = False) -> PendingRequest:
    now = clock.now()
    req = PendingRequest(None, priority=priority, bypass=bypass, arrived_s=now,
                         deadline_s=None if timeout_s is None else now + timeout_s)
    b.submit(req, now)
    return req


def batch_back(b: Batcher, clock: FakeClock, n: int, compute_s: float) -> None:
    b.complete(SimpleNamespace(requests=[None] * n, bucket=None, adapters=None), clock.now(), compute_s)


def test_nothing_is_refused_before_a_batch_was_measured():
    b, clock = make()
    for _ in range(500):
        add(b, clock, timeout_s=0.001)
    assert b.depth == 500 and b.drain_per_request_s is None


def test_an_idle_queue_measures_compute_per_request():
    b, clock = make()
    batch_back(b, clock, 10, 0.010)  # nothing queued: the batch's own compute counts
    assert b.drain_per_request_s == pytest.approx(0.001)


def test_a_backlogged_queue_measures_the_time_between_returns():
    b, clock = make()
    for _ in range(30):
        add(b, clock)
    batch_back(b, clock, 10, 0.010)  # still 30 queued: from here on the gap is measured
    clock.advance(0.050)
    batch_back(b, clock, 10, 0.010)  # 50 ms for 10 requests, slower than their compute
    assert b.drain_per_request_s == pytest.approx((0.001 + 0.005) / 2)


def test_a_backlog_is_judged_by_full_batches():
    """Small batches under a backlog (they left before more arrived) say what a batch
    cycle takes; the queue ahead of a new request fills batches to the cap."""
    b, clock = make(max_batch_size=10)
    add(b, clock)
    batch_back(b, clock, 2, 0.004)  # idle: 2 ms per request
    clock.advance(0.030)
    batch_back(b, clock, 2, 0.004)  # backlogged: 30 ms per cycle, 10 per full batch
    assert b.drain_per_request_s == pytest.approx((0.002 + 0.003) / 2)
    clock.advance(0.001)
    batch_back(b, clock, 2, 0.020)  # the compute outlasted the gap: it counts
    assert b.drain_per_request_s == pytest.approx((0.002 + 0.003 + 0.002) / 3)


def test_refused_when_the_queue_ahead_would_outlast_the_timeout():
    b, clock = make()
    batch_back(b, clock, 10, 0.010)  # 1 ms per request: 1000 requests/s
    for _ in range(100):
        add(b, clock)  # no timeout: never refused on this ground
    assert b.depth == 100
    add(b, clock, timeout_s=0.150)  # 100 ahead: 100 ms, within 150 ms
    with pytest.raises(QueueFull) as caught:
        add(b, clock, timeout_s=0.050)  # 101 ahead: 101 ms, past 50 ms
    error = caught.value
    assert error.retry_after_s == pytest.approx(0.051)
    message = str(error)
    assert "about 101 requests queued ahead" in message and "1000 requests/s" in message
    assert "about 101 ms" in message and "timeout of 50 ms" in message
    assert "timeout_ms" in message
    assert b.depth == 101  # the refused one was not queued
    add(b, clock)  # a request without a timeout is still taken
    assert b.depth == 102


def test_the_retry_after_is_at_least_the_minimum():
    b, clock = make()
    batch_back(b, clock, 10, 0.010)
    for _ in range(51):
        add(b, clock)
    error = b.drain_refusal(1, False, 0.050)
    assert error is not None and error.retry_after_s == MIN_RETRY_AFTER_S
    assert b.drain_refusal(1, False, 0.060) is None


def test_only_requests_that_would_run_first_count_as_ahead():
    b, clock = make(priority_levels=3, default_priority=1)
    batch_back(b, clock, 10, 0.010)
    for _ in range(80):
        add(b, clock, priority=2)
    for _ in range(10):
        add(b, clock, priority=0)
    # an urgent request waits only for the 10 urgent ones (bypass ones first too)
    add(b, clock, timeout_s=0.020, priority=0)
    with pytest.raises(QueueFull):
        add(b, clock, timeout_s=0.020, priority=2)
    assert b.drain_refusal(1, False, 0.020) is None  # 11 ahead of priority 1
    # bypass requests wait only for other bypass requests
    for _ in range(5):
        add(b, clock, bypass=True)
    add(b, clock, timeout_s=0.0055, bypass=True)
    with pytest.raises(QueueFull):
        add(b, clock, timeout_s=0.0055, bypass=True)


def test_head_refusal_goes_by_the_longest_recent_timeout():
    b, clock = make()
    batch_back(b, clock, 10, 0.010)  # 1 ms per request
    assert b.head_refusal(1, None) is None  # nothing seen yet: no timeout to judge by
    for _ in range(60):
        add(b, clock, timeout_s=0.080)
    assert b.head_refusal(1, None) is None  # 60 ahead: 60 ms, within 80 ms
    batch_back(b, clock, 10, 0.020)  # slower now: 1.5 ms per request, 90 ms for 60
    error = b.head_refusal(1, None)
    assert error is not None and "longest timeout of recent requests" in str(error)
    assert "80 ms" in str(error)
    assert b.head_refusal(1, 0.100) is None  # a longer default keeps it open
    add(b, clock)  # one without a timeout: from now on never refused at the head
    assert b.head_refusal(1, None) is None


def test_the_same_figures_give_the_same_error():
    b, clock = make()
    batch_back(b, clock, 10, 0.010)
    for _ in range(100):
        add(b, clock)
    first = b.drain_refusal(1, False, 0.050)
    assert b.drain_refusal(1, False, 0.050) is first
    add(b, clock)  # 101 ms instead of 100 ms: the same to 10 ms
    assert b.drain_refusal(1, False, 0.050) is first
    for _ in range(10):
        add(b, clock)
    assert b.drain_refusal(1, False, 0.050) is not first


# -- through the engine and the early hook -------------------------------------------------
GOOD = orjson.dumps({"inputs": [{"name": "INPUT0", "shape": [4], "datatype": "FP32",
                                 "data": [1, 2, 3, 4]}]})
PATH = "/v2/models/double/infer"
HEADS = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
         (b"content-length", b"%d" % len(GOOD))]


def test_early_refuses_by_the_default_timeout_and_records_it():
    from batchscope.storage.records import ListRecorder, RequestRow
    from runtime.engine.engine import Engine
    from runtime.models.toys import DoubleModel
    from runtime.server.fastpath import InferHook
    from runtime.server.routes import build_app

    async def main():
        hold = threading.Event()
        model = DoubleModel(hold=hold)
        recorder = ListRecorder()
        clock = FakeClock()
        engine = Engine({"double": model}, {"double": BatchingConfig(
            max_batch_size=1, max_queue_size=100, default_timeout_ms=30.0)},
            recorder=recorder, clock=clock)
        hook = InferHook(build_app(engine).state)
        answers: list[tuple[int, list, bytes]] = []
        await engine.start()
        batcher = engine._served("double").batcher
        batcher.complete(SimpleNamespace(requests=[None], bucket=None, adapters=None), clock.now(), 0.009)  # 9 ms each
        try:
            for _ in range(4):  # one runs (held), three wait: 27 ms to drain
                assert hook(None, b"POST", PATH, HEADS, GOOD, lambda *a: answers.append(a))
                if not model.entered.is_set():
                    await asyncio.to_thread(model.entered.wait, 10.0)
            assert answers == [] and batcher.depth == 3
            assert hook.early(b"POST", PATH, HEADS) is None  # 27 ms is within 30 ms
            hook(None, b"POST", PATH, HEADS, GOOD, lambda *a: answers.append(a))
            assert answers == [] and batcher.depth == 4
            status, headers, body = hook.early(b"POST", PATH, HEADS)
            assert status == 429 and dict(headers)[b"retry-after"].isdigit()
            message = orjson.loads(body)["error"]
            assert "about 4 requests queued ahead" in message
            assert "longest timeout of recent requests" in message and "30 ms" in message
            rejected = [r for r in recorder.of(RequestRow) if r.outcome == "rejected"]
            assert len(rejected) == 1
            # recent requests all had 30 ms: so is one whose timeout is not read yet, even
            # with the default gone; once the queue has drained, nothing is refused
            engine.update_settings("double", {"default_timeout_ms": None}, "test")
            assert hook.early(b"POST", PATH, HEADS)[0] == 429
            hold.set()
            for _ in range(1000):
                if batcher.depth == 0 and engine.stats("double")["in_flight"] == 0:
                    break
                await asyncio.sleep(0.01)
            assert hook.early(b"POST", PATH, HEADS) is None
        finally:
            hold.set()
            await engine.stop()
        assert all(a[0] == 200 for a in answers)

    asyncio.run(asyncio.wait_for(main(), 20.0))
