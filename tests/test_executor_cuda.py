"""``run_batch`` on a CUDA device, on a machine without one: a fake GPU stands in for
``torch.cuda`` (kernels launched run when the device is synchronised, the allocator's
figures), so that phase timing, a batch's own peak memory and an OOM during CUDA-graph
capture can be checked on the CPU."""

from __future__ import annotations

import contextlib
import types

import numpy as np
import pytest
import torch

from batchscope.storage.records import BatchRow
from runtime.api.config import BatchingConfig
from runtime.device import executor
from runtime.device.cudagraphs import CudaGraphRunner
from runtime.device.oom import Attempt
from runtime.models.toys import DoubleModel

CUDA = torch.device("cuda:0")
WEIGHTS = 10_000


class FakeGPU:
    """The GPU's timeline and allocator: ``launch``ed work runs, and the clock moves,
    only when the device is synchronised (as a CUDA stream does from the host's view)."""

    def __init__(self) -> None:
        self.t = 0.0
        self.queued = 0.0
        self.syncs = 0
        self.allocated = WEIGHTS       # the model's weights, there before any batch
        self.peak = WEIGHTS

    # the host side
    def now(self) -> float:
        return self.t

    def launch(self, seconds: float) -> None:
        self.queued += seconds

    def alloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        self.peak = max(self.peak, self.allocated)

    # torch.cuda
    def synchronize(self, device=None) -> None:
        self.t += self.queued
        self.queued = 0.0
        self.syncs += 1

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak = self.allocated


@pytest.fixture
def gpu(monkeypatch) -> FakeGPU:
    fake = FakeGPU()
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda, "synchronize", fake.synchronize)
    monkeypatch.setattr(cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: fake.allocated)
    monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: fake.peak)
    monkeypatch.setattr(cuda, "memory_reserved", lambda device=None: fake.peak)
    monkeypatch.setattr(cuda, "get_device_properties",
                        lambda device=None: types.SimpleNamespace(total_memory=1 << 30))
    monkeypatch.setattr(cuda, "memory_summary", lambda device=None, abbreviated=False: "")
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    return fake


class GpuModel(DoubleModel):
    """Collate copies the batch to the device (1 s of GPU work), predict launches 5 s of
    kernels and allocates 300 bytes a row of activations (freeing all but the output's
    100), split copies the output back to the host, which waits for the GPU."""

    def __init__(self, gpu: FakeGPU, *, collate_s: float = 1.0, predict_s: float = 5.0) -> None:
        super().__init__()
        self.gpu = gpu
        self.collate_s = collate_s
        self.predict_s = predict_s

    def collate(self, items, pad_to):
        self.gpu.launch(self.collate_s)
        self.gpu.alloc(10 * len(items))
        return super().collate(items, pad_to)

    def predict(self, batch):
        n = int(batch.shape[0])
        self.gpu.launch(self.predict_s)
        self.gpu.alloc(300 * n)
        self.gpu.alloc(-200 * n)
        return super().predict(batch)

    def split(self, output, n):
        self.gpu.synchronize()    # .cpu(): the host waits for the kernels
        return super().split(output, n)


def items(n: int) -> list[np.ndarray]:
    return [np.full(4, float(i), np.float32) for i in range(n)]


def run(model, n: int, gpu: FakeGPU, cfg: BatchingConfig | None = None, graphs_for=None,
        device=CUDA) -> list[Attempt]:
    return executor.run_batch(model, items(n), None, None, None, cfg or BatchingConfig(), False,
                              device, gpu, graphs_for)


# -- item 2: each phase's GPU time lands in its own phase --------------------------------
def test_on_cuda_each_phase_is_timed_with_its_own_kernels(gpu):
    [a] = run(GpuModel(gpu), 4, gpu)
    assert a.outcome == "ok"
    assert a.input_s == pytest.approx(1.0)                                  # compute_input
    assert a.compute_s - a.input_s - a.output_s == pytest.approx(5.0)       # compute_infer
    assert a.output_s == pytest.approx(0.0)                                 # compute_output
    assert a.compute_s == pytest.approx(6.0)


def test_on_cpu_nothing_is_synchronised(gpu):
    [a] = run(GpuModel(gpu), 4, gpu, device=torch.device("cpu"))
    assert a.outcome == "ok" and gpu.syncs == 1                 # only split's own wait
    assert (a.input_s, a.output_s) == (0.0, pytest.approx(6.0))  # CPU: launches are the work
    assert a.peak_memory_bytes is None and a.peak_memory_increase_bytes is None


# -- item 8: the batch's own peak beside the device's absolute peak -----------------------
def test_peak_memory_is_recorded_absolute_and_as_the_batch_s_increase(gpu):
    model = GpuModel(gpu)
    [a] = run(model, 4, gpu)
    assert a.peak_memory_bytes == WEIGHTS + 4 * 10 + 4 * 300
    assert a.peak_memory_increase_bytes == 4 * 10 + 4 * 300
    # the next batch starts from what the first left allocated (say a KV cache grew)
    [b] = run(model, 2, gpu)
    left = WEIGHTS + 4 * 10 + 4 * 100
    assert b.peak_memory_bytes == left + 2 * 10 + 2 * 300
    assert b.peak_memory_increase_bytes == 2 * 10 + 2 * 300


