"""``RequestBatch``: one record per batch on the hot path, the same rows and series as
one ``RequestRow`` per request everywhere they end up (database by thread or child
process, Prometheus, in-memory recorders, recorders that only know rows)."""

from __future__ import annotations

import asyncio
import random

import numpy as np

import pytest

from batchscope.storage.db import make_engine
from batchscope.storage.records import ListRecorder, RequestBatch, RequestRow, expand
from batchscope.storage.recorder import Recorder, TeeRecorder
from batchscope.storage.schema import RequestRecord
from runtime.api.config import BatchingConfig
from runtime.engine.engine import Engine
from runtime.models.toys import DoubleModel
from runtime.server.metrics import MetricsRecorder
from tests.factories import samples, stored

OFFSET = 1_700_000_000.0


def block(seq: int, n: int = 5, *, mixed: bool = False, lengths: bool = True) -> RequestBatch:
    rng = random.Random(seq)
    arrived = sorted(100.0 + seq + rng.uniform(0, 0.01) for _ in range(n))
    return RequestBatch("rt", "mlp", seq, "ok", 100.02 + seq, 100.03 + seq, OFFSET,
                        [rng.randrange(3) if mixed else 1 for _ in range(n)], arrived,
                        [i % 2 == 0 for i in range(n)],
                        [rng.randrange(8, 128) for _ in range(n)] if lengths else None)


def one_by_one(b: RequestBatch) -> list[RequestRow]:
    """What the engine used to build per request."""
    return [RequestRow(b.instance_id, b.model, b.batch_seq, p, a + b.wall_offset_s,
                       b.finished_s + b.wall_offset_s, b.started_s - a, b.finished_s - a,
                       b.outcome, by, None if b.lengths is None else b.lengths[i])
            for i, (p, a, by) in enumerate(zip(b.priorities, b.arrived_s, b.bypass))]


def test_rows_are_exactly_the_per_request_rows():
    for b in (block(1), block(2, mixed=True), block(3, lengths=False), block(4, n=1)):
        assert b.rows() == one_by_one(b) and len(b) == len(b.arrived_s)
    single = RequestRow("rt", "mlp", 9, 0, 1.0, 2.0, 0.1, 1.0, "rejected")
    assert expand([single, block(5), single]) == [single, *block(5).rows(), single]
    memory = ListRecorder()
    memory.put(block(6))
    memory.put_many([single, block(7)])
    assert memory.records == [*block(6).rows(), single, *block(7).rows()]


@pytest.mark.parametrize("writer_process", [False, True])
@pytest.mark.both_backends
def test_database_rows_match_and_drops_count_requests(db_url, writer_process):
    engine = make_engine(db_url)
    rec = Recorder(engine, buffer_size=4, writer_process=writer_process)
    blocks = [block(1), block(2, mixed=True), block(3, lengths=False)]
    single = RequestRow("rt", "mlp", None, 2, OFFSET + 5, OFFSET + 6, 0.0, 1.0, "expired")
    rec.put_many([blocks[0], single, blocks[1], blocks[2]])
    rec.put(block(4, n=7))   # the buffer (4 records) is full: its 7 requests are dropped
    assert rec.dropped == 7 and rec.dropped_by_kind == {"requests": 7}
    assert rec.flush() == 16
    assert rec.written_by_kind == {"requests": 16}
    want = [*blocks[0].rows(), single, *blocks[1].rows(), *blocks[2].rows()]
    got = stored(engine, RequestRecord, RequestRow)
    key = lambda r: (r.batch_seq or 0, r.arrived_at)  # noqa: E731 - the child writes per type
    assert sorted(got, key=key) == sorted(want, key=key)
    if not writer_process:
        assert got == want   # in the thread, rows keep their order
    rec.close()
    engine.dispose()


def test_prometheus_series_are_the_same_as_from_rows():
    by_block, by_row = MetricsRecorder(), MetricsRecorder()
    for seq in range(40):
        b = block(seq, n=1 + seq % 9, mixed=seq % 3 == 0)
        by_block.put(b)
        by_row.put_many(b.rows())
    got, want = samples(by_block), samples(by_row)
    got = {k: v for k, v in got.items() if not k[0].endswith("_created")}
    want = {k: v for k, v in want.items() if not k[0].endswith("_created")}
    assert got.keys() == want.keys() and len(got) > 10
    assert all(abs(got[k] - v) < 1e-9 * max(1.0, abs(v)) for k, v in want.items())


def test_engine_hands_batches_only_to_recorders_that_take_them():
    class RowsOnly:
        def __init__(self):
            self.records = []

        def put(self, record):
            self.records.append(record)

    assert TeeRecorder(ListRecorder(), MetricsRecorder()).accepts_request_batches
    assert not TeeRecorder(ListRecorder(), RowsOnly()).accepts_request_batches

    async def run(recorder):
        engine = Engine({"double": DoubleModel()}, {"double": BatchingConfig(max_batch_size=4)},
                        recorder=recorder)
        await engine.start()
        try:
            await asyncio.gather(*(engine.infer("double", {"INPUT0": np.ones(4, np.float32)})
                                   for _ in range(6)))
        finally:
            await engine.stop()

    plain, memory = RowsOnly(), ListRecorder()
    asyncio.run(run(plain))
    asyncio.run(run(memory))
    assert [type(r) for r in plain.records].count(RequestRow) == 6
    assert not any(type(r) is RequestBatch for r in plain.records)
    assert len(memory.of(RequestRow)) == 6
