"""``Engine``: the asyncio facade of the request engine.

It serves several request/response models on one device and ties together the
parts of ``runtime.engine``, each a module of its own:

    served.py      ServedModel: one model's batcher, governor and counts
    admission.py   the priority and timeout checks (shared with generation)
    dispatch.py    Dispatcher: one model's dispatch loop, batches out and back
    turns.py       DeviceTurns: whose batch goes to the device next (FairArbiter)
    executors.py   where batches run: the device thread or the device process
    booking.py     Booking: records, events, governor and outcomes of a batch
    tracing.py     Tracer: Triton's trace settings, which requests are traced, their records
    outcomes.py    CallbackOutcome, ItemsOutcome: a request's outcome handed to a callback
    adapter_ops.py EngineAdapters: listing, loading and unloading a model's LoRA adapters

A request is checked and queued here (``infer``/``submit``); a request of several
items (a client-side batch) is checked once and queued as one ``PendingRequest`` per
item (``infer_items``/``submit_items``), answered once when every item is back. Its
model's dispatch loop forms the batch, runs it where the executor puts it and hands
the result to booking. Batches run off the event loop, in the single device thread (collate,
predict and split under ``torch.inference_mode()``, see
``runtime.device.executor.run_batch``), or with ``device_process=True`` in child
processes with their own interpreter lock (``runtime.device.process``), one per model,
each loading its model from ``model_specs`` and restarted on its own: a model that
hangs or crashes stops no other. Every accepted request gets exactly one outcome and one
``RequestRow``; every executed batch (and every out-of-memory attempt) one
``BatchRow``; notable things an ``EventRow``.

All public methods are to be called on the event loop's thread.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from typing import Any, Callable, Sequence

import numpy as np
import torch

from batchscope.storage.records import RecorderLike
from runtime.api.config import MAX_REQUEST_ITEMS, BatchingConfig
from runtime.api.errors import (BatchScopeError, ClientError, ConfigError, ModelNotFound,
                                ModelNotReady, QueueFull, ShuttingDown, ValidationError)
from runtime.api.model import ModelAPI, check_model
from runtime.core.arbiter import FairArbiter
from runtime.core.clock import MonotonicClock
from runtime.core.request import PendingRequest
from runtime.device.executor import MAX_ERROR_CHARS
from runtime.device.priority import LoopBound, RequestTally
from runtime.device.process import DEVICE_NICE_CPU, DeviceProcess
from runtime.engine.admission import deadline_of, priority_of
from runtime.engine.adapter_ops import EngineAdapters
from runtime.engine.booking import Booking
from runtime.engine.direct import DIRECT_MAX_COMPUTE_MS, DirectLane
from runtime.engine.dispatch import Dispatcher
from runtime.engine.executors import (HANDOFF_WAIT_S, MAX_AHEAD_BATCHES, DeviceThread,
                                      ProcessExecutor)
from runtime.engine.outcomes import CallbackOutcome, ItemsOutcome
from runtime.engine.served import EVENT_INTERVAL_S, InferenceTotals, ServedModel
from runtime.engine.tracing import Tracer
from runtime.engine.turns import DeviceTurns

__all__ = ["Engine", "CallbackOutcome", "ItemsOutcome", "EVENT_INTERVAL_S",
           "INLINE_MAX_COMPUTE_MS", "MAX_REQUEST_ITEMS", "HANDOFF_WAIT_S", "MAX_AHEAD_BATCHES"]

log = logging.getLogger("batchscope.engine")

#: CPU batches expected to take at most this long run on the event loop's thread (0: never).
#: Off by default: a model slower than its history would then block the loop.
INLINE_MAX_COMPUTE_MS = 0.0



class DeviceProcesses:
    """The device processes of an engine, started and stopped together; each restarts
    on its own (``DeviceProcess``)."""

    def __init__(self, processes: list[DeviceProcess]) -> None:
        self.processes = processes

    async def start(self) -> None:
        await asyncio.gather(*(p.start() for p in self.processes))

    async def stop(self) -> None:
        await asyncio.gather(*(p.stop() for p in self.processes))


def _process_groups(names: list[str], specs: list[str]) -> list[tuple[list[str], list[str]]]:
    """(model names, their specs) per device process: one process per model when every
    model's spec can be told (a spec ``NAME=target`` names its model; the others follow
    the models in order), else one process for all of them."""
    by_name: dict[str, str] = {}
    rest: list[str] = []
    for spec in specs:
        head, sep, _ = spec.partition("=")
        if sep and ":" not in head and "/" not in head and head in names:
            by_name[head] = spec
        else:
            rest.append(spec)
    unnamed = [n for n in names if n not in by_name]
    if len(unnamed) != len(rest):
        return [(names, specs)]
    by_name.update(zip(unnamed, rest))
    return [([name], [by_name[name]]) for name in names]


class Engine(EngineAdapters):
    """Serves several request/response models on one device (see docs/architecture.md)."""

    def __init__(self, models: dict[str, ModelAPI], configs: dict[str, BatchingConfig] | None = None,
                 *, recorder: RecorderLike | None = None, instance_id: str = "local",
                 clock: MonotonicClock | None = None, device: torch.device | str = "cpu",
                 event_interval_s: float = EVENT_INTERVAL_S,
                 inline_max_compute_ms: float = INLINE_MAX_COMPUTE_MS,
                 device_process: bool = False, model_specs: Sequence[str] = (),
                 direct_max_compute_ms: float = DIRECT_MAX_COMPUTE_MS,
                 device_nice: int | None = None) -> None:
        """``event_interval_s``: rejection and expiry events of a model are folded into at
        most one per this many seconds (each carries the count); request rows are not.
        ``inline_max_compute_ms``: on a CPU device, a batch expected (from recent batches)
        to take at most this long runs on the event loop's thread instead of the device
        thread; 0 turns that off.
        ``device_process``: run batches in child processes, one per model, that load the
        served models from ``model_specs`` (``runtime.models.loader`` specs, e.g. ``mlp`` or
        ``path/file.py:Class``) and calls ``setup(device)`` there; the models given here
        then only ``decode`` (and ``length``) requests and are never set up.
        ``direct_max_compute_ms``: with the device process on a CPU device, a batch that
        finds its process idle and is expected to take at most this long runs in this
        process instead (``runtime.engine.direct``; the models are then set up here too);
        0 turns that off.
        ``device_nice``: how many levels nicer than this process the device processes
        run; None: the same, and on a CPU device ``DEVICE_NICE_CPU`` nicer once the
        event loop is measured to cost more per request than the model
        (``runtime.device.priority``)."""
        configs = dict(configs or {})
        unknown = sorted(set(configs) - set(models))
        if unknown:
            raise ConfigError(f"settings given for unknown model(s) {unknown}; served models are "
                              f"{sorted(models)}")
        for name, model in models.items():
            check_model(model)
            if model.kind != "request":
                raise ConfigError(f"model {name!r} is a {model.kind!r} model; this engine serves "
                                  "request/response models only, serve it with the generation engine")
        if not (isinstance(inline_max_compute_ms, (int, float)) and inline_max_compute_ms >= 0):
            raise ConfigError(f"inline_max_compute_ms={inline_max_compute_ms!r} must be a "
                              "non-negative number of milliseconds (0 = never inline)")
        if not (isinstance(direct_max_compute_ms, (int, float)) and direct_max_compute_ms >= 0):
            raise ConfigError(f"direct_max_compute_ms={direct_max_compute_ms!r} must be a "
                              "non-negative number of milliseconds (0 = never direct)")
        if device_process and not model_specs:
            raise ConfigError("device_process=True needs model_specs: the device process loads "
                              "each model from its spec (e.g. 'mlp' or 'path/file.py:MyModel')")
        self.instance_id = instance_id
        self.device = torch.device(device)
        self._clock = clock or MonotonicClock()
        self._models: dict[str, ServedModel] = {
            name: ServedModel(name, model, configs.get(name) or BatchingConfig(), event_interval_s)
            for name, model in models.items()}
        self._booking = Booking(recorder, instance_id, self._clock)
        #: Triton's trace settings of the models and the traces' records
        #: (``runtime.engine.tracing``)
        self.tracer = Tracer(self._models, self._booking.recorder, instance_id, self._clock)
        self._booking.on_plain_traces = self.tracer.plain_batch
        self._arbiter = FairArbiter()
        served = list(self._models.values())
        #: the child processes batches run in (``device_process=True``): one per model,
        #: so a model that hangs or crashes stops no other; else empty
        self._processes: dict[str, DeviceProcess] = {}
        #: per device process on the CPU, when it goes nicer than the event loop
        #: (``runtime.device.priority``); empty when its priority is fixed
        self._priorities: dict[DeviceProcess, LoopBound] = {}
        self._lanes: list[DirectLane] = []
        #: requests offered to the engine, refused or not (``runtime.device.priority``)
        self._tally = RequestTally()
        if device_process:
            tally = self._tally
            adaptive = device_nice is None and self.device.type == "cpu"
            bounds = self._priorities
            for names, specs in _process_groups(list(self._models), list(model_specs)):
                process = DeviceProcess(
                    tuple(specs), names, str(self.device),
                    torch_threads=torch.get_num_threads(), clock=self._clock,
                    on_exit=functools.partial(self._device_process_exited, names),
                    nice=device_nice or 0)
                self._processes.update((name, process) for name in names)
                if adaptive:
                    bounds[process] = LoopBound(DEVICE_NICE_CPU, tally)
            self._backend: DeviceProcesses | DeviceThread = DeviceProcesses(
                list(dict.fromkeys(self._processes.values())))
            #: each model's direct lane (CPU only; none when direct_max_compute_ms is 0)
            self._lanes = [DirectLane(m, self.device, self._clock, direct_max_compute_ms / 1000.0)
                           for m in served] if self.device.type == "cpu" and \
                direct_max_compute_ms > 0 else []
            lanes = {lane.model.name: lane for lane in self._lanes}
            executors = [ProcessExecutor(self._processes[m.name], m, lanes.get(m.name),
                                         bounds.get(self._processes[m.name]))
                         for m in served]
        else:
            thread = DeviceThread(served, self.device, self._clock, inline_max_compute_ms / 1000.0)
            self._backend = thread
            executors = [thread.executor(m) for m in served]
        turns = DeviceTurns(self._arbiter)
        self._dispatchers: dict[str, Dispatcher] = {
            m.name: Dispatcher(m, ex, turns, self._booking, self._clock)
            for m, ex in zip(served, executors)}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = False
        self._stopping = False
        self.on_settings_change: list[Callable[[str, int, BatchingConfig], None]] = []
        #: told the model's name after an adapter was registered or unloaded
        self.on_adapters_change: list[Callable[[str], None]] = []

    # -- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        """Set every model up (on the device thread, or in the device process) and start
        one dispatch loop per model."""
        if self._loop is not None:
            raise RuntimeError("the engine is already started")
        loop = asyncio.get_running_loop()
        self._loop = loop
        await asyncio.gather(self._backend.start(), self._start_lanes())
        self._ready = True
        for dispatcher in self._dispatchers.values():
            dispatcher.start(loop)

    async def _start_lanes(self) -> None:
        """The direct lanes' copies of their models, set up one after another: building a
        model may change process-wide state for a moment (transformers creates parameters
        on the meta device and patches ``torch.nn.init``), which a model built at the
        same time in another thread would inherit."""
        for lane in self._lanes:
            await lane.start()

    def _device_process_exited(self, names: list[str], message: str) -> None:
        process = self._processes[names[0]]
        self._booking.event(names[0] if len(names) == 1 else None, self._clock.now(),
                            "model_error", message, "error",
                            device_process_restarts=process.restarts, models=names)

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
        self._ready = False
        dispatchers = list(self._dispatchers.values())
        for d in dispatchers:
            d.close()
        tasks = [d.task for d in dispatchers if d.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline - loop.time()))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for d in dispatchers:
            d.answer()
        now = self._clock.now()
        for d in dispatchers:
            d.cancel_queued(now)
        out = [fut for fut in (d.all_back() for d in dispatchers) if fut is not None]
        if out:
            await asyncio.wait(out, timeout=max(1.0, deadline - loop.time()))
        for d in dispatchers:
            d.answer()
        now = self._clock.now()
        for d in dispatchers:
            d.cancel_running(now)
        await self._backend.stop()
        for lane in self._lanes:
            lane.close()
        self.tracer.flush()
        await asyncio.to_thread(self.tracer.close)

    # -- requests -----------------------------------------------------------------------
    def _open(self, model: str) -> ServedModel:
        """The served model a request may be queued for now, else the error refusing it."""
        served = self._models.get(model)
        if served is None:
            raise ModelNotFound(f"model {model!r} is not served here; served models are "
                                f"{sorted(self._models)}")
        if self._stopping:
            raise ShuttingDown("the server is shutting down and accepts no new requests; "
                               "retry on another instance")
        if not self._ready:
            raise ModelNotReady(f"model {model!r} is still loading; retry in a moment")
        return served

    @staticmethod
    def _decode(served: ServedModel, inputs: dict[str, np.ndarray]) -> tuple[Any, int]:
        """One request's (or item's) decoded item and its length; raises ClientError or
        ValidationError naming what is wrong."""
        api = served.api
        variable = served.variable
        try:
            item = api.decode(inputs)
            length = int(api.length(item)) if variable else 1
        except BatchScopeError:
            raise
        except Exception as exc:
            raise ClientError(f"could not read the inputs of model {served.name!r}: "
                              f"{type(exc).__name__}: {exc}"[:MAX_ERROR_CHARS]) from None
        if variable and api.max_length is not None and length > api.max_length:
            raise ValidationError(f"input of length {length} is longer than model "
                                  f"{served.name!r} accepts (max_length={api.max_length}); "
                                  "shorten it")
        return item, length

    def _admit(self, model: str, inputs: dict[str, np.ndarray], priority: int | None,
               timeout_ms: float | None, bypass: bool, outcome: Any,
               trace: Any = None, adapter: str | None = None) -> PendingRequest:
        """Check and queue one request whose answer goes to ``outcome`` (a future, or
        anything with ``done/set_result/set_exception``). Raises before queueing."""
        self._tally.n += 1  # refused or not: the loop's work per request counts it
        served = self._open(model)
        adapter = self._adapter_of(served, adapter)
        item, length = self._decode(served, inputs)
        batcher = served.batcher
        cfg = batcher.config
        priority = priority_of(priority, cfg)
        now = self._clock.now()
        req = PendingRequest(item, length=length, priority=priority,
                             bypass=bool(bypass) and cfg.allow_bypass, arrived_s=now,
                             deadline_s=deadline_of(timeout_ms, cfg, now), future=outcome,
                             trace=trace, adapter=adapter)
        try:
            wake = batcher.submit(req, now)
        except QueueFull:
            self._booking.rejected(served, req, now)
            raise
        dispatcher = self._dispatchers[model]
        deadline = req.deadline_s
        if deadline is not None and deadline < dispatcher.timer_at:
            dispatcher.watch_deadline(deadline)
        if wake:
            dispatcher.wake()
        return req

    def _admit_items(self, model: str, items: Sequence[dict[str, np.ndarray]],
                     priority: int | None, timeout_ms: float | None, bypass: bool,
                     on_done: Callable[[Any, BaseException | None], None],
                     trace: Any = None, adapter: str | None = None) -> ItemsOutcome:
        """Check and queue the items of one request, all or none: every item is decoded
        and the queue's room checked before the first is queued. Raises before queueing."""
        self._tally.n += len(items)
        served = self._open(model)
        adapter = self._adapter_of(served, adapter)
        batcher = served.batcher
        cfg = batcher.config
        n = len(items)
        most = min(cfg.max_queue_size, MAX_REQUEST_ITEMS)
        if not 1 <= n <= most:
            raise ValidationError(
                f"a request to model {model!r} holds {n} items; send 1 to {most} per request "
                f"(at most max_queue_size={cfg.max_queue_size} and {MAX_REQUEST_ITEMS}), "
                "splitting larger batches into several requests")
        decoded = [self._decode(served, inputs) for inputs in items]
        priority = priority_of(priority, cfg)
        now = self._clock.now()
        deadline = deadline_of(timeout_ms, cfg, now)
        bypass = bool(bypass) and cfg.allow_bypass
        group = ItemsOutcome(n, on_done)
        reqs = [PendingRequest(item, length=length, priority=priority, bypass=bypass,
                               arrived_s=now, deadline_s=deadline, future=group.slot(i),
                               trace=trace, adapter=adapter)
                for i, (item, length) in enumerate(decoded)]
        wake = False
        queued = 0
        try:
            room = cfg.max_queue_size - batcher.depth
            if n > room:
                raise QueueFull(
                    f"model {model!r} has {batcher.depth} requests waiting and room for "
                    f"{max(0, room)} more (max_queue_size={cfg.max_queue_size}); this request "
                    f"holds {n} items. Retry after about {batcher.retry_after_s():.2f}s, send "
                    "fewer items per request or raise max_queue_size",
                    retry_after_s=batcher.retry_after_s())
            for req in reqs:
                wake = batcher.submit(req, now) or wake
                queued += 1
        except QueueFull:
            for req in reqs[:queued]:
                batcher.cancel(req)
            for req in reqs:
                self._booking.rejected(served, req, now)
            raise
        group.withdraw = lambda: self._withdraw(served, reqs)
        dispatcher = self._dispatchers[model]
        if deadline is not None and deadline < dispatcher.timer_at:
            dispatcher.watch_deadline(deadline)
        if wake:
            dispatcher.wake()
        return group

    def _withdraw(self, served: ServedModel, reqs: list[PendingRequest]) -> None:
        """Take the still-queued items of a failed or abandoned request out of the queue;
        each is recorded as cancelled (items already in a batch run to their end)."""
        now = self._clock.now()
        batcher = served.batcher
        for req in reqs:
            if batcher.cancel(req):
                req.future.close()
                self._booking.record_request(served, req, now, "cancelled")

    def admission_refusal(self, model: str, *, book: bool = True) -> BatchScopeError | None:
        """The error any request to ``model`` would be refused with now, whatever it
        holds (``ShuttingDown``, ``ModelNotReady`` or ``QueueFull``), else None; O(1),
        no request needed, so a server can refuse before it reads or parses a body.
        None also for a model not served here (the full path says which ones are).

        ``QueueFull`` also when the queue would take longer to drain ahead of a request
        at the default priority than the longest timeout among recent requests and the
        model's ``default_timeout_ms`` (``Batcher.head_refusal``): the request's own
        ``timeout_ms`` is in its body, not read yet. Never while recent requests came
        without a timeout and the model has no default.

        A ``QueueFull`` returned with ``book=True`` is counted and recorded as a rejected
        request (a ``RequestRow`` at the model's default priority), as one that
        ``submit`` refuses; the caller must then answer it."""
        served = self._models.get(model)
        if served is None:
            return None
        if self._stopping:
            return ShuttingDown("the server is shutting down and accepts no new requests; "
                                "retry on another instance")
        if not self._ready:
            return ModelNotReady(f"model {model!r} is still loading; retry in a moment")
        batcher = served.batcher
        if batcher.is_full():
            error = batcher.queue_full()
        else:
            if batcher.drain_per_request_s is None:
                return None
            cfg = batcher.config
            timeout_ms = cfg.default_timeout_ms
            error = batcher.head_refusal(cfg.default_priority,
                                         None if timeout_ms is None else timeout_ms / 1000.0)
            if error is None:
                return None
        if book:
            now = self._clock.now()
            self._booking.rejected(served, PendingRequest(
                None, priority=batcher.config.default_priority, arrived_s=now), now)
        return error

    async def infer(self, model: str, inputs: dict[str, np.ndarray], *, priority: int | None = None,
                    timeout_ms: float | None = None, bypass: bool = False,
                    trace: Any = None, adapter: str | None = None) -> dict[str, np.ndarray]:
        """One request's outputs. ``trace``: its ``RequestTrace`` when it is traced
        (``runtime.engine.tracing``; the same for every entry point below): booking
        stamps its queue and compute times before answering."""
        fut = (self._loop or asyncio.get_running_loop()).create_future()
        req = self._admit(model, inputs, priority, timeout_ms, bypass, fut, trace, adapter)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.cancelled():
                served = self._models[model]
                served.batcher.cancel(req)
                self._booking.record_request(served, req, self._clock.now(), "cancelled")
            raise

    def submit(self, model: str, inputs: dict[str, np.ndarray], priority: int | None,
               timeout_ms: float | None, bypass: bool,
               on_done: Callable[[Any, BaseException | None], None], trace: Any = None,
               adapter: str | None = None) -> None:
        """``infer`` without a coroutine: the same checks and errors (raised here, before
        anything is queued); an accepted request's outcome arrives exactly once as
        ``on_done(result, None)`` or ``on_done(None, error)``, called on the loop while its
        batch settles. ``on_done`` must not raise (what it raises is logged and dropped)."""
        self._admit(model, inputs, priority, timeout_ms, bypass, CallbackOutcome(on_done), trace,
                    adapter)

    async def infer_items(self, model: str, items: Sequence[dict[str, np.ndarray]], *,
                          priority: int | None = None, timeout_ms: float | None = None,
                          bypass: bool = False, trace: Any = None,
                          adapter: str | None = None) -> list[dict[str, np.ndarray]]:
        """``infer`` for a request of several items (a client-side batch): each item is
        one request in the queue, batched with whatever else waits, and the answer is
        the items' results in order, or the one error the first failing item got.

        The same checks and errors as ``infer``, for every item before any is queued;
        also ``ValidationError`` for no items or more than the model's
        ``max_queue_size`` (or ``MAX_REQUEST_ITEMS``), and ``QueueFull`` when the queue
        has no room for all of them. Each item gets its own ``RequestRow``; items still
        queued when another fails (or the caller goes away) are withdrawn and recorded
        as cancelled."""
        fut = (self._loop or asyncio.get_running_loop()).create_future()

        def done(result: Any, error: BaseException | None) -> None:
            if fut.done():
                return
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)

        group = self._admit_items(model, items, priority, timeout_ms, bypass, done, trace,
                                  adapter)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.cancelled():
                group.abandon()
            raise

    def submit_items(self, model: str, items: Sequence[dict[str, np.ndarray]],
                     priority: int | None, timeout_ms: float | None, bypass: bool,
                     on_done: Callable[[Any, BaseException | None], None],
                     trace: Any = None, adapter: str | None = None) -> ItemsOutcome:
        """``infer_items`` without a coroutine, as ``submit`` is ``infer``'s: the checks
        raise here, before anything is queued; then exactly one ``on_done(results,
        None)`` or ``on_done(None, error)``. The returned outcome's ``abandon()``
        withdraws the request (no ``on_done`` follows)."""
        return self._admit_items(model, items, priority, timeout_ms, bypass, on_done, trace,
                                 adapter)

    # -- settings -----------------------------------------------------------------------
    def get_settings(self, model: str) -> tuple[int, BatchingConfig]:
        served = self._served(model)
        return served.settings_version, served.config

    def update_settings(self, model: str, changes: dict, requested_by: str) -> tuple[int, BatchingConfig]:
        """Validate and apply ``changes`` (ConfigError: nothing changes); they take effect
        at the next batch boundary."""
        version, old, new = self._served(model).apply_settings(changes)
        self._booking.event(model, self._clock.now(), "settings_change",
                            f"{model!r} settings v{version}: " + ", ".join(
                                f"{k}={v!r}" for k, v in changes.items()),
                            old=old.to_dict(), new=new.to_dict(), changes=changes,
                            requested_by=requested_by, version=version)
        for listener in list(self.on_settings_change):
            try:
                listener(model, version, new)
            except Exception:  # a listener must not undo an applied change
                log.exception("a settings listener failed for model %r", model)
        self._dispatchers[model].wake()
        return version, new

    # -- introspection ------------------------------------------------------------------
    def _served(self, name: str) -> ServedModel:
        served = self._models.get(name)
        if served is None:
            raise ModelNotFound(f"model {name!r} is not served here; served models are "
                                f"{sorted(self._models)}")
        return served

    def export_spans(self, spans: Any) -> None:
        """Send the traced requests' spans, and their batches', to ``spans`` (a
        ``runtime.engine.otel.OtlpSpans``; None: stop)."""
        self.tracer.otel = spans
        self._booking.on_traced_batch = None if spans is None else spans.batch

    def model_names(self) -> list[str]:
        return list(self._models)

    def model(self, name: str) -> ModelAPI:
        return self._served(name).api

    def is_ready(self, name: str | None = None) -> bool:
        return self._ready and (name is None or name in self._models)

    def inference_totals(self, model: str) -> InferenceTotals:
        """A copy of what ``model`` has served so far: requests by outcome with their
        summed latencies and queue times, batches by size with their compute time."""
        return self._served(model).counts.inference.copy()

    def outcome_window(self, model: str) -> Any:
        """The running latency and outcome figures the autopilot reads for ``model``
        (``runtime.autopilot.window.OutcomeWindow``)."""
        return self._served(model).counts.window

    def stats(self, model: str) -> dict:
        """A JSON-ready snapshot of one model's queue, batches and device share."""
        served = self._served(model)
        dispatcher = self._dispatchers[model]
        batcher = served.batcher
        counts = served.counts
        by_bucket = {("all" if k is None else str(k)): batcher.cap(k) for k in served.bucket_keys()}
        window = batcher.window_s()
        return {
            "queue_depth": batcher.depth,
            "queue_depth_by_priority": {str(p): n for p, n in batcher.depth_by_priority().items()},
            "queue_depth_by_bucket": {("all" if k is None else str(k)): n
                                      for k, n in batcher.depth_by_bucket().items()},
            "in_flight": dispatcher.in_flight,
            "effective_max_batch_size": min(by_bucket.values()),
            "effective_max_batch_size_by_bucket": by_bucket,
            "batches": counts.batches,
            "requests": counts.requests,
            "requests_by_outcome": dict(counts.outcomes),
            "oom_events": counts.oom_events,
            "device_time_s": self._arbiter.device_s.get(model, 0.0),
            "device_grants": self._arbiter.grants.get(model, 0),
            "mean_batch_compute_s": batcher.mean_compute_s,
            "bucket_edges": list(batcher.bucket_edges) if served.variable else None,
            "batching_window_ms": None if window is None else window * 1000.0,
            "settings_version": served.settings_version,
            "ready": self._ready,
            "cuda_graphs": dispatcher.executor.graph_stats(),
            #: batches run in the serving process, skipping the device process (None: no
            #: direct lane; ``runtime.engine.direct``)
            "direct_batches": getattr(getattr(dispatcher.executor, "direct", None), "batches",
                                      None),
            #: of those, the ones run on the lane's thread while the process was busy
            "direct_spills": getattr(getattr(dispatcher.executor, "direct", None), "spills",
                                     None),
            #: inputs a model cut to its length limit (models from files count them)
            "truncated_inputs": getattr(served.api, "truncated_inputs", None),
            #: the LoRA adapters and the slot cache (None: the model takes no adapters)
            "adapters": self._adapter_stats(served),
        }

    @staticmethod
    def _adapter_stats(served: ServedModel) -> dict | None:
        slots = served.batcher.slots
        if served.adapters is None or slots is None:
            return None
        return {"registered": served.adapters.names(), "slots": slots.capacity,
                "resident": len(slots.resident()), "slot_hits": slots.hits,
                "slot_misses": slots.loads, "slot_evictions": slots.evictions}

    def adapter_models(self) -> dict[str, list[str]]:
        """Model -> its registered adapters' names (those being unloaded included), for
        the models that take adapters."""
        return {name: [e.name for e in served.adapters.entries()]
                for name, served in self._models.items() if served.adapters is not None}
