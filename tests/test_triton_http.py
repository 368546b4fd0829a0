"""Triton's HTTP clients, as they are, against the real server: client-side batches,
model configuration, the statistics extension, the repository index, compressed
request bodies and JSON errors on routes the server does not have.

One real ``Service`` (fast inference hook + Starlette routes on the HTTP/1 server) runs
on an ephemeral 127.0.0.1 port; ``tritonclient.http`` and ``tritonclient.http.aio``
talk to it unchanged. Counts are read as differences around the traffic a test sends
itself, one request after the other, so the batches it makes follow from the counts
alone (the items of one request are queued together, so they form one batch).
"""

from __future__ import annotations

import asyncio
import gzip
import zlib

import httpx
import numpy as np
import pytest
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from google.protobuf import json_format
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import InferenceServerException

from runtime.api.config import BatchingConfig, ServerConfig
from runtime.models.mlp import IN_FEATURES, OUT_FEATURES, MLPModel
from runtime.models.toys import DoubleModel, FailingModel
from runtime.server.bounds import MAX_JSON_BYTES
from runtime.server.kserve import MAX_DECODED_BYTES
from runtime.server.service import Service, ServiceThread

pytestmark = pytest.mark.slow

TIMEOUT_S = 30.0
CONFIGS = {
    "mlp": BatchingConfig(max_batch_size=16, max_queue_delay_ms=2.0,
                          preferred_batch_sizes=(4, 8), max_queue_size=64,
                          default_timeout_ms=5000.0),
    "double": BatchingConfig(max_batch_size=8),
    "failing": BatchingConfig(max_batch_size=8),
}


@pytest.fixture(scope="module")
def url():
    svc = Service({"mlp": MLPModel(), "double": DoubleModel(), "failing": FailingModel()},
                  CONFIGS, ServerConfig(record=False), instance_id="triton-http-test")
    runner = ServiceThread(svc)
    yield runner.start()
    runner.stop()


@pytest.fixture
def client(url):
    c = httpclient.InferenceServerClient(url.removeprefix("http://"),
                                         connection_timeout=TIMEOUT_S, network_timeout=TIMEOUT_S)
    yield c
    c.close()


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, IN_FEATURES)).astype(np.float32)


def infer_input(x: np.ndarray, binary: bool = True, name: str = "INPUT0"):
    inp = httpclient.InferInput(name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary)
    return inp


def stats_of(client, model: str) -> dict:
    [doc] = client.get_inference_statistics(model)["model_stats"]
    return doc


def batch_counts(doc: dict) -> dict[int, int]:
    return {b["batch_size"]: b["compute_infer"]["count"] for b in doc["batch_stats"]}


# -- a batch dimension -------------------------------------------------------------------
@pytest.mark.parametrize("binary", [True, False])
def test_a_client_side_batch_is_answered_as_one_stacked_response(client, url, binary):
    x = rows(4, seed=1)
    result = client.infer("mlp", [infer_input(x, binary)])
    batched = result.as_numpy("OUTPUT0")
    assert batched.shape == (4, OUT_FEATURES)
    singles = [client.infer("mlp", [infer_input(x[i:i + 1], binary)]).as_numpy("OUTPUT0")
               for i in range(4)]
    assert all(s.shape == (1, OUT_FEATURES) for s in singles)
    np.testing.assert_allclose(batched, np.concatenate(singles), rtol=1e-5, atol=1e-6)
    # the shape without a batch dimension works as before and is answered without one
    plain = httpx.post(f"{url}/v2/models/mlp/infer", json={"inputs": [
        {"name": "INPUT0", "shape": [IN_FEATURES], "datatype": "FP32",
         "data": x[2].tolist()}]}, timeout=TIMEOUT_S).json()["outputs"][0]
    assert plain["shape"] == [OUT_FEATURES]
    np.testing.assert_allclose(plain["data"], batched[2], rtol=1e-5, atol=1e-6)


