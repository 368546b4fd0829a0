"""A batch that runs past its model's ``execution_timeout_ms`` is answered at the
timeout (503) and does not stop the other models.

The hanging toy (``runtime.models.toys.HangingModel``) hangs on an input whose first
value is 99 for as many seconds as its second value, or until the test releases it,
so the hang always outlasts the timeout by far: outcomes depend on that order only.
Requests are queued synchronously with ``Engine.submit`` before the dispatch loop
runs, so batches hold exactly the requests the test chose. Waits are bounded.
"""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np

from batchscope.storage.records import BatchRow, EventRow, ListRecorder, RequestRow
from runtime.api.config import BatchingConfig
from runtime.api.errors import ModelNotReady
from runtime.api.errors import ModelTimedOut
from runtime.engine.engine import Engine
from runtime.models.loader import load_model
from runtime.models.toys import DoubleModel, HangingModel
from tests.factories import wait_for

SPECS = {"hanging": "runtime.models.toys:HangingModel", "double": "runtime.models.toys:DoubleModel"}


def vec(first: float, second: float = 0.0) -> dict[str, np.ndarray]:
    return {"INPUT0": np.array([first, second, 0, 0], dtype=np.float32)}


def submit_all(engine: Engine, model: str, bodies: list[dict]) -> list:
    """Queue every request now; a list that fills in place with (result, error)."""
    results: list = [None] * len(bodies)
    for i, body in enumerate(bodies):
        def done(result, error, i=i):
            assert results[i] is None, "a request got a second outcome"
            results[i] = (result, error)
        engine.submit(model, body, None, None, False, done)
    return results


def answered(*lists: list) -> bool:
    return all(r is not None for results in lists for r in results)


def outputs(results: list) -> list[float]:
    assert [r[1] for r in results] == [None] * len(results)
    return [float(r[0]["OUTPUT0"][0]) for r in results]


# -- the device thread ---------------------------------------------------------------------
def test_thread_mode_answers_at_the_timeout_and_refuses_until_the_batch_returns():
    release = threading.Event()
    hanging = HangingModel(release)
    rec = ListRecorder()
    engine = Engine({"hanging": hanging, "double": DoubleModel()},
                    {"hanging": BatchingConfig(max_batch_size=2, execution_timeout_ms=200.0),
                     "double": BatchingConfig(max_batch_size=4)}, recorder=rec)
    executor = engine._dispatchers["hanging"].executor

    async def main() -> None:
        await engine.start()
        try:
            stuck = submit_all(engine, "hanging", [vec(99, 30), vec(1)])
            await wait_for(lambda: answered(stuck), "the timeout's answers")
            assert hanging.hanging.is_set() and hanging.returned == 0  # still inside
            for result, error in stuck:
                assert result is None and isinstance(error, ModelTimedOut)
                assert error.http_status == 503
                assert error.message.startswith(
                    "model 'hanging' took longer than execution_timeout_ms=200 on a batch of 2;")
                assert "refuses requests (503) until that batch returns" in error.message
            assert executor.stuck

            # the other model keeps running on a new device thread
            healthy = submit_all(engine, "double", [vec(i) for i in range(6)])
            await wait_for(lambda: answered(healthy), "the healthy model's answers")
            assert outputs(healthy) == [2.0 * i for i in range(6)]

            # the stuck model refuses, with a 503 that says why
            refused = submit_all(engine, "hanging", [vec(5)])
            await wait_for(lambda: answered(refused), "the refusal")
            [(result, error)] = refused
            assert isinstance(error, ModelNotReady) and error.http_status == 503
            assert "model 'hanging' is stuck in a batch" in error.message

            # once the batch returns (its results dropped), the model serves again
            release.set()
            await wait_for(lambda: not executor.stuck, "the stuck batch to return")
            again = submit_all(engine, "hanging", [vec(7), vec(8)])
            await wait_for(lambda: answered(again), "answers after the return")
            assert outputs(again) == [14.0, 16.0]
        finally:
            release.set()
            await engine.stop()
        assert engine._backend.workers == 2
        [event] = [e for e in rec.of(EventRow) if e.kind == "model_timeout"]
        details = json.loads(event.details_json)
        assert details["batch_size"] == 2 and details["execution_timeout_ms"] == 200.0
        assert [b.outcome for b in rec.of(BatchRow) if b.model == "hanging"] == [
            "timeout", "ok"]  # the refused batch never ran: no row
        hanging_rows = [r.outcome for r in rec.of(RequestRow) if r.model == "hanging"]
        assert sorted(hanging_rows) == ["error"] * 3 + ["ok"] * 2

    asyncio.run(asyncio.wait_for(main(), 60))


