"""``Engine.submit``: the callback entry the HTTP fast path uses.

Same checks and errors as ``infer`` (raised before anything is queued), one
``on_done`` call per accepted request, and a finished batch's answers handed out
once the next batch is on its way to the device.
"""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from batchscope.storage.records import ListRecorder, RequestRow
from runtime.api.config import BatchingConfig
from runtime.engine.engine import Engine
from runtime.api.errors import ClientError, ModelError, ModelNotFound, QueueFull, ShuttingDown
from runtime.models.toys import DoubleModel, FailingModel


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def vec(v: float) -> dict[str, np.ndarray]:
    return {"INPUT0": np.full(4, v, dtype=np.float32)}


class Outcomes:
    """Collects ``on_done`` calls; ``wait(n)`` returns once n arrived."""

    def __init__(self) -> None:
        self.calls: list[tuple[object, object]] = []
        self._event = asyncio.Event()
        self._want = 0

    def __call__(self, result, error) -> None:
        self.calls.append((result, error))
        if len(self.calls) >= self._want:
            self._event.set()

    async def wait(self, n: int) -> list[tuple[object, object]]:
        self._want = n
        if len(self.calls) < n:
            self._event.clear()
            await self._event.wait()
        return self.calls


def test_submit_answers_each_request_once_with_its_result():
    async def main():
        rec = ListRecorder()
        engine = Engine({"double": DoubleModel()}, recorder=rec)
        await engine.start()
        done = Outcomes()
        for v in range(20):
            engine.submit("double", vec(float(v)), None, None, False, done)
        calls = await done.wait(20)
        await asyncio.sleep(0.05)  # nothing more arrives
        await engine.stop()
        return calls, rec

    calls, rec = run(main())
    assert len(calls) == 20 and all(err is None for _, err in calls)
    got = sorted(float(r["OUTPUT0"][0]) for r, _ in calls)
    assert got == [2.0 * v for v in range(20)]
    rows = [r for r in rec.records if isinstance(r, RequestRow)]
    assert len(rows) == 20 and {r.outcome for r in rows} == {"ok"}


def test_submit_raises_before_queueing():
    async def main():
        engine = Engine({"double": DoubleModel()}, {"double": BatchingConfig(max_queue_size=1)})
        await engine.start()
        never = Outcomes()
        with pytest.raises(ModelNotFound):
            engine.submit("nope", vec(1.0), None, None, False, never)
        with pytest.raises(ClientError):
            engine.submit("double", {"WRONG": np.zeros(4, np.float32)}, None, None, False, never)
        await engine.stop()
        with pytest.raises(ShuttingDown):
            engine.submit("double", vec(1.0), None, None, False, never)
        return never.calls

    assert run(main()) == []


def test_queue_full_is_raised_and_the_accepted_ones_still_finish():
    async def main():
        hold = threading.Event()
        model = DoubleModel(hold=hold)
        engine = Engine({"double": model}, {"double": BatchingConfig(max_queue_size=2,
                                                                      max_batch_size=2)})
        await engine.start()
        done = Outcomes()
        engine.submit("double", vec(1.0), None, None, False, done)  # runs, held in predict
        await asyncio.to_thread(model.entered.wait, 10.0)
        model.hold = None
        engine.submit("double", vec(2.0), None, None, False, done)
        engine.submit("double", vec(3.0), None, None, False, done)
        with pytest.raises(QueueFull):
            engine.submit("double", vec(4.0), None, None, False, done)
        hold.set()
        calls = await done.wait(3)
        await engine.stop()
        return calls

    calls = run(main())
    assert sorted(float(r["OUTPUT0"][0]) for r, _ in calls) == [2.0, 4.0, 6.0]


def test_model_errors_reach_the_callback():
    async def main():
        engine = Engine({"failing": FailingModel()})
        await engine.start()
        done = Outcomes()
        engine.submit("failing", vec(-1.0), None, None, False, done)
        calls = await done.wait(1)
        await engine.stop()
        return calls

    [(result, error)] = run(main())
    assert result is None and isinstance(error, ModelError)


def test_a_raising_callback_does_not_break_its_batch():
    async def main():
        engine = Engine({"double": DoubleModel()}, {"double": BatchingConfig(max_batch_size=8)})
        await engine.start()
        good = Outcomes()

        def bad(result, error):
            raise RuntimeError("a broken answer path")

        engine.submit("double", vec(1.0), None, None, False, bad)
        engine.submit("double", vec(2.0), None, None, False, good)
        calls = await good.wait(1)
        stats = engine.stats("double")
        await engine.stop()
        return calls, stats

    calls, stats = run(main())
    assert float(calls[0][0]["OUTPUT0"][0]) == 4.0
    assert stats["requests_by_outcome"] == {"ok": 2}


def test_finished_batch_is_answered_after_the_next_batch_is_dispatched():
    """While batch 1 is held in predict, batch 2 queues; once batch 1 finishes, batch 2
    reaches the device before batch 1's answers are handed out."""

    async def main():
        hold = threading.Event()
        model = DoubleModel(hold=hold)
        engine = Engine({"double": model}, {"double": BatchingConfig(max_batch_size=4)})
        await engine.start()
        order: list[tuple[int, int]] = []
        second_hold = threading.Event()

        def first_done(result, error):
            st = engine.stats("double")
            order.append((st["queue_depth"], st["in_flight"]))

        engine.submit("double", vec(1.0), None, None, False, first_done)
        await asyncio.to_thread(model.entered.wait, 10.0)
        model.entered.clear()
        model.hold = second_hold  # the second batch waits inside predict
        done2 = Outcomes()
        engine.submit("double", vec(2.0), None, None, False, done2)
        hold.set()
        await asyncio.to_thread(model.entered.wait, 10.0)
        for _ in range(100):
            if order:
                break
            await asyncio.sleep(0.01)
        second_hold.set()
        await done2.wait(1)
        await engine.stop()
        return order

    order = run(main())
    # when batch 1 was answered, batch 2 had left the queue for the device
    assert order == [(0, 1)]


def test_short_cpu_batches_can_run_on_the_loop_thread():
    async def main():
        ran_on: list[str] = []
        model = DoubleModel()
        predict = model.predict

        def spy(batch):
            ran_on.append(threading.current_thread().name)
            return predict(batch)

        model.predict = spy
        engine = Engine({"double": model}, inline_max_compute_ms=1000.0)
        await engine.start()
        for v in (1.0, 2.0, 3.0):
            done = Outcomes()
            engine.submit("double", vec(v), None, None, False, done)
            [(result, error)] = await done.wait(1)
            assert error is None and float(result["OUTPUT0"][0]) == 2 * v
        await engine.stop()
        return ran_on

    ran_on = run(main())
    # the first batch has no history and goes to the device thread; the next ones are short
    assert ran_on[0].startswith("batchscope-device")
    assert ran_on[1:] == [threading.main_thread().name] * 2


def test_inline_limit_must_be_a_non_negative_number():
    from runtime.api.errors import ConfigError

    with pytest.raises(ConfigError, match="inline_max_compute_ms"):
        Engine({"double": DoubleModel()}, inline_max_compute_ms=-1)