def test_a_batch_past_the_queue_size_is_a_422_naming_the_limit(client):
    with pytest.raises(InferenceServerException) as info:
        client.infer("mlp", [infer_input(rows(65))])
    assert info.value.status() == "422"
    assert "holds 65 items; send 1 to 64" in info.value.message()


def test_a_failing_item_fails_the_whole_batch_once(client):
    x = np.ones((3, 4), dtype=np.float32)
    x[1, 0] = -1.0
    with pytest.raises(InferenceServerException) as info:
        client.infer("failing", [infer_input(x)])
    assert info.value.status() == "500"
    assert info.value.message().startswith("model 'failing' failed on this request")
    ok = client.infer("failing", [infer_input(np.ones((2, 4), np.float32))]).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(ok, np.full((2, 4), 2.0, np.float32))


def test_metadata_carries_the_batch_dimension(client):
    meta = client.get_model_metadata("mlp")
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32", "shape": [-1, IN_FEATURES]}]
    assert meta["outputs"] == [{"name": "OUTPUT0", "datatype": "FP32",
                                "shape": [-1, OUT_FEATURES]}]


# -- model configuration -------------------------------------------------------------------
def test_model_config_reports_the_live_batching_limits(client, url):
    config = client.get_model_config("mlp")
    json_format.ParseDict(config, model_config_pb2.ModelConfig())  # Triton's schema, exactly
    assert config["name"] == "mlp" and config["max_batch_size"] == 16
    assert config["input"][0]["dims"] == [IN_FEATURES]
    assert config["input"][0]["data_type"] == "TYPE_FP32"
    assert config["output"][0]["dims"] == [OUT_FEATURES]
    dyn = config["dynamic_batching"]
    assert dyn["preferred_batch_size"] == [4, 8]
    assert dyn["max_queue_delay_microseconds"] == 2000
    assert dyn["priority_levels"] == 3 and dyn["default_priority_level"] == 2
    assert dyn["default_queue_policy"]["max_queue_size"] == 64
    assert dyn["default_queue_policy"]["default_timeout_microseconds"] == 5_000_000
    assert config == client.get_model_config("mlp", model_version="1")

    changes = {"max_batch_size": 6, "max_queue_delay_ms": 0.5, "preferred_batch_sizes": [2]}
    r = httpx.patch(f"{url}/v2/models/failing/batching", json=changes, timeout=TIMEOUT_S)
    assert r.status_code == 200, r.text
    changed = client.get_model_config("failing")
    back = {key: CONFIGS["failing"].to_dict()[key] for key in changes}
    assert httpx.patch(f"{url}/v2/models/failing/batching", json=back,
                       timeout=TIMEOUT_S).status_code == 200
    assert changed["max_batch_size"] == 6
    assert changed["dynamic_batching"]["max_queue_delay_microseconds"] == 500
    assert changed["dynamic_batching"]["preferred_batch_size"] == [2]
    assert client.get_model_config("failing")["max_batch_size"] == 8
    with pytest.raises(InferenceServerException) as info:
        client.get_model_config("mlp", model_version="3")
    assert info.value.status() == "404" and "no version '3'" in info.value.message()


# -- statistics ------------------------------------------------------------------------------
def test_statistics_count_requests_and_batches_by_size(client):
    before = stats_of(client, "double")
    client.infer("double", [infer_input(np.ones((4, 4), np.float32))])
    for _ in range(2):
        client.infer("double", [infer_input(np.ones(4, np.float32)[None])])
    x = np.ones((1, 4), np.float32)
    x[0, 0] = -1.0
    with pytest.raises(InferenceServerException):
        client.infer("failing", [infer_input(x)])
    after = stats_of(client, "double")
    json_format.ParseDict({"model_stats": [after]}, service_pb2.ModelStatisticsResponse())

    assert after["name"] == "double" and after["version"] == "1"
    assert after["inference_count"] - before["inference_count"] == 6
    assert after["execution_count"] - before["execution_count"] == 3
    inf, was = after["inference_stats"], before["inference_stats"]
    for key in ("success", "queue", "compute_infer"):
        assert inf[key]["count"] - was[key]["count"] == 6, key
        assert inf[key]["ns"] > was[key]["ns"], key
    assert inf["fail"] == was["fail"]
    assert inf["success"]["ns"] - was["success"]["ns"] >= inf["queue"]["ns"] - was["queue"]["ns"]
    grown = {size: n - batch_counts(before).get(size, 0)
             for size, n in batch_counts(after).items()}
    assert {size: n for size, n in grown.items() if n} == {4: 1, 1: 2}
    assert after["last_inference"] >= before["last_inference"]
    assert after["last_inference"] > 1_600_000_000_000  # milliseconds since the epoch

    failing = stats_of(client, "failing")
    assert failing["inference_stats"]["fail"]["count"] >= 1
    assert failing["inference_stats"]["fail"]["ns"] > 0


