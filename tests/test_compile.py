"""``compile``: predict through torch.compile, compiled when the setting takes effect.

Real torch.compile (inductor, C++ on the CPU). Whether a call compiled is read from
dynamo's graph counter, so the assertions count graphs, never seconds.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch

from batchscope.storage.records import EventRow, ListRecorder
from runtime.api.config import BatchingConfig
from runtime.device import compiled as compiled_mod
from runtime.device.compiled import compiled_frames, synthetic_inputs
from runtime.device.executor import run_batch
from runtime.engine.engine import Engine
from runtime.models.toys import DoubleModel, VarLenModel
from runtime.core.clock import MonotonicClock

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")


def batch(model, n, length=4):
    return [model.decode({"INPUT0": np.arange(length, dtype=np.float32) + i}) for i in range(n)]


def one_compiled_batch(mode: str, n: int = 2):
    """The one attempt of a fresh ``DoubleModel``'s first batch of ``n`` with ``compile=mode``."""
    model = DoubleModel()
    model.setup(CPU)
    [a] = run_batch(model, batch(model, n), None, None, None, BatchingConfig(compile=mode),
                    False, CPU, MonotonicClock())
    return a


class Smooth(VarLenModel):
    """A variable-length model whose predict is all tensor work (nothing dynamo must
    specialise on)."""

    def predict(self, batch):
        return torch.tanh(batch * 0.5).sum(dim=1), batch.shape[1]


def test_compiles_once_on_synthetic_batches_then_reuses_one_graph_for_every_size():
    model = Smooth()
    model.setup(CPU)
    cfg = BatchingConfig(compile="default")
    clock = MonotonicClock()
    before = compiled_frames()
    items = batch(model, 3, 5)
    first = run_batch(model, items, [5] * 3, None, None, cfg, True, CPU, clock)
    [a] = first
    assert a.outcome == "ok" and a.compile_s > 0 and a.compile_error is None
    warm = compiled_frames()
    assert warm > before  # the warm-up compiled, before the real batch ran
    eager = model.split(model.predict(model.collate(items, None)), 3)
    for got, want in zip(a.outputs, eager):
        np.testing.assert_allclose(got["SUM"], want["SUM"], rtol=1e-6)
    for n, length in ((1, 3), (7, 11), (5, 2), (1, 9)):  # new sizes and lengths: no new graph
        [b] = run_batch(model, batch(model, n, length), [length] * n, None, None, cfg, True, CPU, clock)
        assert b.outcome == "ok" and b.compile_s == 0
    assert compiled_frames() == warm


def test_synthetic_inputs_follow_the_declared_shapes():
    model = Smooth()
    inputs = synthetic_inputs(model, 6)
    assert list(inputs) == ["INPUT0"] and inputs["INPUT0"].shape == (6,)
    assert inputs["INPUT0"].dtype == np.float32


def test_a_compiler_that_fails_leaves_the_model_eager_and_says_why():
    import torch._inductor.config as inductor

    model = DoubleModel()
    model.setup(CPU)
    cfg = BatchingConfig(compile="max-autotune")
    with inductor.patch({"cpp.cxx": ("/nonexistent/c++",)}):  # a machine without a compiler
        [a] = run_batch(model, batch(model, 2), None, None, None, cfg, False, CPU, MonotonicClock())
    assert a.outcome == "ok" and a.compile_error
    # the cause, not only the backend's first line ("backend='inductor' raised:")
    assert not a.compile_error.rstrip().endswith("raised:") and "TORCH_LOGS" not in a.compile_error
    assert [o["OUTPUT0"].tolist() for o in a.outputs] == [[0, 2, 4, 6], [2, 4, 6, 8]]
    [b] = run_batch(model, batch(model, 2), None, None, None, cfg, False, CPU, MonotonicClock())
    assert b.outcome == "ok" and b.compile_error is None  # said once
    assert compiled_mod.compiled_already(model, "max-autotune")


def test_the_engine_books_a_compile_event_and_answers_every_request():
    rec = ListRecorder()
    cfg = BatchingConfig(max_batch_size=8, compile="default")
    model = DoubleModel()
    engine = Engine({"double": model}, {"double": cfg}, recorder=rec)

    async def main() -> list:
        await engine.start()
        try:
            results = await asyncio.gather(*[
                engine.infer("double", {"INPUT0": np.full(4, float(i), dtype=np.float32)})
                for i in range(6)])
        finally:
            await engine.stop()
        return results

    results = asyncio.run(asyncio.wait_for(main(), 300))
    assert [float(r["OUTPUT0"][0]) for r in results] == [2.0 * i for i in range(6)]
    events = [e for e in rec.of(EventRow) if e.kind.startswith("compile")]
    assert [e.kind for e in events] == ["compile"], [e.message for e in events]
    details = json.loads(events[0].details_json)
    assert details["mode"] == "default" and details["compile_s"] > 0


def test_a_backend_failure_is_described_by_its_cause():
    """torch's BackendCompilerFailed puts the cause on the lines after "raised:"."""
    class BackendCompilerFailed(Exception):
        pass

    exc = BackendCompilerFailed("backend='inductor' raised:\nCalledProcessError: Command "
                                "'['/usr/bin/gcc', ...]' returned non-zero exit status 1.\n\n"
                                "Set TORCH_LOGS=\"+dynamo\" and TORCHDYNAMO_VERBOSE=1 for more information")
    said = compiled_mod.describe_failure(exc)
    assert said == ("BackendCompilerFailed: backend='inductor' raised: CalledProcessError: Command "
                    "'['/usr/bin/gcc', ...]' returned non-zero exit status 1.")
    assert len(compiled_mod.describe_failure(Exception("x" * 5000))) == compiled_mod.MAX_REASON_CHARS


