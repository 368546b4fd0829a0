"""What a session reads and sends besides its own load: recorded traffic read back from
a real SQLite database and turned into an arrival schedule, model metadata with Triton's
batch dimension, and live figures from a real Prometheus exposition (the runtime's
``MetricsRecorder``)."""

from __future__ import annotations

import itertools

import orjson
import pytest
from sqlalchemy.orm import Session

from batchscope.load.loadgen import LoadError, item_metadata
from batchscope.load.replay import read_traffic, recorded_lengths, replay_arrivals
from batchscope.storage.records import RequestRow
from batchscope.storage.schema import RequestRecord
from batchscope.tuning.measure import Histogram, latency_histogram
from runtime.server.metrics import MetricsRecorder

VARLEN = {"name": "v", "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1]}]}
FIXED = {"name": "f", "inputs": [{"name": "X", "datatype": "FP32", "shape": [4]}]}


def record(db, model: str, arrivals: list[tuple[float, int | None, int, bool]],
           instance: str = "a") -> None:
    with Session(db) as s:
        s.add_all(RequestRecord(instance_id=instance, model=model, priority=priority,
                                bypass=bypass, length=length, arrived_at=at, finished_at=at + 0.01,
                                queue_wait_s=0.0, latency_s=0.01, outcome="ok")
                  for at, length, priority, bypass in arrivals)
        s.commit()


def test_recorded_traffic_reads_arrivals_lengths_and_priorities(db):
    record(db, "v", [(100.0, 8, 0, False), (100.5, 30, 2, True), (101.5, 12, 1, False)])
    record(db, "v", [(100.2, 99, 1, False)], instance="b")
    record(db, "other", [(100.1, 5, 1, False), (100.3, 5, 1, False)])
    traffic = read_traffic(db, "v", instance_id="a")
    assert traffic.offsets_s == (0.0, 0.5, 1.5)
    assert traffic.lengths == (8, 30, 12) and traffic.max_length == 30
    assert traffic.priorities == (1, 3, 2)      # engine 0..2 -> HTTP 1..3
    assert traffic.bypass == (False, True, False)
    assert traffic.rate_rps == pytest.approx(2 / 1.5)
    assert len(read_traffic(db, "v")) == 4
    assert read_traffic(db, "v", since=100.4).offsets_s == (0.0, 1.0)
    assert recorded_lengths(db, "v") == (8, 99) and recorded_lengths(db, "other") == (5, 5)
    with pytest.raises(LoadError, match="holds 1 recorded request"):
        read_traffic(db, "v", since=101.0)
    with pytest.raises(LoadError, match="holds 0 recorded request"):
        read_traffic(db, "nobody")


def test_replay_follows_the_schedule_and_the_lengths_then_wraps(db):
    record(db, "v", [(10.0, 3, 0, False), (10.2, 5, 1, False), (10.6, 4, 0, True)])
    traffic = read_traffic(db, "v")
    sent = list(itertools.islice(replay_arrivals(traffic, VARLEN, speed=2.0), 5))
    docs = [orjson.loads(body) for body, _ in sent]
    assert [d["inputs"][0]["shape"] for d in docs] == [[3], [5], [4], [3], [5]]
    assert [len(d["inputs"][0]["data"]) for d in docs] == [3, 5, 4, 3, 5]
    assert [round(gap, 6) for _, gap in sent] == [0.1, 0.2, 0.15, 0.1, 0.2]  # wrap: mean gap
    assert [d["parameters"]["priority"] for d in docs] == [1, 2, 1, 1, 2]
    assert docs[2]["parameters"]["realtime"] is True
    fixed = [orjson.loads(b) for b, _ in itertools.islice(replay_arrivals(traffic, FIXED), 3)]
    assert all(d["inputs"][0]["shape"] == [4] for d in fixed)
    with pytest.raises(LoadError, match="--replay-speed"):
        next(replay_arrivals(traffic, VARLEN, speed=0))


def test_metadata_led_by_the_batch_dimension_is_read_per_item():
    triton = {"name": "m", "inputs": [{"name": "X", "datatype": "FP32", "shape": [-1, 256]}],
              "outputs": [{"name": "Y", "datatype": "FP32", "shape": [-1, 10]}]}
    item = item_metadata(triton, {"max_batch_size": 32})
    assert item["inputs"][0]["shape"] == [256] and item["outputs"][0]["shape"] == [10]
    assert item_metadata(triton, {"max_batch_size": 0}) is triton
    assert item_metadata(triton, None) is triton


def test_live_figures_come_from_the_latency_histogram():
    metrics = MetricsRecorder()
    for k in range(100):   # 1 .. 100 ms, one request each
        metrics.put(RequestRow(instance_id="i", model="m", batch_seq=1, priority=k % 3,
                               arrived_at=0.0, finished_at=(k + 1) / 1000, queue_wait_s=0.0,
                               latency_s=(k + 1) / 1000, outcome="ok"))
    metrics.put(RequestRow(instance_id="i", model="other", batch_seq=1, priority=1,
                           arrived_at=0.0, finished_at=5.0, queue_wait_s=0.0, latency_s=5.0,
                           outcome="ok"))
    hist = latency_histogram(metrics.render().decode(), "m")
    assert hist.total == 100
    # buckets ... 25, 50, 100 ms: linear within each, as histogram_quantile reads them
    assert hist.quantile(0.5) == pytest.approx(50.0)
    assert hist.quantile(0.99) == pytest.approx(99.0)
    assert hist.at_most(50.0) == 50 and hist.at_most(75.0) == pytest.approx(75.0)
    earlier = Histogram(hist.bounds_ms, tuple(c / 2 for c in hist.cumulative))
    assert hist.minus(earlier).total == 50
    assert Histogram((), ()).quantile(0.99) is None
