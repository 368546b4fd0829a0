"""Engine behaviour with real asyncio, the toy models and an in-memory recorder.

Ordering is made deterministic by holding the first batch inside ``predict``
(``DoubleModel(hold=...)``) while the test queues more requests behind it.
"""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest

from batchscope.storage.records import BatchRow, EventRow, ListRecorder, RequestRow
from runtime.api.config import BatchingConfig
from runtime.engine.engine import Engine
from runtime.api.errors import (ClientError, ConfigError, ModelError, ModelNotFound, ModelNotReady,
                            QueueFull, RequestExpired, ShuttingDown, ValidationError)
from runtime.api.model import ModelAPI
from runtime.models.toys import DoubleModel, FailingModel, VarLenModel


def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def vec(v: float) -> dict[str, np.ndarray]:
    return {"INPUT0": np.full(4, v, dtype=np.float32)}


class Held:
    """An engine serving a DoubleModel whose first batch waits until released."""

    def __init__(self, model: DoubleModel | None = None, **config) -> None:
        self.hold = threading.Event()
        self.model = model or DoubleModel()
        self.model.hold = self.hold
        self.rec = ListRecorder()
        self.engine = Engine({"double": self.model}, {"double": BatchingConfig().with_changes(config)},
                             recorder=self.rec, event_interval_s=3600.0)

    async def start_blocked(self) -> asyncio.Task:
        """Start, and run one request that stays inside predict until ``release``."""
        await self.engine.start()
        first = asyncio.ensure_future(self.engine.infer("double", vec(-1.0)))
        await asyncio.to_thread(self.model.entered.wait, 10.0)
        self.model.hold = None
        return first

    def release(self) -> None:
        self.hold.set()

    def submit(self, v: float, **kw) -> asyncio.Task:
        return asyncio.ensure_future(self.engine.infer("double", vec(v), **kw))

    async def settle(self) -> None:
        """Let queued infer() calls reach the batcher."""
        for _ in range(3):
            await asyncio.sleep(0)


def test_batches_form_under_concurrency():
    async def main():
        h = Held()
        first = await h.start_blocked()
        tasks = [h.submit(i) for i in range(10)]
        await h.settle()
        h.release()
        outs = await asyncio.gather(first, *tasks)
        assert [float(o["OUTPUT0"][0]) for o in outs[1:]] == [2.0 * i for i in range(10)]
        assert h.model.batch_sizes == [1, 10]
        rows = h.rec.of(BatchRow)
        assert [r.batch_size for r in rows] == [1, 10] and rows[1].queue_depth == 10
        assert len(h.rec.of(RequestRow)) == 11
        assert {r.batch_seq for r in h.rec.of(RequestRow)} == {rows[0].seq, rows[1].seq}
        await h.engine.stop()
    run(main())


def test_settings_change_applies_at_next_batch_and_is_recorded():
    async def main():
        h = Held()
        seen = []
        h.engine.on_settings_change.append(lambda m, v, c: seen.append((m, v, c.max_batch_size)))
        first = await h.start_blocked()
        tasks = [h.submit(i) for i in range(10)]
        await h.settle()
        version, cfg = h.engine.update_settings("double", {"max_batch_size": 4}, requested_by="test")
        assert (version, cfg.max_batch_size) == (2, 4)
        assert h.engine.get_settings("double")[0] == 2
        h.release()
        await asyncio.gather(first, *tasks)
        assert h.model.batch_sizes == [1, 4, 4, 2]
        assert [r.settings_version for r in h.rec.of(BatchRow)] == [1, 2, 2, 2]
        assert seen == [("double", 2, 4)]
        (event,) = [e for e in h.rec.of(EventRow) if e.kind == "settings_change"]
        details = json.loads(event.details_json)
        assert details["requested_by"] == "test"
        assert details["old"]["max_batch_size"] == 32 and details["new"]["max_batch_size"] == 4
        await h.engine.stop()
    run(main())


def test_invalid_settings_change_changes_nothing():
    async def main():
        h = Held()
        await h.engine.start()
        with pytest.raises(ConfigError):
            h.engine.update_settings("double", {"max_batch_size": 0}, requested_by="test")
        with pytest.raises(ConfigError, match="unknown setting"):
            h.engine.update_settings("double", {"nope": 1}, requested_by="test")
        assert h.engine.get_settings("double") == (1, BatchingConfig())
        assert not [e for e in h.rec.of(EventRow) if e.kind == "settings_change"]
        await h.engine.stop()
    run(main())


