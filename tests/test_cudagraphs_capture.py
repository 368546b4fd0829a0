"""CUDA-graph capture and replay on a machine without a GPU: ``FakeCuda`` stands in for
the part of ``torch.cuda`` the runner uses (streams, ``CUDAGraph``, ``graph``) and
keeps CUDA's capture rules that matter here: a capture in "global" mode forbids
synchronising calls from every thread, "thread_local" only from the capturing one; a
stream can hold one capture at a time; ``torch.cuda.graph`` leaves the thread on the
capture stream when ending the capture raises. Kernels a model launches while a graph
captures are recorded instead of run, and run again on ``replay``, so a replayed output
is what the graph computes from its static inputs (and the values frozen at capture).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
import torch

from runtime.api.config import BatchingConfig
from runtime.api.model import ModelAPI
from runtime.device import cudagraphs, executor
from runtime.device.cudagraphs import CAPTURE, EAGER, REPLAY, CudaGraphRunner, GraphBook
from runtime.models.toys import VarLenModel

CUDA = torch.device("cuda:0")
NOT_PERMITTED = "CUDA error: operation not permitted when stream is capturing"


class FakeStream:
    def __init__(self, name: str) -> None:
        self.name = name

    def wait_stream(self, other: "FakeStream") -> None:
        pass

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeGraph:
    """``torch.cuda.CUDAGraph``: the kernels launched while it captured, run on replay."""

    def __init__(self, cuda: "FakeCuda") -> None:
        self.cuda = cuda
        self.kernels: list = []
        self.mode: str | None = None
        self.stream: FakeStream | None = None
        self.invalidated = False
        self.replays = 0

    def capture_begin(self, pool=None, capture_error_mode: str = "global") -> None:
        cuda, stream = self.cuda, self.cuda.current_stream()
        if cuda.fail_begin:
            raise RuntimeError("CUDA error: capture_begin failed")
        if any(g.stream is stream for g in cuda.captures.values()):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing "
                               "(the stream already holds a capture)")
        self.mode, self.stream = capture_error_mode, stream
        cuda.captures[threading.get_ident()] = self
        cuda.modes.append(capture_error_mode)

    def capture_end(self) -> None:
        del self.cuda.captures[threading.get_ident()]
        if self.invalidated:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    def replay(self) -> None:
        self.replays += 1
        for kernel in self.kernels:
            kernel()


class FakeGraphContext:
    """``torch.cuda.graph`` as torch 2.x writes it: ``__exit__`` ends the capture, then
    restores the stream, so a failing ``capture_end`` leaves the capture stream current."""

    def __init__(self, cuda: "FakeCuda", graph: FakeGraph, pool=None, stream=None,
                 capture_error_mode: str = "global") -> None:
        self.cuda, self.graph, self.pool, self.mode = cuda, graph, pool, capture_error_mode
        self.stream_ctx = cuda.stream(stream or cuda.capture_stream)

    def __enter__(self) -> None:
        self.stream_ctx.__enter__()
        self.graph.capture_begin(self.pool, capture_error_mode=self.mode)

    def __exit__(self, *exc: Any) -> None:
        self.graph.capture_end()
        self.stream_ctx.__exit__(*exc)


class _StreamContext:
    def __init__(self, cuda: "FakeCuda", stream: FakeStream) -> None:
        self.cuda, self.stream, self.previous = cuda, stream, None

    def __enter__(self) -> None:
        self.previous = self.cuda.current_stream()
        self.cuda.set_stream(self.stream)

    def __exit__(self, *exc: Any) -> None:
        self.cuda.set_stream(self.previous)


class FakeCuda:
    def __init__(self) -> None:
        self.default = FakeStream("default")
        self.capture_stream = FakeStream("capture")   # torch.cuda.graph's shared default
        self._current: dict[int, FakeStream] = {}
        #: thread id -> the graph it is capturing
        self.captures: dict[int, FakeGraph] = {}
        #: capture_error_mode of every capture begun
        self.modes: list[str] = []
        self.fail_begin = False
        self.graphs: list[FakeGraph] = []

    # torch.cuda
    def current_stream(self, device=None) -> FakeStream:
        return self._current.get(threading.get_ident(), self.default)

    def set_stream(self, stream: FakeStream) -> None:
        self._current[threading.get_ident()] = stream

    def stream(self, stream: FakeStream) -> _StreamContext:
        return _StreamContext(self, stream)

    def Stream(self, device=None) -> FakeStream:  # noqa: N802 - torch's name
        return FakeStream("side")

    def CUDAGraph(self) -> FakeGraph:  # noqa: N802 - torch's name
        graph = FakeGraph(self)
        self.graphs.append(graph)
        return graph

    def graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global"):
        return FakeGraphContext(self, cuda_graph, pool, stream, capture_error_mode)

    def install(self, monkeypatch) -> "FakeCuda":
        cuda = torch.cuda
        monkeypatch.setattr(cuda, "is_available", lambda: True)
        monkeypatch.setattr(cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(cuda, "current_stream", self.current_stream)
        monkeypatch.setattr(cuda, "set_stream", self.set_stream)
        monkeypatch.setattr(cuda, "stream", self.stream)
        monkeypatch.setattr(cuda, "Stream", self.Stream)
        monkeypatch.setattr(cuda, "CUDAGraph", self.CUDAGraph)
        monkeypatch.setattr(cuda, "graph", self.graph)
        monkeypatch.setattr(cuda, "graph_pool_handle", lambda: object())
        # the allocator's figures, for run_batch on a CUDA device
        monkeypatch.setattr(cuda, "reset_peak_memory_stats", lambda device=None: None)
        monkeypatch.setattr(cuda, "memory_allocated", lambda device=None: 0)
        monkeypatch.setattr(cuda, "max_memory_allocated", lambda device=None: 0)
        return self

    # what a model's forward does on the device
    def launch(self, kernel) -> None:
        """A kernel: recorded by the graph this thread captures, else run now."""
        graph = self.captures.get(threading.get_ident())
        if graph is not None:
            graph.kernels.append(kernel)
        else:
            kernel()

    def host_sync(self) -> None:
        """A call that waits for the device (``.item()``, ``.cpu()``): refused in a
        capturing thread, and in any thread while a "global" capture is underway (the
        capture is invalidated either way)."""
        me = threading.get_ident()
        for tid, graph in list(self.captures.items()):
            if tid == me or graph.mode == "global":
                graph.invalidated = True
                raise RuntimeError(NOT_PERMITTED)


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    return FakeCuda().install(monkeypatch)


class Scale(ModelAPI):
    """``x * factor`` for a batch ``{"x": rows, "factor": a non-tensor value}``; every
    ``predict`` notes the stream it ran on. ``sync``: the forward waits for the device."""

    name = "scale"

    def __init__(self, cuda: FakeCuda, *, sync: bool = False, name: str = "scale") -> None:
        self.cuda = cuda
        self.sync = sync
        self.name = name
        self.streams: list[FakeStream] = []
        #: called (with the batch) at the start of every forward, when set
        self.hook = None

    def predict(self, batch: dict) -> torch.Tensor:
        self.streams.append(self.cuda.current_stream())
        if self.hook is not None:
            self.hook(batch)
        if self.sync:
            self.cuda.host_sync()
        x, factor = batch["x"], batch["factor"]
        out = torch.empty_like(x)
        self.cuda.launch(lambda: out.copy_(x * float(factor)))
        return out


def rows(n: int, start: float = 0.0) -> torch.Tensor:
    return torch.arange(start, start + 4 * n, dtype=torch.float32).reshape(n, 4)


def runner_for(model: ModelAPI, max_batch_size: int = 8, **kw: Any) -> CudaGraphRunner:
    runner = CudaGraphRunner(model, CUDA, max_batch_size=max_batch_size, **kw)
    assert runner.active
    return runner


def test_fake_replays_what_it_captured(cuda):
    runner = runner_for(Scale(cuda))
    out, as_graph = runner.run({"x": rows(3), "factor": 2.0}, 3)
    assert as_graph and torch.equal(out, rows(3) * 2)
    out, as_graph = runner.run({"x": rows(4, 100.0), "factor": 2.0}, 4)
    assert as_graph and torch.equal(out, rows(4, 100.0) * 2)
    stats = runner.stats()
    assert (stats["graphs"], stats["captures"], stats["replays"], stats["eager_runs"]) == (1, 1, 2, 0)


def test_a_graph_captured_under_inference_mode_replays_outside_it(cuda):
    """``run_batch`` captures under ``torch.inference_mode()``, so the static inputs are
    inference tensors; a caller outside inference mode (a benchmark, a user's loop) must
    still be able to replay (torch refuses in-place copies into them outside it)."""
    runner = runner_for(Scale(cuda))
    with torch.inference_mode():
        assert runner.run({"x": rows(2), "factor": 3.0}, 2)[1] is True
    out, as_graph = runner.run({"x": rows(2, 50.0), "factor": 3.0}, 2)
    assert as_graph and torch.equal(out, rows(2, 50.0) * 3)


# -- 3: capture while another thread works on the device ------------------------------------
def test_capture_is_thread_local_so_another_threads_work_goes_on(cuda):
    """A decoder step (it reads its sampled tokens back: a sync) on another thread,
    while the device thread captures: neither fails."""
    model = Scale(cuda)
    in_capture, stepped = threading.Event(), threading.Event()
    decoder: list[str] = []

    def step() -> None:
        in_capture.wait(5)
        try:
            cuda.host_sync()
            decoder.append("ok")
        except RuntimeError as exc:
            decoder.append(str(exc))
        stepped.set()

    def hook(batch) -> None:
        if threading.get_ident() in cuda.captures:
            in_capture.set()
            stepped.wait(5)

    model.hook = hook
    thread = threading.Thread(target=step)
    thread.start()
    runner = runner_for(model)
    out, as_graph = runner.run({"x": rows(2), "factor": 3.0}, 2)
    thread.join(5)
    assert decoder == ["ok"]
    assert as_graph and torch.equal(out, rows(2) * 3) and runner.book.failures == {}
    assert cuda.modes == ["thread_local"]


def test_capture_holds_the_device_lock(cuda):
    model = Scale(cuda)
    seen: list[bool] = []

    def hook(batch) -> None:
        if threading.get_ident() in cuda.captures:
            other = threading.Thread(
                target=lambda: seen.append(cudagraphs.DEVICE_LOCK.acquire(blocking=False)))
            other.start()
            other.join(5)

    model.hook = hook
    runner_for(model).run({"x": rows(2), "factor": 1.0}, 2)
    assert seen == [False]                      # another thread could not take it
    assert cudagraphs.DEVICE_LOCK.acquire(blocking=False)   # and it is free again
    cudagraphs.DEVICE_LOCK.release()


def test_a_replacement_worker_does_not_wait_on_a_stuck_capture(cuda):
    """The old device thread hangs inside a capture (past its timeout); the new worker
    runs another model: it runs eagerly instead of capturing alongside (one capture at a
    time: they would share torch's capture stream) and captures once the lock is free."""
    stuck_model, other_model = Scale(cuda, name="stuck"), Scale(cuda, name="other")
    entered, release = threading.Event(), threading.Event()

    def hang(batch) -> None:
        if threading.get_ident() in cuda.captures:
            entered.set()
            release.wait(10)

    stuck_model.hook = hang
    stuck = runner_for(stuck_model)
    old = threading.Thread(target=stuck.run, args=({"x": rows(2), "factor": 1.0}, 2))
    old.start()
    assert entered.wait(5)
    runner = runner_for(other_model, capture_lock_wait_s=0.01)
    try:
        out, as_graph = runner.run({"x": rows(2), "factor": 5.0}, 2)
        assert not as_graph and torch.equal(out, rows(2) * 5)
        assert runner.book.failures == {} and runner.stats()["capture_deferred"] == 1
    finally:
        release.set()
        old.join(5)
    out, as_graph = runner.run({"x": rows(2), "factor": 5.0}, 2)
    assert as_graph and torch.equal(out, rows(2) * 5) and runner.stats()["captures"] == 1


# -- 4: a failed capture restores the stream -------------------------------------------------
@pytest.mark.parametrize("where", ["end", "begin"])
def test_a_failed_capture_leaves_the_thread_on_its_own_stream(cuda, where):
    if where == "begin":
        cuda.fail_begin = True
        model = Scale(cuda)
    else:
        model = Scale(cuda, sync=True)          # a sync in the forward: capture_end raises
    runner = runner_for(model)
    out, as_graph = runner.run({"x": rows(2), "factor": 2.0}, 2)
    assert not as_graph and torch.equal(out, rows(2) * 2) and len(runner.book.failures) == 1
    assert cuda.current_stream() is cuda.default
    assert model.streams[-1] is cuda.default     # the eager fallback ran on the default stream
    cuda.fail_begin = False
    other = runner_for(Scale(cuda, name="other"))
    out, as_graph = other.run({"x": rows(2), "factor": 4.0}, 2)
    assert as_graph and torch.equal(out, rows(2) * 4)
    assert cuda.current_stream() is cuda.default


# -- 5: a max_batch_size change keeps the graphs ---------------------------------------------
def test_graph_book_evicts_the_least_recently_used():
    book = GraphBook(max_graphs=2)
    assert book.captured("a") == [] and book.captured("b") == []
    book.used("a")
    assert book.captured("c") == ["b"]
    assert book.decide("b") == CAPTURE and book.decide("a") == REPLAY and book.decide("c") == REPLAY
    assert book.evictions == 1
    assert GraphBook(max_graphs=0).decide("a") == EAGER


def test_a_new_max_batch_size_keeps_the_captured_graphs(cuda):
    model = Scale(cuda)
    runner = executor.graph_runner(None, model, CUDA, 8)
    assert runner.run({"x": rows(8), "factor": 1.0}, 8)[1]
    again = executor.graph_runner(runner, model, CUDA, 16)     # the autopilot raised it
    assert again is runner and runner.sizes == (1, 2, 4, 8, 16)
    out, as_graph = runner.run({"x": rows(7, 50.0), "factor": 1.0}, 7)
    assert as_graph and torch.equal(out, rows(7, 50.0)) and runner.stats()["captures"] == 1
    assert runner.run({"x": rows(12), "factor": 1.0}, 12)[1]    # 16: captured on first use
    executor.graph_runner(runner, model, CUDA, 4)                # lowered: 8 rows run eagerly
    assert runner.run({"x": rows(8), "factor": 1.0}, 8)[1] is False
    executor.graph_runner(runner, model, CUDA, 16)
    assert runner.run({"x": rows(8), "factor": 1.0}, 8)[1]
    stats = runner.stats()
    assert stats["captures"] == 2 and stats["captured_sizes"] == [8, 16]
    assert executor.graph_runner(runner, Scale(cuda), CUDA, 16) is not runner   # another model


def test_the_runner_bounds_its_graphs(cuda):
    runner = runner_for(Scale(cuda), max_graphs=2)
    for n in (1, 2, 1, 4):           # 1 is used again before 4 arrives: 2 is evicted
        assert runner.run({"x": rows(n), "factor": 1.0}, n)[1]
    stats = runner.stats()
    assert stats["graphs"] == 2 and stats["evictions"] == 1 and stats["captured_sizes"] == [1, 4]
    assert runner.plan({"x": rows(2), "factor": 1.0}, 2)[0] == CAPTURE


# -- 6: variable-length models capture at bucket edges only ----------------------------------
def test_only_bucket_edge_lengths_are_captured(cuda):
    runner = runner_for(Scale(cuda))
    batch = {"x": rows(2), "factor": 1.0}
    assert runner.run(batch, 2, padded_length=13, bucket_edge=16)[1] is False
    assert runner.run(batch, 2, padded_length=13, bucket_edge=None)[1] is False
    assert runner.run(batch, 2, padded_length=16, bucket_edge=16)[1] is True
    assert runner.run(batch, 2)[1] is True                       # a fixed-length model
    stats = runner.stats()
    assert stats["eager_unbucketed"] == 2 and stats["eager_runs"] == 2
    assert stats["captures"] == 1 and stats["replays"] == 2
    assert {"active", "sizes", "graphs", "replays", "eager_runs", "failures",
            "disabled_reason"} <= set(stats)                      # the keys it always had


class Clock:
    def now(self) -> float:
        return 0.0


def test_run_batch_hands_the_padded_length_and_bucket_to_the_runner(cuda):
    model = VarLenModel()
    runner = runner_for(model, max_batch_size=4)
    cfg = BatchingConfig(max_batch_size=4, cuda_graphs=True)
    items = [np.ones(3, np.float32), np.ones(5, np.float32)]

    def run(pad: int, bucket: int | None):
        [a] = executor.run_batch(model, items, [3, 5], pad, bucket, cfg, True, CUDA, Clock(),
                                 lambda cfg: runner)
        assert a.outcome == "ok", a.error
        return a.cuda_graph

    assert run(5, 8) is False and run(5, None) is False and run(5, -1) is False
    assert run(8, 8) is True and run(8, 8) is True
    stats = runner.stats()
    assert (stats["eager_unbucketed"], stats["captures"], stats["replays"]) == (3, 1, 2)


# -- 7: non-tensor fields are part of the key -----------------------------------------------
def test_a_non_tensor_value_is_part_of_the_key(cuda):
    runner = runner_for(Scale(cuda))
    assert torch.equal(runner.run({"x": rows(2), "factor": 2.0}, 2)[0], rows(2) * 2)
    out, as_graph = runner.run({"x": rows(2), "factor": 3.0}, 2)
    assert torch.equal(out, rows(2) * 3)            # not the 2.0 frozen in the first graph
    assert runner.stats()["captures"] == 2
    out, as_graph = runner.run({"x": rows(2, 9.0), "factor": 2.0}, 2)
    assert as_graph and torch.equal(out, rows(2, 9.0) * 2) and runner.stats()["captures"] == 2


def test_a_batch_with_an_unhashable_non_tensor_value_runs_eagerly(cuda):
    runner = runner_for(Scale(cuda))
    for factor in (2.0, 3.0):
        out, as_graph = runner.run({"x": rows(2), "factor": np.array(factor)}, 2)
        assert not as_graph and torch.equal(out, rows(2) * factor)
    stats = runner.stats()
    assert stats["eager_unkeyable"] == 2 and stats["captures"] == 0 and runner.book.failures == {}


def test_static_key():
    static_key = cudagraphs.static_key
    a = torch.zeros(2, 3)
    assert static_key({"x": a, "f": 2.0}) != static_key({"x": a, "f": 3.0})
    assert static_key({"x": a, "f": 2.0}) == static_key({"x": torch.ones(2, 3), "f": 2.0})
    assert static_key((a, None, torch.float16, "mean")) is not None
    assert static_key({"x": a, "f": np.array(1.0)}) is None       # unhashable
    assert static_key({"x": a, "f": object()}) is None            # compared by identity only
    assert static_key({"x": a}) != static_key([a]) != static_key((a,))


def test_a_non_tensor_value_that_varies_per_batch_stops_capturing_its_shape(cuda):
    runner = runner_for(Scale(cuda), max_static_variants=2)
    for factor in (1.0, 2.0, 3.0, 4.0, 1.0):
        out, as_graph = runner.run({"x": rows(2), "factor": factor}, 2)
        assert torch.equal(out, rows(2) * factor) and as_graph == (factor in (1.0, 2.0))
    stats = runner.stats()
    assert stats["captures"] == 2 and stats["eager_static_varies"] == 2
    assert runner.run({"x": rows(4), "factor": 3.0}, 4)[1]      # another shape: its own count
