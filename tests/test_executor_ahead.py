"""With the device process, a full batch goes to the child while the previous one runs.

The toy model holds any batch containing an item whose first value is 99 until a gate
file exists, so a batch can be kept running while the test queues more requests.
Outcomes are count-based (batches in flight, queue depth, answers, rows); waits are
bounded and never asserted on.
"""

from __future__ import annotations

import asyncio
import os
import signal
import textwrap

import numpy as np

from batchscope.storage.records import BatchRow, EventRow, ListRecorder, RequestRow
from runtime.api.config import BatchingConfig
from runtime.engine.engine import MAX_AHEAD_BATCHES, Engine
from runtime.api.errors import BatchLost
from runtime.models.loader import load_model
from tests.factories import SLOW_MODEL, WAIT_S, wait_for

GATED_MODEL = SLOW_MODEL + '''

GATE = GATE_PATH


class GatedModel(SlowModel):
    """x + 1; a batch holding an item whose first value is 99 waits for the gate file."""
    name = MODEL_NAME

    def predict(self, batch):
        if bool((batch[:, 0] == 99).any()):
            give_up = time.monotonic() + 30.0
            while not os.path.exists(GATE) and time.monotonic() < give_up:
                time.sleep(0.005)
        return batch + 1
'''


def _gated(tmp_path, name: str = "gated") -> tuple[str, str]:
    """(model spec, gate file path) of a gated toy model called ``name``."""
    gate = str(tmp_path / f"{name}.open")
    path = tmp_path / f"{name}_model.py"
    source = textwrap.dedent(GATED_MODEL).replace("GATE_PATH", repr(gate))
    path.write_text("import os\n" + source.replace("MODEL_NAME", repr(name)))
    return f"{path}:GatedModel", gate


def _submit(engine: Engine, model: str, firsts: list[float], results: list | None = None) -> list:
    """Queue one request per value; ``results`` (a new list if None), extended by one
    entry per request that fills in place with (result, error)."""
    results = [] if results is None else results
    for first in firsts:
        results.append(None)

        def done(result, error, i=len(results) - 1):
            assert results[i] is None, "a request got a second outcome"
            results[i] = (result, error)
        engine.submit(model, {"INPUT0": np.array([first, 0], np.float32)}, None, None, False,
                      done)
    return results


async def _let_worker_run(turns: int = 20) -> None:
    for _ in range(turns):
        await asyncio.sleep(0)


def _engine(tmp_path, rec: ListRecorder, max_batch_size: int = 4) -> tuple[Engine, str]:
    spec, gate = _gated(tmp_path)
    engine = Engine({"gated": load_model(spec)},
                    {"gated": BatchingConfig(max_batch_size=max_batch_size)},
                    recorder=rec, device_process=True, model_specs=[spec])
    return engine, gate


def test_a_full_batch_is_sent_while_one_runs_but_a_partial_one_waits(tmp_path):
    rec = ListRecorder()
    engine, gate = _engine(tmp_path, rec)

    async def run() -> None:
        await engine.start()
        try:
            everything = _submit(engine, "gated", [99, 1, 2, 3])
            await wait_for(lambda: engine.stats("gated")["in_flight"] == 4, "the first batch")
            _submit(engine, "gated", [4, 5], everything)
            await _let_worker_run()
            st = engine.stats("gated")
            assert (st["in_flight"], st["queue_depth"]) == (4, 2)  # a partial batch waits
            _submit(engine, "gated", [6, 7], everything)
            await wait_for(lambda: engine.stats("gated")["in_flight"] == 8,
                            "the full second batch to go ahead")
            assert len(engine._processes["gated"]._sent) == 2 and all(r is None for r in everything)
            # never more than two batches of a model in flight
            _submit(engine, "gated", [8, 9, 10, 11, 12, 13, 14, 15], everything)
            await _let_worker_run()
            st = engine.stats("gated")
            assert MAX_AHEAD_BATCHES == 2
            assert (st["in_flight"], st["queue_depth"]) == (8, 8)
            open(gate, "w").close()
            await wait_for(lambda: all(r is not None for r in everything), "every answer")
            assert [r[1] for r in everything] == [None] * 16
            assert [float(r[0]["OUTPUT0"][0]) for r in everything] == [
                100.0, *[float(v + 1) for v in range(1, 16)]]
            assert engine.stats("gated")["in_flight"] == 0
        finally:
            await engine.stop()
        sizes = [b.batch_size for b in rec.of(BatchRow)]
        assert sizes == [4, 4, 4, 4] and all(b.outcome == "ok" for b in rec.of(BatchRow))
        rows = rec.of(RequestRow)
        assert len(rows) == 16 and all(r.outcome == "ok" for r in rows)
        st = engine.stats("gated")
        assert st["batches"] == 4 and st["requests"] == 16
        # every batch's device time reached the arbiter (the held one alone took a while)
        assert st["device_time_s"] > 0 and st["device_grants"] >= 1

    asyncio.run(run())


