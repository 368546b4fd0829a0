"""Folding pending records in groups gives exactly the series one observe per record gives."""

from __future__ import annotations

import random

from prometheus_client import CollectorRegistry, Histogram

from runtime.server import metrics as metrics_mod
from runtime.server.metrics import MetricsRecorder
from tests.factories import metric_batch as batch, metric_request as request, samples


def test_grouped_fold_matches_observing_each_record():
    rng = random.Random(7)
    m = MetricsRecorder()
    registry = CollectorRegistry(auto_describe=False)
    latency = Histogram("batchscope_request_latency_seconds", "x", ["model", "outcome", "priority"],
                        buckets=metrics_mod._SECONDS_BUCKETS, registry=registry)
    sizes = Histogram("batchscope_batch_size", "x", ["model"], buckets=metrics_mod._BATCH_BUCKETS,
                      registry=registry)
    edges = list(metrics_mod._SECONDS_BUCKETS)
    for i in range(3000):
        # exact bucket edges included: a value equal to an upper bound belongs to that bucket
        lat = rng.choice(edges) if i % 5 == 0 else rng.uniform(0.0, 40.0) ** 2 / 100
        outcome = rng.choice(["ok", "ok", "rejected", "expired"])
        prio = rng.randrange(3)
        m.put(request("mlp", outcome, priority=prio, latency_s=lat))
        latency.labels("mlp", outcome, str(prio + 1)).observe(lat)  # labelled as clients count
        if i % 7 == 0:
            size = rng.choice([1, 2, 3, 32, 64, 5000])
            m.put(batch("mlp", size, 0.001))
            sizes.labels("mlp").observe(size)
    got = samples(m)
    want = {}
    for family in registry.collect():
        for s in family.samples:
            if not s.name.endswith("_created"):
                want[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert want and all(abs(got[k] - v) < 1e-9 * max(1.0, abs(v)) for k, v in want.items()), \
        [(k, got.get(k), v) for k, v in want.items() if abs(got.get(k, -1) - v) > 1e-9]
    # a second scrape with nothing new pending changes nothing
    assert samples(m) == got


def test_pending_records_fold_on_their_own_past_the_limit(monkeypatch):
    monkeypatch.setattr(metrics_mod, "FOLD_EVERY", 10)
    m = MetricsRecorder()
    for _ in range(25):
        m.put(request("mlp", "ok"))
    assert len(m._pending) == 5
    assert samples(m)[("batchscope_requests_total", (("model", "mlp"), ("outcome", "ok")))] == 25
