"""``Engine``: the asyncio shell around the batching core.

One worker task per model drives that model's ``Batcher`` with the real clock.
Batches run off the event loop in a single device thread (collate, predict and
split under ``torch.inference_mode()``, see ``runtime.device.executor.run_batch``); the
futures of a batch are resolved in one ``loop.call_soon_threadsafe`` callback. With
``device_process=True`` they run instead in a child process with its own GIL
(``runtime.device.process``), which loads the models from ``model_specs``; a model's
next batch then goes to the child while one still runs when the queue holds a full
batch (``Engine._worker_ahead``, at most ``MAX_AHEAD_BATCHES``). Several models share
the device through ``FairArbiter``. Every accepted request gets exactly one outcome, and one
``RequestRow``; every executed batch (and every out-of-memory attempt) one
``BatchRow``; notable things an ``EventRow``.

All public methods are to be called on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import numpy as np
import torch

from batchscope.storage.records import (BatchRow, EventRow, ListRecorder, RecorderLike, RequestBatch,
                                RequestRow, put_many_of)
from runtime.core.clock import MonotonicClock
from runtime.api.config import BatchingConfig
from runtime.core.arbiter import FairArbiter
from runtime.core.batcher import Batch, Batcher, pad_length
from runtime.device.process import DeviceProcess
from runtime.core.request import PendingRequest
from runtime.api.errors import (BatchScopeError, ClientError, ConfigError, ModelError, ModelNotFound,
                            ModelNotReady, OutOfMemory, QueueFull, RequestExpired, ShuttingDown,
                            ValidationError)
from runtime.device.executor import MAX_ERROR_CHARS, graph_runner, run_batch
from runtime.api.model import ModelAPI, check_model
from runtime.device.oom import Attempt, SizeGovernor

log = logging.getLogger("batchscope.engine")

#: rejection and expiry events are folded into at most one per this many seconds
EVENT_INTERVAL_S = 1.0
#: CPU batches expected to take at most this long run on the event loop's thread (0: never).
#: Off by default: a model slower than its history would then block the loop.
INLINE_MAX_COMPUTE_MS = 0.0
#: the longest the event loop waits for the device thread to pick up a batch
HANDOFF_WAIT_S = 0.002
#: with the device process, the most batches of one model sent to it at once (one
#: running, the next waiting in its pipe; see ``Engine._worker_ahead``)
MAX_AHEAD_BATCHES = 2


class _Waker:
    """Lets a worker sleep until woken or until a timeout, without ``wait_for``."""

    __slots__ = ("_loop", "_fut")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._fut: asyncio.Future | None = None

    async def wait(self, timeout_s: float | None) -> None:
        fut = self._loop.create_future()
        self._fut = fut
        timer = None if timeout_s is None else self._loop.call_later(max(0.0, timeout_s), self.wake)
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


class CallbackOutcome:
    """Stands where a request's future would: hands its one outcome to a callback."""

    __slots__ = ("_fn", "_done")

    def __init__(self, fn: Callable[[Any, BaseException | None], None]) -> None:
        self._fn = fn
        self._done = False

    def done(self) -> bool:
        return self._done

    def cancelled(self) -> bool:
        return False

    def set_result(self, result: Any) -> None:
        self._finish(result, None)

    def set_exception(self, error: BaseException) -> None:
        self._finish(None, error)

    def _finish(self, result: Any, error: BaseException | None) -> None:
        if self._done:
            return
        self._done = True
        try:
            self._fn(result, error)
        except Exception:  # the answer path must not break the batch that settles it
            log.exception("a request's completion callback failed")


