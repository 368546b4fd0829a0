"""A request the model fails on fails alone: its batch is split in halves until the
failing requests are isolated (``isolate_errors``), within a bounded number of
attempts; the log gets at most one traceback per model per interval.

The splitting is driven by a pure attempt function (no torch, no loop); the engine
tests queue a whole batch synchronously before the dispatch loop runs, so the first
batch holds every request and outcomes depend on counts only. The log test passes
the time in.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math

import numpy as np
import pytest

from batchscope.storage.records import BatchRow, EventRow, ListRecorder, RequestRow
from runtime.api.config import BatchingConfig
from runtime.api.errors import ModelError
from runtime.device.oom import Attempt, IsolationBudget, run_splitting
from runtime.engine.booking import FailureLog
from runtime.engine.engine import Engine
from runtime.models.toys import FailingModel


# -- the splitting rule (pure) ------------------------------------------------------------
def fails_on(bad: set[int], oom_above: int | None = None):
    """An attempt that fails when its slice holds a request in ``bad`` (and runs out of
    memory above ``oom_above``); records the slices it ran."""
    ran: list[tuple[int, int]] = []

    def attempt(lo: int, hi: int) -> Attempt:
        ran.append((lo, hi))
        if oom_above is not None and hi - lo > oom_above:
            outcome = "oom"
        else:
            outcome = "error" if bad & set(range(lo, hi)) else "ok"
        error = "ValueError: bad" if outcome == "error" else None
        return Attempt(lo, hi, outcome, 0.0, 0.0, 0.0, error=error)

    attempt.ran = ran
    return attempt


def final(attempts: list[Attempt]) -> dict[int, str]:
    """Each request's outcome: that of the last unsplit attempt covering it (checked to
    be exactly one)."""
    out: dict[int, str] = {}
    for a in attempts:
        if a.split:
            continue
        for i in range(a.start, a.stop):
            assert i not in out, f"request {i} has two outcomes"
            out[i] = a.outcome
    return out


def test_one_bad_request_is_isolated_in_one_plus_two_log2_n_attempts():
    for n, bad in ((8, 5), (32, 0), (32, 31), (7, 3), (2, 1)):
        attempts = run_splitting(n, fails_on({bad}), recover=True, free=lambda: None,
                                 isolate=True)
        outcomes = final(attempts)
        assert sorted(outcomes) == list(range(n))
        assert [i for i, o in outcomes.items() if o == "error"] == [bad], (n, bad)
        assert len(attempts) <= 1 + 2 * math.ceil(math.log2(n)), (n, len(attempts))


def test_bad_requests_spread_over_a_batch_are_all_isolated():
    for bad in ({0, 31}, {3, 12, 20, 29}, {1, 2, 3}):
        attempts = run_splitting(32, fails_on(bad), recover=True, free=lambda: None,
                                 isolate=True)
        outcomes = final(attempts)
        assert {i for i, o in outcomes.items() if o == "error"} == bad
        assert len(attempts) <= 1 + 6 * 5


def test_a_model_that_fails_on_everything_stops_after_two_alone():
    attempts = run_splitting(32, fails_on(set(range(32))), recover=True, free=lambda: None,
                             isolate=True)
    # 32 -> 16 -> 8 -> 4 -> 2 -> 1 + 1: both alone fail, so nothing else is split
    assert len(attempts) == 11
    outcomes = final(attempts)
    assert set(outcomes.values()) == {"error"} and len(outcomes) == 32
    assert [a.size for a in attempts if not a.split] == [1, 1, 2, 4, 8, 16]


def test_the_budget_bounds_the_attempts_and_the_rest_fails_whole():
    bad = set(range(0, 32, 4))  # one in every four: more than the budget isolates
    attempts = run_splitting(32, fails_on(bad), recover=True, free=lambda: None, isolate=True)
    splits = sum(a.split for a in attempts)
    assert splits == IsolationBudget(32).splits_left == 15
    assert len(attempts) == 1 + 2 * splits
    outcomes = final(attempts)
    assert bad <= {i for i, o in outcomes.items() if o == "error"}  # no bad one succeeds
    assert any(o == "ok" for o in outcomes.values())  # but the isolation helped some


def test_without_isolation_a_failing_batch_fails_whole():
    attempts = run_splitting(16, fails_on({4}), recover=True, free=lambda: None)
    assert [(a.size, a.outcome, a.split) for a in attempts] == [(16, "error", False)]


def test_out_of_memory_then_a_bad_request_in_a_half():
    attempts = run_splitting(16, fails_on({9}, oom_above=8), recover=True, free=lambda: None,
                             isolate=True)
    assert (attempts[0].outcome, attempts[0].split) == ("oom", True)
    outcomes = final(attempts)
    assert [i for i, o in outcomes.items() if o != "ok"] == [9]


# -- through the engine (device thread) ----------------------------------------------------
def vec(v: float) -> dict[str, np.ndarray]:
    return {"INPUT0": np.full(4, v, dtype=np.float32)}


def submit_all(engine: Engine, model: str, values: list[float]) -> list:
    results: list = [None] * len(values)
    for i, v in enumerate(values):
        def done(result, error, i=i):
            assert results[i] is None, "a request got a second outcome"
            results[i] = (result, error)
        engine.submit(model, vec(v), None, None, False, done)
    return results


async def settled(results: list, limit: int = 2000) -> None:
    for _ in range(limit):
        if all(r is not None for r in results):
            return
        await asyncio.sleep(0.005)
    raise AssertionError("not every request was answered")


def serve(isolate: bool) -> tuple[Engine, ListRecorder]:
    rec = ListRecorder()
    cfg = BatchingConfig(max_batch_size=8, isolate_errors=isolate)
    return Engine({"failing": FailingModel()}, {"failing": cfg}, recorder=rec), rec


def test_only_the_poison_request_of_a_batch_fails():
    engine, rec = serve(isolate=True)

    async def main() -> None:
        await engine.start()
        try:
            values = [1, 2, 3, -1, 5, 6, 7, 8]
            results = submit_all(engine, "failing", values)
            await settled(results)
        finally:
            await engine.stop()
        errors = [r[1] for r in results]
        assert [e is None for e in errors] == [True, True, True, False, True, True, True, True]
        assert [float(r[0]["OUTPUT0"][0]) for r in results if r[1] is None] == [
            2 * v for v in values if v > 0]
        bad = errors[3]
        assert isinstance(bad, ModelError) and bad.http_status == 500
        assert bad.message.startswith("model 'failing' failed on this request: RuntimeError")
        assert "fails on cue" in bad.message and "Traceback" not in bad.message
        # every attempt has a batch row, first halves first: 8 -> 4 -> 2 + 2 -> 1 + 1, 4
        assert [(b.batch_size, b.outcome) for b in rec.of(BatchRow)] == [
            (8, "error"), (4, "error"), (2, "ok"), (2, "error"), (1, "ok"), (1, "error"), (4, "ok")]
        [event] = [e for e in rec.of(EventRow) if e.kind == "model_error"]
        details = json.loads(event.details_json)
        assert details["failed_requests"] == 1 and details["isolated"] is True
        assert details["attempts"] == 7 and details["batch_size"] == 8
        assert sorted(r.outcome for r in rec.of(RequestRow)) == ["error"] + ["ok"] * 7

    asyncio.run(asyncio.wait_for(main(), 30))


def test_isolate_errors_off_fails_the_whole_batch_as_before():
    engine, rec = serve(isolate=False)

    async def main() -> None:
        await engine.start()
        try:
            results = submit_all(engine, "failing", [1, 2, -1, 4])
            await settled(results)
        finally:
            await engine.stop()
        assert all(isinstance(r[1], ModelError) and "failed on a batch of 4" in r[1].message
                   for r in results)
        assert [(b.batch_size, b.outcome) for b in rec.of(BatchRow)] == [(4, "error")]

    asyncio.run(asyncio.wait_for(main(), 30))


# -- the log ------------------------------------------------------------------------------
def test_one_traceback_per_interval_and_folded_summaries(caplog):
    failures = FailureLog(trace_interval_s=10.0, summary_interval_s=1.0)
    caplog.set_level(logging.ERROR, logger="batchscope.engine")
    for i in range(300):  # 300 failures in 3 s
        failures.failed("poison", i * 0.01, f"model 'poison' failed ({i})", "Traceback: ...")
    lines = [r.getMessage() for r in caplog.records]
    traces = [m for m in lines if "Traceback" in m]
    assert len(traces) == 1 and lines[0].startswith("model 'poison' failed (0)")
    summaries = [m for m in lines if "since the last line" in m]
    assert len(summaries) == 2 and len(lines) == 3  # at 1 s and 2 s
    assert "[100 failure(s)" in summaries[0]
    # another model has its own allowance; after the interval the next one is in full
    failures.failed("other", 3.0, "model 'other' failed", "Traceback: other")
    failures.failed("poison", 10.5, "model 'poison' failed (late)", "Traceback: again")
    late = caplog.records[-1].getMessage()
    assert "Traceback: again" in late and "299 more failure(s) since its last traceback" in late
    assert sum("Traceback" in r.getMessage() for r in caplog.records) == 3


@pytest.mark.parametrize("n, splits", [(1, 0), (2, 3), (8, 9), (32, 15), (33, 18)])
def test_the_budget_grows_with_log2_of_the_batch(n, splits):
    assert IsolationBudget(n).splits_left == splits
