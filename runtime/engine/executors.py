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
  (``max_in_flight = MAX_AHEAD_BATCHES``). A short batch that finds the process idle
  runs in the serving process instead, without the hop (``runtime.engine.direct``).

Execution timeout (``execution_timeout_ms``, per model). A batch that runs longer
has its requests answered at the timeout with a ``timeout`` attempt (503). In the
device process the child is killed and restarted (``runtime.device.process``). On
the device thread nothing can stop it: a loop timer answers the batch, the model is
marked stuck and refuses its batches (``refused`` attempts, 503 "stuck in a batch")
until the thread returns, whose results are then dropped, and a new device thread
takes over the queue so the other models keep running. A batch run inline on the
loop has no timeout (nothing can interrupt the loop; inline runs are off by
default and meant for batches of a few milliseconds).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import Any, Callable, Protocol

import torch

from batchscope.threadnames import name_native
from runtime.api.config import BatchingConfig
from runtime.core.batcher import Batch
from runtime.device.compiled import compiled_already
from runtime.device.executor import batch_attempts, graph_runner
from runtime.device.oom import Attempt
from runtime.device.priority import LoopBound
from runtime.device.process import DeviceProcess
from runtime.engine.direct import DirectLane
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
#: the states of a batch handed to the device thread
_QUEUED, _RUNNING, _DONE, _TIMED_OUT = range(4)


class _Job:
    """A batch handed to the device thread."""

    __slots__ = ("executor", "batch", "on_done", "timeout_s", "state", "started", "timer")

    def __init__(self, executor: "ThreadExecutor", batch: Batch, on_done: OnDone) -> None:
        self.executor = executor
        self.batch = batch
        self.on_done = on_done
        #: the batch's execution_timeout_ms in seconds (None: none)
        self.timeout_s: float | None = None
        #: _QUEUED -> _RUNNING -> _DONE, or _RUNNING -> _TIMED_OUT (the loop gave up on
        #: it); the end transitions are taken under ``DeviceThread.lock``
        self.state = _QUEUED
        #: ``time.monotonic()`` when the device thread started it
        self.started = 0.0
        #: the loop's timer that checks it against its timeout
        self.timer: asyncio.TimerHandle | None = None


