"""``Booking``: what a batch's run means for the records, the governor and its requests.

When a batch comes back from the device it is a list of ``Attempt`` s (one, or
several when out-of-memory split it; see ``runtime.device.oom.run_splitting``).
Booking turns them into:

* one ``BatchRow`` per attempt, numbered in the order they are booked;
* an ``EventRow`` for each out-of-memory attempt (``oom`` when it was split,
  ``oom_failed`` when it could not be), each model error (``model_error``, with the
  trace in the log) and each probe of the effective max back up (``oom_probe``);
* the ``SizeGovernor`` update and the batcher's size caps that follow from it;
* every request's one outcome: its result, ``OutOfMemory`` (507) or ``ModelError``
  (500), with one ``RequestRow`` each (a ``RequestBatch`` block for a successful
  attempt when the recorder takes them).

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
from dataclasses import dataclass
from typing import Any

from batchscope.storage.records import (BatchRow, EventRow, ListRecorder, RecorderLike,
                                        RequestBatch, RequestRow, put_many_of)
from runtime.api.errors import ModelError, OutOfMemory, RequestExpired
from runtime.core.batcher import Batch, pad_length
from runtime.core.request import PendingRequest
from runtime.device.oom import Attempt
from runtime.engine.served import ServedModel

log = logging.getLogger("batchscope.engine")


@dataclass(slots=True)
class BookedBatch:
    """A batch whose run is recorded but whose requests are not answered yet."""

    batch: Batch
    attempts: list[Attempt]
    #: the batch number of each attempt's ``BatchRow``
    seqs: list[int]
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

    # -- a batch back from the device ---------------------------------------------------
    def batch_back(self, model: ServedModel, batch: Batch, attempts: list[Attempt],
                   now: float) -> BookedBatch:
        """Record the batch's attempts, report what went wrong and move the governor."""
        device_s = 0.0
        had_oom = False
        seqs = []
        for a in attempts:
            device_s += a.compute_s
            seq = self._record_batch(model, batch, a)
            seqs.append(seq)
            if a.outcome == "oom":
                had_oom = True
                self._oom_event(model, batch, a, seq, now)
            elif a.outcome == "error":
                self._model_error(model, a, seq, now)
        if not had_oom and all(a.outcome == "ok" for a in attempts):
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
            if a.outcome == "ok":
                self._answer_ok(model, reqs, a, seq, now)
            elif a.outcome == "oom":
                for i in range(a.start, a.stop):
                    self.settle(model, reqs[i], now, "oom",
                                error=self._oom_error(model, reqs[i], a),
                                started_s=a.started_s, batch_seq=seq)
            else:
                for i in range(a.start, a.stop):
                    self.settle(model, reqs[i], now, "error", error=ModelError(
                        f"model {model.name!r} failed on a batch of {a.size}: {a.error}"),
                        started_s=a.started_s, batch_seq=seq)

    def _answer_ok(self, model: ServedModel, reqs: list[PendingRequest], a: Attempt, seq: int,
                   now: float) -> None:
        """``settle`` of a successful attempt's requests, unrolled for speed."""
        outputs = a.outputs
        start = a.start
        priorities: list[int] = []
        arrived: list[float] = []
        bypass: list[bool] = []
        lengths: list[int] | None = [] if model.variable else None
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
            block = RequestBatch(self.instance_id, model.name, seq, "ok", a.started_s, now,
                                 self.clock.to_wall(0.0), priorities, arrived, bypass, lengths)
            if self._request_batches:
                self.recorder.put(block)
            else:
                self._put_many(block.rows())
        counts = model.counts
        counts.requests += answered
        counts.outcomes["ok"] = counts.outcomes.get("ok", 0) + answered

    def _record_batch(self, model: ServedModel, batch: Batch, a: Attempt) -> int:
        self.batch_seq += 1
        seq = self.batch_seq
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
            a.peak_memory_bytes, a.cuda_graph, batch.queue_depth))
        return seq

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

    def _model_error(self, model: ServedModel, a: Attempt, seq: int, now: float) -> None:
        log.error("model %r raised on a batch of %d (batch %d):\n%s", model.name, a.size, seq,
                  a.trace or a.error)
        self.event(model.name, now, "model_error",
                   f"{model.name!r} failed on a batch of {a.size}: {a.error}", "error",
                   batch_size=a.size, batch_seq=seq, error=a.error)

    # -- outcomes that are not a batch's ------------------------------------------------
    def settle(self, model: ServedModel, req: PendingRequest, now: float, outcome: str, *,
               result: Any = None, error: BaseException | None = None,
               started_s: float | None = None, batch_seq: int | None = None) -> None:
        """Give a request its one outcome and its row (no-op if it already has one)."""
        fut = req.future
        if fut.done():
            return
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
        to_wall = self.clock.to_wall
        arrived = req.arrived_s
        self.recorder.put(RequestRow(
            self.instance_id, model.name, batch_seq, req.priority, to_wall(arrived), to_wall(now),
            (started_s if started_s is not None else now) - arrived, now - arrived, outcome,
            req.bypass, req.length if model.variable else None))

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
        """Requests whose deadline passed in the queue: ``RequestExpired``, never run."""
        for req in reqs:
            waited_ms = (now - req.arrived_s) * 1000.0
            timeout_ms = ((req.deadline_s or now) - req.arrived_s) * 1000.0
            self.settle(model, req, now, "expired", error=RequestExpired(
                f"the request waited {waited_ms:.0f} ms in the queue of model {model.name!r}, "
                f"past its timeout of {timeout_ms:.0f} ms, and was not run; raise timeout_ms or "
                "send less load"))
        count = model.counts.expiries.hit(now, len(reqs))
        if count:
            self.event(model.name, now, "expired",
                       f"{count} request(s) expired in the queue of {model.name!r}", "warning",
                       count=count, queue_depth=model.batcher.depth)

    def event(self, model: str | None, now: float, kind: str, message: str,
              severity: str = "info", **details: Any) -> None:
        self.recorder.put(EventRow(self.instance_id, model, self.clock.to_wall(now), kind,
                                   message, severity, json.dumps(details, default=str)))
