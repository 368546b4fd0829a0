"""The device process: batches run in a child process through the real engine.

Outcomes are count-based: requests are queued synchronously with ``Engine.submit``
before the worker runs, so the first batch of each model holds ``max_batch_size``
of them; waits are bounded and never asserted on.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import textwrap

import numpy as np
import pytest
import torch

from batchscope.storage.records import BatchRow, EventRow, ListRecorder, RequestRow
from runtime.tools.cli import build_parser, device_process_default
from runtime.api.config import BatchingConfig, ServerConfig
from runtime.engine.engine import Engine
from runtime.api.errors import BatchLost, ConfigError, ModelError
from runtime.device.executor import pack_items, pack_outputs, unpack_items, unpack_outputs
from runtime.device.process import DEVICE_NICE_CPU
from runtime.models.loader import load_model
from tests.factories import SLEEPY_MODEL, SLOW_MODEL, wait_for

TOYS = {"double": "runtime.models.toys:DoubleModel", "varlen": "runtime.models.toys:VarLenModel",
        "failing": "runtime.models.toys:FailingModel", "oomtoy": "runtime.models.toys:OOMModel"}



# -- packing (no process) -------------------------------------------------------------
def test_same_shape_items_travel_stacked_and_come_back_equal():
    items = [np.full(4, i, dtype=np.float32) for i in range(5)]
    packed = pack_items(items)
    assert packed[0] == "stack"
    back = unpack_items(packed)
    assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(items, back))
    tensors = [torch.arange(3) + i for i in range(4)]
    back = unpack_items(pack_items(tensors))
    assert all(isinstance(t, torch.Tensor) and torch.equal(t, u) for t, u in zip(tensors, back))


def test_ragged_items_travel_concatenated_with_their_lengths():
    items = [torch.arange(n, dtype=torch.int64) for n in (3, 1, 7)]
    packed = pack_items(items)
    assert packed[0] == "cat" and packed[3] == [3, 1, 7]
    back = unpack_items(packed)
    assert [t.tolist() for t in back] == [t.tolist() for t in items]
    arrays = [np.ones((n, 2), dtype=np.float32) * n for n in (2, 5)]
    assert [a.shape for a in unpack_items(pack_items(arrays))] == [(2, 2), (5, 2)]


def test_mixed_items_and_outputs_fall_back_to_plain_lists():
    mixed = [np.zeros(2, dtype=np.float32), np.zeros(2, dtype=np.int64)]
    assert pack_items(mixed)[0] == "raw"
    assert pack_items([{"a": 1}])[0] == "raw"
    outs = [{"A": np.ones(2, np.float32), "B": np.array([i])} for i in range(3)]
    packed = pack_outputs(outs)
    assert packed[0] == "cols"
    back = unpack_outputs(packed)
    assert [int(o["B"][0]) for o in back] == [0, 1, 2] and back[1]["A"].tolist() == [1.0, 1.0]
    uneven = [{"A": np.ones(2)}, {"A": np.ones(3)}]
    assert pack_outputs(uneven)[0] == "raw"


# -- through the engine ----------------------------------------------------------------
def _submit_all(engine: Engine, model: str, bodies: list[dict]) -> list:
    """Queue every request synchronously; a list that fills in place with (result, error)."""
    results: list = [None] * len(bodies)

    for i, body in enumerate(bodies):
        def done(result, error, i=i):
            results[i] = (result, error)
        engine.submit(model, body, None, None, False, done)
    return results


def _vec(first: float) -> dict:
    return {"INPUT0": np.array([first, 1, 2, 3], dtype=np.float32)}


def test_batches_run_in_the_child_with_correct_outputs_errors_and_oom_splits():
    rec = ListRecorder()
    models = {name: load_model(f"{name}={spec}") for name, spec in TOYS.items()}
    configs = {"double": BatchingConfig(max_batch_size=8),
               "failing": BatchingConfig(max_batch_size=4),
               "oomtoy": BatchingConfig(max_batch_size=32)}
    engine = Engine(models, configs, recorder=rec, device_process=True,
                    model_specs=[f"{n}={s}" for n, s in TOYS.items()])

    async def run() -> None:
        await engine.start()
        try:
            pid = engine._processes["double"].pid
            assert pid != os.getpid()
            double = _submit_all(engine, "double", [_vec(i) for i in range(20)])
            lengths = [3, 9, 17, 30, 5]
            varlen = _submit_all(engine, "varlen", [
                {"INPUT0": np.ones(n, dtype=np.float32)} for n in lengths])
            failing = _submit_all(engine, "failing", [_vec(v) for v in (1, 2, -1, 3, 4, 5, 6, 7)])
            oom = _submit_all(engine, "oomtoy", [_vec(i) for i in range(20)])
            lists = (double, varlen, failing, oom)
            await wait_for(lambda: all(r is not None for rs in lists for r in rs), "every answer")

            assert [r[1] for r in double] == [None] * 20
            assert [float(r[0]["OUTPUT0"][0]) for r in double] == [2.0 * i for i in range(20)]
            assert [float(r[0]["SUM"][0]) for r in varlen] == [float(n) for n in lengths]
            # the first batch of failing (4 requests) holds the negative one: it is split
            # (isolate_errors) until only that request fails
            assert [r[1] is None for r in failing] == [True, True, False] + [True] * 5
            assert isinstance(failing[2][1], ModelError) and "fails on cue" in str(failing[2][1])
            assert "failed on this request" in str(failing[2][1])
            assert [r[1] for r in oom] == [None] * 20
            assert [float(r[0]["OUTPUT0"][0]) for r in oom] == [2.0 * i for i in range(20)]

            rows = rec.of(BatchRow)
            double_sizes = [b.batch_size for b in rows if b.model == "double"]
            assert double_sizes[0] == 8 and sum(double_sizes) == 20
            oom_rows = [(b.batch_size, b.outcome) for b in rows if b.model == "oomtoy"]
            assert oom_rows[0] == (20, "oom") and ("oom" not in [o for s, o in oom_rows if s <= 8])
            kinds = [e.kind for e in rec.of(EventRow)]
            assert "oom" in kinds and "model_error" in kinds
            assert engine.stats("oomtoy")["effective_max_batch_size"] == 5  # 20 and 10 ran out

            # a settings change reaches the child: a memory budget of 4 MiB (1 MiB/item)
            engine.update_settings("double", {"memory_budget_mb": 4.0, "max_batch_size": 8},
                                   requested_by="test")
            # the double toy estimates nothing: its batches keep running whole
            again = _submit_all(engine, "double", [_vec(1) for _ in range(8)])
            before = len(rec.of(BatchRow))
            engine.update_settings("oomtoy", {"memory_budget_mb": 4.0}, requested_by="test")
            budget = _submit_all(engine, "oomtoy", [_vec(1) for _ in range(8)])
            await wait_for(lambda: all(r is not None for r in again)
                            and all(r is not None for r in budget), "budget answers")
            assert [r[1] for r in again + budget] == [None] * 16
            tail = [(b.batch_size, b.outcome) for b in rec.of(BatchRow)[before:]
                    if b.model == "oomtoy"]
            # capped at 5 after the splits above; over the 4 MiB budget, a 5 splits again
            assert (5, "oom") in tail and max(s for s, o in tail if o == "ok") <= 4
            assert all(r.outcome in ("ok", "error") for r in rec.of(RequestRow))
        finally:
            await engine.stop()
        assert len(set(engine._processes.values())) == len(TOYS)  # one child per model
        assert all(p.restarts == 0 for p in engine._processes.values())

    asyncio.run(run())


def test_a_killed_child_fails_its_batch_and_a_new_one_serves_the_next(tmp_path):
    path = tmp_path / "slow_model.py"
    path.write_text(textwrap.dedent(SLOW_MODEL))
    spec = f"{path}:SlowModel"
    rec = ListRecorder()
    engine = Engine({"slow": load_model(spec)}, {"slow": BatchingConfig(max_batch_size=4)},
                    recorder=rec, device_process=True, model_specs=[spec])

    async def run() -> None:
        await engine.start()
        try:
            first_pid = engine._processes["slow"].pid
            stuck = _submit_all(engine, "slow", [{"INPUT0": np.array([99, 0], np.float32)},
                                                 {"INPUT0": np.array([5, 0], np.float32)}])
            await wait_for(lambda: engine.stats("slow")["in_flight"] == 2, "the batch to run")
            os.kill(first_pid, signal.SIGKILL)
            await wait_for(lambda: all(r is not None for r in stuck), "the lost batch's answers")
            for result, error in stuck:  # not the model's fault: 503, send it again
                assert result is None and isinstance(error, BatchLost)
                assert error.http_status == 503 and error.retry_after_s == 1.0
                assert "SIGKILL" in str(error) and "send the request again" in str(error)
            later = _submit_all(engine, "slow", [{"INPUT0": np.array([i, 0], np.float32)}
                                                 for i in range(3)])
            await wait_for(lambda: all(r is not None for r in later), "answers after restart")
            assert [r[1] for r in later] == [None] * 3
            assert [float(r[0]["OUTPUT0"][0]) for r in later] == [1.0, 2.0, 3.0]
            assert engine._processes["slow"].restarts == 1 and engine._processes["slow"].pid != first_pid
        finally:
            await engine.stop()
        events = [e for e in rec.of(EventRow) if e.kind == "model_error"]
        assert any("SIGKILL" in e.message and "starting a new one" in e.message for e in events)
        assert any(json.loads(e.details_json).get("batch_size") == 2 for e in events)

    asyncio.run(run())


def test_device_process_needs_specs_and_defaults_to_on_for_the_cpu_only():
    models = {"double": load_model(f"double={TOYS['double']}")}
    with pytest.raises(ConfigError, match="model_specs"):
        Engine(models, device_process=True)
    assert ServerConfig().device_process is False
    with pytest.raises(ConfigError, match="device_process"):
        ServerConfig(device_process="yes")
    parser = build_parser()
    assert parser.parse_args(["serve"]).device_process is None   # decided by the device:
    assert device_process_default(None, "cpu") is True
    assert device_process_default(None, "cuda:0") is False
    assert device_process_default(False, "cpu") is False
    assert device_process_default(True, "cuda") is True
    assert parser.parse_args(["serve", "--device-process"]).device_process is True
    assert parser.parse_args(["serve", "--no-device-process"]).device_process is False


def test_device_process_priority_fixed_renice_and_kept_after_a_crash():
    """``device_nice`` N starts the child N levels nicer (0: the same); by default on the
    CPU it starts at the same level with a ``LoopBound`` per process sharing one tally,
    ``renice`` makes the running child nicer and a new child after a crash starts there;
    bad values are refused."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    spec = f"double={TOYS['double']}"

    def run_engine(device_nice, check) -> None:
        engine = Engine({"double": load_model(spec)}, device_process=True, model_specs=[spec],
                        device_nice=device_nice)

        async def run() -> None:
            await engine.start()
            try:
                await check(engine, engine._processes["double"])
            finally:
                await engine.stop()

        asyncio.run(run())

    def at(pid: int) -> int:
        return os.getpriority(os.PRIO_PROCESS, pid)

    async def default(engine: Engine, process) -> None:
        assert at(process.pid) == base and process.nice == 0
        bound = engine._priorities[process]
        assert bound.nice == DEVICE_NICE_CPU and not bound.applied
        process.renice(DEVICE_NICE_CPU)
        assert at(process.pid) == min(19, base + DEVICE_NICE_CPU)
        os.kill(process.pid, signal.SIGKILL)
        await wait_for(lambda: process.restarts == 1, "a new child")
        answers = _submit_all(engine, "double", [_vec(1.0)])
        await wait_for(lambda: answers[0] is not None, "an answer from it")
        assert answers[0][1] is None
        assert at(process.pid) == min(19, base + DEVICE_NICE_CPU)

    async def fixed(engine: Engine, process) -> None:
        assert at(process.pid) == min(19, base + 3) and not engine._priorities

    run_engine(None, default)
    run_engine(3, fixed)
    assert ServerConfig().device_nice is None and ServerConfig(device_nice=19).device_nice == 19
    for bad in (-1, 20, "3", 2.5, True):
        with pytest.raises(ConfigError, match="device_nice"):
            ServerConfig(device_nice=bad)
    parser = build_parser()
    assert parser.parse_args(["serve"]).device_nice is None
    assert parser.parse_args(["serve", "--device-nice", "4"]).device_nice == 4


