"""``Booking``: a finished batch's attempts become rows, events, governor moves and outcomes.

Driven synchronously, with a fake clock and a ``ListRecorder``: no event loop, no
device. Requests carry a ``CallbackOutcome`` so each outcome can be read back.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from batchscope.storage.records import BatchRow, EventRow, ListRecorder, RequestRow
from runtime.api.config import BatchingConfig
from runtime.api.errors import ModelError, OutOfMemory, RequestExpired
from runtime.core.clock import FakeClock
from runtime.core.request import PendingRequest
from runtime.core.tracing import (PLAIN_BATCH_SEQ, PLAIN_ENDING, PLAIN_SEND_END,
                                  PLAIN_SEND_START, RequestTrace, full, plain_trace)
from runtime.device.oom import Attempt
from runtime.engine.booking import Booking
from runtime.engine.engine import CallbackOutcome
from runtime.engine.served import ServedModel
from runtime.models.toys import DoubleModel


class Setup:
    """One served toy model, its booking, the clock and every request's outcome."""

    def __init__(self, **config) -> None:
        self.clock = FakeClock()
        self.rec = ListRecorder()
        self.model = ServedModel("double", DoubleModel(), BatchingConfig(**config),
                                 event_interval_s=1.0)
        self.booking = Booking(self.rec, "test", self.clock)
        self.outcomes: list[tuple[object, object] | None] = []

    def batch(self, n: int):
        """Queue ``n`` requests, let 10 ms pass, and take them as one batch."""
        now = self.clock.now()
        for i in range(n):
            self.outcomes.append(None)

            def done(result, error, i=len(self.outcomes) - 1):
                assert self.outcomes[i] is None, "a request got a second outcome"
                self.outcomes[i] = (result, error)

            req = PendingRequest(np.full(4, float(i), np.float32), arrived_s=now,
                                 future=CallbackOutcome(done))
            self.model.batcher.submit(req, now)
        self.clock.advance(0.010)
        batch = self.model.batcher.next_batch(self.clock.now())
        assert batch is not None and len(batch) == n
        return batch

    def attempt(self, start: int, stop: int, outcome: str, **kw) -> Attempt:
        """An attempt that started now and took 2 ms (the clock moves on)."""
        began = self.clock.now()
        ended = self.clock.advance(0.002)
        if outcome == "ok" and "outputs" not in kw:
            kw["outputs"] = [{"OUTPUT0": np.full(4, float(i))} for i in range(start, stop)]
        return Attempt(start, stop, outcome, began, ended, 0.002, **kw)


def test_a_split_oom_batch_books_each_attempt_and_lowers_the_effective_max():
    s = Setup(max_batch_size=4)
    batch = s.batch(4)
    attempts = [s.attempt(0, 4, "oom", error="CUDA out of memory", split=True,
                          memory={"rss_bytes": 1}),
                s.attempt(0, 2, "ok"), s.attempt(2, 4, "ok")]
    booked = s.booking.batch_back(s.model, batch, attempts, s.clock.now())

    rows = s.rec.of(BatchRow)
    assert [(b.seq, b.batch_size, b.outcome) for b in rows] == [
        (1, 4, "oom"), (2, 2, "ok"), (3, 2, "ok")]
    assert rows[0].queue_wait_max_s == pytest.approx(0.010)
    assert booked.seqs == [1, 2, 3] and booked.device_s == pytest.approx(0.006)
    [event] = s.rec.of(EventRow)
    details = json.loads(event.details_json)
    assert (event.kind, event.severity) == ("oom", "error")
    assert details["batch_size"] == 4 and details["effective_max_batch_size"] == 2
    assert "split into 2 batches of 2/2" in details["action"]
    # the governor's cap reached the batcher
    assert s.model.governor.limit(None) == 2 and s.model.batcher.cap(None) == 2
    assert s.model.counts.oom_events == 1 and s.model.counts.batches == 3
    # nobody is answered until ``answer``
    assert s.outcomes == [None] * 4 and s.rec.of(RequestRow) == []

    s.booking.answer(s.model, booked, s.clock.now())
    assert [err for _, err in s.outcomes] == [None] * 4
    assert [float(res["OUTPUT0"][0]) for res, _ in s.outcomes] == [0.0, 1.0, 2.0, 3.0]
    reqs = s.rec.of(RequestRow)
    assert [(r.outcome, r.batch_seq) for r in reqs] == [("ok", 2), ("ok", 2), ("ok", 3), ("ok", 3)]
    assert reqs[0].queue_wait_s == pytest.approx(0.012)  # queued 10 ms, then the 2 ms oom
    assert s.model.counts.requests == 4 and s.model.counts.outcomes == {"ok": 4}