def test_statistics_of_every_model_and_by_version(client):
    every = client.get_inference_statistics()
    json_format.ParseDict(every, service_pb2.ModelStatisticsResponse())
    assert [m["name"] for m in every["model_stats"]] == ["mlp", "double", "failing"]
    assert client.get_inference_statistics("mlp", "1")["model_stats"][0]["name"] == "mlp"
    with pytest.raises(InferenceServerException) as info:
        client.get_inference_statistics("nope")
    assert info.value.status() == "404" and "unknown model 'nope'" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.get_inference_statistics("mlp", "2")
    assert info.value.status() == "404"


def test_batchscope_stats_stay_under_batching(url):
    doc = httpx.get(f"{url}/v2/models/mlp/batching/stats", timeout=TIMEOUT_S).json()
    assert doc["model"] == "mlp" and doc["kind"] == "request" and "queue_depth" in doc


# -- repository index ------------------------------------------------------------------------
def test_repository_index_lists_every_model_ready(client, url):
    index = client.get_model_repository_index()
    json_format.ParseDict({"models": index}, service_pb2.RepositoryIndexResponse())
    assert index == [{"name": n, "version": "1", "state": "READY", "reason": ""}
                     for n in ("mlp", "double", "failing")]
    r = httpx.post(f"{url}/v2/repository/index", json={"ready": True}, timeout=TIMEOUT_S)
    assert r.json() == index
    r = httpx.post(f"{url}/v2/repository/index", json={"ready": "yes"}, timeout=TIMEOUT_S)
    assert r.status_code == 400 and '{"ready": true}' in r.json()["error"]


# -- compressed request bodies -----------------------------------------------------------------
@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("binary", [True, False])
def test_compressed_requests_are_answered_as_plain_ones(client, algorithm, binary):
    x = rows(3, seed=2)
    plain = client.infer("mlp", [infer_input(x, binary)]).as_numpy("OUTPUT0")
    packed = client.infer("mlp", [infer_input(x, binary)],
                          request_compression_algorithm=algorithm).as_numpy("OUTPUT0")
    np.testing.assert_array_equal(packed, plain)


def test_raw_deflate_and_bad_compressed_bodies(url):
    body = (b'{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", '
            b'"data": [1, 2, 3, 4]}]}')
    raw = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    deflated = raw.compress(body) + raw.flush()
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as http:
        r = http.post("/v2/models/double/infer", content=deflated,
                      headers={"Content-Encoding": "deflate"})
        assert r.status_code == 200 and r.json()["outputs"][0]["data"] == [2, 4, 6, 8]
        r = http.post("/v2/models/double/infer", content=gzip.compress(body)[:-12],
                      headers={"Content-Encoding": "gzip"})
        assert r.status_code == 400 and "ends before its compressed stream" in r.json()["error"]
        r = http.post("/v2/models/double/infer", content=body, headers={"Content-Encoding": "gzip"})
        assert r.status_code == 400 and "not valid gzip data" in r.json()["error"]
        r = http.post("/v2/models/double/infer", content=body, headers={"Content-Encoding": "br"})
        assert r.status_code == 415 and "'br' is not supported" in r.json()["error"]