def test_a_crash_with_two_batches_in_flight_fails_each_request_once(tmp_path):
    rec = ListRecorder()
    engine, gate = _engine(tmp_path, rec)

    async def run() -> None:
        await engine.start()
        try:
            first_pid = engine._processes["gated"].pid
            lost = _submit(engine, "gated", [99, 1, 2, 3])
            await wait_for(lambda: engine.stats("gated")["in_flight"] == 4, "the first batch")
            _submit(engine, "gated", [4, 5, 6, 7], lost)
            await wait_for(lambda: engine.stats("gated")["in_flight"] == 8, "the second batch")
            os.kill(first_pid, signal.SIGKILL)
            await wait_for(lambda: all(r is not None for r in lost), "the lost answers")
            for result, error in lost:
                assert result is None and isinstance(error, BatchLost) and error.http_status == 503
                assert "SIGKILL" in str(error) and "send the request again" in str(error)
            open(gate, "w").close()
            later = _submit(engine, "gated", [20, 21, 22, 23, 24])
            await wait_for(lambda: all(r is not None for r in later), "answers after restart")
            assert [r[1] for r in later] == [None] * 5
            assert [float(r[0]["OUTPUT0"][0]) for r in later] == [21.0, 22.0, 23.0, 24.0, 25.0]
            assert engine._processes["gated"].restarts == 1 and engine._processes["gated"].pid != first_pid
            assert engine.stats("gated")["in_flight"] == 0
        finally:
            await engine.stop()
        outcomes = [r.outcome for r in rec.of(RequestRow)]
        assert outcomes.count("error") == 8 and outcomes.count("ok") == 5 and len(outcomes) == 13
        failed = [b for b in rec.of(BatchRow) if b.outcome == "lost"]
        assert [b.batch_size for b in failed] == [4, 4]
        assert any("starting a new one" in e.message and "2 batch(es)" in e.message
                   for e in rec.of(EventRow))

    asyncio.run(run())


def test_stop_answers_both_batches_in_flight(tmp_path):
    rec = ListRecorder()
    engine, gate = _engine(tmp_path, rec)

    async def run() -> None:
        await engine.start()
        everything = _submit(engine, "gated", [99, 1, 2, 3])
        await wait_for(lambda: engine.stats("gated")["in_flight"] == 4, "the first batch")
        _submit(engine, "gated", [4, 5, 6, 7, 8], everything)
        await wait_for(lambda: engine.stats("gated")["in_flight"] == 8, "the second batch")
        open(gate, "w").close()
        await engine.stop(drain_timeout_s=WAIT_S)
        assert all(r is not None for r in everything)
        assert [r[1] for r in everything] == [None] * 9  # drained: every request ran
        assert [float(r[0]["OUTPUT0"][0]) for r in everything[1:]] == [
            float(v + 1) for v in range(1, 9)]

    asyncio.run(run())
    assert len(rec.of(RequestRow)) == 9


def test_two_models_in_the_device_process_share_it_and_both_are_charged(tmp_path):
    rec = ListRecorder()
    spec_a, gate_a = _gated(tmp_path, "left")
    spec_b, _ = _gated(tmp_path, "right")
    engine = Engine({"left": load_model(spec_a), "right": load_model(spec_b)},
                    {"left": BatchingConfig(max_batch_size=4),
                     "right": BatchingConfig(max_batch_size=4)},
                    recorder=rec, device_process=True, model_specs=[spec_a, spec_b])

    async def run() -> None:
        await engine.start()
        try:
            left = _submit(engine, "left", [99, 1, 2, 3])
            await wait_for(lambda: engine.stats("left")["in_flight"] == 4, "left's batch")
            right = _submit(engine, "right", [1, 2, 3, 4])
            _submit(engine, "left", [5, 6, 7, 8], left)
            await _let_worker_run()
            # right waits for the device turn: left's full batch does not jump ahead of it
            assert engine.stats("left")["in_flight"] == 4
            open(gate_a, "w").close()
            await wait_for(lambda: all(r is not None for r in left + right), "every answer")
            assert [r[1] for r in left + right] == [None] * 12
        finally:
            await engine.stop()
        order = [b.model for b in rec.of(BatchRow)]
        assert order == ["left", "right", "left"]
        for name in ("left", "right"):
            st = engine.stats(name)
            assert st["device_time_s"] > 0 and st["in_flight"] == 0
        assert engine._arbiter.holder is None

    asyncio.run(run())
