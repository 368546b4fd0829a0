"""Running one batch on the device, wherever that happens.

``run_batch`` is the whole execution of a batch: memory-budget check, ``collate``,
``predict`` (through the CUDA-graph runner when ``cuda_graphs`` is on), ``split``,
out-of-memory detection with split-and-retry and the isolation of requests the model
fails on (both ``runtime.device.oom.run_splitting``) and peak memory (the device's
absolute peak and the batch's own increase over what it found allocated). The engine's
device thread calls it in the serving process; the device process
(``runtime.device.process``) calls it in its child. Either way the engine
books the returned ``Attempt`` list the same way.

On CUDA, kernels run after the call that launched them has returned, so the device is
synchronised after ``collate``, after ``predict`` and after ``split``, before each clock
read: ``input_s``, the predict time and ``output_s`` (Triton's compute_input,
compute_infer and compute_output) are each phase's own GPU time, not the time its
kernels took to launch. On CPU nothing is added.

``pack_items``/``unpack_items`` and ``pack_outputs``/``unpack_outputs`` carry a
batch's items and results between processes as a few large numpy arrays instead of
many small objects (one stacked or concatenated array per batch), falling back to
plain pickling for anything else.
"""

from __future__ import annotations

import traceback
from contextlib import nullcontext
from typing import Any, Callable, Sequence

import numpy as np
import torch

from runtime.device import memory as devicemem
from runtime.device import nvtx
from runtime.api.config import BatchingConfig
from runtime.core.batcher import pad_length
from runtime.api.errors import ModelError
from runtime.api.model import ModelAPI
from runtime.device.compiled import compiled_frames, compiled_predict
from runtime.device.oom import Attempt, check_budget, is_oom, run_splitting

#: longest model error text sent to a client
MAX_ERROR_CHARS = 200

GraphRunnerFor = Callable[[BatchingConfig], Any]


def graph_runner(current: Any, model: ModelAPI, device: torch.device, max_batch_size: int) -> Any:
    """``current`` when it was made for ``model`` (resized to ``max_batch_size``: the
    graphs it captured are kept), else a new CUDA-graph runner."""
    if current is not None and current.model is model:
        current.resize(max_batch_size)
        return current
    from runtime.device.cudagraphs import CudaGraphRunner  # CUDA only: import on use

    return CudaGraphRunner(model, device, max_batch_size=max_batch_size)


def run_batch(model: ModelAPI, items: list, lengths: Sequence[int] | None, pad_to: int | None,
              bucket: int | None, cfg: BatchingConfig, variable: bool, device: torch.device,
              clock: Any, graphs_for: GraphRunnerFor | None = None, *,
              seq: int | None = None, name: str = "", adapters: Any = None) -> list[Attempt]:
    """Run ``items`` as one batch (split in halves on out-of-memory when
    ``cfg.oom_recovery``, and on a model error when ``cfg.isolate_errors``, so that
    only the requests that fail alone fail); every attempt in the order it ran. ``lengths`` are the
    items' lengths (only read for a variable-length model's sub-batches);
    ``graphs_for(cfg)`` gives the CUDA-graph runner when ``cfg.cuda_graphs`` is on;
    ``seq`` and ``name``: the batch id and model an NVTX range names (``--nvtx``);
    ``adapters``: the rows' LoRA slots (``runtime.adapters.slots.AdapterPlan``), put in
    the model's ``adapter_bank`` before the forward pass."""
    whole = len(items)
    on_cuda = device.type == "cuda"
    compiled = compiled_predict(model, cfg.compile, clock)
    graphs = graphs_for(cfg) if on_cuda and cfg.cuda_graphs and compiled is None \
        and graphs_for is not None and adapters is None else None
    #: the warm-up's seconds and error go on the first attempt only
    pending = [compiled.warm_up_s if compiled else 0.0, compiled.error if compiled else None]

    def attempt(lo: int, hi: int) -> Attempt:
        n = hi - lo
        part = items if n == whole else items[lo:hi]
        if n == whole or not variable:
            pad = pad_to
        else:
            pad = pad_length(list(lengths[lo:hi]), bucket, cfg, variable)
        base = devicemem.reset_peak(device) if on_cuda else None
        started = clock.now()
        used_graph = False
        try:
            check_budget(model, n, pad, cfg.memory_budget_mb)
            if adapters is not None:
                bank = model.adapter_bank
                if bank is None:
                    raise ModelError(f"model {name!r} made no adapter_bank in setup")
                bank.prepare(adapters.slots)
                rows = adapters.rows if n == whole else adapters.rows[lo:hi]
            with torch.inference_mode(), (bank.activate(rows) if adapters is not None
                                          else nullcontext()):
                inputs = model.collate(part, pad)
                if on_cuda:  # kernels run after their launch returns: wait for them
                    torch.cuda.synchronize(device)
                collated = clock.now()
                frames = compiled_frames() if compiled is not None else 0
                if compiled is not None:
                    output = compiled.predict(inputs)
                elif graphs is None:
                    output = model.predict(inputs)
                else:
                    output, used_graph = graphs.run(inputs, n, padded_length=pad,
                                                    bucket_edge=bucket)
                if on_cuda:
                    torch.cuda.synchronize(device)
                predicted = clock.now()
                compile_s, pending[0] = pending[0], 0.0
                if compiled is not None and compiled_frames() != frames:
                    compile_s += predicted - collated
                outputs = model.split(output, n)
                del inputs, output
                if on_cuda:  # split may leave copies to the host in flight
                    torch.cuda.synchronize(device)
            if outputs is None or len(outputs) != n:
                got = "None" if outputs is None else len(outputs)
                raise ModelError(f"split returned {got} outputs for a batch of {n}; it must "
                                 "return exactly one dict per request")
        except Exception as exc:  # noqa: BLE001 - the model is user code
            ended = clock.now()
            text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if is_oom(exc):
                memory = devicemem.figures(device)
                summary = devicemem.allocator_summary(device)
                if summary:
                    memory["allocator_summary"] = summary
                peak = devicemem.peak_bytes(device)
                return Attempt(lo, hi, "oom", started, ended, ended - started,
                               error=text[:MAX_ERROR_CHARS], memory=memory, peak_memory_bytes=peak,
                               peak_memory_increase_bytes=devicemem.peak_increase(peak, base))
            return Attempt(lo, hi, "error", started, ended, ended - started,
                           error=text[:MAX_ERROR_CHARS], trace=traceback.format_exc())
        ended = clock.now()
        if on_cuda:
            peak = devicemem.peak_bytes(device)
            increase = devicemem.peak_increase(peak, base)
        else:
            peak = increase = None
        error, pending[1] = pending[1], None
        return Attempt(lo, hi, "ok", started, ended, ended - started, outputs=outputs,
                       peak_memory_bytes=peak, peak_memory_increase_bytes=increase,
                       cuda_graph=used_graph, input_s=collated - started,
                       output_s=ended - predicted, compile_s=compile_s, compile_error=error)

    with nvtx.batch_range(seq, name, whole):
        return run_splitting(whole, attempt, recover=cfg.oom_recovery,
                             free=lambda: devicemem.free_cached(device),
                             isolate=cfg.isolate_errors)


