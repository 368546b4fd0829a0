"""``tritonclient.grpc`` (sync and aio), as it is, against the gRPC server beside a real
HTTP service: the same engine answers both, so gRPC answers are compared with the HTTP
ones for the same input, and gRPC requests batch with HTTP requests.

One real ``Service`` runs on its own thread and event loop (``ServiceThread``, on
127.0.0.1); ``GrpcServer``s are started on that same loop, next to it. Batching and
queueing outcomes are made deterministic by holding a batch inside ``predict``
(``DoubleModel.hold``) while a test queues requests behind it and waits, bounded, for
the queue depth it needs; nothing depends on timing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as aioclient
import tritonclient.http as httpclient
from google.protobuf import json_format
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from runtime.api.config import BatchingConfig, ServerConfig
from runtime.api.errors import ConfigError
from runtime.api.model import ModelAPI, TensorSpec
from runtime.models.encoder import EncoderModel
from runtime.models.mlp import IN_FEATURES, OUT_FEATURES, MLPModel
from runtime.models.toys import DoubleModel
from runtime.server.grpc import GrpcServer
from runtime.server.service import Service, ServiceThread
from tests.factories import wait_until

pytestmark = pytest.mark.slow

TIMEOUT_S = 30.0
CONFIGS = {
    "mlp": BatchingConfig(max_batch_size=16, max_queue_size=64),
    "encoder": BatchingConfig(max_batch_size=8),
    "held": BatchingConfig(max_batch_size=8, max_queue_size=256, priority_levels=3),
    "tiny": BatchingConfig(max_batch_size=1, max_queue_size=2),
    "text": BatchingConfig(max_batch_size=4),
}


class TextModel(ModelAPI):
    """BYTES in, BYTES and INT64 out: each text upper-cased, and its length."""

    name = "text"
    inputs = (TensorSpec("TEXT", "BYTES", (1,)),)
    outputs = (TensorSpec("UPPER", "BYTES", (1,)), TensorSpec("LENGTH", "INT64", (1,)))

    def decode(self, inputs: dict[str, np.ndarray]) -> bytes:
        return bytes(inputs["TEXT"].reshape(-1)[0])

    def collate(self, items: list[bytes], pad_to: int | None) -> list[bytes]:
        return items

    def predict(self, batch: list[bytes]) -> list[bytes]:
        return batch

    def split(self, output: list[bytes], n: int) -> list[dict[str, np.ndarray]]:
        return [{"UPPER": np.array([t.upper()], dtype=object),
                 "LENGTH": np.array([len(t)], dtype=np.int64)} for t in output]


class Served:
    """The HTTP service on its thread, and gRPC servers on its event loop."""

    def __init__(self) -> None:
        self.held = DoubleModel()
        self.tiny = DoubleModel()
        models = {"mlp": MLPModel(), "encoder": EncoderModel(), "held": self.held,
                  "tiny": self.tiny, "text": TextModel()}
        loops: list[asyncio.AbstractEventLoop] = []
        self.service = Service(models, CONFIGS, ServerConfig(record=False),
                               instance_id="grpc-test",
                               on_started=lambda _: loops.append(asyncio.get_running_loop()))
        self.runner = ServiceThread(self.service)
        self.url = self.runner.start()
        self.loop = loops[0]
        self.servers: list[GrpcServer] = []
        self.address = self.add_server()[1]

    def on_loop(self, coro: Any, timeout_s: float = TIMEOUT_S) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def add_server(self, **options: Any) -> tuple[GrpcServer, str]:
        server = GrpcServer(self.service.engine, version="test", **options)
        port = self.on_loop(server.start("127.0.0.1", 0))
        self.servers.append(server)
        return server, f"127.0.0.1:{port}"

    def stats(self, model: str) -> dict:
        async def read() -> dict:
            return self.service.engine.stats(model)
        return self.on_loop(read())

    def close(self) -> None:
        for server in self.servers:
            self.on_loop(server.stop(1.0))
        self.runner.stop()


@pytest.fixture(scope="module")
def served():
    s = Served()
    yield s
    s.close()


@pytest.fixture
def client(served):
    c = grpcclient.InferenceServerClient(served.address)
    yield c
    c.close()


@pytest.fixture
def http(served):
    c = httpclient.InferenceServerClient(served.url.removeprefix("http://"),
                                         connection_timeout=TIMEOUT_S, network_timeout=TIMEOUT_S)
    yield c
    c.close()


def grpc_input(x: np.ndarray, datatype: str = "FP32", name: str = "INPUT0"):
    inp = grpcclient.InferInput(name, list(x.shape), datatype)
    inp.set_data_from_numpy(x)
    return inp


def http_input(x: np.ndarray, datatype: str = "FP32", name: str = "INPUT0"):
    inp = httpclient.InferInput(name, list(x.shape), datatype)
    inp.set_data_from_numpy(x, binary_data=True)
    return inp


def rows(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, IN_FEATURES)).astype(np.float32)


def http_error(served, model: str, body: dict) -> str:
    answer = httpx.post(f"{served.url}/v2/models/{model}/infer", json=body, timeout=TIMEOUT_S)
    assert answer.status_code >= 400
    return answer.json()["error"]


def http_infer(served, model: str, x: np.ndarray) -> list[float]:
    """One request over plain HTTP (safe from any thread); the output's values."""
    body = {"inputs": [{"name": "INPUT0", "shape": list(x.shape), "datatype": "FP32",
                        "data": x.reshape(-1).tolist()}]}
    answer = httpx.post(f"{served.url}/v2/models/{model}/infer", json=body, timeout=TIMEOUT_S)
    answer.raise_for_status()
    return answer.json()["outputs"][0]["data"]