class _Throttle:
    """Counts occurrences and says when to report them (at most once per interval)."""

    __slots__ = ("interval_s", "_last", "_pending")

    def __init__(self, interval_s: float = EVENT_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self._last = -math.inf
        self._pending = 0

    def hit(self, now: float, n: int = 1) -> int:
        """Returns how many occurrences to report now (0: stay quiet)."""
        self._pending += n
        if now - self._last < self.interval_s:
            return 0
        self._last = now
        out, self._pending = self._pending, 0
        return out


class _Slot:
    """Everything the engine keeps per model."""

    def __init__(self, name: str, model: ModelAPI, config: BatchingConfig,
                 event_interval_s: float) -> None:
        self.name = name
        self.model = model
        self.variable = bool(model.variable_length)
        self.batcher = Batcher(name, config, variable_length=self.variable)
        self.version = 1
        self.governor = SizeGovernor(config.max_batch_size, config.oom_probe_after_batches)
        self.waker: _Waker | None = None
        self.task: asyncio.Task | None = None
        self.ready = False
        self.closing = False
        self.in_flight = 0
        #: batches on the device, oldest first, with the futures that settle when each is back
        self.running: list[tuple[Batch, asyncio.Future]] = []
        #: whether this model's worker holds the arbiter's device turn (device process only)
        self.holds_turn = False
        #: batches back from the device process whose device time the arbiter has not
        #: been told yet, and that time
        self.unreported = 0
        self.unreported_s = 0.0
        #: finished batches whose requests still wait for their answers
        self.finished: list[tuple[Batch, list[Attempt], list[int]]] = []
        #: CUDA-graph runner (device thread only), made when cuda_graphs is on, per max size
        self.graphs: Any = None
        self.batches = 0
        self.requests = 0
        self.outcomes: dict[str, int] = {}
        self.oom_events = 0
        self.rejections = _Throttle(event_interval_s)
        self.expiries = _Throttle(event_interval_s)

    def bucket_keys(self) -> list[int | None]:
        cfg = self.batcher.config
        if not (self.variable and cfg.bucketing):
            return [None]
        return [*cfg.bucket_edges, -1]


class Engine:
    """Serves several request/response models on one device (see docs/architecture.md)."""

    def __init__(self, models: dict[str, ModelAPI], configs: dict[str, BatchingConfig] | None = None,
                 *, recorder: RecorderLike | None = None, instance_id: str = "local",
                 clock: MonotonicClock | None = None, device: torch.device | str = "cpu",
                 event_interval_s: float = EVENT_INTERVAL_S,
                 inline_max_compute_ms: float = INLINE_MAX_COMPUTE_MS,
                 device_process: bool = False, model_specs: Sequence[str] = ()) -> None:
        """``event_interval_s``: rejection and expiry events of a model are folded into at
        most one per this many seconds (each carries the count); request rows are not.
        ``inline_max_compute_ms``: on a CPU device, a batch expected (from recent batches)
        to take at most this long runs on the event loop's thread instead of the device
        thread; 0 turns that off.
        ``device_process``: run batches in a child process that loads every served model
        from ``model_specs`` (``runtime.models.loader`` specs, e.g. ``mlp`` or
        ``path/file.py:Class``) and calls ``setup(device)`` there; the models given here
        then only ``decode`` (and ``length``) requests and are never set up."""
        configs = dict(configs or {})
        unknown = sorted(set(configs) - set(models))
        if unknown:
            raise ConfigError(f"settings given for unknown model(s) {unknown}; served models are "
                              f"{sorted(models)}")
        if not models:
            raise ConfigError("no models to serve; pass at least one model")
        self._slots: dict[str, _Slot] = {}
        for name, model in models.items():
            check_model(model)
            if model.kind != "request":
                raise ConfigError(f"model {name!r} is a {model.kind!r} model; this engine serves "
                                  "request/response models only, serve it with the generation engine")
            self._slots[name] = _Slot(name, model, configs.get(name) or BatchingConfig(),
                                      event_interval_s)
        self.instance_id = instance_id
        self.device = torch.device(device)
        self._clock = clock or MonotonicClock()
        self._recorder: RecorderLike = recorder if recorder is not None else ListRecorder(keep=False)
        self._put_many = put_many_of(self._recorder)
        self._request_batches = bool(getattr(self._recorder, "accepts_request_batches", False))
        self._arbiter = FairArbiter()
        self._grants: dict[str, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._executor: ThreadPoolExecutor | None = None
        if not (isinstance(inline_max_compute_ms, (int, float)) and inline_max_compute_ms >= 0):
            raise ConfigError(f"inline_max_compute_ms={inline_max_compute_ms!r} must be a "
                              "non-negative number of milliseconds (0 = never inline)")
        self._inline_max_s = inline_max_compute_ms / 1000.0
        if device_process and not model_specs:
            raise ConfigError("device_process=True needs model_specs: the device process loads "
                              "each model from its spec (e.g. 'mlp' or 'path/file.py:MyModel')")
        self._use_process = bool(device_process)
        self._model_specs = tuple(model_specs)
        self._process: DeviceProcess | None = None
        #: released by the device thread when it starts a batch (see ``_execute``)
        self._handoff = threading.Lock()
        self._stopping = False
        self._batch_seq = 0
        self.on_settings_change: list[Callable[[str, int, BatchingConfig], None]] = []

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Set up every model (in the device thread) and start one worker per model."""
        if self._loop is not None:
            raise RuntimeError("the engine is already started")
        loop = asyncio.get_running_loop()
        self._loop = loop
        if self._use_process:
            await self._start_process()
        else:
            await self._setup_in_thread(loop)
        for slot in self._slots.values():
            slot.waker = _Waker(loop)
            slot.ready = True
        for slot in self._slots.values():
            work = self._worker_ahead(slot) if self._process is not None else self._worker(slot)
            slot.task = loop.create_task(work, name=f"batchscope-worker-{slot.name}")

    async def _setup_in_thread(self, loop: asyncio.AbstractEventLoop) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchscope-device")
        for slot in self._slots.values():
            try:
                await loop.run_in_executor(self._executor, slot.model.setup, self.device)
            except Exception:
                log.exception("setup of model %r on %s failed", slot.name, self.device)
                self._executor.shutdown(wait=False)
                raise

    async def _start_process(self) -> None:
        process = DeviceProcess(self._model_specs, list(self._slots), str(self.device),
                                torch_threads=torch.get_num_threads(), clock=self._clock,
                                on_exit=self._device_process_exited)
        await process.start()
        self._process = process

    def _device_process_exited(self, message: str) -> None:
        self._event(None, self._clock.now(), "model_error", message, "error",
                    device_process_restarts=self._process.restarts if self._process else 0)

    async def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Refuse new work, run what is queued for up to ``drain_timeout_s``, then answer
        whatever could not run with ``ShuttingDown``."""
        if self._stopping:
            return
        self._stopping = True
        loop = self._loop
        if loop is None:
            return
        deadline = loop.time() + max(0.0, drain_timeout_s)
        for slot in self._slots.values():
            slot.ready = False
            slot.closing = True
            slot.batcher.start_draining()
            if slot.waker is not None:
                slot.waker.wake()
        tasks = [s.task for s in self._slots.values() if s.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for slot in self._slots.values():
            self._answer_finished(slot)
        now = self._clock.now()
        for slot in self._slots.values():
            for req in slot.batcher.drain_all():
                self._settle(slot, req, now, "cancelled", error=ShuttingDown(
                    "the server shut down before this request could run; send it again "
                    "to a running instance"))
        running = [done for s in self._slots.values() for _, done in s.running]
        if running:
            await asyncio.wait(running, timeout=max(1.0, deadline - loop.time()))
        for slot in self._slots.values():
            self._answer_finished(slot)
        now = self._clock.now()
        for slot in self._slots.values():
            for batch, _ in slot.running:
                for req in batch.requests:
                    self._settle(slot, req, now, "cancelled", error=ShuttingDown(
                        "the server shut down while this request was running; its result "
                        "was lost, send it again to a running instance"))
        if self._executor is not None:
            self._executor.shutdown(wait=False)
        if self._process is not None:
            await self._process.stop()

    # -- requests -----------------------------------------------------------------------
    def _admit(self, model: str, inputs: dict[str, np.ndarray], priority: int | None,
               timeout_ms: float | None, bypass: bool, outcome: Any) -> PendingRequest:
        """Check and queue one request whose answer goes to ``outcome`` (a future, or
        anything with ``done/set_result/set_exception``). Raises before queueing."""
        slot = self._slots.get(model)
        if slot is None:
            raise ModelNotFound(f"model {model!r} is not served here; served models are "
                                f"{sorted(self._slots)}")
        if self._stopping:
            raise ShuttingDown("the server is shutting down and accepts no new requests; "
                               "retry on another instance")
        if not slot.ready:
            raise ModelNotReady(f"model {model!r} is still loading; retry in a moment")
        api = slot.model
        try:
            item = api.decode(inputs)
            length = int(api.length(item)) if slot.variable else 1
        except BatchScopeError:
            raise
        except Exception as exc:
            raise ClientError(f"could not read the inputs of model {model!r}: "
                              f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]) from None
        if slot.variable and api.max_length is not None and length > api.max_length:
            raise ValidationError(f"input of length {length} is longer than model {model!r} "
                                  f"accepts (max_length={api.max_length}); shorten it")
        batcher = slot.batcher
        cfg = batcher.config
        if priority is None:
            priority = cfg.default_priority
        elif not isinstance(priority, int) or isinstance(priority, bool):
            raise ValidationError(f"priority={priority!r} must be an integer from 0 (most urgent) "
                                  f"to {cfg.priority_levels - 1}")
        if timeout_ms is None:
            timeout_ms = cfg.default_timeout_ms
        elif (isinstance(timeout_ms, bool) or not isinstance(timeout_ms, (int, float))
              or not timeout_ms > 0 or not math.isfinite(timeout_ms)):
            raise ValidationError(f"timeout_ms={timeout_ms!r} must be a positive number of milliseconds")
        now = self._clock.now()
        req = PendingRequest(item, length=length, priority=priority,
                             bypass=bool(bypass) and cfg.allow_bypass, arrived_s=now,
                             deadline_s=None if timeout_ms is None else now + timeout_ms / 1000.0,
                             future=outcome)
        try:
            wake = batcher.submit(req, now)
        except QueueFull:
            self._rejected(slot, req, now)
            raise
        if wake:
            slot.waker.wake()
        return req

    async def infer(self, model: str, inputs: dict[str, np.ndarray], *, priority: int | None = None,
                    timeout_ms: float | None = None, bypass: bool = False) -> dict[str, np.ndarray]:
        fut = (self._loop or asyncio.get_running_loop()).create_future()
        req = self._admit(model, inputs, priority, timeout_ms, bypass, fut)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.cancelled():
                self._slots[model].batcher.cancel(req)
                self._record_request(self._slots[model], req, self._clock.now(), "cancelled",
                                     None, None)
            raise

    def submit(self, model: str, inputs: dict[str, np.ndarray], priority: int | None,
               timeout_ms: float | None, bypass: bool,
               on_done: Callable[[Any, BaseException | None], None]) -> None:
        """``infer`` without a coroutine: the same checks and errors (raised here, before
        anything is queued); an accepted request's outcome arrives exactly once as
        ``on_done(result, None)`` or ``on_done(None, error)``, called on the loop while its
        batch settles. ``on_done`` must not raise (what it raises is logged and dropped)."""
        self._admit(model, inputs, priority, timeout_ms, bypass, CallbackOutcome(on_done))

    # -- outcomes -----------------------------------------------------------------------
    def _record_request(self, slot: _Slot, req: PendingRequest, now: float, outcome: str,
                        started_s: float | None, batch_seq: int | None) -> None:
        slot.requests += 1
        slot.outcomes[outcome] = slot.outcomes.get(outcome, 0) + 1
        to_wall = self._clock.to_wall
        arrived = req.arrived_s
        self._recorder.put(RequestRow(
            self.instance_id, slot.name, batch_seq, req.priority, to_wall(arrived), to_wall(now),
            (started_s if started_s is not None else now) - arrived, now - arrived, outcome,
            req.bypass, req.length if slot.variable else None))

    def _settle(self, slot: _Slot, req: PendingRequest, now: float, outcome: str, *,
                result: Any = None, error: BaseException | None = None,
                started_s: float | None = None, batch_seq: int | None = None) -> None:
        """Give a request its one outcome (no-op if it already has one)."""
        fut = req.future
        if fut.done():
            return
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)
        self._record_request(slot, req, now, outcome, started_s, batch_seq)

    def _event(self, model: str | None, now: float, kind: str, message: str,
               severity: str = "info", **details: Any) -> None:
        self._recorder.put(EventRow(self.instance_id, model, self._clock.to_wall(now), kind, message,
                                    severity, json.dumps(details, default=str)))

    def _rejected(self, slot: _Slot, req: PendingRequest, now: float) -> None:
        self._record_request(slot, req, now, "rejected", None, None)
        count = slot.rejections.hit(now)
        if count:
            cfg = slot.batcher.config
            self._event(slot.name, now, "rejected",
                        f"{count} request(s) refused: queue of {slot.name!r} is full "
                        f"(max_queue_size={cfg.max_queue_size})", "warning",
                        count=count, queue_depth=slot.batcher.depth,
                        max_queue_size=cfg.max_queue_size)

    def _expired(self, slot: _Slot, reqs: list[PendingRequest], now: float) -> None:
        for req in reqs:
            waited_ms = (now - req.arrived_s) * 1000.0
            timeout_ms = ((req.deadline_s or now) - req.arrived_s) * 1000.0
            self._settle(slot, req, now, "expired", error=RequestExpired(
                f"the request waited {waited_ms:.0f} ms in the queue of model {slot.name!r}, past "
                f"its timeout of {timeout_ms:.0f} ms, and was not run; raise timeout_ms or "
                "send less load"))
        count = slot.expiries.hit(now, len(reqs))
        if count:
            self._event(slot.name, now, "expired",
                        f"{count} request(s) expired in the queue of {slot.name!r}", "warning",
                        count=count, queue_depth=slot.batcher.depth)

    # -- the worker ---------------------------------------------------------------------
    async def _worker(self, slot: _Slot) -> None:
        """Dispatch loop of one model. The answers of a finished batch are handed out
        right after the next batch went to the device (or before the worker waits), so
        the device does not sit idle while a batch's responses are written."""
        batcher = slot.batcher
        while True:
            try:
                now = self._expire_now(slot)
                if slot.closing and not batcher.depth:
                    self._answer_finished(slot)
                    return
                due = batcher.due_at(now)
                if due is None or due > now:
                    self._answer_finished(slot)
                    wake_at = batcher.next_wakeup(now)
                    await slot.waker.wait(None if wake_at is None else wake_at - now)
                    continue
                if not self._arbiter.request(slot.name, urgent=batcher.has_bypass()):
                    self._answer_finished(slot)
                    await self._acquire(slot.name)
                device_s = 0.0
                try:
                    now = self._expire_now(slot)
                    batch = batcher.next_batch(now)
                    if batch is not None:
                        device_s = await self._execute(slot, batch)
                    else:
                        self._answer_finished(slot)
                finally:
                    self._release(slot.name, device_s)
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug in the engine: keep serving, say so loudly
                log.exception("the worker of model %r hit an unexpected error", slot.name)
                self._answer_finished(slot)
                await asyncio.sleep(0.01)

    def _expire_now(self, slot: _Slot) -> float:
        """Settle the slot's queued requests that are past their deadline; the time now."""
        now = self._clock.now()
        expired = slot.batcher.expire(now)
        if expired:
            self._expired(slot, expired, now)
        return now

    async def _acquire(self, name: str) -> None:
        """Wait for the device turn the arbiter did not grant at once."""
        fut = self._loop.create_future()
        self._grants[name] = fut
        try:
            await fut
        except asyncio.CancelledError:
            self._grants.pop(name, None)
            if self._arbiter.holder == name:
                self._release(name, 0.0)
            else:
                self._arbiter.withdraw(name)
            raise

    def _release(self, name: str, device_s: float) -> None:
        nxt = self._arbiter.release(name, device_s)
        while nxt is not None:
            fut = self._grants.pop(nxt, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
                return
            # that worker was cancelled while waiting: pass its turn on
            nxt = self._arbiter.release(nxt, 0.0)

    # -- the worker with the device process ---------------------------------------------
    async def _worker_ahead(self, slot: _Slot) -> None:
        """Dispatch loop of one model whose batches run in the device process.

        Like ``_worker``, but it need not wait for a batch to come back before it sends
        the next: when the queue already holds a full batch (every bucket with requests
        holds the bucket's effective max batch size, no bypass request waits), that
        batch goes to the child while the running one is still there, and the child
        starts it the moment it finishes the first (it runs its pipe in order) instead
        of idling while this loop answers one batch and forms the next. Partial batches
        wait until nothing of the model runs, so batches do not shrink; at most
        ``MAX_AHEAD_BATCHES`` batches are in flight.

        Device turns: a batch is sent under the arbiter's grant; a second one rides on
        the grant of the running one only while no other model waits for the device.
        The grant is given back when a batch comes back, with that batch's device time
        (a batch that comes back while the model does not hold the device is counted
        at its next turn, or at once if the device is free)."""
        batcher = slot.batcher
        arbiter = self._arbiter
        name = slot.name
        try:
            while True:
                try:
                    now = self._expire_now(slot)
                    if slot.unreported:
                        if slot.holds_turn:
                            self._give_back_turn(slot)
                        elif arbiter.holder is None and not arbiter.waiting:
                            arbiter.request(name)
                            slot.holds_turn = True
                            self._give_back_turn(slot)
                    if slot.closing and not batcher.depth:
                        self._answer_finished(slot)
                        return
                    running = len(slot.running)
                    if running >= MAX_AHEAD_BATCHES:
                        due = False
                    elif running:
                        due = (self._full_batch_waiting(slot)
                               and not (slot.holds_turn and arbiter.waiting))
                    else:
                        due_at = batcher.due_at(now)
                        due = due_at is not None and due_at <= now
                    if not due:
                        self._answer_finished(slot)
                        if running:  # a batch coming back wakes the worker
                            await slot.waker.wait(None)
                        else:
                            wake_at = batcher.next_wakeup(now)
                            await slot.waker.wait(None if wake_at is None else wake_at - now)
                        continue
                    if not slot.holds_turn:
                        if not arbiter.request(name, urgent=batcher.has_bypass()):
                            self._answer_finished(slot)
                            await self._acquire(name)
                        slot.holds_turn = True
                    now = self._expire_now(slot)
                    batch = batcher.next_batch(now, model_busy=bool(slot.running))
                    if batch is not None:
                        self._send_to_process(slot, batch)
                    elif not slot.running:
                        self._give_back_turn(slot)
                    self._answer_finished(slot)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug in the engine: keep serving, say so loudly
                    log.exception("the worker of model %r hit an unexpected error", name)
                    self._answer_finished(slot)
                    await asyncio.sleep(0.01)
        finally:
            if slot.holds_turn:
                self._give_back_turn(slot)

    def _full_batch_waiting(self, slot: _Slot) -> bool:
        """Whether the next batch the batcher forms is sure to be full: no bypass request
        waits, and every bucket with requests holds at least its effective max."""
        batcher = slot.batcher
        if not batcher.depth or batcher.has_bypass():
            return False
        cap = batcher.cap
        return all(n >= cap(key) for key, n in batcher.depth_by_bucket().items() if n)

    def _give_back_turn(self, slot: _Slot) -> None:
        """Release the device turn the slot holds, with the device time not yet told."""
        device_s = slot.unreported_s
        slot.unreported = 0
        slot.unreported_s = 0.0
        slot.holds_turn = False
        self._release(slot.name, device_s)

    def _send_to_process(self, slot: _Slot, batch: Batch) -> None:
        done = self._loop.create_future()
        slot.running.append((batch, done))
        slot.in_flight += len(batch.requests)
        reqs = batch.requests

        def back(attempts: list[Attempt]) -> None:
            slot.unreported += 1
            slot.unreported_s += sum(a.compute_s for a in attempts)
            self._finish_batch(slot, batch, attempts, done)
            if slot.name in self._grants:  # the worker waits for a turn: answer now
                self._answer_finished(slot)
            slot.waker.wake()

        self._process.submit(
            slot.name, batch.config, batch.settings_version, [r.item for r in reqs],
            [r.length for r in reqs] if slot.variable else None, batch.pad_to, batch.bucket,
            back)

    async def _execute(self, slot: _Slot, batch: Batch) -> float:
        done = self._loop.create_future()
        slot.in_flight = len(batch.requests)
        slot.running.append((batch, done))
        if self._runs_inline(slot, batch):
            # Short CPU batch: run it right here. Handing it to the device thread would
            # cost more than it saves: the thread needs the GIL the busy loop holds.
            self._answer_finished(slot)
            self._run_in_thread(slot, batch, done)
            return await asyncio.shield(done)
        gate = self._handoff
        gate.acquire(blocking=False)  # closed (it may have been left open by a late start)
        self._executor.submit(self._run_in_thread, slot, batch, done)
        # Let the device thread take the GIL and start now: a busy event loop would
        # otherwise keep it waiting for as long as the loop stays busy.
        gate.acquire(timeout=HANDOFF_WAIT_S)
        self._answer_finished(slot)
        # shielded: if the worker is cancelled at shutdown, stop() still waits for this
        return await asyncio.shield(done)

    def _runs_inline(self, slot: _Slot, batch: Batch) -> bool:
        """Whether this batch runs on the event loop's thread: CPU only, and only when the
        recent device time per request says it takes at most ``inline_max_compute_ms``."""
        if not self._inline_max_s or self.device.type != "cpu":
            return False
        per_request = slot.batcher.mean_compute_per_request_s
        return per_request is not None and per_request * len(batch.requests) <= self._inline_max_s

    # -- in the device thread -----------------------------------------------------------
    def _run_in_thread(self, slot: _Slot, batch: Batch, done: asyncio.Future) -> None:
        """Run a batch and hand its outcome to the loop (on the device thread, or on the
        loop itself for a short CPU batch; see ``_runs_inline``)."""
        try:
            self._handoff.release()
        except RuntimeError:  # already open: the loop gave up waiting
            pass
        try:
            attempts = self._run_batch(slot, batch)
        except BaseException as exc:  # noqa: BLE001 - every request must still get an answer
            now = self._clock.now()
            attempts = [Attempt(0, len(batch.requests), "error", now, now, 0.0,
                                error=f"{type(exc).__name__}: {exc}",
                                trace=traceback.format_exc())]
        try:
            self._loop.call_soon_threadsafe(self._finish_batch, slot, batch, attempts, done)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    def _run_batch(self, slot: _Slot, batch: Batch) -> list[Attempt]:
        reqs = batch.requests
        return run_batch(slot.model, [r.item for r in reqs],
                         [r.length for r in reqs] if slot.variable else None, batch.pad_to,
                         batch.bucket, batch.config, slot.variable, self.device, self._clock,
                         lambda cfg: self._graph_runner(slot, cfg))

    def _graph_runner(self, slot: _Slot, cfg: BatchingConfig) -> Any:
        """The slot's CUDA-graph runner for the current max batch size (device thread)."""
        slot.graphs = graph_runner(slot.graphs, slot.model, self.device, cfg.max_batch_size)
        return slot.graphs

    # -- back on the loop ---------------------------------------------------------------
    def _finish_batch(self, slot: _Slot, batch: Batch, attempts: list[Attempt],
                      done: asyncio.Future) -> None:
        """Book a finished batch (records, events, OOM governor, batcher) and wake its
        worker; its requests are answered by ``_answer_finished``."""
        now = self._clock.now()
        device_s = 0.0
        had_oom = False
        seqs = []
        for a in attempts:
            device_s += a.compute_s
            seq = self._record_batch(slot, batch, a)
            seqs.append(seq)
            if a.outcome == "oom":
                had_oom = True
                self._oom_event(slot, batch, a, seq, now)
            elif a.outcome == "error":
                self._model_error(slot, a, seq, now)
        if not had_oom and all(a.outcome == "ok" for a in attempts):
            probed = slot.governor.on_success(batch.bucket)
            if probed is not None:
                self._apply_caps(slot)
                self._event(slot.name, now, "oom_probe",
                            f"{slot.name!r}: no out-of-memory in {slot.governor.probe_after_batches} "
                            f"batches; effective max batch size back up to {probed}",
                            bucket=batch.bucket, effective_max_batch_size=probed)
        slot.batcher.complete(batch, now, device_s)
        slot.finished.append((batch, attempts, seqs))
        running = slot.running
        if len(running) == 1 and running[0][1] is done:
            running.clear()
            slot.in_flight = 0
        else:
            running[:] = [entry for entry in running if entry[1] is not done]
            slot.in_flight = sum(len(b.requests) for b, _ in running)
        if not done.done():
            done.set_result(device_s)

    def _answer_finished(self, slot: _Slot) -> None:
        """Give every request of the slot's finished batches its outcome."""
        finished = slot.finished
        if not finished:
            return
        slot.finished = []
        now = self._clock.now()
        for batch, attempts, seqs in finished:
            reqs = batch.requests
            for a, seq in zip(attempts, seqs):
                if a.split:
                    continue
                if a.outcome == "ok":
                    self._answer_ok(slot, reqs, a, seq, now)
                elif a.outcome == "oom":
                    for i in range(a.start, a.stop):
                        self._settle(slot, reqs[i], now, "oom",
                                     error=self._oom_error(slot, reqs[i], a),
                                     started_s=a.started_s, batch_seq=seq)
                else:
                    for i in range(a.start, a.stop):
                        self._settle(slot, reqs[i], now, "error", error=ModelError(
                            f"model {slot.name!r} failed on a batch of {a.size}: {a.error}"),
                            started_s=a.started_s, batch_seq=seq)

    def _answer_ok(self, slot: _Slot, reqs: list[PendingRequest], a: Attempt, seq: int,
                   now: float) -> None:
        """``_settle`` of a successful attempt's requests, unrolled for speed."""
        outputs = a.outputs
        start = a.start
        started = a.started_s
        priorities: list[int] = []
        arrived: list[float] = []
        bypass: list[bool] = []
        lengths: list[int] | None = [] if slot.variable else None
        for i in range(start, a.stop):
            req = reqs[i]
            fut = req.future
            if fut.done():
                continue
            fut.set_result(outputs[i - start])
            priorities.append(req.priority)
            arrived.append(req.arrived_s)
            bypass.append(req.bypass)
            if lengths is not None:
                lengths.append(req.length)
        answered = len(arrived)
        if answered:
            block = RequestBatch(self.instance_id, slot.name, seq, "ok", started, now,
                                 self._clock.to_wall(0.0), priorities, arrived, bypass, lengths)
            if self._request_batches:
                self._recorder.put(block)
            else:
                self._put_many(block.rows())
        slot.requests += answered
        slot.outcomes["ok"] = slot.outcomes.get("ok", 0) + answered

    def _record_batch(self, slot: _Slot, batch: Batch, a: Attempt) -> int:
        self._batch_seq += 1
        seq = self._batch_seq
        slot.batches += 1
        reqs = batch.requests
        if a.size == len(reqs):
            part, real, padded = reqs, batch.real_elements, batch.padded_elements
        else:
            part = reqs[a.start:a.stop]
            real = sum(r.length for r in part)
            pad = pad_length([r.length for r in part], batch.bucket, batch.config, slot.variable)
            padded = real if pad is None else pad * len(part)
        start = a.started_s
        arrived = [r.arrived_s for r in part]
        to_wall = self._clock.to_wall
        cfg = batch.config
        self._recorder.put(BatchRow(
            self.instance_id, slot.name, seq, cfg.policy, batch.settings_version,
            cfg.max_batch_size, batch.bucket, len(part), real, padded,
            start - max(arrived), start - sum(arrived) / len(arrived), start - min(arrived),
            a.compute_s, to_wall(a.started_s), to_wall(a.ended_s), a.outcome,
            a.peak_memory_bytes, a.cuda_graph, batch.queue_depth))
        return seq

    def _oom_error(self, slot: _Slot, req: PendingRequest, a: Attempt) -> OutOfMemory:
        if a.size == 1:
            what = f"of length {req.length} " if slot.variable else ""
            return OutOfMemory(f"this request {what}does not fit in the memory of model "
                               f"{slot.name!r} even alone ({a.error}); send a smaller input")
        return OutOfMemory(f"model {slot.name!r} ran out of memory on a batch of {a.size} and "
                           f"oom_recovery is off ({a.error}); turn oom_recovery on or lower "
                           "max_batch_size")

    def _oom_event(self, slot: _Slot, batch: Batch, a: Attempt, seq: int, now: float) -> None:
        slot.oom_events += 1
        bucket = batch.bucket
        if a.split:
            first = (a.size + 1) // 2
            cap = slot.governor.on_oom(bucket, a.size, slot.bucket_keys())
            self._apply_caps(slot)
            action = (f"split into 2 batches of {first}/{a.size - first}; effective max batch "
                      f"size now {cap}")
            kind, severity = "oom", "error"
        else:
            cap = slot.governor.limit(bucket)
            action = ("a single request does not fit even alone; it failed with 507"
                      if a.size == 1 else "oom_recovery is off; the batch failed with 507")
            kind, severity = "oom_failed", "error"
        self._event(slot.name, now, kind,
                    f"{slot.name!r} ran out of memory on a batch of {a.size}: {action}", severity,
                    batch_size=a.size, bucket=bucket, batch_seq=seq, error=a.error,
                    memory=a.memory, action=action, effective_max_batch_size=cap)

    def _model_error(self, slot: _Slot, a: Attempt, seq: int, now: float) -> None:
        log.error("model %r raised on a batch of %d (batch %d):\n%s", slot.name, a.size, seq,
                  a.trace or a.error)
        self._event(slot.name, now, "model_error",
                    f"{slot.name!r} failed on a batch of {a.size}: {a.error}", "error",
                    batch_size=a.size, batch_seq=seq, error=a.error)

    def _apply_caps(self, slot: _Slot) -> None:
        gov = slot.governor
        for key in slot.bucket_keys():
            cap = gov.limit(key)
            slot.batcher.set_size_cap(key, cap if cap < gov.configured_max else None)

    # -- settings -----------------------------------------------------------------------
    def get_settings(self, model: str) -> tuple[int, BatchingConfig]:
        slot = self._slot(model)
        return slot.version, slot.batcher.config

    def update_settings(self, model: str, changes: dict, requested_by: str) -> tuple[int, BatchingConfig]:
        """Validate and apply ``changes`` (ConfigError: nothing changes); they take effect
        at the next batch boundary."""
        slot = self._slot(model)
        old = slot.batcher.config
        new = old.with_changes(changes)
        slot.version += 1
        version = slot.version
        slot.batcher.set_config(new, version)
        if (old.bucketing, old.bucket_edges) != (new.bucketing, new.bucket_edges):
            slot.governor = SizeGovernor(new.max_batch_size, new.oom_probe_after_batches)
        else:
            slot.governor.reconfigure(new.max_batch_size, new.oom_probe_after_batches)
        for key in set(slot.bucket_keys()) | {None, *old.bucket_edges, -1}:
            slot.batcher.set_size_cap(key, None)
        self._apply_caps(slot)
        self._event(model, self._clock.now(), "settings_change",
                    f"{model!r} settings v{version}: " + ", ".join(
                        f"{k}={v!r}" for k, v in changes.items()),
                    old=old.to_dict(), new=new.to_dict(), changes=changes,
                    requested_by=requested_by, version=version)
        for listener in list(self.on_settings_change):
            try:
                listener(model, version, new)
            except Exception:  # a listener must not undo an applied change
                log.exception("a settings listener failed for model %r", model)
        if slot.waker is not None:
            slot.waker.wake()
        return version, new

    # -- introspection ------------------------------------------------------------------
    def _slot(self, name: str) -> _Slot:
        slot = self._slots.get(name)
        if slot is None:
            raise ModelNotFound(f"model {name!r} is not served here; served models are "
                                f"{sorted(self._slots)}")
        return slot

    def model_names(self) -> list[str]:
        return list(self._slots)

    def model(self, name: str) -> ModelAPI:
        return self._slot(name).model

    def is_ready(self, name: str | None = None) -> bool:
        if name is None:
            return all(s.ready for s in self._slots.values())
        slot = self._slots.get(name)
        return slot is not None and slot.ready

    def stats(self, model: str) -> dict:
        """A JSON-ready snapshot of one model's queue, batches and device share."""
        slot = self._slot(model)
        batcher = slot.batcher
        by_bucket = {("all" if k is None else str(k)): batcher.cap(k) for k in slot.bucket_keys()}
        window = batcher.window_s()
        return {
            "queue_depth": batcher.depth,
            "queue_depth_by_priority": {str(p): n for p, n in batcher.depth_by_priority().items()},
            "queue_depth_by_bucket": {("all" if k is None else str(k)): n
                                      for k, n in batcher.depth_by_bucket().items()},
            "in_flight": slot.in_flight,
            "effective_max_batch_size": min(by_bucket.values()),
            "effective_max_batch_size_by_bucket": by_bucket,
            "batches": slot.batches,
            "requests": slot.requests,
            "requests_by_outcome": dict(slot.outcomes),
            "oom_events": slot.oom_events,
            "device_time_s": self._arbiter.device_s.get(model, 0.0),
            "device_grants": self._arbiter.grants.get(model, 0),
            "mean_batch_compute_s": batcher.mean_compute_s,
            "batching_window_ms": None if window is None else window * 1000.0,
            "settings_version": slot.version,
            "ready": slot.ready,
            "cuda_graphs": slot.graphs.stats() if slot.graphs is not None else None,
        }