def test_request_expires_in_queue_and_never_runs():
    async def main():
        h = Held()
        first = await h.start_blocked()
        doomed = h.submit(7.0, timeout_ms=1.0)
        fine = h.submit(8.0)
        await asyncio.sleep(0.02)  # well past the 1 ms timeout
        h.release()
        await first
        assert float((await fine)["OUTPUT0"][0]) == 16.0
        with pytest.raises(RequestExpired, match="timeout of 1 ms"):
            await doomed
        assert all(7.0 not in values for values in h.model.batches)
        outcomes = sorted(r.outcome for r in h.rec.of(RequestRow))
        assert outcomes == ["expired", "ok", "ok"]
        assert [e.kind for e in h.rec.of(EventRow)] == ["expired"]
        await h.engine.stop()
    run(main())


def test_queue_full_gives_429_with_retry_after_and_a_request_row():
    async def main():
        h = Held(max_queue_size=2)
        first = await h.start_blocked()
        queued = [h.submit(i) for i in range(2)]
        await h.settle()
        with pytest.raises(QueueFull, match="max_queue_size=2") as info:
            await h.engine.infer("double", vec(9.0))
        with pytest.raises(QueueFull):
            await h.engine.infer("double", vec(9.0))
        assert info.value.http_status == 429 and info.value.retry_after_s >= 0.05
        h.release()
        await asyncio.gather(first, *queued)
        rejected = [r for r in h.rec.of(RequestRow) if r.outcome == "rejected"]
        assert len(rejected) == 2
        # folded into one event per interval, with the count
        events = [e for e in h.rec.of(EventRow) if e.kind == "rejected"]
        assert len(events) == 1 and json.loads(events[0].details_json)["count"] == 1
        assert h.engine.stats("double")["requests_by_outcome"] == {"rejected": 2, "ok": 3}
        await h.engine.stop()
    run(main())


def test_model_error_fails_only_its_batch():
    async def main():
        rec = ListRecorder()
        model = FailingModel()
        engine = Engine({"failing": model}, {"failing": BatchingConfig(max_batch_size=1)},
                        recorder=rec)
        await engine.start()
        results = await asyncio.gather(
            *[engine.infer("failing", vec(v)) for v in (1.0, -1.0, 2.0)], return_exceptions=True)
        assert float(results[0]["OUTPUT0"][0]) == 2.0 and float(results[2]["OUTPUT0"][0]) == 4.0
        err = results[1]
        assert isinstance(err, ModelError) and err.http_status == 500
        assert "fails on cue" in err.message and "Traceback" not in err.message
        assert [e.kind for e in rec.of(EventRow)] == ["model_error"]
        assert sorted(r.outcome for r in rec.of(BatchRow)) == ["error", "ok", "ok"]
        assert sorted(r.outcome for r in rec.of(RequestRow)) == ["error", "ok", "ok"]
        # the engine keeps serving
        assert float((await engine.infer("failing", vec(3.0)))["OUTPUT0"][0]) == 6.0
        await engine.stop()
    run(main())


class ShortSplit(DoubleModel):
    name = "short"

    def split(self, output, n):
        return super().split(output, n)[:-1]


def test_split_must_return_one_output_per_request():
    async def main():
        engine = Engine({"short": ShortSplit()})
        await engine.start()
        with pytest.raises(ModelError, match="split returned 0 outputs for a batch of 1"):
            await engine.infer("short", vec(1.0))
        await engine.stop()
    run(main())


def test_stop_drains_queued_work():
    async def main():
        h = Held(max_batch_size=4)
        first = await h.start_blocked()
        tasks = [h.submit(i) for i in range(10)]
        await h.settle()
        stopping = asyncio.ensure_future(h.engine.stop(drain_timeout_s=20.0))
        await asyncio.sleep(0)
        with pytest.raises(ShuttingDown):
            await h.engine.infer("double", vec(1.0))
        h.release()
        await stopping
        outs = await asyncio.gather(first, *tasks)
        assert len(outs) == 11 and h.model.batch_sizes == [1, 4, 4, 2]
        assert [r.outcome for r in h.rec.of(RequestRow)] == ["ok"] * 11
        assert not h.engine.is_ready()
    run(main())


def test_stop_gives_exactly_one_outcome_to_every_request():
    async def main():
        h = Held(max_batch_size=4)
        first = await h.start_blocked()
        tasks = [h.submit(i) for i in range(20)]
        await h.settle()
        asyncio.get_running_loop().call_later(0.05, h.release)
        await h.engine.stop(drain_timeout_s=0.0)
        results = await asyncio.gather(first, *tasks, return_exceptions=True)
        assert float(results[0]["OUTPUT0"][0]) == -2.0       # the running batch finished
        assert all(isinstance(r, ShuttingDown) for r in results[1:])
        rows = h.rec.of(RequestRow)
        assert len(rows) == 21
        assert sorted(r.outcome for r in rows) == ["cancelled"] * 20 + ["ok"]
        assert h.model.batch_sizes == [1]
    run(main())


