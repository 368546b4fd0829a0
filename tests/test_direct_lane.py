"""The direct lane: a lone short batch that finds its device process idle runs in the
serving process (``runtime.engine.direct``).

Which batch goes where is decided from counts (batch sizes, the queue, whether the
process has a batch out), so each outcome here follows from the requests sent, never
from timing. The engine tests run a real device process.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import torch

from batchscope.storage.records import BatchRow, ListRecorder
from runtime.api.config import BatchingConfig
from runtime.engine import direct
from runtime.engine.direct import DirectLane
from runtime.engine.engine import Engine
from runtime.models.loader import load_model
from runtime.models.toys import HANG_CUE

DOUBLE = "double=runtime.models.toys:DoubleModel"


def lane_for(per_request_s: float | None = 1e-5, depth: int = 0,
             device: str = "cpu") -> DirectLane:
    """A lane over a stand-in model whose batcher reports these figures."""
    model = SimpleNamespace(name="m", batcher=SimpleNamespace(
        mean_compute_per_request_s=per_request_s, depth=depth))
    lane = DirectLane(model, torch.device(device), None, 0.002)
    lane.ready = device == "cpu"
    return lane


def batch(n: int = 1, adapters=None, compile: str = "off") -> SimpleNamespace:
    return SimpleNamespace(requests=[object()] * n, adapters=adapters,
                           config=SimpleNamespace(compile=compile))


def test_a_lone_short_batch_runs_directly_only_when_there_is_nothing_else():
    assert lane_for().takes(batch(), process_idle=True) == "loop"
    assert lane_for().takes(batch(), process_idle=False) is None  # the process has work
    assert lane_for(depth=3).takes(batch(), process_idle=True) is None  # more requests wait
    assert lane_for().takes(batch(2), process_idle=True) is None  # something to batch
    assert lane_for(per_request_s=None).takes(batch(), process_idle=True) is None  # unmeasured
    # too long for the loop: the lane's thread (the spill), not the loop
    assert lane_for(per_request_s=0.003).takes(batch(), process_idle=True) == "thread"
    assert lane_for().takes(batch(adapters=object()), process_idle=True) is None
    assert lane_for().takes(batch(compile="default"), process_idle=True) is None
    assert lane_for(device="cuda").takes(batch(), process_idle=True) is None
    running = lane_for()
    running.running = True  # one is already waiting for its turn on the loop
    assert running.takes(batch(), process_idle=True) is None


def test_a_lone_long_batch_spills_to_the_lanes_thread():
    assert lane_for(per_request_s=0.006).takes(batch(), process_idle=False) == "thread"
    # the process idle: no hop to it either
    assert lane_for(per_request_s=0.006).takes(batch(), process_idle=True) == "thread"
    assert lane_for(per_request_s=0.001).takes(batch(), process_idle=False) is None  # short:
    # it waits in the process' pipe, which is soon free, rather than take a core
    assert lane_for(per_request_s=0.06).takes(batch(), process_idle=False) is None  # too long
    assert lane_for(per_request_s=0.006).takes(batch(2), process_idle=False) is None
    assert lane_for(per_request_s=0.006, depth=1).takes(batch(), process_idle=False) is None
    assert lane_for(per_request_s=0.006, device="cuda").takes(batch(), process_idle=False) is None
    busy = lane_for(per_request_s=0.006)
    busy.on_thread = object()  # one runs on the thread already: the copy serves one at a time
    assert busy.takes(batch(), process_idle=False) is None
    assert direct.SPILL_MAX_COMPUTE_S == 0.05


def test_after_batches_of_several_the_lane_waits_for_the_traffic_to_thin_out():
    lane = lane_for()
    assert lane.takes(batch(8), process_idle=True) is None  # mean 1.7: traffic
    taken = [lane.takes(batch(1), process_idle=True) for _ in range(6)]
    # the mean falls by a tenth of its excess per lone batch: 1.63, 1.57, 1.51, 1.46...
    assert taken == [None, None, None, "loop", "loop", "loop"]
    assert direct.DIRECT_MAX_MEAN_BATCH == 1.5 and direct.BATCH_MEAN_WEIGHT == 0.1


def test_a_lone_long_request_runs_on_the_lanes_thread_and_the_next_on_the_process():
    """A lone request too long for the loop runs on the serving process' copy, on the
    lane's thread, even with the device process idle (no hop); it hangs there, and a
    request that comes meanwhile goes to the idle device process instead of waiting
    behind it (the dispatcher counts only batches out at the process as busy)."""
    hanging = "hanging=runtime.models.toys:HangingModel"
    # a limit every batch passes: no batch runs on the loop, so only the spill is left
    engine = Engine({"hanging": load_model(hanging)}, {"hanging": BatchingConfig()},
                    recorder=ListRecorder(), device_process=True, model_specs=[hanging],
                    direct_max_compute_ms=1e-9)

    async def run() -> tuple[np.ndarray, bool]:
        await engine.start()
        try:
            await engine.infer("hanging", {"INPUT0": np.ones(4, np.float32)})  # measured
            held = asyncio.ensure_future(engine.infer(
                "hanging", {"INPUT0": np.array([HANG_CUE, 30.0, 0, 0], np.float32)}))
            lane = engine._dispatchers["hanging"].executor.direct
            for _ in range(1000):  # until the held batch is out on the lane's thread
                if lane.on_thread is not None:
                    break
                await asyncio.sleep(0.01)
            out = await asyncio.wait_for(
                engine.infer("hanging", {"INPUT0": np.full(4, 3.0, np.float32)}), 20.0)
            return out["OUTPUT0"], held.done()
        finally:
            engine._dispatchers["hanging"].executor.direct.model.api.release.set()  # the copy here
            await engine.stop(drain_timeout_s=0.0)
            held.cancel()

    answer, held_done = asyncio.run(run())
    assert answer.tolist() == [6.0] * 4 and not held_done
    stats = engine.stats("hanging")
    assert stats["direct_spills"] == 1 and stats["direct_batches"] == 1  # the held one only


def run_one_at_a_time(engine: Engine, n: int) -> list[np.ndarray]:
    async def run() -> list[np.ndarray]:
        await engine.start()
        try:
            out = []
            for i in range(n):
                result = await engine.infer("double", {"INPUT0": np.full(4, i, np.float32)})
                out.append(result["OUTPUT0"])
            return out
        finally:
            await engine.stop()

    return asyncio.run(run())


def test_one_client_is_served_directly_after_the_first_batch():
    rec = ListRecorder()
    # a limit no batch reaches, so the outcome depends on counts, not on how fast this
    # machine runs the model now
    engine = Engine({"double": load_model(DOUBLE)}, {"double": BatchingConfig()},
                    recorder=rec, device_process=True, model_specs=[DOUBLE],
                    direct_max_compute_ms=60_000)
    outputs = run_one_at_a_time(engine, 12)
    # the first batch went to the device process (nothing was measured yet), the others
    # found it idle and ran here, with the same outputs and the same records
    assert engine.stats("double")["direct_batches"] == 11
    assert [o.tolist() for o in outputs] == [[2.0 * i] * 4 for i in range(12)]
    batches = [r for r in rec.records if isinstance(r, BatchRow)]
    assert len(batches) == 12 and all(b.outcome == "ok" and b.batch_size == 1 for b in batches)


def test_without_the_lane_every_batch_goes_to_the_device_process():
    engine = Engine({"double": load_model(DOUBLE)}, {"double": BatchingConfig()},
                    recorder=ListRecorder(), device_process=True, model_specs=[DOUBLE],
                    direct_max_compute_ms=0)
    outputs = run_one_at_a_time(engine, 5)
    assert engine.stats("double")["direct_batches"] is None
    assert [o.tolist() for o in outputs] == [[2.0 * i] * 4 for i in range(5)]


def test_a_spilled_batch_past_its_timeout_is_answered_and_nothing_else_spills_meanwhile():
    """The serving process' copy hangs on the lane's thread: its request is answered at the
    execution timeout (a thread cannot be stopped), and no batch spills until it returns:
    the next request goes to the device process, which answers it."""
    hanging = "hanging=runtime.models.toys:HangingModel"
    config = BatchingConfig(execution_timeout_ms=300, execution_timeout_auto=False)
    engine = Engine({"hanging": load_model(hanging)}, {"hanging": config},
                    recorder=ListRecorder(), device_process=True, model_specs=[hanging],
                    direct_max_compute_ms=1e-9)
    hang = {"INPUT0": np.array([HANG_CUE, 30.0, 0, 0], np.float32)}

    async def run() -> tuple[BaseException | None, bool, bool, np.ndarray]:
        await engine.start()
        lane = engine._dispatchers["hanging"].executor.direct
        try:
            await engine.infer("hanging", {"INPUT0": np.ones(4, np.float32)})  # measured
            error = None
            try:  # lone and too long for the loop: the lane's thread, where it hangs
                await asyncio.wait_for(engine.infer("hanging", hang), 20.0)
            except asyncio.TimeoutError:
                raise
            except Exception as exc:  # noqa: BLE001 - the answer under test
                error = exc
            still = lane.spilled
            out = await asyncio.wait_for(  # the thread is taken: the device process
                engine.infer("hanging", {"INPUT0": np.full(4, 3.0, np.float32)}), 20.0)
            lane.model.api.release.set()  # the copy in this process returns
            for _ in range(1000):
                if not lane.spilled:
                    break
                await asyncio.sleep(0.01)
            return error, still, lane.spilled, out["OUTPUT0"]
        finally:
            await engine.stop(drain_timeout_s=0.0)

    error, spilled_while_hanging, spilled_after, answer = asyncio.run(run())
    assert error is not None and "execution timeout" in str(error)
    assert spilled_while_hanging and not spilled_after
    assert answer.tolist() == [6.0] * 4
    assert engine.stats("hanging")["direct_spills"] == 1

