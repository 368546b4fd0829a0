"""OOM detection, split-and-retry and the effective batch-size state machine."""

from __future__ import annotations

import asyncio
import json
import threading

import numpy as np
import pytest
import torch

from batchscope.storage.records import BatchRow, EventRow, ListRecorder, RequestRow
from runtime.api.config import BatchingConfig
from runtime.engine.engine import Engine
from runtime.api.errors import OutOfMemory
from runtime.models.toys import OOMModel
from runtime.device.oom import (Attempt, MemoryBudgetExceeded, SizeGovernor, check_budget, is_oom,
                         run_splitting)


# -- detection -------------------------------------------------------------------------
def test_is_oom_recognises_cuda_and_text_and_budget():
    assert is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB"))
    assert is_oom(RuntimeError("CUDA out of memory"))
    assert is_oom(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate: out of memory"))
    assert is_oom(MemoryBudgetExceeded("over budget"))
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))


def test_check_budget_compares_the_estimate():
    model = OOMModel(bytes_per_item=1 << 20)
    check_budget(model, 4, None, 4.0)
    check_budget(model, 1000, None, None)
    with pytest.raises(MemoryBudgetExceeded, match="memory_budget_mb=4"):
        check_budget(model, 5, None, 4.0)


# -- split and retry ---------------------------------------------------------------------
def fits_up_to(limit: int):
    def attempt(lo: int, hi: int) -> Attempt:
        outcome = "ok" if hi - lo <= limit else "oom"
        return Attempt(lo, hi, outcome, 0.0, 0.0, 0.0)
    return attempt


def test_run_splitting_halves_until_it_fits():
    freed = []
    attempts = run_splitting(10, fits_up_to(3), recover=True, free=lambda: freed.append(1))
    assert [(a.start, a.stop, a.outcome, a.split) for a in attempts] == [
        (0, 10, "oom", True), (0, 5, "oom", True), (0, 3, "ok", False), (3, 5, "ok", False),
        (5, 10, "oom", True), (5, 8, "ok", False), (8, 10, "ok", False)]
    assert len(freed) == 3


def test_run_splitting_stops_at_single_requests():
    attempts = run_splitting(2, fits_up_to(0), recover=True, free=lambda: None)
    leaves = [(a.start, a.outcome) for a in attempts if not a.split]
    assert leaves == [(0, "oom"), (1, "oom")]


def test_run_splitting_without_recovery_tries_once():
    attempts = run_splitting(8, fits_up_to(4), recover=False, free=lambda: None)
    assert [(a.size, a.outcome, a.split) for a in attempts] == [(8, "oom", False)]


# -- the effective max batch size ---------------------------------------------------------
def test_governor_backs_off_to_the_halves_and_probes_back_up():
    gov = SizeGovernor(configured_max=32, probe_after_batches=3)
    assert gov.limit(None) == 32
    assert gov.on_oom(None, 32) == 16
    assert gov.on_oom(None, 16) == 8
    assert [gov.on_success(None) for _ in range(3)] == [None, None, 16]
    assert gov.limit(None) == 16
    assert [gov.on_success(None) for _ in range(3)] == [None, None, 32]
    assert gov.caps == {} and gov.on_success(None) is None


def test_governor_oom_resets_the_clean_count():
    gov = SizeGovernor(configured_max=8, probe_after_batches=2)
    gov.on_oom(None, 8)
    gov.on_success(None)
    gov.on_oom(None, 4)
    assert gov.limit(None) == 2
    assert gov.on_success(None) is None and gov.on_success(None) == 4


def test_governor_lowers_longer_buckets_too():
    gov = SizeGovernor(configured_max=32, probe_after_batches=10)
    gov.on_oom(64, 32, longer=[32, 64, 128, -1])
    assert (gov.limit(32), gov.limit(64), gov.limit(128), gov.limit(-1)) == (32, 16, 16, 16)
    gov.on_oom(-1, 16, longer=[32, 64, 128, -1])
    assert (gov.limit(64), gov.limit(-1)) == (16, 8)


def test_governor_reconfigure_drops_caps_above_the_new_max():
    gov = SizeGovernor(configured_max=32, probe_after_batches=10)
    gov.on_oom(None, 32)
    gov.reconfigure(configured_max=8, probe_after_batches=10)
    assert gov.limit(None) == 8 and gov.caps == {}


# -- through the engine -------------------------------------------------------------------
def run(coro, timeout_s: float = 30.0):
    return asyncio.run(asyncio.wait_for(coro, timeout_s))


def vec(v: float) -> dict[str, np.ndarray]:
    return {"INPUT0": np.full(4, v, dtype=np.float32)}


async def storm(engine: Engine, model: OOMModel, n: int) -> list:
    """Hold one batch, queue ``n`` requests behind it, release: they form one batch."""
    hold = threading.Event()
    model.hold = hold
    first = asyncio.ensure_future(engine.infer("oomtoy", vec(-1.0)))
    await asyncio.to_thread(model.entered.wait, 10.0)
    model.hold = None
    tasks = [asyncio.ensure_future(engine.infer("oomtoy", vec(i))) for i in range(n)]
    for _ in range(3):
        await asyncio.sleep(0)
    hold.set()
    return await asyncio.gather(first, *tasks, return_exceptions=True)


