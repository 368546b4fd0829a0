"""Large request bodies are parsed on the parser thread, off the event loop, and
answered exactly as small ones (real server on 127.0.0.1)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from runtime.api.config import BatchingConfig, ServerConfig
from runtime.models.toys import DoubleModel
from runtime.server import fastpath
from runtime.server.service import Service, ServiceThread

pytestmark = pytest.mark.slow


@pytest.fixture
def url(monkeypatch):
    monkeypatch.setattr(fastpath, "LARGE_BODY_BYTES", 64)  # every request here is "large"
    svc = Service({"double": DoubleModel()}, {"double": BatchingConfig(max_batch_size=8)},
                  ServerConfig(record=False), instance_id="large-body-test")
    runner = ServiceThread(svc)
    yield runner.start()
    runner.stop()


def body(values, **extra) -> dict:
    return {"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32",
                        "data": list(values)}], **extra}


def test_large_bodies_are_parsed_aside_and_answered_like_small_ones(url, monkeypatch):
    threads = []
    real_pool = fastpath._parser_pool

    def counting_pool():
        pool = real_pool()
        threads.append(pool)
        return pool

    monkeypatch.setattr(fastpath, "_parser_pool", counting_pool)
    with httpx.Client(base_url=url, timeout=20.0) as client:
        ok = [client.post("/v2/models/double/infer", json=body([i, 1, 2, 3])) for i in range(10)]
        bad_shape = client.post("/v2/models/double/infer", json=body([1, 2, 3]))
        not_json = client.post("/v2/models/double/infer", content=b"{" * 100,
                               headers={"content-type": "application/json"})
        big = client.post("/v2/models/double/infer",
                          json=body([1, 2, 3, 4], id="x" * (2 << 20)))
    assert [r.status_code for r in ok] == [200] * 10
    for i, r in enumerate(ok):
        np.testing.assert_allclose(r.json()["outputs"][0]["data"], [2 * i, 2, 4, 6])
    assert bad_shape.status_code in (400, 422) and "error" in bad_shape.json()
    assert not_json.status_code == 400 and "error" in not_json.json()
    assert big.status_code == 200 and big.json()["outputs"][0]["data"] == [2, 4, 6, 8]
    assert len(threads) == 13  # every one of them went through the parser thread