def test_an_oom_attempt_records_the_increase_it_reached(gpu):
    class Oom(GpuModel):
        def predict(self, batch):
            self.gpu.alloc(700)
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    [a, *_] = run(Oom(gpu), 2, gpu)
    assert a.outcome == "oom" and a.split
    assert a.peak_memory_bytes == WEIGHTS + 20 + 700 and a.peak_memory_increase_bytes == 720


def test_the_increase_reaches_the_batch_row():
    from tests.test_engine_booking import Setup

    s = Setup(max_batch_size=4)
    batch = s.batch(2)
    attempt = s.attempt(0, 2, "ok", peak_memory_bytes=5_000, peak_memory_increase_bytes=600)
    s.booking.batch_back(s.model, batch, [attempt], s.clock.now())
    [row] = s.rec.of(BatchRow)
    assert (row.peak_memory_bytes, row.peak_memory_increase_bytes) == (5_000, 600)


# -- item 11: an OOM while capturing a CUDA graph is an OOM --------------------------------
class FakeGraphs:
    """``torch.cuda`` graph capture as the runner uses it; ``capturing`` while inside."""

    def __init__(self) -> None:
        self.capturing = False
        self.replays = 0

    def graph(self, graph, pool=None, **kwargs):
        @contextlib.contextmanager
        def capture():
            self.capturing = True
            try:
                yield
            finally:
                self.capturing = False
        return capture()

    def install(self, monkeypatch) -> None:
        cuda = torch.cuda
        stream = types.SimpleNamespace(wait_stream=lambda other: None)
        monkeypatch.setattr(cuda, "Stream", lambda device=None: stream)
        monkeypatch.setattr(cuda, "current_stream", lambda device=None: stream)
        monkeypatch.setattr(cuda, "stream", lambda s: contextlib.nullcontext())
        monkeypatch.setattr(cuda, "graph_pool_handle", lambda: object())
        monkeypatch.setattr(cuda, "CUDAGraph", lambda: types.SimpleNamespace(replay=self.replay))
        monkeypatch.setattr(cuda, "graph", self.graph)

    def replay(self) -> None:
        self.replays += 1


def test_an_oom_during_graph_capture_is_booked_as_an_oom_and_capture_is_retried(gpu, monkeypatch):
    graphs = FakeGraphs()
    graphs.install(monkeypatch)
    tight = [True]

    class CaptureOom(GpuModel):
        """Runs eagerly; the capture's private memory pool does not fit while ``tight``."""

        def predict(self, batch):
            if graphs.capturing and tight[0]:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512.00 MiB")
            return super().predict(batch)

    model = CaptureOom(gpu)
    runner = CudaGraphRunner(model, CUDA, max_batch_size=4)
    assert runner.active
    cfg = BatchingConfig(max_batch_size=4, cuda_graphs=True, oom_recovery=False)
    [a] = run(model, 4, gpu, cfg, graphs_for=lambda cfg: runner)
    assert a.outcome == "oom" and "OutOfMemoryError" in a.error
    assert runner.book.failures == {} and runner.book.disabled_reason is None
    tight[0] = False   # memory freed (the OOM's split and empty_cache): capture works now
    [b] = run(model, 4, gpu, cfg, graphs_for=lambda cfg: runner)
    assert b.outcome == "ok" and b.cuda_graph and graphs.replays == 1


def test_a_capture_failure_that_is_not_an_oom_still_runs_eagerly(gpu, monkeypatch):
    graphs = FakeGraphs()
    graphs.install(monkeypatch)

    class Syncs(GpuModel):
        def predict(self, batch):
            if graphs.capturing:
                raise RuntimeError("CUDA error: operation not permitted when stream is capturing")
            return super().predict(batch)

    model = Syncs(gpu)
    runner = CudaGraphRunner(model, CUDA, max_batch_size=4)
    cfg = BatchingConfig(max_batch_size=4, cuda_graphs=True)
    [a] = run(model, 4, gpu, cfg, graphs_for=lambda cfg: runner)
    assert a.outcome == "ok" and not a.cuda_graph and len(runner.book.failures) == 1


def test_the_device_process_makes_cuda_n_its_current_device_before_loading(monkeypatch):
    """``cuda:1`` in the device process: ``torch.cuda.set_device`` before any model is
    made (else cuBLAS handles and streams land on device 0); cpu and bare cuda untouched."""
    import torch

    from runtime.device.process import current_device
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(str(d)))
    assert str(current_device("cuda:1")) == "cuda:1" and calls == ["cuda:1"]
    assert str(current_device("cpu")) == "cpu" and str(current_device("cuda")) == "cuda"
    assert calls == ["cuda:1"]