def test_a_model_dearer_than_the_loop_keeps_its_priority(tmp_path):
    """A real model whose batches take 20 ms each: every window the loop's CPU per
    request is measured and found below the model's device time, and the process keeps
    the serving process's priority."""
    path = tmp_path / "sleepy_model.py"
    path.write_text(SLEEPY_MODEL)
    spec = f"{path}:Sleepy"
    engine = Engine({"sleepy": load_model(spec)}, device_process=True, model_specs=[spec],
                    direct_max_compute_ms=0)
    base = os.getpriority(os.PRIO_PROCESS, 0)

    async def run() -> None:
        await engine.start()
        try:
            process = engine._processes["sleepy"]
            bound = engine._priorities[process]
            bound.check_every_s, bound.min_requests = 0.0, 4  # judge every few requests
            for _ in range(5):
                answers = _submit_all(engine, "sleepy", [{"X": np.full(4, i, np.float32)}
                                                          for i in range(6)])
                await wait_for(lambda: all(a is not None for a in answers), "answers")
            assert bound.loop_s_per_request is not None
            assert bound.loop_s_per_request < engine._models["sleepy"].batcher \
                .mean_compute_per_request_s
            assert not bound.applied and process.nice == 0
            assert os.getpriority(os.PRIO_PROCESS, process.pid) == base
        finally:
            await engine.stop()

    asyncio.run(run())


