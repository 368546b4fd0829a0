"""CUDA-graph capture and replay per padded batch size.

Small batches of a small model spend most of their time launching kernels; a CUDA
graph replays the whole forward pass with one launch. Graph shapes are fixed, so a
batch of ``n`` rows is padded up to the nearest capture size (``select_size``), the
graph for that size is captured the first time it is needed, and the outputs are
sliced back to ``n`` rows.

A graph's key is everything its replay depends on: the padded size, each tensor's
trailing shape and dtype, and the batch's non-tensor part (``static_key``: container
types, field names and plain values such as a flag or a scale, which a graph freezes
at capture). A batch holding a non-tensor value that cannot be keyed (unhashable, or
compared by identity only) runs eagerly, and so does a shape whose non-tensor part
has already been captured ``max_static_variants`` ways (a value that differs from
batch to batch, a list of lengths say, would otherwise capture every batch).

A variable-length model's batches are captured only when padded to a bucket edge
(``run(..., padded_length, bucket_edge)``): padding to the longest item makes every
length a key of its own and would fill the graph slots; other lengths run eagerly.

Graphs stay captured when ``max_batch_size`` changes (``resize``; the autopilot and
tuning change it often): only the capture sizes move, sizes not yet captured are
captured on first use, and at most ``max_graphs`` graphs are kept, the least recently
used evicted first (``GraphBook``).

A capture runs in "thread_local" capture mode, so work other threads run on the device
meanwhile (a generation model's decoder step, a device thread started after a
timeout) neither fails nor breaks the capture, and under ``DEVICE_LOCK``, the process's
one lock for work that must not overlap a capture: one capture at a time (torch's
captures share one capture stream), and code that must not run during one can take
it. A capture that cannot have the lock within ``capture_lock_wait_s`` (a capture
stuck in a batch past its timeout holds it) runs the batch eagerly and captures later.
Whatever happens, the thread's previous stream is current again after a capture.

Where capture fails (a model that synchronises, allocates on the host, branches on
data...) the runner remembers it and runs that shape eagerly from then on; after a
few distinct failures it stops trying altogether. Running out of memory during capture
is not such a failure: it propagates (``runtime.device.oom.is_oom``), so the batch is
booked as an OOM and split, and the shape is captured again later. On a CPU device the
runner is a pass-through. ``stats()`` counts captures, replays and eager runs by
reason. The bookkeeping (``select_size``, ``GraphBook``, ``flatten``, ``static_key``,
``pad_rows``, ``plan``) is pure and runs anywhere; only ``_capture``/``_replay`` touch
CUDA.

The engine calls, per batch::

    runner = graph_runner(runner, model, device, cfg.max_batch_size)   # executor.py
    batch = model.collate(items, pad_to)
    output, ran_as_graph = runner.run(batch, len(items), padded_length=pad_to,
                                      bucket_edge=bucket)
    results = model.split(output, len(items))
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Sequence

import torch

from runtime.api.model import ModelAPI
from runtime.device.oom import is_oom

log = logging.getLogger(__name__)

REPLAY, CAPTURE, EAGER = "replay", "capture", "eager"

#: held while a graph is captured; other device work that must not overlap a capture
#: takes it too (re-entrant: a capture may run code that takes it again)
DEVICE_LOCK = threading.RLock()
#: how long a capture waits for ``DEVICE_LOCK`` before running its batch eagerly, seconds
CAPTURE_LOCK_WAIT_S = 0.1
#: cudaStreamCaptureMode of every capture: only the capturing thread is restricted
CAPTURE_ERROR_MODE = "thread_local"

#: why a batch ran eagerly (``stats()["eager_by_reason"]``)
WHY_INACTIVE = "inactive"          # not a CUDA device
WHY_DISABLED = "disabled"          # capture given up after failures
WHY_TOO_LARGE = "too_large"        # more rows than the largest capture size
WHY_UNPADDABLE = "unpaddable"      # no tensor, or tensors without the batch's rows
WHY_UNBUCKETED = "unbucketed"      # variable length, not padded to a bucket edge
WHY_UNKEYABLE = "unkeyable"        # a non-tensor value that cannot be part of a key
WHY_FAILED = "capture_failed"      # this key's capture failed (now or before)
WHY_DEFERRED = "capture_deferred"  # DEVICE_LOCK busy: captured on a later batch
WHY_NO_SLOTS = "no_slots"          # max_graphs < 1
WHY_STATIC_VARIES = "static_varies"  # this shape's non-tensor part varies too much to capture


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
    """Which graph keys are captured (least recently used first), which failed, and
    whether to keep trying (pure). At most ``max_graphs`` stay captured: ``captured``
    evicts the least recently used beyond that and returns them."""

    max_graphs: int = 64
    max_failures: int = 3
    captured_keys: OrderedDict = field(default_factory=OrderedDict)
    failures: dict = field(default_factory=dict)
    disabled_reason: str | None = None
    evictions: int = 0

    def decide(self, key: Hashable) -> str:
        if key in self.captured_keys:
            return REPLAY
        if self.disabled_reason is not None or key in self.failures or self.max_graphs < 1:
            return EAGER
        return CAPTURE

    def used(self, key: Hashable) -> None:
        """``key``'s graph was replayed: it is the most recently used."""
        if key in self.captured_keys:
            self.captured_keys.move_to_end(key)

    def captured(self, key: Hashable) -> list:
        """Book ``key`` as captured; the keys evicted to make room (their graphs go)."""
        self.captured_keys[key] = None
        self.captured_keys.move_to_end(key)
        evicted = []
        while len(self.captured_keys) > max(self.max_graphs, 0):
            old, _ = self.captured_keys.popitem(last=False)
            evicted.append(old)
        self.evictions += len(evicted)
        return evicted

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