def test_an_oom_without_recovery_fails_every_request_with_507():
    s = Setup(max_batch_size=4, oom_recovery=False)
    batch = s.batch(3)
    booked = s.booking.batch_back(s.model, batch, [s.attempt(0, 3, "oom", error="CUDA oom")],
                                  s.clock.now())
    s.booking.answer(s.model, booked, s.clock.now())
    assert [(b.batch_size, b.outcome) for b in s.rec.of(BatchRow)] == [(3, "oom")]
    assert [e.kind for e in s.rec.of(EventRow)] == ["oom_failed"]
    assert all(res is None and isinstance(err, OutOfMemory) and "oom_recovery is off" in str(err)
               for res, err in s.outcomes)
    assert [r.outcome for r in s.rec.of(RequestRow)] == ["oom"] * 3
    assert s.model.batcher.cap(None) == 4  # an unsplit OOM does not move the governor


def test_a_single_request_that_does_not_fit_alone():
    s = Setup()
    batch = s.batch(1)
    booked = s.booking.batch_back(s.model, batch, [s.attempt(0, 1, "oom", error="CUDA oom")],
                                  s.clock.now())
    s.booking.answer(s.model, booked, s.clock.now())
    [(result, error)] = s.outcomes
    assert isinstance(error, OutOfMemory) and "even alone" in str(error)
    assert "does not fit even alone" in s.rec.of(EventRow)[0].message


def test_a_model_error_fails_its_attempt_and_is_an_event():
    s = Setup(max_batch_size=4)
    batch = s.batch(4)
    attempts = [s.attempt(0, 4, "oom", error="CUDA oom", split=True),
                s.attempt(0, 2, "error", error="ValueError: bad item", trace="Traceback ..."),
                s.attempt(2, 4, "ok")]
    booked = s.booking.batch_back(s.model, batch, attempts, s.clock.now())
    s.booking.answer(s.model, booked, s.clock.now())
    assert [e.kind for e in s.rec.of(EventRow)] == ["oom", "model_error"]
    errors = [err for _, err in s.outcomes]
    assert all(isinstance(e, ModelError) and "bad item" in str(e) for e in errors[:2])
    assert errors[2:] == [None, None]
    assert s.model.counts.outcomes == {"error": 2, "ok": 2}


def test_clean_batches_probe_the_effective_max_back_up():
    s = Setup(max_batch_size=4, oom_probe_after_batches=2)
    batch = s.batch(4)
    s.booking.batch_back(s.model, batch, [s.attempt(0, 4, "oom", error="oom", split=True),
                                          s.attempt(0, 2, "ok"), s.attempt(2, 4, "ok")],
                         s.clock.now())
    assert s.model.batcher.cap(None) == 2
    for _ in range(2):
        batch = s.batch(2)
        s.booking.batch_back(s.model, batch, [s.attempt(0, 2, "ok")], s.clock.now())
    probe = [e for e in s.rec.of(EventRow) if e.kind == "oom_probe"]
    assert len(probe) == 1 and json.loads(probe[0].details_json)["effective_max_batch_size"] == 4
    assert s.model.batcher.cap(None) == 4


def test_rejections_and_expiries_are_counted_and_folded_into_events():
    s = Setup()
    req = PendingRequest(None, arrived_s=s.clock.now(), future=CallbackOutcome(lambda r, e: None))
    for _ in range(3):
        s.booking.rejected(s.model, req, s.clock.now())
    s.clock.advance(1.5)
    s.booking.rejected(s.model, req, s.clock.now())
    counts = [json.loads(e.details_json)["count"] for e in s.rec.of(EventRow)]
    assert counts == [1, 3]  # the first at once, the next three folded into one
    got = []
    late = PendingRequest(None, arrived_s=s.clock.now(), deadline_s=s.clock.now() + 0.005,
                          future=CallbackOutcome(lambda r, e: got.append(e)))
    s.clock.advance(0.020)
    s.booking.expired(s.model, [late], s.clock.now())
    assert isinstance(got[0], RequestExpired) and "timeout of 5 ms" in str(got[0])
    assert s.model.counts.outcomes == {"rejected": 4, "expired": 1}
    assert [e.kind for e in s.rec.of(EventRow)] == ["rejected", "rejected", "expired"]