@contextlib.contextmanager
def holding(model: DoubleModel):
    """Hold the next batch of ``model`` inside predict until the block ends."""
    gate = threading.Event()
    model.entered.clear()
    model.hold = gate
    try:
        yield gate
    finally:
        model.hold = None
        gate.set()


class Answers:
    """Callbacks of ``async_infer`` / a stream, collected from the client's threads."""

    def __init__(self) -> None:
        self.items: queue.Queue = queue.Queue()

    def __call__(self, result, error) -> None:
        self.items.put((result, error))

    def take(self, n: int) -> list[tuple[Any, Any]]:
        return [self.items.get(timeout=TIMEOUT_S) for _ in range(n)]


def vec(v: float) -> np.ndarray:
    return np.full((1, 4), v, dtype=np.float32)


def start_held(served, client, answers: Answers) -> None:
    """One request to ``held`` that is now running (inside predict); later ones queue."""
    client.async_infer("held", [grpc_input(vec(-1.0))], answers)
    assert served.held.entered.wait(TIMEOUT_S)


def queued(served, model: str, n: int) -> bool:
    return wait_until(lambda: served.stats(model)["queue_depth"] == n)


# -- health and metadata -------------------------------------------------------------------
def test_health_and_server_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("mlp")
    assert client.is_model_ready("mlp", "1")
    assert not client.is_model_ready("mlp", "2")
    assert not client.is_model_ready("nope")
    meta = client.get_server_metadata(as_json=True)
    assert meta["name"] == "batchscope" and meta["version"] == "test"
    assert "statistics" in meta["extensions"] and "model_configuration" in meta["extensions"]


def test_model_metadata_is_the_http_metadata(client, http):
    meta = client.get_model_metadata("mlp", as_json=True)
    assert meta["inputs"] == [{"name": "INPUT0", "datatype": "FP32",
                               "shape": ["-1", str(IN_FEATURES)]}]
    via_http = json_format.ParseDict(http.get_model_metadata("mlp"),
                                     service_pb2.ModelMetadataResponse())
    assert client.get_model_metadata("mlp") == via_http


# -- inference -------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 5])
def test_infer_on_mlp_equals_the_http_answer(client, http, n):
    x = rows(n, seed=n)
    result = client.infer("mlp", [grpc_input(x)], request_id=f"r{n}")
    out = result.as_numpy("OUTPUT0")
    assert out.shape == (n, OUT_FEATURES) and result.get_response().id == f"r{n}"
    via_http = http.infer("mlp", [http_input(x)]).as_numpy("OUTPUT0")
    np.testing.assert_allclose(out, via_http, rtol=1e-6, atol=1e-7)
    # the shape without a batch dimension is answered without one
    plain = client.infer("mlp", [grpc_input(x[0])]).as_numpy("OUTPUT0")
    assert plain.shape == (OUT_FEATURES,)
    np.testing.assert_allclose(plain, via_http[0], rtol=1e-5, atol=1e-6)