def test_priorities_order_the_queue():
    async def main():
        h = Held(max_batch_size=2)
        first = await h.start_blocked()
        tasks = [h.submit(v, priority=p) for v, p in [(20, 2), (10, 1), (0, 0), (21, 2), (1, 0)]]
        await h.settle()
        h.release()
        await asyncio.gather(first, *tasks)
        assert h.model.batches[1:] == [[0.0, 1.0], [10.0, 20.0], [21.0]]
        await h.engine.stop()
    run(main())


def test_bypass_request_runs_before_the_queue():
    async def main():
        h = Held(max_batch_size=5)
        first = await h.start_blocked()
        # a long window: without bypass, a lone request would now wait 10 s
        h.engine.update_settings("double", {"max_queue_delay_ms": 10_000.0}, requested_by="test")
        normal = [h.submit(i) for i in range(5)]
        rt = h.submit(99.0, bypass=True)
        await h.settle()
        h.release()
        await asyncio.gather(first, rt, *normal)
        assert h.model.batches[1:] == [[99.0], [0.0, 1.0, 2.0, 3.0, 4.0]]
        assert [r.bypass for r in h.rec.of(RequestRow)].count(True) == 1
        await h.engine.stop()
    run(main())


def test_bypass_is_ignored_when_not_allowed():
    async def main():
        h = Held(max_batch_size=2, allow_bypass=False)
        first = await h.start_blocked()
        tasks = [h.submit(0.0), h.submit(1.0), h.submit(99.0, bypass=True)]
        await h.settle()
        h.release()
        await asyncio.gather(first, *tasks)
        assert h.model.batches[1:] == [[0.0, 1.0], [99.0]]
        await h.engine.stop()
    run(main())


def test_cancelled_request_is_recorded_and_never_runs():
    async def main():
        h = Held()
        first = await h.start_blocked()
        gone = h.submit(5.0)
        stay = h.submit(6.0)
        await h.settle()
        gone.cancel()
        await asyncio.sleep(0)
        h.release()
        await asyncio.gather(first, stay)
        assert gone.cancelled() and h.model.batches[1:] == [[6.0]]
        assert sorted(r.outcome for r in h.rec.of(RequestRow)) == ["cancelled", "ok", "ok"]
        await h.engine.stop()
    run(main())


def test_request_errors_before_queueing():
    async def main():
        engine = Engine({"double": DoubleModel()})
        with pytest.raises(ModelNotReady):
            await engine.infer("double", vec(1.0))
        await engine.start()
        with pytest.raises(ModelNotFound, match="served models are \\['double'\\]"):
            await engine.infer("nope", vec(1.0))
        with pytest.raises(ClientError, match="expected FP32 \\[4\\]"):
            await engine.infer("double", {"INPUT0": np.zeros(3, np.float32)})
        with pytest.raises(ValidationError, match="0 .most urgent. to 2"):
            await engine.infer("double", vec(1.0), priority=5)
        with pytest.raises(ValidationError, match="timeout_ms"):
            await engine.infer("double", vec(1.0), timeout_ms=-1)
        assert engine.stats("double")["requests"] == 0
        await engine.stop()
    run(main())


def test_engine_refuses_bad_construction():
    with pytest.raises(ConfigError, match="unknown model"):
        Engine({"double": DoubleModel()}, {"other": BatchingConfig()})

    class Gen(DoubleModel):
        kind = "generate"

    with pytest.raises(ConfigError, match="generation engine"):
        Engine({"gen": Gen()})
    with pytest.raises(TypeError):
        Engine({"bare": ModelAPI()})


def test_variable_length_model_is_bucketed_and_padded():
    async def main():
        rec = ListRecorder()
        model = VarLenModel()
        engine = Engine({"varlen": model},
                        {"varlen": BatchingConfig(bucket_edges=(8, 16), pad_to="bucket")},
                        recorder=rec)
        await engine.start()
        outs = await asyncio.gather(*[engine.infer("varlen", {"INPUT0": np.ones(n, np.float32)})
                                      for n in (3, 12, 5, 40)])
        assert [float(o["SUM"][0]) for o in outs] == [3.0, 12.0, 5.0, 40.0]
        assert sorted(int(o["PADDED"][0]) for o in outs) == [8, 8, 16, 40]
        rows = {r.bucket: r for r in rec.of(BatchRow)}
        assert rows[8].batch_size == 2 and rows[8].real_elements == 8 and rows[8].padded_elements == 16
        assert rows[-1].padded_elements == 40
        assert sorted(r.length for r in rec.of(RequestRow)) == [3, 5, 12, 40]
        with pytest.raises(ValidationError, match="max_length=1024"):
            await engine.infer("varlen", {"INPUT0": np.ones(2000, np.float32)})
        await engine.stop()
    run(main())