def test_no_timeout_when_it_is_off_or_the_batch_is_quick():
    release = threading.Event()
    hanging = HangingModel(release)
    engine = Engine({"hanging": hanging},
                    {"hanging": BatchingConfig(max_batch_size=1, execution_timeout_ms=None)})

    async def main() -> None:
        await engine.start()
        try:
            slow = submit_all(engine, "hanging", [vec(99, 0.4)])  # 0.4 s, no timeout
            quick = submit_all(engine, "hanging", [vec(3)])
            await wait_for(lambda: answered(slow, quick), "every answer")
            assert outputs(slow) == [198.0] and outputs(quick) == [6.0]
            engine.update_settings("hanging", {"execution_timeout_ms": 5000.0}, "test")
            fast = submit_all(engine, "hanging", [vec(i) for i in range(5)])
            await wait_for(lambda: answered(fast), "every answer")
            assert outputs(fast) == [0.0, 2.0, 4.0, 6.0, 8.0]
        finally:
            release.set()
            await engine.stop()
        assert engine._backend.workers == 1

    asyncio.run(asyncio.wait_for(main(), 60))


# -- the device process ---------------------------------------------------------------------
def test_process_mode_kills_the_child_resends_what_waited_and_serves_after_restart():
    rec = ListRecorder()
    models = {name: load_model(f"{name}={spec}") for name, spec in SPECS.items()}
    engine = Engine(models,
                    {"hanging": BatchingConfig(max_batch_size=2, execution_timeout_ms=1500.0),
                     "double": BatchingConfig(max_batch_size=4)},
                    recorder=rec, device_process=True,
                    model_specs=[f"{n}={s}" for n, s in SPECS.items()])

    async def main() -> None:
        await engine.start()
        process = engine._processes["hanging"]
        other = engine._processes["double"]
        assert process is not other  # one child per model
        try:
            first_pid, other_pid = process.pid, other.pid
            # two batches of 2: the first hangs, the second waits behind it in the pipe
            hang = submit_all(engine, "hanging", [vec(99, 60), vec(1), vec(2), vec(3)])
            await wait_for(lambda: engine.stats("hanging")["in_flight"] == 4, "both batches")
            await wait_for(lambda: answered(hang[:2]), "the timeout's answers")
            for result, error in hang[:2]:
                assert result is None and isinstance(error, ModelTimedOut)
                assert "execution_timeout_ms=1500 on a batch of 2" in error.message
                assert "device process running it was killed" in error.message
            # the healthy model's own child goes on serving, untouched
            healthy = submit_all(engine, "double", [vec(i) for i in range(5)])
            await wait_for(lambda: answered(hang, healthy), "answers after the restart")
            assert outputs(hang[2:]) == [4.0, 6.0]  # sent again, not failed
            assert outputs(healthy) == [2.0 * i for i in range(5)]
            assert process.timeouts == 1 and process.restarts == 1
            assert process.pid != first_pid and other.pid == other_pid and other.restarts == 0
        finally:
            await engine.stop()
        kinds = [e.kind for e in rec.of(EventRow)]
        assert kinds.count("model_timeout") == 1 and "model_error" not in kinds
        rows = [r.outcome for r in rec.of(RequestRow)]
        assert len(rows) == 9 and rows.count("error") == 2

    asyncio.run(asyncio.wait_for(main(), 120))


def test_a_hang_in_one_models_process_costs_the_others_nothing():
    """One device process per model, and a batch that overstays gives the device turn
    back: the healthy model is served while the hanging one's batch is still out (its
    timeout, the 30 s default ceiling, is far off: too few batches for an automatic one)."""
    rec = ListRecorder()
    models = {name: load_model(f"{name}={spec}") for name, spec in SPECS.items()}
    engine = Engine(models, {"double": BatchingConfig(max_batch_size=4)}, recorder=rec,
                    device_process=True, model_specs=[f"{n}={s}" for n, s in SPECS.items()])

    async def main() -> None:
        await engine.start()
        try:
            hang = submit_all(engine, "hanging", [vec(99, 60)])
            await wait_for(lambda: engine.stats("hanging")["in_flight"] == 1, "the hang")
            for round_ in range(3):
                healthy = submit_all(engine, "double", [vec(i) for i in range(6)])
                await wait_for(lambda: answered(healthy), f"round {round_} of double")
                assert outputs(healthy) == [2.0 * i for i in range(6)]
            assert not answered(hang)  # still running in its own child
            assert engine._dispatchers["hanging"].stall_yields == 1
        finally:
            await engine.stop(drain_timeout_s=0.5)

    asyncio.run(asyncio.wait_for(main(), 120))


def test_the_automatic_timeout_follows_recent_batches_and_ignores_one_outlier():
    from runtime.device.timeouts import FLOOR_S, MIN_BATCHES, BatchTimes

    cfg = BatchingConfig()  # execution_timeout_ms=30000 is the ceiling, auto on
    times = BatchTimes()
    for _ in range(MIN_BATCHES - 1):
        times.observe(0.005)
    assert times.timeout_s(cfg) == 30.0  # too few batches: the ceiling
    times.observe(12.0)  # a hang that ran to its end
    assert times.timeout_s(cfg) == FLOOR_S  # 10 x 5 ms is under the floor
    for _ in range(40):
        times.observe(0.5)
    assert times.timeout_s(cfg) == 5.0  # 10 x the p99 of what the model really does
    assert times.timeout_s(cfg.with_changes({"execution_timeout_ms": 3000.0})) == 3.0
    assert times.timeout_s(cfg.with_changes({"execution_timeout_auto": False})) == 30.0
    assert times.timeout_s(cfg.with_changes({"execution_timeout_ms": None,
                                             "execution_timeout_auto": False})) is None