def test_setup_failure_in_the_child_is_reported(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text(textwrap.dedent(SLOW_MODEL) + textwrap.dedent('''
        class Broken(SlowModel):
            name = "broken"
            def setup(self, device):
                raise RuntimeError("weights are missing")
    '''))
    spec = f"{path}:Broken"
    engine = Engine({"broken": load_model(spec)}, device_process=True, model_specs=[spec])

    async def run() -> None:
        with pytest.raises(RuntimeError, match="weights are missing"):
            await engine.start()

    asyncio.run(run())


@pytest.mark.slow
def test_server_with_device_process_answers_tritonclient():
    import tritonclient.http as triton

    from runtime.server.service import Service, ServiceThread

    models = {"double": load_model(f"double={TOYS['double']}")}
    cfg = ServerConfig(record=False, models=(f"double={TOYS['double']}",), device_process=True)
    runner = ServiceThread(Service(models, {"double": BatchingConfig(max_batch_size=8)}, cfg,
                                   instance_id="device-process-test"))
    url = runner.start()
    try:
        client = triton.InferenceServerClient(url.removeprefix("http://"),
                                              network_timeout=30.0, connection_timeout=30.0)
        for k in range(3):
            x = np.array([[k, 1.5, -2, 4]], dtype=np.float32)
            inp = triton.InferInput("INPUT0", [1, 4], "FP32")
            inp.set_data_from_numpy(x, binary_data=True)
            res = client.infer("double", [inp])
            assert res.as_numpy("OUTPUT0").reshape(-1).tolist() == (x[0] * 2).tolist()
        client.close()
    finally:
        runner.stop()
    assert runner.error is None