def test_a_body_inflating_past_the_limit_is_a_413(url):
    """A JSON-only body stops inflating at the JSON cap; one with binary tensors after its
    JSON header at the decoded-body cap."""
    bomb = gzip.compress(b" " * (MAX_DECODED_BYTES + 1), compresslevel=9)
    assert len(bomb) < MAX_DECODED_BYTES // 100
    r = httpx.post(f"{url}/v2/models/double/infer", content=bomb,
                   headers={"Content-Encoding": "gzip"}, timeout=TIMEOUT_S)
    assert r.status_code == 413
    assert f"more than this server accepts ({MAX_JSON_BYTES} bytes)" in r.json()["error"]
    r = httpx.post(f"{url}/v2/models/double/infer", content=bomb, timeout=TIMEOUT_S,
                   headers={"Content-Encoding": "gzip", "Inference-Header-Content-Length": "2"})
    assert r.status_code == 413
    assert f"more than this server accepts ({MAX_DECODED_BYTES} bytes)" in r.json()["error"]


# -- errors ------------------------------------------------------------------------------------
def test_routes_the_server_lacks_answer_json_that_tritonclient_reads(client):
    with pytest.raises(InferenceServerException) as info:
        client.get_log_settings()
    assert info.value.status() == "404"
    assert info.value.message().startswith("no route for GET /v2/logging")
    with pytest.raises(InferenceServerException) as info:
        client.load_model("mlp")
    assert info.value.status() == "404"
    assert info.value.message().startswith("no route for POST /v2/repository/models/mlp/load")


def test_wrong_methods_on_the_new_routes_are_json_405s(url):
    with httpx.Client(base_url=url, timeout=TIMEOUT_S) as http:
        for method, path, allow in (("POST", "/v2/models/stats", "GET, HEAD"),
                                    ("GET", "/v2/repository/index", "POST"),
                                    ("DELETE", "/v2/models/mlp/config", "GET, HEAD"),
                                    ("PUT", "/v2/models/mlp/versions/1/stats", "GET, HEAD")):
            r = http.request(method, path)
            assert r.status_code == 405 and r.headers["allow"] == allow, (method, path)
            assert r.json()["error"].startswith(f"{method} is not accepted on {path}")


# -- the asyncio client ---------------------------------------------------------------------------
def test_the_aio_client_batches_reads_config_and_statistics(url):
    async def main() -> None:
        client = aioclient.InferenceServerClient(url.removeprefix("http://"),
                                                 conn_timeout=TIMEOUT_S)
        try:
            x = rows(4, seed=3)
            inp = aioclient.InferInput("INPUT0", [4, IN_FEATURES], "FP32")
            inp.set_data_from_numpy(x)
            before = (await client.get_inference_statistics("mlp"))["model_stats"][0]
            batched = (await client.infer("mlp", [inp])).as_numpy("OUTPUT0")
            packed = (await client.infer("mlp", [inp], request_compression_algorithm="gzip")
                      ).as_numpy("OUTPUT0")
            singles = []
            for i in range(4):
                one = aioclient.InferInput("INPUT0", [1, IN_FEATURES], "FP32")
                one.set_data_from_numpy(x[i:i + 1])
                singles.append((await client.infer("mlp", [one])).as_numpy("OUTPUT0"))
            config = await client.get_model_config("mlp")
            after = (await client.get_inference_statistics("mlp"))["model_stats"][0]
            every = await client.get_inference_statistics()
            with pytest.raises(InferenceServerException) as info:
                await client.get_model_config("nope")
        finally:
            await client.close()
        assert batched.shape == (4, OUT_FEATURES)
        np.testing.assert_allclose(batched, np.concatenate(singles), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(packed, batched)
        assert config["max_batch_size"] == 16 and config["input"][0]["dims"] == [IN_FEATURES]
        assert after["inference_count"] - before["inference_count"] == 12
        grown = batch_counts(after).get(4, 0) - batch_counts(before).get(4, 0)
        assert grown == 2  # the two batched requests, each one batch of 4
        assert [m["name"] for m in every["model_stats"]] == ["mlp", "double", "failing"]
        assert info.value.status() == "404" and "unknown model 'nope'" in info.value.message()

    asyncio.run(asyncio.wait_for(main(), 60))