class DeviceThread:
    """The one thread of the serving process on which every model's batches run.

    Batches wait in one queue for the worker thread. A batch that runs past its
    model's ``execution_timeout_ms`` cannot be stopped (Python cannot kill a
    thread): the loop answers its requests at the timeout, its model refuses
    batches until it returns (``ThreadExecutor``), and a new worker thread takes the
    queue so the other models keep running. The old thread ends when the batch
    returns. Worker threads are daemons, so a batch that never returns does not
    keep the process from exiting.
    """

    def __init__(self, models: list[ServedModel], device: torch.device, clock: Any,
                 inline_max_s: float) -> None:
        self.models = models
        self.device = device
        self.clock = clock
        #: the longest a batch may be expected to take to run on the loop (0: never)
        self.inline_max_s = inline_max_s if device.type == "cpu" else 0.0
        self.loop: asyncio.AbstractEventLoop | None = None
        #: batches (``_Job``), setup calls (callables) and the stop mark (None)
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        #: guards the end transitions of a ``_Job``
        self.lock = threading.Lock()
        #: released by the device thread when it starts a batch (see ``ThreadExecutor``)
        self.handoff = threading.Lock()
        #: worker threads started, the first included (more after timeouts)
        self.workers = 0

    async def start(self) -> None:
        """Start the thread and set every model up on it."""
        self.loop = asyncio.get_running_loop()
        self._start_worker()
        for model in self.models:
            try:
                await self._call(model.api.setup, self.device)
            except Exception:
                log.exception("setup of model %r on %s failed", model.name, self.device)
                self.jobs.put(None)
                raise

    async def stop(self) -> None:
        if self.loop is not None:
            self.jobs.put(None)  # after the batches still queued

    def executor(self, model: ServedModel) -> "ThreadExecutor":
        return ThreadExecutor(self, model)

    # -- the worker -------------------------------------------------------------------
    def _start_worker(self) -> None:
        self.workers += 1
        threading.Thread(target=self._work, name=f"batchscope-device-{self.workers}",
                         daemon=True).start()

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run ``fn(*args)`` on the device thread and wait for it."""
        loop = self.loop
        fut = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if not fut.done():
                if error is None:
                    fut.set_result(result)
                else:
                    fut.set_exception(error)

        def call() -> None:
            try:
                result, error = fn(*args), None
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting loop
                result, error = None, exc
            loop.call_soon_threadsafe(settle, result, error)

        self.jobs.put(call)
        return await fut

    def _work(self) -> None:
        """Run what the queue holds until the stop mark, or until this thread's batch
        outlived its timeout (a new worker has the queue by then)."""
        name_native()
        jobs, lock, handoff, loop = self.jobs, self.lock, self.handoff, self.loop
        while True:
            job = jobs.get()
            if job is None:
                return
            if not isinstance(job, _Job):  # a setup call
                job()
                continue
            job.started = time.monotonic()
            job.state = _RUNNING
            try:
                handoff.release()
            except RuntimeError:  # already open: the loop gave up waiting
                pass
            attempts = job.executor.attempts(job.batch)
            with lock:
                late = job.state == _TIMED_OUT
                job.state = _DONE
            try:
                loop.call_soon_threadsafe(self._returned if late else self._finish, job,
                                          attempts)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return
            if late:
                return

    # -- on the loop ------------------------------------------------------------------
    def _finish(self, job: _Job, attempts: list[Attempt]) -> None:
        if job.timer is not None:
            job.timer.cancel()
        job.on_done(attempts)

    def _returned(self, job: _Job, attempts: list[Attempt]) -> None:
        job.executor.returned(job, time.monotonic() - job.started)

    def arm(self, job: _Job, after_s: float) -> None:
        job.timer = self.loop.call_later(after_s, self._check, job)

    def _check(self, job: _Job) -> None:
        """A batch's timeout may have passed: time it out if it has run that long."""
        job.timer = None
        state = job.state
        if state == _QUEUED:  # still waiting for the thread: waiting is not running
            self.arm(job, job.timeout_s)
            return
        if state != _RUNNING:
            return
        ran_s = time.monotonic() - job.started
        if ran_s < job.timeout_s:
            self.arm(job, job.timeout_s - ran_s)
            return
        with self.lock:
            if job.state != _RUNNING:
                return  # it returned meanwhile; its answer is on its way
            job.state = _TIMED_OUT
        self._start_worker()
        job.executor.timed_out(job, ran_s)


