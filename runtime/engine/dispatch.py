"""``Dispatcher``: the dispatch loop of one model.

One asyncio task per model drives that model's ``Batcher`` with the real clock and
sends each batch it forms to the model's ``Executor`` (``runtime.engine.executors``),
under a device turn from ``DeviceTurns``. A batch coming back is booked at once
(``runtime.engine.booking``); its requests are answered right after the next batch
is on its way (or before the loop sleeps), so the device does not sit idle while a
batch's responses are written.

How many batches may be out at once is the executor's ``max_in_flight``: 1 on the
device thread, ``MAX_AHEAD_BATCHES`` in the device process. With more than one, the
loop need not wait for a batch to come back before sending the next:

* a further batch is sent only when the queue holds a full one (every bucket with
  requests holds the bucket's effective max batch size, and no bypass request
  waits), and only while no other model waits for the device; the child starts it
  the moment the running one ends, instead of idling while this loop answers one
  batch and forms the next;
* a partial batch waits until nothing of the model runs, so batches do not shrink.

Device turns: the first batch goes out under the arbiter's grant; further ones
ride on that grant. The turn is given back when a batch comes back, with the
device time of the batches back since the last report (a batch that comes back
while the model does not hold the turn is counted at its next turn, or at once if
the device is free).

A batch that overstays. When the model runs in a device process of its own
(``Executor.isolated``), a batch still out ``STALL_FACTOR`` times the model's median
batch time (``ServedModel.batch_times``) after it was sent (at least ``STALL_FLOOR_S``) gives the device turn back
early: a model that hangs then holds its own process until its execution timeout
cuts it, and no other model's turn. Its device time is reported when it comes back.

Deadlines have a timer of their own, one per model, armed for the earliest deadline
in the queue (``watch_deadline`` on admission, re-armed each time it fires): a queued
request past its deadline is answered ``RequestExpired`` (503) at that deadline,
whatever the loop is doing, waiting for a batch to come back or for its device turn.
The loop expires too, before each decision. A batch is formed with the time it is
expected to take until it is back (the model's recent mean batch time, once per
batch already out ahead of it, plus its own): a request whose deadline falls before
that is answered ``RequestExpired`` at once instead of being run uselessly. A request
that was dispatched is answered when its batch comes back, also when that is past
its deadline (by at most the batch's time beyond its expected time); so every
accepted request gets exactly one outcome.

Everything here runs on the event loop's thread; ``on_done`` of the executor too.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from runtime.api.errors import ShuttingDown
from runtime.core.batcher import Batch
from runtime.device.oom import Attempt
from runtime.engine.booking import BookedBatch, Booking
from runtime.engine.executors import Executor
from runtime.engine.served import ServedModel
from runtime.engine.turns import DeviceTurns

log = logging.getLogger("batchscope.engine")

#: a batch of an isolated model still out this many times its mean batch time ...
STALL_FACTOR = 4.0
#: ... and at least this long gives the device turn back while it runs on
STALL_FLOOR_S = 0.1


class Waker:
    """Lets a loop sleep until woken or until a timeout, without ``wait_for``."""

    __slots__ = ("_fut",)

    def __init__(self) -> None:
        self._fut: asyncio.Future | None = None

    async def wait(self, timeout_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._fut = fut
        timer = None if timeout_s is None else loop.call_later(max(0.0, timeout_s), self.wake)
        try:
            await fut
        finally:
            self._fut = None
            if timer is not None:
                timer.cancel()

    def wake(self) -> None:
        fut = self._fut
        if fut is not None and not fut.done():
            fut.set_result(None)


class Dispatcher:
    """Forms, sends and books the batches of one model (its attributes are its own)."""

    def __init__(self, model: ServedModel, executor: Executor, turns: DeviceTurns,
                 booking: Booking, clock: Any) -> None:
        self.model = model
        self.executor = executor
        self.turns = turns
        self.booking = booking
        self.clock = clock
        self.max_in_flight = executor.max_in_flight
        #: batches out on the executor, oldest first
        self.running: list[Batch] = []
        #: requests in those batches
        self.in_flight = 0
        #: batches back and booked whose requests still wait for their answers
        self._finished: list[BookedBatch] = []
        #: whether this loop holds the device turn
        self._holds_turn = False
        #: batches back whose device time the arbiter has not been told yet, and that time
        self._unreported = 0
        self._unreported_s = 0.0
        #: set by ``close``: run what is queued, then end
        self._closing = False
        #: set while ``_refill`` sends (a batch failed at once must not send again)
        self._refilling = False
        #: resolved when the last running batch is back (made by ``all_back``)
        self._all_back: asyncio.Future | None = None
        self._waker = Waker()
        self.task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        #: the expiry timer, and the deadline (engine clock) it is armed for (inf: none)
        self._timer: asyncio.TimerHandle | None = None
        self.timer_at = math.inf
        #: gives the turn back while a batch overstays (isolated executors only)
        self._isolated = bool(getattr(executor, "isolated", False))
        self._stall: asyncio.TimerHandle | None = None
        #: turns given back early so far, for tests and stats
        self.stall_yields = 0

    # -- lifecycle ----------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.task = loop.create_task(self.run(), name=f"batchscope-worker-{self.model.name}")

    def wake(self) -> None:
        """Something changed (a request, new settings): decide again now."""
        self._waker.wake()

    def close(self) -> None:
        """Take no new work from now on; the loop ends once the queue is empty and
        every batch it sent is back."""
        self._closing = True
        self.model.batcher.start_draining()
        self._waker.wake()

    def all_back(self) -> asyncio.Future | None:
        """A future resolved when no batch of the model is out any more (None: none is)."""
        if not self.running:
            return None
        if self._all_back is None or self._all_back.done():
            self._all_back = asyncio.get_running_loop().create_future()
        return self._all_back

    def cancel_queued(self, now: float) -> None:
        """Answer every request still queued with ``ShuttingDown``."""
        self._disarm()
        for req in self.model.batcher.drain_all():
            self.booking.settle(self.model, req, now, "cancelled", error=ShuttingDown(
                "the server shut down before this request could run; send it again "
                "to a running instance"))

    def cancel_running(self, now: float) -> None:
        """Answer the requests of batches that never came back with ``ShuttingDown``."""
        for batch in self.running:
            for req in batch.requests:
                self.booking.settle(self.model, req, now, "cancelled", error=ShuttingDown(
                    "the server shut down while this request was running; its result "
                    "was lost, send it again to a running instance"))

    # -- the expiry timer ---------------------------------------------------------------
    def watch_deadline(self, deadline_s: float) -> None:
        """A request with ``deadline_s`` was queued: make sure the timer fires by then."""
        if deadline_s < self.timer_at:
            self._arm(deadline_s)

    def _arm(self, deadline_s: float) -> None:
        loop = self._loop
        if loop is None:
            return
        if self._timer is not None:
            self._timer.cancel()
        self.timer_at = deadline_s
        self._timer = loop.call_later(max(0.0, deadline_s - self.clock.now()), self._on_timer)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.timer_at = math.inf

    def _on_timer(self) -> None:
        """The earliest deadline is due: answer what expired, arm for the next one."""
        self._timer = None
        self.timer_at = math.inf
        try:
            self._expire()
        finally:
            nxt = self.model.batcher.earliest_deadline()
            if nxt is not None:
                self._arm(nxt)

    # -- the loop -----------------------------------------------------------------------
    async def run(self) -> None:
        batcher = self.model.batcher
        turns = self.turns
        name = self.model.name
        try:
            while True:
                try:
                    now = self._expire()
                    if self._unreported:
                        self._report_device_time()
                    if self._closing and not batcher.depth and not self.running:
                        self.answer()
                        return
                    if not self._due(now):
                        self.answer()
                        if self._process_busy() and not self._spills():
                            await self._waker.wait(None)  # a batch coming back wakes it
                        else:  # deadlines are the timer's
                            wake_at = batcher.due_at(now)
                            await self._waker.wait(None if wake_at is None else wake_at - now)
                        continue
                    if not self._holds_turn:
                        if not turns.ask(name, urgent=batcher.has_bypass()):
                            self.answer()
                            await turns.wait(name)
                        self._holds_turn = True
                    now = self.clock.now()
                    busy = self._process_busy() and not self._spills()  # the spill's core is free
                    batch = batcher.next_batch(now, model_busy=busy, lead_s=self._lead_s())
                    if batch is not None:
                        self._send(batch)
                    elif not self.running:
                        self._give_back_turn()
                    self._expire()  # those left out for want of time
                    self.answer()
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug in the engine: keep serving, say so loudly
                    log.exception("the worker of model %r hit an unexpected error", name)
                    if self._holds_turn and not self.running:
                        self._give_back_turn()
                    self.answer()
                    await asyncio.sleep(0.01)
        finally:
            if self._holds_turn:
                self._give_back_turn()

    def _due(self, now: float) -> bool:
        """Whether a batch is to be sent now."""
        running = len(self.running)
        if running >= self.max_in_flight or self.model.batcher.blocked:
            return False
        if self._process_busy() and not self._spills():
            return (self._full_batch_waiting()
                    and not (self._holds_turn and self.turns.others_waiting()))
        due_at = self.model.batcher.due_at(now)
        return due_at is not None and due_at <= now

    def _process_busy(self) -> bool:
        """Whether a batch of the model is out where it runs (a batch on the direct
        lane's thread keeps only that thread busy: the next goes to the device process)."""
        direct = getattr(self.executor, "direct", None)
        on_thread = direct.on_thread if direct is not None else None
        return any(b is not on_thread for b in self.running)

    def _spills(self) -> bool:
        """Whether the one request waiting would run on the direct lane's thread
        (``runtime.engine.direct``: a lone batch too long for the loop) while a batch is
        out at the process:
        it is then batched as if the model were idle, when due rather than held until
        the running batch is back."""
        direct = getattr(self.executor, "direct", None)
        return direct is not None and direct.would_spill(self.model.batcher.depth)

    def _full_batch_waiting(self) -> bool:
        """Whether the next batch the batcher forms is sure to be full: no bypass request
        waits, and every bucket with requests holds at least its effective max."""
        batcher = self.model.batcher
        if not batcher.depth or batcher.has_bypass():
            return False
        cap = batcher.cap
        return all(n >= cap(key) for key, n in batcher.depth_by_bucket().items() if n)

    def _lead_s(self) -> float:
        """How long a batch sent now may take until it is back: the recent mean batch time
        for each batch already out ahead of it, and for itself the recent 99th percentile
        (batches of a variable-length model differ: a request must not miss its deadline
        because its batch was a long one)."""
        mean = self.model.batcher.mean_compute_s
        if mean is None:
            return 0.0
        own = self.model.batch_times.p99_s
        return mean * len(self.running) + (mean if own is None or own < mean else own)

    def _expire(self) -> float:
        """Settle the queued requests that are past their deadline; the time now."""
        now = self.clock.now()
        expired = self.model.batcher.expire(now)
        if expired:
            self.booking.expired(self.model, expired, now)
        return now

    # -- device turns -------------------------------------------------------------------
    def _report_device_time(self) -> None:
        """Tell the arbiter the device time of the batches back since the last report."""
        if self._holds_turn:
            self._give_back_turn()
        elif self.turns.is_free():
            self.turns.ask(self.model.name)
            self._holds_turn = True
            self._give_back_turn()

    def _give_back_turn(self) -> None:
        """Release the device turn, with the device time not yet told."""
        device_s = self._unreported_s
        self._unreported = 0
        self._unreported_s = 0.0
        self._holds_turn = False
        self.turns.release(self.model.name, device_s)

    # -- batches out and back -----------------------------------------------------------
    def _send(self, batch: Batch) -> None:
        self.running.append(batch)
        self.in_flight += len(batch.requests)
        if self._isolated and self._loop is not None:
            if self._stall is not None:
                self._stall.cancel()
            typical = (self.model.batch_times.typical_s or self.model.batcher.mean_compute_s
                       or 0.0)
            self._stall = self._loop.call_later(
                max(STALL_FLOOR_S, STALL_FACTOR * typical * len(self.running)), self._on_stall)
        batch.seq = self.booking.reserve()
        self.executor.submit(batch, lambda attempts: self._back(batch, attempts))

    def _on_stall(self) -> None:
        """A batch overstays: let the other models have the device meanwhile."""
        self._stall = None
        if self.running and self._holds_turn:
            self.stall_yields += 1
            self._give_back_turn()

    def _back(self, batch: Batch, attempts: list[Attempt]) -> None:
        """A batch is back from the executor: book it and wake the loop."""
        model = self.model
        now = self.clock.now()
        booked = self.booking.batch_back(model, batch, attempts, now)
        self._unreported += 1
        self._unreported_s += booked.device_s
        model.batcher.complete(batch, now, booked.device_s)
        if all(a.outcome not in ("timeout", "lost") for a in attempts):  # no batch time
            model.batch_times.observe(booked.device_s)
        self._finished.append(booked)
        running = self.running
        if len(running) == 1 and running[0] is batch:
            running.clear()
            self.in_flight = 0
        else:
            running[:] = [b for b in running if b is not batch]
            self.in_flight = sum(len(b.requests) for b in running)
        if not running:
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None
            if self._all_back is not None and not self._all_back.done():
                self._all_back.set_result(None)
        self._refill(now)
        self.answer()
        self._waker.wake()

    def _refill(self, now: float) -> None:
        """Send the next batch from the completion callback itself, when one is due and
        the model holds the device turn, rather than on the loop's next pass: under
        overload one pass of the loop reads thousands of connections, and a device that
        waited for the dispatch task to run would idle for as long as that takes."""
        if self._closing or self._refilling or not self._holds_turn:
            return
        turns = self.turns
        if not self.running:
            # the turn ended with the batch: report its device time, and go on only
            # when the device is free (else the loop waits for its turn as usual)
            self._give_back_turn()
            if not (self._due(now) and turns.is_free()):
                return
            turns.ask(self.model.name, urgent=self.model.batcher.has_bypass())
            self._holds_turn = True
        self._refilling = True
        try:
            batcher = self.model.batcher
            while self._due(now) and not turns.others_waiting():
                busy = self._process_busy() and not self._spills()
                batch = batcher.next_batch(now, model_busy=busy, lead_s=self._lead_s())
                if batch is None:
                    break
                self._send(batch)
                now = self.clock.now()
            if not self.running:
                self._give_back_turn()
        finally:
            self._refilling = False

    def answer(self) -> None:
        """Give every request of the batches back so far its outcome."""
        finished = self._finished
        if not finished:
            return
        self._finished = []
        now = self.clock.now()
        answer = self.booking.answer
        model = self.model
        for booked in finished:
            answer(model, booked, now)
