"""``Booking``: what a batch's run means for the records, the governor and its requests.

When a batch comes back from the device it is a list of ``Attempt`` s (one, or
several when out-of-memory or a model error split it; see
``runtime.device.oom.run_splitting``). Booking turns them into:

* one ``BatchRow`` per attempt that ran, numbered in the order they are booked (a
  ``refused`` attempt, a batch of a model stuck in an earlier one, never ran and has
  none);
* an ``EventRow`` for each out-of-memory attempt (``oom`` when it was split,
  ``oom_failed`` when it could not be), one ``model_error`` per batch the model
  raised on (however many attempts isolating the bad requests took), one
  ``model_timeout`` per batch that ran past ``execution_timeout_ms`` and each probe
  of the effective max back up (``oom_probe``);
* the ``SizeGovernor`` update and the batcher's size caps that follow from it;
* the model's ``InferenceTotals``: each request's outcome with its latency and queue
  time, each batch that ran without error by its size with its compute time (what
  the Triton statistics report);
* the timestamps of a traced request (``PendingRequest.trace``, see
  ``runtime.engine.tracing``): queued, its batch's compute start, inputs ready, outputs
  taken and end, and its outcome, stamped just before it is answered; a plain trace
  (a list, ``runtime.core.tracing.plain_trace``) gets only its queue start and its
  batch's number, and the traced members of a batch go to ``on_plain_traces``
  together, once answered, with the times they share held once;
* every request's one outcome: its result, ``OutOfMemory`` (507), ``ModelError``
  (500: "failed on this request" when it failed alone), ``ModelTimedOut`` (503) or
  ``ModelNotReady`` (503, a stuck model), with one ``RequestRow`` each (a
  ``RequestBatch`` block for a successful attempt when the recorder takes them).

Model errors reach the log through a ``FailureLog``: per model at most one full
traceback every ``TRACEBACK_INTERVAL_S``, the failures in between folded into at
most one summary line a second, so a model that fails on every request cannot
flood the log. The events keep every failure.

It books the other outcomes too (rejected, expired, cancelled), with rejection and
expiry events folded to at most one per interval, and writes the engine's other
events. Synchronous and clock-injected, it runs on the event loop's thread in the
engine and under a fake clock in tests. A batch is booked in two steps so that the
dispatch loop can send the next batch in between::

    booked = booking.batch_back(model, batch, attempts, now)  # records, events, governor
    ...                                                      # the next batch goes out
    booking.answer(model, booked, now)                       # the requests' outcomes
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any, Callable

from batchscope.storage.records import (BatchRow, EventRow, ListRecorder, RecorderLike,
                                        RequestBatch, RequestRow, declared_shapes, put_many_of,
                                        shapes_json, timeout_of)
from runtime.api.errors import (BatchLost, BatchScopeError, ModelError, ModelNotReady, ModelTimedOut,
                                OutOfMemory, RequestExpired)
from runtime.core.batcher import TIMEOUT_HOW, Batch, ms_text, pad_length
from runtime.core.request import PendingRequest
from runtime.core.tracing import PLAIN_BATCH_SEQ, PLAIN_REQUEST_START, settled, span_of
from runtime.device.oom import Attempt
from runtime.device.timeouts import FLOOR_S, MULTIPLE
from runtime.engine.otel_spans import BatchInfo
from runtime.engine.served import ServedModel

log = logging.getLogger("batchscope.engine")

#: a model's full traceback goes to the log at most once per this many seconds
TRACEBACK_INTERVAL_S = 10.0
#: the failures between two tracebacks are told in one line per this many seconds at most
SUMMARY_INTERVAL_S = 1.0
#: a client told that a model timed out or is stuck may retry after this long
RETRY_AFTER_STUCK_S = 1.0


def _limit(config: Any, a: Attempt) -> str:
    """The execution timeout a ``timeout`` attempt ran past, in words."""
    ceiling = config.execution_timeout_ms
    if a.timeout_s is None or ceiling is None or abs(a.timeout_s * 1000.0 - ceiling) < 1e-6:
        return f"execution_timeout_ms={_ms(ceiling)}"
    return (f"its execution timeout of {_ms(a.timeout_s * 1000.0)} ms (execution_timeout_auto: "
            f"{MULTIPLE:g} x its recent p99 batch time, at least {FLOOR_S:g} s; "
            f"execution_timeout_ms={_ms(ceiling)} is the ceiling)")


def _ms(value: float | None) -> str:
    return "null" if value is None else f"{value:g}"


class FailureLog:
    """Model failures in the log without flooding it: per model, one full traceback
    per ``trace_interval_s`` at most; each failure in between is counted and told
    in a one-line summary, at most one per ``summary_interval_s``. Time is passed in."""

    def __init__(self, trace_interval_s: float = TRACEBACK_INTERVAL_S,
                 summary_interval_s: float = SUMMARY_INTERVAL_S) -> None:
        self.trace_interval_s = trace_interval_s
        self.summary_interval_s = summary_interval_s
        #: model -> [last traceback at, last summary at, failures since the traceback,
        #: failures since the last line]
        self._state: dict[str, list] = {}

    def failed(self, model: str, now: float, what: str, trace: str | None) -> None:
        """Log one failure of ``model``: ``what`` in one line, and ``trace`` when due."""
        state = self._state.get(model)
        if state is None:
            state = self._state[model] = [-math.inf, -math.inf, 0, 0]
        if now - state[0] >= self.trace_interval_s:
            since = state[2]
            more = f" ({since} more failure(s) since its last traceback)" if since else ""
            if trace:
                log.error("%s%s\n%s", what, more, trace.rstrip())
            else:
                log.error("%s%s", what, more)
            state[:] = [now, now, 0, 0]
            return
        state[2] += 1
        state[3] += 1
        if now - state[1] >= self.summary_interval_s:
            log.error("%s [%d failure(s) of model %r since the last line; a full traceback "
                      "is logged at most every %g s]", what, state[3], model,
                      self.trace_interval_s)
            state[1] = now
            state[3] = 0


@dataclass(slots=True)
class BookedBatch:
    """A batch whose run is recorded but whose requests are not answered yet."""

    batch: Batch
    attempts: list[Attempt]
    #: the batch number of each attempt's ``BatchRow`` (None: a refused attempt has none)
    seqs: list[int | None]
    #: device time of all its attempts
    device_s: float


class Booking:
    """Records and outcomes of every model of one engine."""

    def __init__(self, recorder: RecorderLike | None, instance_id: str, clock: Any) -> None:
        self.instance_id = instance_id
        self.clock = clock
        self.recorder: RecorderLike = recorder if recorder is not None else ListRecorder(keep=False)
        self._put_many = put_many_of(self.recorder)
        self._request_batches = bool(getattr(self.recorder, "accepts_request_batches", False))
        #: the number of the last ``BatchRow``, across models
        self.batch_seq = 0
        self.failures = FailureLog()
        #: given each batch with a member whose spans are exported
        #: (``runtime.engine.otel.OtlpSpans.batch``); None: nobody asks
        self.on_traced_batch: Callable[[BatchInfo], None] | None = None
        #: given the plain traces of each batch that answered some (a
        #: ``batchscope.storage.records.PLAIN_BATCH_FIELDS`` tuple;
        #: ``runtime.engine.tracing.Tracer.plain_batch``); None: they are not recorded
        self.on_plain_traces: Callable[[tuple], None] | None = None
        #: model name -> its declared input shapes (see ``_shapes_of``)
        self._declared: dict[str, tuple] = {}

    def reserve(self) -> int:
        """A new batch id (``BatchRow.seq``): the first attempt of a batch sent to the
        device gets the one reserved for it then; a split's other attempts new ones."""
        self.batch_seq += 1
        return self.batch_seq

    # -- a batch back from the device ---------------------------------------------------
    def batch_back(self, model: ServedModel, batch: Batch, attempts: list[Attempt],
                   now: float) -> BookedBatch:
        """Record the batch's attempts, report what went wrong and move the governor."""
        plan = batch.adapters
        if plan is not None and plan.changes:
            self._slot_events(model.name, plan.changes)
        device_s = 0.0
        clean = True
        errors = False
        seqs: list = []
        for a in attempts:
            device_s += a.compute_s
            outcome = a.outcome
            if outcome == "refused":  # never ran: no batch row
                seqs.append(None)
                clean = False
                continue
            seq, real, padded = self._record_batch(model, batch, a)
            seqs.append(seq)
            if a.compile_s or a.compile_error:
                self._compile_event(model, batch, a, seq, now)
            if outcome == "ok":
                totals = model.counts.inference
                totals.executions += 1
                totals.real_elements += real
                totals.padded_elements += padded
                by_size = totals.by_batch_size.get(a.size)
                if by_size is None:
                    totals.by_batch_size[a.size] = [1, a.compute_s, a.input_s, a.output_s]
                else:
                    by_size[0] += 1
                    by_size[1] += a.compute_s
                    by_size[2] += a.input_s
                    by_size[3] += a.output_s
                continue
            clean = False
            if outcome == "oom":
                self._oom_event(model, batch, a, seq, now)
            elif outcome == "timeout":
                self._timeout_event(model, batch, a, seq, now)
            else:
                errors = True
        if errors:
            self._model_error(model, attempts, seqs, now)
        if clean:
            probed = model.governor.on_success(batch.bucket)
            if probed is not None:
                model.apply_caps()
                self.event(model.name, now, "oom_probe",
                           f"{model.name!r}: no out-of-memory in "
                           f"{model.governor.probe_after_batches} batches; effective max batch "
                           f"size back up to {probed}",
                           bucket=batch.bucket, effective_max_batch_size=probed)
        return BookedBatch(batch, attempts, seqs, device_s)

    def answer(self, model: ServedModel, booked: BookedBatch, now: float) -> None:
        """Give every request of a booked batch its outcome: that of the last attempt
        covering it that was not split."""
        reqs = booked.batch.requests
        for a, seq in zip(booked.attempts, booked.seqs):
            if a.split:
                continue
            outcome = a.outcome
            if outcome == "ok":
                self._answer_ok(model, reqs, a, seq, now, booked.batch.adapters)
            elif outcome == "oom":
                for i in range(a.start, a.stop):
                    self.settle(model, reqs[i], now, "oom",
                                error=self._oom_error(model, reqs[i], a),
                                started_s=a.started_s, batch_seq=seq)
            else:
                error = self._failure(model, booked.batch, a)
                for i in range(a.start, a.stop):
                    self.settle(model, reqs[i], now, "error", error=error,
                                started_s=a.started_s, batch_seq=seq)

    @staticmethod
    def _failure(model: ServedModel, batch: Batch, a: Attempt) -> BatchScopeError:
        """The error the requests of a failed attempt (not ok, not OOM) are answered with."""
        name = model.name
        if a.outcome == "timeout":
            return ModelTimedOut(
                f"model {name!r} took longer than {_limit(batch.config, a)} on a batch of "
                f"{a.size}; {a.error}", retry_after_s=RETRY_AFTER_STUCK_S)
        if a.outcome == "refused":
            return ModelNotReady(a.error or f"model {name!r} is not ready; retry later",
                                 retry_after_s=RETRY_AFTER_STUCK_S)
        if a.outcome == "lost":
            return BatchLost(f"model {name!r}: {a.error}", retry_after_s=RETRY_AFTER_STUCK_S)
        if a.size == 1:
            return ModelError(f"model {name!r} failed on this request: {a.error}")
        return ModelError(f"model {name!r} failed on a batch of {a.size}: {a.error}")

    def _answer_ok(self, model: ServedModel, reqs: list[PendingRequest], a: Attempt, seq: int,
                   now: float, batch_adapters: object = None) -> None:
        """``settle`` of a successful attempt's requests, unrolled for speed."""
        outputs = a.outputs
        start = a.start
        priorities: list[int] = []
        arrived: list[float] = []
        bypass: list[bool] = []
        deadlines: list[float | None] = []
        lengths: list[int] | None = [] if model.variable else None
        adapters: list[str | None] | None = [] if batch_adapters is not None else None
        plain: list[tuple] | None = None
        for i in range(start, a.stop):
            req = reqs[i]
            fut = req.future
            if fut.done():
                continue
            trace = req.trace
            if trace is None:
                fut.set_result(outputs[i - start])
            elif type(trace) is list:  # plain: its answer reads the batch, stamps sending
                trace[PLAIN_REQUEST_START] = req.arrived_s
                trace[PLAIN_BATCH_SEQ] = seq
                fut.set_result(outputs[i - start])
                if plain is None:
                    plain = []
                # its values as a tuple: one the garbage collector soon stops tracking,
                # and that the writer's process unpickles in half a list's time
                plain.append(tuple(trace))
            else:  # stamped before the answer goes out
                ended = a.ended_s
                trace.ran(req.arrived_s, a.started_s, a.started_s + a.input_s,
                          ended - a.output_s, ended, seq, now, "ok")
                fut.set_result(outputs[i - start])
            priorities.append(req.priority)
            arrived.append(req.arrived_s)
            bypass.append(req.bypass)
            deadlines.append(req.deadline_s)
            if lengths is not None:
                lengths.append(req.length)
            if adapters is not None:
                adapters.append(req.adapter)
        answered = len(arrived)
        if plain is not None and self.on_plain_traces is not None:
            ended = a.ended_s
            self.on_plain_traces((model.name, "http", "ok", seq, a.started_s,
                                  a.started_s + a.input_s, ended - a.output_s, ended, now,
                                  plain))
        if answered:
            block = RequestBatch(self.instance_id, model.name, seq, "ok", a.started_s, now,
                                 self.clock.to_wall(0.0), priorities, arrived, bypass, lengths,
                                 deadlines, self._shapes_of(model), adapters)
            if self._request_batches:
                self.recorder.put(block)
            else:
                self._put_many(block.rows())
        counts = model.counts
        counts.requests += answered
        counts.outcomes["ok"] = counts.outcomes.get("ok", 0) + answered
        counts.window.add_ok(now, arrived)  # autopilot: latency window
        if answered:
            totals = counts.inference
            arrived_s = sum(arrived)
            totals.success += answered
            totals.success_s += answered * now - arrived_s
            totals.queue_s += answered * a.started_s - arrived_s
            totals.compute_s += answered * a.compute_s
            totals.input_s += answered * a.input_s
            totals.output_s += answered * a.output_s
            totals.last_success_at = self.clock.to_wall(now)

    def _record_batch(self, model: ServedModel, batch: Batch,
                      a: Attempt) -> tuple[int, int, int]:
        """Record one attempt's batch row: (its number, real elements, padded elements)."""
        seq = batch.seq
        if seq is None:  # not reserved, or taken by an earlier attempt of the batch
            seq = self.reserve()
        else:
            batch.seq = None
        model.counts.batches += 1
        reqs = batch.requests
        if a.size == len(reqs):
            part, real, padded = reqs, batch.real_elements, batch.padded_elements
        else:
            part = reqs[a.start:a.stop]
            real = sum(r.length for r in part)
            pad = pad_length([r.length for r in part], batch.bucket, batch.config, model.variable)
            padded = real if pad is None else pad * len(part)
        start = a.started_s
        arrived = [r.arrived_s for r in part]
        to_wall = self.clock.to_wall
        cfg = batch.config
        self.recorder.put(BatchRow(
            self.instance_id, model.name, seq, cfg.policy, batch.settings_version,
            cfg.max_batch_size, batch.bucket, len(part), real, padded,
            start - max(arrived), start - sum(arrived) / len(arrived), start - min(arrived),
            a.compute_s, to_wall(a.started_s), to_wall(a.ended_s), a.outcome,
            a.peak_memory_bytes, a.cuda_graph, batch.queue_depth, a.peak_memory_increase_bytes,
            None if model.batcher.slots is None else len({r.adapter for r in part} - {None})))
        hook = self.on_traced_batch
        if hook is not None and any(r.trace is not None and span_of(r.trace) is not None
                                    for r in part):  # a member whose spans are exported
            hook(BatchInfo(seq, model.name, to_wall(a.started_s), to_wall(a.ended_s), len(part),
                           cfg.max_batch_size, padded, real, batch.bucket, cfg.policy,
                           batch.settings_version, a.outcome))
        return seq, real, padded

    def _compile_event(self, model: ServedModel, batch: Batch, a: Attempt, seq: int,
                       now: float) -> None:
        mode = batch.config.compile
        if a.compile_error:
            self.event(model.name, now, "compile_failed",
                       f"{model.name!r}: torch.compile (mode {mode}) failed, the model runs "
                       f"eagerly: {a.compile_error}", "warning", mode=mode, error=a.compile_error,
                       compile_s=round(a.compile_s, 3), batch_seq=seq)
            return
        self.event(model.name, now, "compile",
                   f"{model.name!r}: torch.compile (mode {mode}) compiled for {a.compile_s:.1f} s",
                   mode=mode, compile_s=round(a.compile_s, 3), batch_seq=seq,
                   batch_size=a.size, padded_length=batch.pad_to)

    # -- what went wrong ----------------------------------------------------------------
    def _oom_error(self, model: ServedModel, req: PendingRequest, a: Attempt) -> OutOfMemory:
        if a.size == 1:
            what = f"of length {req.length} " if model.variable else ""
            return OutOfMemory(f"this request {what}does not fit in the memory of model "
                               f"{model.name!r} even alone ({a.error}); send a smaller input")
        return OutOfMemory(f"model {model.name!r} ran out of memory on a batch of {a.size} and "
                           f"oom_recovery is off ({a.error}); turn oom_recovery on or lower "
                           "max_batch_size")

    def _oom_event(self, model: ServedModel, batch: Batch, a: Attempt, seq: int,
                   now: float) -> None:
        model.counts.oom_events += 1
        bucket = batch.bucket
        if a.split:
            first = (a.size + 1) // 2
            cap = model.governor.on_oom(bucket, a.size, model.bucket_keys())
            model.apply_caps()
            action = (f"split into 2 batches of {first}/{a.size - first}; effective max batch "
                      f"size now {cap}")
            kind = "oom"
        else:
            cap = model.governor.limit(bucket)
            action = ("a single request does not fit even alone; it failed with 507"
                      if a.size == 1 else "oom_recovery is off; the batch failed with 507")
            kind = "oom_failed"
        self.event(model.name, now, kind,
                   f"{model.name!r} ran out of memory on a batch of {a.size}: {action}", "error",
                   batch_size=a.size, bucket=bucket, batch_seq=seq, error=a.error,
                   memory=a.memory, action=action, effective_max_batch_size=cap)

    def _model_error(self, model: ServedModel, attempts: list[Attempt], seqs: list,
                     now: float) -> None:
        """One event (and one rate-limited log entry) for a batch the model raised on,
        however many attempts isolating the requests it fails on took."""
        first = first_seq = None
        failed = []
        isolated = False
        for a, seq in zip(attempts, seqs):
            if a.outcome not in ("error", "lost"):
                continue
            if first is None:
                first, first_seq = a, seq
            if a.split:
                isolated = True
            else:
                failed.append(a)
        name = model.name
        culprit = failed[0] if failed else first
        failed_requests = sum(a.size for a in failed)
        if not isolated:
            message = f"{name!r} failed on a batch of {first.size}: {first.error}"
        elif failed:
            message = (f"{name!r} failed on {failed_requests} of the {first.size} request(s) "
                       f"of a batch, isolated in {len(attempts)} attempts: {culprit.error}")
        else:
            message = (f"{name!r} failed on a batch of {first.size}, but on none of its "
                       f"requests when retried in parts: {first.error}")
        self.failures.failed(name, now, f"model {message} (batch {first_seq})",
                             culprit.trace)
        self.event(name, now, "model_error", message, "error",
                   batch_size=first.size, batch_seq=first_seq, error=culprit.error,
                   failed_requests=failed_requests, attempts=len(attempts), isolated=isolated)

    def _timeout_event(self, model: ServedModel, batch: Batch, a: Attempt, seq: int,
                       now: float) -> None:
        limit = batch.config.execution_timeout_ms
        message = (f"{model.name!r} ran a batch of {a.size} for {a.compute_s:.1f} s, past "
                   f"{_limit(batch.config, a)}; {a.error}")
        log.error("model %s", message)
        self.event(model.name, now, "model_timeout", message, "error",
                   batch_size=a.size, batch_seq=seq, execution_timeout_ms=limit,
                   ran_s=a.compute_s, action=a.error)

    # -- outcomes that are not a batch's ------------------------------------------------
    def settle(self, model: ServedModel, req: PendingRequest, now: float, outcome: str, *,
               result: Any = None, error: BaseException | None = None,
               started_s: float | None = None, batch_seq: int | None = None) -> None:
        """Give a request its one outcome and its row (no-op if it already has one)."""
        fut = req.future
        if fut.done():
            return
        if req.trace is not None:
            settled(req.trace, req.arrived_s, now, outcome, started_s, batch_seq)
        if error is None:
            fut.set_result(result)
        else:
            fut.set_exception(error)
        self.record_request(model, req, now, outcome, started_s, batch_seq)

    def record_request(self, model: ServedModel, req: PendingRequest, now: float, outcome: str,
                       started_s: float | None = None, batch_seq: int | None = None) -> None:
        """Count and record one request's outcome (its future is the caller's business)."""
        counts = model.counts
        counts.requests += 1
        counts.outcomes[outcome] = counts.outcomes.get(outcome, 0) + 1
        counts.window.add_request(outcome, now, req.arrived_s)  # autopilot: latency window
        to_wall = self.clock.to_wall
        arrived = req.arrived_s
        totals = counts.inference
        if outcome == "ok":
            totals.success += 1
            totals.success_s += now - arrived
            totals.queue_s += (started_s if started_s is not None else now) - arrived
            totals.last_success_at = to_wall(now)
        else:
            totals.fail += 1
            totals.fail_s += now - arrived
        length = req.length if model.variable else None
        self.recorder.put(RequestRow(
            self.instance_id, model.name, batch_seq, req.priority, to_wall(arrived), to_wall(now),
            (started_s if started_s is not None else now) - arrived, now - arrived, outcome,
            req.bypass, length, input_shape_json=shapes_json(self._shapes_of(model), length),
            timeout_ms=timeout_of(req.deadline_s, arrived), adapter=req.adapter))

    def _shapes_of(self, model: ServedModel) -> tuple:
        """The model's declared input shapes (``declared_shapes``), worked out once."""
        shapes = self._declared.get(model.name)
        if shapes is None:
            shapes = self._declared[model.name] = declared_shapes(model.api.inputs)
        return shapes

    def rejected(self, model: ServedModel, req: PendingRequest, now: float) -> None:
        """A request refused because the queue is full (the caller raises ``QueueFull``)."""
        self.record_request(model, req, now, "rejected")
        count = model.counts.rejections.hit(now)
        if count:
            cfg = model.config
            self.event(model.name, now, "rejected",
                       f"{count} request(s) refused: queue of {model.name!r} is full "
                       f"(max_queue_size={cfg.max_queue_size})", "warning",
                       count=count, queue_depth=model.batcher.depth,
                       max_queue_size=cfg.max_queue_size)

    def expired(self, model: ServedModel, reqs: list[PendingRequest], now: float) -> None:
        """Requests whose deadline passed in the queue, or whose batch could not have ended
        before it: ``RequestExpired``, never run."""
        for req in reqs:
            waited_ms = (now - req.arrived_s) * 1000.0
            deadline = req.deadline_s if req.deadline_s is not None else now
            timeout_ms = (deadline - req.arrived_s) * 1000.0
            why = (f"past its timeout of {ms_text(timeout_ms)} ms" if now >= deadline else
                   "and its batch could not have ended within its timeout of "
                   f"{ms_text(timeout_ms)} ms")
            self.settle(model, req, now, "expired", error=RequestExpired(
                f"the request waited {ms_text(waited_ms)} ms in the queue of model "
                f"{model.name!r}, {why}, and was not run; give it a longer timeout "
                f"({TIMEOUT_HOW}) or send less load"))
        count = model.counts.expiries.hit(now, len(reqs))
        if count:
            self.event(model.name, now, "expired",
                       f"{count} request(s) expired in the queue of {model.name!r}", "warning",
                       count=count, queue_depth=model.batcher.depth)

    def _slot_events(self, model: str, changes: list) -> None:
        """An ``adapter_load`` event per adapter the batch put in a slot (and an
        ``adapter_evict`` for the one it replaced), at the time the batch was formed."""
        for change in changes:
            if change.evicted is not None:
                self.event(model, change.at_s, "adapter_evict",
                           f"adapter {change.evicted!r} left slot {change.slot} for "
                           f"{change.name!r} (least recently used)", adapter=change.evicted,
                           slot=change.slot, reason="lru", replaced_by=change.name)
            self.event(model, change.at_s, "adapter_load",
                       f"adapter {change.name!r} loaded into slot {change.slot}",
                       adapter=change.name, slot=change.slot, evicted=change.evicted)

    def event(self, model: str | None, now: float, kind: str, message: str,
              severity: str = "info", **details: Any) -> None:
        self.recorder.put(EventRow(self.instance_id, model, self.clock.to_wall(now), kind,
                                   message, severity, json.dumps(details, default=str)))
