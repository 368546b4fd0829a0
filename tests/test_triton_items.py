"""A request of several items (a client-side batch, ``Engine.infer_items`` /
``submit_items``): each item is queued as one request and batches with whatever else
waits; the request gets exactly one outcome, the items' results in order or the one
error the first failing item got; admission is all or nothing.

Each test drives a real engine on the device thread with toy models. Outcomes depend
on counts only: requests are queued synchronously before the dispatch loop runs (so
the first batch holds all of them), or behind a batch held in ``predict`` (the device
thread runs one batch of a model at a time, so everything else stays queued).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass

import numpy as np
import pytest

from batchscope.storage.records import ListRecorder, RequestRow
from runtime.api.config import BatchingConfig
from runtime.api.errors import ClientError, ModelError, QueueFull, RequestExpired, ValidationError
from runtime.engine.engine import Engine
from runtime.models.toys import DoubleModel, FailingModel
from runtime.server import triton
from tests.factories import wait_for

LIMIT_S = 30.0


def vec(v: float) -> dict[str, np.ndarray]:
    return {"INPUT0": np.full(4, v, dtype=np.float32)}


def run(main) -> None:
    asyncio.run(asyncio.wait_for(main(), LIMIT_S))


def outcomes(rec: ListRecorder) -> list[str]:
    return sorted(r.outcome for r in rec.of(RequestRow))


def test_items_batch_with_other_requests_and_come_back_in_order():
    model = DoubleModel()
    rec = ListRecorder()
    engine = Engine({"double": model}, {"double": BatchingConfig(max_batch_size=8)},
                    recorder=rec)

    async def main() -> None:
        await engine.start()
        try:
            loop = asyncio.get_running_loop()
            first = loop.create_task(engine.infer("double", vec(1)))
            items = loop.create_task(engine.infer_items("double", [vec(2), vec(3), vec(4)]))
            last = loop.create_task(engine.infer("double", vec(5)))
            a, group, b = await asyncio.gather(first, items, last)
        finally:
            await engine.stop()
        assert model.batch_sizes == [5]  # one batch: the items and the two others together
        assert [float(r["OUTPUT0"][0]) for r in group] == [4.0, 6.0, 8.0]
        assert float(a["OUTPUT0"][0]) == 2.0 and float(b["OUTPUT0"][0]) == 10.0
        assert outcomes(rec) == ["ok"] * 5  # one row per item
        totals = engine.inference_totals("double")
        assert (totals.success, totals.fail, totals.executions) == (5, 0, 1)
        assert list(totals.by_batch_size) == [5] and totals.by_batch_size[5][0] == 1
        assert totals.compute_s == pytest.approx(5 * totals.by_batch_size[5][1])
        assert totals.queue_s >= 0.0 and totals.success_s >= totals.queue_s
        # the device time split into collate, forward pass and split, as Triton reports it
        n, compute_s, input_s, output_s = totals.by_batch_size[5]
        assert input_s > 0.0 and output_s > 0.0 and input_s + output_s < compute_s
        assert totals.input_s == pytest.approx(5 * input_s)
        stats = triton.model_statistics(engine, ["double"])["model_stats"][0]
        inference, batch = stats["inference_stats"], stats["batch_stats"][0]
        parts = [inference[k]["ns"] for k in ("compute_input", "compute_infer", "compute_output")]
        assert all(ns > 0 for ns in parts)
        assert sum(parts) == pytest.approx(totals.compute_s * 1e9, abs=3)
        assert batch["compute_input"]["ns"] == round(input_s * 1e9)

    run(main)


def test_a_poison_item_fails_the_whole_request_once():
    rec = ListRecorder()
    engine = Engine({"failing": FailingModel()}, {"failing": BatchingConfig(max_batch_size=8)},
                    recorder=rec)
    calls: list = []

    async def main() -> None:
        await engine.start()
        try:
            engine.submit_items("failing", [vec(1), vec(2), vec(-1), vec(4)], None, None, False,
                                lambda result, error: calls.append((result, error)))
            await wait_for(lambda: len(rec.of(RequestRow)) == 4, "every item's row")
            await asyncio.sleep(0.05)  # a second outcome would have arrived by now
        finally:
            await engine.stop()
        [(result, error)] = calls
        assert result is None and isinstance(error, ModelError)
        assert error.message.startswith("model 'failing' failed on this request")
        assert outcomes(rec) == ["error", "ok", "ok", "ok"]  # isolated: the others ran
        totals = engine.inference_totals("failing")
        assert (totals.success, totals.fail) == (3, 1)

    run(main)


def test_items_still_queued_when_one_fails_are_withdrawn():
    rec = ListRecorder()
    engine = Engine({"failing": FailingModel()},
                    {"failing": BatchingConfig(max_batch_size=2, isolate_errors=False)},
                    recorder=rec)
    calls: list = []

    async def main() -> None:
        await engine.start()
        try:
            engine.submit_items("failing", [vec(-1), vec(1), vec(2), vec(3), vec(4), vec(5)],
                                None, None, False, lambda r, e: calls.append((r, e)))
            await wait_for(lambda: len(rec.of(RequestRow)) == 6, "every item's row")
            assert engine.stats("failing")["queue_depth"] == 0
        finally:
            await engine.stop()
        [(_, error)] = calls
        assert isinstance(error, ModelError) and "failed on a batch of 2" in error.message
        rows = outcomes(rec)
        # the first batch fails; at most the one batch sent before the failure was
        # answered still runs, the rest never does
        assert rows.count("error") == 2 and rows.count("cancelled") >= 2
        assert rows.count("ok") + rows.count("cancelled") == 4

    run(main)


@dataclass
class Held:
    """A started engine serving ``double`` whose first batch (one request) waits in
    ``predict`` until ``release()``, so every later request stays queued."""

    engine: Engine
    model: DoubleModel
    rec: ListRecorder
    hold: threading.Event
    blocker: asyncio.Task

    def release(self) -> None:
        self.hold.set()

    def depth(self) -> int:
        return self.engine.stats("double")["queue_depth"]


@contextlib.asynccontextmanager
async def held(config: BatchingConfig):
    hold = threading.Event()
    model = DoubleModel(hold=hold)
    rec = ListRecorder()
    engine = Engine({"double": model}, {"double": config}, recorder=rec)
    await engine.start()
    try:
        blocker = asyncio.get_running_loop().create_task(engine.infer("double", vec(1)))
        await wait_for(model.entered.is_set, "the held batch")
        state = Held(engine, model, rec, hold, blocker)
        yield state
        state.release()
        await blocker
    finally:
        hold.set()
        await engine.stop()


def test_items_past_their_timeout_fail_the_request_with_one_expiry():
    async def main() -> None:
        async with held(BatchingConfig(max_batch_size=8)) as h:
            with pytest.raises(RequestExpired, match="waited"):
                await h.engine.infer_items("double", [vec(2), vec(3), vec(4)], timeout_ms=50)
        assert outcomes(h.rec) == ["expired"] * 3 + ["ok"]
        assert h.model.batch_sizes == [1]

    run(main)


def test_admission_is_all_or_nothing():
    never = lambda r, e: pytest.fail("a refused request got an outcome")  # noqa: E731

    async def main() -> None:
        async with held(BatchingConfig(max_batch_size=8, max_queue_size=4)) as h:
            engine = h.engine
            loop = asyncio.get_running_loop()
            waiting = [loop.create_task(engine.infer("double", vec(v))) for v in (2, 3)]
            await wait_for(lambda: h.depth() == 2, "two queued")
            with pytest.raises(QueueFull, match="room for 2 more") as full:
                engine.submit_items("double", [vec(4), vec(5), vec(6)], None, None, False, never)
            assert full.value.http_status == 429 and full.value.retry_after_s > 0
            with pytest.raises(ValidationError, match="holds 5 items; send 1 to 4"):
                engine.submit_items("double", [vec(0)] * 5, None, None, False, never)
            with pytest.raises(ValidationError, match="holds 0 items"):
                engine.submit_items("double", [], None, None, False, never)
            bad = {"INPUT0": np.zeros(3, dtype=np.float32)}
            with pytest.raises(ClientError, match="expected FP32"):
                engine.submit_items("double", [vec(4), bad], None, None, False, never)
            assert h.depth() == 2  # nothing of them was queued
            pair = loop.create_task(engine.infer_items("double", [vec(7), vec(8)]))
            await wait_for(lambda: h.depth() == 4, "the pair queued")
            h.release()
            await asyncio.gather(*waiting)
            assert [float(r["OUTPUT0"][0]) for r in await pair] == [14.0, 16.0]
        # the refused request of three items counts three rejections; the rest ran
        assert outcomes(h.rec) == ["ok"] * 5 + ["rejected"] * 3

    run(main)


def test_a_caller_that_goes_away_withdraws_its_queued_items():
    async def main() -> None:
        async with held(BatchingConfig(max_batch_size=8)) as h:
            task = asyncio.get_running_loop().create_task(
                h.engine.infer_items("double", [vec(2), vec(3), vec(4)]))
            await wait_for(lambda: h.depth() == 3, "items queued")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert h.depth() == 0
        assert outcomes(h.rec) == ["cancelled"] * 3 + ["ok"]
        assert h.model.batch_sizes == [1]

    run(main)
