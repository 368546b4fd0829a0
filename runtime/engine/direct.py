"""The direct lane: a short batch that finds its device process idle runs in the serving
process, without the hop.

With the device process, every batch crosses to the child and back: two socket
writes, the items and outputs pickled, and two wake-ups, of the child and then of the
event loop. Under load those costs overlap with other work and the child's own
interpreter lock pays for them many times over. With one client they are the whole
difference: on a 2-vCPU machine ``mlp`` answered one client at 0.53x the plain
server's throughput through the hop, and at 1.16x through this lane.

So when a batch of one request arrives, nothing else is queued, its device process has
nothing to do (no batch sent and not back, none held for a restart), the model's recent
batches held about one request each (``DIRECT_MAX_MEAN_BATCH``) and its recent device
time per request says the batch takes at most ``direct_max_compute_ms``, it runs on the
event loop with
the serving process' own copy of the model, set up on the same device at start (CPU
only: a second copy on a GPU would take its memory twice). The loop first hands out the
answers it holds, then runs the batch (``ThreadExecutor``'s inline runs do the same).

Why so strict: whenever there is traffic, the event loop is the busier side, and a batch
run on it instead of in the child takes its time from every other request (8 closed-loop
clients lost a fifth to a third of their throughput when small batches went direct).

The spill: a lone batch too long for the loop (expected above ``direct_max_compute_ms``,
up to ``SPILL_MAX_COMPUTE_S``) runs on the lane's thread (torch leaves the interpreter
lock while it computes), one at a time, under the same conditions on traffic. With its
device process idle this saves the hop (encoder, one client: 1.05x the throughput, p50
0.36 ms lower than through the process, alternating 4-s windows, medians of 8), and the
dispatcher counts only batches out at the process as busy, so a request that comes while
it runs goes to the idle process. With the process busy it does more: at a light rate
two requests sometimes overlap, and a plain server runs them at once on two cores where
one device process runs them one after the other; the dispatcher sends such a batch at
once rather than hold it until the running batch is back (``Dispatcher._spills``).

What a direct batch gives up, and why that is acceptable for it: no execution timeout
on the loop (nothing can interrupt it; a spilled batch past its timeout is answered
then, and no other batch spills until it returns) and no crash isolation. Only batches
measured to take a millisecond or two qualify (up to 50 ms for the spill), and only once the model has answered batches in its
device process (before that nothing is measured, so nothing runs directly). Batches
with LoRA adapters, and models with ``compile`` on, always go to the device process:
the adapters and the compiled model live there.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch

from batchscope.threadnames import name_native
from runtime.core.batcher import Batch
from runtime.device.executor import batch_attempts
from runtime.device.oom import Attempt
from runtime.engine.served import ServedModel

log = logging.getLogger("batchscope.engine")

#: the default ``direct_max_compute_ms``: the longest a batch may be expected to take to
#: run directly on the serving process' event loop
DIRECT_MAX_COMPUTE_MS = 2.0
#: a lone batch too long for the loop runs on the lane's thread instead, up to this long
#: (expected): no hop to the device process, and two lone requests that overlap run at
#: once on two cores, as a plain server runs them, instead of one after the other
SPILL_MAX_COMPUTE_S = 0.05
#: the most requests a batch run directly holds: a larger batch means there is traffic to
#: batch, and the event loop, which serves all of it, is better left to that
DIRECT_MAX_BATCH = 1
#: ... and only while the model's recent batches held at most this many on average (an
#: exponential mean, each batch weighing ``BATCH_MEAN_WEIGHT``)
DIRECT_MAX_MEAN_BATCH = 1.5
BATCH_MEAN_WEIGHT = 0.1


class DirectLane:
    """One model's direct runs (module doc); ``takes(batch, idle)`` says whether a batch
    runs here, ``run(batch, on_done)`` runs it."""

    def __init__(self, model: ServedModel, device: torch.device, clock: Any,
                 max_compute_s: float) -> None:
        self.model = model
        self.device = device
        self.clock = clock
        self.max_compute_s = max_compute_s if device.type == "cpu" else 0.0
        #: whether the serving process' copy of the model is set up
        self.ready = False
        #: batches run directly so far, and whether one is waiting for its turn on the loop
        self.batches = 0
        self.running = False
        #: the model's recent batch size (exponential mean of every batch it was asked about)
        self.mean_batch = 1.0
        self.loop: asyncio.AbstractEventLoop | None = None
        #: of ``batches``, those run on the lane's thread
        self.spills = 0
        #: the batch on the lane's thread (None: none): it keeps that thread busy, not
        #: the device process, so the dispatcher sends the next batch to the process
        self.on_thread: Any = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def spilled(self) -> bool:
        """Whether a batch runs on the lane's thread (one past its timeout, answered
        already, counts until it returns)."""
        return self.on_thread is not None

    async def start(self) -> None:
        """Set the serving process' copy of the model up (off the loop); without it the
        lane stays closed and every batch goes to the device process."""
        if not self.max_compute_s:
            return
        self.loop = asyncio.get_running_loop()
        try:
            await asyncio.to_thread(self.model.api.setup, self.device)
        except Exception as exc:  # noqa: BLE001 - the device process serves it anyway
            log.warning("model %r: the direct lane stays closed, its setup in the serving "
                        "process failed (%s: %s)", self.model.name, type(exc).__name__, exc)
            return
        self.ready = True

    def takes(self, batch: Batch, process_idle: bool) -> str | None:
        """Where ``batch`` runs here, or None: to the device process (``process_idle``:
        the process has nothing to do). ``"loop"``: a short batch that finds the process
        idle, on the event loop; ``"thread"``: a lone batch too long for the loop, on the
        lane's thread (the spill). Every batch of the model is asked about, so the recent
        mean size is the model's."""
        n = len(batch.requests)
        mean = self.mean_batch = self.mean_batch + (n - self.mean_batch) * BATCH_MEAN_WEIGHT
        if mean > DIRECT_MAX_MEAN_BATCH or n > DIRECT_MAX_BATCH:  # there is traffic to batch
            return None
        if not (self.ready and self.max_compute_s) or self.running or self.spilled \
                or batch.adapters is not None:
            return None
        if self.model.batcher.depth or batch.config.compile != "off":
            return None
        per_request = self.model.batcher.mean_compute_per_request_s
        if per_request is None:
            return None
        expected = per_request * n
        if process_idle and expected <= self.max_compute_s:
            return "loop"
        return "thread" if self.max_compute_s < expected <= SPILL_MAX_COMPUTE_S else None

    def would_spill(self, waiting: int) -> bool:
        """Whether a lone request waiting (``waiting``: the model's queue depth) would
        run on the lane's thread, its device process being busy: the dispatcher then
        sends it at once rather than hold it until the running batch is back."""
        if waiting != 1 or self.mean_batch > DIRECT_MAX_MEAN_BATCH or self.running \
                or self.spilled or not (self.ready and self.max_compute_s):
            return False
        per_request = self.model.batcher.mean_compute_per_request_s
        return per_request is not None and self.max_compute_s < per_request <= SPILL_MAX_COMPUTE_S

    def run(self, batch: Batch, on_done: Callable[[list[Attempt]], None],
            where: str = "loop") -> None:
        """Run ``batch`` where ``takes`` said: on the loop once it has handed out the
        answers it holds, or on the lane's thread (the answers handed out on the loop)."""
        self.batches += 1
        if where == "thread":
            self.spills += 1
            self.on_thread = batch
            answered = [False]

            def finish(attempts: list[Attempt]) -> None:
                if not answered[0]:
                    answered[0] = True
                    on_done(attempts)

            started = self.clock.now() if self.clock is not None else 0.0
            timeout_s = self.model.batch_times.timeout_s(batch.config)
            timer = None if timeout_s is None else self.loop.call_later(
                timeout_s, self._spill_overdue, batch, finish, started, timeout_s)
            run = self.loop.run_in_executor(self._thread(), batch_attempts, self.model, batch,
                                            self.device, self.clock)
            run.add_done_callback(lambda done: self._spill_done(done, finish, timer))
            return
        self.running = True
        self.loop.call_soon(self._run, batch, on_done)

    def _run(self, batch: Batch, on_done: Callable[[list[Attempt]], None]) -> None:
        self.running = False
        on_done(batch_attempts(self.model, batch, self.device, self.clock))

    def _thread(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"direct-{self.model.name}",
                                            initializer=name_native)
        return self._pool

    def _spill_done(self, done: asyncio.Future, finish: Callable[[list[Attempt]], None],
                    timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()
        self.on_thread = None
        finish(done.result())  # batch_attempts answers every failure as an attempt (and
        # a batch answered at its timeout already is not answered twice)

    def _spill_overdue(self, batch: Batch, finish: Callable[[list[Attempt]], None],
                       started: float, timeout_s: float) -> None:
        """A spilled batch past its execution timeout: a thread cannot be stopped, so its
        requests are answered now and it stays ``spilled`` (no other batch spills, the
        device process serves them) until it returns."""
        now = self.clock.now()
        log.error("model %r: a batch of %d on the direct lane's thread has run past its "
                  "execution timeout of %g ms; its requests are answered now", self.model.name,
                  len(batch.requests), timeout_s * 1000.0)
        finish([Attempt(0, len(batch.requests), "timeout", started, now, now - started,
                        error=f"the batch ran past model {self.model.name!r}'s execution "
                              "timeout; retry, and fix the model or raise execution_timeout_ms",
                        timeout_s=timeout_s)])

    def close(self) -> None:
        """Let the lane's thread go once a batch on it has returned."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)