def _traced_batch(s: Setup, traces: list) -> tuple:
    """Queue one request per trace (None: untraced) whose answer notes its trace's batch
    number and stamps its send times as the fast path does; take them as one batch."""
    now = s.clock.now()
    seen: list = []
    for i, trace in enumerate(traces):
        def done(result, error, trace=trace):
            if type(trace) is list:
                seen.append((trace[PLAIN_BATCH_SEQ], error))
                trace[PLAIN_SEND_START] = s.clock.now()
                trace[PLAIN_SEND_END] = s.clock.now() + 0.0001
                return
            seen.append((None if trace is None else trace.batch_seq, error))
            if trace is not None:
                trace.send_start, trace.send_end = s.clock.now(), s.clock.now() + 0.0001

        s.model.batcher.submit(PendingRequest(np.full(4, float(i), np.float32), arrived_s=now,
                                              future=CallbackOutcome(done), trace=trace), now)
    s.clock.advance(0.010)
    return s.model.batcher.next_batch(s.clock.now()), seen


def test_the_plain_traces_of_a_batch_are_handed_over_together_once_answered():
    s = Setup(max_batch_size=4)
    handed: list = []
    s.booking.on_plain_traces = handed.append
    plain = [plain_trace(1, "r1", 0.5, 0.6), plain_trace(2, None, None, None)]
    full = RequestTrace(3, "double", "http", s.clock.now())
    batch, seen = _traced_batch(s, [plain[0], full, None, plain[1]])
    arrived = s.clock.now() - 0.010
    attempt = s.attempt(0, 4, "ok")
    booked = s.booking.batch_back(s.model, batch, [attempt], s.clock.now())
    s.booking.answer(s.model, booked, s.clock.now())

    [seq] = booked.seqs
    # each answer saw its batch's number; the plain ones went over together, as they are
    assert seen == [(seq, None), (seq, None), (None, None), (seq, None)]
    [(model, protocol, outcome, batch_seq, started, input_end, output_start, ended, end,
      members)] = handed
    assert (model, protocol, outcome, batch_seq) == ("double", "http", "ok", seq)
    assert (started, ended, end) == (attempt.started_s, attempt.ended_s, s.clock.now())
    assert (input_end, output_start) == (attempt.started_s + attempt.input_s,
                                         attempt.ended_s - attempt.output_s)
    assert members == [tuple(p) for p in plain]
    assert [m[:8] for m in members] == [(1, "r1", 0.5, 0.6, arrived, *plain[0][5:7], None),
                                        (2, None, None, None, arrived, *plain[1][5:7], None)]
    assert None not in (plain[0][PLAIN_SEND_START], plain[1][PLAIN_SEND_END])
    # the other kind of trace is stamped in place, as before
    assert (full.batch_seq, full.outcome, full.compute_start) == (seq, "ok", attempt.started_s)
    assert all(p[PLAIN_ENDING] is None for p in plain)


def test_a_plain_trace_of_a_failed_batch_becomes_a_request_trace():
    s = Setup(max_batch_size=2, oom_recovery=False)
    handed: list = []
    s.booking.on_plain_traces = handed.append
    trace = plain_trace(9, "x", 0.1, 0.2)
    batch, seen = _traced_batch(s, [trace, None])
    arrived = s.clock.now() - 0.010
    attempt = s.attempt(0, 2, "oom", error="CUDA out of memory")
    booked = s.booking.batch_back(s.model, batch, [attempt], s.clock.now())
    s.booking.answer(s.model, booked, s.clock.now())

    assert handed == [] and isinstance(seen[0][1], OutOfMemory)
    made = full(trace, "double", s.clock.now())
    assert (made.trace_id, made.model, made.request_id, made.recv_start, made.recv_end) == (
        9, "double", "x", 0.1, 0.2)
    assert (made.outcome, made.batch_seq, made.compute_start) == ("oom", booked.seqs[0],
                                                                  attempt.started_s)
    assert made.request_start == made.queue_start == arrived
    assert made.request_end == s.clock.now()
    # refused before it was queued: it starts when the engine refused it
    refused = full(plain_trace(10, None, None, None), "double", 42.0)
    assert refused.request_start == 42.0 and refused.outcome is None