def test_int64_tokens_on_encoder_equal_the_http_answer(client, http):
    ids = np.arange(1, 25, dtype=np.int64).reshape(2, 12)
    out = client.infer("encoder", [grpc_input(ids, "INT64", "INPUT_IDS")]).as_numpy("EMBEDDING")
    via_http = http.infer("encoder", [http_input(ids, "INT64", "INPUT_IDS")]).as_numpy("EMBEDDING")
    assert out.shape == (2, 256)
    np.testing.assert_allclose(out, via_http, rtol=1e-5, atol=1e-6)


def test_bytes_in_and_out(client):
    texts = np.array([[b"hello"], [b"gRPC \xc3\xa9"]], dtype=object)
    result = client.infer("text", [grpc_input(texts, "BYTES", "TEXT")])
    assert result.as_numpy("UPPER").tolist() == [[b"HELLO"], [b"GRPC \xc3\xa9"]]
    assert result.as_numpy("LENGTH").tolist() == [[5], [7]]
    only = client.infer("text", [grpc_input(texts[:1], "BYTES", "TEXT")],
                        outputs=[grpcclient.InferRequestedOutput("LENGTH")])
    assert only.as_numpy("UPPER") is None and only.as_numpy("LENGTH").tolist() == [[5]]


def test_typed_contents_from_a_plain_grpc_stub(served):
    """A client that sends ``contents`` (KServe's typed fields) instead of raw bytes."""
    x = rows(2, seed=7)
    request = service_pb2.ModelInferRequest(model_name="mlp")
    t = request.inputs.add(name="INPUT0", datatype="FP32", shape=[2, IN_FEATURES])
    t.contents.fp32_contents.extend(x.reshape(-1).tolist())
    with grpc.insecure_channel(served.address) as channel:
        response = service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
            request, timeout=TIMEOUT_S)
    got = np.frombuffer(response.raw_output_contents[0], np.float32).reshape(2, OUT_FEATURES)
    with torch.inference_mode():
        want = served.service.engine.model("mlp").net(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert list(response.outputs[0].shape) == [2, OUT_FEATURES]


def test_bytes_that_are_no_request_message_are_invalid_argument(served, caplog):
    """Not a ModelInferRequest: INVALID_ARGUMENT saying so (not gRPC's UNKNOWN and a
    traceback in the log); in a stream, that request's error, the others answered."""
    def raw_bytes(message):
        return message if isinstance(message, bytes) else message.SerializeToString()

    good = service_pb2.ModelInferRequest(model_name="mlp")
    good.inputs.add(name="INPUT0", datatype="FP32", shape=[1, IN_FEATURES])
    good.raw_input_contents.append(rows(1).tobytes())
    with grpc.insecure_channel(served.address) as channel:
        infer = channel.unary_unary(
            "/inference.GRPCInferenceService/ModelInfer", request_serializer=raw_bytes,
            response_deserializer=service_pb2.ModelInferResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            infer(b"\xff\xff\xff", timeout=TIMEOUT_S)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid inference.ModelInferRequest" in info.value.details()
        stream = channel.stream_stream(
            "/inference.GRPCInferenceService/ModelStreamInfer", request_serializer=raw_bytes,
            response_deserializer=service_pb2.ModelStreamInferResponse.FromString)
        replies = list(stream(iter([good, b"\xff\xff\xff", good]), timeout=TIMEOUT_S))
    errors = sorted(r.error_message for r in replies)
    assert len(replies) == 3 and errors[:2] == ["", ""]
    assert "not a valid inference.ModelInferRequest" in errors[2]
    assert not [r for r in caplog.records if "Traceback" in r.getMessage()
                or r.levelno >= logging.ERROR]


def test_compressed_requests(client):
    x = rows(1, seed=3)
    plain = client.infer("mlp", [grpc_input(x)]).as_numpy("OUTPUT0")
    for algorithm in ("gzip", "deflate"):
        got = client.infer("mlp", [grpc_input(x)], compression_algorithm=algorithm)
        np.testing.assert_allclose(got.as_numpy("OUTPUT0"), plain, rtol=1e-5, atol=1e-6)


# -- errors ------------------------------------------------------------------------------------
def test_unknown_model_is_not_found_with_the_http_message(served, client):
    with pytest.raises(InferenceServerException) as info:
        client.infer("nope", [grpc_input(vec(1.0))])
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert info.value.message() == http_error(served, "nope", {"inputs": []})
    assert "served models are" in info.value.message()
    with pytest.raises(InferenceServerException) as info:
        client.get_model_metadata("mlp", "3")
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert "has no version '3'" in info.value.message()


def test_a_bad_shape_is_invalid_argument_with_the_http_message(served, client):
    x = np.ones((2, 7), np.float32)
    with pytest.raises(InferenceServerException) as info:
        client.infer("mlp", [grpc_input(x)])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    body = {"inputs": [{"name": "INPUT0", "shape": [2, 7], "datatype": "FP32",
                        "data": x.reshape(-1).tolist()}]}
    assert info.value.message() == http_error(served, "mlp", body)
    assert "must have shape [256], or [k, 256]" in info.value.message()


def test_an_out_of_range_priority_is_invalid_argument(client):
    with pytest.raises(InferenceServerException) as info:
        client.infer("held", [grpc_input(vec(1.0))], priority=9)
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert "priority 9 is out of range: send 1 (most urgent) to 3" in info.value.message()


def test_a_full_queue_is_resource_exhausted_with_retry_after(served, client):
    answers = Answers()
    with holding(served.tiny):
        client.async_infer("tiny", [grpc_input(vec(0.0))], answers)
        assert served.tiny.entered.wait(TIMEOUT_S)
        for v in (1.0, 2.0):
            client.async_infer("tiny", [grpc_input(vec(v))], answers)
        assert queued(served, "tiny", 2)
        with pytest.raises(InferenceServerException) as info:
            client.infer("tiny", [grpc_input(vec(3.0))])
        assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
        assert "max_queue_size=2" in info.value.message()
        with grpc.insecure_channel(served.address) as channel:
            request = service_pb2.ModelInferRequest(model_name="tiny")
            request.inputs.add(name="INPUT0", datatype="FP32", shape=[4]) \
                .contents.fp32_contents.extend([0, 0, 0, 0])
            with pytest.raises(grpc.RpcError) as raw:
                service_pb2_grpc.GRPCInferenceServiceStub(channel).ModelInfer(
                    request, timeout=TIMEOUT_S)
        assert raw.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert int(dict(raw.value.trailing_metadata())["retry-after"]) >= 1
    done = answers.take(3)
    assert all(error is None for _, error in done)
    assert sorted(float(r.as_numpy("OUTPUT0")[0, 0]) for r, _ in done) == [0.0, 2.0, 4.0]


def test_a_queue_timeout_is_deadline_exceeded(served, client):
    answers = Answers()
    with holding(served.held):
        start_held(served, client, answers)
        with pytest.raises(InferenceServerException) as info:
            client.infer("held", [grpc_input(vec(1.0))], timeout=20_000)  # 20 ms
    assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
    assert "past its timeout of 20 ms, and was not run" in info.value.message()
    [(_, error)] = answers.take(1)
    assert error is None


def test_a_call_past_its_grpc_deadline_leaves_the_queue(served, client):
    answers = Answers()
    before = served.stats("held")["requests_by_outcome"].get("cancelled", 0)
    with holding(served.held):
        start_held(served, client, answers)
        with pytest.raises(InferenceServerException) as info:
            client.infer("held", [grpc_input(vec(1.0))], client_timeout=0.3)
        assert info.value.status() == "StatusCode.DEADLINE_EXCEEDED"
        assert wait_until(lambda: served.stats("held")["requests_by_outcome"]
                          .get("cancelled", 0) == before + 1)
        assert served.stats("held")["queue_depth"] == 0
    answers.take(1)


def test_an_unimplemented_method_says_so(client):
    with pytest.raises(InferenceServerException) as info:
        client.get_cuda_shared_memory_status()
    assert info.value.status() == "StatusCode.UNIMPLEMENTED"
    assert "CudaSharedMemoryStatus is not supported by this server" in info.value.message()


# -- batching, priorities --------------------------------------------------------------------
def test_64_concurrent_grpc_requests_batch_with_http_ones(served, client):
    answers = Answers()
    before = served.stats("held")["batches"]
    http_results: list[Any] = []
    with holding(served.held):
        start_held(served, client, answers)
        for i in range(64):
            client.async_infer("held", [grpc_input(vec(float(i)))], answers)
        assert queued(served, "held", 64)
        threads = [threading.Thread(target=lambda v=v: http_results.append(http_infer(
            served, "held", vec(v)))) for v in (100, 101)]
        for t in threads:
            t.start()
        assert queued(served, "held", 66)
        served.held.batch_sizes.clear()
    done = answers.take(65)
    for t in threads:
        t.join(TIMEOUT_S)
    assert all(error is None for _, error in done)
    assert sorted(float(r.as_numpy("OUTPUT0")[0, 0]) for r, _ in done) == \
        sorted([-2.0] + [2.0 * i for i in range(64)])
    assert sorted(a[0] for a in http_results) == [200.0, 202.0]
    # the held batch of one, then the 66 queued requests in full batches of 8 (and 2)
    assert served.stats("held")["batches"] - before == 1 + 9
    assert sorted(served.held.batch_sizes) == [2] + [8] * 8


def test_priorities_from_request_parameters(served, client):
    """Nine requests at the lowest priority, then one at the most urgent: the urgent one
    runs in the first batch of 8, ahead of two that came before it."""
    answers = Answers()
    with holding(served.held):
        start_held(served, client, answers)
        for i in range(9):
            client.async_infer("held", [grpc_input(vec(float(i)))], answers, priority=3)
        assert queued(served, "held", 9)
        client.async_infer("held", [grpc_input(vec(100.0))], answers, priority=1)
        assert queued(served, "held", 10)
        served.held.batches.clear()
    assert all(error is None for _, error in answers.take(11))
    first, second = served.held.batches
    assert 100.0 in first and len(first) == 8
    assert sorted(second) == [7.0, 8.0]


# -- statistics, configuration, index ------------------------------------------------------
def test_statistics_are_the_http_statistics(client, http):
    client.infer("mlp", [grpc_input(rows(3))])
    for model in ("mlp", ""):
        ours = client.get_inference_statistics(model)
        via_http = json_format.ParseDict(http.get_inference_statistics(model),
                                         service_pb2.ModelStatisticsResponse())
        assert ours == via_http
    [mlp] = client.get_inference_statistics("mlp").model_stats
    assert mlp.inference_count >= 3 and any(b.batch_size == 3 for b in mlp.batch_stats)
    names = [m.name for m in client.get_inference_statistics().model_stats]
    assert names == ["mlp", "encoder", "held", "tiny", "text"]
    with pytest.raises(InferenceServerException) as info:
        client.get_inference_statistics("nope")
    assert info.value.status() == "StatusCode.NOT_FOUND"


def test_model_config_is_the_http_config(client, http):
    config = client.get_model_config("mlp").config
    assert config.max_batch_size == 16 and list(config.input[0].dims) == [IN_FEATURES]
    assert config.dynamic_batching.default_queue_policy.max_queue_size == 64
    via_http = json_format.ParseDict({"config": http.get_model_config("mlp")},
                                     service_pb2.ModelConfigResponse())
    assert client.get_model_config("mlp") == via_http


def test_repository_index(client):
    index = client.get_model_repository_index(as_json=True)["models"]
    assert [(m["name"], m["state"]) for m in index] == [
        (name, "READY") for name in ("mlp", "encoder", "held", "tiny", "text")]


# -- streams and the aio client ----------------------------------------------------------------
def test_a_stream_answers_each_request_and_reports_errors_in_line(served, client):
    answers = Answers()
    client.start_stream(answers)
    try:
        for i in range(6):
            client.async_stream_infer("mlp", [grpc_input(rows(1, seed=i))], request_id=str(i))
        client.async_stream_infer("nope", [grpc_input(rows(1))], request_id="bad")
        client.async_stream_infer("mlp", [grpc_input(rows(2, seed=9))], request_id="pair")
        done = answers.take(8)
    finally:
        client.stop_stream()
    errors = [e for _, e in done if e is not None]
    assert len(errors) == 1 and "unknown model 'nope'" in errors[0].message()
    results = {r.get_response().id: r.as_numpy("OUTPUT0") for r, e in done if e is None}
    assert sorted(results) == ["0", "1", "2", "3", "4", "5", "pair"]
    assert results["pair"].shape == (2, OUT_FEATURES)
    alone = client.infer("mlp", [grpc_input(rows(1, seed=4))]).as_numpy("OUTPUT0")
    np.testing.assert_allclose(results["4"], alone, rtol=1e-5, atol=1e-6)


def test_the_aio_client(served):
    async def main():
        async with aioclient.InferenceServerClient(served.address) as c:
            assert await c.is_server_live() and await c.is_model_ready("mlp")
            x = rows(4, seed=11)
            inp = aioclient.InferInput("INPUT0", [4, IN_FEATURES], "FP32")
            inp.set_data_from_numpy(x)
            outs = await asyncio.gather(*(c.infer("mlp", [inp]) for _ in range(8)))
            first = outs[0].as_numpy("OUTPUT0")
            for out in outs:
                # batched with different companions, float32 sums round differently
                np.testing.assert_allclose(out.as_numpy("OUTPUT0"), first, rtol=1e-5, atol=1e-6)

            async def requests():
                for i in range(3):
                    yield {"model_name": "mlp", "inputs": [inp], "request_id": str(i)}

            ids = []
            async for result, error in c.stream_infer(requests()):
                assert error is None
                ids.append(result.get_response().id)
                if len(ids) == 3:
                    break
            assert sorted(ids) == ["0", "1", "2"]
            return first

    first = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    assert first.shape == (4, OUT_FEATURES)


# -- the server's bounds and its stop --------------------------------------------------------
def test_a_message_over_the_limit_is_refused(served):
    _, address = served.add_server(max_message_bytes=4096)
    with grpcclient.InferenceServerClient(address) as c:
        assert c.infer("mlp", [grpc_input(rows(1))]).as_numpy("OUTPUT0").shape == (1, 10)
        with pytest.raises(InferenceServerException) as info:
            c.infer("mlp", [grpc_input(rows(8))])
    assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"


def test_calls_past_the_concurrency_bound_are_refused_at_once(served, client):
    _, address = served.add_server(max_concurrent_rpcs=1)
    answers = Answers()
    with grpcclient.InferenceServerClient(address) as bounded:
        with holding(served.held):
            bounded.async_infer("held", [grpc_input(vec(1.0))], answers)
            assert served.held.entered.wait(TIMEOUT_S)
            with pytest.raises(InferenceServerException) as info:
                bounded.is_server_live()
            assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
            assert client.is_server_live()  # the bound is per server
        [(result, error)] = answers.take(1)
        assert error is None, error
        assert bounded.is_server_live()  # the call is over: there is room again


def test_stop_lets_calls_in_flight_finish_and_refuses_new_ones(served):
    server, address = served.add_server()
    answers = Answers()
    with grpcclient.InferenceServerClient(address) as c, holding(served.held) as gate:
        c.async_infer("held", [grpc_input(vec(5.0))], answers)
        assert served.held.entered.wait(TIMEOUT_S)
        stopping = asyncio.run_coroutine_threadsafe(server.stop(TIMEOUT_S), served.loop)
        refusals: list[InferenceServerException] = []

        def refused() -> bool:
            try:
                c.is_server_ready(client_timeout=TIMEOUT_S)
            except InferenceServerException as exc:
                refusals.append(exc)
                return True
            return False

        assert wait_until(refused, limit=400)  # once stopping, new calls are refused
        assert refusals[0].status() == "StatusCode.UNAVAILABLE"
        assert "shutting down" in refusals[0].message()
        with pytest.raises(InferenceServerException) as info:
            c.infer("mlp", [grpc_input(rows(1))], client_timeout=TIMEOUT_S)
        assert info.value.status() == "StatusCode.UNAVAILABLE"
        assert c.is_server_live(client_timeout=TIMEOUT_S)  # alive until it exits
        assert not stopping.done()  # the call in flight holds the stop
        gate.set()
        [(result, error)] = answers.take(1)
        stopping.result(TIMEOUT_S)
    assert error is None and float(result.as_numpy("OUTPUT0")[0, 0]) == 10.0


def test_a_taken_port_is_an_error(served):
    taken = int(served.address.rsplit(":", 1)[1])
    with pytest.raises(OSError, match="could not listen"):
        served.on_loop(GrpcServer(served.service.engine).start("127.0.0.1", taken))


def test_a_generation_model_is_named_where_it_is_served(served):
    _, address = served.add_server(generation=["decoder"])
    with grpcclient.InferenceServerClient(address) as c:
        with pytest.raises(InferenceServerException) as info:
            c.infer("decoder", [grpc_input(vec(1.0))])
    assert info.value.status() == "StatusCode.NOT_FOUND"
    assert "generation model, served over HTTP at /v1/completions" in info.value.message()


@pytest.mark.parametrize("option", [{"max_concurrent_rpcs": 0}, {"max_message_bytes": -1}])
def test_bounds_must_be_positive(served, option):
    with pytest.raises(ConfigError, match="must be a positive integer"):
        GrpcServer(served.service.engine, **option)
