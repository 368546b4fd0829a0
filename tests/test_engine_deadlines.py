"""Deadlines of the request engine: the expiry timer, requests left out of a batch that
could not end in time, dispatched requests past their deadline, and admission refusal.

The batcher is driven with a fake clock; the engine runs on a real loop with short
deadlines, and the assertions are on outcomes and bounds, never on exact times.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

from batchscope.storage.records import ListRecorder, RequestRow
from runtime.api.config import BatchingConfig
from runtime.api.errors import ModelNotReady, QueueFull, RequestExpired, ShuttingDown
from runtime.core.batcher import Batcher
from runtime.core.request import DISPATCHED, EXPIRED, PendingRequest
from runtime.engine.engine import Engine
from runtime.models.toys import DoubleModel

#: how late (beyond its deadline) an expired request may be answered in these tests; the
#: timer fires at the deadline, this is slack for a busy shared machine
LATE_S = 0.25


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def vec(v: float) -> dict[str, np.ndarray]:
    return {"INPUT0": np.full(4, v, dtype=np.float32)}


class Outcomes:
    """Collects ``on_done`` calls with the time each arrived; ``wait(n)`` for n of them."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, BaseException | None, float]] = []
        self._event = asyncio.Event()
        self._want = 0

    def __call__(self, result, error) -> None:
        self.calls.append((result, error, time.monotonic()))
        if len(self.calls) >= self._want:
            self._event.set()

    async def wait(self, n: int, timeout_s: float = 10.0) -> list:
        self._want = n
        if len(self.calls) < n:
            self._event.clear()
            await asyncio.wait_for(self._event.wait(), timeout_s)
        return self.calls


def req(seq_deadline: float | None, now: float = 0.0) -> PendingRequest:
    return PendingRequest(None, arrived_s=now, deadline_s=seq_deadline)


# -- the batcher, fake clock -------------------------------------------------------------
def test_next_batch_leaves_out_requests_whose_batch_could_not_end_in_time():
    b = Batcher("m", BatchingConfig(max_batch_size=8),
                variable_length=False)
    tight, loose, none = req(0.010), req(0.100), req(None)
    for r in (tight, loose, none):
        b.submit(r, 0.0)
    batch = b.next_batch(0.0, lead_s=0.050)
    assert batch is not None and batch.requests == [loose, none]
    assert tight.state == EXPIRED and loose.state == DISPATCHED
    assert b.expire(0.0) == [tight]
    assert b.expire(0.0) == [] and b.depth == 0


def test_without_lead_a_request_due_later_is_dispatched():
    b = Batcher("m", BatchingConfig(), variable_length=False)
    r = req(0.010)
    b.submit(r, 0.0)
    batch = b.next_batch(0.0)
    assert batch is not None and batch.requests == [r]
    assert b.expire(1.0) == []  # dispatched: no longer the batcher's to expire


def test_earliest_deadline_skips_requests_that_left_the_queue():
    b = Batcher("m", BatchingConfig(max_batch_size=1),
                variable_length=False)
    first, second = req(0.5), req(0.9)
    b.submit(first, 0.0)
    b.submit(second, 0.0)
    assert b.earliest_deadline() == 0.5
    assert b.next_batch(0.0).requests == [first]
    assert b.earliest_deadline() == 0.9
    b.cancel(second)
    assert b.earliest_deadline() is None


def test_queue_full_is_the_refusal_submit_raises_and_is_reused_while_unchanged():
    b = Batcher("m", BatchingConfig(max_queue_size=2), variable_length=False)
    assert not b.is_full()
    b.submit(req(None), 0.0)
    b.submit(req(None), 0.0)
    assert b.is_full()
    with pytest.raises(QueueFull) as raised:
        b.submit(req(None), 0.0)
    error = b.queue_full()
    assert str(error) == str(raised.value)
    assert error.retry_after_s == raised.value.retry_after_s
    assert b.queue_full() is error


# -- the engine, real loop ------------------------------------------------------------------
def test_queued_requests_expire_at_their_deadline_while_a_batch_runs():
    """The dispatch loop waits for a held batch; the timer answers the queue anyway."""

    async def main():
        hold = threading.Event()
        model = DoubleModel(hold=hold)
        engine = Engine({"double": model}, {"double": BatchingConfig(
            max_batch_size=1)}, recorder=ListRecorder())
        await engine.start()
        first = Outcomes()
        engine.submit("double", vec(1.0), None, None, False, first)
        await asyncio.to_thread(model.entered.wait, 10.0)
        queued = Outcomes()
        timeouts_ms = [30.0, 60.0, 90.0, 120.0]
        sent = {}
        for t in timeouts_ms:
            sent[t] = time.monotonic()
            engine.submit("double", vec(t), None, t, False,
                          lambda r, e, t=t: queued((t, r), e))
        calls = await queued.wait(len(timeouts_ms))
        assert first.calls == []  # the batch is still held
        for (t, result), error, at in calls:
            assert result is None and isinstance(error, RequestExpired)
            deadline = sent[t] + t / 1000.0
            assert deadline - 0.005 <= at <= deadline + LATE_S
        assert [t for (t, _), _, _ in calls] == timeouts_ms  # in deadline order
        hold.set()
        (result, error, _), = await first.wait(1)
        assert error is None and result["OUTPUT0"][0] == 2.0
        assert engine.stats("double")["requests_by_outcome"] == {"expired": 4, "ok": 1}
        await engine.stop()

    run(main())


