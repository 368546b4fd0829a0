"""Where a model's batches run: the device thread or the device process.

A dispatch loop hands each batch to its model's ``Executor``::

    executor.submit(batch, on_done)    # on_done(attempts) later, on the event loop

and never waits for it: ``on_done`` is called exactly once, on the loop's thread,
with the batch's ``Attempt`` list (``runtime.device.executor.run_batch``). It may
be called before ``submit`` returns (a device process that is shutting down fails
a batch at once). ``max_in_flight`` says how many batches of the model the loop may
have out at once.

* ``ThreadExecutor`` (one per model, all on one ``DeviceThread``): the batch runs
  on the single device thread of the serving process, one at a time
  (``max_in_flight = 1``). After handing a batch over, the event loop waits up to
  ``HANDOFF_WAIT_S`` for the thread to start it: a busy loop would otherwise keep
  the thread waiting for the interpreter lock for as long as it stays busy. A short
  CPU batch (from the model's recent device time per request, at most
  ``inline_max_compute_ms``) instead runs on the loop itself, right after the loop
  has handed out the answers it holds.
* ``ProcessExecutor`` (one per model, all on one ``DeviceProcess``): the batch
  runs in the child process with its own interpreter lock; the child runs its pipe
  in order, so a second batch can wait there while one runs
  (``max_in_flight = MAX_AHEAD_BATCHES``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol

import torch

from runtime.api.config import BatchingConfig
from runtime.core.batcher import Batch
from runtime.device.executor import graph_runner, run_batch
from runtime.device.oom import Attempt
from runtime.device.process import DeviceProcess
from runtime.engine.served import ServedModel

log = logging.getLogger("batchscope.engine")

#: the longest the event loop waits for the device thread to pick up a batch
HANDOFF_WAIT_S = 0.002
#: with the device process, the most batches of one model sent to it at once (one
#: running, the next waiting in its pipe)
MAX_AHEAD_BATCHES = 2

OnDone = Callable[[list[Attempt]], None]


class Executor(Protocol):
    """Runs one model's batches off its dispatch loop."""

    #: the most batches of this model that may be out at once
    max_in_flight: int

    def submit(self, batch: Batch, on_done: OnDone) -> None:
        """Run ``batch``; ``on_done(attempts)`` is called once, on the event loop."""

    def graph_stats(self) -> dict | None:
        """Figures of the model's CUDA-graph runner, None when it has none here."""


# -- the device thread ------------------------------------------------------------------
class DeviceThread:
    """The one thread of the serving process on which every model's batches run."""

    def __init__(self, models: list[ServedModel], device: torch.device, clock: Any,
                 inline_max_s: float) -> None:
        self.models = models
        self.device = device
        self.clock = clock
        #: the longest a batch may be expected to take to run on the loop (0: never)
        self.inline_max_s = inline_max_s if device.type == "cpu" else 0.0
        self.loop: asyncio.AbstractEventLoop | None = None
        self.pool: ThreadPoolExecutor | None = None
        #: released by the device thread when it starts a batch (see ``ThreadExecutor``)
        self.handoff = threading.Lock()

    async def start(self) -> None:
        """Start the thread and set every model up on it."""
        self.loop = asyncio.get_running_loop()
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchscope-device")
        for model in self.models:
            try:
                await self.loop.run_in_executor(self.pool, model.api.setup, self.device)
            except Exception:
                log.exception("setup of model %r on %s failed", model.name, self.device)
                self.pool.shutdown(wait=False)
                raise

    async def stop(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False)

    def executor(self, model: ServedModel) -> "ThreadExecutor":
        return ThreadExecutor(self, model)


class ThreadExecutor:
    """One model's batches on the ``DeviceThread`` (or, when short, on the loop)."""

    max_in_flight = 1

    def __init__(self, thread: DeviceThread, model: ServedModel) -> None:
        self._thread = thread
        self._model = model
        #: CUDA-graph runner for the current max batch size, made on the device thread
        #: when cuda_graphs is on
        self._graphs: Any = None

    def submit(self, batch: Batch, on_done: OnDone) -> None:
        thread = self._thread
        if self._runs_inline(batch):
            # Short CPU batch: run it on the loop, once the loop has handed out the
            # answers it holds. Handing it to the device thread would cost more than
            # it saves: the thread needs the interpreter lock the busy loop holds.
            thread.loop.call_soon(self._run, batch, on_done)
            return
        gate = thread.handoff
        gate.acquire(blocking=False)  # closed (it may have been left open by a late start)
        thread.pool.submit(self._run_on_thread, batch, on_done)
        # Let the device thread take the interpreter lock and start now.
        gate.acquire(timeout=HANDOFF_WAIT_S)

    def graph_stats(self) -> dict | None:
        return self._graphs.stats() if self._graphs is not None else None

    def _runs_inline(self, batch: Batch) -> bool:
        """Whether the recent device time per request says this batch takes at most
        ``inline_max_compute_ms`` (CPU only)."""
        limit = self._thread.inline_max_s
        if not limit:
            return False
        per_request = self._model.batcher.mean_compute_per_request_s
        return per_request is not None and per_request * len(batch.requests) <= limit

    def _run_on_thread(self, batch: Batch, on_done: OnDone) -> None:
        try:
            self._thread.handoff.release()
        except RuntimeError:  # already open: the loop gave up waiting
            pass
        self._run(batch, on_done)

    def _run(self, batch: Batch, on_done: OnDone) -> None:
        """Run a batch and hand its attempts to the loop."""
        thread = self._thread
        try:
            attempts = self._run_batch(batch)
        except BaseException as exc:  # noqa: BLE001 - every request must still get an answer
            now = thread.clock.now()
            attempts = [Attempt(0, len(batch.requests), "error", now, now, 0.0,
                                error=f"{type(exc).__name__}: {exc}",
                                trace=traceback.format_exc())]
        try:
            thread.loop.call_soon_threadsafe(on_done, attempts)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _run_batch(self, batch: Batch) -> list[Attempt]:
        model = self._model
        reqs = batch.requests
        return run_batch(model.api, [r.item for r in reqs],
                         [r.length for r in reqs] if model.variable else None, batch.pad_to,
                         batch.bucket, batch.config, model.variable, self._thread.device,
                         self._thread.clock, self._graph_runner)

    def _graph_runner(self, cfg: BatchingConfig) -> Any:
        """The model's CUDA-graph runner for the current max batch size (device thread)."""
        self._graphs = graph_runner(self._graphs, self._model.api, self._thread.device,
                                    cfg.max_batch_size)
        return self._graphs


# -- the device process -----------------------------------------------------------------
class ProcessExecutor:
    """One model's batches in the ``DeviceProcess`` (which this only wraps)."""

    max_in_flight = MAX_AHEAD_BATCHES

    def __init__(self, process: DeviceProcess, model: ServedModel) -> None:
        self._process = process
        self._model = model

    def submit(self, batch: Batch, on_done: OnDone) -> None:
        model = self._model
        reqs = batch.requests
        self._process.submit(
            model.name, batch.config, batch.settings_version, [r.item for r in reqs],
            [r.length for r in reqs] if model.variable else None, batch.pad_to, batch.bucket,
            on_done)

    def graph_stats(self) -> dict | None:
        return None  # the runner lives in the child
