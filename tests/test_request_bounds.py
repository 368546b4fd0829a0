"""Work a request declares is bounded before anything is allocated, on every route.

The codec tests measure allocation with ``tracemalloc`` (a declared batch of 2**32
empty items must cost nothing before it is refused); the server tests send the same
requests to a real server (HTTP, gRPC, OpenAI routes) and check the memory budget
is given back once every request is answered.
"""

from __future__ import annotations

import socket
import tracemalloc

import grpc
import httpx
import numpy as np
import orjson
import pytest

from runtime.api.config import BatchingConfig, ServerConfig
from runtime.api.errors import (BatchScopeError, ClientError, InsufficientMemory,
                                RequestTooLarge, ValidationError, error_answer)
from runtime.models.decoder import TinyDecoder
from runtime.models.encoder import EncoderModel
from runtime.models.mlp import MLPModel
from runtime.server.bounds import (ITEM_BYTES, MAX_JSON_BYTES, MemoryBudget, RequestBounds)
from runtime.server.grpc.protocol import message
from runtime.server.grpc.tensors import MAX_CONTENTS_VALUES, decode_request
from runtime.server.http1 import MAX_HEADERS
from runtime.server.kserve import parse_infer
from runtime.server.service import Service, ServiceThread
from tests.factories import wait_until

ENCODER = EncoderModel()
ENCODER_BOUNDS = RequestBounds.of(1024, ENCODER.max_length)

#: the request of the report: 85 bytes declaring 2**32 items of length zero
ATTACK = (b'{"inputs":[{"name":"INPUT_IDS","shape":[4294967296,0],"datatype":"INT64",'
          b'"data":[]}]}')


def parse(body: bytes, bounds: RequestBounds = ENCODER_BOUNDS, budget=None, header=None):
    return parse_infer(body, header, "encoder", ENCODER.inputs, ENCODER.outputs, 3,
                       bounds=bounds, budget=budget)


def encoder_body(shape, data=(), binary: bytes | None = None) -> tuple[bytes, str | None]:
    tensor = {"name": "INPUT_IDS", "shape": shape, "datatype": "INT64"}
    if binary is None:
        tensor["data"] = list(data)
        return orjson.dumps({"inputs": [tensor]}), None
    tensor["parameters"] = {"binary_data_size": len(binary)}
    head = orjson.dumps({"inputs": [tensor]})
    return head + binary, str(len(head))


@pytest.mark.parametrize("shape, error, fragment", [
    ([4294967296, 0], ClientError, "describes more elements"),
    ([65536, 0], ValidationError, "holds 65536 items; send 1 to 1024"),
    ([1025, 0], ValidationError, "holds 1025 items; send 1 to 1024"),
    ([2, 0, 5], ClientError, "must have shape [-1], or [k, -1]"),
    ([1, 129], ValidationError, "at most 128 (max_length)"),
    ([10**6], ValidationError, "at most 128 (max_length)"),
])
def test_a_declared_shape_past_a_bound_is_refused_before_anything_is_allocated(shape, error,
                                                                               fragment):
    body, header = encoder_body(shape, binary=b"" if 0 in shape else None)
    tracemalloc.start()
    try:
        with pytest.raises(error) as info:
            parse(body, header=header)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert fragment in info.value.message
    assert peak < 256 * 1024, f"{peak} bytes allocated before the refusal"


def test_the_reported_request_is_refused_in_constant_memory():
    assert len(ATTACK) == 85
    tracemalloc.start()
    try:
        with pytest.raises(BatchScopeError) as info:
            parse(ATTACK)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert 400 <= info.value.http_status < 500 and peak < 64 * 1024


def test_json_over_the_cap_is_refused_unparsed_and_binary_is_not_capped():
    body = b'{"inputs": [' + b" " * MAX_JSON_BYTES + b"]}"
    with pytest.raises(RequestTooLarge, match="binary tensor extension"):
        parse(body)
    ids = np.arange(1, 101, dtype=np.int64)
    req = parse(*encoder_body([100], binary=ids.tobytes())[:1],
                header=encoder_body([100], binary=ids.tobytes())[1])
    assert req.inputs["INPUT_IDS"].tolist() == ids.tolist()


def test_a_request_reserves_what_its_arrays_hold_and_gives_it_back():
    budget = MemoryBudget(per_request_bytes=1 << 20, total_bytes=2 << 20)
    body, header = encoder_body([8, 16], binary=np.ones(128, np.int64).tobytes())
    req = parse(body, budget=budget, header=header)
    assert budget.held_bytes == 128 * 8 + 8 * ITEM_BYTES == req.reservation.nbytes
    req.release()
    req.release()  # a second release changes nothing
    assert budget.held_bytes == 0 and budget.peak_bytes == 128 * 8 + 8 * ITEM_BYTES


def test_one_request_over_its_share_is_413_and_a_full_budget_is_507_with_retry_after():
    budget = MemoryBudget(per_request_bytes=4000, total_bytes=4000)
    small = encoder_body([2, 64], binary=np.ones(128, np.int64).tobytes())
    with pytest.raises(RequestTooLarge, match="more than the 4000 bytes one request may"):
        parse(encoder_body([4, 128], binary=np.ones(512, np.int64).tobytes())[0],
              budget=budget, header=str(len(orjson.dumps({"inputs": [
                  {"name": "INPUT_IDS", "shape": [4, 128], "datatype": "INT64",
                   "parameters": {"binary_data_size": 4096}}]}))))
    held = parse(small[0], budget=budget, header=small[1])
    with pytest.raises(InsufficientMemory) as info:
        parse(small[0], budget=budget, header=small[1])
    status, headers, _ = error_answer(info.value, "test")
    assert status == 507 and (b"retry-after", b"1") in headers
    assert budget.refused_too_large == 1 and budget.refused_full == 1
    held.release()
    parse(small[0], budget=budget, header=small[1]).release()
    assert budget.held_bytes == 0