def test_a_dispatched_request_past_its_deadline_still_gets_its_result_once():
    async def main():
        hold = threading.Event()
        model = DoubleModel(hold=hold)
        engine = Engine({"double": model}, {"double": BatchingConfig()},
                        recorder=ListRecorder())
        await engine.start()
        done = Outcomes()
        engine.submit("double", vec(3.0), None, 20.0, False, done)
        await asyncio.to_thread(model.entered.wait, 10.0)
        await asyncio.sleep(0.06)  # well past its 20 ms deadline, while it runs
        assert done.calls == []
        hold.set()
        (result, error, _), = await done.wait(1)
        assert error is None and result["OUTPUT0"][0] == 6.0
        await asyncio.sleep(0.05)
        assert len(done.calls) == 1
        await engine.stop()

    run(main())


def test_a_request_whose_batch_cannot_end_in_time_is_answered_at_once_not_run():
    async def main():
        rec = ListRecorder()
        model = DoubleModel()
        engine = Engine({"double": model}, {"double": BatchingConfig()},
                        recorder=rec)
        await engine.start()
        warm = Outcomes()
        engine.submit("double", vec(1.0), None, None, False, warm)
        await warm.wait(1)
        # the model's recent batch time says a batch takes 200 ms
        batcher = engine._models["double"].batcher
        for _ in range(40):
            batcher._compute.add(0.2)
        done = Outcomes()
        start = time.monotonic()
        engine.submit("double", vec(2.0), None, 100.0, False, done)
        (result, error, at), = await done.wait(1)
        assert isinstance(error, RequestExpired) and "could not have ended" in str(error)
        assert at - start < 0.1  # at once, not at its deadline
        assert model.batch_sizes == [1]  # it never ran
        rows = rec.of(RequestRow)
        assert sorted(r.outcome for r in rows) == ["expired", "ok"]
        await engine.stop()

    run(main())


def test_every_accepted_request_gets_exactly_one_outcome_under_short_deadlines():
    async def main():
        rec = ListRecorder()
        hold = threading.Event()
        model = DoubleModel(hold=hold)
        engine = Engine({"double": model}, {"double": BatchingConfig(
            max_batch_size=8, max_queue_size=64)}, recorder=rec)
        await engine.start()
        done = Outcomes()
        accepted = refused = 0
        for i in range(200):
            try:
                engine.submit("double", vec(float(i)), None, 10.0 + (i % 5) * 10.0, False, done)
                accepted += 1
            except QueueFull:
                refused += 1
            if i == 0:
                await asyncio.to_thread(model.entered.wait, 10.0)
            if i == 120:  # the queue filled up behind the held batch
                await asyncio.sleep(0.03)
                hold.set()
            if i > 120 and i % 10 == 0:
                await asyncio.sleep(0.005)
        calls = await done.wait(accepted)
        await asyncio.sleep(0.1)
        assert len(calls) == accepted and refused > 0
        rows = rec.of(RequestRow)
        outcomes = [r.outcome for r in rows]
        assert outcomes.count("rejected") == refused
        assert len(outcomes) - refused == accepted
        assert {"ok", "expired"} >= set(outcomes) - {"rejected"}
        for result, error, _ in calls:
            assert (result is None) != (error is None)
        await engine.stop()

    run(main())


# -- admission refusal without a request -------------------------------------------------------
def test_admission_refusal_says_why_any_request_would_be_refused():
    async def main():
        rec = ListRecorder()
        hold = threading.Event()
        model = DoubleModel(hold=hold)
        engine = Engine({"double": model}, {"double": BatchingConfig(
            max_batch_size=1, max_queue_size=2)}, recorder=rec)
        assert isinstance(engine.admission_refusal("double"), ModelNotReady)
        await engine.start()
        assert engine.admission_refusal("double") is None
        assert engine.admission_refusal("nope") is None  # the full path says 404
        done = Outcomes()
        engine.submit("double", vec(1.0), None, None, False, done)
        await asyncio.to_thread(model.entered.wait, 10.0)
        engine.submit("double", vec(2.0), None, None, False, done)
        engine.submit("double", vec(3.0), None, None, False, done)
        refusal = engine.admission_refusal("double", book=False)
        assert isinstance(refusal, QueueFull) and refusal.retry_after_s > 0
        assert "max_queue_size=2" in str(refusal)
        assert not rec.of(RequestRow)
        assert isinstance(engine.admission_refusal("double"), QueueFull)
        rows = rec.of(RequestRow)
        assert [r.outcome for r in rows] == ["rejected"]
        assert engine.stats("double")["requests_by_outcome"] == {"rejected": 1}
        hold.set()
        await done.wait(3)
        assert engine.admission_refusal("double") is None
        await engine.stop()
        assert isinstance(engine.admission_refusal("double"), ShuttingDown)

    run(main())


def test_the_lead_covers_a_long_batch_not_only_the_mean_one():
    """The time a batch sent now may take until it is back: the mean for each batch out
    ahead of it, the recent 99th percentile for itself (batches of a variable-length model
    differ, and a request must not miss its deadline in a long one)."""
    from types import SimpleNamespace

    from runtime.device.timeouts import MIN_BATCHES, BatchTimes
    from runtime.engine.dispatch import Dispatcher

    times = BatchTimes()
    model = SimpleNamespace(batcher=SimpleNamespace(mean_compute_s=None), batch_times=times)
    dispatcher = SimpleNamespace(model=model, running=[])
    lead = lambda: Dispatcher._lead_s(dispatcher)  # noqa: E731
    assert lead() == 0.0  # nothing measured: nothing expires early
    model.batcher.mean_compute_s = 0.01
    assert lead() == pytest.approx(0.01)  # too few batches for a percentile: the mean
    for i in range(max(MIN_BATCHES, 200)):
        times.observe(0.05 if i % 10 == 0 else 0.01)
    dispatcher.running = [object()]
    assert lead() == pytest.approx(0.01 + 0.05)
