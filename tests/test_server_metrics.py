"""The Prometheus adapter: records in, parseable text out."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from batchscope.storage.records import BatchRow, EventRow, RequestRow
from runtime.server.metrics import MetricsRecorder


def batch(model: str, size: int, compute_s: float) -> BatchRow:
    return BatchRow(instance_id="i", model=model, seq=1, policy="dynamic", settings_version=1,
                    max_batch_size=32, bucket=None, batch_size=size, real_elements=size,
                    padded_elements=size, queue_wait_min_s=0.0, queue_wait_mean_s=0.0,
                    queue_wait_max_s=0.0, compute_s=compute_s, started_at=0.0, ended_at=1.0)


def request(model: str, outcome: str, priority: int = 1, latency_s: float = 0.01) -> RequestRow:
    return RequestRow(instance_id="i", model=model, batch_seq=1, priority=priority, arrived_at=0.0,
                      finished_at=latency_s, queue_wait_s=0.002, latency_s=latency_s,
                      outcome=outcome)


def samples(metrics: MetricsRecorder) -> dict:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


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
           (("model", "mlp"), ("outcome", "ok"), ("priority", "0")))
    assert s[lat] == 5
    assert s[("batchscope_queue_depth", (("model", "mlp"),))] == 12
    assert s[("batchscope_effective_max_batch_size", (("model", "mlp"),))] == 16
    assert s[("batchscope_recorder_dropped_records", ())] == 7