def test_a_request_failing_after_its_reservation_gives_it_back():
    budget = MemoryBudget()
    body = orjson.dumps({"inputs": [{"name": "INPUT_IDS", "shape": [3], "datatype": "INT64",
                                     "data": [1, 2, 3]}], "outputs": [{"name": "NOPE"}]})
    with pytest.raises(ClientError, match="unknown output"):
        parse(body, budget=budget)
    assert budget.held_bytes == 0


def grpc_request(shape, **contents):
    request = message("ModelInferRequest")(model_name="encoder")
    tensor = request.inputs.add(name="INPUT_IDS", datatype="INT64")
    tensor.shape.extend(shape)
    for field, values in contents.items():
        getattr(tensor.contents, field).extend(values)
    return request


def test_grpc_checks_the_same_bounds_before_reading_contents():
    def decode(request, budget=None):
        return decode_request(request, "encoder", ENCODER.inputs, ENCODER.outputs, 3,
                              ENCODER_BOUNDS, budget)

    with pytest.raises(ClientError, match="describes more elements"):
        decode(grpc_request([2**32, 0]))
    with pytest.raises(ValidationError, match="holds 2000 items; send 1 to 1024"):
        decode(grpc_request([2000, 0]))
    with pytest.raises(RequestTooLarge, match="raw_input_contents"):
        decode_request(grpc_request([MAX_CONTENTS_VALUES + 1]), "encoder", ENCODER.inputs,
                       ENCODER.outputs, 3, RequestBounds(1024, None))
    budget = MemoryBudget()
    req = decode(grpc_request([2, 3], int64_contents=[1, 2, 3, 4, 5, 6]), budget)
    assert budget.held_bytes > 0 and len(req.items) == 2
    req.release()
    assert budget.held_bytes == 0


# -- the real server ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    service = Service({"mlp": MLPModel(), "encoder": EncoderModel()},
                      {"encoder": BatchingConfig(max_queue_size=64)},
                      ServerConfig(record=False, grpc_port=0),
                      generation={"decoder": TinyDecoder(d_model=32, n_layers=1)},
                      instance_id="bounds-test")
    with ServiceThread(service) as runner, httpx.Client(base_url=runner.url, timeout=30) as http:
        yield service, http


def error_of(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"] if "error" in response.json() else str(response.json())


def test_the_server_refuses_the_reported_request_and_keeps_serving(served):
    service, http = served
    r = http.post("/v2/models/encoder/infer", content=ATTACK)
    assert "describes more elements" in error_of(r, 400)
    r = http.post("/v2/models/encoder/infer",
                  content=encoder_body([65, 0])[0])  # max_queue_size=64 bounds the items
    assert "holds 65 items; send 1 to 64" in error_of(r, 422)
    ok = http.post("/v2/models/encoder/infer", content=encoder_body([2, 3], range(1, 7))[0])
    assert ok.status_code == 200 and ok.json()["outputs"][0]["shape"][0] == 2
    budget = service.app.state.budget
    assert wait_until(lambda: budget.held_bytes == 0), "the budget was not given back"
    assert budget.peak_bytes > 0


def test_grpc_refuses_a_huge_declared_batch(served):
    service, _ = served
    with grpc.insecure_channel(f"127.0.0.1:{service.grpc_port}") as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            call(grpc_request([100, 0]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "holds 100 items; send 1 to 64" in info.value.details()


def test_openai_routes_bound_choices_inputs_and_text(served):
    _, http = served
    r = http.post("/v1/completions", json={"model": "decoder", "prompt": ["a"] * 200, "n": 2,
                                           "max_tokens": 1})
    assert "ask for 400 choices; at most 256" in error_of(r, 400)["message"]
    r = http.post("/v1/completions", json={"model": "decoder", "prompt": "x" * 200_000,
                                           "max_tokens": 1})
    assert "characters, more than" in error_of(r, 413)["message"]
    r = http.post("/v1/embeddings", json={"model": "encoder", "input": ["ab"] * 65})
    assert "input has 65 items; at most 64" in error_of(r, 400)["message"]
    r = http.post("/v1/embeddings", json={"model": "encoder", "input": "x" * 60_000})
    assert "send at most 50000 per input" in error_of(r, 413)["message"]
    r = http.post("/v1/embeddings", content=b'{"input": "' + b"x" * MAX_JSON_BYTES + b'"}')
    assert "bytes this server parses per request" in error_of(r, 413)["message"]
    ok = http.post("/v1/embeddings", json={"model": "encoder", "input": ["ab", "cd"]})
    assert ok.status_code == 200 and len(ok.json()["data"]) == 2


def test_too_many_or_too_large_headers_are_431(served):
    service, _ = served
    host, port = service.url.removeprefix("http://").split(":")
    for headers in ([f"x-h{i}: v" for i in range(MAX_HEADERS + 1)], ["x-big: " + "v" * 70_000]):
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(("GET /v2/health/live HTTP/1.1\r\nhost: x\r\n" + "\r\n".join(headers)
                          + "\r\n\r\n").encode())
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 431"), answer[:100]


def test_grpc_refuses_a_request_message_over_4_mib_unparsed(served):
    service, _ = served
    request = grpc_request([1])
    request.raw_input_contents.append(b"\0" * ((4 << 20) + 1))
    with grpc.insecure_channel(f"127.0.0.1:{service.grpc_port}",
                               options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        call = channel.unary_unary("/inference.GRPCInferenceService/ModelInfer",
                                   request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=lambda b: b)
        with pytest.raises(grpc.RpcError) as info:
            call(request, timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
