"""CUDA-graph capture and replay per padded batch size.

Small batches of a small model spend most of their time launching kernels; a CUDA
graph replays the whole forward pass with one launch. Graph shapes are fixed, so a
batch of ``n`` rows is padded up to the nearest capture size (``select_size``), the
graph for that size (and, for variable-length models, that padded length) is captured
the first time it is needed, and the outputs are sliced back to ``n`` rows.

Where capture fails (a model that synchronises, allocates on the host, branches on
data...) the runner remembers it and runs that shape eagerly from then on; after a
few distinct failures it stops trying altogether. On a CPU device the runner is a
pass-through. The bookkeeping (``select_size``, ``GraphBook``, ``flatten``,
``pad_rows``) is pure and runs anywhere; only ``_capture``/``_replay`` touch CUDA.

The engine calls, per batch::

    runner = CudaGraphRunner(model, device, max_batch_size=cfg.max_batch_size)
    batch = model.collate(items, pad_to)
    output, ran_as_graph = runner.run(batch, len(items))
    results = model.split(output, len(items))
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

from runtime.api.model import ModelAPI

log = logging.getLogger(__name__)

REPLAY, CAPTURE, EAGER = "replay", "capture", "eager"


def default_capture_sizes(max_batch_size: int) -> tuple[int, ...]:
    """Powers of two below ``max_batch_size``, then ``max_batch_size`` itself."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    sizes, s = [], 1
    while s < max_batch_size:
        sizes.append(s)
        s *= 2
    sizes.append(max_batch_size)
    return tuple(sizes)


def select_size(n: int, sizes: Sequence[int]) -> int:
    """The smallest capture size that holds ``n`` rows.

    Raises ValueError when ``n`` < 1 or larger than every size (run such a batch eagerly).
    """
    if n < 1:
        raise ValueError(f"a batch needs at least one row, got {n}")
    best = None
    for s in sizes:
        if s >= n and (best is None or s < best):
            best = s
    if best is None:
        raise ValueError(f"batch of {n} rows is larger than every capture size {sorted(sizes)}")
    return best


@dataclass
class GraphBook:
    """Which graph keys are captured, which failed, and whether to keep trying (pure)."""

    max_graphs: int = 64
    max_failures: int = 3
    captured_keys: set = field(default_factory=set)
    failures: dict = field(default_factory=dict)
    disabled_reason: str | None = None

    def decide(self, key: Hashable) -> str:
        if key in self.captured_keys:
            return REPLAY
        if self.disabled_reason is not None or key in self.failures:
            return EAGER
        if len(self.captured_keys) >= self.max_graphs:
            return EAGER
        return CAPTURE

    def captured(self, key: Hashable) -> None:
        self.captured_keys.add(key)

    def failed(self, key: Hashable, reason: str) -> None:
        self.failures[key] = reason
        if len(self.failures) >= self.max_failures and self.disabled_reason is None:
            self.disabled_reason = (f"capture failed for {len(self.failures)} shapes; "
                                    f"last error: {reason}")

    def disable(self, reason: str) -> None:
        self.disabled_reason = reason


def flatten(batch: Any) -> tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], Any]]:
    """Tensor leaves of a tensor / tuple / list / dict / dataclass, and a function that
    rebuilds the same structure from replacement leaves. Non-tensor values are kept."""
    if isinstance(batch, torch.Tensor):
        return [batch], lambda leaves: leaves[0]
    if isinstance(batch, (tuple, list)):
        return _flatten_items(list(enumerate(batch)), lambda pairs: type(batch)(v for _, v in pairs))
    if isinstance(batch, dict):
        return _flatten_items(list(batch.items()), lambda pairs: dict(pairs))
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        pairs = [(f.name, getattr(batch, f.name)) for f in dataclasses.fields(batch)]
        return _flatten_items(pairs, lambda new: dataclasses.replace(batch, **dict(new)))
    return [], lambda leaves: batch


def _flatten_items(pairs: list[tuple[Any, Any]], build: Callable[[list], Any]):
    leaves: list[torch.Tensor] = []
    parts = []
    for key, value in pairs:
        sub_leaves, sub_build = flatten(value)
        parts.append((key, len(sub_leaves), sub_build))
        leaves.extend(sub_leaves)

    def rebuild(new_leaves: list[torch.Tensor]) -> Any:
        out, i = [], 0
        for key, count, sub_build in parts:
            out.append((key, sub_build(new_leaves[i:i + count])))
            i += count
        return build(out)

    return leaves, rebuild


