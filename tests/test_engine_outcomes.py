"""Every accepted request gets exactly one outcome and one RequestRow, whatever happens."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import numpy as np

from batchscope.storage.records import ListRecorder, RequestRow
from runtime.api.config import BatchingConfig
from runtime.engine.engine import Engine
from runtime.api.errors import BatchScopeError, QueueFull
from runtime.models.toys import DoubleModel, FailingModel, OOMModel


def test_mixed_load_with_cancellations_and_stop_gives_one_outcome_each():
    async def main():
        rng = random.Random(7)
        rec = ListRecorder()
        models = {"double": DoubleModel(), "failing": FailingModel(), "oomtoy": OOMModel(oom_above=3)}
        cfg = BatchingConfig(max_batch_size=8, max_queue_size=60)
        engine = Engine(models, {name: cfg for name in models}, recorder=rec)
        await engine.start()

        async def one(i: int) -> str:
            name = rng.choice(sorted(models))
            value = -1.0 if (name == "failing" and i % 5 == 0) else float(i)
            try:
                await engine.infer(name, {"INPUT0": np.full(4, value, np.float32)},
                                   priority=rng.randrange(3),
                                   timeout_ms=rng.choice([None, None, 0.5, 50.0]),
                                   bypass=rng.random() < 0.1)
                return "ok"
            except QueueFull:
                return "rejected"
            except BatchScopeError as exc:
                return exc.reason

        # a first wave runs to completion, a second is cut short by cancellations and stop
        first = [asyncio.ensure_future(one(i)) for i in range(300)]
        await asyncio.gather(*first, return_exceptions=True)
        second = [asyncio.ensure_future(one(i)) for i in range(300, 600)]
        while sum(task.done() for task in second) < 20:
            await asyncio.sleep(0)
        for task in second[::7]:
            task.cancel()
        await engine.stop(drain_timeout_s=0.0)
        results = await asyncio.gather(*first, *second, return_exceptions=True)
        outcomes = Counter("cancelled" if isinstance(r, asyncio.CancelledError) else r
                           for r in results)
        rows = rec.of(RequestRow)
        assert len(rows) == 600, outcomes
        by_row = Counter(r.outcome for r in rows)
        seen = {"ok": outcomes["ok"], "rejected": outcomes["rejected"],
                "error": outcomes["model_error"], "oom": outcomes["oom"],
                "expired": outcomes["expired"], "cancelled": outcomes["shutting_down"]}
        # a task cancelled by its client has one row too: "cancelled", or the answer the
        # engine gave in the same instant; every other task's row matches what it saw
        extra = {kind: by_row[kind] - seen[kind] for kind in seen}
        assert min(extra.values()) >= 0, (by_row, outcomes)
        assert sum(extra.values()) == outcomes["cancelled"], (by_row, outcomes)
        # the mix really happened
        assert min(outcomes["ok"], outcomes["rejected"], outcomes["model_error"],
                   outcomes["expired"], outcomes["shutting_down"]) > 0, outcomes
    asyncio.run(asyncio.wait_for(main(), 60))
