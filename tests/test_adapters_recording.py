"""What a model with LoRA adapters records: each batch the number of distinct adapters it
mixed, each request the adapter it named, through the request engine and into the
database (both backends), and a database of schema version 8 upgrading to take them."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from sqlalchemy import select

from batchscope.storage import db as storage_db
from batchscope.storage.db import make_engine, schema_revision, schema_version
from batchscope.storage.records import BatchRow, ListRecorder, RequestBatch, RequestRow
from batchscope.storage.recorder import Recorder
from batchscope.storage.schema import SCHEMA_VERSION, BatchRecord, RequestRecord
from runtime.adapters.demo import write_demo_adapters
from runtime.api.config import BatchingConfig
from runtime.engine.engine import Engine
from runtime.models.encoder import EncoderModel
from runtime.models.toys import DoubleModel
from tests.factories import database_at


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return write_demo_adapters(str(tmp_path_factory.mktemp("adapters")), 3)


async def _serve(paths: dict[str, str], rec: ListRecorder, mixing: bool) -> None:
    config = BatchingConfig(max_batch_size=16, max_queue_delay_ms=20.0, adapter_mixing=mixing)
    engine = Engine({"encoder": EncoderModel()}, {"encoder": config}, recorder=rec,
                    inline_max_compute_ms=0)
    for name, path in paths.items():
        engine.register_adapter("encoder", name, path)
    await engine.start()
    try:
        names = [None, *paths]
        ids = np.arange(1, 9, dtype=np.int64)
        await asyncio.gather(*(
            engine.infer("encoder", {"INPUT_IDS": ids},
                         **({} if names[i % 4] is None else {"adapter": names[i % 4]}))
            for i in range(12)))
    finally:
        await engine.stop()


@pytest.mark.parametrize("mixing", [True, False])
def test_batches_count_their_adapters_and_requests_name_theirs(paths, mixing):
    rec = ListRecorder()
    asyncio.run(_serve(paths, rec, mixing))
    requests = [r for r in rec.records if type(r) is RequestRow]
    batches = [r for r in rec.records if type(r) is BatchRow]
    assert sorted(map(str, (r.adapter for r in requests))) == sorted(
        ["None"] * 3 + ["enc-0"] * 3 + ["enc-1"] * 3 + ["enc-2"] * 3)
    by_seq: dict[int, set] = {}
    for r in requests:
        by_seq.setdefault(r.batch_seq, set()).add(r.adapter)
    for b in batches:
        assert b.adapters == len(by_seq[b.seq] - {None})
    if mixing:
        assert max(b.adapters for b in batches) >= 2
    else:
        assert max(b.adapters for b in batches) == 1


def test_a_model_that_takes_no_adapters_records_none():
    rec = ListRecorder()

    async def run() -> None:
        engine = Engine({"double": DoubleModel()}, recorder=rec, inline_max_compute_ms=0)
        await engine.start()
        try:
            await engine.infer("double", {"INPUT0": np.ones(4, dtype=np.float32)})
        finally:
            await engine.stop()

    asyncio.run(run())
    assert [b.adapters for b in rec.records if type(b) is BatchRow] == [None]
    assert [r.adapter for r in rec.records if type(r) is RequestRow] == [None]


def _block(adapters):
    return RequestBatch("rt-1", "encoder", 1, "ok", 10.0, 10.5, 1000.0, [0, 0], [9.9, 10.0],
                        [False, False], adapters=adapters)


def test_request_batches_carry_the_adapter_column():
    assert [r.adapter for r in _block(["enc-0", None]).rows()] == ["enc-0", None]
    assert [r.adapter for r in _block(None).rows()] == [None, None]


@pytest.mark.both_backends
def test_rows_are_written_and_an_older_database_upgrades(db_url):
    database_at(db_url, "0007", 
            "INSERT INTO batches (instance_id, model, seq, policy, settings_version, "
            "max_batch_size, bucket, batch_size, real_elements, padded_elements, "
            "queue_wait_min_s, queue_wait_mean_s, queue_wait_max_s, compute_s, started_at, "
            "ended_at, outcome, cuda_graph) VALUES ('rt-0', 'encoder', 1, 'dynamic', 1, 8, "
            "NULL, 1, 4, 4, 0, 0, 0, 0.01, 999.0, 999.01, 'ok', false)")
    engine = make_engine(db_url)
    try:
        assert schema_version(engine) == SCHEMA_VERSION >= 9
        assert schema_revision(engine) == storage_db._head() >= "0008"
        rec = Recorder(engine)
        rec.put(BatchRow("rt-1", "encoder", 1, "dynamic", 1, 8, None, 2, 8, 8, 0.0, 0.0, 0.0,
                         0.01, 1000.0, 1000.01, adapters=1))
        rec.put(_block(["enc-0", None]))
        rec.flush()
        with engine.connect() as conn:
            got = conn.execute(select(BatchRecord.instance_id, BatchRecord.adapters)
                               .order_by(BatchRecord.id)).all()
            assert [tuple(r) for r in got] == [("rt-0", None), ("rt-1", 1)]
            adapters = conn.execute(select(RequestRecord.adapter)
                                    .order_by(RequestRecord.id)).scalars().all()
            assert adapters == ["enc-0", None]
    finally:
        engine.dispose()


def test_metrics_label_requests_by_registered_adapter_and_count_the_slot_cache():
    from runtime.server.metrics import MetricsRecorder

    registered = {"encoder": ["enc-0", "enc-1"]}
    stats = {"encoder": {"adapters": {"slot_hits": 5, "slot_misses": 2, "slot_evictions": 1}},
             "double": {"adapters": None}}
    m = MetricsRecorder(stats=lambda: stats)
    m.bind(adapters=lambda: registered)
    m.put(_block(["enc-0", None]))
    m.put(RequestRow("rt-1", "encoder", 2, 0, 1.0, 1.2, 0.1, 0.2, "ok", adapter="enc-1"))
    m.put(RequestRow("rt-1", "double", 3, 0, 1.0, 1.2, 0.1, 0.2, "ok"))
    text = m.render().decode()
    assert 'batchscope_adapter_requests_total{adapter="enc-0",model="encoder",outcome="ok"} 1.0' in text
    assert 'batchscope_adapter_requests_total{adapter="",model="encoder",outcome="ok"} 1.0' in text
    assert 'batchscope_adapter_requests_total{adapter="enc-1",model="encoder",outcome="ok"} 1.0' in text
    assert 'model="double"' not in "\n".join(l for l in text.splitlines() if "adapter_" in l)
    assert 'batchscope_adapter_request_latency_seconds_count{adapter="enc-0",model="encoder"} 1.0' in text
    assert 'batchscope_adapter_slot_hits_total{model="encoder"} 5.0' in text
    assert 'batchscope_adapter_slot_misses_total{model="encoder"} 2.0' in text
    assert 'batchscope_adapter_slot_evictions_total{model="encoder"} 1.0' in text
    # unloaded: its series go; a name never registered gets none
    registered["encoder"] = ["enc-0"]
    m.put(RequestRow("rt-1", "encoder", 4, 0, 1.0, 1.2, 0.1, 0.2, "ok", adapter="zzz"))
    text = m.render().decode()
    assert 'adapter="enc-1"' not in text and 'adapter="zzz"' not in text
    assert 'adapter="enc-0"' in text