class _Unkeyable(Exception):
    pass


#: types compared by identity whose values are singletons (so identity is equality)
_SINGLETON_TYPES = (type(None), type(Ellipsis), enum.Enum, type, torch.dtype)


def _keyable(value: Any) -> bool:
    """Whether ``value`` can stand in a graph key: hashable, and compared by value
    (an object compared by identity would make every batch a new key)."""
    try:
        hash(value)
    except TypeError:
        return False
    return isinstance(value, _SINGLETON_TYPES) or type(value).__eq__ is not object.__eq__


def _static(value: Any) -> Hashable:
    if isinstance(value, torch.Tensor):
        return "<tensor>"        # its shape and dtype are ``shape_key``'s
    if isinstance(value, (tuple, list)):
        return (type(value).__qualname__, tuple(_static(v) for v in value))
    if isinstance(value, dict):
        for k in value:
            if not _keyable(k):
                raise _Unkeyable
        return ("dict", tuple((k, _static(v)) for k, v in value.items()))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__module__, type(value).__qualname__,
                tuple((f.name, _static(getattr(value, f.name))) for f in dataclasses.fields(value)))
    if not _keyable(value):
        raise _Unkeyable
    return (type(value).__qualname__, value)


def static_key(batch: Any) -> Hashable | None:
    """The non-tensor part of a batch (container types, field names, plain values), which
    a graph freezes at capture, as a hashable key; None when a value cannot be keyed."""
    try:
        return _static(batch)
    except _Unkeyable:
        return None


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
                 max_batch_size: int, max_graphs: int = 64, warmup_runs: int = 2,
                 capture_lock_wait_s: float = CAPTURE_LOCK_WAIT_S,
                 max_static_variants: int = 8) -> None:
        self.model = model
        self.device = torch.device(device)
        self._fixed_sizes = capture_sizes
        self.max_batch_size = max_batch_size
        self.sizes = tuple(sorted(set(capture_sizes or default_capture_sizes(max_batch_size))))
        if self.sizes[0] < 1:
            raise ValueError(f"capture sizes must be >= 1, got {self.sizes}")
        self.book = GraphBook(max_graphs=max_graphs)
        self.warmup_runs = warmup_runs
        self.capture_lock_wait_s = capture_lock_wait_s
        self.max_static_variants = max_static_variants
        #: (padded size, shape key) -> the non-tensor parts captured with it
        self._statics: dict[Hashable, set] = {}
        self.captures = 0
        self.replays = 0
        self.eager_runs = 0
        self.eager_by_reason: dict[str, int] = {}
        self._graphs: dict[Hashable, _Graph] = {}
        self._pool = None
        self._stream = None
        self.active = self.device.type == "cuda" and torch.cuda.is_available()
        if not self.active:
            self.book.disable(f"device {self.device} is not a CUDA device")

    def resize(self, max_batch_size: int) -> None:
        """Capture sizes for a new ``max_batch_size``; graphs already captured are kept
        (a size no longer listed is not chosen, and is evicted in its turn)."""
        if max_batch_size == self.max_batch_size:
            return
        self.max_batch_size = max_batch_size
        if self._fixed_sizes is None:
            self.sizes = default_capture_sizes(max_batch_size)

    def plan(self, batch: Any, n: int, padded_length: int | None = None,
             bucket_edge: int | None = None) -> tuple[str, Hashable | None, int]:
        """(decision, graph key, padded size) for a batch of ``n`` rows; pure bookkeeping."""
        return self._plan(batch, n, padded_length, bucket_edge)[:3]

    def _plan(self, batch: Any, n: int, padded_length: int | None,
              bucket_edge: int | None) -> tuple[str, Hashable | None, int, str | None]:
        """``plan`` and, for an eager decision, why."""
        if not self.active:
            return EAGER, None, n, WHY_INACTIVE
        if n > self.sizes[-1]:
            return EAGER, None, n, WHY_TOO_LARGE
        if padded_length is not None and padded_length != bucket_edge:
            return EAGER, None, n, WHY_UNBUCKETED
        leaves, _ = flatten(batch)
        sig = shape_key(leaves, n)
        if sig is None:
            return EAGER, None, n, WHY_UNPADDABLE
        static = static_key(batch)
        if static is None:
            return EAGER, None, n, WHY_UNKEYABLE
        size = select_size(n, self.sizes)
        key = (size, sig, static)
        decision = self.book.decide(key)
        why = None
        if decision == CAPTURE:
            seen = self._statics.get(key[:2], ())
            if static not in seen and len(seen) >= self.max_static_variants:
                return EAGER, None, n, WHY_STATIC_VARIES
        if decision == EAGER:
            why = (WHY_DISABLED if self.book.disabled_reason is not None
                   else WHY_FAILED if key in self.book.failures else WHY_NO_SLOTS)
        return decision, key, size, why

    def run(self, batch: Any, n: int, *, padded_length: int | None = None,
            bucket_edge: int | None = None) -> tuple[Any, bool]:
        """The model's output for the first ``n`` rows, and whether a graph produced it.

        ``padded_length``: the length a variable-length model's batch is padded to (None
        for a fixed-length model); such a batch is captured only when it equals
        ``bucket_edge``, the edge of the batch's length bucket (None: not bucketed).
        """
        with torch.inference_mode():  # statics made in a capture under it accept copies only under it
            return self._run(batch, n, padded_length, bucket_edge)

    def _run(self, batch: Any, n: int, padded_length: int | None,
             bucket_edge: int | None) -> tuple[Any, bool]:
        decision, key, size, why = self._plan(batch, n, padded_length, bucket_edge)
        if decision == REPLAY:
            self.book.used(key)
            return self._replay(self._graphs[key], batch, n), True
        if decision == CAPTURE:
            entry, why = self._capture_locked(key, batch, n, size)
            if entry is not None:
                return self._replay(entry, batch, n), True
        self.eager_runs += 1
        self.eager_by_reason[why] = self.eager_by_reason.get(why, 0) + 1
        return self.model.predict(batch), False

    def stats(self) -> dict[str, Any]:
        why = self.eager_by_reason
        return {"active": self.active, "sizes": list(self.sizes), "graphs": len(self._graphs),
                "replays": self.replays, "eager_runs": self.eager_runs,
                "failures": len(self.book.failures), "disabled_reason": self.book.disabled_reason,
                "captures": self.captures, "evictions": self.book.evictions,
                "max_graphs": self.book.max_graphs,
                "captured_sizes": sorted({key[0] for key in self._graphs}),
                "eager_unbucketed": why.get(WHY_UNBUCKETED, 0),
                "eager_unkeyable": why.get(WHY_UNKEYABLE, 0),
                "capture_deferred": why.get(WHY_DEFERRED, 0),
                "eager_static_varies": why.get(WHY_STATIC_VARIES, 0),
                "eager_by_reason": dict(why)}

    # -- CUDA only ------------------------------------------------------------------------
    def _capture_locked(self, key: Hashable, batch: Any, n: int,
                        size: int) -> tuple[_Graph | None, str | None]:
        """``_capture`` under ``DEVICE_LOCK``; (None, why) when there is no graph to run."""
        if not DEVICE_LOCK.acquire(timeout=self.capture_lock_wait_s):
            log.info("CUDA graph capture of model %s at batch size %d deferred: another "
                     "capture holds the device lock", self.model.name, size)
            return None, WHY_DEFERRED
        try:
            entry = self._capture(key, batch, n, size)
        finally:
            DEVICE_LOCK.release()
        return entry, (None if entry is not None else WHY_FAILED)

    def _capture(self, key: Hashable, batch: Any, n: int, size: int) -> _Graph | None:
        leaves, rebuild = flatten(batch)
        static_inputs = [pad_rows(t, size).clone() for t in leaves]
        static_batch = rebuild(static_inputs)
        previous = torch.cuda.current_stream(self.device)
        try:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            stream = self._stream
            stream.wait_stream(previous)
            with torch.cuda.stream(stream):  # warm-up errors are the model's own: let them propagate
                for _ in range(self.warmup_runs):
                    self.model.predict(static_batch)
            previous.wait_stream(stream)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._pool, capture_error_mode=CAPTURE_ERROR_MODE):
                    static_out = self.model.predict(static_batch)
            except Exception as exc:  # capture is not possible for this shape: remember, run eagerly
                if is_oom(exc):  # not the shape's fault: booked as an OOM, captured again later
                    raise
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                self.book.failed(key, reason)
                log.warning("CUDA graph capture of model %s at batch size %d failed (%s); running eagerly",
                            self.model.name, size, reason)
                try:
                    torch.cuda.synchronize(self.device)
                except Exception:
                    pass
                return None
        finally:
            # torch.cuda.graph restores the stream only after capture_end succeeded (and not
            # at all when capture_begin raised): make sure eager work leaves the capture stream
            if torch.cuda.current_stream(self.device) != previous:
                torch.cuda.set_stream(previous)
        out_leaves, rebuild_out = flatten(static_out)
        if not out_leaves:
            self.book.failed(key, f"predict returned {type(static_out).__name__}, not tensors")
            return None
        entry = _Graph(graph, static_inputs, out_leaves, rebuild_out)
        self._graphs[key] = entry
        self.captures += 1
        self._statics.setdefault(key[:2], set()).add(key[2])
        for old in self.book.captured(key):
            self._graphs.pop(old, None)
            log.info("evicted CUDA graph of model %s, batch size %d (max_graphs=%d)",
                     self.model.name, old[0], self.book.max_graphs)
        log.info("captured CUDA graph for model %s, batch size %d, key %s", self.model.name, size, key[1])
        return entry

    def _replay(self, entry: _Graph, batch: Any, n: int) -> Any:
        leaves, _ = flatten(batch)
        for static, t in zip(entry.inputs, leaves):
            static[:n].copy_(t, non_blocking=True)
        entry.graph.replay()
        self.replays += 1
        return entry.rebuild_output([t[:n].clone() for t in entry.output_leaves])
