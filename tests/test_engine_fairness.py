"""Several models on one device: a flooded model must not starve another."""

from __future__ import annotations

import asyncio

import numpy as np

from runtime.api.config import BatchingConfig
from runtime.engine.engine import Engine
from runtime.models.toys import DoubleModel


def vec(v: float) -> dict[str, np.ndarray]:
    return {"INPUT0": np.full(4, v, dtype=np.float32)}


def test_occasional_model_is_served_within_a_bounded_number_of_flooder_batches():
    async def main():
        journal: list = []
        flood, quiet = DoubleModel(journal=journal), DoubleModel(journal=journal)
        engine = Engine({"flood": flood, "quiet": quiet},
                        {"flood": BatchingConfig(max_batch_size=4, max_queue_size=10_000)})
        await engine.start()
        flood_tasks = [asyncio.ensure_future(engine.infer("flood", vec(i))) for i in range(400)]

        def flood_batches() -> int:
            return sum(1 for model, _ in journal if model is flood)

        waited = []
        for k in range(5):
            while flood_batches() < 5 * (k + 1):
                await asyncio.sleep(0)
            before = flood_batches()
            await engine.infer("quiet", vec(1000 + k))
            waited.append(flood_batches() - before)
        assert flood_batches() < 100, "the flood must still have been running"
        # the batch running when the request arrived, and at most one more
        assert max(waited) <= 2, waited
        await asyncio.gather(*flood_tasks)
        assert flood_batches() == 100 and quiet.batch_sizes == [1] * 5
        fs, qs = engine.stats("flood"), engine.stats("quiet")
        assert fs["device_grants"] == 100 and qs["device_grants"] == 5
        assert fs["device_time_s"] > 0 and qs["device_time_s"] > 0
        await engine.stop()
    asyncio.run(asyncio.wait_for(main(), 60))
