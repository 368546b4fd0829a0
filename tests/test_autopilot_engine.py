"""The autopilot on a real engine and in a real server: its decisions are settings
changes requested by "autopilot", with their reasons in autopilot events.

The starting settings make every request wait 200 ms for companions while the SLO is
50 ms, so the first judged window is over the SLO whatever the machine's speed, and
the first decision is known: halve the delay.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from batchscope.storage import control
from batchscope.storage.db import make_engine
from batchscope.storage.records import EventRow, ListRecorder
from batchscope.storage.schema import EventRecord
from tests.factories import stored, wait_until
from runtime.api.config import BatchingConfig, ServerConfig
from runtime.autopilot.controller import Tuning
from runtime.autopilot.shell import Autopilot
from runtime.engine.engine import Engine
from runtime.models.toys import DoubleModel, VarLenModel
from runtime.server.service import Service, ServiceThread

START = BatchingConfig(max_queue_delay_ms=200.0, autopilot_slo_p99_ms=50.0)


def vec(v: float) -> dict[str, np.ndarray]:
    return {"INPUT0": np.full(4, v, dtype=np.float32)}


def autopilot_events(rec: ListRecorder) -> list[EventRow]:
    return [e for e in rec.of(EventRow) if e.kind == "autopilot"]


def settings_changes(rec: ListRecorder) -> list[dict]:
    return [json.loads(e.details_json) for e in rec.of(EventRow) if e.kind == "settings_change"]


@pytest.mark.slow
def test_decisions_on_a_real_engine_are_settings_changes_by_the_autopilot():
    rec = ListRecorder()

    async def main() -> Engine:
        engine = Engine({"double": DoubleModel()}, {"double": START}, recorder=rec)
        await engine.start()
        pilot = Autopilot(engine, recorder=rec, interval_s=0.02,
                          tuning=Tuning(min_samples=20, min_window_s=0.1, cooldown_s=0.05))
        pilot.start()
        try:
            for _ in range(100):  # rounds of 24 at once: each waits out the delay
                await asyncio.gather(*(engine.infer("double", vec(i)) for i in range(24)))
                if len(settings_changes(rec)) >= 2:
                    break
            assert pilot.state("double")["state"] in ("lowering", "settling", "watching")
            # someone else changes a setting: the controller starts again from there
            engine.update_settings("double", {"max_batch_size": 16}, requested_by="pytest")
            for _ in range(100):
                await asyncio.sleep(0.02)
                if "settings changed" in autopilot_events(rec)[-1].message:
                    break
            assert pilot.state("double")["start"]["max_batch_size"] == 16
            # switched off: the settings stay where they are
            engine.update_settings("double", {"autopilot_slo_p99_ms": None}, requested_by="pytest")
            for _ in range(100):
                await asyncio.sleep(0.02)
                if pilot.state("double") is None:
                    break
            assert pilot.state("double") is None
        finally:
            await pilot.stop()
            await engine.stop()
        return engine

    engine = asyncio.run(asyncio.wait_for(main(), 60.0))
    changes = settings_changes(rec)
    first, second = changes[0], changes[1]
    assert first["requested_by"] == second["requested_by"] == "autopilot"
    assert first["changes"] == {"max_queue_delay_ms": 100.0}
    assert second["changes"] == {"max_queue_delay_ms": 50.0}
    assert (first["old"]["max_queue_delay_ms"], first["new"]["max_queue_delay_ms"]) == (200.0, 100.0)
    events = [e.message for e in autopilot_events(rec)]
    assert events[0].startswith("autopilot on: p99 SLO 50 ms, starting from max_batch_size=32, "
                                "max_queue_delay_ms=200")
    assert events[1].startswith("p99 ") and events[1].endswith(
        "> SLO 50 ms: max_queue_delay_ms 200 -> 100")
    assert "autopilot settings changed" in " ".join(events)
    assert events[-1] == "autopilot off: the settings stay as they are"
    version, config = engine.get_settings("double")
    assert config.autopilot_slo_p99_ms is None and config.max_batch_size == 16
    assert config.max_queue_delay_ms is not None and config.max_queue_delay_ms <= 50.0


@pytest.mark.slow
def test_the_server_runs_the_autopilot_switched_on_over_the_control_api(tmp_path):
    db_url = f"sqlite:///{tmp_path / 'bs.db'}"
    cfg = ServerConfig(database_url=db_url, heartbeat_interval_s=0.2, control_poll_interval_s=0.05)
    service = Service({"double": DoubleModel()}, None, cfg, instance_id="autopilot-test")
    runner = ServiceThread(service)
    url = runner.start()
    db = make_engine(db_url)
    try:
        with httpx.Client(base_url=url, timeout=30.0) as http:
            r = http.patch("/v2/models/double/batching",
                           json={"max_queue_delay_ms": 200, "autopilot_slo_p99_ms": 50})
            assert r.status_code == 200, r.text
            bad = http.patch("/v2/models/double/batching",
                             json={"policy": "adaptive"})  # the autopilot needs dynamic
            assert bad.status_code == 422 and "needs policy='dynamic'" in bad.json()["error"]
            body = {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                                "data": [1.0, 2.0, 3.0, 4.0]}]}

            def http_delay(client: httpx.Client = http) -> float | None:
                return client.get("/v2/models/double/batching").json()["settings"][
                    "max_queue_delay_ms"]

            def client(_: int) -> None:  # load until the autopilot has moved the delay
                with httpx.Client(base_url=url, timeout=30.0) as own:
                    for _ in range(12):
                        if http_delay(own) != 200.0:
                            return
                        assert own.post("/v2/models/double/infer", json=body).status_code == 200

            with ThreadPoolExecutor(24) as pool:
                list(pool.map(client, range(24)))
            assert wait_until(lambda: http_delay() == 100.0, 400, 0.05)
        assert wait_until(lambda: any(c.requested_by == "autopilot"
                                      for c in control.settings_history(db, "double")), 400, 0.05)
        change = next(c for c in control.settings_history(db, "double")
                      if c.requested_by == "autopilot")
        assert (change.old["max_queue_delay_ms"], change.new["max_queue_delay_ms"]) == (200.0, 100.0)
        reasons = [e.message for e in stored(db, EventRecord, EventRow) if e.kind == "autopilot"]
        assert reasons[0].startswith("autopilot on: p99 SLO 50 ms")
        assert any(m.endswith("max_queue_delay_ms 200 -> 100") for m in reasons)
    finally:
        runner.stop()
        db.dispose()


class _PerTokenVarLen(VarLenModel):
    """A variable-length model whose batch takes 20 us per padded token."""

    def predict(self, batch):
        time.sleep(batch.numel() * 20e-6)
        return super().predict(batch)


@pytest.mark.slow
def test_on_a_real_engine_coarse_edges_give_way_to_derived_ones():
    # lengths 4..64 under one edge at 128: about three quarters of every batch is padding
    rec = ListRecorder()
    start = BatchingConfig(max_batch_size=32, bucket_edges=(128,), autopilot_slo_p99_ms=1.0)
    rng = np.random.default_rng(3)

    async def main() -> Engine:
        engine = Engine({"varlen": _PerTokenVarLen()}, {"varlen": start}, recorder=rec)
        await engine.start()
        pilot = Autopilot(engine, recorder=rec, interval_s=0.02,
                          tuning=Tuning(min_samples=20, min_batches=3, min_window_s=0.1,
                                        cooldown_s=0.05, fallback_after=10_000))
        pilot.start()

        async def client() -> None:
            for _ in range(400):
                if engine.get_settings("varlen")[1].bucket_edges is None:
                    return
                n = int(rng.integers(4, 65))
                await engine.infer("varlen", {"INPUT0": np.ones(n, dtype=np.float32)})

        try:
            await asyncio.gather(*(client() for _ in range(24)))
        finally:
            await pilot.stop()
            await engine.stop()
        return engine

    engine = asyncio.run(asyncio.wait_for(main(), 60.0))
    moved = [c for c in settings_changes(rec) if "bucket_edges" in c["changes"]]
    assert moved and moved[0]["requested_by"] == "autopilot"
    assert moved[0]["changes"]["bucket_edges"] is None
    reason = next(e.message for e in autopilot_events(rec) if "bucket_edges" in e.message)
    assert "of the padded tokens padding" in reason and "bucket_edges 128 -> null" in reason
    assert engine.get_settings("varlen")[1].bucket_edges is None