def shape_key(leaves: Sequence[torch.Tensor], n: int) -> tuple | None:
    """What besides the batch size fixes a graph: each leaf's trailing shape and dtype.
    None when the leaves do not all have ``n`` rows (such a batch cannot be padded)."""
    if not leaves or any(t.dim() == 0 or t.shape[0] != n for t in leaves):
        return None
    return tuple((tuple(t.shape[1:]), str(t.dtype)) for t in leaves)


def pad_rows(t: torch.Tensor, size: int) -> torch.Tensor:
    """``t`` with rows appended (copies of row 0, always valid input) up to ``size`` rows."""
    n = t.shape[0]
    if n >= size:
        return t
    return torch.cat([t, t[:1].expand(size - n, *t.shape[1:])], dim=0)


@dataclass
class _Graph:
    graph: Any
    inputs: list[torch.Tensor]
    output_leaves: list[torch.Tensor]
    rebuild_output: Callable[[list[torch.Tensor]], Any]


class CudaGraphRunner:
    """Runs ``model.predict`` through captured CUDA graphs where it can (see module docstring)."""

    def __init__(self, model: ModelAPI, device: Any, *, capture_sizes: tuple[int, ...] | None = None,
                 max_batch_size: int, max_graphs: int = 64, warmup_runs: int = 2) -> None:
        self.model = model
        self.device = torch.device(device)
        self.sizes = tuple(sorted(set(capture_sizes or default_capture_sizes(max_batch_size))))
        if self.sizes[0] < 1:
            raise ValueError(f"capture sizes must be >= 1, got {self.sizes}")
        self.book = GraphBook(max_graphs=max_graphs)
        self.warmup_runs = warmup_runs
        self.replays = 0
        self.eager_runs = 0
        self._graphs: dict[Hashable, _Graph] = {}
        self._pool = None
        self.active = self.device.type == "cuda" and torch.cuda.is_available()
        if not self.active:
            self.book.disable(f"device {self.device} is not a CUDA device")

    def plan(self, batch: Any, n: int) -> tuple[str, Hashable | None, int]:
        """(decision, graph key, padded size) for a batch of ``n`` rows; pure bookkeeping."""
        if not self.active or n > self.sizes[-1]:
            return EAGER, None, n
        leaves, _ = flatten(batch)
        sig = shape_key(leaves, n)
        if sig is None:
            return EAGER, None, n
        size = select_size(n, self.sizes)
        key = (size, sig)
        return self.book.decide(key), key, size

    def run(self, batch: Any, n: int) -> tuple[Any, bool]:
        """The model's output for the first ``n`` rows, and whether a graph produced it."""
        decision, key, size = self.plan(batch, n)
        if decision == REPLAY:
            return self._replay(self._graphs[key], batch, n), True
        if decision == CAPTURE:
            entry = self._capture(key, batch, n, size)
            if entry is not None:
                return self._replay(entry, batch, n), True
        self.eager_runs += 1
        return self.model.predict(batch), False

    def stats(self) -> dict[str, Any]:
        return {"active": self.active, "sizes": list(self.sizes), "graphs": len(self._graphs),
                "replays": self.replays, "eager_runs": self.eager_runs,
                "failures": len(self.book.failures), "disabled_reason": self.book.disabled_reason}

    # -- CUDA only ------------------------------------------------------------------------
    def _capture(self, key: Hashable, batch: Any, n: int, size: int) -> _Graph | None:
        leaves, rebuild = flatten(batch)
        static_inputs = [pad_rows(t, size).clone() for t in leaves]
        static_batch = rebuild(static_inputs)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):  # warm-up errors are the model's own: let them propagate
            for _ in range(self.warmup_runs):
                self.model.predict(static_batch)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self._pool):
                static_out = self.model.predict(static_batch)
        except Exception as exc:  # capture is not possible for this shape: remember, run eagerly
            reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            self.book.failed(key, reason)
            log.warning("CUDA graph capture of model %s at batch size %d failed (%s); running eagerly",
                        self.model.name, size, reason)
            try:
                torch.cuda.synchronize(self.device)
            except Exception:
                pass
            return None
        out_leaves, rebuild_out = flatten(static_out)
        if not out_leaves:
            self.book.failed(key, f"predict returned {type(static_out).__name__}, not tensors")
            return None
        entry = _Graph(graph, static_inputs, out_leaves, rebuild_out)
        self._graphs[key] = entry
        self.book.captured(key)
        log.info("captured CUDA graph for model %s, batch size %d, key %s", self.model.name, size, key[1])
        return entry

    def _replay(self, entry: _Graph, batch: Any, n: int) -> Any:
        leaves, _ = flatten(batch)
        for static, t in zip(entry.inputs, leaves):
            static[:n].copy_(t, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return entry.rebuild_output([t[:n].clone() for t in entry.output_leaves])