class ThreadExecutor:
    """One model's batches on the ``DeviceThread`` (or, when short, on the loop)."""

    max_in_flight = 1

    def __init__(self, thread: DeviceThread, model: ServedModel) -> None:
        self._thread = thread
        self._model = model
        #: CUDA-graph runner for the current max batch size, made on the device thread
        #: when cuda_graphs is on
        self._graphs: Any = None
        #: the batch that ran past its timeout and has not returned (the model is stuck)
        self._stuck: _Job | None = None

    @property
    def stuck(self) -> bool:
        """Whether a batch of the model outlived its timeout and has not returned."""
        return self._stuck is not None

    def submit(self, batch: Batch, on_done: OnDone) -> None:
        if self._stuck is not None:
            self._refuse(batch, on_done)
            return
        thread = self._thread
        if self._runs_inline(batch):
            # Short CPU batch: run it on the loop, once the loop has handed out the
            # answers it holds. Handing it to the device thread would cost more than
            # it saves: the thread needs the interpreter lock the busy loop holds.
            # (It runs without an execution timeout: nothing can interrupt the loop.)
            thread.loop.call_soon(self._run_inline, batch, on_done)
            return
        job = _Job(self, batch, on_done)
        timeout_s = self._model.batch_times.timeout_s(batch.config)
        if not compiled_already(self._model.api, batch.config.compile):
            timeout_s = None  # this batch compiles the model first
        if timeout_s is not None:
            job.timeout_s = timeout_s
            thread.arm(job, job.timeout_s)
        gate = thread.handoff
        gate.acquire(blocking=False)  # closed (it may have been left open by a late start)
        thread.jobs.put(job)
        # Let the device thread take the interpreter lock and start now.
        gate.acquire(timeout=HANDOFF_WAIT_S)

    def graph_stats(self) -> dict | None:
        return self._graphs.stats() if self._graphs is not None else None

    def _runs_inline(self, batch: Batch) -> bool:
        """Whether the recent device time per request says this batch takes at most
        ``inline_max_compute_ms`` (CPU only)."""
        limit = self._thread.inline_max_s
        if not limit or not compiled_already(self._model.api, batch.config.compile):
            return False
        per_request = self._model.batcher.mean_compute_per_request_s
        return per_request is not None and per_request * len(batch.requests) <= limit

    def _run_inline(self, batch: Batch, on_done: OnDone) -> None:
        self._thread.loop.call_soon(on_done, self.attempts(batch))

    def attempts(self, batch: Batch) -> list[Attempt]:
        """Run a batch (on whichever thread calls this); its attempts, never raises."""
        return batch_attempts(self._model, batch, self._thread.device, self._thread.clock,
                              self._graph_runner)

    def _graph_runner(self, cfg: BatchingConfig) -> Any:
        """The model's CUDA-graph runner for the current max batch size (device thread)."""
        self._graphs = graph_runner(self._graphs, self._model.api, self._thread.device,
                                    cfg.max_batch_size)
        return self._graphs

    # -- a batch past its timeout (on the loop) ---------------------------------------
    def timed_out(self, job: _Job, ran_s: float) -> None:
        """``job`` has run ``ran_s`` past its timeout: answer it now, refuse until it returns."""
        self._stuck = job
        name = self._model.name
        log.error("model %r has run a batch of %d for %.1f s, past its execution timeout of %g ms; "
                  "its requests are answered now, the model refuses batches until it returns, "
                  "and a new device thread serves the other models", name,
                  len(job.batch.requests), ran_s, job.timeout_s * 1000.0)
        now = self._thread.clock.now()
        job.on_done([Attempt(0, len(job.batch.requests), "timeout", now - ran_s, now, ran_s,
                             error=f"a thread cannot be stopped, so model {name!r} refuses "
                                   "requests (503) until that batch returns; retry later, and "
                                   "fix the model or raise execution_timeout_ms",
                             timeout_s=job.timeout_s)])

    def returned(self, job: _Job, ran_s: float) -> None:
        """The stuck batch returned (its results were dropped): serve the model again."""
        if self._stuck is job:
            self._stuck = None
        log.warning("model %r: the batch that outlived its timeout returned after %.1f s; "
                    "the model serves requests again", self._model.name, ran_s)

    def _refuse(self, batch: Batch, on_done: OnDone) -> None:
        job = self._stuck
        name = self._model.name
        now = self._thread.clock.now()
        on_done([Attempt(0, len(batch.requests), "refused", now, now, 0.0, error=(
            f"model {name!r} is stuck in a batch that has run for "
            f"{time.monotonic() - job.started:.0f} s, past its execution_timeout_ms="
            f"{job.timeout_s * 1000.0:g}; it refuses requests until that batch returns, "
            "retry later"))])


# -- the device process -----------------------------------------------------------------
class ProcessExecutor:
    """One model's batches in the ``DeviceProcess`` (which this only wraps)."""

    max_in_flight = MAX_AHEAD_BATCHES

    def __init__(self, process: DeviceProcess, model: ServedModel,
                 direct: DirectLane | None = None, bound: LoopBound | None = None) -> None:
        self._process = process
        self._model = model
        #: whether this model's process should go nicer than the loop
        #: (``runtime.device.priority``); None: its priority is fixed
        self._bound = bound
        #: the process runs this model alone: its stalls are its own (see dispatch)
        self.isolated = process.names == [model.name]
        #: runs short batches that find the process idle in the serving process
        #: (``runtime.engine.direct``); None: every batch goes to the process
        self.direct = direct

    def submit(self, batch: Batch, on_done: OnDone) -> None:
        bound = self._bound
        if bound is not None:
            now = time.monotonic()
            if bound.due(now) and bound.decide(now, time.thread_time(),
                                               self._model.batcher.mean_compute_per_request_s):
                self._process.renice(bound.nice)
            if bound.applied:  # decided for good: nothing more to ask per batch
                self._bound = None
        direct = self.direct
        if direct is not None:
            where = direct.takes(batch, self._process.idle)
            if where is not None:
                direct.run(batch, on_done, where)
                return
        model = self._model
        reqs = batch.requests
        self._process.submit(
            model.name, batch.config, batch.settings_version, [r.item for r in reqs],
            [r.length for r in reqs] if model.variable else None, batch.pad_to, batch.bucket,
            on_done, model.batch_times.timeout_s(batch.config), seq=batch.seq,
            adapters=batch.adapters)

    def graph_stats(self) -> dict | None:
        return None  # the runner lives in the child