def test_a_compiler_that_fails_on_inference_tensors_gets_ordinary_ones(monkeypatch):
    """torch 2.11's inductor (reduce-overhead, CUDA) failed on the mlp's inference-tensor
    batch; the compiled model is then called on ordinary copies, outside inference mode."""
    real = torch.compile
    calls = []

    def picky_compile(fn, mode=None):
        compiled = real(fn, mode="default")

        def call(batch):
            calls.append(batch.is_inference())
            if batch.is_inference() or torch.is_inference_mode_enabled():
                raise RuntimeError("backend='inductor' raised:\nRuntimeError: <weakref to UntypedStorage>")
            return compiled(batch)
        return call

    monkeypatch.setattr(torch, "compile", picky_compile)
    a = one_compiled_batch("reduce-overhead", n=3)
    assert a.outcome == "ok" and a.compile_error is None, a.compile_error
    assert [o["OUTPUT0"].tolist() for o in a.outputs][0] == [0, 2, 4, 6]
    assert calls[0] is True and calls[-1] is False  # refused once, then ordinary tensors


def test_compiling_happens_off_the_serving_thread(monkeypatch):
    """What a failed compile leaves in the thread that ran it (torch 2.11 broke its
    dispatcher state) must not reach the thread that serves the model."""
    import threading

    seen = []
    real = torch.compile

    def noting_compile(fn, mode=None):
        compiled = real(fn, mode="default")

        def call(batch):
            seen.append(threading.current_thread().name)
            return compiled(batch)
        return call

    monkeypatch.setattr(torch, "compile", noting_compile)
    a = one_compiled_batch("default")
    assert a.outcome == "ok" and a.compile_error is None
    warm, served = seen[:-1], seen[-1]
    assert warm and set(warm) == {"batchscope-compile"} and served == threading.current_thread().name


def test_every_thread_running_a_compiled_model_has_the_cuda_graph_state(monkeypatch):
    """reduce-overhead's CUDA graph trees keep per-thread state that torch 2.11 filled
    only on the thread importing it: the first batch on any other thread failed with a
    bare AssertionError. Each thread running the compiled model must have it first."""
    import threading

    from torch._inductor import cudagraph_trees as trees

    seen = []
    real = torch.compile

    def noting_compile(fn, mode=None):
        compiled = real(fn, mode="default")

        def call(batch):
            ready = hasattr(trees.local, "tree_manager_containers") or \
                torch._C._is_key_in_tls("tree_manager_containers")
            seen.append((threading.current_thread().ident, threading.current_thread().name, ready))
            return compiled(batch)
        return call

    monkeypatch.setattr(torch, "compile", noting_compile)
    a = one_compiled_batch("default")
    assert a.outcome == "ok" and a.compile_error is None
    other = []
    worker = threading.Thread(target=lambda: other.append(one_compiled_batch("default").outcome),
                              name="another-device-thread")
    worker.start()
    worker.join(60)
    assert other == ["ok"]
    assert all(ready for _, _, ready in seen), seen
    assert {name for _, name, _ in seen} == {"batchscope-compile", threading.current_thread().name,
                                             "another-device-thread"}


@pytest.mark.parametrize("name", ["mlp", "encoder", "wide"])
def test_a_bundled_predict_compiles_without_an_inference_mode_switch(name):
    """run_batch already holds inference mode; a predict that enters it again puts
    ``_enter_inference_mode`` into the compiled graph, which torch 2.11's compiler failed
    on for ``mlp`` on the H200 (pytorch/pytorch#181512)."""
    from runtime.models.loader import load_model

    model = load_model(name)
    model.setup(CPU)
    inputs = synthetic_inputs(model, 8)
    with torch.inference_mode():
        batch = model.collate([model.decode(inputs)] * 2, None)
    # as run_batch calls it (inference mode), and as a compile fallback does (no_grad):
    # one whole graph each time, no switch in it
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            explained = torch._dynamo.explain(model.predict)(batch)
        code = "\n".join(g.code for g in explained.graphs)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), mode
        assert "inference_mode" not in code
    direct = model.predict(batch)  # called outside inference mode, it still is in it
    assert not direct.requires_grad


def test_outside_inference_mode_copies_the_tensors_of_a_dataclass_batch():
    """The encoder's batch is a dataclass: its inference tensors are copied too."""
    from dataclasses import dataclass

    @dataclass
    class Batch:
        ids: torch.Tensor
        mask: torch.Tensor
        note: str

    seen = []

    def fn(batch):
        seen.append((batch.ids.is_inference(), batch.mask.is_inference(), batch.note,
                     torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return batch.ids.sum()

    with torch.inference_mode():
        made = Batch(torch.arange(4), torch.zeros(4, dtype=torch.bool), "kept")
        compiled_mod.outside_inference_mode(fn)(made)
    assert seen == [(False, False, "kept", False, False)]


def test_a_fallback_that_compiles_nothing_is_reported_as_a_failure(monkeypatch):
    """Ordinary tensors are tried only for a failure inference tensors may cause, and
    count only when they compile a graph: a model left eager says so."""
    def not_compiling(fn, mode=None):
        def call(batch):
            if torch.is_inference_mode_enabled():
                raise RuntimeError("backend='inductor' raised:\nRuntimeError: <weakref to UntypedStorage>")
            return fn(batch)  # runs, but nothing is compiled
        return call

    monkeypatch.setattr(torch, "compile", not_compiling)
    a = one_compiled_batch("default")
    assert a.outcome == "ok" and "UntypedStorage" in (a.compile_error or "")
