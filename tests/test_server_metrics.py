"""The Prometheus adapter: records in, parseable text out."""

from __future__ import annotations

from batchscope.storage.records import EventRow
from runtime.server.metrics import MetricsRecorder
from tests.factories import metric_batch as batch, metric_request as request, samples


def test_records_become_series_and_scrape_time_gauges_are_read():
    depth = {"mlp": 0}
    m = MetricsRecorder(stats=lambda: {"mlp": {"queue_depth": depth["mlp"], "in_flight": 2,
                                               "effective_max_batch_size": 16}},
                        dropped=lambda: 7)
    m.put(batch("mlp", 8, 0.004))
    m.put(batch("mlp", 3, 0.002))
    for _ in range(5):
        m.put(request("mlp", "ok", priority=0))
    m.put(request("mlp", "rejected", latency_s=0.0001))
    m.put(EventRow(instance_id="i", model="mlp", at=0.0, kind="x", message="ignored"))
    depth["mlp"] = 12
    s = samples(m)
    assert s[("batchscope_batch_size_count", (("model", "mlp"),))] == 2
    assert s[("batchscope_batch_size_sum", (("model", "mlp"),))] == 11
    assert s[("batchscope_batch_size_bucket", (("le", "4.0"), ("model", "mlp")))] == 1
    assert s[("batchscope_requests_total", (("model", "mlp"), ("outcome", "ok")))] == 5
    assert s[("batchscope_requests_total", (("model", "mlp"), ("outcome", "rejected")))] == 1
    # queue wait only for requests that ran
    assert s[("batchscope_queue_wait_seconds_count", (("model", "mlp"),))] == 5
    lat = ("batchscope_request_latency_seconds_count",
           (("model", "mlp"), ("outcome", "ok"), ("priority", "1")))  # engine priority 0
    assert s[lat] == 5
    assert s[("batchscope_queue_depth", (("model", "mlp"),))] == 12
    assert s[("batchscope_effective_max_batch_size", (("model", "mlp"),))] == 16
    assert s[("batchscope_recorder_dropped_records_total", ())] == 7
