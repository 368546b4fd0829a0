"""Tiny deterministic models for tests and examples.

* ``DoubleModel`` ("double"): FP32 [4] -> x * 2, fixed size. It remembers the batch
  sizes it ran and can be held at the start of ``predict`` (``hold``) so a test can
  let a queue build up behind a running batch without timing anything.
* ``VarLenModel`` ("varlen"): FP32 [-1] (variable length); answers the sum of the
  values and the length it was padded to.
* ``FailingModel`` ("failing"): like ``double`` but raises when an input's first
  value is negative, so a test picks which batch fails.
* ``OOMModel`` ("oomtoy"): like ``double`` but raises the real
  ``torch.cuda.OutOfMemoryError`` whenever a batch is larger than ``oom_above``.
* ``HangingModel`` ("hanging"): like ``double`` but a batch holding an input whose
  first value is 99 hangs for as many seconds as that input's second value (at most
  ``MAX_HANG_S``), or until ``release`` is set, so a test can drive the execution
  timeout; in a device process the hang is chosen by the input alone.
* ``GatedDecoder`` ("gated"): the bundled generation model ``decoder``, whose steps
  wait while the file named by ``$BATCHSCOPE_TOY_GATE`` exists, so a test holds the
  generations of a server in another process mid-stream by creating that file
  (``tests/test_sigterm_streams.py``).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import torch

from runtime.api.errors import ClientError
from runtime.api.model import ModelAPI, TensorSpec
from runtime.models.decoder import TinyDecoder


def _vector(inputs: dict[str, np.ndarray], width: int | None) -> np.ndarray:
    if "INPUT0" not in inputs:
        raise ClientError(f"missing input 'INPUT0'; got {sorted(inputs)}")
    x = np.asarray(inputs["INPUT0"], dtype=np.float32)
    if x.ndim == 2 and x.shape[0] == 1:
        x = x[0]
    want = "[-1]" if width is None else f"[{width}]"
    if x.ndim != 1 or (width is not None and x.shape[0] != width):
        raise ClientError(f"input 'INPUT0' has shape {list(x.shape)}; expected FP32 {want}")
    return x


class DoubleModel(ModelAPI):
    name = "double"
    inputs = (TensorSpec("INPUT0", "FP32", (4,)),)
    outputs = (TensorSpec("OUTPUT0", "FP32", (4,)),)

    def __init__(self, hold: threading.Event | None = None, journal: list | None = None) -> None:
        #: while set to an unset Event, predict waits for it (at most 30 s)
        self.hold = hold
        #: a list shared by several models: (model instance, batch size) per batch run
        self.journal = journal
        #: set each time predict starts, so a test can wait for a batch to be running
        self.entered = threading.Event()
        self.batch_sizes: list[int] = []
        #: first input value of every item, per batch, in the order they ran
        self.batches: list[list[float]] = []

    def decode(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        return _vector(inputs, 4)

    def collate(self, items: list[np.ndarray], pad_to: int | None) -> torch.Tensor:
        return torch.from_numpy(np.stack(items))

    def predict(self, batch: torch.Tensor) -> torch.Tensor:
        self.batch_sizes.append(int(batch.shape[0]))
        self.batches.append([float(v) for v in batch[:, 0]])
        if self.journal is not None:
            self.journal.append((self, int(batch.shape[0])))
        self.entered.set()
        if self.hold is not None:
            self.hold.wait(timeout=30.0)
        return batch * 2

    def split(self, output: torch.Tensor, n: int) -> list[dict[str, np.ndarray]]:
        out = output.numpy()
        return [{"OUTPUT0": out[i]} for i in range(n)]


class FailingModel(DoubleModel):
    name = "failing"

    def predict(self, batch: torch.Tensor) -> torch.Tensor:
        if bool((batch[:, 0] < 0).any()):
            self.batch_sizes.append(int(batch.shape[0]))
            raise RuntimeError("negative first value: this toy model fails on cue")
        return super().predict(batch)


class OOMModel(DoubleModel):
    name = "oomtoy"

    def __init__(self, oom_above: int = 8, bytes_per_item: int = 1 << 20,
                 hold: threading.Event | None = None) -> None:
        super().__init__(hold)
        #: batches larger than this raise torch.cuda.OutOfMemoryError
        self.oom_above = oom_above
        self.bytes_per_item = bytes_per_item
        self.oom_sizes: list[int] = []

    def predict(self, batch: torch.Tensor) -> torch.Tensor:
        n = int(batch.shape[0])
        if n > self.oom_above:
            self.oom_sizes.append(n)
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {n * self.bytes_per_item} bytes "
                f"for a batch of {n} (this toy fits at most {self.oom_above})")
        return super().predict(batch)

    def estimate_batch_bytes(self, batch_size: int, padded_length: int) -> int | None:
        return batch_size * self.bytes_per_item


#: the longest a ``HangingModel`` batch hangs
MAX_HANG_S = 60.0
#: the first input value that makes a ``HangingModel`` batch hang
HANG_CUE = 99.0


class HangingModel(DoubleModel):
    name = "hanging"

    def __init__(self, release: threading.Event | None = None) -> None:
        super().__init__()
        #: when set, a hanging batch returns at once
        self.release = release if release is not None else threading.Event()
        #: set when a hanging batch starts, cleared by the test
        self.hanging = threading.Event()
        #: how many hanging batches returned
        self.returned = 0

    def predict(self, batch: torch.Tensor) -> torch.Tensor:
        cue = batch[:, 0] == HANG_CUE
        if bool(cue.any()):
            hang_s = min(MAX_HANG_S, max(0.0, float(batch[cue][0, 1])))
            self.hanging.set()
            give_up = time.monotonic() + hang_s
            while not self.release.is_set() and time.monotonic() < give_up:
                self.release.wait(min(0.05, max(0.0, give_up - time.monotonic())))
            self.returned += 1
        return super().predict(batch)


#: the environment variable naming the file that holds a ``GatedDecoder``'s steps
GATE_ENV = "BATCHSCOPE_TOY_GATE"
#: how often a held step looks at the file again
GATE_POLL_S = 0.01


class GatedDecoder(TinyDecoder):
    """``decoder`` whose steps do not start while the gate file exists: a step that
    finds it waits until it is removed, for at most ``MAX_HANG_S`` (then the step
    raises, failing the sequences it held). Without ``$BATCHSCOPE_TOY_GATE`` it is
    the plain ``decoder``."""

    name = "gated"

    def __init__(self) -> None:
        super().__init__()
        self.gate = os.environ.get(GATE_ENV) or None

    def step(self, chunks: Any) -> torch.Tensor:
        if self.gate is not None and os.path.exists(self.gate):
            give_up = time.monotonic() + MAX_HANG_S
            while os.path.exists(self.gate):
                if time.monotonic() > give_up:
                    raise TimeoutError(f"the gate file {self.gate} stayed for {MAX_HANG_S:g} s")
                time.sleep(GATE_POLL_S)
        return super().step(chunks)


class VarLenModel(ModelAPI):
    name = "varlen"
    inputs = (TensorSpec("INPUT0", "FP32", (-1,)),)
    outputs = (TensorSpec("SUM", "FP32", (1,)), TensorSpec("PADDED", "INT64", (1,)))
    variable_length = True
    max_length = 1024

    def __init__(self) -> None:
        #: (batch size, padded length) of every batch, in the order they ran
        self.shapes: list[tuple[int, int]] = []

    def decode(self, inputs: dict[str, np.ndarray]) -> np.ndarray:
        x = _vector(inputs, None)
        if x.shape[0] == 0:
            raise ClientError("input 'INPUT0' is empty; send at least one value")
        return x

    def length(self, item: np.ndarray) -> int:
        return int(item.shape[0])

    def collate(self, items: list[np.ndarray], pad_to: int | None) -> torch.Tensor:
        width = pad_to if pad_to is not None else max(len(x) for x in items)
        out = np.zeros((len(items), width), dtype=np.float32)
        for i, x in enumerate(items):
            out[i, :len(x)] = x
        return torch.from_numpy(out)

    def predict(self, batch: torch.Tensor) -> Any:
        self.shapes.append((int(batch.shape[0]), int(batch.shape[1])))
        return batch.sum(dim=1), int(batch.shape[1])

    def split(self, output: Any, n: int) -> list[dict[str, np.ndarray]]:
        sums, width = output
        values = sums.numpy()
        return [{"SUM": values[i:i + 1], "PADDED": np.array([width], dtype=np.int64)}
                for i in range(n)]