def test_oom_storm_all_succeed_effective_max_drops_then_probes_back():
    async def main():
        rec = ListRecorder()
        model = OOMModel(oom_above=8)
        engine = Engine({"oomtoy": model},
                        {"oomtoy": BatchingConfig(max_batch_size=32, oom_probe_after_batches=3)},
                        recorder=rec)
        await engine.start()
        results = await storm(engine, model, 32)
        assert all(isinstance(r, dict) for r in results)
        assert [float(r["OUTPUT0"][0]) for r in results[1:]] == [2.0 * i for i in range(32)]
        assert model.oom_sizes == [32, 16, 16]
        assert model.batch_sizes == [1, 8, 8, 8, 8]
        stats = engine.stats("oomtoy")
        assert stats["effective_max_batch_size"] == 8 and stats["oom_events"] == 3
        batches = rec.of(BatchRow)
        assert [(b.batch_size, b.outcome) for b in batches] == [
            (1, "ok"), (32, "oom"), (16, "oom"), (8, "ok"), (8, "ok"), (16, "oom"), (8, "ok"),
            (8, "ok")]
        events = [e for e in rec.of(EventRow) if e.kind == "oom"]
        assert len(events) == 3 and all(e.severity == "error" for e in events)
        first = json.loads(events[0].details_json)
        assert first["batch_size"] == 32 and first["effective_max_batch_size"] == 16
        assert "split into 2 batches of 16/16" in first["action"]
        assert "rss_bytes" in first["memory"]
        oks = [r for r in rec.of(RequestRow)]
        assert len(oks) == 33 and {r.outcome for r in oks} == {"ok"}
        # while capped, a storm is cut to 8 without any OOM
        await storm(engine, model, 16)
        assert model.oom_sizes == [32, 16, 16] and model.batch_sizes[-2:] == [8, 8]
        # clean batches (the storm's 3 count) -> probe up to 16
        assert engine.stats("oomtoy")["effective_max_batch_size"] == 16
        probes = [e for e in rec.of(EventRow) if e.kind == "oom_probe"]
        assert len(probes) == 1 and json.loads(probes[0].details_json)["effective_max_batch_size"] == 16
        # the probe was too optimistic: 16 runs out of memory again and backs off
        results = await storm(engine, model, 16)
        assert all(isinstance(r, dict) for r in results)
        assert model.oom_sizes[-1] == 16
        assert engine.stats("oomtoy")["effective_max_batch_size"] == 8
        await engine.stop()
    run(main())


def test_single_request_that_cannot_fit_gets_507():
    async def main():
        rec = ListRecorder()
        model = OOMModel(oom_above=0)
        engine = Engine({"oomtoy": model}, recorder=rec)
        await engine.start()
        with pytest.raises(OutOfMemory, match="does not fit .* even alone") as info:
            await engine.infer("oomtoy", vec(1.0))
        assert info.value.http_status == 507
        assert [r.outcome for r in rec.of(RequestRow)] == ["oom"]
        assert [(e.kind, e.severity) for e in rec.of(EventRow)] == [("oom_failed", "error")]
        await engine.stop()
    run(main())


def test_storm_with_one_oversize_request_fails_only_that_one():
    class PickyOOM(OOMModel):
        def predict(self, batch):
            if bool((batch[:, 0] == 13.0).any()):
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (item 13 is huge)")
            return super().predict(batch)

    async def main():
        model = PickyOOM(oom_above=100)
        engine = Engine({"oomtoy": model})
        await engine.start()
        results = await storm(engine, model, 16)
        failed = [i for i, r in enumerate(results[1:]) if isinstance(r, OutOfMemory)]
        assert failed == [13]
        assert sum(isinstance(r, dict) for r in results) == 16
        await engine.stop()
    run(main())


def test_memory_budget_counts_as_oom_before_running():
    async def main():
        rec = ListRecorder()
        model = OOMModel(oom_above=1000, bytes_per_item=1 << 20)
        engine = Engine({"oomtoy": model},
                        {"oomtoy": BatchingConfig(memory_budget_mb=4.5)}, recorder=rec)
        await engine.start()
        results = await storm(engine, model, 16)
        assert all(isinstance(r, dict) for r in results)
        assert max(model.batch_sizes) <= 4 and model.oom_sizes == []
        assert engine.stats("oomtoy")["effective_max_batch_size"] == 4
        event = [e for e in rec.of(EventRow) if e.kind == "oom"][0]
        assert "memory_budget_mb=4.5" in json.loads(event.details_json)["error"]
        await engine.stop()
    run(main())


def test_without_recovery_an_oom_fails_the_batch_with_507():
    async def main():
        model = OOMModel(oom_above=4)
        engine = Engine({"oomtoy": model}, {"oomtoy": BatchingConfig(oom_recovery=False)})
        await engine.start()
        results = await storm(engine, model, 8)
        assert isinstance(results[0], dict)
        assert all(isinstance(r, OutOfMemory) and "oom_recovery is off" in r.message
                   for r in results[1:])
        await engine.stop()
    run(main())