# -- moving a batch between processes ---------------------------------------------------
def batch_attempts(model: Any, batch: Any, device: torch.device, clock: Any,
                   graphs_for: GraphRunnerFor | None = None) -> list[Attempt]:
    """``run_batch`` of a dispatched batch (``runtime.core.batcher.Batch``) of a served
    model (``api``, ``name``, ``variable``), on whichever thread calls it; never raises:
    anything escaping is one ``error`` attempt for the whole batch."""
    reqs = batch.requests
    try:
        return run_batch(model.api, [r.item for r in reqs],
                         [r.length for r in reqs] if model.variable else None, batch.pad_to,
                         batch.bucket, batch.config, model.variable, device, clock, graphs_for,
                         seq=batch.seq, name=model.name, adapters=batch.adapters)
    except BaseException as exc:  # noqa: BLE001 - every request must still get an answer
        now = clock.now()
        return [Attempt(0, len(reqs), "error", now, now, 0.0,
                        error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc())]


def _as_arrays(items: list) -> tuple[str, list[np.ndarray]] | None:
    """("np" | "torch", the items as numpy arrays of one dtype), or None if they are not."""
    first = items[0]
    if isinstance(first, np.ndarray):
        kind, arrays = "np", items
        if not all(type(a) is np.ndarray for a in items):
            return None
    elif isinstance(first, torch.Tensor):
        kind = "torch"
        if not all(isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.requires_grad
                   for t in items):
            return None
        try:
            arrays = [t.numpy() for t in items]
        except (TypeError, RuntimeError):  # dtypes numpy lacks (bfloat16 ...)
            return None
    else:
        return None
    dtype, ndim = arrays[0].dtype, arrays[0].ndim
    if dtype == object or ndim == 0 or not all(a.dtype == dtype and a.ndim == ndim for a in arrays):
        return None
    return kind, arrays


def pack_items(items: list) -> tuple:
    """Items of one batch in a form that pickles fast: one stacked array when every
    item is an array (numpy or CPU tensor) of one shape, one concatenated array plus
    lengths when they differ only in their first dimension, else the list itself."""
    found = _as_arrays(items) if items else None
    if found is None:
        return ("raw", items)
    kind, arrays = found
    shape = arrays[0].shape
    if all(a.shape == shape for a in arrays):
        return ("stack", kind, np.stack(arrays))
    tail = shape[1:]
    if all(a.shape[1:] == tail for a in arrays):
        return ("cat", kind, np.concatenate(arrays), [a.shape[0] for a in arrays])
    return ("raw", items)


def unpack_items(packed: tuple) -> list:
    form = packed[0]
    if form == "raw":
        return packed[1]
    kind, data = packed[1], packed[2]
    if form == "stack":
        if kind == "torch":
            return list(torch.from_numpy(data).unbind(0))
        return list(data)
    lengths = packed[3]
    if kind == "torch":
        return list(torch.from_numpy(data).split(lengths))
    return np.split(data, np.cumsum(lengths)[:-1])


def pack_outputs(outputs: list) -> tuple:
    """Per-request output dicts as one stacked array per output name when every dict
    has the same names and each name's arrays share one shape and dtype."""
    first = outputs[0] if outputs else None
    if not isinstance(first, dict):
        return ("raw", outputs)
    keys = tuple(first)
    columns = []
    for key in keys:
        column = []
        for out in outputs:
            value = out.get(key) if isinstance(out, dict) and len(out) == len(keys) else None
            if type(value) is not np.ndarray:
                return ("raw", outputs)
            column.append(value)
        head = column[0]
        if head.dtype == object or not all(v.shape == head.shape and v.dtype == head.dtype
                                           for v in column):
            return ("raw", outputs)
        columns.append(np.stack(column))
    return ("cols", keys, columns)


def unpack_outputs(packed: tuple) -> list:
    if packed[0] == "raw":
        return packed[1]
    keys, columns = packed[1], packed[2]
    if len(keys) == 1:
        key = keys[0]
        return [{key: row} for row in columns[0]]
    return [dict(zip(keys, rows)) for rows in zip(*columns)]
